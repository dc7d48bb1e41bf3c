//! A Redis key's items as one value (`Snapshot`), read whole inside an exec and written whole
//! under another key, in another database or on another shard: RENAME, RENAMENX, COPY and MOVE.
//! DUMP and RESTORE (`dump.rs`) translate a snapshot to and from Redis's payload.
//!
//! A snapshot keeps a collection's element items as they are stored, keyed by what follows the
//! collection's id (a list element's index, a hash field's scan hash and name, ...), so copying
//! a collection of any type is one loop: the items go under the destination's id, a fresh
//! version (`unused_version`), and the destination's old version goes to the orphan collector.
//!
//! Atomicity: within one shard (MOVE always: a key has one shard in every database) a command
//! is one exec holding both keys' locks and writing one batch. Across shards it reads the source
//! first, then writes one cross-shard batch whose source part reads the source again and
//! refuses if it changed (its fingerprint), so no write to the source between the read and the
//! batch is lost; a refused batch is tried again, `COPY_ATTEMPTS_MAX` times at most.
//!
//! Invariants:
//! - A snapshot of a collection holds exactly its live elements (`count` of them; a list's from
//!   `head` on) and its meta value; it is written under a version no element item uses.
//! - A copy is one atomic batch: a key with more than `COPY_ITEMS_MAX` items or
//!   `COPY_BYTES_MAX` bytes is refused before anything is written.

use std::sync::{Arc, Mutex};

use copse::exec::{ReadOp, ReadOps, ReadResults};
use copse::limits::EXEC_READS_MAX;
use copse::BatchOp;

use super::namespace::{Namespace, DATABASES};
use super::{
    bound_ref, check_batch, delete_ops, last_op_wins, parse_i64, run_outcome, stored_type, ttl_ops,
    unexpected, unused_version, value_of, AtomicPlan, Call, Expiry, Input, Next, Outcome, Plan,
    Spec, View, CORRUPT_META, NOT_INTEGER, SYNTAX,
};
use crate::keyspace::{self, CollectionMeta, KeyType};
use crate::resp::Reply;

/// How many times a cross-shard RENAME or COPY reads its source again when it changed before
/// the batch.
pub const COPY_ATTEMPTS_MAX: usize = 100;
/// Element items, and bytes of them, that one copy (RENAME, COPY, MOVE) takes at most: a copy
/// holds the key's items in memory, once read and once in its batch, so it is bounded by what one
/// request may carry (the default query buffer limit, 256 MiB), not by the batch limits, which
/// sit far above (`WRITE_BATCH_OPS_MAX`: room for the copy's meta, expiry and orphan items).
pub const COPY_ITEMS_MAX: usize = 2 * 1024 * 1024;
pub const COPY_BYTES_MAX: usize = 256 * 1024 * 1024;
const _: () = assert!(COPY_ITEMS_MAX + 64 < copse::limits::WRITE_BATCH_OPS_MAX);

pub const NO_SUCH_KEY: &str = "ERR no such key";
pub const SAME_OBJECT: &str = "ERR source and destination objects are the same";
const DB_OUT_OF_RANGE: &str = "ERR DB index is out of range";

pub fn specs() -> Vec<Spec> {
    let spec = |name, arity, first, last, summary, handler| {
        Spec::new("generic", name, arity, &["write"], (first, last, 1), summary, handler)
    };
    vec![
        spec("rename", 3, 1, 2, "Renames a key, replacing the destination.", rename as _),
        spec("renamenx", 3, 1, 2, "Renames a key if the new name is free.", renamenx as _),
        spec("copy", -3, 1, 2, "Copies a key.", copy as _),
        spec("move", 3, 1, 1, "Moves a key to another database.", move_key as _),
    ]
}

/// Every item of one Redis key.
#[derive(Clone, Debug, PartialEq)]
pub struct Snapshot {
    pub ty: KeyType,
    /// The meta item's value: a string's value, or a collection's `CollectionMeta`.
    pub meta: Vec<u8>,
    /// A collection's element items, keyed by what follows its id, in item key order, with
    /// their values.
    pub elements: Vec<(Vec<u8>, Vec<u8>)>,
    pub deadline_ms: Option<u64>,
}

impl Snapshot {
    /// The writes that put this snapshot under `key`, which `view` must show missing (or whose
    /// deletes come first in the same batch): a collection takes a version no item of `key`
    /// uses.
    pub fn write_ops(&self, view: &View<'_>, key: &[u8]) -> Vec<BatchOp> {
        let mut ops = Vec::with_capacity(self.elements.len() + 3);
        match (self.ty, self.ty.element_tag()) {
            (KeyType::String, _) | (_, None) => ops.push(BatchOp::Put {
                key: keyspace::meta_key(key, KeyType::String),
                value: self.meta.clone(),
            }),
            (ty, Some(tag)) => {
                let mut meta = CollectionMeta::decode(&self.meta).expect("checked when read");
                meta.version = unused_version(view, key);
                let prefix =
                    keyspace::element_prefix(tag, &keyspace::collection_id(key, meta.version));
                for (rest, value) in &self.elements {
                    let mut item = Vec::with_capacity(prefix.len() + rest.len());
                    item.extend_from_slice(&prefix);
                    item.extend_from_slice(rest);
                    ops.push(BatchOp::Put { key: item, value: value.clone() });
                }
                ops.push(BatchOp::Put { key: keyspace::meta_key(key, ty), value: meta.encode() });
            }
        }
        ops.extend(ttl_ops(key, None, self.deadline_ms));
        ops
    }

    /// A fingerprint of everything the snapshot holds.
    pub fn fingerprint(&self) -> u64 {
        let mut hasher = xxhash_rust::xxh3::Xxh3::new();
        hasher.update(&[self.ty as u8]);
        hasher.update(&self.deadline_ms.map_or(0, |deadline| deadline + 1).to_be_bytes());
        for part in std::iter::once((&self.meta, &self.meta))
            .chain(self.elements.iter().map(|(rest, value)| (rest, value)))
        {
            hasher.update(&(part.0.len() as u64).to_be_bytes());
            hasher.update(part.0);
            hasher.update(&(part.1.len() as u64).to_be_bytes());
            hasher.update(part.1);
        }
        hasher.digest()
    }
}

/// A key's contents as Redis types (DUMP, RESTORE, OBJECT ENCODING).
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    String(Vec<u8>),
    List(Vec<Vec<u8>>),
    /// (field, value) pairs.
    Hash(Vec<(Vec<u8>, Vec<u8>)>),
    Set(Vec<Vec<u8>>),
    /// (member, score) pairs, ordered by score, then member.
    ZSet(Vec<(Vec<u8>, f64)>),
}

impl Value {
    pub fn ty(&self) -> KeyType {
        match self {
            Value::String(_) => KeyType::String,
            Value::List(_) => KeyType::List,
            Value::Hash(_) => KeyType::Hash,
            Value::Set(_) => KeyType::Set,
            Value::ZSet(_) => KeyType::ZSet,
        }
    }

    /// Elements (a string: 1).
    #[allow(clippy::len_without_is_empty)] // a stored value is never empty
    pub fn len(&self) -> usize {
        match self {
            Value::String(_) => 1,
            Value::List(items) | Value::Set(items) => items.len(),
            Value::Hash(pairs) => pairs.len(),
            Value::ZSet(pairs) => pairs.len(),
        }
    }
}

impl Snapshot {
    /// The snapshot's contents as Redis types; None for items this version never writes.
    pub fn value(&self) -> Option<Value> {
        // What follows a field's or a set member's scan hash.
        let named = |rest: &[u8]| rest.get(8..).map(<[u8]>::to_vec);
        Some(match self.ty {
            KeyType::String => Value::String(self.meta.clone()),
            KeyType::List => {
                Value::List(self.elements.iter().map(|(_, value)| value.clone()).collect())
            }
            KeyType::Hash => Value::Hash(
                self.elements
                    .iter()
                    .map(|(rest, value)| Some((named(rest)?, value.clone())))
                    .collect::<Option<_>>()?,
            ),
            KeyType::Set => Value::Set(
                self.elements.iter().map(|(rest, _)| named(rest)).collect::<Option<_>>()?,
            ),
            KeyType::ZSet => {
                let mut pairs = Vec::with_capacity(self.elements.len() / 2);
                for (rest, value) in &self.elements {
                    if rest.first() == Some(&keyspace::ZSET_MEMBER) {
                        pairs.push((rest[1..].to_vec(), keyspace::decode_score_value(value)?));
                    }
                }
                pairs.sort_by(|a, b| a.1.total_cmp(&b.1).then_with(|| a.0.cmp(&b.0)));
                Value::ZSet(pairs)
            }
        })
    }

    /// The snapshot of a key holding `value` (a collection must not be empty) with
    /// `deadline_ms`: its items as `write_ops` writes them.
    pub fn of_value(value: &Value, deadline_ms: Option<u64>) -> Snapshot {
        let ty = value.ty();
        // Element items are built under a placeholder id, then cut after it.
        let id = keyspace::collection_id(b"", 0);
        let cut = |item: Vec<u8>| item[keyspace::element_prefix(item[0], &id).len()..].to_vec();
        let mut elements = Vec::with_capacity(value.len());
        match value {
            Value::String(bytes) => {
                return Snapshot { ty, meta: bytes.clone(), elements, deadline_ms };
            }
            Value::List(items) => {
                for (at, item) in items.iter().enumerate() {
                    let index = keyspace::LIST_HEAD_INITIAL + at as u64;
                    elements.push((cut(keyspace::list_key(&id, index)), item.clone()));
                }
            }
            Value::Hash(pairs) => {
                for (field, item) in pairs {
                    elements.push((cut(keyspace::field_key(&id, field)), item.clone()));
                }
            }
            Value::Set(members) => {
                for member in members {
                    elements.push((cut(keyspace::set_member_key(&id, member)), Vec::new()));
                }
            }
            Value::ZSet(pairs) => {
                for (member, score) in pairs {
                    let score_item = keyspace::score_key(&id, *score, member);
                    elements.push((cut(score_item), Vec::new()));
                    let member_item = keyspace::member_key(&id, member);
                    elements.push((cut(member_item), keyspace::encode_score(*score)));
                }
            }
        }
        // Item key order, as a snapshot read from the store has them.
        elements.sort_by(|a, b| a.0.cmp(&b.0));
        let meta = CollectionMeta {
            version: 0,
            count: value.len() as u64,
            deadline_ms: None,
            head: (ty == KeyType::List).then_some(keyspace::LIST_HEAD_INITIAL),
        };
        Snapshot { ty, meta: meta.encode(), elements, deadline_ms }
    }
}

/// The writes that make `key` in `view` hold `snapshot`, whatever it held (its deadline too; an
/// expired key is reclaimed). With `replace` false a live key is left alone: None.
pub fn replace_ops(
    view: &View<'_>,
    key: &[u8],
    snapshot: &Snapshot,
    replace: bool,
) -> Option<Vec<BatchOp>> {
    let expiry = Expiry::of(view, key);
    let mut ops = match expiry.live(stored_type(view, key)) {
        Some(_) if !replace => return None,
        Some(ty) => delete_ops(key, ty, &expiry),
        None => Vec::new(),
    };
    ops = expiry.before(ops);
    ops.extend(snapshot.write_ops(view, key));
    Some(last_op_wins(ops))
}

/// What reading a snapshot asks for next.
pub enum Step {
    Read(ReadOps),
    /// The snapshot, None for a missing (or expired) key.
    Done(Option<Snapshot>),
    Failed(Reply),
}

/// Reads a key's snapshot inside an exec holding its lock: `start`, then `resume` with each
/// read's results until `Done`.
pub struct SnapshotReader {
    key: Vec<u8>,
    ty: KeyType,
    deadline_ms: Option<u64>,
    meta: Option<Vec<u8>>,
    /// Bytes of an element item's key before what the snapshot keeps.
    prefix_bytes: usize,
    /// Element item keys, in order; `read` of them are read.
    items: Vec<Vec<u8>>,
    read: usize,
    asked: usize,
    elements: Vec<(Vec<u8>, Vec<u8>)>,
    /// A copy's reader refuses a key larger than one batch; a reader for a reply (DUMP, OBJECT)
    /// refuses one whose items pass `reply_bytes_max` instead.
    for_copy: bool,
    reply_bytes_max: usize,
    bytes_read: usize,
}

impl SnapshotReader {
    /// A reader for a copy: the key must fit one batch.
    pub fn new(key: Vec<u8>) -> SnapshotReader {
        SnapshotReader::bounded(key, true, COPY_BYTES_MAX)
    }

    /// A reader for a reply (DUMP, OBJECT ENCODING): any number of elements, at most
    /// `reply_bytes_max` bytes of items.
    pub fn for_reply(key: Vec<u8>, reply_bytes_max: usize) -> SnapshotReader {
        SnapshotReader::bounded(key, false, reply_bytes_max)
    }

    fn bounded(key: Vec<u8>, for_copy: bool, reply_bytes_max: usize) -> SnapshotReader {
        SnapshotReader {
            for_copy,
            reply_bytes_max,
            bytes_read: 0,
            key,
            ty: KeyType::String,
            deadline_ms: None,
            meta: None,
            prefix_bytes: 0,
            items: Vec::new(),
            read: 0,
            asked: 0,
            elements: Vec::new(),
        }
    }

    pub fn key(&self) -> &[u8] {
        &self.key
    }

    pub fn start(&mut self, view: &View<'_>) -> Step {
        let expiry = Expiry::of(view, &self.key);
        let live = expiry.live(stored_type(view, &self.key));
        view.note_lookup(live.is_some());
        let Some(ty) = live else { return Step::Done(None) };
        self.ty = ty;
        self.deadline_ms = expiry.deadline_ms;
        Step::Read(smallvec::smallvec![ReadOp::Get(keyspace::meta_key(&self.key, ty))])
    }

    pub fn resume(&mut self, view: &View<'_>, results: ReadResults) -> Step {
        if self.meta.is_none() {
            let Some(value) = value_of(results.into_iter().next()) else {
                return Step::Failed(Reply::error("ERR internal error: a meta item vanished"));
            };
            if let Err(error) = self.list_elements(view, &value) {
                return Step::Failed(error);
            }
            self.meta = Some(value);
        } else {
            let asked = &self.items[self.read..self.read + self.asked];
            for (item, result) in asked.iter().zip(results) {
                let Some(value) = value_of(Some(result)) else {
                    return Step::Failed(Reply::error("ERR internal error: an element vanished"));
                };
                self.bytes_read += item.len() + value.len();
                self.elements.push((item[self.prefix_bytes..].to_vec(), value));
            }
            if self.bytes_read > self.reply_bytes_max {
                return Step::Failed(match self.for_copy {
                    true => Reply::Error(format!(
                        "ERR this key holds more than {COPY_BYTES_MAX} bytes, more than copse \
                         copies in one atomic batch; nothing was changed"
                    )),
                    false => super::reply_too_large(self.bytes_read, self.reply_bytes_max),
                });
            }
            self.read += self.asked;
        }
        self.asked = (self.items.len() - self.read).min(EXEC_READS_MAX);
        if self.asked == 0 {
            return Step::Done(Some(Snapshot {
                ty: self.ty,
                meta: self.meta.take().unwrap_or_default(),
                elements: std::mem::take(&mut self.elements),
                deadline_ms: self.deadline_ms,
            }));
        }
        let asked = &self.items[self.read..self.read + self.asked];
        Step::Read(asked.iter().map(|item| ReadOp::Get(item.clone())).collect())
    }

    /// Lists the element items of a collection whose meta value is `value` (no I/O), refusing a
    /// collection too large to copy in one batch.
    fn list_elements(&mut self, view: &View<'_>, value: &[u8]) -> Result<(), Reply> {
        let Some(tag) = self.ty.element_tag() else { return Ok(()) };
        let Some(meta) = CollectionMeta::decode(value) else {
            return Err(Reply::error(CORRUPT_META));
        };
        let per_element = if self.ty == KeyType::ZSet { 2 } else { 1 };
        let items = (meta.count as usize).saturating_mul(per_element);
        if self.for_copy && items > COPY_ITEMS_MAX {
            return Err(Reply::Error(format!(
                "ERR this key has {} elements, more than copse copies in one atomic batch ({}); nothing was changed",
                meta.count,
                COPY_ITEMS_MAX / per_element
            )));
        }
        let id = keyspace::collection_id(&self.key, meta.version);
        let (start, end) = match self.ty {
            KeyType::List => {
                let head = meta.head.unwrap_or(keyspace::LIST_HEAD_INITIAL);
                keyspace::list_range(&id, head, head + meta.count)
            }
            _ => keyspace::id_range(tag, &id),
        };
        self.items = view.keys(bound_ref(&start), bound_ref(&end), items + 1);
        if self.items.len() != items {
            return Err(Reply::error(
                "ERR internal error: a collection's elements do not match its count",
            ));
        }
        self.prefix_bytes = keyspace::element_prefix(tag, &id).len();
        Ok(())
    }
}

fn rename(call: &mut Call<'_>) -> Outcome {
    rename_command(call, false)
}

fn renamenx(call: &mut Call<'_>) -> Outcome {
    rename_command(call, true)
}

/// RENAME and RENAMENX: the source's items under the destination, the source deleted.
fn rename_command(call: &mut Call<'_>, only_if_free: bool) -> Outcome {
    let source = call.args[1].clone();
    let destination = call.args[2].clone();
    let answer = move |copied: bool| match (only_if_free, copied) {
        (true, copied) => Reply::Integer(copied as i64),
        (false, _) => Reply::ok(),
    };
    if source == destination {
        // The key stays as it is: only whether it exists matters.
        let same = std::mem::take(&mut call.args[1]);
        return super::on_key(
            super::KeyTarget::of(call.db(), &same),
            move |view, input| match input {
                Input::Start if super::key_type(view, &same).is_none() => {
                    Next::Reply(Reply::error(NO_SUCH_KEY))
                }
                Input::Start => Next::Reply(answer(false)),
                _ => unexpected(),
            },
        );
    }
    let copy = Copy {
        source,
        destination,
        destination_namespace: Namespace::current(),
        replace: !only_if_free,
        delete_source: true,
        missing: Reply::error(NO_SUCH_KEY),
    };
    copy.run(call, Box::new(answer))
}

/// COPY source destination [DB n] [REPLACE].
fn copy(call: &mut Call<'_>) -> Outcome {
    let mut database = None;
    let mut replace = false;
    let mut at = 3;
    while at < call.args.len() {
        match call.word(at).as_str() {
            "replace" => replace = true,
            "db" if at + 1 < call.args.len() => {
                at += 1;
                match parse_i64(&call.args[at]) {
                    Some(number) if (0..DATABASES as i64).contains(&number) => {
                        database = Some(number as u8)
                    }
                    Some(_) => return Outcome::error(DB_OUT_OF_RANGE),
                    None => return Outcome::error(NOT_INTEGER),
                }
            }
            _ => return Outcome::error(SYNTAX),
        }
        at += 1;
    }
    let database = database.unwrap_or(call.conn.db);
    if call.args[1] == call.args[2] && database == call.conn.db {
        return Outcome::error(SAME_OBJECT);
    }
    let copy = Copy {
        source: call.args[1].clone(),
        destination: call.args[2].clone(),
        destination_namespace: Namespace::current().sibling(database),
        replace,
        delete_source: false,
        missing: Reply::Integer(0),
    };
    copy.run(call, Box::new(|copied| Reply::Integer(copied as i64)))
}

/// MOVE key db: the key's items in database `db`, unless a live key of that name is there.
fn move_key(call: &mut Call<'_>) -> Outcome {
    let database = match parse_i64(&call.args[2]) {
        Some(number) if (0..DATABASES as i64).contains(&number) => number as u8,
        Some(_) => return Outcome::error(DB_OUT_OF_RANGE),
        None => return Outcome::error(NOT_INTEGER),
    };
    if database == call.conn.db {
        return Outcome::error(SAME_OBJECT);
    }
    let key = call.args[1].clone();
    let copy = Copy {
        source: key.clone(),
        destination: key,
        destination_namespace: Namespace::current().sibling(database),
        replace: false,
        delete_source: true,
        missing: Reply::Integer(0),
    };
    copy.run(call, Box::new(|copied| Reply::Integer(copied as i64)))
}

/// One copy of `source` (in the command's namespace) to `destination` in
/// `destination_namespace`.
struct Copy {
    source: Vec<u8>,
    destination: Vec<u8>,
    destination_namespace: Namespace,
    /// Overwrite a live destination (else the copy is not made: `answer(false)`).
    replace: bool,
    /// RENAME and MOVE: the source is deleted in the same batch.
    delete_source: bool,
    /// The answer for a missing source.
    missing: Reply,
}

type Answer = Box<dyn Fn(bool) -> Reply + Send>;

impl Copy {
    fn run(self, call: &Call<'_>, answer: Answer) -> Outcome {
        let db = call.db();
        if db.shard_of(&self.source) == db.shard_of(&self.destination) {
            return self.in_one_shard(call, answer);
        }
        let server = call.server.clone();
        Outcome::AfterPending(Box::pin(async move {
            for _ in 0..COPY_ATTEMPTS_MAX {
                let snapshot = match read_snapshot(&server.db, &self.source).await {
                    Ok(Some(snapshot)) => snapshot,
                    Ok(None) => return self.missing.clone(),
                    Err(error) => return error,
                };
                let ty = snapshot.ty;
                match self.across_shards(&server.db, snapshot).await {
                    Some(Ok(true)) => {
                        let namespace = self.destination_namespace.number().unwrap_or(0);
                        wake_waiters(&server, ty, namespace, &self.destination);
                        return answer(true);
                    }
                    Some(copied) => return copied.map_or_else(|error| error, &answer),
                    None => tokio::task::yield_now().await,
                }
            }
            Reply::error("ERR the source kept changing under this command; nothing was copied")
        }))
    }

    /// Both keys in one shard: one exec holding both locks, seeing both namespaces (a raw exec
    /// that translates for each).
    fn in_one_shard(self, call: &Call<'_>, answer: Answer) -> Outcome {
        let source_namespace = Namespace::current();
        let raw = source_namespace.as_raw();
        let shard = call.db().shard_of(&self.source);
        let locks = vec![self.source.clone(), self.destination.clone()];
        let mut reader = SnapshotReader::new(self.source.clone());
        let mut copied = None;
        let server = call.server.clone();
        let mut plan = Plan::new();
        let step = move |view: &View<'_>, input: Input| {
            let source_view = view.in_namespace(&source_namespace);
            let step = match input {
                Input::Start => reader.start(&source_view),
                Input::Read(results) => reader.resume(&source_view, results),
                Input::Written => {
                    if let Some(ty) = copied {
                        let namespace = self.destination_namespace.number().unwrap_or(0);
                        wake_waiters(&server, ty, namespace, &self.destination);
                    }
                    return Next::Reply(answer(copied.is_some()));
                }
            };
            let snapshot = match step {
                Step::Read(mut reads) => {
                    source_namespace.read_ops(&mut reads);
                    return Next::Read(reads);
                }
                Step::Failed(error) => return Next::Reply(error),
                Step::Done(None) => return Next::Reply(self.missing.clone()),
                Step::Done(Some(snapshot)) => snapshot,
            };
            let destination_view = view.in_namespace(&self.destination_namespace);
            let Some(mut ops) =
                replace_ops(&destination_view, &self.destination, &snapshot, self.replace)
            else {
                return Next::Reply(answer(false));
            };
            let mut fits = self.destination_namespace.write_ops(&mut ops).is_ok();
            if self.delete_source {
                let expiry = Expiry::of(&source_view, &self.source);
                let mut deletes = delete_ops(&self.source, snapshot.ty, &expiry);
                fits &= source_namespace.write_ops(&mut deletes).is_ok();
                ops.splice(0..0, deletes);
            }
            if !fits {
                return Next::Reply(super::namespace::too_long(&ops));
            }
            if let Err(error) = check_batch(&ops) {
                return Next::Reply(error);
            }
            copied = Some(snapshot.ty);
            Next::Write(ops)
        };
        raw.scope(|| plan.add(shard, locks, step));
        plan.finish(Box::new(|mut replies| replies.pop().unwrap_or(Reply::Null)))
    }

    /// Keys on two shards: one cross-shard batch whose source part checks the source still
    /// holds `snapshot`. None when it changed (read again); else the copy's outcome.
    async fn across_shards(
        &self,
        db: &copse::Db,
        snapshot: Snapshot,
    ) -> Option<Result<bool, Reply>> {
        let expected = snapshot.fingerprint();
        // Why a part refused the batch (the other part answers the abort that follows).
        let cause: Arc<Mutex<Option<Reply>>> = Arc::new(Mutex::new(None));
        let cause_of_source = cause.clone();
        let mut plan = AtomicPlan::new();
        let source = self.source.clone();
        let delete_source = self.delete_source;
        let shard = db.shard_of(&source);
        // The source was looked up once already (`read_snapshot`): its check is not counted.
        let check_namespace = Namespace::current().uncounted();
        check_namespace.scope(|| {
            plan.add(shard, vec![source.clone()], move |vote| {
                let mut vote = Some(vote);
                let mut reader = SnapshotReader::new(source);
                move |view: &View<'_>, input| {
                    let step = match input {
                        Input::Start => reader.start(view),
                        Input::Read(results) => reader.resume(view, results),
                        Input::Written => return Next::Reply(Reply::ok()),
                    };
                    let refused = match step {
                        Step::Read(reads) => return Next::Read(reads),
                        Step::Done(Some(now)) if now.fingerprint() == expected => {
                            let mut ops = Vec::new();
                            if delete_source {
                                let expiry = Expiry::of(view, reader.key());
                                ops = delete_ops(reader.key(), now.ty, &expiry);
                            }
                            return match vote.take() {
                                Some(vote) => Next::Prepare(vote, ops),
                                None => unexpected(),
                            };
                        }
                        Step::Done(_) => Reply::Simple(CHANGED.into()),
                        Step::Failed(error) => error,
                    };
                    if let Some(vote) = vote.take() {
                        vote.refuse(copse::WriteError::Aborted("the copy's source changed".into()));
                    }
                    cause_of_source
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .get_or_insert(refused);
                    Next::Reply(Reply::ok())
                }
            })
        });
        let destination = self.destination.clone();
        let replace = self.replace;
        let shard = db.shard_of(&destination);
        let snapshot = Arc::new(Mutex::new(Some(snapshot)));
        let refusal = cause.clone();
        self.destination_namespace.scope(|| {
            plan.add(shard, vec![destination.clone()], move |vote| {
                let mut vote = Some(vote);
                move |view: &View<'_>, input| match input {
                    Input::Start => {
                        let taken = snapshot.lock().unwrap_or_else(|p| p.into_inner()).take();
                        let Some(snapshot) = taken else { return unexpected() };
                        let refused = match replace_ops(view, &destination, &snapshot, replace) {
                            None => Reply::Simple(NOT_COPIED.into()),
                            Some(ops) => match check_batch(&ops) {
                                Ok(()) => {
                                    return match vote.take() {
                                        Some(vote) => Next::Prepare(vote, ops),
                                        None => unexpected(),
                                    }
                                }
                                Err(error) => error,
                            },
                        };
                        if let Some(vote) = vote.take() {
                            vote.refuse(copse::WriteError::Aborted("the copy was refused".into()));
                        }
                        let mut cause = cause.lock().unwrap_or_else(|p| p.into_inner());
                        cause.get_or_insert(refused);
                        Next::Reply(Reply::ok())
                    }
                    Input::Written => Next::Reply(Reply::ok()),
                    Input::Read(_) => unexpected(),
                }
            })
        });
        let combine = Box::new(move |replies: Vec<Reply>| {
            match refusal.lock().unwrap_or_else(|p| p.into_inner()).take() {
                Some(Reply::Simple(word)) if word == NOT_COPIED => Reply::Integer(0),
                Some(cause) => cause,
                None => replies
                    .into_iter()
                    .find(|reply| !matches!(reply, Reply::Simple(_)))
                    .unwrap_or(Reply::Integer(1)),
            }
        });
        match run_outcome(db, plan.finish(db, combine)).await {
            Reply::Simple(word) if word == CHANGED => None,
            Reply::Integer(copied) => Some(Ok(copied == 1)),
            other => Some(Err(other)),
        }
    }
}

/// Wakes the first client blocked on `key` of namespace `namespace` that a new `ty` there can
/// serve (a list for BLPOP and the like, a sorted set for BZPOPMIN and the like), as Redis
/// signals a key made by RENAME, COPY, MOVE or RESTORE.
pub fn wake_waiters(server: &crate::context::Server, ty: KeyType, namespace: u8, key: &[u8]) {
    let kind = match ty {
        KeyType::List => crate::waiters::Kind::List,
        KeyType::ZSet => crate::waiters::Kind::ZSet,
        _ => return,
    };
    server.waiters.wake(kind, namespace, key);
}

/// What a part of a copy's batch answers when the source changed since it was read.
const CHANGED: &str = "CHANGED";
/// What the destination's part answers when a live destination is not to be replaced.
const NOT_COPIED: &str = "NOT-COPIED";

/// An exec program that reads `reader`'s key whole, then answers `done` of its snapshot (None:
/// a missing key); a failed read answers its error.
pub fn snapshot_step<F>(
    mut reader: SnapshotReader,
    mut done: F,
) -> impl FnMut(&View<'_>, Input) -> Next + Send + 'static
where
    F: FnMut(Option<Snapshot>) -> Next + Send + 'static,
{
    move |view, input| {
        let step = match input {
            Input::Start => reader.start(view),
            Input::Read(results) => reader.resume(view, results),
            Input::Written => return unexpected(),
        };
        match step {
            Step::Read(reads) => Next::Read(reads),
            Step::Failed(error) => Next::Reply(error),
            Step::Done(snapshot) => done(snapshot),
        }
    }
}

/// `key`'s snapshot, read by one exec in the current namespace (None: missing).
pub async fn read_snapshot(db: &copse::Db, key: &[u8]) -> Result<Option<Snapshot>, Reply> {
    let slot: Arc<Mutex<Option<Snapshot>>> = Arc::new(Mutex::new(None));
    let filled = slot.clone();
    let reader = SnapshotReader::new(key.to_vec());
    let mut plan = Plan::new();
    let step = snapshot_step(reader, move |snapshot| {
        *filled.lock().unwrap_or_else(|poison| poison.into_inner()) = snapshot;
        Next::Reply(Reply::ok())
    });
    plan.add(db.shard_of(key), vec![key.to_vec()], step);
    match run_outcome(db, plan.finish(Box::new(|mut replies| replies.pop().unwrap_or(Reply::Null))))
        .await
    {
        Reply::Simple(_) => Ok(slot.lock().unwrap_or_else(|poison| poison.into_inner()).take()),
        other => Err(other),
    }
}
