//! The NVMe tier through real processes: DRAM filled to 3x its size stays
//! readable (objects demoted to NVMe, promoted back on reads), and a storage
//! node killed with SIGKILL and restarted on the same NVMe path brings its
//! objects back through the master, with a corrupted one reported as such.

use crate::common;

use std::path::Path;
use std::time::Duration;

use kvpool_client::Client;
use kvpool_config::ClientConfig;
use kvpool_wire::proto::Tier;
use kvpool_wire::{ErrorCode, KvError};
use xxhash_rust::xxh3::xxh3_64;

use common::{put_patiently, scratch_dir as dir, value, write_config};

#[test]
fn dram_filled_to_three_times_its_size_stays_readable_through_the_nvme_tier() {
    let d = dir("nvme-fill");
    let nvme = d.join("tier.kvnv");
    let cfg = write_config(
        &d,
        "node.toml",
        &format!(
            "[master]\npromote_after_reads = 2\nlease_ttl_ms = 500\n\
             [storage.nvme]\npath = \"{}\"\ncapacity = \"512 MiB\"\npolicy = \"on_evict\"\n\
             avg_object_bytes = \"1 MiB\"\nsync_writes = false\ntask_poll_ms = 20\n",
            nvme.display()
        ),
    );
    let mut args = common::ephemeral(&["--segment-size", "64MiB"]);
    args.splice(0..0, ["--config", cfg.as_str()]);
    let node = common::start("all", &args);
    let rt = common::rt();
    rt.block_on(async {
        let c = Client::connect(&node.addr, ClientConfig::default())
            .await
            .unwrap();
        let n = 192u64; // 192 MiB through a 64 MiB DRAM segment
        let len = 1 << 20;
        for i in 0..n {
            put_patiently(&c, &format!("obj-{i}"), &value(i, len)).await;
        }
        let stat = c.stat().await.unwrap();
        assert_eq!(stat.keys, n, "nothing was dropped: {stat:?}");
        assert!(
            stat.demotions >= n - 64,
            "most objects went to NVMe: {stat:?}"
        );
        let mut on_nvme = 0;
        for i in 0..n {
            let got = c
                .get(format!("obj-{i}").as_bytes())
                .await
                .unwrap_or_else(|e| panic!("obj-{i}: {e}"));
            assert_eq!(
                xxh3_64(&got),
                xxh3_64(&value(i, len)),
                "obj-{i} byte for byte"
            );
            let info = c.describe(format!("obj-{i}").as_bytes()).await.unwrap();
            if info.replicas.iter().all(|r| r.tier == Tier::Nvme) {
                on_nvme += 1;
            }
        }
        assert!(
            on_nvme > n / 2,
            "{on_nvme} of {n} objects were served from NVMe"
        );
        // A second read of NVMe-only objects promotes them back to DRAM.
        let probe: Vec<u64> = (0..n).take(8).collect();
        for &i in &probe {
            let _ = c.get(format!("obj-{i}").as_bytes()).await.unwrap();
            let _ = c.get(format!("obj-{i}").as_bytes()).await.unwrap();
        }
        common::eventually("a promotion", Duration::from_secs(10), || async {
            let s = c.stat().await.unwrap();
            if s.promotions > 0 {
                Ok(())
            } else {
                Err(format!("no promotion happened: {s:?}"))
            }
        })
        .await;
        let promoted = {
            let mut k = 0;
            for &i in &probe {
                let info = c.describe(format!("obj-{i}").as_bytes()).await.unwrap();
                if info.replicas.iter().any(|r| r.tier == Tier::Dram) {
                    k += 1;
                    let got = c.get(format!("obj-{i}").as_bytes()).await.unwrap();
                    assert_eq!(xxh3_64(&got), xxh3_64(&value(i, len)), "promoted obj-{i}");
                }
            }
            k
        };
        assert!(promoted > 0, "promoted objects read from DRAM again");
    });
    let _ = std::fs::remove_dir_all(&d);
}

/// Flips bytes in the value of `key` in the tier's file.
fn corrupt_value(file: &Path, key: &str) {
    let mut bytes = std::fs::read(file).unwrap();
    let needle = key.as_bytes();
    let hdr = (0..bytes.len() - 4096)
        .step_by(4096)
        .find(|&at| {
            &bytes[at..at + 4] == b"KVOB"
                && bytes[at + 64..].starts_with(needle)
                && bytes[at + 64 + needle.len()] == 0
        })
        .unwrap_or_else(|| panic!("{key}'s header in the tier's file"));
    let at = hdr + 4096 + 100;
    bytes[at] ^= 0xff;
    bytes[at + 1] ^= 0x0f;
    std::fs::write(file, &bytes).unwrap();
    std::fs::File::open(file).unwrap().sync_all().unwrap();
}

#[test]
fn a_storage_node_killed_and_restarted_on_the_same_nvme_path_serves_its_objects_again() {
    let d = dir("nvme-restart");
    let nvme = d.join("tier.kvnv");
    let mcfg = write_config(&d, "master.toml", "[master]\nclient_ttl_ms = 2000\n");
    let scfg = write_config(
        &d,
        "storage.toml",
        &format!(
            "[storage.nvme]\npath = \"{}\"\ncapacity = \"256 MiB\"\npolicy = \"write_through\"\n\
             avg_object_bytes = \"64 KiB\"\ntask_poll_ms = 20\n",
            nvme.display()
        ),
    );
    let mut margs = common::ephemeral(&[]);
    margs.splice(0..0, ["--config", mcfg.as_str()]);
    let master = common::start("master", &margs);
    let storage_args = |cfg: &str| -> Vec<String> {
        [
            "--config",
            cfg,
            "--listen",
            "127.0.0.1:0",
            "--http",
            "127.0.0.1:0",
            "--shards",
            "2",
            "--master",
            &master.addr,
            "--segment-size",
            "128MiB",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    let a = storage_args(&scfg);
    let first = common::start("storage", &a.iter().map(String::as_str).collect::<Vec<_>>());
    let rt = common::rt();
    let n = 40u64;
    let len = |i: u64| 10_000 + (i as usize * 7919) % 90_000;
    rt.block_on(async {
        let c = Client::connect(&master.addr, ClientConfig::default())
            .await
            .unwrap();
        for i in 0..n {
            c.put(format!("obj-{i}").as_bytes(), &value(i, len(i)))
                .await
                .unwrap();
        }
        // Write-through: wait until every object has its NVMe copy.
        common::eventually("every NVMe copy", Duration::from_secs(20), || async {
            for i in 0..n {
                let info = c.describe(format!("obj-{i}").as_bytes()).await.unwrap();
                if !info.replicas.iter().any(|r| r.tier == Tier::Nvme) {
                    return Err(format!("obj-{i} has no NVMe copy yet"));
                }
            }
            Ok(())
        })
        .await;
        // Removed at the master: the node drops the NVMe copies too, so they
        // do not come back after the restart. obj-38 is then put again with
        // other bytes of the same length: its new copy must be these bytes,
        // never the old copy's.
        for i in [38, 39] {
            c.remove(format!("obj-{i}").as_bytes()).await.unwrap();
        }
        c.put(b"obj-38", &value(1038, len(38))).await.unwrap();
        common::eventually(
            "the new obj-38 on NVMe",
            Duration::from_secs(20),
            || async {
                let info = c.describe(b"obj-38").await.unwrap();
                info.replicas.iter().any(|r| r.tier == Tier::Nvme)
            },
        )
        .await;
        common::eventually(
            "the removed objects' NVMe copies dropped",
            Duration::from_secs(20),
            || async {
                let (_, m) = common::http(&first.http, "GET", "/metrics");
                m.contains("kvpool_storage_nvme_drops_total 2")
            },
        )
        .await;
    });
    first.signal(common::Signal::KILL);
    let mut first = first;
    first.wait_exit(Duration::from_secs(10)).expect("killed");
    corrupt_value(&nvme, "obj-7");
    let second = common::start("storage", &a.iter().map(String::as_str).collect::<Vec<_>>());
    rt.block_on(async {
        let c = Client::connect(&master.addr, ClientConfig::default())
            .await
            .unwrap();
        // The dead node's DRAM segment goes after client_ttl; then only the
        // restarted node's DRAM segment and its NVMe tier remain.
        common::eventually(
            "the dead node unmounted",
            Duration::from_secs(10),
            || async {
                let s = c.stat().await.unwrap();
                if s.segments.len() == 2 {
                    Ok(())
                } else {
                    Err(format!("the dead node is still mounted: {s:?}"))
                }
            },
        )
        .await;
        let e = c.get(b"obj-39").await.expect_err("obj-39 was removed");
        assert_eq!(e.code, ErrorCode::ObjectNotFound, "{e}");
        for i in 0..n - 1 {
            let want = if i == 38 {
                value(1038, len(38))
            } else {
                value(i, len(i))
            };
            let r: Result<Vec<u8>, KvError> = c.get(format!("obj-{i}").as_bytes()).await;
            if i == 7 {
                let e = r.expect_err("the corrupted object is not returned as data");
                assert_eq!(e.code, ErrorCode::Corrupt, "{e}");
            } else {
                let v = r.unwrap_or_else(|e| panic!("obj-{i} after the restart: {e}"));
                assert_eq!(xxh3_64(&v), xxh3_64(&want), "obj-{i} byte for byte");
            }
        }
    });
    drop(second);
    let _ = std::fs::remove_dir_all(&d);
}

/// A reader's NVMe location may be stale: the tier evicts on its own, and
/// reuses the freed slot for the next copy, maybe another key's of the same
/// size, which a value without a checksum could not tell apart. So a
/// `ReadNvme` names its key and the node reads the slot only while it holds
/// that key's copy: a read of "a"'s location (with its own grant) under the
/// name "b" is `ObjectNotFound`, under "a" the bytes of "a".
#[test]
fn an_nvme_read_is_served_only_for_the_key_whose_copy_the_slot_holds() {
    use kvpool_wire::frame::FrameKind;
    use kvpool_wire::proto::{DataRequest, DataResponse};
    use std::io::Read;
    use std::net::TcpStream;

    let d = dir("nvme-read-key");
    let nvme = d.join("tier.kvnv");
    let cfg = write_config(
        &d,
        "node.toml",
        &format!(
            "[storage.nvme]\npath = \"{}\"\ncapacity = \"64 MiB\"\npolicy = \"write_through\"\n\
             sync_writes = false\ntask_poll_ms = 20\n",
            nvme.display()
        ),
    );
    let mut args = common::ephemeral(&["--segment-size", "64MiB"]);
    args.splice(0..0, ["--config", cfg.as_str()]);
    let node = common::start("all", &args);
    let rt = common::rt();
    let (a, b) = (value(1, 8192), value(2, 8192));
    let rep = rt.block_on(async {
        let c = Client::connect(&node.addr, ClientConfig::default())
            .await
            .unwrap();
        c.put(b"a", &a).await.unwrap();
        c.put(b"b", &b).await.unwrap();
        // The write-through copy's report comes within a few task polls.
        common::eventually("an NVMe copy of a", Duration::from_secs(10), || async {
            let reps = c.describe(b"a").await.unwrap().replicas;
            reps.into_iter().find(|r| r.tier == Tier::Nvme)
        })
        .await
    });
    let read_as = |key: &[u8]| -> Result<Vec<u8>, ErrorCode> {
        let mut s = TcpStream::connect(rep.endpoint.shard_addr(rep.data_shard())).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let req = DataRequest::ReadNvme {
            segment_id: rep.segment_id,
            loc: rep.offset,
            len: rep.len,
            grant: rep.grant,
            key: key.to_vec(),
        };
        let DataResponse::Data { len } =
            common::exchange(&mut s, FrameKind::DataRequest, 7, &req, &[])?
        else {
            panic!("an answer other than Data");
        };
        let mut v = vec![0u8; len as usize];
        s.read_exact(&mut v).unwrap();
        Ok(v)
    };
    assert_eq!(read_as(b"b"), Err(ErrorCode::ObjectNotFound));
    assert_eq!(read_as(b"a").expect("a's own read"), a);
    drop(node);
    let _ = std::fs::remove_dir_all(&d);
}
