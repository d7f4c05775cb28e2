"""Attention over a paged KV cache, in plain torch so it runs on CPU and CUDA alike.

The cache of one layer is `[2, num_blocks, block_size, kv_heads, head_dim]`; a sequence owns a
list of blocks (its block table) and token t of it lives in slot
`block_table[t // block_size] * block_size + t % block_size`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class AttentionMetadata:
    """What one step's attention needs besides q, k, v; built by the model runner.

    A step is either all prefills (each sequence computed from position 0) or all decodes (one new
    token per sequence), which keeps each path a single simple kernel sequence.
    """

    is_prefill: bool
    slot_mapping: torch.Tensor  # [num_tokens] cache slot each new token's K/V is written to
    query_lens: list[int]  # prefill: tokens per sequence
    block_tables: torch.Tensor | None = None  # decode: [batch, max_blocks]
    attn_bias: torch.Tensor | None = None  # decode: [batch, 1, 1, max_context] 0 or -inf
    max_context_len: int = 0
    # Rotary cos/sin rows for this step's positions, filled once per forward by the model.
    rope_cos: torch.Tensor | None = None
    rope_sin: torch.Tensor | None = None


class PagedAttention(nn.Module):
    """Writes the step's K/V into the cache, then attends (causal prefill or cached decode)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.kv_cache: torch.Tensor | None = None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] -> [T, H*D]."""
        if self.kv_cache is not None:
            flat = self.kv_cache.view(2, -1, self.num_kv_heads, self.head_dim)
            flat[0].index_copy_(0, meta.slot_mapping, k)
            flat[1].index_copy_(0, meta.slot_mapping, v)
        if meta.is_prefill:
            return self._prefill(q, k, v, meta.query_lens)
        return self._decode(q, meta)

    def _prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_lens: list[int]
    ) -> torch.Tensor:
        outputs = []
        start = 0
        for length in query_lens:
            end = start + length
            qs = q[start:end].transpose(0, 1).unsqueeze(0)
            ks = k[start:end].transpose(0, 1).unsqueeze(0)
            vs = v[start:end].transpose(0, 1).unsqueeze(0)
            out = F.scaled_dot_product_attention(
                qs, ks, vs, is_causal=True, scale=self.scale, enable_gqa=True
            )
            outputs.append(out.squeeze(0).transpose(0, 1))
            start = end
        out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

    def _decode(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        assert self.kv_cache is not None and meta.block_tables is not None
        batch = q.shape[0]
        group = self.num_heads // self.num_kv_heads
        # One gather for K and V: [2, B, max_blocks, block, Hkv, D] -> [2, B, Hkv, L, D] (strided).
        kv = self.kv_cache[:, meta.block_tables].flatten(2, 3)[:, :, : meta.max_context_len]
        kv = kv.transpose(2, 3)
        # The single new query of each sequence: fold the heads sharing a KV head into the query
        # length, so attention is one SDPA call with no KV repetition.
        qg = q.view(batch, self.num_kv_heads, group, self.head_dim)
        out = F.scaled_dot_product_attention(
            qg, kv[0], kv[1], attn_mask=meta.attn_bias, scale=self.scale
        )
        return out.reshape(batch, self.num_heads * self.head_dim)
