//! The configuration of a kvpool process. Every key has a default (the
//! embedded single-node deployment needs no file); an unknown key or a bad
//! value is a start-up error naming the key. `configs/*.toml` document each key.
//!
//! One crate for every role's settings, so that a role's crate, the process
//! that composes roles, and tools read the same file the same way.

use std::time::Duration;

use kvpool_runtime::config::Bytes;
use kvpool_runtime::ShardPoolConfig;
use kvpool_wire::auth::ClusterKey;
use kvpool_wire::limits::{MAX_FRAME_BYTES, MAX_KEY_BYTES, MIN_FRAME_BYTES};
use serde::{Deserialize, Serialize};

/// The whole config file.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct NodeConfig {
    pub runtime: RuntimeConfig,
    pub master: MasterConfig,
    pub storage: StorageConfig,
    pub client: ClientConfig,
    pub security: SecurityConfig,
    pub engine: EngineConfig,
    pub serving: ServingConfig,
    pub resp: RespConfig,
}

/// The environment variable that holds the cluster secret (it overrides
/// `[security] secret`).
pub const SECRET_ENV: &str = "KVPOOL_SECRET";

/// The environment variable that holds the serving front's API key (it
/// overrides `[serving] api_key`).
pub const API_KEY_ENV: &str = "KVPOOL_API_KEY";

impl NodeConfig {
    /// Takes the cluster secret from `KVPOOL_SECRET` when it is set (and not
    /// empty): a secret is better kept out of config files.
    pub fn apply_env(&mut self) {
        if let Ok(v) = std::env::var(SECRET_ENV) {
            if !v.is_empty() {
                self.security.secret = v;
            }
        }
        if let Ok(v) = std::env::var(API_KEY_ENV) {
            if !v.is_empty() {
                self.serving.api_key = v;
            }
        }
    }

    /// The cluster key, when a secret is configured.
    pub fn cluster_key(&self) -> Result<Option<ClusterKey>, String> {
        self.security.key()
    }

    /// The `[client]` settings with the cluster secret filled in: what this
    /// process's pool clients (the CLI, a storage node's own) use.
    pub fn client_config(&self) -> ClientConfig {
        let mut c = self.client.clone();
        c.secret = Secret::new(self.security.secret.clone());
        c
    }

    /// The addresses this process would listen on beyond loopback for
    /// `has_master` / `has_storage` roles (to warn about an open cluster).
    pub fn wide_listens(&self, has_master: bool, has_storage: bool) -> Vec<String> {
        let mut v = Vec::new();
        if has_master {
            v.push(self.master.listen.clone());
            v.push(self.master.http.clone());
        }
        if has_storage {
            v.push(self.storage.listen.clone());
            if !has_master {
                v.push(self.storage.http.clone());
            }
        }
        v.retain(|a| !is_loopback(a));
        v
    }

    pub fn from_toml(text: &str, origin: &str) -> Result<Self, kvpool_runtime::RuntimeError> {
        let cfg: Self = kvpool_runtime::config::from_toml_str(text, origin)?;
        cfg.validate()
            .map_err(|e| kvpool_runtime::RuntimeError::Config(format!("{origin}: {e}")))?;
        Ok(cfg)
    }

    /// Checks values that parse but make no sense; the message names the key.
    pub fn validate(&self) -> Result<(), String> {
        fn nonzero(name: &str, v: u64) -> Result<(), String> {
            if v == 0 {
                Err(format!("key `{name}`: must be greater than 0"))
            } else {
                Ok(())
            }
        }
        nonzero(
            "runtime.job_queue_depth",
            self.runtime.job_queue_depth as u64,
        )?;
        nonzero("runtime.actor_threads", self.runtime.actor_threads as u64)?;
        nonzero(
            "runtime.http_header_timeout_ms",
            self.runtime.http_header_timeout_ms,
        )?;
        nonzero(
            "runtime.http_body_timeout_ms",
            self.runtime.http_body_timeout_ms,
        )?;
        nonzero(
            "runtime.http_max_connections",
            self.runtime.http_max_connections as u64,
        )?;
        // Each listener's cap is a semaphore's permits: past tokio's limit
        // (2^61) it would panic at start; far past any descriptor limit
        // already at this bound.
        if self.runtime.http_max_connections > 1 << 20 {
            return Err("key `runtime.http_max_connections`: at most 1048576".into());
        }
        nonzero("master.inbox_depth", self.master.inbox_depth as u64)?;
        nonzero("master.max_connections", self.master.max_connections as u64)?;
        nonzero("master.max_key_bytes", self.master.max_key_bytes as u64)?;
        if self.master.max_key_bytes > MAX_KEY_BYTES {
            return Err(format!(
                "key `master.max_key_bytes`: at most {MAX_KEY_BYTES}"
            ));
        }
        nonzero("master.max_value_bytes", self.master.max_value_bytes.get())?;
        nonzero("master.max_keys", self.master.max_keys)?;
        nonzero("master.io_timeout_ms", self.master.io_timeout_ms)?;
        nonzero("master.max_batch", self.master.max_batch as u64)?;
        nonzero("master.lease_ttl_ms", self.master.lease_ttl_ms)?;
        nonzero("master.put_timeout_ms", self.master.put_timeout_ms)?;
        nonzero("master.client_ttl_ms", self.master.client_ttl_ms)?;
        nonzero("master.tick_ms", self.master.tick_ms)?;
        nonzero("master.ha_lease_ttl_s", self.master.ha_lease_ttl_s)?;
        nonzero("master.ha_sync_timeout_ms", self.master.ha_sync_timeout_ms)?;
        if !self.master.ha.is_empty() && self.master.ha_sync_timeout_ms >= self.master.io_timeout_ms
        {
            return Err(format!(
                "key `master.ha_sync_timeout_ms`: {} must be below master.io_timeout_ms ({})",
                self.master.ha_sync_timeout_ms, self.master.io_timeout_ms
            ));
        }
        // A shipping answer carries up to 1 MiB of state-log records, or one
        // record of up to 1 MiB beyond that: 2 MiB frames carry any.
        if !self.master.ha.is_empty() && self.master.max_frame_bytes.get() < HA_MIN_FRAME_BYTES {
            return Err(format!(
                "key `master.max_frame_bytes`: {} is below {} MiB, the largest answer that ships \
                 the state log to a standby (with `master.ha` set)",
                self.master.max_frame_bytes.get(),
                HA_MIN_FRAME_BYTES >> 20
            ));
        }
        if self.master.ha_fence_margin_ms.saturating_mul(2) > self.master.ha_lease_ttl_s * 1000 {
            return Err(format!(
                "key `master.ha_fence_margin_ms`: {} is more than half of \
                 master.ha_lease_ttl_s ({} s)",
                self.master.ha_fence_margin_ms, self.master.ha_lease_ttl_s
            ));
        }
        if !self.master.ha.is_empty() && !self.master.ha.starts_with("etcd://") {
            return Err(format!(
                "key `master.ha`: {:?} is not an etcd://host:port[,host:port...] URL",
                self.master.ha
            ));
        }
        let hw = self.master.high_watermark;
        if !(hw > 0.0 && hw <= 1.0) {
            return Err(format!(
                "key `master.high_watermark`: {hw} is not in (0, 1]"
            ));
        }
        let er = self.master.eviction_ratio;
        if !(er > 0.0 && er <= 1.0) {
            return Err(format!(
                "key `master.eviction_ratio`: {er} is not in (0, 1]"
            ));
        }
        if self.master.hot_replicas >= 2 {
            nonzero("master.hot_reads", self.master.hot_reads.into())?;
            nonzero("master.hot_window_ms", self.master.hot_window_ms)?;
            let hb = self.master.hot_budget;
            if !(hb > 0.0 && hb < 1.0) {
                return Err(format!("key `master.hot_budget`: {hb} is not in (0, 1)"));
            }
        }
        nonzero("storage.segment_size", self.storage.segment_size.get())?;
        if !self.storage.segment_size.get().is_multiple_of(4096) {
            return Err(format!(
                "key `storage.segment_size`: {} is not a multiple of 4096",
                self.storage.segment_size.get()
            ));
        }
        nonzero("storage.ping_interval_ms", self.storage.ping_interval_ms)?;
        nonzero(
            "storage.max_connections",
            self.storage.max_connections as u64,
        )?;
        nonzero("storage.io_timeout_ms", self.storage.io_timeout_ms)?;
        let n = &self.storage.nvme;
        if !n.path.is_empty() {
            nonzero("storage.nvme.capacity", n.capacity.get())?;
            nonzero("storage.nvme.task_poll_ms", n.task_poll_ms)?;
            if !(0.0 < n.low_watermark
                && n.low_watermark < n.high_watermark
                && n.high_watermark <= 1.0)
            {
                return Err(
                    "keys `storage.nvme.low_watermark` and `storage.nvme.high_watermark`: need 0 < low < high <= 1"
                        .into(),
                );
            }
        }
        for (k, v) in [
            (
                "master.first_frame_timeout_ms",
                self.master.first_frame_timeout_ms,
            ),
            (
                "storage.first_frame_timeout_ms",
                self.storage.first_frame_timeout_ms,
            ),
            (
                "master.max_frame_memory",
                self.master.max_frame_memory.get(),
            ),
            (
                "storage.max_frame_memory",
                self.storage.max_frame_memory.get(),
            ),
        ] {
            nonzero(k, v)?;
        }
        for (k, mem, frame) in [
            (
                "master.max_frame_memory",
                self.master.max_frame_memory,
                self.master.max_frame_bytes,
            ),
            (
                "storage.max_frame_memory",
                self.storage.max_frame_memory,
                self.storage.max_frame_bytes,
            ),
        ] {
            if mem.get() < frame.get() {
                return Err(format!(
                    "key `{k}`: {} is less than one frame of max_frame_bytes ({})",
                    mem.get(),
                    frame.get()
                ));
            }
        }
        self.security.key()?;
        if self.security.clock_skew_ms > 600_000 {
            return Err("key `security.clock_skew_ms`: at most 600000 (10 minutes)".into());
        }
        nonzero("client.timeout_ms", self.client.timeout_ms)?;
        nonzero("client.connect_timeout_ms", self.client.connect_timeout_ms)?;
        nonzero(
            "client.max_connections_per_endpoint",
            self.client.max_connections_per_endpoint as u64,
        )?;
        nonzero(
            "client.batch_parallelism",
            self.client.batch_parallelism as u64,
        )?;
        nonzero("client.tcp_slice_bytes", self.client.tcp_slice_bytes.get())?;
        nonzero("client.lanes", self.client.lanes as u64)?;
        nonzero("client.max_in_flight", self.client.max_in_flight as u64)?;
        self.resp.validate()?;
        self.storage.rdma.validate("storage.rdma")?;
        self.client.rdma.validate("client.rdma")?;
        self.serving.validate()?;
        for (k, v) in [
            ("master.max_frame_bytes", self.master.max_frame_bytes),
            ("storage.max_frame_bytes", self.storage.max_frame_bytes),
            ("client.max_frame_bytes", self.client.max_frame_bytes),
        ] {
            if v.get() < MIN_FRAME_BYTES || v.get() > MAX_FRAME_BYTES {
                return Err(format!(
                    "key `{k}`: must be between {} KiB and 4 GiB",
                    MIN_FRAME_BYTES >> 10
                ));
            }
        }
        Ok(())
    }
}

pub use kvpool_wire::limits::HA_MIN_FRAME_BYTES;

mod role;
pub use role::Role;

/// `[runtime]`: shards and the actor side.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RuntimeConfig {
    /// Shards (glommio executors, one per core); 0 = one per available core.
    pub shards: usize,
    /// Pin each shard to a core.
    pub pin_shards: bool,
    /// Depth of each shard's job queue.
    pub job_queue_depth: usize,
    /// Busy-poll this long before an idle shard parks (0 = park at once).
    pub spin_before_park_us: u64,
    /// io_uring buffer memory per shard.
    pub io_memory: Bytes,
    /// Worker threads of the tokio runtime that runs the actors and HTTP.
    pub actor_threads: usize,
    /// At shutdown, how long in-flight requests get to finish.
    pub drain_timeout_ms: u64,
    /// Every HTTP listener of the process (admin, engine, proxies, the
    /// serving front): a request head, and the wait for the next one on a
    /// kept-alive connection, must arrive within this.
    pub http_header_timeout_ms: u64,
    /// A request body must arrive in full within this of its head (then
    /// 400 and the connection closes).
    pub http_body_timeout_ms: u64,
    /// Connections open at once on one HTTP listener; one more takes the
    /// place of the oldest idle connection.
    pub http_max_connections: usize,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        Self {
            shards: 0,
            pin_shards: true,
            job_queue_depth: 1024,
            spin_before_park_us: 0,
            io_memory: Bytes::kib(2560),
            actor_threads: 2,
            drain_timeout_ms: 5000,
            http_header_timeout_ms: kvpool_runtime::http_limits::HEADER_READ_TIMEOUT.as_millis()
                as u64,
            http_body_timeout_ms: kvpool_runtime::http_limits::BODY_READ_TIMEOUT.as_millis() as u64,
            http_max_connections: kvpool_runtime::http_limits::MAX_CONNECTIONS,
        }
    }
}

impl RuntimeConfig {
    pub fn shard_pool(&self) -> ShardPoolConfig {
        ShardPoolConfig {
            shards: self.shards,
            job_queue_depth: self.job_queue_depth,
            pin: self.pin_shards,
            spin_before_park: Duration::from_micros(self.spin_before_park_us),
            io_memory_bytes: self.io_memory.get() as usize,
            name: "kvpool-shard".into(),
            drain_timeout: Duration::from_millis(self.drain_timeout_ms),
        }
    }

    /// The limits of each HTTP listener.
    pub fn http_limits(&self) -> kvpool_runtime::http_limits::HttpLimits {
        kvpool_runtime::http_limits::HttpLimits {
            header_read_timeout: Duration::from_millis(self.http_header_timeout_ms),
            body_read_timeout: Duration::from_millis(self.http_body_timeout_ms),
            max_connections: self.http_max_connections,
        }
    }
}

/// `[master]`: the metadata service.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct MasterConfig {
    /// Base RPC address; shard i listens on port + i.
    pub listen: String,
    /// HTTP address for /healthz, /metrics and the admin API.
    pub http: String,
    /// Master shards: the first this many of the process's shards hold the
    /// keys; 0 = automatic: 4, or the process's shards when fewer. At most
    /// `[runtime] shards`.
    pub shards: usize,
    /// Largest control frame accepted.
    pub max_frame_bytes: Bytes,
    /// Open RPC connections per shard; more are refused.
    pub max_connections: usize,
    /// Depth of each shard's inbox (requests forwarded from other shards).
    pub inbox_depth: usize,
    /// Close an RPC connection idle this long.
    pub idle_timeout_ms: u64,
    /// Deadline of one frame's read or write once it has started.
    pub io_timeout_ms: u64,
    /// A new connection must send a whole frame (and, with a cluster
    /// secret, authenticate) within this long, or it is closed.
    pub first_frame_timeout_ms: u64,
    /// Memory for control frames being read, over all connections.
    pub max_frame_memory: Bytes,
    /// Longest key.
    pub max_key_bytes: usize,
    /// Largest value.
    pub max_value_bytes: Bytes,
    /// Most objects in the pool.
    pub max_keys: u64,
    /// Most keys in one batch call.
    pub max_batch: usize,
    /// Read lease granted by GetReplicaList.
    pub lease_ttl_ms: u64,
    /// A put still Processing after this long is discarded.
    pub put_timeout_ms: u64,
    /// Space of a discarded (stale or revoked-for-liveness) put is reused only
    /// after this grace, so a late writer cannot overwrite a new object.
    pub stale_put_grace_ms: u64,
    /// A client or storage node silent this long is dead: its segments are
    /// unmounted and its Processing puts revoked.
    pub client_ttl_ms: u64,
    /// Evict when a segment range's use passes this fraction.
    pub high_watermark: f64,
    /// Fraction of a segment range's bytes one eviction frees.
    pub eviction_ratio: f64,
    /// Replica placement: "random", "free_ratio_first" or "local_first".
    pub placement: Placement,
    /// Housekeeping period of each shard (stale puts, expired leases,
    /// liveness).
    pub tick_ms: u64,
    /// Reads of an object held only on NVMe after which it is copied back
    /// to DRAM (0: never).
    pub promote_after_reads: u16,
    /// Hot-object replication: the most DRAM replicas (on distinct nodes)
    /// an object read often gets; 0 or 1: none beyond what its put asked.
    pub hot_replicas: u16,
    /// An object read this many times within one `hot_window_ms` is hot.
    pub hot_reads: u16,
    /// The window reads are counted in, in ms.
    pub hot_window_ms: u64,
    /// At most this fraction of each shard's DRAM holds extra replicas.
    pub hot_budget: f64,
    /// HA on etcd: `etcd://host:port[,host:port...][/name]`. Masters given
    /// the same URL elect one leader under an etcd lease; the others stand
    /// by. "" = a single master, no election (`--ha` sets it).
    pub ha: String,
    /// The leader's etcd lease, in seconds: a leader that cannot renew it
    /// this long is replaced (etcd may raise it to its minimum, ~2 s).
    pub ha_lease_ttl_s: u64,
    /// The leader stops answering this long before its lease could run
    /// out, measured from the last renewal it sent (fencing margin: covers
    /// clock-rate drift between this host and etcd, and scheduling).
    pub ha_fence_margin_ms: u64,
    /// HA: how long a leader's reply waits for a following standby to
    /// confirm the reply's state-log records; a standby that has not by
    /// then is dropped from the set the replies wait for (it starts again
    /// from a snapshot). Below `io_timeout_ms` (checked with `ha` set; a
    /// master given `--ha` later waits at most half of `io_timeout_ms`).
    pub ha_sync_timeout_ms: u64,
    /// Directory of the master's log and snapshots ("" = none: a restarted
    /// master forgets every object, and only NVMe objects come back, from
    /// their nodes' reports).
    pub state_dir: String,
    /// How the log reaches the disk before replies go out: "none" (write
    /// only: survives a killed master, not a crashed machine) or "always"
    /// (fdatasync each commit).
    pub state_sync: StateSync,
}

/// How the master's log reaches the disk (`[master] state_sync`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StateSync {
    /// write(2) to the page cache before replying.
    None,
    /// write(2), then fdatasync(2), before replying.
    Always,
}

/// How the master chooses segments for a put's replicas.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Placement {
    /// Uniformly among segments with room.
    Random,
    /// Segments with the largest free fraction first.
    FreeRatioFirst,
    /// Segments on the writer's host first, then by free fraction.
    LocalFirst,
}

impl Default for MasterConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:7070".into(),
            http: "127.0.0.1:9070".into(),
            shards: 0,
            max_frame_bytes: Bytes::mib(4),
            max_connections: 4096,
            inbox_depth: 4096,
            idle_timeout_ms: 600_000,
            io_timeout_ms: 10_000,
            first_frame_timeout_ms: 5_000,
            max_frame_memory: Bytes::mib(256),
            max_key_bytes: MAX_KEY_BYTES,
            max_value_bytes: Bytes::gib(1),
            max_keys: 100_000_000,
            max_batch: 4096,
            lease_ttl_ms: 10_000,
            put_timeout_ms: 30_000,
            stale_put_grace_ms: 10_000,
            client_ttl_ms: 10_000,
            high_watermark: 0.90,
            eviction_ratio: 0.05,
            placement: Placement::LocalFirst,
            tick_ms: 100,
            promote_after_reads: 2,
            hot_replicas: 0,
            hot_reads: 16,
            hot_window_ms: 1000,
            hot_budget: 0.1,
            ha: String::new(),
            ha_lease_ttl_s: 3,
            ha_fence_margin_ms: 500,
            ha_sync_timeout_ms: 1000,
            state_dir: String::new(),
            state_sync: StateSync::None,
        }
    }
}

/// `[storage]`: a storage node.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct StorageConfig {
    /// Base data-plane address; shard i listens on port + i.
    pub listen: String,
    /// HTTP address for /healthz and /metrics.
    pub http: String,
    /// The master's RPC address (`host:port`), or `etcd://host:port[,...]` to
    /// follow the leader of masters on etcd (HA).
    pub master: String,
    /// DRAM this node gives to the pool.
    pub segment_size: Bytes,
    /// Commit every page of the segment at start instead of at first write.
    pub prefault: bool,
    /// Host clients should connect to ("" = the listen host, or this
    /// machine's hostname when listening on 0.0.0.0).
    pub advertise_host: String,
    /// Names this machine for same-host transfers and placement ("" = hostname).
    pub host_id: String,
    /// Liveness ping to the master.
    pub ping_interval_ms: u64,
    /// Open data connections per shard; more are refused.
    pub max_connections: usize,
    /// Close a data connection idle this long.
    pub idle_timeout_ms: u64,
    /// Deadline of one request's frame, payload and answer once started.
    pub io_timeout_ms: u64,
    /// A new connection must send a whole frame within this long.
    pub first_frame_timeout_ms: u64,
    /// Memory for control frames being read, over all connections.
    pub max_frame_memory: Bytes,
    /// Largest control frame accepted.
    pub max_frame_bytes: Bytes,
    /// Hand the segment to same-host clients (memfd over a unix socket).
    pub shm: bool,
    /// `[storage.nvme]`: the NVMe tier under the DRAM segment.
    pub nvme: NvmeTierConfig,
    /// `[storage.rdma]`: serving the segment over RDMA.
    pub rdma: RdmaSettings,
}

/// Whether a role uses RDMA.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RdmaMode {
    /// Use RDMA when this build has it and a device opens; otherwise say why
    /// (one log line) and use TCP.
    Auto,
    /// Never use RDMA.
    Off,
    /// RDMA or refuse to start.
    Required,
}

/// `[storage.rdma]` / `[client.rdma]`: the RDMA transport (cargo feature
/// `rdma`). Device settings follow `kvpool_transport::nic::RdmaConfig`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RdmaSettings {
    /// auto | off | required. A client's `transport = "rdma"` means required.
    pub enabled: RdmaMode,
    /// Devices by name (`mlx5_0`); empty: every device with an active port.
    pub devices: Vec<String>,
    /// Port number on every device (from 1).
    pub port: u8,
    /// Source GID index; -1: the first RoCE v2 IPv4-mapped GID (RoCE), 0 (IB).
    pub gid_index: i32,
    /// Queue pairs per connection to a segment.
    pub lanes: usize,
    /// Bytes per work request.
    pub slice_bytes: Bytes,
    /// Work requests in flight per queue pair.
    pub max_outstanding_per_lane: u32,
    /// Transfers one connection tracks at once; more wait.
    pub max_requests_per_connection: usize,
}

impl RdmaSettings {
    /// Checks the values; the message names the key under `prefix`.
    pub fn validate(&self, prefix: &str) -> Result<(), String> {
        if self.port == 0 {
            return Err(format!("key `{prefix}.port`: verbs ports count from 1"));
        }
        if !(-1..=255).contains(&self.gid_index) {
            return Err(format!(
                "key `{prefix}.gid_index`: {} is not in -1..=255",
                self.gid_index
            ));
        }
        if !(1..=16).contains(&self.lanes) {
            return Err(format!(
                "key `{prefix}.lanes`: {} is not in 1..=16",
                self.lanes
            ));
        }
        let s = self.slice_bytes.get();
        if s == 0 || s > 1 << 30 {
            return Err(format!(
                "key `{prefix}.slice_bytes`: {s} is not in 1..=1 GiB"
            ));
        }
        if !(1..=4096).contains(&self.max_outstanding_per_lane) {
            return Err(format!(
                "key `{prefix}.max_outstanding_per_lane`: {} is not in 1..=4096",
                self.max_outstanding_per_lane
            ));
        }
        if !(1..=65536).contains(&self.max_requests_per_connection) {
            return Err(format!(
                "key `{prefix}.max_requests_per_connection`: {} is not in 1..=65536",
                self.max_requests_per_connection
            ));
        }
        Ok(())
    }
}

impl Default for RdmaSettings {
    fn default() -> Self {
        Self {
            enabled: RdmaMode::Auto,
            devices: Vec::new(),
            port: 1,
            gid_index: -1,
            lanes: 2,
            slice_bytes: Bytes::kib(64),
            max_outstanding_per_lane: 32,
            max_requests_per_connection: 256,
        }
    }
}

/// What happens to objects on the NVMe tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OffloadPolicy {
    /// An object evicted from DRAM moves to NVMe instead of being dropped.
    OnEvict,
    /// Every object is copied to NVMe at PutEnd (and evicted DRAM copies go).
    WriteThrough,
}

/// Which objects the NVMe tier evicts first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum NvmeEvictionPolicy {
    Fifo,
    Lru,
}

/// `[storage.nvme]`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct NvmeTierConfig {
    /// A file or block device; "" = no NVMe tier.
    pub path: String,
    /// Bytes of it the tier uses.
    pub capacity: Bytes,
    pub policy: OffloadPolicy,
    pub eviction: NvmeEvictionPolicy,
    /// Evict past this fraction of the tier's data space...
    pub high_watermark: f64,
    /// ...down to this one.
    pub low_watermark: f64,
    /// Expected mean object size: sizes the on-device index.
    pub avg_object_bytes: Bytes,
    /// fdatasync every object and index write (off: a power loss may lose
    /// the newest objects; a process crash still loses nothing).
    pub sync_writes: bool,
    /// How often the node asks the master for work (demotions, promotions).
    pub task_poll_ms: u64,
}

impl Default for NvmeTierConfig {
    fn default() -> Self {
        Self {
            path: String::new(),
            capacity: Bytes::gib(16),
            policy: OffloadPolicy::OnEvict,
            eviction: NvmeEvictionPolicy::Fifo,
            high_watermark: 0.95,
            low_watermark: 0.85,
            avg_object_bytes: Bytes::kib(256),
            sync_writes: true,
            task_poll_ms: 100,
        }
    }
}

impl Default for StorageConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:7300".into(),
            http: "127.0.0.1:9300".into(),
            master: "127.0.0.1:7070".into(),
            segment_size: Bytes::gib(1),
            prefault: false,
            advertise_host: String::new(),
            host_id: String::new(),
            ping_interval_ms: 1000,
            max_connections: 4096,
            idle_timeout_ms: 600_000,
            io_timeout_ms: 10_000,
            first_frame_timeout_ms: 5_000,
            max_frame_memory: Bytes::mib(64),
            max_frame_bytes: Bytes::kib(64),
            shm: true,
            nvme: NvmeTierConfig::default(),
            rdma: RdmaSettings::default(),
        }
    }
}

/// `[client]`: the store client used by the CLI, storage nodes and embedders.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClientConfig {
    /// Deadline of one put, get, exists or remove, end to end.
    pub timeout_ms: u64,
    /// Deadline of establishing one connection.
    pub connect_timeout_ms: u64,
    /// Connections kept per master shard or storage shard.
    pub max_connections_per_endpoint: usize,
    /// Largest control frame accepted.
    pub max_frame_bytes: Bytes,
    /// Liveness ping to the master (0: none, for short-lived clients such as
    /// the CLI). A client that pinged and then falls silent for the master's
    /// `client_ttl_ms` has its unfinished puts revoked.
    pub ping_interval_ms: u64,
    /// Data transfers one batch call runs at once.
    pub batch_parallelism: usize,
    /// Data path: "auto" (shared memory for same-host replicas, RDMA when
    /// both sides have it, TCP otherwise), "tcp", "shm" or "rdma" (RDMA for
    /// every node that has it; no local device is a start-up error).
    pub transport: Transport,
    /// A TCP transfer larger than this is cut into slices.
    pub tcp_slice_bytes: Bytes,
    /// Slices of one transfer in flight at once, over distinct connections.
    pub lanes: usize,
    /// Which storage shard port a TCP transfer of a DRAM replica starts on:
    /// `true` = this client's own shard of every node (picked at random when
    /// the client starts; any shard serves any offset), so one client keeps
    /// one core of a node busy instead of waking a different one per key;
    /// `false` = the shard whose slice holds the offset.
    pub shard_affinity: bool,
    /// Slices in flight over the whole client; more wait.
    pub max_in_flight: usize,
    /// Compute a checksum of every value put and check it on every get
    /// (a mismatch is `Corrupt` and the next replica is tried). Off only
    /// for those who trust their memory, NICs and disks.
    pub checksums: bool,
    /// When this process fills its page tables for a same-host segment it
    /// maps (shared memory): "on_use" fills each 2 MiB chunk the first time
    /// a copy touches it; "at_map" also fills the whole segment in the
    /// background as soon as it is mapped, so a long-lived client (an
    /// inference worker) stops paying the first-touch cost early. The price
    /// of "at_map": page tables for the whole segment in this process (8
    /// bytes per 4 KiB page: 4 MiB per 2 GiB), about a microsecond of one
    /// core per page once (one core per mapped segment), the whole segment
    /// counted in this process's RSS at once (the OOM killer sees it); on a
    /// node that does not prefault, the segment's memory is committed by
    /// this process and charged to its memory cgroup.
    pub shm_populate: ShmPopulate,
    /// Where recently read objects lie, kept while this client's read lease
    /// on them lasts, so a repeated get goes straight to the storage node
    /// (one round trip instead of two). Entries at most (0: off).
    pub location_cache_entries: usize,
    /// `[client.rdma]`: the client's RDMA devices.
    pub rdma: RdmaSettings,
    /// The cluster secret; not a key of `[client]`: a process takes it from
    /// `[security] secret` or `KVPOOL_SECRET`, an embedder sets it here.
    #[serde(skip)]
    pub secret: Secret,
}

/// A secret string whose `Debug` does not show it.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(s: impl Into<String>) -> Self {
        Self(s.into())
    }

    pub fn expose(&self) -> &str {
        &self.0
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_empty() { "\"\"" } else { "<set>" })
    }
}

/// When a client fills its page tables for a mapped segment
/// (`client.shm_populate`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ShmPopulate {
    OnUse,
    AtMap,
}

/// The client's data path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Transport {
    Auto,
    Tcp,
    Shm,
    Rdma,
}

impl Default for ClientConfig {
    fn default() -> Self {
        Self {
            timeout_ms: 10_000,
            connect_timeout_ms: 2_000,
            max_connections_per_endpoint: 16,
            max_frame_bytes: Bytes::mib(64),
            ping_interval_ms: 1000,
            batch_parallelism: 16,
            transport: Transport::Auto,
            tcp_slice_bytes: Bytes::mib(2),
            lanes: 4,
            shard_affinity: true,
            max_in_flight: 64,
            checksums: true,
            shm_populate: ShmPopulate::OnUse,
            location_cache_entries: 65_536,
            rdma: RdmaSettings::default(),
            secret: Secret::default(),
        }
    }
}

/// `[resp]`: the Redis protocol (RESP2) front: a listener on processes that
/// have a pool client (roles all and storage, with `listen` set) and the
/// whole of role gateway. Checked by [`RespConfig::validate`].
#[derive(Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RespConfig {
    /// Listen address (`--resp`); "" = no RESP listener (role gateway then
    /// listens on 127.0.0.1:6379).
    pub listen: String,
    /// The master's RPC address, for role gateway (`--master` overrides it;
    /// roles all and storage use their own master).
    pub master: String,
    /// HTTP address (`/healthz`, `/metrics`) of role gateway (`--http`).
    pub http: String,
    /// The password of `AUTH`; "" = none, and then `listen` must be a
    /// loopback address unless `protected_mode = false`.
    pub requirepass: String,
    /// Without a password, refuse to listen beyond loopback.
    pub protected_mode: bool,
    /// Threads serving RESP connections, each with its own pool client;
    /// 0 = one per shard of the process.
    pub threads: usize,
    /// Pin thread i to the core of shard i.
    pub pin_threads: bool,
    /// Open connections at most. A new one past it takes the place of the
    /// oldest connection that has not run a command yet (which is closed);
    /// with none such it gets `-ERR max number of clients reached` and is
    /// closed.
    pub max_clients: usize,
    /// Connections from one peer address that have not run a command yet
    /// (authenticated, where `requirepass` is set) at most; one more is
    /// refused. 0 = no limit.
    pub max_pending_per_peer: usize,
    /// Close a connection that sends nothing for this long (0 = never).
    pub idle_timeout_ms: u64,
    /// Once a command's first byte has arrived, the whole command must
    /// arrive within this long; a reply must be taken by the client within
    /// it too. Otherwise the connection is closed. Also the idle limit of a
    /// connection that has not run a command yet (authenticated, where
    /// `requirepass` is set).
    pub io_timeout_ms: u64,
    /// Largest bulk string (a key or a value); a longer one is refused from
    /// its length line, before its bytes are read, and the connection closed.
    pub proto_max_bulk_len: Bytes,
    /// A connection's read buffer (one command in full, or pipelined ones)
    /// at most.
    pub max_query_buffer: Bytes,
    /// Read buffers and values in flight over all connections at most; a
    /// connection that finds it spent gets an error and is closed.
    pub max_buffer_memory: Bytes,
    /// Commands executed from one connection before its replies are sent.
    pub max_pipeline: usize,
    /// Keys in one batch call to the pool (pipelined GETs, MGET, MSET,
    /// EXISTS, DEL); more are split.
    pub batch_keys: usize,
    /// Views of recently read values kept while their read lease lasts, so
    /// a repeated GET skips the master (0: every GET asks it). This front's
    /// own writes are seen at once; another process's replace or removal
    /// may be missed until the lease ends.
    pub view_cache_entries: usize,
    /// Lists, sets, hashes and sorted sets live in the front's memory (the
    /// pool stores immutable blobs), shared by its RESP threads: their
    /// bytes at most. A write past it gets Redis's `OOM` error.
    pub max_collection_memory: Bytes,
}

impl std::fmt::Debug for RespConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RespConfig")
            .field("listen", &self.listen)
            .field("master", &self.master)
            .field("http", &self.http)
            .field(
                "requirepass",
                &if self.requirepass.is_empty() {
                    ""
                } else {
                    "<set>"
                },
            )
            .field("protected_mode", &self.protected_mode)
            .field("threads", &self.threads)
            .field("max_clients", &self.max_clients)
            .field("idle_timeout_ms", &self.idle_timeout_ms)
            .field("io_timeout_ms", &self.io_timeout_ms)
            .field("proto_max_bulk_len", &self.proto_max_bulk_len)
            .field("max_query_buffer", &self.max_query_buffer)
            .field("max_buffer_memory", &self.max_buffer_memory)
            .field("max_pipeline", &self.max_pipeline)
            .field("batch_keys", &self.batch_keys)
            .field("view_cache_entries", &self.view_cache_entries)
            .field("max_collection_memory", &self.max_collection_memory)
            .finish()
    }
}

/// Where role gateway listens when neither `--resp` nor `[resp] listen`
/// says.
pub const RESP_GATEWAY_DEFAULT_LISTEN: &str = "127.0.0.1:6379";

impl Default for RespConfig {
    fn default() -> Self {
        Self {
            listen: String::new(),
            master: "127.0.0.1:7070".into(),
            http: "127.0.0.1:9400".into(),
            requirepass: String::new(),
            protected_mode: true,
            threads: 0,
            pin_threads: true,
            max_clients: 10_000,
            max_pending_per_peer: 256,
            idle_timeout_ms: 600_000,
            io_timeout_ms: 60_000,
            proto_max_bulk_len: Bytes::mib(512),
            max_query_buffer: Bytes::gib(1),
            max_buffer_memory: Bytes::gib(2),
            max_pipeline: 1024,
            batch_keys: 256,
            view_cache_entries: 65_536,
            max_collection_memory: Bytes::mib(64),
        }
    }
}

impl RespConfig {
    /// Checks values that parse but make no sense; the message names the key.
    pub fn validate(&self) -> Result<(), String> {
        for (k, v) in [
            ("resp.max_clients", self.max_clients as u64),
            ("resp.io_timeout_ms", self.io_timeout_ms),
            ("resp.proto_max_bulk_len", self.proto_max_bulk_len.get()),
            ("resp.max_pipeline", self.max_pipeline as u64),
            ("resp.batch_keys", self.batch_keys as u64),
        ] {
            if v == 0 {
                return Err(format!("key `{k}`: must be greater than 0"));
            }
        }
        if self.batch_keys > 4096 {
            return Err("key `resp.batch_keys`: at most 4096 (the master's max_batch)".into());
        }
        // One command holding the largest bulk string, with room for its
        // header and a pipelined neighbour.
        let one = self.proto_max_bulk_len.get() + 64 * 1024;
        if self.max_query_buffer.get() < one {
            return Err(format!(
                "key `resp.max_query_buffer`: {} cannot hold one bulk string of \
                 resp.proto_max_bulk_len ({}) and its header (64 KiB)",
                self.max_query_buffer, self.proto_max_bulk_len
            ));
        }
        if self.max_buffer_memory.get() < one {
            return Err(format!(
                "key `resp.max_buffer_memory`: {} cannot hold one bulk string of \
                 resp.proto_max_bulk_len ({}) and its header (64 KiB)",
                self.max_buffer_memory, self.proto_max_bulk_len
            ));
        }
        if self.requirepass.len() > 512 {
            return Err("key `resp.requirepass`: at most 512 bytes".into());
        }
        if self.requirepass.bytes().any(|b| b.is_ascii_control()) {
            return Err("key `resp.requirepass`: no control characters".into());
        }
        Ok(())
    }

    /// The address to listen on for `role_is_gateway` (`None`: no listener).
    pub fn listen_addr(&self, role_is_gateway: bool) -> Option<String> {
        match (self.listen.is_empty(), role_is_gateway) {
            (false, _) => Some(self.listen.clone()),
            (true, true) => Some(RESP_GATEWAY_DEFAULT_LISTEN.into()),
            (true, false) => None,
        }
    }

    /// Refuses a front without a password in a cluster with a secret
    /// (`cluster_secret`): every other port of such a cluster proves its
    /// peers hold the secret, and a front open to anyone would read, write
    /// and FLUSHALL its pool for them (issue 29), on loopback too. Without a
    /// secret, refuses an unprotected listener beyond loopback.
    pub fn check_exposure(&self, listen: &str, cluster_secret: bool) -> Result<(), String> {
        if cluster_secret && self.requirepass.is_empty() {
            return Err(format!(
                "key `resp.requirepass`: the cluster has a secret ([security] secret or \
                 KVPOOL_SECRET), and the RESP front on {listen} has no password: anyone who \
                 reaches it could read, write and FLUSHALL the pool. Set resp.requirepass \
                 (clients then AUTH with it)"
            ));
        }
        if self.requirepass.is_empty() && self.protected_mode && !is_loopback(listen) {
            return Err(format!(
                "key `resp.listen`: {listen} is beyond loopback and `resp.requirepass` is \
                 empty: set a password, listen on 127.0.0.1, or set `resp.protected_mode = \
                 false` to serve anyone who reaches the port"
            ));
        }
        Ok(())
    }
}

/// `[security]`: who may do what.
#[derive(Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct SecurityConfig {
    /// The cluster secret (at least 16 bytes); "" = an open cluster, for
    /// loopback. `KVPOOL_SECRET` overrides it.
    pub secret: String,
    /// How long after its expiry a storage node still accepts a grant: the
    /// master's clock may be this far ahead of the node's.
    pub clock_skew_ms: u64,
}

impl std::fmt::Debug for SecurityConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SecurityConfig")
            .field("secret", &if self.secret.is_empty() { "" } else { "<set>" })
            .field("clock_skew_ms", &self.clock_skew_ms)
            .finish()
    }
}

impl Default for SecurityConfig {
    fn default() -> Self {
        Self {
            secret: String::new(),
            clock_skew_ms: 5_000,
        }
    }
}

impl SecurityConfig {
    /// The keyed secret, or `None` for an open cluster; a secret that is too
    /// short is an error naming the key.
    pub fn key(&self) -> Result<Option<ClusterKey>, String> {
        if self.secret.is_empty() {
            return Ok(None);
        }
        ClusterKey::new(self.secret.as_bytes())
            .map(Some)
            .map_err(|e| format!("key `security.secret` (or {SECRET_ENV}): {e}"))
    }
}

/// Whether `addr` (`host:port`) is a loopback address.
pub fn is_loopback(addr: &str) -> bool {
    use std::net::ToSocketAddrs;
    let host = addr.rsplit_once(':').map(|(h, _)| h).unwrap_or(addr);
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host == "localhost" {
        return true;
    }
    match host.parse::<std::net::IpAddr>() {
        Ok(ip) => ip.is_loopback(),
        Err(_) => addr
            .to_socket_addrs()
            .map(|mut a| a.all(|s| s.ip().is_loopback()))
            .unwrap_or(false),
    }
}

#[cfg(test)]
mod tests;

/// `[engine]`: the inference engine role (`kvpool run --role engine`). Its
/// pool client uses `[client]` and `--master`. Checked by
/// [`EngineConfig::validate`] when the engine starts.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct EngineConfig {
    /// Tokens per KV chunk (one pool object per full chunk). Every engine and
    /// the conductor sharing a pool must use the same value.
    pub chunk_tokens: usize,
    /// Sequences decoding at once (one batched decode step covers them all).
    pub max_num_seqs: usize,
    /// Requests admitted but not yet running; more are refused with 503.
    pub max_waiting: usize,
    /// Longest prompt + generation in tokens (0: the model's
    /// max_position_embeddings).
    pub max_model_len: usize,
    /// Look a prompt's leading chunks up in the pool and load them.
    pub load_from_pool: bool,
    /// Store the prompt's new full chunks in the pool after prefill.
    pub store_to_pool: bool,
    /// Store jobs queued for the pool; a full queue drops the job (counted).
    pub store_queue_depth: usize,
    /// Pool objects per KV chunk: the chunk's layers split into this many
    /// groups (1 = one object per chunk). Part of each key: every engine
    /// sharing a pool's chunks must use the same value.
    pub kv_layer_groups: usize,
    /// Layer-wise streaming: store each group of a chunk's layers as soon as
    /// the chunk's piece has computed it, and start a prompt's prefill while
    /// its loaded prefix still arrives, group by group.
    pub kv_stream: bool,
    /// Deadline of one request, end to end.
    pub request_timeout_ms: u64,
    /// Largest HTTP request body.
    pub max_body_bytes: Bytes,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            chunk_tokens: 256,
            max_num_seqs: 16,
            max_waiting: 64,
            max_model_len: 0,
            load_from_pool: true,
            store_to_pool: true,
            store_queue_depth: 64,
            kv_layer_groups: 1,
            kv_stream: false,
            request_timeout_ms: 600_000,
            max_body_bytes: Bytes::mib(16),
        }
    }
}

impl EngineConfig {
    /// Checks values that parse but make no sense; the message names the key.
    pub fn validate(&self) -> Result<(), String> {
        for (k, v) in [
            ("engine.chunk_tokens", self.chunk_tokens as u64),
            ("engine.max_num_seqs", self.max_num_seqs as u64),
            ("engine.max_waiting", self.max_waiting as u64),
            ("engine.store_queue_depth", self.store_queue_depth as u64),
            ("engine.kv_layer_groups", self.kv_layer_groups as u64),
            ("engine.request_timeout_ms", self.request_timeout_ms),
            ("engine.max_body_bytes", self.max_body_bytes.get()),
        ] {
            if v == 0 {
                return Err(format!("key `{k}`: must be greater than 0"));
            }
        }
        if self.chunk_tokens > 65_536 {
            return Err("key `engine.chunk_tokens`: at most 65536".into());
        }
        if self.kv_layer_groups > 1024 {
            return Err("key `engine.kv_layer_groups`: at most 1024".into());
        }
        if self.max_num_seqs > 1024 {
            return Err("key `engine.max_num_seqs`: at most 1024".into());
        }
        Ok(())
    }
}

/// Why a role could not start or run.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("config: {0}")]
    Config(String),
    #[error("{0}")]
    Start(String),
    #[error(transparent)]
    Runtime(#[from] kvpool_runtime::RuntimeError),
    #[error(transparent)]
    Kv(#[from] kvpool_wire::KvError),
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
}

/// `[serving]`: the serving path: the conductor's OpenAI-compatible front
/// (`--role conductor`), the prefill and decode proxies (`--role
/// prefill-proxy`, `--role decode-proxy`), and what role `all` starts of it.
/// Addresses are `HOST:PORT` (plain HTTP). Checked by
/// [`ServingConfig::validate`] with the rest of the file.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServingConfig {
    /// Role all: also run the serving path (a conductor, one prefill and one
    /// decode engine of `model`, a proxy in front of each).
    pub enabled: bool,
    /// Role all: the model of its two engines (`builtin:tiny`,
    /// `builtin:small` or a model folder).
    pub model: String,
    /// The serving front's API key ("" = open): its `/v1` routes then need
    /// `Authorization: Bearer <key>` (OpenAI clients' `api_key`); `/health`,
    /// `/healthz` and `/metrics` stay open. `KVPOOL_API_KEY` or `--api-key`
    /// override it.
    pub api_key: String,
    pub conductor: ConductorConfig,
    pub prefill_proxy: ProxyConfig,
    pub decode_proxy: ProxyConfig,
}

impl Default for ServingConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            model: "builtin:tiny".into(),
            api_key: String::new(),
            conductor: ConductorConfig::default(),
            prefill_proxy: ProxyConfig {
                listen: "127.0.0.1:8200".into(),
                engine: "127.0.0.1:8100".into(),
                ..ProxyConfig::default()
            },
            decode_proxy: ProxyConfig {
                listen: "127.0.0.1:8201".into(),
                engine: "127.0.0.1:8101".into(),
                ..ProxyConfig::default()
            },
        }
    }
}

/// `[serving.conductor]`: the front and the live scheduler.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ConductorConfig {
    /// The OpenAI-compatible front (HTTP), also /healthz and /metrics.
    pub listen: String,
    /// The pool's master, asked which chunks of a prompt it holds ("": no
    /// pool lookups; the conductor then knows only where it sent prompts).
    pub pool: String,
    /// Prefill proxies, in instance order.
    pub prefill: Vec<String>,
    /// Decode proxies, in instance order.
    pub decode: Vec<String>,
    /// Scheduling policy: random, round_robin, least_loaded, cache_local,
    /// cache_global, early_reject or predictive_reject.
    pub policy: String,
    /// Cluster cost model file (see configs/cluster-model*.toml); "" = the
    /// built-in model. Its block_tokens is set to `engine.chunk_tokens`.
    pub cost_model: String,
    /// Time-to-first-token objective, ms.
    pub ttft_slo_ms: f64,
    /// Time-between-tokens objective (per-request average), ms.
    pub tbt_slo_ms: f64,
    /// Seed of the random policy.
    pub seed: u64,
    /// How often each proxy's load report is fetched.
    pub load_poll_ms: u64,
    /// Deadline of one request, end to end.
    pub request_timeout_ms: u64,
    /// A decode stream silent this long after its first token counts as
    /// failed (and is continued elsewhere); a streaming client that takes
    /// nothing this long is dropped.
    pub stall_timeout_ms: u64,
    /// Requests in flight at once; more get 503 with Retry-After.
    pub max_in_flight: usize,
    /// Times one request may move to another engine after one failed.
    pub max_failovers: u32,
    /// Retry-After (seconds) on a 503.
    pub retry_after_s: u64,
    /// Largest request body.
    pub max_body_bytes: Bytes,
    /// Write every scheduling decision and the view it was made on to this
    /// file (JSON lines, `kvpool sim replay --log`); "" = none.
    pub decision_log: String,
}

impl Default for ConductorConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:8080".into(),
            pool: "127.0.0.1:7070".into(),
            prefill: vec!["127.0.0.1:8200".into()],
            decode: vec!["127.0.0.1:8201".into()],
            policy: "predictive_reject".into(),
            cost_model: String::new(),
            ttft_slo_ms: 30_000.0,
            tbt_slo_ms: 100.0,
            seed: 0,
            load_poll_ms: 100,
            request_timeout_ms: 600_000,
            stall_timeout_ms: 30_000,
            max_in_flight: 256,
            max_failovers: 2,
            retry_after_s: 1,
            max_body_bytes: Bytes::mib(16),
            decision_log: String::new(),
        }
    }
}

/// `[serving.prefill_proxy]`, `[serving.decode_proxy]`: a proxy in front of
/// one engine.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ProxyConfig {
    /// The proxy's HTTP address (the conductor's side).
    pub listen: String,
    /// The engine it fronts: anything speaking vLLM's OpenAI API with
    /// kv_transfer_params (ours, or vLLM with a KV connector).
    pub engine: String,
    /// How often the engine's health and model are probed.
    pub probe_interval_ms: u64,
    /// Probes that fail in a row before the engine counts as down (a
    /// refused connection counts at once).
    pub probe_failures: u32,
    /// Deadline of connecting to the engine.
    pub connect_timeout_ms: u64,
    /// Deadline of one request through the proxy, end to end.
    pub request_timeout_ms: u64,
    /// Requests in flight to the engine at once; more get 503.
    pub max_in_flight: usize,
    /// Messages waiting in the proxy actor's mailbox; more are refused.
    pub mailbox_bound: usize,
    /// Largest request body.
    pub max_body_bytes: Bytes,
}

impl Default for ProxyConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:8200".into(),
            engine: "127.0.0.1:8100".into(),
            probe_interval_ms: 500,
            probe_failures: 2,
            connect_timeout_ms: 2_000,
            request_timeout_ms: 600_000,
            max_in_flight: 256,
            mailbox_bound: 1024,
            max_body_bytes: Bytes::mib(16),
        }
    }
}

impl ServingConfig {
    /// Checks values that parse but make no sense; the message names the key.
    pub fn validate(&self) -> Result<(), String> {
        let c = &self.conductor;
        for (k, v) in [
            ("serving.conductor.load_poll_ms", c.load_poll_ms),
            ("serving.conductor.request_timeout_ms", c.request_timeout_ms),
            ("serving.conductor.stall_timeout_ms", c.stall_timeout_ms),
            ("serving.conductor.max_in_flight", c.max_in_flight as u64),
            ("serving.conductor.max_body_bytes", c.max_body_bytes.get()),
        ] {
            if v == 0 {
                return Err(format!("key `{k}`: must be greater than 0"));
            }
        }
        for (k, v) in [
            ("serving.conductor.ttft_slo_ms", c.ttft_slo_ms),
            ("serving.conductor.tbt_slo_ms", c.tbt_slo_ms),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(format!("key `{k}`: must be a finite number > 0, got {v}"));
            }
        }
        if c.retry_after_s > 3600 {
            return Err("key `serving.conductor.retry_after_s`: at most 3600".into());
        }
        for (name, p) in [
            ("serving.prefill_proxy", &self.prefill_proxy),
            ("serving.decode_proxy", &self.decode_proxy),
        ] {
            for (k, v) in [
                ("probe_interval_ms", p.probe_interval_ms),
                ("probe_failures", u64::from(p.probe_failures)),
                ("connect_timeout_ms", p.connect_timeout_ms),
                ("request_timeout_ms", p.request_timeout_ms),
                ("max_in_flight", p.max_in_flight as u64),
                ("mailbox_bound", p.mailbox_bound as u64),
                ("max_body_bytes", p.max_body_bytes.get()),
            ] {
                if v == 0 {
                    return Err(format!("key `{name}.{k}`: must be greater than 0"));
                }
            }
        }
        Ok(())
    }
}
