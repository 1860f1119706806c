//! The bodies of kvpool's fuzz targets, and the seed inputs they start from.
//!
//! Each target feeds untrusted bytes to the functions the real peers run on
//! them, not to copies: the frame reader (`frame::read_header`,
//! `read_payload_budgeted`), the payload decoder (`frame::decode`, rkyv +
//! bytecheck), the master's routing and shard state (`MasterCore::call`,
//! which composes the same `route::target`, `check_batch` and
//! `ShardState::apply` the live service runs), the storage node's request
//! gate (`DataGate::admit`), the client's reply reader (`frame::read_reply`,
//! `check_answer`, `merge_batch`, the typed `Call::reply`) and the config
//! loader (`NodeConfig::from_toml`). A target fails by panicking.
//!
//! `fuzz_targets/*.rs` (cargo-fuzz, nightly) call these; the workspace's
//! `tests/fuzz_corpus.rs` replays every file of `fuzz/corpus/` through them
//! on stable, so `cargo test` runs the corpus (and every crash kept in it).

use std::sync::OnceLock;

use futures_lite::future::block_on;
use futures_lite::io::Cursor;
use kvpool_config::{MasterConfig, NodeConfig};
use kvpool_master::core::MasterCore;
use kvpool_storage::Segment;
use kvpool_storage_node::gate::{handshake, DataGate, Handshake};
use kvpool_wire::auth::{ClusterKey, Grant, GrantClock};
use kvpool_wire::frame::check_answer;
use kvpool_wire::frame::{self, AlignedVec, FrameBudget, FrameHeader, FrameKind, HEADER_LEN};
use kvpool_wire::proto::call::{self, Call};
use kvpool_wire::proto::{
    ClusterMap, DataRequest, DataResponse, DropTask, Endpoint, ItemResult, MasterRequest,
    MasterResponse, MasterShardAddr, NodeTask, NvmeUpdate, ObjectInfo, PersistTask, PoolStat,
    PromoteTask, PutDone, PutItem, PutOptions, ReplicaDesc, SegmentSpec, Tier, WireError,
};
use kvpool_wire::route::merge_batch;
use kvpool_wire::{ErrorCode, KvError, RdmaConnectRequest, RdmaRequest, RdmaResponse};

/// The targets, by name (the folders of `fuzz/corpus/`).
pub const TARGETS: [&str; 5] = ["frame", "master_request", "data_request", "reply", "config"];

/// Runs target `name` on `data`.
pub fn run(name: &str, data: &[u8]) {
    match name {
        "frame" => frame(data),
        "master_request" => master_request(data),
        "data_request" => data_request(data),
        "reply" => reply(data),
        "config" => config(data),
        other => panic!("no fuzz target {other}"),
    }
}

/// The frame bound the targets read under (small, so `TooLarge` is reached).
const MAX_FRAME: u32 = 64 << 10;

/// A payload as a server holds it: in a 16-byte-aligned buffer.
fn aligned(data: &[u8]) -> AlignedVec {
    let mut v = AlignedVec::with_capacity(data.len());
    v.extend_from_slice(data);
    v
}

/// A byte stream of frames, read as a shard reads its connection: each
/// header checked against the bound, each payload grown from a process
/// budget, then decoded as the type its kind names. Every frame's memory
/// goes back to the budget.
pub fn frame(data: &[u8]) {
    let budget = FrameBudget::new(256 << 10);
    let mut r = Cursor::new(data);
    block_on(async {
        loop {
            let Ok(hdr) = frame::read_header(&mut r, MAX_FRAME).await else {
                break;
            };
            assert!(hdr.len <= MAX_FRAME);
            // A header that parsed re-encodes to one that parses the same.
            assert_eq!(
                FrameHeader::decode(&hdr.encode(), MAX_FRAME).ok(),
                Some(hdr)
            );
            let Ok((payload, held)) = frame::read_payload_budgeted(&mut r, &hdr, &budget).await
            else {
                break;
            };
            assert_eq!(payload.len(), hdr.len as usize);
            assert!(budget.used() >= payload.len() as u64);
            let _ = match hdr.kind {
                FrameKind::MasterRequest => frame::decode::<MasterRequest>(&payload).is_ok(),
                FrameKind::MasterResponse => frame::decode::<MasterResponse>(&payload).is_ok(),
                FrameKind::DataRequest => frame::decode::<DataRequest>(&payload).is_ok(),
                FrameKind::DataResponse => frame::decode::<DataResponse>(&payload).is_ok(),
                FrameKind::Error => frame::decode::<WireError>(&payload).is_ok(),
            };
            drop(held);
        }
    });
    assert_eq!(budget.used(), 0, "a frame kept its memory");
}

/// A time well after 0, so leases and pins have room both ways.
const NOW_MS: u64 = 1_000_000;
const NODE: u64 = 100;
const WRITER: u64 = 7;

/// The data port of the fuzzed master's storage node.
fn endpoint() -> Endpoint {
    Endpoint {
        host: "127.0.0.1".into(),
        port: 7300,
        nr_shards: 2,
    }
}

fn seg_spec(name: &str, tier: Tier) -> SegmentSpec {
    SegmentSpec {
        name: name.into(),
        size: 1 << 20,
        endpoint: endpoint(),
        slice_bytes: 1 << 19,
        host_id: "host-a".into(),
        tier,
        nvme: None,
    }
}

/// A two-shard master with a DRAM segment, a complete object `done`, a
/// put of `open` under way (by client 7) and a hard-pinned `pinned`.
fn populated_master() -> MasterCore {
    let cfg = MasterConfig {
        max_keys: 1_000,
        max_batch: 64,
        ..Default::default()
    };
    let mut m = MasterCore::new(2, &cfg, 1);
    let ok = |m: &mut MasterCore, q: MasterRequest| {
        m.call(q, NOW_MS).expect("the set-up of the fuzzed master");
    };
    ok(
        &mut m,
        MasterRequest::MountSegment {
            client_id: NODE,
            spec: seg_spec("seg-a", Tier::Dram),
        },
    );
    for (key, end, hard_pin) in [
        ("done", true, false),
        ("open", false, false),
        ("pinned", true, true),
    ] {
        ok(
            &mut m,
            MasterRequest::PutStart {
                client_id: WRITER,
                key: key.into(),
                len: 4096,
                opts: PutOptions {
                    hard_pin,
                    ..Default::default()
                },
            },
        );
        if end {
            ok(
                &mut m,
                MasterRequest::PutEnd {
                    client_id: WRITER,
                    put_id: 0,
                    key: key.into(),
                    checksum: Some(1),
                },
            );
        }
    }
    m
}

/// A master request payload, decoded as the master's connection decodes it
/// and applied to a populated master as its shards apply it; then time
/// moves past every lease, pin and put deadline. The pool's totals must
/// still add up.
pub fn master_request(data: &[u8]) {
    let Ok(req) = frame::decode::<MasterRequest>(&aligned(data)) else {
        return;
    };
    round_trips(&req);
    let mut m = populated_master();
    let _ = m.call(req, NOW_MS);
    m.tick(NOW_MS + 3_600_000);
    let stat = call::Stat::reply(m.call(MasterRequest::Stat, NOW_MS + 3_600_000).unwrap()).unwrap();
    assert!(stat.used <= stat.capacity, "{stat:?}");
    let used: u64 = stat.segments.iter().map(|s| s.used).sum();
    assert_eq!(used, stat.used, "{stat:?}");
}

/// A decoded value encodes and decodes to itself.
fn round_trips<T: frame::Payload + PartialEq + std::fmt::Debug>(v: &T) {
    let bytes = frame::encode(FrameKind::MasterRequest, 1, v);
    let back = frame::decode::<T>(&aligned(&bytes[HEADER_LEN..])).expect("re-decodes");
    assert_eq!(&back, v);
}

struct DataSide {
    segment: Segment,
    key: ClusterKey,
}

fn data_side() -> &'static DataSide {
    static SIDE: OnceLock<DataSide> = OnceLock::new();
    SIDE.get_or_init(|| DataSide {
        segment: Segment::new_dram("kvpool-fuzz", 1 << 20, false).expect("a 1 MiB segment"),
        key: ClusterKey::new(b"kvpool-fuzz-secret-0123456789abcdef").expect("a key"),
    })
}

/// The segment id the data target's gate serves.
pub const FUZZ_SEGMENT: u64 = 0x5e9;
/// Its NVMe tier's id.
pub const FUZZ_NVME: u64 = 0x4e5;

/// A data request payload, decoded as a storage shard decodes it and
/// checked by the shard's gate, with and without a cluster secret. An
/// admitted `Write`/`Read` range must lie inside the segment (the shard
/// then slices the segment's memory with it).
pub fn data_request(data: &[u8]) {
    let Ok(req) = frame::decode::<DataRequest>(&aligned(data)) else {
        return;
    };
    round_trips(&req);
    let side = data_side();
    let clock = GrantClock {
        now_ms: NOW_MS,
        skew_ms: 1_000,
    };
    for key in [None, Some(&side.key)] {
        // The connection's handshake first, as on the data port: a fresh
        // connection, and one that has proved the secret.
        let mut fresh = kvpool_wire::server::ConnState::default();
        let first = handshake(key, &req, &mut fresh);
        if key.is_some() {
            let handshake_step = matches!(
                req,
                DataRequest::AuthBegin { .. } | DataRequest::AuthProve { .. }
            );
            // With a secret, only a handshake step gets past a fresh
            // connection, and no single frame authenticates it.
            assert!(
                handshake_step || matches!(first, Handshake::Refuse(_)),
                "a fresh connection passed {req:?}"
            );
            assert!(!fresh.authenticated, "one frame authenticated: {req:?}");
        }
        let mut proved = kvpool_wire::server::ConnState {
            authenticated: true,
            ..Default::default()
        };
        if !matches!(handshake(key, &req, &mut proved), Handshake::Pass) {
            continue;
        }
        let term = std::sync::atomic::AtomicU64::new(0);
        let gate = DataGate {
            segment_len: side.segment.len(),
            segment_id: FUZZ_SEGMENT,
            nvme_id: Some(FUZZ_NVME),
            shard: 1,
            key,
            term: &term,
        };
        let admitted = gate.admit(&req, clock);
        if let (
            Ok(()),
            DataRequest::Write { offset, len, .. } | DataRequest::Read { offset, len, .. },
        ) = (&admitted, &req)
        {
            let end = offset
                .checked_add(*len)
                .expect("an admitted range does not overflow");
            assert!(end <= side.segment.len(), "admitted {offset}+{len}");
        }
        if let (Some(_), Ok(())) = (key, &admitted) {
            // With a secret nothing passes without a grant the key signed.
            let g = match &req {
                DataRequest::Write { grant, .. }
                | DataRequest::Read { grant, .. }
                | DataRequest::ReadNvme { grant, .. }
                | DataRequest::Rdma { grant, .. } => grant,
                DataRequest::AuthBegin { .. } | DataRequest::AuthProve { .. } => {
                    panic!("the gate admitted a handshake step: {req:?}")
                }
            };
            assert!(
                matches!(
                    req,
                    DataRequest::Rdma {
                        req: RdmaRequest::Caps,
                        ..
                    }
                ) || *g != Grant::default(),
                "admitted without a grant: {req:?}"
            );
        }
    }
}

/// What a client reads: byte 0 picks the reader (a master reply, a data
/// reply, or the master's answer to one shard's part of a batch); the rest
/// is the byte stream from the peer. The answer goes through the client's
/// request-id check and the typed reply of every call that could get it.
pub fn reply(data: &[u8]) {
    let Some((&which, rest)) = data.split_first() else {
        return;
    };
    match which % 3 {
        0 => {
            if let Some(Ok(resp)) = client_reads::<MasterResponse>(rest, FrameKind::MasterResponse)
            {
                typed_replies(resp);
            }
        }
        1 => {
            let _ = client_reads::<DataResponse>(rest, FrameKind::DataResponse);
        }
        _ => {
            // A batch of 4 keys split over two shards: this answer is the
            // part of keys 0 and 2, the other part failed.
            let Some(answer) = client_reads::<MasterResponse>(rest, FrameKind::MasterResponse)
            else {
                return;
            };
            let other = Err(KvError::new(ErrorCode::Unavailable, "down"));
            let merged = merge_batch(4, vec![(vec![0, 2], answer), (vec![1, 3], other)]);
            match merged {
                Ok(MasterResponse::BatchReplicas(v)) => assert_eq!(v.len(), 4),
                Ok(MasterResponse::BatchDone(v)) => assert_eq!(v.len(), 4),
                Ok(MasterResponse::BatchExists(v)) => assert_eq!(v.len(), 4),
                Ok(other) => panic!("a merged batch is a batch answer: {other:?}"),
                Err(_) => {}
            }
        }
    }
}

/// Reads one reply from `bytes` as the client does: the frame (an error
/// frame is the peer's error), then the check that it answers request 1.
fn client_reads<T: frame::Payload>(bytes: &[u8], kind: FrameKind) -> Option<Result<T, KvError>> {
    let mut r = Cursor::new(bytes);
    let (rid, answer) = block_on(frame::read_reply::<T, _>(&mut r, kind, MAX_FRAME)).ok()?;
    check_answer(rid, 1, answer).ok()
}

/// Every typed call's reading of `resp`, and what the client then does
/// with replica lists (the data shard to ask, its address).
fn typed_replies(resp: MasterResponse) {
    let _ = call::Hello::reply(resp.clone());
    if let Ok(replicas) = call::GetReplicaList::reply(resp.clone()) {
        for r in &replicas {
            let shard = r.data_shard();
            assert!(shard < r.endpoint.nr_shards.max(1));
            let _ = r.endpoint.shard_addr(shard);
        }
    }
    let _ = call::Stat::reply(resp.clone());
    let _ = call::Describe::reply(resp.clone());
    if let Ok(items) = call::BatchGet::reply(resp.clone()) {
        for it in items {
            let _: Result<Vec<ReplicaDesc>, KvError> = it.into();
        }
    }
    let _ = call::NodeTasks::reply(resp.clone());
    let _ = call::AuthBegin::reply(resp.clone());
    let _ = call::AuthProve::reply(resp.clone());
    let _ = call::Ping::reply(resp.clone());
    let _ = call::RemoveAll::reply(resp.clone());
    // A standby checks shipped records before it applies any.
    if let Ok(shipped) = call::Follow::reply(resp.clone()) {
        // Keys of even length are shard 0's here.
        let shard_of = |k: &[u8]| (k.len() % 2) as u32;
        if let Ok(recs) = kvpool_master::ship::decode_records(&shipped.records, 0, shard_of) {
            let mut sb = kvpool_master::ship::Standby::default();
            sb.apply(
                shipped.session,
                shipped.term,
                recs,
                shipped.records.len() as u64,
                shipped.synced,
            );
        }
    }
    let _ = call::Exist::reply(resp);
}

/// Config text, loaded as the binary loads `--config`: parsed, checked,
/// and on success turned into what the roles start from (the master's
/// state, the shard pool, the clients' settings, the cluster key).
pub fn config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(cfg) = NodeConfig::from_toml(text, "fuzz.toml") else {
        return;
    };
    let _ = cfg.runtime.shard_pool();
    let _ = cfg.client_config();
    let _ = cfg.cluster_key();
    // Not `wide_listens`: it resolves host names (a DNS lookup per input).
    let mut m = MasterCore::new(1, &cfg.master, 0);
    let _ = m.call(MasterRequest::Stat, NOW_MS);
    m.tick(NOW_MS);
}

/// One seed input: the target, a file name, the bytes.
pub struct Seed {
    pub target: &'static str,
    pub name: String,
    pub bytes: Vec<u8>,
}

/// One request of every `MasterRequest` variant; [`master_variant`] checks
/// at compile time that none is missing from it.
pub fn master_request_seeds() -> Vec<MasterRequest> {
    let key = || b"done".to_vec();
    let opts = PutOptions {
        replicas: 2,
        soft_pin_ttl_ms: 500,
        preferred_host: "host-a".into(),
        ..Default::default()
    };
    vec![
        MasterRequest::Hello { client_id: WRITER },
        MasterRequest::AuthBegin {
            client_id: WRITER,
            nonce: [3; 16],
        },
        MasterRequest::AuthProve { proof: [4; 32] },
        MasterRequest::Ping {
            client_id: NODE,
            segments: vec![1, 2],
        },
        MasterRequest::MountSegment {
            client_id: NODE,
            spec: seg_spec("seg-b", Tier::Nvme),
        },
        MasterRequest::UnmountSegment {
            client_id: NODE,
            segment_id: kvpool_wire::proto::segment_id_for("seg-a"),
        },
        MasterRequest::DrainSegment {
            segment_id: kvpool_wire::proto::segment_id_for("seg-a"),
        },
        MasterRequest::PutStart {
            client_id: WRITER,
            key: b"new".to_vec(),
            len: 8192,
            opts: opts.clone(),
        },
        MasterRequest::PutEnd {
            client_id: WRITER,
            put_id: 0,
            key: b"open".to_vec(),
            checksum: Some(9),
        },
        MasterRequest::PutRevoke {
            client_id: WRITER,
            put_id: 0,
            key: b"open".to_vec(),
        },
        MasterRequest::GetReplicaList { key: key() },
        MasterRequest::Exist { key: key() },
        MasterRequest::Remove {
            key: key(),
            force: true,
        },
        MasterRequest::RemoveAll { force: false },
        MasterRequest::Stat,
        MasterRequest::Describe { key: key() },
        MasterRequest::BatchPutStart {
            client_id: WRITER,
            items: vec![
                PutItem {
                    key: b"b1".to_vec(),
                    len: 100,
                },
                PutItem {
                    key: b"b2".to_vec(),
                    len: 200,
                },
            ],
            opts,
        },
        MasterRequest::BatchPutEnd {
            client_id: WRITER,
            put_id: 0,
            items: vec![PutDone {
                key: b"open".to_vec(),
                checksum: None,
            }],
        },
        MasterRequest::BatchPutRevoke {
            client_id: WRITER,
            put_id: 0,
            keys: vec![b"open".to_vec(), b"x".to_vec()],
        },
        MasterRequest::BatchGet {
            keys: vec![key(), b"pinned".to_vec()],
        },
        MasterRequest::BatchExist {
            keys: vec![key(), b"nope".to_vec()],
        },
        MasterRequest::BatchRemove {
            keys: vec![key(), b"pinned".to_vec()],
            force: false,
        },
        MasterRequest::NodeTasks {
            client_id: NODE,
            shard: 1,
            segments: vec![1],
            max: 8,
        },
        MasterRequest::NvmeUpdates {
            client_id: NODE,
            updates: vec![
                NvmeUpdate::Stored {
                    key: key(),
                    nvme: 5,
                    loc: 1 << 32,
                    len: 4096,
                    dram: 1,
                    offset: 0,
                    demote: true,
                    sum: 1,
                    version: 7 << 32 | 1,
                },
                NvmeUpdate::Promoted {
                    key: key(),
                    dram: 1,
                    offset: 0,
                    ok: true,
                },
                NvmeUpdate::PersistFailed {
                    key: key(),
                    dram: 1,
                    offset: 0,
                    demote: false,
                },
                NvmeUpdate::Evicted {
                    key: key(),
                    nvme: 5,
                    loc: 3,
                    version: 7 << 32 | 2,
                },
                NvmeUpdate::Recovered {
                    key: b"old".to_vec(),
                    nvme: 5,
                    loc: 4,
                    len: 10,
                    sum: 2,
                    version: 0,
                },
            ],
        },
        MasterRequest::ReportUnreachable {
            client_id: WRITER,
            segment_id: 1,
        },
        MasterRequest::Follow {
            client_id: WRITER,
            shard: 0,
            shards: 1,
            session: 0,
            acked: 0,
        },
    ]
}

/// The variant's index: an exhaustive match, so a new request type does
/// not compile until it has a seed here.
pub fn master_variant(r: &MasterRequest) -> usize {
    use MasterRequest as Q;
    match r {
        Q::Hello { .. } => 0,
        Q::AuthBegin { .. } => 1,
        Q::AuthProve { .. } => 2,
        Q::Ping { .. } => 3,
        Q::MountSegment { .. } => 4,
        Q::UnmountSegment { .. } => 5,
        Q::DrainSegment { .. } => 6,
        Q::PutStart { .. } => 7,
        Q::PutEnd { .. } => 8,
        Q::PutRevoke { .. } => 9,
        Q::GetReplicaList { .. } => 10,
        Q::Exist { .. } => 11,
        Q::Remove { .. } => 12,
        Q::RemoveAll { .. } => 13,
        Q::Stat => 14,
        Q::Describe { .. } => 15,
        Q::BatchPutStart { .. } => 16,
        Q::BatchPutEnd { .. } => 17,
        Q::BatchPutRevoke { .. } => 18,
        Q::BatchGet { .. } => 19,
        Q::BatchExist { .. } => 20,
        Q::BatchRemove { .. } => 21,
        Q::NodeTasks { .. } => 22,
        Q::NvmeUpdates { .. } => 23,
        Q::ReportUnreachable { .. } => 24,
        Q::Follow { .. } => 25,
    }
}

/// How many `MasterRequest` variants there are.
pub const MASTER_VARIANTS: usize = 26;

/// One request of every `DataRequest` variant (and RDMA request), named.
pub fn data_request_seeds() -> Vec<(&'static str, DataRequest)> {
    let g = Grant {
        op: 1,
        offset: 0,
        len: 4096,
        expires_ms: NOW_MS + 5_000,
        term: 0,
        mac: [7; 16],
    };
    vec![
        (
            "write",
            DataRequest::Write {
                segment_id: FUZZ_SEGMENT,
                offset: 4096,
                len: 4096,
                grant: g,
            },
        ),
        (
            "read",
            DataRequest::Read {
                segment_id: FUZZ_SEGMENT,
                offset: 0,
                len: 4096,
                grant: g,
            },
        ),
        (
            "read_nvme",
            DataRequest::ReadNvme {
                segment_id: FUZZ_NVME,
                loc: (1 << 32) | 5,
                len: 4096,
                grant: g,
                key: b"k".to_vec(),
            },
        ),
        (
            "rdma_caps",
            DataRequest::Rdma {
                req: RdmaRequest::Caps,
                grant: Grant::default(),
            },
        ),
        (
            "rdma_connect",
            DataRequest::Rdma {
                req: RdmaRequest::Connect(RdmaConnectRequest {
                    segment_id: FUZZ_SEGMENT,
                    lanes: Vec::new(),
                }),
                grant: g,
            },
        ),
        (
            "auth_begin",
            DataRequest::AuthBegin {
                client_id: 0,
                nonce: [3; 16],
            },
        ),
        ("auth_prove", DataRequest::AuthProve { proof: [4; 32] }),
    ]
}

/// The data request's kind (RDMA's two apart): an exhaustive match, like
/// [`master_variant`].
pub fn data_variant(r: &DataRequest) -> usize {
    match r {
        DataRequest::Write { .. } => 0,
        DataRequest::Read { .. } => 1,
        DataRequest::ReadNvme { .. } => 2,
        DataRequest::Rdma {
            req: RdmaRequest::Caps,
            ..
        } => 3,
        DataRequest::Rdma {
            req: RdmaRequest::Connect(_),
            ..
        } => 4,
        DataRequest::AuthBegin { .. } => 5,
        DataRequest::AuthProve { .. } => 6,
    }
}

/// How many kinds [`data_variant`] tells apart.
pub const DATA_VARIANTS: usize = 7;

/// One answer of every `MasterResponse` variant, named.
fn master_response_seeds() -> Vec<(&'static str, MasterResponse)> {
    let replica = ReplicaDesc {
        segment_id: 1,
        endpoint: endpoint(),
        slice_bytes: 1 << 19,
        host_id: "host-a".into(),
        offset: 600_000,
        len: 4096,
        tier: Tier::Dram,
        checksum: Some(5),
        grant: Grant::default(),
    };
    let err = WireError {
        code: ErrorCode::NoSpace.code(),
        message: "full".into(),
    };
    vec![
        (
            "hello",
            MasterResponse::Hello {
                cluster: ClusterMap {
                    shards: vec![MasterShardAddr {
                        host: String::new(),
                        port: 7100,
                        vshard_start: 0,
                        vshard_end: 4096,
                    }],
                    lease_ttl_ms: 5_000,
                    hot_replicas: 0,
                    max_batch: 4096,
                    max_value_bytes: 1 << 30,
                },
            },
        ),
        ("pong", MasterResponse::Pong { unknown: vec![3] }),
        (
            "auth_challenge",
            MasterResponse::AuthChallenge { nonce: [1; 16] },
        ),
        ("auth_ok", MasterResponse::AuthOk { proof: [2; 32] }),
        ("mounted", MasterResponse::Mounted { segment_id: 9 }),
        ("done", MasterResponse::Done),
        ("replicas", MasterResponse::Replicas(vec![replica.clone()])),
        ("exists", MasterResponse::Exists(true)),
        ("removed", MasterResponse::Removed(3)),
        ("stat", MasterResponse::Stat(PoolStat::default())),
        (
            "described",
            MasterResponse::Described(ObjectInfo {
                key: b"k".to_vec(),
                complete: true,
                size: 4096,
                replicas: vec![replica.clone()],
                lease_remaining_ms: 0,
                soft_pin_remaining_ms: 0,
                hard_pin: false,
            }),
        ),
        (
            "batch_replicas",
            MasterResponse::BatchReplicas(vec![
                ItemResult::Ok(vec![replica]),
                ItemResult::Err(err.clone()),
            ]),
        ),
        (
            "batch_done",
            MasterResponse::BatchDone(vec![ItemResult::Ok(()), ItemResult::Err(err)]),
        ),
        (
            "batch_exists",
            MasterResponse::BatchExists(vec![ItemResult::Ok(false)]),
        ),
        (
            "tasks",
            MasterResponse::Tasks(vec![
                NodeTask::Drop(DropTask {
                    key: b"k".to_vec(),
                    loc: 1,
                    version: Some(7 << 32 | 1),
                }),
                NodeTask::Persist(PersistTask {
                    key: b"k".to_vec(),
                    dram: 1,
                    offset: 0,
                    len: 4096,
                    demote: true,
                    checksum: Some(3),
                    version: 7 << 32 | 1,
                }),
                NodeTask::Promote(PromoteTask {
                    key: b"k".to_vec(),
                    loc: 1,
                    dram: 1,
                    offset: 4096,
                    len: 4096,
                    checksum: None,
                    version: 7 << 32 | 1,
                }),
            ]),
        ),
        ("shipped", MasterResponse::Shipped(shipped_seed())),
    ]
}

/// A `Shipped` answer with an object, a removal, a hold and a segment's
/// drain of shard 0 (keys of even length, in [`typed_replies`]).
fn shipped_seed() -> kvpool_wire::proto::Shipped {
    use kvpool_master::journal::{Hold, ObjectRec, Record, SegmentState};
    let key = b"k0".to_vec();
    let mut records = Vec::new();
    Record::Object {
        key: key.clone(),
        obj: ObjectRec {
            size: 4096,
            sum: Some(7),
            hard_pin: false,
            version: 0,
            replicas: vec![(1, 0)],
        },
    }
    .encode(&mut records);
    Record::Gone { key }.encode(&mut records);
    Record::Hold(Hold {
        segment: 1,
        offset: 4096,
        len: 4096,
        until_unix_ms: 1,
    })
    .encode(&mut records);
    Record::Segment {
        id: 1,
        state: SegmentState::Draining,
    }
    .encode(&mut records);
    kvpool_wire::proto::Shipped {
        session: 3,
        term: 2,
        start: 0,
        records,
        synced: true,
    }
}

/// The seed corpus: valid encodings of every request and reply type, a
/// stream of frames of every kind, and the repository's config files
/// without their comments (`repo` is the repository root).
pub fn seeds(repo: &std::path::Path) -> Vec<Seed> {
    let mut out = Vec::new();
    let mut push = |target: &'static str, name: String, bytes: Vec<u8>| {
        out.push(Seed {
            target,
            name,
            bytes,
        })
    };
    let payload = |b: Vec<u8>| b[HEADER_LEN..].to_vec();
    for q in master_request_seeds() {
        push(
            "master_request",
            format!("seed-{}", q.op_name()),
            payload(frame::encode(FrameKind::MasterRequest, 1, &q)),
        );
    }
    for (name, q) in data_request_seeds() {
        push(
            "data_request",
            format!("seed-{name}"),
            payload(frame::encode(FrameKind::DataRequest, 1, &q)),
        );
    }
    let mut stream = Vec::new();
    stream.extend(frame::encode(
        FrameKind::MasterRequest,
        1,
        &master_request_seeds()[7],
    ));
    stream.extend(frame::encode(
        FrameKind::DataRequest,
        2,
        &data_request_seeds()[0].1,
    ));
    stream.extend(frame::encode(
        FrameKind::MasterResponse,
        3,
        &MasterResponse::Done,
    ));
    stream.extend(frame::encode(
        FrameKind::DataResponse,
        4,
        &DataResponse::Data { len: 3 },
    ));
    stream.extend(frame::encode_error(
        5,
        &KvError::new(ErrorCode::NoSpace, "full"),
    ));
    push("frame", "seed-every-kind".to_string(), stream);
    for (name, a) in master_response_seeds() {
        let f = frame::encode(FrameKind::MasterResponse, 1, &a);
        let is_batch = name.starts_with("batch_");
        for (sel, what) in [(0u8, "master"), (2u8, "batch")] {
            if sel == 2 && !is_batch {
                continue;
            }
            let mut b = vec![sel];
            b.extend(&f);
            push("reply", format!("seed-{what}-{name}"), b);
        }
    }
    let data_replies = [
        ("written", DataResponse::Written),
        ("data", DataResponse::Data { len: 4096 }),
        (
            "rdma_caps",
            DataResponse::Rdma(RdmaResponse::Caps(kvpool_wire::RdmaCaps::unavailable(
                "none",
            ))),
        ),
        (
            "auth_challenge",
            DataResponse::AuthChallenge { nonce: [5; 16] },
        ),
        ("auth_ok", DataResponse::AuthOk { proof: [6; 32] }),
    ];
    for (name, a) in data_replies {
        let mut b = vec![1u8];
        b.extend(frame::encode(FrameKind::DataResponse, 1, &a));
        push("reply", format!("seed-data-{name}"), b);
    }
    let mut b = vec![0u8];
    b.extend(frame::encode_error(
        1,
        &KvError::new(ErrorCode::NoSpace, "full"),
    ));
    push("reply", "seed-error-frame".to_string(), b);
    for f in [
        "single-node.toml",
        "master.toml",
        "storage.toml",
        "engine.toml",
    ] {
        // Without their comments: short inputs run faster, and the fuzzer
        // mutates keys and values rather than prose.
        let text = std::fs::read_to_string(repo.join("configs").join(f)).expect("configs/");
        let bare: String = text
            .lines()
            .filter(|l| !l.trim().is_empty() && !l.trim_start().starts_with('#'))
            .flat_map(|l| [l, "\n"])
            .collect();
        push(
            "config",
            format!("seed-{}", f.trim_end_matches(".toml")),
            bare.into_bytes(),
        );
    }
    out
}
