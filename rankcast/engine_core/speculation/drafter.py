"""Which running requests draft in a step, and how far: proposals from the configured method,
weighed against the measured cost of the wider step.

A drafted token is worth the chance it is accepted: the j-th token of a request's draft yields
a token only if it and every one before it are accepted, rate^j with the request's acceptance
rate so far (blended with the engine's, so a new request starts from what others did). The step
then takes the drafted tokens worth most, as many as raise the expected tokens per second of
the step (`StepCostModel`): none when the step is already compute-bound or the drafts are
rarely right. That is what is meant to keep speculation from making serving slower;
docs/benchmarks.md says how close it comes (at 32 clients, within a few percent either way).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rankcast.config import SpeculativeConfig
from rankcast.engine_core.request import Request
from rankcast.engine_core.speculation.cost_model import StepCostModel
from rankcast.engine_core.speculation.ngram import NgramIndex
from rankcast.engine_core.speculation.suffix import SUFFIX_KEY, SuffixCache

# Pseudo-counts a request's own acceptance is blended with the engine's.
_PRIOR_CHECKS = 4
# A drafted token less likely than this to be kept is never worth a row.
_MIN_GAIN = 0.02
# Drafts must promise at least this much more tokens per second than the step without them:
# step times are measured on a shared machine and acceptance is an estimate, so a promise of
# a few percent is within their error (at 32 clients on the standard workload, where promises
# are that small, speculation measured 0.86-0.96x of off: bench/speculative.py, AMX Xeon).
MIN_PROMISED_SPEEDUP = 1.05


@dataclass
class RequestDrafts:
    """One request's draft source and how its drafts fared."""

    index: NgramIndex
    fed: int = 0  # the request's tokens given to `index` so far
    checked: int = 0  # drafted tokens the model checked (each one up to the first rejected)
    accepted: int = 0

    def feed(self, request: Request) -> None:
        prompt = len(request.prompt_token_ids)
        if self.fed < prompt:
            self.index.extend(request.prompt_token_ids[self.fed :])
            self.fed = prompt
        self.index.extend(request.output_token_ids[self.fed - prompt :])
        self.fed = request.num_tokens


@dataclass
class SpeculationCounters:
    """vLLM's `spec_decode` counters, since the engine started."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)


class Drafter:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.cost = StepCostModel()
        self.counters = SpeculationCounters(accepted_per_position=[0] * config.max_draft_tokens)
        self.requests: dict[str, RequestDrafts] = {}
        self.checked = 0  # drafted tokens checked, engine-wide (the acceptance rate's base)
        # What the cost model decided: steps that had drafts to weigh, and those it widened
        # (benchmarks report the share at each concurrency).
        self.steps_with_proposals = 0
        self.steps_drafted = 0
        # The suffix method's memory of recent requests' outputs (None: ngram).
        self.suffix = (
            SuffixCache(config.suffix_decoding_max_cached_requests)
            if config.method == "suffix"
            else None
        )

    def _state(self, request: Request) -> RequestDrafts:
        state = self.requests.get(request.request_id)
        if state is None:
            if self.config.method == "ngram":
                assert self.config.prompt_lookup_min and self.config.prompt_lookup_max
                index = NgramIndex(self.config.prompt_lookup_min, self.config.prompt_lookup_max)
            else:
                index = NgramIndex(SUFFIX_KEY, self.config.suffix_decoding_max_tree_depth)
            state = self.requests[request.request_id] = RequestDrafts(index)
        state.feed(request)
        return state

    def _propose(self, state: RequestDrafts, limit: int) -> list[int]:
        if self.suffix is None:
            return state.index.propose(limit)
        return self.suffix.propose(state.index, limit, self.config)

    def _rate(self, state: RequestDrafts) -> float:
        engine = (self.counters.accepted_tokens + 1) / (self.checked + 2)
        return (state.accepted + _PRIOR_CHECKS * engine) / (state.checked + _PRIOR_CHECKS)

    def plan(self, decodes: list[Request], step_tokens: int, budget: int) -> dict[str, list[int]]:
        """The drafts of this step's decoding requests (by request id; those not named draft
        nothing), `step_tokens` already in the step and at most `budget` more."""
        base = self.cost.seconds(step_tokens)
        if base is None or budget <= 0:
            return {}  # the first steps measure what a step costs before any is widened
        options: list[tuple[float, str, list[int]]] = []
        for request in decodes:
            limit = min(
                self.config.max_draft_tokens,
                request.max_tokens - len(request.output_token_ids) - 1,
                self.max_model_len - request.num_tokens - 1,
            )
            if limit <= 0:
                continue
            state = self._state(request)
            draft = self._propose(state, limit)
            if not draft:
                continue
            rate = self._rate(state)
            gain = 1.0
            for position in range(len(draft)):
                gain *= rate
                if gain < _MIN_GAIN:
                    break
                options.append((gain, request.request_id, draft[: position + 1]))
        if not options:
            return {}
        self.steps_with_proposals += 1
        # The most likely drafted tokens first (a request's in order: each is less likely
        # than the one before), as many as make the step's expected tokens per second best.
        options.sort(key=lambda option: -option[0])
        produced = float(len(decodes))
        best_rate, best_count = produced / base * MIN_PROMISED_SPEEDUP, 0
        for count, (gain, _, _) in enumerate(options[:budget], start=1):
            produced += gain
            seconds = self.cost.seconds(step_tokens + count)
            assert seconds is not None
            if produced / seconds > best_rate:
                best_rate, best_count = produced / seconds, count
        drafts: dict[str, list[int]] = {}
        for _, request_id, draft in options[:best_count]:
            if len(draft) > len(drafts.get(request_id, ())):
                drafts[request_id] = draft
        self.steps_drafted += bool(drafts)
        return drafts

    def record_step(self, tokens: int, seconds: float) -> None:
        self.cost.record(tokens, seconds)

    def record_verification(self, request: Request, drafted: int, accepted: int) -> None:
        """`drafted` tokens of `request` were checked in a step and `accepted` kept."""
        counters = self.counters
        counters.drafts += 1
        counters.draft_tokens += drafted
        counters.accepted_tokens += accepted
        for position in range(accepted):
            counters.accepted_per_position[position] += 1
        checked = min(drafted, accepted + 1)
        self.checked += checked
        state = self.requests.get(request.request_id)
        if state is not None:
            state.checked += checked
            state.accepted += accepted

    def finish(self, request: Request) -> None:
        """The request is done: its history leaves (and its output joins the suffix cache)."""
        self.requests.pop(request.request_id, None)
        if self.suffix is not None:
            self.suffix.add(request.output_token_ids)
