//! The whole master in one thread: every shard's state and the coordinator,
//! routed exactly as the live service routes, with the clock an argument.
//!
//! This is what the behaviour tests and the property test drive (a simulated
//! clock, no sleeps, no threads), and what a single-threaded embedder could
//! use. The live service ([`super::service`]) runs the same pieces on the
//! shards and moves requests between them by message.

use kvpool_runtime::hash::ShardMap;
use kvpool_transport::proto::{MasterRequest, MasterResponse};
use kvpool_transport::{ErrorCode, KvError};

use super::coord::{CommandResult, CoordState, Decision, ShardCommand};
use super::state::{ShardConfig, ShardState, TickReport, EVICT_STEP_VICTIMS};
use kvpool_config::MasterConfig;
use kvpool_transport::route::{self, merge_batch, split_batch, Target};

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
        }
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
        }
        let expired = self.coord.expire(now_ms);
        for cmd in &expired.commands {
            self.broadcast(cmd, now_ms);
        }
        self.drive_eviction(now_ms);
        total
    }
}
