//! Commands over keys of any type and over the whole key space: DEL, UNLINK, EXISTS, TYPE,
//! SCAN, KEYS, DBSIZE, FLUSHALL, FLUSHDB.
//!
//! Key-space commands read only the shards' indexes (meta items carry the type in their key), so
//! SCAN, KEYS and DBSIZE do no I/O. SCAN's cursor is the scan hash to continue from: meta items
//! are ordered by it, so a cursor survives writes, and every key present for a whole iteration
//! is returned at least once.

use std::ops::Bound;

use copse::exec::ReadOp;
use copse::BatchOp;
use copse::Db;

use super::names;
use super::namespace::{Namespace, DATABASES};
use super::View;
use super::{
    by_shard, delete_ops, key_type, lowercase, on_key, one_batch, parse_i64, stored_type,
    unexpected, Call, Expiry, Input, KeyTarget, Next, Outcome, Plan, Spec, NOT_INTEGER, SYNTAX,
};
use crate::cmd::run_outcome;
use crate::keyspace::{self, decode_meta, KeyType};
use crate::resp::Reply;

/// Keys a SCAN step looks at when COUNT is not given (Redis's default).
pub const SCAN_COUNT_DEFAULT: usize = 10;
/// The largest COUNT honoured; larger asks are clamped (the reply stays bounded).
pub const SCAN_COUNT_MAX: usize = 100_000;
/// Keys a FLUSHALL deletes per write batch.
pub const FLUSH_BATCH_KEYS: usize = 1_000;

pub fn specs() -> Vec<Spec> {
    let spec = |name, arity, flags, first, last, step, summary, handler| {
        Spec::new("generic", name, arity, flags, (first, last, step), summary, handler)
    };
    const W: &[&str] = &["write"];
    const R: &[&str] = &["readonly"];
    vec![
        spec("del", -2, W, 1, -1, 1, "Deletes keys.", del as _),
        spec("unlink", -2, W, 1, -1, 1, "Deletes keys (as DEL).", del as _),
        spec("exists", -2, R, 1, -1, 1, "Counts the given keys that exist.", exists as _),
        // Noting the keys as used (`cmd::dispatch`) is all TOUCH does besides EXISTS's count.
        spec("touch", -2, R, 1, -1, 1, "Counts existing keys, noting them as used.", exists as _),
        spec("type", 2, R, 1, 1, 1, "Returns the type of a key.", type_of as _),
        spec("scan", -2, R, 0, 0, 0, "Iterates over the key space.", scan as _),
        spec("keys", 2, R, 0, 0, 0, "Returns the keys that match a pattern.", keys as _),
        spec("dbsize", 1, R, 0, 0, 0, "Returns the number of keys.", dbsize as _),
        spec("flushall", -1, W, 0, 0, 0, "Deletes every key.", flushall as _),
        spec("flushdb", -1, W, 0, 0, 0, "Deletes every key of the database.", flushdb as _),
    ]
}

fn del(call: &mut Call<'_>) -> Outcome {
    let keys: Vec<Vec<u8>> = call.args[1..].to_vec();
    let mut plan = Plan::new();
    for (shard, at) in by_shard(call.db(), &keys) {
        let mut group: Vec<Vec<u8>> = at.iter().map(|&i| keys[i].clone()).collect();
        group.sort();
        group.dedup();
        let mut deleted = 0;
        plan.add(shard, group.clone(), move |view, input| match input {
            Input::Start => {
                let mut per_key = Vec::new();
                for key in &group {
                    let expiry = Expiry::of(view, key);
                    match expiry.live(stored_type(view, key)) {
                        Some(ty) => {
                            deleted += 1;
                            per_key.push(delete_ops(key, ty, &expiry));
                        }
                        // Not counted (it is missing), but deleted now rather than later.
                        None if expiry.expired() => per_key.push(expiry.before(Vec::new())),
                        None => {}
                    }
                }
                // Every key of the shard in one atomic write, however many.
                match one_batch(per_key) {
                    Ok(batch) if batch.is_empty() => Next::Reply(Reply::Integer(0)),
                    Ok(batch) => Next::Write(batch),
                    Err(reply) => Next::Reply(reply),
                }
            }
            Input::Written => Next::Reply(Reply::Integer(deleted)),
            Input::Read(_) => unexpected(),
        });
    }
    // Over several shards, one cross-shard batch: all or nothing, never seen in part.
    super::multi::atomically(call, plan.finish(Box::new(sum_integers)))
}

/// Adds integer answers; the first error wins.
fn sum_integers(replies: Vec<Reply>) -> Reply {
    let mut total = 0;
    for reply in replies {
        match reply {
            Reply::Integer(count) => total += count,
            other => return other,
        }
    }
    Reply::Integer(total)
}

/// Execs counting which of `keys` exist (a key named twice counts twice, as in Redis).
fn existing_plan(db: &Db, keys: &[Vec<u8>]) -> Outcome {
    let mut plan = Plan::new();
    for (shard, at) in by_shard(db, keys) {
        let group: Vec<Vec<u8>> = at.iter().map(|&i| keys[i].clone()).collect();
        // The shard dedups lock keys; a key named twice is counted twice, as in Redis.
        plan.add(shard, group.clone(), move |view, input| match input {
            Input::Start => {
                let count = group.iter().filter(|key| key_type(view, key).is_some()).count();
                Next::Reply(Reply::Integer(count as i64))
            }
            _ => unexpected(),
        });
    }
    plan.finish(Box::new(sum_integers))
}

fn exists(call: &mut Call<'_>) -> Outcome {
    // Over several shards, counted at one moment (one cross-shard batch of reads).
    super::multi::atomically(call, existing_plan(call.db(), &call.args[1..]))
}

fn type_of(call: &mut Call<'_>) -> Outcome {
    let key = call.args[1].clone();
    on_key(KeyTarget::of(call.db(), &key), move |view, input| match input {
        Input::Start => {
            let name = key_type(view, &key).map_or("none", KeyType::name);
            Next::Reply(Reply::Simple(name.into()))
        }
        _ => unexpected(),
    })
}

/// One page of the key space in SCAN order, from `cursor`: up to `count` live keys (an
/// expired key is listed by no SCAN or KEYS) as the client wrote them, with their types, and
/// the cursor after the page's items (0 when the key space is exhausted).
async fn scan_page(
    db: &Db,
    cursor: u64,
    count: usize,
) -> Result<(Vec<(Vec<u8>, KeyType)>, u64), Reply> {
    let mut plan = Plan::new();
    let start = keyspace::meta_scan_start(cursor);
    let end = keyspace::meta_scan_end();
    for shard in 0..db.shard_count() {
        let (start, end) = (start.clone(), end.clone());
        // Each listed meta item as [item, key] (a live key) or [item] (an expired one, which
        // still moves the cursor); a surrogate's key is read from its name item.
        let mut listed: Vec<Vec<Reply>> = Vec::new();
        let mut unnamed: Vec<usize> = Vec::new();
        let mut asked = 0..0;
        plan.add(shard, vec![], move |view, input| {
            match input {
                Input::Start => {
                    // One more than asked: its hash is the next cursor.
                    let items =
                        view.keys(Bound::Included(&start), Bound::Excluded(&end), count + 1);
                    for item in items {
                        let live = decode_meta(&item)
                            .filter(|(_, name, _)| !Expiry::of(view, name).expired())
                            .map(|(_, name, _)| name.to_vec());
                        let mut entry = vec![Reply::Bulk(item)];
                        if let Some(name) = live {
                            if keyspace::is_surrogate(&name) {
                                unnamed.push(listed.len());
                            }
                            entry.push(Reply::Bulk(name));
                        }
                        listed.push(entry);
                    }
                }
                Input::Read(results) => {
                    for (&at, result) in unnamed[asked.clone()].iter().zip(results) {
                        match super::value_of(Some(result)) {
                            Some(key) => listed[at][1] = Reply::Bulk(key),
                            None => return Next::Reply(Reply::error(names::NAME_ITEM_MISSING)),
                        }
                    }
                }
                Input::Written => return unexpected(),
            }
            asked = asked.end..(asked.end + copse::limits::EXEC_READS_MAX).min(unnamed.len());
            if asked.is_empty() {
                let listed = std::mem::take(&mut listed).into_iter().map(Reply::Array);
                return Next::Reply(Reply::Array(listed.collect()));
            }
            Next::Read(
                unnamed[asked.clone()]
                    .iter()
                    .map(|&at| match &listed[at][1] {
                        Reply::Bulk(name) => ReadOp::Get(keyspace::name_key(name)),
                        _ => unreachable!("a live key's entry holds its name"),
                    })
                    .collect(),
            )
        });
    }
    let pages = match run_outcome(db, plan.finish(Box::new(Reply::Array))).await {
        Reply::Array(pages) => pages,
        other => return Err(other),
    };
    // (item, the key if it is live)
    let mut items: Vec<(Vec<u8>, Option<Vec<u8>>)> = Vec::new();
    for page in pages {
        let Reply::Array(page) = page else { return Err(page) };
        for entry in page {
            let Reply::Array(mut entry) = entry else { continue };
            let key = match entry.pop() {
                Some(Reply::Bulk(key)) if !entry.is_empty() => Some(key),
                Some(Reply::Bulk(item)) => {
                    items.push((item, None));
                    continue;
                }
                _ => continue,
            };
            if let Some(Reply::Bulk(item)) = entry.pop() {
                items.push((item, key));
            }
        }
    }
    items.sort_unstable();
    let next = match items.get(count) {
        Some((item, _)) => decode_meta(item).map_or(0, |(hash, _, _)| hash),
        None => 0,
    };
    items.truncate(count);
    let live = items.into_iter().filter_map(|(item, key)| {
        let (_, _, ty) = decode_meta(&item)?;
        Some((key?, ty))
    });
    Ok((live.collect(), next))
}

pub use crate::glob::glob_match;

fn scan(call: &mut Call<'_>) -> Outcome {
    let Some(cursor) = std::str::from_utf8(&call.args[1]).ok().and_then(|c| c.parse::<u64>().ok())
    else {
        return Outcome::error("ERR invalid cursor");
    };
    let mut pattern = None;
    let mut count = SCAN_COUNT_DEFAULT;
    let mut only_type = None;
    let mut at = 2;
    while at < call.args.len() {
        let Some(argument) = call.args.get(at + 1) else { return Outcome::error(SYNTAX) };
        match call.word(at).as_str() {
            "match" => pattern = Some(argument.clone()),
            "count" => match parse_i64(argument) {
                Some(n) if n >= 1 => count = (n as usize).min(SCAN_COUNT_MAX),
                Some(_) => return Outcome::error(SYNTAX),
                None => return Outcome::error(NOT_INTEGER),
            },
            "type" => only_type = Some(lowercase(argument)),
            _ => return Outcome::error(SYNTAX),
        }
        at += 2;
    }
    let db = call.db().clone();
    Outcome::AfterPending(Box::pin(async move {
        let (items, next) = match scan_page(&db, cursor, count).await {
            Ok(page) => page,
            Err(reply) => return reply,
        };
        let keys = items
            .into_iter()
            .filter(|(key, ty)| {
                pattern.as_ref().is_none_or(|pattern| glob_match(pattern, key))
                    && only_type.as_ref().is_none_or(|wanted| wanted == ty.name())
            })
            .map(|(key, _)| Reply::Bulk(key))
            .collect();
        Reply::Array(vec![Reply::Bulk(next.to_string().into_bytes()), Reply::Array(keys)])
    }))
}

fn keys(call: &mut Call<'_>) -> Outcome {
    let pattern = call.args[1].clone();
    let db = call.db().clone();
    let reply_bytes_max =
        call.server.settings.client_output_bytes_max.load(std::sync::atomic::Ordering::Relaxed);
    Outcome::AfterPending(Box::pin(async move {
        let mut cursor = 0;
        let mut keys = Vec::new();
        // Counted page by page, so a reply past the output limit is refused having listed at
        // most the limit plus one page, not every key of the store.
        let mut reply_bytes = 0usize;
        loop {
            let (items, next) = match scan_page(&db, cursor, SCAN_COUNT_MAX).await {
                Ok(page) => page,
                Err(reply) => return reply,
            };
            for (key, _) in items {
                if glob_match(&pattern, &key) {
                    reply_bytes += key.len() + KEY_REPLY_OVERHEAD_BYTES;
                    keys.push(Reply::Bulk(key));
                }
            }
            if reply_bytes > reply_bytes_max {
                return Reply::Error(format!(
                    "ERR reply of at least {reply_bytes} bytes exceeds the client output limit ({reply_bytes_max} bytes)"
                ));
            }
            if next == 0 {
                return Reply::Array(keys);
            }
            cursor = next;
        }
    }))
}

/// What KEYS counts for one key in its reply besides the key's bytes: the bulk's header once
/// encoded, and the reply element and its allocation while the reply is built (~64 bytes).
const KEY_REPLY_OVERHEAD_BYTES: usize = 64;

/// Keys in the whole store (meta items, counted in each shard's index). As in Redis, a key
/// whose deadline passed counts until it is deleted (active expiry does so within a round).
pub async fn key_count(db: &Db) -> Result<i64, Reply> {
    item_count(db, keyspace::meta_scan_start(0), keyspace::meta_scan_end()).await
}

/// Keys with an expiry (expiry items): INFO's `expires`.
pub async fn expiring_key_count(db: &Db) -> Result<i64, Reply> {
    let tag = keyspace::TAG_EXPIRY;
    item_count(db, vec![tag], vec![tag + 1]).await
}

/// Items in `[start, end)` over every shard's index.
async fn item_count(db: &Db, start: Vec<u8>, end: Vec<u8>) -> Result<i64, Reply> {
    let mut plan = Plan::new();
    for shard in 0..db.shard_count() {
        let (start, end) = (start.clone(), end.clone());
        plan.add(shard, vec![], move |view, input| match input {
            Input::Start => {
                let count = view.count(Bound::Included(&start), Bound::Excluded(&end), usize::MAX);
                Next::Reply(Reply::Integer(count as i64))
            }
            _ => unexpected(),
        });
    }
    match run_outcome(db, plan.finish(Box::new(sum_integers))).await {
        Reply::Integer(count) => Ok(count),
        other => Err(other),
    }
}

fn dbsize(call: &mut Call<'_>) -> Outcome {
    let db = call.db().clone();
    Outcome::AfterPending(Box::pin(async move {
        match key_count(&db).await {
            Ok(count) => Reply::Integer(count),
            Err(reply) => reply,
        }
    }))
}

/// FLUSHDB: deletes every key of the client's database (`flush`).
fn flushdb(call: &mut Call<'_>) -> Outcome {
    if let Err(reply) = check_flush_mode(call) {
        return Outcome::Reply(reply);
    }
    let db = call.db().clone();
    let server = call.server.clone();
    Outcome::AfterPending(Box::pin(async move {
        let namespace = Namespace::current();
        server.flush_epoch.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        let reply = flush(&db, &[namespace]).await;
        server.flush_epoch.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        reply
    }))
}

/// FLUSHALL: deletes every key of every database (`flush`).
fn flushall(call: &mut Call<'_>) -> Outcome {
    if let Err(reply) = check_flush_mode(call) {
        return Outcome::Reply(reply);
    }
    let db = call.db().clone();
    let server = call.server.clone();
    Outcome::AfterPending(Box::pin(async move {
        let namespaces: Vec<Namespace> = (0..DATABASES as u8)
            .map(|database| super::namespace::resolve(&server.databases, database))
            .collect();
        server.flush_epoch.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        let reply = flush(&db, &namespaces).await;
        server.flush_epoch.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        reply
    }))
}

fn check_flush_mode(call: &Call<'_>) -> Result<(), Reply> {
    match call.args.get(1).map(|arg| lowercase(arg)) {
        None => Ok(()),
        Some(mode) if (mode == "sync" || mode == "async") && call.args.len() == 2 => Ok(()),
        Some(_) => Err(Reply::error(SYNTAX)),
    }
}

/// Deletes every item of `namespaces` in every shard, `FLUSH_BATCH_KEYS` per write. Each shard's
/// part is a series of batches, so a concurrent writer on another connection may see a
/// part-flushed database (docs/server.md); the connection that sent the flush sees it whole.
async fn flush(db: &Db, namespaces: &[Namespace]) -> Reply {
    let mut plan = Plan::new();
    for namespace in namespaces {
        namespace.scope(|| {
            for shard in 0..db.shard_count() {
                plan.add(shard, vec![], flush_step);
            }
        });
    }
    run_outcome(
        db,
        plan.finish(Box::new(|replies| {
            replies
                .into_iter()
                .find(|reply| !matches!(reply, Reply::Simple(_)))
                .unwrap_or_else(Reply::ok)
        })),
    )
    .await
}

/// One shard's part of a flush: a batch of deletes per step until its namespace is empty.
fn flush_step(view: &View<'_>, input: Input) -> Next {
    if let Input::Read(_) = input {
        return unexpected();
    }
    // Meta items first, so that no key reappears without its expiry between batches; then
    // everything else up to the marker's tag (the store stays marked as a Redis key space),
    // but the name items of long keys: those go with their meta items' deletes (`names.rs`),
    // so a key a writer recreates during the flush never loses its name to a later batch.
    let metas = (keyspace::meta_scan_start(0), keyspace::meta_scan_end());
    let mut keys =
        view.keys(Bound::Included(&metas.0), Bound::Excluded(&metas.1), FLUSH_BATCH_KEYS);
    if keys.is_empty() {
        let names = [keyspace::TAG_NAME];
        keys = view.keys(Bound::Unbounded, Bound::Excluded(&names), FLUSH_BATCH_KEYS);
    }
    if keys.is_empty() {
        let after_names = [keyspace::TAG_NAME + 1];
        let end = [keyspace::MARKER_KEY[0]];
        keys = view.keys(Bound::Included(&after_names), Bound::Excluded(&end), FLUSH_BATCH_KEYS);
    }
    if keys.is_empty() {
        return Next::Reply(Reply::ok());
    }
    Next::Write(keys.into_iter().map(|key| BatchOp::Delete { key }).collect())
}

/// The namespaces that hold any item in some shard (`namespace.rs`): 0 always, the others as
/// their items say, from each shard's index (no I/O). Background work looks only at these.
pub async fn namespaces_in_use(db: &Db) -> Result<Vec<u8>, Reply> {
    let mut plan = Plan::new();
    Namespace::raw().scope(|| {
        for shard in 0..db.shard_count() {
            plan.add(shard, vec![], |view, input| match input {
                Input::Start => {
                    let mut used = 1i64;
                    for number in 1..DATABASES as u8 {
                        let (start, end) = ([number], [number + 1]);
                        if view.count(Bound::Included(&start), Bound::Excluded(&end), 1) > 0 {
                            used |= 1 << number;
                        }
                    }
                    Next::Reply(Reply::Integer(used))
                }
                _ => unexpected(),
            });
        }
    });
    let combine = Box::new(|replies: Vec<Reply>| {
        let mut used = 0;
        for reply in replies {
            match reply {
                Reply::Integer(mask) => used |= mask,
                other => return other,
            }
        }
        Reply::Integer(used)
    });
    match run_outcome(db, plan.finish(combine)).await {
        Reply::Integer(mask) => {
            Ok((0..DATABASES as u8).filter(|number| mask & (1 << number) != 0).collect())
        }
        other => Err(other),
    }
}

#[cfg(test)]
mod tests {
    use super::glob_match;

    #[test]
    fn globs_match_as_in_redis() {
        let cases: &[(&str, &str, bool)] = &[
            ("*", "anything", true),
            ("*", "", true),
            ("h?llo", "hello", true),
            ("h?llo", "hllo", false),
            ("h*llo", "heeeello", true),
            ("h[ae]llo", "hallo", true),
            ("h[ae]llo", "hillo", false),
            ("h[^e]llo", "hallo", true),
            ("h[^e]llo", "hello", false),
            ("h[a-b]llo", "hbllo", true),
            ("h[a-b]llo", "hcllo", false),
            ("h\\*llo", "h*llo", true),
            ("h\\*llo", "hello", false),
            ("user:*:name", "user:42:name", true),
            ("user:*:name", "user:42:mail", false),
            ("*a*b", "xaxxb", true),
            ("*a*b", "xaxxbc", false),
        ];
        for (pattern, text, expected) in cases {
            assert_eq!(
                glob_match(pattern.as_bytes(), text.as_bytes()),
                *expected,
                "{pattern} {text}"
            );
        }
    }
}
