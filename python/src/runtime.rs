//! The process's tokio runtime for every client and embedded node of the
//! module, started at first use.
//!
//! Python threads call [`block_on`] with the GIL released; the futures run
//! on the runtime's workers (the client's pings, the embedded node's actor
//! and shm server live there too). A runtime does not survive `fork`: a
//! child that inherited one gets an error instead of a call that never ends.

use std::future::Future;
use std::sync::OnceLock;

use kvpool_wire::{ErrorCode, KvError};

/// Worker threads of the runtime (`KVPOOL_PY_THREADS` overrides).
const DEFAULT_THREADS: usize = 2;

struct Rt {
    rt: tokio::runtime::Runtime,
    pid: u32,
}

static RT: OnceLock<Result<Rt, String>> = OnceLock::new();

fn runtime() -> Result<&'static tokio::runtime::Runtime, KvError> {
    let rt = RT.get_or_init(|| {
        init_logging();
        let threads = std::env::var("KVPOOL_PY_THREADS")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|&n| n > 0)
            .unwrap_or(DEFAULT_THREADS);
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name("kvpool-py")
            .enable_all()
            .build()
            .map(|rt| Rt {
                rt,
                pid: std::process::id(),
            })
            .map_err(|e| format!("cannot start the tokio runtime: {e}"))
    });
    match rt {
        Ok(r) if r.pid == std::process::id() => Ok(&r.rt),
        Ok(_) => Err(KvError::new(
            ErrorCode::Unavailable,
            "this process was forked after kvpool started its threads: \
             create clients in the child, after the fork",
        )),
        Err(e) => Err(KvError::new(ErrorCode::Internal, e.clone())),
    }
}

/// Runs `f` to completion on the runtime. Call it with the GIL released.
pub fn block_on<F: Future>(f: F) -> Result<F::Output, KvError> {
    Ok(runtime()?.block_on(f))
}

/// Logs on stderr, filtered by `KVPOOL_LOG` (default `warn`).
fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("KVPOOL_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .try_init();
}
