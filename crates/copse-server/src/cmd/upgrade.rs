//! Upgrades a store from key space format 1 to the current one at open, before the server
//! serves anyone (docs/format/redis-keyspace.md, "Upgrading from version 1").
//!
//! Format 1 keyed a collection's elements by its Redis key alone and left its meta item's value
//! empty. Each collection is moved to version `UPGRADED_VERSION`: its elements are re-keyed under
//! that id in bounded batches (each batch writes the new items and deletes the old ones), and its
//! meta item gets its value (version, count) in the batch after the last element moved. Strings
//! are the same in both formats. The marker is rewritten last.
//!
//! Invariants:
//! - Nothing is written unless every element fits format 2's keys (8 bytes longer): a first pass
//!   over the element items of every shard refuses the store before the first write.
//! - No two keys' elements meet. Format 2's items of key `A` at version 0 have the bytes of format
//!   1's items of key `A ++ 00×8`, so a shard's collections are moved longest key first: when `A`
//!   moves, every longer key has moved, and keys of `A`'s length or shorter have format 1 ranges
//!   whose length field differs from `A`'s id's.
//! - Restartable: a crash leaves the marker at version 1, every collection either done (its meta
//!   value decodes) or with its elements split between the old keys and the new id, which the
//!   next open goes on moving (in the same order). No element is in both: one batch writes one
//!   and deletes the other.
//! - The new count is counted from the new id's items once no old item is left.

use std::collections::VecDeque;
use std::ops::Bound;

use copse::exec::ReadOp;
use copse::limits::KEY_BYTES_MAX;
use copse::{BatchOp, Db};

use super::{bound_ref, run_outcome, unexpected, value_of, Input, KeyTarget, Next};
use crate::keyspace::{
    self, collection_id, decode_field, decode_meta, decode_score, encode_score, field_key,
    member_key, score_key, CollectionMeta, KeyType, UPGRADED_VERSION,
};
use crate::resp::Reply;

/// Sorted set elements one upgrade exec moves at most (re-keyed, no read).
pub const UPGRADE_MEMBERS_PER_BATCH: usize = 256;
/// Hash fields one upgrade exec reads and moves at most: their values are held in memory (up to
/// 16 MiB each) and written in as many batches as they need.
pub const UPGRADE_FIELDS_PER_STEP: usize = 32;
/// Items listed per step of the walks over a shard's keys.
const UPGRADE_KEYS_PER_STEP: usize = 10_000;

/// Moves every collection of the store to the current format. Returns the collections moved.
pub async fn upgrade_collections(db: &Db) -> Result<u64, String> {
    // Refuse before any write a store with an element format 2 cannot key.
    for shard in 0..db.shard_count() {
        for tag in [keyspace::TAG_FIELD, keyspace::TAG_ZSET] {
            let (start, end) = (vec![tag], vec![tag + 1]);
            let mut after = None;
            while let Some(items) = list_items(db, shard, (&start, &end), after.take()).await? {
                if let Some(long) =
                    items.iter().find(|item| item.len() + keyspace::VERSION_BYTES > KEY_BYTES_MAX)
                {
                    return Err(too_long(long));
                }
                after = items.last().cloned();
            }
        }
    }
    let mut moved = 0;
    for shard in 0..db.shard_count() {
        let mut collections = Vec::new();
        let (start, end) = (keyspace::meta_scan_start(0), keyspace::meta_scan_end());
        let mut after = None;
        while let Some(metas) = list_items(db, shard, (&start, &end), after.take()).await? {
            for meta in &metas {
                if let Some((_, key, ty)) = decode_meta(meta) {
                    if ty != KeyType::String {
                        collections.push((key.to_vec(), ty));
                    }
                }
            }
            after = metas.last().cloned();
        }
        // Longest key first (module invariant 2); ties in key order, so a restart repeats it.
        collections.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then_with(|| a.0.cmp(&b.0)));
        for (key, ty) in collections {
            upgrade_key(db, &key, ty).await?;
            moved += 1;
        }
    }
    Ok(moved)
}

/// One step of a walk over `shard`'s keys in `[start, end)` (`shard_keys`), or None at its end.
async fn list_items(
    db: &Db,
    shard: u32,
    range: (&[u8], &[u8]),
    after: Option<Vec<u8>>,
) -> Result<Option<Vec<Vec<u8>>>, String> {
    let items = super::shard_keys(db, shard, range, after, UPGRADE_KEYS_PER_STEP)
        .await
        .map_err(|reply| format!("listing items: {reply:?}"))?;
    Ok((!items.is_empty()).then_some(items))
}

/// Moves one collection, a batch per exec, until its meta item holds a current value.
async fn upgrade_key(db: &Db, key: &[u8], ty: KeyType) -> Result<(), String> {
    loop {
        match run_outcome(db, upgrade_step(db, key.to_vec(), ty)).await {
            Reply::Integer(1) => return Ok(()),
            Reply::Integer(_) => {}
            other => {
                return Err(format!(
                    "upgrading collection {:?}: {other:?}",
                    String::from_utf8_lossy(key)
                ))
            }
        }
    }
}

/// One exec: moves up to `UPGRADE_ELEMENTS_PER_BATCH` elements of `key`, or, with none left,
/// writes its meta value. Answers 1 once the collection is done, 0 while elements remain.
fn upgrade_step(db: &Db, key: Vec<u8>, ty: KeyType) -> super::Outcome {
    let target = KeyTarget::of(db, &key);
    let id = collection_id(&key, UPGRADED_VERSION);
    let mut fields: Vec<Vec<u8>> = Vec::new();
    let mut batches: VecDeque<Vec<BatchOp>> = VecDeque::new();
    let mut done = 0;
    super::on_key(target, move |view, input| match input {
        Input::Start => Next::Read(smallvec::smallvec![ReadOp::Get(keyspace::meta_key(&key, ty))]),
        Input::Read(mut results) if fields.is_empty() => {
            let Some(value) = value_of(results.pop()) else {
                // The key is gone: nothing to move.
                return Next::Reply(Reply::Integer(1));
            };
            if CollectionMeta::decode(&value).is_some() {
                return Next::Reply(Reply::Integer(1));
            }
            if !value.is_empty() {
                return Next::Reply(Reply::error(super::CORRUPT_META));
            }
            match ty {
                KeyType::Hash => {
                    // Format 1 keyed the fields by the Redis key where format 2 has the id.
                    let (start, end) = keyspace::fields_range(&key);
                    fields = view.keys(bound_ref(&start), bound_ref(&end), UPGRADE_FIELDS_PER_STEP);
                    if fields.is_empty() {
                        return finish(view, &key, &id, ty, &mut done);
                    }
                    Next::Read(fields.iter().map(|item| ReadOp::Get(item.clone())).collect())
                }
                _ => {
                    let prefix = keyspace::scores_prefix(&key);
                    let end = keyspace::prefix_end(&prefix);
                    let items = view.keys(
                        Bound::Included(&prefix[..]),
                        bound_ref(&end),
                        UPGRADE_MEMBERS_PER_BATCH,
                    );
                    if items.is_empty() {
                        return finish(view, &key, &id, ty, &mut done);
                    }
                    let mut ops = Vec::with_capacity(4 * items.len());
                    for item in items {
                        let Some((score, member)) = decode_score(&item, key.len()) else {
                            return unexpected();
                        };
                        ops.push(BatchOp::Delete { key: member_key(&key, member) });
                        ops.push(BatchOp::Put {
                            key: member_key(&id, member),
                            value: encode_score(score),
                        });
                        ops.push(BatchOp::Put {
                            key: score_key(&id, score, member),
                            value: Vec::new(),
                        });
                        ops.push(BatchOp::Delete { key: item });
                    }
                    Next::Write(ops)
                }
            }
        }
        Input::Read(results) => {
            // The values of format 1 fields, moved in as many batches as they need (each field
            // moves whole: its new item and the old one's delete share a batch), each the size of
            // one batch record, as before batches could be chains.
            let mut ops = Vec::new();
            let mut bytes = 0;
            for (item, result) in std::mem::take(&mut fields).into_iter().zip(results) {
                let Some(value) = value_of(Some(result)) else { return unexpected() };
                let Some((_, field)) = decode_field(&item, key.len()) else { return unexpected() };
                let new = field_key(&id, field);
                let size = 2 * (new.len() + item.len()) + value.len() + 64;
                if !ops.is_empty() && bytes + size > copse::limits::BATCH_RECORD_BYTES_MAX {
                    batches.push_back(std::mem::take(&mut ops));
                    bytes = 0;
                }
                bytes += size;
                ops.push(BatchOp::Put { key: new, value });
                ops.push(BatchOp::Delete { key: item });
            }
            batches.push_back(ops);
            Next::Write(batches.pop_front().unwrap_or_default())
        }
        Input::Written => match batches.pop_front() {
            Some(batch) => Next::Write(batch),
            None => Next::Reply(Reply::Integer(done)),
        },
    })
}

/// Refusal of a store holding a format 1 element item (`item`) too long for format 2's keys,
/// which carry the version (8 bytes more). Found before anything is written.
fn too_long(item: &[u8]) -> String {
    format!(
        "an element item of {} bytes ({:?}) is too long for key space format 2 (a hash's key and \
         field together at most {} bytes, a sorted set's key and member {}); nothing was changed: \
         shorten it with a build of format 1 first",
        item.len(),
        String::from_utf8_lossy(&item[..item.len().min(64)]),
        KEY_BYTES_MAX - keyspace::FIELD_OVERHEAD_BYTES,
        KEY_BYTES_MAX - keyspace::MEMBER_OVERHEAD_BYTES
    )
}

/// No format 1 element is left: the meta item gets its value, counted from the new id.
fn finish(view: &super::View<'_>, key: &[u8], id: &[u8], ty: KeyType, done: &mut i64) -> Next {
    let (start, end) = match ty {
        KeyType::Hash => keyspace::fields_range(id),
        _ => keyspace::members_range(id),
    };
    let count = view.count(bound_ref(&start), bound_ref(&end), usize::MAX) as u64;
    *done = 1;
    if count == 0 {
        // Format 1 never left a collection without elements; if one is found, it is deleted.
        return Next::Write(vec![BatchOp::Delete { key: keyspace::meta_key(key, ty) }]);
    }
    let meta = CollectionMeta { version: UPGRADED_VERSION, count, deadline_ms: None, head: None };
    Next::Write(vec![BatchOp::Put { key: keyspace::meta_key(key, ty), value: meta.encode() }])
}
