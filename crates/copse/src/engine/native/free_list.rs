//! Free slots of one size class (KVell §5.3): a bounded in-memory part, the rest chained on disk.
//!
//! Invariants:
//! - A slot is in at most one place: the in-memory set, one on-disk chain, or in use.
//! - A slot enters the in-memory set only once nothing it holds can be mistaken for live data
//!   (its newer version is durable) and enters a chain only once its free record, which points
//!   to the chain's previous head, is durable.
//! - Each in-memory slot remembers the hash of the key whose stale copy it still holds ("tag"),
//!   so tombstones of that key are kept until the stale copy is overwritten (see `seqs.rs`).
//! - Each chain has at most one push or pop in flight ("busy"), so its head is always the
//!   durable top of the chain.

use crate::hash::HashMap;

use crate::limits::{FREE_CHAINS_PER_CLASS, FREE_SLOTS_IN_MEMORY_MAX};

#[derive(Clone, Copy, Debug, Default)]
struct Chain {
    head: Option<u64>,
    busy: bool,
    length: u64,
}

pub struct FreeList {
    /// LIFO order of the in-memory slots; entries no longer in `tags` were taken out of order.
    stack: Vec<u64>,
    /// In-memory free slots and the stale key hash each still holds.
    tags: HashMap<u64, Option<u64>>,
    /// The in-memory slots holding a stale copy, by key hash (so a delete can erase them).
    by_tag: HashMap<u64, Vec<u64>>,
    chains: [Chain; FREE_CHAINS_PER_CLASS],
    /// Chains whose head is set: `begin_pop` runs every round for every class (the refill), and
    /// most classes have no chain at all, so it answers those without a scan.
    chains_with_head: usize,
    next_chain: usize,
}

impl Default for FreeList {
    fn default() -> Self {
        FreeList {
            stack: Vec::new(),
            tags: HashMap::default(),
            by_tag: HashMap::default(),
            chains: [Chain::default(); FREE_CHAINS_PER_CLASS],
            chains_with_head: 0,
            next_chain: 0,
        }
    }
}

impl FreeList {
    pub fn in_memory(&self) -> usize {
        self.tags.len()
    }

    pub fn on_disk(&self) -> u64 {
        self.chains.iter().map(|chain| chain.length).sum()
    }

    pub fn has_room(&self) -> bool {
        self.tags.len() < FREE_SLOTS_IN_MEMORY_MAX
    }

    /// Adds a slot to the in-memory part. The caller checked `has_room` (a refill from a chain
    /// may overshoot the bound by the number of chains).
    pub fn push(&mut self, slot: u64, tag: Option<u64>) {
        let previous = self.tags.insert(slot, tag);
        assert!(previous.is_none(), "slot {slot} freed twice");
        if let Some(tag) = tag {
            self.by_tag.entry(tag).or_default().push(slot);
        }
        self.stack.push(slot);
        if self.stack.len() > 4 * FREE_SLOTS_IN_MEMORY_MAX {
            let tags = &self.tags;
            self.stack.retain(|slot| tags.contains_key(slot));
        }
    }

    /// Takes the most recently freed slot.
    pub fn pop(&mut self) -> Option<(u64, Option<u64>)> {
        while let Some(slot) = self.stack.pop() {
            if let Some(tag) = self.take(slot) {
                return Some((slot, tag));
            }
        }
        None
    }

    /// Takes `slot` if it is free in memory (used to place an update beside its old copy).
    pub fn take(&mut self, slot: u64) -> Option<Option<u64>> {
        let tag = self.tags.remove(&slot)?;
        if let Some(hash) = tag {
            let slots = self.by_tag.get_mut(&hash).expect("tagged slots are indexed");
            slots.retain(|&other| other != slot);
            if slots.is_empty() {
                self.by_tag.remove(&hash);
            }
        }
        Some(tag)
    }

    /// Takes every in-memory slot holding a stale copy under `tag`.
    pub fn take_tagged(&mut self, tag: u64) -> Vec<u64> {
        let slots = self.by_tag.remove(&tag).unwrap_or_default();
        for slot in &slots {
            self.tags.remove(slot);
        }
        slots
    }

    #[cfg(any(test, feature = "testing"))]
    pub fn contains(&self, slot: u64) -> bool {
        self.tags.contains_key(&slot)
    }

    /// A chain to push onto, marked busy, with its current head (the new free record's next).
    pub fn begin_push(&mut self) -> Option<(usize, Option<u64>)> {
        for _ in 0..FREE_CHAINS_PER_CLASS {
            let index = self.next_chain;
            self.next_chain = (self.next_chain + 1) % FREE_CHAINS_PER_CLASS;
            let chain = &mut self.chains[index];
            if !chain.busy {
                chain.busy = true;
                return Some((index, chain.head));
            }
        }
        None
    }

    /// The free record of `slot`, pointing at the previous head, is durable.
    pub fn end_push(&mut self, chain: usize, slot: u64) {
        let chain = &mut self.chains[chain];
        assert!(chain.busy);
        chain.busy = false;
        if chain.head.is_none() {
            self.chains_with_head += 1;
        }
        chain.head = Some(slot);
        chain.length += 1;
    }

    /// Gives up a push whose write failed (the chain keeps its old head).
    pub fn abort(&mut self, chain: usize) {
        self.chains[chain].busy = false;
    }

    /// A chain with a head to pop, marked busy. The caller reads the head's free record.
    pub fn begin_pop(&mut self) -> Option<(usize, u64)> {
        debug_assert_eq!(
            self.chains_with_head,
            self.chains.iter().filter(|chain| chain.head.is_some()).count()
        );
        if self.chains_with_head == 0 {
            return None;
        }
        for (index, chain) in self.chains.iter_mut().enumerate() {
            if let (false, Some(head)) = (chain.busy, chain.head) {
                chain.busy = true;
                return Some((index, head));
            }
        }
        None
    }

    /// The head was read: it moves to memory and `next` becomes the head.
    pub fn end_pop(&mut self, chain: usize, next: Option<u64>) {
        let state = &mut self.chains[chain];
        assert!(state.busy);
        let head = state.head.take().expect("popping an empty chain");
        state.busy = false;
        state.head = next;
        if next.is_none() {
            self.chains_with_head -= 1;
        }
        state.length = state.length.saturating_sub(1);
        if next.is_none() {
            state.length = 0;
        }
        self.push(head, None);
    }

    /// Drops a chain whose head no longer reads as a free record (reported by the caller).
    pub fn drop_chain(&mut self, chain: usize) {
        if self.chains[chain].head.is_some() {
            self.chains_with_head -= 1;
        }
        self.chains[chain] = Chain::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_part_is_lifo_and_take_removes_out_of_order() {
        let mut free = FreeList::default();
        free.push(1, None);
        free.push(2, Some(7));
        free.push(3, None);
        assert_eq!(free.take(2), Some(Some(7)));
        assert_eq!(free.pop(), Some((3, None)));
        assert_eq!(free.pop(), Some((1, None)));
        assert_eq!(free.pop(), None);
    }

    #[test]
    fn tagged_slots_are_found_by_tag_and_leave_with_any_take() {
        let mut free = FreeList::default();
        free.push(1, Some(9));
        free.push(2, Some(9));
        free.push(3, Some(4));
        assert_eq!(free.take(2), Some(Some(9)));
        assert_eq!(free.take_tagged(9), vec![1]);
        assert!(free.take_tagged(9).is_empty());
        assert_eq!(free.pop(), Some((3, Some(4))));
        assert!(free.take_tagged(4).is_empty());
        assert_eq!(free.in_memory(), 0);
    }

    #[test]
    fn chains_hand_out_heads_once_each() {
        let mut free = FreeList::default();
        let (chain, head) = free.begin_push().unwrap();
        assert_eq!(head, None);
        free.end_push(chain, 40);
        let (again, head) = free.begin_push().unwrap();
        assert_ne!(again, chain, "a busy chain was handed out twice");
        assert_eq!(head, None);
        free.abort(again);
        let (popped_chain, popped) = free.begin_pop().unwrap();
        assert_eq!((popped_chain, popped), (chain, 40));
        assert!(free.begin_pop().is_none(), "the only chain is busy");
        free.end_pop(chain, None);
        assert!(free.contains(40));
        assert_eq!(free.on_disk(), 0);
    }

    #[test]
    #[should_panic(expected = "freed twice")]
    fn double_free_is_caught() {
        let mut free = FreeList::default();
        free.push(5, None);
        free.push(5, None);
    }
}
