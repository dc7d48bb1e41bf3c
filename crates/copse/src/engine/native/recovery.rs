//! Recovery: every open scans every slab of the shard with large sequential reads and rebuilds
//! the index, the free lists and the tombstone guards (there is no commit log to replay and no
//! index snapshot to trust). Shards recover in parallel, each on its own thread.
//!
//! Per key the record with the highest sequence number wins; every older record is a stale copy
//! and is freed (counted under the key's hash, invariant 4 of `mod.rs`). Slots that do not
//! verify are counted, logged with their location, erased and never indexed. A durable batch
//! record is replayed (see `batch.rs`), and so is a committed Part record (`parts.rs`); a prepared
//! Part record is only reported. A chain of Chunk records counts as the record it holds only if
//! every record of it is found; the records of any other chain are erased (`chain.rs`). The
//! sequence counter restarts above every number seen.

use crate::hash::{HashMap, HashSet};
use std::time::Instant;

use super::chain::{decode_chunk, FoundChains};
use super::format::{
    class_of_file_name, decode_slab_header, decode_slot, pages_for, peek_damaged_key,
    peek_damaged_unkeyed, shard_dir, DamagedRecord, LiveDigest, Loc, RecordKind, RecordLayout,
    SizeClass, SlabHeader, Slot, SlotDefect, CLASS_COUNT,
};
use super::index::Entry;
use super::seqs::key_hash;
use super::slabs::ClassFile;
use super::NativeEngine;
use crate::device::{
    read_sync, AlignedBuf, BlockDevice, DeviceError, FaultPoint, FileId, IoKind, IoRequest,
};
use crate::engine::batch_codec::decode_batch;
use crate::engine::part::{self, PartRecord, PartState};
use crate::engine::BatchOp;
use crate::error::OpenError;
use crate::limits::{PAGE_BYTES, RECOVERY_CHUNKS_IN_FLIGHT, RECOVERY_CHUNK_BYTES};

/// Called with each slot's location, decoded content (or defect) and raw bytes.
pub type SlotVisitor<'a> = dyn FnMut(Loc, Result<Slot<'_>, SlotDefect>, &[u8]) + 'a;

/// Corrupt slots logged one by one before recovery only counts them.
const CORRUPT_SLOTS_LOGGED_MAX: u64 = 20;

/// Reads a slab file's header page and checks it belongs to `class` of `shard_id`.
/// `Ok(None)`: the header page is blank: the file was created but its header never became
/// durable (then no record follows it), or a device lost the header's write (then records do).
pub fn read_slab_header(
    device: &mut dyn BlockDevice,
    file: FileId,
    file_bytes: u64,
    class: SizeClass,
    shard_id: u32,
) -> Result<Option<SlabHeader>, Result<String, DeviceError>> {
    if file_bytes < PAGE_BYTES as u64 {
        return Ok(None);
    }
    let page = read_sync(device, file, 0, PAGE_BYTES).map_err(Err)?;
    check_slab_header(&page, class, shard_id).map_err(Ok)
}

/// Judges a slab file's header page: `None` if it is blank (the file was never initialised),
/// an error saying what is wrong if it does not belong to `class` of `shard_id`.
pub fn check_slab_header(
    page: &[u8],
    class: SizeClass,
    shard_id: u32,
) -> Result<Option<SlabHeader>, String> {
    if page.iter().all(|&byte| byte == 0) {
        return Ok(None);
    }
    let header = decode_slab_header(page)?;
    if header.class_id != class.id {
        return Err(format!("header says class {}, file name says {}", header.class_id, class.id));
    }
    if header.shard_id != shard_id {
        return Err(format!("header says shard {}, file is in shard {shard_id}", header.shard_id));
    }
    if (header.slot_bytes, header.slots_per_unit, header.pages_per_unit)
        != (class.slot_bytes, class.slots_per_unit, class.pages_per_unit)
    {
        return Err(format!(
            "header geometry ({} bytes, {} per page, {} pages) does not match class {}",
            header.slot_bytes, header.slots_per_unit, header.pages_per_unit, class.id
        ));
    }
    Ok(Some(header))
}

/// A slab file to scan: which file, how long, and how to read its slots.
#[derive(Clone, Copy, Debug)]
pub struct SlabFile {
    pub file: FileId,
    pub file_bytes: u64,
    pub class: SizeClass,
    /// From the file's header page.
    pub layout: RecordLayout,
}

/// Scans every slot of a slab file with sequential reads, several chunks in flight, calling
/// `visit` with each slot's location, decoded content (or defect) and raw bytes.
pub fn scan_slab(
    device: &mut dyn BlockDevice,
    shard_id: u32,
    slab: SlabFile,
    progress: Option<&indicatif::ProgressBar>,
    visit: &mut SlotVisitor<'_>,
) -> Result<u64, DeviceError> {
    let SlabFile { file, file_bytes, class, layout } = slab;
    assert_eq!(device.in_flight(), 0);
    let slots = class.slots_in_file(file_bytes);
    // Only whole units hold slots; chunks are whole units, so they hold whole slots.
    let unit_bytes = class.unit_pages() as usize * PAGE_BYTES;
    let data_end = PAGE_BYTES as u64 + slots / class.slots_per_unit as u64 * unit_bytes as u64;
    let chunk_bytes = (unit_bytes * (RECOVERY_CHUNK_BYTES / unit_bytes).max(1)) as u64;
    let mut next_offset = PAGE_BYTES as u64;
    let mut scanned = 0u64;
    let mut done = Vec::new();
    loop {
        let mut requests = Vec::new();
        while device.in_flight() + requests.len() < RECOVERY_CHUNKS_IN_FLIGHT
            && next_offset < data_end
        {
            let len = chunk_bytes.min(data_end - next_offset);
            requests.push(IoRequest {
                token: next_offset,
                file,
                offset: next_offset,
                kind: IoKind::Read,
                buf: AlignedBuf::zeroed(len as usize),
            });
            next_offset += len;
        }
        if !requests.is_empty() {
            device.submit(requests)?;
        }
        if device.in_flight() == 0 {
            break;
        }
        done.clear();
        device.reap(1, &mut done)?;
        for completion in done.drain(..) {
            completion.result?;
            let chunk = &completion.buf[..];
            visit_chunk(shard_id, class, layout, completion.offset, chunk, visit);
            scanned += chunk.len() as u64;
            if let Some(progress) = progress {
                progress.inc(chunk.len() as u64);
            }
        }
    }
    Ok(scanned)
}

fn visit_chunk(
    shard_id: u32,
    class: SizeClass,
    layout: RecordLayout,
    offset: u64,
    chunk: &[u8],
    visit: &mut SlotVisitor<'_>,
) {
    let slot_bytes = class.slot_bytes as usize;
    let first_page = offset / PAGE_BYTES as u64;
    if class.is_multi_page() {
        let first_slot = (first_page - 1) / class.pages_per_unit as u64;
        for (index, bytes) in chunk.chunks_exact(slot_bytes).enumerate() {
            let slot = first_slot + index as u64;
            let bare = Loc::new(class.id, slot, 0);
            let result = decode_slot(bytes, layout, shard_id, bare, slot_bytes);
            let loc = match &result {
                Ok(Slot::Record { header, .. }) => {
                    Loc::new(class.id, slot, pages_for(header.record_bytes()))
                }
                _ => bare,
            };
            visit(loc, result, bytes);
        }
    } else {
        for (slot, bytes) in class.slots_in_units(first_page, chunk) {
            let loc = Loc::new(class.id, slot, 0);
            visit(loc, decode_slot(bytes, layout, shard_id, loc, slot_bytes), bytes);
        }
    }
}

struct Newest {
    loc: Loc,
    seq: u64,
    /// The record's durable watermark when written: of two copies of one version (a move's),
    /// the later one carries the higher (or the same) mark in normal operation. (A collector
    /// move written while an open replays a batch may carry a lower one; either copy is then
    /// kept, which is as correct: both are the version.)
    written_mark: u64,
    tombstone: bool,
}

/// A slot that failed verification but still names its key: once-durable (rot) or torn.
struct Damaged {
    loc: Loc,
    key: Box<[u8]>,
    seq: u64,
    tombstone: bool,
    /// Its header check holds (format 3), so the key and seq are its own.
    attributable: bool,
}

#[derive(Default)]
struct Found {
    /// Do not log defective slots (the offline check reports them itself).
    quiet: bool,
    /// Highest durable watermark carried by a valid record: every record with a sequence number
    /// at or below it was durable once, so if it is damaged now, that is rot, not a torn write.
    watermark_max: u64,
    damaged: Vec<Damaged>,
    newest: HashMap<Box<[u8]>, Newest>,
    stale: Vec<(Loc, Option<u64>)>,
    free: Vec<Loc>,
    empty: Vec<Loc>,
    corrupt: Vec<Loc>,
    /// The first defective slots with what is wrong with them, for `RecoveryStats`.
    corrupt_sample: Vec<String>,
    /// Batch records (or whole chains): their records, sequence number and operations.
    batches: Vec<(Vec<Loc>, u64, Vec<BatchOp>)>,
    /// Part records (or whole chains): records, sequence number, content.
    parts: Vec<(Vec<Loc>, u64, PartRecord)>,
    /// Chunk records, until `sort_chains` makes whole records of complete chains.
    chains: FoundChains,
    /// The records of chains found incomplete: erased.
    broken_chains: Vec<Loc>,
    /// Damaged Batch, Part and Chunk records whose own header still holds: their sequence
    /// numbers.
    damaged_unkeyed: HashMap<Loc, u64>,
    /// The Watermark record with the highest seq: its seq and the live digest it carries.
    last_watermark: Option<(u64, Option<LiveDigest>)>,
    /// Slab files whose header page was blank over records (its write was lost): what to report.
    lost_headers: Vec<String>,
    max_seq: u64,
    /// Per class: one past the highest slot holding anything.
    frontier: Vec<u64>,
}

impl Found {
    fn visit(
        &mut self,
        shard_id: u32,
        layout: RecordLayout,
        loc: Loc,
        result: Result<Slot<'_>, SlotDefect>,
        bytes: &[u8],
    ) {
        let class = loc.class() as usize;
        let touched = |found: &mut Found| {
            found.frontier[class] = found.frontier[class].max(loc.slot() + 1);
        };
        match result {
            Ok(Slot::Empty) => self.empty.push(loc),
            Ok(Slot::Record { header, key, value }) => {
                touched(self);
                self.max_seq = self.max_seq.max(header.seq);
                if header.kind != RecordKind::Free {
                    self.watermark_max = self.watermark_max.max(header.aux);
                }
                match header.kind {
                    RecordKind::Put | RecordKind::Tombstone => {
                        let tombstone = header.kind == RecordKind::Tombstone;
                        let tag = |tombstone: bool, key: &[u8]| (!tombstone).then(|| key_hash(key));
                        let found =
                            Newest { loc, seq: header.seq, written_mark: header.aux, tombstone };
                        match self.newest.get_mut(key) {
                            // Two valid copies of one seq are one version (a collector's or a
                            // clustering move): either would do, and the later copy, the one
                            // the move put where it wanted it, is kept.
                            Some(newest)
                                if (newest.seq, newest.written_mark)
                                    >= (header.seq, header.aux) =>
                            {
                                self.stale.push((loc, tag(tombstone, key)));
                            }
                            Some(newest) => {
                                self.stale.push((newest.loc, tag(newest.tombstone, key)));
                                *newest = found;
                            }
                            None => {
                                self.newest.insert(key.into(), found);
                            }
                        }
                    }
                    RecordKind::Free => self.free.push(loc),
                    RecordKind::Watermark => {
                        if self.last_watermark.is_none_or(|(seq, _)| seq < header.seq) {
                            self.last_watermark = Some((header.seq, LiveDigest::decode(value)));
                        }
                        self.free.push(loc);
                    }
                    RecordKind::Batch => match decode_batch(value) {
                        Ok(ops) => self.batches.push((vec![loc], header.seq, ops)),
                        Err(reason) => self.corrupt_slot(shard_id, loc, &reason),
                    },
                    RecordKind::Part => match part::decode(value) {
                        Ok(record) => self.parts.push((vec![loc], header.seq, record)),
                        Err(reason) => self.corrupt_slot(shard_id, loc, &reason),
                    },
                    RecordKind::Chunk => match decode_chunk(value) {
                        Ok(chunk) => self.chains.add(loc, header.seq, chunk),
                        Err(reason) => self.corrupt_slot(shard_id, loc, &reason),
                    },
                }
            }
            Err(defect) => {
                touched(self);
                let class = SizeClass::get(loc.class());
                if let Some(DamagedRecord { header, key, attributable }) =
                    peek_damaged_key(bytes, layout, shard_id, loc, class.slot_bytes as usize)
                {
                    let pages =
                        if class.is_multi_page() { pages_for(header.record_bytes()) } else { 0 };
                    self.damaged.push(Damaged {
                        loc: Loc::new(loc.class(), loc.slot(), pages),
                        key: key.into(),
                        seq: header.seq,
                        tombstone: header.kind == RecordKind::Tombstone,
                        attributable,
                    });
                } else if let Some(header) =
                    peek_damaged_unkeyed(bytes, layout, shard_id, loc, class.slot_bytes as usize)
                {
                    self.damaged_unkeyed.insert(loc.slot_only(), header.seq);
                }
                self.corrupt_slot(shard_id, loc, &defect.to_string());
            }
        }
    }

    fn corrupt_slot(&mut self, shard_id: u32, loc: Loc, reason: &str) {
        if (self.corrupt_sample.len() as u64) < CORRUPT_SLOTS_LOGGED_MAX {
            self.corrupt_sample.push(format!(
                "class {} slot {}: {reason}",
                loc.class(),
                loc.slot()
            ));
        }
        if !self.quiet && (self.corrupt.len() as u64) < CORRUPT_SLOTS_LOGGED_MAX {
            tracing::warn!(
                shard = shard_id,
                ?loc,
                reason,
                "torn or corrupt slot: not indexed, will be erased"
            );
        }
        self.corrupt.push(loc);
    }
}

/// A batch recovery replays: its records (one, or a chain's), sequence number, every operation,
/// and the operations it writes again.
type BatchReplay = (Vec<Loc>, u64, Vec<BatchOp>, Vec<BatchOp>);

/// How recovery judged the damaged records that still name their key.
struct DamagedJudged {
    /// Damaged records that decide their key (rot in its newest record): kept, not erased.
    kept: HashSet<Loc>,
    /// Damaged records that may be torn in-flight writes, with their sequence numbers.
    torn: HashMap<Loc, u64>,
    /// Damaged puts known to be stale copies of their key, with the key's hash: erased counted
    /// under it, so a tombstone of the key outlives them (invariant 4 of `mod.rs`).
    stale: HashMap<Loc, u64>,
    /// The keys whose newest record is damaged, for the log.
    decided: Vec<(Loc, Box<[u8]>)>,
}

impl Found {
    /// Makes the whole record of each complete chain of Chunk records, as if it had been found
    /// as one record; the records of incomplete chains are to be erased. Called once, after
    /// every slot was visited.
    fn sort_chains(&mut self, shard_id: u32) {
        let sorted = std::mem::take(&mut self.chains).sort();
        for (seq, what) in sorted.malformed {
            if !self.quiet {
                tracing::warn!(shard = shard_id, seq, "{what}");
            }
            self.corrupt_sample.push(what);
        }
        self.broken_chains = sorted.incomplete;
        for chain in sorted.whole {
            let reason = match chain.whole {
                RecordKind::Batch => match decode_batch(&chain.value) {
                    Ok(ops) => {
                        self.batches.push((chain.records, chain.seq, ops));
                        continue;
                    }
                    Err(reason) => reason,
                },
                _ => match part::decode(&chain.value) {
                    Ok(record) => {
                        self.parts.push((chain.records, chain.seq, record));
                        continue;
                    }
                    Err(reason) => reason,
                },
            };
            let reason = format!("a whole chain of seq {} does not decode: {reason}", chain.seq);
            for loc in chain.records {
                self.corrupt_slot(shard_id, loc, &reason);
            }
        }
    }

    /// A damaged record that was durable once (rot) and is the newest of its key decides the
    /// key: a put makes the key read as corrupt, a tombstone keeps it deleted; either way no
    /// older copy comes back. One that may be a torn in-flight write is to be erased, and the
    /// watermark stays below its number until the erasure is durable.
    fn judge_damaged(&mut self) -> DamagedJudged {
        let mut judged = DamagedJudged {
            kept: HashSet::default(),
            torn: HashMap::default(),
            stale: HashMap::default(),
            decided: Vec::new(),
        };
        let mut damaged = std::mem::take(&mut self.damaged);
        damaged.sort_by_key(|damaged| damaged.seq);
        for Damaged { loc, key, seq, tombstone, attributable } in damaged {
            if seq > self.watermark_max {
                judged.torn.insert(loc.slot_only(), seq);
                continue;
            }
            let tag = |tombstone: bool, key: &[u8]| (!tombstone).then(|| key_hash(key));
            // A format-3 record whose header check holds is the key's own, so it decides its key
            // even if it was the only copy. A format-1/2 header may be a chimera (a write torn
            // across it joins one record's seq to another's key) or renamed by the damage, so it
            // decides only a key that still has an older valid record (a key whose only copy
            // rots then reads as absent: docs/reliability.md).
            let decides = match self.newest.get(&key) {
                Some(newest) => newest.seq < seq,
                None => attributable,
            };
            if !decides {
                // A named stale copy (a put) is erased counted under its key.
                if let Some(hash) = tag(tombstone, &key).filter(|_| attributable) {
                    judged.stale.insert(loc.slot_only(), hash);
                }
                continue;
            }
            // Every valid record was visited before: no copy of this seq is left to compare.
            let decided = Newest { loc, seq, written_mark: 0, tombstone };
            if let Some(previous) = self.newest.insert(key.clone(), decided) {
                if !judged.kept.remove(&previous.loc.slot_only()) {
                    self.stale.push((previous.loc, tag(previous.tombstone, &key)));
                } else if let Some(hash) = tag(previous.tombstone, &key) {
                    // A damaged record no longer the newest: erased as a stale copy.
                    judged.stale.insert(previous.loc.slot_only(), hash);
                }
            }
            judged.kept.insert(loc.slot_only());
            judged.decided.push((loc, key));
        }
        self.corrupt.retain(|loc| !judged.kept.contains(&loc.slot_only()));
        judged
    }

    /// The batch records in sequence order, each with the operations recovery writes again:
    /// those whose key has no record at least as new as the batch.
    fn batch_replays(&mut self) -> Vec<BatchReplay> {
        let mut batches = std::mem::take(&mut self.batches);
        batches.sort_by_key(|(_, seq, _)| *seq);
        batches
            .into_iter()
            .map(|(record, seq, ops)| {
                let needed = self.needed(&ops, seq);
                (record, seq, ops, needed)
            })
            .collect()
    }

    /// The operations of a batch or committed part of sequence number `seq` that recovery
    /// writes again: those whose key has no record at least as new.
    fn needed(&self, ops: &[BatchOp], seq: u64) -> Vec<BatchOp> {
        ops.iter()
            .filter(|op| self.newest.get(op.key()).is_none_or(|newest| newest.seq < seq))
            .cloned()
            .collect()
    }

    /// What the replay of `ops` with sequence number `seq` leaves as each key's newest record
    /// (for the offline judgement, which writes nothing).
    fn assume_replayed(&mut self, ops: Vec<BatchOp>, seq: u64) {
        for op in ops {
            let tombstone = matches!(op, BatchOp::Delete { .. });
            let loc = Loc::new(0, 0, 0);
            self.newest.insert(op.key().into(), Newest { loc, seq, written_mark: 0, tombstone });
        }
    }
}

/// The records of one cross-shard part found by recovery (see `parts.rs`).
struct FoundPart {
    /// The part, committed if any of its records says so.
    record: PartRecord,
    /// Its prepared records (normally one, or one chain's), in erasure order.
    prepared: Vec<Loc>,
    /// The committed record (or chain) and its sequence number, with the operations recovery
    /// writes again: those whose key has no record at least as new.
    committed: Option<(Vec<Loc>, u64, Vec<BatchOp>)>,
}

impl Found {
    fn part_replays(&mut self) -> Vec<FoundPart> {
        let mut by_gsn: std::collections::BTreeMap<u64, Vec<(Vec<Loc>, u64, PartRecord)>> =
            std::collections::BTreeMap::new();
        for (loc, seq, record) in std::mem::take(&mut self.parts) {
            by_gsn.entry(record.gsn).or_default().push((loc, seq, record));
        }
        let mut found = Vec::new();
        for (_, mut records) in by_gsn {
            records.sort_by_key(|(_, seq, record)| (record.state, *seq));
            let (last_loc, last_seq, last) = records.pop().expect("grouped from at least one");
            let mut prepared: Vec<Loc> = records.into_iter().flat_map(|(locs, _, _)| locs).collect();
            let committed = match last.state {
                PartState::Committed => {
                    Some((last_loc, last_seq, self.needed(&last.ops, last_seq)))
                }
                PartState::Prepared => {
                    prepared.extend(last_loc);
                    None
                }
            };
            found.push(FoundPart { record: last, prepared, committed });
        }
        found
    }
}

/// Recovery's judgement of one shard's slots without acting on it, for the offline check: feed
/// it every slot, then ask what recovery would leave.
pub struct ShardScan {
    found: Found,
}

/// Keys as recovery would leave them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KeyCounts {
    /// Keys whose newest record (after batch replay) is a put, damaged or not.
    pub live: u64,
    /// Keys whose newest record is a tombstone.
    pub deleted: u64,
    /// Put and tombstone records older than their key's newest record.
    pub stale_copies: u64,
}

impl Default for ShardScan {
    fn default() -> Self {
        ShardScan {
            found: Found { quiet: true, frontier: vec![0; CLASS_COUNT], ..Found::default() },
        }
    }
}

impl ShardScan {
    pub fn visit(
        &mut self,
        shard_id: u32,
        layout: RecordLayout,
        loc: Loc,
        result: Result<Slot<'_>, SlotDefect>,
        bytes: &[u8],
    ) {
        self.found.visit(shard_id, layout, loc, result, bytes);
    }

    pub fn key_counts(mut self) -> KeyCounts {
        self.found.sort_chains(0);
        self.found.judge_damaged();
        for (_, seq, _, needed) in self.found.batch_replays() {
            self.found.assume_replayed(needed, seq);
        }
        for part in self.found.part_replays() {
            if let Some((_, seq, needed)) = part.committed {
                self.found.assume_replayed(needed, seq);
            }
        }
        let live = self.found.newest.values().filter(|newest| !newest.tombstone).count() as u64;
        KeyCounts {
            live,
            deleted: self.found.newest.len() as u64 - live,
            stale_copies: self.found.stale.len() as u64,
        }
    }
}

impl NativeEngine {
    pub(super) fn recover(
        &mut self,
        progress: Option<&indicatif::ProgressBar>,
    ) -> Result<(), OpenError> {
        let started = Instant::now();
        let dir = shard_dir(self.shard_id);
        let mut found = Found { frontier: vec![0; CLASS_COUNT], ..Found::default() };
        let mut scanned_classes = Vec::new();
        for name in self.io.device.list_files(&dir)? {
            let path = format!("{dir}/{name}");
            let Some(class_id) = class_of_file_name(&name) else {
                tracing::warn!(file = %path, "ignoring a file that is not a slab");
                continue;
            };
            if class_id as usize >= CLASS_COUNT {
                return Err(OpenError::CorruptSlabHeader {
                    file: path,
                    reason: format!("no size class {class_id}"),
                });
            }
            let class = SizeClass::get(class_id);
            let file = self.io.device.open_file(&path, false)?;
            let file_bytes = self.io.device.file_len_bytes(file)?;
            if let Some(progress) = progress {
                progress.inc_length(file_bytes);
            }
            let (layout, blank_header) = match read_slab_header(
                self.io.device.as_mut(),
                file,
                file_bytes,
                class,
                self.shard_id,
            ) {
                Ok(Some(header)) => (RecordLayout::of_version(header.format_version), false),
                // Scanned like any file: only this build writes headers blank-first.
                Ok(None) => (RecordLayout::current(), true),
                Err(Ok(reason)) => return Err(OpenError::CorruptSlabHeader { file: path, reason }),
                Err(Err(err)) => return Err(OpenError::Device(err)),
            };
            let shard_id = self.shard_id;
            let mut slots_used = 0u64;
            self.recovery.bytes_scanned += scan_slab(
                self.io.device.as_mut(),
                shard_id,
                SlabFile { file, file_bytes, class, layout },
                progress,
                &mut |loc, result, bytes| {
                    slots_used += u64::from(!matches!(result, Ok(Slot::Empty)));
                    found.visit(shard_id, layout, loc, result, bytes)
                },
            )?;
            if blank_header {
                if slots_used == 0 {
                    // Created, never used (a crash before its header was durable).
                    self.initialize_class_file(class, file)?;
                    continue;
                }
                // The header is written and flushed before any record, so records behind a blank
                // header mean the device lost its write. Ignoring the file would bring back older
                // versions of its keys, and re-initialising it would revive them later.
                let what = format!(
                    "{path}: the header page is blank over {slots_used} used slots (its write \
                     was lost); rewritten, the records kept"
                );
                tracing::error!(shard = self.shard_id, "{what}");
                found.lost_headers.push(what);
                self.write_slab_header(class, file).map_err(OpenError::Device)?;
            }
            scanned_classes.push((class, file, file_bytes, layout));
        }
        for (class, file, file_bytes, layout) in scanned_classes {
            let next_append_slot = found.frontier[class.id as usize];
            let scanned = ClassFile::scanned(class, file, file_bytes, layout, next_append_slot);
            self.slabs.add_file(class.id, scanned);
            self.collector.open_class(class, file_bytes, next_append_slot);
        }
        self.io.device.fault_point(FaultPoint::RecoveryScanned)?;
        self.rebuild(found)?;
        self.recovery.seconds = started.elapsed().as_secs_f64();
        if self.recovery.bytes_scanned > 0 {
            tracing::info!(shard = self.shard_id, stats = ?self.recovery, "shard recovered");
        }
        Ok(())
    }

    fn rebuild(&mut self, mut found: Found) -> Result<(), OpenError> {
        // A damaged record's number is taken too: a new record must never share or undercut it.
        let damaged_seq_max = (found.damaged.iter().map(|damaged| damaged.seq))
            .chain(found.damaged_unkeyed.values().copied())
            .max()
            .unwrap_or(0);
        self.seqs.restart_above(found.max_seq.max(damaged_seq_max));
        found.sort_chains(self.shard_id);
        let judged = found.judge_damaged();
        let replays = found.batch_replays();
        let parts = found.part_replays();
        let watermark_max = found.watermark_max;
        // A clean close's digest speaks for the disk only if nothing was written after it.
        let closed_cleanly_with = match found.last_watermark {
            Some((seq, digest)) if seq + 1 == self.seqs.next() => digest,
            _ => None,
        };
        let Found {
            newest,
            stale,
            free,
            empty,
            corrupt,
            frontier,
            corrupt_sample,
            damaged_unkeyed,
            broken_chains,
            lost_headers: found_lost_headers,
            ..
        } = found;
        self.recovery.torn_or_corrupt =
            (corrupt.len() + judged.kept.len() + found_lost_headers.len()) as u64;
        self.recovery.defects_sample =
            found_lost_headers.into_iter().chain(corrupt_sample).collect();
        self.recovery.damaged_items = judged.decided.len() as u64;
        for (loc, key) in &judged.decided {
            tracing::error!(shard = self.shard_id, ?loc, key = %String::from_utf8_lossy(key), "the newest record of a key is damaged: it reads as corrupt until rewritten");
        }
        self.recovery.stale_copies = stale.len() as u64;
        for (loc, tag) in stale {
            self.release_slot(loc.slot_only(), tag, false);
        }
        let below_frontier = |loc: &Loc| loc.slot() < frontier[loc.class() as usize];
        let free_slots: Vec<Loc> =
            free.into_iter().chain(empty.into_iter().filter(below_frontier)).collect();
        self.recovery.free_slots = free_slots.len() as u64;
        for loc in free_slots {
            self.release_slot(loc, None, false);
        }
        for loc in corrupt {
            // A torn Batch or Part record (past every durable watermark) is erased like a torn
            // put: holding its number, so that no record written meanwhile claims it durable.
            let torn_unkeyed =
                (damaged_unkeyed.get(&loc.slot_only()).copied()).filter(|&seq| seq > watermark_max);
            match judged.torn.get(&loc.slot_only()).copied().or(torn_unkeyed) {
                Some(seq) => self.erase_torn(loc.slot_only(), seq),
                None => {
                    let tag = judged.stale.get(&loc.slot_only()).copied();
                    self.release_slot(loc.slot_only(), tag, true)
                }
            }
        }
        // A chain found incomplete was never durable whole (nothing of it was acknowledged or
        // written), or its erasure had begun (its members are all durable): erased either way.
        self.recovery.broken_chain_records = broken_chains.len() as u64;
        for loc in broken_chains {
            self.release_slot(loc.slot_only(), None, true);
        }
        // Batches hold their keys before tombstones are judged (a tombstone must outlive a batch
        // record that mentions its key).
        for (record, seq, ops, needed) in replays {
            self.recovery.batches_replayed += u64::from(!needed.is_empty());
            self.replay_batch(record, seq, &ops, needed, None).map_err(|err| {
                OpenError::Device(DeviceError::Io {
                    what: format!("replaying a write batch: {err}"),
                })
            })?;
        }
        // A committed part replays like a batch but keeps its records until it is forgotten; a
        // prepared one changes nothing until the router decides it (after every shard opened).
        self.recovery.parts = parts.len() as u64;
        for FoundPart { record, prepared, committed } in parts {
            let gsn = record.gsn;
            self.parts.insert(gsn, super::parts::Part::recovered(&record, prepared));
            if let Some((loc, seq, needed)) = committed {
                self.recovery.parts_committed += 1;
                self.replay_batch(loc, seq, &record.ops, needed, Some(gsn)).map_err(|err| {
                    OpenError::Device(DeviceError::Io {
                        what: format!("replaying the committed part of batch {gsn}: {err}"),
                    })
                })?;
            }
            self.recovered_parts.push(record);
        }
        let mut tombstones = Vec::new();
        let mut live = Vec::with_capacity(newest.len());
        for (key, newest) in newest {
            if newest.tombstone {
                tombstones.push((key_hash(&key), newest.loc, key));
            } else {
                live.push((key, Entry { loc: newest.loc, seq: newest.seq }));
            }
        }
        // One sort and an index built in order cost less than an insert per key; the keys the
        // batch replays above indexed go back in after.
        live.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        let replayed = std::mem::take(&mut self.index);
        self.index.load_sorted(live.iter().map(|(key, entry)| (&key[..], *entry)));
        drop(live);
        for (key, entry) in replayed.range(std::ops::Bound::Unbounded, std::ops::Bound::Unbounded, usize::MAX) {
            let old = self.index.insert(&key, entry.loc, entry.seq);
            assert!(old.is_none(), "recovery indexed a key twice");
        }
        self.recovery.items = self.index.len() as u64;
        self.recovery.tombstones = tombstones.len() as u64;
        if let Some(recorded) = closed_cleanly_with {
            let found = self.index.digest();
            if found != recorded {
                self.recovery.lost_writes_detected = 1;
                let what = format!(
                    "the live items differ from what the last clean close recorded ({} items, \
                     digest {:016x}; found {}, digest {:016x}): a write acknowledged before the \
                     close was lost or misdirected by the device, or a record's name rotted",
                    recorded.items, recorded.xor, found.items, found.xor
                );
                tracing::error!(shard = self.shard_id, "{what}");
                self.recovery.defects_sample.push(what);
            }
        }
        for (hash, loc, key) in tombstones {
            if self.seqs.has_stale(hash) || self.seqs.in_flight(&key) {
                self.seqs.guard(hash, loc.slot_only(), key);
            } else {
                self.release_slot(loc.slot_only(), None, false);
            }
        }
        Ok(())
    }
}
