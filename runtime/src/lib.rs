//! kvpool's runtime: thread-per-core shards (glommio), the bridge to the actor
//! side (tokio), key-to-shard hashing, the prefix-chained chunk hash of KV
//! cache chunks, config loading, metrics and tracing, and the HTTP limits
//! every role's listeners are served with (the server is `kvpool-http`).
//!
//! This crate knows nothing of kvpool's roles; `storage`, `transport` and
//! the crates under `actors/` build on it.

pub mod chunk_hash;
pub mod config;
pub mod hash;
pub mod http_limits;
pub mod metrics;
pub mod net;
pub mod shard;
pub mod telemetry;

pub use shard::{
    DrainGuard, ShardCtx, ShardHandle, ShardJob, ShardPool, ShardPoolConfig, Shutdown,
};

/// Errors of the runtime layer.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("config: {0}")]
    Config(String),
    #[error("shard: {0}")]
    Shard(String),
    #[error("shard {0} has stopped")]
    ShardGone(usize),
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
}

/// Resolves when the process receives SIGINT or SIGTERM. Must run inside a
/// tokio runtime.
pub async fn wait_for_signal() -> std::io::Result<&'static str> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut int = signal(SignalKind::interrupt())?;
    let mut term = signal(SignalKind::terminate())?;
    tokio::select! {
        _ = int.recv() => Ok("SIGINT"),
        _ = term.recv() => Ok("SIGTERM"),
    }
}
