//! Sorted set commands. A sorted set is its meta item (version, member count, expiry) plus two
//! items per member under the set's id: the member item (member -> score) answers ZSCORE with one
//! read, and the by-score item (score and member in its key, empty value) keeps members in score
//! order in the index, so ranges and ranks (ZRANGE, ZRANGEBYSCORE, ZRANK, ZCOUNT) are answered
//! with no read beyond the meta item, and ZCARD from the meta item alone.
//!
//! Invariants:
//! - A sorted set exists iff its meta item exists, and then it has `count` ≥ 1 members under its
//!   id: the meta item is written in the same batch as every change of the member count, and
//!   deleted with the last member.
//! - A member item and its by-score item are written and deleted in the same batch, and the
//!   member item's value is the score in the by-score item's key.
//! - A sorted set has no member limit: DEL deletes the meta item and writes an orphan record, and
//!   the orphan collector deletes the members (`cmd/orphans.rs`).
//! - Each command writes at most one batch; every limit is checked before it, and a refused
//!   command changes nothing.
//! - No score is NaN, and -0 is stored as 0 (the by-score order cannot tell them apart, so the
//!   member item does not either).

use std::collections::{HashMap, HashSet};
use std::ops::Bound;

use super::View;
use copse::exec::ReadOp;
use copse::limits::KEY_BYTES_MAX;
use copse::BatchOp;

use super::{
    answer, bound_ref, check_batch, from_index, on_collection, on_collection_grouped, parse_f64,
    parse_i64, read_items, unexpected, value_of, Call, Input, Next, Outcome, Spec, NOT_FLOAT,
    NOT_INTEGER, SYNTAX,
};
use crate::keyspace::{
    decode_score, decode_score_value, encode_score, member_key, score_key, scores_prefix,
    sortable_score, KeyRange, KeyType, MEMBER_OVERHEAD_BYTES,
};
use crate::resp::{Protocol, Reply};

pub(super) const MIN_MAX_NOT_FLOAT: &str = "ERR min or max is not a float";
const SCORE_NAN: &str = "ERR resulting score is not a number (NaN)";

pub fn specs() -> Vec<Spec> {
    let spec = |name, arity, flags, summary, handler| {
        Spec::new("sorted-set", name, arity, flags, (1, 1, 1), summary, handler)
    };
    const W: &[&str] = &["write", "fast"];
    const R: &[&str] = &["readonly", "fast"];
    const RS: &[&str] = &["readonly"];
    vec![
        spec("zadd", -4, W, "Adds members or updates their scores.", zadd as _),
        spec("zincrby", 4, W, "Increments the score of a member.", zincrby as _),
        spec("zrem", -3, W, "Removes members.", zrem as _),
        spec("zscore", 3, R, "Returns the score of a member.", zscore as _),
        spec("zmscore", -3, R, "Returns the scores of several members.", zmscore as _),
        spec("zcard", 2, R, "Returns the number of members.", zcard as _),
        spec("zcount", 4, R, "Counts the members with scores in a range.", zcount as _),
        spec("zrange", -4, RS, "Returns members by rank or score range.", zrange as _),
        spec("zrevrange", -4, RS, "Returns members by rank, highest first.", zrevrange as _),
        spec("zrangebyscore", -4, RS, "Returns members in a score range.", zrangebyscore as _),
        spec(
            "zrevrangebyscore",
            -4,
            RS,
            "Returns members in a score range, highest first.",
            zrevrangebyscore as _,
        ),
        spec("zrank", -3, R, "Returns the rank of a member.", zrank as _),
        spec("zrevrank", -3, R, "Returns the rank of a member, highest first.", zrevrank as _),
    ]
}

/// Every by-score item of the set with id `id`.
pub(super) fn all_scores(id: &[u8]) -> KeyRange {
    let prefix = scores_prefix(id);
    let end = crate::keyspace::prefix_end(&prefix);
    (Bound::Included(prefix), end)
}

/// (score, member) of the by-score items in `range`, up to `limit`, in score order.
pub(super) fn by_score(
    view: &View<'_>,
    id: &[u8],
    range: &KeyRange,
    limit: usize,
) -> Vec<(f64, Vec<u8>)> {
    view.keys(bound_ref(&range.0), bound_ref(&range.1), limit)
        .iter()
        .filter_map(|item| decode_score(item, id.len()).map(|(s, m)| (s, m.to_vec())))
        .collect()
}

/// Refuses a member whose by-score item key would not fit copse's keys.
pub(super) fn check_member(key: &[u8], member: &[u8]) -> Result<(), Reply> {
    if key.len() + member.len() + MEMBER_OVERHEAD_BYTES > KEY_BYTES_MAX {
        return Err(Reply::Error(format!(
            "ERR sorted set member of {} bytes is too long for a key stored under a name of {} \
             bytes (copse allows name and member together up to {} bytes; a key of over {} \
             bytes is stored under a name of {} bytes)",
            member.len(),
            key.len(),
            KEY_BYTES_MAX - MEMBER_OVERHEAD_BYTES,
            crate::keyspace::NAME_INLINE_BYTES_MAX,
            crate::keyspace::SURROGATE_NAME_BYTES,
        )));
    }
    Ok(())
}

/// -0 and 0 are one score (see the module invariants).
pub(super) fn normal(score: f64) -> f64 {
    if score == 0.0 {
        0.0
    } else {
        score
    }
}

/// A score range as Redis parses it: "(" makes a bound exclusive; the number is read as C's
/// strtod reads it here (an empty string is 0, leading spaces are skipped), never NaN.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct ScoreRange {
    min: f64,
    min_exclusive: bool,
    max: f64,
    max_exclusive: bool,
}

fn parse_bound(bytes: &[u8]) -> Option<(f64, bool)> {
    let (exclusive, number) = match bytes.split_first() {
        Some((b'(', rest)) => (true, rest),
        _ => (false, bytes),
    };
    let start = number.iter().position(|b| !b.is_ascii_whitespace()).unwrap_or(number.len());
    let value = if number.is_empty() { 0.0 } else { parse_f64(&number[start..])? };
    Some((value, exclusive))
}

impl ScoreRange {
    pub(super) fn parse(min: &[u8], max: &[u8]) -> Option<ScoreRange> {
        let (min, min_exclusive) = parse_bound(min)?;
        let (max, max_exclusive) = parse_bound(max)?;
        Some(ScoreRange { min, min_exclusive, max, max_exclusive })
    }

    /// Whether `score` is in the range.
    pub(super) fn contains(&self, score: f64) -> bool {
        let above = if self.min_exclusive { score > self.min } else { score >= self.min };
        let below = if self.max_exclusive { score < self.max } else { score <= self.max };
        above && below
    }

    pub(super) fn is_empty(&self) -> bool {
        self.min > self.max || (self.min == self.max && (self.min_exclusive || self.max_exclusive))
    }

    /// The by-score items of the set with id `id` in this range (not empty).
    pub(super) fn items(&self, id: &[u8]) -> KeyRange {
        // Every by-score item of score s starts with position(s), and every item of a higher
        // score is at or after position(s) + 1 (as an integer: sortable(+inf) < u64::MAX).
        let position = |score: f64, after: bool| {
            let mut out = scores_prefix(id);
            let sortable = u64::from_be_bytes(sortable_score(score));
            out.extend_from_slice(&(sortable + after as u64).to_be_bytes());
            out
        };
        let start = Bound::Included(position(self.min, self.min_exclusive));
        let end = Bound::Excluded(position(self.max, !self.max_exclusive));
        (start, end)
    }
}

/// Redis's rank arithmetic: the inclusive positions `start..=stop` name in a set of `len`
/// (negative counts from the end), or None when they name nothing.
pub(super) fn rank_window(start: i64, stop: i64, len: usize) -> Option<(usize, usize)> {
    let len = len as i64;
    let start = if start < 0 { (len + start).max(0) } else { start };
    let stop = if stop < 0 { len + stop } else { stop };
    if start > stop || start >= len {
        return None;
    }
    Some((start as usize, stop.min(len - 1) as usize))
}

/// Redis's LIMIT over `len` results: skip `offset` (a negative one skips everything, as Redis's
/// loop does), then keep `count` (negative: all the rest).
pub(super) fn limit_window(len: usize, offset: i64, count: i64) -> std::ops::Range<usize> {
    if offset < 0 {
        return 0..0;
    }
    let start = (offset as u64).min(len as u64) as usize;
    let end = if count < 0 { len } else { start.saturating_add(count as usize).min(len) };
    start..end
}

/// Reads the scores of `members` (a missing key or member is None, with no I/O) and answers
/// `reply` of them, in the order of `members`.
fn read_scores<F>(call: &Call<'_>, members: Vec<Vec<u8>>, mut reply: F) -> Outcome
where
    F: FnMut(Vec<Option<f64>>) -> Reply + Send + 'static,
{
    read_items(call, KeyType::ZSet, members, member_key, true, move |values| {
        let mut scores = Vec::with_capacity(values.len());
        for value in values {
            match value.map(|bytes| decode_score_value(&bytes)) {
                None => scores.push(None),
                Some(Some(score)) => scores.push(Some(score)),
                // A member item that is not 8 bytes: not something copse writes.
                Some(None) => return Reply::error("ERR internal error: unexpected step"),
            }
        }
        reply(scores)
    })
}

fn zscore(call: &mut Call<'_>) -> Outcome {
    let member = call.args[2].clone();
    read_scores(call, vec![member], |mut scores| {
        scores.pop().flatten().map_or(Reply::Null, Reply::Double)
    })
}

fn zmscore(call: &mut Call<'_>) -> Outcome {
    let members = call.args[2..].to_vec();
    read_scores(call, members, |scores| {
        Reply::Array(scores.into_iter().map(|s| s.map_or(Reply::Null, Reply::Double)).collect())
    })
}

fn zcard(call: &mut Call<'_>) -> Outcome {
    from_index(call, KeyType::ZSet, |_, coll| Reply::Integer(coll.count() as i64))
}

fn zcount(call: &mut Call<'_>) -> Outcome {
    let Some(range) = ScoreRange::parse(&call.args[2], &call.args[3]) else {
        return Outcome::error(MIN_MAX_NOT_FLOAT);
    };
    from_index(call, KeyType::ZSet, move |view, coll| {
        if range.is_empty() {
            return Reply::Integer(0);
        }
        let (start, end) = range.items(&coll.id);
        Reply::Integer(view.count(bound_ref(&start), bound_ref(&end), usize::MAX) as i64)
    })
}

#[derive(Default)]
struct AddOptions {
    nx: bool,
    xx: bool,
    gt: bool,
    lt: bool,
    ch: bool,
    incr: bool,
}

fn zadd(call: &mut Call<'_>) -> Outcome {
    let mut options = AddOptions::default();
    let mut at = 2;
    while at < call.args.len() {
        match call.word(at).as_str() {
            "nx" => options.nx = true,
            "xx" => options.xx = true,
            "gt" => options.gt = true,
            "lt" => options.lt = true,
            "ch" => options.ch = true,
            "incr" => options.incr = true,
            _ => break,
        }
        at += 1;
    }
    let elements = call.args.len() - at;
    if elements == 0 || !elements.is_multiple_of(2) {
        return Outcome::error(SYNTAX);
    }
    if options.nx && options.xx {
        return Outcome::error("ERR XX and NX options at the same time are not compatible");
    }
    if (options.nx && (options.gt || options.lt)) || (options.gt && options.lt) {
        return Outcome::error("ERR GT, LT, and/or NX options at the same time are not compatible");
    }
    if options.incr && elements > 2 {
        return Outcome::error("ERR INCR option supports a single increment-element pair");
    }
    let mut pairs = Vec::with_capacity(elements / 2);
    for pair in call.args[at..].chunks(2) {
        let Some(score) = parse_f64(&pair[0]) else {
            return Outcome::error(NOT_FLOAT);
        };
        pairs.push((normal(score), pair[1].clone()));
    }
    add_members(call, options, pairs)
}

fn zincrby(call: &mut Call<'_>) -> Outcome {
    let Some(by) = parse_f64(&call.args[2]) else {
        return Outcome::error(NOT_FLOAT);
    };
    let options = AddOptions { incr: true, ..AddOptions::default() };
    add_members(call, options, vec![(normal(by), call.args[3].clone())])
}

/// ZADD's effect on the current scores of the members it names, applied pair by pair as Redis
/// does (a member named twice sees the first change). Returns (added, updated, processed,
/// last new score), or the NaN error.
fn apply_adds(
    options: &AddOptions,
    pairs: &[(f64, Vec<u8>)],
    scores: &mut HashMap<Vec<u8>, f64>,
) -> Result<(usize, usize, usize, f64), Reply> {
    let (mut added, mut updated, mut processed, mut last) = (0, 0, 0, 0.0);
    for (score, member) in pairs {
        match scores.get(member).copied() {
            Some(current) => {
                if options.nx {
                    continue;
                }
                let new = if options.incr { normal(current + score) } else { *score };
                if new.is_nan() {
                    return Err(Reply::error(SCORE_NAN));
                }
                if (options.lt && new >= current) || (options.gt && new <= current) {
                    continue;
                }
                processed += 1;
                last = new;
                if new != current {
                    updated += 1;
                    scores.insert(member.clone(), new);
                }
            }
            None => {
                if options.xx {
                    continue;
                }
                processed += 1;
                added += 1;
                last = *score;
                scores.insert(member.clone(), *score);
            }
        }
    }
    Ok((added, updated, processed, last))
}

/// ZADD and ZINCRBY: reads the old scores of members that exist, applies the pairs, and writes
/// every changed member (its member item, and its by-score item moved) in one batch.
fn add_members(call: &Call<'_>, options: AddOptions, pairs: Vec<(f64, Vec<u8>)>) -> Outcome {
    for (_, member) in &pairs {
        if let Err(error) = check_member(&call.args[1], member) {
            return Outcome::Reply(error);
        }
    }
    let blocked = if options.incr { Reply::Null } else { Reply::Integer(0) };
    // Distinct members that exist, in the order they are read.
    let mut reads: Vec<Vec<u8>> = Vec::new();
    // Members read so far, and the ones of the step in flight (`EXEC_READS_MAX` per step).
    let mut read_scores: HashMap<Vec<u8>, f64> = HashMap::new();
    let mut asked = 0..0;
    let mut pending = None;
    // Members added wake a client blocked on the key (BZPOPMIN and the like).
    let server = call.server.clone();
    on_collection_grouped(call, KeyType::ZSet, move |view, input, coll| {
        let id = &coll.id;
        let old: HashMap<Vec<u8>, f64> = match input {
            Input::Start => {
                if !coll.exists() && options.xx {
                    return Next::Reply(blocked.clone());
                }
                let mut seen = HashSet::new();
                for (_, member) in &pairs {
                    if seen.insert(&member[..]) && view.contains(&member_key(id, member)) {
                        reads.push(member.clone());
                    }
                }
                if !reads.is_empty() {
                    return read_chunk(id, &reads, &mut asked);
                }
                HashMap::new()
            }
            Input::Read(results) => {
                for (member, result) in reads[asked.clone()].iter().zip(results) {
                    match value_of(Some(result)).as_deref().and_then(decode_score_value) {
                        Some(score) => read_scores.insert(member.clone(), score),
                        None => return unexpected(),
                    };
                }
                if asked.end < reads.len() {
                    return read_chunk(id, &reads, &mut asked);
                }
                std::mem::take(&mut read_scores)
            }
            Input::Written => {
                server.waiters.wake(
                    crate::waiters::Kind::ZSet,
                    view.namespace().number().unwrap_or(0),
                    &coll.key,
                );
                return answer(&mut pending);
            }
        };
        let mut scores = old.clone();
        let (added, updated, processed, last) = match apply_adds(&options, &pairs, &mut scores) {
            Ok(counts) => counts,
            Err(error) => return Next::Reply(error),
        };
        let reply = if options.incr {
            if processed > 0 {
                Reply::Double(last)
            } else {
                Reply::Null
            }
        } else {
            Reply::Integer((added + if options.ch { updated } else { 0 }) as i64)
        };
        let mut ops = Vec::new();
        let mut seen = HashSet::new();
        for (_, member) in &pairs {
            if !seen.insert(&member[..]) {
                continue;
            }
            let (Some(&new), before) = (scores.get(member), old.get(member).copied()) else {
                continue;
            };
            if before == Some(new) {
                continue;
            }
            if let Some(before) = before {
                ops.push(BatchOp::Delete { key: score_key(id, before, member) });
            }
            ops.push(BatchOp::Put { key: member_key(id, member), value: encode_score(new) });
            ops.push(BatchOp::Put { key: score_key(id, new, member), value: Vec::new() });
        }
        if ops.is_empty() {
            return Next::Reply(reply);
        }
        ops.extend(coll.meta_ops(coll.count() + added));
        if let Err(error) = check_batch(&ops) {
            return Next::Reply(error);
        }
        pending = Some(reply);
        Next::Write(ops)
    })
}

/// The next step's reads of member items of `reads` after `asked`, at most `EXEC_READS_MAX`.
fn read_chunk(id: &[u8], reads: &[Vec<u8>], asked: &mut std::ops::Range<usize>) -> Next {
    *asked = asked.end..(asked.end + copse::limits::EXEC_READS_MAX).min(reads.len());
    let members = &reads[asked.clone()];
    Next::Read(members.iter().map(|member| ReadOp::Get(member_key(id, member))).collect())
}

fn zrem(call: &mut Call<'_>) -> Outcome {
    let members = call.args[2..].to_vec();
    let mut reads: Vec<Vec<u8>> = Vec::new();
    let mut asked = 0..0;
    let mut ops = Vec::new();
    let mut pending = None;
    on_collection_grouped(call, KeyType::ZSet, move |view, input, coll| match input {
        Input::Start => {
            if !coll.exists() {
                return Next::Reply(Reply::Integer(0));
            }
            let mut seen = HashSet::new();
            for member in &members {
                if seen.insert(&member[..]) && view.contains(&member_key(&coll.id, member)) {
                    reads.push(member.clone());
                }
            }
            if reads.is_empty() {
                return Next::Reply(Reply::Integer(0));
            }
            read_chunk(&coll.id, &reads, &mut asked)
        }
        Input::Read(results) => {
            for (member, result) in reads[asked.clone()].iter().zip(results) {
                let Some(score) = value_of(Some(result)).as_deref().and_then(decode_score_value)
                else {
                    return unexpected();
                };
                ops.push(BatchOp::Delete { key: member_key(&coll.id, member) });
                ops.push(BatchOp::Delete { key: score_key(&coll.id, score, member) });
            }
            if asked.end < reads.len() {
                return read_chunk(&coll.id, &reads, &mut asked);
            }
            let mut ops = std::mem::take(&mut ops);
            ops.extend(coll.meta_ops(coll.count().saturating_sub(reads.len())));
            if let Err(error) = check_batch(&ops) {
                return Next::Reply(error);
            }
            pending = Some(Reply::Integer(reads.len() as i64));
            Next::Write(ops)
        }
        Input::Written => answer(&mut pending),
    })
}

#[derive(Clone, Debug, PartialEq)]
pub(super) enum RangeBy {
    Rank(i64, i64),
    Score(ScoreRange),
    Lex(LexRange),
}

/// One end of a lexicographic range: `-` and `+` (no bound), `[x` (inclusive), `(x` (exclusive).
#[derive(Clone, Debug, PartialEq)]
pub(super) enum LexBound {
    Lowest,
    Highest,
    Inclusive(Vec<u8>),
    Exclusive(Vec<u8>),
}

impl LexBound {
    pub(super) fn parse(bytes: &[u8]) -> Option<LexBound> {
        match bytes.split_first() {
            Some((b'-', [])) => Some(LexBound::Lowest),
            Some((b'+', [])) => Some(LexBound::Highest),
            Some((b'[', rest)) => Some(LexBound::Inclusive(rest.to_vec())),
            Some((b'(', rest)) => Some(LexBound::Exclusive(rest.to_vec())),
            _ => None,
        }
    }
}

pub(super) const LEX_RANGE_INVALID: &str = "ERR min or max not valid string range item";

/// A range of members by their bytes, for sorted sets whose members share one score (Redis's
/// BYLEX commands; with mixed scores Redis leaves the result unspecified, and copse looks only
/// at the members that share the lowest score).
#[derive(Clone, Debug, PartialEq)]
pub(super) struct LexRange {
    pub(super) min: LexBound,
    pub(super) max: LexBound,
}

impl LexRange {
    pub(super) fn parse(min: &[u8], max: &[u8]) -> Option<LexRange> {
        Some(LexRange { min: LexBound::parse(min)?, max: LexBound::parse(max)? })
    }

    /// Whether `member` is in the range.
    pub(super) fn contains(&self, member: &[u8]) -> bool {
        let above = match &self.min {
            LexBound::Lowest => true,
            LexBound::Highest => false,
            LexBound::Inclusive(min) => member >= &min[..],
            LexBound::Exclusive(min) => member > &min[..],
        };
        let below = match &self.max {
            LexBound::Lowest => false,
            LexBound::Highest => true,
            LexBound::Inclusive(max) => member <= &max[..],
            LexBound::Exclusive(max) => member < &max[..],
        };
        above && below
    }

    /// The by-score items of the set `coll` whose members are in this range, among those with
    /// the set's lowest score.
    pub(super) fn items(&self, view: &View<'_>, id: &[u8]) -> Option<KeyRange> {
        let first = by_score(view, id, &all_scores(id), 1).pop()?;
        let mut base = scores_prefix(id);
        base.extend_from_slice(&sortable_score(first.0));
        let with = |member: &[u8]| {
            let mut key = base.clone();
            key.extend_from_slice(member);
            key
        };
        let start = match &self.min {
            LexBound::Lowest => Bound::Included(base.clone()),
            LexBound::Highest => return None,
            LexBound::Inclusive(member) => Bound::Included(with(member)),
            LexBound::Exclusive(member) => Bound::Excluded(with(member)),
        };
        let end = match &self.max {
            LexBound::Lowest => return None,
            LexBound::Highest => crate::keyspace::prefix_end(&base),
            LexBound::Inclusive(member) => Bound::Included(with(member)),
            LexBound::Exclusive(member) => Bound::Excluded(with(member)),
        };
        Some((start, end))
    }
}

/// A parsed ZRANGE-family query.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct RangeQuery {
    pub(super) by: RangeBy,
    pub(super) reverse: bool,
    /// LIMIT offset count; Redis's defaults (0, -1) when not given.
    pub(super) offset: i64,
    pub(super) count: i64,
    pub(super) with_scores: bool,
}

#[derive(Clone, Copy, PartialEq)]
pub(super) enum RangeKind {
    Rank,
    Score,
    Lex,
}

/// Parses a ZRANGE-family command as Redis's `zrangeGenericCommand` does: `kind` and `reverse`
/// are fixed by the older commands (ZREVRANGE, ZRANGEBYSCORE, ...), or None for ZRANGE, whose
/// options (BYSCORE, REV) choose them.
pub(super) fn parse_range(
    args: &[Vec<u8>],
    kind: Option<RangeKind>,
    reverse: Option<bool>,
) -> Result<RangeQuery, Reply> {
    let (mut kind, mut reverse) = (kind, reverse);
    let (mut offset, mut count, mut with_scores) = (0, -1, false);
    let mut at = 4;
    while at < args.len() {
        let left = args.len() - at - 1;
        match super::lowercase(&args[at]).as_str() {
            "withscores" => with_scores = true,
            "limit" if left >= 2 => {
                match (parse_i64(&args[at + 1]), parse_i64(&args[at + 2])) {
                    (Some(o), Some(c)) => (offset, count) = (o, c),
                    _ => return Err(Reply::error(NOT_INTEGER)),
                }
                at += 2;
            }
            "rev" if reverse.is_none() => reverse = Some(true),
            "byscore" if kind.is_none() => kind = Some(RangeKind::Score),
            "bylex" if kind.is_none() => kind = Some(RangeKind::Lex),
            _ => return Err(Reply::error(SYNTAX)),
        }
        at += 1;
    }
    let kind = kind.unwrap_or(RangeKind::Rank);
    let reverse = reverse.unwrap_or(false);
    if count != -1 && kind == RangeKind::Rank {
        return Err(Reply::error(
            "ERR syntax error, LIMIT is only supported in combination with either BYSCORE or BYLEX",
        ));
    }
    if with_scores && kind == RangeKind::Lex {
        return Err(Reply::error(
            "ERR syntax error, WITHSCORES not supported in combination with BYLEX",
        ));
    }
    let by = match kind {
        RangeKind::Rank => match (parse_i64(&args[2]), parse_i64(&args[3])) {
            (Some(start), Some(stop)) => RangeBy::Rank(start, stop),
            _ => return Err(Reply::error(NOT_INTEGER)),
        },
        RangeKind::Score => {
            // Reversed, the range is given as max then min.
            let (min, max) = if reverse { (&args[3], &args[2]) } else { (&args[2], &args[3]) };
            match ScoreRange::parse(min, max) {
                Some(range) => RangeBy::Score(range),
                None => return Err(Reply::error(MIN_MAX_NOT_FLOAT)),
            }
        }
        RangeKind::Lex => {
            let (min, max) = if reverse { (&args[3], &args[2]) } else { (&args[2], &args[3]) };
            match LexRange::parse(min, max) {
                Some(range) => RangeBy::Lex(range),
                None => return Err(Reply::error(LEX_RANGE_INVALID)),
            }
        }
    };
    Ok(RangeQuery { by, reverse, offset, count, with_scores })
}

/// The (score, member) pairs a range query selects, from the index alone.
pub(super) fn run_range(
    view: &View<'_>,
    coll: &super::Coll,
    query: &RangeQuery,
) -> Vec<(f64, Vec<u8>)> {
    let id = &coll.id;
    match &query.by {
        RangeBy::Lex(range) => {
            let Some(items) = range.items(view, id) else { return Vec::new() };
            if query.offset < 0 {
                return Vec::new();
            }
            let mut items = by_score(view, id, &items, usize::MAX);
            if query.reverse {
                items.reverse();
            }
            let window = limit_window(items.len(), query.offset, query.count);
            items.truncate(window.end);
            items.drain(..window.start);
            items
        }
        &RangeBy::Rank(start, stop) => {
            let len = coll.count();
            let Some((first, last)) = rank_window(start, stop, len) else {
                return Vec::new();
            };
            // Reverse ranks count from the highest score: map them to ascending positions.
            let (low, high) =
                if query.reverse { (len - 1 - last, len - 1 - first) } else { (first, last) };
            let mut items = by_score(view, id, &all_scores(id), high + 1);
            items.drain(..low.min(items.len()));
            if query.reverse {
                items.reverse();
            }
            items
        }
        RangeBy::Score(range) => {
            let range = *range;
            if range.is_empty() || query.offset < 0 {
                return Vec::new();
            }
            // Ascending with a LIMIT count: no need to look past offset + count.
            let fetch = if !query.reverse && query.count >= 0 {
                (query.offset as u64).saturating_add(query.count as u64).min(usize::MAX as u64)
                    as usize
            } else {
                usize::MAX
            };
            let mut items = by_score(view, id, &range.items(id), fetch);
            if query.reverse {
                items.reverse();
            }
            let window = limit_window(items.len(), query.offset, query.count);
            items.truncate(window.end);
            items.drain(..window.start);
            items
        }
    }
}

/// Members, with their scores if asked: in RESP3 as [member, score] pairs (as Redis 7 sends
/// them), in RESP2 flat.
pub(super) fn range_reply(
    items: Vec<(f64, Vec<u8>)>,
    with_scores: bool,
    protocol: Protocol,
) -> Reply {
    if !with_scores {
        return Reply::Array(items.into_iter().map(|(_, member)| Reply::Bulk(member)).collect());
    }
    if protocol == Protocol::Resp3 {
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

fn range_command(call: &Call<'_>, kind: Option<RangeKind>, reverse: Option<bool>) -> Outcome {
    let query = match parse_range(&call.args, kind, reverse) {
        Ok(query) => query,
        Err(error) => return Outcome::Reply(error),
    };
    let protocol = call.conn.protocol;
    from_index(call, KeyType::ZSet, move |view, coll| {
        range_reply(run_range(view, coll, &query), query.with_scores, protocol)
    })
}

fn zrange(call: &mut Call<'_>) -> Outcome {
    range_command(call, None, None)
}

fn zrevrange(call: &mut Call<'_>) -> Outcome {
    range_command(call, Some(RangeKind::Rank), Some(true))
}

fn zrangebyscore(call: &mut Call<'_>) -> Outcome {
    range_command(call, Some(RangeKind::Score), Some(false))
}

fn zrevrangebyscore(call: &mut Call<'_>) -> Outcome {
    range_command(call, Some(RangeKind::Score), Some(true))
}

/// ZRANK and ZREVRANK [WITHSCORE]: the member's score from its member item, then its position: the
/// by-score items before its own, counted in the index (a walk over them, nothing copied).
fn rank_command(call: &Call<'_>, reverse: bool) -> Outcome {
    if call.args.len() > 4 {
        let name = call.word(0);
        return Outcome::error(format!("ERR wrong number of arguments for '{name}' command"));
    }
    let with_score = call.args.len() == 4;
    if with_score && call.word(3) != "withscore" {
        return Outcome::error(SYNTAX);
    }
    let member = call.args[2].clone();
    // Redis answers a RESP2 client asking WITHSCORE a null array.
    let missing = if with_score { Reply::NullArray } else { Reply::Null };
    on_collection(call, KeyType::ZSet, move |view, input, coll| match input {
        Input::Start => {
            if !view.contains(&member_key(&coll.id, &member)) {
                return Next::Reply(missing.clone());
            }
            Next::Read(smallvec::smallvec![ReadOp::Get(member_key(&coll.id, &member))])
        }
        Input::Read(mut results) => {
            let Some(score) = value_of(results.pop()).as_deref().and_then(decode_score_value)
            else {
                return unexpected();
            };
            // The members before it in score order: counted in the index, none copied.
            let (start, _) = all_scores(&coll.id);
            let at = score_key(&coll.id, score, &member);
            let below = view.count(bound_ref(&start), Bound::Excluded(&at[..]), usize::MAX);
            let rank = if reverse { coll.count().saturating_sub(1 + below) } else { below } as i64;
            Next::Reply(if with_score {
                Reply::Array(vec![Reply::Integer(rank), Reply::Double(score)])
            } else {
                Reply::Integer(rank)
            })
        }
        Input::Written => unexpected(),
    })
}

fn zrank(call: &mut Call<'_>) -> Outcome {
    rank_command(call, false)
}

fn zrevrank(call: &mut Call<'_>) -> Outcome {
    rank_command(call, true)
}

#[cfg(test)]
mod tests {
    use std::ops::RangeBounds;

    use super::*;

    fn args(words: &[&str]) -> Vec<Vec<u8>> {
        words.iter().map(|w| w.as_bytes().to_vec()).collect()
    }

    #[test]
    fn score_bounds_parse_as_redis_parses_them() {
        assert_eq!(parse_bound(b"1.5"), Some((1.5, false)));
        assert_eq!(parse_bound(b"(1.5"), Some((1.5, true)));
        assert_eq!(parse_bound(b"-inf"), Some((f64::NEG_INFINITY, false)));
        assert_eq!(parse_bound(b"(+inf"), Some((f64::INFINITY, true)));
        // strtod's quirks, which Redis inherits.
        assert_eq!(parse_bound(b""), Some((0.0, false)));
        assert_eq!(parse_bound(b"("), Some((0.0, true)));
        assert_eq!(parse_bound(b" 2"), Some((2.0, false)));
        for bad in [&b"nan"[..], b"(nan", b"x", b"1 ", b"((1", b" "] {
            assert_eq!(parse_bound(bad), None, "{:?}", String::from_utf8_lossy(bad));
        }
        assert!(ScoreRange::parse(b"2", b"1").unwrap().is_empty());
        assert!(ScoreRange::parse(b"(1", b"1").unwrap().is_empty());
        assert!(ScoreRange::parse(b"1", b"(1").unwrap().is_empty());
        assert!(!ScoreRange::parse(b"1", b"1").unwrap().is_empty());
        assert!(!ScoreRange::parse(b"-inf", b"+inf").unwrap().is_empty());
    }

    #[test]
    fn score_ranges_select_exactly_their_by_score_items() {
        let key = b"z";
        let scores = [f64::NEG_INFINITY, -2.0, 1.0, 1.0, 1.5, 2.0, f64::INFINITY];
        let items: Vec<Vec<u8>> =
            scores.iter().enumerate().map(|(i, s)| score_key(key, *s, &[b'a' + i as u8])).collect();
        let selected = |min: &str, max: &str| -> Vec<f64> {
            let (start, end) =
                ScoreRange::parse(min.as_bytes(), max.as_bytes()).unwrap().items(key);
            items
                .iter()
                .filter(|item| (start.clone(), end.clone()).contains(*item))
                .map(|item| decode_score(item, key.len()).unwrap().0)
                .collect()
        };
        assert_eq!(selected("1", "2"), [1.0, 1.0, 1.5, 2.0]);
        assert_eq!(selected("(1", "2"), [1.5, 2.0]);
        assert_eq!(selected("1", "(2"), [1.0, 1.0, 1.5]);
        assert_eq!(selected("(1", "(2"), [1.5]);
        assert_eq!(selected("-inf", "+inf"), scores);
        assert_eq!(selected("(-inf", "(+inf"), &scores[1..6]);
        assert_eq!(selected("-inf", "-inf"), [f64::NEG_INFINITY]);
        assert_eq!(selected("+inf", "+inf"), [f64::INFINITY]);
        // Another key's items are never in range (length-prefixed key).
        let (start, end) = ScoreRange::parse(b"-inf", b"+inf").unwrap().items(key);
        let other = score_key(b"zz", 1.0, b"a");
        assert!(!(start, end).contains(&other));
    }

    #[test]
    fn ranks_follow_redis_index_rules() {
        assert_eq!(rank_window(0, -1, 5), Some((0, 4)));
        assert_eq!(rank_window(1, 2, 5), Some((1, 2)));
        assert_eq!(rank_window(-2, -1, 5), Some((3, 4)));
        assert_eq!(rank_window(-100, 100, 5), Some((0, 4)));
        assert_eq!(rank_window(3, 1, 5), None);
        assert_eq!(rank_window(5, 10, 5), None);
        assert_eq!(rank_window(0, -6, 5), None);
        assert_eq!(rank_window(0, -1, 0), None);
        assert_eq!(rank_window(i64::MIN, i64::MAX, 3), Some((0, 2)));
    }

    #[test]
    fn limits_follow_redis_rules() {
        assert_eq!(limit_window(5, 0, -1), 0..5);
        assert_eq!(limit_window(5, 1, 2), 1..3);
        assert_eq!(limit_window(5, 4, 10), 4..5);
        assert_eq!(limit_window(5, 7, 1), 5..5);
        assert_eq!(limit_window(5, 0, 0), 0..0);
        assert_eq!(limit_window(5, -1, 2), 0..0);
        assert_eq!(limit_window(5, 2, -3), 2..5);
        assert_eq!(limit_window(5, i64::MAX, i64::MAX), 5..5);
    }

    #[test]
    fn range_options_parse_as_in_redis() {
        let parse = |words: &[&str]| parse_range(&args(words), None, None);
        let query = parse(&["zrange", "z", "0", "-1", "WITHSCORES"]).unwrap();
        assert_eq!(query.by, RangeBy::Rank(0, -1));
        assert!(query.with_scores && !query.reverse);
        let query =
            parse(&["zrange", "z", "(5", "1", "byscore", "rev", "limit", "1", "2"]).unwrap();
        assert!(query.reverse);
        assert_eq!((query.offset, query.count), (1, 2));
        let RangeBy::Score(range) = query.by else { panic!("by score") };
        assert_eq!(
            (range.min, range.min_exclusive, range.max, range.max_exclusive),
            (1.0, false, 5.0, true)
        );
        // LIMIT with the default count passes even by rank, as in Redis.
        assert!(parse(&["zrange", "z", "0", "1", "limit", "0", "-1"]).is_ok());
        assert!(parse(&["zrange", "z", "0", "1", "limit", "0", "1"]).is_err());
        assert!(parse(&["zrange", "z", "0", "1", "limit", "0"]).is_err());
        assert!(parse(&["zrange", "z", "0", "1", "rev", "rev"]).is_err());
        assert_eq!(parse(&["zrange", "z", "a", "1"]).unwrap_err(), Reply::error(NOT_INTEGER));
        assert_eq!(
            parse(&["zrange", "z", "a", "1", "byscore"]).unwrap_err(),
            Reply::error(MIN_MAX_NOT_FLOAT)
        );
        let old = parse_range(
            &args(&["zrangebyscore", "z", "0", "1", "rev"]),
            Some(RangeKind::Score),
            Some(false),
        );
        assert_eq!(old.unwrap_err(), Reply::error(SYNTAX));
    }

    #[test]
    fn adds_apply_pair_by_pair() {
        let pairs = |list: &[(f64, &str)]| -> Vec<(f64, Vec<u8>)> {
            list.iter().map(|(s, m)| (*s, m.as_bytes().to_vec())).collect()
        };
        let mut scores = HashMap::from([(b"a".to_vec(), 1.0)]);
        let plain = AddOptions::default();
        let counts = apply_adds(&plain, &pairs(&[(1.0, "a"), (2.0, "b"), (3.0, "b")]), &mut scores);
        assert_eq!(counts.unwrap(), (1, 1, 3, 3.0));
        assert_eq!(scores[&b"b".to_vec()], 3.0);
        let gt = AddOptions { gt: true, ..AddOptions::default() };
        assert_eq!(apply_adds(&gt, &pairs(&[(0.5, "a")]), &mut scores).unwrap().2, 0);
        assert_eq!(apply_adds(&gt, &pairs(&[(9.0, "c")]), &mut scores).unwrap().0, 1);
        let incr = AddOptions { incr: true, ..AddOptions::default() };
        scores.insert(b"i".to_vec(), f64::INFINITY);
        assert_eq!(
            apply_adds(&incr, &pairs(&[(f64::NEG_INFINITY, "i")]), &mut scores).unwrap_err(),
            Reply::error(SCORE_NAN)
        );
    }
}
