//! List commands. A list is its meta item (version, element count, head index) plus one item
//! per element under the list's id, keyed by its index: element `i` (0-based from the left) is
//! at index `head + i`. A push at either end writes one element item and the meta item; a pop
//! reads and deletes the end's items; LINDEX and LRANGE read only the indexes asked for
//! (docs/format/redis-keyspace.md, "Lists").
//!
//! Invariants:
//! - A list exists iff its meta item exists, and then its elements are exactly the items of its
//!   id at indexes `head .. head + count`, `count` ≥ 1. Items of its id outside that window are
//!   dead (left by pops and trims of more than `LIST_DELETES_INLINE_MAX` elements, with the
//!   key's orphan record written in the same batch): nothing reads them, the orphan collector
//!   deletes them, and a push over one rewrites it.
//! - Each command writes at most one batch (LMOVE across shards: one cross-shard batch), so it
//!   happens whole or not at all; a refused command changes nothing.
//! - A write that adds elements wakes the first client blocked on the key once it is durable
//!   (`waiters.rs`); blocked clients are served in the order they blocked.

use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::View;
use copse::exec::{ReadOp, ReadResults};
use copse::limits::{EXEC_READS_MAX, KEY_BYTES_MAX, VALUE_BYTES_MAX};
use copse::{BatchOp, Db};

use super::{
    answer, check_batch, coll_begin, coll_make, coll_meta, from_index, on_collection,
    on_collection_grouped, on_collection_key, parse_f64, parse_i64, run_outcome, unexpected,
    value_of, Call, Coll, Input, Next, Outcome, Plan, Spec, NOT_INTEGER, SYNTAX,
};
use crate::context::Server;
use crate::keyspace::{self, list_key, KeyType, VERSION_BYTES};
use crate::resp::Reply;
use crate::waiters::{queue_key, Kind};

/// Bytes a list element's item key adds around the Redis key: tag, id length, version, index.
pub const LIST_ELEMENT_OVERHEAD_BYTES: usize = 1 + 4 + VERSION_BYTES + 8;
/// The longest key a list can have (its element items must fit an item key).
pub const LIST_KEY_BYTES_MAX: usize = KEY_BYTES_MAX - LIST_ELEMENT_OVERHEAD_BYTES;
/// The largest element: a new list writes its first element and its meta item in one batch
/// record, which must fit copse's largest value (4 KiB kept for the framing and the meta item).
pub const LIST_ELEMENT_BYTES_MAX: usize = VALUE_BYTES_MAX - 4096;
/// Elements a pop or trim deletes in its own batch at most; beyond, it moves the list's window
/// and writes the key's orphan record, and the orphan collector deletes the rest.
pub const LIST_DELETES_INLINE_MAX: usize = 1_000;
/// How many times LMOVE across shards retries when the source changed between its read and its
/// atomic write, before it answers an error.
pub const LMOVE_ATTEMPTS_MAX: usize = 1_000;

pub fn specs() -> Vec<Spec> {
    let spec = |name, arity, flags, keys, summary, handler| {
        Spec::new("list", name, arity, flags, keys, summary, handler)
    };
    const W: &[&str] = &["write", "fast"];
    const WS: &[&str] = &["write"];
    const R: &[&str] = &["readonly", "fast"];
    const RS: &[&str] = &["readonly"];
    const B: &[&str] = &["write", "blocking"];
    const ONE: (i32, i32, i32) = (1, 1, 1);
    const TWO: (i32, i32, i32) = (1, 2, 1);
    vec![
        spec("lpush", -3, W, ONE, "Prepends elements to a list.", lpush as _),
        spec("rpush", -3, W, ONE, "Appends elements to a list.", rpush as _),
        spec("lpushx", -3, W, ONE, "Prepends elements to an existing list.", lpushx as _),
        spec("rpushx", -3, W, ONE, "Appends elements to an existing list.", rpushx as _),
        spec("lpop", -2, W, ONE, "Removes and returns the first elements.", lpop as _),
        spec("rpop", -2, W, ONE, "Removes and returns the last elements.", rpop as _),
        spec("llen", 2, R, ONE, "Returns the length of a list.", llen as _),
        spec("lindex", 3, R, ONE, "Returns the element at an index.", lindex as _),
        spec("lrange", 4, RS, ONE, "Returns a range of elements.", lrange as _),
        spec("lset", 4, WS, ONE, "Sets the element at an index.", lset as _),
        spec("ltrim", 4, WS, ONE, "Keeps only a range of elements.", ltrim as _),
        spec("lrem", 4, WS, ONE, "Removes occurrences of an element.", lrem as _),
        spec("linsert", 5, WS, ONE, "Inserts an element before or after another.", linsert as _),
        spec("lpos", -3, RS, ONE, "Returns the indexes of matching elements.", lpos as _),
        spec("lmove", 5, WS, TWO, "Pops from one list and pushes to another.", lmove as _),
        spec("rpoplpush", 3, WS, TWO, "Pops the last element, pushes it first.", rpoplpush as _),
        spec("lmpop", -4, WS, (2, -2, 1), "Pops from the first non-empty list.", lmpop as _),
        spec("blpop", -3, B, (1, -2, 1), "LPOP, blocking until an element comes.", blpop as _),
        spec("brpop", -3, B, (1, -2, 1), "RPOP, blocking until an element comes.", brpop as _),
        spec("blmove", 6, B, TWO, "LMOVE, blocking until an element comes.", blmove as _),
        spec("brpoplpush", 4, B, TWO, "RPOPLPUSH, blocking.", brpoplpush as _),
        spec("blmpop", -5, B, (3, -2, 1), "LMPOP, blocking until an element comes.", blmpop as _),
    ]
}

/// Refuses a key whose list elements would not fit copse's item keys: `key` is a stored name,
/// so only a key stored inline past `LIST_KEY_BYTES_MAX` (1004 to 1013 bytes) is refused; a
/// longer one has a short surrogate name.
fn check_list_key(key: &[u8]) -> Result<(), Reply> {
    if key.len() > LIST_KEY_BYTES_MAX {
        return Err(Reply::Error(format!(
            "ERR key of {} bytes cannot hold a list (a key of {} to {} bytes is stored as it is and leaves no room for a list element's index; shorter and longer keys can)",
            key.len(),
            LIST_KEY_BYTES_MAX + 1,
            crate::keyspace::NAME_INLINE_BYTES_MAX,
        )));
    }
    Ok(())
}

fn check_element(element: &[u8]) -> Result<(), Reply> {
    if element.len() > LIST_ELEMENT_BYTES_MAX {
        return Err(Reply::Error(format!(
            "ERR list element of {} bytes is too large (copse list elements are at most {LIST_ELEMENT_BYTES_MAX} bytes)",
            element.len()
        )));
    }
    Ok(())
}

/// Which end of a list.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum End {
    Left,
    Right,
}

impl End {
    fn parse(word: &str) -> Option<End> {
        match word {
            "left" => Some(End::Left),
            "right" => Some(End::Right),
            _ => None,
        }
    }
}

/// The index of element `at` (0-based from the left) of `coll`.
fn index_of(coll: &Coll, at: u64) -> u64 {
    coll.head().wrapping_add(at)
}

/// The index of the element at `end` of `coll` (which has one).
fn end_index(coll: &Coll, end: End) -> u64 {
    match end {
        End::Left => index_of(coll, 0),
        End::Right => index_of(coll, coll.count() as u64 - 1),
    }
}

/// The writes that push `elements` at `end` of `coll` (one at a time, as Redis does: LPUSH a b
/// leaves b first), and the list's new length.
fn push_ops(coll: &Coll, end: End, elements: &[Vec<u8>]) -> Result<(Vec<BatchOp>, usize), Reply> {
    let (mut head, count) = (coll.head(), coll.count());
    let exhausted = || Reply::error("ERR the list's index space is exhausted at this end");
    let mut ops = Vec::with_capacity(elements.len() + 1);
    for (at, element) in elements.iter().enumerate() {
        let index = match end {
            End::Left => {
                head = head.checked_sub(1).ok_or_else(exhausted)?;
                head
            }
            End::Right => coll.head().checked_add((count + at) as u64).ok_or_else(exhausted)?,
        };
        ops.push(BatchOp::Put { key: list_key(&coll.id, index), value: element.clone() });
    }
    let length = count + elements.len();
    ops.extend(coll.list_meta_ops(head, length));
    Ok((ops, length))
}

/// The writes that remove `taken` elements from `end` of `coll`: their items deleted, or,
/// beyond `LIST_DELETES_INLINE_MAX`, left to the orphan collector.
fn pop_ops(coll: &Coll, end: End, taken: usize) -> Vec<BatchOp> {
    let (head, count) = (coll.head(), coll.count());
    let (gone, new_head) = match end {
        End::Left => (0..taken, head.wrapping_add(taken as u64)),
        End::Right => (count - taken..count, head),
    };
    let mut ops = drop_elements(coll, gone);
    ops.extend(coll.list_meta_ops(new_head, count - taken));
    ops
}

/// Deletes the elements at positions `gone` of `coll` (0-based from the left), or writes the
/// key's orphan record for the collector when they are many.
fn drop_elements(coll: &Coll, gone: Range<usize>) -> Vec<BatchOp> {
    if gone.len() > LIST_DELETES_INLINE_MAX {
        return vec![BatchOp::Put { key: keyspace::orphans_key(&coll.key), value: Vec::new() }];
    }
    gone.map(|at| BatchOp::Delete { key: list_key(&coll.id, index_of(coll, at as u64)) }).collect()
}

// -- pushes -------------------------------------------------------------------------------------

fn push(call: &mut Call<'_>, end: End, only_existing: bool) -> Outcome {
    if let Err(error) = check_list_key(&call.args[1]) {
        return Outcome::Reply(error);
    }
    let elements: Vec<Vec<u8>> = call.args.drain(2..).collect();
    if let Some(error) = elements.iter().find_map(|element| check_element(element).err()) {
        return Outcome::Reply(error);
    }
    let server = call.server.clone();
    let mut pending = None;
    let namespace = super::namespace::current_number();
    on_collection_grouped(call, KeyType::List, move |_, input, coll| match input {
        Input::Start => {
            if only_existing && !coll.exists() {
                return Next::Reply(Reply::Integer(0));
            }
            let (ops, length) = match push_ops(coll, end, &elements) {
                Ok(pushed) => pushed,
                Err(error) => return Next::Reply(error),
            };
            if let Err(error) = check_batch(&ops) {
                return Next::Reply(error);
            }
            pending = Some(Reply::Integer(length as i64));
            Next::WriteLast(ops)
        }
        Input::Written => {
            server.waiters.wake(Kind::List, namespace, &coll.key);
            answer(&mut pending)
        }
        Input::Read(_) => unexpected(),
    })
}

fn lpush(call: &mut Call<'_>) -> Outcome {
    push(call, End::Left, false)
}

fn rpush(call: &mut Call<'_>) -> Outcome {
    push(call, End::Right, false)
}

fn lpushx(call: &mut Call<'_>) -> Outcome {
    push(call, End::Left, true)
}

fn rpushx(call: &mut Call<'_>) -> Outcome {
    push(call, End::Right, true)
}

// -- reading elements ---------------------------------------------------------------------------

/// Reads list element items in steps no larger than the room left under `bytes_max` (each
/// counted at the largest value the store may hold, at most `EXEC_READS_MAX` per step), so a
/// reply or a scan past the limit stops having read at most the limit plus one value. The item
/// keys are made step by step from a run of indexes (`walk`), never all at once: a walk over a
/// list of any length holds one step's keys.
struct Elements {
    /// The list's id, the index of the walk's first element, its length, and its direction
    /// (true: towards lower indexes).
    id: Vec<u8>,
    first: u64,
    len: usize,
    backwards: bool,
    /// Elements of the walk asked for so far, and those of the step in flight.
    asked: Range<usize>,
    values: Vec<Vec<u8>>,
    bytes: usize,
    bytes_max: usize,
    value_bytes_bound: Arc<AtomicUsize>,
    /// Keep the values read (false: `take` hands each step's values back and keeps none).
    keep: bool,
}

/// What each value costs in a reply besides its bytes (a bulk's header).
const ELEMENT_REPLY_OVERHEAD_BYTES: usize = 16;

impl Elements {
    fn new(server: &Server, keep: bool) -> Elements {
        Elements {
            id: Vec::new(),
            first: 0,
            len: 0,
            backwards: false,
            asked: 0..0,
            values: Vec::new(),
            bytes: 0,
            bytes_max: server.settings.client_output_bytes_max.load(Ordering::Relaxed),
            value_bytes_bound: server.value_bytes_bound.clone(),
            keep,
        }
    }

    /// Walks `len` elements of `coll` from position `from` (0-based from the left), towards the
    /// right, or towards the left if `backwards`.
    fn walk(&mut self, coll: &Coll, from: usize, len: usize, backwards: bool) {
        self.id = coll.id.clone();
        self.first = index_of(coll, from as u64);
        self.len = len;
        self.backwards = backwards;
    }

    /// The index of the walk's `at`-th element.
    fn index(&self, at: usize) -> u64 {
        if self.backwards {
            self.first.wrapping_sub(at as u64)
        } else {
            self.first.wrapping_add(at as u64)
        }
    }

    /// The next step's reads, or None once every element of the walk is read.
    fn next(&mut self) -> Option<Next> {
        let value_bytes_max = self.value_bytes_bound.load(Ordering::Acquire).min(VALUE_BYTES_MAX)
            + ELEMENT_REPLY_OVERHEAD_BYTES;
        let room = self.bytes_max.saturating_sub(self.bytes);
        let step = (room / value_bytes_max).clamp(1, EXEC_READS_MAX);
        self.asked = self.asked.end..(self.asked.end + step).min(self.len);
        if self.asked.is_empty() {
            return None;
        }
        let reads = self.asked.clone().map(|at| ReadOp::Get(list_key(&self.id, self.index(at))));
        Some(Next::Read(reads.collect()))
    }

    /// Takes a step's results: the values read (also kept if `keep`), or an error once they pass
    /// the limit.
    fn take(&mut self, results: ReadResults) -> Result<Vec<Vec<u8>>, Reply> {
        let values: Vec<Vec<u8>> =
            results.into_iter().map(|result| value_of(Some(result)).unwrap_or_default()).collect();
        if self.keep {
            self.bytes +=
                values.iter().map(|v| v.len() + ELEMENT_REPLY_OVERHEAD_BYTES).sum::<usize>();
            if self.bytes > self.bytes_max {
                return Err(super::reply_too_large(self.bytes, self.bytes_max));
            }
            self.values.extend(values.iter().cloned());
        }
        Ok(values)
    }
}

/// Redis's LRANGE window of a list of `len`: the positions from `start` to `stop`, both
/// inclusive, negative ones counting from the end; empty when they cross or start past the end.
fn range_window(start: i64, stop: i64, len: usize) -> Range<usize> {
    let len = len as i64;
    let start = if start < 0 { (len + start).max(0) } else { start };
    let stop = if stop < 0 { len + stop } else { stop };
    if start > stop || start >= len {
        return 0..0;
    }
    start as usize..(stop.min(len - 1) + 1) as usize
}

/// Redis's LINDEX position: None when out of range.
fn position(index: i64, len: usize) -> Option<usize> {
    let at = if index < 0 { len as i64 + index } else { index };
    (0..len as i64).contains(&at).then_some(at as usize)
}

fn llen(call: &mut Call<'_>) -> Outcome {
    from_index(call, KeyType::List, |_, coll| Reply::Integer(coll.count() as i64))
}

fn lindex(call: &mut Call<'_>) -> Outcome {
    let Some(index) = parse_i64(&call.args[2]) else { return Outcome::error(NOT_INTEGER) };
    on_collection(call, KeyType::List, move |_, input, coll| match input {
        Input::Start => match position(index, coll.count()) {
            Some(at) => {
                let key = list_key(&coll.id, index_of(coll, at as u64));
                Next::Read(smallvec::smallvec![ReadOp::Get(key)])
            }
            None => Next::Reply(Reply::Null),
        },
        Input::Read(mut results) => {
            Next::Reply(value_of(results.pop()).map_or(Reply::Null, Reply::Bulk))
        }
        Input::Written => unexpected(),
    })
}

fn lrange(call: &mut Call<'_>) -> Outcome {
    let (Some(start), Some(stop)) = (parse_i64(&call.args[2]), parse_i64(&call.args[3])) else {
        return Outcome::error(NOT_INTEGER);
    };
    let mut elements = Elements::new(call.server, true);
    on_collection(call, KeyType::List, move |_, input, coll| {
        match input {
            Input::Start => {
                let window = range_window(start, stop, coll.count());
                elements.walk(coll, window.start, window.len(), false);
            }
            Input::Read(results) => {
                if let Err(error) = elements.take(results) {
                    return Next::Reply(error);
                }
            }
            Input::Written => return unexpected(),
        }
        match elements.next() {
            Some(read) => read,
            None => Next::Reply(Reply::Array(
                std::mem::take(&mut elements.values).into_iter().map(Reply::Bulk).collect(),
            )),
        }
    })
}

// -- pops -----------------------------------------------------------------------------------------

/// The count argument of LPOP and RPOP (None: no count, a single element's reply).
fn pop_count(call: &Call<'_>) -> Result<Option<usize>, Reply> {
    match call.args.len() {
        2 => Ok(None),
        3 => match parse_i64(&call.args[2]) {
            Some(count) if count >= 0 => Ok(Some(count as usize)),
            _ => Err(Reply::error("ERR value is out of range, must be positive")),
        },
        _ => Err(Reply::Error(format!(
            "ERR wrong number of arguments for '{}' command",
            call.word(0)
        ))),
    }
}

/// Pops up to `count` elements (None: one, answered as a bulk) from `end` of list `key`;
/// `reply` shapes the answer from the key and the elements popped (called only when the key
/// holds a list). A missing key answers `missing`.
fn pop_with<F>(
    server: &Server,
    key: Vec<u8>,
    end: End,
    count: Option<usize>,
    missing: Reply,
    mut reply: F,
) -> Outcome
where
    F: FnMut(&[u8], Vec<Vec<u8>>) -> Reply + Send + 'static,
{
    let mut elements = Elements::new(server, true);
    let mut taken = 0;
    let mut pending = None;
    // Pops of one hot list share flushes with the pushes and pops before them (write groups):
    // they read single items and write once, last.
    on_collection_key(&server.db, key, KeyType::List, true, move |_, input, coll| {
        match input {
            Input::Start => {
                if !coll.exists() {
                    return Next::Reply(missing.clone());
                }
                taken = count.unwrap_or(1).min(coll.count());
                // Popped in the order they leave the list: from the end inwards.
                match end {
                    End::Left => elements.walk(coll, 0, taken, false),
                    End::Right => elements.walk(coll, coll.count() - 1, taken, true),
                }
            }
            Input::Read(results) => {
                if let Err(error) = elements.take(results) {
                    return Next::Reply(error);
                }
            }
            Input::Written => return answer(&mut pending),
        }
        if let Some(read) = elements.next() {
            return read;
        }
        let popped = std::mem::take(&mut elements.values);
        let answer_now = reply(&coll.key, popped);
        if taken == 0 {
            return Next::Reply(answer_now);
        }
        pending = Some(answer_now);
        Next::WriteLast(pop_ops(coll, end, taken))
    })
}

fn pop(call: &mut Call<'_>, end: End) -> Outcome {
    let count = match pop_count(call) {
        Ok(count) => count,
        Err(error) => return Outcome::Reply(error),
    };
    let missing = if count.is_some() { Reply::NullArray } else { Reply::Null };
    let key = call.args[1].clone();
    pop_with(call.server, key, end, count, missing, move |_, mut popped| match count {
        None => popped.pop().map_or(Reply::Null, Reply::Bulk),
        Some(_) => Reply::Array(popped.into_iter().map(Reply::Bulk).collect()),
    })
}

fn lpop(call: &mut Call<'_>) -> Outcome {
    pop(call, End::Left)
}

fn rpop(call: &mut Call<'_>) -> Outcome {
    pop(call, End::Right)
}

// -- changes in place -----------------------------------------------------------------------------

fn lset(call: &mut Call<'_>) -> Outcome {
    let Some(index) = parse_i64(&call.args[2]) else { return Outcome::error(NOT_INTEGER) };
    let element = std::mem::take(&mut call.args[3]);
    if let Err(error) = check_element(&element) {
        return Outcome::Reply(error);
    }
    let mut element = Some(element);
    let mut pending = None;
    on_collection(call, KeyType::List, move |_, input, coll| match input {
        Input::Start => {
            if !coll.exists() {
                return Next::Reply(Reply::error("ERR no such key"));
            }
            let Some(at) = position(index, coll.count()) else {
                return Next::Reply(Reply::error("ERR index out of range"));
            };
            let Some(value) = element.take() else { return unexpected() };
            pending = Some(Reply::ok());
            Next::WriteLast(vec![BatchOp::Put {
                key: list_key(&coll.id, index_of(coll, at as u64)),
                value,
            }])
        }
        Input::Written => answer(&mut pending),
        Input::Read(_) => unexpected(),
    })
}

fn ltrim(call: &mut Call<'_>) -> Outcome {
    let (Some(start), Some(stop)) = (parse_i64(&call.args[2]), parse_i64(&call.args[3])) else {
        return Outcome::error(NOT_INTEGER);
    };
    let mut pending = None;
    on_collection(call, KeyType::List, move |_, input, coll| match input {
        Input::Start => {
            let count = coll.count();
            let keep = range_window(start, stop, count);
            if keep.len() == count {
                return Next::Reply(Reply::ok());
            }
            let (keep_start, keep_end) =
                if keep.is_empty() { (count, count) } else { (keep.start, keep.end) };
            let mut ops = drop_elements(coll, 0..keep_start);
            ops.extend(drop_elements(coll, keep_end..count));
            let new_head = index_of(coll, keep_start as u64);
            ops.extend(coll.list_meta_ops(new_head, keep.len()));
            let ops = super::last_op_wins(ops);
            pending = Some(Reply::ok());
            Next::WriteLast(ops)
        }
        Input::Written => answer(&mut pending),
        Input::Read(_) => unexpected(),
    })
}

/// Reads every element of the list (in steps, within the output limit: these commands hold the
/// whole list in memory), then `change` decides from them.
fn with_all_elements<F>(call: &Call<'_>, mut change: F) -> Outcome
where
    F: FnMut(&Coll, Vec<Vec<u8>>) -> Result<(Vec<BatchOp>, Reply), Reply> + Send + 'static,
{
    let mut elements = Elements::new(call.server, true);
    let mut pending = None;
    on_collection(call, KeyType::List, move |_, input, coll| {
        match input {
            Input::Start => {
                elements.walk(coll, 0, coll.count(), false);
            }
            Input::Read(results) => {
                if let Err(error) = elements.take(results) {
                    return Next::Reply(error);
                }
            }
            Input::Written => return answer(&mut pending),
        }
        if let Some(read) = elements.next() {
            return read;
        }
        match change(coll, std::mem::take(&mut elements.values)) {
            Ok((ops, reply)) if ops.is_empty() => Next::Reply(reply),
            Ok((ops, reply)) => {
                if let Err(error) = check_batch(&ops) {
                    return Next::Reply(error);
                }
                pending = Some(reply);
                Next::WriteLast(ops)
            }
            Err(error) => Next::Reply(error),
        }
    })
}

/// The writes that turn `coll`'s elements `old` into `new`, keeping the head where it is:
/// positions from the first that differs are rewritten, and those past the new end deleted.
fn rewrite_ops(coll: &Coll, old: &[Vec<u8>], new: Vec<Vec<u8>>) -> Vec<BatchOp> {
    let first = old.iter().zip(&new).take_while(|(a, b)| a == b).count();
    let mut ops = Vec::new();
    let new_len = new.len();
    for (at, value) in new.into_iter().enumerate().skip(first) {
        ops.push(BatchOp::Put { key: list_key(&coll.id, index_of(coll, at as u64)), value });
    }
    for at in new_len..old.len() {
        ops.push(BatchOp::Delete { key: list_key(&coll.id, index_of(coll, at as u64)) });
    }
    if new_len == 0 {
        ops.extend(coll.list_meta_ops(coll.head(), 0));
    } else {
        ops.extend(coll.list_meta_ops(coll.head(), new_len));
    }
    ops
}

fn lrem(call: &mut Call<'_>) -> Outcome {
    let Some(count) = parse_i64(&call.args[2]) else { return Outcome::error(NOT_INTEGER) };
    let element = call.args[3].clone();
    with_all_elements(call, move |coll, old| {
        // Which positions go: the first |count| matches from the head (count > 0) or the tail
        // (count < 0), or all of them (0).
        let matches: Vec<usize> = (0..old.len()).filter(|&at| old[at] == element).collect();
        let limit = if count == 0 { usize::MAX } else { count.unsigned_abs() as usize };
        let removed: Vec<usize> = if count >= 0 {
            matches.into_iter().take(limit).collect()
        } else {
            matches.into_iter().rev().take(limit).collect()
        };
        if removed.is_empty() {
            return Ok((Vec::new(), Reply::Integer(0)));
        }
        let gone: std::collections::HashSet<usize> = removed.iter().copied().collect();
        let new: Vec<Vec<u8>> = old
            .iter()
            .enumerate()
            .filter(|(at, _)| !gone.contains(at))
            .map(|(_, v)| v.clone())
            .collect();
        Ok((rewrite_ops(coll, &old, new), Reply::Integer(removed.len() as i64)))
    })
}

fn linsert(call: &mut Call<'_>) -> Outcome {
    let after = match call.word(2).as_str() {
        "before" => false,
        "after" => true,
        _ => return Outcome::error(SYNTAX),
    };
    let pivot = call.args[3].clone();
    let element = call.args[4].clone();
    if let Err(error) = check_element(&element) {
        return Outcome::Reply(error);
    }
    // No blocked client to wake: LINSERT adds only to a list that has elements.
    with_all_elements(call, move |coll, old| {
        if !coll.exists() {
            return Ok((Vec::new(), Reply::Integer(0)));
        }
        let Some(found) = old.iter().position(|value| *value == pivot) else {
            return Ok((Vec::new(), Reply::Integer(-1)));
        };
        let at = if after { found + 1 } else { found };
        // Move the shorter side by one: the elements before `at` one to the left (the head
        // moves), or those from `at` one to the right.
        let mut ops = Vec::new();
        if at <= old.len() / 2 {
            let new_head = coll.head().checked_sub(1).ok_or_else(|| {
                Reply::error("ERR the list's index space is exhausted at this end")
            })?;
            for (i, value) in old[..at].iter().enumerate() {
                let key = list_key(&coll.id, new_head.wrapping_add(i as u64));
                ops.push(BatchOp::Put { key, value: value.clone() });
            }
            let key = list_key(&coll.id, new_head.wrapping_add(at as u64));
            ops.push(BatchOp::Put { key, value: element.clone() });
            ops.extend(coll.list_meta_ops(new_head, old.len() + 1));
        } else {
            for (i, value) in old.iter().enumerate().skip(at) {
                let key = list_key(&coll.id, index_of(coll, i as u64 + 1));
                ops.push(BatchOp::Put { key, value: value.clone() });
            }
            let key = list_key(&coll.id, index_of(coll, at as u64));
            ops.push(BatchOp::Put { key, value: element.clone() });
            ops.extend(coll.list_meta_ops(coll.head(), old.len() + 1));
        }
        Ok((ops, Reply::Integer(old.len() as i64 + 1)))
    })
}

// -- LPOS ---------------------------------------------------------------------------------------

#[derive(Clone, Copy)]
struct PosOptions {
    rank: i64,
    count: Option<usize>,
    maxlen: usize,
}

fn pos_options(call: &Call<'_>) -> Result<PosOptions, Reply> {
    let mut options = PosOptions { rank: 1, count: None, maxlen: 0 };
    let mut at = 3;
    while at < call.args.len() {
        let word = call.word(at);
        let Some(value) = call.args.get(at + 1) else { return Err(Reply::error(SYNTAX)) };
        let number = || parse_i64(value).ok_or_else(|| Reply::error(NOT_INTEGER));
        match word.as_str() {
            "rank" => {
                let rank = number()?;
                if rank == i64::MIN {
                    return Err(Reply::Error(format!(
                        "ERR value is out of range, value must between {} and {}",
                        -i64::MAX,
                        i64::MAX
                    )));
                }
                if rank == 0 {
                    return Err(Reply::error(
                        "ERR RANK can't be zero: use 1 to start from the first match, 2 from the second ... or use negative to start from the end of the list",
                    ));
                }
                options.rank = rank;
            }
            "count" => {
                let count = number()?;
                if count < 0 {
                    return Err(Reply::error("ERR COUNT can't be negative"));
                }
                options.count = Some(count as usize);
            }
            "maxlen" => {
                let maxlen = number()?;
                if maxlen < 0 {
                    return Err(Reply::error("ERR MAXLEN can't be negative"));
                }
                options.maxlen = maxlen as usize;
            }
            _ => return Err(Reply::error(SYNTAX)),
        }
        at += 2;
    }
    Ok(options)
}

fn lpos(call: &mut Call<'_>) -> Outcome {
    let options = match pos_options(call) {
        Ok(options) => options,
        Err(error) => return Outcome::Reply(error),
    };
    let element = call.args[2].clone();
    // Compared as they are read, never held: a scan of any length stays in bounded memory.
    let mut elements = Elements::new(call.server, false);
    // The walk's direction and the list's length, to turn a step's elements into positions.
    let mut backwards = false;
    let mut len = 0;
    let mut found: Vec<i64> = Vec::new();
    let mut skip = options.rank.unsigned_abs() as usize - 1;
    let wanted = match options.count {
        None => 1,
        Some(0) => usize::MAX,
        Some(count) => count,
    };
    let done = move |found: &mut Vec<i64>| match options.count {
        None => found.first().map_or(Reply::Null, |&at| Reply::Integer(at)),
        Some(_) => Reply::Array(std::mem::take(found).into_iter().map(Reply::Integer).collect()),
    };
    on_collection(call, KeyType::List, move |_, input, coll| {
        match input {
            Input::Start => {
                len = coll.count();
                let scanned = if options.maxlen == 0 { len } else { options.maxlen.min(len) };
                backwards = options.rank < 0;
                if backwards {
                    elements.walk(coll, len.saturating_sub(1), scanned, true);
                } else {
                    elements.walk(coll, 0, scanned, false);
                }
            }
            Input::Read(results) => {
                let values = match elements.take(results) {
                    Ok(values) => values,
                    Err(error) => return Next::Reply(error),
                };
                for (value, step_at) in values.iter().zip(elements.asked.clone()) {
                    let at = if backwards { len - 1 - step_at } else { step_at };
                    if *value != element {
                        continue;
                    }
                    if skip > 0 {
                        skip -= 1;
                        continue;
                    }
                    found.push(at as i64);
                    if found.len() >= wanted {
                        return Next::Reply(done(&mut found));
                    }
                }
            }
            Input::Written => return unexpected(),
        }
        match elements.next() {
            Some(read) => read,
            None => Next::Reply(done(&mut found)),
        }
    })
}

// -- LMOVE --------------------------------------------------------------------------------------

fn ends(call: &Call<'_>, at: usize) -> Result<(End, End), Reply> {
    match (End::parse(&call.word(at)), End::parse(&call.word(at + 1))) {
        (Some(from), Some(to)) => Ok((from, to)),
        _ => Err(Reply::error(SYNTAX)),
    }
}

fn lmove(call: &mut Call<'_>) -> Outcome {
    match ends(call, 3) {
        Ok((from, to)) => move_plan(call, from, to),
        Err(error) => Outcome::Reply(error),
    }
}

fn rpoplpush(call: &mut Call<'_>) -> Outcome {
    move_plan(call, End::Right, End::Left)
}

fn move_plan(call: &Call<'_>, from: End, to: End) -> Outcome {
    let (source, destination) = (call.args[1].clone(), call.args[2].clone());
    for key in [&source, &destination] {
        if let Err(error) = check_list_key(key) {
            return Outcome::Reply(error);
        }
    }
    let server = call.server.clone();
    Outcome::AfterPending(Box::pin(async move {
        move_once(&server, &source, &destination, from, to).await
    }))
}

/// One LMOVE: Null if the source is empty. Both keys in one shard: one exec holding both locks.
/// Across shards: the source's end element is read, then one cross-shard batch pops it (if the
/// source is as it was read; else it is read again) and pushes it to the destination.
async fn move_once(
    server: &Arc<Server>,
    source: &[u8],
    destination: &[u8],
    from: End,
    to: End,
) -> Reply {
    let db = &server.db;
    let reply = if db.shard_of(source) == db.shard_of(destination) {
        run_outcome(db, move_in_shard(db, source.to_vec(), destination.to_vec(), from, to)).await
    } else {
        let mut attempts = 0;
        loop {
            match move_across(db, source, destination, from, to).await {
                Some(reply) => break reply,
                None if attempts < LMOVE_ATTEMPTS_MAX => {
                    // Another client took this end's element first: let it finish, then look
                    // again.
                    attempts += 1;
                    tokio::task::yield_now().await;
                }
                None => break Reply::error(
                    "ERR LMOVE gave up: the source list kept changing under it; nothing was moved",
                ),
            }
        }
    };
    if matches!(reply, Reply::Bulk(_)) {
        server.waiters.wake(Kind::List, super::namespace::current_number(), destination);
    }
    reply
}

/// The state an LMOVE exec in one shard reads: both lists' expiries and meta items.
fn move_in_shard(db: &Db, source: Vec<u8>, destination: Vec<u8>, from: End, to: End) -> Outcome {
    let shard = db.shard_of(&source);
    let mut plan = Plan::new();
    let same = source == destination;
    let mut state: Option<(super::Expiry, super::Expiry)> = None;
    let mut colls: Option<(Coll, Option<Coll>)> = None;
    let mut pending = None;
    plan.add(shard, vec![source.clone(), destination.clone()], move |view, input| match input {
        Input::Start => {
            let (source_expiry, source_read) = match coll_begin(view, &source, KeyType::List) {
                Ok(begun) => begun,
                Err(error) => return Next::Reply(error),
            };
            let Some(source_read) = source_read else { return Next::Reply(Reply::Null) };
            let (destination_expiry, destination_read) = if same {
                (super::Expiry::default(), None)
            } else {
                match coll_begin(view, &destination, KeyType::List) {
                    Ok(begun) => begun,
                    Err(error) => return Next::Reply(error),
                }
            };
            state = Some((source_expiry, destination_expiry));
            let mut reads = smallvec::smallvec![source_read];
            reads.extend(destination_read);
            Next::Read(reads)
        }
        Input::Read(mut results) if colls.is_none() => {
            let Some((source_expiry, destination_expiry)) = state.take() else {
                return unexpected();
            };
            let destination_meta = if results.len() == 2 { results.pop() } else { None };
            let source_meta = match coll_meta(results.pop()) {
                Ok(meta) => meta,
                Err(error) => return Next::Reply(error),
            };
            let source_coll =
                coll_make(view, source.clone(), KeyType::List, source_expiry, source_meta);
            let destination_coll = if same {
                None
            } else {
                let meta = match destination_meta {
                    Some(result) => match coll_meta(Some(result)) {
                        Ok(meta) => meta,
                        Err(error) => return Next::Reply(error),
                    },
                    None => None,
                };
                Some(coll_make(view, destination.clone(), KeyType::List, destination_expiry, meta))
            };
            let read = ReadOp::Get(list_key(&source_coll.id, end_index(&source_coll, from)));
            colls = Some((source_coll, destination_coll));
            Next::Read(smallvec::smallvec![read])
        }
        Input::Read(mut results) => {
            let Some((source_coll, destination_coll)) = colls.as_ref() else { return unexpected() };
            let Some(element) = value_of(results.pop()) else { return unexpected() };
            let ops = match destination_coll {
                Some(destination_coll) => {
                    let mut ops = pop_ops(source_coll, from, 1);
                    match push_ops(destination_coll, to, std::slice::from_ref(&element)) {
                        Ok((pushed, _)) => ops.extend(pushed),
                        Err(error) => return Next::Reply(error),
                    }
                    ops
                }
                None => match rotate_ops(source_coll, from, to, &element) {
                    Ok(ops) => ops,
                    Err(error) => return Next::Reply(error),
                },
            };
            pending = Some(Reply::Bulk(element));
            Next::Write(ops)
        }
        Input::Written => answer(&mut pending),
    });
    plan.finish(Box::new(|mut replies| replies.pop().unwrap_or(Reply::Null)))
}

/// LMOVE of a list onto itself: the element leaves one end and joins the other (or the same,
/// changing nothing).
fn rotate_ops(coll: &Coll, from: End, to: End, element: &[u8]) -> Result<Vec<BatchOp>, Reply> {
    if from == to || coll.count() == 1 {
        return Ok(Vec::new());
    }
    let count = coll.count() as u64;
    let exhausted = || Reply::error("ERR the list's index space is exhausted at this end");
    let (gone, added, new_head) = match from {
        // The first element becomes the last.
        End::Left => {
            let added = coll.head().checked_add(count).ok_or_else(exhausted)?;
            (coll.head(), added, coll.head() + 1)
        }
        // The last element becomes the first.
        End::Right => {
            let added = coll.head().checked_sub(1).ok_or_else(exhausted)?;
            (coll.head() + count - 1, added, added)
        }
    };
    let mut ops = vec![
        BatchOp::Delete { key: list_key(&coll.id, gone) },
        BatchOp::Put { key: list_key(&coll.id, added), value: element.to_vec() },
    ];
    ops.extend(coll.list_meta_ops(new_head, coll.count()));
    Ok(ops)
}

/// One attempt of LMOVE across shards: Some(answer), or None when the source changed between
/// the read and the batch (try again).
async fn move_across(
    db: &Db,
    source: &[u8],
    destination: &[u8],
    from: End,
    to: End,
) -> Option<Reply> {
    // 1. The source's end element, its index and the list's version, as they are now.
    let read = run_outcome(db, read_end(db, source.to_vec(), from)).await;
    let (version, read_index, element) = match read {
        Reply::Array(mut parts) if parts.len() == 3 => {
            match (parts.pop(), parts.pop(), parts.pop()) {
                (
                    Some(Reply::Bulk(element)),
                    Some(Reply::Integer(end)),
                    Some(Reply::Integer(version)),
                ) => (version as u64, end as u64, element),
                _ => return Some(Reply::error("ERR internal error: LMOVE read")),
            }
        }
        other => return Some(other),
    };
    // 2. One cross-shard batch: the source pops its end element if it is still the one read
    // (same version, same end index, same bytes: then popping it now is the same move, whatever
    // else changed, such as a push at the other end), and the destination pushes it.
    let mut plan = super::AtomicPlan::new();
    let (source_key, destination_key) = (source.to_vec(), destination.to_vec());
    let source_shard = db.shard_of(source);
    let destination_shard = db.shard_of(destination);
    let expected = element.clone();
    plan.add(source_shard, vec![source_key.clone()], move |vote| {
        let mut vote = Some(vote);
        let mut expiry = super::Expiry::default();
        let mut coll: Option<Coll> = None;
        move |view: &View<'_>, input| match input {
            Input::Start => match coll_begin(view, &source_key, KeyType::List) {
                Ok((found, Some(read))) => {
                    expiry = found;
                    Next::Read(smallvec::smallvec![read])
                }
                _ => refuse(&mut vote, "changed"),
            },
            Input::Read(mut results) if coll.is_none() => {
                let meta = match coll_meta(results.pop()) {
                    Ok(Some(meta)) => meta,
                    _ => return refuse(&mut vote, "changed"),
                };
                let now = coll_make(
                    view,
                    source_key.clone(),
                    KeyType::List,
                    std::mem::take(&mut expiry),
                    Some(meta),
                );
                let now_end = end_index(&now, from);
                if meta.version != version || now_end != read_index {
                    return refuse(&mut vote, "changed");
                }
                let read = ReadOp::Get(list_key(&now.id, now_end));
                coll = Some(now);
                Next::Read(smallvec::smallvec![read])
            }
            Input::Read(mut results) => {
                let (Some(now), Some(value)) = (coll.as_ref(), value_of(results.pop())) else {
                    return refuse(&mut vote, "changed");
                };
                if value != expected {
                    return refuse(&mut vote, "changed");
                }
                let Some(vote) = vote.take() else { return unexpected() };
                Next::Prepare(vote, pop_ops(now, from, 1))
            }
            Input::Written => Next::Reply(Reply::ok()),
        }
    });
    let pushed = element.clone();
    plan.add(destination_shard, vec![destination_key.clone()], move |vote| {
        let mut vote = Some(vote);
        let mut expiry = super::Expiry::default();
        let push = move |view: &View<'_>,
                         key: &[u8],
                         expiry: super::Expiry,
                         meta,
                         vote: &mut Option<copse::exec::Vote>| {
            let coll = coll_make(view, key.to_vec(), KeyType::List, expiry, meta);
            match push_ops(&coll, to, std::slice::from_ref(&pushed)) {
                Ok((ops, _)) => match vote.take() {
                    Some(vote) => Next::Prepare(vote, ops),
                    None => unexpected(),
                },
                Err(error) => {
                    if let Some(vote) = vote.take() {
                        vote.refuse(copse::WriteError::Aborted("the destination is full".into()));
                    }
                    Next::Reply(error)
                }
            }
        };
        move |view: &View<'_>, input| match input {
            Input::Start => match coll_begin(view, &destination_key, KeyType::List) {
                Ok((found, Some(read))) => {
                    expiry = found;
                    Next::Read(smallvec::smallvec![read])
                }
                Ok((found, None)) => push(view, &destination_key, found, None, &mut vote),
                Err(error) => {
                    if let Some(vote) = vote.take() {
                        vote.refuse(copse::WriteError::Aborted("wrong type".into()));
                    }
                    Next::Reply(error)
                }
            },
            Input::Read(mut results) => match coll_meta(results.pop()) {
                Ok(meta) => {
                    push(view, &destination_key, std::mem::take(&mut expiry), meta, &mut vote)
                }
                Err(error) => {
                    if let Some(vote) = vote.take() {
                        vote.refuse(copse::WriteError::Aborted("unreadable meta".into()));
                    }
                    Next::Reply(error)
                }
            },
            Input::Written => Next::Reply(Reply::ok()),
        }
    });
    let combined = run_outcome(
        db,
        plan.finish(
            db,
            Box::new(move |replies: Vec<Reply>| {
                // The source's part first (queued in shard order, answered in plan order).
                let mut replies = replies.into_iter();
                let (source_reply, destination_reply) = (replies.next(), replies.next());
                match (source_reply, destination_reply) {
                    (Some(Reply::Simple(_)), Some(Reply::Simple(_))) => Reply::Bulk(element),
                    (_, Some(Reply::Error(error)))
                        if error.starts_with("WRONGTYPE") || !error.contains("aborted") =>
                    {
                        Reply::Error(error)
                    }
                    (Some(Reply::Simple(word)), _) if word == "CHANGED" => {
                        Reply::Simple("CHANGED".into())
                    }
                    (Some(Reply::Error(error)), _) if !error.contains("aborted") => {
                        Reply::Error(error)
                    }
                    _ => Reply::Simple("CHANGED".into()),
                }
            }),
        ),
    )
    .await;
    match combined {
        Reply::Simple(word) if word == "CHANGED" => None,
        other => Some(other),
    }
}

/// The source part of a cross-shard LMOVE found its list changed since it was read: refuses the
/// batch, and answers so that the move is tried again.
fn refuse(vote: &mut Option<copse::exec::Vote>, why: &str) -> Next {
    if let Some(vote) = vote.take() {
        vote.refuse(copse::WriteError::Aborted(why.into()));
    }
    Next::Reply(Reply::Simple("CHANGED".into()))
}

/// Reads list `key`'s element at `end`: `[version, end index, element]`, Null if the key is
/// missing, or WRONGTYPE.
fn read_end(db: &Db, key: Vec<u8>, end: End) -> Outcome {
    let shard = db.shard_of(&key);
    let mut plan = Plan::new();
    let mut at: Option<(u64, u64)> = None;
    let mut expiry = super::Expiry::default();
    plan.add(shard, vec![key.clone()], move |view, input| match input {
        Input::Start => match coll_begin(view, &key, KeyType::List) {
            Ok((found, Some(read))) => {
                expiry = found;
                Next::Read(smallvec::smallvec![read])
            }
            Ok((_, None)) => Next::Reply(Reply::Null),
            Err(error) => Next::Reply(error),
        },
        Input::Read(mut results) if at.is_none() => {
            let meta = match coll_meta(results.pop()) {
                Ok(Some(meta)) => meta,
                Ok(None) => return unexpected(),
                Err(error) => return Next::Reply(error),
            };
            let coll = coll_make(
                view,
                key.clone(),
                KeyType::List,
                std::mem::take(&mut expiry),
                Some(meta),
            );
            let index = end_index(&coll, end);
            at = Some((meta.version, index));
            Next::Read(smallvec::smallvec![ReadOp::Get(list_key(&coll.id, index))])
        }
        Input::Read(mut results) => match (at.take(), value_of(results.pop())) {
            (Some((version, index)), Some(element)) => Next::Reply(Reply::Array(vec![
                // Carried as integers of the same 64 bits (cast back by the caller).
                Reply::Integer(version as i64),
                Reply::Integer(index as i64),
                Reply::Bulk(element),
            ])),
            _ => unexpected(),
        },
        Input::Written => unexpected(),
    });
    plan.finish(Box::new(|mut replies| replies.pop().unwrap_or(Reply::Null)))
}

// -- LMPOP and the blocking pops -----------------------------------------------------------------

/// What a multi-key pop asks: its keys, the end, and how many elements (None: one, BLPOP's
/// `[key, element]` reply; Some: LMPOP's `[key, [elements]]`).
struct MultiPop {
    keys: Vec<Vec<u8>>,
    end: End,
    count: Option<usize>,
}

/// LMPOP's arguments from `at` (numkeys): numkeys, keys, LEFT|RIGHT, [COUNT n].
fn parse_mpop(call: &Call<'_>, at: usize) -> Result<MultiPop, Reply> {
    let (keys, end_at, count) = super::parse_multi_pop(call, at)?;
    let Some(end) = End::parse(&call.word(end_at)) else { return Err(Reply::error(SYNTAX)) };
    for key in &keys {
        check_list_key(key)?;
    }
    Ok(MultiPop { keys, end, count: Some(count) })
}

/// Tries each key of `pop` in order: the first that holds a list answers.
async fn try_pop(server: &Arc<Server>, pop: &MultiPop, one: bool) -> Option<Reply> {
    for key in &pop.keys {
        let outcome =
            pop_with(server, key.clone(), pop.end, pop.count, Reply::NullArray, |_, popped| {
                Reply::Array(popped.into_iter().map(Reply::Bulk).collect())
            });
        let reply = run_outcome(&server.db, outcome).await;
        match reply {
            Reply::NullArray | Reply::Null => continue,
            Reply::Array(elements) => {
                let key = Reply::Bulk(key.clone());
                return Some(if one {
                    match elements.into_iter().next() {
                        Some(element) => Reply::Array(vec![key, element]),
                        None => continue,
                    }
                } else {
                    Reply::Array(vec![key, Reply::Array(elements)])
                });
            }
            error => return Some(error),
        }
    }
    None
}

fn lmpop(call: &mut Call<'_>) -> Outcome {
    let pop = match parse_mpop(call, 1) {
        Ok(pop) => pop,
        Err(error) => return Outcome::Reply(error),
    };
    let server = call.server.clone();
    Outcome::AfterPending(Box::pin(async move {
        try_pop(&server, &pop, false).await.unwrap_or(Reply::NullArray)
    }))
}

/// A blocking command's timeout in seconds (0: forever), as Redis parses it.
pub(super) fn parse_timeout(bytes: &[u8]) -> Result<Option<Duration>, Reply> {
    let seconds = parse_f64(bytes)
        .filter(|seconds| seconds.is_finite())
        .ok_or_else(|| Reply::error("ERR timeout is not a float or out of range"))?;
    // Past what milliseconds in a signed 64-bit integer hold, Redis 7.0's conversion wraps
    // negative: its answer is kept.
    if seconds < 0.0 || seconds * 1000.0 >= i64::MAX as f64 {
        return Err(Reply::error("ERR timeout is negative"));
    }
    Ok((seconds > 0.0).then(|| Duration::from_secs_f64(seconds)))
}

/// Runs `attempt` until it answers, blocking between tries on `keys` (in arrival order with
/// the other clients blocked on them, `waiters.rs`) until `timeout`, then answers Null.
pub(super) async fn blocking<F, Fut>(
    server: Arc<Server>,
    kind: Kind,
    keys: Vec<Vec<u8>>,
    timeout: Option<Duration>,
    mut attempt: F,
) -> Reply
where
    F: FnMut(Arc<Server>) -> Fut,
    Fut: std::future::Future<Output = Option<Reply>>,
{
    let redis_keys = keys;
    let mut namespace = super::namespace::current_number();
    let queue_keys = |namespace: u8| -> Vec<Vec<u8>> {
        redis_keys.iter().map(|key| queue_key(kind, namespace, key)).collect()
    };
    let mut keys = queue_keys(namespace);
    // A deadline past what the clock can hold is no deadline: it never comes.
    let deadline = timeout.and_then(|timeout| tokio::time::Instant::now().checked_add(timeout));
    // A newcomer tries at once, unless clients already wait on one of its keys: they go first.
    if !server.waiters.anyone_waiting_on(&keys) {
        if let Some(reply) = attempt(server.clone()).await {
            return reply;
        }
    }
    // Dropped on every way out (served, timed out, connection gone): leaves the queues and
    // passes its turn on.
    let mut registration = server.waiters.register(&keys);
    loop {
        // After a SWAPDB the client's database may be another namespace: it waits there now
        // (at the back of its queues, which it joins anew).
        let now = super::namespace::current_number();
        if now != namespace {
            namespace = now;
            keys = queue_keys(namespace);
            drop(registration);
            registration = server.waiters.register(&keys);
        }
        // Only the first in line on one of its keys tries (always once right after
        // registering: an element may have come in between).
        if server.waiters.is_first_anywhere(&registration.waiter, &keys) {
            if let Some(reply) = attempt(server.clone()).await {
                return reply;
            }
        }
        // A wake between the try and here is kept by `Notify` as a permit.
        let woken = registration.waiter.notify.notified();
        match deadline {
            Some(deadline) => {
                if tokio::time::timeout_at(deadline, woken).await.is_err() {
                    return Reply::NullArray;
                }
            }
            None => woken.await,
        }
    }
}

fn blocking_pop(call: &mut Call<'_>, end: End) -> Outcome {
    let timeout = match parse_timeout(&call.args[call.args.len() - 1]) {
        Ok(timeout) => timeout,
        Err(error) => return Outcome::Reply(error),
    };
    let keys: Vec<Vec<u8>> = call.args[1..call.args.len() - 1].to_vec();
    for key in &keys {
        if let Err(error) = check_list_key(key) {
            return Outcome::Reply(error);
        }
    }
    let pop = Arc::new(MultiPop { keys: keys.clone(), end, count: Some(1) });
    let server = call.server.clone();
    Outcome::AfterPending(Box::pin(blocking(server, Kind::List, keys, timeout, move |server| {
        let pop = pop.clone();
        async move { try_pop(&server, &pop, true).await }
    })))
}

fn blpop(call: &mut Call<'_>) -> Outcome {
    blocking_pop(call, End::Left)
}

fn brpop(call: &mut Call<'_>) -> Outcome {
    blocking_pop(call, End::Right)
}

fn blmpop(call: &mut Call<'_>) -> Outcome {
    let timeout = match parse_timeout(&call.args[1]) {
        Ok(timeout) => timeout,
        Err(error) => return Outcome::Reply(error),
    };
    let pop = match parse_mpop(call, 2) {
        Ok(pop) => Arc::new(pop),
        Err(error) => return Outcome::Reply(error),
    };
    let keys = pop.keys.clone();
    let server = call.server.clone();
    Outcome::AfterPending(Box::pin(blocking(server, Kind::List, keys, timeout, move |server| {
        let pop = pop.clone();
        async move { try_pop(&server, &pop, false).await }
    })))
}

fn blocking_move(call: &Call<'_>, from: End, to: End, timeout_at: usize) -> Outcome {
    let timeout = match parse_timeout(&call.args[timeout_at]) {
        Ok(timeout) => timeout,
        Err(error) => return Outcome::Reply(error),
    };
    let (source, destination) = (call.args[1].clone(), call.args[2].clone());
    for key in [&source, &destination] {
        if let Err(error) = check_list_key(key) {
            return Outcome::Reply(error);
        }
    }
    let server = call.server.clone();
    let keys = vec![source.clone()];
    Outcome::AfterPending(Box::pin(blocking(server, Kind::List, keys, timeout, move |server| {
        let (source, destination) = (source.clone(), destination.clone());
        async move {
            match move_once(&server, &source, &destination, from, to).await {
                Reply::Null => None,
                reply => Some(reply),
            }
        }
    })))
}

fn blmove(call: &mut Call<'_>) -> Outcome {
    match ends(call, 3) {
        Ok((from, to)) => blocking_move(call, from, to, 5),
        Err(error) => Outcome::Reply(error),
    }
}

fn brpoplpush(call: &mut Call<'_>) -> Outcome {
    blocking_move(call, End::Right, End::Left, 3)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_follow_redis_index_rules() {
        assert_eq!(range_window(0, -1, 5), 0..5);
        assert_eq!(range_window(-2, -1, 5), 3..5);
        assert_eq!(range_window(1, 100, 5), 1..5);
        assert_eq!(range_window(3, 1, 5), 0..0);
        assert_eq!(range_window(5, 10, 5), 0..0);
        assert_eq!(range_window(-100, 0, 5), 0..1);
        assert_eq!(range_window(0, -1, 0), 0..0);
        assert_eq!(range_window(i64::MIN, i64::MAX, 3), 0..3);
        assert_eq!(position(-1, 3), Some(2));
        assert_eq!(position(3, 3), None);
        assert_eq!(position(-4, 3), None);
        assert_eq!(position(i64::MIN, 3), None);
    }

    #[test]
    fn a_list_key_fits_exactly_when_its_element_items_fit() {
        let key = vec![b'k'; LIST_KEY_BYTES_MAX];
        assert_eq!(list_key(&keyspace::collection_id(&key, 1), 0).len(), KEY_BYTES_MAX);
        assert!(check_list_key(&key).is_ok());
        assert!(check_list_key(&[b'k'; LIST_KEY_BYTES_MAX + 1]).is_err());
        assert_eq!(keyspace::TAG_LIST, b'l');
    }
}
