"""rankcast: an LLM serving engine whose notification channel reaches every rank and frontend."""

from rankcast.entrypoints.llm import LLM
from rankcast.lora.request import LoRARequest
from rankcast.outputs import CompletionOutput, RequestOutput
from rankcast.sampling_params import SamplingParams
from rankcast.version import __version__

__all__ = [
    "LLM",
    "CompletionOutput",
    "LoRARequest",
    "RequestOutput",
    "SamplingParams",
    "__version__",
]
