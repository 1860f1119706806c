//! Every bound of the wire protocol in one place: what a kvpool process
//! accepts from a socket, and the ranges the configuration's frame keys may
//! take. A request beyond one of them is refused with a clear error before
//! anything is allocated for it. The relations between the bounds are
//! checked at compile time (the `const` assertions at the end), so changing
//! one that breaks another does not build.

/// Bytes of a key: the master's `master.max_key_bytes` is at most this, and
/// the RESP front and the NVMe tier's index refuse longer keys.
pub const MAX_KEY_BYTES: usize = 4096;

/// The smallest `*.max_frame_bytes` a configuration may set: a request with
/// a key of [`MAX_KEY_BYTES`] must fit in one frame.
pub const MIN_FRAME_BYTES: u64 = 16 << 10;
/// The largest `*.max_frame_bytes` (a frame's length is a `u32`).
pub const MAX_FRAME_BYTES: u64 = u32::MAX as u64;
/// The bound on a control payload where no configuration gives one.
pub const DEFAULT_MAX_FRAME_BYTES: u32 = 4 << 20;
/// The smallest `master.max_frame_bytes` of a master on etcd: log
/// shipping's largest answer fits.
pub const HA_MIN_FRAME_BYTES: u64 = 2 << 20;

/// Largest segment a node may mount (256 TiB): bounds what a report or an
/// allocation can name.
pub const MAX_SEGMENT_BYTES: u64 = 1 << 48;
/// Most shards (ports) a storage node may announce.
pub const MAX_NODE_SHARDS: u16 = 1024;
/// Longest segment name, host id or endpoint host in a mount.
pub const MAX_NAME_BYTES: usize = 256;
/// Most segments one ping may name.
pub const MAX_PING_SEGMENTS: usize = 64;
/// Most clients one master tracks for liveness.
pub const MAX_CLIENTS: usize = 1 << 20;

/// Most RDMA lanes (queue pairs) one connection may ask for.
pub const MAX_LANES_PER_CONNECTION: usize = 64;
/// Most RDMA devices one peer may advertise.
pub const MAX_ADVERTISED_DEVICES: usize = 32;

// A key of the largest size, with its request's other fields and the frame
// header, fits in the smallest frame a configuration may set.
const _: () = assert!(MIN_FRAME_BYTES >= 2 * MAX_KEY_BYTES as u64);
const _: () = assert!(MIN_FRAME_BYTES <= HA_MIN_FRAME_BYTES);
const _: () = assert!(HA_MIN_FRAME_BYTES <= MAX_FRAME_BYTES);
const _: () = assert!(
    DEFAULT_MAX_FRAME_BYTES as u64 >= MIN_FRAME_BYTES
        && DEFAULT_MAX_FRAME_BYTES as u64 <= MAX_FRAME_BYTES
);
// The names a mount may carry and a full ping fit in the smallest frame.
const _: () = assert!((3 * MAX_NAME_BYTES + MAX_PING_SEGMENTS * 16) as u64 <= MIN_FRAME_BYTES);
// A segment's byte offsets and lengths travel as u64, and its shard count as
// u16 (`Endpoint::nr_shards`).
const _: () = assert!(MAX_SEGMENT_BYTES < u64::MAX / 2);
const _: () = assert!(MAX_LANES_PER_CONNECTION <= u16::MAX as usize);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::{self, FrameKind, HEADER_LEN};
    use crate::proto::{MasterRequest, PutOptions};

    /// The relation the first assertion above stands for, measured: a put
    /// of a key of the largest size is one frame of at most the smallest
    /// frame bound.
    #[test]
    fn a_request_with_the_longest_key_fits_in_the_smallest_frame() {
        let req = MasterRequest::PutStart {
            client_id: u64::MAX,
            key: vec![b'k'; MAX_KEY_BYTES],
            len: u64::MAX,
            opts: PutOptions::default(),
        };
        let bytes = frame::encode(FrameKind::MasterRequest, u64::MAX, &req);
        assert!(bytes.len() > HEADER_LEN + MAX_KEY_BYTES);
        assert!(
            bytes.len() as u64 <= MIN_FRAME_BYTES,
            "{} bytes",
            bytes.len()
        );
    }
}
