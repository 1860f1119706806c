//! NVMe tiers as one shard sees them: node tasks (Persist, Promote, Drop),
//! tier reports, the Drops each tier is owed, and which copies a tier may
//! bring back (listed tiers, detached copies).
use super::copies::Unlisted;
use super::*;

/// A segment's queue of node tasks, with an index of the Drops in it: a
/// `Recovered` report asks whether its copy's Drop is queued, and a node
/// that reports its whole tier again asks that for every copy, so it is one
/// lookup, not a scan of up to [`MAX_TASKS_PER_SEGMENT`] tasks per copy.
#[derive(Debug, Default)]
pub(crate) struct TaskQueue {
    pub(super) q: VecDeque<NodeTask>,
    /// (key, loc) of each queued Drop, and how many such Drops wait.
    pub(super) drops: Map<(Vec<u8>, u64), u32>,
}

/// The answer to a tier report of a copy no object lists while a copy of
/// the key's object is on its way to that tier (it may be that copy, its
/// `Stored` not yet in): not now; the node keeps it, and its `Stored`
/// lists it (or the tier's next report refuses it once nothing is under
/// way).
fn under_way() -> KvError {
    err(
        ErrorCode::TryAgain,
        "a copy of this object is on its way to this tier: its Stored report lists it",
    )
}

impl TaskQueue {
    pub fn len(&self) -> usize {
        self.q.len()
    }

    pub fn push_back(&mut self, t: NodeTask) {
        self.index(&t);
        self.q.push_back(t);
    }

    /// Queues `t` before every task waiting.
    pub fn push_front(&mut self, t: NodeTask) {
        self.index(&t);
        self.q.push_front(t);
    }

    /// Counts `t` in the index of Drops, if it is one.
    fn index(&mut self, t: &NodeTask) {
        if let NodeTask::Drop(d) = t {
            *self.drops.entry((d.key.clone(), d.loc)).or_default() += 1;
        }
    }

    pub fn pop_front(&mut self) -> Option<NodeTask> {
        let t = self.q.pop_front()?;
        if let NodeTask::Drop(d) = &t {
            let k = (d.key.clone(), d.loc);
            match self.drops.get_mut(&k) {
                Some(n) if *n > 1 => *n -= 1,
                _ => {
                    self.drops.remove(&k);
                }
            }
        }
        Some(t)
    }

    /// Whether a Drop of the copy of `key` at `loc` waits in the queue.
    pub fn has_drop(&self, key: &[u8], loc: u64) -> bool {
        !self.drops.is_empty() && self.drops.contains_key(&(key.to_vec(), loc))
    }
}

/// Recovered replicas not back yet: (segment, offset).
pub(super) type Waiting = SmallVec<[(SegmentId, u64); 2]>;

impl ShardState {
    /// Queues for the node of DRAM segment `dram` the Drops its NVMe tier is
    /// owed and that are not in its queue (its node came back with a new
    /// DRAM segment, or the master restarted): first, before any task the
    /// mount leads to.
    pub(super) fn queue_owed_drops(&mut self, dram: SegmentId) {
        let Some(&idx) = self.by_id.get(&dram) else {
            return;
        };
        let Some(nvme) = self.slot(idx).spec.nvme.as_ref().map(|a| a.segment_id) else {
            return;
        };
        let q = self.tasks.entry(dram).or_default();
        for ((key, loc), version) in self.copies.owed(nvme) {
            if q.len() >= MAX_TASKS_PER_SEGMENT {
                break; // the rest go out at the node's next mount
            }
            if !q.has_drop(key, *loc) {
                q.push_front(NodeTask::Drop(DropTask {
                    key: key.to_vec(),
                    loc: *loc,
                    version,
                }));
            }
        }
    }

    /// Records that `nvme`'s copy of `key` at `loc` (at `version`) is owed
    /// a Drop; false when the tier is owed its maximum already.
    pub(super) fn owe_drop(
        &mut self,
        nvme: SegmentId,
        key: &[u8],
        loc: u64,
        version: Option<u64>,
    ) -> bool {
        let Some(new) = self.copies.owe(nvme, key, loc, version) else {
            return false;
        };
        if new {
            if let Some(d) = self.durable.as_mut() {
                d.drops.push(Record::DropOwed {
                    nvme,
                    key: key.into(),
                    loc,
                    version,
                });
            }
        }
        true
    }

    /// `nvme`'s copy of `key` at `loc` is owed no Drop any more: it went out
    /// to the node (`sent`; to a tier not listed yet it stays owed until the
    /// tier is listed: the node may report the copy before it runs the
    /// Drop), or the copy is an object's again.
    pub(super) fn settle_drop(&mut self, nvme: SegmentId, key: &[u8], loc: u64, sent: bool) {
        if self.copies.settle(nvme, key, loc, sent) {
            if let Some(d) = self.durable.as_mut() {
                d.drops.push(Record::DropDone {
                    nvme,
                    key: key.into(),
                    loc,
                });
            }
        }
    }

    /// The DRAM segment the NVMe tier `nvme` is attached to (its node's
    /// task queue), if it is mounted.
    pub(super) fn dram_of_tier(&self, nvme: SegmentId) -> Option<SegmentId> {
        self.slots.iter().flatten().find_map(|d| {
            d.spec
                .nvme
                .as_ref()
                .is_some_and(|a| a.segment_id == nvme)
                .then_some(d.id)
        })
    }

    /// Whether `key`'s copy at `loc` of tier `nvme` is owed a Drop (maybe
    /// handed out already): that copy's object was removed or replaced.
    pub(super) fn drop_owed(&self, nvme: SegmentId, key: &[u8], loc: u64) -> bool {
        self.copies.is_dropped(nvme, key, loc)
    }

    /// Tells the nodes holding NVMe copies of a removed object to drop them.
    /// NVMe space is the node's: without this a copy would outlive its
    /// object, until NVMe eviction, and come back as `Recovered` when the
    /// node restarts. The task goes on the queue of the DRAM segment the
    /// tier is attached to, behind that node's Persist tasks, so the node
    /// sees the removal and a later put of the same key in the order they
    /// happened. The copy is owed its Drop until it goes out to a listed
    /// tier (to an adopted one: until the tier is listed; recorded in the
    /// state directory): a node whose DRAM segment is gone meanwhile gets it
    /// when it mounts one again. With the tier owed its maximum, or that
    /// queue full, the copy stays (logged).
    pub(super) fn drop_nvme_copies(&mut self, key: &[u8], obj: &Object) {
        for r in &obj.replicas {
            let s = self.slot(r.slot);
            if s.tier() == Tier::Nvme {
                let version = obj.complete().map(|c| c.version);
                self.owe_and_queue_drop(s.id, key, r.offset, version, false);
            }
        }
    }

    /// Owes tier `nvme`'s node a Drop of `key`'s copy at `loc` (at
    /// `version`, when known: the Drop takes only that incarnation) and
    /// queues it for the node's DRAM segment, if one is mounted (else it
    /// goes out at the node's next mount); `first`: before every task
    /// waiting (the removal it stands for came before them).
    pub(super) fn owe_and_queue_drop(
        &mut self,
        nvme: SegmentId,
        key: &[u8],
        loc: u64,
        version: Option<u64>,
        first: bool,
    ) {
        if !self.owe_drop(nvme, key, loc, version) {
            // A tier still adopted takes back copies nothing names, this
            // one too: it is listed now (what it has not reported yet is
            // refused as old, lost rather than a removed key come back),
            // which also settles the Drops handed out to it.
            let adopted = !self.copies.is_listed(nvme);
            if adopted {
                tracing::warn!(
                    tier = format!("{nvme:016x}"),
                    "NVMe tier still adopted is owed its maximum of Drops: listed now"
                );
                self.list_tier(nvme);
            }
            if !adopted || !self.owe_drop(nvme, key, loc, version) {
                tracing::warn!(
                    key = %show_key(key),
                    "NVMe tier owed its maximum of Drops: the removed object's NVMe copy stays \
                     until evicted (refused if the tier reports it)"
                );
                return;
            }
        }
        let Some(dram) = self.dram_of_tier(nvme) else {
            return; // the node's DRAM segment is gone: it is asked at its next mount
        };
        let q = self.tasks.entry(dram).or_default();
        if q.len() < MAX_TASKS_PER_SEGMENT {
            let t = NodeTask::Drop(DropTask {
                key: key.to_vec(),
                loc,
                version,
            });
            if first {
                q.push_front(t);
            } else {
                q.push_back(t);
            }
        } else {
            tracing::warn!(
                key = %show_key(key),
                "node task queue full: the removed object's Drop goes out when its node mounts \
                 again"
            );
        }
    }

    /// What a copy of `key` at `loc` at `version` that tier `nvme` reports
    /// and that no object lists is: `Adopted` while the tier is not listed
    /// yet (its report keeps it so for `tier_quiet_ms` more) unless this
    /// shard's lineage handed out its version, `Detached` when it was
    /// detached with its tier and its object has been neither removed nor
    /// replaced since, else `Old`.
    pub(super) fn unlisted_copy(
        &mut self,
        nvme: SegmentId,
        key: &[u8],
        loc: u64,
        version: u64,
        now_ms: u64,
    ) -> Unlisted {
        if !self.copies.is_listed(nvme) {
            let next = now_ms.saturating_add(self.cfg.tier_quiet_ms);
            if !self.copies.adopts(nvme, now_ms, next) {
                self.list_tier(nvme);
            }
        }
        let found = self.copies.take_detached(nvme, key, loc, version);
        if found == Unlisted::Old && !self.copies.is_listed(nvme) && !self.issued(version) {
            return Unlisted::Adopted;
        }
        found
    }

    /// Whether a reported copy of `len` bytes summing to `sum` may be the
    /// one a Persist of `key`'s object to tier `nvme` is writing: a
    /// demotion of one of its DRAM replicas on the segment the tier is
    /// attached to, or a write-through copy not listed yet, of the object's
    /// size and (when it has one) checksum. A copy of another object under
    /// the key is not (refused as old).
    pub(super) fn copy_under_way(&self, key: &[u8], nvme: SegmentId, len: u64, sum: u64) -> bool {
        let Some(id) = self.objs.complete_id(key) else {
            return false;
        };
        let o = self.objs.get(id);
        if o.size != len || o.checksum().is_some_and(|s| s != sum) {
            return false;
        }
        let on_tier = o.replicas.iter().any(|r| self.slot(r.slot).id == nvme);
        o.replicas.iter().any(|r| {
            self.slot(r.slot).spec.nvme.as_ref().is_some_and(|a| {
                a.segment_id == nvme
                    && (r.state == ReplicaState::Demoting || (a.write_through && !on_tier))
            })
        })
    }

    /// From now on every live copy of tier `nvme` is one this shard lists.
    /// The Drops that went out to it while it was adopted are owed no more:
    /// a copy they take that the node reports is old now.
    pub(super) fn list_tier(&mut self, nvme: SegmentId) {
        let (new, settled) = self.copies.list(nvme);
        if let Some(d) = self.durable.as_mut() {
            if new {
                d.listed.push(nvme);
            }
            d.drops
                .extend(settled.into_iter().map(|(key, loc)| Record::DropDone {
                    nvme,
                    key: key.into(),
                    loc,
                }));
        }
        if new {
            tracing::info!(
                shard = self.shard,
                tier = format!("{nvme:016x}"),
                "NVMe tier listed: a copy it reports that no object lists is refused"
            );
        }
    }

    /// Remembers `key`'s copy at `loc` of tier `nvme`, which the shard no
    /// longer counts as a replica (the tier is unmounted, or its recovered
    /// replicas were given up), a copy of its object at `version`.
    pub(super) fn detach(&mut self, nvme: SegmentId, key: &[u8], loc: u64, version: Option<u64>) {
        if !self.copies.detach(nvme, key, loc, version) {
            tracing::warn!(
                key = %show_key(key),
                "too many copies on tiers unmounted as dead: this one is refused if its tier \
                 comes back"
            );
        }
    }

    /// `key`'s object was removed or replaced: its copies on tiers unmounted
    /// as dead are owed a Drop (refused if their tier reports them).
    pub(super) fn retire_detached(&mut self, key: &[u8]) {
        for (nvme, loc, version) in self.copies.retire(key) {
            self.owe_and_queue_drop(nvme, key, loc, version, true);
        }
    }

    /// An NVMe-only object was read: after `promote_after_reads` reads, give
    /// it a DRAM replica (pending until its node has copied the bytes in).
    pub(super) fn count_nvme_read(&mut self, id: Id, now_ms: u64) {
        let n = self.cfg.promote_after_reads;
        let reads = self.objs.update(id, |o| {
            let c = o.stored_mut();
            c.nvme_reads = c.nvme_reads.saturating_add(1);
            c.nvme_reads
        });
        let obj = self.objs.get(id);
        if n == 0
            || reads < n
            || obj
                .replicas
                .iter()
                .any(|r| r.state == ReplicaState::Promoting)
        {
            return;
        }
        self.objs.update(id, |o| o.stored_mut().nvme_reads = 0);
        let obj = self.objs.get(id);
        let size = obj.size;
        let Some(nvme) = obj
            .replicas
            .iter()
            .find(|r| {
                self.slots[r.slot as usize]
                    .as_ref()
                    .is_some_and(|s| s.tier() == Tier::Nvme)
            })
            .copied()
        else {
            return;
        };
        let nvme_seg = self.slot(nvme.slot).id;
        let owner = self.slot(nvme.slot).owner;
        // Only the DRAM segment the tier is attached to: the node copies
        // the bytes into its own memory, so the range must be in it.
        let Some(idx) = self.slots.iter().enumerate().find_map(|(i, s)| {
            let s = s.as_ref()?;
            let attached = s.tier() == Tier::Dram
                && s.owner == owner
                && s.spec
                    .nvme
                    .as_ref()
                    .is_some_and(|a| a.segment_id == nvme_seg);
            (attached && !s.draining && !s.suspect).then_some(i as u32)
        }) else {
            return;
        };
        let Some(offset) = self.slot_mut(idx).alloc.alloc(size) else {
            return;
        };
        let checksum = self.objs.get(id).checksum();
        let version = self.objs.get(id).stored().version;
        let dram = self.slot(idx).id;
        let q = self.tasks.entry(nvme_seg).or_default();
        if q.len() >= MAX_TASKS_PER_SEGMENT {
            self.slot_mut(idx).alloc.dealloc(offset, size);
            return;
        }
        // The node writes the range when it gets to the task: held as a
        // put's grant is, from the read's lease end (no earlier than now).
        let until = self.write_hold_until(self.objs.get(id).stored().lease_end_ms);
        self.hold(idx, offset, size, until);
        let q = self.tasks.entry(nvme_seg).or_default();
        q.push_back(NodeTask::Promote(PromoteTask {
            key: self.objs.key(id).to_vec(),
            loc: nvme.offset,
            dram,
            offset,
            len: size,
            checksum,
            version,
        }));
        self.objs.update(id, |o| {
            o.replicas.push(Replica::filling(idx, offset, false))
        });
        self.fill_due(id, idx, offset, now_ms);
    }

    /// The slot of segment `seg` if it is mounted, of tier `tier`, and owned
    /// by `client`: what a node may report on or take work for.
    pub(super) fn owned_slot(
        &self,
        client: ClientId,
        seg: SegmentId,
        tier: Tier,
    ) -> Result<u32, KvError> {
        let idx = *self.by_id.get(&seg).ok_or_else(|| {
            err(
                ErrorCode::SegmentNotFound,
                format!("segment {seg:016x} is not mounted"),
            )
        })?;
        let s = self.slot(idx);
        if s.owner != client {
            return Err(err(
                ErrorCode::IllegalClient,
                format!("segment {seg:016x} belongs to another client"),
            ));
        }
        if s.tier() != tier {
            return Err(err(
                ErrorCode::InvalidParams,
                format!("segment {seg:016x} is not a {tier:?} segment"),
            ));
        }
        Ok(idx)
    }

    /// Checks that an NVMe location names a region the tier has.
    pub(super) fn check_loc(&self, nslot: u32, loc: u64) -> Result<(), KvError> {
        let regions = self.slot(nslot).spec.endpoint.nr_shards.max(1) as u64;
        if loc >> 32 >= regions {
            return Err(err(
                ErrorCode::InvalidParams,
                format!("NVMe location {loc:#x} names a region the tier does not have"),
            ));
        }
        Ok(())
    }

    /// Up to `max` queued tasks for the given segments' node, taken at
    /// `now_ms`; every segment named must be mounted and owned by `client`.
    pub fn node_tasks(
        &mut self,
        client: ClientId,
        segments: &[SegmentId],
        max: usize,
        now_ms: u64,
    ) -> Result<Vec<NodeTask>, KvError> {
        for seg in segments {
            let idx = *self.by_id.get(seg).ok_or_else(|| {
                err(
                    ErrorCode::SegmentNotFound,
                    format!("segment {seg:016x} is not mounted"),
                )
            })?;
            if self.slot(idx).owner != client {
                return Err(err(
                    ErrorCode::IllegalClient,
                    format!("segment {seg:016x} belongs to another client"),
                ));
            }
        }
        let mut out = Vec::new();
        for seg in segments {
            let Some(mut q) = self.tasks.remove(seg) else {
                continue;
            };
            let tier = self
                .by_id
                .get(seg)
                .and_then(|&i| self.slot(i).spec.nvme.as_ref())
                .map(|a| a.segment_id);
            while out.len() < max {
                let Some(mut t) = q.pop_front() else {
                    break;
                };
                let stale = self.task_is_stale(*seg, &t);
                if let (NodeTask::Drop(DropTask { key, loc, .. }), Some(nvme)) = (&t, tier) {
                    // Out to the node (or stale: the copy is an object's
                    // again): owed no more, unless the same Drop waits again.
                    if !q.has_drop(key, *loc) {
                        self.settle_drop(nvme, key, *loc, !stale);
                    }
                }
                if !stale {
                    if let NodeTask::Fetch(f) = &mut t {
                        self.renew_fetch(f, now_ms);
                    }
                    out.push(t);
                }
            }
            self.tasks.insert(*seg, q);
        }
        Ok(out)
    }

    /// Whether task `t` of segment `seg`'s queue no longer stands, and is
    /// dropped instead of handed out:
    /// * a Persist whose object no longer holds the DRAM range it names as
    ///   it did when the task was queued (removed, replaced, its replica
    ///   evicted; for a demotion, the replica no longer `Demoting`): nothing
    ///   waits for its report, and a node that ran it would copy whatever
    ///   lies in the range now and replace the key's copy on its tier
    ///   (maybe the one the current object lists) with it;
    /// * a Drop of a copy that the object under the key lists again (a
    ///   guard: a `Recovered` report of a copy whose Drop is queued is
    ///   refused, so the master should never list such a copy).
    pub(super) fn task_is_stale(&self, seg: SegmentId, t: &NodeTask) -> bool {
        let (key, dram, offset, demote) = match t {
            NodeTask::Persist(p) => (&p.key, &p.dram, &p.offset, &p.demote),
            NodeTask::Drop(DropTask { key, loc, .. }) => {
                let tier = self
                    .by_id
                    .get(&seg)
                    .and_then(|&i| self.slot(i).spec.nvme.as_ref())
                    .and_then(|a| self.by_id.get(&a.segment_id));
                return match (tier, self.objs.complete_id(key)) {
                    (Some(&nslot), Some(id)) => self
                        .objs
                        .get(id)
                        .replicas
                        .iter()
                        .any(|r| r.slot == nslot && r.offset == *loc),
                    _ => false,
                };
            }
            NodeTask::Promote(_) => return false,
            // Stale once the replica it fills is gone (the object removed,
            // replaced, or the replica dropped).
            NodeTask::Fetch(f) => {
                let (Some(&dslot), Some(id)) =
                    (self.by_id.get(&f.dram), self.objs.complete_id(&f.key))
                else {
                    return true;
                };
                return !self.objs.get(id).replicas.iter().any(|r| {
                    r.slot == dslot && r.offset == f.offset && r.state == ReplicaState::Promoting
                });
            }
        };
        let (Some(&dslot), Some(id)) = (self.by_id.get(dram), self.objs.complete_id(key)) else {
            return true;
        };
        !self.objs.get(id).replicas.iter().any(|r| {
            r.slot == dslot
                && r.offset == *offset
                && if *demote {
                    r.state == ReplicaState::Demoting
                } else {
                    r.state != ReplicaState::Promoting
                }
        })
    }

    /// Applies one report of node `client` about its NVMe tier. Everything
    /// the report names is checked before anything changes: its segments
    /// must be mounted, of the right tier and the reporter's own; NVMe
    /// locations must name a region of the tier; DRAM ranges must be the
    /// ones the master itself handed out for that object.
    pub fn nvme_update(
        &mut self,
        client: ClientId,
        u: &NvmeUpdate,
        now_ms: u64,
    ) -> Result<(), KvError> {
        self.check_key(u.key())?;
        match u {
            NvmeUpdate::Stored {
                key,
                nvme,
                loc,
                len,
                dram,
                offset,
                demote,
                sum,
                version,
            } => {
                let nslot = self.owned_slot(client, *nvme, Tier::Nvme)?;
                self.check_loc(nslot, *loc)?;
                let dslot = match self.owned_slot(client, *dram, Tier::Dram) {
                    Ok(d) => Some(d),
                    // The DRAM segment went away meanwhile: the NVMe copy
                    // still counts.
                    Err(e) if e.code == ErrorCode::SegmentNotFound => None,
                    Err(e) => return Err(e),
                };
                let id = self
                    .objs
                    .complete_id(key)
                    .filter(|&id| self.objs.get(id).size == *len);
                let Some(id) = id else {
                    return Err(not_found(key));
                };
                let obj = self.objs.get(id);
                if obj.checksum().is_some_and(|s| s != *sum) {
                    return Err(err(
                        ErrorCode::Corrupt,
                        format!(
                            "the NVMe copy of {} does not match the object's checksum",
                            show_key(key)
                        ),
                    ));
                }
                // A copy of another incarnation of the key (asked for before
                // a replace or a removal and put since): never this one's.
                if obj.stored().version != *version {
                    return Err(err(
                        ErrorCode::ObjectNotFound,
                        format!(
                            "the NVMe copy of {} is of another incarnation (version {version:#x}, \
                             the object's {:#x})",
                            show_key(key),
                            obj.stored().version
                        ),
                    ));
                }
                let existing = obj
                    .replicas
                    .iter()
                    .find(|r| r.slot == nslot)
                    .map(|r| r.offset);
                let pos = dslot.and_then(|d| {
                    obj.replicas.iter().position(|r| {
                        r.slot == d && r.offset == *offset && r.state != ReplicaState::Promoting
                    })
                });
                match existing {
                    Some(l) if l != *loc => {
                        return Err(err(
                            ErrorCode::ObjectAlreadyExists,
                            "another NVMe copy is recorded",
                        ))
                    }
                    Some(_) => {}
                    // The copy was made from a DRAM range this object does
                    // not hold: the object it was asked for was replaced (or
                    // removed and put again) meanwhile, so these bytes may
                    // be another version's. (The range itself is not reused
                    // while a node may still read it: see `free_at`.)
                    None if dslot.is_some() && pos.is_none() => {
                        return Err(err(
                            ErrorCode::ObjectNotFound,
                            format!(
                                "the object under {} no longer holds the DRAM range the copy \
                                 was made from",
                                show_key(key)
                            ),
                        ))
                    }
                    None => self
                        .objs
                        .update(id, |o| o.replicas.push(Replica::ready(nslot, *loc))),
                }
                // The write-through copy of a replica whose demotion is
                // under way: the node still holds that demotion's Persist
                // task, which reads the range; its own report ends it. (Were
                // the replica Ready again, an eviction would free the range
                // at once, the object having an NVMe copy, and the node
                // would copy another put's bytes from it.)
                let pos = pos.filter(|&p| {
                    *demote || self.objs.get(id).replicas[p].state != ReplicaState::Demoting
                });
                if let Some(pos) = pos {
                    let obj = self.objs.get(id);
                    let was = (obj.replicas[pos].state == ReplicaState::Demoting)
                        .then_some((obj.replicas[pos].slot, obj.size));
                    if *demote {
                        let r = self.objs.update(id, |o| o.replicas.remove(pos));
                        let obj = self.objs.get(id);
                        let (size, lease_end) = (obj.size, obj.stored().lease_end_ms);
                        self.demotions += 1;
                        self.evict_dram_replica(r, size, lease_end, now_ms);
                    } else {
                        self.objs
                            .update(id, |o| o.replicas[pos].state = ReplicaState::Ready);
                    }
                    if let Some((idx, size)) = was {
                        self.demotion_over(idx, size);
                    }
                }
                // The copy is this object's: a Drop owed to an earlier
                // object's copy in the same place is stale.
                self.settle_drop(*nvme, key, *loc, false);
                Ok(())
            }
            NvmeUpdate::PersistFailed {
                key,
                dram,
                offset,
                demote,
            } => {
                let dslot = self.owned_slot(client, *dram, Tier::Dram)?;
                let id = self.objs.complete_id(key).ok_or_else(|| not_found(key))?;
                let obj = self.objs.get(id);
                let Some(pos) = obj.replicas.iter().position(|r| {
                    r.slot == dslot && r.offset == *offset && r.state == ReplicaState::Demoting
                }) else {
                    return Ok(());
                };
                let size = obj.size;
                if !*demote {
                    // A write-through copy failed while a demotion of the
                    // replica is under way: that demotion's own report
                    // ends it (its task still reads the range).
                    return Ok(());
                }
                // The eviction goes ahead without an NVMe copy.
                let (r, left) = self.objs.update(id, |o| {
                    let r = o.replicas.remove(pos);
                    (r, o.replicas.len())
                });
                let lease_end = self.objs.get(id).stored().lease_end_ms;
                if left == 0 {
                    self.remove_replicaless(id);
                }
                self.demotion_over(dslot, size);
                self.evict_dram_replica(r, size, lease_end, now_ms);
                Ok(())
            }
            NvmeUpdate::Promoted {
                key,
                dram,
                offset,
                ok,
            } => {
                let dslot = self.owned_slot(client, *dram, Tier::Dram)?;
                let id = self.objs.complete_id(key).ok_or_else(|| not_found(key))?;
                let obj = self.objs.get(id);
                let pos = obj
                    .replicas
                    .iter()
                    .position(|r| {
                        r.slot == dslot && r.offset == *offset && r.state == ReplicaState::Promoting
                    })
                    .ok_or_else(|| {
                        err(ErrorCode::ObjectNotFound, "no promotion under way there")
                    })?;
                if *ok {
                    let extra = obj.replicas[pos].extra;
                    self.objs
                        .update(id, |o| o.replicas[pos].state = ReplicaState::Ready);
                    if extra {
                        self.hot_copies += 1;
                    } else {
                        self.promotions += 1;
                    }
                } else {
                    let size = obj.size;
                    let r = self.objs.update(id, |o| o.replicas.remove(pos));
                    self.free_replica_now(&r, size);
                }
                Ok(())
            }
            NvmeUpdate::Evicted { key, nvme, loc, .. } => {
                // A tier not mounted is refused (`SegmentNotFound`), and
                // the node keeps the copy: a restarted master may still
                // list it (a recovered replica waiting for the tier's
                // remount, which would then name a freed slot), and the
                // tier's report after its mount settles it either way.
                let nslot = self.owned_slot(client, *nvme, Tier::Nvme)?;
                if let Some(id) = self.objs.complete_id(key) {
                    let left = self.objs.update(id, |o| {
                        o.replicas
                            .retain(|r| !(r.slot == nslot && r.offset == *loc));
                        o.replicas.len()
                    });
                    if left == 0 {
                        self.remove_replicaless(id);
                    }
                }
                Ok(())
            }
            NvmeUpdate::Recovered {
                key,
                nvme,
                loc,
                len,
                sum,
                version,
            } => {
                let nslot = self.owned_slot(client, *nvme, Tier::Nvme)?;
                self.check_loc(nslot, *loc)?;
                if *len == 0 || *len > self.cfg.max_value_bytes {
                    return Err(err(
                        ErrorCode::InvalidParams,
                        format!("a recovered object of {len} bytes"),
                    ));
                }
                let listed = self.objs.complete_id(key).is_some_and(|id| {
                    self.objs
                        .get(id)
                        .replicas
                        .iter()
                        .any(|r| r.slot == nslot && r.offset == *loc)
                });
                // The copy carries the version of the key's object (or of
                // the recovered one none of whose replicas is back): it is
                // that object's (a Persist wrote it, maybe in a slot a Drop
                // of an earlier incarnation freed, its `Stored` not in yet),
                // whatever the Drop ledger remembers of the place.
                let parked = self.parked_record(key);
                let versioned = *version != 0
                    && (self.objs.complete_id(key).is_some_and(|id| {
                        let o = self.objs.get(id);
                        o.stored().version == *version && o.size == *len
                    }) || parked.is_some_and(|(size, _, _, v)| v == *version && size == *len));
                if !listed && !versioned && self.drop_owed(*nvme, key, *loc) {
                    // Reported before the node ran the Drop it is owed,
                    // maybe handed out already (to a tier still adopted a
                    // Drop stays owed until the tier is listed; on a listed
                    // one such a copy is old, below). The node restarted,
                    // or its tier mounted again; the master may have
                    // restarted too (what is owed is in its state
                    // directory). Taking it would bring back a removed or replaced object. (A copy the
                    // key's object lists is that object's: a later put's
                    // copy took the slot, and the Drop is stale.) Unless,
                    // written before versions (one with a version is its
                    // object's, above, or old), it has the checksum of the
                    // key's object, a copy of which is on its way to this
                    // tier: the node ran the Drop and wrote that copy in the
                    // freed slot before this report.
                    // Refused, the node would delete it and its `Stored`
                    // list an empty slot. (Without a checksum an old copy
                    // of the same size cannot be told from it: refused.)
                    let summed = self
                        .objs
                        .complete_id(key)
                        .is_some_and(|id| self.objs.get(id).checksum().is_some());
                    if *version == 0 && summed && self.copy_under_way(key, *nvme, *len, *sum) {
                        return Err(under_way());
                    }
                    return Err(err(
                        ErrorCode::ObjectAlreadyExists,
                        "this copy's object was removed or replaced: its Drop is owed",
                    ));
                }
                let unlisted = if listed || versioned {
                    Unlisted::Listed
                } else {
                    self.unlisted_copy(*nvme, key, *loc, *version, now_ms)
                };
                // A copy with a version is its object's (above) or old: only
                // one written before versions may be one under way.
                if unlisted == Unlisted::Old
                    && *version == 0
                    && self.copy_under_way(key, *nvme, *len, *sum)
                {
                    // The node reports its whole tier beside its rounds: a
                    // copy a Persist of this object has just written may be
                    // reported before its `Stored`. Not now (the node keeps
                    // it): its `Stored` lists it, and a copy that never
                    // reports (its persist failed) is refused as old at the
                    // tier's next report, when nothing is under way.
                    return Err(under_way());
                }
                if unlisted == Unlisted::Old {
                    // Every live copy of this tier is listed: this one is
                    // an old object's whose Drop was handed out (the node
                    // died before it ran it, or the master restarted), or
                    // of a key removed while its tier was away.
                    return Err(err(
                        ErrorCode::ObjectAlreadyExists,
                        "an old copy: no object lists it (its object was removed or replaced)",
                    ));
                }
                match self.objs.complete_id(key) {
                    Some(id) => {
                        let o = self.objs.get(id);
                        // Without a checksum nothing shows the copy is this
                        // object's and not an earlier one's of the same
                        // size, unless this very replica is listed already
                        // (its record came back from the state directory),
                        // or was this object's when its tier went.
                        let same = match o.checksum() {
                            Some(s) => s == *sum,
                            None => unlisted != Unlisted::Adopted,
                        };
                        if o.size != *len || !same {
                            return Err(err(
                                ErrorCode::ObjectAlreadyExists,
                                "a different object is stored under this key now",
                            ));
                        }
                        self.objs.update(id, |o| {
                            o.replicas.retain(|r| r.slot != nslot);
                            o.replicas.push(Replica::ready(nslot, *loc));
                        });
                        self.settle_drop(*nvme, key, *loc, false);
                        Ok(())
                    }
                    // A put of the key under way (a replace of a complete
                    // key is the arm above: its copy is the complete one's).
                    None if self.objs.processing_id(key).is_some() => {
                        Err(err(ErrorCode::ObjectAlreadyExists, "the key is being put"))
                    }
                    // A recovered object holds the key, none of its replicas
                    // back yet: the copy is taken for it only if it is its
                    // own (its checksum, or without one its version). An
                    // earlier object's (replaced before the restart, on a
                    // tier not listed, so taken on its word) would stand in
                    // for it, and its record would name the recovered
                    // object's waiting replicas, other bytes, beside it.
                    None if parked.is_some() => {
                        let same = parked.is_some_and(|(size, psum, ..)| {
                            size == *len && psum.map_or(versioned, |s| s == *sum)
                        });
                        if !same {
                            return Err(err(
                                ErrorCode::ObjectAlreadyExists,
                                "a different object is stored under this key now",
                            ));
                        }
                        if !self.attach_parked_copy(key, nslot, *loc, now_ms) {
                            return Err(err(
                                ErrorCode::ResourceExhausted,
                                "the pool holds its maximum of keys",
                            ));
                        }
                        self.settle_drop(*nvme, key, *loc, false);
                        Ok(())
                    }
                    None => {
                        if self.key_count() >= self.cfg.max_keys || !self.objs.has_room() {
                            return Err(err(
                                ErrorCode::ResourceExhausted,
                                "the pool holds its maximum of keys",
                            ));
                        }
                        self.objs.insert(
                            key,
                            Object {
                                size: *len,
                                phase: Phase::Complete(Complete {
                                    lease_end_ms: now_ms,
                                    unread: false,
                                    pin_end_ms: 0,
                                    sum: *sum,
                                    has_sum: true,
                                    hard_pin: false,
                                    nvme_reads: 0,
                                    // The copy's: its incarnation's.
                                    version: *version,
                                }),
                                replicas: smallvec::smallvec![Replica::ready(nslot, *loc)],
                            },
                        );
                        Ok(())
                    }
                }
            }
        }
    }
}
