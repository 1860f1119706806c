//! The shared-memory transport: same-host readers and writers map the
//! storage node's segment.
//!
//! ```text
//!  storage node                          client on the same host
//!  memfd segment                         connect("\0kvpool-shm-<segment id>")
//!  listens on the abstract unix socket
//!   challenge {magic, nonce}        ->
//!                                   <-   request {magic, segment id, grant}
//!                                         + proof (HMAC of the secret over the
//!                                         nonce, segment and grant; zeros in an
//!                                         open cluster)
//!   checks the proof and the grant
//!   (a live one the master signed
//!   for this segment)               ->   header {magic, segment id, size}
//!                                         + the memfd (SCM_RIGHTS)
//!                                        mmap(fd, size, shared)  -> memcpy in and out
//! ```
//!
//! The socket name is derived from the segment id, so a client needs nothing
//! beyond the replica descriptor. Abstract sockets live in the network
//! namespace: a client in another namespace (another container) fails to
//! connect and falls back to TCP, with a log line saying why. With a cluster
//! secret, a grant alone maps nothing: a local process that saw one (on the
//! wire, in a log) must also prove the secret, as on a data connection.

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use rustix::mm::{mmap, munmap, MapFlags, ProtFlags};
use rustix::net::{
    recvmsg, sendmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

use kvpool_wire::auth::{ClusterKey, Grant, NONCE_BYTES};
use kvpool_wire::error::{ErrorCode, KvError};
use kvpool_wire::proto::SegmentId;

const MAGIC: [u8; 4] = *b"KVSH";
const HEADER: usize = 20;
const REQUEST_MAGIC: [u8; 4] = *b"KVSQ";
/// magic, segment id, grant (op, offset, len, expires, mac, term).
const REQUEST: usize = 4 + 8 + 1 + 8 + 8 + 8 + 16 + 8;
/// The client's proof after its request ([`ClusterKey::shm_proof`]).
const PROOF: usize = 32;
const CHALLENGE_MAGIC: [u8; 4] = *b"KVSC";
/// magic, the node's nonce.
const CHALLENGE: usize = 4 + NONCE_BYTES;

/// What a client asked of a segment's socket (storage node side).
#[derive(Debug, Clone)]
pub struct ShmRequest {
    /// The segment it asks for.
    pub segment_id: SegmentId,
    /// The grant it shows.
    pub grant: Grant,
    /// Its proof of the secret over the node's nonce (zeros without one).
    pub proof: [u8; PROOF],
}

/// Sends the node's challenge to a client that connected (storage node
/// side): the nonce its proof must cover.
pub async fn send_challenge(
    stream: &mut tokio::net::UnixStream,
) -> std::io::Result<[u8; NONCE_BYTES]> {
    use tokio::io::AsyncWriteExt;
    let ns = kvpool_wire::auth::nonce();
    let mut b = [0u8; CHALLENGE];
    b[0..4].copy_from_slice(&CHALLENGE_MAGIC);
    b[4..].copy_from_slice(&ns);
    stream.write_all(&b).await?;
    Ok(ns)
}

/// Checks a request's proof against the node's nonce `ns`: any proof in an
/// open cluster (no `key`), the secret's otherwise.
pub fn check_proof(
    key: Option<&ClusterKey>,
    ns: &[u8; NONCE_BYTES],
    req: &ShmRequest,
) -> Result<(), KvError> {
    match key {
        Some(k) => k.verify_shm_proof(req.segment_id, ns, &req.grant, &req.proof),
        None => Ok(()),
    }
}

fn encode_request(segment_id: SegmentId, g: &Grant) -> [u8; REQUEST] {
    let mut b = [0u8; REQUEST];
    b[0..4].copy_from_slice(&REQUEST_MAGIC);
    b[4..12].copy_from_slice(&segment_id.to_le_bytes());
    b[12] = g.op;
    b[13..21].copy_from_slice(&g.offset.to_le_bytes());
    b[21..29].copy_from_slice(&g.len.to_le_bytes());
    b[29..37].copy_from_slice(&g.expires_ms.to_le_bytes());
    b[37..53].copy_from_slice(&g.mac);
    b[53..61].copy_from_slice(&g.term.to_le_bytes());
    b
}

/// Reads a client's request for a segment and its proof (storage node side).
pub async fn read_request(stream: &mut tokio::net::UnixStream) -> std::io::Result<ShmRequest> {
    use tokio::io::AsyncReadExt;
    let mut b = [0u8; REQUEST + PROOF];
    stream.read_exact(&mut b).await?;
    if b[0..4] != REQUEST_MAGIC {
        return Err(std::io::Error::other("not a kvpool shm request"));
    }
    let u = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
    let mut mac = [0u8; 16];
    mac.copy_from_slice(&b[37..53]);
    let mut proof = [0u8; PROOF];
    proof.copy_from_slice(&b[REQUEST..]);
    Ok(ShmRequest {
        segment_id: u(4),
        grant: Grant {
            op: b[12],
            offset: u(13),
            len: u(21),
            expires_ms: u(29),
            term: u(53),
            mac,
        },
        proof,
    })
}

/// Segment mappings open in this process (for leak checks).
static MAPPED: AtomicU64 = AtomicU64::new(0);

/// Shared-memory mappings currently open in this process.
pub fn open_mappings() -> u64 {
    MAPPED.load(Ordering::Relaxed)
}

/// The abstract socket name of a segment.
pub fn socket_name(segment_id: SegmentId) -> String {
    format!("kvpool-shm-{segment_id:016x}")
}

fn io_err(what: &str, e: impl std::fmt::Display) -> KvError {
    KvError::new(ErrorCode::Unavailable, format!("shm: {what}: {e}"))
}

/// Listens on the segment's abstract socket (storage node side).
pub fn listen(segment_id: SegmentId) -> std::io::Result<UnixListener> {
    let addr = SocketAddr::from_abstract_name(socket_name(segment_id).as_bytes())?;
    UnixListener::bind_addr(&addr)
}

/// Sends the segment's memfd to a client that connected (storage node side).
pub fn send_segment(
    stream: &UnixStream,
    segment_id: SegmentId,
    size: u64,
    fd: BorrowedFd<'_>,
) -> std::io::Result<()> {
    let mut head = [0u8; HEADER];
    head[0..4].copy_from_slice(&MAGIC);
    head[4..12].copy_from_slice(&segment_id.to_le_bytes());
    head[12..20].copy_from_slice(&size.to_le_bytes());
    let fds = [fd];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    control.push(SendAncillaryMessage::ScmRights(&fds));
    let n = sendmsg(
        stream,
        &[IoSlice::new(&head)],
        &mut control,
        SendFlags::empty(),
    )?;
    if n != HEADER {
        return Err(std::io::Error::other("short write of the shm header"));
    }
    Ok(())
}

/// A storage node's segment, mapped into this process.
pub struct ShmMap {
    ptr: NonNull<u8>,
    len: usize,
    segment_id: SegmentId,
    /// One bit per [`POPULATE_CHUNK`] of the mapping: set once its page
    /// tables were filled in one call (see [`ShmMap::populate`]).
    populated: Box<[AtomicU64]>,
    /// Chunks whose `madvise` succeeded.
    populated_ok: AtomicU64,
    _fd: OwnedFd,
}

/// The granularity at which a client fills its page tables for the segment:
/// the first copy into or out of a chunk maps the whole chunk in one
/// `madvise`, instead of one page fault per 4 KiB page during the copy.
pub const POPULATE_CHUNK: usize = 2 << 20;

// SAFETY: a plain shared mapping; the pointer is valid until drop on any
// thread. Which bytes may be touched is decided by the master's allocations
// and leases (see `read_into` / `write_from`).
unsafe impl Send for ShmMap {}
// SAFETY: as above; shared access goes through methods that copy bytes.
unsafe impl Sync for ShmMap {}

impl ShmMap {
    /// Connects to the segment's socket, shows `grant` (a grant the master
    /// issued for a range of this segment; empty in an open cluster) with
    /// its proof of the cluster secret `key` over the node's challenge,
    /// receives its memfd and maps it. Blocking (two local round trips);
    /// `timeout` bounds every wait.
    pub fn open(
        segment_id: SegmentId,
        grant: &Grant,
        key: Option<&ClusterKey>,
        timeout: Duration,
    ) -> Result<Self, KvError> {
        use std::io::{Read, Write};
        let addr = SocketAddr::from_abstract_name(socket_name(segment_id).as_bytes())
            .map_err(|e| io_err("socket name", e))?;
        let mut stream = UnixStream::connect_addr(&addr).map_err(|e| io_err("connect", e))?;
        stream
            .set_read_timeout(Some(timeout))
            .map_err(|e| io_err("set timeout", e))?;
        stream
            .set_write_timeout(Some(timeout))
            .map_err(|e| io_err("set timeout", e))?;
        let mut challenge = [0u8; CHALLENGE];
        stream
            .read_exact(&mut challenge)
            .map_err(|e| io_err("challenge", e))?;
        if challenge[0..4] != CHALLENGE_MAGIC {
            return Err(io_err("challenge", "not a kvpool shm socket"));
        }
        let mut ns = [0u8; NONCE_BYTES];
        ns.copy_from_slice(&challenge[4..]);
        let proof = key.map_or([0u8; PROOF], |k| k.shm_proof(segment_id, &ns, grant));
        let mut req = [0u8; REQUEST + PROOF];
        req[..REQUEST].copy_from_slice(&encode_request(segment_id, grant));
        req[REQUEST..].copy_from_slice(&proof);
        stream.write_all(&req).map_err(|e| io_err("request", e))?;
        let mut head = [0u8; HEADER];
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let msg = recvmsg(
            &stream,
            &mut [IoSliceMut::new(&mut head)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        )
        .map_err(|e| io_err("receive", e))?;
        let mut fd = None;
        for m in control.drain() {
            if let RecvAncillaryMessage::ScmRights(mut fds) = m {
                fd = fds.next();
            }
        }
        let fd = fd.ok_or_else(|| io_err("receive", "no file descriptor came"))?;
        if msg.bytes != HEADER || head[0..4] != MAGIC {
            return Err(io_err("receive", "bad header"));
        }
        let got_id = u64::from_le_bytes(head[4..12].try_into().expect("8 bytes"));
        let size = u64::from_le_bytes(head[12..20].try_into().expect("8 bytes"));
        if got_id != segment_id {
            return Err(KvError::new(
                ErrorCode::SegmentNotFound,
                format!("shm: asked for segment {segment_id:016x}, got {got_id:016x}"),
            ));
        }
        let stat = rustix::fs::fstat(&fd).map_err(|e| io_err("fstat", e))?;
        if stat.st_size as u64 != size || size == 0 {
            return Err(io_err(
                "map",
                format!("segment size {size} vs file {}", stat.st_size),
            ));
        }
        // SAFETY: a fresh shared mapping of the whole file, which is exactly
        // `size` bytes (checked with fstat); nothing else is aliased.
        let raw = unsafe {
            mmap(
                std::ptr::null_mut(),
                size as usize,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                fd.as_fd(),
                0,
            )
        }
        .map_err(|e| io_err("mmap", e))?;
        // SAFETY: `raw` is the mapping made above, of exactly `size` bytes.
        // A hint (as the node gives for its own mapping): where the host
        // lets shared memory use huge pages, this process's page tables for
        // the segment can map them too. A kernel without them refuses it.
        let _ =
            unsafe { rustix::mm::madvise(raw, size as usize, rustix::mm::Advice::LinuxHugepage) };
        let ptr = NonNull::new(raw.cast::<u8>()).ok_or_else(|| io_err("mmap", "null"))?;
        MAPPED.fetch_add(1, Ordering::Relaxed);
        let chunks = (size as usize).div_ceil(POPULATE_CHUNK);
        Ok(Self {
            ptr,
            len: size as usize,
            segment_id,
            populated: (0..chunks.div_ceil(64))
                .map(|_| AtomicU64::new(0))
                .collect(),
            populated_ok: AtomicU64::new(0),
            _fd: fd,
        })
    }

    pub fn segment_id(&self) -> SegmentId {
        self.segment_id
    }

    pub fn len(&self) -> u64 {
        self.len as u64
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn check(&self, offset: u64, len: u64) -> Result<(), KvError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len as u64 => Ok(()),
            _ => Err(KvError::new(
                ErrorCode::InvalidParams,
                format!(
                    "shm: {offset}+{len} is outside segment {:016x} of {} bytes",
                    self.segment_id, self.len
                ),
            )),
        }
    }

    /// Fills this process's page tables for the chunks that
    /// `offset..offset+len` touches and that no earlier copy filled: one
    /// `MADV_POPULATE_WRITE` per chunk (Linux 5.14), where the copy would
    /// otherwise take a page fault per 4 KiB page the first time (a mapping
    /// of a memfd starts with no page tables, even when the node's pages
    /// exist). Each chunk is populated at most once per mapping. A kernel
    /// without the call, or any failure, leaves the copy to fault as before:
    /// this only moves work, it never decides what is written.
    fn populate(&self, offset: u64, len: u64) {
        if len == 0 {
            return;
        }
        let first = offset as usize / POPULATE_CHUNK;
        let last = (offset + len - 1) as usize / POPULATE_CHUNK;
        for chunk in first..=last {
            let (word, bit) = (chunk / 64, 1u64 << (chunk % 64));
            if self.populated[word].fetch_or(bit, Ordering::Relaxed) & bit != 0 {
                continue;
            }
            let start = chunk * POPULATE_CHUNK;
            let n = POPULATE_CHUNK.min(self.len - start);
            // SAFETY: `start..start + n` lies inside this live mapping;
            // MADV_POPULATE_WRITE only faults pages in (as a write would,
            // without changing their contents), so no byte changes.
            let done = unsafe {
                rustix::mm::madvise(
                    self.ptr.as_ptr().add(start).cast(),
                    n,
                    rustix::mm::Advice::LinuxPopulateWrite,
                )
            };
            if done.is_ok() {
                self.populated_ok.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Fills the page tables of the whole mapping behind `map`, chunk by
    /// chunk, skipping chunks a copy filled already (a copy meanwhile fills
    /// or skips its own chunks the same way). Stops at the first chunk
    /// after the mapping's last owner let go (the segment forgotten, the
    /// client dropped), so it never keeps a mapping alive and a runtime
    /// shutting down waits for one chunk at most. Blocking: about a
    /// microsecond per 4 KiB page.
    pub fn populate_while_mapped(map: &std::sync::Weak<ShmMap>) {
        let mut at = 0;
        while let Some(m) = map.upgrade() {
            if at >= m.len {
                return;
            }
            let n = POPULATE_CHUNK.min(m.len - at);
            m.populate(at as u64, n as u64);
            at += n;
        }
    }

    /// Chunks of this mapping whose page tables were filled in one call,
    /// by a copy or by [`ShmMap::populate_while_mapped`] (a chunk whose
    /// call failed is not counted and not tried again: its copies fault
    /// page by page as without the fill).
    pub fn populated_chunks(&self) -> u64 {
        self.populated_ok.load(Ordering::Relaxed)
    }

    /// Copies `dst.len()` bytes at `offset` out of the segment.
    pub fn read_into(&self, offset: u64, dst: &mut [u8]) -> Result<(), KvError> {
        self.check(offset, dst.len() as u64)?;
        self.populate(offset, dst.len() as u64);
        // SAFETY: in bounds (checked); the master gave the caller a replica
        // list and a lease for this range, so no writer touches it meanwhile.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.as_ptr().add(offset as usize),
                dst.as_mut_ptr(),
                dst.len(),
            )
        };
        Ok(())
    }

    /// Copies `src` into the segment at `offset`.
    pub fn write_from(&self, offset: u64, src: &[u8]) -> Result<(), KvError> {
        self.check(offset, src.len() as u64)?;
        self.populate(offset, src.len() as u64);
        // SAFETY: in bounds (checked); the master allocated this range to this
        // writer alone (PutStart), and no reader is sent to it before PutEnd.
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.as_ptr(),
                self.ptr.as_ptr().add(offset as usize),
                src.len(),
            )
        };
        Ok(())
    }

    /// [`ShmMap::read_into`], and the checksum of the bytes read, each
    /// piece hashed right after it was copied ([`kvpool_wire::checksum::copy_and_sum`]).
    pub fn read_into_summed(&self, offset: u64, dst: &mut [u8]) -> Result<u64, KvError> {
        self.check(offset, dst.len() as u64)?;
        self.populate(offset, dst.len() as u64);
        // SAFETY: in bounds (checked); the lease keeps writers away from the
        // source (as in `read_into`); `dst` is ours, distinct from the
        // mapping, and it is the side hashed.
        Ok(unsafe {
            kvpool_wire::checksum::copy_and_sum(
                dst.as_mut_ptr(),
                self.ptr.as_ptr().add(offset as usize),
                dst.len(),
                kvpool_wire::checksum::Side::Dst,
            )
        })
    }

    /// [`ShmMap::write_from`], and the checksum of `src`, each piece hashed
    /// right after it was copied.
    pub fn write_from_summed(&self, offset: u64, src: &[u8]) -> Result<u64, KvError> {
        self.check(offset, src.len() as u64)?;
        self.populate(offset, src.len() as u64);
        // SAFETY: in bounds (checked); the range is this writer's alone (as
        // in `write_from`); `src` is a shared borrow, so it does not change,
        // and it is the side hashed.
        Ok(unsafe {
            kvpool_wire::checksum::copy_and_sum(
                self.ptr.as_ptr().add(offset as usize),
                src.as_ptr(),
                src.len(),
                kvpool_wire::checksum::Side::Src,
            )
        })
    }

    /// The bytes at `offset..offset+len`, borrowed.
    ///
    /// # Safety
    /// The caller must hold a live lease on the object at this range for as
    /// long as the slice lives: after the lease ends, the master may hand the
    /// space to a writer.
    pub unsafe fn bytes(&self, offset: u64, len: u64) -> Result<&[u8], KvError> {
        self.check(offset, len)?;
        self.populate(offset, len);
        // SAFETY: in bounds (checked); no writer while the lease holds (caller).
        Ok(unsafe {
            std::slice::from_raw_parts(self.ptr.as_ptr().add(offset as usize), len as usize)
        })
    }
}

impl Drop for ShmMap {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `open`, with this address and length; no
        // borrowed slice can outlive `self`.
        let _ = unsafe { munmap(self.ptr.as_ptr().cast(), self.len) };
        MAPPED.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The node's side of the exchange, before the segment: a challenge
    /// out, the request and its proof in.
    fn answer_challenge(s: &mut UnixStream) -> [u8; REQUEST + PROOF] {
        use std::io::{Read, Write};
        let mut c = [0u8; CHALLENGE];
        c[0..4].copy_from_slice(&CHALLENGE_MAGIC);
        s.write_all(&c).unwrap();
        let mut req = [0u8; REQUEST + PROOF];
        s.read_exact(&mut req).unwrap();
        req
    }

    #[test]
    fn a_memfd_passes_over_the_socket_and_both_sides_see_the_same_bytes() {
        let id = 0x5eed_0000_0000_0000 ^ std::process::id() as u64;
        let fd = rustix::fs::memfd_create("t", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&fd, 8192).unwrap();
        let listener = listen(id).unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let req = answer_challenge(&mut s);
            assert_eq!(req[0..4], REQUEST_MAGIC);
            assert_eq!(u64::from_le_bytes(req[4..12].try_into().unwrap()), id);
            send_segment(&s, id, 8192, fd.as_fd()).unwrap();
            fd
        });
        let a = ShmMap::open(id, &Grant::default(), None, Duration::from_secs(5)).unwrap();
        let fd = server.join().unwrap();
        assert_eq!(open_mappings(), 1);
        a.write_from(100, b"hello").unwrap();
        // The server's own view of the memfd sees the write.
        let mut buf = [0u8; 5];
        rustix::io::pread(&fd, &mut buf, 100).unwrap();
        assert_eq!(&buf, b"hello");
        let mut back = [0u8; 5];
        a.read_into(100, &mut back).unwrap();
        assert_eq!(&back, b"hello");
        assert!(
            a.read_into(8190, &mut [0u8; 5]).is_err(),
            "bounds are checked"
        );
        drop(a);
        assert_eq!(open_mappings(), 0);
    }

    #[test]
    fn each_chunk_is_populated_once_and_bytes_are_untouched() {
        // A segment of 2.5 chunks whose bytes the node wrote before any
        // client mapped it: populating must not change them.
        let id = 0x9091_0000_0000_0000 ^ std::process::id() as u64;
        let size = 2 * POPULATE_CHUNK + POPULATE_CHUNK / 2;
        let fd = rustix::fs::memfd_create("p", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&fd, size as u64).unwrap();
        let pattern: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
        rustix::io::pwrite(&fd, &pattern, 0).unwrap();
        let listener = listen(id).unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            answer_challenge(&mut s);
            send_segment(&s, id, size as u64, fd.as_fd()).unwrap();
            fd
        });
        let a = ShmMap::open(id, &Grant::default(), None, Duration::from_secs(5)).unwrap();
        let _fd = server.join().unwrap();
        let before = a.populated_chunks();
        // A read across the first two chunks populates both, once.
        let mut got = vec![0u8; 8192];
        let at = POPULATE_CHUNK - 4096;
        a.read_into(at as u64, &mut got).unwrap();
        assert_eq!(got, pattern[at..at + 8192]);
        let after_read = a.populated_chunks() - before;
        a.read_into(at as u64, &mut got).unwrap();
        a.write_from(0, b"x").unwrap();
        assert_eq!(a.populated_chunks() - before, after_read, "populated twice");
        // The short last chunk is populated within the mapping's end.
        a.write_from((size - 3) as u64, b"end").unwrap();
        let mut all = vec![0u8; size];
        a.read_into(0, &mut all).unwrap();
        let mut want = pattern.clone();
        want[0] = b'x';
        want[size - 3..].copy_from_slice(b"end");
        assert!(all == want, "populating changed bytes");
        // Where the kernel has MADV_POPULATE_WRITE, every chunk was filled
        // once; where it has not, none was and the copies faulted as before.
        let total = a.populated_chunks() - before;
        assert!(total == 3 || total == 0, "{total} chunks populated");
        assert_eq!(after_read, total / 3 * 2);
    }

    #[test]
    fn no_listener_is_unavailable() {
        let e = ShmMap::open(0xdead_beef, &Grant::default(), None, Duration::from_secs(1))
            .err()
            .expect("nobody serves this segment");
        assert_eq!(e.code, ErrorCode::Unavailable);
    }
}
