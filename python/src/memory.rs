//! Memory the module reads and writes: Python buffers held for one call,
//! raw ranges the caller registered (Mooncake's `register_buffer(ptr, size)`),
//! and shareable host memory (`MooncakeHostMemAllocator`).

use std::collections::{BTreeMap, HashMap};
use std::os::fd::OwnedFd;
use std::sync::Mutex;

use kvpool_client::{Client, MemoryRegistration};

use crate::cuda;
use kvpool_wire::{ErrorCode, KvError};
use pyo3::exceptions::{PyBufferError, PyRuntimeError};
use pyo3::prelude::*;

/// CPython's buffer protocol, declared here rather than taken from PyO3: in
/// the stable ABI it arrived with 3.11 (PyO3 offers it to abi3 builds only
/// from there), yet the struct and these three functions are the same, and
/// exported by libpython, from 3.3 on. Declaring them lets the one abi3
/// wheel (`cp310-abi3`) read buffers on 3.10 too (docs/architecture/python.md).
mod ffi {
    use std::os::raw::{c_char, c_int, c_void};

    use pyo3::ffi::{PyObject, Py_ssize_t};

    /// `Py_buffer` (Include/pybuffer.h), field for field.
    #[repr(C)]
    pub struct PyBuffer {
        pub buf: *mut c_void,
        pub obj: *mut PyObject,
        pub len: Py_ssize_t,
        pub itemsize: Py_ssize_t,
        pub readonly: c_int,
        pub ndim: c_int,
        pub format: *mut c_char,
        pub shape: *mut Py_ssize_t,
        pub strides: *mut Py_ssize_t,
        pub suboffsets: *mut Py_ssize_t,
        pub internal: *mut c_void,
    }

    /// `PyBUF_FULL_RO`: any layout, with its format; not asking for write
    /// access (checked on `readonly` instead, for a clearer error).
    pub const PYBUF_FULL_RO: c_int = 0x0100 | 0x0010 | 0x0008 | 0x0004;

    unsafe extern "C" {
        pub fn PyObject_GetBuffer(obj: *mut PyObject, view: *mut PyBuffer, flags: c_int) -> c_int;
        pub fn PyBuffer_Release(view: *mut PyBuffer);
        pub fn PyBuffer_IsContiguous(view: *const PyBuffer, order: c_char) -> c_int;
    }
}

/// A Python object's memory, exported to us (the object cannot resize or
/// free it) for as long as this value lives.
pub struct PyMem {
    /// Filled by `PyObject_GetBuffer`; boxed so that its address stays put
    /// until `PyBuffer_Release`.
    view: Box<ffi::PyBuffer>,
    pub addr: usize,
    pub len: usize,
}

// SAFETY: the view is only an export record; it is released with the GIL
// held (Drop attaches), from whichever thread drops it, as PyO3's own
// buffer wrapper does.
unsafe impl Send for PyMem {}
// SAFETY: no method reads the view's pointers through `&self` besides the
// plain `readonly` field.
unsafe impl Sync for PyMem {}

impl PyMem {
    /// Any C-contiguous buffer-protocol object (bytes, bytearray,
    /// memoryview, numpy arrays, ...), read-only use.
    pub fn readable(obj: &Bound<'_, PyAny>) -> PyResult<Self> {
        let mut view = Box::new(ffi::PyBuffer {
            buf: std::ptr::null_mut(),
            obj: std::ptr::null_mut(),
            len: 0,
            itemsize: 0,
            readonly: 0,
            ndim: 0,
            format: std::ptr::null_mut(),
            shape: std::ptr::null_mut(),
            strides: std::ptr::null_mut(),
            suboffsets: std::ptr::null_mut(),
            internal: std::ptr::null_mut(),
        });
        // SAFETY: `obj` is a live object (the GIL is held: `Bound`); `view`
        // is ours to fill and outlives the export (released in Drop).
        if unsafe { ffi::PyObject_GetBuffer(obj.as_ptr(), &mut *view, ffi::PYBUF_FULL_RO) } == -1 {
            return Err(PyErr::fetch(obj.py()));
        }
        let (addr, len) = (view.buf as usize, view.len.max(0) as usize);
        let m = Self { view, addr, len };
        // SAFETY: the view was filled by a successful GetBuffer.
        if unsafe { ffi::PyBuffer_IsContiguous(&*m.view, b'C' as std::os::raw::c_char) } == 0 {
            return Err(PyBufferError::new_err(
                "the buffer must be C-contiguous (one run of bytes)",
            ));
        }
        Ok(m)
    }

    /// A writable C-contiguous buffer-protocol object (bytearray, a numpy
    /// array, a writable memoryview, a tensor's storage, ...).
    pub fn writable(obj: &Bound<'_, PyAny>) -> PyResult<Self> {
        let m = Self::readable(obj)?;
        if m.view.readonly != 0 {
            return Err(PyBufferError::new_err(
                "the buffer is read-only: get_into needs a writable one",
            ));
        }
        Ok(m)
    }
}

impl Drop for PyMem {
    fn drop(&mut self) {
        // SAFETY: the view holds an export from GetBuffer, released once,
        // with the GIL held.
        Python::attach(|_| unsafe { ffi::PyBuffer_Release(&mut *self.view) });
    }
}

/// The bytes at `addr..addr + len` (empty for `len == 0`, whatever `addr`).
///
/// # Safety
/// For the returned lifetime the range must be mapped, readable memory that
/// nobody frees or writes.
pub unsafe fn slice<'a>(addr: usize, len: usize) -> &'a [u8] {
    if len == 0 {
        return &[];
    }
    // SAFETY: per this function's contract.
    unsafe { std::slice::from_raw_parts(addr as *const u8, len) }
}

/// The bytes at `addr..addr + len`, writable.
///
/// # Safety
/// For the returned lifetime the range must be mapped, writable memory that
/// nobody else reads, writes or frees, and that no other live slice covers.
#[allow(clippy::mut_from_ref)]
pub unsafe fn slice_mut<'a>(addr: usize, len: usize) -> &'a mut [u8] {
    if len == 0 {
        return &mut [];
    }
    // SAFETY: per this function's contract.
    unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) }
}

/// Whether no two of the ranges `(addr, len)` overlap (writable slices of a
/// batch must not alias).
pub fn disjoint(ranges: &[(usize, usize)]) -> bool {
    let mut v: Vec<(usize, usize)> = ranges.iter().copied().filter(|r| r.1 > 0).collect();
    v.sort_unstable();
    v.windows(2).all(|w| w[0].0 + w[0].1 <= w[1].0)
}

/// One registered range: host memory (with its registration at the
/// client: an RDMA memory region, where there is one), or CUDA device
/// memory, which the module reaches only through staged copies.
enum Reg {
    Host(MemoryRegistration),
    Device { len: usize, dev: cuda::Device },
}

impl Reg {
    fn len(&self) -> usize {
        match self {
            Reg::Host(r) => r.len(),
            Reg::Device { len, .. } => *len,
        }
    }
}

/// Ranges registered with one client, by start address.
#[derive(Default)]
pub struct Registry {
    map: Mutex<BTreeMap<usize, Reg>>,
}

impl Registry {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<usize, Reg>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers `addr..addr + len` with `client`: CUDA device memory is
    /// recorded as such (the client never touches it; see [`cuda`]), host
    /// memory is registered with the client. The same range again is a
    /// no-op; another length at the same address replaces the old range
    /// (unregistered first, so that the old one's release cannot drop the
    /// new one's entry in the RDMA cache).
    ///
    /// # Safety
    /// As [`Client::register_memory`]: the range stays valid until it is
    /// unregistered (or the registry dropped) and its transfers have ended.
    pub unsafe fn register(&self, client: &Client, addr: usize, len: usize) -> Result<(), KvError> {
        let device = if len > 0 && addr != 0 {
            cuda::classify(addr, len)?
        } else {
            None
        };
        let mut map = self.lock();
        match map.get(&addr) {
            Some(r) if r.len() == len => return Ok(()),
            Some(_) => drop(map.remove(&addr)),
            None => {}
        }
        let reg = match device {
            Some(dev) => Reg::Device { len, dev },
            // SAFETY: this function's contract, passed on.
            None => Reg::Host(unsafe { client.register_memory(addr, len) }?),
        };
        map.insert(addr, reg);
        Ok(())
    }

    /// Forgets the range that starts at `addr`; whether there was one.
    pub fn unregister(&self, addr: usize) -> bool {
        self.lock().remove(&addr).is_some()
    }

    /// The registered range that holds all of `addr..addr + len`.
    fn holder(map: &BTreeMap<usize, Reg>, addr: usize, len: usize) -> Option<&Reg> {
        let (&start, r) = map.range(..=addr).next_back()?;
        let end = addr.checked_add(len)?;
        (end <= start + r.len()).then_some(r)
    }

    /// Whether `addr..addr + len` lies inside one registered range.
    pub fn covers(&self, addr: usize, len: usize) -> bool {
        let map = self.lock();
        match Self::holder(&map, addr, len) {
            Some(Reg::Host(r)) => r.covers(addr, len),
            Some(Reg::Device { .. }) => true,
            None => false,
        }
    }

    /// Whether every range lies inside a registered one.
    pub fn covers_all(&self, ranges: &[(usize, usize)]) -> bool {
        ranges.iter().all(|&(a, l)| l == 0 || self.covers(a, l))
    }

    /// The device of the first non-empty range that lies in registered
    /// device memory; `None` when all are host memory.
    pub fn device_of(&self, ranges: &[(usize, usize)]) -> Option<cuda::Device> {
        let map = self.lock();
        ranges
            .iter()
            .filter(|r| r.1 > 0)
            .find_map(|&(a, l)| match Self::holder(&map, a, l) {
                Some(Reg::Device { dev, .. }) => Some(*dev),
                _ => None,
            })
    }

    pub fn clear(&self) {
        self.lock().clear();
    }
}

/// Shared host memory for a process that hands its buffers to another
/// (Mooncake's standalone mode): each allocation is its own memfd, mapped
/// shared and populated.
#[pyclass(module = "kvpool.mooncake", name = "MooncakeHostMemAllocator")]
pub struct HostMemAllocator;

struct HostAlloc {
    len: usize,
    _fd: OwnedFd,
}

/// Live allocations of every allocator of the process, by address.
static HOST_ALLOCS: Mutex<Option<HashMap<usize, HostAlloc>>> = Mutex::new(None);

fn host_alloc(size: usize) -> Result<usize, String> {
    use rustix::fs::{ftruncate, memfd_create, MemfdFlags};
    use rustix::mm::{mmap, MapFlags, ProtFlags};
    if size == 0 {
        return Err("cannot allocate 0 bytes".into());
    }
    let fd = memfd_create("kvpool_host_mem", MemfdFlags::CLOEXEC)
        .map_err(|e| format!("memfd_create: {e}"))?;
    ftruncate(&fd, size as u64).map_err(|e| format!("ftruncate({size}): {e}"))?;
    // SAFETY: a new shared mapping of our own memfd at an address the
    // kernel picks: it aliases no Rust memory.
    let ptr = unsafe {
        mmap(
            std::ptr::null_mut(),
            size,
            ProtFlags::READ | ProtFlags::WRITE,
            MapFlags::SHARED | MapFlags::POPULATE,
            &fd,
            0,
        )
    }
    .map_err(|e| format!("mmap({size}): {e}"))?;
    let addr = ptr as usize;
    HOST_ALLOCS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get_or_insert_with(HashMap::new)
        .insert(addr, HostAlloc { len: size, _fd: fd });
    Ok(addr)
}

fn host_free(addr: usize) -> bool {
    let a = HOST_ALLOCS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .as_mut()
        .and_then(|m| m.remove(&addr));
    match a {
        Some(a) => {
            // SAFETY: `addr..addr + len` is a mapping `host_alloc` made and
            // nobody else unmaps (it just left the table); the caller said
            // it is done with it (Mooncake's contract for `free`).
            if let Err(e) = unsafe { rustix::mm::munmap(addr as *mut _, a.len) } {
                tracing::warn!("munmap of host memory at {addr:#x}: {e}");
            }
            true
        }
        None => false,
    }
}

#[pymethods]
impl HostMemAllocator {
    #[new]
    fn new() -> Self {
        Self
    }

    /// Allocates `size` bytes of shareable host memory (a memfd, mapped
    /// shared and populated); returns its address. Failure raises
    /// RuntimeError.
    #[pyo3(signature = (size, /))]
    fn alloc(&self, py: Python<'_>, size: usize) -> PyResult<usize> {
        py.detach(|| host_alloc(size))
            .map_err(|e| PyRuntimeError::new_err(format!("MooncakeHostMemAllocator.alloc: {e}")))
    }

    /// Frees memory from `alloc`: 0, or -1 for an address it did not give.
    #[pyo3(signature = (ptr, /))]
    fn free(&self, py: Python<'_>, ptr: usize) -> i64 {
        if py.detach(|| host_free(ptr)) {
            0
        } else {
            -1
        }
    }
}

/// `InvalidParams` for a range that is not registered.
pub fn unregistered(addr: usize, len: usize) -> KvError {
    KvError::new(
        ErrorCode::InvalidParams,
        format!("{len} bytes at {addr:#x} are not inside a registered buffer"),
    )
}
