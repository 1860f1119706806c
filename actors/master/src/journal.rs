//! The master's durable state on disk: records, their encoding, the
//! per-shard log and its snapshots, and replay.
//!
//! This module knows files and bytes, not shards: a shard hands it encoded
//! records ([`Record::encode`]) to append, and gets back at start the
//! [`Image`] its directory holds ([`open_shard`], [`replay_file`]). The same records are what a
//! standby would be shipped.
//!
//! On disk, per shard, in `<state_dir>/shard-<i>/`:
//!
//! ```text
//!  snap-<g>   the shard's durable state as records, complete (written to
//!             snap-<g>.tmp, then renamed)
//!  log-<g>    every change since log-<g> was opened, appended; log-<g+1>
//!             is opened when a snapshot starts, so snap-<g+1> + log-<g+1>..
//!             is the state, and older files can go once snap-<g+1> exists
//! ```
//!
//! Recovery loads the newest snapshot `snap-<g>` and replays `log-<g>`,
//! `log-<g+1>`, ... in order. Records are full states of a key (an object
//! and all its replicas, or its absence), so replaying a change twice, or
//! over a snapshot taken while changes went on, ends in the same state.
//!
//! A frame is `len: u32 | check: u32 | payload` (little-endian; `check` is
//! the low half of xxh3-64 of the payload). A frame cut short or failing its
//! check at the very end of the newest log is a write the crash tore: it is
//! cut off. Anything else malformed is an error that names the file and the
//! offset: the master refuses to start rather than forget an object.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

use kvpool_wire::proto::SegmentId;
use xxhash_rust::xxh3::xxh3_64;

/// Largest payload of one record: a key of at most this much, with its
/// replicas.
pub const MAX_RECORD_BYTES: usize = 1 << 20;

/// What the bytes at the start of a log (or a shipped batch) hold.
pub(crate) enum Frame<'a> {
    /// A whole frame that passes its check; `end`: its length, header in.
    Whole { payload: &'a [u8], end: usize },
    /// A header or payload cut short (`header`: the header itself).
    CutShort { header: bool },
    /// A length no record has.
    BadLen(usize),
    /// A whole frame that fails its check.
    BadSum { end: usize },
}

impl Frame<'_> {
    /// Why the bytes are not a whole frame, for an error message.
    pub fn why(&self) -> String {
        match self {
            Frame::Whole { .. } => "a whole frame".into(),
            Frame::CutShort { header: true } => "a frame header cut short".into(),
            Frame::CutShort { header: false } => "a frame cut short".into(),
            Frame::BadLen(len) => format!("a frame of {len} bytes"),
            Frame::BadSum { .. } => "a frame fails its checksum".into(),
        }
    }
}

/// The frame at the start of `rest` (length, xxh3 check, payload): the one
/// reading of the framing, for replay and for log shipping.
pub(crate) fn next_frame(rest: &[u8]) -> Frame<'_> {
    if rest.len() < FRAME_HEADER {
        return Frame::CutShort { header: true };
    }
    let len = u32::from_le_bytes(rest[..4].try_into().expect("4")) as usize;
    let check = u32::from_le_bytes(rest[4..8].try_into().expect("4"));
    if len == 0 || len > MAX_RECORD_BYTES + 64 {
        return Frame::BadLen(len);
    }
    let end = FRAME_HEADER + len;
    if rest.len() < end {
        return Frame::CutShort { header: false };
    }
    let payload = &rest[FRAME_HEADER..end];
    if xxh3_64(payload) as u32 != check {
        return Frame::BadSum { end };
    }
    Frame::Whole { payload, end }
}
/// Most replicas one object record names.
pub const MAX_RECORD_REPLICAS: usize = 64;
/// Bytes of a frame's header.
pub const FRAME_HEADER: usize = 8;

const TAG_OBJECT: u8 = 1;
const TAG_GONE: u8 = 2;
const TAG_HOLD: u8 = 3;
const TAG_DROP_OWED: u8 = 4;
const TAG_DROP_DONE: u8 = 5;
const TAG_TIER_LISTED: u8 = 6;
const TAG_EPOCH: u8 = 7;
const TAG_SEGMENT: u8 = 8;

/// Object record flags: a checksum follows; hard-pinned; a version follows
/// the checksum (absent: version 0, how records before versions read).
const FLAG_SUM: u8 = 1;
const FLAG_HARD_PIN: u8 = 2;
const FLAG_VERSION: u8 = 4;

/// What the state directory records of one complete object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectRec {
    pub size: u64,
    pub sum: Option<u64>,
    pub hard_pin: bool,
    /// The object incarnation's version, which its copies carry (0: none
    /// recorded; the record's bytes are then those of a record written
    /// before versions were).
    pub version: u64,
    /// (segment, offset in it; an NVMe tier's packed location).
    pub replicas: Vec<(SegmentId, u64)>,
}

/// Space someone may still write into (a writer with a grant, a node
/// copying an object in) or read from (a leased reader) until a wall-clock
/// time: a restarted master hands it out only after.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hold {
    pub segment: SegmentId,
    pub offset: u64,
    pub len: u64,
    pub until_unix_ms: u64,
}

/// One durable fact.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Record {
    /// The complete object under `key` is this one (put, replica added or
    /// dropped).
    Object {
        key: Vec<u8>,
        obj: ObjectRec,
    },
    /// No complete object under `key` (removed, evicted, lost).
    Gone {
        key: Vec<u8>,
    },
    Hold(Hold),
    /// The copy of `key` at `loc` of NVMe tier `nvme` belongs to an object
    /// removed or replaced: its node is owed a Drop of it, and a report of
    /// that copy (`Recovered`) is refused until then. `version`: the copy's
    /// (the Drop takes only that incarnation); `None` in a record written
    /// before Drops named one (the Drop takes the key's copy in that slot).
    DropOwed {
        nvme: SegmentId,
        key: Vec<u8>,
        loc: u64,
        version: Option<u64>,
    },
    /// That Drop went out to the node (or the copy is an object's again).
    DropDone {
        nvme: SegmentId,
        key: Vec<u8>,
        loc: u64,
    },
    /// Every live copy on NVMe tier `nvme` is one this state lists (an
    /// object's replica, or a copy owed a Drop): a copy the tier reports
    /// that it does not list is an old one, never taken back.
    TierListed {
        nvme: SegmentId,
    },
    /// Segment `id` is mounted (`Live`), mounted and draining (no new puts),
    /// or unmounted (`Gone`). A master that restarts on this directory
    /// waits for every segment recorded `Live` or `Draining` to mount
    /// again, and one that was draining is draining when it does.
    Segment {
        id: SegmentId,
        state: SegmentState,
    },
    /// A master began an epoch: the versions it hands out are
    /// `epoch << 32 | n`, and a master restarted on this directory begins a
    /// later one, so no version is handed out twice.
    Epoch {
        epoch: u64,
    },
}

/// A segment's recorded state. (A segment recorded `Live` or `Draining`
/// that has not mounted since a restart is awaiting its remount; that is
/// the restarted shard's view, not a record.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum SegmentState {
    Live,
    Draining,
    Gone,
}

impl SegmentState {
    fn byte(self) -> u8 {
        match self {
            SegmentState::Live => 1,
            SegmentState::Draining => 2,
            SegmentState::Gone => 3,
        }
    }

    fn from_byte(b: u8) -> Result<Self, String> {
        Ok(match b {
            1 => SegmentState::Live,
            2 => SegmentState::Draining,
            3 => SegmentState::Gone,
            b => return Err(format!("unknown segment state {b}")),
        })
    }
}

fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}
fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

/// Starts a frame in `out`; returns where its header is.
fn begin_frame(out: &mut Vec<u8>) -> usize {
    let at = out.len();
    out.extend_from_slice(&[0; FRAME_HEADER]);
    at
}

/// Fills in the header of the frame begun at `at`.
fn end_frame(out: &mut [u8], at: usize) {
    let payload = &out[at + FRAME_HEADER..];
    let len = payload.len() as u32;
    let check = xxh3_64(payload) as u32;
    out[at..at + 4].copy_from_slice(&len.to_le_bytes());
    out[at + 4..at + 8].copy_from_slice(&check.to_le_bytes());
}

/// Appends the frame of an object record to `out` (what a shard does on
/// its hot path: no allocation beyond `out`'s growth).
pub fn encode_object(
    out: &mut Vec<u8>,
    key: &[u8],
    size: u64,
    sum: Option<u64>,
    hard_pin: bool,
    version: u64,
    replicas: impl Iterator<Item = (SegmentId, u64)>,
) {
    let at = begin_frame(out);
    out.push(TAG_OBJECT);
    put_u32(out, key.len() as u32);
    out.extend_from_slice(key);
    put_u64(out, size);
    let flag = |on: bool, f: u8| if on { f } else { 0 };
    out.push(
        flag(sum.is_some(), FLAG_SUM)
            | flag(hard_pin, FLAG_HARD_PIN)
            | flag(version != 0, FLAG_VERSION),
    );
    put_u64(out, sum.unwrap_or(0));
    if version != 0 {
        put_u64(out, version);
    }
    let n_at = out.len();
    out.push(0);
    let mut n = 0u8;
    for (seg, off) in replicas {
        put_u64(out, seg);
        put_u64(out, off);
        n += 1;
    }
    out[n_at] = n;
    end_frame(out, at);
}

/// Appends the frame of a `Gone` record to `out`.
pub fn encode_gone(out: &mut Vec<u8>, key: &[u8]) {
    let at = begin_frame(out);
    out.push(TAG_GONE);
    put_u32(out, key.len() as u32);
    out.extend_from_slice(key);
    end_frame(out, at);
}

/// Appends the frame of a `Hold` record to `out`.
pub fn encode_hold(out: &mut Vec<u8>, h: &Hold) {
    let at = begin_frame(out);
    out.push(TAG_HOLD);
    put_u64(out, h.segment);
    put_u64(out, h.offset);
    put_u64(out, h.len);
    put_u64(out, h.until_unix_ms);
    end_frame(out, at);
}

/// Appends the frame of an `Epoch` record.
pub fn encode_epoch(out: &mut Vec<u8>, epoch: u64) {
    let at = begin_frame(out);
    out.push(TAG_EPOCH);
    put_u64(out, epoch);
    end_frame(out, at);
}

/// Appends the frame of a `Segment` record.
pub fn encode_segment(out: &mut Vec<u8>, id: SegmentId, state: SegmentState) {
    let at = begin_frame(out);
    out.push(TAG_SEGMENT);
    put_u64(out, id);
    out.push(state.byte());
    end_frame(out, at);
}

/// Appends the frame of a `TierListed` record.
pub fn encode_tier_listed(out: &mut Vec<u8>, nvme: SegmentId) {
    let at = begin_frame(out);
    out.push(TAG_TIER_LISTED);
    put_u64(out, nvme);
    end_frame(out, at);
}

/// Appends the frame of a `DropOwed` record; the copy's version, if known,
/// follows the key.
pub fn encode_drop_owed(
    out: &mut Vec<u8>,
    nvme: SegmentId,
    key: &[u8],
    loc: u64,
    version: Option<u64>,
) {
    encode_drop(out, TAG_DROP_OWED, nvme, key, loc, version);
}

/// The frame of a `DropOwed` or `DropDone` record (`tag`).
fn encode_drop(
    out: &mut Vec<u8>,
    tag: u8,
    nvme: SegmentId,
    key: &[u8],
    loc: u64,
    version: Option<u64>,
) {
    let at = begin_frame(out);
    out.push(tag);
    put_u64(out, nvme);
    put_u64(out, loc);
    put_u32(out, key.len() as u32);
    out.extend_from_slice(key);
    if let Some(version) = version {
        put_u64(out, version);
    }
    end_frame(out, at);
}

impl Record {
    /// Appends this record's frame to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        match self {
            Record::Object { key, obj } => encode_object(
                out,
                key,
                obj.size,
                obj.sum,
                obj.hard_pin,
                obj.version,
                obj.replicas.iter().copied(),
            ),
            Record::Gone { key } => encode_gone(out, key),
            Record::Hold(h) => encode_hold(out, h),
            Record::DropOwed {
                nvme,
                key,
                loc,
                version,
            } => encode_drop_owed(out, *nvme, key, *loc, *version),
            Record::DropDone { nvme, key, loc } => {
                encode_drop(out, TAG_DROP_DONE, *nvme, key, *loc, None)
            }
            Record::TierListed { nvme } => encode_tier_listed(out, *nvme),
            Record::Epoch { epoch } => encode_epoch(out, *epoch),
            Record::Segment { id, state } => encode_segment(out, *id, *state),
        }
    }

    /// Decodes one payload (its frame's check already passed).
    pub fn decode(p: &[u8]) -> Result<Record, String> {
        let mut c = Cursor { p, at: 0 };
        let rec = match c.u8()? {
            TAG_OBJECT => {
                let key = c.key()?;
                let size = c.u64()?;
                let flags = c.u8()?;
                if flags & !(FLAG_SUM | FLAG_HARD_PIN | FLAG_VERSION) != 0 {
                    return Err(format!("unknown object flags {flags:#x}"));
                }
                let sum = c.u64()?;
                let version = if flags & FLAG_VERSION != 0 {
                    match c.u64()? {
                        0 => return Err("an object record with version 0 written out".into()),
                        v => v,
                    }
                } else {
                    0
                };
                let n = c.u8()? as usize;
                if n == 0 || n > MAX_RECORD_REPLICAS {
                    return Err(format!("an object record with {n} replicas"));
                }
                let mut replicas = Vec::with_capacity(n);
                for _ in 0..n {
                    replicas.push((c.u64()?, c.u64()?));
                }
                if size == 0 {
                    return Err("an object record of 0 bytes".into());
                }
                Record::Object {
                    key,
                    obj: ObjectRec {
                        size,
                        sum: (flags & FLAG_SUM != 0).then_some(sum),
                        hard_pin: flags & FLAG_HARD_PIN != 0,
                        version,
                        replicas,
                    },
                }
            }
            TAG_GONE => Record::Gone { key: c.key()? },
            TAG_HOLD => Record::Hold(Hold {
                segment: c.u64()?,
                offset: c.u64()?,
                len: c.u64()?,
                until_unix_ms: c.u64()?,
            }),
            tag @ (TAG_DROP_OWED | TAG_DROP_DONE) => {
                let (nvme, loc, key) = (c.u64()?, c.u64()?, c.key()?);
                if tag == TAG_DROP_OWED {
                    // A record written before Drops named a version ends
                    // with the key.
                    let version = if c.at < p.len() { Some(c.u64()?) } else { None };
                    Record::DropOwed {
                        nvme,
                        key,
                        loc,
                        version,
                    }
                } else {
                    Record::DropDone { nvme, key, loc }
                }
            }
            TAG_TIER_LISTED => Record::TierListed { nvme: c.u64()? },
            // Epochs are written in 1..2^32 (versions are `epoch << 32 | n`):
            // another is a damaged or forged record, which would otherwise
            // make the next epoch wrap onto one handed out before.
            TAG_EPOCH => match c.u64()? {
                e @ 1..=0xffff_ffff => Record::Epoch { epoch: e },
                e => return Err(format!("an epoch record of {e:#x}")),
            },
            TAG_SEGMENT => Record::Segment {
                id: c.u64()?,
                state: SegmentState::from_byte(c.u8()?)?,
            },
            t => return Err(format!("unknown record tag {t}")),
        };
        if c.at != p.len() {
            return Err(format!("{} bytes after the record", p.len() - c.at));
        }
        Ok(rec)
    }
}

struct Cursor<'a> {
    p: &'a [u8],
    at: usize,
}

impl Cursor<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], String> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.p.len())
            .ok_or_else(|| "the record ends early".to_string())?;
        let s = &self.p[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4")))
    }
    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8")))
    }
    fn key(&mut self) -> Result<Vec<u8>, String> {
        let n = self.u32()? as usize;
        // Keys were checked against the wire's limit before any was
        // recorded; a longer one is a damaged (or forged) record.
        if n == 0 || n > kvpool_wire::limits::MAX_KEY_BYTES {
            return Err(format!("a key of {n} bytes"));
        }
        Ok(self.take(n)?.to_vec())
    }
}

/// A state directory that cannot be read back as it was written.
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{path} at byte {offset}: {why}")]
    Corrupt {
        path: PathBuf,
        offset: u64,
        why: String,
    },
    #[error("{0}")]
    Mismatch(String),
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> JournalError + '_ {
    move |source| JournalError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// What a shard's directory holds: its complete objects, the space held
/// beyond the crash, and the NVMe copies whose Drop a node is still owed.
/// Ordered, so a shard restored from it is the same shard every time (its
/// objects inserted, and Drops owed, in one order: a simulation replays).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Image {
    pub objects: BTreeMap<Vec<u8>, ObjectRec>,
    pub holds: Vec<Hold>,
    /// (NVMe tier, key, location) of each copy owed a Drop, and the copy's
    /// version where its record names one.
    pub drops: BTreeMap<(SegmentId, Vec<u8>, u64), Option<u64>>,
    /// NVMe tiers whose every live copy the image lists.
    pub listed_tiers: BTreeSet<SegmentId>,
    /// Segments recorded mounted (`Live` or `Draining`) and not unmounted
    /// since.
    pub segments: BTreeMap<SegmentId, SegmentState>,
    /// The latest epoch a master began on this directory (0: none).
    pub epoch: u64,
    /// The earliest epoch the directory names (0: none): the versions of
    /// epochs `first_epoch..=epoch` were handed out by its masters.
    pub first_epoch: u64,
}

impl Image {
    /// Applies one record.
    pub fn apply(&mut self, rec: Record) {
        match rec {
            Record::Object { key, obj } => {
                self.objects.insert(key, obj);
            }
            Record::Gone { key } => {
                self.objects.remove(&key);
            }
            Record::Hold(h) => self.holds.push(h),
            Record::DropOwed {
                nvme,
                key,
                loc,
                version,
            } => {
                self.drops.insert((nvme, key, loc), version);
            }
            Record::DropDone { nvme, key, loc } => {
                self.drops.remove(&(nvme, key, loc));
            }
            Record::TierListed { nvme } => {
                self.listed_tiers.insert(nvme);
            }
            Record::Segment { id, state } => {
                if state == SegmentState::Gone {
                    self.segments.remove(&id);
                } else {
                    self.segments.insert(id, state);
                }
            }
            Record::Epoch { epoch } => {
                self.epoch = self.epoch.max(epoch);
                if self.first_epoch == 0 || epoch < self.first_epoch {
                    self.first_epoch = epoch;
                }
            }
        }
    }

    /// Forgets holds that end by `now_unix_ms`.
    pub fn drop_holds_before(&mut self, now_unix_ms: u64) {
        self.holds.retain(|h| h.until_unix_ms > now_unix_ms);
    }
}

/// What a file replayed to: how many valid bytes, and whether the rest was
/// a torn tail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileEnd {
    pub valid: u64,
    pub torn: bool,
}

/// Replays the records of one file into `img`. `last`: it is the newest
/// log, where a torn tail is a crash's, not damage.
pub fn replay_file(path: &Path, img: &mut Image, last: bool) -> Result<FileEnd, JournalError> {
    let mut f = File::open(path).map_err(io_err(path))?;
    let mut data = Vec::new();
    f.read_to_end(&mut data).map_err(io_err(path))?;
    let mut at = 0usize;
    let corrupt = |offset: usize, why: String| JournalError::Corrupt {
        path: path.to_path_buf(),
        offset: offset as u64,
        why,
    };
    while at < data.len() {
        let rest = &data[at..];
        // A tail of zeros (space the file system allocated before the
        // crash) or a frame cut short, at the end of the newest log: torn.
        let torn_here = last && (rest.len() < FRAME_HEADER || rest.iter().all(|&b| b == 0));
        if torn_here {
            return Ok(FileEnd {
                valid: at as u64,
                torn: true,
            });
        }
        let (payload, end) = match next_frame(rest) {
            Frame::Whole { payload, end } => (payload, end),
            // A frame cut short, or the last frame of the newest log failing
            // its check: torn.
            Frame::CutShort { .. } if last => {
                return Ok(FileEnd {
                    valid: at as u64,
                    torn: true,
                })
            }
            Frame::BadSum { end } if last && rest.len() == end => {
                return Ok(FileEnd {
                    valid: at as u64,
                    torn: true,
                })
            }
            f => return Err(corrupt(at, f.why())),
        };
        let rec = Record::decode(payload).map_err(|why| corrupt(at, why))?;
        img.apply(rec);
        at += end;
    }
    Ok(FileEnd {
        valid: at as u64,
        torn: false,
    })
}

/// Generations of `prefix-<g>` files in `dir`, ascending.
fn generations(dir: &Path, prefix: &str) -> Result<Vec<u64>, JournalError> {
    let mut gens = Vec::new();
    for e in fs::read_dir(dir).map_err(io_err(dir))? {
        let e = e.map_err(io_err(dir))?;
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        if let Some(g) = name
            .strip_prefix(prefix)
            .and_then(|r| r.strip_prefix('-'))
            .filter(|r| !r.contains('.'))
        {
            let g = g.parse::<u64>().map_err(|_| {
                JournalError::Mismatch(format!("{}: an unexpected file {name}", dir.display()))
            })?;
            gens.push(g);
        }
    }
    gens.sort_unstable();
    Ok(gens)
}

fn snap_path(dir: &Path, g: u64) -> PathBuf {
    dir.join(format!("snap-{g:08}"))
}

fn log_path(dir: &Path, g: u64) -> PathBuf {
    dir.join(format!("log-{g:08}"))
}

/// A shard's directory, replayed: the image, and the log to append to.
pub struct Recovered {
    pub image: Image,
    pub log: LogWriter,
    /// Records replayed and whether a torn tail was cut off (for the log line).
    pub torn: bool,
}

/// How the log reaches the disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sync {
    /// write(2) only: survives the process's death, not the machine's.
    None,
    /// write(2) then fdatasync(2) before the replies go out.
    Always,
}

/// Opens (creating it if needed) a shard's directory, replays it, cuts a
/// torn tail off the newest log, and opens that log for appending.
pub fn open_shard(dir: &Path, sync: Sync) -> Result<Recovered, JournalError> {
    fs::create_dir_all(dir).map_err(io_err(dir))?;
    let snaps = generations(dir, "snap")?;
    let logs = generations(dir, "log")?;
    let base = snaps.last().copied().unwrap_or(0);
    let mut image = Image::default();
    if let Some(&g) = snaps.last() {
        let p = snap_path(dir, g);
        let end = replay_file(&p, &mut image, false)?;
        debug_assert!(!end.torn);
    }
    let replay: Vec<u64> = logs.iter().copied().filter(|&g| g >= base).collect();
    if let (Some(&first), false) = (replay.first(), snaps.is_empty()) {
        if first != base {
            return Err(JournalError::Mismatch(format!(
                "{}: snapshot {base} has no log-{base:08} beside it",
                dir.display()
            )));
        }
    }
    for w in replay.windows(2) {
        if w[1] != w[0] + 1 {
            return Err(JournalError::Mismatch(format!(
                "{}: log {} is missing between {} and {}",
                dir.display(),
                w[0] + 1,
                w[0],
                w[1]
            )));
        }
    }
    let mut torn = false;
    let mut newest = base;
    for (i, &g) in replay.iter().enumerate() {
        let p = log_path(dir, g);
        let last = i + 1 == replay.len();
        let end = replay_file(&p, &mut image, last)?;
        if end.torn {
            torn = true;
            let f = OpenOptions::new()
                .write(true)
                .open(&p)
                .map_err(io_err(&p))?;
            f.set_len(end.valid).map_err(io_err(&p))?;
            f.sync_all().map_err(io_err(&p))?;
        }
        newest = g;
    }
    let log = LogWriter::open(dir, newest, sync)?;
    Ok(Recovered { image, log, torn })
}

/// The log a shard appends to.
pub struct LogWriter {
    dir: PathBuf,
    gen: u64,
    file: File,
    sync: Sync,
    /// Bytes in the current log file.
    pub bytes: u64,
}

impl LogWriter {
    fn open(dir: &Path, gen: u64, sync: Sync) -> Result<Self, JournalError> {
        let p = log_path(dir, gen);
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&p)
            .map_err(io_err(&p))?;
        let bytes = file.metadata().map_err(io_err(&p))?.len();
        Ok(Self {
            dir: dir.to_path_buf(),
            gen,
            file,
            sync,
            bytes,
        })
    }

    /// Appends encoded records (whole frames) and, with `Sync::Always`,
    /// waits for the disk. The caller answers the requests they record
    /// only after this returns.
    pub fn append(&mut self, frames: &[u8]) -> io::Result<()> {
        if frames.is_empty() {
            return Ok(());
        }
        self.file.write_all(frames)?;
        if self.sync == Sync::Always {
            self.file.sync_data()?;
        }
        self.bytes += frames.len() as u64;
        Ok(())
    }

    /// The generation appended to.
    pub fn generation(&self) -> u64 {
        self.gen
    }

    /// Starts log `gen + 1` (appends go there from now on) and returns a
    /// writer for snapshot `gen + 1`: the snapshot then written from the
    /// live state, plus this new log and its successors, is the state.
    pub fn rotate(&mut self) -> Result<SnapshotWriter, JournalError> {
        let next = LogWriter::open(&self.dir, self.gen + 1, self.sync)?;
        let old = std::mem::replace(self, next);
        drop(old);
        SnapshotWriter::create(&self.dir, self.gen)
    }
}

/// A snapshot being written: complete only once [`SnapshotWriter::finish`]
/// renames it into place.
pub struct SnapshotWriter {
    dir: PathBuf,
    gen: u64,
    tmp: PathBuf,
    file: io::BufWriter<File>,
    pub bytes: u64,
}

impl SnapshotWriter {
    fn create(dir: &Path, gen: u64) -> Result<Self, JournalError> {
        let tmp = dir.join(format!("snap-{gen:08}.tmp"));
        let file = File::create(&tmp).map_err(io_err(&tmp))?;
        Ok(Self {
            dir: dir.to_path_buf(),
            gen,
            tmp,
            file: io::BufWriter::with_capacity(1 << 20, file),
            bytes: 0,
        })
    }

    /// Appends encoded records.
    pub fn write(&mut self, frames: &[u8]) -> Result<(), JournalError> {
        self.file.write_all(frames).map_err(io_err(&self.tmp))?;
        self.bytes += frames.len() as u64;
        Ok(())
    }

    /// Flushes and syncs the snapshot, renames it into place, and removes
    /// the snapshots and logs it makes redundant.
    pub fn finish(self) -> Result<(), JournalError> {
        let f = self
            .file
            .into_inner()
            .map_err(|e| io_err(&self.tmp)(e.into_error()))?;
        f.sync_all().map_err(io_err(&self.tmp))?;
        let dst = snap_path(&self.dir, self.gen);
        fs::rename(&self.tmp, &dst).map_err(io_err(&dst))?;
        File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(io_err(&self.dir))?;
        for g in generations(&self.dir, "snap")? {
            if g < self.gen {
                let p = snap_path(&self.dir, g);
                fs::remove_file(&p).map_err(io_err(&p))?;
            }
        }
        for g in generations(&self.dir, "log")? {
            if g < self.gen {
                let p = log_path(&self.dir, g);
                fs::remove_file(&p).map_err(io_err(&p))?;
            }
        }
        Ok(())
    }
}

/// Checks (or, in a new directory, writes) the shard count the directory
/// was written with: keys and segment ranges are split by it, so a master
/// with another count cannot use it.
pub fn check_meta(dir: &Path, nr_shards: u32) -> Result<(), JournalError> {
    fs::create_dir_all(dir).map_err(io_err(dir))?;
    let p = dir.join("meta");
    let want = format!("kvpool-state 1\nshards {nr_shards}\n");
    match fs::read_to_string(&p) {
        Ok(have) if have == want => Ok(()),
        Ok(have) => Err(JournalError::Mismatch(format!(
            "{}: written by a master with {:?}; this one has {nr_shards} shards (start it with \
             `master.shards` set to the count the directory was written with, or on another \
             directory)",
            p.display(),
            have.trim().replace('\n', ", ")
        ))),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            let tmp = dir.join("meta.tmp");
            fs::write(&tmp, want).map_err(io_err(&tmp))?;
            fs::rename(&tmp, &p).map_err(io_err(&p))?;
            Ok(())
        }
        Err(e) => Err(io_err(&p)(e)),
    }
}

/// A shard's directory under the state directory.
pub fn shard_dir(state_dir: &Path, shard: u32) -> PathBuf {
    state_dir.join(format!("shard-{shard}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "kvpool-journal-{name}-{}-{}",
            std::process::id(),
            rand::random::<u32>()
        ));
        let _ = fs::remove_dir_all(&d);
        d
    }

    fn obj(key: &str, n: u64) -> Record {
        Record::Object {
            key: key.as_bytes().to_vec(),
            obj: ObjectRec {
                size: n,
                sum: Some(n * 7),
                hard_pin: n.is_multiple_of(2),
                version: 0,
                replicas: vec![(1, n * 4096), (2, n)],
            },
        }
    }

    #[test]
    fn records_round_trip() {
        let recs = vec![
            obj("a", 3),
            Record::Gone { key: b"a".to_vec() },
            Record::Hold(Hold {
                segment: 9,
                offset: 4096,
                len: 100,
                until_unix_ms: 77,
            }),
            Record::DropOwed {
                nvme: 5,
                key: b"d".to_vec(),
                loc: 12,
                version: Some(3 << 32 | 4),
            },
            Record::DropOwed {
                nvme: 5,
                key: b"e".to_vec(),
                loc: 13,
                version: Some(0),
            },
            Record::DropOwed {
                nvme: 5,
                key: b"f".to_vec(),
                loc: 14,
                version: None,
            },
            Record::DropDone {
                nvme: 5,
                key: b"d".to_vec(),
                loc: 12,
            },
            Record::TierListed { nvme: 0xfeed },
            Record::Epoch { epoch: 3 },
            Record::Segment {
                id: 0xfeed,
                state: SegmentState::Live,
            },
            Record::Segment {
                id: 7,
                state: SegmentState::Draining,
            },
            Record::Segment {
                id: 7,
                state: SegmentState::Gone,
            },
            Record::Object {
                key: b"v".to_vec(),
                obj: ObjectRec {
                    size: 10,
                    sum: None,
                    hard_pin: false,
                    version: 3 << 32 | 17,
                    replicas: vec![(4, 8192)],
                },
            },
        ];
        let mut buf = Vec::new();
        for r in &recs {
            r.encode(&mut buf);
        }
        let mut at = 0;
        let mut back = Vec::new();
        while at < buf.len() {
            let len = u32::from_le_bytes(buf[at..at + 4].try_into().unwrap()) as usize;
            back.push(Record::decode(&buf[at + 8..at + 8 + len]).unwrap());
            at += 8 + len;
        }
        assert_eq!(back, recs);
    }

    /// The image holds a segment's latest state until it is recorded gone;
    /// a segment record with a state no master writes is refused.
    #[test]
    fn segment_records_replay_to_the_latest_state() {
        let mut img = Image::default();
        for (id, state) in [
            (1, SegmentState::Live),
            (2, SegmentState::Live),
            (1, SegmentState::Draining),
            (2, SegmentState::Gone),
            (3, SegmentState::Gone),
        ] {
            img.apply(Record::Segment { id, state });
        }
        assert_eq!(
            img.segments.into_iter().collect::<Vec<_>>(),
            vec![(1, SegmentState::Draining)]
        );
        let mut buf = Vec::new();
        encode_segment(&mut buf, 4, SegmentState::Live);
        let last = buf.len() - 1;
        buf[last] = 9;
        let err = Record::decode(&buf[FRAME_HEADER..]).unwrap_err();
        assert!(err.contains("unknown segment state 9"), "{err}");
    }

    /// A `DropOwed` record of a master before Drops named a version (it
    /// ended with the key) reads as owed at no version; one that names a
    /// version is that record and eight bytes more; a `DropDone` with
    /// bytes after its key is refused.
    #[test]
    fn a_drop_record_without_a_version_reads_as_before() {
        let old = |tag: u8| {
            let mut b = vec![tag];
            b.extend_from_slice(&5u64.to_le_bytes());
            b.extend_from_slice(&12u64.to_le_bytes());
            b.extend_from_slice(&1u32.to_le_bytes());
            b.push(b'd');
            b
        };
        assert_eq!(
            Record::decode(&old(TAG_DROP_OWED)).unwrap(),
            Record::DropOwed {
                nvme: 5,
                key: b"d".to_vec(),
                loc: 12,
                version: None,
            }
        );
        let mut framed = Vec::new();
        encode_drop_owed(&mut framed, 5, b"d", 12, None);
        assert_eq!(&framed[FRAME_HEADER..], &old(TAG_DROP_OWED)[..]);
        let mut framed = Vec::new();
        encode_drop_owed(&mut framed, 5, b"d", 12, Some(7));
        let mut with = old(TAG_DROP_OWED);
        with.extend_from_slice(&7u64.to_le_bytes());
        assert_eq!(&framed[FRAME_HEADER..], &with[..]);
        let mut done = old(TAG_DROP_DONE);
        done.extend_from_slice(&7u64.to_le_bytes());
        assert!(Record::decode(&done).is_err());
        let mut torn = old(TAG_DROP_OWED);
        torn.extend_from_slice(&[7, 0, 0]);
        assert!(Record::decode(&torn).is_err());
    }

    /// An object record without a version is byte for byte the record of
    /// a master before versions (so either reads the other's directory); a
    /// version adds a flag and eight bytes; a flagged version 0 is refused.
    #[test]
    fn a_record_without_a_version_keeps_its_old_bytes() {
        let frame = |version: u64| {
            let mut b = Vec::new();
            encode_object(
                &mut b,
                b"key",
                5,
                Some(9),
                true,
                version,
                [(1, 2)].into_iter(),
            );
            b
        };
        let (old, new) = (frame(0), frame(7 << 32 | 1));
        // header 8 | tag 1 | key len 4 + 3 | size 8 | flags 1 | sum 8 | n 1 | replica 16
        assert_eq!(old.len(), 8 + 1 + 4 + 3 + 8 + 1 + 8 + 1 + 16);
        let flags_at = 8 + 1 + 4 + 3 + 8;
        assert_eq!(old[flags_at], FLAG_SUM | FLAG_HARD_PIN);
        assert_eq!(new.len(), old.len() + 8);
        assert_eq!(new[flags_at], FLAG_SUM | FLAG_HARD_PIN | FLAG_VERSION);
        let Record::Object { obj, .. } = Record::decode(&new[8..]).unwrap() else {
            panic!("not an object record");
        };
        assert_eq!(obj.version, 7 << 32 | 1);
        let mut zero = new[8..].to_vec();
        let v_at = flags_at - 8 + 1 + 8;
        zero[v_at..v_at + 8].fill(0);
        assert!(Record::decode(&zero).unwrap_err().contains("version 0"));
        let mut img = Image::default();
        img.apply(Record::Epoch { epoch: 3 });
        img.apply(Record::Epoch { epoch: 2 });
        assert_eq!(img.epoch, 3, "an image keeps the latest epoch");
        assert_eq!(img.first_epoch, 2, "and the earliest");
        for bad in [0, 1 << 32, u64::MAX] {
            let mut frame = Vec::new();
            encode_epoch(&mut frame, bad);
            let e = Record::decode(&frame[8..]).unwrap_err();
            assert!(e.contains("epoch record"), "{bad:#x}: {e}");
        }
    }

    #[test]
    fn a_torn_tail_is_cut_off_and_damage_before_it_is_an_error() {
        let d = tmp("torn");
        let sd = d.join("shard-0");
        let mut r = open_shard(&sd, Sync::None).unwrap();
        let mut buf = Vec::new();
        obj("a", 1).encode(&mut buf);
        obj("b", 2).encode(&mut buf);
        r.log.append(&buf).unwrap();
        let whole = buf.len() as u64;
        // A third record half written.
        let mut third = Vec::new();
        obj("c", 3).encode(&mut third);
        r.log.append(&third[..third.len() / 2]).unwrap();
        drop(r);
        let r = open_shard(&sd, Sync::None).unwrap();
        assert!(r.torn);
        assert_eq!(r.image.objects.len(), 2);
        assert_eq!(r.log.bytes, whole, "the torn tail was cut off");
        drop(r);
        // A flipped byte in the first record, with a valid one after it:
        // damage, not a crash: the master refuses to start.
        let p = log_path(&sd, 0);
        let mut data = fs::read(&p).unwrap();
        data[12] ^= 0xff;
        fs::write(&p, &data).unwrap();
        let e = open_shard(&sd, Sync::None).err().expect("corrupt");
        assert!(
            e.to_string().contains("checksum"),
            "the error names the cause: {e}"
        );
        let _ = fs::remove_dir_all(&d);
    }

    #[test]
    fn a_snapshot_and_the_logs_after_it_are_the_state() {
        let d = tmp("snap");
        let mut r = open_shard(&d, Sync::None).unwrap();
        let mut buf = Vec::new();
        obj("a", 1).encode(&mut buf);
        obj("b", 2).encode(&mut buf);
        r.log.append(&buf).unwrap();
        let mut snap = r.log.rotate().unwrap();
        // Changes while the snapshot is written go to the new log.
        let mut buf = Vec::new();
        Record::Gone { key: b"a".to_vec() }.encode(&mut buf);
        obj("c", 3).encode(&mut buf);
        r.log.append(&buf).unwrap();
        // The snapshot saw "a" still (it was taken before the removal).
        let mut sbuf = Vec::new();
        obj("a", 1).encode(&mut sbuf);
        obj("b", 2).encode(&mut sbuf);
        snap.write(&sbuf).unwrap();
        // Before it is finished, the old files are the state.
        drop(r);
        let want: Vec<&str> = vec!["b", "c"];
        let img = open_shard(&d, Sync::None).unwrap().image;
        let mut keys: Vec<_> = img.objects.keys().map(|k| k.as_slice()).collect();
        keys.sort();
        assert_eq!(keys, want.iter().map(|k| k.as_bytes()).collect::<Vec<_>>());
        snap.finish().unwrap();
        assert!(!log_path(&d, 0).exists(), "the old log is gone");
        let img2 = open_shard(&d, Sync::None).unwrap().image;
        assert_eq!(img2, img);
        let _ = fs::remove_dir_all(&d);
    }

    #[test]
    fn a_directory_of_another_shard_count_is_refused() {
        let d = tmp("meta");
        check_meta(&d, 2).unwrap();
        check_meta(&d, 2).unwrap();
        let e = check_meta(&d, 4).unwrap_err().to_string();
        assert!(e.contains("4 shards"), "{e}");
        let _ = fs::remove_dir_all(&d);
    }
}
