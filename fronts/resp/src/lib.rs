//! kvpool's Redis protocol (RESP2) front: redis-cli, redis-py, LMCache's
//! `redis://` connector and every other Redis client read and write the
//! pool through it, unchanged.
//!
//! ```text
//!   Redis clients ----> one listening port
//!                            | accepted on RESP thread 0, handed out round robin
//!        +-------------------+--------------------+
//!        v                                        v
//!   RESP thread 0 (core 0)               RESP thread n-1 (core n-1)
//!   tokio current-thread runtime         tokio current-thread runtime
//!    connections 0, n, 2n, ...            connections n-1, 2n-1, ...
//!    its own pool Client ------+          its own pool Client ------+
//!        | master RPC (TCP)    | values      | master RPC (TCP)     | values
//!        v                     v             v                      v
//!   master shards        storage node's memory (shm, in place) or TCP/RDMA
//! ```
//!
//! A connection lives on one thread from accept to close, and each request
//! runs there start to end: parse, ask the master, read the value in place
//! from a same-host storage node's memory, reply. The pool client runs on
//! tokio (it is what embedders use), so each RESP thread is a tokio runtime
//! of its own with its own [`Client`]: its sockets are driven by the thread
//! that uses them, and no request waits for a wake-up from another thread.
//! Why this and not connections on the glommio shards: docs/architecture/resp.md.
//!
//! Values: a `GET` of a value on this host is answered through a
//! [`kvpool_client::ReadView`]: its bytes are copied out of the node's shared
//! memory and the copy is checked against the object's checksum, then the
//! copy is sent (never the shared memory, which a writer could change after
//! the check); values on other hosts are read by the client, which checks
//! what it receives. A `SET` replaces the value atomically.

mod cache;
mod checks;
mod clients;
mod collections;
mod commands;
mod conn;
mod exec;
mod info;
mod keyspace;
mod locks;
mod metrics;
mod multi;
pub mod proto;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpool_client::Client;
use kvpool_config::{ClientConfig, RespConfig};
use kvpool_runtime::metrics::MetricsRegistry;
use kvpool_runtime::Shutdown;
use tokio::sync::mpsc;

pub use commands::{Cmd, SPECS};

/// Why the front could not start.
#[derive(Debug, thiserror::Error)]
pub enum RespError {
    #[error("config: {0}")]
    Config(String),
    #[error("resp listener: {0}")]
    Bind(String),
    #[error("resp thread {thread}: {why}")]
    Thread { thread: usize, why: String },
}

/// What [`start`] needs.
pub struct RespOptions {
    pub cfg: RespConfig,
    /// Address to listen on.
    pub listen: String,
    /// The master's RPC address.
    pub master: String,
    /// Settings of the threads' pool clients (the cluster secret included).
    pub client: ClientConfig,
    /// RESP threads (at least 1).
    pub threads: usize,
    pub metrics: MetricsRegistry,
    pub shutdown: Shutdown,
}

/// What every RESP thread shares.
pub(crate) struct Shared {
    pub cfg: RespConfig,
    pub metrics: metrics::Metrics,
    pub budget: metrics::Budget,
    pub next_id: AtomicU64,
    pub started: Instant,
    pub threads: usize,
    /// The port listened on (for `INFO`).
    pub port: u16,
    /// Views of recent reads, for repeated GETs.
    pub views: cache::ViewCache,
    /// Open connections, for `CLIENT LIST`.
    pub clients: Arc<clients::Clients>,
    /// Lists, sets, hashes and sorted sets (held here, not in the pool).
    pub collections: collections::Collections,
    /// `INCR` and its kin read, add and write a key one at a time across
    /// the RESP threads: a key's stripe is held for the three steps. A SET
    /// holds its key's stripe for its write, an MSET (or a pipeline's run
    /// of SETs) its keys' stripes (another thread's write of a key waits
    /// here, not at the master). Always before this thread's hold on a key.
    pub counters: KeyStripes,
}

/// Locks of keys across the RESP threads, by stripe. The stripe of a key is
/// chosen by a hasher seeded at random per process: keys chosen to share a
/// victim key's stripe (and hold up its SETs) cannot be aimed at it.
pub struct KeyStripes {
    locks: Box<[tokio::sync::Mutex<()>]>,
    hasher: std::hash::RandomState,
}

impl KeyStripes {
    fn new(n: usize) -> Self {
        Self {
            locks: (0..n).map(|_| tokio::sync::Mutex::new(())).collect(),
            hasher: std::hash::RandomState::new(),
        }
    }

    /// The lock of `key`'s stripe.
    pub fn of(&self, key: &[u8]) -> &tokio::sync::Mutex<()> {
        &self.locks[self.index(key)]
    }

    fn index(&self, key: &[u8]) -> usize {
        use std::hash::BuildHasher;
        (self.hasher.hash_one(key) % self.locks.len() as u64) as usize
    }

    /// The locks of the stripes of `keys`, each once, taken in the stripes'
    /// order (two writers of several keys never wait for each other in a
    /// circle; a writer of one key holds one stripe); `None` when they are
    /// not all held by `deadline`.
    pub async fn lock_all(
        &self,
        keys: &[&[u8]],
        deadline: tokio::time::Instant,
    ) -> Option<Vec<tokio::sync::MutexGuard<'_, ()>>> {
        let mut at: Vec<usize> = keys.iter().map(|k| self.index(k)).collect();
        at.sort_unstable();
        at.dedup();
        let mut held = Vec::with_capacity(at.len());
        for i in at {
            let lock = self.locks[i].lock();
            held.push(tokio::time::timeout_at(deadline, lock).await.ok()?);
        }
        Some(held)
    }
}

/// Stripes of [`Shared::counters`]: enough that SETs of distinct keys from
/// many connections seldom share one (a SET holds its stripe for a write).
const COUNTER_STRIPES: usize = 16_384;

/// One RESP thread's view: the shared parts and its own pool client.
pub(crate) struct ThreadCtx {
    pub shared: Arc<Shared>,
    pub client: Client,
    /// The client's deadline for one call.
    pub client_timeout_ms: u64,
    /// Keys this thread's connections are writing.
    pub keys: locks::KeyLocks,
    pub shutdown: Shutdown,
}

/// The running front.
pub struct RespServer {
    addr: SocketAddr,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl RespServer {
    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Waits (at most `within`) for the threads to end after shutdown.
    pub fn join(self, within: Duration) {
        let end = Instant::now() + within;
        for t in self.threads {
            while !t.is_finished() && Instant::now() < end {
                std::thread::sleep(Duration::from_millis(10));
            }
            if t.is_finished() {
                let _ = t.join();
            } else {
                tracing::warn!("a RESP thread did not stop within {within:?}");
            }
        }
    }
}

/// Depth of each thread's queue of accepted connections.
const HANDOFF_DEPTH: usize = 256;

/// Binds the listener, starts the threads (each connects its pool client
/// to the master) and returns once all of them serve.
pub async fn start(opts: RespOptions) -> Result<RespServer, RespError> {
    let cfg = opts.cfg;
    cfg.validate().map_err(RespError::Config)?;
    cfg.check_exposure(&opts.listen, !opts.client.secret.is_empty())
        .map_err(RespError::Config)?;
    let n = opts.threads.max(1);
    let (addr, mut listeners) = kvpool_runtime::net::bind_sharded(&opts.listen, 1)
        .map_err(|e| RespError::Bind(format!("{}: {e}", opts.listen)))?;
    let listener = listeners.remove(0);
    listener
        .set_nonblocking(true)
        .map_err(|e| RespError::Bind(e.to_string()))?;
    let shared = Arc::new(Shared {
        metrics: metrics::Metrics::new(&opts.metrics),
        budget: metrics::Budget::new(cfg.max_buffer_memory.get()),
        next_id: AtomicU64::new(1),
        started: Instant::now(),
        threads: n,
        port: addr.port(),
        views: cache::ViewCache::new(cfg.view_cache_entries),
        clients: Arc::default(),
        collections: collections::Collections::new(cfg.max_collection_memory.get()),
        counters: KeyStripes::new(COUNTER_STRIPES),
        cfg,
    });
    let mut client_cfg = opts.client;
    // Every GET asks the master: a location remembered by one thread's
    // client would serve a value another thread's SET has replaced.
    client_cfg.location_cache_entries = 0;
    let cores: Vec<core_affinity::CoreId> = if shared.cfg.pin_threads {
        core_affinity::get_core_ids().unwrap_or_default()
    } else {
        Vec::new()
    };
    let mut senders = Vec::with_capacity(n);
    let mut inboxes = Vec::with_capacity(n);
    for _ in 0..n {
        let (tx, rx) = mpsc::channel::<Accepted>(HANDOFF_DEPTH);
        senders.push(tx);
        inboxes.push(rx);
    }
    let mut listener = Some(listener);
    let mut threads = Vec::with_capacity(n);
    let mut ready = Vec::with_capacity(n);
    for (i, inbox) in inboxes.into_iter().enumerate() {
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel::<Result<(), String>>();
        ready.push(ready_rx);
        let core = (!cores.is_empty()).then(|| cores[i % cores.len()]);
        let shared = shared.clone();
        let master = opts.master.clone();
        let client_cfg = client_cfg.clone();
        let shutdown = opts.shutdown.clone();
        let accept = if i == 0 {
            Some((listener.take().expect("one listener"), senders.clone()))
        } else {
            None
        };
        let t = std::thread::Builder::new()
            .name(format!("kvpool-resp-{i}"))
            .spawn(move || {
                if let Some(c) = core {
                    core_affinity::set_for_current(c);
                }
                thread_main(
                    i, shared, master, client_cfg, shutdown, accept, inbox, ready_tx,
                )
            })
            .map_err(|e| RespError::Thread {
                thread: i,
                why: e.to_string(),
            })?;
        threads.push(t);
    }
    drop(senders);
    for (i, r) in ready.into_iter().enumerate() {
        match r.await {
            Ok(Ok(())) => {}
            Ok(Err(why)) => {
                opts.shutdown.trigger();
                return Err(RespError::Thread { thread: i, why });
            }
            Err(_) => {
                opts.shutdown.trigger();
                return Err(RespError::Thread {
                    thread: i,
                    why: "ended before it was ready".into(),
                });
            }
        }
    }
    tracing::info!(%addr, threads = n, "RESP front serving");
    Ok(RespServer { addr, threads })
}

/// How long a RESP thread keeps trying to reach the master at start (a
/// gateway may start before its master).
const CONNECT_DEADLINE: Duration = Duration::from_secs(30);

async fn connect(master: &str, cfg: ClientConfig) -> Result<Client, kvpool_wire::KvError> {
    use kvpool_wire::ErrorCode;
    let deadline = Instant::now() + CONNECT_DEADLINE;
    loop {
        match Client::connect(master, cfg.clone()).await {
            Ok(c) => return Ok(c),
            Err(e)
                if Instant::now() < deadline
                    && matches!(e.code, ErrorCode::Unavailable | ErrorCode::Timeout) =>
            {
                tracing::warn!("master {master} not reachable yet, retrying: {e}");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => return Err(e),
        }
    }
}

type Accept = (std::net::TcpListener, Vec<mpsc::Sender<Accepted>>);

#[allow(clippy::too_many_arguments)]
fn thread_main(
    i: usize,
    shared: Arc<Shared>,
    master: String,
    client_cfg: ClientConfig,
    shutdown: Shutdown,
    accept: Option<Accept>,
    mut inbox: mpsc::Receiver<Accepted>,
    ready: tokio::sync::oneshot::Sender<Result<(), String>>,
) {
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            let _ = ready.send(Err(format!("cannot start its runtime: {e}")));
            return;
        }
    };
    let local = tokio::task::LocalSet::new();
    local.block_on(&rt, async move {
        let client_timeout_ms = client_cfg.timeout_ms;
        let client = match connect(&master, client_cfg).await {
            Ok(c) => c,
            Err(e) => {
                let _ = ready.send(Err(format!("cannot reach the master at {master}: {e}")));
                return;
            }
        };
        let ctx = std::rc::Rc::new(ThreadCtx {
            shared,
            client,
            client_timeout_ms,
            keys: locks::KeyLocks::default(),
            shutdown: shutdown.clone(),
        });
        if let Some((listener, senders)) = accept {
            let ctx = ctx.clone();
            match tokio::net::TcpListener::from_std(listener) {
                Ok(l) => {
                    tokio::task::spawn_local(accept_loop(l, senders, ctx));
                }
                Err(e) => {
                    let _ = ready.send(Err(format!("cannot use the listener: {e}")));
                    return;
                }
            }
        }
        let _ = ready.send(Ok(()));
        loop {
            tokio::select! {
                s = inbox.recv() => match s {
                    Some(s) => spawn_conn(s, &ctx),
                    None => break,
                },
                _ = shutdown.wait() => break,
            }
        }
        tracing::debug!(thread = i, "RESP thread stopping");
    });
}

/// A connection let in, on its way to its thread.
struct Accepted {
    stream: std::net::TcpStream,
    listed: clients::Registered,
}

fn spawn_conn(a: Accepted, ctx: &std::rc::Rc<ThreadCtx>) {
    let ctx = ctx.clone();
    tokio::task::spawn_local(async move {
        let guard = conn::OpenGuard::new(&ctx.shared);
        match tokio::net::TcpStream::from_std(a.stream) {
            Ok(s) => conn::serve(s, a.listed, ctx.clone(), guard).await,
            Err(e) => tracing::debug!("an accepted RESP connection could not be used: {e}"),
        }
    });
}

/// Accepts on thread 0 and hands connections out round robin. Who gets in
/// ([`clients::Clients::admit`]): at most `max_pending_per_peer` connections
/// of one address that have not run a command; at `max_clients` the oldest
/// of those is closed for the new one, and with none a connection gets
/// Redis's error and is closed.
async fn accept_loop(
    listener: tokio::net::TcpListener,
    senders: Vec<mpsc::Sender<Accepted>>,
    ctx: std::rc::Rc<ThreadCtx>,
) {
    let shared = ctx.shared.clone();
    let mut next = 0usize;
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = ctx.shutdown.wait() => return,
        };
        let stream = match accepted {
            Ok((s, _)) => s,
            Err(e) => {
                // Out of descriptors, or the peer left before accept:
                // wait a little instead of spinning on the error.
                tracing::warn!("RESP accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let shown = |a: std::io::Result<SocketAddr>| a.map_or("?".into(), |a| a.to_string());
        let peer = stream.peer_addr();
        let meta = Arc::new(clients::ClientMeta::new(
            shared.next_id.fetch_add(1, Ordering::Relaxed),
            peer.as_ref().ok().map(|a| a.ip()),
            shown(peer),
            shown(stream.local_addr()),
        ));
        let open = shared.metrics.open.load(Ordering::Relaxed);
        let cfg = &shared.cfg;
        let listed =
            match shared
                .clients
                .admit(meta, open, cfg.max_clients, cfg.max_pending_per_peer)
            {
                Ok(l) => l,
                Err(why) => {
                    shared.metrics.rejected_connections.inc();
                    // Best effort: the socket buffer of a new connection has room.
                    let _ = stream.try_write(why);
                    continue;
                }
            };
        shared.metrics.open.fetch_add(1, Ordering::Relaxed);
        let std_stream = match stream.into_std() {
            Ok(s) => s,
            Err(e) => {
                shared.metrics.open.fetch_sub(1, Ordering::Relaxed);
                tracing::debug!("cannot hand a RESP connection over: {e}");
                continue;
            }
        };
        let a = Accepted {
            stream: std_stream,
            listed,
        };
        let t = next % senders.len();
        next = next.wrapping_add(1);
        if t == 0 {
            spawn_conn(a, &ctx);
            continue;
        }
        // A full queue pushes back on accepting (bounded, like every queue).
        if senders[t].send(a).await.is_err() {
            shared.metrics.open.fetch_sub(1, Ordering::Relaxed);
            return;
        }
    }
}
