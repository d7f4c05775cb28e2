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

Each block counts the tokens it routes to each of its experts (`routed`, one bincount a step,
which also names the experts the step runs); the worker takes the counts once a window and
publishes them (`rankcast/worker/expert_load.py`), so an unbalanced placement shows on every API
server. Sliced, every rank counts every expert's tokens (the same counts on each); with expert
parallelism a rank counts only its own experts' (another's read 0), so the ranks' counts add up
to each expert's tokens once and each rank's sum is its share of the work.
"""

from __future__ import annotations

import torch
from torch import nn

from rankcast.distributed import TensorParallelGroup
from rankcast.model import ops
from rankcast.model.layers import MergedColumnParallelLinear, ReplicatedLinear, RowParallelLinear
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
        # `take_routed`; None: none since.
        self.routed: torch.Tensor | None = None

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
        self.routed = counts if self.routed is None else self.routed.add_(counts)
        return counts

    def take_routed(self) -> torch.Tensor | None:
        """The counts since the last take (None: no token since), and start again from none."""
        routed, self.routed = self.routed, None
        return routed

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
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
