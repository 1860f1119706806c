//! The NVMe tier on a real file (O_DIRECT, io_uring through glommio): round
//! trips, eviction, recovery after a clean close and after kill -9,
//! corruption detected by checksum.

use std::future::Future;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvpool_storage::nvme::{Eviction, NvmeConfig, NvmeError, NvmeLoc, NvmeShard, Space, BLOCK};
use xxhash_rust::xxh3::xxh3_64;

/// Runs `f` on a fresh glommio executor (the tier lives on shards).
fn on_shard<F, Fut, T>(f: F) -> T
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = T> + 'static,
    T: Send + 'static,
{
    glommio::LocalExecutorBuilder::new(glommio::Placement::Unbound)
        .spawn(f)
        .expect("executor")
        .join()
        .expect("join")
}

/// A file on a real file system (O_DIRECT does not work on tmpfs).
fn file(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("nvme-tests");
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(format!("{name}-{}.kvnv", std::process::id()));
    let _ = std::fs::remove_file(&p);
    p
}

fn value(i: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|j| (xxh3_64(&(i * 1_000_003 + j as u64).to_le_bytes()) & 0xff) as u8)
        .collect()
}

fn cfg(capacity: u64) -> NvmeConfig {
    NvmeConfig {
        capacity,
        regions: 2,
        avg_object_bytes: 16 << 10,
        ..Default::default()
    }
}

#[test]
fn odd_sizes_round_trip_byte_for_byte() {
    let path = file("odd");
    on_shard(move || async move {
        let (t, rec) = NvmeShard::open(&path, cfg(64 << 20), 0).await.unwrap();
        assert!(rec.is_empty());
        let sizes = [1usize, 4095, 4096, 4097, (1 << 20) + 1, 16 << 20];
        let mut locs = Vec::new();
        for (i, &n) in sizes.iter().enumerate() {
            let v = value(i as u64, n);
            locs.push((t.write(format!("k{i}").as_bytes(), &v).await.unwrap(), v));
        }
        for (loc, v) in &locs {
            let got = t.read(*loc).await.unwrap();
            assert_eq!(got.len(), v.len());
            assert!(*got == **v, "{} bytes", v.len());
        }
        assert_eq!(t.lookup(b"k3"), Some(locs[3].0));
        assert!(t.write(b"k3", b"again").await.is_err(), "one copy per key");
        let _ = std::fs::remove_file(&path);
    });
}

/// A tier file made ahead as a sparse file (`truncate -s`, as operators
/// size one) reads back: a hole at block zero must not make glommio take
/// the file system for one that polls (every read then fails with
/// EOPNOTSUPP). Found by tests/faults.rs's full-disk test.
#[test]
fn a_tier_file_made_ahead_as_a_sparse_file_reads_back() {
    let path = file("sparse-ahead");
    std::fs::File::create(&path)
        .unwrap()
        .set_len(64 << 20)
        .unwrap();
    on_shard(move || async move {
        let (t, rec) = NvmeShard::open(&path, cfg(64 << 20), 0).await.unwrap();
        assert!(rec.is_empty());
        for (i, n) in [4096usize, (1 << 20) + 1].into_iter().enumerate() {
            let v = value(i as u64, n);
            let loc = t.write(format!("k{i}").as_bytes(), &v).await.unwrap();
            let got = t
                .read(loc)
                .await
                .unwrap_or_else(|e| panic!("{n} bytes from a sparse tier file: {e}"));
            assert!(*got == *v, "{n} bytes");
        }
        let _ = std::fs::remove_file(&path);
    });
}

/// The tier's eviction order (which the cluster simulation runs on its
/// own copies): FIFO by write; LRU by last read, a copy never read with the
/// first read one; ties by place.
#[test]
fn eviction_orders_copies_by_their_write_or_their_last_read() {
    // (place, write sequence number, read clock at the last read)
    let copies = [(3u32, 5, 0), (1, 9, 4), (2, 7, 2), (0, 6, 0)];
    assert_eq!(Eviction::Fifo.order(copies), vec![3, 0, 2, 1]);
    assert_eq!(Eviction::Lru.order(copies), vec![0, 3, 2, 1]);
}

/// How much the tier evicts (which the cluster simulation runs on its own
/// tiers): past the high watermark down to the low one, evicting copies
/// counted as gone; a wanted extent that does not fit; a full slot table;
/// victims taken in order until their extents cover it.
#[test]
fn eviction_frees_down_to_the_low_watermark_or_what_a_write_needs() {
    let c = NvmeConfig {
        high_watermark: 0.8,
        low_watermark: 0.5,
        ..NvmeConfig::default()
    };
    let space = |used, evicting, largest_free, short_of_slots| Space {
        used,
        capacity: 1000,
        evicting,
        largest_free,
        short_of_slots,
    };
    assert_eq!(c.bytes_to_evict(space(800, 0, 200, false), 0), 0, "at high");
    assert_eq!(c.bytes_to_evict(space(900, 0, 100, false), 0), 400);
    assert_eq!(c.bytes_to_evict(space(900, 300, 100, false), 0), 100);
    assert_eq!(c.bytes_to_evict(space(900, 500, 100, false), 0), 0);
    // Under the high watermark: only what a write of `need` bytes lacks.
    assert_eq!(c.bytes_to_evict(space(600, 0, 100, false), 0), 0);
    assert_eq!(c.bytes_to_evict(space(600, 0, 100, false), 300), 300);
    assert_eq!(c.bytes_to_evict(space(600, 0, 400, false), 300), 0);
    // No slot free: down to the low watermark, and one copy at least.
    assert_eq!(c.bytes_to_evict(space(600, 0, 400, true), 0), 100);
    assert_eq!(c.bytes_to_evict(space(300, 0, 700, true), 0), 1);
    // (place, write sequence number, last read, extent)
    let copies = [
        (3u32, 5, 0, 100),
        (1, 9, 4, 300),
        (2, 7, 2, 200),
        (0, 6, 0, 50),
    ];
    assert_eq!(Eviction::Fifo.victims(copies, 0), Vec::<u32>::new());
    assert_eq!(Eviction::Fifo.victims(copies, 100), vec![3]);
    assert_eq!(Eviction::Fifo.victims(copies, 101), vec![3, 0]);
    assert_eq!(Eviction::Lru.victims(copies, 200), vec![0, 3, 2]);
    assert_eq!(Eviction::Lru.victims(copies, 10_000), vec![0, 3, 2, 1]);
}

#[test]
fn eviction_marks_victims_unreadable_and_release_frees_their_space() {
    let path = file("evict");
    on_shard(move || async move {
        let c = NvmeConfig {
            eviction: Eviction::Fifo,
            high_watermark: 0.8,
            low_watermark: 0.5,
            ..cfg(8 << 20)
        };
        let (t, _) = NvmeShard::open(&path, c, 1).await.unwrap();
        let (_, cap) = t.usage();
        let n = (cap / (64 << 10)) as usize;
        let mut locs = Vec::new();
        let mut i = 0;
        while t.fits(8, 60 << 10) {
            locs.push(
                t.write(format!("obj-{i:03}").as_bytes(), &value(i, 60 << 10))
                    .await
                    .unwrap(),
            );
            i += 1;
        }
        assert!(locs.len() >= n / 2, "filled: {} objects", locs.len());
        let victims = t.evict_candidates(0);
        assert!(!victims.is_empty(), "past the high watermark");
        // FIFO: the oldest writes go first.
        assert_eq!(victims[0].key, b"obj-000");
        for v in &victims {
            assert!(
                matches!(t.read(v.loc).await, Err(NvmeError::NotFound(_))),
                "{:?} unreadable",
                v.key
            );
            assert_eq!(t.lookup(&v.key), None);
        }
        // An eviction the master was not told of is taken back: the
        // copies read again and are the next eviction's candidates again.
        for v in &victims {
            assert!(t.keep(v.loc));
            assert!(!t.keep(v.loc), "marked once");
        }
        for v in &victims {
            assert_eq!(t.lookup(&v.key), Some(v.loc));
            assert!(t.read(v.loc).await.is_ok(), "{:?} readable again", v.key);
        }
        let again = t.evict_candidates(0);
        assert_eq!(again, victims, "the same victims, marked again");
        let (used_before, _) = t.usage();
        for v in &victims {
            t.release(v.loc, v.seq).await.unwrap();
        }
        let (used_after, cap) = t.usage();
        assert!(used_after < used_before);
        assert!((used_after as f64) <= 0.5 * cap as f64 + (64 << 10) as f64);
        // The space is reused, and survivors still read back.
        let l = t.write(b"new", &value(999, 60 << 10)).await.unwrap();
        assert!(*t.read(l).await.unwrap() == *value(999, 60 << 10));
        let last = *locs.last().unwrap();
        assert!(*t.read(last).await.unwrap() == *value(i - 1, 60 << 10));
        let _ = std::fs::remove_file(&path);
    });
}

/// Two removals of one copy at once, the second asked while the first's
/// tombstone is on its way to the file: one removes it, the other finds
/// nothing to remove. Both going ahead would write two tombstones and free
/// the slot twice; a copy written into the slot between the two frees
/// would lose its record, or its space, to the second.
#[test]
fn two_removals_of_one_copy_at_once_remove_it_once() {
    let path = file("remove-twice");
    on_shard(move || async move {
        let (t, _) = NvmeShard::open(&path, cfg(64 << 20), 0).await.unwrap();
        let t = std::rc::Rc::new(t);
        let loc = t.write(b"a", &value(1, 3000)).await.unwrap();
        let (used, _) = t.usage();
        let removals: Vec<_> = (0..2)
            .map(|_| {
                let t = t.clone();
                glommio::spawn_local(async move { t.remove(loc).await })
            })
            .collect();
        let mut done = Vec::new();
        for r in removals {
            done.push(r.await);
        }
        assert!(done[0].is_ok(), "the first removal: {:?}", done[0]);
        assert!(
            matches!(done[1], Err(NvmeError::NotFound(_))),
            "the second finds the removal under way: {:?}",
            done[1]
        );
        assert_eq!(t.objects(), 0);
        // The space was freed once: a new copy takes the slot and reads back.
        assert!(t.usage().0 < used);
        let b = t.write(b"b", &value(2, 3000)).await.unwrap();
        assert_eq!(b, loc, "the freed slot is reused");
        assert!(*t.read(b).await.unwrap() == *value(2, 3000));
        let _ = std::fs::remove_file(&path);
    });
}

/// A removal by write number (a stale copy the control lane drops, a
/// Drop, a release) asked while another removal of that copy is under way
/// waits for it: the copy is gone after, removed once, and the waiting
/// removal takes nothing else; had the first failed, it would try itself.
/// A write of the key waits the same way, then finds the key free.
#[test]
fn a_removal_by_write_number_waits_for_one_under_way_and_takes_nothing_else() {
    let path = file("remove-wait");
    on_shard(move || async move {
        let (t, _) = NvmeShard::open(&path, cfg(64 << 20), 0).await.unwrap();
        let t = std::rc::Rc::new(t);
        let loc = t.write(b"a", &value(1, 3000)).await.unwrap();
        let seq = t.copy_seq(loc).unwrap();
        let first = {
            let t = t.clone();
            glommio::spawn_local(async move { t.remove(loc).await })
        };
        let waiting = {
            let t = t.clone();
            glommio::spawn_local(async move { t.remove_copy(loc, seq).await })
        };
        let rewrite = {
            let t = t.clone();
            glommio::spawn_local(async move {
                t.key_settled(b"a").await.unwrap();
                assert_eq!(
                    t.lookup(b"a"),
                    None,
                    "the key's copy is gone, not half-gone"
                );
                t.write(b"a", &value(2, 3000)).await
            })
        };
        first.await.unwrap();
        assert!(!waiting.await.unwrap(), "removed by the first, not again");
        let again = rewrite.await.unwrap();
        assert_eq!(t.objects(), 1);
        assert!(*t.read(again).await.unwrap() == *value(2, 3000));
        let _ = std::fs::remove_file(&path);
    });
}

/// A removal dropped at its tombstone's write (its task cancelled, as at
/// an executor's end) leaves the copy as it was: removable again, and the
/// tombstone out of the table image, so a later flush does not put it on
/// the device and a restart finds the copy.
#[test]
fn a_removal_dropped_at_its_write_leaves_the_copy_as_it_was() {
    let path = file("remove-dropped");
    let p2 = path.clone();
    on_shard(move || async move {
        let (t, _) = NvmeShard::open(&p2, cfg(64 << 20), 0).await.unwrap();
        let t = std::rc::Rc::new(t);
        let a = t.write(b"a", &value(1, 3000)).await.unwrap();
        t.flush().await.unwrap();
        let removal = {
            let t = t.clone();
            glommio::spawn_local(async move { t.remove(a).await })
        };
        // The removal runs until its tombstone's write waits on the file.
        glommio::executor().yield_task_queue_now().await;
        assert!(t.being_removed(a), "the removal is at its write");
        assert!(removal.cancel().await.is_none(), "dropped before it ended");
        assert!(!t.being_removed(a), "removable again");
        assert_eq!(t.lookup(b"a"), Some(a));
        t.flush().await.unwrap();
    });
    on_shard(move || async move {
        let (t, rec) = NvmeShard::open(&path, cfg(64 << 20), 0).await.unwrap();
        assert_eq!(rec.len(), 1, "the copy is still on the device: {rec:?}");
        assert!(*t.read(rec[0].loc).await.unwrap() == *value(1, 3000));
        let _ = std::fs::remove_file(&path);
    });
}

/// The number after the last '-' of a test key.
fn key_number(key: &[u8]) -> u64 {
    std::str::from_utf8(key)
        .unwrap()
        .rsplit('-')
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

#[test]
fn a_clean_restart_recovers_everything_and_removed_objects_stay_removed() {
    let path = file("restart");
    let p2 = path.clone();
    let path2 = path.clone();
    on_shard(move || async move {
        for region in 0..2 {
            let (t, _) = NvmeShard::open(&p2, cfg(64 << 20), region).await.unwrap();
            for i in 0..20 {
                t.write(
                    format!("r{region}-{i}").as_bytes(),
                    &value(i, 10_000 + i as usize),
                )
                .await
                .unwrap();
            }
            let gone = t.lookup(format!("r{region}-7").as_bytes()).unwrap();
            t.remove(gone).await.unwrap();
            t.flush().await.unwrap();
        }
    });
    on_shard(move || async move {
        for region in 0..2 {
            let (t, rec) = NvmeShard::open(&path, cfg(64 << 20), region).await.unwrap();
            assert_eq!(rec.len(), 19, "region {region}");
            assert!(!rec
                .iter()
                .any(|r| r.key == format!("r{region}-7").into_bytes()));
            for r in &rec {
                let i = key_number(&r.key);
                assert_eq!(r.len, 10_000 + i);
                assert!(*t.read(r.loc).await.unwrap() == *value(i, 10_000 + i as usize));
            }
            // New objects after the restart take free slots only: none of
            // the recovered ones is overwritten.
            for i in 100..120 {
                t.write(format!("r{region}-{i}").as_bytes(), &value(i, 3000))
                    .await
                    .unwrap();
            }
            t.flush().await.unwrap();
            for r in &rec {
                assert!(
                    t.lookup(&r.key) == Some(r.loc),
                    "recovered object moved or lost"
                );
            }
        }
    });
    on_shard(move || async move {
        for region in 0..2 {
            let (t, rec) = NvmeShard::open(&path2, cfg(64 << 20), region)
                .await
                .unwrap();
            assert_eq!(rec.len(), 39, "region {region}: 19 old and 20 new");
            for r in &rec {
                let i = key_number(&r.key);
                let want = if i >= 100 {
                    value(i, 3000)
                } else {
                    value(i, 10_000 + i as usize)
                };
                assert!(*t.read(r.loc).await.unwrap() == *want);
            }
        }
        let _ = std::fs::remove_file(&path2);
    });
}

/// A write returns before its index record is on the device; the record
/// follows by itself, without a flush, and a restart then finds the object.
#[test]
fn index_records_reach_the_device_in_the_background() {
    let path = file("background-commit");
    let p2 = path.clone();
    on_shard(move || async move {
        let (t, _) = NvmeShard::open(&p2, cfg(64 << 20), 0).await.unwrap();
        for i in 0..10u64 {
            let loc = t
                .write(format!("b-{i}").as_bytes(), &value(i, 20_000))
                .await
                .unwrap();
            // Readable at once.
            assert!(*t.read(loc).await.unwrap() == *value(i, 20_000));
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while t.unflushed_blocks() > 0 {
            assert!(
                Instant::now() < deadline,
                "index records never reached the device"
            );
            glommio::timer::sleep(Duration::from_millis(1)).await;
        }
    });
    on_shard(move || async move {
        let (t, rec) = NvmeShard::open(&path, cfg(64 << 20), 0).await.unwrap();
        assert_eq!(rec.len(), 10);
        for r in &rec {
            let i = key_number(&r.key);
            assert!(*t.read(r.loc).await.unwrap() == *value(i, 20_000));
        }
        let _ = std::fs::remove_file(&path);
    });
}

#[test]
fn a_file_formatted_with_another_layout_is_refused_not_overwritten() {
    let path = file("layout");
    let p2 = path.clone();
    on_shard(move || async move {
        let (t, _) = NvmeShard::open(&p2, cfg(64 << 20), 0).await.unwrap();
        t.write(b"keep", b"me").await.unwrap();
        t.flush().await.unwrap();
    });
    on_shard(move || async move {
        let other = NvmeConfig {
            regions: 4,
            ..cfg(64 << 20)
        };
        let e = NvmeShard::open(&path, other, 0)
            .await
            .err()
            .expect("refused");
        assert!(e.to_string().contains("another layout"), "{e}");
        let (_, rec) = NvmeShard::open(&path, cfg(64 << 20), 0).await.unwrap();
        assert_eq!(rec.len(), 1, "the data survived the refused open");
        let _ = std::fs::remove_file(&path);
    });
}

/// Where the test writes object `i` of the crash test.
/// Records of one table block are written by one image (group commit):
/// 64 writes and 16 removals in flight at once, their records sharing
/// blocks, must all be on the device after a flush.
#[test]
fn concurrent_writes_and_removals_sharing_table_blocks_all_reach_the_index() {
    let path = file("group-commit");
    let p2 = path.clone();
    on_shard(move || async move {
        let (t, _) = NvmeShard::open(&p2, cfg(64 << 20), 0).await.unwrap();
        let t = std::rc::Rc::new(t);
        // 16 objects to remove later, written one by one.
        for i in 0..16u64 {
            t.write(format!("old-{i}").as_bytes(), &value(i, 3000))
                .await
                .unwrap();
        }
        let mut tasks = Vec::new();
        for i in 0..64u64 {
            let t = t.clone();
            tasks.push(glommio::spawn_local(async move {
                t.write(
                    format!("new-{i}").as_bytes(),
                    &value(100 + i, 5000 + i as usize),
                )
                .await
                .unwrap();
            }));
        }
        for i in 0..16u64 {
            let t = t.clone();
            tasks.push(glommio::spawn_local(async move {
                let loc = t.lookup(format!("old-{i}").as_bytes()).unwrap();
                t.remove(loc).await.unwrap();
            }));
        }
        for task in tasks {
            task.await;
        }
        t.flush().await.unwrap();
    });
    on_shard(move || async move {
        let (t, rec) = NvmeShard::open(&path, cfg(64 << 20), 0).await.unwrap();
        let mut keys: Vec<String> = rec
            .iter()
            .map(|r| String::from_utf8(r.key.clone()).unwrap())
            .collect();
        keys.sort();
        let mut want: Vec<String> = (0..64).map(|i| format!("new-{i}")).collect();
        want.sort();
        assert_eq!(
            keys, want,
            "exactly the 64 new objects, none of the removed"
        );
        for r in &rec {
            let i: u64 = String::from_utf8(r.key.clone()).unwrap()[4..]
                .parse()
                .unwrap();
            assert!(*t.read(r.loc).await.unwrap() == *value(100 + i, 5000 + i as usize));
        }
        let _ = std::fs::remove_file(&path);
    });
}

/// Small reads go through the tier's own io_uring ring with a bounded set
/// of registered buffers: a read dropped while in flight must give its
/// buffer back when the kernel is done with it, or the ring would run dry.
#[test]
fn small_reads_dropped_in_flight_give_their_buffers_back() {
    let path = file("dropped-reads");
    on_shard(move || async move {
        let (t, _) = NvmeShard::open(&path, cfg(16 << 20), 0).await.unwrap();
        let mut locs = Vec::new();
        for i in 0..8u64 {
            // 1-block and 3-block extents: both within the ring's slots.
            let len = if i % 2 == 0 { 1000 } else { 10_000 };
            locs.push((
                i,
                len,
                t.write(format!("k{i}").as_bytes(), &value(i, len))
                    .await
                    .unwrap(),
            ));
        }
        let done = glommio::timer::timeout(Duration::from_secs(20), async {
            // Far more dropped reads than the ring has buffers (64).
            for round in 0..400usize {
                let (_, _, loc) = locs[round % locs.len()];
                let mut read = Box::pin(t.read(loc));
                let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
                let _ = read.as_mut().poll(&mut cx);
                drop(read);
                if round % 50 == 0 {
                    glommio::timer::sleep(Duration::from_millis(5)).await;
                }
            }
            for _ in 0..4 {
                for &(i, len, loc) in &locs {
                    assert!(*t.read(loc).await.unwrap() == *value(i, len));
                }
            }
            Ok(())
        })
        .await;
        assert!(
            done.is_ok(),
            "reads after dropped ones hung: the ring ran out of buffers"
        );
        let _ = std::fs::remove_file(&path);
    });
}

fn crash_value(i: u64) -> Vec<u8> {
    value(i, 1000 + (i as usize * 7919) % 200_000)
}

/// Not a test of its own: the writer process of
/// `acknowledged_objects_survive_kill_9_and_nothing_else_reads_as_valid`, run
/// by that test (it re-executes this binary) with `KVPOOL_NVME_CRASH_FILE`
/// set. Without it, there is nothing to do.
#[test]
fn crash_test_writer_process() {
    let Ok(path) = std::env::var("KVPOOL_NVME_CRASH_FILE") else {
        return;
    };
    on_shard(move || async move {
        let (t, _) = NvmeShard::open(Path::new(&path), cfg(256 << 20), 0)
            .await
            .unwrap();
        for i in 0u64.. {
            let key = format!("crash-{i}");
            if t.write(key.as_bytes(), &crash_value(i)).await.is_err() {
                // Full: start over with removals so writes keep coming.
                if let Some(l) = t.lookup(format!("crash-{}", i.saturating_sub(100)).as_bytes()) {
                    let _ = t.remove(l).await;
                }
                continue;
            }
            // Acknowledged once its index record is on the device too.
            t.flush().await.unwrap();
            println!("ack {i}");
        }
    });
}

#[test]
fn acknowledged_objects_survive_kill_9_and_nothing_else_reads_as_valid() {
    let path = file("crash");
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "crash_test_writer_process",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("KVPOOL_NVME_CRASH_FILE", &path)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let out = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            if let Some(i) = line.strip_prefix("ack ") {
                if tx.send(i.parse::<u64>().unwrap()).is_err() {
                    break;
                }
            }
        }
    });
    let mut acked = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while acked.len() < 60 {
        let left = deadline.saturating_duration_since(Instant::now());
        acked.push(
            rx.recv_timeout(left)
                .expect("the writer acknowledges writes"),
        );
    }
    // Mid-stream: more writes are in flight when the kill lands.
    let pid = rustix::process::Pid::from_raw(child.id() as i32).unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::KILL).unwrap();
    child.wait().unwrap();
    while let Ok(i) = rx.try_recv() {
        acked.push(i);
    }
    on_shard(move || async move {
        let (t, rec) = NvmeShard::open(&path, cfg(256 << 20), 0).await.unwrap();
        let found: std::collections::HashMap<Vec<u8>, NvmeLoc> =
            rec.iter().map(|r| (r.key.clone(), r.loc)).collect();
        for i in &acked {
            let key = format!("crash-{i}").into_bytes();
            let loc = found
                .get(&key)
                .unwrap_or_else(|| panic!("acknowledged crash-{i} was lost"));
            assert!(
                *t.read(*loc).await.unwrap() == *crash_value(*i),
                "crash-{i}"
            );
        }
        // Anything else recovered (written but not yet acknowledged) is whole.
        for r in &rec {
            let i: u64 = String::from_utf8(r.key.clone()).unwrap()[6..]
                .parse()
                .unwrap();
            match t.read(r.loc).await {
                Ok(v) => assert!(
                    *v == *crash_value(i),
                    "recovered crash-{i} has the wrong bytes"
                ),
                Err(e) => panic!("recovered crash-{i} is listed but unreadable: {e}"),
            }
        }
        let _ = std::fs::remove_file(&path);
    });
}

#[test]
fn flipped_bytes_in_a_value_are_a_checksum_error_for_that_object_only() {
    let path = file("corrupt");
    let p2 = path.clone();
    let locs = on_shard(move || async move {
        let (t, _) = NvmeShard::open(&p2, cfg(64 << 20), 0).await.unwrap();
        let mut v = Vec::new();
        for i in 0..5u64 {
            v.push(
                t.write(format!("c{i}").as_bytes(), &value(i, 50_000))
                    .await
                    .unwrap(),
            );
        }
        t.flush().await.unwrap();
        v
    });
    // Find object c2's value on disk (its header names the key) and flip bytes.
    let mut bytes = std::fs::read(&path).unwrap();
    let hdr = bytes
        .windows(4 + 60 + 2)
        .position(|w| w[0..4] == *b"KVOB" && &w[64..66] == b"c2")
        .expect("c2's header");
    let at = hdr + BLOCK as usize + 1234;
    bytes[at] ^= 0xff;
    bytes[at + 1] ^= 0x55;
    std::fs::write(&path, &bytes).unwrap();
    // And a slot record of c4: the record fails its checksum at recovery.
    on_shard(move || async move {
        let (t, rec) = NvmeShard::open(&path, cfg(64 << 20), 0).await.unwrap();
        assert_eq!(rec.len(), 5);
        for (i, loc) in locs.iter().enumerate() {
            let r = t.read(*loc).await;
            if i == 2 {
                assert!(
                    matches!(r, Err(NvmeError::Corrupt { .. })),
                    "c2 must be Corrupt"
                );
            } else {
                assert!(*r.unwrap() == *value(i as u64, 50_000), "c{i} is intact");
            }
        }
        assert_eq!(t.stats.corrupt.get(), 1);
        drop(t);
        // Now damage c4's slot record in the table.
        let mut bytes = std::fs::read(&path).unwrap();
        let rec4 = BLOCK as usize + locs[4].slot as usize * 512;
        assert_eq!(&bytes[rec4..rec4 + 4], b"KVRC");
        bytes[rec4 + 20] ^= 0x01;
        std::fs::write(&path, &bytes).unwrap();
        let (t, rec) = NvmeShard::open(&path, cfg(64 << 20), 0).await.unwrap();
        assert_eq!(rec.len(), 4, "the damaged record is dropped, not trusted");
        assert!(!rec.iter().any(|r| r.key == b"c4"));
        assert!(*t.read(locs[0]).await.unwrap() == *value(0, 50_000));
        let _ = std::fs::remove_file(&path);
    });
}

/// A copy written with a version keeps it in its record and header: it is
/// reported at open after a restart, a removal naming another version leaves
/// the copy, and a header whose version disagrees with its record is dropped
/// at open as a torn header is. A plain write is version 0, as every copy of
/// a file written before versions were kept reads.
#[test]
fn a_copy_keeps_its_version_across_a_restart_and_a_header_that_disagrees_is_dropped() {
    let path = file("versions");
    let p2 = path.clone();
    on_shard(move || async move {
        let (t, _) = NvmeShard::open(&p2, cfg(64 << 20), 0).await.unwrap();
        let plain = t.write(b"v0", &value(0, 9_000)).await.unwrap();
        let seven = t.write_versioned(b"v7", &value(7, 9_000), 7).await.unwrap();
        let nine = t
            .write_versioned(b"v9", &value(9, 70_000), 9 << 32 | 3)
            .await
            .unwrap();
        assert_eq!(t.copy_version(plain), Some(0));
        assert_eq!(t.copy_version(seven), Some(7));
        assert_eq!(t.copy_version(nine), Some(9 << 32 | 3));
        // `remove_if` sees the slot's key and version (the node's Drop rule
        // decides on them).
        let at =
            |key: &'static [u8], version: u64| move |k: &[u8], v: u64| k == key && v == version;
        assert!(!t.remove_if(nine, at(b"v9", 9 << 32 | 2)).await.unwrap());
        assert!(!t.remove_if(nine, at(b"v7", 9 << 32 | 3)).await.unwrap());
        assert!(*t.read(nine).await.unwrap() == *value(9, 70_000));
        assert!(t.remove_if(nine, at(b"v9", 9 << 32 | 3)).await.unwrap());
        assert_eq!(t.copy_version(nine), None);
        t.flush().await.unwrap();
    });
    let p3 = path.clone();
    on_shard(move || async move {
        let (t, rec) = NvmeShard::open(&p3, cfg(64 << 20), 0).await.unwrap();
        let mut got: Vec<(Vec<u8>, u64)> = rec.iter().map(|r| (r.key.clone(), r.version)).collect();
        got.sort();
        assert_eq!(got, vec![(b"v0".to_vec(), 0), (b"v7".to_vec(), 7)]);
        let seven = rec.iter().find(|r| r.key == b"v7").unwrap();
        assert!(*t.read(seven.loc).await.unwrap() == *value(7, 9_000));
        assert_eq!(t.entries().len(), 2);
        assert!(t.entries().iter().any(|e| e.key == b"v7" && e.version == 7));
    });
    // The header's copy of v7's version no longer matches its record.
    let mut bytes = std::fs::read(&path).unwrap();
    let hdr = bytes
        .windows(64 + 2)
        .position(|w| w[0..4] == *b"KVOB" && &w[64..66] == b"v7")
        .expect("v7's header");
    assert_eq!(bytes[hdr + 40], 7, "the header holds the version at 40..48");
    bytes[hdr + 40] = 8;
    std::fs::write(&path, &bytes).unwrap();
    on_shard(move || async move {
        let (t, rec) = NvmeShard::open(&path, cfg(64 << 20), 0).await.unwrap();
        let keys: Vec<&[u8]> = rec.iter().map(|r| &r.key[..]).collect();
        assert_eq!(keys, vec![&b"v0"[..]], "v7's copy is dropped, v0 stays");
        assert!(*t.read(rec[0].loc).await.unwrap() == *value(0, 9_000));
        let _ = std::fs::remove_file(&path);
    });
}
