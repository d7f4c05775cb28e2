//! The engine core's messages (`rankcast/protocol.py`): API server <-> engine core, and engine
//! core <-> ranks. Every struct is array-like: field order is the contract, fields are appended
//! only at the end, and `PROTOCOL_VERSION` names the contract as a whole.

use crate::notifications::{Notification, NotificationLedgerState};
use crate::sampling::SamplingParams;
use crate::{array_struct, array_union, Dict, Raw, Value};

/// Bumped whenever a message changes shape; the engine refuses a client of another version.
pub const PROTOCOL_VERSION: i64 = 16;

/// Why a request finished (`FinishReason` in Python): "stop", "length", "abort", "error".
pub type FinishReason = String;

array_struct! {
    /// The sampled token's log-probability and rank, and the `top_*` alternatives.
    TokenLogprobs {
        token_id: i64,
        logprob: f64,
        rank: i64,
        top_token_ids: Vec<i64> = Vec::new(),
        top_logprobs: Vec<f64> = Vec::new(),
    }
}

// ---- API server -> engine core ----

array_struct! {
    /// The first message a client sends: the engine answers with `EngineReady`.
    ClientHello tag "hello" {
        protocol_version: i64,
        client_index: i64,
    }
}

array_struct! {
    EngineCoreRequest tag "add" {
        request_id: String,
        prompt_token_ids: Vec<i64>,
        sampling_params: SamplingParams,
        arrival_time: f64 = 0.0,
        client_index: i64 = 0,
        lora_name: Option<String> = None,
        routing_reason: String = String::new(),
        routing_expected_prefix_tokens: i64 = 0,
    }
}

array_struct! {
    AbortRequests tag "abort" {
        request_ids: Vec<String>,
    }
}

array_struct! {
    /// A call of one of the engine's utilities; answered by a `UtilityOutput` with `call_id`.
    UtilityRequest tag "utility" {
        call_id: i64,
        method: String,
        args: Vec<Value> = Vec::new(),
    }
}

array_union! {
    /// Everything a client sends to the engine core.
    EngineCoreInput {
        Hello(ClientHello),
        Add(EngineCoreRequest),
        Abort(AbortRequests),
        Utility(UtilityRequest),
    }
}

// ---- engine core -> API server ----

array_struct! {
    /// One request's progress in one step: its new tokens, and why it finished if it did.
    EngineCoreOutput {
        request_id: String,
        new_token_ids: Vec<i64>,
        new_logprobs: Option<Vec<TokenLogprobs>> = None,
        finish_reason: Option<FinishReason> = None,
        stop_reason: Option<i64> = None,
        num_prompt_tokens: i64 = 0,
        error: Option<String> = None,
        /// The scored prompt (`prompt_logprobs`), on the request's first output with tokens:
        /// one per prompt token after the first (protocol 15).
        prompt_logprobs: Option<Vec<TokenLogprobs>> = None,
    }
}

impl EngineCoreOutput {
    pub fn finished(&self) -> bool {
        self.finish_reason.is_some()
    }
}

array_struct! {
    /// The engine's load as of one step, sent to every client.
    SchedulerStats {
        num_running_reqs: i64 = 0,
        num_waiting_reqs: i64 = 0,
        kv_cache_usage: f64 = 0.0,
        num_preemptions: i64 = 0,
        num_blocks: i64 = 0,
        block_size: i64 = 0,
        notification_gathers: i64 = 0,
        notification_gather_seconds: f64 = 0.0,
        running_lora_adapters: Vec<String> = Vec::new(),
        waiting_lora_adapters: Vec<String> = Vec::new(),
        running_lora_requests: Dict<i64> = Dict::new(),
        waiting_lora_requests: Dict<i64> = Dict::new(),
        lora_requests_changed_at: f64 = 0.0,
        prefix_cache_queries: i64 = 0,
        prefix_cache_hits: i64 = 0,
        kv_cache_committed_bytes: i64 = 0,
        routing_decisions: Dict<i64> = Dict::new(),
        routing_expected_prefix_tokens: i64 = 0,
        routing_hit_prefix_tokens: i64 = 0,
        lora_requests_found: Dict<Dict<i64>> = Dict::new(),
        lora_evictions_undone: Dict<i64> = Dict::new(),
        kv_cache_dtype: String = String::new(),
        /// Speculative decoding since the engine started (vLLM's `vllm:spec_decode_*`):
        /// verifications, tokens drafted, drafts accepted, and accepted by position in the draft.
        spec_decode_num_drafts: i64 = 0,
        spec_decode_num_draft_tokens: i64 = 0,
        spec_decode_num_accepted_tokens: i64 = 0,
        spec_decode_num_accepted_tokens_per_pos: Vec<i64> = Vec::new(),
    }
}

array_struct! {
    /// A utility's answer; a failure carries a machine-readable `error_kind` next to the text.
    UtilityOutput {
        call_id: i64,
        result: Value = Value::Nil,
        error: Option<String> = None,
        error_kind: String = String::new(),
    }
}

array_struct! {
    /// One registered adapter, as `list_loras` and `add_lora` describe it.
    LoRAAdapterInfo {
        name: String,
        path: String,
        id: i64,
        rank: i64,
        bytes: i64,
        tiers: Vec<String> = Vec::new(),
        slot: Option<i64> = None,
        pinned: bool = false,
    }
}

array_struct! {
    /// What one step (or an idle flush) sends a client: its requests' outputs, the engine's
    /// stats, a utility's answer, and the notifications flushed since the last message.
    EngineCoreOutputs tag "outputs" {
        engine_index: i64 = 0,
        outputs: Vec<EngineCoreOutput> = Vec::new(),
        scheduler_stats: Option<SchedulerStats> = None,
        timestamp: f64 = 0.0,
        utility_output: Option<UtilityOutput> = None,
        finished_requests: Option<Vec<String>> = None,
        engine_notifications: Option<Vec<Raw>> = None,
    }
}

// ---- the catch-up snapshot ----

array_struct! {
    RankTier {
        rank: i64,
        tier: String,
    }
}

array_struct! {
    /// Where one adapter is, rank by rank; `pinned_ranks`: the ranks that pinned it (protocol
    /// 12: a rank's pin moves with its own events).
    AdapterResidency {
        name: String,
        id: i64,
        pinned: bool = false,
        ranks: Vec<RankTier> = Vec::new(),
        pinned_ranks: Vec<i64> = Vec::new(),
    }
}

array_struct! {
    LoRAEventCount {
        adapter: String,
        event: String,
        reason: String,
        count: i64,
    }
}

array_struct! {
    LoRALoadTime {
        transition: String,
        seconds: f64,
    }
}

array_struct! {
    /// LoRA residency per rank, lifecycle event counts and load times.
    LoRAState {
        world_size: i64,
        max_loras: i64,
        max_cpu_loras: i64,
        adapters: Vec<AdapterResidency> = Vec::new(),
        events: Vec<LoRAEventCount> = Vec::new(),
        loads: Vec<LoRALoadTime> = Vec::new(),
    }
}

array_struct! {
    KVCacheBlock {
        block_hash: i64,
        parent: Option<i64>,
        token_ids: Vec<i64>,
        lora_id: i64,
    }
}

array_struct! {
    KVCacheState {
        block_size: i64,
        blocks: Vec<KVCacheBlock> = Vec::new(),
    }
}

array_struct! {
    /// The channel's state as of `engine_seq`: a client applies it, then the stream continues
    /// with the notification after it.
    EngineStateSnapshot {
        engine_index: i64 = 0,
        engine_seq: i64 = -1,
        notifications: NotificationLedgerState = NotificationLedgerState {
            totals: Vec::new(),
            dropped: Vec::new(),
            weights_loaded: Vec::new(),
            expert_tokens: Vec::new(),
        },
        lora: Option<LoRAState> = None,
        kv_cache: Option<KVCacheState> = None,
        incarnation: i64 = 0,
    }
}

array_struct! {
    /// The engine's answer to a hello: its geometry and the snapshot, or `error` (a refusal).
    EngineReady tag "ready" {
        protocol_version: i64,
        engine_index: i64 = 0,
        max_model_len: i64 = 0,
        num_blocks: i64 = 0,
        block_size: i64 = 0,
        pid: i64 = 0,
        error: String = String::new(),
        snapshot: Option<EngineStateSnapshot> = None,
    }
}

array_union! {
    /// Everything the engine core sends a client.
    EngineCoreMessage {
        Outputs(EngineCoreOutputs),
        Ready(EngineReady),
    }
}

// ---- engine core <-> ranks ----

array_struct! {
    ScheduledSequence {
        request_id: String,
        token_ids: Vec<i64>,
        start_position: i64,
        block_ids: Vec<i64>,
        sampling_params: Option<SamplingParams> = None,
        lora_slot: i64 = -1,
        sample: bool = true,
        window_block_ids: Option<Vec<i64>> = None,
        /// The last `num_draft_tokens` of `token_ids` are drafts (speculative decoding).
        num_draft_tokens: i64 = 0,
        /// The prompt tokens the step's first rows score, one per row (prompt logprobs).
        prompt_logprob_targets: Option<Vec<i64>> = None,
    }
}

array_struct! {
    LoRAMove {
        action: String,
        adapter_id: i64,
        name: String = String::new(),
        path: String = String::new(),
        slot: i64 = -1,
        tier: String = String::new(),
        reason: String = String::new(),
    }
}

array_struct! {
    SchedulerOutput {
        sequences: Vec<ScheduledSequence>,
        finished_request_ids: Vec<String> = Vec::new(),
        lora_moves: Vec<LoRAMove> = Vec::new(),
    }
}

array_struct! {
    /// A step's scores of one request's prompt tokens, from prompt position `position` on.
    PromptLogprobs {
        request_id: String,
        position: i64,
        logprobs: Vec<TokenLogprobs>,
    }
}

array_struct! {
    /// The output rank's tokens for each sequence that sampled: one, or with drafts the drafts
    /// it accepted and the token sampled after them; `logprobs`, where asked for, one per token.
    ModelRunnerOutput {
        request_ids: Vec<String>,
        sampled_token_ids: Vec<Vec<i64>>,
        logprobs: Option<Vec<Option<Vec<TokenLogprobs>>>> = None,
        /// The step's scored prompt rows, per sequence that asked.
        prompt_logprobs: Option<Vec<PromptLogprobs>> = None,
    }
}

array_struct! {
    /// A rank finished reading an adapter into its host tier (`error` None), or could not.
    AdapterRead {
        adapter_id: i64,
        name: String,
        error: Option<String> = None,
    }
}

array_struct! {
    StepReply {
        output: Option<ModelRunnerOutput> = None,
        notifications: Option<Vec<Notification>> = None,
        adapter_reads: Option<Vec<AdapterRead>> = None,
    }
}

array_struct! {
    WorkerCall {
        call_id: i64,
        method: String,
        args: Vec<Value> = Vec::new(),
        reply_rank: i64 = -1,
    }
}

array_struct! {
    WorkerReply {
        call_id: i64,
        rank: i64,
        result: Value = Value::Nil,
        error: Option<String> = None,
        notifications_pending: bool = false,
    }
}

// ---- the engine core's utilities: each verb's arguments, in the order `UtilityRequest.args`
// carries them (`rankcast/protocol.py`, `Utility`) ----

array_struct! { Ping {} }

array_struct! { GetStats {} }

array_struct! { Snapshot {} }

array_struct! {
    /// A worker-extension method on every rank.
    CollectiveRPC {
        method: String,
        args: Option<Vec<Value>> = None,
        timeout: Option<f64> = None,
    }
}

array_struct! { AddLoRA { name: String, path: String } }

array_struct! { RemoveLoRA { name: String } }

array_struct! { PinLoRA { name: String, pinned: bool = true } }

array_struct! { ListLoRAs {} }

array_struct! { ResetPrefixCache {} }

// ---- the engine core's calls on its ranks: each call's arguments, in `WorkerCall.args` order
// (`rankcast/protocol.py`, `RankCall`) ----

array_struct! {
    CacheBudget {
        budget_bytes: i64,
        full_block_bytes: i64,
        window_block_bytes: i64,
    }
}

array_struct! { NumAvailableBlocks {} }

array_struct! {
    /// A rank's answer to `InitializeCache`: the bytes it committed and what its cache holds.
    CacheAllocated {
        committed_bytes: i64,
        kv_cache_dtype: String,
    }
}

array_struct! { InitializeCache { num_blocks: i64, num_window_blocks: i64 = 0 } }

array_struct! { TakeNotifications {} }

array_struct! { ApplyLoRAMoves { moves: Vec<LoRAMove> } }

array_struct! { ExecuteModel { batch: SchedulerOutput } }
