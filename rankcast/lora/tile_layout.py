"""Adapter slots packed for AMX tiles, the layout csrc/lora_amx.cpp multiplies.

On a CPU with AMX a bfloat16 model's adapters are held in bfloat16, each A and B already in the
shape a tile's second operand loads (up to 16 output columns of 16 pairs of k a tile), so an
activation stays one copy per slot place and the kernel packs nothing per step. An adapter is
packed once, when a rank makes its slot images (`LoRALinear.slot_images`).

With kr = `tile_rank(rank)`, w = min(kr, 16), P = kr / w and K = the input rounded up to 32:
- A [rank, in] becomes [P, K/2, w, 2]: element [p, k // 2, j, k % 2] is A[w p + j, k] (a
  panel of A no wider than the rank: at rank 8 half the bytes of 16 columns, half of float32's);
- B transposed [rank, n] becomes [n/16, kr/2, 16, 2]: element [c, j // 2, i, j % 2] is
  B[j, 16 c + i];
zeros everywhere else. n must be a multiple of 16 (`fits_tiles`).
"""

from __future__ import annotations

import torch

TILE_COLUMNS = 16  # output columns (float32 sums) of one tile
TILE_K = 32  # bfloat16 k of one tile (16 pairs)


def tile_rank(rank: int) -> int:
    """The rank the tiles take: even up to 16 (one panel of A that wide, one tile of `rank / 2`
    pairs in the expand), then a multiple of 32 (whole panels and tiles)."""
    return (rank + 1) // 2 * 2 if rank <= TILE_COLUMNS else -(-rank // TILE_K) * TILE_K


def fits_tiles(out_size: int) -> bool:
    """Whether a sub-projection's output fills whole panels of 16 columns, which the kernel
    writes whole (every model rankcast loads has such projections; a test's odd one keeps
    float32 slots)."""
    return out_size % TILE_COLUMNS == 0


def a_shape(rank: int, in_size: int) -> tuple[int, ...]:
    """One slot's packed A of one sub-projection."""
    kr = tile_rank(rank)
    width = min(kr, TILE_COLUMNS)
    return (kr // width, -(-in_size // TILE_K) * TILE_K // 2, width, 2)


def b_shape(rank: int, out_size: int) -> tuple[int, ...]:
    """One slot's packed B of one sub-projection."""
    return (out_size // TILE_COLUMNS, tile_rank(rank) // 2, TILE_COLUMNS, 2)


def pack_a(a: torch.Tensor) -> torch.Tensor:
    """[..., rank, in] -> [..., P, K/2, w, 2] bfloat16 (rounded once)."""
    *lead, rank, in_size = a.shape
    panels, half_k, width, _ = a_shape(rank, in_size)
    padded = torch.zeros(*lead, panels * width, 2 * half_k, dtype=torch.bfloat16)
    padded[..., :rank, :in_size] = a
    # A pair of k is adjacent already: move pairs as one 32-bit word (a transposing copy of
    # 2-byte elements was 7x slower, on a thread an adapter read shares with the forward pass).
    words = padded.view(torch.int32).view(*lead, panels, width, half_k)
    return _as_pairs(words.transpose(-2, -1).contiguous())


def pack_b(b: torch.Tensor) -> torch.Tensor:
    """B transposed, [..., rank, n] -> [..., n/16, kr/2, 16, 2] bfloat16 (rounded once)."""
    *lead, rank, out_size = b.shape
    panels, half_rank, _, _ = b_shape(rank, out_size)
    # Columns first, so that a pair of rank is adjacent and moves as one 32-bit word (as A).
    padded = torch.zeros(*lead, out_size, 2 * half_rank, dtype=torch.bfloat16)
    padded[..., :rank] = b.transpose(-2, -1)
    words = padded.view(torch.int32).view(*lead, panels, TILE_COLUMNS, half_rank)
    return _as_pairs(words.transpose(-2, -1).contiguous())


def _as_pairs(words: torch.Tensor) -> torch.Tensor:
    """32-bit words [..., w] as the bfloat16 pairs they hold, [..., w, 2]."""
    return words.view(torch.bfloat16).view(*words.shape, 2)
