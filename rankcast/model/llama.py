"""A Llama-family decoder (SmolLM2, Llama 2/3, Qwen2, Mistral, Qwen3, SmolLM3, Phi-3/Phi-4-mini,
Gemma 3) built from tensor-parallel layers.

Parameter names follow HF checkpoints except where projections are stacked (`qkv_proj`,
`gate_up_proj`); `load_weights` maps checkpoint names onto them and lets each parameter's
`weight_loader` take this rank's shard.

What sets the family's members apart is a switch of `ArchConfig`: Qwen3's per-head q/k RMSNorm
(`qk_norm`), SmolLM3's layers without RoPE (`rope_layers`), Phi-3's partial rotary
(`rotary_dim`: q and k heads stored reordered, rotary.py) and LongRoPE (the RoPE table), sliding
windows per layer (`layer_windows`), and Gemma 3's block (four norms scaling by 1 + w, GeGLU,
a second RoPE table and a KV-cache group of their own for its local layers; its scaled
embeddings and soft-capped logits stay outside the layers). The modules and the C++ decoder stack
(csrc/decoder_stack.cpp, `fuse_layers`) both take them, with the same kernels. Phi-3's
fused `qkv_proj` and `gate_up_proj` are split at load into the parts each rank's shards are cut
from.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from rankcast.distributed import PipelineStage, TensorParallelGroup
from rankcast.errors import ModelFormatError
from rankcast.model import ops
from rankcast.model.attention import AttentionMetadata, PagedAttention
from rankcast.model.layers import (
    ColumnParallelLinear,
    KernelSlots,
    LinearDelta,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    default_weight_loader,
)
from rankcast.model.linear_kernels import ROWS_SPLIT
from rankcast.model.moe import SparseMoeBlock
from rankcast.model.rotary import RotaryEmbedding, partial_rotary_order
from rankcast.model_files.arch import ArchConfig

# checkpoint suffix -> (stacked parameter suffix, shard id)
_STACKED = (
    ("q_proj", "qkv_proj", "q"),
    ("k_proj", "qkv_proj", "k"),
    ("v_proj", "qkv_proj", "v"),
    ("gate_proj", "gate_up_proj", 0),
    ("up_proj", "gate_up_proj", 1),
)


# Mixtral's names for its mixture of experts, as Qwen3-MoE's (SparseMoeBlock's): the block,
# and each expert's gate (w1), down (w2) and up (w3) projections.
_MIXTRAL = (
    (".block_sparse_moe.", ".mlp."),
    (".w1.", ".gate_proj."),
    (".w2.", ".down_proj."),
    (".w3.", ".up_proj."),
)


def _mixtral_names(name: str) -> str:
    if ".block_sparse_moe." not in name:
        return name
    for theirs, ours in _MIXTRAL:
        name = name.replace(theirs, ours)
    return name


class LlamaAttention(nn.Module):
    def __init__(self, arch: ArchConfig, tp: TensorParallelGroup, layer: int) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            arch.hidden_size,
            arch.head_dim,
            arch.num_attention_heads,
            arch.num_key_value_heads,
            arch.attention_bias,
            tp,
        )
        self.o_proj = RowParallelLinear(
            arch.num_attention_heads * arch.head_dim, arch.hidden_size, arch.output_bias, tp
        )
        self.head_dim = arch.head_dim
        # Qwen3, Gemma 3: one weight of head_dim each, shared by the heads, so every
        # tensor-parallel rank holds it whole and normalises its own heads.
        offset = arch.norm_weight_offset
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, offset) if arch.qk_norm else None
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, offset) if arch.qk_norm else None
        window = arch.window(layer)
        self.attn = PagedAttention(
            self.qkv_proj.num_heads,
            self.qkv_proj.num_kv_heads,
            arch.head_dim,
            rotates=arch.rope_layers[layer],
            scale=arch.attention_scale,
            window=window,
            local_rope=bool(window) and arch.local_rope_theta is not None,
            kv_group=arch.kv_group(layer),
        )

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        if self.q_norm is not None and self.k_norm is not None:
            q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
            by_head = (-1, self.head_dim)
            q = qkv[:, :q_size].unflatten(1, by_head)
            k = qkv[:, q_size : q_size + kv_size].unflatten(1, by_head)
            ops.head_rms_norm_(q, self.q_norm.weight, self.q_norm.eps)
            ops.head_rms_norm_(k, self.k_norm.weight, self.k_norm.eps)
        # nn.Module.__call__ is typed as returning Any; o_proj's forward returns a Tensor.
        out: torch.Tensor = self.o_proj(self.attn(qkv, meta))
        return out


class LlamaMLP(nn.Module):
    def __init__(self, arch: ArchConfig, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            arch.hidden_size, [arch.intermediate_size] * 2, False, tp
        )
        self.down_proj = RowParallelLinear(arch.intermediate_size, arch.hidden_size, False, tp)
        self.act_and_mul = (
            ops.gelu_tanh_and_mul if arch.hidden_activation == "gelu_tanh" else ops.silu_and_mul
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(self.act_and_mul(self.gate_up_proj(x)))
        return out


class LlamaDecoderLayer(nn.Module):
    """Llama's block: input norm, attention, then the norm before the MLP (HF's
    `post_attention_layernorm`), each adding the residual stream as it normalises. With
    `sandwich_norms` (Gemma 3), attention's and the MLP's outputs are normalised too before
    they join the stream: `post_attention_layernorm` is then that norm, and
    `pre_feedforward_layernorm` the one before the MLP."""

    def __init__(
        self,
        arch: ArchConfig,
        tp: TensorParallelGroup,
        layer: int,
        expert_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(arch, tp, layer)
        self.mlp: LlamaMLP | SparseMoeBlock = (
            SparseMoeBlock(arch, tp, expert_parallel) if arch.is_moe(layer) else LlamaMLP(arch, tp)
        )
        width, eps, offset = arch.hidden_size, arch.rms_norm_eps, arch.norm_weight_offset
        self.input_layernorm = RMSNorm(width, eps, offset)
        self.post_attention_layernorm = RMSNorm(width, eps, offset)
        self.pre_feedforward_layernorm: RMSNorm | None = None
        self.post_feedforward_layernorm: RMSNorm | None = None
        if arch.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(width, eps, offset)
            self.post_feedforward_layernorm = RMSNorm(width, eps, offset)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, meta)
        if self.pre_feedforward_layernorm is None or self.post_feedforward_layernorm is None:
            hidden, residual = self.post_attention_layernorm(hidden, residual)
            return self.mlp(hidden), residual
        hidden, _ = self.post_attention_layernorm(hidden)
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        hidden, _ = self.post_feedforward_layernorm(self.mlp(hidden))
        return hidden, residual


class LlamaForCausalLM(nn.Module):
    """The whole decoder, or this pipeline stage's slice of it.

    Non-first stages take `(hidden, residual)` from the previous stage instead of token ids, and
    only the last stage owns the final norm and the LM head.
    """

    def __init__(
        self,
        arch: ArchConfig,
        tp: TensorParallelGroup | None = None,
        pp: PipelineStage | None = None,
        expert_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.arch = arch
        self.tp = tp or TensorParallelGroup()
        self.pp = pp or PipelineStage()
        self.start_layer, self.end_layer = self.pp.layer_range(arch.num_hidden_layers)
        self.rope = RotaryEmbedding(
            arch.head_dim,
            arch.max_position_embeddings,
            arch.rope_theta,
            arch.rope_scaling,
            arch.rotary_dim,
        )
        # Gemma 3's local layers: plain RoPE with their own base.
        self.local_rope = (
            RotaryEmbedding(
                arch.head_dim, arch.max_position_embeddings, arch.local_rope_theta, None
            )
            if arch.local_rope_theta is not None and arch.layer_windows
            else None
        )
        # Partial rotary: the order each q and k head's values are stored in (rotary.py).
        self.head_order = (
            partial_rotary_order(arch.head_dim, arch.rotary_dim)
            if arch.rotary_dim < arch.head_dim
            else None
        )
        self.embed_tokens = (
            VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, self.tp)
            if self.pp.is_first or (self.pp.is_last and arch.tie_word_embeddings)
            else None
        )
        self.layers = nn.ModuleDict(
            {
                str(i): LlamaDecoderLayer(arch, self.tp, i, expert_parallel)
                for i in range(self.start_layer, self.end_layer)
            }
        )
        self.norm = (
            RMSNorm(arch.hidden_size, arch.rms_norm_eps, arch.norm_weight_offset)
            if self.pp.is_last
            else None
        )
        self.lm_head: ParallelLMHead | None = None
        if self.pp.is_last:
            self.lm_head = ParallelLMHead(arch.vocab_size, arch.hidden_size, self.tp)
            if arch.tie_word_embeddings and self.embed_tokens is not None:
                self.lm_head.weight = self.embed_tokens.weight
        # This stage's layers as one C++ call where it can run them (fuse_layers): a
        # torch.classes.rankcast.DecoderStack.
        self.fused_layers: Any = None
        # Adapter slots on this stage's projections. The stack adds their deltas itself when
        # csrc/lora.cpp applies them (stack_adds_deltas); otherwise a step where any of them
        # adds a delta runs the module path, and steps without adapters run the stack.
        self.adapter_deltas: list[LinearDelta] = []
        self.stack_adds_deltas = False
        # Steps of at least this many tokens run the modules (the `rows` path: their linears
        # take oneDNN's packing there); None: every step may run the stack.
        self.fused_max_rows: int | None = None

    def decoder_layers(self) -> list[LlamaDecoderLayer]:
        """This stage's layers, in order."""
        return [layer for layer in self.layers.values() if isinstance(layer, LlamaDecoderLayer)]

    def attention_layers(self) -> list[PagedAttention]:
        """This stage's attention modules, in layer order, for the runner to hand caches to."""
        return [layer.self_attn.attn for layer in self.decoder_layers()]

    def fuse_layers(self) -> bool:
        """Hand this stage's layers to the C++ decoder stack, where it can run them all: one
        rank (no all-reduce between layers), rankcast's packed linears, caches set; with LoRA
        slots attached, the stack adds their deltas where csrc/lora.cpp applies them, and
        otherwise runs only steps where no adapter applies.
        Returns whether it could; the module path stays in use for everything else.

        Each layer's q/k norms (Qwen3) and RoPE switch (SmolLM3) go with it (`set_attention`),
        its RoPE table and KV-cache group (Gemma 3's local layers, `set_rope_and_group`), and its
        block's shape (Gemma 3's MLP norms and GeGLU, `set_block`)."""
        self.fused_layers = None
        self.adapter_deltas = []
        self.stack_adds_deltas = False
        self.fused_max_rows = None
        layers = self.decoder_layers()
        # Each mixture of experts as one C++ call (csrc/moe.cpp), on the module path too.
        moe_fused = [layer.mlp.fuse() for layer in layers if isinstance(layer.mlp, SparseMoeBlock)]
        if self.tp.size != 1 or not layers or not ops.can_fuse_layers(layers[0].self_attn.attn):
            return False
        if not all(moe_fused):
            return False  # experts the C++ object cannot run stay on the module path
        projections: list[list[ops.PackedWeight]] = []
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            group: list[ColumnParallelLinear | RowParallelLinear] = [attn.qkv_proj, attn.o_proj]
            if isinstance(mlp, LlamaMLP):
                group += [mlp.gate_up_proj, mlp.down_proj]
            packed = [p.packed_weight for p in group]
            if attn.attn.key_cache is None:
                return False
            self.adapter_deltas.extend(p.lora for p in group if p.lora is not None)
            ready = [w for w in packed if w is not None and w.backend == "rankcast"]
            if len(ready) != len(group):
                return False
            if any(p.tiles_weight is not None for p in group):
                self.fused_max_rows = ROWS_SPLIT
            projections.append(ready)
        first = layers[0].self_attn.attn
        stack = torch.classes.rankcast.DecoderStack(
            first.num_heads,
            first.num_kv_heads,
            first.head_dim,
            self.arch.rms_norm_eps,
            first.scale,
            self.rope.cos_sin,
        )
        no_weight = torch.empty(0)
        for layer, packed_group in zip(layers, projections, strict=True):
            attn = layer.self_attn
            qkv, o = packed_group[:2]
            # A mixture of experts' layer has no dense projections: placeholders, and set_moe.
            gate_up, down = (
                packed_group[2:]
                if len(packed_group) == 4
                else [ops.PackedWeight(no_weight, "rankcast", 0)] * 2
            )
            stack.add_layer(
                layer.input_layernorm.weight.detach(),
                layer.post_attention_layernorm.weight.detach(),
                qkv.tensor,
                attn.qkv_proj.bias,
                qkv.out_features,
                o.tensor,
                attn.o_proj.bias,
                o.out_features,
                gate_up.tensor,
                gate_up.out_features,
                down.tensor,
                down.out_features,
                attn.attn.key_cache,
                attn.attn.value_cache,
                qkv.scales,
                o.scales,
                gate_up.scales,
                down.scales,
            )
        for i, layer in enumerate(layers):
            attn = layer.self_attn
            if isinstance(layer.mlp, SparseMoeBlock):
                stack.set_moe(i, layer.mlp.fused)
            stack.set_attention(
                i,
                attn.q_norm.weight.detach() if attn.q_norm is not None else None,
                attn.k_norm.weight.detach() if attn.k_norm is not None else None,
                attn.attn.rotates,
                attn.attn.window,
            )
            local_table = self.local_rope.cos_sin if self.local_rope is not None else None
            stack.set_rope_and_group(
                i, local_table if attn.attn.local_rope else None, attn.attn.kv_group
            )
            if attn.attn.key_scale is not None and attn.attn.value_scale is not None:
                stack.set_kv_scales(i, attn.attn.key_scale, attn.attn.value_scale)
            pre, post = layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm
            stack.set_block(
                i,
                pre.weight.detach() if pre is not None else None,
                post.weight.detach() if post is not None else None,
                self.arch.hidden_activation == "gelu_tanh",
            )
        self.stack_adds_deltas = self._hand_deltas_to(stack, layers)
        self.fused_layers = stack
        return True

    def _hand_deltas_to(self, stack: Any, layers: list[LlamaDecoderLayer]) -> bool:
        """Give the stack every projection's adapter slots, if it can add all their deltas as
        the modules do: each through csrc/lora.cpp, and no row-parallel bias (the modules add
        o_proj's after the delta, the stack's kernel before it). Returns whether it took them."""
        if not self.adapter_deltas:
            return False
        handed: list[tuple[int, int, KernelSlots]] = []
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            if attn.o_proj.lora is not None and attn.o_proj.bias is not None:
                return False
            deltas = (attn.qkv_proj.lora, attn.o_proj.lora) + (
                (mlp.gate_up_proj.lora, mlp.down_proj.lora)
                if isinstance(mlp, LlamaMLP)
                else (None, None)  # adapters on experts are refused at load
            )
            for j, delta in enumerate(deltas):
                if delta is None:
                    continue
                slots = delta.kernel_slots()
                if slots is None:
                    return False
                handed.append((i, j, slots))
        for i, j, (a, b, offsets, rank) in handed:
            stack.set_lora(i, j, a, b, offsets, rank)
        return True

    def forward(
        self,
        input_ids: torch.Tensor | None,
        meta: AttentionMetadata,
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run this stage's layers; the last stage returns the final-normed hidden states."""
        if self.pp.is_first:
            assert self.embed_tokens is not None and input_ids is not None
            hidden, residual = self.embed_tokens(input_ids), None
            if self.arch.embedding_multiplier != 1.0:
                # In the embeddings' dtype, as Gemma's reference scales them.
                hidden = hidden * torch.tensor(self.arch.embedding_multiplier, dtype=hidden.dtype)
        else:
            assert intermediate is not None
            hidden, residual = intermediate
        meta.cos_sin = self.rope.cos_sin
        if self.local_rope is not None:
            meta.local_cos_sin = self.local_rope.cos_sin
        fits = self.fused_max_rows is None or hidden.shape[0] < self.fused_max_rows
        adapters = any(delta.adds_this_step() for delta in self.adapter_deltas)
        if self.fused_layers is not None and fits and (self.stack_adds_deltas or not adapters):
            hidden, residual = self.fused_layers.forward(
                hidden,
                residual,
                meta.positions,
                meta.slot_mapping,
                meta.block_tables,
                meta.seq_lens,
                meta.query_start,
                self.adapter_deltas[0].token_slots() if adapters else None,
                meta.window_slot_mapping,
                meta.window_block_tables,
            )
        else:
            for layer in self.decoder_layers():
                hidden, residual = layer(hidden, residual, meta)
        if self.norm is None:
            return hidden, residual
        hidden, _ = self.norm(hidden, residual)
        return hidden, None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.lm_head is not None
        logits = self.lm_head.compute_logits(hidden)
        cap = self.arch.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors, skipping those another pipeline stage owns.

        Returns the names of parameters that were filled, so the loader can report any missing.
        """
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for ckpt_name, tensor in self._split_fused(weights):
            name = _mixtral_names(ckpt_name.removeprefix("model."))
            if "rotary_emb.inv_freq" in name:
                continue
            if name.startswith("layers."):
                index = int(name.split(".")[1])
                if not self.start_layer <= index < self.end_layer:
                    continue
            if name == "lm_head.weight" and self.arch.tie_word_embeddings:
                continue
            target, shard = name, None
            for ckpt_part, param_part, shard_id in _STACKED:
                if f".{ckpt_part}." in name:
                    target, shard = name.replace(ckpt_part, param_part), shard_id
                    break
            if self.head_order is not None and shard in ("q", "k"):
                tensor = self._reorder_heads(tensor)
            if target not in params:
                continue  # belongs to another stage (embedding, norm, head)
            param = params[target]
            loader: Callable[..., None] = getattr(param, "weight_loader", default_weight_loader)
            with torch.no_grad():
                if shard is None:
                    loader(param, tensor)
                else:
                    loader(param, tensor, shard)
            loaded.add(target)
        if self.lm_head is not None and self.arch.tie_word_embeddings:
            loaded.add("lm_head.weight")
        return loaded

    def _split_fused(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Phi-3's fused projections as the parts rankcast's stacked ones are loaded from:
        `qkv_proj` rows [q | k | v] (heads, kv heads, kv heads of head_dim) as q_proj, k_proj
        and v_proj, `gate_up_proj` rows [gate | up] as gate_proj and up_proj, so each
        tensor-parallel rank cuts its heads and columns from each part as from separate
        checkpoint tensors. Everything else passes as it is."""
        arch = self.arch
        q = arch.num_attention_heads * arch.head_dim
        kv = arch.num_key_value_heads * arch.head_dim
        for name, tensor in weights:
            module, _, suffix = name.rpartition(".")
            prefix, _, fused = module.rpartition(".")
            if fused == "qkv_proj" and prefix.endswith(".self_attn"):
                if tensor.shape[0] != q + 2 * kv:
                    raise ModelFormatError(
                        f"{name}: {tensor.shape[0]} rows, not the {q + 2 * kv} of q, k and v "
                        f"({arch.num_attention_heads} + 2 x {arch.num_key_value_heads} heads "
                        f"of {arch.head_dim})"
                    )
                yield f"{prefix}.q_proj.{suffix}", tensor.narrow(0, 0, q)
                yield f"{prefix}.k_proj.{suffix}", tensor.narrow(0, q, kv)
                yield f"{prefix}.v_proj.{suffix}", tensor.narrow(0, q + kv, kv)
            elif fused == "gate_up_proj" and prefix.endswith(".mlp"):
                width = arch.intermediate_size
                if tensor.shape[0] != 2 * width:
                    raise ModelFormatError(
                        f"{name}: {tensor.shape[0]} rows, not the 2 x {width} of gate and up "
                        "(intermediate_size)"
                    )
                yield f"{prefix}.gate_proj.{suffix}", tensor.narrow(0, 0, width)
                yield f"{prefix}.up_proj.{suffix}", tensor.narrow(0, width, width)
            else:
                yield name, tensor

    def _reorder_heads(self, tensor: torch.Tensor) -> torch.Tensor:
        """A q or k projection's rows (or bias), whole heads of head_dim, each head's values put
        in `head_order` (partial rotary, rotary.py). The heads stay where they are, so each rank
        cuts its own from the result as from the checkpoint's."""
        assert self.head_order is not None
        d = self.arch.head_dim
        by_head = tensor.reshape(-1, d, *tensor.shape[1:])
        return by_head[:, self.head_order].reshape(tensor.shape)
