"""Quantizing a linear layer's weights, and what each quantized matmul computes in plain torch.

The schemes of `--quantization` (docs/quantization.md): int8 per output channel (weight-only
`int8`, and `w8a8` whose rows are quantized per token too) and llama.cpp's Q4_1 (`q4_1`) and
Q8_0 (`q8_0`). The quantizers run once at load; the references are the arithmetic the CPU
kernels (csrc/gemm.cpp, gemm_w8a8.cpp, gemm_q4.cpp, gemm_q8.cpp) are tested against, and what
the model runs where they are not built (CUDA, `RANKCAST_KERNELS=off`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def quantize_int8_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel: (values in [-127, 127] as int8 [out, in], float32
    scales [out]) with weight ~= values * scales[:, None]. Per channel rather than per group
    keeps the kernel's inner loop pure integer; the perplexity this costs is measured in
    bench/perplexity.py."""
    values, scales = _quantize_rows(weight.float())
    return values.to(torch.int8), scales


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of float32 `x` to integers in [-127, 127] (as float32) and its scale
    max|row| / 127, rounding half to even: the arithmetic csrc/gemm_w8a8.cpp does for
    activations, so that the reference below matches the kernel bit for bit."""
    amax = x.abs().amax(dim=1)
    # A true division: `127.0 / amax` would be torch's reciprocal-then-multiply, another rounding.
    inverse = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    values = torch.round(x * inverse[:, None]).clamp_(-127, 127)
    return values, amax / 127


# The schemes a linear's weight can be stored in (`--quantization` adds "none" and "auto"); the
# 4-bit ones share one kernel (Q4_0 is Q4_1's arithmetic with m = -8 d).
SCHEMES = ("int8", "w8a8", "q4_0", "q4_1", "q8_0")
FOUR_BIT = ("q4_0", "q4_1")
GROUP = 32  # k per group of the group schemes (llama.cpp's Q4_0, Q4_1 and Q8_0 blocks)


def _groups(weight: torch.Tensor) -> torch.Tensor:
    """A [out, in] weight as float32 groups [out, in32 / 32, 32], zero-padded to whole groups."""
    out, k = weight.shape
    padded = -(-k // GROUP) * GROUP
    return F.pad(weight.float(), (0, padded - k)).view(out, padded // GROUP, GROUP)


def quantize_q4_1_weight(
    weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """llama.cpp's Q4_1 of a [out, in] weight: groups of 32 along `in` (zero-padded to whole
    groups), each w ~= d * q + m with q in 0..15, m the group's minimum and d its range / 15;
    (q as uint8 [out, in32], d and m as float16 [out, in32 / 32]). A weight that came from a
    Q4_1 GGUF (the embedded SmolLM2) gives back that file's values: its groups hold q = 0 and
    q = 15, so the minimum and range are the file's m and 15 d."""
    w = _groups(weight)
    low, high = w.amin(dim=2), w.amax(dim=2)
    scale = (high - low) / 15
    inverse = torch.where(scale != 0, 1 / scale, torch.zeros_like(scale))
    values = torch.floor((w - low[..., None]) * inverse[..., None] + 0.5).clamp_(0, 15)
    return values.to(torch.uint8).flatten(1), scale.half(), low.half()


def quantize_q4_0_weight(
    weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """llama.cpp's Q4_0 of a [out, in] weight, as Q4_1's arithmetic takes it: groups of 32,
    w ~= d * (q - 8) with q in 0..15 and d = (the group's element of largest |w|) / -8, so
    (q as uint8 [out, in32], d and m = -8 d as float16 [out, in32 / 32]), m exact. A weight that
    came from a Q4_0 GGUF gives back that file's values: its largest |w| is its q = 0 element,
    -8 d exactly; so a Q4_0 file runs through csrc/gemm_q4.cpp as it is."""
    w = _groups(weight)
    index = w.abs().argmax(dim=2, keepdim=True)  # the first of equals, as llama.cpp takes it
    scale = w.gather(2, index) / -8
    inverse = torch.where(scale != 0, 1 / scale, torch.zeros_like(scale))
    values = torch.floor(w * inverse + 8.5).clamp_(0, 15)  # llama.cpp: (int8)(x * id + 8.5)
    d = scale[..., 0].half()
    return values.to(torch.uint8).flatten(1), d, (d.float() * -8).half()


def quantize_q8_0_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's Q8_0 of a [out, in] weight: groups of 32 along `in` (zero-padded to whole
    groups), each w ~= d * q with q in -127..127 and d the group's max |w| / 127; (q as int8
    [out, in32], d as float16 [out, in32 / 32]). q is rounded against the float16 d, so a
    weight that came from a Q8_0 GGUF (every group holds a q of +-127, d * q exact in float32)
    gives back that file's values. A group that already lies on Q5_0's grid (w = d * i with i
    in -16..15 and d its element of largest |w| over -16, as llama.cpp writes Q5_0, and so also
    Q4_0's, whose i in -8..7 are the even ones of d / 2) keeps that grid's d and integers
    exactly: the group sums the kernel makes are then the file's own, and a GGUF mixing Q8_0 and
    Q5_0 tensors (llama.cpp's K-quant mixes on models whose rows are not a multiple of 256 wide)
    runs as 8-bit groups without rounding any weight again."""
    w = _groups(weight)
    low, high = torch.aminmax(w, dim=2)
    scale = (torch.maximum(high, -low) / 127).half()
    d = scale.float()[..., None]
    values = torch.where(d != 0, torch.round(w / torch.where(d != 0, d, 1.0)), 0.0)
    values = values.clamp_(-127, 127)
    # Q5_0's grid: its extreme element is its only one at i = -16 (i = +16 does not exist).
    grid = (torch.where(-low >= high, low, high) / -16).half()
    step = grid.float()[..., None]
    steps = torch.round(w / torch.where(step != 0, step, 1.0))
    exact = (steps * step == w) & (steps >= -16) & (steps < 16)
    on_grid = exact.all(dim=2) & (grid != 0)
    scale = torch.where(on_grid, grid, scale)
    values = torch.where(on_grid[..., None], steps, values)
    return values.to(torch.int8).flatten(1), scale


def _quantize_rows_15(x: torch.Tensor, padded: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of `x` to 15-bit integers (as float32, zero-padded to `padded` columns) and its
    scale max|row| / 16383: what csrc/quantize_rows.h does for the 4- and 8-bit group kernels."""
    amax = x.float().abs().amax(dim=1)
    inverse = torch.where(amax > 0, torch.full_like(amax, 16383.0) / amax, torch.zeros_like(amax))
    rows = torch.round(x.float() * inverse[:, None]).clamp_(-16383, 16383)
    return F.pad(rows, (0, padded - x.shape[1])), amax / 16383


def q8_0_linear_reference(
    x: torch.Tensor,
    values: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    exact: bool = True,
) -> torch.Tensor:
    """x times 8-bit group weights as csrc/gemm_q8.cpp computes it: `_group_linear_reference`
    without minimums."""
    return _group_linear_reference(x, values, scales, None, bias, exact)


def q4_1_linear_reference(
    x: torch.Tensor,
    values: torch.Tensor,
    scales: torch.Tensor,
    minimums: torch.Tensor,
    bias: torch.Tensor | None,
    exact: bool = True,
) -> torch.Tensor:
    """x times 4-bit weights as csrc/gemm_q4.cpp computes it: `_group_linear_reference`."""
    return _group_linear_reference(x, values, scales, minimums, bias, exact)


Q6_K_BLOCK = 256  # k a Q6_K super-block
Q6_K_BLOCK_BYTES = 210  # ql[128] | qh[64] | int8 scales[16] | float16 d


def unpack_q6_k(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """llama.cpp's Q6_K rows (uint8 [out, in / 256 * 210], as a GGUF file stores them) as
    `q6_k_linear_reference` takes them (csrc/gemm_q6k.cpp's `pack_q6k_weight` reads the
    stored blocks itself): d float16 [out, in / 256], the sub-block scales int8
    [out, in / 16] and the 6-bit values uint8 [out, in] (0..63); a weight is d * sc * (q - 32).

    A block's 256 values are stored as two halves of 128: in half h, for l in 0..31, the low
    nibble of ql[64h + l] and bits 0-1 of qh[32h + l] make value l, the low nibble of
    ql[64h + 32 + l] and bits 2-3 value 32 + l, the high nibbles with bits 4-5 and 6-7 values
    64 + l and 96 + l (ggml's dequantize_row_q6_K)."""
    out = raw.shape[0]
    blocks = raw.view(torch.uint8).reshape(out, -1, Q6_K_BLOCK_BYTES).to(torch.int32)
    n_blocks = blocks.shape[1]
    ql = blocks[..., :128].reshape(out, n_blocks, 2, 2, 32)  # [half][first, second 32][l]
    qh = blocks[..., 128:192].reshape(out, n_blocks, 2, 1, 32)
    low = torch.cat([ql & 0xF, ql >> 4], dim=3)  # [half][4 quarters][l], quarters in order
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.int32).view(1, 1, 1, 4, 1)
    high = (qh >> shifts) & 3
    q = (low | (high << 4)).reshape(out, n_blocks * Q6_K_BLOCK).to(torch.uint8)
    scales = blocks[..., 192:208].to(torch.uint8).view(torch.int8).reshape(out, n_blocks * 16)
    d = blocks[..., 208:210].to(torch.uint8).contiguous().view(torch.float16).reshape(out, -1)
    return d, scales, q


def q6_k_linear_reference(
    x: torch.Tensor,
    d: torch.Tensor,
    scales: torch.Tensor,
    q: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """x times Q6_K weights (`unpack_q6_k`'s d, sc and q) as csrc/gemm_q6k.cpp computes it, up
    to the order of its float32 sums (here float64): each row's blocks of 256 quantized to int8
    (a = round(x * 127 / max|x|), scale s_b = max|x| / 127, as llama.cpp's Q8_K rows), each
    sub-block's integer sum of (q - 32) * a, then the sum over blocks and sub-blocks of
    s_b * d * sc * that, + bias, rounded once to x's dtype."""
    rows, k = x.shape
    blocks = x.float().reshape(rows, k // Q6_K_BLOCK, Q6_K_BLOCK)
    amax = blocks.abs().amax(dim=2, keepdim=True)
    top = torch.tensor(127.0)
    inverse = torch.where(amax > 0, top / amax, torch.zeros_like(amax))
    ints = torch.round(blocks * inverse).clamp(-127, 127)  # half to even, as the kernel rounds
    block_scales = (amax / top).to(torch.float64)  # [rows, blocks, 1]
    a = ints.to(torch.float64).reshape(rows, -1, 16)  # [rows, sub-blocks, 16]
    values = (q.to(torch.float64) - 32).reshape(q.shape[0], -1, 16)
    sums = torch.einsum("rsk,osk->ros", a, values)  # exact integers
    weights = d.to(torch.float64).repeat_interleave(16, dim=1) * scales.to(torch.float64)
    scaled = sums * weights * block_scales.repeat_interleave(16, dim=1).view(rows, 1, -1)
    y = scaled.sum(dim=2).float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def _group_linear_reference(
    x: torch.Tensor,
    values: torch.Tensor,
    scales: torch.Tensor,
    minimums: torch.Tensor | None,
    bias: torch.Tensor | None,
    exact: bool,
) -> torch.Tensor:
    """x times group weights (q [out, in32], d and m [out, in32 / 32]) as the 15-bit group
    kernels compute it, up to the order of their float32 sums: each row quantized to 15-bit
    integers a (scale max|x| / 16383), each group's integer sum of q * a (and, with minimums,
    its sum of a), then scale * sum over groups of (d * that + m * sum(a)) + bias, rounded once
    to x's dtype. `exact=False` (the torch path where the kernels are not built) sums in
    float32 rather than float64."""
    out, padded = values.shape
    flat, row_scales = _quantize_rows_15(x, padded)
    accumulate = torch.float64 if exact else torch.float32
    rows = flat.view(x.shape[0], -1, GROUP).to(accumulate)
    q = values.view(out, -1, GROUP).to(accumulate)
    terms = torch.einsum("rgk,ogk->rog", rows, q) * scales.to(accumulate)  # [rows, out, groups]
    if minimums is not None:
        terms = terms + rows.sum(dim=2)[:, None, :] * minimums.to(accumulate)
    y = (terms.sum(dim=2) * row_scales.to(accumulate)[:, None]).float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def int8_weight_reference(
    x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [rows, in] times int8 weights, weight-only (what csrc/gemm.cpp computes for them, up to
    the order of float32 sums): (x @ values^T) * scales + bias, in float32, rounded once to x's
    dtype. The rows are not quantized, so the only cost in quality is the weights' rounding."""
    y = F.linear(x.float(), values.float()) * scales
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def w8a8_linear_reference(
    x: torch.Tensor,
    values: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    exact: bool = True,
) -> torch.Tensor:
    """x [rows, in] times int8 weights (`values` [out, in], `scales` [out]) in plain torch, as
    csrc/gemm_w8a8.cpp computes it: each row quantized to int8 with its own scale, the integer
    products summed exactly (float64 holds every such sum; `exact=False` sums in float32, the
    faster path where the kernels are not built, rounding sums beyond 2^24), then
    ((sum * weight scale) * row scale) + bias, rounded once to x's dtype."""
    rows, row_scales = _quantize_rows(x.float())
    accumulate = torch.float64 if exact else torch.float32
    sums = (rows.to(accumulate) @ values.to(accumulate).T).float()
    y = sums * scales * row_scales[:, None]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
