"""The restart rules on their own: back-off grows with recent failures, and only failures
within the window count towards giving up."""

from __future__ import annotations

import pytest

from rankcast.launcher.supervision import (
    API_SERVER_BACKOFF_S,
    GIVE_UP_WINDOW_S,
    RESTART_BACKOFF_S,
    Supervision,
)


@pytest.fixture(autouse=True)
def default_back_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default waits (the suite's conftest shortens them for the launchers it starts)."""
    monkeypatch.delenv("RANKCAST_RESTART_BACKOFF_S", raising=False)


def test_back_off_grows_and_the_third_failure_in_the_window_gives_up() -> None:
    engine = Supervision.engine(0)
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
    engine = Supervision.engine(1)
    engine.failed("exited", now=0.0)
    engine.failed("exited", now=10.0)
    engine.failed("exited", now=5.0 + GIVE_UP_WINDOW_S)  # the first one has aged out
    assert engine.given_up is None
    assert engine.retry_at == 5.0 + GIVE_UP_WINDOW_S + RESTART_BACKOFF_S[1]


def test_a_restart_under_way_says_why_the_engine_died() -> None:
    """What `/health` shows while an engine core is restarted: the reason it gave as it died
    (its last words on the launcher's pipe), e.g. which rank was lost."""
    engine = Supervision.engine(0)
    engine.failed("exited (code 1): rank 1 (Ray actor, pid 42) died", now=5.0)
    state = engine.state()
    assert state.state == "restarting"
    assert state.message.endswith("after it exited (code 1): rank 1 (Ray actor, pid 42) died")


def test_a_restart_says_which_incarnation_comes_and_ready_ends_it() -> None:
    """While the back-off runs, the state names the incarnation to come; once started it is
    the one under way; ready returns the engine to `serving`. Before its first ready it is
    `starting`, never `serving`."""
    engine = Supervision.engine(0)
    assert engine.state().state == "starting"
    engine.ready()
    assert engine.state().state == "serving"
    engine.failed("exited (code -9)", now=1.0)
    assert "(incarnation 1)" in engine.state().message
    engine.restarting()
    assert engine.incarnation == 1 and engine.state().state == "restarting"
    assert "(incarnation 1)" in engine.state().message
    engine.ready()
    assert engine.state().state == "serving" and engine.state().incarnation == 1


def test_an_api_server_is_started_again_at_once_then_with_back_off() -> None:
    server = Supervision.api_server(1)
    server.failed("exited (code -9)", now=10.0)
    assert API_SERVER_BACKOFF_S[0] == 0.0 and server.due(now=10.0)
    server.restarting()
    server.failed("exited during start-up (exit code -9)", now=11.0)
    assert not server.due(now=11.5) and server.due(now=11.0 + API_SERVER_BACKOFF_S[1])
    server.restarting()
    server.failed("exited (code -9)", now=12.0)
    assert server.given_up is not None and server.given_up.startswith("API server 1 failed 3")


def test_an_operator_sets_the_engine_waits_and_a_bad_value_is_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RANKCAST_RESTART_BACKOFF_S", "0.5, 3")
    engine = Supervision.engine(0)
    engine.failed("exited", now=100.0)
    assert engine.retry_at == 100.5
    engine.retry_at = None
    engine.failed("exited", now=110.0)
    assert engine.retry_at == 113.0
    engine.failed("exited", now=120.0)  # the give-up rule is the same
    assert engine.given_up is not None
    # API servers keep their own (at once, then 1 s).
    server = Supervision.api_server(0)
    server.failed("exited", now=0.0)
    assert server.retry_at == 0.0
    for bad in ("1,-2", "soon", "1,,2", "inf"):
        monkeypatch.setenv("RANKCAST_RESTART_BACKOFF_S", bad)
        with pytest.raises(ValueError, match="RANKCAST_RESTART_BACKOFF_S must be seconds"):
            Supervision.engine(0)
