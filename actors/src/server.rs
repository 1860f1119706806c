//! The shard-side TCP server loop shared by the master and storage nodes.
//!
//! Each shard accepts on its own port and runs one local task per connection.
//! A connection handles one request at a time: wait for a header (idle
//! deadline, or shutdown), then the request's payload and answer run under the
//! I/O deadline while a drain guard keeps the shard alive for them. A frame
//! that cannot be parsed gets an error frame and the connection is closed;
//! the shard goes on serving everyone else.

use std::cell::Cell;
use std::future::Future;
use std::os::fd::{FromRawFd, IntoRawFd};
use std::rc::Rc;
use std::time::Duration;

use glommio::net::{TcpListener, TcpStream};
use kvpool_runtime::ShardCtx;
use kvpool_transport::frame::{self, FrameError, FrameHeader};
use kvpool_transport::{ErrorCode, KvError};

/// Bounds of one shard's server.
#[derive(Debug, Clone, Copy)]
pub struct ServerLimits {
    pub max_connections: usize,
    pub idle_timeout: Duration,
    pub io_timeout: Duration,
    pub max_frame_bytes: u32,
}

/// What a handler tells the loop after one request.
pub enum Next {
    /// Wait for the next request on this connection.
    Continue,
    /// Close the connection (the handler already answered if it could).
    Close,
}

/// Turns a std listener (bound on the main thread) into the shard's listener.
pub fn into_glommio(listener: std::net::TcpListener) -> TcpListener {
    // SAFETY: the fd comes from `into_raw_fd`, so this is its only owner; it is
    // a bound, listening TCP socket, which is what glommio's listener expects.
    unsafe { TcpListener::from_raw_fd(listener.into_raw_fd()) }
}

/// Serves one request: reads the payload announced by `hdr` from `stream`,
/// acts, answers. Runs on the shard's thread.
pub trait Handler: 'static {
    fn handle(&self, hdr: FrameHeader, stream: &mut TcpStream) -> impl Future<Output = Next>;
}

/// Accepts connections until shutdown; runs `handler` for each request frame.
pub async fn serve<H: Handler>(
    ctx: ShardCtx,
    listener: TcpListener,
    limits: ServerLimits,
    role: &'static str,
    handler: Rc<H>,
) {
    let active = Rc::new(Cell::new(0usize));
    loop {
        let accepted = futures_lite::future::or(async { Some(listener.accept().await) }, async {
            ctx.shutdown().wait().await;
            None
        })
        .await;
        let stream = match accepted {
            None => break,
            Some(Ok(s)) => s,
            Some(Err(e)) => {
                tracing::warn!(role, shard = ctx.id(), "accept failed: {e}");
                // Out of fds and the like: back off instead of spinning.
                glommio::timer::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        if active.get() >= limits.max_connections {
            let msg = KvError::new(
                ErrorCode::ResourceExhausted,
                format!(
                    "{role} shard {} is at its limit of {} connections",
                    ctx.id(),
                    limits.max_connections
                ),
            );
            glommio::spawn_local(async move {
                let _ = stream.set_write_timeout(Some(Duration::from_secs(1)));
                let mut s = stream;
                let _ = frame::write_all(&mut s, &frame::encode_error(0, &msg)).await;
            })
            .detach();
            continue;
        }
        active.set(active.get() + 1);
        let ctx2 = ctx.clone();
        let handler = handler.clone();
        let active2 = active.clone();
        glommio::spawn_local(async move {
            connection(ctx2, stream, limits, role, &*handler).await;
            active2.set(active2.get() - 1);
        })
        .detach();
    }
}

async fn connection<H: Handler>(
    ctx: ShardCtx,
    mut stream: TcpStream,
    limits: ServerLimits,
    role: &'static str,
    handler: &H,
) {
    loop {
        let _ = stream.set_read_timeout(Some(limits.idle_timeout));
        let got = futures_lite::future::or(
            async { Some(frame::read_header(&mut stream, limits.max_frame_bytes).await) },
            async {
                ctx.shutdown().wait().await;
                None
            },
        )
        .await;
        let hdr = match got {
            None => break,
            Some(Ok(h)) => h,
            Some(Err(e)) => {
                if !e.is_disconnect() {
                    reject(&mut stream, 0, &e, role).await;
                }
                break;
            }
        };
        let _guard = ctx.drain_guard();
        let _ = stream.set_read_timeout(Some(limits.io_timeout));
        let _ = stream.set_write_timeout(Some(limits.io_timeout));
        match handler.handle(hdr, &mut stream).await {
            Next::Continue => {}
            Next::Close => break,
        }
    }
}

/// Answers a bad frame with an error frame (best effort) before closing.
pub async fn reject(stream: &mut TcpStream, request_id: u64, e: &FrameError, role: &str) {
    tracing::debug!(role, "refusing a frame: {e}");
    let err = KvError::new(e.code(), e.to_string());
    let _ = frame::write_all(stream, &frame::encode_error(request_id, &err)).await;
}

/// Writes an encoded frame; `Close` if the peer is gone or too slow.
pub async fn answer(stream: &mut TcpStream, bytes: &[u8]) -> Next {
    match frame::write_all(stream, bytes).await {
        Ok(()) => Next::Continue,
        Err(_) => Next::Close,
    }
}
