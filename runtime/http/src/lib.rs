//! Serving an axum router on a TCP listener with the limits `axum::serve`
//! lacks. `axum::serve` gives hyper no timer, so hyper's header read
//! timeout is silently off; nothing bounds how long a request body may take
//! to arrive, or how many connections are open. A client that sends a
//! request head a byte a minute, or a body that never ends, or simply opens
//! sockets, would hold a task and a file descriptor each, for ever. Every
//! HTTP listener of kvpool (the node's, the engine's, the serving proxies'
//! and the conductor's) is served through [`serve`].
//!
//! At the connection cap, a new connection takes the place of the oldest
//! idle one (no request in flight, no answer being sent): 1,100 idle sockets
//! used to lock `/healthz`, the admin routes and the serving front out for
//! the 30 s of the header deadline, again and again (issue 29). A connection
//! serving a request is never closed for a newcomer.

pub mod openai;

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::{pin, Pin};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Bytes;
use axum::Router;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::Request;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{watch, Notify, Semaphore};

pub use kvpool_runtime::http_limits::{
    HttpLimits, BODY_READ_TIMEOUT, HEADER_READ_TIMEOUT, MAX_CONNECTIONS,
};

/// Serves `app` on `listener` (HTTP/1.1) until `shutdown` resolves; then
/// stops accepting, lets each connection finish the request it is serving,
/// and returns once they have closed.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: HttpLimits,
    shutdown: impl Future<Output = ()>,
) {
    let open = Arc::new(Semaphore::new(limits.max_connections));
    let conns = Arc::new(Conns::default());
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut shutdown = pin!(shutdown);
    let mut next_id = 0u64;
    loop {
        let stream = tokio::select! {
            r = listener.accept() => match r {
                Ok((s, _)) => s,
                Err(e) => {
                    // Out of descriptors, or a connection reset before it
                    // was taken: wait a little rather than spin.
                    tracing::warn!("HTTP accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let permit = match open.clone().try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                // At the cap: the oldest idle connection gives its place
                // (with none idle, wait for one to close).
                conns.evict_oldest_idle();
                tokio::select! {
                    p = open.clone().acquire_owned() => match p {
                        Ok(p) => p,
                        Err(_) => break,
                    },
                    _ = &mut shutdown => break,
                }
            }
        };
        let _ = stream.set_nodelay(true);
        next_id += 1;
        let slot = Arc::new(Slot::default());
        let listed = conns.add(next_id, slot.clone());
        let router = TowerToHyperService::new(app.clone());
        let body_timeout = limits.body_read_timeout;
        let busy_slot = slot.clone();
        let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
            use hyper::service::Service;
            let busy = Busy::new(busy_slot.clone());
            let answer = router.call(req.map(|b| BodyDeadline::new(b, body_timeout)));
            async move {
                let res = answer.await?;
                // Busy until the answer's last byte is taken (or dropped).
                Ok::<_, std::convert::Infallible>(res.map(|inner| Tracked { inner, _busy: busy }))
            }
        });
        let mut stop = stop_rx.clone();
        let header_timeout = limits.header_read_timeout;
        tokio::spawn(async move {
            let mut b = hyper::server::conn::http1::Builder::new();
            b.timer(TokioTimer::new())
                .header_read_timeout(header_timeout);
            let mut conn = pin!(b.serve_connection(TokioIo::new(stream), svc));
            tokio::select! {
                r = conn.as_mut() => {
                    if let Err(e) = r {
                        tracing::debug!("HTTP connection ended: {e}");
                    }
                }
                _ = stop.changed() => {
                    conn.as_mut().graceful_shutdown();
                    let _ = conn.await;
                }
                // Idle, and closed for a newcomer at the cap.
                _ = slot.evicted() => {}
            }
            drop(listed);
            drop(permit);
        });
    }
    let _ = stop_tx.send(true);
    // Every connection gives its place back when it closes.
    let _ = open.acquire_many(limits.max_connections as u32).await;
}

/// One open connection: whether it serves a request, and whether it was
/// closed for a newcomer.
#[derive(Default)]
struct Slot {
    /// Requests whose answer is not sent in full yet.
    busy: AtomicUsize,
    evicted: AtomicBool,
    wake: Notify,
}

impl Slot {
    async fn evicted(&self) {
        while !self.evicted.load(Ordering::Acquire) {
            self.wake.notified().await;
        }
    }
}

/// The open connections of a listener, oldest first.
#[derive(Default)]
struct Conns {
    open: Mutex<BTreeMap<u64, Arc<Slot>>>,
}

impl Conns {
    fn map(&self) -> MutexGuard<'_, BTreeMap<u64, Arc<Slot>>> {
        // A panic ends the process (the binary's panic hook): a poisoned
        // lock is never seen; take the data either way.
        self.open.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn add(self: &Arc<Self>, id: u64, slot: Arc<Slot>) -> Listed {
        self.map().insert(id, slot);
        Listed {
            conns: self.clone(),
            id,
        }
    }

    /// Closes the oldest connection with no request in flight, if any. A
    /// request that arrives on it at this very moment is cut with it, as on
    /// any keep-alive connection the server closes.
    fn evict_oldest_idle(&self) {
        let map = self.map();
        let idle = map.values().find(|s| {
            s.busy.load(Ordering::Acquire) == 0 && !s.evicted.swap(true, Ordering::AcqRel)
        });
        if let Some(s) = idle {
            s.wake.notify_one();
        }
    }
}

/// Takes a connection off the list when it closes.
struct Listed {
    conns: Arc<Conns>,
    id: u64,
}

impl Drop for Listed {
    fn drop(&mut self) {
        self.conns.map().remove(&self.id);
    }
}

/// A request in flight on a connection.
struct Busy(Arc<Slot>);

impl Busy {
    fn new(slot: Arc<Slot>) -> Self {
        slot.busy.fetch_add(1, Ordering::AcqRel);
        Self(slot)
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.busy.fetch_sub(1, Ordering::AcqRel);
    }
}

/// An answer's body, its connection busy until it is sent or dropped.
struct Tracked<B> {
    inner: B,
    _busy: Busy,
}

impl<B: Body + Unpin> Body for Tracked<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A request body that must arrive in full by a deadline; past it, an
/// error (the handler answers 400, and the connection closes).
struct BodyDeadline {
    inner: Incoming,
    limit: Duration,
    deadline: Pin<Box<tokio::time::Sleep>>,
}

impl BodyDeadline {
    fn new(inner: Incoming, limit: Duration) -> Self {
        Self {
            inner,
            limit,
            deadline: Box::pin(tokio::time::sleep(limit)),
        }
    }
}

impl Body for BodyDeadline {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if let Poll::Ready(f) = Pin::new(&mut self.inner).poll_frame(cx) {
            return Poll::Ready(f.map(|r| r.map_err(Into::into)));
        }
        if self.deadline.as_mut().poll(cx).is_ready() {
            let msg = format!(
                "the request body did not arrive within {} s",
                self.limit.as_secs()
            );
            return Poll::Ready(Some(Err(msg.into())));
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
