"""A mixture-of-experts MLP (Qwen3-MoE's sparse block, Mixtral's): a router picks each token's
top-k experts from the softmax of its logits, each chosen expert (a SwiGLU MLP of its own) runs
on the tokens that chose it, and their outputs join the token's, weighted.

Batch invariance holds as for the dense MLP: a token's router logits and each expert's output
for it come from linears on rankcast's row-invariant kernels (the experts are ordinary
column- and row-parallel linears, packed and quantized like every other), and its output is
summed in one order whatever the batch: from zero, expert by expert in index order (the order
transformers adds them in), each adding the token's own row only. Which other tokens chose the
same expert changes nothing in it.

Under tensor parallelism every rank holds a slice of every expert (gate/up by output rows, down
by input columns) and the whole router; the experts' partial sums are added on each rank and
all-reduced once for the block, not once per expert. With expert parallelism (vLLM's
--enable-expert-parallel) each rank holds whole experts instead, a contiguous share of them,
and adds only its own experts' outputs (still in index order) before the same all-reduce: a
token's result is then summed in another order than under slicing, but in one order whatever
the batch.

Where rankcast's kernels run the experts' packed weights, the block is one C++ object
(csrc/moe.cpp, `fuse`): routing, the loop over the chosen experts and the weighted sum without
returning to Python, the same object the decoder stack runs for a fused stage. Its arithmetic
is the loop below, operator for operator, so both give the same bits (tested).

Each block counts the tokens it routes to each of its experts (`routed`); the worker takes the
counts once a window and publishes them (`rankcast/worker/expert_load.py`), so an unbalanced
placement shows on every API server. Sliced, every rank counts every expert's tokens (the same
counts on each); with expert parallelism a rank counts only its own experts' (another's read 0),
so the ranks' counts add up to each expert's tokens once and each rank's sum is its share of the
work.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rankcast import kernels
from rankcast.distributed import TensorParallelGroup
from rankcast.model import ops
from rankcast.model.layers import (
    MergedColumnParallelLinear,
    PackedLinearMixin,
    ReplicatedLinear,
    RowParallelLinear,
)
from rankcast.model.linear_kernels import ROWS_SPLIT
from rankcast.model_files.arch import ArchConfig


class Expert(nn.Module):
    """One expert: `gate_up_proj` (gate_proj and up_proj stacked) and `down_proj`, left
    un-reduced across ranks (the block reduces the sum)."""

    def __init__(self, arch: ArchConfig, tp: TensorParallelGroup) -> None:
        super().__init__()
        width = arch.expert_intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(arch.hidden_size, [width] * 2, False, tp)
        self.down_proj = RowParallelLinear(width, arch.hidden_size, False, tp, reduce=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))
        return out


class SparseMoeBlock(nn.Module):
    """The experts and their router (`gate`), named as Qwen3-MoE's checkpoints name them
    (`mlp.gate`, `mlp.experts.{i}.gate_proj/up_proj/down_proj`); Mixtral's names are mapped
    onto these at load."""

    def __init__(
        self, arch: ArchConfig, tp: TensorParallelGroup, expert_parallel: bool = False
    ) -> None:
        super().__init__()
        self.tp = tp
        self.num_experts = arch.num_experts
        self.top_k = arch.experts_per_token
        self.norm_topk_prob = arch.norm_topk_prob
        self.gate = ReplicatedLinear(arch.hidden_size, arch.num_experts)
        # This rank's experts by their index in the model (their checkpoint names): all of
        # them, sliced, or with expert parallelism its share, whole.
        held = range(arch.num_experts)
        shard = tp
        if expert_parallel and tp.size > 1:
            if arch.num_experts % tp.size:
                raise ValueError(
                    f"--enable-expert-parallel: {arch.num_experts} experts do not divide "
                    f"among {tp.size} tensor-parallel ranks"
                )
            share = arch.num_experts // tp.size
            held = range(tp.rank * share, (tp.rank + 1) * share)
            shard = TensorParallelGroup()  # a whole expert: one rank's
        self.held = held
        self.experts = nn.ModuleDict({str(i): Expert(arch, shard) for i in held})
        # Tokens routed to each of this rank's experts (a token once per chosen expert) since
        # `take_routed`, then the tokens the block ran since (all zero: none), added to in
        # place here and by the C++ object.
        self.routed = torch.zeros(arch.num_experts + 1, dtype=torch.int64)
        # The block as one C++ call (`fuse`), or None: the loop below.
        self.fused: Any = None

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's chosen experts (most likely first) and their weights, in the
        activations' dtype, as transformers' router gives them: the softmax in float32, its
        top k, renormalised to sum to one where the model says so."""
        logits = self.gate(hidden)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return chosen, weights.to(logits.dtype)

    def count(self, chosen: torch.Tensor) -> torch.Tensor:
        """The tokens `chosen` routes to each of this rank's experts ([num_experts] int64; 0 for
        another rank's under expert parallelism), added to `routed`."""
        counts = torch.bincount(chosen.flatten(), minlength=self.num_experts)
        if len(self.held) < self.num_experts:
            counts[: self.held.start] = 0
            counts[self.held.stop :] = 0
        self.routed[: self.num_experts].add_(counts.to(self.routed.device))
        self.routed[self.num_experts] += chosen.shape[0]
        return counts

    def has_routed(self) -> bool:
        """Whether any token ran through the block since the last take."""
        return bool(self.routed[self.num_experts] > 0)

    def take_routed(self) -> torch.Tensor | None:
        """The counts since the last take (None: no token since), and start again from none."""
        if not self.has_routed():
            return None
        routed = self.routed[: self.num_experts].clone()
        self.routed.zero_()
        return routed

    def fuse(self) -> bool:
        """Hand the block to csrc/moe.cpp where it can run it: the kernels built, the router
        and every held expert packed for rankcast's kernels (oneDNN's tiles beside them, taken
        from ROWS_SPLIT rows on as the modules take them). Returns whether it could."""
        self.fused = None
        linears: list[PackedLinearMixin] = [self.gate]
        for expert in self.experts.values():
            assert isinstance(expert, Expert)
            linears += [expert.gate_up_proj, expert.down_proj]
        packed = [linear.packed_weight for linear in linears]
        if not kernels.available(self.gate.weight) or any(
            weight is None or weight.backend != "rankcast" or weight.groups is not None
            for weight in packed
        ):
            return False
        fused = torch.classes.rankcast.MoeExperts(
            self.num_experts,
            self.held.start,
            self.top_k,
            self.norm_topk_prob,
            self.routed,
            ROWS_SPLIT,
        )

        def tiles(linear: PackedLinearMixin) -> torch.Tensor | None:
            return linear.tiles_weight.tensor if linear.tiles_weight is not None else None

        router = self.gate.packed_weight
        assert router is not None
        fused.set_router(router.tensor, router.scales, tiles(self.gate))
        for expert in self.experts.values():
            assert isinstance(expert, Expert)
            gate_up, down = expert.gate_up_proj.packed_weight, expert.down_proj.packed_weight
            assert gate_up is not None and down is not None
            fused.add_expert(
                gate_up.tensor,
                gate_up.scales,
                gate_up.out_features,
                tiles(expert.gate_up_proj),
                down.tensor,
                down.scales,
                down.out_features,
                tiles(expert.down_proj),
            )
        self.fused = fused
        return True

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            return self.tp.all_reduce(self.fused.forward(hidden))
        chosen, weights = self.route(hidden)
        out = torch.zeros_like(hidden)
        # This rank's experts in index order, each on the tokens that chose it (a token takes
        # an expert at most once, so each index_add_ adds one row per token).
        for expert in torch.nonzero(self.count(chosen)).flatten().tolist():
            name = str(expert)
            tokens, slot = torch.where(chosen == expert)
            rows = self.experts[name](hidden[tokens]) * weights[tokens, slot, None]
            out.index_add_(0, tokens, rows.to(out.dtype))
        return self.tp.all_reduce(out)
