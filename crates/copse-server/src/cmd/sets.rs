//! Set commands. A set is its meta item (version, member count) plus one item per member under
//! the set's id, the member in the item key (`'s' len(id) id scan_hash(M) M`, empty value): so
//! membership, SMEMBERS, SSCAN, SPOP's choice and SINTER/SUNION/SDIFF read only the shard's index,
//! never the device (docs/format/redis-keyspace.md, "Sets").
//!
//! Invariants:
//! - A set exists iff its meta item exists, and then it has `count` ≥ 1 member items under its
//!   id: every change of the count writes the meta item in the same batch.
//! - Each command on one set writes one batch; SMOVE across shards is one cross-shard batch; the
//!   STORE commands read their sources (consistently across shards) and then write the
//!   destination in one batch.
//! - Member order (SMEMBERS, SSCAN) is by the member's scan hash; Redis promises no order either.

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::View;
use copse::limits::KEY_BYTES_MAX;
use copse::{BatchOp, Db};

use super::keys::{glob_match, SCAN_COUNT_DEFAULT, SCAN_COUNT_MAX};
use super::{
    answer, bound_ref, check_batch, coll_begin, coll_make, coll_meta, delete_ops, from_index,
    hashed_element_at, on_collection_grouped, parse_i64, random_u64, reply_too_large, stored_type,
    unexpected, Call, Coll, Expiry, Input, Next, Outcome, Plan, Spec, NOT_INTEGER, SYNTAX,
    WRONGTYPE,
};
use crate::context::Server;
use crate::keyspace::{self, decode_field, set_member_key, KeyType, TAG_SET, VERSION_BYTES};
use crate::resp::Reply;

/// Bytes a member item adds around the Redis key and the member: tag, id length, version, hash.
pub const SET_MEMBER_OVERHEAD_BYTES: usize = 1 + 4 + VERSION_BYTES + 8;

pub fn specs() -> Vec<Spec> {
    let spec = |name, arity, flags, keys, summary, handler| {
        Spec::new("set", name, arity, flags, keys, summary, handler)
    };
    const W: &[&str] = &["write", "fast"];
    const WS: &[&str] = &["write"];
    const R: &[&str] = &["readonly", "fast"];
    const RS: &[&str] = &["readonly"];
    const ONE: (i32, i32, i32) = (1, 1, 1);
    const ALL: (i32, i32, i32) = (1, -1, 1);
    vec![
        spec("sadd", -3, W, ONE, "Adds members to a set; returns how many are new.", sadd as _),
        spec("srem", -3, W, ONE, "Removes members from a set.", srem as _),
        spec("sismember", 3, R, ONE, "Tells whether a member is in a set.", sismember as _),
        spec("smismember", -3, R, ONE, "Tells which members are in a set.", smismember as _),
        spec("smembers", 2, RS, ONE, "Returns every member of a set.", smembers as _),
        spec("scard", 2, R, ONE, "Returns the number of members.", scard as _),
        spec("spop", -2, W, ONE, "Removes and returns random members.", spop as _),
        spec("srandmember", -2, RS, ONE, "Returns random members.", srandmember as _),
        spec("smove", 4, W, (1, 2, 1), "Moves a member to another set.", smove as _),
        spec("sscan", -3, RS, ONE, "Iterates over the members of a set.", sscan as _),
        spec("sinter", -2, RS, ALL, "Returns the intersection of sets.", sinter as _),
        spec("sunion", -2, RS, ALL, "Returns the union of sets.", sunion as _),
        spec("sdiff", -2, RS, ALL, "Returns the difference of sets.", sdiff as _),
        spec("sinterstore", -3, WS, ALL, "Stores the intersection of sets.", sinterstore as _),
        spec("sunionstore", -3, WS, ALL, "Stores the union of sets.", sunionstore as _),
        spec("sdiffstore", -3, WS, ALL, "Stores the difference of sets.", sdiffstore as _),
        spec("sintercard", -3, RS, (2, -1, 1), "Counts the intersection of sets.", sintercard as _),
    ]
}

/// Refuses a member whose item key would not fit copse's keys.
fn check_member(key: &[u8], member: &[u8]) -> Result<(), Reply> {
    if key.len() + member.len() + SET_MEMBER_OVERHEAD_BYTES > KEY_BYTES_MAX {
        return Err(Reply::Error(format!(
            "ERR set member of {} bytes is too long for a key stored under a name of {} bytes (copse allows name and member together up to {} bytes; a key of over {} bytes is stored under a name of {} bytes)",
            member.len(),
            key.len(),
            KEY_BYTES_MAX - SET_MEMBER_OVERHEAD_BYTES,
            crate::keyspace::NAME_INLINE_BYTES_MAX,
            crate::keyspace::SURROGATE_NAME_BYTES,
        )));
    }
    Ok(())
}

/// Every member of `coll` (from the index), in scan-hash order.
fn all_members(view: &View<'_>, coll: &Coll) -> Vec<Vec<u8>> {
    if !coll.exists() {
        return Vec::new();
    }
    let (start, end) = keyspace::id_range(TAG_SET, &coll.id);
    let items = view.keys(bound_ref(&start), bound_ref(&end), usize::MAX);
    items
        .iter()
        .filter_map(|item| decode_field(item, coll.id.len()))
        .map(|(_, m)| m.to_vec())
        .collect()
}

/// `n` distinct random members of `coll` (n ≤ its count).
fn random_members(view: &View<'_>, coll: &Coll, n: usize) -> Vec<Vec<u8>> {
    if n * 4 >= coll.count() {
        // Many of them: list them all, then pick.
        let mut all = all_members(view, coll);
        for at in 0..n.min(all.len()) {
            let pick = at + (random_u64() as usize) % (all.len() - at);
            all.swap(at, pick);
        }
        all.truncate(n);
        return all;
    }
    let mut taken = HashSet::new();
    let mut chosen = Vec::with_capacity(n);
    while chosen.len() < n {
        match hashed_element_at(view, coll, random_u64() >> 1, &taken) {
            Some(member) => {
                taken.insert(member.clone());
                chosen.push(member);
            }
            None => break,
        }
    }
    chosen
}

fn sadd(call: &mut Call<'_>) -> Outcome {
    let members: Vec<Vec<u8>> = call.args.drain(2..).collect();
    if let Some(error) = members.iter().find_map(|m| check_member(&call.args[1], m).err()) {
        return Outcome::Reply(error);
    }
    let mut pending = None;
    on_collection_grouped(call, KeyType::Set, move |view, input, coll| match input {
        Input::Start => {
            let mut seen = HashSet::new();
            let mut ops = Vec::new();
            for member in &members {
                let item = set_member_key(&coll.id, member);
                if seen.insert(&member[..]) && !(coll.exists() && view.contains(&item)) {
                    ops.push(BatchOp::Put { key: item, value: Vec::new() });
                }
            }
            let added = ops.len();
            if added == 0 {
                return Next::Reply(Reply::Integer(0));
            }
            ops.extend(coll.meta_ops(coll.count() + added));
            if let Err(error) = check_batch(&ops) {
                return Next::Reply(error);
            }
            pending = Some(Reply::Integer(added as i64));
            Next::WriteLast(ops)
        }
        Input::Written => answer(&mut pending),
        Input::Read(_) => unexpected(),
    })
}

fn srem(call: &mut Call<'_>) -> Outcome {
    let members: Vec<Vec<u8>> = call.args.drain(2..).collect();
    let mut pending = None;
    on_collection_grouped(call, KeyType::Set, move |view, input, coll| match input {
        Input::Start => {
            if !coll.exists() {
                return Next::Reply(Reply::Integer(0));
            }
            let mut seen = HashSet::new();
            let mut ops = Vec::new();
            for member in &members {
                let item = set_member_key(&coll.id, member);
                if seen.insert(&member[..]) && view.contains(&item) {
                    ops.push(BatchOp::Delete { key: item });
                }
            }
            let removed = ops.len();
            if removed == 0 {
                return Next::Reply(Reply::Integer(0));
            }
            ops.extend(coll.meta_ops(coll.count() - removed));
            if let Err(error) = check_batch(&ops) {
                return Next::Reply(error);
            }
            pending = Some(Reply::Integer(removed as i64));
            Next::WriteLast(ops)
        }
        Input::Written => answer(&mut pending),
        Input::Read(_) => unexpected(),
    })
}

fn sismember(call: &mut Call<'_>) -> Outcome {
    let member = call.args[2].clone();
    from_index(call, KeyType::Set, move |view, coll| {
        let found = coll.exists() && view.contains(&set_member_key(&coll.id, &member));
        Reply::Integer(found as i64)
    })
}

fn smismember(call: &mut Call<'_>) -> Outcome {
    let members = call.args[2..].to_vec();
    from_index(call, KeyType::Set, move |view, coll| {
        Reply::Array(
            members
                .iter()
                .map(|member| {
                    let found = coll.exists() && view.contains(&set_member_key(&coll.id, member));
                    Reply::Integer(found as i64)
                })
                .collect(),
        )
    })
}

fn scard(call: &mut Call<'_>) -> Outcome {
    from_index(call, KeyType::Set, |_, coll| Reply::Integer(coll.count() as i64))
}

/// What a reply of `members` costs against the output limit (a bulk header each).
fn members_bytes(members: &[Vec<u8>]) -> usize {
    members.iter().map(|member| member.len() + 16).sum()
}

fn smembers(call: &mut Call<'_>) -> Outcome {
    let limit = call.server.settings.client_output_bytes_max.load(Ordering::Relaxed);
    from_index(call, KeyType::Set, move |view, coll| {
        let members = all_members(view, coll);
        let bytes = members_bytes(&members);
        if bytes > limit {
            return reply_too_large(bytes, limit);
        }
        Reply::Set(members.into_iter().map(Reply::Bulk).collect())
    })
}

/// SPOP's and SRANDMEMBER's count (None: no count given).
fn random_count(call: &Call<'_>, allow_negative: bool) -> Result<Option<i64>, Reply> {
    match call.args.len() {
        2 => Ok(None),
        3 => match parse_i64(&call.args[2]) {
            Some(count) if count >= 0 || (allow_negative && count != i64::MIN) => Ok(Some(count)),
            Some(i64::MIN) if allow_negative => Err(Reply::Error(format!(
                "ERR value is out of range, value must between {} and {}",
                -i64::MAX,
                i64::MAX
            ))),
            Some(_) => Err(Reply::error("ERR value is out of range, must be positive")),
            None => Err(Reply::error(NOT_INTEGER)),
        },
        _ => Err(Reply::error(SYNTAX)),
    }
}

fn spop(call: &mut Call<'_>) -> Outcome {
    let count = match random_count(call, false) {
        Ok(count) => count,
        Err(error) => return Outcome::Reply(error),
    };
    let limit = call.server.settings.client_output_bytes_max.load(Ordering::Relaxed);
    let mut pending = None;
    // SPOPs of one hot set share flushes with the writes before them (write groups).
    on_collection_grouped(call, KeyType::Set, move |view, input, coll| match input {
        Input::Start => {
            if !coll.exists() {
                return Next::Reply(if count.is_some() {
                    Reply::Set(Vec::new())
                } else {
                    Reply::Null
                });
            }
            let n = count.map_or(1, |count| count as usize).min(coll.count());
            if n == 0 {
                return Next::Reply(Reply::Set(Vec::new()));
            }
            let chosen = random_members(view, coll, n);
            let bytes = members_bytes(&chosen);
            if bytes > limit {
                return Next::Reply(reply_too_large(bytes, limit));
            }
            let ops = if chosen.len() == coll.count() {
                // All of them: the key goes, its members to the orphan collector.
                delete_ops(&coll.key, KeyType::Set, &coll.expiry)
            } else {
                let mut ops: Vec<BatchOp> = chosen
                    .iter()
                    .map(|member| BatchOp::Delete { key: set_member_key(&coll.id, member) })
                    .collect();
                ops.extend(coll.meta_ops(coll.count() - chosen.len()));
                ops
            };
            if let Err(error) = check_batch(&ops) {
                return Next::Reply(error);
            }
            pending = Some(match count {
                None => chosen.into_iter().next().map_or(Reply::Null, Reply::Bulk),
                Some(_) => Reply::Set(chosen.into_iter().map(Reply::Bulk).collect()),
            });
            Next::WriteLast(ops)
        }
        Input::Written => answer(&mut pending),
        Input::Read(_) => unexpected(),
    })
}

fn srandmember(call: &mut Call<'_>) -> Outcome {
    let count = match random_count(call, true) {
        Ok(count) => count,
        Err(error) => return Outcome::Reply(error),
    };
    let limit = call.server.settings.client_output_bytes_max.load(Ordering::Relaxed);
    from_index(call, KeyType::Set, move |view, coll| {
        if !coll.exists() {
            return if count.is_some() { Reply::Array(Vec::new()) } else { Reply::Null };
        }
        let chosen = match count {
            None => random_members(view, coll, 1),
            Some(count) if count >= 0 => {
                random_members(view, coll, (count as usize).min(coll.count()))
            }
            Some(count) => {
                // Repeats allowed: each pick on its own, counted as it goes.
                let mut chosen = Vec::new();
                let mut bytes = 0;
                let none = HashSet::new();
                for _ in 0..count.unsigned_abs() {
                    let Some(member) = hashed_element_at(view, coll, random_u64() >> 1, &none)
                    else {
                        break;
                    };
                    bytes += member.len() + 16;
                    if bytes > limit {
                        return reply_too_large(bytes, limit);
                    }
                    chosen.push(member);
                }
                chosen
            }
        };
        let bytes = members_bytes(&chosen);
        if bytes > limit {
            return reply_too_large(bytes, limit);
        }
        match count {
            None => chosen.into_iter().next().map_or(Reply::Null, Reply::Bulk),
            Some(_) => Reply::Array(chosen.into_iter().map(Reply::Bulk).collect()),
        }
    })
}

fn sscan(call: &mut Call<'_>) -> Outcome {
    let Some(cursor) = std::str::from_utf8(&call.args[2]).ok().and_then(|c| c.parse::<u64>().ok())
    else {
        return Outcome::error("ERR invalid cursor");
    };
    let mut pattern = None;
    let mut count = SCAN_COUNT_DEFAULT;
    let mut at = 3;
    let mut options_error = None;
    while at < call.args.len() {
        match (call.word(at).as_str(), call.args.get(at + 1)) {
            ("match", Some(value)) => pattern = (value[..] != b"*"[..]).then(|| value.clone()),
            ("count", Some(value)) => match parse_i64(value) {
                Some(n) if n >= 1 => count = (n as usize).min(SCAN_COUNT_MAX),
                Some(_) => {
                    options_error = Some(Reply::error(SYNTAX));
                    break;
                }
                None => {
                    options_error = Some(Reply::error(NOT_INTEGER));
                    break;
                }
            },
            _ => {
                options_error = Some(Reply::error(SYNTAX));
                break;
            }
        }
        at += 2;
    }
    from_index(call, KeyType::Set, move |view, coll| {
        let reply = |next: u64, members: Vec<Reply>| {
            Reply::Array(vec![Reply::Bulk(next.to_string().into_bytes()), Reply::Array(members)])
        };
        // Redis answers a missing key before looking at the options.
        if !coll.exists() {
            return reply(0, Vec::new());
        }
        if let Some(error) = &options_error {
            return error.clone();
        }
        let (start, end) = keyspace::set_members_from(&coll.id, cursor);
        let mut items = view.keys(bound_ref(&start), bound_ref(&end), count + 1);
        let next = if items.len() > count {
            items
                .pop()
                .and_then(|item| decode_field(&item, coll.id.len()).map(|(hash, _)| hash))
                .unwrap_or(0)
        } else {
            0
        };
        let members = items
            .iter()
            .filter_map(|item| decode_field(item, coll.id.len()).map(|(_, m)| m.to_vec()))
            .filter(|member| pattern.as_ref().is_none_or(|p| glob_match(p, member)))
            .map(Reply::Bulk)
            .collect();
        reply(next, members)
    })
}

// -- SMOVE ----------------------------------------------------------------------------------------

fn smove(call: &mut Call<'_>) -> Outcome {
    let (source, destination, member) =
        (call.args[1].clone(), call.args[2].clone(), call.args[3].clone());
    if let Err(error) = check_member(&destination, &member) {
        return Outcome::Reply(error);
    }
    let db = call.db();
    if db.shard_of(&source) == db.shard_of(&destination) {
        return smove_in_shard(db, source, destination, member);
    }
    smove_across(db, source, destination, member)
}

/// SMOVE with both keys in one shard: one exec holding both locks, from the index alone.
fn smove_in_shard(db: &Db, source: Vec<u8>, destination: Vec<u8>, member: Vec<u8>) -> Outcome {
    let shard = db.shard_of(&source);
    let mut plan = Plan::new();
    let mut expiries: Option<(Expiry, Expiry)> = None;
    let mut pending = None;
    plan.add(shard, vec![source.clone(), destination.clone()], move |view, input| match input {
        Input::Start => {
            let source_expiry = Expiry::of(view, &source);
            let destination_expiry = Expiry::of(view, &destination);
            let source_type = source_expiry.live(stored_type(view, &source));
            let destination_type = destination_expiry.live(stored_type(view, &destination));
            if source_type.is_none() {
                return Next::Reply(Reply::Integer(0));
            }
            if source_type != Some(KeyType::Set)
                || destination_type.is_some_and(|ty| ty != KeyType::Set)
            {
                return Next::Reply(Reply::error(WRONGTYPE));
            }
            let mut reads = smallvec::SmallVec::new();
            reads.push(copse::exec::ReadOp::Get(keyspace::meta_key(&source, KeyType::Set)));
            if destination_type.is_some() && destination != source {
                reads
                    .push(copse::exec::ReadOp::Get(keyspace::meta_key(&destination, KeyType::Set)));
            }
            expiries = Some((source_expiry, destination_expiry));
            Next::Read(reads)
        }
        Input::Read(mut results) => {
            let Some((source_expiry, destination_expiry)) = expiries.take() else {
                return unexpected();
            };
            let destination_meta = if results.len() == 2 { Some(results.pop()) } else { None };
            let source_meta = match coll_meta(results.pop()) {
                Ok(meta) => meta,
                Err(error) => return Next::Reply(error),
            };
            let source_coll =
                coll_make(view, source.clone(), KeyType::Set, source_expiry, source_meta);
            if !view.contains(&set_member_key(&source_coll.id, &member)) {
                return Next::Reply(Reply::Integer(0));
            }
            if source == destination {
                return Next::Reply(Reply::Integer(1));
            }
            let destination_meta = match destination_meta {
                Some(result) => match coll_meta(result) {
                    Ok(meta) => meta,
                    Err(error) => return Next::Reply(error),
                },
                None => None,
            };
            let destination_coll = coll_make(
                view,
                destination.clone(),
                KeyType::Set,
                destination_expiry,
                destination_meta,
            );
            let mut ops = remove_ops(&source_coll, &member);
            ops.extend(add_ops(view, &destination_coll, &member));
            pending = Some(Reply::Integer(1));
            Next::Write(ops)
        }
        Input::Written => answer(&mut pending),
    });
    plan.finish(Box::new(|mut replies| replies.pop().unwrap_or(Reply::Null)))
}

/// The writes that remove `member` (present) from `coll`.
fn remove_ops(coll: &Coll, member: &[u8]) -> Vec<BatchOp> {
    let mut ops = vec![BatchOp::Delete { key: set_member_key(&coll.id, member) }];
    ops.extend(coll.meta_ops(coll.count() - 1));
    ops
}

/// The writes that add `member` to `coll` (none if it is there).
fn add_ops(view: &View<'_>, coll: &Coll, member: &[u8]) -> Vec<BatchOp> {
    let item = set_member_key(&coll.id, member);
    if coll.exists() && view.contains(&item) {
        return Vec::new();
    }
    let mut ops = vec![BatchOp::Put { key: item, value: Vec::new() }];
    ops.extend(coll.meta_ops(coll.count() + 1));
    ops
}

/// What the source part of a cross-shard SMOVE found, as its answer to the combining step.
const SMOVE_NO_KEY: i64 = -1;
const SMOVE_NO_MEMBER: i64 = 0;
const SMOVE_MOVED: i64 = 1;

/// SMOVE across shards: one cross-shard batch; each part decides from its own index (the source:
/// the key and the member are there; the destination: its type), and either refusing calls the
/// whole move off.
fn smove_across(db: &Db, source: Vec<u8>, destination: Vec<u8>, member: Vec<u8>) -> Outcome {
    let mut plan = super::AtomicPlan::new();
    let source_member = member.clone();
    let source_key = source.clone();
    plan.add(db.shard_of(&source), vec![source.clone()], move |vote| {
        let mut vote = Some(vote);
        let mut expiry = Expiry::default();
        move |view: &View<'_>, input| {
            let refuse = |vote: &mut Option<copse::exec::Vote>, answer: Reply| {
                if let Some(vote) = vote.take() {
                    vote.refuse(copse::WriteError::Aborted("SMOVE: nothing to move".into()));
                }
                Next::Reply(answer)
            };
            match input {
                Input::Start => match coll_begin(view, &source_key, KeyType::Set) {
                    Ok((found, Some(read))) => {
                        expiry = found;
                        Next::Read(smallvec::smallvec![read])
                    }
                    Ok((_, None)) => refuse(&mut vote, Reply::Integer(SMOVE_NO_KEY)),
                    Err(error) => refuse(&mut vote, error),
                },
                Input::Read(mut results) => {
                    let meta = match coll_meta(results.pop()) {
                        Ok(meta) => meta,
                        Err(error) => return refuse(&mut vote, error),
                    };
                    let coll = coll_make(
                        view,
                        source_key.clone(),
                        KeyType::Set,
                        std::mem::take(&mut expiry),
                        meta,
                    );
                    if !view.contains(&set_member_key(&coll.id, &source_member)) {
                        return refuse(&mut vote, Reply::Integer(SMOVE_NO_MEMBER));
                    }
                    match vote.take() {
                        Some(vote) => Next::Prepare(vote, remove_ops(&coll, &source_member)),
                        None => unexpected(),
                    }
                }
                Input::Written => Next::Reply(Reply::Integer(SMOVE_MOVED)),
            }
        }
    });
    let destination_key = destination.clone();
    plan.add(db.shard_of(&destination), vec![destination.clone()], move |vote| {
        let mut vote = Some(vote);
        let mut expiry = Expiry::default();
        move |view: &View<'_>, input| {
            let prepare = |view: &View<'_>, expiry, meta, vote: &mut Option<copse::exec::Vote>| {
                let coll = coll_make(view, destination_key.clone(), KeyType::Set, expiry, meta);
                match vote.take() {
                    Some(vote) => Next::Prepare(vote, add_ops(view, &coll, &member)),
                    None => unexpected(),
                }
            };
            match input {
                Input::Start => match coll_begin(view, &destination_key, KeyType::Set) {
                    Ok((found, Some(read))) => {
                        expiry = found;
                        Next::Read(smallvec::smallvec![read])
                    }
                    Ok((found, None)) => prepare(view, found, None, &mut vote),
                    Err(error) => {
                        if let Some(vote) = vote.take() {
                            vote.refuse(copse::WriteError::Aborted("SMOVE: wrong type".into()));
                        }
                        Next::Reply(error)
                    }
                },
                Input::Read(mut results) => match coll_meta(results.pop()) {
                    Ok(meta) => prepare(view, std::mem::take(&mut expiry), meta, &mut vote),
                    Err(error) => {
                        if let Some(vote) = vote.take() {
                            vote.refuse(copse::WriteError::Aborted("SMOVE: unreadable".into()));
                        }
                        Next::Reply(error)
                    }
                },
                Input::Written => Next::Reply(Reply::ok()),
            }
        }
    });
    plan.finish(
        db,
        Box::new(|replies: Vec<Reply>| {
            let mut replies = replies.into_iter();
            let (from, to) = (replies.next(), replies.next());
            // Redis's order: a missing source answers 0 before any type check; then a source
            // of another type, then a destination of another type; then a missing member.
            match (from, to) {
                (Some(Reply::Integer(SMOVE_NO_KEY)), _) => Reply::Integer(0),
                (Some(Reply::Error(error)), _) if error.starts_with("WRONGTYPE") => {
                    Reply::Error(error)
                }
                (_, Some(Reply::Error(error))) if error.starts_with("WRONGTYPE") => {
                    Reply::Error(error)
                }
                (Some(Reply::Integer(SMOVE_NO_MEMBER)), _) => Reply::Integer(0),
                (Some(Reply::Integer(SMOVE_MOVED)), Some(Reply::Simple(_))) => Reply::Integer(1),
                (Some(Reply::Error(error)), _) | (_, Some(Reply::Error(error))) => {
                    Reply::Error(error)
                }
                _ => Reply::error("ERR internal error: SMOVE"),
            }
        }),
    )
}

// -- SINTER, SUNION, SDIFF and their STORE and CARD forms -----------------------------------------

#[derive(Clone, Copy, PartialEq, Eq)]
enum Algebra {
    Inter,
    Union,
    Diff,
}

/// Each key's members (None: missing), in the order given, or WRONGTYPE (`store.rs`);
/// `limit`: the most bytes the members may come to (a reply's bound), or None.
async fn read_sets(
    server: &Arc<Server>,
    keys: &[Vec<u8>],
    limit: Option<usize>,
) -> Result<Vec<Option<Vec<Vec<u8>>>>, Reply> {
    let sources = super::store::read_sources(server, keys, &[KeyType::Set], limit).await?;
    Ok(sources
        .elements
        .into_iter()
        .map(|set| set.map(|items| items.into_iter().map(|(_, member)| member).collect()))
        .collect())
}

/// The members of `algebra` over `sets` (None: a missing key, an empty set), in a stable order.
fn compute(
    algebra: Algebra,
    sets: Vec<Option<Vec<Vec<u8>>>>,
    limit: Option<usize>,
) -> Vec<Vec<u8>> {
    let mut sets = sets.into_iter().map(Option::unwrap_or_default);
    let Some(first) = sets.next() else { return Vec::new() };
    let rest: Vec<HashSet<Vec<u8>>> = sets.map(|set| set.into_iter().collect()).collect();
    let mut out: Vec<Vec<u8>> = Vec::new();
    match algebra {
        Algebra::Inter => {
            for member in first {
                if rest.iter().all(|set| set.contains(&member)) {
                    out.push(member);
                    if limit.is_some_and(|limit| limit > 0 && out.len() >= limit) {
                        break;
                    }
                }
            }
        }
        Algebra::Diff => {
            out = first.into_iter().filter(|m| !rest.iter().any(|set| set.contains(m))).collect()
        }
        Algebra::Union => {
            let mut seen: HashSet<Vec<u8>> = HashSet::new();
            for member in first.into_iter().chain(rest.into_iter().flatten()) {
                if seen.insert(member.clone()) {
                    out.push(member);
                }
            }
        }
    }
    out
}

fn algebra_reply(call: &Call<'_>, algebra: Algebra) -> Outcome {
    let keys: Vec<Vec<u8>> = call.args[1..].to_vec();
    let server = call.server.clone();
    let limit = super::store::reply_limit(&server);
    Outcome::AfterPending(Box::pin(async move {
        match read_sets(&server, &keys, Some(limit)).await {
            Ok(sets) => {
                Reply::Set(compute(algebra, sets, None).into_iter().map(Reply::Bulk).collect())
            }
            Err(error) => error,
        }
    }))
}

fn sinter(call: &mut Call<'_>) -> Outcome {
    algebra_reply(call, Algebra::Inter)
}

fn sunion(call: &mut Call<'_>) -> Outcome {
    algebra_reply(call, Algebra::Union)
}

fn sdiff(call: &mut Call<'_>) -> Outcome {
    algebra_reply(call, Algebra::Diff)
}

/// The STORE forms: the result replaces `destination` whatever it held (deleted if empty),
/// atomically with the read of the sources (`store.rs`).
fn algebra_store(call: &Call<'_>, algebra: Algebra) -> Outcome {
    let destination = call.args[1].clone();
    let keys: Vec<Vec<u8>> = call.args[2..].to_vec();
    let server = call.server.clone();
    Outcome::AfterPending(Box::pin(async move {
        let checked = destination.clone();
        super::store::store(
            &server,
            keys,
            &[KeyType::Set],
            destination,
            KeyType::Set,
            move |sets| {
                let sets = sets
                    .into_iter()
                    .map(|set| {
                        set.map(|items| items.into_iter().map(|(_, member)| member).collect())
                    })
                    .collect();
                let members = compute(algebra, sets, None);
                if let Some(error) = members.iter().find_map(|m| check_member(&checked, m).err()) {
                    return Err(error);
                }
                Ok(members.into_iter().map(|member| (1.0, member)).collect())
            },
        )
        .await
    }))
}

fn sinterstore(call: &mut Call<'_>) -> Outcome {
    algebra_store(call, Algebra::Inter)
}

fn sunionstore(call: &mut Call<'_>) -> Outcome {
    algebra_store(call, Algebra::Union)
}

fn sdiffstore(call: &mut Call<'_>) -> Outcome {
    algebra_store(call, Algebra::Diff)
}

fn sintercard(call: &mut Call<'_>) -> Outcome {
    const ERRORS: super::NumkeysErrors = super::NumkeysErrors {
        not_positive: "ERR numkeys should be greater than 0",
        not_integer: "ERR numkeys should be greater than 0",
        too_few: "ERR Number of keys can't be greater than number of args",
    };
    let (keys, limit) = match super::parse_intercard(call, &ERRORS) {
        Ok(parsed) => parsed,
        Err(error) => return Outcome::Reply(error),
    };
    let server = call.server.clone();
    Outcome::AfterPending(Box::pin(async move {
        match read_sets(&server, &keys, None).await {
            Ok(sets) => Reply::Integer(compute(Algebra::Inter, sets, Some(limit)).len() as i64),
            Err(error) => error,
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(members: &[&str]) -> Option<Vec<Vec<u8>>> {
        Some(members.iter().map(|m| m.as_bytes().to_vec()).collect())
    }

    #[test]
    fn set_algebra_follows_redis() {
        let sorted = |mut v: Vec<Vec<u8>>| {
            v.sort();
            v.into_iter().map(|m| String::from_utf8(m).unwrap()).collect::<Vec<_>>()
        };
        let sets = || vec![set(&["a", "b", "c"]), set(&["b", "c", "d"]), None];
        assert!(compute(Algebra::Inter, sets(), None).is_empty(), "a missing key is empty");
        let two = vec![set(&["a", "b", "c"]), set(&["b", "c", "d"])];
        assert_eq!(sorted(compute(Algebra::Inter, two.clone(), None)), ["b", "c"]);
        assert_eq!(compute(Algebra::Inter, two.clone(), Some(1)).len(), 1);
        assert_eq!(sorted(compute(Algebra::Union, sets(), None)), ["a", "b", "c", "d"]);
        assert_eq!(sorted(compute(Algebra::Diff, sets(), None)), ["a"]);
        assert!(compute(Algebra::Diff, vec![None, set(&["a"])], None).is_empty());
    }

    #[test]
    fn a_member_fits_exactly_when_its_item_key_fits() {
        let key = b"s";
        let longest = vec![b'm'; KEY_BYTES_MAX - SET_MEMBER_OVERHEAD_BYTES - key.len()];
        assert!(check_member(key, &longest).is_ok());
        let id = keyspace::collection_id(key, 3);
        assert_eq!(set_member_key(&id, &longest).len(), KEY_BYTES_MAX);
        assert!(check_member(key, &[b'm'; KEY_BYTES_MAX]).is_err());
    }
}
