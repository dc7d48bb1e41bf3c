//! Clients blocked on keys (BLPOP, BRPOP, BLMOVE, BRPOPLPUSH, BLMPOP), per key in the order
//! they blocked.
//!
//! A blocked command tries its pop; if every key was empty it registers here and sleeps until
//! woken or timed out, then tries again (keeping its place). A write that adds elements to a
//! key wakes the first client waiting on it, once the write is durable; a client that is
//! served, times out or goes away leaves every queue it was in and wakes the one behind it on
//! each key, which tries in turn. So clients are served in arrival order, and a wake is never
//! lost: `Notify` keeps a permit for a client not yet asleep.
//!
//! Invariants:
//! - A waiter is in the queue of each of its keys from `register` to `unregister` (its
//!   `Registration` unregisters when dropped: a closed connection leaves no waiter behind).
//! - Only the first waiter of a key is woken by a write to that key.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

/// What a blocked client waits for on a key: each kind has queues of its own, so a write of one
/// kind wakes only clients that can take it (a ZADD never wakes a BLPOP, which would find the
/// wrong type and hold up the BZPOPMIN behind it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    List,
    ZSet,
}

/// The queue key of `key` of namespace `namespace` (its database's, `cmd/namespace.rs`) for
/// clients of `kind`.
pub fn queue_key(kind: Kind, namespace: u8, key: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(key.len() + 2);
    out.push(namespace);
    out.push(match kind {
        Kind::List => b'l',
        Kind::ZSet => b'z',
    });
    out.extend_from_slice(key);
    out
}

/// One blocked client.
pub struct Waiter {
    id: u64,
    pub notify: Notify,
}

/// Every blocked client, per key.
#[derive(Default)]
pub struct Waiters {
    queues: Mutex<HashMap<Vec<u8>, VecDeque<Arc<Waiter>>>>,
    next_id: AtomicU64,
    blocked: AtomicUsize,
}

/// A waiter's place in the queues of its keys; leaves them when dropped.
pub struct Registration<'a> {
    waiters: &'a Waiters,
    pub waiter: Arc<Waiter>,
    keys: Vec<Vec<u8>>,
}

impl Drop for Registration<'_> {
    fn drop(&mut self) {
        self.waiters.unregister(&self.waiter, &self.keys);
    }
}

impl Waiters {
    /// Clients blocked now (INFO's `blocked_clients`).
    pub fn blocked_clients(&self) -> usize {
        self.blocked.load(Ordering::Relaxed)
    }

    /// Queues a new waiter at the back of each of `keys`' queues.
    pub fn register(&self, keys: &[Vec<u8>]) -> Registration<'_> {
        let waiter = Arc::new(Waiter {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            notify: Notify::new(),
        });
        let mut queues = self.queues.lock().unwrap_or_else(|poison| poison.into_inner());
        let mut keys = keys.to_vec();
        keys.sort();
        keys.dedup();
        for key in &keys {
            queues.entry(key.clone()).or_default().push_back(waiter.clone());
        }
        self.blocked.fetch_add(1, Ordering::Relaxed);
        Registration { waiters: self, waiter, keys }
    }

    /// Wakes the first client of `kind` waiting on `key`, if any (no lock while no client is
    /// blocked).
    pub fn wake(&self, kind: Kind, namespace: u8, key: &[u8]) {
        if !self.any_waiting() {
            return;
        }
        let queues = self.queues.lock().unwrap_or_else(|poison| poison.into_inner());
        if let Some(first) = queues.get(&queue_key(kind, namespace, key)).and_then(VecDeque::front)
        {
            first.notify.notify_one();
        }
    }

    /// Wakes every blocked client (SWAPDB: each looks again, in its database's new namespace).
    pub fn wake_everyone(&self) {
        let queues = self.queues.lock().unwrap_or_else(|poison| poison.into_inner());
        for waiter in queues.values().flatten() {
            waiter.notify.notify_one();
        }
    }

    /// Whether any client is blocked at all (a write then wakes; without, it skips the lock).
    pub fn any_waiting(&self) -> bool {
        self.blocked.load(Ordering::Relaxed) > 0
    }

    /// Whether a client waits on one of `keys` (a newcomer then queues behind it).
    pub fn anyone_waiting_on(&self, keys: &[Vec<u8>]) -> bool {
        if !self.any_waiting() {
            return false;
        }
        let queues = self.queues.lock().unwrap_or_else(|poison| poison.into_inner());
        keys.iter().any(|key| queues.contains_key(key))
    }

    fn unregister(&self, waiter: &Waiter, keys: &[Vec<u8>]) {
        let mut queues = self.queues.lock().unwrap_or_else(|poison| poison.into_inner());
        for key in keys {
            let Some(queue) = queues.get_mut(key) else { continue };
            let was_first = queue.front().is_some_and(|first| first.id == waiter.id);
            queue.retain(|other| other.id != waiter.id);
            if queue.is_empty() {
                queues.remove(key);
            } else if was_first {
                // Its turn passes on: the key may still hold elements for the next one.
                queue[0].notify.notify_one();
            }
        }
        self.blocked.fetch_sub(1, Ordering::Relaxed);
    }

    /// Whether `waiter` is first in the queue of any of `keys` (only the first may take an
    /// element a write announced; the others wait their turn).
    pub fn is_first_anywhere(&self, waiter: &Waiter, keys: &[Vec<u8>]) -> bool {
        let queues = self.queues.lock().unwrap_or_else(|poison| poison.into_inner());
        keys.iter().any(|key| {
            queues.get(key).and_then(VecDeque::front).is_some_and(|first| first.id == waiter.id)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waiters_leave_every_queue_and_pass_their_turn_on() {
        let waiters = Waiters::default();
        let keys = vec![b"a".to_vec(), b"b".to_vec()];
        let first = waiters.register(&keys);
        let second = waiters.register(&keys[..1]);
        assert_eq!(waiters.blocked_clients(), 2);
        assert!(waiters.is_first_anywhere(&first.waiter, &keys));
        assert!(!waiters.is_first_anywhere(&second.waiter, &keys));
        drop(first);
        assert!(waiters.is_first_anywhere(&second.waiter, &keys));
        assert_eq!(waiters.blocked_clients(), 1);
        drop(second);
        assert_eq!(waiters.blocked_clients(), 0);
        assert!(waiters.queues.lock().unwrap().is_empty(), "no queue is left behind");
    }
}
