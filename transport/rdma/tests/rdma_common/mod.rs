//! Shared pieces of the RDMA tests: opening a context or skipping, a
//! memfd-backed "segment" like a storage node's, and a node that accepts
//! RDMA connections over a real TCP control connection with our rkyv frames.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::os::fd::OwnedFd;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvpool_rdma::{
    PassiveConnection, RdmaBuffer, RdmaConfig, RdmaConnection, RdmaContext, RdmaError, RdmaMemory,
    Registration,
};
use kvpool_wire::frame::{self, FrameKind};
use kvpool_wire::{KvError, RdmaRequest, RdmaResponse};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::compat::{Compat, TokioAsyncReadCompatExt};

pub const MAX_FRAME: u32 = 1 << 20;
pub const SEGMENT_ID: u64 = 0x5e6;

/// Opens RDMA with `cfg`, or says why the test is skipped. With
/// `RDMA_TESTS_REQUIRE_DEVICE=1` (the CI's guest run) a missing device fails
/// the test instead: a guest that lost its device must not pass silently.
pub fn open_or_skip(cfg: RdmaConfig, test: &str) -> Option<Arc<RdmaContext>> {
    match RdmaContext::open(cfg) {
        Ok(ctx) => Some(ctx),
        Err(RdmaError::NoDevice(reason)) => {
            if std::env::var("RDMA_TESTS_REQUIRE_DEVICE").as_deref() == Ok("1") {
                panic!("{test}: RDMA_TESTS_REQUIRE_DEVICE=1 but no RDMA device: {reason}");
            }
            println!("skip: no RDMA device ({reason}) [{test}]");
            None
        }
        Err(e) => panic!("{test}: opening RDMA failed: {e}"),
    }
}

/// A shared memfd mapping, as a storage node's DRAM segment is.
pub struct MemfdSegment {
    ptr: NonNull<u8>,
    len: usize,
    _fd: OwnedFd,
}

// SAFETY: owns a plain shared mapping.
unsafe impl Send for MemfdSegment {}
// SAFETY: access to the bytes goes through unsafe accessors with a contract.
unsafe impl Sync for MemfdSegment {}

impl MemfdSegment {
    pub fn new(len: usize) -> Self {
        use rustix::fs::{ftruncate, memfd_create, MemfdFlags};
        use rustix::mm::{mmap, MapFlags, ProtFlags};
        let fd = memfd_create("kvpool-rdma-test", MemfdFlags::CLOEXEC).expect("memfd");
        ftruncate(&fd, len as u64).expect("ftruncate");
        // SAFETY: a fresh shared mapping of the whole memfd.
        let p = unsafe {
            mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED | MapFlags::NORESERVE,
                &fd,
                0,
            )
        }
        .expect("mmap");
        Self {
            ptr: NonNull::new(p.cast()).expect("non-null mapping"),
            len,
            _fd: fd,
        }
    }

    /// # Safety
    /// No transfer may write these bytes while the slice lives.
    pub unsafe fn bytes(&self, off: usize, len: usize) -> &[u8] {
        assert!(off + len <= self.len);
        // SAFETY: in bounds; per the caller.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(off), len) }
    }

    /// # Safety
    /// No transfer may touch these bytes while the slice lives.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn bytes_mut(&self, off: usize, len: usize) -> &mut [u8] {
        assert!(off + len <= self.len);
        // SAFETY: in bounds; per the caller.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(off), len) }
    }
}

impl Drop for MemfdSegment {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`; registrations hold their owner,
        // so no MR covers it any more.
        let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

// SAFETY: the mapping is fixed and lives until drop.
unsafe impl RdmaMemory for MemfdSegment {
    fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    fn len(&self) -> usize {
        self.len
    }
}

/// A storage node stand-in: a registered memfd segment, and a TCP listener
/// that answers `RdmaRequest`s with our frames. Each control connection's
/// QPs live until it closes (or until `drop_connections`).
pub struct Node {
    pub addr: SocketAddr,
    pub ctx: Arc<RdmaContext>,
    pub segment: Arc<MemfdSegment>,
    pub region: Arc<Registration>,
    conns: Arc<Mutex<HashMap<u64, PassiveConnection>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Node {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Node {
    pub async fn start(ctx: Arc<RdmaContext>, segment_len: usize) -> Node {
        let segment = Arc::new(MemfdSegment::new(segment_len));
        let region = ctx.register(segment.clone()).expect("register the segment");
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let conns: Arc<Mutex<HashMap<u64, PassiveConnection>>> = Arc::default();
        let next = Arc::new(AtomicU64::new(0));
        let task = {
            let (ctx, region, conns) = (ctx.clone(), region.clone(), conns.clone());
            tokio::spawn(async move {
                loop {
                    let Ok((tcp, _)) = listener.accept().await else {
                        return;
                    };
                    let _ = tcp.set_nodelay(true);
                    let id = next.fetch_add(1, Ordering::Relaxed);
                    let (ctx, region, conns) = (ctx.clone(), region.clone(), conns.clone());
                    tokio::spawn(async move {
                        serve(tcp.compat(), id, ctx, region, conns.clone()).await;
                        // The control connection is gone: so are its QPs.
                        conns.lock().unwrap().remove(&id);
                    });
                }
            })
        };
        Node {
            addr,
            ctx,
            segment,
            region,
            conns,
            task,
        }
    }

    /// Drops every passive connection (destroys the node's QPs) while the
    /// control connections stay open: the peer is gone mid-transfer.
    pub fn drop_connections(&self) -> usize {
        let mut c = self.conns.lock().unwrap();
        let n = c.len();
        c.clear();
        n
    }

    /// Destroys lane `lane` of every live passive connection.
    pub fn destroy_lane(&self, lane: usize) {
        for c in self.conns.lock().unwrap().values_mut() {
            c.destroy_lane(lane);
        }
    }

    pub fn connections(&self) -> usize {
        self.conns.lock().unwrap().len()
    }
}

async fn serve(
    mut tcp: Compat<TcpStream>,
    id: u64,
    ctx: Arc<RdmaContext>,
    region: Arc<Registration>,
    conns: Arc<Mutex<HashMap<u64, PassiveConnection>>>,
) {
    loop {
        let (rid, req) = match frame::read_message::<RdmaRequest, _>(
            &mut tcp,
            FrameKind::DataRequest,
            MAX_FRAME,
        )
        .await
        {
            Ok(m) => m,
            Err(_) => return,
        };
        let out = match req {
            RdmaRequest::Caps => frame::encode(
                FrameKind::DataResponse,
                rid,
                &RdmaResponse::Caps(ctx.caps()),
            ),
            RdmaRequest::Connect(req) => match ctx.accept(&req, &region) {
                Ok((reply, passive)) => {
                    conns.lock().unwrap().insert(id, passive);
                    frame::encode(
                        FrameKind::DataResponse,
                        rid,
                        &RdmaResponse::Connected(reply),
                    )
                }
                Err(e) => frame::encode_error(rid, &KvError::from(e)),
            },
        };
        if frame::write_all(&mut tcp, &out).await.is_err() {
            return;
        }
    }
}

/// A client's control connection; the RDMA connection is valid while it is
/// open (the node tears its QPs down when it closes).
pub struct Control {
    pub tcp: Compat<TcpStream>,
}

/// Connects to `node` the way a client does: caps, then connect, over TCP.
pub async fn connect(ctx: &Arc<RdmaContext>, addr: SocketAddr) -> (RdmaConnection, Control) {
    let tcp = TcpStream::connect(addr).await.expect("tcp connect");
    let _ = tcp.set_nodelay(true);
    let mut tcp = tcp.compat();
    let caps = match ask(&mut tcp, 1, &RdmaRequest::Caps).await {
        Ok(RdmaResponse::Caps(c)) => c,
        other => panic!("caps: {other:?}"),
    };
    assert!(
        caps.is_available(),
        "node has no RDMA: {}",
        caps.unavailable_reason
    );
    let pending = ctx.connect(&caps, SEGMENT_ID).expect("create QPs");
    let reply = match ask(
        &mut tcp,
        2,
        &RdmaRequest::Connect(pending.request().clone()),
    )
    .await
    {
        Ok(RdmaResponse::Connected(r)) => r,
        other => panic!("connect: {other:?}"),
    };
    let conn = pending.complete(&reply).expect("QPs to RTS");
    (conn, Control { tcp })
}

pub async fn ask(
    tcp: &mut Compat<TcpStream>,
    id: u64,
    req: &RdmaRequest,
) -> Result<RdmaResponse, KvError> {
    frame::write_all(tcp, &frame::encode(FrameKind::DataRequest, id, req))
        .await
        .map_err(KvError::from)?;
    let (rid, resp) =
        frame::read_message::<RdmaResponse, _>(tcp, FrameKind::DataResponse, MAX_FRAME).await?;
    assert_eq!(rid, id);
    Ok(resp)
}

/// Deterministic bytes for `seed`.
pub fn fill(buf: &mut [u8], seed: u64) {
    let mut x = seed | 1;
    for chunk in buf.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let b = x.to_le_bytes();
        chunk.copy_from_slice(&b[..chunk.len()]);
    }
}

pub fn checksum(b: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(b)
}

pub fn buffer(ctx: &RdmaContext, len: usize) -> (Arc<RdmaBuffer>, Arc<Registration>) {
    let buf = Arc::new(RdmaBuffer::new(len));
    let reg = ctx.register(buf.clone()).expect("register buffer");
    (buf, reg)
}

pub fn secs(s: u64) -> Instant {
    Instant::now() + Duration::from_secs(s)
}
