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


def compute_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies for the rotated half-dimensions, after any configured scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ModelFormatError(f"config.json: rope scaling type {kind!r} is not supported")


class RotaryEmbedding(nn.Module):
    """The rotate-half RoPE table that HF checkpoints assume, as one float32 `cos_sin` buffer:
    row p is `cos(p * inv_freq) | sin(p * inv_freq)`, so a kernel reads one row per token."""

    cos_sin: torch.Tensor

    def __init__(
        self, head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        inv_freq = compute_inv_freq(head_dim, theta, scaling)
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        # Kept in float32 whatever the model's dtype, like the reference's table.
        table = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(torch.float32)
        self.register_buffer("cos_sin", table, persistent=False)
