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
//! Plain requests (`Db::put`, `Db::get`, ...) take no locks: they are ordered with execs only by
//! arrival at the engine. A key space is used either through execs or through plain requests.

use std::collections::{HashMap, VecDeque};
use std::ops::Bound;

use futures::channel::oneshot;

use crate::engine::input::{check_key, check_write};
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
}

impl ExecTable {
    pub fn is_empty(&self) -> bool {
        self.running.is_empty()
    }

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
    pub fn pump(&mut self, engine: &mut dyn ShardEngine) -> bool {
        let mut moved_any = false;
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

    fn advance(&mut self, id: u64, engine: &mut dyn ShardEngine) -> Advance {
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
        };
        let step = running.exec.step(&ExecView { engine }, input);
        running.state = match step {
            ExecStep::Done => return Advance::Finished,
            ExecStep::Read(reads) => issue_reads(reads, engine),
            ExecStep::Write(ops) => issue_write(ops, engine),
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
