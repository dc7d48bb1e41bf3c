//! What the engine knows about each key's versions beyond the index (`Seqs`): the sequence
//! counter and the numbers handed out whose records are not durable yet (the durable
//! watermark), the writes of each key in flight (`Flight`), the stale copies counted under each
//! key's hash, and the tombstones kept to outlive them.
//!
//! Invariants (4 and 5 of `mod.rs`):
//! - Sequence numbers are handed out in increasing order, each once; only a number handed out
//!   (or seen on disk, below `next_seq` after recovery) is held (asserted in `hold`), and each
//!   hold is finished once (asserted in `finish`). The durable watermark is below every number
//!   held, so a record carrying it never claims an unfinished write durable.
//! - A key has a `Flight` exactly while writes of it are in flight; `applied_seq` only grows, so
//!   only the highest completed write is applied, whatever the completion order (asserted in
//!   `flight_end`: no flight ends that did not begin).
//! - `stale_counts[hash]` is the number of stale copies of keys with that hash still on disk (or
//!   still named by a batch or committed part record); it never goes below zero (asserted in
//!   `release_stale`) and a zero count is removed.
//! - A tombstone is kept in `tombstone_guards` only while its key has a stale copy counted or
//!   a write in flight (asserted in `guard`; `releasable_guards` hands back the others).

use std::collections::BTreeMap;

use super::format::Loc;
use super::Key;
use crate::hash::HashMap;

/// The hash under which stale copies of a key are counted (invariant 4).
pub(super) fn key_hash(key: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(key, 0x5741_4c45)
}

/// Writes of one key that are in flight (invariant 5).
#[derive(Default)]
struct Flight {
    in_flight: u32,
    applied_seq: u64,
}

pub(super) struct Seqs {
    next_seq: u64,
    /// `next_seq` when the shard opened: nothing was written since if it is still the same.
    next_seq_at_open: u64,
    /// Sequence numbers handed out whose records are not yet durable (count of holders). Every
    /// record carries the durable watermark (below the smallest of these) so that recovery can
    /// tell a damaged record that was once durable (bit rot) from a torn in-flight write.
    unfinished_seqs: BTreeMap<u64, u32>,
    flights: HashMap<Key, Flight>,
    stale_counts: HashMap<u64, u32>,
    /// Tombstones kept (with their keys) until no older copy of the key can remain on disk.
    tombstone_guards: HashMap<u64, Vec<(Loc, Key)>>,
}

impl Seqs {
    pub(super) fn new() -> Seqs {
        Seqs {
            next_seq: 1,
            next_seq_at_open: 0,
            unfinished_seqs: BTreeMap::new(),
            flights: HashMap::default(),
            stale_counts: HashMap::default(),
            tombstone_guards: HashMap::default(),
        }
    }

    /// Recovery saw sequence numbers up to `seen_max`: new ones start above.
    pub(super) fn restart_above(&mut self, seen_max: u64) {
        self.next_seq = seen_max + 1;
    }

    /// The number the next `take` hands out.
    pub(super) fn next(&self) -> u64 {
        self.next_seq
    }

    /// The shard is open: what is written from now on counts as written since open.
    pub(super) fn mark_open(&mut self) {
        self.next_seq_at_open = self.next_seq;
    }

    pub(super) fn written_since_open(&self) -> bool {
        self.next_seq != self.next_seq_at_open
    }

    pub(super) fn take(&mut self) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        seq
    }

    /// Every sequence number up to this one belongs to a record that is durable (or to nothing
    /// on disk). Written into each record's `aux`.
    pub(super) fn durable_watermark(&self) -> u64 {
        match self.unfinished_seqs.keys().next() {
            Some(&oldest) => oldest - 1,
            None => self.next_seq - 1,
        }
    }

    /// The record of `seq` is not durable yet: the watermark stays below it until `finish`.
    pub(super) fn hold(&mut self, seq: u64) {
        assert!(
            seq > 0 && seq < self.next_seq,
            "held sequence number {seq} was never handed out (next is {})",
            self.next_seq
        );
        *self.unfinished_seqs.entry(seq).or_default() += 1;
    }

    pub(super) fn finish(&mut self, seq: u64) {
        let holders =
            self.unfinished_seqs.get_mut(&seq).expect("finishing a sequence number never held");
        *holders -= 1;
        if *holders == 0 {
            self.unfinished_seqs.remove(&seq);
        }
    }

    pub(super) fn flight_begin(&mut self, key: &[u8]) {
        match self.flights.get_mut(key) {
            Some(flight) => flight.in_flight += 1,
            None => {
                self.flights.insert(key.into(), Flight { in_flight: 1, applied_seq: 0 });
            }
        }
    }

    /// Ends one in-flight write of `key`; returns whether `seq` is the newest applied so far.
    pub(super) fn flight_end(&mut self, key: &[u8], seq: u64, applied: bool) -> bool {
        let flight = self.flights.get_mut(key).expect("a write of a key with no flight");
        assert!(flight.in_flight > 0);
        flight.in_flight -= 1;
        let newest = applied && seq > flight.applied_seq;
        if newest {
            flight.applied_seq = seq;
        }
        if flight.in_flight == 0 {
            self.flights.remove(key);
        }
        newest
    }

    /// Whether a write of `key` is in flight.
    pub(super) fn in_flight(&self, key: &[u8]) -> bool {
        self.flights.contains_key(key)
    }

    /// One more stale copy of a key with hash `hash` is on disk.
    pub(super) fn count_stale(&mut self, hash: u64) {
        *self.stale_counts.entry(hash).or_default() += 1;
    }

    /// One stale copy under `hash` is gone; returns whether none is left.
    pub(super) fn release_stale(&mut self, hash: u64) -> bool {
        let count = self.stale_counts.get_mut(&hash).expect("released a stale copy never counted");
        *count -= 1;
        if *count == 0 {
            self.stale_counts.remove(&hash);
            return true;
        }
        false
    }

    pub(super) fn has_stale(&self, hash: u64) -> bool {
        self.stale_counts.contains_key(&hash)
    }

    /// Keeps the tombstone of `key` at `loc` until no older copy of the key can remain.
    pub(super) fn guard(&mut self, hash: u64, loc: Loc, key: Key) {
        assert!(
            self.stale_counts.contains_key(&hash) || self.flights.contains_key(&key),
            "a tombstone kept at {loc:?} with nothing for it to outlive"
        );
        self.tombstone_guards.entry(hash).or_default().push((loc, key));
    }

    /// Whether a tombstone is kept under `hash`.
    pub(super) fn has_guards(&self, hash: u64) -> bool {
        self.tombstone_guards.contains_key(&hash)
    }

    /// Whether the tombstone of `key` at `loc` is kept.
    pub(super) fn guards_at(&self, loc: Loc, key: &[u8]) -> bool {
        (self.tombstone_guards.get(&key_hash(key)))
            .is_some_and(|guards| guards.iter().any(|(at, k)| *at == loc && **k == *key))
    }

    /// Whether a tombstone of `key` is kept (anywhere).
    pub(super) fn guards_key(&self, key: &[u8]) -> bool {
        (self.tombstone_guards.get(&key_hash(key)))
            .is_some_and(|guards| guards.iter().any(|(_, k)| **k == *key))
    }

    /// The kept tombstone of `key` at `from` moved to `to` (the collector's move is durable).
    pub(super) fn move_guard(&mut self, key: &[u8], from: Loc, to: Loc) {
        let guards = self.tombstone_guards.get_mut(&key_hash(key)).expect("a kept tombstone");
        let guard = guards.iter_mut().find(|(at, k)| *at == from && **k == *key);
        guard.expect("a kept tombstone").0 = to;
    }

    /// Takes the tombstones kept under `hash` that may go: none while a stale copy under it
    /// remains, and not those whose key still has a write in flight (it would land as a stale
    /// copy with nothing above it). Returns their slots, to be freed.
    pub(super) fn releasable_guards(&mut self, hash: u64) -> Vec<Loc> {
        if self.stale_counts.contains_key(&hash) {
            return Vec::new();
        }
        let Some(tombstones) = self.tombstone_guards.remove(&hash) else { return Vec::new() };
        let (waiting, free): (Vec<_>, Vec<_>) =
            tombstones.into_iter().partition(|(_, key)| self.flights.contains_key(key));
        if !waiting.is_empty() {
            self.tombstone_guards.insert(hash, waiting);
        }
        free.into_iter().map(|(tombstone, _)| tombstone).collect()
    }

    /// Tombstones kept, for the stats.
    pub(super) fn tombstones_held(&self) -> u64 {
        self.tombstone_guards.values().map(|locs| locs.len() as u64).sum()
    }
}
