//! The engine factory: the one place outside an engine's own folder that names the engines. The
//! store's open (`interfaces/db.rs`) describes what it wants in a [`StoreSetup`] and gets, per
//! shard, an [`EngineOpener`] to run on the shard's thread; it never names an engine type.
//!
//! Invariants: a setup is made once per open, after the manifest was read or created (so the
//! engine kind and the placements are the store's own); `finish_open` runs only after every
//! shard opened, so an engine that records "creation finished" (RocksDB) records it only for a
//! store whose every shard exists.

use std::path::Path;
#[cfg(feature = "rocksdb")]
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

#[cfg(feature = "rocksdb")]
use super::check::ShardReport;
use super::check::{Problems, ShardChecks};
use super::native::format::{
    shard_dir, ClassKind, SizeClass, CLASS_COUNT, SLAB_FORMAT_VERSION,
    SLAB_FORMAT_VERSION_READ_MIN,
};
use super::native::placement::choose_placement;
use super::native::{EngineConfig, NativeEngine};
use super::placement::{Placement, PlacementDecision, PlacementSetting, PLACED_CLASS_COUNT};
use super::{EngineKind, ShardEngine};
use crate::device::{BlockDevice, Storage};
use crate::error::OpenError;
use crate::limits::{
    CACHE_PAGES_PER_SHARD_MIN, GC_ROOM_BLOCKS_MIN, PAGE_BYTES, SHARDS_MAX, SLAB_GROWTH_BYTES_MIN,
};

/// Opens (recovers) one shard's engine; runs on the shard's own thread.
pub type EngineOpener = Box<dyn FnOnce() -> Result<Box<dyn ShardEngine>, OpenError> + Send>;

/// What the engines of one store's shards are opened with.
pub struct StoreSetup {
    kind: EngineKind,
    storage: Arc<dyn Storage>,
    /// The store's directory, for engines that keep their own files in it.
    #[cfg(feature = "rocksdb")]
    dir: Option<PathBuf>,
    cache_pages_per_shard: usize,
    io_depth_max: usize,
    /// Of every size class (native engine).
    placements: Vec<Placement>,
    append_block_pages: u32,
    space_amplification_max: f64,
    batch_record_bytes_max: usize,
    /// Raised by any shard whose write or flush failed; every shard then refuses writes.
    poisoned: Arc<AtomicBool>,
    progress: Option<indicatif::ProgressBar>,
    #[cfg(feature = "rocksdb")]
    rocks: Option<(super::rocks::RocksShared, bool)>,
}

/// The settings a [`StoreSetup`] is made from (validated `Options`, the manifest's placements).
pub struct SetupSettings {
    pub kind: EngineKind,
    pub shards: usize,
    pub cache_bytes: usize,
    pub io_depth_max: usize,
    /// Of the in-page classes, from the manifest (the others are always in place).
    pub placements: [Placement; PLACED_CLASS_COUNT],
    pub append_block_pages: u32,
    pub space_amplification_max: f64,
    pub batch_record_bytes_max: usize,
    pub progress: Option<indicatif::ProgressBar>,
}

impl StoreSetup {
    /// A setup for `settings.kind` over `storage` (and `dir`, for engines that keep their own
    /// files). Refuses an engine this build lacks, and one that needs a directory when there
    /// is none, with the reason.
    pub fn new(
        settings: SetupSettings,
        storage: Arc<dyn Storage>,
        dir: Option<&Path>,
    ) -> Result<StoreSetup, OpenError> {
        if !settings.kind.available() {
            return Err(OpenError::EngineUnavailable(settings.kind));
        }
        if settings.kind == EngineKind::RocksDb && dir.is_none() {
            // RocksDB writes its own files through the file system; it cannot run on a
            // `Storage` such as the simulated device.
            return Err(OpenError::InvalidOption(format!(
                "the {} engine needs a directory (Db::open), not a storage",
                settings.kind
            )));
        }
        #[cfg(feature = "rocksdb")]
        let rocks = match (settings.kind, dir) {
            (EngineKind::RocksDb, Some(dir)) => Some((
                super::rocks::RocksShared::new(settings.cache_bytes, settings.shards)?,
                // Instances may be created only until the store's first open finished (see
                // `rocks::CREATED_MARKER`); after that a missing instance is a lost one.
                super::rocks::creation_finished(dir),
            )),
            _ => None,
        };
        Ok(StoreSetup {
            kind: settings.kind,
            storage,
            #[cfg(feature = "rocksdb")]
            dir: dir.map(Path::to_path_buf),
            cache_pages_per_shard: (settings.cache_bytes / PAGE_BYTES / settings.shards.max(1))
                .max(CACHE_PAGES_PER_SHARD_MIN),
            io_depth_max: settings.io_depth_max,
            placements: settings.placements.to_vec(),
            append_block_pages: settings.append_block_pages,
            space_amplification_max: settings.space_amplification_max,
            batch_record_bytes_max: settings.batch_record_bytes_max,
            poisoned: Arc::new(AtomicBool::new(false)),
            progress: settings.progress,
            #[cfg(feature = "rocksdb")]
            rocks,
        })
    }

    /// The opener of shard `shard_id`'s engine.
    pub fn opener(&self, shard_id: u32) -> EngineOpener {
        match self.kind {
            EngineKind::Native => {
                let config = EngineConfig {
                    shard_id,
                    cache_pages: self.cache_pages_per_shard,
                    io_depth_max: self.io_depth_max,
                    slab_growth_bytes_min: SLAB_GROWTH_BYTES_MIN,
                    placements: self.placements.clone(),
                    append_block_pages: self.append_block_pages,
                    space_amplification_max: self.space_amplification_max,
                    gc_room_blocks_min: GC_ROOM_BLOCKS_MIN,
                    batch_record_bytes_max: self.batch_record_bytes_max,
                    poisoned: self.poisoned.clone(),
                };
                let storage = self.storage.clone();
                let progress = self.progress.clone();
                Box::new(move || {
                    let device = storage.open_device()?;
                    let engine = NativeEngine::open(device, config, progress.as_ref())?;
                    Ok(Box::new(engine) as Box<dyn ShardEngine>)
                })
            }
            #[cfg(feature = "rocksdb")]
            EngineKind::RocksDb => {
                let (shared, created) = self.rocks.clone().expect("made by new for this engine");
                let config = super::rocks::RocksConfig {
                    shard_id,
                    store_dir: self.dir.clone().expect("new refuses rocksdb without a directory"),
                    shared,
                    poisoned: self.poisoned.clone(),
                    create_if_missing: !created,
                };
                Box::new(move || {
                    let engine = super::rocks::RocksEngine::open(config)?;
                    Ok(Box::new(engine) as Box<dyn ShardEngine>)
                })
            }
            #[cfg(not(feature = "rocksdb"))]
            EngineKind::RocksDb => unreachable!("new refuses an engine this build lacks"),
        }
    }

    /// Every shard opened: records what the engine needs recorded once a store exists whole.
    pub fn finish_open(&self) -> Result<(), OpenError> {
        #[cfg(feature = "rocksdb")]
        if let (Some((_, false)), Some(dir)) = (&self.rocks, &self.dir) {
            super::rocks::mark_creation_finished(dir)?;
        }
        Ok(())
    }

    pub fn progress(&self) -> Option<&indicatif::ProgressBar> {
        self.progress.as_ref()
    }
}

/// Decides the placement of every in-page class of a new store: the setting asked for (per
/// class where `placement_by_class` says), with `Auto` resolved by the device's write probe
/// (`placement_by_class` overrides `placement` for the classes it names).
pub fn decide_placement(
    storage: &dyn Storage,
    placement: PlacementSetting,
    placement_by_class: &[(u8, PlacementSetting)],
    space_amplification_max: f64,
) -> Result<PlacementDecision, OpenError> {
    let setting_of = |class: usize| {
        placement_by_class
            .iter()
            .rev()
            .find(|(id, _)| *id as usize == class)
            .map_or(placement, |(_, setting)| *setting)
    };
    let placeable = |class: usize| SizeClass::get(class as u8).is_placeable();
    let wants_probe = (0..CLASS_COUNT)
        .any(|class| placeable(class) && setting_of(class) == PlacementSetting::Auto);
    let ratio = if wants_probe {
        storage.probe_writes()?.map(|probe| probe.sequential_over_random())
    } else {
        None
    };
    let mut placements = [Placement::InPlace; PLACED_CLASS_COUNT];
    for (class, placement) in placements.iter_mut().enumerate() {
        if !placeable(class) {
            continue;
        }
        *placement = match setting_of(class) {
            PlacementSetting::InPlace => Placement::InPlace,
            PlacementSetting::Append => Placement::Append,
            PlacementSetting::Auto => match ratio {
                Some(ratio) => {
                    choose_placement(SizeClass::get(class as u8), ratio, space_amplification_max)
                }
                None => Placement::InPlace,
            },
        };
    }
    if wants_probe {
        tracing::info!(
            sequential_over_random = ratio,
            placements = ?placements.iter().map(|placement| placement.name()).collect::<Vec<_>>(),
            "auto placement decided"
        );
    }
    Ok(PlacementDecision {
        setting: placement,
        placements,
        probe_ratio_milli: ratio
            .map_or(0, |ratio| (ratio * 1000.0).round().clamp(1.0, u32::MAX as f64) as u32),
    })
}

/// Fills in the placements of the packed classes of a manifest written before they existed
/// (format version 3 and older): each takes the placement of the paged class of the smallest
/// slot that holds its own, which is what `auto` would have chosen for it at the same probe
/// ratio and ceiling up to the slot size, and what a uniform setting gave every class.
pub fn place_newer_classes(placements: &mut [Placement; PLACED_CLASS_COUNT]) {
    for class in (0..CLASS_COUNT as u8).map(SizeClass::get) {
        if class.kind == ClassKind::Packed {
            placements[class.id as usize] = placements[class.paged_counterpart().id as usize];
        }
    }
}

/// Whether a class id names a class that can be placed either way (`Options::placement_by_class`).
pub fn class_has_placement(class: u8) -> bool {
    (class as usize) < CLASS_COUNT && SizeClass::get(class).is_placeable()
}

/// Whether recorded placements are possible: a class that cannot be appended is in place.
pub fn placements_are_valid(placements: &[Placement; PLACED_CLASS_COUNT]) -> bool {
    (0..CLASS_COUNT as u8)
        .map(SizeClass::get)
        .all(|class| class.is_placeable() || placements[class.id as usize] == Placement::InPlace)
}

/// The format version of the files a new store of `kind` writes, as the manifest records it
/// (`slab_format_version`): the native slab format; 0 for an engine whose files are its own
/// (RocksDB).
pub fn file_format_version(kind: EngineKind) -> u32 {
    match kind {
        EngineKind::Native => SLAB_FORMAT_VERSION,
        EngineKind::RocksDb => 0,
    }
}

/// Whether this build reads a store of `kind` whose manifest records file format `version`.
pub fn reads_file_format(kind: EngineKind, version: u32) -> bool {
    match kind {
        EngineKind::Native => {
            (SLAB_FORMAT_VERSION_READ_MIN..=SLAB_FORMAT_VERSION).contains(&version)
        }
        EngineKind::RocksDb => version == 0,
    }
}

/// The check of every shard of a store of `kind` (`copse check`; a store with no manifest is
/// checked as native). Problems go to `problems`; `Err` only when the check cannot run.
pub fn check_shards(
    kind: EngineKind,
    path: &Path,
    storage: &dyn Storage,
    shard_count: u32,
    manifest_found: bool,
    problems: &mut Problems,
) -> Result<ShardChecks, OpenError> {
    match kind {
        EngineKind::Native => {
            super::native::check::check_shards(storage, shard_count, manifest_found, problems)
        }
        EngineKind::RocksDb => check_rocksdb_shards(path, shard_count, problems),
    }
}

/// A store of the RocksDB engine: every shard's instance is opened read-only and every item read
/// with RocksDB's block checksums verified; a failure is a problem of that instance.
#[cfg(feature = "rocksdb")]
fn check_rocksdb_shards(
    path: &Path,
    shard_count: u32,
    problems: &mut Problems,
) -> Result<ShardChecks, OpenError> {
    let mut checks = ShardChecks::default();
    for shard in 0..shard_count {
        let dir = super::rocks::shard_dir(path, shard);
        let file = dir.strip_prefix(path).unwrap_or(&dir).display().to_string();
        match super::rocks::check_instance(&dir) {
            Ok(live_keys) => {
                checks.files_checked += 1;
                checks.shards.push(ShardReport { shard, live_keys, ..ShardReport::default() });
            }
            Err(what) => problems.file(&file, Some(shard), None, what),
        }
    }
    Ok(checks)
}

#[cfg(not(feature = "rocksdb"))]
fn check_rocksdb_shards(
    _path: &Path,
    _shard_count: u32,
    _problems: &mut Problems,
) -> Result<ShardChecks, OpenError> {
    Err(OpenError::EngineUnavailable(EngineKind::RocksDb))
}

/// Whether the directory `path` has a native shard directory (any shard number).
pub fn native_shard_dirs_exist(path: &Path) -> bool {
    (0..SHARDS_MAX as u32).any(|shard| path.join(shard_dir(shard)).is_dir())
}

/// Whether `device` holds files in any native shard directory, whatever the shard count (a store
/// created with more shards and a lost manifest must not be taken for a new store).
pub fn native_files_exist(device: &mut dyn BlockDevice) -> bool {
    (0..SHARDS_MAX as u32).any(|shard| {
        device.list_files(&shard_dir(shard)).map(|files| !files.is_empty()).unwrap_or(false)
    })
}

/// Whether the store in `path` holds anything under the RocksDB engine's directory (an
/// instance, or its creation marker). Read with `std::fs`: devices list files, not directories.
/// Known to every build, so one without the `rocksdb` feature still recognises such a store.
pub fn rocksdb_files_exist(path: &Path) -> bool {
    std::fs::read_dir(path.join(super::ROCKSDB_DIR))
        .map(|mut entries| entries.next().is_some())
        .unwrap_or(false)
}
