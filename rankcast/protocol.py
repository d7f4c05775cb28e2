"""Every message that crosses a process boundary, as msgspec structs.

Hot-path structs are `array_like=True, omit_defaults=True`: positional on the wire, so **field
order is a contract** — new fields go at the end with a default, never in between. Messages on a
socket that carries several kinds are tagged unions (the tag is the first array element).
Golden bytes for each live in tests/fixtures/wire/; a second-language client decodes the same.
"""

from __future__ import annotations

import enum
from typing import Any, ClassVar, Generic, TypeVar

import msgspec

from rankcast.channel.events import WorkerNotification
from rankcast.channel.snapshot import EngineStateSnapshot
from rankcast.sampling_params import SamplingParams


class FinishReason(enum.StrEnum):
    """Why a request stopped; the strings are the OpenAI API's."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class TokenLogprobs(msgspec.Struct, array_like=True, omit_defaults=True):
    """Log-probabilities at one generated position: the sampled token and the top-k."""

    token_id: int
    logprob: float
    rank: int
    top_token_ids: list[int] = msgspec.field(default_factory=list)
    top_logprobs: list[float] = msgspec.field(default_factory=list)


# ---- frontend <-> engine core ----


# Bump whenever any struct below changes its field list; peers refuse a mismatch at handshake.
# 7: SamplingParams.structured (an engine that did not know it would ignore the output's shape).
# 8: EngineStateSnapshot.incarnation (which start of a supervised engine core sent it).
# 9: StepReply.adapter_reads (a rank's finished adapter reads, typed: the engine's readiness
#    no longer follows events), SchedulerStats.kv_cache_committed_bytes.
# 12: AdapterResidency.pinned_ranks (the snapshot is the engine view's state, pins per rank).
# 13: SchedulerStats.kv_cache_dtype (an 8-bit KV cache is named on /metrics).
# 14: speculative decoding: ScheduledSequence.num_draft_tokens, ModelRunnerOutput's tokens and
#     logprobs a list per sequence, SchedulerStats.spec_decode_* (vLLM's counters).
# 15: prompt logprobs: SamplingParams.prompt_logprobs, ScheduledSequence.prompt_logprob_targets,
#     ModelRunnerOutput.prompt_logprobs (PromptLogprobs), EngineCoreOutput.prompt_logprobs.
# 16: expert load: NotificationLedgerState.expert_tokens (RankExpertTokens), the totals of the
#     ranks' `rankcast.expert_load` events, for a late API server's expert counters.
PROTOCOL_VERSION = 16


class ClientHello(msgspec.Struct, tag="hello", array_like=True, omit_defaults=True):
    """First message of a frontend on its input socket: who it is and what it speaks."""

    protocol_version: int
    client_index: int


class EngineCoreRequest(msgspec.Struct, tag="add", array_like=True, omit_defaults=True):
    """A tokenized request as the engine core receives it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    client_index: int = 0
    # The LoRA adapter to serve this request with (registered with the engine); None: base.
    lora_name: str | None = None
    # Why the API server chose this engine ("load", "prefix", "adapter", "only"; empty: no
    # choice was made) and the prompt tokens it expected to find cached here: the engine counts
    # both, and what it then found, in its stats, so every API server reports the same.
    routing_reason: str = ""
    routing_expected_prefix_tokens: int = 0


class AbortRequests(msgspec.Struct, tag="abort", array_like=True, omit_defaults=True):
    """Stop these requests (client disconnected, stop string found); unknown ids are ignored."""

    request_ids: list[str]


class UtilityRequest(msgspec.Struct, tag="utility", array_like=True, omit_defaults=True):
    """Call a named engine-core utility on the busy-loop thread; answered to the caller only."""

    call_id: int
    method: str
    args: list[Any] = msgspec.field(default_factory=list)


EngineCoreInput = ClientHello | EngineCoreRequest | AbortRequests | UtilityRequest


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one request produced in one step."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None
    num_prompt_tokens: int = 0
    # Why the engine refused or ended the request (with finish_reason "abort"); None otherwise.
    error: str | None = None
    # The scored prompt (SamplingParams.prompt_logprobs), on the request's first output that
    # carries tokens and no other: one entry per prompt token after the first, in order (the
    # first token has none, so the list is one shorter than the prompt).
    prompt_logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True):
    """Engine-wide load figures that every frontend reports identically."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    num_blocks: int = 0
    block_size: int = 0
    # The notification channel's own cost: gathers (one collective each) and their total time.
    notification_gathers: int = 0
    notification_gather_seconds: float = 0.0
    # Adapters of the requests that run, and of those that wait (what routers read).
    running_lora_adapters: list[str] = msgspec.field(default_factory=list)
    waiting_lora_adapters: list[str] = msgspec.field(default_factory=list)
    # Per adapter, how many requests run on it and how many wait for it.
    running_lora_requests: dict[str, int] = msgspec.field(default_factory=dict)
    waiting_lora_requests: dict[str, int] = msgspec.field(default_factory=dict)
    # Engine clock (unix time) of the last change to those sets: every API server reports the
    # same `vllm:lora_requests_info` value because it is the engine's, not the server's, time.
    lora_requests_changed_at: float = 0.0
    # Prompt tokens looked up in the prefix cache since the engine started, and found there.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # KV-cache memory every rank of the engine committed at start (0: left to first use).
    kv_cache_committed_bytes: int = 0
    # Requests API servers routed here, by reason; of those, the prompt tokens the router
    # expected cached here and the tokens the prefix cache then found.
    routing_decisions: dict[str, int] = msgspec.field(default_factory=dict)
    routing_expected_prefix_tokens: int = 0
    routing_hit_prefix_tokens: int = 0
    # Per adapter: requests that found it in a device slot, the host tier or on disk
    # ({"sql": {"device": 9, "disk": 1}}), and evictions a request then had to undo.
    lora_requests_found: dict[str, dict[str, int]] = msgspec.field(default_factory=dict)
    lora_evictions_undone: dict[str, int] = msgspec.field(default_factory=dict)
    # What the KV cache holds (`--kv-cache-dtype` as the ranks resolved it: "bfloat16", "int8",
    # "fp8_e4m3", ...): vLLM's `cache_dtype` label of `vllm:cache_config_info`.
    kv_cache_dtype: str = ""
    # Speculative decoding since the engine started (vLLM's `vllm:spec_decode_*` counters):
    # verifications run (a request's drafts in one step), tokens drafted, drafts accepted, and
    # of those by position in the draft (index 0: the first drafted token).
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = msgspec.field(default_factory=list)


class ErrorKind(enum.StrEnum):
    """Why a utility call failed, for the caller to act on (an API server maps each kind to an
    HTTP status in one table): the client's doing, or the engine's (`internal`)."""

    BAD_ARGUMENT = "bad_argument"
    UNKNOWN_ADAPTER = "unknown_adapter"
    NO_CAPACITY = "no_capacity"
    ADAPTER_BUSY = "adapter_busy"
    ADAPTER_EXISTS = "adapter_exists"
    UNKNOWN_METHOD = "unknown_method"
    EXTENSION_FAILED = "extension_failed"
    INTERNAL = "internal"


class UtilityOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """The answer to one `UtilityRequest`: a msgpack-able result, or an error message with its
    kind (appended in protocol 6; a peer that does not know a kind treats it as `internal`)."""

    call_id: int
    result: Any = None
    error: str | None = None
    error_kind: str = ""


class LoRAAdapterInfo(msgspec.Struct, array_like=True, omit_defaults=True):
    """One registered adapter as the engine sees it: the reply of `add_lora`, `pin_lora` and
    (one per adapter) `list_loras`. `tiers` are where it is on every rank ("device", "cpu")."""

    name: str
    path: str
    id: int
    rank: int
    bytes: int
    tiers: list[str] = msgspec.field(default_factory=list)
    slot: int | None = None
    pinned: bool = False


class EngineCoreOutputs(msgspec.Struct, tag="outputs", array_like=True, omit_defaults=True):
    """One message from the engine core to a frontend."""

    engine_index: int = 0
    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    utility_output: UtilityOutput | None = None
    finished_requests: list[str] | None = None
    # Each element is one encoded notification (a map with a "type" tag), kept raw so that the
    # engine core encodes it once for every API server and a receiver decodes each on its own.
    engine_notifications: list[msgspec.Raw] | None = None


class EngineReady(msgspec.Struct, tag="ready", array_like=True, omit_defaults=True):
    """The engine core's answer to `ClientHello`; a non-empty `error` refuses the client."""

    protocol_version: int
    engine_index: int = 0
    max_model_len: int = 0
    num_blocks: int = 0
    block_size: int = 0
    pid: int = 0
    error: str = ""
    snapshot: EngineStateSnapshot | None = None


EngineCoreMessage = EngineCoreOutputs | EngineReady


# ---- engine core <-> worker ranks ----


class ScheduledSequence(msgspec.Struct, array_like=True, omit_defaults=True):
    """One sequence's work in a step: `token_ids` at positions `start_position...`, whose K/V
    the step computes after the `start_position` tokens already cached.

    A decode is its single newest token; a prompt may come whole or in chunks over several
    steps, after a prefix the cache already held. A request's first step after admission (new,
    or resumed after preemption) carries the sampling parameters.
    """

    request_id: str
    token_ids: list[int]
    start_position: int
    block_ids: list[int]
    sampling_params: SamplingParams | None = None
    # The LoRA slot this sequence's tokens use on every rank (-1: the base model).
    lora_slot: int = -1
    # Whether the step reaches the sequence's newest token, so a token is sampled from it;
    # False for a chunk of a prompt that continues in a later step.
    sample: bool = True
    # Its block table in the model's sliding-window group, where the model's windowed layers
    # have a KV-cache group of their own (engine_core/kv_cache_manager.py); None elsewhere.
    window_block_ids: list[int] | None = None
    # The last `num_draft_tokens` of `token_ids` are drafts (speculative decoding): the step
    # samples at each of them as well and keeps the tokens up to the first draft the model
    # disagrees with (worker/verification.py).
    num_draft_tokens: int = 0
    # Prompt logprobs: the prompt tokens that the step's first rows score, one per row (row j,
    # at position start_position + j, scores the token at the next position; the last one may
    # be the first token of the next chunk). The output rank takes these rows' logits too;
    # None (the usual case): no prompt row is scored.
    prompt_logprob_targets: list[int] | None = None


class LoRAMove(msgspec.Struct, array_like=True, omit_defaults=True):
    """One adapter move the engine decided; every rank makes the same ones, in order.

    `action`: "read" (disk -> host tier, before the call returns), "read_async" (the same on
    the rank's own thread: the rank reports the result as a notification), "activate" (host ->
    device `slot`), "evict" (from `tier`, for `reason`), "pin", "unpin".
    """

    action: str
    adapter_id: int
    name: str = ""
    path: str = ""
    slot: int = -1
    tier: str = ""
    reason: str = ""


class SchedulerOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """The batch for one step (decodes and prompt chunks together), the requests every rank
    may forget, and the adapter moves every rank makes before the step runs."""

    sequences: list[ScheduledSequence]
    finished_request_ids: list[str] = msgspec.field(default_factory=list)
    lora_moves: list[LoRAMove] = msgspec.field(default_factory=list)


class PromptLogprobs(msgspec.Struct, array_like=True, omit_defaults=True):
    """A step's scores of one request's prompt tokens (`prompt_logprob_targets`): `logprobs[i]`
    is the token at prompt position `position + i`'s. A prompt in chunks is scored a piece per
    step; the engine concatenates them (a recompute after preemption replaces what it covers)."""

    request_id: str
    position: int
    logprobs: list[TokenLogprobs]


class ModelRunnerOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """The output rank's tokens for each sequence that sampled, in the order of
    `SchedulerOutput.sequences`: one token, or with drafts the drafts it accepted and the token
    sampled after them. `logprobs`, where asked for, one per token. `prompt_logprobs`: the
    step's scored prompt rows, per sequence that asked (None: none did), whether it sampled or
    not."""

    request_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs] | None] | None = None
    prompt_logprobs: list[PromptLogprobs] | None = None


class AdapterRead(msgspec.Struct, array_like=True, omit_defaults=True):
    """A rank finished reading an adapter from disk into its host tier (`error` None), or
    could not (`error` says why). State, not an event: the engine's registry marks the adapter
    ready from these, so a dropped notification can never leave it waiting forever."""

    adapter_id: int
    name: str
    error: str | None = None


class StepReply(msgspec.Struct, array_like=True, omit_defaults=True):
    """Every rank's answer to a step: the output rank's sampled tokens (None from the others)
    and the rank's notifications drained as the step ended (None when its buffer was empty).

    Carrying the events on the reply every rank sends anyway is what keeps a busy channel
    from costing a gather round trip per step (rule 5). `adapter_reads`: the background adapter
    reads this rank finished since its last reply (None: none), which the engine's registry
    acts on; the events about them only report it.
    """

    output: ModelRunnerOutput | None = None
    notifications: list[WorkerNotification] | None = None
    adapter_reads: list[AdapterRead] | None = None


# The `WorkerCall.method` that ends a rank's loop (worker/worker_proc.py) instead of naming a
# method: here, with the call, so the executor sending it need not import the worker (torch).
SHUTDOWN = "__shutdown__"


class WorkerCall(msgspec.Struct, array_like=True, omit_defaults=True):
    """One collective RPC as each worker process receives it.

    `method` names a Worker method, or `module:qualname` of a function called with the worker.
    `reply_rank` -1 asks every rank to answer; otherwise only that rank does.
    """

    call_id: int
    method: str
    args: list[Any] = msgspec.field(default_factory=list)
    reply_rank: int = -1


class WorkerReply(msgspec.Struct, array_like=True, omit_defaults=True):
    """A rank's answer to the `WorkerCall` with the same `call_id`.

    `notifications_pending` is the doorbell of ranks that share no memory with the engine core
    (Ray actors on other machines): the rank's notification buffer is not empty.
    """

    call_id: int
    rank: int
    result: Any = None
    error: str | None = None
    notifications_pending: bool = False


# ---- the engine core's utilities: one request struct per verb, with its reply type ----
#
# On the wire a utility is a `UtilityRequest(call_id, METHOD, [its fields, in order])`, so the
# bytes are those of a named call with positional arguments (what the Rust client sends too);
# here each verb is a struct a client builds and the engine core's table dispatches on, with
# the reply type every client converts the result to. Adding a verb: its struct here, its
# handler in the engine core's table (`EngineCore.utility_handlers`), its test.

R = TypeVar("R")


class Verb(msgspec.Struct, Generic[R], array_like=True):
    """One call of one process on another, as a struct: `METHOD` names it on the wire, its
    fields are the call's positional arguments in order, `REPLY` is the type of its answer.
    The kinds: `Utility` (a client on an engine core), `RankCall` (an engine core on a rank)."""

    METHOD: ClassVar[str] = ""
    REPLY: ClassVar[Any] = None

    def wire_args(self) -> list[Any]:
        """The arguments as the wire carries them."""
        return list(msgspec.structs.astuple(self))

    def reply(self, result: Any) -> R:
        """The answer as `REPLY` (over a socket a struct arrives as plain data)."""
        if self.REPLY is None:
            return None  # type: ignore[return-value]
        return msgspec.convert(result, self.REPLY)  # type: ignore[no-any-return]


class Utility(Verb[R], array_like=True):
    """A call any client may make to an engine core, answered to that client only.
    `CHANGES_PRODUCERS`: it can change what a producer publishes, so the engine gathers every
    rank after it (rule 5 of the notification channel)."""

    CHANGES_PRODUCERS: ClassVar[bool] = False

    def to_request(self, call_id: int) -> UtilityRequest:
        return UtilityRequest(call_id, self.METHOD, self.wire_args())


class Ping(Utility[str], array_like=True):
    METHOD = "ping"
    REPLY = str


class GetStats(Utility[SchedulerStats], array_like=True):
    METHOD = "get_stats"
    REPLY = SchedulerStats


class Snapshot(Utility[EngineStateSnapshot], array_like=True):
    """The catch-up snapshot as of the last flushed event (rule 8)."""

    METHOD = "snapshot"
    REPLY = EngineStateSnapshot


class CollectiveRPC(Utility[list[Any]], array_like=True):
    """A worker-extension method on every rank; replies in rank order."""

    METHOD = "collective_rpc"
    REPLY = list[Any]
    CHANGES_PRODUCERS = True
    method: str
    args: list[Any] | None = None
    timeout: float | None = None


class AddLoRA(Utility[LoRAAdapterInfo], array_like=True):
    METHOD = "add_lora"
    REPLY = LoRAAdapterInfo
    CHANGES_PRODUCERS = True
    name: str
    path: str


class RemoveLoRA(Utility[None], array_like=True):
    METHOD = "remove_lora"
    REPLY = None
    CHANGES_PRODUCERS = True
    name: str


class PinLoRA(Utility[LoRAAdapterInfo], array_like=True):
    METHOD = "pin_lora"
    REPLY = LoRAAdapterInfo
    CHANGES_PRODUCERS = True
    name: str
    pinned: bool = True


class ListLoRAs(Utility[list[LoRAAdapterInfo]], array_like=True):
    METHOD = "list_loras"
    REPLY = list[LoRAAdapterInfo]


class ResetPrefixCache(Utility[bool], array_like=True):
    """Forget every cached block (refused, False, while requests hold blocks)."""

    METHOD = "reset_prefix_cache"
    REPLY = bool


# Every utility by its wire name: how the engine core reads a `UtilityRequest`.
UTILITIES: dict[str, type[Utility[Any]]] = {
    cls.METHOD: cls
    for cls in (
        Ping,
        GetStats,
        Snapshot,
        CollectiveRPC,
        AddLoRA,
        RemoveLoRA,
        PinLoRA,
        ListLoRAs,
        ResetPrefixCache,
    )
}


# ---- the engine core's calls on its ranks: one struct per call, with each rank's reply type ----
#
# On the wire a `WorkerCall(call_id, METHOD, [its fields, in order])`; each rank dispatches by
# one table (`Worker.rank_call_handlers`). Worker-extension methods (`collective_rpc`) stay
# calls by name: they are the user's, declared by their own signatures.


class RankCall(Verb[R], array_like=True):
    """A call the engine core makes on every rank; `REPLY` is each rank's answer."""


class CacheBudget(msgspec.Struct, array_like=True):
    """A rank's KV-cache budget and what one block of each KV-cache group costs it (0 for a
    group it has no layers of): the engine sizes the pools so every rank's fit."""

    budget_bytes: int
    full_block_bytes: int
    window_block_bytes: int


class NumAvailableBlocks(RankCall[CacheBudget], array_like=True):
    """This rank's KV-cache budget (`CacheBudget`); the engine sizes the pools from every
    rank's."""

    METHOD = "num_available_blocks"
    REPLY = CacheBudget


class CacheAllocated(msgspec.Struct, array_like=True):
    """A rank's KV cache once allocated: the bytes it committed before the first step (0: left
    to first use) and what the cache holds (`--kv-cache-dtype` resolved: "bfloat16", "int8",
    "fp8_e4m3", ...), which only the ranks know (the engine core has no torch)."""

    committed_bytes: int
    kv_cache_dtype: str


class InitializeCache(RankCall[CacheAllocated], array_like=True):
    """Allocate the KV cache, `num_blocks` in the full group's pool and `num_window_blocks` in
    the sliding-window group's (0: the model has no such group)."""

    METHOD = "initialize_cache"
    REPLY = CacheAllocated
    num_blocks: int
    num_window_blocks: int = 0


class TakeNotifications(RankCall["list[WorkerNotification] | None"], array_like=True):
    """Drain the rank's notification buffer (rule 3)."""

    METHOD = "take_notifications"
    REPLY = list[WorkerNotification] | None


class ApplyLoRAMoves(RankCall[None], array_like=True):
    """Make the engine's adapter moves now (a utility's; a step's ride the step)."""

    METHOD = "apply_lora_moves"
    REPLY = None
    moves: list[LoRAMove]


class ExecuteModel(RankCall[StepReply], array_like=True):
    """Run one step; every rank answers with its events, the output rank with its tokens."""

    METHOD = "execute_model"
    REPLY = StepReply
    batch: SchedulerOutput


# Every call the engine core makes on its ranks, by its wire name.
RANK_CALLS: dict[str, type[RankCall[Any]]] = {
    cls.METHOD: cls
    for cls in (
        NumAvailableBlocks,
        InitializeCache,
        TakeNotifications,
        ApplyLoRAMoves,
        ExecuteModel,
    )
}
