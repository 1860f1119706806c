//! The messages of kvpool's protocols (rkyv archives inside frames).
//!
//! Wire compatibility: a reader tolerates what it does not need (reserved
//! header fields, error codes it does not know); a writer sends only what the
//! current version defines. A change to any type here is a protocol version
//! bump (`frame::VERSION`).

use rkyv::{Archive, Deserialize, Serialize};

use crate::error::{ErrorCode, KvError};

/// A mounted segment's id, assigned by the master (stable for a segment name).
pub type SegmentId = u64;

/// A data-plane permission the master signs and a storage node checks
/// without asking anyone: `op` on `len` bytes at `offset` of a segment,
/// until `expires_ms` (Unix time, milliseconds), signed by the leader of
/// `term` (HA on etcd: the etcd revision of the signing master's leader
/// key; 0 for a master without an election). A storage node refuses a
/// grant of a term older than one it has seen, so a deposed leader's grants
/// stop working once the new leader's first grant reached the node. `mac`
/// is zero in an open cluster, where the term is carried but neither
/// recorded nor checked (nothing signs it).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Grant {
    pub op: u8,
    pub offset: u64,
    pub len: u64,
    pub expires_ms: u64,
    pub term: u64,
    pub mac: [u8; 16],
}

impl Grant {
    /// Whether `offset..offset+len` lies inside the granted range.
    pub fn covers(&self, offset: u64, len: u64) -> bool {
        let (Some(end), Some(gend)) = (offset.checked_add(len), self.offset.checked_add(self.len))
        else {
            return false;
        };
        offset >= self.offset && end <= gend
    }
}
/// A client's id: random per client instance, it names the writer of a put
/// and the owner of a segment for liveness.
pub type ClientId = u64;

/// The id of the segment named `name`: both the master and the node that owns
/// the segment derive it, so data requests can name it before the mount.
pub fn segment_id_for(name: &str) -> SegmentId {
    xxhash_rust::xxh3::xxh3_64(name.as_bytes()).max(1)
}

/// A key for messages: printable keys as they are, others in hex, cut short.
pub fn show_key(key: &[u8]) -> String {
    const MAX: usize = 64;
    let k = &key[..key.len().min(MAX)];
    let mut s = match std::str::from_utf8(k) {
        Ok(t) if t.chars().all(|c| !c.is_control()) => format!("{t:?}"),
        _ => k.iter().map(|b| format!("{b:02x}")).collect(),
    };
    if key.len() > MAX {
        s.push_str("...");
    }
    s
}

/// A node's sharded listener: shard `i` listens on `port + i`.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq, Hash)]
pub struct Endpoint {
    pub host: String,
    pub port: u16,
    pub nr_shards: u16,
}

impl Endpoint {
    /// `host:port` of shard `shard`.
    pub fn shard_addr(&self, shard: u16) -> String {
        let port = self.port as u32 + shard as u32;
        if self.host.contains(':') {
            format!("[{}]:{port}", self.host)
        } else {
            format!("{}:{port}", self.host)
        }
    }
}

/// One master shard and the virtual shards it owns (`vshard_start..vshard_end`).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct MasterShardAddr {
    pub host: String,
    pub port: u16,
    pub vshard_start: u32,
    pub vshard_end: u32,
}

/// Where every key's metadata lives: the answer to `Hello`.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct ClusterMap {
    pub shards: Vec<MasterShardAddr>,
    /// The read lease GetReplicaList grants (a borrowed view lasts this long).
    pub lease_ttl_ms: u64,
    /// DRAM replicas a hot object may have (`master.hot_replicas`; 0: no
    /// hot-object replication). When set, every storage node polls for
    /// `Fetch` tasks, the tier-less ones too.
    pub hot_replicas: u16,
    /// The most keys one batch request may name (`master.max_batch`): a
    /// client cuts a longer batch into pieces of at most this many keys per
    /// shard.
    pub max_batch: u32,
    /// The longest value the cluster stores (`master.max_value_bytes`): a
    /// client refuses a replica list naming a longer one rather than size a
    /// buffer by it.
    pub max_value_bytes: u64,
}

/// What a storage node contributes when it mounts a segment.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct SegmentSpec {
    /// Unique per segment instance (a restarted node mounts a new name).
    pub name: String,
    pub size: u64,
    /// The node's data-plane listener.
    pub endpoint: Endpoint,
    /// The node serves offsets `i*slice_bytes ..` on shard `i`'s port.
    pub slice_bytes: u64,
    /// Names the machine, for same-host (shm) reads and `local_first` placement.
    pub host_id: String,
    /// DRAM (the master allocates in it) or NVMe (the node manages it; the
    /// master only records what lives there).
    pub tier: Tier,
    /// For a DRAM segment: the same node's NVMe tier, if it has one.
    pub nvme: Option<NvmeAttach>,
}

/// A DRAM segment's NVMe tier on the same node.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct NvmeAttach {
    /// The NVMe tier's segment id.
    pub segment_id: SegmentId,
    /// Copy every object to NVMe at PutEnd (otherwise only when evicted).
    pub write_through: bool,
}

/// Work the master asks a storage node to do (it polls for it).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub enum NodeTask {
    Persist(PersistTask),
    Promote(PromoteTask),
    Drop(DropTask),
    Fetch(FetchTask),
}

/// Copy the object at `offset` of DRAM segment `dram` to the NVMe tier.
/// `demote`: the DRAM copy goes once the NVMe copy is in (eviction).
/// Answered by `Stored` or `PersistFailed`.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct PersistTask {
    pub key: Vec<u8>,
    pub dram: SegmentId,
    pub offset: u64,
    pub len: u64,
    pub demote: bool,
    /// The object's checksum: the node copies only bytes that match it.
    pub checksum: Option<u64>,
    /// The object incarnation's version: the copy carries it.
    pub version: u64,
}

impl PersistTask {
    /// The answer: the copy is at packed `loc` of tier `nvme`, its bytes of
    /// checksum `sum`.
    pub fn stored(self, nvme: SegmentId, loc: u64, sum: u64) -> NvmeUpdate {
        NvmeUpdate::Stored {
            key: self.key,
            nvme,
            loc,
            len: self.len,
            dram: self.dram,
            offset: self.offset,
            demote: self.demote,
            sum,
            version: self.version,
        }
    }

    /// The answer when nothing was copied.
    pub fn failed(self) -> NvmeUpdate {
        NvmeUpdate::PersistFailed {
            key: self.key,
            dram: self.dram,
            offset: self.offset,
            demote: self.demote,
        }
    }
}

/// Copy the NVMe object at `loc` into DRAM segment `dram` at `offset`.
/// Answered by `Promoted`.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct PromoteTask {
    pub key: Vec<u8>,
    pub loc: u64,
    pub dram: SegmentId,
    pub offset: u64,
    pub len: u64,
    /// The object's checksum: the node copies only bytes that match it.
    pub checksum: Option<u64>,
    /// The object incarnation's version: without a checksum, the node
    /// copies only the copy that carries it.
    pub version: u64,
}

impl PromoteTask {
    /// The answer: whether the bytes are in the range.
    pub fn promoted(self, ok: bool) -> NvmeUpdate {
        promoted(self.key, self.dram, self.offset, ok)
    }
}

/// The object `key` was removed: drop its NVMe copy at `loc` (if that copy
/// is still `key`'s, at `version` when given; `None`: whatever its version,
/// a Drop owed from before versions). Queued with the node's other tasks,
/// in order; not answered.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct DropTask {
    pub key: Vec<u8>,
    pub loc: u64,
    pub version: Option<u64>,
}

/// Copy the object from one of `from` (DRAM replicas on other nodes, with
/// read grants) into DRAM segment `dram` at `offset`: an extra replica of
/// a hot object. Answered like a promotion (`Promoted`).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct FetchTask {
    pub key: Vec<u8>,
    pub from: Vec<ReplicaDesc>,
    pub dram: SegmentId,
    pub offset: u64,
    pub len: u64,
    /// The object's checksum: the node copies only bytes that match it.
    pub checksum: u64,
}

impl FetchTask {
    /// The answer: whether the bytes are in the range.
    pub fn promoted(self, ok: bool) -> NvmeUpdate {
        promoted(self.key, self.dram, self.offset, ok)
    }
}

/// The answer of a promotion or a fetch into `dram` at `offset`.
fn promoted(key: Vec<u8>, dram: SegmentId, offset: u64, ok: bool) -> NvmeUpdate {
    NvmeUpdate::Promoted {
        key,
        dram,
        offset,
        ok,
    }
}

/// What a storage node reports about its NVMe tier (batched, by key).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub enum NvmeUpdate {
    /// A Persist task is done.
    Stored {
        key: Vec<u8>,
        nvme: SegmentId,
        loc: u64,
        len: u64,
        dram: SegmentId,
        offset: u64,
        demote: bool,
        /// xxh3-64 of the bytes the copy holds.
        sum: u64,
        /// The version the copy carries (the Persist task's).
        version: u64,
    },
    /// A Promote task is done (or failed: `ok` false).
    Promoted {
        key: Vec<u8>,
        dram: SegmentId,
        offset: u64,
        ok: bool,
    },
    /// A Persist task failed (the tier is full or broken): a demotion then
    /// simply evicts the DRAM copy.
    PersistFailed {
        key: Vec<u8>,
        dram: SegmentId,
        offset: u64,
        demote: bool,
    },
    /// The tier evicted this object; its space is reused once answered.
    Evicted {
        key: Vec<u8>,
        nvme: SegmentId,
        loc: u64,
        /// The version the copy carried.
        version: u64,
    },
    /// Found on the device at start (after a restart).
    Recovered {
        key: Vec<u8>,
        nvme: SegmentId,
        loc: u64,
        len: u64,
        /// xxh3-64 of the value, as the tier's index records it.
        sum: u64,
        /// The version the copy carries (0: written before versions).
        version: u64,
    },
}

impl NvmeUpdate {
    pub fn key(&self) -> &[u8] {
        match self {
            Self::Stored { key, .. }
            | Self::PersistFailed { key, .. }
            | Self::Promoted { key, .. }
            | Self::Evicted { key, .. }
            | Self::Recovered { key, .. } => key,
        }
    }
}

/// Which tier holds a replica.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tier {
    Dram,
    Nvme,
}

/// Where one replica of an object lies.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct ReplicaDesc {
    pub segment_id: SegmentId,
    pub endpoint: Endpoint,
    pub slice_bytes: u64,
    pub host_id: String,
    pub offset: u64,
    pub len: u64,
    pub tier: Tier,
    /// The object's checksum (xxh3-64 of its bytes, computed by its writer);
    /// `None` while it is being put, or when its writer did not compute one.
    pub checksum: Option<u64>,
    /// The master's permission to read (GetReplicaList) or write (PutStart)
    /// this replica's range; empty in an open cluster.
    pub grant: Grant,
}

impl ReplicaDesc {
    /// The storage shard that serves this replica's offset.
    pub fn data_shard(&self) -> u16 {
        let nr = self.endpoint.nr_shards.max(1) as u64;
        match self.tier {
            // An NVMe replica's offset is its packed location: region << 32
            // | slot; region i is served by shard i.
            Tier::Nvme => ((self.offset >> 32) % nr) as u16,
            Tier::Dram => {
                let slice = self.slice_bytes.max(1);
                (self.offset / slice).min(nr - 1) as u16
            }
        }
    }
}

/// Options of a put.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct PutOptions {
    /// Replicas wanted, each on a distinct segment (best effort).
    pub replicas: u32,
    /// Soft pin for this long after the put (0: none).
    pub soft_pin_ttl_ms: u64,
    /// Never evicted (Remove still works).
    pub hard_pin: bool,
    /// The writer's host id, for `local_first` placement ("" for none).
    pub preferred_host: String,
    /// An atomic replace ("upsert"): a complete object under the key stays
    /// readable until this put ends, then the new one takes its place in
    /// one step. Without it a put of a complete key is `ObjectAlreadyExists`.
    pub replace: bool,
    /// Names this placement of the put, so that its `PutEnd`/`PutRevoke`
    /// (which carry the same id) act on it and on no later placement of the
    /// key: a revoke or end that reaches the master late, after the writer
    /// placed the key again, is refused. The writer chooses it (a client
    /// counts, wrapping after 65,535: it tells apart the placements of one
    /// key by one writer, which are never that many at once); 0 names none,
    /// and an end or revoke with 0 acts on whichever put of the key the
    /// writer has under way.
    pub put_id: u16,
}

impl Default for PutOptions {
    fn default() -> Self {
        Self {
            replicas: 1,
            soft_pin_ttl_ms: 0,
            hard_pin: false,
            preferred_host: String::new(),
            replace: false,
            put_id: 0,
        }
    }
}

/// One key of a `BatchPutStart`.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct PutItem {
    pub key: Vec<u8>,
    pub len: u64,
}

/// One key of a `BatchPutEnd`, with the checksum of what was written.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct PutDone {
    pub key: Vec<u8>,
    pub checksum: Option<u64>,
}

/// One result of a batch call: the value, or why this key failed.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub enum ItemResult<T> {
    Ok(T),
    Err(WireError),
}

impl<T> From<Result<T, KvError>> for ItemResult<T> {
    fn from(r: Result<T, KvError>) -> Self {
        match r {
            Ok(v) => ItemResult::Ok(v),
            Err(e) => ItemResult::Err(WireError::from(&e)),
        }
    }
}

impl<T> From<ItemResult<T>> for Result<T, KvError> {
    fn from(r: ItemResult<T>) -> Self {
        match r {
            ItemResult::Ok(v) => Ok(v),
            ItemResult::Err(e) => Err(e.into()),
        }
    }
}

/// An object as the admin API describes it.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct ObjectInfo {
    pub key: Vec<u8>,
    /// `false` while the object is being put (Processing).
    pub complete: bool,
    pub size: u64,
    pub replicas: Vec<ReplicaDesc>,
    /// Milliseconds left on the read lease (0: none live).
    pub lease_remaining_ms: u64,
    /// Milliseconds left on the soft pin (0: none).
    pub soft_pin_remaining_ms: u64,
    pub hard_pin: bool,
}

/// Declares every master call in one place: the `MasterRequest` variant
/// (wire), its name for logs and metrics, and a typed struct in [`call`]
/// whose [`call::Call`] impl names the reply type and how it is read from a
/// `MasterResponse`. Adding a call is one entry here (plus its routing in
/// [`MasterRequest::route`] and the master's handling of it).
macro_rules! master_calls {
    ($(
        $(#[$doc:meta])*
        $name:ident ($op:literal) $({ $($(#[$fdoc:meta])* $field:ident : $fty:ty),* $(,)? })?
            -> $reply:ty = $pat:pat => $val:expr;
    )*) => {
        /// Requests to a master shard.
        #[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
        pub enum MasterRequest {
            $( $(#[$doc])* $name $({ $($(#[$fdoc])* $field: $fty),* })?, )*
        }

        impl MasterRequest {
            /// A short name for logs and metrics.
            pub fn op_name(&self) -> &'static str {
                match self {
                    $( Self::$name { .. } => $op, )*
                }
            }
        }

        /// One struct per master call (the fields of its `MasterRequest`
        /// variant), typed by the reply it gets: `client.call(Exist { key })`
        /// is a `bool`.
        pub mod call {
            use super::*;

            /// A typed master call.
            pub trait Call: Into<MasterRequest> + Send + 'static {
                /// What a successful answer carries.
                type Reply: Send + 'static;
                /// The call's name (as `MasterRequest::op_name`).
                const OP: &'static str;
                /// Reads the answer; any other response is `Internal`.
                fn reply(resp: MasterResponse) -> Result<Self::Reply, KvError>;
            }

            /// An answer of the wrong kind for `op`.
            pub fn unexpected(op: &str, resp: &MasterResponse) -> KvError {
                KvError::new(
                    ErrorCode::Internal,
                    format!("the master answered {op} with an unexpected {resp:?}"),
                )
            }

            $(
                call_struct!($(#[$doc])* $name $({ $($(#[$fdoc])* $field : $fty),* })?);

                impl From<$name> for MasterRequest {
                    fn from(c: $name) -> Self {
                        into_request!(c, $name $({ $($field),* })?)
                    }
                }

                impl Call for $name {
                    type Reply = $reply;
                    const OP: &'static str = $op;
                    fn reply(resp: MasterResponse) -> Result<$reply, KvError> {
                        #[allow(unreachable_patterns)]
                        match resp {
                            $pat => Ok($val),
                            other => Err(unexpected($op, &other)),
                        }
                    }
                }
            )*
        }
    };
}

macro_rules! call_struct {
    ($(#[$m:meta])* $name:ident) => {
        $(#[$m])*
        #[derive(Debug, Clone, PartialEq, Eq)]
        pub struct $name;
    };
    ($(#[$m:meta])* $name:ident { $($(#[$fm:meta])* $f:ident : $t:ty),* }) => {
        $(#[$m])*
        #[derive(Debug, Clone, PartialEq, Eq)]
        pub struct $name { $($(#[$fm])* pub $f: $t),* }
    };
}

macro_rules! into_request {
    ($c:ident, $name:ident) => {{
        let _ = $c;
        MasterRequest::$name
    }};
    ($c:ident, $name:ident { $($f:ident),* }) => {
        MasterRequest::$name { $($f: $c.$f),* }
    };
}

master_calls! {
    /// First message of a client: returns the cluster map.
    Hello("hello") { client_id: ClientId } -> ClusterMap
        = MasterResponse::Hello { cluster } => cluster;
    /// With a cluster secret, the first request on a connection: the
    /// client's id and nonce (see `auth`); the answer is the master's nonce.
    AuthBegin("auth_begin") { client_id: ClientId, nonce: [u8; 16] } -> [u8; 16]
        = MasterResponse::AuthChallenge { nonce } => nonce;
    /// The client's proof over both nonces; the connection then speaks for
    /// the client id of `AuthBegin`. The answer is the master's own proof.
    AuthProve("auth_prove") { proof: [u8; 32] } -> [u8; 32]
        = MasterResponse::AuthOk { proof } => proof;
    /// Liveness; every second from clients and storage nodes. `segments`:
    /// the segments the sender owns (a storage node), so the master can say
    /// which it does not know (after a restart) and the node mounts again.
    Ping("ping") { client_id: ClientId, segments: Vec<SegmentId> } -> Vec<SegmentId>
        = MasterResponse::Pong { unknown } => unknown;
    /// A storage node gives a segment to the pool; its id.
    MountSegment("mount_segment") { client_id: ClientId, spec: SegmentSpec } -> SegmentId
        = MasterResponse::Mounted { segment_id } => segment_id;
    /// By the segment's owner.
    UnmountSegment("unmount_segment") { client_id: ClientId, segment_id: SegmentId } -> ()
        = MasterResponse::Done => ();
    /// Graceful leave: existing replicas stay readable, new puts go elsewhere.
    DrainSegment("drain_segment") { segment_id: SegmentId } -> ()
        = MasterResponse::Done => ();
    /// Allocates a put's replicas: where to write (with write grants).
    PutStart("put_start") { client_id: ClientId, key: Vec<u8>, len: u64, opts: PutOptions }
        -> Vec<ReplicaDesc> = MasterResponse::Replicas(r) => r;
    /// Completes a put.
    PutEnd("put_end") {
        client_id: ClientId,
        key: Vec<u8>,
        /// The `put_id` of the `PutStart` it ends (see [`PutOptions::put_id`]).
        put_id: u16,
        /// xxh3-64 of the bytes written; readers check it.
        checksum: Option<u64>,
    } -> () = MasterResponse::Done => ();
    /// Gives a put's space back (its writer gave up); `put_id` as in `PutEnd`.
    PutRevoke("put_revoke") { client_id: ClientId, key: Vec<u8>, put_id: u16 } -> ()
        = MasterResponse::Done => ();
    /// Where to read an object (with read grants); grants a read lease.
    GetReplicaList("get_replica_list") { key: Vec<u8> } -> Vec<ReplicaDesc>
        = MasterResponse::Replicas(r) => r;
    /// Whether a complete object is stored; grants no lease.
    Exist("exist") { key: Vec<u8> } -> bool = MasterResponse::Exists(b) => b;
    /// Removes an object (under a lease only with `force`).
    Remove("remove") { key: Vec<u8>, force: bool } -> () = MasterResponse::Done => ();
    /// Removes every complete object without a live lease, or with
    /// `force` every complete object (the space of a leased one waits for
    /// its lease); how many went.
    RemoveAll("remove_all") { force: bool } -> u64 = MasterResponse::Removed(n) => n;
    /// Segments, capacity, use and key count of the pool.
    Stat("stat") -> PoolStat = MasterResponse::Stat(s) => s;
    /// Metadata of one object (admin API); does not extend its lease.
    Describe("describe") { key: Vec<u8> } -> ObjectInfo = MasterResponse::Described(i) => i;
    /// `PutStart` of every item; one result per item, in order.
    BatchPutStart("batch_put_start") { client_id: ClientId, items: Vec<PutItem>, opts: PutOptions }
        -> Vec<ItemResult<Vec<ReplicaDesc>>> = MasterResponse::BatchReplicas(v) => v;
    /// `PutEnd` of every item; `put_id` is the `BatchPutStart`'s.
    BatchPutEnd("batch_put_end") { client_id: ClientId, put_id: u16, items: Vec<PutDone> }
        -> Vec<ItemResult<()>> = MasterResponse::BatchDone(v) => v;
    /// `PutRevoke` of every key; `put_id` is the `BatchPutStart`'s.
    BatchPutRevoke("batch_put_revoke") { client_id: ClientId, put_id: u16, keys: Vec<Vec<u8>> }
        -> Vec<ItemResult<()>> = MasterResponse::BatchDone(v) => v;
    /// GetReplicaList of every key (grants leases).
    BatchGet("batch_get") { keys: Vec<Vec<u8>> } -> Vec<ItemResult<Vec<ReplicaDesc>>>
        = MasterResponse::BatchReplicas(v) => v;
    /// `Exist` of every key.
    BatchExist("batch_exist") { keys: Vec<Vec<u8>> } -> Vec<ItemResult<bool>>
        = MasterResponse::BatchExists(v) => v;
    /// `Remove` of every key.
    BatchRemove("batch_remove") { keys: Vec<Vec<u8>>, force: bool } -> Vec<ItemResult<()>>
        = MasterResponse::BatchDone(v) => v;
    /// A storage node asks master shard `shard` for its pending work.
    NodeTasks("node_tasks") { client_id: ClientId, shard: u32, segments: Vec<SegmentId>, max: u32 }
        -> Vec<NodeTask> = MasterResponse::Tasks(t) => t;
    /// A storage node reports on its NVMe tier (one result per update).
    NvmeUpdates("nvme_updates") { client_id: ClientId, updates: Vec<NvmeUpdate> }
        -> Vec<ItemResult<()>> = MasterResponse::BatchDone(v) => v;
    /// A client could not reach a segment's node: the master stops placing
    /// new replicas there until the node's next ping.
    ReportUnreachable("report_unreachable") { client_id: ClientId, segment_id: SegmentId } -> ()
        = MasterResponse::Done => ();
    /// HA: a standby follows the leader's state log of master shard `shard`
    /// (docs/architecture/ha.md, "Log shipping"), on that shard's own port.
    /// `session` 0 starts a session (a snapshot of the shard, then its log);
    /// `acked`: the bytes of the session's stream the standby has applied
    /// (the leader's put replies wait for it). `shards`: the standby's shard
    /// count, which must be the leader's.
    Follow("follow") { client_id: ClientId, shard: u32, shards: u32, session: u64, acked: u64 }
        -> Shipped = MasterResponse::Shipped(s) => s;
}

/// The leader's answer to `Follow`: the next bytes of the session's stream
/// (whole state-log records, each framed `len | check | payload`).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct Shipped {
    /// The session (new when `Follow` asked for 0).
    pub session: u64,
    /// The leader's term.
    pub term: u64,
    /// Offset of `records` in the session's stream (the `acked` asked with).
    pub start: u64,
    pub records: Vec<u8>,
    /// The snapshot is complete within the stream up to `start + records.len()`:
    /// from the next `Follow`, the leader's replies wait for this standby.
    pub synced: bool,
}

/// Where a master request is served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route<'a> {
    /// The connection answers it itself (the cluster map, the handshake).
    Connection,
    /// The master shard that owns this key.
    Key(&'a [u8]),
    /// Split by owning shard; the answers merged back in order.
    Batch,
    /// This master shard (a node's task queue on it).
    Shard(u32),
    /// The coordinator (on shard 0): mounts, liveness, stat, remove-all.
    Coordinator,
}

impl MasterRequest {
    /// The key a request is about, if any (it decides the owning shard).
    pub fn key(&self) -> Option<&[u8]> {
        match self {
            Self::PutStart { key, .. }
            | Self::PutEnd { key, .. }
            | Self::PutRevoke { key, .. }
            | Self::GetReplicaList { key }
            | Self::Exist { key }
            | Self::Describe { key }
            | Self::Remove { key, .. } => Some(key),
            _ => None,
        }
    }

    /// The keys of a batch request, in order.
    pub fn batch_keys(&self) -> Option<Vec<&[u8]>> {
        Some(match self {
            Self::BatchPutStart { items, .. } => items.iter().map(|i| i.key.as_slice()).collect(),
            Self::BatchPutEnd { items, .. } => items.iter().map(|i| i.key.as_slice()).collect(),
            Self::BatchPutRevoke { keys, .. }
            | Self::BatchGet { keys }
            | Self::BatchExist { keys }
            | Self::BatchRemove { keys, .. } => keys.iter().map(Vec::as_slice).collect(),
            Self::NvmeUpdates { updates, .. } => updates.iter().map(NvmeUpdate::key).collect(),
            _ => return None,
        })
    }

    /// The client a request speaks for, if it names one (with a cluster
    /// secret it must be the one its connection authenticated as).
    pub fn client_id(&self) -> Option<ClientId> {
        match self {
            Self::Hello { client_id }
            | Self::AuthBegin { client_id, .. }
            | Self::Ping { client_id, .. }
            | Self::MountSegment { client_id, .. }
            | Self::UnmountSegment { client_id, .. }
            | Self::PutStart { client_id, .. }
            | Self::PutEnd { client_id, .. }
            | Self::PutRevoke { client_id, .. }
            | Self::BatchPutStart { client_id, .. }
            | Self::BatchPutEnd { client_id, .. }
            | Self::BatchPutRevoke { client_id, .. }
            | Self::NodeTasks { client_id, .. }
            | Self::NvmeUpdates { client_id, .. }
            | Self::ReportUnreachable { client_id, .. }
            | Self::Follow { client_id, .. } => Some(*client_id),
            _ => None,
        }
    }

    /// Whether sending the request twice has the effect of sending it once
    /// (a client may then retry it on a fresh connection when a pooled one
    /// turns out to have been closed under it).
    pub fn is_idempotent(&self) -> bool {
        match self {
            Self::Hello { .. }
            | Self::Ping { .. }
            | Self::MountSegment { .. }
            | Self::UnmountSegment { .. }
            | Self::DrainSegment { .. }
            | Self::GetReplicaList { .. }
            | Self::BatchGet { .. }
            | Self::Exist { .. }
            | Self::BatchExist { .. }
            | Self::Stat
            | Self::Describe { .. }
            | Self::ReportUnreachable { .. } => true,
            Self::NvmeUpdates { updates, .. } => updates
                .iter()
                .all(|u| matches!(u, NvmeUpdate::Recovered { .. } | NvmeUpdate::Evicted { .. })),
            _ => false,
        }
    }

    /// Where the request is served: the one routing rule that clients, the
    /// master's connections, its handle and `MasterCore` all follow.
    pub fn route(&self) -> Route<'_> {
        match self {
            Self::Hello { .. }
            | Self::AuthBegin { .. }
            | Self::AuthProve { .. }
            | Self::Follow { .. } => Route::Connection,
            Self::NodeTasks { shard, .. } => Route::Shard(*shard),
            r if r.batch_keys().is_some() => Route::Batch,
            r => match r.key() {
                Some(k) => Route::Key(k),
                None => Route::Coordinator,
            },
        }
    }
}

/// A segment as `Stat` reports it.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct SegmentStat {
    pub id: SegmentId,
    pub name: String,
    pub endpoint: Endpoint,
    pub host_id: String,
    pub capacity: u64,
    pub used: u64,
    pub draining: bool,
    /// A client reported its node unreachable; no new replicas go there
    /// until the node pings again.
    pub suspect: bool,
}

/// The pool as `Stat` reports it.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq, Default)]
pub struct PoolStat {
    pub segments: Vec<SegmentStat>,
    pub keys: u64,
    pub capacity: u64,
    pub used: u64,
    /// Replicas evicted since the master started, and their bytes.
    pub evictions: u64,
    pub evicted_bytes: u64,
    /// Objects moved to NVMe by eviction, and copied back to DRAM on reads.
    pub demotions: u64,
    pub promotions: u64,
    /// Extra DRAM replicas of hot objects fetched since the master started.
    pub hot_copies: u64,
}

/// Answers of a master shard.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub enum MasterResponse {
    Hello {
        cluster: ClusterMap,
    },
    /// `unknown`: the pinged segments the master has not mounted.
    Pong {
        unknown: Vec<SegmentId>,
    },
    AuthChallenge {
        nonce: [u8; 16],
    },
    /// The master's own proof: it holds the secret too.
    AuthOk {
        proof: [u8; 32],
    },
    Mounted {
        segment_id: SegmentId,
    },
    /// The call succeeded and has nothing to return.
    Done,
    /// PutStart: where to write; GetReplicaList: where to read.
    Replicas(Vec<ReplicaDesc>),
    Exists(bool),
    /// RemoveAll: how many objects went.
    Removed(u64),
    Stat(PoolStat),
    Described(ObjectInfo),
    /// BatchPutStart / BatchGet: replicas per key, in order.
    BatchReplicas(Vec<ItemResult<Vec<ReplicaDesc>>>),
    /// BatchPutEnd / BatchPutRevoke / BatchRemove: per key, in order.
    BatchDone(Vec<ItemResult<()>>),
    BatchExists(Vec<ItemResult<bool>>),
    Tasks(Vec<NodeTask>),
    /// The leader's state log, to a following standby.
    Shipped(Shipped),
}

/// Requests to a storage node's data port. A `Write` is followed on the wire
/// by exactly `len` payload bytes.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub enum DataRequest {
    Write {
        segment_id: SegmentId,
        offset: u64,
        len: u64,
        grant: Grant,
    },
    Read {
        segment_id: SegmentId,
        offset: u64,
        len: u64,
        grant: Grant,
    },
    /// Read the object `key` of the node's NVMe tier (at packed location
    /// `loc`); must reach the shard that owns the location's region. The
    /// node reads the copy only while that slot holds `key`'s: one evicted
    /// since may hold another key's copy of the same size.
    ReadNvme {
        segment_id: SegmentId,
        loc: u64,
        len: u64,
        grant: Grant,
        key: Vec<u8>,
    },
    /// RDMA set-up: the node's capabilities, or queue pairs to its segment.
    /// The queue pairs live as long as the TCP connection that set them up.
    /// `Connect` needs a grant on the segment (any live read or write
    /// grant) when the node has a cluster secret.
    Rdma {
        req: crate::rdma_wire::RdmaRequest,
        grant: Grant,
    },
    /// With a cluster secret, a data connection proves it holds the secret
    /// before its first other request (grants alone are bearer tokens: one
    /// seen on the wire could be replayed by anyone). The client's nonce;
    /// the answer is `AuthChallenge`.
    AuthBegin { client_id: u64, nonce: [u8; 16] },
    /// The client's proof over both nonces; the answer is `AuthOk` with the
    /// node's own proof.
    AuthProve { proof: [u8; 32] },
}

/// Answers of a storage node. `Data` is followed by exactly `len` bytes.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub enum DataResponse {
    Written,
    Data { len: u64 },
    Rdma(crate::rdma_wire::RdmaResponse),
    AuthChallenge { nonce: [u8; 16] },
    AuthOk { proof: [u8; 32] },
}

/// The payload of an error frame.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct WireError {
    pub code: u16,
    pub message: String,
}

impl From<&KvError> for WireError {
    fn from(e: &KvError) -> Self {
        Self {
            code: e.code.code(),
            message: e.message.clone(),
        }
    }
}

impl From<WireError> for KvError {
    fn from(e: WireError) -> Self {
        KvError::new(ErrorCode::from_code(e.code), e.message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replica_data_shard_follows_the_slice_and_is_clamped() {
        let mut r = ReplicaDesc {
            segment_id: 1,
            endpoint: Endpoint {
                host: "h".into(),
                port: 1,
                nr_shards: 4,
            },
            slice_bytes: 100,
            host_id: String::new(),
            offset: 250,
            len: 10,
            tier: Tier::Dram,
            checksum: None,
            grant: Grant::default(),
        };
        assert_eq!(r.data_shard(), 2);
        r.offset = 10_000;
        assert_eq!(r.data_shard(), 3);
        // NVMe: the region in the packed location picks the shard.
        r.tier = Tier::Nvme;
        r.offset = (2u64 << 32) | 77;
        assert_eq!(r.data_shard(), 2);
    }

    #[test]
    fn ipv6_hosts_are_bracketed() {
        let e = Endpoint {
            host: "::1".into(),
            port: 7000,
            nr_shards: 2,
        };
        assert_eq!(e.shard_addr(1), "[::1]:7001");
    }
}
