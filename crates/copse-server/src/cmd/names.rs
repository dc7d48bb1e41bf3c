//! Long Redis keys: every key argument becomes its stored name at dispatch, and the name items
//! of surrogates are kept beside their meta items at the exec boundary.
//!
//! A Redis key may be up to `REDIS_KEY_BYTES_MAX` (1 MiB) bytes, an item key at most 1024. So
//! every item embeds the key's *stored name* (`keyspace::stored_name`): the key itself when it
//! is short and does not start with `SURROGATE_PREFIX`, else a *surrogate*, the prefix and the
//! key's SHA-256. `dispatch` converts each key argument of every command once, where it checks
//! its length (`convert_keys`, at the positions `KeyPositions` gives: the table's, or the keys a
//! numkeys argument counts), so command code, item-key builders, routing (`Db::shard_of`),
//! locks, waiters, the access clock and the collectors all work on names and never see a long
//! key. A command whose arguments have no surrogate pays one length and prefix test per key.
//!
//! The Redis key of a surrogate lives in its *name item* (`keyspace::name_key`), which
//! `maintain` adds to the write batches as they leave a command's exec (`CommandExec::step`,
//! after the namespace translation, so raw execs such as MOVE and COPY ... DB are covered
//! alike): a batch that puts a surrogate's meta item also puts its name item, with the key
//! taken from the command's own conversion (`Names`, carried into
//! every exec the command builds as the namespace is: `current`, `scope`, `bind`); a batch that
//! deletes a surrogate's meta item and puts none also deletes its name item. Background
//! deletions (active expiry, FLUSHDB, the orphan collector) delete meta items only through
//! execs too, so they take the name items with them; none of them needs the key.
//!
//! Replies that name keys turn names back into keys: SCAN, KEYS and RANDOMKEY read the name
//! items of the surrogates they list (`keys.rs`, `inspect.rs`); the pops that name the key they
//! popped from (BLPOP, LMPOP, BZPOPMIN, ZMPOP, ...) use the command's own `Names`
//! (`key_back_in_reply`).
//!
//! Invariants:
//! - A surrogate has a name item exactly while it has a meta item, in the same namespace: the
//!   two are written or deleted in one batch.
//! - A command's `Names` holds the key of every surrogate among its arguments, so any meta item
//!   it writes for a surrogate can have its name item (a batch that would put one without it
//!   is refused: `maintain` errs, nothing is written).

use std::cell::RefCell;
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use copse::BatchOp;

use super::namespace::NAMESPACE_FIRST_BYTE_MIN;
use super::Spec;
use crate::keyspace::{self, REDIS_KEY_BYTES_MAX};
use crate::resp::Reply;

/// The surrogates among one command's key arguments, each with its Redis key.
#[derive(Debug, Default)]
pub struct Names {
    keys: HashMap<Vec<u8>, Vec<u8>>,
}

impl Names {
    /// The Redis key of surrogate `name`, if the command named it.
    pub fn key_of(&self, name: &[u8]) -> Option<&[u8]> {
        self.keys.get(name).map(Vec::as_slice)
    }
}

thread_local! {
    /// The names of the command being handled on this thread (`scope`), read by the exec
    /// programs it builds. None outside any command and for a command of short keys only.
    static CURRENT: RefCell<Option<Arc<Names>>> = const { RefCell::new(None) };
}

/// The names of the command being handled on this thread.
pub fn current() -> Option<Arc<Names>> {
    CURRENT.with(|current| current.borrow().clone())
}

/// Runs `f` with `names` as the current command's names.
pub fn scope<R>(names: Option<Arc<Names>>, f: impl FnOnce() -> R) -> R {
    let previous = CURRENT.with(|current| current.replace(names));
    let result = f();
    CURRENT.with(|current| *current.borrow_mut() = previous);
    result
}

/// `future`, polled with `names` as the current names (the execs it builds later carry them).
pub fn bind<F: Future>(names: Arc<Names>, future: F) -> WithNames<F> {
    WithNames { names, future: Box::pin(future) }
}

/// A future polled with a command's names (`bind`).
pub struct WithNames<F: Future> {
    names: Arc<Names>,
    future: Pin<Box<F>>,
}

impl<F: Future> Future for WithNames<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = &mut *self;
        scope(Some(this.names.clone()), || this.future.as_mut().poll(cx))
    }
}

/// Commands whose keys are counted by a numkeys argument, not at fixed positions: (name,
/// positions of keys before numkeys, position of numkeys). Their table positions are
/// Redis's COMMAND answer, which covers non-key words (LEFT, COUNT) or nothing at all.
const NUMKEYS_COMMANDS: &[(&str, &[usize], usize)] = &[
    ("blmpop", &[], 2),
    ("bzmpop", &[], 2),
    ("eval", &[], 2),
    ("eval_ro", &[], 2),
    ("evalsha", &[], 2),
    ("evalsha_ro", &[], 2),
    ("lmpop", &[], 1),
    ("sintercard", &[], 1),
    ("zdiff", &[], 1),
    ("zdiffstore", &[1], 2),
    ("zinter", &[], 1),
    ("zintercard", &[], 1),
    ("zinterstore", &[1], 2),
    ("zmpop", &[], 1),
    ("zunion", &[], 1),
    ("zunionstore", &[1], 2),
];

/// How a command's key arguments are found (`Spec::keys`, filled in when the table is built).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeySpec {
    /// Redis's (first, last, step) of the table.
    Positions,
    /// Keys at these positions, then the keys counted by the numkeys argument at this position.
    Numkeys(&'static [usize], usize),
}

/// The key spec of the command named `name`.
pub fn key_spec_of(name: &str) -> KeySpec {
    match NUMKEYS_COMMANDS.iter().find(|(command, _, _)| *command == name) {
        Some(&(_, fixed, numkeys_at)) => KeySpec::Numkeys(fixed, numkeys_at),
        None => KeySpec::Positions,
    }
}

/// The positions of a command's key arguments, in order (no allocation: this runs per request).
pub struct KeyPositions {
    fixed: &'static [usize],
    at: usize,
    end: usize,
    step: usize,
}

impl KeyPositions {
    pub fn of(spec: &Spec, args: &[Vec<u8>]) -> KeyPositions {
        let count = args.len();
        match spec.keys {
            KeySpec::Positions if spec.first_key > 0 => {
                let last = if spec.last_key < 0 {
                    count as i64 + spec.last_key as i64
                } else {
                    spec.last_key as i64
                };
                let end = (last + 1).clamp(0, count as i64) as usize;
                let step = spec.key_step.max(1) as usize;
                KeyPositions { fixed: &[], at: spec.first_key as usize, end, step }
            }
            KeySpec::Positions => KeyPositions { fixed: &[], at: 0, end: 0, step: 1 },
            KeySpec::Numkeys(fixed, numkeys_at) => {
                // A numkeys the command will refuse names no key: nothing is converted.
                let first = numkeys_at + 1;
                let numkeys = args
                    .get(numkeys_at)
                    .and_then(|arg| super::parse_i64(arg))
                    .filter(|&n| n > 0)
                    .map_or(0, |n| (n as u64).min(count as u64) as usize);
                let end = (first + numkeys).min(count);
                KeyPositions { fixed, at: first, end, step: 1 }
            }
        }
    }
}

impl Iterator for KeyPositions {
    type Item = usize;

    fn next(&mut self) -> Option<usize> {
        if let Some((&first, rest)) = self.fixed.split_first() {
            self.fixed = rest;
            return Some(first);
        }
        if self.at >= self.end {
            return None;
        }
        let at = self.at;
        self.at += self.step;
        Some(at)
    }
}

/// Refuses a Redis key longer than copse serves: the same error for every command, read or
/// write, before anything runs.
pub fn check_key_length(key: &[u8]) -> Result<(), Reply> {
    if key.len() > REDIS_KEY_BYTES_MAX {
        return Err(Reply::Error(format!(
            "ERR key of {} bytes is too long (copse keys are at most {REDIS_KEY_BYTES_MAX} bytes); nothing was changed",
            key.len()
        )));
    }
    Ok(())
}

/// Checks every key argument of `spec` in `args` and replaces each one that needs a surrogate
/// by it. Calls `each` with every key's stored name (the access clock). Returns the surrogates'
/// keys, None when there are none (nearly every command: nothing allocated).
pub fn convert_keys(
    spec: &Spec,
    args: &mut [Vec<u8>],
    mut each: impl FnMut(&[u8]),
) -> Result<Option<Arc<Names>>, Reply> {
    let mut names: Option<Names> = None;
    for at in KeyPositions::of(spec, args) {
        let key = &mut args[at];
        check_key_length(key)?;
        if keyspace::needs_surrogate(key) {
            let name = keyspace::stored_name(key).into_owned();
            let key = std::mem::replace(key, name.clone());
            names.get_or_insert_with(Names::default).keys.insert(name, key);
        }
        each(&args[at]);
    }
    Ok(names.map(Arc::new))
}

/// The namespace prefix and stored name of a stored item key that is the meta item of a
/// surrogate, else None.
fn surrogate_meta(stored: &[u8]) -> Option<(&[u8], &[u8])> {
    let split = usize::from(stored.first().is_some_and(|&byte| byte < NAMESPACE_FIRST_BYTE_MIN));
    let (prefix, item) = stored.split_at(split);
    match keyspace::decode_meta(item) {
        Some((_, name, _)) if keyspace::is_surrogate(name) => Some((prefix, name)),
        _ => None,
    }
}

/// Adds to `ops` (stored item keys, as they go to the engine) the name items its meta items of
/// surrogates call for (module header): a batch that puts a surrogate's meta item puts its name
/// item too, and one that deletes the meta item and puts none deletes the name item. Always,
/// whatever the index says: a batch is one sequence number, so the last batch that touched a
/// meta item touched its name item alike, even when it raced a writer that holds no lock on the
/// key (FLUSHDB; a review found a flush racing a SET that left a meta item without its name when
/// the name item was put only if missing). The cost is a long key's bytes rewritten with each
/// write of its meta item. Err (nothing to write) when a meta item of a surrogate is put and the
/// command did not name its key: no command does. Linear in the batch.
pub fn maintain(ops: &mut Vec<BatchOp>, names: Option<&Names>) -> Result<(), Reply> {
    // The common batch has no surrogate at all: one look at each op's first bytes.
    if !ops.iter().any(|op| surrogate_meta(op.key()).is_some()) {
        return Ok(());
    }
    // Name item as stored -> (the surrogate, whether a meta item of it is put, whether the batch
    // names the name item itself), in first-seen order so the batch comes out the same every time.
    let mut touched: HashMap<Vec<u8>, (&[u8], bool, bool)> = HashMap::new();
    let mut order: Vec<Vec<u8>> = Vec::new();
    for op in ops.iter() {
        let Some((prefix, name)) = surrogate_meta(op.key()) else { continue };
        let mut item = prefix.to_vec();
        item.extend_from_slice(&keyspace::name_key(name));
        let put = matches!(op, BatchOp::Put { .. });
        match touched.get_mut(&item) {
            Some(entry) => entry.1 |= put,
            None => {
                order.push(item.clone());
                touched.insert(item, (name, put, false));
            }
        }
    }
    for op in ops.iter() {
        if let Some(entry) = touched.get_mut(op.key()) {
            entry.2 = true;
        }
    }
    let mut added = Vec::new();
    for item in order {
        let (name, put, named) = touched[&item];
        // A batch that names a name item itself (FLUSHDB's) decides it.
        if named {
            continue;
        }
        if put {
            let Some(key) = names.and_then(|names| names.key_of(name)) else {
                return Err(Reply::error(
                    "ERR internal error: a long key's meta item would be written without its name; nothing was changed",
                ));
            };
            added.push(BatchOp::Put { key: item, value: key.to_vec() });
        } else {
            added.push(BatchOp::Delete { key: item });
        }
    }
    ops.extend(added);
    Ok(())
}

/// The error of a listing that met a surrogate with no name item (module invariant 1 broken).
pub const NAME_ITEM_MISSING: &str =
    "ERR internal error: a long key has no name item (the key space breaks its invariants; please report it)";

/// Meta items listed per step of `prefixed_key_in_store`'s walk (index only).
const UPGRADE_METAS_PER_STEP: usize = 10_000;

/// A key of a store of format 6 or earlier that format 7 stores under a surrogate (it starts
/// with `SURROGATE_PREFIX`, or it is longer than `NAME_INLINE_BYTES_MAX`: 1014 bytes was allowed
/// in database 0), as (namespace, key), if any: format 7 would look it up under another name, so
/// such a store cannot be upgraded (net/mod.rs refuses it; a review found a 1014-byte key listed
/// but unreadable after the upgrade). Walks every meta item of every namespace once, from the
/// indexes.
pub async fn prefixed_key_in_store(db: &copse::Db) -> Result<Option<(u8, Vec<u8>)>, Reply> {
    use super::namespace::{prefixed, Namespace, DATABASES};
    for shard in 0..db.shard_count() {
        for number in 0..DATABASES as u8 {
            let start = prefixed(number, &keyspace::meta_scan_start(0));
            let end = prefixed(number, &keyspace::meta_scan_end());
            let mut after = None;
            loop {
                let walk = super::shard_keys(
                    db,
                    shard,
                    (&start, &end),
                    after.take(),
                    UPGRADE_METAS_PER_STEP,
                );
                let metas = Namespace::raw().bind(walk).await?;
                for meta in &metas {
                    let item = &meta[usize::from(number > 0)..];
                    if let Some((_, key, _)) = keyspace::decode_meta(item) {
                        if keyspace::needs_surrogate(key) {
                            return Ok(Some((number, key.to_vec())));
                        }
                    }
                }
                if metas.len() < UPGRADE_METAS_PER_STEP {
                    break;
                }
                after = metas.last().cloned();
            }
        }
    }
    Ok(None)
}

/// Commands whose reply names the key they popped from, first in its array.
pub const REPLIES_NAMING_A_KEY: &[&str] =
    &["blmpop", "blpop", "brpop", "bzmpop", "bzpopmax", "bzpopmin", "lmpop", "zmpop"];

/// `reply` with its first element, a key's stored name, shown as the client's key.
pub fn key_back_in_reply(reply: Reply, names: &Names) -> Reply {
    match reply {
        Reply::Array(mut items) => {
            if let Some(Reply::Bulk(name)) = items.first_mut() {
                if let Some(key) = names.key_of(name) {
                    *name = key.to_vec();
                }
            }
            Reply::Array(items)
        }
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keyspace::{stored_name, NAME_INLINE_BYTES_MAX, SURROGATE_PREFIX};

    fn args(words: &[&[u8]]) -> Vec<Vec<u8>> {
        words.iter().map(|word| word.to_vec()).collect()
    }

    #[test]
    fn stored_names_are_inline_up_to_the_limit_and_surrogates_past_it() {
        let inline = vec![b'k'; NAME_INLINE_BYTES_MAX];
        assert_eq!(&*stored_name(&inline), &inline[..]);
        let long = vec![b'k'; NAME_INLINE_BYTES_MAX + 1];
        let name = stored_name(&long);
        assert_eq!(name.len(), keyspace::SURROGATE_NAME_BYTES);
        assert!(keyspace::is_surrogate(&name));
        assert_eq!(&*stored_name(&long), &*name, "a pure function of the key");
        assert_ne!(&*stored_name(&vec![b'k'; NAME_INLINE_BYTES_MAX + 2]), &*name);
        // A short key that starts with the prefix is a surrogate too: never taken for one.
        let mut lookalike = SURROGATE_PREFIX.to_vec();
        lookalike.extend_from_slice(&[0; 32]);
        let name = stored_name(&lookalike);
        assert!(keyspace::is_surrogate(&name) && *name != lookalike[..]);
        assert_eq!(&*stored_name(b"\xff\xc0#"), b"\xff\xc0#", "a part of the prefix is not it");
        assert_eq!(&*stored_name(b""), b"");
        // The meta item of the longest inline name fits an item key in every namespace.
        assert_eq!(
            keyspace::meta_key(&inline, keyspace::KeyType::String).len() + 1,
            copse::limits::KEY_BYTES_MAX
        );
        // The documented example (docs/format/redis-keyspace.md).
        let example = stored_name(&[b'a'; 2000]).into_owned();
        assert_eq!(
            example[..],
            hex("ff c0 23 4e c4 a7 00 f8 5b 7e 9e 5c db dc 51 17 04 09 ee 2a d4 8b eb e2 f2 \
                 f0 95 7a 06 79 37 53 1a 0a 3c 42")[..]
        );
    }

    fn hex(text: &str) -> Vec<u8> {
        text.split_whitespace().map(|b| u8::from_str_radix(b, 16).unwrap()).collect()
    }

    fn positions(words: &[&[u8]]) -> Vec<usize> {
        let args = args(words);
        let spec = super::super::find_ignoring_case(words[0]).unwrap();
        KeyPositions::of(spec, &args).collect()
    }

    #[test]
    fn key_positions_are_the_keys_and_nothing_else() {
        assert_eq!(positions(&[b"get", b"k"]), [1]);
        assert_eq!(positions(&[b"mset", b"a", b"1", b"b", b"2"]), [1, 3]);
        assert_eq!(positions(&[b"del", b"a", b"b", b"c"]), [1, 2, 3]);
        assert_eq!(positions(&[b"blpop", b"a", b"b", b"0"]), [1, 2]);
        assert_eq!(positions(&[b"lmpop", b"2", b"a", b"b", b"left", b"count", b"3"]), [2, 3]);
        assert_eq!(positions(&[b"blmpop", b"0", b"1", b"a", b"right"]), [3]);
        assert_eq!(positions(&[b"zmpop", b"1", b"a", b"min"]), [2]);
        assert_eq!(positions(&[b"bzmpop", b"0", b"2", b"a", b"b", b"max"]), [3, 4]);
        assert_eq!(
            positions(&[b"zunionstore", b"d", b"2", b"a", b"b", b"weights", b"1", b"2"]),
            [1, 3, 4]
        );
        assert_eq!(positions(&[b"zinter", b"2", b"a", b"b", b"withscores"]), [2, 3]);
        assert_eq!(positions(&[b"zintercard", b"1", b"a", b"limit", b"5"]), [2]);
        assert_eq!(positions(&[b"sintercard", b"2", b"a", b"b", b"limit", b"1"]), [2, 3]);
        assert_eq!(positions(&[b"zdiff", b"x", b"a"]), Vec::<usize>::new(), "bad numkeys");
        assert_eq!(positions(&[b"zdiff", b"9", b"a"]), [2], "numkeys past the arguments");
        assert_eq!(positions(&[b"ping"]), Vec::<usize>::new());
        assert_eq!(positions(&[b"object", b"encoding", b"k"]), [2]);
    }

    #[test]
    fn keys_are_converted_once_and_refused_past_the_limit() {
        let long = vec![b'x'; 70_000];
        let spec = super::super::find("mset").unwrap();
        let mut words = args(&[b"mset", &long, &long, b"short", b"v"]);
        let mut seen = Vec::new();
        let names = convert_keys(spec, &mut words, |name| seen.push(name.to_vec())).unwrap();
        let names = names.expect("a surrogate");
        let name = stored_name(&long).into_owned();
        assert_eq!(words[1], name);
        assert_eq!(words[2], long, "a value is no key");
        assert_eq!(words[3], b"short");
        assert_eq!(names.key_of(&name), Some(&long[..]));
        assert_eq!(seen, [name.clone(), b"short".to_vec()]);
        let mut short = args(&[b"get", b"k"]);
        assert!(convert_keys(super::super::find("get").unwrap(), &mut short, |_| {})
            .unwrap()
            .is_none());
        let mut over = args(&[b"get", &vec![b'x'; REDIS_KEY_BYTES_MAX + 1]]);
        let error = convert_keys(super::super::find("get").unwrap(), &mut over, |_| {});
        assert!(error.is_err());
        assert_eq!(over[1].len(), REDIS_KEY_BYTES_MAX + 1, "a refused key is left as it was");
        assert!(check_key_length(&vec![b'x'; REDIS_KEY_BYTES_MAX]).is_ok());
        // The popped key is shown as the client wrote it.
        let reply = Reply::Array(vec![Reply::Bulk(name), Reply::Bulk(b"v".to_vec())]);
        match key_back_in_reply(reply, &names) {
            Reply::Array(items) => assert!(matches!(&items[0], Reply::Bulk(key) if *key == long)),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn meta_items_of_surrogates_are_found_in_every_namespace() {
        let name = stored_name(&[b'y'; 5000]).into_owned();
        let meta = keyspace::meta_key(&name, keyspace::KeyType::Hash);
        assert_eq!(surrogate_meta(&meta), Some((&b""[..], &name[..])));
        let mut in_three = vec![3];
        in_three.extend_from_slice(&meta);
        assert_eq!(surrogate_meta(&in_three), Some((&b"\x03"[..], &name[..])));
        assert_eq!(surrogate_meta(&keyspace::meta_key(b"short", keyspace::KeyType::Hash)), None);
        assert_eq!(surrogate_meta(&keyspace::orphans_key(&name)), None);
        assert_eq!(surrogate_meta(keyspace::MARKER_KEY), None);
    }
}
