//! Log-probabilities in OpenAI's two shapes, rendered as the Python servers render them: chat's
//! `content` list (token, logprob, UTF-8 bytes, the `top` likeliest) and the completions API's
//! legacy lists (tokens, token_logprobs, top_logprobs keyed by token text, text_offset in
//! characters; an echoed prompt's positions first, its first token unscored). A token's text is
//! its own decode, special tokens included and an incomplete UTF-8 sequence replaced, as the
//! Python tokenizer decodes one id. Fields come in the Python
//! servers' order (`pyjson`), and a completion's `top_logprobs` by rank, as a dict keeps them.

use rankcast_client::wire::protocol::TokenLogprobs;
use rankcast_frontend::object;
use rankcast_frontend::pyjson::Json;
use rankcast_text::Tokenizer;

fn text(tokenizer: &Tokenizer, id: i64) -> String {
    u32::try_from(id).map_or_else(|_| String::new(), |id| tokenizer.decode(&[id], false))
}

/// The `top` likeliest at one position, by rank: the engine's alternatives (ranks 1, 2, ...),
/// the sampled token's own figures in its entry (or after them, when it was not among them).
fn ranked(item: &TokenLogprobs, top: usize) -> Vec<(i64, f64)> {
    let mut entries: Vec<(i64, f64, i64)> = item
        .top_token_ids
        .iter()
        .zip(&item.top_logprobs)
        .enumerate()
        .map(|(rank, (&id, &logprob))| (id, logprob, rank as i64 + 1))
        .collect();
    match entries.iter_mut().find(|entry| entry.0 == item.token_id) {
        Some(entry) => (entry.1, entry.2) = (item.logprob, item.rank),
        None => entries.push((item.token_id, item.logprob, item.rank)),
    }
    entries.sort_by_key(|entry| entry.2); // stable: equal ranks keep their order
    entries.truncate(top);
    entries.into_iter().map(|(id, lp, _)| (id, lp)).collect()
}

/// Chat's `logprobs`: `{"content": [...]}`, one entry per position.
pub fn chat(tokenizer: &Tokenizer, items: &[TokenLogprobs], top: usize) -> Json {
    let token = |id: i64, logprob: f64| {
        let text = text(tokenizer, id);
        let bytes = text.as_bytes().to_vec();
        vec![
            ("token".to_string(), Json::from(text)),
            ("logprob".to_string(), Json::from(logprob)),
            ("bytes".to_string(), Json::from(bytes)),
        ]
    };
    let content: Vec<Json> = items
        .iter()
        .map(|item| {
            let mut entry = token(item.token_id, item.logprob);
            let tops = ranked(item, top)
                .into_iter()
                .map(|(id, lp)| Json::Object(token(id, lp)))
                .collect();
            entry.push(("top_logprobs".to_string(), Json::Array(tops)));
            Json::Object(entry)
        })
        .collect();
    object![("content", Json::Array(content))]
}

/// The completions API's legacy `logprobs`, a position at a time: an echoed prompt's (its
/// first token unscored: its text and `null`s), then the completion's, each `text_offset` where
/// the token's text starts in the choice's text (characters).
#[derive(Clone)]
pub struct Legacy {
    tokens: Vec<Json>,
    token_logprobs: Vec<Json>,
    top_logprobs: Vec<Json>,
    text_offset: Vec<Json>,
    /// Where the next position's text starts.
    pub end: usize,
}

impl Legacy {
    /// No positions yet, the first to start at `offset` (a stream's chunk starts where the
    /// text streamed before it ends).
    pub fn starting_at(offset: usize) -> Legacy {
        Legacy {
            tokens: Vec::new(),
            token_logprobs: Vec::new(),
            top_logprobs: Vec::new(),
            text_offset: Vec::new(),
            end: offset,
        }
    }

    fn push_text(&mut self, text: String) {
        self.text_offset.push(Json::from(self.end));
        self.end += text.chars().count();
        self.tokens.push(Json::from(text));
    }

    /// A scored position: its token, the token's logprob and the `top` likeliest there.
    pub fn push(&mut self, tokenizer: &Tokenizer, item: &TokenLogprobs, top: usize) {
        self.push_text(text(tokenizer, item.token_id));
        self.token_logprobs.push(Json::from(item.logprob));
        // A dict by token text: two ids of one text keep the first's place, the last's figure.
        let mut by_text: Vec<(String, Json)> = Vec::new();
        for (id, lp) in ranked(item, top) {
            let token = text(tokenizer, id);
            match by_text.iter_mut().find(|(seen, _)| *seen == token) {
                Some(entry) => entry.1 = Json::from(lp),
                None => by_text.push((token, Json::from(lp))),
            }
        }
        self.top_logprobs.push(Json::Object(by_text));
    }

    /// A position without a score (a prompt's first token): its text, `null`s.
    fn push_unscored(&mut self, tokenizer: &Tokenizer, token: i64) {
        self.push_text(text(tokenizer, token));
        self.token_logprobs.push(Json::Null);
        self.top_logprobs.push(Json::Null);
    }

    pub fn json(self) -> Json {
        object![
            ("tokens", self.tokens),
            ("token_logprobs", self.token_logprobs),
            ("top_logprobs", self.top_logprobs),
            ("text_offset", self.text_offset),
        ]
    }
}

/// An echoed prompt's positions: its first token unscored, the rest with the engine's scores
/// (`prompt_logprobs`, one per token after the first; every position unscored without them),
/// as the Python servers' `_echo_logprobs` gives them.
pub fn echoed(
    tokenizer: &Tokenizer,
    prompt: &[u32],
    scored: Option<&[TokenLogprobs]>,
    top: usize,
) -> Legacy {
    let mut legacy = Legacy::starting_at(0);
    let Some((&first, _)) = prompt.split_first() else {
        return legacy;
    };
    match scored {
        Some(scored) => {
            legacy.push_unscored(tokenizer, i64::from(first));
            // Python's `zip`: as many positions as both the prompt and the scores have.
            for item in scored.iter().take(prompt.len() - 1) {
                legacy.push(tokenizer, item, top);
            }
        }
        None => {
            for &token in prompt {
                legacy.push_unscored(tokenizer, i64::from(token));
            }
        }
    }
    legacy
}

#[cfg(test)]
mod tests {
    use super::ranked;
    use rankcast_client::wire::protocol::TokenLogprobs;

    #[test]
    fn the_sampled_token_takes_its_own_entry_or_comes_after_the_alternatives() {
        let item = |token_id, rank| TokenLogprobs {
            token_id,
            logprob: -0.5,
            rank,
            top_token_ids: vec![7, 8, 9],
            top_logprobs: vec![-0.1, -0.2, -0.3],
        };
        assert_eq!(ranked(&item(8, 2), 3), [(7, -0.1), (8, -0.5), (9, -0.3)]);
        assert_eq!(ranked(&item(5, 40), 3), [(7, -0.1), (8, -0.2), (9, -0.3)]);
        assert_eq!(ranked(&item(5, 40), 0), []);
    }
}
