//! What log shipping costs a put (HA on etcd, docs/architecture/ha.md "Log
//! shipping"): a real etcd on loopback, a leader and a standby (`kvpool run
//! --role master --ha`), a DRAM storage node, one client putting 4 KiB
//! objects one after the other. Rounds alternate in the same run: with the
//! standby following (every put's two master calls wait for its ack), and
//! with it stopped (SIGSTOP) and dropped from the set the replies wait for.
//! After each stop the time the standby takes to be in sync again (a new
//! session: a snapshot of every object so far, then the log) is printed.
//!
//!     cargo bench --bench master_ship          # 6 rounds of 3,000 puts each way
//!     cargo test --release --bench master_ship # small run (part of the suite)
//!
//! Without /usr/bin/etcd it says so and measures nothing.

mod support;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvpool_client::{Client, ClientConfig};
use support::{full_mode, on_path, Lat};

/// A free loopback port now.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

struct Etcd {
    child: Child,
    dir: std::path::PathBuf,
    client: String,
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn etcd(bin: &str) -> Etcd {
    let (c, p) = (free_port(), free_port());
    let client = format!("127.0.0.1:{c}");
    let peer = format!("http://127.0.0.1:{p}");
    let dir = std::env::temp_dir().join(format!("kvpool-bench-etcd-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let child = Command::new(bin)
        .args(["--name", "b", "--data-dir", dir.to_str().expect("utf-8")])
        .args(["--listen-client-urls", &format!("http://{client}")])
        .args(["--advertise-client-urls", &format!("http://{client}")])
        .args(["--listen-peer-urls", &peer])
        .args(["--initial-advertise-peer-urls", &peer])
        .args(["--initial-cluster", &format!("b={peer}")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn etcd");
    let e = Etcd { child, dir, client };
    wait_for("etcd healthy", Duration::from_secs(20), || {
        get(&e.client, "/health").is_some_and(|b| b.contains("true"))
    });
    e
}

/// One HTTP GET's body.
fn get(addr: &str, path: &str) -> Option<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(3))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    Some(out.split_once("\r\n\r\n")?.1.to_string())
}

fn wait_for(what: &str, within: Duration, mut done: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < within, "{what}: not within {within:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
    start.elapsed()
}

/// `name=value` in a master's /healthz.
fn healthz(http: &str, name: &str) -> Option<String> {
    let body = get(http, "/healthz")?;
    body.split_whitespace()
        .find_map(|w| w.strip_prefix(&format!("{name}=")))
        .map(str::to_string)
}

fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "kill {sig} {pid}");
}

pub fn main() {
    let Some(etcd_bin) = on_path("etcd") else {
        println!("skip: etcd not found on PATH (apt-get install etcd-server); nothing measured");
        return;
    };
    let (rounds, per_round) = if full_mode() { (6, 3000) } else { (2, 100) };
    let etcd = etcd(&etcd_bin);
    let url = format!("etcd://{}", etcd.client);
    let cfg = std::env::temp_dir().join(format!("kvpool-bench-ship-{}.toml", std::process::id()));
    std::fs::write(
        &cfg,
        "[master]\nha_lease_ttl_s = 2\nha_fence_margin_ms = 500\n",
    )
    .expect("config");
    let cfg = cfg.to_str().expect("utf-8").to_string();
    let master = |http: &str| {
        support::start(
            "master",
            &[
                "--config",
                &cfg,
                "--ha",
                &url,
                "--listen",
                "127.0.0.1:0",
                "--http",
                http,
                "--shards",
                "2",
            ],
        )
    };
    let a_http = format!("127.0.0.1:{}", free_port());
    let a = master(&a_http);
    wait_for("a leader", Duration::from_secs(10), || {
        healthz(&a_http, "role").as_deref() == Some("leader")
    });
    let b_http = format!("127.0.0.1:{}", free_port());
    let b = master(&b_http);
    let _node = support::start(
        "storage",
        &[
            "--listen",
            "127.0.0.1:0",
            "--http",
            "127.0.0.1:0",
            "--shards",
            "1",
            "--master",
            &url,
            "--segment-size",
            "512MiB",
        ],
    );
    // Every shard of the leader with `n` standbys in sync.
    let in_sync = |n: &str| {
        healthz(&a_http, "standbys_in_sync").is_some_and(|v| v.split(',').all(|x| x == n))
    };
    wait_for("the standby in sync", Duration::from_secs(20), || {
        in_sync("1")
    });
    kvpool_ha::install();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let c = rt
        .block_on(Client::connect(&url, ClientConfig::default()))
        .expect("client");
    let value = vec![0x5au8; 4096];
    let next = std::cell::Cell::new(0u64);
    let run = |lat: &mut Lat| {
        rt.block_on(async {
            for _ in 0..per_round {
                let key = format!("ship-bench-{:09}", next.get());
                next.set(next.get() + 1);
                let t = Instant::now();
                c.put(key.as_bytes(), &value).await.expect("put");
                lat.record(t.elapsed(), 4096);
            }
        })
    };
    let b_pid = b.child.id();
    let mut with = Lat::new();
    let mut without = Lat::new();
    let (mut p50_with, mut p50_without) = (Vec::new(), Vec::new());
    println!("# {}", support::machine());
    for r in 0..rounds {
        for first in [r % 2 == 0, r % 2 != 0] {
            let mut l = Lat::new();
            if first {
                run(&mut l);
                p50_with.push(l.us(0.5));
                with.add(&l);
            } else {
                // The standby stops; the leader drops it at the next put
                // that waits the sync timeout for it (not measured).
                signal(b_pid, "-STOP");
                let key = format!("ship-bench-drop-{r}");
                rt.block_on(async { c.put(key.as_bytes(), &value).await.expect("put") });
                wait_for("the standby dropped", Duration::from_secs(10), || {
                    in_sync("0")
                });
                run(&mut l);
                p50_without.push(l.us(0.5));
                without.add(&l);
                signal(b_pid, "-CONT");
                let took = wait_for("the standby in sync again", Duration::from_secs(60), || {
                    in_sync("1")
                });
                println!(
                    "catch-up of {} objects: in sync again {took:?} after SIGCONT",
                    next.get()
                );
            }
        }
    }
    support::header();
    support::row("put+ship", "4KiB", &with);
    support::row("put", "4KiB", &without);
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (mw, mo) = (median(&mut p50_with), median(&mut p50_without));
    println!(
        "median of the rounds' p50: {mw:.1} us with a following standby, {mo:.1} us without \
         ({:.2}x)",
        mw / mo
    );
    drop(a);
}
