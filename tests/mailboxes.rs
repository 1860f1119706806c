//! Actor mailboxes stay bounded when their work is slow (issue 18).

use crate::common;

use std::time::{Duration, Instant};

use kvpool_client::Client;
use kvpool_config::ClientConfig;
use kvpool_storage_node::{StorageNode, StorageNodeArgs, StorageNodeMsg};
use kvpool_wire::proto::{Endpoint, SegmentSpec, Tier};
use ractor::{call, Actor};

/// A storage node's ticks while its master is frozen: every ping waits out
/// the client's deadline (300 ms) while ticks are due every 10 ms. With
/// `send_interval` they piled up in the actor's mailbox (about 150 in 2 s)
/// and a call behind them waited for every one (~45 s); one tick at a time,
/// a call waits for at most two pings.
#[test]
fn a_storage_node_does_not_pile_up_ticks_while_its_master_is_frozen() {
    let master = common::start("master", &common::ephemeral(&[]));
    let rt = common::rt();
    rt.block_on(async {
        let cfg = ClientConfig {
            timeout_ms: 300,
            ping_interval_ms: 0,
            ..Default::default()
        };
        let client = Client::connect(&master.addr, cfg).await.unwrap();
        let spec = SegmentSpec {
            name: "mailbox-test".into(),
            size: 1 << 20,
            endpoint: Endpoint {
                host: "127.0.0.1".into(),
                port: 1,
                nr_shards: 1,
            },
            slice_bytes: 1 << 20,
            host_id: "mailbox-test".into(),
            tier: Tier::Dram,
            nvme: None,
        };
        let args = StorageNodeArgs {
            client,
            spec,
            nvme: None,
            ping_interval: Duration::from_millis(10),
            mount_deadline: Duration::from_secs(5),
        };
        let (node, join) = Actor::spawn(None, StorageNode, args).await.unwrap();
        master.freeze();
        // Ticks fall due while every ping waits for its deadline.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let asked = Instant::now();
        let info = tokio::time::timeout(Duration::from_secs(5), async {
            call!(node, StorageNodeMsg::Info)
        })
        .await;
        let waited = asked.elapsed();
        assert!(
            matches!(info, Ok(Ok(_))),
            "the node's Info call waited {waited:?} behind queued ticks: {:?}",
            info.map(|r| r.map(|_| ()))
        );
        node.stop(None);
        let _ = tokio::time::timeout(Duration::from_secs(5), join).await;
    });
    master.signal(common::Signal::CONT);
}
