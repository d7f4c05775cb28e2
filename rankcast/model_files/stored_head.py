"""An LM head kept as the GGUF file stores it, beside the file's float conversion.

llama-quantize keeps a model's LM head Q6_K under 4-bit layers, and at one token the head is a
large share of what a small or sparse model reads (Qwen3-30B-A3B cut to 4 layers: 311M of 539M
active parameters). The conversion dequantizes every tensor to float; served from that, the head
would be re-quantized to q8_0 (8.5 bits a weight) where the file holds 6.5625. So the
conversion also saves the head's own Q6_K blocks, and a rank whose kernels multiply Q6_K as
stored (csrc/gemm_q6k.cpp) packs those instead: the file's exact weights in the file's bytes.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: the engine core reads model files without torch
    import torch

# In a conversion's directory: safetensors holding "lm_head.weight", uint8 [vocab, hidden / 256
# * 210], the head's Q6_K blocks as the GGUF stores them (its `output` tensor, or the embedding
# a tied head reads). Not named *.safetensors: the checkpoint's loader reads every such file.
STORED_HEAD_FILE = "lm_head.q6_k"
STORED_HEAD_TENSOR = "lm_head.weight"


def has_stored_head(model_dir: Path) -> bool:
    return (model_dir / STORED_HEAD_FILE).is_file()


def stored_head_rows(model_dir: Path, start: int, rows: int) -> torch.Tensor:
    """Rows [start, start + rows) of the stored head's blocks (a tensor-parallel rank's share of
    the vocabulary), zero rows past its end (a zero block's d is 0: its weights are 0)."""
    import torch
    from safetensors import safe_open

    with safe_open(str(model_dir / STORED_HEAD_FILE), framework="pt") as handle:
        stored = handle.get_slice(STORED_HEAD_TENSOR)
        width = stored.get_shape()[1]
        shard: torch.Tensor = stored[start : start + rows]
    if shard.shape[0] < rows:
        padding = torch.zeros(rows - shard.shape[0], width, dtype=torch.uint8)
        shard = torch.cat([shard, padding])
    return shard.contiguous()
