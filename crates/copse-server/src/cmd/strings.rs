//! String commands. A string is its meta item: the value is stored there, so a GET is one read
//! and a SET one write. Every read-modify-write (INCR, APPEND, SETRANGE, GETSET, ...) is one
//! exec holding the key's lock, so it is atomic and ordered with every other command on the key.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use super::View;
use copse::exec::{ReadOp, ReadResults};
use copse::BatchOp;

use super::{
    answer, by_shard, check_value, delete_ops, key_type, now_ms, on_key, on_key_grouped, one_batch,
    parse_f64, parse_i64, stored_collection_type, stored_type, ttl_ops, type_delete_ops,
    unexpected, value_of, Call, Expiry, Input, KeyTarget, Next, Outcome, Plan, Spec, NOT_FLOAT,
    NOT_INTEGER, SYNTAX, WRONGTYPE,
};
use crate::keyspace::{meta_key, KeyType};
use crate::resp::{format_double, Reply};

pub fn specs() -> Vec<Spec> {
    let spec = |name, arity, flags, first, last, step, summary, handler| {
        Spec::new("string", name, arity, flags, (first, last, step), summary, handler)
    };
    const W: &[&str] = &["write"];
    const R: &[&str] = &["readonly", "fast"];
    vec![
        spec("get", 2, R, 1, 1, 1, "Returns the string value of a key.", get as _),
        spec("set", -3, W, 1, 1, 1, "Sets the string value of a key.", set as _),
        spec("setex", 4, W, 1, 1, 1, "Sets a value and its expiry in seconds.", setex as _),
        spec("psetex", 4, W, 1, 1, 1, "Sets a value and its expiry in milliseconds.", psetex as _),
        spec(
            "getex",
            -2,
            W,
            1,
            1,
            1,
            "Returns a value and sets or removes its expiry.",
            getex as _,
        ),
        spec("setnx", 3, W, 1, 1, 1, "Sets a key's value only if it does not exist.", setnx as _),
        spec("getset", 3, W, 1, 1, 1, "Sets a key's value and returns the old one.", getset as _),
        spec("getdel", 2, W, 1, 1, 1, "Returns a key's value and deletes the key.", getdel as _),
        spec("mget", -2, R, 1, -1, 1, "Returns the values of several keys.", mget as _),
        spec("mset", -3, W, 1, -1, 2, "Sets several keys.", mset as _),
        spec("msetnx", -3, W, 1, -1, 2, "Sets several keys if none exists.", msetnx as _),
        spec("strlen", 2, R, 1, 1, 1, "Returns the length of a string value.", strlen as _),
        spec("append", 3, W, 1, 1, 1, "Appends to a string value.", append as _),
        spec("getrange", 4, R, 1, 1, 1, "Returns a substring of a string value.", getrange as _),
        spec("setrange", 4, W, 1, 1, 1, "Overwrites part of a string value.", setrange as _),
        spec("incr", 2, W, 1, 1, 1, "Increments an integer value by one.", incr as _),
        spec("decr", 2, W, 1, 1, 1, "Decrements an integer value by one.", decr as _),
        spec("incrby", 3, W, 1, 1, 1, "Increments an integer value.", incrby as _),
        spec("decrby", 3, W, 1, 1, 1, "Decrements an integer value.", decrby as _),
        spec("incrbyfloat", 3, W, 1, 1, 1, "Increments a float value.", incrbyfloat as _),
    ]
}

/// The first step of a command that reads string `key`: the read of its value item, asked
/// before the key's type. A string's read is then the key's one index lookup; the other types
/// are looked up (no I/O) only when it finds nothing (`string_or_wrongtype`).
fn read_string(key: &[u8]) -> Next {
    Next::Read(smallvec::smallvec![ReadOp::Get(meta_key(key, KeyType::String))])
}

/// What `read_string` found: the string's value, None for a missing key, or WRONGTYPE for a key
/// of another type (the exec holds the key's lock, so its type did not change between steps;
/// whether it expired is `expiry`'s decision at the exec's start, never a second clock reading).
fn string_or_wrongtype(
    view: &View<'_>,
    key: &[u8],
    expiry: &Expiry,
    results: &mut ReadResults,
) -> Result<Option<Vec<u8>>, Next> {
    match value_of(results.pop()) {
        Some(value) => {
            view.note_lookup(true);
            Ok(Some(value))
        }
        None if expiry.live(stored_type(view, key)).is_some() => {
            view.note_lookup(true);
            Err(Next::Reply(Reply::error(WRONGTYPE)))
        }
        None => {
            view.note_lookup(false);
            Ok(None)
        }
    }
}

/// Reads a string key: `done` gets its value (None if the key does not exist) and decides.
/// Any other type answers WRONGTYPE.
fn with_string<F>(call: &mut Call<'_>, mut done: F) -> Outcome
where
    F: FnMut(&View<'_>, Option<Vec<u8>>) -> Next + Send + 'static,
{
    // Taken from the request, not copied: the program reads with it.
    let key = std::mem::take(&mut call.args[1]);
    let mut expiry = Expiry::default();
    on_key(KeyTarget::of(call.db(), &key), move |view, input| match input {
        Input::Start => {
            // An expired key reads as missing, with no read (no lookup in a shard without
            // expiries).
            expiry = Expiry::of(view, &key);
            if expiry.expired() {
                view.note_lookup(false);
                return done(view, None);
            }
            read_string(&key)
        }
        Input::Read(mut results) => match string_or_wrongtype(view, &key, &expiry, &mut results) {
            Ok(value) => done(view, value),
            Err(wrongtype) => wrongtype,
        },
        Input::Written => unexpected(),
    })
}

/// What a write of a string does to the key's expiry.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum SetTtl {
    /// Removes it (SET, GETSET, MSET).
    #[default]
    Clear,
    /// Keeps it (SET ... KEEPTTL).
    Keep,
    /// Sets this deadline, Unix time in milliseconds.
    At(u64),
}

/// Writes `value` as string `key`, replacing whatever the key held: `existing` is its live type
/// and `expiry` its expiry as the exec found them (an expired key is deleted in the same batch).
fn put_string(
    key: &[u8],
    existing: Option<KeyType>,
    expiry: &Expiry,
    value: Vec<u8>,
    ttl: SetTtl,
) -> Vec<BatchOp> {
    let mut ops = Vec::new();
    if let Some(ty) = existing {
        if ty != KeyType::String {
            ops = type_delete_ops(key, ty);
        }
    }
    ops.push(BatchOp::Put { key: meta_key(key, KeyType::String), value });
    let deadline = match ttl {
        SetTtl::Clear => None,
        SetTtl::Keep => expiry.deadline_ms,
        SetTtl::At(deadline) => Some(deadline),
    };
    ops.extend(ttl_ops(key, expiry.deadline_ms, deadline));
    expiry.before(ops)
}

/// `put_string` of `value` over whatever `key` holds in `view`, its expiry removed (MSET).
fn overwrite(view: &View<'_>, key: &[u8], value: Vec<u8>) -> Vec<BatchOp> {
    let expiry = Expiry::of(view, key);
    put_string(key, expiry.live(stored_type(view, key)), &expiry, value, SetTtl::Clear)
}

/// The last write step, whose answer is fixed in advance (given once the write is durable).
fn write_then(ops: Vec<BatchOp>, reply: Reply, pending: &mut Option<Reply>) -> Next {
    *pending = Some(reply);
    Next::WriteLast(ops)
}

fn get(call: &mut Call<'_>) -> Outcome {
    with_string(call, |_, value| Next::Reply(value.map_or(Reply::Null, Reply::Bulk)))
}

#[derive(Default)]
struct SetOptions {
    nx: bool,
    xx: bool,
    get: bool,
    ttl: SetTtl,
}

/// The expiry options SET and GETEX take, as Redis 7.2 parses them.
#[derive(Clone, Copy, PartialEq, Eq)]
enum ExpiryUnit {
    /// EX: seconds from now.
    Seconds,
    /// PX: milliseconds from now.
    Milliseconds,
    /// EXAT: Unix time in seconds.
    UnixSeconds,
    /// PXAT: Unix time in milliseconds.
    UnixMilliseconds,
}

impl ExpiryUnit {
    fn parse(word: &str) -> Option<ExpiryUnit> {
        match word {
            "ex" => Some(ExpiryUnit::Seconds),
            "px" => Some(ExpiryUnit::Milliseconds),
            "exat" => Some(ExpiryUnit::UnixSeconds),
            "pxat" => Some(ExpiryUnit::UnixMilliseconds),
            _ => None,
        }
    }

    /// The deadline `amount` names, Unix time in milliseconds, or Redis's error for a
    /// non-positive amount or one whose deadline overflows (`command` names the command).
    fn deadline_ms(self, amount: &[u8], command: &str) -> Result<u64, Reply> {
        let amount = parse_i64(amount).ok_or_else(|| Reply::error(NOT_INTEGER))?;
        let invalid = || Reply::Error(format!("ERR invalid expire time in '{command}' command"));
        let seconds = matches!(self, ExpiryUnit::Seconds | ExpiryUnit::UnixSeconds);
        if amount <= 0 || (seconds && amount > i64::MAX / 1000) {
            return Err(invalid());
        }
        let ms = if seconds { amount * 1000 } else { amount };
        let ms = match self {
            ExpiryUnit::Seconds | ExpiryUnit::Milliseconds => {
                ms.checked_add(now_ms() as i64).ok_or_else(invalid)?
            }
            _ => ms,
        };
        Ok(ms as u64)
    }
}

fn set(call: &mut Call<'_>) -> Outcome {
    let mut options = SetOptions::default();
    // Redis accepts an option named twice (the last value wins), refuses two that conflict, and
    // checks the expiry's amount once every option parsed.
    let mut expire: Option<(usize, ExpiryUnit)> = None;
    let mut keep_ttl = false;
    let mut at = 3;
    while at < call.args.len() {
        let word = call.word(at);
        match (word.as_str(), ExpiryUnit::parse(&word)) {
            ("nx", _) if !options.xx => options.nx = true,
            ("xx", _) if !options.nx => options.xx = true,
            ("get", _) => options.get = true,
            ("keepttl", _) if expire.is_none() => keep_ttl = true,
            (_, Some(this))
                if !keep_ttl
                    && expire.is_none_or(|(_, unit)| unit == this)
                    && at + 1 < call.args.len() =>
            {
                expire = Some((at + 1, this));
                at += 1;
            }
            _ => return Outcome::error(SYNTAX),
        }
        at += 1;
    }
    if keep_ttl {
        options.ttl = SetTtl::Keep;
    }
    if let Some((at, unit)) = expire {
        if let Err(error) = check_expiring_key(&call.args[1]) {
            return Outcome::Reply(error);
        }
        match unit.deadline_ms(&call.args[at], "set") {
            Ok(deadline) => options.ttl = SetTtl::At(deadline),
            Err(reply) => return Outcome::Reply(reply),
        }
    }
    set_with(call, options, SetAnswer::Plain)
}

/// Refuses a key too long to carry an expiry (its expiry item must fit an item key): `key` is a
/// stored name, so only a key stored inline past `EXPIRY_KEY_BYTES_MAX` (1012 or 1013 bytes)
/// is refused; a longer one has a short surrogate name.
pub fn check_expiring_key(key: &[u8]) -> Result<(), Reply> {
    use crate::keyspace::{EXPIRY_KEY_BYTES_MAX, NAME_INLINE_BYTES_MAX};
    if key.len() > EXPIRY_KEY_BYTES_MAX {
        return Err(Reply::Error(format!(
            "ERR key of {} bytes cannot expire (a key of {} to {NAME_INLINE_BYTES_MAX} bytes is stored as it is and leaves no room for the deadline, while keys of at most {EXPIRY_KEY_BYTES_MAX} bytes and longer ones can); nothing was changed",
            key.len(),
            EXPIRY_KEY_BYTES_MAX + 1,
        )));
    }
    Ok(())
}

/// SETEX and PSETEX: SET with EX or PX, the amount before the value.
fn set_expiring(call: &mut Call<'_>, unit: ExpiryUnit) -> Outcome {
    if let Err(error) = check_expiring_key(&call.args[1]) {
        return Outcome::Reply(error);
    }
    let command = call.word(0);
    let deadline = match unit.deadline_ms(&call.args[2], &command) {
        Ok(deadline) => deadline,
        Err(reply) => return Outcome::Reply(reply),
    };
    call.args.swap(2, 3);
    let options = SetOptions { ttl: SetTtl::At(deadline), ..SetOptions::default() };
    set_with(call, options, SetAnswer::Plain)
}

fn setex(call: &mut Call<'_>) -> Outcome {
    set_expiring(call, ExpiryUnit::Seconds)
}

fn psetex(call: &mut Call<'_>) -> Outcome {
    set_expiring(call, ExpiryUnit::Milliseconds)
}

/// GETEX: the value, and its expiry set (EX, PX, EXAT, PXAT; a deadline already past deletes
/// the key) or removed (PERSIST); without an option, GET.
fn getex(call: &mut Call<'_>) -> Outcome {
    // None: leave the expiry; Some(None): PERSIST; Some(Some(amount, unit)).
    let mut change: Option<Option<(Vec<u8>, ExpiryUnit)>> = None;
    let mut at = 2;
    while at < call.args.len() {
        let word = call.word(at);
        match (word.as_str(), ExpiryUnit::parse(&word), &change) {
            ("persist", _, None | Some(None)) => change = Some(None),
            (_, Some(this), None) | (_, Some(this), Some(Some((_, _)))) => {
                if matches!(change, Some(Some((_, unit))) if unit != this) {
                    return Outcome::error(SYNTAX);
                }
                let Some(amount) = call.args.get(at + 1) else { return Outcome::error(SYNTAX) };
                change = Some(Some((amount.clone(), this)));
                at += 1;
            }
            _ => return Outcome::error(SYNTAX),
        }
        at += 1;
    }
    let key = std::mem::take(&mut call.args[1]);
    let mut pending = None;
    let mut expiry = Expiry::default();
    on_key(KeyTarget::of(call.db(), &key), move |view, input| match input {
        Input::Start => {
            expiry = Expiry::of(view, &key);
            if expiry.expired() {
                return Next::Reply(Reply::Null);
            }
            read_string(&key)
        }
        Input::Read(mut results) => {
            let value = match string_or_wrongtype(view, &key, &expiry, &mut results) {
                Ok(Some(value)) => value,
                Ok(None) => return Next::Reply(Reply::Null),
                Err(wrongtype) => return wrongtype,
            };
            let deadline = match &change {
                None => return Next::Reply(Reply::Bulk(value)),
                Some(None) => None,
                // Checked once the key is found, as Redis does.
                Some(Some((amount, unit))) => match unit.deadline_ms(amount, "getex") {
                    Ok(deadline) => match check_expiring_key(&key) {
                        Ok(()) => Some(deadline),
                        Err(reply) => return Next::Reply(reply),
                    },
                    Err(reply) => return Next::Reply(reply),
                },
            };
            // Only a Unix time can be past already (EX and PX count from now, and are positive).
            let absolute = matches!(
                change,
                Some(Some((_, ExpiryUnit::UnixSeconds | ExpiryUnit::UnixMilliseconds)))
            );
            let ops = match deadline {
                Some(deadline) if absolute && deadline <= now_ms() => {
                    delete_ops(&key, KeyType::String, &expiry)
                }
                deadline => ttl_ops(&key, expiry.deadline_ms, deadline),
            };
            if ops.is_empty() {
                return Next::Reply(Reply::Bulk(value));
            }
            write_then(ops, Reply::Bulk(value), &mut pending)
        }
        Input::Written => answer(&mut pending),
    })
}

enum SetAnswer {
    /// OK, or nil when NX/XX stopped it (with GET: the old value).
    Plain,
    /// SETNX: 1 if set, else 0.
    Flag,
}

/// SET and its variants: the value is argument 2.
fn set_with(call: &mut Call<'_>, options: SetOptions, kind: SetAnswer) -> Outcome {
    if let Err(reply) = check_value(&call.args[2]) {
        return Outcome::Reply(reply);
    }
    // Taken from the request, not copied: the value and the key are the arguments.
    let value = std::mem::take(&mut call.args[2]);
    let key = std::mem::take(&mut call.args[1]);
    let target = KeyTarget::of(call.db(), &key);
    let mut value = Some(value);
    let mut pending = None;
    // A plain SET reads nothing and answers OK once its write is durable: it may share a flush
    // with the SETs of the same key before it (a hot key). NX, XX and GET answer from the key.
    let grouped = !options.nx && !options.xx && !options.get;
    // The key's type and expiry, looked up once at the start (the exec holds the key's lock).
    let mut existing = None;
    let mut expiry = Expiry::default();
    on_key_grouped(target, grouped, move |view, input| {
        match input {
            Input::Start => {
                // A plain SET needs the key's type only to delete a hash's or sorted set's
                // items: in a shard that holds none, no lookup at all (one of ~4 per SET).
                expiry = Expiry::of(view, &key);
                existing = expiry.live(if grouped {
                    stored_collection_type(view, &key)
                } else {
                    stored_type(view, &key)
                });
                if options.get {
                    // The old value is looked up as a read, as Redis counts it (GETSET, SET ...
                    // GET; a plain SET notes nothing).
                    view.note_lookup(existing.is_some());
                }
                if options.get && existing.is_some_and(|ty| ty != KeyType::String) {
                    return Next::Reply(Reply::error(WRONGTYPE));
                }
                if options.get && existing == Some(KeyType::String) {
                    return Next::Read(smallvec::smallvec![ReadOp::Get(meta_key(
                        &key,
                        KeyType::String
                    ))]);
                }
                decide(&key, existing, &expiry, None, &options, &kind, &mut value, &mut pending)
            }
            Input::Read(mut results) => {
                let old = value_of(results.pop());
                decide(&key, existing, &expiry, old, &options, &kind, &mut value, &mut pending)
            }
            Input::Written => answer(&mut pending),
        }
    })
}

#[allow(clippy::too_many_arguments)]
fn decide(
    key: &[u8],
    existing: Option<KeyType>,
    expiry: &Expiry,
    old: Option<Vec<u8>>,
    options: &SetOptions,
    answer: &SetAnswer,
    value: &mut Option<Vec<u8>>,
    pending: &mut Option<Reply>,
) -> Next {
    let blocked = (options.nx && existing.is_some()) || (options.xx && existing.is_none());
    let (done, skipped) = match answer {
        SetAnswer::Flag => (Reply::Integer(1), Reply::Integer(0)),
        SetAnswer::Plain if options.get => {
            let old = old.map_or(Reply::Null, Reply::Bulk);
            (old.clone(), old)
        }
        SetAnswer::Plain => (Reply::ok(), Reply::Null),
    };
    if blocked {
        return Next::Reply(skipped);
    }
    let Some(value) = value.take() else { return unexpected() };
    let ops = put_string(key, existing, expiry, value, options.ttl);
    // Replacing a hash or sorted set deletes its meta item and writes its orphan record in the
    // same atomic batch as the new value; a value too large to share that batch is refused,
    // changing nothing.
    if let Err(reply) = super::check_batch(&ops) {
        return Next::Reply(reply);
    }
    write_then(ops, done, pending)
}

fn setnx(call: &mut Call<'_>) -> Outcome {
    let options = SetOptions { nx: true, ..SetOptions::default() };
    set_with(call, options, SetAnswer::Flag)
}

fn getset(call: &mut Call<'_>) -> Outcome {
    let options = SetOptions { get: true, ..SetOptions::default() };
    set_with(call, options, SetAnswer::Plain)
}

fn getdel(call: &mut Call<'_>) -> Outcome {
    let key = call.args[1].clone();
    let mut pending = None;
    let mut expiry = Expiry::default();
    on_key(KeyTarget::of(call.db(), &key), move |view, input| match input {
        Input::Start => {
            expiry = Expiry::of(view, &key);
            if expiry.expired() {
                view.note_lookup(false);
                return Next::Reply(Reply::Null);
            }
            read_string(&key)
        }
        Input::Read(mut results) => match string_or_wrongtype(view, &key, &expiry, &mut results) {
            Ok(Some(value)) => write_then(
                delete_ops(&key, KeyType::String, &expiry),
                Reply::Bulk(value),
                &mut pending,
            ),
            Ok(None) => Next::Reply(Reply::Null),
            Err(wrongtype) => wrongtype,
        },
        Input::Written => answer(&mut pending),
    })
}

/// MGET. Over several shards it reads until no cross-shard batch was decided meanwhile, so it
/// never sees half of an MSET (`Db::read_consistently`); it then runs after the connection's
/// earlier replies.
fn mget(call: &mut Call<'_>) -> Outcome {
    let keys: Vec<Vec<u8>> = call.args[1..].to_vec();
    let reply_bytes_max = call.server.settings.client_output_bytes_max.load(Ordering::Relaxed);
    let value_bytes_bound = call.server.value_bytes_bound.clone();
    // Inside EXEC the transaction's sequences read all shards at one moment already.
    if call.conn.in_exec || by_shard(call.db(), &keys).len() <= 1 {
        return mget_plan(call.db(), &keys, reply_bytes_max, &value_bytes_bound);
    }
    let db = call.db().clone();
    Outcome::AfterPending(Box::pin(async move {
        let read = db.read_consistently(|| async {
            Ok::<Reply, std::convert::Infallible>(
                crate::cmd::run_outcome(
                    &db,
                    mget_plan(&db, &keys, reply_bytes_max, &value_bytes_bound),
                )
                .await,
            )
        });
        match read.await {
            Ok(reply) => reply,
        }
    }))
}

/// The bytes of MGET's reply counted so far over all its shards, and the worst case of the
/// reads in flight; shared by its execs so that together they stop at the limit.
struct ReplyBudget {
    reply_bytes_max: usize,
    reply_bytes: AtomicUsize,
    reserved_bytes: AtomicUsize,
}

impl ReplyBudget {
    /// Bytes a shard may still read in one step without the reply passing the limit, counting
    /// what the other shards' reads in flight could add.
    fn room_bytes(&self) -> usize {
        let used = self.reply_bytes.load(Ordering::Acquire);
        let reserved = self.reserved_bytes.load(Ordering::Acquire);
        self.reply_bytes_max.saturating_sub(used.saturating_add(reserved))
    }
}

/// Bytes of a bulk reply of `len` bytes (`$<len>\r\n<bytes>\r\n`), or of a null one.
fn bulk_reply_bytes(value: Option<&[u8]>) -> usize {
    match value {
        Some(value) => value.len() + value.len().to_string().len() + 5,
        None => 5,
    }
}

/// MGET's execs, one per shard. A key named several times is read once and its value repeated
/// in the reply. Each shard reads its keys in steps no larger than the room left under
/// `reply_bytes_max` (one key at least), each key counted at the largest value the store may
/// hold (`value_bytes_bound`, read in the shard, after every write queued before this read)
/// for every position it fills, so an MGET whose reply would pass the limit stops with an
/// error having read at most the limit plus one largest value per shard, and nothing past the
/// limit is ever copied into a reply.
fn mget_plan(
    db: &copse::Db,
    keys: &[Vec<u8>],
    reply_bytes_max: usize,
    value_bytes_bound: &Arc<AtomicUsize>,
) -> Outcome {
    use copse::limits::{EXEC_READS_MAX, VALUE_BYTES_MAX};
    let mut distinct: Vec<Vec<u8>> = Vec::new();
    let mut repeats: Vec<usize> = Vec::new();
    let mut first_at: std::collections::HashMap<&[u8], usize> = std::collections::HashMap::new();
    let positions: Vec<usize> = keys
        .iter()
        .map(|key| {
            let at = *first_at.entry(&key[..]).or_insert_with(|| {
                distinct.push(key.clone());
                repeats.push(0);
                distinct.len() - 1
            });
            repeats[at] += 1;
            at
        })
        .collect();
    let budget = Arc::new(ReplyBudget {
        reply_bytes_max,
        reply_bytes: AtomicUsize::new(0),
        reserved_bytes: AtomicUsize::new(0),
    });
    let mut plan = Plan::new();
    let mut groups_at = Vec::new();
    for (shard, at) in by_shard(db, &distinct) {
        let group: Vec<Vec<u8>> = at.iter().map(|&i| distinct[i].clone()).collect();
        let group_repeats: Vec<usize> = at.iter().map(|&i| repeats[i]).collect();
        groups_at.push(at);
        let budget = budget.clone();
        let value_bytes_bound = value_bytes_bound.clone();
        let mut values: Vec<Option<Vec<u8>>> = Vec::new();
        let mut strings: Vec<bool> = Vec::new();
        let mut next = 0;
        let mut asked: Vec<usize> = Vec::new();
        let mut asked_bytes = 0;
        plan.add(shard, group.clone(), move |view, input| {
            match input {
                Input::Start => {
                    // MGET answers nil for a key of another type, with no read.
                    strings = group
                        .iter()
                        .map(|key| key_type(view, key) == Some(KeyType::String))
                        .collect();
                    values = vec![None; group.len()];
                }
                Input::Read(results) => {
                    budget.reserved_bytes.fetch_sub(asked_bytes, Ordering::AcqRel);
                    let mut added = 0;
                    for (&at, result) in asked.iter().zip(results) {
                        let value = value_of(Some(result));
                        added += group_repeats[at] * bulk_reply_bytes(value.as_deref());
                        values[at] = value;
                    }
                    let total = budget.reply_bytes.fetch_add(added, Ordering::AcqRel) + added;
                    if total > budget.reply_bytes_max {
                        return Next::Reply(Reply::Error(format!(
                            "ERR reply of at least {total} bytes exceeds the client output limit ({} bytes)",
                            budget.reply_bytes_max
                        )));
                    }
                }
                Input::Written => return unexpected(),
            }
            // The next step's keys: as many as the room left allows at their largest.
            let room = budget.room_bytes();
            let value_bytes_max =
                bulk_reply_bytes(None) + value_bytes_bound.load(Ordering::Acquire).min(VALUE_BYTES_MAX) + 16;
            asked.clear();
            asked_bytes = 0;
            while next < group.len() && asked.len() < EXEC_READS_MAX {
                if !strings[next] {
                    next += 1;
                    continue;
                }
                let worst = group_repeats[next].saturating_mul(value_bytes_max);
                if !asked.is_empty() && asked_bytes.saturating_add(worst) > room {
                    break;
                }
                asked_bytes = asked_bytes.saturating_add(worst);
                asked.push(next);
                next += 1;
            }
            if asked.is_empty() {
                let replies = values
                    .iter_mut()
                    .map(|value| value.take().map_or(Reply::Null, Reply::Bulk))
                    .collect();
                return Next::Reply(Reply::Array(replies));
            }
            budget.reserved_bytes.fetch_add(asked_bytes, Ordering::AcqRel);
            Next::Read(
                asked.iter().map(|&at| ReadOp::Get(meta_key(&group[at], KeyType::String))).collect(),
            )
        });
    }
    let distinct_count = distinct.len();
    plan.finish(Box::new(move |replies| {
        let mut found: Vec<Reply> = vec![Reply::Null; distinct_count];
        for (reply, at) in replies.into_iter().zip(groups_at) {
            match reply {
                Reply::Array(values) => {
                    for (value, i) in values.into_iter().zip(at) {
                        found[i] = value;
                    }
                }
                error => return error,
            }
        }
        // Within the limit now, so the copies of repeated keys are bounded by it.
        Reply::Array(positions.iter().map(|&at| found[at].clone()).collect())
    }))
}

type KeyValues = Vec<(Vec<u8>, Vec<u8>)>;

/// The (key, value) pairs of MSET/MSETNX, or the syntax error.
fn pairs(call: &Call<'_>) -> Result<KeyValues, Outcome> {
    if call.args.len() % 2 != 1 {
        let name = call.word(0);
        return Err(Outcome::error(format!("ERR wrong number of arguments for '{name}' command")));
    }
    let mut pairs = Vec::new();
    for pair in call.args[1..].chunks(2) {
        if let Err(reply) = check_value(&pair[1]) {
            return Err(Outcome::Reply(reply));
        }
        pairs.push((pair[0].clone(), pair[1].clone()));
    }
    Ok(pairs)
}

/// MSET: all or nothing, also over several shards (a cross-shard batch), and never seen in part
/// by MGET.
fn mset(call: &mut Call<'_>) -> Outcome {
    let pairs = match pairs(call) {
        Ok(pairs) => pairs,
        Err(outcome) => return outcome,
    };
    mset_plan(call.db(), pairs, false, call.conn.in_exec)
}

/// MSETNX: sets every key, or none if any exists; atomic over several shards too: each shard
/// checks its keys under their locks, and one that finds a key refuses the whole batch.
fn msetnx(call: &mut Call<'_>) -> Outcome {
    let pairs = match pairs(call) {
        Ok(pairs) => pairs,
        Err(outcome) => return outcome,
    };
    mset_plan(call.db(), pairs, true, call.conn.in_exec)
}

/// MSET's answer from its execs' answers; MSETNX's (`only_new`) is 0 if a shard found a key
/// (the other shards then answer that the batch was aborted), 1 if all set.
fn mset_combine(only_new: bool) -> super::Combine {
    Box::new(move |replies: Vec<Reply>| {
        if only_new && replies.iter().any(|reply| matches!(reply, Reply::Integer(0))) {
            return Reply::Integer(0);
        }
        match replies.into_iter().find(|reply| !matches!(reply, Reply::Simple(_))) {
            Some(other) => other,
            None if only_new => Reply::Integer(1),
            None => Reply::ok(),
        }
    })
}

/// The (key, value) pairs of one shard, the last value of a key named twice winning (Redis).
/// Linear in the pairs: an MSET may name a million keys.
fn shard_group(pairs: &KeyValues, at: Vec<usize>) -> KeyValues {
    let mut last: std::collections::HashMap<&[u8], usize> =
        std::collections::HashMap::with_capacity(at.len());
    for (position, &i) in at.iter().enumerate() {
        last.insert(&pairs[i].0, position);
    }
    at.iter()
        .enumerate()
        .filter(|&(position, &i)| last[&pairs[i].0[..]] == position)
        .map(|(_, &i)| pairs[i].clone())
        .collect()
}

/// MSET's execs: one exec on one shard, or one part per shard of a cross-shard batch; with
/// `only_new`, nothing is set if any key exists (MSETNX). Inside EXEC (`in_exec`) an MSET is
/// one plain exec per shard: the transaction's sequences make them one atomic write already.
fn mset_plan(db: &copse::Db, pairs: KeyValues, only_new: bool, in_exec: bool) -> Outcome {
    let keys: Vec<Vec<u8>> = pairs.iter().map(|(key, _)| key.clone()).collect();
    let groups = by_shard(db, &keys);
    if groups.len() > 1 && (only_new || !in_exec) {
        let mut plan = super::AtomicPlan::new();
        for (shard, at) in groups {
            let group = shard_group(&pairs, at);
            let locks = group.iter().map(|(key, _)| key.clone()).collect();
            plan.add(shard, locks, move |vote| {
                let mut part = Some((vote, group));
                move |view: &super::View<'_>, input| match input {
                    Input::Start => {
                        let Some((vote, group)) = part.take() else { return unexpected() };
                        if only_new && group.iter().any(|(key, _)| key_type(view, key).is_some()) {
                            vote.refuse(copse::WriteError::Aborted("a key exists".into()));
                            return Next::Reply(Reply::Integer(0));
                        }
                        let ops: Vec<BatchOp> = group
                            .into_iter()
                            .flat_map(|(key, value)| overwrite(view, &key, value))
                            .collect();
                        Next::Prepare(vote, ops)
                    }
                    Input::Written => Next::Reply(Reply::ok()),
                    Input::Read(_) => unexpected(),
                }
            });
        }
        return plan.finish(db, mset_combine(only_new));
    }
    let mut plan = Plan::new();
    for (shard, at) in groups {
        let group = shard_group(&pairs, at);
        let locks = group.iter().map(|(key, _)| key.clone()).collect();
        let mut group = Some(group);
        plan.add(shard, locks, move |view, input| match input {
            Input::Start => {
                let Some(group) = group.take() else { return unexpected() };
                if only_new && group.iter().any(|(key, _)| key_type(view, key).is_some()) {
                    return Next::Reply(Reply::Integer(0));
                }
                let per_key: Vec<_> =
                    group.into_iter().map(|(key, value)| overwrite(view, &key, value)).collect();
                if let Some(reply) = per_key.iter().find_map(|ops| super::check_batch(ops).err()) {
                    return Next::Reply(reply);
                }
                // Every pair of the shard in one atomic write, however many.
                match one_batch(per_key) {
                    Ok(batch) => Next::Write(batch),
                    Err(reply) => Next::Reply(reply),
                }
            }
            Input::Written => Next::Reply(Reply::ok()),
            Input::Read(_) => unexpected(),
        });
    }
    plan.finish(mset_combine(only_new))
}

fn strlen(call: &mut Call<'_>) -> Outcome {
    with_string(call, |_, value| Next::Reply(Reply::Integer(value.map_or(0, |v| v.len() as i64))))
}

/// Modifies a string: `change` maps the old value (None if missing) to the new value and the
/// answer, or to an answer that changes nothing (an error; SETRANGE's empty patch).
fn modify<F>(call: &Call<'_>, mut change: F) -> Outcome
where
    F: FnMut(Option<Vec<u8>>) -> Result<(Vec<u8>, Reply), Reply> + Send + 'static,
{
    let key = call.args[1].clone();
    let mut pending = None;
    let mut expiry = Expiry::default();
    on_key(KeyTarget::of(call.db(), &key), move |view, input| {
        let old = match input {
            Input::Start => {
                // An expired key is missing: the new value replaces it, with no expiry.
                expiry = Expiry::of(view, &key);
                if !expiry.expired() {
                    return read_string(&key);
                }
                None
            }
            Input::Read(mut results) => {
                match string_or_wrongtype(view, &key, &expiry, &mut results) {
                    Ok(old) => old,
                    Err(wrongtype) => return wrongtype,
                }
            }
            Input::Written => return answer(&mut pending),
        };
        match change(old) {
            Ok((value, reply)) => write_then(
                expiry.before(vec![BatchOp::Put { key: meta_key(&key, KeyType::String), value }]),
                reply,
                &mut pending,
            ),
            Err(reply) => Next::Reply(reply),
        }
    })
}

fn append(call: &mut Call<'_>) -> Outcome {
    let tail = call.args[2].clone();
    modify(call, move |old| {
        let mut value = old.unwrap_or_default();
        value.extend_from_slice(&tail);
        check_value(&value)?;
        let length = value.len() as i64;
        Ok((value, Reply::Integer(length)))
    })
}

/// Redis's GETRANGE index arithmetic: negative indices count from the end, both ends inclusive.
fn substring(value: &[u8], start: i64, end: i64) -> &[u8] {
    let length = value.len() as i64;
    if length == 0 {
        return &[];
    }
    let start = if start < 0 { (length + start).max(0) } else { start };
    let end = if end < 0 { (length + end).max(0) } else { end.min(length - 1) };
    if start > end || start >= length {
        return &[];
    }
    &value[start as usize..=end as usize]
}

fn getrange(call: &mut Call<'_>) -> Outcome {
    let (Some(start), Some(end)) = (parse_i64(&call.args[2]), parse_i64(&call.args[3])) else {
        return Outcome::error(NOT_INTEGER);
    };
    with_string(call, move |_, value| {
        let value = value.unwrap_or_default();
        Next::Reply(Reply::Bulk(substring(&value, start, end).to_vec()))
    })
}

fn setrange(call: &mut Call<'_>) -> Outcome {
    let Some(offset) = parse_i64(&call.args[2]) else {
        return Outcome::error(NOT_INTEGER);
    };
    if offset < 0 {
        return Outcome::error("ERR offset is out of range");
    }
    let patch = call.args[3].clone();
    let end = (offset as u64).saturating_add(patch.len() as u64);
    if end > copse::limits::VALUE_BYTES_MAX as u64 {
        return Outcome::error(format!(
            "ERR string exceeds maximum allowed size ({} bytes)",
            copse::limits::VALUE_BYTES_MAX
        ));
    }
    modify(call, move |old| {
        let mut value = old.unwrap_or_default();
        if patch.is_empty() {
            // Redis: an empty patch changes nothing and creates no key.
            return Err(Reply::Integer(value.len() as i64));
        }
        let end = end as usize;
        if value.len() < end {
            value.resize(end, 0);
        }
        value[offset as usize..end].copy_from_slice(&patch);
        let length = value.len() as i64;
        Ok((value, Reply::Integer(length)))
    })
}

fn add_integer(call: &Call<'_>, by: i64) -> Outcome {
    modify(call, move |old| {
        let current = match old {
            None => 0,
            Some(bytes) => parse_i64(&bytes).ok_or_else(|| Reply::error(NOT_INTEGER))?,
        };
        let next = current
            .checked_add(by)
            .ok_or_else(|| Reply::error("ERR increment or decrement would overflow"))?;
        Ok((next.to_string().into_bytes(), Reply::Integer(next)))
    })
}

fn incr(call: &mut Call<'_>) -> Outcome {
    add_integer(call, 1)
}

fn decr(call: &mut Call<'_>) -> Outcome {
    add_integer(call, -1)
}

fn incrby(call: &mut Call<'_>) -> Outcome {
    match parse_i64(&call.args[2]) {
        Some(by) => add_integer(call, by),
        None => Outcome::error(NOT_INTEGER),
    }
}

fn decrby(call: &mut Call<'_>) -> Outcome {
    match parse_i64(&call.args[2]).and_then(i64::checked_neg) {
        Some(by) => add_integer(call, by),
        None => Outcome::error(NOT_INTEGER),
    }
}

fn incrbyfloat(call: &mut Call<'_>) -> Outcome {
    let Some(by) = parse_f64(&call.args[2]) else {
        return Outcome::error(NOT_FLOAT);
    };
    modify(call, move |old| {
        let current = match old {
            None => 0.0,
            Some(bytes) => parse_f64(&bytes).ok_or_else(|| Reply::error(NOT_FLOAT))?,
        };
        let next = current + by;
        if !next.is_finite() {
            return Err(Reply::error("ERR increment would produce NaN or Infinity"));
        }
        let text = format_double(next).into_bytes();
        Ok((text.clone(), Reply::Bulk(text)))
    })
}

#[cfg(test)]
mod tests {
    use super::substring;

    #[test]
    fn substrings_follow_redis_index_rules() {
        let value = b"This is a string";
        assert_eq!(substring(value, 0, 3), b"This");
        assert_eq!(substring(value, -3, -1), b"ing");
        assert_eq!(substring(value, 0, -1), value);
        assert_eq!(substring(value, 10, 100), b"string");
        assert_eq!(substring(value, 5, 3), b"");
        assert_eq!(substring(b"", 0, -1), b"");
        assert_eq!(substring(value, -100, 3), b"This");
    }
}
