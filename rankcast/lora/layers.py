"""Batched multi-LoRA on the tensor-parallel projections, without merging weights.

Each LoRA-enabled projection holds `max_loras` adapter slots. Its sub-projections (q, k, v of a
fused QKV; gate, up of a fused gate/up; or the one output of o/down) stack every slot's A in one
matrix, sub-projection by sub-projection, as [subs * slots * r, in]; each sub-projection keeps
its own B (transposed, scaling folded in) as [slots * r, out]; empty slots are zero.

Two ways to apply them, the same result:
- on the CPU with rankcast's kernels built (csrc/lora.cpp), each token reads only its own
  slot's rows of A and B and adds its delta in one pass: the work is the tokens' own adapters,
  whatever the number of slots. The slots are float32, except for a bfloat16 model on a CPU
  with AMX, where they are bfloat16 packed for its tiles (rankcast/lora/tile_layout.py,
  csrc/lora_amx.cpp): each A [subs, slots, P, K/2, w, 2], each B [slots, n/16, kr/2, 16, 2];
- elsewhere (CUDA, float16, no kernels), torch: `x A^T` for every sub-projection and slot in one
  matmul, each token's row masked to its own slot's columns, each sub-projection's part times
  its B. It computes in `lora_compute_dtype` (rankcast/platform.py): the model's dtype, except
  half precision on CPUs without native bfloat16 matmuls, where torch emulates them.
Row-parallel projections add their partial delta before the all-reduce, which then sums it with
the partial outputs, so no extra collective is needed.

Each layer cuts its own shard from the whole adapter the way its `weight_loader` cuts the base
weight (including KV heads replicated across ranks), so the adapter file is read once per rank
and never pre-sharded by hand.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rankcast.lora import tile_layout
from rankcast.lora.peft_adapter import LoRAAdapter, SlotImage
from rankcast.model import ops
from rankcast.model.layers import KernelSlots
from rankcast.model.moe import SparseMoeBlock
from rankcast.platform import lora_compute_dtype

if TYPE_CHECKING:
    from rankcast.model.layers import ColumnParallelLinear, RowParallelLinear
    from rankcast.model.llama import LlamaDecoderLayer, LlamaForCausalLM


# The most sub-projections one layer fuses (q, k, v): the batch mask covers that many.
MAX_SUBS = 3


@dataclass(frozen=True)
class LoRABatch:
    """Which adapter slot each token of a step uses.

    `token_slots[t]` is token t's slot (-1: none), what the CPU kernel reads. The torch path
    reads `mask`: `mask[t, c]` is 1 when token t uses the slot column c belongs to
    (`LoRAContext.column_slots`), so one shrink against all slots at once, masked, applies every
    token's own adapter: far fewer, larger matmuls than one pair per adapter group. Tokens
    without an adapter have an all-zero row.
    """

    token_slots: torch.Tensor  # [tokens] int64
    mask: torch.Tensor | None  # [tokens, MAX_SUBS * max_loras * max_rank]; None with the kernel

    @classmethod
    def from_token_slots(cls, slots: list[int], context: LoRAContext) -> LoRABatch | None:
        if all(slot < 0 for slot in slots):
            return None
        columns = context.column_slots
        token_slots = torch.tensor(slots, dtype=torch.long, device=columns.device)
        if context.kernel:
            return cls(token_slots, None)
        return cls(token_slots, (token_slots[:, None] == columns[None, :]).to(context.dtype))


class LoRAContext:
    """The current step's `LoRABatch`, shared by every LoRA layer of one model; the model runner
    sets it before the forward pass. `dtype` is what the adapters compute in; `kernel`: whether
    rankcast's CPU kernel applies them (csrc/lora.cpp) instead of torch's masked matmuls, from
    float32 slots, or from bfloat16 slots packed for AMX tiles (`tiles`)."""

    def __init__(
        self,
        max_loras: int,
        max_rank: int,
        device: torch.device,
        dtype: torch.dtype,
        kernel: bool = False,
    ) -> None:
        if kernel and dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"the LoRA kernel's slots are float32 or bfloat16, not {dtype}")
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.device = device
        self.dtype = dtype
        self.kernel = kernel
        self.tiles = kernel and dtype == torch.bfloat16
        # The slot each stacked rank column belongs to, for each sub-projection in turn (a layer
        # with n sub-projections uses the first n): fixed, so built once, not per step.
        per_sub = torch.arange(max_loras, device=device).repeat_interleave(max_rank)
        self.column_slots = per_sub.repeat(MAX_SUBS)
        self.batch: LoRABatch | None = None


@dataclass(frozen=True)
class SubProjection:
    """One adapter-targetable projection inside a (possibly fused) layer, on this rank.

    `out_offset`/`out_size`: its columns of the layer's local output. Column-parallel: this rank
    takes rows `shard_index * out_size ...` of the adapter's B. Row-parallel (`in_shard` set):
    it takes columns `in_shard * in_size ...` of A and all of B.
    """

    module: str
    out_offset: int
    out_size: int
    shard_index: int = 0
    in_shard: int | None = None


@dataclass(frozen=True)
class SlotPlaces:
    """Where one slot's adapter lives in a LoRA layer: its rows of every sub-projection's A,
    one [subs, max_rank, in] view, and its rows of each sub-projection's B (packed for tiles:
    its [subs, P, K/2, w, 2] of A and [n/16, kr/2, 16, 2] of each B)."""

    a: torch.Tensor
    b: list[torch.Tensor]


class LoRALinear:
    def __init__(self, context: LoRAContext, subs: list[SubProjection], in_size: int) -> None:
        if not 1 <= len(subs) <= MAX_SUBS:
            raise ValueError(f"a LoRA layer has 1 to {MAX_SUBS} sub-projections, not {len(subs)}")
        self.context = context
        self.subs = subs
        self.in_size = in_size
        self.max_rank = context.max_rank
        self.columns = context.max_loras * context.max_rank  # per sub-projection
        dtype, device = context.dtype, context.device
        slots, rank = context.max_loras, context.max_rank
        if context.tiles:  # packed for AMX tiles (rankcast/lora/tile_layout.py)
            self.a = torch.zeros(
                len(subs), slots, *tile_layout.a_shape(rank, in_size), dtype=dtype, device=device
            )
            self.b = [
                torch.zeros(
                    slots, *tile_layout.b_shape(rank, sub.out_size), dtype=dtype, device=device
                )
                for sub in subs
            ]
            self.sub_a = list(self.a)
            self.slot_places = [
                SlotPlaces(self.a[:, slot], [b[slot] for b in self.b]) for slot in range(slots)
            ]
        else:
            # Every sub-projection's A in one [subs * slots * rank, in] matrix: one shrink
            # matmul.
            self.a = torch.zeros(len(subs) * self.columns, in_size, dtype=dtype, device=device)
            # B transposed, per sub-projection: [slots * rank, out].
            self.b = [
                torch.zeros(self.columns, sub.out_size, dtype=dtype, device=device) for sub in subs
            ]
            # Each sub-projection's A, and each slot's place in A and B, as views made once: an
            # activation writes ~120 projections, and slicing them anew cost more than the
            # copies.
            self.sub_a = [
                self.a.narrow(0, i * self.columns, self.columns) for i in range(len(subs))
            ]
            stacked = self.a.view(len(subs), slots, rank, in_size)
            self.slot_places = [
                SlotPlaces(stacked[:, slot], [b.narrow(0, slot * rank, rank) for b in self.b])
                for slot in range(slots)
            ]
        self.active = [set[int]() for _ in subs]
        # What an adapter's slot image for this layer depends on (beside the layer index).
        self.image_key = (tuple(subs), in_size, rank, context.dtype, context.tiles)
        # The kernel's arguments: each sub-projection holding an adapter, as views of the above.
        self.kernel_args: tuple[list[torch.Tensor], list[torch.Tensor], list[int]] = ([], [], [])

    def set_slot(self, slot: int, adapter: LoRAAdapter, layer: int) -> None:
        """Write this layer's shard of `adapter` into `slot` (modules it does not target: zero):
        one copy for every sub-projection's A and one per B, from the adapter's slot image."""
        for place, image in self.slot_writes(slot, adapter, layer):
            place.copy_(image)

    def slot_writes(
        self, slot: int, adapter: LoRAAdapter, layer: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The copies that put this layer's shard of `adapter` into `slot`, as (slot place,
        slot image) pairs, the slot already marked as holding it: the model runner makes every
        layer's copies in one call (`ModelRunner.set_lora`)."""
        image = adapter.slot_images.get((layer, self.image_key))
        if image is None:  # an adapter as read from its files (not a rank's host tier)
            if not adapter.weights:
                raise RuntimeError(
                    f"adapter {adapter.name!r} keeps only slot images, none for layer {layer}"
                )
            image = self.slot_image(adapter, layer)
        places = self.slot_places[slot]
        for i, targeted in enumerate(image.targets):
            if targeted:
                self.active[i].add(slot)
            else:
                self.active[i].discard(slot)
        self._update_kernel_args()
        return [(places.a, image.a), *zip(places.b, image.b, strict=True)]

    def slot_image(self, adapter: LoRAAdapter, layer: int) -> SlotImage:
        """This rank's shard of the adapter's projections in this layer, scaled, B transposed,
        zero-padded to the slot's rank, in the slots' dtype, in host memory (the host tier is
        host memory on a GPU too: an activation copies it to the device)."""
        return self.slot_images(adapter, [layer])[0]

    def slot_images(self, adapter: LoRAAdapter, layers: list[int]) -> list[SlotImage]:
        """`slot_image` for each of `layers` (whose projections share this one's
        `image_key`), made with a few operations on all layers' tensors stacked rather than a
        few per layer: a read makes ~120 images for a SmolLM2 adapter, on a thread that shares
        the interpreter with the rank's forward pass, so each operation saved is time the
        adapter's first request does not wait."""
        dtype, device = self.context.dtype, torch.device("cpu")
        count = len(layers)
        a_images = torch.zeros(
            count, len(self.subs), self.max_rank, self.in_size, dtype=dtype, device=device
        )
        b_images = [
            torch.zeros(count, self.max_rank, sub.out_size, dtype=dtype, device=device)
            for sub in self.subs
        ]
        targets = [[False] * len(self.subs) for _ in layers]
        for i, sub in enumerate(self.subs):
            found = [
                (j, adapter.weights.get((layer, sub.module))) for j, layer in enumerate(layers)
            ]
            held = [(j, w) for j, w in found if w is not None]
            if not held:
                continue
            rows = [j for j, _ in held]
            a = torch.stack([w.a for _, w in held])  # [held, rank, in]
            b = torch.stack([w.b for _, w in held])  # [held, out, rank]
            if sub.in_shard is None:
                b = b.narrow(1, sub.shard_index * sub.out_size, sub.out_size)
            else:
                a = a.narrow(2, sub.in_shard * self.in_size, self.in_size)
            rank = a.shape[1]
            a_images[rows, i, :rank] = a.to(dtype)
            b_images[i][rows, :rank] = (b * adapter.scaling).transpose(1, 2).to(dtype)
            for j in rows:
                targets[j][i] = True
        if self.context.tiles:
            a_images = tile_layout.pack_a(a_images)
            b_images = [tile_layout.pack_b(b) for b in b_images]
        return [SlotImage(a_images[j], [b[j] for b in b_images], targets[j]) for j in range(count)]

    def clear_slot(self, slot: int) -> None:
        torch._foreach_zero_(self.slot_clears(slot))

    def slot_clears(self, slot: int) -> list[torch.Tensor]:
        """The slot's places, to be zeroed, the slot already marked empty (the model runner
        zeroes every layer's in one call, `ModelRunner.clear_lora`)."""
        for active in self.active:
            active.discard(slot)
        self._update_kernel_args()
        places = self.slot_places[slot]
        return [places.a, *places.b]

    def _update_kernel_args(self) -> None:
        held = [i for i in range(len(self.subs)) if self.active[i]]
        self.kernel_args = (
            [self.sub_a[i] for i in held],
            [self.b[i] for i in held],
            [self.subs[i].out_offset for i in held],
        )

    def adds_this_step(self) -> bool:
        return self.context.batch is not None and any(self.active)

    def kernel_slots(self) -> KernelSlots | None:
        """Every sub-projection's slots (an empty sub's are zero and add nothing), so they
        stay right whatever is written into the slots later."""
        if not self.context.kernel:
            return None
        return list(self.sub_a), list(self.b), [sub.out_offset for sub in self.subs], self.max_rank

    def token_slots(self) -> torch.Tensor | None:
        batch = self.context.batch
        return None if batch is None else batch.token_slots

    def add_to(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """Add every token's own adapter delta to its row of `out` (in place)."""
        batch = self.context.batch
        if batch is None or not any(self.active):
            return
        if batch.mask is None:  # the kernel's batch
            a, b, offsets = self.kernel_args
            torch.ops.rankcast.lora_add(out, x, batch.token_slots, a, b, offsets, self.max_rank)
            return
        mask = batch.mask.narrow(1, 0, self.a.shape[0])
        shrunk = (x.to(self.a.dtype) @ self.a.T).mul_(mask)
        for i, sub in enumerate(self.subs):
            if self.active[i]:
                delta = shrunk.narrow(1, i * self.columns, self.columns) @ self.b[i]
                out.narrow(1, sub.out_offset, sub.out_size).add_(delta)


def attach_lora(
    model: LlamaForCausalLM, max_loras: int, max_rank: int
) -> tuple[LoRAContext, dict[int, list[LoRALinear]]]:
    """Give every targetable projection of this stage's layers `max_loras` empty slots.

    Returns the shared context and, per layer index, the layer's LoRA projections.
    """
    param = next(model.parameters())
    device = param.device
    indices = range(model.start_layer, model.end_layer)
    projections = {
        index: _lora_projections(layer, model.tp.rank)
        for index, layer in zip(indices, model.decoder_layers(), strict=True)
    }
    if ops.lora_kernel_applies(param):
        tiles = ops.lora_tiles_apply(param) and all(
            tile_layout.fits_tiles(sub.out_size)
            for layer in projections.values()
            for _, subs, _ in layer
            for sub in subs
        )
        dtype = torch.bfloat16 if tiles else torch.float32
        context = LoRAContext(max_loras, max_rank, device, dtype, kernel=True)
    else:
        context = LoRAContext(max_loras, max_rank, device, lora_compute_dtype(param.dtype, device))
    per_layer: dict[int, list[LoRALinear]] = {}
    for index, layer in projections.items():
        per_layer[index] = []
        for linear, subs, in_size in layer:
            linear.lora = LoRALinear(context, subs, in_size)
            per_layer[index].append(linear.lora)
    return context, per_layer


def _lora_projections(
    layer: LlamaDecoderLayer, tp_rank: int
) -> list[tuple[ColumnParallelLinear | RowParallelLinear, list[SubProjection], int]]:
    """A decoder layer's targetable projections on this rank (QKV, O, and the MLP's gate-up
    and down unless the layer's MLP is a mixture of experts): each linear, its
    sub-projections and its input width."""
    qkv = layer.self_attn.qkv_proj
    q, kv = qkv.q_size, qkv.kv_size
    kv_index = tp_rank // qkv.kv_replicas
    o_proj = layer.self_attn.o_proj
    attention: list[tuple[ColumnParallelLinear | RowParallelLinear, list[SubProjection], int]] = [
        (
            qkv,
            [
                SubProjection("q_proj", 0, q, tp_rank),
                SubProjection("k_proj", q, kv, kv_index),
                SubProjection("v_proj", q + kv, kv, kv_index),
            ],
            qkv.weight.shape[1],
        ),
        (
            o_proj,
            [SubProjection("o_proj", 0, o_proj.weight.shape[0], in_shard=tp_rank)],
            o_proj.input_size_per_rank,
        ),
    ]
    mlp = layer.mlp
    if isinstance(mlp, SparseMoeBlock):
        return attention
    gate_up, down = mlp.gate_up_proj, mlp.down_proj
    half = gate_up.output_size_per_rank // 2
    return [
        attention[0],
        (
            gate_up,
            [
                SubProjection("gate_proj", 0, half, tp_rank),
                SubProjection("up_proj", half, half, tp_rank),
            ],
            gate_up.weight.shape[1],
        ),
        attention[1],
        (
            down,
            [SubProjection("down_proj", 0, down.weight.shape[0], in_shard=tp_rank)],
            down.input_size_per_rank,
        ),
    ]
