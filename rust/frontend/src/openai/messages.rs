//! Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`), as the
//! Python servers answer it (`rankcast/api_server/anthropic_messages.py`), to the byte where
//! the content is the same.
//!
//! A Messages request is translated into the chat body of the same conversation (system prompt
//! first, `tool_use` blocks as the assistant's tool calls, `tool_result` blocks as tool
//! messages, `tools` as function tools, `tool_choice` any/tool as forced calls), run as one
//! chat turn (`chat_turn.rs`), and answered in Anthropic's shapes: a message with content
//! blocks, or its event stream (`message_start`, `content_block_start`, deltas,
//! `content_block_stop`, `message_delta`, `message_stop`). Errors are Anthropic's too
//! (`errors.rs`).

use std::sync::Arc;

use hyper::body::Bytes;
use hyper::{Body, Method, Request, Response, StatusCode};
use rankcast_frontend::object;
use rankcast_frontend::output_parsers::{uuid4_hex, ToolCall};
use rankcast_frontend::pyjson::Json;

use super::chat_turn::{
    ApiError, ChatBody, ChatMessage, ChatTurn, Finish, FunctionTool, OutputFormat, Piece, TextKind,
    ToolChoice, TurnFailure, TurnOutputs, TurnReader,
};
use super::errors::{self, anthropic_error_body};
use super::validate::{
    self, bool_field, defaulted, float_field, given, integer_field, optional, required, string,
    Field, Ty, INT_MAX, TOOL_NAME,
};
use super::{methods, text_reply, Reply, Server};

/// Text: what a system prompt and a tool result hold, and any turn may.
const TEXT_BLOCK: &[Field] = &[
    required("type", Ty::Literal(&["text"])),
    required("text", Ty::Str),
];

/// A call the assistant made (given back in a later request's history).
const TOOL_USE_BLOCK: &[Field] = &[
    required("type", Ty::Literal(&["tool_use"])),
    required("id", Ty::Str),
    required("name", Ty::Str),
    required("input", Ty::Dict),
];

const TEXT_BLOCKS: Ty = Ty::List(&Ty::Model(TEXT_BLOCK), 0, None);

/// What a call returned, in the user's turn.
const TOOL_RESULT_BLOCK: &[Field] = &[
    required("type", Ty::Literal(&["tool_result"])),
    required("tool_use_id", Ty::Str),
    optional("content", Ty::Union(&[Ty::Str, TEXT_BLOCKS])),
    optional("is_error", Ty::Bool),
];

/// Earlier reasoning given back: not shown to the model again, as chat templates do.
const THINKING_BLOCK: &[Field] = &[required(
    "type",
    Ty::Literal(&["thinking", "redacted_thinking"]),
)];

/// What each role's content may hold, told apart by `type`: any other kind (images,
/// documents, server tools) is a 400 naming where it is.
const USER_MESSAGE: &[Field] = &[
    required("role", Ty::Literal(&["user"])),
    required(
        "content",
        Ty::Union(&[
            Ty::Str,
            Ty::List(
                &Ty::Tagged(
                    "type",
                    &[("text", TEXT_BLOCK), ("tool_result", TOOL_RESULT_BLOCK)],
                ),
                0,
                None,
            ),
        ]),
    ),
];

const ASSISTANT_MESSAGE: &[Field] = &[
    required("role", Ty::Literal(&["assistant"])),
    required(
        "content",
        Ty::Union(&[
            Ty::Str,
            Ty::List(
                &Ty::Tagged(
                    "type",
                    &[
                        ("text", TEXT_BLOCK),
                        ("tool_use", TOOL_USE_BLOCK),
                        ("thinking", THINKING_BLOCK),
                        ("redacted_thinking", THINKING_BLOCK),
                    ],
                ),
                0,
                None,
            ),
        ]),
    ),
];

const TOOL_DEFINITION: &[Field] = &[
    required("name", TOOL_NAME),
    optional("description", Ty::Str),
    required("input_schema", Ty::Dict),
    optional("type", Ty::Literal(&["custom"])),
];

/// `auto` (the model decides), `any` (some tool must be called) or `none`.
const TOOL_CHOICE_KIND: &[Field] = &[
    required("type", Ty::Literal(&["auto", "any", "none"])),
    optional("disable_parallel_tool_use", Ty::Bool),
];

/// `tool`: this one must be called.
const TOOL_CHOICE_NAMED: &[Field] = &[
    required("type", Ty::Literal(&["tool"])),
    required("name", Ty::MinLen(1)),
    optional("disable_parallel_tool_use", Ty::Bool),
];

const THINKING: &[Field] = &[
    required("type", Ty::Literal(&["enabled", "disabled", "adaptive"])),
    optional("budget_tokens", Ty::Int { ge: None, le: None }),
];

const JSON_OUTPUT_FORMAT: &[Field] = &[
    required("type", Ty::Literal(&["json_schema"])),
    required("schema", Ty::Dict),
];

const OUTPUT_CONFIG: &[Field] = &[optional("format", Ty::Model(JSON_OUTPUT_FORMAT))];

/// `CountTokensRequest`'s fields (the conversation), which `MessagesRequest` starts with.
const COUNT_TOKENS: &[Field] = &[
    optional("model", Ty::Str),
    required(
        "messages",
        Ty::List(
            &Ty::Tagged(
                "role",
                &[("user", USER_MESSAGE), ("assistant", ASSISTANT_MESSAGE)],
            ),
            1,
            None,
        ),
    ),
    optional("system", Ty::Union(&[Ty::Str, TEXT_BLOCKS])),
    optional("tools", Ty::List(&Ty::Model(TOOL_DEFINITION), 0, None)),
    optional(
        "tool_choice",
        Ty::Tagged(
            "type",
            &[
                ("auto", TOOL_CHOICE_KIND),
                ("any", TOOL_CHOICE_KIND),
                ("none", TOOL_CHOICE_KIND),
                ("tool", TOOL_CHOICE_NAMED),
            ],
        ),
    ),
    optional("thinking", Ty::Model(THINKING)),
];

/// What `MessagesRequest` adds: the output and its sampling.
const MESSAGES: &[Field] = &[
    required(
        "max_tokens",
        Ty::Int {
            ge: Some(1),
            le: Some(INT_MAX),
        },
    ),
    optional("stop_sequences", Ty::List(&Ty::MinLen(1), 0, Some(16))),
    optional(
        "temperature",
        Ty::Float {
            ge: Some(0.0),
            gt: None,
            le: Some(1.0),
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
    optional(
        "top_k",
        Ty::Int {
            ge: Some(-1),
            le: Some(INT_MAX),
        },
    ),
    defaulted("stream", Ty::Bool),
    optional("metadata", Ty::Dict),
    optional("output_config", Ty::Model(OUTPUT_CONFIG)),
];

/// Whether `path` is one of this module's routes.
pub fn serves(path: &str) -> bool {
    path == "/v1/messages" || path == "/v1/messages/count_tokens"
}

pub async fn route(server: Arc<Server>, request: Request<Body>) -> Reply {
    let path = request.uri().path().to_string();
    let answer = match (request.method(), path.as_str()) {
        (&Method::POST, _) if !server.engine.alive() => Err(ApiError::engine_down()),
        (&Method::POST, "/v1/messages") => create(server, request).await,
        (&Method::POST, _) => count_tokens(&server, request).await,
        _ => return methods::not_allowed(&path, "POST"),
    };
    answer.unwrap_or_else(|error| errors::reply(&path, &error))
}

/// The text of a string or of text blocks (the schema takes no other kind there).
fn text_of(blocks: Option<&Json>) -> String {
    match blocks {
        Some(Json::Str(text)) => text.clone(),
        Some(Json::Array(blocks)) => blocks.iter().filter_map(|b| string(b, "text")).collect(),
        _ => String::new(),
    }
}

/// The conversation as chat messages, in order (the schema has refused every block a role's
/// turn cannot hold).
fn chat_messages(body: &Json) -> Vec<ChatMessage> {
    let mut messages = Vec::new();
    let system = text_of(body.get("system"));
    if !system.is_empty() {
        messages.push(ChatMessage::new("system", system));
    }
    let Some(Json::Array(given_messages)) = body.get("messages") else {
        return messages;
    };
    for message in given_messages {
        let role = string(message, "role").unwrap_or_default();
        let blocks = match message.get("content") {
            Some(Json::Array(blocks)) => blocks,
            content => {
                messages.push(ChatMessage::new(&role, text_of(content)));
                continue;
            }
        };
        let mut texts = String::new();
        let mut calls = Vec::new();
        for block in blocks {
            match string(block, "type").as_deref() {
                Some("text") => texts.push_str(&string(block, "text").unwrap_or_default()),
                Some("tool_use") => {
                    let input = given(block, "input").cloned().unwrap_or(object![]);
                    let function = object![
                        ("name", string(block, "name").unwrap_or_default()),
                        ("arguments", input.dumps_ascii()),
                    ];
                    calls.push(object![
                        ("id", string(block, "id").unwrap_or_default()),
                        ("type", "function"),
                        ("function", function),
                    ]);
                }
                Some("tool_result") => {
                    let mut tool = ChatMessage::new("tool", text_of(block.get("content")));
                    let call_id = string(block, "tool_use_id").unwrap_or_default();
                    tool.extra
                        .push(("tool_call_id".into(), Json::from(call_id)));
                    messages.push(tool);
                }
                // Earlier reasoning is not given back to the model, as templates do.
                _ => {}
            }
        }
        // A turn of only tool results is those; an empty one is still a turn.
        if !texts.is_empty() || !calls.is_empty() || blocks.is_empty() || role == "assistant" {
            let mut entry = ChatMessage::new(&role, texts);
            if !calls.is_empty() {
                entry.extra.push(("tool_calls".into(), Json::Array(calls)));
            }
            messages.push(entry);
        }
    }
    messages
}

/// The chat body of the same conversation and sampling (`with_sampling`: a Messages request's
/// own fields; a count_tokens request has none).
fn chat_body(body: &Json, with_sampling: bool) -> ChatBody {
    let mut chat = ChatBody {
        model: string(body, "model"),
        messages: chat_messages(body),
        ..ChatBody::default()
    };
    if let Some(Json::Array(tools)) = given(body, "tools") {
        chat.tools = tools
            .iter()
            .map(|tool| FunctionTool {
                name: string(tool, "name").unwrap_or_default(),
                parameters: given(tool, "input_schema").cloned(),
            })
            .collect();
        let choice = given(body, "tool_choice");
        let kind = choice.and_then(|c| string(c, "type"));
        chat.tool_choice = Some(match kind.as_deref().unwrap_or("auto") {
            "tool" => ToolChoice::Named(choice.and_then(|c| string(c, "name")).unwrap_or_default()),
            "any" => ToolChoice::Required,
            "none" => ToolChoice::None,
            _ => ToolChoice::Auto,
        });
    }
    if with_sampling {
        chat.max_tokens = integer_field(body, "max_tokens");
        chat.temperature = float_field(body, "temperature");
        chat.top_p = float_field(body, "top_p");
        chat.top_k = integer_field(body, "top_k");
        if let Some(Json::Array(stops)) = given(body, "stop_sequences") {
            chat.stop = stops
                .iter()
                .filter_map(|s| match s {
                    Json::Str(s) => Some(s.clone()),
                    _ => None,
                })
                .collect();
        }
        let format = given(body, "output_config").and_then(|c| given(c, "format"));
        if let Some(schema) = format.and_then(|f| given(f, "schema")) {
            chat.response_format = Some(OutputFormat::JsonSchema {
                name: "output".into(),
                schema: schema.clone(),
            });
        }
    }
    chat
}

async fn count_tokens(server: &Server, request: Request<Body>) -> Result<Reply, ApiError> {
    let body = validate::body_of(request).await?;
    let body = validate::model(&[COUNT_TOKENS], &body)?;
    server.check_model(string(&body, "model").as_deref())?;
    let chat = chat_body(&body, false);
    chat.check()?;
    let (_, prompt_ids) = server.chat_prompt(&chat.messages)?;
    let answer = object![("input_tokens", prompt_ids.len())];
    Ok(text_reply(StatusCode::OK, answer.response()))
}

/// Anthropic's stop_reason and stop_sequence for a finished output.
fn stop(finish: &Finish, calls: usize) -> (&'static str, Json) {
    if calls > 0 {
        return ("tool_use", Json::Null);
    }
    if finish.reason == "length" {
        return ("max_tokens", Json::Null);
    }
    match &finish.stop_string {
        Some(stop) => ("stop_sequence", Json::from(stop.as_str())),
        None => ("end_turn", Json::Null),
    }
}

/// A call's arguments as the object Anthropic's `input` is (the JSON a grammar or the parser
/// checked; anything else is kept whole under `arguments`).
fn input(call: &ToolCall) -> Json {
    match Json::parse(&call.arguments) {
        None => object![("arguments", call.arguments.as_str())],
        Some(value @ Json::Object(_)) => value,
        Some(value) => object![("arguments", value)],
    }
}

fn block(piece: &Piece) -> Json {
    match piece {
        Piece::Call(call) => object![
            ("type", "tool_use"),
            ("id", call.id.as_str()),
            ("name", call.name.as_str()),
            ("input", input(call)),
        ],
        Piece::Text(TextKind::Reasoning, text) => object![
            ("type", "thinking"),
            ("thinking", text.as_str()),
            ("signature", ""),
        ],
        Piece::Text(TextKind::Content, text) => object![("type", "text"), ("text", text.as_str())],
    }
}

fn message(turn: &ChatTurn, usage: Json) -> Json {
    object![
        ("id", turn.request_id.as_str()),
        ("type", "message"),
        ("role", "assistant"),
        ("model", turn.model.as_str()),
        ("content", Vec::<Json>::new()),
        ("stop_reason", Json::Null),
        ("stop_sequence", Json::Null),
        ("usage", usage),
    ]
}

async fn create(server: Arc<Server>, request: Request<Body>) -> Result<Reply, ApiError> {
    let body = validate::body_of(request).await?;
    let body = validate::model(&[COUNT_TOKENS, MESSAGES], &body)?;
    let stream = bool_field(&body, "stream").unwrap_or(false);
    let chat = chat_body(&body, true);
    let mut turn = server.start_chat(&chat, format!("msg_{}", uuid4_hex()))?;
    let engine = turn.engine;
    if stream {
        let (sender, body) = Body::channel();
        tokio::spawn(events(server, turn, sender));
        return Ok(Response::builder()
            .header("content-type", "text/event-stream; charset=utf-8")
            .header("x-rankcast-engine", engine)
            .body(body)
            .expect("a response"));
    }
    let mut reader = TurnReader::new(&mut turn);
    let mut outputs = TurnOutputs::new(&server, turn);
    let finish = outputs.finish().await?;
    let pieces = reader.whole(&finish);
    let (stop_reason, stop_sequence) = stop(&finish, reader.calls);
    let turn = &outputs.turn;
    let usage = object![
        ("input_tokens", turn.prompt_tokens),
        ("output_tokens", finish.tokens),
    ];
    let content = pieces.iter().map(block).collect();
    let answer = message(turn, usage)
        .with("content", Json::Array(content))
        .with("stop_reason", Json::from(stop_reason))
        .with("stop_sequence", stop_sequence);
    let mut reply = text_reply(StatusCode::OK, answer.response());
    reply.headers_mut().insert(
        "x-rankcast-engine",
        hyper::header::HeaderValue::from(engine),
    );
    Ok(reply)
}

fn event(kind: &str, payload: Vec<(&str, Json)>) -> String {
    let mut fields = vec![("type".to_string(), Json::from(kind))];
    for (key, value) in payload {
        match fields.iter_mut().find(|(k, _)| k == key) {
            Some(field) => field.1 = value,
            None => fields.push((key.to_string(), value)),
        }
    }
    format!("event: {kind}\ndata: {}\n\n", Json::Object(fields).event())
}

/// Anthropic's event sequence: a block is opened by its first piece and closed when a piece of
/// another kind (or the end) comes; a tool call is one block, opened with its name and given
/// its arguments in one `input_json_delta`.
struct MessageEvents {
    index: i64,
    open: Option<TextKind>,
}

impl MessageEvents {
    fn close(&mut self) -> String {
        if self.open.take().is_none() {
            return String::new();
        }
        event(
            "content_block_stop",
            vec![("index", Json::from(self.index))],
        )
    }

    fn emit(&mut self, piece: &Piece) -> String {
        let mut out = String::new();
        let (kind, text) = match piece {
            Piece::Call(call) => {
                out += &self.close();
                self.index += 1;
                let index = Json::from(self.index);
                let block = object![
                    ("type", "tool_use"),
                    ("id", call.id.as_str()),
                    ("name", call.name.as_str()),
                    ("input", object![]),
                ];
                out += &event(
                    "content_block_start",
                    vec![("index", index.clone()), ("content_block", block)],
                );
                let delta = object![
                    ("type", "input_json_delta"),
                    ("partial_json", call.arguments.as_str()),
                ];
                out += &event(
                    "content_block_delta",
                    vec![("index", index.clone()), ("delta", delta)],
                );
                return out + &event("content_block_stop", vec![("index", index)]);
            }
            Piece::Text(kind, text) => (*kind, text.as_str()),
        };
        if self.open != Some(kind) {
            out += &self.close();
            self.index += 1;
            self.open = Some(kind);
            let start = match kind {
                TextKind::Reasoning => {
                    object![("type", "thinking"), ("thinking", ""), ("signature", ""),]
                }
                TextKind::Content => object![("type", "text"), ("text", "")],
            };
            out += &event(
                "content_block_start",
                vec![("index", Json::from(self.index)), ("content_block", start)],
            );
        }
        let delta = match kind {
            TextKind::Reasoning => object![("type", "thinking_delta"), ("thinking", text)],
            TextKind::Content => object![("type", "text_delta"), ("text", text)],
        };
        out + &event(
            "content_block_delta",
            vec![("index", Json::from(self.index)), ("delta", delta)],
        )
    }
}

async fn events(server: Arc<Server>, mut turn: ChatTurn, mut sender: hyper::body::Sender) {
    let usage = object![
        ("input_tokens", turn.prompt_tokens),
        ("output_tokens", 0u64)
    ];
    let start = event("message_start", vec![("message", message(&turn, usage))]);
    if sender.send_data(Bytes::from(start)).await.is_err() {
        server.engine.abort(&turn.request_id);
        return;
    }
    let mut reader = TurnReader::new(&mut turn);
    let mut outputs = TurnOutputs::new(&server, turn);
    let mut state = MessageEvents {
        index: -1,
        open: None,
    };
    loop {
        let (delta, finish) = match outputs.next().await {
            Ok(step) => step,
            Err(failure) => {
                let (status, why) = match failure {
                    TurnFailure::Rejected(why, _) => (StatusCode::BAD_REQUEST, why),
                    TurnFailure::EngineDead(why) | TurnFailure::Shutdown(why) => {
                        (StatusCode::SERVICE_UNAVAILABLE, why)
                    }
                };
                let body = anthropic_error_body(status, &why);
                let Json::Object(fields) = body else {
                    unreachable!("an error body is an object")
                };
                let payload = fields
                    .iter()
                    .map(|(key, value)| (key.as_str(), value.clone()))
                    .collect();
                let out = state.close() + &event("error", payload);
                let _ = sender.send_data(Bytes::from(out)).await;
                return;
            }
        };
        let mut out = String::new();
        for piece in reader.feed(&delta, finish.as_ref()) {
            out += &state.emit(&piece);
        }
        if let Some(finish) = finish {
            let (stop_reason, stop_sequence) = stop(&finish, reader.calls);
            if state.index < 0 {
                // No output at all: one empty text block, as Anthropic's answers have.
                out += &state.emit(&Piece::Text(TextKind::Content, String::new()));
            }
            out += &state.close();
            let delta = object![
                ("stop_reason", stop_reason),
                ("stop_sequence", stop_sequence)
            ];
            let usage = object![("output_tokens", finish.tokens)];
            out += &event("message_delta", vec![("delta", delta), ("usage", usage)]);
            out += &event("message_stop", Vec::new());
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
    use super::{MessageEvents, Piece, TextKind};
    use rankcast_frontend::output_parsers::ToolCall;
    use rankcast_frontend::pyjson::Json;

    #[test]
    fn blocks_open_stream_and_close_as_the_python_servers_write_them() {
        let mut state = MessageEvents {
            index: -1,
            open: None,
        };
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
            written += &state.emit(&piece);
        }
        written += &state.close();
        let got: Vec<String> = written
            .split("\n\n")
            .filter_map(|event| event.split_once("\ndata: "))
            .map(|(_, data)| {
                let event = Json::parse(data).expect("JSON data");
                let kind = event.get("type").map(Json::repr).unwrap_or_default();
                let index = event.get("index").map(Json::repr).unwrap_or_default();
                let block = event
                    .get("content_block")
                    .or(event.get("delta"))
                    .and_then(|b| b.get("type"))
                    .map(Json::repr)
                    .unwrap_or_default();
                format!("{kind} {index} {block}")
            })
            .collect();
        let want = [
            "'content_block_start' 0 'thinking'",
            "'content_block_delta' 0 'thinking_delta'",
            "'content_block_delta' 0 'thinking_delta'",
            "'content_block_stop' 0 ",
            "'content_block_start' 1 'text'",
            "'content_block_delta' 1 'text_delta'",
            "'content_block_stop' 1 ",
            "'content_block_start' 2 'tool_use'",
            "'content_block_delta' 2 'input_json_delta'",
            "'content_block_stop' 2 ",
            "'content_block_start' 3 'text'",
            "'content_block_delta' 3 'text_delta'",
            "'content_block_stop' 3 ",
        ];
        assert_eq!(got, want);
    }
}
