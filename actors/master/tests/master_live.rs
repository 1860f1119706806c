//! The live master (a glommio shard behind the `Master` actor): a put that
//! takes a range past the high watermark returns without evicting, and the
//! shard's eviction task frees `eviction_ratio` of the range after it, with
//! no further request and no housekeeping tick to set it off.

use std::time::{Duration, Instant};

use kvpool_config::MasterConfig;
use kvpool_master::{call, Master, MasterArgs};
use kvpool_runtime::metrics::MetricsRegistry;
use kvpool_runtime::{ShardPool, ShardPoolConfig, Shutdown};
use kvpool_wire::proto::call::{MountSegment, PutEnd, PutStart, Stat};
use kvpool_wire::proto::{Endpoint, SegmentSpec, Tier};
use ractor::Actor;

const KIB: u64 = 1024;

#[test]
fn the_live_shards_eviction_task_brings_a_range_back_under_the_watermark() {
    let pool = ShardPool::start(
        &ShardPoolConfig {
            shards: 1,
            pin: false,
            ..Default::default()
        },
        Shutdown::new(),
    )
    .expect("shards");
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let config = MasterConfig {
            listen: "127.0.0.1:0".into(),
            // No housekeeping tick during the test: only the eviction task
            // may evict.
            tick_ms: 3_600_000,
            // Values are kept from eviction for a lease after their put.
            lease_ttl_ms: 300,
            ..Default::default()
        };
        let (high, ratio) = (config.high_watermark, config.eviction_ratio);
        let args = MasterArgs {
            shards: pool.handle(),
            config,
            key: None,
            metrics: MetricsRegistry::new(),
        };
        let (master, _join) = Actor::spawn(None, Master, args).await.expect("master");
        let spec = SegmentSpec {
            name: "node-a:7300:1".into(),
            size: 100 * KIB,
            endpoint: Endpoint {
                host: "127.0.0.1".into(),
                port: 7300,
                nr_shards: 1,
            },
            slice_bytes: 100 * KIB,
            host_id: "node-a".into(),
            tier: Tier::Dram,
            nvme: None,
        };
        call(&master, MountSegment { client_id: 1, spec })
            .await
            .expect("mount");
        let below = (high * 100.0) as u64; // objects of 1 KiB up to the watermark
        for i in 0..=below {
            if i == below {
                // A lease past the puts, so that the episode may take them.
                tokio::time::sleep(Duration::from_millis(400)).await;
            }
            let key = format!("k{i}").into_bytes();
            call(
                &master,
                PutStart {
                    client_id: 7,
                    key: key.clone(),
                    len: KIB,
                    opts: Default::default(),
                },
            )
            .await
            .expect("put_start");
            call(
                &master,
                PutEnd {
                    client_id: 7,
                    put_id: 0,
                    key,
                    checksum: None,
                },
            )
            .await
            .expect("put_end");
            if i < below {
                let s = call(&master, Stat).await.expect("stat");
                assert_eq!(s.evictions, 0, "at or below the watermark after {i}");
            }
        }
        // The last put took the range past the watermark; the eviction task
        // frees the ratio on its own.
        let want = (ratio * 100.0).ceil() as u64;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let s = call(&master, Stat).await.expect("stat");
            if s.evictions >= want {
                assert_eq!(s.evictions, want, "one episode: {s:?}");
                assert_eq!(s.keys, below + 1 - want, "{s:?}");
                break;
            }
            assert!(
                Instant::now() < deadline,
                "no eviction episode within 10 s: {s:?}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        master.stop(None);
    });
    pool.shutdown_and_join().expect("shutdown");
}
