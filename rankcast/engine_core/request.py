"""A request's state inside the engine core."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from rankcast.protocol import FinishReason, TokenLogprobs
from rankcast.sampling_params import SamplingParams


@dataclass
class GroupBlocks:
    """A request's blocks in one KV-cache group (block_manager.py): its block table, how many
    of them are named in the prefix cache, and how many leading entries it no longer holds (a
    sliding-window group's blocks behind the window, handed back; or skipped by a prefix hit:
    their entries hold the group's null block, which no kernel reads)."""

    block_ids: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0
    num_released: int = 0


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PARKED = enum.auto()  # started, KV kept, out of the batch until its adapter's turn
    FINISHED = enum.auto()


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    eos_token_ids: frozenset[int]
    arrival_time: float = 0.0
    client_index: int = 0
    # The adapter the request names (None: the base model), and the device slot it was given
    # when last admitted (-1 until then; a preempted request may get another one).
    lora_name: str | None = None
    lora_slot: int = -1
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens whose K/V the cache holds: a cached prefix, then the prompt in one or more steps,
    # then one token per step; back to 0 when the request is preempted.
    num_computed_tokens: int = 0
    # The registration of the adapter it runs on (0: the base model): part of every block's
    # prefix-cache name, so no adapter ever reuses another's (or the base model's) K/V.
    lora_id: int = 0
    # Why an API server routed it here and the prefix tokens it expected cached (the
    # scheduler counts both, and the tokens found at its first admission).
    routing_reason: str = ""
    routing_expected_prefix_tokens: int = 0
    routing_hit_counted: bool = False
    # Whether the scheduler counted where this request found its adapter (its first turn).
    adapter_found_counted: bool = False
    # Prefix-cache names of its full blocks (computed once, shared by every KV-cache group).
    block_hashes: list[int] = field(default_factory=list)
    # Its blocks in each KV-cache group: the full-attention layers' (or the only group's)
    # first, then a model's sliding-window layers' where they form a group of their own.
    kv_groups: list[GroupBlocks] = field(default_factory=lambda: [GroupBlocks()])
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None
    num_preemptions: int = 0
    parked_at: int = 0  # the scheduler's step when it was last parked
    # Resumed after waiting too long (adapter_turns.py, PARKED_PATIENCE_TURNS): until this step
    # its adapter keeps the slot against queued requests.
    keeps_slot_until: int = 0
    error: str | None = None  # why the scheduler ended it, if it did
    # This step's drafted tokens (speculative decoding), checked after its newest token.
    draft_token_ids: list[int] = field(default_factory=list)
    # Tokens and logprobs sampled since the last output was sent.
    pending_token_ids: list[int] = field(default_factory=list)
    pending_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # Prompt logprobs (`params.prompt_logprobs`) scored so far, entry i the prompt token at
    # position i + 1's; sent with the request's first output, and then no longer computed.
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs_sent: bool = False

    @property
    def block_ids(self) -> list[int]:
        """Its block table in the first KV-cache group."""
        return self.kv_groups[0].block_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def scores_prompt(self) -> bool:
        """Whether its steps must still score prompt tokens (asked for, not sent yet). Until
        then it takes no prefix-cache hits, as in vLLM: a cached block's positions would have
        no logits to score their tokens with."""
        return self.params.prompt_logprobs is not None and not self.prompt_logprobs_sent

    def prompt_logprob_targets(self, start: int, count: int) -> list[int] | None:
        """The prompt tokens a step over positions [start, start + count) scores (None: none):
        the row at position p scores the token at p + 1, up to the prompt's last token."""
        if not self.scores_prompt:
            return None
        end = min(start + count, len(self.prompt_token_ids) - 1)
        return self.prompt_token_ids[start + 1 : end + 1] if end > start else None

    def add_prompt_logprobs(self, position: int, logprobs: list[TokenLogprobs]) -> None:
        """A step's scores, of the prompt tokens from `position` on. A prompt in chunks comes
        piece after piece; a recompute from the start (after preemption) replaces them."""
        del self.prompt_logprobs[position - 1 :]
        if len(self.prompt_logprobs) != position - 1:
            raise RuntimeError(
                f"request {self.request_id}: prompt logprobs from position {position}, but "
                f"only {len(self.prompt_logprobs)} positions were scored before"
            )
        self.prompt_logprobs.extend(logprobs)

    def take_prompt_logprobs(self) -> list[TokenLogprobs] | None:
        """Every prompt token's scores once all are in (and the request has sampled, so its
        first output goes with them); None before that, and after they were taken once."""
        if not (self.scores_prompt and self.output_token_ids):
            return None
        if len(self.prompt_logprobs) != len(self.prompt_token_ids) - 1:
            return None
        scored, self.prompt_logprobs = self.prompt_logprobs, []
        self.prompt_logprobs_sent = True
        return scored

    def token_slice(self, start: int, count: int) -> list[int]:
        """all_token_ids[start:start + count] without building the whole list (a decode step
        takes one token of a long sequence)."""
        prompt = len(self.prompt_token_ids)
        if start >= prompt:
            return self.output_token_ids[start - prompt : start - prompt + count]
        return self.all_token_ids[start : start + count]

    def append_token(self, token_id: int, logprobs: TokenLogprobs | None) -> None:
        self.output_token_ids.append(token_id)
        self.pending_token_ids.append(token_id)
        if logprobs is not None:
            self.pending_logprobs.append(logprobs)

    def check_stop(self, max_model_len: int) -> bool:
        """Set the finish reason if the newest token ends the request."""
        last = self.output_token_ids[-1]
        if last in self.params.stop_token_ids:
            self.finish_reason, self.stop_reason = FinishReason.STOP, last
        elif not self.params.ignore_eos and last in self.eos_token_ids:
            self.finish_reason = FinishReason.STOP
        elif len(self.output_token_ids) >= self.max_tokens or self.num_tokens >= max_model_len:
            self.finish_reason = FinishReason.LENGTH
        return self.finish_reason is not None
