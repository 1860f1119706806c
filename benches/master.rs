//! Master metadata throughput and latency: PutStart+PutEnd, GetReplicaList and
//! Exist, (a) on the state machine alone, (b) in process through the `Master`
//! actor, (c) from this process to a `kvpool run --role master` over TCP;
//! single calls and batches of 32 and 128, with 1 and 2 shards; then the
//! master process's RSS per object at 1 M and 10 M objects; then the cost of
//! one put on the state machine while eviction runs, with 1 M and 10 M
//! objects in the pool, and the cost of each step of the off-path eviction
//! run between the puts as the live shard runs it.
//!
//!     cargo bench --bench master          # full run
//!     cargo test --release --bench master # small run (part of the suite)

mod support;

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpool_client::Client;
use kvpool_config::{ClientConfig, MasterConfig};
use kvpool_master::core::{EvictDrive, MasterCore};
use kvpool_master::state::EVICT_STEP_VICTIMS;
use kvpool_master::{call as master_call, Master, MasterArgs, MasterMsg};
use kvpool_runtime::metrics::MetricsRegistry;
use kvpool_runtime::{ShardPool, ShardPoolConfig, Shutdown};
use kvpool_wire::proto::{
    call, Endpoint, MasterRequest as Q, MasterResponse as A, PutItem, PutOptions, SegmentSpec,
};
use ractor::{Actor, ActorRef};
use support::Lat;

/// A segment that only exists as metadata: nothing is written to it.
fn fake_segment(name: &str) -> SegmentSpec {
    SegmentSpec {
        name: name.into(),
        size: 1 << 40,
        endpoint: Endpoint {
            host: "127.0.0.1".into(),
            port: 1,
            nr_shards: 1,
        },
        slice_bytes: 1 << 40,
        host_id: "bench".into(),
        tier: kvpool_wire::proto::Tier::Dram,
        nvme: None,
    }
}

fn master_cfg() -> MasterConfig {
    MasterConfig {
        listen: "127.0.0.1:0".into(),
        max_keys: 50_000_000,
        max_batch: 4096,
        ..Default::default()
    }
}

fn opts() -> PutOptions {
    PutOptions::default()
}

fn row(path: &str, op: &str, shards: usize, batch: usize, keys: u64, wall: Duration, l: &Lat) {
    println!(
        "{:<8} {:<12} {:>6} {:>5} {:>12.0} {:>10.1} {:>10.1} {:>10.1}",
        path,
        op,
        shards,
        batch,
        keys as f64 / wall.as_secs_f64(),
        l.us(0.5),
        l.us(0.99),
        l.us(0.999),
    );
}

fn header() {
    println!(
        "{:<8} {:<12} {:>6} {:>5} {:>12} {:>10} {:>10} {:>10}",
        "path", "op", "shards", "batch", "keys/s", "p50_us", "p99_us", "p99.9_us"
    );
}

/// Runs `tasks` concurrent loops of `calls` calls each; per-call latency.
async fn drive<F, Fut>(tasks: usize, calls: usize, f: F) -> (Lat, Duration)
where
    F: Fn(usize, usize) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send,
{
    let f = Arc::new(f);
    let started = Instant::now();
    let handles: Vec<_> = (0..tasks)
        .map(|t| {
            let f = f.clone();
            tokio::spawn(async move {
                let mut l = Lat::new();
                for i in 0..calls {
                    let s = Instant::now();
                    f(t, i).await;
                    l.record(s.elapsed(), 0);
                }
                l
            })
        })
        .collect();
    let mut all = Lat::new();
    for h in handles {
        all.h.add(&h.await.expect("task").h).expect("same bounds");
    }
    (all, started.elapsed())
}

fn key(prefix: &str, t: usize, i: usize) -> Vec<u8> {
    format!("{prefix}-{t}-{i:08}").into_bytes()
}

/// (a) The state machine alone, one thread: what one core can do.
fn bench_state_machine(n: usize) {
    let mut m = MasterCore::new(1, &master_cfg(), 1);
    m.call(
        Q::MountSegment {
            client_id: 1,
            spec: fake_segment("fake"),
        },
        0,
    )
    .expect("mount");
    let keys: Vec<Vec<u8>> = (0..n).map(|i| key("sm", 0, i)).collect();
    let mut l = Lat::new();
    let t = Instant::now();
    for k in &keys {
        let s = Instant::now();
        m.call(
            Q::PutStart {
                client_id: 2,
                key: k.clone(),
                len: 64,
                opts: opts(),
            },
            1,
        )
        .expect("put_start");
        m.call(
            Q::PutEnd {
                client_id: 2,
                put_id: 0,
                key: k.clone(),
                checksum: None,
            },
            1,
        )
        .expect("put_end");
        l.record(s.elapsed(), 0);
    }
    row("state", "put+end", 1, 1, n as u64, t.elapsed(), &l);
    for (op, get) in [("get", true), ("exist", false)] {
        let mut l = Lat::new();
        let t = Instant::now();
        for k in &keys {
            let s = Instant::now();
            let q = if get {
                Q::GetReplicaList { key: k.clone() }
            } else {
                Q::Exist { key: k.clone() }
            };
            m.call(q, 2).expect("call");
            l.record(s.elapsed(), 0);
        }
        row("state", op, 1, 1, n as u64, t.elapsed(), &l);
    }
}

/// (d) One put (PutStart + PutEnd) on the state machine with `n` objects
/// in a segment sized so that they fill it to the high watermark: every
/// further put runs with eviction going on (an episode frees
/// `eviction_ratio` of the segment whenever use crosses the watermark).
/// Between two puts one step of the off-path eviction runs, if one is owed,
/// as the live shard's eviction task runs one between requests. Reports
/// per-put and per-step latency over `puts` further puts, the longest stall
/// of the shard (a put or a step), and how many replicas went.
fn bench_evict(n: usize, puts: usize) {
    let cfg = master_cfg();
    let mut m = MasterCore::new(1, &cfg, 1);
    m.evict = EvictDrive::Manual;
    // 64-byte objects (the allocator's alignment): n of them are the high
    // watermark's share of the segment.
    let size = ((n as f64 * 64.0 / cfg.high_watermark).ceil() as u64).next_multiple_of(64);
    let mut spec = fake_segment("evict");
    spec.size = size;
    spec.slice_bytes = size;
    m.call(Q::MountSegment { client_id: 1, spec }, 0)
        .expect("mount");
    let put = |m: &mut MasterCore, k: &[u8], now: u64| {
        m.call(
            Q::PutStart {
                client_id: 2,
                key: k.to_vec(),
                len: 64,
                opts: opts(),
            },
            now,
        )
        .expect("put_start");
        m.call(
            Q::PutEnd {
                client_id: 2,
                put_id: 0,
                key: k.to_vec(),
                checksum: None,
            },
            now,
        )
        .expect("put_end");
    };
    // Time moves 1 ms per put, so every lease but the newest has ended.
    let mut now = 1_000u64;
    let fill = Instant::now();
    for i in 0..n {
        put(&mut m, &key("ev", 0, i), now);
        now += 1;
    }
    let fill = fill.elapsed();
    let evictions = |m: &MasterCore| m.shards[0].stat().evictions;
    let before = evictions(&m);
    let mut l = Lat::new();
    let mut steps = Lat::new();
    let mut in_puts = 0;
    let t = Instant::now();
    for i in 0..puts {
        let k = key("ev", 1, i);
        let e = evictions(&m);
        let s = Instant::now();
        put(&mut m, &k, now);
        l.record(s.elapsed(), 0);
        // Evictions inside the put: it found no room and evicted to fit.
        in_puts += evictions(&m) - e;
        if m.shards[0].evicting() {
            let s = Instant::now();
            m.evict_step(now, EVICT_STEP_VICTIMS);
            steps.record(s.elapsed(), 0);
        }
        now += 1;
    }
    let wall = t.elapsed();
    let evicted = evictions(&m) - before;
    let n_steps = steps.h.len();
    let stall = l.us(1.0).max(if n_steps > 0 { steps.us(1.0) } else { 0.0 });
    println!(
        "evict    objects {n:>9}  fill {:>6.1} s  puts {puts:>7}  evicted {evicted:>8} (in puts {in_puts})  put p50 {:>5.1} us  p99 {:>5.1} us  p99.9 {:>6.1} us  max {:>8.1} us  {:>9.0} puts/s",
        fill.as_secs_f64(),
        l.us(0.5),
        l.us(0.99),
        l.us(0.999),
        l.us(1.0),
        puts as f64 / wall.as_secs_f64(),
    );
    if n_steps > 0 {
        println!(
            "evict    objects {n:>9}  steps {n_steps:>7} of <= {EVICT_STEP_VICTIMS} victims  step p50 {:>5.1} us  p99 {:>5.1} us  p99.9 {:>6.1} us  max {:>8.1} us  longest stall {stall:>8.1} us",
            steps.us(0.5),
            steps.us(0.99),
            steps.us(0.999),
            steps.us(1.0),
        );
    }
}

/// (b) Through the actor API in this process.
fn bench_actor(shards: usize, n: usize, rt: &tokio::runtime::Runtime) {
    let pool = ShardPool::start(
        &ShardPoolConfig {
            shards,
            ..Default::default()
        },
        Shutdown::new(),
    )
    .expect("shards");
    rt.block_on(async {
        let (m, _) = Actor::spawn(
            None,
            Master,
            MasterArgs {
                key: None,
                shards: pool.handle(),
                config: master_cfg(),
                metrics: MetricsRegistry::new(),
            },
        )
        .await
        .expect("master");
        master_call(
            &m,
            call::MountSegment {
                client_id: 1,
                spec: fake_segment("fake"),
            },
        )
        .await
        .expect("mount");
        let tasks = 32;
        for batch in [1usize, 32, 128] {
            let calls = (n / tasks / batch).max(1);
            let keys = (tasks * calls * batch) as u64;
            let prefix: &'static str = Box::leak(format!("a{shards}-{batch}").into_boxed_str());
            let mm = m.clone();
            let (l, wall) = drive(tasks, calls, move |t, i| {
                actor_put(mm.clone(), prefix, batch, t, i)
            })
            .await;
            row("actor", "put+end", shards, batch, keys, wall, &l);
            let mm = m.clone();
            let (l, wall) = drive(tasks, calls, move |t, i| {
                actor_read(mm.clone(), prefix, batch, t, i, true)
            })
            .await;
            row("actor", "get", shards, batch, keys, wall, &l);
            let mm = m.clone();
            let (l, wall) = drive(tasks, calls, move |t, i| {
                actor_read(mm.clone(), prefix, batch, t, i, false)
            })
            .await;
            row("actor", "exist", shards, batch, keys, wall, &l);
        }
        m.stop(None);
    });
    pool.shutdown_and_join().expect("shutdown");
}

async fn actor_put(m: ActorRef<MasterMsg>, prefix: &'static str, batch: usize, t: usize, i: usize) {
    if batch == 1 {
        let k = key(prefix, t, i);
        master_call(
            &m,
            call::PutStart {
                client_id: 2,
                key: k.clone(),
                len: 64,
                opts: opts(),
            },
        )
        .await
        .expect("put_start");
        master_call(
            &m,
            call::PutEnd {
                client_id: 2,
                put_id: 0,
                key: k,
                checksum: None,
            },
        )
        .await
        .expect("put_end");
    } else {
        let keys: Vec<Vec<u8>> = (0..batch).map(|j| key(prefix, t, i * batch + j)).collect();
        let items = keys
            .iter()
            .map(|k| PutItem {
                key: k.clone(),
                len: 64,
            })
            .collect();
        master_call(
            &m,
            call::BatchPutStart {
                client_id: 2,
                items,
                opts: opts(),
            },
        )
        .await
        .expect("batch_put_start");
        master_call(
            &m,
            call::BatchPutEnd {
                client_id: 2,
                put_id: 0,
                items: done(keys),
            },
        )
        .await
        .expect("batch_put_end");
    }
}

async fn actor_read(
    m: ActorRef<MasterMsg>,
    prefix: &'static str,
    batch: usize,
    t: usize,
    i: usize,
    get: bool,
) {
    if batch == 1 {
        let k = key(prefix, t, i);
        if get {
            master_call(&m, call::GetReplicaList { key: k })
                .await
                .expect("get");
        } else {
            master_call(&m, call::Exist { key: k })
                .await
                .expect("exist");
        }
    } else {
        let keys: Vec<Vec<u8>> = (0..batch).map(|j| key(prefix, t, i * batch + j)).collect();
        if get {
            master_call(&m, call::BatchGet { keys })
                .await
                .expect("batch_get");
        } else {
            master_call(&m, call::BatchExist { keys })
                .await
                .expect("batch_exist");
        }
    }
}

/// (c) From this process to a master process over TCP.
fn bench_tcp(shards: usize, n: usize, rt: &tokio::runtime::Runtime) {
    let node = support::start(
        "master",
        &[
            "--listen",
            "127.0.0.1:0",
            "--http",
            "127.0.0.1:0",
            "--shards",
            &shards.to_string(),
        ],
    );
    rt.block_on(async {
        let c = Client::connect(
            &node.addr,
            ClientConfig {
                max_connections_per_endpoint: 64,
                ..Default::default()
            },
        )
        .await
        .expect("connect");
        c.mount_segment(fake_segment("fake")).await.expect("mount");
        let tasks = 32;
        for batch in [1usize, 32, 128] {
            let calls = (n / tasks / batch).max(1);
            let keys = (tasks * calls * batch) as u64;
            let prefix: &'static str = Box::leak(format!("t{shards}-{batch}").into_boxed_str());
            let cc = c.clone();
            let (l, wall) = drive(tasks, calls, move |t, i| {
                tcp_put(cc.clone(), prefix, batch, t, i)
            })
            .await;
            row("tcp", "put+end", shards, batch, keys, wall, &l);
            for (op, get) in [("get", true), ("exist", false)] {
                let cc = c.clone();
                let (l, wall) = drive(tasks, calls, move |t, i| {
                    tcp_read(cc.clone(), prefix, batch, t, i, get)
                })
                .await;
                row("tcp", op, shards, batch, keys, wall, &l);
            }
        }
    });
}

async fn tcp_put(c: Client, prefix: &'static str, batch: usize, t: usize, i: usize) {
    if batch == 1 {
        let k = key(prefix, t, i);
        c.request(Q::PutStart {
            client_id: c.id(),
            key: k.clone(),
            len: 64,
            opts: opts(),
        })
        .await
        .expect("put_start");
        c.request(Q::PutEnd {
            client_id: c.id(),
            put_id: 0,
            key: k,
            checksum: None,
        })
        .await
        .expect("put_end");
    } else {
        let keys: Vec<Vec<u8>> = (0..batch).map(|j| key(prefix, t, i * batch + j)).collect();
        let items = keys
            .iter()
            .map(|k| PutItem {
                key: k.clone(),
                len: 64,
            })
            .collect();
        c.request(Q::BatchPutStart {
            client_id: c.id(),
            items,
            opts: opts(),
        })
        .await
        .expect("batch_put_start");
        c.request(Q::BatchPutEnd {
            client_id: c.id(),
            put_id: 0,
            items: done(keys),
        })
        .await
        .expect("batch_put_end");
    }
}

async fn tcp_read(c: Client, prefix: &'static str, batch: usize, t: usize, i: usize, get: bool) {
    let q = if batch == 1 {
        let key = key(prefix, t, i);
        if get {
            Q::GetReplicaList { key }
        } else {
            Q::Exist { key }
        }
    } else {
        let keys: Vec<Vec<u8>> = (0..batch).map(|j| key(prefix, t, i * batch + j)).collect();
        if get {
            Q::BatchGet { keys }
        } else {
            Q::BatchExist { keys }
        }
    };
    c.request(q).await.expect("read");
}

fn rss_bytes(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    let kb: u64 = s
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .expect("VmRSS");
    kb * 1024
}

/// The master process's memory per object, at each count in `marks`.
fn bench_rss(marks: &[usize], rt: &tokio::runtime::Runtime) {
    let node = support::start(
        "master",
        &[
            "--listen",
            "127.0.0.1:0",
            "--http",
            "127.0.0.1:0",
            "--shards",
            "2",
        ],
    );
    let pid = node.child.id();
    rt.block_on(async {
        let c = Client::connect(
            &node.addr,
            ClientConfig {
                max_connections_per_endpoint: 16,
                timeout_ms: 60_000,
                ..Default::default()
            },
        )
        .await
        .expect("connect");
        c.mount_segment(fake_segment("fake")).await.expect("mount");
        let base = rss_bytes(pid);
        let key_len = key("rss", 0, 0).len();
        let mut have = 0usize;
        for &mark in marks {
            let batch = 1024;
            let tasks = 8;
            while have < mark {
                let todo = (mark - have).min(batch * tasks);
                let calls = todo.div_ceil(batch);
                let mut hs = Vec::new();
                for j in 0..calls {
                    let c = c.clone();
                    let from = have + j * batch;
                    let to = (from + batch).min(mark);
                    hs.push(tokio::spawn(async move {
                        let keys: Vec<Vec<u8>> = (from..to).map(|i| key("rss", 0, i)).collect();
                        let items = keys.iter().map(|k| PutItem { key: k.clone(), len: 64 }).collect();
                        c.request(Q::BatchPutStart {
                            client_id: c.id(),
                            items,
                            opts: opts(),
                        })
                        .await
                        .expect("batch_put_start");
                        let r = c
                            .request(Q::BatchPutEnd {
                                client_id: c.id(),
                                put_id: 0,
                                items: done(keys),
                            })
                            .await
                            .expect("batch_put_end");
                        assert!(matches!(r, A::BatchDone(_)));
                    }));
                }
                for h in hs {
                    h.await.expect("task");
                }
                have += todo;
            }
            let rss = rss_bytes(pid);
            let per = (rss.saturating_sub(base)) as f64 / mark as f64;
            println!(
                "master RSS at {mark:>9} objects: {:>7.1} MiB, {per:>6.1} bytes/object ({:.1} beyond the {key_len}-byte key)",
                rss as f64 / (1 << 20) as f64,
                per - key_len as f64
            );
        }
    });
}

pub fn main() {
    let full = support::full_mode();
    println!(
        "kvpool master bench ({} mode)",
        if full { "full" } else { "small" }
    );
    println!("machine: {}", support::machine());
    let scale = if full { 1 } else { 50 };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    // KVPOOL_BENCH_ONLY=state|actor|tcp|rss runs one part (for profiling).
    let only = std::env::var("KVPOOL_BENCH_ONLY").unwrap_or_default();
    let run = |part: &str| only.is_empty() || only == part;
    header();
    if run("state") {
        bench_state_machine(1_000_000 / scale);
    }
    if run("actor") {
        for shards in [1, 2] {
            bench_actor(shards, 256_000 / scale, &rt);
        }
    }
    if run("tcp") {
        for shards in [1, 2] {
            bench_tcp(shards, 256_000 / scale, &rt);
        }
    }
    if run("rss") {
        let marks: Vec<usize> = if full {
            vec![1_000_000, 10_000_000]
        } else {
            vec![20_000]
        };
        bench_rss(&marks, &rt);
    }
    if run("evict") {
        let marks: Vec<usize> = if full {
            vec![1_000_000, 10_000_000]
        } else {
            vec![20_000]
        };
        for n in marks {
            bench_evict(n, 4 * n / 10);
        }
    }
}

/// Keys as a `BatchPutEnd`'s items (no checksums: the bench measures the
/// master's metadata path alone).
fn done(keys: Vec<Vec<u8>>) -> Vec<kvpool_wire::proto::PutDone> {
    keys.into_iter()
        .map(|key| kvpool_wire::proto::PutDone {
            key,
            checksum: None,
        })
        .collect()
}
