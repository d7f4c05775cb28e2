"""rankcast: an LLM serving engine whose notification channel reaches every rank and frontend.

The public names are imported when first used (PEP 562): importing any `rankcast.*` module
imports this package first, and `LLM` brings the engine and torch with it, ~2 s of CPU that an
API server process, which never runs the model, would otherwise pay at every start.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from rankcast.startup_gc import collector_paused
from rankcast.version import __version__

if TYPE_CHECKING:
    from rankcast.lora.request import LoRARequest
    from rankcast.offline.llm import LLM
    from rankcast.outputs import CompletionOutput, RequestOutput
    from rankcast.sampling_params import SamplingParams

# Each public name and the module that defines it.
_PUBLIC = {
    "LLM": "rankcast.offline.llm",
    "CompletionOutput": "rankcast.outputs",
    "LoRARequest": "rankcast.lora.request",
    "RequestOutput": "rankcast.outputs",
    "SamplingParams": "rankcast.sampling_params",
}

__all__ = [
    "LLM",
    "CompletionOutput",
    "LoRARequest",
    "RequestOutput",
    "SamplingParams",
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'rankcast' has no attribute {name!r}")
    with collector_paused():  # `LLM` imports torch: ~0.3 s less (rankcast/startup_gc.py)
        value = getattr(import_module(_PUBLIC[name]), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
