//! The RESP front against redis-server, measured by the same tool in the
//! same run: `redis-benchmark -t set` then `-t get` of 4 KiB, 64 KiB and
//! 1 MiB values with `-c 1`, `-c 16` and `-c 16 -P 16`, in alternating
//! rounds (kvpool first in even rounds, Redis first in odd ones). Prints each
//! run (requests/s, p50/p99/p99.9/max from redis-benchmark's histogram), then
//! the median of each side and their ratio, and the two targets.
//!
//!     cargo bench --bench resp               # full run (5 rounds)
//!     cargo test --release --bench resp      # small run (also in the suite)
//!
//! Without redis-server or redis-benchmark it says so and measures nothing.

mod support;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// One redis-benchmark run.
#[derive(Debug, Clone, Copy)]
struct Run {
    rps: f64,
    p50_ms: f64,
    p99_ms: f64,
    p999_ms: f64,
    max_ms: f64,
}

/// A case: value size, clients, pipeline depth, requests (full, small).
struct Case {
    size: usize,
    clients: u32,
    pipeline: u32,
    n_full: usize,
    n_small: usize,
}

const CASES: &[Case] = &[
    Case {
        size: 4 << 10,
        clients: 1,
        pipeline: 1,
        n_full: 10_000,
        n_small: 200,
    },
    Case {
        size: 4 << 10,
        clients: 16,
        pipeline: 1,
        n_full: 20_000,
        n_small: 400,
    },
    Case {
        size: 4 << 10,
        clients: 16,
        pipeline: 16,
        n_full: 100_000,
        n_small: 1_600,
    },
    Case {
        size: 64 << 10,
        clients: 1,
        pipeline: 1,
        n_full: 5_000,
        n_small: 100,
    },
    Case {
        size: 64 << 10,
        clients: 16,
        pipeline: 1,
        n_full: 10_000,
        n_small: 200,
    },
    Case {
        size: 64 << 10,
        clients: 16,
        pipeline: 16,
        n_full: 20_000,
        n_small: 800,
    },
    Case {
        size: 1 << 20,
        clients: 1,
        pipeline: 1,
        n_full: 1_000,
        n_small: 20,
    },
    Case {
        size: 1 << 20,
        clients: 16,
        pipeline: 1,
        n_full: 2_000,
        n_small: 64,
    },
    Case {
        size: 1 << 20,
        clients: 16,
        pipeline: 16,
        n_full: 2_000,
        n_small: 256,
    },
];

/// The median of `v` (the mean of the middle two when even).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

fn has(tool: &str) -> bool {
    Command::new(tool)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// Waits (bounded) until `port` answers PING.
fn wait_ping(port: u16) {
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        let ok = Command::new("redis-cli")
            .args(["-p", &port.to_string(), "ping"])
            .output()
            .is_ok_and(|o| o.stdout.starts_with(b"PONG"));
        if ok {
            return;
        }
        assert!(Instant::now() < end, "port {port} never answered PING");
        std::thread::sleep(Duration::from_millis(50));
    }
}

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The first number after `prefix` on a line.
fn number_after(line: &str, prefix: &str) -> Option<f64> {
    line.trim()
        .strip_prefix(prefix)?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Parses redis-benchmark's default output: the throughput summary, the
/// latency summary (p50, p99, max) and the percentile distribution (the
/// first line at or past 99.9%).
fn parse(out: &str) -> Option<Run> {
    let rps = out
        .lines()
        .find_map(|l| number_after(l, "throughput summary:"))?;
    let mut p999 = None;
    for l in out.lines() {
        let l = l.trim();
        let Some((pct, rest)) = l.split_once("% <= ") else {
            continue;
        };
        let Ok(pct) = pct.parse::<f64>() else {
            continue;
        };
        if pct >= 99.9 && p999.is_none() {
            p999 = rest.split_whitespace().next()?.parse().ok();
        }
    }
    let lines: Vec<&str> = out.lines().collect();
    let at = lines
        .iter()
        .position(|l| l.contains("avg") && l.contains("p50"))?;
    let f: Vec<f64> = lines
        .get(at + 1)?
        .split_whitespace()
        .filter_map(|x| x.parse().ok())
        .collect();
    // avg min p50 p95 p99 max
    if f.len() < 6 {
        return None;
    }
    Some(Run {
        rps,
        p50_ms: f[2],
        p99_ms: f[4],
        p999_ms: p999.unwrap_or(f[5]),
        max_ms: f[5],
    })
}

fn bench(port: u16, op: &str, case: &Case, n: usize) -> Run {
    let out = Command::new("redis-benchmark")
        .args(["-p", &port.to_string(), "-t", op])
        .args(["-d", &case.size.to_string(), "-n", &n.to_string()])
        .args([
            "-c",
            &case.clients.to_string(),
            "-P",
            &case.pipeline.to_string(),
        ])
        .output()
        .expect("run redis-benchmark");
    let text = String::from_utf8_lossy(&out.stdout).replace('\r', "\n");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "redis-benchmark failed: {text} {err}");
    assert!(
        !text.contains("Error") && !err.contains("Error"),
        "redis-benchmark saw an error reply: {err}"
    );
    parse(&text).unwrap_or_else(|| panic!("cannot read redis-benchmark's output:\n{text}"))
}

pub fn main() {
    let full = support::full_mode();
    println!(
        "kvpool RESP bench ({} mode)",
        if full { "full" } else { "small" }
    );
    println!("machine: {}", support::machine());
    if !has("redis-server") || !has("redis-benchmark") || !has("redis-cli") {
        println!("skip: reference redis-server / redis-benchmark not found (apt-get install redis-server redis-tools); nothing measured");
        return;
    }
    let rounds = if full { 5 } else { 1 };

    let redis_port = free_port();
    let _redis = Killed(
        Command::new("redis-server")
            .args([
                "--port",
                &redis_port.to_string(),
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start redis-server"),
    );
    let kv_port = free_port();
    let cfg = std::env::temp_dir().join(format!("kvpool-bench-resp-{}.toml", std::process::id()));
    std::fs::write(&cfg, "[storage]\nprefault = true\n").expect("bench config");
    let resp = format!("127.0.0.1:{kv_port}");
    let _node = support::start_pool(&cfg, "2GiB", &["--resp", &resp]);
    wait_ping(redis_port);
    wait_ping(kv_port);
    let version = Command::new("redis-server")
        .arg("--version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    println!("reference: {version}, one instance, --save '' --appendonly no");
    println!(
        "{:<18} {:<4} {:<7} {:>5} {:>11} {:>8} {:>8} {:>9} {:>8}",
        "case", "op", "server", "round", "req/s", "p50_ms", "p99_ms", "p99.9_ms", "max_ms"
    );
    let servers = [("kvpool", kv_port), ("redis", redis_port)];
    let mut summary = Vec::new();
    for case in CASES {
        let n = if full { case.n_full } else { case.n_small };
        let name = format!(
            "{} -c {}{}",
            support::size_name(case.size),
            case.clients,
            if case.pipeline > 1 {
                format!(" -P {}", case.pipeline)
            } else {
                String::new()
            }
        );
        // runs[server][op] = rounds
        let mut runs: [[Vec<Run>; 2]; 2] = Default::default();
        for round in 0..rounds {
            let order: [usize; 2] = if round % 2 == 0 { [0, 1] } else { [1, 0] };
            for s in order {
                let (server, port) = servers[s];
                for (o, op) in ["set", "get"].into_iter().enumerate() {
                    let r = bench(port, op, case, n);
                    println!(
                        "{:<18} {:<4} {:<7} {:>5} {:>11.0} {:>8.3} {:>8.3} {:>9.3} {:>8.3}",
                        name,
                        op.to_uppercase(),
                        server,
                        round,
                        r.rps,
                        r.p50_ms,
                        r.p99_ms,
                        r.p999_ms,
                        r.max_ms
                    );
                    runs[s][o].push(r);
                }
            }
        }
        for (o, op) in ["SET", "GET"].into_iter().enumerate() {
            let med = |s: usize, f: fn(&Run) -> f64| median(runs[s][o].iter().map(f).collect());
            let (kv, rd) = (med(0, |r| r.rps), med(1, |r| r.rps));
            summary.push((
                name.clone(),
                op,
                case.size,
                kv,
                rd,
                med(0, |r| r.p50_ms),
                med(1, |r| r.p50_ms),
                med(0, |r| r.p99_ms),
                med(1, |r| r.p99_ms),
            ));
        }
    }
    println!();
    println!("medians of {rounds} alternating round(s)");
    println!(
        "{:<18} {:<4} {:>11} {:>11} {:>7} {:>9} {:>9} {:>10} {:>9} {:>9}",
        "case",
        "op",
        "kv req/s",
        "redis req/s",
        "ratio",
        "kv GB/s",
        "redis GB/s",
        "kv p50_ms",
        "rd p50_ms",
        "kv p99_ms"
    );
    for (name, op, size, kv, rd, kp50, rp50, kp99, _rp99) in &summary {
        println!(
            "{:<18} {:<4} {:>11.0} {:>11.0} {:>7.2} {:>9.3} {:>9.3} {:>10.3} {:>9.3} {:>9.3}",
            name,
            op,
            kv,
            rd,
            kv / rd,
            kv * *size as f64 / 1e9,
            rd * *size as f64 / 1e9,
            kp50,
            rp50,
            kp99
        );
    }
    let ratio = |case: &str, op: &str| {
        summary
            .iter()
            .find(|s| s.0 == case && s.1 == op)
            .map(|s| s.3 / s.4)
            .unwrap_or(0.0)
    };
    for (case, op, target) in [
        ("1MiB -c 16", "GET", 1.5),
        ("4KiB -c 16 -P 16", "GET", 1.0),
        ("4KiB -c 16 -P 16", "SET", 1.0),
    ] {
        let r = ratio(case, op);
        println!(
            "target {case} {op}: kvpool >= {target:.1}x Redis: {r:.2}x ({})",
            if r >= target { "met" } else { "MISSED" }
        );
    }
    let _ = std::fs::remove_file(&cfg);
}
