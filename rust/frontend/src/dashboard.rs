//! `/dashboard`: the same static page the Python API servers serve (rankcast/api_server/dashboard/),
//! compiled in, so the Rust server needs no files beside its binary and never serves other
//! bytes than the Python ones. The page holds no data; the routes it calls ask for the key.

const INDEX: &str = include_str!("../../../rankcast/api_server/dashboard/index.html");
const SCRIPT: &str = include_str!("../../../rankcast/api_server/dashboard/dashboard.js");
const STYLE: &str = include_str!("../../../rankcast/api_server/dashboard/dashboard.css");

/// The asset at `path` under /dashboard ("" or "/": the page) and its content type; None for
/// anything else.
pub fn asset(path: &str) -> Option<(&'static str, &'static str)> {
    match path {
        "" | "/" => Some((INDEX, "text/html; charset=utf-8")),
        "/dashboard.js" => Some((SCRIPT, "text/javascript; charset=utf-8")),
        "/dashboard.css" => Some((STYLE, "text/css; charset=utf-8")),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_and_its_files_are_served_and_nothing_else() {
        for path in ["", "/", "/dashboard.js", "/dashboard.css"] {
            assert!(asset(path).is_some(), "{path}");
        }
        assert!(asset("/../Cargo.toml").is_none());
        assert!(INDEX.contains("/dashboard/dashboard.js"));
    }
}
