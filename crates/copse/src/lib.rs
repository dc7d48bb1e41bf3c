//! copse: a persistent key-value store for fast SSDs.
//!
//! Start with [`Db`] (`interfaces/db.rs`), then `ARCHITECTURE.md` for the reading order.
//! Layers, top to bottom: `interfaces` → `store` → `router` → `shard` → `engine` → `device`.
//!
//! The public API is what this file exports: [`Db`] and its [`Options`], the errors, the
//! figures `stats` returns, the limits ([`limits`]), the device contract for embedders who bring
//! their own storage ([`device`]: [`Storage`], [`BlockDevice`]), the offline check, and the exec
//! programs the Redis server runs ([`exec`]). Every layer module is `pub(crate)`; the `testing`
//! cargo feature, which the crate's own tests, benches and fuzz targets turn on, opens them (and
//! adds the simulated device and the fuzz entry points) so that tests can reach internals.

/// Declares a layer module: crate-private, public under the `testing` feature.
macro_rules! layer {
    ($(#[$attr:meta])* $name:ident) => {
        $(#[$attr])*
        #[cfg(feature = "testing")]
        pub mod $name;
        $(#[$attr])*
        #[cfg(not(feature = "testing"))]
        pub(crate) mod $name;
    };
}

#[cfg(any(test, feature = "testing"))]
pub mod alloc_count;

// The library's unit tests measure what their structures allocate
// (`alloc_count::thread_allocated_bytes`); a test target that sets its own allocator is not
// this one.
#[cfg(test)]
#[global_allocator]
static COUNTING_ALLOCATOR: alloc_count::CountingAllocator = alloc_count::CountingAllocator;
pub mod device;
layer!(engine);
layer!(error);
#[cfg(any(test, feature = "testing"))]
pub mod fuzz;
layer!(hash);
layer!(interfaces);
pub mod limits;
layer!(router);
layer!(shard);
layer!(store);

pub use device::{
    AlignedBuf, Backend, BlockDevice, DeviceError, DeviceStats, DirStorage, FaultPoint, FileId,
    IoCompletion, IoKind, IoObserver, IoRequest, Storage, WriteDurability,
};
pub use engine::batch_codec::encoded_batch_bytes;
pub use engine::check::{FileReport, HeaderState, Problem, ShardReport, SlotCounts};
pub use engine::input::{check_batch, check_key, check_value, check_write};
pub use engine::placement::{AppendFigures, Placement, PlacementSetting};
pub use engine::{
    BatchOp, ClassStats, EngineKind, KeyValue, RecoveryStats, ScrubReport, ShardStats,
};
pub use error::{Error, InputError, OpenError, ReadError, WriteError};
pub use interfaces::check::{check_store, CheckOptions, CheckReport, ManifestSummary};
pub use interfaces::db::{Db, ScrubRun, StoreStats, WriteBatch};
pub use shard::{ShardLoop, ShardTurn, ShardWait};
pub use store::manifest::{read_manifest, KeyHash, Manifest};
pub use store::{Options, StorePlacement};

/// Exec programs: small state machines that run atomically inside one shard (read, decide,
/// write one all-or-nothing batch, repeat), sent with [`Db::exec`]; and the atomic programs
/// over several shards ([`Db::exec_atomic`]). The Redis server runs every command
/// as one. Semantics: `shard/exec.rs` and `router/txn.rs`.
pub mod exec {
    pub use crate::router::txn::AtomicExec;
    pub use crate::shard::exec::{apply as apply_to_overlay, overlay_ops, Overlay};
    pub use crate::shard::exec::{
        lock_ids, Exec, ExecRequest, ExecStep, ExecView, LockIds, ReadOp, ReadOps, ReadResult,
        ReadResults, StepInput, Vote,
    };
    pub use crate::shard::sequence::{
        merge_read, plan_read, OverlayRead, ScanOver, Sequence, SequenceOutcome, COUNTS_BACKGROUND,
    };
}
