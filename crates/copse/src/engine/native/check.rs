//! The native engine's part of the offline check (`copse check`): every slot of every slab file
//! of every shard directory, decoded and judged exactly as recovery does (`scan_slab`,
//! `read_slab_header`, recovery's own `ShardScan`), so a slot it calls defective is one recovery
//! would erase, and its live-key counts are what recovery would leave.
//!
//! Invariants: it submits only reads and opens files without `create`; a device error on one
//! file becomes a problem of that file and the check goes on with a fresh device (a failed scan
//! may leave reads in flight on the old one); memory is one entry per distinct key of the shard
//! being checked, freed before the next shard.

use super::chain::decode_chunk;
use super::format::{
    class_of_file_name, shard_dir, Loc, RecordKind, RecordLayout, SizeClass, Slot, SlotDefect,
    CLASS_COUNT,
};
use super::recovery::{read_slab_header, scan_slab, ShardScan, SlabFile};
use crate::device::{BlockDevice, DeviceError, FileId, Storage};
use crate::engine::batch_codec::decode_batch;
use crate::engine::check::{
    FileReport, HeaderState, Problem, Problems, ShardChecks, ShardReport, SlotCounts,
};
use crate::engine::part;
use crate::error::OpenError;
use crate::limits::{PAGE_BYTES, SHARDS_MAX};

/// Checks every shard directory of the store on `storage` (any shard number, so files of a
/// shard past `shard_count` are found and checked too, and reported when a manifest gave the
/// count).
pub fn check_shards(
    storage: &dyn Storage,
    shard_count: u32,
    manifest_found: bool,
    problems: &mut Problems,
) -> Result<ShardChecks, OpenError> {
    let mut device = storage.open_device()?;
    let mut checks = ShardChecks::default();
    for shard in 0..SHARDS_MAX as u32 {
        let dir = shard_dir(shard);
        let names = match device.list_files(&dir) {
            Ok(names) => names,
            Err(err) => {
                problems.file(
                    &dir,
                    Some(shard),
                    None,
                    format!("cannot list the shard directory: {err}"),
                );
                continue;
            }
        };
        if shard >= shard_count {
            if names.is_empty() {
                continue;
            }
            // Without a manifest there is no shard count to hold the directory against; either
            // way its slabs are checked.
            if manifest_found {
                problems.file(
                    &dir,
                    Some(shard),
                    None,
                    format!(
                        "holds files, but the manifest says the store has {shard_count} shards"
                    ),
                );
            }
        }
        let shard_report = check_shard(storage, &mut device, shard, &names, problems, &mut checks)?;
        checks.shards.push(shard_report);
    }
    Ok(checks)
}

fn check_shard(
    storage: &dyn Storage,
    device: &mut Box<dyn BlockDevice>,
    shard: u32,
    names: &[String],
    problems: &mut Problems,
    checks: &mut ShardChecks,
) -> Result<ShardReport, OpenError> {
    let mut shard_report = ShardReport { shard, ..ShardReport::default() };
    let mut tally = ShardScan::default();
    for name in names {
        let file_name = format!("{}/{name}", shard_dir(shard));
        let Some(class_id) = class_of_file_name(name).filter(|&id| (id as usize) < CLASS_COUNT)
        else {
            if class_of_file_name(name).is_some() {
                problems.file(&file_name, Some(shard), None, "no such size class".into());
            } else {
                // Recovery ignores files that are not slabs (with a warning); so does the check.
                tracing::warn!(file = %file_name, "ignoring a file that is not a slab");
            }
            continue;
        };
        let class = SizeClass::get(class_id);
        checks.files_checked += 1;
        let mut file_report = FileReport {
            file: file_name.clone(),
            class: Some(class_id),
            slot_bytes: Some(class.slot_bytes),
            file_bytes: 0,
            header: HeaderState::Unreadable,
            slots: SlotCounts::default(),
        };
        match check_file(
            device.as_mut(),
            shard,
            class,
            &file_name,
            &mut file_report,
            &mut tally,
            problems,
        ) {
            Ok(scanned_bytes) => checks.bytes_scanned += scanned_bytes,
            Err(err) => {
                problems.file(
                    &file_name,
                    Some(shard),
                    Some(class_id),
                    format!("read failed: {err}"),
                );
                // A failed scan may leave reads in flight; the next file starts on a fresh device.
                *device = storage.open_device()?;
            }
        }
        shard_report.slots.add(&file_report.slots);
        shard_report.files.push(file_report);
    }
    let keys = tally.key_counts();
    shard_report.live_keys = keys.live;
    shard_report.deleted_keys = keys.deleted;
    shard_report.stale_copies = keys.stale_copies;
    Ok(shard_report)
}

/// Checks one slab file; returns the bytes scanned. Slot and header defects go to `problems`;
/// `Err` is a device failure that stopped the file's check.
fn check_file(
    device: &mut dyn BlockDevice,
    shard: u32,
    class: SizeClass,
    file_name: &str,
    file_report: &mut FileReport,
    tally: &mut ShardScan,
    problems: &mut Problems,
) -> Result<u64, DeviceError> {
    let file: FileId = device.open_file(file_name, false)?;
    let file_bytes = device.file_len_bytes(file)?;
    file_report.file_bytes = file_bytes;
    if file_bytes % PAGE_BYTES as u64 != 0 {
        problems.file(
            file_name,
            Some(shard),
            Some(class.id),
            format!("file length {file_bytes} is not a multiple of the {PAGE_BYTES}-byte page"),
        );
    }
    let header_problem = |what: String| Problem {
        file: file_name.to_string(),
        shard: Some(shard),
        class: Some(class.id),
        slot: None,
        byte_offset: Some(0),
        what,
    };
    // A file whose header is bad is still scanned, as the current format: its slots' problems
    // are reported too.
    let mut layout = RecordLayout::current();
    match read_slab_header(device, file, file_bytes, class, shard) {
        Ok(Some(header)) => {
            file_report.header = HeaderState::Ok;
            layout = RecordLayout::of_version(header.format_version);
        }
        // Scanned too: records behind a blank header mean its write was lost (recovery keeps
        // them and rewrites the header).
        Ok(None) => file_report.header = HeaderState::Blank,
        Err(Ok(reason)) => {
            file_report.header = HeaderState::Bad;
            problems.report(header_problem(format!("bad slab header: {reason}")));
        }
        Err(Err(err)) => return Err(err),
    }
    let counts = &mut file_report.slots;
    let mut visit = |loc: Loc, result: Result<Slot<'_>, SlotDefect>, bytes: &[u8]| {
        // Recovery's own judgement decides which keys count as live.
        tally.visit(shard, layout, loc, result.clone(), bytes);
        counts.slots += 1;
        let defect = match result {
            Ok(Slot::Empty) => {
                counts.empty += 1;
                None
            }
            Ok(Slot::Record { header, value, .. }) => match header.kind {
                RecordKind::Put => {
                    counts.items += 1;
                    None
                }
                RecordKind::Tombstone => {
                    counts.tombstones += 1;
                    None
                }
                // A clean close's watermark record: free space from the next open on.
                RecordKind::Free | RecordKind::Watermark => {
                    counts.free += 1;
                    None
                }
                RecordKind::Batch => match decode_batch(value) {
                    Ok(_) => {
                        counts.batch_records += 1;
                        None
                    }
                    Err(reason) => Some(format!("batch record does not decode: {reason}")),
                },
                RecordKind::Part => match part::decode(value) {
                    Ok(_) => {
                        counts.part_records += 1;
                        None
                    }
                    Err(reason) => Some(format!("part record does not decode: {reason}")),
                },
                RecordKind::Chunk => match decode_chunk(value) {
                    Ok(_) => {
                        counts.chunk_records += 1;
                        None
                    }
                    Err(reason) => Some(format!("chunk record does not decode: {reason}")),
                },
            },
            Err(defect) => Some(defect.to_string()),
        };
        if let Some(what) = defect {
            counts.defective += 1;
            let slot = loc.slot();
            problems.report(Problem {
                file: file_name.to_string(),
                shard: Some(shard),
                class: Some(class.id),
                slot: Some(slot),
                byte_offset: Some(
                    class.page_of_slot(slot) * PAGE_BYTES as u64
                        + class.offset_in_page(slot) as u64,
                ),
                what,
            });
        }
    };
    let bytes =
        scan_slab(device, shard, SlabFile { file, file_bytes, class, layout }, None, &mut visit)?;
    let used = file_report.slots.slots - file_report.slots.empty;
    if file_report.header == HeaderState::Blank && used > 0 {
        let what =
            format!("the slab header page is blank over {used} used slots (its write was lost)");
        problems.report(header_problem(what));
    }
    Ok(bytes)
}
