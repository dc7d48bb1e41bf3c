//! Engines: what a shard runs its requests against. Today the native engine (KVell slabs);
//! the RocksDB and Dotori engines come with their issues behind the same request contract.
//!
//! The contract between a shard and its engine is the [`Request`] message: the engine answers
//! each request exactly once through its reply channel, and answers a write only when it is
//! durable.

pub mod input;
pub mod native;

use std::ops::Bound;

use futures::channel::oneshot;
use serde::Serialize;

use crate::device::DeviceStats;
use crate::error::{ReadError, WriteError};

pub type Reply<T, E> = oneshot::Sender<Result<T, E>>;

/// One operation of a write batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BatchOp {
    Put { key: Vec<u8>, value: Vec<u8> },
    Delete { key: Vec<u8> },
}

impl BatchOp {
    pub fn key(&self) -> &[u8] {
        match self {
            BatchOp::Put { key, .. } | BatchOp::Delete { key } => key,
        }
    }
}

pub type KeyValue = (Vec<u8>, Vec<u8>);

/// A message to a shard. Limits were checked by the caller.
pub enum Request {
    Get {
        key: Vec<u8>,
        reply: Reply<Option<Vec<u8>>, ReadError>,
    },
    Put {
        key: Vec<u8>,
        value: Vec<u8>,
        reply: Reply<(), WriteError>,
    },
    /// Answers whether the key existed.
    Delete {
        key: Vec<u8>,
        reply: Reply<bool, WriteError>,
    },
    /// All-or-nothing within the shard, also across a crash.
    Batch {
        ops: Vec<BatchOp>,
        reply: Reply<(), WriteError>,
    },
    /// The shard's first `limit` items in the range, in key order.
    Scan {
        start: Bound<Vec<u8>>,
        end: Bound<Vec<u8>>,
        limit: usize,
        reply: Reply<Vec<KeyValue>, ReadError>,
    },
    /// Answers once every write the shard accepted before it is durable.
    Flush {
        reply: Reply<(), WriteError>,
    },
    Stats {
        reply: Reply<ShardStats, ReadError>,
    },
}

impl Request {
    /// Requests of one kind form a run that the shard hands to its engine together.
    pub fn kind(&self) -> RequestKind {
        match self {
            Request::Get { .. } => RequestKind::Get,
            Request::Put { .. } | Request::Delete { .. } | Request::Batch { .. } => {
                RequestKind::Write
            }
            Request::Scan { .. } => RequestKind::Scan,
            Request::Flush { .. } | Request::Stats { .. } => RequestKind::Control,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestKind {
    Get,
    Write,
    Scan,
    Control,
}

/// What recovery found when the shard opened.
#[derive(Clone, Debug, Default, Serialize)]
pub struct RecoveryStats {
    pub bytes_scanned: u64,
    pub items: u64,
    pub stale_copies: u64,
    pub tombstones: u64,
    pub free_slots: u64,
    /// Slots whose bytes did not verify (torn writes, bit flips). Never indexed.
    pub torn_or_corrupt: u64,
    /// Keys whose newest record was durable once and is damaged now (bit rot): they read as
    /// corrupt until rewritten, never as an older value.
    pub damaged_items: u64,
    pub batches_replayed: u64,
    pub seconds: f64,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct ClassStats {
    pub class: u8,
    pub slot_bytes: u32,
    pub file_bytes: u64,
    pub slots_used: u64,
    pub free_in_memory: u64,
    pub free_on_disk: u64,
}

/// One shard's figures, for `copse stats`.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ShardStats {
    pub shard: u32,
    pub items: u64,
    pub file_bytes: u64,
    pub index_bytes: u64,
    pub cache_pages: u64,
    pub cache_capacity_pages: u64,
    pub cache_hits: u64,
    pub cache_misses: u64,
    pub device: DeviceStats,
    pub recovery: RecoveryStats,
    pub classes: Vec<ClassStats>,
    pub tombstones_held: u64,
}
