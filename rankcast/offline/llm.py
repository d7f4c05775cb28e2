"""`LLM`: offline batched generation in the caller's process."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from rankcast.channel.events import Notification
from rankcast.config import EngineConfig
from rankcast.lora.request import LoRARequest
from rankcast.offline.llm_engine import LLMEngine
from rankcast.outputs import RequestOutput
from rankcast.protocol import (
    AddLoRA,
    CollectiveRPC,
    ListLoRAs,
    LoRAAdapterInfo,
    PinLoRA,
    ResetPrefixCache,
)
from rankcast.sampling_params import SamplingParams
from rankcast.startup_gc import collector_paused, freeze_startup_heap, release_startup_heap
from rankcast.tokenizer import ModelTokenizer

Message = dict[str, Any]


class LLM:
    """Generate from many prompts at once; all prompts share continuous batches.

    `model=None` serves the embedded SmolLM2-135M-Instruct. Other keyword arguments are the
    engine options (`dtype`, `max_model_len`, `max_num_seqs`, `num_blocks`, ...).
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.config = EngineConfig.from_kwargs(model=model, **kwargs)
        # The collector paused while torch loads and the model is built, and the result frozen
        # (rankcast/startup_gc.py): ~0.3-0.5 s of a warm start; `shutdown` thaws it.
        with collector_paused():
            # Imported here: the engine core brings the model and torch, which importing this
            # module (the CLI does) must not pay for.
            from rankcast.engine_core.core import EngineCore

            self.engine = LLMEngine(self.config, EngineCore)
        freeze_startup_heap()

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """Wrap an engine built from an existing configuration tree (the CLI builds one)."""
        llm = cls.__new__(cls)
        llm.config = engine.config
        llm.engine = engine
        return llm

    def get_tokenizer(self) -> ModelTokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids); results come back in prompt order.

        `lora_request` serves every prompt (or each prompt, given a list) with an adapter,
        loaded on first use; needs `enable_lora=True`.
        """
        batch: list[str | list[int]] = [prompts] if isinstance(prompts, str) else [*prompts]
        return self._run(batch, params, lora_request)

    def chat(
        self,
        messages: list[Message] | Sequence[list[Message]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or several, then generate.
        `chat_template_kwargs`: more variables the template sees (Qwen3's `enable_thinking`),
        as vLLM's `LLM.chat` takes them."""
        if messages and isinstance(messages[0], dict):
            conversations = [cast(list[Message], messages)]
        else:
            conversations = [list(conv) for conv in cast(Sequence[list[Message]], messages)]
        prompts: list[str | list[int]] = [
            self.engine.apply_chat_template(conv, chat_template_kwargs) for conv in conversations
        ]
        return self._run(prompts, params)

    def _run(
        self,
        prompts: list[str | list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        if params is None or isinstance(params, SamplingParams):
            per_prompt = [params or SamplingParams()] * len(prompts)
        else:
            per_prompt = list(params)
            if len(per_prompt) != len(prompts):
                raise ValueError(f"got {len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            adapters: list[LoRARequest | None] = [lora_request] * len(prompts)
        else:
            adapters = list(lora_request)
            if len(adapters) != len(prompts):
                raise ValueError(f"got {len(adapters)} LoRA requests for {len(prompts)} prompts")
        # First use order, so slots are assigned the same way every run.
        for first_use in dict.fromkeys(a for a in adapters if a is not None):
            self.engine.call(AddLoRA(first_use.name, first_use.path))
        order: dict[str, int] = {}
        try:
            for index, (prompt, p, adapter) in enumerate(
                zip(prompts, per_prompt, adapters, strict=True)
            ):
                lora_name = adapter.name if adapter is not None else None
                order[self.engine.add_request(prompt, p, lora_name=lora_name)] = index
        except Exception:
            self.engine.abort_requests(list(order))
            raise
        finished: list[RequestOutput | None] = [None] * len(prompts)
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished and output.request_id in order:
                    finished[order[output.request_id]] = output
        return [out for out in finished if out is not None]

    def collective_rpc(
        self, method: str, args: list[Any] | None = None, timeout: float | None = None
    ) -> list[Any]:
        """Call a `worker_extension_cls` method on every rank; replies in rank order."""
        return self.engine.call(CollectiveRPC(method, args, timeout))

    def pin_lora(self, name: str, pinned: bool = True) -> LoRAAdapterInfo:
        """Keep a registered adapter in the device tier until unpinned (LRU eviction skips it)."""
        return self.engine.call(PinLoRA(name, pinned))

    def list_loras(self) -> list[LoRAAdapterInfo]:
        """Registered adapters with their tiers, device slot and pin."""
        return self.engine.call(ListLoRAs())

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block; False (nothing done) while requests hold blocks."""
        return self.engine.call(ResetPrefixCache())

    def take_notifications(self) -> list[Notification]:
        """The engine notifications gathered so far (weight loads, plugin events, ...), each
        stamped with the rank it came from; oldest first, each returned once."""
        return self.engine.take_notifications()

    def shutdown(self) -> None:
        """Stop the engine and thaw what its start froze. `gc.freeze` is process-wide: objects
        the caller held when this engine started are frozen with it until now, and a caller's
        own earlier `gc.freeze` is undone here too. An engine never stopped is stopped at
        interpreter exit (and kept until then), so a script that never calls this still ends."""
        self.engine.shutdown()
        release_startup_heap()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
