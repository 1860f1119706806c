//! Segments as one shard sees them: the slot of each mounted segment (its
//! spec, this shard's range of a DRAM one, draining and suspect marks, the
//! demotion and eviction counts), mounts and unmounts, and the slots'
//! own invariants.
use super::*;

/// A segment as one shard sees it: its spec and this shard's range of it.
#[derive(Debug)]
pub(super) struct SegmentSlot {
    pub(super) id: SegmentId,
    pub(super) spec: Arc<SegmentSpec>,
    /// DRAM: this shard's range. NVMe: empty (the node manages that space).
    pub(super) alloc: RangeAllocator,
    pub(super) draining: bool,
    /// The client (storage node) that mounted it: only it may report on it
    /// or take its tasks.
    pub(super) owner: ClientId,
    /// A client could not reach its node: no new replicas go there until the
    /// owner's next ping.
    pub(super) suspect: bool,
    /// Bytes of this segment's `Demoting` replicas (space on its way out),
    /// kept as they change so a put need not count them.
    pub(super) demoting: u64,
    /// Bytes the off-path eviction still owes this range (an episode under
    /// way; 0: none).
    pub(super) evict_owed: u64,
}

impl SegmentSlot {
    pub(super) fn tier(&self) -> Tier {
        self.spec.tier
    }

    /// Its state as the state directory records it.
    pub(super) fn recorded_state(&self) -> SegmentState {
        if self.draining {
            SegmentState::Draining
        } else {
            SegmentState::Live
        }
    }

    /// A DRAM range placement may use for `size` bytes now: not draining,
    /// not suspect, a free extent that fits.
    pub(super) fn takes(&self, size: u64) -> bool {
        self.tier() == Tier::Dram
            && !self.draining
            && !self.suspect
            && self.alloc.largest_free() >= self.alloc.rounded(size)
    }

    /// The fraction of this shard's range that is free.
    pub(super) fn free_ratio(&self) -> f64 {
        self.alloc.free() as f64 / self.alloc.capacity().max(1) as f64
    }
}

impl ShardState {
    /// Adds a segment (idempotent for the same id; a known NVMe tier that
    /// mounts again after its node restarted gets its new address and owner).
    pub fn add_segment(
        &mut self,
        id: SegmentId,
        spec: Arc<SegmentSpec>,
        owner: ClientId,
        now_ms: u64,
    ) {
        if let Some(&idx) = self.by_id.get(&id) {
            if let Some(slot) = self.slots[idx as usize].as_mut() {
                slot.spec = spec;
                slot.owner = owner;
                slot.suspect = false;
            }
            return;
        }
        let alloc = match spec.tier {
            Tier::Dram => {
                let (lo, len) = self.range_of(spec.size);
                RangeAllocator::new(lo, len, SEGMENT_ALIGN)
            }
            // The node manages NVMe space; the master only records replicas.
            Tier::Nvme => RangeAllocator::new(0, 0, SEGMENT_ALIGN),
        };
        // A segment recorded draining before a restart is draining when it
        // mounts again: a drain ends with the segment's unmount, not with
        // the master's process.
        let draining = self
            .durable
            .as_ref()
            .is_some_and(|d| d.awaiting.get(&id) == Some(&SegmentState::Draining));
        let slot = SegmentSlot {
            id,
            alloc,
            spec,
            draining,
            owner,
            suspect: false,
            demoting: 0,
            evict_owed: 0,
        };
        let dram = slot.tier() == Tier::Dram;
        // A put is a use: where eviction drops the only copy (no NVMe
        // tier), an unread object ranks as if read at its completion.
        let keep_ms = if slot.spec.nvme.is_none() {
            self.cfg.lease_ttl_ms
        } else {
            0
        };
        let idx = match self.slots.iter().position(Option::is_none) {
            Some(i) => {
                self.slots[i] = Some(slot);
                i
            }
            None => {
                self.slots.push(Some(slot));
                self.slots.len() - 1
            }
        };
        if dram {
            self.objs.mount_range(idx as u32, keep_ms);
        } else {
            self.copies
                .mounted(id, now_ms.saturating_add(self.cfg.tier_quiet_ms));
        }
        self.by_id.insert(id, idx as u32);
        self.attach_parked(idx as u32, id, now_ms);
        self.queue_owed_drops(id);
        let state = self.slot(idx as u32).recorded_state();
        self.record_segment(id, state);
    }

    /// A segment's new state, to record.
    fn record_segment(&mut self, id: SegmentId, state: SegmentState) {
        if let Some(d) = self.durable.as_mut() {
            d.segments.push((id, state));
        }
    }

    /// Removes a segment and every replica on it; objects left with no replica
    /// are removed. Returns how many objects went. Idempotent. O(objects).
    pub fn remove_segment(&mut self, id: SegmentId) -> u64 {
        let Some(idx) = self.by_id.remove(&id) else {
            return 0;
        };
        self.record_segment(id, SegmentState::Gone);
        let mut gone = 0;
        // A tier that may come back: what it holds is remembered, and from
        // then on only that (a tier still adopted is listed now: copies it
        // had not reported yet are lost when it comes back, but a key
        // removed while it was away does not return).
        let detach = self.slot(idx).tier() == Tier::Nvme;
        if detach {
            self.list_tier(id);
        }
        for oid in self.objs.ids_with_replica_in(idx) {
            if detach {
                let key: Box<[u8]> = self.objs.key(oid).into();
                let o = self.objs.get(oid);
                let version = o.complete().map(|c| c.version);
                let locs: SmallVec<[u64; 2]> = o
                    .replicas
                    .iter()
                    .filter(|r| r.slot == idx)
                    .map(|r| r.offset)
                    .collect();
                for loc in locs {
                    self.detach(id, &key, loc, version);
                }
            }
            let left = self.objs.update(oid, |o| {
                o.replicas.retain(|r| r.slot != idx);
                o.replicas.len()
            });
            if left == 0 {
                self.remove_replicaless(oid);
                gone += 1;
            }
        }
        self.objs.unmount_range(idx);
        self.slots[idx as usize] = None;
        self.tasks.remove(&id);
        // Extents that waited to be freed go with the mount: the same
        // segment mounted again (a node declared dead that joins again) has
        // a fresh allocator that never handed them out.
        self.pending.retain(|p| p.0.slot != idx);
        gone
    }

    /// Marks a segment suspect (a client could not reach its node) or clears
    /// the mark (its owner pinged): placement skips suspect segments.
    pub fn set_suspect(&mut self, id: SegmentId, suspect: bool) {
        if let Some(&idx) = self.by_id.get(&id) {
            if let Some(s) = self.slots[idx as usize].as_mut() {
                s.suspect = suspect;
            }
        }
    }

    /// Marks a segment draining until it is unmounted (a restart of the
    /// master, or a standby's takeover, keeps the mark): its replicas stay
    /// readable, no new puts go there. Returns false for an unknown segment.
    pub fn drain_segment(&mut self, id: SegmentId) -> bool {
        let Some(&idx) = self.by_id.get(&id) else {
            return false;
        };
        let s = self.slot_mut(idx);
        if !s.draining {
            s.draining = true;
            self.record_segment(id, SegmentState::Draining);
        }
        true
    }

    pub(super) fn slot(&self, idx: u32) -> &SegmentSlot {
        self.slots[idx as usize]
            .as_ref()
            .expect("replicas only point at mounted slots")
    }

    pub(super) fn slot_mut(&mut self, idx: u32) -> &mut SegmentSlot {
        self.slots[idx as usize]
            .as_mut()
            .expect("replicas only point at mounted slots")
    }

    /// The slots' invariants: every mounted segment is found by its id and
    /// every id finds its segment; a DRAM slot, and only one, has a range in
    /// the eviction index.
    pub(super) fn check_segments(&self) -> Result<(), String> {
        for (&id, &idx) in &self.by_id {
            match self.slots.get(idx as usize) {
                Some(Some(s)) if s.id == id => {}
                _ => {
                    return Err(format!(
                        "segment {id:016x} maps to slot {idx}, which is not it"
                    ))
                }
            }
        }
        let mounted = self.slots.iter().flatten().count();
        if mounted != self.by_id.len() {
            return Err(format!(
                "{mounted} slots mounted, {} segment ids known",
                self.by_id.len()
            ));
        }
        for (idx, slot) in self.slots.iter().enumerate() {
            let dram = slot.as_ref().is_some_and(|s| s.tier() == Tier::Dram);
            if self.objs.has_range(idx as u32) != dram {
                return Err(format!(
                    "slot {idx}: the eviction index has a range for it: {}, it is a mounted \
                     DRAM segment: {dram}",
                    !dram
                ));
            }
        }
        Ok(())
    }
}
