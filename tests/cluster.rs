//! End to end across processes: one master and two storage nodes, each its
//! own `kvpool` process on 127.0.0.1, driven through the client library.

use crate::common;

use futures_util::stream::{self, StreamExt};
use kvpool_client::Client;
use kvpool_config::{ClientConfig, Transport};
use rand::{RngCore, SeedableRng};
use xxhash_rust::xxh3::xxh3_64;

const OBJECTS: usize = 1000;
const MAX_SIZE: usize = 4 << 20;

fn value(seed: u64, i: usize, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    rand::rngs::StdRng::seed_from_u64(seed ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15))
        .fill_bytes(&mut v);
    v
}

#[test]
fn thousand_objects_of_random_sizes_round_trip_across_a_master_and_two_storage_processes() {
    // Short leases, so the space of the objects read and then removed comes
    // back within the test.
    let pool = common::Cluster::spec("thousand-objects")
        .master_config("[master]\nlease_ttl_ms = 500\n")
        .nodes(2, "1536MiB")
        .start();

    let seed: u64 = rand::random();
    println!("seed {seed}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut sizes: Vec<usize> = (0..OBJECTS)
        .map(|_| 1 + (rng.next_u64() as usize % MAX_SIZE))
        .collect();
    // The edges, always.
    sizes[0] = 1;
    sizes[1] = MAX_SIZE;

    let rt = common::rt();
    rt.block_on(async {
        // Over TCP: the storage processes serve every byte (a same-host
        // client would otherwise use shared memory; tests/transfer.rs covers it).
        let cfg = ClientConfig {
            transport: Transport::Tcp,
            ..Default::default()
        };
        let client = Client::connect(pool.addr(), cfg).await.expect("connect");
        let stat = client.stat().await.unwrap();
        assert_eq!(stat.segments.len(), 2, "both storage nodes mounted");

        // Put, 8 at a time; remember each value's checksum.
        let sums: Vec<(usize, u64)> = stream::iter(0..OBJECTS)
            .map(|i| {
                let client = client.clone();
                let len = sizes[i];
                async move {
                    let v = value(seed, i, len);
                    client
                        .put(format!("obj-{i}").as_bytes(), &v)
                        .await
                        .unwrap_or_else(|e| panic!("put obj-{i} ({len} B), seed {seed}: {e}"));
                    (i, xxh3_64(&v))
                }
            })
            .buffer_unordered(8)
            .collect()
            .await;
        let mut want = vec![0u64; OBJECTS];
        for (i, h) in sums {
            want[i] = h;
        }

        let stat = client.stat().await.unwrap();
        assert_eq!(stat.keys, OBJECTS as u64);
        for seg in &stat.segments {
            assert!(seg.used > 0, "objects landed on both nodes: {stat:?}");
        }

        // Read every one back, byte for byte (by length and checksum).
        stream::iter(0..OBJECTS)
            .map(|i| {
                let client = client.clone();
                let (len, sum) = (sizes[i], want[i]);
                async move {
                    let got = client
                        .get(format!("obj-{i}").as_bytes())
                        .await
                        .unwrap_or_else(|e| panic!("get obj-{i}, seed {seed}: {e}"));
                    assert_eq!(got.len(), len, "length of obj-{i}, seed {seed}");
                    assert_eq!(xxh3_64(&got), sum, "bytes of obj-{i}, seed {seed}");
                }
            })
            .buffer_unordered(8)
            .collect::<Vec<()>>()
            .await;

        // Just read, so leased: removal needs force.
        for i in 0..OBJECTS {
            client
                .remove_with(format!("obj-{i}").as_bytes(), true)
                .await
                .unwrap();
        }
        assert!(!client.exists(b"obj-0").await.unwrap());
    });

    // `stat` (the CLI) shows them gone at once, and the space free once the
    // readers' leases have ended.
    common::eventually_blocking(
        "the space freed",
        std::time::Duration::from_secs(10),
        || {
            let (code, out, err) = common::cli(pool.addr(), &["stat", "--json"], None);
            assert_eq!(code, 0, "{err}");
            let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
            assert_eq!(v["keys"], 0, "{v}");
            assert_eq!(v["segments"].as_array().unwrap().len(), 2, "{v}");
            if v["used"] == 0 {
                Ok(())
            } else {
                Err(format!("space not freed: {v}"))
            }
        },
    );
    drop(pool);
}
