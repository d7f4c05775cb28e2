"""Tensor-parallel building blocks, plain `nn.Module`s whose weight loaders take their own shard.

At TP=1 each layer is an ordinary linear/embedding; at TP>1 the same code holds a slice and the
`weight_loader` attached to each parameter cuts that slice out of a full checkpoint tensor, so the
model definition never changes with the layout.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from rankcast.distributed import TensorParallelGroup
from rankcast.model import ops
from rankcast.model.linear_kernels import ROWS_SPLIT
from rankcast.model.quantization import FOUR_BIT

WeightLoader = Callable[..., None]


# A projection's adapter slots as csrc/lora.cpp reads them: each sub-projection's A and B, its
# column offset in the output, the slots' rank.
KernelSlots = tuple[list[torch.Tensor], list[torch.Tensor], list[int], int]


class LinearDelta(Protocol):
    """What a linear layer adds to its output when adapters are on (rankcast/lora/layers.py's
    `LoRALinear`): named by its shape here so the model layer does not import the LoRA one."""

    def add_to(self, x: torch.Tensor, out: torch.Tensor) -> None: ...

    def adds_this_step(self) -> bool:
        """Whether `add_to` changes anything in the current step (some token uses an adapter
        this projection holds): when none does, the model may take a path without adapters."""
        ...

    def kernel_slots(self) -> KernelSlots | None:
        """The slots as csrc/lora.cpp reads them, for the C++ decoder stack to add deltas in
        place of `add_to`: views of the tensors adapters are written into. None where the
        kernel does not apply them (torch's masked matmuls: the stack cannot)."""
        ...

    def token_slots(self) -> torch.Tensor | None:
        """The current step's adapter slot per token (-1: none), as the kernel reads it; None
        when no token uses an adapter."""
        ...


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(
            f"{what} ({numerator}) is not divisible by tensor parallel size {denominator}"
        )
    return numerator // denominator


def _copy_checked(param: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(loaded.shape)} != {tuple(param.shape)}")
    param.data.copy_(loaded)


def _attach_loader(param: nn.Parameter, loader: WeightLoader) -> None:
    param.weight_loader = loader  # type: ignore[attr-defined]


class PackedLinearMixin:
    """Matmul through a weight packed once after loading, where the platform benefits (see
    `ops.pack_linear_weight`): at decode batch sizes laying the weight out for the CPU's dot
    products on every call would cost more than the multiplication. Once packed, the plain
    weight is released unless another module reads it (see `prepack`)."""

    packed_weight: ops.PackedWeight | None = None
    # Under the `rows` path (linear_kernels.py), oneDNN's packing beside rankcast's, for steps
    # of ROWS_SPLIT rows or more.
    tiles_weight: ops.PackedWeight | None = None
    weight: nn.Parameter  # the plain weight, which each layer defines

    def prepack(
        self, weight: nn.Parameter, kernel: str, release_plain: bool, quantization: str = "none"
    ) -> None:
        """Pack `weight` for `kernel` (the model's path: `linear_kernels.choose_linear_path`);
        with `release_plain`, drop its storage afterwards: the packed copy is
        then the only one any matmul reads, and keeping both would hold the layer twice (on
        SmolLM2-135M in bfloat16, 203 of the process's ~800 MB). The parameter keeps its shape,
        dtype and device (LoRA sizes its slots by them) over a single zero; where the kernel can,
        the packed copy takes over the plain one's storage instead of a buffer of its own.
        A `quantization` scheme (rankcast/model/quantization.py SCHEMES) stores
        the weight quantized; the plain weight is then released like a packed one. Under
        "rows" it is packed for oneDNN first, then for rankcast's kernel."""
        if kernel == "rows":
            self.tiles_weight = ops.pack_linear_weight(weight.detach(), "onednn")
            kernel = "rankcast"
        self.packed_weight = ops.pack_linear_weight(
            weight.detach(), kernel, reuse_storage=release_plain, quantization=quantization
        )
        if self.packed_weight is not None and release_plain:
            _release(weight)

    def adopt_packed(self, packed: ops.PackedWeight, release_plain: bool) -> None:
        """Take a weight packed earlier, by this build of the kernels for this layer's shard
        (a weight snapshot's, rankcast/model/weight_snapshot.py), instead of packing one."""
        self.packed_weight = packed
        if release_plain:
            _release(self.weight)

    def matmul(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        if self.packed_weight is None:
            return F.linear(x, weight, bias)
        flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        packed = self.packed_weight
        if self.tiles_weight is not None and flat.shape[0] >= ROWS_SPLIT:
            packed = self.tiles_weight
        rows = ops.packed_linear(flat, packed, bias)
        return rows if x.dim() == 2 else rows.view(*x.shape[:-1], rows.shape[-1])


def _release(weight: nn.Parameter) -> None:
    """Drop a parameter's storage, keeping its shape, dtype and device over a single zero."""
    weight.data = torch.zeros((), dtype=weight.dtype, device=weight.device).expand(weight.shape)


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """Loader for replicated parameters (norms, unsharded biases)."""
    _copy_checked(param, loaded, "replicated parameter")


class RMSNorm(nn.Module):
    """RMSNorm with an optional fused residual add, computed in float32 like the reference.

    With a `weight_offset` (Gemma's 1: the norm scales by 1 + w), the weight is kept as
    offset + w in float32, formed once at load as the reference forms it at each call, and the
    normalised values are scaled by it before they are rounded to the activations' dtype
    (Gemma's order; Llama's rounds first). In float32 that is the kernels' arithmetic exactly."""

    def __init__(self, hidden_size: int, eps: float, weight_offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.weight_offset = weight_offset
        if weight_offset:
            self.weight = nn.Parameter(torch.ones(hidden_size, dtype=torch.float32))
            _attach_loader(self.weight, self._load_offset_weight)
        else:
            self.weight = nn.Parameter(torch.ones(hidden_size))
            _attach_loader(self.weight, default_weight_loader)

    def _load_offset_weight(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.shape != param.shape:
            raise ValueError(
                f"norm: checkpoint has shape {tuple(loaded.shape)}, expected {tuple(param.shape)}"
            )
        param.data.copy_(loaded.float() + self.weight_offset)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """rms_norm(x) * weight, without a residual (rows of x)."""
        return ops.rms_norm(x, self.weight, self.eps)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (normalised input, the residual stream to carry forward).

        With a residual, the sum may be formed in the residual's own storage (the caller hands
        it over): that saves a temporary per layer on the hot path.
        """
        if residual is None:
            return self.normalize(x), x
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


class ColumnParallelLinear(PackedLinearMixin, nn.Module):
    """y = x W^T with W split by output rows; each rank produces its slice of the output."""

    # Adapter slots, when LoRA is enabled (rankcast/lora/layers.py attaches them).
    lora: LinearDelta | None = None

    def __init__(
        self, input_size: int, output_size: int, bias: bool, tp: TensorParallelGroup
    ) -> None:
        super().__init__()
        self.tp = tp
        self.output_size_per_rank = _divide(output_size, tp.size, "output size")
        self.weight = nn.Parameter(torch.empty(self.output_size_per_rank, input_size))
        _attach_loader(self.weight, self.weight_loader)
        if bias:
            self.bias = nn.Parameter(torch.empty(self.output_size_per_rank))
            _attach_loader(self.bias, self.weight_loader)
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        shard = param.shape[0]
        _copy_checked(param, loaded.narrow(0, self.tp.rank * shard, shard), "column-parallel")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x, self.weight, self.bias)
        if self.lora is not None:
            self.lora.add_to(x, out)
        return out


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate and up)."""

    def __init__(
        self, input_size: int, output_sizes: list[int], bias: bool, tp: TensorParallelGroup
    ) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, tp)

    def weight_loader(  # type: ignore[override]
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int
    ) -> None:
        size = self.output_sizes[shard_id] // self.tp.size
        offset = sum(self.output_sizes[:shard_id]) // self.tp.size
        part = loaded.narrow(0, self.tp.rank * size, size)
        _copy_checked(param.data.narrow(0, offset, size), part, f"merged shard {shard_id}")


class QKVParallelLinear(ColumnParallelLinear):
    """Query, key and value projections in one matmul, split by attention heads.

    With fewer KV heads than ranks, each KV head is replicated on the ranks that share it.
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        tp: TensorParallelGroup,
    ) -> None:
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp.size, "attention heads")
        if num_kv_heads >= tp.size:
            self.num_kv_heads = _divide(num_kv_heads, tp.size, "KV heads")
            self.kv_replicas = 1
        else:
            self.num_kv_heads = 1
            self.kv_replicas = _divide(tp.size, num_kv_heads, "ranks per KV head")
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        super().__init__(hidden_size, (self.q_size + 2 * self.kv_size) * tp.size, bias, tp)

    def weight_loader(  # type: ignore[override]
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str
    ) -> None:
        if shard_id == "q":
            offset, size, index = 0, self.q_size, self.tp.rank
        else:
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            size, index = self.kv_size, self.tp.rank // self.kv_replicas
        part = loaded.narrow(0, index * size, size)
        _copy_checked(param.data.narrow(0, offset, size), part, f"qkv shard {shard_id}")


class RowParallelLinear(PackedLinearMixin, nn.Module):
    """y = x W^T with W split by input columns; partial sums are all-reduced across ranks
    (unless `reduce` is off: a mixture of experts sums its experts' partials first and
    all-reduces once)."""

    lora: LinearDelta | None = None

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        tp: TensorParallelGroup,
        reduce: bool = True,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.reduce = reduce
        self.input_size_per_rank = _divide(input_size, tp.size, "input size")
        self.weight = nn.Parameter(torch.empty(output_size, self.input_size_per_rank))
        _attach_loader(self.weight, self.weight_loader)
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size))
            _attach_loader(self.bias, default_weight_loader)
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        shard = param.shape[1]
        _copy_checked(param, loaded.narrow(1, self.tp.rank * shard, shard), "row-parallel")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = self.matmul(x, self.weight, None)
        if self.lora is not None:
            # Each rank's partial adapter delta rides the same all-reduce as the output.
            self.lora.add_to(x, partial)
        y = self.tp.all_reduce(partial) if self.reduce else partial
        return y + self.bias if self.bias is not None else y


class ReplicatedLinear(PackedLinearMixin, nn.Module):
    """y = x W^T with the whole W on every rank (a mixture of experts' router: each rank
    routes its tokens itself, to the same experts), on the same kernels as the others."""

    def __init__(self, input_size: int, output_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        _attach_loader(self.weight, default_weight_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.weight, None)


class VocabParallelEmbedding(nn.Module):
    """Token embedding split by vocabulary rows; out-of-slice ids add zeros before the sum."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.rows_per_rank = -(-vocab_size // tp.size)
        self.vocab_start = tp.rank * self.rows_per_rank
        # Loading fills every row but the padding past the vocabulary (the last rank's), so
        # only those are zeroed: zeroing the whole table first cost 0.03 s of a start, twice
        # for a tied model, whose head's own table is then replaced by the embedding's.
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, hidden_size))
        self.weight.data[max(0, vocab_size - self.vocab_start) :].zero_()
        _attach_loader(self.weight, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.shape[0] != self.vocab_size:
            raise ValueError(
                f"embedding: checkpoint has {loaded.shape[0]} rows, expected {self.vocab_size}"
            )
        end = min(self.vocab_start + self.rows_per_rank, self.vocab_size)
        param.data[: end - self.vocab_start].copy_(loaded[self.vocab_start : end])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.rows_per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)


class ParallelLMHead(PackedLinearMixin, VocabParallelEmbedding):
    """The output projection, split by vocabulary rows like the embedding it may be tied to."""

    # Set by the loader where the checkpoint keeps this head as llama.cpp's Q6_K blocks
    # (rankcast/model_files/stored_head.py) and this build multiplies them as stored: its scheme
    # is then "q6_k" (`layer_quantization`), and `q6_k_blocks` holds this rank's rows of them
    # from loading until packing.
    serves_stored_q6_k: bool = False
    q6_k_blocks: torch.Tensor | None = None

    def prepack(
        self, weight: nn.Parameter, kernel: str, release_plain: bool, quantization: str = "none"
    ) -> None:
        if quantization != "q6_k":
            super().prepack(weight, kernel, release_plain, quantization)
            return
        if self.q6_k_blocks is None:
            raise ValueError("lm_head: q6_k needs the head's stored blocks, which were not loaded")
        self.adopt_packed(ops.pack_q6_k_blocks(self.q6_k_blocks), release_plain)
        self.q6_k_blocks = None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.tp.all_gather_last_dim(self.matmul(hidden, self.weight, None))
        return logits[..., : self.vocab_size]


def packed_linears(model: nn.Module) -> list[tuple[str, PackedLinearMixin, bool]]:
    """Every linear-like layer of `model`, by module name, with whether its plain weight is its
    own (then packing may release it) rather than shared with another module (an LM head tied
    to the embedding keeps its plain form)."""
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    return [
        (name, module, uses[id(module.weight)] == 1)
        for name, module in model.named_modules()
        if isinstance(module, PackedLinearMixin)
    ]


def layer_quantization(module: PackedLinearMixin, quantization: str) -> str:
    """The scheme a layer's weight takes under the model's `quantization`: all the same, but
    with 4-bit groups the LM head (often the embedding too) takes 8-bit groups (q8_0), as
    llama.cpp's Q4_1 files keep it (the embedded SmolLM2's is Q8_0, so its head is served as
    the file holds it): its logits are what sampling reads, and 4 bits there cost the most
    (bench/perplexity.py). Where the file keeps the head as Q6_K (llama-quantize's choice
    under 4-bit layers) and the kernels multiply that as stored, the head under any group
    scheme is "q6_k": the file's own weights in its own 6.5625 bits. A router is never
    quantized."""
    if isinstance(module, ParallelLMHead) and quantization in (*FOUR_BIT, "q8_0"):
        # A GGUF file's head as it stores it, where it is Q6_K and the kernels take it.
        return "q6_k" if module.serves_stored_q6_k else "q8_0"
    if isinstance(module, ReplicatedLinear):
        # A mixture of experts' router stays in the activations' dtype, as llama.cpp keeps its
        # ffn_gate_inp in float32: a rounded logit can change which experts a token takes.
        return "none"
    return quantization


def prepack_linears(
    model: nn.Module, kernel: str, release_plain: bool = True, quantization: str = "none"
) -> None:
    """Prepack every linear-like layer's weight for `kernel` after loading (a no-op for
    "torch" unquantized), quantized as `quantization` says (`layer_quantization`), and, with
    `release_plain`, release the plain weights only their own matmul reads."""
    for _, module, own in packed_linears(model):
        scheme = layer_quantization(module, quantization)
        module.prepack(module.weight, kernel, release_plain and own, scheme)
