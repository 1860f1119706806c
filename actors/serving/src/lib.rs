//! The serving path: requests in, tokens out, KV through the pool.
//!
//! ```text
//!  client (OpenAI API)
//!     |  POST /v1/(chat/)completions, X-Request-Id
//!     v
//!  front + Conductor (this crate's `front`, kvpool-conductor's actor and Scheduler)
//!     |  tokenize (engine /tokenize), batch exists on the chunk keys (pool),
//!     |  schedule: (prefill i, decode j) or 503 + Retry-After
//!     |----------------------------------.
//!     v                                  v
//!  PrefillProxy i (actor)             DecodeProxy j (actor)         <- GET /v1/load (reports)
//!     |  max_tokens 1, stream false,     |  + kv_transfer_params, stream
//!     |  do_remote_decode                |
//!     v                                  v
//!  prefill engine  --KV chunks-->  pool  --KV chunks-->  decode engine
//! ```
//!
//! Modules:
//! - [`front`]: the OpenAI-compatible front, the live conductor's inputs
//!   (tokens, pool prefix, proxies' reports) and failover;
//! - [`proxy`]: the [`proxy::PrefillProxy`] and [`proxy::DecodeProxy`]
//!   actors and their HTTP routes;
//! - [`roles`]: `kvpool run --role conductor|prefill-proxy|decode-proxy`
//!   and role all's serving half;
//! - [`chat`]: `kvpool chat`;
//! - [`http`], [`sse`], [`api`]: the HTTP client, server-sent events, and
//!   what the routes share (request ids, OpenAI's error shape).

pub mod api;
pub mod chat;
pub mod front;
pub mod http;
pub mod proxy;
pub mod roles;
pub mod sse;

/// Why a serving role could not start or run.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// A bad setting; the message names the key.
    #[error("config: {0}")]
    Config(String),
    /// Anything else.
    #[error("{0}")]
    Start(String),
}
