//! `kvpool bench transfer`: put and get latency and throughput through the
//! client library against a running pool, per transport, value size, and
//! batch size. `benches/transfer.rs` runs the same code against a fresh
//! `kvpool run` with the reference measurements beside it.

use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use kvpool_transport::KvError;
use serde::Serialize;

use kvpool_client::Client;
use kvpool_config::{ClientConfig, Transport};

/// What to measure.
#[derive(Debug, Clone)]
pub struct TransferBench {
    pub transports: Vec<Transport>,
    pub sizes: Vec<usize>,
    pub batches: Vec<usize>,
    /// Bytes moved per (transport, size, batch, op), at most.
    pub bytes_per_case: u64,
    /// Calls per case, at most (small values).
    pub max_calls: usize,
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
            client: ClientConfig::default(),
        }
    }
}

/// A bench buffer: registered with the client's RDMA devices when it has
/// them (transfers are then zero copy, as a serving engine's KV buffers
/// would be), else an ordinary heap buffer.
enum BenchBuf {
    Heap(Vec<u8>),
    #[cfg(feature = "rdma")]
    Rdma(std::sync::Arc<kvpool_transport::rdma::RdmaBuffer>, usize),
}

impl BenchBuf {
    fn new(c: &Client, len: usize, fill: impl Fn(usize) -> u8) -> Result<Self, KvError> {
        #[cfg(feature = "rdma")]
        if c.engine().rdma_enabled() {
            let b = c.engine().alloc_rdma_buffer(len)?;
            let mut me = BenchBuf::Rdma(b, len);
            for (i, x) in me.bytes_mut().iter_mut().enumerate() {
                *x = fill(i);
            }
            return Ok(me);
        }
        let _ = c;
        Ok(BenchBuf::Heap((0..len).map(fill).collect()))
    }

    fn bytes(&self) -> &[u8] {
        match self {
            BenchBuf::Heap(v) => v,
            // SAFETY: a bench buffer is used by one transfer at a time, which
            // is awaited before the buffer is touched again.
            #[cfg(feature = "rdma")]
            BenchBuf::Rdma(b, len) => unsafe { b.bytes(0, *len) },
        }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            BenchBuf::Heap(v) => v,
            // SAFETY: as in `bytes`; `&mut self` makes this the only view.
            #[cfg(feature = "rdma")]
            BenchBuf::Rdma(b, len) => unsafe { b.bytes_mut(0, *len) },
        }
    }
}

/// One line of results.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub transport: &'static str,
    pub op: &'static str,
    pub size: usize,
    pub batch: usize,
    pub calls: u64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    pub max_us: f64,
    pub gb_per_s: f64,
}

fn name(t: Transport) -> &'static str {
    match t {
        Transport::Auto => "auto",
        Transport::Tcp => "tcp",
        Transport::Shm => "shm",
        Transport::Rdma => "rdma",
    }
}

fn row(
    transport: Transport,
    op: &'static str,
    size: usize,
    batch: usize,
    h: &Histogram<u64>,
    bytes: u64,
    wall: Duration,
) -> Row {
    Row {
        transport: name(transport),
        op,
        size,
        batch,
        calls: h.len(),
        p50_us: h.value_at_quantile(0.5) as f64 / 1000.0,
        p99_us: h.value_at_quantile(0.99) as f64 / 1000.0,
        p999_us: h.value_at_quantile(0.999) as f64 / 1000.0,
        max_us: h.max() as f64 / 1000.0,
        gb_per_s: bytes as f64 / wall.as_secs_f64().max(1e-9) / 1e9,
    }
}

fn hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 3_600_000_000_000, 3).expect("histogram bounds")
}

/// Runs the matrix against the pool at `master`; `on_row` gets each line as
/// it is measured.
pub async fn run_transfer(
    master: &str,
    bench: &TransferBench,
    mut on_row: impl FnMut(&Row),
) -> Result<Vec<Row>, KvError> {
    let mut rows = Vec::new();
    for &t in &bench.transports {
        let c = Client::connect(
            master,
            ClientConfig {
                transport: t,
                ping_interval_ms: 0,
                ..bench.client.clone()
            },
        )
        .await?;
        for &size in &bench.sizes {
            let value = BenchBuf::new(&c, size, |i| (i % 251) as u8)?;
            let value = value.bytes();
            for &batch in &bench.batches {
                // Values per case: the byte budget, at least one call's worth
                // of small values and at least one value, capped by the calls.
                let n = ((bench.bytes_per_case / size as u64) as usize)
                    .clamp(1, bench.max_calls * batch);
                let keys: Vec<Vec<u8>> = (0..n)
                    .map(|i| format!("bench/{}/{size}/{batch}/{i}", name(t)).into_bytes())
                    .collect();
                // Warm the connections and the shm mapping.
                c.put(b"bench/warm", value).await?;
                let mut buf = BenchBuf::new(&c, size, |_| 0)?;
                c.get_into(b"bench/warm", buf.bytes_mut()).await?;
                c.remove_with(b"bench/warm", true).await?;

                let mut h = hist();
                let t0 = Instant::now();
                for chunk in keys.chunks(batch) {
                    let s = Instant::now();
                    if batch == 1 {
                        c.put(&chunk[0], value).await?;
                    } else {
                        let items: Vec<(&[u8], &[u8])> =
                            chunk.iter().map(|k| (k.as_slice(), value)).collect();
                        for r in c.batch_put(&items, &Default::default()).await? {
                            r?;
                        }
                    }
                    h.saturating_record(s.elapsed().as_nanos() as u64);
                }
                let r = row(
                    t,
                    "put",
                    size,
                    batch,
                    &h,
                    (keys.len() * size) as u64,
                    t0.elapsed(),
                );
                on_row(&r);
                rows.push(r);

                let mut h = hist();
                // Touched before timing: first-touch page faults of fresh
                // buffers are not the transfer's cost.
                let mut bufs = (0..batch.min(n))
                    .map(|_| BenchBuf::new(&c, size, |_| 1))
                    .collect::<Result<Vec<_>, _>>()?;
                let t0 = Instant::now();
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
                let wall = t0.elapsed();
                if bufs[0].bytes() != value {
                    return Err(KvError::new(
                        kvpool_transport::ErrorCode::Corrupt,
                        "bench: bytes read differ from bytes written",
                    ));
                }
                let r = row(t, "get", size, batch, &h, (keys.len() * size) as u64, wall);
                on_row(&r);
                rows.push(r);

                for chunk in keys.chunks(512) {
                    let ks: Vec<&[u8]> = chunk.iter().map(Vec::as_slice).collect();
                    c.batch_remove(&ks, true).await?;
                }
            }
        }
    }
    Ok(rows)
}

/// A header and row format for humans.
pub fn print_header() {
    println!(
        "{:<9} {:<4} {:>9} {:>5} {:>7} {:>9} {:>9} {:>9} {:>9} {:>7}",
        "transport",
        "op",
        "size",
        "batch",
        "calls",
        "p50_us",
        "p99_us",
        "p99.9_us",
        "max_us",
        "GB/s"
    );
}

pub fn print_row(r: &Row) {
    let size = if r.size >= 1 << 20 {
        format!("{}MiB", r.size >> 20)
    } else {
        format!("{}KiB", r.size >> 10)
    };
    println!(
        "{:<9} {:<4} {:>9} {:>5} {:>7} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>7.3}",
        r.transport,
        r.op,
        size,
        r.batch,
        r.calls,
        r.p50_us,
        r.p99_us,
        r.p999_us,
        r.max_us,
        r.gb_per_s
    );
}
