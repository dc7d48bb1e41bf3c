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
//! - Restartable: a crash leaves the marker at version 1, every collection either done (its meta
//!   value decodes) or with its elements split between the old keys and the new id, which the
//!   next open goes on moving. No element is in both (one batch writes one and deletes the other),
//!   and the two key ranges cannot meet: format 1's carry the key's length, the new ones the id's.
//! - The new count is counted from the new id's items once no old item is left.

use std::ops::Bound;

use copse::exec::ReadOp;
use copse::limits::KEY_BYTES_MAX;
use copse::{BatchOp, Db};

use super::{bound_ref, run_outcome, unexpected, value_of, Input, KeyTarget, Next, Plan};
use crate::keyspace::{
    self, collection_id, decode_field, decode_meta, decode_score, encode_score, field_key,
    member_key, score_key, CollectionMeta, KeyType, UPGRADED_VERSION,
};
use crate::resp::Reply;

/// Elements one upgrade exec moves at most.
pub const UPGRADE_ELEMENTS_PER_BATCH: usize = 256;
/// Meta items listed per step of the walk over a shard's keys.
const UPGRADE_KEYS_PER_STEP: usize = 1_000;

/// Moves every collection of the store to the current format. Returns the collections moved.
pub async fn upgrade_collections(db: &Db) -> Result<u64, String> {
    let mut moved = 0;
    for shard in 0..db.shard_count() {
        let mut after: Option<Vec<u8>> = None;
        loop {
            let metas = list_metas(db, shard, after.clone()).await?;
            let Some(last) = metas.last().cloned() else { break };
            for meta in metas {
                if let Some((_, key, ty)) = decode_meta(&meta) {
                    if ty != KeyType::String {
                        upgrade_key(db, key, ty).await?;
                        moved += 1;
                    }
                }
            }
            after = Some(last);
        }
    }
    Ok(moved)
}

/// Up to `UPGRADE_KEYS_PER_STEP` meta items of `shard` after `after`.
async fn list_metas(db: &Db, shard: u32, after: Option<Vec<u8>>) -> Result<Vec<Vec<u8>>, String> {
    let mut plan = Plan::new();
    plan.add(shard, vec![], move |view, input| match input {
        Input::Start => {
            let first = keyspace::meta_scan_start(0);
            let start = match &after {
                Some(after) => Bound::Excluded(&after[..]),
                None => Bound::Included(&first[..]),
            };
            let end = keyspace::meta_scan_end();
            let items = view.keys(start, Bound::Excluded(&end), UPGRADE_KEYS_PER_STEP);
            Next::Reply(Reply::Array(items.into_iter().map(Reply::Bulk).collect()))
        }
        _ => unexpected(),
    });
    match run_outcome(db, plan.finish(Box::new(Reply::Array))).await {
        Reply::Array(mut pages) => match pages.pop() {
            Some(Reply::Array(items)) => Ok(items
                .into_iter()
                .filter_map(|item| match item {
                    Reply::Bulk(item) => Some(item),
                    _ => None,
                })
                .collect()),
            other => Err(format!("listing meta items: {other:?}")),
        },
        other => Err(format!("listing meta items: {other:?}")),
    }
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
                    let (start, end) = keyspace::v1_elements_range(keyspace::TAG_FIELD, &key);
                    fields =
                        view.keys(bound_ref(&start), bound_ref(&end), UPGRADE_ELEMENTS_PER_BATCH);
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
                        UPGRADE_ELEMENTS_PER_BATCH,
                    );
                    if items.is_empty() {
                        return finish(view, &key, &id, ty, &mut done);
                    }
                    let mut ops = Vec::with_capacity(4 * items.len());
                    for item in items {
                        let Some((score, member)) = decode_score(&item, key.len()) else {
                            return unexpected();
                        };
                        if score_key(&id, score, member).len() > KEY_BYTES_MAX {
                            return Next::Reply(too_long(&key));
                        }
                        ops.push(BatchOp::Delete { key: member_key(&key, member) });
                        ops.push(BatchOp::Put { key: member_key(&id, member), value: encode_score(score) });
                        ops.push(BatchOp::Put { key: score_key(&id, score, member), value: Vec::new() });
                        ops.push(BatchOp::Delete { key: item });
                    }
                    Next::Write(ops)
                }
            }
        }
        Input::Read(results) => {
            // The values of format 1 fields: write as many as one batch holds.
            let mut ops = Vec::with_capacity(2 * fields.len());
            let mut bytes = 0;
            for (item, result) in std::mem::take(&mut fields).into_iter().zip(results) {
                let Some(value) = value_of(Some(result)) else { return unexpected() };
                let Some((_, field)) = decode_field(&item, key.len()) else { return unexpected() };
                let new = field_key(&id, field);
                if new.len() > KEY_BYTES_MAX {
                    return Next::Reply(too_long(&key));
                }
                let size = 2 * (new.len() + item.len()) + value.len() + 64;
                if !ops.is_empty() && bytes + size > copse::limits::WRITE_BATCH_BYTES_MAX {
                    break;
                }
                bytes += size;
                ops.push(BatchOp::Put { key: new, value });
                ops.push(BatchOp::Delete { key: item });
            }
            Next::Write(ops)
        }
        Input::Written => Next::Reply(Reply::Integer(done)),
    })
}

/// A format 1 element whose key and name are too long for format 2's element keys (which carry
/// the version: 8 bytes more).
fn too_long(key: &[u8]) -> Reply {
    Reply::Error(format!(
        "ERR collection {:?} has a field or member too long for key space format 2 (key and name \
         together at most {} bytes for a hash); shorten it with a build of format 1 first",
        String::from_utf8_lossy(key),
        KEY_BYTES_MAX - keyspace::FIELD_OVERHEAD_BYTES
    ))
}

/// No format 1 element is left: the meta item gets its value, counted from the new id.
fn finish(view: &copse::exec::ExecView<'_>, key: &[u8], id: &[u8], ty: KeyType, done: &mut i64) -> Next {
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
    let meta = CollectionMeta { version: UPGRADED_VERSION, count, deadline_ms: None };
    Next::Write(vec![BatchOp::Put { key: keyspace::meta_key(key, ty), value: meta.encode() }])
}
