//! `kvpool.Client`: the Pythonic face of the store client.
//!
//! Every call releases the GIL while it waits on the pool; buffers are read
//! and written in place (a value's bytes go from the caller's buffer to the
//! transport and back, never through an intermediate Python object). Errors
//! raise `KvpoolError` with kvpool's code; a miss is `None`, not an error.

use std::collections::HashMap;
use std::sync::{Mutex, RwLock};

use kvpool_client::{Client, MemoryRegistration};
use kvpool_wire::proto::{PoolStat, PutOptions};
use kvpool_wire::{ErrorCode, KvError};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use crate::codes::{to_py, to_py_value};
use crate::memory::{self, PyMem};
use crate::{config, runtime};

/// A key from Python: `str` (UTF-8) or a bytes-like object.
pub fn key_of(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
    if let Ok(s) = obj.extract::<&str>() {
        return Ok(s.as_bytes().to_vec());
    }
    if let Ok(b) = obj.cast::<PyBytes>() {
        return Ok(b.as_bytes().to_vec());
    }
    let m = PyMem::readable(obj)
        .map_err(|_| PyValueError::new_err("a key is a str or a bytes-like object"))?;
    // SAFETY: `m` holds the object's buffer export while we copy it, with
    // the GIL held.
    Ok(unsafe { memory::slice(m.addr, m.len) }.to_vec())
}

/// Keys from a Python iterable.
pub fn keys_of(obj: &Bound<'_, PyAny>) -> PyResult<Vec<Vec<u8>>> {
    obj.try_iter()?.map(|k| key_of(&k?)).collect()
}

/// Runs `f` on the runtime with the GIL released.
pub fn run<T: Send, F>(py: Python<'_>, f: F) -> Result<T, KvError>
where
    F: std::future::Future<Output = Result<T, KvError>> + Send,
{
    py.detach(|| runtime::block_on(f).and_then(|r| r))
}

fn put_options(replicas: u32, soft_pin_ms: u64, hard_pin: bool) -> PutOptions {
    PutOptions {
        replicas,
        soft_pin_ttl_ms: soft_pin_ms,
        hard_pin,
        ..PutOptions::default()
    }
}

/// A registered buffer: the object's export and its registration.
struct Registered {
    _mem: PyMem,
    _reg: MemoryRegistration,
}

/// A connection to a kvpool pool.
///
/// ``Client(master="127.0.0.1:7070", **options)``: ``options`` are keys of
/// kvpool's ``[client]`` config (``timeout_ms``, ``connect_timeout_ms``,
/// ``transport``, ``lanes``, ``checksums``, ...) and ``secret`` (the cluster
/// secret; default ``$KVPOOL_SECRET``). An unknown option raises ValueError
/// naming it. Safe to share between threads; every call releases the GIL.
#[pyclass(module = "kvpool", name = "Client", frozen)]
pub struct PyClient {
    client: RwLock<Option<Client>>,
    master: String,
    /// Registered buffers by start address.
    registered: Mutex<HashMap<usize, Registered>>,
}

impl PyClient {
    /// A put or (`opts.replace`) an upsert of a bytes-like value, read in
    /// place.
    fn write(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        value: &Bound<'_, PyAny>,
        opts: PutOptions,
    ) -> PyResult<()> {
        let client = self.client()?;
        let key = key_of(key)?;
        let mem = PyMem::readable(value)?;
        let (addr, len) = (mem.addr, mem.len);
        let r = run(py, async move {
            // SAFETY: `mem` holds the buffer export until after this call
            // (the object cannot free or resize it); the bytes are only read.
            let value = unsafe { memory::slice(addr, len) };
            client.put_with(&key, value, &opts).await
        });
        drop(mem);
        r.map_err(|e| to_py(py, &e))
    }

    fn client(&self) -> PyResult<Client> {
        self.client
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| {
                to_py_closed(&KvError::new(
                    ErrorCode::Unavailable,
                    "the client is closed",
                ))
            })
    }
}

fn to_py_closed(e: &KvError) -> PyErr {
    Python::attach(|py| to_py(py, e))
}

fn stat_dict<'py>(py: Python<'py>, s: &PoolStat) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("keys", s.keys)?;
    d.set_item("capacity", s.capacity)?;
    d.set_item("used", s.used)?;
    d.set_item("evictions", s.evictions)?;
    d.set_item("evicted_bytes", s.evicted_bytes)?;
    d.set_item("demotions", s.demotions)?;
    d.set_item("promotions", s.promotions)?;
    d.set_item("hot_copies", s.hot_copies)?;
    let segs = PyList::empty(py);
    for g in &s.segments {
        let e = PyDict::new(py);
        e.set_item("id", g.id)?;
        e.set_item("name", &g.name)?;
        e.set_item(
            "endpoint",
            format!("{}:{}", g.endpoint.host, g.endpoint.port),
        )?;
        e.set_item("host_id", &g.host_id)?;
        e.set_item("capacity", g.capacity)?;
        e.set_item("used", g.used)?;
        e.set_item("draining", g.draining)?;
        e.set_item("suspect", g.suspect)?;
        segs.append(e)?;
    }
    d.set_item("segments", segs)?;
    Ok(d)
}

#[pymethods]
impl PyClient {
    #[new]
    #[pyo3(signature = (master = "127.0.0.1:7070", **options))]
    fn new(py: Python<'_>, master: &str, options: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        let cfg = config::client_options(options)?;
        let addr = master.to_string();
        let client =
            run(py, async move { Client::connect(&addr, cfg).await }).map_err(|e| to_py(py, &e))?;
        Ok(Self {
            client: RwLock::new(Some(client)),
            master: master.to_string(),
            registered: Mutex::new(HashMap::new()),
        })
    }

    /// The master's address.
    #[getter]
    fn master(&self) -> &str {
        &self.master
    }

    /// Stores ``value`` (any bytes-like object, read in place) under
    /// ``key``. Objects are written once: a key that is stored already
    /// raises KvpoolError ``ObjectAlreadyExists`` (see :meth:`upsert`).
    #[pyo3(signature = (key, value, *, replicas = 1, soft_pin_ms = 0, hard_pin = false))]
    fn put(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        value: &Bound<'_, PyAny>,
        replicas: u32,
        soft_pin_ms: u64,
        hard_pin: bool,
    ) -> PyResult<()> {
        self.write(py, key, value, put_options(replicas, soft_pin_ms, hard_pin))
    }

    /// Stores ``value`` under ``key``, replacing what is stored there: the
    /// atomic replace (a reader gets the old bytes or the new, never a mix
    /// and never a miss in between).
    #[pyo3(signature = (key, value, *, replicas = 1, soft_pin_ms = 0, hard_pin = false))]
    fn upsert(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        value: &Bound<'_, PyAny>,
        replicas: u32,
        soft_pin_ms: u64,
        hard_pin: bool,
    ) -> PyResult<()> {
        let opts = PutOptions {
            replace: true,
            ..put_options(replicas, soft_pin_ms, hard_pin)
        };
        self.write(py, key, value, opts)
    }

    /// Same as :meth:`put`: the bytes go from ``buffer``'s memory to the
    /// pool with no copy in Python (with RDMA, zero copy from a buffer
    /// passed to :meth:`register_buffer`).
    #[pyo3(signature = (key, buffer, *, replicas = 1, soft_pin_ms = 0, hard_pin = false))]
    fn put_from(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        buffer: &Bound<'_, PyAny>,
        replicas: u32,
        soft_pin_ms: u64,
        hard_pin: bool,
    ) -> PyResult<()> {
        self.put(py, key, buffer, replicas, soft_pin_ms, hard_pin)
    }

    /// The value under ``key`` as bytes, or None if there is none.
    fn get<'py>(
        &self,
        py: Python<'py>,
        key: &Bound<'_, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let client = self.client()?;
        let key = key_of(key)?;
        match run(py, async move { client.get(&key).await }) {
            Ok(v) => Ok(Some(PyBytes::new(py, &v))),
            Err(e) if e.code == ErrorCode::ObjectNotFound => Ok(None),
            Err(e) => Err(to_py(py, &e)),
        }
    }

    /// Reads the value under ``key`` straight into ``buffer`` (a writable
    /// bytes-like object: bytearray, numpy array, memoryview, ...); returns
    /// its length, or None if there is none. A value longer than the buffer
    /// raises ``InvalidParams`` and writes nothing.
    fn get_into(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        buffer: &Bound<'_, PyAny>,
    ) -> PyResult<Option<usize>> {
        let client = self.client()?;
        let key = key_of(key)?;
        let mem = PyMem::writable(buffer)?;
        let (addr, len) = (mem.addr, mem.len);
        let r = run(py, async move {
            // SAFETY: `mem` holds the writable export until after the call;
            // only this call writes the range while the GIL is released
            // (the buffer protocol's contract with the exporter's users).
            let dst = unsafe { memory::slice_mut(addr, len) };
            client.get_into(&key, dst).await
        });
        drop(mem);
        match r {
            Ok(n) => Ok(Some(n)),
            Err(e) if e.code == ErrorCode::ObjectNotFound => Ok(None),
            Err(e) => Err(to_py(py, &e)),
        }
    }

    /// Whether a complete object is stored under ``key``.
    fn exists(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<bool> {
        let client = self.client()?;
        let key = key_of(key)?;
        run(py, async move { client.exists(&key).await }).map_err(|e| to_py(py, &e))
    }

    /// Removes the object under ``key``: True if it went, False if there
    /// was none. Under a reader's lease it raises ``ObjectHasLease`` unless
    /// ``force``.
    #[pyo3(signature = (key, force = false))]
    fn remove(&self, py: Python<'_>, key: &Bound<'_, PyAny>, force: bool) -> PyResult<bool> {
        let client = self.client()?;
        let key = key_of(key)?;
        match run(py, async move { client.remove_with(&key, force).await }) {
            Ok(()) => Ok(true),
            Err(e) if e.code == ErrorCode::ObjectNotFound => Ok(false),
            Err(e) => Err(to_py(py, &e)),
        }
    }

    /// Removes every object without a live lease (with ``force``, leased
    /// ones too); how many went.
    #[pyo3(signature = (force = false))]
    fn remove_all(&self, py: Python<'_>, force: bool) -> PyResult<u64> {
        let client = self.client()?;
        run(py, async move { client.remove_all_with(force).await }).map_err(|e| to_py(py, &e))
    }

    /// Stores several values in one round trip per master shard; returns,
    /// per key in order, None (stored) or the KvpoolError that kept it out.
    #[pyo3(signature = (keys, values, *, replicas = 1, soft_pin_ms = 0, hard_pin = false))]
    fn batch_put(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        values: &Bound<'_, PyAny>,
        replicas: u32,
        soft_pin_ms: u64,
        hard_pin: bool,
    ) -> PyResult<Vec<Option<Py<PyAny>>>> {
        let client = self.client()?;
        let keys = keys_of(keys)?;
        let mems: Vec<PyMem> = values
            .try_iter()?
            .map(|v| PyMem::readable(&v?))
            .collect::<PyResult<_>>()?;
        if keys.len() != mems.len() {
            return Err(PyValueError::new_err(format!(
                "{} keys and {} values",
                keys.len(),
                mems.len()
            )));
        }
        let ranges: Vec<(usize, usize)> = mems.iter().map(|m| (m.addr, m.len)).collect();
        let opts = put_options(replicas, soft_pin_ms, hard_pin);
        let r = run(py, async move {
            let items: Vec<(&[u8], &[u8])> = keys
                .iter()
                .zip(&ranges)
                // SAFETY: `mems` hold the exports until after the call; read only.
                .map(|(k, &(a, l))| (k.as_slice(), unsafe { memory::slice(a, l) }))
                .collect();
            client.batch_put(&items, &opts).await
        });
        drop(mems);
        let r = r.map_err(|e| to_py(py, &e))?;
        r.into_iter()
            .map(|x| match x {
                Ok(()) => Ok(None),
                Err(e) => to_py_value(py, &e).map(Some),
            })
            .collect()
    }

    /// The values under ``keys``, in order: bytes, or None for a key with
    /// none. Any other failure raises.
    fn batch_get<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<Option<Bound<'py, PyBytes>>>> {
        let client = self.client()?;
        let keys = keys_of(keys)?;
        let r = run(py, async move {
            let ks: Vec<&[u8]> = keys.iter().map(|k| k.as_slice()).collect();
            client.batch_get(&ks).await
        })
        .map_err(|e| to_py(py, &e))?;
        r.into_iter()
            .map(|x| match x {
                Ok(v) => Ok(Some(PyBytes::new(py, &v))),
                Err(e) if e.code == ErrorCode::ObjectNotFound => Ok(None),
                Err(e) => Err(to_py(py, &e)),
            })
            .collect()
    }

    /// Reads each key's value straight into its buffer (one master round
    /// trip per shard); per key, its length or None if there is none. Any
    /// other failure raises. The buffers must not overlap.
    fn batch_get_into(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        buffers: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<Option<usize>>> {
        let client = self.client()?;
        let keys = keys_of(keys)?;
        let mems: Vec<PyMem> = buffers
            .try_iter()?
            .map(|v| PyMem::writable(&v?))
            .collect::<PyResult<_>>()?;
        if keys.len() != mems.len() {
            return Err(PyValueError::new_err(format!(
                "{} keys and {} buffers",
                keys.len(),
                mems.len()
            )));
        }
        let ranges: Vec<(usize, usize)> = mems.iter().map(|m| (m.addr, m.len)).collect();
        if !memory::disjoint(&ranges) {
            return Err(PyValueError::new_err("the buffers overlap"));
        }
        let r = run(py, async move {
            let mut items: Vec<(&[u8], &mut [u8])> = keys
                .iter()
                .zip(&ranges)
                // SAFETY: `mems` hold the writable exports until after the
                // call, and the ranges are disjoint (checked above).
                .map(|(k, &(a, l))| (k.as_slice(), unsafe { memory::slice_mut(a, l) }))
                .collect();
            client.batch_get_into(&mut items).await
        });
        drop(mems);
        let r = r.map_err(|e| to_py(py, &e))?;
        r.into_iter()
            .map(|x| match x {
                Ok(n) => Ok(Some(n)),
                Err(e) if e.code == ErrorCode::ObjectNotFound => Ok(None),
                Err(e) => Err(to_py(py, &e)),
            })
            .collect()
    }

    /// Whether each key is stored, in order.
    fn batch_exists(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<Vec<bool>> {
        let client = self.client()?;
        let keys = keys_of(keys)?;
        let r = run(py, async move {
            let ks: Vec<&[u8]> = keys.iter().map(|k| k.as_slice()).collect();
            client.batch_exists(&ks).await
        })
        .map_err(|e| to_py(py, &e))?;
        r.into_iter()
            .map(|x| x.map_err(|e| to_py(py, &e)))
            .collect()
    }

    /// Removes several keys; per key, True if it went, False if there was
    /// none. Other failures (a lease, without ``force``) raise.
    #[pyo3(signature = (keys, force = false))]
    fn batch_remove(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        force: bool,
    ) -> PyResult<Vec<bool>> {
        let client = self.client()?;
        let keys = keys_of(keys)?;
        let r = run(py, async move {
            let ks: Vec<&[u8]> = keys.iter().map(|k| k.as_slice()).collect();
            client.batch_remove(&ks, force).await
        })
        .map_err(|e| to_py(py, &e))?;
        r.into_iter()
            .map(|x| match x {
                Ok(()) => Ok(true),
                Err(e) if e.code == ErrorCode::ObjectNotFound => Ok(false),
                Err(e) => Err(to_py(py, &e)),
            })
            .collect()
    }

    /// Registers a writable buffer's memory for transfers: with RDMA, the
    /// NIC gets a memory region for it, so :meth:`get_into` into it and
    /// :meth:`put_from` out of it are zero copy. The buffer is held (it
    /// cannot be resized or freed) until :meth:`unregister_buffer` or
    /// :meth:`close`. Without RDMA it changes nothing but is harmless.
    fn register_buffer(&self, py: Python<'_>, buffer: &Bound<'_, PyAny>) -> PyResult<()> {
        let client = self.client()?;
        let mem = PyMem::writable(buffer)?;
        let (addr, len) = (mem.addr, mem.len);
        // A buffer registered again at this address: the old registration
        // goes first, so that its release cannot drop the new one's entry
        // in the RDMA cache.
        let old = self
            .registered
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&addr);
        drop(old);
        // The GIL is released: an RDMA registration pins every page.
        let reg = py
            // SAFETY: the export in `mem` keeps the memory valid and in
            // place for as long as the registration lives beside it in
            // `registered` (both go together in `unregister_buffer` /
            // `close`).
            .detach(|| unsafe { client.register_memory(addr, len) })
            .map_err(|e| to_py(py, &e))?;
        self.registered
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(
                addr,
                Registered {
                    _mem: mem,
                    _reg: reg,
                },
            );
        Ok(())
    }

    /// Lets go of a buffer given to :meth:`register_buffer`; whether it was
    /// registered.
    fn unregister_buffer(&self, buffer: &Bound<'_, PyAny>) -> PyResult<bool> {
        let mem = PyMem::readable(buffer)?;
        let gone = self
            .registered
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&mem.addr);
        Ok(gone.is_some())
    }

    /// The pool: ``keys``, ``capacity``, ``used``, eviction counters and
    /// ``segments`` (one dict per mounted segment).
    fn stat<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let client = self.client()?;
        let s = run(py, async move { client.stat().await }).map_err(|e| to_py(py, &e))?;
        stat_dict(py, &s)
    }

    /// Closes the client: later calls raise; registered buffers are let go.
    fn close(&self) {
        self.registered
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
        self.client
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .take();
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, _args: &Bound<'_, pyo3::types::PyTuple>) -> bool {
        self.close();
        false
    }

    fn __repr__(&self) -> String {
        let open = self
            .client
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .is_some();
        format!(
            "kvpool.Client(master={:?}{})",
            self.master,
            if open { "" } else { ", closed" }
        )
    }
}
