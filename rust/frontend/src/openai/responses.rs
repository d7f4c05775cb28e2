//! OpenAI's Responses API (`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`), as
//! the Python servers answer it (`rankcast/api_server/openai_responses.py`), to the byte where
//! the content is the same.
//!
//! A Responses request is translated into the chat body of the same conversation
//! (`instructions` as the system message, input items as messages, `function_call` /
//! `function_call_output` items as the assistant's tool calls and their results, `text.format`
//! as `response_format`, flat function tools as chat tools), run as one chat turn
//! (`chat_turn.rs`), and answered as a response object with output items (`reasoning`,
//! `message`, `function_call`) or as the typed event stream (`response.created` ...
//! `response.completed`, each event numbered). With `store` (the default) the response and the
//! conversation it ends go to the fleet's store (`response_store.rs`), so `previous_response_id`
//! continues it on whichever API server, Python or Rust, the next request reaches.

use std::sync::Arc;

use hyper::body::Bytes;
use hyper::{Body, Method, Request, Response, StatusCode};
use rankcast_frontend::object;
use rankcast_frontend::output_parsers::{uuid4_hex, ToolCall};
use rankcast_frontend::pyjson::{str_repr, Json};

use super::chat_turn::{
    ApiError, ChatBody, ChatMessage, ChatTurn, Finish, FunctionTool, OutputFormat, Piece, TextKind,
    ToolChoice, TurnFailure, TurnOutputs, TurnReader,
};
use super::response_store::{store, StoredResponse};
use super::validate::{
    self, bool_field, defaulted, float_field, given, integer_field, optional, required, string,
    Field, Ty, INT_MAX, TOOL_NAME,
};
use super::{errors, methods, now, text_reply, Reply, Server};

const FUNCTION_TOOL: &[Field] = &[
    required("type", Ty::Literal(&["function"])),
    required("name", TOOL_NAME),
    optional("description", Ty::Str),
    optional("parameters", Ty::Dict),
    optional("strict", Ty::Bool),
];

const NAMED_FUNCTION: &[Field] = &[
    required("type", Ty::Literal(&["function"])),
    required("name", Ty::MinLen(1)),
];

/// `PlainFormat`: text, or any JSON object.
const PLAIN_FORMAT: &[Field] = &[required("type", Ty::Literal(&["text", "json_object"]))];

const JSON_SCHEMA_FORMAT: &[Field] = &[
    required("type", Ty::Literal(&["json_schema"])),
    optional("name", Ty::Str),
    optional("description", Ty::Str),
    required("schema", Ty::Dict),
    optional("strict", Ty::Bool),
];

const TEXT_CONFIG: &[Field] = &[optional(
    "format",
    Ty::Tagged(
        "type",
        &[
            ("text", PLAIN_FORMAT),
            ("json_object", PLAIN_FORMAT),
            ("json_schema", JSON_SCHEMA_FORMAT),
        ],
    ),
)];

/// `ResponsesRequest`'s fields, in its order.
const REQUEST: &[Field] = &[
    optional("model", Ty::Str),
    required("input", Ty::Union(&[Ty::Str, Ty::List(&Ty::Dict, 0, None)])),
    optional("instructions", Ty::Str),
    optional(
        "max_output_tokens",
        Ty::Int {
            ge: Some(1),
            le: Some(INT_MAX),
        },
    ),
    optional(
        "temperature",
        Ty::Float {
            ge: Some(0.0),
            gt: None,
            le: Some(2.0),
        },
    ),
    optional(
        "top_p",
        Ty::Float {
            ge: None,
            gt: Some(0.0),
            le: Some(1.0),
        },
    ),
    optional("tools", Ty::List(&Ty::Model(FUNCTION_TOOL), 0, None)),
    optional(
        "tool_choice",
        Ty::Union(&[
            Ty::Literal(&["none", "auto", "required"]),
            Ty::Model(NAMED_FUNCTION),
        ]),
    ),
    optional("parallel_tool_calls", Ty::Bool),
    optional("text", Ty::Model(TEXT_CONFIG)),
    defaulted("stream", Ty::Bool),
    defaulted("store", Ty::Bool),
    optional("previous_response_id", Ty::Str),
    optional("metadata", Ty::StrDict),
    defaulted(
        "background",
        Ty::False("background responses are not supported"),
    ),
];

/// Whether `path` is one of this module's routes.
pub fn serves(path: &str) -> bool {
    path == "/v1/responses" || path.starts_with("/v1/responses/")
}

pub async fn route(server: Arc<Server>, request: Request<Body>) -> Reply {
    let path = request.uri().path().to_string();
    let method = request.method().clone();
    let answer = if path == "/v1/responses" {
        match method {
            Method::POST => create(server, request).await,
            _ => return methods::not_allowed(&path, "POST"),
        }
    } else {
        let id = percent_decoded(&path["/v1/responses/".len()..]);
        if id.is_empty() || id.contains('/') {
            Err(ApiError::new(StatusCode::NOT_FOUND, "Not Found", None))
        } else {
            match method {
                Method::GET => stored(&id),
                Method::DELETE => delete(&id),
                // The first of the two routes on this path is GET's, as the Python servers'.
                _ => return methods::not_allowed(&path, "GET"),
            }
        }
    };
    answer.unwrap_or_else(|error| errors::reply(&path, &error))
}

/// A path segment as the Python servers see it (percent escapes decoded).
fn percent_decoded(segment: &str) -> String {
    let bytes = segment.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(byte)) => {
                out.push(byte);
                i += 3;
            }
            (byte, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn not_found(id: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        format!("Response with id '{id}' not found."),
        Some("response_id"),
    )
}

fn stored(id: &str) -> Result<Reply, ApiError> {
    let stored = store().get(id).ok_or_else(|| not_found(id))?;
    Ok(text_reply(StatusCode::OK, stored.response.response()))
}

fn delete(id: &str) -> Result<Reply, ApiError> {
    if !store().delete(id) {
        return Err(not_found(id));
    }
    let body = object![("id", id), ("object", "response"), ("deleted", true)];
    Ok(text_reply(StatusCode::OK, body.response()))
}

/// A validated `ResponsesRequest`.
struct ResponsesRequest {
    body: Json,
    input: Json,
    instructions: Option<String>,
    tools: Vec<Json>,
    tool_choice: Option<Json>,
    text_format: Option<Json>,
    stream: bool,
    store: bool,
    previous_response_id: Option<String>,
}

impl ResponsesRequest {
    fn parse(body: &Json) -> Result<ResponsesRequest, ApiError> {
        let body = validate::model(&[REQUEST], body)?;
        let tools = match given(&body, "tools") {
            Some(Json::Array(tools)) => tools.clone(),
            _ => Vec::new(),
        };
        let text_format = given(&body, "text")
            .and_then(|text| given(text, "format"))
            .cloned();
        // A choice that calls a tool needs tools to call (the model's own check, once its
        // fields are valid: no field is named).
        let tool_choice = given(&body, "tool_choice");
        let calls =
            tool_choice.is_some_and(|c| !matches!(c, Json::Str(s) if s == "none" || s == "auto"));
        if calls && tools.is_empty() {
            let choice = match tool_choice {
                Some(Json::Str(choice)) => str_repr(choice),
                Some(named) => format!(
                    "NamedFunction(type='function', name={})",
                    str_repr(&string(named, "name").unwrap_or_default())
                ),
                None => unreachable!("a choice that calls"),
            };
            return Err(ApiError::bad(
                format!("tool_choice {choice} needs tools"),
                None,
            ));
        }
        Ok(ResponsesRequest {
            input: body.get("input").cloned().unwrap_or(Json::Null),
            instructions: string(&body, "instructions"),
            tool_choice: given(&body, "tool_choice").cloned(),
            stream: bool_field(&body, "stream").unwrap_or(false),
            store: bool_field(&body, "store").unwrap_or(true),
            previous_response_id: string(&body, "previous_response_id"),
            tools,
            text_format,
            body,
        })
    }
}

fn part_text(part: &Json, at: &str) -> Result<String, ApiError> {
    let kind = part.get("type").unwrap_or(&Json::Null);
    if !matches!(kind, Json::Str(k) if ["input_text", "output_text", "text"].contains(&k.as_str()))
    {
        return Err(ApiError::bad(
            format!("content part type {} is not supported", kind.repr()),
            Some(at),
        ));
    }
    match part.get("text") {
        Some(Json::Str(text)) => Ok(text.clone()),
        _ => Err(ApiError::bad("a text part needs text", Some(at))),
    }
}

/// The input items as chat messages; consecutive function calls are one assistant turn.
fn input_messages(input: &Json) -> Result<Vec<ChatMessage>, ApiError> {
    let items = match input {
        Json::Str(text) => return Ok(vec![ChatMessage::new("user", text.as_str())]),
        Json::Array(items) => items,
        _ => return Ok(Vec::new()),
    };
    let mut messages: Vec<ChatMessage> = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let at = format!("input.{i}");
        let kind = match item.get("type") {
            None => Json::from("message"),
            Some(kind) => kind.clone(),
        };
        match &kind {
            Json::Str(k) if k == "message" => {
                let role = item.get("role").unwrap_or(&Json::Null);
                let role = match role {
                    Json::Str(r)
                        if ["user", "system", "developer", "assistant"].contains(&r.as_str()) =>
                    {
                        r.as_str()
                    }
                    _ => {
                        return Err(ApiError::bad(
                            format!(
                                "role {} is not one of user, system, developer, assistant",
                                role.repr()
                            ),
                            Some(&format!("{at}.role")),
                        ))
                    }
                };
                let text = match item.get("content") {
                    Some(Json::Str(text)) => text.clone(),
                    Some(Json::Array(parts)) => {
                        let mut text = String::new();
                        for (j, part) in parts.iter().enumerate() {
                            if let Json::Object(_) = part {
                                text.push_str(&part_text(part, &format!("{at}.content.{j}"))?);
                            }
                        }
                        text
                    }
                    _ => {
                        return Err(ApiError::bad(
                            "content must be text or a list of parts",
                            Some(&format!("{at}.content")),
                        ))
                    }
                };
                let role = if role == "developer" { "system" } else { role };
                messages.push(ChatMessage::new(role, text));
            }
            Json::Str(k) if k == "function_call" => {
                let arguments = item.get("arguments").cloned().unwrap_or(Json::from("{}"));
                let (Some(Json::Str(call_id)), Some(Json::Str(name)), Json::Str(arguments)) =
                    (item.get("call_id"), item.get("name"), arguments)
                else {
                    return Err(ApiError::bad(
                        "a function_call needs call_id, name and arguments",
                        Some(&at),
                    ));
                };
                let call = object![
                    ("id", call_id.as_str()),
                    ("type", "function"),
                    (
                        "function",
                        object![("name", name.as_str()), ("arguments", arguments)]
                    ),
                ];
                let last = messages.last_mut().filter(|m| m.role == "assistant");
                let calls = last.and_then(|m| {
                    m.extra
                        .iter_mut()
                        .find(|(key, _)| key == "tool_calls")
                        .map(|(_, calls)| calls)
                });
                match calls {
                    Some(Json::Array(calls)) => calls.push(call),
                    _ => {
                        let mut message = ChatMessage::new("assistant", "");
                        message
                            .extra
                            .push(("tool_calls".into(), Json::Array(vec![call])));
                        messages.push(message);
                    }
                }
            }
            Json::Str(k) if k == "function_call_output" => {
                let (Some(Json::Str(call_id)), Some(Json::Str(output))) =
                    (item.get("call_id"), item.get("output"))
                else {
                    return Err(ApiError::bad(
                        "a function_call_output needs call_id and output",
                        Some(&at),
                    ));
                };
                let mut message = ChatMessage::new("tool", output.as_str());
                message
                    .extra
                    .push(("tool_call_id".into(), Json::from(call_id.as_str())));
                messages.push(message);
            }
            // Earlier reasoning is not given back to the model, as templates do.
            Json::Str(k) if k == "reasoning" => {}
            _ => {
                return Err(ApiError::bad(
                    format!("input item type {} is not supported", kind.repr()),
                    Some(&format!("{at}.type")),
                ))
            }
        }
    }
    Ok(messages)
}

/// The chat body of the same conversation and sampling.
fn chat_body(request: &ResponsesRequest, history: Vec<ChatMessage>) -> Result<ChatBody, ApiError> {
    let body = &request.body;
    let mut messages = history;
    messages.extend(input_messages(&request.input)?);
    if let Some(instructions) = request.instructions.as_deref().filter(|i| !i.is_empty()) {
        messages.insert(0, ChatMessage::new("system", instructions));
    }
    let tools: Vec<FunctionTool> = request
        .tools
        .iter()
        .map(|tool| FunctionTool {
            name: string(tool, "name").unwrap_or_default(),
            parameters: given(tool, "parameters").cloned(),
        })
        .collect();
    let tool_choice = if tools.is_empty() {
        None
    } else {
        match &request.tool_choice {
            None => None,
            Some(Json::Str(choice)) => Some(match choice.as_str() {
                "none" => ToolChoice::None,
                "required" => ToolChoice::Required,
                _ => ToolChoice::Auto,
            }),
            Some(named) => Some(ToolChoice::Named(string(named, "name").unwrap_or_default())),
        }
    };
    let response_format = match &request.text_format {
        Some(format) => match string(format, "type").as_deref() {
            Some("json_schema") => {
                let name = string(format, "name").filter(|n| !n.is_empty());
                Some(OutputFormat::JsonSchema {
                    name: name.unwrap_or_else(|| "response".into()),
                    schema: given(format, "schema").cloned().unwrap_or(object![]),
                })
            }
            Some("json_object") => Some(OutputFormat::JsonObject),
            _ => None,
        },
        None => None,
    };
    Ok(ChatBody {
        model: string(body, "model"),
        messages,
        max_tokens: integer_field(body, "max_output_tokens"),
        temperature: float_field(body, "temperature"),
        top_p: float_field(body, "top_p"),
        tools,
        tool_choice,
        response_format,
        ..ChatBody::default()
    })
}

/// An output item's id, with OpenAI's prefixes.
fn item_id(piece: &Piece) -> String {
    let prefix = match piece {
        Piece::Call(_) => "fc",
        Piece::Text(TextKind::Reasoning, _) => "rs",
        Piece::Text(TextKind::Content, _) => "msg",
    };
    format!("{prefix}_{}", uuid4_hex())
}

fn output_text_part(text: &str) -> Json {
    object![
        ("type", "output_text"),
        ("text", text),
        ("annotations", Vec::<Json>::new()),
        ("logprobs", Vec::<Json>::new()),
    ]
}

/// A piece as an output item.
fn item(piece: &Piece, id: &str, status: &str) -> Json {
    match piece {
        Piece::Call(call) => object![
            ("type", "function_call"),
            ("id", id),
            ("call_id", call.id.as_str()),
            ("name", call.name.as_str()),
            ("arguments", call.arguments.as_str()),
            ("status", status),
        ],
        Piece::Text(TextKind::Reasoning, text) => object![
            ("type", "reasoning"),
            ("id", id),
            ("summary", Vec::<Json>::new()),
            (
                "content",
                vec![object![("type", "reasoning_text"), ("text", text.as_str())]]
            ),
            ("status", status),
        ],
        Piece::Text(TextKind::Content, text) => object![
            ("type", "message"),
            ("id", id),
            ("status", status),
            ("role", "assistant"),
            ("content", vec![output_text_part(text)]),
        ],
    }
}

/// The response's output as the assistant turn a continuation is given.
fn output_message(pieces: &[Piece]) -> ChatMessage {
    let mut content = String::new();
    let mut calls = Vec::new();
    for piece in pieces {
        match piece {
            Piece::Text(TextKind::Content, text) => content.push_str(text),
            Piece::Text(TextKind::Reasoning, _) => {}
            Piece::Call(call) => calls.push(object![
                ("id", call.id.as_str()),
                ("type", "function"),
                (
                    "function",
                    object![
                        ("name", call.name.as_str()),
                        ("arguments", call.arguments.as_str())
                    ]
                ),
            ]),
        }
    }
    let mut message = ChatMessage::new("assistant", content);
    if !calls.is_empty() {
        message
            .extra
            .push(("tool_calls".into(), Json::Array(calls)));
    }
    message
}

/// One response: the request, what its turn is, and the response object as it stands.
struct ResponseRun {
    request: ResponsesRequest,
    messages: Vec<ChatMessage>,
    id: String,
    model: String,
    prompt_tokens: usize,
    created: u64,
}

impl ResponseRun {
    fn response(
        &self,
        status: &str,
        output: Vec<Json>,
        tokens: Option<usize>,
        error: Option<Json>,
    ) -> Json {
        let body = &self.request.body;
        // As the format's model dumps it: a plain format is its type; a schema's, its fields
        // that were given.
        let text_format = match &self.request.text_format {
            None => object![("type", "text")],
            Some(format) if string(format, "type").as_deref() != Some("json_schema") => {
                object![("type", format.get("type").cloned().unwrap_or(Json::Null))]
            }
            Some(format) => {
                let keys = ["type", "name", "description", "schema", "strict"];
                let given = keys.map(|key| (key.to_string(), given(format, key).cloned()));
                let fields = given
                    .into_iter()
                    .filter_map(|(key, value)| Some((key, value?)));
                Json::Object(fields.collect())
            }
        };
        let tool_choice = match &self.request.tool_choice {
            None => Json::from("auto"),
            Some(Json::Str(choice)) => Json::from(choice.as_str()),
            Some(named) => object![
                ("type", "function"),
                ("name", string(named, "name").unwrap_or_default()),
            ],
        };
        let tools: Vec<Json> = self
            .request
            .tools
            .iter()
            .map(|tool| {
                let field = |key| given(tool, key).cloned().unwrap_or(Json::Null);
                object![
                    ("type", "function"),
                    ("name", field("name")),
                    ("description", field("description")),
                    ("parameters", field("parameters")),
                    ("strict", field("strict")),
                ]
            })
            .collect();
        let usage = tokens.map_or(Json::Null, |generated| {
            object![
                ("input_tokens", self.prompt_tokens),
                ("input_tokens_details", object![("cached_tokens", 0u64)]),
                ("output_tokens", generated),
                ("output_tokens_details", object![("reasoning_tokens", 0u64)]),
                ("total_tokens", self.prompt_tokens + generated),
            ]
        });
        let incomplete = if status == "incomplete" {
            object![("reason", "max_output_tokens")]
        } else {
            Json::Null
        };
        let field = |key| given(body, key).cloned().unwrap_or(Json::Null);
        object![
            ("id", self.id.as_str()),
            ("object", "response"),
            ("created_at", self.created),
            ("status", status),
            ("background", false),
            ("error", error),
            ("incomplete_details", incomplete),
            ("instructions", field("instructions")),
            ("max_output_tokens", field("max_output_tokens")),
            (
                "metadata",
                given(body, "metadata").cloned().unwrap_or(object![])
            ),
            ("model", self.model.as_str()),
            ("output", output),
            (
                "parallel_tool_calls",
                bool_field(body, "parallel_tool_calls") != Some(false)
            ),
            ("previous_response_id", field("previous_response_id")),
            (
                "reasoning",
                object![("effort", Json::Null), ("summary", Json::Null)]
            ),
            ("store", self.request.store),
            ("temperature", field("temperature")),
            ("text", object![("format", text_format)]),
            ("tool_choice", tool_choice),
            ("tools", tools),
            ("top_p", field("top_p")),
            ("truncation", "disabled"),
            ("usage", usage),
            ("user", Json::Null),
        ]
    }

    /// The finished response, stored when the request asked for it.
    fn finish(&self, finish: &Finish, pieces: &[Piece], output: Vec<Json>) -> Json {
        let status = if finish.reason == "length" {
            "incomplete"
        } else {
            "completed"
        };
        let response = self.response(status, output, Some(finish.tokens), None);
        if self.request.store {
            // The conversation as the model saw it, less the instructions (a continuation
            // gives its own, as OpenAI's do), then this response's output.
            let skip = usize::from(
                self.request
                    .instructions
                    .as_deref()
                    .is_some_and(|i| !i.is_empty()),
            );
            let mut messages: Vec<Json> = self.messages[skip..]
                .iter()
                .map(ChatMessage::to_json)
                .collect();
            messages.push(output_message(pieces).to_json());
            let stored = StoredResponse {
                response: response.clone(),
                messages,
            };
            if let Err(e) = store().put(&self.id, stored) {
                eprintln!("rankcast-frontend: storing response {}: {e}", self.id);
            }
        }
        response
    }
}

async fn create(server: Arc<Server>, request: Request<Body>) -> Result<Reply, ApiError> {
    if !server.engine.alive() {
        return Err(ApiError::engine_down());
    }
    let body = validate::body_of(request).await?;
    let request = ResponsesRequest::parse(&body)?;
    let mut history = Vec::new();
    if let Some(previous) = &request.previous_response_id {
        let Some(stored) = store().get(previous) else {
            return Err(ApiError::new(
                StatusCode::NOT_FOUND,
                format!("Previous response with id '{previous}' not found."),
                Some("previous_response_id"),
            ));
        };
        history = stored
            .messages
            .iter()
            .filter_map(ChatMessage::from_json)
            .collect();
    }
    let chat = chat_body(&request, history)?;
    let mut turn = server.start_chat(&chat, format!("resp_{}", uuid4_hex()))?;
    let run = ResponseRun {
        id: turn.request_id.clone(),
        model: turn.model.clone(),
        prompt_tokens: turn.prompt_tokens,
        created: now(),
        messages: chat.messages,
        request,
    };
    let engine = turn.engine;
    if run.request.stream {
        let (sender, body) = Body::channel();
        tokio::spawn(stream(server, run, turn, sender));
        return Ok(Response::builder()
            .header("content-type", "text/event-stream; charset=utf-8")
            .header("x-rankcast-engine", engine)
            .body(body)
            .expect("a response"));
    }
    let mut reader = TurnReader::new(&mut turn);
    let mut outputs = TurnOutputs::new(&server, turn);
    let finish = match outputs.finish().await {
        Ok(finish) => finish,
        Err(failure) => return Err(failure.into()),
    };
    let pieces = reader.whole(&finish);
    let output = pieces
        .iter()
        .map(|p| item(p, &item_id(p), "completed"))
        .collect();
    let response = run.finish(&finish, &pieces, output);
    let mut reply = text_reply(StatusCode::OK, response.response());
    reply.headers_mut().insert(
        "x-rankcast-engine",
        hyper::header::HeaderValue::from(engine),
    );
    Ok(reply)
}

/// The numbered event stream of one response.
#[derive(Default)]
struct Events {
    sequence: u64,
}

impl Events {
    fn event(&mut self, kind: &str, payload: Vec<(&str, Json)>) -> String {
        let mut fields = vec![
            ("type".to_string(), Json::from(kind)),
            ("sequence_number".to_string(), Json::from(self.sequence)),
        ];
        fields.extend(payload.into_iter().map(|(k, v)| (k.to_string(), v)));
        self.sequence += 1;
        format!("event: {kind}\ndata: {}\n\n", Json::Object(fields).event())
    }
}

/// The typed event sequence as it is written: an item is opened by its first piece
/// (`output_item.added`, and for a message its `content_part.added`), its text streamed as
/// deltas, and closed (`..done` events) when a piece of another kind comes or the output
/// ends; a function call is opened, given its arguments in one delta, and closed at once.
#[derive(Default)]
struct ResponseEvents {
    events: Events,
    items: Vec<Json>,
    pieces: Vec<Piece>,
    /// The text item being streamed: its kind, its text so far, its id.
    open: Option<(TextKind, String, String)>,
}

impl ResponseEvents {
    /// `item_id`, `output_index` (and `content_index` for text): where an event's text goes.
    fn place(id: &str, index: usize, text: bool) -> Vec<(&'static str, Json)> {
        let mut place = vec![
            ("item_id", Json::from(id)),
            ("output_index", Json::from(index)),
        ];
        if text {
            place.push(("content_index", Json::from(0u64)));
        }
        place
    }

    /// The open text item's `..done` events (none when no item is open).
    fn close(&mut self) -> String {
        let Some((kind, text, id)) = self.open.take() else {
            return String::new();
        };
        let index = self.items.len();
        let item = item(&Piece::Text(kind, text.clone()), &id, "completed");
        self.items.push(item.clone());
        let place = || Self::place(&id, index, true);
        let mut out = if kind == TextKind::Reasoning {
            let done = [place(), vec![("text", Json::from(text))]].concat();
            self.events.event("response.reasoning_text.done", done)
        } else {
            let logprobs = ("logprobs", Json::Array(Vec::new()));
            let text_done = [place(), vec![("text", Json::from(text.as_str())), logprobs]];
            let part_done = [place(), vec![("part", output_text_part(&text))]];
            self.events
                .event("response.output_text.done", text_done.concat())
                + &self
                    .events
                    .event("response.content_part.done", part_done.concat())
        };
        let done = vec![("output_index", Json::from(index)), ("item", item)];
        out += &self.events.event("response.output_item.done", done);
        out
    }

    fn emit(&mut self, piece: Piece) -> String {
        self.pieces.push(piece.clone());
        match piece {
            Piece::Call(call) => self.call(call),
            Piece::Text(kind, text) => self.text(kind, text),
        }
    }

    /// A call: opened (its arguments empty), given them in one delta, and closed.
    fn call(&mut self, call: ToolCall) -> String {
        let mut out = self.close();
        let index = self.items.len();
        let piece = Piece::Call(call);
        let id = item_id(&piece);
        let Piece::Call(call) = &piece else {
            unreachable!("a call")
        };
        let started = item(&piece, &id, "in_progress").with("arguments", Json::from(""));
        let done = item(&piece, &id, "completed");
        self.items.push(done.clone());
        let at = || Self::place(&id, index, false);
        let delta = [at(), vec![("delta", Json::from(call.arguments.as_str()))]];
        let arguments = Json::from(call.arguments.as_str());
        let name = Json::from(call.name.as_str());
        let finished = [at(), vec![("name", name), ("arguments", arguments)]];
        let events = [
            (
                "response.output_item.added",
                vec![("output_index", Json::from(index)), ("item", started)],
            ),
            ("response.function_call_arguments.delta", delta.concat()),
            ("response.function_call_arguments.done", finished.concat()),
            (
                "response.output_item.done",
                vec![("output_index", Json::from(index)), ("item", done)],
            ),
        ];
        for (kind, payload) in events {
            out += &self.events.event(kind, payload);
        }
        out
    }

    /// Text: a delta of the open item, which is opened first when the text is of another kind
    /// (the item then without content, a message's part announced on its own).
    fn text(&mut self, kind: TextKind, text: String) -> String {
        let mut out = String::new();
        if self.open.as_ref().is_none_or(|(open, _, _)| *open != kind) {
            out += &self.close();
            let index = self.items.len();
            let empty = Piece::Text(kind, String::new());
            let id = item_id(&empty);
            let started = item(&empty, &id, "in_progress");
            let part = started.get("content").and_then(|c| match c {
                Json::Array(parts) => parts.last().cloned(),
                _ => None,
            });
            let started = started.with("content", Json::Array(Vec::new()));
            let added = vec![("output_index", Json::from(index)), ("item", started)];
            out += &self.events.event("response.output_item.added", added);
            if let (TextKind::Content, Some(part)) = (kind, part) {
                let place = Self::place(&id, index, true);
                let added = [place, vec![("part", part)]].concat();
                out += &self.events.event("response.content_part.added", added);
            }
            self.open = Some((kind, String::new(), id));
        }
        let index = self.items.len();
        let (_, so_far, id) = self.open.as_mut().expect("an open item");
        so_far.push_str(&text);
        let mut payload = Self::place(id, index, true);
        payload.push(("delta", Json::from(text)));
        let event = if kind == TextKind::Reasoning {
            "response.reasoning_text.delta"
        } else {
            payload.push(("logprobs", Json::Array(Vec::new())));
            "response.output_text.delta"
        };
        out + &self.events.event(event, payload)
    }
}

async fn stream(
    server: Arc<Server>,
    run: ResponseRun,
    mut turn: ChatTurn,
    mut sender: hyper::body::Sender,
) {
    let mut state = ResponseEvents::default();
    let started = run.response("in_progress", Vec::new(), None, None);
    let mut head = state
        .events
        .event("response.created", vec![("response", started.clone())]);
    head += &state
        .events
        .event("response.in_progress", vec![("response", started)]);
    if sender.send_data(Bytes::from(head)).await.is_err() {
        server.engine.abort(&turn.request_id);
        return;
    }
    let mut reader = TurnReader::new(&mut turn);
    let mut outputs = TurnOutputs::new(&server, turn);
    loop {
        let (delta, finish) = match outputs.next().await {
            Ok(step) => step,
            Err(failure) => {
                let (code, message) = match failure {
                    TurnFailure::Rejected(why, _) => ("invalid_request", why),
                    TurnFailure::EngineDead(why) | TurnFailure::Shutdown(why) => {
                        ("server_error", why)
                    }
                };
                let mut out = state.close();
                out += &state.events.event(
                    "error",
                    vec![
                        ("code", Json::from(code)),
                        ("message", Json::from(message.as_str())),
                        ("param", Json::Null),
                    ],
                );
                let error = object![("code", code), ("message", message)];
                let failed = run.response("failed", state.items.clone(), None, Some(error));
                out += &state
                    .events
                    .event("response.failed", vec![("response", failed)]);
                let _ = sender.send_data(Bytes::from(out)).await;
                return;
            }
        };
        let mut out = String::new();
        for piece in reader.feed(&delta, finish.as_ref()) {
            out += &state.emit(piece);
        }
        if let Some(finish) = finish {
            out += &state.close();
            let items = std::mem::take(&mut state.items);
            let last = run.finish(&finish, &state.pieces, items);
            let kind = if last.get("status") == Some(&Json::from("incomplete")) {
                "response.incomplete"
            } else {
                "response.completed"
            };
            out += &state.events.event(kind, vec![("response", last)]);
            let _ = sender.send_data(Bytes::from(out)).await;
            return;
        }
        if !out.is_empty() && sender.send_data(Bytes::from(out)).await.is_err() {
            return; // the client left: dropping the outputs aborts the request
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Piece, ResponseEvents, TextKind};
    use rankcast_frontend::output_parsers::ToolCall;
    use rankcast_frontend::pyjson::Json;

    /// (type, output_index) of each event in written events.
    fn events(written: &str) -> Vec<(String, Option<Json>)> {
        written
            .split("\n\n")
            .filter_map(|event| event.split_once("\ndata: "))
            .map(|(_, data)| {
                let event = Json::parse(data).expect("JSON data");
                let Some(Json::Str(kind)) = event.get("type") else {
                    panic!("an event type")
                };
                (kind.clone(), event.get("output_index").cloned())
            })
            .collect()
    }

    #[test]
    fn items_open_stream_and_close_as_the_python_servers_write_them() {
        let mut state = ResponseEvents::default();
        let call = ToolCall {
            id: "call_1".into(),
            name: "f".into(),
            arguments: "{}".into(),
        };
        let mut written = String::new();
        for piece in [
            Piece::Text(TextKind::Reasoning, "a".into()),
            Piece::Text(TextKind::Reasoning, "b".into()),
            Piece::Text(TextKind::Content, "c".into()),
            Piece::Call(call),
            Piece::Text(TextKind::Content, "d".into()),
        ] {
            written += &state.emit(piece);
        }
        written += &state.close();
        let at = |i: u64| Some(Json::from(i));
        let want = [
            ("response.output_item.added", at(0)),
            ("response.reasoning_text.delta", at(0)),
            ("response.reasoning_text.delta", at(0)),
            ("response.reasoning_text.done", at(0)),
            ("response.output_item.done", at(0)),
            ("response.output_item.added", at(1)),
            ("response.content_part.added", at(1)),
            ("response.output_text.delta", at(1)),
            ("response.output_text.done", at(1)),
            ("response.content_part.done", at(1)),
            ("response.output_item.done", at(1)),
            ("response.output_item.added", at(2)),
            ("response.function_call_arguments.delta", at(2)),
            ("response.function_call_arguments.done", at(2)),
            ("response.output_item.done", at(2)),
            ("response.output_item.added", at(3)),
            ("response.content_part.added", at(3)),
            ("response.output_text.delta", at(3)),
            ("response.output_text.done", at(3)),
            ("response.content_part.done", at(3)),
            ("response.output_item.done", at(3)),
        ];
        let want: Vec<(String, Option<Json>)> =
            want.into_iter().map(|(k, i)| (k.to_string(), i)).collect();
        assert_eq!(events(&written), want);
        let kinds: Vec<Option<&Json>> = state.items.iter().map(|i| i.get("type")).collect();
        let names = ["reasoning", "message", "function_call", "message"].map(Json::from);
        assert_eq!(kinds, names.iter().map(Some).collect::<Vec<_>>());
        let reasoning = &state.items[0];
        let text = reasoning.get("content").map(|c| c.repr());
        assert_eq!(
            text.as_deref(),
            Some("[{'type': 'reasoning_text', 'text': 'ab'}]")
        );
    }
}
