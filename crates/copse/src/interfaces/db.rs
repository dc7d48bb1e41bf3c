//! The embedded Rust API: [`Db`], blocking and async.
//!
//! Every request is checked against the limits in `limits.rs` here, before it is queued, so a bad
//! request changes nothing and allocates nothing in a shard. A write returns only once it is
//! durable (see docs/durability.md); a read sees every write that returned before it started.

use std::io::IsTerminal;
use std::ops::{Bound, RangeBounds};
use std::path::Path;
use std::sync::Arc;

use serde::Serialize;

use crate::device::{Backend, DeviceStats, DirStorage, Storage, WriteDurability};
use crate::engine::factory::{decide_placement, SetupSettings, StoreSetup};
use crate::engine::input::{check_batch, check_key, check_value};
use crate::engine::placement::{Placement, PlacementSetting, PLACED_CLASS_COUNT};
use crate::engine::{BatchOp, ClassStats, EngineKind, KeyValue, Request, ScrubReport, ShardStats};
use crate::error::{InputError, OpenError, ReadError, WriteError};
use crate::limits::{
    APPEND_BLOCK_PAGES_MAX, CACHE_BYTES_DEFAULT, IO_DEPTH_DEFAULT, IO_DEPTH_MAX, KEY_BYTES_MAX,
    SCAN_ITEMS_MAX, SHARDS_MAX, SPACE_AMPLIFICATION_MAX, SPACE_AMPLIFICATION_MIN,
};
use crate::router::txn::{self, AtomicExec, Coordination};
use crate::router::{close_shards, manifest, shard_of, Router};
use crate::shard::exec::{Exec, ExecRequest};
use crate::shard::ShardHandle;

/// How to open a store.
#[derive(Clone, Debug)]
pub struct Options {
    /// Shards (threads). Fixed when the store is created; reopening with another count fails.
    pub shards: usize,
    /// Page cache budget for the whole store, split evenly over shards.
    pub cache_bytes: usize,
    /// Device I/Os each shard keeps in flight at most.
    pub io_depth: usize,
    pub durability: WriteDurability,
    pub backend: Backend,
    pub create_if_missing: bool,
    /// Draw a progress bar on a terminal while recovery scans the slabs.
    pub show_progress: bool,
    /// Pin shard `i` to core `i % cores` (KVell: one worker per core).
    pub pin_threads: bool,
    /// The engine of a new store; an existing store must be opened with the engine that created
    /// it (recorded in the manifest). `RocksDb` needs the `rocksdb` cargo feature and a directory
    /// (`Db::open`); `durability`, `backend` and `io_depth` apply to the native engine only.
    pub engine: EngineKind,
    /// How the in-page size classes of a new native store place records (docs/placement.md):
    /// `InPlace` (KVell), `Append` (RStore, with a garbage collector) or `Auto` (decided per class
    /// from a short write probe of the device at creation; in place where no probe can run, as
    /// on the simulated device). Recorded in the manifest; an existing store keeps its own.
    pub placement: PlacementSetting,
    /// Per-class exceptions to `placement` (class id, setting), for in-page classes (0 to 12).
    pub placement_by_class: Vec<(u8, PlacementSetting)>,
    /// The collector keeps each append class's file under this many times its live slots
    /// (plus one growth step of the file), between `SPACE_AMPLIFICATION_MIN` and
    /// `SPACE_AMPLIFICATION_MAX`. Lower costs more collector writes.
    pub space_amplification_max: f64,
    /// Pages per block of an append class (the unit the collector empties and reuses).
    pub append_block_pages: u32,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            shards: std::thread::available_parallelism().map_or(1, |cores| cores.get()),
            cache_bytes: CACHE_BYTES_DEFAULT,
            io_depth: IO_DEPTH_DEFAULT,
            // Measured in docs/benchmarks.md ("durability mode"): one fdatasync per round of
            // writes beat RWF_DSYNC on every write on this machine's virtual disk, 1.4-2x at
            // queue depth 16-64, and far more on freshly allocated space.
            durability: WriteDurability::FlushPerRound,
            backend: Backend::Auto,
            create_if_missing: true,
            show_progress: true,
            pin_threads: true,
            engine: EngineKind::Native,
            placement: PlacementSetting::Auto,
            placement_by_class: Vec::new(),
            space_amplification_max: crate::limits::SPACE_AMPLIFICATION_DEFAULT,
            append_block_pages: crate::limits::APPEND_BLOCK_PAGES,
        }
    }
}

impl Options {
    /// Checks every setting against its limit; `Db::open` calls it before it touches the
    /// directory, so refused options leave nothing behind.
    pub fn validate(&self) -> Result<(), OpenError> {
        if self.shards == 0 || self.shards > SHARDS_MAX {
            return Err(OpenError::ShardCountOutOfRange(self.shards));
        }
        if self.io_depth == 0 || self.io_depth > IO_DEPTH_MAX {
            return Err(OpenError::InvalidOption(format!(
                "io_depth {} is out of range (1 to {IO_DEPTH_MAX})",
                self.io_depth
            )));
        }
        if !(SPACE_AMPLIFICATION_MIN..=SPACE_AMPLIFICATION_MAX)
            .contains(&self.space_amplification_max)
        {
            return Err(OpenError::InvalidOption(format!(
                "space_amplification_max {} is out of range ({SPACE_AMPLIFICATION_MIN} to {SPACE_AMPLIFICATION_MAX})",
                self.space_amplification_max
            )));
        }
        if self.append_block_pages == 0 || self.append_block_pages > APPEND_BLOCK_PAGES_MAX {
            return Err(OpenError::InvalidOption(format!(
                "append_block_pages {} is out of range (1 to {APPEND_BLOCK_PAGES_MAX})",
                self.append_block_pages
            )));
        }
        if let Some((class, _)) =
            self.placement_by_class.iter().find(|(class, _)| *class as usize >= PLACED_CLASS_COUNT)
        {
            return Err(OpenError::InvalidOption(format!(
                "placement_by_class names class {class}; only in-page classes (0 to {}) have a placement",
                PLACED_CLASS_COUNT - 1
            )));
        }
        Ok(())
    }
}

/// Owned start and end bounds of a scan.
type KeyRange = (Bound<Vec<u8>>, Bound<Vec<u8>>);

/// A batch of puts and deletes, applied all or nothing, also across a crash, and never seen in
/// part by a reader (a batch over several shards is a cross-shard batch: router/txn.rs).
#[derive(Clone, Debug, Default)]
pub struct WriteBatch {
    ops: Vec<BatchOp>,
}

impl WriteBatch {
    pub fn new() -> WriteBatch {
        WriteBatch::default()
    }
    pub fn put(&mut self, key: impl Into<Vec<u8>>, value: impl Into<Vec<u8>>) -> &mut Self {
        self.ops.push(BatchOp::Put { key: key.into(), value: value.into() });
        self
    }
    pub fn delete(&mut self, key: impl Into<Vec<u8>>) -> &mut Self {
        self.ops.push(BatchOp::Delete { key: key.into() });
        self
    }
    pub fn len(&self) -> usize {
        self.ops.len()
    }
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }
}

/// Figures for the whole store (`copse stats`).
#[derive(Clone, Debug, Serialize)]
pub struct StoreStats {
    pub items: u64,
    pub file_bytes: u64,
    pub index_bytes: u64,
    pub index_bytes_per_item: f64,
    pub cache_hit_rate: f64,
    /// Every shard's device figures, summed.
    pub device: DeviceStats,
    /// Bytes of keys and values users asked to write since the store was opened.
    pub user_bytes_written: u64,
    /// Device bytes written per user byte written, since open (0 before any user write).
    pub write_amplification: f64,
    pub placement: StorePlacement,
    /// Every class in use, summed over shards.
    pub classes: Vec<ClassStats>,
    pub shards: Vec<ShardStats>,
}

/// A finished online scrub (`Db::scrub`): when it ended, how long it took, what it found.
#[derive(Clone, Debug, Serialize)]
pub struct ScrubRun {
    /// When it finished, in seconds since the Unix epoch.
    pub finished_unix_secs: u64,
    pub duration_ms: u64,
    pub report: ScrubReport,
}

/// Scrubs under way and the last one finished (the server's `INFO`).
#[derive(Default)]
struct ScrubLog {
    running: u32,
    last: Option<ScrubRun>,
}

/// An open store. Cheap to clone; every clone talks to the same shards.
#[derive(Clone)]
pub struct Db {
    inner: Arc<Inner>,
}

struct Inner {
    router: Router,
    /// Cross-shard batches: gsns and the decision count multi-key reads check.
    coordination: Coordination,
    /// The shard threads; taken (under the mutex) only to close.
    shards: std::sync::Mutex<Vec<ShardHandle>>,
    /// The directory lock, released by `close` (or drop).
    lock: std::sync::Mutex<Option<std::fs::File>>,
    scrubs: std::sync::Mutex<ScrubLog>,
    /// What the manifest says of placement, for `stats`.
    placement: StorePlacement,
}

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

impl Db {
    /// Opens (or creates) the store in directory `path`.
    pub fn open(path: impl AsRef<Path>, options: Options) -> Result<Db, OpenError> {
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
        Db::open_inner(Arc::new(storage), options, Some(lock), Some(path))
    }

    /// Opens a store on any storage (the simulated device in tests). An engine that keeps its
    /// own files in a directory (RocksDB) is refused with the reason (`Db::open` serves it).
    pub fn open_with_storage(storage: Arc<dyn Storage>, options: Options) -> Result<Db, OpenError> {
        if options.engine == EngineKind::RocksDb {
            // Before the manifest is created: a refused open leaves nothing behind.
            return Err(OpenError::InvalidOption(format!(
                "the {} engine needs a directory (Db::open), not a storage",
                options.engine
            )));
        }
        options.validate()?;
        Db::open_inner(storage, options, None, None)
    }

    /// Both `open`s validated the options before they came here.
    fn open_inner(
        storage: Arc<dyn Storage>,
        options: Options,
        lock: Option<std::fs::File>,
        dir: Option<&Path>,
    ) -> Result<Db, OpenError> {
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
        Ok(Db {
            inner: Arc::new(Inner {
                router,
                coordination: Coordination::new(resolution.next_gsn),
                shards: std::sync::Mutex::new(shards),
                lock: std::sync::Mutex::new(lock),
                scrubs: std::sync::Mutex::new(ScrubLog::default()),
                placement: StorePlacement {
                    asked: manifest.placement_setting,
                    classes: manifest.placements.to_vec(),
                    probe_sequential_over_random: (manifest.probe_ratio_milli > 0)
                        .then(|| manifest.probe_ratio_milli as f64 / 1000.0),
                },
            }),
        })
    }

    fn router(&self) -> &Router {
        &self.inner.router
    }

    pub fn shard_count(&self) -> u32 {
        self.inner.router.shard_count()
    }

    pub fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, ReadError> {
        check_key(key)?;
        let key = key.to_vec();
        self.router().send(&key, ReadError::Closed, |key, reply| Request::Get { key, reply }).wait()
    }

    pub fn put(&self, key: &[u8], value: &[u8]) -> Result<(), WriteError> {
        check_key(key)?;
        check_value(value)?;
        let value = value.to_vec();
        self.router()
            .send(key, WriteError::Closed, |key, reply| Request::Put { key, value, reply })
            .wait()
    }

    /// Deletes `key`; returns whether it existed.
    pub fn delete(&self, key: &[u8]) -> Result<bool, WriteError> {
        check_key(key)?;
        self.router()
            .send(key, WriteError::Closed, |key, reply| Request::Delete { key, reply })
            .wait()
    }

    /// Applies a batch all or nothing, also across a crash; no reader sees part of it. A batch
    /// within one shard is one all-or-nothing write there; a batch over several shards is a
    /// cross-shard batch (two-phase commit, docs/atomic-batches.md), whose parts lock their keys
    /// until applied. An error means the batch was not applied, except after an I/O error,
    /// when its outcome is unknown until the store is reopened (it is then whole or absent).
    pub fn write_batch(&self, batch: WriteBatch) -> Result<(), WriteError> {
        futures::executor::block_on(self.write_batch_async(batch))
    }

    /// The batch's operations by shard, ascending, the last operation of each key only; each
    /// part checked if there are several.
    fn split_batch(&self, ops: Vec<BatchOp>) -> Result<Vec<(u32, Vec<BatchOp>)>, WriteError> {
        check_batch(&ops)?;
        let mut parts: std::collections::BTreeMap<u32, Vec<BatchOp>> = Default::default();
        for op in crate::engine::batch_codec::dedupe_batch(ops) {
            parts.entry(shard_of(op.key(), self.shard_count())).or_default().push(op);
        }
        if parts.len() > 1 {
            for ops in parts.values() {
                crate::engine::input::check_part(parts.len(), ops)?;
            }
        }
        Ok(parts.into_iter().collect())
    }

    /// Several keys' values, as of one moment: a cross-shard batch is seen whole or not at all.
    pub fn multi_get(&self, keys: &[Vec<u8>]) -> Result<Vec<Option<Vec<u8>>>, ReadError> {
        futures::executor::block_on(self.multi_get_async(keys))
    }

    pub async fn multi_get_async(
        &self,
        keys: &[Vec<u8>],
    ) -> Result<Vec<Option<Vec<u8>>>, ReadError> {
        for key in keys {
            check_key(key)?;
        }
        self.read_consistently(|| async {
            let pending: Vec<_> = keys
                .iter()
                .map(|key| {
                    self.router()
                        .send(key, ReadError::Closed, |key, reply| Request::Get { key, reply })
                })
                .collect();
            let mut values = Vec::with_capacity(keys.len());
            for reply in pending {
                values.push(reply.into_future().await?);
            }
            Ok(values)
        })
        .await
    }

    /// Runs a read of several keys (or shards) until no cross-shard batch was decided during
    /// it, so that it saw every batch whole (router/txn.rs, `Decisions::read`). For callers that
    /// compose their own multi-key reads from execs (the server's MGET).
    pub async fn read_consistently<T, E, F, Fut>(&self, attempt: F) -> Result<T, E>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, E>>,
    {
        self.inner.coordination.decisions.read(attempt).await
    }

    /// Runs one exec per shard as one cross-shard batch (see `txn::AtomicExec`): each exec ends
    /// in `ExecStep::Prepare` with the vote it was built with, or refuses it. Returns once every
    /// exec is queued and started (or the batch was called off); each answers its own caller.
    /// `parts` must name at least two shards, each once.
    pub async fn exec_atomic(&self, mut parts: Vec<AtomicExec>) {
        parts.sort_by_key(|part| part.shard);
        assert!(parts.len() >= 2, "a cross-shard batch spans at least two shards");
        assert!(parts.windows(2).all(|pair| pair[0].shard < pair[1].shard), "one exec per shard");
        assert!(parts.iter().all(|part| part.shard < self.shard_count()), "no such shard");
        self.inner.coordination.run(self.router(), parts).await;
    }

    /// Up to `limit` items with keys in `range`, in key order, each with its latest value.
    pub fn scan<R: RangeBounds<Vec<u8>>>(
        &self,
        range: R,
        limit: usize,
    ) -> Result<Vec<KeyValue>, ReadError> {
        futures::executor::block_on(self.scan_async(range, limit))
    }

    fn scan_bounds<R: RangeBounds<Vec<u8>>>(
        range: &R,
        limit: usize,
    ) -> Result<KeyRange, InputError> {
        if limit > SCAN_ITEMS_MAX {
            return Err(InputError::ScanLimitTooLarge { limit, max: SCAN_ITEMS_MAX });
        }
        for bound in [range.start_bound(), range.end_bound()] {
            if let Bound::Included(key) | Bound::Excluded(key) = bound {
                if key.len() > KEY_BYTES_MAX {
                    return Err(InputError::KeyTooLarge { bytes: key.len(), max: KEY_BYTES_MAX });
                }
            }
        }
        Ok((range.start_bound().cloned(), range.end_bound().cloned()))
    }

    /// Returns once every write accepted before the call is durable.
    pub fn flush(&self) -> Result<(), WriteError> {
        self.on_every_shard(|reply| Request::Flush { reply })
    }

    /// As `flush`, and also waits for the engine's background work to finish (RocksDB's memtable
    /// flushes and compactions; the native engine has none). For benchmarks and operators.
    pub fn settle(&self) -> Result<(), WriteError> {
        self.on_every_shard(|reply| Request::Settle { reply })
    }

    /// Sends one request to every shard and waits for all; the last failure if any failed.
    fn on_every_shard(
        &self,
        build: impl Fn(crate::engine::Reply<(), WriteError>) -> Request,
    ) -> Result<(), WriteError> {
        let mut result = Ok(());
        for pending in self.router().broadcast(WriteError::Closed, build) {
            if let Err(err) = pending.wait() {
                result = Err(err);
            }
        }
        result
    }

    pub fn stats(&self) -> Result<StoreStats, ReadError> {
        let mut shards = Vec::new();
        for pending in self.router().broadcast(ReadError::Closed, |reply| Request::Stats { reply })
        {
            shards.push(pending.wait()?);
        }
        Ok(summarize(shards, &self.inner.placement))
    }

    /// Scrubs every shard online (`engine::Request::Scrub`): every item and page checksum is
    /// verified against what the device holds, while the store keeps serving. The shards scrub
    /// in parallel; the report is their sum.
    pub fn scrub(&self) -> Result<ScrubReport, ReadError> {
        futures::executor::block_on(self.scrub_async()).map(|run| run.report)
    }

    /// `scrub` for async callers (the server's SCRUB command), with when it finished and how
    /// long it took. A scrub asked for while one runs joins it. The finished scrub is kept as
    /// `last_scrub`.
    pub async fn scrub_async(&self) -> Result<ScrubRun, ReadError> {
        let started = std::time::Instant::now();
        let _running = ScrubRunning::start(&self.inner.scrubs);
        let mut report = ScrubReport::default();
        for pending in self.router().broadcast(ReadError::Closed, |reply| Request::Scrub { reply })
        {
            report.merge(pending.into_future().await?);
        }
        let finished_unix_secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |since| since.as_secs());
        let run = ScrubRun {
            finished_unix_secs,
            duration_ms: started.elapsed().as_millis() as u64,
            report,
        };
        lock_ignoring_poison(&self.inner.scrubs).last = Some(run.clone());
        Ok(run)
    }

    /// The last scrub that finished since the store was opened, if any.
    pub fn last_scrub(&self) -> Option<ScrubRun> {
        lock_ignoring_poison(&self.inner.scrubs).last.clone()
    }

    /// Whether a scrub is under way.
    pub fn scrub_running(&self) -> bool {
        lock_ignoring_poison(&self.inner.scrubs).running > 0
    }

    /// Finishes all work, makes it durable and stops the shards. Other clones see `Closed`.
    pub fn close(&self) -> Result<(), WriteError> {
        let mut shards = lock_ignoring_poison(&self.inner.shards);
        let result = close_shards(&mut shards);
        lock_ignoring_poison(&self.inner.lock).take();
        result
    }

    /// The shard that owns `route`: where the plain requests for that key go, and where execs
    /// that work on it must run.
    pub fn shard_of(&self, route: &[u8]) -> u32 {
        crate::router::shard_of(route, self.shard_count())
    }

    /// Runs an exec program in `shard`, atomically with respect to every other exec sharing one
    /// of its `locks` (see `shard::exec`). The program answers through its own channel; this
    /// returns once the program is queued (blocking while the queue is full). If the store is
    /// closed the program is dropped unstarted, which its waiter sees as a closed channel.
    pub fn exec(&self, shard: u32, locks: Vec<Vec<u8>>, exec: Box<dyn Exec>) {
        assert!(shard < self.shard_count(), "exec sent to shard {shard} of {}", self.shard_count());
        self.router().send_exec(shard, ExecRequest { locks, exec });
    }

    /// As `exec`, awaiting room in the shard's queue instead of blocking the thread.
    pub async fn exec_async(&self, shard: u32, locks: Vec<Vec<u8>>, exec: Box<dyn Exec>) {
        assert!(shard < self.shard_count(), "exec sent to shard {shard} of {}", self.shard_count());
        self.router().send_exec_async(shard, ExecRequest { locks, exec }).await;
    }

    /// Messages waiting in each shard's queue (a gauge for operators).
    pub fn queue_depths(&self) -> Vec<usize> {
        self.router().queue_depths()
    }

    pub async fn get_async(&self, key: &[u8]) -> Result<Option<Vec<u8>>, ReadError> {
        check_key(key)?;
        let key = key.to_vec();
        self.router()
            .send_async(&key, ReadError::Closed, |key, reply| Request::Get { key, reply })
            .await
            .into_future()
            .await
    }

    pub async fn put_async(&self, key: &[u8], value: &[u8]) -> Result<(), WriteError> {
        check_key(key)?;
        check_value(value)?;
        let value = value.to_vec();
        self.router()
            .send_async(key, WriteError::Closed, |key, reply| Request::Put { key, value, reply })
            .await
            .into_future()
            .await
    }

    pub async fn delete_async(&self, key: &[u8]) -> Result<bool, WriteError> {
        check_key(key)?;
        self.router()
            .send_async(key, WriteError::Closed, |key, reply| Request::Delete { key, reply })
            .await
            .into_future()
            .await
    }

    pub async fn write_batch_async(&self, batch: WriteBatch) -> Result<(), WriteError> {
        let mut parts = self.split_batch(batch.ops)?;
        if parts.len() > 1 {
            return self.inner.coordination.write(self.router(), parts).await;
        }
        let Some((_, ops)) = parts.pop() else { return Ok(()) };
        let (reply, receiver) = futures::channel::oneshot::channel();
        let shard = shard_of(ops[0].key(), self.shard_count());
        let request = Request::Batch { ops, reply };
        self.router().send_to(shard, WriteError::Closed, request, receiver).into_future().await
    }

    pub async fn scan_async<R: RangeBounds<Vec<u8>>>(
        &self,
        range: R,
        limit: usize,
    ) -> Result<Vec<KeyValue>, ReadError> {
        let (start, end) = Self::scan_bounds(&range, limit)?;
        self.read_consistently(|| {
            crate::router::scan::scan(self.router(), start.clone(), end.clone(), limit)
        })
        .await
    }

    pub async fn stats_async(&self) -> Result<StoreStats, ReadError> {
        let mut shards = Vec::new();
        for pending in self.router().broadcast(ReadError::Closed, |reply| Request::Stats { reply })
        {
            shards.push(pending.into_future().await?);
        }
        Ok(summarize(shards, &self.inner.placement))
    }

    pub async fn flush_async(&self) -> Result<(), WriteError> {
        let mut result = Ok(());
        for pending in self.router().broadcast(WriteError::Closed, |reply| Request::Flush { reply })
        {
            if let Err(err) = pending.into_future().await {
                result = Err(err);
            }
        }
        result
    }
}

fn lock_ignoring_poison<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poison| poison.into_inner())
}

/// Counts a scrub as running until dropped (so an abandoned scrub future is not counted).
struct ScrubRunning<'a>(&'a std::sync::Mutex<ScrubLog>);

impl<'a> ScrubRunning<'a> {
    fn start(log: &'a std::sync::Mutex<ScrubLog>) -> Self {
        lock_ignoring_poison(log).running += 1;
        ScrubRunning(log)
    }
}

impl Drop for ScrubRunning<'_> {
    fn drop(&mut self) {
        lock_ignoring_poison(self.0).running -= 1;
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let shards = self.shards.get_mut().unwrap_or_else(|poison| poison.into_inner());
        if let Err(err) = close_shards(shards) {
            tracing::error!(%err, "closing the store on drop failed");
        }
    }
}

fn summarize(shards: Vec<ShardStats>, placement: &StorePlacement) -> StoreStats {
    let mut classes: Vec<ClassStats> = Vec::new();
    for class in shards.iter().flat_map(|shard| &shard.classes) {
        match classes.iter_mut().find(|sum| sum.class == class.class) {
            Some(sum) => sum.merge(class),
            None => classes.push(class.clone()),
        }
    }
    classes.sort_by_key(|class| class.class);
    let user_bytes_written: u64 = classes.iter().map(|class| class.user_bytes_written).sum();
    let device = shards.iter().fold(DeviceStats::default(), |total, shard| total + shard.device);
    let items: u64 = shards.iter().map(|shard| shard.items).sum();
    let index_bytes: u64 = shards.iter().map(|shard| shard.index_bytes).sum();
    let hits: u64 = shards.iter().map(|shard| shard.cache_hits).sum();
    let misses: u64 = shards.iter().map(|shard| shard.cache_misses).sum();
    StoreStats {
        items,
        file_bytes: shards.iter().map(|shard| shard.file_bytes).sum(),
        index_bytes,
        index_bytes_per_item: if items == 0 { 0.0 } else { index_bytes as f64 / items as f64 },
        cache_hit_rate: if hits + misses == 0 { 0.0 } else { hits as f64 / (hits + misses) as f64 },
        user_bytes_written,
        write_amplification: crate::engine::write_amplification(
            device.bytes_written,
            user_bytes_written,
        ),
        device,
        placement: placement.clone(),
        classes,
        shards,
    }
}
