//! Shared by the conductor integration tests: where the synthetic trace is.
//!
//! The crate sits two levels below the workspace root, whose `tests/data/`
//! holds the trace; change [`TRACE_PATH`] here if it moves.

use kvpool_sim::trace::Trace;

/// The Mooncake synthetic trace (3,993 requests).
pub const TRACE_PATH: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../tests/data/synthetic_trace.jsonl"
);

/// Loads [`TRACE_PATH`].
pub fn load_trace() -> Trace {
    Trace::load(std::path::Path::new(TRACE_PATH))
        .unwrap_or_else(|e| panic!("cannot load the synthetic trace: {e}"))
}
