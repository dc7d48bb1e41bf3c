//! What the offline check (`copse check`, `interfaces/check.rs`) reports, in an engine-neutral
//! shape: each engine's own check (`engine/native/check.rs`, the RocksDB engine's instance check)
//! fills these, and the store-level check adds the manifest and totals.
//!
//! Invariant: every defect is counted in `Problems::found`; the first `PROBLEMS_LISTED_MAX` are
//! listed, so a badly damaged store gives a report of bounded size and still an exact count.

use serde::Serialize;

/// Problems listed in a report at most; the rest are only counted.
pub const PROBLEMS_LISTED_MAX: usize = 1000;

/// One defect: where it is and what is wrong.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Problem {
    /// Relative to the store directory, e.g. `shard-000/class-04.slab` or `MANIFEST`.
    pub file: String,
    pub shard: Option<u32>,
    pub class: Option<u8>,
    /// The slot, for a slot defect; `None` for a problem with a whole file.
    pub slot: Option<u64>,
    /// Where the damaged structure starts in the file: the slot's first byte, or 0 for a header.
    /// (A checksum says that a slot is damaged, not which byte.)
    pub byte_offset: Option<u64>,
    pub what: String,
}

/// Slots by what they hold. `items` and `tombstones` count every copy, stale ones included.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct SlotCounts {
    pub slots: u64,
    pub items: u64,
    pub tombstones: u64,
    pub free: u64,
    pub empty: u64,
    pub batch_records: u64,
    /// Cross-shard parts (prepared or committed) not yet forgotten.
    pub part_records: u64,
    /// Records of chains holding a batch or part too large for one record (whole chains, or
    /// the leftovers of a crash the next open erases).
    pub chunk_records: u64,
    /// Slots that do not verify (torn writes, bit flips) and batch or part records that do not
    /// decode.
    pub defective: u64,
}

impl SlotCounts {
    pub fn add(&mut self, other: &SlotCounts) {
        self.slots += other.slots;
        self.items += other.items;
        self.tombstones += other.tombstones;
        self.free += other.free;
        self.empty += other.empty;
        self.batch_records += other.batch_records;
        self.part_records += other.part_records;
        self.chunk_records += other.chunk_records;
        self.defective += other.defective;
    }
}

/// The state of a slab file's header page.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum HeaderState {
    Ok,
    /// All zeros: the file was created but its header never became durable (no slot is used),
    /// or a device lost the header's write (slots are used: listed as a problem; recovery keeps
    /// the records and rewrites the header). The slots are scanned either way.
    Blank,
    /// Listed as a problem. The slots are still scanned with the geometry the file name implies:
    /// each record's checksum covers its shard, class and slot, so one that verifies is genuine.
    Bad,
    /// The file could not be read (the device error is listed as a problem).
    Unreadable,
}

#[derive(Clone, Debug, Serialize)]
pub struct FileReport {
    pub file: String,
    pub class: Option<u8>,
    pub slot_bytes: Option<u32>,
    pub file_bytes: u64,
    pub header: HeaderState,
    pub slots: SlotCounts,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct ShardReport {
    pub shard: u32,
    pub files: Vec<FileReport>,
    pub slots: SlotCounts,
    /// Keys whose newest record is a put: what recovery would index.
    pub live_keys: u64,
    /// Keys whose newest record is a tombstone.
    pub deleted_keys: u64,
    /// Put and tombstone records older than their key's newest record.
    pub stale_copies: u64,
}

/// Counts every problem, keeps the first `PROBLEMS_LISTED_MAX`.
#[derive(Default)]
pub struct Problems {
    pub found: u64,
    pub listed: Vec<Problem>,
}

impl Problems {
    pub fn report(&mut self, problem: Problem) {
        self.found += 1;
        if self.listed.len() < PROBLEMS_LISTED_MAX {
            self.listed.push(problem);
        }
    }

    pub fn file(&mut self, file: &str, shard: Option<u32>, class: Option<u8>, what: String) {
        self.report(Problem {
            file: file.to_string(),
            shard,
            class,
            slot: None,
            byte_offset: None,
            what,
        });
    }
}

/// What an engine's check of a store's shards found.
#[derive(Default)]
pub struct ShardChecks {
    pub shards: Vec<ShardReport>,
    pub files_checked: u64,
    pub bytes_scanned: u64,
}
