"""An 8-bit KV cache (`--kv-cache-dtype int8 | fp8 | fp8_e4m3 | fp8_e5m2`, model/kv_quant.py).

What it must keep: the kernels store the bytes and scales the torch path stores, and read them
as it does (within float rounding); a token's attention output has the same bits decoded alone,
in a batch, split between threads or inside a prompt (the batch-invariance rule), so whole,
chunked and prefix-cached generations are the same tokens; the C++ decoder stack gives the
modules' bits; a block costs what `bytes_per_block` says, so the same budget holds ~1.9x the
blocks of a bfloat16 cache; and the model's output stays near the 16-bit cache's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rankcast import LLM, SamplingParams, kernels
from rankcast.config import ConfigError
from rankcast.model import kv_quant, ops
from rankcast.model.rotary import RotaryEmbedding
from tests.model.family_models import stack_and_modules_logits, stack_expected

EIGHT_BIT = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
EIGHT_BIT_IDS = ["int8", "fp8_e4m3", "fp8_e5m2"]
ACTIVATIONS = [torch.float32, torch.bfloat16]


def reference(monkeypatch: pytest.MonkeyPatch, fn, *args, **kwargs):
    """Run `fn` with the kernels switched off: the plain-torch path."""
    with monkeypatch.context() as patch:
        patch.setattr(kernels, "available", lambda tensor: False)
        return fn(*args, **kwargs)


def quantized_caches(
    blocks: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random keys and values stored as an 8-bit cache: (keys, values, key_scale, value_scale),
    each token's head quantized as the cache write quantizes it."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(blocks, kv_heads, head_dim, block_size, generator=gen)
    values = torch.randn(blocks, kv_heads, block_size, head_dim, generator=gen)
    key_bytes, key_scale = kv_quant.quantize_heads(keys.transpose(2, 3), dtype)
    value_bytes, value_scale = kv_quant.quantize_heads(values, dtype)
    return key_bytes.transpose(2, 3).contiguous(), value_bytes, key_scale, value_scale


@pytest.mark.parametrize("cache", EIGHT_BIT, ids=EIGHT_BIT_IDS)
@pytest.mark.parametrize("activations", ACTIVATIONS, ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (16, 8), (128, 32)])
def test_the_kernel_writes_the_bytes_and_scales_torch_writes(
    monkeypatch: pytest.MonkeyPatch,
    cache: torch.dtype,
    activations: torch.dtype,
    head_dim: int,
    block_size: int,
) -> None:
    """Each token's key and value of each head as bytes and a scale: the same amax, the same
    1 / scale, rounding to nearest even on both paths. (Every token at position 0: its rotation
    is exact on both, where at other positions their last bits may differ before the write.)"""
    if not kernels.load():
        pytest.skip("kernel property")
    heads, kv_heads, tokens = 6, 2, 9
    rope = RotaryEmbedding(head_dim, 256, 10000.0, None)
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(activations)
    qkv[0] = 0.0  # a token of zeros: scale 0, bytes 0
    positions = torch.zeros(tokens, dtype=torch.long)
    slots = torch.randperm(8 * block_size, generator=gen)[:tokens]
    slots[4] = -1  # a token whose K/V is not kept
    results = []
    for kernel in (True, False):
        x = qkv.clone()
        keys = torch.zeros(8, kv_heads, head_dim, block_size, dtype=cache)
        values = torch.zeros(8, kv_heads, block_size, head_dim, dtype=cache)
        key_scale = torch.zeros(8, kv_heads, block_size)
        value_scale = torch.zeros(8, kv_heads, block_size)
        args = (x, positions, rope.cos_sin, keys, values, slots, heads, kv_heads)
        scales = {"key_scale": key_scale, "value_scale": value_scale}
        if kernel:
            ops.rotary_embedding_cache(*args, **scales)
        else:
            reference(monkeypatch, ops.rotary_embedding_cache, *args, **scales)
        results.append((x, keys.view(torch.uint8), values.view(torch.uint8), *scales.values()))
    (x, *stored), (want_x, *want_stored) = results
    torch.testing.assert_close(x, want_x)
    for got, want in zip(stored, want_stored, strict=True):
        assert torch.equal(got, want)
    assert key_scale.count_nonzero() > 0


@pytest.mark.parametrize("cache", EIGHT_BIT, ids=EIGHT_BIT_IDS)
@pytest.mark.parametrize("activations", ACTIVATIONS, ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size", [(9, 3, 64, 16), (4, 4, 16, 8), (8, 2, 128, 32)]
)
def test_paged_attention_reads_an_8bit_cache_as_torch_does(
    monkeypatch: pytest.MonkeyPatch,
    cache: torch.dtype,
    activations: torch.dtype,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
) -> None:
    """Decodes, a chunk after a cached prefix and a whole prompt in one step, against the torch
    path that decodes each block with its scales and runs SDPA."""
    query_lens = [1, 1, 5, 7, 1, 3]
    seq_lens = [1, 37, 25, 7, 300, 3 * block_size]
    blocks = 64
    keys, values, key_scale, value_scale = quantized_caches(
        blocks, kv_heads, head_dim, block_size, cache, seed=4
    )
    gen = torch.Generator().manual_seed(4)
    order = torch.randperm(blocks, generator=gen).tolist()
    width = max(-(-n // block_size) for n in seq_lens)
    tables = []
    for n in seq_lens:
        need = -(-n // block_size)
        tables.append([order.pop() for _ in range(need)] + [0] * (width - need))
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    query = torch.randn(starts[-1], heads, head_dim, generator=gen).to(activations)
    args = (
        keys,
        values,
        torch.tensor(tables, dtype=torch.int32),
        torch.tensor(seq_lens, dtype=torch.int32),
        torch.tensor(starts, dtype=torch.int32),
        head_dim**-0.5,
        query_lens,
    )
    scales = {"key_scale": key_scale, "value_scale": value_scale}
    got, want = torch.empty_like(query), torch.empty_like(query)
    ops.paged_attention(got, query, *args, **scales)
    reference(monkeypatch, ops.paged_attention, want, query, *args, **scales)
    # In bfloat16 the torch path rounds the decoded values to the query's dtype; the kernel
    # keeps them in float32.
    close = (
        {"atol": 1e-5, "rtol": 1e-5}
        if activations == torch.float32
        else {"atol": 2e-2, "rtol": 2e-2}
    )
    torch.testing.assert_close(got, want, **close)
    # Read as 16-bit values instead of bytes and scales, the answer would be far off.
    plain = torch.empty_like(query)
    ops.paged_attention(
        plain, query, keys.float().to(activations), values.float().to(activations), *args[2:]
    )
    assert not torch.allclose(plain, want, atol=0.1)


@pytest.mark.parametrize("cache", EIGHT_BIT, ids=EIGHT_BIT_IDS)
@pytest.mark.parametrize("activations", ACTIVATIONS, ids=["fp32", "bf16"])
def test_a_token_gets_the_same_bits_alone_batched_split_or_in_a_prompt(
    cache: torch.dtype, activations: torch.dtype
) -> None:
    """Each decode path of csrc/attention.cpp (tiles, one sequence per item, a long context
    split between threads) scales scores and probabilities at the same point, so a token's
    output does not depend on which ran it."""
    if not kernels.load():
        pytest.skip("kernel property")
    heads, kv_heads, head_dim, block_size, scale = 9, 3, 64, 16, 64**-0.5
    lengths = [1, 17, 150, 300, 45, 701, 16, 3]
    need = [-(-n // block_size) for n in lengths]
    total = sum(need) + 3
    keys, values, key_scale, value_scale = quantized_caches(
        total, kv_heads, head_dim, block_size, cache, seed=5
    )
    scales = {"key_scale": key_scale, "value_scale": value_scale}
    gen = torch.Generator().manual_seed(5)
    order = torch.randperm(total, generator=gen).tolist()
    table = torch.tensor(
        [[order.pop() for _ in range(n)] + [0] * (max(need) - n) for n in need], dtype=torch.int32
    )
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    query = torch.randn(len(lengths), heads, head_dim, generator=gen).to(activations)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batch = torch.empty_like(query)
        starts = torch.arange(len(lengths) + 1, dtype=torch.int32)
        ops.paged_attention(
            batch, query, keys, values, table, seq_lens, starts, scale, [1] * len(lengths), **scales
        )
        for b, length in enumerate(lengths):
            one = (keys, values, table[b : b + 1], seq_lens[b : b + 1])
            alone = []
            for threads in (1, 2):  # 2 threads split a long context (attend_split)
                torch.set_num_threads(threads)
                out = torch.empty_like(query[b : b + 1])
                ops.paged_attention(
                    out,
                    query[b : b + 1],
                    *one,
                    torch.tensor([0, 1], dtype=torch.int32),
                    scale,
                    [1],
                    **scales,
                )
                alone.append(out[0])
            assert torch.equal(alone[0], batch[b]), f"a {length}-token decode: batch differs"
            assert torch.equal(alone[1], batch[b]), f"a {length}-token decode: split differs"
            if length >= 2:  # the same token as the last of a two-token chunk
                pair = torch.stack([query[(b + 1) % len(lengths)], query[b]])
                inside = torch.empty_like(pair)
                ops.paged_attention(
                    inside,
                    pair,
                    *one,
                    torch.tensor([0, 2], dtype=torch.int32),
                    scale,
                    [2],
                    **scales,
                )
                assert torch.equal(inside[1], batch[b]), f"{length} tokens: a chunk differs"
    finally:
        torch.set_num_threads(previous)


def test_names_resolve_and_a_16bit_cache_other_than_the_activations_is_refused() -> None:
    assert kv_quant.cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_quant.cache_dtype("fp8", torch.float32) == torch.float8_e4m3fn
    assert kv_quant.cache_dtype("fp8_e5m2", torch.bfloat16) == torch.float8_e5m2
    assert kv_quant.cache_dtype("int8", torch.float32) == torch.int8
    assert kv_quant.cache_dtype("bfloat16", torch.bfloat16) == torch.bfloat16
    with pytest.raises(ConfigError, match="--kv-cache-dtype bfloat16 needs --dtype bfloat16"):
        kv_quant.cache_dtype("bfloat16", torch.float32)
    with pytest.raises(ConfigError, match="--kv-cache-dtype must be one of"):
        LLM(kv_cache_dtype="fp4")


def _tiny(tiny_llama_dir: Path, kv_cache_dtype: str, **options: object) -> LLM:
    return LLM(
        str(tiny_llama_dir),
        dtype="float32",
        kv_cache_space_gib=0.05,
        kv_cache_dtype=kv_cache_dtype,
        **options,
    )


PROMPTS = [
    [(13 * j) % 900 + 30 for j in range(40)],
    [*[(13 * j) % 900 + 30 for j in range(32)], 77, 501, 9, 12],
    [400, 401, 402, 403, 404],
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_whole_chunked_and_cached_prompts_generate_the_same_tokens(
    tiny_llama_dir: Path, kv_cache_dtype: str
) -> None:
    """A token's bytes depend on its own values only: prompts whole, in 16-token chunks, and
    again from the prefix cache (the second prompt shares the first's two blocks) give the same
    greedy tokens; a block costs what `bytes_per_block` says (values of one byte plus a float32
    scale per token and head), so the same budget holds more blocks than a float32 cache."""
    with _tiny(tiny_llama_dir, kv_cache_dtype, enable_prefix_caching=False) as llm:
        whole = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        runner = llm.engine.client.core.executor.worker.runner
        stats = llm.engine.client.core.scheduler.stats()
        eight_bit_blocks = stats.num_blocks
        arch = runner.arch
        heads = arch.num_key_value_heads
        assert runner.bytes_per_block() == (
            2 * arch.num_hidden_layers * 16 * heads * (arch.head_dim + 4)
        )
        assert llm.engine.client.core.kv_cache_dtype == kv_quant.dtype_name(
            kv_quant.cache_dtype(kv_cache_dtype, torch.float32)
        )
    with _tiny(tiny_llama_dir, kv_cache_dtype, max_num_batched_tokens=16, max_num_seqs=4) as llm:
        for _ in range(2):
            assert [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in PROMPTS] == whole
        assert llm.engine.client.core.scheduler.stats().prefix_cache_hits > 0
    with _tiny(tiny_llama_dir, "auto") as llm:
        float_blocks = llm.engine.client.core.scheduler.stats().num_blocks
    head_dim = arch.head_dim
    assert eight_bit_blocks == pytest.approx(float_blocks * 4 * head_dim / (head_dim + 4), rel=0.02)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", ACTIVATIONS, ids=["fp32", "bf16"])
def test_the_decoder_stack_gives_the_modules_bits_over_an_8bit_cache(
    tiny_llama_dir: Path, kv_cache_dtype: str, dtype: torch.dtype
) -> None:
    """The stack hands each layer's scales to the same kernels the modules call; and the
    logits stay near a 16-bit cache's (the quantization's error, not garbage)."""
    if not stack_expected(dtype):
        pytest.skip("the C++ decoder stack needs rankcast's packed linears on this machine")
    cache = kv_quant.cache_dtype(kv_cache_dtype, dtype)
    fused, modules = stack_and_modules_logits(tiny_llama_dir, dtype, kv_cache_dtype=cache)
    assert torch.equal(fused, modules)
    exact, _ = stack_and_modules_logits(tiny_llama_dir, dtype)
    assert not torch.equal(fused, exact)  # the cache did hold bytes
    # Each row's logits point where the 16-bit cache's do, as far as the format's precision
    # allows (measured on the tiny model: cosine 0.99995 int8, 0.9991 e4m3, 0.995-0.997 e5m2).
    floor = {"int8": 0.9995, "fp8_e4m3": 0.998, "fp8_e5m2": 0.99}[kv_cache_dtype]
    cosine = torch.nn.functional.cosine_similarity(fused.float(), exact.float(), dim=-1)
    assert cosine.min().item() > floor, cosine
