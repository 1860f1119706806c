//! A storage process that dies or hangs under a get: the get ends with an
//! error within its deadline, it never hangs.

use crate::common;

use std::time::{Duration, Instant};

use common::Signal;
use kvpool_client::Client;
use kvpool_config::{ClientConfig, Transport};
use kvpool_wire::ErrorCode;

const DEADLINE_MS: u64 = 3000;

/// A master and one node of 256 MiB; `name` names its scratch directory.
fn cluster(name: &str) -> common::Cluster {
    common::Cluster::spec(name).node("256MiB").start()
}

/// Over TCP: a same-host client would otherwise read the node's memory
/// directly (shm), and a dead node's mapped memory outlives it.
fn client_cfg() -> ClientConfig {
    ClientConfig {
        timeout_ms: DEADLINE_MS,
        transport: Transport::Tcp,
        ..Default::default()
    }
}

#[test]
fn a_get_fails_within_its_deadline_when_its_storage_process_is_killed_mid_request() {
    let pool = cluster("killed-mid-get");
    let storage = &pool.nodes[0];
    let rt = common::rt();
    rt.block_on(async {
        let client = Client::connect(pool.addr(), client_cfg()).await.unwrap();
        let value = vec![7u8; 64 << 20];
        client.put(b"big", &value).await.unwrap();
        assert_eq!(client.get(b"big").await.unwrap().len(), value.len());

        // Freeze the node so the get is certainly in flight at it, then kill it.
        storage.freeze();
        let started = Instant::now();
        let get = tokio::spawn({
            let client = client.clone();
            async move { client.get(b"big").await }
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!get.is_finished(), "the get waits on the frozen node");
        storage.signal(Signal::KILL);

        let res = tokio::time::timeout(Duration::from_millis(DEADLINE_MS + 2000), get)
            .await
            .expect("the get must not hang past its deadline")
            .unwrap();
        let took = started.elapsed();
        let err = res.expect_err("a get from a killed node fails");
        assert!(
            matches!(err.code, ErrorCode::Unavailable | ErrorCode::Timeout),
            "{err}"
        );
        assert!(
            took < Duration::from_millis(DEADLINE_MS + 1000),
            "took {took:?}"
        );

        // The master still answers, and the client is usable.
        assert!(client.exists(b"big").await.is_ok());
    });
}

#[test]
fn a_get_times_out_within_its_deadline_when_its_storage_process_hangs() {
    let pool = cluster("hung-node");
    let storage = &pool.nodes[0];
    let rt = common::rt();
    rt.block_on(async {
        let client = Client::connect(pool.addr(), client_cfg()).await.unwrap();
        client.put(b"k", &[1u8; 100_000]).await.unwrap();
        storage.freeze();
        let started = Instant::now();
        let err = client
            .get(b"k")
            .await
            .expect_err("a hung node cannot answer");
        let took = started.elapsed();
        assert_eq!(err.code, ErrorCode::Timeout, "{err}");
        assert!(
            took < Duration::from_millis(DEADLINE_MS + 1000),
            "took {took:?}"
        );
        storage.signal(Signal::CONT);
        // Once it runs again, so do gets.
        assert_eq!(client.get(b"k").await.unwrap().len(), 100_000);
    });
}

/// A read stops at its read lease's end, not only at the call's deadline:
/// past the lease the master may free the object's space and a put reuse
/// it, and a read there would hand that put's bytes to a client that checks
/// no checksum. With a 1 s lease and a 10 s call, a get and a batch get of
/// a value on a node that stays silent end with `Timeout` within the lease
/// (before, they read on until the call's deadline).
#[test]
fn a_get_from_a_silent_node_stops_at_its_read_lease_not_at_the_calls_deadline() {
    let pool = common::Cluster::spec("silent-node-lease")
        .master_config("[master]\nlease_ttl_ms = 1000\n")
        .node("64MiB")
        .start();
    let storage = &pool.nodes[0];
    common::rt().block_on(async {
        let cfg = ClientConfig {
            timeout_ms: 10_000,
            checksums: false,
            ..client_cfg()
        };
        let client = Client::connect(pool.addr(), cfg).await.unwrap();
        let value = vec![3u8; 100_000];
        client.put(b"k", &value).await.unwrap();
        storage.freeze();
        for batch in [false, true] {
            let started = Instant::now();
            let res = if batch {
                client.batch_get(&[b"k"]).await.unwrap().remove(0)
            } else {
                client.get(b"k").await
            };
            let took = started.elapsed();
            let err = res.expect_err("nothing can be read from a silent node");
            assert_eq!(err.code, ErrorCode::Timeout, "batch {batch}: {err}");
            assert!(
                took < Duration::from_millis(1000),
                "batch {batch}: took {took:?}, past the 1 s read lease"
            );
        }
        storage.signal(Signal::CONT);
        assert_eq!(client.get(b"k").await.unwrap(), value);
    });
}
