//! Offline integrity check of a store directory (`copse check`): reads the manifest, has the
//! store's engine check every shard (`engine::factory::check_shards`: every slot of every slab
//! file for the native engine, `engine/native/check.rs`), and reports what it holds and every
//! defect it finds.
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

use crate::device::{
    read_sync, Backend, BlockDevice, DeviceError, DirStorage, Storage, WriteDurability,
};
use crate::engine::check::Problems;
use crate::engine::check::{Problem, ShardReport, SlotCounts};
use crate::engine::factory;
use crate::engine::EngineKind;
use crate::error::OpenError;
use crate::limits::PAGE_BYTES;
use crate::store::manifest::{self, MANIFEST_FILE};
use crate::store::open::lock_directory;

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

/// Checks the store in `path` without changing it. `Err` only when the check cannot run at all
/// (no store there, the store is in use, no device); every defect of the store itself is a
/// `Problem` in the report.
pub fn check_store(path: &Path, options: &CheckOptions) -> Result<CheckReport, OpenError> {
    // Decide this before taking the lock, which would create the directory and its LOCK file.
    let looks_like_store = path.join(MANIFEST_FILE).is_file()
        || factory::native_shard_dirs_exist(path)
        || factory::rocksdb_files_exist(path);
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
    let kind = manifest.as_ref().map_or(EngineKind::Native, |manifest| manifest.engine);
    drop(device);
    let checks = factory::check_shards(
        kind,
        path,
        &storage,
        shard_count,
        manifest.is_some(),
        &mut problems,
    )?;
    report.files_checked = checks.files_checked;
    report.bytes_scanned = checks.bytes_scanned;
    for shard_report in &checks.shards {
        report.slots.add(&shard_report.slots);
        report.live_keys += shard_report.live_keys;
    }
    report.shards = checks.shards;
    if manifest.is_none() && !manifest_reported && factory::rocksdb_files_exist(path) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::native::format::SizeClass;
    use crate::engine::check::{HeaderState, PROBLEMS_LISTED_MAX};
    use crate::{Db, Options};

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
        let pages = (PROBLEMS_LISTED_MAX as u64).div_ceil(class.slots_per_unit as u64) + 2;
        assert!(std::fs::metadata(&path).unwrap().len() >= (1 + pages) * PAGE_BYTES as u64);
        {
            use std::os::unix::fs::FileExt;
            let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
            let garbage = vec![0xabu8; pages as usize * PAGE_BYTES];
            file.write_all_at(&garbage, PAGE_BYTES as u64).unwrap();
        }
        let report = check_store(dir.path(), &CheckOptions::default()).unwrap();
        let damaged = pages * class.slots_per_unit as u64;
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
