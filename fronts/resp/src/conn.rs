//! One RESP connection: its bounded read buffer, the parse / execute / reply
//! loop, its deadlines, and replies that carry values in place.
//!
//! The loop: parse every complete command in the buffer (at most
//! `max_pipeline`), execute them in order (runs of GETs as one batch),
//! write the replies, drop the bytes they used, read more. Replies go out in
//! request order, always.

use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

use crate::clients::{ClientMeta, Registered};
use crate::commands::Cmd;
use crate::proto::{reply, Limits, Parser, Progress};
use crate::{Shared, ThreadCtx};

/// A read buffer starts (and shrinks back to) this size.
const INITIAL_BUFFER: usize = 16 * 1024;
/// Idle read buffers larger than this give their memory back.
const KEEP_BUFFER: usize = 4 << 20;
/// Replies are sent once this many bytes are waiting (values included).
pub(crate) const FLUSH_AT: u64 = 1 << 20;
/// Slices handed to one `writev`.
const MAX_IOV: usize = 64;

/// Counts an open connection; gives its place back when dropped.
pub(crate) struct OpenGuard {
    shared: Arc<Shared>,
}

impl OpenGuard {
    /// For a connection already counted in `open` by the acceptor.
    pub(crate) fn new(shared: &Arc<Shared>) -> Self {
        shared.metrics.connections.inc();
        shared.metrics.connections_total.inc();
        Self {
            shared: shared.clone(),
        }
    }
}

impl Drop for OpenGuard {
    fn drop(&mut self) {
        self.shared.metrics.open.fetch_sub(1, Ordering::Relaxed);
        self.shared.metrics.connections.dec();
    }
}

/// Why a pending connection was closed for a new one.
const EVICTED: &str = "closed for a new connection at resp.max_clients: it had not run a command";

/// Why a connection ends.
#[derive(Debug)]
pub(crate) enum Close {
    /// The peer left, went idle, or the process stops: nothing to say.
    Quiet(&'static str),
    /// Say this (`ERR ...`), then close.
    Reply(String),
}

/// Memory taken from the front's budget; given back when dropped.
pub(crate) struct Held {
    shared: Arc<Shared>,
    bytes: u64,
}

impl Held {
    pub(crate) fn none(shared: &Arc<Shared>) -> Self {
        Self {
            shared: shared.clone(),
            bytes: 0,
        }
    }

    /// Takes `n` more bytes, if the budget has them.
    pub(crate) fn grow(&mut self, n: u64) -> bool {
        if n == 0 {
            return true;
        }
        if !self.shared.budget.take(n) {
            return false;
        }
        self.bytes += n;
        self.shared.metrics.buffer_bytes.inc_by(n as i64);
        true
    }

    /// Holds exactly `n` bytes: takes more (if the budget has them) or
    /// gives some back.
    pub(crate) fn set(&mut self, n: u64) -> bool {
        if n >= self.bytes {
            self.grow(n - self.bytes)
        } else {
            self.shrink(self.bytes - n);
            true
        }
    }

    /// Gives `n` bytes back.
    pub(crate) fn shrink(&mut self, n: u64) {
        let n = n.min(self.bytes);
        self.bytes -= n;
        self.shared.budget.give(n);
        self.shared.metrics.buffer_bytes.dec_by(n as i64);
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let n = self.bytes;
        self.shrink(n);
    }
}

/// The error reply when the buffer budget cannot hold what a reply needs.
pub(crate) const BUDGET_SPENT: &str =
    "ERR the RESP front's buffer memory is spent (resp.max_buffer_memory); try again";

fn budget_spent() -> Close {
    Close::Reply(BUDGET_SPENT.into())
}

/// A value in a reply that is not in the reply's byte buffer: a checked copy
/// (from a same-host segment through a [`kvpool_client::ReadView`], or read
/// from another host), its memory held from the budget until the reply is
/// sent. Never the shared memory itself: what was checked is what is sent.
pub(crate) struct Part {
    pub value: Vec<u8>,
    pub _held: Held,
}

impl Part {
    fn len(&self) -> usize {
        self.value.len()
    }
}

/// Replies waiting to be written: bytes, and values placed between them.
pub(crate) struct Out {
    pub bytes: Vec<u8>,
    /// Each part goes out after `bytes[..at]` (and the parts before it).
    parts: Vec<(usize, Part)>,
    part_bytes: u64,
}

impl Out {
    fn new() -> Self {
        Self {
            bytes: Vec::with_capacity(4096),
            parts: Vec::new(),
            part_bytes: 0,
        }
    }

    /// A bulk string reply whose bytes are `part`.
    pub(crate) fn bulk_part(&mut self, part: Part) {
        reply::bulk_header(&mut self.bytes, part.len());
        self.part_bytes += part.len() as u64;
        self.parts.push((self.bytes.len(), part));
        self.bytes.extend_from_slice(b"\r\n");
    }

    /// Reply bytes encoded elsewhere (a large array), their memory held
    /// from the budget until sent.
    pub(crate) fn raw_part(&mut self, part: Part) {
        self.part_bytes += part.len() as u64;
        self.parts.push((self.bytes.len(), part));
    }

    /// Bytes waiting, values included.
    pub(crate) fn pending(&self) -> u64 {
        self.bytes.len() as u64 + self.part_bytes
    }

    /// The `k`th piece to write: bytes between parts, or a part.
    fn piece(&self, k: usize) -> &[u8] {
        let i = k / 2;
        if k.is_multiple_of(2) {
            let from = if i == 0 { 0 } else { self.parts[i - 1].0 };
            let to = self.parts.get(i).map_or(self.bytes.len(), |p| p.0);
            return &self.bytes[from..to];
        }
        &self.parts[i].1.value
    }

    fn piece_len(&self, k: usize) -> usize {
        let i = k / 2;
        if k % 2 == 1 {
            return self.parts[i].1.len();
        }
        let from = if i == 0 { 0 } else { self.parts[i - 1].0 };
        self.parts.get(i).map_or(self.bytes.len(), |p| p.0) - from
    }

    fn pieces(&self) -> usize {
        self.parts.len() * 2 + 1
    }

    fn clear(&mut self) {
        self.bytes.clear();
        if self.bytes.capacity() > FLUSH_AT as usize * 2 {
            self.bytes.shrink_to(4096);
        }
        self.parts.clear();
        self.part_bytes = 0;
    }
}

/// A transaction's queue (`MULTI` ... `EXEC`: multi.rs): owned copies of the
/// commands (the read buffer they came in moves on), their memory held from
/// the front's budget.
pub(crate) struct Queued {
    pub(crate) cmds: Vec<(Cmd, Vec<Vec<u8>>)>,
    pub(crate) _held: Held,
    /// A command was refused while queueing: `EXEC` discards all.
    pub(crate) aborted: bool,
}

/// One client's connection.
pub(crate) struct Conn {
    pub ctx: Rc<ThreadCtx>,
    pub id: u64,
    pub authed: bool,
    /// What `CLIENT LIST` shows of it (its names included).
    pub meta: Arc<ClientMeta>,
    /// Replies in RESP3 (after `HELLO 3`), RESP2 otherwise.
    pub resp3: bool,
    /// Commands queued since `MULTI`, until `EXEC` or `DISCARD`.
    pub multi: Option<Queued>,
    pub quit: bool,
    pub out: Out,
    stream: TcpStream,
}

/// Serves one connection until it closes.
pub(crate) async fn serve(
    stream: TcpStream,
    listed: Registered,
    ctx: Rc<ThreadCtx>,
    _open: OpenGuard,
) {
    let meta = listed.meta().clone();
    let id = meta.id;
    let mut c = Conn {
        authed: ctx.shared.cfg.requirepass.is_empty(),
        ctx,
        id,
        meta,
        resp3: false,
        multi: None,
        quit: false,
        out: Out::new(),
        stream,
    };
    match c.run().await {
        Ok(()) => {}
        Err(Close::Quiet(why)) => tracing::debug!(conn = id, "RESP connection closed: {why}"),
        Err(Close::Reply(msg)) => {
            c.ctx.shared.metrics.protocol_errors.inc();
            tracing::debug!(conn = id, "RESP connection closed: {msg}");
            // After the replies of the commands that came before it.
            reply::error(&mut c.out.bytes, &msg);
            // Best effort, briefly: the connection is going anyway.
            let _ = tokio::time::timeout(Duration::from_secs(1), c.flush()).await;
        }
    }
}

impl Conn {
    fn io_timeout(&self) -> Duration {
        Duration::from_millis(self.ctx.shared.cfg.io_timeout_ms)
    }

    /// An authenticated connection is no longer pending (see
    /// [`crate::clients`]); `Err` if it was closed for a newcomer meanwhile.
    fn prove(&self) -> Result<(), Close> {
        if self.authed && !self.meta.proven() && !self.ctx.shared.clients.prove(&self.meta) {
            return Err(Close::Quiet(EVICTED));
        }
        Ok(())
    }

    async fn run(&mut self) -> Result<(), Close> {
        let shared = self.ctx.shared.clone();
        let cfg = &shared.cfg;
        let max_query = cfg.max_query_buffer.get() as usize;
        let full = Limits::full(cfg.proto_max_bulk_len.get() as usize);
        // Until AUTH, Redis's small limits, and one command parsed at a
        // time (so that a pipelined AUTH lifts them for what follows).
        let mut authed = self.authed;
        let mut parser = Parser::new(if authed {
            full
        } else {
            Limits::unauthenticated()
        });
        let mut held = Held::none(&shared);
        if !held.grow(INITIAL_BUFFER as u64) {
            return Err(budget_spent());
        }
        let mut buf: Vec<u8> = Vec::with_capacity(INITIAL_BUFFER);
        // The parser's tables, charged as they grow and shrink.
        let mut tables = Held::none(&shared);
        // When the command now arriving began (its deadline runs from there).
        let mut started: Option<Instant> = None;
        loop {
            if self.authed != authed {
                authed = self.authed;
                parser.set_limits(full);
            }
            let max = if authed { cfg.max_pipeline } else { 1 };
            let progress = parser.parse(&buf, max);
            if !tables.set(parser.heap_bytes() as u64) {
                return Err(budget_spent());
            }
            match progress {
                Progress::Ready => {
                    // No longer pending once it runs a command with the
                    // right to (before its reply goes out: a client that
                    // has its answer is never closed for a newcomer).
                    self.prove()?;
                    self.execute(&parser, &buf).await?;
                    self.prove()?;
                    self.flush().await?;
                    let done = parser.consume();
                    buf.drain(..done);
                    if !tables.set(parser.heap_bytes() as u64) {
                        return Err(budget_spent());
                    }
                    started = parser.in_command().then(Instant::now);
                    if self.quit {
                        return Ok(());
                    }
                    continue;
                }
                Progress::Error(e) => {
                    if parser.ready() > 0 {
                        self.execute(&parser, &buf).await?;
                    }
                    return Err(Close::Reply(format!("ERR {}", e.0)));
                }
                Progress::Need(need) => {
                    // Empty requests (`*0`, `*-1`, blank lines) parsed
                    // before the partial command: their bytes go now, not
                    // with the next command (which may never come), and the
                    // idle timeout applies again if nothing else arrived.
                    let done = parser.consume();
                    let need = need - done;
                    if done > 0 {
                        buf.drain(..done);
                        if !parser.in_command() {
                            started = None;
                        }
                    }
                    if need > max_query {
                        return Err(Close::Reply(format!(
                            "ERR a request of more than {max_query} bytes is over the query \
                             buffer limit (resp.max_query_buffer)"
                        )));
                    }
                    if buf.is_empty() {
                        shrink_idle(&mut buf, &mut held, &shared);
                    }
                    if buf.len() == buf.capacity() {
                        // Grow with what arrives, never to an announced
                        // length at once: doubling, or to what a pending
                        // bulk needs when that is less (but by half at
                        // least). Never by what the next element needs
                        // alone: with no length pending that is one byte,
                        // and a large pipeline or inline line would be read
                        // (and rescanned) a byte at a time.
                        let cap = buf.capacity();
                        let doubled = (cap * 2).max(INITIAL_BUFFER);
                        let want = if parser.bulk_pending() {
                            doubled.min(need.max(cap + cap / 2))
                        } else {
                            doubled
                        };
                        let want = want.max(buf.len() + 1).min(max_query);
                        let more = want - buf.capacity();
                        shared.metrics.buffer_grows.inc();
                        if !held.grow(more as u64) {
                            return Err(budget_spent());
                        }
                        buf.reserve_exact(more);
                        // `reserve_exact` may give more than asked: hold it all.
                        let extra = buf.capacity() - want;
                        if !held.grow(extra as u64) {
                            return Err(budget_spent());
                        }
                    }
                }
            }
            let n = self.read_some(&mut buf, started).await?;
            if n == 0 {
                return Err(Close::Quiet("the client closed the connection"));
            }
            if started.is_none() {
                started = Some(Instant::now());
            }
        }
    }

    /// Reads what has arrived into `buf`'s spare room, within the command's
    /// deadline (or the idle timeout between commands).
    async fn read_some(
        &mut self,
        buf: &mut Vec<u8>,
        started: Option<Instant>,
    ) -> Result<usize, Close> {
        debug_assert!(buf.capacity() > buf.len());
        let shutdown = self.ctx.shutdown.clone();
        let deadline = match started {
            Some(t) => Some((
                t + self.io_timeout(),
                "a command did not arrive in full within resp.io_timeout_ms",
            )),
            // A client that has not run a command (authenticated, where a
            // password is set) gets io_timeout_ms, not the (long) idle
            // timeout, to send its next one.
            None if !self.authed || !self.meta.proven() => Some((
                Instant::now() + self.io_timeout(),
                "no command run (authenticated) within resp.io_timeout_ms",
            )),
            None if self.ctx.shared.cfg.idle_timeout_ms > 0 => Some((
                Instant::now() + Duration::from_millis(self.ctx.shared.cfg.idle_timeout_ms),
                "idle past resp.idle_timeout_ms",
            )),
            None => None,
        };
        let read = self.stream.read_buf(buf);
        let r = tokio::select! {
            r = read => r,
            _ = shutdown.wait() => return Err(Close::Quiet("the process is stopping")),
            _ = self.meta.evicted() => return Err(Close::Quiet(EVICTED)),
            _ = sleep_until(deadline.map(|d| d.0)) => {
                return Err(Close::Quiet(deadline.map_or("deadline", |d| d.1)))
            }
        };
        r.map_err(|_| Close::Quiet("read error"))
    }

    /// Writes every waiting reply; each write must make progress within
    /// `io_timeout_ms`.
    pub(crate) async fn flush(&mut self) -> Result<(), Close> {
        let io_timeout = self.io_timeout();
        let total = self.out.pieces();
        // (piece, offset in it)
        let mut at = (0usize, 0usize);
        while at.0 < total {
            match tokio::time::timeout(io_timeout, self.stream.writable()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => return Err(Close::Quiet("write error")),
                Err(_) => {
                    return Err(Close::Quiet(
                        "the client took no reply bytes within resp.io_timeout_ms",
                    ))
                }
            }
            let written = {
                let mut slices: Vec<std::io::IoSlice<'_>> = Vec::with_capacity(MAX_IOV);
                let mut k = at.0;
                while k < total && slices.len() < MAX_IOV {
                    let p = self.out.piece(k);
                    let p = if k == at.0 { &p[at.1..] } else { p };
                    if !p.is_empty() {
                        slices.push(std::io::IoSlice::new(p));
                    }
                    k += 1;
                }
                if slices.is_empty() {
                    0
                } else {
                    match self.stream.try_write_vectored(&slices) {
                        Ok(0) => return Err(Close::Quiet("the client stopped reading")),
                        Ok(n) => n,
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                        Err(_) => return Err(Close::Quiet("write error")),
                    }
                }
            };
            // Advance past what was written, then past empty pieces.
            let mut left = written;
            while left > 0 {
                let len = self.out.piece_len(at.0) - at.1;
                if left < len {
                    at.1 += left;
                    left = 0;
                } else {
                    left -= len;
                    at = (at.0 + 1, 0);
                }
            }
            while at.0 < total && self.out.piece_len(at.0) == at.1 {
                at = (at.0 + 1, 0);
            }
        }
        self.out.clear();
        Ok(())
    }
}

async fn sleep_until(t: Option<Instant>) {
    match t {
        Some(t) => tokio::time::sleep_until(tokio::time::Instant::from_std(t)).await,
        None => std::future::pending().await,
    }
}

/// An empty read buffer that grew past what an idle connection keeps (or
/// any grown one, when the budget runs short) goes back to its first size.
fn shrink_idle(buf: &mut Vec<u8>, held: &mut Held, shared: &Shared) {
    let cap = buf.capacity();
    if cap > KEEP_BUFFER || (cap > INITIAL_BUFFER && shared.budget.pressed()) {
        *buf = Vec::with_capacity(INITIAL_BUFFER);
        held.shrink((cap - buf.capacity()) as u64);
    }
}
