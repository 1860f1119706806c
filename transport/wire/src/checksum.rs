//! The value checksum: xxh3-64 of the whole value, as the writer hands it to
//! the master at `PutEnd` and every reader checks it.
//!
//! Computing it is one more pass over the value. Done after a copy, that
//! pass reads the value back from memory; done on each piece right after the
//! piece was copied or received, it reads from cache. The helpers here do
//! the latter and give exactly the one-shot digest (xxh3's streaming state
//! over the pieces in order equals xxh3 of their concatenation).

pub use kvpool_runtime::hash::{value_sum, ValueSum};

/// Pieces hashed right after they are copied: small enough to stay in a
/// core's L2 cache between the copy and the hash.
pub const PIECE_BYTES: usize = 256 * 1024;

/// Copies `len` bytes from `src` to `dst` and returns the checksum of the
/// bytes, hashing each piece of `hashed` (the side that is ours: `src` for a
/// write, `dst` for a read) right after the piece is copied.
///
/// # Safety
/// `src` must be valid for reads and `dst` for writes of `len` bytes, the two
/// ranges must not overlap, and the side named by `hashed` must not change
/// while this runs (it is read back after the copy).
pub unsafe fn copy_and_sum(dst: *mut u8, src: *const u8, len: usize, hashed: Side) -> u64 {
    if len <= PIECE_BYTES {
        // SAFETY: the caller's contract.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
        // SAFETY: the hashed side is valid for `len` bytes and stable.
        return value_sum(unsafe { hashed.slice(dst, src, 0, len) });
    }
    let mut h = ValueSum::new();
    let mut at = 0;
    while at < len {
        let n = PIECE_BYTES.min(len - at);
        // SAFETY: `at + n <= len`, inside both ranges (caller's contract).
        unsafe { std::ptr::copy_nonoverlapping(src.add(at), dst.add(at), n) };
        // SAFETY: as above; the hashed side does not change meanwhile.
        h.update(unsafe { hashed.slice(dst, src, at, n) });
        at += n;
    }
    h.digest()
}

/// Which side of a copy is hashed: the one the caller owns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Src,
    Dst,
}

impl Side {
    /// # Safety
    /// The chosen side is valid for reads of `at + n` bytes and stable.
    unsafe fn slice<'a>(self, dst: *mut u8, src: *const u8, at: usize, n: usize) -> &'a [u8] {
        let p = match self {
            Side::Src => src,
            Side::Dst => dst as *const u8,
        };
        // SAFETY: the caller's contract.
        unsafe { std::slice::from_raw_parts(p.add(at), n) }
    }
}

/// The checksum of a value whose pieces complete out of order (TCP slices
/// over several lanes): each piece is hashed as soon as every piece before it
/// has been, so a piece is hashed soon after it landed, while it is likely
/// still in cache.
pub struct Frontier {
    h: ValueSum,
    /// The next piece to hash.
    next: usize,
    /// Pieces that landed ahead of `next`, by index.
    ready: Vec<bool>,
}

impl Frontier {
    pub fn new(pieces: usize) -> Self {
        Self {
            h: ValueSum::new(),
            next: 0,
            ready: vec![false; pieces],
        }
    }

    /// Piece `i` has landed; hashes it and every landed piece after it that
    /// is now in order. `piece(j)` gives piece `j`'s bytes.
    pub fn landed<'a>(&mut self, i: usize, piece: impl Fn(usize) -> &'a [u8]) {
        self.ready[i] = true;
        while self.next < self.ready.len() && self.ready[self.next] {
            self.h.update(piece(self.next));
            self.next += 1;
        }
    }

    /// The checksum, once every piece has landed.
    pub fn digest(&self) -> Option<u64> {
        (self.next == self.ready.len()).then(|| self.h.digest())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 31 + i / 257) as u8).collect()
    }

    #[test]
    fn copying_and_summing_gives_the_bytes_and_the_one_shot_digest() {
        for len in [
            0,
            1,
            240,
            241,
            4096,
            PIECE_BYTES - 1,
            PIECE_BYTES,
            PIECE_BYTES + 1,
            3 * PIECE_BYTES + 17,
        ] {
            let src = data(len);
            for side in [Side::Src, Side::Dst] {
                let mut dst = vec![0u8; len];
                // SAFETY: two distinct buffers of `len` bytes.
                let sum = unsafe { copy_and_sum(dst.as_mut_ptr(), src.as_ptr(), len, side) };
                assert_eq!(dst, src, "len {len}");
                assert_eq!(sum, value_sum(&src), "len {len} {side:?}");
            }
        }
    }

    #[test]
    fn pieces_landing_in_any_order_give_the_one_shot_digest() {
        let v = data(10 * 1000 + 7);
        let pieces: Vec<&[u8]> = v.chunks(1000).collect();
        for order in [
            vec![0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
            vec![10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0],
            vec![3, 0, 1, 10, 2, 5, 4, 9, 6, 8, 7],
        ] {
            let mut f = Frontier::new(pieces.len());
            for (n, &i) in order.iter().enumerate() {
                assert_eq!(f.digest(), None, "not done after {n} pieces");
                f.landed(i, |j| pieces[j]);
            }
            assert_eq!(f.digest(), Some(value_sum(&v)), "order {order:?}");
        }
    }
}
