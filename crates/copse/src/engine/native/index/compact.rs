//! A compact per-shard index: full keys front-coded in sorted blocks, with a hash directory
//! beside them for point lookups. Same answers as `index::Index` (a std B-tree of boxed keys)
//! in about a third of the memory; `docs/index-design.md` has the options and the measurements.
//!
//! Layout (the block encoding and its grammar live in `compact/block.rs`):
//! - `blocks`: each block holds a run of consecutive keys in order, front-coded (each key is
//!   stored as the length it shares with the previous key of the block plus the rest), each
//!   followed by its location and seq. The first key of a block is stored whole. A block grows
//!   by rewriting it and splits in two past `block_bytes_max`.
//! - `fences`: an ordered map from each block's lower bound to the block, for scans and for
//!   placing a new key. The first block's fence is the empty key, the smallest key there is.
//! - `slots`: an open-addressing table (linear probing) with one 4-byte slot per key: the block
//!   that holds the key (24 bits) and 8 bits of the key's hash. A lookup hashes the key once,
//!   probes from its home slot and searches only the blocks whose 8 bits match, comparing full
//!   key bytes: the answer is exact, never a fingerprint's guess.
//!
//! Invariants:
//! - The fences partition the key space: block `b` with fence `f` holds exactly the keys `k`
//!   with `f <= k < f'` (`f'` the next fence), in strictly increasing order. The empty key is
//!   always a fence (of block 0 or whichever block took its place: it is never removed). A
//!   split's fence is the shortest key above the first half's last key and at or below the
//!   second half's first key, so fences of long keys stay short.
//! - Every key in block `b` owns a distinct slot `(b, hash bits)` reachable from its home slot
//!   without crossing an empty slot. Slots are not tied to one key: when two keys of a block
//!   share the 8 hash bits, moving or removing "the first matching slot" of either keeps the
//!   invariant (linear probing: the skipped slot lies on both keys' probe paths).
//! - At least one slot in eight is empty (`slots_used * 8 <= slots.len() * 7`), so every probe
//!   ends. Removed keys leave tombstones, counted in `slots_used` until the table is rebuilt.
//! - The seq of an entry is stored as a zigzag varint of its difference from the block's base
//!   (wrapping), so every u64 round-trips exactly; there is no overflow path to get wrong.
//! - `memory_bytes` is computed from the exact sizes of the heap blocks (block bytes, slot table,
//!   block list) plus an estimate for the fence map's B-tree nodes; `tests/index_memory.rs`
//!   checks it against a counting allocator.
//!
//! Limits: at most `BLOCKS_MAX` blocks (24-bit block numbers in a slot): ~16.7M blocks of tens
//! of keys each, far beyond what one shard holds in memory. Keys may be 0 to any length.

use std::collections::BTreeMap;
use std::ops::Bound;

mod block;

use super::{is_empty_range, Entry};
use crate::engine::native::format::{LiveDigest, Loc};
use block::{
    Reader, Writer, block_find, common_prefix, get_header, get_value, get_varint, put_key,
    put_value, skip_value,
};

/// A block splits when its encoding grows past this many bytes (tens of keys: a lookup reads
/// a few cache lines of one block; see docs/index-design.md for the sizes measured).
pub const BLOCK_BYTES_MAX_DEFAULT: usize = 1024;
/// Blocks one slot can name (24 bits, values 1..=0xFF_FFFE; 0 is empty, 0xFF_FFFF a tombstone).
const BLOCKS_MAX: usize = (1 << 24) - 2;
const SLOT_EMPTY: u32 = 0;
const SLOT_TOMBSTONE: u32 = u32::MAX;
const SLOTS_MIN: usize = 16;
/// Bytes one fence costs in its B-tree node beyond its key (entry of 24 bytes, node headers and
/// ~70% fill spread over entries).
const FENCE_ENTRY_BYTES_ESTIMATE: u64 = 40;

type Fence = Box<[u8]>;

pub struct CompactIndex {
    blocks: Vec<Box<[u8]>>,
    free_blocks: Vec<u32>,
    fences: BTreeMap<Box<[u8]>, u32>,
    slots: Vec<u32>,
    /// Slots that are not empty: live keys plus tombstones.
    slots_used: usize,
    items: usize,
    block_bytes_total: u64,
    fence_key_bytes: u64,
    block_bytes_max: usize,
    /// The slot-table hash's seed (`new_seed`).
    seed: u64,
    /// Inserts, updates and removes so far (`changes`).
    changes: u64,
    /// An entry's value being encoded before it is spliced in, kept between updates: one
    /// allocation per update less on the write path (`update_value`).
    value_scratch: Vec<u8>,
    /// Keys by their first byte (the empty key last), so "does any key start with this byte"
    /// costs no lookup (`has_first_byte`): what the Redis layer asks before every plain SET.
    keys_by_first_byte: Box<[u64; 257]>,
}

/// The `keys_by_first_byte` counter of `key`.
fn first_byte_bucket(key: &[u8]) -> usize {
    key.first().map_or(256, |&byte| byte as usize)
}

impl Default for CompactIndex {
    fn default() -> Self {
        Self::with_block_bytes_max(BLOCK_BYTES_MAX_DEFAULT)
    }
}

impl CompactIndex {
    /// An empty index whose blocks split past `block_bytes_max` (tests use small blocks to
    /// exercise splits and merges; the benchmark compares sizes).
    pub fn with_block_bytes_max(block_bytes_max: usize) -> Self {
        assert!(block_bytes_max >= 32, "blocks of {block_bytes_max} B cannot hold two keys");
        let first = Writer::new(0).finish();
        let mut fences = BTreeMap::new();
        fences.insert(Box::<[u8]>::from(&[][..]), 0u32);
        CompactIndex {
            block_bytes_total: first.len() as u64,
            blocks: vec![first],
            free_blocks: Vec::new(),
            fences,
            slots: vec![SLOT_EMPTY; SLOTS_MIN],
            slots_used: 0,
            items: 0,
            fence_key_bytes: 0,
            block_bytes_max,
            seed: new_seed(),
            changes: 0,
            value_scratch: Vec::new(),
            keys_by_first_byte: Box::new([0; 257]),
        }
    }

    /// Fills an empty index from `entries` in strictly increasing key order, block by block with
    /// no search per key (recovery sorts its keys once and calls this instead of one insert per
    /// key). Blocks are filled to three quarters, so later inserts do not split at once.
    /// REQUIRES: the index is empty; keys strictly increase (asserted).
    pub fn load_sorted<'a>(&mut self, entries: impl IntoIterator<Item = (&'a [u8], Entry)>) {
        assert!(self.is_empty(), "load_sorted fills an empty index");
        let fill = self.block_bytes_max * 3 / 4;
        // (fence, block bytes) in order.
        let mut blocks: Vec<(Fence, Box<[u8]>)> = Vec::new();
        let mut fence: Box<[u8]> = Box::default();
        let mut writer = Writer::new(0);
        let mut items = 0;
        for (key, entry) in entries {
            if writer.out.len() >= fill {
                assert!(writer.previous.as_slice() < key, "load_sorted: keys out of order");
                let length = common_prefix(&writer.previous, key) + 1;
                let next_fence: Box<[u8]> = key[..length].into();
                let full = std::mem::replace(&mut writer, Writer::new(0));
                blocks.push((std::mem::replace(&mut fence, next_fence), full.finish()));
            }
            writer.push(key, entry);
            self.keys_by_first_byte[first_byte_bucket(key)] += 1;
            items += 1;
        }
        blocks.push((fence, writer.finish()));
        self.blocks.clear();
        self.block_bytes_total = 0;
        self.fences.clear();
        for (fence, bytes) in blocks {
            let block = self.allocate_block(bytes);
            self.add_fence(&fence, block);
        }
        self.items = items;
        self.changes += 1;
        self.rebuild_slots(items);
    }

    pub fn get(&self, key: &[u8]) -> Option<Loc> {
        self.entry(key).map(|entry| entry.loc)
    }

    pub fn entry(&self, key: &[u8]) -> Option<Entry> {
        self.find(key, hash_key(self.seed, key)).map(|(_, entry, _)| entry)
    }

    /// The entries of `keys`, as `entry` answers each, with the lookups' memory accesses
    /// overlapped: every key's home slot is prefetched, then every matching block's pointer,
    /// then the start of every block, before any key is searched. A lookup's cost is its cache
    /// misses (slot, block pointer, block bytes), which one at a time are paid in series.
    pub fn entries(&self, keys: &[&[u8]], out: &mut Vec<Option<Entry>>) {
        let hashes: Vec<u64> = keys.iter().map(|key| hash_key(self.seed, key)).collect();
        for &hash in &hashes {
            prefetch(&self.slots[self.home(hash)]);
        }
        let mut blocks = Vec::with_capacity(keys.len());
        for &hash in &hashes {
            let slot = self.slots[self.home(hash)];
            let block = (slot != SLOT_EMPTY && slot != SLOT_TOMBSTONE && slot as u8 == hash as u8)
                .then(|| (slot >> 8) - 1);
            if let Some(block) = block {
                prefetch(&self.blocks[block as usize]);
            }
            blocks.push(block);
        }
        for block in blocks.iter().flatten() {
            let bytes = &self.blocks[*block as usize];
            for line in bytes.chunks(64).take(4) {
                prefetch(&line[0]);
            }
        }
        out.extend(keys.iter().zip(&hashes).map(|(key, &hash)| {
            self.find(key, hash).map(|(_, entry, _)| entry)
        }));
    }

    /// A count that moves with every insert, update and remove: an entry looked up while it
    /// read some value still stands exactly as long as this has not moved since (a read that
    /// waited for its page skips its second lookup).
    pub fn changes(&self) -> u64 {
        self.changes
    }

    pub fn contains(&self, key: &[u8]) -> bool {
        self.entry(key).is_some()
    }

    /// Points `key` at the record `seq` at `loc`; returns the previous entry.
    pub fn insert(&mut self, key: &[u8], loc: Loc, seq: u64) -> Option<Entry> {
        let entry = Entry { loc, seq };
        let hash = hash_key(self.seed, key);
        self.changes += 1;
        if let Some((block, old, value)) = self.find(key, hash) {
            self.update_value(block, value, entry);
            return Some(old);
        }
        self.reserve_slot();
        let block = self.block_for(key);
        let old = self.rewrite(block, key, Some(entry));
        assert!(old.is_none(), "the directory missed a key of block {block}");
        self.slot_insert(hash, block);
        self.items += 1;
        self.keys_by_first_byte[first_byte_bucket(key)] += 1;
        self.split_if_full(block);
        None
    }

    /// Points `key` at `loc` with the same seq if its entry is still `expected`, with one lookup
    /// (the collector's check and update of a moved record). Returns the entry the key had:
    /// `Some(expected)` when it was replaced.
    pub fn replace_if(&mut self, key: &[u8], expected: Entry, loc: Loc) -> Option<Entry> {
        let (block, old, value) = self.find(key, hash_key(self.seed, key))?;
        if old != expected {
            return Some(old);
        }
        self.changes += 1;
        self.update_value(block, value, Entry { loc, seq: old.seq });
        Some(old)
    }

    /// An update of a key found in `block`: only its value's bytes (`value`, where the lookup
    /// found them) are rewritten.
    fn update_value(&mut self, block: u32, value: std::ops::Range<usize>, entry: Entry) {
        let base = get_varint(&self.blocks[block as usize], &mut 0);
        let mut replacement = std::mem::take(&mut self.value_scratch);
        replacement.clear();
        put_value(&mut replacement, entry, base);
        self.splice(block, value, &replacement);
        self.value_scratch = replacement;
        self.split_if_full(block);
    }

    pub fn remove(&mut self, key: &[u8]) -> Option<Loc> {
        let hash = hash_key(self.seed, key);
        let (block, entry, _) = self.find(key, hash)?;
        self.changes += 1;
        let old = self.rewrite(block, key, None);
        assert_eq!(old, Some(entry));
        self.slot_move(hash, block, None);
        self.items -= 1;
        self.keys_by_first_byte[first_byte_bucket(key)] -= 1;
        self.merge_if_small(block, key);
        if self.slots.len() > SLOTS_MIN && self.items * 4 < self.slots.len() {
            self.rebuild_slots(self.items);
        }
        Some(entry.loc)
    }

    pub fn len(&self) -> usize {
        self.items
    }

    /// Whether a key starting with `byte` is indexed. No lookup: a count per first byte.
    pub fn has_first_byte(&self, byte: u8) -> bool {
        self.keys_by_first_byte[byte as usize] > 0
    }

    pub fn is_empty(&self) -> bool {
        self.items == 0
    }

    /// Up to `limit` keys in the range, in order, with their entries.
    pub fn range(
        &self,
        start: Bound<&[u8]>,
        end: Bound<&[u8]>,
        limit: usize,
    ) -> Vec<(Box<[u8]>, Entry)> {
        let mut out = Vec::new();
        self.walk(start, end, limit, |key, entry| out.push((key.into(), entry)));
        out
    }

    /// Keys in the range, counting no further than `limit`.
    pub fn count(&self, start: Bound<&[u8]>, end: Bound<&[u8]>, limit: usize) -> usize {
        self.walk(start, end, limit, |_, _| {})
    }

    /// The digest of every live item (key and seq) that a clean close records.
    pub fn digest(&self) -> LiveDigest {
        let mut digest = LiveDigest::default();
        self.walk(Bound::Unbounded, Bound::Unbounded, usize::MAX, |key, entry| {
            digest.add(key, entry.seq)
        });
        digest
    }

    /// Heap bytes of the index: exact for the blocks, the slot table and the block list; the
    /// fence map's nodes estimated.
    pub fn memory_bytes(&self) -> u64 {
        self.block_bytes_total
            + (self.blocks.capacity() * size_of::<Box<[u8]>>()) as u64
            + (self.free_blocks.capacity() * size_of::<u32>()) as u64
            + (self.slots.capacity() * size_of::<u32>()) as u64
            + self.fences.len() as u64 * FENCE_ENTRY_BYTES_ESTIMATE
            + self.fence_key_bytes
            + size_of::<[u64; 257]>() as u64
    }

    /// The block holding `key` and its entry: one hash, probes from the home slot, and a search
    /// of each block whose hash bits match.
    fn find(&self, key: &[u8], hash: u64) -> Option<(u32, Entry, std::ops::Range<usize>)> {
        let bits = hash as u8;
        let mut at = self.home(hash);
        loop {
            let slot = self.slots[at];
            if slot == SLOT_EMPTY {
                return None;
            }
            if slot != SLOT_TOMBSTONE && slot as u8 == bits {
                let block = (slot >> 8) - 1;
                if let Some((entry, value)) = block_find(&self.blocks[block as usize], key) {
                    return Some((block, entry, value));
                }
            }
            at += 1;
            if at == self.slots.len() {
                at = 0;
            }
        }
    }

    fn home(&self, hash: u64) -> usize {
        ((hash as u128 * self.slots.len() as u128) >> 64) as usize
    }

    /// The block whose range holds `key` (the last fence at or below it).
    fn block_for(&self, key: &[u8]) -> u32 {
        let (_, &block) = self
            .fences
            .range::<[u8], _>((Bound::Unbounded, Bound::Included(key)))
            .next_back()
            .expect("the empty key is always a fence");
        block
    }

    /// Sets `key` in `block` to `entry` (or removes it for `None`); returns the key's old
    /// entry. Splices the block: only the edited entry and the header of the entry after it
    /// (whose shared prefix changes) are re-encoded; an update whose value encodes to the same
    /// length is written in place.
    fn rewrite(&mut self, block: u32, key: &[u8], entry: Option<Entry>) -> Option<Entry> {
        let bytes = &self.blocks[block as usize];
        let mut pos = 0;
        let base = get_varint(bytes, &mut pos);
        let mut previous: Vec<u8> = Vec::new();
        let mut current: Vec<u8> = Vec::new();
        let mut replacement = Vec::with_capacity(key.len() + 40);
        // The edited region of `bytes`, [start, end), and the old entry.
        let (start, end, old) = loop {
            let start = pos;
            if pos == bytes.len() {
                // Past the last key: append.
                // A remove of a key the block does not hold changes nothing.
                let entry = entry?;
                put_key(&mut replacement, common_prefix(&current, key), key);
                put_value(&mut replacement, entry, base);
                break (start, start, None);
            }
            let (shared, suffix_len) = get_header(bytes, &mut pos);
            std::mem::swap(&mut previous, &mut current);
            current.clear();
            current.extend_from_slice(&previous[..shared]);
            current.extend_from_slice(&bytes[pos..pos + suffix_len]);
            pos += suffix_len;
            let value_start = pos;
            skip_value(bytes, &mut pos);
            match current.as_slice().cmp(key) {
                std::cmp::Ordering::Less => continue,
                std::cmp::Ordering::Equal => {
                    let old = get_value(bytes, &mut value_start.clone(), base);
                    if let Some(entry) = entry {
                        put_value(&mut replacement, entry, base);
                        break (value_start, pos, Some(old));
                    }
                    // Remove: the next entry, if any, now follows `previous`.
                    if pos == bytes.len() {
                        break (start, pos, Some(old));
                    }
                    let next_start = pos;
                    let (next_shared, next_suffix_len) = get_header(bytes, &mut pos);
                    let mut next = current[..next_shared].to_vec();
                    next.extend_from_slice(&bytes[pos..pos + next_suffix_len]);
                    pos += next_suffix_len;
                    assert!(next_start < pos);
                    put_key(&mut replacement, shared.min(next_shared), &next);
                    break (start, pos, Some(old));
                }
                std::cmp::Ordering::Greater => {
                    // Insert before `current`, which then follows `key`.
                    // A remove of a key the block does not hold changes nothing.
                    let entry = entry?;
                    put_key(&mut replacement, common_prefix(&previous, key), key);
                    put_value(&mut replacement, entry, base);
                    put_key(&mut replacement, common_prefix(key, &current), &current);
                    break (start, value_start, None);
                }
            }
        };
        self.splice(block, start..end, &replacement);
        old
    }

    /// Replaces `range` of `block`'s bytes with `replacement`: in place when the lengths agree.
    fn splice(&mut self, block: u32, range: std::ops::Range<usize>, replacement: &[u8]) {
        let bytes = &self.blocks[block as usize];
        if replacement.len() == range.len() {
            self.blocks[block as usize][range].copy_from_slice(replacement);
            return;
        }
        let mut spliced = Vec::with_capacity(bytes.len() - range.len() + replacement.len());
        spliced.extend_from_slice(&bytes[..range.start]);
        spliced.extend_from_slice(replacement);
        spliced.extend_from_slice(&bytes[range.end..]);
        self.set_block(block, spliced.into_boxed_slice());
    }

    fn set_block(&mut self, block: u32, bytes: Box<[u8]>) {
        let old = std::mem::replace(&mut self.blocks[block as usize], bytes);
        self.block_bytes_total -= old.len() as u64;
        self.block_bytes_total += self.blocks[block as usize].len() as u64;
    }

    fn allocate_block(&mut self, bytes: Box<[u8]>) -> u32 {
        self.block_bytes_total += bytes.len() as u64;
        if let Some(block) = self.free_blocks.pop() {
            assert!(self.blocks[block as usize].is_empty(), "a free block holds bytes");
            self.blocks[block as usize] = bytes;
            return block;
        }
        assert!(self.blocks.len() < BLOCKS_MAX, "the index is out of block numbers");
        self.blocks.push(bytes);
        (self.blocks.len() - 1) as u32
    }

    fn free_block(&mut self, block: u32) {
        self.set_block(block, Box::default());
        self.free_blocks.push(block);
    }

    fn add_fence(&mut self, key: &[u8], block: u32) {
        self.fence_key_bytes += key.len() as u64;
        let old = self.fences.insert(key.into(), block);
        assert!(old.is_none(), "two blocks with one fence");
    }

    fn remove_fence(&mut self, key: &[u8]) {
        assert!(!key.is_empty(), "the empty key's fence stays");
        let removed = self.fences.remove(key);
        assert!(removed.is_some());
        self.fence_key_bytes -= key.len() as u64;
    }

    /// Splits `block` in two halves by bytes once it outgrows `block_bytes_max` (a block of one
    /// long key stays whole).
    fn split_if_full(&mut self, block: u32) {
        if self.blocks[block as usize].len() <= self.block_bytes_max {
            return;
        }
        let old = std::mem::take(&mut self.blocks[block as usize]);
        self.block_bytes_total -= old.len() as u64;
        let half = old.len() / 2;
        let mut reader = Reader::new(&old);
        let mut first = Writer::with_capacity(reader.base, half + 64);
        let mut second = Writer::with_capacity(reader.base, old.len() - half + 64);
        let mut fence: Option<Box<[u8]>> = None;
        let mut moved = Vec::new();
        while let Some(entry) = reader.next() {
            if first.count == 0 || (first.out.len() < half && second.count == 0) {
                first.push(&reader.key, entry);
            } else {
                if fence.is_none() {
                    // The shortest fence above the first half's last key, at or below this key
                    // (LevelDB's shortest separator): fences of long keys stay short.
                    let last = &first.previous;
                    let length = common_prefix(last, &reader.key) + 1;
                    fence = Some(reader.key[..length].into());
                }
                second.push(&reader.key, entry);
                moved.push(hash_key(self.seed, &reader.key));
            }
        }
        let Some(fence) = fence else {
            // One key: nothing to split.
            self.blocks[block as usize] = old;
            self.block_bytes_total += self.blocks[block as usize].len() as u64;
            return;
        };
        self.blocks[block as usize] = first.finish();
        self.block_bytes_total += self.blocks[block as usize].len() as u64;
        let new = self.allocate_block(second.finish());
        self.add_fence(&fence, new);
        for hash in moved {
            self.slot_move(hash, block, Some(new));
        }
    }

    /// After a remove from `block` (which held `removed`): a block under a quarter full takes
    /// in the next block when both fit in one; an empty block other than the first goes.
    fn merge_if_small(&mut self, block: u32, removed: &[u8]) {
        let bytes = &self.blocks[block as usize];
        if bytes.len() >= self.block_bytes_max / 4 {
            return;
        }
        let next = self
            .fences
            .range::<[u8], _>((Bound::Excluded(removed), Bound::Unbounded))
            .next()
            .map(|(fence, &next)| (fence.clone(), next));
        let next = next.filter(|&(_, next)| {
            bytes.len() + self.blocks[next as usize].len() <= self.block_bytes_max
        });
        if let Some((next_fence, next)) = next {
            let mut reader = Reader::new(bytes);
            let mut writer =
                Writer::with_capacity(reader.base, bytes.len() + self.blocks[next as usize].len());
            while let Some(entry) = reader.next() {
                writer.push(&reader.key, entry);
            }
            let mut moved = Vec::new();
            let mut reader = Reader::new(&self.blocks[next as usize]);
            while let Some(entry) = reader.next() {
                writer.push(&reader.key, entry);
                moved.push(hash_key(self.seed, &reader.key));
            }
            let merged = writer.finish();
            self.set_block(block, merged);
            self.free_block(next);
            self.remove_fence(&next_fence);
            for hash in moved {
                self.slot_move(hash, next, Some(block));
            }
            return;
        }
        if Reader::new(bytes).next().is_none() {
            let (own_fence, _) = self
                .fences
                .range::<[u8], _>((Bound::Unbounded, Bound::Included(removed)))
                .next_back()
                .expect("the empty key is always a fence");
            if !own_fence.is_empty() {
                let own_fence = own_fence.clone();
                self.remove_fence(&own_fence);
                self.free_block(block);
            }
        }
    }

    /// Makes room for one more slot: rebuilds the table (dropping tombstones, ~70% full after)
    /// when one more would leave fewer than one slot in eight empty.
    fn reserve_slot(&mut self) {
        if (self.slots_used + 1) * 8 > self.slots.len() * 7 {
            self.rebuild_slots(self.items + 1);
        }
    }

    fn rebuild_slots(&mut self, items: usize) {
        let capacity = (items * 10 / 7 + 1).max(SLOTS_MIN);
        self.slots = Vec::new();
        self.slots = vec![SLOT_EMPTY; capacity];
        self.slots_used = 0;
        let mut placed = Vec::with_capacity(self.items);
        for &block in self.fences.values() {
            let mut reader = Reader::new(&self.blocks[block as usize]);
            while reader.next().is_some() {
                placed.push((hash_key(self.seed, &reader.key), block));
            }
        }
        for (hash, block) in placed {
            self.slot_insert(hash, block);
        }
        assert_eq!(self.slots_used, self.items);
    }

    fn slot_insert(&mut self, hash: u64, block: u32) {
        let mut at = self.home(hash);
        loop {
            let slot = self.slots[at];
            if slot == SLOT_EMPTY || slot == SLOT_TOMBSTONE {
                if slot == SLOT_EMPTY {
                    self.slots_used += 1;
                }
                self.slots[at] = slot_for(hash, block);
                assert!(self.slots_used * 8 <= self.slots.len() * 7);
                return;
            }
            at += 1;
            if at == self.slots.len() {
                at = 0;
            }
        }
    }

    /// Points the first slot of (`hash`, `from`) on the probe path at `to`, or leaves a
    /// tombstone for `None`.
    fn slot_move(&mut self, hash: u64, from: u32, to: Option<u32>) {
        let wanted = slot_for(hash, from);
        let mut at = self.home(hash);
        loop {
            let slot = self.slots[at];
            assert!(slot != SLOT_EMPTY, "no slot for a key of block {from}");
            if slot == wanted {
                self.slots[at] = to.map_or(SLOT_TOMBSTONE, |to| slot_for(hash, to));
                return;
            }
            at += 1;
            if at == self.slots.len() {
                at = 0;
            }
        }
    }

    /// Calls `visit` on up to `limit` keys in the range, in order; returns how many.
    fn walk(
        &self,
        start: Bound<&[u8]>,
        end: Bound<&[u8]>,
        limit: usize,
        mut visit: impl FnMut(&[u8], Entry),
    ) -> usize {
        if limit == 0 || is_empty_range(start, end) {
            return 0;
        }
        let first_fence: &[u8] = match start {
            Bound::Unbounded => &[],
            Bound::Included(key) | Bound::Excluded(key) => self
                .fences
                .range::<[u8], _>((Bound::Unbounded, Bound::Included(key)))
                .next_back()
                .map(|(fence, _)| &fence[..])
                .expect("the empty key is always a fence"),
        };
        let mut visited = 0;
        let mut reader = Reader::new(&[]);
        for (_, &block) in self.fences.range::<[u8], _>((Bound::Included(first_fence), Bound::Unbounded)) {
            reader.reset(&self.blocks[block as usize]);
            while let Some(entry) = reader.next() {
                let key = reader.key.as_slice();
                let after_start = match start {
                    Bound::Unbounded => true,
                    Bound::Included(start) => key >= start,
                    Bound::Excluded(start) => key > start,
                };
                if !after_start {
                    continue;
                }
                let before_end = match end {
                    Bound::Unbounded => true,
                    Bound::Included(end) => key <= end,
                    Bound::Excluded(end) => key < end,
                };
                if !before_end {
                    return visited;
                }
                visit(key, entry);
                visited += 1;
                if visited == limit {
                    return visited;
                }
            }
        }
        visited
    }
}

/// Asks the CPU to bring `value`'s cache line in (a hint: no effect on what is read).
pub(crate) fn prefetch<T>(value: &T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint that never faults and reads nothing into the program; the
    // pointer comes from a live reference.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
            (value as *const T).cast::<i8>(),
        );
    }
}

/// The slot-table hash of `key` under the index's `seed`.
fn hash_key(seed: u64, key: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(key, seed)
}

/// A seed for the slot table's hash: random per index, so that keys a client chooses cannot be
/// aimed at one probe run (hash flooding makes lookups slow, never wrong); fixed under
/// `hash::make_deterministic`, so the simulator replays a seed exactly. The table is rebuilt at
/// every open and never persisted, so the seed need not survive a restart.
fn new_seed() -> u64 {
    use std::hash::BuildHasher;
    crate::hash::State::default().hash_one(0x636f_7073_655f_6978_u64)
}

fn slot_for(hash: u64, block: u32) -> u32 {
    assert!((block as usize) < BLOCKS_MAX);
    ((block + 1) << 8) | (hash as u8 as u32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limits::KEY_BYTES_MAX;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    fn loc(i: u64) -> Loc {
        Loc::new((i % 40) as u8, i % (1 << 40), (i % 3 * 1000) as u32)
    }

    #[test]
    fn replace_if_moves_only_the_expected_entry_and_changes_counts_every_edit() {
        let mut index = CompactIndex::default();
        let mut changes = index.changes();
        let mut step = |index: &CompactIndex, moved: bool| {
            assert_eq!(index.changes() > changes, moved);
            changes = index.changes();
        };
        index.insert(b"a", loc(1), 7);
        step(&index, true);
        index.insert(b"a", loc(2), 8);
        step(&index, true);
        assert_eq!(index.entry(b"a"), Some(Entry { loc: loc(2), seq: 8 }));
        step(&index, false);
        // Not the expected entry (seq or loc differ), or no entry: nothing changes.
        let stale = Entry { loc: loc(2), seq: 7 };
        assert_eq!(index.replace_if(b"a", stale, loc(3)), Some(Entry { loc: loc(2), seq: 8 }));
        assert_eq!(index.replace_if(b"a", Entry { loc: loc(1), seq: 8 }, loc(3)).unwrap().loc, loc(2));
        assert_eq!(index.replace_if(b"b", stale, loc(3)), None);
        step(&index, false);
        let live = Entry { loc: loc(2), seq: 8 };
        assert_eq!(index.replace_if(b"a", live, loc(3)), Some(live));
        step(&index, true);
        assert_eq!(index.entry(b"a"), Some(Entry { loc: loc(3), seq: 8 }), "same seq, new place");
        index.remove(b"b");
        step(&index, false);
        index.remove(b"a");
        step(&index, true);
    }

    /// Checks every answer of `index` against `model`, and the index's own invariants.
    fn check_all(index: &CompactIndex, model: &BTreeMap<Vec<u8>, Entry>) {
        assert_eq!(index.len(), model.len());
        let all = index.range(Bound::Unbounded, Bound::Unbounded, usize::MAX);
        let expected: Vec<_> = model.iter().map(|(k, e)| (k.clone().into_boxed_slice(), *e)).collect();
        assert_eq!(all, expected);
        for (key, entry) in model {
            assert_eq!(index.entry(key), Some(*entry));
        }
        let mut digest = LiveDigest::default();
        for (key, entry) in model {
            digest.add(key, entry.seq);
        }
        assert_eq!(index.digest(), digest);
        for byte in 0..=u8::MAX {
            let expected = model.keys().any(|key| key.first() == Some(&byte));
            assert_eq!(index.has_first_byte(byte), expected, "keys starting with {byte:#04x}");
        }
        assert!(index.slots_used * 8 <= index.slots.len() * 7);
        let total: u64 = index.blocks.iter().map(|b| b.len() as u64).sum();
        assert_eq!(total, index.block_bytes_total);
        let fence_bytes: u64 = index.fences.keys().map(|k| k.len() as u64).sum();
        assert_eq!(fence_bytes, index.fence_key_bytes);
        // Each block holds only keys from its fence up to the next fence.
        let fences: Vec<_> = index.fences.iter().collect();
        for (i, (fence, &block)) in fences.iter().enumerate() {
            let mut reader = Reader::new(&index.blocks[block as usize]);
            while reader.next().is_some() {
                assert!(reader.key.as_slice() >= &fence[..]);
                if let Some((next, _)) = fences.get(i + 1) {
                    assert!(reader.key.as_slice() < &next[..]);
                }
            }
        }
    }

    fn bound(kind: u8, key: &[u8]) -> Bound<&[u8]> {
        match kind % 3 {
            0 => Bound::Unbounded,
            1 => Bound::Included(key),
            _ => Bound::Excluded(key),
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert(Vec<u8>, u64),
        Remove(Vec<u8>),
        Get(Vec<u8>),
        Range(u8, Vec<u8>, u8, Vec<u8>, usize),
    }

    fn key_strategy() -> impl Strategy<Value = Vec<u8>> {
        // Few distinct bytes, so keys share prefixes and are prefixes of each other.
        prop_oneof![
            prop::collection::vec(prop_oneof![Just(0u8), Just(b'a'), Just(b'b'), Just(0xFF)], 0..6),
            prop::collection::vec(any::<u8>(), 0..40),
            (0u32..300).prop_map(|i| format!("user{:06}", i.wrapping_mul(7919) % 1000).into_bytes()),
        ]
    }

    fn op_strategy() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (key_strategy(), any::<u64>()).prop_map(|(k, s)| Op::Insert(k, s)),
            2 => key_strategy().prop_map(Op::Remove),
            2 => key_strategy().prop_map(Op::Get),
            1 => (any::<u8>(), key_strategy(), any::<u8>(), key_strategy(), 0usize..50)
                .prop_map(|(a, s, b, e, l)| Op::Range(a, s, b, e, l)),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]
        #[test]
        fn answers_like_an_ordered_map(
            ops in prop::collection::vec(op_strategy(), 1..600),
            block_bytes_max in prop_oneof![Just(32usize), Just(64), Just(200), Just(1024)],
        ) {
            let mut index = CompactIndex::with_block_bytes_max(block_bytes_max);
            let mut model: BTreeMap<Vec<u8>, Entry> = BTreeMap::new();
            for op in ops {
                match op {
                    Op::Insert(key, seq) => {
                        let entry = Entry { loc: loc(seq), seq };
                        prop_assert_eq!(index.insert(&key, entry.loc, seq), model.insert(key, entry));
                    }
                    Op::Remove(key) => {
                        prop_assert_eq!(index.remove(&key), model.remove(&key).map(|e| e.loc));
                    }
                    Op::Get(key) => {
                        prop_assert_eq!(index.entry(&key), model.get(&key).copied());
                        prop_assert_eq!(index.contains(&key), model.contains_key(&key));
                        prop_assert_eq!(index.get(&key), model.get(&key).map(|e| e.loc));
                        if let Some(&byte) = key.first() {
                            let expected = model.keys().any(|k| k.first() == Some(&byte));
                            prop_assert_eq!(index.has_first_byte(byte), expected);
                        }
                    }
                    Op::Range(a, s, b, e, limit) => {
                        let (start, end) = (bound(a, &s), bound(b, &e));
                        let expected: Vec<_> = if is_empty_range(start, end) {
                            Vec::new()
                        } else {
                            model.range::<[u8], _>((start, end)).take(limit)
                                .map(|(k, e)| (k.clone().into_boxed_slice(), *e)).collect()
                        };
                        prop_assert_eq!(index.count(start, end, limit), expected.len());
                        prop_assert_eq!(index.range(start, end, limit), expected);
                    }
                }
            }
            check_all(&index, &model);
            let keys: Vec<_> = model.keys().cloned().collect();
            for key in keys {
                prop_assert!(index.remove(&key).is_some());
            }
            prop_assert!(index.is_empty());
            prop_assert_eq!(index.fences.len(), 1);

            // The same items loaded in order answer the same, and keep working as an index.
            let mut loaded = CompactIndex::with_block_bytes_max(block_bytes_max);
            loaded.load_sorted(model.iter().map(|(key, entry)| (&key[..], *entry)));
            check_all(&loaded, &model);
            loaded.insert(b"user000500", loc(1), 1);
            model.insert(b"user000500".to_vec(), Entry { loc: loc(1), seq: 1 });
            check_all(&loaded, &model);
            let keys: Vec<_> = model.keys().cloned().collect();
            for key in keys {
                prop_assert_eq!(loaded.remove(&key), model.remove(&key).map(|e| e.loc));
            }
            check_all(&loaded, &model);
        }
    }

    #[test]
    fn edge_keys_round_trip() {
        let long_a = vec![b'a'; KEY_BYTES_MAX];
        let mut long_b = long_a.clone();
        *long_b.last_mut().unwrap() = b'b';
        let keys: Vec<Vec<u8>> = vec![
            vec![],
            vec![0],
            vec![0, 0],
            vec![0xFF],
            vec![0xFF; 17],
            vec![0xFF; KEY_BYTES_MAX],
            b"a".to_vec(),
            b"ab".to_vec(),
            b"abc".to_vec(),
            b"abcdefghijklmnopqrstuvwxyz".to_vec(),
            long_a,
            long_b,
        ];
        for block_bytes_max in [32, 1024] {
            let mut index = CompactIndex::with_block_bytes_max(block_bytes_max);
            let mut model = BTreeMap::new();
            for (i, key) in keys.iter().enumerate() {
                let entry = Entry { loc: loc(i as u64 * 977), seq: u64::MAX - i as u64 };
                assert_eq!(index.insert(key, entry.loc, entry.seq), None);
                model.insert(key.clone(), entry);
                check_all(&index, &model);
            }
            assert!(!index.contains(b"abcd"));
            assert!(!index.contains(&[0xFF; 2]));
            assert!(!index.contains(&vec![b'a'; KEY_BYTES_MAX - 1]));
            let seq_zero = Entry { loc: Loc::new(255, (1 << 40) - 1, (1 << 16) - 1), seq: 0 };
            let old = index.insert(b"", seq_zero.loc, 0);
            assert_eq!(old, model.insert(Vec::new(), seq_zero));
            check_all(&index, &model);
            for key in &keys {
                assert_eq!(index.remove(key), model.remove(key).map(|e| e.loc));
                check_all(&index, &model);
            }
            assert_eq!(index.remove(b""), None);
        }
    }

    #[test]
    fn inverted_and_empty_ranges_are_empty() {
        let mut index = CompactIndex::default();
        for i in 0..10u8 {
            index.insert(&[b'k', i], Loc::new(0, i as u64, 0), i as u64);
        }
        assert!(index.range(Bound::Included(&b"z"[..]), Bound::Included(&b"a"[..]), 10).is_empty());
        assert!(index.range(Bound::Excluded(&b"k"[..]), Bound::Excluded(&b"k"[..]), 10).is_empty());
        assert_eq!(index.count(Bound::Unbounded, Bound::Unbounded, 0), 0);
        let keys: Vec<_> = index
            .range(Bound::Included(&[b'k', 2][..]), Bound::Excluded(&[b'k', 8][..]), 3)
            .into_iter()
            .map(|(key, _)| key[1])
            .collect();
        assert_eq!(keys, vec![2, 3, 4]);
    }

    #[test]
    fn memory_follows_inserts_and_removes_back_to_empty() {
        let mut index = CompactIndex::with_block_bytes_max(64);
        let empty = index.memory_bytes();
        for i in 0..2000u64 {
            index.insert(format!("user{:019}", i.wrapping_mul(0x9E37_79B9)).as_bytes(), loc(i), i);
        }
        assert!(index.memory_bytes() > empty + 2000 * 20);
        for i in 0..2000u64 {
            index.remove(format!("user{:019}", i.wrapping_mul(0x9E37_79B9)).as_bytes());
        }
        assert_eq!(index.fences.len(), 1);
        assert_eq!(index.slots.len(), SLOTS_MIN);
        assert_eq!(index.block_bytes_total, 1, "one empty block: its base");
        let lists = index.blocks.capacity() * 16 + index.free_blocks.capacity() * 4;
        assert_eq!(index.memory_bytes(), empty + lists as u64 - 16);
    }
}
