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
//! it, except to give back reads it took: invariant 5). An engine that blocks its thread
//! (RocksDB, the synchronous device) is never combined: its loop stays on its thread
//! (`ShardLoop::run_on_thread`) and `slot` stays empty.
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
//!    just to post it (measured: combining with callers submitting was slower than none; so
//!    was a caller that submitted and waited in a poll of the ring, docs/benchmarks.md). The
//!    exception is invariant 5.
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
//! 5. A combining caller whose answer its turns did not give, and whose turns held back nothing but
//!    at most `TAKEN_READS_MAX` reads (its own miss among them, in the common case), takes those
//!    reads (`BlockDevice::take_reads`), lets the loop go, and performs them with pread(2) on its
//!    own thread, as RocksDB's reader does: the device's interrupt wakes the thread that waits in
//!    the read, and no task work runs anywhere else. It then takes the loop again, waiting for the
//!    lock if it must, gives the reads back and runs turns, which reap them and answer it. Until
//!    then the reads count as in flight (the engine is not idle, the loop does not stop or move to
//!    a host), but nothing waits for them: `reap` never does, and a loop with only taken reads in
//!    flight needs no wake (the caller comes back). So every taken read is given back by the caller
//!    that took it, and the turns it runs then leave the loop as any combiner's do (invariant 3).
//!    This replaced a caller alone on the shard submitting its miss and waiting for it in the ring
//!    with the loop held, which needed a window of quiet callers to keep others from queueing
//!    behind the wait, and was no faster at one caller (docs/benchmarks.md, "A caller performs its
//!    own read").

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{fence, AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use futures::channel::oneshot;

use super::caller_wait::DeferredWakes;
use super::event_loop::{ShardLoop, ShardTurn, ShardWait, ThreadTurn};
use super::wake::{Parker, Waker, Wakeup};

/// Turns one combining caller runs at most before it leaves the rest to the thread: enough for
/// a request's round plus the turn that finds the loop idle, few enough that a caller on a busy
/// shard does not serve everybody else's requests for long.
const COMBINE_TURNS_MAX: usize = 4;

/// Reads a combining caller takes from its turns and performs itself, one after the other
/// (invariant 5): its own miss and those of the few requests its turns took with it. More are
/// left to the ring, where they run in parallel. Measured at 16 callers: 3 ahead of 1, and 8
/// no better than 3 (docs/benchmarks.md, "A caller performs its own read").
const TAKEN_READS_MAX: usize = 3;

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
    /// Callers that left I/O held back for the thread to submit.
    left_io_for_thread: AtomicU64,
    /// Reads callers took and performed themselves (invariant 5).
    reads_taken: AtomicU64,
}

/// Flat combining's counts for one shard (`ShardStats` has their meaning).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CombineCounts {
    pub combined: u64,
    pub found_busy: u64,
    pub left_io_for_thread: u64,
    pub reads_taken: u64,
}

/// What a caller's `call` came to.
pub(crate) enum Call<T> {
    /// It did not run the loop (busy, on a host, or not shared): the caller wakes the shard and
    /// waits for its answer.
    NotRun,
    /// It ran the loop's turns; the answer is still to come.
    Ran,
    /// It ran them and has its answer (`Err`: the request was dropped, the shard is gone).
    Answered(Result<T, oneshot::Canceled>),
}

/// How a combiner's turns ended.
enum Ended {
    /// The loop stopped (or panicked).
    Stopped,
    /// A turn said to wait, with nothing queued.
    Wait(ShardWait),
    /// `COMBINE_TURNS_MAX` turns went by.
    TurnsUsed,
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
            left_io_for_thread: AtomicU64::new(0),
            reads_taken: AtomicU64::new(0),
        }
    }

    pub(crate) fn counts(&self) -> CombineCounts {
        CombineCounts {
            combined: self.combined.load(Ordering::Relaxed),
            found_busy: self.found_busy.load(Ordering::Relaxed),
            left_io_for_thread: self.left_io_for_thread.load(Ordering::Relaxed),
            reads_taken: self.reads_taken.load(Ordering::Relaxed),
        }
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

    /// For a caller that has just queued a request on this shard and waits for its answer in
    /// `receiver`: runs the loop's turns here if no other driver holds it (invariant 2), and
    /// performs its own read when they leave one (invariant 5).
    pub(crate) fn call<T>(&self, receiver: &mut oneshot::Receiver<T>) -> Call<T> {
        let wakes = DeferredWakes::start();
        let Ok(mut guard) = self.slot.try_lock() else {
            self.found_busy.fetch_add(1, Ordering::Relaxed);
            return Call::NotRun;
        };
        let Some(shard) = guard.as_mut() else { return Call::NotRun };
        self.combined.fetch_add(1, Ordering::Relaxed);
        let ended = turns(shard);
        let answer = try_answer(receiver);
        let mut taken = Vec::new();
        if answer.is_none() && matches!(ended, Ended::Wait(_)) && !shard.handoff_pending() {
            taken = shard.take_reads(TAKEN_READS_MAX);
        }
        self.leave(guard, ended, wakes);
        if taken.is_empty() {
            return answer.map_or(Call::Ran, Call::Answered);
        }
        self.reads_taken.fetch_add(taken.len() as u64, Ordering::Relaxed);
        for read in &mut taken {
            read.perform();
        }
        // Invariant 5: the reads go back to the loop through this caller, whoever holds it now.
        let wakes = DeferredWakes::start();
        let mut guard = self.lock();
        let Some(shard) = guard.as_mut() else {
            // The loop stopped meanwhile (a panic in a driver): the device leaked the buffers
            // these reads point into, and dropped the request, which the caller's wait sees.
            return Call::Ran;
        };
        shard.give_back(taken);
        let ended = turns(shard);
        self.leave(guard, ended, wakes);
        try_answer(receiver).map_or(Call::Ran, Call::Answered)
    }

    /// Lets the loop go after a combiner's turns, leaving it watched (invariants 3 and 4).
    fn leave(
        &self,
        mut guard: MutexGuard<'_, Option<ShardLoop>>,
        ended: Ended,
        wakes: DeferredWakes,
    ) {
        let left = match (&ended, guard.as_ref()) {
            (Ended::Stopped, _) | (_, None) => Left::Stopped,
            (Ended::TurnsUsed, Some(_)) => Left::Work,
            (Ended::Wait(wait), Some(shard)) => left_after(shard, wait),
        };
        if let Some(shard) = guard.as_ref().filter(|_| left != Left::Stopped) {
            if shard.has_deferred_submission() {
                self.left_io_for_thread.fetch_add(1, Ordering::Relaxed);
            }
        }
        if left == Left::Stopped {
            *guard = None;
        }
        if left == Left::Idle {
            drop(guard);
            drop(wakes);
            return;
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
    }
}

/// A combiner's turns with the loop held, caught if they panic (invariant 4).
fn turns(shard: &mut ShardLoop) -> Ended {
    let shard_id = shard.shard_id();
    let turns = std::panic::AssertUnwindSafe(|| run_turns(shard));
    std::panic::catch_unwind(turns).unwrap_or_else(|_| {
        tracing::error!(shard = shard_id, "a shard's turn panicked in a caller");
        Ended::Stopped
    })
}

/// The answer in `receiver`, if it has come (or the request was dropped).
fn try_answer<T>(receiver: &mut oneshot::Receiver<T>) -> Option<Result<T, oneshot::Canceled>> {
    match receiver.try_recv() {
        Ok(Some(answer)) => Some(Ok(answer)),
        Ok(None) => None,
        Err(canceled) => Some(Err(canceled)),
    }
}

/// What a combiner's turns that ended in `wait` leave behind. Reads a caller took are no
/// completions to watch for: the caller gives them back and runs the turns that follow
/// (invariant 5).
fn left_after(shard: &ShardLoop, wait: &ShardWait) -> Left {
    let thread_needed = shard.handoff_pending() || shard.has_deferred_submission();
    let completions = wait.completions && shard.has_io_in_kernel();
    match (completions, wait.deadline, thread_needed) {
        (false, None, false) => Left::Idle,
        (true, None, false) => Left::Completions,
        _ => Left::Work,
    }
}

/// A combiner's turns (invariant 2).
fn run_turns(shard: &mut ShardLoop) -> Ended {
    for _ in 0..COMBINE_TURNS_MAX {
        match shard.turn_as_caller() {
            ShardTurn::Stopped => return Ended::Stopped,
            // A wait with something queued (an idle loop waits before it looks at the queue):
            // the next turn takes it.
            ShardTurn::Wait(_) if shard.has_news() => {}
            ShardTurn::Wait(wait) => return Ended::Wait(wait),
            ShardTurn::Again => {}
        }
    }
    Ended::TurnsUsed
}
