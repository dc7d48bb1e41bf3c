//! Errors, one enum per operation family, all converting into [`Error`].

use crate::device::DeviceError;

/// A request that breaks a limit. Nothing was changed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InputError {
    #[error("key is empty (keys are {min} to {max} bytes)", min = crate::limits::KEY_BYTES_MIN, max = crate::limits::KEY_BYTES_MAX)]
    KeyEmpty,
    #[error("key of {bytes} bytes exceeds the limit of {max} bytes")]
    KeyTooLarge { bytes: usize, max: usize },
    #[error("value of {bytes} bytes exceeds the limit of {max} bytes")]
    ValueTooLarge { bytes: usize, max: usize },
    #[error("write batch of {ops} operations exceeds the limit of {max}")]
    BatchTooManyOps { ops: usize, max: usize },
    #[error("write batch of {bytes} encoded bytes exceeds the limit of {max} bytes")]
    BatchTooLarge { bytes: usize, max: usize },
    #[error("scan limit {limit} exceeds the maximum of {max} items")]
    ScanLimitTooLarge { limit: usize, max: usize },
    #[error("{reads} reads in one exec step exceed the limit of {max}")]
    TooManyReads { reads: usize, max: usize },
    #[error("a sequence of {steps} steps exceeds the limit of {max}")]
    SequenceTooLong { steps: usize, max: usize },
    #[error("a sequence's steps read {bytes} bytes, past the limit of {max}; nothing was written")]
    SequenceReadsTooLarge { bytes: usize, max: usize },
}

/// Opening (or creating) a store.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OpenError {
    #[error("store at {path} has {found} shards; it cannot be opened with {requested} (use the same count, or reshard)")]
    ShardCountMismatch { path: String, found: u32, requested: u32 },
    #[error("shard count {0} is out of range (1 to {max})", max = crate::limits::SHARDS_MAX)]
    ShardCountOutOfRange(usize),
    #[error("no store at {0} (and create_if_missing is off)")]
    NotFound(String),
    #[error("store at {0} is in use by another process")]
    Locked(String),
    #[error("manifest is corrupt: {0}")]
    CorruptManifest(String),
    #[error("slab file {file} has a bad header: {reason}")]
    CorruptSlabHeader { file: String, reason: String },
    #[error("device error while opening: {0}")]
    Device(#[from] DeviceError),
    #[error("invalid option: {0}")]
    InvalidOption(String),
    #[error("shard thread failed to start: {0}")]
    Thread(String),
    #[error(
        "store at {path} was created with the {found} engine; it cannot be opened with {requested}"
    )]
    EngineMismatch { path: String, found: crate::EngineKind, requested: crate::EngineKind },
    #[error("this build has no {0} engine (build with `--features rocksdb`)")]
    EngineUnavailable(crate::EngineKind),
    /// An engine that is not copse's own (RocksDB) failed to open; its message.
    #[error("engine failed to open: {0}")]
    Engine(String),
    /// Applying or erasing the parts of cross-shard batches that a crash interrupted failed.
    #[error("resolving interrupted cross-shard batches failed: {0}")]
    Batches(WriteError),
}

/// get, scan, stats.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ReadError {
    #[error(transparent)]
    Input(#[from] InputError),
    #[error("read failed: {0}")]
    Device(DeviceError),
    #[error("corrupt item at shard {shard} {location}: {defect}")]
    Corrupt { shard: u32, location: String, defect: String },
    /// An engine that is not copse's own (RocksDB) failed; its message.
    #[error("read failed in shard {shard}: {message}")]
    Engine { shard: u32, message: String },
    #[error("the store is closed")]
    Closed,
}

/// put, delete, write_batch, flush, close.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WriteError {
    #[error(transparent)]
    Input(#[from] InputError),
    #[error("the store refuses writes after an earlier write or flush failed (poisoned); reopen it to recover")]
    Poisoned,
    #[error("no space left on the device: {0}")]
    NoSpace(DeviceError),
    #[error("write failed: {0}")]
    Device(DeviceError),
    /// An engine that is not copse's own (RocksDB) failed; its message.
    #[error("write failed in shard {shard}: {message}")]
    Engine { shard: u32, message: String },
    /// A cross-shard batch was called off before it committed; nothing of it was applied.
    #[error("the cross-shard batch was aborted: {0}")]
    Aborted(String),
    /// A shard was asked to commit a cross-shard batch's part it does not hold (a bug).
    #[error("shard {shard} holds no part of batch {gsn}")]
    UnknownPart { shard: u32, gsn: u64 },
    #[error("the store is closed")]
    Closed,
}

impl WriteError {
    pub fn from_device(err: DeviceError) -> WriteError {
        match err {
            DeviceError::NoSpace { .. } => WriteError::NoSpace(err),
            other => WriteError::Device(other),
        }
    }
}

/// Any copse error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    #[error(transparent)]
    Open(#[from] OpenError),
    #[error(transparent)]
    Read(#[from] ReadError),
    #[error(transparent)]
    Write(#[from] WriteError),
    #[error(transparent)]
    Input(#[from] InputError),
}
