//! The KV cache of a sequence, kept per chunk of `chunk_tokens` tokens in
//! exactly the layout of the pool objects that hold that chunk.
//!
//! A chunk's layers are split into groups of `group_layers` consecutive
//! layers (one group of all layers by default, `engine.kv_layer_groups`);
//! each group is one *segment*, one pool object: `HEADER_BYTES` of header,
//! then for each of its layers K then V, each `[kv_heads][chunk_tokens][head_dim]`
//! f32 (little-endian):
//!
//! ```text
//! | header (64 B) | L0 K | L0 V | L1 K | L1 V | ... |      group 0 = one pool object
//! | header (64 B) | L4 K | L4 V | ...             |      group 1 (with 4 layers per group)
//! ```
//!
//! Because a segment *is* the object, a chunk loaded from the pool is read by
//! the client straight into its segments (no staging copy), and a chunk the
//! engine computed is stored straight from them. A segment is sealed once the
//! last of its layers is written for the whole chunk and never written again
//! (later layers go to other segments, later tokens to later chunks), so it is
//! shared (`Arc`) with the background store while the sequence goes on;
//! with layer-wise streaming that happens while the next group computes.
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
//! | 32 | tokens (u32), layers of the model (u32) |
//! | 40 | KV heads (u16), head dim (u16), first layer here (u16), layers here (u16) |
//! | 48 | payload bytes (u64) |
//! | 56 | checksum (u64): xxh3-64 of bytes 0..56 and the payload |

use std::sync::Arc;

use kvpool_runtime::chunk_hash::{ChunkHash, StoreKey};
use xxhash_rust::xxh3::Xxh3;

#[cfg(not(target_endian = "little"))]
compile_error!("the KV chunk format is little-endian and stored as native f32");

/// Bytes of a segment header.
pub const HEADER_BYTES: usize = 64;
const HEADER_FLOATS: usize = HEADER_BYTES / 4;
const _: () = assert!(HEADER_BYTES.is_multiple_of(4) && HEADER_BYTES >= 64);
/// First bytes of every KV object.
pub const MAGIC: [u8; 8] = *b"KVPOOLKV";
/// Version of the chunk format (header and payload layout).
pub const FORMAT_VERSION: u32 = 2;
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
    /// Layers per segment (pool object); `layers` = one object per chunk.
    pub group_layers: usize,
}

impl KvLayout {
    /// Layers per group for `groups` groups of `layers` (at least one layer
    /// each): `ceil(layers / groups)`.
    pub fn group_layers_for(layers: usize, groups: usize) -> usize {
        layers.div_ceil(groups.clamp(1, layers.max(1))).max(1)
    }

    /// Checks that the header can describe this layout (its u16 fields).
    pub fn check(&self) -> Result<(), String> {
        for (what, v) in [
            ("KV heads", self.kv_heads),
            ("head dim", self.head_dim),
            ("layers", self.layers),
        ] {
            if v == 0 || v > usize::from(u16::MAX) {
                return Err(format!(
                    "the KV chunk format holds 1 to 65535 {what}, this model has {v}"
                ));
            }
        }
        if self.group_layers == 0 || self.group_layers > self.layers {
            return Err(format!(
                "{} layers per KV group for a model of {} layers",
                self.group_layers, self.layers
            ));
        }
        Ok(())
    }

    /// Segments (pool objects) per chunk.
    pub fn groups(&self) -> usize {
        self.layers.div_ceil(self.group_layers)
    }

    /// The group `layer` belongs to.
    pub fn group_of(&self, layer: usize) -> usize {
        layer / self.group_layers
    }

    /// First layer and number of layers of group `g`.
    pub fn group_span(&self, g: usize) -> (usize, usize) {
        let first = g * self.group_layers;
        (first, self.group_layers.min(self.layers - first))
    }

    /// Floats of one layer's K (or V) in a segment.
    pub fn plane_floats(&self) -> usize {
        self.kv_heads * self.chunk_tokens * self.head_dim
    }

    /// Bytes after the header of group `g`'s segment.
    pub fn payload_bytes(&self, g: usize) -> usize {
        self.group_span(g).1 * 2 * self.plane_floats() * 4
    }

    /// Bytes of group `g`'s segment (= one pool object).
    pub fn segment_bytes(&self, g: usize) -> usize {
        HEADER_BYTES + self.payload_bytes(g)
    }

    /// Bytes of one chunk, all its segments.
    pub fn chunk_bytes(&self) -> usize {
        (0..self.groups()).map(|g| self.segment_bytes(g)).sum()
    }

    /// Index (in floats, within its group's segment) of layer `layer`'s K
    /// (`v = false`) or V plane.
    pub fn plane_offset(&self, layer: usize, v: bool) -> usize {
        let first = self.group_of(layer) * self.group_layers;
        HEADER_FLOATS + ((layer - first) * 2 + usize::from(v)) * self.plane_floats()
    }

    fn layout_format(&self) -> String {
        format!(
            "kv{FORMAT_VERSION}-f32-l{}h{}d{}",
            self.layers, self.kv_heads, self.head_dim
        )
    }

    /// The `format` part of group `g`'s store key: format version, dtype,
    /// layout and, with more than one group, the group.
    pub fn group_format(&self, g: usize) -> String {
        match self.groups() {
            1 => self.layout_format(),
            n => format!("{}-g{g}of{n}", self.layout_format()),
        }
    }

    /// The `format` part of a chunk's name: that of its last group, the
    /// object stored last (so present means the whole chunk was stored).
    pub fn key_format(&self) -> String {
        self.group_format(self.groups() - 1)
    }

    /// The `model` part of the store key.
    pub fn key_model(&self) -> String {
        format!("m{:016x}", self.fingerprint)
    }

    /// The pool key of group `g` of the chunk whose prefix-chained hash is `hash`.
    pub fn group_key(&self, hash: ChunkHash, g: usize) -> String {
        StoreKey::new(
            &self.key_model(),
            hash,
            &self.group_format(g),
            self.chunk_tokens as u32,
        )
        .expect("model and format parts contain no '@'")
        .to_string()
    }

    /// The chunk's name (its last group's key): what `kv_transfer_params`
    /// and the serving front's pool lookups use.
    pub fn key(&self, hash: ChunkHash) -> String {
        self.group_key(hash, self.groups() - 1)
    }

    /// A zeroed segment of group `g`.
    pub fn new_segment(&self, g: usize) -> Arc<[f32]> {
        vec![0f32; self.segment_bytes(g) / 4].into()
    }
}

/// Views a segment's floats as bytes (for the pool's reads and writes).
pub fn block_bytes(block: &[f32]) -> &[u8] {
    // SAFETY: u8 has no alignment or validity requirement and the byte
    // length is exactly the slice's size; the borrow keeps `block` alive.
    unsafe { std::slice::from_raw_parts(block.as_ptr().cast::<u8>(), std::mem::size_of_val(block)) }
}

/// Views a segment's floats as bytes to write into.
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

/// Writes the header of group `g`'s segment of a chunk computed by this engine.
pub fn seal(layout: &KvLayout, hash: ChunkHash, g: usize, segment: &mut [f32]) {
    let (first, count) = layout.group_span(g);
    let b = block_bytes_mut(segment);
    let u16_of = |v: usize| u16::try_from(v).expect("KvLayout::check bounds it");
    b[0..8].copy_from_slice(&MAGIC);
    b[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    b[12..16].copy_from_slice(&DTYPE_F32.to_le_bytes());
    b[16..24].copy_from_slice(&layout.fingerprint.to_le_bytes());
    b[24..32].copy_from_slice(&hash.0.to_le_bytes());
    b[32..36].copy_from_slice(&(layout.chunk_tokens as u32).to_le_bytes());
    b[36..40].copy_from_slice(&(layout.layers as u32).to_le_bytes());
    b[40..42].copy_from_slice(&u16_of(layout.kv_heads).to_le_bytes());
    b[42..44].copy_from_slice(&u16_of(layout.head_dim).to_le_bytes());
    b[44..46].copy_from_slice(&u16_of(first).to_le_bytes());
    b[46..48].copy_from_slice(&u16_of(count).to_le_bytes());
    b[48..56].copy_from_slice(&(layout.payload_bytes(g) as u64).to_le_bytes());
    let sum = checksum(b);
    b[56..64].copy_from_slice(&sum.to_le_bytes());
}

/// Why a segment read from the pool was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChunkRefused {
    #[error("object is {got} bytes, this segment of this layout is {want}")]
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

/// Checks group `g`'s segment of a chunk read from the pool (`len` bytes):
/// every header field against this engine's layout, the group and the
/// expected chunk hash, then the checksum.
pub fn verify(
    layout: &KvLayout,
    hash: ChunkHash,
    g: usize,
    segment: &[f32],
    len: usize,
) -> Result<(), ChunkRefused> {
    let b = block_bytes(segment);
    if len != b.len() {
        return Err(ChunkRefused::Length {
            got: len,
            want: b.len(),
        });
    }
    if b[0..8] != MAGIC {
        return Err(ChunkRefused::Magic);
    }
    let u16_at = |o: usize| u16::from_le_bytes(b[o..o + 2].try_into().expect("2 bytes"));
    let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"));
    let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"));
    if u32_at(8) != FORMAT_VERSION {
        return Err(ChunkRefused::Version(u32_at(8)));
    }
    let (first, count) = layout.group_span(g);
    let fields: [(&'static str, u64, u64); 10] = [
        ("dtype", u32_at(12).into(), DTYPE_F32.into()),
        ("model fingerprint", u64_at(16), layout.fingerprint),
        ("chunk hash", u64_at(24), hash.0),
        ("tokens", u32_at(32).into(), layout.chunk_tokens as u64),
        ("layers", u32_at(36).into(), layout.layers as u64),
        ("kv heads", u16_at(40).into(), layout.kv_heads as u64),
        ("head dim", u16_at(42).into(), layout.head_dim as u64),
        ("first layer", u16_at(44).into(), first as u64),
        ("layers here", u16_at(46).into(), count as u64),
        ("payload bytes", u64_at(48), layout.payload_bytes(g) as u64),
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

/// A sequence's KV: `len` positions filled, per chunk of `chunk_tokens` one
/// segment per layer group.
#[derive(Debug)]
pub struct SeqKv {
    layout: KvLayout,
    /// Chunk `c`'s group `g` at `c * groups + g`; `None` while a streamed
    /// load has not delivered it ([`SeqKv::with_pending`]).
    segs: Vec<Option<Arc<[f32]>>>,
    len: usize,
}

impl SeqKv {
    pub fn new(layout: KvLayout) -> Self {
        Self {
            layout,
            segs: Vec::new(),
            len: 0,
        }
    }

    /// A sequence whose leading full chunks were loaded: `segs` holds every
    /// group of each, chunk after chunk.
    pub fn with_loaded(layout: KvLayout, segs: Vec<Arc<[f32]>>) -> Self {
        let g = layout.groups();
        assert!(segs.len().is_multiple_of(g), "whole chunks only");
        let len = segs.len() / g * layout.chunk_tokens;
        Self {
            layout,
            segs: segs.into_iter().map(Some).collect(),
            len,
        }
    }

    /// A sequence whose first `chunks` full chunks are being loaded group by
    /// group: they count as present, and [`SeqKv::install`] must deliver a
    /// group before a layer of it runs.
    pub fn with_pending(layout: KvLayout, chunks: usize) -> Self {
        Self {
            layout,
            segs: vec![None; chunks * layout.groups()],
            len: chunks * layout.chunk_tokens,
        }
    }

    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// Positions whose K and V are present (or, streamed, promised).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Chunks held (full or the partial last one).
    pub fn chunks(&self) -> usize {
        self.segs.len() / self.layout.groups()
    }

    /// Group `g`'s segment of chunk `c`, if present.
    pub fn segment(&self, c: usize, g: usize) -> Option<&Arc<[f32]>> {
        self.segs[c * self.layout.groups() + g].as_ref()
    }

    /// Whether a chunk still waits for group `g` from a streamed load.
    pub fn awaits(&self, g: usize) -> bool {
        (0..self.chunks()).any(|c| self.segment(c, g).is_none())
    }

    /// Puts a streamed load's group `g` in place for chunks `0..segs.len()`.
    /// Returns false when `segs` does not cover every chunk still waiting for
    /// the group: the caller then keeps only the chunks delivered
    /// ([`SeqKv::truncate_chunks`]).
    pub fn install(&mut self, g: usize, segs: Vec<Arc<[f32]>>) -> bool {
        let groups = self.layout.groups();
        let delivered = segs.len();
        for (c, s) in segs.into_iter().enumerate().take(self.chunks()) {
            let slot = &mut self.segs[c * groups + g];
            if slot.is_none() {
                *slot = Some(s);
            }
        }
        (delivered..self.chunks()).all(|c| self.segs[c * groups + g].is_some())
    }

    /// Keeps the first `chunks` chunks (and their positions) only.
    pub fn truncate_chunks(&mut self, chunks: usize) {
        self.segs.truncate(chunks * self.layout.groups());
        self.len = self.len.min(chunks * self.layout.chunk_tokens);
    }

    fn segment_mut(&mut self, c: usize, g: usize) -> &mut [f32] {
        let i = c * self.layout.groups() + g;
        let seg = self.segs[i]
            .as_mut()
            .expect("a segment being written was computed here, not loaded");
        Arc::get_mut(seg).expect("a segment that is still being filled is not shared")
    }

    /// Writes K and V of `n` new positions for `layer`. `k` and `v` are
    /// `[kv_heads][n][head_dim]`; positions `len..len+n` are filled, and
    /// [`SeqKv::advance`] makes them count once every layer is written.
    pub fn write(&mut self, layer: usize, k: &[f32], v: &[f32], n: usize) {
        let l = self.layout;
        let hd = l.head_dim;
        debug_assert_eq!(k.len(), l.kv_heads * n * hd);
        let end = self.len + n;
        while self.chunks() * l.chunk_tokens < end {
            for g in 0..l.groups() {
                self.segs.push(Some(l.new_segment(g)));
            }
        }
        let g = l.group_of(layer);
        let mut pos = self.len;
        while pos < end {
            let c = pos / l.chunk_tokens;
            let in_chunk = pos % l.chunk_tokens;
            let take = (l.chunk_tokens - in_chunk).min(end - pos);
            let first = pos - self.len;
            let seg = self.segment_mut(c, g);
            for (src, is_v) in [(k, false), (v, true)] {
                let plane = l.plane_offset(layer, is_v);
                for h in 0..l.kv_heads {
                    let dst = plane + (h * l.chunk_tokens + in_chunk) * hd;
                    let s = (h * n + first) * hd;
                    seg[dst..dst + take * hd].copy_from_slice(&src[s..s + take * hd]);
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
        let g = l.group_of(layer);
        let s = l.plane_offset(layer, v);
        let mut out = Vec::with_capacity(l.kv_heads * upto * hd);
        for h in 0..l.kv_heads {
            let mut pos = 0;
            for c in 0..self.chunks() {
                if pos >= upto {
                    break;
                }
                let take = (upto - pos).min(l.chunk_tokens);
                let seg = self
                    .segment(c, g)
                    .expect("a streamed group is installed before its layers run");
                let o = s + h * l.chunk_tokens * hd;
                out.extend_from_slice(&seg[o..o + take * hd]);
                pos += take;
            }
        }
        out
    }

    /// Seals group `g`'s segment of chunk `c` (header, checksum) and hands a
    /// shared handle to it, for storing. Every position of the chunk must be
    /// written for the group's layers (`filled` = positions written so far,
    /// counted or not), and the segment not yet shared.
    pub fn seal_segment(
        &mut self,
        c: usize,
        g: usize,
        hash: ChunkHash,
        filled: usize,
    ) -> Arc<[f32]> {
        assert!(
            (c + 1) * self.layout.chunk_tokens <= filled,
            "chunk {c} is not full"
        );
        let layout = self.layout;
        seal(&layout, hash, g, self.segment_mut(c, g));
        self.segment(c, g).expect("just sealed").clone()
    }

    /// Seals every group of full chunk `c` (see [`SeqKv::seal_segment`]).
    pub fn seal_chunk(&mut self, c: usize, hash: ChunkHash) -> Vec<Arc<[f32]>> {
        let len = self.len;
        (0..self.layout.groups())
            .map(|g| self.seal_segment(c, g, hash, len))
            .collect()
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
            group_layers: 2,
        }
    }

    fn filled(l: KvLayout, n: usize) -> SeqKv {
        let mut kv = SeqKv::new(l);
        for layer in 0..l.layers {
            let k: Vec<f32> = (0..l.kv_heads * n * l.head_dim)
                .map(|i| (layer * 1000 + i) as f32)
                .collect();
            kv.write(layer, &k, &k, n);
        }
        kv.advance(n);
        kv
    }

    #[test]
    fn written_positions_gather_back_across_chunks_and_groups() {
        for group_layers in [2, 1] {
            let l = KvLayout {
                group_layers,
                ..layout()
            };
            let mut kv = SeqKv::new(l);
            // 6 positions in one call, then 3 more: crosses two chunk edges.
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
            assert_eq!(kv.chunks(), 3);
            let g = kv.gather(1, false, 9);
            assert_eq!(g.len(), 2 * 9 * 3);
            // Head 1, position 7 (second call, offset 1): source index (1*3+1)*3.
            let want = (1000 + 60 + (3 + 1) * 3) as f32;
            assert_eq!(g[(9 + 7) * 3], want);
            let gv = kv.gather(1, true, 9);
            assert_eq!(gv[(9 + 7) * 3], -want);
        }
    }

    #[test]
    fn sealed_chunks_verify_and_any_change_is_refused() {
        let l = layout();
        let mut kv = filled(l, 4);
        let block = kv.seal_chunk(0, ChunkHash(7)).remove(0);
        let n = l.segment_bytes(0);
        assert_eq!(n, l.chunk_bytes());
        assert_eq!(verify(&l, ChunkHash(7), 0, &block, n), Ok(()));
        assert!(matches!(
            verify(&l, ChunkHash(8), 0, &block, n),
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
            verify(&other, ChunkHash(7), 0, &block, n),
            Err(ChunkRefused::Field {
                field: "model fingerprint",
                ..
            })
        ));
        assert!(matches!(
            verify(&l, ChunkHash(7), 0, &block, n - 4),
            Err(ChunkRefused::Length { .. })
        ));
        let mut bad = block.to_vec();
        bad[HEADER_FLOATS + 5] = 2.5;
        assert_eq!(
            verify(&l, ChunkHash(7), 0, &bad, n),
            Err(ChunkRefused::Checksum)
        );
        let mut bad = block.to_vec();
        block_bytes_mut(&mut bad)[0] ^= 1;
        assert_eq!(
            verify(&l, ChunkHash(7), 0, &bad, n),
            Err(ChunkRefused::Magic)
        );
        let mut bad = block.to_vec();
        block_bytes_mut(&mut bad)[8] = 9;
        assert_eq!(
            verify(&l, ChunkHash(7), 0, &bad, n),
            Err(ChunkRefused::Version(9))
        );
    }

    #[test]
    fn each_group_is_its_own_object_and_one_group_is_not_another() {
        let l = KvLayout {
            group_layers: 1,
            ..layout()
        };
        assert_eq!(l.groups(), 2);
        let mut kv = filled(l, 4);
        let segs = kv.seal_chunk(0, ChunkHash(7));
        assert_eq!(segs.len(), 2);
        let n = l.segment_bytes(1);
        assert_eq!(l.chunk_bytes(), 2 * n);
        assert_eq!(verify(&l, ChunkHash(7), 0, &segs[0], n), Ok(()));
        assert_eq!(verify(&l, ChunkHash(7), 1, &segs[1], n), Ok(()));
        // Group 1's object stored under group 0's key is refused.
        assert!(matches!(
            verify(&l, ChunkHash(7), 0, &segs[1], n),
            Err(ChunkRefused::Field {
                field: "first layer",
                ..
            })
        ));
        // The same KV split differently is another layout.
        let whole = layout();
        assert!(verify(&whole, ChunkHash(7), 0, &segs[0], n).is_err());
    }

    #[test]
    fn a_streamed_load_installs_groups_and_a_short_group_is_refused() {
        let l = KvLayout {
            group_layers: 1,
            ..layout()
        };
        let mut src = filled(l, 8);
        let c0 = src.seal_chunk(0, ChunkHash(1));
        let c1 = src.seal_chunk(1, ChunkHash(2));
        let mut kv = SeqKv::with_pending(l, 2);
        assert_eq!(kv.len(), 8);
        assert!(kv.awaits(0) && kv.awaits(1));
        assert!(kv.install(0, vec![c0[0].clone(), c1[0].clone()]));
        assert!(!kv.awaits(0) && kv.awaits(1));
        assert_eq!(kv.gather(0, true, 8), src.gather(0, true, 8));
        // Group 1 arrives for chunk 0 only: the caller keeps one chunk.
        assert!(!kv.install(1, vec![c0[1].clone()]));
        kv.truncate_chunks(1);
        assert_eq!((kv.len(), kv.chunks()), (4, 1));
        assert!(!kv.awaits(1));
        assert_eq!(kv.gather(1, false, 4), src.gather(1, false, 4));
    }

    #[test]
    fn keys_name_model_layout_group_and_hash() {
        let l = layout();
        let key = l.key(ChunkHash(0xabc));
        assert_eq!(key, "m000000000000feed@0000000000000abc@kv2-f32-l2h2d3@4");
        let parsed: StoreKey = key.parse().unwrap();
        assert_eq!(parsed.hash(), ChunkHash(0xabc));
        let g = KvLayout {
            group_layers: 1,
            ..l
        };
        assert_eq!(
            g.group_key(ChunkHash(0xabc), 0),
            "m000000000000feed@0000000000000abc@kv2-f32-l2h2d3-g0of2@4"
        );
        assert_eq!(g.key(ChunkHash(0xabc)), g.group_key(ChunkHash(0xabc), 1));
        assert_eq!(g.key_format(), "kv2-f32-l2h2d3-g1of2");
        assert_eq!(KvLayout::group_layers_for(16, 4), 4);
        assert_eq!(KvLayout::group_layers_for(16, 3), 6);
        assert_eq!(KvLayout::group_layers_for(2, 4), 1);
        assert_eq!(KvLayout::group_layers_for(16, 0), 16);
    }
}
