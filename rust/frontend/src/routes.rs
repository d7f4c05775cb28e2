//! The route table the Python servers declare (`rankcast/api_server/`), kept once for the Rust
//! server's two uses of it: the 405 answer to a method a route does not take (`openai/methods.rs`)
//! and the route label `http_requests_total` counts a request under (`route_metrics.rs`). A leaf:
//! it imports nothing of the crate, so both can depend on it without depending on each other.

/// (path template, the methods of its first route), as the Python servers declare them
/// (`rankcast/api_server/`): `{name}` is one path segment, `{name:path}` the rest. Also what
/// `http_requests_total` labels a request with.
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
pub(crate) fn allowed(path: &str) -> Option<&'static str> {
    ROUTES
        .iter()
        .find(|(template, _)| matches(template, path) == Some(true))
        .map(|(_, methods)| *methods)
}

/// Whether `path` matches `template`; None when it lies beneath the template's fixed part
/// without matching its parameter (a path no route of that prefix takes).
pub(crate) fn matches(template: &str, path: &str) -> Option<bool> {
    let Some((fixed, parameter)) = template.split_once('{') else {
        return Some(template == path);
    };
    let rest = path.strip_prefix(fixed)?;
    if parameter.contains(":path}") {
        return Some(true);
    }
    Some(!rest.is_empty() && !rest.contains('/'))
}
