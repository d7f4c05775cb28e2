//! `/openapi.json`: the document the Python API servers publish, less the routes this server
//! does not serve, written from their own routes into `rust/frontend/openapi.json`
//! (`python -m rankcast.api_server.openapi_document`) and embedded here, with the served
//! vocabulary's last token id put where the copy holds its placeholder; so a fleet's two kinds
//! of server publish the same schema for the routes they share, byte for byte.

/// The copy, as the Python servers render theirs (compact JSON).
const DOCUMENT: &str = include_str!("../../openapi.json");
/// What the copy holds in place of the last token id (`VOCAB_PLACEHOLDER` in Python).
const VOCAB_PLACEHOLDER: &str = "\"maximum\":987654321";

/// The document for a model whose vocabulary has `vocab` tokens.
pub fn document(vocab: usize) -> String {
    let bound = format!("\"maximum\":{}", vocab.saturating_sub(1));
    DOCUMENT.replace(VOCAB_PLACEHOLDER, &bound)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_token_id_bound_is_the_vocabularys() {
        let served = document(49152);
        assert!(!served.contains(VOCAB_PLACEHOLDER));
        assert!(served.contains("\"maximum\":49151"));
        assert!(served.contains("\"/v1/responses\""));
        assert!(!served.contains("\"/collective_rpc\""));
    }
}
