//! The embedded Rust API: [`Db`], blocking and async.
//!
//! Every request is checked against the limits in `limits.rs` here, before it is queued, so a bad
//! request changes nothing and allocates nothing in a shard. A write returns only once it is
//! durable (see docs/durability.md); a read sees every write that returned before it started.

use std::ops::{Bound, RangeBounds};
use std::path::Path;
use std::sync::Arc;

use serde::Serialize;

use crate::device::{DeviceStats, Storage};
use crate::engine::input::{check_batch, check_key, check_value};
use crate::engine::{BatchOp, ClassStats, KeyValue, Request, ScrubReport, ShardStats};
use crate::error::{InputError, OpenError, ReadError, WriteError};
use crate::limits::{KEY_BYTES_MAX, SCAN_ITEMS_MAX};
use crate::router::txn::AtomicExec;
use crate::router::{shard_of, Router};
use crate::shard::ShardLoop;
use crate::shard::exec::{Exec, ExecRequest};
use crate::store::open::{lock_ignoring_poison, Store};
use crate::store::{Options, StorePlacement};

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
    store: Store,
    scrubs: std::sync::Mutex<ScrubLog>,
}

impl Db {
    /// Opens (or creates) the store in directory `path`.
    pub fn open(path: impl AsRef<Path>, options: Options) -> Result<Db, OpenError> {
        Ok(Db::over(Store::open(path.as_ref(), options)?))
    }

    /// Opens a store on any storage (the simulated device in tests). An engine that keeps its
    /// own files in a directory (RocksDB) is refused with the reason (`Db::open` serves it).
    pub fn open_with_storage(storage: Arc<dyn Storage>, options: Options) -> Result<Db, OpenError> {
        Ok(Db::over(Store::open_with_storage(storage, options)?))
    }

    fn over(store: Store) -> Db {
        Db { inner: Arc::new(Inner { store, scrubs: std::sync::Mutex::new(ScrubLog::default()) }) }
    }

    fn router(&self) -> &Router {
        &self.inner.store.router
    }

    pub fn shard_count(&self) -> u32 {
        self.inner.store.router.shard_count()
    }

    /// Adds flat combining's counts, kept beside the shard's loop rather than in its engine.
    fn with_combine_counts(&self, mut shards: Vec<ShardStats>) -> Vec<ShardStats> {
        for stats in &mut shards {
            let counts = self.router().combine_counts(stats.shard);
            stats.requests_combined = counts.combined;
            stats.combine_found_busy = counts.found_busy;
            stats.combine_left_io_for_thread = counts.left_io_for_thread;
            stats.combine_reads_taken = counts.reads_taken;
        }
        shards
    }

    pub fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, ReadError> {
        check_key(key)?;
        self.router().call_combining(key, ReadError::Closed, |key, reply| Request::Get { key, reply })
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

    /// Several keys' values, as of one moment: a batch is seen whole or not at all. Each shard
    /// reads its keys at one moment (`Request::MultiGet`), and the read is retried if a
    /// cross-shard batch was decided during it.
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
        // Each shard's keys, by their places in `keys`.
        let mut places: std::collections::BTreeMap<u32, Vec<usize>> = Default::default();
        for (place, key) in keys.iter().enumerate() {
            places.entry(shard_of(key, self.shard_count())).or_default().push(place);
        }
        self.read_consistently(|| async {
            let pending: Vec<_> = places
                .iter()
                .map(|(&shard, places)| {
                    let (reply, receiver) = futures::channel::oneshot::channel();
                    let keys = places.iter().map(|&place| keys[place].clone()).collect();
                    let request = Request::MultiGet { keys, reply };
                    self.router().send_to(shard, ReadError::Closed, request, receiver)
                })
                .collect();
            let mut values = vec![None; keys.len()];
            for (reply, places) in pending.into_iter().zip(places.values()) {
                for (value, &place) in reply.into_future().await?.into_iter().zip(places) {
                    values[place] = value;
                }
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
        self.inner.store.coordination.decisions.read(attempt).await
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
        self.inner.store.coordination.run(self.router(), parts).await;
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
        Ok(summarize(self.with_combine_counts(shards), &self.inner.store.placement))
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
        for pending in self.router().broadcast_async(ReadError::Closed, |reply| Request::Scrub { reply }).await
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
        self.inner.store.close()
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
        self.router().send_exec(shard, ExecRequest::new(&locks, exec));
    }

    /// As `exec`, awaiting room in the shard's queue instead of blocking the thread.
    pub async fn exec_async(&self, shard: u32, locks: Vec<Vec<u8>>, exec: Box<dyn Exec>) {
        assert!(shard < self.shard_count(), "exec sent to shard {shard} of {}", self.shard_count());
        self.router().send_exec_async(shard, ExecRequest::new(&locks, exec)).await;
    }

    /// As `exec_async` for several programs on one shard, queued in order as one message: a
    /// caller with many programs for a shard (the server's wave of pipelined commands) crosses
    /// to it, and wakes it, once.
    pub async fn exec_many_async(&self, shard: u32, execs: Vec<ExecRequest>) {
        assert!(shard < self.shard_count(), "exec sent to shard {shard} of {}", self.shard_count());
        self.router().send_execs_async(shard, execs).await;
    }

    /// Hands the shards' event loops to the caller, to run on threads of its own
    /// (thread-per-core: a server runs each shard as a task of a network thread, so a command
    /// whose key lives there is served without crossing threads). Returns the loops of the
    /// shards whose engine can share a thread (the native engine on io_uring); the others keep
    /// theirs. Each loop must then be driven (`ShardLoop::turn`) until it answers
    /// `ShardTurn::Stopped`, which it does once the store is closed (`close` waits for that) or
    /// every handle is gone.
    pub fn hand_off_shards(&self) -> Vec<ShardLoop> {
        (0..self.shard_count()).filter_map(|shard| self.router().hand_off(shard)).collect()
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
            return self.inner.store.coordination.write(self.router(), parts).await;
        }
        let Some((_, ops)) = parts.pop() else { return Ok(()) };
        let (reply, receiver) = futures::channel::oneshot::channel();
        let shard = shard_of(ops[0].key(), self.shard_count());
        let request = Request::Batch { ops, reply };
        self.router().send_to_async(shard, WriteError::Closed, request, receiver).await.into_future().await
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
        for pending in self.router().broadcast_async(ReadError::Closed, |reply| Request::Stats { reply }).await
        {
            shards.push(pending.into_future().await?);
        }
        Ok(summarize(self.with_combine_counts(shards), &self.inner.store.placement))
    }

    pub async fn flush_async(&self) -> Result<(), WriteError> {
        let mut result = Ok(());
        for pending in self.router().broadcast_async(WriteError::Closed, |reply| Request::Flush { reply }).await
        {
            if let Err(err) = pending.into_future().await {
                result = Err(err);
            }
        }
        result
    }
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
