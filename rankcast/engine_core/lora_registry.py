"""Which LoRA adapters the engine serves, and where each one is on every rank.

The engine core owns this, not an API server, so adapters added through any API server (or the
offline `LLM`) are the same for all. Three places an adapter can be, per rank:

- registered only: known by name and path, read from disk again when a request needs it;
- the host tier (`--max-cpu-loras`): read and kept in host memory, ready to copy to a slot;
- a device slot (`--max-loras`): requests can run on it. Every device adapter is also in the
  host tier.

Every move is decided here and made by each rank's `LoRAManager`, so all ranks make the same
moves and each reports its own. Moves the scheduler needs ride the next step
(`SchedulerOutput.lora_moves`, taken with `take_moves`); a read from disk that a request needs
runs on each rank's own thread, and the adapter counts as in the host tier once every rank has
reported it loaded (observed as the events leave the engine), so running requests keep decoding
meanwhile. An operator's utility (add, remove, pin) makes its moves at once. The engine checks
an adapter from its config and tensor header; only the ranks read its tensors. Nothing is
evicted before the incoming adapter has been read, and an adapter a running request uses, or a
pinned one, is never evicted. Among the rest, a device slot goes to the least recently used;
the host tier keeps the adapters most asked for lately (the engine's last RECENT_REQUESTS
requests), the least recently used going first among equals.

Why the host tier counts requests: under skewed (Zipf) traffic, the most popular adapter is
often idle for a moment between its requests, and least-recently-used alone then evicts it for
a rarely used one and reads it back from disk a few steps later. Measured on bench/routing.py's
adapter part (2-core Sapphire Rapids, 12 adapters, host tier of 4 per engine): the engine most
asked for one adapter read it from disk six times in ten seconds under LRU.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rankcast.config import LoRAConfig
from rankcast.engine_core.adapter_turns import AdapterState
from rankcast.errors import (
    AdapterBusyError,
    AdapterExistsError,
    CapacityError,
    ClientError,
    UnknownAdapterError,
)
from rankcast.executor.base import Executor, ExecutorError
from rankcast.model_files.arch import ArchConfig
from rankcast.protocol import (
    AdapterRead,
    ApplyLoRAMoves,
    LoRAAdapterInfo,
    LoRAMove,
)

# The engine's latest requests whose adapters the host tier counts to decide who stays: long
# enough to rank a few dozen adapters by popularity, short enough to follow it as it shifts.
RECENT_REQUESTS = 256


def startup_share(names: list[str], engine: int, engines: int) -> list[str]:
    """The order in which data-parallel engine `engine` of `engines` wants its `--lora-modules`
    resident at start: every `engines`-th one from its own index first, then the rest as
    listed. Engines starting with the same adapters (the last registered, as each engine read
    them all) held one set between them; round robin, the group holds up to `engines` times as
    many, the first listed spread over the engines, each with a home the router sends it to.
    """
    own = names[engine::engines]
    return own + [name for name in names if name not in own]


class LoRACapacityError(CapacityError):
    """No room can be made for an adapter without evicting one that must stay."""


class LoRALoadError(ClientError):
    """A rank could not read an adapter that was valid when registered (the files changed)."""


@dataclass
class RegisteredAdapter:
    name: str
    path: str
    adapter_id: int
    rank: int
    nbytes: int
    in_host: bool = False
    slot: int | None = None
    pinned: bool = False
    last_used: int = 0  # logical clock: larger is more recent
    # A background read is in flight; the ranks that have reported it done so far; the
    # adapter that leaves the host tier when it is done (its place was reserved at the start).
    loading: bool = False
    loaded_ranks: set[int] = field(default_factory=set)
    makes_room_from: str | None = None
    leaving: bool = False  # reserved to leave the host tier when a read in flight ends
    # Its read took a parked adapter's place (`prepare`'s `spare`): that one leaves when the
    # read is done even though requests still name it, unless it is back in a device slot.
    room_from_parked: bool = False

    @property
    def tiers(self) -> list[str]:
        return [t for t, held in (("device", self.slot is not None), ("cpu", self.in_host)) if held]


class LoRARegistry:
    def __init__(
        self,
        executor: Executor,
        arch: ArchConfig,
        config: LoRAConfig,
        requests_using: Callable[[str], int],
        running_adapters: Callable[[], set[str]],
        world_size: int = 1,
    ) -> None:
        self.executor = executor
        self.world_size = world_size
        # Moves decided for the next step, and why adapters whose background read failed
        # were dropped (the requests that waited for them are told).
        self.planned: list[LoRAMove] = []
        self.failed: dict[str, str] = {}
        self.arch = arch
        self.config = config
        self.max_loras = config.max_loras
        self.requests_using = requests_using
        self.running_adapters = running_adapters
        self.adapters: dict[str, RegisteredAdapter] = {}
        # Adapters evicted (from a device slot or the host tier) to make room for another, and
        # not needed since: the next request on one of them counts a thrash.
        self.displaced: set[str] = set()
        roots = config.allowed_lora_paths
        self.allowed_roots = None if roots is None else [Path(r) for r in roots]
        self._ids = itertools.count(1)
        self._clock = itertools.count(1)
        # The adapters of the engine's latest requests (at most RECENT_REQUESTS), and how many
        # of them name each adapter: the host tier's measure of popularity.
        self.recent: collections.deque[str] = collections.deque()
        self.recent_counts: collections.Counter[str] = collections.Counter()

    def update_from_reads(self, reads_per_rank: list[list[AdapterRead] | None]) -> None:
        """Follow background reads from the step's typed results (one list per rank, in rank
        order): an adapter is ready once every rank has read it, and dropped when one could
        not. Called by the engine core with every step's replies, before the next schedule."""
        for rank, reads in enumerate(reads_per_rank):
            for read in reads or ():
                entry = self.adapters.get(read.name)
                if entry is None or not entry.loading or entry.adapter_id != read.adapter_id:
                    continue  # unloaded, or registered again, while it was being read
                if read.error is not None:
                    self._read_failed(entry, read.error)
                    continue
                entry.loaded_ranks.add(rank)
                if len(entry.loaded_ranks) >= self.world_size:
                    self._read_done(entry)

    def reads_in_flight(self) -> bool:
        """Whether some adapter is still being read on some rank."""
        return any(entry.loading for entry in self.adapters.values())

    def _read_done(self, entry: RegisteredAdapter) -> None:
        """Read on every rank: only now does the adapter whose place it took leave (unless a
        request started on it meanwhile: then the tier holds one more until it goes idle)."""
        entry.loading, entry.in_host = False, True
        self._touch(entry)
        from_parked, entry.room_from_parked = entry.room_from_parked, False
        victim = self._release_reservation(entry)
        if victim is None:
            return
        # A parked adapter out of the device slots serves no request now; one back in a slot
        # (its requests resumed) stays, as does any adapter requests started on meanwhile.
        gone = victim.slot is None if from_parked else victim.name not in self.running_adapters()
        if gone:
            self._move(LoRAMove("evict", victim.adapter_id, tier="cpu", reason="capacity"))
            victim.in_host, victim.slot = False, None

    def _release_reservation(self, entry: RegisteredAdapter) -> RegisteredAdapter | None:
        name, entry.makes_room_from = entry.makes_room_from, None
        victim = self.adapters.get(name) if name is not None else None
        if victim is None or not victim.leaving:
            return None
        victim.leaving = False
        return None if victim.pinned else victim

    def _read_failed(self, entry: RegisteredAdapter, error: str) -> None:
        """A rank could not read it (the files changed since it was registered): every request
        for it would fail the same way, so it is unregistered, undone on every rank, and the
        requests waiting for it are refused with the rank's error."""
        entry.loading, entry.room_from_parked = False, False
        self._release_reservation(entry)  # the adapter it would have replaced stays
        self._move(LoRAMove("evict", entry.adapter_id, tier="cpu", reason="load_failed"))
        del self.adapters[entry.name]
        first_line = error.splitlines()[0] if error else "unknown error"
        self.failed[entry.name] = (
            f"could not load adapter {entry.name!r} (unregistered): {first_line}"
        )

    # ---- moves ----

    def _move(self, move: LoRAMove) -> None:
        self.planned.append(move)
        if move.action == "evict" and move.reason in ("capacity", "lru"):
            # Pushed out to make room for another: a request that needs it again undoes this.
            self.displaced.update(
                a.name for a in self.adapters.values() if a.adapter_id == move.adapter_id
            )

    def whereabouts(self, name: str) -> str:
        """Where a request on `name` finds it now: "device" (a slot), "host" (every rank's
        host tier) or "disk" (it must be read first)."""
        entry = self.adapters.get(name)
        if entry is not None and entry.slot is not None:
            return "device"
        if entry is not None and entry.in_host:
            return "host"
        return "disk"

    def note_request(self, name: str) -> None:
        """A request on `name` had its first turn: it counts among the latest requests that
        decide who stays in the host tier."""
        if len(self.recent) >= RECENT_REQUESTS:
            oldest = self.recent.popleft()
            self.recent_counts[oldest] -= 1
            if not self.recent_counts[oldest]:
                del self.recent_counts[oldest]
        self.recent.append(name)
        self.recent_counts[name] += 1

    def undo_displacement(self, name: str) -> bool:
        """Whether a request needing `name` off its device slot undoes an eviction that made
        room for another adapter (thrashing); each eviction is undone once."""
        if name in self.displaced:
            self.displaced.discard(name)
            return True
        return False

    def take_moves(self) -> list[LoRAMove]:
        """The moves decided since the last call, for the next step to carry."""
        moves, self.planned = self.planned, []
        return moves

    def _send_now(self) -> None:
        """A utility's moves go at once, not with a step."""
        moves = self.take_moves()
        if moves:
            self.executor.call(ApplyLoRAMoves(moves))

    # ---- registration ----

    def add(self, name: str, path: str) -> LoRAAdapterInfo:
        """Check, then read into every rank's host tier now and, if a slot is free, the device.

        The same name and path again is a no-op. A full host tier makes room by evicting its
        least recently used idle adapter (reason "capacity"); a full set of device slots does
        not: the adapter moves to the device when a request needs it.
        """
        if not name:
            raise ClientError("an adapter needs a name")
        # Here, not with the module: the adapter module brings torch, which the engine core's
        # start leaves to its ranks (rankcast/executor/base.py `worker_cls`).
        from rankcast.lora.peft_adapter import inspect_peft_adapter

        meta = inspect_peft_adapter(path, self.arch, self.config.max_lora_rank, self.allowed_roots)
        known = self.adapters.get(name)
        if known is not None:
            if known.path == str(meta.path):
                return self.describe(known)
            raise AdapterExistsError(
                f"adapter {name!r} is already loaded from {known.path}; unload it first to "
                f"load {meta.path} under that name"
            )
        self._send_now()
        entry = RegisteredAdapter(name, str(meta.path), next(self._ids), meta.rank, meta.nbytes)
        self.failed.pop(name, None)
        self._read_into_host(entry, self.running_adapters())
        self.adapters[name] = entry
        self._touch(entry)
        free = self._free_slots()
        if free:
            self._activate(entry, free[0])
        self._send_now()
        return self.describe(entry)

    def start_with(self, names: list[str]) -> None:
        """Startup: the host tier holds the first of `names` it has room for and the device
        slots the first of those, reading and evicting as needed (an engine's `--lora-modules`
        are all read as they are registered, which leaves whichever came last otherwise)."""
        keep = [name for name in names if name in self.adapters][: self.config.host_capacity]
        for name in keep:
            entry = self.adapters[name]
            if not entry.in_host:
                self._read_into_host(entry, set(keep))
        on_device = keep[: self.max_loras]
        for name in on_device:
            if self.acquire(name, set(on_device)) is None:
                break
        for name in reversed(keep):  # the first named is the most recently used
            self._touch(self.adapters[name])
        self._send_now()

    def remove(self, name: str) -> None:
        """Unload from every tier of every rank (a read in flight is dropped); refused while
        any request still names it."""
        entry = self._entry(name)
        busy = self.requests_using(name)
        if busy:
            raise AdapterBusyError(f"adapter {name!r} is in use by {busy} request(s)")
        self._move(LoRAMove("evict", entry.adapter_id, tier="cpu", reason="unload"))
        del self.adapters[name]
        self._send_now()

    def pin(self, name: str, pinned: bool) -> LoRAAdapterInfo:
        """Pin: bring the adapter to the device now and keep it there until unpinned."""
        entry = self._entry(name)
        self._send_now()
        if pinned and entry.slot is None:
            if not entry.in_host:
                self._read_into_host(entry, self.running_adapters())
            slot = self.acquire(name, self.running_adapters())
            if slot is None:
                raise LoRACapacityError(
                    f"every device slot (--max-loras {self.max_loras}) holds an adapter that "
                    "running requests use; retry when they finish"
                )
        if entry.pinned != pinned:
            self._move(LoRAMove("pin" if pinned else "unpin", entry.adapter_id))
            entry.pinned = pinned
        self._send_now()
        return self.describe(entry)

    # ---- residency on demand (the scheduler's side) ----

    def prepare(
        self, name: str, protected: set[str], spare: frozenset[str] = frozenset()
    ) -> AdapterState:
        """Whether `name` is in every rank's host tier; if not, its read is started (on each
        rank's own thread) and the request waits. Raises for an adapter that cannot be served:
        unknown, or dropped because a rank could not read it.

        A read holds its place in the host tier from the start: in a full tier it reserves the
        idle adapter `_host_victim` picks, never one of `protected` (those of running requests,
        of the batch being formed and of requests ahead in the queue), which leaves only when
        the read is done; with no such adapter the read waits ("no_room"), so reads never push
        out each other's adapters before they are used. Only when no idle adapter is left may
        it take the place of one of `spare` (parked adapters, which the scheduler offers for a
        request with no token yet): the most recently used one out of the device slots, the
        last its requests will want back when adapters take turns."""
        entry = self.adapters.get(name)
        if entry is None:
            if name in self.failed:
                raise LoRALoadError(self.failed[name])
            entry = self._entry(name)
        if entry.in_host:
            return "ready"
        if entry.loading:
            return "reading"
        try:
            victim = self._host_victim(protected | {name})
        except LoRACapacityError:
            victim = self._spare_victim(spare - {name})
            if victim is None:
                return "no_room"
            entry.room_from_parked = True
        if victim is not None:
            victim.leaving = True  # leaves once the read is done, not before
            entry.makes_room_from = victim.name
        entry.loading = True
        entry.loaded_ranks = set()
        self._move(LoRAMove("read_async", entry.adapter_id, entry.name, entry.path))
        return "reading"

    def acquire(self, name: str, busy: set[str]) -> int | None:
        """The device slot `name` (in the host tier: `prepare`) runs on, moving it there if
        needed; None: not now.

        `busy` are the adapters of running requests and of the batch being formed: they are
        never evicted. None means every slot holds a busy adapter (the request waits for one to
        finish). Every slot held by a pinned adapter is a lasting refusal, so it raises.
        """
        entry = self._entry(name)
        self._touch(entry)
        if entry.slot is not None:
            return entry.slot
        if not entry.in_host:
            return None
        if not self._free_slots() and self._device_victim(busy) is None:
            if all(a.pinned for a in self.adapters.values() if a.slot is not None):
                raise LoRACapacityError(
                    f"every device slot (--max-loras {self.max_loras}) holds a pinned adapter; "
                    f"unpin one to serve {name!r}"
                )
            return None
        free = self._free_slots()
        if free:
            slot = free[0]
        else:
            victim = self._device_victim(busy | {name})
            if victim is None:
                return None
            slot = self._evict_device(victim, "lru")
        self._activate(entry, slot)
        return slot

    def _free_slots(self) -> list[int]:
        used = {a.slot for a in self.adapters.values()}
        return [slot for slot in range(self.max_loras) if slot not in used]

    def _device_victim(self, busy: set[str]) -> RegisteredAdapter | None:
        idle = [
            a
            for a in self.adapters.values()
            if a.slot is not None and not a.pinned and a.name not in busy
        ]
        return min(idle, key=lambda a: a.last_used, default=None)

    def _read_into_host(self, entry: RegisteredAdapter, busy: set[str]) -> None:
        """Disk -> host tier on every rank, now (a utility's read); if the tier is full, the
        idle adapter `_host_victim` picks is evicted, but only after the read succeeded, so an
        adapter that cannot be read costs no other adapter its place (the tier holds one more
        for the moment in between)."""
        victim = self._host_victim(busy)
        self._load(entry)
        if victim is not None:
            self._move(LoRAMove("evict", victim.adapter_id, tier="cpu", reason="capacity"))
            victim.in_host, victim.slot = False, None

    def _host_victim(self, busy: set[str]) -> RegisteredAdapter | None:
        """Who leaves the host tier to make room for one more (None: room left): of its idle
        adapters, off-device ones first, the one the fewest of the latest requests asked for,
        then the least recently used; raises when nobody may leave."""
        # Reads in flight hold their places; adapters already promised to one are not taken.
        held = [a for a in self.adapters.values() if (a.in_host or a.loading) and not a.leaving]
        if len(held) < self.config.host_capacity:
            return None
        idle = [a for a in held if a.in_host and not a.pinned and a.name not in busy]
        if not idle:
            raise LoRACapacityError(
                f"the host tier (--max-cpu-loras {self.config.host_capacity}) holds only "
                "adapters that requests use or that are pinned"
            )
        counts = self.recent_counts
        return min(idle, key=lambda a: (a.slot is not None, counts[a.name], a.last_used))

    def _spare_victim(self, spare: frozenset[str]) -> RegisteredAdapter | None:
        """Of the parked adapters offered, the one whose place a read may take: in the host
        tier only (not in a slot, not pinned, not already promised), most recently used."""
        candidates = [
            a
            for name in spare
            if (a := self.adapters.get(name)) is not None
            and a.in_host
            and a.slot is None
            and not a.pinned
            and not a.leaving
        ]
        return max(candidates, key=lambda a: a.last_used, default=None)

    def _evict_device(self, victim: RegisteredAdapter, reason: str) -> int:
        assert victim.slot is not None
        self._move(LoRAMove("evict", victim.adapter_id, tier="device", reason=reason))
        slot, victim.slot = victim.slot, None
        return slot

    def _load(self, entry: RegisteredAdapter) -> None:
        """Disk -> host tier on every rank, before returning; a rank that fails is undone on
        the others.

        A registered adapter that can no longer be read (its files changed) is unregistered:
        every request for it would fail the same way, and the operator sees why in the
        `lora_adapter_load_failed` events.
        """
        try:
            self.executor.call(
                ApplyLoRAMoves([LoRAMove("read", entry.adapter_id, entry.name, entry.path)])
            )
        except ExecutorError as exc:
            self.executor.call(
                ApplyLoRAMoves(
                    [LoRAMove("evict", entry.adapter_id, tier="cpu", reason="load_failed")]
                )
            )
            dropped = self.adapters.pop(entry.name, None) is not None
            first_line = str(exc).splitlines()[0]
            note = " (unregistered)" if dropped else ""
            raise LoRALoadError(
                f"could not load adapter {entry.name!r}{note}: {first_line}"
            ) from None
        entry.in_host = True

    def _activate(self, entry: RegisteredAdapter, slot: int) -> None:
        self._move(LoRAMove("activate", entry.adapter_id, slot=slot))
        entry.slot = slot

    def _touch(self, entry: RegisteredAdapter) -> None:
        entry.last_used = next(self._clock)

    # ---- lookups ----

    def check_servable(self, name: str) -> None:
        """Raise now, at submission, for a request that could never run: an unknown adapter,
        or every slot pinned by other adapters."""
        entry = self._entry(name)
        pinned = [a for a in self.adapters.values() if a.pinned and a.slot is not None]
        if entry.slot is None and len(pinned) >= self.max_loras:
            raise LoRACapacityError(
                f"every device slot (--max-loras {self.max_loras}) holds a pinned adapter "
                f"({', '.join(sorted(a.name for a in pinned))}); unpin one to serve {name!r}"
            )

    def is_pinned(self, name: str) -> bool:
        entry = self.adapters.get(name)
        return entry is not None and entry.pinned

    def _entry(self, name: str) -> RegisteredAdapter:
        entry = self.adapters.get(name)
        if entry is None:
            known = ", ".join(sorted(self.adapters)) or "none"
            raise UnknownAdapterError(f"unknown LoRA adapter {name!r} (loaded: {known})")
        return entry

    def list(self) -> list[LoRAAdapterInfo]:
        ordered = sorted(self.adapters.values(), key=lambda a: a.adapter_id)
        return [self.describe(a) for a in ordered]

    @staticmethod
    def describe(entry: RegisteredAdapter) -> LoRAAdapterInfo:
        return LoRAAdapterInfo(
            name=entry.name,
            path=entry.path,
            id=entry.adapter_id,
            rank=entry.rank,
            bytes=entry.nbytes,
            tiers=entry.tiers,
            slot=entry.slot,
            pinned=entry.pinned,
        )
