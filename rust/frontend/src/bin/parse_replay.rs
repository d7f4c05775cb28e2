//! `parse_replay`: the Rust chat output parsers for the cross-language tests. Reads from stdin
//! one JSON case a line, `{"opened", "constrained", "think", "tools", "pieces": [text, ...]}`
//! (the flags of `ThinkParser` and whether each parser runs, then the output's deltas), and
//! prints one JSON line per case: for each piece fed, then for the finish, `[reasoning,
//! content, [[name, arguments], ...]]`, exactly what each step gave.
//!
//!     parse_replay < cases.jsonl > steps.jsonl

use std::io::{BufRead, Write};

use rankcast_frontend::output_parsers::{HermesToolParser, OutputParser, Parsed, ThinkParser};
use serde_json::{json, Value};

fn step(reasoning: String, parsed: Parsed) -> Value {
    let calls: Vec<Value> = parsed
        .calls
        .into_iter()
        .map(|call| json!([call.name, call.arguments]))
        .collect();
    json!([reasoning, parsed.content, calls])
}

fn replay(case: &Value) -> Result<Value, String> {
    let flag = |key: &str| {
        case.get(key)
            .and_then(Value::as_bool)
            .ok_or_else(|| format!("{key}: a boolean"))
    };
    let (opened, constrained, tools) = (flag("opened")?, flag("constrained")?, flag("tools")?);
    let mut parser = OutputParser {
        think: flag("think")?.then(|| ThinkParser::new(opened, constrained, tools)),
        tools: tools.then(HermesToolParser::default),
    };
    let pieces = case
        .get("pieces")
        .and_then(Value::as_array)
        .ok_or("pieces: a list")?;
    let mut steps = Vec::with_capacity(pieces.len() + 1);
    for piece in pieces {
        let text = piece.as_str().ok_or("pieces: strings")?;
        let (reasoning, parsed) = parser.feed(text);
        steps.push(step(reasoning, parsed));
    }
    let (reasoning, parsed) = parser.finish();
    steps.push(step(reasoning, parsed));
    Ok(Value::Array(steps))
}

fn main() {
    let mut out = std::io::stdout().lock();
    for (number, line) in std::io::stdin().lock().lines().enumerate() {
        let result = line
            .map_err(|e| e.to_string())
            .and_then(|line| serde_json::from_str(&line).map_err(|e| e.to_string()))
            .and_then(|case| replay(&case));
        match result {
            Ok(steps) => {
                if writeln!(out, "{steps}").is_err() {
                    std::process::exit(1);
                }
            }
            Err(e) => {
                eprintln!("parse_replay: case {}: {e}", number + 1);
                std::process::exit(1);
            }
        }
    }
}
