//! A shard: one OS thread that owns its engine (and through it the index, page cache, free lists
//! and I/O ring). Nothing else touches that state; callers reach it only by message.
//!
//! The event loop (KVell worker, p2KVS opportunistic batching):
//! 1. take what is in the queue, up to `ROUND_REQUESTS_MAX`, never waiting to fill a batch;
//! 2. hand them to the engine in runs of the same kind, in arrival order (the native engine turns
//!    the round into page reads and writes; a page touched by several requests is written once);
//! 3. submit the round's I/O with one system call, within the queue-depth bound;
//! 4. reap completions as they arrive and answer the requests they finish.
//!
//! Exec programs (`exec.rs`) run beside plain requests: between the steps above the shard moves
//! every exec that can move (its reads answered, its write durable, its locks free) and hands the
//! reads and writes they ask for to the engine in the same round.
//!
//! When a round brought nothing new, the shard sleeps (`wake.rs`) until whichever comes first: a
//! message on its queue, a completion of its engine's I/O (when I/O is in flight and the device
//! has a completion fd; a device without one completes on demand, and the shard reaps instead),
//! or the engine's next deadline (`ShardEngine::next_deadline`). It sleeps only when the engine
//! says the next round cannot move without one of those (`ShardEngine::has_work_ready`), never
//! for a fixed time. Every message reaches the queue through a [`ShardSender`], which wakes the
//! shard when it sleeps.

pub mod coordinator;
pub mod exec;
pub mod gate;
pub mod wake;

use std::sync::Arc;
use std::thread::JoinHandle;

use crate::engine::part::PartRecord;
use crate::engine::Request;
use crate::engine::ShardEngine;
use crate::error::{OpenError, WriteError};
use crate::limits::{ROUND_REQUESTS_MAX, SHARD_QUEUE_REQUESTS_MAX};
use exec::{ExecRequest, ExecTable};
use gate::Gate;
use wake::{Parker, Waker, Wakeup};

/// A message on a shard's queue: a request, an exec program, or the order to finish and stop.
pub enum Message {
    Request(Request),
    Exec(ExecRequest),
    /// Execs queued together, in order (a network thread's wave of pipelined commands for this
    /// shard: one message and at most one wake for all of them).
    Execs(Vec<ExecRequest>),
    Close(futures::channel::oneshot::Sender<Result<(), WriteError>>),
    /// Look again at the parts of cross-shard batches (a decision was made elsewhere). Sent
    /// with `try_send`: when the queue is full the shard is busy and looks anyway (and the wake
    /// that comes with every send reaches it even then).
    Wake,
}

impl Message {
    /// How many requests or execs the message carries (at least 1).
    fn work_items(&self) -> usize {
        match self {
            Message::Execs(list) => list.len().max(1),
            _ => 1,
        }
    }
}

pub use crate::engine::factory::EngineOpener;

/// The sending end of a shard's queue. Every message a shard gets comes through one of these,
/// so that every send wakes the shard if it sleeps (`wake.rs`). Cheap to clone.
#[derive(Clone)]
pub struct ShardSender {
    queue: flume::Sender<Message>,
    /// Declared after `queue`, so dropped after it: the last sender's drop disconnects the
    /// queue, then wakes the shard to see that.
    waker: WakeOnDrop,
}

#[derive(Clone)]
struct WakeOnDrop(Arc<Waker>);

impl Drop for WakeOnDrop {
    fn drop(&mut self) {
        self.0.wake();
    }
}

impl ShardSender {
    /// Queues a message; blocks while the queue is full. False if the shard is gone (the
    /// message is dropped, and with it any reply channel, which its waiter sees).
    pub fn send(&self, message: Message) -> bool {
        let delivered = self.queue.send(message).is_ok();
        self.waker.0.wake();
        delivered
    }

    /// As `send`, awaiting room in the queue instead of blocking the thread.
    pub async fn send_async(&self, message: Message) -> bool {
        let delivered = self.queue.send_async(message).await.is_ok();
        self.waker.0.wake();
        delivered
    }

    /// Queues a message if there is room; never blocks. Wakes the shard either way: a full
    /// queue drops the message, and the wake is what tells a shard that is closing (and so
    /// reads its queue only to turn messages away) to look again.
    pub fn try_send(&self, message: Message) -> bool {
        let delivered = self.queue.try_send(message).is_ok();
        self.waker.0.wake();
        delivered
    }

    /// Messages waiting in the queue.
    pub fn queue_depth(&self) -> usize {
        self.queue.len()
    }
}

pub struct ShardHandle {
    pub sender: ShardSender,
    thread: Option<JoinHandle<()>>,
}

impl ShardHandle {
    /// Starts the shard thread; it opens (recovers) its engine with `open`, on the shard thread,
    /// and reports through `opened`.
    pub fn spawn(
        shard_id: u32,
        open: EngineOpener,
        opened: std::sync::mpsc::Sender<(u32, Result<Vec<PartRecord>, OpenError>)>,
        pin_core: Option<usize>,
    ) -> Result<ShardHandle, OpenError> {
        let (queue, receiver) = flume::bounded(SHARD_QUEUE_REQUESTS_MAX);
        let (parker, waker) =
            Parker::new().map_err(|err| OpenError::Thread(format!("eventfd: {err}")))?;
        let sender = ShardSender { queue, waker: WakeOnDrop(waker) };
        let thread = std::thread::Builder::new()
            .name(format!("copse-shard-{shard_id}"))
            .spawn(move || {
                if let Some(core) = pin_core {
                    pin_to_core(shard_id, core);
                }
                match open() {
                    Ok(engine) => {
                        let _ = opened.send((shard_id, Ok(engine.recovered_parts())));
                        run(Gate::new(engine), receiver, parker);
                    }
                    Err(err) => {
                        let _ = opened.send((shard_id, Err(err)));
                    }
                }
            })
            .map_err(|err| OpenError::Thread(err.to_string()))?;
        Ok(ShardHandle { sender, thread: Some(thread) })
    }

    pub fn join(&mut self) {
        if let Some(thread) = self.thread.take() {
            if thread.join().is_err() {
                tracing::error!("a shard thread panicked");
            }
        }
    }
}

/// Pins the calling thread to one core, so a shard keeps its caches warm; a refusal (containers
/// often restrict affinity) is logged and otherwise ignored.
fn pin_to_core(shard_id: u32, core: usize) {
    // SAFETY: cpu_set_t is plain data; CPU_ZERO/CPU_SET write only inside it, and
    // sched_setaffinity reads it for the calling thread (pid 0).
    let result = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_ZERO(&mut set);
        libc::CPU_SET(core, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    if result != 0 {
        tracing::warn!(shard = shard_id, core, err = %std::io::Error::last_os_error(), "could not pin shard thread");
    }
}

/// The shard's event loop over any engine (the contract: `engine::ShardEngine`), behind the
/// gate that keeps cross-shard batches whole (`gate.rs`).
fn run(mut engine: Gate, receiver: flume::Receiver<Message>, parker: Parker) {
    let mut closing = None;
    // Close orders after the first, answered as the shard stops (as `finish` answers them).
    let mut late_closes = Vec::new();
    // False once every sender is gone: the queue can bring nothing more.
    let mut connected = true;
    let mut requests = Vec::with_capacity(ROUND_REQUESTS_MAX);
    let mut execs = ExecTable::default();
    loop {
        if closing.is_none() && connected && engine.is_idle() {
            // Every exec that is not blocked waits on the engine, so an idle engine with nothing
            // queued means there is nothing to do but wait for a message (or a deadline).
            wait_for_work(&parker, &engine, &receiver, connected, false);
        }
        // Take what is queued, never waiting to fill a batch. Once closing, what arrives is
        // turned away as `finish` would at the end, so that a wake still moves the execs left.
        let mut messages = 0;
        while messages < ROUND_REQUESTS_MAX && connected {
            match receiver.try_recv() {
                Ok(message) => {
                    // A message of several execs counts as that many toward the round's bound.
                    messages += message.work_items();
                    if closing.is_some() {
                        turn_away(message, &mut late_closes);
                    } else {
                        take(message, &mut requests, &mut execs, &mut closing);
                    }
                }
                Err(flume::TryRecvError::Empty) => break,
                Err(flume::TryRecvError::Disconnected) => {
                    connected = false;
                    messages += 1;
                }
            }
        }
        if !connected && closing.is_none() && engine.is_idle() {
            // Every handle is gone without a close: finish and stop.
            break;
        }
        let took = requests.len();
        engine.handle_in_runs(requests.drain(..));
        let execs_moved = execs.pump(&mut engine);
        engine.end_round();
        if took == 0 && !execs_moved && engine.has_io_in_flight() {
            // Nothing new arrived or moved this round: wait for a completion, or for a message
            // or the engine's deadline, whichever comes first. A device without a completion
            // fd completes on demand, so reaping is the wait.
            if engine.completion_fd().is_some() {
                wait_for_work(&parker, &engine, &receiver, connected, true);
                engine.reap(false);
            } else {
                engine.reap(true);
            }
        } else {
            // Collect what has completed and go back to the queue.
            engine.reap(false);
        }
        let execs_moved = execs.pump(&mut engine) || execs_moved;
        if took == 0 && !engine.has_io_in_flight() && !engine.is_idle() && !engine.has_work_ready()
        {
            // Work waits for a later round that no I/O will bring: the engine's deadline (or a
            // message) does.
            debug_assert!(
                engine.next_deadline().is_some(),
                "shard {}: the engine is neither idle, ready, in I/O nor waiting for a deadline",
                engine.shard_id()
            );
            wait_for_work(&parker, &engine, &receiver, connected, false);
        }
        if let Some(reply) = closing.take() {
            if engine.is_idle() && execs.is_empty() {
                finish(&receiver, late_closes);
                let _ = futures::channel::oneshot::Sender::send(reply, engine.close());
                return;
            }
            if took == 0 && !execs_moved && engine.is_idle() {
                // The execs left wait for other shards (a cross-shard batch's decision), which
                // send a wake when they move.
                wait_for_work(&parker, &engine, &receiver, connected, false);
            }
            closing = Some(reply);
        }
    }
    finish(&receiver, late_closes);
    if let Err(err) = engine.close() {
        tracing::error!(shard = engine.shard_id(), %err, "closing the shard failed");
    }
}

/// Sleeps until a message arrives (while `connected`), a completion of the engine's I/O is
/// ready (if `completions`), or the engine's next deadline passes. A wake that brought nothing
/// (a sender's handle dropped, an interrupted poll) sleeps again.
fn wait_for_work(
    parker: &Parker,
    engine: &Gate,
    receiver: &flume::Receiver<Message>,
    connected: bool,
    completions: bool,
) {
    // Everything a sender changes before it wakes the shard (invariant 1 of `wake.rs`).
    let queued = || connected && (!receiver.is_empty() || receiver.is_disconnected());
    let completion_fd = if completions { engine.completion_fd() } else { None };
    let deadline = engine.next_deadline();
    loop {
        match parker.park(queued, completion_fd, deadline) {
            Wakeup::Woken | Wakeup::Interrupted if !queued() => continue,
            _ => return,
        }
    }
}

fn take(
    message: Message,
    requests: &mut Vec<Request>,
    execs: &mut ExecTable,
    closing: &mut Option<futures::channel::oneshot::Sender<Result<(), WriteError>>>,
) {
    match message {
        Message::Request(request) => requests.push(request),
        Message::Exec(exec) => execs.arrive(exec),
        Message::Execs(list) => list.into_iter().for_each(|exec| execs.arrive(exec)),
        Message::Close(reply) => *closing = Some(reply),
        Message::Wake => {}
    }
}

/// A message that reached a closing shard: the store is closed to it.
fn turn_away(
    message: Message,
    late_closes: &mut Vec<futures::channel::oneshot::Sender<Result<(), WriteError>>>,
) {
    match message {
        Message::Request(request) => reject(request),
        // Dropping the program drops its answer channel: its waiter sees the store closed.
        Message::Exec(exec) => drop(exec),
        Message::Execs(list) => drop(list),
        Message::Close(reply) => late_closes.push(reply),
        Message::Wake => {}
    }
}

/// Answers requests still queued at close, and the close orders after the first.
fn finish(
    receiver: &flume::Receiver<Message>,
    mut late_closes: Vec<futures::channel::oneshot::Sender<Result<(), WriteError>>>,
) {
    while let Ok(message) = receiver.try_recv() {
        turn_away(message, &mut late_closes);
    }
    for reply in late_closes {
        let _ = reply.send(Ok(()));
    }
}

pub(crate) fn reject(request: Request) {
    use crate::error::ReadError;
    match request {
        Request::Get { reply, .. } => {
            let _ = reply.send(Err(ReadError::Closed));
        }
        Request::Scan { reply, .. } => {
            let _ = reply.send(Err(ReadError::Closed));
        }
        Request::Stats { reply } => {
            let _ = reply.send(Err(ReadError::Closed));
        }
        Request::Scrub { reply } => {
            let _ = reply.send(Err(ReadError::Closed));
        }
        Request::Put { reply, .. }
        | Request::Batch { reply, .. }
        | Request::Flush { reply }
        | Request::Settle { reply }
        | Request::PreparePart { reply, .. }
        | Request::CommitPart { reply, .. }
        | Request::ForgetPart { reply, .. } => {
            let _ = reply.send(Err(WriteError::Closed));
        }
        Request::Delete { reply, .. } => {
            let _ = reply.send(Err(WriteError::Closed));
        }
    }
}
