//! Reading several sets or sorted sets at once (SINTER, ZUNION, ...) and the STORE commands that
//! write a result computed from them (SINTERSTORE, ZUNIONSTORE, ZRANGESTORE, ...).
//!
//! Sources are read consistently over the shards (`Db::read_consistently`: no cross-shard batch
//! is seen in part), from the indexes alone (set members and sorted set members with their
//! scores are in item keys). A STORE then writes its destination in one cross-shard batch over
//! every shard it read: each part first checks that its sources still hold exactly what was
//! read (a fingerprint of their elements), and refuses otherwise; a refused batch is read and
//! computed again. So a STORE is atomic like Redis's: no write to a source between the read and
//! the write is lost (a review found a SUNIONSTORE d d e losing concurrent SADDs to d).
//!
//! Invariants:
//! - A source's elements are listed in index order (sets by member scan hash, sorted sets by
//!   score and member), and its fingerprint is computed over that list the same way at read and
//!   at check.
//! - The destination is replaced whole (its old version to the orphan collector, its deadline
//!   removed), or deleted when the result is empty.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::View;
use copse::exec::ReadOp;
use copse::BatchOp;

use super::{
    bound_ref, by_shard, check_batch, coll_make, coll_meta, delete_ops, last_op_wins,
    reply_too_large, run_outcome, stored_type, unexpected, Coll, Expiry, Input, Next, Plan,
    WRONGTYPE,
};
use crate::context::Server;
use crate::keyspace::{self, KeyType, TAG_SET};
use crate::resp::Reply;

/// (score, member) pairs; a set's members score 1.
pub type Scored = Vec<(f64, Vec<u8>)>;

/// How many times a STORE reads and computes again when a source changed before its write.
pub const STORE_ATTEMPTS_MAX: usize = 100;

/// The elements of `coll` (a set or a sorted set), from the index, in index order.
pub fn elements(view: &View<'_>, coll: &Coll) -> Scored {
    if !coll.exists() {
        return Vec::new();
    }
    match coll.ty {
        KeyType::Set => {
            let (start, end) = keyspace::id_range(TAG_SET, &coll.id);
            view.keys(bound_ref(&start), bound_ref(&end), usize::MAX)
                .iter()
                .filter_map(|item| keyspace::decode_field(item, coll.id.len()))
                .map(|(_, member)| (1.0, member.to_vec()))
                .collect()
        }
        _ => {
            let prefix = keyspace::scores_prefix(&coll.id);
            let end = keyspace::prefix_end(&prefix);
            view.keys(std::ops::Bound::Included(&prefix[..]), bound_ref(&end), usize::MAX)
                .iter()
                .filter_map(|item| keyspace::decode_score(item, coll.id.len()))
                .map(|(score, member)| (score, member.to_vec()))
                .collect()
        }
    }
}

/// A fingerprint of what a source holds: its type (None: missing) and its elements in order.
fn fingerprint(ty: Option<KeyType>, elements: &[(f64, Vec<u8>)]) -> u64 {
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    hasher.update(&[ty.map_or(0, |ty| ty as u8)]);
    for (score, member) in elements {
        hasher.update(&score.to_bits().to_be_bytes());
        hasher.update(&(member.len() as u64).to_be_bytes());
        hasher.update(member);
    }
    hasher.digest()
}

/// What each source held when read: its elements (None: missing) and their fingerprint.
pub struct Sources {
    pub elements: Vec<Option<Scored>>,
    fingerprints: Vec<u64>,
}

/// Reads `keys` (each a type of `allowed`, else WRONGTYPE, checked for every key before any
/// element is looked at, as Redis does), consistently over the shards, from the indexes.
/// `limit`: the most bytes the elements may come to (a reply's bound), or None.
pub async fn read_sources(
    server: &Arc<Server>,
    keys: &[Vec<u8>],
    allowed: &'static [KeyType],
    limit: Option<usize>,
) -> Result<Sources, Reply> {
    let db = server.db.clone();
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
                        let live = expiry.live(stored_type(view, key));
                        view.note_lookup(live.is_some());
                        match live {
                            None => {}
                            Some(ty) if allowed.contains(&ty) => {
                                reads.push(ReadOp::Get(keyspace::meta_key(key, ty)));
                                metas.push((at, ty, expiry));
                            }
                            Some(_) => answers[at] = Reply::error(WRONGTYPE),
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
                        let items = elements(view, &coll);
                        bytes += items.iter().map(|(_, m)| m.len() + 48).sum::<usize>();
                        if let Some(limit) = limit.filter(|&limit| bytes > limit) {
                            return Next::Reply(reply_too_large(bytes, limit));
                        }
                        let mut flat = Vec::with_capacity(2 * items.len() + 1);
                        flat.push(Reply::Integer(ty as u8 as i64));
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
    let mut sources = Sources { elements: Vec::new(), fingerprints: Vec::new() };
    for reply in replies {
        match reply {
            Reply::Array(flat) => {
                let mut flat = flat.into_iter();
                let ty = match flat.next() {
                    Some(Reply::Integer(byte)) => KeyType::from_byte(byte as u8),
                    _ => None,
                };
                let mut items = Vec::new();
                while let (Some(Reply::Double(score)), Some(Reply::Bulk(member))) =
                    (flat.next(), flat.next())
                {
                    items.push((score, member));
                }
                sources.fingerprints.push(fingerprint(ty, &items));
                sources.elements.push(Some(items));
            }
            _ => {
                sources.fingerprints.push(fingerprint(None, &[]));
                sources.elements.push(None);
            }
        }
    }
    Ok(sources)
}

/// What a part of a STORE's batch answers when a source changed since it was read.
const CHANGED: &str = "CHANGED";

/// A STORE: reads `sources`, computes the result with `compute` (an error answers it, nothing
/// written), and replaces `destination` with a `ty` (a set or a sorted set) of the result in
/// one cross-shard batch that checks every source is as read. Answers the result's size.
pub async fn store<F>(
    server: &Arc<Server>,
    sources: Vec<Vec<u8>>,
    allowed: &'static [KeyType],
    destination: Vec<u8>,
    ty: KeyType,
    compute: F,
) -> Reply
where
    F: Fn(Vec<Option<Scored>>) -> Result<Scored, Reply>,
{
    for _ in 0..STORE_ATTEMPTS_MAX {
        let read = match read_sources(server, &sources, allowed, None).await {
            Ok(read) => read,
            Err(error) => return error,
        };
        let fingerprints = read.fingerprints;
        let result = match compute(read.elements) {
            Ok(result) => result,
            Err(error) => return error,
        };
        match write(server, &sources, &fingerprints, allowed, &destination, ty, result).await {
            Some(reply) => {
                if ty == KeyType::ZSet {
                    let namespace = super::namespace::current_number();
                    server.waiters.wake(crate::waiters::Kind::ZSet, namespace, &destination);
                }
                return reply;
            }
            None => tokio::task::yield_now().await,
        }
    }
    Reply::error("ERR the sources kept changing under this command; nothing was stored")
}

/// One shard's share of a STORE's write: the sources it holds, each with the fingerprint it was
/// read with, and the destination's result if the destination is there.
struct Share {
    checks: Vec<(Vec<u8>, u64)>,
    destination: Vec<u8>,
    result: Option<Scored>,
    ty: KeyType,
    allowed: &'static [KeyType],
    metas: Vec<(usize, KeyType, Expiry)>,
}

/// What a share decided at a step.
enum Decided {
    Read(copse::exec::ReadOps),
    /// Every source is as read: these are the shard's writes (none without the destination).
    Write(Vec<BatchOp>),
    /// A source changed: read again.
    Changed,
    Refused(Reply),
}

impl Share {
    fn start(&mut self, view: &View<'_>) -> Decided {
        let mut reads = smallvec::SmallVec::new();
        for (at, (key, expected)) in self.checks.iter().enumerate() {
            let expiry = Expiry::of(view, key);
            match expiry.live(stored_type(view, key)) {
                None if *expected == fingerprint(None, &[]) => {}
                Some(ty) if self.allowed.contains(&ty) => {
                    reads.push(ReadOp::Get(keyspace::meta_key(key, ty)));
                    self.metas.push((at, ty, expiry));
                }
                _ => return Decided::Changed,
            }
        }
        if reads.is_empty() {
            return self.writes(view);
        }
        Decided::Read(reads)
    }

    fn read(&mut self, view: &View<'_>, results: copse::exec::ReadResults) -> Decided {
        for ((at, found, expiry), result) in
            std::mem::take(&mut self.metas).into_iter().zip(results)
        {
            let Ok(meta) = coll_meta(Some(result)) else { return Decided::Changed };
            let (key, expected) = &self.checks[at];
            let coll = coll_make(view, key.clone(), found, expiry, meta);
            if fingerprint(Some(found), &elements(view, &coll)) != *expected {
                return Decided::Changed;
            }
        }
        self.writes(view)
    }

    fn writes(&mut self, view: &View<'_>) -> Decided {
        let ops = match self.result.take() {
            Some(result) => replace_ops(view, &self.destination, self.ty, result),
            None => Vec::new(),
        };
        match check_batch(&ops) {
            Ok(()) => Decided::Write(ops),
            Err(error) => Decided::Refused(error),
        }
    }
}

/// The batch of one STORE attempt: Some(answer), or None when a source changed (read again).
/// In one shard, one exec holding every key's lock; across shards, one cross-shard batch whose
/// parts each check their sources.
async fn write(
    server: &Arc<Server>,
    sources: &[Vec<u8>],
    fingerprints: &[u64],
    allowed: &'static [KeyType],
    destination: &[u8],
    ty: KeyType,
    result: Scored,
) -> Option<Reply> {
    let db = &server.db;
    let mut keys: Vec<Vec<u8>> = sources.to_vec();
    keys.push(destination.to_vec());
    let count = result.len();
    let mut result = Some(result);
    let groups = by_shard(db, &keys);
    let shares: Vec<(u32, Vec<Vec<u8>>, Share)> = groups
        .into_iter()
        .map(|(shard, at)| {
            let checks = at
                .iter()
                .filter(|&&i| i < sources.len())
                .map(|&i| (sources[i].clone(), fingerprints[i]))
                .collect();
            let share_result = at.contains(&sources.len()).then(|| result.take()).flatten();
            let locks = at.iter().map(|&i| keys[i].clone()).collect();
            let share = Share {
                checks,
                destination: destination.to_vec(),
                result: share_result,
                ty,
                allowed,
                metas: Vec::new(),
            };
            (shard, locks, share)
        })
        .collect();
    let answer = move |replies: Vec<Reply>| {
        if replies.iter().any(|r| matches!(r, Reply::Simple(word) if word == CHANGED)) {
            return Reply::Simple(CHANGED.into());
        }
        match replies.into_iter().find(|reply| !matches!(reply, Reply::Simple(_))) {
            Some(error) => error,
            None => Reply::Integer(count as i64),
        }
    };
    let outcome = if shares.len() == 1 {
        let (shard, locks, mut share) = shares.into_iter().next()?;
        let mut plan = Plan::new();
        plan.add(shard, locks, move |view, input| {
            let decided = match input {
                Input::Start => share.start(view),
                Input::Read(results) => share.read(view, results),
                Input::Written => return Next::Reply(Reply::ok()),
            };
            match decided {
                Decided::Read(reads) => Next::Read(reads),
                Decided::Write(ops) if ops.is_empty() => Next::Reply(Reply::ok()),
                Decided::Write(ops) => Next::Write(ops),
                Decided::Changed => Next::Reply(Reply::Simple(CHANGED.into())),
                Decided::Refused(error) => Next::Reply(error),
            }
        });
        plan.finish(Box::new(answer))
    } else {
        let mut plan = super::AtomicPlan::new();
        for (shard, locks, share) in shares {
            plan.add(shard, locks, move |vote| {
                let mut vote = Some(vote);
                let mut share = share;
                move |view: &View<'_>, input| {
                    let decided = match input {
                        Input::Start => share.start(view),
                        Input::Read(results) => share.read(view, results),
                        Input::Written => return Next::Reply(Reply::ok()),
                    };
                    let refuse = |vote: &mut Option<copse::exec::Vote>, reply: Reply| {
                        if let Some(vote) = vote.take() {
                            vote.refuse(copse::WriteError::Aborted("STORE refused".into()));
                        }
                        Next::Reply(reply)
                    };
                    match decided {
                        Decided::Read(reads) => Next::Read(reads),
                        Decided::Write(ops) => match vote.take() {
                            Some(vote) => Next::Prepare(vote, ops),
                            None => unexpected(),
                        },
                        Decided::Changed => refuse(&mut vote, Reply::Simple(CHANGED.into())),
                        Decided::Refused(error) => refuse(&mut vote, error),
                    }
                }
            });
        }
        plan.finish(db, Box::new(answer))
    };
    match run_outcome(db, outcome).await {
        Reply::Simple(word) if word == CHANGED => None,
        other => Some(other),
    }
}

/// The writes that replace `destination` (whatever it held, its deadline too; an expired one is
/// reclaimed) with a `ty` of `items`, or delete it when there are none.
fn replace_ops(view: &View<'_>, destination: &[u8], ty: KeyType, items: Scored) -> Vec<BatchOp> {
    let expiry = Expiry::of(view, destination);
    let existing = expiry.live(stored_type(view, destination));
    let (mut ops, expiry) = match existing {
        Some(found) => (delete_ops(destination, found, &expiry), Expiry::default()),
        None => (Vec::new(), expiry),
    };
    if items.is_empty() {
        ops.extend(expiry.before(Vec::new()));
        return last_op_wins(ops);
    }
    let coll = coll_make(view, destination.to_vec(), ty, expiry, None);
    for (score, member) in &items {
        match ty {
            KeyType::Set => ops.push(BatchOp::Put {
                key: keyspace::set_member_key(&coll.id, member),
                value: Vec::new(),
            }),
            _ => {
                // -0 and 0 are one score (zsets.rs invariant).
                let score = if *score == 0.0 { 0.0 } else { *score };
                ops.push(BatchOp::Put {
                    key: keyspace::member_key(&coll.id, member),
                    value: keyspace::encode_score(score),
                });
                ops.push(BatchOp::Put {
                    key: keyspace::score_key(&coll.id, score, member),
                    value: Vec::new(),
                });
            }
        }
    }
    ops.extend(coll.meta_ops(items.len()));
    last_op_wins(ops)
}

/// The most bytes a reply may take (the client output limit).
pub fn reply_limit(server: &Server) -> usize {
    server.settings.client_output_bytes_max.load(Ordering::Relaxed)
}
