//! The parts of the Rust API server that other binaries share: the engine view (`view`), kept
//! exactly as the Python servers keep theirs, and the per-engine container the server reads
//! (`engine_views`). `rankcast-frontend` (main.rs) serves them; `view_replay` replays golden
//! and generated event streams through them for the cross-language tests.

pub mod engine_views;
pub mod view;
