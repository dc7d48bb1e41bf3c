//! Key expiry: the commands that set, read and remove a key's deadline (EXPIRE, PEXPIRE,
//! EXPIREAT, PEXPIREAT, TTL, PTTL, EXPIRETIME, PEXPIRETIME, PERSIST), and active expiry, the
//! background task that deletes keys whose deadline passed (docs/format/redis-keyspace.md,
//! "Expiry"). SET's, SETEX's and GETEX's expiry options are in `strings.rs`.
//!
//! A key's deadline is two items, written and deleted in one batch: its expiry item (`'e' K
//! deadline`), which every command finds in the index to learn whether its key is there
//! (`Expiry::of`, no I/O), and its due item (`'t' deadline K`), the per-shard expiry index in
//! deadline order. A key whose deadline passed reads as missing at once, whether or not it has
//! been deleted yet; a command that writes it deletes it in its own batch first.
//!
//! Invariants:
//! - Active expiry never scans the key space: each round lists, per shard, the due items up to
//!   now (at most `EXPIRY_KEYS_PER_BATCH`), and deletes those keys in one batch under their locks.
//! - It deletes a key only if the key's own expiry item, read under its lock, has passed: a key
//!   whose expiry changed since the due item was listed is left alone.
//! - Deadlines are absolute Unix times in milliseconds and persisted, so a restart honours them:
//!   keys that expired while the server was down read as missing from the first command on.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use copse::BatchOp;

use super::strings::check_expiring_key;
use super::{
    answer, delete_ops, now_ms, on_key, parse_i64, run_outcome, shard_keys, stored_deadline,
    stored_type, ttl_ops, unexpected, Call, Expiry, Input, KeyTarget, Next, Outcome, Plan, Spec,
    NOT_INTEGER,
};
use crate::context::Server;
use crate::keyspace;
use crate::resp::Reply;

/// Keys active expiry deletes at most in one batch of one shard (each costs up to five item
/// writes: meta item, orphan record, expiry and due items).
pub const EXPIRY_KEYS_PER_BATCH: usize = 500;
/// How long active expiry waits before looking again when a round found fewer due keys than a
/// full batch in every shard (Redis's active expiry runs 10 times a second too).
pub const EXPIRY_IDLE_POLL_MS: u64 = 100;

pub fn specs() -> Vec<Spec> {
    let spec = |name, arity, flags, first, last, step, summary, handler| {
        Spec::new("generic", name, arity, flags, (first, last, step), summary, handler)
    };
    const W: &[&str] = &["write", "fast"];
    const R: &[&str] = &["readonly", "fast"];
    vec![
        spec("expire", -3, W, 1, 1, 1, "Sets a key's time to live in seconds.", expire as _),
        spec("pexpire", -3, W, 1, 1, 1, "Sets a key's time to live in milliseconds.", pexpire as _),
        spec("expireat", -3, W, 1, 1, 1, "Sets a key's expiry as a Unix time.", expireat as _),
        spec("pexpireat", -3, W, 1, 1, 1, "Sets a key's expiry in Unix ms.", pexpireat as _),
        spec("ttl", 2, R, 1, 1, 1, "Seconds to live; -1 without expiry, -2 if missing.", ttl as _),
        spec("pttl", 2, R, 1, 1, 1, "Milliseconds to live; -1, or -2 if missing.", pttl as _),
        spec("expiretime", 2, R, 1, 1, 1, "A key's expiry as a Unix time.", expiretime as _),
        spec("pexpiretime", 2, R, 1, 1, 1, "A key's expiry in Unix ms.", pexpiretime as _),
        spec("persist", 2, W, 1, 1, 1, "Removes a key's expiry.", persist as _),
    ]
}

/// The conditions of EXPIRE's family (Redis 7).
#[derive(Default)]
struct Conditions {
    /// Only if the key has no expiry.
    nx: bool,
    /// Only if it has one.
    xx: bool,
    /// Only if the new deadline is later (a key without expiry never passes: it lives forever).
    gt: bool,
    /// Only if the new deadline is earlier (a key without expiry always passes).
    lt: bool,
}

impl Conditions {
    fn parse(call: &Call<'_>) -> Result<Conditions, Reply> {
        let mut conditions = Conditions::default();
        for at in 3..call.args.len() {
            match call.word(at).as_str() {
                "nx" => conditions.nx = true,
                "xx" => conditions.xx = true,
                "gt" => conditions.gt = true,
                "lt" => conditions.lt = true,
                _ => {
                    let option = String::from_utf8_lossy(&call.args[at]);
                    return Err(Reply::Error(format!("ERR Unsupported option {option}")));
                }
            }
        }
        if conditions.nx && (conditions.xx || conditions.gt || conditions.lt) {
            return Err(Reply::error(
                "ERR NX and XX, GT or LT options at the same time are not compatible",
            ));
        }
        if conditions.gt && conditions.lt {
            return Err(Reply::error("ERR GT and LT options at the same time are not compatible"));
        }
        Ok(conditions)
    }

    /// Whether a key whose deadline is `current` (None: no expiry) takes `deadline`.
    fn allow(&self, current: Option<u64>, deadline: i64) -> bool {
        let current = current.map(|current| current as i64);
        !((self.nx && current.is_some())
            || (self.xx && current.is_none())
            || (self.gt && current.is_none_or(|current| deadline <= current))
            || (self.lt && current.is_some_and(|current| deadline >= current)))
    }
}

/// EXPIRE and its family: `seconds` when the amount counts seconds, `absolute` when it is a
/// Unix time rather than a time from now. A deadline already past deletes the key.
fn expire_with(call: &mut Call<'_>, seconds: bool, absolute: bool) -> Outcome {
    // Redis 7 reads the options before the amount.
    let conditions = match Conditions::parse(call) {
        Ok(conditions) => conditions,
        Err(reply) => return Outcome::Reply(reply),
    };
    let Some(amount) = parse_i64(&call.args[2]) else { return Outcome::error(NOT_INTEGER) };
    let command = call.word(0);
    let invalid = || Outcome::error(format!("ERR invalid expire time in '{command}' command"));
    // Redis allows negative amounts, and refuses only those whose deadline overflows.
    let deadline = if seconds { amount.checked_mul(1000) } else { Some(amount) };
    // The command's time, as Redis's `commandTimeSnapshot`: a relative amount counts from it,
    // and a deadline is "already past" against it, not against when the exec runs.
    let now = now_ms() as i64;
    let base = if absolute { 0 } else { now };
    let Some(deadline) = deadline.and_then(|deadline| deadline.checked_add(base)) else {
        return invalid();
    };
    let key = std::mem::take(&mut call.args[1]);
    let mut pending = None;
    on_key(KeyTarget::of(call.db(), &key), move |view, input| match input {
        Input::Start => {
            let expiry = Expiry::of(view, &key);
            let Some(ty) = expiry.live(stored_type(view, &key)) else {
                return Next::Reply(Reply::Integer(0));
            };
            if !conditions.allow(expiry.deadline_ms, deadline) {
                return Next::Reply(Reply::Integer(0));
            }
            let ops = if deadline <= now {
                delete_ops(&key, ty, &expiry)
            } else {
                // A missing key answered 0 above, as in Redis; an existing one too long for an
                // expiry item is refused.
                if let Err(error) = check_expiring_key(&key) {
                    return Next::Reply(error);
                }
                ttl_ops(&key, expiry.deadline_ms, Some(deadline as u64))
            };
            if ops.is_empty() {
                return Next::Reply(Reply::Integer(1));
            }
            pending = Some(Reply::Integer(1));
            Next::WriteLast(ops)
        }
        Input::Written => answer(&mut pending),
        Input::Read(_) => unexpected(),
    })
}

fn expire(call: &mut Call<'_>) -> Outcome {
    expire_with(call, true, false)
}

fn pexpire(call: &mut Call<'_>) -> Outcome {
    expire_with(call, false, false)
}

fn expireat(call: &mut Call<'_>) -> Outcome {
    expire_with(call, true, true)
}

fn pexpireat(call: &mut Call<'_>) -> Outcome {
    expire_with(call, false, true)
}

/// TTL and its family: -2 for a missing key, -1 for one without expiry, else the time left
/// (`absolute`: the deadline), in milliseconds or in seconds rounded as Redis rounds them.
fn ttl_with(call: &mut Call<'_>, in_ms: bool, absolute: bool) -> Outcome {
    let key = std::mem::take(&mut call.args[1]);
    on_key(KeyTarget::of(call.db(), &key), move |view, input| match input {
        Input::Start => {
            let expiry = Expiry::of(view, &key);
            let live = expiry.live(stored_type(view, &key));
            view.note_lookup(live.is_some());
            let answer = match (live, expiry.deadline_ms) {
                (None, _) => -2,
                (Some(_), None) => -1,
                (Some(_), Some(deadline)) => {
                    let left = if absolute { deadline } else { deadline.saturating_sub(now_ms()) };
                    let left = left.min(i64::MAX as u64) as i64;
                    if in_ms {
                        left
                    } else {
                        left.saturating_add(500) / 1000
                    }
                }
            };
            Next::Reply(Reply::Integer(answer))
        }
        _ => unexpected(),
    })
}

fn ttl(call: &mut Call<'_>) -> Outcome {
    ttl_with(call, false, false)
}

fn pttl(call: &mut Call<'_>) -> Outcome {
    ttl_with(call, true, false)
}

fn expiretime(call: &mut Call<'_>) -> Outcome {
    ttl_with(call, false, true)
}

fn pexpiretime(call: &mut Call<'_>) -> Outcome {
    ttl_with(call, true, true)
}

/// PERSIST: 1 if the key had an expiry and no longer has, else 0.
fn persist(call: &mut Call<'_>) -> Outcome {
    let key = std::mem::take(&mut call.args[1]);
    let mut pending = None;
    on_key(KeyTarget::of(call.db(), &key), move |view, input| match input {
        Input::Start => {
            let expiry = Expiry::of(view, &key);
            match (expiry.live(stored_type(view, &key)), expiry.deadline_ms) {
                (Some(_), Some(deadline)) => {
                    pending = Some(Reply::Integer(1));
                    Next::WriteLast(ttl_ops(&key, Some(deadline), None))
                }
                _ => Next::Reply(Reply::Integer(0)),
            }
        }
        Input::Written => answer(&mut pending),
        Input::Read(_) => unexpected(),
    })
}

/// Runs active expiry until the runtime that polls it stops.
pub async fn run(server: Arc<Server>) {
    loop {
        let mut full_batch = false;
        let active = server.settings.active_expire.load(Ordering::Relaxed);
        let namespaces = match active {
            true => super::keys::namespaces_in_use(&server.db).await.unwrap_or_else(|_| vec![0]),
            false => Vec::new(),
        };
        let rounds = namespaces
            .iter()
            .flat_map(|&number| (0..server.db.shard_count()).map(move |shard| (number, shard)));
        for (number, shard) in rounds {
            let round = expire_due(&server, shard);
            match super::namespace::Namespace::detached(number).bind(round).await {
                // Another round at once only if this one was full and did something (a clock
                // stepped back makes listed keys not due yet: then wait like an idle round).
                Ok((listed, expired)) => {
                    full_batch |= listed == EXPIRY_KEYS_PER_BATCH && expired > 0
                }
                Err(error) => {
                    tracing::warn!(?error, shard, "active expiry failed; it will try again");
                }
            }
        }
        if !full_batch {
            tokio::time::sleep(Duration::from_millis(EXPIRY_IDLE_POLL_MS)).await;
        }
    }
}

/// One round of active expiry in `shard`: deletes the keys whose due items are up to now, at
/// most `EXPIRY_KEYS_PER_BATCH`, in one batch. Returns the due items listed and the keys deleted.
async fn expire_due(server: &Server, shard: u32) -> Result<(usize, u64), Reply> {
    let (start, end) = keyspace::due_range(now_ms());
    let items = shard_keys(&server.db, shard, (&start, &end), None, EXPIRY_KEYS_PER_BATCH).await?;
    if items.is_empty() {
        return Ok((0, 0));
    }
    let listed = items.len();
    let due: Vec<(u64, Vec<u8>)> = items
        .iter()
        .filter_map(|item| keyspace::decode_due(item))
        .map(|(deadline, key)| (deadline, key.to_vec()))
        .collect();
    let locks = due.iter().map(|(_, key)| key.clone()).collect();
    let mut plan = Plan::new();
    let mut expired = 0;
    plan.add_background(shard, locks, move |view, input| match input {
        Input::Start => {
            let mut ops: Vec<BatchOp> = Vec::new();
            for (deadline, key) in &due {
                let expiry = Expiry::of(view, key);
                if expiry.expired() {
                    expired += 1;
                    ops.extend(expiry.before(Vec::new()));
                } else if stored_deadline(view, key) != Some(*deadline) {
                    // A due item without its expiry item: never written so, but not left to
                    // be listed again forever.
                    ops.push(BatchOp::Delete { key: keyspace::due_key(*deadline, key) });
                }
            }
            if ops.is_empty() {
                return Next::Reply(Reply::Integer(0));
            }
            Next::Write(ops)
        }
        Input::Written => Next::Reply(Reply::Integer(expired)),
        Input::Read(_) => unexpected(),
    });
    let combine = Box::new(|mut replies: Vec<Reply>| replies.pop().unwrap_or(Reply::Null));
    match run_outcome(&server.db, plan.finish(combine)).await {
        Reply::Integer(expired) => {
            server.stats.expired_keys.fetch_add(expired as u64, Ordering::Relaxed);
            Ok((listed, expired as u64))
        }
        other => Err(other),
    }
}
