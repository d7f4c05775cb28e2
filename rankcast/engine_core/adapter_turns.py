"""Which adapters hold the device slots: the scheduler's LoRA drain, park and resume policy.

A batch never runs more distinct adapters than there are device slots. A request whose adapter
would be one too many, or whose adapter cannot get a slot because every slot serves running
requests, is deferred (it keeps its place at the head of the queue) and later requests may go
first. So that a popular adapter cannot hold its slot forever against a deferred one, one slot is
then drained: the running adapter with the fewest running requests (not pinned) takes no new
requests until they finish, and its slot goes to the adapter that waited.

With `--lora-turn-steps N` (N > 0) adapters take turns instead. A queued request, which has no
token yet, waits for no turn: before the step, as many running adapters as the queue's ready
adapters need slots for are parked (their requests kept with their KV blocks and their place,
out of the batch), and the queued requests take the slots in that step (`to_park_for_queue`); it
may also take a parked adapter's place in the host tier (`adapter_ready`). A parked request
waiting for a slot drains one: after N steps the drained adapter's requests are parked and its
slot changes hands (meanwhile it still takes new requests, parked with the rest when the turn
ends). Parked requests go after the queue's unless one has waited PARKED_PATIENCE_TURNS turns,
so adapters share the slots by turns instead of by whole requests, and time to first token waits
for neither a turn nor every request of the adapters in flight.

`AdapterTurns` decides (what a request's adapter needs, which adapter is drained, when its turn
ends, which adapters are parked for the queue, which parked requests are overdue); the scheduler
moves the requests between its queue, its batch and its parked list, with their blocks.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterable
from typing import Literal, Protocol

from rankcast.engine_core.request import Request
from rankcast.protocol import LoRAMove

AdapterState = Literal["ready", "reading", "no_room"]

# Turns a parked request waits before parked requests claim slots ahead of the queue.
PARKED_PATIENCE_TURNS = 4


class AdapterSlots(Protocol):
    """What the scheduler needs from the engine's LoRA registry."""

    max_loras: int

    def acquire(self, name: str, busy: set[str]) -> int | None:
        """The adapter's device slot, loading/evicting as needed; None: no slot can be freed
        now without evicting one of `busy`. Raises ValueError when it can never be served."""
        ...

    def is_pinned(self, name: str) -> bool:
        """Whether the adapter is pinned to its device slot (never drained for another)."""
        ...

    def prepare(
        self, name: str, protected: set[str], spare: frozenset[str] = frozenset()
    ) -> AdapterState:
        """ "ready": in every rank's host tier, a slot may be asked for. "reading": its read
        is under way (started now if need be, making room without evicting any of
        `protected`, and one of `spare` only when nothing else can go); the request waits,
        draining nothing. "no_room": the host tier holds only adapters that must stay; like a
        missing slot, a running adapter is drained. Raises ValueError when it can never be
        served."""
        ...

    def take_moves(self) -> list[LoRAMove]:
        """The adapter moves decided since the last call: the step carries them."""
        ...

    def whereabouts(self, name: str) -> str:
        """Where a request finds the adapter now: "device", "host" or "disk"."""
        ...

    def note_request(self, name: str) -> None:
        """A request on the adapter had its first turn (the host tier keeps the most asked)."""
        ...

    def undo_displacement(self, name: str) -> bool:
        """Whether needing it undoes an eviction that made room for another (once each)."""
        ...


class AdapterTurns:
    """Whose turn it is on the device slots. The scheduler owns one and asks it, with the step
    count (`step`) and the requests it holds, before it admits, parks or resumes a request."""

    def __init__(self, adapters: AdapterSlots | None, turn_steps: int) -> None:
        self.adapters = adapters
        # Steps a drained adapter keeps its slot before its requests are parked (0: until they
        # finish).
        self.turn_steps = turn_steps
        # The adapter whose slot is being freed for a deferred request (without turns it
        # takes no new requests), the step count that times its drain, and whether it is
        # parked when its turn ends.
        self.draining: str | None = None
        self.drain_since = 0
        self.drain_parks = True
        # The step a read last took a parked adapter's host place (at most one a step).
        self.parked_place_taken_at = -1
        # Per adapter: where its requests found it (device, host, disk), and the evictions a
        # request then had to undo (the adapter had been pushed out for another).
        self.requests_found: dict[str, collections.Counter[str]] = {}
        self.evictions_undone: collections.Counter[str] = collections.Counter()

    def count_found(self, request: Request) -> None:
        """At a request's first turn: where its adapter was, and whether needing it undoes an
        eviction (what users chart to see adapter thrashing)."""
        assert self.adapters is not None and request.lora_name is not None
        request.adapter_found_counted = True
        where = self.adapters.whereabouts(request.lora_name)
        self.adapters.note_request(request.lora_name)
        self.requests_found.setdefault(request.lora_name, collections.Counter())[where] += 1
        if where != "device" and self.adapters.undo_displacement(request.lora_name):
            self.evictions_undone[request.lora_name] += 1

    def adapter_ready(
        self,
        name: str,
        protected: set[str],
        parked: set[str],
        first_token: bool,
        step: int,
        queued: frozenset[str] = frozenset(),
    ) -> AdapterState:
        """Whether the adapter is in the host tier, its read started if not, never making room
        from `protected` or `parked` adapters, with one exception.

        Parked adapters keep their places: a parked request resumes from there. But when a
        queued request (`first_token`: no token yet) finds no other room, its read takes the
        place of the parked adapter that will want it back last (the registry's choice), at
        most one such read a step: otherwise its first token waits until every request of some
        adapter in flight has finished, seconds (TTFT p99 1.3-1.8 s in bench/routing.py's
        adapter part, against the base model's 0.14-0.26 s). Parked requests never take a place
        this way: a read for one to take another's was what made parked adapters take turns
        through the disk (338 reads per 100 requests under load routing, against 48). A parked
        adapter that `queued` requests name goes only when no other can: in bench/routing.py's
        adapter part a new request for a parked adapter found it read out for another and
        waited for it to be read back.
        """
        assert self.adapters is not None, "a LoRA request reached an engine without LoRA"
        state = self.adapters.prepare(name, protected | parked)
        if state != "no_room" or not first_token or self.parked_place_taken_at == step:
            return state
        spare = frozenset(parked - protected)
        state = self.adapters.prepare(name, protected | parked, spare - queued)
        if state == "no_room" and spare & queued:
            state = self.adapters.prepare(name, protected | parked, spare)
        if state == "reading":
            self.parked_place_taken_at = step
        return state

    def adapter_slot(self, name: str, active: set[str]) -> int | None:
        """The adapter's device slot for a batch already running the `active` adapters (None:
        none for now)."""
        assert self.adapters is not None, "a LoRA request reached an engine without LoRA"
        if name not in active and len(active) >= self.adapters.max_loras:
            return None  # one adapter too many for this batch
        return self.adapters.acquire(name, active)

    def running_per_adapter(self, running: list[Request]) -> collections.Counter[str]:
        """Running requests per adapter; a drain whose adapter runs no more is over (its slot is
        free for the request that waited)."""
        counts: collections.Counter[str] = collections.Counter()
        if self.adapters is not None:  # the base-model path does no per-adapter work
            counts.update(r.lora_name for r in running if r.lora_name)
        if self.draining not in counts:
            self.draining = None
        return counts

    def start_drain(self, running: collections.Counter[str], step: int, parks: bool = True) -> None:
        """A request waits for a slot (`parks`: the drained adapter is parked after its turn)
        or for room in the host tier (it is not: a parked adapter keeps its place there, so
        only requests finishing make room): drain one, unless one is being drained already."""
        if self.draining is None:
            self.draining = self._drain_target(running)
            self.drain_since, self.drain_parks = step, parks
        elif parks and not self.drain_parks:
            self.drain_since, self.drain_parks = step, True

    def takes_no_new_requests(self, name: str) -> bool:
        """Whether the adapter is being drained and meanwhile takes no new requests: unless the
        drain ends by parking at the end of its turn (turns on, a slot wanted) rather than when
        its adapter's requests finish. Then a new request on the drained adapter may still join
        it, takes its first token at once and is parked with the others, which delays no one
        (bench/routing.py's adapter part showed requests waiting 7 steps for the adapter
        already on a slot)."""
        return name == self.draining and not (self.turn_steps > 0 and self.drain_parks)

    def turn_over(self, step: int) -> str | None:
        """The drained adapter whose turn of draining (`--lora-turn-steps`) is over: its running
        requests leave the batch, keeping their blocks (None: no such adapter). With
        `--lora-turn-steps 0` nothing is ever parked."""
        name = self.draining
        if name is None or self.turn_steps <= 0 or not self.drain_parks:
            return None
        if step - self.drain_since < self.turn_steps:
            return None
        return name

    def to_park_for_queue(
        self,
        running: list[Request],
        parked: list[Request],
        waiting: Iterable[Request],
        room: int,
        step: int,
    ) -> list[str]:
        """With turns, before the step: the running adapters to park, as many as the queue's
        ready adapters (among the `room` requests the batch may still take) need slots for,
        so each takes a slot in this very step.

        A queued request has no token yet, so it waits for no turn; and every adapter it
        needs gets a slot at once, not one drain after another: in bench/routing.py's adapter
        part the opening burst (five adapters for eight requests on two slots) put its last
        first token five steps after the first with one-step drains. A parked request that has
        waited PARKED_PATIENCE_TURNS turns counts as queued, ahead of the queue (it resumes
        first, `parked_overdue`), and then keeps its slot for a whole turn
        (`keeps_slot_until`). An adapter is parked only once every running request of it has
        its first token (no request without one is parked for another), and never when
        pinned. Adapters the queue does not name go first (parking one the queue names holds
        its queued requests back a step, the very wait this pass removes: in the opening burst
        two late requests for a running adapter waited a step while a new adapter took its
        slot, the part's worst TTFTs), then the fewest running requests, as in `_drain_target`.
        """
        if self.adapters is None or self.turn_steps <= 0:
            return []
        per_adapter = self.running_per_adapter(running)
        overdue = [r for r in parked if self.overdue(r, step)]
        wanted: list[str] = []
        queued_for = collections.Counter[str]()
        for request in itertools.chain(overdue, itertools.islice(waiting, max(0, room))):
            name = request.lora_name
            if name is None:
                continue
            queued_for[name] += 1
            if name in per_adapter or name in wanted:
                continue
            if self.adapters.whereabouts(name) != "disk":  # a read in flight is not ready
                wanted.append(name)
        short = len(per_adapter) + len(wanted) - self.adapters.max_loras
        if short <= 0:
            return []
        staying = {
            r.lora_name for r in running if not r.output_token_ids or r.keeps_slot_until > step
        }
        candidates = sorted(
            (queued_for[name], count, name)
            for name, count in per_adapter.items()
            if name not in staying and not self.adapters.is_pinned(name)
        )
        return [name for _, _, name in candidates[:short]]

    def overdue(self, request: Request, step: int) -> bool:
        """Whether the parked request has waited PARKED_PATIENCE_TURNS turns."""
        return step - request.parked_at >= PARKED_PATIENCE_TURNS * self.turn_steps

    def parked_overdue(self, parked: list[Request], step: int) -> bool:
        """Whether a parked request has waited PARKED_PATIENCE_TURNS turns: then parked
        requests claim slots before the queue does. Otherwise the queue goes first (a request
        with no token yet before one that has been streaming), which halved TTFT p50 and kept
        p99 against parked-first in bench/routing.py's adapter part; the patience bounds how
        long a stream of new adapters' requests can hold a parked one back."""
        return any(self.overdue(r, step) for r in parked)

    def _drain_target(self, running: collections.Counter[str]) -> str | None:
        """The running adapter that frees a slot soonest: fewest running requests, not pinned."""
        assert self.adapters is not None
        candidates = [(n, name) for name, n in running.items() if not self.adapters.is_pinned(name)]
        return min(candidates, default=(0, None))[1]
