"""The restart rules on their own: back-off grows with recent failures, and only failures
within the window count towards giving up."""

from __future__ import annotations

from rankcast.entrypoints.supervision import (
    GIVE_UP_WINDOW_S,
    RESTART_BACKOFF_S,
    EngineSupervision,
)


def test_back_off_grows_and_the_third_failure_in_the_window_gives_up() -> None:
    engine = EngineSupervision(0)
    engine.failed("exited", now=100.0)
    assert engine.retry_at == 100.0 + RESTART_BACKOFF_S[0]
    assert not engine.due(now=100.5) and engine.due(now=101.0)
    assert engine.state().state == "restarting"
    engine.retry_at = None  # restarted
    engine.failed("exited", now=110.0)
    assert engine.retry_at == 110.0 + RESTART_BACKOFF_S[1]
    engine.failed("failed to start", now=120.0)
    assert engine.given_up is not None and engine.retry_at is None
    assert engine.state().state == "given_up"
    assert "failed 3 times" in engine.state().message and "failed to start" in engine.given_up


def test_failures_older_than_the_window_are_forgotten() -> None:
    engine = EngineSupervision(1)
    engine.failed("exited", now=0.0)
    engine.failed("exited", now=10.0)
    engine.failed("exited", now=5.0 + GIVE_UP_WINDOW_S)  # the first one has aged out
    assert engine.given_up is None
    assert engine.retry_at == 5.0 + GIVE_UP_WINDOW_S + RESTART_BACKOFF_S[1]


def test_a_restart_under_way_says_why_the_engine_died() -> None:
    """What `/health` shows while an engine core is restarted: the reason it gave as it died
    (its last words on the launcher's pipe), e.g. which rank was lost."""
    engine = EngineSupervision(0)
    engine.failed("exited (code 1): rank 1 (Ray actor, pid 42) died", now=5.0)
    state = engine.state()
    assert state.state == "restarting"
    assert state.message.endswith("after it exited (code 1): rank 1 (Ray actor, pid 42) died")
