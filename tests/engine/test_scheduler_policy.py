"""The scheduler's LoRA policy against a fake adapter-slot table (no registry, no executor).

The scheduler needs three things of the engine's LoRARegistry (the `AdapterSlots` protocol in
rankcast/engine_core/adapter_turns.py): `max_loras`, `acquire(name, busy)` and `is_pinned(name)`.
`FakeSlots` implements them with plain dicts and records every move it is asked to make. Its
eviction choice is deliberately naive: the idle adapter on the LOWEST slot goes, whatever its
age. The tests place adapters of running requests on low slots, so a scheduler that leaves one
out of `busy` gets it evicted under a running request, and `_check` fails.

The rules (adapter_turns.py's docstring): a request is admitted only once its adapter holds a device
slot; a request that cannot get one is deferred, keeps its place at the head of the queue, and
later requests may go first; the scheduler then drains one slot: the running adapter with the
fewest running requests, not pinned, takes no new requests until they finish, and its slot goes
to the adapter that waited. With turns (`_turns`, `--lora-turn-steps`) a queued request whose
adapter is ready instead takes a slot in the next step, its holder parked before the step; the
fake's `whereabouts` says which are ready (known, not being read, with room in the host tier).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import pytest

from rankcast.config import SchedulerConfig
from rankcast.engine_core.adapter_turns import PARKED_PATIENCE_TURNS
from rankcast.engine_core.block_manager import BlockManager
from rankcast.engine_core.request import Request, RequestStatus
from rankcast.engine_core.scheduler import Scheduler
from rankcast.protocol import FinishReason, LoRAMove, ModelRunnerOutput, ScheduledSequence
from rankcast.sampling_params import SamplingParams


class FakeSlots:
    """An adapter-slot table: which adapters hold which device slot, which are pinned."""

    def __init__(
        self,
        max_loras: int,
        resident: dict[str, int] | None = None,
        known: Iterable[str] = (),
        pinned: Iterable[str] = (),
    ) -> None:
        self.max_loras = max_loras
        self.slots: dict[str, int] = dict(resident or {})  # adapter -> device slot
        self.known = set(known) | set(self.slots)  # registered adapters
        self.pinned = set(pinned)
        self.moves: list[tuple[str, str, int]] = []  # ("evict" | "load", adapter, slot)
        self.calls: list[tuple[str, frozenset[str]]] = []  # acquire(name, busy)
        self.evicted: list[str] = []
        self.reading = set()
        self.reads_started = []
        self.no_room: set[str] = set()
        self.spare_places: set[str] = set()
        self.places_taken: list[tuple[str, str]] = []
        self.offers: list[tuple[str, frozenset[str]]] = []  # prepare(name, _, spare)
        self.protections: list[tuple[str, frozenset[str]]] = []  # prepare(name, protected)

    # Adapters still being read from disk (not ready for a slot), and reads started;
    # adapters whose read cannot start (the host tier holds only adapters that must stay);
    # adapters in the host tier whose place a read may take when offered as `spare`, and the
    # (read, adapter whose place it took) so far.
    reading: set[str]
    reads_started: list[str]

    def prepare(self, name: str, protected: set[str], spare: frozenset[str] = frozenset()) -> str:
        if name not in self.known:
            raise ValueError(f"unknown LoRA adapter {name!r}")
        self.offers.append((name, spare))
        self.protections.append((name, frozenset(protected)))
        if name in self.no_room:
            taken = sorted(spare & self.spare_places - {name})
            if not taken:
                return "no_room"
            self.spare_places.discard(taken[0])
            self.places_taken.append((name, taken[0]))
            self.no_room.discard(name)
            self.reading.add(name)
        if name in self.reading:
            if name not in self.reads_started:
                self.reads_started.append(name)
            return "reading"
        return "ready"

    def take_moves(self) -> list[LoRAMove]:
        return []

    def whereabouts(self, name: str) -> str:
        if name in self.slots:
            return "device"
        unready = name not in self.known or name in self.reading or name in self.no_room
        return "disk" if unready else "host"

    def note_request(self, name: str) -> None:
        pass  # popularity only ranks the host tier's adapters, which the fake does not model

    def undo_displacement(self, name: str) -> bool:
        if name in self.evicted:
            self.evicted.remove(name)
            return True
        return False

    def acquire(self, name: str, busy: set[str]) -> int | None:
        self.calls.append((name, frozenset(busy)))
        if name not in self.known:
            raise ValueError(f"unknown LoRA adapter {name!r}")
        if name in self.slots:
            return self.slots[name]
        free = sorted(set(range(self.max_loras)) - set(self.slots.values()))
        if free:
            slot = free[0]
        else:
            idle = sorted(
                (slot, held)
                for held, slot in self.slots.items()
                if held not in busy and held not in self.pinned
            )
            if not idle:
                if all(held in self.pinned for held in self.slots):
                    raise ValueError(f"every device slot holds a pinned adapter; {name!r} waits")
                return None
            slot, victim = idle[0]
            del self.slots[victim]
            self.moves.append(("evict", victim, slot))
            self.evicted.append(victim)
        self.slots[name] = slot
        self.moves.append(("load", name, slot))
        return slot

    def is_pinned(self, name: str) -> bool:
        return name in self.pinned


_prompts = itertools.count()


def _request(rid: str, lora: str | None = None, max_tokens: int = 100) -> Request:
    base = 1000 * next(_prompts)  # distinct prompts: no prefix-cache sharing between requests
    return Request(
        rid,
        [base + i for i in range(4)],
        SamplingParams(temperature=0.0, max_tokens=max_tokens),
        max_tokens=max_tokens,
        eos_token_ids=frozenset({-1}),
        lora_name=lora,
    )


def _scheduler(slots: FakeSlots, max_num_seqs: int = 16) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs), BlockManager(256, 4), 1024, slots)


def _check(scheduler: Scheduler, slots: FakeSlots) -> None:
    """What must hold after every step, whatever the fake was asked."""
    adapters = {r.lora_name for r in scheduler.running if r.lora_name is not None}
    assert len(adapters) <= slots.max_loras, f"more adapters than slots run: {adapters}"
    for request in scheduler.running:
        if request.lora_name is not None:
            assert slots.slots.get(request.lora_name) == request.lora_slot, (
                f"{request.request_id} runs on slot {request.lora_slot}, but its adapter "
                f"{request.lora_name!r} is at {slots.slots.get(request.lora_name)}: evicted "
                f"under a running request (moves: {slots.moves})"
            )
    assert not set(slots.evicted) & slots.pinned, f"a pinned adapter was evicted: {slots.moves}"


def _step(scheduler: Scheduler, slots: FakeSlots) -> dict[str, ScheduledSequence]:
    """One step, every sampling sequence given token 7; what ran, by request id."""
    batch = scheduler.schedule()
    _check(scheduler, slots)
    ids = [s.request_id for s in batch.sequences if s.sample]
    scheduler.update_from_output(ModelRunnerOutput(ids, [[7]] * len(ids)))
    return {s.request_id: s for s in batch.sequences}


def _start(scheduler: Scheduler, slots: FakeSlots, *requests: Request) -> None:
    """Add the requests and run one step that admits all of them."""
    for request in requests:
        scheduler.add_request(request)
    ran = _step(scheduler, slots)
    assert set(ran) >= {r.request_id for r in requests}


def _waiting(scheduler: Scheduler) -> list[str]:
    return [r.request_id for r in scheduler.waiting]


# ---- residency ----


def test_a_request_runs_on_its_adapters_slot_and_a_base_request_on_none() -> None:
    slots = FakeSlots(2, resident={"a": 1}, known={"b"})
    scheduler = _scheduler(slots)
    for request in (_request("on-a", "a"), _request("base"), _request("on-b", "b")):
        scheduler.add_request(request)
    ran = _step(scheduler, slots)
    assert {rid: s.lora_slot for rid, s in ran.items()} == {"on-a": 1, "base": -1, "on-b": 0}
    # "a" was already there: nothing moved for it; "b" took the free slot, evicting nobody.
    assert slots.moves == [("load", "b", 0)]
    assert [name for name, _ in slots.calls] == ["a", "b"], "the base request needs no slot"
    # Decodes keep the slot they were admitted with.
    ran = _step(scheduler, slots)
    assert {rid: s.lora_slot for rid, s in ran.items()} == {"on-a": 1, "base": -1, "on-b": 0}


def test_a_request_whose_adapter_is_being_read_waits_and_drains_no_one() -> None:
    """The read runs on the ranks' own threads: meanwhile the request keeps its place, running
    adapters keep their slots and new requests keep being admitted; once read, it runs."""
    slots = FakeSlots(1, resident={"a": 0}, known={"b"})
    slots.reading.add("b")
    scheduler = _scheduler(slots)
    _start(scheduler, slots, _request("on-a", "a"))
    scheduler.add_request(_request("on-b", "b"))
    scheduler.add_request(_request("more-a", "a"))
    ran = _step(scheduler, slots)
    assert "on-b" not in ran and "more-a" in ran, "a request behind the read is admitted"
    assert slots.reads_started == ["b"] and _waiting(scheduler) == ["on-b"]
    assert scheduler.turns.draining is None, "a read in flight is no reason to drain a slot"
    assert not [name for name, _ in slots.calls if name == "b"], "no slot asked for before"
    for _ in range(2):
        assert set(_step(scheduler, slots)) == {"on-a", "more-a"}
    slots.reading.discard("b")  # every rank reported it read
    ran = _step(scheduler, slots)
    assert "on-b" not in ran, "its slot is still taken by running requests on a"
    assert scheduler.turns.draining == "a", "now that it is ready, a slot is drained for it"


def test_no_room_in_the_host_tier_drains_a_running_adapter_like_a_missing_slot() -> None:
    """Otherwise popular adapters could keep the host tier forever and the request starve."""
    slots = FakeSlots(1, resident={"a": 0}, known={"b"})
    slots.no_room.add("b")
    scheduler = _scheduler(slots)
    _start(scheduler, slots, _request("on-a", "a"))
    scheduler.add_request(_request("on-b", "b"))
    ran = _step(scheduler, slots)
    assert "on-b" not in ran and _waiting(scheduler) == ["on-b"]
    assert scheduler.turns.draining == "a"


def test_without_a_free_slot_the_request_waits_while_base_requests_keep_running() -> None:
    slots = FakeSlots(1, resident={"a": 0}, known={"b"})
    scheduler = _scheduler(slots)
    _start(scheduler, slots, _request("on-a", "a"))
    scheduler.add_request(_request("on-b", "b"))
    for i in range(3):
        scheduler.add_request(_request(f"base{i}", max_tokens=1))
        ran = _step(scheduler, slots)
        assert set(ran) == {"on-a", f"base{i}"}, "a deferred request does not block the queue"
        assert _waiting(scheduler) == ["on-b"]
    waiting = scheduler.requests["on-b"]
    assert waiting.status == RequestStatus.WAITING and waiting.block_ids == []
    assert waiting.num_computed_tokens == 0, "a deferred request holds no blocks"
    assert slots.moves == [], "the only slot serves a running request"


def test_a_deferred_request_keeps_its_place_at_the_head_of_the_queue() -> None:
    slots = FakeSlots(1, resident={"a": 0}, known={"b"})
    scheduler = _scheduler(slots, max_num_seqs=2)
    _start(scheduler, slots, _request("on-a", "a", max_tokens=3))
    for request in (_request("on-b", "b"), _request("base0", max_tokens=2), _request("base1")):
        scheduler.add_request(request)
    # "on-b" is deferred, "base0" fills the batch, "base1" waits for room.
    assert set(_step(scheduler, slots)) == {"on-a", "base0"}
    assert _waiting(scheduler) == ["on-b", "base1"]
    # Both finish together; "on-b" goes first, and "base1" only as far as room allows.
    assert set(_step(scheduler, slots)) == {"on-a", "base0"}
    assert set(_step(scheduler, slots)) == {"on-b", "base1"}


def test_the_deferred_request_takes_the_slot_when_its_holder_finishes() -> None:
    slots = FakeSlots(1, resident={"a": 0}, known={"b"})
    scheduler = _scheduler(slots)
    _start(scheduler, slots, _request("on-a", "a", max_tokens=3))  # token 1
    scheduler.add_request(_request("on-b", "b"))
    assert set(_step(scheduler, slots)) == {"on-a"}  # token 2
    assert set(_step(scheduler, slots)) == {"on-a"}  # token 3: finished
    assert "on-a" not in scheduler.requests and slots.moves == []
    ran = _step(scheduler, slots)
    assert set(ran) == {"on-b"} and ran["on-b"].lora_slot == 0
    assert slots.moves == [("evict", "a", 0), ("load", "b", 0)]
    assert not scheduler.waiting


def test_aborting_the_holders_request_frees_the_slot_for_the_deferred_one() -> None:
    slots = FakeSlots(1, resident={"a": 0}, known={"b"})
    scheduler = _scheduler(slots)
    _start(scheduler, slots, _request("on-a", "a"))
    scheduler.add_request(_request("on-b", "b"))
    assert set(_step(scheduler, slots)) == {"on-a"}
    scheduler.abort_requests(["on-a"])
    ran = _step(scheduler, slots)
    assert set(ran) == {"on-b"} and ran["on-b"].lora_slot == 0


def test_an_adapter_that_a_running_request_uses_is_never_evicted() -> None:
    # "a" (running) is on slot 0, the naive fake's first choice: only `busy` protects it.
    slots = FakeSlots(2, resident={"a": 0, "idle": 1}, known={"c"})
    scheduler = _scheduler(slots)
    _start(scheduler, slots, _request("on-a", "a"))
    scheduler.add_request(_request("on-c", "c"))
    ran = _step(scheduler, slots)
    assert ran["on-c"].lora_slot == 1 and ran["on-a"].lora_slot == 0
    assert slots.moves == [("evict", "idle", 1), ("load", "c", 1)]
    assert "a" in slots.calls[-1][1], "running adapters are passed as busy"


def test_an_adapter_admitted_earlier_in_the_same_step_is_not_evicted() -> None:
    slots = FakeSlots(2, resident={"x": 0, "y": 1}, known={"c", "d", "e"})
    scheduler = _scheduler(slots)
    for rid, lora in (("on-c", "c"), ("on-d", "d"), ("on-e", "e"), ("base", None)):
        scheduler.add_request(_request(rid, lora))
    ran = _step(scheduler, slots)
    # "c" takes slot 0 from idle "x"; "d" must not take it back from "c" (just admitted).
    assert slots.moves == [("evict", "x", 0), ("load", "c", 0), ("evict", "y", 1), ("load", "d", 1)]
    assert {rid: s.lora_slot for rid, s in ran.items()} == {"on-c": 0, "on-d": 1, "base": -1}
    # A third adapter is one too many for a two-slot batch: it waits, base still runs.
    assert _waiting(scheduler) == ["on-e"]


# ---- pins and draining ----


def test_the_drained_adapter_takes_no_new_requests_until_its_running_ones_finish() -> None:
    slots = FakeSlots(1, resident={"a": 0}, known={"b"})
    scheduler = _scheduler(slots)
    _start(scheduler, slots, _request("a1", "a", max_tokens=4))  # token 1
    scheduler.add_request(_request("on-b", "b"))
    assert set(_step(scheduler, slots)) == {"a1"}  # token 2; "on-b" deferred, "a" drains
    assert scheduler.turns.draining == "a"
    # New requests for the resident adapter would keep its slot busy forever: they wait too,
    # behind "on-b", while base requests still run.
    scheduler.add_request(_request("a2", "a"))
    scheduler.add_request(_request("base", max_tokens=1))
    assert set(_step(scheduler, slots)) == {"a1", "base"}  # token 3
    assert _waiting(scheduler) == ["on-b", "a2"]
    assert set(_step(scheduler, slots)) == {"a1"}  # token 4: "a1" finished, "a" drained
    ran = _step(scheduler, slots)
    assert set(ran) == {"on-b"}, "the drained slot goes to the adapter that waited"
    assert slots.moves == [("evict", "a", 0), ("load", "b", 0)]
    assert _waiting(scheduler) == ["a2"]
    # The drain is over: once "b" is done, "a" takes requests again.
    scheduler.abort_requests(["on-b"])
    ran = _step(scheduler, slots)
    assert set(ran) == {"a2"} and ran["a2"].lora_slot == 0


def test_the_drained_adapter_is_the_unpinned_one_with_fewest_running_requests() -> None:
    # "alpha" (3 running) is first by name and first admitted; "zeta" has 1 running.
    slots = FakeSlots(2, resident={"alpha": 0, "zeta": 1}, known={"c"})
    scheduler = _scheduler(slots)
    _start(scheduler, slots, *(_request(f"alpha{i}", "alpha") for i in range(3)))
    _start(scheduler, slots, _request("zeta0", "zeta"))
    scheduler.add_request(_request("on-c", "c"))
    _step(scheduler, slots)
    assert scheduler.turns.draining == "zeta"
    scheduler.add_request(_request("alpha-new", "alpha"))
    scheduler.add_request(_request("zeta-new", "zeta"))
    ran = _step(scheduler, slots)
    assert "alpha-new" in ran and "zeta-new" not in ran
    scheduler.abort_requests(["zeta0"])
    ran = _step(scheduler, slots)
    assert ran["on-c"].lora_slot == 1
    assert slots.moves == [("evict", "zeta", 1), ("load", "c", 1)]
    assert _waiting(scheduler) == ["zeta-new"]


def test_a_drain_once_chosen_is_not_moved_to_another_adapter() -> None:
    slots = FakeSlots(2, resident={"alpha": 0, "zeta": 1}, known={"c"})
    scheduler = _scheduler(slots)
    _start(scheduler, slots, _request("alpha0", "alpha"), _request("alpha1", "alpha"))
    _start(scheduler, slots, _request("zeta0", "zeta"))
    scheduler.add_request(_request("on-c", "c"))
    _step(scheduler, slots)
    assert scheduler.turns.draining == "zeta"
    # Now both have one running request: "alpha" would win a fresh choice (by name); switching
    # would start draining a second slot while the first one is half drained.
    scheduler.abort_requests(["alpha1"])
    scheduler.add_request(_request("alpha-new", "alpha"))
    ran = _step(scheduler, slots)
    assert scheduler.turns.draining == "zeta" and "alpha-new" in ran
    scheduler.abort_requests(["zeta0"])
    assert _step(scheduler, slots)["on-c"].lora_slot == 1


def test_a_pinned_adapter_is_never_drained_even_with_the_fewest_requests() -> None:
    slots = FakeSlots(2, resident={"pinned": 0, "other": 1}, known={"c"}, pinned={"pinned"})
    scheduler = _scheduler(slots)
    _start(scheduler, slots, _request("p0", "pinned"))
    _start(scheduler, slots, _request("o0", "other"), _request("o1", "other"))
    scheduler.add_request(_request("on-c", "c"))
    _step(scheduler, slots)
    assert scheduler.turns.draining == "other"
    scheduler.add_request(_request("p-new", "pinned"))
    assert "p-new" in _step(scheduler, slots), "the pinned adapter keeps taking requests"
    # Its requests finishing leaves it idle on slot 0 (the naive fake's first choice), but a
    # pinned adapter is no victim: "c" waits for "other"'s slot.
    scheduler.abort_requests(["p0", "p-new"])
    assert "on-c" not in _step(scheduler, slots)
    scheduler.abort_requests(["o0", "o1"])
    assert _step(scheduler, slots)["on-c"].lora_slot == 1
    assert "pinned" not in slots.evicted


def test_with_only_pinned_adapters_running_nothing_drains_and_pinned_requests_go_on() -> None:
    slots = FakeSlots(1, resident={"pinned": 0}, known={"c"}, pinned={"pinned"})
    scheduler = _scheduler(slots)
    _start(scheduler, slots, _request("p0", "pinned"))
    scheduler.add_request(_request("on-c", "c"))
    scheduler.add_request(_request("p1", "pinned"))
    ran = _step(scheduler, slots)
    assert "p1" in ran and "on-c" not in ran
    assert scheduler.turns.draining is None


# ---- requests that can never run ----


@pytest.mark.parametrize("case", ["unknown adapter", "every slot pinned"])
def test_a_request_the_slots_refuse_for_good_is_ended_and_the_rest_go_on(case: str) -> None:
    if case == "unknown adapter":
        slots = FakeSlots(1, resident={}, known=set())
        name = "nope"
    else:
        slots = FakeSlots(1, resident={"pinned": 0}, known={"c"}, pinned={"pinned"})
        name = "c"
    scheduler = _scheduler(slots)
    scheduler.add_request(_request("doomed", name))
    scheduler.add_request(_request("base"))
    ran = _step(scheduler, slots)
    assert set(ran) == {"base"} and "doomed" not in scheduler.requests
    assert not scheduler.waiting
    [(_, output)] = scheduler.take_rejected()
    assert output.request_id == "doomed" and output.finish_reason == FinishReason.ABORT
    assert output.error and name in output.error
    assert scheduler.take_rejected() == [], "reported once"


# ---- turns (--lora-turn-steps) ----


def _turns(
    slots: FakeSlots, turn_steps: int = 2, blocks: int = 256, step_tokens: int = 512
) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=step_tokens)
    return Scheduler(config, BlockManager(blocks, 4), 1024, slots, lora_turn_steps=turn_steps)


def _b_waits_for_a(
    turn_steps: int, blocks: int = 256, a_tokens: int = 100, b_tokens: int = 100
) -> tuple[FakeSlots, Scheduler]:
    """One slot held by "a", whose request "a1" runs; "on-b" has just arrived for it."""
    slots = FakeSlots(1, resident={"a": 0}, known={"b"})
    scheduler = _turns(slots, turn_steps=turn_steps, blocks=blocks)
    _start(scheduler, slots, _request("a1", "a", max_tokens=a_tokens))
    scheduler.add_request(_request("on-b", "b", max_tokens=b_tokens))
    return slots, scheduler


def test_a_queued_request_takes_the_slot_in_the_next_step_and_the_holder_is_parked() -> None:
    """A request with no token yet waits for no turn: the holder is parked before the step."""
    slots, scheduler = _b_waits_for_a(4)
    holder = scheduler.requests["a1"]
    blocks, computed = list(holder.block_ids), holder.num_computed_tokens
    ran = _step(scheduler, slots)
    assert set(ran) == {"on-b"} and ran["on-b"].lora_slot == 0
    assert slots.moves == [("evict", "a", 0), ("load", "b", 0)]
    assert holder.status == RequestStatus.PARKED and scheduler.parked == [holder]
    assert holder.block_ids == blocks and holder.num_computed_tokens == computed, "KV kept"
    assert holder.num_preemptions == 0 and scheduler.num_preemptions == 0
    assert scheduler.stats().num_running_reqs == 2, "a parked request is still in flight"


def test_every_queued_adapter_gets_a_slot_in_the_same_step() -> None:
    """Two slots held, two new adapters queued: both holders are parked at once, not one
    drain after the other."""
    slots = FakeSlots(2, resident={"a": 0, "b": 1}, known={"c", "d"})
    scheduler = _turns(slots, turn_steps=4)
    _start(scheduler, slots, _request("a1", "a"), _request("a2", "a"), _request("b1", "b"))
    scheduler.add_request(_request("c1", "c"))
    scheduler.add_request(_request("d1", "d"))
    ran = _step(scheduler, slots)
    assert set(ran) == {"c1", "d1"}
    assert {r.request_id for r in scheduler.parked} == {"a1", "a2", "b1"}
    assert not scheduler.waiting


def _a_twice_b_once() -> tuple[FakeSlots, Scheduler]:
    """Two slots: "a" runs two requests, "b" one; "c" is known, in no slot."""
    slots = FakeSlots(2, resident={"a": 0, "b": 1}, known={"c"})
    scheduler = _turns(slots, turn_steps=4)
    _start(scheduler, slots, _request("a1", "a"), _request("a2", "a"), _request("b1", "b"))
    return slots, scheduler


def test_only_as_many_adapters_are_parked_as_the_queue_needs_fewest_requests_first() -> None:
    slots, scheduler = _a_twice_b_once()
    scheduler.add_request(_request("c1", "c"))
    scheduler.add_request(_request("c2", "c"))
    ran = _step(scheduler, slots)
    assert set(ran) == {"a1", "a2", "c1", "c2"}
    assert [r.request_id for r in scheduler.parked] == ["b1"]


def test_an_adapter_the_queue_names_is_parked_last_even_with_fewer_requests() -> None:
    """ "b" runs fewer requests than "a", but a new request for it is queued: parking "b" would
    hold that request back a step (no first token yet), parking "a" only pauses streams that
    have one."""
    slots, scheduler = _a_twice_b_once()
    scheduler.add_request(_request("c1", "c"))
    scheduler.add_request(_request("b2", "b"))
    ran = _step(scheduler, slots)
    assert set(ran) == {"b1", "b2", "c1"}, "both new requests get their first token now"
    assert {r.request_id for r in scheduler.parked} == {"a1", "a2"}
    assert not scheduler.waiting


def test_a_request_without_its_first_token_is_never_parked_for_a_queued_one() -> None:
    """The holder's prompt takes three steps (8 tokens a step): the queued request waits for
    its first token, then takes the slot."""
    slots = FakeSlots(1, resident={"a": 0}, known={"b"})
    scheduler = _turns(slots, turn_steps=4, step_tokens=16)
    long = _request("a1", "a")
    long.prompt_token_ids = list(range(700, 740))  # 40 tokens: 16 + 16 + 8
    scheduler.add_request(long)
    assert set(_step(scheduler, slots)) == {"a1"}
    scheduler.add_request(_request("on-b", "b"))
    assert set(_step(scheduler, slots)) == {"a1"}
    assert scheduler.turns.draining is None, "it waits for the first token, not for a turn"
    assert set(_step(scheduler, slots)) == {"a1"} and long.output_token_ids, "its first token"
    assert set(_step(scheduler, slots)) == {"on-b"} and scheduler.parked == [long]


def test_a_pinned_holder_is_never_parked_for_a_queued_request() -> None:
    slots = FakeSlots(2, resident={"a": 0, "b": 1}, known={"c"}, pinned={"a"})
    scheduler = _turns(slots, turn_steps=4)
    _start(scheduler, slots, _request("a1", "a"), _request("b1", "b"), _request("b2", "b"))
    scheduler.add_request(_request("c1", "c"))
    ran = _step(scheduler, slots)
    assert set(ran) == {"a1", "c1"}, "b has more requests, but a is pinned"


def test_a_parked_adapter_read_back_never_pushes_out_a_queued_requests_adapter() -> None:
    """A parked adapter that lost its host place reads back without evicting the adapter of
    a queued request: the queued request would read it again, taking a parked place in turn,
    round and round."""
    slots, scheduler = _two_parked()
    slots.reading.add("e")  # "e1" waits for its read; "d1" takes the slot and keeps it
    slots.pinned.add("d")
    slots.no_room.add("a")
    scheduler.add_request(_request("d1", "d"))
    scheduler.add_request(_request("e1", "e"))
    _step(scheduler, slots)
    slots.reading.discard("e")  # read: "e1" waits for a slot now, "a" asks for room
    asked_before = len(slots.protections)
    _step(scheduler, slots)
    assert "e1" in _waiting(scheduler)
    asked = [protected for name, protected in slots.protections[asked_before:] if name == "a"]
    assert asked and all("e" in protected for protected in asked)


def test_an_overdue_parked_request_goes_before_the_queue_and_keeps_its_slot_a_turn() -> None:
    """Past PARKED_PATIENCE_TURNS a parked request counts as queued, ahead of the queue: the
    holder is parked for it at once, and it keeps the slot for a whole turn against queued
    requests (not one step each)."""
    slots, scheduler = _b_waits_for_a(2)
    _step(scheduler, slots)  # "a1" parked for "on-b"
    scheduler.requests["a1"].parked_at -= PARKED_PATIENCE_TURNS * 2  # waited that long
    slots.known.add("c")
    scheduler.add_request(_request("on-c", "c"))
    assert set(_step(scheduler, slots)) == {"a1"}
    assert set(_step(scheduler, slots)) == {"a1"}, "a whole turn before on-c gets the slot"
    assert set(_step(scheduler, slots)) == {"on-c"}


def test_a_slot_made_for_the_queue_goes_to_no_parked_request_that_is_not_overdue() -> None:
    """An overdue request that cannot resume (its adapter lost its host place) lets parked
    requests go first for no one else: the slot parked for the queued request is its."""
    slots, scheduler = _two_parked()
    scheduler.requests["a1"].parked_at -= PARKED_PATIENCE_TURNS * 4  # overdue
    slots.no_room.add("a")
    scheduler.add_request(_request("d1", "d"))
    ran = _step(scheduler, slots)
    assert set(ran) == {"d1"}
    assert {r.request_id for r in scheduler.parked} == {"a1", "b1", "c1"}


def test_parked_requests_take_their_turn_back_and_go_on_where_they_stopped() -> None:
    slots, scheduler = _b_waits_for_a(2, a_tokens=20, b_tokens=20)
    assert set(_step(scheduler, slots)) == {"on-b"}  # "a1" parked at once for "on-b"
    holder = scheduler.requests["a1"]
    tokens = len(holder.output_token_ids)
    # The parked request waits for the slot too, but a whole turn (it has tokens): "b"
    # drains, and after its turn (the step it was admitted in and one more) "a1" resumes on
    # the slot, from the token it stopped at.
    assert scheduler.turns.draining == "b"
    assert set(_step(scheduler, slots)) == {"on-b"}
    ran = _step(scheduler, slots)
    assert set(ran) == {"a1"} and scheduler.parked == [scheduler.requests["on-b"]]
    assert ran["a1"].sampling_params is None, "the ranks still hold its parameters"
    assert ran["a1"].start_position == holder.num_computed_tokens - 1 and ran["a1"].lora_slot == 0
    assert len(ran["a1"].token_ids) == 1, "no prompt computed again"
    assert len(holder.output_token_ids) == tokens + 1
    assert scheduler.num_parked == 2 and scheduler.num_preemptions == 0
    # Turn by turn, both finish with every token.
    for _ in range(60):
        if not scheduler.has_unfinished_requests():
            break
        _step(scheduler, slots)
    assert not scheduler.has_unfinished_requests()


def test_with_no_one_waiting_for_its_slot_a_drained_adapter_runs_on_at_once() -> None:
    """The parked request that drained "b" went away: at the end of the turn "b" is parked
    and resumed in the same step, nothing moved."""
    slots, scheduler = _b_waits_for_a(2)
    _step(scheduler, slots)  # "a1" parked for "on-b"
    _step(scheduler, slots)  # "a1" drains "b"
    assert scheduler.turns.draining == "b"
    moves = list(slots.moves)
    scheduler.abort_requests(["a1"])
    for _ in range(3):
        assert set(_step(scheduler, slots)) == {"on-b"}
    assert slots.moves == moves and not scheduler.parked


def test_a_parked_request_is_preempted_before_any_running_one_when_blocks_run_out() -> None:
    # 12 blocks of 4 tokens: "a1" parks holding 2, "on-b" grows until the pool is empty.
    slots, scheduler = _b_waits_for_a(1, blocks=12, a_tokens=200, b_tokens=200)
    _step(scheduler, slots)
    parked = scheduler.requests["a1"]
    assert parked.status == RequestStatus.PARKED and parked.block_ids
    # "on-b" keeps the slot from now on (its drain for "a1" started with a turn of 1 step).
    scheduler.turns.turn_steps = 1000
    for _ in range(60):
        if parked.status != RequestStatus.PARKED:
            break
        assert set(_step(scheduler, slots)) == {"on-b"}
    assert parked.status == RequestStatus.WAITING and parked.block_ids == []
    assert parked.num_preemptions == 1 and scheduler.requests["on-b"].num_preemptions == 0
    assert scheduler.requests["on-b"].status == RequestStatus.RUNNING


def test_aborting_a_parked_request_frees_its_blocks() -> None:
    slots, scheduler = _b_waits_for_a(2)
    _step(scheduler, slots)
    _step(scheduler, slots)
    assert [r.request_id for r in scheduler.parked] == ["a1"]
    free = len(scheduler.blocks.free_blocks)
    scheduler.abort_requests(["a1"])
    assert not scheduler.parked and "a1" not in scheduler.requests
    assert len(scheduler.blocks.free_blocks) > free
    assert scheduler.unfinished_requests() == [scheduler.requests["on-b"]]


@pytest.mark.parametrize("blocks", [4, 5, 6, 8])
@pytest.mark.parametrize("turn_steps", [1, 2, 3])
def test_turns_under_block_pressure_always_make_progress(blocks: int, turn_steps: int) -> None:
    """Two adapters on one slot in a pool too small for both: whatever is parked or
    preempted, every step runs something until every request has all its tokens."""
    slots = FakeSlots(1, resident={"a": 0}, known={"b", "c"})
    scheduler = _turns(slots, turn_steps=turn_steps, blocks=blocks)
    requests = [_request(f"r{i}", "abc"[i % 3], max_tokens=10) for i in range(4)]
    for request in requests:
        scheduler.add_request(request)
    for _ in range(400):
        if not scheduler.has_unfinished_requests():
            break
        assert _step(scheduler, slots), (
            f"an empty step: parked {[r.request_id for r in scheduler.parked]}, free "
            f"{len(scheduler.blocks.free_blocks)}, waiting {_waiting(scheduler)}"
        )
    assert not scheduler.has_unfinished_requests()
    assert all(len(r.output_token_ids) == 10 for r in requests)


def test_parked_requests_holding_every_block_with_nothing_running_are_recomputed() -> None:
    # 3 blocks of 4: "a1" (8 prompt tokens) holds 2, "b1" (4) holds 1, both at a block's end.
    slots = FakeSlots(2, resident={"a": 0, "b": 1})
    scheduler = _turns(slots, blocks=3)
    a1 = _request("a1", "a")
    a1.prompt_token_ids = list(range(500, 508))
    _start(scheduler, slots, a1, _request("b1", "b"))
    assert not scheduler.blocks.free_blocks
    for request in list(scheduler.running):  # both parked: nothing runs to preempt them
        scheduler.running.remove(request)
        request.status = RequestStatus.PARKED
        scheduler.parked.append(request)
    ran = _step(scheduler, slots)
    assert set(ran) == {"a1"}, "the oldest is recomputed at once, not left to wait forever"
    assert scheduler.requests["a1"].num_preemptions == 1  # (its own cached blocks shorten it)
    assert _waiting(scheduler) == ["b1"] and not scheduler.parked


def test_a_parked_request_waiting_for_its_adapters_read_is_not_recomputed() -> None:
    """Nothing runs, but the parked request waits for its adapter, not for blocks: the read
    ends by itself, and recomputing would throw its KV away (this was a flaky preemption in
    test_lora_generation.py)."""
    slots, scheduler = _b_waits_for_a(2)
    _step(scheduler, slots)  # "a1" parked for "on-b"
    scheduler.abort_requests(["on-b"])
    slots.reading.add("a")  # "a" lost its host place and is being read back
    holder = scheduler.requests["a1"]
    assert _step(scheduler, slots) == {}
    assert holder.status == RequestStatus.PARKED and scheduler.num_preemptions == 0
    slots.reading.discard("a")
    assert set(_step(scheduler, slots)) == {"a1"}
    assert scheduler.num_preemptions == 0


def test_the_queue_claims_a_slot_before_parked_requests_until_one_is_overdue() -> None:
    """A request with no token yet goes before one that has been streaming; but a stream of
    new adapters cannot hold a parked request back for more than PARKED_PATIENCE_TURNS."""
    slots = FakeSlots(1, resident={"a": 0}, known={f"n{i}" for i in range(20)})
    scheduler = _turns(slots, turn_steps=1)
    _start(scheduler, slots, _request("a1", "a"))
    parked_at = resumed_at = None
    ran_while_parked: list[str] = []
    for i in range(20):
        scheduler.add_request(_request(f"new{i}", f"n{i}"))  # a new adapter every step
        ran = _step(scheduler, slots)
        if parked_at is None and scheduler.requests["a1"].status == RequestStatus.PARKED:
            parked_at = scheduler.steps
        elif parked_at is not None and "a1" in ran:
            resumed_at = scheduler.steps
            break
        if parked_at is not None:
            ran_while_parked += ran
    assert parked_at is not None and resumed_at is not None
    assert ran_while_parked[:2] == ["new0", "new1"], "the queue went first while it could"
    assert resumed_at - parked_at <= PARKED_PATIENCE_TURNS * 1 + 2, "held back too long"


def test_waiting_for_room_in_the_host_tier_parks_no_one() -> None:
    """Parking frees a slot, not a place in the host tier (a parked adapter keeps its place):
    a request waiting for host room drains an adapter but lets its requests finish."""
    slots = FakeSlots(1, resident={"a": 0}, known={"b"})
    slots.no_room.add("b")
    scheduler = _turns(slots, turn_steps=1)
    _start(scheduler, slots, _request("a1", "a", max_tokens=20))
    scheduler.add_request(_request("on-b", "b"))
    for _ in range(4):
        assert set(_step(scheduler, slots)) == {"a1"}
        assert scheduler.turns.draining == "a" and not scheduler.parked
    slots.no_room.discard("b")  # room now: it takes the slot at once, as any queued request
    ran = _step(scheduler, slots)
    assert set(ran) == {"on-b"} and [r.request_id for r in scheduler.parked] == ["a1"]


def _two_parked() -> tuple[FakeSlots, Scheduler]:
    """One slot: "a1" and then "b1" parked for newer adapters, "c1" running on the slot."""
    slots = FakeSlots(1, resident={"a": 0}, known={"b", "c", "d", "e"})
    scheduler = _turns(slots, turn_steps=4)
    _start(scheduler, slots, _request("a1", "a"))
    scheduler.add_request(_request("b1", "b"))
    _step(scheduler, slots)
    _step(scheduler, slots)  # "a1" parked, "b1" runs
    scheduler.add_request(_request("c1", "c"))
    _step(scheduler, slots)
    _step(scheduler, slots)  # "b1" parked, "c1" runs
    assert {r.request_id for r in scheduler.parked} == {"a1", "b1"}
    assert [r.request_id for r in scheduler.running] == ["c1"]
    return slots, scheduler


def test_a_queued_request_finding_no_host_room_takes_a_parked_adapters_place() -> None:
    """Parked adapters hold the host tier; a request with no token yet may take the place of
    one of them (never the running adapter's), one such read a step."""
    slots, scheduler = _two_parked()
    slots.no_room |= {"d", "e"}
    slots.spare_places |= {"a", "b", "c"}
    scheduler.add_request(_request("d1", "d"))
    scheduler.add_request(_request("e1", "e"))
    _step(scheduler, slots)
    assert [read for read, _ in slots.places_taken] == ["d"], "one read a step"
    assert slots.places_taken[0][1] in {"a", "b"}, "a parked adapter's place, not c's"
    assert all("c" not in spare for _, spare in slots.offers), "the running adapter stays"
    assert slots.reads_started == ["d"]
    _step(scheduler, slots)
    assert [read for read, _ in slots.places_taken] == ["d", "e"]
    assert {taken for _, taken in slots.places_taken} == {"a", "b"}


def test_a_read_takes_the_place_of_a_parked_adapter_no_queued_request_names() -> None:
    """A new request for a parked adapter must not find it read out for another: the read
    takes a parked place the queue does not name while there is one."""
    slots, scheduler = _two_parked()
    slots.no_room.add("d")
    slots.spare_places |= {"a", "b"}  # the fake would give up "a" first
    scheduler.add_request(_request("d1", "d"))
    scheduler.add_request(_request("a2", "a"))
    ran = _step(scheduler, slots)
    assert slots.places_taken == [("d", "b")]
    assert "a2" in ran


def test_a_parked_request_never_takes_another_parked_adapters_place() -> None:
    """Parked adapters taking each other's places is what made turns go through the disk: a
    parked request whose adapter lost its place waits for room made otherwise."""
    slots, scheduler = _two_parked()
    slots.no_room.add("a")  # "a" lost its place in the host tier
    slots.spare_places.add("b")
    for _ in range(6):
        _step(scheduler, slots)
    assert not slots.places_taken
    assert all(not spare for name, spare in slots.offers if name == "a")
    assert scheduler.requests["a1"].status == RequestStatus.PARKED


def test_with_turns_the_drained_adapter_takes_new_requests_and_parks_them_with_the_rest() -> None:
    """A turn ends at a fixed step, so a new request on the drained adapter delays no one: it
    gets its first token at once instead of waiting out the turn and the next ones."""
    slots, scheduler = _b_waits_for_a(3)
    _step(scheduler, slots)  # "a1" parked for "on-b"
    _step(scheduler, slots)  # "a1" drains "b" for a turn of 3 steps
    assert scheduler.turns.draining == "b"
    scheduler.add_request(_request("b2", "b"))
    assert set(_step(scheduler, slots)) == {"on-b", "b2"}, "joined the drained adapter"
    _step(scheduler, slots)
    ran = _step(scheduler, slots)  # the turn is over: both parked, "a1" takes the slot
    assert set(ran) == {"a1"}
    assert {r.request_id for r in scheduler.parked} == {"on-b", "b2"}
    assert scheduler.requests["b2"].output_token_ids, "parked after its first token"


def test_without_turns_the_drained_adapter_takes_no_new_requests() -> None:
    slots, scheduler = _b_waits_for_a(0)
    _step(scheduler, slots)
    assert scheduler.turns.draining == "a"
    scheduler.add_request(_request("a2", "a"))
    assert set(_step(scheduler, slots)) == {"a1"}, "its slot frees only when a1 finishes"
