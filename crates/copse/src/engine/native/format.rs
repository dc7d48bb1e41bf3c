//! Slab file format: size classes, the header page, and item records. Spec: docs/format/slab.md.
//!
//! Invariants:
//! - A slab file is an array of 4 KiB pages; page 0 is the header page, then units of
//!   `pages_per_unit` pages, each holding `slots_per_unit` slots of `slot_bytes` end to end.
//!   A slot of a paged class lies inside one page; a slot of a multi-page class is its unit;
//!   a slot of a packed class (format 4) may cross one page boundary, never a unit's, and its
//!   32-byte header never crosses a page (slots are multiples of 32 bytes).
//! - A record starts at its slot's first byte with a 32-byte header. An all-zero header is an
//!   empty slot (files grow zero-filled). Any other header must carry a header check (version 3:
//!   a crc32c over the header fields, the key and the record's location; versions 1 and 2: a
//!   16-bit magic), a known kind, lengths that fit the slot, and a crc32c over header, key, value
//!   and location; otherwise the slot is corrupt and is never returned as data.
//! - A file's records all use the layout of the file's format version (`RecordLayout`): a file
//!   keeps its version for life, so a store upgraded in place writes old files in their old
//!   layout and new files in the new one.
//! - All integers are little-endian.

use crate::limits::{KEY_BYTES_MAX, PAGE_BYTES, VALUE_BYTES_MAX};

/// First 8 bytes of every slab file.
pub const SLAB_MAGIC: [u8; 8] = *b"COPSLAB\x01";
/// Version of the slab format (header page, record header, record kinds, class table) that this
/// build writes into new files. Version 2 added the Part record kind; version 3 replaced the
/// record magic with a header checksum; version 4 added the packed classes; version 5 added the
/// Chunk record kind. Older files are read, and written, as they are.
pub const SLAB_FORMAT_VERSION: u32 = 5;
/// Oldest slab format version this build reads.
pub const SLAB_FORMAT_VERSION_READ_MIN: u32 = 1;
/// Bytes 28..30 of a record header in format versions 1 and 2: tells a record from garbage
/// before the crc is computed.
pub const RECORD_MAGIC: u16 = 0xC05E;
pub const RECORD_HEADER_BYTES: usize = 32;

/// How a file's record headers are checked, from the file's format version.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordLayout {
    /// Versions 1 and 2: bytes 28..30 hold `RECORD_MAGIC`, 30..32 are zero. Only the record crc
    /// covers the header, so a damaged record's header cannot be trusted: a write torn across
    /// the header can join one record's seq to another's key.
    Magic,
    /// Version 3: bytes 28..32 hold `header_crc`, a crc32c over the header fields, the key and
    /// the location. A damaged record whose header check still holds names its key and seq
    /// for sure (the damage is in its value), so recovery can let it decide its key.
    HeaderCrc,
}

impl RecordLayout {
    /// The layout of records in a file of `format_version` (one this build reads).
    pub fn of_version(format_version: u32) -> RecordLayout {
        assert!(
            (SLAB_FORMAT_VERSION_READ_MIN..=SLAB_FORMAT_VERSION).contains(&format_version),
            "slab format version {format_version} is not read by this build"
        );
        if format_version >= 3 {
            RecordLayout::HeaderCrc
        } else {
            RecordLayout::Magic
        }
    }

    /// The layout of new files.
    pub fn current() -> RecordLayout {
        RecordLayout::of_version(SLAB_FORMAT_VERSION)
    }
}

/// Largest record: header + largest key + largest value.
pub const RECORD_BYTES_MAX: usize = RECORD_HEADER_BYTES + KEY_BYTES_MAX + VALUE_BYTES_MAX;

/// What a slot holds. persisted: never renumber.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordKind {
    /// A key and its value.
    Put = 1,
    /// A key that was deleted; kept only while older copies of the key may remain on disk.
    Tombstone = 2,
    /// A free slot, possibly chaining to the next free slot of its class (`aux` = slot + 1).
    Free = 3,
    /// A write batch, written whole before its members (see `engine/native/batch.rs`).
    Batch = 4,
    /// Written at a clean close: `aux` is the shard's durable watermark then, so recovery knows
    /// every earlier record was durable (see `recovery.rs`). Freed at the next open.
    Watermark = 5,
    /// One shard's part of a cross-shard batch (`engine/part.rs`), prepared or committed; kept
    /// until the router forgets the batch (see `part.rs` in this folder). Since format version 2.
    Part = 6,
    /// One record of a chain holding a Batch or Part value too large for one record
    /// (`chain.rs`): the whole's kind, its index, the chain's length and a piece of the value.
    /// Since format version 5.
    Chunk = 7,
}

impl RecordKind {
    fn from_u8(byte: u8) -> Option<RecordKind> {
        match byte {
            1 => Some(RecordKind::Put),
            2 => Some(RecordKind::Tombstone),
            3 => Some(RecordKind::Free),
            4 => Some(RecordKind::Batch),
            5 => Some(RecordKind::Watermark),
            6 => Some(RecordKind::Part),
            7 => Some(RecordKind::Chunk),
            _ => None,
        }
    }
}

/// Slots per page of the paged classes (ids 0 to 12, formats 1 to 3), largest count (smallest
/// slot) first. Frozen: files of these classes are read and written as they are, but no new
/// record goes to them (`SizeClass::for_record` picks a packed class).
const PAGED_SLOTS_PER_PAGE: [u32; 13] = [64, 48, 32, 24, 16, 12, 8, 6, 5, 4, 3, 2, 1];
/// Pages per slot of the multi-page classes (ids 13 to 35). The last class holds the largest
/// record.
const MULTI_PAGE_PAGES_PER_SLOT: [u32; 23] = [
    2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048,
    3072, 4097,
];
/// Slot bytes of the packed classes (ids 36 on, format 4), smallest first. A packed class lays
/// its slots end to end in units of `PACKED_UNIT_PAGES` pages, so a slot may cross a page
/// boundary (never a unit's). Multiples of `PACKED_SLOT_ALIGN` so that a record header never
/// crosses a page. Steps of 32 bytes up to 640, then sizes that fill a unit to within 4%
/// (`16384 / n`, rounded down to 32) up to a page. Changing this table changes the format
/// version.
const PACKED_SLOT_BYTES: [u32; 40] = [
    64, 96, 128, 160, 192, 224, 256, 288, 320, 352, 384, 416, 448, 480, 512, 544, 576, 608, 640,
    672, 704, 736, 768, 800, 832, 896, 960, 1024, 1088, 1152, 1248, 1344, 1472, 1632, 1792, 2048,
    2336, 2720, 3264, 4096,
];
/// Pages per unit of a packed class: a unit holds a whole number of slots, so a read or write
/// of whole units (the collector's victim blocks, recovery's chunks) holds whole slots.
pub const PACKED_UNIT_PAGES: u32 = 4;
/// Alignment of a packed slot (and so of its record header) inside its unit.
pub const PACKED_SLOT_ALIGN: u32 = 32;
/// Id of the first packed class.
pub const PACKED_FIRST_CLASS: u8 = (PAGED_CLASS_COUNT + MULTI_PAGE_PAGES_PER_SLOT.len()) as u8;
pub const PAGED_CLASS_COUNT: usize = PAGED_SLOTS_PER_PAGE.len();
pub const PACKED_CLASS_COUNT: usize = PACKED_SLOT_BYTES.len();
pub const CLASS_COUNT: usize = PACKED_FIRST_CLASS as usize + PACKED_CLASS_COUNT;
/// The first multi-page class: the smallest class for records over a page.
const MULTI_PAGE_FIRST_CLASS: u8 = PAGED_CLASS_COUNT as u8;

const _: () = assert!(RECORD_BYTES_MAX <= 4097 * PAGE_BYTES);
// The manifest keeps one placement byte per class.
const _: () = assert!(CLASS_COUNT == crate::engine::placement::PLACED_CLASS_COUNT);
// File names carry two digits of class id.
const _: () = assert!(CLASS_COUNT <= 100);
const _: () = assert!(PACKED_SLOT_BYTES[PACKED_CLASS_COUNT - 1] as usize == PAGE_BYTES);
const _: () = {
    let mut index = 1;
    while index < MULTI_PAGE_PAGES_PER_SLOT.len() {
        assert!(MULTI_PAGE_PAGES_PER_SLOT[index] > MULTI_PAGE_PAGES_PER_SLOT[index - 1]);
        index += 1;
    }
};
const _: () = {
    let mut index = 0;
    while index < PACKED_CLASS_COUNT {
        let slot = PACKED_SLOT_BYTES[index];
        assert!(slot.is_multiple_of(PACKED_SLOT_ALIGN) && slot as usize <= PAGE_BYTES);
        assert!(index == 0 || slot > PACKED_SLOT_BYTES[index - 1]);
        index += 1;
    }
};

/// How a class lays its slots out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClassKind {
    /// Ids 0 to 12 (formats 1 to 3): `slots_per_unit` slots in each page; no slot crosses a
    /// page.
    Paged,
    /// Ids 13 to 35: each slot is `pages_per_unit` whole pages.
    MultiPage,
    /// Ids 36 on (format 4): `slots_per_unit` slots end to end in each unit of
    /// `PACKED_UNIT_PAGES` pages; a slot may cross one page boundary.
    Packed,
}

/// A size class: which slots its items occupy. A class's file is the header page, then units
/// of `pages_per_unit` pages holding `slots_per_unit` slots each, end to end from the unit's
/// first byte (`ClassKind` tells the three layouts apart; the same two numbers describe all).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SizeClass {
    pub id: u8,
    pub kind: ClassKind,
    /// Bytes per slot; for a multi-page class, `pages_per_unit * PAGE_BYTES`.
    pub slot_bytes: u32,
    /// 1 for multi-page classes.
    pub slots_per_unit: u32,
    /// 1 for paged classes.
    pub pages_per_unit: u32,
}

/// Where a slot of an in-page (paged or packed) class lies: its first page, its first byte in
/// that page, and the pages it spans (1, or 2 for a packed slot that crosses a page boundary).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotSpan {
    pub first_page: u64,
    pub offset: usize,
    pub pages: u64,
}

impl SlotSpan {
    /// The pages of the span.
    pub fn page_numbers(&self) -> std::ops::Range<u64> {
        self.first_page..self.first_page + self.pages
    }
}

impl SizeClass {
    pub fn get(id: u8) -> SizeClass {
        let index = id as usize;
        assert!(index < CLASS_COUNT, "size class {id} out of range");
        if index < PAGED_CLASS_COUNT {
            let slots_per_page = PAGED_SLOTS_PER_PAGE[index];
            // Slots are 8-byte aligned so headers are aligned.
            let slot_bytes = (PAGE_BYTES as u32 / slots_per_page) & !7;
            SizeClass {
                id,
                kind: ClassKind::Paged,
                slot_bytes,
                slots_per_unit: slots_per_page,
                pages_per_unit: 1,
            }
        } else if index < PACKED_FIRST_CLASS as usize {
            let pages_per_slot = MULTI_PAGE_PAGES_PER_SLOT[index - PAGED_CLASS_COUNT];
            SizeClass {
                id,
                kind: ClassKind::MultiPage,
                slot_bytes: pages_per_slot * PAGE_BYTES as u32,
                slots_per_unit: 1,
                pages_per_unit: pages_per_slot,
            }
        } else {
            let slot_bytes = PACKED_SLOT_BYTES[index - PACKED_FIRST_CLASS as usize];
            SizeClass {
                id,
                kind: ClassKind::Packed,
                slot_bytes,
                slots_per_unit: PACKED_UNIT_PAGES * PAGE_BYTES as u32 / slot_bytes,
                pages_per_unit: PACKED_UNIT_PAGES,
            }
        }
    }

    /// The class a new record of `record_bytes` goes to: the smallest packed class whose slot
    /// holds it, or past a page the smallest multi-page class. (The paged classes are kept for
    /// the files that have them; nothing new goes there.)
    /// Binary searches of the two tables (both increase, checked at compile time), then one
    /// `get`: it runs for every record written, and a walk that built each class on the way
    /// cost ~700 instructions a SET (docs/benchmarks.md, 2026-11-29).
    pub fn for_record(record_bytes: usize) -> SizeClass {
        assert!(record_bytes <= RECORD_BYTES_MAX);
        let packed = PACKED_SLOT_BYTES.partition_point(|&slot| (slot as usize) < record_bytes);
        if packed < PACKED_CLASS_COUNT {
            return SizeClass::get(PACKED_FIRST_CLASS + packed as u8);
        }
        let multi_page = MULTI_PAGE_PAGES_PER_SLOT
            .partition_point(|&pages| (pages as usize) * PAGE_BYTES < record_bytes);
        assert!(multi_page < MULTI_PAGE_PAGES_PER_SLOT.len(), "the last class holds the largest record");
        SizeClass::get(MULTI_PAGE_FIRST_CLASS + multi_page as u8)
    }

    /// The paged class whose slot is the smallest that holds this packed class's slot: a store
    /// created before the packed classes gives a packed class that class's placement.
    pub fn paged_counterpart(&self) -> SizeClass {
        assert_eq!(self.kind, ClassKind::Packed);
        (0..PAGED_CLASS_COUNT as u8)
            .map(SizeClass::get)
            .find(|paged| paged.slot_bytes >= self.slot_bytes)
            .expect("the largest paged slot is a page")
    }

    pub fn is_multi_page(&self) -> bool {
        self.kind == ClassKind::MultiPage
    }

    /// Whether append placement can serve the class (slots inside units of pages it caches).
    pub fn is_placeable(&self) -> bool {
        !self.is_multi_page()
    }

    fn unit_bytes(&self) -> u64 {
        self.pages_per_unit as u64 * PAGE_BYTES as u64
    }

    /// Byte offset of a slot in its file.
    pub fn slot_offset(&self, slot: u64) -> u64 {
        let unit = slot / self.slots_per_unit as u64;
        let in_unit = slot % self.slots_per_unit as u64;
        PAGE_BYTES as u64 + unit * self.unit_bytes() + in_unit * self.slot_bytes as u64
    }

    /// The page holding the slot's first byte.
    pub fn page_of_slot(&self, slot: u64) -> u64 {
        self.slot_offset(slot) / PAGE_BYTES as u64
    }

    /// Byte offset of the slot inside its first page.
    pub fn offset_in_page(&self, slot: u64) -> usize {
        (self.slot_offset(slot) % PAGE_BYTES as u64) as usize
    }

    /// Where a slot of an in-page class lies.
    pub fn span(&self, slot: u64) -> SlotSpan {
        assert!(!self.is_multi_page(), "class {} keeps whole-page slots", self.id);
        let offset = self.offset_in_page(slot);
        SlotSpan {
            first_page: self.page_of_slot(slot),
            offset,
            pages: (offset + self.slot_bytes as usize).div_ceil(PAGE_BYTES) as u64,
        }
    }

    /// The slots whose first byte lies in `page` (in-page classes).
    pub fn slots_starting_in_page(&self, page: u64) -> std::ops::Range<u64> {
        assert!(page >= 1 && !self.is_multi_page());
        let unit = (page - 1) / self.pages_per_unit as u64;
        let page_in_unit = (page - 1) % self.pages_per_unit as u64;
        let page_bytes = PAGE_BYTES as u64;
        let slot_bytes = self.slot_bytes as u64;
        let per_unit = self.slots_per_unit as u64;
        let first = (page_in_unit * page_bytes).div_ceil(slot_bytes).min(per_unit);
        let end = ((page_in_unit + 1) * page_bytes).div_ceil(slot_bytes).min(per_unit);
        unit * per_unit + first..unit * per_unit + end
    }

    /// The page after the last one a slot below `slots` touches (1 when `slots` is 0): pages
    /// at and past it hold none of those slots.
    pub fn page_after_slots(&self, slots: u64) -> u64 {
        if slots == 0 {
            return 1;
        }
        let last = slots - 1;
        (self.slot_offset(last) + self.slot_bytes as u64).div_ceil(PAGE_BYTES as u64)
    }

    /// The slots of the whole units in `bytes`, read from the file at page `first_page` (the
    /// first page of a unit): each slot's number and bytes, in order.
    pub fn slots_in_units<'a>(
        &self,
        first_page: u64,
        bytes: &'a [u8],
    ) -> impl Iterator<Item = (u64, &'a [u8])> + 'a {
        let unit_bytes = self.unit_bytes() as usize;
        let pages_per_unit = self.pages_per_unit as u64;
        assert!(first_page >= 1 && (first_page - 1).is_multiple_of(pages_per_unit));
        let first_unit = (first_page - 1) / pages_per_unit;
        let slot_bytes = self.slot_bytes as usize;
        let per_unit = self.slots_per_unit as usize;
        bytes.chunks_exact(unit_bytes).enumerate().flat_map(move |(index, unit)| {
            let first_slot = (first_unit + index as u64) * per_unit as u64;
            (0..per_unit).map(move |in_unit| {
                (first_slot + in_unit as u64, &unit[in_unit * slot_bytes..(in_unit + 1) * slot_bytes])
            })
        })
    }

    /// Pages per unit (a slot of a multi-page class, one page of a paged class).
    pub fn unit_pages(&self) -> u64 {
        self.pages_per_unit as u64
    }

    /// Slots that fit in a file of `file_bytes` (whole units only).
    pub fn slots_in_file(&self, file_bytes: u64) -> u64 {
        let pages = (file_bytes / PAGE_BYTES as u64).saturating_sub(1);
        pages / self.pages_per_unit as u64 * self.slots_per_unit as u64
    }

    /// `bytes` rounded up to a file length of whole units after the header page (for a
    /// multi-page class, whose unit is a slot that may be megabytes, whole pages: the file
    /// grows by its growth step and holds the slots that fit).
    pub fn whole_units_file_bytes(&self, bytes: u64) -> u64 {
        let unit_bytes = if self.is_multi_page() { PAGE_BYTES as u64 } else { self.unit_bytes() };
        let data = bytes.saturating_sub(PAGE_BYTES as u64).next_multiple_of(unit_bytes);
        PAGE_BYTES as u64 + data
    }

    /// File bytes needed to hold `slots` slots.
    pub fn file_bytes_for_slots(&self, slots: u64) -> u64 {
        let units = slots.div_ceil(self.slots_per_unit as u64);
        (1 + units * self.pages_per_unit as u64) * PAGE_BYTES as u64
    }

    pub fn file_name(&self, shard_id: u32) -> String {
        format!("{}/class-{:02}.slab", shard_dir(shard_id), self.id)
    }
}

/// The class of a slab file name (`class-NN.slab`, as `SizeClass::file_name` writes it).
pub fn class_of_file_name(name: &str) -> Option<u8> {
    let digits = name.strip_prefix("class-")?.strip_suffix(".slab")?;
    digits.parse::<u8>().ok()
}

pub fn shard_dir(shard_id: u32) -> String {
    format!("shard-{shard_id:03}")
}

/// An item's address: class and slot. Multi-page locations also carry the pages the record
/// uses, so a read fetches exactly those pages in one I/O.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Loc(u64);

const LOC_SLOT_BITS: u32 = 40;
const LOC_PAGES_BITS: u32 = 16;

impl Loc {
    pub fn new(class: u8, slot: u64, pages_used: u32) -> Loc {
        assert!(slot < 1 << LOC_SLOT_BITS, "slot {slot} beyond the location format");
        assert!(pages_used < 1 << LOC_PAGES_BITS);
        Loc(((class as u64) << (LOC_SLOT_BITS + LOC_PAGES_BITS))
            | ((pages_used as u64) << LOC_SLOT_BITS)
            | slot)
    }
    pub fn class(self) -> u8 {
        (self.0 >> (LOC_SLOT_BITS + LOC_PAGES_BITS)) as u8
    }
    pub fn slot(self) -> u64 {
        self.0 & ((1 << LOC_SLOT_BITS) - 1)
    }
    /// Pages the record spans (multi-page classes), 0 for in-page classes.
    pub fn pages_used(self) -> u32 {
        ((self.0 >> LOC_SLOT_BITS) & ((1 << LOC_PAGES_BITS) - 1)) as u32
    }
    /// The same slot, without the record length (free lists and page keys use this).
    pub fn slot_only(self) -> Loc {
        Loc::new(self.class(), self.slot(), 0)
    }
}

impl std::fmt::Debug for Loc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "class {} slot {}", self.class(), self.slot())
    }
}

/// A decoded record header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecordHeader {
    pub kind: RecordKind,
    pub key_bytes: u16,
    pub value_bytes: u32,
    pub seq: u64,
    pub aux: u64,
}

impl RecordHeader {
    pub fn record_bytes(&self) -> usize {
        RECORD_HEADER_BYTES + self.key_bytes as usize + self.value_bytes as usize
    }
}

pub fn record_bytes(key_bytes: usize, value_bytes: usize) -> usize {
    RECORD_HEADER_BYTES + key_bytes + value_bytes
}

/// Pages a record of `record_bytes` spans (for multi-page locations).
pub fn pages_for(record_bytes: usize) -> u32 {
    record_bytes.div_ceil(PAGE_BYTES) as u32
}

pub(crate) fn checksum(shard_id: u32, loc: Loc, header: &[u8], body: &[u8]) -> u32 {
    debug_assert_eq!(header.len(), RECORD_HEADER_BYTES);
    let mut crc = crc32c::crc32c(&header[0..24]);
    crc = crc32c::crc32c_append(crc, &header[28..32]);
    crc = crc32c::crc32c_append(crc, body);
    crc32c::crc32c_append(crc, &place_bytes(shard_id, loc))
}

/// The location bytes every crc ends with: a reader supplies where it read the record from.
fn place_bytes(shard_id: u32, loc: Loc) -> [u8; 13] {
    let mut place = [0u8; 13];
    place[0..4].copy_from_slice(&shard_id.to_le_bytes());
    place[4] = loc.class();
    place[5..13].copy_from_slice(&loc.slot().to_le_bytes());
    place
}

/// Format 3's header check: the header fields, the key and the location.
pub(crate) fn header_checksum(shard_id: u32, loc: Loc, header: &[u8], key: &[u8]) -> u32 {
    let crc = crc32c::crc32c(&header[0..24]);
    let crc = crc32c::crc32c_append(crc, key);
    crc32c::crc32c_append(crc, &place_bytes(shard_id, loc))
}

/// Writes a record at the start of `out` (which must hold it). The body is `key` then `value`.
#[allow(clippy::too_many_arguments)] // the record's fields; a struct would only rename them
pub fn encode_record(
    out: &mut [u8],
    layout: RecordLayout,
    shard_id: u32,
    loc: Loc,
    kind: RecordKind,
    seq: u64,
    aux: u64,
    key: &[u8],
    value: &[u8],
) {
    let total = record_bytes(key.len(), value.len());
    assert!(out.len() >= total, "record of {total} bytes does not fit {} bytes", out.len());
    assert!(key.len() <= u16::MAX as usize && value.len() <= u32::MAX as usize);
    let (header, body) = out.split_at_mut(RECORD_HEADER_BYTES);
    header[0] = kind as u8;
    header[1] = 0; // flags: none defined in format version 1
    header[2..4].copy_from_slice(&(key.len() as u16).to_le_bytes());
    header[4..8].copy_from_slice(&(value.len() as u32).to_le_bytes());
    header[8..16].copy_from_slice(&seq.to_le_bytes());
    header[16..24].copy_from_slice(&aux.to_le_bytes());
    header[24..28].fill(0);
    match layout {
        RecordLayout::Magic => {
            header[28..30].copy_from_slice(&RECORD_MAGIC.to_le_bytes());
            header[30..32].fill(0);
        }
        RecordLayout::HeaderCrc => {
            let check = header_checksum(shard_id, loc, header, key);
            header[28..32].copy_from_slice(&check.to_le_bytes());
        }
    }
    body[..key.len()].copy_from_slice(key);
    body[key.len()..key.len() + value.len()].copy_from_slice(value);
    let crc = checksum(shard_id, loc, header, &body[..key.len() + value.len()]);
    header[24..28].copy_from_slice(&crc.to_le_bytes());
}

/// Why a slot could not be decoded. Reported with its location; never returned as data.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SlotDefect {
    BadMagic,
    /// Format 3: the header check does not match the header fields, key and location.
    HeaderChecksumMismatch {
        stored: u32,
        computed: u32,
    },
    UnknownKind(u8),
    LengthsExceedSlot {
        record_bytes: usize,
        slot_bytes: usize,
    },
    ChecksumMismatch {
        stored: u32,
        computed: u32,
    },
    /// The slot was read only partly (a multi-page record longer than the bytes at hand).
    Truncated,
    /// The header's flags or reserved bytes are not zero: none is defined, so the record is
    /// from a newer format or damaged.
    ReservedBitsSet,
}

impl std::fmt::Display for SlotDefect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SlotDefect::BadMagic => write!(f, "bad record magic"),
            SlotDefect::HeaderChecksumMismatch { stored, computed } => write!(
                f,
                "header checksum mismatch (stored {stored:#010x}, computed {computed:#010x})"
            ),
            SlotDefect::UnknownKind(kind) => write!(f, "unknown record kind {kind}"),
            SlotDefect::LengthsExceedSlot { record_bytes, slot_bytes } => {
                write!(f, "record of {record_bytes} bytes exceeds its {slot_bytes}-byte slot")
            }
            SlotDefect::ChecksumMismatch { stored, computed } => {
                write!(f, "checksum mismatch (stored {stored:#010x}, computed {computed:#010x})")
            }
            SlotDefect::Truncated => write!(f, "record extends past the bytes read"),
            SlotDefect::ReservedBitsSet => write!(f, "flags or reserved header bytes are set"),
        }
    }
}

/// A decoded slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Slot<'a> {
    Empty,
    Record { header: RecordHeader, key: &'a [u8], value: &'a [u8] },
}

/// The header fields of a slot, checked for nothing but a known kind (no magic, no crc).
fn parse_header(bytes: &[u8]) -> Option<RecordHeader> {
    let header = bytes.get(..RECORD_HEADER_BYTES)?;
    Some(RecordHeader {
        kind: RecordKind::from_u8(header[0])?,
        key_bytes: u16::from_le_bytes([header[2], header[3]]),
        value_bytes: u32::from_le_bytes(header[4..8].try_into().unwrap()),
        seq: u64::from_le_bytes(header[8..16].try_into().unwrap()),
        aux: u64::from_le_bytes(header[16..24].try_into().unwrap()),
    })
}

/// Reads a slot's header without its checks (for tools that look at damaged slots; nothing
/// read here may be trusted): the magic must match in a `Magic` file, nothing in a `HeaderCrc`
/// file.
pub fn peek_header(bytes: &[u8], layout: RecordLayout) -> Option<RecordHeader> {
    let header = bytes.get(..RECORD_HEADER_BYTES)?;
    if layout == RecordLayout::Magic && u16::from_le_bytes([header[28], header[29]]) != RECORD_MAGIC
    {
        return None;
    }
    parse_header(bytes)
}

/// The key bytes of a slot whose header starts `bytes`, or why they cannot be had: the header's
/// key length does not fit the slot, or not the bytes at hand.
fn key_of(bytes: &[u8], slot_bytes: usize) -> Result<&[u8], SlotDefect> {
    let key_bytes = u16::from_le_bytes([bytes[2], bytes[3]]) as usize;
    let key_end = RECORD_HEADER_BYTES + key_bytes;
    if key_end > slot_bytes {
        let value_bytes = u32::from_le_bytes(bytes[4..8].try_into().unwrap()) as usize;
        return Err(SlotDefect::LengthsExceedSlot {
            record_bytes: key_end + value_bytes,
            slot_bytes,
        });
    }
    bytes.get(RECORD_HEADER_BYTES..key_end).ok_or(SlotDefect::Truncated)
}

/// A put or tombstone that failed verification but still names a key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DamagedRecord<'a> {
    pub header: RecordHeader,
    pub key: &'a [u8],
    /// The header check holds (format 3): the header and key are the record's own, so the
    /// damage is in its value. Otherwise (formats 1 and 2) the name is only a guess: damage or a
    /// torn write may have renamed the record or changed its seq.
    pub attributable: bool,
}

/// The header and key of a slot that failed verification, if they still look like a put or a
/// tombstone (format 3: the header check holds; formats 1 and 2: magic, kind, lengths that fit
/// the slot and the bytes at hand). Recovery uses this to tell which key a damaged record
/// belonged to; nothing read here is ever returned as data.
pub fn peek_damaged_key<'a>(
    bytes: &'a [u8],
    layout: RecordLayout,
    shard_id: u32,
    loc: Loc,
    slot_bytes: usize,
) -> Option<DamagedRecord<'a>> {
    let header = peek_header(bytes, layout)?;
    if !matches!(header.kind, RecordKind::Put | RecordKind::Tombstone) {
        return None;
    }
    let raw = &bytes[..RECORD_HEADER_BYTES];
    let key = key_of(bytes, slot_bytes).ok()?;
    if key.is_empty() || key.len() > KEY_BYTES_MAX || header.record_bytes() > slot_bytes {
        return None;
    }
    let attributable = match layout {
        RecordLayout::Magic => false,
        RecordLayout::HeaderCrc if header_check_holds(raw, shard_id, loc, key) => true,
        RecordLayout::HeaderCrc => return None,
    };
    Some(DamagedRecord { header, key, attributable })
}

/// The header of a Batch, Part or Chunk record that failed verification, if its header check holds
/// (format 3 only: the damage is then in its value, so its seq is its own). Recovery needs the
/// seq of such a record, which a torn write in flight at a crash leaves behind: no later record
/// may reuse the number, and the watermark stays below it until the record is erased.
pub fn peek_damaged_unkeyed(
    bytes: &[u8],
    layout: RecordLayout,
    shard_id: u32,
    loc: Loc,
    slot_bytes: usize,
) -> Option<RecordHeader> {
    if layout != RecordLayout::HeaderCrc {
        return None;
    }
    let header = peek_header(bytes, layout)?;
    if !matches!(header.kind, RecordKind::Batch | RecordKind::Part | RecordKind::Chunk) {
        return None;
    }
    let key = key_of(bytes, slot_bytes).ok()?;
    header_check_holds(&bytes[..RECORD_HEADER_BYTES], shard_id, loc, key).then_some(header)
}

/// Whether a format-3 header's `header_crc` (bytes 28..32) matches its fields, key and place.
fn header_check_holds(raw: &[u8], shard_id: u32, loc: Loc, key: &[u8]) -> bool {
    u32::from_le_bytes(raw[28..32].try_into().unwrap()) == header_checksum(shard_id, loc, raw, key)
}

/// What a clean close knows of a shard's live items, kept in the value of its Watermark record
/// (docs/format/slab.md): their number, and the XOR of `live_item_hash` over them. Recovery
/// after that close rebuilds the same set from the scan, unless the device lost, misdirected or
/// rotted a record of it; the digest is how such a loss shows across a restart.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LiveDigest {
    pub items: u64,
    pub xor: u64,
}

/// Bytes of an encoded `LiveDigest`: `items: u64 LE, xor: u64 LE`.
pub const LIVE_DIGEST_BYTES: usize = 16;

impl LiveDigest {
    /// Adds (or, XOR being its own inverse, removes) a live item.
    pub fn add(&mut self, key: &[u8], seq: u64) {
        self.items += 1;
        self.xor ^= live_item_hash(key, seq);
    }

    pub fn encode(&self) -> [u8; LIVE_DIGEST_BYTES] {
        let mut out = [0u8; LIVE_DIGEST_BYTES];
        out[..8].copy_from_slice(&self.items.to_le_bytes());
        out[8..].copy_from_slice(&self.xor.to_le_bytes());
        out
    }

    /// The digest in a Watermark record's value; `None` for the empty value older builds wrote.
    pub fn decode(value: &[u8]) -> Option<LiveDigest> {
        let bytes: &[u8; LIVE_DIGEST_BYTES] = value.try_into().ok()?;
        Some(LiveDigest {
            items: u64::from_le_bytes(bytes[..8].try_into().unwrap()),
            xor: u64::from_le_bytes(bytes[8..].try_into().unwrap()),
        })
    }
}

/// The hash of one live item in a `LiveDigest`: xxh3-64 of the key followed by its seq (LE).
pub fn live_item_hash(key: &[u8], seq: u64) -> u64 {
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    hasher.update(key);
    hasher.update(&seq.to_le_bytes());
    hasher.digest()
}

/// Decodes and verifies the slot that starts at `bytes[0]`. `bytes` holds the slot (it may be
/// shorter than a multi-page slot if it holds the whole record).
pub fn decode_slot<'a>(
    bytes: &'a [u8],
    layout: RecordLayout,
    shard_id: u32,
    loc: Loc,
    slot_bytes: usize,
) -> Result<Slot<'a>, SlotDefect> {
    let header = &bytes[..RECORD_HEADER_BYTES];
    if header.iter().all(|&b| b == 0) {
        return Ok(Slot::Empty);
    }
    match layout {
        RecordLayout::Magic => {
            if u16::from_le_bytes([header[28], header[29]]) != RECORD_MAGIC {
                return Err(SlotDefect::BadMagic);
            }
            if header[30] != 0 || header[31] != 0 {
                return Err(SlotDefect::ReservedBitsSet);
            }
        }
        RecordLayout::HeaderCrc => {
            let key = key_of(bytes, slot_bytes)?;
            let stored = u32::from_le_bytes(header[28..32].try_into().unwrap());
            let computed = header_checksum(shard_id, loc, header, key);
            if stored != computed {
                return Err(SlotDefect::HeaderChecksumMismatch { stored, computed });
            }
        }
    }
    let parsed = parse_header(bytes).ok_or(SlotDefect::UnknownKind(header[0]))?;
    if header[1] != 0 {
        return Err(SlotDefect::ReservedBitsSet);
    }
    let total = parsed.record_bytes();
    if total > slot_bytes {
        return Err(SlotDefect::LengthsExceedSlot { record_bytes: total, slot_bytes });
    }
    if total > bytes.len() {
        return Err(SlotDefect::Truncated);
    }
    let body = &bytes[RECORD_HEADER_BYTES..total];
    let stored = u32::from_le_bytes(header[24..28].try_into().unwrap());
    let computed = checksum(shard_id, loc, header, body);
    if stored != computed {
        return Err(SlotDefect::ChecksumMismatch { stored, computed });
    }
    let (key, value) = body.split_at(parsed.key_bytes as usize);
    Ok(Slot::Record { header: parsed, key, value })
}

/// `decode_slot` of a slot whose record passed it before, with the same bytes, layout, shard,
/// location and slot size (the page cache's marks, `cache.rs`): the same answer, without
/// computing the checksums again. Builds with `testing` or debug assertions also decode it in
/// full and assert the answers agree: a mark that outlived a change of its bytes is an engine
/// bug.
pub fn decode_verified_slot<'a>(
    bytes: &'a [u8],
    layout: RecordLayout,
    shard_id: u32,
    loc: Loc,
    slot_bytes: usize,
) -> Result<Slot<'a>, SlotDefect> {
    let known = parse_header(bytes)
        .filter(|header| header.record_bytes() <= slot_bytes.min(bytes.len()))
        .map(|header| {
            let body = &bytes[RECORD_HEADER_BYTES..header.record_bytes()];
            let (key, value) = body.split_at(header.key_bytes as usize);
            Slot::Record { header, key, value }
        });
    if cfg!(any(debug_assertions, feature = "testing")) {
        let checked = decode_slot(bytes, layout, shard_id, loc, slot_bytes);
        assert!(
            matches!((&known, &checked), (Some(a), Ok(b)) if a == b),
            "shard {shard_id}: the record at {loc:?} was marked verified, but its bytes decode \
             to {checked:?}"
        );
    }
    // A mark stands only for a record that decoded, so `None` is a bug the assertion above
    // shows in tests; a production build reports it as the full decode would.
    match known {
        Some(slot) => Ok(slot),
        None => decode_slot(bytes, layout, shard_id, loc, slot_bytes),
    }
}

/// What the byte at `at` of a slab file is, as far as checksums go. For fault injection, which
/// must know whether a flipped bit can be detected at all and whose record it damages.
///
/// Checked: the slab header's fields, every slot's 32 header bytes (an empty slot's are all
/// zero, so any change there is a defect), and a record's key and value. Unchecked: the header
/// page past its fields, a slot's bytes past its record (or past an empty slot's header), and a
/// page's tail past its last slot.
#[cfg(any(test, feature = "testing"))]
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ByteRole {
    Unchecked,
    Checked,
    /// The header or key bytes of a put or tombstone of this key: damage there can rename the
    /// record or change its seq, so recovery can no longer tell whose it was or whether it was
    /// durable (its defect is still reported).
    KeyOf(Vec<u8>),
    /// The value bytes of a put of this key.
    ValueOf(Vec<u8>),
}

/// The role of byte `at` of the slab file `file_name` (`shard-NNN/class-NN.slab`) whose image
/// is `image`.
#[cfg(any(test, feature = "testing"))]
pub fn byte_role(image: &[u8], file_name: &str, at: u64) -> ByteRole {
    use ByteRole::{Checked, KeyOf, Unchecked, ValueOf};
    let base = file_name.rsplit('/').next().unwrap_or(file_name);
    let Some(class) = class_of_file_name(base).filter(|&id| (id as usize) < CLASS_COUNT) else {
        return Unchecked;
    };
    let class = SizeClass::get(class);
    let page = at / PAGE_BYTES as u64;
    if page == 0 {
        return if (at as usize) < SLAB_HEADER_BYTES { Checked } else { Unchecked };
    }
    let unit_bytes = class.unit_pages() * PAGE_BYTES as u64;
    let in_unit = (at - PAGE_BYTES as u64) % unit_bytes;
    let index = in_unit / class.slot_bytes as u64;
    if index >= class.slots_per_unit as u64 {
        return Unchecked;
    }
    let unit = (at - PAGE_BYTES as u64) / unit_bytes;
    if unit * class.slots_per_unit as u64 + index >= class.slots_in_file(image.len() as u64) {
        // A unit the file holds only part of has no slots.
        return Unchecked;
    }
    let slot_start = at - in_unit + index * class.slot_bytes as u64;
    let offset_in_slot = (at - slot_start) as usize;
    let end = (slot_start as usize + class.slot_bytes as usize).min(image.len());
    let slot = image.get(slot_start as usize..end).unwrap_or(&[]);
    let layout = decode_slab_header(image)
        .map_or(RecordLayout::current(), |header| RecordLayout::of_version(header.format_version));
    let header = peek_header(slot, layout).filter(|header| header.record_bytes() <= slot.len());
    if offset_in_slot < RECORD_HEADER_BYTES {
        // The lengths are in the header too: damage there also loses the key's name.
        return match header {
            Some(header) if matches!(header.kind, RecordKind::Put | RecordKind::Tombstone) => {
                let key = &slot[RECORD_HEADER_BYTES..][..header.key_bytes as usize];
                KeyOf(key.to_vec())
            }
            _ => Checked,
        };
    }
    match header {
        Some(header) if offset_in_slot < header.record_bytes() => {
            let in_key = offset_in_slot < RECORD_HEADER_BYTES + header.key_bytes as usize;
            let key = slot[RECORD_HEADER_BYTES..][..header.key_bytes as usize].to_vec();
            match header.kind {
                RecordKind::Put | RecordKind::Tombstone if in_key => KeyOf(key),
                RecordKind::Put => ValueOf(key),
                _ => Checked,
            }
        }
        _ => Unchecked,
    }
}

/// The header page of a slab file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlabHeader {
    pub format_version: u32,
    pub class_id: u8,
    pub slot_bytes: u32,
    pub slots_per_unit: u32,
    pub pages_per_unit: u32,
    pub shard_id: u32,
}

const SLAB_HEADER_BYTES: usize = 36;

pub fn encode_slab_header(page: &mut [u8], header: &SlabHeader) {
    assert_eq!(page.len(), PAGE_BYTES);
    page.fill(0);
    page[0..8].copy_from_slice(&SLAB_MAGIC);
    page[8..12].copy_from_slice(&header.format_version.to_le_bytes());
    page[12..16].copy_from_slice(&(header.class_id as u32).to_le_bytes());
    page[16..20].copy_from_slice(&header.slot_bytes.to_le_bytes());
    page[20..24].copy_from_slice(&header.slots_per_unit.to_le_bytes());
    page[24..28].copy_from_slice(&header.pages_per_unit.to_le_bytes());
    page[28..32].copy_from_slice(&header.shard_id.to_le_bytes());
    let crc = crc32c::crc32c(&page[0..32]);
    page[32..SLAB_HEADER_BYTES].copy_from_slice(&crc.to_le_bytes());
}

/// Decodes and validates a slab header page; the error says what is wrong.
pub fn decode_slab_header(page: &[u8]) -> Result<SlabHeader, String> {
    if page.len() < SLAB_HEADER_BYTES {
        return Err("header page is short".into());
    }
    if page[0..8] != SLAB_MAGIC {
        return Err("not a copse slab file (bad magic)".into());
    }
    let stored = u32::from_le_bytes(page[32..36].try_into().unwrap());
    let computed = crc32c::crc32c(&page[0..32]);
    if stored != computed {
        return Err(format!(
            "header checksum mismatch (stored {stored:#010x}, computed {computed:#010x})"
        ));
    }
    let word = |at: usize| u32::from_le_bytes(page[at..at + 4].try_into().unwrap());
    let format_version = word(8);
    if !(SLAB_FORMAT_VERSION_READ_MIN..=SLAB_FORMAT_VERSION).contains(&format_version) {
        return Err(format!(
            "unsupported slab format version {format_version} (this build reads versions {SLAB_FORMAT_VERSION_READ_MIN} to {SLAB_FORMAT_VERSION})"
        ));
    }
    let class_id = word(12);
    if class_id as usize >= CLASS_COUNT {
        return Err(format!("unknown size class {class_id}"));
    }
    Ok(SlabHeader {
        format_version,
        class_id: class_id as u8,
        slot_bytes: word(16),
        slots_per_unit: word(20),
        pages_per_unit: word(24),
        shard_id: word(28),
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_record_goes_to_the_smallest_new_class_that_holds_it() {
        // The definition: packed classes first, then multi-page ones, smallest slot that fits.
        let by_walk = |record_bytes: usize| {
            (PACKED_FIRST_CLASS..CLASS_COUNT as u8)
                .chain(MULTI_PAGE_FIRST_CLASS..PACKED_FIRST_CLASS)
                .map(SizeClass::get)
                .find(|class| class.slot_bytes as usize >= record_bytes)
                .expect("the last class holds the largest record")
        };
        let mut sizes: Vec<usize> = (0..=3 * PAGE_BYTES).collect();
        for class in 0..CLASS_COUNT as u8 {
            let slot = SizeClass::get(class).slot_bytes as usize;
            sizes.extend([slot.saturating_sub(1), slot, slot + 1]);
        }
        sizes.push(RECORD_BYTES_MAX);
        for record_bytes in sizes.into_iter().filter(|&bytes| bytes <= RECORD_BYTES_MAX) {
            assert_eq!(SizeClass::for_record(record_bytes), by_walk(record_bytes), "{record_bytes}");
        }
    }

    /// The worked example of docs/format/slab.md: a shard closed holding only `k` at seq 7.
    #[test]
    fn the_live_digest_matches_its_worked_example() {
        let mut digest = LiveDigest::default();
        digest.add(b"k", 7);
        let bytes = digest.encode();
        assert_eq!(&bytes[..8], &[1, 0, 0, 0, 0, 0, 0, 0]);
        let mut hashed = b"k".to_vec();
        hashed.extend_from_slice(&7u64.to_le_bytes());
        assert_eq!(&bytes[8..], &xxhash_rust::xxh3::xxh3_64(&hashed).to_le_bytes());
        assert_eq!(format!("{:02x?}", &bytes[8..]), "[0d, 45, cd, 3b, 77, c1, 6f, 90]");
        assert_eq!(LiveDigest::decode(&bytes), Some(digest));
        assert_eq!(LiveDigest::decode(&[]), None);
        // Adding and removing an item restores the digest's hash (XOR is its own inverse).
        digest.add(b"j", 3);
        digest.add(b"j", 3);
        assert_eq!(digest.xor, live_item_hash(b"k", 7));
    }

    use super::*;

    #[test]
    fn classes_grow_and_cover_every_record_size() {
        for kind in [ClassKind::Paged, ClassKind::MultiPage, ClassKind::Packed] {
            let mut previous = 0;
            for class in (0..CLASS_COUNT as u8).map(SizeClass::get).filter(|c| c.kind == kind) {
                assert!(class.slot_bytes > previous, "class {} is not larger", class.id);
                assert_eq!(class.slot_bytes % 8, 0);
                previous = class.slot_bytes;
            }
        }
        assert_eq!(SizeClass::for_record(33).slot_bytes, 64);
        assert_eq!(SizeClass::for_record(33).kind, ClassKind::Packed);
        // YCSB's records: a 1 KiB value or a 128-byte one, with a 23-byte key.
        assert_eq!(SizeClass::for_record(32 + 23 + 1024).slot_bytes, 1088);
        assert_eq!(SizeClass::for_record(32 + 23 + 128).slot_bytes, 192);
        assert_eq!(SizeClass::for_record(4096).slot_bytes, 4096);
        assert_eq!(SizeClass::for_record(4097).pages_per_unit, 2);
        assert_eq!(SizeClass::for_record(4097).kind, ClassKind::MultiPage);
        assert_eq!(SizeClass::for_record(RECORD_BYTES_MAX).pages_per_unit, 4097);
    }

    #[test]
    fn packed_classes_fill_their_units_and_keep_headers_in_one_page() {
        for class in (PACKED_FIRST_CLASS..CLASS_COUNT as u8).map(SizeClass::get) {
            let filled = class.slots_per_unit as usize * class.slot_bytes as usize;
            let unit = PACKED_UNIT_PAGES as usize * PAGE_BYTES;
            assert!(filled <= unit && filled * 100 >= unit * 96, "class {} fills {filled}", class.id);
            for slot in 0..3 * class.slots_per_unit as u64 {
                let span = class.span(slot);
                assert!(span.offset + RECORD_HEADER_BYTES <= PAGE_BYTES);
                assert!((1..=2).contains(&span.pages));
                assert!(class.slots_starting_in_page(span.first_page).contains(&slot));
                let unit_of = |page: u64| (page - 1) / PACKED_UNIT_PAGES as u64;
                assert_eq!(unit_of(span.first_page), unit_of(span.first_page + span.pages - 1));
            }
        }
    }

    #[test]
    fn slot_geometry_matches_file_size() {
        let class = SizeClass::get(10); // 3 slots per page
        assert_eq!(class.slots_per_unit, 3);
        assert_eq!(class.page_of_slot(0), 1);
        assert_eq!(class.page_of_slot(5), 2);
        assert_eq!(class.offset_in_page(5), 2 * 1360);
        assert_eq!(class.slots_in_file(class.file_bytes_for_slots(7)), 9);
        assert_eq!(class.slots_starting_in_page(2), 3..6);
        assert_eq!(class.page_after_slots(4), 3);
        let big = SizeClass::get(13);
        assert_eq!(big.page_of_slot(3), 1 + 3 * 2);
        assert_eq!(big.slots_in_file(big.file_bytes_for_slots(5)), 5);
        // 1088-byte slots: 15 per 4-page unit. Slot 3 starts at byte 3264 of page 1 and ends in
        // page 2; slot 15 starts unit 1 (page 5).
        let packed = SizeClass::for_record(1079);
        assert_eq!((packed.slots_per_unit, packed.pages_per_unit), (15, 4));
        assert_eq!(packed.span(3), SlotSpan { first_page: 1, offset: 3264, pages: 2 });
        assert_eq!(packed.span(15), SlotSpan { first_page: 5, offset: 0, pages: 1 });
        assert_eq!(packed.slots_starting_in_page(2), 4..8);
        assert_eq!(packed.slots_starting_in_page(4), 12..15);
        assert_eq!(packed.page_after_slots(4), 3);
        assert_eq!(packed.page_after_slots(15), 5);
        assert_eq!(packed.slots_in_file(packed.file_bytes_for_slots(16)), 30);
    }

    const LAYOUTS: [RecordLayout; 2] = [RecordLayout::HeaderCrc, RecordLayout::Magic];

    #[test]
    fn record_round_trips_and_detects_every_flipped_bit() {
        for layout in LAYOUTS {
            let loc = Loc::new(3, 77, 0);
            let mut slot = vec![0u8; 168];
            encode_record(&mut slot, layout, 2, loc, RecordKind::Put, 9, 0, b"key", b"value");
            match decode_slot(&slot, layout, 2, loc, 168).unwrap() {
                Slot::Record { header, key, value } => {
                    assert_eq!(
                        (header.kind, header.seq, key, value),
                        (RecordKind::Put, 9, &b"key"[..], &b"value"[..])
                    );
                }
                Slot::Empty => panic!("decoded an empty slot"),
            }
            let used = record_bytes(3, 5);
            for bit in 0..used * 8 {
                let mut flipped = slot.clone();
                flipped[bit / 8] ^= 1 << (bit % 8);
                assert!(
                    decode_slot(&flipped, layout, 2, loc, 168).is_err(),
                    "{layout:?}: flip of bit {bit} went unnoticed"
                );
            }
        }
    }

    #[test]
    fn checksum_covers_the_location() {
        for layout in LAYOUTS {
            let loc = Loc::new(3, 77, 0);
            let mut slot = vec![0u8; 168];
            encode_record(&mut slot, layout, 2, loc, RecordKind::Put, 9, 0, b"key", b"value");
            assert!(decode_slot(&slot, layout, 2, Loc::new(3, 78, 0), 168).is_err());
            assert!(decode_slot(&slot, layout, 1, loc, 168).is_err());
        }
    }

    #[test]
    fn a_record_is_read_only_in_the_layout_it_was_written_in() {
        let loc = Loc::new(3, 77, 0);
        let encoded = |layout| {
            let mut slot = vec![0u8; 168];
            encode_record(&mut slot, layout, 2, loc, RecordKind::Put, 9, 0, b"k", b"v");
            slot
        };
        let slot = encoded(RecordLayout::HeaderCrc);
        assert_eq!(decode_slot(&slot, RecordLayout::Magic, 2, loc, 168), Err(SlotDefect::BadMagic));
        let slot = encoded(RecordLayout::Magic);
        assert!(matches!(
            decode_slot(&slot, RecordLayout::HeaderCrc, 2, loc, 168),
            Err(SlotDefect::HeaderChecksumMismatch { .. })
        ));
    }

    /// Simulator seed 1636: slot 6 of class 3 (168-byte slots) starts 16 bytes before a sector
    /// boundary, so its header straddles it. A crash tore the write of k14 (seq 144) over a
    /// stale copy of k04 (seq 118): the first sector kept k04's kind, lengths and seq, the next
    /// one took k14's key. In format 2 that chimera reads as "k14 at seq 118", a once-durable
    /// record, and recovery let it decide k14 as corrupt.
    #[test]
    fn a_write_torn_across_a_record_header_names_no_key() {
        let class = SizeClass::get(3);
        let loc = Loc::new(3, 6, 0);
        let start = class.offset_in_page(6);
        let boundary = 1024 - start;
        assert!(boundary > 0 && boundary < RECORD_HEADER_BYTES, "the header straddles a sector");
        let slot_bytes = class.slot_bytes as usize;
        for layout in LAYOUTS {
            let mut old = vec![0u8; slot_bytes];
            encode_record(&mut old, layout, 0, loc, RecordKind::Put, 118, 114, b"k04", &[1; 100]);
            let mut new = vec![0u8; slot_bytes];
            encode_record(&mut new, layout, 0, loc, RecordKind::Put, 144, 141, b"k14", &[2; 100]);
            let torn = [&old[..boundary], &new[boundary..]].concat();
            assert!(decode_slot(&torn, layout, 0, loc, slot_bytes).is_err());
            let named = peek_damaged_key(&torn, layout, 0, loc, slot_bytes);
            match layout {
                RecordLayout::HeaderCrc => assert_eq!(named, None, "a chimera was attributed"),
                // The weakness format 3 removes: recovery only lets such a record decide a key
                // that still has an older valid record.
                RecordLayout::Magic => {
                    let named = named.expect("format 2 reads a name from the chimera");
                    assert_eq!(
                        (named.key, named.header.seq, named.attributable),
                        (&b"k14"[..], 118, false)
                    );
                }
            }
        }
    }

    #[test]
    fn a_record_damaged_in_its_value_still_names_its_key_and_one_damaged_in_its_header_does_not() {
        let loc = Loc::new(3, 77, 0);
        let mut slot = vec![0u8; 168];
        let layout = RecordLayout::HeaderCrc;
        encode_record(&mut slot, layout, 2, loc, RecordKind::Put, 9, 4, b"key", b"value");
        let mut value_rot = slot.clone();
        value_rot[RECORD_HEADER_BYTES + 3] ^= 0x10;
        let named = peek_damaged_key(&value_rot, layout, 2, loc, 168).expect("named");
        assert_eq!((named.key, named.header.seq, named.attributable), (&b"key"[..], 9, true));
        for at in (0..RECORD_HEADER_BYTES + 3).filter(|at| !(24..28).contains(at)) {
            let mut header_rot = slot.clone();
            header_rot[at] ^= 0x01;
            assert_eq!(peek_damaged_key(&header_rot, layout, 2, loc, 168), None, "byte {at}");
        }
        // Another slot's record: misdirected, so no name either.
        assert_eq!(peek_damaged_key(&value_rot, layout, 2, Loc::new(3, 78, 0), 168), None);
    }

    #[test]
    fn slab_header_round_trips_and_refuses_other_versions() {
        let header = SlabHeader {
            format_version: SLAB_FORMAT_VERSION,
            class_id: 4,
            slot_bytes: 256,
            slots_per_unit: 16,
            pages_per_unit: 1,
            shard_id: 1,
        };
        let mut page = vec![0u8; PAGE_BYTES];
        encode_slab_header(&mut page, &header);
        assert_eq!(decode_slab_header(&page).unwrap(), header);
        // Version 1 (before Part records) is still read.
        let older = SlabHeader { format_version: 1, ..header };
        encode_slab_header(&mut page, &older);
        assert_eq!(decode_slab_header(&page).unwrap(), older);
        let newer = SlabHeader { format_version: SLAB_FORMAT_VERSION + 1, ..header };
        encode_slab_header(&mut page, &newer);
        assert!(decode_slab_header(&page)
            .unwrap_err()
            .contains(&format!("unsupported slab format version {}", SLAB_FORMAT_VERSION + 1)));
        // The worked examples of docs/format/slab.md: class 0 of shard 0 (format 3), and the
        // packed class of 1088-byte slots, 15 in each 4-page unit (format 4).
        let packed = SlabHeader {
            format_version: 4,
            class_id: 64,
            slot_bytes: 1088,
            slots_per_unit: 15,
            pages_per_unit: 4,
            shard_id: 0,
        };
        let class = SizeClass::get(64);
        assert_eq!((class.slot_bytes, class.slots_per_unit, class.pages_per_unit), (1088, 15, 4));
        encode_slab_header(&mut page, &packed);
        assert_eq!(&page[32..36], &[0xe5, 0x23, 0xd6, 0xe4]);
        let example = SlabHeader {
            format_version: 3,
            class_id: 0,
            slot_bytes: 64,
            slots_per_unit: 64,
            pages_per_unit: 1,
            shard_id: 0,
        };
        encode_slab_header(&mut page, &example);
        assert_eq!(&page[32..36], &[0xb3, 0xe6, 0xa8, 0xaf]);
        encode_slab_header(&mut page, &SlabHeader { format_version: 2, ..example });
        assert_eq!(&page[32..36], &[0x3d, 0x24, 0xe7, 0x15]);
        page[0] = b'X';
        assert!(decode_slab_header(&page).is_err());
    }

    /// The record bytes of docs/format/slab.md's worked example (format 3, class 0, shard 0).
    #[test]
    fn records_encode_as_the_spec_shows() {
        use RecordKind::{Free, Put, Tombstone};
        use RecordLayout::{HeaderCrc, Magic};
        // Bytes 24..32 (the crc, then the header check) of a record in slot `slot` of class 0.
        let checks = |layout, slot, kind, seq, aux, key: &[u8], value: &[u8]| {
            let mut bytes = vec![0u8; 64];
            encode_record(&mut bytes, layout, 0, Loc::new(0, slot, 0), kind, seq, aux, key, value);
            bytes[24..32].to_vec()
        };
        let put = checks(HeaderCrc, 3, Put, 7, 0, b"user1", b"hello");
        assert_eq!(put, [0x7b, 0x4e, 0x6e, 0x71, 0x48, 0x2c, 0x28, 0x55]);
        let tombstone = checks(HeaderCrc, 4, Tombstone, 8, 0, b"user1", b"");
        assert_eq!(tombstone, [0xc2, 0x95, 0x41, 0xe3, 0x01, 0x82, 0x0b, 0x72]);
        let free = checks(HeaderCrc, 5, Free, 0, 10, b"", b"");
        assert_eq!(free, [0x10, 0x4a, 0x7d, 0xd4, 0xc4, 0xeb, 0x4a, 0x7e]);
        // Format 2's record of the same put, from that version's worked example.
        let put_v2 = checks(Magic, 3, Put, 7, 0, b"user1", b"hello");
        assert_eq!(put_v2, [0x5f, 0xe2, 0xfd, 0x87, 0x5e, 0xc0, 0x00, 0x00]);
    }

    #[test]
    fn loc_packs_its_fields() {
        let loc = Loc::new(35, (1 << 40) - 1, 4097);
        assert_eq!((loc.class(), loc.slot(), loc.pages_used()), (35, (1 << 40) - 1, 4097));
        assert_eq!(loc.slot_only(), Loc::new(35, (1 << 40) - 1, 0));
    }
}
