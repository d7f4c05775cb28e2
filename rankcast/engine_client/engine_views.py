"""Every engine as this API server sees it: one `EngineView` per engine core
(`rankcast/channel/view.py`), and the questions asked across them.

The output loop is the only writer: each engine's catch-up snapshot (at connection and at every
new incarnation), its notifications and its stats. Everything else reads: the router (KV index,
adapter tier and id), serving (`check_model`: adapter names and the pinned-slot refusal),
`/v1/lora_adapters`, `/v1/engine_views`, `/v1/events` (incarnation) and the metric collectors,
which only render. Nothing here counts an event a second time.
"""

from __future__ import annotations

import collections
from typing import Any

from rankcast.channel.events import Notification
from rankcast.channel.snapshot import EngineStateSnapshot
from rankcast.channel.view import EngineView, add_counts, ordered_tiers
from rankcast.protocol import SchedulerStats


class EngineViews:
    """One view per engine core, in engine order, plus what earlier incarnations counted."""

    def __init__(self, num_engines: int) -> None:
        self.views = [EngineView(engine) for engine in range(num_engines)]
        # Per engine, the event totals of its earlier incarnations: a restarted engine counts
        # from zero again, and a counter never goes back.
        self.earlier: list[EngineTotals] = [EngineTotals() for _ in range(num_engines)]

    def __getitem__(self, engine: int) -> EngineView:
        return self.views[engine]

    def __len__(self) -> int:
        return len(self.views)

    # ---- the writer: the output loop ----

    def apply_snapshot(self, snapshot: EngineStateSnapshot) -> None:
        view = self.views[snapshot.engine_index]
        if snapshot.incarnation != view.incarnation:
            self.earlier[snapshot.engine_index].add(view)
        view.apply_snapshot(snapshot)

    def consume(self, engine: int, notifications: list[Notification], unknown: list[str]) -> None:
        """One batch from `engine`: each event to the view of the engine that gathered it."""
        for n in notifications:
            index = n.engine_index if 0 <= n.engine_index < len(self.views) else engine
            self.views[index].apply(n)
        for type_name in unknown:
            self.views[engine].apply_unknown(type_name)

    def record_stats(self, engine: int, stats: SchedulerStats) -> None:
        self.views[engine].record_requests(
            stats.running_lora_requests,
            stats.waiting_lora_requests,
            stats.lora_requests_changed_at,
        )

    # ---- readers ----

    @property
    def max_loras(self) -> int:
        """Device slots per rank (0: no engine serves adapters)."""
        return max((v.lora.max_loras for v in self.views if v.lora is not None), default=0)

    def serves_adapters(self) -> bool:
        return any(v.lora is not None for v in self.views)

    def adapter_names(self) -> list[str]:
        """Adapters some engine has registered, in name order (servable by name)."""
        return sorted({name for view in self.views for name in view.adapters})

    def refusal(self, name: str) -> str | None:
        """Why a request on `name` could not run on any engine until someone unpins: on each
        engine that has it, every device slot holds another pinned adapter. None: it can run.
        (The engine core checks the same at submission; this gives the client a 400.)"""
        blocked: list[str] = []
        for view in self.views:
            if name not in view.adapters or view.lora is None:
                continue
            pinned = [other for other in view.pinned_in_device() if other != name]
            if len(pinned) < view.lora.max_loras:
                return None
            blocked = pinned
        if not blocked:
            return None
        return (
            f"every device slot (--max-loras {self.max_loras}) holds a pinned adapter "
            f"({', '.join(blocked)}); unpin one to serve {name!r}"
        )

    def running_adapters(self) -> list[str]:
        return sorted({a for view in self.views for a in view.running})

    def waiting_adapters(self) -> list[str]:
        return sorted({a for view in self.views for a in view.waiting})

    @property
    def requests_changed_at(self) -> float:
        """When some engine's running or waiting adapter set last changed (engine clock)."""
        return max((view.requests_changed_at for view in self.views), default=0.0)

    def describe_adapters(self) -> list[dict[str, Any]]:
        """`/v1/lora_adapters`: per adapter its tiers, whether pinned, residency per engine and
        rank, request counts, and `partial` when the ranks of one engine disagree."""
        out = []
        for name in self.adapter_names():
            engines, tiers, pinned, partial = [], set[str](), False, False
            for view in self.views:
                adapter = view.adapters.get(name)
                if adapter is None:
                    continue
                partial = partial or view.partial(name)
                tiers.update(*adapter.ranks.values())
                pinned = pinned or bool(adapter.pinned)
                ranks = [
                    {
                        "rank": rank,
                        "tiers": ordered_tiers(held),
                        "pinned": rank in adapter.pinned,
                    }
                    for rank, held in sorted(adapter.ranks.items())
                ]
                engines.append({"engine": view.engine_index, "ranks": ranks})
            out.append(
                {
                    "name": name,
                    "tiers": ordered_tiers(tiers),
                    "pinned": pinned,
                    "partial": partial,
                    "running_requests": sum(v.running.get(name, 0) for v in self.views),
                    "waiting_requests": sum(v.waiting.get(name, 0) for v in self.views),
                    "engines": engines,
                }
            )
        return out

    def expert_tokens(self, engine: int) -> dict[tuple[int, int], list[int]]:
        """Tokens per expert of each (rank, layer) of `engine`, its earlier incarnations
        included (what its expert counters show: they never go back)."""
        out = {key: list(tokens) for key, tokens in self.earlier[engine].expert_tokens.items()}
        for key, tokens in self.views[engine].expert_tokens.items():
            add_counts(out.setdefault(key, []), tokens)
        return out

    def as_json(self) -> list[dict[str, Any]]:
        """`/v1/engine_views`: every engine's view, in engine order."""
        return [view.as_json() for view in self.views]


class EngineTotals:
    """What an engine's earlier incarnations counted, added under its current view's counts."""

    def __init__(self) -> None:
        self.totals: collections.Counter[tuple[str, str]] = collections.Counter()
        self.skipped: collections.Counter[str] = collections.Counter()
        self.dropped: collections.Counter[int] = collections.Counter()
        self.lora_events: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self.expert_tokens: dict[tuple[int, int], list[int]] = {}

    def add(self, view: EngineView) -> None:
        self.totals.update(view.totals)
        self.skipped.update(view.skipped)
        self.dropped.update(view.dropped)
        self.lora_events.update(view.lora_events)
        for key, tokens in view.expert_tokens.items():
            add_counts(self.expert_tokens.setdefault(key, []), tokens)
