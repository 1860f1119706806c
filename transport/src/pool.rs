//! Client-side TCP connection pools (tokio), one per address, bounded.
//!
//! A call takes a connection, uses it, and gives it back only if it is in a
//! known state (the whole answer was read). A connection dropped mid-request
//! is reset (unsent bytes discarded), never reused. More concurrent calls than connections wait for
//! one (under the caller's deadline): the bound is the back-pressure.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::compat::{Compat, TokioAsyncReadCompatExt};

use kvpool_wire::error::{ErrorCode, KvError};

/// A pooled stream, seen through the `futures-io` traits the frame code uses.
pub type Stream = Compat<TcpStream>;

/// Open TCP connections of every pool in this process (for leak checks).
static OPEN: AtomicU64 = AtomicU64::new(0);

/// Connections currently open through pools in this process.
pub fn open_connections() -> u64 {
    OPEN.load(Ordering::Relaxed)
}

/// A counted stream: the count drops when the stream is closed.
struct Counted(Stream);

impl Drop for Counted {
    fn drop(&mut self) {
        OPEN.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A connection pool to one address.
pub struct ConnPool {
    addr: String,
    idle: Mutex<Vec<Counted>>,
    slots: Arc<Semaphore>,
}

/// A connection taken from a pool; closed on drop unless released.
pub struct Conn {
    stream: Option<Counted>,
    pool: Arc<ConnPool>,
    _slot: OwnedSemaphorePermit,
    fresh: bool,
}

impl Conn {
    /// Whether this connection was opened by this `get` (not reused): a
    /// connection that must introduce itself (authenticate) does it now.
    pub fn is_new(&self) -> bool {
        self.fresh
    }

    pub fn stream(&mut self) -> &mut Stream {
        &mut self.stream.as_mut().expect("present until release").0
    }

    pub fn addr(&self) -> &str {
        &self.pool.addr
    }

    /// Returns a healthy connection to its pool.
    pub fn release(mut self) {
        if let Some(s) = self.stream.take() {
            self.pool
                .idle
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(s);
        }
    }
}

impl Drop for Conn {
    /// A connection given up mid-request is reset, not closed: bytes still
    /// in its send buffer (a write abandoned on its deadline) are thrown
    /// away instead of reaching the peer late, when the master may already
    /// have given their destination to another put.
    fn drop(&mut self) {
        if let Some(s) = &self.stream {
            let _ = s.0.get_ref().set_zero_linger();
        }
    }
}

impl ConnPool {
    pub fn new(addr: String, max_connections: usize) -> Arc<Self> {
        Arc::new(Self {
            addr,
            idle: Mutex::new(Vec::new()),
            slots: Arc::new(Semaphore::new(max_connections.max(1))),
        })
    }

    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Takes an idle connection or opens one (within `connect_timeout`).
    pub async fn get(self: &Arc<Self>, connect_timeout: Duration) -> Result<Conn, KvError> {
        let slot = self
            .slots
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| KvError::new(ErrorCode::Internal, "connection pool closed"))?;
        let idle = self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let fresh = idle.is_none();
        let stream = match idle {
            Some(s) => s,
            None => {
                let s = tokio::time::timeout(connect_timeout, TcpStream::connect(&self.addr))
                    .await
                    .map_err(|_| {
                        KvError::new(
                            ErrorCode::Timeout,
                            format!("connecting to {} took over {connect_timeout:?}", self.addr),
                        )
                    })?
                    .map_err(|e| {
                        KvError::new(
                            ErrorCode::Unavailable,
                            format!("cannot connect to {}: {e}", self.addr),
                        )
                    })?;
                let _ = s.set_nodelay(true);
                OPEN.fetch_add(1, Ordering::Relaxed);
                Counted(s.compat())
            }
        };
        Ok(Conn {
            stream: Some(stream),
            pool: self.clone(),
            _slot: slot,
            fresh,
        })
    }

    /// Closes every idle connection (after a peer failure).
    pub fn clear(&self) {
        self.idle.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_lite::AsyncWriteExt;
    use std::io::Read;

    /// What the peer reads after the pool's side is dropped: a clean end of
    /// stream (`Ok(0)`) or an error.
    fn peer_end(release: bool) -> std::io::Result<usize> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let pool = ConnPool::new(addr, 1);
        let mut conn = rt
            .block_on(pool.get(Duration::from_secs(5)))
            .expect("connects");
        let (mut peer, _) = listener.accept().unwrap();
        rt.block_on(conn.stream().write_all(b"half a request"))
            .unwrap();
        let mut buf = [0u8; 14];
        peer.read_exact(&mut buf).unwrap();
        if release {
            conn.release();
            pool.clear();
        } else {
            drop(conn);
        }
        peer.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        peer.read(&mut buf)
    }

    /// A connection given up mid-request is reset, so bytes still in its
    /// send buffer never reach the peer late; a released one that is then
    /// closed ends cleanly.
    #[test]
    fn a_connection_dropped_mid_request_is_reset_not_closed() {
        let e = peer_end(false).expect_err("the peer sees a reset");
        assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{e}");
        assert_eq!(peer_end(true).unwrap(), 0, "a clean end of stream");
    }
}
