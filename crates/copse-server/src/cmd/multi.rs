//! Transactions: MULTI, EXEC, DISCARD, WATCH and UNWATCH, with Redis's semantics.
//!
//! After MULTI every command is checked as dispatch would check it (known, arity, AUTH, key
//! lengths, and whether copse can run it inside a transaction, below) and queued, answered
//! `+QUEUED`; a command refused there is answered its error and makes EXEC answer EXECABORT and
//! run nothing. EXEC builds every queued command's execs in order (as dispatch would, so a
//! queued SELECT changes the database of the commands after it) and runs them as one
//! `copse::exec::Sequence` per shard: each shard's steps run one after another holding all
//! their locks, see each other's writes, and write once at the end, all or nothing. Over
//! several shards the sequences are the parts of one cross-shard batch (`Db::exec_atomic`), so a
//! crash keeps all of a transaction or none of it, and no other client sees part of it.
//!
//! WATCH reads, for each key, the version of its lock in its shard (`ExecView::lock_version`:
//! the writes execs issued under it), whether the key exists and its deadline. EXEC's sequences
//! check the versions under the locks before they run; a changed one calls the transaction off
//! and EXEC answers a null array. What changes keys without their locks is checked at EXEC
//! instead, as Redis's cas.tcl expects: a FLUSHALL or FLUSHDB since the WATCH fails it if a
//! watched key existed (`Server::flush_epoch`), any SWAPDB fails it (`swap_epoch`), and so does a
//! watched key that was live with a deadline that has passed (a key already expired at WATCH
//! does not).
//!
//! Invariants:
//! - EXEC's reply is sent only once every sequence reported `Applied`; a queued command's own
//!   answer is never passed on otherwise (`copse::exec::Sequence`, invariant 4).
//! - A transaction runs entirely as sequences or not at all: a command whose handler would run
//!   in steps of its own after the connection's earlier replies (`Outcome::AfterPending`: SCAN,
//!   KEYS, FLUSHALL, a blocking pop, RENAME across shards, ...) is refused while queueing.
//!   Should one still appear at EXEC, EXEC answers an error and runs nothing.
//! - WATCH records its keys before the connection's next command is dispatched (it runs after
//!   the earlier replies, as those commands do), so a pipelined UNWATCH or EXEC sees them.
//!
//! Where copse differs from Redis (docs/server.md, "Transactions"): the commands refused above
//! (Redis runs them, blocking pops without blocking); versions are per lock counter
//! (`LOCK_VERSION_SLOTS`) and locks are per key name in every database, so a write to another
//! key sharing the counter, or to the same name in another database, also fails a WATCH (only
//! ever towards a retry); FLUSHDB fails a WATCH of an existing key in any database, and SWAPDB
//! fails every WATCH.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use copse::exec::{
    lock_ids, AtomicExec, Exec, ExecRequest, ExecStep, ExecView, LockIds, Sequence,
    SequenceOutcome, StepInput,
};
use copse::limits::SEQUENCE_STEPS_MAX;
use futures::channel::oneshot;

use super::{
    answered, dispatch, dry_run, find_ignoring_case, stored_type, unknown_command, write_error,
    Call, Combine, Execs, Expiry, Input, Next, Outcome, Spec,
};
use crate::context::{ConnState, Server, Transaction, Watched, WatchedKey};
use crate::resp::{Args, Reply};

/// Commands that run at once even while a transaction is queued (Redis's list).
const RUN_AT_ONCE: &[&str] = &["exec", "discard", "multi", "watch", "quit", "reset"];

/// Commands refused while queueing that a dry run cannot find: those without the `write` or
/// `readonly` flag that answer after the connection's earlier replies, scripts (a script's
/// exec cannot run inside a sequence yet), (un)subscriptions, and the connection and server
/// commands that would change state as EXEC builds the transaction, before it knows whether the
/// transaction runs (CLIENT SETNAME, CONFIG SET, HELLO, AUTH, DEBUG; SELECT is undone instead).
const LATER_ANSWERED: &[&str] = &[
    "info",
    "scrub",
    "client",
    "config",
    "debug",
    "auth",
    "hello",
    "subscribe",
    "psubscribe",
    "ssubscribe",
    "unsubscribe",
    "punsubscribe",
    "sunsubscribe",
];

pub fn specs() -> Vec<Spec> {
    let spec = |name, arity, flags, summary, handler| {
        Spec::new("transactions", name, arity, flags, (0, 0, 0), summary, handler)
    };
    const F: &[&str] = &["fast"];
    vec![
        spec("multi", 1, F, "Starts a transaction.", multi as _),
        spec("exec", 1, &[], "Runs the commands queued since MULTI, atomically.", exec as _),
        spec("discard", 1, F, "Discards the commands queued since MULTI.", discard as _),
        Spec::new(
            "transactions",
            "watch",
            -2,
            F,
            (1, -1, 1),
            "Makes the next EXEC run only if these keys are not changed meanwhile.",
            watch as _,
        ),
        spec("unwatch", 1, F, "Forgets the keys WATCH named.", unwatch as _),
    ]
}

/// While a transaction is queued, queues `args` (answering `+QUEUED`) or refuses it (marking the
/// transaction for EXECABORT). Hands `args` back for dispatch when no transaction is queued or
/// the command runs at once.
pub fn queue(server: &Arc<Server>, conn: &mut ConnState, args: Args) -> Result<Outcome, Args> {
    if conn.transaction.is_none() {
        return Err(args);
    }
    let spec = find_ignoring_case(&args[0]);
    if let Some(spec) = spec.filter(|spec| RUN_AT_ONCE.contains(&spec.name)) {
        // Its arity is checked here: a wrong one flags the transaction, as in Redis.
        let count = args.len() as i32;
        if (spec.arity > 0 && count != spec.arity) || (spec.arity < 0 && count < -spec.arity) {
            let error = format!("wrong number of arguments for '{}' command", spec.name);
            if spec.name == "exec" {
                // Redis discards the transaction at once, with the reason.
                conn.transaction = None;
                conn.unwatch();
                return Ok(Outcome::Reply(Reply::Error(format!(
                    "EXECABORT Transaction discarded because of: {error}"
                ))));
            }
            conn.transaction.as_mut().expect("queueing").refused = true;
            return Ok(Outcome::Reply(Reply::Error(format!("ERR {error}"))));
        }
        return Err(args);
    }
    let refusal = match spec {
        None => Some(unknown_command(&args)),
        Some(spec) => refusal(server, conn, spec, &args),
    };
    let transaction = conn.transaction.as_mut().expect("queueing");
    let bytes: usize = args.iter().map(Vec::len).sum();
    let refusal = refusal.or_else(|| {
        let limit = server.config.client_query_buffer_bytes_max;
        (transaction.queued_bytes + bytes > limit).then(|| {
            format!(
                "ERR the commands queued since MULTI pass {limit} bytes (the query buffer limit)"
            )
        })
    });
    match refusal {
        Some(error) => {
            transaction.refused = true;
            Ok(Outcome::Reply(Reply::Error(error)))
        }
        None => {
            transaction.queued_bytes += bytes;
            transaction.queued.push(args);
            Ok(Outcome::Reply(Reply::Simple("QUEUED".into())))
        }
    }
}

/// Why `args` cannot be queued, as its error reply's text.
fn refusal(
    server: &Arc<Server>,
    conn: &mut ConnState,
    spec: &'static Spec,
    args: &Args,
) -> Option<String> {
    let name = spec.name;
    let count = args.len() as i32;
    if (spec.arity > 0 && count != spec.arity) || (spec.arity < 0 && count < -spec.arity) {
        return Some(format!("ERR wrong number of arguments for '{name}' command"));
    }
    if !conn.authenticated {
        return Some("NOAUTH Authentication required.".into());
    }
    let not_here = || {
        Some(format!(
            "ERR {} cannot run inside MULTI in copse: it would run in steps of its own (a \
             blocking or whole-keyspace command, or one whose keys span shards)",
            name.to_uppercase()
        ))
    };
    if spec.flags.contains(&"blocking") || LATER_ANSWERED.contains(&name) {
        return not_here();
    }
    if !(spec.flags.contains(&"write") || spec.flags.contains(&"readonly")) {
        return None;
    }
    // A data command's handler only builds its execs: built and dropped, it changes nothing.
    match dry_run(server, conn, spec, args.clone()) {
        Err(Reply::Error(error)) => Some(error),
        Err(_) => None,
        Ok(Outcome::AfterPending(_)) => not_here(),
        Ok(_) => None,
    }
}

fn multi(call: &mut Call<'_>) -> Outcome {
    if call.conn.transaction.is_some() {
        return Outcome::error("ERR MULTI calls can not be nested");
    }
    call.conn.transaction = Some(Transaction::default());
    Outcome::Reply(Reply::ok())
}

fn discard(call: &mut Call<'_>) -> Outcome {
    if call.conn.transaction.take().is_none() {
        return Outcome::error("ERR DISCARD without MULTI");
    }
    call.conn.unwatch();
    Outcome::Reply(Reply::ok())
}

fn unwatch(call: &mut Call<'_>) -> Outcome {
    call.conn.unwatch();
    Outcome::Reply(Reply::ok())
}

/// WATCH: reads each key's lock version in its shard, under its lock (so after every write
/// queued before it), and records them. It runs after the connection's earlier replies and
/// before its later commands are dispatched, so an UNWATCH or EXEC after it sees what it
/// recorded.
fn watch(call: &mut Call<'_>) -> Outcome {
    if call.conn.transaction.is_some() {
        return Outcome::error("ERR WATCH inside MULTI is not allowed");
    }
    let mut plan = super::Plan::new();
    let mut watching = Vec::new();
    for key in &call.args[1..] {
        let shard = call.db().shard_of(key);
        let lock = lock_ids(&[key])[0];
        watching.push((shard, lock));
        let key = key.clone();
        plan.add(shard, vec![key.clone()], move |view, input| match input {
            Input::Start => {
                let expiry = Expiry::of(view, &key);
                let existed = expiry.live(stored_type(view, &key)).is_some();
                let found = WatchedKey {
                    shard,
                    lock,
                    version: view.lock_version(lock),
                    existed,
                    deadline_ms: expiry.deadline_ms,
                };
                Next::Reply(Reply::Bulk(encode_watched(&found)))
            }
            _ => super::unexpected(),
        });
    }
    let watched = call.conn.watched.clone();
    let server = call.server.clone();
    Outcome::AfterPending(Box::pin(async move {
        let flush_epoch = server.flush_epoch.load(Ordering::Acquire);
        let swap_epoch = server.swap_epoch.load(Ordering::Acquire);
        let found = super::run_outcome(&server.db, plan.finish(Box::new(Reply::Array))).await;
        let Reply::Array(found) = found else { return found };
        let mut watched = watched.lock().unwrap_or_else(|poison| poison.into_inner());
        if watched.keys.is_empty() {
            watched.flush_epoch = flush_epoch;
            watched.swap_epoch = swap_epoch;
        }
        for ((shard, lock), found) in watching.into_iter().zip(found) {
            match found {
                Reply::Bulk(bytes) => match decode_watched(shard, lock, &bytes) {
                    Some(key) => watched.keys.push(key),
                    None => return Reply::error("ERR internal error: a watched key's state"),
                },
                other => return other,
            }
        }
        Reply::ok()
    }))
}

/// A transaction's step, run with the clock frozen at the transaction's reading (`now_ms`).
struct AtClock {
    inner: Box<dyn Exec>,
    now_ms: u64,
}

impl Exec for AtClock {
    fn step(&mut self, view: &ExecView<'_>, input: StepInput) -> ExecStep {
        let _frozen = super::FrozenClock::at(self.now_ms);
        self.inner.step(view, input)
    }
}

/// A watched key's state as its exec answers it: version, existed, deadline (0: none).
fn encode_watched(key: &WatchedKey) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(17);
    bytes.extend_from_slice(&key.version.to_le_bytes());
    bytes.push(u8::from(key.existed));
    bytes.extend_from_slice(&key.deadline_ms.unwrap_or(0).to_le_bytes());
    bytes
}

fn decode_watched(shard: u32, lock: u64, bytes: &[u8]) -> Option<WatchedKey> {
    let version = u64::from_le_bytes(bytes.get(0..8)?.try_into().ok()?);
    let existed = *bytes.get(8)? == 1;
    let deadline = u64::from_le_bytes(bytes.get(9..17)?.try_into().ok()?);
    let deadline_ms = (deadline != 0).then_some(deadline);
    Some(WatchedKey { shard, lock, version, existed, deadline_ms })
}

/// Whether something outside the watched locks changed a watched key since WATCH: a FLUSHALL
/// or FLUSHDB of a key that existed, any SWAPDB, or a deadline that passed (a key that was
/// live then has expired).
fn changed_outside_locks(server: &Server, watched: &Watched) -> bool {
    if watched.keys.is_empty() {
        return false;
    }
    let now = super::now_ms();
    server.swap_epoch.load(Ordering::Acquire) != watched.swap_epoch
        || (server.flush_epoch.load(Ordering::Acquire) != watched.flush_epoch
            && watched.keys.iter().any(|key| key.existed))
        || watched.keys.iter().any(|key| key.deadline_ms.is_some_and(|deadline| deadline <= now))
}

/// The check a transaction's sequences ask at their start and before their write: nothing
/// outside the watched keys' locks changed them (`changed_outside_locks`).
fn unchanged_outside_locks(
    server: &Arc<Server>,
    watched: Watched,
) -> Arc<dyn Fn() -> bool + Send + Sync> {
    let server = server.clone();
    Arc::new(move || !changed_outside_locks(&server, &watched))
}

/// How one queued command is answered at EXEC.
enum Answer {
    Ready(Reply),
    /// PUBLISH or SPUBLISH: delivered once the transaction applied (`cmd/pubsub.rs`).
    Publish {
        shard: bool,
        channel: Vec<u8>,
        message: Vec<u8>,
    },
    One(oneshot::Receiver<Reply>),
    Many(Vec<oneshot::Receiver<Reply>>, Combine),
}

/// One shard's share of a transaction: its steps, their locks, and its watched versions.
#[derive(Default)]
pub(crate) struct ShardShare {
    steps: Vec<(Box<dyn Exec>, LockIds)>,
    locks: LockIds,
    watched: Vec<(u64, u64)>,
}

impl ShardShare {
    /// A share of `steps` (each with its locks) holding `locks` too, checking `watched`.
    pub(crate) fn new(
        steps: Vec<(Box<dyn Exec>, LockIds)>,
        locks: LockIds,
        watched: Vec<(u64, u64)>,
    ) -> ShardShare {
        let mut share = ShardShare { steps, locks, watched };
        let step_locks: Vec<u64> =
            share.steps.iter().flat_map(|(_, locks)| locks.iter().copied()).collect();
        share.locks.extend(step_locks);
        share
    }

    fn lock(&mut self, locks: &[u64]) {
        self.locks.extend_from_slice(locks);
    }

    fn sorted_locks(&mut self) -> LockIds {
        let mut locks = std::mem::take(&mut self.locks);
        locks.sort_unstable();
        locks.dedup();
        locks
    }
}

fn exec(call: &mut Call<'_>) -> Outcome {
    let Some(transaction) = call.conn.transaction.take() else {
        return Outcome::error("ERR EXEC without MULTI");
    };
    let watched = std::mem::take(&mut *call.conn.watched.lock().unwrap_or_else(|p| p.into_inner()));
    if transaction.refused {
        return Outcome::error("EXECABORT Transaction discarded because of previous errors.");
    }
    let is_script = |args: &crate::resp::Args| {
        matches!(super::lowercase(&args[0]).as_str(), "eval" | "evalsha" | "eval_ro" | "evalsha_ro")
    };
    if transaction.queued.iter().any(is_script) {
        return with_scripts(call, transaction.queued, watched);
    }
    // Each command's execs, built in order, as dispatch builds them, all at one clock reading
    // (Redis freezes time for a transaction too). A queued SELECT changes the database of the
    // commands after it, and of the connection only if the transaction runs.
    let mut shares: BTreeMap<u32, ShardShare> = BTreeMap::new();
    let mut answers = Vec::with_capacity(transaction.queued.len());
    let now_ms = super::now_ms();
    let db_before = call.conn.db;
    call.conn.in_exec = true;
    let _frozen = super::FrozenClock::at(now_ms);
    let mut unsupported = None;
    for args in transaction.queued {
        let name = String::from_utf8_lossy(&args[0]).to_uppercase();
        if (name == "PUBLISH" || name == "SPUBLISH") && args.len() == 3 {
            let shard = name == "SPUBLISH";
            let (channel, message) = (args[1].clone(), args[2].clone());
            answers.push(Answer::Publish { shard, channel, message });
            continue;
        }
        let outcome = dispatch(call.server, call.conn, args).outcome;
        let mut add = |queued: super::Queued| {
            let share = shares.entry(queued.shard).or_default();
            share.lock(&queued.request.locks);
            let exec = Box::new(AtClock { inner: queued.request.exec, now_ms });
            share.steps.push((exec, queued.request.locks));
        };
        answers.push(match outcome {
            Outcome::Reply(reply) | Outcome::Close(reply) => Answer::Ready(reply),
            Outcome::Execs(Execs::One { queued, answer }) => {
                add(queued);
                Answer::One(answer)
            }
            Outcome::Execs(Execs::Many { queued, answers, combine }) => {
                queued.into_iter().for_each(&mut add);
                Answer::Many(answers, combine)
            }
            Outcome::AfterPending(_) => {
                unsupported.get_or_insert(name);
                Answer::Ready(Reply::Null)
            }
        });
    }
    call.conn.in_exec = false;
    let db_after = std::mem::replace(&mut call.conn.db, db_before);
    call.conn.select(db_before);
    if let Some(name) = unsupported {
        return Outcome::Reply(Reply::Error(format!(
            "ERR {name} cannot run inside MULTI in copse; the transaction was not run"
        )));
    }
    for key in &watched.keys {
        let share = shares.entry(key.shard).or_default();
        share.lock(&[key.lock]);
        share.watched.push((key.lock, key.version));
    }
    let server = call.server.clone();
    let switch_db = call.conn.after_exec.clone();
    Outcome::AfterPending(Box::pin(async move {
        // Asked by each sequence at its start and right before its write, under its locks.
        let check = unchanged_outside_locks(&server, watched);
        if !check() {
            return Reply::NullArray;
        }
        match run(&server, shares, Some(check)).await {
            Ok(true) => {}
            Ok(false) => return Reply::NullArray,
            Err(error) => return error,
        }
        if db_after != db_before {
            switch_db.store(u16::from(db_after) + 1, Ordering::Release);
        }
        let mut replies = Vec::with_capacity(answers.len());
        for answer in answers {
            replies.push(match answer {
                Answer::Ready(reply) => reply,
                Answer::Publish { shard, channel, message } => {
                    Reply::Integer(server.pubsub.publish(&channel, &message, shard) as i64)
                }
                Answer::One(answer) => answered(answer).await,
                Answer::Many(answers, combine) => super::collect(answers, combine).await,
            });
        }
        Reply::Array(replies)
    }))
}

/// EXEC of a transaction that holds a script: a script's calls cannot be built before it runs,
/// so the whole transaction runs optimistically as one session (`scripts::spread`): every
/// command and call tried in its shard in order, then one batch that checks every version they
/// saw and the watched ones. (A SELECT inside it changes the database of the commands after it,
/// and the connection's once EXEC ran.)
fn with_scripts(call: &mut Call<'_>, queued: Vec<crate::resp::Args>, watched: Watched) -> Outcome {
    let server = call.server.clone();
    let (client, db) = (call.conn.info.clone(), call.conn.db);
    let switch_db = call.conn.after_exec.clone();
    let keys = watched.keys.clone();
    Outcome::AfterPending(Box::pin(async move {
        let check = unchanged_outside_locks(&server, watched);
        if !check() {
            return Reply::NullArray;
        }
        let ran = super::scripts::spread::transaction(&server, client, db, queued, keys, check);
        match ran.await {
            Some((reply, db_after)) => {
                // A queued SELECT switches the connection's database once EXEC ran.
                if matches!(reply, Reply::Array(_)) && db_after != db {
                    switch_db.store(u16::from(db_after) + 1, Ordering::Release);
                }
                reply
            }
            None => Reply::NullArray,
        }
    }))
}

/// `outcome` made atomic over shards: a command's execs over several shards (DEL, UNLINK, EXISTS,
/// TOUCH of several keys) run as one cross-shard batch of one sequence per shard, so no other
/// client sees part of a DEL and a crash keeps all of it or none, and EXISTS counts its keys at
/// one moment. Inside EXEC (already one batch) or on one shard, `outcome` as it is.
pub fn atomically(call: &Call<'_>, outcome: Outcome) -> Outcome {
    if call.conn.in_exec {
        return outcome;
    }
    let Outcome::Execs(Execs::Many { queued, answers, combine }) = outcome else {
        return outcome;
    };
    if queued.windows(2).all(|pair| pair[0].shard == pair[1].shard) {
        return Outcome::Execs(Execs::Many { queued, answers, combine });
    }
    let mut shares: BTreeMap<u32, ShardShare> = BTreeMap::new();
    for queued in queued {
        let share = shares.entry(queued.shard).or_default();
        share.lock(&queued.request.locks);
        share.steps.push((queued.request.exec, queued.request.locks));
    }
    let server = call.server.clone();
    Outcome::AfterPending(Box::pin(async move {
        match run(&server, shares, None).await {
            Ok(true) => super::collect(answers, combine).await,
            Ok(false) => Reply::error("ERR internal error: a batch with no watched key changed"),
            Err(error) => error,
        }
    }))
}

/// Runs the shares as one sequence each: alone in one shard, or as the parts of one cross-shard
/// batch. Ok(true) once all applied, Ok(false) if a watched key changed (`check` false).
pub(crate) async fn run(
    server: &Server,
    shares: BTreeMap<u32, ShardShare>,
    check: Option<Arc<dyn Fn() -> bool + Send + Sync>>,
) -> Result<bool, Reply> {
    let db = &server.db;
    // What a transaction's steps may read in one shard: the most one reply may hold.
    let read_bytes_max = server.settings.client_output_bytes_max.load(Ordering::Relaxed);
    let checker = |check: &Option<Arc<dyn Fn() -> bool + Send + Sync>>| {
        check.clone().map(|check| Box::new(move || check()) as Box<dyn Fn() -> bool + Send>)
    };
    if let Some(share) = shares.values().find(|share| share.steps.len() > SEQUENCE_STEPS_MAX) {
        return Err(Reply::Error(format!(
            "ERR a transaction of {} commands on one shard passes the limit of {SEQUENCE_STEPS_MAX}",
            share.steps.len()
        )));
    }
    let mut outcomes = Vec::with_capacity(shares.len());
    if shares.len() == 1 {
        let (shard, mut share) = shares.into_iter().next().expect("one share");
        let (done, outcome) = oneshot::channel();
        let locks = share.sorted_locks();
        let sequence =
            Sequence::new(share.steps, share.watched, checker(&check), read_bytes_max, None, done)
                .map_err(|err| Reply::Error(format!("ERR {err}")))?;
        db.exec_many_async(shard, vec![ExecRequest { locks, exec: Box::new(sequence) }]).await;
        outcomes.push(outcome);
    } else if shares.len() > 1 {
        let mut parts = Vec::with_capacity(shares.len());
        for (shard, mut share) in shares {
            let (done, outcome) = oneshot::channel();
            outcomes.push(outcome);
            let lock_ids = share.sorted_locks();
            let check = checker(&check);
            parts.push(AtomicExec {
                shard,
                locks: Vec::new(),
                lock_ids,
                build: Box::new(move |vote| {
                    let sequence = Sequence::new(
                        share.steps,
                        share.watched,
                        check,
                        read_bytes_max,
                        Some(vote),
                        done,
                    )
                    .expect("checked the steps above");
                    Box::new(sequence) as Box<dyn Exec>
                }),
            });
        }
        db.exec_atomic(parts).await;
    }
    let mut changed = false;
    let mut failure = None;
    for outcome in outcomes {
        match outcome.await {
            Ok(SequenceOutcome::Applied) => {}
            Ok(SequenceOutcome::Changed) => changed = true,
            Ok(SequenceOutcome::Failed(err)) => {
                // The cause rather than the abort it led to elsewhere.
                if failure.is_none() || !matches!(err, copse::WriteError::Aborted(_)) {
                    failure = Some(err);
                }
            }
            // A part never built: the batch was called off before it (or the store closed).
            Err(oneshot::Canceled) => {
                failure.get_or_insert(copse::WriteError::Aborted("a part did not run".into()));
            }
        }
    }
    if changed {
        return Ok(false);
    }
    match failure {
        None => Ok(true),
        Some(err) => Err(write_error(&err)),
    }
}
