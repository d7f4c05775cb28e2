//! What KV-aware routers ask a worker, in vLLM's shapes, as the Python servers answer it
//! (`rankcast/api_server/discovery.py`): the token ids a request will compute and cache
//! (`/v1/chat/completions/render`, `/v1/completions/render`, through the same checks and prompt
//! construction as generation), where KV events are published (`/kv_event_sources`) and the
//! block size they are cut in (`/get_server_info`). The configuration these read is the
//! launcher's, handed over in flags; the JSON ones are written by the Python side's own
//! encoders and kept as given (key order, number spelling).

use rankcast_client::wire::sampling::{SamplingParams, StructuredOutputs};
use rankcast_client::wire::Value as Wire;
use rankcast_frontend::object;
use rankcast_frontend::pyjson::Json;

use super::Prepared;

/// What routers' discovery reads of the fleet's configuration (`ApiServerConfig`).
pub struct Discovery {
    pub block_size: i64,
    pub enable_prefix_caching: bool,
    pub data_parallel_size: i64,
    /// `--kv-events-config` as the launcher normalized it (`null` without the flag).
    pub kv_events_config: Json,
    /// Each engine's vLLM-format publisher keyed by data-parallel rank (`{}`: none publishes).
    pub kv_event_sources: Json,
    /// `--speculative-config` as the engines run it (`null` without speculation).
    pub speculative_config: Json,
}

impl Default for Discovery {
    fn default() -> Self {
        Discovery {
            block_size: 16,
            enable_prefix_caching: true,
            data_parallel_size: 1,
            kv_events_config: Json::Null,
            kv_event_sources: Json::Object(Vec::new()),
            speculative_config: Json::Null,
        }
    }
}

impl Discovery {
    /// `GET /get_server_info`: the part of vLLM's `vllm_config` that routers read.
    pub fn server_info(&self, model: &str, max_model_len: i64) -> Json {
        object![
            ("version", env!("CARGO_PKG_VERSION")),
            (
                "vllm_config",
                object![
                    (
                        "model_config",
                        object![("model", model), ("max_model_len", max_model_len)]
                    ),
                    (
                        "cache_config",
                        object![
                            ("block_size", self.block_size),
                            ("enable_prefix_caching", self.enable_prefix_caching),
                        ]
                    ),
                    (
                        "parallel_config",
                        object![("data_parallel_size", self.data_parallel_size)]
                    ),
                    ("kv_events_config", self.kv_events_config.clone()),
                    ("speculative_config", self.speculative_config.clone()),
                ]
            ),
        ]
    }
}

/// vLLM's `GenerateRequest`: what a token-in engine would be sent for `prepared`.
pub fn generate_request(request_id: &str, prepared: &Prepared) -> Json {
    object![
        ("request_id", request_id),
        ("token_ids", prepared.prompt_ids.clone()),
        ("features", Json::Null),
        ("sampling_params", sampling_params(&prepared.params)),
        ("model", prepared.model.as_str()),
        ("stream", prepared.stream),
        ("cache_salt", Json::Null),
        ("priority", 0u64),
    ]
}

/// `msgspec.to_builtins(params)` of the Python servers' params: the fields that differ from
/// their defaults, in order, and the three floats always. msgspec leaves a field out when it
/// is its default's own object (an identity test: the empty collections aside, a value equal
/// to the default is kept), which the small integers, `None` and the booleans are, and the
/// Python servers' floats never are (they come from the request or from constants of
/// another module).
fn sampling_params(params: &SamplingParams) -> Json {
    let default = SamplingParams::default();
    let mut fields: Vec<(String, Json)> = Vec::new();
    let mut put = |name: &str, value: Json, is_default: bool| {
        if !is_default {
            fields.push((name.to_string(), value));
        }
    };
    put("temperature", params.temperature.into(), false);
    put("top_p", params.top_p.into(), false);
    put("top_k", params.top_k.into(), params.top_k == default.top_k);
    put("min_p", params.min_p.into(), false);
    put("seed", params.seed.into(), params.seed == default.seed);
    put(
        "max_tokens",
        params.max_tokens.into(),
        params.max_tokens == default.max_tokens,
    );
    put("stop", params.stop.clone().into(), params.stop.is_empty());
    put(
        "stop_token_ids",
        params.stop_token_ids.clone().into(),
        params.stop_token_ids.is_empty(),
    );
    put("ignore_eos", params.ignore_eos.into(), !params.ignore_eos);
    put(
        "logprobs",
        params.logprobs.into(),
        params.logprobs.is_none(),
    );
    put(
        "skip_special_tokens",
        params.skip_special_tokens.into(),
        params.skip_special_tokens,
    );
    put(
        "include_stop_str_in_output",
        params.include_stop_str_in_output.into(),
        !params.include_stop_str_in_output,
    );
    put("n", params.n.into(), params.n == default.n);
    if let Some(shape) = &params.structured {
        put("structured", structured(shape), false);
    }
    Json::Object(fields)
}

/// `msgspec.to_builtins` of an output shape: the one shape given.
fn structured(shape: &StructuredOutputs) -> Json {
    let mut fields: Vec<(String, Json)> = Vec::new();
    if let Some(json) = &shape.json {
        fields.push(("json".into(), wire_json(json)));
    }
    if shape.json_object {
        fields.push(("json_object".into(), true.into()));
    }
    if let Some(regex) = &shape.regex {
        fields.push(("regex".into(), regex.as_str().into()));
    }
    if let Some(choice) = &shape.choice {
        fields.push(("choice".into(), choice.clone().into()));
    }
    if let Some(grammar) = &shape.grammar {
        fields.push(("grammar".into(), grammar.as_str().into()));
    }
    Json::Object(fields)
}

/// A wire value as JSON (a schema given as an object).
fn wire_json(value: &Wire) -> Json {
    match value {
        Wire::Nil => Json::Null,
        Wire::Bool(b) => Json::Bool(*b),
        Wire::Int(n) => Json::Int(n.to_string()),
        Wire::Float(x) => Json::Float(*x),
        Wire::Str(s) => Json::Str(s.clone()),
        Wire::Bin(bytes) => Json::Str(String::from_utf8_lossy(bytes).into_owned()),
        Wire::Array(items) => Json::Array(items.iter().map(wire_json).collect()),
        Wire::Map(entries) => Json::Object(
            entries
                .iter()
                .map(|(key, value)| {
                    let key = key
                        .as_str()
                        .map_or_else(|| format!("{key:?}"), str::to_string);
                    (key, wire_json(value))
                })
                .collect(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampling_params_leave_out_their_defaults_as_msgspec_does_but_the_floats() {
        let params = SamplingParams {
            temperature: 0.0,
            max_tokens: None,
            stop: vec!["\n".into()],
            ..SamplingParams::default()
        };
        assert_eq!(
            sampling_params(&params).response(),
            r#"{"temperature":0.0,"top_p":1.0,"min_p":0.0,"max_tokens":null,"stop":["\n"]}"#
        );
        assert_eq!(
            sampling_params(&SamplingParams::default()).response(),
            r#"{"temperature":1.0,"top_p":1.0,"min_p":0.0}"#
        );
    }

    #[test]
    fn server_info_nests_the_configuration_as_vllm_config() {
        let discovery = Discovery {
            kv_events_config: Json::parse(r#"{"enable_kv_cache_events": true, "x": 1.0}"#)
                .expect("JSON"),
            ..Discovery::default()
        };
        let info = discovery.server_info("m", 128).response();
        assert!(info.ends_with(
            r#""cache_config":{"block_size":16,"enable_prefix_caching":true},"parallel_config":{"data_parallel_size":1},"kv_events_config":{"enable_kv_cache_events":true,"x":1.0},"speculative_config":null}}"#
        ), "{info}");
    }
}
