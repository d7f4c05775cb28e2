//! Errors in the shape of the API a route belongs to (`rankcast/api_server/errors.py`), so
//! official clients raise the right exception types: OpenAI's everywhere but under
//! `/v1/messages`, which answers Anthropic's.

use hyper::StatusCode;
use rankcast_frontend::object;
use rankcast_frontend::pyjson::Json;

use super::chat_turn::ApiError;
use super::{error_body, text_reply, Reply};
use crate::drain::RETRY_AFTER_S;

pub const ANTHROPIC_PREFIX: &str = "/v1/messages";

/// Anthropic's error body (its SDK maps the status to an exception class and shows the type
/// and message).
pub fn anthropic_error_body(status: StatusCode, message: &str) -> Json {
    let kind = match status.as_u16() {
        400 | 405 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 => "overloaded_error",
        _ => "api_error",
    };
    object![
        ("type", "error"),
        ("error", object![("type", kind), ("message", message)]),
    ]
}

/// The error answer for a request to `path` (Anthropic's shape under /v1/messages, where the
/// field has no place of its own and is named in the message).
pub fn reply(path: &str, error: &ApiError) -> Reply {
    let ApiError {
        status,
        message,
        param,
        retry_after,
    } = error;
    let body = if path.starts_with(ANTHROPIC_PREFIX) {
        let message = match param {
            Some(param) if !message.contains(param.as_str()) => format!("{param}: {message}"),
            _ => message.clone(),
        };
        anthropic_error_body(*status, &message)
    } else {
        error_body(*status, message, param.as_deref())
    };
    let mut reply = text_reply(*status, body.response());
    if *retry_after {
        let retry = hyper::header::HeaderValue::from(RETRY_AFTER_S);
        reply.headers_mut().insert("retry-after", retry);
    }
    reply
}
