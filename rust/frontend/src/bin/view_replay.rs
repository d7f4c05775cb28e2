//! `view_replay`: the Rust engine view for the cross-language tests. Reads from stdin a msgpack
//! array of cases, each `[snapshot, [event, ...]]` (the catch-up snapshot as it crosses the
//! wire, then notification maps as in `EngineCoreOutputs.engine_notifications`), and prints one
//! line of JSON per case: `EngineView::as_json()` after applying the snapshot, then each event
//! (a type this build does not know through `apply_unknown`, named by its map's "type").
//!
//!     view_replay < cases.msgpack > states.jsonl

use std::io::{Read, Write};

use rankcast_client::wire::codec::read_array_len;
use rankcast_frontend::view::{decode_case, replay};

fn main() {
    let mut input = Vec::new();
    if let Err(e) = std::io::stdin().read_to_end(&mut input) {
        eprintln!("view_replay: reading stdin: {e}");
        std::process::exit(1);
    }
    let mut rd = input.as_slice();
    let run = |rd: &mut &[u8]| -> Result<Vec<String>, String> {
        let count = read_array_len(rd).map_err(|e| format!("the cases: {e}"))?;
        let mut lines = Vec::with_capacity(count);
        for i in 0..count {
            let (snapshot, events) = decode_case(rd).map_err(|e| format!("case {i}: {e}"))?;
            lines.push(replay(&snapshot, &events).as_json().to_string());
        }
        if !rd.is_empty() {
            return Err(format!("{} bytes after the cases", rd.len()));
        }
        Ok(lines)
    };
    match run(&mut rd) {
        Ok(lines) => {
            let mut out = std::io::stdout().lock();
            for line in lines {
                if writeln!(out, "{line}").is_err() {
                    std::process::exit(1);
                }
            }
        }
        Err(message) => {
            eprintln!("view_replay: {message}");
            std::process::exit(1);
        }
    }
}
