//! Framing of control messages.
//!
//! ```text
//!  0      4    5     6       8            16     20         24
//!  +------+----+-----+-------+------------+------+----------+--------------+
//!  | KVPL | v1 | kind| flags | request_id | len  | reserved | payload ...  |
//!  +------+----+-----+-------+------------+------+----------+--------------+
//!    magic  u8   u8    u16 LE    u64 LE    u32 LE  u32 (0)    len bytes (rkyv)
//! ```
//!
//! The payload is read into a 16-byte-aligned buffer and validated with
//! bytecheck before anything looks at it: a frame from the network is
//! untrusted input. Bad magic, an unknown version or kind, a length over the
//! configured maximum, or a payload that fails validation is a [`FrameError`];
//! servers answer it with an error frame and close the connection.
//! Writers set `flags` and `reserved` to zero; readers ignore them.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use futures_lite::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use rkyv::api::high::{HighDeserializer, HighSerializer, HighValidator};
use rkyv::bytecheck::CheckBytes;
use rkyv::rancor;
use rkyv::ser::allocator::ArenaHandle;
pub use rkyv::util::AlignedVec;
use rkyv::{Archive, Deserialize, Serialize};

use crate::error::{ErrorCode, KvError};
use crate::proto::WireError;

pub const MAGIC: [u8; 4] = *b"KVPL";
/// 2: checksums, grants, the auth handshake, Ping's segments (issue 12).
/// 3: `PutOptions::replace` (the atomic replace), `RemoveAll`'s `force` (issue 16).
/// 4: what changed after 3 without a bump: a put's `put_id`, log shipping
/// (`Follow`, `Shipped`), data connections' proof of the secret, hot
/// replicas' fetch tasks, `ClusterMap::max_batch`.
/// 5: copy versions in `Persist`, `Drop`, `Stored`, `Evicted`, `Recovered`.
/// 6: each `NodeTask` variant holds a struct (`PersistTask`, `PromoteTask`,
/// `DropTask`, `FetchTask`): the archived layout changed.
/// 7: `PromoteTask::version`.
/// 8: `DataRequest::ReadNvme::key`.
/// 9: `ClusterMap::max_value_bytes`.
pub const VERSION: u8 = 9;
pub const HEADER_LEN: usize = 24;

/// What a frame's payload is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameKind {
    MasterRequest = 1,
    MasterResponse = 2,
    DataRequest = 3,
    DataResponse = 4,
    /// Payload is a [`WireError`].
    Error = 15,
}

impl FrameKind {
    fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            1 => Self::MasterRequest,
            2 => Self::MasterResponse,
            3 => Self::DataRequest,
            4 => Self::DataResponse,
            15 => Self::Error,
            _ => return None,
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    pub kind: FrameKind,
    pub request_id: u64,
    pub len: u32,
}

impl FrameHeader {
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4] = VERSION;
        b[5] = self.kind as u8;
        // b[6..8]: flags, zero.
        b[8..16].copy_from_slice(&self.request_id.to_le_bytes());
        b[16..20].copy_from_slice(&self.len.to_le_bytes());
        // b[20..24]: reserved, zero.
        b
    }

    /// Parses and checks a header against the maximum payload length.
    pub fn decode(b: &[u8; HEADER_LEN], max_len: u32) -> Result<Self, FrameError> {
        if b[0..4] != MAGIC {
            return Err(FrameError::BadMagic([b[0], b[1], b[2], b[3]]));
        }
        if b[4] != VERSION {
            return Err(FrameError::BadVersion(b[4]));
        }
        let kind = FrameKind::from_u8(b[5]).ok_or(FrameError::BadKind(b[5]))?;
        let request_id = u64::from_le_bytes(b[8..16].try_into().expect("8 bytes"));
        let len = u32::from_le_bytes(b[16..20].try_into().expect("4 bytes"));
        if len > max_len {
            return Err(FrameError::TooLarge { len, max: max_len });
        }
        Ok(Self {
            kind,
            request_id,
            len,
        })
    }
}

/// Why a frame was refused.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("bad magic {0:02x?}: not a kvpool peer")]
    BadMagic([u8; 4]),
    #[error("unsupported protocol version {0} (this peer speaks {VERSION})")]
    BadVersion(u8),
    #[error("unknown frame kind {0}")]
    BadKind(u8),
    #[error("frame payload of {len} bytes exceeds the maximum of {max}")]
    TooLarge { len: u32, max: u32 },
    #[error("frame payload failed validation: {0}")]
    Invalid(String),
    #[error("expected a {expected:?} frame, got {got:?}")]
    UnexpectedKind { expected: FrameKind, got: FrameKind },
    #[error("connection closed")]
    Closed,
    /// The process's memory for frames being read is spent.
    #[error("{0}")]
    Exhausted(String),
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
}

impl FrameError {
    /// The error code a peer reports for this failure.
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::BadMagic(_) | Self::Invalid(_) | Self::UnexpectedKind { .. } => {
                ErrorCode::Malformed
            }
            Self::BadVersion(_) | Self::BadKind(_) => ErrorCode::Unsupported,
            Self::TooLarge { .. } => ErrorCode::TooLarge,
            Self::Exhausted(_) => ErrorCode::ResourceExhausted,
            Self::Closed => ErrorCode::Unavailable,
            Self::Io(e) => KvError::from(std::io::Error::new(e.kind(), "")).code,
        }
    }

    /// True when the peer is gone (no point in answering).
    pub fn is_disconnect(&self) -> bool {
        match self {
            Self::Closed => true,
            Self::Io(e) => matches!(
                e.kind(),
                std::io::ErrorKind::UnexpectedEof
                    | std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::BrokenPipe
                    | std::io::ErrorKind::ConnectionAborted
            ),
            _ => false,
        }
    }
}

impl From<FrameError> for KvError {
    fn from(e: FrameError) -> Self {
        KvError::new(e.code(), e.to_string())
    }
}

/// Types that can be a frame payload: rkyv-serializable, and checkable with
/// bytecheck before deserialization.
pub trait Payload:
    Archive + for<'a> Serialize<HighSerializer<AlignedVec, ArenaHandle<'a>, rancor::Error>> + Sized
{
    /// Validates `bytes` (bytecheck) and deserializes them.
    fn decode_from(bytes: &[u8]) -> Result<Self, FrameError>;
}

impl<T> Payload for T
where
    T: Archive + for<'a> Serialize<HighSerializer<AlignedVec, ArenaHandle<'a>, rancor::Error>>,
    T::Archived: for<'a> CheckBytes<HighValidator<'a, rancor::Error>>
        + Deserialize<T, HighDeserializer<rancor::Error>>,
{
    fn decode_from(bytes: &[u8]) -> Result<Self, FrameError> {
        rkyv::from_bytes::<T, rancor::Error>(bytes).map_err(|e| FrameError::Invalid(e.to_string()))
    }
}

/// Encodes header + payload into one buffer, ready for a single write.
pub fn encode<T: Payload>(kind: FrameKind, request_id: u64, msg: &T) -> Vec<u8> {
    // Serializing our own in-memory types into a growable buffer cannot fail.
    let payload = rkyv::to_bytes::<rancor::Error>(msg).expect("rkyv serialization of a message");
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    out.extend_from_slice(
        &FrameHeader {
            kind,
            request_id,
            len: payload.len() as u32,
        }
        .encode(),
    );
    out.extend_from_slice(&payload);
    out
}

/// Validates a payload (bytecheck) and deserializes it.
pub fn decode<T: Payload>(payload: &AlignedVec) -> Result<T, FrameError> {
    T::decode_from(payload)
}

/// Reads one header. A clean close before the first byte is `Closed`.
pub async fn read_header<R: AsyncRead + Unpin>(
    r: &mut R,
    max_len: u32,
) -> Result<FrameHeader, FrameError> {
    let mut b = [0u8; HEADER_LEN];
    let mut got = 0;
    while got < HEADER_LEN {
        let n = r.read(&mut b[got..]).await?;
        if n == 0 {
            return Err(if got == 0 {
                FrameError::Closed
            } else {
                FrameError::Io(std::io::ErrorKind::UnexpectedEof.into())
            });
        }
        got += n;
    }
    FrameHeader::decode(&b, max_len)
}

/// The first step of a payload buffer; it then doubles with what arrived.
const GROW_FROM: usize = 64 << 10;

/// Memory for control frames being read, shared by every connection of a
/// process: a frame's buffer grows as its bytes arrive (never to the length
/// its header announces before they do), and each step is taken from this
/// budget. A frame that finds it spent is refused with `ResourceExhausted`.
#[derive(Debug)]
pub struct FrameBudget {
    used: AtomicU64,
    max: u64,
}

impl FrameBudget {
    pub fn new(max_bytes: u64) -> Arc<Self> {
        Arc::new(Self {
            used: AtomicU64::new(0),
            max: max_bytes,
        })
    }

    /// Bytes taken now.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    fn take(self: &Arc<Self>, n: u64, held: &mut Reservation) -> Result<(), FrameError> {
        let mut cur = self.used.load(Ordering::Relaxed);
        loop {
            let next = cur.saturating_add(n);
            if next > self.max {
                return Err(FrameError::Exhausted(format!(
                    "frames being read hold {cur} bytes of the process's {} (frame memory limit)",
                    self.max
                )));
            }
            match self
                .used
                .compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => break,
                Err(now) => cur = now,
            }
        }
        held.bytes += n;
        Ok(())
    }
}

/// Bytes a frame holds of a [`FrameBudget`]; given back on drop.
#[derive(Debug)]
pub struct Reservation {
    budget: Option<Arc<FrameBudget>>,
    bytes: u64,
}

impl Reservation {
    /// A reservation of nothing (frames read without a budget).
    pub fn none() -> Self {
        Self {
            budget: None,
            bytes: 0,
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if let Some(b) = &self.budget {
            b.used.fetch_sub(self.bytes, Ordering::AcqRel);
        }
    }
}

/// Reads the payload announced by `hdr` into an aligned buffer that grows
/// as bytes arrive (a peer that announces a large frame and sends little
/// pins little memory).
pub async fn read_payload<R: AsyncRead + Unpin>(
    r: &mut R,
    hdr: &FrameHeader,
) -> Result<AlignedVec, FrameError> {
    let mut held = Reservation::none();
    read_payload_into(r, hdr, None, &mut held).await
}

/// Like [`read_payload`], taking every step of the buffer's growth from
/// `budget`; the returned reservation holds it until dropped.
pub async fn read_payload_budgeted<R: AsyncRead + Unpin>(
    r: &mut R,
    hdr: &FrameHeader,
    budget: &Arc<FrameBudget>,
) -> Result<(AlignedVec, Reservation), FrameError> {
    let mut held = Reservation {
        budget: Some(budget.clone()),
        bytes: 0,
    };
    let buf = read_payload_into(r, hdr, Some(budget), &mut held).await?;
    Ok((buf, held))
}

async fn read_payload_into<R: AsyncRead + Unpin>(
    r: &mut R,
    hdr: &FrameHeader,
    budget: Option<&Arc<FrameBudget>>,
    held: &mut Reservation,
) -> Result<AlignedVec, FrameError> {
    let len = hdr.len as usize;
    let mut buf = AlignedVec::<16>::new();
    let mut got = 0;
    while got < len {
        let step = (len - got).min(got.max(GROW_FROM));
        if let Some(b) = budget {
            b.take(step as u64, held)?;
        }
        buf.resize(got + step, 0);
        r.read_exact(&mut buf[got..got + step]).await?;
        got += step;
    }
    Ok(buf)
}

/// Reads a whole frame (header and payload).
pub async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
    max_len: u32,
) -> Result<(FrameHeader, AlignedVec), FrameError> {
    let hdr = read_header(r, max_len).await?;
    let payload = read_payload(r, &hdr).await?;
    Ok((hdr, payload))
}

/// Reads a frame and decodes it as `T` if its kind is `kind`, or turns an
/// error frame into the `KvError` it carries.
pub async fn read_message<T: Payload, R: AsyncRead + Unpin>(
    r: &mut R,
    kind: FrameKind,
    max_len: u32,
) -> Result<(u64, T), KvError> {
    let (id, answer) = read_reply(r, kind, max_len).await?;
    Ok((id, answer?))
}

/// Reads a reply frame: the outer error is a transport failure (the
/// connection is unusable), the inner one is the peer's answer (an error
/// frame; the connection is fine).
pub async fn read_reply<T: Payload, R: AsyncRead + Unpin>(
    r: &mut R,
    kind: FrameKind,
    max_len: u32,
) -> Result<(u64, Result<T, KvError>), FrameError> {
    let (hdr, payload) = read_frame(r, max_len).await?;
    match hdr.kind {
        k if k == kind => Ok((hdr.request_id, Ok(decode::<T>(&payload)?))),
        FrameKind::Error => {
            let e: WireError = decode(&payload)?;
            Ok((hdr.request_id, Err(e.into())))
        }
        got => Err(FrameError::UnexpectedKind {
            expected: kind,
            got,
        }),
    }
}

/// Writes a whole buffer (an encoded frame, or payload bytes).
pub async fn write_all<W: AsyncWrite + Unpin>(w: &mut W, buf: &[u8]) -> Result<(), FrameError> {
    w.write_all(buf).await?;
    Ok(())
}

/// Encodes an error frame.
pub fn encode_error(request_id: u64, err: &KvError) -> Vec<u8> {
    encode(FrameKind::Error, request_id, &WireError::from(err))
}

/// The answer to request `want`, as the outer result (the connection can
/// be used again) or an outer error (it cannot). An error frame with id 0
/// answers the connection, not a request (a server at its connection cap
/// says `ResourceExhausted` so): that error is the outer one, as it is.
pub fn check_answer<T>(
    got: u64,
    want: u64,
    answer: Result<T, KvError>,
) -> Result<Result<T, KvError>, KvError> {
    if got == want {
        return Ok(answer);
    }
    match answer {
        Err(e) if got == 0 => Err(e),
        _ => Err(KvError::new(
            ErrorCode::Malformed,
            format!("answer to request {got} arrived for request {want}"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::{MasterRequest, MasterResponse};

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        futures_lite::future::block_on(f)
    }

    #[test]
    fn a_message_round_trips_through_a_frame() {
        let msg = MasterRequest::Exist {
            key: b"hello".to_vec(),
        };
        let bytes = encode(FrameKind::MasterRequest, 42, &msg);
        let mut r = futures_lite::io::Cursor::new(bytes);
        let (id, got): (u64, MasterRequest) =
            block_on(read_message(&mut r, FrameKind::MasterRequest, 1024)).unwrap();
        assert_eq!(id, 42);
        assert_eq!(got, msg);
    }

    #[test]
    fn an_error_frame_becomes_the_error_it_carries() {
        let bytes = encode_error(7, &KvError::new(ErrorCode::NoSpace, "full"));
        let mut r = futures_lite::io::Cursor::new(bytes);
        let err = block_on(read_message::<MasterResponse, _>(
            &mut r,
            FrameKind::MasterResponse,
            1024,
        ))
        .unwrap_err();
        assert_eq!(err.code, ErrorCode::NoSpace);
        assert_eq!(err.message, "full");
    }

    #[test]
    fn bad_magic_version_kind_and_length_are_refused() {
        let good = FrameHeader {
            kind: FrameKind::DataRequest,
            request_id: 1,
            len: 10,
        }
        .encode();
        let mut b = good;
        b[0] = b'X';
        assert!(matches!(
            FrameHeader::decode(&b, 100),
            Err(FrameError::BadMagic(_))
        ));
        let mut b = good;
        b[4] = VERSION + 1;
        assert!(matches!(
            FrameHeader::decode(&b, 100),
            Err(FrameError::BadVersion(v)) if v == VERSION + 1
        ));
        let mut b = good;
        b[5] = 77;
        assert!(matches!(
            FrameHeader::decode(&b, 100),
            Err(FrameError::BadKind(77))
        ));
        assert!(matches!(
            FrameHeader::decode(&good, 9),
            Err(FrameError::TooLarge { len: 10, max: 9 })
        ));
        assert!(FrameHeader::decode(&good, 10).is_ok());
    }

    #[test]
    fn garbage_payload_fails_validation_instead_of_being_used() {
        let msg = MasterRequest::Exist { key: vec![1, 2, 3] };
        let mut bytes = encode(FrameKind::MasterRequest, 1, &msg);
        // Point the key's relative pointer far outside the buffer.
        let n = bytes.len();
        for b in &mut bytes[HEADER_LEN..n] {
            *b = 0xff;
        }
        let mut r = futures_lite::io::Cursor::new(bytes);
        let err = block_on(read_message::<MasterRequest, _>(
            &mut r,
            FrameKind::MasterRequest,
            1024,
        ))
        .unwrap_err();
        assert_eq!(err.code, ErrorCode::Malformed, "{err}");
    }

    #[test]
    fn a_budget_refuses_past_its_bound_and_is_given_back() {
        let budget = FrameBudget::new(100 << 10);
        let msg = MasterRequest::Exist {
            key: vec![7u8; 90 << 10],
        };
        let bytes = encode(FrameKind::MasterRequest, 1, &msg);
        let read = |b: &Arc<FrameBudget>| {
            let mut r = futures_lite::io::Cursor::new(bytes.clone());
            block_on(async {
                let h = read_header(&mut r, u32::MAX).await?;
                read_payload_budgeted(&mut r, &h, b).await
            })
        };
        let (p, held) = read(&budget).unwrap();
        assert!(budget.used() >= p.len() as u64);
        // A second frame while the first is held does not fit.
        let e = read(&budget).unwrap_err();
        assert_eq!(e.code(), ErrorCode::ResourceExhausted, "{e}");
        drop(held);
        assert_eq!(budget.used(), 0);
        let (p2, _held) = read(&budget).unwrap();
        assert_eq!(decode::<MasterRequest>(&p2).unwrap(), msg);
    }

    #[test]
    fn a_payload_buffer_grows_with_what_arrives() {
        // 4 MiB announced against a 1 MiB budget, 10 bytes sent: the read
        // ends at the missing bytes (EOF), not at the budget, because the
        // buffer only grows with what arrives.
        let budget = FrameBudget::new(1 << 20);
        let mut bytes = FrameHeader {
            kind: FrameKind::MasterRequest,
            request_id: 1,
            len: 4 << 20,
        }
        .encode()
        .to_vec();
        bytes.extend_from_slice(&[0u8; 10]);
        let mut r = futures_lite::io::Cursor::new(bytes);
        let res = block_on(async {
            let h = read_header(&mut r, u32::MAX).await?;
            read_payload_budgeted(&mut r, &h, &budget).await
        });
        assert!(matches!(res, Err(FrameError::Io(_))), "{res:?}");
        assert_eq!(budget.used(), 0, "the failed read gave its memory back");
    }

    #[test]
    fn truncated_frames_are_errors_not_hangs() {
        let msg = MasterRequest::Exist { key: b"k".to_vec() };
        let bytes = encode(FrameKind::MasterRequest, 1, &msg);
        for cut in [1, HEADER_LEN - 1, HEADER_LEN + 1, bytes.len() - 1] {
            let mut r = futures_lite::io::Cursor::new(bytes[..cut].to_vec());
            assert!(block_on(read_frame(&mut r, 1024)).is_err(), "cut at {cut}");
        }
        let mut r = futures_lite::io::Cursor::new(Vec::new());
        assert!(matches!(
            block_on(read_frame(&mut r, 1024)),
            Err(FrameError::Closed)
        ));
    }
}
