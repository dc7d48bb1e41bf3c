//! The per-shard index: an ordered map from the full key to the item's location and the
//! sequence number of the record there. `Index` is the `CompactIndex` (`compact.rs`: keys
//! front-coded in sorted blocks with a hash directory for point lookups, ~29 B per item for
//! YCSB keys); `BTreeIndex`, the std B-tree of boxed keys it replaced (73-82 B per item), stays
//! (`btree.rs`) as the reference that `examples/index_bench.rs` measures against
//! (docs/index-design.md).
//!
//! The sequence number lets every read (and the scrub) tell the record the index expects from an
//! older record of the same key still in that slot: a write the device acknowledged but never
//! stored (a lost or misdirected write) is then reported as corrupt, never returned as the
//! item's value.
//!
//! Full keys, not prefixes: KVell's 8-byte prefixes made two keys with a common prefix collide
//! (and the process exit). Both indexes answer from full key bytes held in memory, with no I/O.
//! The map is ordered so scans walk it directly.
//!
//! `BTreeIndex` reports memory as an estimate: the B-tree's entry (boxed key pointer and length,
//! 8-byte location) with the tree's node overhead at its typical fill, plus the key's heap
//! allocation rounded up to the allocator's 16-byte granularity. `tests/index_memory.rs` checks
//! the estimates of both against a counting allocator.

use super::format::Loc;
use crate::engine::is_empty_range;

// The B-tree the compact index replaced: a reference for the benchmark and the memory test,
// not part of the store.
#[cfg(any(test, feature = "testing"))]
mod btree;
pub mod compact;

#[cfg(any(test, feature = "testing"))]
pub use btree::BTreeIndex;
pub use compact::CompactIndex;
pub(crate) use compact::prefetch;

/// The index the native engine uses.
pub type Index = CompactIndex;

/// Where a key's live record is, and the seq that record carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    pub loc: Loc,
    pub seq: u64,
}
