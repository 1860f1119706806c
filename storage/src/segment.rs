//! A DRAM segment: the memory a storage node contributes to the pool.
//!
//! It is a memfd mapped shared, so that a reader on the same host can map the
//! same pages (the shm transport) and an RDMA NIC can register them. Pages are
//! committed lazily: an idle segment costs address space, not memory.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;

use rustix::fs::{ftruncate, memfd_create, MemfdFlags};
use rustix::mm::{mmap, munmap, Advice, MapFlags, ProtFlags};

use crate::StorageError;

/// Offsets and lengths inside a segment are multiples of this.
pub const SEGMENT_ALIGN: u64 = 64;

/// Upper bound on a segment's size (1 TiB): a guard against a typo that would
/// reserve the whole address space.
pub const MAX_SEGMENT_BYTES: u64 = 1 << 40;

/// A shared, memfd-backed memory segment.
pub struct Segment {
    fd: OwnedFd,
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: `Segment` owns a plain shared mapping; the pointer stays valid until
// drop and has no thread affinity. Who may touch which bytes is decided by the
// master's allocations (see `slice`/`slice_mut`), not by this type.
unsafe impl Send for Segment {}
// SAFETY: as above; shared access goes through the unsafe accessors, whose
// callers uphold the no-overlapping-writer rule.
unsafe impl Sync for Segment {}

impl Segment {
    /// Creates a zero-filled segment of `len` bytes (a multiple of
    /// [`SEGMENT_ALIGN`], at most [`MAX_SEGMENT_BYTES`]). With `prefault`, every
    /// page is committed now (start-up time and RSS up front) instead of at
    /// first write (a page fault on the data path).
    pub fn new_dram(name: &str, len: u64, prefault: bool) -> Result<Self, StorageError> {
        if len == 0 || !len.is_multiple_of(SEGMENT_ALIGN) || len > MAX_SEGMENT_BYTES {
            return Err(StorageError::InvalidSize(format!(
                "segment size {len} must be a non-zero multiple of {SEGMENT_ALIGN} up to {MAX_SEGMENT_BYTES}"
            )));
        }
        let fd = memfd_create(name, MemfdFlags::CLOEXEC)?;
        ftruncate(&fd, len)?;
        // SAFETY: a fresh shared mapping of the whole memfd; no existing memory
        // is aliased, the length equals the file size set just above.
        let raw = unsafe {
            mmap(
                std::ptr::null_mut(),
                len as usize,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED | MapFlags::NORESERVE,
                &fd,
                0,
            )?
        };
        // SAFETY: `raw` is the mapping made above, of exactly `len` bytes.
        // Transparent huge pages are a hint; a kernel without them refuses it.
        let _ = unsafe { rustix::mm::madvise(raw, len as usize, Advice::LinuxHugepage) };
        let ptr = NonNull::new(raw.cast::<u8>()).ok_or_else(|| {
            StorageError::Io(std::io::Error::other("mmap returned a null mapping"))
        })?;
        let seg = Self {
            fd,
            ptr,
            len: len as usize,
        };
        if prefault {
            seg.prefault()?;
        }
        Ok(seg)
    }

    fn prefault(&self) -> Result<(), StorageError> {
        // SAFETY: the whole mapping owned by `self`; populating pages does not
        // change their (zero) contents.
        let r = unsafe {
            rustix::mm::madvise(
                self.ptr.as_ptr().cast(),
                self.len,
                Advice::LinuxPopulateWrite,
            )
        };
        if r.is_err() {
            // Kernels before 5.14: touch one byte per page instead.
            let page = 4096;
            for off in (0..self.len).step_by(page) {
                // SAFETY: in bounds; nothing else uses the segment during
                // construction. A volatile write of the zero already there.
                unsafe { std::ptr::write_volatile(self.ptr.as_ptr().add(off), 0) };
            }
        }
        Ok(())
    }

    pub fn len(&self) -> u64 {
        self.len as u64
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The memfd behind the segment, for sharing with same-host readers.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Base address of the mapping (for RDMA registration).
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Checks that `offset..offset+len` lies inside the segment.
    pub fn check_range(&self, offset: u64, len: u64) -> Result<(), StorageError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len as u64 => Ok(()),
            _ => Err(StorageError::OutOfBounds {
                offset,
                len,
                size: self.len as u64,
            }),
        }
    }

    /// The bytes at `offset..offset+len`.
    ///
    /// # Safety
    /// The range must be inside the segment (see [`Segment::check_range`]) and
    /// no one may write it while the returned slice lives. The master
    /// guarantees the second for well-behaved clients: a range is read only
    /// under a lease or after `PutEnd`, and its space is not reused while any
    /// lease on it is live.
    pub unsafe fn slice(&self, offset: u64, len: u64) -> &[u8] {
        debug_assert!(self.check_range(offset, len).is_ok());
        // SAFETY: in bounds per the caller; the mapping lives as long as `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(offset as usize), len as usize) }
    }

    /// The bytes at `offset..offset+len`, writable.
    ///
    /// # Safety
    /// The range must be inside the segment, and no one else may read or write
    /// it while the returned slice lives. The master hands each range to one
    /// writer at a time (between `PutStart` and `PutEnd`).
    #[allow(clippy::mut_from_ref)] // interior mutability of shared memory, by contract above
    pub unsafe fn slice_mut(&self, offset: u64, len: u64) -> &mut [u8] {
        debug_assert!(self.check_range(offset, len).is_ok());
        // SAFETY: in bounds per the caller; exclusive per the caller's contract.
        unsafe {
            std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(offset as usize), len as usize)
        }
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: the mapping was created in `new_dram` with this address and
        // length, and no slice into it can outlive `self`.
        let _ = unsafe { munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

impl std::fmt::Debug for Segment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Segment").field("len", &self.len).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segment_is_zeroed_writable_and_bounds_checked() {
        let seg = Segment::new_dram("t", 1 << 20, false).unwrap();
        assert_eq!(seg.len(), 1 << 20);
        seg.check_range(0, 1 << 20).unwrap();
        assert!(seg.check_range(1, 1 << 20).is_err());
        assert!(seg.check_range(u64::MAX, 2).is_err());
        // SAFETY: in bounds; this test is the only user of the segment.
        unsafe {
            assert!(seg.slice(4096, 64).iter().all(|b| *b == 0));
            seg.slice_mut(4096, 3).copy_from_slice(b"abc");
            assert_eq!(seg.slice(4096, 3), b"abc");
        }
    }

    #[test]
    fn a_prefaulted_segment_is_zeroed_and_usable() {
        let seg = Segment::new_dram("t", 4 << 20, true).unwrap();
        // SAFETY: in bounds; this test is the only user of the segment.
        unsafe {
            assert!(seg.slice(0, 4 << 20).iter().all(|b| *b == 0));
            seg.slice_mut(1 << 20, 2).copy_from_slice(b"ok");
            assert_eq!(seg.slice(1 << 20, 2), b"ok");
        }
    }

    #[test]
    fn bad_sizes_are_refused() {
        assert!(Segment::new_dram("t", 0, false).is_err());
        assert!(Segment::new_dram("t", 100, false).is_err());
        assert!(Segment::new_dram("t", MAX_SEGMENT_BYTES + 64, false).is_err());
    }
}
