//! A storage process killed under a batch of transfers: every pending
//! request fails within the batch's deadline, and nothing leaks (connections,
//! mappings, fds, in-flight permits). Its own test binary, so the process-wide
//! counters it checks see no other test's traffic.

mod common;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kvpool_client::Client;
use kvpool_config::{ClientConfig, Transport};
use kvpool_runtime::config::Bytes;
use kvpool_transport::engine::Transfer;
use kvpool_wire::ErrorCode;
use rand::{RngCore, SeedableRng};

fn cfg(transport: Transport) -> ClientConfig {
    ClientConfig {
        transport,
        tcp_slice_bytes: Bytes(64 << 10),
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

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count())
        .unwrap_or(0)
}

#[test]
fn a_peer_killed_mid_batch_fails_every_pending_request_within_the_deadline_and_leaks_nothing() {
    let pool = common::Cluster::spec("transfer-kill")
        .node("512MiB")
        .start();
    let storage = &pool.nodes[0];
    let rt = common::rt();
    rt.block_on(async {
        let fds_before = open_fds();
        let conns_before = kvpool_transport::pool::open_connections();
        {
            let c = Client::connect(pool.addr(), cfg(Transport::Tcp))
                .await
                .unwrap();
            let value = data(7, 8 << 20);
            let keys: Vec<String> = (0..32).map(|i| format!("k{i}")).collect();
            let items: Vec<(&[u8], &[u8])> = keys
                .iter()
                .map(|k| (k.as_bytes(), value.as_slice()))
                .collect();
            for r in c.batch_put(&items, &Default::default()).await.unwrap() {
                r.unwrap();
            }
            let lists: Vec<_> = {
                let mut v = Vec::new();
                for k in &keys {
                    v.push(c.describe(k.as_bytes()).await.unwrap().replicas);
                }
                v
            };
            storage.freeze();
            let mut bufs: Vec<Vec<u8>> = (0..32).map(|_| vec![0u8; 8 << 20]).collect();
            let mut batch: Vec<Transfer<'_>> = bufs
                .iter_mut()
                .zip(&lists)
                .zip(&keys)
                .map(|((b, l), k)| Transfer::read(k.as_bytes(), b, l))
                .collect();
            let deadline = Instant::now() + Duration::from_secs(3);
            let started = Instant::now();
            let engine = c.engine();
            let killer = async {
                tokio::time::sleep(Duration::from_millis(300)).await;
                storage.signal(common::Signal::KILL);
            };
            let ((), ()) = tokio::join!(engine.run(&mut batch, deadline, None), killer);
            let took = started.elapsed();
            assert!(
                took < Duration::from_millis(3500),
                "the batch ended by its deadline: {took:?}"
            );
            for (i, t) in batch.iter().enumerate() {
                let st = t.status.as_ref().expect("every status is set");
                let e = st.as_ref().expect_err("the node is dead");
                assert!(
                    matches!(e.code, ErrorCode::Unavailable | ErrorCode::Timeout),
                    "request {i}: {e}"
                );
            }
            assert_eq!(
                engine.stats().in_flight.load(Ordering::Relaxed),
                0,
                "no slice left in flight"
            );
            // The client recovers on the next call: the master still answers.
            assert!(c.exists(b"k0").await.is_ok());
        }
        // The client and its pools are gone: every connection it opened is closed.
        assert_eq!(kvpool_transport::pool::open_connections(), conns_before);
        assert_eq!(kvpool_transport::shm::open_mappings(), 0);
        common::eventually("the fds closed", Duration::from_secs(5), || async {
            let now = open_fds();
            if now <= fds_before {
                Ok(())
            } else {
                Err(format!("fds: {fds_before} before, {now} after"))
            }
        })
        .await;
    });
}
