//! One tier task's decisions, without I/O (issue 32): what a Persist does
//! with the copy of its key the tier holds, which Promote the node refuses,
//! which copy a Drop takes. The tasks are the wire's structs
//! (`kvpool_wire::proto::{PersistTask, ...}`, which also build the report
//! each task ends in); the rules are traits on them here. The node
//! ([`crate::nvme_tier`]) acts on them over its tier's regions; the cluster
//! simulation (`tools/cluster-sim`) over its simulated disk, so these rules
//! exist once. The I/O around them (reading the DRAM bytes and their
//! checksum, writing and removing copies, eviction when the tier is full)
//! stays with the driver.
//!
//! ```text
//!  NodeTask ──job(mine)──▶ Persist: decide(sum of the DRAM bytes, held copy)
//!                                     ─▶ Found(at) | Write { replace: Option<at> }
//!                                   then stored(nvme, loc, sum) | failed();
//!                                   no room: evict room(), try once more
//!                          Promote: target(mine), reads(the slot's key and version),
//!                                   check(copy's len, segment, sum)
//!                                   ─▶ ok | Refusal (Size, Checksum, Range); promoted(ok)
//!                          Drop:    takes(the slot's key and version)
//!                          Fetch:   target(mine, segment), check(sum of the bytes read)
//!                                   (not a tier task: crate::fetch runs it); promoted(ok)
//!                          None:    a Persist of another node's segment, ignored
//! ```

use kvpool_wire::proto::{
    show_key, DropTask, FetchTask, NodeTask, PersistTask, PromoteTask, SegmentId, Tier,
};
use kvpool_wire::{ErrorCode, KvError};

/// A copy the tier holds, as a task sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    pub len: u64,
    pub sum: u64,
    /// The object incarnation it is a copy of.
    pub version: u64,
}

/// A master's task, as the node's tier runs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Job {
    Persist(PersistTask),
    Promote(PromoteTask),
    Drop(DropTask),
    /// An extra DRAM replica of a hot object: not the tier's (the node runs
    /// it with [`crate::fetch`]).
    Fetch(FetchTask),
}

/// The job `task` is for the node whose DRAM segment is `mine`; `None`: a
/// Persist of another node's segment (its bytes are not here to copy; the
/// master hands it to that node), ignored.
pub fn job(task: NodeTask, mine: SegmentId) -> Option<Job> {
    Some(match task {
        NodeTask::Persist(p) if p.dram != mine => return None,
        NodeTask::Persist(p) => Job::Persist(p),
        NodeTask::Promote(p) => Job::Promote(p),
        NodeTask::Drop(d) => Job::Drop(d),
        NodeTask::Fetch(f) => Job::Fetch(f),
    })
}

/// What a Persist does, given the copy of its key the tier holds (at the
/// driver's location `L`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Write<L> {
    /// That very copy is there (a write-through, then the demotion): it is
    /// reported, not written again.
    Found(L),
    /// The bytes are written; `replace`: the key's copy there now is of an
    /// earlier object (removed at the master, its Drop not seen yet), or of
    /// other bytes, and goes first. It is never reported as this object's.
    Write { replace: Option<L> },
}

/// A Persist's decision (a DRAM range copied to the tier, a demotion or
/// a write-through, as the copy of incarnation `version`).
pub trait PersistRule {
    /// What to do with the DRAM bytes read, whose checksum is `sum`, when
    /// the tier holds `held` under the key (its location and what it is).
    /// Bytes that do not match the object's checksum are not copied
    /// (`Corrupt`: the range holds something else now).
    fn decide<L>(&self, sum: u64, held: Option<(L, Held)>) -> Result<Write<L>, KvError>;

    /// The bytes the node asks its tier to free when this copy found no
    /// room (its value and up to two blocks of header and rounding); the
    /// node then tries the Persist once more.
    fn room(&self) -> u64;
}

impl PersistRule for PersistTask {
    fn decide<L>(&self, sum: u64, held: Option<(L, Held)>) -> Result<Write<L>, KvError> {
        if self.checksum.is_some_and(|c| c != sum) {
            return Err(KvError::new(
                ErrorCode::Corrupt,
                format!(
                    "the DRAM bytes of {} do not match the object's checksum",
                    show_key(&self.key)
                ),
            ));
        }
        Ok(match held {
            Some((at, h)) if h.len == self.len && h.sum == sum && h.version == self.version => {
                Write::Found(at)
            }
            Some((at, _)) => Write::Write { replace: Some(at) },
            None => Write::Write { replace: None },
        })
    }

    fn room(&self) -> u64 {
        self.len + 8192
    }
}

/// A Promote's decisions (the tier's copy at packed `loc` into the range
/// `offset..offset + len` of DRAM segment `dram` the master allocated).
pub trait PromoteRule {
    /// Refuses a range in another node's segment (`mine` is this node's):
    /// writing this node's memory at that offset would overwrite unrelated
    /// objects.
    fn target(&self, mine: SegmentId) -> Result<(), KvError>;

    /// Whether the copy read (`copy_len` bytes, checksum `sum`, computed
    /// only when the object has one and the size is right) may go into the
    /// range, in a segment of `segment_len` bytes: only the object's size
    /// and bytes, and only inside the segment.
    fn check(
        &self,
        copy_len: u64,
        segment_len: u64,
        sum: impl FnOnce() -> u64,
    ) -> Result<(), Refusal>;

    /// Whether the tier's copy in the slot (of `key`, at `version`) is the
    /// one to copy: the key's, and, for an object without a checksum, of
    /// its incarnation (a slot evicted and reused since may hold another
    /// copy of the same size, whose bytes nothing else would tell apart; a
    /// checksum tells them by itself, whatever version the copy carries).
    fn reads(&self, key: &[u8], version: u64) -> bool;

    /// The error of a refused promotion.
    fn error(&self, r: Refusal) -> KvError;
}

impl PromoteRule for PromoteTask {
    fn target(&self, mine: SegmentId) -> Result<(), KvError> {
        if self.dram != mine {
            return Err(KvError::new(
                ErrorCode::InvalidParams,
                format!(
                    "a promotion into segment {:016x}, which is not this node's ({mine:016x})",
                    self.dram
                ),
            ));
        }
        Ok(())
    }

    fn check(
        &self,
        copy_len: u64,
        segment_len: u64,
        sum: impl FnOnce() -> u64,
    ) -> Result<(), Refusal> {
        if copy_len != self.len {
            return Err(Refusal::Size);
        }
        if self.checksum.is_some_and(|c| c != sum()) {
            return Err(Refusal::Checksum);
        }
        if self
            .offset
            .checked_add(self.len)
            .is_none_or(|end| end > segment_len)
        {
            return Err(Refusal::Range { segment_len });
        }
        Ok(())
    }

    fn reads(&self, key: &[u8], version: u64) -> bool {
        key == self.key.as_slice() && (self.checksum.is_some() || version == self.version)
    }

    fn error(&self, r: Refusal) -> KvError {
        match r {
            Refusal::Size => KvError::new(ErrorCode::Corrupt, "promoted object has another size"),
            Refusal::Checksum => KvError::new(
                ErrorCode::Corrupt,
                "the NVMe copy does not match the object's checksum",
            ),
            Refusal::Range { segment_len } => KvError::new(
                ErrorCode::InvalidParams,
                format!(
                    "a promotion to {}+{} past the segment's {segment_len} bytes",
                    self.offset, self.len
                ),
            ),
        }
    }
}

/// Why a promotion's bytes do not go into its range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The copy has another size than the object.
    Size,
    /// The copy's bytes do not match the object's checksum.
    Checksum,
    /// The range does not lie inside the segment.
    Range { segment_len: u64 },
}

/// A Drop's decision (the object `key` was removed: its copy at packed
/// `loc` goes).
pub trait DropRule {
    /// Whether the copy in the slot (of `key`, at `version`) is the one
    /// this Drop takes. A slot that holds another key (its own copy went,
    /// the slot was reused), or a later incarnation of the key, keeps it.
    /// A Drop without a version (owed from before versions) takes the
    /// key's copy whatever its version.
    fn takes(&self, key: &[u8], version: u64) -> bool;
}

impl DropRule for DropTask {
    fn takes(&self, key: &[u8], version: u64) -> bool {
        key == self.key.as_slice() && self.version.is_none_or(|v| v == version)
    }
}

/// A Fetch's decisions (an extra DRAM replica of a hot object: the bytes
/// of one of `from`'s replicas into the range `offset..offset + len` of
/// this node's segment `dram`). The node reads the replica with the
/// transfer engine ([`crate::fetch`]); the cluster simulation over its
/// network.
pub trait FetchRule {
    /// Refuses a range in another node's segment (`mine` is this node's),
    /// outside a segment of `segment_len` bytes, or a fetch that names no
    /// replica, or one of another length, another tier, or on this node.
    fn target(&self, mine: SegmentId, segment_len: u64) -> Result<(), KvError>;

    /// Whether the bytes read (checksum `sum`) may go into the range: only
    /// the object's (`Corrupt` else; the engine checks a replica's bytes
    /// when its client checks checksums, the node checks them itself too).
    fn check(&self, sum: u64) -> Result<(), KvError>;
}

impl FetchRule for FetchTask {
    fn target(&self, mine: SegmentId, segment_len: u64) -> Result<(), KvError> {
        let invalid = |why: String| KvError::new(ErrorCode::InvalidParams, why);
        if self.dram != mine {
            return Err(invalid(format!(
                "a fetch into segment {:016x}, which is not this node's ({mine:016x})",
                self.dram
            )));
        }
        if self
            .offset
            .checked_add(self.len)
            .is_none_or(|end| end > segment_len)
        {
            return Err(invalid(format!(
                "a fetch of {}+{} outside the segment of {segment_len} bytes",
                self.offset, self.len
            )));
        }
        if self.from.is_empty()
            || self
                .from
                .iter()
                .any(|r| r.len != self.len || r.tier != Tier::Dram || r.segment_id == mine)
        {
            return Err(invalid(
                "a fetch names no replica, or one of another length, tier, or on this node".into(),
            ));
        }
        Ok(())
    }

    fn check(&self, sum: u64) -> Result<(), KvError> {
        if sum != self.checksum {
            return Err(KvError::new(
                ErrorCode::Corrupt,
                "the fetched bytes do not match the object's checksum",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvpool_wire::auth::Grant;
    use kvpool_wire::proto::{Endpoint, ReplicaDesc};

    fn fetch(from: &[(SegmentId, u64, Tier)]) -> FetchTask {
        FetchTask {
            key: b"hot".to_vec(),
            from: from
                .iter()
                .map(|&(segment_id, len, tier)| ReplicaDesc {
                    segment_id,
                    endpoint: Endpoint {
                        host: "h".into(),
                        port: 1,
                        nr_shards: 1,
                    },
                    slice_bytes: 0,
                    host_id: "h".into(),
                    offset: 0,
                    len,
                    tier,
                    checksum: Some(9),
                    grant: Grant::default(),
                })
                .collect(),
            dram: 2,
            offset: 96,
            len: 4,
            checksum: 9,
        }
    }

    #[test]
    fn a_fetch_goes_only_into_this_nodes_segment_from_another_nodes_dram_replica_of_its_bytes() {
        let ok = fetch(&[(5, 4, Tier::Dram)]);
        assert!(ok.target(2, 100).is_ok());
        assert!(ok.check(9).is_ok());
        assert_eq!(ok.check(8).unwrap_err().code, ErrorCode::Corrupt);
        let refused = |f: FetchTask, mine, len| f.target(mine, len).unwrap_err().code;
        assert_eq!(
            refused(ok.clone(), 3, 100),
            ErrorCode::InvalidParams,
            "another segment"
        );
        assert_eq!(
            refused(ok.clone(), 2, 99),
            ErrorCode::InvalidParams,
            "past its end"
        );
        for bad in [
            fetch(&[]),
            fetch(&[(5, 4, Tier::Dram), (6, 5, Tier::Dram)]),
            fetch(&[(5, 4, Tier::Nvme)]),
            fetch(&[(2, 4, Tier::Dram)]),
        ] {
            assert_eq!(refused(bad, 2, 100), ErrorCode::InvalidParams);
        }
    }

    fn persist(checksum: Option<u64>) -> PersistTask {
        PersistTask {
            key: b"k".to_vec(),
            dram: 2,
            offset: 64,
            len: 4,
            demote: true,
            checksum,
            version: 7,
        }
    }

    /// A copy held at location 1.
    fn held(len: u64, sum: u64, version: u64) -> Option<(u32, Held)> {
        Some((1, Held { len, sum, version }))
    }

    #[test]
    fn a_persist_reports_the_copy_it_finds_only_if_it_is_that_incarnations() {
        let p = persist(None);
        assert_eq!(p.decide(9, held(4, 9, 7)).unwrap(), Write::Found(1));
        // The same bytes of an earlier incarnation (removed, its Drop not
        // seen): written again, never reported as this object's.
        assert_eq!(
            p.decide(9, held(4, 9, 6)).unwrap(),
            Write::Write { replace: Some(1) }
        );
        assert_eq!(
            p.decide(9, held(4, 8, 7)).unwrap(),
            Write::Write { replace: Some(1) }
        );
        assert_eq!(
            p.decide(9, held(5, 9, 7)).unwrap(),
            Write::Write { replace: Some(1) },
            "another size"
        );
        assert_eq!(
            p.decide::<u32>(9, None).unwrap(),
            Write::Write { replace: None }
        );
    }

    #[test]
    fn a_persist_copies_only_bytes_that_match_the_objects_checksum() {
        let e = persist(Some(5)).decide::<u32>(9, None).unwrap_err();
        assert_eq!(e.code, ErrorCode::Corrupt);
        // Even when the tier holds a copy that matches what was read.
        let e = persist(Some(5)).decide(9, held(4, 9, 7)).unwrap_err();
        assert_eq!(e.code, ErrorCode::Corrupt);
        assert_eq!(
            persist(Some(9)).decide::<u32>(9, None).unwrap(),
            Write::Write { replace: None }
        );
        // A persist of another node's segment is not this node's job.
        let t = NodeTask::Persist(PersistTask {
            key: b"k".to_vec(),
            dram: 3,
            offset: 0,
            len: 4,
            demote: false,
            checksum: None,
            version: 1,
        });
        assert_eq!(job(t.clone(), 2), None);
        assert!(matches!(job(t, 3), Some(Job::Persist(_))));
    }

    #[test]
    fn a_promotion_goes_only_into_this_nodes_segment_with_the_objects_bytes() {
        let p = PromoteTask {
            key: b"k".to_vec(),
            loc: 1,
            dram: 2,
            offset: 60,
            len: 4,
            checksum: Some(9),
            version: 7,
        };
        assert_eq!(p.target(3).unwrap_err().code, ErrorCode::InvalidParams);
        p.target(2).unwrap();
        p.check(4, 64, || 9).unwrap();
        // Another size is refused before the sum is computed.
        assert_eq!(
            p.check(5, 64, || unreachable!("the size is checked first")),
            Err(Refusal::Size)
        );
        assert_eq!(p.check(4, 64, || 8), Err(Refusal::Checksum));
        assert_eq!(
            p.check(4, 63, || 9),
            Err(Refusal::Range { segment_len: 63 })
        );
        assert_eq!(p.error(Refusal::Size).code, ErrorCode::Corrupt);
        assert_eq!(p.error(Refusal::Checksum).code, ErrorCode::Corrupt);
        let far = PromoteTask {
            offset: u64::MAX,
            ..p.clone()
        };
        assert_eq!(
            far.check(4, 64, || 9),
            Err(Refusal::Range { segment_len: 64 })
        );
        assert_eq!(
            far.error(Refusal::Range { segment_len: 64 }).code,
            ErrorCode::InvalidParams
        );
        // Without a checksum the sum is not computed.
        let unsummed = PromoteTask {
            checksum: None,
            ..p
        };
        unsummed
            .check(4, 64, || unreachable!("no checksum to compare"))
            .unwrap();
    }

    #[test]
    fn a_promotion_reads_only_its_keys_copy_and_without_a_checksum_only_its_incarnations() {
        let summed = PromoteTask {
            key: b"k".to_vec(),
            loc: 1,
            dram: 2,
            offset: 0,
            len: 4,
            checksum: Some(9),
            version: 7,
        };
        assert!(summed.reads(b"k", 7));
        assert!(!summed.reads(b"j", 7), "another key in the reused slot");
        assert!(summed.reads(b"k", 6), "the checksum tells the bytes");
        let unsummed = PromoteTask {
            checksum: None,
            ..summed
        };
        assert!(unsummed.reads(b"k", 7));
        assert!(!unsummed.reads(b"k", 6), "an earlier incarnation's copy");
        assert!(!unsummed.reads(b"j", 7));
    }

    #[test]
    fn a_drop_takes_only_its_keys_copy_at_its_version() {
        let d = DropTask {
            key: b"k".to_vec(),
            loc: 1,
            version: Some(7),
        };
        assert!(d.takes(b"k", 7));
        assert!(!d.takes(b"k", 8), "a later incarnation stays");
        assert!(!d.takes(b"j", 7), "another key in the reused slot stays");
        let old = DropTask { version: None, ..d };
        assert!(old.takes(b"k", 8) && !old.takes(b"j", 8));
    }
}
