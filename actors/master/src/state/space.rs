//! DRAM space: placement, deferred frees, and eviction (demotion to the
//! NVMe tier where there is one).
use super::*;

impl ShardState {
    /// A demotion's DRAM replica `r` (already taken off its object) is
    /// evicted: counted, and its space freed once the object's read lease
    /// (`lease_end`) is over, since a reader may still be copying it (the
    /// node is done with it: it reported).
    pub(super) fn evict_dram_replica(
        &mut self,
        r: Replica,
        size: u64,
        lease_end: u64,
        now_ms: u64,
    ) {
        self.evictions += 1;
        self.evicted_bytes += demoting_extent(size);
        self.free_replica_at(&r, size, lease_end, now_ms);
    }

    /// Frees one replica's DRAM space (NVMe space is the node's).
    pub(super) fn free_replica_now(&mut self, r: &Replica, size: u64) {
        let slot = self.slot_mut(r.slot);
        if slot.tier() == Tier::Dram {
            slot.alloc.dealloc(r.offset, size);
        }
    }

    /// Frees one replica's DRAM space at `at_ms` (now, if that has passed).
    pub(super) fn free_replica_at(&mut self, r: &Replica, size: u64, at_ms: u64, now_ms: u64) {
        if at_ms <= now_ms {
            self.free_replica_now(r, size);
            return;
        }
        let slot = self.slot(r.slot);
        if slot.tier() == Tier::Dram {
            let segment = slot.id;
            self.hold(r.slot, r.offset, size, at_ms);
            self.pending.push(Reverse(PendingFree {
                at_ms,
                segment,
                slot: r.slot,
                offset: r.offset,
                size,
            }));
        }
    }

    /// Whether a node may still be copying replica `r` of an object (which
    /// has an NVMe copy already if `on_nvme`): out to NVMe (a demotion, or
    /// the write-through copy asked for at PutEnd of an object that has no
    /// NVMe copy yet) or in from NVMe (a promotion).
    pub(super) fn node_may_copy(&self, r: &Replica, on_nvme: bool) -> bool {
        match r.state {
            ReplicaState::Demoting | ReplicaState::Promoting => true,
            ReplicaState::Ready => {
                !on_nvme
                    && self
                        .slot(r.slot)
                        .spec
                        .nvme
                        .as_ref()
                        .is_some_and(|a| a.write_through)
            }
        }
    }

    /// Frees `obj`'s space at `at_ms` (now, if that has passed). A replica
    /// that a node may still be copying (`node_may_copy`) waits at least
    /// `stale_put_grace_ms`: the node reads or writes the range without
    /// asking the master, so no writer may be sent to it meanwhile.
    pub(super) fn free_at(&mut self, obj: &Object, at_ms: u64, now_ms: u64) {
        let on_nvme = has_nvme(&self.slots, obj);
        for r in &obj.replicas {
            let at_ms = if self.node_may_copy(r, on_nvme) {
                at_ms.max(now_ms + self.cfg.stale_put_grace_ms)
            } else {
                at_ms
            };
            self.free_replica_at(r, obj.size, at_ms, now_ms);
        }
    }

    /// Frees every deferred extent whose time has come; returns the bytes.
    pub(super) fn release_due(&mut self, now_ms: u64) -> u64 {
        let mut freed = 0;
        while self.pending.peek().is_some_and(|p| p.0.at_ms <= now_ms) {
            let Reverse(p) = self.pending.pop().expect("peeked");
            // The segment may have been unmounted (and the slot reused) since.
            if let Some(Some(slot)) = self.slots.get_mut(p.slot as usize) {
                if slot.id == p.segment {
                    slot.alloc.dealloc(p.offset, p.size);
                    freed += slot.alloc.rounded(p.size);
                }
            }
        }
        freed
    }

    /// Discards a Processing object nobody will finish; its space is
    /// quarantined, since a late writer may still be sending bytes into it.
    pub(super) fn discard_processing(&mut self, id: Id, now_ms: u64) {
        let (_, obj) = self.objs.remove(id);
        let at = now_ms.saturating_add(self.cfg.stale_put_grace_ms);
        self.free_at(&obj, at, now_ms);
    }

    pub(super) fn is_stale(&self, obj: &Object, now_ms: u64) -> bool {
        now_ms.saturating_sub(obj.put().started_ms) >= self.cfg.put_timeout_ms
    }

    /// Chooses up to `n` distinct segments with room for `size` bytes.
    pub(super) fn place(
        &mut self,
        size: u64,
        n: usize,
        preferred_host: &str,
    ) -> SmallVec<[u32; 4]> {
        let mut cands: SmallVec<[(u32, f64, bool); 16]> = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                let s = s.as_ref()?;
                s.takes(size).then(|| {
                    let local = !preferred_host.is_empty() && s.spec.host_id == preferred_host;
                    (i as u32, s.free_ratio(), local)
                })
            })
            .collect();
        match self.cfg.placement {
            Placement::Random => {
                // Partial Fisher-Yates: the first n are a uniform sample.
                let k = n.min(cands.len());
                for i in 0..k {
                    let j = self.rng.random_range(i..cands.len());
                    cands.swap(i, j);
                }
                cands.truncate(k);
            }
            Placement::FreeRatioFirst => {
                cands.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            }
            Placement::LocalFirst => {
                cands.sort_by(|a, b| b.2.cmp(&a.2).then(b.1.total_cmp(&a.1)).then(a.0.cmp(&b.0)));
            }
        }
        cands.into_iter().take(n).map(|c| c.0).collect()
    }

    /// Whether segments may still mount again on a master that restarted
    /// on its state, or a standby that took over, before its recovered
    /// replicas are given up (`parked_until_ms`): none is mounted yet, or
    /// some await their remount (recorded mounted, or named by a recovered
    /// replica or hold; their nodes have not pinged it yet).
    pub(super) fn awaiting_segments(&self, now_ms: u64) -> bool {
        self.durable.as_ref().is_some_and(|d| {
            now_ms < d.parked_until_ms
                && (!d.awaiting.is_empty()
                    || self.slots.iter().flatten().all(|s| s.tier() != Tier::Dram))
        })
    }

    /// Whether a DRAM segment that placement skips only because it is
    /// suspect has room for `size` bytes.
    pub(super) fn room_while_suspect(&self, size: u64) -> bool {
        self.slots.iter().flatten().any(|s| {
            s.tier() == Tier::Dram
                && s.suspect
                && !s.draining
                && s.alloc.largest_free() >= s.alloc.rounded(size)
        })
    }

    /// Evicts the replica in slot `idx` that ranks first (see
    /// [`super::objects`]: complete, lease ended, not hard-pinned, `Ready`;
    /// unpinned before soft-pinned, oldest lease first). A victim with an
    /// NVMe copy loses its DRAM replica at once; one whose node has an NVMe
    /// tier is demoted (copied there first, its space on its way out);
    /// others are dropped, and an object left without a replica goes. A
    /// replica is never `Ready` while a demotion of it is under way (see
    /// the `Stored` and `PersistFailed` arms of `nvme_update`), so no
    /// queued demotion reads a range freed here. Returns the bytes it frees
    /// now or once its demotion lands; `None`
    /// when nothing in the range may be evicted. Pins must have been swept
    /// to `now_ms`.
    pub(super) fn evict_next(&mut self, idx: u32, now_ms: u64) -> Option<u64> {
        let id = self.objs.first_victim(idx, now_ms)?;
        let (seg_id, tiered) = {
            let s = self.slot(idx);
            (s.id, s.spec.nvme.is_some())
        };
        let obj = self.objs.get(id);
        let size = obj.size;
        let pos = obj
            .replicas
            .iter()
            .position(|r| r.slot == idx && r.state == ReplicaState::Ready)
            .expect("indexed by a Ready replica in this range");
        let queue_room = self
            .tasks
            .get(&seg_id)
            .is_none_or(|q| q.len() < MAX_TASKS_PER_SEGMENT);
        // An extra replica of a hot object is dropped: the object has others.
        let extra = obj.replicas[pos].extra;
        if tiered && queue_room && !extra && !has_nvme(&self.slots, obj) {
            // Demote: the node copies it to NVMe, then the DRAM replica goes.
            let task = NodeTask::Persist(PersistTask {
                key: self.objs.key(id).to_vec(),
                dram: seg_id,
                offset: obj.replicas[pos].offset,
                len: size,
                demote: true,
                checksum: obj.checksum(),
                version: obj.stored().version,
            });
            self.objs
                .update(id, |o| o.replicas[pos].state = ReplicaState::Demoting);
            self.slot_mut(idx).demoting += demoting_extent(size);
            self.tasks.entry(seg_id).or_default().push_back(task);
            return Some(demoting_extent(size));
        }
        let (r, left) = self.objs.update(id, |o| {
            let r = o.replicas.remove(pos);
            (r, o.replicas.len())
        });
        if left == 0 {
            self.remove_replicaless(id);
        }
        let slot = self.slot_mut(idx);
        slot.alloc.dealloc(r.offset, size);
        let bytes = slot.alloc.rounded(size);
        self.evictions += 1;
        self.evicted_bytes += bytes;
        Some(bytes)
    }

    /// DRAM bytes of slot `idx` whose demotion to NVMe is under way.
    pub(super) fn demoting_bytes(&self, idx: u32) -> u64 {
        self.slot(idx).demoting
    }

    /// A `Demoting` replica of an object of `size` bytes in slot `idx` stops
    /// being one (its copy landed or failed, or the object went).
    pub(super) fn demotion_over(&mut self, idx: u32, size: u64) {
        if let Some(Some(s)) = self.slots.get_mut(idx as usize) {
            s.demoting = s.demoting.saturating_sub(demoting_extent(size));
        }
    }

    /// `obj` leaves the shard: its demotions under way no longer count.
    pub(super) fn demotions_over(&mut self, obj: &Object) {
        for r in &obj.replicas {
            if r.state == ReplicaState::Demoting {
                self.demotion_over(r.slot, obj.size);
            }
        }
    }

    /// What one eviction episode frees in slot `idx`: `eviction_ratio` of
    /// the range.
    pub(super) fn episode_bytes(&self, idx: u32) -> u64 {
        (self.cfg.eviction_ratio * self.slot(idx).alloc.capacity() as f64).ceil() as u64
    }

    /// If the range in slot `idx` is past the high watermark (space on its
    /// way out to NVMe counting as freed) and no episode is under way, the
    /// off-path eviction now owes it an episode.
    pub(super) fn owe_if_high(&mut self, idx: u32) {
        let s = self.slot(idx);
        let cap = s.alloc.capacity();
        if s.evict_owed > 0 || cap == 0 {
            return;
        }
        let left = s.alloc.used().saturating_sub(s.demoting);
        if (left as f64) <= self.cfg.high_watermark * cap as f64 {
            return;
        }
        let owed = self.episode_bytes(idx);
        self.slot_mut(idx).evict_owed = owed;
    }

    /// Whether the range in slot `idx` is past the high watermark only by
    /// its extra replicas, none of which may be evicted at `now_ms` (one
    /// being fetched, or still leased): the off-path eviction then waits
    /// for them (the ticks owe the range an episode again) rather than
    /// evict another object in their place. An optional copy never costs
    /// an object its place.
    fn waits_for_extras(&self, idx: u32, now_ms: u64) -> bool {
        let extra = self.objs.extra_bytes_in(idx);
        if extra == 0 || self.objs.extra_due(idx, now_ms) {
            return false;
        }
        let s = self.slot(idx);
        let left = s
            .alloc
            .used()
            .saturating_sub(s.demoting)
            .saturating_sub(extra);
        (left as f64) <= self.cfg.high_watermark * s.alloc.capacity() as f64
    }

    /// Whether the off-path eviction owes some range an episode: the driver
    /// should run [`Self::evict_step`].
    pub fn evicting(&self) -> bool {
        self.slots.iter().flatten().any(|s| s.evict_owed > 0)
    }

    /// One bounded step of the off-path eviction at `now_ms`: at most
    /// `budget` replicas evicted, or pins swept, over the ranges owed an
    /// episode (an episode ends when its bytes are freed or nothing in its
    /// range may be evicted). Returns whether more is owed. The live shard
    /// runs steps in a task that yields between them; `MasterCore` runs
    /// them after every call.
    pub fn evict_step(&mut self, now_ms: u64, budget: usize) -> bool {
        if !self.evicting() {
            return false;
        }
        let mut left = budget.max(1);
        if !self.objs.sweep_pins(now_ms, &mut left) {
            return true;
        }
        for idx in 0..self.slots.len() as u32 {
            while left > 0 {
                let owed = match &self.slots[idx as usize] {
                    Some(s) if s.evict_owed > 0 => s.evict_owed,
                    _ => break,
                };
                left -= 1;
                let next = if self.waits_for_extras(idx, now_ms) {
                    None
                } else {
                    self.evict_next(idx, now_ms)
                };
                self.slot_mut(idx).evict_owed = match next {
                    Some(bytes) => owed.saturating_sub(bytes),
                    None => 0,
                };
            }
        }
        self.evicting()
    }

    /// A put of `len` bytes found no room: evicts in the ranges that could
    /// hold it, in each until the object fits there (at most
    /// `max(eviction_ratio of the range, len)`), until `want` ranges fit;
    /// what is left of the ratio in a range it evicted in is owed to the
    /// off-path eviction. O(victims + pins that ended).
    pub(super) fn evict_to_fit(
        &mut self,
        len: u64,
        want: usize,
        now_ms: u64,
    ) -> SmallVec<[u32; 4]> {
        let idxs: SmallVec<[u32; 4]> = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                let s = s.as_ref()?;
                (s.tier() == Tier::Dram
                    && !s.draining
                    && !s.suspect
                    && s.alloc.capacity() >= s.alloc.rounded(len))
                .then_some(i as u32)
            })
            .collect();
        let mut unbounded = usize::MAX;
        self.objs.sweep_pins(now_ms, &mut unbounded);
        let fits = |s: &SegmentSlot| s.alloc.largest_free() >= s.alloc.rounded(len);
        let mut fitting = idxs.iter().filter(|&&i| fits(self.slot(i))).count();
        for &idx in &idxs {
            if fitting >= want {
                break;
            }
            if fits(self.slot(idx)) {
                continue;
            }
            let ratio = self.episode_bytes(idx);
            let bound = ratio.max(self.slot(idx).alloc.rounded(len));
            let mut done = 0;
            while done < bound && !fits(self.slot(idx)) {
                match self.evict_next(idx, now_ms) {
                    Some(bytes) => done += bytes,
                    None => break,
                }
            }
            if fits(self.slot(idx)) {
                fitting += 1;
            }
            if done > 0 && ratio > done {
                let s = self.slot_mut(idx);
                s.evict_owed = s.evict_owed.max(ratio - done);
            }
        }
        idxs
    }

    /// The space invariants: in every DRAM range, the extents the objects,
    /// puts and deferred frees hold add up to what the allocator has in use,
    /// lie inside the shard's range and do not overlap; the demoting bytes
    /// counted are those of `Demoting` replicas.
    pub(super) fn check_space(&self) -> Result<(), String> {
        let mut extents: HashMap<u32, Vec<(u64, u64, String)>> = HashMap::new();
        let mut demoting: HashMap<u32, u64> = HashMap::new();
        for id in self.objs.complete_ids() {
            let o = self.objs.get(id);
            for r in &o.replicas {
                if r.state == ReplicaState::Demoting {
                    *demoting.entry(r.slot).or_default() += demoting_extent(o.size);
                }
            }
        }
        for (state, ids) in [
            ("complete", self.objs.complete_ids().collect::<Vec<_>>()),
            ("processing", self.objs.processing_ids().collect()),
        ] {
            for id in ids {
                let (k, o) = (self.objs.key(id), self.objs.get(id));
                for r in &o.replicas {
                    let Some(Some(slot)) = self.slots.get(r.slot as usize) else {
                        return Err(format!(
                            "{state} object {} has a replica in unmounted slot {}",
                            show_key(k),
                            r.slot
                        ));
                    };
                    if slot.tier() == Tier::Dram {
                        extents.entry(r.slot).or_default().push((
                            r.offset,
                            slot.alloc.rounded(o.size),
                            format!("{state} {}", show_key(k)),
                        ));
                    }
                }
            }
        }
        for Reverse(p) in self.pending.iter() {
            if let Some(Some(slot)) = self.slots.get(p.slot as usize) {
                if slot.id == p.segment {
                    extents.entry(p.slot).or_default().push((
                        p.offset,
                        slot.alloc.rounded(p.size),
                        format!("a free due at {} ms", p.at_ms),
                    ));
                }
            }
        }
        for (idx, slot) in self.slots.iter().enumerate() {
            let Some(slot) = slot else { continue };
            if slot.tier() != Tier::Dram {
                continue;
            }
            let counted = demoting.get(&(idx as u32)).copied().unwrap_or(0);
            if slot.demoting != counted {
                return Err(format!(
                    "segment {:016x}: {} demoting bytes counted, {counted} in Demoting replicas",
                    slot.id, slot.demoting
                ));
            }
            let mut v = extents.remove(&(idx as u32)).unwrap_or_default();
            let sum: u64 = v.iter().map(|e| e.1).sum();
            if sum != slot.alloc.used() {
                return Err(format!(
                    "segment {:016x}: the allocator has {} bytes in use, the extents held \
                     add up to {sum}",
                    slot.id,
                    slot.alloc.used()
                ));
            }
            let (lo, len) = (slot.alloc.base(), slot.alloc.capacity());
            v.sort_unstable_by_key(|e| e.0);
            for e in &v {
                if e.0 < lo || e.0 + e.1 > lo + len {
                    return Err(format!(
                        "segment {:016x}: {} at {}+{} lies outside this shard's range \
                         {lo}+{len}",
                        slot.id, e.2, e.0, e.1
                    ));
                }
            }
            for w in v.windows(2) {
                if w[0].0 + w[0].1 > w[1].0 {
                    return Err(format!(
                        "segment {:016x}: {} at {}+{} overlaps {} at {}+{}",
                        slot.id, w[0].2, w[0].0, w[0].1, w[1].2, w[1].0, w[1].1
                    ));
                }
            }
        }
        Ok(())
    }
}
