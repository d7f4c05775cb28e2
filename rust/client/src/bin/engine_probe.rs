//! Connects to an engine core as one more client, prints what it learns, runs one greedy
//! request and prints its tokens: what the Python tests drive to check the Rust client against a
//! real engine core.
//!
//!     engine-probe <input address> <output address> <client index>
//!                  [--protocol-version N] [--prompt 1,2,3] [--max-tokens N] [--utility NAME]
//!
//! Lines on stdout: `ready ...`, `tokens ...`, `finish ...`, `notification <type> <engine_seq>`,
//! `utility ...`. A refused handshake prints `refused: <message>` and exits with status 2.

use std::time::{Duration, Instant};

use rankcast_client::wire::notifications::Notification;
use rankcast_client::wire::protocol::{EngineCoreRequest, PROTOCOL_VERSION};
use rankcast_client::wire::sampling::SamplingParams;
use rankcast_client::{ClientError, EngineCoreClient};

struct Args {
    input: String,
    output: String,
    client_index: i64,
    protocol_version: i64,
    prompt: Vec<i64>,
    max_tokens: i64,
    utility: Option<String>,
}

fn parse() -> Args {
    let mut args = std::env::args().skip(1);
    let usage = "usage: engine-probe <input> <output> <client index> [options]";
    let mut parsed = Args {
        input: args.next().expect(usage),
        output: args.next().expect(usage),
        client_index: args
            .next()
            .expect(usage)
            .parse()
            .expect("client index: an integer"),
        protocol_version: PROTOCOL_VERSION,
        prompt: Vec::new(),
        max_tokens: 8,
        utility: None,
    };
    while let Some(flag) = args.next() {
        let value = args
            .next()
            .unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--protocol-version" => parsed.protocol_version = value.parse().expect("an integer"),
            "--prompt" => {
                parsed.prompt = value
                    .split(',')
                    .map(|t| t.parse().expect("token ids"))
                    .collect()
            }
            "--max-tokens" => parsed.max_tokens = value.parse().expect("an integer"),
            "--utility" => parsed.utility = Some(value),
            other => panic!("unknown option {other}"),
        }
    }
    parsed
}

fn main() {
    let args = parse();
    let timeout = Duration::from_secs(60);
    let mut client = match EngineCoreClient::connect_speaking(
        &args.input,
        &args.output,
        args.client_index,
        timeout,
        args.protocol_version,
    ) {
        Ok(client) => client,
        Err(ClientError::ProtocolMismatch(message)) => {
            println!("refused: {message}");
            std::process::exit(2);
        }
        Err(e) => {
            eprintln!("engine-probe: {e}");
            std::process::exit(1);
        }
    };
    let ready = &client.ready;
    let snapshot = ready
        .snapshot
        .clone()
        .unwrap_or_else(|| panic!("no snapshot in {ready:?}"));
    let weights: Vec<String> = snapshot
        .notifications
        .weights_loaded
        .iter()
        .map(|w| w.rank.to_string())
        .collect();
    println!(
        "ready engine_index={} pid={} num_blocks={} block_size={} max_model_len={} incarnation={} engine_seq={} weights_loaded_ranks={}",
        ready.engine_index,
        ready.pid,
        ready.num_blocks,
        ready.block_size,
        ready.max_model_len,
        snapshot.incarnation,
        snapshot.engine_seq,
        weights.join(","),
    );
    if let Some(method) = &args.utility {
        match client.call_utility(method, Vec::new(), timeout) {
            Ok(value) => println!("utility {method} ok {value:?}"),
            Err(ClientError::Utility { message, kind }) => {
                println!("utility {method} error {kind} {message}")
            }
            Err(e) => panic!("utility {method}: {e}"),
        }
    }
    if args.prompt.is_empty() {
        return;
    }
    let request_id = format!("rust-probe-{}", std::process::id());
    client
        .add_request(EngineCoreRequest {
            request_id: request_id.clone(),
            prompt_token_ids: args.prompt.clone(),
            sampling_params: SamplingParams {
                temperature: 0.0,
                max_tokens: Some(args.max_tokens),
                ignore_eos: true,
                ..SamplingParams::default()
            },
            arrival_time: 0.0,
            client_index: args.client_index,
            lora_name: None,
            routing_reason: String::new(),
            routing_expected_prefix_tokens: 0,
        })
        .expect("sending the request");
    let mut tokens = Vec::new();
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let outputs = client
            .next_outputs(Some(left))
            .expect("outputs")
            .expect("outputs in time");
        for raw in outputs.engine_notifications.unwrap_or_default() {
            let n: Notification = raw.decode_as().expect("a notification");
            println!("notification {}", n.type_name());
        }
        for output in outputs.outputs {
            assert_eq!(
                output.request_id, request_id,
                "outputs go only to their owner"
            );
            tokens.extend(output.new_token_ids.iter().map(i64::to_string));
            if let Some(reason) = output.finish_reason {
                println!("tokens {}", tokens.join(" "));
                println!("finish {reason}");
                return;
            }
        }
    }
}
