//! The NVMe tier against fio on the same file system, in the same run:
//! 1 MiB sequential writes and reads, 4 KiB random reads, through
//! `kvpool_storage::nvme::NvmeShard` (one region on one glommio executor,
//! several operations in flight), and fio with ioengine=io_uring, direct=1
//! at the same block size, queue depth and amount of work.
//!
//! The two sides alternate in rounds (ours and fio, each measure, each
//! round; for the 1 MiB measures who goes first swaps every round, and each
//! write and each read starts on a settled disk) and the ratio is taken per
//! round, then the median over rounds: the shared VM disk's speed drifts by
//! a factor of two or three within a minute, so only measurements taken
//! seconds apart compare.
//!
//! Both sides' I/O buffers are physically contiguous: ours because this
//! bench puts glommio's DMA pool on transparent huge pages ([`HugePool`]),
//! fio's with `--iomem=shmhuge` (when the kernel has huge pages reserved:
//! `sysctl vm.nr_hugepages=16`; without, fio uses malloc and the bench says
//! so). On a virtio disk without indirect descriptors a request takes one
//! ring slot per contiguous piece of its buffer, so a 1 MiB buffer in 256
//! scattered pages fills the ring alone: with one side's buffers scattered
//! and the other's not, the two compare page allocators, not I/O paths
//! (docs/benchmarks/nvme-tier.md, "What the 1 MiB figures measure").
//!
//!     cargo bench --bench nvme           # full run
//!     cargo test --release --bench nvme  # small run (part of the suite)

mod support;

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::rc::Rc;
use std::time::Instant;

use kvpool_storage::nvme::{NvmeConfig, NvmeLoc, NvmeShard};
use support::{header, row, Lat};

/// Value bytes of a "4 KiB" object: with its 64-byte header and a 16-byte
/// key it is exactly one 4 KiB block on the device (what fio reads).
const SMALL: usize = 4096 - 64 - 16;

/// Allocations this large or larger (glommio's DMA pool, `io_memory`, is
/// one) are mapped on their own and advised for transparent huge pages.
const HUGE_ALLOC_MIN: usize = 16 << 20;
const HUGE_PAGE: usize = 2 << 20;
/// Free huge pages fio needs for `--iomem=shmhuge` (8 x 1 MiB in flight,
/// plus alignment).
const FIO_HUGE_PAGES: u64 = 8;

/// The bench's allocator: the system's, except that a large allocation
/// (glommio's DMA pool) is a mapping of its own, 2 MiB aligned and advised
/// for transparent huge pages, so the buffers our reads and writes use are
/// physically contiguous, as fio's are with `--iomem=shmhuge`. Without it
/// the pool is whatever the page allocator hands out: seen here, 1-10
/// pieces per MiB in some processes and 256 (every page apart) in others,
/// and 2-3 GB/s against 0.4-0.8 GB/s for the same reads on this VM's disk.
struct HugePool;

// SAFETY: small or over-aligned layouts go to `System` unchanged; a large
// one gets a fresh private mapping of at least its size, aligned to 2 MiB
// (more than it asks for), which `dealloc` unmaps with the same length.
unsafe impl GlobalAlloc for HugePool {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        use rustix::mm::{madvise, mmap_anonymous, munmap, Advice, MapFlags, ProtFlags};
        if layout.size() < HUGE_ALLOC_MIN || layout.align() > HUGE_PAGE {
            return unsafe { System.alloc(layout) };
        }
        let len = layout.size().next_multiple_of(HUGE_PAGE);
        // One huge page more than needed, so that an aligned start lies
        // inside; what is left over on either side is unmapped again.
        let Ok(p) = (unsafe {
            mmap_anonymous(
                std::ptr::null_mut(),
                len + HUGE_PAGE,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::PRIVATE,
            )
        }) else {
            return std::ptr::null_mut();
        };
        let start = (p as usize).next_multiple_of(HUGE_PAGE);
        let head = start - p as usize;
        unsafe {
            if head > 0 {
                let _ = munmap(p, head);
            }
            let _ = munmap((start + len) as *mut _, HUGE_PAGE - head);
            // Advice only: without THP the pool is what it would have been.
            let _ = madvise(start as *mut _, len, Advice::LinuxHugepage);
        }
        start as *mut u8
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if layout.size() < HUGE_ALLOC_MIN || layout.align() > HUGE_PAGE {
            return unsafe { System.dealloc(ptr, layout) };
        }
        let len = layout.size().next_multiple_of(HUGE_PAGE);
        let _ = unsafe { rustix::mm::munmap(ptr.cast(), len) };
    }
}

#[global_allocator]
static ALLOC: HugePool = HugePool;

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
    /// fio's `--iomem`: "shmhuge" or "malloc".
    fio_iomem: &'static str,
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
        let iomem = plan.fio_iomem;
        if fio(&seq, "write", "1M", seq_file, 8, None, iomem).is_none() {
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
        fio(&fio_rand, "write", "1M", rand_bytes, 8, None, iomem);
        println!("I/O buffers: {}", buffers(&seq, iomem).await);

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
                    settle();
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
                    let fw = fio(&seq, "write", "1M", seq_bytes, 8, None, iomem);
                    settle();
                    let fr = fio(&seq, "read", "1M", seq_bytes, 8, None, iomem);
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
                iomem,
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

/// Lets the disk settle before a measure: the guest's dirty data goes out,
/// and a pause lets the host write back what it buffered.
fn settle() {
    rustix::fs::sync();
    std::thread::sleep(std::time::Duration::from_secs(1));
}

/// fio with io_uring and O_DIRECT over `bytes` of `file`, `ios` operations
/// if given, its buffers in `iomem`; (bytes/s, IOPS) of the job, None
/// without fio.
fn fio(
    file: &Path,
    rw: &str,
    bs: &str,
    bytes: u64,
    qd: u32,
    ios: Option<usize>,
    iomem: &str,
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
        &format!("--iomem={iomem}"),
        "--output-format=json",
    ]);
    if let Some(n) = ios {
        c.arg(format!("--number_ios={n}"));
    }
    let out = c.output().ok()?;
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(&out.stdout) else {
        let err = String::from_utf8_lossy(&out.stderr);
        println!("fio {rw} failed: {}", err.lines().next().unwrap_or(""));
        return None;
    };
    let job = &v["jobs"][0];
    let side = if rw.contains("write") {
        "write"
    } else {
        "read"
    };
    Some((job[side]["bw_bytes"].as_f64()?, job[side]["iops"].as_f64()?))
}

/// fio's buffer memory: huge pages when the kernel has enough free ones
/// (physically contiguous, like our pool), else malloc.
fn fio_iomem() -> &'static str {
    let free = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("HugePages_Free:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .unwrap_or(0);
    if free >= FIO_HUGE_PAGES {
        "shmhuge"
    } else {
        "malloc"
    }
}

/// Physically contiguous pieces in `len` bytes at `ptr` (on a virtio disk
/// without indirect descriptors, the ring slots a request for that buffer
/// takes), from /proc/self/pagemap; None where frame numbers are hidden
/// (not root). Assumes 4 KiB pages.
fn phys_pieces(ptr: *const u8, len: usize) -> Option<usize> {
    use std::os::unix::fs::FileExt;
    let pagemap = std::fs::File::open("/proc/self/pagemap").ok()?;
    let first = ptr as usize / 4096;
    let pages = (ptr as usize + len).div_ceil(4096) - first;
    let mut raw = vec![0u8; pages * 8];
    pagemap.read_exact_at(&mut raw, first as u64 * 8).ok()?;
    let pfn: Vec<u64> = raw
        .chunks(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")) & ((1 << 55) - 1))
        .collect();
    if pfn.contains(&0) {
        return None;
    }
    Some(1 + pfn.windows(2).filter(|w| w[1] != w[0] + 1).count())
}

/// What both sides' 1 MiB I/O buffers are made of: ours sampled from
/// glommio's pool (eight buffers the size of a read), fio's by its option.
async fn buffers(file: &Path, fio_iomem: &str) -> String {
    let f = glommio::io::DmaFile::open(file).await.expect("open");
    let bufs: Vec<_> = (0..8)
        .map(|_| f.alloc_dma_buffer((1 << 20) + 4096))
        .collect();
    let pieces: Option<Vec<usize>> = bufs
        .iter()
        .map(|b| phys_pieces(b.as_ptr(), b.len()))
        .collect();
    let ours = match pieces {
        Some(p) => format!(
            "ours: a 1 MiB read buffer in at most {} physically contiguous piece(s) (8 sampled)",
            p.iter().max().unwrap_or(&0)
        ),
        None => "ours on THP (contiguity not visible without root)".into(),
    };
    let theirs = if fio_iomem == "shmhuge" {
        "fio --iomem=shmhuge (huge pages)".into()
    } else {
        format!(
            "fio --iomem={fio_iomem}: NOT huge pages (fewer than {FIO_HUGE_PAGES} free), so its \
             1 MiB figures may be at one request at a time on a disk like this one"
        )
    };
    let _ = f.close().await;
    format!("{ours}; {theirs}")
}

/// The disk under `dir`: how many pieces one request may have, and whether
/// (virtio) a request's pieces each take a ring slot.
fn disk(dir: &Path) -> String {
    use std::os::unix::fs::MetadataExt;
    let Ok(m) = std::fs::metadata(dir) else {
        return "unknown".into();
    };
    let dev = m.dev();
    let mut sys = PathBuf::from(format!(
        "/sys/dev/block/{}:{}",
        rustix::fs::major(dev),
        rustix::fs::minor(dev)
    ));
    if sys.join("partition").exists() {
        sys = sys.join("..");
    }
    let name = std::fs::canonicalize(&sys)
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "?".into());
    let read = |f: &str| {
        std::fs::read_to_string(sys.join(f))
            .map(|s| s.trim().to_string())
            .unwrap_or_default()
    };
    let mut s = format!(
        "{name}, up to {} pieces per request",
        read("queue/max_segments")
    );
    // A virtio device's negotiated features, one character per bit; bit 28
    // is VIRTIO_RING_F_INDIRECT_DESC.
    match read("device/features").as_bytes().get(28) {
        Some(b'1') => s += ", virtio with indirect descriptors",
        Some(_) => {
            s += ", virtio without indirect descriptors (each piece of a request takes a ring slot)"
        }
        None => {}
    }
    s
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
    println!("disk: {}", disk(&dir));
    let have_fio = Command::new("fio").arg("--version").output().is_ok();
    if !have_fio {
        println!("skip: reference fio not found (apt-get install fio); our side only");
    }
    let plan = if full {
        Plan {
            // Even: each side writes first in half the rounds.
            rounds: 6,
            fio_iomem: fio_iomem(),
            seq_objects: 512,
            small_objects: 200_000,
            rand_reads: 100_000,
        }
    } else {
        Plan {
            rounds: 1,
            fio_iomem: fio_iomem(),
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
