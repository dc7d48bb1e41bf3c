//! Range scans across shards (p2KVS's RANGE), reading from each shard only what the merge needs.
//!
//! A shard's index is in memory and its items are on disk, so a scan asks in two steps: first
//! every shard, in parallel, for the keys of its first `limit` items of the range (index only, no
//! I/O); the keys are merged and cut at `limit`; then each shard with chosen keys reads its range
//! from the start up to its last chosen key, which holds exactly its chosen items unless keys
//! came or went between the steps. Asking every shard for `limit` whole items instead reads up
//! to `shards x limit` items to return `limit` (twice the reads on two shards). Reading a range,
//! not a list of keys, tells the engine the items are neighbours, which the native engine uses
//! to cluster them on disk (docs/placement.md, "What it means for scans: clustering").
//!
//! Invariants:
//! - The result is in key order, has no key twice (each key lives in one shard), and holds at
//!   most `limit` items, each with a verified value read after its key was chosen.
//! - A chosen key deleted between the two steps is skipped, and the scan continues after the last
//!   chosen key for what is missing, so a concurrent delete never shortens a scan that has more
//!   items to give. A key written between the steps into a shard's range is read with it. Like
//!   every scan here, it is not a snapshot: shards answer at their own time.
//! - A shard reads at most the `wanted` items the merge can use. If it has that many up to its
//!   last chosen key, its items alone fill the result's first `wanted` places of its keys and
//!   below, so the merged prefix misses nothing.
//! - Both steps are exec programs with no lock keys, so they run as soon as they reach a shard
//!   and never wait for (or delay) an exec holding locks.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::ops::Bound;

use futures::channel::oneshot;

use super::Router;
use crate::engine::KeyValue;
use crate::error::ReadError;
use crate::shard::exec::{Exec, ExecRequest, ExecStep, ExecView, ReadOp, ReadResult, StepInput};

/// Merges runs sorted by `key` (keys unique across runs) into one sorted list of at most
/// `limit` items, each with the index of the run it came from.
pub fn merge_runs<T>(
    runs: Vec<Vec<T>>,
    limit: usize,
    key: impl Fn(&T) -> &[u8],
) -> Vec<(usize, T)> {
    let mut iterators: Vec<_> = runs.into_iter().map(|run| run.into_iter()).collect();
    let mut heads: Vec<Option<T>> = iterators.iter_mut().map(|run| run.next()).collect();
    let mut heap = BinaryHeap::new();
    for (index, head) in heads.iter().enumerate() {
        if let Some(item) = head {
            heap.push(Reverse((key(item).to_vec(), index)));
        }
    }
    let mut out = Vec::with_capacity(limit.min(1024));
    while out.len() < limit {
        let Some(Reverse((_, index))) = heap.pop() else { break };
        let item = heads[index].take().expect("a run in the heap has a head");
        out.push((index, item));
        if let Some(next) = iterators[index].next() {
            heap.push(Reverse((key(&next).to_vec(), index)));
            heads[index] = Some(next);
        }
    }
    out
}

/// Up to `limit` items with keys in `start..end`, in key order. `limit` is already checked.
pub async fn scan(
    router: &Router,
    start: Bound<Vec<u8>>,
    end: Bound<Vec<u8>>,
    limit: usize,
) -> Result<Vec<KeyValue>, ReadError> {
    let shards = router.shard_count() as usize;
    let mut out: Vec<KeyValue> = Vec::new();
    let mut from = start;
    while out.len() < limit {
        let wanted = limit - out.len();
        let mut key_runs = Vec::with_capacity(shards);
        for receiver in send_to_shards(router, shards, |_| {
            let (reply, receiver) = oneshot::channel();
            let exec = IndexKeys {
                start: from.clone(),
                end: end.clone(),
                limit: wanted,
                reply: Some(reply),
            };
            Some((Box::new(exec) as Box<dyn Exec>, receiver))
        })
        .await?
        {
            key_runs.push(receiver.await.map_err(|_| ReadError::Closed)?);
        }
        let chosen = merge_runs(key_runs, wanted, |key| key.as_slice());
        let Some((_, last_chosen)) = chosen.last() else { break };
        let last_chosen = last_chosen.clone();
        let chosen_count = chosen.len();
        // Each shard's last chosen key: step two reads the shard's range up to it.
        let mut last_per_shard: Vec<Option<Vec<u8>>> = vec![None; shards];
        for (shard, key) in chosen {
            last_per_shard[shard] = Some(key);
        }
        let mut item_runs = Vec::with_capacity(shards);
        for receiver in send_to_shards(router, shards, |shard| {
            let last = last_per_shard[shard].take()?;
            let (reply, receiver) = oneshot::channel();
            let exec = ReadRange {
                start: from.clone(),
                end: Bound::Included(last),
                limit: wanted,
                reply: Some(reply),
            };
            Some((Box::new(exec) as Box<dyn Exec>, receiver))
        })
        .await?
        {
            item_runs.push(receiver.await.map_err(|_| ReadError::Closed)??);
        }
        let found = merge_runs(item_runs, wanted, |(key, _)| key.as_slice());
        out.extend(found.into_iter().map(|(_, item)| item));
        if chosen_count < wanted {
            break; // the range had no more keys when step one looked
        }
        // Some chosen keys vanished before they were read: continue past the last chosen key.
        from = Bound::Excluded(last_chosen);
    }
    Ok(out)
}

/// Sends one exec to every shard that `build(shard)` gives one for; returns the receivers in
/// shard order.
async fn send_to_shards<T>(
    router: &Router,
    shards: usize,
    mut build: impl FnMut(usize) -> Option<(Box<dyn Exec>, oneshot::Receiver<T>)>,
) -> Result<Vec<oneshot::Receiver<T>>, ReadError> {
    let mut receivers = Vec::with_capacity(shards);
    for shard in 0..shards {
        let Some((exec, receiver)) = build(shard) else { continue };
        let request = ExecRequest { locks: Default::default(), exec };
        if !router.send_exec_async(shard as u32, request).await {
            return Err(ReadError::Closed);
        }
        receivers.push(receiver);
    }
    Ok(receivers)
}

/// Step one: a shard's first `limit` keys of the range, from its index.
struct IndexKeys {
    start: Bound<Vec<u8>>,
    end: Bound<Vec<u8>>,
    limit: usize,
    reply: Option<oneshot::Sender<Vec<Vec<u8>>>>,
}

impl Exec for IndexKeys {
    fn step(&mut self, view: &ExecView<'_>, _input: StepInput) -> ExecStep {
        let start = self.start.as_ref().map(Vec::as_slice);
        let end = self.end.as_ref().map(Vec::as_slice);
        let keys = view.keys(start, end, self.limit);
        if let Some(reply) = self.reply.take() {
            let _ = reply.send(keys); // a caller that went away no longer wants them
        }
        ExecStep::Done
    }
}

/// Step two: one shard's items from the scan's start up to its last chosen key (`end`), read
/// by the engine as one range (so that it sees them as neighbours: docs/placement.md, "What it
/// means for scans: clustering"). Keys written between the steps may join; at most `limit`
/// items, the most the merge can use.
struct ReadRange {
    start: Bound<Vec<u8>>,
    end: Bound<Vec<u8>>,
    limit: usize,
    reply: Option<oneshot::Sender<Result<Vec<KeyValue>, ReadError>>>,
}

impl ReadRange {
    fn answer(&mut self, result: Result<Vec<KeyValue>, ReadError>) -> ExecStep {
        if let Some(reply) = self.reply.take() {
            let _ = reply.send(result);
        }
        ExecStep::Done
    }
}

impl Exec for ReadRange {
    fn step(&mut self, _view: &ExecView<'_>, input: StepInput) -> ExecStep {
        match input {
            StepInput::Start => ExecStep::Read(smallvec::smallvec![ReadOp::Scan {
                start: self.start.clone(),
                end: self.end.clone(),
                limit: self.limit,
            }]),
            StepInput::Read(Ok(mut results)) => match results.pop() {
                Some(ReadResult::Items(items)) if results.is_empty() => self.answer(Ok(items)),
                other => unreachable!("a scan step answers with one run of items, not {other:?}"),
            },
            StepInput::Read(Err(err)) => self.answer(Err(err)),
            StepInput::Written(_) => self.answer(Err(ReadError::Closed)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_merge_in_key_order_with_their_origin() {
        let run = |keys: &[&str]| keys.iter().map(|k| k.as_bytes().to_vec()).collect::<Vec<_>>();
        let merged =
            merge_runs(vec![run(&["a", "d", "e"]), run(&["b", "c", "f"]), run(&[])], 5, |k| k);
        let keys: Vec<(usize, &str)> =
            merged.iter().map(|(run, key)| (*run, std::str::from_utf8(key).unwrap())).collect();
        assert_eq!(keys, [(0, "a"), (1, "b"), (1, "c"), (0, "d"), (0, "e")]);
        assert!(merge_runs(Vec::<Vec<Vec<u8>>>::new(), 3, |k| k).is_empty());
    }
}
