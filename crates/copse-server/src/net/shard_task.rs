//! A shard run as a task of a network thread (thread-per-core, RStore's design): the thread's
//! event loop runs the shard's turns (`copse::ShardLoop`) between its connections' tasks, so a
//! command whose key lives in this shard is queued, run and answered without leaving the thread,
//! and a wake from a connection here is a push on the thread's run queue, not a system call.
//!
//! Invariants:
//! 1. The task runs turns until the shard says `Stopped` (the store closed, or every handle to
//!    it gone); the network thread keeps running it after its connections are done, until then.
//! 2. It waits only when a turn asks to, and then for exactly what the turn names: a message
//!    (`ShardLoop::poll_messages`), the engine's deadline (a timer of this runtime), and, when
//!    asked, the completion fd (registered with this runtime's epoll).
//! 3. The completion fd is registered through a duplicate, so the registration never outlives
//!    the file it names, and never names a descriptor number the engine closed and the process
//!    reused for something else.
//! 4. After a turn that asks for no wait, the task yields: connections queued behind it run
//!    before the shard's next round, which then finds their requests batched.

use std::future::Future;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::task::Poll;

use copse::{ShardLoop, ShardTurn};
use tokio::io::unix::AsyncFd;

/// How often a shard whose completion fd could not be registered looks for completions.
const UNWATCHED_COMPLETION_POLL: std::time::Duration = std::time::Duration::from_micros(200);

/// The completion fd as registered here: the engine's descriptor number and its duplicate.
struct Registered {
    engine_fd: RawFd,
    watched: AsyncFd<OwnedFd>,
}

/// Drives `shard` until it stops.
pub async fn run(mut shard: ShardLoop) {
    let mut registered: Option<Registered> = None;
    let mut failure_logged = false;
    loop {
        let wait = match shard.turn() {
            ShardTurn::Again => {
                tokio::task::yield_now().await;
                continue;
            }
            ShardTurn::Stopped => return,
            ShardTurn::Wait(wait) => wait,
        };
        let mut watched = None;
        if wait.completions {
            watched = completion_fd(&shard, &mut registered, &mut failure_logged);
            if watched.is_none() {
                // The turn asked to wait for a completion that this runtime cannot watch for
                // (registration failed, logged): run the next turn after other tasks, which
                // reaps what has arrived, and meanwhile sleep a little rather than spin. Never
                // expected on Linux, where a ring fd polls.
                tokio::time::sleep(UNWATCHED_COMPLETION_POLL).await;
                continue;
            }
        }
        let mut deadline = wait
            .deadline
            .map(|at| Box::pin(tokio::time::sleep_until(tokio::time::Instant::from_std(at))));
        shard.begin_wait();
        std::future::poll_fn(|cx| {
            if shard.poll_messages(cx.waker()).is_ready() {
                return Poll::Ready(());
            }
            if let Some(watched) = watched {
                if let Poll::Ready(ready) = watched.poll_read_ready(cx) {
                    // Cleared before the next turn reaps: a completion that lands after the
                    // reap marks the fd ready again (the registration is edge-triggered).
                    if let Ok(mut guard) = ready {
                        guard.clear_ready();
                    }
                    return Poll::Ready(());
                }
            }
            if let Some(deadline) = deadline.as_mut() {
                if deadline.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(());
                }
            }
            Poll::Pending
        })
        .await;
        shard.end_wait();
    }
}

/// The shard's completion fd, registered with this runtime (once per descriptor it names).
fn completion_fd<'a>(
    shard: &ShardLoop,
    registered: &'a mut Option<Registered>,
    failure_logged: &mut bool,
) -> Option<&'a AsyncFd<OwnedFd>> {
    let fd = shard.completion_fd()?;
    let engine_fd = fd.as_raw_fd();
    if registered.as_ref().is_none_or(|known| known.engine_fd != engine_fd) {
        let watched = fd.try_clone_to_owned().and_then(|owned| {
            // SAFETY: `owned` is a duplicate this AsyncFd owns: it stays open, naming the same
            // file description, until the AsyncFd drops it, and `as_raw_fd` on an OwnedFd
            // always returns the same number.
            unsafe { AsyncFd::register_with_interest(owned, tokio::io::Interest::READABLE) }
                .map_err(|failed| failed.into())
        });
        match watched {
            Ok(watched) => *registered = Some(Registered { engine_fd, watched }),
            Err(err) => {
                if !std::mem::replace(failure_logged, true) {
                    tracing::error!(shard = shard.shard_id(), %err, "cannot watch the shard's completion fd; polling for completions instead");
                }
                return None;
            }
        }
    }
    registered.as_ref().map(|known| &known.watched)
}
