//! The master's behaviour, row by row of DESIGN §4, against the real state
//! machines (`MasterCore`: every shard and the coordinator) on a simulated
//! clock. No sleeps: time moves only when a test says so.

use std::sync::Arc;

use kvpool_config::{MasterConfig, Placement};
use kvpool_master::core::MasterCore;
use kvpool_transport::proto::{
    Endpoint, ItemResult, MasterRequest as Q, MasterResponse as A, ObjectInfo, PoolStat, PutItem,
    PutOptions, ReplicaDesc, SegmentId, SegmentSpec,
};
use kvpool_transport::{ErrorCode, KvError};

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
        tier: kvpool_transport::proto::Tier::Dram,
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
    nv.tier = kvpool_transport::proto::Tier::Nvme;
    let r = m.call(Q::MountSegment {
        client_id: NODE,
        spec: nv,
    });
    assert_eq!(code(r), ErrorCode::InvalidParams);
    let r = m.get("k").unwrap();
    assert_eq!(r[0].tier, kvpool_transport::proto::Tier::Dram);
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
            .map(|k| kvpool_transport::proto::PutDone {
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
                .map(|key| kvpool_transport::proto::PutDone {
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

// ---- pins and eviction ------------------------------------------------------------

/// One shard, one segment of 100 KiB, objects of 1 KiB.
fn small_pool() -> M {
    let mut m = M::new(1);
    m.mount("seg", 100 * KIB);
    m
}

fn fill(m: &mut M, prefix: &str, n: usize, o: PutOptions) {
    for i in 0..n {
        m.put_with(&format!("{prefix}{i}"), KIB, o.clone());
        m.advance(1);
    }
}

#[test]
fn passing_the_high_watermark_evicts_about_eviction_ratio_of_the_segment() {
    let mut m = small_pool();
    fill(&mut m, "k", 90, opts(1));
    assert_eq!(m.stat().keys, 90, "90% is not past the watermark");
    m.advance(m.cfg.lease_ttl_ms); // a lease past the puts
    m.put("k90", KIB);
    let s = m.stat();
    assert_eq!(s.evictions, 5, "5% of 100 KiB = 5 objects of 1 KiB");
    assert_eq!(s.evicted_bytes, 5 * KIB);
    assert_eq!(s.keys, 86);
}

#[test]
fn eviction_takes_the_oldest_lease_first() {
    let mut m = small_pool();
    fill(&mut m, "k", 90, opts(1));
    // Read the five oldest: their leases now end last.
    for i in 0..5 {
        m.get(&format!("k{i}")).unwrap();
    }
    m.advance(m.cfg.lease_ttl_ms);
    m.put("trigger", KIB);
    for i in 0..5 {
        assert!(m.exist(&format!("k{i}")), "recently read k{i} survived");
    }
    for i in 5..10 {
        assert!(!m.exist(&format!("k{i}")), "k{i}, the oldest unread, went");
    }
}

#[test]
fn leased_objects_are_not_evicted() {
    let mut m = small_pool();
    fill(&mut m, "k", 90, opts(1));
    for i in 0..90 {
        m.get(&format!("k{i}")).unwrap();
    }
    m.put("trigger", KIB);
    assert_eq!(m.stat().evictions, 0);
    assert_eq!(m.stat().keys, 91);
}

/// A put is a use (issue 31): where eviction drops the only copy, a value
/// is kept for a lease after its put as after a read, so a writer (or the
/// decode instance it hands the key to) reads back what it was told is
/// stored. Was: unread values ranked by their completion time, before
/// every value read since, and a pool under pressure dropped a value put a
/// moment ago.
#[test]
fn a_value_is_kept_for_a_lease_after_its_put_as_after_a_read() {
    let mut m = small_pool();
    fill(&mut m, "read", 89, opts(1));
    for i in 0..89 {
        m.get(&format!("read{i}")).unwrap(); // leased until now + ttl
    }
    m.put("new", KIB); // 90%: not past the watermark
    m.advance(10);
    m.put("trigger", KIB); // past it: an eviction episode is owed
    assert_eq!(
        m.stat().evictions,
        0,
        "nothing read or put within a lease goes"
    );
    assert!(m.exist("new"), "the value put a moment ago was dropped");
    // A lease later they rank by their last use and go in that order.
    m.advance(m.cfg.lease_ttl_ms);
    m.put("again", KIB);
    assert!(m.stat().evictions > 0);
    assert!(m.exist("again"));
    // Nothing left to take but values put within a lease: the pool says so.
    let mut c = cfg();
    c.high_watermark = 1.0;
    let mut m = M::with(1, c);
    m.mount("seg", 10 * KIB);
    fill(&mut m, "k", 10, opts(1));
    assert_eq!(code(m.start("more", KIB)), ErrorCode::NoSpace);
    assert!(
        (0..10).all(|i| m.exist(&format!("k{i}"))),
        "nothing dropped"
    );
    m.advance(m.cfg.lease_ttl_ms);
    m.start("more", KIB).unwrap();
    assert!(!m.exist("k0"), "a lease later, the oldest put goes");
}

/// A master on a state directory, as `[master] state_dir` (a restart, or
/// the HA leader that takes over).
fn on_state_dir(dir: &std::path::Path, now: u64) -> M {
    let cfg = cfg();
    M {
        m: MasterCore::open(1, &cfg, 42, dir, now, 1_700_000_000_000).expect("open"),
        now,
        cfg,
        live: Vec::new(),
    }
}

/// Issue 29, item 7: the objects a restarted master (or a new HA leader)
/// recovers count as read at the take-over, and keys put since as read at
/// their put, so under pressure the older recovered objects go first. Was:
/// recovered objects ranked a lease after the take-over and new puts at
/// their completion, so the first keys the new leader acknowledged were
/// evicted before every recovered one.
#[test]
fn after_a_restart_recovered_objects_are_evicted_before_keys_put_since() {
    let dir = std::env::temp_dir().join(format!("kvpool-mb-recovered-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut m = on_state_dir(&dir, 1_000);
    m.mount("seg", 100 * KIB);
    fill(&mut m, "old", 45, opts(1));
    drop(m); // the master goes
    let mut m = on_state_dir(&dir, 120_000);
    m.mount("seg", 100 * KIB); // its node mounts again: the objects come back
    assert!(m.exist("old0") && m.exist("old44"));
    m.advance(10);
    fill(&mut m, "new", 45, opts(1));
    m.advance(m.cfg.lease_ttl_ms + 100); // every lease and keep is over
    m.put("trigger", KIB); // 91 of 100 KiB: past the watermark
    assert_eq!(m.stat().evictions, 5);
    for i in 0..45 {
        assert!(
            m.exist(&format!("new{i}")),
            "new{i}, put after the restart, went"
        );
    }
    let left = (0..45).filter(|i| m.exist(&format!("old{i}"))).count();
    assert_eq!(left, 40, "five recovered objects went");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn soft_pinned_objects_are_evicted_only_after_unpinned_ones() {
    let mut m = small_pool();
    let pinned = PutOptions {
        soft_pin_ttl_ms: 3_600_000,
        ..opts(1)
    };
    fill(&mut m, "pin", 10, pinned); // the oldest, but pinned
    fill(&mut m, "k", 80, opts(1));
    m.advance(m.cfg.lease_ttl_ms);
    m.put("trigger", KIB);
    assert_eq!(m.stat().evictions, 5);
    for i in 0..10 {
        assert!(m.exist(&format!("pin{i}")));
    }
    for i in 0..5 {
        assert!(!m.exist(&format!("k{i}")));
    }
}

#[test]
fn soft_pinned_objects_are_evicted_when_nothing_else_is_left() {
    let mut m = small_pool();
    let pinned = PutOptions {
        soft_pin_ttl_ms: 3_600_000,
        ..opts(1)
    };
    fill(&mut m, "pin", 90, pinned);
    m.advance(m.cfg.lease_ttl_ms);
    m.put("trigger", KIB);
    assert_eq!(
        m.stat().evictions,
        5,
        "a soft pin is a preference, not a guarantee"
    );
}

#[test]
fn an_expired_soft_pin_no_longer_protects() {
    let mut m = small_pool();
    let pinned = PutOptions {
        soft_pin_ttl_ms: 1_000,
        ..opts(1)
    };
    fill(&mut m, "pin", 10, pinned);
    fill(&mut m, "k", 80, opts(1));
    m.advance(m.cfg.lease_ttl_ms.max(2_000));
    m.put("trigger", KIB);
    for i in 0..5 {
        assert!(!m.exist(&format!("pin{i}")), "oldest, pin expired");
    }
}

#[test]
fn soft_pin_never_blocks_remove() {
    let mut m = small_pool();
    m.put_with(
        "k",
        KIB,
        PutOptions {
            soft_pin_ttl_ms: 60_000,
            ..opts(1)
        },
    );
    m.remove("k", false).unwrap();
    assert!(!m.exist("k"));
}

#[test]
fn hard_pinned_objects_are_never_evicted() {
    let mut m = small_pool();
    let hard = PutOptions {
        hard_pin: true,
        ..opts(1)
    };
    fill(&mut m, "hard", 90, hard);
    assert_eq!(code(m.start("next", 20 * KIB)), ErrorCode::NoSpace);
    assert_eq!(m.stat().evictions, 0);
    assert_eq!(m.stat().keys, 90);
}

#[test]
fn hard_pinned_objects_can_be_removed() {
    let mut m = small_pool();
    m.put_with(
        "k",
        KIB,
        PutOptions {
            hard_pin: true,
            ..opts(1)
        },
    );
    assert!(m.describe("k").hard_pin);
    m.remove("k", false).unwrap();
    assert!(!m.exist("k"));
}

#[test]
fn a_failed_allocation_evicts_then_retries_once() {
    let mut c = cfg();
    c.high_watermark = 1.0; // only a failed allocation evicts
    let mut m = M::with(1, c);
    m.mount("seg", 100 * KIB);
    fill(&mut m, "k", 100, opts(1));
    assert_eq!(m.stat().evictions, 0);
    m.advance(m.cfg.lease_ttl_ms);
    m.start("big", 3 * KIB).unwrap();
    let s = m.stat();
    assert_eq!(s.evictions, 5, "5% freed, then the allocation succeeded");
    assert!(!m.exist("k0") && !m.exist("k4") && m.exist("k5"));
}

#[test]
fn eviction_of_one_replica_keeps_the_object_readable_from_the_other() {
    let mut c = cfg();
    c.high_watermark = 1.0;
    let mut m = M::with(1, c);
    let a = m.mount("a", 10 * KIB);
    m.mount("b", 100 * KIB);
    m.put_with("two", KIB, opts(2));
    m.advance(1);
    for i in 0..9 {
        m.put_with(
            &format!("a{i}"),
            KIB,
            PutOptions {
                preferred_host: "host-a".into(),
                ..opts(1)
            },
        );
        m.advance(1);
    }
    // Segment a is full; a put that only fits there evicts "two"'s replica.
    m.advance(m.cfg.lease_ttl_ms);
    let big = m.start_with(WRITER, "big", 95 * KIB, opts(1)).unwrap();
    assert_ne!(big[0].segment_id, a);
    let r = m.get("two").unwrap();
    assert!(!r.is_empty(), "still readable");
}

#[test]
fn evicted_space_is_reused_by_new_puts() {
    let mut c = cfg();
    c.high_watermark = 1.0;
    let mut m = M::with(1, c);
    m.mount("seg", 10 * KIB);
    fill(&mut m, "k", 10, opts(1));
    let first = m.describe("k0").replicas[0].offset;
    m.advance(m.cfg.lease_ttl_ms);
    let r = m.start("new", KIB).unwrap();
    assert_eq!(r[0].offset, first, "the oldest object's space");
}

// ---- liveness and draining ----------------------------------------------------------

#[test]
fn a_silent_storage_node_has_its_segments_unmounted_after_client_ttl() {
    let mut m = M::new(2);
    m.mount_as(NODE, "dead-node", 64 * KIB, "h1");
    m.mount_as(NODE + 1, "live-node", 64 * KIB, "h2");
    m.put_with("both", 10, opts(2));
    m.put("solo", 10);
    m.kill(NODE);
    m.advance(m.cfg.client_ttl_ms - 1000);
    assert_eq!(
        m.stat().segments.len(),
        2,
        "not yet: silent for less than client_ttl"
    );
    m.advance(1000);
    let s = m.stat();
    assert_eq!(s.segments.len(), 1);
    assert_eq!(s.segments[0].name, "live-node");
    assert_eq!(m.get("both").unwrap().len(), 1, "the surviving replica");
    // "solo" was placed on one of the two; it is readable only if it survived.
    let solo_ok = m.get("solo").is_ok();
    assert_eq!(solo_ok, m.stat().keys == 2);
    assert!(m.start("new", 10).is_ok(), "new puts go to the survivor");
}

#[test]
fn a_pinging_storage_node_keeps_its_segments() {
    let mut m = M::new(1);
    m.mount("seg", 64 * KIB);
    m.advance(30 * m.cfg.client_ttl_ms);
    assert_eq!(m.stat().segments.len(), 1);
}

#[test]
fn a_silent_writer_has_its_processing_puts_revoked() {
    let mut m = M::new(2);
    m.mount("seg", 64 * KIB);
    m.ping(WRITER); // the writer is a pinging client, then goes silent
    m.start("k", 10).unwrap();
    m.advance(m.cfg.client_ttl_ms - 1000);
    assert_eq!(code(m.get("k")), ErrorCode::ReplicaNotReady, "not yet");
    m.advance(1000);
    assert_eq!(code(m.get("k")), ErrorCode::ObjectNotFound);
    assert!(m.start_with(OTHER, "k", 10, opts(1)).is_ok());
}

#[test]
fn a_draining_segment_keeps_serving_reads_and_takes_no_new_puts() {
    let mut m = M::new(1);
    let a = m.mount("a", 64 * KIB);
    let b = m.mount("b", 64 * KIB);
    m.put_with("k", 10, opts(2));
    m.call(Q::DrainSegment { segment_id: a }).unwrap();
    assert!(m.stat().segments.iter().any(|s| s.id == a && s.draining));
    assert_eq!(
        m.get("k").unwrap().len(),
        2,
        "existing replicas stay readable"
    );
    for i in 0..10 {
        let r = m.start(&format!("n{i}"), 10).unwrap();
        assert_eq!(r[0].segment_id, b);
    }
}

#[test]
fn drain_of_an_unknown_segment_is_segment_not_found() {
    let mut m = M::new(1);
    assert_eq!(
        code(m.call(Q::DrainSegment { segment_id: 99 })),
        ErrorCode::SegmentNotFound
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

// ---- NVMe tier ------------------------------------------------------------------

use kvpool_transport::proto::{NodeTask, NvmeAttach, NvmeUpdate, Tier};

const NVME: SegmentId = 0x4e56_4d45;

/// One shard; a 10 KiB DRAM segment whose node has an NVMe tier.
fn tiered(write_through: bool) -> (M, SegmentId) {
    let mut c = cfg();
    c.promote_after_reads = 2;
    let mut m = M::with(1, c);
    let id = mount_node(&mut m, write_through);
    (m, id)
}

/// `NODE` mounts its NVMe tier and its DRAM segment "dram" (the tier
/// attached); returns the DRAM segment's id.
fn mount_node(m: &mut M, write_through: bool) -> SegmentId {
    if !m.live.contains(&NODE) {
        m.live.push(NODE);
    }
    mount_tier(m);
    mount_tiered_dram(m, "dram", write_through)
}

fn mount_tier(m: &mut M) {
    let mut nv = spec("nvme:host-a:/dev/x", 1 << 30, "host-a");
    nv.tier = Tier::Nvme;
    let r = m
        .call(Q::MountSegment {
            client_id: NODE,
            spec: nv,
        })
        .unwrap();
    assert!(
        matches!(r, A::Mounted { segment_id } if segment_id == kvpool_transport::proto::segment_id_for("nvme:host-a:/dev/x"))
    );
}

/// The tier's report of a copy of `key` at `loc` (no checksum).
fn recovered(key: &str, loc: u64) -> NvmeUpdate {
    NvmeUpdate::Recovered {
        key: key.as_bytes().to_vec(),
        nvme: nvme_id(),
        loc,
        len: 100,
        sum: 0,
    }
}

/// Mounts a 10 KiB DRAM segment `name` of `NODE` with the tier attached.
fn mount_tiered_dram(m: &mut M, name: &str, write_through: bool) -> SegmentId {
    let mut dram = spec(name, 10 * KIB, "host-a");
    dram.nvme = Some(NvmeAttach {
        segment_id: nvme_id(),
        write_through,
    });
    match m
        .call(Q::MountSegment {
            client_id: NODE,
            spec: dram,
        })
        .unwrap()
    {
        A::Mounted { segment_id } => segment_id,
        other => panic!("{other:?}"),
    }
}

fn nvme_id() -> SegmentId {
    let _ = NVME;
    kvpool_transport::proto::segment_id_for("nvme:host-a:/dev/x")
}

fn tasks(m: &mut M, seg: SegmentId) -> Vec<NodeTask> {
    match m
        .call(Q::NodeTasks {
            client_id: NODE,
            shard: 0,
            segments: vec![seg, nvme_id()],
            max: 100,
        })
        .unwrap()
    {
        A::Tasks(t) => t,
        other => panic!("{other:?}"),
    }
}

fn update(m: &mut M, u: NvmeUpdate) -> Result<(), KvError> {
    match m
        .call(Q::NvmeUpdates {
            client_id: NODE,
            updates: vec![u],
        })
        .unwrap()
    {
        A::BatchDone(mut v) => Result::from(v.remove(0)),
        other => panic!("{other:?}"),
    }
}

/// The node's report of a copy at `loc` made for a Persist task (as the
/// task named it), without a checksum of its own to offer.
fn stored(task: &NodeTask, loc: u64) -> NvmeUpdate {
    let NodeTask::Persist {
        key,
        dram,
        offset,
        len,
        demote,
        ..
    } = task.clone()
    else {
        panic!("not a Persist task: {task:?}")
    };
    NvmeUpdate::Stored {
        key,
        nvme: nvme_id(),
        loc,
        len,
        dram,
        offset,
        demote,
        sum: 0,
    }
}

#[test]
fn eviction_demotes_to_the_nodes_nvme_tier_instead_of_dropping() {
    let (mut m, dram) = tiered(false);
    fill(&mut m, "k", 10, opts(1)); // 100%: the last put schedules demotions
    let t = tasks(&mut m, dram);
    assert!(!t.is_empty(), "demotions were asked for");
    let NodeTask::Persist {
        key,
        offset,
        len,
        demote,
        ..
    } = t[0].clone()
    else {
        panic!("{t:?}")
    };
    assert!(demote);
    assert_eq!(key, b"k0", "oldest first");
    let used = m.used();
    assert!(m.exist("k0"), "still there while the copy is made");
    update(
        &mut m,
        NvmeUpdate::Stored {
            key: key.clone(),
            nvme: nvme_id(),
            loc: 7,
            len,
            dram,
            offset,
            demote: true,
            sum: 0,
        },
    )
    .unwrap();
    assert!(m.used() < used, "the DRAM copy's space came back");
    let r = m.get("k0").unwrap();
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].tier, Tier::Nvme);
    assert_eq!(r[0].offset, 7);
    assert!(m.stat().demotions >= 1);
}

/// Runs the write-through Persist task the master asks for first (it must
/// be one, not a demotion) as a node would: reports the copy `Stored` at `loc`.
fn write_through_copy(m: &mut M, dram: SegmentId, loc: u64) {
    let t = tasks(m, dram);
    let Some(NodeTask::Persist {
        key,
        offset,
        len,
        demote,
        ..
    }) = t.first().cloned()
    else {
        panic!("{t:?}")
    };
    assert!(!demote);
    update(
        m,
        NvmeUpdate::Stored {
            key,
            nvme: nvme_id(),
            loc,
            len,
            dram,
            offset,
            demote: false,
            sum: 0,
        },
    )
    .unwrap();
}

/// A write-through pool filled to 100%: the Persist tasks of k0 the node
/// fetched, its write-through copy's and its demotion's (queued by the
/// eviction of the last put, before the write-through copy landed).
fn write_through_and_demotion_of_k0() -> (M, NodeTask, NodeTask) {
    let (mut m, dram) = tiered(true);
    fill(&mut m, "k", 10, opts(1));
    let t = tasks(&mut m, dram);
    let persist_of = |demote: bool| {
        t.iter()
            .find(|t| {
                matches!(t, NodeTask::Persist { key, demote: d, .. } if key == b"k0" && *d == demote)
            })
            .cloned()
            .unwrap_or_else(|| panic!("a Persist of k0 with demote {demote}: {t:?}"))
    };
    (m, persist_of(false), persist_of(true))
}

/// Puts that need room, their leases over: they evict.
fn puts_that_evict(m: &mut M, each: impl Fn(&str, &[ReplicaDesc])) {
    m.advance(60_000);
    for i in 0..20 {
        let key = format!("new{i}");
        let Ok(r) = m.start(&key, KIB) else {
            continue;
        };
        m.end(&key).unwrap();
        each(&key, &r);
    }
}

/// Found by the cluster simulation (seed 798 with `KVPOOL_SIM_UNSUMMED=1`,
/// and seed 132 of an earlier build): a demotion is queued, then the
/// write-through copy of the same object lands (`Stored`, demote false).
/// The node still holds the demotion's Persist task, which reads the DRAM
/// range, so that range must not go to another put before the demotion
/// reports (before the fix the replica became Ready again, the next
/// eviction freed it at once because the object had an NVMe copy, and a
/// put got the range: the node copied that put's bytes as the object's).
#[test]
fn a_range_a_queued_demotion_reads_is_not_given_to_a_put_before_the_demotion_reports() {
    let (mut m, through, demotion) = write_through_and_demotion_of_k0();
    let NodeTask::Persist { offset, .. } = demotion else {
        unreachable!()
    };
    // The write-through copy lands; the demotion is still with the node.
    update(&mut m, stored(&through, 3)).unwrap();
    puts_that_evict(&mut m, |key, r| {
        assert!(
            r.iter().all(|r| r.offset != offset),
            "put {key} got k0's range at {offset}, which the node's demotion still reads"
        );
    });
    // Once the demotion reports, the range is k0's no more.
    update(&mut m, stored(&demotion, 3)).unwrap();
    assert_eq!(m.get("k0").unwrap().len(), 1, "k0 is on NVMe only");
}

/// The same race with the write-through copy failing: the demotion under
/// way goes on (before, the replica became Ready again and the next
/// eviction asked for a second demotion of it while the first ran).
#[test]
fn a_failed_write_through_copy_does_not_end_a_demotion_under_way() {
    let (mut m, _, demotion) = write_through_and_demotion_of_k0();
    let NodeTask::Persist { dram, offset, .. } = demotion.clone() else {
        unreachable!()
    };
    update(
        &mut m,
        NvmeUpdate::PersistFailed {
            key: b"k0".to_vec(),
            dram,
            offset,
            demote: false,
        },
    )
    .unwrap();
    puts_that_evict(&mut m, |_, _| {});
    let again: Vec<NodeTask> = tasks(&mut m, dram)
        .into_iter()
        .filter(|t| matches!(t, NodeTask::Persist { key, .. } if key == b"k0"))
        .collect();
    assert!(again.is_empty(), "k0 demoted a second time: {again:?}");
    update(&mut m, stored(&demotion, 3)).unwrap();
    assert_eq!(m.get("k0").unwrap().len(), 1, "k0 is on NVMe only");
}

/// Found by the cluster simulation (seed 671 with `KVPOOL_SIM_UNSUMMED=1`,
/// once the restarted master kept its state directory): an object put
/// without a checksum took a node's recovered NVMe copy of an earlier
/// object under the key, of the same size, as its own replica, and readers
/// got the earlier bytes. Without a checksum the master takes a recovered
/// copy only when it lists that very replica already.
#[test]
fn a_recovered_copy_is_not_taken_for_an_object_without_a_checksum_it_cannot_be_matched_with() {
    let (mut m, dram) = tiered(true);
    m.put("k", 100); // no checksum
    let rec = |loc| NvmeUpdate::Recovered {
        key: b"k".to_vec(),
        nvme: nvme_id(),
        loc,
        len: 100,
        sum: 0x1234,
    };
    let e = update(&mut m, rec(9)).unwrap_err();
    assert_eq!(
        e.code,
        ErrorCode::ObjectAlreadyExists,
        "the node removes it"
    );
    assert_eq!(m.get("k").unwrap().len(), 1, "only the DRAM replica");
    // The copy the master took for this object comes back as it was.
    write_through_copy(&mut m, dram, 3);
    update(&mut m, rec(3)).unwrap();
    let r = m.get("k").unwrap();
    assert_eq!(r.len(), 2);
    assert_eq!((r[1].tier, r[1].offset), (Tier::Nvme, 3));
}

/// Found by the cluster simulation (seed 671 with `KVPOOL_SIM_UNSUMMED=1`,
/// with the master's state directory): a demotion queued for a node that
/// was away; the object was removed and the key came back from the node's
/// tier; the node then ran the old demotion on whatever lay in the range
/// and replaced the key's copy, the one the master listed, with it. A
/// Persist task whose object no longer holds its range is not handed out.
#[test]
fn a_demotion_of_a_removed_object_is_not_handed_out() {
    let (mut m, dram) = tiered(false);
    fill(&mut m, "k", 10, opts(1)); // k0's demotion queued, not yet fetched
    m.remove("k0", true).unwrap();
    let t = tasks(&mut m, dram);
    assert!(
        !t.iter()
            .any(|t| matches!(t, NodeTask::Persist { key, .. } if key == b"k0")),
        "{t:?}"
    );
}

/// Found by the cluster simulation (seed 63, with the master's state
/// directory): a removal queued a Drop of the key's NVMe copy for a node
/// whose tier was away; the tier came back and reported the copy, which
/// the master took (the key was free); the node then ran the Drop and
/// removed the copy the master listed. The report is refused now (see
/// `a_recovered_copy_whose_drop_is_queued_is_refused`): the key stays
/// removed and the Drop goes out. (A Drop of a copy the key's object lists
/// is still never handed out.)
#[test]
fn a_copy_reported_again_after_its_removal_is_refused_and_its_drop_goes_out() {
    let (mut m, dram) = tiered(false);
    let rec = NvmeUpdate::Recovered {
        key: b"k".to_vec(),
        nvme: nvme_id(),
        loc: 9,
        len: 100,
        sum: 0x1234,
    };
    update(&mut m, rec.clone()).unwrap();
    m.remove("k", true).unwrap(); // queues Drop k at 9
    let e = update(&mut m, rec).unwrap_err();
    assert_eq!(e.code, ErrorCode::ObjectAlreadyExists, "{e}");
    assert_eq!(code(m.get("k")), ErrorCode::ObjectNotFound);
    let t = tasks(&mut m, dram);
    assert!(
        t.iter().any(|t| matches!(t, NodeTask::Drop { loc: 9, .. })),
        "{t:?}"
    );
}

#[test]
fn write_through_asks_for_a_copy_at_put_end_and_keeps_the_dram_replica() {
    let (mut m, dram) = tiered(true);
    m.put("k", 100);
    write_through_copy(&mut m, dram, 3);
    let r = m.get("k").unwrap();
    assert_eq!(r.len(), 2);
    assert_eq!(r[0].tier, Tier::Dram, "DRAM first");
    assert_eq!(r[1].tier, Tier::Nvme);
}

#[test]
fn a_stored_report_for_an_object_removed_meanwhile_is_refused_so_the_node_deletes_its_copy() {
    let (mut m, dram) = tiered(true);
    m.put("k", 100);
    let copy = tasks(&mut m, dram).remove(0);
    m.remove("k", false).unwrap();
    let e = update(&mut m, stored(&copy, 3)).unwrap_err();
    assert_eq!(e.code, ErrorCode::ObjectNotFound);
}

#[test]
fn an_nvme_eviction_report_drops_that_replica_and_an_object_left_without_one() {
    let (mut m, _) = tiered(false);
    update(
        &mut m,
        NvmeUpdate::Recovered {
            key: b"only-nvme".to_vec(),
            nvme: nvme_id(),
            loc: 9,
            len: 500,
            sum: 0,
        },
    )
    .unwrap();
    assert!(m.exist("only-nvme"));
    update(
        &mut m,
        NvmeUpdate::Evicted {
            key: b"only-nvme".to_vec(),
            nvme: nvme_id(),
            loc: 9,
        },
    )
    .unwrap();
    assert!(!m.exist("only-nvme"));
}

#[test]
fn recovered_objects_come_back_and_stale_copies_are_refused() {
    let (mut m, _) = tiered(false);
    update(
        &mut m,
        NvmeUpdate::Recovered {
            key: b"back".to_vec(),
            nvme: nvme_id(),
            loc: 1,
            len: 4096,
            sum: 0,
        },
    )
    .unwrap();
    let r = m.get("back").unwrap();
    assert_eq!((r[0].tier, r[0].len), (Tier::Nvme, 4096));
    // A newer object under a key the device still has: the device copy is stale.
    m.put("newer", 100);
    let e = update(
        &mut m,
        NvmeUpdate::Recovered {
            key: b"newer".to_vec(),
            nvme: nvme_id(),
            loc: 2,
            len: 555,
            sum: 0,
        },
    )
    .unwrap_err();
    assert_eq!(e.code, ErrorCode::ObjectAlreadyExists);
}

#[test]
fn reads_of_an_nvme_only_object_promote_it_back_to_dram() {
    let (mut m, dram) = tiered(false);
    update(
        &mut m,
        NvmeUpdate::Recovered {
            key: b"hot".to_vec(),
            nvme: nvme_id(),
            loc: 5,
            len: 1000,
            sum: 0,
        },
    )
    .unwrap();
    m.get("hot").unwrap();
    assert!(tasks(&mut m, dram).is_empty(), "one read is not enough");
    m.get("hot").unwrap();
    let t = tasks(&mut m, dram);
    let Some(NodeTask::Promote {
        key,
        loc,
        dram: d,
        offset,
        ..
    }) = t.first().cloned()
    else {
        panic!("{t:?}")
    };
    assert_eq!((key.as_slice(), loc, d), (b"hot".as_slice(), 5, dram));
    // Until the node reports the copy, readers still get NVMe only.
    assert_eq!(m.get("hot").unwrap().len(), 1);
    update(
        &mut m,
        NvmeUpdate::Promoted {
            key,
            dram,
            offset,
            ok: true,
        },
    )
    .unwrap();
    let r = m.get("hot").unwrap();
    assert_eq!(r.len(), 2);
    assert_eq!(r[0].tier, Tier::Dram);
    assert_eq!(m.stat().promotions, 1);
}

#[test]
fn a_failed_persist_of_a_demotion_evicts_the_dram_copy_anyway() {
    let (mut m, dram) = tiered(false);
    fill(&mut m, "k", 10, opts(1));
    let Some(NodeTask::Persist { key, offset, .. }) = tasks(&mut m, dram).first().cloned() else {
        panic!()
    };
    update(
        &mut m,
        NvmeUpdate::PersistFailed {
            key: key.clone(),
            dram,
            offset,
            demote: true,
        },
    )
    .unwrap();
    assert!(!m.exist(std::str::from_utf8(&key).unwrap()));
}

#[test]
fn an_nvme_tier_mounted_again_after_a_restart_keeps_its_replicas() {
    let (mut m, _) = tiered(false);
    update(
        &mut m,
        NvmeUpdate::Recovered {
            key: b"kept".to_vec(),
            nvme: nvme_id(),
            loc: 4,
            len: 100,
            sum: 0,
        },
    )
    .unwrap();
    let mut nv = spec("nvme:host-a:/dev/x", 1 << 30, "host-a");
    nv.tier = Tier::Nvme;
    nv.endpoint.port = 9999; // the restarted node's new port
    m.call(Q::MountSegment {
        client_id: NODE + 5,
        spec: nv,
    })
    .unwrap();
    let r = m.get("kept").unwrap();
    assert_eq!(r[0].endpoint.port, 9999);
}

#[test]
fn removing_an_object_asks_its_node_to_drop_the_nvme_copy_before_a_new_put_of_the_key() {
    let (mut m, dram) = tiered(true);
    m.put("k", 100);
    write_through_copy(&mut m, dram, 3);
    m.remove("k", true).unwrap();
    // The same key, put again: its copy must not be confused with the old one.
    m.put("k", 100);
    drop_then_copy(&mut m, dram, "k", 3);
}

/// The node's next tasks: drop the old object's NVMe copy of `key` at
/// `loc`, then copy the new object of `key`, in that order, and no others.
fn drop_then_copy(m: &mut M, dram: SegmentId, key: &str, loc: u64) {
    let t = tasks(m, dram);
    assert_eq!(
        t.first(),
        Some(&NodeTask::Drop {
            key: key.as_bytes().to_vec(),
            loc
        }),
        "the old object's NVMe copy is dropped first: {t:?}"
    );
    assert!(
        matches!(t.get(1), Some(NodeTask::Persist { key: k, demote: false, .. }) if k == key.as_bytes()),
        "then the new object's copy is made: {t:?}"
    );
    assert_eq!(t.len(), 2, "{t:?}");
}

#[test]
fn a_replace_drops_the_old_objects_nvme_copy_before_the_new_object_is_copied() {
    let (mut m, dram) = tiered(true);
    m.put("k", 100);
    write_through_copy(&mut m, dram, 3);
    m.replace_as(WRITER, "k", 100).unwrap();
    assert_eq!(m.get("k").unwrap().len(), 2, "the old object, both copies");
    assert!(tasks(&mut m, dram).is_empty(), "nothing until the put ends");
    m.end("k").unwrap();
    drop_then_copy(&mut m, dram, "k", 3);
    let r = m.get("k").unwrap();
    assert_eq!((r.len(), r[0].tier), (1, Tier::Dram), "no copy listed yet");
    m.check();
}

#[test]
fn a_copy_made_from_the_replaced_objects_range_is_never_listed_for_the_new_one() {
    // Same size, no checksums: only the DRAM range tells the two apart.
    let (mut m, dram) = tiered(true);
    m.put("k", 100);
    let copy = tasks(&mut m, dram).remove(0);
    // Replaced while the node is still copying the old object out.
    let used = m.used();
    m.replace_as(WRITER, "k", 100).unwrap();
    m.end("k").unwrap();
    assert_eq!(
        m.used(),
        2 * used,
        "the range the node is reading is not handed out again yet"
    );
    let e = update(&mut m, stored(&copy, 3)).unwrap_err();
    assert_eq!(e.code, ErrorCode::ObjectNotFound, "{e}");
    let r = m.get("k").unwrap();
    assert_eq!((r.len(), r[0].tier), (1, Tier::Dram), "{r:?}");
    // Once a node can no longer be copying it, the range comes back.
    m.advance(m.cfg.stale_put_grace_ms.max(m.cfg.lease_ttl_ms));
    assert_eq!(m.used(), used);
    m.check();
}

#[test]
fn a_restarted_node_reporting_the_copy_of_an_object_being_replaced_keeps_it() {
    let (mut m, dram) = tiered(true);
    m.put("k", 100);
    write_through_copy(&mut m, dram, 3);
    m.replace_as(WRITER, "k", 100).unwrap();
    // The node restarts and reports what its tier holds: the copy is the
    // complete object's, which readers still get (the node deletes copies
    // the master refuses).
    update(
        &mut m,
        NvmeUpdate::Recovered {
            key: b"k".to_vec(),
            nvme: nvme_id(),
            loc: 3,
            len: 100,
            sum: 0,
        },
    )
    .unwrap();
    let r = m.get("k").unwrap();
    assert_eq!((r.len(), r[1].tier, r[1].offset), (2, Tier::Nvme, 3));
    // A copy under a key that is only being put is still refused.
    m.start("fresh", 100).unwrap();
    let e = update(
        &mut m,
        NvmeUpdate::Recovered {
            key: b"fresh".to_vec(),
            nvme: nvme_id(),
            loc: 4,
            len: 100,
            sum: 0,
        },
    )
    .unwrap_err();
    assert_eq!(e.code, ErrorCode::ObjectAlreadyExists);
    m.check();
}

/// A removed object's NVMe copy is owed a Drop; if its node reports the
/// copy (it restarted, or mounted its tier again) before it ran the Drop,
/// taking the report would bring the removed object back (found by the
/// cluster simulation, seed 618 of 3db89c7: the Drop then ran, the tier
/// reused the slot, and the master listed another version's bytes there).
#[test]
fn a_recovered_copy_whose_drop_is_queued_is_refused() {
    let (mut m, dram) = tiered(true);
    m.put("k", 100);
    write_through_copy(&mut m, dram, 3);
    m.remove("k", true).unwrap();
    let rec = NvmeUpdate::Recovered {
        key: b"k".to_vec(),
        nvme: nvme_id(),
        loc: 3,
        len: 100,
        sum: 0,
    };
    let e = update(&mut m, rec.clone()).unwrap_err();
    assert_eq!(e.code, ErrorCode::ObjectAlreadyExists, "{e}");
    assert_eq!(code(m.get("k")), ErrorCode::ObjectNotFound);
    // Handed its Drop, the node may still report the copy before it runs
    // it: still refused (a later put's copy in the reused slot is listed
    // once its Stored is taken, and a listed copy is never refused).
    let t = tasks(&mut m, dram);
    assert!(
        t.iter().any(|t| matches!(t, NodeTask::Drop { loc: 3, .. })),
        "{t:?}"
    );
    let e = update(&mut m, rec.clone()).unwrap_err();
    assert_eq!(e.code, ErrorCode::ObjectAlreadyExists, "{e}");
    assert_eq!(code(m.get("k")), ErrorCode::ObjectNotFound);
    // Long after, too (issue 32: the node died before it ran the Drop, and
    // reports its tier when it is back). Before, the master had forgotten
    // the Drop after 10 s and took the copy: the removed key came back. The
    // tier is listed by then (no report for `client_ttl_ms`): a copy no
    // object lists is an old one. (A later put's copy in the reused slot
    // whose Stored report was lost is refused too: that object keeps its
    // DRAM replica.)
    m.advance(11_000);
    let e = update(&mut m, rec).unwrap_err();
    assert_eq!(e.code, ErrorCode::ObjectAlreadyExists, "{e}");
    assert_eq!(code(m.get("k")), ErrorCode::ObjectNotFound);
    m.check();
}

/// A fresh scratch directory for a master's state.
fn state_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("kvpool-mb-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A master on `dir` whose node's tier holds write-through copies of "k"
/// (at 3) and "kept" (at 4), and is listed (`client_ttl_ms` without a
/// report); returns it and the node's DRAM segment.
fn listed_tier_with_k_and_kept(dir: &std::path::Path) -> (M, SegmentId) {
    let mut m = on_state_dir(dir, 1_000);
    let dram = mount_node(&mut m, true);
    m.put("k", 100);
    write_through_copy(&mut m, dram, 3);
    m.put("kept", 100);
    write_through_copy(&mut m, dram, 4);
    m.advance(m.cfg.client_ttl_ms + 1_000);
    (m, dram)
}

/// After a restart, `NODE` mounts again and reports its tier: the copy of
/// the removed "k" is refused, the listed copy of "kept" comes back.
fn old_copy_refused_listed_copy_back(m: &mut M) {
    mount_node(m, true);
    let e = update(m, recovered("k", 3)).unwrap_err();
    assert_eq!(e.code, ErrorCode::ObjectAlreadyExists, "{e}");
    assert_eq!(code(m.get("k")), ErrorCode::ObjectNotFound);
    update(m, recovered("kept", 4)).unwrap();
    assert!(m.get("kept").unwrap().iter().any(|r| r.offset == 4));
    m.check();
}

/// Issue 32, copy identity: a removed object's Drop went out to its node,
/// which died before it ran it; the master restarted on its state
/// directory; the node came back and reported its tier. The old copy is
/// refused and the key stays removed; the copy the master lists comes back.
/// Before, the restarted master had forgotten the Drop (it remembered
/// handed-out Drops 10 s, in memory) and adopted the copy of a key its
/// image did not hold: the removed key came back.
#[test]
fn a_removed_key_does_not_come_back_from_a_copy_whose_drop_was_handed_out_before_a_restart() {
    let dir = state_dir("handed-out-drop");
    let (mut m, dram) = listed_tier_with_k_and_kept(&dir);
    m.remove("k", true).unwrap();
    let t = tasks(&mut m, dram);
    assert!(
        t.iter()
            .any(|t| matches!(t, NodeTask::Drop { key, loc: 3 } if key == b"k")),
        "{t:?}"
    );
    drop(m); // the master goes; the node dies before it runs the Drop
    old_copy_refused_listed_copy_back(&mut on_state_dir(&dir, 60_000));
    std::fs::remove_dir_all(&dir).ok();
}

/// Issue 32, copy identity: a key removed while the restarted master waited
/// for its node (the object was recovered, its segments not back), then a
/// second restart before the node came back. Before, what the removal owed
/// the node's tier was in memory only; the second master adopted the copy
/// and the removed key came back.
#[test]
fn a_key_removed_while_its_node_was_away_stays_removed_across_a_second_restart() {
    let dir = state_dir("removed-parked");
    let (m, _) = listed_tier_with_k_and_kept(&dir);
    drop(m);
    let mut m = on_state_dir(&dir, 60_000); // the node stays away
    m.remove("k", true).unwrap();
    drop(m);
    old_copy_refused_listed_copy_back(&mut on_state_dir(&dir, 70_000));
    std::fs::remove_dir_all(&dir).ok();
}

/// Issue 32, copy identity: a tier unmounted as dead (its node was cut off)
/// takes back, when it mounts again, the copies of objects nobody removed
/// or replaced meanwhile, with or without other replicas, checksum or not;
/// a copy of a key removed meanwhile is refused and owed a Drop. Before, a
/// copy of a key the master no longer held was adopted: the key removed
/// while its tier was away came back.
#[test]
fn a_tier_that_comes_back_takes_back_its_copies_but_not_those_of_keys_removed_meanwhile() {
    let (mut m, dram) = tiered(true);
    m.put("both", 100); // a DRAM and an NVMe replica
    write_through_copy(&mut m, dram, 3);
    // NVMe-only objects (reported by the tier while it is adopted).
    for (k, loc) in [("only", 5), ("removed", 6), ("replaced", 7)] {
        update(&mut m, recovered(k, loc)).unwrap();
    }
    m.advance(m.cfg.client_ttl_ms + 1_000); // the tier is listed
    m.call(Q::UnmountSegment {
        client_id: NODE,
        segment_id: nvme_id(),
    })
    .unwrap();
    assert_eq!(code(m.get("only")), ErrorCode::ObjectNotFound);
    assert_eq!(code(m.remove("removed", true)), ErrorCode::ObjectNotFound);
    m.put("replaced", 100);
    mount_tier(&mut m);
    for k in ["removed", "replaced"] {
        let loc = if k == "removed" { 6 } else { 7 };
        let e = update(&mut m, recovered(k, loc)).unwrap_err();
        assert_eq!(e.code, ErrorCode::ObjectAlreadyExists, "{k}: {e}");
    }
    assert_eq!(code(m.get("removed")), ErrorCode::ObjectNotFound);
    assert_eq!(
        m.get("replaced").unwrap().len(),
        1,
        "only the new DRAM replica"
    );
    update(&mut m, recovered("only", 5)).unwrap();
    update(&mut m, recovered("both", 3)).unwrap();
    assert_eq!(m.get("both").unwrap().len(), 2);
    assert_eq!(m.get("only").unwrap()[0].offset, 5);
    let t = tasks(&mut m, dram);
    for (k, loc) in [(&b"removed"[..], 6), (b"replaced", 7)] {
        assert!(
            t.iter()
                .any(|t| matches!(t, NodeTask::Drop { key, loc: l } if key == k && *l == loc)),
            "{t:?}"
        );
    }
    m.check();
}

/// The Drop a removed object's NVMe copy is owed outlives its node's DRAM
/// segment: a node that dies (its segment unmounted, its task queue gone)
/// and comes back with a new DRAM segment and the same tier still gets the
/// Drop, and its report of the copy meanwhile is refused. Before, the queue
/// went with the segment and the report brought the removed object back.
#[test]
fn a_drop_owed_to_a_node_that_came_back_with_a_new_segment_still_goes_out() {
    let (mut m, dram) = tiered(true);
    m.put("k", 100);
    write_through_copy(&mut m, dram, 3);
    m.remove("k", true).unwrap(); // Drop k at 3 queued for `dram`
    m.call(Q::UnmountSegment {
        client_id: NODE,
        segment_id: dram,
    })
    .unwrap();
    let dram2 = mount_tiered_dram(&mut m, "dram-after-restart", true);
    let recovered = NvmeUpdate::Recovered {
        key: b"k".to_vec(),
        nvme: nvme_id(),
        loc: 3,
        len: 100,
        sum: 0,
    };
    let e = update(&mut m, recovered.clone()).unwrap_err();
    assert_eq!(e.code, ErrorCode::ObjectAlreadyExists, "{e}");
    assert_eq!(code(m.get("k")), ErrorCode::ObjectNotFound);
    let t = tasks(&mut m, dram2);
    assert!(
        t.iter()
            .any(|t| matches!(t, NodeTask::Drop { key, loc: 3 } if key == b"k")),
        "the new segment's node is asked to drop the copy: {t:?}"
    );
    // Gone out, and the node may report the copy before it runs it: still
    // refused.
    let e = update(&mut m, recovered).unwrap_err();
    assert_eq!(e.code, ErrorCode::ObjectAlreadyExists, "{e}");
    m.check();
}

/// But a copy the key's object lists is that object's, whatever Drop of
/// the place waits: a later put's copy took the slot (cluster simulation,
/// seed 422 with `KVPOOL_SIM_UNSUMMED=1`: refused, the node removed the
/// copy the master listed).
#[test]
fn a_recovered_copy_the_object_lists_is_kept_though_a_drop_of_its_place_waits() {
    let (mut m, dram) = tiered(true);
    m.put("k", 100);
    write_through_copy(&mut m, dram, 3);
    m.remove("k", true).unwrap(); // Drop k at 3 queued
    let b = m.put("k", 100);
    // The node copied the new object into the freed slot and reported it.
    let persist = NodeTask::Persist {
        key: b"k".to_vec(),
        dram,
        offset: b[0].offset,
        len: 100,
        demote: false,
        checksum: None,
    };
    update(&mut m, stored(&persist, 3)).unwrap();
    let rec = NvmeUpdate::Recovered {
        key: b"k".to_vec(),
        nvme: nvme_id(),
        loc: 3,
        len: 100,
        sum: 0,
    };
    update(&mut m, rec).unwrap();
    let r = m.get("k").unwrap();
    assert!(
        r.iter().any(|r| r.tier == Tier::Nvme && r.offset == 3),
        "{r:?}"
    );
    m.check();
}

#[test]
fn replacing_an_object_under_demotion_keeps_the_demotion_accounting() {
    let (mut m, dram) = tiered(false);
    fill(&mut m, "k", 10, opts(1)); // full: the oldest are being demoted
    let demotion = tasks(&mut m, dram).remove(0);
    let NodeTask::Persist {
        key, demote: true, ..
    } = &demotion
    else {
        panic!("{demotion:?}")
    };
    let name = String::from_utf8(key.clone()).unwrap();
    // Room for the replace: remove an object that is not being demoted.
    m.remove("k9", true).unwrap();
    m.replace_as(WRITER, &name, KIB).unwrap();
    m.end(&name).unwrap();
    m.check(); // the demoting bytes no longer count the replaced object
               // The node reports the old object's copy: not the new object's.
    let e = update(&mut m, stored(&demotion, 11)).unwrap_err();
    assert_eq!(e.code, ErrorCode::ObjectNotFound, "{e}");
    let r = m.get(&name).unwrap();
    assert_eq!((r.len(), r[0].tier), (1, Tier::Dram), "{r:?}");
    m.check();
}

// ---- trust: owners, checksums, suspects, grants (issue 12) -------------------

fn update_as(m: &mut M, client: u64, u: NvmeUpdate) -> Result<(), KvError> {
    match m
        .call(Q::NvmeUpdates {
            client_id: client,
            updates: vec![u],
        })
        .unwrap()
    {
        A::BatchDone(mut v) => Result::from(v.remove(0)),
        other => panic!("{other:?}"),
    }
}

fn end_with_sum(m: &mut M, key: &str, sum: u64) {
    m.call(Q::PutEnd {
        client_id: WRITER,
        put_id: 0,
        key: key.into(),
        checksum: Some(sum),
    })
    .unwrap();
}

#[test]
fn nvme_reports_from_a_client_that_does_not_own_the_tier_change_nothing() {
    let (mut m, dram) = tiered(false);
    let forged = NvmeUpdate::Recovered {
        key: b"forged".to_vec(),
        nvme: nvme_id(),
        loc: 1,
        len: 100,
        sum: 0,
    };
    assert_eq!(
        code(update_as(&mut m, OTHER, forged)),
        ErrorCode::IllegalClient
    );
    assert!(!m.exist("forged"));
    // The owner may not name its DRAM segment as a tier (the report that
    // once reached an allocator assert), nor a region the tier lacks.
    let as_tier = NvmeUpdate::Recovered {
        key: b"forged".to_vec(),
        nvme: dram,
        loc: 1 << 40,
        len: 100,
        sum: 0,
    };
    assert_eq!(code(update(&mut m, as_tier)), ErrorCode::InvalidParams);
    let far = NvmeUpdate::Recovered {
        key: b"forged".to_vec(),
        nvme: nvme_id(),
        loc: 5 << 32,
        len: 100,
        sum: 0,
    };
    assert_eq!(code(update(&mut m, far)), ErrorCode::InvalidParams);
    assert!(!m.exist("forged"));
    // Removing whatever a forged report could have named is harmless.
    assert_eq!(code(m.remove("forged", true)), ErrorCode::ObjectNotFound);
    m.put("after", 100);
}

#[test]
fn only_the_owner_takes_a_segments_tasks_or_unmounts_it() {
    let (mut m, dram) = tiered(false);
    let r = m.call(Q::NodeTasks {
        client_id: OTHER,
        shard: 0,
        segments: vec![dram],
        max: 10,
    });
    assert_eq!(code(r), ErrorCode::IllegalClient);
    let r = m.call(Q::UnmountSegment {
        client_id: OTHER,
        segment_id: dram,
    });
    assert_eq!(code(r), ErrorCode::IllegalClient);
    assert_eq!(m.stat().segments.len(), 2);
    m.call(Q::UnmountSegment {
        client_id: NODE,
        segment_id: dram,
    })
    .unwrap();
    assert_eq!(m.stat().segments.len(), 1);
}

#[test]
fn a_promotion_lands_in_the_dram_segment_of_the_node_that_holds_the_copy() {
    let (mut m, dram) = tiered(false);
    // A larger, emptier segment on another node: placement would prefer it.
    let other = m.mount_as(OTHER, "elsewhere", 1 << 20, "host-b");
    update(
        &mut m,
        NvmeUpdate::Recovered {
            key: b"cold".to_vec(),
            nvme: nvme_id(),
            loc: 4,
            len: 1000,
            sum: 77,
        },
    )
    .unwrap();
    m.get("cold").unwrap();
    m.get("cold").unwrap();
    let t = tasks(&mut m, dram);
    let Some(NodeTask::Promote {
        dram: target,
        checksum,
        ..
    }) = t.iter().find(|t| matches!(t, NodeTask::Promote { .. }))
    else {
        panic!("no promotion: {t:?}")
    };
    assert_eq!(*target, dram, "not the emptier segment {other:016x}");
    assert_eq!(*checksum, Some(77), "the node checks the bytes it copies");
}

#[test]
fn the_writers_checksum_reaches_readers_and_every_copy_must_match_it() {
    let (mut m, dram) = tiered(true); // write-through: a Persist at PutEnd
    m.start("k", 500).unwrap();
    end_with_sum(&mut m, "k", 0xfeed);
    assert!(m
        .get("k")
        .unwrap()
        .iter()
        .all(|r| r.checksum == Some(0xfeed)));
    let Some(NodeTask::Persist {
        key,
        offset,
        len,
        checksum,
        ..
    }) = tasks(&mut m, dram).first().cloned()
    else {
        panic!()
    };
    assert_eq!(checksum, Some(0xfeed));
    let stored = |sum| NvmeUpdate::Stored {
        key: key.clone(),
        nvme: nvme_id(),
        loc: 3,
        len,
        dram,
        offset,
        demote: false,
        sum,
    };
    assert_eq!(code(update(&mut m, stored(0xbad))), ErrorCode::Corrupt);
    assert_eq!(m.get("k").unwrap().len(), 1, "the bad copy is not listed");
    update(&mut m, stored(0xfeed)).unwrap();
    assert_eq!(m.get("k").unwrap().len(), 2);
    // A recovered copy of another object under the key is stale.
    let rec = |sum| NvmeUpdate::Recovered {
        key: b"k".to_vec(),
        nvme: nvme_id(),
        loc: 3,
        len: 500,
        sum,
    };
    assert_eq!(
        code(update(&mut m, rec(0xbad))),
        ErrorCode::ObjectAlreadyExists
    );
    update(&mut m, rec(0xfeed)).unwrap();
}

#[test]
fn a_segment_reported_unreachable_gets_no_new_replicas_until_its_owner_pings() {
    let mut m = M::new(1);
    // Both empty: the first mounted wins the tie, so b is chosen first.
    let b = m.mount_as(OTHER, "b", 1 << 20, "host-b");
    let a = m.mount_as(NODE, "a", 64 * KIB, "host-a");
    assert_eq!(m.start("x", 100).unwrap()[0].segment_id, b);
    m.call(Q::ReportUnreachable {
        client_id: WRITER,
        segment_id: b,
    })
    .unwrap();
    assert!(m.stat().segments.iter().any(|s| s.id == b && s.suspect));
    assert_eq!(m.start("y", 100).unwrap()[0].segment_id, a);
    // Its replicas stay readable; only placement skips it.
    m.end("x").unwrap();
    assert_eq!(m.get("x").unwrap()[0].segment_id, b);
    // Another client's ping proves nothing; the owner's does.
    m.ping(WRITER);
    assert_eq!(m.start("z", 100).unwrap()[0].segment_id, a);
    let r = m
        .call(Q::Ping {
            client_id: OTHER,
            segments: vec![b],
        })
        .unwrap();
    assert!(matches!(r, A::Pong { unknown } if unknown.is_empty()));
    assert_eq!(m.start("w", 100).unwrap()[0].segment_id, b);
}

#[test]
fn a_ping_names_the_segments_the_master_does_not_know() {
    let mut m = M::new(2);
    let a = m.mount_as(NODE, "a", 64 * KIB, "host-a");
    let r = m
        .call(Q::Ping {
            client_id: NODE,
            segments: vec![a, 12345],
        })
        .unwrap();
    assert!(matches!(r, A::Pong { unknown } if unknown == vec![12345]));
}

#[test]
fn a_node_back_on_the_same_ports_takes_over_its_segments() {
    let mut m = M::new(1);
    let id = m.mount_as(NODE, "a", 64 * KIB, "host-a");
    m.put("kept", 100);
    // The node restarts with a new client id and the same spec.
    m.kill(NODE);
    let again = m.mount_as(OTHER, "a", 64 * KIB, "host-a");
    assert_eq!(again, id);
    m.advance(m.cfg.client_ttl_ms + 2_000);
    assert_eq!(m.stat().segments.len(), 1, "the old registration's expiry");
    assert!(m.exist("kept"));
}

#[test]
fn a_full_segment_whose_space_is_being_demoted_says_try_again() {
    let (mut m, _) = tiered(false);
    fill(&mut m, "k", 10, opts(1)); // full: demotions queued, nothing freed yet
    let e = m.start("one-more", KIB).unwrap_err();
    assert_eq!(e.code, ErrorCode::TryAgain, "{e}");
    // Without a tier the same fill is NoSpace (after eviction frees room,
    // a put fits: use a pinned fill so nothing can be evicted).
    let mut m = small_pool();
    let pinned = PutOptions {
        hard_pin: true,
        ..opts(1)
    };
    fill(&mut m, "p", 100, pinned);
    assert_eq!(code(m.start("one-more", KIB)), ErrorCode::NoSpace);
}

#[test]
fn free_space_in_pieces_too_small_with_no_demotion_under_way_is_no_space_not_try_again() {
    let mut m = M::new(1);
    m.mount("seg", 4 * KIB);
    let hard = PutOptions {
        hard_pin: true,
        ..opts(1)
    };
    for k in ["a", "b", "c", "d"] {
        m.put_with(k, KIB, hard.clone());
    }
    m.remove("b", false).unwrap();
    m.remove("d", false).unwrap();
    // 2 KiB free, in two 1 KiB holes, nothing to evict and nothing coming:
    // waiting would not help, so the writer must not be told to.
    assert_eq!(code(m.start("e", 2 * KIB)), ErrorCode::NoSpace);
}

#[test]
fn with_a_secret_the_master_signs_write_and_read_grants_for_each_replica() {
    use kvpool_master::state::{GrantSigner, ShardConfig, ShardState};
    use kvpool_transport::auth::{ClusterKey, GrantClock, GrantOp};
    let key = ClusterKey::new(b"grant-test-secret-0123").unwrap();
    let c = cfg();
    let mut s =
        ShardState::new(0, 1, ShardConfig::from_master(&c, 1), 1).with_signer(Some(GrantSigner {
            key: key.clone(),
            unix_at_zero_ms: 1_000_000,
        }));
    let seg = Arc::new(spec("a", 64 * KIB, "host-a"));
    let id = kvpool_transport::proto::segment_id_for("a");
    s.add_segment(id, seg, NODE, 0);
    let w = s.put_start(WRITER, b"k", 4096, &opts(1), 10).unwrap();
    let g = w[0].grant;
    let until = 1_000_000 + 10 + c.put_timeout_ms;
    assert_eq!(g.expires_ms, until);
    let at = |now_ms| GrantClock { now_ms, skew_ms: 0 };
    key.check_grant(&g, GrantOp::Write, id, (w[0].offset, 4096), at(until))
        .unwrap();
    assert!(key
        .check_grant(&g, GrantOp::Read, id, (w[0].offset, 4096), at(until))
        .is_err());
    s.put_end(WRITER, b"k", 0, Some(1), 20).unwrap();
    let r = s.get_replica_list(b"k", 30).unwrap();
    let lease_end = 1_000_000 + 30 + c.lease_ttl_ms;
    assert_eq!(r[0].grant.expires_ms, lease_end);
    key.check_grant(
        &r[0].grant,
        GrantOp::Read,
        id,
        (r[0].offset, 4096),
        at(lease_end),
    )
    .unwrap();
}

/// Found by the cluster simulation (seed 248): a node cut off past its
/// client TTL is declared dead (its segment removed), then joins again and
/// mounts the same segment. Extents that waited to be freed on the old
/// mount (a leased removal) must not be freed into the new mount's
/// allocator: it never handed them out, and a put placed there meanwhile
/// would have its range freed under it.
#[test]
fn a_segment_mounted_again_does_not_free_the_old_mounts_deferred_extents() {
    let mut m = M::new(1);
    let id = m.mount("seg", 64 * KIB);
    m.put("k", 4 * KIB);
    m.get("k").unwrap(); // a read lease
    m.remove("k", true).unwrap(); // its space waits for the lease
    m.call(Q::UnmountSegment {
        client_id: NODE,
        segment_id: id,
    })
    .unwrap();
    assert_eq!(m.mount("seg", 64 * KIB), id);
    for (i, s) in m.m.shards.iter().enumerate() {
        s.check_invariants()
            .unwrap_or_else(|e| panic!("shard {i} after the remount: {e}"));
    }
    // A put lands in the fresh mount; the old lease's end frees nothing
    // of it.
    let r = m.put("k2", 4 * KIB);
    m.advance(cfg().lease_ttl_ms + 1);
    for (i, s) in m.m.shards.iter().enumerate() {
        s.check_invariants()
            .unwrap_or_else(|e| panic!("shard {i} after the old lease ended: {e}"));
    }
    assert_eq!(m.get("k2").unwrap()[0].offset, r[0].offset);
    assert!(m.used() >= 4 * KIB, "k2's space is still in use");
}
