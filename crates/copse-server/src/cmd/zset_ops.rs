//! The rest of Redis's sorted set commands, over the layout of `zsets.rs`: pops at either end
//! (ZPOPMIN, ZPOPMAX, ZMPOP and their blocking forms), removals by range (ZREMRANGEBYSCORE,
//! ZREMRANGEBYRANK, ZREMRANGEBYLEX), lexicographic ranges (ZRANGEBYLEX, ZREVRANGEBYLEX,
//! ZLEXCOUNT), ZRANDMEMBER, ZSCAN, the algebra (ZUNION, ZINTER, ZDIFF, their STORE forms,
//! ZINTERCARD) and ZRANGESTORE.
//!
//! Invariants (those of `zsets.rs`, plus):
//! - Every member these commands select is found in the index (the by-score items carry score and
//!   member), so selection does no I/O; a removal deletes the member item and the by-score item
//!   of each member in one batch with the meta item.
//! - A write that adds members wakes the first client blocked on the key (BZPOPMIN and the like)
//!   once it is durable (`waiters.rs`).

use std::collections::HashMap;
use std::ops::Bound;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use copse::exec::{ExecView, ReadOp};
use copse::{BatchOp, Db};

use super::keys::{glob_match, SCAN_COUNT_DEFAULT, SCAN_COUNT_MAX};
use super::lists::{blocking, parse_timeout};
use super::zsets::{
    all_scores, by_score, range_reply, rank_window, run_range, LexRange, RangeBy, RangeQuery,
    ScoreRange, LEX_RANGE_INVALID, MIN_MAX_NOT_FLOAT,
};
use super::{
    answer, bound_ref, by_shard, check_batch, coll_make, coll_meta, delete_ops, from_index,
    last_op_wins, on_collection, on_collection_key, parse_f64, parse_i64, run_outcome, stored_type,
    unexpected, value_of, Call, Coll, Expiry, Input, Next, Outcome, Plan, Spec, NOT_INTEGER,
    SYNTAX,
};
use crate::context::Server;
use crate::keyspace::{self, decode_score_value, encode_score, member_key, score_key, KeyType};
use crate::resp::{format_double, Protocol, Reply};

pub fn specs() -> Vec<Spec> {
    let spec = |name, arity, flags, keys, summary, handler| {
        Spec::new("sorted-set", name, arity, flags, keys, summary, handler)
    };
    const W: &[&str] = &["write", "fast"];
    const WS: &[&str] = &["write"];
    const R: &[&str] = &["readonly", "fast"];
    const RS: &[&str] = &["readonly"];
    const B: &[&str] = &["write", "blocking"];
    const ONE: (i32, i32, i32) = (1, 1, 1);
    vec![
        spec("zpopmin", -2, W, ONE, "Removes and returns the lowest-scored members.", zpopmin as _),
        spec(
            "zpopmax",
            -2,
            W,
            ONE,
            "Removes and returns the highest-scored members.",
            zpopmax as _,
        ),
        spec(
            "bzpopmin",
            -3,
            B,
            (1, -2, 1),
            "ZPOPMIN, blocking until a member comes.",
            bzpopmin as _,
        ),
        spec(
            "bzpopmax",
            -3,
            B,
            (1, -2, 1),
            "ZPOPMAX, blocking until a member comes.",
            bzpopmax as _,
        ),
        spec("zmpop", -4, WS, (2, -2, 1), "Pops from the first non-empty sorted set.", zmpop as _),
        spec("bzmpop", -5, B, (3, -2, 1), "ZMPOP, blocking until a member comes.", bzmpop as _),
        spec(
            "zremrangebyscore",
            4,
            WS,
            ONE,
            "Removes members in a score range.",
            zremrangebyscore as _,
        ),
        spec(
            "zremrangebyrank",
            4,
            WS,
            ONE,
            "Removes members in a rank range.",
            zremrangebyrank as _,
        ),
        spec(
            "zremrangebylex",
            4,
            WS,
            ONE,
            "Removes members in a lexicographic range.",
            zremrangebylex as _,
        ),
        spec(
            "zrangebylex",
            -4,
            RS,
            ONE,
            "Returns members in a lexicographic range.",
            zrangebylex as _,
        ),
        spec("zrevrangebylex", -4, RS, ONE, "ZRANGEBYLEX, highest first.", zrevrangebylex as _),
        spec("zlexcount", 4, R, ONE, "Counts members in a lexicographic range.", zlexcount as _),
        spec("zrandmember", -2, RS, ONE, "Returns random members.", zrandmember as _),
        spec("zscan", -3, RS, ONE, "Iterates over members and scores.", zscan as _),
        spec("zunion", -3, RS, (0, 0, 0), "Returns the union of sorted sets.", zunion as _),
        spec("zinter", -3, RS, (0, 0, 0), "Returns the intersection of sorted sets.", zinter as _),
        spec("zdiff", -3, RS, (0, 0, 0), "Returns the difference of sorted sets.", zdiff as _),
        spec(
            "zunionstore",
            -4,
            WS,
            (1, 1, 1),
            "Stores the union of sorted sets.",
            zunionstore as _,
        ),
        spec("zinterstore", -4, WS, (1, 1, 1), "Stores the intersection.", zinterstore as _),
        spec("zdiffstore", -4, WS, (1, 1, 1), "Stores the difference.", zdiffstore as _),
        spec("zintercard", -3, RS, (0, 0, 0), "Counts the intersection.", zintercard as _),
        spec("zrangestore", -5, WS, (1, 2, 1), "Stores a range of a sorted set.", zrangestore as _),
    ]
}

/// The writes that remove `members` (score, member), all present, from `coll`: the whole key
/// when they are all of it (two small items, the collector does the rest).
fn remove_ops(coll: &Coll, members: &[(f64, Vec<u8>)]) -> Vec<BatchOp> {
    if members.len() == coll.count() {
        return delete_ops(&coll.key, KeyType::ZSet, &coll.expiry);
    }
    let mut ops = Vec::with_capacity(2 * members.len() + 1);
    for (score, member) in members {
        ops.push(BatchOp::Delete { key: member_key(&coll.id, member) });
        ops.push(BatchOp::Delete { key: score_key(&coll.id, *score, member) });
    }
    ops.extend(coll.meta_ops(coll.count() - members.len()));
    ops
}

/// Members with scores: flat in RESP2; in RESP3 `[member, score]` pairs when `pairs`.
fn scored_reply(items: Vec<(f64, Vec<u8>)>, pairs: bool, protocol: Protocol) -> Reply {
    if pairs && protocol == Protocol::Resp3 {
        return Reply::Array(
            items
                .into_iter()
                .map(|(score, member)| {
                    Reply::Array(vec![Reply::Bulk(member), Reply::Double(score)])
                })
                .collect(),
        );
    }
    let mut flat = Vec::with_capacity(2 * items.len());
    for (score, member) in items {
        flat.push(Reply::Bulk(member));
        flat.push(Reply::Double(score));
    }
    Reply::Array(flat)
}

/// Removes the `n` lowest (or highest) members of sorted set `key`, answering `reply` of them
/// (in the order they leave), `missing` for a missing key.
fn pop_with<F>(
    server: &Server,
    key: Vec<u8>,
    max: bool,
    n: usize,
    missing: Reply,
    mut reply: F,
) -> Outcome
where
    F: FnMut(Vec<(f64, Vec<u8>)>) -> Reply + Send + 'static,
{
    let limit = server.settings.client_output_bytes_max.load(Ordering::Relaxed);
    let mut pending = None;
    // Pops of one hot sorted set share flushes with the writes before them (write groups).
    on_collection_key(&server.db, key, KeyType::ZSet, true, move |view, input, coll| match input {
        Input::Start => {
            if !coll.exists() {
                return Next::Reply(missing.clone());
            }
            let n = n.min(coll.count());
            if n == 0 {
                return Next::Reply(reply(Vec::new()));
            }
            let mut items = if max {
                let mut all = by_score(view, &coll.id, &all_scores(&coll.id), usize::MAX);
                all.drain(..all.len() - n);
                all.reverse();
                all
            } else {
                by_score(view, &coll.id, &all_scores(&coll.id), n)
            };
            items.truncate(n);
            let bytes: usize = items.iter().map(|(_, m)| m.len() + 48).sum();
            if bytes > limit {
                return Next::Reply(Reply::Error(format!(
                    "ERR reply of at least {bytes} bytes exceeds the client output limit ({limit} bytes)"
                )));
            }
            let ops = remove_ops(coll, &items);
            if let Err(error) = check_batch(&ops) {
                return Next::Reply(error);
            }
            pending = Some(reply(items));
            Next::WriteLast(ops)
        }
        Input::Written => answer(&mut pending),
        Input::Read(_) => unexpected(),
    })
}

fn pop_command(call: &mut Call<'_>, max: bool) -> Outcome {
    let count = match call.args.len() {
        2 => None,
        3 => match parse_i64(&call.args[2]) {
            Some(count) if count >= 0 => Some(count as usize),
            _ => return Outcome::error("ERR value is out of range, must be positive"),
        },
        _ => return Outcome::error(SYNTAX),
    };
    let protocol = call.conn.protocol;
    let key = call.args[1].clone();
    pop_with(call.server, key, max, count.unwrap_or(1), Reply::Array(Vec::new()), move |items| {
        scored_reply(items, count.is_some(), protocol)
    })
}

fn zpopmin(call: &mut Call<'_>) -> Outcome {
    pop_command(call, false)
}

fn zpopmax(call: &mut Call<'_>) -> Outcome {
    pop_command(call, true)
}

/// ZMPOP's arguments from `at` (numkeys): numkeys, keys, MIN|MAX, [COUNT n].
fn parse_mpop(call: &Call<'_>, at: usize) -> Result<(Vec<Vec<u8>>, bool, usize), Reply> {
    let numkeys = match parse_i64(&call.args[at]) {
        Some(n) if n > 0 => n as usize,
        _ => return Err(Reply::error("ERR numkeys should be greater than 0")),
    };
    let first = at + 1;
    if first + numkeys >= call.args.len() {
        return Err(Reply::error(SYNTAX));
    }
    let keys = call.args[first..first + numkeys].to_vec();
    let max = match call.word(first + numkeys).as_str() {
        "min" => false,
        "max" => true,
        _ => return Err(Reply::error(SYNTAX)),
    };
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
    Ok((keys, max, count.unwrap_or(1)))
}

/// Tries each key in order: the first that holds a sorted set answers `shape(key, popped)`.
async fn try_pops<F>(
    server: &Arc<Server>,
    keys: &[Vec<u8>],
    max: bool,
    n: usize,
    shape: F,
) -> Option<Reply>
where
    F: Fn(&[u8], Vec<(f64, Vec<u8>)>) -> Reply,
{
    for key in keys {
        let outcome = pop_with(server, key.clone(), max, n, Reply::NullArray, |items| {
            // Carried through the exec as pairs; shaped by the caller.
            Reply::Array(
                items
                    .into_iter()
                    .map(|(score, member)| {
                        Reply::Array(vec![Reply::Bulk(member), Reply::Double(score)])
                    })
                    .collect(),
            )
        });
        match run_outcome(&server.db, outcome).await {
            Reply::NullArray => continue,
            Reply::Array(pairs) if pairs.is_empty() => continue,
            Reply::Array(pairs) => {
                let items = pairs
                    .into_iter()
                    .filter_map(|pair| match pair {
                        Reply::Array(mut pair) => match (pair.pop(), pair.pop()) {
                            (Some(Reply::Double(score)), Some(Reply::Bulk(member))) => {
                                Some((score, member))
                            }
                            _ => None,
                        },
                        _ => None,
                    })
                    .collect();
                return Some(shape(key, items));
            }
            error => return Some(error),
        }
    }
    None
}

/// ZMPOP's reply: `[key, [[member, score], ...]]` in both protocols.
fn mpop_reply(key: &[u8], items: Vec<(f64, Vec<u8>)>) -> Reply {
    let pairs = items
        .into_iter()
        .map(|(score, member)| Reply::Array(vec![Reply::Bulk(member), Reply::Double(score)]))
        .collect();
    Reply::Array(vec![Reply::Bulk(key.to_vec()), Reply::Array(pairs)])
}

fn zmpop(call: &mut Call<'_>) -> Outcome {
    let (keys, max, n) = match parse_mpop(call, 1) {
        Ok(parsed) => parsed,
        Err(error) => return Outcome::Reply(error),
    };
    let server = call.server.clone();
    Outcome::AfterPending(Box::pin(async move {
        try_pops(&server, &keys, max, n, mpop_reply).await.unwrap_or(Reply::NullArray)
    }))
}

fn bzmpop(call: &mut Call<'_>) -> Outcome {
    let timeout = match parse_timeout(&call.args[1]) {
        Ok(timeout) => timeout,
        Err(error) => return Outcome::Reply(error),
    };
    let (keys, max, n) = match parse_mpop(call, 2) {
        Ok(parsed) => parsed,
        Err(error) => return Outcome::Reply(error),
    };
    let server = call.server.clone();
    let keys = Arc::new(keys);
    let watched = keys.to_vec();
    Outcome::AfterPending(Box::pin(blocking(server, watched, timeout, move |server| {
        let keys = keys.clone();
        async move { try_pops(&server, &keys, max, n, mpop_reply).await }
    })))
}

fn blocking_pop(call: &mut Call<'_>, max: bool) -> Outcome {
    let timeout = match parse_timeout(&call.args[call.args.len() - 1]) {
        Ok(timeout) => timeout,
        Err(error) => return Outcome::Reply(error),
    };
    let keys = Arc::new(call.args[1..call.args.len() - 1].to_vec());
    let server = call.server.clone();
    let watched = keys.to_vec();
    Outcome::AfterPending(Box::pin(blocking(server, watched, timeout, move |server| {
        let keys = keys.clone();
        async move {
            // `[key, member, score]`.
            try_pops(&server, &keys, max, 1, |key, mut items| match items.pop() {
                Some((score, member)) => Reply::Array(vec![
                    Reply::Bulk(key.to_vec()),
                    Reply::Bulk(member),
                    Reply::Double(score),
                ]),
                None => Reply::NullArray,
            })
            .await
        }
    })))
}

fn bzpopmin(call: &mut Call<'_>) -> Outcome {
    blocking_pop(call, false)
}

fn bzpopmax(call: &mut Call<'_>) -> Outcome {
    blocking_pop(call, true)
}

// -- removals by range and lexicographic ranges --------------------------------------------------

/// Removes the members `select` picks from the index; answers how many.
fn remove_range<F>(call: &Call<'_>, mut select: F) -> Outcome
where
    F: FnMut(&ExecView<'_>, &Coll) -> Vec<(f64, Vec<u8>)> + Send + 'static,
{
    let mut pending = None;
    on_collection(call, KeyType::ZSet, move |view, input, coll| match input {
        Input::Start => {
            if !coll.exists() {
                return Next::Reply(Reply::Integer(0));
            }
            let items = select(view, coll);
            if items.is_empty() {
                return Next::Reply(Reply::Integer(0));
            }
            let ops = remove_ops(coll, &items);
            if let Err(error) = check_batch(&ops) {
                return Next::Reply(error);
            }
            pending = Some(Reply::Integer(items.len() as i64));
            Next::WriteLast(ops)
        }
        Input::Written => answer(&mut pending),
        Input::Read(_) => unexpected(),
    })
}

fn zremrangebyscore(call: &mut Call<'_>) -> Outcome {
    let Some(range) = ScoreRange::parse(&call.args[2], &call.args[3]) else {
        return Outcome::error(MIN_MAX_NOT_FLOAT);
    };
    remove_range(call, move |view, coll| {
        if range.is_empty() {
            return Vec::new();
        }
        by_score(view, &coll.id, &range.items(&coll.id), usize::MAX)
    })
}

fn zremrangebyrank(call: &mut Call<'_>) -> Outcome {
    let (Some(start), Some(stop)) = (parse_i64(&call.args[2]), parse_i64(&call.args[3])) else {
        return Outcome::error(NOT_INTEGER);
    };
    remove_range(call, move |view, coll| {
        let Some((first, last)) = rank_window(start, stop, coll.count()) else { return Vec::new() };
        let mut items = by_score(view, &coll.id, &all_scores(&coll.id), last + 1);
        items.drain(..first.min(items.len()));
        items
    })
}

fn zremrangebylex(call: &mut Call<'_>) -> Outcome {
    let Some(range) = LexRange::parse(&call.args[2], &call.args[3]) else {
        return Outcome::error(LEX_RANGE_INVALID);
    };
    remove_range(call, move |view, coll| match range.items(view, &coll.id) {
        Some(items) => by_score(view, &coll.id, &items, usize::MAX),
        None => Vec::new(),
    })
}

/// ZRANGEBYLEX and ZREVRANGEBYLEX `key min max [LIMIT offset count]` (reversed: max then min).
fn range_by_lex(call: &mut Call<'_>, reverse: bool) -> Outcome {
    let (min, max) =
        if reverse { (&call.args[3], &call.args[2]) } else { (&call.args[2], &call.args[3]) };
    let Some(range) = LexRange::parse(min, max) else { return Outcome::error(LEX_RANGE_INVALID) };
    let (mut offset, mut count) = (0, -1);
    match call.args.len() {
        4 => {}
        7 if call.word(4) == "limit" => {
            match (parse_i64(&call.args[5]), parse_i64(&call.args[6])) {
                (Some(o), Some(c)) => (offset, count) = (o, c),
                _ => return Outcome::error(NOT_INTEGER),
            }
        }
        _ => return Outcome::error(SYNTAX),
    }
    let query = RangeQuery { by: RangeBy::Lex(range), reverse, offset, count, with_scores: false };
    let protocol = call.conn.protocol;
    from_index(call, KeyType::ZSet, move |view, coll| {
        range_reply(run_range(view, coll, &query), false, protocol)
    })
}

fn zrangebylex(call: &mut Call<'_>) -> Outcome {
    range_by_lex(call, false)
}

fn zrevrangebylex(call: &mut Call<'_>) -> Outcome {
    range_by_lex(call, true)
}

fn zlexcount(call: &mut Call<'_>) -> Outcome {
    let Some(range) = LexRange::parse(&call.args[2], &call.args[3]) else {
        return Outcome::error(LEX_RANGE_INVALID);
    };
    from_index(call, KeyType::ZSet, move |view, coll| match range.items(view, &coll.id) {
        Some((start, end)) => {
            Reply::Integer(view.count(bound_ref(&start), bound_ref(&end), usize::MAX) as i64)
        }
        None => Reply::Integer(0),
    })
}

// -- ZRANDMEMBER and ZSCAN -------------------------------------------------------------------------

fn random_u64() -> u64 {
    use std::sync::atomic::AtomicU64;
    static STATE: AtomicU64 = AtomicU64::new(0);
    let nonce = STATE.fetch_add(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed);
    xxhash_rust::xxh3::xxh3_64_with_seed(&keyspace::new_version().to_le_bytes(), nonce)
}

/// The members at `ranks` (ascending positions, repeats allowed) of `coll`, in the order of
/// `ranks` as given: one walk over the by-score items, holding only those picked.
fn members_at(view: &ExecView<'_>, coll: &Coll, ranks: &[usize]) -> Vec<(f64, Vec<u8>)> {
    let mut order: Vec<usize> = (0..ranks.len()).collect();
    order.sort_by_key(|&at| ranks[at]);
    let mut out: Vec<Option<(f64, Vec<u8>)>> = vec![None; ranks.len()];
    let (_, end) = all_scores(&coll.id);
    let mut start = all_scores(&coll.id).0;
    let mut position = 0;
    let mut next = 0;
    const STEP: usize = 1024;
    while next < order.len() {
        let items = view.keys(bound_ref(&start), bound_ref(&end), STEP);
        if items.is_empty() {
            break;
        }
        while next < order.len() && ranks[order[next]] < position + items.len() {
            let item = &items[ranks[order[next]] - position];
            out[order[next]] =
                keyspace::decode_score(item, coll.id.len()).map(|(s, m)| (s, m.to_vec()));
            next += 1;
        }
        position += items.len();
        start = Bound::Excluded(items[items.len() - 1].clone());
    }
    out.into_iter().flatten().collect()
}

fn zrandmember(call: &mut Call<'_>) -> Outcome {
    let (count, with_scores) = match call.args.len() {
        2 => (None, false),
        3 | 4 => {
            let count = match parse_i64(&call.args[2]) {
                Some(i64::MIN) => {
                    return Outcome::error(format!(
                        "ERR value is out of range, value must between {} and {}",
                        -i64::MAX,
                        i64::MAX
                    ))
                }
                Some(count) => count,
                None => return Outcome::error(NOT_INTEGER),
            };
            if call.args.len() == 4 && call.word(3) != "withscores" {
                return Outcome::error(SYNTAX);
            }
            (Some(count), call.args.len() == 4)
        }
        _ => return Outcome::error(SYNTAX),
    };
    let limit = call.server.settings.client_output_bytes_max.load(Ordering::Relaxed);
    let protocol = call.conn.protocol;
    from_index(call, KeyType::ZSet, move |view, coll| {
        if !coll.exists() {
            return if count.is_some() { Reply::Array(Vec::new()) } else { Reply::Null };
        }
        let len = coll.count();
        let ranks: Vec<usize> = match count {
            None => vec![(random_u64() % len as u64) as usize],
            Some(count) if count >= 0 => {
                let n = (count as usize).min(len);
                if (n as u128) * 48 > limit as u128 {
                    return too_large(n * 48, limit);
                }
                // n distinct ranks: Floyd's sampling.
                let mut chosen = std::collections::BTreeSet::new();
                for j in len - n..len {
                    let pick = (random_u64() % (j as u64 + 1)) as usize;
                    if !chosen.insert(pick) {
                        chosen.insert(j);
                    }
                }
                let mut ranks: Vec<usize> = chosen.into_iter().collect();
                // Shuffled: Redis's order is random too.
                for at in (1..ranks.len()).rev() {
                    ranks.swap(at, (random_u64() % (at as u64 + 1)) as usize);
                }
                ranks
            }
            Some(count) => {
                let n = count.unsigned_abs() as usize;
                if (n as u128) * 48 > limit as u128 {
                    return too_large(n * 48, limit);
                }
                (0..n).map(|_| (random_u64() % len as u64) as usize).collect()
            }
        };
        let items = members_at(view, coll, &ranks);
        match (count, with_scores) {
            (None, _) => items.into_iter().next().map_or(Reply::Null, |(_, m)| Reply::Bulk(m)),
            (Some(_), false) => {
                Reply::Array(items.into_iter().map(|(_, m)| Reply::Bulk(m)).collect())
            }
            (Some(_), true) => scored_reply(items, true, protocol),
        }
    })
}

fn too_large(bytes: usize, limit: usize) -> Reply {
    Reply::Error(format!(
        "ERR reply of at least {bytes} bytes exceeds the client output limit ({limit} bytes)"
    ))
}

/// ZSCAN's cursor: the first 7 bytes of the member to continue from, big-endian, plus one (so it
/// is never 0, which means start and done). Members are listed in byte order; the members that
/// share the cursor's 7-byte prefix are all returned in one page (a page may pass COUNT), so the
/// cursor always moves on, and every member present for the whole scan is returned.
fn zscan_cursor(member: &[u8]) -> u64 {
    let mut prefix = [0u8; 8];
    let n = member.len().min(7);
    prefix[1..1 + n].copy_from_slice(&member[..n]);
    u64::from_be_bytes(prefix) + 1
}

fn zscan_start(cursor: u64) -> Vec<u8> {
    let bytes = (cursor - 1).to_be_bytes();
    let mut prefix = bytes[1..].to_vec();
    while prefix.last() == Some(&0) {
        prefix.pop();
    }
    prefix
}

fn zscan(call: &mut Call<'_>) -> Outcome {
    let Some(cursor) = std::str::from_utf8(&call.args[2]).ok().and_then(|c| c.parse::<u64>().ok())
    else {
        return Outcome::error("ERR invalid cursor");
    };
    let mut pattern = None;
    let mut count = SCAN_COUNT_DEFAULT;
    let mut options_error = None;
    let mut at = 3;
    while at < call.args.len() {
        match (call.word(at).as_str(), call.args.get(at + 1)) {
            ("match", Some(value)) => pattern = (value[..] != b"*"[..]).then(|| value.clone()),
            ("count", Some(value)) => match parse_i64(value) {
                Some(n) if n >= 1 => count = (n as usize).min(SCAN_COUNT_MAX),
                Some(_) => options_error = Some(Reply::error(SYNTAX)),
                None => options_error = Some(Reply::error(NOT_INTEGER)),
            },
            _ => options_error = Some(Reply::error(SYNTAX)),
        }
        if options_error.is_some() {
            break;
        }
        at += 2;
    }
    let mut members: Vec<Vec<u8>> = Vec::new();
    let mut next = 0;
    on_collection(call, KeyType::ZSet, move |view, input, coll| match input {
        Input::Start => {
            let page = |next: u64, items: Vec<Reply>| {
                Reply::Array(vec![Reply::Bulk(next.to_string().into_bytes()), Reply::Array(items)])
            };
            if !coll.exists() {
                return Next::Reply(page(0, Vec::new()));
            }
            if let Some(error) = &options_error {
                return Next::Reply(error.clone());
            }
            let (first, end) = keyspace::members_range(&coll.id);
            let start = match (cursor, &first) {
                (0, _) => first.clone(),
                (cursor, Bound::Included(prefix)) => {
                    let mut key = prefix.clone();
                    key.extend_from_slice(&zscan_start(cursor));
                    Bound::Included(key)
                }
                _ => first.clone(),
            };
            let prefix_bytes = match &first {
                Bound::Included(prefix) => prefix.len(),
                _ => return Next::Reply(page(0, Vec::new())),
            };
            let mut listed: Vec<Vec<u8>> = view
                .keys(bound_ref(&start), bound_ref(&end), count + 1)
                .into_iter()
                .map(|item| item[prefix_bytes..].to_vec())
                .collect();
            next = 0;
            if listed.len() > count {
                let following = listed.pop().unwrap_or_default();
                next = zscan_cursor(&following);
                if next == cursor {
                    // The whole page shares the cursor's prefix: it takes every member with
                    // that prefix, so the next cursor moves on.
                    listed.push(following);
                    next = 0;
                    let mut after = match &first {
                        Bound::Included(prefix) => {
                            let mut key = prefix.clone();
                            key.extend_from_slice(
                                listed.last().map(Vec::as_slice).unwrap_or_default(),
                            );
                            Bound::Excluded(key)
                        }
                        _ => return Next::Reply(page(0, Vec::new())),
                    };
                    'more: loop {
                        let more = view.keys(bound_ref(&after), bound_ref(&end), 64);
                        for item in &more {
                            let member = item[prefix_bytes..].to_vec();
                            if zscan_cursor(&member) != cursor {
                                next = zscan_cursor(&member);
                                break 'more;
                            }
                            listed.push(member);
                        }
                        match more.last() {
                            Some(last) if more.len() == 64 => after = Bound::Excluded(last.clone()),
                            _ => break,
                        }
                    }
                }
            }
            members = listed
                .into_iter()
                .filter(|member| pattern.as_ref().is_none_or(|p| glob_match(p, member)))
                .collect();
            if members.is_empty() {
                return Next::Reply(page(next, Vec::new()));
            }
            Next::Read(members.iter().map(|m| ReadOp::Get(member_key(&coll.id, m))).collect())
        }
        Input::Read(results) => {
            let mut flat = Vec::with_capacity(2 * members.len());
            for (member, result) in std::mem::take(&mut members).into_iter().zip(results) {
                let Some(score) = value_of(Some(result)).as_deref().and_then(decode_score_value)
                else {
                    return unexpected();
                };
                flat.push(Reply::Bulk(member));
                flat.push(Reply::Bulk(format_double(score).into_bytes()));
            }
            Next::Reply(Reply::Array(vec![
                Reply::Bulk(next.to_string().into_bytes()),
                Reply::Array(flat),
            ]))
        }
        Input::Written => unexpected(),
    })
}

// -- ZUNION, ZINTER, ZDIFF, their STORE forms, ZINTERCARD, ZRANGESTORE ---------------------------

/// (score, member) pairs.
type Scored = Vec<(f64, Vec<u8>)>;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Algebra {
    Union,
    Inter,
    Diff,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Aggregate {
    Sum,
    Min,
    Max,
}

struct AlgebraArgs {
    keys: Vec<Vec<u8>>,
    weights: Vec<f64>,
    aggregate: Aggregate,
    with_scores: bool,
}

/// `numkeys key... [WEIGHTS w...] [AGGREGATE SUM|MIN|MAX] [WITHSCORES]` from `at`; ZDIFF takes
/// neither WEIGHTS nor AGGREGATE; the STORE forms take no WITHSCORES.
fn parse_algebra(
    call: &Call<'_>,
    at: usize,
    algebra: Algebra,
    store: bool,
) -> Result<AlgebraArgs, Reply> {
    let numkeys = match parse_i64(&call.args[at]) {
        Some(n) if n > 0 => n as usize,
        Some(_) => {
            return Err(Reply::Error(format!(
                "ERR at least 1 input key is needed for '{}' command",
                call.word(0)
            )))
        }
        None => return Err(Reply::error(NOT_INTEGER)),
    };
    let first = at + 1;
    if first + numkeys > call.args.len() {
        return Err(Reply::error(SYNTAX));
    }
    let keys: Vec<Vec<u8>> = call.args[first..first + numkeys].to_vec();
    let mut args = AlgebraArgs {
        keys,
        weights: vec![1.0; numkeys],
        aggregate: Aggregate::Sum,
        with_scores: false,
    };
    let mut rest = first + numkeys;
    while rest < call.args.len() {
        let left = call.args.len() - rest - 1;
        match call.word(rest).as_str() {
            "weights" if algebra != Algebra::Diff && left >= numkeys => {
                for k in 0..numkeys {
                    args.weights[k] = parse_f64(&call.args[rest + 1 + k])
                        .ok_or_else(|| Reply::error("ERR weight value is not a float"))?;
                }
                rest += numkeys;
            }
            "aggregate" if algebra != Algebra::Diff && left >= 1 => {
                args.aggregate = match call.word(rest + 1).as_str() {
                    "sum" => Aggregate::Sum,
                    "min" => Aggregate::Min,
                    "max" => Aggregate::Max,
                    _ => return Err(Reply::error(SYNTAX)),
                };
                rest += 1;
            }
            "withscores" if !store => args.with_scores = true,
            _ => return Err(Reply::error(SYNTAX)),
        }
        rest += 1;
    }
    Ok(args)
}

/// Each key's (member -> score) (None: missing; a set's members score 1), read consistently
/// over the shards from the indexes alone; WRONGTYPE for a key of another type.
async fn read_zsets(server: &Arc<Server>, keys: &[Vec<u8>]) -> Result<Vec<Option<Scored>>, Reply> {
    let db = server.db.clone();
    let limit = server.settings.client_output_bytes_max.load(Ordering::Relaxed);
    let read = db.read_consistently(|| async {
        let mut plan = Plan::new();
        let mut positions = Vec::new();
        for (shard, at) in by_shard(&db, keys) {
            let group: Vec<Vec<u8>> = at.iter().map(|&i| keys[i].clone()).collect();
            positions.push(at);
            let mut metas: Vec<(usize, KeyType, Expiry)> = Vec::new();
            let mut answers: Vec<Reply> = Vec::new();
            plan.add(shard, group.clone(), move |view, input| match input {
                Input::Start => {
                    answers = vec![Reply::Null; group.len()];
                    let mut reads = smallvec::SmallVec::new();
                    for (at, key) in group.iter().enumerate() {
                        let expiry = Expiry::of(view, key);
                        match expiry.live(stored_type(view, key)) {
                            None => {}
                            Some(ty @ (KeyType::ZSet | KeyType::Set)) => {
                                reads.push(ReadOp::Get(keyspace::meta_key(key, ty)));
                                metas.push((at, ty, expiry));
                            }
                            Some(_) => answers[at] = Reply::error(super::WRONGTYPE),
                        }
                    }
                    if reads.is_empty() {
                        return Next::Reply(Reply::Array(std::mem::take(&mut answers)));
                    }
                    Next::Read(reads)
                }
                Input::Read(results) => {
                    let mut bytes = 0usize;
                    for ((at, ty, expiry), result) in
                        std::mem::take(&mut metas).into_iter().zip(results)
                    {
                        let meta = match coll_meta(Some(result)) {
                            Ok(meta) => meta,
                            Err(error) => return Next::Reply(error),
                        };
                        let coll = coll_make(view, group[at].clone(), ty, expiry, meta);
                        let items: Vec<(f64, Vec<u8>)> = if ty == KeyType::ZSet {
                            by_score(view, &coll.id, &all_scores(&coll.id), usize::MAX)
                        } else {
                            let (start, end) = keyspace::id_range(keyspace::TAG_SET, &coll.id);
                            view.keys(bound_ref(&start), bound_ref(&end), usize::MAX)
                                .iter()
                                .filter_map(|item| keyspace::decode_field(item, coll.id.len()))
                                .map(|(_, m)| (1.0, m.to_vec()))
                                .collect()
                        };
                        bytes += items.iter().map(|(_, m)| m.len() + 48).sum::<usize>();
                        if bytes > limit {
                            return Next::Reply(too_large(bytes, limit));
                        }
                        let mut flat = Vec::with_capacity(2 * items.len());
                        for (score, member) in items {
                            flat.push(Reply::Double(score));
                            flat.push(Reply::Bulk(member));
                        }
                        answers[at] = Reply::Array(flat);
                    }
                    Next::Reply(Reply::Array(std::mem::take(&mut answers)))
                }
                Input::Written => unexpected(),
            });
        }
        let count = keys.len();
        let outcome = plan.finish(Box::new(move |replies| {
            let mut ordered = vec![Reply::Null; count];
            for (reply, at) in replies.into_iter().zip(positions) {
                match reply {
                    Reply::Array(answers) => {
                        for (answer, i) in answers.into_iter().zip(at) {
                            ordered[i] = answer;
                        }
                    }
                    error => return error,
                }
            }
            Reply::Array(ordered)
        }));
        Ok::<Reply, std::convert::Infallible>(run_outcome(&db, outcome).await)
    });
    let replies = match read.await {
        Ok(Reply::Array(replies)) => replies,
        Ok(other) => return Err(other),
        Err(never) => match never {},
    };
    if let Some(error) = replies.iter().find(|reply| matches!(reply, Reply::Error(_))) {
        return Err(error.clone());
    }
    Ok(replies
        .into_iter()
        .map(|reply| match reply {
            Reply::Array(flat) => {
                let mut items = Vec::with_capacity(flat.len() / 2);
                let mut flat = flat.into_iter();
                while let (Some(Reply::Double(score)), Some(Reply::Bulk(member))) =
                    (flat.next(), flat.next())
                {
                    items.push((score, member));
                }
                Some(items)
            }
            _ => None,
        })
        .collect())
}

/// Redis's aggregate of two scores (a NaN from inf - inf is 0, as Redis makes it).
fn aggregate(how: Aggregate, a: f64, b: f64) -> f64 {
    let out = match how {
        Aggregate::Sum => a + b,
        Aggregate::Min => a.min(b),
        Aggregate::Max => a.max(b),
    };
    if out.is_nan() {
        0.0
    } else {
        out
    }
}

fn weighted(score: f64, weight: f64) -> f64 {
    let out = score * weight;
    if out.is_nan() {
        0.0
    } else {
        out
    }
}

/// The result of `algebra` over `sets`, sorted as Redis sorts a sorted set (score, member).
fn compute(algebra: Algebra, args: &AlgebraArgs, sets: Vec<Option<Scored>>) -> Scored {
    let mut sets = sets.into_iter();
    let first = sets.next().flatten().unwrap_or_default();
    let rest: Vec<HashMap<Vec<u8>, f64>> = sets
        .map(|set| set.unwrap_or_default().into_iter().map(|(s, m)| (m, s)).collect())
        .collect();
    let mut out: HashMap<Vec<u8>, f64> = HashMap::new();
    match algebra {
        Algebra::Inter => {
            'members: for (score, member) in first {
                let mut total = weighted(score, args.weights[0]);
                for (k, set) in rest.iter().enumerate() {
                    match set.get(&member) {
                        Some(&other) => {
                            total = aggregate(
                                args.aggregate,
                                total,
                                weighted(other, args.weights[k + 1]),
                            )
                        }
                        None => continue 'members,
                    }
                }
                out.insert(member, total);
            }
        }
        Algebra::Union => {
            for (score, member) in first {
                out.insert(member, weighted(score, args.weights[0]));
            }
            for (k, set) in rest.iter().enumerate() {
                for (member, &score) in set {
                    let score = weighted(score, args.weights[k + 1]);
                    out.entry(member.clone())
                        .and_modify(|total| *total = aggregate(args.aggregate, *total, score))
                        .or_insert(score);
                }
            }
        }
        Algebra::Diff => {
            for (score, member) in first {
                if !rest.iter().any(|set| set.contains_key(&member)) {
                    out.insert(member, score);
                }
            }
        }
    }
    let mut items: Vec<(f64, Vec<u8>)> = out.into_iter().map(|(m, s)| (s, m)).collect();
    items.sort_by(|a, b| a.0.total_cmp(&b.0).then_with(|| a.1.cmp(&b.1)));
    items
}

fn algebra_command(call: &mut Call<'_>, algebra: Algebra) -> Outcome {
    let args = match parse_algebra(call, 1, algebra, false) {
        Ok(args) => args,
        Err(error) => return Outcome::Reply(error),
    };
    let server = call.server.clone();
    let protocol = call.conn.protocol;
    Outcome::AfterPending(Box::pin(async move {
        match read_zsets(&server, &args.keys).await {
            Ok(sets) => {
                let items = compute(algebra, &args, sets);
                range_reply(items, args.with_scores, protocol)
            }
            Err(error) => error,
        }
    }))
}

fn zunion(call: &mut Call<'_>) -> Outcome {
    algebra_command(call, Algebra::Union)
}

fn zinter(call: &mut Call<'_>) -> Outcome {
    algebra_command(call, Algebra::Inter)
}

fn zdiff(call: &mut Call<'_>) -> Outcome {
    algebra_command(call, Algebra::Diff)
}

/// Replaces `destination` with a sorted set of `items` (deleted if none); answers the count.
fn store_zset(db: &Db, destination: Vec<u8>, items: Vec<(f64, Vec<u8>)>) -> Outcome {
    let mut plan = Plan::new();
    let mut items = Some(items);
    let mut written = 0;
    plan.add(
        db.shard_of(&destination),
        vec![destination.clone()],
        move |view, input| match input {
            Input::Start => {
                let Some(items) = items.take() else { return unexpected() };
                let expiry = Expiry::of(view, &destination);
                let existing = expiry.live(stored_type(view, &destination));
                let (mut ops, expiry) = match existing {
                    Some(ty) => (delete_ops(&destination, ty, &expiry), Expiry::default()),
                    None => (Vec::new(), expiry),
                };
                written = items.len();
                if !items.is_empty() {
                    let coll = coll_make(view, destination.clone(), KeyType::ZSet, expiry, None);
                    for (score, member) in &items {
                        ops.push(BatchOp::Put {
                            key: member_key(&coll.id, member),
                            value: encode_score(*score),
                        });
                        ops.push(BatchOp::Put {
                            key: score_key(&coll.id, *score, member),
                            value: Vec::new(),
                        });
                    }
                    ops.extend(coll.meta_ops(items.len()));
                } else {
                    ops.extend(expiry.before(Vec::new()));
                }
                let ops = last_op_wins(ops);
                if ops.is_empty() {
                    return Next::Reply(Reply::Integer(0));
                }
                if let Err(error) = check_batch(&ops) {
                    return Next::Reply(error);
                }
                Next::Write(ops)
            }
            Input::Written => Next::Reply(Reply::Integer(written as i64)),
            Input::Read(_) => unexpected(),
        },
    );
    plan.finish(Box::new(|mut replies| replies.pop().unwrap_or(Reply::Null)))
}

fn algebra_store(call: &mut Call<'_>, algebra: Algebra) -> Outcome {
    let args = match parse_algebra(call, 2, algebra, true) {
        Ok(args) => args,
        Err(error) => return Outcome::Reply(error),
    };
    let destination = call.args[1].clone();
    let server = call.server.clone();
    Outcome::AfterPending(Box::pin(async move {
        let items = match read_zsets(&server, &args.keys).await {
            Ok(sets) => compute(algebra, &args, sets),
            Err(error) => return error,
        };
        let reply =
            run_outcome(&server.db, store_zset(&server.db, destination.clone(), items)).await;
        server.waiters.wake(&destination);
        reply
    }))
}

fn zunionstore(call: &mut Call<'_>) -> Outcome {
    algebra_store(call, Algebra::Union)
}

fn zinterstore(call: &mut Call<'_>) -> Outcome {
    algebra_store(call, Algebra::Inter)
}

fn zdiffstore(call: &mut Call<'_>) -> Outcome {
    algebra_store(call, Algebra::Diff)
}

fn zintercard(call: &mut Call<'_>) -> Outcome {
    let numkeys = match parse_i64(&call.args[1]) {
        Some(n) if n > 0 => n as usize,
        Some(_) => {
            return Outcome::error("ERR at least 1 input key is needed for 'zintercard' command")
        }
        None => return Outcome::error(NOT_INTEGER),
    };
    // Redis 7.0 answers ZINTERCARD's short key list a syntax error (SINTERCARD's is worded).
    if numkeys > call.args.len() - 2 {
        return Outcome::error(SYNTAX);
    }
    let keys: Vec<Vec<u8>> = call.args[2..2 + numkeys].to_vec();
    let mut limit = 0usize;
    let mut at = 2 + numkeys;
    while at < call.args.len() {
        match (call.word(at).as_str(), call.args.get(at + 1)) {
            ("limit", Some(value)) => match parse_i64(value) {
                Some(n) if n >= 0 => limit = n as usize,
                Some(_) => return Outcome::error("ERR LIMIT can't be negative"),
                None => return Outcome::error(NOT_INTEGER),
            },
            _ => return Outcome::error(SYNTAX),
        }
        at += 2;
    }
    let server = call.server.clone();
    let args = AlgebraArgs {
        weights: vec![1.0; keys.len()],
        keys,
        aggregate: Aggregate::Sum,
        with_scores: false,
    };
    Outcome::AfterPending(Box::pin(async move {
        match read_zsets(&server, &args.keys).await {
            Ok(sets) => {
                let count = compute(Algebra::Inter, &args, sets).len();
                Reply::Integer(if limit > 0 { count.min(limit) } else { count } as i64)
            }
            Err(error) => error,
        }
    }))
}

/// ZRANGESTORE dst src min max [BYSCORE|BYLEX] [REV] [LIMIT offset count].
fn zrangestore(call: &mut Call<'_>) -> Outcome {
    // The range arguments as ZRANGE reads them: src at 1.
    let mut args = call.args.clone();
    let destination = args.remove(1);
    let query = match super::zsets::parse_range(&args, None, None) {
        Ok(query) => query,
        Err(error) => return Outcome::Reply(error),
    };
    if query.with_scores {
        return Outcome::error(SYNTAX);
    }
    let source = args[1].clone();
    let server = call.server.clone();
    Outcome::AfterPending(Box::pin(async move {
        let read = read_range(&server, source, query);
        let items = match run_outcome(&server.db, read).await {
            Reply::Array(flat) => {
                let mut items = Vec::new();
                let mut flat = flat.into_iter();
                while let (Some(Reply::Double(score)), Some(Reply::Bulk(member))) =
                    (flat.next(), flat.next())
                {
                    items.push((score, member));
                }
                items
            }
            other => return other,
        };
        let reply =
            run_outcome(&server.db, store_zset(&server.db, destination.clone(), items)).await;
        server.waiters.wake(&destination);
        reply
    }))
}

/// The (score, member) pairs `query` selects from sorted set `key`, flat (score, member, ...).
fn read_range(server: &Server, key: Vec<u8>, query: RangeQuery) -> Outcome {
    let limit = server.settings.client_output_bytes_max.load(Ordering::Relaxed);
    on_collection_key(&server.db, key, KeyType::ZSet, false, move |view, input, coll| match input {
        Input::Start => {
            let items = run_range(view, coll, &query);
            let bytes: usize = items.iter().map(|(_, m)| m.len() + 48).sum();
            if bytes > limit {
                return Next::Reply(too_large(bytes, limit));
            }
            let mut flat = Vec::with_capacity(2 * items.len());
            for (score, member) in items {
                flat.push(Reply::Double(score));
                flat.push(Reply::Bulk(member));
            }
            Next::Reply(Reply::Array(flat))
        }
        _ => unexpected(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zscan_cursors_order_like_members_and_are_never_zero() {
        assert!(zscan_cursor(b"") >= 1);
        assert!(zscan_cursor(b"a") < zscan_cursor(b"b"));
        assert_eq!(zscan_cursor(b"abcdefgh"), zscan_cursor(b"abcdefgz"), "7 bytes of prefix");
        assert_eq!(zscan_start(zscan_cursor(b"abc")), b"abc");
        assert_eq!(zscan_start(zscan_cursor(b"abcdefgh")), b"abcdefg");
    }

    #[test]
    fn aggregates_follow_redis() {
        assert_eq!(aggregate(Aggregate::Sum, f64::INFINITY, f64::NEG_INFINITY), 0.0);
        assert_eq!(weighted(f64::INFINITY, 0.0), 0.0);
        assert_eq!(aggregate(Aggregate::Max, 1.0, 2.0), 2.0);
    }
}
