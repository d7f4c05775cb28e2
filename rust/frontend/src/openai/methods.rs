//! The methods each route takes, for the answer to a method it does not take: 405 with
//! `Allow`, as the Python servers' router answers it (the methods of the first route, in the
//! order they are declared, whose path matches), so a wrong method gets the same answer from
//! either kind of API server, and is counted under that route as they count it.

use hyper::header::{HeaderValue, ALLOW};
use hyper::{Method, StatusCode};

use super::chat_turn::ApiError;
use super::{errors, Reply};
use crate::route_metrics;

/// (path template, the methods of its first route), as the Python servers declare them
/// (`rankcast/api_server/`): `{name}` is one path segment, `{name:path}` the rest. Also what
/// `http_requests_total` labels a request with (`route_metrics.rs`).
pub(crate) const ROUTES: &[(&str, &str)] = &[
    ("/health", "GET"),
    ("/ping", "GET"), // its GET route, then its POST route
    ("/load", "GET"),
    ("/version", "GET"),
    ("/metrics", "GET"),
    ("/openapi.json", "GET"),
    ("/docs", "GET"),
    ("/docs/oauth2-redirect", "GET"),
    ("/redoc", "GET"),
    ("/kv_event_sources", "GET"),
    ("/get_server_info", "GET"),
    ("/tokenize", "POST"),
    ("/detokenize", "POST"),
    ("/collective_rpc", "POST"),
    ("/reset_prefix_cache", "POST"),
    ("/v1/models", "GET"),
    ("/v1/models/{model_id:path}", "GET"),
    ("/v1/completions", "POST"),
    ("/v1/completions/render", "POST"),
    ("/v1/chat/completions", "POST"),
    ("/v1/chat/completions/render", "POST"),
    ("/v1/responses", "POST"),
    ("/v1/responses/{response_id}", "GET"),
    ("/v1/messages", "POST"),
    ("/v1/messages/count_tokens", "POST"),
    ("/v1/lora_adapters", "GET"),
    ("/v1/load_lora_adapter", "POST"),
    ("/v1/unload_lora_adapter", "POST"),
    ("/v1/pin_lora_adapter", "POST"),
    ("/v1/unpin_lora_adapter", "POST"),
    ("/v1/engine_views", "GET"),
    ("/v1/events", "GET"),
    ("/dashboard", "GET"),
    ("/dashboard/", "GET"),
    ("/dashboard/{path}", "GET"),
];

/// The methods the first route matching `path` takes, or None where no route's path matches.
pub fn allowed(path: &str) -> Option<&'static str> {
    ROUTES
        .iter()
        .find(|(template, _)| route_metrics::matches(template, path) == Some(true))
        .map(|(_, methods)| *methods)
}

/// The answer to `method` on `path` when no route of this server took it: 405 naming the
/// methods where a route's path matches and the method is not among them, else None (a 404:
/// no such route here).
pub fn refusal(method: &Method, path: &str) -> Option<Reply> {
    let allow = allowed(path)?;
    if allow.split(", ").any(|m| m == method.as_str()) {
        return None;
    }
    Some(not_allowed(path, allow))
}

/// 405 in the route's API shape, with `Allow: methods`.
pub fn not_allowed(path: &str, methods: &'static str) -> Reply {
    let refusal = ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "Method Not Allowed", None);
    let mut reply = errors::reply(path, &refusal);
    reply
        .headers_mut()
        .insert(ALLOW, HeaderValue::from_static(methods));
    reply
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wrong_method_names_the_first_matching_routes_methods() {
        let allow = |method: Method, path| {
            refusal(&method, path).map(|r| r.headers()[ALLOW].to_str().unwrap().to_string())
        };
        assert_eq!(allow(Method::TRACE, "/version").as_deref(), Some("GET"));
        assert_eq!(
            allow(Method::PUT, "/v1/responses/resp_1").as_deref(),
            Some("GET")
        );
        assert_eq!(allow(Method::GET, "/v1/messages").as_deref(), Some("POST"));
        assert_eq!(allow(Method::DELETE, "/ping").as_deref(), Some("GET"));
        assert_eq!(
            allow(Method::HEAD, "/v1/models/a/b").as_deref(),
            Some("GET")
        );
        // A method the route takes, or a path no route has: not a 405.
        assert!(refusal(&Method::POST, "/collective_rpc").is_none());
        assert!(refusal(&Method::GET, "/nowhere").is_none());
        assert!(refusal(&Method::GET, "/v1/responses/a/b").is_none());
        let reply = refusal(&Method::GET, "/v1/messages").unwrap();
        assert_eq!(reply.status(), StatusCode::METHOD_NOT_ALLOWED);
    }
}
