//! What one shard knows of the copies on NVMe tiers that no object lists
//! (issue 32): the Drops each tier is owed (those handed out to a tier not
//! listed yet among them), which tiers are listed (every live copy known)
//! or still adopted, and the copies detached with a tier unmounted as dead. Data and its own
//! invariant check; the rules that use it (what a `Recovered` copy is, when
//! a Drop is queued) are `tier.rs`'s, and the state directory's records of
//! it are the caller's (each change that is recorded says so).

use crate::objects::{Map, Set};

use kvpool_wire::proto::SegmentId;

use super::limits::{MAX_DETACHED_COPIES, MAX_TASKS_PER_SEGMENT};

/// A copy on an NVMe tier: (key, packed location).
pub(super) type CopyAt = (Box<[u8]>, u64);

/// Where a detached copy is and its object's version: (packed location,
/// version; `None`: the object was not complete).
type DetachedAt = (u64, Option<u64>);

/// What a copy an NVMe tier reports is to the shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Unlisted {
    /// An object lists it.
    Listed,
    /// Of a tier not listed yet: taken on its word.
    Adopted,
    /// Its object's when its tier was unmounted as dead, and still.
    Detached,
    /// An old copy: refused.
    Old,
}

/// The Drops one NVMe tier's node is owed (removed or replaced objects'
/// copies). A Drop handed out to a tier not listed yet stays owed until the
/// tier is listed: the node may report such a copy (`Recovered`, from a
/// report of its whole tier running beside its task rounds, or after a
/// restart of either side) before it runs the Drop, and only the owed set
/// tells that copy from one an adopted tier may bring back. On a listed
/// tier an unnamed copy is old anyway, so a Drop is owed no more once it
/// went out there.
#[derive(Debug, Default)]
struct TierDrops {
    /// With the copy's version (`None`: owed from a record that named
    /// none).
    owed: Map<CopyAt, Option<u64>>,
    /// The owed copies whose Drop went out already (to a tier not listed
    /// yet): settled when the tier is listed. In memory only: after a
    /// restart they go out again.
    handed: Set<CopyAt>,
}

impl TierDrops {
    /// `c` is owed no Drop any more. Whether it was owed.
    fn forget(&mut self, c: &CopyAt) -> bool {
        self.handed.remove(c);
        self.owed.remove(c).is_some()
    }

    fn is_empty(&self) -> bool {
        self.owed.is_empty()
    }
}

/// The copy book of one shard's NVMe tiers.
#[derive(Debug, Default)]
pub(super) struct Copies {
    /// The copies (key, location) of removed or replaced objects whose Drop
    /// has not gone out to their node yet (or went out to a tier not listed
    /// yet: [`TierDrops`]), by tier. Kept apart from the
    /// task queues, which go with their DRAM segment: a node that comes back
    /// (or a restarted master, from its state directory) is owed them
    /// still, and a `Recovered` report of such a copy is refused.
    drops: Map<SegmentId, TierDrops>,
    /// Tiers every live copy of which this shard lists (an object's
    /// replica, a copy detached with its tier, or one owed a Drop): a copy
    /// such a tier reports that none of these names is an old one and is
    /// refused. Recorded (`TierListed`).
    listed: Set<SegmentId>,
    /// Tiers mounted that this shard does not list yet (new to it, or any
    /// tier after a restart without a state directory): the copies they
    /// report are taken as they come, until `tier_quiet_ms` passed with no
    /// report (the time here); then the tier is listed.
    adopting: Map<SegmentId, u64>,
    /// Copies on listed tiers unmounted as dead (their node was cut off):
    /// the shard forgot them as replicas, but a tier that comes back may
    /// report them and they are taken, unless their object was removed or
    /// replaced since (then they are owed a Drop). By tier, then key: the
    /// location and the object's version (`None`: not complete).
    detached: Map<SegmentId, Map<Box<[u8]>, DetachedAt>>,
    /// Copies in `detached`.
    detached_len: usize,
}

impl Copies {
    // ---- owed Drops ----

    /// Owes tier `nvme` a Drop of `key`'s copy at `loc` at `version`:
    /// `None` when the tier is owed its maximum already, else whether it is
    /// new (to record). A Drop owed in that slot before is of a copy a later
    /// one overwrote: this one, of the later copy, replaces it.
    pub fn owe(
        &mut self,
        nvme: SegmentId,
        key: &[u8],
        loc: u64,
        version: Option<u64>,
    ) -> Option<bool> {
        let t = self.drops.entry(nvme).or_default();
        let c: CopyAt = (key.into(), loc);
        if let Some(v) = t.owed.get_mut(&c) {
            let new = *v != version;
            *v = version;
            // Queued again: it has not gone out (to a tier still adopted)
            // until it goes out again.
            t.handed.remove(&c);
            return Some(new);
        }
        if t.owed.len() >= MAX_TASKS_PER_SEGMENT {
            return None;
        }
        t.owed.insert(c, version);
        Some(true)
    }

    /// The Drop of `nvme`'s copy of `key` at `loc` went out to the node
    /// (`sent`), or the copy is an object's again: it is owed no more, but
    /// one that went out to a tier not listed yet stays owed until the tier
    /// is listed. Whether it was owed and is no more (to record).
    pub fn settle(&mut self, nvme: SegmentId, key: &[u8], loc: u64, sent: bool) -> bool {
        let listed = self.listed.contains(&nvme);
        let Some(t) = self.drops.get_mut(&nvme) else {
            return false;
        };
        let c: CopyAt = (key.into(), loc);
        if sent && !listed {
            if t.owed.contains_key(&c) {
                t.handed.insert(c);
            }
            return false;
        }
        let was_owed = t.forget(&c);
        if t.is_empty() {
            self.drops.remove(&nvme);
        }
        was_owed
    }

    /// Whether `key`'s copy at `loc` of tier `nvme` is owed a Drop (maybe
    /// handed out already, to a tier not listed yet).
    pub fn is_dropped(&self, nvme: SegmentId, key: &[u8], loc: u64) -> bool {
        self.drops
            .get(&nvme)
            .is_some_and(|t| t.owed.contains_key(&(Box::<[u8]>::from(key), loc)))
    }

    /// The copies tier `nvme` is owed a Drop of, with their versions.
    pub fn owed(&self, nvme: SegmentId) -> impl Iterator<Item = (&CopyAt, Option<u64>)> {
        self.drops
            .get(&nvme)
            .into_iter()
            .flat_map(|t| t.owed.iter().map(|(c, &v)| (c, v)))
    }

    /// Every owed Drop: (tier, key, location, version), for a snapshot.
    pub fn all_owed(&self) -> impl Iterator<Item = (SegmentId, &[u8], u64, Option<u64>)> {
        self.drops
            .iter()
            .flat_map(|(&n, t)| t.owed.iter().map(move |((k, l), &v)| (n, &k[..], *l, v)))
    }

    // ---- listed and adopted tiers ----

    pub fn is_listed(&self, nvme: SegmentId) -> bool {
        self.listed.contains(&nvme)
    }

    /// Every listed tier, for a snapshot.
    pub fn listed(&self) -> impl Iterator<Item = SegmentId> + '_ {
        self.listed.iter().copied()
    }

    /// Tier `nvme` mounted: adopted until `until_ms` unless listed.
    pub fn mounted(&mut self, nvme: SegmentId, until_ms: u64) {
        if !self.listed.contains(&nvme) {
            self.adopting.insert(nvme, until_ms);
        }
    }

    /// Whether tier `nvme` is still adopted after a report at `now_ms`
    /// (which keeps it so until `next_ms`); false: it is to be listed.
    pub fn adopts(&mut self, nvme: SegmentId, now_ms: u64, next_ms: u64) -> bool {
        if self.listed.contains(&nvme) {
            return false;
        }
        let until = self.adopting.entry(nvme).or_insert(next_ms);
        if now_ms < *until {
            *until = next_ms;
            return true;
        }
        false
    }

    /// Lists tier `nvme`: whether it is new (to record), and the copies
    /// whose Drops went out while it was adopted, owed no more (to record).
    pub fn list(&mut self, nvme: SegmentId) -> (bool, Vec<CopyAt>) {
        self.adopting.remove(&nvme);
        let new = self.listed.insert(nvme);
        let mut settled = Vec::new();
        if let Some(t) = self.drops.get_mut(&nvme) {
            for c in std::mem::take(&mut t.handed) {
                t.owed.remove(&c);
                settled.push(c);
            }
            if t.is_empty() {
                self.drops.remove(&nvme);
            }
        }
        (new, settled)
    }

    /// Tiers adopted with no report since `now_ms`: to be listed.
    pub fn quiet(&self, now_ms: u64) -> Vec<SegmentId> {
        self.adopting
            .iter()
            .filter(|&(_, &until)| until <= now_ms)
            .map(|(&t, _)| t)
            .collect()
    }

    // ---- detached copies ----

    /// Remembers `key`'s copy at `loc` of tier `nvme`, which the shard no
    /// longer counts as a replica (the tier is unmounted, or a recovered
    /// replica's segment, maybe a DRAM one, did not mount again in time),
    /// a copy of its object at `version`; false when the book is full.
    pub fn detach(&mut self, nvme: SegmentId, key: &[u8], loc: u64, version: Option<u64>) -> bool {
        if self.detached_len >= MAX_DETACHED_COPIES {
            return false;
        }
        if self
            .detached
            .entry(nvme)
            .or_default()
            .insert(key.into(), (loc, version))
            .is_none()
        {
            self.detached_len += 1;
        }
        true
    }

    /// A reported copy of `key` at `loc` at `version` on tier `nvme` that
    /// no object lists: `Detached` (and forgotten as detached) if it is the
    /// copy detached there (that location, and that version where its
    /// object had one), else `Old` (and the detached copy still awaited).
    pub fn take_detached(
        &mut self,
        nvme: SegmentId,
        key: &[u8],
        loc: u64,
        version: u64,
    ) -> Unlisted {
        let Some(t) = self.detached.get_mut(&nvme) else {
            return Unlisted::Old;
        };
        match t.get(key) {
            Some(&(at, v)) if at == loc && v.is_none_or(|v| v == version) => {}
            _ => return Unlisted::Old,
        }
        t.remove(key);
        self.detached_len -= 1;
        if t.is_empty() {
            self.detached.remove(&nvme);
        }
        Unlisted::Detached
    }

    /// `key`'s object was removed or replaced: its detached copies, forgotten
    /// here; those on listed tiers as (tier, location, version), each to be
    /// owed a Drop. (A segment not listed may be a DRAM one, never owed a
    /// Drop; a tier not listed refuses the copy by its version.)
    pub fn retire(&mut self, key: &[u8]) -> Vec<(SegmentId, u64, Option<u64>)> {
        let mut out = Vec::new();
        if self.detached.is_empty() {
            return out;
        }
        let mut gone = 0;
        self.detached.retain(|&nvme, t| {
            if let Some((loc, version)) = t.remove(key) {
                gone += 1;
                if self.listed.contains(&nvme) {
                    out.push((nvme, loc, version));
                }
            }
            !t.is_empty()
        });
        self.detached_len -= gone;
        out
    }

    /// DRAM segment `id` mounted: what was detached under its id (recovered
    /// replicas given up before it came back) is forgotten; a DRAM copy
    /// never comes back as a tier's.
    pub fn forget_segment(&mut self, id: SegmentId) {
        if let Some(t) = self.detached.remove(&id) {
            self.detached_len -= t.len();
        }
    }

    /// The keys of every detached copy.
    pub fn detached_keys(&self) -> Vec<Box<[u8]>> {
        self.detached
            .values()
            .flat_map(|t| t.keys().cloned())
            .collect()
    }

    // ---- a restart's image ----

    /// What a state directory's image said: listed tiers, owed Drops.
    pub fn restore(
        &mut self,
        listed: impl IntoIterator<Item = SegmentId>,
        owed: impl IntoIterator<Item = ((SegmentId, Vec<u8>, u64), Option<u64>)>,
    ) {
        self.listed.extend(listed);
        for ((nvme, key, loc), version) in owed {
            self.drops
                .entry(nvme)
                .or_default()
                .owed
                .insert((key.into_boxed_slice(), loc), version);
        }
    }

    /// The book's own invariants: the detached count, no empty entry, no
    /// tier both listed and adopted, a Drop that went out and is still owed
    /// only on a tier not listed, the bounds.
    pub fn check(&self) -> Result<(), String> {
        let detached: usize = self.detached.values().map(Map::len).sum();
        if detached != self.detached_len || self.detached.values().any(Map::is_empty) {
            return Err(format!(
                "{detached} detached copies counted as {} (or an empty tier entry)",
                self.detached_len
            ));
        }
        if detached > MAX_DETACHED_COPIES {
            return Err(format!("{detached} detached copies, over the bound"));
        }
        if let Some(t) = self.adopting.keys().find(|t| self.listed.contains(t)) {
            return Err(format!("tier {t:016x} is listed and still being adopted"));
        }
        for (nvme, t) in &self.drops {
            if t.is_empty() {
                return Err(format!("tier {nvme:016x} has an empty entry of Drops"));
            }
            if let Some((k, _)) = t.handed.iter().find(|c| !t.owed.contains_key(*c)) {
                return Err(format!(
                    "tier {nvme:016x}: the Drop of {}'s copy went out but is not owed",
                    kvpool_wire::proto::show_key(k)
                ));
            }
            if !t.handed.is_empty() && self.listed.contains(nvme) {
                return Err(format!(
                    "tier {nvme:016x} is listed and still holds Drops that went out"
                ));
            }
            if t.owed.len() > MAX_TASKS_PER_SEGMENT {
                return Err(format!(
                    "tier {nvme:016x} is owed {} Drops, over the bound",
                    t.owed.len()
                ));
            }
        }
        Ok(())
    }
}
