//! `kvpool bench transfer`: put and get latency and throughput through the
//! client library against a running pool, per transport, value size, and
//! batch size. `benches/transfer.rs` runs the same code against a fresh
//! `kvpool run` with the reference measurements beside it.
//!
//! Each case puts its values, reads them all back, and removes them. A read
//! leases the object, and the space of a removed object comes back only
//! when that lease ends (`master.lease_ttl_ms`), so a case cannot assume the
//! space of the one before it is free. Each case is therefore sized from the
//! pool's `stat`: at most [`SPACE_HEADROOM`] of what is free below the high
//! watermark, so that no put crosses the watermark and evicts a value not yet
//! read. When leases are short (within [`MAX_SPACE_WAIT`]) a case that wants
//! more waits for the earlier cases' space, bounded, then runs with what
//! there is; with longer leases that space is shared out among the cases
//! left, so the matrix completes even if no lease ends during the run.
//! Keys are spread evenly over the master shards, since each shard evicts in
//! its own range of a segment.
//!
//! `clients` runs each case with N clients at once: N `Client`s, each with
//! its own master and data connections, as tasks of this process's
//! multi-threaded runtime (one worker per core), started together; the
//! case's values are dealt out among them. A row then gives the aggregate
//! throughput (all clients' bytes over the wall time of the slowest) and the
//! latency percentiles of every call of every client. Every key of a run
//! starts with `bench/<run id>/`, a random id per run, so benches run at once
//! against one pool (several processes, as a cluster's clients do) never
//! touch each other's keys.

use std::fmt;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use kvpool_runtime::hash::ShardMap;
use kvpool_wire::{ErrorCode, KvError};
use serde::Serialize;

use kvpool_client::Client;
use kvpool_config::{ClientConfig, MasterConfig, Transport};

/// The share of the pool's room below the high watermark one case may use:
/// the rest absorbs keys and replicas landing unevenly on shards and
/// segments, and allocations rounding up.
pub const SPACE_HEADROOM: f64 = 0.5;
/// Read leases up to this long (with the tick that frees their space) make
/// space renewable: a case waits for the space of earlier cases to come
/// back, at most this long. Longer leases are never waited for.
pub const MAX_SPACE_WAIT: Duration = Duration::from_secs(30);
/// How often a waiting case asks the master for its `stat`.
const SPACE_POLL: Duration = Duration::from_millis(100);
/// After a lease's end, the master frees the space on its next tick.
const LEASE_SLACK: Duration = Duration::from_secs(1);
/// Keys per remove call when a case cleans up.
const REMOVE_CHUNK: usize = 512;

/// What to measure.
#[derive(Debug, Clone)]
pub struct TransferBench {
    pub transports: Vec<Transport>,
    pub sizes: Vec<usize>,
    pub batches: Vec<usize>,
    /// Bytes moved per (transport, size, batch, op), at most.
    pub bytes_per_case: u64,
    /// Calls per case, at most (small values); with several clients, all
    /// clients' calls together.
    pub max_calls: usize,
    /// Clients at once, a case per count (`[1]`: one client).
    pub clients: Vec<usize>,
    /// The pool's `master.high_watermark`: a case stays well below it.
    pub high_watermark: f64,
    pub client: ClientConfig,
}

impl TransferBench {
    /// The matrix: 4 KiB .. 16 MiB, single and batches of 32.
    pub fn standard(full: bool) -> Self {
        Self {
            transports: vec![Transport::Tcp, Transport::Shm],
            sizes: vec![4 << 10, 64 << 10, 1 << 20, 16 << 20],
            batches: vec![1, 32],
            bytes_per_case: if full { 1 << 30 } else { 32 << 20 },
            max_calls: if full { 20_000 } else { 200 },
            clients: vec![1],
            high_watermark: MasterConfig::default().high_watermark,
            client: ClientConfig::default(),
        }
    }
}

/// `Unsupported` when a transport cannot work in this build (RDMA without
/// the `rdma` feature: none installed); callers check before connecting to
/// anything.
pub fn check_transports(transports: &[Transport]) -> Result<(), KvError> {
    if kvpool_transport::nic::provider().is_none() && transports.contains(&Transport::Rdma) {
        return Err(KvError::new(
            ErrorCode::Unsupported,
            "--transport rdma: this kvpool was built without the rdma feature \
             (build with `cargo build --release --features rdma`)",
        ));
    }
    Ok(())
}

/// A bench buffer: registered with the client's RDMA devices when it has
/// them (transfers are then zero copy, as a serving engine's KV buffers
/// would be), else an ordinary heap buffer.
enum BenchBuf {
    Heap(Vec<u8>),
    Rdma(std::sync::Arc<kvpool_transport::nic::RdmaBuffer>, usize),
}

impl BenchBuf {
    fn new(c: &Client, len: usize, fill: impl Fn(usize) -> u8) -> Result<Self, KvError> {
        if c.engine().rdma_enabled() {
            let b = c.engine().alloc_rdma_buffer(len)?;
            let mut me = BenchBuf::Rdma(b, len);
            for (i, x) in me.bytes_mut().iter_mut().enumerate() {
                *x = fill(i);
            }
            return Ok(me);
        }
        Ok(BenchBuf::Heap((0..len).map(fill).collect()))
    }

    fn bytes(&self) -> &[u8] {
        match self {
            BenchBuf::Heap(v) => v,
            // SAFETY: a bench buffer is used by one transfer at a time, which
            // is awaited before the buffer is touched again.
            BenchBuf::Rdma(b, len) => unsafe { b.bytes(0, *len) },
        }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            BenchBuf::Heap(v) => v,
            // SAFETY: as in `bytes`; `&mut self` makes this the only view.
            BenchBuf::Rdma(b, len) => unsafe { b.bytes_mut(0, *len) },
        }
    }
}

/// One line of results.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// The transport asked for.
    pub transport: &'static str,
    /// The data path the bytes took (`shm`, `tcp`, `rdma`, or several
    /// joined by `+`): what `auto` chose, or where `rdma` fell back.
    pub path: String,
    pub op: &'static str,
    pub size: usize,
    pub batch: usize,
    /// Clients at once; `calls`, the percentiles and `gb_per_s` are theirs
    /// together.
    pub clients: usize,
    pub calls: u64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    pub max_us: f64,
    pub gb_per_s: f64,
}

/// One case of the matrix, numbered from 1.
#[derive(Debug, Clone, Copy)]
pub struct Case {
    pub index: usize,
    pub of: usize,
    pub transport: Transport,
    pub size: usize,
    pub batch: usize,
    pub clients: usize,
}

impl fmt::Display for Case {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "case {}/{} ({} {} batch {}",
            self.index,
            self.of,
            name(self.transport),
            size_name(self.size as u64),
            self.batch
        )?;
        match self.clients {
            1 => write!(f, ")"),
            n => write!(f, ", {n} clients)"),
        }
    }
}

/// What the bench reports as it goes.
#[derive(Debug)]
pub enum Progress<'a> {
    /// The case waits up to `up_to` for the space of earlier cases: it
    /// wants `want` bytes and `usable` are free for it now.
    Waiting {
        case: &'a Case,
        want: u64,
        usable: u64,
        up_to: Duration,
    },
    /// The case runs with `values` values (`bytes` in all), after waiting
    /// `waited` for space.
    Start {
        case: &'a Case,
        values: usize,
        bytes: u64,
        waited: Duration,
    },
    /// A measured row.
    Row(&'a Row),
}

/// The bench stopped at `case`; `rows` were measured before it.
#[derive(Debug)]
pub struct BenchError {
    pub rows: Vec<Row>,
    pub case: Option<Case>,
    pub error: KvError,
}

impl fmt::Display for BenchError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.case {
            Some(c) => write!(
                f,
                "{} ({}): {c}: {}",
                self.error.code,
                self.error.code.code(),
                self.error.message
            )?,
            None => write!(f, "{}", self.error)?,
        }
        write!(f, " ({} rows measured before it)", self.rows.len())
    }
}

impl std::error::Error for BenchError {}

fn name(t: Transport) -> &'static str {
    match t {
        Transport::Auto => "auto",
        Transport::Tcp => "tcp",
        Transport::Shm => "shm",
        Transport::Rdma => "rdma",
    }
}

fn size_name(n: u64) -> String {
    if n >= 1 << 20 && n.is_multiple_of(1 << 20) {
        format!("{}MiB", n >> 20)
    } else if n >= 1 << 10 && n.is_multiple_of(1 << 10) {
        format!("{}KiB", n >> 10)
    } else {
        format!("{n}B")
    }
}

/// An amount of space, roughly, for progress lines.
fn mib(n: u64) -> String {
    format!("{:.1} MiB", n as f64 / (1u64 << 20) as f64)
}

fn hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 3_600_000_000_000, 3).expect("histogram bounds")
}

/// Bytes the engines of `cs` have moved over shm, tcp and rdma.
fn moved(cs: &[Client]) -> [u64; 3] {
    let mut m = [0; 3];
    for c in cs {
        let s = c.engine().stats();
        m[0] += s.shm_bytes.load(Ordering::Relaxed);
        m[1] += s.tcp_bytes.load(Ordering::Relaxed);
        m[2] += s.rdma_bytes.load(Ordering::Relaxed);
    }
    m
}

/// The paths that moved bytes since `before`.
fn path_since(cs: &[Client], before: [u64; 3]) -> String {
    let now = moved(cs);
    let used: Vec<&str> = ["shm", "tcp", "rdma"]
        .into_iter()
        .zip(now.iter().zip(before))
        .filter(|(_, (n, b))| **n > *b)
        .map(|(p, _)| p)
        .collect();
    if used.is_empty() {
        "-".into()
    } else {
        used.join("+")
    }
}

/// Bytes a case may use: [`SPACE_HEADROOM`] of the room below the high
/// watermark in the DRAM segments that take new objects.
async fn usable_bytes(c: &Client, high_watermark: f64) -> Result<u64, KvError> {
    let s = c.stat().await?;
    let room: u64 = s
        .segments
        .iter()
        .filter(|g| !g.draining && !g.suspect)
        .map(|g| ((g.capacity as f64 * high_watermark) as u64).saturating_sub(g.used))
        .sum();
    Ok((room as f64 * SPACE_HEADROOM) as u64)
}

/// `n` keys for a case of run `run`, spread evenly over the master shards.
fn balanced_keys(c: &Client, run: &str, case: &Case, n: usize) -> Vec<Vec<u8>> {
    let shards = c.cluster_map().shards.len().max(1);
    let map = ShardMap::new(shards as u32).expect("the client checked the cluster map");
    let mut quota: Vec<usize> = (0..shards)
        .map(|s| n / shards + usize::from(s < n % shards))
        .collect();
    let mut keys = Vec::with_capacity(n);
    let mut i = 0u64;
    while keys.len() < n {
        let k = format!(
            "bench/{run}/{}/{}/{}/{}/{i}",
            name(case.transport),
            case.size,
            case.batch,
            case.clients
        )
        .into_bytes();
        let q = &mut quota[map.shard_of(&k) as usize];
        if *q > 0 {
            *q -= 1;
            keys.push(k);
        }
        i += 1;
    }
    keys
}

/// Removes `keys` (forced), ignoring errors: a case's clean-up.
async fn remove_keys(c: &Client, keys: &[Vec<u8>]) {
    for chunk in keys.chunks(REMOVE_CHUNK) {
        let ks: Vec<&[u8]> = chunk.iter().map(Vec::as_slice).collect();
        let _ = c.batch_remove(&ks, true).await;
    }
}

/// Runs the matrix against the pool at `master`; `on` hears of each case as
/// it starts and gets each row as it is measured. On an error, the rows
/// measured before it come back with it. Several clients run as tasks of
/// the calling runtime: a multi-threaded one runs them in parallel.
pub async fn run_transfer(
    master: &str,
    bench: &TransferBench,
    mut on: impl FnMut(Progress<'_>),
) -> Result<Vec<Row>, BenchError> {
    let mut rows = Vec::new();
    let fail = |rows: &mut Vec<Row>, case: Option<Case>, error: KvError| BenchError {
        rows: std::mem::take(rows),
        case,
        error,
    };
    check_transports(&bench.transports).map_err(|e| fail(&mut rows, None, e))?;
    let counts: Vec<usize> = if bench.clients.is_empty() {
        vec![1]
    } else {
        bench.clients.clone()
    };
    if let Some(&n) = counts.iter().find(|&&n| n == 0 || n > MAX_CLIENTS) {
        let e = KvError::new(
            ErrorCode::InvalidParams,
            format!("--clients {n}: from 1 to {MAX_CLIENTS} clients at once"),
        );
        return Err(fail(&mut rows, None, e));
    }
    let most = counts.iter().copied().max().unwrap_or(1);
    let run = format!("{:016x}", rand::random::<u64>());
    let of = bench.transports.len() * bench.sizes.len() * bench.batches.len() * counts.len();
    let mut index = 0;
    // When the read leases of the cases run so far have ended, and the
    // master has freed their space.
    let mut held_until: Option<Instant> = None;
    for &transport in &bench.transports {
        let first = Case {
            index: index + 1,
            of,
            transport,
            size: bench.sizes.first().copied().unwrap_or(0),
            batch: bench.batches.first().copied().unwrap_or(1),
            clients: counts[0],
        };
        let mut cs = Vec::with_capacity(most);
        for _ in 0..most {
            let c = Client::connect(
                master,
                ClientConfig {
                    transport,
                    ping_interval_ms: 0,
                    ..bench.client.clone()
                },
            )
            .await
            .map_err(|e| fail(&mut rows, Some(first), e))?;
            cs.push(c);
        }
        let lease = Duration::from_millis(cs[0].cluster_map().lease_ttl_ms) + LEASE_SLACK;
        for &size in &bench.sizes {
            for &batch in &bench.batches {
                for &clients in &counts {
                    index += 1;
                    let case = Case {
                        index,
                        of,
                        transport,
                        size,
                        batch,
                        clients,
                    };
                    let mut ctx = CaseRun {
                        cs: &cs[..clients],
                        run: &run,
                        bench,
                        case: &case,
                        lease,
                        held_until: &mut held_until,
                        keys: Vec::new(),
                    };
                    let r = ctx.run(&mut on).await;
                    let keys = std::mem::take(&mut ctx.keys);
                    match r {
                        Ok(measured) => {
                            for r in measured {
                                on(Progress::Row(&r));
                                rows.push(r);
                            }
                        }
                        Err((measured, e)) => {
                            remove_keys(&cs[0], &keys).await;
                            for (i, c) in cs.iter().enumerate() {
                                let _ = c.remove_with(&warm_key(&run, i), true).await;
                            }
                            for r in measured {
                                on(Progress::Row(&r));
                                rows.push(r);
                            }
                            return Err(fail(&mut rows, Some(case), e));
                        }
                    }
                }
            }
        }
    }
    Ok(rows)
}

/// Clients at once, at most.
pub const MAX_CLIENTS: usize = 256;

/// The key client `i` of run `run` warms its connections with.
fn warm_key(run: &str, i: usize) -> Vec<u8> {
    format!("bench/{run}/warm/{i}").into_bytes()
}

/// One case under way: what it needs and the keys it has put.
struct CaseRun<'a> {
    /// The case's clients.
    cs: &'a [Client],
    /// This run's id, in every key.
    run: &'a str,
    bench: &'a TransferBench,
    case: &'a Case,
    /// A read lease and the tick that frees its space.
    lease: Duration,
    held_until: &'a mut Option<Instant>,
    /// The case's keys, for the clean-up on an error.
    keys: Vec<Vec<u8>>,
}

/// One client's share of a case: its keys, dealt round-robin.
fn dealt(keys: &[Vec<u8>], i: usize, n: usize) -> Vec<Vec<u8>> {
    keys.iter().skip(i).step_by(n).cloned().collect()
}

/// One client's part of a phase: its keys, `batch` at a time, each value
/// `size` bytes; it starts when `go` opens (every client is ready).
struct Share {
    c: Client,
    keys: Vec<Vec<u8>>,
    size: usize,
    batch: usize,
    go: std::sync::Arc<tokio::sync::Barrier>,
}

/// A client puts its share; the latency of each call.
async fn put_share(s: Share) -> Result<Histogram<u64>, KvError> {
    let (c, keys, size, batch, go) = (s.c, s.keys, s.size, s.batch, s.go);
    let value = BenchBuf::new(&c, size, |i| (i % 251) as u8);
    go.wait().await;
    let value = value?;
    let value = value.bytes();
    let mut h = hist();
    for chunk in keys.chunks(batch) {
        let s = Instant::now();
        if batch == 1 {
            c.put(&chunk[0], value).await?;
        } else {
            let items: Vec<(&[u8], &[u8])> = chunk.iter().map(|k| (k.as_slice(), value)).collect();
            for r in c.batch_put(&items, &Default::default()).await? {
                r?;
            }
        }
        h.saturating_record(s.elapsed().as_nanos() as u64);
    }
    Ok(h)
}

/// A client reads its share back into buffers touched before `go` opens,
/// and checks the first buffer against the value put.
async fn get_share(s: Share) -> Result<Histogram<u64>, KvError> {
    let (c, keys, size, batch, go) = (s.c, s.keys, s.size, s.batch, s.go);
    // Touched before timing: first-touch page faults of fresh buffers are
    // not the transfer's cost.
    let bufs = (0..batch.min(keys.len()))
        .map(|_| BenchBuf::new(&c, size, |_| 1))
        .collect::<Result<Vec<_>, _>>();
    go.wait().await;
    let mut bufs = bufs?;
    let mut h = hist();
    for chunk in keys.chunks(batch) {
        let s = Instant::now();
        if batch == 1 {
            c.get_into(&chunk[0], bufs[0].bytes_mut()).await?;
        } else {
            let mut items: Vec<(&[u8], &mut [u8])> = chunk
                .iter()
                .zip(bufs.iter_mut())
                .map(|(k, b)| (k.as_slice(), b.bytes_mut()))
                .collect();
            for r in c.batch_get_into(&mut items).await? {
                r?;
            }
        }
        h.saturating_record(s.elapsed().as_nanos() as u64);
    }
    if let Some(b) = bufs.first() {
        if b.bytes()
            .iter()
            .enumerate()
            .any(|(i, &x)| x != (i % 251) as u8)
        {
            return Err(KvError::new(
                ErrorCode::Corrupt,
                "bench: bytes read differ from bytes written",
            ));
        }
    }
    Ok(h)
}

/// Which phase of a case the clients run.
#[derive(Clone, Copy)]
enum Phase {
    Put,
    Get,
}

impl CaseRun<'_> {
    /// Sizes the case from the pool's free space (waiting, bounded, for
    /// earlier cases' space), then measures put and get with the case's
    /// clients at once. On an error, the row already measured (the put)
    /// comes back with it.
    async fn run(
        &mut self,
        on: &mut impl FnMut(Progress<'_>),
    ) -> Result<Vec<Row>, (Vec<Row>, KvError)> {
        let (cs, case) = (self.cs, self.case);
        let size = case.size;
        let n = self.size_working_set(on).await.map_err(|e| (vec![], e))?;
        // Warm each client's connections and shm mapping (one more value
        // each: the working set left room for them).
        let value = BenchBuf::new(&cs[0], size, |i| (i % 251) as u8).map_err(|e| (vec![], e))?;
        let mut buf = BenchBuf::new(&cs[0], size, |_| 0).map_err(|e| (vec![], e))?;
        for (i, c) in cs.iter().enumerate() {
            let warm = warm_key(self.run, i);
            c.put(&warm, value.bytes()).await.map_err(|e| (vec![], e))?;
            c.get_into(&warm, buf.bytes_mut())
                .await
                .map_err(|e| (vec![], e))?;
            c.remove_with(&warm, true).await.map_err(|e| (vec![], e))?;
        }
        self.leased_now();
        drop((value, buf));

        self.keys = balanced_keys(&cs[0], self.run, case, n);
        let bytes = (self.keys.len() * size) as u64;
        let (h, wall, before) = self.phase(Phase::Put).await.map_err(|e| (vec![], e))?;
        let put = self.row("put", &h, bytes, wall, before);
        let got = self.phase(Phase::Get).await;
        self.leased_now();
        let (h, wall, before) = got.map_err(|e| (vec![put.clone()], e))?;
        let get = self.row("get", &h, bytes, wall, before);
        remove_keys(&cs[0], &self.keys).await;
        self.keys.clear();
        Ok(vec![put, get])
    }

    /// Runs `phase` on every client of the case at once, each on its share
    /// of the keys: the latencies of all their calls, the wall time from
    /// the start (all clients ready) to the last client's end, and the
    /// engines' byte counts before it.
    async fn phase(&self, phase: Phase) -> Result<(Histogram<u64>, Duration, [u64; 3]), KvError> {
        let cs = self.cs;
        let (size, batch) = (self.case.size, self.case.batch);
        let go = std::sync::Arc::new(tokio::sync::Barrier::new(cs.len() + 1));
        let tasks: Vec<_> = cs
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let share = Share {
                    c: c.clone(),
                    keys: dealt(&self.keys, i, cs.len()),
                    size,
                    batch,
                    go: go.clone(),
                };
                tokio::spawn(async move {
                    match phase {
                        Phase::Put => put_share(share).await,
                        Phase::Get => get_share(share).await,
                    }
                })
            })
            .collect();
        // Read before the barrier opens: the shares transfer nothing until
        // it does, and once it has, one may finish before this task runs
        // again (its bytes then counted as "before": the row's path said
        // "-", 1 run in 10 of tests/bench_transfer.rs on the 2-core machine).
        let before = moved(cs);
        go.wait().await;
        let t0 = Instant::now();
        let mut h = hist();
        let mut first_err = None;
        for t in tasks {
            match t.await {
                Ok(Ok(one)) => h.add(&one).expect("histograms of the same bounds"),
                Ok(Err(e)) => {
                    first_err.get_or_insert(e);
                }
                Err(e) => std::panic::resume_unwind(e.into_panic()),
            }
        }
        let wall = t0.elapsed();
        match first_err {
            Some(e) => Err(e),
            None => Ok((h, wall, before)),
        }
    }

    /// The values reads just leased hold their space until this lease ends.
    fn leased_now(&mut self) {
        *self.held_until = Some(Instant::now() + self.lease);
    }

    /// How many values the case puts: what it asks for (its byte budget, at
    /// least one value, at most its calls), cut to the space it may use.
    ///
    /// Leases that end within [`MAX_SPACE_WAIT`] make space renewable: a
    /// case may use all of the usable space, and waits (bounded) for earlier
    /// cases' space when it wants more. Longer leases are never waited for:
    /// the usable space is shared out among the cases left, so that the
    /// whole matrix fits even if no lease ends during the run.
    async fn size_working_set(
        &mut self,
        on: &mut impl FnMut(Progress<'_>),
    ) -> Result<usize, KvError> {
        let (c, b, case) = (&self.cs[0], self.bench, self.case);
        let size = case.size as u64;
        let wanted = ((b.bytes_per_case / size) as usize)
            .clamp(1, b.max_calls * case.batch)
            .max(case.clients);
        // The values and each client's warm-up value.
        let want = (wanted as u64 + case.clients as u64) * size;
        let renewable = self.lease <= MAX_SPACE_WAIT;
        let cases_left = (case.of + 1 - case.index) as u64;
        let share = |usable: u64| {
            if renewable {
                usable
            } else {
                usable / cases_left
            }
        };
        let mut usable = usable_bytes(c, b.high_watermark).await?;
        let mut waited = Duration::ZERO;
        let now = Instant::now();
        if let Some(until) = self
            .held_until
            .filter(|&u| renewable && usable < want && u > now)
        {
            on(Progress::Waiting {
                case,
                want,
                usable,
                up_to: until - now,
            });
            while usable < want && Instant::now() < until {
                tokio::time::sleep(SPACE_POLL).await;
                usable = usable_bytes(c, b.high_watermark).await?;
            }
            waited = now.elapsed();
        }
        let n = wanted.min((share(usable) / size).saturating_sub(case.clients as u64) as usize);
        if n < case.clients {
            return Err(KvError::new(
                ErrorCode::NoSpace,
                format!(
                    "{} values do not fit: a case needs room for two per client (one warms up), the \
                     bench uses at most {:.0}% of the room below the pool's high watermark \
                     ({}){}, and {} of that room is free now",
                    size_name(size),
                    SPACE_HEADROOM * 100.0,
                    b.high_watermark,
                    if renewable {
                        String::new()
                    } else {
                        format!(
                            ", shared among the {cases_left} cases left since read leases \
                             ({} s) outlast the run",
                            self.lease.as_secs()
                        )
                    },
                    mib((usable as f64 / SPACE_HEADROOM) as u64),
                ),
            ));
        }
        on(Progress::Start {
            case,
            values: n,
            bytes: n as u64 * size,
            waited,
        });
        Ok(n)
    }

    fn row(
        &self,
        op: &'static str,
        h: &Histogram<u64>,
        bytes: u64,
        wall: Duration,
        before: [u64; 3],
    ) -> Row {
        Row {
            transport: name(self.case.transport),
            path: path_since(self.cs, before),
            op,
            size: self.case.size,
            batch: self.case.batch,
            clients: self.case.clients,
            calls: h.len(),
            p50_us: h.value_at_quantile(0.5) as f64 / 1000.0,
            p99_us: h.value_at_quantile(0.99) as f64 / 1000.0,
            p999_us: h.value_at_quantile(0.999) as f64 / 1000.0,
            max_us: h.max() as f64 / 1000.0,
            gb_per_s: bytes as f64 / wall.as_secs_f64().max(1e-9) / 1e9,
        }
    }
}

/// Progress lines for humans, on stderr (rows go elsewhere: see
/// [`print_row`]). Plain text: no terminal codes.
pub fn print_progress(p: &Progress<'_>) {
    match p {
        Progress::Waiting {
            case,
            want,
            usable,
            up_to,
        } => eprintln!(
            "bench: {case}: waiting up to {:.1} s for the space of earlier cases \
             (their read leases end): wants {}, {} usable now",
            up_to.as_secs_f64(),
            mib(*want),
            mib(*usable)
        ),
        Progress::Start {
            case,
            values,
            bytes,
            waited,
        } => {
            let waited = if waited.is_zero() {
                String::new()
            } else {
                format!(" (waited {:.1} s for space)", waited.as_secs_f64())
            };
            let plural = if *values == 1 { "" } else { "s" };
            eprintln!(
                "bench: {case}: {values} value{plural}, {}{waited}",
                mib(*bytes)
            )
        }
        Progress::Row(_) => {}
    }
}

/// A header and row format for humans.
pub fn print_header() {
    println!(
        "{:<9} {:<8} {:<4} {:>9} {:>5} {:>7} {:>7} {:>9} {:>9} {:>9} {:>9} {:>7}",
        "transport",
        "path",
        "op",
        "size",
        "batch",
        "clients",
        "calls",
        "p50_us",
        "p99_us",
        "p99.9_us",
        "max_us",
        "GB/s"
    );
}

pub fn print_row(r: &Row) {
    println!(
        "{:<9} {:<8} {:<4} {:>9} {:>5} {:>7} {:>7} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>7.3}",
        r.transport,
        r.path,
        r.op,
        size_name(r.size as u64),
        r.batch,
        r.clients,
        r.calls,
        r.p50_us,
        r.p99_us,
        r.p999_us,
        r.max_us,
        r.gb_per_s
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_named_in_their_largest_whole_unit() {
        assert_eq!(size_name(4 << 10), "4KiB");
        assert_eq!(size_name(16 << 20), "16MiB");
        assert_eq!(size_name(1536 << 10), "1536KiB");
        assert_eq!(size_name(100), "100B");
    }

    #[test]
    fn rdma_is_refused_by_a_build_without_the_feature() {
        // This crate's tests install no RDMA: a build without the feature.
        let e = check_transports(&[Transport::Tcp, Transport::Rdma]).unwrap_err();
        assert_eq!(e.code, ErrorCode::Unsupported);
        assert!(e.message.contains("--features rdma"), "{e}");
        assert!(check_transports(&[Transport::Auto, Transport::Shm]).is_ok());
    }
}
