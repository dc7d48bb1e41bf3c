//! The orphan collector: deletes the elements of collections that DEL, an overwrite or a type
//! change made dead (docs/format/redis-keyspace.md, "Orphans").
//!
//! Deleting a hash or a sorted set writes two small items, whatever it holds: the meta item is
//! deleted (so nothing reads its version any more) and the key's orphan record is written. This
//! task finds orphan records in every shard and, for each, deletes the key's element items of
//! every version but the live one, `ORPHAN_DELETES_PER_BATCH` per exec, then the record itself
//! in the batch that deletes the last of them.
//!
//! Invariants:
//! - Never touches a live version: each exec holds the key's lock, reads the live meta item (if
//!   any) under it, and deletes only items outside the live id's ranges.
//! - Resumes after a crash: an orphan record is durable before DEL answers and is deleted only in
//!   the batch that deletes the key's last dead element, so a restart finds what is left.
//! - Bounded work: one exec deletes at most `ORPHAN_DELETES_PER_BATCH` items and releases the
//!   key's lock between batches, so clients of the key wait at most one batch.

use std::ops::Bound;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::View;
use copse::exec::ReadOp;
use copse::{BatchOp, Db};

use super::keys::namespaces_in_use;
use super::namespace::{Namespace, DATABASES};
use super::{bound_ref, run_outcome, shard_keys, value_of, Input, KeyTarget, Next};
use crate::context::Server;
use crate::keyspace::{self, CollectionMeta, KeyType, TAG_ORPHANS};
use crate::resp::Reply;

/// Element items one collector exec deletes at most (one write batch).
pub const ORPHAN_DELETES_PER_BATCH: usize = 1_000;
/// Orphan records a pass lists per shard before it works through them.
pub const ORPHAN_RECORDS_PER_PASS: usize = 100;
/// How long the collector waits before looking again when it found nothing to do.
pub const ORPHAN_IDLE_POLL_MS: u64 = 100;

/// Runs the collector until the runtime that polls it stops.
pub async fn run(server: Arc<Server>) {
    // Per namespace and shard, the last orphan record listed: the next pass goes on after it, so
    // records the collector cannot finish (an exec that fails) never hide the ones behind them.
    let shards = server.db.shard_count() as usize;
    let mut cursors: Vec<Vec<Option<Vec<u8>>>> = vec![vec![None; shards]; DATABASES];
    loop {
        let namespaces = match namespaces_in_use(&server.db).await {
            Ok(namespaces) => namespaces,
            Err(error) => {
                tracing::warn!(?error, "the orphan collector could not list the namespaces");
                vec![0]
            }
        };
        let mut seen = 0;
        for number in namespaces {
            let pass = pass(&server, &mut cursors[number as usize]);
            seen += Namespace::detached(number).bind(pass).await;
        }
        server.stats.orphan_records_seen.store(seen as u64, Ordering::Relaxed);
        if seen == 0 {
            tokio::time::sleep(Duration::from_millis(ORPHAN_IDLE_POLL_MS)).await;
        }
    }
}

/// One pass over the current namespace's orphan records: returns how many it listed.
async fn pass(server: &Server, cursors: &mut [Option<Vec<u8>>]) -> usize {
    let keys = match orphan_keys(&server.db, cursors).await {
        Ok(keys) => keys,
        Err(error) => {
            tracing::warn!(?error, "the orphan collector could not list orphan records");
            Vec::new()
        }
    };
    for key in &keys {
        collect_key(server, key).await;
    }
    keys.len()
}

/// Deletes the dead elements of `key`, one bounded exec at a time, until its orphan record is
/// gone (or an exec fails: the record stays, and a later pass tries again).
async fn collect_key(server: &Server, key: &[u8]) {
    loop {
        match run_outcome(&server.db, collect_once(&server.db, key.to_vec())).await {
            Reply::Array(answer) => {
                let (deleted, done) = match answer[..] {
                    [Reply::Integer(deleted), Reply::Integer(done)] => (deleted, done),
                    _ => return,
                };
                server.stats.orphan_elements_deleted.fetch_add(deleted as u64, Ordering::Relaxed);
                if done == 1 {
                    server.stats.orphan_keys_collected.fetch_add(1, Ordering::Relaxed);
                    return;
                }
            }
            other => {
                tracing::warn!(?other, "the orphan collector's exec failed; it will try again");
                tokio::time::sleep(Duration::from_millis(ORPHAN_IDLE_POLL_MS)).await;
                return;
            }
        }
    }
}

/// The Redis keys named by orphan records, up to `ORPHAN_RECORDS_PER_PASS` per shard after the
/// shard's cursor; a shard whose records ran out starts from its first one next time.
async fn orphan_keys(db: &Db, cursors: &mut [Option<Vec<u8>>]) -> Result<Vec<Vec<u8>>, Reply> {
    // Every orphan record: its tag, and nothing else starts with it.
    let range: (&[u8], &[u8]) = (&[TAG_ORPHANS], &[TAG_ORPHANS + 1]);
    let mut keys = Vec::new();
    for (shard, cursor) in cursors.iter_mut().enumerate() {
        let items =
            shard_keys(db, shard as u32, range, cursor.take(), ORPHAN_RECORDS_PER_PASS).await?;
        if items.len() == ORPHAN_RECORDS_PER_PASS {
            *cursor = items.last().cloned();
        }
        let named = items.iter().filter_map(|item| keyspace::decode_orphans(item));
        keys.extend(named.map(<[u8]>::to_vec));
    }
    Ok(keys)
}

/// The element ranges of `key` that hold dead items: every version of each element tag, minus
/// the live collection's own id range (`live`: its type, id and meta); for a live list, the
/// indexes of its id outside `head .. head + count` too (what LPOP, RPOP and LTRIM left).
fn dead_ranges(
    key: &[u8],
    live: Option<(KeyType, &[u8], CollectionMeta)>,
) -> Vec<keyspace::KeyRange> {
    let mut ranges = Vec::with_capacity(5);
    for ty in KeyType::COLLECTIONS {
        let Some(tag) = ty.element_tag() else { continue };
        let (start, end) = keyspace::all_versions_range(tag, key);
        match live {
            Some((live_ty, id, meta)) if live_ty == ty => {
                // The live id's items are one range inside the key's: skip over it.
                let (live_start, live_end) = keyspace::id_range(tag, id);
                let before = match live_start {
                    Bound::Included(live_start) => Bound::Excluded(live_start),
                    other => other,
                };
                let after = match live_end {
                    Bound::Excluded(after) => Bound::Included(after),
                    other => other,
                };
                ranges.push((start, before));
                ranges.push((after, end));
                if let (KeyType::List, Some(head)) = (ty, meta.head) {
                    let tail = head.saturating_add(meta.count);
                    ranges.push(keyspace::list_range(id, 0, head));
                    ranges.push((
                        Bound::Included(keyspace::list_key(id, tail)),
                        keyspace::id_range(tag, id).1,
                    ));
                }
            }
            _ => ranges.push((start, end)),
        }
    }
    ranges
}

/// Up to `limit` dead element items of `key`.
fn dead_items(
    view: &View<'_>,
    key: &[u8],
    live: Option<(KeyType, &[u8], CollectionMeta)>,
    limit: usize,
) -> Vec<Vec<u8>> {
    let mut items = Vec::new();
    for (start, end) in dead_ranges(key, live) {
        if items.len() >= limit {
            break;
        }
        items.extend(view.keys(bound_ref(&start), bound_ref(&end), limit - items.len()));
    }
    items
}

/// One exec of the collector on `key`: answers `[deleted, done]`.
fn collect_once(db: &Db, key: Vec<u8>) -> super::Outcome {
    let target = KeyTarget::of(db, &key);
    let mut live_ty = None;
    let mut answer = None;
    super::on_key_background(target, move |view, input| {
        let live: Option<CollectionMeta> = match input {
            Input::Start => {
                live_ty = super::stored_collection_type(view, &key);
                if let Some(ty) = live_ty {
                    let meta = keyspace::meta_key(&key, ty);
                    return Next::Read(smallvec::smallvec![ReadOp::Get(meta)]);
                }
                None
            }
            Input::Read(mut results) => {
                match value_of(results.pop()).as_deref().and_then(CollectionMeta::decode) {
                    Some(meta) => Some(meta),
                    None => return Next::Reply(Reply::error(super::CORRUPT_META)),
                }
            }
            Input::Written => return super::answer(&mut answer),
        };
        let id = live.map(|meta| keyspace::collection_id(&key, meta.version));
        let live = match (live_ty, id.as_deref(), live) {
            (Some(ty), Some(id), Some(meta)) => Some((ty, id, meta)),
            _ => None,
        };
        let items = dead_items(view, &key, live, ORPHAN_DELETES_PER_BATCH);
        let done = items.len() < ORPHAN_DELETES_PER_BATCH;
        let deleted = items.len() as i64;
        let mut ops: Vec<BatchOp> = items.into_iter().map(|key| BatchOp::Delete { key }).collect();
        if done {
            ops.push(BatchOp::Delete { key: keyspace::orphans_key(&key) });
        }
        answer = Some(Reply::Array(vec![Reply::Integer(deleted), Reply::Integer(done as i64)]));
        Next::Write(ops)
    })
}
