"""Continuous batching with chunked prefill, admission control and recompute preemption.

Each step computes up to `max_num_batched_tokens` tokens: first every running request's next
token (or the next chunk of a prompt still being computed), then prompt tokens of requests
admitted from the queue, while their KV blocks fit and the batch limits allow. With chunked
prefill a prompt that does not fit what is left of the budget is split, so decodes never wait
behind a long prompt. When a running request needs a block and none is free, the most recently
admitted request is preempted: its blocks are freed and it goes back to the front of the queue
to be recomputed later.

With LoRA, a request is admitted only once its adapter holds a device slot. A batch never runs
more distinct adapters than there are slots: a request whose adapter would be one too many, or
whose adapter cannot get a slot because every slot serves running requests, is deferred (it
keeps its place at the head of the queue) and later requests may go first. So that a popular
adapter cannot hold its slot forever against a deferred one, the scheduler then drains one slot:
the running adapter with the fewest running requests (not pinned) takes no new requests until
they finish, and its slot goes to the adapter that waited.

With `--lora-turn-steps N` (N > 0) adapters take turns instead. A queued request, which has no
token yet, waits for no turn: before the step, as many running adapters as the queue's ready
adapters need slots for are parked (their requests kept with their KV blocks and their place,
out of the batch), and the queued requests take the slots in that step (`_park_for_queue`); it
may also take a parked adapter's place in the host tier (`_adapter_ready`). A parked request
waiting for a slot drains one: after N steps the drained adapter's requests are parked and its
slot changes hands (meanwhile it still takes new requests, parked with the rest when the turn
ends). Parked requests go after the queue's unless one has waited PARKED_PATIENCE_TURNS turns,
so adapters share the slots by turns instead of by whole requests, and time to first token waits
for neither a turn nor every request of the adapters in flight. Parked requests are the first to
be preempted when blocks run out.
"""

from __future__ import annotations

import collections
import itertools
import logging
from collections import deque
from typing import Literal, Protocol

from rankcast.config import SchedulerConfig
from rankcast.engine_core.block_manager import BlockManager
from rankcast.engine_core.request import Request, RequestStatus
from rankcast.protocol import (
    EngineCoreOutput,
    FinishReason,
    LoRAMove,
    ModelRunnerOutput,
    ScheduledSequence,
    SchedulerOutput,
    SchedulerStats,
)

logger = logging.getLogger(__name__)


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


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        max_model_len: int,
        adapters: AdapterSlots | None = None,
        lora_turn_steps: int = 0,
    ) -> None:
        self.config = config
        self.adapters = adapters
        # Steps a drained adapter keeps its slot before its requests are parked (0: until they
        # finish), the requests parked, and the step count that times a drain.
        self.lora_turn_steps = lora_turn_steps
        self.parked: list[Request] = []
        self.num_parked = 0  # requests parked so far (one request may be parked many times)
        self.steps = 0
        self.drain_since = 0
        self.drain_parks = True
        self.parked_short_of_blocks = False  # a parked request found no blocks this step
        # The step a read last took a parked adapter's host place (at most one a step).
        self.parked_place_taken_at = -1
        # Requests the scheduler itself ended (their adapter could not be served).
        self.rejected: list[Request] = []
        # The adapter whose slot is being freed for a deferred request (without turns it
        # takes no new requests).
        self.draining: str | None = None
        self.blocks = block_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.finished_since_last_step: list[str] = []
        self.num_preemptions = 0
        # What API servers' routing sent here (rankcast/engine_client/engine_router.py): by
        # reason, the prefix tokens they expected cached, and those found at first admission.
        self.routing_decisions: collections.Counter[str] = collections.Counter()
        self.routing_expected_prefix_tokens = 0
        self.routing_hit_prefix_tokens = 0
        # Per adapter: where its requests found it (device, host, disk), and the evictions a
        # request then had to undo (the adapter had been pushed out for another).
        self.lora_requests_found: dict[str, collections.Counter[str]] = {}
        self.lora_evictions_undone: collections.Counter[str] = collections.Counter()
        # What the last `schedule()` gave each request, applied by `update_from_output`.
        self.scheduled: list[tuple[Request, int]] = []

    # ---- queue management ----

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)
        if request.routing_reason:
            self.routing_decisions[request.routing_reason] += 1
            self.routing_expected_prefix_tokens += request.routing_expected_prefix_tokens

    def abort_requests(self, request_ids: list[str]) -> list[Request]:
        """Finish the named requests now; unknown or already finished ids are ignored."""
        aborted = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status == RequestStatus.PARKED:
                self.parked.remove(request)
            else:
                self.waiting.remove(request)
            request.finish_reason = FinishReason.ABORT
            self._finish(request)
            aborted.append(request)
        return aborted

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.parked)

    def unfinished_requests(self) -> list[Request]:
        return [*self.running, *self.parked, *self.waiting]

    def adapters_in_flight(self) -> set[str]:
        """Adapters of running and parked requests: the host tier keeps them (a parked
        request resumes from there), though a parked one's device slot may go to another."""
        running = {r.lora_name for r in self.running if r.lora_name is not None}
        return running | self._parked_adapters()

    def _queued_adapters(self) -> frozenset[str]:
        """Adapters the queue's requests name (a scan of the queue: LoRA engines only)."""
        return frozenset(r.lora_name for r in self.waiting if r.lora_name is not None)

    def _parked_adapters(self) -> set[str]:
        return {r.lora_name for r in self.parked if r.lora_name is not None}

    def _finish(self, request: Request) -> None:
        request.status = RequestStatus.FINISHED
        self.blocks.free(request)
        self.requests.pop(request.request_id, None)
        self.finished_since_last_step.append(request.request_id)

    def _release(self, request: Request) -> None:
        """Give back what a request that stays waiting holds (a cached prefix it matched)."""
        self.blocks.free(request)
        request.num_computed_tokens = 0

    def _preempt(self, request: Request) -> None:
        self._release(request)
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # ---- one step ----

    def _chunk(self, request: Request, budget: int, first: bool) -> int:
        """How many of the request's uncomputed tokens this step takes (0: none).

        Without chunking a prompt is taken whole; the step's `first` prompt is taken even when
        it is longer than what is left of the budget (as it would be by itself), so a long
        prompt is never starved by decodes.
        """
        remaining = request.num_tokens - request.num_computed_tokens
        if self.config.enable_chunked_prefill:
            return min(remaining, budget)
        return remaining if remaining <= budget or first else 0

    def _schedule_waiting(self, budget: int) -> list[tuple[Request, int]]:
        admitted: list[tuple[Request, int]] = []
        deferred: list[Request] = []
        running = self._running_per_adapter()
        active = set(running)
        parked = self._parked_adapters()
        queued = self._queued_adapters() if self.adapters is not None else frozenset()
        in_flight = len(self.running) + len(self.parked)
        while self.waiting and in_flight + len(admitted) < self.config.max_num_seqs:
            request = self.waiting[0]
            cached = self.blocks.match_prefix(request)
            count = self._chunk(request, budget, not admitted)
            need = request.num_computed_tokens + count
            if count == 0 or not self.blocks.can_allocate(request, need):
                self._release(request)
                break
            self.waiting.popleft()
            if request.lora_name is not None:
                if not request.adapter_found_counted:
                    self._count_adapter_found(request)
                if request.lora_name == self.draining and not self._drain_parks_on_time():
                    self._release(request)
                    deferred.append(request)
                    continue
                try:
                    # Adapters running, in this batch, or wanted by requests ahead stay put.
                    wanted = {r.lora_name for r in deferred if r.lora_name is not None}
                    state = self._adapter_ready(
                        request.lora_name, active | wanted, parked, True, queued
                    )
                    ready = state == "ready"
                    slot = self._adapter_slot(request.lora_name, active) if ready else None
                except ValueError as exc:
                    self._reject(request, str(exc))
                    continue
                if state == "reading":  # from disk: wait without taking a slot from anyone
                    self._release(request)
                    deferred.append(request)
                    continue
                if slot is None:  # no slot, or (not ready) no room in the host tier
                    self._release(request)
                    deferred.append(request)
                    if not (ready and self.lora_turn_steps > 0):  # else: `_park_for_queue`
                        self._start_drain(running, parks=ready)
                    continue
                request.lora_slot = slot
                active.add(request.lora_name)
            self.blocks.allocate(request, need)
            self.blocks.plan_computed(request, need)
            self.blocks.record_lookup(request.num_tokens, cached)
            if request.routing_reason and not request.routing_hit_counted:
                self.routing_hit_prefix_tokens += cached
                request.routing_hit_counted = True
            request.status = RequestStatus.RUNNING
            admitted.append((request, count))
            budget -= count
        self.waiting.extendleft(reversed(deferred))
        return admitted

    def _count_adapter_found(self, request: Request) -> None:
        """At a request's first turn: where its adapter was, and whether needing it undoes an
        eviction (what users chart to see adapter thrashing)."""
        assert self.adapters is not None and request.lora_name is not None
        request.adapter_found_counted = True
        where = self.adapters.whereabouts(request.lora_name)
        self.adapters.note_request(request.lora_name)
        self.lora_requests_found.setdefault(request.lora_name, collections.Counter())[where] += 1
        if where != "device" and self.adapters.undo_displacement(request.lora_name):
            self.lora_evictions_undone[request.lora_name] += 1

    def _adapter_ready(
        self,
        name: str,
        protected: set[str],
        parked: set[str],
        first_token: bool,
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
        if state != "no_room" or not first_token or self.parked_place_taken_at == self.steps:
            return state
        spare = frozenset(parked - protected)
        state = self.adapters.prepare(name, protected | parked, spare - queued)
        if state == "no_room" and spare & queued:
            state = self.adapters.prepare(name, protected | parked, spare)
        if state == "reading":
            self.parked_place_taken_at = self.steps
        return state

    def _adapter_slot(self, name: str, active: set[str]) -> int | None:
        assert self.adapters is not None, "a LoRA request reached an engine without LoRA"
        if name not in active and len(active) >= self.adapters.max_loras:
            return None  # one adapter too many for this batch
        return self.adapters.acquire(name, active)

    def _running_per_adapter(self) -> collections.Counter[str]:
        """Running requests per adapter; a drain whose adapter runs no more is over (its slot is
        free for the request that waited)."""
        running: collections.Counter[str] = collections.Counter()
        if self.adapters is not None:  # the base-model path does no per-adapter work
            running.update(r.lora_name for r in self.running if r.lora_name)
        if self.draining not in running:
            self.draining = None
        return running

    def _start_drain(self, running: collections.Counter[str], parks: bool = True) -> None:
        """A request waits for a slot (`parks`: the drained adapter is parked after its turn)
        or for room in the host tier (it is not: a parked adapter keeps its place there, so
        only requests finishing make room): drain one, unless one is being drained already."""
        if self.draining is None:
            self.draining = self._drain_target(running)
            self.drain_since, self.drain_parks = self.steps, parks
        elif parks and not self.drain_parks:
            self.drain_since, self.drain_parks = self.steps, True

    def _drain_parks_on_time(self) -> bool:
        """Whether the drain ends by parking at the end of its turn (turns on, a slot wanted)
        rather than when its adapter's requests finish: then a new request on the drained
        adapter may still join it, takes its first token at once and is parked with the
        others, which delays no one (bench/routing.py's adapter part showed requests waiting
        7 steps for the adapter already on a slot)."""
        return self.lora_turn_steps > 0 and self.drain_parks

    def _park_drained(self) -> str | None:
        """After its turn of draining (`--lora-turn-steps`), the drained adapter's running
        requests leave the batch, keeping their blocks; returns that adapter (None: nothing
        parked). With `--lora-turn-steps 0` nothing is ever parked."""
        name = self.draining
        if name is None or self.lora_turn_steps <= 0 or not self.drain_parks:
            return None
        if self.steps - self.drain_since < self.lora_turn_steps:
            return None
        return name if self._park(name) else None

    def _park(self, name: str) -> bool:
        """The adapter's running requests leave the batch, keeping their blocks and place;
        whether there were any."""
        leaving = [r for r in self.running if r.lora_name == name]
        self.running = [r for r in self.running if r.lora_name != name]
        for request in leaving:
            request.status = RequestStatus.PARKED
            request.parked_at = self.steps
        self.parked.extend(leaving)
        self.num_parked += len(leaving)
        return bool(leaving)

    def _park_for_queue(self) -> None:
        """With turns, before the step: park as many running adapters as the queue's ready
        adapters need slots for, so each takes a slot in this very step.

        A queued request has no token yet, so it waits for no turn; and every adapter it
        needs gets a slot at once, not one drain after another: in bench/routing.py's adapter
        part the opening burst (five adapters for eight requests on two slots) put its last
        first token five steps after the first with one-step drains. A parked request that has
        waited PARKED_PATIENCE_TURNS turns counts as queued, ahead of the queue (it resumes
        first, `_parked_overdue`), and then keeps its slot for a whole turn
        (`keeps_slot_until`). An adapter is parked only once every running request of it has
        its first token (no request without one is parked for another), and never when
        pinned. Adapters the queue does not name go first (parking one the queue names holds
        its queued requests back a step, the very wait this pass removes: in the opening burst
        two late requests for a running adapter waited a step while a new adapter took its
        slot, the part's worst TTFTs), then the fewest running requests, as in `_drain_target`.
        """
        if self.adapters is None or self.lora_turn_steps <= 0:
            return
        running = self._running_per_adapter()
        patience = PARKED_PATIENCE_TURNS * self.lora_turn_steps
        overdue = [r for r in self.parked if self.steps - r.parked_at >= patience]
        room = self.config.max_num_seqs - len(self.running) - len(self.parked)
        wanted: list[str] = []
        queued_for = collections.Counter[str]()
        for request in itertools.chain(overdue, itertools.islice(self.waiting, max(0, room))):
            name = request.lora_name
            if name is None:
                continue
            queued_for[name] += 1
            if name in running or name in wanted:
                continue
            if self.adapters.whereabouts(name) != "disk":  # a read in flight is not ready
                wanted.append(name)
        short = len(running) + len(wanted) - self.adapters.max_loras
        if short <= 0:
            return
        staying = {
            r.lora_name
            for r in self.running
            if not r.output_token_ids or r.keeps_slot_until > self.steps
        }
        candidates = sorted(
            (queued_for[name], count, name)
            for name, count in running.items()
            if name not in staying and not self.adapters.is_pinned(name)
        )
        for _, _, name in candidates[:short]:
            self._park(name)

    def _parked_overdue(self) -> bool:
        """Whether a parked request has waited PARKED_PATIENCE_TURNS turns: then parked
        requests claim slots before the queue does. Otherwise the queue goes first (a request
        with no token yet before one that has been streaming), which halved TTFT p50 and kept
        p99 against parked-first in bench/routing.py's adapter part; the patience bounds how
        long a stream of new adapters' requests can hold a parked one back."""
        patience = PARKED_PATIENCE_TURNS * self.lora_turn_steps
        return any(self.steps - r.parked_at >= patience for r in self.parked)

    def _resume_parked(
        self, budget: int, skip: str | None = None, overdue_only: bool = False
    ) -> list[tuple[Request, int]]:
        """Parked requests (but `skip`'s; with `overdue_only`, only those that waited
        PARKED_PATIENCE_TURNS) back into the batch, oldest first, wherever their adapter gets
        a slot; one that cannot drains a slot for it as a waiting request would."""
        resumed: list[tuple[Request, int]] = []
        if not self.parked:
            return resumed
        running = self._running_per_adapter()
        active = set(running)
        parked = self._parked_adapters()
        # A parked adapter read back never pushes out a queued request's adapter: the queue
        # takes slots first, and the queued request would read it again, taking a parked
        # place in turn (in bench/routing.py's adapter part one request went round that loop
        # for 12 steps).
        queued = self._queued_adapters()
        patience = PARKED_PATIENCE_TURNS * self.lora_turn_steps
        for request in list(self.parked):
            assert request.lora_name is not None, "only adapters' requests are parked"
            overdue = self.steps - request.parked_at >= patience
            if request.lora_name in (skip, self.draining) or (overdue_only and not overdue):
                continue
            count = self._chunk(request, budget, False)
            need = request.num_computed_tokens + count
            if count == 0 or not self.blocks.can_allocate(request, need):
                self.parked_short_of_blocks = True
                continue
            try:
                state = self._adapter_ready(
                    request.lora_name, active | queued, parked, first_token=False
                )
                ready = state == "ready"
                slot = self._adapter_slot(request.lora_name, active) if ready else None
            except ValueError as exc:  # its adapter was dropped meanwhile: refused, as queued
                self.parked.remove(request)
                self._reject(request, str(exc))
                continue
            if slot is None:
                if ready:
                    self._start_drain(running)
                continue
            request.lora_slot = slot
            active.add(request.lora_name)
            if overdue:  # a whole turn now
                request.keeps_slot_until = self.steps + self.lora_turn_steps
            self.parked.remove(request)
            self.blocks.allocate(request, need)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            resumed.append((request, count))
            budget -= count
        return resumed

    def _drain_target(self, running: collections.Counter[str]) -> str | None:
        """The running adapter that frees a slot soonest: fewest running requests, not pinned."""
        assert self.adapters is not None
        candidates = [(n, name) for name, n in running.items() if not self.adapters.is_pinned(name)]
        return min(candidates, default=(0, None))[1]

    def _reject(self, request: Request, reason: str) -> None:
        logger.warning("aborting request %s: %s", request.request_id, reason)
        request.finish_reason = FinishReason.ABORT
        request.error = reason
        self._finish(request)
        self.rejected.append(request)

    def take_rejected(self) -> list[tuple[int, EngineCoreOutput]]:
        """(client index, output) for the requests the scheduler ended since the last call."""
        rejected, self.rejected = self.rejected, []
        return [(r.client_index, self._take_output(r)) for r in rejected]

    def _schedule_running(self, budget: int) -> tuple[list[tuple[Request, int]], int, bool]:
        """Every running request's next token or prompt chunk, oldest first; preempts the
        newest when blocks run out. Returns what was scheduled, the budget left, and whether
        anything was preempted (then nothing new is admitted this step)."""
        scheduled: list[tuple[Request, int]] = []
        preempted = False
        queue = list(self.running)
        while queue:
            request = queue.pop(0)
            count = self._chunk(request, budget, False)
            if count == 0:
                continue  # the budget is spent: it goes on next step
            need = request.num_computed_tokens + count
            while not self.blocks.can_allocate(request, need):
                preempted = True
                if self.parked:  # out of the batch anyway: the newest parked goes first
                    self._preempt(self.parked.pop())
                    continue
                victim = queue.pop() if queue else request
                self._preempt(victim)
                self.running.remove(victim)
                if victim is request:
                    break
            else:
                self.blocks.allocate(request, need)
                scheduled.append((request, count))
                budget -= count
        return scheduled, budget, preempted

    def schedule(self) -> SchedulerOutput:
        finished = self.finished_since_last_step
        self.finished_since_last_step = []
        self.steps += 1
        self.blocks.begin_step()
        just_parked = self._park_drained()
        self.parked_short_of_blocks = False  # set by `_resume_parked`
        self._park_for_queue()
        scheduled, budget, preempted = self._schedule_running(self.config.max_num_batched_tokens)
        admitted: list[tuple[Request, int]] = []
        if not preempted:
            # The queue claims slots before parked requests, except those overdue: they go
            # first (`_park_for_queue` made room for them as well), but not the adapter
            # parked just now (its slot is for the request that waited), and only they: a
            # slot made for a queued request went to any parked one otherwise, step after
            # step (a queued request waited 35 steps so in bench/routing.py's adapter part).
            if self._parked_overdue():
                scheduled += self._resume_parked(budget, skip=just_parked, overdue_only=True)
                budget = self.config.max_num_batched_tokens - sum(c for _, c in scheduled)
            admitted = self._schedule_waiting(budget)
            self.running.extend(request for request, _ in admitted)
            budget -= sum(count for _, count in admitted)
            scheduled += self._resume_parked(budget)
            if not scheduled and not admitted and self.parked_short_of_blocks and not self.running:
                # Parked requests hold the blocks the next of them needs, and nothing runs
                # that would preempt them: they are recomputed instead of waiting forever.
                # (Not when they wait for their adapter's read: that ends by itself.)
                while self.parked:
                    self._preempt(self.parked.pop())
                admitted = self._schedule_waiting(self.config.max_num_batched_tokens)
                self.running.extend(request for request, _ in admitted)
        self.scheduled = scheduled + admitted
        sequences = []
        for i, (request, count) in enumerate(self.scheduled):
            start = request.num_computed_tokens
            sequences.append(
                ScheduledSequence(
                    request.request_id,
                    request.token_slice(start, count),
                    start,
                    list(request.block_ids),
                    # Ranks learn a request's parameters when it is admitted (or readmitted).
                    request.params if i >= len(scheduled) else None,
                    request.lora_slot,
                    sample=start + count == request.num_tokens,
                )
            )
        moves = self.adapters.take_moves() if self.adapters is not None else []
        return SchedulerOutput(sequences, finished, moves)

    def update_from_output(self, result: ModelRunnerOutput) -> list[tuple[int, EngineCoreOutput]]:
        """Count the step's computed tokens, append sampled ones, finish requests that stop,
        and describe what changed: (client index, output), the client that owns the request."""
        for computed, count in self.scheduled:
            computed.num_computed_tokens += count
            self.blocks.cache_computed_blocks(computed)
        self.scheduled = []
        outputs: list[tuple[int, EngineCoreOutput]] = []
        logprobs = result.logprobs or [None] * len(result.request_ids)
        for request_id, token, lp in zip(
            result.request_ids, result.sampled_token_ids, logprobs, strict=True
        ):
            request = self.requests.get(request_id)
            if request is None:
                continue  # aborted while the step ran
            request.append_token(token, lp)
            if request.check_stop(self.max_model_len):
                self.running.remove(request)
                self._finish(request)
            outputs.append((request.client_index, self._take_output(request)))
        return outputs

    def _take_output(self, request: Request) -> EngineCoreOutput:
        output = EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=request.pending_token_ids,
            new_logprobs=request.pending_logprobs or None,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            num_prompt_tokens=len(request.prompt_token_ids),
            error=request.error,
        )
        request.pending_token_ids = []
        request.pending_logprobs = []
        return output

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running_reqs=len(self.running) + len(self.parked),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.blocks.usage,
            num_preemptions=self.num_preemptions,
            num_blocks=self.blocks.num_blocks,
            block_size=self.blocks.block_size,
            prefix_cache_queries=self.blocks.queried_tokens,
            prefix_cache_hits=self.blocks.hit_tokens,
            routing_decisions=dict(self.routing_decisions),
            routing_expected_prefix_tokens=self.routing_expected_prefix_tokens,
            routing_hit_prefix_tokens=self.routing_hit_prefix_tokens,
            lora_requests_found={
                name: dict(found) for name, found in sorted(self.lora_requests_found.items())
            },
            lora_evictions_undone=dict(sorted(self.lora_evictions_undone.items())),
        )
