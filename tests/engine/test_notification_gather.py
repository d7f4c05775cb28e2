"""Rules 4-6 in the engine core: gather from every rank in order, only when there is a reason,
never swallowing a failure, and never stranding an event (the offline engine included)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rankcast import LLM, SamplingParams
from rankcast.channel import publish
from rankcast.channel.events import (
    WEIGHTS_LOADED_KEY,
    CustomNotification,
    Notification,
    NotificationsDropped,
)
from rankcast.channel.gather import GatherError
from rankcast.errors import ExtensionCallError
from rankcast.protocol import ErrorKind
from tests.worker.producers import KEY, RankReport

EXTENSION = "tests.worker.producers:EventProducer"
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = ["The capital of France is", "Once upon a time"]


def _llm(model: Path, **kwargs: object) -> LLM:
    return LLM(
        str(model),
        dtype="float32",
        kv_cache_space_gib=0.05,
        worker_extension_cls=EXTENSION,
        **kwargs,
    )


@pytest.fixture(scope="module")
def tp2_started(tiny_llama_dir: Path) -> Iterator[tuple[LLM, list[Notification]]]:
    """A TP=2 engine and the notifications it had right after start-up."""
    llm = _llm(tiny_llama_dir, tensor_parallel_size=2)
    try:
        yield llm, llm.take_notifications()
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def tp2(tp2_started: tuple[LLM, list[Notification]]) -> LLM:
    return tp2_started[0]


def _calls(llm: LLM) -> dict[str, int]:
    return dict(llm.engine.client.core.executor.rpc_counts)


def _custom(notifications: list[Notification], key: str = KEY) -> list[CustomNotification]:
    return [n for n in notifications if isinstance(n, CustomNotification) and n.key == key]


def _wait_for(llm: LLM, count: int, key: str = KEY, timeout_s: float = 30) -> list[Notification]:
    """Take notifications until `count` with `key` arrived (no step runs meanwhile)."""
    got: list[Notification] = []
    deadline = time.monotonic() + timeout_s
    while len(_custom(got, key)) < count:
        assert time.monotonic() < deadline, f"only {len(_custom(got, key))} of {count} arrived"
        got.extend(llm.take_notifications())
        time.sleep(0.02)
    return got


def test_each_rank_reports_its_weight_load_stamped_with_its_place(
    tp2_started: tuple[LLM, list[Notification]],
) -> None:
    loads = _custom(tp2_started[1], WEIGHTS_LOADED_KEY)
    assert [(n.rank, n.pp_rank, n.tp_rank, n.engine_index) for n in loads] == [
        (0, 0, 0, 0),
        (1, 0, 1, 0),
    ]
    assert all(n.payload["bytes"] > 0 and n.payload["seconds"] > 0 for n in loads)


def test_ranks_froze_their_start_up_heap_and_collect_again(tp2: LLM) -> None:
    """Each spawned rank imported torch and built its model with the collector paused, froze
    what it built once ready (rankcast/startup_gc.py), and left the collector on."""
    states = tp2.collective_rpc("collector_state")
    assert len(states) == 2
    for enabled, frozen in states:
        assert enabled
        assert frozen > 10_000  # torch's modules and the model, at least


def test_gather_keeps_every_rank_in_rank_order_and_emission_order(tp2: LLM) -> None:
    tp2.take_notifications()
    assert tp2.collective_rpc("publish_events", [3]) == [0, 1]
    events = _custom(tp2.take_notifications())
    assert [(n.rank, n.payload["i"]) for n in events] == [
        (0, 0),
        (0, 1),
        (0, 2),
        (1, 0),
        (1, 1),
        (1, 2),
    ]
    seqs = [n.engine_seq for n in events]
    assert seqs == list(range(seqs[0], seqs[0] + 6)), "engine_seq is gap-free"


def test_quiet_steps_make_no_gather_rpc(tp2: LLM) -> None:
    tp2.take_notifications()
    before = _calls(tp2)
    tp2.generate(PROMPTS, GREEDY)
    after = _calls(tp2)
    assert after.get("take_notifications", 0) == before.get("take_notifications", 0)
    steps = after["execute_model"] - before.get("execute_model", 0)
    assert steps >= GREEDY.max_tokens
    assert sum(after.values()) - sum(before.values()) == steps, "only the steps made RPCs"


def test_an_event_published_mid_generation_rides_a_step_reply(tp2: LLM) -> None:
    tp2.take_notifications()
    tp2.collective_rpc("publish_later", [0.05, KEY, [1]])
    before = _calls(tp2).get("take_notifications", 0)
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    engine = tp2.engine
    request_id = engine.add_request(PROMPTS[0], long)
    while engine.has_unfinished_requests() and not _custom(engine.notifications):
        engine.step()
    assert engine.has_unfinished_requests(), "the event arrived before generation ended"
    engine.abort_requests([request_id])
    (event,) = _custom(engine.notifications)
    assert event.rank == 1 and event.payload["later"] is True
    gathers = _calls(tp2)["take_notifications"] - before
    assert gathers == 0, "the event came back with rank 1's step reply: no gather call"
    # The drain into the reply cleared rank 1's doorbell: going idle gathers nothing again.
    assert _custom(tp2.take_notifications()) == [event]
    assert _calls(tp2)["take_notifications"] == before, "no gather for events already delivered"


def test_the_offline_engine_strands_nothing_without_a_step(tp2: LLM) -> None:
    tp2.take_notifications()
    tp2.collective_rpc("publish_later", [0.1])
    events = _custom(_wait_for(tp2, 2))
    assert sorted(n.rank for n in events) == [0, 1]


def test_a_bad_payload_fails_at_the_producer_and_the_engine_keeps_going(tp2: LLM) -> None:
    with pytest.raises(ExtensionCallError, match=r"payload\['ok'\]\[1\]\['bad'\]") as failed:
        tp2.collective_rpc("publish_bad_payload")
    assert failed.value.kind is ErrorKind.EXTENSION_FAILED  # the caller's doing: a 400 served
    out = tp2.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4


def test_a_rank_failing_during_a_gather_fails_loudly_and_leaves_no_stale_reply(
    tiny_llama_dir: Path,
) -> None:
    with _llm(tiny_llama_dir, tensor_parallel_size=2) as llm:
        core = llm.engine.client.core
        core.executor.collective_rpc("break_notification_drain", (1,))
        with pytest.raises(GatherError, match=r"rank 1 failed in take_notifications"):
            core.gather_worker_notifications()
        assert core.executor.collective_rpc("rank_info") == [(0, 0, 0), (1, 0, 1)]


def test_pipeline_stages_that_return_no_output_still_deliver(tiny_llama_dir: Path) -> None:
    with _llm(tiny_llama_dir, pipeline_parallel_size=2, tensor_parallel_size=2) as llm:
        loads = _custom(llm.take_notifications(), WEIGHTS_LOADED_KEY)
        assert [(n.rank, n.pp_rank, n.tp_rank) for n in loads] == [
            (0, 0, 0),
            (1, 0, 1),
            (2, 1, 0),
            (3, 1, 1),
        ]
        # Ranks 0 and 1 (stage 0) return no output: their events still ride their replies.
        llm.collective_rpc("publish_later", [0.05, KEY, [0, 1]])
        engine = llm.engine
        long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        engine.add_request(PROMPTS[0], long)
        while engine.has_unfinished_requests() and len(_custom(engine.notifications)) < 2:
            engine.step()
        assert sorted(n.rank for n in _custom(engine.notifications)) == [0, 1]


def test_the_poll_is_off_by_default_and_its_interval_gates_the_gather(
    tiny_llama_dir: Path,
) -> None:
    with _llm(tiny_llama_dir) as quiet:
        assert quiet.config.notifications.poll_interval is None
        quiet.generate(PROMPTS, GREEDY)
        assert _calls(quiet).get("take_notifications", 0) == 1, "only the start-up gather"
    interval = 0.25
    with _llm(tiny_llama_dir, worker_notification_poll_interval=interval) as polled:
        start = time.monotonic()
        before = _calls(polled).get("take_notifications", 0)
        steps_before = _calls(polled).get("execute_model", 0)
        long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        # Busy for several intervals however fast the machine steps.
        while time.monotonic() - start < 3 * interval:
            polled.generate(PROMPTS, long)
        elapsed = time.monotonic() - start
        gathers = _calls(polled)["take_notifications"] - before
        steps = _calls(polled).get("execute_model", 0) - steps_before
        assert 1 <= gathers <= elapsed / interval + 1
        assert gathers < steps, "the poll does not put an RPC on every step"


def test_the_engine_pending_list_is_bounded_with_counted_drops(tiny_llama_dir: Path) -> None:
    with _llm(tiny_llama_dir, engine_notification_buffer_size=4) as llm:
        llm.take_notifications()
        llm.collective_rpc("publish_events", [10])
        got = llm.take_notifications()
        assert isinstance(got[0], NotificationsDropped)
        assert (got[0].count, got[0].rank) == (6, -1)
        assert [n.payload["i"] for n in _custom(got)] == [6, 7, 8, 9]


def test_with_the_doorbell_off_an_idle_engine_hears_events_only_on_the_poll(
    tiny_llama_dir: Path,
) -> None:
    interval = 0.3
    with _llm(
        tiny_llama_dir,
        worker_notification_doorbell=False,
        worker_notification_poll_interval=interval,
    ) as llm:
        channel = llm.engine.client.core.notifications
        assert 0 < channel.idle_wait(1.0) <= interval, "the idle wait times out at the poll"
        llm.take_notifications()
        # A plain collective (not the utility), so nothing but the poll can gather it.
        llm.engine.client.core.executor.collective_rpc("publish_events", (1,))
        start = time.monotonic()
        assert _custom(llm.take_notifications()) == [], "the poll was not due yet"
        _wait_for(llm, 1)
        assert time.monotonic() - start >= interval * 0.5


def test_two_in_process_engines_keep_their_notifications_apart(tiny_llama_dir: Path) -> None:
    """Each worker owns its buffer: what one engine's rank publishes reaches that engine only,
    and a thread that cannot tell which engine it means is refused rather than guessed."""
    with _llm(tiny_llama_dir) as first, _llm(tiny_llama_dir) as second:
        first.take_notifications()
        second.take_notifications()
        first.collective_rpc("publish_events", [3, "test.first"])
        second.collective_rpc("publish_events", [2, "test.second"])
        got_first, got_second = first.take_notifications(), second.take_notifications()
        assert [n.payload["i"] for n in _custom(got_first, "test.first")] == [0, 1, 2]
        assert [n.payload["i"] for n in _custom(got_second, "test.second")] == [0, 1]
        assert not _custom(got_first, "test.second") and not _custom(got_second, "test.first")
        # A plain thread of this process, with two workers alive, has no worker of its own.
        errors: list[BaseException] = []

        def stray() -> None:
            try:
                publish(CustomNotification(key="test.stray", payload={}))
            except RuntimeError as exc:
                errors.append(exc)

        thread = threading.Thread(target=stray)
        thread.start()
        thread.join()
        assert len(errors) == 1 and "current_notification_buffer()" in str(errors[0])
        # Captured during a call, the buffer takes a thread's events to its own engine.
        second.collective_rpc("publish_from_own_thread", ["test.captured"])
        assert _custom(second.take_notifications(), "test.captured")
        assert not _custom(first.take_notifications(), "test.captured")


def test_an_extension_struct_reply_is_the_same_struct_on_uni_and_mp(
    tiny_llama_dir: Path, tp2: LLM
) -> None:
    """Replies are converted once, the same way whichever executor carried them: an in-process
    struct and one that crossed a socket come back equal (tuple fields included)."""
    with _llm(tiny_llama_dir) as single:
        (uni,) = single.collective_rpc("report")
    assert uni == RankReport(0, (0, 0), ["a", "b"])
    assert tp2.collective_rpc("report") == [
        RankReport(0, (0, 0), ["a", "b"]),
        RankReport(1, (1, 0), ["a", "b"]),
    ]
