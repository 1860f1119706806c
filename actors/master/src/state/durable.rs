//! A shard's side of the state directory: the records of what changed,
//! snapshots, and the recovered image waiting for its segments.
use super::*;

/// A shard's side of the state directory: the clock's wall time, the holds
/// to record, and what recovery brought back that waits for its segments.
#[derive(Debug, Default)]
pub(super) struct Durable {
    /// Unix time (ms) at `now_ms == 0`: holds outlive the process, so they
    /// are recorded in wall time.
    pub(super) unix_at_zero_ms: u64,
    /// Space handed to a writer (or a node) or kept for a reader, to record.
    pub(super) holds: Vec<Hold>,
    /// Scratch for the keys taken from the object store.
    pub(super) keys: Vec<Box<[u8]>>,
    /// Recovered replicas whose segments have not mounted again, by key.
    pub(super) parked: Map<Box<[u8]>, Parked>,
    /// Recovered holds on segments that have not mounted again.
    pub(super) parked_holds: Map<SegmentId, Vec<Hold>>,
    /// When replicas still parked are given up (`now_ms` clock), as an
    /// unmount would drop them.
    pub(super) parked_until_ms: u64,
    /// Drops owed or settled since the last records, to record.
    /// (`DropOwed` / `DropDone` records.)
    pub(super) drops: Vec<Record>,
    /// Recovered replicas, still waiting for their segments, of objects
    /// removed or replaced since, with the objects' versions: a tier among
    /// those segments is owed a Drop of them when it mounts.
    pub(super) removed_parked: Map<Box<[u8]>, (u64, Waiting)>,
    /// Segments awaiting their remount: recorded mounted (their state:
    /// `Live` or `Draining`), or named by a recovered replica or hold
    /// (`Live`), and not mounted since. Until `parked_until_ms` a put that
    /// finds no room waits for them (`TryAgain`) instead of hearing
    /// `NoSpace`; one recorded draining is draining when it mounts.
    pub(super) awaiting: Map<SegmentId, SegmentState>,
    /// Segments mounted, drained or unmounted since the last records, to
    /// record.
    pub(super) segments: Vec<(SegmentId, SegmentState)>,
    /// Tiers listed since the last records, to record.
    pub(super) listed: Vec<SegmentId>,
    /// An epoch begun since the last records, to record.
    pub(super) epoch: Option<u64>,
}

impl Durable {
    /// The recovered image's own invariants: a replica waits only for a
    /// segment that has not mounted again (a mount attaches it) and that
    /// recovery expects (puts wait for it); a removed object's waiting
    /// copies are listed only while some remain.
    pub(super) fn check(&self, mounted: impl Fn(SegmentId) -> bool) -> Result<(), String> {
        for (key, p) in &self.parked {
            for &(seg, off) in &p.waiting {
                if mounted(seg) {
                    return Err(format!(
                        "{}'s recovered replica at {off} waits for segment {seg:016x}, which \
                         is mounted",
                        show_key(key)
                    ));
                }
                if !self.awaiting.contains_key(&seg) {
                    return Err(format!(
                        "{}'s recovered replica waits for segment {seg:016x}, which recovery \
                         does not expect",
                        show_key(key)
                    ));
                }
            }
        }
        if let Some(seg) = self.awaiting.keys().find(|&&s| mounted(s)) {
            return Err(format!(
                "segment {seg:016x} awaits its remount, and is mounted"
            ));
        }
        if let Some(k) = self.removed_parked.iter().find(|(_, (_, w))| w.is_empty()) {
            return Err(format!(
                "removed {} is listed with no copy waiting",
                show_key(k.0)
            ));
        }
        Ok(())
    }
}

/// A recovered object some of whose replicas wait for their segments.
#[derive(Debug)]
pub(super) struct Parked {
    pub(super) size: u64,
    pub(super) sum: Option<u64>,
    pub(super) hard_pin: bool,
    /// The incarnation's version (0: recorded before versions).
    pub(super) version: u64,
    /// (segment, offset) of the replicas not back yet.
    pub(super) waiting: SmallVec<[(SegmentId, u64); 2]>,
    /// Some replica came back: the object is in the store (and if it is
    /// not any more, it was removed since, and these go too).
    pub(super) attached: bool,
}

/// Appends the record of a recovered object none of whose replicas is back.
pub(super) fn encode_parked(key: &[u8], p: &Parked, out: &mut Vec<u8>) {
    journal::encode_object(
        out,
        key,
        p.size,
        p.sum,
        p.hard_pin,
        p.version,
        p.waiting.iter().copied(),
    );
}

/// Where a snapshot of a shard has got to (see [`ShardState::snapshot_step`]).
#[derive(Debug, Default, Clone, Copy)]
pub struct SnapshotCursor {
    pub(super) next_id: u32,
    pub(super) done: bool,
}

impl ShardState {
    /// Takes the state directory's image back (at start, before any
    /// request): each object waits for its segments to mount again, and is
    /// readable from the first that does; what has not come back by
    /// `now_ms + wait_ms` is dropped as an unmount drops it. Space held at
    /// the crash (a put's grant, a leased removal) stays held until its
    /// time when its segment mounts.
    pub fn recover(&mut self, image: Image, now_ms: u64, wait_ms: u64) {
        // A later epoch than any the directory names: no version handed out
        // before is handed out again.
        let epoch = match image.epoch {
            // None yet (a directory begun before epochs, or empty): the
            // shard's random one.
            0 => self.epoch,
            e => following_epoch(e),
        };
        // The lineage whose versions this shard knows as its own: from the
        // directory's first epoch (a directory whose epochs wrapped, after
        // 2^32 - 1 of them, knows only the new one).
        self.first_epoch = match image.first_epoch {
            f if f == 0 || f > epoch => epoch,
            f => f,
        };
        let d = self
            .durable
            .as_mut()
            .expect("recover needs with_durability");
        let now_unix = d.unix_at_zero_ms.saturating_add(now_ms);
        d.parked_until_ms = now_ms.saturating_add(wait_ms);
        d.awaiting.extend(image.segments);
        for (key, o) in image.objects {
            for r in &o.replicas {
                d.awaiting.entry(r.0).or_insert(SegmentState::Live);
            }
            d.parked.insert(
                key.into_boxed_slice(),
                Parked {
                    size: o.size,
                    sum: o.sum,
                    hard_pin: o.hard_pin,
                    version: o.version,
                    waiting: o.replicas.into_iter().collect(),
                    attached: false,
                },
            );
        }
        for h in image.holds {
            if h.until_unix_ms > now_unix {
                d.awaiting.entry(h.segment).or_insert(SegmentState::Live);
                d.parked_holds.entry(h.segment).or_default().push(h);
            }
        }
        self.copies.restore(image.listed_tiers, image.drops);
        self.begin_epoch(epoch);
    }

    /// Recovered objects still waiting for a segment (all their replicas,
    /// or some).
    pub fn parked_len(&self) -> usize {
        self.durable.as_ref().map_or(0, |d| d.parked.len())
    }

    /// A hold until `until_ms` on a DRAM replica's space, to record.
    pub(super) fn hold(&mut self, slot: u32, offset: u64, size: u64, until_ms: u64) {
        let Some(d) = self.durable.as_mut() else {
            return;
        };
        let Some(Some(s)) = self.slots.get(slot as usize) else {
            return;
        };
        if s.tier() != Tier::Dram {
            return;
        }
        d.holds.push(Hold {
            segment: s.id,
            offset,
            len: s.alloc.rounded(size),
            until_unix_ms: d.unix_at_zero_ms.saturating_add(until_ms),
        });
    }

    /// How long a writer or a node may still write into space it was
    /// handed at `now_ms`: the put's deadline and the quarantine after it.
    pub(super) fn write_hold_until(&self, now_ms: u64) -> u64 {
        now_ms
            .saturating_add(self.cfg.put_timeout_ms)
            .saturating_add(self.cfg.stale_put_grace_ms)
    }

    /// Appends to `out` the records of every durable change since the last
    /// call: the whole state of each key whose complete object changed,
    /// then the holds. The caller writes them to the log before it answers
    /// the requests that made them.
    pub fn take_records(&mut self, out: &mut Vec<u8>) {
        let Some(mut d) = self.durable.take() else {
            return;
        };
        if let Some(epoch) = d.epoch.take() {
            journal::encode_epoch(out, epoch);
        }
        // Listed tiers first: the Drops that went out to a tier while it
        // was adopted are done with its listing, never before it (a tier
        // not listed would take the copy back). Then the Drops: a write the
        // crash tore keeps a removal's DropOwed rather than its Gone (an
        // owed Drop of a copy the object still lists is stale, and
        // skipped), never the Gone without the DropOwed (the copy would
        // come back).
        for nvme in d.listed.drain(..) {
            journal::encode_tier_listed(out, nvme);
        }
        for (id, state) in d.segments.drain(..) {
            journal::encode_segment(out, id, state);
        }
        for rec in d.drops.drain(..) {
            rec.encode(out);
        }
        self.objs.take_dirty(&mut d.keys);
        let mut keys = std::mem::take(&mut d.keys);
        for key in keys.drain(..) {
            self.encode_key(&mut d, &key, out);
        }
        d.keys = keys;
        for h in d.holds.drain(..) {
            journal::encode_hold(out, &h);
        }
        self.durable = Some(d);
    }

    /// The record of `key` as it stands.
    pub(super) fn encode_key(&self, d: &mut Durable, key: &[u8], out: &mut Vec<u8>) {
        let parked = d.parked.get(key);
        if let Some(id) = self.objs.complete_id(key) {
            // An object whose only replica is a promotion still being
            // copied in (its NVMe copy evicted meanwhile) has nothing a
            // restart could read: it is recorded as gone.
            if !self.encode_complete(key, self.objs.get(id), parked, out) {
                journal::encode_gone(out, key);
            }
            return;
        }
        match parked {
            Some(p) if !p.attached && !p.waiting.is_empty() => encode_parked(key, p, out),
            _ => {
                // Removed (or evicted, or lost with its segments) since:
                // what still waited goes with it.
                d.parked.remove(key);
                journal::encode_gone(out, key);
            }
        }
    }

    /// The replicas of `o` a restart could read: its readable ones, and
    /// those recovered that still wait for their segment.
    pub(super) fn durable_replicas(
        &self,
        o: &Object,
        parked: Option<&Parked>,
    ) -> SmallVec<[(SegmentId, u64); 2]> {
        o.replicas
            .iter()
            .filter(|r| r.state != ReplicaState::Promoting)
            .map(|r| (self.slot(r.slot).id, r.offset))
            .chain(parked.into_iter().flat_map(|p| p.waiting.iter().copied()))
            .collect()
    }

    /// Appends the record of complete object `o` under `key`; false (and
    /// nothing appended) when it has no replica a restart could read.
    pub(super) fn encode_complete(
        &self,
        key: &[u8],
        o: &Object,
        parked: Option<&Parked>,
        out: &mut Vec<u8>,
    ) -> bool {
        let replicas = self.durable_replicas(o, parked);
        if replicas.is_empty() {
            return false;
        }
        journal::encode_object(
            out,
            key,
            o.size,
            o.checksum(),
            o.hard_pinned(),
            o.stored().version,
            replicas.into_iter(),
        );
        true
    }

    /// Segment `id` mounted in slot `idx`: the recovered replicas on it are
    /// taken back (their space allocated again, their objects readable),
    /// then the recovered holds on it.
    pub(super) fn attach_parked(&mut self, idx: u32, id: SegmentId, now_ms: u64) {
        let Some(mut d) = self.durable.take() else {
            return;
        };
        d.awaiting.remove(&id);
        if self.slot(idx).tier() == Tier::Dram {
            self.copies.forget_segment(id);
        }
        let keys: Vec<Box<[u8]>> = d
            .parked
            .iter()
            .filter(|(_, p)| p.waiting.iter().any(|w| w.0 == id))
            .map(|(k, _)| k.clone())
            .collect();
        for key in keys {
            let p = d.parked.get_mut(&key).expect("listed");
            let pos = p.waiting.iter().position(|w| w.0 == id).expect("listed");
            let (_, offset) = p.waiting.remove(pos);
            let (size, sum, hard_pin, version) = (p.size, p.sum, p.hard_pin, p.version);
            let taken = match self.slot(idx).tier() {
                Tier::Dram => {
                    let (lo, len) = (self.slot(idx).alloc.base(), self.slot(idx).alloc.capacity());
                    offset >= lo
                        && offset.saturating_add(size) <= lo + len
                        && self.slot_mut(idx).alloc.alloc_at(offset, size)
                }
                Tier::Nvme => self.check_loc(idx, offset).is_ok(),
            };
            let attached = taken
                && self.attach_replica(&key, idx, offset, size, sum, hard_pin, version, now_ms);
            if taken && !attached && self.slot(idx).tier() == Tier::Dram {
                self.slot_mut(idx).alloc.dealloc(offset, size);
            }
            if !attached {
                tracing::warn!(
                    key = %show_key(&key),
                    segment = format!("{id:016x}"),
                    offset,
                    "a recovered replica does not fit its segment as it mounted again: dropped"
                );
            }
            let p = d.parked.get_mut(&key).expect("listed");
            p.attached |= attached;
            // The record of this key no longer names the replica.
            self.objs.mark_dirty(&key);
            if p.waiting.is_empty() {
                d.parked.remove(&key);
            }
        }
        // Recovered copies on this tier of objects removed while they
        // waited: owed a Drop now (recorded with the next records).
        let mut drops = Vec::new();
        if self.slot(idx).tier() == Tier::Nvme && !d.removed_parked.is_empty() {
            d.removed_parked.retain(|key, (version, waiting)| {
                waiting.retain(|&mut (seg, loc)| {
                    if seg == id {
                        drops.push((key.clone(), loc, *version));
                    }
                    seg != id
                });
                !waiting.is_empty()
            });
        }
        if let Some(holds) = d.parked_holds.remove(&id) {
            if self.slot(idx).tier() == Tier::Dram {
                for h in holds {
                    let at_ms = h.until_unix_ms.saturating_sub(d.unix_at_zero_ms);
                    if at_ms <= now_ms {
                        continue;
                    }
                    for (offset, size) in
                        self.slot_mut(idx).alloc.alloc_free_within(h.offset, h.len)
                    {
                        self.pending.push(Reverse(PendingFree {
                            at_ms,
                            segment: id,
                            slot: idx,
                            offset,
                            size,
                        }));
                        d.holds.push(Hold {
                            segment: id,
                            offset,
                            len: size,
                            until_unix_ms: h.until_unix_ms,
                        });
                    }
                }
            }
        }
        self.durable = Some(d);
        // First: the removals came before any task the node has waiting
        // (a put of the key since, whose copy the Drop must not take).
        for (key, loc, version) in drops {
            self.owe_and_queue_drop(id, &key, loc, Some(version), true);
        }
    }

    /// Gives recovered object `key` a replica in slot `idx` (space taken);
    /// false when another object holds the key now.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attach_replica(
        &mut self,
        key: &[u8],
        idx: u32,
        offset: u64,
        size: u64,
        sum: Option<u64>,
        hard_pin: bool,
        version: u64,
        now_ms: u64,
    ) -> bool {
        if let Some(cid) = self.objs.complete_id(key) {
            let o = self.objs.get(cid);
            if o.size != size
                || o.checksum() != sum
                || o.stored().version != version
                || o.replicas.iter().any(|r| r.slot == idx)
            {
                return false;
            }
            self.objs
                .update(cid, |o| o.replicas.push(Replica::ready(idx, offset)));
            return true;
        }
        if self.objs.processing_id(key).is_some() || !self.objs.has_room() {
            return false;
        }
        // Readers may hold leases the restarted master never saw: the
        // object counts as leased for one lease from now.
        self.objs.insert(
            key,
            Object {
                size,
                phase: Phase::Complete(Complete {
                    lease_end_ms: now_ms.saturating_add(self.cfg.lease_ttl_ms),
                    unread: false,
                    pin_end_ms: 0,
                    sum: sum.unwrap_or(0),
                    has_sum: sum.is_some(),
                    hard_pin,
                    nvme_reads: 0,
                    version,
                }),
                replicas: smallvec::smallvec![Replica::ready(idx, offset)],
            },
        );
        true
    }

    /// Gives up the recovered replicas whose segments did not come back in
    /// time, as an unmount would, and records those segments gone.
    pub(super) fn expire_parked(&mut self, now_ms: u64) {
        let Some(d) = self.durable.as_mut() else {
            return;
        };
        if (d.parked.is_empty()
            && d.parked_holds.is_empty()
            && d.removed_parked.is_empty()
            && d.awaiting.is_empty())
            || now_ms < d.parked_until_ms
        {
            return;
        }
        let gone: Vec<SegmentId> = d.awaiting.drain().map(|(id, _)| id).collect();
        if !gone.is_empty() {
            tracing::info!(
                shard = self.shard,
                segments = gone.len(),
                "segments the state directory had mounted did not mount again in time: \
                 recorded gone"
            );
        }
        d.segments
            .extend(gone.into_iter().map(|id| (id, SegmentState::Gone)));
        d.removed_parked.clear();
        if !d.parked.is_empty() {
            tracing::warn!(
                shard = self.shard,
                objects = d.parked.len(),
                "recovered replicas whose segments did not mount again in time: dropped"
            );
        }
        d.parked_holds.clear();
        let parked: Vec<(Box<[u8]>, Parked)> = d.parked.drain().collect();
        for (k, p) in parked {
            self.objs.mark_dirty(&k);
            // A tier that comes back later still has these copies: taken
            // then, unless their object was removed or replaced (a tier not
            // listed adopts the others, but not a copy of a version this
            // shard's lineage handed out that is not detached).
            for (seg, loc) in p.waiting {
                self.detach(seg, &k, loc, Some(p.version));
            }
        }
    }

    /// Takes complete object `id`, which lost its last listed replica (an
    /// eviction, an `Evicted` copy, a segment gone), out of the store. A
    /// recovered object whose other replicas still wait for their segments
    /// waits for them again, as before any came back: what went was what
    /// was listed, and without the restart the object would have kept the
    /// others (an object with an NVMe copy loses only its DRAM replica to
    /// eviction). Dropping it took its NVMe copy too: refused as old when
    /// the tier reported it (unsummed simulation seed 4).
    pub(super) fn remove_replicaless(&mut self, id: Id) {
        let (key, _) = self.objs.remove(id);
        if let Some(p) = self
            .durable
            .as_mut()
            .and_then(|d| d.parked.get_mut(&key[..]))
        {
            if !p.waiting.is_empty() {
                p.attached = false;
            }
        }
    }

    /// Whether `key` is a recovered object none of whose replicas is back.
    pub(super) fn parked_only(&self, key: &[u8]) -> bool {
        self.parked_record(key).is_some()
    }

    /// The record of recovered object `key` while none of its replicas is
    /// back: (size, checksum, hard pin, version).
    pub(super) fn parked_record(&self, key: &[u8]) -> Option<(u64, Option<u64>, bool, u64)> {
        let d = self.durable.as_ref()?;
        let p = d.parked.get(key).filter(|p| !p.attached)?;
        Some((p.size, p.sum, p.hard_pin, p.version))
    }

    /// Takes tier slot `idx`'s copy at `loc` as recovered object `key`'s
    /// (none of its replicas was back): the object is in the store from now
    /// on, and its replicas still waiting join it when they mount. False
    /// when there is no room for it.
    pub(super) fn attach_parked_copy(
        &mut self,
        key: &[u8],
        idx: u32,
        loc: u64,
        now_ms: u64,
    ) -> bool {
        let Some((size, sum, hard_pin, version)) = self.parked_record(key) else {
            return false;
        };
        if !self.attach_replica(key, idx, loc, size, sum, hard_pin, version, now_ms) {
            return false;
        }
        if let Some(p) = self.durable.as_mut().and_then(|d| d.parked.get_mut(key)) {
            p.attached = true;
        }
        true
    }

    pub(super) fn recovering(key: &[u8]) -> KvError {
        err(
            ErrorCode::ReplicaNotReady,
            format!(
                "key {} is being recovered: its segments have not mounted again yet",
                show_key(key)
            ),
        )
    }

    /// Appends to `out` the next part of a snapshot of this shard's durable
    /// state (at most `budget` objects); returns whether it is complete.
    /// The state may change between steps: each key's record is its state
    /// at some time after the log was rotated, and the new log, replayed
    /// over the snapshot, ends in the state as it is.
    pub fn snapshot_step(
        &self,
        cur: &mut SnapshotCursor,
        budget: usize,
        out: &mut Vec<u8>,
    ) -> bool {
        let Some(d) = self.durable.as_ref() else {
            return true;
        };
        if cur.done {
            return true;
        }
        let end = self.objs.slab_len();
        let mut n = 0;
        while (cur.next_id as usize) < end && n < budget {
            let id = cur.next_id;
            cur.next_id += 1;
            let Some((key, o)) = self.objs.entry_at(id) else {
                continue;
            };
            n += 1;
            match o.phase {
                Phase::Complete(_) => {
                    self.encode_complete(key, o, d.parked.get(key), out);
                }
                Phase::Processing(ref p) => {
                    let until = self.write_hold_until(p.started_ms);
                    for r in &o.replicas {
                        self.encode_hold(d, r.slot, r.offset, o.size, until, out);
                    }
                }
            }
            // A promotion's range is written by a node.
            for r in o
                .replicas
                .iter()
                .filter(|r| r.state == ReplicaState::Promoting)
            {
                let until = self.write_hold_until(o.complete().map_or(0, |c| c.lease_end_ms));
                self.encode_hold(d, r.slot, r.offset, o.size, until, out);
            }
        }
        if (cur.next_id as usize) < end {
            return false;
        }
        for (key, p) in &d.parked {
            if !p.attached && !p.waiting.is_empty() {
                encode_parked(key, p, out);
            }
        }
        for h in d.parked_holds.values().flatten() {
            journal::encode_hold(out, h);
        }
        for (nvme, key, loc, version) in self.copies.all_owed() {
            journal::encode_drop_owed(out, nvme, key, loc, version);
        }
        for nvme in self.copies.listed() {
            journal::encode_tier_listed(out, nvme);
        }
        // Segments mounted, then those still awaiting their remount.
        for s in self.slots.iter().flatten() {
            journal::encode_segment(out, s.id, s.recorded_state());
        }
        for (&id, &state) in &d.awaiting {
            journal::encode_segment(out, id, state);
        }
        // The lineage's first epoch, then the current one: the image keeps
        // the earliest and the latest.
        if self.first_epoch != self.epoch {
            journal::encode_epoch(out, self.first_epoch);
        }
        journal::encode_epoch(out, self.epoch);
        for Reverse(p) in &self.pending {
            if let Some(Some(s)) = self.slots.get(p.slot as usize) {
                if s.id == p.segment {
                    journal::encode_hold(
                        out,
                        &Hold {
                            segment: p.segment,
                            offset: p.offset,
                            len: s.alloc.rounded(p.size),
                            until_unix_ms: d.unix_at_zero_ms.saturating_add(p.at_ms),
                        },
                    );
                }
            }
        }
        cur.done = true;
        true
    }

    pub(super) fn encode_hold(
        &self,
        d: &Durable,
        slot: u32,
        offset: u64,
        size: u64,
        until_ms: u64,
        out: &mut Vec<u8>,
    ) {
        let s = self.slot(slot);
        if s.tier() == Tier::Dram {
            journal::encode_hold(
                out,
                &Hold {
                    segment: s.id,
                    offset,
                    len: s.alloc.rounded(size),
                    until_unix_ms: d.unix_at_zero_ms.saturating_add(until_ms),
                },
            );
        }
    }

    /// The durable state as the state directory would record it: every
    /// complete object (with the replicas still waiting for their
    /// segments) and every recovered one not back yet. For tests.
    pub fn durable_image(&self) -> HashMap<Vec<u8>, ObjectRec> {
        let mut m = HashMap::new();
        let d = self.durable.as_deref();
        for id in self.objs.complete_ids() {
            let key = self.objs.key(id);
            let o = self.objs.get(id);
            let mut replicas = self
                .durable_replicas(o, d.and_then(|d| d.parked.get(key)))
                .to_vec();
            if replicas.is_empty() {
                continue;
            }
            replicas.sort_unstable();
            m.insert(
                key.to_vec(),
                ObjectRec {
                    size: o.size,
                    sum: o.checksum(),
                    hard_pin: o.hard_pinned(),
                    version: o.stored().version,
                    replicas,
                },
            );
        }
        for (key, p) in d.iter().flat_map(|d| d.parked.iter()) {
            if !p.attached {
                let mut replicas: Vec<_> = p.waiting.to_vec();
                replicas.sort_unstable();
                m.insert(
                    key.to_vec(),
                    ObjectRec {
                        size: p.size,
                        sum: p.sum,
                        hard_pin: p.hard_pin,
                        version: p.version,
                        replicas,
                    },
                );
            }
        }
        m
    }

    /// The recovered replicas of `key` still waiting for their segments
    /// belong to an object removed or replaced now: those on an NVMe tier
    /// are owed a Drop when the tier mounts again (until then nothing says
    /// which waiting segments are tiers).
    pub(super) fn retire_parked(&mut self, key: &[u8]) {
        self.retire_detached(key);
        let Some(d) = self.durable.as_mut() else {
            return;
        };
        if let Some(p) = d.parked.remove(key) {
            if !p.waiting.is_empty() {
                d.removed_parked.insert(key.into(), (p.version, p.waiting));
            }
        }
    }
}
