"""safetensors' memory-mapped reader, typed: its stub has no annotations, so mypy would see
every call on a `safe_open` handle as untyped."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open


class SafetensorsFile(Protocol):
    """What rankcast uses of `safe_open(..., framework="pt")`: the tensor names, each tensor
    by name (a view of the file's mapping, not a copy), and the header's metadata."""

    def keys(self) -> list[str]: ...

    def get_tensor(self, name: str) -> torch.Tensor: ...

    def metadata(self) -> dict[str, str] | None: ...


def open_safetensors(path: Path) -> SafetensorsFile:
    """Map `path`; safetensors' own error where it is not a readable safetensors file."""
    handle: SafetensorsFile = safe_open(str(path), framework="pt")
    return handle
