"""The engine choice of one API server (`EngineRouter`), fed the way the channel feeds it: KV
events as the engine core publishes them, adapter residency as LoRA events build it, load from
stats. Each rule decides a case it should, and nothing else decides it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from rankcast.channel.events import (
    KVBlocksStored,
    KVCacheCleared,
    LoRAAdapterActivated,
    LoRAAdapterLoaded,
    Notification,
)
from rankcast.channel.kv_index import KVCacheIndex, block_hash
from rankcast.channel.view import LoRAShape
from rankcast.engine_client.engine_router import LOAD_COST, EngineRouter
from rankcast.engine_client.engine_views import EngineViews
from rankcast.protocol import SchedulerStats

BS = 16
PREFIX = list(range(100, 100 + 20 * BS))  # 20 blocks: 320 tokens of shared system prompt


def stored(engine: int, tokens: list[int], lora_id: int = 0, lora: str | None = None):
    """The KV event an engine publishes after caching the full blocks of `tokens`."""
    hashes, parent = [], None
    for start in range(0, len(tokens) - BS + 1, BS):
        parent = block_hash(parent, tokens[start : start + BS], lora_id)
        hashes.append(parent)
    full = len(hashes) * BS
    event = KVBlocksStored(
        block_hashes=hashes,
        parent_block_hash=None,
        token_ids=tokens[:full],
        block_size=BS,
        lora_id=lora_id,
        lora_name=lora,
    )
    event.engine_index = engine
    return event


def load(router: EngineRouter, engine: int, running: int, usage: float = 0.1) -> None:
    router.record_stats(
        engine, SchedulerStats(num_running_reqs=running, kv_cache_usage=usage, num_blocks=100)
    )


def router(
    policy: str = "auto", world_size: int = 1, host_places: int | None = None
) -> EngineRouter:
    """A router over two engines' views (each engine `world_size` ranks), both idle."""
    views = EngineViews(2)
    for view in views.views:
        view.lora = LoRAShape(world_size, 1, 4)
    r = EngineRouter(views, policy, BS, host_places)
    load(r, 0, 0)
    load(r, 1, 0)
    return r


def feed(r: EngineRouter, events: list[Notification]) -> None:
    """Events as the API server's output loop applies them: to each engine's view."""
    r.views.consume(0, events, [])


def question(i: int) -> list[int]:
    return [*PREFIX, 7, i, 9]


def test_the_prefix_holder_wins_over_load_and_says_so() -> None:
    r = router()
    feed(r, [stored(1, PREFIX)])
    load(r, 1, 1)  # busier than engine 0: load alone would pick 0
    choice = r.choose([True, True], question(1), None)
    assert (choice.engine, choice.reason, choice.expected_prefix_tokens) == (1, "prefix", 320)


def test_load_holds_back_an_engine_that_holds_every_prefix() -> None:
    r = router()
    feed(r, [stored(1, PREFIX)])
    busy = 320 // LOAD_COST + 1  # enough requests ahead to outweigh the saved prefix
    load(r, 1, busy)
    choice = r.choose([True, True], question(2), None)
    assert (choice.engine, choice.reason) == (0, "load")


def test_load_policy_ignores_the_prefix_and_a_cleared_engine_holds_none() -> None:
    r = router("load")
    feed(r, [stored(1, PREFIX)])
    load(r, 1, 1)
    assert r.choose([True, True], question(3), None).engine == 0
    auto = router()
    feed(auto, [stored(1, PREFIX), KVCacheCleared(engine_index=1)])
    load(auto, 1, 1)
    assert auto.choose([True, True], question(3), None).engine == 0


def test_an_adapter_in_a_device_slot_wins_partial_residency_does_not() -> None:
    r = router(world_size=2)
    for rank in (0, 1):  # engine 1, both ranks: host tier, then a device slot
        for event in (
            LoRAAdapterLoaded(adapter_name="sql", adapter_id=3, tier="cpu", seconds=0.1),
            LoRAAdapterActivated(
                adapter_name="sql", adapter_id=3, tier="device", seconds=0.01, slot=0
            ),
        ):
            event.engine_index, event.rank = 1, rank
            feed(r, [event])
    partial = LoRAAdapterActivated(
        adapter_name="sql", adapter_id=5, tier="device", seconds=0.01, slot=0
    )
    partial.engine_index, partial.rank = 0, 0  # engine 0: rank 0 only
    feed(r, [partial])
    assert (r.views[1].tier_on("sql"), r.views[0].tier_on("sql")) == ("device", None)
    load(r, 1, 1)
    choice = r.choose([True, True], [1, 2, 3], "sql")
    assert (choice.engine, choice.reason) == (1, "adapter")
    assert r.choose([True, True], [1, 2, 3], None).engine == 0, "the base model goes by load"


def test_adapter_blocks_are_found_under_the_adapters_id_on_that_engine() -> None:
    r = router()
    feed(r, [stored(1, PREFIX, lora_id=3, lora="sql")])
    load(r, 1, 1)
    assert r.choose([True, True], question(4), "sql").engine == 1
    assert r.choose([True, True], question(4), None).engine == 0, "not the base model's"


def test_a_dead_engine_is_skipped_and_every_server_chooses_alike() -> None:
    r = router()
    feed(r, [stored(1, PREFIX)])
    assert r.choose([True, False], question(5), None).engine == 0
    servers = [router(), router()]
    for s in servers:
        feed(s, [stored(1, PREFIX)])
    picks = [[s.choose([True, True], [i, i + 1], None).engine for i in range(20)] for s in servers]
    assert picks[0] == picks[1], "same request and state, same choice"
    assert set(picks[0]) == {0, 1}, "unrelated requests spread over the engines"


def tied_choices() -> list[int]:
    """The engine each of 24 requests goes to when both engines hold the prompt's prefix and
    carry the same load: every choice is a tie. Half name an adapter, so a tie broken by
    anything salted per process (`hash()` of a string or bytes, set order, `id()`) differs
    between processes."""
    picks = []
    for i in range(24):
        r = router()
        feed(r, [stored(0, PREFIX), stored(1, PREFIX)])
        picks.append(r.choose([True, True], question(i), f"tenant-{i}" if i % 2 else None).engine)
    return picks


def test_api_servers_in_separate_processes_break_ties_alike_whatever_their_hash_seed() -> None:
    """API servers are separate processes, each with its own hash seed: two routers in one
    process share it, so only separate processes show a tie broken by a salted hash."""
    root = Path(__file__).resolve().parents[2]
    script = "import json; from tests.routing.test_engine_router import tied_choices as c; "
    script += "print(json.dumps(c()))"
    picks = {}
    for seed in ("0", "1", "2"):
        done = subprocess.run(
            [sys.executable, "-c", script],
            cwd=root,
            env=dict(os.environ, PYTHONHASHSEED=seed),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        picks[seed] = json.loads(done.stdout)
    assert picks["0"] == picks["1"] == picks["2"], f"choices differ with the hash seed: {picks}"
    assert set(picks["0"]) == {0, 1}, "tied requests spread over the engines"


def test_an_engine_without_room_for_the_prompt_is_avoided() -> None:
    r = router()
    load(r, 0, 0, usage=0.99)  # 1 free block of 100: no room for a 20-block prompt
    assert r.choose([True, True], question(6), None).engine == 1


def test_a_burst_on_an_adapter_no_engine_has_reported_follows_the_first_request() -> None:
    """Before any engine's events name the adapter's id, the blocks sent are named under a
    provisional id: the second request with the same prefix goes where the first went, even
    though that engine is now busier (the prefix policy alone: under `auto` the adapter just
    sent there would pull it too)."""
    r = router("prefix")
    first = r.choose([True, True], question(1), "sql")
    load(r, first.engine, 2)
    second = r.choose([True, True], question(2), "sql")
    assert (second.engine, second.reason) == (first.engine, "prefix")
    assert second.expected_prefix_tokens == len(PREFIX)
    other = r.choose([True, True], question(3), "sql2")
    assert other.engine != first.engine, "another adapter's blocks are other blocks"


def test_an_adapter_just_sent_to_an_engine_counts_as_loaded_there() -> None:
    r = router()
    first = r.choose([True, True], [1, 2, 3], "sql")
    load(r, first.engine, 3)
    second = r.choose([True, True], [4, 5, 6], "sql")
    assert (second.engine, second.reason) == (first.engine, "adapter")
    assert r.choose([True, True], [4, 5, 6], None).engine != first.engine, "base goes by load"


def test_an_adapter_goes_where_the_host_tier_has_room_for_it() -> None:
    """An engine whose host tier (2 places here) is taken by other adapters' requests in flight
    would hold a request for a third adapter until one of them finished all its requests: the
    request goes to the other engine, though it is busier; an adapter already in flight there
    still goes to it, and so does any adapter once the stats show room."""
    r = router(host_places=2)
    load(r, 0, 0)
    full = SchedulerStats(num_running_reqs=2, num_blocks=100, running_lora_adapters=["a", "b"])
    r.record_stats(0, full)
    load(r, 1, 6)
    choice = r.choose([True, True], [1, 2, 3], "c")
    assert (choice.engine, choice.reason) == (1, "adapter")
    assert r.choose([True, True], [4, 5, 6], "a").engine == 0, "in flight there: no new place"
    r.record_stats(
        0, SchedulerStats(num_running_reqs=1, num_blocks=100, running_lora_adapters=["a"])
    )
    assert r.choose([True, True], [1, 2, 3], "d").engine == 0, "room again"
    # Requests this server just sent count before the engine's stats show them.
    r.record_stats(0, SchedulerStats(num_running_reqs=0, num_blocks=100))
    load(r, 1, 6)
    assert r.choose([True, True], [7], "e").engine == 0
    assert r.choose([True, True], [8], "f").engine == 0
    assert r.choose([True, True], [9], "g").engine == 1, "e and f now fill engine 0's tier"


def test_a_prompt_no_engine_holds_goes_where_fewer_prefixes_are_held() -> None:
    """New content (a tenant's first request) is spread by the distinct prefixes each engine
    holds, not by whichever engine happened to be less busy at that moment."""
    r = router()
    feed(r, [stored(0, PREFIX)])
    assert r.views[0].kv.roots == 1 and r.views[1].kv.roots == 0
    load(r, 1, 2)  # engine 1 is busier by two requests
    other_tenant = [*range(900, 900 + 20 * BS), 7, 1, 9]
    choice = r.choose([True, True], other_tenant, None)
    assert choice.engine == 1, "the engine holding no prefix takes the new one"
    # Sent, not yet reported: it counts there at once, so the next new tenant goes to 0.
    load(r, 0, 2)
    third = [*range(5000, 5000 + 20 * BS), 7, 1, 9]
    assert r.choose([True, True], third, None).engine == 0
    # A prompt some engine holds part of is not new content: the prefix rule decides.
    assert r.choose([True, True], question(3), None).engine == 0


def test_the_index_counts_the_prefixes_it_holds() -> None:
    from rankcast.channel.events import KVBlocksRemoved

    index = KVCacheIndex()
    index.apply(stored(0, PREFIX))
    index.apply(stored(0, PREFIX))  # the same blocks again: still one prefix
    index.apply(stored(0, list(range(7000, 7000 + 2 * BS))))
    assert index.roots == 2
    first = next(name for name, block in index.blocks.items() if block.parent is None)
    index.apply(KVBlocksRemoved(block_hashes=[first]))
    assert index.roots == 1
    index.apply(KVCacheCleared())
    assert (index.roots, index.blocks) == (0, {})
