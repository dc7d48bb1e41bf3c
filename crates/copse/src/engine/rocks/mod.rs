//! The RocksDB engine (p2KVS): one RocksDB instance per shard, in `rocksdb/shard-NNN` under the
//! store, each driven only by its shard thread. The router, shard loop and exec programs are the
//! same as for the native engine; what p2KVS adds over a plain RocksDB is the access layer in
//! front of it (hash-partitioned workers with their own queues and opportunistic batching).
//!
//! How the shard loop's rounds map onto RocksDB:
//! - every write of a round (puts, deletes, batches, from plain requests and exec programs alike)
//!   goes into one `WriteBatch`, written with `sync = true` when the round ends: one WAL append
//!   and one fsync for the whole round (group commit), so a write is answered only when durable;
//! - a run of gets becomes one `multi_get`, each key with its own result buffer (p2KVS's public
//!   harness read one key's buffer for all keys of a multi-get; here each answer is its own);
//! - scans and the exec programs' index questions use an iterator over the instance.
//!
//! Invariants:
//! 1. A write is answered only after the synced `WriteBatch` holding it returned Ok; when it
//!    fails, every write of that batch is answered with the error and the store is poisoned
//!    (later writes are refused), as after a failed flush in the native engine.
//! 2. A read sees only written batches: writes of the current round are invisible until the
//!    round's batch is durable, as in the native engine (a write is visible once durable).
//! 3. A delete answers whether the key existed just before it, counting the earlier writes of
//!    its own round (`round_state`), so deletes in one round answer as if run one by one.
//! 4. Parts of cross-shard batches (`engine/part.rs`) live in their own column family,
//!    `PARTS_COLUMN_FAMILY`, keyed by the gsn (8 bytes, big-endian), so no read, scan or count
//!    of the default family sees them. Prepare, commit (the operations plus the part rewritten
//!    as committed) and forget each ride the round's one synced `WriteBatch`, so each is atomic
//!    and durable when answered.
//!
//! Every engine call here is synchronous: the shard thread waits for RocksDB, and RocksDB's own
//! background threads (flushes, compactions) do the rest. The one thing the engine waits for
//! across rounds is a settle (RocksDB's background work to finish): it looks each
//! `ROCKSDB_SETTLE_POLL_MS` through `next_deadline`, so the shard sleeps in between and keeps
//! serving requests; a scrub moves a step each round (`has_work_ready`). The RocksDB crate's
//! API used here is the part common to rocksdb 0.20 (which links Debian's librocksdb 7.8, for
//! the tests in CI) and 0.25 (bundled RocksDB 11, for every published benchmark); see
//! docs/engines.md.

use std::collections::HashMap;
use std::ops::Bound;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rocksdb::{BlockBasedOptions, Cache, DBCompressionType, Options, ReadOptions, WriteBatch, DB};

use crate::engine::part::{self, PartRecord, PartState};
use crate::engine::{
    BatchOp, KeyValue, RecoveryStats, Reply, Request, ScrubReport, ShardEngine, ShardStats,
};
use crate::error::{OpenError, ReadError, WriteError};
use crate::limits::{
    ROCKSDB_BLOCK_BYTES, ROCKSDB_BLOOM_BITS_PER_KEY, ROCKSDB_MEMTABLE_BUDGET_DIVISOR,
    ROCKSDB_SETTLE_POLL_MS, ROCKSDB_SETTLE_SECONDS_MAX, SCRUB_ITEMS_PER_STEP_MAX,
};

/// What every shard's instance shares: the block cache (one budget for the store, as the native
/// engine's page cache is one budget split over shards).
#[derive(Clone)]
pub struct RocksShared {
    cache: Cache,
    /// Memtable bytes of one instance (RocksDB keeps up to two per instance: one filling, one
    /// being flushed).
    write_buffer_bytes: usize,
}

/// `Cache::new_lru_cache` returns the cache itself in rocksdb 0.25 and a `Result` in 0.20; the
/// engine builds with either (see the module comment).
trait IntoCache {
    fn into_cache(self) -> Result<Cache, String>;
}

impl IntoCache for Cache {
    fn into_cache(self) -> Result<Cache, String> {
        Ok(self)
    }
}

impl<E: std::fmt::Display> IntoCache for Result<Cache, E> {
    fn into_cache(self) -> Result<Cache, String> {
        self.map_err(|err| err.to_string())
    }
}

impl RocksShared {
    /// Splits `cache_bytes` between the block cache (three quarters, shared by every shard's
    /// instance) and memtables (a quarter: two per instance of `cache_bytes / 8 / shards`), so
    /// that together they stay within the budget. (A single RocksDB can charge its memtables to
    /// the block cache with a WriteBufferManager; rocksdb 0.20, which the tests link, has no
    /// binding for it, so the split is fixed here.) Index and filter blocks stay outside the
    /// cache, RocksDB's default, as in the benchmark's single RocksDB.
    pub fn new(cache_bytes: usize, shards: usize) -> Result<RocksShared, OpenError> {
        let cache = Cache::new_lru_cache((cache_bytes / 4 * 3).max(1 << 20))
            .into_cache()
            .map_err(OpenError::Engine)?;
        let write_buffer_bytes =
            (cache_bytes / ROCKSDB_MEMTABLE_BUDGET_DIVISOR / shards.max(1)).max(1 << 20);
        Ok(RocksShared { cache, write_buffer_bytes })
    }
}

/// The directory of shard `shard`'s instance, relative to the store.
pub fn shard_dir(store: &Path, shard: u32) -> PathBuf {
    store.join(super::ROCKSDB_DIR).join(format!("shard-{shard:03}"))
}

/// RocksDB options for one shard's instance.
fn db_options(shared: &RocksShared, create_if_missing: bool) -> Options {
    let mut table = BlockBasedOptions::default();
    table.set_block_size(ROCKSDB_BLOCK_BYTES);
    table.set_block_cache(&shared.cache);
    table.set_bloom_filter(ROCKSDB_BLOOM_BITS_PER_KEY, false);
    let mut options = Options::default();
    options.create_if_missing(create_if_missing);
    options.set_block_based_table_factory(&table);
    options.set_compression_type(DBCompressionType::None);
    options.set_write_buffer_size(shared.write_buffer_bytes);
    options.set_max_write_buffer_number(2);
    // Reads and background I/O bypass the page cache, like the native engine's O_DIRECT: the
    // memory budget is the block cache, not whatever the kernel keeps.
    options.set_use_direct_reads(true);
    options.set_use_direct_io_for_flush_and_compaction(true);
    options
}

/// The column family holding parts of cross-shard batches (invariant 4).
pub const PARTS_COLUMN_FAMILY: &str = "copse-parts";

fn part_key(gsn: u64) -> [u8; 8] {
    gsn.to_be_bytes()
}

/// Settings of one shard's engine.
pub struct RocksConfig {
    pub shard_id: u32,
    pub store_dir: PathBuf,
    pub shared: RocksShared,
    /// Shared by all shards: once any write fails, every shard refuses writes.
    pub poisoned: Arc<AtomicBool>,
    /// Create the instance if it does not exist: only while the store is being created (see
    /// `CREATED_MARKER`); later a missing instance is lost data, and the open is refused.
    pub create_if_missing: bool,
}

/// The file, in `rocksdb/`, that says every instance of the store was created: `Db::open` writes
/// it (durably) after the first open's shards all opened, before any write is accepted. Until it
/// exists, instances are created as needed (a crash during creation lost no data, since no write
/// was accepted); once it exists, a missing instance directory refuses the open instead of
/// coming back empty.
pub const CREATED_MARKER: &str = "CREATED";

/// Whether the RocksDB store in `store` finished its creation.
pub fn creation_finished(store: &Path) -> bool {
    store.join(super::ROCKSDB_DIR).join(CREATED_MARKER).is_file()
}

/// Writes the creation marker durably (the file, then its directory).
pub fn mark_creation_finished(store: &Path) -> Result<(), OpenError> {
    let dir = store.join(super::ROCKSDB_DIR);
    let path = dir.join(CREATED_MARKER);
    let device_error =
        |err: std::io::Error| crate::device::DeviceError::from_io(&err, path.display().to_string());
    let file = std::fs::File::create(&path).map_err(device_error)?;
    file.sync_all().map_err(device_error)?;
    crate::device::files::fsync_dir(&dir)?;
    Ok(())
}

/// The round's writes, applied together when the round ends.
enum Waiter {
    Put(Reply<(), WriteError>),
    Delete { reply: Reply<bool, WriteError>, existed: bool },
    Batch(Reply<(), WriteError>),
}

pub struct RocksEngine {
    shard_id: u32,
    db: DB,
    poisoned: Arc<AtomicBool>,
    batch: WriteBatch,
    waiters: Vec<Waiter>,
    /// Whether each key written this round exists after the round's writes so far (invariant 3).
    round_state: HashMap<Vec<u8>, bool>,
    open_seconds: f64,
    writes_applied: u64,
    write_batches: u64,
    /// The parts stored in `PARTS_COLUMN_FAMILY`, by gsn (as of the round's batch).
    parts: HashMap<u64, PartRecord>,
    /// What the open found there, for `recovered_parts`.
    recovered_parts: Vec<PartRecord>,
    /// The online scrub under way: the key to resume after (`None`: from the first), what it
    /// found so far, and who waits for it.
    scrub: Option<RocksScrub>,
    /// Settles waiting for the instance's background work to finish.
    settle: Option<RocksSettle>,
}

struct RocksSettle {
    replies: Vec<Reply<(), WriteError>>,
    /// When the instance is looked at next.
    next_look: Instant,
    /// Past this the settles are answered even if work still runs (`ROCKSDB_SETTLE_SECONDS_MAX`).
    give_up: Instant,
}

struct RocksScrub {
    after: Option<Vec<u8>>,
    report: ScrubReport,
    replies: Vec<Reply<ScrubReport, ReadError>>,
}

impl RocksEngine {
    pub fn open(config: RocksConfig) -> Result<RocksEngine, OpenError> {
        let started = Instant::now();
        let dir = shard_dir(&config.store_dir, config.shard_id);
        if config.create_if_missing {
            crate::device::files::create_dirs_durably(&config.store_dir, &dir)?;
        } else if !dir.is_dir() {
            return Err(OpenError::Engine(format!(
                "{}: the instance of shard {} is missing (the store was created with it)",
                dir.display(),
                config.shard_id
            )));
        }
        let mut options = db_options(&config.shared, config.create_if_missing);
        // Stores made before parts existed get the family on their next open.
        options.create_missing_column_families(true);
        // Every column family takes the instance's options: `DB::open_cf` would give each
        // RocksDB's defaults (64 MiB memtables, a block cache of its own, compression), outside
        // the store's budget.
        let families = [rocksdb::DEFAULT_COLUMN_FAMILY_NAME, PARTS_COLUMN_FAMILY]
            .map(|name| rocksdb::ColumnFamilyDescriptor::new(name, options.clone()));
        let db = DB::open_cf_descriptors(&options, &dir, families)
            .map_err(|err| OpenError::Engine(format!("{}: {err}", dir.display())))?;
        let recovered_parts = read_parts(&db)
            .map_err(|err| OpenError::Engine(format!("{}: {err}", dir.display())))?;
        Ok(RocksEngine {
            shard_id: config.shard_id,
            db,
            poisoned: config.poisoned,
            batch: WriteBatch::default(),
            waiters: Vec::new(),
            scrub: None,
            settle: None,
            round_state: HashMap::new(),
            open_seconds: started.elapsed().as_secs_f64(),
            writes_applied: 0,
            write_batches: 0,
            parts: recovered_parts.iter().map(|part| (part.gsn, part.clone())).collect(),
            recovered_parts,
        })
    }

    fn read_error(&self, err: rocksdb::Error) -> ReadError {
        match err.kind() {
            rocksdb::ErrorKind::Corruption => ReadError::Corrupt {
                shard: self.shard_id,
                location: "in its RocksDB instance".into(),
                defect: err.to_string(),
            },
            _ => ReadError::Engine { shard: self.shard_id, message: err.to_string() },
        }
    }

    fn write_error(&self, err: &rocksdb::Error) -> WriteError {
        let message = err.to_string();
        if message.contains("No space left") {
            WriteError::NoSpace(crate::device::DeviceError::NoSpace {
                what: format!("shard {} RocksDB instance: {message}", self.shard_id),
            })
        } else {
            WriteError::Engine { shard: self.shard_id, message }
        }
    }

    fn is_poisoned(&self) -> bool {
        self.poisoned.load(Ordering::Acquire)
    }

    /// Whether `key` exists, counting this round's earlier writes.
    fn exists_now(&self, key: &[u8]) -> Result<bool, ReadError> {
        if let Some(&exists) = self.round_state.get(key) {
            return Ok(exists);
        }
        self.db.get_pinned(key).map(|value| value.is_some()).map_err(|err| self.read_error(err))
    }

    /// Adds one write to the round's batch.
    fn write(&mut self, request: Request) {
        if self.is_poisoned() {
            return refuse(request, WriteError::Poisoned);
        }
        match request {
            Request::Put { key, value, reply } => {
                self.batch.put(&key, &value);
                self.round_state.insert(key, true);
                self.waiters.push(Waiter::Put(reply));
            }
            Request::Delete { key, reply } => match self.exists_now(&key) {
                Ok(existed) => {
                    self.batch.delete(&key);
                    self.round_state.insert(key, false);
                    self.waiters.push(Waiter::Delete { reply, existed });
                }
                Err(err) => {
                    let message = err.to_string();
                    let _ = reply.send(Err(WriteError::Engine { shard: self.shard_id, message }));
                }
            },
            Request::Batch { ops, reply } => {
                for op in ops {
                    match op {
                        BatchOp::Put { key, value } => {
                            self.batch.put(&key, &value);
                            self.round_state.insert(key, true);
                        }
                        BatchOp::Delete { key } => {
                            self.batch.delete(&key);
                            self.round_state.insert(key, false);
                        }
                    }
                }
                self.waiters.push(Waiter::Batch(reply));
            }
            Request::PreparePart { gsn, participants, ops, reply } => {
                let record = PartRecord { state: PartState::Prepared, gsn, participants, ops };
                self.put_part(&record);
                self.parts.insert(gsn, record);
                self.waiters.push(Waiter::Batch(reply));
            }
            Request::CommitPart { gsn, reply } => {
                let Some(record) = self.parts.get_mut(&gsn) else {
                    let _ = reply.send(Err(WriteError::UnknownPart { shard: self.shard_id, gsn }));
                    return;
                };
                record.state = PartState::Committed;
                let record = record.clone();
                for op in &record.ops {
                    match op {
                        BatchOp::Put { key, value } => {
                            self.batch.put(key, value);
                            self.round_state.insert(key.clone(), true);
                        }
                        BatchOp::Delete { key } => {
                            self.batch.delete(key);
                            self.round_state.insert(key.clone(), false);
                        }
                    }
                }
                self.put_part(&record);
                self.waiters.push(Waiter::Batch(reply));
            }
            Request::ForgetPart { gsn, reply } => {
                if self.parts.remove(&gsn).is_none() {
                    let _ = reply.send(Ok(()));
                    return;
                }
                let family = self.db.cf_handle(PARTS_COLUMN_FAMILY).expect("opened with parts");
                self.batch.delete_cf(family, part_key(gsn));
                self.waiters.push(Waiter::Batch(reply));
            }
            other => unreachable!("not a write: {:?}", other.kind()),
        }
    }

    /// Adds a part's stored form to the round's batch (invariant 4).
    fn put_part(&mut self, record: &PartRecord) {
        let value = part::encode(record.state, record.gsn, &record.participants, &record.ops);
        let family = self.db.cf_handle(PARTS_COLUMN_FAMILY).expect("opened with parts");
        self.batch.put_cf(family, part_key(record.gsn), value);
    }

    /// Writes the round's batch, synced, and answers its writers (invariant 1).
    fn commit_round(&mut self) {
        if self.waiters.is_empty() {
            return;
        }
        let batch = std::mem::take(&mut self.batch);
        let waiters = std::mem::take(&mut self.waiters);
        self.round_state.clear();
        let mut options = rocksdb::WriteOptions::default();
        options.set_sync(true);
        let result = self.db.write_opt(batch, &options);
        if let Err(err) = &result {
            tracing::error!(shard = self.shard_id, %err, "RocksDB write failed; refusing writes");
            self.poisoned.store(true, Ordering::Release);
        } else {
            self.writes_applied += waiters.len() as u64;
            self.write_batches += 1;
        }
        for waiter in waiters {
            let failure = result.as_ref().err().map(|err| self.write_error(err));
            match waiter {
                Waiter::Put(reply) | Waiter::Batch(reply) => {
                    let _ = reply.send(failure.map_or(Ok(()), Err));
                }
                Waiter::Delete { reply, existed } => {
                    let _ = reply.send(failure.map_or(Ok(existed), Err));
                }
            }
        }
    }

    /// A run of gets as one multi-get; each key gets its own answer.
    fn get_run(&mut self, run: Vec<Request>) {
        let mut keys = Vec::with_capacity(run.len());
        let mut replies = Vec::with_capacity(run.len());
        for request in run {
            match request {
                Request::Get { key, reply } => {
                    keys.push(key);
                    replies.push(reply);
                }
                other => unreachable!("not a get: {:?}", other.kind()),
            }
        }
        let results = self.db.multi_get(&keys);
        assert_eq!(results.len(), replies.len(), "multi_get answered a different number of keys");
        for (result, reply) in results.into_iter().zip(replies) {
            let _ = reply.send(result.map_err(|err| self.read_error(err)));
        }
    }

    /// Iterates the range in key order, handing each item to `visit` until it returns false.
    fn iterate(
        &self,
        start: Bound<&[u8]>,
        end: Bound<&[u8]>,
        mut visit: impl FnMut(&[u8], &[u8]) -> bool,
    ) -> Result<(), ReadError> {
        let mut options = ReadOptions::default();
        options.set_verify_checksums(true);
        if let Bound::Excluded(end) = end {
            options.set_iterate_upper_bound(end.to_vec());
        }
        let mut iterator = self.db.raw_iterator_opt(options);
        match start {
            Bound::Included(start) | Bound::Excluded(start) => iterator.seek(start),
            Bound::Unbounded => iterator.seek_to_first(),
        }
        while iterator.valid() {
            let (Some(key), Some(value)) = (iterator.key(), iterator.value()) else { break };
            let past_end = matches!(end, Bound::Included(end) if key > end);
            let at_excluded_start = matches!(start, Bound::Excluded(start) if key == start);
            if past_end {
                break;
            }
            if !at_excluded_start && !visit(key, value) {
                return Ok(());
            }
            iterator.next();
        }
        iterator.status().map_err(|err| self.read_error(err))
    }

    fn scan(
        &self,
        start: Bound<Vec<u8>>,
        end: Bound<Vec<u8>>,
        limit: usize,
    ) -> Result<Vec<KeyValue>, ReadError> {
        let mut items = Vec::new();
        if limit == 0 {
            return Ok(items);
        }
        self.iterate(as_ref(&start), as_ref(&end), |key, value| {
            items.push((key.to_vec(), value.to_vec()));
            items.len() < limit
        })?;
        Ok(items)
    }

    fn property(&self, name: &str) -> u64 {
        self.db.property_int_value(name).ok().flatten().unwrap_or(0)
    }

    /// The shard's figures. `items` is exact: the instance's keys are counted by iterating them
    /// (O(items) per call), because RocksDB's own estimate counts overwritten and deleted keys
    /// until compaction drops them, and an exact running count would cost a read per write.
    fn stats(&self) -> ShardStats {
        let items = self.count_keys(Bound::Unbounded, Bound::Unbounded, usize::MAX) as u64;
        ShardStats {
            shard: self.shard_id,
            items,
            file_bytes: self.property("rocksdb.total-sst-files-size"),
            index_bytes: self.property("rocksdb.estimate-table-readers-mem")
                + self.property("rocksdb.cur-size-all-mem-tables"),
            recovery: RecoveryStats { seconds: self.open_seconds, ..RecoveryStats::default() },
            parts_held: self.parts.len() as u64,
            ..ShardStats::default()
        }
    }

    /// Whether the instance has a flush or compaction running or pending.
    fn background_busy(&self) -> bool {
        let busy = self.property("rocksdb.num-running-compactions")
            + self.property("rocksdb.num-running-flushes")
            + self.property("rocksdb.compaction-pending")
            + self.property("rocksdb.mem-table-flush-pending");
        busy > 0
    }

    /// Answers the settles once the instance has no background work running or pending, so a
    /// benchmark phase does not pay for the previous one's; bounded by
    /// `ROCKSDB_SETTLE_SECONDS_MAX`. Looks at most once per `ROCKSDB_SETTLE_POLL_MS`: the
    /// shard sleeps until `next_deadline` in between.
    fn settle_step(&mut self) {
        let Some(settle) = &mut self.settle else { return };
        let now = Instant::now();
        if now < settle.next_look {
            return;
        }
        if now < settle.give_up && self.background_busy() {
            let settle = self.settle.as_mut().expect("checked above");
            settle.next_look = now + Duration::from_millis(ROCKSDB_SETTLE_POLL_MS);
            return;
        }
        let result = if self.is_poisoned() { Err(WriteError::Poisoned) } else { Ok(()) };
        for reply in self.settle.take().expect("checked above").replies {
            let _ = reply.send(result.clone());
        }
    }
}

/// Every part stored in the instance (invariant 4).
fn read_parts(db: &DB) -> Result<Vec<PartRecord>, String> {
    let family = db.cf_handle(PARTS_COLUMN_FAMILY).ok_or("the parts column family is missing")?;
    let mut options = ReadOptions::default();
    options.set_verify_checksums(true);
    let mut iterator = db.raw_iterator_cf_opt(family, options);
    iterator.seek_to_first();
    let mut parts = Vec::new();
    while iterator.valid() {
        let (Some(key), Some(value)) = (iterator.key(), iterator.value()) else { break };
        let record = part::decode(value).map_err(|err| format!("part {key:?}: {err}"))?;
        if key != part_key(record.gsn) {
            return Err(format!("part stored under {key:?} names gsn {}", record.gsn));
        }
        parts.push(record);
        iterator.next();
    }
    iterator.status().map_err(|err| format!("reading parts failed: {err}"))?;
    Ok(parts)
}

impl RocksEngine {
    /// Reads the next `SCRUB_ITEMS_PER_STEP_MAX` items with RocksDB's block checksums verified;
    /// one step a round, so a scrub never holds the shard for long.
    fn scrub_step(&mut self) {
        let Some(mut scrub) = self.scrub.take() else { return };
        let mut options = ReadOptions::default();
        options.set_verify_checksums(true);
        options.fill_cache(false);
        let mut iterator = self.db.raw_iterator_opt(options);
        match &scrub.after {
            None => iterator.seek_to_first(),
            Some(key) => {
                iterator.seek(key);
                if iterator.key() == Some(key.as_slice()) {
                    iterator.next();
                }
            }
        }
        let mut taken = 0;
        while iterator.valid() && taken < SCRUB_ITEMS_PER_STEP_MAX {
            taken += 1;
            scrub.report.items_checked += 1;
            scrub.after = iterator.key().map(<[u8]>::to_vec);
            iterator.next();
        }
        let finished = match iterator.status() {
            Err(err) => {
                scrub.report.problem(format!(
                    "shard {}: reading after item {} failed: {err}",
                    self.shard_id, scrub.report.items_checked
                ));
                true
            }
            Ok(()) => !iterator.valid(),
        };
        drop(iterator);
        if finished {
            for reply in scrub.replies {
                let _ = reply.send(Ok(scrub.report.clone()));
            }
        } else {
            self.scrub = Some(scrub);
        }
    }
}

/// `copse check` of one shard's instance: opens it read-only and reads every item with block
/// checksums verified. Returns the live keys, or what went wrong.
pub fn check_instance(dir: &Path) -> Result<u64, String> {
    if !dir.is_dir() {
        return Err("the instance's directory is missing".into());
    }
    let families = DB::list_cf(&Options::default(), dir)
        .map_err(|err| format!("cannot list the instance's column families: {err}"))?;
    let db = DB::open_cf_for_read_only(&Options::default(), dir, &families, false)
        .map_err(|err| format!("cannot open the instance: {err}"))?;
    if families.iter().any(|name| name == PARTS_COLUMN_FAMILY) {
        read_parts(&db)?;
    }
    let mut options = ReadOptions::default();
    options.set_verify_checksums(true);
    let mut iterator = db.raw_iterator_opt(options);
    iterator.seek_to_first();
    let mut live_keys = 0;
    while iterator.valid() {
        live_keys += 1;
        iterator.next();
    }
    iterator.status().map_err(|err| format!("reading item {live_keys} failed: {err}"))?;
    Ok(live_keys)
}

fn as_ref(bound: &Bound<Vec<u8>>) -> Bound<&[u8]> {
    match bound {
        Bound::Included(key) => Bound::Included(key),
        Bound::Excluded(key) => Bound::Excluded(key),
        Bound::Unbounded => Bound::Unbounded,
    }
}

fn refuse(request: Request, err: WriteError) {
    match request {
        Request::Put { reply, .. }
        | Request::Batch { reply, .. }
        | Request::PreparePart { reply, .. }
        | Request::CommitPart { reply, .. }
        | Request::ForgetPart { reply, .. } => {
            let _ = reply.send(Err(err));
        }
        Request::Delete { reply, .. } => {
            let _ = reply.send(Err(err));
        }
        other => unreachable!("not a write: {:?}", other.kind()),
    }
}

impl ShardEngine for RocksEngine {
    fn shard_id(&self) -> u32 {
        self.shard_id
    }

    fn handle_run(&mut self, run: Vec<Request>) {
        match run.first().map(Request::kind) {
            Some(crate::engine::RequestKind::Get) => self.get_run(run),
            _ => {
                for request in run {
                    self.handle(request);
                }
            }
        }
    }

    fn handle(&mut self, request: Request) {
        match request {
            Request::Get { key, reply } => {
                let result = self.db.get(&key).map_err(|err| self.read_error(err));
                let _ = reply.send(result);
            }
            Request::MultiGet { keys, reply } => {
                // One thread runs the engine and applies a round's writes in one batch between
                // messages, so the keys are read at one moment.
                let results: Result<Vec<_>, _> = self.db.multi_get(&keys).into_iter().collect();
                let _ = reply.send(results.map_err(|err| self.read_error(err)));
            }
            write @ (Request::Put { .. }
            | Request::Delete { .. }
            | Request::Batch { .. }
            | Request::PreparePart { .. }
            | Request::CommitPart { .. }
            | Request::ForgetPart { .. }) => self.write(write),
            Request::Scan { start, end, limit, reply } => {
                let _ = reply.send(self.scan(start, end, limit));
            }
            Request::Flush { reply } => {
                // Every write is synced when its round ends; what was accepted before this flush
                // is durable once this round's batch is (it is written before the next message).
                self.commit_round();
                let _ =
                    reply.send(if self.is_poisoned() { Err(WriteError::Poisoned) } else { Ok(()) });
            }
            Request::Settle { reply } => {
                // The round's writes are accepted before the settle: their batch is written
                // when the round ends, before the settle first looks (`settle_step`).
                if self.is_poisoned() {
                    let _ = reply.send(Err(WriteError::Poisoned));
                    return;
                }
                let now = Instant::now();
                let settle = self.settle.get_or_insert_with(|| RocksSettle {
                    replies: Vec::new(),
                    next_look: now,
                    give_up: now + Duration::from_secs(ROCKSDB_SETTLE_SECONDS_MAX),
                });
                settle.replies.push(reply);
            }
            Request::Stats { reply } => {
                let _ = reply.send(Ok(self.stats()));
            }
            Request::Scrub { reply } => match &mut self.scrub {
                Some(scrub) => scrub.replies.push(reply),
                None => {
                    let report = ScrubReport::default();
                    self.scrub = Some(RocksScrub { after: None, report, replies: vec![reply] });
                }
            },
        }
    }

    fn end_round(&mut self) {
        self.commit_round();
        self.scrub_step();
        self.settle_step();
    }

    fn reap(&mut self, _wait: bool) {}

    fn is_idle(&self) -> bool {
        self.waiters.is_empty() && self.scrub.is_none() && self.settle.is_none()
    }

    fn has_io_in_flight(&self) -> bool {
        false
    }

    /// Writes of a round are written when it ends, and a scrub reads a step a round; a settle
    /// alone waits for its next look (`next_deadline`).
    fn has_work_ready(&self) -> bool {
        !self.waiters.is_empty() || self.scrub.is_some()
    }

    fn next_deadline(&self) -> Option<Instant> {
        self.settle.as_ref().map(|settle| settle.next_look)
    }

    fn recovered_parts(&self) -> Vec<PartRecord> {
        self.recovered_parts.clone()
    }

    /// A read of the instance (RocksDB keeps no full index in memory). A failed read is logged
    /// and answered "present", so that the exec's next step reads the key and reports the error.
    fn contains_key(&self, key: &[u8]) -> bool {
        match self.db.get_pinned(key) {
            Ok(value) => value.is_some(),
            Err(err) => {
                tracing::error!(shard = self.shard_id, %err, "RocksDB read failed in an index question");
                true
            }
        }
    }

    fn index_keys(&self, start: Bound<&[u8]>, end: Bound<&[u8]>, limit: usize) -> Vec<Vec<u8>> {
        let mut keys = Vec::new();
        if limit == 0 {
            return keys;
        }
        let result = self.iterate(start, end, |key, _| {
            keys.push(key.to_vec());
            keys.len() < limit
        });
        if let Err(err) = result {
            tracing::error!(shard = self.shard_id, %err, "RocksDB scan failed in an index question");
        }
        keys
    }

    fn count_keys(&self, start: Bound<&[u8]>, end: Bound<&[u8]>, limit: usize) -> usize {
        let mut count = 0;
        if limit == 0 {
            return count;
        }
        let result = self.iterate(start, end, |_, _| {
            count += 1;
            count < limit
        });
        if let Err(err) = result {
            tracing::error!(shard = self.shard_id, %err, "RocksDB scan failed in an index question");
        }
        count
    }

    fn close(&mut self) -> Result<(), WriteError> {
        self.commit_round();
        // The shard closes an idle engine, so no settle waits here; if one did, closing is as
        // settled as the instance will get.
        if let Some(settle) = self.settle.take() {
            let result = if self.is_poisoned() { Err(WriteError::Poisoned) } else { Ok(()) };
            for reply in settle.replies {
                let _ = reply.send(result.clone());
            }
        }
        if self.is_poisoned() {
            return Err(WriteError::Poisoned);
        }
        self.db.flush_wal(true).map_err(|err| self.write_error(&err))
    }
}
