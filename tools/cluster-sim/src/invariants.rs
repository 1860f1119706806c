//! What the world checks: after every event ([`World::check`]), after the
//! master handled a request ([`World::after_master`]) and when a node's
//! DRAM segment or tier comes back to a restarted master
//! ([`World::check_owed`]).

use super::*;
use crate::trace::replicas_of;

impl World {
    /// The content of a DRAM range of a live node, if it serves `seg`.
    pub(crate) fn dram_content(&self, seg: SegmentId, offset: u64, len: u64) -> Option<Content> {
        let &n = self.ctx.seg_node.get(&seg)?;
        let node = &self.nodes[n];
        node.serves(seg)
            .then(|| node.dram_read(seg, offset, len))
            .flatten()
    }

    /// After the master handled something: the keys it no longer lists
    /// must have lost every live replica, unless `removes` says a client
    /// removed them.
    pub(crate) fn after_master(&mut self, what: &str, removes: Option<Vec<Vec<u8>>>) {
        let now = self.describe_all();
        let before = std::mem::replace(&mut self.snap, now);
        // A recovered object listed again (through any of its segments)
        // owes nothing more on its DRAM replicas: from now on it is
        // checked as every listed object is (an eviction may take it).
        let listed =
            |k: &[u8], snap: &Snap| snap.iter().flatten().any(|i| i.complete && i.key == k);
        let snap = &self.snap;
        self.owed
            .retain(|o| o.tier != Tier::Dram || !listed(&o.key, snap));
        if what == "evict step" || what == "tick" {
            for (old, new) in before.iter().zip(&self.snap) {
                let (o, n) = (replicas_of(old), replicas_of(new));
                if o != n {
                    let k = old.as_ref().or(new.as_ref()).map(|i| i.key.clone());
                    let k = String::from_utf8_lossy(&k.unwrap_or_default()).into_owned();
                    self.ctx.note(format!("{what}: {k} {o} -> {n}"));
                }
            }
        }
        for (i, old) in before.iter().enumerate() {
            let Some(old) = old.as_ref().filter(|o| o.complete) else {
                continue;
            };
            if self.snap[i].as_ref().is_some_and(|n| n.complete) {
                continue;
            }
            if removes.as_ref().is_some_and(|r| r.contains(&old.key)) {
                continue;
            }
            // Eviction (off the path, or a put that finds no room) and
            // NVMe reports legitimately drop DRAM replicas; nothing drops a
            // live NVMe copy but its tier (Evicted) or a removal; a tick
            // drops what sat on segments it expired.
            let dram_may_go = what == "evict step"
                || what == "tick"
                || what.starts_with("nvme")
                || what.starts_with("put_start")
                || what.starts_with("batch_put_start");
            for r in &old.replicas {
                let live = match r.tier {
                    Tier::Dram => !dram_may_go && self.segment_alive(r.segment_id),
                    Tier::Nvme => {
                        self.segment_mounted(r.segment_id)
                            && self.tier_holds(r.segment_id, r.offset, &old.key)
                    }
                };
                if live {
                    self.ctx.fail(format!(
                        "{what} lost key {} though its {:?} replica (segment {:016x}, offset \
                         {}) is live",
                        String::from_utf8_lossy(&old.key),
                        r.tier,
                        r.segment_id,
                        r.offset
                    ));
                }
            }
        }
    }

    fn segment_mounted(&mut self, seg: SegmentId) -> bool {
        let Some(m) = self.master.as_mut() else {
            return false;
        };
        match m.call(MasterRequest::Stat, self.ctx.now) {
            Ok(MasterResponse::Stat(s)) => s.segments.iter().any(|x| x.id == seg),
            _ => false,
        }
    }

    /// Whether the tier `seg` durably holds `key`'s copy at `loc` (its node
    /// may be down: the copy is on its disk).
    fn tier_holds(&self, seg: SegmentId, loc: u64, key: &[u8]) -> bool {
        self.ctx
            .seg_node
            .get(&seg)
            .is_some_and(|&n| self.nodes[n].tier_holds(seg, loc, key))
    }

    /// After node `i` reported its whole tier to the master: what the
    /// master listed with an NVMe copy there before it crashed is listed
    /// again (unless a client put or removed the key since).
    /// Node `i` mounted its DRAM segment again or reported its tier: the
    /// objects owed on them must be listed.
    pub(crate) fn check_owed(&mut self, i: usize, back: Tier) {
        if self.master.is_none() {
            // The answer to the mount (or report) outlived the master that
            // gave it: what that master listed went with it, and the
            // owed list, taken again at its crash, waits for the next one.
            return;
        }
        let seg = match back {
            Tier::Dram => Some(self.nodes[i].dram_segment()),
            Tier::Nvme => self.nodes[i].tier_segment(),
        };
        let in_time = self.ctx.now < self.parked_until;
        let owed: Vec<Owed> = self
            .owed
            .extract_if(.., |o| o.tier == back && Some(o.seg) == seg)
            .collect();
        if owed.is_empty() {
            return;
        }
        self.snap = self.describe_all();
        for o in owed {
            let holds = match o.tier {
                // Nothing writes a node's memory while its segment is
                // unknown to the master; one mounted after the recovered
                // replicas expired has nothing to come back.
                Tier::Dram => in_time,
                Tier::Nvme => self.nodes[i].tier_holds(o.seg, o.loc, &o.key),
            };
            if self.touched.contains(&o.key) || !holds {
                continue;
            }
            self.ctx.stats.owed_checked += 1;
            let k = self
                .keys
                .iter()
                .position(|k| *k == o.key)
                .expect("a sim key");
            if !self.snap[k].as_ref().is_some_and(|n| n.complete) {
                self.ctx.fail(format!(
                    "key {} had a {:?} replica before the master restarted and its node \
                     mounted or reported it again, but the master does not list it",
                    String::from_utf8_lossy(&o.key),
                    o.tier
                ));
            }
        }
    }

    pub(crate) fn describe_all(&self) -> Snap {
        let Some(m) = self.master.as_ref() else {
            return vec![None; KEYS];
        };
        self.keys
            .iter()
            .map(|k| m.shards[m.shard_of(k)].describe(k, self.ctx.now).ok())
            .collect()
    }

    /// The invariants, after every event.
    pub(crate) fn check(&mut self) {
        let now = self.ctx.now;
        // Allocator totals balance; every shard's extents are disjoint.
        if let Some(m) = self.master.as_ref() {
            for (i, sh) in m.shards.iter().enumerate() {
                if let Err(e) = sh.check_invariants() {
                    self.ctx.fail(format!("master shard {i}: {e}"));
                }
            }
            // A removed key does not come back at a version its removal
            // took away (an old copy reported again, before or after a
            // restart); a put after the removal lists a newer one.
            for (k, &gone) in self.keys.iter().zip(&self.removed) {
                let Some(gone) = gone else { continue };
                if let Some(v) = version_of(m, k).filter(|&v| v <= gone) {
                    self.ctx.fail(format!(
                        "key {} is listed again at version {v:#x}, though a client's removal \
                         took version {gone:#x} away",
                        String::from_utf8_lossy(k)
                    ));
                }
            }
        }
        // No extent owned twice, across shards; every replica listed holds
        // its object's bytes (checksums verified against the master's).
        let mut dram: HashMap<SegmentId, Vec<(u64, u64, usize)>> = HashMap::new();
        let mut nvme: HashMap<(SegmentId, u64), usize> = HashMap::new();
        let snap = std::mem::take(&mut self.snap);
        for (k, info) in snap.iter().enumerate() {
            let Some(info) = info else { continue };
            for r in &info.replicas {
                match r.tier {
                    Tier::Dram => {
                        dram.entry(r.segment_id)
                            .or_default()
                            .push((r.offset, r.len.max(1), k))
                    }
                    Tier::Nvme => {
                        if let Some(other) = nvme.insert((r.segment_id, r.offset), k) {
                            self.ctx.fail(format!(
                                "NVMe location {:016x}/{} listed for keys {} and {}",
                                r.segment_id, r.offset, other, k
                            ));
                        }
                    }
                }
                if !info.complete {
                    continue;
                }
                let held = match r.tier {
                    Tier::Dram => {
                        if !self.segment_alive(r.segment_id) {
                            continue;
                        }
                        self.dram_content(r.segment_id, r.offset, r.len).flatten()
                    }
                    Tier::Nvme => {
                        let Some(&n) = self.ctx.seg_node.get(&r.segment_id) else {
                            continue;
                        };
                        if !self.nodes[n].up {
                            continue;
                        }
                        self.nodes[n].tier_content(r.offset, &info.key)
                    }
                };
                let right = self.ctx.is_value_of(held, &info.key)
                    && info.replicas[0].checksum.is_none_or(|s| s == sum_of(held));
                if !right {
                    let whose = held
                        .and_then(|t| self.ctx.tag_key.get(t as usize))
                        .map(|k| String::from_utf8_lossy(k).into_owned());
                    self.ctx.fail(format!(
                        "the master lists a {:?} replica of {} (segment {:016x}, offset {}) \
                         that holds {held:?} (a value of {whose:?}), not its bytes",
                        r.tier,
                        String::from_utf8_lossy(&info.key),
                        r.segment_id,
                        r.offset
                    ));
                }
            }
        }
        self.snap = snap;
        for (seg, mut v) in dram {
            v.sort_unstable();
            for w in v.windows(2) {
                if w[0].0 + w[0].1 > w[1].0 {
                    self.ctx.fail(format!(
                        "DRAM extents overlap in segment {seg:016x}: keys {} at {}+{} and {} \
                         at {}",
                        w[0].2, w[0].0, w[0].1, w[1].2, w[1].0
                    ));
                }
            }
        }
        // A leased range is never handed out again: its bytes stay.
        let epoch = self.master_epoch;
        self.leases.retain(|l| l.4 > now && l.5 == epoch);
        for i in 0..self.leases.len() {
            let (seg, off, len, c, _, _) = self.leases[i];
            if !self.segment_alive(seg) {
                continue;
            }
            let held = self.dram_content(seg, off, len);
            if held != Some(c) {
                self.ctx.fail(format!(
                    "a leased DRAM range (segment {seg:016x}, offset {off}, {len} bytes) \
                     changed from {c:?} to {held:?} before its lease ended"
                ));
            }
        }
        // Every call ends by its deadline.
        for c in &self.clients {
            if let Some(d) = c.open_deadline() {
                if now > d {
                    self.ctx.fail(format!(
                        "client {} has a call open past its deadline",
                        c.idx
                    ));
                }
            }
        }
        for n in &self.nodes {
            let forgotten = n.forgotten_marks();
            if !forgotten.is_empty() {
                self.ctx.fail(format!(
                    "node {}'s tier holds copies marked evicting that nothing will free \
                     (slots {forgotten:?})",
                    n.idx
                ));
            }
            if let Some(d) = n.open_deadline() {
                if now > d {
                    self.ctx
                        .fail(format!("node {} has a call open past its deadline", n.idx));
                }
            }
        }
    }
}
