//! Hash commands. A hash is its meta item (version, field count, expiry) plus one item per field
//! under the hash's id, so HSET of one field of a large hash writes one small item (and the meta
//! item when the count changes), never the whole hash.
//!
//! Invariants:
//! - A hash exists iff its meta item exists, and then it has `count` ≥ 1 fields under its id: the
//!   meta item is written in the same batch as every change of the field count, and deleted in
//!   the same batch as the last field.
//! - A hash has no field limit: DEL deletes the meta item and writes an orphan record (two
//!   items), and the orphan collector deletes the fields (`cmd/orphans.rs`).
//! - Each command writes at most one batch, so it happens whole or not at all; every limit is
//!   checked before that batch, and a refused command changes nothing.
//! - Whatever the meta item and the item keys tell (HEXISTS, HLEN, HKEYS, HSCAN NOVALUES) is
//!   answered from them with no other read; values are read only where they are needed.
//! - Field order (HGETALL, HKEYS, HVALS, HSCAN) is by field scan hash, not insertion order.

use std::collections::{HashMap, HashSet};
use std::ops::Bound;

use super::View;
use copse::exec::ReadOp;
use copse::limits::KEY_BYTES_MAX;
use copse::BatchOp;

use super::keys::{glob_match, SCAN_COUNT_DEFAULT, SCAN_COUNT_MAX};
use super::{
    answer, bound_ref, check_batch, from_index, hashed_element_at, on_collection,
    on_collection_grouped, parse_f64, parse_i64, random_u64, read_items, reply_too_large,
    unexpected, value_of, Call, Coll, Input, Next, Outcome, Spec, NOT_FLOAT, NOT_INTEGER, SYNTAX,
};
use crate::keyspace::{
    decode_field, field_key, fields_from, fields_range, KeyType, FIELD_OVERHEAD_BYTES,
};
use crate::resp::{format_double, Reply};

/// The largest field value: a new hash writes its first field and its meta item in one batch
/// record, which must fit copse's largest value, so a field leaves room for that record's
/// framing and the meta item (at most 2 × (7 + 1024) + 4 bytes; 4 KiB is kept).
pub const FIELD_VALUE_BYTES_MAX: usize = copse::limits::VALUE_BYTES_MAX - 4096;

pub fn specs() -> Vec<Spec> {
    let spec = |name, arity, flags, summary, handler| {
        Spec::new("hash", name, arity, flags, (1, 1, 1), summary, handler)
    };
    const W: &[&str] = &["write", "fast"];
    const R: &[&str] = &["readonly", "fast"];
    const RS: &[&str] = &["readonly"];
    vec![
        spec("hset", -4, W, "Sets fields of a hash; returns how many are new.", hset as _),
        spec("hmset", -4, W, "Sets fields of a hash.", hmset as _),
        spec("hsetnx", 4, W, "Sets a field of a hash only if it does not exist.", hsetnx as _),
        spec("hget", 3, R, "Returns the value of a field.", hget as _),
        spec("hmget", -3, R, "Returns the values of several fields.", hmget as _),
        spec("hgetall", 2, RS, "Returns every field and value of a hash.", hgetall as _),
        spec("hdel", -3, W, "Deletes fields of a hash.", hdel as _),
        spec("hexists", 3, R, "Tells whether a field exists.", hexists as _),
        spec("hlen", 2, R, "Returns the number of fields of a hash.", hlen as _),
        spec("hkeys", 2, RS, "Returns every field name of a hash.", hkeys as _),
        spec("hvals", 2, RS, "Returns every value of a hash.", hvals as _),
        spec("hstrlen", 3, R, "Returns the length of a field's value.", hstrlen as _),
        spec("hincrby", 4, W, "Increments the integer value of a field.", hincrby as _),
        spec("hincrbyfloat", 4, W, "Increments the float value of a field.", hincrbyfloat as _),
        spec("hscan", -3, RS, "Iterates over the fields of a hash.", hscan as _),
        spec("hrandfield", -2, RS, "Returns random fields.", hrandfield as _),
    ]
}

/// Refuses a field whose item key would not fit copse's keys.
fn check_field(key: &[u8], field: &[u8]) -> Result<(), Reply> {
    if key.len() + field.len() + FIELD_OVERHEAD_BYTES > KEY_BYTES_MAX {
        return Err(Reply::Error(format!(
            "ERR hash field of {} bytes is too long for a key stored under a name of {} bytes \
             (copse allows name and field together up to {} bytes; a key of over {} bytes is \
             stored under a name of {} bytes)",
            field.len(),
            key.len(),
            KEY_BYTES_MAX - FIELD_OVERHEAD_BYTES,
            crate::keyspace::NAME_INLINE_BYTES_MAX,
            crate::keyspace::SURROGATE_NAME_BYTES,
        )));
    }
    Ok(())
}

/// Refuses a field value over `FIELD_VALUE_BYTES_MAX`.
fn check_field_value(value: &[u8]) -> Result<(), Reply> {
    if value.len() > FIELD_VALUE_BYTES_MAX {
        return Err(Reply::Error(format!(
            "ERR hash field value of {} bytes exceeds copse's limit of {FIELD_VALUE_BYTES_MAX} bytes",
            value.len()
        )));
    }
    Ok(())
}

/// (field, value) pairs.
type Pairs = Vec<(Vec<u8>, Vec<u8>)>;

/// (field, value) pairs of HSET/HMSET, the last value of a repeated field winning, or the error.
fn field_pairs(call: &Call<'_>) -> Result<Pairs, Reply> {
    if !call.args.len().is_multiple_of(2) {
        let name = call.word(0);
        return Err(Reply::Error(format!("ERR wrong number of arguments for '{name}' command")));
    }
    let key = &call.args[1];
    let mut pairs: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
    let mut seen: HashMap<&[u8], usize> = HashMap::new();
    for pair in call.args[2..].chunks(2) {
        check_field(key, &pair[0])?;
        check_field_value(&pair[1])?;
        match seen.get(&pair[0][..]) {
            Some(&at) => pairs[at].1 = pair[1].clone(),
            None => {
                seen.insert(&pair[0], pairs.len());
                pairs.push((pair[0].clone(), pair[1].clone()));
            }
        }
    }
    Ok(pairs)
}

/// Sets `pairs` (distinct fields) in one batch, creating the hash if needed; answers
/// `done(new fields)`. With `only_new`, a field that exists stops it (HSETNX: one pair).
fn set_fields(
    call: &Call<'_>,
    mut pairs: Pairs,
    only_new: bool,
    done: fn(usize) -> Reply,
) -> Outcome {
    let mut pending = None;
    on_collection_grouped(call, KeyType::Hash, move |view, input, coll| match input {
        Input::Start => {
            let mut ops = Vec::with_capacity(pairs.len() + 1);
            let mut added = 0;
            for (field, value) in std::mem::take(&mut pairs) {
                let item = field_key(&coll.id, &field);
                if !view.contains(&item) {
                    added += 1;
                } else if only_new {
                    return Next::Reply(Reply::Integer(0));
                }
                ops.push(BatchOp::Put { key: item, value });
            }
            ops.extend(coll.meta_ops(coll.count() + added));
            if let Err(error) = check_batch(&ops) {
                return Next::Reply(error);
            }
            pending = Some(done(added));
            Next::Write(ops)
        }
        Input::Written => answer(&mut pending),
        Input::Read(_) => unexpected(),
    })
}

fn hset(call: &mut Call<'_>) -> Outcome {
    match field_pairs(call) {
        Ok(pairs) => set_fields(call, pairs, false, |added| Reply::Integer(added as i64)),
        Err(error) => Outcome::Reply(error),
    }
}

fn hmset(call: &mut Call<'_>) -> Outcome {
    match field_pairs(call) {
        Ok(pairs) => set_fields(call, pairs, false, |_| Reply::ok()),
        Err(error) => Outcome::Reply(error),
    }
}

fn hsetnx(call: &mut Call<'_>) -> Outcome {
    match field_pairs(call) {
        Ok(pairs) => set_fields(call, pairs, true, |_| Reply::Integer(1)),
        Err(error) => Outcome::Reply(error),
    }
}

/// Reads the values of `fields` of the hash and answers `reply(values)`, in their order.
fn read_fields<F>(call: &Call<'_>, fields: Vec<Vec<u8>>, reply: F) -> Outcome
where
    F: FnMut(Vec<Option<Vec<u8>>>) -> Reply + Send + 'static,
{
    read_items(call, KeyType::Hash, fields, field_key, true, reply)
}

fn hget(call: &mut Call<'_>) -> Outcome {
    let field = call.args[2].clone();
    read_fields(call, vec![field], |mut values| {
        values.pop().flatten().map_or(Reply::Null, Reply::Bulk)
    })
}

fn hmget(call: &mut Call<'_>) -> Outcome {
    let fields = call.args[2..].to_vec();
    read_fields(call, fields, |values| {
        Reply::Array(
            values.into_iter().map(|value| value.map_or(Reply::Null, Reply::Bulk)).collect(),
        )
    })
}

fn hstrlen(call: &mut Call<'_>) -> Outcome {
    let field = call.args[2].clone();
    // Its reply is a length: the value counts for nothing against the output limit.
    read_items(call, KeyType::Hash, vec![field], field_key, false, |mut values| {
        Reply::Integer(values.pop().flatten().map_or(0, |value| value.len() as i64))
    })
}

/// Reads every (field, value) of the hash and answers `reply` of them. The fields come from the
/// index (no I/O); their values are read in steps no larger than the room left under the
/// output limit, each counted at the largest value the store may hold, so a reply that would
/// pass the limit is refused with an error having read at most the limit plus one value.
fn read_all<F>(call: &Call<'_>, mut reply: F) -> Outcome
where
    F: FnMut(Vec<(Vec<u8>, Vec<u8>)>) -> Reply + Send + 'static,
{
    use std::sync::atomic::Ordering;
    let reply_bytes_max = call.server.settings.client_output_bytes_max.load(Ordering::Relaxed);
    let value_bytes_bound = call.server.value_bytes_bound.clone();
    let mut items: Vec<Vec<u8>> = Vec::new();
    let mut pairs: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
    let mut asked = 0..0;
    let mut reply_bytes = 0;
    on_collection(call, KeyType::Hash, move |view, input, coll| {
        match input {
            Input::Start => {
                if !coll.exists() {
                    return Next::Reply(reply(Vec::new()));
                }
                let (start, end) = fields_range(&coll.id);
                items = view.keys(bound_ref(&start), bound_ref(&end), usize::MAX);
            }
            Input::Read(results) => {
                for (item, result) in items[asked.clone()].iter().zip(results) {
                    let Some((_, field)) = decode_field(item, coll.id.len()) else {
                        return unexpected();
                    };
                    // A field the index lists is there: the exec holds the hash's lock.
                    let value = value_of(Some(result)).unwrap_or_default();
                    reply_bytes += field.len() + value.len() + 32;
                    pairs.push((field.to_vec(), value));
                }
                if reply_bytes > reply_bytes_max {
                    return Next::Reply(Reply::Error(format!(
                        "ERR reply of at least {reply_bytes} bytes exceeds the client output limit ({reply_bytes_max} bytes)"
                    )));
                }
            }
            Input::Written => return unexpected(),
        }
        let value_bytes_max =
            value_bytes_bound.load(Ordering::Acquire).min(copse::limits::VALUE_BYTES_MAX) + 32;
        let room = reply_bytes_max.saturating_sub(reply_bytes);
        let step = (room / value_bytes_max).clamp(1, copse::limits::EXEC_READS_MAX);
        asked = asked.end..(asked.end + step).min(items.len());
        if asked.is_empty() {
            return Next::Reply(reply(std::mem::take(&mut pairs)));
        }
        Next::Read(items[asked.clone()].iter().map(|item| ReadOp::Get(item.clone())).collect())
    })
}

fn hgetall(call: &mut Call<'_>) -> Outcome {
    read_all(call, |pairs| {
        Reply::Map(
            pairs
                .into_iter()
                .map(|(field, value)| (Reply::Bulk(field), Reply::Bulk(value)))
                .collect(),
        )
    })
}

fn hvals(call: &mut Call<'_>) -> Outcome {
    read_all(call, |pairs| Reply::Array(pairs.into_iter().map(|(_, v)| Reply::Bulk(v)).collect()))
}

/// The field names of hash `key`'s items in `[start, end)`, up to `limit`, from the index.
fn field_names(
    view: &View<'_>,
    id: &[u8],
    range: &(Bound<Vec<u8>>, Bound<Vec<u8>>),
    limit: usize,
) -> Vec<(u64, Vec<u8>)> {
    view.keys(bound_ref(&range.0), bound_ref(&range.1), limit)
        .iter()
        .filter_map(|item| decode_field(item, id.len()).map(|(hash, f)| (hash, f.to_vec())))
        .collect()
}

fn hkeys(call: &mut Call<'_>) -> Outcome {
    from_index(call, KeyType::Hash, |view, coll| {
        let names = field_names(view, &coll.id, &fields_range(&coll.id), usize::MAX);
        Reply::Array(names.into_iter().map(|(_, field)| Reply::Bulk(field)).collect())
    })
}

fn hexists(call: &mut Call<'_>) -> Outcome {
    let field = call.args[2].clone();
    from_index(call, KeyType::Hash, move |view, coll| {
        Reply::Integer(view.contains(&field_key(&coll.id, &field)) as i64)
    })
}

fn hlen(call: &mut Call<'_>) -> Outcome {
    from_index(call, KeyType::Hash, |_, coll| Reply::Integer(coll.count() as i64))
}

fn hdel(call: &mut Call<'_>) -> Outcome {
    let fields = call.args[2..].to_vec();
    let mut pending = None;
    on_collection_grouped(call, KeyType::Hash, move |view, input, coll| match input {
        Input::Start => {
            if !coll.exists() {
                return Next::Reply(Reply::Integer(0));
            }
            let mut ops: Vec<BatchOp> = Vec::new();
            let mut seen = HashSet::new();
            for field in &fields {
                let item = field_key(&coll.id, field);
                if seen.insert(&field[..]) && view.contains(&item) {
                    ops.push(BatchOp::Delete { key: item });
                }
            }
            let deleted = ops.len();
            if deleted == 0 {
                return Next::Reply(Reply::Integer(0));
            }
            ops.extend(coll.meta_ops(coll.count().saturating_sub(deleted)));
            if let Err(error) = check_batch(&ops) {
                return Next::Reply(error);
            }
            pending = Some(Reply::Integer(deleted as i64));
            Next::Write(ops)
        }
        Input::Written => answer(&mut pending),
        Input::Read(_) => unexpected(),
    })
}

/// Changes one field: `change` maps its old value (None if missing) to the new value and the
/// answer, or to an error that changes nothing.
fn modify_field<F>(call: &Call<'_>, mut change: F) -> Outcome
where
    F: FnMut(Option<Vec<u8>>) -> Result<(Vec<u8>, Reply), Reply> + Send + 'static,
{
    let field = call.args[2].clone();
    if let Err(error) = check_field(&call.args[1], &field) {
        return Outcome::Reply(error);
    }
    let mut item = Vec::new();
    let mut pending = None;
    on_collection_grouped(call, KeyType::Hash, move |view, input, coll: &mut Coll| {
        let old = match input {
            Input::Start => {
                item = field_key(&coll.id, &field);
                if view.contains(&item) {
                    return Next::Read(smallvec::smallvec![ReadOp::Get(item.clone())]);
                }
                None
            }
            Input::Read(mut results) => match value_of(results.pop()) {
                Some(value) => Some(value),
                None => return unexpected(),
            },
            Input::Written => return answer(&mut pending),
        };
        let is_new = old.is_none();
        let (value, reply) = match change(old) {
            Ok(changed) => changed,
            Err(error) => return Next::Reply(error),
        };
        let mut ops = Vec::with_capacity(2);
        ops.push(BatchOp::Put { key: item.clone(), value });
        ops.extend(coll.meta_ops(coll.count() + is_new as usize));
        pending = Some(reply);
        Next::Write(ops)
    })
}

fn hincrby(call: &mut Call<'_>) -> Outcome {
    let Some(by) = parse_i64(&call.args[3]) else {
        return Outcome::error(NOT_INTEGER);
    };
    modify_field(call, move |old| {
        let current = match old {
            None => 0,
            Some(bytes) => {
                parse_i64(&bytes).ok_or_else(|| Reply::error("ERR hash value is not an integer"))?
            }
        };
        let next = current
            .checked_add(by)
            .ok_or_else(|| Reply::error("ERR increment or decrement would overflow"))?;
        Ok((next.to_string().into_bytes(), Reply::Integer(next)))
    })
}

fn hincrbyfloat(call: &mut Call<'_>) -> Outcome {
    let Some(by) = parse_f64(&call.args[3]) else {
        return Outcome::error(NOT_FLOAT);
    };
    if by.is_infinite() {
        return Outcome::error("ERR value is NaN or Infinity");
    }
    modify_field(call, move |old| {
        let current = match old {
            None => 0.0,
            Some(bytes) => {
                parse_f64(&bytes).ok_or_else(|| Reply::error("ERR hash value is not a float"))?
            }
        };
        let next = current + by;
        if !next.is_finite() {
            return Err(Reply::error("ERR increment would produce NaN or Infinity"));
        }
        let text = format_double(next).into_bytes();
        Ok((text.clone(), Reply::Bulk(text)))
    })
}

struct ScanOptions {
    pattern: Option<Vec<u8>>,
    count: usize,
    values: bool,
}

/// HSCAN's options after the cursor.
fn scan_options(call: &Call<'_>) -> Result<ScanOptions, Reply> {
    let mut options = ScanOptions { pattern: None, count: SCAN_COUNT_DEFAULT, values: true };
    let mut at = 3;
    while at < call.args.len() {
        let argument = call.args.get(at + 1);
        match (call.word(at).as_str(), argument) {
            ("match", Some(pattern)) => {
                // "*" matches everything: skip the matching.
                options.pattern = (pattern[..] != b"*"[..]).then(|| pattern.clone());
            }
            ("count", Some(count)) => match parse_i64(count) {
                Some(n) if n >= 1 => options.count = (n as usize).min(SCAN_COUNT_MAX),
                Some(_) => return Err(Reply::error(SYNTAX)),
                None => return Err(Reply::error(NOT_INTEGER)),
            },
            ("novalues", _) => {
                options.values = false;
                at += 1;
                continue;
            }
            _ => return Err(Reply::error(SYNTAX)),
        }
        at += 2;
    }
    Ok(options)
}

/// HSCAN: the cursor is the field scan hash to continue from, so it survives writes and every
/// field present for the whole iteration is returned at least once. Unlike Redis, a small hash
/// is paged by COUNT like a large one.
fn hscan(call: &mut Call<'_>) -> Outcome {
    let Some(cursor) = std::str::from_utf8(&call.args[2]).ok().and_then(|c| c.parse::<u64>().ok())
    else {
        return Outcome::error("ERR invalid cursor");
    };
    // Redis answers a missing key before looking at the options: so does this, in the exec.
    let options = scan_options(call);
    let mut fields: Vec<Vec<u8>> = Vec::new();
    let mut next = 0;
    on_collection(call, KeyType::Hash, move |view, input, coll| match input {
        Input::Start => {
            if !coll.exists() {
                return Next::Reply(scan_reply(0, Vec::new()));
            }
            let options = match &options {
                Ok(options) => options,
                Err(error) => return Next::Reply(error.clone()),
            };
            // One more than asked: its hash is the next cursor.
            let mut names =
                field_names(view, &coll.id, &fields_from(&coll.id, cursor), options.count + 1);
            next = if names.len() > options.count { names.pop().map_or(0, |(h, _)| h) } else { 0 };
            fields = names
                .into_iter()
                .map(|(_, field)| field)
                .filter(|field| options.pattern.as_ref().is_none_or(|p| glob_match(p, field)))
                .collect();
            if !options.values {
                let fields = std::mem::take(&mut fields);
                return Next::Reply(scan_reply(
                    next,
                    fields.into_iter().map(Reply::Bulk).collect(),
                ));
            }
            if fields.is_empty() {
                return Next::Reply(scan_reply(next, Vec::new()));
            }
            Next::Read(fields.iter().map(|field| ReadOp::Get(field_key(&coll.id, field))).collect())
        }
        Input::Read(results) => {
            let mut flat = Vec::with_capacity(2 * fields.len());
            for (field, result) in std::mem::take(&mut fields).into_iter().zip(results) {
                match value_of(Some(result)) {
                    Some(value) => flat.extend([Reply::Bulk(field), Reply::Bulk(value)]),
                    None => return unexpected(),
                }
            }
            Next::Reply(scan_reply(next, flat))
        }
        Input::Written => unexpected(),
    })
}

/// What a random field costs in a reply besides its bytes (its bulk header).
const RANDOM_FIELD_OVERHEAD_BYTES: usize = 32;

/// HRANDFIELD key [count [WITHVALUES]]: a count ≥ 0 gives distinct fields (at most all), a
/// negative one |count| fields with repeats.
fn hrandfield(call: &mut Call<'_>) -> Outcome {
    let (count, with_values) = match super::parse_random_count(call, "withvalues") {
        Ok(parsed) => parsed,
        Err(error) => return Outcome::Reply(error),
    };
    let limit =
        call.server.settings.client_output_bytes_max.load(std::sync::atomic::Ordering::Relaxed);
    let protocol = call.conn.protocol;
    let mut chosen: Vec<Vec<u8>> = Vec::new();
    let mut values: Vec<Vec<u8>> = Vec::new();
    let mut bytes = 0usize;
    on_collection(call, KeyType::Hash, move |view, input, coll| {
        match input {
            Input::Start => {
                if !coll.exists() {
                    return Next::Reply(if count.is_some() {
                        Reply::Array(Vec::new())
                    } else {
                        Reply::Null
                    });
                }
                let len = coll.count();
                let wanted = match count {
                    None => 1,
                    Some(count) if count >= 0 => (count as u64).min(len as u64),
                    Some(count) => count.unsigned_abs(),
                };
                // Every pick costs at least its overhead: refused before any is chosen.
                let least = (wanted as u128) * RANDOM_FIELD_OVERHEAD_BYTES as u128;
                if least > limit as u128 {
                    return Next::Reply(reply_too_large(
                        least.min(usize::MAX as u128) as usize,
                        limit,
                    ));
                }
                let distinct = count.is_none_or(|count| count >= 0);
                let mut taken = HashSet::new();
                let none = HashSet::new();
                for _ in 0..wanted {
                    let avoid = if distinct { &taken } else { &none };
                    let Some(field) = hashed_element_at(view, coll, random_u64() >> 1, avoid)
                    else {
                        break;
                    };
                    bytes += field.len() + RANDOM_FIELD_OVERHEAD_BYTES;
                    if bytes > limit {
                        return Next::Reply(reply_too_large(bytes, limit));
                    }
                    if distinct {
                        taken.insert(field.clone());
                    }
                    chosen.push(field);
                }
                if !with_values {
                    let fields = std::mem::take(&mut chosen);
                    return Next::Reply(match count {
                        None => fields.into_iter().next().map_or(Reply::Null, Reply::Bulk),
                        Some(_) => Reply::Array(fields.into_iter().map(Reply::Bulk).collect()),
                    });
                }
            }
            Input::Read(results) => {
                for result in results {
                    let value = value_of(Some(result)).unwrap_or_default();
                    bytes += value.len();
                    values.push(value);
                }
                if bytes > limit {
                    return Next::Reply(reply_too_large(bytes, limit));
                }
            }
            Input::Written => return unexpected(),
        }
        // The values, read in steps of at most `EXEC_READS_MAX`.
        if values.len() < chosen.len() {
            let end = (values.len() + copse::limits::EXEC_READS_MAX).min(chosen.len());
            return Next::Read(
                chosen[values.len()..end]
                    .iter()
                    .map(|field| ReadOp::Get(field_key(&coll.id, field)))
                    .collect(),
            );
        }
        let pairs = std::mem::take(&mut chosen).into_iter().zip(std::mem::take(&mut values));
        Next::Reply(if protocol == crate::resp::Protocol::Resp3 {
            Reply::Array(
                pairs.map(|(f, v)| Reply::Array(vec![Reply::Bulk(f), Reply::Bulk(v)])).collect(),
            )
        } else {
            Reply::Array(pairs.flat_map(|(f, v)| [Reply::Bulk(f), Reply::Bulk(v)]).collect())
        })
    })
}

fn scan_reply(next: u64, items: Vec<Reply>) -> Reply {
    Reply::Array(vec![Reply::Bulk(next.to_string().into_bytes()), Reply::Array(items)])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_field_fits_exactly_when_its_item_key_fits() {
        let key = b"user:1";
        let longest = vec![b'f'; KEY_BYTES_MAX - FIELD_OVERHEAD_BYTES - key.len()];
        assert!(check_field(key, &longest).is_ok());
        let id = crate::keyspace::collection_id(key, 7);
        assert_eq!(field_key(&id, &longest).len(), KEY_BYTES_MAX);
        let longer = vec![b'f'; longest.len() + 1];
        assert!(
            matches!(check_field(key, &longer), Err(Reply::Error(text)) if text.starts_with("ERR "))
        );
    }
}
