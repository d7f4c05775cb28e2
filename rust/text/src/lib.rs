//! Text for a Rust frontend: the model's byte-level BPE tokenizer, read from its
//! `tokenizer.json` (the `tokenizers` crate is not packaged where rankcast builds), and
//! incremental detokenization that never splits a UTF-8 character.
//!
//! What is supported is what a GPT-2-style byte-level BPE model declares: added (special) tokens
//! split out first, the ByteLevel pre-tokenizer's regex, every byte mapped to a printable
//! character, merges applied by rank, and the ByteLevel decoder. A `tokenizer.json` that asks for
//! anything else (a normalizer, another model or pre-tokenizer, byte fallback) is refused when
//! it is read, naming what it asked for: ids that differ from the Python side's are worse than
//! none.

use std::collections::HashMap;
use std::path::Path;

use fancy_regex::Regex;
use serde_json::Value;

/// GPT-2's pre-tokenization: contractions, letter runs, digit runs, other runs, whitespace
/// (the last run of spaces before a word goes with the word).
const BYTE_LEVEL_PATTERN: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenizerError(pub String);

impl std::fmt::Display for TokenizerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for TokenizerError {}

fn refuse<T>(message: impl Into<String>) -> Result<T, TokenizerError> {
    Err(TokenizerError(message.into()))
}

/// The byte-level alphabet: printable bytes stand for themselves, the others for characters
/// from 256 on, so every byte string is a string of printable characters.
fn byte_alphabet() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..256u32 {
        let printable =
            (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        table[b as usize] = if printable {
            char::from_u32(b).expect("a Latin-1 character")
        } else {
            next += 1;
            char::from_u32(next - 1).expect("a character above 255")
        };
    }
    table
}

struct AddedToken {
    id: u32,
    content: String,
    special: bool,
}

pub struct Tokenizer {
    vocab: HashMap<String, u32>,
    tokens: Vec<String>,
    /// (left, right) -> (rank, merged id)
    merges: HashMap<(u32, u32), (u32, u32)>,
    added: Vec<AddedToken>,
    special_ids: Vec<bool>,
    pattern: Regex,
    alphabet: [char; 256],
    byte_of: HashMap<char, u8>,
}

fn field<'a>(json: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.').try_fold(json, |v, key| v.get(key))
}

fn check_type(json: &Value, path: &str, allowed: &[&str]) -> Result<(), TokenizerError> {
    match field(json, path) {
        None | Some(Value::Null) if allowed.contains(&"null") => Ok(()),
        Some(v) => match v.get("type").and_then(Value::as_str) {
            Some(t) if allowed.contains(&t) => Ok(()),
            other => refuse(format!("tokenizer.json: {path} {other:?} is not supported")),
        },
        None => refuse(format!("tokenizer.json: {path} is missing")),
    }
}

impl Tokenizer {
    pub fn from_file(path: &Path) -> Result<Self, TokenizerError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| TokenizerError(format!("{}: {e}", path.display())))?;
        let json: Value = serde_json::from_str(&text)
            .map_err(|e| TokenizerError(format!("{}: {e}", path.display())))?;
        Self::from_json(&json)
    }

    pub fn from_json(json: &Value) -> Result<Self, TokenizerError> {
        check_type(json, "model", &["BPE"])?;
        check_type(json, "normalizer", &["null"])?;
        check_type(json, "pre_tokenizer", &["ByteLevel"])?;
        check_type(json, "decoder", &["ByteLevel"])?;
        let model = &json["model"];
        if model.get("byte_fallback").and_then(Value::as_bool) == Some(true) {
            return refuse("tokenizer.json: model.byte_fallback is not supported");
        }
        if model.get("ignore_merges").and_then(Value::as_bool) == Some(true) {
            return refuse("tokenizer.json: model.ignore_merges is not supported");
        }
        let pre = &json["pre_tokenizer"];
        if pre.get("add_prefix_space").and_then(Value::as_bool) == Some(true)
            || pre.get("use_regex").and_then(Value::as_bool) == Some(false)
        {
            return refuse(
                "tokenizer.json: only ByteLevel(add_prefix_space=false, use_regex=true)",
            );
        }
        let Some(vocab_json) = model.get("vocab").and_then(Value::as_object) else {
            return refuse("tokenizer.json: model.vocab is missing");
        };
        let mut vocab = HashMap::with_capacity(vocab_json.len());
        for (token, id) in vocab_json {
            let Some(id) = id.as_u64() else {
                return refuse(format!("vocab: bad id for {token:?}"));
            };
            vocab.insert(token.clone(), id as u32);
        }
        let mut added = Vec::new();
        for entry in json
            .get("added_tokens")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let (Some(id), Some(content)) = (entry["id"].as_u64(), entry["content"].as_str())
            else {
                return refuse("tokenizer.json: an added token without id or content");
            };
            for flag in ["lstrip", "rstrip", "single_word", "normalized"] {
                if entry.get(flag).and_then(Value::as_bool) == Some(true) {
                    return refuse(format!("added token {content:?}: {flag} is not supported"));
                }
            }
            let special = entry
                .get("special")
                .and_then(Value::as_bool)
                .unwrap_or(false);
            vocab.insert(content.to_string(), id as u32);
            added.push(AddedToken {
                id: id as u32,
                content: content.to_string(),
                special,
            });
        }
        // Longest first, so that a token that is a prefix of another never wins.
        added.sort_by_key(|t| std::cmp::Reverse(t.content.len()));
        let size = vocab.values().max().map_or(0, |&m| m as usize + 1);
        let mut tokens = vec![String::new(); size];
        for (token, &id) in &vocab {
            tokens[id as usize] = token.clone();
        }
        let mut special_ids = vec![false; size];
        for token in added.iter().filter(|t| t.special) {
            special_ids[token.id as usize] = true;
        }
        let mut merges = HashMap::new();
        let merge_list = model
            .get("merges")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        for (rank, merge) in merge_list.iter().enumerate() {
            let (left, right) = match merge {
                Value::String(s) => match s.split_once(' ') {
                    Some((l, r)) => (l.to_string(), r.to_string()),
                    None => return refuse(format!("merge {s:?} is not two tokens")),
                },
                Value::Array(pair) if pair.len() == 2 => (
                    pair[0].as_str().unwrap_or_default().to_string(),
                    pair[1].as_str().unwrap_or_default().to_string(),
                ),
                other => return refuse(format!("merge {other} is not a pair")),
            };
            let merged = format!("{left}{right}");
            let (Some(&l), Some(&r), Some(&m)) =
                (vocab.get(&left), vocab.get(&right), vocab.get(&merged))
            else {
                return refuse(format!(
                    "merge {left:?} {right:?} names a token not in the vocab"
                ));
            };
            merges.entry((l, r)).or_insert((rank as u32, m));
        }
        let alphabet = byte_alphabet();
        let byte_of = alphabet
            .iter()
            .enumerate()
            .map(|(b, &c)| (c, b as u8))
            .collect();
        Ok(Tokenizer {
            vocab,
            tokens,
            merges,
            added,
            special_ids,
            pattern: Regex::new(BYTE_LEVEL_PATTERN).expect("the byte-level pattern"),
            alphabet,
            byte_of,
        })
    }

    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.vocab.get(token).copied()
    }

    /// The vocabulary's entry for `id` (byte-level pieces as the vocabulary spells them, as
    /// `tokenizers`' `id_to_token` gives it); None outside the vocabulary.
    pub fn token_string(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    pub fn is_special(&self, id: u32) -> bool {
        self.special_ids.get(id as usize).copied().unwrap_or(false)
    }

    /// The ids of `text`, added tokens included where they appear (as `tokenizer(text,
    /// add_special_tokens=False)` gives them in Python).
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut ids = Vec::new();
        let mut start = 0;
        let mut i = 0;
        while i < text.len() {
            if !text.is_char_boundary(i) {
                i += 1;
                continue;
            }
            if let Some(token) = self
                .added
                .iter()
                .find(|t| text[i..].starts_with(&t.content))
            {
                self.encode_plain(&text[start..i], &mut ids);
                ids.push(token.id);
                i += token.content.len();
                start = i;
                continue;
            }
            i += 1;
        }
        self.encode_plain(&text[start..], &mut ids);
        ids
    }

    fn encode_plain(&self, text: &str, ids: &mut Vec<u32>) {
        for piece in self.pattern.find_iter(text) {
            let piece = piece
                .expect("the byte-level pattern cannot fail on text")
                .as_str();
            self.bpe(piece, ids);
        }
    }

    /// Merge the piece's byte characters by rank, lowest first, until no merge applies.
    fn bpe(&self, piece: &str, ids: &mut Vec<u32>) {
        let mut symbols: Vec<u32> = piece
            .bytes()
            .map(|b| {
                let mut buf = [0u8; 4];
                let c = self.alphabet[b as usize].encode_utf8(&mut buf);
                self.vocab[&*c]
            })
            .collect();
        loop {
            let best = symbols
                .windows(2)
                .enumerate()
                .filter_map(|(i, w)| {
                    self.merges
                        .get(&(w[0], w[1]))
                        .map(|&(rank, id)| (rank, i, id))
                })
                .min();
            let Some((_, i, merged)) = best else { break };
            symbols[i] = merged;
            symbols.remove(i + 1);
        }
        ids.extend(symbols);
    }

    /// The bytes a token stands for (added tokens: their text).
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let Some(token) = self.tokens.get(id as usize) else {
            return Vec::new();
        };
        if self.added.iter().any(|t| t.id == id) {
            return token.as_bytes().to_vec();
        }
        token
            .chars()
            .filter_map(|c| self.byte_of.get(&c).copied())
            .collect()
    }

    /// The text of `ids` (invalid UTF-8 replaced by U+FFFD, as the Python side decodes).
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> String {
        let mut bytes = Vec::new();
        for &id in ids {
            if skip_special_tokens && self.is_special(id) {
                continue;
            }
            bytes.extend(self.token_bytes(id));
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

/// Text of a stream of tokens as it grows: each `push` returns what the new token completed,
/// holding back the bytes of a character that later tokens finish.
pub struct IncrementalDetokenizer<'a> {
    tokenizer: &'a Tokenizer,
    skip_special_tokens: bool,
    pending: Vec<u8>,
}

impl<'a> IncrementalDetokenizer<'a> {
    pub fn new(tokenizer: &'a Tokenizer, skip_special_tokens: bool) -> Self {
        IncrementalDetokenizer {
            tokenizer,
            skip_special_tokens,
            pending: Vec::new(),
        }
    }

    pub fn push(&mut self, id: u32) -> String {
        if !(self.skip_special_tokens && self.tokenizer.is_special(id)) {
            self.pending.extend(self.tokenizer.token_bytes(id));
        }
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(text) => {
                    out.push_str(text);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    out.push_str(
                        std::str::from_utf8(&self.pending[..valid]).expect("valid prefix"),
                    );
                    match e.error_len() {
                        // An unfinished character at the end: wait for the next token.
                        None => {
                            self.pending.drain(..valid);
                            return out;
                        }
                        // Bytes that no later token can make valid.
                        Some(bad) => {
                            out.push('\u{FFFD}');
                            self.pending.drain(..valid + bad);
                        }
                    }
                }
            }
        }
    }

    /// Whatever is still held back when the stream ends, replaced as a full decode would.
    pub fn finish(&mut self) -> String {
        let rest = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        rest
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A byte-level BPE over "a", "b", "Ġ" (the space) with two merges.
    fn tiny(extra: Value) -> Result<Tokenizer, TokenizerError> {
        let mut json = serde_json::json!({
            "normalizer": null,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "use_regex": true},
            "decoder": {"type": "ByteLevel"},
            "model": {
                "type": "BPE",
                "vocab": {"a": 0, "b": 1, "Ġ": 2, "ab": 3, "Ġab": 4, "<s>": 5},
                "merges": ["a b", ["Ġ", "ab"]],
            },
            "added_tokens": [{"id": 5, "content": "<s>", "special": true}],
        });
        if let (Value::Object(base), Value::Object(more)) = (&mut json, extra) {
            base.extend(more);
        }
        Tokenizer::from_json(&json)
    }

    #[test]
    fn merges_apply_by_rank_and_added_tokens_split_first() {
        let t = tiny(serde_json::json!({})).unwrap();
        assert_eq!(t.encode("ab ab<s>a"), vec![3, 4, 5, 0]);
        assert_eq!(t.decode(&[3, 4, 5, 0], false), "ab ab<s>a");
        assert_eq!(t.decode(&[3, 4, 5, 0], true), "ab aba");
    }

    #[test]
    fn what_this_tokenizer_cannot_do_is_refused_by_name() {
        let e = tiny(serde_json::json!({"normalizer": {"type": "NFC"}}))
            .err()
            .unwrap();
        assert!(e.0.contains("normalizer"), "{e}");
        let model = serde_json::json!({"model": {"type": "Unigram", "vocab": []}});
        assert!(tiny(model).err().unwrap().0.contains("Unigram"));
    }

    #[test]
    fn an_unfinished_character_is_held_until_it_is_complete() {
        let t = tiny(serde_json::json!({})).unwrap();
        let mut stream = IncrementalDetokenizer::new(&t, false);
        assert_eq!(stream.push(3), "ab");
        stream.pending.extend([0xE2, 0x82]); // the first two bytes of "€"
        assert_eq!(
            stream.push(5),
            "\u{FFFD}<s>",
            "a character no token can finish is replaced"
        );
        stream.pending.extend([0xE2, 0x82]);
        assert_eq!(stream.finish(), "\u{FFFD}");
    }
}
