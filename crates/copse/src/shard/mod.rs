//! A shard: one thread at a time owns its engine (and through it the index, page cache, free
//! lists and I/O ring): the shard's own OS thread, or a host's thread it was handed to
//! (`event_loop.rs`). Nothing else touches that state; callers reach it only by message.
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

pub(crate) mod caller_wait;
mod combine;
pub mod coordinator;
pub mod event_loop;
pub mod exec;
pub mod gate;
pub mod sequence;
pub mod wake;

use std::sync::Arc;
use std::thread::JoinHandle;

use crate::engine::part::PartRecord;
use crate::engine::Request;
use crate::error::{OpenError, WriteError};
use crate::limits::SHARD_QUEUE_REQUESTS_MAX;
pub use event_loop::{ShardLoop, ShardTurn, ShardWait};
pub use combine::CombineCounts;
use exec::ExecRequest;
use combine::{Call, SharedLoop};
use gate::Gate;
use wake::{Parker, Waker};

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
    /// A host asks for the shard's event loop, to run it on its own thread (`event_loop.rs`);
    /// the sender is dropped instead when the engine cannot share a thread.
    HandOff(std::sync::mpsc::SyncSender<ShardLoop>),
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
    /// The loop, when callers may run its turns (`combine.rs`).
    shared: Arc<SharedLoop>,
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

    /// As `send`, for a caller that blocks until `receiver` has the answer, which it returns
    /// (`Err` when the request was dropped: the shard is gone). Runs the shard's turns on the
    /// calling thread when no other driver holds its loop (flat combining, `combine.rs`), and
    /// wakes the shard otherwise. Not for a thread that may host a shard (an async caller).
    pub fn call_combining<T>(
        &self,
        message: Message,
        mut receiver: futures::channel::oneshot::Receiver<T>,
    ) -> Result<T, futures::channel::oneshot::Canceled> {
        let delivered = self.queue.send(message).is_ok();
        let call = if delivered { self.shared.call(&mut receiver) } else { Call::NotRun };
        match call {
            Call::Answered(answer) => return answer,
            Call::Ran => {}
            Call::NotRun => self.waker.0.wake(),
        }
        caller_wait::block_on(receiver)
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

    /// Flat combining's counts (`combine.rs`).
    pub fn combine_counts(&self) -> CombineCounts {
        self.shared.counts()
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
        let shared = Arc::new(SharedLoop::new(waker.clone()));
        let sender = ShardSender { queue, waker: WakeOnDrop(waker), shared: shared.clone() };
        let thread = std::thread::Builder::new()
            .name(format!("copse-shard-{shard_id}"))
            .spawn(move || {
                if let Some(core) = pin_core {
                    pin_to_core(shard_id, core);
                }
                match open() {
                    Ok(engine) => {
                        let _ = opened.send((shard_id, Ok(engine.recovered_parts())));
                        shared.run_on_thread(ShardLoop::new(Gate::new(engine), receiver, parker));
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

pub(crate) fn reject(request: Request) {
    use crate::error::ReadError;
    match request {
        Request::Get { reply, .. } => {
            let _ = reply.send(Err(ReadError::Closed));
        }
        Request::Scan { reply, .. } => {
            let _ = reply.send(Err(ReadError::Closed));
        }
        Request::MultiGet { reply, .. } => {
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
