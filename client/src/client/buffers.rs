//! Memory handed to callers: buffers registered for transfers, caller memory
//! registered for zero-copy gets and puts, and read views on a pool's segment.

use super::*;

/// A zeroed buffer for a value of `len` bytes, the length a master named:
/// `ResourceExhausted` when no allocator can give it, never an abort (what
/// `vec![0; len]` does). The cluster's bound ([`crate::get::within_bound`])
/// comes from the master too, so this is what keeps a master that lies in
/// its map as well as its lists from ending the process. As cheap as
/// `vec![0; len]`: the allocator's zeroed pages, no second pass.
pub(super) fn zeroed(len: u64) -> Result<Vec<u8>, KvError> {
    let no = || {
        KvError::new(
            ErrorCode::ResourceExhausted,
            format!("no memory for a value of {len} bytes"),
        )
    };
    let len = usize::try_from(len).map_err(|_| no())?;
    if len == 0 {
        return Ok(Vec::new());
    }
    let layout = std::alloc::Layout::array::<u8>(len).map_err(|_| no())?;
    // SAFETY: the layout's size is not zero (checked above).
    let p = unsafe { std::alloc::alloc_zeroed(layout) };
    if p.is_null() {
        return Err(no());
    }
    // SAFETY: `p` comes from the global allocator with the layout of
    // `len` bytes at alignment 1 (what a Vec<u8> of capacity `len` frees
    // with), and all `len` bytes are initialized (zeroed).
    Ok(unsafe { Vec::from_raw_parts(p, len, len) })
}

/// Memory allocated by the client for transfers, from
/// [`Client::register_buffer`]. With RDMA on, it is registered with the NIC
/// (one memory region per device, held in the engine's MR cache for as long
/// as this value lives): puts from it and gets into it are zero copy. Without
/// RDMA it is ordinary memory that TCP and shared memory use as they use any
/// buffer; nothing is registered.
///
/// The buffer owns its memory. A transfer on it that was abandoned (its call
/// timed out or its future was dropped) may still have RDMA work in flight
/// for a moment; until that has completed, [`RegisteredBuffer::bytes`] and
/// [`RegisteredBuffer::bytes_mut`] answer `TryAgain` instead of handing out
/// bytes the NIC may be writing, and the memory is freed only after it.
pub struct RegisteredBuffer {
    pub(super) mem: BufferMem,
    pub(super) len: usize,
}

pub(super) enum BufferMem {
    Host(Box<[u8]>),
    Nic {
        buf: Arc<kvpool_transport::nic::RdmaBuffer>,
        reg: Arc<dyn kvpool_transport::nic::NicRegion>,
        nic: Arc<dyn kvpool_transport::nic::Nic>,
    },
}

impl RegisteredBuffer {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the NIC holds a memory region for this buffer (RDMA on).
    pub fn nic_registered(&self) -> bool {
        !matches!(self.mem, BufferMem::Host(_))
    }

    /// Whether an abandoned RDMA transfer may still touch the bytes. Every
    /// work request in flight holds the registration; besides those, this
    /// buffer and the MR cache hold it (the cache cannot drop an entry that
    /// is held elsewhere, and only this buffer's drop unregisters it).
    pub(super) fn busy(&self) -> bool {
        match &self.mem {
            BufferMem::Host(_) => false,
            BufferMem::Nic { reg, .. } => Arc::strong_count(reg) > 2,
        }
    }

    pub(super) fn check_idle(&self) -> Result<(), KvError> {
        if self.busy() {
            return Err(KvError::new(
                ErrorCode::TryAgain,
                "an abandoned RDMA transfer on this buffer is still in flight",
            ));
        }
        Ok(())
    }

    /// The buffer's bytes.
    pub fn bytes(&self) -> Result<&[u8], KvError> {
        self.check_idle()?;
        match &self.mem {
            BufferMem::Host(b) => Ok(b),
            // SAFETY: no transfer is in flight on the buffer (checked just
            // above; a new one needs `&mut self` or this `&self`, which the
            // returned slice borrows), so nothing writes it while it lives.
            BufferMem::Nic { buf, .. } => Ok(unsafe { buf.bytes(0, self.len) }),
        }
    }

    /// The buffer's bytes, writable.
    pub fn bytes_mut(&mut self) -> Result<&mut [u8], KvError> {
        self.check_idle()?;
        match &mut self.mem {
            BufferMem::Host(b) => Ok(b),
            // SAFETY: no transfer is in flight (checked above) and `&mut
            // self` keeps any other slice of the buffer from living.
            BufferMem::Nic { buf, .. } => Ok(unsafe { buf.bytes_mut(0, self.len) }),
        }
    }
}

impl Drop for RegisteredBuffer {
    fn drop(&mut self) {
        if let BufferMem::Nic { reg, nic, .. } = &self.mem {
            // The cache lets go; the registration (and the memory it owns)
            // goes when the last work request in flight does.
            nic.unregister(reg.addr(), reg.len());
        }
    }
}

impl std::fmt::Debug for RegisteredBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegisteredBuffer")
            .field("len", &self.len)
            .field("nic_registered", &self.nic_registered())
            .finish()
    }
}

/// Memory the caller owns, registered with this client for transfers
/// ([`Client::register_memory`]): with RDMA on, the NIC holds a memory region
/// for it and gets into it and puts from it are zero copy; without RDMA the
/// range is only recorded (TCP and shared memory read and write any memory
/// straight). Dropping it unregisters the range; the memory itself stays the
/// caller's.
pub struct MemoryRegistration {
    pub(super) addr: usize,
    pub(super) len: usize,
    pub(super) nic: Option<(
        Arc<dyn kvpool_transport::nic::NicRegion>,
        Arc<dyn kvpool_transport::nic::Nic>,
    )>,
}

impl MemoryRegistration {
    pub fn addr(&self) -> usize {
        self.addr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the NIC holds a memory region for the range (RDMA on).
    pub fn nic_registered(&self) -> bool {
        self.nic.is_some()
    }

    /// Whether `addr..addr + len` lies inside this range.
    pub fn covers(&self, addr: usize, len: usize) -> bool {
        addr >= self.addr
            && addr
                .checked_add(len)
                .is_some_and(|end| end <= self.addr + self.len)
    }
}

impl Drop for MemoryRegistration {
    fn drop(&mut self) {
        if let Some((reg, nic)) = self.nic.take() {
            // The cache lets go; the MRs go when the last work request
            // holding the registration does.
            nic.unregister(reg.addr(), reg.len());
        }
    }
}

impl std::fmt::Debug for MemoryRegistration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryRegistration")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("nic_registered", &self.nic_registered())
            .finish()
    }
}

/// A value in a same-host segment under a read lease: the mapping of each
/// same-host DRAM replica, valid while the lease lasts.
///
/// A view never hands out the shared memory as the value: anyone who can
/// write the segment (a writer behind the master's back, a bug) may change
/// it between a check and a use. [`ReadView::read_into`] copies the bytes
/// into the caller's memory and checks the copy against the object's
/// checksum, piece by piece as it is made; what it returns is what was put,
/// or `Corrupt`. It refuses once the lease has (nearly) ended.
pub struct ReadView {
    /// The same-host DRAM replicas that mapped, in the order a read tries
    /// them.
    pub(super) replicas: Vec<(Arc<ShmMap>, ReplicaDesc)>,
    pub(super) len: u64,
    pub(super) valid_until: Instant,
    /// The client's state: its engine checks (and counts) what is read.
    pub(super) client: Arc<Inner>,
}

impl ReadView {
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// When the lease (less a safety margin) ends.
    pub fn valid_until(&self) -> Instant {
        self.valid_until
    }

    pub(super) fn live(&self) -> Result<(), KvError> {
        if Instant::now() >= self.valid_until {
            return Err(KvError::new(
                ErrorCode::Timeout,
                "the view's read lease has ended: get a new view",
            ));
        }
        Ok(())
    }

    /// Copies the value into `dst` (exactly [`ReadView::len`] bytes) and
    /// checks the copy, not the shared memory, against the object's checksum
    /// (when this client checks checksums), trying each same-host replica in
    /// turn: `Ok` when `dst` holds the value that was put, `Corrupt` when no
    /// replica's copy matched (then `dst` holds other bytes: do not use
    /// them), `Timeout` once the lease has ended.
    pub fn read_into(&self, dst: &mut [u8]) -> Result<(), KvError> {
        if dst.len() as u64 != self.len {
            return Err(KvError::new(
                ErrorCode::InvalidParams,
                format!(
                    "a buffer of {} bytes for a value of {}",
                    dst.len(),
                    self.len
                ),
            ));
        }
        let engine = &self.client.engine;
        let mut corrupt = None;
        for (map, r) in &self.replicas {
            self.live()?;
            // The engine's own same-host read: a copy (hashed as it lands
            // in `dst` when checksums are on), then its check of the copy.
            let sum = if engine.config().verify_checksums {
                Some(map.read_into_summed(r.offset, dst)?)
            } else {
                map.read_into(r.offset, dst)?;
                None
            };
            match engine.verify(r, dst, sum) {
                Err(e) => corrupt = Some(e),
                Ok(()) => return Ok(()),
            }
        }
        Err(corrupt
            .unwrap_or_else(|| KvError::new(ErrorCode::Unavailable, "the view holds no replica")))
    }

    /// The value, copied and checked as [`ReadView::read_into`] does.
    pub fn read(&self) -> Result<Vec<u8>, KvError> {
        let mut v = zeroed(self.len)?;
        self.read_into(&mut v)?;
        Ok(v)
    }

    /// The first replica's bytes in the node's memory as they are now,
    /// unchecked: for tests and diagnostics that look at the memory itself.
    /// Never hand them on as the value (use [`ReadView::read_into`]).
    ///
    /// # Safety
    /// Nobody may write the range while the slice lives: the lease promises
    /// that only until [`ReadView::valid_until`], and a writer behind the
    /// master's back breaks it.
    pub unsafe fn unchecked_bytes(&self) -> Result<&[u8], KvError> {
        self.live()?;
        let (map, r) = self
            .replicas
            .first()
            .ok_or_else(|| KvError::new(ErrorCode::Unavailable, "the view holds no replica"))?;
        // SAFETY: the lease checked just above is live, the master does not
        // reuse the space of a leased object, and the caller promises that
        // nobody else writes it meanwhile.
        unsafe { map.bytes(r.offset, self.len) }
    }
}

impl std::fmt::Debug for ReadView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let at: Vec<String> = self
            .replicas
            .iter()
            .map(|(_, r)| format!("{:016x}@{}", r.segment_id, r.offset))
            .collect();
        f.debug_struct("ReadView")
            .field("replicas", &at)
            .field("len", &self.len)
            .field("valid_until", &self.valid_until)
            .finish()
    }
}
