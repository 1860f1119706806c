//! The coordinator's state and the routing rules shared by the live service
//! and the in-process [`super::core::MasterCore`].
//!
//! The coordinator (one per master, on shard 0) owns what spans shards:
//! mounted segments by name, client liveness. It never touches a
//! shard's state; it decides and returns [`ShardCommand`]s that every shard
//! then applies (by message in the service, by a loop in `MasterCore`), one
//! operation at a time, so every shard sees the same order.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use kvpool_wire::proto::{
    segment_id_for, ClientId, MasterRequest, MasterResponse, PoolStat, SegmentId, SegmentSpec,
    SegmentStat,
};
use kvpool_wire::{ErrorCode, KvError};

use super::objects::Map;
use super::state::{ShardStat, ShardState};

pub use kvpool_wire::limits::{
    MAX_CLIENTS, MAX_NAME_BYTES, MAX_NODE_SHARDS, MAX_PING_SEGMENTS, MAX_SEGMENT_BYTES,
};

/// A command every shard applies.
#[derive(Debug, Clone)]
pub enum ShardCommand {
    AddSegment {
        id: SegmentId,
        spec: Arc<SegmentSpec>,
        owner: ClientId,
    },
    /// Placement skips suspect segments (a client could not reach them).
    SetSuspect {
        ids: Vec<SegmentId>,
        suspect: bool,
    },
    RemoveSegment {
        id: SegmentId,
    },
    DrainSegment {
        id: SegmentId,
    },
    RevokeClient {
        client: ClientId,
    },
    Stat,
    RemoveAll {
        force: bool,
    },
}

/// A shard's answer to a command.
#[derive(Debug, Clone)]
pub enum CommandResult {
    /// Objects dropped or revoked, or nothing to report.
    Count(u64),
    Stat(ShardStat),
}

impl ShardState {
    /// Applies a coordinator command.
    pub fn command(&mut self, cmd: &ShardCommand, now_ms: u64) -> CommandResult {
        match cmd {
            ShardCommand::AddSegment { id, spec, owner } => {
                self.add_segment(*id, spec.clone(), *owner, now_ms);
                CommandResult::Count(0)
            }
            ShardCommand::SetSuspect { ids, suspect } => {
                for id in ids {
                    self.set_suspect(*id, *suspect);
                }
                CommandResult::Count(0)
            }
            ShardCommand::RemoveSegment { id } => CommandResult::Count(self.remove_segment(*id)),
            ShardCommand::DrainSegment { id } => {
                CommandResult::Count(u64::from(self.drain_segment(*id)))
            }
            ShardCommand::RevokeClient { client } => {
                CommandResult::Count(self.revoke_client(*client, now_ms))
            }
            ShardCommand::Stat => CommandResult::Stat(self.stat()),
            ShardCommand::RemoveAll { force } => {
                CommandResult::Count(self.remove_all(now_ms, *force))
            }
        }
    }
}

#[derive(Debug)]
struct Mounted {
    spec: Arc<SegmentSpec>,
    owner: ClientId,
    suspect: bool,
}

/// What the coordinator decided to do about an admin request.
#[derive(Debug)]
pub enum Decision {
    /// Answer now; no shard needs to act.
    Answer(MasterResponse),
    /// Every shard applies `cmd`; `finish` turns their answers into the reply.
    Broadcast { cmd: ShardCommand, finish: Finish },
}

/// How to answer once every shard has applied a broadcast command.
#[derive(Debug, Clone)]
pub enum Finish {
    Mounted(SegmentId),
    Done,
    Stat,
    Removed,
    /// A ping that cleared suspect marks: `Pong` with these unknown ids.
    Pong(Vec<SegmentId>),
}

/// Checks a segment spec from the network before anything is mounted.
fn check_spec(spec: &SegmentSpec) -> Result<(), KvError> {
    let bad = |why: String| {
        Err(KvError::new(
            ErrorCode::InvalidParams,
            format!("segment {:?}: {why}", spec.name),
        ))
    };
    if spec.name.is_empty() || spec.size == 0 || spec.endpoint.nr_shards == 0 {
        return bad("size, name and shard count must be non-zero".into());
    }
    for (what, v) in [
        ("name", &spec.name),
        ("host id", &spec.host_id),
        ("endpoint host", &spec.endpoint.host),
    ] {
        if v.len() > MAX_NAME_BYTES {
            return bad(format!("{what} longer than {MAX_NAME_BYTES} bytes"));
        }
    }
    if spec.size > MAX_SEGMENT_BYTES {
        return bad(format!(
            "{} bytes is more than the largest segment, {MAX_SEGMENT_BYTES}",
            spec.size
        ));
    }
    if spec.endpoint.nr_shards > MAX_NODE_SHARDS {
        return bad(format!("more than {MAX_NODE_SHARDS} shards"));
    }
    if spec.endpoint.port == 0 || spec.endpoint.host.is_empty() {
        return bad("no endpoint to reach it at".into());
    }
    match spec.tier {
        kvpool_wire::proto::Tier::Dram => {
            let slices = spec.slice_bytes.checked_mul(spec.endpoint.nr_shards as u64);
            if spec.slice_bytes == 0 || slices.is_none_or(|b| b < spec.size) {
                return bad("its shards' slices do not cover it".into());
            }
        }
        kvpool_wire::proto::Tier::Nvme => {
            if spec.nvme.is_some() {
                return bad("an NVMe tier has no tier of its own".into());
            }
        }
    }
    Ok(())
}

/// Clients and segments that fell silent, and what to do about them.
#[derive(Debug, Default)]
pub struct Expired {
    pub clients: Vec<ClientId>,
    pub commands: Vec<ShardCommand>,
}

/// The coordinator's state: segments, their owners, client liveness.
#[derive(Debug)]
pub struct CoordState {
    segments: BTreeMap<SegmentId, Mounted>,
    by_name: Map<String, SegmentId>,
    last_seen: Map<ClientId, u64>,
    client_ttl_ms: u64,
}

impl CoordState {
    pub fn new(client_ttl_ms: u64) -> Self {
        Self {
            segments: BTreeMap::new(),
            by_name: Map::default(),
            last_seen: Map::default(),
            client_ttl_ms,
        }
    }

    fn seen(&mut self, client: ClientId, now_ms: u64) -> Result<(), KvError> {
        if !self.last_seen.contains_key(&client) && self.last_seen.len() >= MAX_CLIENTS {
            return Err(KvError::new(
                ErrorCode::ResourceExhausted,
                format!("the master tracks its maximum of {MAX_CLIENTS} clients"),
            ));
        }
        self.last_seen.insert(client, now_ms);
        Ok(())
    }

    /// Decides an admin request (mount, unmount, drain, ping, stat, remove all).
    pub fn decide(&mut self, req: MasterRequest, now_ms: u64) -> Result<Decision, KvError> {
        match req {
            MasterRequest::Ping {
                client_id,
                segments,
            } => {
                if segments.len() > MAX_PING_SEGMENTS {
                    return Err(KvError::new(
                        ErrorCode::InvalidParams,
                        format!("a ping names at most {MAX_PING_SEGMENTS} segments"),
                    ));
                }
                self.seen(client_id, now_ms)?;
                let mut unknown = Vec::new();
                let mut cleared = Vec::new();
                for id in segments {
                    match self.segments.get_mut(&id) {
                        None => unknown.push(id),
                        Some(m) if m.owner == client_id && m.suspect => {
                            // Its node is alive after all.
                            m.suspect = false;
                            cleared.push(id);
                        }
                        Some(_) => {}
                    }
                }
                if cleared.is_empty() {
                    return Ok(Decision::Answer(MasterResponse::Pong { unknown }));
                }
                tracing::info!(segments = ?cleared, "owner pinged: no longer suspect");
                Ok(Decision::Broadcast {
                    cmd: ShardCommand::SetSuspect {
                        ids: cleared,
                        suspect: false,
                    },
                    finish: Finish::Pong(unknown),
                })
            }
            MasterRequest::ReportUnreachable {
                client_id,
                segment_id,
            } => {
                self.seen(client_id, now_ms)?;
                match self.segments.get_mut(&segment_id) {
                    Some(m) if !m.suspect && m.owner != client_id => {
                        m.suspect = true;
                        tracing::warn!(
                            segment = %m.spec.name,
                            reporter = client_id,
                            "a client could not reach this segment's node: no new replicas there until it pings"
                        );
                        Ok(Decision::Broadcast {
                            cmd: ShardCommand::SetSuspect {
                                ids: vec![segment_id],
                                suspect: true,
                            },
                            finish: Finish::Done,
                        })
                    }
                    _ => Ok(Decision::Answer(MasterResponse::Done)),
                }
            }
            MasterRequest::MountSegment { client_id, spec } => {
                check_spec(&spec)?;
                if let Some(&id) = self.by_name.get(&spec.name) {
                    let m = &self.segments[&id];
                    let same = *m.spec == spec;
                    let old_owner = m.owner;
                    // An NVMe tier back at a new address: NVMe before and
                    // now, the same size. A DRAM segment is never taken for
                    // one (its allocator and replicas would be read as
                    // NVMe's: found by the master_request fuzz target).
                    let same_tier_back = spec.tier == kvpool_wire::proto::Tier::Nvme
                        && m.spec.tier == kvpool_wire::proto::Tier::Nvme
                        && m.spec.size == spec.size;
                    if same || same_tier_back {
                        // A retried mount is the same mount. Mounted by
                        // another client (its node restarted on the same
                        // ports, or an NVMe tier back at a new address),
                        // it changes hands: the old registration's expiry
                        // must not take it away. Its replicas stay valid.
                        self.seen(client_id, now_ms)?;
                        if same && old_owner == client_id {
                            return Ok(Decision::Answer(MasterResponse::Mounted {
                                segment_id: id,
                            }));
                        }
                        if old_owner != client_id {
                            tracing::info!(
                                segment = %spec.name,
                                from = old_owner,
                                to = client_id,
                                "segment mounted again by a new owner"
                            );
                        }
                        let spec = Arc::new(spec);
                        let m = self.segments.get_mut(&id).expect("present");
                        m.spec = spec.clone();
                        m.owner = client_id;
                        m.suspect = false;
                        return Ok(Decision::Broadcast {
                            cmd: ShardCommand::AddSegment {
                                id,
                                spec,
                                owner: client_id,
                            },
                            finish: Finish::Mounted(id),
                        });
                    }
                    return Err(KvError::new(
                        ErrorCode::InvalidParams,
                        format!(
                            "segment {:?} is mounted with another size or address",
                            spec.name
                        ),
                    ));
                }
                let id = segment_id_for(&spec.name);
                if self.segments.contains_key(&id) {
                    return Err(KvError::new(
                        ErrorCode::Internal,
                        format!(
                            "segment id collision for {:?}; mount it under another name",
                            spec.name
                        ),
                    ));
                }
                self.seen(client_id, now_ms)?;
                let spec = Arc::new(spec);
                self.by_name.insert(spec.name.clone(), id);
                self.segments.insert(
                    id,
                    Mounted {
                        spec: spec.clone(),
                        owner: client_id,
                        suspect: false,
                    },
                );
                Ok(Decision::Broadcast {
                    cmd: ShardCommand::AddSegment {
                        id,
                        spec,
                        owner: client_id,
                    },
                    finish: Finish::Mounted(id),
                })
            }
            MasterRequest::UnmountSegment {
                client_id,
                segment_id,
            } => {
                if let Some(m) = self.segments.get(&segment_id) {
                    if m.owner != client_id {
                        return Err(KvError::new(
                            ErrorCode::IllegalClient,
                            format!(
                                "segment {:?} belongs to another client; only its node unmounts it",
                                m.spec.name
                            ),
                        ));
                    }
                }
                match self.forget(segment_id) {
                    // Idempotent: an unknown or already unmounted segment is done.
                    None => Ok(Decision::Answer(MasterResponse::Done)),
                    Some(cmd) => Ok(Decision::Broadcast {
                        cmd,
                        finish: Finish::Done,
                    }),
                }
            }
            MasterRequest::DrainSegment { segment_id } => {
                // The shards keep the mark (and their state directories
                // record it): stat reads it from them.
                if !self.segments.contains_key(&segment_id) {
                    return Err(KvError::new(
                        ErrorCode::SegmentNotFound,
                        format!("segment {segment_id:016x} is not mounted"),
                    ));
                }
                Ok(Decision::Broadcast {
                    cmd: ShardCommand::DrainSegment { id: segment_id },
                    finish: Finish::Done,
                })
            }
            MasterRequest::Stat => Ok(Decision::Broadcast {
                cmd: ShardCommand::Stat,
                finish: Finish::Stat,
            }),
            MasterRequest::RemoveAll { force } => Ok(Decision::Broadcast {
                cmd: ShardCommand::RemoveAll { force },
                finish: Finish::Removed,
            }),
            other => Err(KvError::new(
                ErrorCode::Internal,
                format!("{} is not an admin request", other.op_name()),
            )),
        }
    }

    fn forget(&mut self, id: SegmentId) -> Option<ShardCommand> {
        let m = self.segments.remove(&id)?;
        self.by_name.remove(&m.spec.name);
        tracing::info!(segment = %m.spec.name, id, owner = m.owner, "segment unmounted");
        Some(ShardCommand::RemoveSegment { id })
    }

    /// Turns the shards' answers to a broadcast into the reply.
    pub fn finish(&self, finish: Finish, results: Vec<CommandResult>) -> MasterResponse {
        match finish {
            Finish::Mounted(id) => {
                if let Some(m) = self.segments.get(&id) {
                    tracing::info!(
                        segment = %m.spec.name,
                        id,
                        size = m.spec.size,
                        endpoint = %m.spec.endpoint.shard_addr(0),
                        "segment mounted"
                    );
                }
                MasterResponse::Mounted { segment_id: id }
            }
            Finish::Done => MasterResponse::Done,
            Finish::Removed => MasterResponse::Removed(
                results
                    .iter()
                    .map(|r| match r {
                        CommandResult::Count(n) => *n,
                        CommandResult::Stat(_) => 0,
                    })
                    .sum(),
            ),
            Finish::Stat => MasterResponse::Stat(self.merge_stat(results)),
            Finish::Pong(unknown) => MasterResponse::Pong { unknown },
        }
    }

    fn merge_stat(&self, results: Vec<CommandResult>) -> PoolStat {
        let mut keys = 0;
        let mut evictions = 0;
        let mut evicted_bytes = 0;
        let mut demotions = 0;
        let mut promotions = 0;
        let mut hot_copies = 0;
        let mut per_seg: HashMap<SegmentId, (u64, u64, bool)> = HashMap::new();
        for r in results {
            if let CommandResult::Stat(s) = r {
                keys += s.keys;
                evictions += s.evictions;
                evicted_bytes += s.evicted_bytes;
                demotions += s.demotions;
                promotions += s.promotions;
                hot_copies += s.hot_copies;
                // Draining only where every shard says so: a drain that
                // reached some shards' logs and not others' before a crash
                // shows as not draining, and the operator drains again.
                for (id, cap, used, draining) in s.segments {
                    let e = per_seg.entry(id).or_insert((0, 0, true));
                    e.0 += cap;
                    e.1 += used;
                    e.2 &= draining;
                }
            }
        }
        let mut segments: Vec<SegmentStat> = self
            .segments
            .iter()
            .map(|(id, m)| {
                let (capacity, used, draining) = per_seg.get(id).copied().unwrap_or((0, 0, false));
                SegmentStat {
                    id: *id,
                    name: m.spec.name.clone(),
                    endpoint: m.spec.endpoint.clone(),
                    host_id: m.spec.host_id.clone(),
                    capacity,
                    used,
                    draining,
                    suspect: m.suspect,
                }
            })
            .collect();
        segments.sort_by(|a, b| a.name.cmp(&b.name));
        PoolStat {
            keys,
            capacity: segments.iter().map(|s| s.capacity).sum(),
            used: segments.iter().map(|s| s.used).sum(),
            evictions,
            evicted_bytes,
            demotions,
            promotions,
            hot_copies,
            segments,
        }
    }

    /// Clients silent for `client_ttl_ms`: their segments are unmounted and
    /// their Processing puts revoked.
    pub fn expire(&mut self, now_ms: u64) -> Expired {
        let ttl = self.client_ttl_ms;
        let dead: Vec<ClientId> = self
            .last_seen
            .iter()
            .filter(|(_, &t)| now_ms.saturating_sub(t) >= ttl)
            .map(|(c, _)| *c)
            .collect();
        let mut out = Expired::default();
        for c in dead {
            self.last_seen.remove(&c);
            let owned: Vec<SegmentId> = self
                .segments
                .iter()
                .filter(|(_, m)| m.owner == c)
                .map(|(id, _)| *id)
                .collect();
            for id in owned {
                tracing::warn!(
                    client = c,
                    segment = id,
                    "owner silent past client_ttl_ms: unmounting"
                );
                if let Some(cmd) = self.forget(id) {
                    out.commands.push(cmd);
                }
            }
            out.commands.push(ShardCommand::RevokeClient { client: c });
            out.clients.push(c);
        }
        out
    }

    /// Mounted segments (for the admin API).
    pub fn segment_count(&self) -> usize {
        self.segments.len()
    }
}
