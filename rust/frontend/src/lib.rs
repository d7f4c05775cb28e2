//! The parts of the Rust API server that other binaries share: the engine view (`view`), kept
//! exactly as the Python servers keep theirs, and the per-engine container the server reads
//! (`engine_views`); the chat output parsers (`output_parsers`) with the JSON they write
//! (`pyjson`), kept exactly as the Python servers' are. `rankcast-frontend` (main.rs) serves
//! them; `view_replay` and `parse_replay` run golden, generated and cut outputs through them for
//! the cross-language tests.

pub mod engine_views;
pub mod output_parsers;
pub mod pyjson;
pub mod view;
