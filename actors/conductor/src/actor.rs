//! The live `Conductor` actor (ractor).
//!
//! It holds a [`Scheduler`] and a cluster view fed by messages: the proxies'
//! load reports ([`ConductorMsg::LoadReport`]), the pool's and prefill
//! instances' KV events ([`ConductorMsg::KvEvent`]) and the decode proxies'
//! finished requests ([`ConductorMsg::DecodeFinished`], from which
//! `predictive_reject` learns how long answers are), and answers
//! [`ConductorMsg::Schedule`] with a [`Decision`]. It does no I/O of its own.
//!
//! The view it keeps:
//!
//! - per prefill instance: the last reported queue (length and time to drain,
//!   turned into a `busy_until` on the conductor's clock), plus the predicted
//!   prefill time of every request routed there since that report; and the
//!   chunk hashes the instance reported as stored (and, optimistically, the
//!   chunks of requests routed to it, which it will store), at most the
//!   cost model's `prefill.local_cache_blocks` of them;
//! - the chunk hashes stored in the pool, unless the request says how much
//!   of its prompt the pool holds ([`ScheduleRequest::pool_prefix_blocks`],
//!   what a live front learns with one batch exists);
//! - per decode instance: the last reported load;
//! - per instance, whether it is up ([`ConductorMsg::Availability`]); the
//!   scheduler skips those that are not.
//!
//! For every request the actor captures this view as a
//! [`crate::record::RecordedView`] and schedules on the
//! capture, so that a decision log (`ConductorArgs::decision_log`) holds
//! exactly what each decision was made on (see [`crate::record`]).
//!
//! Bounds: each chunk mirror holds at most `max_tracked_chunks` hashes (the
//! least recently touched are forgotten first, which can only make the
//! conductor under-estimate a hit); the scheduler's own memory is bounded
//! ([`crate::scheduler::INBOUND_LEDGER_MAX`]). ractor's mailbox is
//! unbounded, so [`ConductorHandle`] bounds it with a
//! [`MailboxGate`]: it counts messages sent and not yet handled, and
//! refuses a new one with [`ConductorError::Overloaded`] once
//! `mailbox_bound` are outstanding. Messages sent straight through the
//! [`ActorRef`] are not counted.
//!
//! ```
//! use std::time::Duration;
//! use kvpool_conductor::actor::{
//!     ConductorArgs, ConductorHandle, InstanceLoad, KvLocation, ScheduleRequest,
//! };
//! use kvpool_conductor::chunk_hash::chunk_hashes;
//! use kvpool_conductor::cost::CostModel;
//! use kvpool_conductor::scheduler::{Decision, Policy, Slo};
//!
//! let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
//! rt.block_on(async {
//!     let args = ConductorArgs::new(Policy::CacheGlobal, CostModel::default(), Slo::default(), 2, 1);
//!     let (conductor, join) = ConductorHandle::spawn(args).await.unwrap();
//!
//!     // Prefill instance 1 reports that it holds the KV of a 4,096-token prompt.
//!     let prompt: Vec<u32> = (0..4_096).collect();
//!     let chunks = chunk_hashes(&prompt, 512).unwrap();
//!     conductor.kv_event(KvLocation::Prefill(1), chunks.clone(), Vec::new()).unwrap();
//!     conductor
//!         .report_load(0, InstanceLoad::Prefill { queued_requests: 0, queued_ms: 0.0 })
//!         .unwrap();
//!
//!     // A request that extends that prompt goes where its prefix is.
//!     let longer: Vec<u32> = (0..5_000).collect();
//!     let request = ScheduleRequest {
//!         id: 7,
//!         input_tokens: 5_000,
//!         chunks: chunk_hashes(&longer, 512).unwrap(),
//!         pool_prefix_blocks: None,
//!     };
//!     match conductor.schedule(request, Duration::from_secs(5)).await.unwrap() {
//!         Decision::Route { prefill, cached_blocks, .. } => {
//!             assert_eq!((prefill, cached_blocks), (1, 8));
//!         }
//!         Decision::Reject(reason) => panic!("rejected: {reason}"),
//!     }
//!     conductor.stop();
//!     join.await.unwrap();
//! });
//! ```

use std::fs::File;
use std::io::BufWriter;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use serde::Serialize;

use super::cache::{BlockCache, Capacity, LruCache, PrefixIndex};
use super::chunk_hash::ChunkHash;
use super::cost::CostModel;
use super::mailbox::{GateError, MailboxGate};
use super::record::{DecisionLog, LogRecord, LogSource, RecordedView};
use super::scheduler::{
    ClusterView, Decision, DecodeLoad, Policy, PrefillLoad, RequestView, Scheduler, Slo,
};

/// Default bound on messages outstanding through a [`ConductorHandle`].
pub const DEFAULT_MAILBOX_BOUND: usize = 4_096;
/// Default bound on chunk hashes mirrored per location.
pub const DEFAULT_MAX_TRACKED_CHUNKS: usize = 1 << 20;

/// A request to place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduleRequest {
    /// Caller's id.
    pub id: u64,
    /// Prompt tokens.
    pub input_tokens: u32,
    /// Prefix-chained chunk hashes of the prompt (full chunks only).
    pub chunks: Vec<ChunkHash>,
    /// Leading chunks of the prompt the pool holds, when the caller looked
    /// (one batch exists on their keys); `None`: the conductor's mirror of
    /// the pool's KV events answers instead.
    pub pool_prefix_blocks: Option<usize>,
}

/// Prefill or decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum InstanceKind {
    /// A prefill instance.
    Prefill,
    /// A decode instance.
    Decode,
}

/// A load report from one proxy.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(tag = "role", rename_all = "snake_case")]
pub enum InstanceLoad {
    /// From a prefill proxy.
    Prefill {
        /// Requests waiting (not counting the running one).
        queued_requests: usize,
        /// Time until everything the instance holds is done, ms.
        queued_ms: f64,
    },
    /// From a decode proxy.
    Decode {
        /// Sequences in the running batch.
        active_seqs: usize,
        /// Context tokens in the running batch.
        active_tokens: u64,
        /// Requests waiting for a slot.
        waiting_seqs: usize,
        /// Context tokens of the waiting requests.
        waiting_tokens: u64,
    },
}

/// Where KV chunks were stored or removed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum KvLocation {
    /// In a prefill instance's own memory.
    Prefill(usize),
    /// In the shared pool.
    Pool,
}

/// Messages of the [`Conductor`].
#[derive(Debug)]
pub enum ConductorMsg {
    /// Place a request; the decision goes to `reply`.
    Schedule {
        /// The request.
        request: ScheduleRequest,
        /// Where the decision goes.
        reply: RpcReplyPort<Decision>,
    },
    /// A proxy's load report. `instance` indexes the prefill or decode
    /// instances according to the variant of `load`.
    LoadReport {
        /// Instance index.
        instance: usize,
        /// The load.
        load: InstanceLoad,
    },
    /// Chunks stored at and removed from `location`.
    KvEvent {
        /// Where.
        location: KvLocation,
        /// Chunk hashes now present.
        stored: Vec<ChunkHash>,
        /// Chunk hashes gone.
        removed: Vec<ChunkHash>,
    },
    /// A decode proxy saw a request finish after `output_tokens` tokens in
    /// all (the first one, from prefill, included). `predictive_reject`
    /// predicts departures from the mean of these.
    DecodeFinished {
        /// Decode instance index.
        instance: usize,
        /// Tokens the request generated.
        output_tokens: u32,
    },
    /// An instance came up or went down (its proxy or engine stopped
    /// answering). Instances start up.
    Availability {
        /// Prefill or decode.
        kind: InstanceKind,
        /// Its index.
        instance: usize,
        /// Whether it takes requests.
        available: bool,
    },
    /// The decode instance that is up and least loaded for a request of
    /// `context_tokens` joining now (`None` when none is up): where a
    /// request whose decode instance died goes on. Not a scheduling
    /// decision: nothing is logged or counted.
    PickDecode {
        /// Prompt plus generated tokens of the request.
        context_tokens: u64,
        /// Where the answer goes.
        reply: RpcReplyPort<Option<usize>>,
    },
    /// A copy of the conductor's view and counters.
    Snapshot {
        /// Where the snapshot goes.
        reply: RpcReplyPort<ConductorSnapshot>,
    },
}

/// What a [`ConductorMsg::Snapshot`] returns.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ConductorSnapshot {
    /// Policy in use.
    pub policy: Policy,
    /// Per prefill instance: load as the scheduler sees it now (ms on the
    /// conductor's clock) and chunks mirrored.
    pub prefill: Vec<(PrefillLoad, usize)>,
    /// Per decode instance: last reported load.
    pub decode: Vec<DecodeLoad>,
    /// Per prefill instance: whether it is up.
    pub prefill_up: Vec<bool>,
    /// Per decode instance: whether it is up.
    pub decode_up: Vec<bool>,
    /// SLOs the scheduler works to.
    pub slo: Slo,
    /// Seed of the `random` policy.
    pub seed: u64,
    /// Records written to the decision log (0 without one).
    pub logged: u64,
    /// Chunks mirrored for the pool.
    pub pool_chunks: usize,
    /// Requests routed.
    pub routed: u64,
    /// Requests rejected.
    pub rejected: u64,
    /// Reports and events naming an instance that does not exist.
    pub ignored: u64,
    /// Output tokens per request the scheduler currently assumes.
    pub expected_output_tokens: f64,
    /// Conductor clock, ms since start.
    pub now_ms: f64,
}

/// Errors of the conductor's handle.
#[derive(Debug, thiserror::Error)]
pub enum ConductorError {
    /// The actor could not be started.
    #[error("cannot start the conductor: {0}")]
    Spawn(String),
    /// `mailbox_bound` messages are already waiting.
    #[error("the conductor already has {bound} messages waiting; try again later")]
    Overloaded {
        /// The bound.
        bound: usize,
    },
    /// The actor is gone.
    #[error("the conductor is not running: {0}")]
    NotRunning(String),
    /// No answer within the timeout.
    #[error("the conductor did not answer within {0:?}")]
    Timeout(Duration),
    /// Bad start arguments.
    #[error("invalid conductor arguments: {0}")]
    InvalidArgs(String),
}

impl From<GateError> for ConductorError {
    fn from(e: GateError) -> Self {
        match e {
            GateError::Full { bound } => ConductorError::Overloaded { bound },
            GateError::NotRunning(m) => ConductorError::NotRunning(m),
            GateError::Timeout(t) => ConductorError::Timeout(t),
        }
    }
}

/// Start arguments of the [`Conductor`].
#[derive(Debug, Clone)]
pub struct ConductorArgs {
    /// Scheduling policy.
    pub policy: Policy,
    /// Cost model used for estimates.
    pub cost: CostModel,
    /// SLOs for the rejecting policies.
    pub slo: Slo,
    /// Seed of the `random` policy.
    pub seed: u64,
    /// Number of prefill instances.
    pub prefill_instances: usize,
    /// Number of decode instances.
    pub decode_instances: usize,
    /// Bound on chunk hashes mirrored per location.
    pub max_tracked_chunks: usize,
    /// Bound on messages outstanding through a [`ConductorHandle`].
    pub mailbox_bound: usize,
    /// Write a decision log here (see [`crate::record`]); created or
    /// truncated at start.
    pub decision_log: Option<PathBuf>,
    gate: Option<MailboxGate>,
}

impl ConductorArgs {
    /// Arguments with seed 0 and the default bounds.
    pub fn new(
        policy: Policy,
        cost: CostModel,
        slo: Slo,
        prefill_instances: usize,
        decode_instances: usize,
    ) -> Self {
        Self {
            policy,
            cost,
            slo,
            seed: 0,
            prefill_instances,
            decode_instances,
            max_tracked_chunks: DEFAULT_MAX_TRACKED_CHUNKS,
            mailbox_bound: DEFAULT_MAILBOX_BOUND,
            decision_log: None,
            gate: None,
        }
    }

    fn validate(&self) -> Result<(), ConductorError> {
        if self.prefill_instances == 0 || self.decode_instances == 0 {
            return Err(ConductorError::InvalidArgs(
                "at least one prefill and one decode instance are needed".into(),
            ));
        }
        if self.max_tracked_chunks == 0 || self.mailbox_bound == 0 {
            return Err(ConductorError::InvalidArgs(
                "max_tracked_chunks and mailbox_bound must be at least 1".into(),
            ));
        }
        self.cost
            .validate()
            .map_err(|e| ConductorError::InvalidArgs(e.to_string()))
    }
}

#[derive(Debug)]
struct LivePrefill {
    queued: usize,
    busy_until_ms: f64,
    chunks: LruCache,
}

/// The conductor's view of the cluster.
#[derive(Debug)]
struct LiveView {
    prefill: Vec<LivePrefill>,
    decode: Vec<DecodeLoad>,
    prefill_up: Vec<bool>,
    decode_up: Vec<bool>,
    pool: LruCache,
}

impl ClusterView for LiveView {
    fn prefill_instances(&self) -> usize {
        self.prefill.len()
    }
    fn prefill_load(&self, i: usize) -> PrefillLoad {
        let p = &self.prefill[i];
        PrefillLoad {
            queued: p.queued,
            busy_until_ms: p.busy_until_ms,
        }
    }
    fn local_prefix_blocks(&self, i: usize, blocks: &[ChunkHash]) -> usize {
        self.prefill[i].chunks.prefix_len(blocks)
    }
    fn global_prefix_blocks(&self, blocks: &[ChunkHash]) -> usize {
        self.pool.prefix_len(blocks)
    }
    fn decode_instances(&self) -> usize {
        self.decode.len()
    }
    fn decode_load(&self, i: usize) -> DecodeLoad {
        self.decode[i]
    }
    fn prefill_available(&self, i: usize) -> bool {
        self.prefill_up[i]
    }
    fn decode_available(&self, i: usize) -> bool {
        self.decode_up[i]
    }
}

/// State of the [`Conductor`] actor.
pub struct ConductorState {
    scheduler: Scheduler,
    view: LiveView,
    epoch: Instant,
    gate: Option<MailboxGate>,
    log: Option<DecisionLog<BufWriter<File>>>,
    seed: u64,
    routed: u64,
    rejected: u64,
    ignored: u64,
}

impl std::fmt::Debug for ConductorState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConductorState")
            .field("policy", &self.scheduler.policy())
            .field("view", &self.view)
            .field("logging", &self.log.is_some())
            .field("routed", &self.routed)
            .field("rejected", &self.rejected)
            .finish_non_exhaustive()
    }
}

impl ConductorState {
    fn now_ms(&self) -> f64 {
        self.epoch.elapsed().as_secs_f64() * 1000.0
    }

    fn schedule(&mut self, request: &ScheduleRequest) -> Decision {
        let now = self.now_ms();
        let view = RequestView {
            id: request.id,
            input_tokens: request.input_tokens,
            blocks: &request.chunks,
        };
        // The scheduler decides on the capture, so a log holds exactly
        // what it saw.
        let mut seen = RecordedView::capture(&self.view, &request.chunks);
        if let Some(n) = request.pool_prefix_blocks {
            seen.global_prefix_blocks = n.min(request.chunks.len());
        }
        let decision = self.scheduler.schedule(&view, &seen, now);
        self.log(|| LogRecord::Schedule {
            id: request.id,
            now_ms: now,
            input_tokens: request.input_tokens,
            blocks: request.chunks.len(),
            view: seen,
            decision,
        });
        match decision {
            Decision::Route {
                prefill,
                predicted_prefill_ms,
                ..
            } => {
                self.routed += 1;
                let p = &mut self.view.prefill[prefill];
                p.queued += 1;
                p.busy_until_ms = p.busy_until_ms.max(now) + predicted_prefill_ms;
                p.chunks.touch(&request.chunks);
            }
            Decision::Reject(_) => self.rejected += 1,
        }
        decision
    }

    fn load_report(&mut self, instance: usize, load: InstanceLoad) {
        let now = self.now_ms();
        match load {
            InstanceLoad::Prefill {
                queued_requests,
                queued_ms,
            } => match self.view.prefill.get_mut(instance) {
                Some(p) if queued_ms.is_finite() && queued_ms >= 0.0 => {
                    p.queued = queued_requests;
                    p.busy_until_ms = now + queued_ms;
                }
                _ => self.ignored += 1,
            },
            InstanceLoad::Decode {
                active_seqs,
                active_tokens,
                waiting_seqs,
                waiting_tokens,
            } => match self.view.decode.get_mut(instance) {
                Some(d) => {
                    *d = DecodeLoad {
                        active_seqs,
                        active_tokens,
                        waiting_seqs,
                        waiting_tokens,
                    }
                }
                None => self.ignored += 1,
            },
        }
    }

    fn decode_finished(&mut self, instance: usize, output_tokens: u32) {
        if instance < self.view.decode.len() {
            self.scheduler.observe_decode_finished(output_tokens);
            self.log(|| LogRecord::DecodeFinished { output_tokens });
        } else {
            self.ignored += 1;
        }
    }

    fn log(&mut self, record: impl FnOnce() -> LogRecord) {
        if let Some(log) = self.log.as_mut() {
            log.write(&record());
            // One line at a time on disk: a conductor killed loses no
            // decision it made.
            if let Err(e) = log.flush() {
                tracing::error!("decision log: {e}; no more decisions are logged");
                self.log = None;
            }
        }
    }

    fn availability(&mut self, kind: InstanceKind, instance: usize, available: bool) {
        let up = match kind {
            InstanceKind::Prefill => &mut self.view.prefill_up,
            InstanceKind::Decode => &mut self.view.decode_up,
        };
        match up.get_mut(instance) {
            Some(u) => *u = available,
            None => self.ignored += 1,
        }
    }

    fn kv_event(&mut self, location: KvLocation, stored: &[ChunkHash], removed: &[ChunkHash]) {
        let mirror = match location {
            KvLocation::Pool => &mut self.view.pool,
            KvLocation::Prefill(i) => match self.view.prefill.get_mut(i) {
                Some(p) => &mut p.chunks,
                None => {
                    self.ignored += 1;
                    return;
                }
            },
        };
        for h in removed {
            mirror.remove(*h);
        }
        mirror.touch(stored);
    }

    fn snapshot(&self) -> ConductorSnapshot {
        ConductorSnapshot {
            policy: self.scheduler.policy(),
            prefill: (0..self.view.prefill.len())
                .map(|i| (self.view.prefill_load(i), self.view.prefill[i].chunks.len()))
                .collect(),
            decode: self.view.decode.clone(),
            prefill_up: self.view.prefill_up.clone(),
            decode_up: self.view.decode_up.clone(),
            slo: self.scheduler.slo(),
            seed: self.seed,
            logged: self.log.as_ref().map_or(0, DecisionLog::records),
            pool_chunks: self.view.pool.len(),
            routed: self.routed,
            rejected: self.rejected,
            ignored: self.ignored,
            expected_output_tokens: self.scheduler.expected_output_tokens(),
            now_ms: self.now_ms(),
        }
    }
}

/// The conductor actor. Spawn it with [`ConductorHandle::spawn`] (bounded)
/// or with ractor's `Actor::spawn` and [`ConductorArgs`] (unbounded mailbox).
#[derive(Debug, Clone, Copy, Default)]
pub struct Conductor;

impl Actor for Conductor {
    type Msg = ConductorMsg;
    type State = ConductorState;
    type Arguments = ConductorArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        args: ConductorArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        args.validate()?;
        let cap = Capacity::Blocks(args.max_tracked_chunks);
        // An instance's mirror holds no more than the instance's own cache
        // (the cost model's local_cache_blocks; 0 for engines that keep no
        // KV between requests).
        let local_cap = match args.cost.prefill.local_cache_blocks.limit() {
            Some(n) => Capacity::Blocks(n.min(args.max_tracked_chunks)),
            None => cap,
        };
        let log = match &args.decision_log {
            Some(path) => {
                let file = File::create(path).map_err(|e| {
                    ConductorError::InvalidArgs(format!("decision log {}: {e}", path.display()))
                })?;
                let mut log = DecisionLog::new(BufWriter::new(file));
                log.write(&LogRecord::Start {
                    source: LogSource::Live,
                    policy: args.policy,
                    cost: args.cost.clone(),
                    slo: args.slo,
                    seed: args.seed,
                });
                log.flush().map_err(|e| {
                    ConductorError::InvalidArgs(format!("decision log {}: {e}", path.display()))
                })?;
                Some(log)
            }
            None => None,
        };
        Ok(ConductorState {
            scheduler: Scheduler::new(args.policy, args.cost.clone(), args.slo, args.seed),
            view: LiveView {
                prefill: (0..args.prefill_instances)
                    .map(|_| LivePrefill {
                        queued: 0,
                        busy_until_ms: 0.0,
                        chunks: LruCache::new(local_cap),
                    })
                    .collect(),
                decode: vec![DecodeLoad::default(); args.decode_instances],
                prefill_up: vec![true; args.prefill_instances],
                decode_up: vec![true; args.decode_instances],
                pool: LruCache::new(cap),
            },
            epoch: Instant::now(),
            gate: args.gate,
            log,
            seed: args.seed,
            routed: 0,
            rejected: 0,
            ignored: 0,
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        message: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        // One fewer message outstanding (saturating: raw sends are not counted).
        if let Some(g) = &state.gate {
            g.handled();
        }
        match message {
            ConductorMsg::Schedule { request, reply } => {
                let decision = state.schedule(&request);
                // The caller may have given up (timeout); nothing to do then.
                let _ = reply.send(decision);
            }
            ConductorMsg::LoadReport { instance, load } => state.load_report(instance, load),
            ConductorMsg::KvEvent {
                location,
                stored,
                removed,
            } => state.kv_event(location, &stored, &removed),
            ConductorMsg::DecodeFinished {
                instance,
                output_tokens,
            } => state.decode_finished(instance, output_tokens),
            ConductorMsg::Availability {
                kind,
                instance,
                available,
            } => state.availability(kind, instance, available),
            ConductorMsg::PickDecode {
                context_tokens,
                reply,
            } => {
                let pick = state
                    .scheduler
                    .least_loaded_decode(&state.view, context_tokens)
                    .map(|(d, _)| d);
                let _ = reply.send(pick);
            }
            ConductorMsg::Snapshot { reply } => {
                let _ = reply.send(state.snapshot());
            }
        }
        Ok(())
    }
}

/// A bounded handle to a running [`Conductor`].
#[derive(Debug, Clone)]
pub struct ConductorHandle {
    actor: ActorRef<ConductorMsg>,
    gate: MailboxGate,
}

impl ConductorHandle {
    /// Starts a conductor; returns its handle and the actor task's join handle.
    pub async fn spawn(
        mut args: ConductorArgs,
    ) -> Result<(Self, tokio::task::JoinHandle<()>), ConductorError> {
        args.validate()?;
        let gate = MailboxGate::new(args.mailbox_bound);
        args.gate = Some(gate.clone());
        let (actor, join) = Actor::spawn(None, Conductor, args)
            .await
            .map_err(|e| ConductorError::Spawn(e.to_string()))?;
        Ok((Self { actor, gate }, join))
    }

    fn send(&self, msg: ConductorMsg) -> Result<(), ConductorError> {
        Ok(self.gate.cast(&self.actor, msg)?)
    }

    async fn call<T: Send + 'static>(
        &self,
        build: impl FnOnce(RpcReplyPort<T>) -> ConductorMsg,
        timeout: Duration,
    ) -> Result<T, ConductorError> {
        Ok(self.gate.call(&self.actor, build, timeout).await?)
    }

    /// Places a request, waiting at most `timeout` for the answer.
    pub async fn schedule(
        &self,
        request: ScheduleRequest,
        timeout: Duration,
    ) -> Result<Decision, ConductorError> {
        self.call(|reply| ConductorMsg::Schedule { request, reply }, timeout)
            .await
    }

    /// Sends a load report.
    pub fn report_load(&self, instance: usize, load: InstanceLoad) -> Result<(), ConductorError> {
        self.send(ConductorMsg::LoadReport { instance, load })
    }

    /// Sends a KV event.
    pub fn kv_event(
        &self,
        location: KvLocation,
        stored: Vec<ChunkHash>,
        removed: Vec<ChunkHash>,
    ) -> Result<(), ConductorError> {
        self.send(ConductorMsg::KvEvent {
            location,
            stored,
            removed,
        })
    }

    /// Reports that a request finished decoding on `instance` after
    /// `output_tokens` tokens in all.
    pub fn decode_finished(
        &self,
        instance: usize,
        output_tokens: u32,
    ) -> Result<(), ConductorError> {
        self.send(ConductorMsg::DecodeFinished {
            instance,
            output_tokens,
        })
    }

    /// Marks an instance up or down.
    pub fn set_available(
        &self,
        kind: InstanceKind,
        instance: usize,
        available: bool,
    ) -> Result<(), ConductorError> {
        self.send(ConductorMsg::Availability {
            kind,
            instance,
            available,
        })
    }

    /// The least loaded decode instance that is up, for a request of
    /// `context_tokens` (see [`ConductorMsg::PickDecode`]).
    pub async fn pick_decode(
        &self,
        context_tokens: u64,
        timeout: Duration,
    ) -> Result<Option<usize>, ConductorError> {
        self.call(
            |reply| ConductorMsg::PickDecode {
                context_tokens,
                reply,
            },
            timeout,
        )
        .await
    }

    /// A snapshot of the conductor's view and counters.
    pub async fn snapshot(&self, timeout: Duration) -> Result<ConductorSnapshot, ConductorError> {
        self.call(|reply| ConductorMsg::Snapshot { reply }, timeout)
            .await
    }

    /// The underlying actor reference (sends through it are not bounded).
    pub fn actor(&self) -> &ActorRef<ConductorMsg> {
        &self.actor
    }

    /// Messages sent through handles and not yet handled.
    pub fn outstanding(&self) -> usize {
        self.gate.outstanding()
    }

    /// Asks the actor to stop.
    pub fn stop(&self) {
        self.actor.stop(None);
    }
}
