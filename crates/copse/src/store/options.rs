//! How to open a store: [`Options`], checked against the limits before anything is touched.

use crate::device::{Backend, WriteDurability};
use crate::engine::placement::{PlacementSetting, PLACED_CLASS_COUNT};
use crate::engine::EngineKind;
use crate::error::OpenError;
use crate::limits::{
    APPEND_BLOCK_PAGES_MAX, BATCH_RECORD_BYTES_MAX, BATCH_RECORD_BYTES_MIN, CACHE_BYTES_DEFAULT, IO_DEPTH_DEFAULT, IO_DEPTH_MAX, SHARDS_MAX,
    SPACE_AMPLIFICATION_MAX, SPACE_AMPLIFICATION_MIN,
};

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
    /// Per-class exceptions to `placement` (class id, setting), for classes whose slots are at
    /// most a page: the packed classes (36 to 75) of new stores, and the paged ones (0 to 12).
    pub placement_by_class: Vec<(u8, PlacementSetting)>,
    /// The collector keeps each append class's file under this many times its live slots
    /// (plus one growth step of the file), between `SPACE_AMPLIFICATION_MIN` and
    /// `SPACE_AMPLIFICATION_MAX`. Lower costs more collector writes.
    pub space_amplification_max: f64,
    /// Pages per block of an append class (the unit the collector empties and reuses).
    pub append_block_pages: u32,
    /// The largest value of one batch record (native engine): a batch encoded larger is recorded
    /// as a chain of records of at most this size. `BATCH_RECORD_BYTES_MAX` unless a test wants
    /// chains from small batches; `BATCH_RECORD_BYTES_MIN` at least.
    pub batch_record_bytes_max: usize,
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
            batch_record_bytes_max: BATCH_RECORD_BYTES_MAX,
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
        if !(BATCH_RECORD_BYTES_MIN..=BATCH_RECORD_BYTES_MAX).contains(&self.batch_record_bytes_max)
        {
            return Err(OpenError::InvalidOption(format!(
                "batch_record_bytes_max {} is out of range ({BATCH_RECORD_BYTES_MIN} to \
                 {BATCH_RECORD_BYTES_MAX})",
                self.batch_record_bytes_max
            )));
        }
        if let Some((class, _)) = self
            .placement_by_class
            .iter()
            .find(|(class, _)| !crate::engine::factory::class_has_placement(*class))
        {
            return Err(OpenError::InvalidOption(format!(
                "placement_by_class names class {class}, which has no placement (classes are 0 \
                 to {}; a class of multi-page slots is always in place)",
                PLACED_CLASS_COUNT - 1
            )));
        }
        Ok(())
    }
}
