"""rankcast's CPU kernels against the plain-torch path of the same ops (the reference CUDA runs).

Each op is run twice on the same inputs, once through `torch.ops.rankcast` and once with the
kernels switched off, across the shapes that stress the kernels' edges: tails shorter than a
vector, block sizes other than sixteen, grouped-query ratios, and steps that mix decodes, chunks
after a cached prefix and whole prompts.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from rankcast import kernels
from rankcast.model import ops
from rankcast.model.linear_kernels import CpuFacts, choose_linear_path, cpu_family
from rankcast.model.rotary import RotaryEmbedding

DTYPES = [torch.float32, torch.bfloat16]
# (heads, KV heads, block size) of the decode paths' bit-identity tests: SmolLM2's, one KV head
# with blocks of 8, two with blocks of 32, one query row per KV head (whose 4 heads are items
# enough for two threads: a lone decode there keeps the tiles, the comparison still holds).
DECODE_GEOMETRIES = [(9, 3, 16), (6, 1, 8), (12, 2, 32), (4, 4, 16)]
CPU = torch.device("cpu")


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


def reference(monkeypatch: pytest.MonkeyPatch, fn, *args):
    """Run `fn` with the kernels switched off: the plain-torch path."""
    with monkeypatch.context() as patch:
        patch.setattr(kernels, "available", lambda tensor: False)
        return fn(*args)


def test_the_kernels_are_built_for_this_machine() -> None:
    assert kernels.load(), f"no kernel build at {kernels.library_path()}: run `make kernels`"
    assert kernels.available(torch.zeros(1, dtype=torch.bfloat16))
    assert not kernels.available(torch.zeros(1, dtype=torch.float16))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [576, 40])
def test_rms_norms_match_torch(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, width: int):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, width, generator=gen).to(dtype)
    residual = torch.randn(7, width, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(width, generator=gen)).to(dtype)
    torch.testing.assert_close(
        ops.rms_norm(x, weight, 1e-5),
        reference(monkeypatch, ops.rms_norm, x, weight, 1e-5),
        **tolerance(dtype),
    )
    want_out, want_sum = reference(monkeypatch, ops.add_rms_norm, x, residual.clone(), weight, 1e-5)
    got_out, got_sum = ops.add_rms_norm(x, residual.clone(), weight, 1e-5)
    torch.testing.assert_close(got_sum, want_sum, **tolerance(dtype))
    torch.testing.assert_close(got_out, want_out, **tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1536, 24])
def test_silu_and_mul_matches_torch(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, width: int
):
    x = (3 * torch.randn(5, 2 * width, generator=torch.Generator().manual_seed(1))).to(dtype)
    torch.testing.assert_close(
        ops.silu_and_mul(x), reference(monkeypatch, ops.silu_and_mul, x), **tolerance(dtype)
    )


@pytest.mark.parametrize("width", [1152, 40])
def test_a_float32_norm_weight_scales_bfloat16_rows_before_rounding(
    monkeypatch: pytest.MonkeyPatch, width: int
) -> None:
    """Gemma's norms: a float32 (1 + w) weight on bfloat16 rows scales the float32 normalised
    row and rounds once, as the reference does. Rounding first (Llama's order) changes about a
    third of the values by an ulp, so a kernel in the wrong order cannot pass; the two paths
    compute 1 / sqrt differently, which may move a rare value."""
    gen = torch.Generator().manual_seed(2)
    x = (3 * torch.randn(64, width, generator=gen)).to(torch.bfloat16)
    residual = torch.randn(64, width, generator=gen).to(torch.bfloat16)
    weight = 1 + 0.5 * torch.randn(width, generator=gen)

    def mismatched(got: torch.Tensor, want: torch.Tensor) -> float:
        assert got.dtype == torch.bfloat16
        return (got != want).float().mean().item()

    want = reference(monkeypatch, ops.rms_norm, x, weight, 1e-6)
    assert mismatched(ops.rms_norm(x, weight, 1e-6), want) < 1e-3
    want_out, want_sum = reference(monkeypatch, ops.add_rms_norm, x, residual.clone(), weight, 1e-6)
    got_out, got_sum = ops.add_rms_norm(x, residual.clone(), weight, 1e-6)
    assert torch.equal(got_sum, want_sum)
    assert mismatched(got_out, want_out) < 1e-3


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1152, 24])
def test_gelu_tanh_and_mul_matches_torch(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, width: int
) -> None:
    """Gemma's GeGLU against torch's tanh-approximated GELU, gates out to +-30 (where tanh
    saturates) included."""
    x = 3 * torch.randn(5, 2 * width, generator=torch.Generator().manual_seed(3))
    x[0, :4] = torch.tensor([30.0, -30.0, 12.0, -12.0])
    x = x.to(dtype)
    torch.testing.assert_close(
        ops.gelu_tanh_and_mul(x),
        reference(monkeypatch, ops.gelu_tanh_and_mul, x),
        **tolerance(dtype),
    )


def _packed_or_skip(weight: torch.Tensor, kernel: str | None = None) -> ops.PackedWeight:
    """The weight packed for `kernel`, by default the path chosen for its dtype here
    (`choose_linear_path`); skipped only where that path is plain `F.linear` (bfloat16 on a CPU
    where neither rankcast's kernel nor oneDNN packs it)."""
    if kernel is None:
        kernel = choose_linear_path(weight.dtype, CPU).kernel
    packed = ops.pack_linear_weight(weight, kernel)
    if packed is None:
        pytest.skip(f"the {weight.dtype} path here is plain F.linear: nothing is packed")
    return packed


def runnable_kernels(dtype: torch.dtype) -> list[str]:
    """Every packed path this CPU and kernel build can run for `dtype`, chosen or not."""
    facts = CpuFacts.of_this_machine()
    paths = (("rankcast", facts.packed), ("onednn", facts.onednn))
    return [kernel for kernel, able in paths if dtype in able]


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_chosen_path_is_the_one_the_weights_are_packed_for(dtype: torch.dtype) -> None:
    """On every x86 family with AVX2 and FMA the kernels are built with a float32 matmul, and
    `auto` sends float32 linears (bfloat16 too, where the build multiplies it) to rankcast's
    packed kernel, the batch-invariant one; the packed weight is the chosen kernel's."""
    path = choose_linear_path(dtype, CPU)
    if cpu_family() != "other" and dtype == torch.float32:
        assert path.kernel == "rankcast" and path.batch_invariant, path
    weight = torch.randn(32, 16).to(dtype)
    packed = ops.pack_linear_weight(weight, path.kernel)
    assert (packed.backend if packed is not None else "torch") == path.kernel


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 8, 16, 20, 31, 33, 70])
@pytest.mark.parametrize(
    "out_features,in_features",
    [(96, 64), (40, 24), (16, 7), (200, 301), (40, 96), (50, 576), (40, 63)],
)
def test_packed_linear_matches_f_linear(
    dtype: torch.dtype, rows: int, out_features: int, in_features: int
) -> None:
    """Every packed path this CPU runs, the chosen one and the ones a setting forces."""
    # Row counts around the 6-row (AVX2) and 8-row (AVX-512) register tiles and the 16-row
    # (AMX) tiles and 32-row blocks (a lower AMX tile partly filled: 20, 31), widths with partial
    # panels and odd panel counts, an odd K, a K that spans several of the kernel's k-blocks, and
    # Ks of whole AMX tiles (32 k; 63 is padded to 64 and runs on them too).
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    # Outputs reach ~sqrt(K) in size: float32 rounding of a sum that long is ~1e-5 absolute,
    # while a kernel that drops or repeats a k-block is off by whole units.
    tol = {"atol": 1e-4, "rtol": 1e-5} if dtype == torch.float32 else tolerance(dtype)
    kernels_here = runnable_kernels(dtype)
    if not kernels_here:
        pytest.skip(f"nothing packs {dtype} on this CPU")
    for kernel in kernels_here:
        packed = _packed_or_skip(weight, kernel)
        for b in (None, bias):
            want = F.linear(x.double(), weight.double(), None if b is None else b.double())
            got = ops.packed_linear(x, packed, b).double()
            torch.testing.assert_close(got, want, **tol, msg=lambda m, k=kernel: f"{k}: {m}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_features,in_features", [(16, 2), (48, 64), (96, 302)])
def test_packing_over_the_weights_own_storage_gives_the_same_layout(
    dtype: torch.dtype, out_features: int, in_features: int
) -> None:
    """A weight given up to the kernel is packed over its own bytes, exactly as the copying
    pack lays it out; a shape whose packed form would not fit is refused, not corrupted."""
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(8))
    weight = weight.to(dtype)
    if "rankcast" not in runnable_kernels(dtype):
        pytest.skip(f"no packed {dtype} kernel in this build")
    copied = _packed_or_skip(weight, "rankcast")
    given_up = weight.clone()
    in_place = ops.pack_linear_weight(given_up, "rankcast", reuse_storage=True)
    assert in_place is not None and in_place.tensor.data_ptr() == given_up.data_ptr()
    assert torch.equal(in_place.tensor, copied.tensor)
    x = torch.randn(5, in_features, generator=torch.Generator().manual_seed(9)).to(dtype)
    assert torch.equal(ops.packed_linear(x, in_place, None), ops.packed_linear(x, copied, None))
    ragged = torch.randn(40, 64).to(dtype)
    with pytest.raises(RuntimeError, match="in place needs out % 16 == 0"):
        torch.ops.rankcast.pack_linear_weight_(ragged)
    kept = ops.pack_linear_weight(ragged, "rankcast", reuse_storage=True)  # a copy instead
    assert kept is not None and kept.tensor.data_ptr() != ragged.data_ptr()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("in_features", [301, 320])
def test_packed_linear_gives_a_row_the_same_bits_in_any_batch(
    dtype: torch.dtype, in_features: int
) -> None:
    """Prefix caching reuses K/V computed in another batch: a row's output must not depend on
    which rows share its step (tiles, row blocks and k-blocks may only change the order of work,
    never the order of a sum). 320 is whole AMX tiles of k: an AMX build multiplies it on tiles
    at every row count, 301 through the dot-product kernel."""
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(200, in_features, generator=gen).to(dtype)
    x = torch.randn(70, in_features, generator=gen).to(dtype)
    if "rankcast" not in runnable_kernels(dtype):
        pytest.skip(f"no packed {dtype} kernel in this build")
    packed = _packed_or_skip(weight, "rankcast")
    batch = ops.packed_linear(x, packed, None)
    for row in (0, 9, 63, 64, 69):
        alone = ops.packed_linear(x[row : row + 1].contiguous(), packed, None)
        assert torch.equal(batch[row : row + 1], alone), f"row {row} differs"


def _pairs_in_vdpbf16ps_order(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T as VDPBF16PS sums it: float32, pairs of k in order, each pair's odd product
    added before its even one, each addition rounded (bfloat16 products are exact in float32),
    the sum rounded once to bfloat16."""
    xf, wf = x.float(), weight.float()
    acc = torch.zeros(x.shape[0], weight.shape[0])
    for k in range(0, x.shape[1], 2):
        acc = acc + xf[:, k + 1, None] * wf[None, :, k + 1]
        acc = acc + xf[:, k, None] * wf[None, :, k]
    return acc.to(torch.bfloat16)


@pytest.mark.parametrize("rows", [1, 8, 33])
def test_bfloat16_linears_sum_pairs_of_k_as_vdpbf16ps_does(rows: int) -> None:
    """An AVX512-BF16 build's bfloat16 linears give VDPBF16PS's bits exactly, whether the
    instruction runs or, where it is slow (Intel: RANKCAST_BF16_PAIRS_ON_FMA), the two FMAs it
    does in its order: a build of either kind gives the same results. K = 90 is no whole number
    of AMX tiles, so an AMX build's linear takes the same pairs. Random rows alone would seldom
    show an order changed (a sum's last float32 bits rarely move its bfloat16 rounding): the
    first row and column meet in products 2^-8, 1 | 0, -2^-23 | 2^-23, 2^-24, whose sum is
    1 + 2^-8 + 2^-23 (rounded up to 1 + 2^-7) with each pair's odd product first and exactly the
    bfloat16 tie 1 + 2^-8 (rounded to 1) in k's order."""
    if CpuFacts.of_this_machine().build not in ("avx512-bf16", "amx"):
        pytest.skip("only AVX512-BF16 and AMX builds sum bfloat16 in VDPBF16PS pairs")
    gen = torch.Generator().manual_seed(11)
    weight = torch.randn(72, 90, generator=gen)
    x = torch.randn(rows, 90, generator=gen)
    x[0] = 0.0
    weight[0] = 0.0
    x[0, :6] = torch.tensor([2**-4, 1.0, 0.0, -(2**-12), 2**-12, 2**-12])
    weight[0, :6] = torch.tensor([2**-4, 1.0, 0.0, 2**-11, 2**-11, 2**-12])
    x, weight = x.to(torch.bfloat16), weight.to(torch.bfloat16)
    packed = _packed_or_skip(weight, "rankcast")
    got = ops.packed_linear(x, packed, None)
    want = _pairs_in_vdpbf16ps_order(x, weight)
    assert want[0, 0].item() == 1 + 2**-7, "the crafted products sum to above the tie"
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_takes_the_first_of_equal_maxima(dtype: torch.dtype) -> None:
    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(6)).to(dtype)
    logits[1, 17] = logits[1, 900] = 50.0  # a tie: the first index wins, as torch's
    logits[2, -1] = 60.0  # the very last column (past the last whole vector)
    logits[3, 5] = float("nan")  # a NaN is the maximum, as torch.argmax has it
    assert ops.argmax(logits).tolist() == logits.argmax(dim=-1).tolist()


def _caches(blocks: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(2)
    keys = torch.randn(blocks, kv_heads, head_dim, block_size, generator=gen).to(dtype)
    values = torch.randn(blocks, kv_heads, block_size, head_dim, generator=gen).to(dtype)
    return keys, values


def _decode_batch(
    lengths: list[int], heads: int, kv_heads: int, block_size: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Generator]:
    """Caches, block tables of scattered blocks, context lengths and one query token for each
    of a batch of decodes (head_dim 64): (keys, values, table, seq_lens, query, generator)."""
    gen = torch.Generator().manual_seed(seed)
    needs = [-(-n // block_size) for n in lengths]
    keys, values = _caches(sum(needs) + 3, kv_heads, 64, block_size, dtype)
    order = torch.randperm(sum(needs) + 3, generator=gen).tolist()  # scattered blocks
    width = max(needs)
    table = torch.tensor(
        [[order.pop() for _ in range(need)] + [0] * (width - need) for need in needs],
        dtype=torch.int32,
    )
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    query = torch.randn(len(lengths), heads, 64, generator=gen).to(dtype)
    return keys, values, table, seq_lens, query, gen


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (16, 4), (128, 32)])
def test_rotary_and_cache_write_match_torch(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, head_dim: int, block_size: int
) -> None:
    heads, kv_heads, tokens = 6, 2, 9
    rope = RotaryEmbedding(head_dim, 256, 10000.0, None)
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    positions = torch.randint(0, 256, (tokens,), generator=gen)
    slots = torch.randperm(8 * block_size, generator=gen)[:tokens]
    slots[4] = -1  # a token whose K/V is not kept
    results = []
    for path in (ops.rotary_embedding_cache, None):
        x = qkv.clone()
        keys, values = _caches(8, kv_heads, head_dim, block_size, dtype)
        args = (x, positions, rope.cos_sin, keys, values, slots, heads, kv_heads)
        if path is None:
            reference(monkeypatch, ops.rotary_embedding_cache, *args)
        else:
            path(*args)
        results.append((x, keys, values))
    for got, want in zip(results[0], results[1], strict=True):
        torch.testing.assert_close(got, want, **tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size",
    [(9, 3, 64, 16), (4, 4, 16, 4), (8, 2, 128, 32), (7, 1, 32, 8)],
)
def test_paged_attention_matches_torch_on_a_mixed_step(
    monkeypatch: pytest.MonkeyPatch,
    dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
) -> None:
    # Decodes at several context lengths, a chunk after a cached prefix, and a whole prompt.
    query_lens = [1, 1, 5, 7, 1, 3]
    seq_lens = [1, 37, 25, 7, 16, 3 * block_size]
    blocks = 64
    keys, values = _caches(blocks, kv_heads, head_dim, block_size, dtype)
    gen = torch.Generator().manual_seed(4)
    order = torch.randperm(blocks, generator=gen).tolist()  # scattered, non-adjacent blocks
    width = max(-(-n // block_size) for n in seq_lens)
    tables = []
    for n in seq_lens:
        need = -(-n // block_size)
        tables.append([order.pop() for _ in range(need)] + [0] * (width - need))
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    query = torch.randn(starts[-1], heads, head_dim, generator=gen).to(dtype)
    args = (
        keys,
        values,
        torch.tensor(tables, dtype=torch.int32),
        torch.tensor(seq_lens, dtype=torch.int32),
        torch.tensor(starts, dtype=torch.int32),
        head_dim**-0.5,
        query_lens,
    )
    got = torch.empty_like(query)
    want = torch.empty_like(query)
    ops.paged_attention(got, query, *args)
    reference(monkeypatch, ops.paged_attention, want, query, *args)
    torch.testing.assert_close(got, want, **tolerance(dtype))
    # The decode-only reference (one gather for the batch) agrees with the per-sequence one.
    decodes = [0, 1, 4]
    sub = (
        keys,
        values,
        torch.tensor([tables[i] for i in decodes], dtype=torch.int32),
        torch.tensor([seq_lens[i] for i in decodes], dtype=torch.int32),
        torch.arange(len(decodes) + 1, dtype=torch.int32),
        head_dim**-0.5,
        [1] * len(decodes),
    )
    rows = query[[starts[i] for i in decodes]]
    batched = torch.empty_like(rows)
    reference(monkeypatch, ops.paged_attention, batched, rows, *sub)
    torch.testing.assert_close(batched, want[[starts[i] for i in decodes]], **tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_token_attends_bit_identically_alone_or_inside_a_prompt(dtype: torch.dtype) -> None:
    """Chunking and prefix caching may compute a token in a decode, a chunk or a whole prompt;
    its attention output must not depend on which other rows shared the kernel's tile."""
    if not kernels.load():
        pytest.skip("kernel property")
    heads, kv_heads, head_dim, block_size, length = 9, 3, 64, 16, 37
    keys, values = _caches(8, kv_heads, head_dim, block_size, dtype)
    table = torch.tensor([[5, 1, 7]], dtype=torch.int32)
    query = torch.randn(length, heads, head_dim, generator=torch.Generator().manual_seed(7))
    query = query.to(dtype)
    whole = torch.empty_like(query)
    ops.paged_attention(
        whole,
        query,
        keys,
        values,
        table,
        torch.tensor([length], dtype=torch.int32),
        torch.tensor([0, length], dtype=torch.int32),
        head_dim**-0.5,
        [length],
    )
    for position in (0, 17, length - 1):
        alone = torch.empty_like(query[:1])
        ops.paged_attention(
            alone,
            query[position : position + 1],
            keys,
            values,
            table,
            torch.tensor([position + 1], dtype=torch.int32),
            torch.tensor([0, 1], dtype=torch.int32),
            head_dim**-0.5,
            [1],
        )
        assert torch.equal(alone[0], whole[position])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,block_size", DECODE_GEOMETRIES)
def test_a_long_context_decode_split_between_threads_gives_the_tiles_bits(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, heads: int, kv_heads: int, block_size: int
) -> None:
    """A lone decode over a long context is shared out between the threads by stretches of its
    context (csrc/attention.cpp, `attend_split`); each chunk's weighted values are then summed
    on the thread that owns it and the chunks' sums added in order. The token must come out
    with the bits one thread gives it, and the bits it gets inside a prompt."""
    if not kernels.load():
        pytest.skip("kernel property")
    head_dim = 64
    gen = torch.Generator().manual_seed(11)
    previous = torch.get_num_threads()
    for length in (256, 300, 701):
        need = -(-length // block_size)
        keys, values = _caches(need + 5, kv_heads, head_dim, block_size, dtype)
        order = (torch.randperm(need + 5, generator=gen)[:need]).tolist()  # scattered blocks
        table = torch.tensor([order], dtype=torch.int32)
        prompt = torch.randn(3, heads, head_dim, generator=gen).to(dtype)
        args = (keys, values, table, torch.tensor([length], dtype=torch.int32))
        scale = head_dim**-0.5
        inside = torch.empty_like(prompt)  # the last three positions as one chunk: the tiles
        ops.paged_attention(
            inside, prompt, *args, torch.tensor([0, 3], dtype=torch.int32), scale, [3]
        )
        decoded = []
        try:
            for threads in (1, 2):
                torch.set_num_threads(threads)
                alone = torch.empty_like(prompt[2:])
                ops.paged_attention(
                    alone, prompt[2:], *args, torch.tensor([0, 1], dtype=torch.int32), scale, [1]
                )
                decoded.append(alone)
        finally:
            torch.set_num_threads(previous)
        assert torch.equal(decoded[0], decoded[1]), f"{length} tokens: threads changed the bits"
        assert torch.equal(decoded[1][0], inside[2]), f"{length} tokens: a prompt's bits differ"
        want = torch.empty_like(decoded[1])
        reference(
            monkeypatch,
            ops.paged_attention,
            want,
            prompt[2:],
            *args,
            torch.tensor([0, 1], dtype=torch.int32),
            scale,
            [1],
        )
        torch.testing.assert_close(decoded[1], want, **tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,block_size", DECODE_GEOMETRIES)
def test_a_batch_of_decodes_gives_each_token_the_bits_it_gets_alone(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, heads: int, kv_heads: int, block_size: int
) -> None:
    """A step of decodes only, with sequences enough to share out, takes one sequence (every KV
    head) per item (csrc/attention.cpp, `attend_sequence`) where other steps take one (sequence,
    head) pair: each token must still get the bits it gets decoded alone on one thread (the
    tiles) and inside a prompt."""
    if not kernels.load():
        pytest.skip("kernel property")
    head_dim, scale = 64, 64**-0.5
    lengths = [1, 17, 150, 300, 45, 700, 16, 3]
    keys, values, table, seq_lens, query, gen = _decode_batch(
        lengths, heads, kv_heads, block_size, dtype, seed=5
    )
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batch = torch.empty_like(query)
        starts = torch.arange(len(lengths) + 1, dtype=torch.int32)
        ops.paged_attention(
            batch, query, keys, values, table, seq_lens, starts, scale, [1] * len(lengths)
        )
        torch.set_num_threads(1)
        for b, length in enumerate(lengths):
            alone = torch.empty_like(query[b : b + 1])
            one = (keys, values, table[b : b + 1], seq_lens[b : b + 1])
            ops.paged_attention(
                alone, query[b : b + 1], *one, torch.tensor([0, 1], dtype=torch.int32), scale, [1]
            )
            assert torch.equal(alone[0], batch[b]), f"a {length}-token decode's bits differ"
            if length >= 2:  # the same token as the last of a two-token chunk
                pair = torch.cat([torch.randn(1, heads, head_dim, generator=gen).to(dtype), alone])
                pair[1] = query[b]
                inside = torch.empty_like(pair)
                ops.paged_attention(
                    inside, pair, *one, torch.tensor([0, 2], dtype=torch.int32), scale, [2]
                )
                assert torch.equal(inside[1], batch[b]), f"{length} tokens: a chunk's bits differ"
    finally:
        torch.set_num_threads(previous)
    want = torch.empty_like(query)
    reference(
        monkeypatch,
        ops.paged_attention,
        want,
        query,
        keys,
        values,
        table,
        seq_lens,
        torch.arange(len(lengths) + 1, dtype=torch.int32),
        scale,
        [1] * len(lengths),
    )
    torch.testing.assert_close(batch, want, **tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [5, 16, 20])
def test_a_sliding_window_matches_torch_and_never_reads_behind_it(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, window: int
) -> None:
    """A mixed step (decodes, a chunk after a cached prefix, a whole prompt) with a window: the
    kernel gives the masked reference's answer, and with every block wholly behind each
    sequence's first query's window filled with NaN (memory the engine may have freed), it
    still does: those blocks are never read."""
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    query_lens = [1, 1, 5, 40, 3]
    seq_lens = [3, 70, 61, 40, 130]
    blocks = 48
    keys, values = _caches(blocks, kv_heads, head_dim, block_size, dtype)
    gen = torch.Generator().manual_seed(21)
    order = torch.randperm(blocks - 1, generator=gen).add(1).tolist()  # block 0 kept aside
    width = max(-(-n // block_size) for n in seq_lens)
    tables, behind = [], []
    for n, q in zip(seq_lens, query_lens, strict=True):
        need = -(-n // block_size)
        row = [order.pop() for _ in range(need)]
        skipped = max(0, n - q + 1 - window) // block_size
        behind += row[:skipped]
        tables.append(row + [0] * (width - need))
    assert behind, "the step must have blocks behind a window"
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    query = torch.randn(starts[-1], heads, head_dim, generator=gen).to(dtype)
    args = (
        torch.tensor(tables, dtype=torch.int32),
        torch.tensor(seq_lens, dtype=torch.int32),
        torch.tensor(starts, dtype=torch.int32),
        head_dim**-0.5,
        query_lens,
        window,
    )
    want = torch.empty_like(query)
    reference(monkeypatch, ops.paged_attention, want, query, keys, values, *args)
    got = torch.empty_like(query)
    ops.paged_attention(got, query, keys, values, *args)
    torch.testing.assert_close(got, want, **tolerance(dtype))
    if not kernels.load():
        return
    poisoned_keys, poisoned_values = keys.clone(), values.clone()
    poisoned_keys[behind] = float("nan")
    poisoned_values[behind] = float("nan")
    poisoned = torch.empty_like(query)
    ops.paged_attention(poisoned, query, poisoned_keys, poisoned_values, *args)
    assert torch.equal(poisoned, got)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,block_size", DECODE_GEOMETRIES)
def test_a_windowed_token_gets_the_same_bits_on_every_path(
    dtype: torch.dtype, heads: int, kv_heads: int, block_size: int
) -> None:
    """With a window, a token decoded alone on one thread (the tiles), alone on two (its
    context split between them), in a batch of decodes (one sequence per item) and as the last
    of a chunk comes out with the same bits: each path starts at the window's first block and
    adds the same chunk sums in the same order."""
    if not kernels.load():
        pytest.skip("kernel property")
    head_dim, scale, window = 64, 64**-0.5, 100
    lengths = [701, 300, 90, 257, 150, 400, 33, 600]
    keys, values, table, seq_lens, query, gen = _decode_batch(
        lengths, heads, kv_heads, block_size, dtype, seed=13
    )
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batch = torch.empty_like(query)
        starts = torch.arange(len(lengths) + 1, dtype=torch.int32)
        ops.paged_attention(
            batch, query, keys, values, table, seq_lens, starts, scale, [1] * len(lengths), window
        )
        one_start = torch.tensor([0, 1], dtype=torch.int32)
        for b, length in enumerate(lengths):
            one = (keys, values, table[b : b + 1], seq_lens[b : b + 1])
            alone = []
            for threads in (1, 2):
                torch.set_num_threads(threads)
                out = torch.empty_like(query[b : b + 1])
                ops.paged_attention(out, query[b : b + 1], *one, one_start, scale, [1], window)
                alone.append(out[0])
            assert torch.equal(alone[0], alone[1]), f"{length} tokens: threads changed the bits"
            assert torch.equal(alone[0], batch[b]), f"{length} tokens: the batch's bits differ"
            chunk = torch.randn(3, heads, head_dim, generator=gen).to(dtype)
            chunk[2] = query[b]
            inside = torch.empty_like(chunk)
            ops.paged_attention(
                inside, chunk, *one, torch.tensor([0, 3], dtype=torch.int32), scale, [3], window
            )
            assert torch.equal(inside[2], batch[b]), f"{length} tokens: a chunk's bits differ"
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,block_size,window", [(9, 3, 16, 0), (7, 1, 8, 300)])
def test_a_long_prompt_gives_each_token_its_bits_whole_in_chunks_and_decoded(
    dtype: torch.dtype, heads: int, kv_heads: int, block_size: int, window: int
) -> None:
    """A 600-token prompt attended whole, in chunks of uneven sizes (each after the cached
    prefix before it) and token by token as decodes on one and two threads: every token comes
    out with the same bits. Past a few hundred tokens the paths part: the AMX tiles sum a row's
    weighted values in 256-token segments (csrc/attention_amx.cpp), the vector kernels in
    16-token chunks, and a lone decode splits the context between threads; a chunk boundary or a
    split that moved a sum by one position would change the bits here."""
    if not kernels.load():
        pytest.skip("kernel property")
    head_dim, length, scale = 64, 600, 64**-0.5
    need = -(-length // block_size)
    keys, values = _caches(need + 3, kv_heads, head_dim, block_size, dtype)
    gen = torch.Generator().manual_seed(21)
    table = torch.tensor(
        [torch.randperm(need + 3, generator=gen)[:need].tolist()], dtype=torch.int32
    )
    query = torch.randn(length, heads, head_dim, generator=gen).to(dtype)

    def attend(first: int, last: int) -> torch.Tensor:
        """Positions [first, last) as one chunk after the cached [0, first)."""
        out = torch.empty_like(query[first:last])
        seq_len = torch.tensor([last], dtype=torch.int32)
        starts = torch.tensor([0, last - first], dtype=torch.int32)
        ops.paged_attention(
            out,
            query[first:last],
            keys,
            values,
            table,
            seq_len,
            starts,
            scale,
            [last - first],
            window,
        )
        return out

    whole = attend(0, length)
    bounds = [0, 100, 273, 600]
    chunked = torch.cat([attend(a, b) for a, b in itertools.pairwise(bounds)])
    assert torch.equal(chunked, whole), "chunking changed a token's bits"
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for position in (255, 256, 300, 511, 513, 599):
                alone = attend(position, position + 1)
                assert torch.equal(alone[0], whole[position]), (
                    f"position {position} decoded on {threads} threads: the bits differ"
                )
    finally:
        torch.set_num_threads(previous)
    want = torch.empty_like(query)
    starts = torch.tensor([0, length], dtype=torch.int32)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernels, "available", lambda tensor: False)
        ops.paged_attention(
            want,
            query,
            keys,
            values,
            table,
            torch.tensor([length], dtype=torch.int32),
            starts,
            scale,
            [length],
            window,
        )
    torch.testing.assert_close(whole, want, **tolerance(dtype))


def _fused_qkv_and_adapters(
    gen: torch.Generator, widths: list[int], in_size: int, scale: float
) -> tuple[list, int, list]:
    """A fused q/k/v projection of these widths (its sub-projections and total width) and two
    random adapters for it: rank 8 on every sub-projection for slot 0, rank 3 on q and v only
    for slot 2 (empty rank rows, an untargeted sub-projection)."""
    from rankcast.lora.layers import SubProjection
    from rankcast.lora.peft_adapter import LoRAAdapter, LoRAWeights

    names = ["q_proj", "k_proj", "v_proj"]
    subs, offset = [], 0
    for name, width in zip(names, widths, strict=True):
        subs.append(SubProjection(name, offset, width))
        offset += width

    def adapter(rank: int, modules: list[str]) -> LoRAAdapter:
        weights = {
            (0, m): LoRAWeights(
                torch.randn(rank, in_size, generator=gen) * scale,
                torch.randn(widths[names.index(m)], rank, generator=gen) * scale,
            )
            for m in modules
        }
        return LoRAAdapter("a", Path("."), rank, 0.5, weights)

    return subs, offset, [(0, adapter(8, names)), (2, adapter(3, ["q_proj", "v_proj"]))]


def _lora_layer(kernel: bool, subs: list, in_size: int, adapters: list):
    from rankcast.lora.layers import LoRAContext, LoRALinear

    dtype = torch.float32 if kernel else torch.float64  # the reference in float64
    context = LoRAContext(4, 8, torch.device("cpu"), dtype, kernel=kernel)
    layer = LoRALinear(context, subs, in_size)
    for slot, adapter in adapters:
        layer.set_slot(slot, adapter, 0)
    return context, layer


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("in_size", [576, 40])
def test_the_lora_kernel_adds_each_tokens_own_adapter_as_the_masked_matmuls_do(
    dtype: torch.dtype, in_size: int
) -> None:
    """csrc/lora.cpp against the torch path (masked matmuls over every slot, here in float64):
    a fused projection of three sub-projections with widths that leave vector tails, adapters of
    rank 8 and 3 (empty rank rows), one not targeting every sub-projection, an empty slot,
    tokens without an adapter and an input whose rows are strided."""
    if not kernels.load():
        pytest.skip("kernel property")
    from rankcast.lora.layers import LoRABatch

    gen = torch.Generator().manual_seed(3)
    subs, offset, adapters = _fused_qkv_and_adapters(gen, [48, 24, 8], in_size, scale=1.0)
    slots = [0, -1, 2, 2, 0, 1, -1, 0, 2]  # slot 1 holds nothing
    wide = torch.randn(len(slots), in_size + 5, generator=gen).to(dtype)
    x = wide[:, :in_size]  # rows strided
    base = torch.randn(len(slots), offset, generator=gen).to(dtype)
    got = base.clone()
    context, layer = _lora_layer(True, subs, in_size, adapters)
    context.batch = LoRABatch.from_token_slots(slots, context)
    layer.add_to(x, got)
    want = base.double()
    context, layer = _lora_layer(False, subs, in_size, adapters)
    context.batch = LoRABatch.from_token_slots(slots, context)
    layer.add_to(x.double(), want)
    torch.testing.assert_close(got, want.to(dtype), **tolerance(dtype))
    untouched = [t for t, s in enumerate(slots) if s in (-1, 1)]
    assert torch.equal(got[untouched], base[untouched])
    assert not torch.equal(got, base)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rank", [8, 6])
def test_the_lora_kernel_gives_a_token_the_same_bits_alone_as_in_any_batch(
    dtype: torch.dtype, rank: int
) -> None:
    """Tokens on one slot go through the kernel up to sixteen at a time, in tiles of four,
    sharing each row of A and B, and a few rank rows or column groups side by side: a token's
    delta must not depend on which tokens share its block or tile (runs of 1 to 21 tokens on a
    slot, broken by other slots and by tokens without one; a rank and a width that leave rows
    and columns outside the side-by-side groups), or adapters would change the answer with the
    batch."""
    if not kernels.load():
        pytest.skip("kernel property")
    gen = torch.Generator().manual_seed(5)
    slots_held, in_size, width = 3, 200, 72
    a = torch.randn(slots_held * rank, in_size, generator=gen)
    b = torch.randn(slots_held * rank, width, generator=gen)
    slots = [0, 0, 0, 0, 0, 0, 2, 2, -1, 1, 1, 1, 0, 2, 2, 2, 2, 2, 1, *[0] * 21, *[2] * 7]
    x = torch.randn(len(slots), in_size, generator=gen).to(dtype)
    base = torch.randn(len(slots), width, generator=gen).to(dtype)
    batch = _each_token_alone_as_in_the_batch(x, base, slots, a, b, rank)
    assert not torch.equal(batch, base)


def _each_token_alone_as_in_the_batch(
    x: torch.Tensor,
    base: torch.Tensor,
    slots: list[int],
    a: torch.Tensor,
    b: torch.Tensor,
    rank: int,
) -> torch.Tensor:
    """`base` plus every token's delta, in one batch; asserts each token's row is the same bits
    when the token goes through alone."""
    batch = base.clone()
    torch.ops.rankcast.lora_add(batch, x, torch.tensor(slots), [a], [b], [0], rank)
    for t, slot in enumerate(slots):
        alone = base[t : t + 1].clone()
        torch.ops.rankcast.lora_add(alone, x[t : t + 1], torch.tensor([slot]), [a], [b], [0], rank)
        assert torch.equal(batch[t : t + 1], alone), f"token {t} (slot {slot})"
    return batch


def _tiles_or_skip() -> None:
    if not kernels.load() or not torch.ops.rankcast.lora_tiles_supported():
        pytest.skip("this build or CPU has no AMX tiles")


@pytest.mark.parametrize("in_size", [576, 40])
def test_lora_tiles_add_each_tokens_own_adapter_as_the_masked_matmuls_do(in_size: int) -> None:
    """csrc/lora_amx.cpp (bfloat16 slots packed for AMX tiles) against the torch path in float64,
    to bfloat16's precision: a fused projection of three sub-projections, adapters of rank 8 and
    3, one not targeting every sub-projection, an empty slot, tokens without an adapter, an input
    whose rows are strided and (40) not a whole tile of k; rows a token leaves alone keep their
    bits."""
    _tiles_or_skip()
    from rankcast.lora.layers import LoRABatch, LoRAContext, LoRALinear

    gen = torch.Generator().manual_seed(4)
    subs, offset, adapters = _fused_qkv_and_adapters(gen, [48, 32, 16], in_size, scale=0.25)
    slots = [0, -1, 2, 2, 0, 1, -1, 0, 2, *[0] * 20]  # slot 1 holds nothing

    def layer_for(dtype: torch.dtype, kernel: bool) -> tuple[LoRAContext, LoRALinear]:
        context = LoRAContext(4, 8, torch.device("cpu"), dtype, kernel=kernel)
        layer = LoRALinear(context, subs, in_size)
        for slot, held in adapters:
            layer.set_slot(slot, held, 0)
        context.batch = LoRABatch.from_token_slots(slots, context)
        return context, layer

    wide = torch.randn(len(slots), in_size + 5, generator=gen).bfloat16()
    x = wide[:, :in_size]  # rows strided
    base = torch.randn(len(slots), offset, generator=gen).bfloat16()
    context, tiled = layer_for(torch.bfloat16, kernel=True)
    assert context.tiles and tiled.a.dim() == 6
    got = base.clone()
    tiled.add_to(x, got)
    _, reference_layer = layer_for(torch.float64, kernel=False)
    want = base.double()
    reference_layer.add_to(x.double(), want)
    torch.testing.assert_close(got, want.bfloat16(), atol=2e-2, rtol=2e-2)
    untouched = [t for t, s in enumerate(slots) if s in (-1, 1)]
    assert torch.equal(got[untouched], base[untouched])
    assert not torch.equal(got, base)


@pytest.mark.parametrize("rank", [8, 6, 40])
def test_the_lora_tiles_give_a_token_the_same_bits_alone_as_in_any_batch(rank: int) -> None:
    """On tiles a slot's tokens go through up to 32 at a time (two tiles of rows), the shrink's
    tiles of k in two sets of sums: a token's delta must not depend on the tokens beside it
    (runs of 1 to 37 tokens on a slot, broken by other slots and tokens without one; an input of
    an odd number of tiles of k; rank 40, two tiles of rank in the expand)."""
    _tiles_or_skip()
    from rankcast.lora.tile_layout import pack_a, pack_b

    gen = torch.Generator().manual_seed(6)
    slots_held, in_size, width = 3, 200, 80
    a = pack_a(torch.randn(slots_held, rank, in_size, generator=gen) / 4)
    b = pack_b(torch.randn(slots_held, rank, width, generator=gen) / 4)
    slots = [0, 0, 0, 0, 0, 0, 2, 2, -1, 1, 1, 1, 0, 2, 2, 2, 2, 2, 1, *[0] * 37, *[2] * 17]
    x = torch.randn(len(slots), in_size, generator=gen).bfloat16()
    base = torch.randn(len(slots), width, generator=gen).bfloat16()
    batch = _each_token_alone_as_in_the_batch(x, base, slots, a, b, rank)
    assert not torch.equal(batch[:8], base[:8])


def test_the_lora_tiles_refuse_slots_not_packed_for_them() -> None:
    _tiles_or_skip()
    from rankcast.lora.tile_layout import pack_a, pack_b

    a, b = pack_a(torch.zeros(2, 8, 40)), pack_b(torch.zeros(2, 8, 32))
    out, x = torch.zeros(2, 32, dtype=torch.bfloat16), torch.zeros(2, 40, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="A must be packed for tiles"):
        torch.ops.rankcast.lora_add(out, x, torch.tensor([0, 1]), [a[:, :, :8]], [b], [0], 8)
    with pytest.raises(RuntimeError, match="B must be packed for tiles"):
        rank_6 = pack_b(torch.zeros(2, 6, 32))
        torch.ops.rankcast.lora_add(out, x, torch.tensor([0, 1]), [a], [rank_6], [0], 8)
    with pytest.raises(RuntimeError, match="take bfloat16 steps"):
        torch.ops.rankcast.lora_add(out.float(), x.float(), torch.tensor([0, 1]), [a], [b], [0], 8)
    with pytest.raises(RuntimeError, match="uses slot 2 of 2"):
        torch.ops.rankcast.lora_add(out, x, torch.tensor([0, 2]), [a], [b], [0], 8)


def test_the_lora_kernel_refuses_a_slot_it_does_not_have() -> None:
    if not kernels.load():
        pytest.skip("kernel property")
    a, b = torch.zeros(16, 40), torch.zeros(16, 24)
    out, x = torch.zeros(2, 24), torch.zeros(2, 40)
    with pytest.raises(RuntimeError, match="uses slot 2 of 2"):
        torch.ops.rankcast.lora_add(out, x, torch.tensor([0, 2]), [a], [b], [0], 8)
    with pytest.raises(RuntimeError, match="columns must lie inside out"):
        torch.ops.rankcast.lora_add(out, x, torch.tensor([0, 1]), [a], [b], [4], 8)
