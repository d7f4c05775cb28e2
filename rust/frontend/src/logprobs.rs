//! Log-probabilities in OpenAI's two shapes, rendered as the Python servers render them: chat's
//! `content` list (token, logprob, UTF-8 bytes, the `top` likeliest) and the completions API's
//! legacy lists (tokens, token_logprobs, top_logprobs keyed by token text, text_offset in
//! characters). A token's text is its own decode, special tokens included and an incomplete
//! UTF-8 sequence replaced, as the Python tokenizer decodes one id. Fields come in the Python
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

/// The completions API's `logprobs`, its text offsets counted from `offset` (a stream's chunk
/// starts where the text streamed before it ends); returns it and the offset after it.
pub fn completion(
    tokenizer: &Tokenizer,
    items: &[TokenLogprobs],
    top: usize,
    mut offset: usize,
) -> (Json, usize) {
    let (mut tokens, mut logprobs, mut tops, mut offsets) = (vec![], vec![], vec![], vec![]);
    for item in items {
        let chosen = text(tokenizer, item.token_id);
        offsets.push(offset);
        offset += chosen.chars().count();
        tokens.push(chosen);
        logprobs.push(item.logprob);
        // A dict by token text: two ids of one text keep the first's place, the last's figure.
        let mut by_text: Vec<(String, Json)> = Vec::new();
        for (id, lp) in ranked(item, top) {
            let token = text(tokenizer, id);
            match by_text.iter_mut().find(|(seen, _)| *seen == token) {
                Some(entry) => entry.1 = Json::from(lp),
                None => by_text.push((token, Json::from(lp))),
            }
        }
        tops.push(Json::Object(by_text));
    }
    let rendered = object![
        ("tokens", tokens),
        ("token_logprobs", logprobs),
        ("top_logprobs", tops),
        ("text_offset", offsets),
    ];
    (rendered, offset)
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
