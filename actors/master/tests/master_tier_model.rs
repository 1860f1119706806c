//! Property test of the NVMe tier's transitions: random sequences of puts,
//! reads (which promote), removals, time (which evicts and demotes), the
//! node taking its tasks and answering them in any order (`Stored`,
//! `PersistFailed`, `Promoted` ok or not), and the tier evicting copies on
//! its own (`Evicted`), on a small DRAM segment whose node has a tier. After
//! every step every shard's space accounting must hold
//! (`ShardState::check_invariants`), and every object the master lists must
//! have a replica where its answers say.
//!
//! A failure prints the seed; `KVPOOL_MODEL_SEED=<seed>` replays that case.

use std::collections::HashMap;

use kvpool_config::MasterConfig;
use kvpool_master::core::MasterCore;
use kvpool_transport::proto::call::{self, Call};
use kvpool_transport::proto::{
    segment_id_for, Endpoint, MasterRequest, NodeTask, NvmeAttach, NvmeUpdate, PutOptions,
    SegmentId, SegmentSpec, Tier,
};
use kvpool_transport::KvError;
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
    stored: u64,
    demoted: u64,
    persist_failed: u64,
    promoted: u64,
    promote_failed: u64,
    tier_evicted: u64,
    steps: u64,
}

struct Run {
    m: MasterCore,
    now: u64,
    rng: ChaCha8Rng,
    dram: SegmentId,
    nvme: SegmentId,
    /// Tasks the node has taken and not answered yet.
    tasks: Vec<NodeTask>,
    /// The tier's contents: location -> key.
    on_disk: HashMap<u64, Vec<u8>>,
    next_loc: u64,
    seen: Seen,
}

impl Run {
    fn new(seed: u64) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let cfg = MasterConfig {
            lease_ttl_ms: 200,
            high_watermark: 0.7,
            eviction_ratio: 0.3,
            promote_after_reads: 2,
            client_ttl_ms: 1 << 40,
            ..Default::default()
        };
        let mut m = MasterCore::new(SHARDS, &cfg, seed);
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
            tasks: Vec::new(),
            on_disk: HashMap::new(),
            next_loc: 1,
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
            _ => self.advance(),
        }
        for (i, sh) in self.m.shards.iter().enumerate() {
            if let Err(e) = sh.check_invariants() {
                panic!("shard {i} at {} ms: {e}", self.now);
            }
        }
    }

    fn put(&mut self) {
        let key = self.key();
        let len = [1u64, 700, 2048, 4096, 9000][self.rng.random_range(0..5)];
        let opts = PutOptions::default();
        let started = self.call(call::PutStart {
            client_id: WRITER,
            key: key.clone(),
            len,
            opts,
        });
        if started.is_err() {
            return; // no room, a put under way, ...: all legal answers
        }
        if self.rng.random_ratio(1, 8) {
            let _ = self.call(call::PutRevoke {
                client_id: WRITER,
                key,
            });
            return;
        }
        let checksum = self.rng.random_ratio(1, 2).then_some(len ^ 0xabc);
        let _ = self.call(call::PutEnd {
            client_id: WRITER,
            key,
            checksum,
        });
    }

    fn get(&mut self) {
        let key = self.key();
        if let Ok(replicas) = self.call(call::GetReplicaList { key: key.clone() }) {
            for r in &replicas {
                match r.tier {
                    Tier::Dram => assert_eq!(r.segment_id, self.dram, "{r:?}"),
                    Tier::Nvme => {
                        assert_eq!(r.segment_id, self.nvme, "{r:?}");
                        assert_eq!(
                            self.on_disk.get(&r.offset),
                            Some(&key),
                            "an NVMe replica the tier holds for this key"
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
            self.tasks.extend(got.expect("the owner's tasks"));
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
        match self.tasks.swap_remove(i) {
            NodeTask::Persist {
                key,
                dram,
                offset,
                len,
                demote,
                checksum,
            } => {
                if self.rng.random_ratio(1, 5) {
                    let u = NvmeUpdate::PersistFailed {
                        key,
                        dram,
                        offset,
                        demote,
                    };
                    if self.update(u).is_ok() {
                        self.seen.persist_failed += 1;
                    }
                    return;
                }
                let loc = self.next_loc;
                self.next_loc += 1;
                let u = NvmeUpdate::Stored {
                    key: key.clone(),
                    nvme: self.nvme,
                    loc,
                    len,
                    dram,
                    offset,
                    demote,
                    sum: checksum.unwrap_or(len ^ 0xabc),
                };
                // The tier holds the copy whether or not the master takes it
                // (a refused report: the node drops it, as the real one does).
                if self.update(u).is_ok() {
                    self.on_disk.insert(loc, key);
                    self.seen.stored += 1;
                    if demote {
                        self.seen.demoted += 1;
                    }
                }
            }
            NodeTask::Promote {
                key, dram, offset, ..
            } => {
                let ok = !self.rng.random_ratio(1, 5);
                let u = NvmeUpdate::Promoted {
                    key,
                    dram,
                    offset,
                    ok,
                };
                if self.update(u).is_ok() {
                    if ok {
                        self.seen.promoted += 1;
                    } else {
                        self.seen.promote_failed += 1;
                    }
                }
            }
            NodeTask::Drop { key, loc } => {
                if self.on_disk.get(&loc) == Some(&key) {
                    self.on_disk.remove(&loc);
                }
            }
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
        let key = key.clone();
        self.on_disk.remove(&loc);
        let u = NvmeUpdate::Evicted {
            key,
            nvme: self.nvme,
            loc,
        };
        if self.update(u).is_ok() {
            self.seen.tier_evicted += 1;
        }
    }

    fn advance(&mut self) {
        self.now += self.rng.random_range(1..300);
        let _ = self.call(call::Ping {
            client_id: NODE,
            segments: vec![self.dram, self.nvme],
        });
        self.m.tick(self.now);
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
                total.demoted += s.demoted;
                total.persist_failed += s.persist_failed;
                total.promoted += s.promoted;
                total.promote_failed += s.promote_failed;
                total.tier_evicted += s.tier_evicted;
                total.steps += s.steps;
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
}
