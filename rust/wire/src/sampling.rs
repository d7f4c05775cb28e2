//! What a request asks of the sampler (`rankcast/sampling_params.py`) and the shape a structured
//! output must take (`rankcast/structured_outputs.py`). Both are maps that leave out defaults.

use crate::map_struct;
use crate::Value;

map_struct! {
    /// Exactly one shape is given: a JSON schema (an object or its text), any JSON object, a
    /// regex, a choice of strings or a Lark grammar. The engine checks the shape when it is made.
    StructuredOutputs {
        json: Option<Value> = None,
        json_object: bool = false,
        regex: Option<String> = None,
        choice: Option<Vec<String>> = None,
        grammar: Option<String> = None,
    }
}

map_struct! {
    /// `temperature` 0 is greedy; `top_k` <= 0 disables top-k; `max_tokens` None runs to the
    /// model's length; `logprobs` k returns the k likeliest tokens with each sampled one;
/// `prompt_logprobs` k scores every prompt token after the first, with the k likeliest there.
    SamplingParams {
        temperature: f64 = 1.0,
        top_p: f64 = 1.0,
        top_k: i64 = 0,
        min_p: f64 = 0.0,
        seed: Option<i64> = None,
        max_tokens: Option<i64> = Some(16),
        stop: Vec<String> = Vec::new(),
        stop_token_ids: Vec<i64> = Vec::new(),
        ignore_eos: bool = false,
        logprobs: Option<i64> = None,
        skip_special_tokens: bool = true,
        include_stop_str_in_output: bool = false,
        n: i64 = 1,
        structured: Option<StructuredOutputs> = None,
        prompt_logprobs: Option<i64> = None,
    }
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            seed: None,
            max_tokens: Some(16),
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            logprobs: None,
            skip_special_tokens: true,
            include_stop_str_in_output: false,
            n: 1,
            structured: None,
            prompt_logprobs: None,
        }
    }
}
