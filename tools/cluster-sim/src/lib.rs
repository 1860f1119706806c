//! A seeded simulation of a kvpool cluster, in one thread (issue 18).
//!
//! ```text
//!   clients: the REAL (batch) puts,  \                  /-- storage nodes: the REAL
//!   gets, read rules and removal call >-- simulated --<    round, task and control rules
//!   MasterCore (REAL) ---------------/    network       \   and tier index over a model's
//!                          (drop, delay, reorder,          I/O: DRAM, a simulated disk
//!                           duplicate, partition)
//!   one clock (sim ms), one event queue, one PRNG from the seed
//! ```
//!
//! What is real and what is a model:
//!
//! * The master is the real code: [`kvpool_master::core::MasterCore`], every
//!   shard's `ShardState` and the coordinator, routed as the live service
//!   routes, with the simulated clock as its argument. Its off-path eviction
//!   runs as events of its own (`EvictDrive::Manual`), as the live shards
//!   run it between requests.
//! * Clients ([`client`]) put with the real protocol,
//!   [`kvpool_client::put::PutProtocol`] (waits, re-placements, the end's
//!   resends, read-backs, the revoke at the deadline), singly and in
//!   batches ([`kvpool_client::put::batch::BatchPut`]); the model does its
//!   I/O. Their gets run the client's real get protocol
//!   ([`kvpool_client::get::GetProtocol`]: its location cache first, on the
//!   simulated clock, what an answer leaves there and until when), singly
//!   and in batches ([`kvpool_client::get::BatchGet`]), and the
//!   transfer engine's real read rules ([`kvpool_transport::read`]: replica
//!   order, shares of the time left, failover, unreachable nodes);
//!   removals are `Client::remove_with`'s typed call (`call::Remove`, its
//!   answer read as the client reads it) under the call's deadline.
//! * Storage nodes ([`node`]) follow the real protocol (`kvpool_wire::proto`
//!   requests and answers, the node's tasks and NVMe reports, pings, mounts
//!   and remounts). When a node mounts, reports its tier and pings is the
//!   node's own code ([`kvpool_storage_node::control`]); what a tier task does with the copies it finds (a
//!   Persist's found or replaced copy, a refused Promote, the copy a Drop
//!   takes) is the node's own code ([`kvpool_storage_node::task`]), as is
//!   a round's order of steps, what it reports and which copies it then
//!   removes ([`kvpool_storage_node::round`]) and which refused `Recovered`
//!   copies are stale, and when its tier evicts, how much and which copies
//!   first (the tier's byte watermarks and FIFO or LRU order,
//!   [`kvpool_storage::nvme::NvmeConfig::bytes_to_evict`]). The tier's
//!   index is the real one ([`kvpool_storage::tier_index::TierIndex`]:
//!   slots and extents, which copy a key names, write numbers, the read
//!   clock, eviction marks, and after a crash what recovery keeps of the
//!   records on the simulated disk). The calls and the I/O are a model of
//!   `actors/storage-node`: values are tags (put number n), and a checksum
//!   is a function of the tag. On even seeds the master replicates hot
//!   objects; a node runs its Fetch tasks by the node's rules
//!   ([`kvpool_storage_node::task::FetchRule`]), reading the source replica
//!   by the engine's read rules over the network (nodes without a tier run
//!   the same rounds for them, [`kvpool_storage_node::round::Steps`], as the
//!   real node's fetch loop does, at the same pace,
//!   [`kvpool_storage_node::round::Pace`]).
//! * Data requests: reads are the transfer engine's requests
//!   ([`kvpool_transport::read::data_request`]); nodes admit each write and
//!   read through the node's real gate ([`kvpool_storage_node::gate::DataGate`]:
//!   segment, range, NVMe region, grant, term) on the simulated clock
//!   ([`Ctx::admit`]). Seeds 2 and 3 of every 4 run with a cluster secret:
//!   the master signs a grant into every replica it hands out (the real
//!   signer); a grant that does not cover what the client does with it
//!   breaks an invariant; an expired one is refused. What a tier read is
//!   served is the node's rule ([`kvpool_storage_node::gate::NvmeRead`]).
//! * The network, clock and disk are simulated. Node crashes lose DRAM and
//!   the tier's index records not yet flushed (the write is torn: its copy
//!   is gone after restart); tier writes, flushes and removals fail at
//!   random. The master's state directory is a real one per run
//!   ([`StateDir`]). With [`Options::stalled_reads`] clients' reads now and
//!   then wait before they leave.
//!
//! After every event the world checks the invariants in `World::check`; a
//! failure names the seed, and `KVPOOL_SIM_SEED=<seed> cargo test --release
//! -p kvpool-cluster-sim` replays it exactly.

pub mod client;
mod invariants;
pub mod node;
mod trace;

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use kvpool_config::MasterConfig;
use kvpool_master::core::{EvictDrive, MasterCore};
use kvpool_master::state::GrantSigner;
use kvpool_storage_node::gate::DataGate;
use kvpool_wire::auth::{ClusterKey, GrantClock};
use kvpool_wire::proto::{
    DataRequest, MasterRequest, MasterResponse, NvmeUpdate, ObjectInfo, SegmentId, Tier,
};
use kvpool_wire::{ErrorCode, KvError};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use client::ClientModel;
use node::{Back, NodeModel};
use trace::{describe, describe_req, short_resp};

/// What survives a master restart. The master keeps its state directory
/// (`[master] state_dir`: the real journal, in a real directory of its
/// own per run, see [`StateDir`]) and `World::master_restart` opens it
/// (`MasterCore::open`), so an object with a DRAM replica comes back too:
/// once the node of that replica mounts its segment again (before the
/// recovered replicas expire, `client_ttl_ms` after the restart), the
/// master must list the object again, unless a client put or removed the
/// key since.
pub const DRAM_SURVIVES_MASTER_RESTART: bool = true;

/// The seed of the master's maps and sets in a simulation (the same in every
/// run; see `kvpool_master::fix_hash_seed`).
const MASTER_HASH_SEED: u64 = 0x5eed_0f3a_57e2;

/// Wall-clock time at simulated time 0 (what the journal's holds count in).
const UNIX_AT_ZERO_MS: u64 = 1_700_000_000_000;

/// What a seed is mixed with for the stream that draws tier removals'
/// failures.
const REMOVAL_STREAM: u64 = 0x7e30_57a1_d15c;

/// The cluster secret of the seeds that run with one.
const SECRET: &[u8] = b"the cluster simulation's secret, long enough";

/// What the master signs grants with, when the cluster has a secret.
fn signer(ctx: &Ctx) -> Option<GrantSigner> {
    ctx.key.clone().map(|key| GrantSigner {
        key,
        unix_at_zero_ms: UNIX_AT_ZERO_MS,
    })
}

/// The master's state directory for one run: a real directory, removed
/// when the run ends. The journal's files are written without sync; a
/// crash of the simulated master is a crash of the process, not of the
/// machine, so what it wrote is there when it starts again.
pub struct StateDir(std::path::PathBuf);

impl StateDir {
    fn new(seed: u64) -> Self {
        static RUN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = RUN.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let p = std::env::temp_dir().join(format!("kvpool-sim-{}-{seed}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).expect("the master's state directory");
        Self(p)
    }
}

impl Drop for StateDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// What a range or an NVMe copy holds: the value of put number `n`, or
/// bytes of no complete value.
pub type Content = Option<u64>;

/// The checksum of a value (what writers compute; bytes of no value have
/// none that any value has).
pub fn sum_of(c: Content) -> u64 {
    match c {
        Some(n) => n.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1,
        None => 0,
    }
}

/// Who sends and receives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Addr {
    Master,
    Client(usize),
    Node(usize),
}

/// A message on the simulated network.
#[derive(Debug, Clone)]
pub enum Body {
    /// A master request and its answer.
    Req { id: u64, req: MasterRequest },
    Resp {
        id: u64,
        res: Result<MasterResponse, KvError>,
    },
    /// Data plane: a `Write` of `content` to a DRAM range, under the
    /// master's grant for it (the wire's request; the bytes are a tag).
    Write {
        id: u64,
        req: DataRequest,
        content: Content,
    },
    /// Data plane: a `Read` of a DRAM range or a `ReadNvme` of a copy, as
    /// the transfer engine builds it (`kvpool_transport::read::data_request`).
    Read { id: u64, req: DataRequest },
    /// A data-plane answer (for a write, the content is `None`).
    Data {
        id: u64,
        res: Result<Content, ErrorCode>,
    },
}

#[derive(Debug, Clone)]
pub struct Msg {
    pub from: Addr,
    pub to: Addr,
    pub body: Body,
}

/// Timers of the models.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Timer {
    /// A node's ping (and mount/report) lane; `u64`: its incarnation.
    NodePing(u64),
    /// A node's NVMe round (tasks, reports, tier eviction).
    NodeRound(u64),
    /// A node's call (by request id) reaches its deadline.
    NodeDeadline(u64),
    /// A client starts its next call.
    ClientNext,
    /// A client's call `op` reaches its deadline.
    ClientDeadline(u64),
    /// A client's put ends a pause its protocol asked for (the pause's id).
    ClientWake(u64),
    /// A client's put's writes reach their time (the round's id).
    ClientWriteBy(u64),
    /// A client's read of one replica reaches the end of its share of the
    /// time left (the read's id).
    ClientReadShare(u64),
    /// A client's liveness ping.
    ClientPing,
    /// A node's read of a replica for a Fetch reaches the end of its share
    /// of the time left (the read's id).
    NodeReadShare(u64),
}

#[derive(Debug, Clone)]
enum Event {
    Deliver(Msg),
    Timer(Addr, Timer),
    MasterTick(u64),
    MasterEvict(u64),
    MasterCrash,
    MasterRestart,
    NodeCrash(usize),
    NodeRestart(usize),
    Cut(Addr),
    Heal(Addr),
}

/// The seed's fault rates.
#[derive(Debug, Clone)]
pub struct Faults {
    /// Probability a message is dropped.
    pub drop: f64,
    /// Probability an idempotent request or an answer arrives twice.
    pub duplicate: f64,
    /// Delivery takes 1..=this many ms (so messages reorder).
    pub max_delay_ms: u64,
    /// Crashes and partitions per simulated second.
    pub crash_rate: f64,
    /// Probability a tier write, flush or removal fails.
    pub disk_fail: f64,
}

impl Faults {
    fn draw(rng: &mut ChaCha8Rng) -> Self {
        let calm = rng.random_ratio(1, 8);
        Self {
            drop: if calm {
                0.0
            } else {
                [0.0, 0.002, 0.01, 0.03][rng.random_range(0..4)]
            },
            duplicate: if calm {
                0.0
            } else {
                [0.0, 0.01, 0.05][rng.random_range(0..3)]
            },
            max_delay_ms: [1, 5, 20][rng.random_range(0..3)],
            crash_rate: if calm {
                0.0
            } else {
                [0.0, 0.2, 0.5][rng.random_range(0..3)]
            },
            disk_fail: if calm {
                0.0
            } else {
                [0.0, 0.02, 0.1][rng.random_range(0..3)]
            },
        }
    }
}

/// A run's options.
#[derive(Debug, Clone)]
pub struct Options {
    /// Events to run.
    pub events: usize,
    /// A quarter of the clients run with `client.checksums = false` (off by
    /// default; with it the simulation found the master's demotion race
    /// and the node's report race of docs/RELIABILITY.md, seeds 798 and
    /// 442, both fixed; `tests/seeds.rs` replays them).
    pub some_clients_without_checksums: bool,
    /// Now and then a client's data read waits in the client before it
    /// leaves (a process descheduled between choosing a replica and
    /// sending), up to three quarters of the replica's share of the time
    /// left (one read in four): the read still reaches the node inside its
    /// window, but late enough that an NVMe copy may have been evicted and
    /// its slot reused by another key
    /// (off by default, so the seeds' schedules stay as they were).
    pub stalled_reads: bool,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            events: 3_000,
            some_clients_without_checksums: false,
            stalled_reads: false,
        }
    }
}

/// Counts of what a run did, so a test can say it reached what it is about.
#[derive(Debug, Default, Clone)]
pub struct Stats {
    pub events: u64,
    pub calls_ended: u64,
    pub puts_ok: u64,
    pub gets_ok: u64,
    pub corrupt_reads: u64,
    pub timeouts: u64,
    pub node_crashes: u64,
    pub master_crashes: u64,
    pub partitions: u64,
    pub dropped: u64,
    pub duplicated: u64,
    pub stored: u64,
    pub promoted: u64,
    pub recovered: u64,
    pub disk_failures: u64,
    pub owed_checked: u64,
    /// What the real put protocol asked the client models for: pauses
    /// (told to wait, or an end resent), reports of unreachable nodes,
    /// read-backs after a lost answer.
    pub put_pauses: u64,
    pub put_reports: u64,
    pub put_readbacks: u64,
    /// What the real read rules did: a replica after another failed, a
    /// replica that did not answer within its share of the time left.
    pub read_failovers: u64,
    pub read_shares_passed: u64,
    /// Batch puts begun (each runs the real `BatchPut`).
    pub batch_puts: u64,
    /// Batch gets (the client's real `BatchGet`).
    pub batch_gets: u64,
    /// Copies the tiers evicted, in the real tier's FIFO and LRU orders.
    pub fifo_evictions: u64,
    pub lru_evictions: u64,
    /// Persists the tier had no room for (no slot, or no extent that large
    /// from its allocator).
    pub tier_full: u64,
    /// Persists that found no room and had the tier evict for them in the
    /// middle of the round's tasks (then tried once more).
    pub room_made: u64,
    /// Gets that read through the location cache's entry first.
    pub location_hits: u64,
    /// Extra replicas of hot objects the nodes fetched (and those that
    /// failed).
    pub hot_fetches: u64,
    pub hot_fetches_failed: u64,
    /// Grants the nodes checked (seeds with a cluster secret), and those
    /// refused as expired (sent late: a hot fetch that waited in its
    /// node's round past its grants); any other refusal breaks an invariant.
    pub grants_checked: u64,
    pub grants_expired: u64,
    /// Client reads held back before they left ([`Options::stalled_reads`]),
    /// and tier reads that found their slot holding another key's copy
    /// (which the node's rule,
    /// [`kvpool_storage_node::gate::NvmeRead`], does not serve).
    pub reads_stalled: u64,
    pub nvme_reads_of_reused_slots: u64,
    /// Object versions a client's removal took away (never listed again).
    pub versions_removed: u64,
    /// Tier copies whose eviction the master took and whose first removal
    /// failed, freed by a later eviction step.
    pub owed_releases_done: u64,
}

impl Stats {
    pub fn add(&mut self, o: &Stats) {
        self.events += o.events;
        self.calls_ended += o.calls_ended;
        self.puts_ok += o.puts_ok;
        self.gets_ok += o.gets_ok;
        self.corrupt_reads += o.corrupt_reads;
        self.timeouts += o.timeouts;
        self.node_crashes += o.node_crashes;
        self.master_crashes += o.master_crashes;
        self.partitions += o.partitions;
        self.dropped += o.dropped;
        self.duplicated += o.duplicated;
        self.stored += o.stored;
        self.promoted += o.promoted;
        self.recovered += o.recovered;
        self.disk_failures += o.disk_failures;
        self.owed_checked += o.owed_checked;
        self.put_pauses += o.put_pauses;
        self.put_reports += o.put_reports;
        self.put_readbacks += o.put_readbacks;
        self.read_failovers += o.read_failovers;
        self.read_shares_passed += o.read_shares_passed;
        self.batch_puts += o.batch_puts;
        self.batch_gets += o.batch_gets;
        self.fifo_evictions += o.fifo_evictions;
        self.lru_evictions += o.lru_evictions;
        self.tier_full += o.tier_full;
        self.room_made += o.room_made;
        self.location_hits += o.location_hits;
        self.hot_fetches += o.hot_fetches;
        self.hot_fetches_failed += o.hot_fetches_failed;
        self.grants_checked += o.grants_checked;
        self.grants_expired += o.grants_expired;
        self.reads_stalled += o.reads_stalled;
        self.nvme_reads_of_reused_slots += o.nvme_reads_of_reused_slots;
        self.versions_removed += o.versions_removed;
        self.owed_releases_done += o.owed_releases_done;
    }
}

/// A broken invariant: what, when, and the last events before it.
#[derive(Debug)]
pub struct Failure {
    pub seed: u64,
    pub at_ms: u64,
    pub event: u64,
    pub what: String,
    pub trace: Vec<String>,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "seed {} broke an invariant at event {} ({} ms): {}",
            self.seed, self.event, self.at_ms, self.what
        )?;
        writeln!(
            f,
            "replay: KVPOOL_SIM_SEED={} cargo test --release -p kvpool-cluster-sim",
            self.seed
        )?;
        writeln!(f, "last events:")?;
        for t in &self.trace {
            writeln!(f, "  {t}")?;
        }
        Ok(())
    }
}

/// Simulated cluster sizes and timings.
pub const SHARDS: u32 = 2;
pub const KEYS: usize = 16;
pub const DRAM_BYTES: u64 = 64 << 10;
pub const LEASE_TTL_MS: u64 = 400;
/// The longest value the master stores (clients put at most 9000 bytes):
/// the bound clients hold the master's replica lists to.
pub const MAX_VALUE_BYTES: u64 = 16 << 10;
pub const CLIENT_TTL_MS: u64 = 3_000;
pub const CLIENT_TIMEOUT_MS: u64 = 1_500;
pub const PING_MS: u64 = 500;
/// A node's `task_poll_ms`: the pause after a round that ran no task.
pub const ROUND_MS: u64 = 50;
const TICK_MS: u64 = 100;
const EVICT_MS: u64 = 20;
const TRACE: usize = 120;

/// The key named `i`.
pub fn key(i: usize) -> Vec<u8> {
    format!("k{i}").into_bytes()
}

/// What every model may touch: the clock, the queue, the network, the PRNG,
/// the record of put values, and the failure slot.
pub struct Ctx {
    pub now: u64,
    pub rng: ChaCha8Rng,
    /// Draws whether a tier removal fails ([`Ctx::disk_fails`]): a stream of
    /// its own, so removals draw nothing from `rng` and a seed's schedule
    /// changes only where a removal fails.
    removal_rng: ChaCha8Rng,
    queue: BTreeMap<(u64, u64), Event>,
    seq: u64,
    next_id: u64,
    pub faults: Faults,
    cut: HashSet<Addr>,
    /// Put number -> the key it was put under (every value ever written).
    pub tag_key: Vec<Vec<u8>>,
    /// DRAM and NVMe segment id -> the node that made it.
    pub seg_node: HashMap<SegmentId, usize>,
    /// The master makes extra replicas of hot objects (`hot_replicas`):
    /// nodes without a tier run task rounds too, for their Fetch tasks.
    pub hot: bool,
    /// The cluster secret (seeds 2 and 3 of every 4): the master signs a
    /// grant into every replica it hands out, and nodes check it.
    pub key: Option<ClusterKey>,
    /// [`Options::stalled_reads`].
    pub stalled_reads: bool,
    pub stats: Stats,
    pub violation: Option<String>,
    trace: VecDeque<String>,
}

/// What a node's gate checks a data request against: its DRAM segment,
/// its tier's segment and the newest master term it has seen.
#[derive(Clone, Copy)]
pub struct NodeGate<'a> {
    pub dram: SegmentId,
    pub nvme: Option<SegmentId>,
    pub term: &'a AtomicU64,
}

impl Ctx {
    /// A node's gate on a data request: the real `DataGate::admit` (the
    /// segment and range, the NVMe region, and with a cluster secret the
    /// grant for the request's operation and its master term) on the
    /// simulated clock (no skew). A refusal that is not the grant's (a
    /// segment the node no longer serves) is the request's error. A grant
    /// the master signed covers what the client does with it: a grant
    /// refused for anything but its expiry breaks an invariant. An expired
    /// one (a hot fetch that waited in its node's round past its grants) is
    /// refused as the node refuses it: the fetch fails and the object is
    /// replicated later.
    pub fn admit(&mut self, node: NodeGate<'_>, req: &DataRequest) -> Result<(), ErrorCode> {
        let now_ms = UNIX_AT_ZERO_MS + self.now;
        let expires_ms = match req {
            DataRequest::Write { grant, .. }
            | DataRequest::Read { grant, .. }
            | DataRequest::ReadNvme { grant, .. } => grant.expires_ms,
            _ => now_ms,
        };
        let gate = DataGate {
            segment_len: DRAM_BYTES,
            segment_id: node.dram,
            nvme_id: node.nvme,
            shard: 0,
            key: self.key.as_ref(),
            term: node.term,
        };
        // Everything but the expiry first: the clock held at the grant's end.
        let held = GrantClock {
            now_ms: now_ms.min(expires_ms),
            skew_ms: 0,
        };
        let signed = gate.admit(req, held);
        let live = signed
            .is_ok()
            .then(|| gate.admit(req, GrantClock { now_ms, skew_ms: 0 }));
        match signed {
            Err(r) if r.auth => {
                self.fail(format!(
                    "a node refused the master's grant for {}: {}",
                    describe(req),
                    r.error
                ));
                return Err(r.error.code);
            }
            Err(r) => return Err(r.error.code),
            Ok(()) => {}
        }
        if self.key.is_some() {
            self.stats.grants_checked += 1;
        }
        match live {
            Some(Err(r)) => {
                self.stats.grants_expired += 1;
                Err(r.error.code)
            }
            _ => Ok(()),
        }
    }

    /// Sends a read of replica `r` of `key` to the node that serves it;
    /// the read's id, or `Unavailable` when no node serves its segment.
    /// With [`Options::stalled_reads`], one read in four waits before it
    /// leaves, up to three quarters of `share` (the time the reader gives
    /// this replica): its answer mostly comes within the share (a short
    /// share and slow legs may miss it: the reader moves on, as for a
    /// silent node). Whether the read is dropped or cut off is decided now,
    /// not when it leaves.
    pub fn send_read(
        &mut self,
        from: Addr,
        r: &kvpool_wire::proto::ReplicaDesc,
        key: &[u8],
        share: Duration,
    ) -> Result<u64, KvError> {
        let Some(&n) = self.seg_node.get(&r.segment_id) else {
            return Err(KvError::new(
                ErrorCode::Unavailable,
                "no node serves this segment",
            ));
        };
        let id = self.id();
        let body = Body::Read {
            id,
            req: kvpool_transport::read::data_request(r, key, 0, r.len),
        };
        let most = share.as_millis() as u64 * 3 / 4;
        let stall = if self.stalled_reads && most > 0 && self.rng.random_ratio(1, 4) {
            self.stats.reads_stalled += 1;
            self.rng.random_range(1..=most)
        } else {
            0
        };
        self.send_after(stall, from, Addr::Node(n), body);
        Ok(id)
    }

    /// Whether a tier removal's write fails (the seed's `disk_fail`, drawn
    /// from a stream of its own).
    pub fn disk_fails(&mut self) -> bool {
        let p = self.faults.disk_fail;
        let fails = p > 0.0 && self.removal_rng.random_bool(p);
        if fails {
            self.stats.disk_failures += 1;
            self.note("a tier removal fails: the copy stays".into());
        }
        fails
    }

    /// A fresh request or transfer id.
    pub fn id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    fn at(&mut self, t: u64, e: Event) {
        self.seq += 1;
        self.queue.insert((t, self.seq), e);
    }

    /// Runs `timer` of `who` in `after_ms`.
    pub fn timer(&mut self, who: Addr, after_ms: u64, timer: Timer) {
        self.at(self.now + after_ms, Event::Timer(who, timer));
    }

    /// A new value for `key`: its tag.
    pub fn new_tag(&mut self, key: &[u8]) -> u64 {
        self.tag_key.push(key.to_vec());
        self.tag_key.len() as u64 - 1
    }

    /// Whether `c` is a value put under `key`.
    pub fn is_value_of(&self, c: Content, key: &[u8]) -> bool {
        c.is_some_and(|t| self.tag_key.get(t as usize).is_some_and(|k| k == key))
    }

    /// Records a broken invariant (the first one counts).
    pub fn fail(&mut self, what: String) {
        if self.violation.is_none() {
            self.violation = Some(what);
        }
    }

    pub fn note(&mut self, s: String) {
        if self.trace.len() == TRACE {
            self.trace.pop_front();
        }
        self.trace.push_back(format!("{:>7} ms {s}", self.now));
    }

    /// Sends `body`; the network may drop, delay (and so reorder),
    /// duplicate (what may safely arrive twice) or cut it.
    pub fn send(&mut self, from: Addr, to: Addr, body: Body) {
        self.send_after(0, from, to, body);
    }

    /// [`Ctx::send`], the message leaving `stall` ms from now.
    fn send_after(&mut self, stall: u64, from: Addr, to: Addr, body: Body) {
        if self.cut.contains(&from) || self.cut.contains(&to) {
            self.stats.dropped += 1;
            return;
        }
        if self.rng.random_bool(self.faults.drop) {
            self.stats.dropped += 1;
            return;
        }
        // TCP does not duplicate; what a real peer may see twice is an
        // idempotent request resent on a fresh connection, or a read.
        let may_repeat = match &body {
            Body::Req { req, .. } => req.is_idempotent(),
            Body::Read { .. } | Body::Resp { .. } | Body::Data { .. } => true,
            Body::Write { .. } => false,
        };
        let copies = if may_repeat && self.rng.random_bool(self.faults.duplicate) {
            self.stats.duplicated += 1;
            2
        } else {
            1
        };
        for _ in 0..copies {
            let d = self.rng.random_range(1..=self.faults.max_delay_ms);
            let m = Msg {
                from,
                to,
                body: body.clone(),
            };
            self.at(self.now + stall + d, Event::Deliver(m));
        }
    }

    /// Sends a master request from `from`; its id.
    pub fn ask(&mut self, from: Addr, req: MasterRequest) -> u64 {
        let id = self.id();
        self.send(from, Addr::Master, Body::Req { id, req });
        id
    }
}

/// One key's state at the master, as `describe` gives it.
type Snap = Vec<Option<ObjectInfo>>;

/// A replica a master listed before it crashed: its object must be listed
/// again once its node has reported its tier (an NVMe copy) or mounted its
/// DRAM segment again in time (a DRAM replica), unless a client touched
/// the key.
#[derive(Debug, Clone)]
struct Owed {
    key: Vec<u8>,
    seg: SegmentId,
    loc: u64,
    tier: Tier,
}

/// The cluster.
pub struct World {
    pub seed: u64,
    pub ctx: Ctx,
    cfg: MasterConfig,
    master: Option<MasterCore>,
    master_epoch: u64,
    /// Until when a restarted master keeps the recovered replicas of
    /// segments that have not mounted again.
    parked_until: u64,
    state: StateDir,
    pub nodes: Vec<NodeModel>,
    pub clients: Vec<ClientModel>,
    snap: Snap,
    /// Read leases: (segment, offset, len) -> (content when granted, end).
    leases: Vec<(SegmentId, u64, u64, Content, u64, u64)>,
    owed: Vec<Owed>,
    /// Keys a client put or removed at the master since it restarted.
    touched: HashSet<Vec<u8>>,
    /// Per key, the newest version a client's removal took away: the key's
    /// object is never listed again at that version or an older one (a
    /// removed key does not come back from an old copy, restart or not).
    removed: Vec<Option<u64>>,
    keys: Vec<Vec<u8>>,
}

impl World {
    pub fn new(seed: u64, opts: &Options) -> Self {
        // The master's maps iterate in one order in every run (its task
        // queues, owed Drops, parked objects...): a seed replays exactly.
        assert!(
            kvpool_master::fix_hash_seed(MASTER_HASH_SEED),
            "the master's hash seed was drawn before the simulation fixed it"
        );
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let faults = Faults::draw(&mut rng);
        let nr_nodes = rng.random_range(2..=3);
        let nr_clients = rng.random_range(2..=3);
        // Even seeds replicate hot objects (no draw: the seeds' streams
        // stay as they were).
        let hot = seed.is_multiple_of(2);
        // Seeds 2 and 3 of every 4 run with a cluster secret (no draw).
        let secret = (seed % 4 >= 2).then(|| ClusterKey::new(SECRET).expect("a long secret"));
        let cfg = MasterConfig {
            lease_ttl_ms: LEASE_TTL_MS,
            max_value_bytes: kvpool_runtime::config::Bytes(MAX_VALUE_BYTES),
            client_ttl_ms: CLIENT_TTL_MS,
            stale_put_grace_ms: 2 * CLIENT_TIMEOUT_MS,
            put_timeout_ms: 2 * CLIENT_TIMEOUT_MS,
            high_watermark: 0.7,
            eviction_ratio: 0.3,
            promote_after_reads: 2,
            hot_replicas: if hot { 2 } else { 0 },
            hot_reads: 3,
            hot_window_ms: 1_000,
            tick_ms: TICK_MS,
            ..Default::default()
        };
        let mut ctx = Ctx {
            now: 0,
            rng,
            removal_rng: ChaCha8Rng::seed_from_u64(seed ^ REMOVAL_STREAM),
            queue: BTreeMap::new(),
            seq: 0,
            next_id: 0,
            faults,
            cut: HashSet::new(),
            tag_key: Vec::new(),
            seg_node: HashMap::new(),
            hot,
            key: secret,
            stalled_reads: opts.stalled_reads,
            stats: Stats::default(),
            violation: None,
            trace: VecDeque::new(),
        };
        let nodes = (0..nr_nodes).map(|i| NodeModel::new(i, &mut ctx)).collect();
        let clients = (0..nr_clients)
            .map(|i| {
                let sums = !opts.some_clients_without_checksums || ctx.rng.random_ratio(3, 4);
                ClientModel::new(i, sums, &mut ctx)
            })
            .collect();
        let state = StateDir::new(seed);
        let mut m = MasterCore::open(SHARDS, &cfg, seed, &state.0, 0, UNIX_AT_ZERO_MS)
            .expect("an empty state directory opens")
            .with_signer(signer(&ctx));
        m.evict = EvictDrive::Manual;
        ctx.at(TICK_MS, Event::MasterTick(0));
        ctx.at(EVICT_MS, Event::MasterEvict(0));
        let keys = (0..KEYS).map(key).collect();
        let mut w = Self {
            seed,
            ctx,
            cfg,
            master: Some(m),
            master_epoch: 0,
            parked_until: 0,
            state,
            nodes,
            clients,
            snap: vec![None; KEYS],
            leases: Vec::new(),
            owed: Vec::new(),
            touched: HashSet::new(),
            removed: vec![None; KEYS],
            keys,
        };
        w.schedule_next_fault();
        w
    }

    fn schedule_next_fault(&mut self) {
        let rate = self.ctx.faults.crash_rate;
        if rate <= 0.0 {
            return;
        }
        let gap = (1000.0 / rate) as u64;
        let t = self.ctx.now + self.ctx.rng.random_range(gap / 2..=gap * 3 / 2);
        let n = self.nodes.len();
        let e = match self.ctx.rng.random_range(0..10) {
            0..=3 => Event::NodeCrash(self.ctx.rng.random_range(0..n)),
            4..=5 => Event::MasterCrash,
            6..=7 => Event::Cut(Addr::Node(self.ctx.rng.random_range(0..n))),
            _ => Event::Cut(Addr::Client(
                self.ctx.rng.random_range(0..self.clients.len()),
            )),
        };
        self.ctx.at(t, e);
    }

    /// Runs `opts.events` events; the first broken invariant, if any.
    pub fn run(mut self, opts: &Options) -> Result<Stats, Failure> {
        for _ in 0..opts.events {
            let Some(((t, _), e)) = self.ctx.queue.pop_first() else {
                break;
            };
            self.ctx.now = t;
            self.ctx.stats.events += 1;
            self.event(e);
            self.check();
            if let Some(what) = self.ctx.violation.take() {
                return Err(Failure {
                    seed: self.seed,
                    at_ms: self.ctx.now,
                    event: self.ctx.stats.events,
                    what,
                    trace: self.ctx.trace.drain(..).collect(),
                });
            }
        }
        Ok(self.ctx.stats)
    }

    fn event(&mut self, e: Event) {
        match e {
            Event::Deliver(m) => self.deliver(m),
            Event::Timer(Addr::Node(i), t) => self.nodes[i].on_timer(t, &mut self.ctx),
            Event::Timer(Addr::Client(i), t) => self.clients[i].on_timer(t, &mut self.ctx),
            Event::Timer(Addr::Master, _) => {}
            Event::MasterTick(epoch) => {
                if epoch == self.master_epoch {
                    if let Some(m) = self.master.as_mut() {
                        m.tick(self.ctx.now);
                        self.ctx
                            .at(self.ctx.now + TICK_MS, Event::MasterTick(epoch));
                        self.after_master("tick", None);
                    }
                }
            }
            Event::MasterEvict(epoch) => {
                if epoch == self.master_epoch {
                    if let Some(m) = self.master.as_mut() {
                        let budget = self.ctx.rng.random_range(1..=4);
                        m.evict_step(self.ctx.now, budget);
                        self.ctx
                            .at(self.ctx.now + EVICT_MS, Event::MasterEvict(epoch));
                        self.after_master("evict step", None);
                    }
                }
            }
            Event::MasterCrash => {
                // A master already down does not crash again (nor come
                // back twice: a second restart would be a crash no one
                // noted, of a master that had half heard the nodes).
                if self.master.is_some() {
                    self.master_crash();
                    let down = self.ctx.rng.random_range(50..2_000);
                    self.ctx.at(self.ctx.now + down, Event::MasterRestart);
                }
                self.schedule_next_fault();
            }
            Event::MasterRestart => self.master_restart(),
            Event::NodeCrash(i) => {
                if self.nodes[i].up {
                    self.ctx.note(format!("node {i} crashes"));
                    self.ctx.stats.node_crashes += 1;
                    self.nodes[i].crash(&mut self.ctx);
                    let down = self.ctx.rng.random_range(50..3_000);
                    self.ctx.at(self.ctx.now + down, Event::NodeRestart(i));
                }
                self.schedule_next_fault();
            }
            Event::NodeRestart(i) => {
                self.ctx.note(format!("node {i} restarts"));
                self.nodes[i].restart(&mut self.ctx);
            }
            Event::Cut(a) => {
                if self.ctx.cut.insert(a) {
                    self.ctx.note(format!("{a:?} cut off"));
                    self.ctx.stats.partitions += 1;
                    let len = self.ctx.rng.random_range(100..2 * CLIENT_TTL_MS);
                    self.ctx.at(self.ctx.now + len, Event::Heal(a));
                }
                self.schedule_next_fault();
            }
            Event::Heal(a) => {
                self.ctx.note(format!("{a:?} joined again"));
                self.ctx.cut.remove(&a);
            }
        }
    }

    fn master_crash(&mut self) {
        if self.master.is_none() {
            return;
        }
        self.ctx.note("the master crashes".into());
        self.ctx.stats.master_crashes += 1;
        // What it listed with an NVMe copy must come back once the tier is
        // reported again.
        self.owed.clear();
        for info in self.snap.iter().flatten().filter(|i| i.complete) {
            for r in info.replicas.iter() {
                if r.tier == Tier::Dram && !DRAM_SURVIVES_MASTER_RESTART {
                    continue;
                }
                self.owed.push(Owed {
                    key: info.key.clone(),
                    seg: r.segment_id,
                    loc: r.offset,
                    tier: r.tier,
                });
            }
        }
        self.master = None;
        self.leases.clear();
    }

    /// The master starts again. THE place that decides what a restarted
    /// master knows: what its state directory holds (nodes mount again and
    /// report their tiers). See [`DRAM_SURVIVES_MASTER_RESTART`].
    fn master_restart(&mut self) {
        self.ctx.note("the master restarts".into());
        self.master_epoch += 1;
        let seed = self.seed ^ self.master_epoch;
        let now = self.ctx.now;
        let m = if DRAM_SURVIVES_MASTER_RESTART {
            match MasterCore::open(SHARDS, &self.cfg, seed, &self.state.0, now, UNIX_AT_ZERO_MS) {
                Ok(m) => m,
                Err(e) => {
                    self.ctx
                        .fail(format!("the master cannot open its state directory: {e}"));
                    self.removed.fill(None);
                    MasterCore::new(SHARDS, &self.cfg, seed)
                }
            }
        } else {
            // A master without its state may adopt an old copy again.
            self.removed.fill(None);
            MasterCore::new(SHARDS, &self.cfg, seed)
        };
        self.parked_until = now + self.cfg.client_ttl_ms;
        let mut m = m.with_signer(signer(&self.ctx));
        m.evict = EvictDrive::Manual;
        self.master = Some(m);
        self.touched.clear();
        let e = self.master_epoch;
        self.ctx.at(self.ctx.now + TICK_MS, Event::MasterTick(e));
        self.ctx.at(self.ctx.now + EVICT_MS, Event::MasterEvict(e));
        self.snap = self.describe_all();
    }

    /// Whether the node that made `seg` is up and still serves it.
    fn segment_alive(&self, seg: SegmentId) -> bool {
        self.ctx
            .seg_node
            .get(&seg)
            .is_some_and(|&n| self.nodes[n].serves(seg))
    }

    fn deliver(&mut self, m: Msg) {
        match m.to {
            Addr::Master => self.at_master(m),
            Addr::Node(i) => {
                if !self.nodes[i].up {
                    // Connection refused: the sender hears at once.
                    refuse(&mut self.ctx, &m);
                    return;
                }
                match self.nodes[i].on_msg(m, &mut self.ctx) {
                    Back::Nothing => {}
                    Back::Dram => self.check_owed(i, Tier::Dram),
                    Back::Tier => self.check_owed(i, Tier::Nvme),
                }
            }
            Addr::Client(i) => self.clients[i].on_msg(m, &mut self.ctx),
        }
    }

    fn at_master(&mut self, m: Msg) {
        let Body::Req { id, req } = m.body else {
            return;
        };
        let Some(master) = self.master.as_mut() else {
            refuse(
                &mut self.ctx,
                &Msg {
                    from: m.from,
                    to: Addr::Master,
                    body: Body::Req { id, req },
                },
            );
            return;
        };
        let now = self.ctx.now;
        let what = describe_req(&req);
        let removes = removed_keys(&req);
        let lease_key = match &req {
            MasterRequest::GetReplicaList { key } => Some(key.clone()),
            _ => None,
        };
        if let Some(k) = req.key() {
            if matches!(
                req,
                MasterRequest::PutStart { .. } | MasterRequest::Remove { .. }
            ) {
                self.touched.insert(k.to_vec());
            }
        }
        if matches!(req, MasterRequest::RemoveAll { .. }) {
            self.touched.extend(self.keys.iter().cloned());
        }
        if matches!(
            req,
            MasterRequest::BatchPutStart { .. } | MasterRequest::BatchRemove { .. }
        ) {
            let keys = req.batch_keys().unwrap_or_default();
            self.touched.extend(keys.into_iter().map(<[u8]>::to_vec));
        }
        // A client's removal: the keys it names and their versions now.
        let removing: Vec<(usize, u64)> = match &req {
            MasterRequest::Remove { .. }
            | MasterRequest::BatchRemove { .. }
            | MasterRequest::RemoveAll { .. } => (0..KEYS)
                .filter(|&i| removes.as_ref().is_some_and(|r| r.contains(&self.keys[i])))
                .filter_map(|i| Some((i, version_of(master, &self.keys[i])?)))
                .collect(),
            _ => Vec::new(),
        };
        let res = master.call(req, now);
        for (i, v) in removing {
            if version_of(master, &self.keys[i]).is_none() {
                self.removed[i] = self.removed[i].max(Some(v));
                self.ctx.stats.versions_removed += 1;
            }
        }
        self.ctx.note(format!(
            "{:?} -> master: {what} => {}",
            m.from,
            match &res {
                Ok(r) => short_resp(r),
                Err(e) => format!("{:?}", e.code),
            }
        ));
        if let (Some(key), Ok(MasterResponse::Replicas(rs))) = (&lease_key, &res) {
            // A read lease on each DRAM replica: its bytes must not change
            // until it ends.
            for r in rs.iter().filter(|r| r.tier == Tier::Dram) {
                if let Some(c) = self.dram_content(r.segment_id, r.offset, r.len) {
                    let _ = key;
                    self.leases.push((
                        r.segment_id,
                        r.offset,
                        r.len,
                        c,
                        now + LEASE_TTL_MS,
                        self.master_epoch,
                    ));
                }
            }
        }
        self.after_master(&what, removes);
        self.ctx.send(Addr::Master, m.from, Body::Resp { id, res });
    }
}

/// A peer that is down (or has no such connection) refuses at once.
fn refuse(ctx: &mut Ctx, m: &Msg) {
    let body = match &m.body {
        Body::Req { id, .. } => Body::Resp {
            id: *id,
            res: Err(KvError::new(ErrorCode::Unavailable, "connection refused")),
        },
        Body::Write { id, .. } | Body::Read { id, .. } => Body::Data {
            id: *id,
            res: Err(ErrorCode::Unavailable),
        },
        _ => return,
    };
    ctx.send(m.to, m.from, body);
}

/// The version of `key`'s complete object at `m`, if it has one.
fn version_of(m: &MasterCore, key: &[u8]) -> Option<u64> {
    m.shards[m.shard_of(key)].version_of(key)
}

/// The keys a request removes, if it removes any.
fn removed_keys(req: &MasterRequest) -> Option<Vec<Vec<u8>>> {
    match req {
        MasterRequest::Remove { key, .. } => Some(vec![key.clone()]),
        MasterRequest::BatchRemove { keys, .. } => Some(keys.clone()),
        MasterRequest::RemoveAll { .. } => Some((0..KEYS).map(key).collect()),
        // The tier evicts a copy: reported first, removed once the master
        // took the report.
        MasterRequest::NvmeUpdates { updates, .. } => Some(
            updates
                .iter()
                .filter(|u| matches!(u, NvmeUpdate::Evicted { .. }))
                .map(|u| u.key().to_vec())
                .collect(),
        ),
        _ => None,
    }
}

/// Runs one seed.
pub fn run_seed(seed: u64, opts: &Options) -> Result<Stats, Failure> {
    World::new(seed, opts).run(opts)
}
