//! CUDA device memory, through the driver API loaded at run time
//! (`libcuda.so.1`): a build needs no CUDA, and a machine without a driver
//! sees every address as host memory, exactly as before.
//!
//! What the module uses it for: telling a device pointer (vLLM's and
//! SGLang's KV caches, registered with `register_buffer`) from host memory,
//! and moving device bytes through pinned host staging buffers with
//! asynchronous copies on a stream of our own (docs/architecture/python.md, GPU memory).

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::{Mutex, OnceLock};

use kvpool_wire::{ErrorCode, KvError};

type CuResult = c_int;
type CuDevicePtr = u64;
type CuContext = *mut c_void;
type CuStream = *mut c_void;
type CuEvent = *mut c_void;

const CUDA_SUCCESS: CuResult = 0;
const POINTER_ATTRIBUTE_CONTEXT: c_int = 1;
const POINTER_ATTRIBUTE_MEMORY_TYPE: c_int = 2;
const POINTER_ATTRIBUTE_RANGE_START_ADDR: c_int = 11;
const POINTER_ATTRIBUTE_RANGE_SIZE: c_int = 12;
const MEMORYTYPE_DEVICE: c_uint = 2;
const MEMHOSTALLOC_PORTABLE: c_uint = 1;
const STREAM_NON_BLOCKING: c_uint = 1;
const EVENT_DISABLE_TIMING: c_uint = 2;

/// The driver calls the module makes, resolved once.
struct Driver {
    pointer_get_attribute: unsafe extern "C" fn(*mut c_void, c_int, CuDevicePtr) -> CuResult,
    ctx_push_current: unsafe extern "C" fn(CuContext) -> CuResult,
    ctx_pop_current: unsafe extern "C" fn(*mut CuContext) -> CuResult,
    mem_host_alloc: unsafe extern "C" fn(*mut *mut c_void, usize, c_uint) -> CuResult,
    mem_free_host: unsafe extern "C" fn(*mut c_void) -> CuResult,
    memcpy_async: unsafe extern "C" fn(CuDevicePtr, CuDevicePtr, usize, CuStream) -> CuResult,
    stream_create: unsafe extern "C" fn(*mut CuStream, c_uint) -> CuResult,
    stream_synchronize: unsafe extern "C" fn(CuStream) -> CuResult,
    stream_destroy: unsafe extern "C" fn(CuStream) -> CuResult,
    event_create: unsafe extern "C" fn(*mut CuEvent, c_uint) -> CuResult,
    event_record: unsafe extern "C" fn(CuEvent, CuStream) -> CuResult,
    event_synchronize: unsafe extern "C" fn(CuEvent) -> CuResult,
    event_destroy: unsafe extern "C" fn(CuEvent) -> CuResult,
    get_error_name: unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult,
    /// Keeps the library mapped for as long as the pointers above are used
    /// (the process's life: the driver is never unloaded).
    _lib: libloading::Library,
}

static DRIVER: OnceLock<Option<Driver>> = OnceLock::new();

/// The driver, loaded and initialised at first use; `None` where there is
/// none (no `libcuda.so.1`, or `cuInit` fails: no device, no permission).
fn driver() -> Option<&'static Driver> {
    DRIVER
        .get_or_init(|| match load() {
            Ok(d) => Some(d),
            Err(e) => {
                tracing::debug!("no CUDA driver: {e}");
                None
            }
        })
        .as_ref()
}

fn load() -> Result<Driver, String> {
    // SAFETY: loading the CUDA driver runs its initialisers, which have no
    // preconditions on the loading process.
    let lib = unsafe { libloading::Library::new("libcuda.so.1") }.map_err(|e| e.to_string())?;
    macro_rules! sym {
        ($name:literal) => {
            // SAFETY: the symbol is the driver API's function of that name,
            // whose C signature is the field's type (cuda.h, CUDA 11+; the
            // `_v2` names are the 64-bit ABI every driver since 4.0 exports).
            *unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                .map_err(|e| format!("{}: {e}", $name))?
        };
    }
    let init: unsafe extern "C" fn(c_uint) -> CuResult = sym!("cuInit");
    let d = Driver {
        pointer_get_attribute: sym!("cuPointerGetAttribute"),
        ctx_push_current: sym!("cuCtxPushCurrent_v2"),
        ctx_pop_current: sym!("cuCtxPopCurrent_v2"),
        mem_host_alloc: sym!("cuMemHostAlloc"),
        mem_free_host: sym!("cuMemFreeHost"),
        memcpy_async: sym!("cuMemcpyAsync"),
        stream_create: sym!("cuStreamCreate"),
        stream_synchronize: sym!("cuStreamSynchronize"),
        stream_destroy: sym!("cuStreamDestroy_v2"),
        event_create: sym!("cuEventCreate"),
        event_record: sym!("cuEventRecord"),
        event_synchronize: sym!("cuEventSynchronize"),
        event_destroy: sym!("cuEventDestroy_v2"),
        get_error_name: sym!("cuGetErrorName"),
        _lib: lib,
    };
    // SAFETY: cuInit takes flags (0) and may be called any number of times.
    let r = unsafe { init(0) };
    if r != CUDA_SUCCESS {
        return Err(format!("cuInit: {}", d.name(r)));
    }
    Ok(d)
}

impl Driver {
    fn name(&self, r: CuResult) -> String {
        let mut p: *const c_char = std::ptr::null();
        // SAFETY: cuGetErrorName writes a pointer to a static string (or
        // leaves it null for an unknown code).
        if unsafe { (self.get_error_name)(r, &mut p) } == CUDA_SUCCESS && !p.is_null() {
            // SAFETY: a NUL-terminated static string of the driver.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        } else {
            format!("CUresult {r}")
        }
    }

    fn check(&self, what: &str, r: CuResult) -> Result<(), KvError> {
        if r == CUDA_SUCCESS {
            Ok(())
        } else {
            Err(KvError::new(
                ErrorCode::Internal,
                format!("CUDA {what}: {}", self.name(r)),
            ))
        }
    }

    /// One attribute of a pointer, read into a `T` (the attribute's C type).
    fn attribute<T: Default>(&self, attr: c_int, addr: usize) -> Option<T> {
        let mut v = T::default();
        // SAFETY: `v` is a writable value of the attribute's type; the
        // driver reads nothing at `addr`, only its own tables.
        let r = unsafe {
            (self.pointer_get_attribute)(&mut v as *mut T as *mut c_void, attr, addr as u64)
        };
        (r == CUDA_SUCCESS).then_some(v)
    }
}

/// Device memory: the context that owns it.
#[derive(Clone, Copy, Debug)]
pub struct Device {
    ctx: usize,
}

/// What `addr..addr + len` is: `Ok(None)` host memory (or no driver),
/// `Ok(Some(_))` CUDA device memory, an error for a device range that runs
/// past its allocation's end.
pub fn classify(addr: usize, len: usize) -> Result<Option<Device>, KvError> {
    let Some(d) = driver() else {
        return Ok(None);
    };
    // Host memory the driver does not know answers CUDA_ERROR_INVALID_VALUE.
    match d.attribute::<c_uint>(POINTER_ATTRIBUTE_MEMORY_TYPE, addr) {
        Some(MEMORYTYPE_DEVICE) => {}
        _ => return Ok(None),
    }
    let start = d
        .attribute::<u64>(POINTER_ATTRIBUTE_RANGE_START_ADDR, addr)
        .unwrap_or(addr as u64);
    let size = d.attribute::<usize>(POINTER_ATTRIBUTE_RANGE_SIZE, addr);
    if let Some(size) = size {
        let end = start.saturating_add(size as u64);
        if (addr as u64).saturating_add(len as u64) > end {
            return Err(KvError::new(
                ErrorCode::InvalidParams,
                format!(
                    "{len} bytes at {addr:#x} run past the end of their CUDA allocation \
                     ({size} bytes at {start:#x})"
                ),
            ));
        }
    }
    let ctx = d
        .attribute::<usize>(POINTER_ATTRIBUTE_CONTEXT, addr)
        .ok_or_else(|| KvError::new(ErrorCode::Internal, "CUDA: no context for the pointer"))?;
    Ok(Some(Device { ctx }))
}

/// A device's context, current on this thread until dropped, with a
/// stream of our own for the copies.
pub struct Session {
    d: &'static Driver,
    stream: CuStream,
}

impl Session {
    /// Makes `dev`'s context current on the calling thread (pushed: the
    /// caller's own current context comes back at drop) and creates a
    /// non-blocking stream.
    pub fn open(dev: Device) -> Result<Self, KvError> {
        let d = driver().ok_or_else(|| KvError::new(ErrorCode::Internal, "CUDA: no driver"))?;
        // SAFETY: a context handle the driver returned for a live
        // allocation of the caller's (the caller keeps it registered).
        d.check("cuCtxPushCurrent", unsafe {
            (d.ctx_push_current)(dev.ctx as CuContext)
        })?;
        let mut stream: CuStream = std::ptr::null_mut();
        // SAFETY: writes a new stream handle of the current context.
        let r = unsafe { (d.stream_create)(&mut stream, STREAM_NON_BLOCKING) };
        if let Err(e) = d.check("cuStreamCreate", r) {
            let mut old: CuContext = std::ptr::null_mut();
            // SAFETY: undoes the push above.
            unsafe { (d.ctx_pop_current)(&mut old) };
            return Err(e);
        }
        Ok(Self { d, stream })
    }

    /// Queues a copy of `len` bytes from `src` to `dst` (any of host,
    /// pinned or device memory: the driver tells by the addresses).
    ///
    /// # Safety
    /// Both ranges stay valid, and `dst` untouched by anyone else, until a
    /// later [`Session::synchronize`] (or an event recorded after it) has
    /// returned.
    pub unsafe fn copy(&self, dst: usize, src: usize, len: usize) -> Result<(), KvError> {
        if len == 0 {
            return Ok(());
        }
        // SAFETY: per this function's contract; the stream is ours.
        let r = unsafe { (self.d.memcpy_async)(dst as u64, src as u64, len, self.stream) };
        self.d.check("cuMemcpyAsync", r)
    }

    /// An event that completes when every copy queued so far has.
    pub fn mark(&self) -> Result<Event, KvError> {
        let mut ev: CuEvent = std::ptr::null_mut();
        // SAFETY: writes a new event handle of the current context.
        self.d.check("cuEventCreate", unsafe {
            (self.d.event_create)(&mut ev, EVENT_DISABLE_TIMING)
        })?;
        let e = Event { d: self.d, ev };
        // SAFETY: both handles are live and of this context.
        self.d.check("cuEventRecord", unsafe {
            (self.d.event_record)(e.ev, self.stream)
        })?;
        Ok(e)
    }

    /// Waits until every queued copy is done.
    pub fn synchronize(&self) -> Result<(), KvError> {
        // SAFETY: our live stream.
        self.d.check("cuStreamSynchronize", unsafe {
            (self.d.stream_synchronize)(self.stream)
        })
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        // SAFETY: the stream is ours; destroying it lets queued work finish
        // first (the driver's rule). Then the push of `open` is undone.
        unsafe {
            (self.d.stream_synchronize)(self.stream);
            (self.d.stream_destroy)(self.stream);
            let mut old: CuContext = std::ptr::null_mut();
            (self.d.ctx_pop_current)(&mut old);
        }
    }
}

/// A point in a session's stream.
pub struct Event {
    d: &'static Driver,
    ev: CuEvent,
}

// SAFETY: an event handle may be waited on and destroyed from any thread
// (the driver's handles are thread-safe).
unsafe impl Send for Event {}

impl Event {
    /// Blocks the calling thread until the copies before the event are done.
    pub fn wait(&self) -> Result<(), KvError> {
        // SAFETY: our live event.
        self.d.check("cuEventSynchronize", unsafe {
            (self.d.event_synchronize)(self.ev)
        })
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: our event, destroyed once.
        unsafe { (self.d.event_destroy)(self.ev) };
    }
}

/// Page-locked host memory from the driver (the DMA engine reads and writes
/// it directly, so copies to and from the device are asynchronous and at
/// the link's speed).
pub struct Pinned {
    addr: usize,
    len: usize,
}

// SAFETY: plain memory owned by this value; freed once, from any thread.
unsafe impl Send for Pinned {}

impl Pinned {
    /// Needs a current context (a [`Session`] is open on this thread).
    fn alloc(len: usize) -> Result<Self, KvError> {
        let d = driver().ok_or_else(|| KvError::new(ErrorCode::Internal, "CUDA: no driver"))?;
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: writes the new allocation's address; portable, so any
        // context may copy through it.
        d.check("cuMemHostAlloc", unsafe {
            (d.mem_host_alloc)(&mut p, len, MEMHOSTALLOC_PORTABLE)
        })?;
        Ok(Self {
            addr: p as usize,
            len,
        })
    }

    pub fn addr(&self) -> usize {
        self.addr
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        if let Some(d) = driver() {
            // SAFETY: an allocation of cuMemHostAlloc, freed once, after
            // every copy through it was waited for (its users' rule).
            unsafe { (d.mem_free_host)(self.addr as *mut c_void) };
        }
    }
}

/// Pinned staging buffers kept between calls (allocating pinned memory
/// costs milliseconds), at most `cap` bytes of them.
pub struct StagingPool {
    free: Mutex<Vec<Pinned>>,
    cap: usize,
}

/// The smallest staging buffer allocated (small calls share one size).
const MIN_STAGING: usize = 4 << 20;

impl StagingPool {
    pub fn new(cap: usize) -> Self {
        Self {
            free: Mutex::new(Vec::new()),
            cap,
        }
    }

    /// A buffer of at least `len` bytes: a kept one, or a new one (needs a
    /// current context).
    pub fn take(&self, len: usize) -> Result<Pinned, KvError> {
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = free.iter().position(|b| b.len >= len) {
            return Ok(free.swap_remove(i));
        }
        drop(free);
        Pinned::alloc(len.max(MIN_STAGING).next_power_of_two())
    }

    /// Keeps `b` for later calls while the kept buffers fit the cap
    /// (smallest dropped first).
    pub fn give(&self, b: Pinned) {
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        free.push(b);
        free.sort_by_key(|b| std::cmp::Reverse(b.len));
        let mut kept = 0usize;
        free.retain(|b| {
            kept += b.len;
            kept <= self.cap
        });
    }
}
