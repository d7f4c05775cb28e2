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
    context_lens: torch.Tensor | None = None  # decode: [batch] tokens attended, incl. the new one
    max_context_len: int = 0


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
        assert meta.context_lens is not None
        batch = q.shape[0]
        group = self.num_heads // self.num_kv_heads
        blocks = meta.block_tables
        # Gather this batch's blocks: [B, max_blocks, block, Hkv, D] -> [B, Hkv, L, D].
        keys = self.kv_cache[0][blocks].flatten(1, 2)[:, : meta.max_context_len]
        values = self.kv_cache[1][blocks].flatten(1, 2)[:, : meta.max_context_len]
        keys = keys.permute(0, 2, 3, 1)  # [B, Hkv, D, L]
        values = values.transpose(1, 2)  # [B, Hkv, L, D]
        qg = q.view(batch, self.num_kv_heads, group, self.head_dim)
        scores = torch.matmul(qg, keys).float() * self.scale  # [B, Hkv, G, L]
        positions = torch.arange(meta.max_context_len, device=q.device)
        pad = positions.unsqueeze(0) >= meta.context_lens.unsqueeze(1)  # [B, L]
        scores.masked_fill_(pad[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        out = torch.matmul(probs, values)  # [B, Hkv, G, D]
        return out.reshape(batch, self.num_heads * self.head_dim)
