//! `/dashboard`: the same static page the Python API servers serve (rankcast/dashboard/),
//! compiled in, so the Rust server needs no files beside its binary and never serves other
//! bytes than the Python ones. The page holds no data; the routes it calls ask for the key.

use hyper::{Body, Response, StatusCode};

use crate::openai::{error, Reply};

const INDEX: &str = include_str!("../../../rankcast/dashboard/index.html");
const SCRIPT: &str = include_str!("../../../rankcast/dashboard/dashboard.js");
const STYLE: &str = include_str!("../../../rankcast/dashboard/dashboard.css");

/// The asset at `path` under /dashboard ("" or "/": the page).
pub fn reply(path: &str) -> Reply {
    let (body, content_type) = match path {
        "" | "/" => (INDEX, "text/html; charset=utf-8"),
        "/dashboard.js" => (SCRIPT, "text/javascript; charset=utf-8"),
        "/dashboard.css" => (STYLE, "text/css; charset=utf-8"),
        _ => {
            return error(
                StatusCode::NOT_FOUND,
                &format!("no dashboard file {path:?}"),
                None,
            )
        }
    };
    Response::builder()
        .header("content-type", content_type)
        .header("cache-control", "no-cache")
        .body(Body::from(body))
        .expect("a response")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_and_its_files_are_served_and_nothing_else() {
        for path in ["", "/", "/dashboard.js", "/dashboard.css"] {
            assert_eq!(reply(path).status(), StatusCode::OK, "{path}");
        }
        assert_eq!(reply("/../Cargo.toml").status(), StatusCode::NOT_FOUND);
        assert!(INDEX.contains("/dashboard/dashboard.js"));
    }
}
