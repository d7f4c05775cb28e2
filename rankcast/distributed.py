"""Tensor- and pipeline-parallel groups handed explicitly to the layers that need them.

Layers receive a `TensorParallelGroup` instead of reading process-global state, so a model can
be built for any (rank, size) in a test without initialising torch.distributed. At size 1 every
collective is the identity.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallelGroup:
    """One rank's view of its tensor-parallel group."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum partial results of a row-parallel layer across the group, in place."""
        if self.size == 1:
            return tensor
        dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate each rank's slice of the last dimension (vocab-parallel logits)."""
        if self.size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


@dataclass(frozen=True)
class PipelineStage:
    """Which contiguous slice of decoder layers this rank owns, and its neighbours' global ranks.

    Activations go from a rank to the rank with the same TP rank in the next stage, so
    `prev_rank`/`next_rank` are this rank -/+ the TP size.
    """

    rank: int = 0
    size: int = 1
    prev_rank: int = -1
    next_rank: int = -1

    def send(self, tensors: tuple[torch.Tensor, ...]) -> None:
        """Hand this stage's activations to the next stage."""
        for tensor in tensors:
            dist.send(tensor.contiguous(), self.next_rank)

    def receive(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, count: int
    ) -> tuple[torch.Tensor, ...]:
        """Take the previous stage's activations (their shape follows from the shared batch)."""
        tensors = tuple(torch.empty(shape, dtype=dtype, device=device) for _ in range(count))
        for tensor in tensors:
            dist.recv(tensor, self.prev_rank)
        return tensors

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def layer_range(self, num_layers: int) -> tuple[int, int]:
        """Split layers as evenly as possible, earlier stages taking the remainder."""
        base, extra = divmod(num_layers, self.size)
        start = self.rank * base + min(self.rank, extra)
        end = start + base + (1 if self.rank < extra else 0)
        return start, end
