//! The OpenAI routes: `/v1/completions` and `/v1/chat/completions` (streamed as server-sent
//! events or whole), `/v1/models`, `/health`; vLLM's `/ping`, `/load` and `/version`, its
//! `/tokenize` and `/detokenize` (tokenization.rs), the render and discovery routes routers ask
//! (discovery.rs); and the engine as this server's view has it, `/v1/lora_adapters` and
//! `/v1/engine_views`. Request fields are checked the way the Python API
//! server checks them, and a bad one is a 400 in OpenAI's error shape naming it; a checked
//! request's samples are driven to their answer by `generation.rs`. Completions,
//! chunks and errors are written with the Python servers' field order and number spelling
//! (`pyjson`), and a chat's output goes through the same reasoning and tool-call parsers
//! (`output_parsers`), so a fleet answers the same bytes from either kind of server, ids and
//! times aside.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use hyper::body::Bytes;
use hyper::{Body, Method, Request, Response, StatusCode};
use rankcast_client::wire::sampling::SamplingParams;
use rankcast_frontend::engine_views::EngineViews;
use rankcast_frontend::object;
use rankcast_frontend::output_parsers::{
    prompt_opens_think, HermesToolParser, OutputParser, ThinkParser, ToolCall,
};
use rankcast_frontend::pyjson::Json;
use rankcast_text::Tokenizer;
use serde_json::{json, Map, Value};

use crate::chat::ChatTemplate;
use crate::drain::{Drain, RETRY_AFTER_S};
use crate::engine::Engine;
use crate::events::EventHub;
use crate::fields;
use crate::fleet_start::FleetStart;
use crate::metrics::EngineMetrics;
use crate::route_metrics;
use crate::shape;

// The newer chat-shaped APIs, each translated into one chat turn (their own modules).
mod chat_turn;
mod discovery;
mod errors;
mod messages;
mod methods;
mod openapi;
mod response_store;
mod responses;
mod tokenization;
mod validate;

pub use discovery::Discovery;

pub struct Server {
    pub engine: Engine,
    pub metrics: Arc<EngineMetrics>,
    pub events: Arc<EventHub>,
    /// The engine as its snapshot and notifications describe it (adapters, pins, counts).
    pub views: Arc<EngineViews>,
    /// Where the base model came from (the `root` of its model card).
    pub model_origin: String,
    pub tokenizer: Tokenizer,
    pub template: Option<ChatTemplate>,
    pub model_name: String,
    pub max_model_len: i64,
    /// The engine core this server is a client of (the `engine` label of finished requests).
    pub engine_index: i64,
    pub client_index: i64,
    /// The bearer token every /v1 route requires, when set.
    pub api_key: Option<String>,
    pub counter: AtomicU64,
    pub drain: Arc<Drain>,
    /// Whether the launcher's fleet has started: `/health` is 503 until it has.
    pub fleet: FleetStart,
    /// How chat outputs are read (`--reasoning-parser qwen3`, `--tool-call-parser hermes`):
    /// as the Python servers of the fleet read them.
    pub parsers: Parsers,
    /// What routers' discovery reads of the fleet's configuration.
    pub discovery: Discovery,
}

/// The output parsers this server was started with.
#[derive(Clone, Copy, Default)]
pub struct Parsers {
    /// `--reasoning-parser qwen3`: `<think>` blocks are the answer's reasoning.
    pub qwen3_reasoning: bool,
    /// `--tool-call-parser hermes` (with `--enable-auto-tool-choice`): `<tool_call>` blocks
    /// are tool calls, and `tool_choice` auto is served.
    pub hermes_tools: bool,
}

pub(crate) type Reply = Response<Body>;

fn json_reply(status: StatusCode, body: &Value) -> Reply {
    text_reply(status, body.to_string())
}

/// A JSON body already written (`Json::response`).
pub(crate) fn text_reply(status: StatusCode, body: String) -> Reply {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Body::from(body))
        .expect("a response")
}

/// OpenAI's error body, its fields in the Python servers' order.
pub(crate) fn error_body(status: StatusCode, message: &str, param: Option<&str>) -> Json {
    let kind = match status.as_u16() {
        400 => "BadRequestError",
        401 => "AuthenticationError",
        404 => "NotFoundError",
        503 => "ServiceUnavailableError",
        _ => "APIError",
    };
    object![(
        "error",
        object![
            ("message", message),
            ("type", kind),
            ("param", param),
            ("code", status.as_u16()),
        ]
    )]
}

/// OpenAI's error shape, so official clients raise the right exception type.
pub(crate) fn error(status: StatusCode, message: &str, param: Option<&str>) -> Reply {
    text_reply(status, error_body(status, message, param).response())
}

/// Request fields of the Python servers that this server does not serve yet. Of the output
/// shapes it serves a choice of strings (`guided_choice`, `structured_outputs.choice`:
/// shape.rs), and tools, tool_choice and chat_template_kwargs on chat.
const NOT_SERVED_YET: [&str; 4] = [
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_grammar",
];

/// Chat fields, refused by name on completions.
const CHAT_ONLY: [&str; 3] = ["tools", "tool_choice", "chat_template_kwargs"];

/// A request refused before it reaches the engine: message, field, status (400 unless said).
pub(crate) struct BadRequest(String, Option<String>, StatusCode);

impl BadRequest {
    pub(crate) fn new(message: impl Into<String>, param: Option<&str>) -> BadRequest {
        BadRequest(
            message.into(),
            param.map(str::to_string),
            StatusCode::BAD_REQUEST,
        )
    }

    /// The refusal as the client gets it.
    pub(crate) fn reply(self) -> Reply {
        let BadRequest(message, param, status) = self;
        error(status, &message, param.as_deref())
    }
}

impl From<shape::Refusal> for BadRequest {
    fn from(shape::Refusal(message, param): shape::Refusal) -> BadRequest {
        BadRequest(message, Some(param.into()), StatusCode::BAD_REQUEST)
    }
}

impl From<fields::Invalid> for BadRequest {
    fn from(invalid: fields::Invalid) -> BadRequest {
        let (message, param) = invalid.message();
        BadRequest(message, param, StatusCode::BAD_REQUEST)
    }
}

fn bad<T>(message: impl Into<String>, param: &'static str) -> Result<T, BadRequest> {
    Err(BadRequest(
        message.into(),
        Some(param.into()),
        StatusCode::BAD_REQUEST,
    ))
}

/// The 400 a prompt gets that fills the model's context (`limit` tokens) by itself or with
/// the tokens asked for, in the Python servers' words.
pub(crate) fn context_check(
    limit: i64,
    prompt_len: usize,
    max_tokens: Option<i64>,
    chat: bool,
) -> Result<(), BadRequest> {
    let prompt_len = prompt_len as i64;
    if prompt_len >= limit {
        return bad(
            format!(
                "This model's maximum context length is {limit} tokens. However, your request \
                 has {prompt_len} prompt tokens, leaving no room to generate. Please shorten the \
                 prompt."
            ),
            if chat { "messages" } else { "prompt" },
        );
    }
    match max_tokens {
        Some(m) if prompt_len.saturating_add(m) > limit => bad(
            format!(
                "This model's maximum context length is {limit} tokens. However, you requested \
                 {} tokens ({prompt_len} in the prompt, {m} for the completion). Please reduce \
                 the prompt or max_tokens.",
                prompt_len.saturating_add(m)
            ),
            "max_tokens",
        ),
        _ => Ok(()),
    }
}

fn number(body: &Map<String, Value>, key: &'static str, default: f64) -> Result<f64, BadRequest> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(v) => match v.as_f64() {
            Some(x) if x.is_finite() => Ok(x),
            _ => bad(format!("{key} must be a finite number"), key),
        },
    }
}

fn integer(body: &Map<String, Value>, key: &'static str) -> Result<Option<i64>, BadRequest> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_i64() {
            Some(x) => Ok(Some(x)),
            None => bad(format!("{key} must be an integer within 64 bits"), key),
        },
    }
}

fn flag(body: &Map<String, Value>, key: &'static str, default: bool) -> Result<bool, BadRequest> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => bad(format!("{key} must be a boolean"), key),
    }
}

/// How many alternatives per position the request asks logprobs for, if any: chat's
/// `logprobs: true` with `top_logprobs` (0 unless given), the completions API's `logprobs: k`.
fn requested_logprobs(body: &Map<String, Value>, chat: bool) -> Result<Option<i64>, BadRequest> {
    let in_range = |key: &'static str, value: Option<i64>| match value {
        Some(k) if !(0..=20).contains(&k) => bad(format!("{key} must be in [0, 20]"), key),
        _ => Ok(value),
    };
    if !chat {
        return in_range("logprobs", integer(body, "logprobs")?);
    }
    let top = in_range("top_logprobs", integer(body, "top_logprobs")?)?;
    Ok(flag(body, "logprobs", false)?.then_some(top.unwrap_or(0)))
}

/// The sampling fields both routes share, checked as the engine checks them.
fn sampling(
    body: &Map<String, Value>,
    max_tokens: Option<i64>,
) -> Result<SamplingParams, BadRequest> {
    let temperature = number(body, "temperature", 1.0)?;
    if !(0.0..=2.0).contains(&temperature) {
        return bad("temperature must be in [0, 2]", "temperature");
    }
    let top_p = number(body, "top_p", 1.0)?;
    if !(top_p > 0.0 && top_p <= 1.0) {
        return bad("top_p must be in (0, 1]", "top_p");
    }
    let min_p = number(body, "min_p", 0.0)?;
    if !(0.0..=1.0).contains(&min_p) {
        return bad("min_p must be in [0, 1]", "min_p");
    }
    let top_k = integer(body, "top_k")?.unwrap_or(0);
    if top_k < -1 {
        return bad("top_k must be -1, 0 or positive", "top_k");
    }
    if let Some(m) = max_tokens {
        if m < 1 {
            return bad("max_tokens must be at least 1", "max_tokens");
        }
    }
    let stop = match body.get("stop") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => {
            let mut stops = Vec::new();
            for item in items {
                match item.as_str() {
                    Some(s) if !s.is_empty() => stops.push(s.to_string()),
                    _ => return bad("stop strings must be non-empty strings", "stop"),
                }
            }
            stops
        }
        Some(_) => return bad("stop must be a string or a list of strings", "stop"),
    };
    let stop_token_ids = match body.get("stop_token_ids") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(items)) => {
            let ids: Option<Vec<i64>> = items.iter().map(Value::as_i64).collect();
            match ids {
                Some(ids) => ids,
                None => return bad("stop_token_ids must be integers", "stop_token_ids"),
            }
        }
        Some(_) => {
            return bad(
                "stop_token_ids must be a list of integers",
                "stop_token_ids",
            )
        }
    };
    let params = SamplingParams {
        temperature,
        top_p,
        top_k,
        min_p,
        seed: integer(body, "seed")?,
        max_tokens,
        stop,
        stop_token_ids,
        ignore_eos: flag(body, "ignore_eos", false)?,
        skip_special_tokens: flag(body, "skip_special_tokens", true)?,
        include_stop_str_in_output: flag(body, "include_stop_str_in_output", false)?,
        ..SamplingParams::default()
    };
    Ok(params)
}

pub(crate) fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

pub(crate) fn now_f64() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// A call in a message's `tool_calls`.
fn call_message(call: ToolCall) -> Json {
    object![
        ("id", call.id),
        ("type", "function"),
        (
            "function",
            object![("name", call.name), ("arguments", call.arguments)]
        ),
    ]
}

/// A whole chat answer's message and finish reason, as the Python servers write them: with a
/// parser, the reasoning and the calls the model wrote taken out of the text (no text beside
/// them is `content: null`) and the finish reason `tool_calls` when it wrote some; the
/// reasoning fields are there (`null` without reasoning) whenever the server reads reasoning.
pub(crate) fn chat_message(
    text: String,
    finish: String,
    parser: Option<OutputParser>,
    reasoning_fields: bool,
) -> (Json, String) {
    let mut fields = vec![("role".to_string(), Json::from("assistant"))];
    let Some(mut parser) = parser else {
        fields.push(("content".into(), Json::from(text)));
        if reasoning_fields {
            fields.push(("reasoning".into(), Json::Null));
            fields.push(("reasoning_content".into(), Json::Null));
        }
        return (Json::Object(fields), finish);
    };
    let parsed = parser.whole(&text);
    let content = if !parsed.content.is_empty() {
        Json::from(parsed.content)
    } else if parsed.reasoning.is_some() || !parsed.calls.is_empty() {
        Json::Null
    } else {
        Json::from("")
    };
    fields.push(("content".into(), content));
    if reasoning_fields {
        let reasoning = Json::from(parsed.reasoning);
        fields.push(("reasoning".into(), reasoning.clone()));
        fields.push(("reasoning_content".into(), reasoning));
    }
    if parsed.calls.is_empty() {
        return (Json::Object(fields), finish);
    }
    let calls: Vec<Json> = parsed.calls.into_iter().map(call_message).collect();
    fields.push(("tool_calls".into(), Json::Array(calls)));
    (Json::Object(fields), "tool_calls".into())
}

/// A request's body, which must be a JSON object; the 400 to answer otherwise.
async fn read_body(request: Request<Body>) -> Result<Map<String, Value>, Reply> {
    let bytes = hyper::body::to_bytes(request.into_body())
        .await
        .map_err(|e| {
            error(
                StatusCode::BAD_REQUEST,
                &format!("reading the body: {e}"),
                None,
            )
        })?;
    match serde_json::from_slice(&bytes) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(error(
            StatusCode::BAD_REQUEST,
            "the body must be a JSON object",
            None,
        )),
        Err(e) => Err(error(
            StatusCode::BAD_REQUEST,
            &format!("invalid JSON: {e}"),
            None,
        )),
    }
}

pub(crate) fn sse(value: &Json) -> Bytes {
    Bytes::from(format!("data: {}\n\n", value.event()))
}

impl Server {
    /// Every response names the API server that gave it, as the Python servers' do, and is
    /// counted by its route (`route_metrics`).
    pub async fn handle(self: Arc<Self>, request: Request<Body>) -> Result<Reply, Infallible> {
        let index = self.client_index;
        let metrics = self.metrics.clone();
        let path = request.uri().path();
        let counting = route_metrics::Counting::start(&metrics.requests, request.method(), path);
        let mut reply = self.route(request).await;
        counting.answered(&reply);
        let tag = hyper::header::HeaderValue::from(index);
        reply.headers_mut().insert("x-rankcast-api-server", tag);
        Ok(reply)
    }

    async fn route(self: Arc<Self>, request: Request<Body>) -> Reply {
        let path = request.uri().path().to_string();
        if self.drain.draining() {
            let mut reply = error(
                StatusCode::SERVICE_UNAVAILABLE,
                "The server is shutting down; retry elsewhere.",
                None,
            );
            let retry = hyper::header::HeaderValue::from(RETRY_AFTER_S);
            reply.headers_mut().insert("retry-after", retry);
            return route_metrics::unrouted(reply);
        }
        if let (Some(key), true) = (&self.api_key, path.starts_with("/v1")) {
            // `Authorization: Bearer KEY`, or `x-api-key: KEY` as Anthropic's clients send it.
            let header = |name| request.headers().get(name).and_then(|v| v.to_str().ok());
            let bearer = header("authorization") == Some(format!("Bearer {key}").as_str());
            if !bearer && header("x-api-key") != Some(key.as_str()) {
                let refusal = chat_turn::ApiError::new(
                    StatusCode::UNAUTHORIZED,
                    "Invalid or missing API key.",
                    None,
                );
                return errors::reply(&path, &refusal);
            }
        }
        match (request.method(), path.as_str()) {
            (&Method::GET, "/health") => self.health(),
            // vLLM's (SageMaker's) probe: /health's status, no body.
            (&Method::GET | &Method::POST, "/ping") => Response::builder()
                .status(self.health().status())
                .body(Body::empty())
                .expect("a response"),
            // vLLM's: the completions in flight on this server.
            (&Method::GET, "/load") => {
                let load = object![("server_load", self.drain.in_flight())];
                text_reply(StatusCode::OK, load.response())
            }
            (&Method::GET, "/openapi.json") => Response::builder()
                .header("content-type", "application/json")
                .body(Body::from(openapi::document(self.tokenizer.vocab_size())))
                .expect("a static header"),
            (&Method::GET, "/version") => {
                let version = object![("version", env!("CARGO_PKG_VERSION"))];
                text_reply(StatusCode::OK, version.response())
            }
            (&Method::GET, "/kv_event_sources") => {
                text_reply(StatusCode::OK, self.discovery.kv_event_sources.response())
            }
            (&Method::GET, "/get_server_info") => self.dead().unwrap_or_else(|| {
                let info = self
                    .discovery
                    .server_info(&self.model_name, self.max_model_len);
                text_reply(StatusCode::OK, info.response())
            }),
            (&Method::POST, "/tokenize") => self.answer(request, tokenization::tokenize).await,
            (&Method::POST, "/detokenize") => {
                self.answer(request, |server, body| {
                    tokenization::detokenize(server, body)
                })
                .await
            }
            (&Method::POST, "/v1/chat/completions/render") => {
                self.answer(request, |server, body| server.render(body, true))
                    .await
            }
            (&Method::POST, "/v1/completions/render") => {
                self.answer(request, |server, body| server.render(body, false))
                    .await
            }
            (&Method::GET, "/v1/models") => json_reply(
                StatusCode::OK,
                &json!({"object": "list", "data": self.cards()}),
            ),
            (&Method::GET, id) if id.starts_with("/v1/models/") => {
                let wanted = &id["/v1/models/".len()..];
                match self.cards().into_iter().find(|card| card["id"] == wanted) {
                    Some(card) => json_reply(StatusCode::OK, &card),
                    None => error(
                        StatusCode::NOT_FOUND,
                        &format!("The model `{wanted}` does not exist."),
                        Some("model"),
                    ),
                }
            }
            (&Method::GET, "/metrics") => Response::builder()
                .header("content-type", "text/plain; version=0.0.4; charset=utf-8")
                .body(Body::from(self.metrics.exposition()))
                .expect("a response"),
            (&Method::GET, "/v1/lora_adapters") => self.dead().unwrap_or_else(|| {
                let data = self.views.read(|views| views.describe_adapters());
                json_reply(StatusCode::OK, &json!({ "data": data }))
            }),
            (&Method::GET, "/v1/engine_views") => self.dead().unwrap_or_else(|| {
                let data = self.views.read(|views| views.as_json());
                json_reply(StatusCode::OK, &json!({"object": "list", "data": data}))
            }),
            (&Method::GET, "/v1/events") => self.event_stream(&request),
            (&Method::GET, page) if page == "/dashboard" || page.starts_with("/dashboard/") => {
                match crate::dashboard::asset(&page["/dashboard".len()..]) {
                    Some((body, content_type)) => Response::builder()
                        .header("content-type", content_type)
                        .header("cache-control", "no-cache")
                        .body(Body::from(body))
                        .expect("a response"),
                    None => error(
                        StatusCode::NOT_FOUND,
                        &format!("no dashboard file {page:?}"),
                        None,
                    ),
                }
            }
            (&Method::POST, "/v1/completions") => self.generate(request, false).await,
            (&Method::POST, "/v1/chat/completions") => self.generate(request, true).await,
            (_, path) if responses::serves(path) => responses::route(self, request).await,
            (_, path) if messages::serves(path) => messages::route(self, request).await,
            (method, path) => methods::refusal(method, path).unwrap_or_else(|| {
                route_metrics::unrouted(error(
                    StatusCode::NOT_FOUND,
                    &format!("no route {path}"),
                    None,
                ))
            }),
        }
    }

    /// `/health`: this server's engine core up (with its incarnation) or not; 503 with the
    /// fleet's progress until every API server of the fleet has started.
    fn health(&self) -> Reply {
        if !self.engine.alive() {
            return error(
                StatusCode::SERVICE_UNAVAILABLE,
                "the engine core is not running",
                None,
            );
        }
        let incarnation = self.events.incarnation(self.engine_index);
        let engine = json!({"engine": self.engine_index, "up": true, "incarnation": incarnation});
        match self.fleet.starting() {
            None => json_reply(StatusCode::OK, &json!({"engines": [engine]})),
            Some(fleet) => {
                let body = json!({"engines": [engine], "fleet": fleet});
                let mut reply = json_reply(StatusCode::SERVICE_UNAVAILABLE, &body);
                let retry = hyper::header::HeaderValue::from(RETRY_AFTER_S);
                reply.headers_mut().insert("retry-after", retry);
                reply
            }
        }
    }

    /// An engine-backed route that reads a JSON body and answers JSON: a 503 once the engine
    /// core is gone, the refusal's error otherwise.
    async fn answer(
        &self,
        request: Request<Body>,
        handle: impl FnOnce(&Server, &Map<String, Value>) -> Result<Json, BadRequest>,
    ) -> Reply {
        if let Some(reply) = self.dead() {
            return reply;
        }
        let body = match read_body(request).await {
            Ok(body) => body,
            Err(reply) => return reply,
        };
        match handle(self, &body) {
            Ok(answer) => text_reply(StatusCode::OK, answer.response()),
            Err(refused) => refused.reply(),
        }
    }

    /// `/v1/chat/completions/render` (`chat`) and `/v1/completions/render`: what the
    /// generation route would send the engine, after the same checks, as vLLM's
    /// `GenerateRequest` (a list of one for a completion, as vLLM answers).
    fn render(&self, body: &Map<String, Value>, chat: bool) -> Result<Json, BadRequest> {
        let prepared = self.prepare(body, chat)?;
        let rendered = discovery::generate_request(&self.request_id(chat), &prepared);
        Ok(if chat {
            rendered
        } else {
            Json::Array(vec![rendered])
        })
    }

    /// A new request id, unique among every server of the fleet (its index is in it).
    pub(crate) fn request_id(&self, chat: bool) -> String {
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        let prefix = if chat { "chatcmpl" } else { "cmpl" };
        format!(
            "{prefix}-rs{}-{n}-{:x}",
            self.client_index,
            now_f64().to_bits()
        )
    }

    /// The base model, then every registered adapter as a model of its own (as the Python
    /// servers list them).
    fn cards(&self) -> Vec<Value> {
        let base = json!({"id": self.model_name, "object": "model", "created": now(),
                          "owned_by": "rankcast", "root": self.model_origin, "parent": null,
                          "max_model_len": self.max_model_len});
        let mut cards = vec![base.clone()];
        for name in self.views.read(|views| views.adapter_names()) {
            let mut card = base.clone();
            card["id"] = json!(name);
            card["root"] = json!(name);
            card["parent"] = json!(self.model_name);
            cards.push(card);
        }
        cards
    }

    /// `/v1/events`: `type`/`key` filters in the query, `Last-Event-ID` to resume.
    fn event_stream(&self, request: &Request<Body>) -> Reply {
        let last = request
            .headers()
            .get("last-event-id")
            .and_then(|v| v.to_str().ok());
        let filter = crate::events::Filter::parse(request.uri().query());
        match self.events.subscribe(last) {
            Ok((live, replay, notice)) => {
                let (sender, body) = Body::channel();
                tokio::spawn(crate::events::stream(sender, filter, replay, notice, live));
                Response::builder()
                    .header("content-type", "text/event-stream")
                    .header("cache-control", "no-cache")
                    .body(body)
                    .expect("a response")
            }
            Err(message) => error(StatusCode::BAD_REQUEST, &message, Some("Last-Event-ID")),
        }
    }

    /// A 503 when the engine core has died (None while it runs): every engine-backed route
    /// starts here, as the Python servers' do.
    fn dead(&self) -> Option<Reply> {
        if self.engine.alive() {
            return None;
        }
        Some(error(
            StatusCode::SERVICE_UNAVAILABLE,
            "the engine core is not running",
            None,
        ))
    }

    async fn generate(self: Arc<Self>, request: Request<Body>, chat: bool) -> Reply {
        if let Some(reply) = self.dead() {
            return reply;
        }
        let body = match read_body(request).await {
            Ok(body) => body,
            Err(reply) => return reply,
        };
        match self.prepare(&body, chat) {
            Ok(prepared) => self.run(prepared, chat).await,
            Err(refused) => refused.reply(),
        }
    }

    /// The adapter `requested` names (None: the base model), as the Python servers'
    /// `check_model` finds it: a 404 for a name that is neither.
    pub(crate) fn lora_for(&self, requested: Option<&str>) -> Result<Option<String>, BadRequest> {
        let Some(model) = requested.filter(|model| *model != self.model_name) else {
            return Ok(None);
        };
        if !self
            .views
            .read(|v| v.adapter_names().iter().any(|n| n == model))
        {
            return Err(BadRequest(
                format!("The model `{model}` does not exist."),
                Some("model".into()),
                StatusCode::NOT_FOUND,
            ));
        }
        // Refused while every device slot holds another pinned adapter (the engine core
        // checks the same at submission; this gives the client a 400).
        if let Some(refusal) = self.views.read(|v| v.refusal(model)) {
            return Err(BadRequest(
                refusal,
                Some("model".into()),
                StatusCode::BAD_REQUEST,
            ));
        }
        Ok(Some(model.to_string()))
    }

    /// The prompt text of `messages` through the model's chat template (as the Python
    /// servers' `render_chat` gives it), or the 400 they answer without a template.
    pub(crate) fn render_chat(
        &self,
        messages: &[fields::Message],
        add_generation_prompt: bool,
    ) -> Result<String, BadRequest> {
        let Some(template) = &self.template else {
            return bad(
                "this model has no chat template; use a plain completion prompt",
                "messages",
            );
        };
        let turns: Vec<(String, String)> = messages
            .iter()
            .map(|message| (message.role.clone(), message.text.clone()))
            .collect();
        Ok(template.render(&turns, add_generation_prompt))
    }

    /// A completion or chat request checked and made ready for the engine: what it generates
    /// and what `/v1/completions/render` and `/v1/chat/completions/render` show.
    pub(crate) fn prepare(
        &self,
        body: &Map<String, Value>,
        chat: bool,
    ) -> Result<Prepared, BadRequest> {
        // The fields the Python servers' schema reads as this one does (`fields`) first, in
        // its order, as they check a body before anything else.
        let mut messages = Vec::new();
        let mut prompt = None;
        let mut invalid = fields::Invalid::default();
        let n = crate::sampling::read_n(&mut invalid, body);
        let (mut echo, mut best_of) = (false, None);
        if chat {
            match body.get("messages") {
                None => invalid.missing(body, "", "messages"),
                Some(given) => messages = fields::messages(&mut invalid, "messages", given, 1),
            }
        } else {
            prompt = fields::prompt(&mut invalid, body);
            (echo, best_of) = crate::sampling::read_completion_fields(&mut invalid, body);
        }
        if !invalid.is_empty() {
            return Err(invalid.into());
        }
        let samples = crate::sampling::samples(n, best_of, echo, body)
            .map_err(|refusal| BadRequest::new(refusal, None))?;
        // The base model, or an adapter the engine registered; responses name it as asked.
        let requested = body.get("model").and_then(Value::as_str);
        let lora_name = self.lora_for(requested)?;
        let model = requested.unwrap_or(&self.model_name).to_string();
        // What the Python servers do and this one does not do yet is refused by name, never
        // ignored (the answer would look right and mean something else).
        let refused = if chat { &[][..] } else { &CHAT_ONLY[..] };
        for unsupported in NOT_SERVED_YET.iter().chain(refused) {
            let given = body
                .get(*unsupported)
                .is_some_and(|v| !v.is_null() && v != &Value::Bool(false));
            if given {
                return bad(
                    format!("{unsupported} is not served by the Rust frontend yet"),
                    unsupported,
                );
            }
        }
        let structured = shape::structured(body)?;
        let mut parsing = None;
        let mut prompt_text = None;
        let prompt_ids: Vec<u32> = if chat {
            let auto_tools = shape::auto_tools(body, self.parsers.hermes_tools)?;
            shape::check_template_variables(body)?;
            // The templates this server renders read neither `tools` nor the request's
            // `chat_template_kwargs` (chat.rs), so the prompt is what Jinja gives with them.
            // No content (an assistant's turn of tool calls) is empty text, as the Python
            // servers give it to the template.
            let prompt = self.render_chat(&messages, true)?;
            parsing = Parsing::new(self.parsers, &prompt, structured.is_some(), auto_tools);
            self.tokenizer.encode(&prompt)
        } else {
            match prompt {
                Some(fields::Prompt::Text(text)) => {
                    let ids = self.tokenizer.encode(&text);
                    prompt_text = Some(text);
                    ids
                }
                Some(fields::Prompt::Ids(ids)) => {
                    let vocab = self.tokenizer.vocab_size() as i64;
                    if ids.iter().any(|&id| id >= vocab) {
                        return bad(
                            format!("prompt token ids must be in [0, {vocab})"),
                            "prompt",
                        );
                    }
                    ids.into_iter().map(|id| id as u32).collect()
                }
                None => unreachable!("a completion's prompt was checked to be given"),
            }
        };
        if prompt_ids.is_empty() {
            return bad(
                "the prompt is empty",
                if chat { "messages" } else { "prompt" },
            );
        }
        let asked = match integer(body, "max_completion_tokens")? {
            Some(m) => Some(m),
            None => integer(body, "max_tokens")?,
        };
        // As the Python servers ask: a chat without a limit runs to the model's length (the
        // engine's reading of none), a completion takes 16 tokens.
        let max_tokens = if chat { asked } else { asked.or(Some(16)) };
        context_check(self.max_model_len, prompt_ids.len(), max_tokens, chat)?;
        let mut params = sampling(body, max_tokens)?;
        params.logprobs = requested_logprobs(body, chat)?;
        if structured.is_some() && params.ignore_eos {
            return Err(BadRequest(
                "ignore_eos cannot be combined with structured outputs: the output ends where \
                 its shape does"
                    .into(),
                None,
                StatusCode::BAD_REQUEST,
            ));
        }
        params.structured = structured;
        let include_usage = body
            .get("stream_options")
            .and_then(|o| o.get("include_usage"))
            .and_then(Value::as_bool)
            .unwrap_or(false);
        Ok(Prepared {
            lora_name,
            model,
            prompt_ids,
            prompt_text,
            samples,
            skip_special: params.skip_special_tokens,
            top_logprobs: params.logprobs.map(|top| top as usize),
            params,
            stream: flag(body, "stream", false)?,
            include_usage,
            parsing,
            reasoning_fields: chat && self.parsers.qwen3_reasoning,
        })
    }
}

pub(crate) struct Prepared {
    pub(crate) lora_name: Option<String>,
    /// The model as the request named it (the base model's name when it named none).
    pub(crate) model: String,
    pub(crate) prompt_ids: Vec<u32>,
    /// A completion's prompt as given in text (None: token ids, or a chat).
    pub(crate) prompt_text: Option<String>,
    /// The samples drawn and answered (`n`, `best_of`) and whether the prompt is echoed.
    pub(crate) samples: crate::sampling::Samples,
    pub(crate) params: SamplingParams,
    pub(crate) skip_special: bool,
    pub(crate) stream: bool,
    pub(crate) include_usage: bool,
    /// How many alternatives each position's logprobs list, when logprobs were asked for.
    pub(crate) top_logprobs: Option<usize>,
    /// How the chat's output is read (None: all of it is content).
    pub(crate) parsing: Option<Parsing>,
    /// The answer has `reasoning` and `reasoning_content` fields (the server reads reasoning).
    pub(crate) reasoning_fields: bool,
}

/// Which parsers read a chat's output, decided with its prompt (Python's `output_parser`).
#[derive(Clone, Copy)]
pub(crate) struct Parsing {
    /// The reasoning parser's (`opened`, `constrained`), when the server reads reasoning.
    think: Option<(bool, bool)>,
    /// The request leaves its tools to the model, and the server reads the calls it writes.
    tools: bool,
}

impl Parsing {
    /// The parsing of a chat with `prompt`: reasoning when the server reads it (from inside
    /// the block when the template left `<think>` open; `constrained` by a grammar), tool
    /// calls when `auto_tools`; None when neither.
    fn new(parsers: Parsers, prompt: &str, constrained: bool, auto_tools: bool) -> Option<Parsing> {
        let think = parsers
            .qwen3_reasoning
            .then(|| (prompt_opens_think(prompt), constrained));
        (think.is_some() || auto_tools).then_some(Parsing {
            think,
            tools: auto_tools,
        })
    }

    pub(crate) fn parser(self) -> OutputParser {
        OutputParser {
            think: self
                .think
                .map(|(opened, constrained)| ThinkParser::new(opened, constrained, self.tools)),
            tools: self.tools.then(HermesToolParser::default),
        }
    }
}
