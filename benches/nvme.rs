//! The NVMe tier against fio on the same file system, in the same run:
//! 1 MiB sequential writes and reads, 4 KiB random reads, through
//! `kvpool_storage::nvme::NvmeShard` (one region on one glommio executor,
//! several operations in flight), and fio with ioengine=io_uring, direct=1
//! at the same block size, queue depth and amount of work.
//!
//! The two sides alternate in rounds (ours and fio, each measure, each
//! round; for the 1 MiB measures who goes first swaps every round, and each
//! write starts on a settled disk) and the ratio is taken per round, then
//! the median over rounds: the shared VM disk's speed drifts by a factor of
//! two or three within a minute, so only measurements taken seconds apart
//! compare.
//!
//!     cargo bench --bench nvme           # full run
//!     cargo test --release --bench nvme  # small run (part of the suite)

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::rc::Rc;
use std::time::Instant;

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

/// CPU time of the calling thread, in seconds.
fn thread_cpu() -> f64 {
    let ts = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9
}

/// One round's figures: ours, then fio's.
#[derive(Default)]
struct Round {
    write: f64,
    write_sync: f64,
    read: f64,
    rand_iops: f64,
    rand_cpu_us: f64,
    fio_write: f64,
    fio_read: f64,
    fio_rand_iops: f64,
}

struct Plan {
    rounds: usize,
    /// 1 MiB objects written and read per round.
    seq_objects: usize,
    /// One-block objects in the random-read set.
    small_objects: usize,
    /// Random reads per round (fio does as many).
    rand_reads: usize,
}

/// Opens a tier on `path`; a file without a tier's superblock is formatted.
async fn open(path: &Path, capacity: u64, avg: u64, sync: bool) -> Rc<NvmeShard> {
    let cfg = NvmeConfig {
        capacity,
        regions: 1,
        avg_object_bytes: avg,
        sync_writes: sync,
        ..Default::default()
    };
    Rc::new(NvmeShard::open(path, cfg, 0).await.expect("open tier").0)
}

/// 1 MiB writes at queue depth 8, keys `0..n`; the time includes the
/// flush that puts the last index records on the device.
async fn write_seq(t: &Rc<NvmeShard>, n: usize) -> Lat {
    let value = Rc::new(vec![0x5au8; 1 << 20]);
    let tw = t.clone();
    let started = Instant::now();
    let mut l = concurrent(n, 8, move |i| {
        let (t, v) = (tw.clone(), value.clone());
        async move {
            t.write(&key(i), &v).await.expect("write");
            1 << 20
        }
    })
    .await;
    t.flush().await.expect("flush");
    l.busy = started.elapsed();
    l
}

/// Where keys `0..n` are stored.
fn locations(t: &NvmeShard, n: usize) -> Rc<Vec<NvmeLoc>> {
    Rc::new((0..n).map(|i| t.lookup(&key(i)).expect("stored")).collect())
}

/// All rounds, on one glommio executor; fio runs (blocking this thread,
/// with nothing of ours in flight) between our measures.
fn rounds(dir: &Path, plan: Plan) -> (Vec<Round>, [Lat; 4]) {
    let dir = dir.to_path_buf();
    run(move || async move {
        let mut out = Vec::new();
        let mut lats = [Lat::new(), Lat::new(), Lat::new(), Lat::new()];
        let seq_bytes = (plan.seq_objects as u64) << 20;
        // Both sides' 1 MiB measures use this one file, written through
        // once first: the disk is a file on the host, and blocks the host
        // has not allocated yet write slower than ones it has, so two files
        // (which ext4 may place on either) compare placements, not writers.
        let seq = dir.join("seq.dat");
        let seq_file = seq_bytes + seq_bytes / 2;
        let _ = std::fs::remove_file(&seq);
        if fio(&seq, "write", "1M", seq_file, 8, None).is_none() {
            // No fio: our side only, on a file of the same size.
            std::fs::File::create(&seq)
                .and_then(|f| f.set_len(seq_file))
                .expect("create the sequential file");
        }
        let fio_rand = dir.join("fio-rand.dat");
        let rand_bytes = plan.small_objects as u64 * 4096;

        // The random-read set, written once: ours as one-block objects,
        // fio's as a laid-out file of the same size.
        let _ = std::fs::remove_file(dir.join("tier.small"));
        let small = open(
            &dir.join("tier.small"),
            rand_bytes * 2 + (64 << 20),
            4096,
            false,
        )
        .await;
        let value = Rc::new(vec![7u8; SMALL]);
        let tw = small.clone();
        concurrent(plan.small_objects, 32, move |i| {
            let (t, v) = (tw.clone(), value.clone());
            async move {
                t.write(&key(i), &v).await.expect("write");
                0
            }
        })
        .await;
        let locs = locations(&small, plan.small_objects);
        let _ = std::fs::remove_file(&fio_rand);
        fio(&fio_rand, "write", "1M", rand_bytes, 8, None);

        for round in 0..plan.rounds {
            let mut r = Round::default();

            // 1 MiB sequential: a freshly formatted tier each round on the shared file.
            // Which side goes first alternates, and each write starts on a
            // settled disk: a write right after another one's 512 MiB pays
            // for the host flushing them (seen: 0.46 GB/s after, 1.5 before).
            for side in [round % 2, 1 - round % 2] {
                settle();
                if side == 0 {
                    let t = open(unformatted(&seq), seq_file, 1 << 20, false).await;
                    let w = write_seq(&t, plan.seq_objects).await;
                    r.write = w.gbps();
                    lats[0].add(&w);
                    let locs_seq = locations(&t, plan.seq_objects);
                    let tr = t.clone();
                    let rd = concurrent(plan.seq_objects, 8, move |i| {
                        let (t, locs) = (tr.clone(), locs_seq.clone());
                        async move { t.read(locs[i]).await.expect("read").len() as u64 }
                    })
                    .await;
                    r.read = rd.gbps();
                    lats[1].add(&rd);
                    drop(t);
                } else {
                    let fw = fio(&seq, "write", "1M", seq_bytes, 8, None);
                    let fr = fio(&seq, "read", "1M", seq_bytes, 8, None);
                    r.fio_write = fw.map_or(0.0, |f| f.0 / 1e9);
                    r.fio_read = fr.map_or(0.0, |f| f.0 / 1e9);
                }
            }

            // With an fdatasync per object (the tier's default); fio's
            // figure is its plain write.
            settle();
            let t = open(unformatted(&seq), seq_file, 1 << 20, true).await;
            let ws = write_seq(&t, (plan.seq_objects / 4).max(1)).await;
            r.write_sync = ws.gbps();
            lats[2].add(&ws);
            drop(t);

            // 4 KiB random reads, a different walk each round.
            let tr = small.clone();
            let l = locs.clone();
            let cpu0 = thread_cpu();
            let rr = concurrent(plan.rand_reads, 32, move |i| {
                let (t, locs) = (tr.clone(), l.clone());
                let i = i + round * plan.rand_reads;
                let j = (i.wrapping_mul(2_654_435_761) ^ (i >> 7)) % locs.len();
                async move { t.read(locs[j]).await.expect("read").len() as u64 }
            })
            .await;
            r.rand_cpu_us = (thread_cpu() - cpu0) * 1e6 / plan.rand_reads as f64;
            r.rand_iops = rr.h.len() as f64 / rr.busy.as_secs_f64();
            lats[3].add(&rr);
            let frr = fio(
                &fio_rand,
                "randread",
                "4k",
                rand_bytes,
                32,
                Some(plan.rand_reads),
            );
            r.fio_rand_iops = frr.map_or(0.0, |f| f.1);

            println!(
                "round {}: write {:.2}/{:.2} GB/s, read {:.2}/{:.2} GB/s, 4k randread {:.0}/{:.0} IOPS \
                 ({:.1} us CPU per read) (ours/fio)",
                round + 1,
                r.write,
                r.fio_write,
                r.read,
                r.fio_read,
                r.rand_iops,
                r.fio_rand_iops,
                r.rand_cpu_us
            );
            out.push(r);
        }
        drop(small);
        let _ = std::fs::remove_file(dir.join("tier.small"));
        let _ = std::fs::remove_file(&fio_rand);
        let _ = std::fs::remove_file(&seq);
        (out, lats)
    })
}

/// Zeroes the first block of `path` (a tier's superblock, or fio's data),
/// so the tier opened on it next formats it anew; returns `path`.
fn unformatted(path: &Path) -> &Path {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .expect("the shared file exists");
    f.write_all_at(&[0u8; 4096], 0).expect("zero block 0");
    f.sync_all().expect("sync");
    path
}

/// Lets the disk settle before a write measure: the guest's dirty data
/// goes out, and a pause lets the host write back what it buffered.
fn settle() {
    rustix::fs::sync();
    std::thread::sleep(std::time::Duration::from_secs(1));
}

/// fio with io_uring and O_DIRECT over `bytes` of `file`, `ios` operations
/// if given; (bytes/s, IOPS) of the job, None without fio.
fn fio(
    file: &Path,
    rw: &str,
    bs: &str,
    bytes: u64,
    qd: u32,
    ios: Option<usize>,
) -> Option<(f64, f64)> {
    let mut c = Command::new("fio");
    c.args([
        "--name=ref",
        &format!("--filename={}", file.display()),
        &format!("--rw={rw}"),
        &format!("--bs={bs}"),
        &format!("--size={bytes}"),
        "--ioengine=io_uring",
        "--direct=1",
        &format!("--iodepth={qd}"),
        "--numjobs=1",
        "--output-format=json",
    ]);
    if let Some(n) = ios {
        c.arg(format!("--number_ios={n}"));
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

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
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
    let have_fio = Command::new("fio").arg("--version").output().is_ok();
    if !have_fio {
        println!("reference fio: not installed (apt install fio); our side only");
    }
    let plan = if full {
        Plan {
            // Even: each side writes first in half the rounds.
            rounds: 6,
            seq_objects: 512,
            small_objects: 200_000,
            rand_reads: 100_000,
        }
    } else {
        Plan {
            rounds: 1,
            seq_objects: 64,
            small_objects: 5_000,
            rand_reads: 10_000,
        }
    };
    let n = plan.rounds;
    let (rounds, lats) = rounds(&dir, plan);
    header();
    for (name, size, l) in [
        ("write", "1MiB", &lats[0]),
        ("read", "1MiB", &lats[1]),
        ("write-sync", "1MiB", &lats[2]),
        ("randread", "4KiB", &lats[3]),
    ] {
        row(name, size, l);
    }
    let ratio = |f: fn(&Round) -> f64, g: fn(&Round) -> f64| {
        median(rounds.iter().map(|r| f(r) / g(r)).collect())
    };
    let med = |f: fn(&Round) -> f64| median(rounds.iter().map(f).collect());
    println!(
        "ours, median of {n} rounds: 1M write {:.2} GB/s (with fdatasync per object {:.2}), \
         1M read {:.2} GB/s, 4k randread {:.0} IOPS, {:.1} us CPU per random read",
        med(|r| r.write),
        med(|r| r.write_sync),
        med(|r| r.read),
        med(|r| r.rand_iops),
        med(|r| r.rand_cpu_us)
    );
    if have_fio
        && rounds
            .iter()
            .all(|r| r.fio_write > 0.0 && r.fio_rand_iops > 0.0)
    {
        println!(
            "reference fio io_uring direct=1, median of {n} rounds: 1M write {:.2} GB/s, \
             1M read {:.2} GB/s, 4k randread {:.0} IOPS",
            med(|r| r.fio_write),
            med(|r| r.fio_read),
            med(|r| r.fio_rand_iops)
        );
        println!(
            "ratio to fio, median of per-round ratios: seq write {:.2} (with fdatasync per \
             object: {:.2}), seq read {:.2}, 4k randread IOPS {:.2}",
            ratio(|r| r.write, |r| r.fio_write),
            ratio(|r| r.write_sync, |r| r.fio_write),
            ratio(|r| r.read, |r| r.fio_read),
            ratio(|r| r.rand_iops, |r| r.fio_rand_iops)
        );
    }
}
