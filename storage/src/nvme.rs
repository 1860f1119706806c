//! The NVMe tier: objects on a file or block device, O_DIRECT, driven by
//! io_uring through glommio's `DmaFile`, one region per shard.
//!
//! # On-device format (a compatibility contract)
//!
//! ```text
//!  file:   [ region 0 ][ region 1 ] ... [ region n-1 ]        region = capacity / n, 4 KiB multiple
//!  region: [ superblock 4 KiB ][ slot table: slots x 512 B ][ data area: 4 KiB blocks ]
//!
//!  superblock: "KVNV" | version u32 | region u32 | regions u32 | region_bytes u64 | slots u32 |
//!              pad u32 | data_offset u64 | capacity u64 | xxh3(previous 48 bytes) u64
//!  slot record (512 B, one sector):
//!              "KVRC" | live u32 | seq u64 | offset u64 | extent u64 | value_len u64 |
//!              value_sum u64 | key_hash u64 | copy_version u64 | zeros .. |
//!              xxh3(bytes 0..504) u64
//!  object extent (at `offset` in the region):
//!              header: "KVOB" | version u16 | key_len u16 | seq u64 | value_len u64 |
//!                      value_sum u64 | header_sum u64 | copy_version u64 |
//!                      zeros to 64 | key
//!              value: right after the key when 64 + key + value fit one block
//!                     (a small object is one 4 KiB I/O); otherwise from the next
//!                     block boundary; the extent is padded to 4 KiB
//! ```
//!
//! `copy_version` is the caller's name for the copy (the master's version of
//! the object incarnation it holds), 0 for none: files written before it was
//! kept hold zeros there and read as version 0. The header's copy is not under
//! `header_sum` (whose span predates it); it must equal the record's, which
//! is under the record's checksum.
//!
//! # Crash consistency
//!
//! A write puts the extent (header + value + checksums) on the device and
//! syncs it, and only then puts the slot record that makes it part of the
//! index into the table's image; the image's block is written (and synced)
//! in the background, group-committed with its neighbours' records, and
//! `flush` waits for every record so far. A write returns after its data
//! write: the record's write does not add a second device round trip to
//! every put. A crash before the record leaves free space behind, never an
//! index entry pointing at missing bytes; the storage node flushes before it
//! tells the master an object is on NVMe, so what the master lists survives
//! a crash. Records are one sector each, so a torn write of a table block
//! leaves every record either old or new; a record that fails its checksum
//! is dropped at recovery. Values are
//! checked against their checksum on every read: a torn or corrupt value is
//! `Corrupt`, never returned as data.
//!
//! # Eviction contract
//!
//! Past `high_watermark` the tier picks victims (oldest write first for
//! `Fifo`, least recently read first for `Lru`) until it would be back under
//! `low_watermark`, and marks them evicting: no new read gets them, their
//! space is not reused. The caller reports them to the master and then calls
//! [`NvmeShard::release`], which removes them durably and frees the space.

use std::cell::{Cell, RefCell};
use std::path::Path;
use std::rc::Rc;
use std::time::{Duration, Instant};

use glommio::io::{DmaFile, OpenOptions, ReadResult};
use kvpool_runtime::hash::value_sum;
use xxhash_rust::xxh3::xxh3_64;

use crate::fast_read::{self, FastReader};
pub use crate::tier_index::{Eviction, Space};
use crate::tier_index::{Found, Record, Refused, TierIndex};

/// The unit of every I/O and allocation (O_DIRECT alignment).
pub const BLOCK: u64 = 4096;
const _: () = assert!(BLOCK.is_multiple_of(4096));
const RECORD: usize = 512;
const RECORDS_PER_BLOCK: usize = BLOCK as usize / RECORD;
/// Locks striping the slot-table blocks (see `SlotTable::commit`).
const TABLE_LOCKS: usize = 16;
const _: () = assert!((BLOCK as usize).is_multiple_of(RECORD));
const HEADER_FIXED: usize = 64;
/// Longest key the tier stores.
pub const MAX_KEY_BYTES: usize = 4096;
const SB_MAGIC: [u8; 4] = *b"KVNV";
const REC_MAGIC: [u8; 4] = *b"KVRC";
const OBJ_MAGIC: [u8; 4] = *b"KVOB";
const VERSION: u32 = 1;
/// Table blocks read or written per I/O at recovery and format.
const TABLE_IO_BLOCKS: u64 = 256;
/// The longest a removal waits for another removal of the same copy to
/// end (one record write).
const REMOVAL_WAIT: Duration = Duration::from_secs(5);

/// Settings of the tier.
#[derive(Debug, Clone)]
pub struct NvmeConfig {
    /// Bytes of the file or device the tier uses.
    pub capacity: u64,
    /// Regions (one per shard).
    pub regions: u32,
    /// Expected mean object size; sizes the slot table (objects per region).
    pub avg_object_bytes: u64,
    pub high_watermark: f64,
    pub low_watermark: f64,
    pub eviction: Eviction,
    /// fdatasync after every data and record write (off: faster, but a power
    /// loss may lose recent objects; a process crash loses nothing).
    pub sync_writes: bool,
}

impl Default for NvmeConfig {
    fn default() -> Self {
        Self {
            capacity: 1 << 30,
            regions: 1,
            avg_object_bytes: 256 << 10,
            high_watermark: 0.95,
            low_watermark: 0.85,
            eviction: Eviction::Fifo,
            sync_writes: true,
        }
    }
}

impl NvmeConfig {
    /// Bytes to evict now, the tier's rule: past the high watermark or with
    /// no slot free, down to the low watermark (at least one copy when no
    /// slot is free); else, with `need` bytes wanted and no free extent that
    /// large, `need` of them; else none. Copies already evicting count as
    /// gone. The node runs it on its regions and the cluster simulation on
    /// its tiers.
    pub fn bytes_to_evict(&self, s: Space, need: u64) -> u64 {
        let high = (self.high_watermark * s.capacity as f64) as u64;
        let low = (self.low_watermark * s.capacity as f64) as u64;
        let target = if s.used > high || s.short_of_slots {
            low
        } else if need > 0 && s.largest_free < need {
            s.used.saturating_sub(need)
        } else {
            return 0;
        };
        match s.used.saturating_sub(s.evicting).saturating_sub(target) {
            0 if s.short_of_slots => 1,
            want => want,
        }
    }
}

/// Where an object lies: its region and slot. Packs into a u64 for the
/// master's replica records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct NvmeLoc {
    pub region: u32,
    pub slot: u32,
}

impl NvmeLoc {
    pub fn pack(self) -> u64 {
        ((self.region as u64) << 32) | self.slot as u64
    }

    pub fn unpack(v: u64) -> Self {
        Self {
            region: (v >> 32) as u32,
            slot: v as u32,
        }
    }
}

/// An object found on the device at open.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recovered {
    pub key: Vec<u8>,
    pub loc: NvmeLoc,
    pub len: u64,
    /// xxh3-64 of the value, as its record and header hold it.
    pub sum: u64,
    /// The copy's write sequence number (see [`NvmeShard::copy_seq`]).
    pub seq: u64,
    /// The version it was written with (see [`NvmeShard::write_versioned`]).
    pub version: u64,
}

/// Errors of the tier.
#[derive(Debug, thiserror::Error)]
pub enum NvmeError {
    #[error("nvme io: {0}")]
    Io(String),
    #[error("nvme: object at {loc:?} is corrupt ({why})")]
    Corrupt { loc: NvmeLoc, why: String },
    #[error("nvme: no room ({0})")]
    NoSpace(String),
    #[error("nvme: no object at {0:?}")]
    NotFound(NvmeLoc),
    #[error("nvme: {0}")]
    Invalid(String),
}

fn io(e: impl std::fmt::Display) -> NvmeError {
    NvmeError::Io(e.to_string())
}

/// A record in the table image until its write ends: dropped before (the
/// write failed, or was dropped), it takes the record back out (unless a
/// later change of the slot replaced it already).
struct RecordUndo<'a> {
    table: &'a SlotTable,
    slot: u32,
    record: [u8; RECORD],
    before: [u8; RECORD],
    done: bool,
}

impl Drop for RecordUndo<'_> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let at = self.slot as usize * RECORD;
        let mut im = self.table.image.borrow_mut();
        if im.bytes[at..at + RECORD] == self.record[..] {
            im.bytes[at..at + RECORD].copy_from_slice(&self.before);
        }
    }
}

/// A removal between its tombstone and its free: dropped before the free
/// (its write failed, or the removal was dropped), the copy may be removed
/// again.
struct RemovalUnderWay<'a> {
    index: &'a RefCell<TierIndex>,
    slot: u32,
    freed: bool,
}

impl Drop for RemovalUnderWay<'_> {
    fn drop(&mut self) {
        if !self.freed {
            self.index.borrow_mut().removal_failed(self.slot);
        }
    }
}

/// A copy [`NvmeShard::evict_candidates`] marked for eviction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Victim {
    pub key: Vec<u8>,
    pub loc: NvmeLoc,
    /// The incarnation it is a copy of (what the `Evicted` report names).
    pub version: u64,
    /// Its write's number: [`NvmeShard::release`] frees only this copy.
    pub seq: u64,
}

/// Geometry of one region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Geometry {
    region_bytes: u64,
    slots: u32,
    data_offset: u64,
}

impl Geometry {
    fn of(cfg: &NvmeConfig) -> Result<Self, NvmeError> {
        if cfg.regions == 0 {
            return Err(NvmeError::Invalid("regions must be at least 1".into()));
        }
        let region_bytes = (cfg.capacity / cfg.regions as u64) / BLOCK * BLOCK;
        let want = (region_bytes / cfg.avg_object_bytes.max(BLOCK)).clamp(64, 1 << 20);
        let slots = want.next_multiple_of(RECORDS_PER_BLOCK as u64) as u32;
        let data_offset = BLOCK + slots as u64 * RECORD as u64;
        if region_bytes < data_offset + 16 * BLOCK {
            return Err(NvmeError::Invalid(format!(
                "capacity {} over {} regions leaves no data area",
                cfg.capacity, cfg.regions
            )));
        }
        Ok(Self {
            region_bytes,
            slots,
            data_offset,
        })
    }

    fn table_blocks(&self) -> u64 {
        self.slots as u64 * RECORD as u64 / BLOCK
    }
}

/// A live slot record as recovery reads it from the table.
#[derive(Clone, Copy)]
struct LiveRecord {
    slot: u32,
    key_hash: u64,
    rec: Record,
}

/// The slot table's in-memory image and what of it is on the device.
struct TableImage {
    bytes: Vec<u8>,
    /// Per table block: how many record changes it has had in memory, and
    /// how many of those are on the device.
    changes: Vec<u64>,
    on_device: Vec<u64>,
    /// Blocks with changes not yet on the device.
    dirty: std::collections::BTreeSet<usize>,
}

/// A region's slot table: the image, and the writes that put it on the
/// device (group commit, see [`SlotTable::commit`]). Shared with the
/// background commits of [`NvmeShard::write`].
struct SlotTable {
    file: Rc<DmaFile>,
    /// Offset of the table in the file.
    at: u64,
    sync: bool,
    /// Serialize writes of one table block (block % TABLE_LOCKS picks the
    /// lock), so a later image of a block never lands before an earlier
    /// one; writes of different blocks proceed side by side.
    locks: Vec<glommio::sync::Semaphore>,
    image: RefCell<TableImage>,
}

impl SlotTable {
    /// Puts `record` in slot `slot`'s place in the image: the block, the
    /// block's change number, and the record it replaced.
    fn set(&self, slot: u32, record: &[u8; RECORD]) -> (usize, u64, [u8; RECORD]) {
        let block = slot as usize / RECORDS_PER_BLOCK;
        let at = slot as usize * RECORD;
        let mut im = self.image.borrow_mut();
        let mut before = [0u8; RECORD];
        before.copy_from_slice(&im.bytes[at..at + RECORD]);
        im.bytes[at..at + RECORD].copy_from_slice(record);
        im.changes[block] += 1;
        im.dirty.insert(block);
        (block, im.changes[block], before)
    }

    /// Puts change `upto` of `block` on the device, durably.
    ///
    /// Group commit: the writer takes the block's lock and writes the
    /// block's whole image, which carries every record changed in it so
    /// far. One that finds its change already on the device (an earlier
    /// holder's image carried it) returns without an I/O. Only records whose
    /// object bytes are already durable enter the image, so an image never
    /// puts an index entry on the device before its object.
    async fn commit(&self, block: usize, upto: u64) -> Result<(), NvmeError> {
        let _g = self.locks[block % TABLE_LOCKS]
            .acquire_permit(1)
            .await
            .map_err(io)?;
        let (image, changes) = {
            let im = self.image.borrow();
            if im.on_device[block] >= upto {
                return Ok(());
            }
            let b0 = block * BLOCK as usize;
            (
                im.bytes[b0..b0 + BLOCK as usize].to_vec(),
                im.changes[block],
            )
        };
        write_at(&self.file, self.at + BLOCK * block as u64, &image).await?;
        if self.sync {
            self.file.fdatasync().await.map_err(io)?;
        }
        let mut im = self.image.borrow_mut();
        let d = &mut im.on_device[block];
        *d = (*d).max(changes);
        if im.on_device[block] >= im.changes[block] {
            im.dirty.remove(&block);
        }
        Ok(())
    }

    /// Puts every change made so far on the device.
    async fn flush(&self) -> Result<(), NvmeError> {
        let todo: Vec<(usize, u64)> = {
            let im = self.image.borrow();
            im.dirty.iter().map(|b| (*b, im.changes[*b])).collect()
        };
        for (block, upto) in todo {
            self.commit(block, upto).await?;
        }
        Ok(())
    }
}

async fn write_at(file: &DmaFile, pos: u64, bytes: &[u8]) -> Result<(), NvmeError> {
    let mut buf = file.alloc_dma_buffer(bytes.len());
    buf.as_bytes_mut().copy_from_slice(bytes);
    // The buffer is moved into the operation: the kernel owns it until the
    // write completes.
    let n = file.write_at(buf, pos).await.map_err(io)?;
    if n != bytes.len() {
        return Err(NvmeError::Io(format!(
            "short write at {pos}: {n} of {}",
            bytes.len()
        )));
    }
    Ok(())
}

/// Counters and latencies of one region.
#[derive(Default)]
pub struct NvmeStats {
    pub writes: Cell<u64>,
    pub reads: Cell<u64>,
    pub written_bytes: Cell<u64>,
    pub read_bytes: Cell<u64>,
    pub corrupt: Cell<u64>,
    pub evictions: Cell<u64>,
    pub write_latency: RefCell<Option<hdrhistogram::Histogram<u64>>>,
    pub read_latency: RefCell<Option<hdrhistogram::Histogram<u64>>>,
}

impl NvmeStats {
    fn record(h: &RefCell<Option<hdrhistogram::Histogram<u64>>>, took: Duration) {
        let mut h = h.borrow_mut();
        let h = h.get_or_insert_with(|| {
            hdrhistogram::Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("bounds")
        });
        h.saturating_record(took.as_nanos() as u64);
    }
}

/// A value read from the tier: the read buffer and where the value lies in it.
pub struct NvmeValue {
    buf: ReadBuf,
    start: usize,
    len: usize,
}

/// A read's bytes: glommio's DMA buffer, or a copy out of a fast-read slot.
enum ReadBuf {
    Dma(ReadResult),
    Owned(Vec<u8>),
}

impl std::ops::Deref for ReadBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            ReadBuf::Dma(b) => b,
            ReadBuf::Owned(v) => v,
        }
    }
}

impl std::ops::Deref for NvmeValue {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.buf[self.start..self.start + self.len]
    }
}

/// One region of the tier, owned by one shard (not `Send`: it lives on the
/// shard's glommio executor).
pub struct NvmeShard {
    file: Rc<DmaFile>,
    region: u32,
    base: u64,
    geo: Geometry,
    cfg: NvmeConfig,
    state: RefCell<TierIndex>,
    table: Rc<SlotTable>,
    /// The ring for reads of up to `fast_read::SLOT_BYTES` (made on first
    /// use; `None` inside if it could not be, then glommio reads them).
    fast: std::cell::OnceCell<Option<FastReader>>,
    pub stats: NvmeStats,
}

/// Makes sure the first block of a new file is allocated before glommio
/// opens it. glommio decides whether a device supports IOPOLL by reading
/// offset 0 through the poll ring: on a new, sparse file that read hits a hole
/// and succeeds without touching the device, glommio then turns the poll ring
/// on for the whole device, and every later read of real data fails with
/// EOPNOTSUPP on devices without polling (virtio disks, most file systems).
/// A block device, or a file with data at offset 0, is left alone; a file
/// made ahead as a sparse file (`truncate -s`) has a hole there too.
fn ensure_block_zero(path: &Path) -> Result<(), NvmeError> {
    use std::io::Write;
    use std::os::unix::fs::FileTypeExt;
    match std::fs::metadata(path) {
        Ok(m) if m.file_type().is_block_device() => return Ok(()),
        Ok(m) if m.len() >= BLOCK && !hole_at_zero(path) => return Ok(()),
        Ok(_) | Err(_) => {}
    }
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(|e| NvmeError::Io(format!("cannot create {}: {e}", path.display())))?;
    // Not a superblock: `open` formats a region whose magic is missing.
    f.write_all(&[0xa5; BLOCK as usize])
        .and_then(|_| f.sync_all())
        .map_err(|e| NvmeError::Io(format!("cannot write {}: {e}", path.display())))
}

/// Whether the file's first byte is in a hole (SEEK_DATA from 0 lands
/// further on, or finds no data). A file system without SEEK_DATA reports
/// data everywhere: no hole. Block zero is a region header, so a hole there
/// holds no object: writing it loses nothing (`open` formats the region).
fn hole_at_zero(path: &Path) -> bool {
    let Ok(f) = std::fs::File::open(path) else {
        return false;
    };
    match rustix::fs::seek(&f, rustix::fs::SeekFrom::Data(0)) {
        Ok(at) => at > 0,
        Err(e) => e == rustix::io::Errno::NXIO,
    }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

fn header_len(key_len: usize) -> u64 {
    ((HEADER_FIXED + key_len) as u64).next_multiple_of(BLOCK)
}

/// The bytes of the tier an object of `value_len` bytes under a key of
/// `key_len` takes (its header, its value, rounded to blocks).
pub fn extent(key_len: usize, value_len: u64) -> u64 {
    layout(key_len, value_len).1
}

/// Where an object's value starts in its extent, and the extent's size.
fn layout(key_len: usize, value_len: u64) -> (u64, u64) {
    let inline = (HEADER_FIXED + key_len) as u64;
    if inline + value_len <= BLOCK {
        (inline, BLOCK)
    } else {
        let start = header_len(key_len);
        (start, start + value_len.max(1).next_multiple_of(BLOCK))
    }
}

/// The header's checksum: its first 32 bytes, then the key (no copy: the
/// key is hashed with the first part's hash as its seed).
fn header_sum(h: &[u8], key: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(key, xxh3_64(&h[0..32]))
}

impl NvmeShard {
    /// Opens region `region` of the tier at `path` (creating and formatting
    /// what is not there yet) and recovers the objects its index lists.
    pub async fn open(
        path: &Path,
        cfg: NvmeConfig,
        region: u32,
    ) -> Result<(Self, Vec<Recovered>), NvmeError> {
        let geo = Geometry::of(&cfg)?;
        if region >= cfg.regions {
            return Err(NvmeError::Invalid(format!(
                "region {region} of {}",
                cfg.regions
            )));
        }
        ensure_block_zero(path)?;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .dma_open(path)
            .await
            .map_err(|e| NvmeError::Io(format!("cannot open {}: {e}", path.display())))?;
        let size = file.file_size().await.map_err(io)?;
        if size < cfg.capacity {
            // Allocate the blocks now (fallocate): writes then never wait on
            // the file system's block allocation. A file system without
            // fallocate gets a sparse file instead.
            if file.pre_allocate(cfg.capacity, false).await.is_err() {
                file.truncate(cfg.capacity).await.map_err(|e| {
                    NvmeError::Io(format!(
                        "cannot size {} to {} bytes: {e}",
                        path.display(),
                        cfg.capacity
                    ))
                })?;
            }
        }
        let base = region as u64 * geo.region_bytes;
        let data_bytes = geo.region_bytes - geo.data_offset;
        let file = Rc::new(file);
        let blocks = geo.table_blocks() as usize;
        let shard = Self {
            table: Rc::new(SlotTable {
                file: file.clone(),
                at: base + BLOCK,
                sync: cfg.sync_writes,
                locks: (0..TABLE_LOCKS)
                    .map(|_| glommio::sync::Semaphore::new(1))
                    .collect(),
                image: RefCell::new(TableImage {
                    bytes: vec![0u8; geo.slots as usize * RECORD],
                    changes: vec![0; blocks],
                    on_device: vec![0; blocks],
                    dirty: Default::default(),
                }),
            }),
            file,
            region,
            base,
            geo,
            state: RefCell::new(TierIndex::new(
                geo.data_offset,
                data_bytes,
                BLOCK,
                geo.slots,
            )),
            fast: std::cell::OnceCell::new(),
            stats: NvmeStats::default(),
            cfg,
        };
        let sb = shard
            .file
            .read_at_aligned(base, BLOCK as usize)
            .await
            .map_err(io)?;
        let recovered = if sb.len() == BLOCK as usize && sb[0..4] == SB_MAGIC {
            shard.check_superblock(&sb)?;
            shard.recover().await?
        } else {
            shard.format().await?;
            Vec::new()
        };
        Ok((shard, recovered))
    }

    fn superblock(&self) -> Vec<u8> {
        let mut b = vec![0u8; BLOCK as usize];
        b[0..4].copy_from_slice(&SB_MAGIC);
        b[4..8].copy_from_slice(&VERSION.to_le_bytes());
        b[8..12].copy_from_slice(&self.region.to_le_bytes());
        b[12..16].copy_from_slice(&self.cfg.regions.to_le_bytes());
        b[16..24].copy_from_slice(&self.geo.region_bytes.to_le_bytes());
        b[24..28].copy_from_slice(&self.geo.slots.to_le_bytes());
        b[32..40].copy_from_slice(&self.geo.data_offset.to_le_bytes());
        b[40..48].copy_from_slice(&self.cfg.capacity.to_le_bytes());
        let sum = xxh3_64(&b[0..48]);
        b[48..56].copy_from_slice(&sum.to_le_bytes());
        b
    }

    fn check_superblock(&self, sb: &[u8]) -> Result<(), NvmeError> {
        let want = self.superblock();
        if xxh3_64(&sb[0..48]) != u64_at(sb, 48) {
            return Err(NvmeError::Invalid(format!(
                "region {}: the superblock fails its checksum; refusing to reuse the file",
                self.region
            )));
        }
        if sb[0..48] != want[0..48] {
            return Err(NvmeError::Invalid(format!(
                "region {}: the file was formatted with another layout (capacity, regions or \
                 slots differ); use a new path, or delete the file to start empty",
                self.region
            )));
        }
        Ok(())
    }

    async fn sync(&self) -> Result<(), NvmeError> {
        if self.cfg.sync_writes {
            self.file.fdatasync().await.map_err(io)?;
        }
        Ok(())
    }

    async fn format(&self) -> Result<(), NvmeError> {
        let zeros = vec![0u8; (TABLE_IO_BLOCKS * BLOCK) as usize];
        let blocks = self.geo.table_blocks();
        let mut b = 0;
        while b < blocks {
            let n = (blocks - b).min(TABLE_IO_BLOCKS);
            write_at(
                &self.file,
                self.base + BLOCK * (1 + b),
                &zeros[..(n * BLOCK) as usize],
            )
            .await?;
            b += n;
        }
        self.file.fdatasync().await.map_err(io)?;
        write_at(&self.file, self.base, &self.superblock()).await?;
        self.file.fdatasync().await.map_err(io)?;
        Ok(())
    }

    async fn recover(&self) -> Result<Vec<Recovered>, NvmeError> {
        let blocks = self.geo.table_blocks();
        let mut table = vec![0u8; self.geo.slots as usize * RECORD];
        let mut b = 0;
        while b < blocks {
            let n = (blocks - b).min(TABLE_IO_BLOCKS);
            let r = self
                .file
                .read_at_aligned(self.base + BLOCK * (1 + b), (n * BLOCK) as usize)
                .await
                .map_err(io)?;
            let at = (b * BLOCK) as usize;
            table[at..at + r.len()].copy_from_slice(&r);
            b += n;
        }
        // Live records, newest first per key.
        let mut live: Vec<LiveRecord> = Vec::new();
        for slot in 0..self.geo.slots {
            let r = &table[slot as usize * RECORD..(slot as usize + 1) * RECORD];
            if r[0..4] != REC_MAGIC {
                continue;
            }
            if xxh3_64(&r[0..504]) != u64_at(r, 504) {
                tracing::warn!(
                    region = self.region,
                    slot,
                    "nvme: slot record fails its checksum; dropped"
                );
                continue;
            }
            if u32_at(r, 4) != 1 {
                continue;
            }
            live.push(LiveRecord {
                slot,
                key_hash: u64_at(r, 48),
                rec: Record {
                    seq: u64_at(r, 8),
                    offset: u64_at(r, 16),
                    extent: u64_at(r, 24),
                    len: u64_at(r, 32),
                    sum: u64_at(r, 40),
                    version: u64_at(r, 56),
                },
            });
        }
        live.sort_by_key(|l| std::cmp::Reverse(l.rec.seq));
        let mut out = Vec::new();
        let mut drop_slots = Vec::new();
        for l in live {
            let (slot, r) = (l.slot, l.rec);
            let ok_geometry = r.offset >= self.geo.data_offset
                && r.offset.is_multiple_of(BLOCK)
                && r.offset
                    .checked_add(r.extent)
                    .is_some_and(|e| e <= self.geo.region_bytes)
                && r.extent >= BLOCK
                && r.extent.is_multiple_of(BLOCK);
            let key = if ok_geometry {
                self.read_header(&l).await
            } else {
                None
            };
            let found = self.state.borrow_mut().recover(slot, key.as_deref(), r);
            let why = match found {
                Found::Kept => {
                    out.push(Recovered {
                        key: key.expect("kept with its key"),
                        loc: NvmeLoc {
                            region: self.region,
                            slot,
                        },
                        len: r.len,
                        sum: r.sum,
                        seq: r.seq,
                        version: r.version,
                    });
                    continue;
                }
                Found::Torn => Some("object header is torn or corrupt"),
                // An older copy of a key stored again: the newest wins.
                Found::Older => None,
                Found::Overlaps => Some("extent overlaps another object"),
            };
            if let Some(why) = why {
                tracing::warn!(region = self.region, slot, "nvme: {why}; dropped");
            }
            drop_slots.push(slot);
        }
        self.state.borrow_mut().recovered();
        {
            let mut im = self.table.image.borrow_mut();
            im.bytes = table;
            // Dropped records become free slots; clearing them on the device
            // waits for the next write of their table block.
            for s in &drop_slots {
                let at = *s as usize * RECORD;
                im.bytes[at..at + RECORD].fill(0);
            }
        }
        Ok(out)
    }

    /// Reads and checks the header of a live record's extent against the
    /// record; returns its key.
    async fn read_header(&self, l: &LiveRecord) -> Option<Vec<u8>> {
        let key_hash = l.key_hash;
        let Record {
            offset,
            extent,
            seq,
            len,
            sum,
            version,
        } = l.rec;
        let h = self
            .file
            .read_at_aligned(self.base + offset, BLOCK as usize)
            .await
            .ok()?;
        if h.len() < BLOCK as usize || h[0..4] != OBJ_MAGIC {
            return None;
        }
        let key_len = u16::from_le_bytes([h[6], h[7]]) as usize;
        let hlen = header_len(key_len) as usize;
        let full;
        let hb: &[u8] = if hlen > BLOCK as usize {
            full = self
                .file
                .read_at_aligned(self.base + offset, hlen)
                .await
                .ok()?;
            &full
        } else {
            &h
        };
        if hb.len() < HEADER_FIXED + key_len {
            return None;
        }
        let key = &hb[HEADER_FIXED..HEADER_FIXED + key_len];
        let ok = layout(key_len, len).1 == extent
            && u64_at(hb, 8) == seq
            && u64_at(hb, 16) == len
            && u64_at(hb, 24) == sum
            && u64_at(hb, 32) == header_sum(hb, key)
            && u64_at(hb, 40) == version
            && xxh3_64(key) == key_hash;
        ok.then(|| key.to_vec())
    }

    fn record_bytes(live: bool, key: &[u8], e: &Record) -> [u8; RECORD] {
        let mut r = [0u8; RECORD];
        r[0..4].copy_from_slice(&REC_MAGIC);
        r[4..8].copy_from_slice(&u32::from(live).to_le_bytes());
        r[8..16].copy_from_slice(&e.seq.to_le_bytes());
        r[16..24].copy_from_slice(&e.offset.to_le_bytes());
        r[24..32].copy_from_slice(&e.extent.to_le_bytes());
        r[32..40].copy_from_slice(&e.len.to_le_bytes());
        r[40..48].copy_from_slice(&e.sum.to_le_bytes());
        r[48..56].copy_from_slice(&xxh3_64(key).to_le_bytes());
        r[56..64].copy_from_slice(&e.version.to_le_bytes());
        let s = xxh3_64(&r[0..504]);
        r[504..512].copy_from_slice(&s.to_le_bytes());
        r
    }

    /// Writes slot `slot`'s table block with `record` in it, durably. A
    /// write that fails, or is dropped before it ends, takes the record
    /// back out of the image, so no later commit of the block puts it on
    /// the device.
    async fn write_record(&self, slot: u32, record: &[u8; RECORD]) -> Result<(), NvmeError> {
        let (block, mine, before) = self.table.set(slot, record);
        let mut undo = RecordUndo {
            table: &self.table,
            slot,
            record: *record,
            before,
            done: false,
        };
        let res = self.table.commit(block, mine).await;
        undo.done = res.is_ok();
        res
    }

    /// Puts the index records of every write so far on the device: objects
    /// written before this call are found again by a restart after it
    /// returns.
    pub async fn flush(&self) -> Result<(), NvmeError> {
        self.table.flush().await
    }

    /// Slot-table blocks with records not yet on the device.
    pub fn unflushed_blocks(&self) -> usize {
        self.table.image.borrow().dirty.len()
    }

    /// Stores `value` under `key`. When this returns the object is readable
    /// and its bytes are on the device (synced with `sync_writes`); its
    /// index record follows in the background, and a restart finds the
    /// object once it is there: [`NvmeShard::flush`] waits for that.
    pub async fn write(&self, key: &[u8], value: &[u8]) -> Result<NvmeLoc, NvmeError> {
        self.write_versioned(key, value, 0).await
    }

    /// [`NvmeShard::write`] of a copy named `version` (the caller's name for
    /// it, kept in its record and header; see [`NvmeShard::copy_version`]).
    pub async fn write_versioned(
        &self,
        key: &[u8],
        value: &[u8],
        version: u64,
    ) -> Result<NvmeLoc, NvmeError> {
        if key.is_empty() || key.len() > MAX_KEY_BYTES {
            return Err(NvmeError::Invalid(format!("key of {} bytes", key.len())));
        }
        let started = Instant::now();
        let (vstart, extent) = layout(key.len(), value.len() as u64);
        let place = self
            .state
            .borrow_mut()
            .reserve(key, extent)
            .map_err(|r| match r {
                Refused::KeyStored => {
                    NvmeError::Invalid("the key is already stored in this region".into())
                }
                Refused::NoSlot => {
                    NvmeError::NoSpace(format!("all {} slots in use", self.geo.slots))
                }
                Refused::NoExtent => NvmeError::NoSpace(format!("no {extent}-byte extent free")),
            })?;
        let (slot, offset, seq) = (place.slot, place.offset, place.seq);
        let sum = value_sum(value);
        let record = place.record(value.len() as u64, sum, version);
        let res = async {
            let mut buf = self.file.alloc_dma_buffer(extent as usize);
            let b = buf.as_bytes_mut();
            b[..vstart as usize].fill(0);
            b[0..4].copy_from_slice(&OBJ_MAGIC);
            b[4..6].copy_from_slice(&(VERSION as u16).to_le_bytes());
            b[6..8].copy_from_slice(&(key.len() as u16).to_le_bytes());
            b[8..16].copy_from_slice(&seq.to_le_bytes());
            b[16..24].copy_from_slice(&(value.len() as u64).to_le_bytes());
            b[24..32].copy_from_slice(&sum.to_le_bytes());
            b[HEADER_FIXED..HEADER_FIXED + key.len()].copy_from_slice(key);
            let hs = header_sum(b, key);
            b[32..40].copy_from_slice(&hs.to_le_bytes());
            b[40..48].copy_from_slice(&version.to_le_bytes());
            let v0 = vstart as usize;
            b[v0..v0 + value.len()].copy_from_slice(value);
            b[v0 + value.len()..].fill(0);
            // The buffer is moved into the operation until it completes.
            let n = self
                .file
                .write_at(buf, self.base + offset)
                .await
                .map_err(io)?;
            if n as u64 != extent {
                return Err(NvmeError::Io(format!("short write: {n} of {extent}")));
            }
            self.sync().await?;
            // The record enters the image now (the bytes are on the device)
            // and reaches the device in the background: the write returns
            // after one device write, not two in a row. `flush` waits for it.
            let bytes = Self::record_bytes(true, key, &record);
            let (block, change, _) = self.table.set(slot, &bytes);
            let (table, region) = (self.table.clone(), self.region);
            glommio::spawn_local(async move {
                if let Err(e) = table.commit(block, change).await {
                    tracing::warn!(
                        region,
                        "nvme: an index record did not reach the device ({e}); the next \
                         write of its block or flush retries"
                    );
                }
            })
            .detach();
            Ok(())
        }
        .await;
        let mut st = self.state.borrow_mut();
        match res {
            Ok(()) => {
                st.insert(slot, key, record);
                self.stats.writes.set(self.stats.writes.get() + 1);
                self.stats
                    .written_bytes
                    .set(self.stats.written_bytes.get() + value.len() as u64);
                NvmeStats::record(&self.stats.write_latency, started.elapsed());
                Ok(NvmeLoc {
                    region: self.region,
                    slot,
                })
            }
            Err(e) => {
                // Nothing points at the extent yet: give it back.
                st.unreserve(place);
                Err(e)
            }
        }
    }

    fn check_loc(&self, loc: NvmeLoc) -> Result<(), NvmeError> {
        if loc.region != self.region || loc.slot >= self.geo.slots {
            return Err(NvmeError::NotFound(loc));
        }
        Ok(())
    }

    /// Reads the object at `loc`; its checksum is verified.
    pub async fn read(&self, loc: NvmeLoc) -> Result<NvmeValue, NvmeError> {
        self.read_if(loc, |_, _| true).await
    }

    /// Reads the object at `loc` if `wanted` says so of its key and version
    /// (else `NotFound`: the slot holds another copy); its checksum is
    /// verified, and the bytes are those of the copy `wanted` saw (a slot
    /// reused while the read is in flight fails it).
    pub async fn read_if(
        &self,
        loc: NvmeLoc,
        wanted: impl FnOnce(&[u8], u64) -> bool,
    ) -> Result<NvmeValue, NvmeError> {
        self.check_loc(loc)?;
        let started = Instant::now();
        let (offset, extent, len, sum, seq, version) = {
            let mut st = self.state.borrow_mut();
            let e = st
                .read(loc.slot, wanted)
                .ok_or(NvmeError::NotFound(loc))?
                .record;
            (e.offset, e.extent, e.len, e.sum, e.seq, e.version)
        };
        let buf = match self.fast_reader(extent) {
            Some(f) => ReadBuf::Owned(
                f.read(self.base + offset, extent as usize)
                    .await
                    .map_err(io)?,
            ),
            None => ReadBuf::Dma(
                self.file
                    .read_at_aligned(self.base + offset, extent as usize)
                    .await
                    .map_err(io)?,
            ),
        };
        let corrupt = |why: &str| {
            self.stats.corrupt.set(self.stats.corrupt.get() + 1);
            NvmeError::Corrupt {
                loc,
                why: why.to_string(),
            }
        };
        if buf.len() < extent as usize || buf[0..4] != OBJ_MAGIC {
            return Err(corrupt("bad object header"));
        }
        let key_len = u16::from_le_bytes([buf[6], buf[7]]) as usize;
        let (vstart, want_extent) = layout(key_len, len);
        let hlen = vstart as usize;
        let key_matches = {
            // The slot may have been reused while the read was in flight.
            let st = self.state.borrow();
            st.copy(loc.slot).is_some_and(|e| {
                e.record.seq == seq
                    && buf.get(HEADER_FIXED..HEADER_FIXED + key_len) == Some(&e.key[..])
            })
        };
        if !key_matches
            || want_extent != extent
            || u64_at(&buf, 8) != seq
            || u64_at(&buf, 40) != version
            || u64_at(&buf, 32) != header_sum(&buf, &buf[HEADER_FIXED..HEADER_FIXED + key_len])
        {
            return Err(corrupt("header does not match the index"));
        }
        let value = &buf[hlen..hlen + len as usize];
        if value_sum(value) != sum {
            return Err(corrupt("value checksum mismatch"));
        }
        self.stats.reads.set(self.stats.reads.get() + 1);
        self.stats.read_bytes.set(self.stats.read_bytes.get() + len);
        NvmeStats::record(&self.stats.read_latency, started.elapsed());
        Ok(NvmeValue {
            buf,
            start: hlen,
            len: len as usize,
        })
    }

    /// The fast-read ring, for an extent it serves.
    fn fast_reader(&self, extent: u64) -> Option<&FastReader> {
        if extent as usize > fast_read::SLOT_BYTES {
            return None;
        }
        self.fast
            .get_or_init(|| match FastReader::new(self.file.clone()) {
                Ok(f) => Some(f),
                Err(e) => {
                    tracing::warn!(
                        region = self.region,
                        "nvme: no io_uring ring for small reads ({e}); reading them through glommio"
                    );
                    None
                }
            })
            .as_ref()
    }

    /// The location of `key` in this region, if stored and not evicting.
    pub fn lookup(&self, key: &[u8]) -> Option<NvmeLoc> {
        let slot = self.state.borrow().lookup(key)?;
        Some(NvmeLoc {
            region: self.region,
            slot,
        })
    }

    /// Length and checksum of the value at `loc`, if an object is there.
    pub fn value_sum(&self, loc: NvmeLoc) -> Option<(u64, u64)> {
        self.check_loc(loc).ok()?;
        let st = self.state.borrow();
        st.copy(loc.slot).map(|e| (e.record.len, e.record.sum))
    }

    /// The write sequence number of the copy at `loc`, if one is there. It
    /// names one copy: a slot freed and reused holds a copy with a higher
    /// one (the numbers only grow while the region is open), so a caller
    /// that noted it can tell its copy from a later one in the same slot.
    pub fn copy_seq(&self, loc: NvmeLoc) -> Option<u64> {
        self.check_loc(loc).ok()?;
        let st = self.state.borrow();
        st.copy(loc.slot).map(|e| e.record.seq)
    }

    /// Whether `loc` still holds the copy written with sequence number
    /// `seq` (see [`NvmeShard::copy_seq`]): the index's rule, which the
    /// cluster simulation runs too.
    pub fn holds(&self, loc: NvmeLoc, seq: u64) -> bool {
        self.check_loc(loc).is_ok() && self.state.borrow().holds(loc.slot, seq)
    }

    /// Whether a removal of the copy at `loc` is under way (it may still
    /// fail and the copy stay).
    pub fn being_removed(&self, loc: NvmeLoc) -> bool {
        self.check_loc(loc).is_ok()
            && self
                .state
                .borrow()
                .copy(loc.slot)
                .is_some_and(|c| c.removing)
    }

    /// The version the copy at `loc` was written with, if one is there.
    pub fn copy_version(&self, loc: NvmeLoc) -> Option<u64> {
        self.check_loc(loc).ok()?;
        let st = self.state.borrow();
        st.copy(loc.slot).map(|e| e.record.version)
    }

    /// Removes the copy at `loc` if `takes` says so of its key and version
    /// (a Drop's rule: a slot reused by another key, or holding a later
    /// incarnation of the key, keeps its copy); whether it did. `takes`
    /// runs while the region's state is borrowed: it must not call the
    /// shard.
    pub async fn remove_if(
        &self,
        loc: NvmeLoc,
        takes: impl FnOnce(&[u8], u64) -> bool,
    ) -> Result<bool, NvmeError> {
        self.check_loc(loc)?;
        let seq = {
            let st = self.state.borrow();
            st.copy(loc.slot)
                .filter(|e| takes(&e.key, e.record.version))
                .map(|e| e.record.seq)
        };
        match seq {
            Some(seq) => self.remove_copy(loc, seq).await,
            None => Ok(false),
        }
    }

    /// Removes the copy at `loc` if it is still the one written with
    /// sequence number `seq` (see [`NvmeShard::copy_seq`]); whether this
    /// call removed it. Another removal of that copy under way is waited
    /// for: if it freed the copy, this one did not (false); if it failed,
    /// this one tries. A wait past 5 s (`REMOVAL_WAIT`) is an `Io` error,
    /// the copy untouched by this call.
    pub async fn remove_copy(&self, loc: NvmeLoc, seq: u64) -> Result<bool, NvmeError> {
        if self.check_loc(loc).is_err() {
            return Ok(false);
        }
        // No await between the last check and the tombstone.
        if !self.settled(loc, seq).await? {
            return Ok(false);
        }
        self.remove(loc).await?;
        Ok(true)
    }

    /// Waits while a removal of the copy at `loc` written as `seq` is under
    /// way (at most [`REMOVAL_WAIT`]); whether that copy is still there
    /// with no removal under way.
    async fn settled(&self, loc: NvmeLoc, seq: u64) -> Result<bool, NvmeError> {
        self.wait_while(
            |ix| {
                ix.copy(loc.slot)
                    .is_some_and(|c| c.record.seq == seq && c.removing)
            },
            || format!("the copy at {loc:?}"),
        )
        .await?;
        Ok(self.holds(loc, seq))
    }

    /// Waits while a removal of `key`'s copy is under way (at most 5 s,
    /// `REMOVAL_WAIT`, else an `Io` error): what a write of the key then
    /// finds is settled, a copy that stays or none.
    pub async fn key_settled(&self, key: &[u8]) -> Result<(), NvmeError> {
        self.wait_while(
            |ix| ix.removal_under_way(key),
            || format!("a copy of {}", String::from_utf8_lossy(key)),
        )
        .await
    }

    /// Waits while `removing` says a removal is under way, checking every
    /// 200 us for at most [`REMOVAL_WAIT`]; past it an `Io` error naming
    /// `what`. Returns with no await after its last check.
    async fn wait_while(
        &self,
        removing: impl Fn(&TierIndex) -> bool,
        what: impl FnOnce() -> String,
    ) -> Result<(), NvmeError> {
        let deadline = Instant::now() + REMOVAL_WAIT;
        while removing(&self.state.borrow()) {
            if Instant::now() >= deadline {
                return Err(NvmeError::Io(format!(
                    "a removal of {} did not end within {REMOVAL_WAIT:?}",
                    what()
                )));
            }
            glommio::timer::sleep(Duration::from_micros(200)).await;
        }
        Ok(())
    }

    /// Removes the object at `loc` durably and frees its space. `NotFound`
    /// when the slot is empty or another removal of its copy is under way
    /// ([`TierIndex::tombstone`]; [`NvmeShard::remove_copy`] waits for that
    /// one instead); when the tombstone's write fails, the copy stays and
    /// may be removed again.
    pub async fn remove(&self, loc: NvmeLoc) -> Result<(), NvmeError> {
        self.check_loc(loc)?;
        let tomb = self
            .state
            .borrow_mut()
            .tombstone(loc.slot)
            .ok_or(NvmeError::NotFound(loc))?;
        // Ends the removal as failed unless the record is written, also
        // when this future is dropped at the write.
        let mut under_way = RemovalUnderWay {
            index: &self.state,
            slot: loc.slot,
            freed: false,
        };
        self.write_record(
            loc.slot,
            &Self::record_bytes(false, &tomb.key, &tomb.record),
        )
        .await?;
        under_way.freed = true;
        self.state.borrow_mut().free(loc.slot);
        Ok(())
    }

    /// Bytes in use in the data area, and its size.
    pub fn usage(&self) -> (u64, u64) {
        self.state.borrow().usage()
    }

    pub fn objects(&self) -> usize {
        self.state.borrow().objects()
    }

    /// Every object the region holds now (not those being evicted or
    /// removed), in the form recovery reports them: what a node tells a
    /// master that has forgotten it. A copy left out because its removal
    /// was under way, and whose removal then failed, is in the next
    /// report.
    pub fn entries(&self) -> Vec<Recovered> {
        let st = self.state.borrow();
        st.entries()
            .map(|(slot, e)| Recovered {
                key: e.key.to_vec(),
                loc: NvmeLoc {
                    region: self.region,
                    slot,
                },
                len: e.record.len,
                sum: e.record.sum,
                seq: e.record.seq,
                version: e.record.version,
            })
            .collect()
    }

    /// Whether a write of `value_len` bytes under a `key_len`-byte key fits now.
    pub fn fits(&self, key_len: usize, value_len: u64) -> bool {
        let extent = header_len(key_len) + value_len.max(1).next_multiple_of(BLOCK);
        self.state.borrow().fits(extent)
    }

    /// Past the high watermark (or when `need` bytes are wanted and not
    /// free): picks victims until use would be under the low watermark (and
    /// `need` would fit), marks them evicting and returns them. The caller
    /// reports them (key, place and the copy's version), then calls
    /// [`NvmeShard::release`] for each.
    pub fn evict_candidates(&self, need: u64) -> Vec<Victim> {
        let mut st = self.state.borrow_mut();
        let want = self.cfg.bytes_to_evict(st.space(), need);
        let out: Vec<_> = st
            .mark_victims(self.cfg.eviction, want)
            .into_iter()
            .filter_map(|slot| {
                let e = st.copy(slot)?;
                let loc = NvmeLoc {
                    region: self.region,
                    slot,
                };
                Some(Victim {
                    key: e.key.to_vec(),
                    loc,
                    version: e.record.version,
                    seq: e.record.seq,
                })
            })
            .collect();
        self.stats
            .evictions
            .set(self.stats.evictions.get() + out.len() as u64);
        out
    }

    /// Frees an evicting object's space (after the master took its
    /// eviction). A removal that fails is owed ([`TierIndex::owe_release`]):
    /// [`NvmeShard::release_owed`] tries it again. Only the copy written as
    /// `seq` ([`Victim::seq`]), while marked evicting: a slot that no longer
    /// holds it (another removal freed it, and maybe a new copy took the
    /// slot) has nothing to release.
    pub async fn release(&self, loc: NvmeLoc, seq: u64) -> Result<(), NvmeError> {
        let marked = self.check_loc(loc).is_ok()
            && self
                .state
                .borrow()
                .copy(loc.slot)
                .is_some_and(|c| c.evicting && c.record.seq == seq);
        if !marked {
            return Ok(());
        }
        let r = self.remove_copy(loc, seq).await.map(|_| ());
        if r.is_err() {
            self.state.borrow_mut().owe_release(loc.slot);
        }
        r
    }

    /// Tries the owed releases again (each still owed if it fails again);
    /// how many went.
    pub async fn release_owed(&self) -> usize {
        let owed = self.state.borrow_mut().owed_releases();
        let mut n = 0;
        for (slot, seq) in owed {
            let loc = NvmeLoc {
                region: self.region,
                slot,
            };
            // Checked again after the earlier removals' awaits, with no
            // await before this one's tombstone: only that copy goes.
            if self.holds(loc, seq) && self.release(loc, seq).await.is_ok() {
                n += 1;
            }
        }
        n
    }

    /// Takes back the eviction of the copy at `loc` (the master was not
    /// told: it still lists the copy): readable again, its key found again,
    /// and a candidate of a later [`NvmeShard::evict_candidates`]. Whether a
    /// copy marked evicting was there.
    pub fn keep(&self, loc: NvmeLoc) -> bool {
        if self.check_loc(loc).is_err() {
            return false;
        }
        self.state.borrow_mut().keep(loc.slot)
    }

    pub fn region(&self) -> u32 {
        self.region
    }
}
