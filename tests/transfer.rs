//! The transfer engine across processes: odd sizes over TCP and shared
//! memory, identical bytes either way, a peer killed mid-batch, back-pressure
//! past the in-flight bound, borrowed views under a lease.

use crate::common;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kvpool_client::Client;
use kvpool_config::{ClientConfig, Transport};
use kvpool_runtime::config::Bytes;
use kvpool_wire::ErrorCode;
use rand::{RngCore, SeedableRng};
use xxhash_rust::xxh3::xxh3_64;

const SLICE: u64 = 64 << 10;

fn cfg(transport: Transport) -> ClientConfig {
    ClientConfig {
        transport,
        tcp_slice_bytes: Bytes(SLICE),
        lanes: 4,
        timeout_ms: 60_000,
        ..Default::default()
    }
}

fn data(seed: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    rand::rngs::StdRng::seed_from_u64(seed).fill_bytes(&mut v);
    v
}

#[test]
fn odd_sizes_round_trip_over_tcp_and_shm_with_identical_bytes() {
    // 5 GiB: two shards' ranges of 2.5 GiB each hold two 1 GiB objects even
    // while the first one's space waits for its lease after removal.
    let node = common::start("all", &common::ephemeral(&["--segment-size", "5GiB"]));
    let rt = common::rt();
    rt.block_on(async {
        let tcp = Client::connect(&node.addr, cfg(Transport::Tcp))
            .await
            .unwrap();
        let shm = Client::connect(&node.addr, cfg(Transport::Shm))
            .await
            .unwrap();
        let s = SLICE as usize;
        let sizes = [1, 2, s - 1, s, s + 1, 3 * s + 7, (4 << 20) + 1];
        for (i, &len) in sizes.iter().enumerate() {
            let v = data(i as u64, len);
            // Written over one transport, read over both.
            let (writer, name) = if i % 2 == 0 {
                (&tcp, "tcp")
            } else {
                (&shm, "shm")
            };
            let key = format!("odd-{len}");
            writer
                .put(key.as_bytes(), &v)
                .await
                .unwrap_or_else(|e| panic!("{name} put {len}: {e}"));
            for (reader, rname) in [(&tcp, "tcp"), (&shm, "shm")] {
                let got = reader.get(key.as_bytes()).await.unwrap();
                assert_eq!(got.len(), len, "{rname} read of {len} written by {name}");
                assert_eq!(
                    xxh3_64(&got),
                    xxh3_64(&v),
                    "{rname} read of {len} written by {name}"
                );
            }
        }
        assert!(tcp.engine().stats().tcp_bytes.load(Ordering::Relaxed) > 0);
        assert_eq!(tcp.engine().stats().shm_bytes.load(Ordering::Relaxed), 0);
        assert!(shm.engine().stats().shm_bytes.load(Ordering::Relaxed) > 0);
        assert_eq!(shm.engine().stats().tcp_bytes.load(Ordering::Relaxed), 0);

        // 1 GiB, both ways.
        let big = data(99, 1 << 30);
        let sum = xxh3_64(&big);
        tcp.put(b"one-gib", &big).await.unwrap();
        let mut back = vec![0u8; 1 << 30];
        assert_eq!(shm.get_into(b"one-gib", &mut back).await.unwrap(), 1 << 30);
        assert_eq!(xxh3_64(&back), sum, "1 GiB written over tcp, read over shm");
        back.fill(0);
        assert_eq!(tcp.get_into(b"one-gib", &mut back).await.unwrap(), 1 << 30);
        assert_eq!(xxh3_64(&back), sum, "1 GiB over tcp");
        tcp.remove_with(b"one-gib", true).await.unwrap();
        shm.put(b"one-gib-shm", &big).await.unwrap();
        back.fill(0);
        assert_eq!(
            tcp.get_into(b"one-gib-shm", &mut back).await.unwrap(),
            1 << 30
        );
        assert_eq!(xxh3_64(&back), sum, "1 GiB written over shm, read over tcp");
    });
}

#[test]
fn more_slices_than_the_in_flight_bound_wait_instead_of_piling_up() {
    let node = common::start("all", &common::ephemeral(&["--segment-size", "256MiB"]));
    let rt = common::rt();
    rt.block_on(async {
        let bound = 3;
        let c = Client::connect(
            &node.addr,
            ClientConfig {
                max_in_flight: bound,
                ..cfg(Transport::Tcp)
            },
        )
        .await
        .unwrap();
        let v = data(3, 1 << 20); // 16 slices of 64 KiB each
        let keys: Vec<String> = (0..48).map(|i| format!("bp{i}")).collect();
        let items: Vec<(&[u8], &[u8])> =
            keys.iter().map(|k| (k.as_bytes(), v.as_slice())).collect();
        for r in c.batch_put(&items, &Default::default()).await.unwrap() {
            r.unwrap();
        }
        let mut bufs: Vec<Vec<u8>> = (0..48).map(|_| vec![0u8; 1 << 20]).collect();
        let mut items: Vec<(&[u8], &mut [u8])> = keys
            .iter()
            .zip(bufs.iter_mut())
            .map(|(k, b)| (k.as_bytes(), b.as_mut_slice()))
            .collect();
        for r in c.batch_get_into(&mut items).await.unwrap() {
            assert_eq!(r.unwrap(), 1 << 20);
        }
        assert!(bufs.iter().all(|b| b == &v));
        let s = c.engine().stats();
        assert!(
            s.slices.load(Ordering::Relaxed) >= 2 * 48 * 16,
            "many slices went"
        );
        let peak = s.max_in_flight_seen.load(Ordering::Relaxed);
        assert!(
            peak <= bound,
            "peak in flight {peak} over the bound {bound}"
        );
        assert_eq!(s.in_flight.load(Ordering::Relaxed), 0);
    });
}

/// A batch call of more keys than a master takes in one request
/// (`master.max_batch`, 4,096 by default) goes to its shard in pieces: an
/// engine's chunks times layer groups of a long prompt are such a batch.
/// Before, 5,000 keys to a one-shard master were refused as a whole
/// ("a batch of 5000 keys exceeds master.max_batch"); and a master whose
/// `max_batch` is set below 4,096 refused every piece of 4,096 keys (the
/// client now cuts pieces by the bound the master's cluster map tells).
#[test]
fn a_batch_over_the_masters_bound_goes_in_pieces_and_every_key_answers_in_place() {
    let small = common::config_file("max-batch-1000", "[master]\nmax_batch = 1000\n");
    for config in [None, Some(small.as_str())] {
        let mut args = vec![
            "--listen",
            "127.0.0.1:0",
            "--http",
            "127.0.0.1:0",
            "--shards",
            "1",
            "--segment-size",
            "128MiB",
        ];
        if let Some(f) = config {
            args.extend(["--config", f]);
        }
        let node = common::start("all", &args);
        batch_of_5000_keys(&node.addr, config.is_some());
    }
}

/// A key given twice in one batch put: the first is stored, the second is
/// `ObjectAlreadyExists` (as the master refuses a second put of a key by
/// the writer putting it) and is never placed.
#[test]
fn a_key_given_twice_in_one_batch_put_is_stored_once_and_the_second_refused() {
    let node = common::start("all", &common::ephemeral(&["--segment-size", "64MiB"]));
    common::rt().block_on(async {
        let c = Client::connect(&node.addr, cfg(Transport::Tcp))
            .await
            .unwrap();
        let (a, b) = (data(1, 4096), data(2, 4096));
        let items: [(&[u8], &[u8]); 3] = [(b"twice", &a), (b"once", &b), (b"twice", &b)];
        let r = c.batch_put(&items, &Default::default()).await.unwrap();
        assert!(r[0].is_ok() && r[1].is_ok(), "{r:?}");
        let e = r[2].as_ref().unwrap_err();
        assert_eq!(e.code, ErrorCode::ObjectAlreadyExists, "{e}");
        assert!(c.get(b"twice").await.unwrap() == a, "the first value stays");
        assert!(c.get(b"once").await.unwrap() == b);
    });
}

/// Puts, finds and reads back 5,000 keys in one batch call each.
fn batch_of_5000_keys(master: &str, small: bool) {
    let rt = common::rt();
    rt.block_on(async {
        let c = Client::connect(master, cfg(Transport::Tcp)).await.unwrap();
        let n = 5_000;
        let keys: Vec<String> = (0..n).map(|i| format!("piece{i}")).collect();
        let values: Vec<Vec<u8>> = (0..n).map(|i| data(i as u64, 64)).collect();
        let items: Vec<(&[u8], &[u8])> = keys
            .iter()
            .zip(&values)
            .map(|(k, v)| (k.as_bytes(), v.as_slice()))
            .collect();
        for (i, r) in c
            .batch_put(&items, &Default::default())
            .await
            .unwrap()
            .into_iter()
            .enumerate()
        {
            r.unwrap_or_else(|e| panic!("put {i} (max_batch 1000: {small}): {e}"));
        }
        let refs: Vec<&[u8]> = keys.iter().map(|k| k.as_bytes()).collect();
        let found = c.batch_exists(&refs).await.unwrap();
        assert!(
            found.iter().all(|r| matches!(r, Ok(true))),
            "every key found (max_batch 1000: {small})"
        );
        let mut bufs: Vec<Vec<u8>> = (0..n).map(|_| vec![0u8; 64]).collect();
        let mut items: Vec<(&[u8], &mut [u8])> = keys
            .iter()
            .zip(bufs.iter_mut())
            .map(|(k, b)| (k.as_bytes(), b.as_mut_slice()))
            .collect();
        for r in c.batch_get_into(&mut items).await.unwrap() {
            assert_eq!(r.unwrap(), 64);
        }
        assert!(bufs == values, "every key read its own value");
    });
}

#[test]
fn a_borrowed_view_reads_in_place_until_its_lease_ends() {
    let dir = std::env::temp_dir().join(format!("kvpool-view-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("lease.toml");
    std::fs::write(&f, "[master]\nlease_ttl_ms = 1500\n").unwrap();
    let f = f.to_str().unwrap().to_string();
    let mut args = common::ephemeral(&["--segment-size", "64MiB"]);
    args.splice(0..0, ["--config", f.as_str()]);
    let node = common::start("all", &args);
    let rt = common::rt();
    rt.block_on(async {
        let c = Client::connect(&node.addr, cfg(Transport::Auto))
            .await
            .unwrap();
        let v = data(5, 300_000);
        c.put(b"viewed", &v).await.unwrap();
        let view = c.get_view(b"viewed").await.unwrap();
        assert_eq!(view.read().unwrap(), v, "the bytes, copied and checked");
        // Leased: removal is refused while the view is valid.
        assert_eq!(
            c.remove(b"viewed").await.unwrap_err().code,
            ErrorCode::ObjectHasLease
        );
        while Instant::now() < view.valid_until() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(view.read().unwrap_err().code, ErrorCode::Timeout);
    });
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn auto_uses_tcp_for_a_replica_on_another_host_and_shm_refuses_it() {
    let dir = std::env::temp_dir().join(format!("kvpool-remote-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("elsewhere.toml");
    std::fs::write(&f, "[storage]\nhost_id = \"some-other-host\"\n").unwrap();
    let f = f.to_str().unwrap().to_string();
    let mut args = common::ephemeral(&["--segment-size", "64MiB"]);
    args.splice(0..0, ["--config", f.as_str()]);
    let node = common::start("all", &args);
    let rt = common::rt();
    rt.block_on(async {
        let auto = Client::connect(&node.addr, cfg(Transport::Auto))
            .await
            .unwrap();
        auto.put(b"far", &[1u8; 1000]).await.unwrap();
        assert_eq!(auto.get(b"far").await.unwrap(), vec![1u8; 1000]);
        assert!(auto.engine().stats().tcp_bytes.load(Ordering::Relaxed) >= 2000);
        assert_eq!(auto.engine().stats().shm_bytes.load(Ordering::Relaxed), 0);
        let shm = Client::connect(&node.addr, cfg(Transport::Shm))
            .await
            .unwrap();
        let e = shm.get(b"far").await.unwrap_err();
        assert_eq!(e.code, ErrorCode::Unavailable, "{e}");
        assert!(e.message.contains("not on this host"), "{e}");
        assert_eq!(
            auto.get_view(b"far").await.unwrap_err().code,
            ErrorCode::Unavailable
        );
    });
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_registered_buffer_is_put_from_and_read_into_in_place() {
    let node = common::start("all", &common::ephemeral(&["--segment-size", "64MiB"]));
    let rt = common::rt();
    rt.block_on(async {
        for t in [Transport::Tcp, Transport::Shm] {
            let c = Client::connect(&node.addr, cfg(t)).await.unwrap();
            let e = c.register_buffer(0).unwrap_err();
            assert_eq!(e.code, ErrorCode::InvalidParams, "{e}");
            let mut src = c.register_buffer(1 << 20).unwrap();
            // No NIC here: the buffer is ordinary memory, and says so.
            assert!(!src.nic_registered());
            let v = data(7, 300_001);
            src.bytes_mut().unwrap()[..v.len()].copy_from_slice(&v);
            let key = format!("registered-{t:?}");
            c.put_from(key.as_bytes(), &src, v.len()).await.unwrap();
            let e = c
                .put_from(b"too-long", &src, (1 << 20) + 1)
                .await
                .unwrap_err();
            assert_eq!(e.code, ErrorCode::InvalidParams, "{e}");
            assert!(!c.exists(b"too-long").await.unwrap(), "nothing was stored");

            let mut dst = c.register_buffer(1 << 20).unwrap();
            let n = c
                .get_into_registered(key.as_bytes(), &mut dst)
                .await
                .unwrap();
            assert_eq!(n, v.len());
            assert_eq!(&dst.bytes().unwrap()[..n], &v[..], "{t:?}");
            let mut small = c.register_buffer(1000).unwrap();
            let e = c
                .get_into_registered(key.as_bytes(), &mut small)
                .await
                .unwrap_err();
            assert_eq!(e.code, ErrorCode::InvalidParams, "{e}");
        }
    });
}

/// `client.shm_populate = "at_map"`: once a segment is mapped, the client
/// fills the page tables of the whole segment in the background; "on_use"
/// fills only the chunks copies touch.
#[test]
fn a_client_set_to_populate_at_map_fills_the_whole_mapped_segment() {
    use kvpool_config::ShmPopulate;
    use kvpool_transport::shm::{ShmMap, POPULATE_CHUNK};
    use kvpool_wire::proto::call;
    let node = common::start("all", &common::ephemeral(&["--segment-size", "64MiB"]));
    let rt = common::rt();
    rt.block_on(async {
        // `c` puts `key` (which maps its segment); the mapping.
        async fn mapped(c: &Client, key: &[u8]) -> std::sync::Arc<ShmMap> {
            c.put(key, &data(7, 100_000)).await.unwrap();
            let r = c
                .call(call::GetReplicaList { key: key.to_vec() })
                .await
                .unwrap();
            c.engine().shm_map(&r[0]).await.expect("mapped")
        }
        let chunks = |m: &ShmMap| m.len().div_ceil(POPULATE_CHUNK as u64);
        let lazy = Client::connect(&node.addr, cfg(Transport::Shm))
            .await
            .unwrap();
        let m = mapped(&lazy, b"on-use").await;
        let (touched, all) = (m.populated_chunks(), chunks(&m));
        assert!(all >= 8, "a segment of {all} chunks");
        if touched == 0 {
            println!("skip: this kernel has no MADV_POPULATE_WRITE");
            return;
        }
        assert!(touched <= 2, "on_use filled {touched} of {all} chunks");
        let eager = Client::connect(
            &node.addr,
            ClientConfig {
                shm_populate: ShmPopulate::AtMap,
                ..cfg(Transport::Shm)
            },
        )
        .await
        .unwrap();
        let m = mapped(&eager, b"at-map").await;
        common::eventually(
            "at_map filling every chunk",
            Duration::from_secs(20),
            || async {
                let (filled, all) = (m.populated_chunks(), chunks(&m));
                if filled >= all {
                    Ok(())
                } else {
                    Err(format!("at_map filled {filled} of {all} chunks"))
                }
            },
        )
        .await;
        assert_eq!(m.populated_chunks(), chunks(&m), "each chunk once");
    });
}
