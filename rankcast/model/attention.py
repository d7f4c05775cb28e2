"""Attention over a paged KV cache: rotary embedding, cache write and attention in one module.

A layer's cache is two tensors of `num_blocks` blocks, each holding `block_size` tokens:

    key_cache   [num_blocks, kv_heads, head_dim, block_size]   (keys transposed within a block)
    value_cache [num_blocks, kv_heads, block_size, head_dim]

A sequence owns a list of blocks (its block table); token t of it lives in block
`block_table[t // block_size]` at offset `t % block_size`, i.e. in slot
`block_table[t // block_size] * block_size + t % block_size`. Keys are stored dimension-major so
that the CPU kernel computes sixteen tokens' scores with one vector load per dimension
(`csrc/attention.cpp`); values stay token-major for the weighted sum.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from rankcast.model import ops


@dataclass
class AttentionMetadata:
    """What one step's attention needs besides the projections; built by the model runner.

    Sequence b contributes `query_lens[b]` tokens at the end of its `seq_lens[b]` tokens of
    context. When every sequence starts at position 0 (`from_scratch`), a prompt's attention
    needs nothing from the cache: without the CPU kernel it runs on the step's own K/V.
    """

    positions: torch.Tensor  # [T] int64 position of each token
    slot_mapping: torch.Tensor  # [T] int64 cache slot each token's K/V is written to
    query_lens: list[int]
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32 tokens of context after this step, per sequence
    query_start: torch.Tensor  # [B + 1] int32 first token of each sequence in the step
    from_scratch: bool
    # Rotary cos|sin rows of the whole table, shared by every layer (set by the model).
    cos_sin: torch.Tensor | None = field(default=None)
    # Gemma 3: the table of its sliding-window layers' own RoPE base (set by the model).
    local_cos_sin: torch.Tensor | None = field(default=None)
    # Where the windowed layers' caches form a KV-cache group of their own: their slots and
    # block tables (the group's blocks behind the window hold its null block).
    window_slot_mapping: torch.Tensor | None = field(default=None)
    window_block_tables: torch.Tensor | None = field(default=None)

    def for_group(self, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot mapping, block tables) of a layer whose cache is in KV-cache group `group`."""
        if group == 0:
            return self.slot_mapping, self.block_tables
        assert self.window_slot_mapping is not None and self.window_block_tables is not None
        return self.window_slot_mapping, self.window_block_tables

    # `positions` for layers without RoPE: every token at 0 (made on first use, once a step).
    unrotated_positions: torch.Tensor | None = field(default=None)

    def positions_for(self, rotates: bool) -> torch.Tensor:
        """The positions a layer's q and k are rotated by. A layer without RoPE (SmolLM3's) has
        each token read row 0 of the table, cos 1 and sin 0 exactly: the rotation then leaves q
        and k as they are (x * 1 + y * 0 == x), and the same fused kernel still writes the cache.
        """
        if rotates:
            return self.positions
        if self.unrotated_positions is None:
            self.unrotated_positions = torch.zeros_like(self.positions)
        return self.unrotated_positions


class PagedAttention(nn.Module):
    """Rotates q and k (unless the layer has no RoPE), writes the step's K/V into the cache, then
    attends: over the whole context, or with a sliding `window` over the last `window`
    positions (each query included), the layer's RoPE table the model's main one or, with
    `local_rope`, its local layers' (Gemma 3)."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotates: bool = True,
        scale: float | None = None,
        window: int = 0,
        local_rope: bool = False,
        kv_group: int = 0,
    ) -> None:
        super().__init__()
        self.rotates = rotates
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale if scale is not None else head_dim**-0.5
        self.window = window
        self.local_rope = local_rope
        self.kv_group = kv_group
        self.key_cache: torch.Tensor | None = None
        self.value_cache: torch.Tensor | None = None
        # An 8-bit cache's per-token scales [blocks, Hkv, block_size] (model/kv_quant.py).
        self.key_scale: torch.Tensor | None = None
        self.value_scale: torch.Tensor | None = None

    def forward(self, qkv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """qkv [T, (H + 2 Hkv) D], the fused projection's output -> [T, H*D]."""
        heads, kv_heads, d = self.num_heads, self.num_kv_heads, self.head_dim
        cos_sin = meta.local_cos_sin if self.local_rope else meta.cos_sin
        assert cos_sin is not None
        slot_mapping, block_tables = meta.for_group(self.kv_group)
        ops.rotary_embedding_cache(
            qkv,
            meta.positions_for(self.rotates),
            cos_sin,
            self.key_cache,
            self.value_cache,
            slot_mapping,
            heads,
            kv_heads,
            self.key_scale,
            self.value_scale,
        )
        q = qkv[:, : heads * d].view(-1, heads, d)
        if (
            self.key_cache is None
            or self.value_cache is None
            or (
                # A whole prompt attends over its own K/V, unless the cache is 8-bit: what a
                # later chunk or a prefix hit reads is the stored bytes, and so must it.
                meta.from_scratch
                and self.key_scale is None
                and not ops.paged_kernel_applies(q, self.key_cache)
            )
        ):
            k = qkv[:, heads * d : (heads + kv_heads) * d].view(-1, kv_heads, d)
            v = qkv[:, (heads + kv_heads) * d :].view(-1, kv_heads, d)
            return self._prompts(q, k, v, meta.query_lens)
        out = torch.empty(q.shape[0], heads, d, dtype=q.dtype, device=q.device)
        ops.paged_attention(
            out,
            q,
            self.key_cache,
            self.value_cache,
            block_tables,
            meta.seq_lens,
            meta.query_start,
            self.scale,
            meta.query_lens,
            self.window,
            self.key_scale,
            self.value_scale,
        )
        return out.view(-1, heads * d)

    def _prompts(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_lens: list[int]
    ) -> torch.Tensor:
        """Whole prompts from position 0: causal attention over their own K/V (within the
        window, if the layer has one), one SDPA each."""
        outputs = []
        start = 0
        for length in query_lens:
            end = start + length
            qs = q[start:end].transpose(0, 1).unsqueeze(0)
            ks = k[start:end].transpose(0, 1).unsqueeze(0)
            vs = v[start:end].transpose(0, 1).unsqueeze(0)
            if self.window and length > self.window:
                i = torch.arange(length, device=q.device)
                behind = i[:, None] - i[None, :]
                visible = (behind >= 0) & (behind < self.window)
                out = F.scaled_dot_product_attention(
                    qs, ks, vs, attn_mask=visible, scale=self.scale, enable_gqa=True
                )
            else:
                out = F.scaled_dot_product_attention(
                    qs, ks, vs, is_causal=True, scale=self.scale, enable_gqa=True
                )
            outputs.append(out.squeeze(0).transpose(0, 1))
            start = end
        out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
