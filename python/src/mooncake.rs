//! The native half of `kvpool.mooncake`: Mooncake's `MooncakeDistributedStore`
//! methods with their names, signatures and return conventions (`setup`'s
//! argument forms are parsed in Python, `kvpool/mooncake.py`), and
//! `ReplicateConfig`, `BufferHandle`, `SoftPinAction`, `ObjectDataType`.
//!
//! Conventions (Mooncake's): every call returns; errors are negative ints
//! (kvpool's codes through [`codes::TABLE`]), never exceptions, but for
//! arguments of the wrong type (TypeError). A call before `setup` returns
//! -600 (`b""`, `None` or lists of those where the result is data). Puts are
//! write-once: a put of a stored key returns 0 and keeps the old bytes.
//! Raw-pointer calls (`put_from`, `get_into`, the batch and multi-buffer
//! forms) accept only memory inside a range given to `register_buffer`.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use kvpool_client::Client;
use kvpool_config::Transport;
use kvpool_wire::proto::PutOptions;
use kvpool_wire::{ErrorCode, KvError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyByteArray, PyBytes, PyTuple, PyType};

use crate::client::{key_of, keys_of};
use crate::codes::{mooncake_code, INTERNAL_ERROR, INVALID_PARAMS, OK};
use crate::cuda::StagingPool;
use crate::memory::{self, PyMem, Registry};
use crate::node::EmbeddedNode;
use crate::{config, runtime, staged};

mod writes;

mod options;
use options::*;
pub use options::{ObjectDataType, ReplicateConfig, SoftPinAction};

/// Keys per master request: batches are cut into pieces of this many (the
/// master refuses more than `master.max_batch`, 4096 by default).
const MAX_BATCH: usize = 1024;

/// Values `get_into_ranges` reads at once: each is held whole (its checksum
/// checked) until its fragments are copied, so this bounds its memory.
const RANGES_BATCH: usize = 16;
/// Soft pin of `with_soft_pin` without a TTL (Mooncake's default pin TTL).
const DEFAULT_SOFT_PIN_TTL_MS: u64 = 30 * 60 * 1000;
/// `health_check`'s bound on asking the master.
const HEALTH_TIMEOUT: Duration = Duration::from_secs(2);
/// Mooncake's codes of `health_check`.
const HEALTHY: i64 = 0;
const NOT_INITIALIZED: i64 = 1;
const MASTER_UNREACHABLE: i64 = 2;

/// A value read by `get_buffer`: a `kvpool._buffer.BufferHandle`, a
/// `bytearray` that also answers Mooncake's `ptr()` and `size()`. Its
/// buffer protocol is bytearray's own (1-D bytes, writable), so the one abi3
/// wheel exports it on 3.10 too, where the stable ABI has no way for a
/// class of ours to (docs/architecture/python.md).
fn buffer_handle<'py>(py: Python<'py>, v: &[u8]) -> PyResult<Bound<'py, PyAny>> {
    static CLASS: PyOnceLock<Py<PyType>> = PyOnceLock::new();
    let h = CLASS
        .import(py, "kvpool._buffer", "BufferHandle")?
        .call0()?;
    let bytes = h.cast::<PyByteArray>()?;
    bytes.resize(v.len())?;
    // SAFETY: the GIL is held and the bytearray was made here: no other
    // reference, no export, nothing resizes it while the copy runs.
    unsafe { bytes.as_bytes_mut() }.copy_from_slice(v);
    Ok(h)
}

struct Inner {
    client: Client,
    node: std::sync::Mutex<Option<EmbeddedNode>>,
    hostname: String,
    regs: Registry,
    /// Pinned host memory for puts from and gets into device memory.
    staging: StagingPool,
}

/// The base of `kvpool.mooncake.MooncakeDistributedStore`.
#[pyclass(module = "kvpool.mooncake", name = "_MooncakeStore", subclass, frozen)]
pub struct Store {
    inner: RwLock<Option<Arc<Inner>>>,
}

/// The code of a put, or (`opts.replace`) of an upsert.
fn put_code(r: &Result<(), KvError>, opts: &PutOptions) -> i64 {
    match r {
        Ok(()) => OK,
        // Write-once, as Mooncake: the stored bytes stay, the put succeeds.
        Err(e) if e.code == ErrorCode::ObjectAlreadyExists && !opts.replace => OK,
        Err(e) => mooncake_code(e),
    }
}

fn code(r: &Result<(), KvError>) -> i64 {
    match r {
        Ok(()) => OK,
        Err(e) => mooncake_code(e),
    }
}

/// Runs a future with the GIL released; a runtime failure becomes its code.
fn run<T: Send, F>(py: Python<'_>, f: F) -> Result<T, i64>
where
    F: std::future::Future<Output = T> + Send,
{
    py.detach(|| runtime::block_on(f))
        .map_err(|e| mooncake_code(&e))
}

impl Store {
    fn state(&self) -> Option<Arc<Inner>> {
        self.inner.read().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// `host[:port]` split; `None` for an empty host or a bad port.
fn split_host(s: &str) -> Option<(String, u16)> {
    let s = s.trim();
    if s.is_empty() {
        return None;
    }
    if let Some(rest) = s.strip_prefix('[') {
        let (h, tail) = rest.split_once(']')?;
        let port = match tail.strip_prefix(':') {
            Some(p) => p.parse().ok()?,
            None if tail.is_empty() => 0,
            None => return None,
        };
        return Some((h.to_string(), port));
    }
    match s.rsplit_once(':') {
        Some((h, p)) if !h.contains(':') => Some((h.to_string(), p.parse().ok()?)),
        Some(_) => Some((s.to_string(), 0)), // a bare IPv6 address
        None => Some((s.to_string(), 0)),
    }
}

/// Mooncake's ports for a node when `local_hostname` names none (its
/// transfer engine picks one of these; callers and its tests expect it).
const MOONCAKE_PORTS: std::ops::RangeInclusive<u16> = 12300..=14300;

/// A port of [`MOONCAKE_PORTS`] free on `host` (probed by binding it), or 0
/// (the OS picks one) when none of 32 random tries is free.
fn mooncake_port(host: &str) -> u16 {
    use std::hash::BuildHasher;
    let (lo, hi) = (*MOONCAKE_PORTS.start(), *MOONCAKE_PORTS.end());
    let span = u64::from(hi - lo) + 1;
    let seed = std::collections::hash_map::RandomState::new().hash_one(std::process::id());
    for i in 0..32u64 {
        let p = lo + (seed.wrapping_add(i.wrapping_mul(0x9e37_79b9_7f4a_7c15)) % span) as u16;
        if std::net::TcpListener::bind((host, p)).is_ok() {
            return p;
        }
    }
    0
}
#[pymethods]
impl Store {
    #[new]
    #[pyo3(signature = (*_args, **_kwargs))]
    fn new(_args: &Bound<'_, PyTuple>, _kwargs: Option<&Bound<'_, pyo3::types::PyDict>>) -> Self {
        Self {
            inner: RwLock::new(None),
        }
    }

    /// Connects to the master (`master`, host:port) and, with
    /// `global_segment_size > 0`, starts a storage node in this process that
    /// gives that many bytes of its DRAM to the pool, listening on
    /// `local_hostname`'s host and port (none: a free one of Mooncake's
    /// 12300-14300, as its wheel picks) and advertised to
    /// clients under it. `protocol`: "tcp" (shared memory on the same host,
    /// TCP elsewhere) or "rdma" (`rdma_devices`, comma-separated, "" = any;
    /// a build without RDMA warns and uses tcp, as Mooncake's wheels
    /// without RDMA do). Returns 0 or a negative code.
    #[pyo3(signature = (local_hostname, master, global_segment_size, protocol, rdma_devices))]
    fn _setup_native(
        &self,
        py: Python<'_>,
        local_hostname: &str,
        master: &str,
        global_segment_size: u64,
        protocol: &str,
        rdma_devices: &str,
    ) -> i64 {
        if self.state().is_some() {
            tracing::warn!("setup on a store that is set up already: close() it first");
            return INVALID_PARAMS;
        }
        let Some((host, port)) = split_host(local_hostname) else {
            tracing::warn!("setup: local_hostname {local_hostname:?} is not host[:port]");
            return INVALID_PARAMS;
        };
        if split_host(master).is_none_or(|(_, p)| p == 0) {
            tracing::warn!("setup: master_server_addr {master:?} is not host:port");
            return INVALID_PARAMS;
        }
        let mut cfg = match config::node_config() {
            Ok(c) => c,
            Err(e) => {
                tracing::error!("setup: {e}");
                return INVALID_PARAMS;
            }
        };
        let devices: Vec<String> = rdma_devices
            .split(',')
            .map(str::trim)
            .filter(|d| !d.is_empty())
            .map(String::from)
            .collect();
        match protocol.to_ascii_lowercase().as_str() {
            "tcp" => {
                cfg.client.transport = Transport::Auto;
                cfg.client.rdma.enabled = kvpool_config::RdmaMode::Off;
                cfg.storage.rdma.enabled = kvpool_config::RdmaMode::Off;
            }
            "rdma" if !cfg!(feature = "rdma") => {
                // As Mooncake's wheels built without RDMA do: vLLM's and
                // SGLang's example configs say "rdma".
                tracing::warn!(
                    "setup: protocol \"rdma\" asked of a kvpool built without RDMA (the \
                     `rdma` feature): using tcp (shared memory on the same host)"
                );
                cfg.client.transport = Transport::Auto;
                cfg.client.rdma.enabled = kvpool_config::RdmaMode::Off;
                cfg.storage.rdma.enabled = kvpool_config::RdmaMode::Off;
            }
            "rdma" => {
                cfg.client.transport = Transport::Rdma;
                cfg.client.rdma.enabled = kvpool_config::RdmaMode::Required;
                cfg.client.rdma.devices = devices.clone();
                cfg.storage.rdma.enabled = kvpool_config::RdmaMode::Required;
                cfg.storage.rdma.devices = devices;
            }
            other => {
                tracing::warn!("setup: protocol {other:?} is not supported (tcp, rdma)");
                return INVALID_PARAMS;
            }
        }
        let client_cfg = cfg.client_config();
        let addr = master.to_string();
        let client = match run(py, async move { Client::connect(&addr, client_cfg).await }) {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => {
                tracing::warn!("setup: cannot connect to the master at {master}: {e}");
                return mooncake_code(&e);
            }
            Err(c) => return c,
        };
        let mut hostname = local_hostname.trim().to_string();
        let mut node = None;
        if global_segment_size > 0 {
            let bytes = global_segment_size.div_ceil(4096) * 4096;
            // No port given: one of Mooncake's range, as its wheel picks.
            let port = if port == 0 {
                mooncake_port(&host)
            } else {
                port
            };
            let listen = if host.contains(':') {
                format!("[{host}]:{port}")
            } else {
                format!("{host}:{port}")
            };
            let started =
                py.detach(|| EmbeddedNode::start(&cfg, master, bytes, listen, host.clone()));
            match started {
                Ok(n) => {
                    hostname = if host.contains(':') {
                        format!("[{host}]:{}", n.port())
                    } else {
                        format!("{host}:{}", n.port())
                    };
                    node = Some(n);
                }
                Err(e) => {
                    tracing::error!("setup: the embedded storage node did not start: {e}");
                    return INTERNAL_ERROR;
                }
            }
        }
        *self.inner.write().unwrap_or_else(|p| p.into_inner()) = Some(Arc::new(Inner {
            client,
            node: std::sync::Mutex::new(node),
            hostname,
            regs: Registry::default(),
            staging: StagingPool::new(staged::STAGING_CAP),
        }));
        OK
    }

    /// Closes the store: unmounts and stops an embedded node, forgets
    /// registered buffers. 0; a later `setup` starts afresh.
    fn close(&self, py: Python<'_>) -> i64 {
        let inner = self.inner.write().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(inner) = inner {
            inner.regs.clear();
            let node = inner.node.lock().unwrap_or_else(|p| p.into_inner()).take();
            if let Some(n) = node {
                py.detach(|| n.stop());
            }
        }
        OK
    }

    /// `host:port` of this store's embedded node, or `local_hostname` as
    /// given to `setup` for a pure client ("" before `setup`).
    fn get_hostname(&self) -> String {
        self.state().map(|i| i.hostname.clone()).unwrap_or_default()
    }

    /// 0 healthy, 1 not set up (or closed), 2 the master does not answer.
    fn health_check(&self, py: Python<'_>) -> i64 {
        let Some(inner) = self.state() else {
            return NOT_INITIALIZED;
        };
        let r = run(py, async move {
            tokio::time::timeout(HEALTH_TIMEOUT, inner.client.ping()).await
        });
        match r {
            Ok(Ok(Ok(()))) => HEALTHY,
            _ => MASTER_UNREACHABLE,
        }
    }

    /// Registers `size` bytes at `buffer_ptr` for the zero-copy calls (with
    /// RDMA, a memory region on the NIC). The memory must stay valid until
    /// `unregister_buffer` or `close`. 0 or a negative code.
    #[pyo3(signature = (buffer_ptr, size))]
    fn register_buffer(&self, py: Python<'_>, buffer_ptr: usize, size: usize) -> i64 {
        let Some(inner) = self.state() else {
            return INVALID_PARAMS;
        };
        // SAFETY: Mooncake's contract for `register_buffer`: the caller
        // keeps the range mapped and in place until it unregisters it (or
        // closes the store), and not freed while a transfer uses it.
        let r = py.detach(|| unsafe { inner.regs.register(&inner.client, buffer_ptr, size) });
        code(&r)
    }

    /// Forgets a range from `register_buffer`: 0, or -600 if none starts at
    /// `buffer_ptr`.
    #[pyo3(signature = (buffer_ptr))]
    fn unregister_buffer(&self, py: Python<'_>, buffer_ptr: usize) -> i64 {
        let Some(inner) = self.state() else {
            return INVALID_PARAMS;
        };
        if py.detach(|| inner.regs.unregister(buffer_ptr)) {
            OK
        } else {
            INVALID_PARAMS
        }
    }

    /// Stores `value` (bytes-like, read in place) under `key`. 0 (also for
    /// a key stored already: its bytes stay) or a negative code.
    #[pyo3(signature = (key, value, config = None))]
    fn put(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        value: &Bound<'_, PyAny>,
        config: Option<ReplicateConfig>,
    ) -> PyResult<i64> {
        self.write_value(py, key, value, config, false)
    }

    /// Stores `value` under `key`, replacing what is stored there (the atomic replace: readers get the old bytes or the new, never a mix or a miss). 0 or a negative code.
    #[pyo3(signature = (key, value, config = None))]
    fn upsert(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        value: &Bound<'_, PyAny>,
        config: Option<ReplicateConfig>,
    ) -> PyResult<i64> {
        self.write_value(py, key, value, config, true)
    }

    /// Stores the concatenation of `parts` (each 1-D bytes-like) under
    /// `key`. 0 or a negative code.
    #[pyo3(signature = (key, *parts, config = None))]
    fn put_parts(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        parts: &Bound<'_, PyTuple>,
        config: Option<ReplicateConfig>,
    ) -> PyResult<i64> {
        self.write_parts(py, key, parts, config, false)
    }

    /// `upsert` of the concatenation of `parts`. 0 or a negative code.
    #[pyo3(signature = (key, *parts, config = None))]
    fn upsert_parts(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        parts: &Bound<'_, PyTuple>,
        config: Option<ReplicateConfig>,
    ) -> PyResult<i64> {
        self.write_parts(py, key, parts, config, true)
    }

    /// Stores several values: one int, 0 or the first failing key's code.
    #[pyo3(signature = (keys, values, config = None))]
    fn put_batch(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        values: &Bound<'_, PyAny>,
        config: Option<ReplicateConfig>,
    ) -> PyResult<i64> {
        self.write_batch(py, keys, values, config, false)
    }

    /// `upsert` of several values: one int, 0 or the first failing key's code.
    #[pyo3(signature = (keys, values, config = None))]
    fn upsert_batch(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        values: &Bound<'_, PyAny>,
        config: Option<ReplicateConfig>,
    ) -> PyResult<i64> {
        self.write_batch(py, keys, values, config, true)
    }

    /// The value under `key`; `b""` on a miss or any error.
    #[pyo3(signature = (key, /))]
    fn get<'py>(&self, py: Python<'py>, key: &Bound<'_, PyAny>) -> PyResult<Bound<'py, PyBytes>> {
        let key = key_of(key)?;
        let Some(inner) = self.state() else {
            return Ok(PyBytes::new(py, b""));
        };
        match run(py, async move { inner.client.get(&key).await }) {
            Ok(Ok(v)) => Ok(PyBytes::new(py, &v)),
            _ => Ok(PyBytes::new(py, b"")),
        }
    }

    /// The values under `keys`, in order; `b""` for each miss or error.
    #[pyo3(signature = (keys, /))]
    fn get_batch<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let keys = keys_of(keys)?;
        let n = keys.len();
        let Some(inner) = self.state() else {
            return Ok((0..n).map(|_| PyBytes::new(py, b"")).collect());
        };
        let got = run(py, async move { batch_get(&inner.client, &keys).await })
            .unwrap_or_else(|_| vec![None; n]);
        Ok(got
            .into_iter()
            .map(|v| PyBytes::new(py, v.as_deref().unwrap_or(b"")))
            .collect())
    }

    /// The value under `key` as a BufferHandle, or None on a miss or error.
    #[pyo3(signature = (key, /))]
    fn get_buffer<'py>(
        &self,
        py: Python<'py>,
        key: &Bound<'_, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let key = key_of(key)?;
        let Some(inner) = self.state() else {
            return Ok(None);
        };
        match run(py, async move { inner.client.get(&key).await }) {
            Ok(Ok(v)) => buffer_handle(py, &v).map(Some),
            _ => Ok(None),
        }
    }

    /// `get_buffer` of each key, in order.
    #[pyo3(signature = (keys, /))]
    fn batch_get_buffer<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<Option<Bound<'py, PyAny>>>> {
        let keys = keys_of(keys)?;
        let n = keys.len();
        let Some(inner) = self.state() else {
            return Ok((0..n).map(|_| None).collect());
        };
        let got = run(py, async move { batch_get(&inner.client, &keys).await })
            .unwrap_or_else(|_| vec![None; n]);
        got.into_iter()
            .map(|v| v.map(|v| buffer_handle(py, &v)).transpose())
            .collect()
    }

    /// Stores `size` bytes at `buffer_ptr` (inside a registered buffer)
    /// under `key`, sent straight from that memory. `size == 0` stores
    /// nothing and returns 0. 0 or a negative code.
    #[pyo3(signature = (key, buffer_ptr, size, config = None))]
    fn put_from(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        buffer_ptr: usize,
        size: usize,
        config: Option<ReplicateConfig>,
    ) -> PyResult<i64> {
        self.write_from(py, key, buffer_ptr, size, config, false)
    }

    /// `upsert` of `size` bytes at `buffer_ptr` (inside a registered buffer), sent straight from that memory. 0 or a negative code.
    #[pyo3(signature = (key, buffer_ptr, size, config = None))]
    fn upsert_from(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        buffer_ptr: usize,
        size: usize,
        config: Option<ReplicateConfig>,
    ) -> PyResult<i64> {
        self.write_from(py, key, buffer_ptr, size, config, true)
    }

    /// Reads the value under `key` into `size` bytes at `buffer_ptr`
    /// (inside a registered buffer): the value's length, or a negative code
    /// (-704 a miss, -600 a buffer too small).
    #[pyo3(signature = (key, buffer_ptr, size))]
    fn get_into(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        buffer_ptr: usize,
        size: usize,
    ) -> PyResult<i64> {
        let key = key_of(key)?;
        let Some(inner) = self.state() else {
            return Ok(INVALID_PARAMS);
        };
        if !inner.regs.covers(buffer_ptr, size) {
            return Ok(mooncake_code(&memory::unregistered(buffer_ptr, size)));
        }
        let part = vec![(buffer_ptr, size)];
        if let Some(dev) = inner.regs.device_of(&part) {
            let r = py.detach(|| staged::get(&inner.client, &inner.staging, dev, &[key], &[part]));
            return Ok(match &r[0] {
                Ok(n) => *n as i64,
                Err(e) => mooncake_code(e),
            });
        }
        let r = run(py, async move {
            // SAFETY: Mooncake's contract for `get_into`: the range lies in
            // registered memory (checked) that the caller keeps valid and
            // neither reads nor writes during the call.
            let dst = unsafe { memory::slice_mut(buffer_ptr, size) };
            match inner.client.get_into(&key, dst).await {
                Ok(n) => n as i64,
                Err(e) => mooncake_code(&e),
            }
        });
        Ok(r.unwrap_or_else(|c| c))
    }

    /// Mooncake's `get_into_ranges`: for buffer `i` and its key `j`, each
    /// fragment `k` copies `all_sizes[i][j][k]` bytes at
    /// `all_src_offsets[i][j][k]` of the value into `buffer_ptrs[i] +
    /// all_dst_offsets[i][j][k]`. `results[i][j][k]` is the bytes copied or
    /// a negative code: -600 for lists of different shapes, a source range
    /// past the value, or a destination outside registered host memory;
    /// -704 for a missing key. Each value is read whole and its checksum
    /// checked (the checksum covers the whole value), then its fragments
    /// are copied: a range is never handed out unchecked.
    #[pyo3(signature = (buffer_ptrs, all_keys, all_dst_offsets, all_src_offsets, all_sizes))]
    fn get_into_ranges(
        &self,
        py: Python<'_>,
        buffer_ptrs: Vec<usize>,
        all_keys: Vec<Bound<'_, PyAny>>,
        all_dst_offsets: Vec<Vec<Vec<usize>>>,
        all_src_offsets: Vec<Vec<Vec<usize>>>,
        all_sizes: Vec<Vec<Vec<usize>>>,
    ) -> PyResult<Vec<Vec<Vec<i64>>>> {
        let keys: Vec<Vec<Vec<u8>>> = all_keys.iter().map(keys_of).collect::<PyResult<_>>()?;
        // Every entry starts as -600 and becomes a size or a code once its
        // fragment is served; one per destination offset, as Mooncake sizes
        // them (its own test reads them so).
        let mut results: Vec<Vec<Vec<i64>>> = keys
            .iter()
            .enumerate()
            .map(|(i, ks)| {
                (0..ks.len())
                    .map(|j| {
                        let n = all_dst_offsets
                            .get(i)
                            .and_then(|s| s.get(j))
                            .map_or(0, Vec::len);
                        vec![INVALID_PARAMS; n]
                    })
                    .collect()
            })
            .collect();
        let Some(inner) = self.state() else {
            return Ok(results);
        };
        let outer = [
            all_dst_offsets.len(),
            all_src_offsets.len(),
            all_sizes.len(),
        ];
        if outer.iter().any(|&n| n != buffer_ptrs.len()) || keys.len() != buffer_ptrs.len() {
            return Ok(results);
        }
        // (i, j) of every key whose fragment lists agree in shape.
        let mut wanted: Vec<(usize, usize)> = Vec::new();
        for (i, ks) in keys.iter().enumerate() {
            let (d, s, z) = (&all_dst_offsets[i], &all_src_offsets[i], &all_sizes[i]);
            if d.len() != ks.len() || s.len() != ks.len() || z.len() != ks.len() {
                continue;
            }
            for j in 0..ks.len() {
                if d[j].len() == z[j].len() && s[j].len() == z[j].len() {
                    wanted.push((i, j));
                }
            }
        }
        let regs = &inner.regs;
        let copy = |out: &mut Vec<i64>, (i, j): (usize, usize), value: Vec<u8>| {
            for (k, slot) in out.iter_mut().enumerate() {
                let (src, size) = (all_src_offsets[i][j][k], all_sizes[i][j][k]);
                let Some(dst) = buffer_ptrs[i].checked_add(all_dst_offsets[i][j][k]) else {
                    continue;
                };
                let in_value = src.checked_add(size).is_some_and(|end| end <= value.len());
                let host = regs.covers(dst, size) && regs.device_of(&[(dst, size)]).is_none();
                if !in_value || !host {
                    continue;
                }
                // SAFETY: Mooncake's contract for `get_into_ranges`: the
                // range lies in registered host memory (checked) that the
                // caller keeps valid and does not touch during the call.
                let d = unsafe { memory::slice_mut(dst, size) };
                d.copy_from_slice(&value[src..src + size]);
                *slot = size as i64;
            }
        };
        let client = &inner.client;
        // A call that cannot run (a forked child) leaves every entry at -600.
        let _ = run(py, async {
            // A few values at a time, each dropped once its fragments are
            // copied.
            for chunk in wanted.chunks(RANGES_BATCH) {
                let ks: Vec<&[u8]> = chunk.iter().map(|&(i, j)| keys[i][j].as_slice()).collect();
                let values = match client.batch_get(&ks).await {
                    Ok(v) => v,
                    Err(e) => chunk.iter().map(|_| Err(e.clone())).collect(),
                };
                for (&(i, j), value) in chunk.iter().zip(values) {
                    let out = &mut results[i][j];
                    match value {
                        Ok(v) => copy(out, (i, j), v),
                        Err(e) => out.fill(mooncake_code(&e)),
                    }
                }
            }
        });
        Ok(results)
    }

    /// `put_from` of each key; per key 0 or a negative code.
    #[pyo3(signature = (keys, buffer_ptrs, sizes, config = None))]
    fn batch_put_from(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        buffer_ptrs: Vec<usize>,
        sizes: Vec<usize>,
        config: Option<ReplicateConfig>,
    ) -> PyResult<Vec<i64>> {
        self.write_batch_from(py, keys, buffer_ptrs, sizes, config, false)
    }

    /// `upsert_from` of each key; per key 0 or a negative code.
    #[pyo3(signature = (keys, buffer_ptrs, sizes, config = None))]
    fn batch_upsert_from(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        buffer_ptrs: Vec<usize>,
        sizes: Vec<usize>,
        config: Option<ReplicateConfig>,
    ) -> PyResult<Vec<i64>> {
        self.write_batch_from(py, keys, buffer_ptrs, sizes, config, true)
    }

    /// `get_into` of each key; per key its length or a negative code.
    #[pyo3(signature = (keys, buffer_ptrs, sizes))]
    fn batch_get_into(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        buffer_ptrs: Vec<usize>,
        sizes: Vec<usize>,
    ) -> PyResult<Vec<i64>> {
        let keys = keys_of(keys)?;
        let n = keys.len();
        let Some(inner) = self.state() else {
            return Ok(vec![INVALID_PARAMS; n]);
        };
        let Some(parts) = one_part_each(n, buffer_ptrs, sizes) else {
            return Ok(vec![INVALID_PARAMS; n]);
        };
        Ok(get_multi(py, inner, keys, parts))
    }

    /// Stores each key's buffers, concatenated, as one object; per key 0 or
    /// a negative code.
    #[pyo3(signature = (keys, all_buffer_ptrs, all_sizes, config = None))]
    fn batch_put_from_multi_buffers(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        all_buffer_ptrs: Vec<Vec<usize>>,
        all_sizes: Vec<Vec<usize>>,
        config: Option<ReplicateConfig>,
    ) -> PyResult<Vec<i64>> {
        let keys = keys_of(keys)?;
        let n = keys.len();
        let Some(inner) = self.state() else {
            return Ok(Vec::new());
        };
        let Some(parts) = zip_parts(n, all_buffer_ptrs, all_sizes) else {
            return Ok(vec![INVALID_PARAMS; n]);
        };
        let opts = match options_of(config.as_ref(), false, false) {
            Ok(o) => o,
            Err(c) => return Ok(vec![c; n]),
        };
        Ok(put_multi(py, inner, keys, parts, opts))
    }

    /// Reads each key's object across its buffers, in order; per key the
    /// bytes read or a negative code.
    #[pyo3(signature = (keys, all_buffer_ptrs, all_sizes, prefer_alloc_in_same_node = false))]
    fn batch_get_into_multi_buffers(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        all_buffer_ptrs: Vec<Vec<usize>>,
        all_sizes: Vec<Vec<usize>>,
        prefer_alloc_in_same_node: bool,
    ) -> PyResult<Vec<i64>> {
        let _ = prefer_alloc_in_same_node; // placement of reads is the engine's
        let keys = keys_of(keys)?;
        let n = keys.len();
        let Some(inner) = self.state() else {
            return Ok(vec![INVALID_PARAMS; n]);
        };
        let Some(parts) = zip_parts(n, all_buffer_ptrs, all_sizes) else {
            return Ok(vec![INVALID_PARAMS; n]);
        };
        Ok(get_multi(py, inner, keys, parts))
    }

    /// 1 if a complete object is stored under `key`, 0 if not, or a
    /// negative code. A store that is not set up (or whose setup failed)
    /// answers 0: callers test the result for truth (LMCache's
    /// `if store.is_exist(key)`), and -600 would read as a hit.
    #[pyo3(signature = (key, /))]
    fn is_exist(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<i64> {
        let key = key_of(key)?;
        let Some(inner) = self.state() else {
            return Ok(0);
        };
        let r = run(py, async move {
            match inner.client.exists(&key).await {
                Ok(b) => b as i64,
                Err(e) => mooncake_code(&e),
            }
        });
        Ok(r.unwrap_or_else(|c| c))
    }

    /// `is_exist` of each key (0 each on a store that is not set up).
    #[pyo3(signature = (keys))]
    fn batch_is_exist(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
        let keys = keys_of(keys)?;
        let n = keys.len();
        let Some(inner) = self.state() else {
            return Ok(vec![0; n]);
        };
        let r = run(py, async move {
            let mut out = Vec::with_capacity(keys.len());
            for chunk in keys.chunks(MAX_BATCH) {
                let ks: Vec<&[u8]> = chunk.iter().map(|k| k.as_slice()).collect();
                match inner.client.batch_exists(&ks).await {
                    Ok(v) => out.extend(v.into_iter().map(|r| match r {
                        Ok(b) => b as i64,
                        Err(e) => mooncake_code(&e),
                    })),
                    Err(e) => out.extend(std::iter::repeat_n(mooncake_code(&e), chunk.len())),
                }
            }
            out
        });
        Ok(r.unwrap_or_else(|c| vec![c; n]))
    }

    /// For each key, its replicas as `(tier, size, offset, endpoint,
    /// segment id, on this host)` tuples, or `None` when it has none that
    /// can be read (missing, still being put, or the query failed): what
    /// `get_replica_desc` / `batch_get_replica_desc` wrap. Like a get, the
    /// query holds a read lease on each object it finds.
    #[allow(clippy::type_complexity)]
    fn _replica_descs(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<Option<Vec<(String, u64, u64, String, String, bool)>>>> {
        let keys = keys_of(keys)?;
        let n = keys.len();
        let Some(inner) = self.state() else {
            return Ok(vec![None; n]);
        };
        let here = kvpool_client::local_host_id();
        let r = run(py, async move {
            let mut out = Vec::with_capacity(n);
            for chunk in keys.chunks(MAX_BATCH) {
                let req = kvpool_wire::proto::call::BatchGet {
                    keys: chunk.to_vec(),
                };
                match inner.client.call(req).await {
                    Ok(lists) => out.extend(lists.into_iter().map(|l| {
                        let reps = Result::<Vec<kvpool_wire::proto::ReplicaDesc>, KvError>::from(l)
                            .ok()?;
                        if reps.is_empty() {
                            return None;
                        }
                        Some(
                            reps.iter()
                                .map(|r| {
                                    let tier = match r.tier {
                                        kvpool_wire::proto::Tier::Dram => "memory",
                                        kvpool_wire::proto::Tier::Nvme => "disk",
                                    };
                                    (
                                        tier.to_string(),
                                        r.len,
                                        r.offset,
                                        r.endpoint.shard_addr(r.data_shard()),
                                        format!("{:016x}", r.segment_id),
                                        r.host_id == here,
                                    )
                                })
                                .collect(),
                        )
                    })),
                    Err(_) => out.extend(std::iter::repeat_n(None, chunk.len())),
                }
            }
            out
        });
        Ok(r.unwrap_or_else(|_| vec![None; n]))
    }

    /// The size of the object under `key`, or a negative code (-704 a
    /// miss).
    #[pyo3(signature = (key, /))]
    fn get_size(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<i64> {
        let key = key_of(key)?;
        let Some(inner) = self.state() else {
            return Ok(INVALID_PARAMS);
        };
        let r = run(py, async move {
            match inner.client.describe(&key).await {
                Ok(i) if i.complete => i.size as i64,
                Ok(_) => mooncake_code(&KvError::new(ErrorCode::ReplicaNotReady, "")),
                Err(e) => mooncake_code(&e),
            }
        });
        Ok(r.unwrap_or_else(|c| c))
    }

    /// Removes the object under `key`: 0, or -704 (none), -706 (a reader's
    /// lease; `force` removes anyway), -703 (still being put), ...
    #[pyo3(signature = (key, force = false))]
    fn remove(&self, py: Python<'_>, key: &Bound<'_, PyAny>, force: bool) -> PyResult<i64> {
        let key = key_of(key)?;
        let Some(inner) = self.state() else {
            return Ok(INVALID_PARAMS);
        };
        let r = run(py, async move {
            code(&inner.client.remove_with(&key, force).await)
        });
        Ok(r.unwrap_or_else(|c| c))
    }

    /// `remove` of each key; per key 0 or a negative code.
    #[pyo3(signature = (keys, force = false))]
    fn batch_remove(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        force: bool,
    ) -> PyResult<Vec<i64>> {
        let keys = keys_of(keys)?;
        let n = keys.len();
        let Some(inner) = self.state() else {
            return Ok(vec![INVALID_PARAMS; n]);
        };
        let r = run(py, async move {
            let mut out = Vec::with_capacity(keys.len());
            for chunk in keys.chunks(MAX_BATCH) {
                let ks: Vec<&[u8]> = chunk.iter().map(|k| k.as_slice()).collect();
                match inner.client.batch_remove(&ks, force).await {
                    Ok(v) => out.extend(v.iter().map(code)),
                    Err(e) => out.extend(std::iter::repeat_n(mooncake_code(&e), chunk.len())),
                }
            }
            out
        });
        Ok(r.unwrap_or_else(|c| vec![c; n]))
    }

    /// Clears the replicas of `keys` (Mooncake's `batch_replica_clear`):
    /// the keys whose objects were removed. With `segment_name` empty every
    /// key is removed as `remove` does (not one a reader holds a lease on,
    /// or one still being put); with a segment (its name as the master's
    /// `/get_all_segments` lists it, its hex id, or its node's `host:port`,
    /// which `get_hostname` gives for an embedded node), only the keys whose
    /// every replica is in that segment: the pool keeps no object with
    /// some of its replicas gone. Not atomic: a key replaced between the
    /// look and the removal is removed in its new version.
    #[pyo3(signature = (keys, segment_name = ""))]
    fn batch_replica_clear<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
        segment_name: &str,
    ) -> PyResult<Vec<Bound<'py, PyAny>>> {
        let originals: Vec<Bound<'py, PyAny>> = keys.try_iter()?.collect::<PyResult<_>>()?;
        let ks = keys_of(keys)?;
        let Some(inner) = self.state() else {
            return Ok(Vec::new());
        };
        let segment = segment_name.to_string();
        let cleared = run(py, async move {
            let ids: Option<Vec<u64>> = if segment.is_empty() {
                None
            } else {
                let stat = inner.client.stat().await.ok()?;
                Some(
                    stat.segments
                        .iter()
                        .filter(|g| {
                            g.name == segment
                                || format!("{:016x}", g.id) == segment
                                || format!("{}:{}", g.endpoint.host, g.endpoint.port) == segment
                        })
                        .map(|g| g.id)
                        .collect(),
                )
            };
            let mut out = vec![false; ks.len()];
            for (i, k) in ks.iter().enumerate() {
                if let Some(ids) = &ids {
                    let Ok(info) = inner.client.describe(k).await else {
                        continue;
                    };
                    let all_there = !info.replicas.is_empty()
                        && info.replicas.iter().all(|r| ids.contains(&r.segment_id));
                    if !all_there {
                        continue;
                    }
                }
                out[i] = inner.client.remove_with(k, false).await.is_ok();
            }
            Some(out)
        });
        let cleared = match cleared {
            Ok(Some(c)) => c,
            _ => return Ok(Vec::new()),
        };
        Ok(originals
            .into_iter()
            .zip(cleared)
            .filter_map(|(k, c)| c.then_some(k))
            .collect())
    }

    /// Removes every complete object without a live lease (with `force`,
    /// leased ones too); how many went, or a negative code.
    #[pyo3(signature = (force = false))]
    fn remove_all(&self, py: Python<'_>, force: bool) -> i64 {
        let Some(inner) = self.state() else {
            return INVALID_PARAMS;
        };
        let r = run(py, async move {
            match inner.client.remove_all_with(force).await {
                Ok(n) => n as i64,
                Err(e) => mooncake_code(&e),
            }
        });
        r.unwrap_or_else(|c| c)
    }
}

/// Per key, its one `(ptr, size)`; `None` when the lists' lengths differ
/// (Mooncake then fails every key).
fn one_part_each(
    n: usize,
    ptrs: Vec<usize>,
    sizes: Vec<usize>,
) -> Option<Vec<Vec<(usize, usize)>>> {
    (ptrs.len() == n && sizes.len() == n)
        .then(|| ptrs.into_iter().zip(sizes).map(|r| vec![r]).collect())
}

/// Per key, its list of `(ptr, size)`; `None` when the lists' lengths differ.
fn zip_parts(
    n: usize,
    ptrs: Vec<Vec<usize>>,
    sizes: Vec<Vec<usize>>,
) -> Option<Vec<Vec<(usize, usize)>>> {
    if ptrs.len() != n || sizes.len() != n {
        return None;
    }
    ptrs.into_iter()
        .zip(sizes)
        .map(|(p, s)| (p.len() == s.len()).then(|| p.into_iter().zip(s).collect()))
        .collect()
}

/// `batch_put` in pieces of [`MAX_BATCH`]; per key 0 or a negative code.
async fn batch_put(
    client: &Client,
    keys: &[Vec<u8>],
    values: &[&[u8]],
    opts: &PutOptions,
) -> Vec<i64> {
    let mut out = Vec::with_capacity(keys.len());
    for (ks, vs) in keys.chunks(MAX_BATCH).zip(values.chunks(MAX_BATCH)) {
        let items: Vec<(&[u8], &[u8])> = ks
            .iter()
            .map(|k| k.as_slice())
            .zip(vs.iter().copied())
            .collect();
        match client.batch_put(&items, opts).await {
            Ok(v) => out.extend(v.iter().map(|r| put_code(r, opts))),
            Err(e) => out.extend(std::iter::repeat_n(mooncake_code(&e), ks.len())),
        }
    }
    out
}

/// `batch_get` in pieces of [`MAX_BATCH`]; per key its bytes, or `None`.
async fn batch_get(client: &Client, keys: &[Vec<u8>]) -> Vec<Option<Vec<u8>>> {
    let mut out = Vec::with_capacity(keys.len());
    for chunk in keys.chunks(MAX_BATCH) {
        let ks: Vec<&[u8]> = chunk.iter().map(|k| k.as_slice()).collect();
        match client.batch_get(&ks).await {
            Ok(v) => out.extend(v.into_iter().map(Result::ok)),
            Err(_) => out.extend(std::iter::repeat_n(None, chunk.len())),
        }
    }
    out
}

/// Puts each key's parts as one object: a key with one part is sent
/// straight from its memory; several parts are gathered into one buffer
/// first (one copy). Keys whose parts are not all registered get -600;
/// empty objects store nothing and get 0.
fn put_multi(
    py: Python<'_>,
    inner: Arc<Inner>,
    keys: Vec<Vec<u8>>,
    parts: Vec<Vec<(usize, usize)>>,
    opts: PutOptions,
) -> Vec<i64> {
    let n = keys.len();
    if let Some((dev, on_device)) = device_keys(&inner, &parts) {
        let mut out = vec![OK; n];
        let (dk, dp) = pick(&keys, &parts, &on_device);
        let rs = py.detach(|| staged::put(&inner.client, &inner.staging, dev, &dk, &dp, &opts));
        for (&i, r) in on_device.iter().zip(&rs) {
            out[i] = put_code(r, &opts);
        }
        let rest = others(n, &on_device);
        let (hk, hp) = pick(&keys, &parts, &rest);
        for (&i, c) in rest.iter().zip(put_multi(py, inner, hk, hp, opts)) {
            out[i] = c;
        }
        return out;
    }
    if let Some(ranges) = large_single_parts(&parts) {
        // Groups sent as parallel calls (same host: copies on several
        // workers at once).
        let mut out = vec![OK; n];
        let mut idx = Vec::new();
        for (i, &(a, l)) in ranges.iter().enumerate() {
            if l == 0 {
                continue; // Mooncake: nothing to store, success
            }
            if !inner.regs.covers(a, l) {
                out[i] = INVALID_PARAMS;
                continue;
            }
            idx.push(i);
        }
        let (k, r): (Vec<Vec<u8>>, Vec<(usize, usize)>) =
            idx.iter().map(|&i| (keys[i].clone(), ranges[i])).unzip();
        // SAFETY: registered memory (checked) that the caller keeps valid
        // and unwritten during the call (Mooncake's contract for put_from).
        let rs = py.detach(|| unsafe { staged::put_host(&inner.client, &k, &r, &opts) });
        match rs {
            Ok(rs) => {
                for (&i, r) in idx.iter().zip(&rs) {
                    out[i] = put_code(r, &opts);
                }
            }
            Err(e) => {
                for &i in &idx {
                    out[i] = mooncake_code(&e);
                }
            }
        }
        return out;
    }
    let r = run(py, async move {
        let mut out = vec![OK; n];
        let mut idx = Vec::new();
        let mut gathered: Vec<Vec<u8>> = Vec::new();
        let mut values: Vec<&[u8]> = Vec::new();
        let mut sel_keys: Vec<Vec<u8>> = Vec::new();
        for (i, p) in parts.iter().enumerate() {
            if !inner.regs.covers_all(p) {
                out[i] = INVALID_PARAMS;
                continue;
            }
            if p.iter().map(|r| r.1).sum::<usize>() == 0 {
                continue; // Mooncake: nothing to store, success
            }
            if p.len() > 1 {
                let mut g = Vec::with_capacity(p.iter().map(|r| r.1).sum());
                for &(a, l) in p {
                    // SAFETY: registered memory (checked) that the caller
                    // keeps valid and unwritten during the call.
                    g.extend_from_slice(unsafe { memory::slice(a, l) });
                }
                gathered.push(g);
            }
            idx.push(i);
        }
        let mut g = gathered.iter();
        for &i in &idx {
            let p = &parts[i];
            values.push(if p.len() > 1 {
                g.next()
                    .expect("one gathered buffer per multi-part key")
                    .as_slice()
            } else {
                let (a, l) = p[0];
                // SAFETY: as above (registered, valid, unwritten).
                unsafe { memory::slice(a, l) }
            });
            sel_keys.push(keys[i].clone());
        }
        let codes = batch_put(&inner.client, &sel_keys, &values, &opts).await;
        for (&i, c) in idx.iter().zip(codes) {
            out[i] = c;
        }
        out
    });
    r.unwrap_or_else(|c| vec![c; n])
}

/// Reads each key's object into its parts: one part is read into straight;
/// several are read into one buffer and scattered (one copy). Per key the
/// object's length, or a negative code (-600: parts not registered, or
/// overlapping another key's; an object longer than the parts).
fn get_multi(
    py: Python<'_>,
    inner: Arc<Inner>,
    keys: Vec<Vec<u8>>,
    parts: Vec<Vec<(usize, usize)>>,
) -> Vec<i64> {
    let n = keys.len();
    let all: Vec<(usize, usize)> = parts.iter().flatten().copied().collect();
    if !memory::disjoint(&all) {
        return vec![INVALID_PARAMS; n];
    }
    if let Some((dev, on_device)) = device_keys(&inner, &parts) {
        let mut out = vec![INVALID_PARAMS; n];
        let (dk, dp) = pick(&keys, &parts, &on_device);
        let rs = py.detach(|| staged::get(&inner.client, &inner.staging, dev, &dk, &dp));
        for (&i, r) in on_device.iter().zip(&rs) {
            out[i] = match r {
                Ok(len) => *len as i64,
                Err(e) => mooncake_code(e),
            };
        }
        let rest = others(n, &on_device);
        let (hk, hp) = pick(&keys, &parts, &rest);
        for (&i, c) in rest.iter().zip(get_multi(py, inner, hk, hp)) {
            out[i] = c;
        }
        return out;
    }
    if let Some(ranges) = large_single_parts(&parts) {
        let mut out = vec![INVALID_PARAMS; n];
        let idx: Vec<usize> = (0..n)
            .filter(|&i| inner.regs.covers_all(&parts[i]))
            .collect();
        let (k, r): (Vec<Vec<u8>>, Vec<(usize, usize)>) =
            idx.iter().map(|&i| (keys[i].clone(), ranges[i])).unzip();
        // SAFETY: registered memory (checked), the ranges disjoint (checked
        // above), which the caller keeps valid and untouched during the call.
        let rs = py.detach(|| unsafe { staged::get_host(&inner.client, &k, &r) });
        match rs {
            Ok(rs) => {
                for (&i, r) in idx.iter().zip(&rs) {
                    out[i] = match r {
                        Ok(len) => *len as i64,
                        Err(e) => mooncake_code(e),
                    };
                }
            }
            Err(e) => {
                for &i in &idx {
                    out[i] = mooncake_code(&e);
                }
            }
        }
        return out;
    }
    let r = run(py, async move {
        let mut out = vec![INVALID_PARAMS; n];
        let mut staged: Vec<Vec<u8>> = Vec::new();
        let mut idx = Vec::new();
        for (i, p) in parts.iter().enumerate() {
            if !inner.regs.covers_all(p) {
                continue;
            }
            if p.len() > 1 {
                staged.push(vec![0u8; p.iter().map(|r| r.1).sum()]);
            }
            idx.push(i);
        }
        {
            let mut st = staged.iter_mut();
            let mut items: Vec<(&[u8], &mut [u8])> = Vec::with_capacity(idx.len());
            for &i in &idx {
                let p = &parts[i];
                let dst: &mut [u8] = if p.len() > 1 {
                    st.next().expect("one staging buffer per multi-part key")
                } else {
                    let (a, l) = p[0];
                    // SAFETY: registered memory (checked), disjoint from
                    // every other destination (checked), which the caller
                    // keeps valid and untouched during the call.
                    unsafe { memory::slice_mut(a, l) }
                };
                items.push((keys[i].as_slice(), dst));
            }
            let mut done = 0;
            for chunk in items.chunks_mut(MAX_BATCH) {
                let got = inner.client.batch_get_into(chunk).await;
                let these = &idx[done..done + chunk.len()];
                match got {
                    Ok(v) => {
                        for (&i, r) in these.iter().zip(v) {
                            out[i] = match r {
                                Ok(len) => len as i64,
                                Err(e) => mooncake_code(&e),
                            };
                        }
                    }
                    Err(e) => {
                        for &i in these {
                            out[i] = mooncake_code(&e);
                        }
                    }
                }
                done += chunk.len();
            }
        }
        let mut st = staged.iter();
        for &i in &idx {
            let p = &parts[i];
            if p.len() <= 1 {
                continue;
            }
            let buf = st.next().expect("one staging buffer per multi-part key");
            if out[i] < 0 {
                continue;
            }
            let mut off = 0usize;
            let len = out[i] as usize;
            for &(a, l) in p {
                if off >= len {
                    break;
                }
                let take = l.min(len - off);
                // SAFETY: as above (registered, disjoint, the caller's).
                unsafe { memory::slice_mut(a, take) }.copy_from_slice(&buf[off..off + take]);
                off += take;
            }
        }
        out
    });
    r.unwrap_or_else(|c| vec![c; n])
}

/// The keys (by index) whose registered, non-empty parts touch CUDA device
/// memory, and the device of the first; `None` when there are none (the
/// host path, unchanged).
fn device_keys(
    inner: &Inner,
    parts: &[Vec<(usize, usize)>],
) -> Option<(crate::cuda::Device, Vec<usize>)> {
    let mut dev = None;
    let mut idx = Vec::new();
    for (i, p) in parts.iter().enumerate() {
        if !inner.regs.covers_all(p) {
            continue;
        }
        if let Some(d) = inner.regs.device_of(p) {
            dev.get_or_insert(d);
            idx.push(i);
        }
    }
    dev.map(|d| (d, idx))
}

/// The indices below `n` that are not in `taken` (sorted).
fn others(n: usize, taken: &[usize]) -> Vec<usize> {
    let mut t = taken.iter().peekable();
    (0..n)
        .filter(|i| {
            if t.peek() == Some(&i) {
                t.next();
                false
            } else {
                true
            }
        })
        .collect()
}

/// The keys and parts at `idx`, in that order.
fn pick(
    keys: &[Vec<u8>],
    parts: &[Vec<(usize, usize)>],
    idx: &[usize],
) -> (Vec<Vec<u8>>, Vec<staged::Parts>) {
    idx.iter()
        .map(|&i| (keys[i].clone(), parts[i].clone()))
        .unzip()
}

/// Each key's one range, when every key has one and together they are
/// worth sending in groups ([`staged::worth_grouping`]).
fn large_single_parts(parts: &[Vec<(usize, usize)>]) -> Option<Vec<(usize, usize)>> {
    let ranges: Vec<(usize, usize)> = parts
        .iter()
        .map(|p| (p.len() == 1).then(|| p[0]))
        .collect::<Option<_>>()?;
    staged::worth_grouping(&ranges).then_some(ranges)
}
