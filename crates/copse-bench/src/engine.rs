//! The engines under test, behind one blocking interface that many client threads call at once.
//!
//! `copse` is the native engine through its public API (`copse::Db`), with the placement the
//! store chooses by itself (`auto`); `copse-in-place` and `copse-append` force one placement on
//! every in-page size class (docs/placement.md). `rocksdb` and
//! `rocksdb-relaxed` are one RocksDB instance through the `rocksdb` crate; `rocksdb-sharded` is
//! copse's router and shards over one RocksDB instance per shard (copse's RocksDB engine, p2KVS).
//! The three are built only with the `rocksdb` cargo feature (a bundled RocksDB build takes ~20
//! minutes on 2 cores; `make bench` builds it).
//!
//! Fairness rules every engine follows (docs/benchmarks.md repeats them): the same cache budget
//! (`cache_bytes`); a write returns only when the engine's durability promise holds (for `copse`
//! and `rocksdb`: on the device; `rocksdb-relaxed` is labelled as not durable); values are
//! incompressible random bytes, and compression is off where an engine has it.

use std::path::{Path, PathBuf};

use copse::{Db, Options, PlacementSetting};

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("engine {0:?} is not built into this binary: rebuild with `--features rocksdb` (`make bench` does)")]
    NotBuilt(String),
    #[error("unknown engine {0:?} (known: copse, copse-in-place, copse-append, rocksdb, rocksdb-relaxed, rocksdb-sharded)")]
    Unknown(String),
    #[error("opening {engine} at {dir}: {message}")]
    Open { engine: String, dir: String, message: String },
    #[error("{engine}: {message}")]
    Operation { engine: String, message: String },
}

/// Which engine to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngineKind {
    /// The native engine; the setting is the placement its in-page classes are created with
    /// (`Auto`: what the store's write probe picks).
    Copse(PlacementSetting),
    /// RocksDB with the write-ahead log synced on every write batch: durable like copse.
    Rocksdb,
    /// RocksDB with the WAL written but not synced: a write can be lost on power failure.
    RocksdbRelaxed,
    /// copse's router and shards over one RocksDB per shard (`copse::EngineKind::RocksDb`): each
    /// shard's round of writes is one synced WriteBatch, a run of gets one MultiGet.
    RocksdbSharded,
}

impl EngineKind {
    pub fn parse(name: &str) -> Result<EngineKind, EngineError> {
        match name {
            "copse" => Ok(EngineKind::Copse(PlacementSetting::Auto)),
            "copse-in-place" => Ok(EngineKind::Copse(PlacementSetting::InPlace)),
            "copse-append" => Ok(EngineKind::Copse(PlacementSetting::Append)),
            "rocksdb" => Ok(EngineKind::Rocksdb),
            "rocksdb-relaxed" => Ok(EngineKind::RocksdbRelaxed),
            "rocksdb-sharded" => Ok(EngineKind::RocksdbSharded),
            other => Err(EngineError::Unknown(other.to_string())),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            EngineKind::Copse(PlacementSetting::Auto) => "copse",
            EngineKind::Copse(PlacementSetting::InPlace) => "copse-in-place",
            EngineKind::Copse(PlacementSetting::Append) => "copse-append",
            EngineKind::Rocksdb => "rocksdb",
            EngineKind::RocksdbRelaxed => "rocksdb-relaxed",
            EngineKind::RocksdbSharded => "rocksdb-sharded",
        }
    }

    /// Engines compiled into this binary.
    pub fn built() -> Vec<EngineKind> {
        let mut kinds = vec![
            EngineKind::Copse(PlacementSetting::Auto),
            EngineKind::Copse(PlacementSetting::InPlace),
            EngineKind::Copse(PlacementSetting::Append),
        ];
        if cfg!(feature = "rocksdb") {
            kinds.extend([
                EngineKind::Rocksdb,
                EngineKind::RocksdbRelaxed,
                EngineKind::RocksdbSharded,
            ]);
        }
        kinds
    }

    /// Whether an acknowledged write survives power loss.
    pub fn durable(self) -> bool {
        !matches!(self, EngineKind::RocksdbRelaxed)
    }
}

/// How to open an engine.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    pub kind: EngineKind,
    /// The engine's own directory (created; the caller removes it).
    pub dir: PathBuf,
    /// Cache budget: copse's page cache, RocksDB's block cache.
    pub cache_bytes: usize,
    /// copse shards (threads); `None` is one per core.
    pub shards: Option<usize>,
    /// copse's space ceiling for append classes; `None` is copse's default.
    pub space_amplification_max: Option<f64>,
    /// RocksDB background jobs (flush and compaction threads); `None` is one per core.
    pub background_jobs: Option<usize>,
}

/// Figures an engine knows about itself (beyond what the process counters show).
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct EngineFigures {
    pub items: Option<u64>,
    /// copse: bytes of in-memory index per item.
    pub index_bytes_per_item: Option<f64>,
    /// I/Os the engine itself counted (copse's device layer), if it counts them.
    pub device_reads: Option<u64>,
    pub device_writes: Option<u64>,
    pub device_bytes_written: Option<u64>,
    /// copse: device bytes its slabs wrote per user byte, over the store's life (its own count,
    /// beside the process counters' figure in each phase).
    #[serde(default)]
    pub write_amplification: Option<f64>,
    /// copse: the placement asked for and what each in-page class got, e.g.
    /// `auto: in-place 0-5, append 6-12`.
    #[serde(default)]
    pub placement: Option<String>,
    /// copse with `auto`: the write probe's sequential-over-random page throughput ratio.
    #[serde(default)]
    pub probe_sequential_over_random: Option<f64>,
    /// copse: page cache hits over page lookups, over the store's life.
    #[serde(default)]
    pub cache_hit_rate: Option<f64>,
    /// copse: how its `get` callers reached their shards, since the store was opened.
    #[serde(default)]
    pub combining: Option<CombiningFigures>,
    /// copse: records its append classes moved, since the store was opened.
    #[serde(default)]
    pub moves: Option<MoveFigures>,
}

/// Records copse's append classes moved, summed over shards and classes (`AppendFigures`).
#[derive(Clone, Copy, Debug, Default, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct MoveFigures {
    /// Moved by the collector, emptying blocks.
    pub collected: u64,
    /// Scans whose scattered items were queued to be put side by side.
    pub cluster_runs: u64,
    /// Moved side by side for scans.
    pub clustered: u64,
}

/// Flat combining's counts summed over copse's shards (`ShardStats` has their meaning).
#[derive(Clone, Copy, Debug, Default, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct CombiningFigures {
    /// Gets whose caller ran its shard's turns itself.
    pub combined: u64,
    /// Gets whose caller found the loop held and woke the shard instead.
    pub found_busy: u64,
    /// Reads callers took from their turns and performed themselves.
    pub reads_taken: u64,
    /// Callers that left held-back I/O for the shard's thread to submit.
    pub left_io_for_thread: u64,
}

/// A key-value engine as the harness drives it: blocking calls, from many threads at once.
pub trait BenchEngine: Send + Sync {
    /// The value's length, or `None` when the key is absent.
    fn read(&self, key: &[u8]) -> Result<Option<usize>, EngineError>;
    /// Inserts or overwrites; returns once durable (as the engine promises).
    fn write(&self, key: &[u8], value: &[u8]) -> Result<(), EngineError>;
    /// Reads up to `items` items in key order from `start`; returns how many it read.
    fn scan(&self, start: &[u8], items: usize) -> Result<usize, EngineError>;
    fn figures(&self) -> Result<EngineFigures, EngineError>;
    /// Finishes the background work the requests so far caused (RocksDB: memtable flushes and
    /// compactions), so that the next phase does not pay for this one. The runner measures it
    /// and charges it to the phase that caused it.
    fn settle(&self) -> Result<(), EngineError>;
    /// Makes everything durable and releases the store.
    fn close(&self) -> Result<(), EngineError>;
}

/// Opens the configured engine in `config.dir`.
pub fn open(config: &EngineConfig) -> Result<Box<dyn BenchEngine>, EngineError> {
    std::fs::create_dir_all(&config.dir).map_err(|err| open_error(config, err))?;
    match config.kind {
        EngineKind::Copse(placement) => {
            Ok(Box::new(CopseEngine::open(config, copse::EngineKind::Native, placement)?))
        }
        #[cfg(feature = "rocksdb")]
        EngineKind::RocksdbSharded => Ok(Box::new(CopseEngine::open(
            config,
            copse::EngineKind::RocksDb,
            PlacementSetting::default(),
        )?)),
        #[cfg(feature = "rocksdb")]
        EngineKind::Rocksdb | EngineKind::RocksdbRelaxed => {
            Ok(Box::new(rocks::RocksEngine::open(config)?))
        }
        #[cfg(not(feature = "rocksdb"))]
        other => Err(EngineError::NotBuilt(other.name().to_string())),
    }
}

fn open_error(config: &EngineConfig, err: impl std::fmt::Display) -> EngineError {
    EngineError::Open {
        engine: config.kind.name().to_string(),
        dir: config.dir.display().to_string(),
        message: err.to_string(),
    }
}

fn operation_error(engine: &str, err: impl std::fmt::Display) -> EngineError {
    EngineError::Operation { engine: engine.to_string(), message: err.to_string() }
}

/// copse through its public API, with its defaults except the cache budget and shard count:
/// the native engine (`copse`) or the RocksDB engine (`rocksdb-sharded`).
pub struct CopseEngine {
    db: Db,
    name: &'static str,
    kind: copse::EngineKind,
}

impl CopseEngine {
    fn open(
        config: &EngineConfig,
        engine: copse::EngineKind,
        placement: PlacementSetting,
    ) -> Result<CopseEngine, EngineError> {
        let mut options =
            Options { cache_bytes: config.cache_bytes, engine, placement, ..Options::default() };
        options.show_progress = false;
        if let Some(shards) = config.shards {
            options.shards = shards;
        }
        if let Some(ratio) = config.space_amplification_max {
            options.space_amplification_max = ratio;
        }
        let db = Db::open(&config.dir, options).map_err(|err| open_error(config, err))?;
        Ok(CopseEngine { db, name: config.kind.name(), kind: engine })
    }
}

impl BenchEngine for CopseEngine {
    fn read(&self, key: &[u8]) -> Result<Option<usize>, EngineError> {
        let value = self.db.get(key).map_err(|err| operation_error(self.name, err))?;
        Ok(value.map(|value| value.len()))
    }

    fn write(&self, key: &[u8], value: &[u8]) -> Result<(), EngineError> {
        self.db.put(key, value).map_err(|err| operation_error(self.name, err))
    }

    fn scan(&self, start: &[u8], items: usize) -> Result<usize, EngineError> {
        let found =
            self.db.scan(start.to_vec().., items).map_err(|err| operation_error(self.name, err))?;
        Ok(found.len())
    }

    fn figures(&self) -> Result<EngineFigures, EngineError> {
        let stats = self.db.stats().map_err(|err| operation_error(self.name, err))?;
        // Over RocksDB, copse's device layer sees no I/O and holds no index: those figures are
        // RocksDB's, which the process counters measure.
        let native = self.kind == copse::EngineKind::Native;
        Ok(EngineFigures {
            items: Some(stats.items),
            index_bytes_per_item: native.then_some(stats.index_bytes_per_item),
            device_reads: native.then_some(stats.device.reads),
            device_writes: native.then_some(stats.device.writes),
            device_bytes_written: native.then_some(stats.device.bytes_written),
            write_amplification: native.then_some(stats.write_amplification),
            placement: native.then(|| placement_summary(&stats.placement)),
            probe_sequential_over_random: stats.placement.probe_sequential_over_random,
            cache_hit_rate: native.then_some(stats.cache_hit_rate),
            combining: native.then(|| {
                stats.shards.iter().fold(CombiningFigures::default(), |sum, shard| {
                    CombiningFigures {
                        combined: sum.combined + shard.requests_combined,
                        found_busy: sum.found_busy + shard.combine_found_busy,
                        reads_taken: sum.reads_taken + shard.combine_reads_taken,
                        left_io_for_thread: sum.left_io_for_thread
                            + shard.combine_left_io_for_thread,
                    }
                })
            }),
            moves: native.then(|| {
                let classes = stats.shards.iter().flat_map(|shard| shard.classes.iter());
                classes.fold(MoveFigures::default(), |sum, class| MoveFigures {
                    collected: sum.collected + class.append.gc_slots_moved,
                    cluster_runs: sum.cluster_runs + class.append.cluster_runs,
                    clustered: sum.clustered + class.append.cluster_slots_moved,
                })
            }),
        })
    }

    /// The native engine has no background work (a write is at its final place when
    /// acknowledged); the RocksDB engine waits for its instances' flushes and compactions.
    fn settle(&self) -> Result<(), EngineError> {
        self.db.settle().map_err(|err| operation_error(self.name, err))
    }

    fn close(&self) -> Result<(), EngineError> {
        self.db.close().map_err(|err| operation_error(self.name, err))
    }
}

/// The placement a store asked for and the classes each placement got, in runs of class ids.
fn placement_summary(placement: &copse::StorePlacement) -> String {
    let asked = placement.asked.map_or("unrecorded".to_string(), |asked| asked.to_string());
    let mut runs: Vec<(copse::Placement, usize, usize)> = Vec::new();
    for (class, got) in placement.classes.iter().enumerate() {
        match runs.last_mut() {
            Some((last, _, end)) if last == got && *end + 1 == class => *end = class,
            _ => runs.push((*got, class, class)),
        }
    }
    let runs: Vec<String> =
        runs.iter()
            .map(|(got, start, end)| {
                if start == end {
                    format!("{got} {start}")
                } else {
                    format!("{got} {start}-{end}")
                }
            })
            .collect();
    format!("{asked}: {}", runs.join(", "))
}

/// Bytes the files under `dir` occupy on disk (allocated blocks, not apparent sizes).
pub fn disk_bytes(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|entry| match entry.metadata() {
            Ok(meta) if meta.is_dir() => disk_bytes(&entry.path()),
            Ok(meta) => meta.blocks() * 512,
            Err(_) => 0,
        })
        .sum()
}

#[cfg(feature = "rocksdb")]
mod rocks {
    //! RocksDB as the issue configures the baseline: 4 KiB blocks, direct reads and direct
    //! flush/compaction I/O, an LRU block cache of the shared budget, a 10-bit bloom filter (what
    //! any tuned deployment uses for point reads), no compression (values are random), and the
    //! WAL synced on every write batch (`rocksdb`) or not synced (`rocksdb-relaxed`).
    //! Memtables are charged to the same budget (a write buffer manager over the block cache),
    //! as copse's dirty pages live in its page cache: otherwise RocksDB's default 2 x 64 MiB of
    //! memtables would hold a large part of a small dataset outside the budget.
    use super::*;
    use rocksdb::{
        BlockBasedOptions, Cache, DBCompressionType, WaitForCompactOptions, WriteBufferManager,
        WriteOptions, DB,
    };

    /// Share of the budget memtables may take (charged to the block cache).
    const MEMTABLE_BUDGET_DIVISOR: usize = 2;
    /// One memtable is this share of the budget, so two fit in the memtables' share.
    const MEMTABLE_BYTES_DIVISOR: usize = 4;

    /// Bloom filter bits per key: RocksDB's commonly recommended setting (~1% false positives).
    const BLOOM_BITS_PER_KEY: f64 = 10.0;
    /// RocksDB's block size, matched to copse's page size.
    const BLOCK_BYTES: usize = 4096;

    pub struct RocksEngine {
        db: DB,
        name: &'static str,
        /// Made once: each `WriteOptions` is a C object, not worth a malloc per write.
        write_options: WriteOptions,
    }

    impl RocksEngine {
        pub fn open(config: &EngineConfig) -> Result<RocksEngine, EngineError> {
            let cache = Cache::new_lru_cache(config.cache_bytes);
            let mut table = BlockBasedOptions::default();
            table.set_block_size(BLOCK_BYTES);
            table.set_block_cache(&cache);
            table.set_bloom_filter(BLOOM_BITS_PER_KEY, false);
            let mut options = rocksdb::Options::default();
            options.create_if_missing(true);
            let memtables = WriteBufferManager::new_write_buffer_manager_with_cache(
                config.cache_bytes / MEMTABLE_BUDGET_DIVISOR,
                false,
                cache.clone(),
            );
            options.set_write_buffer_manager(&memtables);
            options.set_write_buffer_size(config.cache_bytes / MEMTABLE_BYTES_DIVISOR);
            options.set_block_based_table_factory(&table);
            options.set_use_direct_reads(true);
            options.set_use_direct_io_for_flush_and_compaction(true);
            options.set_compression_type(DBCompressionType::None);
            let cores = std::thread::available_parallelism().map_or(2, |cores| cores.get());
            options.set_max_background_jobs(config.background_jobs.unwrap_or(cores) as i32);
            let db = DB::open(&options, &config.dir).map_err(|err| open_error(config, err))?;
            let mut write_options = WriteOptions::default();
            write_options.set_sync(config.kind == EngineKind::Rocksdb);
            Ok(RocksEngine { db, name: config.kind.name(), write_options })
        }
    }

    impl BenchEngine for RocksEngine {
        fn read(&self, key: &[u8]) -> Result<Option<usize>, EngineError> {
            let value = self.db.get_pinned(key).map_err(|err| operation_error(self.name, err))?;
            Ok(value.map(|value| value.len()))
        }

        fn write(&self, key: &[u8], value: &[u8]) -> Result<(), EngineError> {
            self.db
                .put_opt(key, value, &self.write_options)
                .map_err(|err| operation_error(self.name, err))
        }

        fn scan(&self, start: &[u8], items: usize) -> Result<usize, EngineError> {
            let mut iterator = self.db.raw_iterator();
            iterator.seek(start);
            let mut found = 0;
            while found < items && iterator.valid() {
                // Touch the value as a reader would.
                std::hint::black_box(iterator.value());
                found += 1;
                iterator.next();
            }
            iterator.status().map_err(|err| operation_error(self.name, err))?;
            Ok(found)
        }

        fn figures(&self) -> Result<EngineFigures, EngineError> {
            let items = self
                .db
                .property_int_value("rocksdb.estimate-num-keys")
                .map_err(|err| operation_error(self.name, err))?;
            Ok(EngineFigures { items, ..EngineFigures::default() })
        }

        fn settle(&self) -> Result<(), EngineError> {
            let mut options = WaitForCompactOptions::default();
            options.set_flush(true);
            self.db.wait_for_compact(&options).map_err(|err| operation_error(self.name, err))
        }

        fn close(&self) -> Result<(), EngineError> {
            self.db.flush_wal(true).map_err(|err| operation_error(self.name, err))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use copse::{Placement, StorePlacement};

    #[test]
    fn engine_names_round_trip() {
        for kind in EngineKind::built() {
            assert_eq!(EngineKind::parse(kind.name()).unwrap(), kind);
        }
        assert_eq!(
            EngineKind::parse("copse-append").unwrap(),
            EngineKind::Copse(PlacementSetting::Append)
        );
        assert!(EngineKind::parse("copse-sideways").is_err());
    }

    #[test]
    fn placement_summary_lists_runs_of_classes() {
        let mut classes = vec![Placement::InPlace; 13];
        classes[6..12].fill(Placement::Append);
        let placement = StorePlacement {
            asked: Some(PlacementSetting::Auto),
            classes,
            probe_sequential_over_random: Some(9.5),
        };
        assert_eq!(placement_summary(&placement), "auto: in-place 0-5, append 6-11, in-place 12");
        let unrecorded =
            StorePlacement { asked: None, classes: vec![Placement::InPlace; 1], ..placement };
        assert_eq!(placement_summary(&unrecorded), "unrecorded: in-place 0");
    }
}
