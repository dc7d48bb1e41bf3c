//! `BTreeIndex`: the std B-tree of boxed full keys, the engine's index until issue 22, kept as
//! the reference `examples/index_bench.rs` measures the compact index against. Memory is an
//! estimate (see the header of `mod.rs`), checked by `tests/index_memory.rs`.

use std::collections::BTreeMap;
use std::ops::Bound;

use super::{is_empty_range, Entry};
use crate::engine::native::format::Loc;

/// Bytes a B-tree entry costs inside its node, with node headers and ~70% fill spread over
/// entries (std's B-tree: 11 entries per node, 32-byte entries here: key pointer and length,
/// location, seq).
const ENTRY_BYTES_ESTIMATE: u64 = 50;
/// Heap bytes a boxed key of `len` bytes costs.
fn key_allocation_bytes(len: usize) -> u64 {
    (len as u64).div_ceil(16) * 16
}

/// The B-tree index of boxed full keys (the engine's index until issue 22).
#[derive(Default)]
pub struct BTreeIndex {
    map: BTreeMap<Box<[u8]>, Entry>,
    key_heap_bytes: u64,
}

impl BTreeIndex {
    pub fn get(&self, key: &[u8]) -> Option<Loc> {
        self.map.get(key).map(|entry| entry.loc)
    }

    pub fn entry(&self, key: &[u8]) -> Option<Entry> {
        self.map.get(key).copied()
    }

    pub fn contains(&self, key: &[u8]) -> bool {
        self.map.contains_key(key)
    }

    /// Points `key` at the record `seq` at `loc`; returns the previous entry (callers assert
    /// what its seq must be: lower for a new version, the same for a moved record).
    pub fn insert(&mut self, key: &[u8], loc: Loc, seq: u64) -> Option<Entry> {
        let entry = Entry { loc, seq };
        if let Some(slot) = self.map.get_mut(key) {
            return Some(std::mem::replace(slot, entry));
        }
        self.key_heap_bytes += key_allocation_bytes(key.len());
        self.map.insert(key.into(), entry);
        None
    }

    pub fn remove(&mut self, key: &[u8]) -> Option<Loc> {
        let entry = self.map.remove(key)?;
        self.key_heap_bytes -= key_allocation_bytes(key.len());
        Some(entry.loc)
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    #[cfg(any(test, feature = "testing"))]
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Up to `limit` keys in the range, in order, with their entries.
    pub fn range(
        &self,
        start: Bound<&[u8]>,
        end: Bound<&[u8]>,
        limit: usize,
    ) -> Vec<(Box<[u8]>, Entry)> {
        if is_empty_range(start, end) {
            return Vec::new();
        }
        self.map
            .range::<[u8], _>((start, end))
            .take(limit)
            .map(|(key, entry)| (key.clone(), *entry))
            .collect()
    }

    /// Keys in the range, counting no further than `limit`.
    pub fn count(&self, start: Bound<&[u8]>, end: Bound<&[u8]>, limit: usize) -> usize {
        if is_empty_range(start, end) {
            return 0;
        }
        self.map.range::<[u8], _>((start, end)).take(limit).count()
    }

    /// The digest of every live item (key and seq) that a clean close records.
    pub fn digest(&self) -> crate::engine::native::format::LiveDigest {
        let mut digest = crate::engine::native::format::LiveDigest::default();
        for (key, entry) in &self.map {
            digest.add(key, entry.seq);
        }
        digest
    }

    /// Estimated heap bytes of the index.
    pub fn memory_bytes(&self) -> u64 {
        self.map.len() as u64 * ENTRY_BYTES_ESTIMATE + self.key_heap_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_sharing_a_long_prefix_stay_distinct() {
        let mut index = BTreeIndex::default();
        index.insert(b"user000000001", Loc::new(1, 1, 0), 7);
        index.insert(b"user000000002", Loc::new(1, 2, 0), 8);
        assert_eq!(index.get(b"user000000001"), Some(Loc::new(1, 1, 0)));
        assert_eq!(index.get(b"user000000002"), Some(Loc::new(1, 2, 0)));
        assert_eq!(index.entry(b"user000000001").map(|entry| entry.seq), Some(7));
        assert_eq!(index.len(), 2);
    }

    #[test]
    fn range_is_ordered_limited_and_tolerates_inverted_bounds() {
        let mut index = BTreeIndex::default();
        for i in 0..10u8 {
            index.insert(&[b'k', i], Loc::new(0, i as u64, 0), i as u64);
        }
        let keys: Vec<_> = index
            .range(Bound::Included(&[b'k', 2][..]), Bound::Excluded(&[b'k', 8][..]), 3)
            .into_iter()
            .map(|(key, _)| key[1])
            .collect();
        assert_eq!(keys, vec![2, 3, 4]);
        assert!(index.range(Bound::Included(&b"z"[..]), Bound::Included(&b"a"[..]), 10).is_empty());
        assert!(index.range(Bound::Excluded(&b"k"[..]), Bound::Excluded(&b"k"[..]), 10).is_empty());
    }

    #[test]
    fn memory_estimate_follows_inserts_and_removes() {
        let mut index = BTreeIndex::default();
        index.insert(b"abc", Loc::new(0, 0, 0), 1);
        let one = index.memory_bytes();
        assert!(one >= 16 + ENTRY_BYTES_ESTIMATE);
        index.remove(b"abc");
        assert_eq!(index.memory_bytes(), 0);
    }
}
