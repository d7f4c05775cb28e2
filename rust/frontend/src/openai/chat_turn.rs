//! One assistant turn as every chat-shaped API produces it (`rankcast/api_server/chat_turn.py`
//! is the Python half): the engine request a chat body starts, and its output read back as
//! typed pieces (reasoning, content, tool calls).
//!
//! `/v1/responses` and `/v1/messages` translate their requests into the chat body
//! `/v1/chat/completions` would be given for the same conversation (`ChatBody`) and run it
//! here, checked, prompted, shaped and sampled as the Python servers do it, so that the same
//! conversation gives the same prompt tokens and the same text from every API server of a
//! fleet. Forced tool calls and JSON schemas are grammars the engine builds (the JSON schema
//! travels in the request; a schema the engine cannot build ends the request with its error).

use std::time::Instant;

use hyper::StatusCode;
use rankcast_client::wire::protocol::EngineCoreRequest;
use rankcast_client::wire::sampling::{SamplingParams, StructuredOutputs};
use rankcast_client::wire::Value;
use rankcast_frontend::object;
use rankcast_frontend::output_parsers::{uuid4_hex, OutputParser, ToolCall};
use rankcast_frontend::pyjson::{str_repr, Json};
use rankcast_text::IncrementalDetokenizer;
use tokio::sync::mpsc::UnboundedReceiver;

use super::{now_f64, Parsers, Parsing, Server};
use crate::drain::InFlight;
use crate::engine::Event;

/// An error answer, in whichever API's shape the route gives it: status, message, and the
/// field it names.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub param: Option<String>,
    /// The server is shutting down: the answer says when to retry (elsewhere).
    pub retry_after: bool,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>, param: Option<&str>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            param: param.map(str::to_string),
            retry_after: false,
        }
    }

    pub fn bad(message: impl Into<String>, param: Option<&str>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, message, param)
    }

    /// Every engine-backed route starts by checking the engine core runs.
    pub fn engine_down() -> ApiError {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "The engine core is not running.",
            None,
        )
    }
}

/// A turn that ended without its finish reason, as a whole (not streamed) answer gives it.
impl From<TurnFailure> for ApiError {
    fn from(failure: TurnFailure) -> ApiError {
        match failure {
            TurnFailure::Rejected(why, field) => ApiError::bad(why, field),
            TurnFailure::EngineDead(why) => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("The engine core is not running: {why}"),
                None,
            ),
            TurnFailure::Shutdown(why) => ApiError {
                retry_after: true,
                ..ApiError::new(StatusCode::SERVICE_UNAVAILABLE, why, None)
            },
        }
    }
}

/// A chat message as the chat body holds it: role and text, and the fields beyond them that
/// the template may read (an assistant's `tool_calls`, a tool's `tool_call_id`).
#[derive(Clone)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    pub extra: Vec<(String, Json)>,
}

impl ChatMessage {
    pub fn new(role: &str, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.to_string(),
            content: content.into(),
            extra: Vec::new(),
        }
    }

    /// As Python's `ChatMessage.model_dump(exclude_none=True)`: role, content, then the rest.
    pub fn to_json(&self) -> Json {
        let mut fields = vec![
            ("role".to_string(), Json::from(self.role.as_str())),
            ("content".to_string(), Json::from(self.content.as_str())),
        ];
        fields.extend(self.extra.iter().cloned());
        Json::Object(fields)
    }

    /// A stored message (`to_json`'s shape) back; None for anything else.
    pub fn from_json(value: &Json) -> Option<ChatMessage> {
        let Json::Object(fields) = value else {
            return None;
        };
        let mut message = ChatMessage::new("", "");
        for (key, value) in fields {
            match (key.as_str(), value) {
                ("role", Json::Str(role)) => message.role = role.clone(),
                ("content", Json::Str(text)) => message.content = text.clone(),
                ("content", Json::Null) => {}
                _ => message.extra.push((key.clone(), value.clone())),
            }
        }
        (!message.role.is_empty()).then_some(message)
    }
}

/// A function tool as chat's `tools` carries it, less what only a template would read (the
/// templates this server renders read no tools: chat.rs).
#[derive(Clone)]
pub struct FunctionTool {
    pub name: String,
    pub parameters: Option<Json>,
}

pub enum ToolChoice {
    None,
    Auto,
    Required,
    Named(String),
}

/// `response_format`: a JSON schema (with the name it was given) or any JSON object.
pub enum OutputFormat {
    JsonSchema { name: String, schema: Json },
    JsonObject,
}

/// The `/v1/chat/completions` body of a conversation, as the newer APIs translate theirs.
#[derive(Default)]
pub struct ChatBody {
    pub model: Option<String>,
    pub messages: Vec<ChatMessage>,
    pub max_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub stop: Vec<String>,
    pub tools: Vec<FunctionTool>,
    pub tool_choice: Option<ToolChoice>,
    pub response_format: Option<OutputFormat>,
}

impl ChatBody {
    /// What `ChatCompletionRequest` refuses of a translated body: its first error, in its
    /// fields' order (the sampling fields come before `messages`).
    pub fn check(&self) -> Result<(), ApiError> {
        if self.stop.len() > 16 || self.stop.iter().any(String::is_empty) {
            return Err(ApiError::bad(
                "stop: stop must be up to 16 non-empty strings",
                Some("stop"),
            ));
        }
        if let Some(OutputFormat::JsonSchema { name, .. }) = &self.response_format {
            if name.chars().count() > 64 {
                return Err(ApiError::bad(
                    "response_format.json_schema.name: String should have at most 64 characters",
                    Some("response_format.json_schema.name"),
                ));
            }
        }
        if self.messages.is_empty() {
            return Err(ApiError::bad(
                "messages: List should have at least 1 item after validation, not 0",
                Some("messages"),
            ));
        }
        Ok(())
    }

    /// Tools with `tool_choice` auto (the default): the model calls them itself.
    fn auto_tools(&self) -> bool {
        !self.tools.is_empty() && matches!(self.tool_choice, None | Some(ToolChoice::Auto))
    }
}

/// How a tool-forcing request's output becomes tool calls (structured.py's `ToolCallShape`):
/// for a named function the output is its arguments; for `required` a JSON list of
/// `{"name": ..., "parameters": {...}}`, one per call.
pub struct ToolCallShape {
    function: Option<String>,
}

impl ToolCallShape {
    /// The calls `text` holds; None when it holds none (an output cut short is not JSON).
    fn calls(&self, text: &str) -> Option<Vec<ToolCall>> {
        let value = Json::parse(text)?;
        let pairs = match &self.function {
            Some(function) => vec![(Json::from(function.as_str()), value)],
            None => {
                let Json::Array(items) = value else {
                    return None;
                };
                if !items.iter().all(|item| matches!(item, Json::Object(_))) {
                    return None;
                }
                items
                    .iter()
                    .map(|call| {
                        let field = |key| call.get(key).cloned().unwrap_or(Json::Null);
                        (field("name"), field("parameters"))
                    })
                    .collect()
            }
        };
        let calls = pairs
            .into_iter()
            .map(|(name, arguments)| ToolCall {
                id: format!("call_{}", &uuid4_hex()[..24]),
                name: match name {
                    Json::Str(name) => name,
                    other => other.dumps(),
                },
                arguments: arguments.dumps_ascii(),
            })
            .collect();
        Some(calls)
    }
}

/// The grammar of a function's arguments: its parameters, or any object.
fn parameters(tool: &FunctionTool) -> Json {
    tool.parameters
        .clone()
        .unwrap_or_else(|| object![("type", "object"), ("properties", object![])])
}

/// The output shape the body asks for, and for forced tool calls how to read them back
/// (structured.py's `requested_shape`); `hermes`: this server reads the calls a model writes.
fn requested_shape(body: &ChatBody, hermes: bool) -> Result<Shape, ApiError> {
    let mut asked: Vec<(&'static str, StructuredOutputs)> = Vec::new();
    match &body.response_format {
        Some(OutputFormat::JsonSchema { schema, .. }) => {
            asked.push(("response_format", json_schema(schema)));
        }
        Some(OutputFormat::JsonObject) => {
            let any_object = StructuredOutputs {
                json: None,
                json_object: true,
                regex: None,
                choice: None,
                grammar: None,
            };
            asked.push(("response_format", any_object));
        }
        None => {}
    }
    let mut forced = None;
    if !body.tools.is_empty() {
        match body.tool_choice.as_ref().unwrap_or(&ToolChoice::Auto) {
            ToolChoice::None => {}
            ToolChoice::Auto if hermes => {}
            ToolChoice::Auto => {
                return Err(ApiError::bad(
                    "tool_choice 'auto' (the default when tools are given) needs a parser of \
                     the model's own tool-call format, which this server was not started with \
                     (--enable-auto-tool-choice --tool-call-parser hermes); use tool_choice \
                     'required', a named function, or 'none'",
                    Some("tool_choice"),
                ))
            }
            ToolChoice::Named(name) => {
                let Some(tool) = body.tools.iter().find(|t| &t.name == name) else {
                    return Err(ApiError::bad(
                        format!(
                            "tool_choice names {}, which is not in tools",
                            str_repr(name)
                        ),
                        Some("tools"),
                    ));
                };
                forced = Some(ToolCallShape {
                    function: Some(tool.name.clone()),
                });
                asked.push(("tools", json_schema(&parameters(tool))));
            }
            ToolChoice::Required => {
                let calls: Vec<Json> = body
                    .tools
                    .iter()
                    .map(|tool| {
                        object![
                            ("type", "object"),
                            (
                                "properties",
                                object![
                                    ("name", object![("const", tool.name.as_str())]),
                                    ("parameters", parameters(tool)),
                                ]
                            ),
                            ("required", vec!["name", "parameters"]),
                            ("additionalProperties", false),
                        ]
                    })
                    .collect();
                forced = Some(ToolCallShape { function: None });
                let array = object![
                    ("type", "array"),
                    ("minItems", 1u64),
                    ("items", object![("anyOf", calls)]),
                ];
                asked.push(("tools", json_schema(&array)));
            }
        }
    }
    if asked.len() > 1 {
        let named: Vec<&str> = asked.iter().map(|(field, _)| *field).collect();
        return Err(ApiError::bad(
            format!("give at most one output shape, got {}", named.join(", ")),
            Some(asked[1].0),
        ));
    }
    let Some((field, structured)) = asked.pop() else {
        return Ok((None, None, None));
    };
    Ok((Some(structured), forced, Some(field)))
}

/// The shape of a JSON schema (the engine builds its grammar, and refuses one it cannot).
fn json_schema(schema: &Json) -> StructuredOutputs {
    StructuredOutputs {
        json: Some(to_wire(schema)),
        json_object: false,
        regex: None,
        choice: None,
        grammar: None,
    }
}

/// The grammar a request's output follows, how forced tool calls are read back, and the field
/// that asked for them.
type Shape = (
    Option<StructuredOutputs>,
    Option<ToolCallShape>,
    Option<&'static str>,
);

/// A JSON value as the wire carries it (a schema is a msgpack map, as Python's dict is).
fn to_wire(value: &Json) -> Value {
    match value {
        Json::Null => Value::Nil,
        Json::Bool(b) => Value::Bool(*b),
        // Integers past 64 bits were refused with the request (`unrepresentable`).
        Json::Int(digits) => digits
            .parse::<i128>()
            .map_or_else(|_| Value::Float(f64::NAN), Value::Int),
        Json::Float(x) => Value::Float(*x),
        Json::Str(s) => Value::Str(s.clone()),
        Json::Array(items) => Value::Array(items.iter().map(to_wire).collect()),
        Json::Object(fields) => Value::Map(
            fields
                .iter()
                .map(|(key, value)| (Value::Str(key.clone()), to_wire(value)))
                .collect(),
        ),
    }
}

/// A chat request running on the engine: what its answer names, and how to read its output.
pub struct ChatTurn {
    pub request_id: String,
    /// As the request named it (an adapter's name, or the base model's).
    pub model: String,
    pub prompt_tokens: usize,
    /// The engine core serving it (the `x-rankcast-engine` header).
    pub engine: i64,
    forced: Option<ToolCallShape>,
    /// The field that gave the output's shape (`response_format`, `tools`), if one did.
    shape: Option<&'static str>,
    parsing: Option<Parsing>,
    stops: Vec<String>,
    events: UnboundedReceiver<Event>,
    arrival: Instant,
    _in_flight: InFlight,
}

impl Server {
    /// The base model (None) or the adapter `model` names, checked as the Python servers'
    /// `check_model` does.
    pub(super) fn check_model(&self, model: Option<&str>) -> Result<Option<String>, ApiError> {
        let Some(model) = model.filter(|m| *m != self.model_name) else {
            return Ok(None);
        };
        if !self
            .views
            .read(|v| v.adapter_names().iter().any(|n| n == model))
        {
            return Err(ApiError::new(
                StatusCode::NOT_FOUND,
                format!("The model `{model}` does not exist."),
                Some("model"),
            ));
        }
        if let Some(refusal) = self.views.read(|v| v.refusal(model)) {
            return Err(ApiError::bad(refusal, Some("model")));
        }
        Ok(Some(model.to_string()))
    }

    /// The prompt text and token ids of `messages` through the model's chat template.
    pub(super) fn chat_prompt(
        &self,
        messages: &[ChatMessage],
    ) -> Result<(String, Vec<u32>), ApiError> {
        let Some(template) = &self.template else {
            return Err(ApiError::bad(
                "this model has no chat template; use a plain completion prompt",
                Some("messages"),
            ));
        };
        let turns: Vec<(String, String)> = messages
            .iter()
            .map(|m| (m.role.clone(), m.content.clone()))
            .collect();
        let prompt = template.render(&turns, true);
        let ids = self.tokenizer.encode(&prompt);
        Ok((prompt, ids))
    }

    /// Check `body` as `/v1/chat/completions` would and submit it.
    pub(super) fn start_chat(
        &self,
        body: &ChatBody,
        request_id: String,
    ) -> Result<ChatTurn, ApiError> {
        body.check()?;
        let lora_name = self.check_model(body.model.as_deref())?;
        let (structured, forced, shape) = requested_shape(body, self.parsers.hermes_tools)?;
        let (prompt, prompt_ids) = self.chat_prompt(&body.messages)?;
        let parsing = Parsing::new(
            Parsers {
                qwen3_reasoning: self.parsers.qwen3_reasoning && forced.is_none(),
                ..self.parsers
            },
            &prompt,
            structured.is_some(),
            self.parsers.hermes_tools && body.auto_tools(),
        );
        let limit = self.max_model_len;
        let prompt_len = prompt_ids.len() as i64;
        if prompt_len >= limit {
            return Err(ApiError::bad(
                format!(
                    "This model's maximum context length is {limit} tokens. However, your \
                     request has {prompt_len} prompt tokens, leaving no room to generate. Please \
                     shorten the prompt."
                ),
                Some("messages"),
            ));
        }
        if let Some(max) = body.max_tokens {
            if prompt_len + max > limit {
                return Err(ApiError::bad(
                    format!(
                        "This model's maximum context length is {limit} tokens. However, you \
                         requested {} tokens ({prompt_len} in the prompt, {max} for the \
                         completion). Please reduce the prompt or max_tokens.",
                        prompt_len + max
                    ),
                    Some("max_tokens"),
                ));
            }
        }
        let params = SamplingParams {
            temperature: body.temperature.unwrap_or(1.0),
            top_p: body.top_p.unwrap_or(1.0),
            top_k: body.top_k.unwrap_or(0),
            max_tokens: Some(body.max_tokens.unwrap_or(limit - prompt_len)),
            stop: body.stop.clone(),
            structured,
            ..SamplingParams::default()
        };
        let in_flight = self.drain.enter();
        let events = self.engine.generate(EngineCoreRequest {
            request_id: request_id.clone(),
            prompt_token_ids: prompt_ids.iter().map(|&t| i64::from(t)).collect(),
            sampling_params: params,
            arrival_time: now_f64(),
            client_index: self.client_index,
            lora_name,
            // One engine core behind a Rust API server: no choice was made.
            routing_reason: String::new(),
            routing_expected_prefix_tokens: 0,
        });
        Ok(ChatTurn {
            request_id,
            model: body
                .model
                .clone()
                .unwrap_or_else(|| self.model_name.clone()),
            prompt_tokens: prompt_ids.len(),
            engine: self.engine_index,
            forced,
            shape,
            parsing,
            stops: body.stop.clone(),
            events,
            arrival: Instant::now(),
            _in_flight: in_flight,
        })
    }
}

/// Why a turn ended without its finish reason.
pub enum TurnFailure {
    /// The engine refused the request (Python's `RequestRejectedError`), and the field that
    /// made it refuse, when one did.
    Rejected(String, Option<&'static str>),
    /// The engine core died.
    EngineDead(String),
    /// This server is shutting down and its grace period is over.
    Shutdown(String),
}

/// Where msgspec says the engine found a request's output shape it could not build.
const SHAPE_REFUSED: &str = " - at `$[3].structured`";

/// How a turn finished: its finish reason, the stop string that ended it (if one did), all its
/// text and how many tokens it generated.
pub struct Finish {
    pub reason: String,
    pub stop_string: Option<String>,
    pub text: String,
    pub tokens: usize,
}

/// A turn's output as it arrives: each engine output's new text (held back while it could be
/// the start of a stop string), the last with how it finished. Dropped before the end, the
/// request is aborted in the engine (the client went away).
pub struct TurnOutputs<'a> {
    pub turn: ChatTurn,
    server: &'a Server,
    detokenizer: IncrementalDetokenizer<'a>,
    text: String,
    shown: usize,
    tokens: usize,
    last_token_at: Option<Instant>,
    done: bool,
}

impl<'a> TurnOutputs<'a> {
    pub fn new(server: &'a Server, turn: ChatTurn) -> TurnOutputs<'a> {
        TurnOutputs {
            turn,
            server,
            detokenizer: IncrementalDetokenizer::new(&server.tokenizer, true),
            text: String::new(),
            shown: 0,
            tokens: 0,
            last_token_at: None,
            done: false,
        }
    }

    /// The next output's new text, and how the turn finished when this was its last.
    pub async fn next(&mut self) -> Result<(String, Option<Finish>), TurnFailure> {
        let server = self.server;
        let mut cut = server.drain.cut_signal();
        let event = tokio::select! {
            event = self.turn.events.recv() => event,
            _ = cut.changed() => return Err(TurnFailure::Shutdown(server.drain.message())),
        };
        let output = match event {
            Some(Event::Output(output)) => output,
            Some(Event::EngineDead(why)) => return Err(TurnFailure::EngineDead(why)),
            None => {
                let why = "the engine core stopped answering".to_string();
                return Err(TurnFailure::EngineDead(why));
            }
        };
        if let Some(error) = output.error {
            self.done = true; // the engine has ended it
                              // A shape whose grammar cannot be built fails where the engine decodes it (msgspec
                              // names the place): said as the Python servers say it, naming the field.
            return Err(match (error.strip_suffix(SHAPE_REFUSED), self.turn.shape) {
                (Some(why), Some(field)) => {
                    TurnFailure::Rejected(format!("{field}: {why}"), Some(field))
                }
                _ => TurnFailure::Rejected(error, None),
            });
        }
        for &id in &output.new_token_ids {
            self.tokens += 1;
            self.text.push_str(&self.detokenizer.push(id as u32));
        }
        self.record_timing(output.new_token_ids.len() as u32);
        let mut reason = output.finish_reason.clone();
        if reason.is_some() {
            self.text.push_str(&self.detokenizer.finish());
        }
        // The stop string that ends the text: the earliest, the first given on a tie.
        let mut stop_string = None;
        let mut safe = self.text.len();
        if !self.turn.stops.is_empty() {
            let found = self
                .turn
                .stops
                .iter()
                .filter_map(|s| self.text.find(s.as_str()).map(|at| (at, s)))
                .min_by_key(|(at, _)| *at);
            if let Some((at, stop)) = found {
                self.text.truncate(at);
                stop_string = Some(stop.clone());
                if reason.is_none() {
                    server.engine.abort(&self.turn.request_id);
                }
                reason = Some("stop".into());
            } else {
                // Hold back what could still begin a stop string (its length less one, in
                // characters, as Python counts them).
                let longest = self.turn.stops.iter().map(|s| s.chars().count()).max();
                let hold = longest.unwrap_or(1) - 1;
                if hold > 0 {
                    safe = self
                        .text
                        .char_indices()
                        .rev()
                        .nth(hold - 1)
                        .map_or(0, |(at, _)| at);
                }
            }
        }
        let visible = if reason.is_some() {
            self.text.len()
        } else {
            safe.max(self.shown)
        };
        let delta = self.text[self.shown..visible].to_string();
        self.shown = visible;
        let Some(reason) = reason else {
            return Ok((delta, None));
        };
        self.done = true;
        server.metrics.requests.record_finished(
            server.engine_index,
            self.turn.arrival.elapsed().as_secs_f64(),
            self.turn.prompt_tokens,
            self.tokens,
            &reason,
        );
        let finish = Finish {
            reason,
            stop_string,
            text: self.text.clone(),
            tokens: self.tokens,
        };
        Ok((delta, Some(finish)))
    }

    /// Every output until the last: how the turn finished.
    pub async fn finish(&mut self) -> Result<Finish, TurnFailure> {
        loop {
            if let (_, Some(finish)) = self.next().await? {
                return Ok(finish);
            }
        }
    }

    /// Time to first token and inter-token latency, as the Python servers count them (tokens
    /// that arrive together share the gap since the previous ones).
    fn record_timing(&mut self, new: u32) {
        if new == 0 {
            return;
        }
        let now = Instant::now();
        let requests = &self.server.metrics.requests;
        match self.last_token_at {
            None => {
                requests.record_first_token((now - self.turn.arrival).as_secs_f64());
                if new > 1 {
                    requests.record_inter_token(0.0, new - 1);
                }
            }
            Some(last) => {
                requests.record_inter_token((now - last).as_secs_f64() / f64::from(new), new);
            }
        }
        self.last_token_at = Some(now);
    }
}

impl Drop for TurnOutputs<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.server.engine.abort(&self.turn.request_id);
        }
    }
}

/// What the model's answer is made of: text of one kind, or a complete tool call.
#[derive(Clone)]
pub enum Piece {
    Text(TextKind, String),
    Call(ToolCall),
}

#[derive(Clone, Copy, PartialEq)]
pub enum TextKind {
    /// What the model thought (`--reasoning-parser`).
    Reasoning,
    /// Its answer.
    Content,
}

/// Reads a turn's output into pieces, as it arrives (`feed`) or all at once (`whole`). A
/// forced tool call's JSON means nothing until it is whole: it is read when the output
/// finishes (as content if it is not valid JSON, as when max_tokens cut it).
pub struct TurnReader {
    forced: Option<ToolCallShape>,
    parser: Option<OutputParser>,
    /// How many tool calls were read.
    pub calls: usize,
}

impl TurnReader {
    pub fn new(turn: &mut ChatTurn) -> TurnReader {
        TurnReader {
            forced: turn.forced.take(),
            parser: turn.parsing.map(Parsing::parser),
            calls: 0,
        }
    }

    pub fn feed(&mut self, delta: &str, finish: Option<&Finish>) -> Vec<Piece> {
        if self.forced.is_some() {
            return finish.map_or_else(Vec::new, |f| self.forced(&f.text, &f.reason));
        }
        let Some(parser) = &mut self.parser else {
            return content(delta);
        };
        let (mut reasoning, mut parsed) = if delta.is_empty() {
            Default::default()
        } else {
            parser.feed(delta)
        };
        if finish.is_some() {
            let (last_reasoning, last) = parser.finish();
            reasoning.push_str(&last_reasoning);
            parsed.content.push_str(&last.content);
            parsed.calls.extend(last.calls);
        }
        let mut pieces = Vec::new();
        if !reasoning.is_empty() {
            pieces.push(Piece::Text(TextKind::Reasoning, reasoning));
        }
        pieces.extend(content(&parsed.content));
        self.calls += parsed.calls.len();
        pieces.extend(parsed.calls.into_iter().map(Piece::Call));
        pieces
    }

    /// Every piece of a finished output.
    pub fn whole(&mut self, finish: &Finish) -> Vec<Piece> {
        if self.forced.is_some() {
            return self.forced(&finish.text, &finish.reason);
        }
        let Some(parser) = &mut self.parser else {
            return content(&finish.text);
        };
        let parsed = parser.whole(&finish.text);
        let mut pieces = Vec::new();
        if let Some(reasoning) = parsed.reasoning {
            pieces.push(Piece::Text(TextKind::Reasoning, reasoning));
        }
        pieces.extend(content(&parsed.content));
        self.calls += parsed.calls.len();
        pieces.extend(parsed.calls.into_iter().map(Piece::Call));
        pieces
    }

    fn forced(&mut self, text: &str, reason: &str) -> Vec<Piece> {
        let shape = self.forced.as_ref().expect("a forced turn");
        let calls = if reason == "stop" {
            shape.calls(text)
        } else {
            None
        };
        let Some(calls) = calls else {
            return content(text);
        };
        self.calls += calls.len();
        calls.into_iter().map(Piece::Call).collect()
    }
}

fn content(text: &str) -> Vec<Piece> {
    if text.is_empty() {
        return Vec::new();
    }
    vec![Piece::Text(TextKind::Content, text.to_string())]
}
