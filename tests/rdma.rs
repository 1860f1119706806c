//! The RDMA transport end to end: the real `kvpool` binary (master and
//! storage nodes) and the store client, with RDMA READ/WRITE moving every
//! byte. Runs where an RDMA device is (CI runs it inside the soft-RoCE guest,
//! `../shared/tools/rxe-vm/run.sh`, with RDMA_TESTS_REQUIRE_DEVICE=1); on a
//! machine without one each test prints `skip: no RDMA device (<reason>)`
//! and passes, and the TCP path is what `tests/transfer.rs` covers.
#![cfg(feature = "rdma")]

mod common;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kvpool_client::Client;
use kvpool_config::{ClientConfig, RdmaMode, Transport};
use kvpool_rdma::{RdmaConfig, RdmaContext, RdmaError};
use kvpool_wire::proto::PutOptions;
use rand::{RngCore, SeedableRng};
use xxhash_rust::xxh3::xxh3_64;

const MIB: usize = 1 << 20;

/// Whether this machine has an RDMA device; prints the skip line if not.
/// Installs the RDMA of this test process's clients (the binary installs
/// its own).
fn device_or_skip(test: &str) -> bool {
    kvpool_rdma::install();
    match RdmaContext::open(RdmaConfig::default()) {
        Ok(_) => true,
        Err(RdmaError::NoDevice(reason)) => {
            if std::env::var("RDMA_TESTS_REQUIRE_DEVICE").as_deref() == Ok("1") {
                panic!("{test}: RDMA_TESTS_REQUIRE_DEVICE=1 but no RDMA device: {reason}");
            }
            println!("skip: no RDMA device ({reason}) [{test}]");
            false
        }
        Err(e) => panic!("{test}: opening RDMA failed: {e}"),
    }
}

fn cfg(transport: Transport, timeout_ms: u64) -> ClientConfig {
    ClientConfig {
        transport,
        timeout_ms,
        ping_interval_ms: 0,
        ..Default::default()
    }
}

fn data(seed: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    rand::rngs::StdRng::seed_from_u64(seed).fill_bytes(&mut v);
    v
}

#[test]
fn puts_and_gets_of_1_byte_to_16_mib_and_a_batch_of_64_go_over_rdma() {
    if !device_or_skip("rdma sizes and batch") {
        return;
    }
    let node = common::start("all", &common::ephemeral(&["--segment-size", "192MiB"]));
    let rt = common::rt();
    rt.block_on(async {
        let c = Client::connect(&node.addr, cfg(Transport::Rdma, 120_000))
            .await
            .expect("client with transport = rdma");
        assert!(c.engine().rdma_enabled());
        let sizes = [1, 4095, 4096, 65_537, MIB + 3, 16 * MIB];
        for (i, &len) in sizes.iter().enumerate() {
            let v = data(i as u64, len);
            let key = format!("rdma-{len}");
            c.put(key.as_bytes(), &v)
                .await
                .unwrap_or_else(|e| panic!("put {len}: {e}"));
            let got = c
                .get(key.as_bytes())
                .await
                .unwrap_or_else(|e| panic!("get {len}: {e}"));
            assert_eq!(got.len(), len);
            assert_eq!(xxh3_64(&got), xxh3_64(&v), "bytes of {len} after rdma");
        }
        let st = c.engine().stats();
        let total: usize = sizes.iter().sum();
        assert_eq!(
            st.rdma_bytes.load(Ordering::Relaxed),
            2 * total as u64,
            "every put and get went over rdma"
        );
        assert_eq!(st.tcp_bytes.load(Ordering::Relaxed), 0);
        assert_eq!(st.shm_bytes.load(Ordering::Relaxed), 0);

        // Zero copy: a get into a registered buffer stages nothing, and
        // neither does a put from one.
        let staged = st.rdma_staged_bytes.load(Ordering::Relaxed);
        let mut buf = c.register_buffer(16 * MIB).unwrap();
        assert!(buf.nic_registered(), "RDMA is on: the NIC holds the buffer");
        let n = c
            .get_into_registered(format!("rdma-{}", 16 * MIB).as_bytes(), &mut buf)
            .await
            .unwrap();
        assert_eq!(n, 16 * MIB);
        assert_eq!(xxh3_64(buf.bytes().unwrap()), xxh3_64(&data(5, 16 * MIB)));
        c.put_from(b"from-registered", &buf, 16 * MIB)
            .await
            .unwrap();
        assert_eq!(
            st.rdma_staged_bytes.load(Ordering::Relaxed),
            staged,
            "a registered buffer is the RDMA source and destination itself"
        );
        let back = c.get(b"from-registered").await.unwrap();
        assert_eq!(xxh3_64(&back), xxh3_64(&data(5, 16 * MIB)));

        // A batch of 64.
        let vals: Vec<Vec<u8>> = (0..64)
            .map(|i| data(100 + i, 4096 + 97 * i as usize))
            .collect();
        let keys: Vec<String> = (0..64).map(|i| format!("batch-{i}")).collect();
        let items: Vec<(&[u8], &[u8])> = keys
            .iter()
            .zip(&vals)
            .map(|(k, v)| (k.as_bytes(), v.as_slice()))
            .collect();
        for r in c.batch_put(&items, &PutOptions::default()).await.unwrap() {
            r.unwrap();
        }
        let before = st.rdma_bytes.load(Ordering::Relaxed);
        let key_refs: Vec<&[u8]> = keys.iter().map(|k| k.as_bytes()).collect();
        let got = c.batch_get(&key_refs).await.unwrap();
        assert_eq!(got.len(), 64);
        for (i, (g, v)) in got.into_iter().zip(&vals).enumerate() {
            let g = g.unwrap_or_else(|e| panic!("batch get {i}: {e}"));
            assert_eq!(xxh3_64(&g), xxh3_64(v), "batch item {i}");
        }
        let read: usize = vals.iter().map(|v| v.len()).sum();
        assert_eq!(st.rdma_bytes.load(Ordering::Relaxed) - before, read as u64);
        assert_eq!(st.tcp_bytes.load(Ordering::Relaxed), 0);
    });
}

#[test]
fn a_node_killed_mid_transfer_fails_the_get_within_its_deadline_and_the_client_goes_on() {
    if !device_or_skip("rdma peer killed") {
        return;
    }
    let master = common::start("master", &common::ephemeral(&[]));
    let storage = |seg: &'static str| {
        let mut a = common::ephemeral(&["--segment-size", seg]);
        a.extend_from_slice(&["--master"]);
        a
    };
    let mut a1 = storage("96MiB");
    a1.push(&master.addr);
    let s1 = common::start("storage", &a1);
    let mut a2 = storage("96MiB");
    a2.push(&master.addr);
    let s2 = common::start("storage", &a2);
    let timeout_ms = 5_000;
    let rt = common::rt();
    rt.block_on(async {
        let c = Client::connect(&master.addr, cfg(Transport::Rdma, timeout_ms))
            .await
            .unwrap();
        // Objects until both nodes hold some; remember where each went.
        let mut on: [Vec<(String, Vec<u8>)>; 2] = [Vec::new(), Vec::new()];
        let mut segs: Vec<u64> = Vec::new();
        for i in 0..16u64 {
            let v = data(i, 4 * MIB);
            let key = format!("k{i}");
            c.put(key.as_bytes(), &v).await.unwrap();
            let seg = c.describe(key.as_bytes()).await.unwrap().replicas[0].segment_id;
            if !segs.contains(&seg) {
                segs.push(seg);
            }
            let idx = segs.iter().position(|s| *s == seg).unwrap();
            on[idx].push((key, v));
            if !on[0].is_empty() && segs.len() == 2 && !on[1].is_empty() && i >= 3 {
                break;
            }
        }
        assert_eq!(segs.len(), 2, "both nodes took objects");
        // Which process serves segs[0]? Its host port is in the replica.
        let (victim_objs, other_objs) = (&on[0], &on[1]);
        let victim_port = c
            .describe(victim_objs[0].0.as_bytes())
            .await
            .unwrap()
            .replicas[0]
            .endpoint
            .port;
        let (victim, _survivor) = if s1.addr.ends_with(&format!(":{victim_port}")) {
            (&s1, &s2)
        } else {
            (&s2, &s1)
        };
        // Warm the rdma connection to the victim, then kill it mid-get.
        c.get(victim_objs[0].0.as_bytes()).await.unwrap();
        let key = victim_objs[0].0.clone();
        let c2 = c.clone();
        let started = Instant::now();
        let getter = tokio::spawn(async move {
            let mut last = Ok(0usize);
            // Keep reading until the kill makes one fail.
            for _ in 0..10_000 {
                last = c2.get(key.as_bytes()).await.map(|v| v.len());
                if last.is_err() {
                    break;
                }
            }
            last
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        victim.signal(common::Signal::KILL);
        let res = tokio::time::timeout(Duration::from_millis(timeout_ms * 3), getter)
            .await
            .expect("the get loop ended")
            .unwrap();
        let err = res.expect_err("a get from the killed node fails");
        assert!(
            started.elapsed() < Duration::from_millis(timeout_ms * 2 + 300),
            "the failed get returned within its deadline ({:?}): {err}",
            started.elapsed()
        );
        // The next call works: the surviving node's objects, over rdma.
        let before = c.engine().stats().rdma_bytes.load(Ordering::Relaxed);
        for (k, v) in other_objs {
            let got = c.get(k.as_bytes()).await.unwrap();
            assert_eq!(xxh3_64(&got), xxh3_64(v));
        }
        assert!(c.engine().stats().rdma_bytes.load(Ordering::Relaxed) > before);
        assert_eq!(c.engine().stats().tcp_bytes.load(Ordering::Relaxed), 0);
    });
}

#[test]
fn a_client_asking_for_rdma_from_a_node_without_it_gets_tcp_and_a_logged_reason() {
    if !device_or_skip("rdma fallback") {
        return;
    }
    let dir = std::env::temp_dir().join(format!("kvpool-rdma-off-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let node_cfg = dir.join("node.toml");
    std::fs::write(&node_cfg, "[storage.rdma]\nenabled = \"off\"\n").unwrap();
    let mut args = common::ephemeral(&["--segment-size", "64MiB", "--config"]);
    let node_cfg_s = node_cfg.display().to_string();
    let leaked: &'static str = Box::leak(node_cfg_s.into_boxed_str());
    args.push(leaked);
    let node = common::start("all", &args);

    // The CLI, with transport = "rdma": it has a device, the node has none.
    let cli_cfg = dir.join("cli.toml");
    std::fs::write(&cli_cfg, "[client]\ntransport = \"rdma\"\n").unwrap();
    let cli_cfg_s = cli_cfg.display().to_string();
    let value = data(7, 300_000);
    let (code, _, err) = common::cli(
        &node.addr,
        &["--config", &cli_cfg_s, "put", "fallback"],
        Some(&value),
    );
    assert_eq!(code, 0, "put: {err}");
    assert!(
        err.contains("rdma unavailable for this node")
            && err.contains("rdma is off (storage.rdma.enabled)")
            && err.contains("using tcp"),
        "one log line says why the node is on tcp: {err}"
    );
    let (code, out, err) = common::cli(
        &node.addr,
        &["--config", &cli_cfg_s, "get", "fallback"],
        None,
    );
    assert_eq!(code, 0, "get: {err}");
    assert_eq!(xxh3_64(&out), xxh3_64(&value));

    // The same through the library: the bytes went over tcp.
    let rt = common::rt();
    rt.block_on(async {
        let c = Client::connect(&node.addr, cfg(Transport::Rdma, 30_000))
            .await
            .unwrap();
        let got = c.get(b"fallback").await.unwrap();
        assert_eq!(xxh3_64(&got), xxh3_64(&value));
        let st = c.engine().stats();
        assert_eq!(st.rdma_bytes.load(Ordering::Relaxed), 0);
        assert_eq!(st.rdma_fallbacks.load(Ordering::Relaxed), 1);
        assert_eq!(st.tcp_bytes.load(Ordering::Relaxed), value.len() as u64);
    });
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn rdma_required_without_a_device_is_a_start_up_error_not_a_fallback() {
    // A device name that does not exist stands for "no device" on any machine.
    let rt = common::rt();
    rt.block_on(async {
        let node = common::start("all", &common::ephemeral(&["--segment-size", "16MiB"]));
        let mut c = cfg(Transport::Rdma, 5_000);
        c.rdma.devices = vec!["no_such_rdma_dev".into()];
        let e = Client::connect(&node.addr, c.clone())
            .await
            .err()
            .expect("refused");
        assert!(
            e.to_string().contains("rdma is required"),
            "the error says rdma is required: {e}"
        );
        c.transport = Transport::Auto;
        c.rdma.enabled = RdmaMode::Required;
        assert!(Client::connect(&node.addr, c).await.is_err());
    });
}

/// With a cluster secret (issue 29): the RDMA control connection proves the
/// secret (the data handshake) and shows a grant before the node connects
/// its queue pair, and the bytes go over RDMA for a client that holds it; a
/// client with another secret is refused before any byte moves.
#[test]
fn with_a_cluster_secret_rdma_moves_the_bytes_of_clients_that_prove_it() {
    if !device_or_skip("rdma with a secret") {
        return;
    }
    const SECRET: &str = "rdma test secret of more than sixteen bytes";
    let env = [("KVPOOL_SECRET", SECRET)];
    let pool = common::Cluster::spec("rdma-secret")
        .env(&env)
        .node("64MiB")
        .start();
    let secured = |secret: &str| ClientConfig {
        secret: kvpool_config::Secret::new(secret),
        ..cfg(Transport::Rdma, 60_000)
    };
    let rt = common::rt();
    rt.block_on(async {
        let c = Client::connect(pool.addr(), secured(SECRET))
            .await
            .expect("a client with the secret");
        // The node mounts shortly after the master starts.
        common::eventually(
            "a node mounted (a put of a probe)",
            Duration::from_secs(10),
            || async { c.put(b"probe", b"p").await.map_err(|e| e.to_string()) },
        )
        .await;
        assert!(c.engine().rdma_enabled());
        let st = c.engine().stats();
        let before = st.rdma_bytes.load(Ordering::Relaxed);
        let sizes = [MIB + 3, 16 * MIB];
        for (i, &len) in sizes.iter().enumerate() {
            let v = data(200 + i as u64, len);
            let key = format!("secret-{len}");
            c.put(key.as_bytes(), &v)
                .await
                .unwrap_or_else(|e| panic!("put {len}: {e}"));
            let got = c.get(key.as_bytes()).await.unwrap();
            assert_eq!(xxh3_64(&got), xxh3_64(&v), "bytes of {len}");
        }
        let total: usize = sizes.iter().sum();
        assert_eq!(
            st.rdma_bytes.load(Ordering::Relaxed) - before,
            2 * total as u64,
            "every put and get went over rdma under the secret"
        );
        assert_eq!(st.tcp_bytes.load(Ordering::Relaxed), 0);

        let e = Client::connect(
            pool.addr(),
            secured("another secret of more than sixteen bytes"),
        )
        .await
        .err()
        .expect("a client with another secret was let in");
        assert_eq!(e.code, kvpool_client::ErrorCode::Unauthenticated, "{e}");
    });
}
