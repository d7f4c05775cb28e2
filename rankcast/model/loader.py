"""Build a model for one rank and fill it from safetensors files, with progress and clear errors."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open
from tqdm import tqdm

from rankcast import envs
from rankcast.distributed import PipelineStage, TensorParallelGroup
from rankcast.errors import ModelFormatError
from rankcast.model.arch import ArchConfig
from rankcast.model.layers import prepack_linears
from rankcast.model.llama import LlamaForCausalLM


class _SafetensorsFile(Protocol):
    """What this module uses of `safe_open(..., framework="pt")`, whose stub has no
    annotations: the tensor names, and each tensor by name."""

    def keys(self) -> list[str]: ...

    def get_tensor(self, name: str) -> torch.Tensor: ...


def iterate_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every tensor of every *.safetensors file, memory-mapped, in file order."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelFormatError(f"{model_dir}: no *.safetensors weights found")
    for file in files:
        try:
            handle: _SafetensorsFile = safe_open(str(file), framework="pt")
            names = list(handle.keys())
        except Exception as exc:
            raise ModelFormatError(f"{file}: cannot be read as safetensors ({exc})") from None
        for name in tqdm(
            names, desc=f"Loading {file.name}", unit="tensor", disable=envs.disable_progress()
        ):
            try:
                tensor = handle.get_tensor(name)
            except Exception as exc:
                raise ModelFormatError(f"{file}: tensor {name} is unreadable ({exc})") from None
            yield name, tensor


def load_model(
    model_dir: Path,
    arch: ArchConfig,
    dtype: torch.dtype,
    device: torch.device,
    tp: TensorParallelGroup | None = None,
    pp: PipelineStage | None = None,
    keep_plain_weights: bool = False,
) -> LlamaForCausalLM:
    """Construct this rank's slice of the model and load its shard of the weights.

    The linears' weights end up packed for the CPU's kernels, their plain copies released
    (`prepack_linears`) unless `keep_plain_weights` (tests that compare loaded shards)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(arch, tp, pp)
    finally:
        torch.set_default_dtype(previous)
    loaded = model.load_weights(iterate_safetensors(model_dir))
    expected = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    missing = sorted(expected - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ModelFormatError(f"{model_dir}: checkpoint lacks {len(missing)} tensors: {shown}")
    prepack_linears(model, release_plain=not keep_plain_weights)
    return model.eval()
