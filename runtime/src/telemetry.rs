//! Tracing set-up: human-readable logs on stderr, filtered by `RUST_LOG`
//! (default `info`). Stdout is kept for the one-line readiness messages and
//! command output that scripts read.

use tracing_subscriber::EnvFilter;

/// Installs the global subscriber; later calls are no-ops.
pub fn init() {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info,glommio=warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .try_init();
}
