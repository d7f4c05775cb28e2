//! The methods each route takes, for the answer to a method it does not take: 405 with
//! `Allow`, as the Python servers' router answers it (the methods of the first route, in the
//! order they are declared, whose path matches), so a wrong method gets the same answer from
//! either kind of API server, and is counted under that route as they count it.

use hyper::header::{HeaderValue, ALLOW};
use hyper::{Method, StatusCode};

use super::chat_turn::ApiError;
use super::{errors, Reply};
use crate::routes::allowed;

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
