//! Commands that describe a key rather than use it: OBJECT (ENCODING, REFCOUNT, IDLETIME,
//! FREQ, HELP), MEMORY USAGE and RANDOMKEY.
//!
//! OBJECT ENCODING answers the encoding Redis 7.0 would give the key's contents under the
//! encoding knobs CONFIG SET left (`context::ENCODING_KNOBS`): clients and test suites branch on
//! it, and copse's own layout (one item per element) has no such names. Redis converts one way
//! only (a hash that grew past the knobs stays a hashtable when it shrinks); copse decides from
//! the contents now. OBJECT IDLETIME reads the access clock (`context::AccessClock`). MEMORY
//! USAGE answers the bytes the key takes in copse: its items' keys and values, each with its
//! record header and index entry, collections estimated from a sample as Redis does.

use copse::exec::ReadOp;

use super::objects::{SnapshotReader, Step, Value};
use super::{
    bound_ref, keyspace, on_key, parse_i64, run_outcome, stored_type, unexpected, value_of, Call,
    Expiry, Input, KeyTarget, Next, Outcome, Plan, Spec, View, NOT_INTEGER, SYNTAX,
};
use crate::context::Server;
use crate::keyspace::{CollectionMeta, KeyType};
use crate::resp::Reply;

/// What each item costs copse besides its key and value: the record header (32 B,
/// docs/format/slab.md) and its index entry (35.6 B per item measured at 10M items,
/// docs/benchmarks.md).
pub const ITEM_OVERHEAD_BYTES: usize = 68;
/// Elements MEMORY USAGE samples when SAMPLES is not given (Redis's default).
pub const MEMORY_SAMPLES_DEFAULT: usize = 5;
/// The most elements MEMORY USAGE samples (SAMPLES 0 asks for all of them).
pub const MEMORY_SAMPLES_MAX: usize = copse::limits::EXEC_READS_MAX;
/// Redis's shared integers (0 .. this) answer OBJECT REFCOUNT with `i32::MAX`.
const SHARED_INTEGERS: i64 = 10_000;
/// The longest string Redis keeps as `embstr`.
const EMBSTR_BYTES_MAX: usize = 44;

const NOT_LFU: &str = "ERR An LFU maxmemory policy is not selected, access frequency not tracked. Please note that when switching between policies at runtime LRU and LFU data will take some time to adjust.";

pub fn specs() -> Vec<Spec> {
    let spec = |name, arity, flags, keys, summary, handler| {
        Spec::new("generic", name, arity, flags, keys, summary, handler)
    };
    const R: &[&str] = &["readonly"];
    vec![
        spec("object", -2, R, (2, 2, 1), "Inspects a key's value.", object as _),
        spec("memory", -2, R, (2, 2, 1), "Reports memory use.", memory as _),
        spec("randomkey", 1, R, (0, 0, 0), "Returns a random key.", randomkey as _),
    ]
}

const OBJECT_HELP: &[&str] = &[
    "OBJECT <subcommand> [<arg> [value] [opt] ...]. Subcommands are:",
    "ENCODING <key>",
    "    Return the kind of internal representation used in order to store the value",
    "    associated with a <key>.",
    "FREQ <key>",
    "    Return the access frequency index of the <key>. The returned integer is",
    "    proportional to the logarithm of the recent access frequency of the key.",
    "IDLETIME <key>",
    "    Return the idle time of the <key>, that is the approximated number of",
    "    seconds elapsed since the last access to the key.",
    "REFCOUNT <key>",
    "    Return the number of references of the value associated with the specified",
    "    <key>.",
    "HELP",
    "    Prints this help.",
];

const MEMORY_HELP: &[&str] = &[
    "MEMORY <subcommand> [<arg> [value] [opt] ...]. Subcommands are:",
    "USAGE <key> [SAMPLES <count>]",
    "    Return memory in bytes used by <key> and its value. Nested values are",
    "    sampled up to <count> times (default: 5, 0 means sample all).",
    "HELP",
    "    Prints this help.",
];

fn help(lines: &[&'static str]) -> Outcome {
    Outcome::Reply(Reply::Array(lines.iter().map(|line| Reply::Simple((*line).into())).collect()))
}

/// The reply to a subcommand called with the wrong number of arguments, or an unknown one.
fn subcommand_error(command: &str, sub: &str, known: bool) -> Outcome {
    match known {
        true => {
            Outcome::error(format!("ERR wrong number of arguments for '{command}|{sub}' command"))
        }
        false => Outcome::error(format!(
            "ERR unknown subcommand '{sub}'. Try {} HELP.",
            command.to_ascii_uppercase()
        )),
    }
}

fn object(call: &mut Call<'_>) -> Outcome {
    let sub = call.word(1);
    let known = ["encoding", "refcount", "idletime", "freq", "help"].contains(&sub.as_str());
    let arity_ok = if sub == "help" { call.args.len() == 2 } else { call.args.len() == 3 };
    if !known || !arity_ok {
        let shown = String::from_utf8_lossy(&call.args[1]).into_owned();
        return subcommand_error("object", if known { &sub } else { &shown }, known);
    }
    if sub == "help" {
        return help(OBJECT_HELP);
    }
    let key = call.args[2].clone();
    let idle_s = call.server.access.idle_s(&key, call.server.access_clock_s());
    let knobs = Knobs::of(call.server);
    let uncounted = super::namespace::Namespace::current().uncounted();
    let reply_bytes_max =
        call.server.settings.client_output_bytes_max.load(std::sync::atomic::Ordering::Relaxed);
    let mut reader = SnapshotReader::for_reply(key.clone(), reply_bytes_max);
    on_key(KeyTarget::of(call.db(), &key), move |view, input| {
        let step = match input {
            Input::Start => {
                let live = Expiry::of(view, &key).live(stored_type(view, &key));
                view.note_lookup(live.is_some());
                let Some(ty) = live else {
                    return Next::Reply(Reply::Null);
                };
                match sub.as_str() {
                    "idletime" => return Next::Reply(Reply::Integer(idle_s as i64)),
                    "freq" => return Next::Reply(Reply::error(NOT_LFU)),
                    "refcount" if ty != KeyType::String => return Next::Reply(Reply::Integer(1)),
                    "encoding" if ty == KeyType::List => {
                        return Next::Reply(Reply::Bulk(b"quicklist".to_vec()))
                    }
                    // Looked up above: the reader's own lookup is not counted again.
                    _ => reader.start(&view.in_namespace(&uncounted)),
                }
            }
            Input::Read(results) => {
                // Past the knobs' count, the contents do not matter: no element is read.
                let meta = match results.first() {
                    Some(copse::exec::ReadResult::Value(Some(meta))) => Some(meta.clone()),
                    _ => None,
                };
                if let Some(big) = meta.and_then(|meta| knobs.past_count(&key, view, &meta)) {
                    return Next::Reply(Reply::Bulk(big.as_bytes().to_vec()));
                }
                reader.resume(view, results)
            }
            Input::Written => return unexpected(),
        };
        match step {
            Step::Read(reads) => Next::Read(reads),
            Step::Failed(error) => Next::Reply(error),
            Step::Done(None) => Next::Reply(Reply::Null),
            Step::Done(Some(snapshot)) => match snapshot.value() {
                Some(value) if sub == "refcount" => Next::Reply(Reply::Integer(refcount(&value))),
                Some(value) => Next::Reply(Reply::Bulk(knobs.encoding(&value).as_bytes().to_vec())),
                None => Next::Reply(Reply::error(super::CORRUPT_META)),
            },
        }
    })
}

/// A string Redis would keep as an integer (`string2ll`: no sign but '-', no leading zero, no
/// space, at most 20 bytes, within i64).
fn as_redis_integer(bytes: &[u8]) -> Option<i64> {
    if bytes.is_empty() || bytes.len() > 20 {
        return None;
    }
    let digits = bytes.strip_prefix(b"-").unwrap_or(bytes);
    let canonical = !digits.is_empty()
        && digits.iter().all(u8::is_ascii_digit)
        && (digits == b"0" || digits[0] != b'0')
        && bytes != b"-0";
    canonical.then(|| std::str::from_utf8(bytes).ok()?.parse().ok()).flatten()
}

fn refcount(value: &Value) -> i64 {
    match value {
        Value::String(bytes) => match as_redis_integer(bytes) {
            Some(number) if (0..SHARED_INTEGERS).contains(&number) => i32::MAX as i64,
            _ => 1,
        },
        _ => 1,
    }
}

/// The encoding knobs as a command read them.
struct Knobs {
    hash_entries: i64,
    hash_value: i64,
    zset_entries: i64,
    zset_value: i64,
    intset_entries: i64,
}

impl Knobs {
    fn of(server: &Server) -> Knobs {
        let knobs = &server.settings.encoding;
        Knobs {
            hash_entries: knobs.get("hash-max-listpack-entries"),
            hash_value: knobs.get("hash-max-listpack-value"),
            zset_entries: knobs.get("zset-max-listpack-entries"),
            zset_value: knobs.get("zset-max-listpack-value"),
            intset_entries: knobs.get("set-max-intset-entries"),
        }
    }

    /// The encoding of a collection whose count alone decides it (None: its contents do).
    fn past_count(&self, key: &[u8], view: &View<'_>, meta: &[u8]) -> Option<&'static str> {
        let ty = stored_type(view, key)?;
        let count = CollectionMeta::decode(meta)?.count as i64;
        match ty {
            KeyType::Hash if count > self.hash_entries => Some("hashtable"),
            KeyType::ZSet if count > self.zset_entries => Some("skiplist"),
            KeyType::Set if count > self.intset_entries => Some("hashtable"),
            _ => None,
        }
    }

    fn encoding(&self, value: &Value) -> &'static str {
        let fits = |bytes: &[u8], most: i64| bytes.len() as i64 <= most;
        match value {
            Value::String(bytes) if as_redis_integer(bytes).is_some() => "int",
            Value::String(bytes) if bytes.len() <= EMBSTR_BYTES_MAX => "embstr",
            Value::String(_) => "raw",
            Value::List(_) => "quicklist",
            Value::Hash(pairs)
                if pairs.len() as i64 <= self.hash_entries
                    && pairs.iter().all(|(field, value)| {
                        fits(field, self.hash_value) && fits(value, self.hash_value)
                    }) =>
            {
                "listpack"
            }
            Value::Hash(_) => "hashtable",
            Value::Set(members)
                if members.len() as i64 <= self.intset_entries
                    && members.iter().all(|member| as_redis_integer(member).is_some()) =>
            {
                "intset"
            }
            Value::Set(_) => "hashtable",
            Value::ZSet(pairs)
                if pairs.len() as i64 <= self.zset_entries
                    && pairs.iter().all(|(member, _)| fits(member, self.zset_value)) =>
            {
                "listpack"
            }
            Value::ZSet(_) => "skiplist",
        }
    }
}

fn memory(call: &mut Call<'_>) -> Outcome {
    let sub = call.word(1);
    match sub.as_str() {
        "help" if call.args.len() == 2 => return help(MEMORY_HELP),
        "usage" if call.args.len() >= 3 => {}
        "help" | "usage" => return subcommand_error("memory", &sub, true),
        _ => {
            let shown = String::from_utf8_lossy(&call.args[1]).into_owned();
            return subcommand_error("memory", &shown, false);
        }
    }
    let mut samples = MEMORY_SAMPLES_DEFAULT;
    let mut at = 3;
    while at < call.args.len() {
        match call.word(at).as_str() {
            "samples" if at + 1 < call.args.len() => match parse_i64(&call.args[at + 1]) {
                Some(0) => samples = MEMORY_SAMPLES_MAX,
                Some(count) if count > 0 => samples = (count as usize).min(MEMORY_SAMPLES_MAX),
                // As Redis: a negative count is a syntax error.
                Some(_) => return Outcome::error(SYNTAX),
                None => return Outcome::error(NOT_INTEGER),
            },
            _ => return Outcome::error(SYNTAX),
        }
        at += 2;
    }
    let key = call.args[2].clone();
    // A long key's name item holds the key (`names.rs`): its bytes count too.
    let name_item_bytes = super::names::current()
        .and_then(|names| names.key_of(&key).map(|long| long.len()))
        .map_or(0, |long| keyspace::name_key(&key).len() + long + ITEM_OVERHEAD_BYTES);
    let mut ty = KeyType::String;
    let mut meta_bytes = 0;
    let mut count = 0u64;
    let mut sampled_keys = 0usize;
    on_key(KeyTarget::of(call.db(), &key), move |view, input| match input {
        Input::Start => match Expiry::of(view, &key).live(stored_type(view, &key)) {
            None => Next::Reply(Reply::Null),
            Some(found) => {
                ty = found;
                Next::Read(smallvec::smallvec![ReadOp::Get(keyspace::meta_key(&key, ty))])
            }
        },
        Input::Read(results) if meta_bytes == 0 => {
            let meta = value_of(results.into_iter().next()).unwrap_or_default();
            meta_bytes = keyspace::META_OVERHEAD_BYTES
                + key.len()
                + meta.len()
                + ITEM_OVERHEAD_BYTES
                + name_item_bytes;
            let (Some(tag), Some(collection)) = (ty.element_tag(), CollectionMeta::decode(&meta))
            else {
                return Next::Reply(Reply::Integer(meta_bytes as i64));
            };
            count = collection.count;
            let id = keyspace::collection_id(&key, collection.version);
            let (start, end) = match ty {
                KeyType::List => {
                    let head = collection.head.unwrap_or(keyspace::LIST_HEAD_INITIAL);
                    keyspace::list_range(&id, head, head + collection.count)
                }
                _ => keyspace::id_range(tag, &id),
            };
            let items = view.keys(bound_ref(&start), bound_ref(&end), samples);
            if items.is_empty() {
                return Next::Reply(Reply::Integer(meta_bytes as i64));
            }
            sampled_keys = items.iter().map(Vec::len).sum::<usize>();
            Next::Read(items.into_iter().map(ReadOp::Get).collect())
        }
        Input::Read(results) => {
            let sampled = results.len();
            let values: usize = results
                .into_iter()
                .map(|result| value_of(Some(result)).map_or(0, |v| v.len()))
                .sum();
            let per_item =
                (sampled_keys + values) as f64 / sampled as f64 + ITEM_OVERHEAD_BYTES as f64;
            // A sorted set keeps two items per member (by member and by score).
            let items = if ty == KeyType::ZSet { count * 2 } else { count };
            Next::Reply(Reply::Integer(meta_bytes as i64 + (per_item * items as f64) as i64))
        }
        Input::Written => unexpected(),
    })
}

/// RANDOMKEY: a live key of the database, from a random shard at a random point of its SCAN
/// order (the next key from there, wrapping), or Null when the database is empty.
fn randomkey(call: &mut Call<'_>) -> Outcome {
    let db = call.db().clone();
    Outcome::AfterPending(Box::pin(async move {
        let shards = db.shard_count();
        let first = (super::random_u64() % shards as u64) as u32;
        let cursor = super::random_u64();
        for shard in (0..shards).map(|at| (first + at) % shards) {
            let mut plan = Plan::new();
            plan.add(shard, vec![], move |view, input| match input {
                Input::Start => match random_in_shard(view, cursor) {
                    // A surrogate: the client's key is in its name item.
                    Some(name) if keyspace::is_surrogate(&name) => {
                        let read = copse::exec::ReadOp::Get(keyspace::name_key(&name));
                        Next::Read(smallvec::smallvec![read])
                    }
                    Some(name) => Next::Reply(Reply::Bulk(name)),
                    None => Next::Reply(Reply::Null),
                },
                Input::Read(mut results) => match super::value_of(results.pop()) {
                    Some(key) => Next::Reply(Reply::Bulk(key)),
                    None => Next::Reply(Reply::error(super::names::NAME_ITEM_MISSING)),
                },
                Input::Written => unexpected(),
            });
            let combine = Box::new(|mut replies: Vec<Reply>| replies.pop().unwrap_or(Reply::Null));
            match run_outcome(&db, plan.finish(combine)).await {
                Reply::Null => continue,
                other => return other,
            }
        }
        Reply::Null
    }))
}

/// Keys RANDOMKEY looks at per step of its walk over one shard's meta items.
const RANDOMKEY_STEP_KEYS: usize = 64;

/// The stored name of the first live key of the shard at or after scan hash `cursor`, wrapping
/// to the first.
fn random_in_shard(view: &View<'_>, cursor: u64) -> Option<Vec<u8>> {
    let end = keyspace::meta_scan_end();
    for from in [cursor, 0] {
        let mut start = std::ops::Bound::Included(keyspace::meta_scan_start(from));
        loop {
            let items =
                view.keys(bound_ref(&start), std::ops::Bound::Excluded(&end), RANDOMKEY_STEP_KEYS);
            for item in &items {
                let Some((_, key, _)) = keyspace::decode_meta(item) else { continue };
                if !Expiry::of(view, key).expired() {
                    return Some(key.to_vec());
                }
            }
            match items.last() {
                Some(last) if items.len() == RANDOMKEY_STEP_KEYS => {
                    start = std::ops::Bound::Excluded(last.clone())
                }
                _ => break,
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integers_are_recognised_as_redis_does() {
        for (text, expected) in [
            ("0", Some(0)),
            ("123", Some(123)),
            ("-5", Some(-5)),
            ("9223372036854775807", Some(i64::MAX)),
            ("-9223372036854775808", Some(i64::MIN)),
        ] {
            assert_eq!(as_redis_integer(text.as_bytes()), expected, "{text}");
        }
        for text in ["", "-", "-0", "007", "+1", " 1", "1.0", "9223372036854775808", "1e3"] {
            assert_eq!(as_redis_integer(text.as_bytes()), None, "{text}");
        }
    }
}
