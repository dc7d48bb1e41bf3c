//! A shard: one OS thread that owns its engine (and through it the index, page cache, free lists
//! and I/O ring). Nothing else touches that state; callers reach it only by message.
//!
//! The event loop (KVell worker, p2KVS opportunistic batching):
//! 1. take what is in the queue, up to `ROUND_REQUESTS_MAX`, never waiting to fill a batch
//!    (block only when the engine has nothing in flight);
//! 2. hand them to the engine in runs of the same kind, in arrival order (the native engine turns
//!    the round into page reads and writes; a page touched by several requests is written once);
//! 3. submit the round's I/O with one system call, within the queue-depth bound;
//! 4. reap completions as they arrive and answer the requests they finish.
//!
//! Exec programs (`exec.rs`) run beside plain requests: between the steps above the shard moves
//! every exec that can move (its reads answered, its write durable, its locks free) and hands the
//! reads and writes they ask for to the engine in the same round.

pub mod coordinator;
pub mod exec;
pub mod gate;
pub mod wake;

use std::thread::JoinHandle;
use std::time::Duration;

use crate::engine::part::PartRecord;
use crate::engine::Request;
use crate::engine::ShardEngine;
use crate::error::{OpenError, WriteError};
use crate::limits::{ROUND_REQUESTS_MAX, SHARD_QUEUE_REQUESTS_MAX};
use exec::{ExecRequest, ExecTable};
use gate::Gate;

/// A message on a shard's queue: a request, an exec program, or the order to finish and stop.
pub enum Message {
    Request(Request),
    Exec(ExecRequest),
    Close(futures::channel::oneshot::Sender<Result<(), WriteError>>),
    /// Look again at the parts of cross-shard batches (a decision was made elsewhere). Sent
    /// with `try_send`: when the queue is full the shard is busy and looks anyway.
    Wake,
}

pub use crate::engine::factory::EngineOpener;

pub struct ShardHandle {
    pub sender: flume::Sender<Message>,
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
        let (sender, receiver) = flume::bounded(SHARD_QUEUE_REQUESTS_MAX);
        let thread = std::thread::Builder::new()
            .name(format!("copse-shard-{shard_id}"))
            .spawn(move || {
                if let Some(core) = pin_core {
                    pin_to_core(shard_id, core);
                }
                match open() {
                    Ok(engine) => {
                        let _ = opened.send((shard_id, Ok(engine.recovered_parts())));
                        run(Gate::new(engine), receiver);
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
fn run(mut engine: Gate, receiver: flume::Receiver<Message>) {
    let mut closing = None;
    let mut requests = Vec::with_capacity(ROUND_REQUESTS_MAX);
    let mut execs = ExecTable::default();
    loop {
        if closing.is_none() {
            // Every exec that is not blocked waits on the engine, so an idle engine with nothing
            // queued means there is nothing to do but wait for a message.
            if engine.is_idle() {
                match receiver.recv() {
                    Ok(message) => take(message, &mut requests, &mut execs, &mut closing),
                    // Every handle is gone without a close: finish and stop.
                    Err(flume::RecvError::Disconnected) => break,
                }
            }
            while requests.len() < ROUND_REQUESTS_MAX && closing.is_none() {
                match receiver.try_recv() {
                    Ok(message) => take(message, &mut requests, &mut execs, &mut closing),
                    Err(_) => break,
                }
            }
        }
        let took = requests.len();
        // Hand the round over in runs of the same kind, in arrival order (p2KVS: an engine can
        // turn a run of puts into one write and a run of gets into one multi-read).
        let mut round = requests.drain(..).peekable();
        while let Some(first) = round.next() {
            let kind = first.kind();
            let mut run = vec![first];
            while let Some(next) = round.next_if(|next| next.kind() == kind) {
                run.push(next);
            }
            engine.handle_run(run);
        }
        let execs_moved = execs.pump(&mut engine);
        engine.end_round();
        // Wait for a completion only if nothing new arrived or moved this round; otherwise just
        // collect what has completed and go back to the queue.
        let wait = took == 0 && !execs_moved && engine.has_io_in_flight();
        engine.reap(wait);
        execs.pump(&mut engine);
        if took == 0 && !engine.has_io_in_flight() && !engine.is_idle() {
            // Work waits for a later round (a deferred free, say) with no I/O to wake us.
            std::thread::sleep(Duration::from_micros(50));
        }
        if let Some(reply) = closing.take() {
            if engine.is_idle() && execs.is_empty() {
                finish(&receiver);
                let _ = futures::channel::oneshot::Sender::send(reply, engine.close());
                return;
            }
            closing = Some(reply);
        }
    }
    finish(&receiver);
    if let Err(err) = engine.close() {
        tracing::error!(shard = engine.shard_id(), %err, "closing the shard failed");
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
        Message::Close(reply) => *closing = Some(reply),
        Message::Wake => {}
    }
}

/// Answers requests still queued at close: the store is closed to them.
fn finish(receiver: &flume::Receiver<Message>) {
    while let Ok(message) = receiver.try_recv() {
        match message {
            Message::Request(request) => reject(request),
            // Dropping the program drops its answer channel: its waiter sees the store closed.
            Message::Exec(exec) => drop(exec),
            Message::Close(reply) => {
                let _ = reply.send(Ok(()));
            }
            Message::Wake => {}
        }
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
