//! Opening a store: the directory lock, the manifest (created, or checked against the options
//! and against what the storage holds: a lost manifest beside engine files is refused), one
//! thread per shard recovering its engine in parallel (the engine factory builds each; nothing
//! here names an engine), then the cross-shard batches a crash interrupted decided and carried
//! out before anyone reads.
//!
//! Invariants:
//! 1. Options are validated, and a refused open returns, before the directory or the storage is
//!    touched (nothing is left behind).
//! 2. No part of a cross-shard batch from an earlier session survives the open (asserted: the
//!    gsn counter restarts above what recovery saw, which is safe only then).
//! 3. The shards of an opened `Store` are stopped by `close` or, failing that, on drop; they
//!    stop once (`close_shards` empties the list, so a second close finds nothing to stop).

use std::io::IsTerminal;
use std::path::Path;
use std::sync::Arc;

use serde::Serialize;

use crate::device::{DirStorage, Storage};
use crate::engine::factory::{decide_placement, SetupSettings, StoreSetup};
use crate::engine::placement::{Placement, PlacementSetting};
use crate::engine::{EngineKind, Request};
use crate::error::{OpenError, ReadError, WriteError};
use crate::limits::IO_DEPTH_MAX;
use crate::router::txn::{self, Coordination};
use crate::router::{close_shards, Router};
use crate::shard::ShardHandle;
use crate::store::manifest;
use crate::store::options::Options;

/// How a store places records (from its manifest), as `copse stats` shows it.
#[derive(Clone, Debug, Serialize)]
pub struct StorePlacement {
    /// What was asked for when the store was created (`None`: before manifest version 3).
    pub asked: Option<PlacementSetting>,
    /// The placement of each in-page class, by class id.
    pub classes: Vec<Placement>,
    /// The write probe's ratio of sequential to random page throughput, when `auto` probed.
    pub probe_sequential_over_random: Option<f64>,
}

/// Takes an exclusive lock on the store directory so two processes never open one store.
pub(crate) fn lock_directory(path: &Path) -> Result<std::fs::File, OpenError> {
    use std::os::fd::AsRawFd;
    // Durably: the new directory's entry in its parent must survive a crash like the store.
    crate::device::files::create_store_dir(path)?;
    let lock_path = path.join("LOCK");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(|err| {
            OpenError::Device(crate::device::DeviceError::from_io(
                &err,
                lock_path.display().to_string(),
            ))
        })?;
    // SAFETY: flock on a descriptor we own; no memory is involved.
    let locked = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if locked != 0 {
        return Err(OpenError::Locked(path.display().to_string()));
    }
    Ok(file)
}

/// An open store: its shards, the router to them, the coordination of cross-shard batches and
/// the directory lock. `Db` is the API over it.
pub(crate) struct Store {
    pub(crate) router: Router,
    /// Cross-shard batches: gsns and the decision count multi-key reads check.
    pub(crate) coordination: Coordination,
    /// The shard threads; taken (under the mutex) only to close.
    shards: std::sync::Mutex<Vec<ShardHandle>>,
    /// The directory lock, released by `close` (or drop).
    lock: std::sync::Mutex<Option<std::fs::File>>,
    /// What the manifest says of placement, for `stats`.
    pub(crate) placement: StorePlacement,
}

impl Store {
    /// Opens (or creates) the store in directory `path`.
    pub(crate) fn open(path: impl AsRef<Path>, options: Options) -> Result<Store, OpenError> {
        let path = path.as_ref();
        // Before taking the lock, which creates the directory: a refused open leaves nothing
        // behind. (`manifest::open_or_create` checks again for storages that are not directories.)
        if !options.create_if_missing && !path.join(manifest::MANIFEST_FILE).exists() {
            return Err(OpenError::NotFound(path.display().to_string()));
        }
        if !options.engine.available() {
            // Checked again by the engine factory; here before the directory is touched.
            return Err(OpenError::EngineUnavailable(options.engine));
        }
        options.validate()?;
        let lock = lock_directory(path)?;
        let ring_entries =
            (options.io_depth.clamp(1, IO_DEPTH_MAX) as u32).next_power_of_two().max(8);
        let storage = DirStorage::new(path, options.backend, options.durability, ring_entries)?;
        Store::open_inner(Arc::new(storage), options, Some(lock), Some(path))
    }

    /// Opens a store on any storage (the simulated device in tests). An engine that keeps its
    /// own files in a directory (RocksDB) is refused with the reason (`Db::open` serves it).
    pub(crate) fn open_with_storage(
        storage: Arc<dyn Storage>,
        options: Options,
    ) -> Result<Store, OpenError> {
        if options.engine == EngineKind::RocksDb {
            // Before the manifest is created: a refused open leaves nothing behind.
            return Err(OpenError::InvalidOption(format!(
                "the {} engine needs a directory (Db::open), not a storage",
                options.engine
            )));
        }
        options.validate()?;
        Store::open_inner(storage, options, None, None)
    }

    /// Both `open`s validated the options before they came here.
    fn open_inner(
        storage: Arc<dyn Storage>,
        options: Options,
        lock: Option<std::fs::File>,
        dir: Option<&Path>,
    ) -> Result<Store, OpenError> {
        let manifest = {
            let mut device = storage.open_device()?;
            manifest::open_or_create(
                device.as_mut(),
                options.shards as u32,
                options.engine,
                options.create_if_missing,
                &storage.describe(),
                dir.is_some_and(crate::engine::factory::rocksdb_files_exist),
                &mut || {
                    decide_placement(
                        storage.as_ref(),
                        options.placement,
                        &options.placement_by_class,
                        options.space_amplification_max,
                    )
                },
            )?
        };
        if manifest.placement_setting.is_some_and(|asked| asked != options.placement) {
            tracing::info!(
                store = manifest.placement_setting.map(|setting| setting.to_string()),
                asked = %options.placement,
                "the store keeps the placement it was created with"
            );
        }
        let progress = (options.show_progress && std::io::stderr().is_terminal()).then(|| {
            let bar = indicatif::ProgressBar::new(0);
            bar.set_style(
                indicatif::ProgressStyle::with_template(
                    "recovering {bar:40} {bytes}/{total_bytes} ({bytes_per_sec}, {eta})",
                )
                .expect("valid template"),
            );
            bar
        });
        let setup = StoreSetup::new(
            SetupSettings {
                kind: options.engine,
                shards: options.shards,
                cache_bytes: options.cache_bytes,
                io_depth_max: options.io_depth,
                placements: manifest.placements,
                append_block_pages: options.append_block_pages,
                space_amplification_max: options.space_amplification_max,
                batch_record_bytes_max: options.batch_record_bytes_max,
                progress,
            },
            storage.clone(),
            dir,
        )?;
        let (opened_sender, opened) = std::sync::mpsc::channel();
        let cores = std::thread::available_parallelism().map_or(1, |cores| cores.get());
        let mut shards = Vec::with_capacity(options.shards);
        for shard_id in 0..options.shards as u32 {
            let pin_core = options.pin_threads.then_some(shard_id as usize % cores);
            let open = setup.opener(shard_id);
            match ShardHandle::spawn(shard_id, open, opened_sender.clone(), pin_core) {
                Ok(handle) => shards.push(handle),
                Err(err) => {
                    close_shards(&mut shards).ok();
                    return Err(err);
                }
            }
        }
        drop(opened_sender);
        let mut failure = None;
        let mut parts = Vec::new();
        for _ in 0..options.shards {
            match opened.recv() {
                Ok((shard, Ok(found))) => {
                    parts.extend(found.into_iter().map(|part| (shard, part)));
                }
                Ok((shard, Err(err))) => {
                    tracing::error!(shard, %err, "shard failed to open");
                    failure.get_or_insert(err);
                }
                Err(_) => {
                    failure.get_or_insert(OpenError::Thread(
                        "a shard thread exited while opening".into(),
                    ));
                }
            }
        }
        if let Some(progress) = setup.progress() {
            progress.finish_and_clear();
        }
        if failure.is_none() {
            failure = setup.finish_open().err();
        }
        if let Some(err) = failure {
            close_shards(&mut shards).ok();
            return Err(err);
        }
        // Batches a crash interrupted are decided and finished before anyone reads.
        let router = Router::new(&shards);
        let resolution = txn::resolve(&parts);
        if !parts.is_empty() {
            tracing::info!(
                committed = resolution.committed_batches,
                aborted = resolution.aborted_batches,
                "resolved interrupted cross-shard batches"
            );
        }
        if let Err(err) = txn::carry_out(&router, &resolution) {
            close_shards(&mut shards).ok();
            return Err(OpenError::Batches(err));
        }
        // The gsn counter restarts above the largest gsn recovery saw, so a gsn of a batch whose
        // parts were all forgotten before the crash may be handed out again. That is safe only
        // because no part of an earlier session outlives this point: carry_out forgot every part
        // found, and a shard answers a forget only once the part's erasure is durable
        // (docs/atomic-batches.md, "Recovery"). Checked here, before anyone can write.
        if !parts.is_empty() {
            for pending in router.broadcast(ReadError::Closed, |reply| Request::Stats { reply }) {
                let held = pending.wait().map_or(0, |stats| stats.parts_held);
                assert_eq!(held, 0, "a part of a recovered batch outlived its resolution");
            }
        }
        Ok(Store {
            router,
            coordination: Coordination::new(resolution.next_gsn),
            shards: std::sync::Mutex::new(shards),
            lock: std::sync::Mutex::new(lock),
            placement: StorePlacement {
                asked: manifest.placement_setting,
                classes: manifest.placements.to_vec(),
                probe_sequential_over_random: (manifest.probe_ratio_milli > 0)
                    .then(|| manifest.probe_ratio_milli as f64 / 1000.0),
            },
        })
    }

    /// Finishes all work, makes it durable and stops the shards, then releases the directory.
    pub(crate) fn close(&self) -> Result<(), WriteError> {
        let mut shards = lock_ignoring_poison(&self.shards);
        let result = close_shards(&mut shards);
        lock_ignoring_poison(&self.lock).take();
        result
    }
}

pub(crate) fn lock_ignoring_poison<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poison| poison.into_inner())
}

impl Drop for Store {
    fn drop(&mut self) {
        let shards = self.shards.get_mut().unwrap_or_else(|poison| poison.into_inner());
        if let Err(err) = close_shards(shards) {
            tracing::error!(%err, "closing the store on drop failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::sim::SimDisk;
    use crate::device::WriteDurability;

    /// An engine that keeps its own files in a directory cannot run over a storage: the open
    /// says why, and leaves the storage as it found it (no manifest written).
    #[test]
    fn an_engine_that_needs_a_directory_is_refused_over_a_storage_and_nothing_is_written() {
        let disk = SimDisk::new(3);
        let storage = Arc::new(disk.storage(WriteDurability::FlushPerRound));
        let options = Options { engine: EngineKind::RocksDb, shards: 2, ..Options::default() };
        let refused = Store::open_with_storage(storage, options).err().expect("refused");
        let message = refused.to_string();
        assert!(matches!(refused, OpenError::InvalidOption(_)), "{message}");
        assert!(message.contains("needs a directory"), "{message}");
        assert!(disk.file_names().is_empty(), "the refused open wrote {:?}", disk.file_names());
    }

    /// The native engine opens over the simulated device like over a directory, and a second
    /// open finds what the first wrote (the manifest it created included).
    #[test]
    fn the_native_engine_opens_over_a_simulated_storage_and_reopens() {
        let disk = SimDisk::new(4);
        let options = || Options {
            shards: 2,
            cache_bytes: 1 << 20,
            show_progress: false,
            pin_threads: false,
            ..Options::default()
        };
        let storage = Arc::new(disk.storage(WriteDurability::FlushPerRound));
        let store = Store::open_with_storage(storage, options()).expect("opens");
        assert_eq!(store.router.shard_count(), 2);
        store.close().expect("closes");
        drop(store);
        assert!(disk.file_names().iter().any(|name| name == manifest::MANIFEST_FILE));
        let storage = Arc::new(disk.storage(WriteDurability::FlushPerRound));
        let reopened = Store::open_with_storage(storage, options()).expect("reopens");
        assert_eq!(reopened.router.shard_count(), 2);
    }
}
