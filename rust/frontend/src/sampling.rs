//! `n`, `best_of` and `echo`: how many samples of one prompt a request draws and answers, and
//! how each sample is asked of the engine, as the Python servers' `parallel_sampling.py` does
//! it. Each sample is a child request of its own (`{request_id}-{i}`); a seeded request gives
//! child i the seed `seed + i` (vLLM's rule), so every choice is reproducible, no two are the
//! same draw, and a fleet's two kinds of server draw the same choices. `best_of` (completions)
//! draws that many and answers the `n` whose tokens are most likely. The driver that submits
//! the children and interleaves their outputs is `generation.rs`.

use rankcast_client::wire::protocol::TokenLogprobs;
use rankcast_client::wire::sampling::SamplingParams;
use serde_json::{Map, Value};

use crate::fields::{self, Invalid};

/// OpenAI's bound on `n` and `best_of`, as the Python servers' schema states it.
const MOST: i64 = 128;

/// The samples a request draws and answers, and whether a completion echoes its prompt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Samples {
    /// Choices answered.
    pub n: usize,
    /// Samples drawn: `best_of` when it is more than `n` (the answer is ranked), else `n`.
    pub drawn: usize,
    /// The completion's text starts with its prompt's (`echo`).
    pub echo: bool,
}

impl Samples {
    /// Whether the answered choices are the likeliest of more samples (`best_of` > `n`).
    pub fn ranked(&self) -> bool {
        self.drawn > self.n
    }
}

/// pydantic's lax `int` with `ge=1, le=128` under `key`; None when absent (or, for
/// `best_of`, null) or refused.
fn count(invalid: &mut Invalid, body: &Map<String, Value>, key: &str) -> Option<i64> {
    let value = body.get(key)?;
    if key == "best_of" && value.is_null() {
        return None;
    }
    match fields::integer(value) {
        Ok(k) if k < 1 => invalid.add(key, "Input should be greater than or equal to 1"),
        Ok(k) if k > MOST => invalid.add(key, "Input should be less than or equal to 128"),
        Ok(k) => return Some(k),
        Err(message) => invalid.add(key, message),
    }
    None
}

/// `n`, read where the Python servers' schema declares it (among the sampling fields, before
/// `messages` or `prompt`).
pub(crate) fn read_n(invalid: &mut Invalid, body: &Map<String, Value>) -> i64 {
    count(invalid, body, "n").unwrap_or(1)
}

/// A completion's `echo` and `best_of`, read after its `prompt` as the schema declares them.
pub(crate) fn read_completion_fields(
    invalid: &mut Invalid,
    body: &Map<String, Value>,
) -> (bool, Option<i64>) {
    let echo = invalid.field(body, "echo", false, fields::boolean);
    (echo, count(invalid, body, "best_of"))
}

/// The samples, once every field read well: `best_of` at least `n`, and not streamed when it
/// ranks (the best are known only at the end); a refusal is the Python servers' message (a
/// 400 naming no field, as their schema's whole-body checks answer).
pub(crate) fn samples(
    n: i64,
    best_of: Option<i64>,
    echo: bool,
    body: &Map<String, Value>,
) -> Result<Samples, String> {
    let drawn = best_of.unwrap_or(n);
    if drawn < n {
        return Err(format!("best_of ({drawn}) must be at least n ({n})"));
    }
    let stream = body
        .get("stream")
        .is_some_and(|v| fields::boolean(v).unwrap_or(false));
    if drawn > n && stream {
        return Err("best_of cannot stream: the best samples are known only at the end".into());
    }
    Ok(Samples {
        n: n as usize,
        drawn: drawn as usize,
        echo,
    })
}

/// The engine request id of sample `index`: the request's own when it draws one sample.
pub(crate) fn child_id(request_id: &str, index: usize, drawn: usize) -> String {
    if drawn == 1 {
        request_id.to_string()
    } else {
        format!("{request_id}-{index}")
    }
}

/// The sampling parameters of sample `index`: its own seed when the request has one (`seed +
/// index`, wrapping as the engine's generators read a 64-bit seed, the same seed as the Python
/// servers' unsigned sum); the prompt is scored (`prompt_logprobs`) by the first sample alone,
/// since scoring it takes no prefix-cache hits and every sample's prompt is the same.
pub(crate) fn child_params(params: &SamplingParams, index: usize) -> SamplingParams {
    let mut child = params.clone();
    if index > 0 {
        child.seed = params.seed.map(|seed| seed.wrapping_add(index as i64));
        child.prompt_logprobs = None;
    }
    child
}

/// The sum of a sample's sampled tokens' log-probabilities (`best_of`'s ranking), added in
/// order as Python's `sum` adds them.
fn likelihood(logprobs: &[TokenLogprobs]) -> f64 {
    logprobs.iter().fold(0.0, |sum, item| sum + item.logprob)
}

/// The indices of the `n` likeliest samples, likeliest first; equally likely ones keep their
/// order (Python's stable sort).
pub(crate) fn likeliest<'a>(
    samples: impl IntoIterator<Item = &'a [TokenLogprobs]>,
    n: usize,
) -> Vec<usize> {
    let scores: Vec<f64> = samples.into_iter().map(likelihood).collect();
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&a, &b| {
        scores[b]
            .partial_cmp(&scores[a])
            .unwrap_or(std::cmp::Ordering::Equal)
    });
    order.truncate(n);
    order
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn read(body: Value) -> Result<Samples, String> {
        let body = body.as_object().cloned().expect("an object");
        let mut invalid = Invalid::default();
        let n = read_n(&mut invalid, &body);
        let (echo, best_of) = read_completion_fields(&mut invalid, &body);
        if !invalid.is_empty() {
            return Err(invalid.message().0);
        }
        samples(n, best_of, echo, &body)
    }

    #[test]
    fn n_and_best_of_are_read_and_refused_as_the_python_schema_does() {
        let drawn = |n, drawn, echo| Ok(Samples { n, drawn, echo });
        assert_eq!(read(json!({})), drawn(1, 1, false));
        assert_eq!(read(json!({"n": "3", "echo": "yes"})), drawn(3, 3, true));
        assert_eq!(read(json!({"n": 2, "best_of": 5})), drawn(2, 5, false));
        assert_eq!(read(json!({"best_of": null, "n": 2.0})), drawn(2, 2, false));
        assert_eq!(
            read(json!({"n": 2, "best_of": 2, "stream": true})),
            drawn(2, 2, false)
        );
        assert_eq!(
            read(json!({"n": 0, "best_of": 129})).unwrap_err(),
            "n: Input should be greater than or equal to 1; best_of: Input should be less \
             than or equal to 128"
        );
        assert_eq!(
            read(json!({"n": null, "echo": null})).unwrap_err(),
            "n: Input should be a valid integer; echo: Input should be a valid boolean"
        );
        assert_eq!(
            read(json!({"n": 4, "best_of": 3})).unwrap_err(),
            "best_of (3) must be at least n (4)"
        );
        assert_eq!(
            read(json!({"best_of": 3, "stream": 1})).unwrap_err(),
            "best_of cannot stream: the best samples are known only at the end"
        );
    }

    #[test]
    fn each_child_has_its_own_id_and_seed_and_only_the_first_scores_the_prompt() {
        assert_eq!(child_id("cmpl-x", 0, 1), "cmpl-x");
        assert_eq!(child_id("cmpl-x", 2, 3), "cmpl-x-2");
        let params = SamplingParams {
            seed: Some(i64::MAX),
            prompt_logprobs: Some(2),
            ..SamplingParams::default()
        };
        assert_eq!(child_params(&params, 0), params);
        let second = child_params(&params, 1);
        // 2**63 as the engine's generator reads it: the same 64 bits as Python's unsigned seed.
        assert_eq!(second.seed, Some(i64::MIN));
        assert_eq!(second.prompt_logprobs, None);
        let unseeded = SamplingParams::default();
        assert_eq!(child_params(&unseeded, 5).seed, None);
    }

    #[test]
    fn the_likeliest_come_first_and_ties_keep_their_order() {
        let item = |logprob| TokenLogprobs {
            token_id: 1,
            logprob,
            rank: 1,
            top_token_ids: Vec::new(),
            top_logprobs: Vec::new(),
        };
        let samples = [
            vec![item(-1.0), item(-1.0)],
            vec![item(-0.5)],
            vec![item(-2.0)],
            vec![item(-0.5)],
        ];
        let order = likeliest(samples.iter().map(Vec::as_slice), 3);
        assert_eq!(order, [1, 3, 0]);
    }
}
