//! The rules of a read, without I/O: which replica is tried next, for how
//! long, and which failures mark a node as unreachable. The transfer
//! engine ([`crate::engine`]) drives them over shm, TCP and RDMA; the
//! cluster simulation drives the same code over its simulated network
//! (issue 32: one simulation of the real code).
//!
//! ```text
//!   ReplicaRead::new(replicas, len, prefer, suspects, now)
//!     next(left) -> Try { replica, share, timed } --read--> ok: done
//!                                                 \-> failed(e) -> next(left) ...
//!                -> Failed(the last replica's error)
//! ```
//!
//! Time is a [`Duration`] since an origin the caller chooses (the engine:
//! its creation; the simulation: its clock's zero), so the rules read no
//! clock.

use std::ops::Add;
use std::time::Duration;

use kvpool_wire::proto::{DataRequest, ReplicaDesc, SegmentId, Tier};
use kvpool_wire::{ErrorCode, KvError};

/// At most this many segments are remembered as unreachable (to report) and
/// as suspect (to try last).
pub const MAX_UNREACHABLE: usize = 64;

/// How long a segment that could not be reached is tried last by reads.
pub const SUSPECT_FOR: Duration = Duration::from_secs(2);

/// Until when the replicas a `GetReplicaList` answered may be read: the
/// read lease's end (`ttl` from before the request, as the reader measures
/// it) less `margin` (the request's way to the node and the node's copy),
/// at most a quarter of the lease (a short lease still leaves time to
/// read). Past the lease the master may free the space and a put reuse it:
/// a read there finds other bytes, which only a checksum would catch. A
/// read runs until this or the call's deadline, whichever is sooner.
pub fn lease_read_end<T: Add<Duration, Output = T>>(
    asked: T,
    ttl: Duration,
    margin: Duration,
) -> T {
    asked + ttl.saturating_sub(margin.min(ttl / 4))
}

/// The data request that reads `len` bytes of replica `r` of `key` over
/// the data port, `at` bytes into it: a DRAM replica by range (TCP reads a
/// large one in slices), an NVMe copy whole (`at` is 0) by its location and
/// key, which the node serves only while that slot holds `key`'s copy.
pub fn data_request(r: &ReplicaDesc, key: &[u8], at: u64, len: u64) -> DataRequest {
    match r.tier {
        Tier::Nvme => {
            debug_assert_eq!(at, 0, "an NVMe copy is read whole");
            DataRequest::ReadNvme {
                segment_id: r.segment_id,
                loc: r.offset,
                len,
                grant: r.grant,
                key: key.to_vec(),
            }
        }
        Tier::Dram => DataRequest::Read {
            segment_id: r.segment_id,
            offset: r.offset + at,
            len,
            grant: r.grant,
        },
    }
}

/// Whether a failure of a transfer with a segment's node names the node as
/// unreachable: the connection was refused, reset or timed out. A corrupt
/// copy or a refused request is the copy's fault, not the node's.
pub fn marks_unreachable(e: &KvError) -> bool {
    matches!(e.code, ErrorCode::Unavailable | ErrorCode::Timeout)
}

/// Segments whose node could not be reached: to report to the master (each
/// once, until taken) and to try last while suspect ([`SUSPECT_FOR`]).
#[derive(Debug, Default)]
pub struct Suspects {
    unreachable: Vec<SegmentId>,
    suspect: Vec<(SegmentId, Duration)>,
}

impl Suspects {
    /// Notes that a transfer with `segment`'s node failed with `e` at
    /// `now`; only failures that [`marks_unreachable`] count.
    pub fn note(&mut self, segment: SegmentId, e: &KvError, now: Duration) {
        if !marks_unreachable(e) {
            return;
        }
        if !self.unreachable.contains(&segment) && self.unreachable.len() < MAX_UNREACHABLE {
            self.unreachable.push(segment);
        }
        self.suspect
            .retain(|&(seg, until)| until > now && seg != segment);
        if self.suspect.len() < MAX_UNREACHABLE {
            self.suspect.push((segment, now + SUSPECT_FOR));
        }
    }

    /// The segments noted unreachable since the last call, each once.
    pub fn take_unreachable(&mut self) -> Vec<SegmentId> {
        std::mem::take(&mut self.unreachable)
    }

    /// Whether some segment was noted unreachable since the last
    /// [`Suspects::take_unreachable`].
    pub fn has_unreachable(&self) -> bool {
        !self.unreachable.is_empty()
    }

    /// Whether reads at `now` try `segment`'s replicas last.
    pub fn is_suspect(&self, segment: SegmentId, now: Duration) -> bool {
        self.suspect
            .iter()
            .any(|&(s, until)| s == segment && until > now)
    }

    /// Whether no segment is suspect (reads need not look at the clock).
    pub fn none_suspect(&self) -> bool {
        self.suspect.is_empty()
    }
}

/// What a reader prefers among equally healthy replicas.
#[derive(Debug, Clone, Copy)]
pub struct Prefer<'a> {
    /// Same-host replicas first (shared memory may be used).
    pub shm: bool,
    /// This reader's host.
    pub host_id: &'a str,
}

/// The next step of a read.
#[derive(Debug)]
pub enum Step {
    /// Read `replicas[index]`: within `share` of the time left when `timed` (more
    /// replicas are left to try), else with all of it (the call's deadline
    /// bounds it). `failover`: an earlier replica failed.
    Try {
        index: usize,
        share: Duration,
        timed: bool,
        failover: bool,
    },
    /// No replica gave the bytes: the last one's error (or why none could
    /// be tried).
    Failed(KvError),
}

/// One read of one object from its replicas: each in turn, in the order
/// [`ReplicaRead::new`] chose, until one gives bytes that pass the check.
/// It holds the replicas' indexes (and lengths), not the replicas, so a
/// caller may keep it beside them.
#[derive(Debug)]
pub struct ReplicaRead {
    /// Index and length of each replica, in the order tried.
    order: Vec<(usize, u64)>,
    next: usize,
    len: u64,
    last: Option<KvError>,
}

impl ReplicaRead {
    /// A read of `len` bytes from `replicas`, tried in this order: those of
    /// a suspect segment last, then DRAM before NVMe, then (with
    /// `prefer.shm`) this host's first. `ObjectNotFound` when there is no
    /// replica.
    pub fn new(
        replicas: &[ReplicaDesc],
        len: u64,
        prefer: Prefer<'_>,
        suspects: &Suspects,
        now: Duration,
    ) -> Result<Self, KvError> {
        if replicas.is_empty() {
            return Err(KvError::new(
                ErrorCode::ObjectNotFound,
                "no replica to read",
            ));
        }
        let look = !suspects.none_suspect();
        let mut order: Vec<(usize, u64)> = replicas.iter().map(|r| r.len).enumerate().collect();
        // Stable: the master's order among equals.
        order.sort_by_key(|&(i, _)| {
            let r = &replicas[i];
            (
                look && suspects.is_suspect(r.segment_id, now),
                r.tier == Tier::Nvme,
                prefer.shm && r.host_id != prefer.host_id,
            )
        });
        Ok(Self {
            order,
            next: 0,
            len,
            last: None,
        })
    }

    /// What to do with `left` of the read's time (see [`lease_read_end`]): the next
    /// replica, each left getting an equal share (the last one all of it),
    /// so a node that stays silent (a cut cable, no reset) costs its share,
    /// not the whole call. No time left ends the read (`Timeout`: no replica
    /// is read once the lease has ended); so does a replica of another
    /// length than the buffer (`InvalidParams`).
    pub fn next(&mut self, left: Duration) -> Step {
        let Some(&(index, len)) = self.order.get(self.next) else {
            return Step::Failed(self.last.take().unwrap_or_else(|| {
                KvError::new(ErrorCode::Unavailable, "no replica could be read")
            }));
        };
        if left.is_zero() {
            let why = match self.last.take() {
                Some(e) => format!("no time left to read another replica (the last: {e})"),
                None => "no time left to read a replica".into(),
            };
            return Step::Failed(KvError::new(ErrorCode::Timeout, why));
        }
        if len != self.len {
            return Step::Failed(KvError::new(
                ErrorCode::InvalidParams,
                format!("buffer of {} bytes for an object of {len}", self.len),
            ));
        }
        let remaining = (self.order.len() - self.next) as u32;
        let failover = self.next > 0;
        self.next += 1;
        Step::Try {
            index,
            share: left / remaining,
            timed: remaining > 1,
            failover,
        }
    }

    /// The replica last given by [`ReplicaRead::next`] failed with `e` (its
    /// transfer, its share of the time, or the check of its bytes).
    pub fn failed(&mut self, e: KvError) {
        self.last = Some(e);
    }

    /// The error a replica that did not answer within its share is given.
    pub fn share_passed(r: &ReplicaDesc, share: Duration) -> KvError {
        KvError::new(
            ErrorCode::Timeout,
            format!(
                "the replica on segment {:016x} did not answer within its share of the \
                 deadline ({share:?}); trying the next",
                r.segment_id
            ),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvpool_wire::proto::{Endpoint, Grant};

    fn replica(seg: SegmentId, tier: Tier, host: &str) -> ReplicaDesc {
        ReplicaDesc {
            segment_id: seg,
            endpoint: Endpoint {
                host: host.into(),
                port: 1,
                nr_shards: 1,
            },
            slice_bytes: 0,
            host_id: host.into(),
            offset: 0,
            len: 10,
            tier,
            checksum: None,
            grant: Grant::default(),
        }
    }

    #[test]
    fn a_dram_replica_is_read_by_range_and_an_nvme_copy_whole_by_key() {
        let mut dram = replica(1, Tier::Dram, "a");
        dram.offset = 4096;
        assert!(matches!(
            data_request(&dram, b"k", 1024, 512),
            DataRequest::Read {
                segment_id: 1,
                offset: 5120,
                len: 512,
                ..
            }
        ));
        let mut nvme = replica(2, Tier::Nvme, "a");
        nvme.offset = 7;
        match data_request(&nvme, b"k", 0, 10) {
            DataRequest::ReadNvme {
                segment_id,
                loc,
                len,
                key,
                ..
            } => assert_eq!(
                (segment_id, loc, len, key.as_slice()),
                (2, 7, 10, &b"k"[..])
            ),
            other => panic!("an NVMe copy is read with ReadNvme, not {other:?}"),
        }
    }

    fn over_tcp() -> Prefer<'static> {
        Prefer {
            shm: false,
            host_id: "a",
        }
    }

    fn tried(
        read: &mut ReplicaRead,
        rs: &[ReplicaDesc],
        left: Duration,
    ) -> Vec<(SegmentId, Duration, bool)> {
        let mut v = Vec::new();
        loop {
            match read.next(left) {
                Step::Try {
                    index,
                    share,
                    timed,
                    ..
                } => {
                    v.push((rs[index].segment_id, share, timed));
                    read.failed(KvError::new(ErrorCode::Unavailable, "cut"));
                }
                Step::Failed(_) => return v,
            }
        }
    }

    #[test]
    fn replicas_are_tried_suspect_last_then_dram_first_then_this_host_first() {
        let rs = [
            replica(1, Tier::Nvme, "a"),
            replica(2, Tier::Dram, "b"),
            replica(3, Tier::Dram, "a"),
            replica(4, Tier::Dram, "a"),
        ];
        let mut s = Suspects::default();
        let cut = KvError::new(ErrorCode::Unavailable, "refused");
        s.note(4, &cut, Duration::ZERO);
        let prefer = Prefer {
            shm: true,
            host_id: "a",
        };
        let now = Duration::from_secs(1);
        let mut r = ReplicaRead::new(&rs, 10, prefer, &s, now).unwrap();
        let order: Vec<_> = tried(&mut r, &rs, Duration::from_secs(1))
            .iter()
            .map(|t| t.0)
            .collect();
        assert_eq!(order, [3, 2, 1, 4]);
        // Once the suspicion lapses, 4 is a same-host DRAM replica again.
        let later = SUSPECT_FOR + Duration::from_millis(1);
        let mut r = ReplicaRead::new(&rs, 10, prefer, &s, later).unwrap();
        let order: Vec<_> = tried(&mut r, &rs, Duration::from_secs(1))
            .iter()
            .map(|t| t.0)
            .collect();
        assert_eq!(order, [3, 4, 2, 1]);
    }

    #[test]
    fn each_replica_left_gets_an_equal_share_and_the_last_all_of_it() {
        let rs = [
            replica(1, Tier::Dram, "a"),
            replica(2, Tier::Dram, "a"),
            replica(3, Tier::Dram, "a"),
        ];
        let prefer = over_tcp();
        let s = Suspects::default();
        let mut r = ReplicaRead::new(&rs, 10, prefer, &s, Duration::ZERO).unwrap();
        let ms = Duration::from_millis;
        assert_eq!(
            tried(&mut r, &rs, ms(300)),
            [(1, ms(100), true), (2, ms(150), true), (3, ms(300), false)]
        );
    }

    #[test]
    fn the_last_replicas_error_ends_the_read_and_a_wrong_length_ends_it_at_once() {
        let mut rs = [replica(1, Tier::Dram, "a"), replica(2, Tier::Dram, "a")];
        let prefer = over_tcp();
        let s = Suspects::default();
        let mut r = ReplicaRead::new(&rs, 10, prefer, &s, Duration::ZERO).unwrap();
        assert!(matches!(
            r.next(Duration::from_secs(1)),
            Step::Try {
                failover: false,
                ..
            }
        ));
        r.failed(KvError::new(ErrorCode::Corrupt, "bad bytes"));
        assert!(matches!(
            r.next(Duration::from_secs(1)),
            Step::Try { failover: true, .. }
        ));
        r.failed(KvError::new(ErrorCode::Timeout, "silent"));
        assert!(
            matches!(r.next(Duration::from_secs(1)), Step::Failed(e) if e.code == ErrorCode::Timeout)
        );

        rs[1].len = 11;
        let mut r = ReplicaRead::new(&rs, 10, prefer, &s, Duration::ZERO).unwrap();
        assert!(matches!(r.next(Duration::from_secs(1)), Step::Try { .. }));
        r.failed(KvError::new(ErrorCode::Unavailable, "cut"));
        assert!(
            matches!(r.next(Duration::from_secs(1)), Step::Failed(e) if e.code == ErrorCode::InvalidParams)
        );
        let none = ReplicaRead::new(&[], 10, prefer, &s, Duration::ZERO).unwrap_err();
        assert_eq!(none.code, ErrorCode::ObjectNotFound);
    }

    #[test]
    fn no_replica_is_read_once_the_lease_has_ended() {
        let rs = [replica(1, Tier::Dram, "a"), replica(2, Tier::Dram, "a")];
        let prefer = over_tcp();
        let s = Suspects::default();
        let ms = Duration::from_millis;
        // Asked at 100 ms, a 400 ms lease, 50 ms of margin; a call until 1,600.
        let until = lease_read_end(ms(100), ms(400), ms(50)).min(ms(1_600));
        assert_eq!(until, ms(450));
        // A margin over a quarter of the lease is cut to a quarter.
        assert_eq!(lease_read_end(ms(100), ms(400), ms(500)), ms(400));
        let mut r = ReplicaRead::new(&rs, 10, prefer, &s, ms(200)).unwrap();
        assert!(matches!(r.next(until - ms(200)), Step::Try { share, .. } if share == ms(125)));
        r.failed(KvError::new(ErrorCode::Timeout, "silent"));
        let now = ms(450);
        assert!(
            matches!(r.next(until.saturating_sub(now)), Step::Failed(e) if e.code == ErrorCode::Timeout)
        );
    }

    #[test]
    fn only_a_node_that_could_not_be_reached_is_reported_and_suspected() {
        let mut s = Suspects::default();
        let t = Duration::ZERO;
        s.note(1, &KvError::new(ErrorCode::Corrupt, "bad bytes"), t);
        s.note(2, &KvError::new(ErrorCode::Timeout, "silent"), t);
        s.note(2, &KvError::new(ErrorCode::Unavailable, "reset"), t);
        assert!(!s.is_suspect(1, t) && s.is_suspect(2, t));
        assert_eq!(s.take_unreachable(), [2]);
        assert!(!s.has_unreachable());
        assert!(s.is_suspect(2, t), "taking the report keeps the suspicion");
    }
}
