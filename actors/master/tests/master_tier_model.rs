//! Property test of the NVMe tier's transitions: random sequences of puts
//! and replaces (upserts, some soft- or hard-pinned), reads (which extend
//! leases and promote), removals, time (which ends leases and pins, evicts
//! and demotes), the node taking its tasks and answering them in any order
//! (`Stored`, `PersistFailed`, `Promoted` ok or not), and the tier evicting
//! copies on its own (`Evicted`), on a small DRAM segment whose node has a
//! tier. In half the runs the off-path eviction takes a few replicas after
//! each call instead of finishing at once, so episodes run while the node
//! reports. After every step every shard's space accounting and eviction
//! index must hold (`ShardState::check_invariants`), and every object the
//! master lists must have a replica where its answers say.
//!
//! The run also follows the bytes: which put's value each DRAM range and
//! each NVMe copy holds (the node copies whatever the range holds when it
//! runs a task, as the real one does, within `stale_put_grace_ms` of taking
//! it). Every replica a read is sent to must hold the value of the key's
//! last completed put, never an earlier version's, another key's, or a
//! range a writer was still filling: with or without writer checksums.
//!
//! A failure prints the seed; `KVPOOL_MODEL_SEED=<seed>` replays that case.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use kvpool_config::MasterConfig;
use kvpool_master::core::{EvictDrive, MasterCore};
use kvpool_master::journal::{self, ObjectRec};
use kvpool_wire::proto::call::{self, Call};
use kvpool_wire::proto::{
    segment_id_for, Endpoint, MasterRequest, NodeTask, NvmeAttach, NvmeUpdate, PutOptions,
    SegmentId, SegmentSpec, Tier,
};
use kvpool_wire::KvError;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const NODE: u64 = 500;
const WRITER: u64 = 7;
const SHARDS: u32 = 2;
const KEYS: usize = 40;

fn spec(name: &str, size: u64, tier: Tier, nvme: Option<NvmeAttach>) -> SegmentSpec {
    SegmentSpec {
        name: name.into(),
        size,
        endpoint: Endpoint {
            host: "127.0.0.1".into(),
            port: 7300,
            nr_shards: 1,
        },
        slice_bytes: size,
        host_id: "host-a".into(),
        tier,
        nvme,
    }
}

/// Counts of what a run did, so the test can say it reached every transition.
#[derive(Default, Debug)]
struct Seen {
    replaced: u64,
    stored: u64,
    demoted: u64,
    persist_failed: u64,
    promoted: u64,
    promote_failed: u64,
    tier_evicted: u64,
    steps: u64,
    /// Steps that ended with an eviction episode still under way.
    evicting: u64,
}

/// What a range or a copy holds: the value of put number n, or bytes of no
/// complete value (a writer was still filling the range).
type Content = Option<u64>;

/// The checksum of put number `n`'s value (what a writer or node computes).
fn sum_of(c: Content) -> u64 {
    match c {
        Some(n) => n.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1,
        None => 0, // no value has this checksum
    }
}

struct Run {
    m: MasterCore,
    now: u64,
    rng: ChaCha8Rng,
    dram: SegmentId,
    nvme: SegmentId,
    cfg: MasterConfig,
    seed: u64,
    /// A compaction of the master's log is under way (durable runs).
    compacting: bool,
    /// Tasks the node has taken and not answered yet, with when it took them.
    tasks: Vec<(NodeTask, u64)>,
    /// The tier's contents: location -> (key, value).
    on_disk: HashMap<u64, (Vec<u8>, Content)>,
    next_loc: u64,
    /// What each DRAM range holds, by offset.
    in_dram: HashMap<u64, Content>,
    /// The key's last completed put.
    current: HashMap<Vec<u8>, u64>,
    puts: u64,
    grace_ms: u64,
    seen: Seen,
}

impl Run {
    fn new(seed: u64) -> Self {
        Self::with_state(seed, None)
    }

    /// A run whose master keeps its state in `dir` (a fresh directory).
    fn with_state(seed: u64, dir: Option<&Path>) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let cfg = MasterConfig {
            lease_ttl_ms: 200,
            high_watermark: 0.7,
            eviction_ratio: 0.3,
            promote_after_reads: 2,
            client_ttl_ms: 1 << 40,
            ..Default::default()
        };
        let grace_ms = cfg.stale_put_grace_ms;
        let mut m = match dir {
            None => MasterCore::new(SHARDS, &cfg, seed),
            Some(d) => MasterCore::open(SHARDS, &cfg, seed, d, 0, UNIX_AT_ZERO_MS).unwrap(),
        };
        if rng.random_ratio(1, 2) {
            m.evict = EvictDrive::StepOf(rng.random_range(1..=3));
        }
        let nvme = ask(
            &mut m,
            call::MountSegment {
                client_id: NODE,
                spec: spec("nvme:host-a:/dev/x", 1 << 30, Tier::Nvme, None),
            },
            1,
        )
        .expect("mount the tier");
        assert_eq!(nvme, segment_id_for("nvme:host-a:/dev/x"));
        let attach = NvmeAttach {
            segment_id: nvme,
            write_through: rng.random_ratio(1, 3),
        };
        let dram = ask(
            &mut m,
            call::MountSegment {
                client_id: NODE,
                spec: spec("dram:host-a", 64 << 10, Tier::Dram, Some(attach)),
            },
            1,
        )
        .expect("mount the DRAM segment");
        Self {
            m,
            now: 1,
            rng,
            dram,
            nvme,
            cfg,
            seed,
            compacting: false,
            tasks: Vec::new(),
            on_disk: HashMap::new(),
            next_loc: 1,
            in_dram: HashMap::new(),
            current: HashMap::new(),
            puts: 0,
            grace_ms,
            seen: Seen::default(),
        }
    }

    fn key(&mut self) -> Vec<u8> {
        format!("k{}", self.rng.random_range(0..KEYS)).into_bytes()
    }

    fn call<C: Call>(&mut self, c: C) -> Result<C::Reply, KvError> {
        ask(&mut self.m, c, self.now)
    }

    fn step(&mut self) {
        self.seen.steps += 1;
        match self.rng.random_range(0..100) {
            0..=24 => self.put(),
            25..=44 => self.get(),
            45..=51 => self.remove(),
            52..=64 => self.take_tasks(),
            65..=84 => self.answer_task(),
            85..=87 => self.tier_evicts(),
            88..=90 if self.compacting || self.rng.random_ratio(1, 4) => {
                // A compaction of the log, in steps between calls.
                self.compacting = self.m.compact_step(self.rng.random_range(1..8)).unwrap();
            }
            _ => self.advance(),
        }
        for (i, sh) in self.m.shards.iter().enumerate() {
            if let Err(e) = sh.check_invariants() {
                panic!("shard {i} at {} ms: {e}", self.now);
            }
        }
        if self.m.shards.iter().any(|s| s.evicting()) {
            self.seen.evicting += 1;
        }
    }

    fn put(&mut self) {
        let key = self.key();
        // Few sizes: a replace often has its object's size (then only the
        // checksum, when there is one, tells the versions apart).
        let len = [1u64, 700, 2048, 4096, 9000][self.rng.random_range(0..5)];
        let replace = self.rng.random_ratio(1, 2);
        let opts = PutOptions {
            replace,
            soft_pin_ttl_ms: if self.rng.random_ratio(1, 4) {
                self.rng.random_range(1..600)
            } else {
                0
            },
            hard_pin: self.rng.random_ratio(1, 20),
            ..PutOptions::default()
        };
        let Ok(replicas) = self.call(call::PutStart {
            client_id: WRITER,
            key: key.clone(),
            len,
            opts,
        }) else {
            return; // no room, a put under way, ...: all legal answers
        };
        // The writer fills its ranges: no complete value there until it ends.
        for r in &replicas {
            self.in_dram.insert(r.offset, None);
        }
        if self.rng.random_ratio(1, 8) {
            let _ = self.call(call::PutRevoke {
                client_id: WRITER,
                put_id: 0,
                key,
            });
            return;
        }
        self.puts += 1;
        let n = self.puts;
        for r in &replicas {
            self.in_dram.insert(r.offset, Some(n));
        }
        let checksum = self.rng.random_ratio(1, 2).then_some(sum_of(Some(n)));
        let ended = self.call(call::PutEnd {
            client_id: WRITER,
            put_id: 0,
            key: key.clone(),
            checksum,
        });
        if ended.is_ok() && self.current.insert(key, n).is_some() && replace {
            self.seen.replaced += 1;
        }
    }

    fn get(&mut self) {
        let key = self.key();
        if let Ok(replicas) = self.call(call::GetReplicaList { key: key.clone() }) {
            let want = Some(self.current[&key]);
            for r in &replicas {
                match r.tier {
                    Tier::Dram => {
                        assert_eq!(r.segment_id, self.dram, "{r:?}");
                        assert_eq!(
                            self.in_dram.get(&r.offset),
                            Some(&want),
                            "a DRAM replica of {} holds the last value put",
                            String::from_utf8_lossy(&key)
                        );
                    }
                    Tier::Nvme => {
                        assert_eq!(r.segment_id, self.nvme, "{r:?}");
                        assert_eq!(
                            self.on_disk.get(&r.offset),
                            Some(&(key.clone(), want)),
                            "an NVMe replica the tier holds for this key, of its last value"
                        );
                    }
                }
            }
        }
    }

    fn remove(&mut self) {
        let key = self.key();
        let force = self.rng.random_ratio(1, 2);
        let _ = self.call(call::Remove { key, force });
    }

    fn take_tasks(&mut self) {
        for shard in 0..SHARDS {
            let got = self.call(call::NodeTasks {
                client_id: NODE,
                shard,
                segments: vec![self.dram, self.nvme],
                max: 8,
            });
            let now = self.now;
            self.tasks.extend(
                got.expect("the owner's tasks")
                    .into_iter()
                    .map(|t| (t, now)),
            );
        }
    }

    fn update(&mut self, u: NvmeUpdate) -> Result<(), KvError> {
        let mut v = self.call(call::NvmeUpdates {
            client_id: NODE,
            updates: vec![u],
        })?;
        Result::from(v.remove(0))
    }

    fn answer_task(&mut self) {
        if self.tasks.is_empty() {
            return;
        }
        let i = self.rng.random_range(0..self.tasks.len());
        let (t, _) = self.tasks.swap_remove(i);
        self.answer(t);
    }

    /// Runs one task as the node does: copies whatever the range or copy
    /// holds now, refusing bytes that do not match the task's checksum.
    fn answer(&mut self, t: NodeTask) {
        match t {
            NodeTask::Persist(p) => {
                let content = self.in_dram.get(&p.offset).copied().flatten();
                let matches = p.checksum.is_none_or(|c| c == sum_of(content));
                if !matches || self.rng.random_ratio(1, 5) {
                    if self.update(p.failed()).is_ok() {
                        self.seen.persist_failed += 1;
                    }
                    return;
                }
                let loc = self.next_loc;
                self.next_loc += 1;
                let (key, demote) = (p.key.clone(), p.demote);
                // The tier holds the copy whether or not the master takes it
                // (a refused report: the node drops it, as the real one does).
                if self
                    .update(p.stored(self.nvme, loc, sum_of(content)))
                    .is_ok()
                {
                    self.on_disk.insert(loc, (key, content));
                    self.seen.stored += 1;
                    if demote {
                        self.seen.demoted += 1;
                    }
                }
            }
            NodeTask::Promote(p) => {
                // The node reads the copy and writes it into the range.
                let copy = match self.on_disk.get(&p.loc) {
                    Some((k, c)) if *k == p.key && p.checksum.is_none_or(|s| s == sum_of(*c)) => {
                        Some(*c)
                    }
                    _ => None,
                };
                let ok = copy.is_some() && !self.rng.random_ratio(1, 5);
                self.in_dram.insert(p.offset, copy.flatten().filter(|_| ok));
                if self.update(p.promoted(ok)).is_ok() {
                    if ok {
                        self.seen.promoted += 1;
                    } else {
                        self.seen.promote_failed += 1;
                    }
                }
            }
            NodeTask::Drop(d) => {
                if self.on_disk.get(&d.loc).is_some_and(|(k, _)| *k == d.key) {
                    self.on_disk.remove(&d.loc);
                }
            }
            NodeTask::Fetch(_) => panic!("hot replication is off in this model"),
        }
    }

    fn tier_evicts(&mut self) {
        let Some((&loc, key)) = self
            .on_disk
            .iter()
            .nth(self.rng.random_range(0..self.on_disk.len().max(1)))
        else {
            return;
        };
        let key = key.0.clone();
        self.on_disk.remove(&loc);
        let u = NvmeUpdate::Evicted {
            key,
            nvme: self.nvme,
            loc,
            version: 0,
        };
        if self.update(u).is_ok() {
            self.seen.tier_evicted += 1;
        }
    }

    fn advance(&mut self) {
        self.now += self.rng.random_range(1..300);
        // The master keeps a range a node may be copying for the grace
        // after it lets go of it: a node finishes its tasks within that.
        let (now, grace) = (self.now, self.grace_ms);
        let due: Vec<NodeTask> = self
            .tasks
            .extract_if(.., |(_, taken)| now >= *taken + grace / 2)
            .map(|(t, _)| t)
            .collect();
        for t in due {
            self.answer(t);
        }
        let _ = self.call(call::Ping {
            client_id: NODE,
            segments: vec![self.dram, self.nvme],
        });
        self.m.tick(self.now);
    }
}

/// Wall time at the simulated clock's 0, for durable runs.
const UNIX_AT_ZERO_MS: u64 = 1_700_000_000_000;

/// Every shard's durable state, as the state directory would record it.
fn image(m: &MasterCore) -> BTreeMap<Vec<u8>, ObjectRec> {
    m.shards.iter().flat_map(|s| s.durable_image()).collect()
}

impl Run {
    /// The master dies (its memory is dropped, the log is what a killed
    /// process leaves, maybe with a torn last record), comes back on its
    /// directory, and its node mounts again: the recovered durable state
    /// must be the one before the crash, and no range a writer held at the
    /// crash may be handed out before the writer's deadline.
    fn crash_and_recover(mut self, dir: &Path) {
        // Puts under way at the crash: their writers still hold grants.
        let mut held = Vec::new();
        for i in 0..3 {
            if let Ok(rs) = self.call(call::PutStart {
                client_id: WRITER,
                key: format!("inflight-{i}").into_bytes(),
                len: 4096,
                opts: PutOptions::default(),
            }) {
                held.extend(rs.iter().map(|r| r.offset));
            }
        }
        let before = image(&self.m);
        let now = self.now + 50;
        drop(self.m);
        if self.rng.random_ratio(1, 2) {
            // A write the crash tore: half a record at the end of a log.
            let shard = self.rng.random_range(0..SHARDS);
            let sd = journal::shard_dir(dir, shard);
            let newest = std::fs::read_dir(&sd)
                .unwrap()
                .flatten()
                .map(|e| e.file_name().into_string().unwrap())
                .filter(|n| n.starts_with("log-"))
                .max()
                .unwrap();
            let mut rec = Vec::new();
            journal::encode_gone(&mut rec, b"k1");
            let mut f = std::fs::OpenOptions::new()
                .append(true)
                .open(sd.join(newest))
                .unwrap();
            use std::io::Write;
            f.write_all(&rec[..rec.len() - 3]).unwrap();
        }
        let mut m =
            MasterCore::open(SHARDS, &self.cfg, self.seed, dir, now, UNIX_AT_ZERO_MS).unwrap();
        // The node mounts its tier and its DRAM segment again (same names).
        for (name, size, tier, attach) in [
            ("nvme:host-a:/dev/x", 1u64 << 30, Tier::Nvme, None),
            (
                "dram:host-a",
                64 << 10,
                Tier::Dram,
                Some(NvmeAttach {
                    segment_id: self.nvme,
                    write_through: false,
                }),
            ),
        ] {
            ask(
                &mut m,
                call::MountSegment {
                    client_id: NODE + 1,
                    spec: spec(name, size, tier, attach),
                },
                now,
            )
            .expect("mount again");
        }
        for (i, sh) in m.shards.iter().enumerate() {
            assert_eq!(sh.parked_len(), 0, "shard {i}: every replica is back");
            if let Err(e) = sh.check_invariants() {
                panic!("shard {i} after recovery: {e}");
            }
        }
        let after = image(&m);
        assert_eq!(
            after.len(),
            before.len(),
            "objects before the crash and after"
        );
        for (k, v) in &before {
            assert_eq!(
                after.get(k),
                Some(v),
                "{} after recovery",
                String::from_utf8_lossy(k)
            );
        }
        // New puts before the in-flight writers' deadline never get their
        // ranges.
        for i in 0..40 {
            let Ok(rs) = ask(
                &mut m,
                call::PutStart {
                    client_id: WRITER,
                    key: format!("new-{i}").into_bytes(),
                    len: 1,
                    opts: PutOptions::default(),
                },
                now + 1,
            ) else {
                continue;
            };
            for r in rs.iter().filter(|r| r.tier == Tier::Dram) {
                assert!(
                    !held.contains(&r.offset),
                    "range {} of a put under way at the crash was handed out again",
                    r.offset
                );
            }
        }
        for (i, sh) in m.shards.iter().enumerate() {
            if let Err(e) = sh.check_invariants() {
                panic!("shard {i} after new puts: {e}");
            }
        }
    }
}

fn ask<C: Call>(m: &mut MasterCore, c: C, now: u64) -> Result<C::Reply, KvError> {
    let req: MasterRequest = c.into();
    C::reply(m.call(req, now)?)
}

#[test]
fn random_tier_transitions_keep_the_space_accounting() {
    let (seeds, steps): (Vec<u64>, usize) = match std::env::var("KVPOOL_MODEL_SEED") {
        Ok(s) => (vec![s.parse().expect("KVPOOL_MODEL_SEED is a u64")], 3_000),
        Err(_) => {
            let base: u64 = rand::random();
            ((0..60).map(|i| base.wrapping_add(i)).collect(), 600)
        }
    };
    let mut total = Seen::default();
    for seed in seeds {
        let r = std::panic::catch_unwind(|| {
            let mut run = Run::new(seed);
            for _ in 0..steps {
                run.step();
            }
            run.seen
        });
        match r {
            Ok(s) => {
                total.stored += s.stored;
                total.replaced += s.replaced;
                total.demoted += s.demoted;
                total.persist_failed += s.persist_failed;
                total.promoted += s.promoted;
                total.promote_failed += s.promote_failed;
                total.tier_evicted += s.tier_evicted;
                total.steps += s.steps;
                total.evicting += s.evicting;
            }
            Err(e) => std::panic::resume_unwind(Box::new(format!(
                "seed {seed} (replay: KVPOOL_MODEL_SEED={seed}): {}",
                e.downcast_ref::<String>()
                    .cloned()
                    .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default()
            ))),
        }
    }
    println!("{total:?}");
    // The walk reached every transition it is about.
    assert!(total.stored > 0, "{total:?}");
    assert!(total.demoted > 0, "{total:?}");
    assert!(total.persist_failed > 0, "{total:?}");
    assert!(total.promoted > 0, "{total:?}");
    assert!(total.promote_failed > 0, "{total:?}");
    assert!(total.tier_evicted > 0, "{total:?}");
    assert!(total.replaced > 0, "{total:?}");
    assert!(total.evicting > 0, "{total:?}");
}

/// The same walk with the master keeping a state directory, cut at a
/// random step by a crash (memory dropped, log as a killed process leaves
/// it, sometimes with a torn last record), with compactions interleaved:
/// the recovered state equals the state before the crash, invariants hold,
/// and puts under way at the crash keep their ranges.
#[test]
fn random_tier_transitions_survive_a_crash_of_the_master() {
    let seeds: Vec<u64> = match std::env::var("KVPOOL_MODEL_SEED") {
        Ok(s) => vec![s.parse().expect("KVPOOL_MODEL_SEED is a u64")],
        Err(_) => {
            let base: u64 = rand::random();
            (0..150).map(|i| base.wrapping_add(i)).collect()
        }
    };
    for seed in seeds {
        let dir = std::env::temp_dir().join(format!(
            "kvpool-durable-model-{}-{seed}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        let r = std::panic::catch_unwind(|| {
            let mut run = Run::with_state(seed, Some(&dir));
            let steps = run.rng.random_range(1..800);
            for _ in 0..steps {
                run.step();
            }
            run.crash_and_recover(&dir);
        });
        let _ = std::fs::remove_dir_all(&dir);
        if let Err(e) = r {
            std::panic::resume_unwind(Box::new(format!(
                "seed {seed} (replay: KVPOOL_MODEL_SEED={seed}): {}",
                e.downcast_ref::<String>()
                    .cloned()
                    .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default()
            )));
        }
    }
}
