//! Hot-object replication: extra DRAM replicas, on other nodes, of objects
//! read often (`master.hot_replicas` >= 2; off by default).
//!
//! * Every read of a complete object (`get_replica_list`) is counted in a
//!   window of `hot_window_ms`; the counts are one bounded map per shard,
//!   emptied when the window turns (no field in the object).
//! * An object read `hot_reads` times in a window is hot: if it has fewer
//!   than `hot_replicas` DRAM replicas, none of them being filled, it gets one
//!   more, in the emptiest DRAM segment of a node that holds none of them,
//!   while the shard's extra replicas stay within `hot_budget` of its DRAM.
//!   Its count starts again, so a hot object that found no room tries again
//!   `hot_reads` reads later.
//! * The new replica is `Promoting` (unreadable, held like a promotion's
//!   range) until its node has fetched the bytes: a `Fetch` task names the
//!   object's DRAM replicas with read grants (and extends the object's read
//!   lease over the fetch; both are renewed when the node takes the task,
//!   which may have waited in its queue), the node reads one, checks the bytes against the
//!   object's checksum, writes them into the range and answers `Promoted`.
//!   An object without a checksum is never replicated: the node could not
//!   check what it copies.
//! * Reads then spread: each answer turns the object's DRAM replicas by its read count
//!   (clients take the first DRAM replica, their own host's first).
//! * An extra replica is evicted before every other replica of its range
//!   once its lease ends, and dropped (never demoted). It is memory only:
//!   the state directory records it as a plain replica.

use kvpool_wire::proto::{FetchTask, NodeTask, ReplicaDesc, Tier};

use super::*;

/// Fills whose report is awaited, by when it is due (in order: every fill
/// is due `put_timeout_ms` after it was asked for).
#[derive(Debug, Default)]
pub(super) struct Filling {
    q: std::collections::VecDeque<(u64, Box<[u8]>, u32, u64)>,
}

/// Reads per object in the current window.
#[derive(Debug, Default)]
pub(super) struct ReadCounts {
    window: u64,
    counts: Map<Id, u16>,
}

impl ShardState {
    /// Turns the DRAM replicas of a read's answer by the object's read
    /// count `n`, so its successive readers start at each replica in turn
    /// (a count per object: a shard-wide one would send two objects read
    /// together to the same node every time).
    pub(super) fn spread_reads(&mut self, descs: &mut [ReplicaDesc], n: Option<u16>) {
        let dram = descs.iter().take_while(|d| d.tier == Tier::Dram).count();
        if dram > 1 {
            let turn = match n {
                Some(n) => n as usize,
                None => {
                    self.spread = self.spread.wrapping_add(1);
                    self.spread as usize
                }
            };
            descs[..dram].rotate_left(turn % dram);
        }
    }

    /// Counts a read of complete object `id` and returns its count in this
    /// window (`None`: not counted, the map is full); a hot one may get a
    /// replica.
    pub(super) fn count_read(&mut self, id: Id, now_ms: u64) -> Option<u16> {
        let window = now_ms / self.cfg.hot_window_ms.max(1);
        let r = &mut self.reads;
        if r.window != window {
            r.window = window;
            r.counts.clear();
        }
        let room = r.counts.len() < MAX_COUNTED_READS;
        let n = match r.counts.get_mut(&id) {
            Some(n) => {
                *n = n.saturating_add(1);
                *n
            }
            None if room => {
                r.counts.insert(id, 1);
                1
            }
            None => return None,
        };
        if n >= self.cfg.hot_reads {
            r.counts.insert(id, 0);
            self.replicate(id, now_ms);
        }
        Some(n)
    }

    /// Gives hot object `id` one more DRAM replica, if it may have one and
    /// there is a place for it (see the module doc).
    fn replicate(&mut self, id: Id, now_ms: u64) {
        let obj = self.objs.get(id);
        let Some(checksum) = obj.checksum() else {
            return;
        };
        let size = obj.size;
        let mut dram = 0;
        let mut owners = Vec::new();
        for r in &obj.replicas {
            let s = self.slot(r.slot);
            if s.tier() != Tier::Dram {
                continue;
            }
            if r.state == ReplicaState::Promoting {
                return;
            }
            dram += 1;
            owners.push(s.owner);
        }
        if dram == 0 || dram >= self.cfg.hot_replicas as usize {
            return;
        }
        let capacity: u64 = self
            .slots
            .iter()
            .flatten()
            .filter(|s| s.tier() == Tier::Dram)
            .map(|s| s.alloc.capacity())
            .sum();
        if (self.objs.extra_bytes() + size) as f64 > self.cfg.hot_budget * capacity as f64 {
            return;
        }
        let target = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                let s = s.as_ref()?;
                let fits = s.takes(size)
                    && !owners.contains(&s.owner)
                    && self
                        .tasks
                        .get(&s.id)
                        .is_none_or(|q| q.len() < MAX_TASKS_PER_SEGMENT);
                fits.then_some((i as u32, s.free_ratio()))
            })
            .max_by(|a, b| a.1.total_cmp(&b.1).then(b.0.cmp(&a.0)));
        let Some((idx, _)) = target else {
            return;
        };
        let offset = self
            .slot_mut(idx)
            .alloc
            .alloc(size)
            .expect("the target's largest free extent fits");
        // The node reads a replica under a lease that covers the fetch, and
        // writes the range until then: held as a put's grant is.
        let until_ms = now_ms + self.cfg.lease_ttl_ms;
        self.objs.update(id, |o| o.extend_lease(until_ms));
        let hold = self.write_hold_until(until_ms);
        self.hold(idx, offset, size, hold);
        let obj = self.objs.get(id);
        let from: Vec<ReplicaDesc> = describe(
            &self.slots,
            obj,
            self.signer.as_ref(),
            Access::Read { until_ms },
            self.term(),
        )
        .into_iter()
        .filter(|d| d.tier == Tier::Dram)
        .collect();
        let task = NodeTask::Fetch(FetchTask {
            key: self.objs.key(id).to_vec(),
            from,
            dram: self.slot(idx).id,
            offset,
            len: size,
            checksum,
        });
        let seg = self.slot(idx).id;
        self.tasks.entry(seg).or_default().push_back(task);
        self.objs
            .update(id, |o| o.replicas.push(Replica::filling(idx, offset, true)));
        self.fill_due(id, idx, offset, now_ms);
    }

    /// A Fetch task handed out to its node at `now_ms`: the read lease on
    /// its object and its sources' read grants run from now, as a get's
    /// would. A task can wait in its node's queue past the lease it was
    /// queued with (a node that polls late, a long queue): its grants would
    /// be refused as expired, and its sources could have been evicted and
    /// their ranges reused under its reads. The sources are the object's
    /// DRAM replicas now.
    pub(super) fn renew_fetch(&mut self, f: &mut FetchTask, now_ms: u64) {
        let Some(id) = self.objs.complete_id(&f.key) else {
            return;
        };
        f.from = self
            .lease_for_read(id, now_ms)
            .into_iter()
            .filter(|d| d.tier == Tier::Dram)
            .collect();
    }

    /// A node was asked to fill the range at `offset` of slot `idx` for
    /// object `id`: its report is due within `put_timeout_ms`.
    pub(super) fn fill_due(&mut self, id: Id, idx: u32, offset: u64, now_ms: u64) {
        if self.filling.q.len() < MAX_FILLS_WATCHED {
            let key = self.objs.key(id).into();
            let due = now_ms.saturating_add(self.cfg.put_timeout_ms);
            self.filling.q.push_back((due, key, idx, offset));
        }
    }

    /// Gives up the fills whose report is overdue (the task or its report
    /// was lost: a master's answer that did not reach the node, a node
    /// that restarted): the replica goes, its range is freed after
    /// `stale_put_grace_ms` (the node may still be writing it), and the
    /// object may be promoted or replicated again. Returns how many.
    pub(super) fn expire_fills(&mut self, now_ms: u64) -> u64 {
        let mut expired = 0;
        while self.filling.q.front().is_some_and(|f| f.0 <= now_ms) {
            let (_, key, slot, offset) = self.filling.q.pop_front().expect("a front");
            let Some(id) = self.objs.complete_id(&key) else {
                continue;
            };
            let obj = self.objs.get(id);
            let Some(pos) = obj.replicas.iter().position(|r| {
                r.slot == slot && r.offset == offset && r.state == ReplicaState::Promoting
            }) else {
                continue;
            };
            let size = obj.size;
            let r = self.objs.update(id, |o| o.replicas.remove(pos));
            self.free_replica_at(&r, size, now_ms + self.cfg.stale_put_grace_ms, now_ms);
            expired += 1;
        }
        expired
    }
}
