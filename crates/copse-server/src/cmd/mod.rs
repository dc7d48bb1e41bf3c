//! Redis commands: the table of every command the server knows, and the machinery that turns a
//! command into exec programs on the shards that own its keys.
//!
//! A command handler runs on the connection's thread and never blocks: it answers at once
//! (PING, a syntax error), or returns the exec programs to queue (one per shard it touches) and
//! how to combine their answers, or a future to run after every earlier reply of the connection
//! (SCAN, KEYS, FLUSHALL: commands over the whole key space). Each exec runs atomically in its
//! shard under the locks of the Redis keys it names, so a read-modify-write (INCR, HSET, ZADD)
//! is atomic, and the commands of one connection on one key run in the order they were sent.
//!
//! Reading order: this file, then `namespace.rs` (how a command's database reaches its execs),
//! `strings.rs`, `keys.rs`, `hashes.rs`, `zsets.rs`, `objects.rs`, `server.rs`.

pub mod dump;
pub mod expiry;
pub mod hashes;
pub mod inspect;
pub mod keys;
pub mod lists;
pub mod multi;
pub mod names;
pub mod namespace;
pub mod objects;
pub mod orphans;
pub mod pubsub;
pub mod scripts;
pub mod server;
pub mod sets;
pub mod store;
pub mod strings;
pub mod upgrade;
pub mod zset_ops;
pub mod zsets;

use std::collections::HashMap;
use std::ops::Bound;
use std::sync::Arc;

use copse::exec::{
    lock_ids, Exec, ExecRequest, ExecStep, ExecView, LockIds, ReadOp, ReadOps, ReadResult,
    ReadResults, StepInput, Vote,
};
use copse::BatchOp;
use copse::Db;
use futures::channel::oneshot;
use futures::future::LocalBoxFuture;
use namespace::Namespace;
pub use namespace::View;

use crate::context::{ConnState, Server};
use crate::keyspace::{self, KeyType};
use crate::resp::{Args, Reply};

pub const WRONGTYPE: &str = "WRONGTYPE Operation against a key holding the wrong kind of value";
pub const NOT_INTEGER: &str = "ERR value is not an integer or out of range";
pub const NOT_FLOAT: &str = "ERR value is not a valid float";
pub const SYNTAX: &str = "ERR syntax error";

/// What a command's exec program is told at each step (errors are answered for it).
pub enum Input {
    Start,
    Read(ReadResults),
    Written,
}

/// What a command's exec program asks for next.
pub enum Next {
    Read(ReadOps),
    Write(Vec<BatchOp>),
    /// The program's last write: once durable it answers (`Input::Written`) and is done. Its
    /// write may share a flush with the same key's next commands (`on_key_grouped`).
    WriteLast(Vec<BatchOp>),
    /// This shard's part of a cross-shard batch (MSET over several shards): resumes with
    /// `Written` once the batch committed and the part is applied here.
    Prepare(Vote, Vec<BatchOp>),
    /// Done: answer this.
    Reply(Reply),
}

/// A Redis command as an exec program: a closure over its own state, stepped by the shard.
struct CommandExec<F> {
    step: F,
    answer: Option<oneshot::Sender<Reply>>,
    /// `Exec::joins_write_groups`: set only by `on_key_grouped`, whose callers keep its promise.
    joins_write_groups: bool,
    /// An answer decided behind a write group, held until the group is durable (it may tell
    /// what the group wrote): sent once the empty last write that stands for it is answered.
    held: Option<Reply>,
    /// The database whose items the program sees (`namespace.rs`): its item keys are
    /// translated here, at the exec's boundary.
    namespace: Namespace,
    /// The command's long keys (`names.rs`): the name items its writes need. None for a
    /// command of short keys only and for background work.
    names: Option<Arc<names::Names>>,
    /// Background work (active expiry, the orphan collector) whose writes change nothing a
    /// client could see as a change: they move only `lock_version_all`, so they fail no WATCH (a
    /// key live at WATCH that expires is caught by its deadline instead, `multi.rs`), while an
    /// optimistic script that read the key's items sees them (`scripts::spread`).
    background: bool,
}

impl<F> Exec for CommandExec<F>
where
    F: FnMut(&View<'_>, Input) -> Next + Send + 'static,
{
    fn step(&mut self, view: &ExecView<'_>, input: StepInput) -> ExecStep {
        let input = match input {
            StepInput::Start => Input::Start,
            StepInput::Read(Ok(mut results)) => {
                self.namespace.read_results(&mut results);
                Input::Read(results)
            }
            StepInput::Written(Ok(())) => match self.held.take() {
                Some(reply) => return self.finish(reply),
                None => Input::Written,
            },
            StepInput::Read(Err(err)) => return self.finish(read_error(&err)),
            StepInput::Written(Err(err)) => return self.finish(write_error(&err)),
        };
        let behind_group = self.joins_write_groups && view.behind_write_group();
        let namespace = &self.namespace;
        let mut next = (self.step)(&View::new(view, namespace), input);
        let fits = match &mut next {
            Next::Write(ops) | Next::WriteLast(ops) | Next::Prepare(_, ops) => {
                namespace.write_ops(ops).is_ok()
            }
            _ => true,
        };
        // The name items of long keys go with their meta items (`names.rs`), as stored.
        let named = match &mut next {
            Next::Write(ops) | Next::WriteLast(ops) | Next::Prepare(_, ops) if fits => {
                names::maintain(ops, self.names.as_deref())
            }
            _ => Ok(()),
        };
        if let Err(error) = named {
            if let Next::Prepare(vote, _) = next {
                vote.refuse(copse::WriteError::Aborted("a long key's name is unknown".into()));
            }
            return self.finish(error);
        }
        match next {
            Next::Read(mut reads) => {
                namespace.read_ops(&mut reads);
                ExecStep::Read(reads)
            }
            // A program that joins write groups writes once, as its last step (`on_key_grouped`):
            // so its write may start a group, or join the one it runs behind.
            Next::Write(ops) | Next::WriteLast(ops) if !fits => {
                let error = namespace::too_long(&ops);
                self.finish(error)
            }
            Next::Prepare(vote, ops) if !fits => {
                let error = namespace::too_long(&ops);
                vote.refuse(copse::WriteError::Aborted("an item key is too long".into()));
                self.finish(error)
            }
            Next::Write(ops) if self.joins_write_groups => ExecStep::WriteLast(ops),
            Next::Write(ops) => ExecStep::Write(ops),
            Next::WriteLast(ops) => ExecStep::WriteLast(ops),
            Next::Prepare(vote, ops) => ExecStep::Prepare { vote, ops },
            Next::Reply(reply) if behind_group => {
                // What it saw includes the group's writes: answered once they are durable.
                self.held = Some(reply);
                ExecStep::WriteLast(Vec::new())
            }
            Next::Reply(reply) => self.finish(reply),
        }
    }

    fn joins_write_groups(&self) -> bool {
        self.joins_write_groups
    }

    fn is_background(&self) -> bool {
        self.background
    }
}

impl<F> CommandExec<F> {
    /// A program in the namespace of the command being handled (`Namespace::current`).
    fn new(step: F, answer: oneshot::Sender<Reply>, joins_write_groups: bool) -> CommandExec<F> {
        let namespace = Namespace::current();
        CommandExec::in_namespace(step, answer, joins_write_groups, namespace, names::current())
    }

    fn in_namespace(
        step: F,
        answer: oneshot::Sender<Reply>,
        joins_write_groups: bool,
        namespace: Namespace,
        names: Option<Arc<names::Names>>,
    ) -> CommandExec<F> {
        let answer = Some(answer);
        let background = false;
        CommandExec { step, answer, joins_write_groups, held: None, namespace, names, background }
    }

    fn finish(&mut self, reply: Reply) -> ExecStep {
        if let Some(answer) = self.answer.take() {
            let _ = answer.send(reply);
        }
        ExecStep::Done
    }
}

pub fn read_error(err: &copse::ReadError) -> Reply {
    Reply::Error(format!("ERR {err}"))
}

pub fn write_error(err: &copse::WriteError) -> Reply {
    match err {
        copse::WriteError::NoSpace(_) => {
            Reply::Error(format!("ERR no space left on the device; nothing was written ({err})"))
        }
        other => Reply::Error(format!("ERR {other}")),
    }
}

/// An exec to queue: its shard, and the program with its lock keys.
pub struct Queued {
    pub shard: u32,
    pub request: ExecRequest,
}

pub type Combine = Box<dyn FnOnce(Vec<Reply>) -> Reply>;

/// What a handler decided.
pub enum Outcome {
    Reply(Reply),
    /// Queue these execs now, in order, and answer from them.
    Execs(Execs),
    /// Run after every earlier reply of the connection is in.
    AfterPending(LocalBoxFuture<'static, Reply>),
    /// Answer, then close the connection (QUIT).
    Close(Reply),
}

impl Outcome {
    pub fn error(text: impl Into<String>) -> Outcome {
        Outcome::Reply(Reply::Error(text.into()))
    }

    /// This outcome with `change` applied to its reply, however it is answered.
    pub fn map_reply(self, change: impl FnOnce(Reply) -> Reply + 'static) -> Outcome {
        match self {
            Outcome::Reply(reply) => Outcome::Reply(change(reply)),
            Outcome::Close(reply) => Outcome::Close(change(reply)),
            Outcome::AfterPending(future) => {
                Outcome::AfterPending(Box::pin(async move { change(future.await) }))
            }
            Outcome::Execs(Execs::One { queued, answer }) => Outcome::Execs(Execs::Many {
                queued: vec![queued],
                answers: vec![answer],
                combine: Box::new(move |mut replies| {
                    change(replies.pop().unwrap_or_else(|| Reply::error("ERR internal error")))
                }),
            }),
            Outcome::Execs(Execs::Many { queued, answers, combine }) => {
                Outcome::Execs(Execs::Many {
                    queued,
                    answers,
                    combine: Box::new(move |replies| change(combine(replies))),
                })
            }
        }
    }
}

/// A command's execs and how its answer comes from theirs.
pub enum Execs {
    /// One exec, whose answer is the command's (most commands: one key). Kept apart from
    /// `Many` so that the hot path builds no vectors and no combining step.
    One { queued: Queued, answer: oneshot::Receiver<Reply> },
    /// Several, in order; the command answers `combine` of their answers.
    Many { queued: Vec<Queued>, answers: Vec<oneshot::Receiver<Reply>>, combine: Combine },
}

/// Builds the execs of one command.
pub struct Plan {
    queued: Vec<Queued>,
    answers: Vec<oneshot::Receiver<Reply>>,
}

impl Plan {
    pub fn new() -> Plan {
        Plan { queued: Vec::new(), answers: Vec::new() }
    }

    /// Adds an exec on `shard` holding the locks of Redis keys `keys`.
    pub fn add<F>(&mut self, shard: u32, keys: Vec<Vec<u8>>, step: F)
    where
        F: FnMut(&View<'_>, Input) -> Next + Send + 'static,
    {
        let (answer, receiver) = oneshot::channel();
        let exec = Box::new(CommandExec::new(step, answer, false));
        self.queued.push(Queued { shard, request: ExecRequest::new(&keys, exec) });
        self.answers.push(receiver);
    }

    /// `add` for background work: its writes move no lock version (`CommandExec::background`).
    pub fn add_background<F>(&mut self, shard: u32, keys: Vec<Vec<u8>>, step: F)
    where
        F: FnMut(&View<'_>, Input) -> Next + Send + 'static,
    {
        let (answer, receiver) = oneshot::channel();
        let mut exec = CommandExec::new(step, answer, false);
        exec.background = true;
        self.queued.push(Queued { shard, request: ExecRequest::new(&keys, Box::new(exec)) });
        self.answers.push(receiver);
    }

    pub fn finish(self, combine: Combine) -> Outcome {
        Outcome::Execs(Execs::Many { queued: self.queued, answers: self.answers, combine })
    }
}

/// Builds one exec per shard for a cross-shard batch (`Db::exec_atomic`): each step function
/// is made from its vote when the coordinator queues it.
pub struct AtomicPlan {
    parts: Vec<copse::exec::AtomicExec>,
    answers: Vec<oneshot::Receiver<Reply>>,
}

impl AtomicPlan {
    pub fn new() -> AtomicPlan {
        AtomicPlan { parts: Vec::new(), answers: Vec::new() }
    }

    /// Adds the exec of `shard` holding the locks of Redis keys `keys`; `make` builds its step
    /// function from its vote, which the step must end with (`Next::Prepare`) or refuse.
    pub fn add<M, F>(&mut self, shard: u32, keys: Vec<Vec<u8>>, make: M)
    where
        M: FnOnce(Vote) -> F + Send + 'static,
        F: FnMut(&View<'_>, Input) -> Next + Send + 'static,
    {
        let (answer, receiver) = oneshot::channel();
        // Built later, when the coordinator queues it: in the namespace of now.
        let (namespace, names) = (Namespace::current(), names::current());
        self.parts.push(copse::exec::AtomicExec {
            shard,
            locks: keys,
            lock_ids: Default::default(),
            build: Box::new(move |vote| {
                let exec = CommandExec::in_namespace(make(vote), answer, false, namespace, names);
                Box::new(exec) as Box<dyn Exec>
            }),
        });
        self.answers.push(receiver);
    }

    /// Runs after the connection's earlier replies: queues the execs in shard order (the
    /// coordinator's rule) and combines their answers.
    pub fn finish(self, db: &Db, combine: Combine) -> Outcome {
        let db = db.clone();
        Outcome::AfterPending(Box::pin(async move {
            db.exec_atomic(self.parts).await;
            collect(self.answers, combine).await
        }))
    }
}

impl Default for AtomicPlan {
    fn default() -> Self {
        AtomicPlan::new()
    }
}

impl Default for Plan {
    fn default() -> Self {
        Plan::new()
    }
}

/// Where `on_key` sends a key's exec: the key's shard and its lock. Built from a borrowed key
/// before the program takes the key itself, so neither copies it.
pub struct KeyTarget {
    shard: u32,
    locks: LockIds,
}

impl KeyTarget {
    pub fn of(db: &Db, key: &[u8]) -> KeyTarget {
        KeyTarget { shard: db.shard_of(key), locks: lock_ids(&[key]) }
    }
}

/// One exec on the shard of one Redis key (`target`), holding its lock and answering for the
/// whole command.
pub fn on_key<F>(target: KeyTarget, step: F) -> Outcome
where
    F: FnMut(&View<'_>, Input) -> Next + Send + 'static,
{
    on_key_grouped(target, false, step)
}

/// `on_key` for background work: its writes move no lock version (`CommandExec::background`).
pub fn on_key_background<F>(target: KeyTarget, step: F) -> Outcome
where
    F: FnMut(&View<'_>, Input) -> Next + Send + 'static,
{
    let (answer, receiver) = oneshot::channel();
    let mut exec = CommandExec::new(step, answer, false);
    exec.background = true;
    let KeyTarget { shard, locks } = target;
    let request = ExecRequest { locks, exec: Box::new(exec) };
    Outcome::Execs(Execs::One { queued: Queued { shard, request }, answer: receiver })
}

/// As `on_key`, for a program that may start behind the key's write group before it is
/// durable (`copse::exec::Exec::joins_write_groups`), and so shares a flush with the commands
/// on the key before it. The program must keep that promise: it asks the view and reads single
/// items (`ReadOp::Get`) only, and writes at most once (`Next::Write` or `Next::WriteLast`),
/// as its last step. Behind a group, an answer it gives without writing is held until the group
/// is durable (an empty last write stands for it), so it never tells what a write a crash could
/// take back did. `grouped` false is `on_key`.
pub fn on_key_grouped<F>(target: KeyTarget, grouped: bool, step: F) -> Outcome
where
    F: FnMut(&View<'_>, Input) -> Next + Send + 'static,
{
    let (answer, receiver) = oneshot::channel();
    let exec = Box::new(CommandExec::new(step, answer, grouped));
    let KeyTarget { shard, locks } = target;
    let request = ExecRequest { locks, exec };
    Outcome::Execs(Execs::One { queued: Queued { shard, request }, answer: receiver })
}

/// Groups argument positions by the shard of the key at each, keeping their order.
pub fn by_shard(db: &Db, keys: &[Vec<u8>]) -> Vec<(u32, Vec<usize>)> {
    let mut groups: HashMap<u32, Vec<usize>> = HashMap::new();
    let mut order = Vec::new();
    for (at, key) in keys.iter().enumerate() {
        let shard = db.shard_of(key);
        groups
            .entry(shard)
            .or_insert_with(|| {
                order.push(shard);
                Vec::new()
            })
            .push(at);
    }
    order.into_iter().map(|shard| (shard, groups.remove(&shard).expect("grouped"))).collect()
}

/// The type of Redis key `key` as the shard's index knows it (no I/O), None for a missing or
/// expired key: one lookup for a string, and no more while the shard holds no hash or sorted
/// set (`stored_collection_type`) and no expiry (`Expiry::of`).
pub fn key_type(view: &View<'_>, key: &[u8]) -> Option<KeyType> {
    let found = Expiry::of(view, key).live(stored_type(view, key));
    view.note_lookup(found.is_some());
    found
}

/// The type of the meta item `key` has, expired or not (the collectors' view).
pub fn stored_type(view: &View<'_>, key: &[u8]) -> Option<KeyType> {
    if view.contains(&keyspace::meta_key(key, KeyType::String)) {
        return Some(KeyType::String);
    }
    stored_collection_type(view, key)
}

/// `stored_type` for a hash or a sorted set: no lookup at all in a shard that holds neither
/// (`may_hold_collections`).
pub fn stored_collection_type(view: &View<'_>, key: &[u8]) -> Option<KeyType> {
    if !may_hold_collections(view) {
        return None;
    }
    KeyType::COLLECTIONS.into_iter().find(|ty| view.contains(&keyspace::meta_key(key, *ty)))
}

/// Whether any key of the shard may be a collection (hash, sorted set, list), with no lookup.
/// Every collection has at least one element item, whose item key starts with its tag: the
/// command that removes the last one deletes the meta item in the same batch (HDEL, ZREM and
/// the like), and one that writes a meta item writes an item with it. So a shard with no key
/// starting with either tag holds only strings.
pub fn may_hold_collections(view: &View<'_>) -> bool {
    KeyType::COLLECTIONS
        .into_iter()
        .filter_map(KeyType::element_tag)
        .any(|tag| view.has_keys_starting_with(tag))
}

thread_local! {
    /// A clock reading every `now_ms` on this thread returns while set (`FrozenClock`).
    static FROZEN_NOW_MS: std::cell::Cell<Option<u64>> = const { std::cell::Cell::new(None) };
}

/// While alive, `now_ms` on this thread answers one reading: a transaction's commands see one
/// moment, as Redis's do (`multi.rs`).
pub struct FrozenClock {
    before: Option<u64>,
}

impl FrozenClock {
    pub fn at(now_ms: u64) -> FrozenClock {
        FrozenClock { before: FROZEN_NOW_MS.with(|frozen| frozen.replace(Some(now_ms))) }
    }
}

impl Drop for FrozenClock {
    fn drop(&mut self) {
        FROZEN_NOW_MS.with(|frozen| frozen.set(self.before));
    }
}

/// Unix time in milliseconds: what deadlines are compared with.
pub fn now_ms() -> u64 {
    if let Some(frozen) = FROZEN_NOW_MS.with(std::cell::Cell::get) {
        return frozen;
    }
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_millis() as u64)
}

/// The deadline of `key`'s expiry item, expired or not: one index step, none in a shard that
/// holds no expiry item.
pub fn stored_deadline(view: &View<'_>, key: &[u8]) -> Option<u64> {
    if !view.has_keys_starting_with(keyspace::TAG_EXPIRY) {
        return None;
    }
    let (start, end) = keyspace::expiry_range(key);
    let items = view.keys(bound_ref(&start), bound_ref(&end), 1);
    items.first().and_then(|item| keyspace::decode_expiry(item, key))
}

/// A key's expiry as an exec finds it, decided once against one clock reading, so that every
/// step of the exec agrees on whether the key is there (as Redis decides once per command).
#[derive(Debug, Default)]
pub struct Expiry {
    /// The deadline of a live key that has one.
    pub deadline_ms: Option<u64>,
    /// For a key whose deadline passed: the writes that delete it (its meta item, its orphan
    /// record, its expiry and due items). Such a key reads as missing; a command that writes
    /// it writes these first, in the same batch (`Expiry::before`).
    reclaim: Vec<BatchOp>,
}

impl Expiry {
    /// `key`'s expiry in `view` now: no lookup in a shard with no expiry item.
    pub fn of(view: &View<'_>, key: &[u8]) -> Expiry {
        let Some(deadline) = stored_deadline(view, key) else { return Expiry::default() };
        if deadline > now_ms() {
            return Expiry { deadline_ms: Some(deadline), reclaim: Vec::new() };
        }
        let mut reclaim =
            stored_type(view, key).map_or_else(Vec::new, |ty| type_delete_ops(key, ty));
        reclaim.extend(ttl_ops(key, Some(deadline), None));
        Expiry { deadline_ms: None, reclaim }
    }

    /// Whether the key's deadline passed: it reads as missing.
    pub fn expired(&self) -> bool {
        !self.reclaim.is_empty()
    }

    /// The key's type as commands see it: `stored` unless the key expired.
    pub fn live(&self, stored: Option<KeyType>) -> Option<KeyType> {
        if self.expired() {
            None
        } else {
            stored
        }
    }

    /// `ops`, a write of the key, preceded by the deletes of the expired key it replaces, with
    /// one operation per item (the last one on an item wins).
    pub fn before(&self, ops: Vec<BatchOp>) -> Vec<BatchOp> {
        if !self.expired() {
            return ops;
        }
        let mut all = self.reclaim.clone();
        all.extend(ops);
        last_op_wins(all)
    }
}

/// The writes that move `key`'s expiry from `old` to `new` (either None: no expiry): its
/// expiry item and its due item change together.
pub fn ttl_ops(key: &[u8], old: Option<u64>, new: Option<u64>) -> Vec<BatchOp> {
    if old == new {
        return Vec::new();
    }
    let mut ops = Vec::with_capacity(4);
    if let Some(old) = old {
        ops.push(BatchOp::Delete { key: keyspace::expiry_key(key, old) });
        ops.push(BatchOp::Delete { key: keyspace::due_key(old, key) });
    }
    if let Some(new) = new {
        ops.push(BatchOp::Put { key: keyspace::expiry_key(key, new), value: Vec::new() });
        ops.push(BatchOp::Put { key: keyspace::due_key(new, key), value: Vec::new() });
    }
    ops
}

/// `ops` with only the last operation on each item key, in their order: a batch that deletes
/// an expired key and writes it anew names some items twice.
pub fn last_op_wins(ops: Vec<BatchOp>) -> Vec<BatchOp> {
    let op_key = |op: &BatchOp| match op {
        BatchOp::Put { key, .. } | BatchOp::Delete { key } => key.clone(),
    };
    let mut seen = std::collections::HashSet::new();
    let mut keep = vec![false; ops.len()];
    for (at, op) in ops.iter().enumerate().rev() {
        keep[at] = seen.insert(op_key(op));
    }
    ops.into_iter().zip(keep).filter_map(|(op, keep)| keep.then_some(op)).collect()
}

/// Refuses a write that does not fit one atomic batch (`copse::check_write`, the
/// shard's own check), with an error that says what it means for the command.
pub fn check_batch(ops: &[BatchOp]) -> Result<(), Reply> {
    use copse::InputError;
    match copse::check_write(ops) {
        Ok(()) => Ok(()),
        Err(InputError::BatchTooManyOps { ops, max }) => Err(Reply::Error(format!(
            "ERR this command would change {ops} items in one atomic batch, more than copse's \
             limit of {max}; nothing was changed"
        ))),
        Err(InputError::BatchTooLarge { bytes, max }) => Err(Reply::Error(format!(
            "ERR this command would write {bytes} bytes in one atomic batch, more than copse's \
             limit of {max}; nothing was changed"
        ))),
        Err(other) => Err(Reply::Error(format!("ERR {other}; nothing was changed"))),
    }
}

/// What a collection command knows of its key once its meta item is read: the Redis key, its
/// meta item (None: the key does not exist), and the id its elements are keyed by (for a
/// missing key, a fresh version's, under which no element exists).
pub struct Coll {
    pub key: Vec<u8>,
    pub ty: KeyType,
    pub meta: Option<keyspace::CollectionMeta>,
    pub id: Vec<u8>,
    /// The key's expiry as the exec found it at its start (an expired key has no meta).
    pub expiry: Expiry,
}

impl Coll {
    /// Elements (0 for a missing key).
    pub fn count(&self) -> usize {
        self.meta.map_or(0, |meta| meta.count as usize)
    }

    pub fn exists(&self) -> bool {
        self.meta.is_some()
    }

    /// The writes that leave the collection with `count` elements: its meta item with the new
    /// count (created with this id's version if the key is new, replacing an expired key), or
    /// deleted with its expiry at 0. The caller writes or deletes the elements themselves in
    /// the same batch.
    pub fn meta_ops(&self, count: usize) -> Vec<BatchOp> {
        let key = keyspace::meta_key(&self.key, self.ty);
        if count == 0 {
            if !self.exists() {
                return Vec::new();
            }
            let mut ops = vec![BatchOp::Delete { key }];
            ops.extend(ttl_ops(&self.key, self.expiry.deadline_ms, None));
            return ops;
        }
        if self.count() == count && self.exists() {
            return Vec::new();
        }
        let head = self.meta.and_then(|meta| meta.head);
        self.put_meta(count, head)
    }

    /// The list's head index (its first element's), or where a new list starts.
    pub fn head(&self) -> u64 {
        self.meta.and_then(|meta| meta.head).unwrap_or(keyspace::LIST_HEAD_INITIAL)
    }

    /// `meta_ops` for a list, whose elements are at `head .. head + count`.
    pub fn list_meta_ops(&self, head: u64, count: usize) -> Vec<BatchOp> {
        if count == 0 || (self.exists() && self.count() == count && self.head() == head) {
            return self.meta_ops(count);
        }
        self.put_meta(count, Some(head))
    }

    fn put_meta(&self, count: usize, head: Option<u64>) -> Vec<BatchOp> {
        let meta = keyspace::CollectionMeta {
            version: keyspace::id_version(&self.id),
            count: count as u64,
            deadline_ms: self.meta.and_then(|meta| meta.deadline_ms),
            head,
        };
        let key = keyspace::meta_key(&self.key, self.ty);
        self.expiry.before(vec![BatchOp::Put { key, value: meta.encode() }])
    }
}

/// A random number for the commands that pick at random (SPOP, SRANDMEMBER, ZRANDMEMBER,
/// HRANDFIELD); not for anything secret.
pub fn random_u64() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static STATE: AtomicU64 = AtomicU64::new(0);
    let nonce = STATE.fetch_add(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed);
    xxhash_rust::xxh3::xxh3_64_with_seed(&keyspace::new_version().to_le_bytes(), nonce)
}

/// The error of a reply of at least `bytes` past the client output limit `limit`.
pub fn reply_too_large(bytes: usize, limit: usize) -> Reply {
    Reply::Error(format!(
        "ERR reply of at least {bytes} bytes exceeds the client output limit ({limit} bytes)"
    ))
}

/// The first element of `coll` (a hash or a set: elements keyed by scan hash) at or after scan
/// hash `from` that is not in `taken`, wrapping to the first (None: every one is taken). Taken
/// elements are stepped over, never drawn again, so elements crowded into one stretch of hash
/// space cost a walk, not endless redraws (a review made nine fields share 24 hash bits and
/// stalled a shard).
pub fn hashed_element_at(
    view: &View<'_>,
    coll: &Coll,
    from: u64,
    taken: &std::collections::HashSet<Vec<u8>>,
) -> Option<Vec<u8>> {
    const STEP: usize = 64;
    let tag = coll.ty.element_tag()?;
    for cursor in [from, 0] {
        let (mut start, end) = keyspace::hashed_from(tag, &coll.id, cursor);
        loop {
            let items = view.keys(bound_ref(&start), bound_ref(&end), STEP);
            for item in &items {
                let (_, name) = keyspace::decode_field(item, coll.id.len())?;
                if !taken.contains(name) {
                    return Some(name.to_vec());
                }
            }
            match items.last() {
                Some(last) if items.len() == STEP => start = Bound::Excluded(last.clone()),
                _ => break,
            }
        }
    }
    None
}

/// Whether no element item of any type is keyed by `key` at `version`: a new collection may
/// take it (keyspace.rs, invariant 2).
fn version_is_unused(view: &View<'_>, key: &[u8], version: u64) -> bool {
    let id = keyspace::collection_id(key, version);
    KeyType::COLLECTIONS.into_iter().filter_map(KeyType::element_tag).all(|tag| {
        let (start, end) = keyspace::id_range(tag, &id);
        view.count(bound_ref(&start), bound_ref(&end), 1) == 0
    })
}

/// A fresh version for a new collection of `key`, under which no element exists.
pub fn unused_version(view: &View<'_>, key: &[u8]) -> u64 {
    loop {
        let version = keyspace::new_version();
        if version_is_unused(view, key, version) {
            return version;
        }
    }
}

/// One exec on the shard of collection `key` of type `ty`, as `on_key`, whose program starts
/// once the key's meta item is read: `step` gets `Input::Start` with the `Coll` filled in (a
/// key of another type is answered WRONGTYPE before that), then the program's own inputs.
pub fn on_collection<F>(call: &Call<'_>, ty: KeyType, step: F) -> Outcome
where
    F: FnMut(&View<'_>, Input, &mut Coll) -> Next + Send + 'static,
{
    collection_exec(call, ty, false, step)
}

/// `on_collection` for a command that writes the collection once, as its last step: it may
/// start behind the key's write group and share its flush (`on_key_grouped`), so a run of
/// writes to one hash or sorted set costs one flush, not one each.
pub fn on_collection_grouped<F>(call: &Call<'_>, ty: KeyType, step: F) -> Outcome
where
    F: FnMut(&View<'_>, Input, &mut Coll) -> Next + Send + 'static,
{
    collection_exec(call, ty, true, step)
}

fn collection_exec<F>(call: &Call<'_>, ty: KeyType, grouped: bool, step: F) -> Outcome
where
    F: FnMut(&View<'_>, Input, &mut Coll) -> Next + Send + 'static,
{
    on_collection_key(call.db(), call.args[1].clone(), ty, grouped, step)
}

/// `on_collection` (or `on_collection_grouped`) of collection `key` outside a command's own
/// call (a command that acts on several keys one after the other).
pub fn on_collection_key<F>(
    db: &Db,
    key: Vec<u8>,
    ty: KeyType,
    grouped: bool,
    mut step: F,
) -> Outcome
where
    F: FnMut(&View<'_>, Input, &mut Coll) -> Next + Send + 'static,
{
    let target = KeyTarget::of(db, &key);
    let mut key = Some(key);
    let mut coll: Option<Coll> = None;
    let mut expiry = Expiry::default();
    on_key_grouped(target, grouped, move |view, input| {
        if let Some(coll) = coll.as_mut() {
            return step(view, input, coll);
        }
        let meta = match input {
            Input::Start => {
                let key = key.as_ref().expect("the key is taken once the meta item is known");
                match coll_begin(view, key, ty) {
                    Err(error) => return Next::Reply(error),
                    Ok((found, Some(read))) => {
                        expiry = found;
                        return Next::Read(smallvec::smallvec![read]);
                    }
                    Ok((found, None)) => {
                        expiry = found;
                        None
                    }
                }
            }
            Input::Read(mut results) => match coll_meta(results.pop()) {
                Ok(meta) => meta,
                Err(error) => return Next::Reply(error),
            },
            Input::Written => return unexpected(),
        };
        let key = key.take().expect("the meta item is read once");
        let coll = coll.insert(coll_make(view, key, ty, std::mem::take(&mut expiry), meta));
        step(view, Input::Start, coll)
    })
}

/// The first step of a command on collection `key` of type `ty`: WRONGTYPE for a live key of
/// another type; else the key's expiry, and the read of its meta item if it exists.
pub fn coll_begin(
    view: &View<'_>,
    key: &[u8],
    ty: KeyType,
) -> Result<(Expiry, Option<ReadOp>), Reply> {
    let expiry = Expiry::of(view, key);
    let live = expiry.live(stored_type(view, key));
    view.note_lookup(live.is_some());
    match live {
        Some(found) if found != ty => Err(Reply::error(WRONGTYPE)),
        Some(_) => Ok((expiry, Some(ReadOp::Get(keyspace::meta_key(key, ty))))),
        None => Ok((expiry, None)),
    }
}

/// The meta value `coll_begin`'s read found (it exists: the exec holds the key's lock).
pub fn coll_meta(result: Option<ReadResult>) -> Result<Option<keyspace::CollectionMeta>, Reply> {
    match value_of(result) {
        Some(value) => match keyspace::CollectionMeta::decode(&value) {
            Some(meta) => Ok(Some(meta)),
            None => Err(Reply::error(CORRUPT_META)),
        },
        None => Err(Reply::error("ERR internal error: a collection's meta item vanished")),
    }
}

/// The `Coll` of `key` once its meta item is known (None: a missing key, given a fresh version).
pub fn coll_make(
    view: &View<'_>,
    key: Vec<u8>,
    ty: KeyType,
    expiry: Expiry,
    meta: Option<keyspace::CollectionMeta>,
) -> Coll {
    let version = match meta {
        Some(meta) => meta.version,
        None => unused_version(view, &key),
    };
    let id = keyspace::collection_id(&key, version);
    Coll { key, ty, meta, id, expiry }
}

/// A meta item whose value is not a collection's: never written by this version.
pub const CORRUPT_META: &str = "ERR internal error: a collection's meta item is not readable";

/// A command on a `ty` key answered from its meta item and the index (no element read); `reply`
/// also runs for a missing key, whose id has no elements.
pub fn from_index<F>(call: &Call<'_>, ty: KeyType, mut reply: F) -> Outcome
where
    F: FnMut(&View<'_>, &Coll) -> Reply + Send + 'static,
{
    on_collection(call, ty, move |view, input, coll| match input {
        Input::Start => Next::Reply(reply(view, coll)),
        _ => unexpected(),
    })
}

/// Reads the sub-items `item_key(key, name)` of `names` (fields of a hash, members of a sorted
/// set) of a `ty` key, and answers `reply` of their values in the order of `names`. A missing
/// key or name reads as None with no I/O (the index says so); each name is read once.
pub fn read_items<F>(
    call: &Call<'_>,
    ty: KeyType,
    names: Vec<Vec<u8>>,
    item_key: fn(&[u8], &[u8]) -> Vec<u8>,
    values_in_reply: bool,
    mut reply: F,
) -> Outcome
where
    F: FnMut(Vec<Option<Vec<u8>>>) -> Reply + Send + 'static,
{
    use std::sync::atomic::Ordering;
    let reply_bytes_max = call.server.settings.client_output_bytes_max.load(Ordering::Relaxed);
    let value_bytes_bound = call.server.value_bytes_bound.clone();
    // Distinct names that exist, in the order they are read, with the positions each fills.
    let mut reads: Vec<(Vec<u8>, usize)> = Vec::new();
    let mut found: HashMap<Vec<u8>, Option<Vec<u8>>> = HashMap::new();
    let mut asked = 0..0;
    // Every position costs at least a null reply.
    let mut reply_bytes = names.len() * VALUE_REPLY_OVERHEAD_BYTES;
    on_collection(call, ty, move |view, input, coll| {
        match input {
            Input::Start => {
                let mut positions: HashMap<&[u8], usize> = HashMap::new();
                for name in &names {
                    *positions.entry(&name[..]).or_default() += 1;
                }
                let mut seen = std::collections::HashSet::new();
                for name in &names {
                    if seen.insert(&name[..]) && view.contains(&item_key(&coll.id, name)) {
                        reads.push((name.clone(), positions[&name[..]]));
                    }
                }
            }
            Input::Read(results) => {
                for ((name, repeats), result) in reads[asked.clone()].iter().zip(results) {
                    let value = value_of(Some(result));
                    if values_in_reply {
                        reply_bytes += repeats * value.as_ref().map_or(0, Vec::len);
                    }
                    found.insert(name.clone(), value);
                }
                if reply_bytes > reply_bytes_max {
                    return Next::Reply(Reply::Error(format!(
                        "ERR reply of at least {reply_bytes} bytes exceeds the client output limit ({reply_bytes_max} bytes)"
                    )));
                }
            }
            Input::Written => return unexpected(),
        }
        // The next step: the reads that fit the room left, each counted at the largest value
        // the store may hold times the positions it fills (one read at least), so a reply past
        // the limit is refused having read at most the limit plus one value.
        // A reply that only measures its values (HSTRLEN) is small whatever they hold.
        let value_bytes_max = if values_in_reply {
            value_bytes_bound.load(Ordering::Acquire).min(copse::limits::VALUE_BYTES_MAX)
        } else {
            0
        };
        let room = reply_bytes_max.saturating_sub(reply_bytes);
        let (mut end, mut reserved) = (asked.end, 0usize);
        while end < reads.len() && end - asked.end < copse::limits::EXEC_READS_MAX {
            reserved = reserved.saturating_add(reads[end].1.saturating_mul(value_bytes_max));
            if end > asked.end && reserved > room {
                break;
            }
            end += 1;
        }
        asked = asked.end..end;
        if asked.is_empty() {
            let values = names.iter().map(|name| found.get(name).cloned().flatten()).collect();
            return Next::Reply(reply(values));
        }
        Next::Read(
            reads[asked.clone()]
                .iter()
                .map(|(name, _)| ReadOp::Get(item_key(&coll.id, name)))
                .collect(),
        )
    })
}

/// The writes that delete live Redis key `key` of type `ty` (`type_delete_ops`) and its expiry.
pub fn delete_ops(key: &[u8], ty: KeyType, expiry: &Expiry) -> Vec<BatchOp> {
    let mut ops = type_delete_ops(key, ty);
    ops.extend(ttl_ops(key, expiry.deadline_ms, None));
    ops
}

/// The writes that delete Redis key `key` of type `ty`, not its expiry: its meta item, and for a
/// hash or a sorted set its orphan record, so that the orphan collector deletes the elements of
/// the version that dies here (`cmd/orphans.rs`). Two small items whatever the collection holds;
/// no I/O.
pub fn type_delete_ops(key: &[u8], ty: KeyType) -> Vec<BatchOp> {
    let mut ops = vec![BatchOp::Delete { key: keyspace::meta_key(key, ty) }];
    if ty != KeyType::String {
        ops.push(BatchOp::Put { key: keyspace::orphans_key(key), value: Vec::new() });
    }
    ops
}

/// The writes of several keys of one shard as the one batch that makes them atomic together
/// (a single-shard MSET or DEL of any size the request limits allow: the engine records a batch
/// too large for one record as a chain, docs/format/slab.md), or the error that refuses it whole
/// past the batch limits, which sit above what one request can carry.
pub fn one_batch(per_key: Vec<Vec<BatchOp>>) -> Result<Vec<BatchOp>, Reply> {
    let ops: Vec<BatchOp> = per_key.into_iter().flatten().collect();
    check_batch(&ops)?;
    Ok(ops)
}

pub fn bound_ref(bound: &std::ops::Bound<Vec<u8>>) -> std::ops::Bound<&[u8]> {
    bound.as_ref().map(|key| &key[..])
}

/// The value of a `Read` result holding one `Get`.
pub fn value_of(result: Option<ReadResult>) -> Option<Vec<u8>> {
    match result {
        Some(ReadResult::Value(value)) => value,
        _ => None,
    }
}

/// The answer a program decided before its write, once the write is durable.
pub fn answer(pending: &mut Option<Reply>) -> Next {
    Next::Reply(pending.take().unwrap_or_else(|| Reply::error("ERR internal error: no answer")))
}

/// A step a program never asks for arrived: answer an error rather than stop the shard.
pub fn unexpected() -> Next {
    Next::Reply(Reply::error("ERR internal error: unexpected step"))
}

/// Refuses a string value copse cannot store.
pub fn check_value(value: &[u8]) -> Result<(), Reply> {
    if value.len() > copse::limits::VALUE_BYTES_MAX {
        return Err(Reply::Error(format!(
            "ERR string exceeds maximum allowed size ({} bytes)",
            copse::limits::VALUE_BYTES_MAX
        )));
    }
    Ok(())
}

/// Parses an integer argument as Redis does (no spaces, no "+", no leading zeros but "0").
pub fn parse_i64(bytes: &[u8]) -> Option<i64> {
    let text = std::str::from_utf8(bytes).ok()?;
    if text.is_empty() || text.len() > 20 || text.starts_with('+') {
        return None;
    }
    let digits = text.strip_prefix('-').unwrap_or(text);
    if digits.is_empty()
        || (digits.len() > 1 && digits.starts_with('0'))
        || digits == "0" && text.starts_with('-')
    {
        return None;
    }
    text.parse().ok()
}

/// The arguments of LMPOP and ZMPOP (and their blocking forms) from `at` (numkeys): the keys,
/// the position of the word after them (LEFT/RIGHT, MIN/MAX), and COUNT (1 if not given).
pub fn parse_multi_pop(call: &Call<'_>, at: usize) -> Result<(Vec<Vec<u8>>, usize, usize), Reply> {
    let numkeys = match parse_i64(&call.args[at]) {
        Some(n) if n > 0 => n as usize,
        _ => return Err(Reply::error("ERR numkeys should be greater than 0")),
    };
    let first = at + 1;
    if first + numkeys >= call.args.len() {
        return Err(Reply::error(SYNTAX));
    }
    let keys: Vec<Vec<u8>> = call.args[first..first + numkeys].to_vec();
    let mut count = None;
    let mut rest = first + numkeys + 1;
    while rest < call.args.len() {
        match (call.word(rest).as_str(), call.args.get(rest + 1), count) {
            ("count", Some(value), None) => match parse_i64(value) {
                Some(n) if n > 0 => count = Some(n as usize),
                _ => return Err(Reply::error("ERR count should be greater than 0")),
            },
            _ => return Err(Reply::error(SYNTAX)),
        }
        rest += 2;
    }
    Ok((keys, first + numkeys, count.unwrap_or(1)))
}

/// Redis's errors for a bad numkeys, which SINTERCARD and ZINTERCARD word differently.
pub struct NumkeysErrors {
    pub not_positive: &'static str,
    pub not_integer: &'static str,
    /// numkeys passes the arguments.
    pub too_few: &'static str,
}

/// The arguments of SINTERCARD and ZINTERCARD: `numkeys key... [LIMIT n]` (0: no limit).
pub fn parse_intercard(
    call: &Call<'_>,
    errors: &NumkeysErrors,
) -> Result<(Vec<Vec<u8>>, usize), Reply> {
    let numkeys = match parse_i64(&call.args[1]) {
        Some(n) if n > 0 => n as usize,
        Some(_) => return Err(Reply::error(errors.not_positive)),
        None => return Err(Reply::error(errors.not_integer)),
    };
    let too_few = errors.too_few;
    if numkeys > call.args.len() - 2 {
        return Err(Reply::error(too_few));
    }
    let keys = call.args[2..2 + numkeys].to_vec();
    let mut limit = 0usize;
    let mut at = 2 + numkeys;
    while at < call.args.len() {
        match (call.word(at).as_str(), call.args.get(at + 1)) {
            ("limit", Some(value)) => match parse_i64(value) {
                Some(n) if n >= 0 => limit = n as usize,
                _ => return Err(Reply::error("ERR LIMIT can't be negative")),
            },
            _ => return Err(Reply::error(SYNTAX)),
        }
        at += 2;
    }
    Ok((keys, limit))
}

/// The count and flag of ZRANDMEMBER and HRANDFIELD: `key [count [flag]]` (flag: WITHSCORES or
/// WITHVALUES), with Redis's errors.
pub fn parse_random_count(call: &Call<'_>, flag: &str) -> Result<(Option<i64>, bool), Reply> {
    match call.args.len() {
        2 => Ok((None, false)),
        3 | 4 => {
            let count = match parse_i64(&call.args[2]) {
                Some(i64::MIN) => {
                    return Err(Reply::Error(format!(
                        "ERR value is out of range, value must between {} and {}",
                        -i64::MAX,
                        i64::MAX
                    )))
                }
                Some(count) => count,
                None => return Err(Reply::error(NOT_INTEGER)),
            };
            if call.args.len() == 4 && call.word(3) != flag {
                return Err(Reply::error(SYNTAX));
            }
            // Redis refuses a count whose reply (two entries each) could not be counted.
            if call.args.len() == 4 && count.unsigned_abs() > i64::MAX as u64 / 2 {
                return Err(Reply::error("ERR value is out of range"));
            }
            Ok((Some(count), call.args.len() == 4))
        }
        _ => Err(Reply::error(SYNTAX)),
    }
}

/// Parses a float argument as Redis does: finite or +/-inf, never NaN, no spaces.
pub fn parse_f64(bytes: &[u8]) -> Option<f64> {
    let text = std::str::from_utf8(bytes).ok()?;
    if text.is_empty() || text.trim() != text {
        return None;
    }
    let value = match text.to_ascii_lowercase().as_str() {
        "inf" | "+inf" | "infinity" | "+infinity" => return Some(f64::INFINITY),
        "-inf" | "-infinity" => return Some(f64::NEG_INFINITY),
        _ => text.parse::<f64>().ok()?,
    };
    // Out of range is refused as Redis's strtold refuses it (ERANGE), not rounded to an
    // infinity or to zero.
    let mantissa = text.split(['e', 'E']).next().unwrap_or("");
    let underflow = value == 0.0 && mantissa.bytes().any(|b| (b'1'..=b'9').contains(&b));
    (value.is_finite() && !underflow).then_some(value)
}

pub fn lowercase(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).to_ascii_lowercase()
}

/// How a command may be called (for arity checks and COMMAND INFO).
pub struct Spec {
    pub name: &'static str,
    /// Redis's convention: N means exactly N arguments counting the name; -N means at least N.
    pub arity: i32,
    pub flags: &'static [&'static str],
    pub first_key: i32,
    pub last_key: i32,
    pub key_step: i32,
    pub group: &'static str,
    pub summary: &'static str,
    pub handler: Handler,
    /// Where its keys are: the positions above, or counted by a numkeys argument (`names.rs`).
    pub keys: names::KeySpec,
}

pub type Handler = fn(&mut Call<'_>) -> Outcome;

impl Spec {
    /// A command of `group`; `keys` is Redis's (first key, last key, step) of its arguments.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        group: &'static str,
        name: &'static str,
        arity: i32,
        flags: &'static [&'static str],
        (first_key, last_key, key_step): (i32, i32, i32),
        summary: &'static str,
        handler: Handler,
    ) -> Spec {
        let keys = names::KeySpec::Positions;
        Spec { name, arity, flags, first_key, last_key, key_step, group, summary, handler, keys }
    }
}

/// A command being handled.
pub struct Call<'a> {
    pub server: &'a Arc<Server>,
    pub conn: &'a mut ConnState,
    pub args: Args,
}

impl Call<'_> {
    pub fn db(&self) -> &Db {
        &self.server.db
    }

    /// Argument `at` as lowercase text (options, subcommands).
    pub fn word(&self, at: usize) -> String {
        self.args.get(at).map(|arg| lowercase(arg)).unwrap_or_default()
    }
}

/// Every command the server knows, sorted by name.
pub fn table() -> &'static [Spec] {
    static TABLE: std::sync::OnceLock<Vec<Spec>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        let mut specs = Vec::new();
        specs.extend(strings::specs());
        specs.extend(keys::specs());
        specs.extend(objects::specs());
        specs.extend(inspect::specs());
        specs.extend(dump::specs());
        specs.extend(expiry::specs());
        specs.extend(hashes::specs());
        specs.extend(zsets::specs());
        specs.extend(lists::specs());
        specs.extend(sets::specs());
        specs.extend(zset_ops::specs());
        specs.extend(server::specs());
        specs.extend(multi::specs());
        specs.extend(scripts::specs());
        specs.extend(pubsub::specs());
        specs.sort_by_key(|spec| spec.name);
        for spec in &mut specs {
            spec.keys = names::key_spec_of(spec.name);
        }
        specs
    })
}

pub fn find(name: &str) -> Option<&'static Spec> {
    find_ignoring_case(name.as_bytes())
}

/// The command named `name` in any case (command names are ASCII), lowercased on the stack,
/// not into a new string, and found by its hash: this runs once per request (a binary search
/// of the names cost ~300 instructions a request, most in its string compares).
pub fn find_ignoring_case(name: &[u8]) -> Option<&'static Spec> {
    let mut lowered = [0u8; COMMAND_NAME_BYTES_MAX];
    // Longer than every command's name: no command.
    let lowered = lowered.get_mut(..name.len())?;
    for (to, from) in lowered.iter_mut().zip(name) {
        *to = from.to_ascii_lowercase();
    }
    // The table's names by their hashes, sorted: integer compares instead of string ones.
    static BY_HASH: std::sync::OnceLock<Vec<(u64, usize)>> = std::sync::OnceLock::new();
    let table = table();
    let by_hash = BY_HASH.get_or_init(|| {
        let mut by_hash: Vec<(u64, usize)> = (table.iter().enumerate())
            .map(|(at, spec)| (xxhash_rust::xxh3::xxh3_64(spec.name.as_bytes()), at))
            .collect();
        by_hash.sort_unstable();
        assert!(
            by_hash.windows(2).all(|pair| pair[0].0 != pair[1].0),
            "two command names hash alike"
        );
        by_hash
    });
    let hash = xxhash_rust::xxh3::xxh3_64(lowered);
    let at = by_hash.binary_search_by_key(&hash, |&(hash, _)| hash).ok()?;
    let spec = &table[by_hash[at].1];
    // Another name with the same hash is not this command.
    (spec.name.as_bytes() == &*lowered).then_some(spec)
}

/// Writes that look their sources up as reads, so Redis counts those lookups in `keyspace_hits`
/// and `keyspace_misses` (their destinations' lookups are not counted: copse's helpers that
/// decide a destination do not note lookups).
const LOOKUP_COUNTING_WRITES: &[&str] = &[
    "copy",
    "getdel",
    "getex",
    "getset",
    "sdiffstore",
    // SET ... GET: only its GET's lookup is noted.
    "set",
    "sinterstore",
    "sunionstore",
    "zdiffstore",
    "zinterstore",
    "zrangestore",
    "zunionstore",
];

/// Commands that look at a key without counting as a use of it (Redis's LOOKUP_NOTOUCH).
const NO_TOUCH: &[&str] =
    &["exists", "expiretime", "memory", "object", "pexpiretime", "pttl", "ttl", "type"];

/// Bytes in the longest command name of the table (checked by a test).
const COMMAND_NAME_BYTES_MAX: usize = 32;

/// Commands a client may run before AUTH when a password is set.
const ALLOWED_BEFORE_AUTH: &[&str] = &["auth", "hello", "quit", "reset"];

/// A handled command, and how large its reply can be before it runs (what its connection
/// reserves until the reply is written).
pub struct Dispatched {
    pub outcome: Outcome,
    pub reply_size: ReplySize,
    /// A blocking command (BLPOP and the like): it may wait for a long time, so the connection
    /// sends the replies before it first and watches for its client going away meanwhile.
    pub blocking: bool,
    /// SWAPDB: while it waits (for the swap, and for the other connections' waves), its
    /// connection runs nothing under any map, so it must not count as busy under the old one:
    /// two connections each waiting in a SWAPDB for the other's wave deadlocked (found by the
    /// long keys' review: pipelined SETs and SWAPDBs from three connections hung the server).
    pub holds_no_map: bool,
}

/// Handles one command: checks it is known, its arity and authentication, then runs it.
pub fn dispatch(server: &Arc<Server>, conn: &mut ConnState, args: Args) -> Dispatched {
    let refused = |outcome| Dispatched {
        outcome,
        reply_size: ReplySize::Small,
        blocking: false,
        holds_no_map: false,
    };
    // A queued SELECT of an EXEC that ran takes effect now (`multi.rs`).
    if conn.after_exec.load(std::sync::atomic::Ordering::Acquire) != 0 {
        let db = conn.after_exec.swap(0, std::sync::atomic::Ordering::AcqRel);
        conn.select((db - 1) as u8);
    }
    // After MULTI, commands are queued (`multi.rs`).
    let args = match multi::queue(server, conn, args) {
        Ok(outcome) => return refused(outcome),
        Err(args) => args,
    };
    let Some(spec) = find_ignoring_case(&args[0]) else {
        return refused(Outcome::error(unknown_command(&args)));
    };
    let name = spec.name;
    let count = args.len() as i32;
    if (spec.arity > 0 && count != spec.arity) || (spec.arity < 0 && count < -spec.arity) {
        return refused(Outcome::error(format!(
            "ERR wrong number of arguments for '{name}' command"
        )));
    }
    if !conn.authenticated && !ALLOWED_BEFORE_AUTH.contains(&spec.name) {
        return refused(Outcome::error("NOAUTH Authentication required."));
    }
    if let Some(error) = pubsub::refused_while_subscribed(spec.name, conn) {
        return refused(Outcome::error(error));
    }
    // The command's execs, built now or by its future later, are in its database's namespace.
    let namespace = namespace::resolve(&server.databases, conn.db);
    let namespace =
        match spec.flags.contains(&"readonly") || LOOKUP_COUNTING_WRITES.contains(&spec.name) {
            true => namespace.counting_lookups(),
            false => namespace,
        };
    // Every key a command names must be at most `REDIS_KEY_BYTES_MAX` bytes, and becomes its
    // stored name (`names.rs`): checked and converted once here for all commands, and noted as
    // used (OBJECT IDLETIME) unless the command only looks (`NO_TOUCH`).
    let mut args = args;
    let touch = !NO_TOUCH.contains(&spec.name) && !conn.no_touch;
    let now_s = server.access_clock_s();
    let names = match names::convert_keys(spec, &mut args, |name| {
        if touch {
            server.access.touch(name, now_s);
        }
    }) {
        Ok(names) => names,
        Err(reply) => return refused(Outcome::Reply(reply)),
    };
    server.stats.commands.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    *conn.info.last_command.lock().unwrap_or_else(|poison| poison.into_inner()) = spec.name;
    if spec.flags.contains(&"write") {
        raise_value_bytes_bound(&server.value_bytes_bound, spec, &args);
    }
    let reply_size = reply_size(spec, &args);
    let database = conn.db;
    let outcome = names::scope(names.clone(), || {
        namespace.scope(|| (spec.handler)(&mut Call { server, conn, args }))
    });
    let blocking = spec.flags.contains(&"blocking");
    let outcome = match outcome {
        // A blocked client may wait for ever: it must not hold the database map (SWAPDB waits
        // for every holder), and after a swap it waits in its database's new namespace.
        Outcome::AfterPending(future) if blocking => Outcome::AfterPending(Box::pin(
            namespace::InDatabase::new(server.clone(), database, false, future),
        )),
        Outcome::AfterPending(future) => Outcome::AfterPending(Box::pin(namespace.bind(future))),
        other => other,
    };
    // The execs such a future builds later carry the command's long keys too; a pop's reply
    // shows the key it popped from as the client wrote it.
    let outcome = match names {
        None => outcome,
        Some(names) => {
            let outcome = match outcome {
                Outcome::AfterPending(future) => {
                    Outcome::AfterPending(Box::pin(names::bind(names.clone(), future)))
                }
                other => other,
            };
            if names::REPLIES_NAMING_A_KEY.contains(&spec.name) {
                outcome.map_reply(move |reply| names::key_back_in_reply(reply, &names))
            } else {
                outcome
            }
        }
    };
    let outcome = server::held_by_pause(server, spec, outcome);
    let holds_no_map = spec.name == "swapdb";
    Dispatched { outcome, reply_size, blocking, holds_no_map }
}

/// Builds the outcome of `args` (command `spec`, checked) without running it: nothing is
/// queued, touched or counted, and the outcome is dropped by the caller. Only for commands
/// whose handlers build execs and change nothing themselves (`write` or `readonly`): MULTI's
/// check of what it queues (`multi.rs`).
pub(crate) fn dry_run(
    server: &Arc<Server>,
    conn: &mut ConnState,
    spec: &'static Spec,
    mut args: Args,
) -> Result<Outcome, Reply> {
    let namespace = namespace::resolve(&server.databases, conn.db);
    let names = names::convert_keys(spec, &mut args, |_| {})?;
    let in_exec = std::mem::replace(&mut conn.in_exec, true);
    let outcome = names::scope(names, || {
        namespace.scope(|| (spec.handler)(&mut Call { server, conn, args }))
    });
    conn.in_exec = in_exec;
    Ok(outcome)
}

/// How large a command's reply can be, before it runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplySize {
    /// A number, a status, a key, a score: no stored value.
    Small,
    /// One stored value (GET, HGET, SET ... GET, ...).
    OneValue,
    /// At most this many stored values (MGET, HMGET: one per key or field named), each counted
    /// at the largest value the store holds, and at most the output limit (which they enforce
    /// as they read). So pipelined MGETs of small values run side by side.
    Values(usize),
    /// Many stored values (HGETALL, ZRANGE, ...): at most the output limit, which HGETALL
    /// enforces as it reads and any other closes the client past.
    Many,
}

impl ReplySize {
    /// The bytes a connection reserves for the reply: `value_bytes_bound` is the largest value
    /// the store can hold now (`Server::value_bytes_bound`).
    pub fn reserved_bytes(self, value_bytes_bound: usize, output_limit: usize) -> usize {
        use crate::config::REPLY_SMALL_BYTES_MAX;
        let one_value = value_bytes_bound.min(copse::limits::VALUE_BYTES_MAX);
        match self {
            ReplySize::Small => REPLY_SMALL_BYTES_MAX,
            ReplySize::OneValue => one_value + REPLY_SMALL_BYTES_MAX,
            ReplySize::Values(count) => count
                .saturating_mul(one_value + VALUE_REPLY_OVERHEAD_BYTES)
                .min(output_limit)
                .max(one_value + REPLY_SMALL_BYTES_MAX),
            ReplySize::Many => output_limit.max(one_value + REPLY_SMALL_BYTES_MAX),
        }
    }
}

/// Commands whose reply holds one stored value per argument from the given position on.
const NAMED_VALUES_REPLIES: &[(&str, usize)] = &[("mget", 1), ("hmget", 2)];
/// What a reply spends on one value (or null) besides the value's bytes, a bulk's header:
/// counted in reservations and against the output limit.
const VALUE_REPLY_OVERHEAD_BYTES: usize = 16;
/// Commands whose reply holds one stored value (a string or a hash field).
const ONE_VALUE_REPLIES: &[&str] = &[
    "blmove",
    "eval",
    "eval_ro",
    "evalsha",
    "evalsha_ro",
    "blpop",
    "brpop",
    "brpoplpush",
    "get",
    "getdel",
    "getex",
    "getrange",
    "getset",
    "hget",
    "lindex",
    "lmove",
    "rpoplpush",
];
/// Writes whose reply holds many stored values (pops with a count).
const MANY_VALUES_WRITES: &[&str] = &[
    "blmpop", "bzmpop", "bzpopmax", "bzpopmin", "lmpop", "lpop", "rpop", "spop", "zmpop",
    "zpopmax", "zpopmin",
];
/// Read commands whose reply is a number, a type or a status, never a stored value.
const SMALL_READ_REPLIES: &[&str] = &[
    "dbsize",
    "exists",
    "expiretime",
    "hexists",
    "hlen",
    "hstrlen",
    "llen",
    "pexpiretime",
    "pttl",
    "scard",
    "sintercard",
    "sismember",
    "strlen",
    "ttl",
    "type",
    "zcard",
    "zcount",
    "zintercard",
    "zlexcount",
    "zrank",
    "zrevrank",
    "zscore",
];

/// The size class of the reply of `spec` called with `args`. A write answers a number or a
/// status (SET ... GET excepted); connection and server commands answer at once (their reply
/// is built, not reserved) or after every earlier reply.
pub fn reply_size(spec: &Spec, args: &[Vec<u8>]) -> ReplySize {
    let set_with_get = spec.name == "set" && args[3..].iter().any(|arg| lowercase(arg) == "get");
    if let Some(&(_, first_named)) =
        NAMED_VALUES_REPLIES.iter().find(|(name, _)| *name == spec.name)
    {
        ReplySize::Values(args.len().saturating_sub(first_named))
    } else if ONE_VALUE_REPLIES.contains(&spec.name) || set_with_get {
        ReplySize::OneValue
    } else if MANY_VALUES_WRITES.contains(&spec.name)
        || (spec.flags.contains(&"readonly") && !SMALL_READ_REPLIES.contains(&spec.name))
    {
        ReplySize::Many
    } else {
        ReplySize::Small
    }
}

/// Raises `bound` (the largest value the store may hold) to cover what write `spec` may store,
/// before its execs are queued, so that every read queued after it reserves enough for the
/// value it could read. Values come from the arguments, except APPEND's and SETRANGE's, whose
/// result is at most the old value (within the bound) plus, or up to, the argument.
pub fn raise_value_bytes_bound(
    bound: &std::sync::atomic::AtomicUsize,
    spec: &Spec,
    args: &[Vec<u8>],
) {
    use std::sync::atomic::Ordering;
    let largest_argument = args[1..].iter().map(Vec::len).max().unwrap_or(0);
    let written = match spec.name {
        "append" => bound.load(Ordering::Acquire).saturating_add(largest_argument),
        "setrange" => {
            let offset = args.get(2).and_then(|arg| parse_i64(arg)).unwrap_or(0).max(0) as usize;
            offset.saturating_add(args.get(3).map_or(0, Vec::len))
        }
        _ => largest_argument,
    };
    bound.fetch_max(written.min(copse::limits::VALUE_BYTES_MAX), Ordering::AcqRel);
}

pub(crate) fn unknown_command(args: &[Vec<u8>]) -> String {
    let mut text = format!(
        "ERR unknown command '{}', with args beginning with: ",
        String::from_utf8_lossy(&args[0])
    );
    for arg in args.iter().skip(1).take(16) {
        text.push_str(&format!("'{}' ", String::from_utf8_lossy(arg)));
    }
    text
}

/// Queues the execs of `outcome` and waits for its answer (for commands that run other
/// commands' plans, and for tests).
/// Up to `limit` item keys of `shard` in `[start, end)`, after `after` when given: one step of a
/// walk over a shard's index (no I/O, no key locks) that resumes where the last one stopped.
pub async fn shard_keys(
    db: &Db,
    shard: u32,
    (start, end): (&[u8], &[u8]),
    after: Option<Vec<u8>>,
    limit: usize,
) -> Result<Vec<Vec<u8>>, Reply> {
    let (first, end) = (start.to_vec(), end.to_vec());
    let mut plan = Plan::new();
    plan.add(shard, vec![], move |view, input| match input {
        Input::Start => {
            let start = match &after {
                Some(after) => Bound::Excluded(&after[..]),
                None => Bound::Included(&first[..]),
            };
            let items = view.keys(start, Bound::Excluded(&end), limit);
            Next::Reply(Reply::Array(items.into_iter().map(Reply::Bulk).collect()))
        }
        _ => unexpected(),
    });
    match run_outcome(db, plan.finish(Box::new(Reply::Array))).await {
        Reply::Array(mut pages) => match pages.pop() {
            Some(Reply::Array(items)) => Ok(items
                .into_iter()
                .filter_map(|item| match item {
                    Reply::Bulk(item) => Some(item),
                    _ => None,
                })
                .collect()),
            Some(other) => Err(other),
            None => Ok(Vec::new()),
        },
        other => Err(other),
    }
}

pub async fn run_outcome(db: &Db, outcome: Outcome) -> Reply {
    match outcome {
        Outcome::Reply(reply) | Outcome::Close(reply) => reply,
        Outcome::AfterPending(future) => future.await,
        Outcome::Execs(Execs::One { queued, answer }) => {
            db.exec_many_async(queued.shard, vec![queued.request]).await;
            answered(answer).await
        }
        Outcome::Execs(Execs::Many { queued, answers, combine }) => {
            for queued in queued {
                db.exec_many_async(queued.shard, vec![queued.request]).await;
            }
            collect(answers, combine).await
        }
    }
}

/// Waits for the answers of a command's execs and combines them.
pub async fn collect(
    answers: Vec<futures::channel::oneshot::Receiver<Reply>>,
    combine: Combine,
) -> Reply {
    let mut replies = Vec::with_capacity(answers.len());
    for answer in answers {
        replies.push(answered(answer).await);
    }
    combine(replies)
}

/// Waits for one exec's answer.
pub async fn answered(answer: futures::channel::oneshot::Receiver<Reply>) -> Reply {
    answer.await.unwrap_or_else(|_| Reply::error("ERR the store is closed"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_command_is_found_in_any_case_and_nothing_longer_is() {
        for spec in table() {
            assert!(spec.name.len() <= COMMAND_NAME_BYTES_MAX, "{} is too long", spec.name);
            let upper = spec.name.to_ascii_uppercase();
            assert_eq!(
                find_ignoring_case(upper.as_bytes()).map(|found| found.name),
                Some(spec.name)
            );
            assert_eq!(
                find_ignoring_case(spec.name.as_bytes()).map(|found| found.name),
                Some(spec.name)
            );
        }
        assert!(find_ignoring_case(b"").is_none());
        assert!(find_ignoring_case(b"GETX").is_none());
        assert!(find_ignoring_case(&[b'g'; COMMAND_NAME_BYTES_MAX + 1]).is_none());
        assert!(find_ignoring_case(b"G\xc9T").is_none());
    }

    #[test]
    fn integers_parse_as_redis_parses_them() {
        assert_eq!(parse_i64(b"0"), Some(0));
        assert_eq!(parse_i64(b"-12"), Some(-12));
        assert_eq!(parse_i64(b"9223372036854775807"), Some(i64::MAX));
        for bad in
            [&b""[..], b"+1", b"01", b"-0", b" 1", b"1 ", b"1.0", b"9223372036854775808", b"abc"]
        {
            assert_eq!(parse_i64(bad), None, "{:?}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn floats_parse_as_redis_parses_them() {
        assert_eq!(parse_f64(b"1.5"), Some(1.5));
        assert_eq!(parse_f64(b"-inf"), Some(f64::NEG_INFINITY));
        assert_eq!(parse_f64(b"+inf"), Some(f64::INFINITY));
        assert_eq!(parse_f64(b"1e3"), Some(1000.0));
        for bad in [&b""[..], b"nan", b" 1", b"abc", b"1.5x", b"1e400", b"1e-400"] {
            assert_eq!(parse_f64(bad), None);
        }
    }

    /// A write over an expired key names some items twice (deleted, then written): the batch
    /// keeps only the last operation on each, in order.
    #[test]
    fn the_last_operation_on_an_item_wins() {
        let put = |key: &str, value: &str| BatchOp::Put {
            key: key.as_bytes().to_vec(),
            value: value.as_bytes().to_vec(),
        };
        let delete = |key: &str| BatchOp::Delete { key: key.as_bytes().to_vec() };
        let ops = vec![delete("m"), put("o", ""), delete("e"), put("m", "new"), put("e", "x")];
        assert_eq!(last_op_wins(ops), vec![put("o", ""), put("m", "new"), put("e", "x")]);
        let ops = vec![put("a", "1"), delete("a")];
        assert_eq!(last_op_wins(ops), vec![delete("a")]);
        // Moving a deadline: four distinct items, all kept.
        let moved = ttl_ops(b"k", Some(1), Some(2));
        assert_eq!(last_op_wins(moved.clone()), moved);
        assert_eq!(moved.len(), 4);
        assert!(ttl_ops(b"k", Some(7), Some(7)).is_empty());
    }

    #[test]
    fn batches_over_the_engine_limits_are_refused_up_front() {
        use copse::limits::{VALUE_BYTES_MAX, WRITE_BATCH_BYTES_MAX, WRITE_BATCH_OPS_MAX};
        // Zeroed values: refused batches are judged on their lengths, so the pages of a batch
        // over 1 GiB are never touched.
        let put = |value: usize| BatchOp::Put { key: b"k".to_vec(), value: vec![0; value] };
        assert!(check_batch(&[put(10), put(10)]).is_ok());
        assert!(check_batch(&[put(VALUE_BYTES_MAX)]).is_ok());
        assert!(check_batch(&[put(VALUE_BYTES_MAX + 1)]).is_err());
        let too_many: Vec<BatchOp> =
            (0..=WRITE_BATCH_OPS_MAX).map(|_| BatchOp::Delete { key: b"k".to_vec() }).collect();
        assert!(check_batch(&too_many).is_err());
        drop(too_many);
        let over: Vec<BatchOp> =
            (0..=WRITE_BATCH_BYTES_MAX / VALUE_BYTES_MAX).map(|_| put(VALUE_BYTES_MAX)).collect();
        assert!(
            matches!(check_batch(&over), Err(Reply::Error(text)) if text.contains("nothing was changed"))
        );
        // What passes here passes the engine's own check: a batch far past one record's size.
        let ops = [put(VALUE_BYTES_MAX), put(VALUE_BYTES_MAX), put(VALUE_BYTES_MAX / 3)];
        assert!(check_batch(&ops).is_ok());
        assert!(copse::check_batch(&ops).is_ok());
    }

    #[test]
    fn replies_are_reserved_by_what_they_can_hold() {
        let args = |words: &[&str]| words.iter().map(|w| w.as_bytes().to_vec()).collect::<Vec<_>>();
        let size = |words: &[&str]| reply_size(find(words[0]).unwrap(), &args(words));
        assert_eq!(size(&["get", "k"]), ReplySize::OneValue);
        assert_eq!(size(&["hget", "h", "f"]), ReplySize::OneValue);
        assert_eq!(size(&["set", "k", "v", "GET"]), ReplySize::OneValue);
        assert_eq!(size(&["set", "k", "v"]), ReplySize::Small);
        assert_eq!(size(&["getex", "k", "EX", "10"]), ReplySize::OneValue);
        assert_eq!(size(&["lpop", "l", "100"]), ReplySize::Many);
        assert_eq!(size(&["blpop", "l", "0"]), ReplySize::OneValue);
        assert_eq!(size(&["llen", "l"]), ReplySize::Small);
        assert_eq!(size(&["incr", "k"]), ReplySize::Small);
        assert_eq!(size(&["strlen", "k"]), ReplySize::Small);
        for many in [&["hgetall", "h"][..], &["zrange", "z", "0", "-1"]] {
            assert_eq!(size(many), ReplySize::Many, "{many:?}");
        }
        // One value per key or field named: pipelined MGETs of small values fit the budget
        // side by side instead of each waiting for every reply before it.
        assert_eq!(size(&["mget", "a", "b"]), ReplySize::Values(2));
        assert_eq!(size(&["hmget", "h", "f", "g", "f"]), ReplySize::Values(3));
        assert_eq!(size(&["hstrlen", "h", "f"]), ReplySize::Small);
        let max = copse::limits::VALUE_BYTES_MAX;
        let small = crate::config::REPLY_SMALL_BYTES_MAX;
        assert_eq!(ReplySize::OneValue.reserved_bytes(100, 1 << 28), 100 + small);
        assert_eq!(ReplySize::OneValue.reserved_bytes(usize::MAX, 1 << 28), max + small);
        assert_eq!(ReplySize::Many.reserved_bytes(100, 1 << 28), 1 << 28);
        assert_eq!(ReplySize::Values(100).reserved_bytes(100, 1 << 28), 100 * (100 + 16));
        assert_eq!(
            ReplySize::Values(2).reserved_bytes(100, 1 << 28),
            100 + small,
            "one value at least"
        );
        assert_eq!(ReplySize::Values(1_000_000).reserved_bytes(max, 1 << 28), 1 << 28);
    }

    /// A read queued after a write reserves for the value that write may store, including the
    /// values APPEND and SETRANGE make larger than any of their arguments.
    #[test]
    fn writes_raise_the_value_bound_before_they_are_queued() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let args = |words: &[&str]| words.iter().map(|w| w.as_bytes().to_vec()).collect::<Vec<_>>();
        let bound = AtomicUsize::new(10);
        let raise = |words: &[&str]| {
            raise_value_bytes_bound(&bound, find(words[0]).unwrap(), &args(words));
            bound.load(Ordering::Acquire)
        };
        assert_eq!(raise(&["set", "k", "abcd"]), 10, "never lowered");
        assert_eq!(raise(&["set", "k", &"v".repeat(100)]), 100);
        assert_eq!(raise(&["append", "k", &"v".repeat(50)]), 150);
        assert_eq!(raise(&["setrange", "k", "1000", "xy"]), 1002);
        assert_eq!(raise(&["hset", "h", "f", &"v".repeat(2000)]), 2000);
        assert_eq!(raise(&["setrange", "k", "99999999999", "x"]), copse::limits::VALUE_BYTES_MAX);
    }

    #[test]
    fn the_command_table_is_sorted_and_every_key_position_is_consistent() {
        let table = table();
        assert!(table.windows(2).all(|pair| pair[0].name < pair[1].name));
        for spec in table {
            assert!(spec.arity != 0, "{}", spec.name);
            assert!(
                spec.first_key >= 0 && (spec.first_key == 0) == (spec.key_step == 0),
                "{}",
                spec.name
            );
            assert!(find(spec.name).is_some());
        }
    }
}
