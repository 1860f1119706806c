//! A lone master killed with SIGKILL under load and restarted on the same
//! state directory (`--state-dir`): every object whose put returned Ok
//! before the kill reads back byte for byte, DRAM and NVMe alike; puts in
//! flight at the kill end with an error by their deadline; after the
//! restart, new puts and reads of the old objects are all byte-exact (no
//! space that holds an object is handed out again).

use crate::common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvpool_client::Client;
use kvpool_config::ClientConfig;
use kvpool_wire::proto::{PutOptions, Tier};
use kvpool_wire::ErrorCode;
use xxhash_rust::xxh3::xxh3_64;

use common::{scratch_dir, value, write_config, Signal};

const WORKERS: u64 = 8;

/// Value sizes: a spread from 4 KiB to 200 KiB.
fn len_of(i: u64) -> usize {
    4096 + ((i.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40) % (196 * 1024)) as usize
}

fn client_cfg() -> ClientConfig {
    ClientConfig {
        timeout_ms: 5_000,
        ..ClientConfig::default()
    }
}

/// The objects whose put returned Ok: key -> (seed, len).
type Acked = Arc<Mutex<BTreeMap<String, (u64, usize)>>>;

/// 8 clients putting (and reading back what they put) until `stop` or
/// `max` puts each; each call's time is checked against the client's
/// deadline.
#[allow(clippy::too_many_arguments)]
fn workers(
    rt: &tokio::runtime::Runtime,
    master: &str,
    prefix: &'static str,
    max: u64,
    acked: &Acked,
    stop: &Arc<AtomicBool>,
    after_kill: &Arc<AtomicU64>,
    killed: &Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<Vec<String>>> {
    (0..WORKERS)
        .map(|w| {
            let (master, acked, stop) = (master.to_string(), acked.clone(), stop.clone());
            let (after_kill, killed) = (after_kill.clone(), killed.clone());
            rt.spawn(async move {
                let c = Client::connect(&master, client_cfg()).await.unwrap();
                let mut errors = Vec::new();
                let mut i = 0u64;
                while !stop.load(Ordering::Acquire) && i < max {
                    let seed = w * 1_000_000 + i;
                    let key = format!("{prefix}-{w}-{i}");
                    let len = len_of(seed);
                    let v = value(seed, len);
                    let was_killed = killed.load(Ordering::Acquire);
                    let t = Instant::now();
                    let r = c.put(key.as_bytes(), &v).await;
                    let took = t.elapsed();
                    assert!(
                        took < Duration::from_secs(10),
                        "a put took {took:?}: past its deadline"
                    );
                    match r {
                        Ok(()) => {
                            acked.lock().unwrap().insert(key.clone(), (seed, len));
                            // Read it back now and then: reads under load.
                            if i % 3 == 0 {
                                if let Ok(got) = c.get(key.as_bytes()).await {
                                    assert_eq!(xxh3_64(&got), xxh3_64(&v), "{key} read back");
                                }
                            }
                        }
                        Err(e) => errors.push(format!("{key}: {e}")),
                    }
                    if was_killed {
                        after_kill.fetch_add(1, Ordering::AcqRel);
                    }
                    i += 1;
                }
                errors
            })
        })
        .collect()
}

async fn read_all(c: &Client, acked: &BTreeMap<String, (u64, usize)>) -> Result<(), String> {
    for (k, &(seed, len)) in acked {
        let got = c.get(k.as_bytes()).await.map_err(|e| format!("{k}: {e}"))?;
        if got.len() != len || xxh3_64(&got) != xxh3_64(&value(seed, len)) {
            return Err(format!("{k}: other bytes than were put"));
        }
    }
    Ok(())
}

/// Reads every acknowledged object, polling until all read back (their
/// segments mount again within a ping) or `within` passes.
fn wait_all_readable(
    rt: &tokio::runtime::Runtime,
    master: &str,
    acked: &BTreeMap<String, (u64, usize)>,
    within: Duration,
) {
    rt.block_on(async {
        let c = Client::connect(master, client_cfg()).await.unwrap();
        common::eventually(
            "after the restart, every acknowledged object read back",
            within,
            || read_all(&c, acked),
        )
        .await;
    });
}

fn start_master(addr: &str, cfg: &str, state: &str) -> common::Proc {
    common::start(
        "master",
        &[
            "--config",
            cfg,
            "--listen",
            addr,
            "--http",
            "127.0.0.1:0",
            "--shards",
            "2",
            "--state-dir",
            state,
        ],
    )
}

#[test]
fn a_lone_master_killed_and_restarted_on_its_state_dir_forgets_no_object() {
    let d = scratch_dir("durability-kill");
    let state = d.join("state");
    let nvme = d.join("tier.kvnv");
    // Random placement: the small node's DRAM overflows into its NVMe tier
    // (objects there NVMe-only), the large DRAM-only node never evicts.
    let mcfg = write_config(
        &d,
        "master.toml",
        "[master]\nplacement = \"random\"\nclient_ttl_ms = 10000\n",
    );
    let ncfg = write_config(
        &d,
        "node.toml",
        &format!(
            "[storage]\nping_interval_ms = 200\n\
             [storage.nvme]\npath = \"{}\"\ncapacity = \"256 MiB\"\npolicy = \"on_evict\"\n\
             avg_object_bytes = \"64 KiB\"\nsync_writes = false\ntask_poll_ms = 20\n",
            nvme.display()
        ),
    );
    let acfg = write_config(&d, "dram.toml", "[storage]\nping_interval_ms = 200\n");
    let addr = common::fixed_addr(2);
    let mut master = start_master(&addr, &mcfg, state.to_str().unwrap());
    let _dram = common::start_storage(&addr, "96MiB", &["--config", &acfg]);
    let tiered = common::start_storage(&addr, "8MiB", &["--config", &ncfg]);
    let rt = common::rt();

    // Phase 1: 8 clients put and read; the master is killed under them.
    let acked: Acked = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let after_kill = Arc::new(AtomicU64::new(0));
    let killed = Arc::new(AtomicBool::new(false));
    let hs = workers(
        &rt,
        &addr,
        "a",
        u64::MAX,
        &acked,
        &stop,
        &after_kill,
        &killed,
    );
    common::eventually_blocking(
        "the clients' progress (320 puts acknowledged)",
        Duration::from_secs(60),
        || {
            let n = acked.lock().unwrap().len();
            if n >= 320 {
                Ok(())
            } else {
                Err(format!("{n} acknowledged"))
            }
        },
    );
    killed.store(true, Ordering::Release);
    master.signal(Signal::KILL);
    master.wait_exit(Duration::from_secs(10)).expect("killed");
    // Every client's call in flight at the kill, and one after, ends.
    common::eventually_blocking(
        "the calls in flight at the kill, and one after, ended",
        Duration::from_secs(30),
        || after_kill.load(Ordering::Acquire) >= 2 * WORKERS,
    );
    stop.store(true, Ordering::Release);
    let mut errors = Vec::new();
    for h in hs {
        errors.extend(rt.block_on(h).unwrap());
    }
    assert!(!errors.is_empty(), "puts after the kill failed");
    let before: BTreeMap<_, _> = acked.lock().unwrap().clone();
    println!(
        "{} objects acknowledged before the kill; {} puts failed (e.g. {})",
        before.len(),
        errors.len(),
        errors[0]
    );

    // Phase 2: the master comes back on the same directory; the nodes
    // mount again; every acknowledged object reads back.
    let master = start_master(&addr, &mcfg, state.to_str().unwrap());
    wait_all_readable(&rt, &master.addr, &before, Duration::from_secs(30));
    let tiers = rt.block_on(async {
        let c = Client::connect(&master.addr, client_cfg()).await.unwrap();
        let (mut dram, mut nvme_only) = (0, 0);
        for k in before.keys() {
            let info = c.describe(k.as_bytes()).await.unwrap();
            if info.replicas.iter().all(|r| r.tier == Tier::Nvme) {
                nvme_only += 1;
            } else {
                dram += 1;
            }
        }
        (dram, nvme_only)
    });
    println!(
        "after the restart: {} in DRAM, {} on NVMe only",
        tiers.0, tiers.1
    );
    assert!(
        tiers.0 > 0 && tiers.1 > 0,
        "both tiers were tried: {tiers:?}"
    );

    // Phase 3: new puts under 8 clients while the old objects are read; then
    // every object, old and new, reads back byte for byte.
    let stop = Arc::new(AtomicBool::new(false));
    let acked2: Acked = Arc::default();
    let never = Arc::new(AtomicBool::new(false));
    let hs = workers(
        &rt,
        &master.addr,
        "b",
        40,
        &acked2,
        &stop,
        &after_kill,
        &never,
    );
    rt.block_on(async {
        let c = Client::connect(&master.addr, client_cfg()).await.unwrap();
        read_all(&c, &before).await.unwrap();
    });
    for h in hs {
        let errs = rt.block_on(h).unwrap();
        assert!(errs.is_empty(), "puts after the restart failed: {errs:?}");
    }
    let after: BTreeMap<_, _> = acked2.lock().unwrap().clone();
    let r = rt.block_on(async {
        let c = Client::connect(&master.addr, client_cfg()).await.unwrap();
        read_all(&c, &before).await?;
        read_all(&c, &after).await
    });
    if let Err(e) = r {
        panic!(
            "after new puts: {e}\nmaster:\n{}\ntiered node:\n{}",
            master.stderr(),
            tiered.stderr()
        );
    }
    let _ = std::fs::remove_dir_all(&d);
}

/// A master on a state directory with one DRAM-only storage node pinging
/// every 200 ms, and a client config with a 10 s deadline.
struct Restartable {
    d: std::path::PathBuf,
    state: String,
    mcfg: String,
    master: common::Proc,
    node: common::Proc,
    rt: tokio::runtime::Runtime,
    cfg: ClientConfig,
}

impl Restartable {
    fn new(name: &str) -> Self {
        let d = scratch_dir(name);
        let state = d.join("state").to_str().unwrap().to_string();
        let ncfg = write_config(&d, "node.toml", "[storage]\nping_interval_ms = 200\n");
        let mcfg = write_config(&d, "master.toml", "[master]\nclient_ttl_ms = 10000\n");
        let addr = common::fixed_addr(2);
        let master = start_master(&addr, &mcfg, &state);
        let node = common::start_storage(&addr, "32MiB", &["--config", &ncfg]);
        let cfg = ClientConfig {
            timeout_ms: 10_000,
            ..ClientConfig::default()
        };
        Self {
            d,
            state,
            mcfg,
            master,
            node,
            rt: common::rt(),
            cfg,
        }
    }

    /// Stops the node (SIGSTOP), kills the master and starts it again on
    /// the same address and state directory.
    fn restart_master_with_the_node_stopped(&mut self) {
        self.node.freeze();
        self.master.signal(Signal::KILL);
        self.master
            .wait_exit(Duration::from_secs(10))
            .expect("killed");
        self.master = start_master(&self.master.addr, &self.mcfg, &self.state);
    }
}

/// Waits (10 s at most) until the master at `http` has answered `n`
/// `put_start` calls with an error (a put told to wait: `TryAgain`,
/// `ReplicaNotReady`), retries included: several pauses long, so a put that
/// ended on its first answer (a `NoSpace`, say) has finished by then.
async fn puts_told_to_wait(http: &str, n: f64) {
    let http = http.to_string();
    common::eventually("puts told to wait", Duration::from_secs(10), || {
        let http = http.clone();
        async move {
            tokio::task::spawn_blocking(move || common::series(&http, common::PUT_START_ERRORS))
                .await
                .unwrap()
                >= n
        }
    })
    .await;
}

/// A put of a key the restarted master holds only as a recovered object
/// (its node has not pinged since) waits for the node, within its deadline,
/// instead of failing: a replace then replaces it, a plain put finds it
/// stored. (A client whose put took effect on a leader that died before it
/// answered asks the next leader again, which meets exactly this.)
#[test]
fn a_put_of_a_key_still_being_recovered_waits_for_its_segment_to_mount_again() {
    let mut p = Restartable::new("durability-parked-put");
    let (old_a, old_b) = (value(1, 100_000), value(2, 50_000));
    p.rt.block_on(async {
        let c = Client::connect(&p.master.addr, p.cfg.clone())
            .await
            .unwrap();
        c.put(b"replaced", &old_a).await.unwrap();
        c.put(b"kept", &old_b).await.unwrap();
    });
    // Both keys are recovered, their segment not mounted yet.
    p.restart_master_with_the_node_stopped();
    let new_a = value(3, 70_000);
    let (replace, plain) = p.rt.block_on(async {
        let c = Client::connect(&p.master.addr, p.cfg.clone())
            .await
            .unwrap();
        let e = c.get(b"replaced").await.unwrap_err();
        assert_eq!(e.code, ErrorCode::ReplicaNotReady, "before the mount: {e}");
        let replace = tokio::spawn({
            let (c, v) = (c.clone(), new_a.clone());
            async move {
                let opts = PutOptions {
                    replace: true,
                    ..PutOptions::default()
                };
                c.put_with(b"replaced", &v, &opts).await
            }
        });
        let plain = tokio::spawn({
            let (c, v) = (c.clone(), old_b.clone());
            async move { c.put(b"kept", &v).await }
        });
        // Both puts told to wait by the master, asking again, and still
        // waiting.
        puts_told_to_wait(&p.master.http, 6.0).await;
        assert!(
            !replace.is_finished() && !plain.is_finished(),
            "the puts wait while the keys are being recovered"
        );
        p.node.signal(Signal::CONT);
        (replace.await.unwrap(), plain.await.unwrap())
    });
    replace.expect("a replace of a recovered key, once its segment mounted");
    let e = plain.expect_err("a plain put of a stored key");
    assert_eq!(e.code, ErrorCode::ObjectAlreadyExists, "{e}");
    p.rt.block_on(async {
        let c = Client::connect(&p.master.addr, p.cfg.clone())
            .await
            .unwrap();
        assert_eq!(xxh3_64(&c.get(b"replaced").await.unwrap()), xxh3_64(&new_a));
        assert_eq!(xxh3_64(&c.get(b"kept").await.unwrap()), xxh3_64(&old_b));
    });
    let _ = std::fs::remove_dir_all(&p.d);
}

/// The config of a storage node whose NVMe tier (`dir/tier.kvnv`) takes a
/// copy of every object at its put.
fn write_through_node_config(dir: &std::path::Path) -> String {
    write_config(
        dir,
        "node.toml",
        &format!(
            "[storage]\nping_interval_ms = 200\n\
             [storage.nvme]\npath = \"{}\"\ncapacity = \"64 MiB\"\npolicy = \"write_through\"\n\
             avg_object_bytes = \"64 KiB\"\ntask_poll_ms = 20\n",
            dir.join("tier.kvnv").display()
        ),
    )
}

/// Puts each `(key, value)` and waits until each has an NVMe copy.
async fn put_on_nvme(c: &Client, objects: &[(&[u8], &[u8])]) {
    for (k, v) in objects {
        c.put(k, v).await.unwrap();
    }
    for (k, _) in objects {
        common::eventually("an NVMe copy", Duration::from_secs(20), || async {
            let info = c.describe(k).await.unwrap();
            info.replicas.iter().any(|r| r.tier == Tier::Nvme)
        })
        .await;
    }
}

/// Once the node has reported its tier, `kept` reads back byte-exact, and
/// `gone` stays removed, not even a while later (the whole tier was
/// reported before the kept object was); only the kept key is stored.
async fn kept_back_and_gone_stays_removed(c: &Client, kept: &[u8], master: &common::Proc) {
    let v = common::eventually("the kept object", Duration::from_secs(20), || async {
        c.get(b"kept").await.map_err(|e| e.to_string())
    })
    .await;
    assert_eq!(xxh3_64(&v), xxh3_64(kept));
    for _ in 0..10 {
        match c.get(b"gone").await {
            Ok(v) => panic!(
                "the removed key came back ({} bytes): {}",
                v.len(),
                master.stderr()
            ),
            Err(e) => assert_eq!(e.code, ErrorCode::ObjectNotFound, "the removed key: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(c.stat().await.unwrap().keys, 1, "only the kept key");
}

/// A key removed while its node could not be told (stopped) does not come
/// back from its NVMe copy when the master restarts on its state directory
/// and the node restarts and reports its tier: the Drop the copy is owed is
/// in the state directory, so the report is refused and the Drop goes out.
/// Before, the owed Drop lived only in the master's memory and the report
/// brought the removed object back.
#[test]
fn a_removed_key_does_not_come_back_from_its_nvme_copy_when_master_and_node_restart() {
    let d = scratch_dir("durability-owed-drop");
    let state = d.join("state");
    let ncfg = write_through_node_config(&d);
    let mcfg = write_config(&d, "master.toml", "[master]\nclient_ttl_ms = 10000\n");
    let addr = common::fixed_addr(2);
    let mut master = start_master(&addr, &mcfg, state.to_str().unwrap());
    let mut node = common::start_storage(&addr, "32MiB", &["--config", &ncfg]);
    let rt = common::rt();
    let cfg = client_cfg();
    let (gone, kept) = (value(11, 30_000), value(12, 40_000));
    rt.block_on(async {
        let c = Client::connect(&addr, cfg.clone()).await.unwrap();
        put_on_nvme(&c, &[(b"gone", &gone), (b"kept", &kept)]).await;
        // The node cannot take its Drop: it is stopped.
        node.freeze();
        c.remove(b"gone").await.unwrap();
    });
    master.signal(Signal::KILL);
    master.wait_exit(Duration::from_secs(10)).expect("killed");
    node.signal(Signal::KILL);
    node.wait_exit(Duration::from_secs(10)).expect("killed");
    let master = start_master(&addr, &mcfg, state.to_str().unwrap());
    let _node = common::start_storage(&addr, "32MiB", &["--config", &ncfg]);
    rt.block_on(async {
        let c = Client::connect(&master.addr, cfg.clone()).await.unwrap();
        // The restarted node reports its tier: the kept object is back,
        // the removed one is not.
        kept_back_and_gone_stays_removed(&c, &kept, &master).await;
    });
    let _ = std::fs::remove_dir_all(&d);
}

/// Issue 32, copy identity: a key removed while the restarted master waited
/// for its node (the object recovered, its tier not back), then a second
/// `kill -9` and restart of the master before the node came back. The
/// removed key stays removed; the other object comes back. Before, what
/// the removal owed the node's tier was in the first restarted master's
/// memory only, and the second adopted the node's copy of a key its image
/// did not hold: the removed key came back.
#[test]
fn a_key_removed_while_its_node_was_away_stays_removed_across_two_master_restarts() {
    let d = scratch_dir("durability-removed-away");
    let state = d.join("state");
    let ncfg = write_through_node_config(&d);
    // A tier is listed once it has been mounted `client_ttl_ms` without a
    // report; the second start must remove the key before its recovered
    // objects are given up (also `client_ttl_ms`).
    let mcfg = write_config(&d, "master.toml", "[master]\nclient_ttl_ms = 5000\n");
    let addr = common::fixed_addr(2);
    let mut master = start_master(&addr, &mcfg, state.to_str().unwrap());
    let mut node = common::start_storage(&addr, "32MiB", &["--config", &ncfg]);
    let rt = common::rt();
    let cfg = client_cfg();
    let (gone, kept) = (value(13, 30_000), value(14, 40_000));
    rt.block_on(async {
        let c = Client::connect(&addr, cfg.clone()).await.unwrap();
        put_on_nvme(&c, &[(b"gone", &gone), (b"kept", &kept)]).await;
        // Both master shards list the tier (logged, and recorded in the
        // state directory).
        common::eventually(
            "both shards list the tier",
            Duration::from_secs(20),
            || async { master.stderr().matches("NVMe tier listed").count() >= 2 },
        )
        .await;
    });
    node.signal(Signal::KILL);
    node.wait_exit(Duration::from_secs(10)).expect("killed");
    master.signal(Signal::KILL);
    master.wait_exit(Duration::from_secs(10)).expect("killed");
    let mut master = start_master(&addr, &mcfg, state.to_str().unwrap());
    rt.block_on(async {
        let c = Client::connect(&master.addr, cfg.clone()).await.unwrap();
        c.remove(b"gone")
            .await
            .expect("the recovered key is removed");
    });
    master.signal(Signal::KILL);
    master.wait_exit(Duration::from_secs(10)).expect("killed");
    let master = start_master(&addr, &mcfg, state.to_str().unwrap());
    let _node = common::start_storage(&addr, "32MiB", &["--config", &ncfg]);
    rt.block_on(async {
        let c = Client::connect(&master.addr, cfg.clone()).await.unwrap();
        kept_back_and_gone_stays_removed(&c, &kept, &master).await;
    });
    let _ = std::fs::remove_dir_all(&d);
}

/// A put made right after the master restarted on its state directory,
/// before its storage node has pinged it again, waits for the node within
/// its deadline and lands, instead of failing `NoSpace` (the restarted
/// master has no segment mounted for up to a ping; a new HA leader the same).
#[test]
fn a_put_right_after_a_restart_waits_for_the_nodes_to_mount_instead_of_no_space() {
    let mut p = Restartable::new("durability-put-after-restart");
    let before = value(21, 10_000);
    p.rt.block_on(async {
        let c = Client::connect(&p.master.addr, p.cfg.clone())
            .await
            .unwrap();
        c.put(b"before", &before).await.unwrap();
    });
    p.restart_master_with_the_node_stopped();
    let after = value(22, 20_000);
    p.rt.block_on(async {
        let c = Client::connect(&p.master.addr, p.cfg.clone())
            .await
            .unwrap();
        let put = tokio::spawn({
            let (c, v) = (c.clone(), after.clone());
            async move { c.put(b"after", &v).await }
        });
        puts_told_to_wait(&p.master.http, 3.0).await;
        if put.is_finished() {
            panic!("the put did not wait for the node: {:?}", put.await);
        }
        p.node.signal(Signal::CONT);
        put.await
            .unwrap()
            .expect("the put, once the node mounted again");
        assert_eq!(xxh3_64(&c.get(b"after").await.unwrap()), xxh3_64(&after));
        assert_eq!(xxh3_64(&c.get(b"before").await.unwrap()), xxh3_64(&before));
    });
    let _ = std::fs::remove_dir_all(&p.d);
}

/// A segment drained before the master is killed is draining again once
/// its node mounts it on the restarted master (the state directory records
/// the drain): stat says so and no new put is placed on it. Before, the
/// restart forgot the drain and placement used the segment again.
#[test]
fn a_drained_segment_stays_drained_across_a_master_restart() {
    let mut p = Restartable::new("durability-drain");
    let ncfg = write_config(&p.d, "node-b.toml", "[storage]\nping_interval_ms = 200\n");
    let _b = common::start_storage(&p.master.addr, "32MiB", &["--config", &ncfg]);
    let stat_of = |c: &Client, rt: &tokio::runtime::Runtime| rt.block_on(c.stat()).unwrap();
    let c =
        p.rt.block_on(Client::connect(&p.master.addr, p.cfg.clone()))
            .unwrap();
    common::eventually_blocking("both segments mounted", Duration::from_secs(20), || {
        stat_of(&c, &p.rt).segments.len() == 2
    });
    let drained = stat_of(&c, &p.rt).segments[0].id;
    p.rt.block_on(c.drain_segment(drained)).unwrap();
    drop(c);
    p.master.signal(Signal::KILL);
    p.master.wait_exit(Duration::from_secs(10)).expect("killed");
    p.master = start_master(&p.master.addr, &p.mcfg, &p.state);
    let c =
        p.rt.block_on(Client::connect(&p.master.addr, p.cfg.clone()))
            .unwrap();
    common::eventually_blocking(
        "both segments mounted again",
        Duration::from_secs(20),
        || stat_of(&c, &p.rt).segments.len() == 2,
    );
    let s = stat_of(&c, &p.rt);
    assert!(
        s.segments.iter().any(|g| g.id == drained && g.draining),
        "the drain is remembered: {s:?}"
    );
    p.rt.block_on(common::puts_avoid(&c, drained));
    let _ = std::fs::remove_dir_all(&p.d);
}
