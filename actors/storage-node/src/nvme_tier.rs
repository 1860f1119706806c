//! A storage node's NVMe tier at work.
//!
//! ```text
//!  shard i: NvmeShard for region i (thread-local: it is !Send), serves
//!           ReadNvme for its region; runs the persist / promote jobs the
//!           loop sends it (its region holds the keys that hash to it)
//!  loop (tokio): every task_poll_ms
//!     NodeTasks from every master shard -> jobs on the owning shards
//!       Persist  (demotion or write-through): DRAM bytes -> NVMe -> Stored
//!       Promote: NVMe bytes -> the DRAM range the master allocated -> Promoted
//!     eviction past the tier's watermark: mark -> report Evicted -> release
//!       (a release that fails is owed: tried again at the next eviction)
//!  start: every region recovers its index; the objects are re-reported
//! ```

use std::cell::RefCell;
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpool_runtime::hash::value_sum;
use kvpool_runtime::{ShardHandle, Shutdown};
use kvpool_storage::nvme::{Eviction, NvmeConfig, NvmeError, NvmeLoc, NvmeShard, NvmeValue};
use kvpool_storage::Segment;
use kvpool_wire::proto::{
    call, segment_id_for, DropTask, Endpoint, NodeTask, NvmeUpdate, PersistTask, PromoteTask,
    SegmentId, SegmentSpec, Tier,
};
use kvpool_wire::{ErrorCode, KvError};
use xxhash_rust::xxh3::xxh3_64;

use crate::metrics::StorageMetrics;
use crate::round::{run_rounds, Round, Step, Steps, TASKS_PER_STEP};
use crate::task::{self, DropRule, PersistRule, PromoteRule};
use kvpool_client::Client;
use kvpool_config::NodeError;
use kvpool_config::{NvmeEvictionPolicy, NvmeTierConfig};

thread_local! {
    /// This shard's region of the tier (set at start on every shard).
    static TIER: RefCell<Option<Rc<NvmeShard>>> = const { RefCell::new(None) };
}

fn tier() -> Result<Rc<NvmeShard>, KvError> {
    TIER.with(|t| t.borrow().clone())
        .ok_or_else(|| KvError::new(ErrorCode::Unavailable, "this node has no NVMe tier"))
}

/// Maps the tier's errors to the protocol's codes.
pub fn kv(e: NvmeError) -> KvError {
    let code = match &e {
        NvmeError::Corrupt { .. } => ErrorCode::Corrupt,
        NvmeError::NoSpace(_) => ErrorCode::NoSpace,
        NvmeError::NotFound(_) => ErrorCode::ObjectNotFound,
        NvmeError::Invalid(_) => ErrorCode::InvalidParams,
        NvmeError::Io(_) => ErrorCode::Internal,
    };
    KvError::new(code, e.to_string())
}

/// The region (and so the shard) that holds `key`.
pub fn region_of(key: &[u8], regions: usize) -> usize {
    (xxh3_64(key) % regions.max(1) as u64) as usize
}

/// The node's handle on its tier (the tokio side).
pub struct NodeNvme {
    pub segment_id: SegmentId,
    pub spec: SegmentSpec,
    /// Objects the tier found on the device at start.
    pub recovered: usize,
    regions: usize,
    shards: ShardHandle,
    dram: Arc<Segment>,
    dram_id: SegmentId,
    metrics: StorageMetrics,
    poll: Duration,
}

/// Opens the tier's region on every shard and recovers their indexes.
pub async fn open(
    shards: &ShardHandle,
    cfg: &NvmeTierConfig,
    host_id: &str,
    endpoint: Endpoint,
    dram: Arc<Segment>,
    dram_id: SegmentId,
    metrics: StorageMetrics,
) -> Result<NodeNvme, NodeError> {
    let path = canonical(&cfg.path)?;
    let regions = shards.nr_shards();
    let ncfg = NvmeConfig {
        capacity: cfg.capacity.get(),
        regions: regions as u32,
        avg_object_bytes: cfg.avg_object_bytes.get(),
        high_watermark: cfg.high_watermark,
        low_watermark: cfg.low_watermark,
        eviction: match cfg.eviction {
            NvmeEvictionPolicy::Fifo => Eviction::Fifo,
            NvmeEvictionPolicy::Lru => Eviction::Lru,
        },
        sync_writes: cfg.sync_writes,
    };
    let mut recovered = 0;
    for i in 0..regions {
        let (p, c) = (path.clone(), ncfg.clone());
        let rec = shards
            .run_on(i, move |_ctx| async move {
                let (t, rec) = NvmeShard::open(&p, c, i as u32).await?;
                TIER.with(|s| *s.borrow_mut() = Some(Rc::new(t)));
                Ok::<_, NvmeError>(rec)
            })
            .await?
            .map_err(|e| NodeError::Start(format!("NVMe tier {}: {e}", path.display())))?;
        recovered += rec.len();
    }
    let name = format!("nvme:{host_id}:{}", path.display());
    let segment_id = segment_id_for(&name);
    tracing::info!(
        path = %path.display(),
        capacity = cfg.capacity.get(),
        regions,
        recovered,
        "NVMe tier open"
    );
    metrics.nvme_capacity.set(cfg.capacity.get() as i64);
    Ok(NodeNvme {
        segment_id,
        spec: SegmentSpec {
            name,
            size: cfg.capacity.get(),
            endpoint,
            slice_bytes: 0,
            host_id: host_id.to_string(),
            tier: Tier::Nvme,
            nvme: None,
        },
        recovered,
        regions,
        shards: shards.clone(),
        dram,
        dram_id,
        metrics,
        poll: Duration::from_millis(cfg.task_poll_ms),
    })
}

fn canonical(p: &str) -> Result<PathBuf, NodeError> {
    let path = PathBuf::from(p);
    if path.exists() {
        return std::fs::canonicalize(&path)
            .map_err(|e| NodeError::Start(format!("NVMe path {p}: {e}")));
    }
    let parent = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(std::path::Path::new("."));
    let dir = std::fs::canonicalize(parent)
        .map_err(|e| NodeError::Start(format!("NVMe path {p}: its directory: {e}")))?;
    Ok(dir.join(path.file_name().unwrap_or_default()))
}

/// Reads an object of this shard's region (for the data plane and
/// promotions). Only the copy `wanted` names by its key and version is read (else
/// `NotFound`): the slot may hold another copy since the reader learnt of it.
pub async fn read_local(
    loc: NvmeLoc,
    metrics: &StorageMetrics,
    wanted: impl FnOnce(&[u8], u64) -> bool,
) -> Result<NvmeValue, KvError> {
    let t = tier()?;
    let started = Instant::now();
    let v = t.read_if(loc, wanted).await.map_err(kv)?;
    metrics
        .nvme_read_seconds
        .observe(started.elapsed().as_secs_f64());
    Ok(v)
}

/// One copy on the tier: its place and the sequence number the tier gave
/// its write. A slot freed and reused holds another copy (a higher number),
/// so the node acts on the copy a report named, never on whatever took its
/// slot since.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct CopyRef {
    loc: NvmeLoc,
    seq: u64,
}

impl NodeNvme {
    /// Reports every object the tier holds now (after a start, or to a
    /// master that restarted and forgot them); copies the master refuses as
    /// stale (another object lives under the key now) are removed. Index
    /// records are flushed first: what the master hears of survives a crash.
    pub async fn report_all(&self, client: &Client) -> Result<(), KvError> {
        let held = self.held().await?;
        let updates: Vec<NvmeUpdate> = held
            .iter()
            .map(|r| NvmeUpdate::Recovered {
                key: r.key.clone(),
                nvme: self.segment_id,
                loc: r.loc.pack(),
                len: r.len,
                sum: r.sum,
                version: r.version,
            })
            .collect();
        let results = self.report(client, updates).await?;
        let (stale, refused) = self.drop_stale(&held, results).await;
        tracing::info!(
            objects = held.len(),
            stale,
            refused,
            "NVMe objects reported to the master"
        );
        Ok(())
    }

    /// Every copy the tier holds, its index records flushed first.
    async fn held(&self) -> Result<Vec<kvpool_storage::nvme::Recovered>, KvError> {
        let mut held = Vec::new();
        for region in 0..self.regions {
            let r = self
                .shards
                .run_on(region, move |_| async move {
                    let t = tier()?;
                    t.flush().await.map_err(kv)?;
                    Ok::<_, KvError>(t.entries())
                })
                .await
                .map_err(|e| KvError::new(ErrorCode::Internal, e.to_string()))??;
            held.extend(r);
        }
        Ok(held)
    }

    /// Acts on the master's answers to a report of every copy: a copy it
    /// refuses as stale (another object lives under the key) is removed,
    /// unless its slot holds another copy by now (an NVMe round running
    /// meanwhile replaced it: that one the master may have taken). How
    /// many were stale, and how many refused otherwise (those stay).
    async fn drop_stale(
        &self,
        held: &[kvpool_storage::nvme::Recovered],
        results: Vec<Result<(), KvError>>,
    ) -> (usize, usize) {
        let mut stale = 0;
        let mut refused = 0;
        for (r, res) in held.iter().zip(results) {
            match res {
                Ok(()) => {}
                Err(e) if crate::round::stale(&e) => {
                    stale += 1;
                    self.remove_copy(CopyRef {
                        loc: r.loc,
                        seq: r.seq,
                    })
                    .await;
                }
                Err(e) => {
                    // Not stale, just not taken now: the copy stays.
                    refused += 1;
                    tracing::debug!("NVMe: the master did not take a recovered copy: {e}");
                }
            }
        }
        (stale, refused)
    }

    /// Sends updates in batches; one result per update.
    async fn report(
        &self,
        client: &Client,
        updates: Vec<NvmeUpdate>,
    ) -> Result<Vec<Result<(), KvError>>, KvError> {
        let mut out = Vec::with_capacity(updates.len());
        for chunk in updates.chunks(1024) {
            let req = call::NvmeUpdates {
                client_id: client.id(),
                updates: chunk.to_vec(),
            };
            out.extend(client.call(req).await?.into_iter().map(Result::from));
        }
        Ok(out)
    }

    /// Removes `c` if its slot still holds that copy.
    async fn remove_copy(&self, c: CopyRef) {
        let r = self
            .shards
            .run_on(c.loc.region as usize, move |_| async move {
                tier()?.remove_copy(c.loc, c.seq).await.map_err(kv)
            })
            .await
            .map_err(|e| KvError::new(ErrorCode::Internal, e.to_string()))
            .and_then(|r| r);
        match r {
            Ok(true) => {}
            Ok(false) => tracing::debug!("NVMe: {c:?} is gone or holds another copy now"),
            Err(e) => tracing::warn!("NVMe: could not remove {c:?}: {e}"),
        }
    }

    /// Frees the copy at `loc` whose eviction the master took; a removal
    /// that fails is owed, and the region's next eviction tries it again.
    async fn release(&self, loc: NvmeLoc, seq: u64) {
        let r = self
            .shards
            .run_on(loc.region as usize, move |_| async move {
                match tier() {
                    Ok(t) => t.release(loc, seq).await.map_err(kv),
                    Err(e) => Err(e),
                }
            })
            .await;
        if let Ok(Err(e)) | Err(e) = r.map_err(|e| KvError::new(ErrorCode::Internal, e.to_string()))
        {
            tracing::warn!(
                "NVMe: could not free {loc:?} yet (tried again at the next eviction): {e}"
            );
        }
    }

    /// Copies DRAM bytes to the tier (a demotion or write-through) as the
    /// copy of incarnation `p.version`: which copy, their checksum, and
    /// whether this call wrote it (false: that copy was there already).
    /// What it does with the copy of the key it finds is the task's rule
    /// ([`task::PersistRule::decide`]). With the region full, evicts there and
    /// tries once more.
    async fn persist(
        &self,
        client: &Client,
        p: &PersistTask,
    ) -> Result<(CopyRef, u64, bool), KvError> {
        let region = region_of(&p.key, self.regions);
        for attempt in 0..2 {
            match self.persist_once(p.clone()).await {
                Err(e) if e.code == ErrorCode::NoSpace && attempt == 0 => {
                    // Make room in that region, then try once more.
                    self.evict_region(client, region, p.room()).await;
                }
                other => return other,
            }
        }
        unreachable!("the loop returns on its second attempt")
    }

    /// One try of [`NodeNvme::persist`], without the eviction.
    async fn persist_once(&self, p: PersistTask) -> Result<(CopyRef, u64, bool), KvError> {
        let region = region_of(&p.key, self.regions);
        let (seg, m) = (self.dram.clone(), self.metrics.clone());
        self.shards
            .run_on(region, move |_| async move {
                let t = tier()?;
                seg.check_range(p.offset, p.len)
                    .map_err(|e| KvError::new(ErrorCode::InvalidParams, e.to_string()))?;
                // SAFETY: in bounds (checked). The master keeps this range
                // allocated to the object until it has the Stored report
                // (a removal meanwhile quarantines it), so no writer is
                // sent to it while we copy.
                let bytes = unsafe { seg.slice(p.offset, p.len) };
                let sum = value_sum(bytes);
                // The copy at `loc`, named by its write's number (taken
                // with no await since the write or lookup).
                let copy = |loc: NvmeLoc| {
                    t.copy_seq(loc)
                        .map(|seq| CopyRef { loc, seq })
                        .ok_or_else(|| {
                            KvError::new(ErrorCode::Internal, format!("no copy at {loc:?}"))
                        })
                };
                // A removal of the key's copy under way (a stale copy the
                // control lane drops) ends first: the copy then stays or
                // is gone, and nothing awaits from here to the decision.
                t.key_settled(&p.key).await.map_err(kv)?;
                let held = t.lookup(&p.key).and_then(|loc| {
                    let (len, sum) = t.value_sum(loc)?;
                    let version = t.copy_version(loc)?;
                    Some((loc, task::Held { len, sum, version }))
                });
                match p.decide(sum, held) {
                    Err(e) => {
                        m.checksum_mismatches.inc();
                        Err(e)
                    }
                    Ok(task::Write::Found(loc)) => Ok((copy(loc)?, sum, false)),
                    Ok(task::Write::Write { replace }) => {
                        if let Some(old) = replace {
                            t.remove(old).await.map_err(kv)?;
                        }
                        let started = Instant::now();
                        let loc = t
                            .write_versioned(&p.key, bytes, p.version)
                            .await
                            .map_err(kv)?;
                        m.nvme_write_seconds
                            .observe(started.elapsed().as_secs_f64());
                        Ok((copy(loc)?, sum, true))
                    }
                }
            })
            .await
            .map_err(|e| KvError::new(ErrorCode::Internal, e.to_string()))?
    }

    /// Copies an NVMe object into the DRAM range the master allocated in
    /// this node's own segment; what it refuses is the task's rule
    /// ([`task::PromoteRule`]).
    async fn promote(&self, p: &PromoteTask) -> Result<(), KvError> {
        p.target(self.dram_id)?;
        let loc = NvmeLoc::unpack(p.loc);
        if loc.region as usize >= self.regions {
            return Err(KvError::new(
                ErrorCode::InvalidParams,
                format!("{loc:?} is no region of this tier"),
            ));
        }
        let (seg, m, p) = (self.dram.clone(), self.metrics.clone(), p.clone());
        self.shards
            .run_on(loc.region as usize, move |_| async move {
                // Only the copy the task names: its slot may hold another
                // since (evicted and reused), whose bytes an object without
                // a checksum could not tell from its own.
                let v = read_local(loc, &m, |key, version| p.reads(key, version)).await?;
                if let Err(r) = p.check(v.len() as u64, seg.len(), || value_sum(&v)) {
                    if r == task::Refusal::Checksum {
                        m.checksum_mismatches.inc();
                    }
                    return Err(p.error(r));
                }
                seg.check_range(p.offset, p.len)
                    .map_err(|e| KvError::new(ErrorCode::InvalidParams, e.to_string()))?;
                // SAFETY: in bounds (checked); the master allocated this range
                // for the promotion and sends no reader or writer to it until
                // it gets the Promoted report.
                unsafe { seg.slice_mut(p.offset, p.len) }.copy_from_slice(&v);
                Ok(())
            })
            .await
            .map_err(|e| KvError::new(ErrorCode::Internal, e.to_string()))?
    }

    /// Evicts in one region: mark, report to the master, then release.
    async fn evict_region(&self, client: &Client, region: usize, need: u64) {
        // First the copies whose eviction the master took earlier but whose
        // removal failed (their space and their key are still held).
        let cands = self
            .shards
            .run_on(region, move |_| async move {
                let Ok(t) = tier() else {
                    return Vec::new();
                };
                let released = t.release_owed().await;
                if released > 0 {
                    tracing::info!("NVMe: {released} owed releases done");
                }
                t.evict_candidates(need)
            })
            .await
            .unwrap_or_default();
        if cands.is_empty() {
            return;
        }
        let updates = cands
            .iter()
            .map(|v| NvmeUpdate::Evicted {
                key: v.key.clone(),
                nvme: self.segment_id,
                loc: v.loc.pack(),
                version: v.version,
            })
            .collect();
        // Reported first: the master stops handing out these replicas; only
        // then is their space released. A copy whose report failed or was
        // refused (its tier not mounted at a master that restarted: it may
        // still list the copy) is kept.
        let results = match self.report(client, updates).await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!("NVMe eviction not reported ({e}); the copies are kept");
                Vec::new()
            }
        };
        if let Some(Err(e)) = results.iter().find(|r| r.is_err()) {
            let n = results.iter().filter(|r| r.is_err()).count();
            tracing::warn!("NVMe eviction of {n} copies refused ({e}); they are kept");
        }
        // Only a copy the master answered Ok for goes (none without an answer).
        let (gone, kept): (Vec<_>, Vec<_>) = cands
            .iter()
            .enumerate()
            .partition(|(i, _)| results.get(*i).is_some_and(|r| r.is_ok()));
        if !kept.is_empty() {
            // The master may still list them: they stay readable and are
            // candidates again at the next round (marked evicting, they
            // would be neither, until a restart).
            let locs: Vec<NvmeLoc> = kept.iter().map(|(_, v)| v.loc).collect();
            let _ = self
                .shards
                .run_on(region, move |_| async move {
                    if let Ok(t) = tier() {
                        for loc in locs {
                            t.keep(loc);
                        }
                    }
                })
                .await;
        }
        self.metrics.nvme_evictions.inc_by(gone.len() as u64);
        for (_, v) in gone {
            self.release(v.loc, v.seq).await;
        }
    }

    /// Drops the copy a removal names, if its slot still holds it (the
    /// task's rule: [`task::DropRule::takes`]).
    async fn drop_copy(&self, d: DropTask) {
        let loc = NvmeLoc::unpack(d.loc);
        if loc.region as usize >= self.regions {
            tracing::warn!("NVMe: Drop for {loc:?}, which is no region of this tier");
            return;
        }
        let r = self
            .shards
            .run_on(loc.region as usize, move |_| async move {
                tier()?
                    .remove_if(loc, |key, version| d.takes(key, version))
                    .await
                    .map_err(kv)
            })
            .await
            .map_err(|e| KvError::new(ErrorCode::Internal, e.to_string()))
            .and_then(|r| r);
        match r {
            Ok(true) => {
                self.metrics.nvme_drops.inc();
            }
            // Gone already, or the slot holds another key (or incarnation)
            // now.
            Ok(false) => {}
            Err(e) => tracing::warn!("NVMe: could not drop {loc:?}: {e}"),
        }
    }

    /// Runs one task; the update to report.
    async fn run_task(
        &self,
        client: &Client,
        task: NodeTask,
    ) -> Option<(NvmeUpdate, Option<CopyRef>, bool)> {
        match task::job(task, self.dram_id)? {
            task::Job::Persist(p) => match self.persist(client, &p).await {
                Ok((copy, sum, fresh)) => {
                    if p.demote {
                        self.metrics.nvme_demotions.inc();
                    }
                    let loc = copy.loc.pack();
                    Some((p.stored(self.segment_id, loc, sum), Some(copy), fresh))
                }
                Err(e) => {
                    tracing::warn!("NVMe persist failed: {e}");
                    Some((p.failed(), None, false))
                }
            },
            task::Job::Drop(d) => {
                self.drop_copy(d).await;
                None
            }
            task::Job::Fetch(t) => {
                let target = crate::fetch::FetchTarget {
                    dram: self.dram.clone(),
                    dram_id: self.dram_id,
                    metrics: self.metrics.clone(),
                };
                Some((target.run(client, t).await, None, false))
            }
            task::Job::Promote(p) => {
                let ok = match self.promote(&p).await {
                    Ok(()) => {
                        self.metrics.nvme_promotions.inc();
                        true
                    }
                    Err(e) => {
                        tracing::warn!("NVMe promotion failed: {e}");
                        false
                    }
                };
                Some((p.promoted(ok), None, false))
            }
        }
    }

    /// Puts the index records of the copies this round reports on the
    /// device before the master hears of them (a write returns before
    /// its record is durable), so every NVMe copy the master lists survives
    /// a crash. Where a region's flush fails, the updates naming its fresh
    /// copies become `PersistFailed` and those copies are dropped, each
    /// once; copies found already there (written and reported in an earlier
    /// round) stay, the master lists them. A copy no longer in its place
    /// after the flush, failed or not, is reported `PersistFailed` too
    /// ([`Round::flushed`]): its key must still
    /// lead to its slot and the slot hold that very copy (a later task of
    /// the round that replaced the key's object can have removed it and
    /// written the new copy into the same, reused slot).
    async fn flush_written(&self, round: &mut Round<CopyRef>) {
        // Every region a copy was reported from, not only the fresh ones: a
        // copy found already there may be one whose record an earlier,
        // failed flush left behind (a flush with nothing dirty is free).
        let mut regions: Vec<u32> = round.copies().map(|c| c.loc.region).collect();
        regions.sort_unstable();
        regions.dedup();
        for region in regions {
            // The Stored copies of this region, checked after the flush,
            // whether it succeeded or not: a copy this round wrote or found
            // can have been evicted by a later task's NoSpace retry (LRU
            // ranks unread copies first), and its slot reused; the master
            // must not hear of it.
            let check = round.stored(|c| c.loc.region == region);
            let look: Vec<(Vec<u8>, CopyRef)> =
                check.iter().map(|(_, k, c)| (k.clone(), *c)).collect();
            let r = self
                .shards
                .run_on(region as usize, move |_| async move {
                    let t = tier()?;
                    let flushed = t.flush().await.map_err(kv);
                    let present: Vec<bool> = look
                        .iter()
                        .map(|(k, c)| {
                            t.lookup(k) == Some(c.loc)
                                && t.holds(c.loc, c.seq)
                                && !t.being_removed(c.loc)
                        })
                        .collect();
                    Ok::<_, KvError>((flushed, present))
                })
                .await
                .map_err(|e| KvError::new(ErrorCode::Internal, e.to_string()))
                .and_then(|r| r);
            match r {
                Ok((flushed, present)) => {
                    if present.iter().any(|here| !here) {
                        tracing::warn!("NVMe: a copy went before it was reported");
                    }
                    if let Err(e) = &flushed {
                        tracing::warn!("NVMe: index records of region {region} not durable: {e}");
                    }
                    let pick = |c: &CopyRef| c.loc.region == region;
                    for c in round.flushed(pick, flushed.is_ok(), &check, &present) {
                        self.remove_copy(c).await;
                    }
                }
                Err(e) => {
                    tracing::warn!("NVMe: index records of region {region} not durable: {e}");
                    for c in round.flush_failed(|c| c.loc.region == region) {
                        self.remove_copy(c).await;
                    }
                }
            }
        }
    }

    /// One round: tasks from every master shard, then eviction, then gauges
    /// (in the order of [`Steps`]). Returns how many tasks ran.
    pub async fn round(&self, client: &Client) -> Result<usize, KvError> {
        let mut ran = 0;
        let mut steps = Steps::default();
        let mut round = Round::default();
        let mut step = steps.tick(client.cluster_map().shards.len() as u32);
        while let Some(s) = step {
            step = match s {
                Step::Tasks(shard) => {
                    let req = call::NodeTasks {
                        client_id: client.id(),
                        shard,
                        segments: vec![self.dram_id, self.segment_id],
                        max: TASKS_PER_STEP,
                    };
                    let tasks = client.call(req).await?;
                    round = Round::default();
                    for t in tasks {
                        ran += 1;
                        if let Some((u, loc, new)) = self.run_task(client, t).await {
                            round.ran(u, loc, new);
                        }
                    }
                    steps.done(!round.is_empty())
                }
                Step::Report(_) => {
                    self.flush_written(&mut round).await;
                    let results = self.report(client, round.take_updates()).await?;
                    // The copies the master no longer wants (object gone),
                    // each removed only while its slot still holds it.
                    for c in round.refused(&results) {
                        self.remove_copy(c).await;
                    }
                    steps.done(false)
                }
                Step::Evict => {
                    for region in 0..self.regions {
                        self.evict_region(client, region, 0).await;
                    }
                    steps.done(false)
                }
            };
        }
        let mut used = 0u64;
        let mut objects = 0u64;
        for region in 0..self.regions {
            if let Ok(Some((u, n))) = self
                .shards
                .run_on(region, move |_| async move {
                    tier().ok().map(|t| (t.usage().0, t.objects() as u64))
                })
                .await
            {
                used += u;
                objects += n;
            }
        }
        self.metrics.nvme_used.set(used as i64);
        self.metrics.nvme_objects.set(objects as i64);
        Ok(ran)
    }

    /// Runs rounds until shutdown.
    pub fn spawn_loop(self: Arc<Self>, client: Client, shutdown: Shutdown) {
        tokio::spawn(async move {
            let (tier, client) = (&self, &client);
            run_rounds(self.poll, shutdown, "NVMe tier", || tier.round(client)).await
        });
    }
}

#[cfg(test)]
mod tests {
    //! The tier's round and report logic on a real tier (a file on this
    //! machine's disk) and a real DRAM segment; the master's answers are the
    //! ones it gives in the races the cluster simulation found.

    use super::*;
    use kvpool_runtime::metrics::MetricsRegistry;
    use kvpool_runtime::{ShardPool, ShardPoolConfig};

    const LEN: u64 = 4096;

    struct Rig {
        pool: Option<ShardPool>,
        rt: tokio::runtime::Runtime,
        nvme: NodeNvme,
        path: PathBuf,
    }

    impl Drop for Rig {
        fn drop(&mut self) {
            if let Some(p) = self.pool.take() {
                let _ = p.shutdown_and_join();
            }
            let _ = std::fs::remove_file(&self.path);
        }
    }

    /// A node's tier of one region (every key lands in it) on a file.
    fn rig(name: &str) -> Rig {
        let pool = ShardPool::start(
            &ShardPoolConfig {
                shards: 1,
                pin: false,
                ..Default::default()
            },
            Shutdown::new(),
        )
        .expect("shards");
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("tokio");
        let path = std::env::temp_dir().join(format!(
            "kvpool-nvme-tier-{name}-{}.kvnv",
            std::process::id()
        ));
        let _ = std::fs::remove_file(&path);
        let cfg = NvmeTierConfig {
            path: path.display().to_string(),
            capacity: kvpool_runtime::config::Bytes::mib(16),
            avg_object_bytes: kvpool_runtime::config::Bytes::kib(16),
            sync_writes: false,
            ..Default::default()
        };
        let dram = Arc::new(Segment::new_dram(&format!("dram-{name}"), 1 << 20, false).unwrap());
        let dram_id = segment_id_for(&format!("dram-{name}"));
        let endpoint = Endpoint {
            host: "127.0.0.1".into(),
            port: 1,
            nr_shards: 1,
        };
        let metrics = StorageMetrics::register(&MetricsRegistry::new());
        let handle = pool.handle();
        let nvme = rt
            .block_on(open(
                &handle, &cfg, "host", endpoint, dram, dram_id, metrics,
            ))
            .expect("tier opens");
        Rig {
            pool: Some(pool),
            rt,
            nvme,
            path,
        }
    }

    impl Rig {
        /// Puts `len` bytes of value `v` in DRAM at `offset`.
        fn dram_put(&self, offset: u64, v: u8) {
            self.nvme.dram.check_range(offset, LEN).unwrap();
            // SAFETY: in bounds (checked); nothing else touches the segment.
            unsafe { self.nvme.dram.slice_mut(offset, LEN) }.fill(v);
        }

        /// Runs a Persist task (no eviction needed: the tier has room) and
        /// returns its update, copy and freshness as `run_task` does.
        fn persist(&self, key: &[u8], offset: u64) -> Ran {
            self.persist_version(key, offset, 0)
        }

        /// [`Rig::persist`] of incarnation `version`.
        fn persist_version(&self, key: &[u8], offset: u64, version: u64) -> Ran {
            let task = PersistTask {
                key: key.to_vec(),
                dram: self.nvme.dram_id,
                offset,
                len: LEN,
                demote: false,
                checksum: None,
                version,
            };
            let (copy, sum, fresh) = self
                .rt
                .block_on(self.nvme.persist_once(task.clone()))
                .expect("persisted");
            let u = task.stored(self.nvme.segment_id, copy.loc.pack(), sum);
            (u, Some(copy), fresh)
        }

        /// What the tier holds under `key`: its place and checksum.
        fn holds(&self, key: &[u8]) -> Option<(NvmeLoc, u64)> {
            let k = key.to_vec();
            self.rt
                .block_on(self.nvme.shards.run_on(0, move |_| async move {
                    let t = tier().ok()?;
                    let loc = t.lookup(&k)?;
                    Some((loc, t.value_sum(loc)?.1))
                }))
                .unwrap()
        }

        /// One round's batch: flushed and checked, then settled with the
        /// master's `answers` as `round` does; the updates reported.
        fn settle(
            &self,
            batch: Vec<Ran>,
            answers: impl Fn(&NvmeUpdate) -> Result<(), KvError>,
        ) -> Vec<NvmeUpdate> {
            let mut round = Round::default();
            for (u, c, wrote) in batch {
                round.ran(u, c, wrote);
            }
            self.rt.block_on(async {
                self.nvme.flush_written(&mut round).await;
                let updates = round.take_updates();
                let results: Vec<_> = updates.iter().map(&answers).collect();
                for c in round.refused(&results) {
                    self.nvme.remove_copy(c).await;
                }
                updates
            })
        }
    }

    type Ran = (NvmeUpdate, Option<CopyRef>, bool);

    impl Rig {
        /// Two Persist tasks of key `k` in one round: an object of bytes
        /// `a` at DRAM offset 0, then the one that replaced it, of bytes
        /// `b` at `LEN`.
        fn persist_replaced(&self, a: u8, b: u8) -> (Ran, Ran) {
            self.dram_put(0, a);
            self.dram_put(LEN, b);
            (self.persist(b"k", 0), self.persist(b"k", LEN))
        }
    }

    /// The master's answer in that race: the first report names the
    /// replaced object's DRAM range (refused), the second is taken.
    fn refuse_the_first(u: &NvmeUpdate) -> Result<(), KvError> {
        match u {
            NvmeUpdate::Stored { offset: 0, .. } => {
                Err(KvError::new(ErrorCode::ObjectNotFound, "replaced"))
            }
            _ => Ok(()),
        }
    }

    fn sum_of(u: &NvmeUpdate) -> Option<u64> {
        match u {
            NvmeUpdate::Stored { sum, .. } => Some(*sum),
            _ => None,
        }
    }

    /// Seed 3 of the cluster simulation: two Persist tasks of one key in
    /// one round (the object replaced between them). The second removes
    /// the first's copy and the tier reuses the slot for its own; the
    /// master refuses the first report and takes the second. The copy it
    /// took must stay.
    #[test]
    fn a_refused_report_does_not_remove_the_copy_that_took_its_slot() {
        let r = rig("reuse");
        let (first, second) = r.persist_replaced(1, 2);
        let (a, b) = (first.1.unwrap(), second.1.unwrap());
        assert_eq!(a.loc, b.loc, "the tier reuses the freed slot");
        let new_sum = sum_of(&second.0).unwrap();
        let updates = r.settle(vec![first, second], refuse_the_first);
        assert!(
            matches!(updates[0], NvmeUpdate::PersistFailed { .. }),
            "the first copy is gone: not reported as stored ({:?})",
            updates[0]
        );
        assert_eq!(
            r.holds(b"k"),
            Some((b.loc, new_sum)),
            "the copy the master took"
        );
    }

    /// Two Persist tasks of two objects with the same bytes name one copy:
    /// a refusal of the first (its object replaced) must not remove the
    /// copy the master took for the second.
    #[test]
    fn a_refused_report_does_not_remove_a_copy_another_report_of_the_batch_gave() {
        let r = rig("same");
        let (first, second) = r.persist_replaced(7, 7);
        assert!(!second.2, "the second found the first's copy there");
        assert_eq!(first.1, second.1);
        let loc = first.1.unwrap().loc;
        let sum = sum_of(&first.0).unwrap();
        r.settle(vec![first, second], refuse_the_first);
        assert_eq!(r.holds(b"k"), Some((loc, sum)));
    }

    /// Seed 442 of the simulation (`KVPOOL_SIM_UNSUMMED=1`): a report of
    /// every copy (after a remount) races an NVMe round whose Persist of a
    /// new object under the key replaces the old copy in the same slot.
    /// The master refuses the old copy as stale; the node must not remove
    /// the new one, which the round reported and the master took.
    #[test]
    fn a_stale_recovered_copy_is_removed_only_if_its_slot_still_holds_it() {
        let r = rig("stale");
        r.dram_put(0, 1);
        r.dram_put(LEN, 2);
        let old = r.persist(b"k", 0);
        r.settle(vec![old], |_| Ok(()));
        let held = r.rt.block_on(r.nvme.held()).unwrap();
        assert_eq!(held.len(), 1);
        // The round runs meanwhile: the new object's copy, same slot.
        let new = r.persist(b"k", LEN);
        assert_eq!(new.1.unwrap().loc, held[0].loc, "the tier reuses the slot");
        let new_sum = sum_of(&new.0).unwrap();
        r.settle(vec![new], |_| Ok(()));
        let stale = KvError::new(ErrorCode::ObjectAlreadyExists, "another object");
        let (n, _) = r.rt.block_on(r.nvme.drop_stale(&held, vec![Err(stale)]));
        assert_eq!(n, 1);
        assert_eq!(r.holds(b"k"), Some((held[0].loc, new_sum)));
        // Refused as stale while its slot still holds it, a copy goes.
        let held = r.rt.block_on(r.nvme.held()).unwrap();
        let stale = KvError::new(ErrorCode::ObjectAlreadyExists, "another object");
        r.rt.block_on(r.nvme.drop_stale(&held, vec![Err(stale)]));
        assert_eq!(r.holds(b"k"), None);
    }

    /// Issue 32, copy identity on the node: a copy carries the version of
    /// the Persist that wrote it, in its report and on the device (a
    /// restart reports it); a Drop at another version leaves it, one at its
    /// version, or of any version, takes it; a Persist of a new incarnation
    /// with the same bytes writes a copy of its own.
    #[test]
    fn a_copy_carries_its_persists_version_and_a_drop_takes_only_that_version() {
        let r = rig("version");
        r.dram_put(0, 1);
        let (v1, v2) = (9 << 32 | 1, 9 << 32 | 2);
        let first = r.persist_version(b"k", 0, v1);
        assert!(matches!(first.0, NvmeUpdate::Stored { version, .. } if version == v1));
        r.settle(vec![first], |_| Ok(()));
        let held = r.rt.block_on(r.nvme.held()).unwrap();
        assert_eq!(held.len(), 1);
        assert_eq!(held[0].version, v1, "what a restart would report");

        // The same bytes again, as a new incarnation: not the old copy.
        let second = r.persist_version(b"k", 0, v2);
        assert!(second.2, "written again, not found there");
        assert!(matches!(second.0, NvmeUpdate::Stored { version, .. } if version == v2));
        let loc = second.1.unwrap().loc;
        r.settle(vec![second], |_| Ok(()));

        let drop = |version: Option<u64>| {
            r.rt.block_on(r.nvme.drop_copy(DropTask {
                key: b"k".to_vec(),
                loc: loc.pack(),
                version,
            }))
        };
        drop(Some(v1));
        assert!(
            r.holds(b"k").is_some(),
            "a Drop of the old incarnation leaves the new copy"
        );
        drop(Some(v2));
        assert_eq!(r.holds(b"k"), None, "a Drop at its version takes it");

        let third = r.persist_version(b"k", 0, v1);
        let loc = third.1.unwrap().loc;
        r.settle(vec![third], |_| Ok(()));
        r.rt.block_on(r.nvme.drop_copy(DropTask {
            key: b"k".to_vec(),
            loc: loc.pack(),
            version: None,
        }));
        assert_eq!(r.holds(b"k"), None, "a Drop of any version takes it");
    }

    /// A promotion copies the tier's copy into its range only with the
    /// object's size and bytes, and only other bytes count as a checksum
    /// mismatch (`storage_checksum_mismatches`, which operators alert on):
    /// a copy of another size is refused before its sum is taken.
    #[test]
    fn a_promotion_refuses_another_size_or_other_bytes_and_counts_only_other_bytes() {
        let r = rig("promote");
        r.dram_put(0, 7);
        let stored = r.persist(b"k", 0);
        let loc = stored.1.as_ref().unwrap().loc.pack();
        let sum = sum_of(&stored.0).unwrap();
        r.settle(vec![stored], |_| Ok(()));
        let to = 2 * LEN;
        let promote = |len: u64, checksum: u64| {
            r.rt.block_on(r.nvme.promote(&PromoteTask {
                key: b"k".to_vec(),
                loc,
                dram: r.nvme.dram_id,
                offset: to,
                len,
                checksum: Some(checksum),
                version: 0,
            }))
        };
        let mismatches = || r.nvme.metrics.checksum_mismatches.get();
        // SAFETY: in bounds of the 1 MiB segment; nothing writes it now.
        let range = || unsafe { r.nvme.dram.slice(to, LEN) }.to_vec();

        let e = promote(LEN - 1, sum).unwrap_err();
        assert_eq!(e.code, ErrorCode::Corrupt, "{e}");
        assert_eq!(mismatches(), 0, "another size is no checksum mismatch");
        let e = promote(LEN, sum ^ 1).unwrap_err();
        assert_eq!(e.code, ErrorCode::Corrupt, "{e}");
        assert_eq!(mismatches(), 1, "other bytes are one");
        assert!(range().iter().all(|&b| b == 0), "the range is untouched");

        promote(LEN, sum).unwrap();
        assert!(range().iter().all(|&b| b == 7), "the copy is in the range");
        assert_eq!(mismatches(), 1);
    }

    /// A Promote task queued before its copy was evicted, run after the
    /// slot was reused by a copy of another key (or of another incarnation
    /// of the key) of the same size: for an object without a checksum,
    /// nothing in the bytes tells them apart, so the node copies only the
    /// copy the task names (its key and version). Before, it copied
    /// whatever the slot held, and the master made the range a readable
    /// replica of the object: other bytes under the key.
    #[test]
    fn an_unsummed_promotion_copies_nothing_from_a_slot_reused_by_another_copy() {
        let r = rig("promote-reused");
        let (v1, v2) = (9 << 32 | 1, 9 << 32 | 2);
        r.dram_put(0, 1);
        let k = r.persist_version(b"k", 0, v1);
        let loc = k.1.as_ref().unwrap().loc;
        r.settle(vec![k], |_| Ok(()));
        let to = 2 * LEN;
        let promote = |key: &[u8], version: u64| {
            r.rt.block_on(r.nvme.promote(&PromoteTask {
                key: key.to_vec(),
                loc: loc.pack(),
                dram: r.nvme.dram_id,
                offset: to,
                len: LEN,
                checksum: None,
                version,
            }))
        };
        // SAFETY: in bounds of the 1 MiB segment; nothing writes it now.
        let range = || unsafe { r.nvme.dram.slice(to, LEN) }.to_vec();

        // k's copy goes (evicted, or dropped); "j" takes its slot.
        r.rt.block_on(r.nvme.drop_copy(DropTask {
            key: b"k".to_vec(),
            loc: loc.pack(),
            version: Some(v1),
        }));
        r.dram_put(LEN, 2);
        let j = r.persist_version(b"j", LEN, v1);
        assert_eq!(j.1.as_ref().unwrap().loc, loc, "the slot is reused");
        r.settle(vec![j], |_| Ok(()));
        let e = promote(b"k", v1).unwrap_err();
        assert!(range().iter().all(|&b| b == 0), "{e}: nothing copied");

        // A later incarnation of "k" in the slot: not the task's copy.
        r.rt.block_on(r.nvme.drop_copy(DropTask {
            key: b"j".to_vec(),
            loc: loc.pack(),
            version: Some(v1),
        }));
        let k2 = r.persist_version(b"k", LEN, v2);
        assert_eq!(k2.1.as_ref().unwrap().loc, loc, "the slot is reused");
        r.settle(vec![k2], |_| Ok(()));
        let e = promote(b"k", v1).unwrap_err();
        assert!(range().iter().all(|&b| b == 0), "{e}: nothing copied");
        promote(b"k", v2).unwrap();
        assert!(range().iter().all(|&b| b == 2), "the task's own copy is");
    }
}
