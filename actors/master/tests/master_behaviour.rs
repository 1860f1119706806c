//! The master's behaviour, row by row of DESIGN §4, against the real state
//! machines (`MasterCore`: every shard and the coordinator) on a simulated
//! clock. No sleeps: time moves only when a test says so.

use std::sync::Arc;

use kvpool_config::{MasterConfig, Placement};
use kvpool_master::core::MasterCore;
use kvpool_wire::proto::{
    DropTask, FetchTask, NodeTask, NvmeAttach, NvmeUpdate, PersistTask, PromoteTask, Tier,
};
use kvpool_wire::proto::{
    Endpoint, ItemResult, MasterRequest as Q, MasterResponse as A, ObjectInfo, PoolStat, PutItem,
    PutOptions, ReplicaDesc, SegmentId, SegmentSpec,
};
use kvpool_wire::{ErrorCode, KvError};

#[path = "master_behaviour/trust.rs"]
mod trust;

#[path = "master_behaviour/nvme_tier.rs"]
mod nvme_tier;
use nvme_tier::*;

#[path = "master_behaviour/eviction.rs"]
mod eviction;
#[path = "master_behaviour/hot.rs"]
mod hot;
#[path = "master_behaviour/segments.rs"]
mod segments;
#[path = "master_behaviour/versions.rs"]
mod versions;
use eviction::*;

const KIB: u64 = 1024;
const WRITER: u64 = 7;
const OTHER: u64 = 8;
const NODE: u64 = 100;

struct M {
    m: MasterCore,
    now: u64,
    cfg: MasterConfig,
    /// Segment owners that ping every second while time advances.
    live: Vec<u64>,
}

fn cfg() -> MasterConfig {
    MasterConfig {
        placement: Placement::FreeRatioFirst,
        max_keys: 10_000,
        max_value_bytes: kvpool_runtime::config::Bytes::mib(64),
        max_batch: 64,
        ..Default::default()
    }
}

fn spec(name: &str, size: u64, host: &str) -> SegmentSpec {
    SegmentSpec {
        name: name.into(),
        size,
        endpoint: Endpoint {
            host: "127.0.0.1".into(),
            port: 7300,
            nr_shards: 1,
        },
        slice_bytes: size,
        host_id: host.into(),
        tier: kvpool_wire::proto::Tier::Dram,
        nvme: None,
    }
}

fn opts(replicas: u32) -> PutOptions {
    PutOptions {
        replicas,
        ..Default::default()
    }
}

fn code<T: std::fmt::Debug>(r: Result<T, KvError>) -> ErrorCode {
    r.expect_err("expected an error").code
}

impl M {
    fn new(shards: u32) -> Self {
        Self::with(shards, cfg())
    }

    fn with(shards: u32, cfg: MasterConfig) -> Self {
        Self {
            m: MasterCore::new(shards, &cfg, 42),
            now: 1_000,
            cfg,
            live: Vec::new(),
        }
    }

    fn call(&mut self, q: Q) -> Result<A, KvError> {
        self.m.call(q, self.now)
    }

    /// Moves the clock by `ms`, in steps of at most a second; live owners
    /// ping at every step, housekeeping runs after each.
    fn advance(&mut self, ms: u64) {
        let mut left = ms;
        while left > 0 {
            let step = left.min(1000);
            self.now += step;
            left -= step;
            for c in self.live.clone() {
                self.ping(c);
            }
            self.m.tick(self.now);
        }
    }

    /// `owner` stops pinging (its process died).
    fn kill(&mut self, owner: u64) {
        self.live.retain(|c| *c != owner);
    }

    fn mount_as(&mut self, owner: u64, name: &str, size: u64, host: &str) -> SegmentId {
        if !self.live.contains(&owner) {
            self.live.push(owner);
        }
        match self.call(Q::MountSegment {
            client_id: owner,
            spec: spec(name, size, host),
        }) {
            Ok(A::Mounted { segment_id }) => segment_id,
            other => panic!("mount: {other:?}"),
        }
    }

    fn mount(&mut self, name: &str, size: u64) -> SegmentId {
        self.mount_as(NODE, name, size, "host-a")
    }

    fn start_with(
        &mut self,
        client: u64,
        key: &str,
        len: u64,
        o: PutOptions,
    ) -> Result<Vec<ReplicaDesc>, KvError> {
        match self.call(Q::PutStart {
            client_id: client,
            key: key.into(),
            len,
            opts: o,
        })? {
            A::Replicas(r) => Ok(r),
            other => panic!("put_start: {other:?}"),
        }
    }

    fn start(&mut self, key: &str, len: u64) -> Result<Vec<ReplicaDesc>, KvError> {
        self.start_with(WRITER, key, len, opts(1))
    }

    fn end_as(&mut self, client: u64, key: &str) -> Result<(), KvError> {
        self.call(Q::PutEnd {
            client_id: client,
            put_id: 0,
            key: key.into(),
            checksum: None,
        })
        .map(|_| ())
    }

    fn end(&mut self, key: &str) -> Result<(), KvError> {
        self.end_as(WRITER, key)
    }

    /// PutEnd of the writer's placement `put_id`.
    fn end_put(&mut self, key: &str, put_id: u16) -> Result<(), KvError> {
        self.call(Q::PutEnd {
            client_id: WRITER,
            put_id,
            key: key.into(),
            checksum: None,
        })
        .map(|_| ())
    }

    /// PutRevoke of the writer's placement `put_id`.
    fn revoke_put(&mut self, key: &str, put_id: u16) -> Result<(), KvError> {
        self.call(Q::PutRevoke {
            client_id: WRITER,
            put_id,
            key: key.into(),
        })
        .map(|_| ())
    }

    fn revoke_as(&mut self, client: u64, key: &str) -> Result<(), KvError> {
        self.call(Q::PutRevoke {
            client_id: client,
            put_id: 0,
            key: key.into(),
        })
        .map(|_| ())
    }

    fn put_with(&mut self, key: &str, len: u64, o: PutOptions) -> Vec<ReplicaDesc> {
        let r = self.start_with(WRITER, key, len, o).expect("put_start");
        self.end(key).expect("put_end");
        r
    }

    fn put(&mut self, key: &str, len: u64) -> Vec<ReplicaDesc> {
        self.put_with(key, len, opts(1))
    }

    fn get(&mut self, key: &str) -> Result<Vec<ReplicaDesc>, KvError> {
        match self.call(Q::GetReplicaList { key: key.into() })? {
            A::Replicas(r) => Ok(r),
            other => panic!("get: {other:?}"),
        }
    }

    fn exist(&mut self, key: &str) -> bool {
        match self.call(Q::Exist { key: key.into() }) {
            Ok(A::Exists(b)) => b,
            other => panic!("exist: {other:?}"),
        }
    }

    fn remove(&mut self, key: &str, force: bool) -> Result<(), KvError> {
        self.call(Q::Remove {
            key: key.into(),
            force,
        })
        .map(|_| ())
    }

    fn describe(&mut self, key: &str) -> ObjectInfo {
        match self.call(Q::Describe { key: key.into() }) {
            Ok(A::Described(i)) => i,
            other => panic!("describe: {other:?}"),
        }
    }

    fn stat(&mut self) -> PoolStat {
        match self.call(Q::Stat) {
            Ok(A::Stat(s)) => s,
            other => panic!("stat: {other:?}"),
        }
    }

    fn used(&mut self) -> u64 {
        self.stat().used
    }

    fn ping(&mut self, client: u64) {
        self.call(Q::Ping {
            client_id: client,
            segments: Vec::new(),
        })
        .expect("ping");
    }
}

// ---- MountSegment / UnmountSegment ------------------------------------------

#[test]
fn mount_segment_is_idempotent_for_the_same_spec() {
    let mut m = M::new(2);
    let a = m.mount("seg-a", 64 * KIB);
    let b = m.mount("seg-a", 64 * KIB);
    assert_eq!(a, b);
    assert_eq!(m.stat().segments.len(), 1);
    assert_eq!(m.stat().capacity, 64 * KIB);
}

#[test]
fn mount_with_a_zero_size_is_invalid_params() {
    let mut m = M::new(1);
    let r = m.call(Q::MountSegment {
        client_id: NODE,
        spec: spec("seg", 0, "h"),
    });
    assert_eq!(code(r), ErrorCode::InvalidParams);
}

#[test]
fn mount_of_a_mounted_name_with_another_size_is_invalid_params() {
    let mut m = M::new(1);
    m.mount("seg", 64 * KIB);
    let r = m.call(Q::MountSegment {
        client_id: NODE,
        spec: spec("seg", 128 * KIB, "host-a"),
    });
    assert_eq!(code(r), ErrorCode::InvalidParams);
}

#[test]
fn a_dram_segment_mounted_again_as_nvme_of_the_same_size_is_invalid_params_and_keeps_its_objects() {
    // Found by the master_request fuzz target: the remount was taken for
    // an NVMe tier back at a new address, and the DRAM segment's slot
    // became NVMe under its allocator and replicas.
    let mut m = M::new(1);
    m.mount("seg", 64 * KIB);
    m.put("k", 100);
    let mut nv = spec("seg", 64 * KIB, "host-a");
    nv.tier = kvpool_wire::proto::Tier::Nvme;
    let r = m.call(Q::MountSegment {
        client_id: NODE,
        spec: nv,
    });
    assert_eq!(code(r), ErrorCode::InvalidParams);
    let r = m.get("k").unwrap();
    assert_eq!(r[0].tier, kvpool_wire::proto::Tier::Dram);
    assert_eq!(m.stat().capacity, 64 * KIB);
}

#[test]
fn unmount_segment_is_idempotent() {
    let mut m = M::new(1);
    let id = m.mount("seg", 64 * KIB);
    assert!(m
        .call(Q::UnmountSegment {
            client_id: NODE,
            segment_id: id,
        })
        .is_ok());
    assert!(m
        .call(Q::UnmountSegment {
            client_id: NODE,
            segment_id: id,
        })
        .is_ok());
    assert!(m
        .call(Q::UnmountSegment {
            client_id: NODE,
            segment_id: 12345,
        })
        .is_ok());
    assert!(m.stat().segments.is_empty());
}

#[test]
fn unmount_drops_its_replicas_and_objects_left_with_none_disappear() {
    let mut m = M::new(2);
    let id = m.mount("seg", 64 * KIB);
    m.put("k1", 100);
    m.put("k2", 100);
    m.call(Q::UnmountSegment {
        client_id: NODE,
        segment_id: id,
    })
    .unwrap();
    assert_eq!(code(m.get("k1")), ErrorCode::ObjectNotFound);
    assert!(!m.exist("k2"));
    assert_eq!(m.stat().keys, 0);
}

#[test]
fn unmount_keeps_objects_that_have_a_replica_on_another_segment() {
    let mut m = M::new(1);
    let a = m.mount("seg-a", 64 * KIB);
    m.mount("seg-b", 64 * KIB);
    m.put_with("k", 100, opts(2));
    m.call(Q::UnmountSegment {
        client_id: NODE,
        segment_id: a,
    })
    .unwrap();
    let r = m.get("k").unwrap();
    assert_eq!(r.len(), 1);
    assert_ne!(r[0].segment_id, a);
}

// ---- PutStart -----------------------------------------------------------------

#[test]
fn put_start_with_an_empty_key_is_invalid_params() {
    let mut m = M::new(1);
    m.mount("seg", 64 * KIB);
    assert_eq!(code(m.start("", 10)), ErrorCode::InvalidParams);
}

#[test]
fn put_start_with_zero_length_is_invalid_params() {
    let mut m = M::new(1);
    m.mount("seg", 64 * KIB);
    assert_eq!(code(m.start("k", 0)), ErrorCode::InvalidParams);
}

#[test]
fn put_start_with_zero_replicas_is_invalid_params() {
    let mut m = M::new(1);
    m.mount("seg", 64 * KIB);
    assert_eq!(
        code(m.start_with(WRITER, "k", 10, opts(0))),
        ErrorCode::InvalidParams
    );
}

#[test]
fn put_start_of_a_key_over_4_kib_is_invalid_params() {
    let mut m = M::new(1);
    m.mount("seg", 64 * KIB);
    let long = "k".repeat(4097);
    assert_eq!(code(m.start(&long, 10)), ErrorCode::InvalidParams);
    let max = "k".repeat(4096);
    assert!(m.start(&max, 10).is_ok());
}

#[test]
fn put_start_of_a_value_over_the_maximum_is_invalid_params() {
    let mut m = M::new(1);
    m.mount("seg", 1 << 30);
    let over = m.cfg.max_value_bytes.get() + 1;
    assert_eq!(code(m.start("k", over)), ErrorCode::InvalidParams);
}

#[test]
fn put_start_of_a_complete_key_is_object_already_exists() {
    let mut m = M::new(1);
    m.mount("seg", 64 * KIB);
    m.put("k", 10);
    assert_eq!(code(m.start("k", 10)), ErrorCode::ObjectAlreadyExists);
}

#[test]
fn put_start_of_a_key_being_put_is_object_already_exists() {
    let mut m = M::new(1);
    m.mount("seg", 64 * KIB);
    m.start("k", 10).unwrap();
    assert_eq!(
        code(m.start_with(OTHER, "k", 10, opts(1))),
        ErrorCode::ObjectAlreadyExists
    );
}

#[test]
fn put_start_places_replicas_on_distinct_segments() {
    let mut m = M::new(1);
    for s in ["a", "b", "c"] {
        m.mount(s, 64 * KIB);
    }
    let r = m.start_with(WRITER, "k", 100, opts(3)).unwrap();
    let mut segs: Vec<SegmentId> = r.iter().map(|r| r.segment_id).collect();
    segs.sort();
    segs.dedup();
    assert_eq!(segs.len(), 3);
}

#[test]
fn put_start_gives_fewer_replicas_when_there_are_fewer_segments() {
    let mut m = M::new(1);
    m.mount("a", 64 * KIB);
    m.mount("b", 64 * KIB);
    let r = m.start_with(WRITER, "k", 100, opts(5)).unwrap();
    assert_eq!(r.len(), 2, "best effort: as many as there are segments");
}

#[test]
fn put_start_without_any_segment_is_no_space() {
    let mut m = M::new(1);
    assert_eq!(code(m.start("k", 10)), ErrorCode::NoSpace);
}

#[test]
fn put_start_is_no_space_when_nothing_can_be_evicted() {
    let mut m = M::new(1);
    m.mount("seg", 4 * KIB);
    m.put("a", 2 * KIB);
    m.get("a").unwrap(); // leased before the pool fills
    m.put("b", 2 * KIB);
    m.get("b").unwrap();
    assert_eq!(code(m.start("c", KIB)), ErrorCode::NoSpace);
    assert!(m.exist("a") && m.exist("b"), "leased objects were kept");
}

#[test]
fn put_start_beyond_max_keys_is_resource_exhausted() {
    let mut c = cfg();
    c.max_keys = 3;
    let mut m = M::with(1, c);
    m.mount("seg", 64 * KIB);
    for k in ["a", "b", "c"] {
        m.put(k, 10);
    }
    assert_eq!(code(m.start("d", 10)), ErrorCode::ResourceExhausted);
}

// ---- PutEnd / PutRevoke -------------------------------------------------------

#[test]
fn put_end_makes_the_object_complete_and_readable() {
    let mut m = M::new(1);
    m.mount("seg", 64 * KIB);
    let r = m.start("k", 100).unwrap();
    assert!(!m.exist("k"));
    m.end("k").unwrap();
    assert!(m.exist("k"));
    assert_eq!(m.get("k").unwrap(), r);
}

#[test]
fn put_end_from_another_client_is_illegal_client() {
    let mut m = M::new(1);
    m.mount("seg", 64 * KIB);
    m.start("k", 10).unwrap();
    assert_eq!(code(m.end_as(OTHER, "k")), ErrorCode::IllegalClient);
    m.end("k").unwrap();
}

#[test]
fn put_end_of_an_unknown_key_is_object_not_found() {
    let mut m = M::new(1);
    m.mount("seg", 64 * KIB);
    assert_eq!(code(m.end("nope")), ErrorCode::ObjectNotFound);
}

#[test]
fn put_revoke_ends_the_put_and_the_key_can_be_put_again() {
    let mut m = M::new(1);
    m.mount("seg", 64 * KIB);
    m.start("k", 10 * KIB).unwrap();
    assert!(m.used() >= 10 * KIB);
    m.revoke_as(WRITER, "k").unwrap();
    assert_eq!(code(m.get("k")), ErrorCode::ObjectNotFound);
    assert!(m.start("k", 10).is_ok(), "the key can be put again");
}

/// The writer gave up, but bytes it had sent may still reach the node (a
/// write abandoned on its deadline under packet loss): its space goes to
/// no other put until the grace has passed. Seen in tests/faults.rs before
/// the fix: a revoked put's late bytes landed in the next key's object.
#[test]
fn a_revoked_puts_space_is_reused_only_after_the_grace() {
    let mut m = M::new(1);
    m.mount("seg", 8 * KIB);
    let first = m.start("old", 8 * KIB).unwrap();
    m.revoke_as(WRITER, "old").unwrap();
    assert_eq!(
        code(m.start_with(OTHER, "new", 8 * KIB, opts(1))),
        ErrorCode::NoSpace
    );
    m.advance(m.cfg.stale_put_grace_ms);
    assert_eq!(m.used(), 0);
    let second = m.start_with(OTHER, "new", 8 * KIB, opts(1)).unwrap();
    assert_eq!(second[0].offset, first[0].offset, "now the space is reused");
}

fn placement(put_id: u16) -> PutOptions {
    PutOptions { put_id, ..opts(1) }
}

/// A revoke of placement 1 that reaches the master after the writer placed
/// the key again (placement 2) must not end placement 2: before put ids,
/// it did, freeing placement 2's space while its bytes were being written.
#[test]
fn a_late_revoke_of_an_earlier_placement_leaves_the_later_one() {
    let mut m = M::new(1);
    m.mount("seg", 64 * KIB);
    m.start_with(WRITER, "k", 10, placement(1)).unwrap();
    m.revoke_put("k", 1).unwrap();
    m.start_with(WRITER, "k", 10, placement(2)).unwrap();
    let used = m.used();
    assert_eq!(code(m.revoke_put("k", 1)), ErrorCode::ObjectNotFound);
    assert_eq!(m.used(), used, "placement 2 keeps its space");
    m.end_put("k", 2).unwrap();
    assert!(m.exist("k"));
}

/// Likewise a late PutEnd of placement 1 does not complete placement 2,
/// whose bytes may not be written yet.
#[test]
fn a_late_end_of_an_earlier_placement_does_not_complete_the_later_one() {
    let mut m = M::new(1);
    m.mount("seg", 64 * KIB);
    m.start_with(WRITER, "k", 10, placement(1)).unwrap();
    m.revoke_put("k", 1).unwrap();
    m.start_with(WRITER, "k", 10, placement(2)).unwrap();
    assert_eq!(code(m.end_put("k", 1)), ErrorCode::ObjectNotFound);
    assert_eq!(code(m.get("k")), ErrorCode::ReplicaNotReady);
    m.end_put("k", 2).unwrap();
    assert!(m.exist("k"));
}

/// Put id 0 names no placement: an end or revoke with it acts on the
/// writer's put of the key, whichever it is.
#[test]
fn put_id_zero_ends_whichever_put_the_writer_has() {
    let mut m = M::new(1);
    m.mount("seg", 64 * KIB);
    m.start_with(WRITER, "k", 10, placement(7)).unwrap();
    m.end_put("k", 0).unwrap();
    assert!(m.exist("k"));
}

#[test]
fn put_revoke_from_another_client_is_illegal_client() {
    let mut m = M::new(1);
    m.mount("seg", 64 * KIB);
    m.start("k", 10).unwrap();
    assert_eq!(code(m.revoke_as(OTHER, "k")), ErrorCode::IllegalClient);
    assert!(m.describe("k").size == 10, "still there");
}

// ---- stale puts -----------------------------------------------------------------

#[test]
fn a_processing_object_older_than_put_timeout_is_discarded_and_its_key_can_be_put_again() {
    let mut m = M::new(1);
    m.mount("seg", 64 * KIB);
    m.start("k", 10).unwrap();
    m.advance(m.cfg.put_timeout_ms - 1);
    assert_eq!(
        code(m.start_with(OTHER, "k", 10, opts(1))),
        ErrorCode::ObjectAlreadyExists
    );
    m.advance(1);
    assert!(m.start_with(OTHER, "k", 10, opts(1)).is_ok());
    m.end_as(OTHER, "k").unwrap();
}

#[test]
fn space_of_a_stale_put_is_reused_only_after_its_writer_can_no_longer_touch_it() {
    let mut m = M::new(1);
    m.mount("seg", 8 * KIB);
    let first = m.start("old", 8 * KIB).unwrap();
    m.advance(m.cfg.put_timeout_ms);
    // Discarded, but a late writer might still be sending bytes into it.
    assert_eq!(code(m.get("old")), ErrorCode::ObjectNotFound);
    assert_eq!(
        code(m.start_with(OTHER, "new", 8 * KIB, opts(1))),
        ErrorCode::NoSpace
    );
    m.advance(m.cfg.stale_put_grace_ms);
    let second = m.start_with(OTHER, "new", 8 * KIB, opts(1)).unwrap();
    assert_eq!(second[0].offset, first[0].offset, "now the space is reused");
}

#[test]
fn put_end_after_put_timeout_fails_and_the_put_is_gone() {
    let mut m = M::new(1);
    m.mount("seg", 64 * KIB);
    m.start("k", 10).unwrap();
    m.now += m.cfg.put_timeout_ms; // no housekeeping ran yet
    assert_eq!(code(m.end("k")), ErrorCode::ObjectNotFound);
    assert_eq!(code(m.get("k")), ErrorCode::ObjectNotFound);
}

// ---- GetReplicaList / Exist -----------------------------------------------------

#[test]
fn get_replica_list_of_a_missing_key_is_object_not_found() {
    let mut m = M::new(1);
    assert_eq!(code(m.get("nope")), ErrorCode::ObjectNotFound);
}

#[test]
fn get_replica_list_of_a_key_still_being_put_is_replica_not_ready() {
    let mut m = M::new(1);
    m.mount("seg", 64 * KIB);
    m.start("k", 10).unwrap();
    assert_eq!(code(m.get("k")), ErrorCode::ReplicaNotReady);
}

#[test]
fn get_replica_list_grants_a_lease_of_lease_ttl() {
    let mut m = M::new(1);
    m.mount("seg", 64 * KIB);
    m.put("k", 10);
    assert_eq!(m.describe("k").lease_remaining_ms, 0);
    m.get("k").unwrap();
    assert_eq!(m.describe("k").lease_remaining_ms, m.cfg.lease_ttl_ms);
    m.advance(4_000);
    assert_eq!(
        m.describe("k").lease_remaining_ms,
        m.cfg.lease_ttl_ms - 4_000
    );
}

#[test]
fn exist_is_false_while_processing_and_true_once_complete() {
    let mut m = M::new(1);
    m.mount("seg", 64 * KIB);
    m.start("k", 10).unwrap();
    assert!(!m.exist("k"));
    m.end("k").unwrap();
    assert!(m.exist("k"));
    assert!(!m.exist("other"));
}

#[test]
fn exist_does_not_extend_a_lease() {
    let mut m = M::new(1);
    m.mount("seg", 64 * KIB);
    m.put("k", 10);
    assert!(m.exist("k"));
    assert_eq!(
        m.describe("k").lease_remaining_ms,
        0,
        "a probe grants no lease"
    );
    m.get("k").unwrap();
    m.advance(5_000);
    assert!(m.exist("k"));
    assert_eq!(
        m.describe("k").lease_remaining_ms,
        m.cfg.lease_ttl_ms - 5_000
    );
    assert!(m.remove("k", false).is_err());
    m.advance(5_000);
    assert!(m.exist("k"));
    assert!(
        m.remove("k", false).is_ok(),
        "probing did not keep it leased"
    );
}

// ---- Remove / RemoveAll ---------------------------------------------------------

#[test]
fn remove_of_leased_object_is_refused_until_lease_expires() {
    let mut m = M::new(1);
    m.mount("seg", 64 * KIB);
    m.put("k", 10);
    m.get("k").unwrap();
    assert_eq!(code(m.remove("k", false)), ErrorCode::ObjectHasLease);
    m.advance(m.cfg.lease_ttl_ms - 1);
    assert_eq!(code(m.remove("k", false)), ErrorCode::ObjectHasLease);
    m.advance(1);
    m.remove("k", false).unwrap();
    assert!(!m.exist("k"));
}

#[test]
fn forced_remove_of_a_leased_object_succeeds_but_its_space_waits_for_the_lease() {
    let mut m = M::new(1);
    m.mount("seg", 8 * KIB);
    let first = m.put("k", 8 * KIB);
    m.get("k").unwrap();
    m.remove("k", true).unwrap();
    assert!(!m.exist("k"));
    // The reader may still be reading: the space is not handed out yet.
    assert_eq!(code(m.start("new", 8 * KIB)), ErrorCode::NoSpace);
    m.advance(m.cfg.lease_ttl_ms);
    let second = m.start("new", 8 * KIB).unwrap();
    assert_eq!(second[0].offset, first[0].offset);
}

#[test]
fn remove_of_a_processing_object_is_replica_not_ready() {
    let mut m = M::new(1);
    m.mount("seg", 64 * KIB);
    m.start("k", 10).unwrap();
    assert_eq!(code(m.remove("k", false)), ErrorCode::ReplicaNotReady);
    assert_eq!(code(m.remove("k", true)), ErrorCode::ReplicaNotReady);
}

#[test]
fn remove_of_a_missing_key_is_object_not_found() {
    let mut m = M::new(1);
    assert_eq!(code(m.remove("nope", false)), ErrorCode::ObjectNotFound);
}

#[test]
fn remove_all_removes_what_it_may_and_returns_the_count() {
    let mut m = M::new(4);
    m.mount("seg", 256 * KIB);
    for i in 0..10 {
        m.put(&format!("k{i}"), 100);
    }
    m.get("k0").unwrap(); // leased: stays
    m.start("p", 100).unwrap(); // processing: stays
    let r = m.call(Q::RemoveAll { force: false }).unwrap();
    assert_eq!(r, A::Removed(9));
    assert!(m.exist("k0"));
    assert_eq!(m.stat().keys, 2);
}

#[test]
fn forced_remove_all_removes_leased_objects_but_their_space_waits_for_the_lease() {
    let mut m = M::new(1);
    m.mount("seg", 8 * KIB);
    let first = m.put("k", 8 * KIB);
    m.get("k").unwrap(); // leased
    assert_eq!(m.call(Q::RemoveAll { force: true }).unwrap(), A::Removed(1));
    assert!(!m.exist("k"));
    // The reader may still be reading: the space is not handed out yet.
    assert_eq!(code(m.start("new", 8 * KIB)), ErrorCode::NoSpace);
    m.advance(m.cfg.lease_ttl_ms);
    let second = m.start("new", 8 * KIB).unwrap();
    assert_eq!(second[0].offset, first[0].offset);
    // Processing objects stay, forced or not.
    m.start("q", 10).ok();
    assert_eq!(m.call(Q::RemoveAll { force: true }).unwrap(), A::Removed(0));
}

// ---- replace (upsert) -------------------------------------------------------------

fn replacing(replicas: u32) -> PutOptions {
    PutOptions {
        replace: true,
        ..opts(replicas)
    }
}

impl M {
    fn replace_as(
        &mut self,
        client: u64,
        key: &str,
        len: u64,
    ) -> Result<Vec<ReplicaDesc>, KvError> {
        self.start_with(client, key, len, replacing(1))
    }

    /// A whole replace by `client`: start, then end.
    fn upsert_as(&mut self, client: u64, key: &str, len: u64) {
        self.replace_as(client, key, len).expect("a replace starts");
        self.end_as(client, key).expect("a replace ends");
    }

    /// Every shard's space accounting holds (`ShardState::check_invariants`).
    fn check(&self) {
        for (i, sh) in self.m.shards.iter().enumerate() {
            if let Err(e) = sh.check_invariants() {
                panic!("shard {i}: {e}");
            }
        }
    }
}

#[test]
fn a_replace_of_a_stored_key_is_read_as_the_old_object_until_its_put_end() {
    let mut m = M::new(2);
    m.mount("seg", 64 * KIB);
    let old = m.put("k", 100);
    let new = m.replace_as(WRITER, "k", 200).unwrap();
    assert_ne!(new[0].offset, old[0].offset, "new space, beside the old");
    m.check();
    // Readers, probes and the admin view still see the old object.
    assert_eq!(m.get("k").unwrap(), old);
    assert!(m.exist("k"));
    let info = m.describe("k");
    assert!(info.complete);
    assert_eq!(info.size, 100);
    assert_eq!(m.stat().keys, 1, "a key being replaced counts once");
    m.end("k").unwrap();
    // In one step: the new object is the one read.
    let got = m.get("k").unwrap();
    assert_eq!((got[0].offset, got[0].len), (new[0].offset, 200));
    assert_eq!(m.describe("k").size, 200);
    assert_eq!(m.stat().keys, 1);
    m.check();
}

#[test]
fn the_replaced_objects_space_is_freed_at_once_when_nobody_reads_it() {
    let mut m = M::new(1);
    m.mount("seg", 64 * KIB);
    m.put("k", 4 * KIB);
    m.replace_as(WRITER, "k", 4 * KIB).unwrap();
    assert_eq!(m.used(), 8 * KIB, "both while the replace is under way");
    m.end("k").unwrap();
    assert_eq!(m.used(), 4 * KIB, "no lease: the old space is back at once");
    m.check();
}

#[test]
fn the_replaced_objects_space_is_not_reused_while_a_lease_on_it_lives() {
    let mut m = M::new(1);
    m.mount("seg", 16 * KIB);
    let old = m.put("k", 8 * KIB);
    m.get("k").unwrap(); // a reader holds a lease on the old object
    m.advance(1_000);
    m.replace_as(WRITER, "k", 8 * KIB).unwrap();
    m.end("k").unwrap();
    m.get("k").unwrap(); // and one on the new (so eviction takes neither)
    m.check();
    // The old object is gone, but its reader may still be copying it.
    assert_eq!(m.used(), 16 * KIB);
    assert_eq!(code(m.start("x", 8 * KIB)), ErrorCode::NoSpace);
    // The old lease ends first: then exactly its space is handed out.
    m.advance(m.cfg.lease_ttl_ms - 1_000);
    let x = m.start("x", 8 * KIB).unwrap();
    assert_eq!(x[0].offset, old[0].offset);
    m.check();
}

#[test]
fn a_revoked_or_stale_replace_leaves_the_old_object_as_it_was() {
    let mut m = M::new(1);
    m.mount("seg", 64 * KIB);
    let old = m.put("k", 100);
    let used = m.used();
    m.replace_as(WRITER, "k", 5 * KIB).unwrap();
    m.revoke_as(WRITER, "k").unwrap();
    assert_eq!(m.get("k").unwrap(), old);
    m.advance(m.cfg.stale_put_grace_ms); // the revoked put's quarantine
    assert_eq!(m.used(), used, "the replace's space went back");
    // A replace nobody finishes is discarded as stale; the old object stays.
    m.replace_as(OTHER, "k", 5 * KIB).unwrap();
    m.advance(m.cfg.put_timeout_ms);
    assert_eq!(code(m.end_as(OTHER, "k")), ErrorCode::ObjectAlreadyExists);
    let got = m.get("k").unwrap();
    assert_eq!((got[0].offset, got[0].len), (old[0].offset, 100));
    m.check();
}

#[test]
fn a_replace_while_another_client_puts_the_key_is_try_again() {
    let mut m = M::new(1);
    m.mount("seg", 64 * KIB);
    m.put("k", 100);
    m.replace_as(WRITER, "k", 200).unwrap();
    let e = m.replace_as(OTHER, "k", 300).unwrap_err();
    assert_eq!(e.code, ErrorCode::TryAgain, "{e}");
    assert!(e.message.contains("another writer"), "{e}");
    // The same writer twice is a bug of that writer, as before.
    assert_eq!(
        code(m.replace_as(WRITER, "k", 200)),
        ErrorCode::ObjectAlreadyExists
    );
    // A plain put of a stored key is refused, replace under way or not.
    assert_eq!(
        code(m.start_with(OTHER, "k", 300, opts(1))),
        ErrorCode::ObjectAlreadyExists
    );
    // Once the first ends, the second replaces its object: the last wins.
    m.end("k").unwrap();
    m.upsert_as(OTHER, "k", 300);
    assert_eq!(m.get("k").unwrap()[0].len, 300);
    // Another client's plain put of a new key under way: the same wait.
    m.start("fresh", 100).unwrap();
    assert_eq!(code(m.replace_as(OTHER, "fresh", 50)), ErrorCode::TryAgain);
    m.end("fresh").unwrap();
    m.upsert_as(OTHER, "fresh", 50);
    assert_eq!(m.get("fresh").unwrap()[0].len, 50);
    m.check();
}

#[test]
fn a_replace_meeting_a_stale_put_of_the_key_discards_it_and_goes_ahead() {
    let mut m = M::new(1);
    m.mount("seg", 64 * KIB);
    m.put("k", 100);
    m.replace_as(WRITER, "k", 200).unwrap();
    m.now += m.cfg.put_timeout_ms; // no housekeeping ran yet
    m.upsert_as(OTHER, "k", 300);
    assert_eq!(m.get("k").unwrap()[0].len, 300);
    m.check();
}

#[test]
fn a_replace_of_a_missing_key_is_an_ordinary_put() {
    let mut m = M::new(1);
    m.mount("seg", 64 * KIB);
    let r = m.replace_as(WRITER, "k", 100).unwrap();
    assert!(!m.exist("k"));
    assert_eq!(code(m.get("k")), ErrorCode::ReplicaNotReady);
    m.end("k").unwrap();
    assert_eq!(m.get("k").unwrap(), r);
    m.check();
}

#[test]
fn a_replace_of_a_stored_key_is_not_refused_for_the_key_count() {
    let mut c = cfg();
    c.max_keys = 2;
    let mut m = M::with(1, c);
    m.mount("seg", 64 * KIB);
    m.put("a", 10);
    m.put("b", 10);
    assert_eq!(code(m.start("c", 10)), ErrorCode::ResourceExhausted);
    // Not a new key in the end: allowed at the limit.
    m.replace_as(WRITER, "a", 20).unwrap();
    // Its entry counts while it lasts; a new key is still refused.
    assert_eq!(code(m.start("c", 10)), ErrorCode::ResourceExhausted);
    assert_eq!(
        code(m.replace_as(OTHER, "c", 10)),
        ErrorCode::ResourceExhausted,
        "a replace of a missing key adds one"
    );
    m.end("a").unwrap();
    assert_eq!(m.stat().keys, 2);
    assert_eq!(code(m.start("c", 10)), ErrorCode::ResourceExhausted);
    m.check();
}

#[test]
fn remove_during_a_replace_takes_the_old_object_and_the_replace_still_completes() {
    let mut m = M::new(1);
    m.mount("seg", 64 * KIB);
    m.put("k", 100);
    let new = m.replace_as(WRITER, "k", 200).unwrap();
    m.remove("k", false).unwrap();
    assert!(!m.exist("k"));
    assert_eq!(code(m.get("k")), ErrorCode::ReplicaNotReady);
    assert_eq!(code(m.remove("k", true)), ErrorCode::ReplicaNotReady);
    m.end("k").unwrap();
    assert_eq!(m.get("k").unwrap(), new);
    assert_eq!(m.used(), 256, "only the new object's space is held");
    m.check();
}

#[test]
fn batch_put_start_with_replace_replaces_each_stored_key() {
    let mut m = M::new(4);
    m.mount("seg", 256 * KIB);
    for k in ["a", "b"] {
        m.put(k, 100);
    }
    let r = m
        .call(Q::BatchPutStart {
            client_id: WRITER,
            items: items(&["a", "b", "new"], 300),
            opts: replacing(1),
        })
        .unwrap();
    let A::BatchReplicas(v) = r else {
        panic!("{r:?}")
    };
    assert!(v.iter().all(|i| matches!(i, ItemResult::Ok(_))), "{v:?}");
    assert_eq!(m.get("a").unwrap()[0].len, 100, "old until the end");
    m.call(Q::BatchPutEnd {
        client_id: WRITER,
        put_id: 0,
        items: ["a", "b", "new"]
            .iter()
            .map(|k| kvpool_wire::proto::PutDone {
                key: k.as_bytes().to_vec(),
                checksum: None,
            })
            .collect(),
    })
    .unwrap();
    for k in ["a", "b", "new"] {
        assert_eq!(m.get(k).unwrap()[0].len, 300, "{k}");
    }
    assert_eq!(m.stat().keys, 3);
    m.check();
}

// ---- batches --------------------------------------------------------------------

fn items(keys: &[&str], len: u64) -> Vec<PutItem> {
    keys.iter()
        .map(|k| PutItem {
            key: k.as_bytes().to_vec(),
            len,
        })
        .collect()
}

fn keys(ks: &[&str]) -> Vec<Vec<u8>> {
    ks.iter().map(|k| k.as_bytes().to_vec()).collect()
}

#[test]
fn batch_put_start_gives_one_result_per_key_in_order() {
    let mut m = M::new(4);
    m.mount("seg", 256 * KIB);
    m.put("taken", 10);
    let ks = ["a", "taken", "", "b", "c"];
    let r = m
        .call(Q::BatchPutStart {
            client_id: WRITER,
            items: items(&ks, 100),
            opts: opts(1),
        })
        .unwrap();
    let A::BatchReplicas(v) = r else {
        panic!("{r:?}")
    };
    assert_eq!(v.len(), 5);
    assert!(matches!(v[0], ItemResult::Ok(_)));
    assert!(matches!(&v[1], ItemResult::Err(e) if e.code == ErrorCode::ObjectAlreadyExists.code()));
    assert!(matches!(&v[2], ItemResult::Err(e) if e.code == ErrorCode::InvalidParams.code()));
    assert!(matches!(v[3], ItemResult::Ok(_)));
    assert!(matches!(v[4], ItemResult::Ok(_)));
}

#[test]
fn batch_put_end_and_revoke_report_each_key() {
    let mut m = M::new(4);
    m.mount("seg", 256 * KIB);
    let ks: Vec<String> = (0..8).map(|i| format!("key-{i}")).collect();
    let ks: Vec<&str> = ks.iter().map(String::as_str).collect();
    m.call(Q::BatchPutStart {
        client_id: WRITER,
        items: items(&ks, 100),
        opts: opts(1),
    })
    .unwrap();
    let r = m
        .call(Q::BatchPutEnd {
            client_id: WRITER,
            put_id: 0,
            items: keys(&[ks[0], ks[1], "missing", ks[2]])
                .into_iter()
                .map(|key| kvpool_wire::proto::PutDone {
                    key,
                    checksum: None,
                })
                .collect(),
        })
        .unwrap();
    let A::BatchDone(v) = r else { panic!("{r:?}") };
    assert!(matches!(v[0], ItemResult::Ok(())));
    assert!(matches!(v[1], ItemResult::Ok(())));
    assert!(matches!(&v[2], ItemResult::Err(e) if e.code == ErrorCode::ObjectNotFound.code()));
    assert!(matches!(v[3], ItemResult::Ok(())));
    let r = m
        .call(Q::BatchPutRevoke {
            client_id: OTHER,
            put_id: 0,
            keys: keys(&[ks[3], ks[4]]),
        })
        .unwrap();
    let A::BatchDone(v) = r else { panic!("{r:?}") };
    assert!(v
        .iter()
        .all(|x| matches!(x, ItemResult::Err(e) if e.code == ErrorCode::IllegalClient.code())));
    let r = m
        .call(Q::BatchPutRevoke {
            client_id: WRITER,
            put_id: 0,
            keys: keys(&[ks[3], ks[4]]),
        })
        .unwrap();
    let A::BatchDone(v) = r else { panic!("{r:?}") };
    assert!(v.iter().all(|x| matches!(x, ItemResult::Ok(()))));
}

#[test]
fn batch_get_exist_and_remove_keep_the_order_of_keys_across_shards() {
    let mut m = M::new(4);
    m.mount("seg", 1 << 20);
    let ks: Vec<String> = (0..40).map(|i| format!("obj-{i}")).collect();
    for (i, k) in ks.iter().enumerate() {
        if i % 3 != 0 {
            m.put(k, 64 + i as u64);
        }
    }
    let all: Vec<&str> = ks.iter().map(String::as_str).collect();
    let shards: std::collections::HashSet<usize> =
        all.iter().map(|k| m.m.shard_of(k.as_bytes())).collect();
    assert!(shards.len() > 1, "the batch spans shards");
    let A::BatchReplicas(v) = m.call(Q::BatchGet { keys: keys(&all) }).unwrap() else {
        panic!()
    };
    for (i, r) in v.iter().enumerate() {
        match r {
            ItemResult::Ok(reps) => {
                assert!(i % 3 != 0);
                assert_eq!(reps[0].len, 64 + i as u64, "result {i} is key {i}'s");
            }
            ItemResult::Err(e) => {
                assert!(i % 3 == 0);
                assert_eq!(e.code, ErrorCode::ObjectNotFound.code());
            }
        }
    }
    let A::BatchExists(v) = m.call(Q::BatchExist { keys: keys(&all) }).unwrap() else {
        panic!()
    };
    for (i, r) in v.iter().enumerate() {
        assert!(matches!(r, ItemResult::Ok(b) if *b == (i % 3 != 0)));
    }
    m.advance(m.cfg.lease_ttl_ms);
    let A::BatchDone(v) = m
        .call(Q::BatchRemove {
            keys: keys(&all),
            force: false,
        })
        .unwrap()
    else {
        panic!()
    };
    for (i, r) in v.iter().enumerate() {
        assert_eq!(matches!(r, ItemResult::Ok(())), i % 3 != 0, "result {i}");
    }
    assert_eq!(m.stat().keys, 0);
}

#[test]
fn a_batch_over_max_batch_is_invalid_params() {
    let mut m = M::new(2);
    let many: Vec<String> = (0..m.cfg.max_batch + 1).map(|i| format!("k{i}")).collect();
    let many: Vec<&str> = many.iter().map(String::as_str).collect();
    assert_eq!(
        code(m.call(Q::BatchExist { keys: keys(&many) })),
        ErrorCode::InvalidParams
    );
}

#[test]
fn an_empty_batch_gets_an_empty_answer() {
    let mut m = M::new(2);
    assert_eq!(
        m.call(Q::BatchGet { keys: vec![] }).unwrap(),
        A::BatchReplicas(vec![])
    );
    assert_eq!(
        m.call(Q::BatchExist { keys: vec![] }).unwrap(),
        A::BatchExists(vec![])
    );
}

// ---- placement, stat, describe ---------------------------------------------------------

#[test]
fn local_first_placement_prefers_the_writers_host() {
    let mut c = cfg();
    c.placement = Placement::LocalFirst;
    let mut m = M::with(1, c);
    m.mount_as(NODE, "far", 1 << 20, "host-far");
    let near = m.mount_as(NODE, "near", 64 * KIB, "host-near");
    for i in 0..5 {
        let r = m
            .start_with(
                WRITER,
                &format!("k{i}"),
                100,
                PutOptions {
                    preferred_host: "host-near".into(),
                    ..opts(1)
                },
            )
            .unwrap();
        assert_eq!(r[0].segment_id, near);
    }
}

#[test]
fn free_ratio_first_placement_prefers_the_emptiest_segment() {
    let mut m = M::new(1);
    let a = m.mount("a", 64 * KIB);
    let b = m.mount("b", 64 * KIB);
    let first = m.put("k0", 32 * KIB)[0].segment_id;
    let second = m.put("k1", 100)[0].segment_id;
    assert_ne!(first, second, "the other segment was emptier");
    assert!([a, b].contains(&first));
}

#[test]
fn random_placement_spreads_over_segments_and_is_seeded() {
    let mut c = cfg();
    c.placement = Placement::Random;
    let run = || {
        let mut m = M::with(1, c.clone());
        let ids: Vec<SegmentId> = (0..4).map(|i| m.mount(&format!("s{i}"), 1 << 20)).collect();
        let picks: Vec<SegmentId> = (0..40)
            .map(|i| m.put(&format!("k{i}"), 100)[0].segment_id)
            .collect();
        (ids, picks)
    };
    let (ids, picks) = run();
    for id in &ids {
        assert!(picks.contains(id), "every segment gets some");
    }
    assert_eq!(run().1, picks, "same seed, same placement");
}

#[test]
fn stat_reports_keys_capacity_use_and_evictions() {
    let mut m = M::new(2);
    m.mount("a", 64 * KIB);
    m.mount("b", 128 * KIB);
    m.put("k", 1000);
    let s = m.stat();
    assert_eq!(s.keys, 1);
    assert_eq!(s.capacity, 192 * KIB);
    assert_eq!(s.used, 1024, "rounded to 64-byte alignment");
    assert_eq!(s.evictions, 0);
    assert_eq!(s.segments.iter().map(|g| g.used).sum::<u64>(), 1024);
}

#[test]
fn describe_reports_state_size_replicas_and_pins() {
    let mut m = M::new(1);
    m.mount("seg", 64 * KIB);
    m.start_with(
        WRITER,
        "k",
        500,
        PutOptions {
            soft_pin_ttl_ms: 5_000,
            hard_pin: true,
            ..opts(1)
        },
    )
    .unwrap();
    let i = m.describe("k");
    assert!(!i.complete);
    assert_eq!(i.size, 500);
    m.end("k").unwrap();
    m.advance(1_000);
    let i = m.describe("k");
    assert!(i.complete && i.hard_pin);
    assert_eq!(i.soft_pin_remaining_ms, 4_000);
    assert_eq!(i.replicas.len(), 1);
    assert_eq!(
        code(m.call(Q::Describe {
            key: b"nope".to_vec()
        })),
        ErrorCode::ObjectNotFound
    );
}

#[test]
fn each_shard_allocates_only_in_its_own_range_of_a_segment() {
    let mut m = M::new(4);
    m.mount("seg", 4 * 64 * KIB);
    for i in 0..200 {
        let k = format!("k{i}");
        let shard = m.m.shard_of(k.as_bytes()) as u64;
        let r = m.put(&k, 100);
        let (lo, hi) = (shard * 64 * KIB, (shard + 1) * 64 * KIB);
        assert!(
            r[0].offset >= lo && r[0].offset + 100 <= hi,
            "{k} in shard {shard}'s range"
        );
    }
}

#[test]
fn shard_state_size_stays_within_the_budget() {
    // Guard for the 200-bytes-per-object budget (the RSS bench measures it).
    let _ = Arc::new(0);
    let mut m = M::new(1);
    m.mount("seg", 1 << 30);
    for i in 0..10_000 {
        m.put(&format!("{i:08}"), 64);
    }
    assert_eq!(m.stat().keys, 10_000);
}
