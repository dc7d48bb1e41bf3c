//! Flat combining for the embedded API (issue 22, item 3): a caller of `Db::get` queues its
//! request as before, then, if nobody is running the shard's loop at that moment, runs the
//! loop's turns itself on its own thread instead of waking the shard's thread and sleeping
//! until it answers. A read of a cached item is then answered without a thread crossing at all;
//! a read that needs the device costs one crossing (the answer) instead of two. Measured:
//! docs/benchmarks.md, "Flat combining".
//!
//! Writes (`put`, `delete`) do not combine: each needs the shard's thread anyway (the flush
//! that makes it durable), and with 16 callers taking writes into rounds of their own, YCSB A
//! ran slower than with the thread gathering them (same section).
//!
//! The loop lives in `slot`, behind a mutex. Its drivers are the shard's thread (which sleeps
//! without holding it) and any combining caller (which only tries the lock, never waits for
//! it). An engine that blocks its thread (RocksDB, the synchronous device) is never combined:
//! its loop stays on its thread (`ShardLoop::run_on_thread`) and `slot` stays empty.
//!
//! Invariants:
//! 1. One driver at a time: whoever holds the mutex owns the shard's state for that turn, as
//!    the shard's thread alone did before (the shard is still single-owner).
//! 2. A combiner never waits: it runs turns until the loop would wait with nothing queued, or
//!    `COMBINE_TURNS_MAX` turns, whichever comes first; it never sleeps on the ring or the
//!    queue (the thread does). Nor does it submit: its turns queue their I/O with the ring's
//!    system call held back (`ShardLoop::turn_as_caller`), and the thread's next turn makes
//!    it. io_uring posts a completion through task work on the thread that submitted the
//!    request, so a caller that submitted and then slept on its answer would be woken once
//!    just to post it (measured: combining with callers submitting was slower than none).
//! 3. No work is left unwatched. A combiner that leaves the shard anything but idle (I/O held
//!    back or in flight, requests queued, a deadline, a hand-off asked for) bumps `generation` under the
//!    lock and then wakes the thread, unless the thread sleeps watching the ring's completions
//!    with no deadline and completions are all that is left. The thread's sleep checks
//!    `generation` after announcing itself (`wake.rs`, invariant 1), so either the thread sees
//!    the bump or the combiner sees it parked.
//! 4. The loop ends in whichever driver's turn returns `Stopped` (or panics, in a combiner: the
//!    panic is caught there, not passed to the caller). The slot is emptied then, under the
//!    lock, which drops the loop (its queue is turned away: waiters see `Closed`), and the
//!    thread is woken; it exits when it finds the slot empty.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{fence, AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use super::caller_wait::DeferredWakes;
use super::event_loop::{ShardLoop, ShardTurn, ShardWait, ThreadTurn};
use super::wake::{Parker, Waker, Wakeup};

/// Turns one combining caller runs at most before it leaves the rest to the thread: enough for
/// a request's round plus the turn that finds the loop idle, few enough that a caller on a busy
/// shard does not serve everybody else's requests for long.
const COMBINE_TURNS_MAX: usize = 4;

/// A shard's loop shared between its thread and combining callers.
pub(crate) struct SharedLoop {
    slot: Mutex<Option<ShardLoop>>,
    /// The shard's waker (the one its senders hold).
    waker: Arc<Waker>,
    /// Bumped, under the lock, by a combiner that left work for the thread (invariant 3).
    generation: AtomicU64,
    /// The thread sleeps watching the ring's completions, with no deadline.
    watching_completions: AtomicBool,
    /// Callers that ran the loop's turns (`ShardStats::requests_combined`).
    combined: AtomicU64,
    /// Callers that found the loop held by another driver (`ShardStats::combine_found_busy`).
    found_busy: AtomicU64,
}

/// What a combiner's turns left behind.
#[derive(Debug, PartialEq, Eq)]
enum Left {
    /// Nothing: no I/O, nothing queued, no deadline.
    Idle,
    /// I/O in flight and nothing else: a completion, which the ring announces, is next.
    Completions,
    /// Anything else the thread must look at.
    Work,
    /// The loop stopped (or panicked): the slot must be emptied.
    Stopped,
}

impl SharedLoop {
    pub(crate) fn new(waker: Arc<Waker>) -> SharedLoop {
        SharedLoop {
            slot: Mutex::new(None),
            waker,
            generation: AtomicU64::new(0),
            watching_completions: AtomicBool::new(false),
            combined: AtomicU64::new(0),
            found_busy: AtomicU64::new(0),
        }
    }

    /// (callers that ran the loop's turns, callers that found it held by another driver).
    pub(crate) fn counts(&self) -> (u64, u64) {
        (self.combined.load(Ordering::Relaxed), self.found_busy.load(Ordering::Relaxed))
    }

    fn lock(&self) -> MutexGuard<'_, Option<ShardLoop>> {
        // A combiner catches panics inside its turns, so the mutex is poisoned only by a panic
        // of the thread's own turn, after which the thread is gone anyway.
        self.slot.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Runs `shard` on the calling thread (the shard's own) with combining callers, until it
    /// stops or a host takes it. Falls back to the plain thread driver when the engine cannot
    /// share its thread or offers no completion fd to sleep on.
    pub(crate) fn run_on_thread(&self, shard: ShardLoop) {
        let ring = match shard.completion_fd().map(|fd| fd.try_clone_to_owned()) {
            Some(Ok(ring)) if shard.can_share_thread() => ring,
            _ => return shard.run_on_thread(),
        };
        let parker = shard.parker_twin();
        *self.lock() = Some(shard);
        loop {
            // Declared before the guard: the callers this turn answers are woken once the loop
            // is let go (caller_wait.rs).
            let wakes = DeferredWakes::start();
            let mut guard = self.lock();
            let Some(shard) = guard.as_mut() else { return };
            let turn = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| shard.turn_inner(true)));
            let turn = match turn {
                Ok(turn) => turn,
                Err(panic) => {
                    // Drop the loop before the panic goes on: its queue is turned away and its
                    // receiver dropped, so no caller waits for a shard that is gone.
                    *guard = None;
                    std::panic::resume_unwind(panic);
                }
            };
            match turn {
                ThreadTurn::Turn(ShardTurn::Again) => {}
                ThreadTurn::Turn(ShardTurn::Wait(wait)) => {
                    let seen = self.generation.load(Ordering::SeqCst);
                    drop(guard);
                    drop(wakes);
                    self.sleep(&parker, &ring, wait, seen);
                }
                ThreadTurn::Turn(ShardTurn::Stopped) => {
                    *guard = None;
                    return;
                }
                ThreadTurn::HandOff(host) => {
                    let shard = guard.take().expect("the slot held the loop");
                    drop(guard);
                    drop(wakes);
                    match shard.hand_off(host) {
                        Some(refused) => *self.lock() = Some(refused),
                        None => return,
                    }
                }
            }
        }
    }

    /// The thread's sleep after a `Wait` turn, without the lock: until a message, a completion
    /// (if `wait.completions`), the deadline, or a combiner's bump of `generation` since `seen`.
    fn sleep(&self, parker: &Parker, ring: &OwnedFd, wait: ShardWait, seen: u64) {
        let ready = || {
            self.generation.load(Ordering::SeqCst) != seen
                || match self.slot.try_lock() {
                    Ok(slot) => slot.as_ref().is_none_or(|shard| shard.has_news()),
                    // A combiner runs the loop: look again once it is done.
                    Err(_) => true,
                }
        };
        let completions = wait.completions.then(|| ring.as_fd());
        self.watching_completions
            .store(wait.completions && wait.deadline.is_none(), Ordering::SeqCst);
        loop {
            match parker.park(ready, completions, wait.deadline) {
                Wakeup::Woken | Wakeup::Interrupted if !ready() => continue,
                _ => break,
            }
        }
        self.watching_completions.store(false, Ordering::SeqCst);
    }

    /// For a caller that has just queued a request on this shard: runs the loop's turns here if
    /// no other driver holds it (invariant 2). False when it did not run them (the loop is busy,
    /// on a host, or not shared): the caller then wakes the shard as any sender does.
    pub(crate) fn combine(&self) -> bool {
        let wakes = DeferredWakes::start();
        let Ok(mut guard) = self.slot.try_lock() else {
            self.found_busy.fetch_add(1, Ordering::Relaxed);
            return false;
        };
        let Some(shard) = guard.as_mut() else { return false };
        self.combined.fetch_add(1, Ordering::Relaxed);
        let shard_id = shard.shard_id();
        let left = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run_turns(shard)))
            .unwrap_or_else(|_| {
                tracing::error!(shard = shard_id, "a shard's turn panicked in a caller");
                Left::Stopped
            });
        if left == Left::Stopped {
            *guard = None;
        }
        if left == Left::Idle {
            return true;
        }
        self.generation.fetch_add(1, Ordering::SeqCst);
        drop(guard);
        drop(wakes);
        // Invariant 3: the bump is visible before `parked` and the watch are read.
        fence(Ordering::SeqCst);
        let watched = left == Left::Completions
            && self.waker.is_parked()
            && self.watching_completions.load(Ordering::SeqCst);
        if !watched {
            self.waker.wake();
        }
        true
    }
}

/// A combiner's turns (invariant 2).
fn run_turns(shard: &mut ShardLoop) -> Left {
    for _ in 0..COMBINE_TURNS_MAX {
        match shard.turn_as_caller() {
            ShardTurn::Stopped => return Left::Stopped,
            // A wait with something queued (an idle loop waits before it looks at the queue):
            // the next turn takes it.
            ShardTurn::Wait(_) if shard.has_news() => {}
            ShardTurn::Wait(wait) => {
                let thread_needed = shard.handoff_pending() || shard.has_deferred_submission();
                return match (wait.completions, wait.deadline, thread_needed) {
                    (false, None, false) => Left::Idle,
                    (true, None, false) => Left::Completions,
                    _ => Left::Work,
                };
            }
            ShardTurn::Again => {}
        }
    }
    Left::Work
}
