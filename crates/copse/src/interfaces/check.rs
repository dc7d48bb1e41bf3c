//! Offline integrity check of a store directory (`copse check`): reads the manifest and every
//! slot of every slab file, and reports what it holds and every defect it finds.
//!
//! Invariants:
//! - The check changes no store byte: it opens files without `create` and submits only reads.
//!   (Opening the LOCK file may create it: that file holds no data.)
//! - It holds the directory's LOCK (the same flock as `Db::open`) for its whole run, so no
//!   process writes while it reads; a store that is open elsewhere makes it fail with `Locked`
//!   instead of reporting pages caught mid-write as damage.
//! - It decodes and judges exactly as recovery does (`scan_slab`, `read_slab_header`, and
//!   recovery's own `ShardScan`), so a slot it calls defective is one recovery would erase, and
//!   its live-key counts are what recovery would leave: per key the newest record wins (stale
//!   copies are normal with out-of-place writes), a damaged once-durable newest record decides
//!   its key, and a batch record replays its operations over older records.
//! - Every defect is counted in `problems_found`; the first `PROBLEMS_LISTED_MAX` are listed, so
//!   a badly damaged store gives a report of bounded size and still an exact count.
//! - A device error on one file becomes a problem for that file and the check goes on with a
//!   fresh device (a failed scan may leave reads in flight on the old one).
//! - Memory: one entry per distinct key of the shard being checked (as in recovery), freed before
//!   the next shard.

use std::path::Path;

use serde::Serialize;

use crate::device::read_sync;
use crate::device::{
    Backend, BlockDevice, DeviceError, DirStorage, FileId, Storage, WriteDurability,
};
use crate::engine::batch_codec::decode_batch;
use crate::engine::native::format::{
    class_of_file_name, shard_dir, Loc, RecordKind, RecordLayout, SizeClass, Slot, SlotDefect,
    CLASS_COUNT,
};
use crate::engine::native::recovery::{read_slab_header, scan_slab, ShardScan, SlabFile};
use crate::engine::part;
use crate::error::OpenError;
use crate::interfaces::db::lock_directory;
use crate::limits::{PAGE_BYTES, SHARDS_MAX};
use crate::router::manifest::{self, MANIFEST_FILE};

/// Problems listed in a report at most; the rest are only counted.
pub const PROBLEMS_LISTED_MAX: usize = 1000;

/// Ring entries of the check's device: `scan_slab` keeps a few chunks in flight.
const CHECK_RING_ENTRIES: u32 = 8;

/// How to check a store.
#[derive(Clone, Debug)]
pub struct CheckOptions {
    /// How to read the files (`Auto`: io_uring where the kernel allows it).
    pub backend: Backend,
}

impl Default for CheckOptions {
    fn default() -> Self {
        CheckOptions { backend: Backend::Auto }
    }
}

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
    /// Slots that do not verify (torn writes, bit flips) and batch or part records that do not
    /// decode.
    pub defective: u64,
}

impl SlotCounts {
    fn add(&mut self, other: &SlotCounts) {
        self.slots += other.slots;
        self.items += other.items;
        self.tombstones += other.tombstones;
        self.free += other.free;
        self.empty += other.empty;
        self.batch_records += other.batch_records;
        self.part_records += other.part_records;
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

#[derive(Clone, Debug, Serialize)]
pub struct ManifestSummary {
    pub shard_count: u32,
    pub key_hash: String,
    pub slab_format_version: u32,
    pub engine: crate::EngineKind,
}

/// What `check_store` found. `problems_found == 0` means the store is intact.
#[derive(Clone, Debug, Serialize)]
pub struct CheckReport {
    pub path: String,
    /// `None` when the manifest is missing, blank or corrupt (the last is a problem).
    pub manifest: Option<ManifestSummary>,
    pub files_checked: u64,
    pub bytes_scanned: u64,
    pub slots: SlotCounts,
    pub live_keys: u64,
    pub problems_found: u64,
    /// The first `PROBLEMS_LISTED_MAX` problems.
    pub problems: Vec<Problem>,
    pub shards: Vec<ShardReport>,
}

impl CheckReport {
    pub fn is_clean(&self) -> bool {
        self.problems_found == 0
    }
}

/// Counts every problem, keeps the first `PROBLEMS_LISTED_MAX`.
#[derive(Default)]
struct Problems {
    found: u64,
    listed: Vec<Problem>,
}

impl Problems {
    fn report(&mut self, problem: Problem) {
        self.found += 1;
        if self.listed.len() < PROBLEMS_LISTED_MAX {
            self.listed.push(problem);
        }
    }

    fn file(&mut self, file: &str, shard: Option<u32>, class: Option<u8>, what: String) {
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

/// Checks the store in `path` without changing it. `Err` only when the check cannot run at all
/// (no store there, the store is in use, no device); every defect of the store itself is a
/// `Problem` in the report.
pub fn check_store(path: &Path, options: &CheckOptions) -> Result<CheckReport, OpenError> {
    // Decide this before taking the lock, which would create the directory and its LOCK file.
    let looks_like_store = path.join(MANIFEST_FILE).is_file()
        || (0..SHARDS_MAX as u32).any(|shard| path.join(shard_dir(shard)).is_dir())
        || crate::engine::factory::rocksdb_files_exist(path);
    if !looks_like_store {
        return Err(OpenError::NotFound(path.display().to_string()));
    }
    let _lock = lock_directory(path)?;
    let storage =
        DirStorage::new(path, options.backend, WriteDurability::Dsync, CHECK_RING_ENTRIES)?;
    let mut device = storage.open_device()?;
    let mut problems = Problems::default();

    let manifest = read_manifest(device.as_mut(), &mut problems)?;
    let manifest_reported = problems.found > 0;
    let mut report = CheckReport {
        path: path.display().to_string(),
        manifest: manifest.clone(),
        files_checked: 0,
        bytes_scanned: 0,
        slots: SlotCounts::default(),
        live_keys: 0,
        problems_found: 0,
        problems: Vec::new(),
        shards: Vec::new(),
    };
    let shard_count = manifest.as_ref().map_or(0, |manifest| manifest.shard_count);
    if let Some(ManifestSummary { engine: crate::EngineKind::RocksDb, .. }) = manifest {
        check_rocksdb_store(path, shard_count, &mut problems, &mut report)?;
        report.problems_found = problems.found;
        report.problems = problems.listed;
        return Ok(report);
    }
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
            if manifest.is_some() {
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
        let shard_report =
            check_shard(&storage, &mut device, shard, &names, &mut problems, &mut report)?;
        report.slots.add(&shard_report.slots);
        report.live_keys += shard_report.live_keys;
        report.shards.push(shard_report);
    }
    if manifest.is_none() && !manifest_reported && crate::engine::factory::rocksdb_files_exist(path)
    {
        problems.file(
            MANIFEST_FILE,
            None,
            None,
            format!(
                "manifest is missing or blank but {}/ holds RocksDB instances",
                crate::engine::ROCKSDB_DIR
            ),
        );
    } else if manifest.is_none() && !manifest_reported && report.files_checked > 0 {
        problems.file(
            MANIFEST_FILE,
            None,
            None,
            "manifest is missing or blank but slab files exist".into(),
        );
    }
    report.problems_found = problems.found;
    report.problems = problems.listed;
    Ok(report)
}

/// A store of the RocksDB engine: every shard's instance is opened read-only and every item read
/// with RocksDB's block checksums verified; a failure is a problem of that instance.
#[cfg(feature = "rocksdb")]
fn check_rocksdb_store(
    path: &Path,
    shard_count: u32,
    problems: &mut Problems,
    report: &mut CheckReport,
) -> Result<(), OpenError> {
    for shard in 0..shard_count {
        let dir = crate::engine::rocks::shard_dir(path, shard);
        let file = dir.strip_prefix(path).unwrap_or(&dir).display().to_string();
        match crate::engine::rocks::check_instance(&dir) {
            Ok(live_keys) => {
                report.files_checked += 1;
                report.live_keys += live_keys;
                report.shards.push(ShardReport { shard, live_keys, ..ShardReport::default() });
            }
            Err(what) => problems.file(&file, Some(shard), None, what),
        }
    }
    Ok(())
}

#[cfg(not(feature = "rocksdb"))]
fn check_rocksdb_store(
    _path: &Path,
    _shard_count: u32,
    _problems: &mut Problems,
    _report: &mut CheckReport,
) -> Result<(), OpenError> {
    Err(OpenError::EngineUnavailable(crate::EngineKind::RocksDb))
}

/// Reads and verifies the manifest. A missing or blank one gives `None` (a store whose creation
/// was interrupted; `check_store` flags it if slabs exist); a corrupt one is also a problem.
fn read_manifest(
    device: &mut dyn BlockDevice,
    problems: &mut Problems,
) -> Result<Option<ManifestSummary>, OpenError> {
    let file = match device.open_file(MANIFEST_FILE, false) {
        Ok(file) => file,
        Err(DeviceError::NotFound { .. }) => return Ok(None),
        Err(err) => {
            problems.file(MANIFEST_FILE, None, None, format!("cannot open the manifest: {err}"));
            return Ok(None);
        }
    };
    let file_bytes = device.file_len_bytes(file)?;
    if file_bytes < PAGE_BYTES as u64 {
        return Ok(None);
    }
    let page = match read_sync(device, file, 0, PAGE_BYTES) {
        Ok(page) => page,
        Err(err) => {
            problems.file(MANIFEST_FILE, None, None, format!("cannot read the manifest: {err}"));
            return Ok(None);
        }
    };
    match manifest::decode(&page) {
        Ok(Some(manifest)) => Ok(Some(ManifestSummary {
            shard_count: manifest.shard_count,
            key_hash: format!("{:?}", manifest.key_hash),
            slab_format_version: manifest.slab_format_version,
            engine: manifest.engine,
        })),
        Ok(None) => Ok(None),
        Err(reason) => {
            problems.report(Problem {
                file: MANIFEST_FILE.into(),
                shard: None,
                class: None,
                slot: None,
                byte_offset: Some(0),
                what: format!("manifest is corrupt: {reason}"),
            });
            Ok(None)
        }
    }
}

fn check_shard(
    storage: &DirStorage,
    device: &mut Box<dyn BlockDevice>,
    shard: u32,
    names: &[String],
    problems: &mut Problems,
    report: &mut CheckReport,
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
        report.files_checked += 1;
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
            Ok(scanned_bytes) => report.bytes_scanned += scanned_bytes,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::interfaces::db::{Db, Options};

    fn options(shards: usize) -> Options {
        Options { shards, cache_bytes: 4 << 20, show_progress: false, ..Options::default() }
    }

    /// Writes 20 keys into a 2-shard store and closes it. With `churn`, one key is overwritten
    /// and one deleted, so slots are reused (a freed slot may then hold a short tombstone; without
    /// churn, slot 0 of each file holds the first put, 32 + 6 + 17 bytes long).
    fn make_store(path: &Path, churn: bool) {
        let db = Db::open(path, options(2)).unwrap();
        for index in 0..20 {
            let key = format!("key-{index:02}");
            db.put(key.as_bytes(), format!("value number {index:04}").as_bytes()).unwrap();
        }
        if churn {
            db.put(b"key-00", b"a newer value for key zero").unwrap();
            assert!(db.delete(b"key-01").unwrap());
        }
        db.close().unwrap();
    }

    fn flip_byte(path: &Path, offset: u64) {
        use std::os::unix::fs::FileExt;
        let file = std::fs::OpenOptions::new().read(true).write(true).open(path).unwrap();
        let mut byte = [0u8; 1];
        file.read_exact_at(&mut byte, offset).unwrap();
        byte[0] ^= 0x5a;
        file.write_all_at(&byte, offset).unwrap();
    }

    /// The slab file of shard 0 whose first slot holds a record long enough to cover byte 40.
    fn first_slab_of_shard_zero(root: &Path) -> (String, std::path::PathBuf) {
        let dir = root.join("shard-000");
        let mut names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|entry| entry.unwrap().file_name().into_string().unwrap())
            .filter(|name| name.ends_with(".slab"))
            .collect();
        names.sort();
        let name = names.first().expect("shard 0 holds a slab file").clone();
        let path = dir.join(&name);
        assert!(std::fs::metadata(&path).unwrap().len() > 2 * PAGE_BYTES as u64);
        (format!("shard-000/{name}"), path)
    }

    #[test]
    fn intact_store_has_no_problems_and_counts_live_keys() {
        let dir = tempfile::tempdir().unwrap();
        make_store(dir.path(), true);
        let report = check_store(dir.path(), &CheckOptions::default()).unwrap();
        assert!(report.is_clean(), "{:#?}", report.problems);
        assert!(report.problems.is_empty());
        assert_eq!(report.manifest.as_ref().unwrap().shard_count, 2);
        assert_eq!(report.shards.len(), 2);
        // 20 keys, one of them deleted; the overwrite and the delete leave stale copies behind
        // (or reuse them), which must not count as live.
        assert_eq!(report.live_keys, 19);
        assert_eq!(report.shards.iter().map(|shard| shard.live_keys).sum::<u64>(), 19);
        assert_eq!(report.shards.iter().map(|shard| shard.deleted_keys).sum::<u64>(), 1);
        // Every live key has a put record; the deleted key's old copy was erased by its delete.
        assert!(report.slots.items >= 19, "a live key lacks its put record: {:?}", report.slots);
        assert!(report.files_checked >= 2);
        // The report is what `copse check` prints.
        let json = serde_json::to_string(&report).unwrap();
        assert!(json.contains("\"problems_found\":0"));
        // The store still opens and holds the same keys: the check changed nothing.
        let db = Db::open(dir.path(), options(2)).unwrap();
        assert_eq!(db.stats().unwrap().items, 19);
    }

    #[test]
    fn flipped_byte_in_a_slot_is_reported_at_that_slot() {
        let dir = tempfile::tempdir().unwrap();
        make_store(dir.path(), false);
        let (name, path) = first_slab_of_shard_zero(dir.path());
        // Page 1 holds slot 0; byte 40 is inside its record (32-byte header, then key and value).
        flip_byte(&path, PAGE_BYTES as u64 + 40);
        let report = check_store(dir.path(), &CheckOptions::default()).unwrap();
        assert_eq!(report.problems_found, 1, "{:#?}", report.problems);
        let problem = &report.problems[0];
        assert_eq!(problem.file, name);
        assert_eq!(problem.shard, Some(0));
        assert_eq!(problem.slot, Some(0));
        assert_eq!(problem.byte_offset, Some(PAGE_BYTES as u64));
        assert!(problem.what.contains("checksum mismatch"), "{}", problem.what);
        assert_eq!(report.slots.defective, 1);
    }

    #[test]
    fn corrupt_slab_header_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        make_store(dir.path(), false);
        let (name, path) = first_slab_of_shard_zero(dir.path());
        flip_byte(&path, 10); // inside the format version, covered by the header checksum
        let report = check_store(dir.path(), &CheckOptions::default()).unwrap();
        assert_eq!(report.problems_found, 1, "{:#?}", report.problems);
        let problem = &report.problems[0];
        assert_eq!(
            (problem.file.as_str(), problem.slot, problem.byte_offset),
            (name.as_str(), None, Some(0))
        );
        assert!(problem.what.contains("bad slab header"), "{}", problem.what);
        let file = report.shards[0].files.iter().find(|file| file.file == name).unwrap();
        assert_eq!(file.header, HeaderState::Bad);
        // Its slots still verify, so they still count.
        assert_eq!(report.live_keys, 20);
    }

    #[test]
    fn problems_beyond_the_listed_maximum_are_still_counted() {
        let dir = tempfile::tempdir().unwrap();
        make_store(dir.path(), false);
        let (_, path) = first_slab_of_shard_zero(dir.path());
        let class = SizeClass::get(0);
        let pages = (PROBLEMS_LISTED_MAX as u64).div_ceil(class.slots_per_page as u64) + 2;
        assert!(std::fs::metadata(&path).unwrap().len() >= (1 + pages) * PAGE_BYTES as u64);
        {
            use std::os::unix::fs::FileExt;
            let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
            let garbage = vec![0xabu8; pages as usize * PAGE_BYTES];
            file.write_all_at(&garbage, PAGE_BYTES as u64).unwrap();
        }
        let report = check_store(dir.path(), &CheckOptions::default()).unwrap();
        let damaged = pages * class.slots_per_page as u64;
        assert_eq!(report.problems_found, damaged);
        assert_eq!(report.problems.len(), PROBLEMS_LISTED_MAX);
        // Key length 0xabab and value length 0xabababab: no 64-byte slot holds them.
        let what = "record of 2880198518 bytes exceeds its 64-byte slot";
        assert!(
            report.problems.iter().all(|problem| problem.what == what),
            "{:?}",
            report.problems[0]
        );
        assert_eq!(report.slots.defective, damaged);
    }

    #[test]
    fn corrupt_manifest_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        make_store(dir.path(), false);
        flip_byte(&dir.path().join(MANIFEST_FILE), 13);
        let report = check_store(dir.path(), &CheckOptions::default()).unwrap();
        assert!(report.manifest.is_none());
        assert_eq!(report.problems_found, 1, "{:#?}", report.problems);
        assert_eq!(report.problems[0].file, MANIFEST_FILE);
        assert!(report.problems[0].what.contains("manifest is corrupt"));
        // Without the manifest the shard directories are still found and checked.
        assert_eq!(report.live_keys, 20);
    }

    #[test]
    fn open_store_is_refused_and_missing_store_is_not_created() {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open(dir.path(), options(1)).unwrap();
        assert!(matches!(
            check_store(dir.path(), &CheckOptions::default()),
            Err(OpenError::Locked(_))
        ));
        db.close().unwrap();
        drop(db);
        let missing = dir.path().join("nothing-here");
        assert!(matches!(
            check_store(&missing, &CheckOptions::default()),
            Err(OpenError::NotFound(_))
        ));
        assert!(!missing.exists());
    }
}
