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

use super::View;
use copse::exec::ReadOp;
use copse::BatchOp;

use super::keys::{glob_match, SCAN_COUNT_DEFAULT, SCAN_COUNT_MAX};
use super::lists::{blocking, parse_timeout};
use super::zsets::{
    all_scores, by_score, range_reply, rank_window, run_range, LexRange, RangeBy, RangeQuery,
    ScoreRange, LEX_RANGE_INVALID, MIN_MAX_NOT_FLOAT,
};
use super::{
    answer, bound_ref, check_batch, delete_ops, from_index, on_collection, on_collection_key,
    parse_f64, parse_i64, random_u64, reply_too_large, run_outcome, unexpected, value_of, Call,
    Coll, Input, Next, Outcome, Spec, NOT_INTEGER, SYNTAX,
};
use crate::context::Server;
use crate::keyspace::{self, decode_score_value, member_key, score_key, KeyType};
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

/// Members with scores: flat in RESP2; in RESP3 `[member, score]` pairs when `pairs` (else
/// flat too, as Redis answers ZPOPMIN without a count).
fn scored_reply(items: Vec<(f64, Vec<u8>)>, pairs: bool, protocol: Protocol) -> Reply {
    let shape = if pairs { protocol } else { Protocol::Resp2 };
    range_reply(items, true, shape)
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
    let (keys, end_at, count) = super::parse_multi_pop(call, at)?;
    let max = match call.word(end_at).as_str() {
        "min" => false,
        "max" => true,
        _ => return Err(Reply::error(SYNTAX)),
    };
    Ok((keys, max, count))
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
    Outcome::AfterPending(Box::pin(blocking(
        server,
        crate::waiters::Kind::ZSet,
        watched,
        timeout,
        move |server| {
            let keys = keys.clone();
            async move { try_pops(&server, &keys, max, n, mpop_reply).await }
        },
    )))
}

fn blocking_pop(call: &mut Call<'_>, max: bool) -> Outcome {
    let timeout = match parse_timeout(&call.args[call.args.len() - 1]) {
        Ok(timeout) => timeout,
        Err(error) => return Outcome::Reply(error),
    };
    let keys = Arc::new(call.args[1..call.args.len() - 1].to_vec());
    let server = call.server.clone();
    let watched = keys.to_vec();
    Outcome::AfterPending(Box::pin(blocking(
        server,
        crate::waiters::Kind::ZSet,
        watched,
        timeout,
        move |server| {
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
        },
    )))
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
    F: FnMut(&View<'_>, &Coll) -> Vec<(f64, Vec<u8>)> + Send + 'static,
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

/// The members at `ranks` (ascending positions, repeats allowed) of `coll`, in the order of
/// `ranks` as given: one walk over the by-score items, holding only those picked.
fn members_at(
    view: &View<'_>,
    coll: &Coll,
    ranks: &[usize],
    limit: usize,
) -> Result<Vec<(f64, Vec<u8>)>, Reply> {
    let mut order: Vec<usize> = (0..ranks.len()).collect();
    order.sort_by_key(|&at| ranks[at]);
    let mut out: Vec<Option<(f64, Vec<u8>)>> = vec![None; ranks.len()];
    let (_, end) = all_scores(&coll.id);
    let mut start = all_scores(&coll.id).0;
    let mut position = 0;
    let mut next = 0;
    // Counted as picked, so a reply past the limit stops here, holding about the limit.
    let mut bytes = 0usize;
    const STEP: usize = 1024;
    while next < order.len() {
        let items = view.keys(bound_ref(&start), bound_ref(&end), STEP);
        if items.is_empty() {
            break;
        }
        while next < order.len() && ranks[order[next]] < position + items.len() {
            let item = &items[ranks[order[next]] - position];
            let picked = keyspace::decode_score(item, coll.id.len()).map(|(s, m)| (s, m.to_vec()));
            bytes += picked.as_ref().map_or(0, |(_, m)| m.len()) + RANDOM_PICK_OVERHEAD_BYTES;
            if bytes > limit {
                return Err(reply_too_large(bytes, limit));
            }
            out[order[next]] = picked;
            next += 1;
        }
        position += items.len();
        start = Bound::Excluded(items[items.len() - 1].clone());
    }
    Ok(out.into_iter().flatten().collect())
}

/// What a random pick costs in a reply besides the member's bytes (its bulk header, a score).
const RANDOM_PICK_OVERHEAD_BYTES: usize = 32;

fn zrandmember(call: &mut Call<'_>) -> Outcome {
    let (count, with_scores) = match super::parse_random_count(call, "withscores") {
        Ok(parsed) => parsed,
        Err(error) => return Outcome::Reply(error),
    };
    let limit = call.server.settings.client_output_bytes_max.load(Ordering::Relaxed);
    let protocol = call.conn.protocol;
    from_index(call, KeyType::ZSet, move |view, coll| {
        if !coll.exists() {
            return if count.is_some() { Reply::Array(Vec::new()) } else { Reply::Null };
        }
        let len = coll.count();
        // Every pick costs at least its overhead: a count past the limit is refused before
        // any is chosen.
        let wanted = count.map_or(1, |count| {
            if count >= 0 {
                (count as u64).min(len as u64)
            } else {
                count.unsigned_abs()
            }
        });
        let least = (wanted as u128) * RANDOM_PICK_OVERHEAD_BYTES as u128;
        if least > limit as u128 {
            return reply_too_large(least.min(usize::MAX as u128) as usize, limit);
        }
        let ranks: Vec<usize> = match count {
            None => vec![(random_u64() % len as u64) as usize],
            Some(count) if count >= 0 => {
                let n = (count as usize).min(len);
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
                (0..count.unsigned_abs()).map(|_| (random_u64() % len as u64) as usize).collect()
            }
        };
        let items = match members_at(view, coll, &ranks, limit) {
            Ok(items) => items,
            Err(error) => return error,
        };
        match (count, with_scores) {
            (None, _) => items.into_iter().next().map_or(Reply::Null, |(_, m)| Reply::Bulk(m)),
            (Some(_), false) => {
                Reply::Array(items.into_iter().map(|(_, m)| Reply::Bulk(m)).collect())
            }
            (Some(_), true) => scored_reply(items, true, protocol),
        }
    })
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
    let mut scores: Vec<f64> = Vec::new();
    let mut next = 0;
    let limit = super::store::reply_limit(call.server);
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
            let bytes: usize = members.iter().map(|m| m.len() + 64).sum();
            if bytes > limit {
                return Next::Reply(reply_too_large(bytes, limit));
            }
            read_scores_step(&coll.id, &members, 0)
        }
        Input::Read(results) => {
            for result in results {
                let Some(score) = value_of(Some(result)).as_deref().and_then(decode_score_value)
                else {
                    return unexpected();
                };
                scores.push(score);
            }
            if scores.len() < members.len() {
                return read_scores_step(&coll.id, &members, scores.len());
            }
            let mut flat = Vec::with_capacity(2 * members.len());
            let scores = std::mem::take(&mut scores);
            for (member, score) in std::mem::take(&mut members).into_iter().zip(scores) {
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

/// The next step's reads of the scores of `members` from `from` on (a page may hold more
/// members than one step reads: those sharing a cursor prefix come in one page).
fn read_scores_step(id: &[u8], members: &[Vec<u8>], from: usize) -> Next {
    let end = (from + copse::limits::EXEC_READS_MAX).min(members.len());
    Next::Read(members[from..end].iter().map(|m| ReadOp::Get(member_key(id, m))).collect())
}

// -- ZUNION, ZINTER, ZDIFF, their STORE forms, ZINTERCARD, ZRANGESTORE ---------------------------

use super::store::Scored;

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

/// Each key's (score, member) pairs (None: missing; a set's members score 1), or WRONGTYPE
/// (`store.rs`); `limit`: a reply's bound in bytes, or None.
async fn read_zsets(
    server: &Arc<Server>,
    keys: &[Vec<u8>],
    limit: Option<usize>,
) -> Result<Vec<Option<Scored>>, Reply> {
    Ok(super::store::read_sources(server, keys, &[KeyType::ZSet, KeyType::Set], limit)
        .await?
        .elements)
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
    // -0 and 0 are one score (zsets.rs invariant).
    let mut items: Vec<(f64, Vec<u8>)> =
        out.into_iter().map(|(m, s)| (if s == 0.0 { 0.0 } else { s }, m)).collect();
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
    let limit = super::store::reply_limit(&server);
    Outcome::AfterPending(Box::pin(async move {
        match read_zsets(&server, &args.keys, Some(limit)).await {
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

/// The STORE forms: the result replaces `destination` atomically with the read of the sources
/// (`store.rs`).
fn algebra_store(call: &mut Call<'_>, algebra: Algebra) -> Outcome {
    let args = match parse_algebra(call, 2, algebra, true) {
        Ok(args) => args,
        Err(error) => return Outcome::Reply(error),
    };
    let destination = call.args[1].clone();
    let server = call.server.clone();
    Outcome::AfterPending(Box::pin(async move {
        let keys = args.keys.clone();
        super::store::store(
            &server,
            keys,
            &[KeyType::ZSet, KeyType::Set],
            destination,
            KeyType::ZSet,
            move |sets| Ok(compute(algebra, &args, sets)),
        )
        .await
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
    // Redis 7.0 answers ZINTERCARD's short key list a syntax error (SINTERCARD's is worded).
    const ERRORS: super::NumkeysErrors = super::NumkeysErrors {
        not_positive: "ERR at least 1 input key is needed for 'zintercard' command",
        not_integer: NOT_INTEGER,
        too_few: SYNTAX,
    };
    let (keys, limit) = match super::parse_intercard(call, &ERRORS) {
        Ok(parsed) => parsed,
        Err(error) => return Outcome::Reply(error),
    };
    let server = call.server.clone();
    let args = AlgebraArgs {
        weights: vec![1.0; keys.len()],
        keys,
        aggregate: Aggregate::Sum,
        with_scores: false,
    };
    Outcome::AfterPending(Box::pin(async move {
        match read_zsets(&server, &args.keys, None).await {
            Ok(sets) => {
                let count = compute(Algebra::Inter, &args, sets).len();
                Reply::Integer(if limit > 0 { count.min(limit) } else { count } as i64)
            }
            Err(error) => error,
        }
    }))
}

/// ZRANGESTORE dst src min max [BYSCORE|BYLEX] [REV] [LIMIT offset count]: the range selected
/// from the source's elements, stored atomically with their read (`store.rs`).
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
        super::store::store(
            &server,
            vec![source],
            &[KeyType::ZSet],
            destination,
            KeyType::ZSet,
            move |mut sets| {
                let items = sets.pop().flatten().unwrap_or_default();
                Ok(select_range(items, &query))
            },
        )
        .await
    }))
}

/// `query` over a sorted set's (score, member) pairs in score order, as `zsets::run_range` runs
/// it over the index.
fn select_range(items: Scored, query: &RangeQuery) -> Scored {
    let mut items = match &query.by {
        RangeBy::Rank(start, stop) => {
            let len = items.len();
            let Some((first, last)) = rank_window(*start, *stop, len) else { return Vec::new() };
            let (low, high) =
                if query.reverse { (len - 1 - last, len - 1 - first) } else { (first, last) };
            let mut picked: Scored = items.into_iter().skip(low).take(high - low + 1).collect();
            if query.reverse {
                picked.reverse();
            }
            return picked;
        }
        RangeBy::Score(range) => {
            if range.is_empty() {
                return Vec::new();
            }
            items.into_iter().filter(|(score, _)| range.contains(*score)).collect::<Scored>()
        }
        RangeBy::Lex(range) => {
            let Some(lowest) = items.first().map(|(score, _)| *score) else { return Vec::new() };
            items
                .into_iter()
                .filter(|(score, member)| *score == lowest && range.contains(member))
                .collect()
        }
    };
    if query.offset < 0 {
        return Vec::new();
    }
    if query.reverse {
        items.reverse();
    }
    let window = super::zsets::limit_window(items.len(), query.offset, query.count);
    items.truncate(window.end);
    items.drain(..window.start);
    items
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
