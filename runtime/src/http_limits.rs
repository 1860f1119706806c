//! The limits of an HTTP listener (`kvpool_http::serve`), apart from the
//! server: the config crate names them for every role, the client included,
//! which builds without HTTP.

use std::time::Duration;

/// A request head (and the wait for the next request on a kept-alive
/// connection) must arrive within this: hyper's own default, which
/// `axum::serve` left without the timer it needs.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// A request body must arrive in full within this of its head: the 16 MiB
/// bodies the serving front accepts at 0.3 MB/s; a client slower than that
/// gets 400 and the connection closes.
pub const BODY_READ_TIMEOUT: Duration = Duration::from_secs(60);
/// Connections open at once on one listener. One more takes the place of
/// the oldest idle connection; with none idle, it waits until one closes.
/// Four times what the serving front admits
/// by default (`max_in_flight` 256), so kept-alive idle clients do not
/// crowd out requests, and far below the descriptors a process has: a
/// flood of sockets runs into this cap, not into `EMFILE` for the pool's
/// own connections.
pub const MAX_CONNECTIONS: usize = 1024;

/// The limits of one listener (`[runtime] http_*` in the config; the
/// constants above are their defaults).
#[derive(Debug, Clone, Copy)]
pub struct HttpLimits {
    pub header_read_timeout: Duration,
    pub body_read_timeout: Duration,
    pub max_connections: usize,
}

impl Default for HttpLimits {
    fn default() -> Self {
        Self {
            header_read_timeout: HEADER_READ_TIMEOUT,
            body_read_timeout: BODY_READ_TIMEOUT,
            max_connections: MAX_CONNECTIONS,
        }
    }
}
