//! The KV cache of a sequence, kept as one block per chunk of `chunk_tokens`
//! tokens, in exactly the layout of the pool object that holds that chunk.
//!
//! A block is `HEADER_BYTES` of header then, for every layer, K then V, each
//! `[kv_heads][chunk_tokens][head_dim]` f32 (little-endian):
//!
//! ```text
//! | header (64 B) | L0 K | L0 V | L1 K | L1 V | ... |      one block = one pool object
//! ```
//!
//! Because the block *is* the object, a chunk loaded from the pool is read by
//! the client straight into the block (no staging copy), and a chunk the
//! engine computed is stored straight from it. A full block is never written
//! again (later tokens go to later blocks), so it is shared (`Arc`) with the
//! background store while the sequence goes on decoding.
//!
//! Header (all little-endian), the compatibility contract of the pool's KV
//! objects; any change bumps [`FORMAT_VERSION`]:
//!
//! | offset | field |
//! |---|---|
//! | 0 | magic `KVPOOLKV` |
//! | 8 | format version (u32) |
//! | 12 | dtype (u32: 1 = f32) |
//! | 16 | model fingerprint (u64) |
//! | 24 | chunk hash (u64): the prefix-chained hash the key names |
//! | 32 | tokens (u32), layers (u32), KV heads (u32), head dim (u32) |
//! | 48 | payload bytes (u64) |
//! | 56 | checksum (u64): xxh3-64 of bytes 0..56 and the payload |

use std::sync::Arc;

use kvpool_runtime::chunk_hash::{ChunkHash, StoreKey};
use xxhash_rust::xxh3::Xxh3;

#[cfg(not(target_endian = "little"))]
compile_error!("the KV chunk format is little-endian and stored as native f32");

/// Bytes of a chunk header.
pub const HEADER_BYTES: usize = 64;
const HEADER_FLOATS: usize = HEADER_BYTES / 4;
const _: () = assert!(HEADER_BYTES.is_multiple_of(4) && HEADER_BYTES >= 64);
/// First bytes of every KV chunk object.
pub const MAGIC: [u8; 8] = *b"KVPOOLKV";
/// Version of the chunk format (header and payload layout).
pub const FORMAT_VERSION: u32 = 1;
/// The dtype code of f32 KV.
pub const DTYPE_F32: u32 = 1;

/// The shape of one chunk's KV.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    pub chunk_tokens: usize,
    pub layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub fingerprint: u64,
}

impl KvLayout {
    /// Floats of one layer's K (or V) in a block.
    pub fn plane_floats(&self) -> usize {
        self.kv_heads * self.chunk_tokens * self.head_dim
    }

    /// Bytes after the header.
    pub fn payload_bytes(&self) -> usize {
        self.layers * 2 * self.plane_floats() * 4
    }

    /// Bytes of one block (= one pool object).
    pub fn block_bytes(&self) -> usize {
        HEADER_BYTES + self.payload_bytes()
    }

    fn block_floats(&self) -> usize {
        self.block_bytes() / 4
    }

    /// Index (in floats) of layer `layer`'s K (`v = false`) or V plane.
    pub fn plane_offset(&self, layer: usize, v: bool) -> usize {
        HEADER_FLOATS + (layer * 2 + usize::from(v)) * self.plane_floats()
    }

    /// The `format` part of the store key: format version, dtype and layout.
    pub fn key_format(&self) -> String {
        format!(
            "kv{FORMAT_VERSION}-f32-l{}h{}d{}",
            self.layers, self.kv_heads, self.head_dim
        )
    }

    /// The `model` part of the store key.
    pub fn key_model(&self) -> String {
        format!("m{:016x}", self.fingerprint)
    }

    /// The pool key of the chunk whose prefix-chained hash is `hash`.
    pub fn key(&self, hash: ChunkHash) -> String {
        StoreKey::new(
            &self.key_model(),
            hash,
            &self.key_format(),
            self.chunk_tokens as u32,
        )
        .expect("model and format parts contain no '@'")
        .to_string()
    }

    /// A zeroed block.
    pub fn new_block(&self) -> Arc<[f32]> {
        vec![0f32; self.block_floats()].into()
    }
}

/// Views a block's floats as bytes (for the pool's reads and writes).
pub fn block_bytes(block: &[f32]) -> &[u8] {
    // SAFETY: u8 has no alignment or validity requirement and the byte
    // length is exactly the slice's size; the borrow keeps `block` alive.
    unsafe { std::slice::from_raw_parts(block.as_ptr().cast::<u8>(), std::mem::size_of_val(block)) }
}

/// Views a block's floats as bytes to write into.
pub fn block_bytes_mut(block: &mut [f32]) -> &mut [u8] {
    // SAFETY: as in `block_bytes`; every bit pattern is a valid f32, so any
    // bytes written through the view leave valid floats.
    unsafe {
        std::slice::from_raw_parts_mut(
            block.as_mut_ptr().cast::<u8>(),
            std::mem::size_of_val(block),
        )
    }
}

fn checksum(bytes: &[u8]) -> u64 {
    let mut h = Xxh3::new();
    h.update(&bytes[..56]);
    h.update(&bytes[HEADER_BYTES..]);
    h.digest()
}

/// Writes the header of a full block computed by this engine.
pub fn seal(layout: &KvLayout, hash: ChunkHash, block: &mut [f32]) {
    let b = block_bytes_mut(block);
    b[0..8].copy_from_slice(&MAGIC);
    b[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    b[12..16].copy_from_slice(&DTYPE_F32.to_le_bytes());
    b[16..24].copy_from_slice(&layout.fingerprint.to_le_bytes());
    b[24..32].copy_from_slice(&hash.0.to_le_bytes());
    b[32..36].copy_from_slice(&(layout.chunk_tokens as u32).to_le_bytes());
    b[36..40].copy_from_slice(&(layout.layers as u32).to_le_bytes());
    b[40..44].copy_from_slice(&(layout.kv_heads as u32).to_le_bytes());
    b[44..48].copy_from_slice(&(layout.head_dim as u32).to_le_bytes());
    b[48..56].copy_from_slice(&(layout.payload_bytes() as u64).to_le_bytes());
    let sum = checksum(b);
    b[56..64].copy_from_slice(&sum.to_le_bytes());
}

/// Why a chunk read from the pool was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChunkRefused {
    #[error("object is {got} bytes, a chunk of this layout is {want}")]
    Length { got: usize, want: usize },
    #[error("bad magic")]
    Magic,
    #[error("format version {0}, this engine reads {FORMAT_VERSION}")]
    Version(u32),
    #[error("header field {field} is {got}, expected {want}")]
    Field {
        field: &'static str,
        got: u64,
        want: u64,
    },
    #[error("checksum mismatch")]
    Checksum,
}

/// Checks a chunk read from the pool: every header field against this
/// engine's layout and the expected chunk hash, then the checksum.
pub fn verify(
    layout: &KvLayout,
    hash: ChunkHash,
    block: &[f32],
    len: usize,
) -> Result<(), ChunkRefused> {
    let b = block_bytes(block);
    if len != b.len() {
        return Err(ChunkRefused::Length {
            got: len,
            want: b.len(),
        });
    }
    if b[0..8] != MAGIC {
        return Err(ChunkRefused::Magic);
    }
    let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"));
    let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"));
    if u32_at(8) != FORMAT_VERSION {
        return Err(ChunkRefused::Version(u32_at(8)));
    }
    let fields: [(&'static str, u64, u64); 8] = [
        ("dtype", u32_at(12).into(), DTYPE_F32.into()),
        ("model fingerprint", u64_at(16), layout.fingerprint),
        ("chunk hash", u64_at(24), hash.0),
        ("tokens", u32_at(32).into(), layout.chunk_tokens as u64),
        ("layers", u32_at(36).into(), layout.layers as u64),
        ("kv heads", u32_at(40).into(), layout.kv_heads as u64),
        ("head dim", u32_at(44).into(), layout.head_dim as u64),
        ("payload bytes", u64_at(48), layout.payload_bytes() as u64),
    ];
    for (field, got, want) in fields {
        if got != want {
            return Err(ChunkRefused::Field { field, got, want });
        }
    }
    if u64_at(56) != checksum(b) {
        return Err(ChunkRefused::Checksum);
    }
    Ok(())
}

/// A sequence's KV: `len` positions filled, in blocks of `chunk_tokens`.
#[derive(Debug)]
pub struct SeqKv {
    layout: KvLayout,
    blocks: Vec<Arc<[f32]>>,
    len: usize,
}

impl SeqKv {
    pub fn new(layout: KvLayout) -> Self {
        Self {
            layout,
            blocks: Vec::new(),
            len: 0,
        }
    }

    /// A sequence whose first `blocks.len()` full chunks were loaded.
    pub fn with_loaded(layout: KvLayout, blocks: Vec<Arc<[f32]>>) -> Self {
        let len = blocks.len() * layout.chunk_tokens;
        Self {
            layout,
            blocks,
            len,
        }
    }

    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// Positions whose K and V are present.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Block `i` (full or the partial last one).
    pub fn block(&self, i: usize) -> &Arc<[f32]> {
        &self.blocks[i]
    }

    /// Writes K and V of `n` new positions for `layer`. `k` and `v` are
    /// `[kv_heads][n][head_dim]`; positions `len..len+n` are filled, and
    /// [`SeqKv::advance`] makes them count once every layer is written.
    pub fn write(&mut self, layer: usize, k: &[f32], v: &[f32], n: usize) {
        let l = self.layout;
        let hd = l.head_dim;
        debug_assert_eq!(k.len(), l.kv_heads * n * hd);
        let end = self.len + n;
        while self.blocks.len() * l.chunk_tokens < end {
            self.blocks.push(l.new_block());
        }
        let mut pos = self.len;
        while pos < end {
            let bi = pos / l.chunk_tokens;
            let in_block = pos % l.chunk_tokens;
            let take = (l.chunk_tokens - in_block).min(end - pos);
            let block = Arc::get_mut(&mut self.blocks[bi])
                .expect("a block that is still being filled is not shared");
            for (src, is_v) in [(k, false), (v, true)] {
                let plane = l.plane_offset(layer, is_v);
                for h in 0..l.kv_heads {
                    let dst = plane + (h * l.chunk_tokens + in_block) * hd;
                    let s = (h * n + (pos - self.len)) * hd;
                    block[dst..dst + take * hd].copy_from_slice(&src[s..s + take * hd]);
                }
            }
            pos += take;
        }
    }

    /// Counts `n` positions written by [`SeqKv::write`] for every layer.
    pub fn advance(&mut self, n: usize) {
        self.len += n;
    }

    /// K (`v = false`) or V of `layer` for positions `0..upto`, as
    /// `[kv_heads][upto][head_dim]`.
    pub fn gather(&self, layer: usize, v: bool, upto: usize) -> Vec<f32> {
        let l = self.layout;
        let hd = l.head_dim;
        let mut out = Vec::with_capacity(l.kv_heads * upto * hd);
        for h in 0..l.kv_heads {
            let mut pos = 0;
            for block in &self.blocks {
                if pos >= upto {
                    break;
                }
                let take = (upto - pos).min(l.chunk_tokens);
                let s = l.plane_offset(layer, v) + h * l.chunk_tokens * hd;
                out.extend_from_slice(&block[s..s + take * hd]);
                pos += take;
            }
        }
        out
    }

    /// Seals full block `i` (header, checksum) and hands a shared handle to
    /// it, for storing. The block must be full and not yet shared.
    pub fn seal_block(&mut self, i: usize, hash: ChunkHash) -> Arc<[f32]> {
        assert!(
            (i + 1) * self.layout.chunk_tokens <= self.len,
            "block {i} is not full"
        );
        let layout = self.layout;
        let block =
            Arc::get_mut(&mut self.blocks[i]).expect("a block is sealed once, before sharing");
        seal(&layout, hash, block);
        self.blocks[i].clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> KvLayout {
        KvLayout {
            chunk_tokens: 4,
            layers: 2,
            kv_heads: 2,
            head_dim: 3,
            fingerprint: 0xfeed,
        }
    }

    #[test]
    fn written_positions_gather_back_across_blocks() {
        let l = layout();
        let mut kv = SeqKv::new(l);
        // 6 positions in one call, then 3 more: crosses two block edges.
        for (start, n) in [(0usize, 6usize), (6, 3)] {
            for layer in 0..2 {
                let k: Vec<f32> = (0..2 * n * 3)
                    .map(|i| (layer * 1000 + start * 10 + i) as f32)
                    .collect();
                let v: Vec<f32> = k.iter().map(|x| -x).collect();
                kv.write(layer, &k, &v, n);
            }
            kv.advance(n);
        }
        assert_eq!(kv.len(), 9);
        let g = kv.gather(1, false, 9);
        assert_eq!(g.len(), 2 * 9 * 3);
        // Head 1, position 7 (second call, offset 1): source index (1*3+1)*3.
        let want = (1000 + 60 + (3 + 1) * 3) as f32;
        assert_eq!(g[(9 + 7) * 3], want);
        let gv = kv.gather(1, true, 9);
        assert_eq!(gv[(9 + 7) * 3], -want);
    }

    #[test]
    fn sealed_chunks_verify_and_any_change_is_refused() {
        let l = layout();
        let mut kv = SeqKv::new(l);
        let k = vec![1.5f32; 2 * 4 * 3];
        for layer in 0..2 {
            kv.write(layer, &k, &k, 4);
        }
        kv.advance(4);
        let block = kv.seal_block(0, ChunkHash(7));
        let n = l.block_bytes();
        assert_eq!(verify(&l, ChunkHash(7), &block, n), Ok(()));
        assert!(matches!(
            verify(&l, ChunkHash(8), &block, n),
            Err(ChunkRefused::Field {
                field: "chunk hash",
                ..
            })
        ));
        let other = KvLayout {
            fingerprint: 1,
            ..l
        };
        assert!(matches!(
            verify(&other, ChunkHash(7), &block, n),
            Err(ChunkRefused::Field {
                field: "model fingerprint",
                ..
            })
        ));
        assert!(matches!(
            verify(&l, ChunkHash(7), &block, n - 4),
            Err(ChunkRefused::Length { .. })
        ));
        let mut bad = block.to_vec();
        bad[HEADER_FLOATS + 5] = 2.5;
        assert_eq!(
            verify(&l, ChunkHash(7), &bad, n),
            Err(ChunkRefused::Checksum)
        );
        let mut bad = block.to_vec();
        block_bytes_mut(&mut bad)[0] ^= 1;
        assert_eq!(verify(&l, ChunkHash(7), &bad, n), Err(ChunkRefused::Magic));
        let mut bad = block.to_vec();
        block_bytes_mut(&mut bad)[8] = 9;
        assert_eq!(
            verify(&l, ChunkHash(7), &bad, n),
            Err(ChunkRefused::Version(9))
        );
    }

    #[test]
    fn keys_name_model_layout_and_hash() {
        let l = layout();
        let key = l.key(ChunkHash(0xabc));
        assert_eq!(key, "m000000000000feed@0000000000000abc@kv1-f32-l2h2d3@4");
        let parsed: StoreKey = key.parse().unwrap();
        assert_eq!(parsed.hash(), ChunkHash(0xabc));
    }
}
