//! Tracing set-up: human-readable logs on stderr, filtered by `RUST_LOG`
//! (default `info`). Stdout is kept for the one-line readiness messages and
//! command output that scripts read. Colour codes only when stderr is a
//! terminal (and `NO_COLOR` is unset): a log file or pipe gets plain text.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

/// Installs the global subscriber; later calls are no-ops.
pub fn init() {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info,glommio=warn"));
    let ansi = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none();
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi)
        .with_target(false)
        .try_init();
}
