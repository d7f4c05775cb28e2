"""The engine view is one state, kept the same way everywhere.

- The golden streams (tests/fixtures/view/) end in the states written beside them (the Rust view
  replays the same files in its own tests).
- Random streams of real event types (loads, activations, evictions from each tier, pins,
  unpins, unloads, failed loads, drops, weight loads, expert loads, well formed or not, KV
  blocks, an engine restart) end in the
  same state in the Python view and the Rust view (`view_replay`, the frontend's own code);
  `tests/dashboard/test_dashboard_view.py` has the page render such states in Chromium.
- A late API server's view, started from the engine's snapshot (`state()`), equals the view of
  one that followed the stream from the start: the catch-up rule, by construction.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rankcast.channel.events import (
    WEIGHTS_LOADED_KEY,
    AnyNotification,
    CustomNotification,
    KVBlocksRemoved,
    KVBlocksStored,
    KVCacheCleared,
    LoRAAdapterActivated,
    LoRAAdapterEvicted,
    LoRAAdapterLoaded,
    LoRAAdapterLoadFailed,
    LoRAAdapterPinned,
    LoRAAdapterUnpinned,
    Notification,
    NotificationsDropped,
)
from rankcast.channel.expert_load import EXPERT_LOAD_KEY
from rankcast.channel.snapshot import EngineStateSnapshot, KVCacheState, LoRAState
from rankcast.channel.view import EngineView
from tests.fixtures.view.generate import CASES, HERE, encode_case, replay
from tests.rust_build import binary

ADAPTERS = [("a", 1), ("b", 2), ("c", 3)]
WORLD = 2


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_golden_stream_ends_in_its_state(name: str) -> None:
    case = msgspec.msgpack.decode((HERE / f"{name}.msgpack").read_bytes(), type=_Case)
    snapshot, events = case.snapshot, list(case.events)
    view = replay(snapshot, events)
    assert view.as_json() == json.loads((HERE / f"{name}.json").read_text())


def test_the_golden_states_are_what_generate_writes() -> None:
    """The files are the generator's output: a rule changed in the view without regenerating
    them (on purpose) fails here, and the Rust replay with it."""
    for name, build in CASES.items():
        snapshot, events = build()
        assert (HERE / f"{name}.msgpack").read_bytes() == encode_case(snapshot, events), name
        assert replay(snapshot, events).as_json() == json.loads((HERE / f"{name}.json").read_text())


def test_the_consumers_once_disagreed_on_evictions_of_a_pinned_adapter() -> None:
    """The rules the page used to break: a host-tier eviction takes the rank's tiers and pin,
    a device eviction keeps the pin and the host tier."""
    view = EngineView(lora=None)
    view.apply_snapshot(EngineStateSnapshot(0, -1, lora=LoRAState(WORLD, 2, 3)))
    for rank in range(WORLD):
        view.apply(
            _on(rank, LoRAAdapterLoaded(adapter_name="a", adapter_id=1, tier="cpu", seconds=0.1))
        )
        view.apply(
            _on(
                rank,
                LoRAAdapterActivated(
                    adapter_name="a", adapter_id=1, tier="device", seconds=0.1, slot=0
                ),
            )
        )
        view.apply(_on(rank, LoRAAdapterPinned(adapter_name="a", adapter_id=1, tier="device")))
    view.apply(
        _on(0, LoRAAdapterEvicted(adapter_name="a", adapter_id=1, tier="cpu", reason="capacity"))
    )
    view.apply(
        _on(1, LoRAAdapterEvicted(adapter_name="a", adapter_id=1, tier="device", reason="lru"))
    )
    ranks = view.as_json()["lora"]["adapters"][0]["ranks"]
    assert ranks == [{"rank": 1, "tiers": ["cpu"], "pinned": True}]


class _Case(msgspec.Struct, array_like=True):
    snapshot: EngineStateSnapshot
    events: list[AnyNotification]


def _on(rank: int, n: Notification, engine: int = 0) -> Notification:
    n.engine_index, n.dp_rank, n.rank = engine, engine, rank
    return n


# ---- random streams of real event types ----

_ranks = st.integers(0, WORLD - 1)
_adapter = st.sampled_from(ADAPTERS)
_seconds = st.sampled_from([0.001, 0.25, 2.0])


def _lora_event(kind: str, adapter: tuple[str, int], rank: int, extra: Any) -> Notification:
    name, adapter_id = adapter
    if kind == "loaded":
        n: Notification = LoRAAdapterLoaded(
            adapter_name=name, adapter_id=adapter_id, tier="cpu", seconds=extra
        )
    elif kind == "activated":
        n = LoRAAdapterActivated(
            adapter_name=name,
            adapter_id=adapter_id,
            tier="device",
            seconds=extra,
            slot=adapter_id % 2,
        )
    elif kind == "pinned":
        n = LoRAAdapterPinned(adapter_name=name, adapter_id=adapter_id, tier="device")
    elif kind == "unpinned":
        n = LoRAAdapterUnpinned(adapter_name=name, adapter_id=adapter_id, tier="device")
    elif kind == "load_failed":
        n = LoRAAdapterLoadFailed(adapter_name=name, adapter_id=adapter_id, error="bad file")
    else:  # an eviction: extra is (tier, reason)
        tier, reason = extra
        n = LoRAAdapterEvicted(adapter_name=name, adapter_id=adapter_id, tier=tier, reason=reason)
    return _on(rank, n)


_evictions = st.tuples(
    st.sampled_from(["device", "cpu", "disk"]),
    st.sampled_from(["lru", "capacity", "unload", "load_failed"]),
)
_lora_events = st.one_of(
    st.builds(_lora_event, st.sampled_from(["loaded", "activated"]), _adapter, _ranks, _seconds),
    st.builds(
        _lora_event,
        st.sampled_from(["pinned", "unpinned", "load_failed"]),
        _adapter,
        _ranks,
        st.none(),
    ),
    st.builds(_lora_event, st.just("evicted"), _adapter, _ranks, _evictions),
)
_blocks = st.lists(st.integers(1, 6), min_size=1, max_size=3, unique=True)
_kv_events = st.one_of(
    st.builds(
        lambda names, root: _on(
            -1,
            KVBlocksStored(
                block_hashes=names,
                parent_block_hash=None if root else 99,
                token_ids=list(range(2 * len(names))),
                block_size=2,
            ),
        ),
        _blocks,
        st.booleans(),
    ),
    st.builds(lambda names: _on(-1, KVBlocksRemoved(block_hashes=names)), _blocks),
    st.just(None).map(lambda _: _on(-1, KVCacheCleared())),
)
_other_events = st.one_of(
    st.builds(
        lambda rank, count: _on(rank, NotificationsDropped(count=count)),
        st.integers(-1, 1),
        st.integers(1, 5),
    ),
    st.builds(
        lambda rank, s: _on(
            rank, CustomNotification(key=WEIGHTS_LOADED_KEY, payload={"bytes": 10, "seconds": s})
        ),
        _ranks,
        _seconds,
    ),
    st.builds(lambda rank: _on(rank, CustomNotification(key="plugin.tick", payload={})), _ranks),
)
# Expert loads: rows of counts for some of four layers; and payloads under the key that are not
# one (every consumer counts them and changes nothing else).
_expert_rows = st.lists(
    st.tuples(st.integers(0, 3), st.lists(st.integers(0, 9), min_size=1, max_size=4)),
    min_size=0,
    max_size=3,
)
_not_expert_loads = st.sampled_from(
    [
        {},
        {"layers": [0], "tokens": [[1, -1]]},
        {"layers": [0], "tokens": [[1, True]]},
        {"layers": [0, 1], "tokens": [[1, 2]]},
        {"layers": [-1], "tokens": [[1]]},
        {"layers": [0], "tokens": [[1.0]]},
        {"layers": "0", "tokens": [[1]]},
        {"layers": [0], "tokens": [2**63]},
        {"layers": [0], "tokens": [[2**63]]},
    ]
)
_expert_events = st.builds(
    lambda rank, payload: _on(rank, CustomNotification(key=EXPERT_LOAD_KEY, payload=payload)),
    _ranks,
    st.one_of(
        _expert_rows.map(
            lambda rows: {
                "layers": [layer for layer, _ in rows],
                "tokens": [tokens for _, tokens in rows],
                "steps": 1,
                "seconds": 0.5,
            }
        ),
        _not_expert_loads,
    ),
)
RESTART = "restart"
_stream = st.lists(
    st.one_of(
        _lora_events, _lora_events, _kv_events, _other_events, _expert_events, st.just(RESTART)
    ),
    max_size=40,
)


def _segments(stream: list[Any]) -> list[tuple[EngineStateSnapshot, list[Notification]]]:
    """The stream cut at each restart: a new incarnation starts from an empty engine's
    snapshot, its engine_seq from 0 again (each segment is what one API server saw)."""
    segments: list[tuple[EngineStateSnapshot, list[Notification]]] = []
    events: list[Notification] = []
    incarnation = 0
    for item in [*stream, RESTART]:
        if item != RESTART:
            item.engine_seq = len(events)
            events.append(msgspec.msgpack.decode(msgspec.msgpack.encode(item), type=type(item)))
            continue
        snapshot = EngineStateSnapshot(
            0, -1, lora=LoRAState(WORLD, 2, 3), kv_cache=KVCacheState(2), incarnation=incarnation
        )
        segments.append((snapshot, events))
        events, incarnation = [], incarnation + 1
    return segments


def _python(cases: list[tuple[EngineStateSnapshot, list[Notification]]]) -> list[dict[str, Any]]:
    return [replay(snapshot, events).as_json() for snapshot, events in cases]


def _rust(cases: list[tuple[EngineStateSnapshot, list[Notification]]]) -> list[dict[str, Any]]:
    """The Rust API server's own view code, fed the same bytes, one JSON state per case."""
    raws = [[s, [msgspec.Raw(msgspec.msgpack.encode(n)) for n in ev]] for s, ev in cases]
    run = subprocess.run(
        [str(binary("view_replay"))],
        input=msgspec.msgpack.encode(raws),
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 0, run.stderr.decode()
    return [json.loads(line) for line in run.stdout.decode().splitlines()]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_stream)
def test_python_and_rust_views_and_a_late_view_end_in_the_same_state(stream: list[Any]) -> None:
    """Each incarnation's stream replayed into the Python view and into the Rust view (the
    frontend's own code, fed the same bytes) must end in identical states; and a late API
    server's view, started from the first one's snapshot, equals it too."""
    segments = _segments(stream)
    python, rust = _python(segments), _rust(segments)
    for (snapshot, events), p, r in zip(segments, python, rust, strict=True):
        assert r == p, events
        early = replay(snapshot, events)
        late = EngineView()
        state = msgspec.msgpack.encode(early.state())
        late.apply_snapshot(msgspec.msgpack.decode(state, type=EngineStateSnapshot))
        assert late.as_json() == p


def test_the_golden_cases_end_in_the_same_state_in_rust() -> None:
    cases = [build() for build in CASES.values()]
    assert _rust(cases) == _python(cases)


# A strategy the page's render test draws states from (tests/dashboard/test_dashboard_view.py).
view_states = _stream.map(lambda stream: _python(_segments(stream))[-1])
