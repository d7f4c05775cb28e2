"""Continuous batching with chunked prefill, admission control and recompute preemption.

Each step computes up to `max_num_batched_tokens` tokens: first every running request's next
token (or the next chunk of a prompt still being computed), then prompt tokens of requests
admitted from the queue, while their KV blocks fit and the batch limits allow. With chunked
prefill a prompt that does not fit what is left of the budget is split, so decodes never wait
behind a long prompt. When a running request needs a block and none is free, the most recently
admitted request is preempted: its blocks are freed and it goes back to the front of the queue
to be recomputed later.

With LoRA, a request is admitted only once its adapter holds a device slot, and a batch never
runs more distinct adapters than there are slots. Which adapters hold the slots when they are
short is `AdapterTurns`'s policy (adapter_turns.py): a request that cannot get one is deferred
and a slot is drained for it, and with `--lora-turn-steps` adapters take turns, the requests of
an adapter out of turn parked (out of the batch, kept with their KV blocks and their place). The
scheduler asks it before it admits, parks or resumes a request, and moves the requests. Parked
requests are the first to be preempted when blocks run out.
"""

from __future__ import annotations

import collections
import logging
from collections import deque

from rankcast.config import SchedulerConfig
from rankcast.engine_core.adapter_turns import AdapterSlots, AdapterTurns
from rankcast.engine_core.block_manager import BlockManager
from rankcast.engine_core.kv_cache_manager import KVCacheManager
from rankcast.engine_core.request import Request, RequestStatus
from rankcast.engine_core.speculation.drafter import Drafter
from rankcast.protocol import (
    EngineCoreOutput,
    FinishReason,
    ModelRunnerOutput,
    ScheduledSequence,
    SchedulerOutput,
    SchedulerStats,
)

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager | KVCacheManager,
        max_model_len: int,
        adapters: AdapterSlots | None = None,
        lora_turn_steps: int = 0,
    ) -> None:
        self.config = config
        self.adapters = adapters
        # Which adapter holds a device slot, drains or is parked (adapter_turns.py).
        self.turns = AdapterTurns(adapters, lora_turn_steps)
        # The requests parked (out of the batch, keeping their blocks and place), and the step
        # count that times turns and parks.
        self.parked: list[Request] = []
        self.num_parked = 0  # requests parked so far (one request may be parked many times)
        self.steps = 0
        self.parked_short_of_blocks = False  # a parked request found no blocks this step
        # Requests the scheduler itself ended (their adapter could not be served).
        self.rejected: list[Request] = []
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
        # What the last `schedule()` gave each request, applied by `update_from_output`.
        self.scheduled: list[tuple[Request, int]] = []
        # Speculative decoding: which decodes draft, and how far (None: off).
        spec = config.speculative_config
        self.drafter = Drafter(spec, max_model_len) if spec is not None else None

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
        if self.drafter is not None:
            self.drafter.finish(request)
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
        running = self.turns.running_per_adapter(self.running)
        active = set(running)
        parked = self._parked_adapters()
        queued = self._queued_adapters() if self.adapters is not None else frozenset()
        in_flight = len(self.running) + len(self.parked)
        while self.waiting and in_flight + len(admitted) < self.config.max_num_seqs:
            request = self.waiting[0]
            # A request still to score its prompt computes all of it (Request.scores_prompt).
            cached = 0 if request.scores_prompt else self.blocks.match_prefix(request)
            count = self._chunk(request, budget, not admitted)
            need = request.num_computed_tokens + count
            if count == 0 or not self.blocks.can_allocate(request, need):
                self._release(request)
                break
            self.waiting.popleft()
            if request.lora_name is not None:
                if not request.adapter_found_counted:
                    self.turns.count_found(request)
                if self.turns.takes_no_new_requests(request.lora_name):
                    self._release(request)
                    deferred.append(request)
                    continue
                try:
                    # Adapters running, in this batch, or wanted by requests ahead stay put.
                    wanted = {r.lora_name for r in deferred if r.lora_name is not None}
                    state = self.turns.adapter_ready(
                        request.lora_name, active | wanted, parked, True, self.steps, queued
                    )
                    ready = state == "ready"
                    slot = self.turns.adapter_slot(request.lora_name, active) if ready else None
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
                    if not (ready and self.turns.turn_steps > 0):  # else: `_park_for_queue`
                        self.turns.start_drain(running, self.steps, parks=ready)
                    continue
                request.lora_slot = slot
                active.add(request.lora_name)
            self.blocks.allocate(request, need)
            self.blocks.plan_computed(request, need)
            if not request.scores_prompt:  # as vLLM: a lookup skipped is not a query
                self.blocks.record_lookup(request.num_tokens, cached)
            if request.routing_reason and not request.routing_hit_counted:
                self.routing_hit_prefix_tokens += cached
                request.routing_hit_counted = True
            request.status = RequestStatus.RUNNING
            admitted.append((request, count))
            budget -= count
        self.waiting.extendleft(reversed(deferred))
        return admitted

    def _park_drained(self) -> str | None:
        """Park the drained adapter whose turn is over (`AdapterTurns.turn_over`); returns
        that adapter (None: nothing parked)."""
        name = self.turns.turn_over(self.steps)
        return name if name is not None and self._park(name) else None

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
        """With turns, before the step: park the running adapters whose slots the queue's
        ready adapters take in this very step (`AdapterTurns.to_park_for_queue`)."""
        room = self.config.max_num_seqs - len(self.running) - len(self.parked)
        for name in self.turns.to_park_for_queue(
            self.running, self.parked, self.waiting, room, self.steps
        ):
            self._park(name)

    def _resume_parked(
        self, budget: int, skip: str | None = None, overdue_only: bool = False
    ) -> list[tuple[Request, int]]:
        """Parked requests (but `skip`'s; with `overdue_only`, only those that waited
        PARKED_PATIENCE_TURNS) back into the batch, oldest first, wherever their adapter gets
        a slot; one that cannot drains a slot for it as a waiting request would."""
        resumed: list[tuple[Request, int]] = []
        if not self.parked:
            return resumed
        running = self.turns.running_per_adapter(self.running)
        active = set(running)
        parked = self._parked_adapters()
        # A parked adapter read back never pushes out a queued request's adapter: the queue
        # takes slots first, and the queued request would read it again, taking a parked
        # place in turn (in bench/routing.py's adapter part one request went round that loop
        # for 12 steps).
        queued = self._queued_adapters()
        for request in list(self.parked):
            assert request.lora_name is not None, "only adapters' requests are parked"
            overdue = self.turns.overdue(request, self.steps)
            if request.lora_name in (skip, self.turns.draining) or (overdue_only and not overdue):
                continue
            count = self._chunk(request, budget, False)
            need = request.num_computed_tokens + count
            if count == 0 or not self.blocks.can_allocate(request, need):
                self.parked_short_of_blocks = True
                continue
            try:
                state = self.turns.adapter_ready(
                    request.lora_name, active | queued, parked, first_token=False, step=self.steps
                )
                ready = state == "ready"
                slot = self.turns.adapter_slot(request.lora_name, active) if ready else None
            except ValueError as exc:  # its adapter was dropped meanwhile: refused, as queued
                self.parked.remove(request)
                self._reject(request, str(exc))
                continue
            if slot is None:
                if ready:
                    self.turns.start_drain(running, self.steps)
                continue
            request.lora_slot = slot
            active.add(request.lora_name)
            if overdue:  # a whole turn now
                request.keeps_slot_until = self.steps + self.turns.turn_steps
            self.parked.remove(request)
            self.blocks.allocate(request, need)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            resumed.append((request, count))
            budget -= count
        return resumed

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
        if self.drafter is not None and scheduled:
            budget = self._add_drafts(scheduled, budget)
        return scheduled, budget, preempted

    def _add_drafts(self, scheduled: list[tuple[Request, int]], budget: int) -> int:
        """Widen the decodes the drafter chooses by their drafts, where their blocks fit
        without taking any from another request; returns the budget left."""
        assert self.drafter is not None
        decodes = [
            request
            for request, count in scheduled
            if count == 1 and request.num_tokens - request.num_computed_tokens == 1
        ]
        step_tokens = sum(count for _, count in scheduled)
        drafts = self.drafter.plan(decodes, step_tokens, budget)
        for i, (request, count) in enumerate(scheduled):
            draft = drafts.get(request.request_id)
            if not draft or count != 1:
                continue
            need = request.num_computed_tokens + 1 + len(draft)
            if not self.blocks.can_allocate(request, need):
                continue  # drafts never take blocks a request would have to be preempted for
            self.blocks.allocate(request, need)
            request.draft_token_ids = draft
            scheduled[i] = (request, 1 + len(draft))
            budget -= len(draft)
        return budget

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
            if self.turns.parked_overdue(self.parked, self.steps):
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
            drafts = request.draft_token_ids
            own = count - len(drafts)  # the request's own tokens; then its drafts
            token_ids = request.token_slice(start, own)
            if drafts:
                token_ids += drafts
            sequences.append(
                ScheduledSequence(
                    request.request_id,
                    token_ids,
                    start,
                    list(request.block_ids),
                    # Ranks learn a request's parameters when it is admitted (or readmitted).
                    request.params if i >= len(scheduled) else None,
                    request.lora_slot,
                    sample=start + own == request.num_tokens,
                    window_block_ids=list(request.kv_groups[1].block_ids)
                    if len(request.kv_groups) > 1
                    else None,
                    num_draft_tokens=len(drafts),
                    prompt_logprob_targets=request.prompt_logprob_targets(start, own),
                )
            )
        moves = self.adapters.take_moves() if self.adapters is not None else []
        return SchedulerOutput(sequences, finished, moves)

    def update_from_output(self, result: ModelRunnerOutput) -> list[tuple[int, EngineCoreOutput]]:
        """Count the step's computed tokens, append sampled ones, finish requests that stop,
        and describe what changed: (client index, output), the client that owns the request."""
        for computed, count in self.scheduled:
            if computed.draft_token_ids:
                continue  # counted once its tokens are known: only accepted drafts count
            computed.num_computed_tokens += count
            self.blocks.cache_computed_blocks(computed)
        self.scheduled = []
        for scored in result.prompt_logprobs or ():
            request = self.requests.get(scored.request_id)
            if request is not None and request.scores_prompt:
                request.add_prompt_logprobs(scored.position, scored.logprobs)
        outputs: list[tuple[int, EngineCoreOutput]] = []
        logprobs = result.logprobs or [None] * len(result.request_ids)
        for request_id, tokens, lps in zip(
            result.request_ids, result.sampled_token_ids, logprobs, strict=True
        ):
            request = self.requests.get(request_id)
            if request is None:
                continue  # aborted while the step ran
            drafts, request.draft_token_ids = request.draft_token_ids, []
            kept = 0
            for position, token in enumerate(tokens):
                request.append_token(token, lps[position] if lps else None)
                kept += 1
                if request.check_stop(self.max_model_len):
                    break  # a stop inside an accepted run: the rest is dropped
            if drafts:
                self._count_verified(request, drafts, len(tokens) - 1, kept)
            if request.finish_reason is not None:
                self.running.remove(request)
                self._finish(request)
            outputs.append((request.client_index, self._take_output(request)))
        return outputs

    def _count_verified(
        self, request: Request, drafts: list[int], accepted: int, kept: int
    ) -> None:
        """A verification's result: the newest token and the accepted drafts are computed
        (their K/V holds the request's real tokens), the rejected drafts' slots are not, so
        no block holding one is ever named in the prefix cache or announced."""
        assert self.drafter is not None
        self.drafter.record_verification(request, len(drafts), accepted)
        request.num_computed_tokens = min(
            request.num_computed_tokens + 1 + min(accepted, kept), request.num_tokens
        )
        self.blocks.cache_computed_blocks(request)

    def _take_output(self, request: Request) -> EngineCoreOutput:
        output = EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=request.pending_token_ids,
            new_logprobs=request.pending_logprobs or None,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            num_prompt_tokens=len(request.prompt_token_ids),
            error=request.error,
            prompt_logprobs=request.take_prompt_logprobs(),
        )
        request.pending_token_ids = []
        request.pending_logprobs = []
        return output

    def stats(self) -> SchedulerStats:
        stats = SchedulerStats(
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
                name: dict(found) for name, found in sorted(self.turns.requests_found.items())
            },
            lora_evictions_undone=dict(sorted(self.turns.evictions_undone.items())),
        )
        if self.drafter is not None:
            counters = self.drafter.counters
            stats.spec_decode_num_drafts = counters.drafts
            stats.spec_decode_num_draft_tokens = counters.draft_tokens
            stats.spec_decode_num_accepted_tokens = counters.accepted_tokens
            stats.spec_decode_num_accepted_tokens_per_pos = list(counters.accepted_per_position)
        return stats

    def record_step_time(self, batch: SchedulerOutput, seconds: float) -> None:
        """`batch` took `seconds`: what the drafter weighs drafts against. Only steps of
        decodes (drafted or not) count: a prompt's tokens cost more each (a new request's
        first step does more than compute), and drafts are weighed in decode steps."""
        if self.drafter is None or not batch.sequences:
            return
        if all(len(s.token_ids) - s.num_draft_tokens == 1 for s in batch.sequences):
            self.drafter.record_step(sum(len(s.token_ids) for s in batch.sequences), seconds)
