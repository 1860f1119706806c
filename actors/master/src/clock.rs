//! The process clock for metadata: milliseconds since the process started,
//! monotonic. The master's state machine takes `now_ms` as an argument, so
//! tests drive it with a simulated clock instead.

use std::sync::OnceLock;
use std::time::Instant;

static EPOCH: OnceLock<Instant> = OnceLock::new();

/// Milliseconds since the first call in this process (monotonic).
pub fn now_ms() -> u64 {
    EPOCH.get_or_init(Instant::now).elapsed().as_millis() as u64
}
