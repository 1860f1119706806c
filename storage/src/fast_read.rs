//! Small NVMe reads on an io_uring ring of the tier's own, with registered
//! (fixed) buffers, beside glommio's.
//!
//! glommio's `DmaFile` read path costs enough per I/O that one executor
//! reached 0.79 of fio's 4 KiB random-read IOPS at queue depth 32 before the
//! tier did any work of its own; a plain ring with `ReadFixed` reached 0.95
//! (docs/benchmarks/nvme-tier.md). Reads of up to [`SLOT_BYTES`] go here; larger ones
//! are bandwidth-bound and stay on glommio.
//!
//! Each read is submitted as soon as it is queued (one `io_uring_enter`
//! each), as fio does. Submitting the reads that one batch of completions
//! freed all together kept them in lock step on the (virtio) device: 32
//! requests in, 32 completions out at once, and 0.68 of fio's IOPS against
//! 0.75-0.85 submitted one by one, with no more CPU per read.
//!
//! * One ring per region, created on first use on the region's executor
//!   (not `Send`, like the region). [`SLOTS`] buffers of [`SLOT_BYTES`] in
//!   one anonymous mapping, registered with the ring: a read borrows a slot,
//!   its bytes are copied out when it completes, and the slot goes back.
//!   More readers than slots wait for one (the bound).
//! * A pump task on the executor reaps completions and wakes their readers.
//!   While reads are in flight it polls every [`POLL_EVERY`]; with none it
//!   parks. It also submits what a failed submit left queued (EAGAIN).
//!   Polling the ring every few microseconds instead of spinning measured
//!   the same IOPS and leaves the core to the shard's other work.
//! * A reader dropped mid-read leaves its slot in flight; the pump frees it
//!   when the completion arrives. The ring is dropped before the buffer
//!   mapping, and the kernel keeps registered pages pinned until the ring's
//!   requests are done, so a read never lands in freed memory.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::future::{poll_fn, Future};
use std::io;
use std::os::fd::AsRawFd;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Poll, Waker};
use std::time::Duration;

use glommio::io::DmaFile;
use io_uring::{opcode, types, IoUring};

/// Largest read served by the ring.
pub const SLOT_BYTES: usize = 16 << 10;
/// Reads in flight at once per region.
pub const SLOTS: usize = 64;
/// Submission queue entries (more than [`SLOTS`]: a push never fails).
const RING_ENTRIES: u32 = 128;
/// The pump's wait between polls of the ring while reads are in flight.
const POLL_EVERY: Duration = Duration::from_micros(20);

enum Slot {
    Free,
    InFlight {
        waker: Option<Waker>,
        abandoned: bool,
    },
    Done(i32),
}

/// The slot buffers: one anonymous mapping.
struct SlotMemory {
    ptr: *mut u8,
    len: usize,
}

impl SlotMemory {
    fn new(len: usize) -> io::Result<Self> {
        use rustix::mm::{mmap_anonymous, MapFlags, ProtFlags};
        // SAFETY: a new private anonymous mapping; nothing else refers to it.
        let ptr = unsafe {
            mmap_anonymous(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::PRIVATE,
            )
        }
        .map_err(io::Error::from)?;
        Ok(Self {
            ptr: ptr.cast(),
            len,
        })
    }

    fn slot_ptr(&self, slot: usize) -> *mut u8 {
        assert!(slot < SLOTS);
        // SAFETY: in bounds of the mapping (SLOTS * SLOT_BYTES bytes).
        unsafe { self.ptr.add(slot * SLOT_BYTES) }
    }
}

impl Drop for SlotMemory {
    fn drop(&mut self) {
        // SAFETY: our own mapping; the ring (dropped before this, see
        // `Inner`) no longer hands it to the kernel, and the kernel holds
        // its own pins on pages of requests it still finishes.
        let _ = unsafe { rustix::mm::munmap(self.ptr.cast(), self.len) };
    }
}

struct Inner {
    // Field order is drop order: the ring goes before the memory it reads
    // into and the file it reads from.
    ring: IoUring,
    mem: SlotMemory,
    file: Rc<DmaFile>,
    slots: Vec<Slot>,
    free: Vec<usize>,
    slot_waiters: VecDeque<Waker>,
    in_flight: usize,
    unsubmitted: bool,
    pump: Option<Waker>,
    pump_running: bool,
    closed: bool,
}

impl Inner {
    /// Frees `slot`; the wakers to call once the borrow of `self` ends
    /// (a woken task must be able to borrow it).
    #[must_use]
    fn release(&mut self, slot: usize) -> Vec<Waker> {
        self.slots[slot] = Slot::Free;
        self.free.push(slot);
        // Every waiter: one that was dropped while waiting must not swallow
        // the wake-up a live one needs; the losers queue again.
        self.slot_waiters.drain(..).collect()
    }

    fn submit(&mut self) {
        match self.ring.submit() {
            Ok(_) => self.unsubmitted = false,
            // EAGAIN/EBUSY: the kernel is short of resources; the SQEs stay
            // queued and the pump's next poll submits them.
            Err(e) => {
                self.unsubmitted = true;
                tracing::debug!("nvme fast read: submit: {e}");
            }
        }
    }

    /// Submits what is left queued and hands out what completed: the
    /// wakers to call once the borrow of `self` ends.
    fn poll_ring(&mut self) -> Vec<Waker> {
        if self.unsubmitted {
            self.submit();
        }
        let done: Vec<(usize, i32)> = self
            .ring
            .completion()
            .map(|c| (c.user_data() as usize, c.result()))
            .collect();
        let mut wake = Vec::new();
        for (slot, res) in done {
            self.in_flight -= 1;
            match std::mem::replace(&mut self.slots[slot], Slot::Done(res)) {
                Slot::InFlight {
                    abandoned: true, ..
                } => wake.extend(self.release(slot)),
                Slot::InFlight { waker, .. } => wake.extend(waker),
                Slot::Free | Slot::Done(_) => {
                    unreachable!("a completion for slot {slot}, which had no read")
                }
            }
        }
        wake
    }
}

/// A region's ring for small reads.
pub struct FastReader {
    inner: Rc<RefCell<Inner>>,
}

impl FastReader {
    /// A ring and its registered buffers for reads of `file`.
    pub fn new(file: Rc<DmaFile>) -> io::Result<Self> {
        let ring = IoUring::new(RING_ENTRIES)?;
        let mem = SlotMemory::new(SLOTS * SLOT_BYTES)?;
        let iovecs: Vec<libc::iovec> = (0..SLOTS)
            .map(|s| libc::iovec {
                iov_base: mem.slot_ptr(s).cast(),
                iov_len: SLOT_BYTES,
            })
            .collect();
        // SAFETY: the buffers lie in `mem`, which `Inner` keeps until after
        // the ring is dropped.
        unsafe { ring.submitter().register_buffers(&iovecs)? };
        Ok(Self {
            inner: Rc::new(RefCell::new(Inner {
                ring,
                mem,
                file,
                slots: (0..SLOTS).map(|_| Slot::Free).collect(),
                free: (0..SLOTS).rev().collect(),
                slot_waiters: VecDeque::new(),
                in_flight: 0,
                unsubmitted: false,
                pump: None,
                pump_running: false,
                closed: false,
            })),
        })
    }

    /// Reads `len` bytes (a multiple of 4 KiB, at most [`SLOT_BYTES`]) at
    /// `offset` (4 KiB-aligned) of the file.
    pub async fn read(&self, offset: u64, len: usize) -> io::Result<Vec<u8>> {
        assert!(len <= SLOT_BYTES && len.is_multiple_of(4096) && offset.is_multiple_of(4096));
        let slot = self.take_slot().await;
        let res = self.run(slot, offset, len).await;
        let mut g = self.inner.borrow_mut();
        let out = res.and_then(|n| {
            if n != len {
                return Err(io::Error::other(format!(
                    "short read at {offset}: {n} of {len} bytes"
                )));
            }
            // SAFETY: the read completed; the slot is ours until released.
            Ok(unsafe { std::slice::from_raw_parts(g.mem.slot_ptr(slot), len) }.to_vec())
        });
        let wake = g.release(slot);
        drop(g);
        wake.into_iter().for_each(Waker::wake);
        out
    }

    async fn take_slot(&self) -> usize {
        poll_fn(|cx| {
            let mut g = self.inner.borrow_mut();
            match g.free.pop() {
                Some(s) => Poll::Ready(s),
                None => {
                    g.slot_waiters.push_back(cx.waker().clone());
                    Poll::Pending
                }
            }
        })
        .await
    }

    /// Submits the read into `slot` (which the caller holds) and waits for
    /// it: the bytes read, or the error. The caller releases the slot after.
    async fn run(&self, slot: usize, offset: u64, len: usize) -> io::Result<usize> {
        let (spawn, wake_pump) = {
            let mut g = self.inner.borrow_mut();
            let fd = types::Fd(g.file.as_raw_fd());
            let sqe = opcode::ReadFixed::new(fd, g.mem.slot_ptr(slot), len as u32, slot as u16)
                .offset(offset)
                .build()
                .user_data(slot as u64);
            // SAFETY: the buffer is registered slot `slot`, which no one else
            // uses until its completion is reaped; the file stays open while
            // `Inner` (which the pump holds) lives.
            if unsafe { g.ring.submission().push(&sqe) }.is_err() {
                return Err(io::Error::other("nvme fast read: submission queue full"));
            }
            g.slots[slot] = Slot::InFlight {
                waker: None,
                abandoned: false,
            };
            // Only the pump reaps, so with nothing in flight it is parked
            // (or not yet started), never waiting on its timer.
            let pump_idle = g.in_flight == 0;
            g.in_flight += 1;
            g.submit();
            let spawn = !g.pump_running;
            g.pump_running = true;
            // A pump waiting on its timer reaps this in time; one parked
            // with nothing in flight, or one that must resubmit, is woken.
            let wake = if pump_idle || g.unsubmitted {
                g.pump.take()
            } else {
                None
            };
            (spawn, wake)
        };
        if spawn {
            glommio::spawn_local(pump(self.inner.clone())).detach();
        }
        if let Some(w) = wake_pump {
            w.wake();
        }
        let mut guard = Abandon {
            inner: &self.inner,
            slot,
            armed: true,
        };
        let res = poll_fn(|cx| {
            let mut g = self.inner.borrow_mut();
            match &mut g.slots[slot] {
                Slot::Done(r) => Poll::Ready(*r),
                Slot::InFlight { waker, .. } => {
                    *waker = Some(cx.waker().clone());
                    Poll::Pending
                }
                Slot::Free => unreachable!("slot {slot} freed while its reader waits"),
            }
        })
        .await;
        guard.armed = false;
        if res < 0 {
            Err(io::Error::from_raw_os_error(-res))
        } else {
            Ok(res as usize)
        }
    }
}

impl Drop for FastReader {
    fn drop(&mut self) {
        let pump = {
            let mut g = self.inner.borrow_mut();
            g.closed = true;
            g.pump.take()
        };
        if let Some(w) = pump {
            w.wake();
        }
    }
}

/// Marks a reader's slot abandoned if the reader is dropped mid-read.
struct Abandon<'a> {
    inner: &'a Rc<RefCell<Inner>>,
    slot: usize,
    armed: bool,
}

impl Drop for Abandon<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let wake = {
            let mut g = self.inner.borrow_mut();
            match &mut g.slots[self.slot] {
                Slot::InFlight { abandoned, .. } => {
                    *abandoned = true;
                    Vec::new()
                }
                Slot::Done(_) => g.release(self.slot),
                Slot::Free => Vec::new(),
            }
        };
        wake.into_iter().for_each(Waker::wake);
    }
}

async fn pump(inner: Rc<RefCell<Inner>>) {
    loop {
        let (in_flight, wake) = {
            let mut g = inner.borrow_mut();
            let wake = g.poll_ring();
            (g.in_flight, wake)
        };
        wake.into_iter().for_each(Waker::wake);
        if in_flight == 0 {
            let stop = poll_fn(|cx| {
                let mut g = inner.borrow_mut();
                if g.in_flight > 0 || g.unsubmitted {
                    Poll::Ready(false)
                } else if g.closed {
                    g.pump_running = false;
                    Poll::Ready(true)
                } else {
                    g.pump = Some(cx.waker().clone());
                    Poll::Pending
                }
            })
            .await;
            if stop {
                return;
            }
            continue;
        }
        // Wait, unless something is left to submit.
        let mut timer = glommio::timer::Timer::new(POLL_EVERY);
        poll_fn(|cx| {
            if Pin::new(&mut timer).poll(cx).is_ready() {
                return Poll::Ready(());
            }
            let mut g = inner.borrow_mut();
            if g.unsubmitted {
                return Poll::Ready(());
            }
            g.pump = Some(cx.waker().clone());
            Poll::Pending
        })
        .await;
        inner.borrow_mut().pump = None;
    }
}
