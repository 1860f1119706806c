//! Hot-object replication across real processes: a master with
//! `hot_replicas = 2`, two storage nodes without NVMe tiers, clients over
//! TCP. A hot object gets a second replica on the other node (fetched by
//! that node), reads then land on both nodes, the bytes stay the bytes, and
//! under pressure the extra replica is evicted before older objects.

use std::time::Duration;

use crate::common;
use kvpool_client::Client;
use kvpool_config::{ClientConfig, Transport};

/// A master with `hot_replicas = 2` (hot after `hot_reads` reads in a minute)
/// and two storage nodes of `size` without NVMe tiers.
fn hot_pool(tag: &str, hot_reads: u16, size: &str) -> common::Cluster {
    common::Cluster::spec(tag)
        .master_config(&format!(
            "[master]\nhot_replicas = 2\nhot_reads = {hot_reads}\nhot_window_ms = 60000\n"
        ))
        .nodes(2, size)
        .start()
}

/// A client over TCP without the location cache (every get asks the
/// master, which counts it), once `segments` segments are mounted.
async fn uncached_client(master: &str, what: &str, segments: usize) -> Client {
    let cfg = ClientConfig {
        transport: Transport::Tcp,
        location_cache_entries: 0,
        ..Default::default()
    };
    let client = Client::connect(master, cfg).await.expect("connect");
    common::eventually(what, Duration::from_secs(10), || async {
        client
            .stat()
            .await
            .is_ok_and(|s| s.segments.len() == segments)
    })
    .await;
    client
}

#[test]
fn a_hot_object_is_copied_to_a_second_node_and_its_reads_spread_over_both() {
    let pool = hot_pool("hot-replicas", 4, "64MiB");
    let (s1, s2) = (&pool.nodes[0], &pool.nodes[1]);
    let nodes = [s1, s2];

    let value = common::value(7, 256 << 10);
    let other = common::value(8, 256 << 10);
    let rt = common::rt();
    rt.block_on(async {
        // Over TCP, and without the location cache: every get asks the
        // master (which counts it) and reads from a storage node.
        let client = uncached_client(pool.addr(), "both nodes mounted", 2).await;
        client.put(b"hot", &value).await.expect("put hot");
        client.put(b"cold", &other).await.expect("put cold");
        let served = |i: usize| common::metric(&nodes[i].http, "kvpool_storage_read_bytes_total");
        let before = [served(0), served(1)];
        for _ in 0..4 {
            assert_eq!(client.get(b"hot").await.expect("get hot"), value);
        }
        // One replica so far: one node served all four reads.
        let after = [served(0), served(1)];
        let grew: Vec<usize> = (0..2).filter(|&i| after[i] > before[i]).collect();
        assert_eq!(grew.len(), 1, "reads before: {before:?}, after: {after:?}");
        let holder = grew[0];
        // The other node fetches a copy (it polls every 100 ms).
        common::eventually("the extra replica", Duration::from_secs(10), || async {
            client.stat().await.is_ok_and(|s| s.hot_copies == 1)
        })
        .await;
        let fetcher = 1 - holder;
        let fetches = |i: usize| common::metric(&nodes[i].http, "kvpool_storage_hot_fetches_total");
        assert_eq!((fetches(fetcher), fetches(holder)), (1.0, 0.0));
        // Reads now start at each replica in turn: both nodes serve.
        let start = [served(0), served(1)];
        for _ in 0..20 {
            assert_eq!(client.get(b"hot").await.expect("get hot"), value);
        }
        let end = [served(0), served(1)];
        for i in 0..2 {
            let bytes = end[i] - start[i];
            assert!(
                bytes >= 8.0 * value.len() as f64,
                "node {i} served {bytes} bytes of 20 reads of {} bytes",
                value.len()
            );
        }
        // The cold object was read once: no copy of it.
        assert_eq!(client.get(b"cold").await.expect("get cold"), other);
        assert_eq!(client.stat().await.unwrap().hot_copies, 1);
    });
    drop(pool);
}

#[test]
fn a_fetch_that_reads_bytes_other_than_the_objects_adds_no_replica() {
    let pool = hot_pool("hot-replicas-bad", 4, "64MiB");
    let (s1, s2) = (&pool.nodes[0], &pool.nodes[1]);
    let value = common::value(9, 100_000);
    let rt = common::rt();
    rt.block_on(async {
        let client = uncached_client(pool.addr(), "both nodes mounted", 2).await;
        client.put(b"hot", &value).await.expect("put");
        let r = client.describe(b"hot").await.expect("describe").replicas;
        assert_eq!(r.len(), 1);
        // The one replica's bytes go bad behind the master's back.
        crate::hostile::scribble(
            &r[0].endpoint.shard_addr(r[0].data_shard()),
            r[0].segment_id,
            r[0].offset + 500,
            64,
        );
        for _ in 0..4 {
            let e = client
                .get(b"hot")
                .await
                .expect_err("the only replica is bad");
            assert_eq!(e.code, kvpool_wire::ErrorCode::Corrupt, "{e}");
        }
        // The other node fetches, finds the bytes fail the checksum, and
        // says so: the master frees the range, no replica is added.
        let fetcher = if r[0].endpoint.port == port_of(&s1.addr) {
            s2
        } else {
            s1
        };
        common::eventually("the refused fetch", Duration::from_secs(10), || async {
            common::metric(&fetcher.http, "kvpool_storage_checksum_mismatches_total") == 1.0
        })
        .await;
        common::eventually("the range freed", Duration::from_secs(10), || async {
            let s = client.stat().await.expect("stat");
            let used: u64 = s.segments.iter().map(|g| g.used).sum();
            (used < 2 * value.len() as u64).then_some(())
        })
        .await;
        let s = client.stat().await.expect("stat");
        assert_eq!(s.hot_copies, 0);
        assert_eq!(
            common::metric(&fetcher.http, "kvpool_storage_hot_fetches_total"),
            0.0
        );
        assert_eq!(
            client
                .describe(b"hot")
                .await
                .expect("describe")
                .replicas
                .len(),
            1
        );
    });
    drop(pool);
}

#[test]
fn a_node_with_an_nvme_tier_fetches_in_its_tier_loop() {
    let pool = common::Cluster::spec("hot-replicas-tier")
        .master_config("[master]\nhot_replicas = 2\nhot_reads = 4\nhot_window_ms = 60000\n")
        .node("64MiB")
        .start();
    let plain = &pool.nodes[0];
    let value = common::value(5, 200_000);
    let rt = common::rt();
    rt.block_on(async {
        let cfg = ClientConfig {
            transport: Transport::Tcp,
            location_cache_entries: 0,
            ..Default::default()
        };
        let client = Client::connect(pool.addr(), cfg).await.expect("connect");
        common::eventually(
            "the plain node mounted",
            Duration::from_secs(10),
            || async { client.stat().await.is_ok_and(|s| s.segments.len() == 1) },
        )
        .await;
        // On the plain node (the only one yet); then the tiered node joins.
        client.put(b"hot", &value).await.expect("put");
        let tiered = pool.start_node(common::Node::new("64MiB").config(
            "[storage.nvme]\npath = \"{dir}/tier.kvnv\"\ncapacity = \"64 MiB\"\n\
             avg_object_bytes = \"64 KiB\"\nsync_writes = false\ntask_poll_ms = 20\n",
        ));
        common::eventually(
            "the tiered node mounted",
            Duration::from_secs(10),
            || async { client.stat().await.is_ok_and(|s| s.segments.len() == 3) },
        )
        .await;
        for _ in 0..4 {
            assert_eq!(client.get(b"hot").await.expect("get"), value);
        }
        common::eventually(
            "the tiered node's copy",
            Duration::from_secs(10),
            || async { client.stat().await.is_ok_and(|s| s.hot_copies == 1) },
        )
        .await;
        assert_eq!(
            common::metric(&tiered.http, "kvpool_storage_hot_fetches_total"),
            1.0
        );
        assert_eq!(
            common::metric(&plain.http, "kvpool_storage_hot_fetches_total"),
            0.0
        );
        let r = client.describe(b"hot").await.expect("describe").replicas;
        assert_eq!(r.len(), 2, "{r:?}");
        for _ in 0..6 {
            assert_eq!(client.get(b"hot").await.expect("get"), value);
        }
        drop(tiered);
    });
    drop(pool);
}

fn port_of(addr: &str) -> u16 {
    addr.rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("host:port")
}

/// An engine's completion (greedy, `max_tokens` tokens) of token ids.
fn complete(engine: &common::Proc, prompt: &[u32], max_tokens: usize) -> serde_json::Value {
    use std::io::{Read, Write};
    let body = serde_json::json!({"model": "builtin:tiny", "prompt": prompt,
        "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true,
        "return_token_ids": true})
    .to_string();
    let mut s = std::net::TcpStream::connect(&engine.addr).expect("connect engine");
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).expect("read answer");
    let (head, body) = out.split_once("\r\n\r\n").expect("http answer");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}\n{body}");
    serde_json::from_str(body).expect("a completion")
}

#[test]
fn a_prefix_many_requests_share_gets_a_second_replica_and_both_nodes_serve_it() {
    let pool = hot_pool("hot-replicas-engine", 3, "256MiB");
    let (s1, s2) = (&pool.nodes[0], &pool.nodes[1]);
    // Without the location cache every load asks the master, as loads by
    // many engines would.
    let ecfg = common::config_file(
        "hot-engine",
        "[client]\ntransport = \"tcp\"\nlocation_cache_entries = 0\n",
    );
    let e = common::tiny_engine(Some(pool.addr()), &ecfg);
    let system = common::byte_prompt(3 * 256, 11);
    let first = complete(&e, &system, 4);
    assert_eq!(first["kvpool"]["prompt_tokens_computed"], 768);
    let rt = common::rt();
    let client = rt
        .block_on(Client::connect(pool.addr(), ClientConfig::default()))
        .expect("connect");
    // The engine stores the prompt's three chunks after its prefill. A store
    // the pool refused (counted and logged: a put that met its deadline on a
    // loaded machine) is not this test's subject: the prompt is sent again,
    // at most twice, and the engine's log is shown if the chunks never land.
    let failed = || common::metric(&e.addr, "kvpool_engine_chunks_store_failed_total");
    let mut failed_before = 0.0;
    for round in 0.. {
        let stored = common::eventually_blocking(
            "the prefix stored",
            Duration::from_secs(30),
            || -> Result<bool, String> {
                let keys = rt.block_on(client.stat()).map(|s| s.keys);
                if keys.as_ref().is_ok_and(|k| *k >= 3) {
                    return Ok(true);
                }
                if failed() > failed_before {
                    return Ok(false);
                }
                Err(format!(
                    "keys {keys:?}; the engine's log, last line first:\n{}",
                    e.stderr_tail(20)
                ))
            },
        );
        if stored {
            break;
        }
        assert!(
            round < 2,
            "the engine's stores failed 3 times:\n{}",
            e.stderr()
        );
        failed_before = failed();
        complete(&e, &system, 4);
    }
    // The same prefix again and again: its first two chunks load from the
    // pool each time, become hot and get a replica on the other node.
    for _ in 0..3 {
        let out = complete(&e, &system, 4);
        assert_eq!(out["kvpool"]["prompt_tokens_loaded"], 512);
        assert_eq!(
            out["choices"][0]["token_ids"],
            first["choices"][0]["token_ids"]
        );
    }
    common::eventually_blocking(
        "replicas of the hot chunks",
        Duration::from_secs(10),
        || rt.block_on(client.stat()).is_ok_and(|s| s.hot_copies >= 2),
    );
    let served = || [s1, s2].map(|n| common::metric(&n.http, "kvpool_storage_read_bytes_total"));
    let before = served();
    for _ in 0..6 {
        let out = complete(&e, &system, 4);
        assert_eq!(out["kvpool"]["prompt_tokens_loaded"], 512);
        assert_eq!(
            out["choices"][0]["token_ids"], first["choices"][0]["token_ids"],
            "the same tokens from either replica"
        );
    }
    let after = served();
    for i in 0..2 {
        assert!(
            after[i] > before[i],
            "node {i} served none of the loads: {before:?} -> {after:?}"
        );
    }
    drop((e, pool));
}

#[test]
fn under_pressure_an_extra_replica_is_evicted_before_an_older_object() {
    // One master shard (one range per segment), 1 s leases, extra replicas
    // may take half the DRAM; two 8 MiB nodes.
    let pool = common::Cluster::spec("hot-evict")
        .master_config(
            "[master]\nshards = 1\nlease_ttl_ms = 1000\nhot_replicas = 2\nhot_reads = 4\n\
             hot_window_ms = 60000\nhot_budget = 0.5\n",
        )
        .nodes(2, "8MiB")
        .start();
    let hot = common::value(11, 2 << 20);
    let old = common::value(12, 5_600_000);
    let rt = common::rt();
    rt.block_on(async {
        let client = uncached_client(pool.addr(), "both nodes mounted", 2).await;
        client.put(b"hot", &hot).await.expect("put hot");
        // The emptier node takes "old" (never read again): 70 % full.
        client.put(b"old", &old).await.expect("put old");
        let seg = |k: &'static [u8]| {
            let c = &client;
            async move {
                let r = c.describe(k).await.expect("describe").replicas;
                r.iter().map(|r| r.segment_id).collect::<Vec<_>>()
            }
        };
        let (a, b) = (seg(b"hot").await, seg(b"old").await);
        assert_eq!((a.len(), b.len()), (1, 1));
        assert_ne!(a, b, "placed on the two nodes");
        // Hot: its extra replica goes to "old"'s node, which passes the high
        // watermark (7.6 of 8 MiB).
        for _ in 0..4 {
            assert_eq!(client.get(b"hot").await.expect("get hot"), hot);
        }
        common::eventually("the extra replica", Duration::from_secs(10), || async {
            client.stat().await.is_ok_and(|s| s.hot_copies == 1)
        })
        .await;
        // (hot_copies counts copies made since start: one landed.) Once the
        // leases end, eviction takes the extra replica, not the older
        // never-read object beside it: the node is back to "old" alone.
        let used = |id: u64| {
            let c = &client;
            async move {
                let st = c.stat().await.expect("stat");
                st.segments.iter().find(|s| s.id == id).map(|s| s.used)
            }
        };
        common::eventually(
            "the extra replica evicted",
            Duration::from_secs(15),
            || async {
                let (on, held) = (seg(b"hot").await, used(b[0]).await);
                if on.len() == 1 && held == Some(5_600_000) {
                    Ok(())
                } else {
                    Err(format!("hot on {on:x?}, {held:?} bytes used where old is"))
                }
            },
        )
        .await;
        assert_eq!(seg(b"hot").await, a, "the first replica stays");
        assert_eq!(client.get(b"old").await.expect("old is still there"), old);
        assert_eq!(client.get(b"hot").await.expect("get hot"), hot);
    });
    drop(pool);
}
