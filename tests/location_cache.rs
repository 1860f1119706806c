//! Repeated gets in one round trip: a client remembers where an object lies
//! while its read lease lasts and reads the node at once. Counted at the
//! master (`/metrics`), never other bytes, forgotten when this client removes
//! or rewrites the key, and not used without checksums.

use crate::common;

use std::time::Duration;

use common::value;
use kvpool_client::Client;
use kvpool_config::ClientConfig;
use kvpool_wire::ErrorCode;

/// A single-process pool whose read leases last `lease_ms`.
fn pool(name: &str, lease_ms: u64) -> (common::Proc, std::path::PathBuf) {
    let d = common::scratch_dir(name);
    let cfg = common::write_config(
        &d,
        "pool.toml",
        &format!("[master]\nlease_ttl_ms = {lease_ms}\n"),
    );
    let mut args = vec!["--config", cfg.as_str(), "--segment-size", "64MiB"];
    args.extend(common::ephemeral(&[]));
    let node = common::start("all", &args);
    (node, d)
}

/// How many `GetReplicaList` calls the master has answered.
fn lookups(http: &str) -> u64 {
    calls(http, "get_replica_list")
}

/// How many calls of kind `op` the master's shards have answered.
fn calls(http: &str, op: &str) -> u64 {
    let (status, body) = common::http(http, "GET", "/metrics");
    assert_eq!(status, 200);
    let label = format!("\"{op}\"");
    body.lines()
        .filter(|l| l.starts_with("kvpool_master_calls_total{") && l.contains(&label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

fn client_cfg() -> ClientConfig {
    ClientConfig {
        ping_interval_ms: 0,
        ..Default::default()
    }
}

#[test]
fn a_repeated_get_within_the_lease_does_not_ask_the_master() {
    let (node, d) = pool("locations-repeat", 2_000);
    let rt = common::rt();
    rt.block_on(async {
        let c = Client::connect(&node.addr, client_cfg()).await.unwrap();
        let v = value(1, 4096);
        c.put(b"hot", &v).await.unwrap();
        let before = lookups(&node.http);
        assert_eq!(c.get(b"hot").await.unwrap(), v);
        assert_eq!(lookups(&node.http), before + 1, "the first get asks");
        for _ in 0..5 {
            assert_eq!(c.get(b"hot").await.unwrap(), v);
        }
        let mut buf = vec![0u8; 8192];
        assert_eq!(c.get_into(b"hot", &mut buf).await.unwrap(), 4096);
        assert_eq!(&buf[..4096], &v[..]);
        assert_eq!(
            lookups(&node.http),
            before + 1,
            "repeats read the node only"
        );
        assert_eq!(c.location_hits(), 6);
        // Past the lease the client asks again (and renews what it knows).
        tokio::time::sleep(Duration::from_millis(2_000)).await;
        assert_eq!(c.get(b"hot").await.unwrap(), v);
        assert_eq!(lookups(&node.http), before + 2);
        assert_eq!(c.get(b"hot").await.unwrap(), v);
        assert_eq!(lookups(&node.http), before + 2);
    });
    drop(node);
    let _ = std::fs::remove_dir_all(d);
}

/// Batch gets follow the get protocol: what a client remembers is read
/// from its node at once, only the other keys are asked for (one
/// `BatchGet`), and a read through an entry that no longer fits (another
/// client replaced the value by a shorter one) forgets it and asks again.
#[test]
fn a_batch_get_reads_what_it_remembers_and_asks_only_for_the_rest() {
    let (node, d) = pool("locations-batch", 10_000);
    let rt = common::rt();
    rt.block_on(async {
        let c = Client::connect(&node.addr, client_cfg()).await.unwrap();
        let other = Client::connect(&node.addr, client_cfg()).await.unwrap();
        let keys: Vec<Vec<u8>> = (0..4).map(|i| format!("batch-{i}").into_bytes()).collect();
        let ks: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
        for (i, k) in ks.iter().enumerate() {
            c.put(k, &value(i as u64, 4096)).await.unwrap();
        }
        let asked = || calls(&node.http, "batch_get");
        let before = asked();
        let check = |got: Vec<Result<Vec<u8>, kvpool_wire::KvError>>| {
            for (i, g) in got.into_iter().enumerate() {
                assert_eq!(g.unwrap(), value(i as u64, 4096), "batch-{i}");
            }
        };
        check(c.batch_get(&ks).await.unwrap());
        let first = asked();
        assert!(first > before, "the first batch asks the master");
        assert_eq!(c.location_hits(), 0);
        // Again, and into buffers: every key read from its node at once.
        check(c.batch_get(&ks).await.unwrap());
        let mut bufs = vec![vec![0u8; 8192]; 4];
        let mut items: Vec<(&[u8], &mut [u8])> = ks
            .iter()
            .copied()
            .zip(bufs.iter_mut().map(|b| &mut b[..]))
            .collect();
        let lens = c.batch_get_into(&mut items).await.unwrap();
        drop(items);
        for (i, len) in lens.into_iter().enumerate() {
            assert_eq!(len.unwrap(), 4096);
            assert_eq!(&bufs[i][..4096], &value(i as u64, 4096)[..], "batch-{i}");
        }
        assert_eq!(asked(), first, "repeats read the nodes only");
        assert_eq!(c.location_hits(), 8);
        // A fifth key, not remembered, beside a remembered one: asked alone.
        c.put(b"batch-4", &value(4, 4096)).await.unwrap();
        let got = c
            .batch_get(&[&b"batch-1"[..], &b"batch-4"[..]])
            .await
            .unwrap();
        assert_eq!(got[0].as_ref().unwrap(), &value(1, 4096));
        assert_eq!(got[1].as_ref().unwrap(), &value(4, 4096));
        let second = asked();
        assert!(second > first, "the key not remembered is asked for");
        assert_eq!(c.location_hits(), 9);
        // Another client replaces batch-0 by a shorter value: c's entry
        // (4096 bytes) does not fit a 3000-byte buffer, so c forgets it and
        // asks again, and reads the new value; batch-2 still comes from its
        // node.
        other.remove_with(b"batch-0", true).await.unwrap();
        other.put(b"batch-0", &value(9, 2048)).await.unwrap();
        let (mut small, mut big) = (vec![0u8; 3000], vec![0u8; 8192]);
        let mut items: Vec<(&[u8], &mut [u8])> = vec![
            (&b"batch-0"[..], &mut small[..]),
            (&b"batch-2"[..], &mut big[..]),
        ];
        let lens = c.batch_get_into(&mut items).await.unwrap();
        drop(items);
        assert_eq!(lens[0].as_ref().unwrap(), &2048);
        assert_eq!(&small[..2048], &value(9, 2048)[..], "the new value");
        assert_eq!(lens[1].as_ref().unwrap(), &4096);
        assert_eq!(&big[..4096], &value(2, 4096)[..]);
        assert!(asked() > second, "the stale entry's key is asked again");
        assert_eq!(c.location_hits(), 10);
    });
    drop(node);
    let _ = std::fs::remove_dir_all(d);
}

#[test]
fn a_key_this_client_removed_or_rewrote_is_asked_for_again() {
    let (node, d) = pool("locations-own-writes", 10_000);
    let rt = common::rt();
    rt.block_on(async {
        let c = Client::connect(&node.addr, client_cfg()).await.unwrap();
        c.put(b"k", &value(1, 5000)).await.unwrap();
        assert_eq!(c.get(b"k").await.unwrap(), value(1, 5000));
        c.remove_with(b"k", true).await.unwrap();
        let e = c.get(b"k").await.unwrap_err();
        assert_eq!(e.code, ErrorCode::ObjectNotFound, "{e}");
        c.put(b"k", &value(2, 3000)).await.unwrap();
        assert_eq!(
            c.get(b"k").await.unwrap(),
            value(2, 3000),
            "its own new value"
        );
        c.batch_remove(&[b"k"], true).await.unwrap()[0]
            .clone()
            .unwrap();
        c.put(b"k", &value(3, 700)).await.unwrap();
        assert_eq!(c.get(b"k").await.unwrap(), value(3, 700));
        // remove_all keeps leased objects (this one is), but the client
        // cannot know which went: it forgets every location.
        let before = lookups(&node.http);
        c.remove_all().await.unwrap();
        assert_eq!(c.get(b"k").await.unwrap(), value(3, 700));
        assert_eq!(lookups(&node.http), before + 1, "asked after remove_all");
    });
    drop(node);
    let _ = std::fs::remove_dir_all(d);
}

#[test]
fn another_clients_rewrite_never_yields_other_bytes() {
    let (node, d) = pool("locations-other-writer", 1_500);
    let rt = common::rt();
    rt.block_on(async {
        let a = Client::connect(&node.addr, client_cfg()).await.unwrap();
        let b = Client::connect(&node.addr, client_cfg()).await.unwrap();
        a.put(b"shared", &value(1, 9000)).await.unwrap();
        assert_eq!(a.get(b"shared").await.unwrap(), value(1, 9000));
        // b replaces the value; many other puts follow, which would reuse
        // the old space if the lease did not hold it.
        b.remove_with(b"shared", true).await.unwrap();
        b.put(b"shared", &value(2, 9000)).await.unwrap();
        for i in 0..200u64 {
            b.put(format!("filler-{i}").as_bytes(), &value(100 + i, 9000))
                .await
                .unwrap();
        }
        // Within a's lease: the value a read (the lease kept its bytes), or
        // the new one; never anything else.
        let got = a.get(b"shared").await.unwrap();
        assert!(
            got == value(1, 9000) || got == value(2, 9000),
            "a get returned bytes that were never put under this key"
        );
        // After the lease: the new value.
        tokio::time::sleep(Duration::from_millis(1_600)).await;
        assert_eq!(a.get(b"shared").await.unwrap(), value(2, 9000));
    });
    drop(node);
    let _ = std::fs::remove_dir_all(d);
}

#[test]
fn without_checksums_every_get_asks_the_master() {
    let (node, d) = pool("locations-no-sums", 10_000);
    let rt = common::rt();
    rt.block_on(async {
        let c = Client::connect(
            &node.addr,
            ClientConfig {
                checksums: false,
                ..client_cfg()
            },
        )
        .await
        .unwrap();
        c.put(b"plain", &value(1, 4096)).await.unwrap();
        let before = lookups(&node.http);
        for _ in 0..3 {
            assert_eq!(c.get(b"plain").await.unwrap(), value(1, 4096));
        }
        assert_eq!(lookups(&node.http), before + 3);
        assert_eq!(c.location_hits(), 0);
    });
    drop(node);
    let _ = std::fs::remove_dir_all(d);
}
