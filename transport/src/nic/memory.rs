//! Memory the NIC may touch, as the rest of kvpool hands it over: owners of
//! fixed ranges. Registering them is `kvpool-rdma`'s.
//!
//! * [`RdmaMemory`] is anything that owns a fixed range of memory (a storage
//!   node's memfd segment, a client's [`RdmaBuffer`], or a caller-vouched
//!   [`RawMemory`]).

use std::alloc::{self, Layout};
use std::ptr::NonNull;

/// Memory that can be registered with a NIC.
///
/// # Safety
/// `as_ptr()..as_ptr()+len()` must be mapped, writable memory that stays
/// valid, at the same address, for as long as the value lives, and that
/// nothing frees or remaps behind the value's back. The NIC reads and writes
/// it by DMA while the value is registered; who may touch which bytes when is
/// the caller's protocol (a request's bytes are the NIC's until the request
/// reports a final status).
pub unsafe trait RdmaMemory: Send + Sync + 'static {
    fn as_ptr(&self) -> *mut u8;
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A page-aligned, zero-filled heap buffer for RDMA.
pub struct RdmaBuffer {
    ptr: NonNull<u8>,
    len: usize,
}

const PAGE: usize = 4096;

// SAFETY: the buffer owns its allocation; the pointer has no thread affinity.
unsafe impl Send for RdmaBuffer {}
// SAFETY: shared access to the bytes goes through the unsafe accessors,
// whose callers uphold the no-concurrent-writer rule.
unsafe impl Sync for RdmaBuffer {}

impl RdmaBuffer {
    /// A zeroed buffer of `len` bytes (at least one page is allocated).
    pub fn new(len: usize) -> Self {
        let layout = Self::layout(len);
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).unwrap_or_else(|| alloc::handle_alloc_error(layout));
        Self { ptr, len }
    }

    fn layout(len: usize) -> Layout {
        Layout::from_size_align(len.max(1).next_multiple_of(PAGE), PAGE)
            .expect("buffer size fits a layout")
    }

    /// `len` bytes at `offset`.
    ///
    /// # Safety
    /// No transfer that writes these bytes (an RDMA READ into them) may be in
    /// flight, and no one may write them through [`RdmaBuffer::bytes_mut`]
    /// while the slice lives.
    pub unsafe fn bytes(&self, offset: usize, len: usize) -> &[u8] {
        assert!(
            offset.checked_add(len).is_some_and(|e| e <= self.len),
            "range {offset}+{len} outside a {}-byte buffer",
            self.len
        );
        // SAFETY: in bounds (asserted); the allocation is initialised;
        // exclusivity per the caller.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(offset), len) }
    }

    /// `len` bytes at `offset`, writable.
    ///
    /// # Safety
    /// No transfer may be in flight on these bytes, and no other slice of
    /// them may live while this one does.
    #[allow(clippy::mut_from_ref)] // shared memory with an explicit protocol, see above
    pub unsafe fn bytes_mut(&self, offset: usize, len: usize) -> &mut [u8] {
        assert!(
            offset.checked_add(len).is_some_and(|e| e <= self.len),
            "range {offset}+{len} outside a {}-byte buffer",
            self.len
        );
        // SAFETY: in bounds (asserted); exclusive per the caller.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(offset), len) }
    }
}

impl Drop for RdmaBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout. A registration keeps
        // its owner alive, so no MR covers the memory any more.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.len)) };
    }
}

// SAFETY: the allocation is fixed and lives until drop.
unsafe impl RdmaMemory for RdmaBuffer {
    fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    fn len(&self) -> usize {
        self.len
    }
}

impl std::fmt::Debug for RdmaBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaBuffer")
            .field("len", &self.len)
            .finish()
    }
}

/// Memory owned elsewhere, vouched for by the caller (a mapping whose owner
/// is not a Rust value this crate knows, such as a storage node's segment
/// kept alive by the node, or a user buffer registered through the client).
#[derive(Debug)]
pub struct RawMemory {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a plain address range; validity is the constructor's contract.
unsafe impl Send for RawMemory {}
// SAFETY: as above.
unsafe impl Sync for RawMemory {}

impl RawMemory {
    /// # Safety
    /// The range must satisfy [`RdmaMemory`]'s contract for as long as any
    /// registration made from this value lives (the registration can outlive
    /// the caller's handles while work requests use it; keep the memory until
    /// `RdmaContext::unregister` and every connection using it are gone).
    pub unsafe fn new(ptr: *mut u8, len: usize) -> Option<Self> {
        Some(Self {
            ptr: NonNull::new(ptr)?,
            len,
        })
    }
}

// SAFETY: per the constructor's contract.
unsafe impl RdmaMemory for RawMemory {
    fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    fn len(&self) -> usize {
        self.len
    }
}
