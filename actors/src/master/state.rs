//! One master shard's metadata, as a pure state machine.
//!
//! No I/O and no clock: every call that depends on time takes `now_ms`, so
//! the same code runs under the live service and under tests with a simulated
//! clock. A shard owns the keys that hash to it and one range of every mounted
//! segment (`[size*s/n, size*(s+1)/n)` for shard `s` of `n`), with its own
//! allocator: an allocation never leaves the shard.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use kvpool_storage::alloc::RangeAllocator;
use kvpool_storage::segment::SEGMENT_ALIGN;
use kvpool_transport::proto::{
    ClientId, MasterResponse, PutOptions, ReplicaDesc, SegmentId, SegmentSpec, Tier,
};
use kvpool_transport::{ErrorCode, KvError};
use xxhash_rust::xxh3::Xxh3Builder;

/// Limits the shard enforces (sized from the config at start).
#[derive(Debug, Clone)]
pub struct Limits {
    pub max_key_bytes: usize,
    pub max_value_bytes: u64,
    /// Objects this shard may hold (the pool's `max_keys` split over shards).
    pub max_keys: u64,
}

/// A segment as one shard sees it: its spec and this shard's range of it.
#[derive(Debug)]
struct SegmentSlot {
    spec: Arc<SegmentSpec>,
    alloc: RangeAllocator,
    draining: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ObjState {
    Processing,
    Complete,
}

#[derive(Debug)]
struct Replica {
    segment: SegmentId,
    offset: u64,
}

#[derive(Debug)]
struct Object {
    writer: ClientId,
    state: ObjState,
    size: u64,
    replicas: Vec<Replica>,
}

/// What a shard reports for `Stat`.
#[derive(Debug, Clone, Default)]
pub struct ShardStat {
    pub keys: u64,
    /// (segment, capacity of this shard's range, used in it)
    pub segments: Vec<(SegmentId, u64, u64)>,
}

/// One master shard's state.
#[derive(Debug)]
pub struct ShardState {
    shard: u32,
    nr_shards: u32,
    limits: Limits,
    segments: BTreeMap<SegmentId, SegmentSlot>,
    objects: HashMap<Box<[u8]>, Object, Xxh3Builder>,
}

fn err(code: ErrorCode, msg: impl Into<String>) -> KvError {
    KvError::new(code, msg)
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

impl ShardState {
    pub fn new(shard: u32, nr_shards: u32, limits: Limits) -> Self {
        assert!(shard < nr_shards);
        Self {
            shard,
            nr_shards,
            limits,
            segments: BTreeMap::new(),
            objects: HashMap::with_hasher(Xxh3Builder::new()),
        }
    }

    pub fn key_count(&self) -> u64 {
        self.objects.len() as u64
    }

    /// This shard's range of a segment of `size` bytes.
    pub fn range_of(&self, size: u64) -> (u64, u64) {
        let lo = (size as u128 * self.shard as u128 / self.nr_shards as u128) as u64;
        let hi = (size as u128 * (self.shard as u128 + 1) / self.nr_shards as u128) as u64;
        (lo, hi - lo)
    }

    /// Adds a segment (idempotent for the same id).
    pub fn add_segment(&mut self, id: SegmentId, spec: Arc<SegmentSpec>) {
        if self.segments.contains_key(&id) {
            return;
        }
        let (lo, len) = self.range_of(spec.size);
        self.segments.insert(
            id,
            SegmentSlot {
                alloc: RangeAllocator::new(lo, len, SEGMENT_ALIGN),
                spec,
                draining: false,
            },
        );
    }

    /// Removes a segment and every replica on it; objects left with no replica
    /// are removed. Returns how many objects went. Idempotent.
    pub fn remove_segment(&mut self, id: SegmentId) -> u64 {
        if self.segments.remove(&id).is_none() {
            return 0;
        }
        let before = self.objects.len();
        self.objects.retain(|_, o| {
            o.replicas.retain(|r| r.segment != id);
            !o.replicas.is_empty()
        });
        (before - self.objects.len()) as u64
    }

    fn check_key(&self, key: &[u8]) -> Result<(), KvError> {
        if key.is_empty() {
            return Err(err(ErrorCode::InvalidParams, "empty key"));
        }
        if key.len() > self.limits.max_key_bytes {
            return Err(err(
                ErrorCode::InvalidParams,
                format!(
                    "key of {} bytes exceeds the maximum of {}",
                    key.len(),
                    self.limits.max_key_bytes
                ),
            ));
        }
        Ok(())
    }

    fn describe(&self, obj: &Object) -> Vec<ReplicaDesc> {
        obj.replicas
            .iter()
            .filter_map(|r| {
                let slot = self.segments.get(&r.segment)?;
                Some(ReplicaDesc {
                    segment_id: r.segment,
                    endpoint: slot.spec.endpoint.clone(),
                    slice_bytes: slot.spec.slice_bytes,
                    host_id: slot.spec.host_id.clone(),
                    offset: r.offset,
                    len: obj.size,
                    tier: Tier::Dram,
                })
            })
            .collect()
    }

    /// Chooses up to `n` distinct segments with room for `size` bytes, most
    /// free (by ratio) first.
    fn place(&self, size: u64, n: usize) -> Vec<SegmentId> {
        let mut cands: Vec<(SegmentId, f64)> = self
            .segments
            .iter()
            .filter(|(_, s)| !s.draining && s.alloc.largest_free() >= s.alloc.rounded(size))
            .map(|(id, s)| {
                let cap = s.alloc.capacity().max(1) as f64;
                (*id, s.alloc.free() as f64 / cap)
            })
            .collect();
        cands.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        cands.into_iter().take(n).map(|(id, _)| id).collect()
    }

    pub fn put_start(
        &mut self,
        client: ClientId,
        key: &[u8],
        len: u64,
        opts: &PutOptions,
        _now_ms: u64,
    ) -> Result<Vec<ReplicaDesc>, KvError> {
        self.check_key(key)?;
        if len == 0 {
            return Err(err(ErrorCode::InvalidParams, "value length is 0"));
        }
        if len > self.limits.max_value_bytes {
            return Err(err(
                ErrorCode::InvalidParams,
                format!(
                    "value of {len} bytes exceeds the maximum of {}",
                    self.limits.max_value_bytes
                ),
            ));
        }
        if opts.replicas == 0 {
            return Err(err(ErrorCode::InvalidParams, "replicas must be at least 1"));
        }
        if self.objects.contains_key(key) {
            return Err(err(
                ErrorCode::ObjectAlreadyExists,
                format!("key {} exists or is being put", show_key(key)),
            ));
        }
        if self.objects.len() as u64 >= self.limits.max_keys {
            return Err(err(
                ErrorCode::ResourceExhausted,
                format!(
                    "the pool holds its maximum of keys ({} on this shard)",
                    self.limits.max_keys
                ),
            ));
        }
        let targets = self.place(len, opts.replicas as usize);
        if targets.is_empty() {
            return Err(err(
                ErrorCode::NoSpace,
                format!("no segment has {len} free bytes"),
            ));
        }
        let mut replicas = Vec::with_capacity(targets.len());
        for seg in targets {
            let slot = self
                .segments
                .get_mut(&seg)
                .expect("placed on a mounted segment");
            let offset = slot
                .alloc
                .alloc(len)
                .expect("placement checked the largest free extent");
            replicas.push(Replica {
                segment: seg,
                offset,
            });
        }
        let obj = Object {
            writer: client,
            state: ObjState::Processing,
            size: len,
            replicas,
        };
        let descs = self.describe(&obj);
        self.objects.insert(key.into(), obj);
        Ok(descs)
    }

    fn free_replicas(&mut self, obj: &Object) {
        for r in &obj.replicas {
            if let Some(slot) = self.segments.get_mut(&r.segment) {
                slot.alloc.dealloc(r.offset, obj.size);
            }
        }
    }

    fn owned_processing(&self, client: ClientId, key: &[u8]) -> Result<&Object, KvError> {
        self.check_key(key)?;
        let obj = self.objects.get(key).ok_or_else(|| {
            err(
                ErrorCode::ObjectNotFound,
                format!("no object {}", show_key(key)),
            )
        })?;
        if obj.writer != client {
            return Err(err(
                ErrorCode::IllegalClient,
                format!("key {} is being put by another client", show_key(key)),
            ));
        }
        if obj.state != ObjState::Processing {
            return Err(err(
                ErrorCode::ObjectAlreadyExists,
                format!("key {} is already complete", show_key(key)),
            ));
        }
        Ok(obj)
    }

    pub fn put_end(&mut self, client: ClientId, key: &[u8], _now_ms: u64) -> Result<(), KvError> {
        self.owned_processing(client, key)?;
        let obj = self.objects.get_mut(key).expect("checked above");
        obj.state = ObjState::Complete;
        Ok(())
    }

    pub fn put_revoke(
        &mut self,
        client: ClientId,
        key: &[u8],
        _now_ms: u64,
    ) -> Result<(), KvError> {
        self.owned_processing(client, key)?;
        let obj = self.objects.remove(key).expect("checked above");
        self.free_replicas(&obj);
        Ok(())
    }

    pub fn get_replica_list(
        &mut self,
        key: &[u8],
        _now_ms: u64,
    ) -> Result<Vec<ReplicaDesc>, KvError> {
        self.check_key(key)?;
        let obj = self.objects.get(key).ok_or_else(|| {
            err(
                ErrorCode::ObjectNotFound,
                format!("no object {}", show_key(key)),
            )
        })?;
        if obj.state != ObjState::Complete {
            return Err(err(
                ErrorCode::ReplicaNotReady,
                format!("key {} is still being put", show_key(key)),
            ));
        }
        Ok(self.describe(obj))
    }

    pub fn exist(&self, key: &[u8], _now_ms: u64) -> Result<bool, KvError> {
        self.check_key(key)?;
        Ok(self
            .objects
            .get(key)
            .is_some_and(|o| o.state == ObjState::Complete))
    }

    pub fn remove(&mut self, key: &[u8], _force: bool, _now_ms: u64) -> Result<(), KvError> {
        self.check_key(key)?;
        let obj = self.objects.get(key).ok_or_else(|| {
            err(
                ErrorCode::ObjectNotFound,
                format!("no object {}", show_key(key)),
            )
        })?;
        if obj.state == ObjState::Processing {
            return Err(err(
                ErrorCode::ReplicaNotReady,
                format!("key {} is still being put", show_key(key)),
            ));
        }
        let obj = self.objects.remove(key).expect("present");
        self.free_replicas(&obj);
        Ok(())
    }

    /// Removes every complete object; returns the count.
    pub fn remove_all(&mut self, _now_ms: u64) -> u64 {
        let keys: Vec<Box<[u8]>> = self
            .objects
            .iter()
            .filter(|(_, o)| o.state == ObjState::Complete)
            .map(|(k, _)| k.clone())
            .collect();
        for k in &keys {
            let obj = self.objects.remove(k).expect("present");
            self.free_replicas(&obj);
        }
        keys.len() as u64
    }

    pub fn stat(&self) -> ShardStat {
        ShardStat {
            keys: self.objects.len() as u64,
            segments: self
                .segments
                .iter()
                .map(|(id, s)| (*id, s.alloc.capacity(), s.alloc.used()))
                .collect(),
        }
    }

    /// Applies a key request (the master's RPC dispatch).
    pub fn apply(
        &mut self,
        req: kvpool_transport::proto::MasterRequest,
        now_ms: u64,
    ) -> Result<MasterResponse, KvError> {
        use kvpool_transport::proto::MasterRequest as R;
        Ok(match req {
            R::PutStart {
                client_id,
                key,
                len,
                opts,
            } => MasterResponse::Replicas(self.put_start(client_id, &key, len, &opts, now_ms)?),
            R::PutEnd { client_id, key } => {
                self.put_end(client_id, &key, now_ms)?;
                MasterResponse::Done
            }
            R::PutRevoke { client_id, key } => {
                self.put_revoke(client_id, &key, now_ms)?;
                MasterResponse::Done
            }
            R::GetReplicaList { key } => {
                MasterResponse::Replicas(self.get_replica_list(&key, now_ms)?)
            }
            R::Exist { key } => MasterResponse::Exists(self.exist(&key, now_ms)?),
            R::Remove { key, force } => {
                self.remove(&key, force, now_ms)?;
                MasterResponse::Done
            }
            other => {
                return Err(err(
                    ErrorCode::Internal,
                    format!("{} is not a key request", other.op_name()),
                ))
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvpool_transport::proto::Endpoint;

    fn spec(name: &str, size: u64) -> Arc<SegmentSpec> {
        Arc::new(SegmentSpec {
            name: name.into(),
            size,
            endpoint: Endpoint {
                host: "127.0.0.1".into(),
                port: 1,
                nr_shards: 1,
            },
            slice_bytes: size,
            host_id: "h".into(),
        })
    }

    fn shard() -> ShardState {
        ShardState::new(
            0,
            1,
            Limits {
                max_key_bytes: 4096,
                max_value_bytes: 1 << 30,
                max_keys: 1000,
            },
        )
    }

    #[test]
    fn put_get_remove_round_trip() {
        let mut s = shard();
        s.add_segment(1, spec("a", 1 << 20));
        let r = s
            .put_start(7, b"k", 100, &PutOptions::default(), 0)
            .unwrap();
        assert_eq!(r.len(), 1);
        assert_eq!(
            s.get_replica_list(b"k", 0).unwrap_err().code,
            ErrorCode::ReplicaNotReady
        );
        assert!(!s.exist(b"k", 0).unwrap());
        s.put_end(7, b"k", 0).unwrap();
        assert!(s.exist(b"k", 0).unwrap());
        assert_eq!(s.get_replica_list(b"k", 0).unwrap(), r);
        s.remove(b"k", false, 0).unwrap();
        assert_eq!(
            s.get_replica_list(b"k", 0).unwrap_err().code,
            ErrorCode::ObjectNotFound
        );
        assert_eq!(s.stat().segments[0].2, 0, "space freed");
    }

    #[test]
    fn shards_split_a_segment_into_disjoint_ranges() {
        let limits = Limits {
            max_key_bytes: 10,
            max_value_bytes: 10,
            max_keys: 10,
        };
        let n = 3;
        let mut end = 0;
        for i in 0..n {
            let s = ShardState::new(i, n, limits.clone());
            let (lo, len) = s.range_of(1000);
            assert_eq!(lo, end);
            end = lo + len;
        }
        assert_eq!(end, 1000);
    }
}
