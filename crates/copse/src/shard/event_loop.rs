//! The shard's event loop, as turns: [`ShardLoop::turn`] runs one round and says what the loop
//! waits for before the next one. Two drivers run the turns:
//! - the shard's own thread (`run_on_thread`), which sleeps in its `Parker` (`wake.rs`);
//! - a host (thread-per-core, RStore's design): a server's network thread runs the shard as
//!   one task among its connections, and sleeps in its own event loop on the same things (the
//!   queue, through `poll_messages`; the completion fd; the deadline). A connection whose key
//!   lives in that shard then reaches it, and is answered, without leaving its thread.
//!
//! A shard starts on its own thread (recovery and the cross-shard resolution run there) and is
//! handed to a host only when asked (`Message::HandOff`) and only if its engine can share a
//! thread (`ShardEngine::can_share_thread`). Once handed over, its thread waits until the loop
//! ends wherever it runs, so joining the thread still means the shard has stopped.
//!
//! Invariants (of the turns, whoever drives them):
//! 1. A turn never blocks on the queue or on a completion; it blocks only where the engine does
//!    (a flush, or `reap(true)` on a device that completes on demand, which returns at once).
//! 2. A driver waits only when a turn returns `Wait`, and then for the queue, the deadline,
//!    and, if `completions`, the completion fd, whichever comes first; a wait that ends for no
//!    reason is harmless (the next turn finds nothing and may ask to wait again).
//! 3. The loop stops (`Stopped`) only after answering the close order, or once every sender is
//!    gone and the engine is idle; what is still queued then is turned away.

use std::os::fd::BorrowedFd;
use std::time::Instant;

use super::exec::ExecTable;
use super::gate::Gate;
use super::wake::{Parker, Wakeup};
use super::Message;
use crate::engine::{Request, ShardEngine};
use crate::error::WriteError;
use crate::limits::ROUND_REQUESTS_MAX;

type CloseReply = futures::channel::oneshot::Sender<Result<(), WriteError>>;

/// What a turn asks of its driver.
#[derive(Debug)]
pub enum ShardTurn {
    /// Run the next turn (a host may run other work first).
    Again,
    /// Wait for a message, the deadline, or (if asked) a completion, then run the next turn.
    Wait(ShardWait),
    /// The shard has stopped; drop the loop.
    Stopped,
}

/// What a waiting shard waits for besides its queue.
#[derive(Clone, Copy, Debug)]
pub struct ShardWait {
    /// A completion of the engine's I/O (`ShardLoop::completion_fd` polls readable).
    pub completions: bool,
    /// The engine's next deadline, if any.
    pub deadline: Option<Instant>,
}

/// What a turn tells the shard's own thread: a `ShardTurn`, or that a host asked for the loop.
pub(crate) enum ThreadTurn {
    Turn(ShardTurn),
    HandOff(std::sync::mpsc::SyncSender<ShardLoop>),
}

/// A shard's state and event loop: its engine behind the gate, its queue, its execs.
pub struct ShardLoop {
    engine: Gate,
    receiver: flume::Receiver<Message>,
    parker: Parker,
    closing: Option<CloseReply>,
    /// Close orders after the first, answered as the shard stops (as `finish` answers them).
    late_closes: Vec<CloseReply>,
    /// False once every sender is gone: the queue can bring nothing more.
    connected: bool,
    requests: Vec<Request>,
    execs: ExecTable,
    /// The last turn asked to wait: this one goes to the queue without asking again.
    waited: bool,
    /// The last turn waited for a completion: this one starts by reaping it.
    reap_first: bool,
    /// A host asked for the loop (taken by the thread driver at the end of the turn).
    handoff: Option<std::sync::mpsc::SyncSender<ShardLoop>>,
    /// Set by a host's driver before the first poll of each wait (`poll_messages`).
    parking: bool,
    /// Held while a host runs the loop; the shard's thread waits for it to drop.
    running_hosted: Option<std::sync::mpsc::Sender<()>>,
    /// The engine holds its submissions back: a combining caller ran the last turn.
    submission_deferred: bool,
}

impl ShardLoop {
    pub(crate) fn new(engine: Gate, receiver: flume::Receiver<Message>, parker: Parker) -> Self {
        ShardLoop {
            engine,
            receiver,
            parker,
            closing: None,
            late_closes: Vec::new(),
            connected: true,
            requests: Vec::with_capacity(ROUND_REQUESTS_MAX),
            execs: ExecTable::default(),
            waited: false,
            reap_first: false,
            handoff: None,
            parking: false,
            running_hosted: None,
            submission_deferred: false,
        }
    }

    pub fn shard_id(&self) -> u32 {
        self.engine.shard_id()
    }

    /// One round of the loop (KVell worker, p2KVS opportunistic batching): take what is queued,
    /// never waiting to fill a batch; hand it to the engine in runs; move the execs; submit;
    /// reap what completed; and say what to wait for, if anything, before the next round.
    ///
    /// This is the turn of a host or of a combining caller (`combine.rs`): a hand-off asked for
    /// stays pending for the thread driver (`handoff_pending`); a hosted loop refuses them.
    pub fn turn(&mut self) -> ShardTurn {
        match self.turn_inner(false) {
            ThreadTurn::Turn(turn) => turn,
            ThreadTurn::HandOff(_) => unreachable!("a turn off the shard's thread takes no hand-off"),
        }
    }

    /// A combining caller's turn (`combine.rs`): as `turn`, with the engine's submissions held
    /// back for the thread (`ShardEngine::defer_submission`), so that no completion is tied to
    /// the caller's thread.
    pub(crate) fn turn_as_caller(&mut self) -> ShardTurn {
        if !self.submission_deferred {
            self.engine.defer_submission(true);
            self.submission_deferred = true;
        }
        self.turn()
    }

    /// Whether the engine holds back I/O that the shard's thread must submit.
    pub(crate) fn has_deferred_submission(&self) -> bool {
        self.engine.has_deferred_submission()
    }

    /// For a combining caller (`combine.rs`, invariant 5): the I/O its turns held back, if it is
    /// at most `max` reads, to perform on its own thread without the loop.
    pub(crate) fn take_reads(&mut self, max: usize) -> Vec<crate::device::TakenRead> {
        self.engine.take_reads(max)
    }

    /// Completes reads taken by `take_reads`: the next turn reaps them.
    pub(crate) fn give_back(&mut self, reads: Vec<crate::device::TakenRead>) {
        self.engine.give_back(reads);
        // Whatever the last turn said to wait for, there is a completion to reap now.
        self.reap_first = true;
    }

    /// Whether I/O is in flight that a completion of the device will announce (not only reads
    /// a caller took).
    pub(crate) fn has_io_in_kernel(&self) -> bool {
        self.engine.has_io_in_kernel()
    }

    /// A turn; `on_thread` when the shard's own thread runs it, the only driver that hands the
    /// loop over (and that submits what a combining caller held back).
    pub(crate) fn turn_inner(&mut self, on_thread: bool) -> ThreadTurn {
        if on_thread && std::mem::take(&mut self.submission_deferred) {
            self.engine.defer_submission(false);
        }
        if std::mem::take(&mut self.reap_first) {
            // The last turn waited for a completion (nothing new had arrived or moved).
            self.engine.reap(false);
            return self.after_reap(0, false, on_thread);
        }
        let waited = std::mem::take(&mut self.waited);
        if !waited && self.closing.is_none() && self.connected && self.engine.is_idle() {
            // Every exec that is not blocked waits on the engine, so an idle engine with nothing
            // queued means there is nothing to do but wait for a message (or a deadline).
            return self.wait(false, on_thread);
        }
        // Take what is queued, never waiting to fill a batch. Once closing, what arrives is
        // turned away as `finish` would at the end, so that a wake still moves the execs left.
        let mut messages = 0;
        while messages < ROUND_REQUESTS_MAX && self.connected {
            match self.receiver.try_recv() {
                Ok(message) => {
                    // A message of several execs counts as that many toward the round's bound.
                    messages += message.work_items();
                    if self.closing.is_some() {
                        turn_away(message, &mut self.late_closes);
                    } else {
                        self.take(message);
                    }
                }
                Err(flume::TryRecvError::Empty) => break,
                Err(flume::TryRecvError::Disconnected) => {
                    self.connected = false;
                    messages += 1;
                }
            }
        }
        if !self.connected && self.closing.is_none() && self.engine.is_idle() {
            // Every handle is gone without a close: finish and stop.
            self.stop_unclosed();
            return ThreadTurn::Turn(ShardTurn::Stopped);
        }
        let took = self.requests.len();
        self.engine.handle_in_runs(self.requests.drain(..));
        let execs_moved = self.execs.pump(&mut self.engine);
        self.engine.end_round();
        if took == 0 && !execs_moved && self.engine.has_io_in_flight() {
            // Nothing new arrived or moved this round: wait for a completion, or for a message
            // or the engine's deadline, whichever comes first. A device without a completion
            // fd completes on demand, so reaping is the wait.
            if self.engine.completion_fd().is_some() {
                self.reap_first = true;
                return self.wait(true, on_thread);
            }
            self.engine.reap(true);
        } else {
            // Collect what has completed and go back to the queue.
            self.engine.reap(false);
        }
        self.after_reap(took, execs_moved, on_thread)
    }

    /// The rest of a round once its completions are reaped.
    fn after_reap(&mut self, took: usize, execs_moved: bool, on_thread: bool) -> ThreadTurn {
        let execs_moved = self.execs.pump(&mut self.engine) || execs_moved;
        if took == 0
            && !self.engine.has_io_in_flight()
            && !self.engine.is_idle()
            && !self.engine.has_work_ready()
        {
            // Work waits for a later round that no I/O will bring: the engine's deadline (or a
            // message) does.
            debug_assert!(
                self.engine.next_deadline().is_some(),
                "shard {}: the engine is neither idle, ready, in I/O nor waiting for a deadline",
                self.engine.shard_id()
            );
            return self.wait(false, on_thread);
        }
        if let Some(reply) = self.closing.take() {
            if self.engine.is_idle() && self.execs.is_empty() {
                finish(&self.receiver, std::mem::take(&mut self.late_closes));
                let _ = reply.send(self.engine.close());
                return ThreadTurn::Turn(ShardTurn::Stopped);
            }
            self.closing = Some(reply);
            if took == 0 && !execs_moved && self.engine.is_idle() {
                // The execs left wait for other shards (a cross-shard batch's decision), which
                // send a wake when they move.
                return self.wait(false, on_thread);
            }
        }
        // A read a caller took comes back to this loop: no hand-off before it has.
        let no_taken_reads = self.engine.taken_reads() == 0;
        match self.handoff.take_if(|_| on_thread && no_taken_reads) {
            Some(host) => ThreadTurn::HandOff(host),
            None => ThreadTurn::Turn(ShardTurn::Again),
        }
    }

    fn wait(&mut self, completions: bool, on_thread: bool) -> ThreadTurn {
        self.waited = true;
        let no_taken_reads = self.engine.taken_reads() == 0;
        if let Some(host) = self.handoff.take_if(|_| on_thread && no_taken_reads) {
            // The host's first turn looks at the queue (and reaps, if this one was to wait for
            // a completion) before it waits.
            return ThreadTurn::HandOff(host);
        }
        ThreadTurn::Turn(ShardTurn::Wait(ShardWait {
            completions,
            deadline: self.engine.next_deadline(),
        }))
    }

    fn take(&mut self, message: Message) {
        match message {
            Message::Request(request) => self.requests.push(request),
            Message::Exec(exec) => self.execs.arrive(exec),
            Message::Execs(list) => list.into_iter().for_each(|exec| self.execs.arrive(exec)),
            Message::Close(reply) => self.closing = Some(reply),
            Message::Wake => {}
            Message::HandOff(host) => {
                // Refused (the sender dropped, which the asker sees) when the engine would
                // block its host.
                if self.engine.can_share_thread() && self.running_hosted.is_none() {
                    self.handoff = Some(host);
                }
            }
        }
    }

    /// Every sender is gone and nothing is left: close the engine.
    fn stop_unclosed(&mut self) {
        finish(&self.receiver, std::mem::take(&mut self.late_closes));
        if let Err(err) = self.engine.close() {
            tracing::error!(shard = self.engine.shard_id(), %err, "closing the shard failed");
        }
    }

    /// Runs the loop on the calling thread (the shard's own) until it stops or a host takes it;
    /// in the second case, returns once the host's run of it has ended.
    pub(crate) fn run_on_thread(mut self) {
        loop {
            match self.turn_inner(true) {
                ThreadTurn::Turn(ShardTurn::Again) => {}
                ThreadTurn::Turn(ShardTurn::Wait(wait)) => self.wait_on_thread(wait),
                ThreadTurn::Turn(ShardTurn::Stopped) => return,
                ThreadTurn::HandOff(host) => match self.hand_off(host) {
                    Some(refused) => self = refused,
                    None => return,
                },
            }
        }
    }

    /// Sends the loop to the host that asked for it; on the shard's thread. Returns once the
    /// host's run of it has ended (`None`), or at once with the loop if the host went away
    /// before taking it (the thread goes on running it).
    pub(crate) fn hand_off(mut self, host: std::sync::mpsc::SyncSender<ShardLoop>) -> Option<Self> {
        let (running, stopped) = std::sync::mpsc::channel();
        self.running_hosted = Some(running);
        self.parker.host();
        match host.send(self) {
            Ok(()) => {
                // Returns when the host's loop drops its `running_hosted`: stopped, or dropped
                // with the host.
                let _ = stopped.recv();
                None
            }
            Err(refused) => {
                let mut refused = refused.0;
                refused.running_hosted = None;
                refused.parker.unhost();
                Some(refused)
            }
        }
    }

    /// Whether the engine's rounds never block the thread that runs them.
    pub(crate) fn can_share_thread(&self) -> bool {
        self.engine.can_share_thread()
    }

    /// A hand-off was asked for and waits for the thread driver's next turn.
    pub(crate) fn handoff_pending(&self) -> bool {
        self.handoff.is_some()
    }

    /// Whether the queue has something for the shard (what a driver's sleep watches).
    pub(crate) fn has_news(&self) -> bool {
        has_news(self.connected, &self.receiver)
    }

    /// A handle on the shard's parker, for a driver that sleeps without holding the loop.
    pub(crate) fn parker_twin(&self) -> Parker {
        self.parker.twin()
    }

    /// Sleeps until a message arrives (while connected), a completion of the engine's I/O is
    /// ready (if asked), or the engine's next deadline passes. A wake that brought nothing (a
    /// sender's handle dropped, an interrupted poll) sleeps again.
    fn wait_on_thread(&self, wait: ShardWait) {
        let queued = || has_news(self.connected, &self.receiver);
        let completion_fd = if wait.completions { self.engine.completion_fd() } else { None };
        loop {
            match self.parker.park(queued, completion_fd, wait.deadline) {
                Wakeup::Woken | Wakeup::Interrupted if !queued() => continue,
                _ => return,
            }
        }
    }

    /// For a host: the fd that polls readable once a completion can be reaped, while a `Wait`
    /// with `completions` is under way. Only for the duration of that wait: the engine may
    /// answer `None` at other times.
    pub fn completion_fd(&self) -> Option<BorrowedFd<'_>> {
        self.engine.completion_fd()
    }

    /// For a host: starts a wait that a `Wait` turn asked for. Then poll `poll_messages` with
    /// the task's waker until it or the host's other sources (completion fd, deadline) are
    /// ready, and call `end_wait`.
    pub fn begin_wait(&mut self) {
        self.parking = true;
    }

    /// For a host, during a wait: `Ready` once a message (or a sender's departure) can end
    /// it; otherwise the task is registered to be woken when one comes (invariant 1 of
    /// `wake.rs`: announced, then checked).
    pub fn poll_messages(&mut self, task: &std::task::Waker) -> std::task::Poll<()> {
        let (connected, receiver) = (self.connected, &self.receiver);
        self.parker.poll_messages(task, &mut self.parking, || has_news(connected, receiver))
    }

    /// For a host: the wait is over, whatever ended it.
    pub fn end_wait(&mut self) {
        self.parking = false;
        self.parker.unpark();
    }
}

/// A loop dropped before it stopped (its host panicked or went away): what is queued is
/// turned away, so that its waiters see the store closed instead of waiting for ever.
impl Drop for ShardLoop {
    fn drop(&mut self) {
        if let Some(reply) = self.closing.take() {
            let _ = reply.send(Err(WriteError::Closed));
        }
        finish(&self.receiver, std::mem::take(&mut self.late_closes));
    }
}

/// Whether the queue has something for a waiting shard: a message, or (while it was still
/// connected) the departure of the last sender. This is everything a sender changes before it
/// wakes the shard (invariant 1 of `wake.rs`).
fn has_news(connected: bool, receiver: &flume::Receiver<Message>) -> bool {
    connected && (!receiver.is_empty() || receiver.is_disconnected())
}

/// A message that reached a closing shard: the store is closed to it.
pub(crate) fn turn_away(message: Message, late_closes: &mut Vec<CloseReply>) {
    match message {
        Message::Request(request) => super::reject(request),
        // Dropping the program drops its answer channel: its waiter sees the store closed.
        Message::Exec(exec) => drop(exec),
        Message::Execs(list) => drop(list),
        Message::Close(reply) => late_closes.push(reply),
        Message::Wake | Message::HandOff(_) => {}
    }
}

/// Answers requests still queued at close, and the close orders after the first.
fn finish(receiver: &flume::Receiver<Message>, mut late_closes: Vec<CloseReply>) {
    while let Ok(message) = receiver.try_recv() {
        turn_away(message, &mut late_closes);
    }
    for reply in late_closes {
        let _ = reply.send(Ok(()));
    }
}
