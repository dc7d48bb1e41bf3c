//! Exec programs: commands that run atomically inside one shard (the Redis server's INCR, HSET,
//! ZADD, ... and any read-modify-write a caller needs).
//!
//! An exec names the lock keys it needs (for the server, the Redis keys it touches) and is a small
//! state machine: it asks for reads, looks at their results, asks for one write (a put, a delete
//! or an all-or-nothing batch), maybe reads and writes again, and finally says it is done. It
//! sends its own answer to whoever is waiting, through a channel it owns; an exec dropped
//! unfinished (the store closed) drops that channel, which its waiter sees.
//!
//! Invariants:
//! 1. Execs holding a common lock key run one at a time, in the order they reached the shard:
//!    an exec starts only when it is first in the queue of every one of its lock keys. Since the
//!    shard thread sees arrivals in one order, no exec waits for a later one (no deadlock).
//! 2. An exec keeps its locks until it is done, and a write step resumes it only once the write is
//!    durable (the engine answers writes then). So an exec that reads after earlier execs on its
//!    keys sees their writes, and a reader behind a writer sees the write only once it is durable:
//!    a read never returns a value that a crash could take back.
//! 3. Nothing an exec asks for reaches the engine unchecked: keys, values and batch sizes are
//!    checked against the limits, and a bad write is answered with an error and changes nothing.
//!
//! 4. An exec may write its shard's part of a cross-shard batch (`ExecStep::Prepare`, see
//!    docs/atomic-batches.md): the part is made durable, its keys are locked in the gate
//!    (`gate.rs`), the exec waits for the batch's decision (its coordinator's, shared by every
//!    participant), then the part is applied or erased and the exec resumes with the outcome.
//!    It keeps its exec locks throughout.
//!
//! Plain requests (`Db::put`, `Db::get`, ...) take no locks: they are ordered with execs only by
//! arrival at the engine. A key space is used either through execs or through plain requests.

use std::collections::VecDeque;

use crate::hash::HashMap;
use std::ops::Bound;
use std::sync::Arc;

use futures::channel::oneshot;

use super::coordinator::{Coordinator, Decision};
use super::gate::Gate;
use crate::engine::input::{check_key, check_part, check_write};
use crate::engine::{BatchOp, KeyValue, Request, ShardEngine};
use crate::error::{InputError, ReadError, WriteError};
use crate::limits::{EXEC_READS_MAX, SCAN_ITEMS_MAX};

/// A command that runs atomically in one shard.
pub trait Exec: Send + 'static {
    /// Advances the program: first with `StepInput::Start`, then with the results of the step it
    /// asked for last. `view` answers index questions with no I/O.
    fn step(&mut self, view: &ExecView<'_>, input: StepInput) -> ExecStep;
}

/// What an exec asks for next.
pub enum ExecStep {
    /// Reads, answered together (at most `EXEC_READS_MAX`).
    Read(Vec<ReadOp>),
    /// One write: a single put or delete, or an all-or-nothing batch. Resumes once durable.
    Write(Vec<BatchOp>),
    /// This shard's part of a cross-shard batch (invariant 4). Resumes with `Written`: Ok once
    /// the batch committed and the part is applied here (durable and visible), or the error
    /// that called the batch off.
    Prepare { vote: Vote, ops: Vec<BatchOp> },
    /// Finished; the locks are released.
    Done,
}

pub enum ReadOp {
    Get(Vec<u8>),
    /// Up to `limit` items of the range, in key order, with values.
    Scan {
        start: Bound<Vec<u8>>,
        end: Bound<Vec<u8>>,
        limit: usize,
    },
}

#[derive(Debug)]
pub enum ReadResult {
    Value(Option<Vec<u8>>),
    Items(Vec<KeyValue>),
}

#[derive(Debug)]
pub enum StepInput {
    Start,
    /// The results of a `Read` step, in the order asked; the first failure if any failed.
    Read(Result<Vec<ReadResult>, ReadError>),
    Written(Result<(), WriteError>),
}

/// A participant's say in a cross-shard batch. Dropped before it was cast (the exec never ran,
/// the store closed), it calls the batch off.
pub struct Vote {
    coordinator: Arc<dyn Coordinator>,
    shard: u32,
    cast: bool,
}

impl Vote {
    pub fn new(coordinator: Arc<dyn Coordinator>, shard: u32) -> Vote {
        Vote { coordinator, shard, cast: false }
    }

    pub fn coordinator(&self) -> &Arc<dyn Coordinator> {
        &self.coordinator
    }

    /// Calls the batch off (a condition of this shard's part failed).
    pub fn refuse(mut self, reason: WriteError) {
        self.cast = true;
        self.coordinator.refuse(reason);
    }

    fn prepared(&mut self, result: Result<(), WriteError>) {
        self.cast = true;
        self.coordinator.prepared(self.shard, result);
    }
}

impl Drop for Vote {
    fn drop(&mut self) {
        if !self.cast {
            self.coordinator.refuse(WriteError::Aborted(format!(
                "shard {}'s part was dropped before it was prepared (the store closed)",
                self.shard
            )));
        }
    }
}

/// Questions an exec may ask the shard's index without I/O. The answers are current for the
/// keys the exec holds locks over, provided all writes of those keys go through locking execs.
pub struct ExecView<'a> {
    engine: &'a dyn ShardEngine,
}

impl ExecView<'_> {
    pub fn contains(&self, key: &[u8]) -> bool {
        self.engine.contains_key(key)
    }

    /// Up to `limit` keys of the range, in order (keys only: no I/O).
    pub fn keys(&self, start: Bound<&[u8]>, end: Bound<&[u8]>, limit: usize) -> Vec<Vec<u8>> {
        self.engine.index_keys(start, end, limit)
    }

    /// Keys in the range, counting no further than `limit` (no I/O).
    pub fn count(&self, start: Bound<&[u8]>, end: Bound<&[u8]>, limit: usize) -> usize {
        self.engine.count_keys(start, end, limit)
    }
}

/// An exec on its way to a shard.
pub struct ExecRequest {
    pub locks: Vec<Vec<u8>>,
    pub exec: Box<dyn Exec>,
}

enum PendingRead {
    Get(oneshot::Receiver<Result<Option<Vec<u8>>, ReadError>>),
    Scan(oneshot::Receiver<Result<Vec<KeyValue>, ReadError>>),
}

enum PendingWrite {
    Put(oneshot::Receiver<Result<(), WriteError>>),
    Delete(oneshot::Receiver<Result<bool, WriteError>>),
}

enum State {
    /// Waiting for `blocked_by` earlier execs to release common lock keys.
    Blocked,
    Ready(StepInput),
    Reading {
        pending: Vec<Option<PendingRead>>,
        results: Vec<Option<ReadResult>>,
    },
    Writing(PendingWrite),
    /// Its part is being made durable.
    Preparing {
        part: Part,
        receiver: WriteReceiver,
    },
    /// Its part is durable (or failed); waiting for the batch's decision.
    Deciding(Part),
    /// Committed: the part is being applied.
    Committing {
        part: Part,
        receiver: WriteReceiver,
    },
    /// Aborted: the part is being erased; then the exec resumes with `reason`.
    Aborting {
        part: Part,
        receiver: WriteReceiver,
        reason: WriteError,
    },
}

type WriteReceiver = oneshot::Receiver<Result<(), WriteError>>;

/// An exec's part of a cross-shard batch, while it is live in this shard.
struct Part {
    vote: Vote,
    ops: Vec<BatchOp>,
}

struct Running {
    exec: Box<dyn Exec>,
    locks: Vec<Vec<u8>>,
    blocked_by: usize,
    state: State,
}

/// The shard's execs and their lock queues.
#[derive(Default)]
pub struct ExecTable {
    running: HashMap<u64, Running>,
    /// Per lock key, the execs holding or waiting for it, in arrival order (the first holds it).
    queues: HashMap<Vec<u8>, VecDeque<u64>>,
    /// Execs that are not blocked; checked by `pump`.
    active: Vec<u64>,
    next_id: u64,
    /// Parts applied here, waiting until every participant applied theirs to be erased.
    to_forget: Vec<Arc<dyn Coordinator>>,
}

impl ExecTable {
    pub fn is_empty(&self) -> bool {
        self.running.is_empty()
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.running.len()
    }

    /// Takes an exec that reached the shard; it starts at the next `pump` if no earlier exec
    /// holds one of its lock keys.
    pub fn arrive(&mut self, request: ExecRequest) {
        let id = self.next_id;
        self.next_id += 1;
        let mut locks = request.locks;
        locks.sort_unstable();
        locks.dedup();
        let mut blocked_by = 0;
        for lock in &locks {
            let queue = self.queues.entry(lock.clone()).or_default();
            if !queue.is_empty() {
                blocked_by += 1;
            }
            queue.push_back(id);
        }
        let state = if blocked_by == 0 { State::Ready(StepInput::Start) } else { State::Blocked };
        if blocked_by == 0 {
            self.active.push(id);
        }
        self.running.insert(id, Running { exec: request.exec, locks, blocked_by, state });
    }

    /// Runs every exec that can make progress until none can: collects answers the engine has
    /// given, steps the programs and hands their new reads and writes to the engine. Returns
    /// whether anything moved.
    pub fn pump(&mut self, engine: &mut Gate) -> bool {
        // Reads the gate answers itself go first: before this pump unlocks any key.
        let mut moved_any = engine.poll();
        self.forget_applied(engine);
        loop {
            let mut moved = false;
            let active = std::mem::take(&mut self.active);
            let mut still_active = Vec::with_capacity(active.len());
            for id in active {
                match self.advance(id, engine) {
                    Advance::Waiting => still_active.push(id),
                    Advance::Moved => {
                        moved = true;
                        still_active.push(id);
                    }
                    Advance::Finished => {
                        moved = true;
                        self.release(id);
                    }
                }
            }
            // `release` may have activated blocked execs meanwhile.
            still_active.append(&mut self.active);
            self.active = still_active;
            if !moved {
                return moved_any;
            }
            moved_any = true;
        }
    }

    /// Erases parts whose batch every participant applied (the last step of the protocol).
    fn forget_applied(&mut self, engine: &mut Gate) {
        if self.to_forget.is_empty() {
            return;
        }
        let mut kept = Vec::new();
        for coordinator in std::mem::take(&mut self.to_forget) {
            if coordinator.all_applied() {
                // A failed erasure poisons the engine; recovery forgets the part later.
                let (reply, _) = oneshot::channel();
                engine.handle(Request::ForgetPart { gsn: coordinator.gsn(), reply });
            } else {
                kept.push(coordinator);
            }
        }
        self.to_forget = kept;
    }

    fn advance(&mut self, id: u64, engine: &mut Gate) -> Advance {
        let running = self.running.get_mut(&id).expect("an active exec is running");
        let input = match &mut running.state {
            State::Blocked => unreachable!("a blocked exec is never active"),
            State::Ready(_) => {
                let State::Ready(input) = std::mem::replace(&mut running.state, State::Blocked)
                else {
                    unreachable!()
                };
                input
            }
            State::Reading { pending, results } => {
                let mut failure = None;
                for (slot, result) in pending.iter_mut().zip(results.iter_mut()) {
                    let Some(read) = slot else { continue };
                    let answer = match read {
                        PendingRead::Get(receiver) => match receiver.try_recv() {
                            Ok(None) => continue,
                            Ok(Some(answer)) => answer.map(ReadResult::Value),
                            Err(oneshot::Canceled) => Err(ReadError::Closed),
                        },
                        PendingRead::Scan(receiver) => match receiver.try_recv() {
                            Ok(None) => continue,
                            Ok(Some(answer)) => answer.map(ReadResult::Items),
                            Err(oneshot::Canceled) => Err(ReadError::Closed),
                        },
                    };
                    *slot = None;
                    match answer {
                        Ok(value) => *result = Some(value),
                        Err(err) => {
                            failure.get_or_insert(err);
                        }
                    }
                }
                if let Some(err) = failure {
                    // Answer at once; reads still in flight finish into dropped channels.
                    StepInput::Read(Err(err))
                } else if pending.iter().any(Option::is_some) {
                    return Advance::Waiting;
                } else {
                    let results = std::mem::take(results);
                    StepInput::Read(Ok(results
                        .into_iter()
                        .map(|result| result.expect("every read answered"))
                        .collect()))
                }
            }
            State::Writing(write) => {
                let answer = match write {
                    PendingWrite::Put(receiver) => receiver.try_recv(),
                    PendingWrite::Delete(receiver) => {
                        receiver.try_recv().map(|a| a.map(|r| r.map(|_existed| ())))
                    }
                };
                match answer {
                    Ok(None) => return Advance::Waiting,
                    Ok(Some(result)) => StepInput::Written(result),
                    Err(oneshot::Canceled) => StepInput::Written(Err(WriteError::Closed)),
                }
            }
            State::Preparing { .. }
            | State::Deciding(_)
            | State::Committing { .. }
            | State::Aborting { .. } => {
                let state = std::mem::replace(&mut running.state, State::Blocked);
                match advance_part(state, engine, &mut self.to_forget) {
                    PartProgress::Still(state) => {
                        running.state = state;
                        return Advance::Waiting;
                    }
                    PartProgress::Moved(state) => {
                        running.state = state;
                        return Advance::Moved;
                    }
                    PartProgress::Done(input) => input,
                }
            }
        };
        let step = running.exec.step(&ExecView { engine }, input);
        running.state = match step {
            ExecStep::Done => return Advance::Finished,
            ExecStep::Read(reads) => issue_reads(reads, engine),
            ExecStep::Write(ops) => issue_write(ops, engine),
            ExecStep::Prepare { vote, ops } => issue_prepare(vote, ops, engine),
        };
        Advance::Moved
    }

    /// Releases a finished exec's locks; the next exec in each queue may start.
    fn release(&mut self, id: u64) {
        let running = self.running.remove(&id).expect("a finished exec is running");
        for lock in running.locks {
            let queue = self.queues.get_mut(&lock).expect("a held lock has a queue");
            let head = queue.pop_front();
            assert_eq!(head, Some(id), "an exec finished without holding its lock");
            match queue.front() {
                None => {
                    self.queues.remove(&lock);
                }
                Some(&next) => {
                    let waiter = self.running.get_mut(&next).expect("a queued exec is running");
                    waiter.blocked_by -= 1;
                    if waiter.blocked_by == 0 {
                        waiter.state = State::Ready(StepInput::Start);
                        self.active.push(next);
                    }
                }
            }
        }
    }
}

enum Advance {
    Waiting,
    Moved,
    Finished,
}

enum PartProgress {
    /// Nothing changed.
    Still(State),
    /// The part moved to another state.
    Moved(State),
    /// The part is settled here; resume the exec with this.
    Done(StepInput),
}

fn poll_write(receiver: &mut WriteReceiver) -> Option<Result<(), WriteError>> {
    match receiver.try_recv() {
        Ok(None) => None,
        Ok(Some(result)) => Some(result),
        Err(oneshot::Canceled) => Some(Err(WriteError::Closed)),
    }
}

/// Moves a part through the protocol (invariant 4): prepared, decided, applied or erased.
fn advance_part(
    state: State,
    engine: &mut Gate,
    to_forget: &mut Vec<Arc<dyn Coordinator>>,
) -> PartProgress {
    match state {
        State::Preparing { mut part, mut receiver } => match poll_write(&mut receiver) {
            None => PartProgress::Still(State::Preparing { part, receiver }),
            Some(result) => {
                part.vote.prepared(result);
                PartProgress::Moved(State::Deciding(part))
            }
        },
        State::Deciding(part) => {
            let gsn = part.vote.coordinator().gsn();
            let (reply, receiver) = oneshot::channel();
            match part.vote.coordinator().decision() {
                Decision::Pending => PartProgress::Still(State::Deciding(part)),
                Decision::Committed => {
                    engine.handle(Request::CommitPart { gsn, reply });
                    PartProgress::Moved(State::Committing { part, receiver })
                }
                Decision::Aborted(reason) => {
                    engine.handle(Request::ForgetPart { gsn, reply });
                    PartProgress::Moved(State::Aborting { part, receiver, reason })
                }
            }
        }
        State::Committing { part, mut receiver } => match poll_write(&mut receiver) {
            None => PartProgress::Still(State::Committing { part, receiver }),
            Some(result) => {
                let coordinator = part.vote.coordinator().clone();
                let gsn = coordinator.gsn();
                match &result {
                    Ok(()) => {
                        engine.unlock(gsn, &part.ops);
                        to_forget.push(coordinator.clone());
                    }
                    // The engine is poisoned; the batch is committed, so its keys here must not
                    // read as before it: they answer errors until a reopen applies the part.
                    Err(err) => {
                        tracing::error!(shard = engine.shard_id(), gsn, %err, "a committed part failed to apply");
                        engine.fail(gsn, &part.ops);
                    }
                }
                coordinator.applied(engine.shard_id(), result.clone());
                PartProgress::Done(StepInput::Written(result))
            }
        },
        State::Aborting { part, mut receiver, reason } => match poll_write(&mut receiver) {
            None => PartProgress::Still(State::Aborting { part, receiver, reason }),
            Some(result) => {
                if let Err(err) = result {
                    // The engine is poisoned: no later write can be accepted, so the old values
                    // stand until a reopen resolves the part.
                    tracing::error!(shard = engine.shard_id(), %err, "erasing an aborted part failed");
                }
                engine.unlock(part.vote.coordinator().gsn(), &part.ops);
                PartProgress::Done(StepInput::Written(Err(reason)))
            }
        },
        other => PartProgress::Still(other),
    }
}

/// Starts a part: checks it, locks its keys in the gate, and asks the engine to make it durable.
fn issue_prepare(mut vote: Vote, ops: Vec<BatchOp>, engine: &mut Gate) -> State {
    let ops = crate::engine::batch_codec::dedupe_batch(ops);
    let coordinator = vote.coordinator().clone();
    if let Err(err) = check_part(coordinator.participants().len(), &ops) {
        vote.prepared(Err(err.into()));
        return State::Deciding(Part { vote, ops: Vec::new() });
    }
    engine.lock(coordinator.clone(), &ops);
    let (reply, receiver) = oneshot::channel();
    engine.handle(Request::PreparePart {
        gsn: coordinator.gsn(),
        participants: coordinator.participants().to_vec(),
        ops: ops.clone(),
        reply,
    });
    State::Preparing { part: Part { vote, ops }, receiver }
}

fn issue_reads(reads: Vec<ReadOp>, engine: &mut dyn ShardEngine) -> State {
    if reads.len() > EXEC_READS_MAX {
        return State::Ready(StepInput::Read(Err(ReadError::Input(InputError::TooManyReads {
            reads: reads.len(),
            max: EXEC_READS_MAX,
        }))));
    }
    for read in &reads {
        let checked = match read {
            ReadOp::Get(key) => check_key(key),
            ReadOp::Scan { limit, .. } if *limit > SCAN_ITEMS_MAX => {
                Err(InputError::ScanLimitTooLarge { limit: *limit, max: SCAN_ITEMS_MAX })
            }
            ReadOp::Scan { .. } => Ok(()),
        };
        if let Err(err) = checked {
            return State::Ready(StepInput::Read(Err(err.into())));
        }
    }
    let mut pending = Vec::with_capacity(reads.len());
    for read in reads {
        match read {
            ReadOp::Get(key) => {
                let (reply, receiver) = oneshot::channel();
                engine.handle(Request::Get { key, reply });
                pending.push(Some(PendingRead::Get(receiver)));
            }
            ReadOp::Scan { start, end, limit } => {
                let (reply, receiver) = oneshot::channel();
                engine.handle(Request::Scan { start, end, limit, reply });
                pending.push(Some(PendingRead::Scan(receiver)));
            }
        }
    }
    let results = pending.iter().map(|_| None).collect();
    State::Reading { pending, results }
}

fn issue_write(mut ops: Vec<BatchOp>, engine: &mut dyn ShardEngine) -> State {
    if ops.is_empty() {
        return State::Ready(StepInput::Written(Ok(())));
    }
    if let Err(err) = check_write(&ops) {
        return State::Ready(StepInput::Written(Err(err.into())));
    }
    // A single operation needs no batch record: one write instead of three.
    if ops.len() == 1 {
        return match ops.pop().expect("one op") {
            BatchOp::Put { key, value } => {
                let (reply, receiver) = oneshot::channel();
                engine.handle(Request::Put { key, value, reply });
                State::Writing(PendingWrite::Put(receiver))
            }
            BatchOp::Delete { key } => {
                let (reply, receiver) = oneshot::channel();
                engine.handle(Request::Delete { key, reply });
                State::Writing(PendingWrite::Delete(receiver))
            }
        };
    }
    let (reply, receiver) = oneshot::channel();
    engine.handle(Request::Batch { ops, reply });
    State::Writing(PendingWrite::Put(receiver))
}
