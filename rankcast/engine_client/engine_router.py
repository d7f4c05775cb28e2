"""Choosing the data-parallel engine core for a request from what the channel delivered.

Every API server receives every engine's KV-cache events and adapter residency through the
notification channel, and every engine's load in its stats. From them it scores each live
engine by the work the request would cost there, in prompt tokens, and sends it to the
cheapest (`--routing-policy`):

    cost = uncached prompt tokens          (prefix, auto: the longest run of the prompt's
                                            blocks in the engine's index, adapter included)
         + ADAPTER_COST[tier]              (adapter, auto: device slot on every rank 0, host
                                            tier 64, otherwise, partial residency included, 512)
         + HOST_FULL_COST                  (adapter, auto: when the engine's host tier is
                                            taken by other adapters of requests in flight)
         + LOAD_COST * requests            (all: waiting + running + sent since its last stats)
         + NO_ROOM_COST                    (when the uncached blocks exceed its free blocks)
         + SPREAD_COST * prefixes held     (prefix, auto, only for a prompt no engine holds
                                            any block of: the distinct prefixes the engine
                                            holds or was just sent)

The last term places new content: the first request of a tenant whose system prompt no engine
holds goes to the engine holding fewer distinct prefixes, so tenants split evenly between the
engines from the start. By load alone they split by whichever engine was less busy at each
first request, which in a burst is chance: measured, 3 tenants on one engine and 5 on the other,
which the load term (a prefix is worth ~30 requests) then never corrects.

Between sending a request and hearing its blocks stored (after its prefill step), the router
counts the blocks it sent to an engine as held there for SPECULATION_S, and its adapter as in a
device slot there: a burst of requests sharing a prefix or an adapter then goes where the first
one went, instead of being spread by load before any of them is cached or loaded. The engine's
own events replace the guess as they arrive. Block names include the engine's id for the
adapter, which a server learns only from that engine's events; until then the blocks it sends
are named under a provisional id derived from the adapter's name (the same on every server).

An engine's host tier holds the adapters of its requests in flight (running, parked or
waiting), so a request for one more adapter where those already fill it (--max-cpu-loras) waits
until one of them has finished every request: seconds on a busy engine. Such an engine costs
HOST_FULL_COST more, more than reading the adapter from disk on another engine (~7 ms): in
bench/routing.py's adapter part on the 2-core Sapphire Rapids, 4 runs each alternated, TTFT p90
522-746 ms against 726-1,015 without it, p99 928-1,539 against 1,579-1,840, disk reads 25-29 per
100 requests against 25-28.

`load` keeps the least-loaded choice with rotating ties. The other policies break ties by a
hash of the request's tokens and adapter, so every API server makes the same choice for the
same request and state. The load term holds back an engine that holds every prefix: each
request it already has costs LOAD_COST, so the other engine takes requests once the first is
LOAD_COST x (its lead in requests) ahead in work saved.
"""

from __future__ import annotations

import hashlib
import time
import typing
from dataclasses import dataclass
from typing import Literal

from rankcast.channel.kv_index import KVCacheIndex, block_names
from rankcast.config import ROUTING_POLICIES
from rankcast.engine_client.engine_views import EngineViews
from rankcast.engine_client.load_balancer import LoadBalancer
from rankcast.protocol import SchedulerStats

RoutingPolicy = Literal["load", "prefix", "adapter", "auto"]
assert set(ROUTING_POLICIES) == set(typing.get_args(RoutingPolicy))

LOAD_COST = 32
ADAPTER_COST = {"device": 0, "cpu": 64, None: 512}
NO_ROOM_COST = 100_000
HOST_FULL_COST = 1024
SPECULATION_S = 10.0
SPREAD_COST = 4 * LOAD_COST


@dataclass(frozen=True)
class Choice:
    engine: int
    # What decided: "load", "prefix" or "adapter" (the term that moved the choice away from
    # the least-loaded engine), "only" with one live engine of several, "" with one engine.
    reason: str
    # Prompt tokens the chosen engine's index said were cached.
    expected_prefix_tokens: int


class EngineRouter:
    """The engine choice of one API server. What each engine holds (KV index, adapter tiers
    and ids) it reads from the engine views; what it keeps is its own: load since the last
    stats, and what it sent each engine that the engine has not yet reported."""

    def __init__(
        self,
        views: EngineViews,
        policy: str = "load",
        block_size: int = 16,
        host_places: int | None = None,
    ) -> None:
        num_engines = len(views)
        self.views = views
        self.policy = policy
        self.host_places = host_places
        self.block_size = block_size
        self.balancer = LoadBalancer(num_engines)
        self.stats: list[SchedulerStats | None] = [None] * num_engines
        # Per engine, the names of blocks this server sent it, and until when they count.
        self.expected: list[dict[int, float]] = [{} for _ in range(num_engines)]
        # Per engine, the adapters this server sent it, and until when they count as loaded.
        self.sent_adapters: list[dict[str, float]] = [{} for _ in range(num_engines)]
        # Per engine, the first block of each prompt this server sent it, and until when.
        self.sent_roots: list[dict[int, float]] = [{} for _ in range(num_engines)]
        # Per engine, the adapters of requests this server sent it since its last stats.
        self.sent_since_stats: list[set[str]] = [set() for _ in range(num_engines)]

    @property
    def uses_prefix(self) -> bool:
        return self.policy in ("prefix", "auto")

    @property
    def uses_adapter(self) -> bool:
        return self.policy in ("adapter", "auto")

    # ---- inputs ----

    def engine_restarted(self, engine: int) -> None:
        """An engine (re)connected: its view started over from its snapshot, and nothing this
        server sent the engine before counts as held there."""
        self.expected[engine] = {}
        self.sent_adapters[engine] = {}
        self.sent_since_stats[engine] = set()
        self.sent_roots[engine] = {}

    def record_stats(self, engine: int, stats: SchedulerStats) -> None:
        self.balancer.record_stats(engine, stats)
        self.stats[engine] = stats
        self.sent_since_stats[engine].clear()

    # ---- the choice ----

    def choose(self, alive: list[bool], prompt: list[int], lora_name: str | None) -> Choice:
        if len(self.views) == 1:  # one engine: nothing to choose, nothing to compute
            if not alive[0]:
                raise LookupError("no live engine core")
            return Choice(0, "", 0)
        if self.policy == "load":
            return Choice(self.balancer.choose(alive), "load", 0)
        live = [engine for engine, up in enumerate(alive) if up]
        if not live:
            raise LookupError("no live engine core")
        if len(live) == 1:
            engine = live[0]
            self.balancer.sent_since_report[engine] += 1
            return Choice(engine, "only", self._prefix(engine, prompt, lora_name))
        terms = {engine: self._terms(engine, prompt, lora_name) for engine in live}
        cost = {engine: sum(t) for engine, t in terms.items()}
        if self.uses_prefix and all(t[0] == len(prompt) for t in terms.values()):
            for engine in live:  # nobody holds any of it: spread new content
                cost[engine] += SPREAD_COST * self._prefixes_held(engine)
        load = {engine: terms[engine][2] for engine in live}
        chosen = self._cheapest(cost, prompt, lora_name)
        by_load = self._cheapest(load, prompt, lora_name)
        reason = "load"
        if chosen != by_load:
            saved_prefix = terms[by_load][0] - terms[chosen][0]
            saved_adapter = terms[by_load][1] - terms[chosen][1]
            reason = "prefix" if saved_prefix >= saved_adapter else "adapter"
        self.balancer.sent_since_report[chosen] += 1
        expected_tokens = self._prefix(chosen, prompt, lora_name)
        self._expect(chosen, prompt, lora_name)
        return Choice(chosen, reason, expected_tokens)

    def _expect(self, engine: int, prompt: list[int], lora_name: str | None) -> None:
        """Count the request's blocks, and its adapter, as held by `engine` until its events
        say what it holds."""
        now = time.monotonic()
        if lora_name is not None and self.uses_adapter:
            self.sent_adapters[engine][lora_name] = now + SPECULATION_S
            self.sent_since_stats[engine].add(lora_name)
        if not self.uses_prefix:
            return
        lora_id = self._lora_id(engine, lora_name)
        if lora_id is None:
            lora_id = provisional_lora_id(lora_name)
        expected, roots = self.expected[engine], self.sent_roots[engine]
        for held in (expected, roots):
            if len(held) > 100_000:  # bounded: drop what expired
                for name in [n for n, until in held.items() if until < now]:
                    del held[name]
        for i, name in enumerate(block_names(prompt[:-1], self.block_size, lora_id)):
            expected[name] = now + SPECULATION_S
            if i == 0:
                roots[name] = now + SPECULATION_S

    def _prefixes_held(self, engine: int) -> int:
        """Distinct prefixes the engine holds (its index's first blocks) or was sent moments
        ago and has not yet reported."""
        now = time.monotonic()
        sent = self.sent_roots[engine]
        for name in [n for n, until in sent.items() if until < now]:
            del sent[name]
        index = self.views[engine].kv
        return index.roots + sum(1 for name in sent if name not in index.blocks)

    def _terms(
        self, engine: int, prompt: list[int], lora_name: str | None
    ) -> tuple[int, int, int, int]:
        """(uncached tokens, adapter cost, load cost, no-room cost) on one engine."""
        cached = self._prefix(engine, prompt, lora_name) if self.uses_prefix else 0
        uncached = len(prompt) - cached
        adapter = 0
        if self.uses_adapter and lora_name is not None:
            tier = self.views[engine].tier_on(lora_name)
            if tier is None and self.sent_adapters[engine].get(lora_name, 0.0) >= time.monotonic():
                tier = "device"  # sent there moments ago: loaded by the time this runs
            adapter = ADAPTER_COST[tier]
            if self._host_full(engine, lora_name):
                adapter += HOST_FULL_COST
        waiting, running = self.balancer.reported[engine]
        requests = waiting + running + self.balancer.sent_since_report[engine]
        room = 0
        stats = self.stats[engine]
        if stats is not None and stats.num_blocks:
            free = int((1.0 - stats.kv_cache_usage) * stats.num_blocks)
            if -(-uncached // self.block_size) > free:
                room = NO_ROOM_COST
        return uncached, adapter, LOAD_COST * requests, room

    def _host_full(self, engine: int, lora_name: str) -> bool:
        """Whether the engine's host tier is taken by other adapters' requests in flight
        (running, parked, waiting, or just sent): a request for one more would wait there until
        one of them has finished all its requests, which on a busy engine takes seconds."""
        stats = self.stats[engine]
        if self.host_places is None or stats is None:
            return False
        in_flight = set(stats.running_lora_adapters) | set(stats.waiting_lora_adapters)
        in_flight |= self.sent_since_stats[engine]
        return lora_name not in in_flight and len(in_flight) >= self.host_places

    def _lora_id(self, engine: int, lora_name: str | None) -> int | None:
        """The engine's id for the adapter (0: the base model; None: not yet seen there)."""
        return 0 if lora_name is None else self.views[engine].adapter_id(lora_name)

    def _prefix(self, engine: int, prompt: list[int], lora_name: str | None) -> int:
        """Tokens of the prompt the engine holds or is expected to hold soon: its index under
        the adapter's id there, or the blocks this server sent it under the adapter's
        provisional id before it learned the real one."""
        live = _Unexpired(self.expected[engine], time.monotonic())
        # Never the last token: the engine computes it to sample from (block_manager.py).
        tokens = prompt[:-1]
        held = 0
        lora_id = self._lora_id(engine, lora_name)
        if lora_id is not None:
            held = self.views[engine].kv.cached_prefix(tokens, self.block_size, lora_id, live)
        if lora_name is not None and self.uses_prefix:
            sent = _NOTHING_CACHED.cached_prefix(
                tokens, self.block_size, provisional_lora_id(lora_name), live
            )
            held = max(held, sent)
        return held

    def _cheapest(self, cost: dict[int, int], prompt: list[int], lora_name: str | None) -> int:
        """The cheapest engine; a tie goes by a hash of the request's tokens and adapter: the
        same on every API server, spread over the tied engines across requests."""
        best = min(cost.values())
        tied = sorted(engine for engine, c in cost.items() if c == best)
        if len(tied) == 1:
            return tied[0]
        key = repr((prompt, lora_name)).encode()
        pick = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
        return tied[pick % len(tied)]


def provisional_lora_id(lora_name: str | None) -> int:
    """A negative id for naming an adapter's blocks before an engine's events gave its real
    one (engines number adapters from 1; 0 is the base model): the same on every server."""
    if lora_name is None:
        return 0
    digest = hashlib.blake2b(lora_name.encode(), digest_size=4).digest()
    return -1 - int.from_bytes(digest, "little")


_NOTHING_CACHED = KVCacheIndex()


class _Unexpired:
    """Block names whose expected arrival has not yet expired (a `Container` for the index)."""

    def __init__(self, expected: dict[int, float], now: float) -> None:
        self.expected = expected
        self.now = now

    def __contains__(self, name: object) -> bool:
        until = self.expected.get(name)  # type: ignore[call-overload]
        return until is not None and until >= self.now
