//! Liveness across processes: a storage node killed with SIGKILL is unmounted
//! by the master within client_ttl + 1 s; objects with a replica elsewhere stay
//! readable, the others are gone, new puts land on the survivors.

use crate::common;

use std::time::{Duration, Instant};

use common::Signal;
use kvpool_client::Client;
use kvpool_config::ClientConfig;
use kvpool_wire::proto::PutOptions;
use kvpool_wire::ErrorCode;

const CLIENT_TTL_MS: u64 = 2_000;

#[test]
fn a_killed_storage_node_is_unmounted_within_client_ttl_and_replicas_elsewhere_survive() {
    let pool = common::Cluster::spec("liveness")
        .master_config(&format!("[master]\nclient_ttl_ms = {CLIENT_TTL_MS}\n"))
        .nodes(2, "64MiB")
        .start();
    let victim = &pool.nodes[0];
    let victim_port: u16 = victim.addr.rsplit(':').next().unwrap().parse().unwrap();

    let rt = common::rt();
    rt.block_on(async {
        let client = Client::connect(pool.addr(), ClientConfig::default())
            .await
            .unwrap();
        let two = PutOptions {
            replicas: 2,
            ..Default::default()
        };
        for i in 0..20 {
            client
                .put_with(format!("both-{i}").as_bytes(), &[i as u8; 10_000], &two)
                .await
                .unwrap();
            client
                .put(format!("one-{i}").as_bytes(), &[i as u8; 10_000])
                .await
                .unwrap();
        }
        let stat = client.stat().await.unwrap();
        assert_eq!(stat.segments.len(), 2);
        let victim_seg = stat
            .segments
            .iter()
            .find(|s| s.endpoint.port == victim_port)
            .expect("the victim's segment")
            .id;
        // Which single-replica objects live only on the victim.
        let mut lost = Vec::new();
        for i in 0..20 {
            let info = client
                .describe(format!("one-{i}").as_bytes())
                .await
                .unwrap();
            if info.replicas[0].segment_id == victim_seg {
                lost.push(i);
            }
        }
        assert!(
            !lost.is_empty() && lost.len() < 20,
            "objects on both nodes: {lost:?}"
        );

        victim.signal(Signal::KILL);
        let killed = Instant::now();
        common::eventually(
            "the master drops the dead node",
            Duration::from_millis(CLIENT_TTL_MS + 1000),
            || async {
                let s = client.stat().await.unwrap();
                if s.segments.len() == 1 {
                    assert_ne!(s.segments[0].id, victim_seg);
                    Ok(())
                } else {
                    Err(format!(
                        "it still lists the dead node {:?} after the kill: {:?}",
                        killed.elapsed(),
                        s.segments
                    ))
                }
            },
        )
        .await;
        println!("unmounted {:?} after SIGKILL", killed.elapsed());

        for i in 0..20 {
            let v = client.get(format!("both-{i}").as_bytes()).await.unwrap();
            assert_eq!(v, vec![i as u8; 10_000], "both-{i} read from the survivor");
            let r = client.get(format!("one-{i}").as_bytes()).await;
            if lost.contains(&i) {
                assert_eq!(r.unwrap_err().code, ErrorCode::ObjectNotFound, "one-{i}");
            } else {
                assert_eq!(r.unwrap(), vec![i as u8; 10_000], "one-{i}");
            }
        }
        for i in 0..10 {
            client
                .put(format!("new-{i}").as_bytes(), &[9u8; 50_000])
                .await
                .unwrap();
            assert_eq!(
                client
                    .get(format!("new-{i}").as_bytes())
                    .await
                    .unwrap()
                    .len(),
                50_000
            );
        }
    });
    drop(pool);
}
