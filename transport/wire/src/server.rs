//! The shard-side TCP server loop shared by the master and storage nodes.
//!
//! Each shard accepts on its own port and runs one local task per connection.
//! A connection handles one request at a time:
//!
//! ```text
//!  wait for a header's first byte   idle_timeout (first_frame_timeout until the
//!                                   connection has sent a whole frame, and, with a
//!                                   cluster secret, until it has authenticated)
//!  rest of header + payload         one deadline for the whole frame (io_timeout);
//!                                   the buffer grows as bytes arrive, from the
//!                                   process's frame budget
//!  handler                          under a drain guard; handlers bound their own
//!                                   payload transfers and answers
//! ```
//!
//! A frame that cannot be parsed gets an error frame and the connection is
//! closed; the shard goes on serving everyone else. A connection past the
//! shard's cap gets a `ResourceExhausted` error frame (request id 0) and is
//! closed.

use std::cell::Cell;
use std::future::Future;
use std::os::fd::{FromRawFd, IntoRawFd};
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::auth::NONCE_BYTES;
use crate::frame::AlignedVec;
use crate::frame::{self, FrameBudget, FrameError, FrameHeader, FrameKind, HEADER_LEN};
use crate::proto::ClientId;
use crate::{ErrorCode, KvError};
use futures_lite::AsyncReadExt;
use glommio::net::{TcpListener, TcpStream};
use kvpool_runtime::ShardCtx;

/// Bounds of one shard's server.
#[derive(Debug, Clone)]
pub struct ServerLimits {
    pub max_connections: usize,
    pub idle_timeout: Duration,
    /// Deadline of one whole frame once its first byte has arrived, and of
    /// one request's payload transfer and answer.
    pub io_timeout: Duration,
    /// Deadline of a new connection's first complete frame (and, when
    /// `require_auth`, of its authentication).
    pub first_frame_timeout: Duration,
    pub max_frame_bytes: u32,
    /// Memory for frames being read, shared by every connection of the
    /// process.
    pub frame_budget: Arc<FrameBudget>,
    /// Connections must authenticate (a cluster secret is configured).
    pub require_auth: bool,
}

/// What a handler tells the loop after one request.
pub enum Next {
    /// Wait for the next request on this connection.
    Continue,
    /// Close the connection (the handler already answered if it could).
    Close,
}

/// What one connection has established so far.
#[derive(Debug, Default)]
pub struct ConnState {
    /// Frames handled on this connection.
    pub frames: u64,
    /// The connection proved it holds the cluster secret.
    pub authenticated: bool,
    /// The client id the connection authenticated as: requests that name
    /// another are refused.
    pub client_id: Option<ClientId>,
    /// A handshake under way: (client id, client nonce, server nonce).
    pub challenge: Option<(ClientId, [u8; NONCE_BYTES], [u8; NONCE_BYTES])>,
}

/// Turns a std listener (bound on the main thread) into the shard's listener.
pub fn into_glommio(listener: std::net::TcpListener) -> TcpListener {
    // SAFETY: the fd comes from `into_raw_fd`, so this is its only owner; it is
    // a bound, listening TCP socket, which is what glommio's listener expects.
    unsafe { TcpListener::from_raw_fd(listener.into_raw_fd()) }
}

/// Serves one request whose control frame (`hdr`, `payload`) has been read;
/// reads whatever payload bytes follow it from `stream`, acts, answers.
/// Runs on the shard's thread.
pub trait Handler: 'static {
    fn handle(
        &self,
        hdr: FrameHeader,
        payload: AlignedVec,
        stream: &mut TcpStream,
        conn: &mut ConnState,
    ) -> impl Future<Output = Next>;
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
        let limits2 = limits.clone();
        glommio::spawn_local(async move {
            connection(ctx2, stream, &limits2, role, &*handler).await;
            active2.set(active2.get() - 1);
        })
        .detach();
    }
}

/// Why no frame came.
enum NoFrame {
    /// The peer closed, went silent past its deadline, or shutdown came.
    Gone,
    /// A bad frame: answer with its error, then close.
    Bad(FrameError),
}

/// Reads one control frame: the first byte under `wait`, the rest under one
/// deadline of `limits.io_timeout`.
async fn read_frame(
    ctx: &ShardCtx,
    stream: &mut TcpStream,
    limits: &ServerLimits,
    wait: Duration,
) -> Result<(FrameHeader, AlignedVec, frame::Reservation), NoFrame> {
    let mut head = [0u8; HEADER_LEN];
    let _ = stream.set_read_timeout(Some(wait));
    let first =
        futures_lite::future::or(async { Some(stream.read(&mut head[..1]).await) }, async {
            ctx.shutdown().wait().await;
            None
        })
        .await;
    match first {
        Some(Ok(1)) => {}
        // Closed, timed out, reset, or shutdown.
        _ => return Err(NoFrame::Gone),
    }
    let _ = stream.set_read_timeout(Some(limits.io_timeout));
    let rest = glommio::timer::timeout(limits.io_timeout, async {
        let r: Result<_, FrameError> = async {
            stream
                .read_exact(&mut head[1..])
                .await
                .map_err(FrameError::Io)?;
            let hdr = FrameHeader::decode(&head, limits.max_frame_bytes)?;
            let (payload, held) =
                frame::read_payload_budgeted(stream, &hdr, &limits.frame_budget).await?;
            Ok((hdr, payload, held))
        }
        .await;
        Ok(r)
    })
    .await;
    match rest {
        Ok(Ok(f)) => Ok(f),
        Ok(Err(e)) if e.is_disconnect() => Err(NoFrame::Gone),
        Ok(Err(e)) => Err(NoFrame::Bad(e)),
        Err(_) => Err(NoFrame::Bad(FrameError::Io(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("the frame did not arrive within {:?}", limits.io_timeout),
        )))),
    }
}

async fn connection<H: Handler>(
    ctx: ShardCtx,
    mut stream: TcpStream,
    limits: &ServerLimits,
    role: &'static str,
    handler: &H,
) {
    let mut conn = ConnState::default();
    let opened = Instant::now();
    loop {
        let probation = conn.frames == 0 || (limits.require_auth && !conn.authenticated);
        let wait = if probation {
            // The first frame (and authentication) must come soon after the
            // connection opened, not merely before the idle timeout.
            limits
                .first_frame_timeout
                .saturating_sub(opened.elapsed())
                .max(Duration::from_millis(1))
        } else {
            limits.idle_timeout
        };
        let (hdr, payload, _held) = match read_frame(&ctx, &mut stream, limits, wait).await {
            Ok(f) => f,
            Err(NoFrame::Gone) => break,
            Err(NoFrame::Bad(e)) => {
                reject(&mut stream, 0, &e, role).await;
                break;
            }
        };
        let _guard = ctx.drain_guard();
        let _ = stream.set_write_timeout(Some(limits.io_timeout));
        let next = handler.handle(hdr, payload, &mut stream, &mut conn).await;
        conn.frames += 1;
        match next {
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

/// Opens a request frame: checks its kind and decodes its payload. A frame
/// of another kind or a payload that fails validation gets an error frame
/// and `None` (the handler then closes the connection).
pub async fn open_request<T: frame::Payload>(
    stream: &mut TcpStream,
    hdr: &FrameHeader,
    payload: &frame::AlignedVec,
    kind: FrameKind,
    role: &str,
) -> Option<T> {
    if hdr.kind != kind {
        let e = frame::FrameError::UnexpectedKind {
            expected: kind,
            got: hdr.kind,
        };
        reject(stream, hdr.request_id, &e, role).await;
        return None;
    }
    match frame::decode(payload) {
        Ok(r) => Some(r),
        Err(e) => {
            reject(stream, hdr.request_id, &e, role).await;
            None
        }
    }
}

/// Writes an encoded frame; `Close` if the peer is gone or too slow.
pub async fn answer(stream: &mut TcpStream, bytes: &[u8]) -> Next {
    match frame::write_all(stream, bytes).await {
        Ok(()) => Next::Continue,
        Err(_) => Next::Close,
    }
}

/// Writes `bytes` within `within` as a whole (a peer that reads a byte now
/// and then cannot hold the connection past it); `Close` otherwise.
pub async fn answer_within(stream: &mut TcpStream, bytes: &[u8], within: Duration) -> Next {
    match glommio::timer::timeout(within, async { Ok(frame::write_all(stream, bytes).await) }).await
    {
        Ok(Ok(())) => Next::Continue,
        _ => Next::Close,
    }
}

/// Logs refusals of unauthenticated requests at most once a second per
/// shard (an attacker must not flood the log), with how many were refused.
#[derive(Default)]
pub struct RefusalLog {
    last: Cell<Option<Instant>>,
    since: Cell<u64>,
}

impl RefusalLog {
    pub fn refused(&self, role: &str, what: &str, why: &KvError) {
        self.since.set(self.since.get() + 1);
        let now = Instant::now();
        if self
            .last
            .get()
            .is_some_and(|t| now.duration_since(t) < Duration::from_secs(1))
        {
            return;
        }
        tracing::warn!(
            role,
            refused = self.since.get(),
            "refused {what}: {}",
            why.message
        );
        self.since.set(0);
        self.last.set(Some(now));
    }
}
