//! How a blocking caller of the embedded API waits for its shard's answer ([`block_on`]), and
//! how a driver that answers while holding a shard's loop (`combine.rs`) puts off waking those
//! callers until it has let the loop go ([`DeferredWakes`]).
//!
//! Why: a wake is a futex system call and, on this 2-core machine, often a switch to the woken
//! thread; made while the loop's lock is held, every caller that arrives meanwhile finds the
//! loop busy and has to wake the shard's thread instead of combining. The thread's turns answer
//! many callers each (a round's completions), so their wakes are most of the time it holds the
//! lock.
//!
//! Invariants:
//! 1. No wake is lost: a deferred wake is made when its `DeferredWakes` drops, which the driver
//!    does before it sleeps or returns (and unwinding does on a panic). The waiter's flag is
//!    set at once, so a caller that looks before the wake comes finds its answer and goes on.
//! 2. Only wakers made by `block_on` are deferred, only on a thread between `DeferredWakes::start`
//!    and its drop; every other waker (an async caller's) is woken at once, as before.

use std::cell::RefCell;
use std::future::Future;
use std::pin::pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::thread::Thread;

thread_local! {
    /// The wakes put off on this thread while a `DeferredWakes` lives.
    static DEFERRED: RefCell<Option<Vec<Arc<CallerWaker>>>> = const { RefCell::new(None) };
}

/// Wakes a thread blocked in `block_on`.
struct CallerWaker {
    thread: Thread,
    /// Set by a wake; `block_on` polls again only then (park may return for no reason).
    woken: AtomicBool,
}

impl Wake for CallerWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::Release);
        let deferred = DEFERRED.with(|deferred| match deferred.borrow_mut().as_mut() {
            Some(list) => {
                list.push(self.clone());
                true
            }
            None => false,
        });
        if !deferred {
            self.thread.unpark();
        }
    }
}

/// Runs `future` to completion on the calling thread, parking it in between (as
/// `futures::executor::block_on` does, with a waker whose wake a driver may put off).
pub fn block_on<F: Future>(future: F) -> F::Output {
    let mut future = pin!(future);
    let caller =
        Arc::new(CallerWaker { thread: std::thread::current(), woken: AtomicBool::new(false) });
    let waker = Waker::from(caller.clone());
    let mut context = Context::from_waker(&waker);
    loop {
        if let Poll::Ready(output) = future.as_mut().poll(&mut context) {
            return output;
        }
        while !caller.woken.swap(false, Ordering::Acquire) {
            std::thread::park();
        }
    }
}

/// While it lives, wakes of `block_on` callers made on this thread are collected; they are made
/// when it drops. Start it before taking a shard's loop and drop it after letting go.
pub(crate) struct DeferredWakes(());

impl DeferredWakes {
    pub(crate) fn start() -> DeferredWakes {
        DEFERRED.with(|deferred| {
            let mut deferred = deferred.borrow_mut();
            debug_assert!(deferred.is_none(), "wakes are already being put off on this thread");
            *deferred = Some(Vec::new());
        });
        DeferredWakes(())
    }
}

impl Drop for DeferredWakes {
    fn drop(&mut self) {
        let list = DEFERRED.with(|deferred| deferred.borrow_mut().take());
        for caller in list.into_iter().flatten() {
            caller.thread.unpark();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_deferred_wake_is_made_when_the_guard_drops() {
        let (sender, receiver) = futures::channel::oneshot::channel::<u32>();
        let waiter = std::thread::spawn(move || block_on(receiver).unwrap());
        // Let the waiter park on its answer.
        std::thread::sleep(Duration::from_millis(50));
        let deferred = DeferredWakes::start();
        sender.send(7).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        assert!(!waiter.is_finished(), "the waiter was woken before the guard dropped");
        drop(deferred);
        assert_eq!(waiter.join().unwrap(), 7);
    }

    #[test]
    fn an_answer_already_there_is_taken_without_parking() {
        let (sender, receiver) = futures::channel::oneshot::channel::<u32>();
        sender.send(3).unwrap();
        assert_eq!(block_on(receiver).unwrap(), 3);
    }
}
