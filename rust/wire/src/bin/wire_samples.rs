//! Writes messages built by the Rust side into a directory, one `<name>.msgpack` each, for the
//! Python side to decode (tests/test_wire_rust.py): the other direction of the golden fixtures.
//!
//!     wire-samples <directory>

use std::path::PathBuf;

use rankcast_wire::notifications::{CustomNotification, LoRAAdapterEvicted, Notification};
use rankcast_wire::protocol::*;
use rankcast_wire::sampling::{SamplingParams, StructuredOutputs};
use rankcast_wire::{to_bytes, Dict, Raw, Value, Wire};

fn stamped_custom() -> CustomNotification {
    CustomNotification {
        key: "rust.frontend_started".into(),
        payload: Dict(vec![
            ("pid".into(), Value::Int(4321)),
            ("note".into(), Value::Str("héllo ✓".into())),
        ]),
        seq: 3,
        timestamp: 1700000002.5,
        engine_seq: 11,
        engine_index: 0,
        dp_rank: 0,
        pp_rank: 0,
        tp_rank: 2,
        rank: 2,
    }
}

fn samples() -> Vec<(&'static str, Vec<u8>)> {
    let hello = ClientHello {
        protocol_version: PROTOCOL_VERSION,
        client_index: 2,
    };
    let request = EngineCoreRequest {
        request_id: "rust-1".into(),
        prompt_token_ids: vec![1, 9690, 28, 2, 70000],
        sampling_params: SamplingParams {
            temperature: 0.5,
            top_k: 40,
            seed: Some(-7),
            max_tokens: None,
            stop: vec!["\n\n".into(), "END".into()],
            logprobs: Some(3),
            prompt_logprobs: Some(1),
            structured: Some(StructuredOutputs {
                json: None,
                json_object: false,
                regex: Some("[a-z]+".into()),
                choice: None,
                grammar: None,
            }),
            ..SamplingParams::default()
        },
        arrival_time: 1700000003.25,
        client_index: 2,
        lora_name: Some("sql".into()),
        routing_reason: "prefix".into(),
        routing_expected_prefix_tokens: 32,
    };
    let utility = UtilityRequest {
        call_id: 9,
        method: "add_lora".into(),
        args: vec![
            Value::Str("sql".into()),
            Value::Str("/adapters/sql".into()),
            Value::Map(vec![(Value::Str("pinned".into()), Value::Bool(true))]),
        ],
    };
    let evicted = Notification::LoRAEvicted(LoRAAdapterEvicted {
        adapter_name: "chat".into(),
        adapter_id: 2,
        tier: "device".into(),
        reason: "lru".into(),
        seq: 4,
        timestamp: 0.0,
        engine_seq: 12,
        engine_index: 0,
        dp_rank: 0,
        pp_rank: 0,
        tp_rank: 1,
        rank: 1,
    });
    let outputs = EngineCoreOutputs {
        engine_index: 1,
        outputs: vec![EngineCoreOutput {
            request_id: "rust-1".into(),
            new_token_ids: vec![42, 43],
            new_logprobs: None,
            finish_reason: Some("length".into()),
            stop_reason: None,
            num_prompt_tokens: 5,
            error: None,
            // One per token of its 5-token prompt but the first, with the likeliest there.
            prompt_logprobs: Some(
                [
                    (9690, -2.5, 7),
                    (28, -0.75, 1),
                    (2, -1.25, 2),
                    (70000, -9.5, 4000),
                ]
                .into_iter()
                .map(|(token_id, logprob, rank)| TokenLogprobs {
                    token_id,
                    logprob,
                    rank,
                    top_token_ids: vec![28],
                    top_logprobs: vec![-0.75],
                })
                .collect(),
            ),
        }],
        scheduler_stats: Some(SchedulerStats {
            num_running_reqs: 1,
            num_waiting_reqs: 0,
            kv_cache_usage: 0.25,
            num_preemptions: 0,
            num_blocks: 64,
            block_size: 16,
            notification_gathers: 0,
            notification_gather_seconds: 0.0,
            running_lora_adapters: vec!["sql".into()],
            waiting_lora_adapters: vec![],
            running_lora_requests: Dict(vec![("sql".into(), 1)]),
            waiting_lora_requests: Dict::new(),
            lora_requests_changed_at: 1700000003.0,
            prefix_cache_queries: 16,
            prefix_cache_hits: 8,
            kv_cache_committed_bytes: 1 << 30,
            routing_decisions: Dict(vec![("prefix".into(), 3), ("load".into(), 1)]),
            routing_expected_prefix_tokens: 96,
            routing_hit_prefix_tokens: 80,
            lora_requests_found: Dict(vec![(
                "sql".into(),
                Dict(vec![("device".into(), 5), ("disk".into(), 1)]),
            )]),
            lora_evictions_undone: Dict(vec![("sql".into(), 1)]),
            kv_cache_dtype: "int8".into(),
            spec_decode_num_drafts: 4,
            spec_decode_num_draft_tokens: 12,
            spec_decode_num_accepted_tokens: 7,
            spec_decode_num_accepted_tokens_per_pos: vec![4, 2, 1],
        }),
        timestamp: 1700000003.5,
        utility_output: None,
        finished_requests: Some(vec!["rust-1".into()]),
        engine_notifications: Some(vec![
            Raw::of(&Notification::Custom(stamped_custom())),
            Raw::of(&evicted),
        ]),
    };
    // A newer peer's hello: one trailing field this protocol does not have.
    let mut newer = Vec::new();
    rankcast_wire::codec::write_array_len(&mut newer, 4);
    rankcast_wire::codec::write_str(&mut newer, "hello");
    PROTOCOL_VERSION.encode(&mut newer);
    3i64.encode(&mut newer);
    "a field from the future".to_string().encode(&mut newer);
    vec![
        (
            "input_client_hello",
            to_bytes(&EngineCoreInput::Hello(hello)),
        ),
        (
            "input_add_request",
            to_bytes(&EngineCoreInput::Add(request)),
        ),
        (
            "input_abort",
            to_bytes(&EngineCoreInput::Abort(AbortRequests {
                request_ids: vec!["rust-1".into()],
            })),
        ),
        (
            "input_utility",
            to_bytes(&EngineCoreInput::Utility(utility)),
        ),
        ("input_client_hello_newer", newer),
        (
            "output_step",
            to_bytes(&EngineCoreMessage::Outputs(outputs)),
        ),
    ]
}

fn main() {
    let dir = PathBuf::from(
        std::env::args()
            .nth(1)
            .expect("usage: wire-samples <directory>"),
    );
    std::fs::create_dir_all(&dir).expect("the output directory");
    for (name, bytes) in samples() {
        std::fs::write(dir.join(format!("{name}.msgpack")), bytes).expect("writing a sample");
    }
}
