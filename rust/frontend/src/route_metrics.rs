//! Every request counted as vLLM's API server counts them (`http_requests_total`, from
//! prometheus-fastapi-instrumentator: method, status class, route template) and as the Python
//! servers' `CountRequests` middleware does, summed over the fleet with the other series each
//! server counts itself (`request_metrics`), so a scrape of any server shows the same counts.
//!
//! A request is labelled by the route that answered it, never by the path as asked, so a path
//! parameter makes one series, not one per value: a route whose path holds a parameter by the
//! template the Python servers declare it with (the route table `routes.rs` keeps), any
//! other by its path.
//! A path no route matched, a path beneath a parametrized route that its parameter does not
//! match, and a request answered before any route ran (a stopping server, the API-key check) are
//! "none", as Starlette leaves them unmatched. vLLM's probes are not counted.

use hyper::{Body, Method, Response, StatusCode};

use crate::request_metrics::RequestMetrics;
use crate::routes::{matches, ROUTES};

type Reply = Response<Body>;

/// The probes vLLM's API server leaves out of its counter (a scrape or a health check counted
/// would change the counter it reads).
const UNCOUNTED: [&str; 5] = ["/metrics", "/health", "/load", "/ping", "/version"];

/// What vLLM's counter names a request no route matched.
const UNMATCHED: &str = "none";

/// Marks an answer given without any route having matched (`handler` "none").
#[derive(Clone, Copy)]
pub(crate) struct Unrouted;

/// `reply`, marked as given before or without a route.
pub(crate) fn unrouted(mut reply: Reply) -> Reply {
    reply.extensions_mut().insert(Unrouted);
    reply
}

/// The `handler` label of a request for `path` that a route answered.
fn handler(path: &str) -> &str {
    let mut beneath = false;
    for (template, _) in ROUTES {
        match matches(template, path) {
            Some(true) => return template,
            Some(false) => {}
            None => continue,
        }
        beneath |= template.contains('{');
    }
    if beneath {
        UNMATCHED
    } else {
        path
    }
}

/// The status class, as vLLM's counter groups statuses: "2xx", "4xx", ...
fn class(status: StatusCode) -> String {
    format!("{}xx", status.as_u16() / 100)
}

/// One request being answered: counted when its answer is ready (a stream when its head is),
/// or, when the client leaves first (hyper then drops the request's future), as the 499 the
/// Python servers count then.
pub(crate) struct Counting<'a> {
    requests: &'a RequestMetrics,
    method: Method,
    path: String,
    counted: bool,
}

impl<'a> Counting<'a> {
    pub(crate) fn start(requests: &'a RequestMetrics, method: &Method, path: &str) -> Self {
        Counting {
            requests,
            method: method.clone(),
            path: path.to_string(),
            counted: UNCOUNTED.contains(&path),
        }
    }

    /// Count the answer. A 401 is the API-key check's, which answers before any route runs.
    pub(crate) fn answered(mut self, reply: &Reply) {
        let routed = reply.extensions().get::<Unrouted>().is_none()
            && reply.status() != StatusCode::UNAUTHORIZED;
        self.count(reply.status(), routed);
    }

    fn count(&mut self, status: StatusCode, routed: bool) {
        if std::mem::replace(&mut self.counted, true) {
            return;
        }
        let handler = if routed {
            handler(&self.path)
        } else {
            UNMATCHED
        };
        let method = self.method.as_str();
        self.requests
            .record_http_request(method, &class(status), handler);
    }
}

impl Drop for Counting<'_> {
    fn drop(&mut self) {
        let gone = StatusCode::from_u16(499).expect("a status");
        self.count(gone, true);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_parametrized_route_is_one_series_and_a_path_beneath_it_none() {
        assert_eq!(handler("/v1/completions"), "/v1/completions");
        assert_eq!(handler("/v1/models/m"), "/v1/models/{model_id:path}");
        assert_eq!(handler("/v1/models/a/b"), "/v1/models/{model_id:path}");
        assert_eq!(handler("/v1/models"), "/v1/models");
        assert_eq!(handler("/dashboard"), "/dashboard");
        assert_eq!(handler("/dashboard/"), "/dashboard/");
        assert_eq!(handler("/dashboard/page.js"), "/dashboard/{path}");
        assert_eq!(handler("/dashboard/a/b.js"), "none");
        assert_eq!(handler("/v1/responses"), "/v1/responses");
        assert_eq!(
            handler("/v1/responses/resp_1"),
            "/v1/responses/{response_id}"
        );
        assert_eq!(handler("/v1/responses/resp_1/x"), "none");
        assert_eq!(handler("/v1/responses/"), "none");
    }

    #[test]
    fn statuses_are_counted_by_class() {
        assert_eq!(class(StatusCode::OK), "2xx");
        assert_eq!(class(StatusCode::NOT_FOUND), "4xx");
        assert_eq!(class(StatusCode::from_u16(499).unwrap()), "4xx");
        assert_eq!(class(StatusCode::SERVICE_UNAVAILABLE), "5xx");
    }

    fn counted(requests: &RequestMetrics) -> Vec<String> {
        let mut out = String::new();
        requests.render(&mut out);
        let mut lines: Vec<String> = out
            .lines()
            .filter(|line| line.starts_with("http_requests_total{"))
            .map(str::to_string)
            .collect();
        lines.sort();
        lines
    }

    #[test]
    fn an_answer_is_counted_once_unrouted_ones_and_refused_keys_as_none_probes_not_at_all() {
        let requests = RequestMetrics::new("m", 0, None);
        let reply = |status: u16| {
            hyper::Response::builder()
                .status(status)
                .body(hyper::Body::empty())
                .expect("a reply")
        };
        for id in ["a", "b"] {
            let path = format!("/v1/models/{id}");
            Counting::start(&requests, &Method::GET, &path).answered(&reply(404));
        }
        Counting::start(&requests, &Method::POST, "/v1/completions").answered(&reply(200));
        Counting::start(&requests, &Method::POST, "/v1/completions").answered(&reply(401));
        Counting::start(&requests, &Method::GET, "/nowhere").answered(&unrouted(reply(404)));
        // A client gone before its answer was ready.
        drop(Counting::start(
            &requests,
            &Method::POST,
            "/v1/chat/completions",
        ));
        Counting::start(&requests, &Method::GET, "/metrics").answered(&reply(200));
        assert_eq!(
            counted(&requests),
            [
                "http_requests_total{handler=\"/v1/chat/completions\",method=\"POST\",status=\"4xx\"} 1.0",
                "http_requests_total{handler=\"/v1/completions\",method=\"POST\",status=\"2xx\"} 1.0",
                "http_requests_total{handler=\"/v1/models/{model_id:path}\",method=\"GET\",status=\"4xx\"} 2.0",
                "http_requests_total{handler=\"none\",method=\"GET\",status=\"4xx\"} 1.0",
                "http_requests_total{handler=\"none\",method=\"POST\",status=\"4xx\"} 1.0",
            ]
        );
    }
}
