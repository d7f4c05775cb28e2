"""Rotary position embedding with the scaling variants Llama-family configs name."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from rankcast.errors import ModelFormatError


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: long wavelengths slowed, short ones kept."""
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def compute_inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, long: bool = False
) -> torch.Tensor:
    """Inverse frequencies for the rotated half-dimensions, after any configured scaling.
    `head_dim` is the rotated width (Phi-3's rotary_dim where it rotates only part of a head).
    LongRoPE divides each frequency by its factor, the short ones or (`long`) the long ones."""
    shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "longrope":
        assert scaling is not None
        factors = torch.tensor(
            scaling["long_factor" if long else "short_factor"], dtype=torch.float32
        )
        # As transformers' _compute_longrope_parameters, operation for operation.
        return 1.0 / (factors * theta**shape)
    inv_freq = 1.0 / (theta**shape)
    if kind == "default":
        return inv_freq
    assert scaling is not None
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ModelFormatError(f"config.json: rope scaling type {kind!r} is not supported")


def _cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float) -> torch.Tensor:
    freqs = torch.outer(positions, inv_freq)
    cos, sin = freqs.cos(), freqs.sin()
    if scale != 1.0:  # LongRoPE's attention factor, on the rotated dims only
        cos, sin = cos * scale, sin * scale
    return torch.cat((cos, sin), dim=-1)


class RotaryEmbedding(nn.Module):
    """The rotate-half RoPE table that HF checkpoints assume, as one float32 `cos_sin` buffer:
    row p is `cos(p * inv_freq) | sin(p * inv_freq)`, so a kernel reads one row per token.

    Partial rotary (Phi-3: `rotary_dim` < `head_dim`): the kernels rotate pairs (i, i + D/2)
    of a head of D values, HF the first rotary_dim values as pairs (i, i + rotary_dim/2) and
    passes the rest through. The model stores each q and k head with its dims reordered
    (`partial_rotary_order`: the rotated halves at 0 and D/2, the passed-through dims after
    each), which leaves q.k unchanged, and the table's rows for those extra pairs are cos 1,
    sin 0 exactly: the same fused kernel then rotates HF's pairs and leaves the rest as they
    are (x * 1 - y * 0 == x).

    LongRoPE (Phi-3's "longrope"): row p takes the short factors where p is within
    `original_max_position_embeddings`, the long ones beyond. A token's rotation depends on its
    position only, never on what else is in the batch or how its prompt was chunked: exact
    against transformers' own cached generation for every prompt within the original length
    (transformers switches by the largest position of each forward call, which there is the
    token's own), and for a longer prompt fed as transformers' cache would take it in two
    calls at the boundary. transformers given a longer prompt in one call rotates all of it
    with the long factors; rankcast keeps the positions within the original length on the
    short ones (docs/models.md).
    """

    cos_sin: torch.Tensor

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        scaling: dict[str, Any] | None,
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__()
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        positions = torch.arange(max_position, dtype=torch.float32)
        scale = 1.0
        if scaling and scaling.get("rope_type") == "longrope":
            scale = float(scaling["attention_factor"])
            boundary = min(int(scaling["original_max_position_embeddings"]), max_position)
            short = compute_inv_freq(rotary_dim, theta, scaling)
            long = compute_inv_freq(rotary_dim, theta, scaling, long=True)
            table = torch.cat(
                (
                    _cos_sin(positions[:boundary], short, scale),
                    _cos_sin(positions[boundary:], long, scale),
                )
            )
        else:
            table = _cos_sin(positions, compute_inv_freq(rotary_dim, theta, scaling), scale)
        if rotary_dim < head_dim:
            # The passed-through pairs: cos 1 and sin 0 exactly.
            half, pad = rotary_dim // 2, (head_dim - rotary_dim) // 2
            ones = torch.ones(max_position, pad, dtype=torch.float32)
            zeros = torch.zeros(max_position, pad, dtype=torch.float32)
            table = torch.cat((table[:, :half], ones, table[:, half:], zeros), dim=-1)
        # Kept in float32 whatever the model's dtype, like the reference's table.
        self.register_buffer("cos_sin", table.to(torch.float32), persistent=False)


def partial_rotary_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """The order a partially rotated q or k head's values are stored in (index i holds HF's
    value order[i]): HF's rotated pairs (j, j + rotary_dim/2) moved to (j, j + head_dim/2), the
    passed-through values filling the rest of each half in their order."""
    half, pad = rotary_dim // 2, (head_dim - rotary_dim) // 2
    return torch.cat(
        (
            torch.arange(0, half),
            torch.arange(rotary_dim, rotary_dim + pad),
            torch.arange(half, rotary_dim),
            torch.arange(rotary_dim + pad, head_dim),
        )
    )
