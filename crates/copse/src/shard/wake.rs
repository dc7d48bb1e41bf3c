//! How a shard thread sleeps: until a message reaches its queue, a completion of its engine's
//! I/O is ready, or the engine's next deadline passes, whichever comes first, in one system call
//! (a `ppoll(2)`, or a read of its eventfd when only a message can end the sleep); never a fixed
//! sleep, never a spin.
//!
//! The shard thread owns a [`Parker`]; everyone who sends it messages holds its [`Waker`] and
//! calls [`Waker::wake`] after each send (`ShardSender` in `mod.rs` does both). The waker's
//! eventfd is what the poll watches for messages; the engine supplies the completion fd (the
//! io_uring ring's fd, readable while completions wait in its completion queue) and the
//! deadline.
//!
//! Invariants:
//! 1. No lost wakeup. The parker announces itself (`parked`), then, after a SeqCst fence,
//!    checks whether anything is ready (the queue holds a message, say); only if not does it
//!    poll. A sender puts its message on the queue, then, after a SeqCst fence, reads `parked`.
//!    The two fences are ordered one way or the other: either the parker's check sees the
//!    message, or the sender sees `parked` and writes the eventfd, which stays readable until
//!    the parker reads it, so the poll returns at once.
//! 2. A sender writes the eventfd only while the shard is parked, and of the senders that see it
//!    parked only the one that clears `parked` writes: the send path of a busy shard costs a
//!    fence and a load, no system call.
//! 3. The completion fd is level-triggered: a completion that arrived between the engine's last
//!    reap and the poll makes the poll return at once.
//! 4. A deadline never wakes the poll early (ppoll takes nanoseconds, and its timer only runs
//!    late), so a shard waiting for a deadline makes one poll, not a run of short ones; a deadline
//!    already past returns without a system call.
//! 5. A park may return with nothing ready (`Interrupted` on EINTR; `Woken` by a wake whose
//!    message was already taken, or by a sender's handle dropped); the caller parks again then
//!    (the shard loop does), which is always safe.
//!
//! A shard handed to a host (`event_loop.rs`, thread-per-core: the server's network thread runs
//! the shard's rounds between its connections' tasks) sleeps as an async task instead: the same
//! `parked` protocol, but the waker wakes the task (`Waker::host`) rather than writing the
//! eventfd, so a wake from a connection on the same thread is a push on that thread's run queue,
//! with no system call. Invariant 1 holds as before: the task registers itself, announces it is
//! parked, and only then looks at the queue (`Parker::poll_messages`).
//!
//! Cost: a sleep that only a sender can end (no completion fd, no deadline: an idle shard) is
//! one blocking read of the eventfd, which waits and resets it in one call, so sleeping and
//! being woken cost two system calls (the read, the sender's write), as a futex wait and wake
//! would. Otherwise it is a ppoll, plus a read to reset the eventfd when a sender ended it.

use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::atomic::{fence, AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The sending side: shared by every sender of one shard.
pub struct Waker {
    /// Readable once a sender woke the parked shard; the parker reads it back to zero.
    eventfd: OwnedFd,
    /// The shard is (about to be) asleep in `Parker::park` (or, hosted, in `poll_messages`).
    parked: AtomicBool,
    /// Set once the shard runs as a task of a host: a wake wakes `task` instead of writing the
    /// eventfd. Set while the shard is not parked, before it is handed over.
    hosted: AtomicBool,
    /// The hosted shard's task, registered at each `poll_messages`.
    task: futures::task::AtomicWaker,
}

impl Waker {
    /// Call after putting a message on the shard's queue (or after anything else the shard's
    /// readiness check looks at changed). Costs a fence and a load unless the shard is parked.
    pub fn wake(&self) {
        // Invariant 1: the message is on the queue before `parked` is read.
        fence(Ordering::SeqCst);
        if self.parked.load(Ordering::Relaxed) && self.parked.swap(false, Ordering::Relaxed) {
            if self.hosted.load(Ordering::Relaxed) {
                self.task.wake();
            } else {
                self.signal();
            }
        }
    }

    /// Whether the shard is (about to be) asleep. Read after a SeqCst fence, it tells a driver
    /// that changed the shard's state (`combine.rs`) whether the sleep could miss it.
    pub(crate) fn is_parked(&self) -> bool {
        self.parked.load(Ordering::SeqCst)
    }

    fn signal(&self) {
        let one: u64 = 1;
        // SAFETY: writes the 8 bytes of `one`, which lives across the call, to an eventfd this
        // waker owns. It adds one to a counter the parker resets at every wakeup, so it never
        // reaches the overflow at which a write would block or fail.
        let _ = unsafe {
            libc::write(
                self.eventfd.as_raw_fd(),
                (&one as *const u64).cast::<libc::c_void>(),
                std::mem::size_of::<u64>(),
            )
        };
    }
}

/// Why `Parker::park` returned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wakeup {
    /// The readiness check found work after the parker announced itself: no poll was made.
    Ready,
    /// A sender woke the shard.
    Woken,
    /// The completion fd became readable.
    Completion,
    /// The deadline passed.
    Deadline,
    /// The poll returned for no reason it reports (EINTR: a signal or task work ran).
    Interrupted,
}

/// The shard thread's side. Not `Clone`: one thread parks.
pub struct Parker {
    waker: Arc<Waker>,
}

impl Parker {
    /// A parker and the waker its senders share.
    pub fn new() -> std::io::Result<(Parker, Arc<Waker>)> {
        // Blocking: an idle shard sleeps in its read. A write blocks only when the counter
        // would pass 2^64 - 2, and each wakeup adds one to a counter every sleep resets.
        // SAFETY: eventfd takes no pointers; it returns a new descriptor or -1.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by eventfd and is owned by nothing else.
        let eventfd = unsafe { OwnedFd::from_raw_fd(fd) };
        let waker = Arc::new(Waker {
            eventfd,
            parked: AtomicBool::new(false),
            hosted: AtomicBool::new(false),
            task: futures::task::AtomicWaker::new(),
        });
        Ok((Parker { waker: waker.clone() }, waker))
    }

    /// A second handle on the same waker, for a driver that sleeps outside the loop that owns
    /// this one (`combine.rs`). Still one thread parks: the twin's driver is the shard's thread,
    /// and the loop's own parker sleeps only once the loop is handed to a host.
    pub(crate) fn twin(&self) -> Parker {
        Parker { waker: self.waker.clone() }
    }

    /// From now on the shard sleeps as a task (`poll_messages`), not in `park`. Call while not
    /// parked, before the shard's state leaves its thread.
    pub fn host(&self) {
        debug_assert!(!self.waker.parked.load(Ordering::Relaxed));
        self.waker.hosted.store(true, Ordering::SeqCst);
    }

    /// Back to sleeping in `park` (a host that asked for the shard went away before taking it).
    pub fn unhost(&self) {
        self.waker.hosted.store(false, Ordering::SeqCst);
    }

    /// A hosted shard's sleep on its queue, as a poll: `Ready` once a sender woke it, or at once
    /// when `ready` (checked after the task registered itself and announced it is parked, so no
    /// wakeup is lost: invariant 1) says there is work. `Pending` leaves the task registered
    /// and the shard parked; a later poll returns `Ready` once a sender cleared `parked`.
    /// `parking` tells a first poll (announce, then check) from a later one (was it woken?);
    /// the caller sets it true before the first poll of each sleep.
    pub fn poll_messages(
        &self,
        task: &std::task::Waker,
        parking: &mut bool,
        ready: impl FnOnce() -> bool,
    ) -> std::task::Poll<()> {
        debug_assert!(self.waker.hosted.load(Ordering::Relaxed));
        self.waker.task.register(task);
        if std::mem::take(parking) {
            self.waker.parked.store(true, Ordering::Relaxed);
            // Invariant 1: `parked` is set before the queue is looked at.
            fence(Ordering::SeqCst);
            if ready() {
                self.waker.parked.store(false, Ordering::Relaxed);
                return std::task::Poll::Ready(());
            }
            return std::task::Poll::Pending;
        }
        if self.waker.parked.load(Ordering::Relaxed) {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    }

    /// Ends a hosted sleep that something other than a sender ended (a completion, a
    /// deadline): senders stop waking the task.
    pub fn unpark(&self) {
        self.waker.parked.store(false, Ordering::Relaxed);
    }

    /// Sleeps until a sender wakes the shard, `completions` (if any) becomes readable, or
    /// `deadline` (if any) passes, unless `ready` (checked after the parker announced itself, so
    /// no wakeup is lost: invariant 1) says there is work already. `ready` must look at
    /// everything senders change before they call `Waker::wake` (the queue).
    pub fn park(
        &self,
        ready: impl FnOnce() -> bool,
        completions: Option<BorrowedFd<'_>>,
        deadline: Option<Instant>,
    ) -> Wakeup {
        let timeout = match deadline {
            Some(deadline) => match deadline.checked_duration_since(Instant::now()) {
                Some(left) if !left.is_zero() => Some(left),
                _ => return Wakeup::Deadline,
            },
            None => None,
        };
        self.waker.parked.store(true, Ordering::Relaxed);
        // Invariant 1: `parked` is set before the queue is looked at.
        fence(Ordering::SeqCst);
        if ready() {
            self.waker.parked.store(false, Ordering::Relaxed);
            return Wakeup::Ready;
        }
        if completions.is_none() && timeout.is_none() {
            // Only a sender can end this sleep: wait in the read that resets the eventfd.
            let woken = self.read_eventfd();
            self.waker.parked.store(false, Ordering::Relaxed);
            return if woken { Wakeup::Woken } else { Wakeup::Interrupted };
        }
        let (woken, completed) = poll(self.waker.eventfd.as_raw_fd(), completions, timeout);
        self.waker.parked.store(false, Ordering::Relaxed);
        if woken {
            // Readable: the counter is above zero and only this thread reads it, so the read
            // returns at once.
            self.read_eventfd();
        }
        match (woken, completed) {
            (true, _) => Wakeup::Woken,
            (false, true) => Wakeup::Completion,
            (false, false) => match deadline {
                Some(deadline) if Instant::now() >= deadline => Wakeup::Deadline,
                _ => Wakeup::Interrupted,
            },
        }
    }

    /// Waits until a sender has written the eventfd (at once if one has), then resets it to
    /// zero, so the next sleep lasts until the next wakeup. False if a signal interrupted it.
    fn read_eventfd(&self) -> bool {
        let mut count: u64 = 0;
        // SAFETY: reads 8 bytes into `count`, which lives across the call, from the eventfd the
        // waker owns.
        let read = unsafe {
            libc::read(
                self.waker.eventfd.as_raw_fd(),
                (&mut count as *mut u64).cast::<libc::c_void>(),
                std::mem::size_of::<u64>(),
            )
        };
        read == std::mem::size_of::<u64>() as isize
    }
}

/// One ppoll over the eventfd and the completion fd: (eventfd readable, completion fd readable).
/// Errors (EINTR; ENOMEM) read as neither, which the caller reports as `Interrupted`.
fn poll(
    eventfd: std::os::fd::RawFd,
    completions: Option<BorrowedFd<'_>>,
    timeout: Option<Duration>,
) -> (bool, bool) {
    let mut fds = [
        libc::pollfd { fd: eventfd, events: libc::POLLIN, revents: 0 },
        libc::pollfd {
            // A negative fd is ignored by poll: no completion fd, no entry.
            fd: completions.map_or(-1, |fd| fd.as_raw_fd()),
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    let timespec = timeout.map(|left| libc::timespec {
        tv_sec: left.as_secs().min(libc::time_t::MAX as u64) as libc::time_t,
        tv_nsec: left.subsec_nanos() as libc::c_long,
    });
    let timeout_ptr = timespec.as_ref().map_or(std::ptr::null(), |t| t as *const libc::timespec);
    // SAFETY: `fds` is an array of `fds.len()` initialized pollfd entries that outlives the
    // call, and the kernel writes only their `revents`; `timeout_ptr` is null (wait without
    // limit) or points at `timespec`, which also outlives the call; a null signal mask leaves
    // the thread's mask alone. The fds are the waker's eventfd (owned by `self`) and the
    // borrowed completion fd, both open for the duration of the call.
    let result = unsafe {
        libc::ppoll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout_ptr, std::ptr::null())
    };
    if result <= 0 {
        return (false, false);
    }
    let readable = |entry: &libc::pollfd| entry.revents & (libc::POLLIN | libc::POLLERR) != 0;
    (readable(&fds[0]), fds[1].fd >= 0 && readable(&fds[1]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;
    use std::time::Duration;

    /// How late a wakeup may come on a loaded 2-core test machine and still count as prompt.
    const WAKE_LATENESS_MAX: Duration = Duration::from_millis(500);

    fn parker() -> (Parker, Arc<Waker>) {
        Parker::new().expect("eventfd")
    }

    #[test]
    fn a_wake_before_the_park_is_not_lost() {
        let (parker, waker) = parker();
        // The message was sent and the wake came while the shard was not yet parked: the flag
        // was clear, so no eventfd write; the readiness check must catch it.
        let queued = AtomicBool::new(false);
        queued.store(true, Ordering::Relaxed);
        waker.wake();
        let started = Instant::now();
        let far = Some(started + Duration::from_secs(60));
        assert_eq!(parker.park(|| queued.load(Ordering::Relaxed), None, far), Wakeup::Ready);
        assert!(started.elapsed() < WAKE_LATENESS_MAX);
    }

    #[test]
    fn a_wake_between_the_check_and_the_poll_is_not_lost() {
        let (parker, waker) = parker();
        // The sender's message lands after the readiness check said "nothing": it sees the
        // parked flag and writes the eventfd, which the poll then finds readable.
        let started = Instant::now();
        let far = Some(started + Duration::from_secs(60));
        let woken = parker.park(
            || {
                waker.wake();
                false
            },
            None,
            far,
        );
        assert_eq!(woken, Wakeup::Woken);
        assert!(started.elapsed() < WAKE_LATENESS_MAX);
        // The eventfd was drained: the next park sleeps until its deadline.
        let soon = Instant::now() + Duration::from_millis(20);
        assert_eq!(parker.park(|| false, None, Some(soon)), Wakeup::Deadline);
        assert!(Instant::now() >= soon);
    }

    #[test]
    fn a_wake_from_another_thread_ends_the_park() {
        // Even rounds sleep in a poll (there is a deadline), odd ones in the eventfd's read.
        for round in 0..400 {
            let (parker, waker) = parker();
            let queued = Arc::new(AtomicBool::new(false));
            let sender = {
                let queued = queued.clone();
                std::thread::spawn(move || {
                    queued.store(true, Ordering::Relaxed);
                    waker.wake();
                })
            };
            let started = Instant::now();
            let far = (round % 2 == 0).then(|| started + Duration::from_secs(60));
            let woken = parker.park(|| queued.load(Ordering::Relaxed), None, far);
            assert!(matches!(woken, Wakeup::Ready | Wakeup::Woken), "{woken:?}");
            assert!(started.elapsed() < WAKE_LATENESS_MAX, "woken after {:?}", started.elapsed());
            sender.join().unwrap();
        }
    }

    #[test]
    fn a_wake_of_an_unparked_shard_makes_no_system_call() {
        let (parker, waker) = parker();
        waker.wake();
        waker.wake();
        // Nothing was written: a park with a short deadline sleeps until the deadline.
        let soon = Instant::now() + Duration::from_millis(20);
        assert_eq!(parker.park(|| false, None, Some(soon)), Wakeup::Deadline);
    }

    #[test]
    fn the_deadline_ends_the_park_on_time() {
        let (parker, _waker) = parker();
        for wait in [Duration::from_micros(300), Duration::from_millis(30)] {
            let started = Instant::now();
            let deadline = started + wait;
            assert_eq!(parker.park(|| false, None, Some(deadline)), Wakeup::Deadline);
            let woke = Instant::now();
            assert!(woke >= deadline, "woke {:?} early", deadline - woke);
            assert!(woke - deadline < WAKE_LATENESS_MAX, "woke {:?} late", woke - deadline);
        }
        // A deadline already past returns at once.
        let past = Instant::now() - Duration::from_millis(1);
        assert_eq!(parker.park(|| false, None, Some(past)), Wakeup::Deadline);
    }

    #[test]
    fn a_completion_fd_ends_the_park() {
        let (parker, _waker) = parker();
        // Another eventfd stands in for the device's completion fd.
        let (completion_parker, completion_waker) = self::parker();
        let completion_fd = completion_parker.waker.eventfd.as_fd();
        completion_waker.parked.store(true, Ordering::Relaxed);
        let signaller = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            completion_waker.wake();
        });
        let started = Instant::now();
        let far = Some(started + Duration::from_secs(60));
        assert_eq!(parker.park(|| false, Some(completion_fd), far), Wakeup::Completion);
        assert!(started.elapsed() < WAKE_LATENESS_MAX);
        signaller.join().unwrap();
    }

    #[test]
    fn without_a_deadline_only_an_event_ends_the_park() {
        let (parker, waker) = parker();
        let queued = Arc::new(AtomicBool::new(false));
        let started = Instant::now();
        let sender = {
            let queued = queued.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(50));
                queued.store(true, Ordering::Relaxed);
                waker.wake();
            })
        };
        let woken = parker.park(|| queued.load(Ordering::Relaxed), None, None);
        assert!(matches!(woken, Wakeup::Ready | Wakeup::Woken), "{woken:?}");
        assert!(started.elapsed() >= Duration::from_millis(50));
        sender.join().unwrap();
    }
}
