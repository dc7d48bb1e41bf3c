//! Where a size class puts new records: in place (KVell: fill free slots) or appended (RStore:
//! pack them into fresh pages of an open block), and the block accounting and victim choice of
//! append placement's garbage collector. The collector's I/O is in `gc.rs`; the guide is
//! docs/placement.md.
//!
//! An append class cuts its slab file into blocks of `block_pages` pages. New and moved records
//! take the next slot of the open block, so a round's records land in consecutive pages that are
//! written together. A freed slot (superseded, deleted, erased) only counts as dead in its block;
//! a block whose every slot is dead is free and is reused whole, from its first page, without
//! reading it. Blocks whose dead count changed go on a queue; when the collector needs a victim
//! the queue feeds a max-heap of dead slots (RStore §3.3), and stale heap entries are dropped.
//!
//! Invariants:
//! - `used` of a block counts its slots handed out and not yet released: live items, tombstones
//!   guarding stale copies, batch, part and watermark records, writes in flight, and slots whose
//!   erasure is in flight. A block is in `free_blocks` iff its used count is 0 and it is not the
//!   open block.
//! - The open block's slots at and past the cursor were not handed out since it was opened, so
//!   their bytes on disk are dead (or zero).
//! - A dead slot that still holds a stale copy of a key keeps the key's hash in its block's
//!   `BlockTags` until the slot is handed out again; the write over it releases the tag once
//!   durable, so the key's tombstone outlives the copy (invariant 4 of mod.rs). A slot is tagged
//!   at most once (asserted when its block is opened, the tags sorted by slot).
//! - Slots are handed out in increasing order within a block, so the pages a block gets written
//!   to are imaged in increasing order (`ClassFile::fresh_pages` relies on it).

use std::collections::{BTreeSet, BinaryHeap};

use super::format::SizeClass;
pub use crate::engine::placement::{AppendFigures, Placement};

/// The cost model behind `auto` (docs/placement.md): an in-place write of an item costs one
/// random page write; an appended one costs its share of a sequential page, times what the
/// collector writes and reads again per slot it frees. With the store's space ceiling `r`,
/// victims are at least `d = 1 - 1/r` dead, so freeing a slot moves at most `(1 - d) / d` live
/// ones: every appended slot costs `1/d` slot writes and `1/d` slot reads. Append wins when
/// `sequential_over_random`, the ratio of the device's sequential to random page throughput,
/// exceeds `2 / d * slot_bytes / PAGE_BYTES`.
pub fn choose_placement(
    class: SizeClass,
    sequential_over_random: f64,
    space_amplification_max: f64,
) -> Placement {
    if !class.is_placeable() {
        // A multi-page slot is already written whole, as one large I/O.
        return Placement::InPlace;
    }
    let dead_fraction = 1.0 - 1.0 / space_amplification_max;
    let page_share = class.slot_bytes as f64 / crate::limits::PAGE_BYTES as f64;
    let append_cost = 2.0 / dead_fraction * page_share;
    if sequential_over_random > append_cost {
        Placement::Append
    } else {
        Placement::InPlace
    }
}

#[derive(Clone, Copy, Debug, Default)]
struct Block {
    /// Slots handed out and not released (see the module invariants).
    used: u32,
    /// The collector is emptying it.
    collecting: bool,
    /// A collection left live slots it could not move (a batch or part record, a record that
    /// no longer verifies): not a victim again until one of its slots is released.
    blocked: bool,
    /// On the change queue.
    queued: bool,
}

/// The stale key hashes of one block's dead slots, by slot offset in the block. Kept per block,
/// not in one map by slot: a release appends to its block's list and the reopened block hands
/// its slots out in order, so the tags are read back in order too, with no hash probe into a map
/// as large as the class's dead slots (two cache misses per overwritten record under a write load).
#[derive(Debug, Default)]
struct BlockTags {
    /// Tags of slots released since the block was last opened, in release order.
    released: Vec<(u32, u64)>,
    /// While the block is open: the tags it held when opened, sorted by decreasing offset, so
    /// the next slot handed out finds its tag (if any) at the end.
    opened: Vec<(u32, u64)>,
}

/// One append class's blocks.
pub(super) struct AppendClass {
    class: SizeClass,
    slots_per_block: u64,
    blocks: Vec<Block>,
    /// The open block and its cursor (the next slot to hand out).
    open: Option<(u32, u64)>,
    free_blocks: BTreeSet<u32>,
    /// Per block, beside `blocks` (which stays `Copy`).
    tags: Vec<BlockTags>,
    /// Blocks whose dead count changed since the heap last saw them.
    changed: Vec<u32>,
    heap: BinaryHeap<(u32, std::cmp::Reverse<u32>)>,
    used_slots: u64,
    pub(super) figures: AppendFigures,
}

/// Where the next slot will come from: the open block, a free block, or a new one past the end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct NextSlot {
    pub slot: u64,
    /// A block is opened for it: its pages, [first, end), hold nothing live.
    pub opens: Option<(u64, u64)>,
}

/// A block's released slots (`AppendClass::released_slots`), as a bitmap by offset from its
/// first slot.
pub(super) struct ReleasedSlots {
    first_slot: u64,
    bits: Vec<u64>,
}

impl ReleasedSlots {
    /// Whether `slot` (of this block) was released.
    pub(super) fn contains(&self, slot: u64) -> bool {
        let offset = slot - self.first_slot;
        self.bits[offset as usize / 64] & (1 << (offset % 64)) != 0
    }
}

impl AppendClass {
    /// An append class over a file holding `slots_in_file` slots, of which the first `frontier`
    /// were handed out at some time; every one of those starts used, and recovery releases the
    /// dead ones. The block holding the frontier (if the frontier is inside it) stays open.
    pub(super) fn new(
        class: SizeClass,
        block_pages: u32,
        slots_in_file: u64,
        frontier: u64,
    ) -> AppendClass {
        assert!(class.is_placeable(), "append placement is for in-page classes");
        assert!(block_pages >= 1);
        // A block is whole units (a packed class's unit is several pages), so that no slot
        // lies in two blocks and a free block is reused without reading its neighbours.
        let slots_per_block =
            (block_pages as u64).div_ceil(class.unit_pages()) * class.slots_per_unit as u64;
        let mut append = AppendClass {
            class,
            slots_per_block,
            blocks: Vec::new(),
            open: None,
            free_blocks: BTreeSet::new(),
            tags: Vec::new(),
            changed: Vec::new(),
            heap: BinaryHeap::new(),
            used_slots: 0,
            figures: AppendFigures::default(),
        };
        let blocks = slots_in_file.max(frontier).div_ceil(slots_per_block);
        for block in 0..blocks {
            let first = block * slots_per_block;
            let used = frontier.saturating_sub(first).min(slots_per_block);
            append.push_block(Block { used: used as u32, ..Block::default() });
            append.used_slots += used;
        }
        let frontier_block = frontier / slots_per_block;
        if !frontier.is_multiple_of(slots_per_block) {
            append.open = Some((frontier_block as u32, frontier));
        }
        for block in 0..blocks as u32 {
            if append.open.is_some_and(|(open, _)| open == block) {
                continue;
            }
            if append.blocks[block as usize].used == 0 {
                append.free_blocks.insert(block);
            } else {
                append.queue(block);
            }
        }
        append
    }

    /// A block past the last one, with its (empty) tag list: `tags` stays beside `blocks`.
    fn push_block(&mut self, block: Block) {
        self.blocks.push(block);
        self.tags.push(BlockTags::default());
    }

    pub(super) fn block_of(&self, slot: u64) -> u32 {
        (slot / self.slots_per_block) as u32
    }

    fn first_slot(&self, block: u32) -> u64 {
        block as u64 * self.slots_per_block
    }

    /// The slots of `block` released with a stale copy's tag since the block was last opened:
    /// dead until the block is reopened (a released slot is handed out again only then).
    pub(super) fn released_slots(&self, block: u32) -> ReleasedSlots {
        let mut bits = vec![0u64; self.slots_per_block.div_ceil(64) as usize];
        for &(offset, _) in &self.tags[block as usize].released {
            bits[offset as usize / 64] |= 1 << (offset % 64);
        }
        ReleasedSlots { first_slot: self.first_slot(block), bits }
    }

    /// The pages of a block, [first, end).
    pub(super) fn pages_of(&self, block: u32) -> (u64, u64) {
        let first = self.class.page_of_slot(self.first_slot(block));
        (first, first + self.slots_per_block / self.class.slots_per_unit as u64 * self.class.unit_pages())
    }

    pub(super) fn slots_per_block(&self) -> u64 {
        self.slots_per_block
    }

    fn dead(&self, block: u32) -> u32 {
        let used = self.blocks[block as usize].used as u64;
        match self.open {
            Some((open, cursor)) if open == block => {
                (cursor - self.first_slot(block)).saturating_sub(used) as u32
            }
            _ => (self.slots_per_block - used) as u32,
        }
    }

    fn queue(&mut self, block: u32) {
        let state = &mut self.blocks[block as usize];
        if !state.queued {
            state.queued = true;
            self.changed.push(block);
        }
    }

    fn is_open(&self, block: u32) -> bool {
        self.open.is_some_and(|(open, _)| open == block)
    }

    /// The slot `take` will hand out next. No state changes.
    pub(super) fn peek(&self) -> NextSlot {
        if let Some((block, cursor)) = self.open {
            if cursor < self.first_slot(block) + self.slots_per_block {
                return NextSlot { slot: cursor, opens: None };
            }
        }
        let block = self.free_blocks.first().copied().unwrap_or(self.blocks.len() as u32);
        NextSlot { slot: self.first_slot(block), opens: Some(self.pages_of(block)) }
    }

    /// Hands out the next slot (the file must hold it: the caller grew it after `peek`), with
    /// the stale key hash of what the slot still holds.
    pub(super) fn take(&mut self) -> (u64, Option<u64>) {
        let next = self.peek();
        if next.opens.is_some() {
            if let Some((sealed, _)) = self.open.take() {
                self.seal(sealed);
            }
            let block = self.block_of(next.slot);
            if !self.free_blocks.remove(&block) {
                assert_eq!(block as usize, self.blocks.len(), "a new block is the next one");
                self.push_block(Block::default());
            }
            assert_eq!(self.blocks[block as usize].used, 0, "an opened block holds nothing live");
            self.open = Some((block, next.slot));
            self.sort_tags(block);
        }
        let (block, cursor) = self.open.as_mut().expect("opened above");
        assert_eq!(*cursor, next.slot);
        *cursor += 1;
        let block = *block;
        self.blocks[block as usize].used += 1;
        self.used_slots += 1;
        let offset = (next.slot - self.first_slot(block)) as u32;
        let opened = &mut self.tags[block as usize].opened;
        let tag = match opened.last() {
            Some(&(tagged, tag)) if tagged == offset => {
                opened.pop();
                Some(tag)
            }
            Some(&(tagged, _)) => {
                assert!(tagged > offset, "the tag of slot {tagged} of block {block} was passed");
                None
            }
            None => None,
        };
        (next.slot, tag)
    }

    /// A block is opened from its first slot (every slot dead): its tags, sorted for `take`.
    fn sort_tags(&mut self, block: u32) {
        let tags = &mut self.tags[block as usize];
        assert!(tags.opened.is_empty(), "block {block} reopened before its tags were taken");
        let mut opened = std::mem::take(&mut tags.released);
        opened.sort_unstable_by_key(|&(offset, _)| std::cmp::Reverse(offset));
        if let Some(pair) = opened.windows(2).find(|pair| pair[0].0 == pair[1].0) {
            panic!("slot {} of block {block} was tagged twice", pair[0].0);
        }
        tags.opened = opened;
    }

    /// The open block is full: it becomes a victim candidate, or free if nothing in it lives.
    fn seal(&mut self, block: u32) {
        // Every slot was handed out, so every tag the block opened with was taken; its list's
        // memory goes back now rather than while the block waits to die.
        let opened = std::mem::take(&mut self.tags[block as usize].opened);
        assert!(opened.is_empty(), "block {block} sealed with {} tags not taken", opened.len());
        if self.blocks[block as usize].used == 0 {
            self.free_blocks.insert(block);
        } else {
            self.queue(block);
        }
    }

    /// A slot holds nothing live any more; `tag`: the hash of the key whose stale copy it holds.
    pub(super) fn release(&mut self, slot: u64, tag: Option<u64>) {
        let block = self.block_of(slot);
        let state = &mut self.blocks[block as usize];
        assert!(state.used > 0, "slot {slot} of class {} released twice", self.class.id);
        state.used -= 1;
        state.blocked = false;
        self.used_slots -= 1;
        if let Some(tag) = tag {
            let offset = (slot - self.first_slot(block)) as u32;
            self.tags[block as usize].released.push((offset, tag));
        }
        if self.is_open(block) {
            return;
        }
        if self.blocks[block as usize].used == 0 {
            let state = &mut self.blocks[block as usize];
            if state.collecting {
                state.collecting = false;
                self.figures.gc_blocks_freed += 1;
            }
            self.free_blocks.insert(block);
        } else {
            self.queue(block);
        }
    }

    /// Whether the collector should run: opening one more block would take the blocks in use
    /// (all but the free ones) most of the way (`GC_START_FRACTION_OF_CEILING_ROOM`) to
    /// `space_amplification_max` times the live slots, and past `room_blocks_min` blocks more
    /// than the live slots (`limits::GC_ROOM_BLOCKS_MIN` in a store: a class of a few blocks
    /// gets that much room). The file grows only when no block is free, so it stays within the
    /// ceiling plus one growth step.
    pub(super) fn wants_collection(&self, space_amplification_max: f64, room_blocks_min: u64) -> bool {
        self.slots_past_start(space_amplification_max, room_blocks_min) > 0
    }

    /// How many slots the blocks in use, with one more opened, stand past the point where
    /// collection starts (0 if short of it): what a collection must free at least to get back.
    pub(super) fn slots_past_start(&self, space_amplification_max: f64, room_blocks_min: u64) -> u64 {
        let occupied = (self.blocks.len() - self.free_blocks.len()) as u64 + 1;
        let start = 1.0
            + crate::limits::GC_START_FRACTION_OF_CEILING_ROOM * (space_amplification_max - 1.0);
        let room_min = (self.used_slots + room_blocks_min * self.slots_per_block) as f64;
        let start_slots = (start * self.used_slots as f64).max(room_min);
        let past = (occupied * self.slots_per_block) as f64 - start_slots;
        past.max(0.0).ceil() as u64
    }

    /// The sealed block with the most dead slots that can be collected, marked as collecting,
    /// with its dead slots.
    pub(super) fn pick_victim(&mut self) -> Option<(u32, u32)> {
        for block in std::mem::take(&mut self.changed) {
            self.blocks[block as usize].queued = false;
            if self.collectable(block) {
                self.heap.push((self.dead(block), std::cmp::Reverse(block)));
            }
        }
        while let Some((dead, std::cmp::Reverse(block))) = self.heap.pop() {
            // An entry is current only if the count still matches; a changed block was queued
            // again, so its current count is in the heap or the queue.
            if self.collectable(block) && self.dead(block) == dead {
                self.blocks[block as usize].collecting = true;
                self.figures.gc_runs += 1;
                return Some((block, dead));
            }
        }
        None
    }

    fn collectable(&self, block: u32) -> bool {
        let state = self.blocks[block as usize];
        !self.is_open(block)
            && state.used > 0
            && !state.collecting
            && !state.blocked
            && self.dead(block) > 0
    }

    pub(super) fn is_collecting(&self, block: u32) -> bool {
        self.blocks[block as usize].collecting
    }

    /// A collection ended. A block it could not empty waits until one of its slots is freed.
    pub(super) fn collection_ended(&mut self, block: u32) {
        let state = &mut self.blocks[block as usize];
        if state.collecting {
            state.collecting = false;
            state.blocked = true;
            self.figures.gc_blocked += 1;
        }
    }

    /// Blocks added by the file growing to `slots_in_file`.
    pub(super) fn cover(&mut self, slots_in_file: u64) {
        let blocks = slots_in_file.div_ceil(self.slots_per_block) as usize;
        while self.blocks.len() < blocks {
            let block = self.blocks.len() as u32;
            self.push_block(Block::default());
            if !self.is_open(block) {
                self.free_blocks.insert(block);
            }
        }
    }

    pub(super) fn figures(&self) -> AppendFigures {
        let dead_slots = (0..self.blocks.len() as u32)
            .filter(|block| !self.free_blocks.contains(block))
            .map(|block| self.dead(block) as u64)
            .sum();
        AppendFigures {
            blocks: self.blocks.len() as u64,
            free_blocks: self.free_blocks.len() as u64,
            used_slots: self.used_slots,
            dead_slots,
            ..self.figures
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn class() -> SizeClass {
        SizeClass::get(4) // 16 slots per page
    }

    #[test]
    fn slots_are_handed_out_in_order_and_a_full_block_is_sealed() {
        let mut append = AppendClass::new(class(), 2, 0, 0);
        let first: Vec<u64> = (0..32).map(|_| append.take().0).collect();
        assert_eq!(first, (0..32).collect::<Vec<_>>());
        assert_eq!(append.peek(), NextSlot { slot: 32, opens: Some((3, 5)) });
        assert_eq!(append.take().0, 32);
        assert!(append.pick_victim().is_none(), "the sealed block has no dead slot");
        append.release(3, Some(77));
        append.release(4, None);
        assert_eq!(append.pick_victim().map(|(block, _)| block), Some(0));
        assert_eq!(append.figures().dead_slots, 2);
    }

    #[test]
    fn a_block_whose_slots_all_die_is_reused_from_its_start_with_its_tags() {
        let mut append = AppendClass::new(class(), 1, 0, 0);
        for _ in 0..16 {
            append.take();
        }
        append.take(); // seals block 0
        for slot in 0..16 {
            append.release(slot, (slot == 5).then_some(9));
        }
        for _ in 1..16 {
            append.take();
        }
        // Block 1 is full; the next slot reopens block 0 from its first page.
        assert_eq!(append.peek(), NextSlot { slot: 0, opens: Some((1, 2)) });
        let tags: Vec<Option<u64>> = (0..16).map(|_| append.take().1).collect();
        assert_eq!(tags[5], Some(9));
        assert_eq!(tags.iter().flatten().count(), 1);
    }

    #[test]
    fn tags_released_in_any_order_come_back_with_their_slots_at_every_reopening() {
        let mut append = AppendClass::new(class(), 1, 0, 0);
        for _ in 0..16 {
            append.take();
        }
        append.take(); // seals block 0, opens block 1
        // Block 0's slots die in scrambled order, a few carrying tags.
        for slot in [9, 2, 15, 0, 7, 11, 4, 13, 1, 3, 5, 6, 8, 10, 12, 14] {
            append.release(slot, (slot % 3 == 0).then_some(100 + slot));
        }
        // Block 1: the slot taken above dies while its block is open (behind the cursor).
        append.release(16, Some(116));
        for _ in 17..32 {
            append.take();
        }
        let tags: Vec<(u64, Option<u64>)> = (0..16).map(|_| append.take()).collect();
        let want: Vec<(u64, Option<u64>)> =
            (0..16).map(|slot| (slot, (slot % 3 == 0).then_some(100 + slot))).collect();
        assert_eq!(tags, want);
        // Block 1 (its other slots die untagged) reopens with slot 16's tag.
        for slot in 17..32 {
            append.release(slot, None);
        }
        let reopened: Vec<(u64, Option<u64>)> = (0..16).map(|_| append.take()).collect();
        assert_eq!(reopened[0], (16, Some(116)));
        assert!(reopened[1..].iter().all(|(_, tag)| tag.is_none()));
    }

    #[test]
    #[should_panic(expected = "tagged twice")]
    fn a_slot_tagged_twice_is_caught_when_its_block_reopens() {
        let mut append = AppendClass::new(class(), 1, 0, 0);
        for _ in 0..17 {
            append.take();
        }
        for slot in 0..16 {
            append.release(slot, Some(slot));
        }
        append.tags[0].released.push((3, 3));
        for _ in 17..32 {
            append.take();
        }
        append.take();
    }

    #[test]
    fn the_victim_has_the_most_dead_slots_and_stale_heap_entries_are_dropped() {
        let mut append = AppendClass::new(class(), 1, 0, 0);
        for _ in 0..49 {
            append.take(); // blocks 0, 1, 2 full, block 3 open
        }
        append.release(1, None);
        append.release(17, None);
        append.release(18, None);
        assert_eq!(append.pick_victim().map(|(block, _)| block), Some(1));
        append.release(33, None);
        append.release(34, None);
        append.release(35, None);
        append.release(2, None);
        // Block 2 has 3 dead, block 0 has 2: block 2 first, then 0.
        assert_eq!(append.pick_victim().map(|(block, _)| block), Some(2));
        assert_eq!(append.pick_victim().map(|(block, _)| block), Some(0));
        assert_eq!(append.pick_victim(), None);
        append.collection_ended(0);
        append.release(3, None);
        assert_eq!(append.pick_victim(), Some((0, 3)), "a release unblocks a block");
    }

    #[test]
    fn recovery_starts_every_handed_out_slot_used_and_keeps_the_frontier_block_open() {
        let mut append = AppendClass::new(class(), 1, 64, 20);
        assert_eq!(append.figures().used_slots, 20);
        assert_eq!(append.peek(), NextSlot { slot: 20, opens: None });
        for slot in 0..16 {
            append.release(slot, None);
        }
        assert_eq!(append.figures().free_blocks, 3, "blocks 0, 2 and 3");
        assert_eq!(append.take().0, 20);
    }

    #[test]
    fn collection_is_wanted_only_past_the_space_ceiling() {
        let mut append = AppendClass::new(class(), 1, 0, 0);
        for _ in 0..16 * 8 {
            append.take();
        }
        assert!(!append.wants_collection(1.5, 0), "no dead slots: a new block keeps the ratio");
        for slot in 0..16 * 4 {
            if slot % 16 != 0 {
                append.release(slot, None);
            }
        }
        assert!(append.wants_collection(1.5, 0));
        assert!(!append.wants_collection(4.0, 0));
        assert!(append.wants_collection(2.2, 0), "starts short of the ceiling");
    }

    #[test]
    fn a_class_of_few_live_slots_keeps_its_room_before_collecting() {
        let mut append = AppendClass::new(class(), 1, 0, 0);
        for _ in 0..16 * 2 {
            append.take();
        }
        for slot in (0..16 * 2).filter(|slot| slot % 2 == 0) {
            append.release(slot, None);
        }
        // 16 live slots in two blocks: 1.5 times them is under two blocks, but a collection
        // would only move live slots from block to block, round after round. A room of three
        // blocks (the store's is `GC_ROOM_BLOCKS_MIN`) holds it off.
        let room = 3;
        assert!(!append.wants_collection(1.5, room));
        assert!(append.wants_collection(1.5, 0), "the ceiling alone would start a collection");
        // Three more blocks filled, two of them then three-quarters dead: 40 live slots in
        // five blocks, six with the next one opened, past the live slots plus the room.
        for _ in 0..16 * 3 {
            append.take();
        }
        for slot in (16 * 2..16 * 4).filter(|slot| slot % 4 != 0) {
            append.release(slot, None);
        }
        assert!(append.wants_collection(1.5, room), "past the room: the blocks in use exceed it");
    }

    #[test]
    fn auto_appends_small_slots_on_a_device_that_favours_sequential_writes() {
        let small = SizeClass::get(4);
        let page = SizeClass::get(12);
        assert_eq!(choose_placement(small, 5.0, 1.5), Placement::Append);
        assert_eq!(choose_placement(page, 5.0, 1.5), Placement::InPlace);
        assert_eq!(choose_placement(small, 0.3, 1.5), Placement::InPlace);
        assert_eq!(choose_placement(SizeClass::get(20), 1000.0, 1.5), Placement::InPlace);
    }
}
