//! The NVMe tier against fio on the same file system, in the same run:
//! 1 MiB sequential writes and reads, 4 KiB random reads, through
//! `kvpool_storage::nvme::NvmeShard` (one region on one glommio executor,
//! several operations in flight), then fio with ioengine=io_uring, direct=1
//! at the same block size and queue depth.
//!
//!     cargo bench --bench nvme           # full run
//!     cargo test --release --bench nvme  # small run (part of the suite)

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::rc::Rc;
use std::time::{Duration, Instant};

use kvpool_storage::nvme::{NvmeConfig, NvmeLoc, NvmeShard};
use support::{header, row, Lat};

/// Value bytes of a "4 KiB" object: with its 64-byte header and a 16-byte
/// key it is exactly one 4 KiB block on the device (what fio reads).
const SMALL: usize = 4096 - 64 - 16;

fn run<F, Fut, T>(f: F) -> T
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = T> + 'static,
    T: Send + 'static,
{
    glommio::LocalExecutorBuilder::new(glommio::Placement::Unbound)
        .io_memory(64 << 20)
        .spawn(f)
        .expect("executor")
        .join()
        .expect("join")
}

/// Runs `n` operations, `qd` at a time, on the current executor.
async fn concurrent<F, Fut>(n: usize, qd: usize, op: F) -> Lat
where
    F: Fn(usize) -> Fut + 'static,
    Fut: std::future::Future<Output = u64> + 'static,
{
    let op = Rc::new(op);
    let next = Rc::new(std::cell::Cell::new(0usize));
    let lat = Rc::new(std::cell::RefCell::new(Lat::new()));
    let started = Instant::now();
    let workers: Vec<_> = (0..qd)
        .map(|_| {
            let (op, next, lat) = (op.clone(), next.clone(), lat.clone());
            glommio::spawn_local(async move {
                loop {
                    let i = next.get();
                    if i >= n {
                        break;
                    }
                    next.set(i + 1);
                    let t = Instant::now();
                    let bytes = op(i).await;
                    lat.borrow_mut().record(t.elapsed(), bytes);
                }
            })
        })
        .collect();
    for w in workers {
        w.await;
    }
    let mut l = Rc::try_unwrap(lat).ok().expect("workers done").into_inner();
    // Throughput over wall time (operations overlap).
    l.busy = started.elapsed();
    l
}

fn key(i: usize) -> Vec<u8> {
    format!("bench-{i:010}").into_bytes()
}

struct Figures {
    seq_write_gbps: f64,
    seq_write_sync_gbps: f64,
    seq_read_gbps: f64,
    rand_read_iops: f64,
}

fn tier(path: &Path, total: u64, full: bool) -> Figures {
    let path = path.to_path_buf();
    run(move || async move {
        let n = (total >> 20) as usize;
        let mut f = Figures {
            seq_write_gbps: 0.0,
            seq_write_sync_gbps: 0.0,
            seq_read_gbps: 0.0,
            rand_read_iops: 0.0,
        };
        header();
        for sync in [false, true] {
            let p = path.with_extension(if sync { "sync" } else { "nosync" });
            let _ = std::fs::remove_file(&p);
            let cfg = NvmeConfig {
                capacity: total + total / 2,
                regions: 1,
                avg_object_bytes: 1 << 20,
                sync_writes: sync,
                ..Default::default()
            };
            let (t, _) = NvmeShard::open(&p, cfg, 0).await.expect("open tier");
            let t = Rc::new(t);
            let value = Rc::new(vec![0x5au8; 1 << 20]);
            let writes = if sync { n / 4 } else { n };
            let tw = t.clone();
            let v = value.clone();
            let w = concurrent(writes, 8, move |i| {
                let (t, v) = (tw.clone(), v.clone());
                async move {
                    t.write(&key(i), &v).await.expect("write");
                    1 << 20
                }
            })
            .await;
            row(if sync { "write-sync" } else { "write" }, "1MiB", &w);
            if sync {
                f.seq_write_sync_gbps = w.gbps();
            } else {
                f.seq_write_gbps = w.gbps();
                let locs: Rc<Vec<NvmeLoc>> =
                    Rc::new((0..n).map(|i| t.lookup(&key(i)).expect("stored")).collect());
                let tr = t.clone();
                let r = concurrent(n, 8, move |i| {
                    let (t, locs) = (tr.clone(), locs.clone());
                    async move { t.read(locs[i]).await.expect("read").len() as u64 }
                })
                .await;
                row("read", "1MiB", &r);
                f.seq_read_gbps = r.gbps();
            }
            drop(t);
            let _ = std::fs::remove_file(&p);
        }
        // Random 4 KiB reads over a set of one-block objects.
        let p = path.with_extension("small");
        let _ = std::fs::remove_file(&p);
        let count = if full { 200_000 } else { 5_000 };
        let cfg = NvmeConfig {
            capacity: (count as u64 * 4096) * 2 + (64 << 20),
            regions: 1,
            avg_object_bytes: 4096,
            sync_writes: false,
            ..Default::default()
        };
        let (t, _) = NvmeShard::open(&p, cfg, 0).await.expect("open tier");
        let t = Rc::new(t);
        let small = Rc::new(vec![7u8; SMALL]);
        let tw = t.clone();
        concurrent(count, 32, move |i| {
            let (t, v) = (tw.clone(), small.clone());
            async move {
                t.write(&key(i), &v).await.expect("write");
                0
            }
        })
        .await;
        let locs: Rc<Vec<NvmeLoc>> = Rc::new(
            (0..count)
                .map(|i| t.lookup(&key(i)).expect("stored"))
                .collect(),
        );
        let reads = if full { 400_000 } else { 10_000 };
        let tr = t.clone();
        let r = concurrent(reads, 32, move |i| {
            let (t, locs) = (tr.clone(), locs.clone());
            // A fixed pseudo-random walk over the objects.
            let j = (i.wrapping_mul(2_654_435_761) ^ (i >> 7)) % locs.len();
            async move { t.read(locs[j]).await.expect("read").len() as u64 }
        })
        .await;
        row("randread", "4KiB", &r);
        f.rand_read_iops = r.h.len() as f64 / r.busy.as_secs_f64();
        drop(t);
        let _ = std::fs::remove_file(&p);
        f
    })
}

/// fio with io_uring and O_DIRECT; (bytes/s, IOPS) of the job.
fn fio(
    file: &Path,
    rw: &str,
    bs: &str,
    size: &str,
    qd: u32,
    seconds: Option<u32>,
) -> Option<(f64, f64)> {
    let mut c = Command::new("fio");
    c.args([
        "--name=ref",
        &format!("--filename={}", file.display()),
        &format!("--rw={rw}"),
        &format!("--bs={bs}"),
        &format!("--size={size}"),
        "--ioengine=io_uring",
        "--direct=1",
        &format!("--iodepth={qd}"),
        "--numjobs=1",
        "--output-format=json",
    ]);
    if let Some(s) = seconds {
        c.args(["--time_based", &format!("--runtime={s}")]);
    }
    let out = c.output().ok()?;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
    let job = &v["jobs"][0];
    let side = if rw.contains("write") {
        "write"
    } else {
        "read"
    };
    Some((job[side]["bw_bytes"].as_f64()?, job[side]["iops"].as_f64()?))
}

fn main() {
    let full = support::full_mode();
    println!(
        "kvpool NVMe tier bench ({} mode)",
        if full { "full" } else { "small" }
    );
    println!("machine: {}", support::machine());
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("nvme-bench");
    std::fs::create_dir_all(&dir).expect("bench dir");
    let fs = Command::new("df")
        .args(["-T", dir.to_str().expect("utf-8")])
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| {
            s.lines()
                .nth(1)
                .map(|l| l.split_whitespace().take(2).collect::<Vec<_>>().join(" "))
        })
        .unwrap_or_default();
    println!("file system: {fs} ({})", dir.display());
    let total: u64 = if full { 1 << 30 } else { 64 << 20 };
    let ours = tier(&dir.join("tier"), total, full);

    let f = dir.join("fio.dat");
    let size = format!("{}M", total >> 20);
    let secs = if full { 10 } else { 2 };
    let w = fio(&f, "write", "1M", &size, 8, None);
    let r = fio(&f, "read", "1M", &size, 8, None);
    let rr = fio(&f, "randread", "4k", &size, 32, Some(secs));
    let _ = std::fs::remove_file(&f);
    match (w, r, rr) {
        (Some(w), Some(r), Some(rr)) => {
            println!(
                "reference fio io_uring direct=1: 1M write {:.2} GB/s, 1M read {:.2} GB/s, 4k randread {:.0} IOPS",
                w.0 / 1e9,
                r.0 / 1e9,
                rr.1
            );
            println!(
                "ratio to fio: seq write {:.2} (with fdatasync per object: {:.2}), seq read {:.2}, 4k randread IOPS {:.2}",
                ours.seq_write_gbps / (w.0 / 1e9),
                ours.seq_write_sync_gbps / (w.0 / 1e9),
                ours.seq_read_gbps / (r.0 / 1e9),
                ours.rand_read_iops / rr.1
            );
        }
        _ => println!("reference fio: not installed (apt install fio)"),
    }
    let _ = Duration::ZERO;
}
