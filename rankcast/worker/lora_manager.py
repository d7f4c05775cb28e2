"""One rank's adapter manager: the host tier, the device slots, and the events they publish.

The engine core decides every move (which adapter to read, which slot to fill, what to evict and
why) so all ranks make the same moves; this class carries them out on its rank and publishes
what it did, with its own timings. That is why residency is reported per rank: a rank that
failed or lagged shows up as itself, not as whatever the engine assumed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from rankcast.channel.events import (
    LoRAAdapterActivated,
    LoRAAdapterEvicted,
    LoRAAdapterLoaded,
    LoRAAdapterLoadFailed,
    LoRAAdapterPinned,
    LoRAAdapterUnpinned,
    Notification,
)
from rankcast.lora.peft_adapter import LoRAAdapter, load_peft_adapter
from rankcast.model_files.arch import ArchConfig
from rankcast.protocol import AdapterRead, LoRAMove
from rankcast.worker.model_runner import ModelRunner


class LoRAManager:
    def __init__(
        self,
        runner: ModelRunner,
        arch: ArchConfig,
        max_lora_rank: int,
        publish: Callable[[Notification], None],
    ) -> None:
        self.runner = runner
        self.publish = publish  # the owning worker's notification buffer
        self.arch = arch
        self.max_lora_rank = max_lora_rank
        self.host: dict[int, LoRAAdapter] = {}  # adapter id -> adapter read from disk
        self.slots: dict[int, int] = {}  # device slot -> adapter id
        self.pinned: set[int] = set()
        # Every adapter this rank was ever told to load and not yet told to unload, even when
        # evicted from the host tier: an unload must still be reported for it.
        self.names: dict[int, str] = {}
        # Background reads: the host tier is shared with them, and one evicted while being
        # read is dropped when the read ends.
        self.lock = threading.Lock()
        self.reading: set[int] = set()
        self.readers: list[threading.Thread] = []  # their threads, joined by `close`
        self.cancelled: set[int] = set()
        # Background reads that ended since the engine last took them (with the rank's next
        # step reply): what the engine's registry acts on, never dropped like an event can be.
        self.finished_reads: list[AdapterRead] = []

    def apply(self, moves: list[LoRAMove]) -> None:
        """Make the engine's moves, in order (at the start of a step, or from a utility)."""
        for move in moves:
            if move.action == "read":
                self.load(move.adapter_id, move.name, move.path)
            elif move.action == "read_async":
                self.load_in_background(move.adapter_id, move.name, move.path)
            elif move.action == "activate":
                self.activate(move.adapter_id, move.slot)
            elif move.action == "evict":
                self.evict(move.adapter_id, move.tier, move.reason)
            elif move.action in ("pin", "unpin"):
                self.pin(move.adapter_id, move.action == "pin")
            else:
                raise ValueError(f"unknown LoRA move {move.action!r}")

    def load_in_background(self, adapter_id: int, name: str, path: str) -> None:
        """Start reading the adapter on a thread of its own, so the rank keeps stepping; the
        result (loaded, or load failed) is published as it would be by `load`."""
        with self.lock:
            if adapter_id in self.host or adapter_id in self.reading:
                return
            self.reading.add(adapter_id)
            self.cancelled.discard(adapter_id)
            self.names[adapter_id] = name
        reader = threading.Thread(
            target=self._read, args=(adapter_id, name, path), name=f"lora-read-{name}", daemon=True
        )
        self.readers = [t for t in self.readers if t.is_alive()]
        self.readers.append(reader)
        reader.start()

    def close(self, timeout_s: float = 60.0) -> None:
        """Wait for the reads in flight: a read's thread left running as the process exits is
        killed inside torch, which aborts the process (as the KV cache's commit did)."""
        deadline = time.monotonic() + timeout_s
        for reader in self.readers:
            reader.join(max(0.0, deadline - time.monotonic()))
        self.readers = []

    def _read(self, adapter_id: int, name: str, path: str) -> None:
        start = time.perf_counter()
        try:
            adapter = self.runner.host_tier_form(
                load_peft_adapter(name, path, self.arch, self.max_lora_rank)
            )
        except Exception as exc:
            with self.lock:
                self.reading.discard(adapter_id)
                dropped = adapter_id in self.cancelled
                if not dropped:
                    self.finished_reads.append(AdapterRead(adapter_id, name, str(exc)))
            if not dropped:
                self.publish(
                    LoRAAdapterLoadFailed(adapter_name=name, adapter_id=adapter_id, error=str(exc))
                )
            return
        with self.lock:
            self.reading.discard(adapter_id)
            if adapter_id in self.cancelled:
                self.cancelled.discard(adapter_id)
                return
            self.host[adapter_id] = adapter
            self.finished_reads.append(AdapterRead(adapter_id, name))
        self.publish(
            LoRAAdapterLoaded(
                adapter_name=name,
                adapter_id=adapter_id,
                tier="cpu",
                seconds=time.perf_counter() - start,
            )
        )

    def take_finished_reads(self) -> list[AdapterRead] | None:
        """The background reads that ended since the last call (None: none), oldest first."""
        if not self.finished_reads:
            return None
        with self.lock:
            reads, self.finished_reads = self.finished_reads, []
        return reads

    def load(self, adapter_id: int, name: str, path: str) -> float:
        """Read the adapter from disk into the host tier (the engine validated it already; a
        file changed since then fails here, is published, and leaves this rank as it was)."""
        if adapter_id in self.host:
            return 0.0
        start = time.perf_counter()
        try:
            adapter = self.runner.host_tier_form(
                load_peft_adapter(name, path, self.arch, self.max_lora_rank)
            )
        except Exception as exc:
            self.publish(
                LoRAAdapterLoadFailed(adapter_name=name, adapter_id=adapter_id, error=str(exc))
            )
            raise
        with self.lock:
            self.host[adapter_id] = adapter
        self.names[adapter_id] = name
        seconds = time.perf_counter() - start
        self.publish(
            LoRAAdapterLoaded(adapter_name=name, adapter_id=adapter_id, tier="cpu", seconds=seconds)
        )
        return seconds

    def activate(self, adapter_id: int, slot: int) -> float:
        """Copy a host-tier adapter into a free device slot (this rank's shard of it)."""
        with self.lock:
            adapter = self.host.get(adapter_id)
        if adapter is None:
            raise RuntimeError(f"adapter {adapter_id} is not in this rank's host tier")
        if slot in self.slots:
            raise RuntimeError(f"device slot {slot} still holds adapter {self.slots[slot]}")
        start = time.perf_counter()
        self.runner.set_lora(slot, adapter)
        self.slots[slot] = adapter_id
        seconds = time.perf_counter() - start
        self.publish(
            LoRAAdapterActivated(
                adapter_name=adapter.name,
                adapter_id=adapter_id,
                tier="device",
                seconds=seconds,
                slot=slot,
            )
        )
        return seconds

    def evict(self, adapter_id: int, tier: str, reason: str) -> None:
        """Drop the adapter from `tier` ("device" frees its slot; "cpu" also frees the device
        slot first, since the host tier is a superset). "unload" and "load_failed" mean the
        engine forgets the adapter; if this rank held it in no tier, that is reported with
        tier "disk", so consumers forget it too."""
        with self.lock:
            adapter = self.host.get(adapter_id)
            if adapter_id in self.reading and tier == "cpu":
                self.cancelled.add(adapter_id)  # dropped when its read ends
        if reason in ("unload", "load_failed"):
            name = self.names.pop(adapter_id, None)
            if adapter is None and name is not None:
                self.publish(
                    LoRAAdapterEvicted(
                        adapter_name=name, adapter_id=adapter_id, tier="disk", reason=reason
                    )
                )
        if adapter is None:
            return
        slot = next((s for s, a in self.slots.items() if a == adapter_id), None)
        if slot is not None:
            self.runner.clear_lora(slot)
            del self.slots[slot]
            self._publish_evicted(adapter, adapter_id, "device", reason)
        if tier == "cpu":
            with self.lock:
                del self.host[adapter_id]
            self.pinned.discard(adapter_id)
            self._publish_evicted(adapter, adapter_id, "cpu", reason)

    def pin(self, adapter_id: int, pinned: bool) -> None:
        adapter = self.host.get(adapter_id)
        if adapter is None:
            raise RuntimeError(f"adapter {adapter_id} is not on this rank")
        if pinned == (adapter_id in self.pinned):
            return
        event: LoRAAdapterPinned | LoRAAdapterUnpinned
        if pinned:
            self.pinned.add(adapter_id)
            event = LoRAAdapterPinned(
                adapter_name=adapter.name, adapter_id=adapter_id, tier="device"
            )
        else:
            self.pinned.discard(adapter_id)
            event = LoRAAdapterUnpinned(
                adapter_name=adapter.name, adapter_id=adapter_id, tier="device"
            )
        self.publish(event)

    def _publish_evicted(
        self, adapter: LoRAAdapter, adapter_id: int, tier: str, reason: str
    ) -> None:
        self.publish(
            LoRAAdapterEvicted(
                adapter_name=adapter.name, adapter_id=adapter_id, tier=tier, reason=reason
            )
        )
