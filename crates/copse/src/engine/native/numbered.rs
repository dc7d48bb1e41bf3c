//! States under way (write batches, scans), each filed under an id handed out in order.
//!
//! Invariant: an id is handed out once per shard session (the counter only grows), so a late
//! completion that names a finished state finds nothing rather than a newer state.

use crate::hash::HashMap;

pub(super) struct Numbered<T> {
    states: HashMap<u64, T>,
    next_id: u64,
}

impl<T> Numbered<T> {
    pub(super) fn new() -> Numbered<T> {
        Numbered { states: HashMap::default(), next_id: 1 }
    }

    /// Files `state` under a new id.
    pub(super) fn insert(&mut self, state: T) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        let earlier = self.states.insert(id, state);
        assert!(earlier.is_none(), "id {id} was handed out twice");
        id
    }

    pub(super) fn get(&self, id: u64) -> Option<&T> {
        self.states.get(&id)
    }

    pub(super) fn get_mut(&mut self, id: u64) -> Option<&mut T> {
        self.states.get_mut(&id)
    }

    pub(super) fn remove(&mut self, id: u64) -> Option<T> {
        self.states.remove(&id)
    }

    pub(super) fn is_empty(&self) -> bool {
        self.states.is_empty()
    }
}
