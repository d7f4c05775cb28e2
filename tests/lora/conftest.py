"""Real PEFT adapters for the LoRA tests, made with `peft` on the tiny model."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

if TYPE_CHECKING:
    from rankcast import LLM

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MIXED_RANKS = (4, 8, 2)


def make_adapter(model_dir: Path, out: Path, rank: int = 4, alpha: int = 8, **extra: object):
    """A real PEFT adapter with non-zero B (peft starts B at zero, which would test nothing)."""
    import peft
    import transformers

    torch.manual_seed(rank)
    base = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir), torch_dtype=torch.float32
    )
    config = peft.LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=TARGETS,
        lora_dropout=0.0,
        init_lora_weights=False,
        **extra,
    )
    model = peft.get_peft_model(base, config)
    model.save_pretrained(str(out))
    return model


def lora_llm(model_dir: Path, **overrides: Any) -> LLM:
    """An offline engine on the tiny model with LoRA on (float32, r <= 8); `overrides` set
    slots, tiers, layout."""
    from rankcast import LLM

    options: dict[str, Any] = {
        "dtype": "float32",
        "kv_cache_space_gib": 0.05,
        "enable_lora": True,
        "max_lora_rank": 8,
    }
    return LLM(str(model_dir), **{**options, **overrides})


@pytest.fixture(scope="session")
def mixed_adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Three adapters of different ranks (4, 8, 2) on the tiny model."""
    root = tmp_path_factory.mktemp("mixed-adapters")
    paths = []
    for rank in MIXED_RANKS:
        make_adapter(tiny_llama_dir, root / f"r{rank}", rank=rank, alpha=2 * rank)
        paths.append(root / f"r{rank}")
    return paths
