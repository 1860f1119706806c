//! The atomic replace (`Client::upsert`) through the real binary and the
//! real client: readers see the old value or the new one, byte for byte,
//! never a mix, never a miss, never an error; two writers replacing one key
//! at once both succeed, one after the other.

use crate::common;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::value;
use kvpool_client::Client;
use kvpool_config::ClientConfig;
use kvpool_wire::proto::{call, PutOptions};

/// A single-process pool whose read leases last `lease_ms`.
fn pool(name: &str, lease_ms: u64, segment: &str) -> (common::Proc, std::path::PathBuf) {
    let d = common::scratch_dir(name);
    let cfg = common::write_config(
        &d,
        "pool.toml",
        &format!("[master]\nlease_ttl_ms = {lease_ms}\n"),
    );
    let mut args = vec!["--config", cfg.as_str(), "--segment-size", segment];
    args.extend(common::ephemeral(&[]));
    (common::start("all", &args), d)
}

fn client_cfg() -> ClientConfig {
    ClientConfig {
        ping_interval_ms: 0,
        ..Default::default()
    }
}

/// How many master calls of `op` ended with `result` ("ok" or "error").
fn calls(http: &str, op: &str, result: &str) -> u64 {
    let (status, body) = common::http(http, "GET", "/metrics");
    assert_eq!(status, 200);
    body.lines()
        .filter(|l| l.starts_with("kvpool_master_calls_total{"))
        .filter(|l| l.contains(&format!("\"{op}\"")) && l.contains(&format!("\"{result}\"")))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

/// Lengths from a few bytes to 300 KB: the new value is never laid where
/// the old one was, and a mix of two would show. At least 8 bytes: `value`'s
/// first 8 bytes differ for every seed, so they name the value.
const LENGTHS: [usize; 5] = [9, 100, 4096, 65_543, 300_001];

/// Value number `i` of a run.
fn nth(i: u64) -> Vec<u8> {
    value(i, LENGTHS[i as usize % LENGTHS.len()])
}

/// Values `0..n` by their first 8 bytes.
struct Written(HashMap<[u8; 8], u64>);

impl Written {
    fn new(n: u64) -> Self {
        Self(
            (0..n)
                .map(|i| (value(i, 8).try_into().expect("8 bytes"), i))
                .collect(),
        )
    }

    /// Which value `got` is, byte for byte; `None` for bytes never written.
    fn which(&self, got: &[u8]) -> Option<u64> {
        let head: [u8; 8] = got.get(..8)?.try_into().ok()?;
        let i = *self.0.get(&head)?;
        (nth(i) == got).then_some(i)
    }
}

#[test]
fn readers_of_a_key_being_upserted_get_one_written_value_each_time() {
    // Short leases: remembered locations roll over, and the space of
    // replaced values is freed and handed out again, many times in a run.
    let (node, d) = pool("upsert-readers", 1_000, "64MiB");
    let rt = common::rt();
    const MAX_VALUES: u64 = 5_000;
    const RUN: Duration = Duration::from_secs(4);
    // At most one upsert per 4 ms: about 20 MB of replaced values a second
    // stay held by the readers' leases, within the key's shard's 32 MiB.
    const PACE: Duration = Duration::from_millis(4);
    let written = Arc::new(Written::new(MAX_VALUES));
    rt.block_on(async {
        let w = Client::connect(&node.addr, client_cfg()).await.unwrap();
        w.upsert(b"hot", &nth(0)).await.unwrap();
        let done = Arc::new(AtomicBool::new(false));
        // One reader asks the master every time; one remembers locations
        // under its lease (and so may read a value the writer has replaced
        // since, from where the lease keeps it).
        let mut readers = Vec::new();
        for remember in [false, true] {
            let cfg = ClientConfig {
                location_cache_entries: if remember { 65_536 } else { 0 },
                ..client_cfg()
            };
            let r = Client::connect(&node.addr, cfg).await.unwrap();
            let (written, done) = (written.clone(), done.clone());
            readers.push(tokio::spawn(async move {
                let (mut reads, mut last, mut seen) = (0u64, 0u64, 1u64);
                let end = Instant::now() + Duration::from_secs(60);
                while !done.load(Ordering::Acquire) {
                    assert!(Instant::now() < end, "the writer did not finish in 60 s");
                    let got = match r.get(b"hot").await {
                        Ok(v) => v,
                        Err(e) => panic!("read {reads} (remember={remember}): {e}"),
                    };
                    let Some(i) = written.which(&got) else {
                        panic!(
                            "read {reads} (remember={remember}) returned {} bytes that were \
                             never put",
                            got.len()
                        );
                    };
                    assert!(
                        i >= last,
                        "read {reads} (remember={remember}) went back from value {last} to \
                         value {i}"
                    );
                    seen += u64::from(i > last);
                    last = i;
                    reads += 1;
                    // A get from a remembered same-host location never
                    // waits: let the writer run.
                    tokio::task::yield_now().await;
                }
                (reads, seen, r.location_hits())
            }));
        }
        // One more holds views of the value in place (shared memory, valid
        // while its lease lasts) and checks, again and again until the view
        // expires, that the bytes under it stay the value it saw: the space
        // of a replaced value is not handed out while a lease on it lives.
        let viewer = {
            let r = Client::connect(&node.addr, client_cfg()).await.unwrap();
            let (written, done) = (written.clone(), done.clone());
            tokio::spawn(async move {
                let (mut views, mut checks) = (0u64, 0u64);
                while !done.load(Ordering::Acquire) {
                    let view = r.get_view(b"hot").await.expect("a view");
                    // SAFETY: only the pool writes this range, and under a
                    // lease it must not: that is what this test checks.
                    let bytes = unsafe { view.unchecked_bytes() }.expect("a live view");
                    let Some(i) = written.which(bytes) else {
                        panic!("view {views} shows bytes that were never put");
                    };
                    let want = nth(i);
                    while !done.load(Ordering::Acquire) {
                        // SAFETY: as above.
                        let Ok(now) = (unsafe { view.unchecked_bytes() }) else {
                            break;
                        }; // expired
                        assert!(
                            now == want.as_slice(),
                            "view {views} of value {i}: its bytes changed under its lease"
                        );
                        checks += 1;
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                    views += 1;
                }
                (views, checks)
            })
        };
        let started = Instant::now();
        let mut pace = tokio::time::interval(PACE);
        pace.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let (mut n, mut offsets, mut reused) = (1, HashSet::new(), 0u64);
        while n < MAX_VALUES && started.elapsed() < RUN {
            pace.tick().await;
            let v = nth(n);
            w.upsert(b"hot", &v)
                .await
                .unwrap_or_else(|e| panic!("upsert {n}: {e}"));
            // Where it landed (the admin view grants no lease).
            let at = w.describe(b"hot").await.unwrap().replicas[0].offset;
            reused += u64::from(!offsets.insert(at));
            // The writer reads its own write at once.
            if n % 50 == 0 {
                assert_eq!(w.get(b"hot").await.unwrap(), v, "after upsert {n}");
            }
            n += 1;
        }
        done.store(true, Ordering::Release);
        let mut stats = Vec::new();
        for r in readers {
            stats.push(r.await.expect("a reader panicked"));
        }
        let (asking, remembering) = (stats[0], stats[1]);
        let viewed = viewer.await.expect("the viewer panicked");
        println!(
            "{n} values, {reused} in space that held an earlier one; reads, values seen, \
             location hits: {asking:?} (asking), {remembering:?} (remembering); views, \
             checks: {viewed:?}"
        );
        assert!(
            viewed.0 >= 2,
            "views expired and were taken again: {viewed:?}"
        );
        assert!(reused > 0, "the run never reused a replaced value's space");
        assert!(
            asking.0 >= 20 && asking.1 >= 2,
            "the asking reader ran along: {asking:?}"
        );
        assert!(
            remembering.0 >= 20 && remembering.1 >= 2 && remembering.2 > 0,
            "the remembering reader read from where it remembered: {remembering:?}"
        );
        let last = nth(n - 1);
        assert_eq!(w.get(b"hot").await.unwrap(), last);
        let fresh = Client::connect(&node.addr, client_cfg()).await.unwrap();
        assert_eq!(fresh.get(b"hot").await.unwrap(), last);
        assert_eq!(fresh.stat().await.unwrap().keys, 1);
    });
    drop(node);
    let _ = std::fs::remove_dir_all(d);
}

#[test]
fn two_clients_upserting_one_key_at_once_both_succeed() {
    let (node, d) = pool("upsert-writers", 10_000, "64MiB");
    let rt = common::rt();
    rt.block_on(async {
        let a = Client::connect(&node.addr, client_cfg()).await.unwrap();
        let b = Client::connect(&node.addr, client_cfg()).await.unwrap();
        let of = |who: u64, i: u64| value(who * 1_000 + i, LENGTHS[i as usize % LENGTHS.len()]);
        let run = |c: Client, who: u64| async move {
            for i in 0..60u64 {
                c.upsert(b"contended", &of(who, i))
                    .await
                    .unwrap_or_else(|e| panic!("client {who}, upsert {i}: {e}"));
            }
        };
        tokio::join!(run(a.clone(), 1), run(b.clone(), 2));
        // The later end wins: one of the two last values, whole.
        let got = a.get(b"contended").await.unwrap();
        assert!(
            got == of(1, 59) || got == of(2, 59),
            "{} bytes that are neither writer's last value",
            got.len()
        );
        assert_eq!(b.get(b"contended").await.unwrap(), got);
        let c = Client::connect(&node.addr, client_cfg()).await.unwrap();
        assert_eq!(c.get(b"contended").await.unwrap(), got);
        assert_eq!(c.stat().await.unwrap().keys, 1);
    });
    drop(node);
    let _ = std::fs::remove_dir_all(d);
}

#[test]
fn an_upsert_that_meets_another_writers_put_waits_for_it_to_end() {
    let (node, d) = pool("upsert-waits", 10_000, "64MiB");
    let rt = common::rt();
    rt.block_on(async {
        let a = Client::connect(&node.addr, client_cfg()).await.unwrap();
        let b = Client::connect(&node.addr, client_cfg()).await.unwrap();
        a.put(b"k", &value(1, 5_000)).await.unwrap();
        // a starts a replace of its own and holds it open.
        a.call(call::PutStart {
            client_id: a.id(),
            key: b"k".to_vec(),
            len: 7_000,
            opts: PutOptions {
                replace: true,
                ..PutOptions::default()
            },
        })
        .await
        .unwrap();
        let refused = calls(&node.http, "put_start", "error");
        let upsert = tokio::spawn({
            let b = b.clone();
            async move { b.upsert(b"k", &value(2, 9_000)).await }
        });
        // b is told to try again (and does, while a's put lasts)...
        common::eventually(
            "b's upsert refused twice",
            Duration::from_secs(10),
            || async {
                assert!(
                    !upsert.is_finished(),
                    "b's upsert ended while a's put lasts"
                );
                calls(&node.http, "put_start", "error") >= refused + 2
            },
        )
        .await;
        // ...and readers still get the old value.
        assert_eq!(a.get(b"k").await.unwrap(), value(1, 5_000));
        // Once a's put is over, b's goes through.
        a.call(call::PutRevoke {
            client_id: a.id(),
            put_id: 0,
            key: b"k".to_vec(),
        })
        .await
        .unwrap();
        tokio::time::timeout(Duration::from_secs(10), upsert)
            .await
            .expect("b's upsert ended")
            .expect("b's task")
            .expect("b's upsert succeeded");
        assert_eq!(b.get(b"k").await.unwrap(), value(2, 9_000));
        let c = Client::connect(&node.addr, client_cfg()).await.unwrap();
        assert_eq!(c.get(b"k").await.unwrap(), value(2, 9_000));
    });
    drop(node);
    let _ = std::fs::remove_dir_all(d);
}

#[test]
fn a_plain_put_of_a_stored_key_is_refused_and_an_upsert_of_a_new_key_stores_it() {
    let (node, d) = pool("upsert-plain", 10_000, "64MiB");
    let rt = common::rt();
    rt.block_on(async {
        let c = Client::connect(&node.addr, client_cfg()).await.unwrap();
        c.upsert(b"new", &value(1, 300)).await.unwrap();
        assert_eq!(c.get(b"new").await.unwrap(), value(1, 300));
        let e = c.put(b"new", &value(2, 300)).await.unwrap_err();
        assert_eq!(e.code, kvpool_wire::ErrorCode::ObjectAlreadyExists);
        // Its own upsert is read back at once, though it remembers where
        // the old value lies (under a lease that still runs).
        c.upsert(b"new", &value(3, 301)).await.unwrap();
        assert_eq!(c.get(b"new").await.unwrap(), value(3, 301));
        // Batches carry the option too.
        let items: Vec<(&[u8], Vec<u8>)> = vec![(b"new", value(4, 10)), (b"other", value(5, 20))];
        let refs: Vec<(&[u8], &[u8])> = items.iter().map(|(k, v)| (*k, v.as_slice())).collect();
        let opts = PutOptions {
            replace: true,
            ..PutOptions::default()
        };
        for r in c.batch_put(&refs, &opts).await.unwrap() {
            r.unwrap();
        }
        assert_eq!(c.get(b"new").await.unwrap(), value(4, 10));
        assert_eq!(c.get(b"other").await.unwrap(), value(5, 20));
    });
    drop(node);
    let _ = std::fs::remove_dir_all(d);
}
