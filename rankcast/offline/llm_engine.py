"""The synchronous engine behind the offline `LLM`: tokenize, step the core, process outputs."""

from __future__ import annotations

import atexit
import itertools
import time
from typing import Any

from rankcast.channel.decoder import NotificationDecoder
from rankcast.channel.events import Notification
from rankcast.config import EngineConfig
from rankcast.engine_client.core_client import CoreFactory, InprocClient
from rankcast.engine_client.output_processor import OutputProcessor
from rankcast.model_files.source import resolve_model
from rankcast.outputs import RequestOutput
from rankcast.protocol import EngineCoreRequest, R, Utility
from rankcast.sampling_params import SamplingParams
from rankcast.tokenizer import load_tokenizer


class LLMEngine:
    """`build_core` makes the in-process engine core (`rankcast.engine_core.core.EngineCore`,
    passed by the entry points: this package runs in API servers too and never imports the
    engine core's, which brings the model and torch)."""

    def __init__(self, config: EngineConfig, build_core: CoreFactory) -> None:
        self.config = config
        self.source = resolve_model(config.model.model)
        self.tokenizer = load_tokenizer(self.source.model_dir)
        self.client = InprocClient(config, self.source, build_core)
        # A script that never calls `shutdown` still ends: without this, its rank processes
        # (tensor or pipeline parallel) waited for calls while multiprocessing's exit hook
        # waited for them, forever, and an in-process rank's cache commit was killed inside
        # torch, aborting the process. Registered after multiprocessing's hook, so it runs first;
        # a bound method equals only itself, so `shutdown` unregisters this engine's hook alone.
        atexit.register(self.client.shutdown)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        self.notification_decoder = NotificationDecoder()
        # Kept encoded and decoded when taken: a step pays nothing to decode events that
        # nobody may ask for (the channel's cost on decode throughput, issue 12).
        self._kept: list[Any] = []

    @property
    def max_model_len(self) -> int:
        return self.client.max_model_len

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        lora_name: str | None = None,
    ) -> str:
        request_id = request_id or str(next(self._ids))
        if isinstance(prompt, str):
            prompt_text: str | None = prompt
            prompt_ids = self.tokenizer.encode(prompt)
        else:
            prompt_text, prompt_ids = None, list(prompt)
        request = EngineCoreRequest(
            request_id, prompt_ids, params, arrival_time=time.time(), lora_name=lora_name
        )
        self.client.add_request(request)
        self.output_processor.add_request(request_id, prompt_text, prompt_ids, params)
        return request_id

    def abort_requests(self, request_ids: list[str]) -> None:
        self.client.abort_requests(request_ids)
        self.output_processor.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        outputs = self.client.get_output()
        if outputs.engine_notifications:
            self._keep(outputs.engine_notifications)
        processed = self.output_processor.process_outputs(outputs.outputs)
        if processed.requests_to_abort:
            self.client.abort_requests(processed.requests_to_abort)
        return processed.request_outputs

    def _keep(self, raws: list[Any]) -> None:
        self._kept.extend(raws)

    @property
    def notifications(self) -> list[Notification]:
        """What the steps delivered so far and nobody took yet, decoded (no gather, no clear)."""
        return self.notification_decoder.decode(self._kept)[0]

    def take_notifications(self) -> list[Notification]:
        """Every notification gathered so far, oldest first, and forget them.

        Looks at the doorbell (and the poll) first, so an event published since the last step
        is here even if no step runs again.
        """
        raws = self.client.idle_output().engine_notifications
        if raws:
            self._keep(raws)
        taken = self.notifications
        self._kept = []
        return taken

    def call(self, utility: Utility[R]) -> R:
        """Run an engine-core utility (`rankcast.protocol`: AddLoRA, PinLoRA, CollectiveRPC,
        ...); what a utility that changes producers published is gathered before it returns."""
        return self.client.call(utility)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], variables: dict[str, Any] | None = None
    ) -> list[int]:
        from rankcast.tokenizer import apply_chat_template

        return apply_chat_template(self.tokenizer, messages, variables=variables)

    def shutdown(self) -> None:
        atexit.unregister(self.client.shutdown)
        self.client.shutdown()
