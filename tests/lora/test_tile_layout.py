"""The packing csrc/lora_amx.cpp reads (rankcast/lora/tile_layout.py), element by element as
its docstring states it, on every CPU (the kernel itself is tested on AMX machines only)."""

from __future__ import annotations

import pytest
import torch

from rankcast.lora.tile_layout import a_shape, b_shape, fits_tiles, pack_a, pack_b, tile_rank


def test_the_tile_rank_is_even_up_to_16_then_whole_tiles() -> None:
    ranks = {1: 2, 2: 2, 3: 4, 8: 8, 15: 16, 16: 16, 17: 32, 32: 32, 33: 64, 64: 64}
    assert {rank: tile_rank(rank) for rank in ranks} == ranks
    assert fits_tiles(192) and not fits_tiles(72)


@pytest.mark.parametrize(("rank", "in_size"), [(8, 64), (3, 40), (16, 96), (20, 33)])
def test_a_is_packed_as_panels_of_rank_rows_over_pairs_of_k(rank: int, in_size: int) -> None:
    """[P, K/2, w, 2]: element [p, k // 2, j, k % 2] is A[w p + j, k]; zero past the rank and
    the input (K rounded up to 32)."""
    gen = torch.Generator().manual_seed(rank)
    a = torch.randn(2, rank, in_size, generator=gen).bfloat16()
    packed = pack_a(a)
    panels, half_k, width, _ = a_shape(rank, in_size)
    assert packed.shape == (2, panels, half_k, width, 2) and packed.is_contiguous()
    assert width == min(tile_rank(rank), 16) and half_k * 2 % 32 == 0
    for s in range(2):
        for p in range(panels):
            for k in range(2 * half_k):
                for j in range(width):
                    row = width * p + j
                    want = a[s, row, k] if row < rank and k < in_size else 0
                    assert packed[s, p, k // 2, j, k % 2] == want, (s, p, k, j)


@pytest.mark.parametrize(("rank", "out_size"), [(8, 32), (3, 16), (20, 48)])
def test_b_is_packed_as_panels_of_16_columns_over_pairs_of_rank(rank: int, out_size: int) -> None:
    """[n/16, kr/2, 16, 2]: element [c, j // 2, i, j % 2] is B[j, 16 c + i] (B transposed,
    [rank, n]); zero past the rank."""
    gen = torch.Generator().manual_seed(rank)
    b = torch.randn(rank, out_size, generator=gen).bfloat16()
    packed = pack_b(b)
    assert packed.shape == b_shape(rank, out_size) and packed.is_contiguous()
    for c in range(out_size // 16):
        for j in range(tile_rank(rank)):
            for i in range(16):
                want = b[j, 16 * c + i] if j < rank else 0
                assert packed[c, j // 2, i, j % 2] == want, (c, j, i)
