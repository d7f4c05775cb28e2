//! What a request asks of its output beyond sampling, checked as the Python servers check it
//! (`rankcast/api_server/structured.py`, `schema.py`): a choice of strings the output must be
//! (`guided_choice`, `structured_outputs.choice`), tools the model may call itself (read back
//! by `--tool-call-parser`), and more variables for the chat template
//! (`chat_template_kwargs`). A choice always makes a grammar (its strings are Lark literals),
//! so the engine takes it as it is; the other shapes need a grammar compiled before the
//! request may reach the engine (xgrammar, in Python), which this server cannot do yet, so
//! they are refused by name, as are tools a request forces (`tool_choice` `required` or a
//! named function, whose grammar is a JSON schema).

use rankcast_client::wire::sampling::StructuredOutputs;
use serde_json::{Map, Value};

/// A request this module refuses: the message and the field it names.
pub struct Refusal(pub String, pub &'static str);

fn refuse<T>(message: impl Into<String>, param: &'static str) -> Result<T, Refusal> {
    Err(Refusal(message.into(), param))
}

/// The output shapes of `structured_outputs`, in the Python servers' order.
const KINDS: [&str; 5] = ["json", "json_object", "regex", "choice", "grammar"];

/// What the Python servers name when `tool_choice` auto meets a server without a tool-call
/// parser (structured.py), less the forced choices this server does not serve yet.
const NO_TOOL_PARSER: &str = "tool_choice 'auto' (the default when tools are given) needs a \
    parser of the model's own tool-call format, which this server was not started with \
    (--enable-auto-tool-choice --tool-call-parser hermes); use tool_choice 'none' (the Rust \
    frontend does not serve 'required' or a named function yet)";

/// The names `render_chat` gives the template itself (chat_template.py's RESERVED_VARIABLES).
const TEMPLATE_OWN: [&str; 4] = ["messages", "tools", "documents", "add_generation_prompt"];

/// Whether `value` is given: neither absent, `null` nor `false` (Python's `_is_set`).
fn is_set(value: Option<&Value>) -> bool {
    !matches!(value, None | Some(Value::Null) | Some(Value::Bool(false)))
}

/// The strings of a `choice`, checked as `StructuredOutputs` checks them.
fn choice(value: &Value, field: &'static str) -> Result<Vec<String>, Refusal> {
    let strings: Option<Vec<String>> = value.as_array().and_then(|items| {
        items
            .iter()
            .map(|item| item.as_str().map(str::to_string))
            .collect()
    });
    match strings {
        None => refuse(format!("{field}: choice must be a list of strings"), field),
        Some(strings) if strings.is_empty() || strings.iter().any(String::is_empty) => refuse(
            format!("{field}: choice: give one or more choices, each a non-empty string"),
            field,
        ),
        Some(strings) => Ok(strings),
    }
}

/// `structured_outputs`, vLLM's object: exactly one shape, of which this server serves
/// `choice`.
fn structured_outputs(value: &Value) -> Result<Vec<String>, Refusal> {
    const FIELD: &str = "structured_outputs";
    let Some(given) = value.as_object() else {
        return refuse("structured_outputs must be an object", FIELD);
    };
    if let Some(unknown) = given.keys().find(|key| !KINDS.contains(&key.as_str())) {
        return refuse(
            format!("structured_outputs: unknown field {unknown:?}"),
            FIELD,
        );
    }
    let set: Vec<&str> = KINDS
        .into_iter()
        .filter(|kind| is_set(given.get(*kind)))
        .collect();
    if let Some(kind) = set.iter().find(|kind| **kind != "choice") {
        return refuse(
            format!(
                "structured_outputs is not served by the Rust frontend yet beyond `choice` \
                 (this request gives `{kind}`)"
            ),
            FIELD,
        );
    }
    match given.get("choice") {
        Some(strings) if set.len() == 1 => choice(strings, FIELD),
        _ => refuse(
            format!(
                "structured_outputs: structured outputs need exactly one of {} (got none)",
                KINDS.join(", ")
            ),
            FIELD,
        ),
    }
}

/// The grammar the request's output must follow, if any: `guided_choice` or
/// `structured_outputs.choice`, at most one of them (the fields this server serves no shape
/// for were refused before).
pub fn structured(body: &Map<String, Value>) -> Result<Option<StructuredOutputs>, Refusal> {
    let mut asked: Vec<(&'static str, Vec<String>)> = Vec::new();
    if let Some(value) = body.get("guided_choice").filter(|v| !v.is_null()) {
        asked.push(("guided_choice", choice(value, "guided_choice")?));
    }
    if let Some(value) = body.get("structured_outputs").filter(|v| !v.is_null()) {
        asked.push(("structured_outputs", structured_outputs(value)?));
    }
    if asked.len() > 1 {
        let named: Vec<&str> = asked.iter().map(|(field, _)| *field).collect();
        return refuse(
            format!("give at most one output shape, got {}", named.join(", ")),
            asked[1].0,
        );
    }
    Ok(asked.pop().map(|(_, strings)| StructuredOutputs {
        json: None,
        json_object: false,
        regex: None,
        choice: Some(strings),
        grammar: None,
    }))
}

/// One entry of `tools`, checked as the Python servers' `Tool` model checks it.
fn check_tool(tool: &Value) -> Result<(), String> {
    if tool.get("type").and_then(Value::as_str) != Some("function") {
        return Err("each tool's type must be \"function\"".into());
    }
    let Some(function) = tool.get("function").and_then(Value::as_object) else {
        return Err("each tool needs a function object".into());
    };
    let name = function.get("name").and_then(Value::as_str).unwrap_or("");
    let valid = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '-';
    if name.is_empty() || name.len() > 64 || !name.chars().all(valid) {
        return Err(format!(
            "a tool's function name must be 1 to 64 of A-Z, a-z, 0-9, _ and -, got {name:?}"
        ));
    }
    for (key, fits) in [
        ("description", Value::is_string as fn(&Value) -> bool),
        ("parameters", Value::is_object),
        ("strict", Value::is_boolean),
    ] {
        if function.get(key).is_some_and(|v| !v.is_null() && !fits(v)) {
            return Err(format!("function {name}: {key} has the wrong type"));
        }
    }
    Ok(())
}

/// Whether the request leaves calling its tools to the model, to be read back by the
/// tool-call parser (`hermes`: whether this server has one): tools with `tool_choice` auto,
/// the default. Tools with `tool_choice` none are only the template's; forced calls are
/// refused (not served yet), and so is auto without a parser, as the Python servers refuse it.
pub fn auto_tools(body: &Map<String, Value>, hermes: bool) -> Result<bool, Refusal> {
    let tools = match body.get("tools") {
        None | Some(Value::Null) => &[][..],
        Some(Value::Array(tools)) => tools.as_slice(),
        Some(_) => return refuse("tools must be a list", "tools"),
    };
    for tool in tools {
        check_tool(tool).map_err(|message| Refusal(message, "tools"))?;
    }
    let choice = match body.get("tool_choice") {
        None | Some(Value::Null) => "auto",
        Some(Value::String(s)) if ["none", "auto", "required"].contains(&s.as_str()) => s,
        Some(Value::Object(named))
            if named.get("type").and_then(Value::as_str) == Some("function")
                && named
                    .get("function")
                    .and_then(|f| f.get("name"))
                    .and_then(Value::as_str)
                    .is_some_and(|name| !name.is_empty()) =>
        {
            "named"
        }
        Some(_) => {
            return refuse(
                "tool_choice must be \"none\", \"auto\", \"required\" or \
                 {\"type\": \"function\", \"function\": {\"name\": ...}}",
                "tool_choice",
            )
        }
    };
    if tools.is_empty() {
        return Ok(false); // tool_choice means nothing without tools, as on the Python servers
    }
    match choice {
        "none" => Ok(false),
        "auto" if hermes => Ok(true),
        "auto" => refuse(NO_TOOL_PARSER, "tool_choice"),
        "required" => refuse(
            "tool_choice 'required' is not served by the Rust frontend yet",
            "tool_choice",
        ),
        _ => refuse(
            "tool_choice naming a function is not served by the Rust frontend yet",
            "tool_choice",
        ),
    }
}

/// `chat_template_kwargs`: an object whose names are not the template's own.
pub fn check_template_variables(body: &Map<String, Value>) -> Result<(), Refusal> {
    const FIELD: &str = "chat_template_kwargs";
    let variables = match body.get(FIELD) {
        None | Some(Value::Null) => return Ok(()),
        Some(Value::Object(variables)) => variables,
        Some(_) => return refuse("chat_template_kwargs must be an object", FIELD),
    };
    let taken: Vec<String> = variables
        .keys()
        .filter(|name| TEMPLATE_OWN.contains(&name.as_str()))
        .map(|name| format!("'{name}'"))
        .collect();
    if taken.is_empty() {
        return Ok(());
    }
    refuse(
        format!(
            "chat_template_kwargs: cannot set {}: the request's own fields give the template \
             those",
            taken.join(", ")
        ),
        FIELD,
    )
}
