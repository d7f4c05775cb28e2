"""The fused steps of a decoder layer: rankcast's CPU kernels where they apply, plain torch
elsewhere (CUDA, float16, or a machine where the kernels are not built).

Both paths compute the same thing; the torch one is the reference the kernels are tested against,
and the kernels are what make a CPU decode step cheap (no per-layer gather of the KV history, one
pass instead of several ops for each element-wise step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F

from rankcast import kernels
from rankcast.model import kv_quant
from rankcast.model.quantization import (
    FOUR_BIT,
    SCHEMES,
    int8_weight_reference,
    q4_1_linear_reference,
    q8_0_linear_reference,
    quantize_int8_weight,
    quantize_q4_0_weight,
    quantize_q4_1_weight,
    quantize_q8_0_weight,
    w8a8_linear_reference,
)

# `torch.ops.*` ops are looked up at run time, so mypy sees their results as Any; each op whose
# result is cast below is declared `-> Tensor` by its schema (csrc/*.cpp, or oneDNN's).


@dataclass(frozen=True)
class PackedWeight:
    """A linear layer's weight laid out once for the CPU's matmul kernel of choice.

    Quantized ("int8", "w8a8"), `scales` holds each output channel's float32 scale and `tensor`
    the int8 values: packed by csrc/gemm.cpp (int8) or csrc/gemm_w8a8.cpp (w8a8) for backend
    "rankcast", plain [out, in] int8 for backend "torch"."""

    tensor: torch.Tensor
    backend: str  # "rankcast", "onednn", or "torch" (quantized weights only)
    out_features: int
    scales: torch.Tensor | None = None
    # "none", "int8" (weight-only), "w8a8", "q4_0", "q4_1", "q8_0", or "q6_k" (an LM head's
    # stored blocks, `pack_q6_k_blocks`)
    quantization: str = "none"
    # Group schemes on the torch path, beside `tensor`'s q [out, in32]: (d, m) float16 [out,
    # groups] for q4_0 and q4_1, (d,) for q8_0.
    groups: tuple[torch.Tensor, ...] | None = None


def pack_linear_weight(
    weight: torch.Tensor, kernel: str, reuse_storage: bool = False, quantization: str = "none"
) -> PackedWeight | None:
    """Pack a [out, in] weight for `kernel`, the path `linear_kernels.choose_linear_path` chose
    for the model: "rankcast" (csrc/gemm.cpp), "onednn" (its prepacked matmul), or "torch"
    (None: plain `F.linear` reads the weight as it is).

    With `reuse_storage` the caller gives the weight up: rankcast's kernel then packs it over
    its own storage where the shapes allow (whole 16-row panels, an even K), and `weight` no
    longer holds the plain layout afterwards. That skips a second buffer the size of the weight
    and its first-touch page faults (~0.1 s of SmolLM2-135M's start on the Zen 3).

    With `quantization` "int8" (weight-only) or "w8a8" the weight is quantized per output
    channel (`quantize_int8_weight`) and packed for csrc/gemm.cpp or csrc/gemm_w8a8.cpp
    ("rankcast"), or kept as plain int8 for the references below ("torch": CUDA, or the kernels
    not built); "q4_1" and "q4_0" in 4-bit groups (`quantize_q4_1_weight`,
    `quantize_q4_0_weight`: Q4_0 as Q4_1 with m = -8 d) for csrc/gemm_q4.cpp, "q8_0"
    in 8-bit groups (`quantize_q8_0_weight`) for csrc/gemm_q8.cpp.
    """
    if quantization in SCHEMES:
        return _pack_quantized(weight, kernel, quantization)
    if quantization != "none":
        raise ValueError(f"unknown quantization {quantization!r}")
    if kernel == "rankcast":
        out, k = weight.shape
        if reuse_storage and weight.is_contiguous() and out % 16 == 0 and k % 2 == 0:
            packed = torch.ops.rankcast.pack_linear_weight_(weight)
        else:
            packed = torch.ops.rankcast.pack_linear_weight(weight)
        return PackedWeight(packed, "rankcast", out)
    if kernel == "onednn":
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 32)
        return PackedWeight(packed, "onednn", weight.shape[0])
    if kernel != "torch":
        raise ValueError(f"unknown linear kernel {kernel!r}")
    return None


def _pack_quantized(weight: torch.Tensor, kernel: str, quantization: str) -> PackedWeight:
    """`weight` quantized as `quantization` and laid out for `kernel` ("rankcast": its
    kernel's packing; "torch": the plain quantized values the references read)."""
    if kernel not in ("rankcast", "torch"):
        raise ValueError(f"{quantization} weights run on rankcast's kernel or torch, not {kernel}")
    out = weight.shape[0]
    if quantization in FOUR_BIT:
        quantize = quantize_q4_0_weight if quantization == "q4_0" else quantize_q4_1_weight
        values, d, m = quantize(weight)
        if kernel == "torch":
            return PackedWeight(values, "torch", out, quantization=quantization, groups=(d, m))
        packed = torch.ops.rankcast.pack_q4_weight(values, d, m)
        return PackedWeight(packed, "rankcast", out, quantization=quantization)
    if quantization == "q8_0":
        q8_values, q8_d = quantize_q8_0_weight(weight)
        if kernel == "torch":
            return PackedWeight(q8_values, "torch", out, quantization="q8_0", groups=(q8_d,))
        packed = torch.ops.rankcast.pack_q8_weight(q8_values, q8_d)
        return PackedWeight(packed, "rankcast", out, quantization="q8_0")
    values, scales = quantize_int8_weight(weight)
    if kernel == "torch":
        return PackedWeight(values, "torch", out, scales, quantization)
    if quantization == "int8":
        packed = torch.ops.rankcast.pack_int8_weight(values, weight.dtype)
    else:
        packed = torch.ops.rankcast.pack_w8a8_weight(values)
    return PackedWeight(packed, "rankcast", out, scales, quantization)


def q6_k_supported() -> bool:
    """Whether this process's kernels multiply Q6_K blocks as stored (csrc/gemm_q6k.cpp:
    AVX-512 builds)."""
    return kernels.load() and bool(torch.ops.rankcast.q6k_supported())


def pack_q6_k_blocks(blocks: torch.Tensor) -> PackedWeight:
    """Q6_K rows as a GGUF stores them (uint8 [out, in / 256 * 210]) packed for
    csrc/gemm_q6k.cpp, which multiplies them as they are."""
    packed = torch.ops.rankcast.pack_q6k_weight(blocks)
    return PackedWeight(packed, "rankcast", blocks.shape[0], quantization="q6_k")


def packed_linear(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [rows, in] times a packed weight (+ bias)."""
    if weight.quantization == "q6_k":
        return cast(
            torch.Tensor,
            torch.ops.rankcast.q6k_linear(x.contiguous(), weight.tensor, weight.out_features, bias),
        )
    if weight.quantization in FOUR_BIT:
        if weight.groups is not None:
            d, m = weight.groups
            return q4_1_linear_reference(x, weight.tensor, d, m, bias, exact=False)
        return cast(
            torch.Tensor,
            torch.ops.rankcast.q4_linear(x.contiguous(), weight.tensor, weight.out_features, bias),
        )
    if weight.quantization == "q8_0":
        if weight.groups is not None:
            (d,) = weight.groups
            return q8_0_linear_reference(x, weight.tensor, d, bias, exact=False)
        return cast(
            torch.Tensor,
            torch.ops.rankcast.q8_linear(x.contiguous(), weight.tensor, weight.out_features, bias),
        )
    if weight.scales is not None and weight.backend == "torch":
        if weight.quantization == "w8a8":
            return w8a8_linear_reference(x, weight.tensor, weight.scales, bias, exact=False)
        return int8_weight_reference(x, weight.tensor, weight.scales, bias)
    if weight.quantization == "w8a8":
        return cast(
            torch.Tensor,
            torch.ops.rankcast.w8a8_linear(
                x.contiguous(), weight.tensor, weight.out_features, weight.scales, bias
            ),
        )
    if weight.backend == "rankcast":
        return cast(
            torch.Tensor,
            torch.ops.rankcast.packed_linear(
                x.contiguous(), weight.tensor, weight.out_features, bias, weight.scales
            ),
        )
    return cast(
        torch.Tensor,
        torch.ops.mkldnn._linear_pointwise(x, weight.tensor, bias, "none", [], ""),
    )


def lora_kernel_applies(weight: torch.Tensor) -> bool:
    """Whether LoRA deltas on a model with this parameter go through csrc/lora.cpp (the CPU,
    float32 or bfloat16 activations, the kernels built) rather than torch's masked matmuls."""
    return kernels.available(weight)


def lora_tiles_apply(weight: torch.Tensor) -> bool:
    """Whether a model with this parameter keeps its adapters in bfloat16 packed for AMX tiles
    (csrc/lora_amx.cpp): a bfloat16 model on the CPU, the kernels built with AMX and the OS
    granting this process the tiles; elsewhere the kernel's slots are float32."""
    return (
        lora_kernel_applies(weight)
        and weight.dtype == torch.bfloat16
        and bool(torch.ops.rankcast.lora_tiles_supported())
    )


def can_fuse_layers(attention: torch.nn.Module) -> bool:
    """Whether the C++ decoder stack can run layers shaped like this attention's: the kernels
    are built and take the cache's dtype (16-bit, or 8-bit with its scales), and the head size
    suits the attention kernel."""
    cache = getattr(attention, "key_cache", None)
    head_dim = getattr(attention, "head_dim", 0)
    if cache is None or head_dim % 16 != 0:
        return False
    if kv_quant.is_8bit(cache.dtype):
        return cache.device.type == "cpu" and kernels.load()
    return kernels.available(cache)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's largest logit's index (greedy sampling), without a float32 copy on CPU."""
    if kernels.available(logits) and logits.dim() == 2 and logits.stride(1) == 1:
        return cast(torch.Tensor, torch.ops.rankcast.argmax_rows(logits))
    return logits.argmax(dim=-1)


_BIT_SHIFTS: dict[torch.device, torch.Tensor] = {}


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """In place, -inf for every token whose bit is clear in its row's mask (int32 words, bit t
    of the row keeps token t; llguidance's layout), on the named rows of `logits` only; tokens
    beyond the mask's width are blocked."""
    if kernels.available(logits) and logits.dim() == 2 and logits.stride(1) == 1:
        index = torch.tensor(rows, dtype=torch.long)
        torch.ops.rankcast.apply_token_bitmask(logits, index, bitmask.contiguous())
        return
    device = logits.device
    shifts = _BIT_SHIFTS.get(device)
    if shifts is None:
        shifts = _BIT_SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    words = bitmask.to(device)
    blocked = ((words.unsqueeze(-1) >> shifts) & 1 == 0).view(len(rows), -1)
    vocab = logits.shape[1]
    if blocked.shape[1] < vocab:
        blocked = F.pad(blocked, (0, vocab - blocked.shape[1]), value=True)
    index = torch.tensor(rows, device=device)
    logits[index] = logits[index].masked_fill(blocked[:, :vocab], float("-inf"))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32. A weight of x's dtype scales the row after it is rounded to that
    dtype (as HF's Llama does); a float32 weight on lower-precision rows (Gemma's 1 + w) scales
    it before the one rounding (`(norm(x.float()) * w).to(x.dtype)`, as Gemma's reference does).
    """
    if kernels.available(x) and x.dim() == 2 and x.stride(1) == 1:
        return cast(torch.Tensor, torch.ops.rankcast.rms_norm(x, weight, eps))
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    normed = F.rms_norm(x.float(), weight.shape, None, eps)
    if weight.dtype == torch.float32:
        return (normed * weight).to(x.dtype)
    return normed.to(x.dtype) * weight


def head_rms_norm_(heads: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """RMSNorm of each head of `heads` [T, H, D] over its D values, in place (Qwen3's q_norm and
    k_norm, one weight of D shared by the heads). `heads` is a view into the fused projection's
    output, whose rows are not evenly strided once split by head: its values are gathered into
    [T * H, D] rows for `rms_norm` (the same per-row numerics as the block's norms) and written
    back."""
    rows = heads.reshape(-1, heads.shape[-1])
    heads.copy_(rms_norm(rows, weight, eps).view(heads.shape))


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual); the kernel adds into `residual` in place."""
    if kernels.available(x) and x.dim() == 2 and x.stride(1) == 1 and residual.is_contiguous():
        return torch.ops.rankcast.add_rms_norm(x, residual, weight, eps), residual
    total = x + residual
    return rms_norm(total, weight, eps), total


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GELU(gate) (its tanh approximation, transformers' gelu_pytorch_tanh) * up for
    x = [gate | up]: Gemma's GeGLU."""
    if kernels.available(x) and x.dim() == 2 and x.stride(1) == 1:
        return cast(torch.Tensor, torch.ops.rankcast.gelu_tanh_and_mul(x))
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for x = [gate | up] along the last dimension."""
    if kernels.available(x) and x.dim() == 2 and x.stride(1) == 1:
        return cast(torch.Tensor, torch.ops.rankcast.silu_and_mul(x))
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary_embedding_cache(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    key_cache: torch.Tensor | None,
    value_cache: torch.Tensor | None,
    slot_mapping: torch.Tensor,
    heads: int,
    kv_heads: int,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
) -> None:
    """Rotate the query and key heads of `qkv` [T, (H + 2 Hkv) D] in place (rotate-half RoPE),
    then write each token's key and value into its cache slot (slot -1: not written).

    Caches are laid out as `key_cache [blocks, Hkv, D, block_size]` (keys transposed within a
    block) and `value_cache [blocks, Hkv, block_size, D]`; see `attention.py`. An 8-bit cache
    (kv_quant.py) takes each token's head as bytes and its scale into `key_scale` /
    `value_scale` [blocks, Hkv, block_size].
    """
    if kernels.available(qkv) and qkv.stride(1) == 1:
        torch.ops.rankcast.rotary_embedding_cache(
            qkv,
            positions,
            cos_sin,
            key_cache,
            value_cache,
            slot_mapping,
            heads,
            kv_heads,
            key_scale,
            value_scale,
        )
        return
    head_dim = cos_sin.shape[1]
    half = head_dim // 2
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(-1, heads + kv_heads, head_dim)
    table = cos_sin[positions].to(qkv.dtype)
    cos = table[:, None, :half].repeat(1, 1, 2)
    sin = table[:, None, half:].repeat(1, 1, 2)
    rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
    qk.copy_(qk * cos + rotated * sin)
    if key_cache is None or value_cache is None:
        return
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_size = key_cache.shape[-1]
    blocks, offsets = slots // block_size, slots % block_size
    k = qk[keep][:, heads:]
    v = qkv[keep][:, (heads + kv_heads) * head_dim :].view(-1, kv_heads, head_dim)
    if key_scale is not None and value_scale is not None:
        k, key_scale[blocks, :, offsets] = kv_quant.quantize_heads(k, key_cache.dtype)
        v, value_scale[blocks, :, offsets] = kv_quant.quantize_heads(v, value_cache.dtype)
    key_cache[blocks, :, :, offsets] = k
    value_cache[blocks, :, offsets] = v


def paged_kernel_applies(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Whether `paged_attention` runs the CPU kernel for these tensors. Where it does it is
    also the faster way to attend whole prompts (measured on 2 cores: 32 prompts of 38 tokens
    0.4 ms a layer against 2.4 ms for a causal SDPA per prompt; one of 1,100 tokens 5 against
    12 ms), so the model uses it for every step."""
    return (
        kernels.available(query)
        and query.stride(2) == 1
        and (key_cache.dtype == query.dtype or kv_quant.is_8bit(key_cache.dtype))
        and query.shape[2] % 16 == 0
    )


def paged_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start: torch.Tensor,
    scale: float,
    query_lens: list[int],
    window: int = 0,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
) -> None:
    """Causal attention of each sequence's new queries over its whole cached context, into `out`
    [T, H, D]. Sequence b's queries are rows `query_start[b]:query_start[b+1]` and are its last
    positions among `seq_lens[b]` cached tokens (the current step's K/V already written).

    With a sliding `window` (> 0), a query at position p sees only keys p - window + 1 .. p (as
    transformers' sliding mask has it), and blocks wholly behind every query's window are never
    read: the engine may have freed them. The kernel reads the cache blocks in place; the torch
    path gathers each sequence's context. An 8-bit cache is read with its per-token
    `key_scale` / `value_scale` (kv_quant.py).
    """
    if paged_kernel_applies(query, key_cache):
        torch.ops.rankcast.paged_attention(
            out,
            query,
            key_cache,
            value_cache,
            block_tables,
            seq_lens,
            query_start,
            scale,
            window,
            key_scale,
            value_scale,
        )
        return
    if all(n == 1 for n in query_lens):
        out.copy_(
            _decode_reference(
                query,
                key_cache,
                value_cache,
                block_tables,
                seq_lens,
                scale,
                window,
                key_scale,
                value_scale,
            )
        )
        return
    kv_heads, head_dim, block_size = key_cache.shape[1:]
    start = 0
    for b, n in enumerate(query_lens):
        length = int(seq_lens[b])
        # Blocks wholly behind the first query's window are left out (never gathered).
        skip = max(0, length - n + 1 - window) // block_size if window else 0
        blocks = block_tables[b, skip : -(-length // block_size)].long()
        first = skip * block_size
        keys = kv_quant.read_blocks(key_cache, key_scale, blocks, query.dtype, keys=True)
        keys = keys.permute(1, 0, 3, 2).reshape(kv_heads, -1, head_dim)
        values = kv_quant.read_blocks(value_cache, value_scale, blocks, query.dtype, keys=False)
        values = values.transpose(0, 1).reshape(kv_heads, -1, head_dim)
        keys, values = keys[:, : length - first], values[:, : length - first]
        q = query[start : start + n].transpose(0, 1)
        # Query i sits at position length - n + i and sees keys up to there (and, with a
        # window, from window - 1 before it).
        key_positions = torch.arange(first, length, device=q.device)
        query_positions = torch.arange(n, device=q.device)[:, None] + length - n
        visible = key_positions <= query_positions
        if window:
            visible &= key_positions > query_positions - window
        out[start : start + n] = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=visible, scale=scale, enable_gqa=True
        ).transpose(0, 1)
        start += n


def _decode_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One new token per sequence: one gather and one SDPA call for the whole batch. (Blocks
    behind a window are gathered too, and masked: their contents must be finite.)"""
    batch, heads, head_dim = query.shape
    kv_heads, block_size = key_cache.shape[1], key_cache.shape[3]
    context = int(seq_lens.max())
    tables = block_tables[:, : -(-context // block_size)].long()
    keys = kv_quant.read_blocks(key_cache, key_scale, tables, query.dtype, keys=True)
    keys = keys.permute(0, 2, 1, 4, 3).flatten(2, 3)[:, :, :context]
    values = kv_quant.read_blocks(value_cache, value_scale, tables, query.dtype, keys=False)
    values = values.transpose(1, 2).flatten(2, 3)[:, :, :context]
    key_positions = torch.arange(context, device=query.device)
    beyond = key_positions >= seq_lens[:, None]
    if window:
        beyond |= key_positions <= seq_lens[:, None] - 1 - window
    bias = torch.zeros(beyond.shape, dtype=query.dtype, device=query.device)
    bias = bias.masked_fill_(beyond, float("-inf"))[:, None, None, :]
    # Fold the query heads that share a KV head into the query length: no KV repetition.
    grouped = query.view(batch, kv_heads, heads // kv_heads, head_dim)
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=bias, scale=scale)
    return out.reshape(batch, heads, head_dim)
