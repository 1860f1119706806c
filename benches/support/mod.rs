//! Shared pieces of kvpool's benches: latency histograms, the reference
//! measurements taken in the same run, and starting the real binary.
//!
//! Benches are plain binaries (`harness = false`). Under `cargo bench` cargo
//! passes `--bench` and they run in full; under `cargo test` they run a small
//! mode, so they cannot rot.

#![allow(dead_code)] // each bench uses a different subset

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;

pub const BIN: &str = env!("CARGO_BIN_EXE_kvpool");

/// True under `cargo bench`, false under `cargo test`.
pub fn full_mode() -> bool {
    std::env::args().any(|a| a == "--bench")
}

/// Latencies in nanoseconds, 3 significant digits.
pub struct Lat {
    pub h: Histogram<u64>,
    pub bytes: u64,
    pub busy: Duration,
}

impl Lat {
    pub fn new() -> Self {
        Self {
            h: Histogram::new_with_bounds(1, 3_600_000_000_000, 3).expect("histogram bounds"),
            bytes: 0,
            busy: Duration::ZERO,
        }
    }

    pub fn record(&mut self, took: Duration, bytes: u64) {
        self.h.saturating_record(took.as_nanos() as u64);
        self.bytes += bytes;
        self.busy += took;
    }

    /// Folds `other` (another run of the same measure) into this one.
    pub fn add(&mut self, other: &Lat) {
        self.h.add(&other.h).expect("same histogram bounds");
        self.bytes += other.bytes;
        self.busy += other.busy;
    }

    /// Throughput over the time spent inside the measured calls.
    pub fn gbps(&self) -> f64 {
        self.bytes as f64 / self.busy.as_secs_f64().max(1e-9) / 1e9
    }

    pub fn us(&self, q: f64) -> f64 {
        self.h.value_at_quantile(q) as f64 / 1000.0
    }
}

pub fn header() {
    println!(
        "{:<10} {:>9} {:>6} {:>10} {:>10} {:>10} {:>10} {:>8}",
        "op", "size", "n", "p50_us", "p99_us", "p99.9_us", "max_us", "GB/s"
    );
}

pub fn row(op: &str, size: &str, l: &Lat) {
    println!(
        "{:<10} {:>9} {:>6} {:>10.1} {:>10.1} {:>10.1} {:>10.1} {:>8.3}",
        op,
        size,
        l.h.len(),
        l.us(0.5),
        l.us(0.99),
        l.us(0.999),
        l.h.max() as f64 / 1000.0,
        l.gbps()
    );
}

pub fn size_name(n: usize) -> String {
    if n >= 1 << 20 && n % (1 << 20) == 0 {
        format!("{}MiB", n >> 20)
    } else if n >= 1 << 10 && n % (1 << 10) == 0 {
        format!("{}KiB", n >> 10)
    } else {
        format!("{n}B")
    }
}

/// Single-thread memcpy bandwidth (GB/s) over `size`-byte buffers.
pub fn memcpy_gbps(size: usize, rounds: usize) -> f64 {
    let src = vec![1u8; size];
    let mut dst = vec![0u8; size];
    dst.copy_from_slice(&src); // fault the pages in first
    let t = Instant::now();
    for i in 0..rounds {
        dst.copy_from_slice(&src);
        std::hint::black_box(&dst[i % size]);
    }
    (size * rounds) as f64 / t.elapsed().as_secs_f64() / 1e9
}

/// Single-thread memcpy bandwidth (GB/s) of `size`-byte copies whose source
/// rotates over `pool` bytes, so it comes from DRAM, not cache (like a get of
/// a different object each time).
pub fn memcpy_cold_gbps(size: usize, pool: usize, rounds: usize) -> f64 {
    let src = vec![1u8; pool];
    let mut dst = vec![0u8; size];
    let n = (pool / size).max(1);
    for i in 0..n {
        dst.copy_from_slice(&src[i * size..(i + 1) * size]); // fault everything in
    }
    let t = Instant::now();
    for i in 0..rounds {
        let j = i % n;
        dst.copy_from_slice(&src[j * size..(j + 1) * size]);
        std::hint::black_box(&dst[i % size]);
    }
    (size * rounds) as f64 / t.elapsed().as_secs_f64() / 1e9
}

/// Loopback TCP bandwidth measured by iperf3 (`-l 1M`), in GB/s, if iperf3
/// is installed.
pub fn iperf3_gbps(seconds: u32) -> Option<f64> {
    let port = 20_000 + (std::process::id() % 20_000) as u16;
    let mut server = Command::new("iperf3")
        .args(["-s", "-1", "-p", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    std::thread::sleep(Duration::from_millis(300));
    let out = Command::new("iperf3")
        .args([
            "-c",
            "127.0.0.1",
            "-p",
            &port.to_string(),
            "-l",
            "1M",
            "-t",
            &seconds.to_string(),
            "-J",
        ])
        .output()
        .ok();
    let _ = server.kill();
    let _ = server.wait();
    let out = out?;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
    let bps = v["end"]["sum_received"]["bits_per_second"].as_f64()?;
    Some(bps / 8.0 / 1e9)
}

/// A running kvpool process; killed when dropped.
pub struct Node {
    pub child: Child,
    pub addr: String,
    /// Its HTTP address, when started with `--http` ("" otherwise).
    pub http: String,
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `kvpool run --role <role> <args>` and waits for its ready line.
pub fn start(role: &str, args: &[&str]) -> Node {
    // The store benches measure the pool alone: role all without its
    // serving path (engines, proxies, conductor).
    let store_only: &[&str] = if role == "all" {
        &["--no-serving"]
    } else {
        &[]
    };
    let mut child = Command::new(BIN)
        .args(["run", "--role", role])
        .args(store_only)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn kvpool");
    let stdout = child.stdout.take().expect("stdout");
    // Owned from here on: a panic below kills and reaps the child.
    let mut node = Node {
        child,
        addr: String::new(),
        http: String::new(),
    };
    let want = format!("kvpool {role} listening on ");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        // Reads to the end, so the child never blocks on a full pipe.
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if let Some(addr) = line.strip_prefix(&want) {
                let _ = tx.send((false, addr.trim().to_string()));
            } else if let Some(addr) = line.strip_prefix("kvpool http listening on ") {
                let _ = tx.send((true, addr.trim().to_string()));
            }
        }
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    let wants_http = args.contains(&"--http");
    while node.addr.is_empty() || (wants_http && node.http.is_empty()) {
        match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok((false, addr)) => node.addr = addr,
            Ok((true, addr)) => node.http = addr,
            Err(e) => panic!("kvpool {role} did not become ready: {e}"),
        }
    }
    node
}

/// Starts `kvpool run --role all` (the pool without its serving path) with
/// `config`, a DRAM segment of `segment_size`, RPC and HTTP on free
/// loopback ports, and `more` arguments.
pub fn start_pool(config: &std::path::Path, segment_size: &str, more: &[&str]) -> Node {
    let mut args = vec![
        "--config",
        config.to_str().expect("utf-8 path"),
        "--listen",
        "127.0.0.1:0",
        "--http",
        "127.0.0.1:0",
        "--segment-size",
        segment_size,
    ];
    args.extend_from_slice(more);
    start("all", &args)
}

/// A counter or gauge of a process's `/metrics` (a counter's `_total`), or
/// `None` when it is not there.
pub fn metric(http: &str, name: &str) -> Option<u64> {
    metrics_text(http)?.lines().find_map(|l| {
        l.strip_prefix(name)
            .and_then(|r| r.strip_prefix("_total ").or_else(|| r.strip_prefix(' ')))
            .and_then(|v| v.trim().parse().ok())
    })
}

/// A process's `/metrics` page.
pub fn metrics_text(http: &str) -> Option<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(http).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    Some(text)
}

/// The machine, for the record.
pub fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_else(|| "unknown cpu".into());
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .unwrap_or_default()
        .trim()
        .to_string();
    format!("{cores} cores, {cpu}, Linux {kernel}")
}

/// One redis-benchmark result: requests/s and p50 latency (ms) of SET and GET.
pub struct RedisFigures {
    pub size: usize,
    pub set_rps: f64,
    pub set_p50_ms: f64,
    pub get_rps: f64,
    pub get_p50_ms: f64,
}

/// Runs Debian's redis-server on a free port and redis-benchmark against it
/// (one client, so its latency compares with a single kvpool caller), for
/// each value size; None if redis is not installed.
pub fn redis_benchmark(sizes: &[usize], requests: usize) -> Option<Vec<RedisFigures>> {
    let port = 30_000 + (std::process::id() % 20_000) as u16;
    let mut server = Command::new("redis-server")
        .args([
            "--port",
            &port.to_string(),
            "--save",
            "",
            "--appendonly",
            "no",
            "--proto-max-bulk-len",
            "64mb",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    let deadline = Instant::now() + Duration::from_secs(5);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if Instant::now() > deadline {
            let _ = server.kill();
            let _ = server.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut out = Vec::new();
    for &size in sizes {
        let n = requests.min(((1usize << 30) / size).max(100));
        let o = Command::new("redis-benchmark")
            .args([
                "-p",
                &port.to_string(),
                "-t",
                "set,get",
                "-d",
                &size.to_string(),
                "-n",
                &n.to_string(),
                "-c",
                "1",
                "--csv",
            ])
            .output()
            .ok()?;
        // CSV: "test","rps","avg_latency_ms","min_latency_ms","p50_latency_ms",...
        let text = String::from_utf8_lossy(&o.stdout);
        let mut set = (0.0, 0.0);
        let mut get = (0.0, 0.0);
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split(',').map(|x| x.trim_matches('"')).collect();
            if f.len() < 5 {
                continue;
            }
            let rps: f64 = f[1].parse().unwrap_or(0.0);
            let p50: f64 = f[4].parse().unwrap_or(0.0);
            match f[0] {
                "SET" => set = (rps, p50),
                "GET" => get = (rps, p50),
                _ => {}
            }
        }
        out.push(RedisFigures {
            size,
            set_rps: set.0,
            set_p50_ms: set.1,
            get_rps: get.0,
            get_p50_ms: get.1,
        });
    }
    let _ = server.kill();
    let _ = server.wait();
    Some(out)
}

/// perftest's `ib_write_bw` / `ib_read_bw` (`op`: "write" or "read") on
/// `device`, server and client on this machine over 127.0.0.1: the average
/// bandwidth in GB/s for `size`-byte messages, about `depth` in flight on one
/// queue pair. `None` if perftest is not installed or the run failed.
#[allow(dead_code)] // only the rdma mode of benches/transfer.rs uses it
pub fn perftest_gbps(
    op: &str,
    device: &str,
    gid_index: u8,
    size: usize,
    iters: usize,
    depth: usize,
) -> Option<f64> {
    let tool = format!("ib_{op}_bw");
    let port =
        (18_600 + (size.trailing_zeros() as u16) + if op == "read" { 40 } else { 0 }).to_string();
    let args = [
        "-d".to_string(),
        device.to_string(),
        "-x".into(),
        gid_index.to_string(),
        "-s".into(),
        size.to_string(),
        "-n".into(),
        iters.to_string(),
        "-t".into(),
        depth.to_string(),
        "-F".into(),
        "-p".into(),
        port.clone(),
    ];
    // Both sides run under coreutils `timeout`: a peer that never shows up
    // ends the run instead of hanging the bench.
    let mut server = Command::new("timeout")
        .arg("120")
        .arg(&tool)
        .args(&args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    // The server listens within a moment; the client retries its connect.
    std::thread::sleep(Duration::from_millis(500));
    let out = Command::new("timeout")
        .arg("120")
        .arg(&tool)
        .args(&args)
        .arg("127.0.0.1")
        .output();
    let _ = server.kill();
    let _ = server.wait();
    let out = out.ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    // The result row: #bytes #iterations BW-peak BW-average MsgRate (MB/s).
    text.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() >= 5 && f[0] == size.to_string())
                .then(|| f[3].parse::<f64>().ok())
                .flatten()
        })
        .next_back()
        .map(|mbps| mbps * 1e6 / 1e9)
}

/// The path of `name` on PATH, if it is there.
pub fn on_path(name: &str) -> Option<String> {
    let paths = std::env::var_os("PATH")?;
    let mut found = std::env::split_paths(&paths).map(|d| d.join(name));
    let path = found.find(|p| p.is_file())?;
    Some(path.to_string_lossy().into_owned())
}

/// POSTs `body` to an engine's `/v1/completions`; the JSON answer (200 or panic).
pub fn completion(addr: &str, body: &serde_json::Value) -> serde_json::Value {
    let body = body.to_string();
    let text = http(
        addr,
        &format!(
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        ),
    );
    let (head, json) = text.split_once("\r\n\r\n").expect("an HTTP answer");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}\n{json}");
    serde_json::from_str(json).expect("a JSON answer")
}

/// Sends one HTTP/1.1 request (with `Connection: close`); the whole answer.
pub fn http(addr: &str, request: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("connect engine");
    s.set_read_timeout(Some(Duration::from_secs(900)))
        .expect("timeout");
    s.write_all(request.as_bytes()).expect("send");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("read answer");
    out
}

/// BOS then pseudo-random bytes (a byte-level built-in model's prompt);
/// `seed` makes prompts that share nothing.
pub fn byte_prompt(n: usize, seed: u32) -> Vec<u32> {
    let mut x = seed.wrapping_mul(2_654_435_761) | 1;
    std::iter::once(256)
        .chain((1..n).map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x % 256
        }))
        .collect()
}
