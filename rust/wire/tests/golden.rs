//! The Rust mirror against the Python side's own bytes: every golden fixture (written by the
//! real producers, `tests/fixtures/wire/generate.py`) decodes, means what it says, and encodes
//! back byte for byte; the struct declarations match the Python schema line for line.

use std::fs;
use std::path::PathBuf;

use rankcast_wire::notifications::Notification;
use rankcast_wire::protocol::{
    ClientHello, EngineCoreInput, EngineCoreMessage, EngineReady, PROTOCOL_VERSION,
};
use rankcast_wire::{from_bytes, schema, to_bytes, Value, Wire};

fn fixtures_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/wire")
}

fn fixture(name: &str) -> Vec<u8> {
    fs::read(fixtures_dir().join(format!("{name}.msgpack")))
        .unwrap_or_else(|e| panic!("fixture {name}: {e}"))
}

fn fixture_names() -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(fixtures_dir())
        .expect("the fixtures directory")
        .filter_map(|entry| {
            let name = entry.ok()?.file_name().into_string().ok()?;
            name.strip_suffix(".msgpack").map(str::to_string)
        })
        .collect();
    names.sort();
    names
}

fn input(name: &str) -> EngineCoreInput {
    from_bytes(&fixture(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn output(name: &str) -> EngineCoreMessage {
    from_bytes(&fixture(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

#[test]
fn the_declarations_match_the_python_schema() {
    let text = fs::read_to_string(fixtures_dir().join("schema.txt")).expect("schema.txt");
    let python: Vec<&str> = text.lines().collect();
    let rust = schema();
    for (p, r) in python.iter().zip(&rust) {
        assert_eq!(
            p, r,
            "the Rust mirror differs from protocol.py: update rust/wire"
        );
    }
    assert_eq!(python.len(), rust.len(), "a struct is missing on one side");
}

#[test]
fn every_fixture_reencodes_byte_for_byte() {
    let names = fixture_names();
    assert!(names.len() >= 10, "fixtures not found: {names:?}");
    for name in names {
        let bytes = fixture(&name);
        let again = if name.starts_with("input_") {
            to_bytes(&input(&name))
        } else {
            to_bytes(&output(&name))
        };
        assert_eq!(again, bytes, "{name} re-encodes differently");
    }
}

#[test]
fn every_forwarded_notification_decodes_as_its_type_and_reencodes() {
    for name in fixture_names().iter().filter(|n| n.starts_with("output_")) {
        let EngineCoreMessage::Outputs(outputs) = output(name) else {
            continue;
        };
        for raw in outputs.engine_notifications.unwrap_or_default() {
            let n: Notification = raw.decode_as().expect("a notification");
            assert!(!matches!(n, Notification::Unknown(_)), "{name}: {n:?}");
            assert_eq!(to_bytes(&n), raw.0, "{name}: {}", n.type_name());
        }
    }
}

#[test]
fn the_fixtures_mean_what_the_python_side_wrote() {
    let EngineCoreInput::Hello(hello) = input("input_client_hello") else {
        panic!()
    };
    assert_eq!(
        hello,
        ClientHello {
            protocol_version: PROTOCOL_VERSION,
            client_index: 1
        }
    );

    let EngineCoreInput::Add(add) = input("input_add_request") else {
        panic!()
    };
    assert_eq!(add.request_id, "chatcmpl-1");
    assert_eq!(add.prompt_token_ids, vec![1, 9690, 28, 2]);
    assert_eq!(add.sampling_params.temperature, 0.7);
    assert_eq!(add.sampling_params.max_tokens, Some(32));
    assert_eq!(add.sampling_params.stop, vec!["\n\n".to_string()]);
    assert_eq!(add.sampling_params.seed, Some(42));
    assert_eq!(add.sampling_params.prompt_logprobs, Some(2));
    assert_eq!(
        add.sampling_params.top_k, 0,
        "a default left out of the map"
    );
    assert_eq!(add.client_index, 1);

    let EngineCoreInput::Add(add) = input("input_add_request_structured") else {
        panic!()
    };
    let shape = add.sampling_params.structured.expect("a structured output");
    let schema = shape.json.expect("a JSON schema");
    assert_eq!(
        schema.get("required"),
        Some(&Value::Array(vec![Value::Str("city".into())]))
    );

    let EngineCoreInput::Abort(abort) = input("input_abort") else {
        panic!()
    };
    assert_eq!(abort.request_ids, vec!["chatcmpl-1", "cmpl-2"]);

    let EngineCoreMessage::Ready(ready) = output("output_ready") else {
        panic!()
    };
    assert_eq!(
        (ready.protocol_version, ready.num_blocks, ready.pid),
        (PROTOCOL_VERSION, 5825, 4242)
    );
    let snapshot = ready.snapshot.expect("a snapshot");
    assert_eq!(snapshot.incarnation, 2);
    let lora = snapshot.lora.expect("a LoRA section");
    let names: Vec<&str> = lora.adapters.iter().map(|a| a.name.as_str()).collect();
    assert_eq!(names, ["chat", "sql"]);
    assert!(lora.adapters[1].pinned);
    assert_eq!(lora.adapters[1].pinned_ranks, vec![0, 1]);
    assert!(lora.adapters[0].pinned_ranks.is_empty());
    assert_eq!(
        snapshot.kv_cache.expect("a KV section").blocks[0].block_hash,
        7301
    );
    assert_eq!(snapshot.notifications.weights_loaded[0].rank, 1);
    // Protocol 16: rank 1's tokens per expert of its MoE layers 0 and 2.
    let experts = &snapshot.notifications.expert_tokens;
    let rows: Vec<(i64, i64, &[i64])> = experts
        .iter()
        .map(|e| (e.rank, e.layer, e.tokens.as_slice()))
        .collect();
    assert_eq!(rows, [(1, 0, &[3, 1, 0, 4][..]), (1, 2, &[2, 2, 3, 1][..])]);

    let EngineCoreMessage::Outputs(step) = output("output_step") else {
        panic!()
    };
    assert_eq!(step.outputs[1].finish_reason.as_deref(), Some("stop"));
    assert_eq!(
        (
            step.outputs[1].stop_reason,
            step.outputs[1].num_prompt_tokens
        ),
        (None, 5)
    );
    let logprobs = step.outputs[1].new_logprobs.as_ref().expect("logprobs");
    assert_eq!(logprobs[0].top_logprobs, vec![-0.25, -1.5]);
    // The first output of a request that asked for prompt logprobs: one per prompt token but
    // the first.
    let prompt = step.outputs[0]
        .prompt_logprobs
        .as_ref()
        .expect("prompt logprobs");
    let scored: Vec<(i64, i64)> = prompt.iter().map(|lp| (lp.token_id, lp.rank)).collect();
    assert_eq!(scored, vec![(9690, 3), (28, 1), (2, 12)]);
    assert_eq!(prompt[0].top_token_ids, vec![28, 2]);
    assert!(step.outputs[1].prompt_logprobs.is_none());
    let stats = step.scheduler_stats.expect("stats");
    assert_eq!(stats.running_lora_requests.get("sql"), Some(&2));
    assert_eq!(stats.prefix_cache_hits, 1088);
    assert_eq!(stats.kv_cache_dtype, "int8");
    assert_eq!(
        (
            stats.spec_decode_num_drafts,
            stats.spec_decode_num_draft_tokens,
            stats.spec_decode_num_accepted_tokens
        ),
        (6, 18, 11)
    );
    assert_eq!(stats.spec_decode_num_accepted_tokens_per_pos, vec![5, 4, 2]);

    let EngineCoreMessage::Outputs(error) = output("output_utility_error") else {
        panic!()
    };
    let utility = error.utility_output.expect("a utility output");
    assert_eq!(utility.error_kind, "unknown_adapter");
}

/// Append `extra` to the top-level array of an encoded message (a newer peer's trailing field).
fn with_trailing_field(bytes: &[u8], extra: &Value) -> Vec<u8> {
    let mut rd = bytes;
    let items = match Value::decode(&mut rd).expect("a message") {
        Value::Array(items) => items,
        other => panic!("not an array: {other:?}"),
    };
    let mut longer = items;
    longer.push(extra.clone());
    to_bytes(&Value::Array(longer))
}

#[test]
fn a_newer_peers_trailing_fields_are_skipped() {
    for name in ["input_client_hello", "input_add_request", "input_abort"] {
        let newer = with_trailing_field(&fixture(name), &Value::Str("from the future".into()));
        let decoded: EngineCoreInput = from_bytes(&newer).expect(name);
        assert_eq!(decoded, input(name), "{name}");
    }
    let newer = with_trailing_field(&fixture("output_ready"), &Value::Int(7));
    assert_eq!(
        from_bytes::<EngineCoreMessage>(&newer).expect("ready"),
        output("output_ready")
    );
}

#[test]
fn an_older_peers_missing_trailing_fields_take_their_defaults() {
    let short = to_bytes(&Value::Array(vec![
        Value::Str("ready".into()),
        Value::Int(7),
    ]));
    let EngineCoreMessage::Ready(ready) = from_bytes(&short).expect("a short ready") else {
        panic!()
    };
    assert_eq!(ready.protocol_version, 7);
    assert_eq!(
        ready,
        EngineReady {
            protocol_version: 7,
            engine_index: 0,
            max_model_len: 0,
            num_blocks: 0,
            block_size: 0,
            pid: 0,
            error: String::new(),
            snapshot: None
        }
    );
    // A required field cannot be left out.
    let bad = to_bytes(&Value::Array(vec![
        Value::Str("hello".into()),
        Value::Int(8),
    ]));
    let err = from_bytes::<EngineCoreInput>(&bad).expect_err("client_index is required");
    assert!(err.0.contains("client_index"), "{err}");
}

#[test]
fn an_unknown_notification_type_is_kept_not_refused() {
    let newer = Value::Map(vec![
        (Value::Str("type".into()), Value::Str("gpu_thermal".into())),
        (Value::Str("celsius".into()), Value::Int(91)),
    ]);
    let n: Notification = from_bytes(&to_bytes(&newer)).expect("decodes");
    assert_eq!(n.type_name(), "gpu_thermal");
    assert_eq!(to_bytes(&n), to_bytes(&newer));
}

#[test]
fn a_notification_with_a_field_this_side_does_not_know_decodes() {
    let newer = Value::Map(vec![
        (
            Value::Str("type".into()),
            Value::Str("notifications_dropped".into()),
        ),
        (Value::Str("count".into()), Value::Int(3)),
        (
            Value::Str("cause".into()),
            Value::Str("a newer field".into()),
        ),
    ]);
    let Notification::Dropped(n) = from_bytes(&to_bytes(&newer)).expect("decodes") else {
        panic!()
    };
    assert_eq!((n.count, n.rank), (3, -1));
}

#[test]
fn a_rank_output_carries_a_list_of_tokens_per_sequence_and_the_scored_prompts() {
    use rankcast_wire::protocol::{ModelRunnerOutput, PromptLogprobs, TokenLogprobs};
    let scored = |token_id, logprob| TokenLogprobs {
        token_id,
        logprob,
        rank: 1,
        top_token_ids: Vec::new(),
        top_logprobs: Vec::new(),
    };
    let output = ModelRunnerOutput {
        request_ids: vec!["a".into(), "b".into()],
        sampled_token_ids: vec![vec![7], vec![30, 31, 2]],
        logprobs: Some(vec![None, Some(vec![scored(30, -0.25)])]),
        // "c" is a prompt chunk that samples nothing yet: its rows are scored all the same.
        prompt_logprobs: Some(vec![PromptLogprobs {
            request_id: "c".into(),
            position: 17,
            logprobs: vec![scored(5, -0.5)],
        }]),
    };
    let ints = |v: &[i128]| Value::Array(v.iter().map(|i| Value::Int(*i)).collect());
    let token = |id: i128, logprob: f64| {
        Value::Array(vec![
            Value::Int(id),
            Value::Float(logprob),
            Value::Int(1),
            Value::Array(Vec::new()),
            Value::Array(Vec::new()),
        ])
    };
    let want = Value::Array(vec![
        Value::Array(vec![Value::Str("a".into()), Value::Str("b".into())]),
        Value::Array(vec![ints(&[7]), ints(&[30, 31, 2])]),
        Value::Array(vec![Value::Nil, Value::Array(vec![token(30, -0.25)])]),
        Value::Array(vec![Value::Array(vec![
            Value::Str("c".into()),
            Value::Int(17),
            Value::Array(vec![token(5, -0.5)]),
        ])]),
    ]);
    assert_eq!(to_bytes(&output), to_bytes(&want));
    assert_eq!(
        from_bytes::<ModelRunnerOutput>(&to_bytes(&want)),
        Ok(output)
    );
}
