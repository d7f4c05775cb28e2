//! `/tokenize` and `/detokenize`: the server's tokenizer in vLLM's request and response shapes,
//! as the Python servers answer them (`rankcast/api_server/tokenization.py`), so a client
//! counts or inspects tokens exactly as the engine will see them whichever server it reaches.

use rankcast_frontend::object;
use rankcast_frontend::pyjson::Json;
use serde_json::{Map, Value};

use super::{BadRequest, Server};
use crate::fields::{self, Invalid};
use crate::shape::Refusal;

/// `POST /tokenize`: a completion `prompt`, or chat `messages` through the chat template (the
/// ids a completion, or a chat completion, of the same request computes).
pub fn tokenize(server: &Server, body: &Map<String, Value>) -> Result<Json, BadRequest> {
    // `TokenizeRequest`'s fields in their order, then its check that one input is given.
    let mut invalid = Invalid::default();
    let model = invalid.field(body, "model", None, fields::optional_string);
    let prompt = invalid.field(body, "prompt", None, fields::optional_string);
    let messages = match body.get("messages") {
        None | Some(Value::Null) => None,
        Some(given) => Some(fields::messages(&mut invalid, "messages", given, 1)),
    };
    let add_special = invalid.field(body, "add_special_tokens", None, fields::optional_boolean);
    let add_generation_prompt = invalid.field(body, "add_generation_prompt", true, fields::boolean);
    let return_token_strs = invalid.field(body, "return_token_strs", false, fields::boolean);
    let variables = invalid.field(body, "chat_template_kwargs", None, fields::optional_object);
    if variables.is_some() {
        // The names the template gives itself are refused (the Python servers' field check).
        if let Err(Refusal(message, field)) = crate::shape::check_template_variables(body) {
            let prefix = format!("{field}: ");
            invalid.add(field, message.strip_prefix(&prefix).unwrap_or(&message));
        }
    }
    if !invalid.is_empty() {
        return Err(invalid.into());
    }
    if prompt.is_some() == messages.is_some() {
        return Err(BadRequest::new("give either prompt or messages", None));
    }
    server.lora_for(model.as_deref())?;
    // The byte-level tokenizers this server reads add no special tokens to a text (their
    // post-processing names none), so `add_special_tokens` changes no id here.
    let _ = add_special;
    let tokens = match (prompt, messages) {
        (Some(prompt), _) => server.tokenizer.encode(&prompt),
        (None, Some(messages)) => {
            let text = server.render_chat(&messages, add_generation_prompt)?;
            server.tokenizer.encode(&text)
        }
        (None, None) => unreachable!("one input was checked to be given"),
    };
    let token_strs = return_token_strs.then(|| {
        tokens
            .iter()
            .map(|&id| Json::from(server.tokenizer.token_string(id).unwrap_or_default()))
            .collect::<Vec<Json>>()
    });
    Ok(object![
        ("count", tokens.len()),
        ("max_model_len", server.max_model_len),
        ("tokens", tokens),
        ("token_strs", token_strs.map(Json::Array)),
    ])
}

/// `POST /detokenize`: the text of `tokens` (special tokens kept, as the Python servers
/// decode them here).
pub fn detokenize(server: &Server, body: &Map<String, Value>) -> Result<Json, BadRequest> {
    let mut invalid = Invalid::default();
    let model = invalid.field(body, "model", None, fields::optional_string);
    let tokens = match body.get("tokens") {
        None => {
            invalid.missing(body, "", "tokens");
            Vec::new()
        }
        Some(given) => fields::token_ids(&mut invalid, "tokens", given),
    };
    if !invalid.is_empty() {
        return Err(invalid.into());
    }
    server.lora_for(model.as_deref())?;
    let vocab = server.tokenizer.vocab_size() as i64;
    if tokens.iter().any(|&id| id >= vocab) {
        let message = format!("token ids must be in [0, {vocab})");
        return Err(BadRequest::new(message, Some("tokens")));
    }
    let ids: Vec<u32> = tokens.iter().map(|&id| id as u32).collect();
    Ok(object![("prompt", server.tokenizer.decode(&ids, false))])
}
