//! Tokenizes a corpus with the Rust tokenizer, for the Python tests to compare with the Python
//! tokenizer: `tokenize <tokenizer.json> <corpus.json>`, the corpus a JSON array whose items are
//! texts (encoded, then decoded) or arrays of token ids (decoded only). Prints a JSON array: per
//! item its ids, their decode, and the pieces an incremental decode gave one token at a time (the
//! last piece: what `finish` returned).

use std::path::Path;

use rankcast_text::{IncrementalDetokenizer, Tokenizer};
use serde_json::{json, Value};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let [_, tokenizer_path, corpus_path] = &args[..] else {
        eprintln!("usage: tokenize <tokenizer.json> <corpus.json>");
        std::process::exit(2);
    };
    let tokenizer = Tokenizer::from_file(Path::new(tokenizer_path)).unwrap_or_else(|e| {
        eprintln!("tokenize: {e}");
        std::process::exit(1);
    });
    let corpus: Vec<Value> =
        serde_json::from_str(&std::fs::read_to_string(corpus_path).expect("the corpus"))
            .expect("a JSON array");
    let results: Vec<Value> = corpus
        .iter()
        .map(|item| {
            let ids: Vec<u32> = match item {
                Value::String(text) => tokenizer.encode(text),
                Value::Array(ids) => ids
                    .iter()
                    .map(|id| id.as_u64().expect("an id") as u32)
                    .collect(),
                other => panic!("not a text or ids: {other}"),
            };
            let mut stream = IncrementalDetokenizer::new(&tokenizer, false);
            let mut pieces: Vec<String> = ids.iter().map(|&id| stream.push(id)).collect();
            pieces.push(stream.finish());
            json!({"ids": ids, "decoded": tokenizer.decode(&ids, false), "pieces": pieces})
        })
        .collect();
    println!("{}", Value::Array(results));
}
