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
//!    A lock is held by its key's 64-bit hash (`lock_id`): keys whose hashes collide share one
//!    lock, which runs their execs one at a time too (less concurrency, the same guarantees).
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
//! 5. Group commit (a hot key): an exec whose last step is its one write says so
//!    (`ExecStep::WriteLast`). If the exec behind it in its lock key's queue joins write groups
//!    (`Exec::joins_write_groups`: it may ask index questions and point reads, then writes
//!    last), that exec starts at once, before the write is durable, seeing the group's writes
//!    through its view and its reads (a key the group wrote is read from the group's writes,
//!    any other from the engine, whose value no exec outside the group can change while the
//!    group holds the lock), and its write joins the group's. A joiner whose reads outlast the
//!    group's turn (the group was handed to the engine meanwhile) waits until the group is
//!    durable, then writes as the next group's first. The group's writes go to the engine as
//!    one all-or-nothing write at the end of the pump, and every member is answered, in queue
//!    order, once it is durable: one flush for a run of SETs of one key. Members keep their
//!    locks until then, so nothing outside the group sees its writes before they are durable
//!    (invariant 2 holds); a crash leaves all of the group's writes or none. Only single-key
//!    execs group; a member whose write does not fit the group's batch limits is written alone
//!    after it.
//!
//! 6. Lock versions (`ExecView::lock_version`): every exec step that writes (`Write`,
//!    `WriteLast` or `Prepare` with operations) counts one write on each of its locks (or on
//!    those its `written_locks` names) before the write is issued, while the exec holds them. So an exec that reads a lock's version, and a
//!    later exec holding the same lock that reads it again, see the same number only if no exec
//!    wrote under that lock in between (Redis's WATCH, `sequence.rs`). Plain requests do not count.
//!
//! Plain requests (`Db::put`, `Db::get`, ...) take no locks: they are ordered with execs only by
//! arrival at the engine. A key space is used either through execs or through plain requests.

use std::collections::{BTreeMap, VecDeque};

use crate::hash::HashMap;
use std::collections::hash_map::Entry;
use std::ops::Bound;
use std::sync::Arc;

use futures::channel::oneshot;

use super::coordinator::{Coordinator, Decision};
use super::gate::Gate;
use crate::engine::input::{check_key, check_part, check_write};
use crate::engine::batch_codec::{encoded_op_bytes, BATCH_HEADER_BYTES};
use crate::engine::{is_empty_range, BatchOp, KeyValue, Request, ShardEngine};
use crate::error::{InputError, ReadError, WriteError};
use crate::limits::{
    EXEC_READS_MAX, EXEC_WRITE_GROUP_BYTES_MAX, EXEC_WRITE_GROUP_MEMBERS_MAX,
    EXEC_WRITE_GROUP_OPS_MAX, LOCK_VERSION_SLOTS, SCAN_ITEMS_MAX,
};

/// A command that runs atomically in one shard.
pub trait Exec: Send + 'static {
    /// Advances the program: first with `StepInput::Start`, then with the results of the step it
    /// asked for last. `view` answers index questions with no I/O.
    fn step(&mut self, view: &ExecView<'_>, input: StepInput) -> ExecStep;

    /// Whether the program may start behind a write group (invariant 5) before the group is
    /// durable. A program that says yes promises that, started behind a group
    /// (`ExecView::behind_write_group`), it asks the view and reads with `ReadOp::Get` only,
    /// then returns `WriteLast` (an empty one if it has nothing to write: it is then answered
    /// once the group is durable), or `Done` having answered something that holds whatever its
    /// keys hold (an input error); anything else is a bug the shard stops on.
    fn joins_write_groups(&self) -> bool {
        false
    }

    /// The locks whose versions the exec's writes move (invariant 6): None for all it holds. A
    /// sequence names those of its steps that wrote.
    fn written_locks(&self) -> Option<&[u64]> {
        None
    }

    /// Background work (the server's active expiry and orphan collector): its writes move
    /// `ExecView::lock_version_all` only, not `lock_version` (a client watching a key does not
    /// see them as changes).
    fn is_background(&self) -> bool {
        false
    }
}

/// What an exec asks for next.
pub enum ExecStep {
    /// Reads, answered together (at most `EXEC_READS_MAX`).
    Read(ReadOps),
    /// One write: a single put or delete, or an all-or-nothing batch. Resumes once durable.
    Write(Vec<BatchOp>),
    /// As `Write`, and the exec's last: once resumed with `Written` it answers and returns
    /// `Done`. The write may share a flush with the execs behind it (invariant 5).
    WriteLast(Vec<BatchOp>),
    /// This shard's part of a cross-shard batch (invariant 4). Resumes with `Written`: Ok once
    /// the batch committed and the part is applied here (durable and visible), or the error
    /// that called the batch off.
    Prepare { vote: Vote, ops: Vec<BatchOp> },
    /// Finished; the locks are released.
    Done,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum ReadOp {
    Get(Vec<u8>),
    /// Up to `limit` items of the range, in key order, with values.
    Scan {
        start: Bound<Vec<u8>>,
        end: Bound<Vec<u8>>,
        limit: usize,
    },
}

#[derive(Clone, Debug)]
pub enum ReadResult {
    Value(Option<Vec<u8>>),
    Items(Vec<KeyValue>),
}

#[derive(Debug)]
pub enum StepInput {
    Start,
    /// The results of a `Read` step, in the order asked; the first failure if any failed.
    Read(Result<ReadResults, ReadError>),
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
/// For an exec started behind a write group, the group's writes not yet durable (invariant 5)
/// are part of what the view answers.
pub struct ExecView<'a> {
    engine: &'a dyn ShardEngine,
    /// Writes not in the engine yet that the exec sees: its write group's (invariant 5) or its
    /// sequence's (`sequence.rs`).
    overlay: Option<&'a Overlay>,
    /// `overlay` is a write group's, not yet durable.
    behind_group: bool,
    lock_versions: &'a LockVersions,
}

/// Writes not yet in the engine: each key's last value, None for a delete.
pub type Overlay = BTreeMap<Vec<u8>, Option<Vec<u8>>>;

impl<'a> ExecView<'a> {
    /// Whether the exec runs behind a write group that is not yet durable (invariant 5): what
    /// it sees includes the group's writes, so it must not answer before they are durable.
    pub fn behind_write_group(&self) -> bool {
        self.behind_group
    }

    /// The version of lock `lock` (`lock_ids`): how many writes execs holding it issued since
    /// the shard opened (invariant 6). Equal versions read under the lock mean no exec wrote
    /// under it in between.
    pub fn lock_version(&self, lock: u64) -> u64 {
        self.lock_versions.get(lock)
    }

    /// `lock_version` counting background work's writes too (`Exec::is_background`): what an
    /// optimistic reader of a key's items must compare, since such work deletes items.
    pub fn lock_version_all(&self, lock: u64) -> u64 {
        self.lock_versions.get_all(lock)
    }

    /// This view with `overlay`'s writes on top: a sequence's steps see the writes of the steps
    /// before them (`sequence.rs`), a script's commands those of the commands before them. Only
    /// for an exec that is not behind a write group.
    pub fn with_overlay<'b>(&'b self, overlay: &'b Overlay) -> ExecView<'b> {
        assert!(self.overlay.is_none(), "a sequence runs behind no write group");
        ExecView {
            engine: self.engine,
            overlay: Some(overlay),
            behind_group: false,
            lock_versions: self.lock_versions,
        }
    }

    pub fn contains(&self, key: &[u8]) -> bool {
        match self.overlay.and_then(|overlay| overlay.get(key)) {
            Some(value) => value.is_some(),
            None => self.engine.contains_key(key),
        }
    }

    /// Whether a live key starts with `byte` (no I/O; the native engine does no lookup).
    pub fn has_keys_starting_with(&self, byte: u8) -> bool {
        let (start, end) = crate::engine::first_byte_range(&byte);
        let Some(overlay) = self.overlay else { return self.engine.has_keys_starting_with(byte) };
        let mut changed = overlay.range::<[u8], _>((start, end)).peekable();
        if changed.peek().is_none() {
            return self.engine.has_keys_starting_with(byte);
        }
        // A key the group puts is one (no count over the group's writes, which grow with it).
        if changed.any(|(_, value)| value.is_some()) {
            return true;
        }
        self.count(start, end, 1) > 0
    }

    /// Up to `limit` keys of the range, in order (keys only: no I/O).
    pub fn keys(&self, start: Bound<&[u8]>, end: Bound<&[u8]>, limit: usize) -> Vec<Vec<u8>> {
        let Some(overlay) = self.overlay.filter(|_| !is_empty_range(start, end)) else {
            return self.engine.index_keys(start, end, limit);
        };
        let changed: Vec<(&Vec<u8>, bool)> =
            overlay.range::<[u8], _>((start, end)).map(|(key, value)| (key, value.is_some())).collect();
        // Asking for as many more as the group changed in the range leaves at least `limit`
        // after its deletes whenever the index had that many.
        let indexed = self.engine.index_keys(start, end, limit.saturating_add(changed.len()));
        let mut merged = Vec::with_capacity(limit.min(indexed.len() + changed.len()));
        let mut indexed = indexed.into_iter().peekable();
        let mut changed = changed.into_iter().peekable();
        while merged.len() < limit {
            let take_changed = match (indexed.peek(), changed.peek()) {
                (None, None) => break,
                (Some(key), Some((next, _))) => next.as_slice() <= key.as_slice(),
                (None, Some(_)) => true,
                (Some(_), None) => false,
            };
            if !take_changed {
                merged.push(indexed.next().expect("peeked"));
                continue;
            }
            let (key, present) = changed.next().expect("peeked");
            // The group's write replaces (or deletes) the indexed key of the same name.
            indexed.next_if(|indexed_key| indexed_key == key);
            if present {
                merged.push(key.clone());
            }
        }
        merged
    }

    /// Keys in the range, counting no further than `limit` (no I/O).
    pub fn count(&self, start: Bound<&[u8]>, end: Bound<&[u8]>, limit: usize) -> usize {
        let Some(overlay) = self.overlay.filter(|_| !is_empty_range(start, end)) else {
            return self.engine.count_keys(start, end, limit);
        };
        let changed: Vec<(&Vec<u8>, bool)> =
            overlay.range::<[u8], _>((start, end)).map(|(key, value)| (key, value.is_some())).collect();
        let indexed = self.engine.count_keys(start, end, limit.saturating_add(changed.len()));
        let mut count = indexed as isize;
        for (key, present) in changed {
            match (self.engine.contains_key(key), present) {
                (false, true) => count += 1,
                (true, false) => count -= 1,
                _ => {}
            }
        }
        (count.max(0) as usize).min(limit)
    }
}

/// An exec on its way to a shard.
pub struct ExecRequest {
    /// Its lock keys as the lock tables hold them (`lock_id`), each once, in order: computed by
    /// the sender, so that no copy of a key travels with the exec for its lock.
    pub locks: LockIds,
    pub exec: Box<dyn Exec>,
}

/// A step's reads, in place when one (a GET's): no list allocated for it.
pub type ReadOps = smallvec::SmallVec<[ReadOp; 1]>;
/// Their results, in the same order, in place when one.
pub type ReadResults = smallvec::SmallVec<[ReadResult; 1]>;

/// The locks of an exec (`lock_id` of each key, sorted, each once).
pub type LockIds = smallvec::SmallVec<[u64; 2]>;

impl ExecRequest {
    /// An exec holding the locks of `keys`.
    pub fn new<K: AsRef<[u8]>>(keys: &[K], exec: Box<dyn Exec>) -> ExecRequest {
        ExecRequest { locks: lock_ids(keys), exec }
    }
}

/// The locks of `keys`, as `ExecRequest::locks` holds them.
pub fn lock_ids<K: AsRef<[u8]>>(keys: &[K]) -> LockIds {
    if let [key] = keys {
        // Most commands hold one key: nothing to sort.
        let mut locks = LockIds::new();
        locks.push(lock_id(key.as_ref()));
        return locks;
    }
    let mut locks: LockIds = keys.iter().map(|key| lock_id(key.as_ref())).collect();
    // Keys whose ids collide are one lock: each queue holds an exec once.
    locks.sort_unstable();
    locks.dedup();
    locks
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
        /// In place for the usual one or two reads: a step's reads allocate no list of their own.
        pending: smallvec::SmallVec<[Option<PendingRead>; 2]>,
        results: Vec<Option<ReadResult>>,
    },
    Writing(PendingWrite),
    /// A member of its lock key's write group, waiting for the group's write (invariant 5).
    Grouped,
    /// Started behind a write group, with a write that did not fit the group: written alone
    /// once the group is done and the exec holds the lock.
    Deferred(Vec<BatchOp>),
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
    /// Its locks (`lock_id`), each once: the keys' bytes are not needed past arrival.
    locks: LockIds,
    blocked_by: usize,
    /// Stepped at least once (an exec started behind a write group starts while still blocked).
    started: bool,
    state: State,
    /// Started behind a write group whose write failed: it saw writes that never became
    /// durable, so its own write is refused with that error (invariant 5).
    saw_failed_group: Option<WriteError>,
}

/// Consecutive last writes on one lock key, made durable by one write (invariant 5).
struct WriteGroup {
    overlay: Overlay,
    /// `overlay`'s encoded bytes as one batch (`batch_codec::encoded_batch_bytes`).
    batch_bytes: usize,
    /// In queue order: the first holds the lock, the others are the execs right behind it.
    members: Vec<u64>,
    /// No exec joins any more: the group is written, or a member's write did not fit.
    closed: bool,
    /// The group's one write, once handed to the engine; then its outcome.
    write: Option<GroupWrite>,
}

enum GroupWrite {
    Pending(PendingWrite),
    Done(Result<(), WriteError>),
}

/// The shard's execs and their lock queues.
#[derive(Default)]
pub struct ExecTable {
    /// The execs that arrived and are not done, by id. An id is reused once its exec is
    /// released, which removes it from every queue, group and list first.
    running: slab::Slab<Running>,
    /// Per lock (`lock_id`), the execs holding or waiting for it, in arrival order (the first
    /// holds it; with a write group, its members are the first ones).
    queues: HashMap<u64, VecDeque<u64>>,
    /// Emptied queues kept for the next lock taken (at most `SPARE_QUEUES_MAX`): a lock taken
    /// and released per command costs no allocation.
    spare_queues: Vec<VecDeque<u64>>,
    /// Per lock, its write group, from its first member's `WriteLast` until every member is
    /// answered.
    groups: HashMap<u64, WriteGroup>,
    /// Execs that are not blocked; checked by `pump`.
    active: Vec<u64>,
    /// An empty list kept for `pump`'s next pass (it holds the pass's unfinished execs).
    spare_active: Vec<u64>,
    /// Parts applied here, waiting until every participant applied theirs to be erased.
    to_forget: Vec<Arc<dyn Coordinator>>,
    /// Reads the execs stepped in this pass of `pump` asked for, handed to the engine together
    /// at the pass's end (`hand_reads`): one run of gets, whose lookups the engine overlaps.
    reads: Vec<Request>,
    lock_versions: LockVersions,
}

/// Per lock, a count of the writes execs holding it issued (invariant 6), in
/// `LOCK_VERSION_SLOTS` counters indexed by the lock's low bits. Locks sharing a counter share
/// a version: a write under one moves the other's too, which can only make a watcher see a
/// change that did not happen (a transaction retried), never miss one. Allocated at the first
/// write, so a shard that never writes through execs holds none.
/// Two counts per counter: every write, and the writes of background work
/// (`Exec::is_background`: active expiry, the orphan collector), which a watcher of the key as
/// clients see it need not count but an optimistic reader of its items must.
#[derive(Default)]
pub(crate) struct LockVersions {
    counters: Vec<u64>,
    background: Vec<u64>,
}

impl LockVersions {
    /// Writes as clients see them: all but background work's.
    fn get(&self, lock: u64) -> u64 {
        self.get_all(lock) - self.background.get(lock as usize % LOCK_VERSION_SLOTS).copied().unwrap_or(0)
    }

    fn get_all(&self, lock: u64) -> u64 {
        self.counters.get(lock as usize % LOCK_VERSION_SLOTS).copied().unwrap_or(0)
    }

    fn bump(&mut self, locks: &[u64], background: bool) {
        if self.counters.is_empty() {
            self.counters = vec![0; LOCK_VERSION_SLOTS];
        }
        if background && self.background.is_empty() {
            self.background = vec![0; LOCK_VERSION_SLOTS];
        }
        for &lock in locks {
            self.counters[lock as usize % LOCK_VERSION_SLOTS] += 1;
            if background {
                self.background[lock as usize % LOCK_VERSION_SLOTS] += 1;
            }
        }
    }
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
        let id = self.running.vacant_key() as u64;
        let locks = request.locks;
        // A lock listed twice would queue the exec behind itself, for ever (`lock_ids` makes
        // them so; the field is public).
        assert!(locks.windows(2).all(|pair| pair[0] < pair[1]), "lock ids sorted, once each");
        let mut blocked_by = 0;
        for &lock in &locks {
            let spare = &mut self.spare_queues;
            let queue = self.queues.entry(lock).or_insert_with(|| spare.pop().unwrap_or_default());
            if !queue.is_empty() {
                blocked_by += 1;
            }
            queue.push_back(id);
        }
        let state = if blocked_by == 0 { State::Ready(StepInput::Start) } else { State::Blocked };
        if blocked_by == 0 {
            self.active.push(id);
        }
        let started = false;
        let inserted = self.running.insert(Running {
            exec: request.exec,
            locks,
            blocked_by,
            started,
            state,
            saw_failed_group: None,
        });
        debug_assert_eq!(inserted as u64, id);
    }

    /// Runs every exec that can make progress until none can: collects answers the engine has
    /// given, steps the programs and hands their new reads and writes to the engine. Returns
    /// whether anything moved.
    pub fn pump(&mut self, engine: &mut Gate) -> bool {
        // Reads the gate answers itself go first: before this pump unlocks any key.
        let mut moved_any = engine.poll();
        self.forget_applied(engine);
        moved_any |= self.answer_groups(engine);
        loop {
            let mut moved = false;
            let mut active = std::mem::take(&mut self.active);
            // The list of the pass before, emptied: a pass allocates no list of its own.
            let mut still_active = std::mem::take(&mut self.spare_active);
            for id in active.drain(..) {
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
                    Advance::Grouped => {
                        moved = true;
                        // A group member waits with its group, not among the active; any
                        // other outcome of `write_last` is an ordinary state.
                        if !matches!(self.running[id as usize].state, State::Grouped) {
                            still_active.push(id);
                        }
                    }
                }
            }
            // `release` may have activated blocked execs meanwhile.
            still_active.append(&mut self.active);
            self.active = still_active;
            self.spare_active = active;
            self.hand_reads(engine);
            if !moved {
                self.write_groups(engine);
                // The engine may have answered a group's write at once (a poisoned store, a
                // refused write): nothing else would bring this shard back to answer it.
                if !self.answer_groups(engine) {
                    return moved_any;
                }
            }
            moved_any = true;
        }
    }

    /// Hands the reads asked for in this pass to the engine, in order, as runs of one kind.
    fn hand_reads(&mut self, engine: &mut Gate) {
        if !self.reads.is_empty() {
            // Drained, not taken: the list keeps its room for the next pass.
            engine.handle_in_runs(self.reads.drain(..));
        }
    }

    /// Hands every open write group's writes to the engine as one write (the pump has stepped
    /// every exec that could join).
    fn write_groups(&mut self, engine: &mut Gate) {
        for group in self.groups.values_mut().filter(|group| group.write.is_none()) {
            group.closed = true;
            let ops = overlay_ops(std::mem::take(&mut group.overlay));
            group.write = Some(match issue_write(ops, engine) {
                State::Writing(pending) => GroupWrite::Pending(pending),
                State::Ready(StepInput::Written(result)) => GroupWrite::Done(result),
                _ => unreachable!("issue_write writes or answers"),
            });
        }
    }

    /// Answers the members of every write group whose write is durable (or failed), in queue
    /// order, and releases them. Returns whether any group was answered.
    fn answer_groups(&mut self, engine: &mut Gate) -> bool {
        let mut finished = Vec::new();
        for (lock, group) in self.groups.iter_mut() {
            let result = match &mut group.write {
                Some(GroupWrite::Pending(PendingWrite::Put(receiver))) => poll_write(receiver),
                Some(GroupWrite::Pending(PendingWrite::Delete(receiver))) => {
                    match receiver.try_recv() {
                        Ok(None) => None,
                        Ok(Some(result)) => Some(result.map(|_existed| ())),
                        Err(oneshot::Canceled) => Some(Err(WriteError::Closed)),
                    }
                }
                Some(GroupWrite::Done(result)) => Some(result.clone()),
                None => None,
            };
            if let Some(result) = result {
                finished.push((*lock, result));
            }
        }
        let answered = !finished.is_empty();
        for (lock, result) in finished {
            let group = self.groups.remove(&lock).expect("a finished group");
            if let Err(err) = &result {
                // The exec started behind the group, if any, saw its writes (invariant 5).
                let queue = self.queues.get(&lock).expect("a group's lock has a queue");
                if let Some(&next) = queue.get(group.members.len()) {
                    let joiner =
                        self.running.get_mut(next as usize).expect("a queued exec is running");
                    if joiner.started {
                        joiner.saw_failed_group = Some(err.clone());
                    }
                }
            }
            for id in group.members {
                let running = self.running.get_mut(id as usize).expect("a group member is running");
                let view = ExecView {
                    engine,
                    overlay: None,
                    behind_group: false,
                    lock_versions: &self.lock_versions,
                };
                let step = running.exec.step(&view, StepInput::Written(result.clone()));
                assert!(
                    matches!(step, ExecStep::Done),
                    "shard {}: an exec asked for more after its WriteLast",
                    engine.shard_id()
                );
                self.release(id);
            }
        }
        answered
    }

    /// Starts the exec right behind the write group of `lock`, if the group is open and that
    /// exec joins write groups and waits for `lock` alone (invariant 5).
    fn start_behind_group(&mut self, lock: u64) {
        let Some(group) = self.groups.get(&lock) else { return };
        if group.closed || group.members.len() >= EXEC_WRITE_GROUP_MEMBERS_MAX {
            return;
        }
        let queue = self.queues.get(&lock).expect("a group's lock has a queue");
        let Some(&next) = queue.get(group.members.len()) else { return };
        let running = self.running.get_mut(next as usize).expect("a queued exec is running");
        if running.started || running.locks.len() != 1 || !running.exec.joins_write_groups() {
            return;
        }
        running.started = true;
        running.state = State::Ready(StepInput::Start);
        self.active.push(next);
    }

    /// An exec's `WriteLast`: starts or joins its lock key's write group, or, for an exec of
    /// several locks, writes as `Write` does.
    fn write_last(&mut self, id: u64, ops: Vec<BatchOp>, engine: &mut Gate) {
        let running = self.running.get_mut(id as usize).expect("a stepping exec is running");
        if let Some(err) = running.saw_failed_group.take() {
            running.state = State::Ready(StepInput::Written(Err(err)));
            return;
        }
        if running.locks.len() != 1 {
            running.state = issue_write(ops, engine);
            return;
        }
        if let Err(err) = check_write(&ops) {
            running.state = State::Ready(StepInput::Written(Err(err.into())));
            return;
        }
        let lock = running.locks[0];
        let group = match self.groups.entry(lock) {
            // The lock's holder: a group of one, which the execs behind it may join. (A holder
            // whose write alone passes the group's bound closes the group at once, below, and
            // writes alone after it.)
            Entry::Vacant(vacant) => {
                assert_eq!(running.blocked_by, 0, "an exec outside a group wrote before its turn");
                vacant.insert(WriteGroup {
                    overlay: Overlay::new(),
                    batch_bytes: BATCH_HEADER_BYTES,
                    members: Vec::new(),
                    closed: false,
                    write: None,
                })
            }
            Entry::Occupied(occupied) => {
                let group = occupied.into_mut();
                // A joiner whose reads outlast the group's turn never gets here while the
                // group is closed: `advance` holds it until the group is durable and gone.
                assert!(
                    !group.closed && running.blocked_by > 0,
                    "shard {}: a write group was joined by an exec it did not start",
                    engine.shard_id()
                );
                group
            }
        };
        // The group's batch with this write in it, measured without building it. The ops move
        // into the overlay (a SET's value is not copied); a write that does not fit is rebuilt
        // from it, which keeps what the ops meant: each key's last value.
        let mut mine = Overlay::new();
        apply(&mut mine, ops);
        let mut ops_after = group.overlay.len();
        let mut bytes_after = group.batch_bytes;
        for (key, value) in &mine {
            match group.overlay.get(key) {
                Some(old) => bytes_after -= encoded_op_bytes(key, old.as_deref()),
                None => ops_after += 1,
            }
            bytes_after += encoded_op_bytes(key, value.as_deref());
        }
        // One operation is written without a batch record (its own checks passed above).
        let fits = ops_after <= 1
            || (ops_after <= EXEC_WRITE_GROUP_OPS_MAX && bytes_after <= EXEC_WRITE_GROUP_BYTES_MAX);
        if !fits {
            // Too much for one batch: this exec writes alone once the group is done.
            group.closed = true;
            running.state = State::Deferred(overlay_ops(mine));
            return;
        }
        group.overlay.append(&mut mine);
        group.batch_bytes = bytes_after;
        group.members.push(id);
        running.state = State::Grouped;
        self.start_behind_group(lock);
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
        let running = self.running.get_mut(id as usize).expect("an active exec is running");
        // Started behind a group that was handed to the engine: the group's writes are no longer
        // in its overlay, and not yet in the engine's index. It waits, its reads answered or
        // not, until the group is durable and the lock is its own (invariant 5).
        if running.started && running.blocked_by > 0 && !matches!(running.state, State::Grouped) {
            let group = self.groups.get(&running.locks[0]);
            if group.is_some_and(|group| group.write.is_some()) {
                return Advance::Waiting;
            }
        }
        let input = match &mut running.state {
            State::Blocked => unreachable!("a blocked exec is never active"),
            State::Grouped => unreachable!("a group member is answered with its group"),
            State::Deferred(_) if running.blocked_by > 0 => return Advance::Waiting,
            State::Deferred(ops) => {
                // The group before it is done and it holds the lock: its own write now.
                let ops = std::mem::take(ops);
                running.state = match running.saw_failed_group.take() {
                    Some(err) => State::Ready(StepInput::Written(Err(err))),
                    None => issue_write(ops, engine),
                };
                return Advance::Moved;
            }
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
        // Started behind a write group: the group's writes are part of what it sees, and it
        // may only write last or finish (`Exec::joins_write_groups`).
        let behind_group = running.blocked_by > 0;
        let overlay: Option<&Overlay> = if behind_group {
            let group = self.groups.get(&running.locks[0]).expect("started behind a group");
            Some(&group.overlay)
        } else {
            None
        };
        let view = ExecView {
            engine,
            overlay,
            behind_group,
            lock_versions: &self.lock_versions,
        };
        let step = running.exec.step(&view, input);
        running.started = true;
        if let ExecStep::Write(ops) | ExecStep::WriteLast(ops) | ExecStep::Prepare { ops, .. } =
            &step
        {
            if !ops.is_empty() {
                let background = running.exec.is_background();
                match running.exec.written_locks() {
                    Some(locks) => self.lock_versions.bump(locks, background),
                    None => self.lock_versions.bump(&running.locks, background),
                }
            }
        }
        if behind_group {
            assert!(
                match &step {
                    ExecStep::WriteLast(_) | ExecStep::Done => true,
                    ExecStep::Read(reads) => {
                        reads.iter().all(|read| matches!(read, ReadOp::Get(_)))
                    }
                    _ => false,
                },
                "shard {}: an exec started behind a write group asked for more than point reads \
                 and a last write",
                engine.shard_id()
            );
        }
        running.state = match step {
            ExecStep::Done => return Advance::Finished,
            ExecStep::Read(reads) if behind_group => {
                let group = self.groups.get(&running.locks[0]).expect("started behind a group");
                issue_reads_over(reads, &group.overlay, &mut self.reads)
            }
            ExecStep::Read(reads) => issue_reads(reads, &mut self.reads),
            ExecStep::Write(ops) => issue_write(ops, engine),
            ExecStep::WriteLast(ops) => {
                self.write_last(id, ops, engine);
                return Advance::Grouped;
            }
            ExecStep::Prepare { vote, ops } => issue_prepare(vote, ops, engine),
        };
        Advance::Moved
    }

    /// Releases a finished exec's locks; the next exec in each queue may start.
    fn release(&mut self, id: u64) {
        let running = self.running.try_remove(id as usize).expect("a finished exec is running");
        for lock in running.locks {
            let queue = self.queues.get_mut(&lock).expect("a held lock has a queue");
            let position = queue.iter().position(|&queued| queued == id);
            if position != Some(0) {
                // Started behind a write group, it finished without writing (invariant 5):
                // the lock stays with the group; the exec behind it may join in its place.
                assert!(
                    position.is_some() && running.blocked_by > 0,
                    "an exec finished without holding its lock"
                );
                queue.retain(|&queued| queued != id);
                self.start_behind_group(lock);
                continue;
            }
            queue.pop_front();
            match queue.front() {
                None => {
                    let queue = self.queues.remove(&lock).expect("a held lock has a queue");
                    // A hot key's long queue is let go: the spares stay a few KiB.
                    if self.spare_queues.len() < SPARE_QUEUES_MAX
                        && queue.capacity() <= SPARE_QUEUE_CAPACITY_MAX
                    {
                        self.spare_queues.push(queue);
                    }
                }
                Some(&next) => {
                    let waiter = self.running.get_mut(next as usize).expect("a queued exec is running");
                    waiter.blocked_by -= 1;
                    if waiter.blocked_by == 0 {
                        match waiter.state {
                            // A later member of the group being answered, the exec that
                            // writes after it, or one started behind the group still reading
                            // (each already among the active or answered with the group).
                            State::Grouped | State::Deferred(_) => {}
                            _ if waiter.started => {}
                            _ => {
                                waiter.state = State::Ready(StepInput::Start);
                                self.active.push(next);
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Emptied lock queues an `ExecTable` keeps for reuse: enough for every exec of a full wave of
/// pipelined commands from many connections, and only short ones (at most
/// `SPARE_QUEUES_MAX` × `SPARE_QUEUE_CAPACITY_MAX` × 8 bytes = 16 KiB kept).
const SPARE_QUEUES_MAX: usize = 256;
const SPARE_QUEUE_CAPACITY_MAX: usize = 8;

/// The identity of a lock key in the lock tables: its 64-bit hash. Keys whose hashes collide
/// share one lock: their execs run one after another, and a write group may hold writes of both
/// (an all-or-nothing write of several keys), so a collision costs only concurrency, never
/// correctness (invariants 1 and 5 hold for the shared lock). Holding hashes rather than copies
/// of the keys spares an allocation per lock taken.
fn lock_id(key: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(key)
}

enum Advance {
    Waiting,
    Moved,
    Finished,
    /// It wrote last (`write_last` chose its state).
    Grouped,
}

/// The writes an overlay holds, as batch operations in key order.
pub fn overlay_ops(overlay: Overlay) -> Vec<BatchOp> {
    overlay
        .into_iter()
        .map(|(key, value)| match value {
            Some(value) => BatchOp::Put { key, value },
            None => BatchOp::Delete { key },
        })
        .collect()
}

/// Applies `ops` to a group's writes: each key keeps its last value.
pub fn apply(overlay: &mut Overlay, ops: impl IntoIterator<Item = BatchOp>) {
    for op in ops {
        match op {
            BatchOp::Put { key, value } => overlay.insert(key, Some(value)),
            BatchOp::Delete { key } => overlay.insert(key, None),
        };
    }
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

/// Checks an exec's reads and queues them for the pass's end (`ExecTable::hand_reads`).
fn issue_reads(reads: ReadOps, queued: &mut Vec<Request>) -> State {
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
    let mut pending = smallvec::SmallVec::with_capacity(reads.len());
    for read in reads {
        match read {
            ReadOp::Get(key) => {
                let (reply, receiver) = oneshot::channel();
                queued.push(Request::Get { key, reply });
                pending.push(Some(PendingRead::Get(receiver)));
            }
            ReadOp::Scan { start, end, limit } => {
                let (reply, receiver) = oneshot::channel();
                queued.push(Request::Scan { start, end, limit, reply });
                pending.push(Some(PendingRead::Scan(receiver)));
            }
        }
    }
    let results = pending.iter().map(|_| None).collect();
    State::Reading { pending, results }
}

/// `issue_reads` for an exec behind a write group: a key the group wrote is answered from the
/// group's writes at once; the others are read from the engine (point reads only, invariant 5).
fn issue_reads_over(reads: ReadOps, overlay: &Overlay, queued: &mut Vec<Request>) -> State {
    if !reads.iter().any(|read| matches!(read, ReadOp::Get(key) if overlay.contains_key(key))) {
        return issue_reads(reads, queued);
    }
    // Per read, its value from the group's writes, or None: read from the engine.
    let mut from_group = Vec::with_capacity(reads.len());
    let mut from_engine = ReadOps::new();
    for read in reads {
        match read {
            ReadOp::Get(key) if overlay.contains_key(&key) => {
                from_group.push(Some(overlay[&key].clone()));
            }
            read => {
                from_group.push(None);
                from_engine.push(read);
            }
        }
    }
    let (mut pending_engine, mut results_engine) = match issue_reads(from_engine, queued) {
        State::Reading { pending, results } => (pending.into_iter(), results.into_iter()),
        refused => return refused,
    };
    let mut pending = smallvec::SmallVec::with_capacity(from_group.len());
    let mut results = Vec::with_capacity(from_group.len());
    for value in from_group {
        match value {
            Some(value) => {
                pending.push(None);
                results.push(Some(ReadResult::Value(value)));
            }
            None => {
                pending.push(pending_engine.next().expect("one pending read per engine read"));
                results.push(results_engine.next().expect("one result per engine read"));
            }
        }
    }
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
