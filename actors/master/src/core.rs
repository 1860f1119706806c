//! The whole master in one thread: every shard's state and the coordinator,
//! routed exactly as the live service routes, with the clock an argument.
//!
//! This is what the behaviour tests and the property test drive (a simulated
//! clock, no sleeps, no threads), and what a single-threaded embedder could
//! use. The live service ([`super::service`]) runs the same pieces on the
//! shards and moves requests between them by message.

use kvpool_runtime::hash::ShardMap;
use kvpool_wire::proto::{MasterRequest, MasterResponse};
use kvpool_wire::{ErrorCode, KvError};

use std::path::Path;

use super::coord::{CommandResult, CoordState, Decision, ShardCommand};
use super::journal::{self, JournalError, LogWriter, SnapshotWriter, Sync};
use super::state::{ShardConfig, ShardState, SnapshotCursor, TickReport, EVICT_STEP_VICTIMS};
use kvpool_config::MasterConfig;
use kvpool_wire::route::{self, merge_batch, split_batch, Target};

/// Checks a batch's size; answers an empty batch at once.
pub fn check_batch(
    req: &MasterRequest,
    max_batch: usize,
) -> Result<Option<MasterResponse>, KvError> {
    let n = req.batch_keys().map(|k| k.len()).unwrap_or(0);
    if n > max_batch {
        return Err(KvError::new(
            ErrorCode::InvalidParams,
            format!("a batch of {n} keys exceeds master.max_batch ({max_batch})"),
        ));
    }
    if n > 0 {
        return Ok(None);
    }
    Ok(Some(match req {
        MasterRequest::BatchPutStart { .. } | MasterRequest::BatchGet { .. } => {
            MasterResponse::BatchReplicas(Vec::new())
        }
        MasterRequest::BatchExist { .. } => MasterResponse::BatchExists(Vec::new()),
        _ => MasterResponse::BatchDone(Vec::new()),
    }))
}

/// How `MasterCore` runs the shards' off-path eviction
/// ([`ShardState::evict_step`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EvictDrive {
    /// After every call and tick, every shard's steps until nothing is owed:
    /// the pool is as the live shard leaves it once its eviction task has
    /// caught up (the default).
    UntilDone,
    /// After every call and tick, one step of at most this many victims per
    /// shard: episodes span calls, as they span requests on a busy shard.
    StepOf(usize),
    /// Never by itself: the caller runs [`MasterCore::evict_step`].
    Manual,
}

/// The master's logic without threads or sockets.
pub struct MasterCore {
    pub coord: CoordState,
    pub shards: Vec<ShardState>,
    map: ShardMap,
    max_batch: usize,
    /// How the off-path eviction runs.
    pub evict: EvictDrive,
    /// Each shard's log, with a state directory.
    logs: Vec<LogWriter>,
    /// Each shard's snapshot under way, if any.
    snapshots: Vec<Option<(SnapshotWriter, SnapshotCursor)>>,
    scratch: Vec<u8>,
}

impl MasterCore {
    /// A master with `nr_shards` shards; `seed` drives random placement.
    pub fn new(nr_shards: u32, cfg: &MasterConfig, seed: u64) -> Self {
        let scfg = ShardConfig::from_master(cfg, nr_shards);
        Self {
            coord: CoordState::new(cfg.client_ttl_ms),
            shards: (0..nr_shards)
                .map(|i| ShardState::new(i, nr_shards, scfg.clone(), seed))
                .collect(),
            map: ShardMap::new(nr_shards).expect("1..=4096 shards"),
            max_batch: cfg.max_batch,
            evict: EvictDrive::UntilDone,
            logs: Vec::new(),
            snapshots: Vec::new(),
            scratch: Vec::new(),
        }
    }

    /// A master that keeps its state in `dir` (as `[master] state_dir`):
    /// what the directory holds is recovered, each object waiting for its
    /// segments to mount again until `now_ms + client_ttl_ms`; every change
    /// from now on is logged before the call that made it returns.
    /// `unix_at_zero_ms` is the wall time at `now_ms == 0`.
    pub fn open(
        nr_shards: u32,
        cfg: &MasterConfig,
        seed: u64,
        dir: &Path,
        now_ms: u64,
        unix_at_zero_ms: u64,
    ) -> Result<Self, JournalError> {
        journal::check_meta(dir, nr_shards)?;
        let mut core = Self::new(nr_shards, cfg, seed);
        let scfg = ShardConfig::from_master(cfg, nr_shards);
        for i in 0..nr_shards {
            let r = journal::open_shard(&journal::shard_dir(dir, i), Sync::None)?;
            let mut st =
                ShardState::new(i, nr_shards, scfg.clone(), seed).with_durability(unix_at_zero_ms);
            st.recover(r.image, now_ms, cfg.client_ttl_ms);
            core.shards[i as usize] = st;
            core.logs.push(r.log);
            core.snapshots.push(None);
        }
        Ok(core)
    }

    /// Signs data-plane grants with `signer` in every shard from now on (a
    /// cluster secret), as the live service's shards do.
    pub fn with_signer(mut self, signer: Option<crate::state::GrantSigner>) -> Self {
        self.shards = std::mem::take(&mut self.shards)
            .into_iter()
            .map(|s| s.with_signer(signer.clone()))
            .collect();
        self
    }

    /// Writes every shard's durable changes to its log.
    fn commit(&mut self) -> Result<(), KvError> {
        for (s, log) in self.shards.iter_mut().zip(&mut self.logs) {
            self.scratch.clear();
            s.take_records(&mut self.scratch);
            log.append(&self.scratch)
                .map_err(|e| KvError::new(ErrorCode::Internal, format!("the state log: {e}")))?;
        }
        Ok(())
    }

    /// One step of a compaction of every shard's log: the first call starts
    /// it (a new log, a snapshot being written), each call writes at most
    /// `budget` objects of each shard's snapshot, and the call that writes
    /// the last puts the snapshots in place and drops the old logs. Returns
    /// whether a compaction is still under way. Calls and ticks may come
    /// between steps.
    pub fn compact_step(&mut self, budget: usize) -> Result<bool, JournalError> {
        let mut busy = false;
        for i in 0..self.shards.len() {
            if self.logs.is_empty() {
                return Ok(false);
            }
            let (mut w, mut cur) = match self.snapshots[i].take() {
                Some(x) => x,
                None => (self.logs[i].rotate()?, SnapshotCursor::default()),
            };
            self.scratch.clear();
            let done = self.shards[i].snapshot_step(&mut cur, budget, &mut self.scratch);
            w.write(&self.scratch)?;
            if done {
                w.finish()?;
            } else {
                self.snapshots[i] = Some((w, cur));
                busy = true;
            }
        }
        Ok(busy)
    }

    /// One step of every shard's off-path eviction (at most `budget` victims
    /// each); whether any shard is owed more.
    pub fn evict_step(&mut self, now_ms: u64, budget: usize) -> bool {
        let mut more = false;
        for s in &mut self.shards {
            more |= s.evict_step(now_ms, budget);
        }
        more
    }

    /// Runs the off-path eviction as `self.evict` says.
    fn drive_eviction(&mut self, now_ms: u64) {
        match self.evict {
            EvictDrive::UntilDone => while self.evict_step(now_ms, EVICT_STEP_VICTIMS) {},
            EvictDrive::StepOf(budget) => {
                self.evict_step(now_ms, budget);
            }
            EvictDrive::Manual => {}
        }
    }

    pub fn shard_of(&self, key: &[u8]) -> usize {
        self.map.shard_of(key) as usize
    }

    fn broadcast(&mut self, cmd: &ShardCommand, now_ms: u64) -> Vec<CommandResult> {
        self.shards
            .iter_mut()
            .map(|s| s.command(cmd, now_ms))
            .collect()
    }

    /// Handles one request at `now_ms`, then runs the off-path eviction as
    /// `self.evict` says (as the live shard runs it between requests).
    pub fn call(&mut self, req: MasterRequest, now_ms: u64) -> Result<MasterResponse, KvError> {
        let res = self.route(req, now_ms);
        self.drive_eviction(now_ms);
        self.commit()?;
        res
    }

    fn route(&mut self, req: MasterRequest, now_ms: u64) -> Result<MasterResponse, KvError> {
        let map = &self.map;
        match route::target(&req, |k| map.shard_of(k), self.shards.len())? {
            Target::Connection => Err(KvError::new(
                ErrorCode::InvalidParams,
                format!("{} belongs to a connection, not MasterCore", req.op_name()),
            )),
            Target::Shard(s) => self.shards[s].apply(req, now_ms),
            Target::Batch => {
                if let Some(empty) = check_batch(&req, self.max_batch)? {
                    return Ok(empty);
                }
                let n = req.batch_keys().map(|k| k.len()).unwrap_or(0);
                let parts = split_batch(req, &self.map)
                    .into_iter()
                    .map(|p| {
                        let res = self.shards[p.shard as usize].apply(p.req, now_ms);
                        (p.positions, res)
                    })
                    .collect();
                merge_batch(n, parts)
            }
            Target::Coordinator => match self.coord.decide(req, now_ms)? {
                Decision::Answer(r) => Ok(r),
                Decision::Broadcast { cmd, finish } => {
                    let results = self.broadcast(&cmd, now_ms);
                    Ok(self.coord.finish(finish, results))
                }
            },
        }
    }

    /// Housekeeping at `now_ms`: every shard's tick, then liveness, then
    /// the off-path eviction as `self.evict` says.
    pub fn tick(&mut self, now_ms: u64) -> TickReport {
        let mut total = TickReport::default();
        for s in &mut self.shards {
            let r = s.tick(now_ms);
            total.stale_discarded += r.stale_discarded;
            total.freed_bytes += r.freed_bytes;
            total.fewer_replicas += r.fewer_replicas;
            total.fills_expired += r.fills_expired;
        }
        let expired = self.coord.expire(now_ms);
        for cmd in &expired.commands {
            self.broadcast(cmd, now_ms);
        }
        self.drive_eviction(now_ms);
        if let Err(e) = self.commit() {
            panic!("MasterCore cannot write its state log: {e}");
        }
        total
    }
}
