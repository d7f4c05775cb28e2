"""A rank's expert load, published a window at a time: the tokens each of its mixture-of-experts
layers routed to each expert (`SparseMoeBlock.routed`), summed over at most `WINDOW_S` seconds of
steps, as one `rankcast.expert_load` notification (`rankcast/channel/expert_load.py` says what it
carries). Every rank publishes its own: ranks that slice every expert count the same tokens, and
with expert parallelism each counts only the experts it holds (`SparseMoeBlock.count`).

Per step the blocks count on the device (a bincount each) and nothing else happens until the
window is due: a step that ends past it publishes (the event rides that step's reply), and a
timer publishes the window's tail when no step comes to end it (the rank's doorbell then brings
the engine core to gather it while idle), so the last requests' load is not left behind until
the next one arrives. A dense model has no window and publishes nothing.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import torch

from rankcast.channel.events import CustomNotification, WorkerNotification
from rankcast.channel.expert_load import EXPERT_LOAD_KEY, expert_load_payloads
from rankcast.model.llama import LlamaForCausalLM
from rankcast.model.moe import SparseMoeBlock

# The longest a window stays open, and so the most often a rank publishes its expert load.
WINDOW_S = 1.0


class ExpertLoadWindow:
    """The window of one rank: its MoE blocks by layer index, and the steps counted since the
    last publish. Steps run, and the window is taken, under one lock, so the timer's publish
    never reads counts a step is adding to."""

    def __init__(
        self,
        blocks: dict[int, SparseMoeBlock],
        publish: Callable[[WorkerNotification], None],
        window_s: float = WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.blocks = dict(sorted(blocks.items()))
        self.publish = publish
        self.window_s = window_s
        self.clock = clock
        self.opened: float | None = None  # when the window's first counted step began
        self.steps = 0
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None

    @classmethod
    def for_model(
        cls,
        model: LlamaForCausalLM,
        publish: Callable[[WorkerNotification], None],
        window_s: float = WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> ExpertLoadWindow | None:
        """The window of this rank's slice of `model`; None for a model without experts."""
        blocks = {
            index: layer.mlp
            for index, layer in zip(
                range(model.start_layer, model.end_layer), model.decoder_layers(), strict=True
            )
            if isinstance(layer.mlp, SparseMoeBlock)
        }
        return cls(blocks, publish, window_s, clock) if blocks else None

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Around one step of the runner: count it, and publish the window once it is due."""
        with self._lock:
            started = self.clock()
            yield
            if not any(block.has_routed() for block in self.blocks.values()):
                return  # no token ran (a step that only ended requests)
            self.steps += 1
            if self.opened is None:
                self.opened = started
            now = self.clock()
            if now - self.opened >= self.window_s:
                self._publish(now)
            elif self._timer is None:
                self._timer = threading.Timer(self.opened + self.window_s - now, self._due)
                self._timer.daemon = True
                self._timer.start()

    def _due(self) -> None:
        """The timer: publish the window if no step did since it was armed."""
        with self._lock:
            if self._timer is not threading.current_thread():
                return  # a step published the window this timer was armed for
            self._timer = None
            if self.steps:
                self._publish(self.clock())

    def _publish(self, now: float) -> None:
        """The window's counts, one notification per payload; the next window opens empty."""
        if self._timer is not None and self._timer is not threading.current_thread():
            self._timer.cancel()
        self._timer = None
        taken = [(block, block.take_routed()) for block in self.blocks.values()]
        device = next(routed.device for _, routed in taken if routed is not None)
        rows = [
            routed if routed is not None else torch.zeros(block.num_experts, dtype=torch.int64)
            for block, routed in taken
        ]
        # One copy from the device for the whole window (a layer left out counted nothing).
        tokens = torch.stack([row.to(device) for row in rows]).tolist()
        assert self.opened is not None
        seconds = now - self.opened
        for payload in expert_load_payloads(list(self.blocks), tokens, self.steps, seconds):
            self.publish(CustomNotification(key=EXPERT_LOAD_KEY, payload=payload))
        self.opened, self.steps = None, 0

    def close(self) -> None:
        """Stop the timer (what it would have published has no one left to read it)."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = None
