//! A storage process that dies or hangs under a get: the get ends with an
//! error within its deadline, it never hangs.

use crate::common;

use std::time::{Duration, Instant};

use common::Signal;
use kvpool_client::Client;
use kvpool_config::{ClientConfig, Transport};
use kvpool_wire::ErrorCode;

const DEADLINE_MS: u64 = 3000;

fn cluster() -> (common::Proc, common::Proc) {
    let master = common::start("master", &common::ephemeral(&[]));
    let storage = common::start_storage(&master.addr, "256MiB", &[]);
    (master, storage)
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
    let (master, storage) = cluster();
    let rt = common::rt();
    rt.block_on(async {
        let client = Client::connect(&master.addr, client_cfg()).await.unwrap();
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
    let (master, storage) = cluster();
    let rt = common::rt();
    rt.block_on(async {
        let client = Client::connect(&master.addr, client_cfg()).await.unwrap();
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
