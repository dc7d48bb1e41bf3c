//! The gate in front of a shard's engine: it keeps the keys of live parts of cross-shard batches
//! (docs/atomic-batches.md) from being written or read around the batch.
//!
//! From `PreparePart` until the part is applied (or, on abort, erased), its keys are *locked*:
//! - writes touching a locked key (plain requests and exec writes alike) are parked, in arrival
//!   order, and handed to the engine when the key is unlocked; a control request (flush, stats)
//!   waits behind parked requests;
//! - reads are answered as of the batch's decision: once it is committed, a locked key reads as
//!   the part's operation says (its value, or absent), even before the engine applied it; before
//!   that (or if aborted) it reads as the engine has it, which is the value before the batch,
//!   since nothing else may write the key. Gets, multi-gets and scans that may touch a locked key
//!   are sent to the engine with the gate's own reply channel, and answered when the gate polls
//!   them (after the round's completions, before any unlock), with the decision as of that
//!   moment. A multi-get or scan may be answered after its part was applied and unlocked, from
//!   what the engine read before: it is overlaid from the holds recorded when it was handed over
//!   (`HoldsAt`), not from the lock table then; a get needs no record, since the engine looks
//!   its key up again when its read completes;
//! - index questions (exec programs, the router's scan) get the same overlay.
//!
//! Invariants:
//! 1. A locked key's engine state is the state before the batch until `CommitPart` completes:
//!    no write of it reaches the engine while it is locked.
//! 2. A read polled while a key is locked and its batch committed answers the batch's value;
//!    the decision flips once for all shards, so every read after any read saw the batch sees it.
//! 3. Parked requests reach the engine in arrival order; none is answered by the gate except
//!    with an error when its key's committed part failed to apply (`fail`): the store is
//!    poisoned then, and the key stays locked, reading as the batch wrote it.

use std::collections::{BTreeMap, VecDeque};

use crate::hash::HashMap;
use std::ops::Bound;
use std::os::fd::BorrowedFd;
use std::sync::Arc;
use std::time::Instant;

use futures::channel::oneshot;

use super::coordinator::{Coordinator, Decision};
use crate::engine::part::PartRecord;
use crate::engine::{BatchOp, KeyValue, Reply, Request, RequestKind, ShardEngine};
use crate::error::{ReadError, WriteError};

/// A live part's hold on one key: its batch and what it writes there (None: a delete).
struct Hold {
    gsn: u64,
    value: Option<Vec<u8>>,
}

/// The parts holding a key when a read of several keys was handed to the engine, with what each
/// writes there: the batches that read's moment comes before. Its answer is overlaid with the
/// newest of them committed by then, even if that part was applied and unlocked meanwhile (the
/// engine read the key before it was applied; the lock table no longer says so).
type HoldsAt = Vec<(Arc<dyn Coordinator>, Option<Vec<u8>>)>;

/// A read the gate answers itself once the engine did.
enum Intercepted {
    Get {
        key: Vec<u8>,
        receiver: oneshot::Receiver<Result<Option<Vec<u8>>, ReadError>>,
        reply: Reply<Option<Vec<u8>>, ReadError>,
    },
    MultiGet {
        /// Each key's holds when the engine read it.
        holds: Vec<HoldsAt>,
        receiver: oneshot::Receiver<Result<Vec<Option<Vec<u8>>>, ReadError>>,
        reply: Reply<Vec<Option<Vec<u8>>>, ReadError>,
    },
    Scan {
        /// The locked keys of the range, each with its holds, when the engine looked it up.
        holds: Vec<(Vec<u8>, HoldsAt)>,
        limit: usize,
        receiver: oneshot::Receiver<Result<Vec<KeyValue>, ReadError>>,
        reply: Reply<Vec<KeyValue>, ReadError>,
    },
}

pub struct Gate {
    engine: Box<dyn ShardEngine>,
    /// Locked keys and the parts holding them (more than one only if callers mix exec lock
    /// spaces; the newest committed hold wins).
    locked: BTreeMap<Vec<u8>, Vec<Hold>>,
    /// Live parts' coordinators, for their decisions.
    parts: HashMap<u64, Arc<dyn Coordinator>>,
    /// Keys whose committed part failed to apply here (the store is poisoned). They stay locked
    /// and read as the batch wrote them, which is what a reopen will apply; writes of them are
    /// refused rather than parked forever.
    failed: BTreeMap<Vec<u8>, ()>,
    parked: VecDeque<Request>,
    intercepted: Vec<Intercepted>,
}

impl Gate {
    /// Hands `requests` to the engine in runs of the same kind, in arrival order (p2KVS: an
    /// engine can turn a run of puts into one write and a run of gets into one multi-read).
    pub fn handle_in_runs(&mut self, requests: impl IntoIterator<Item = Request>) {
        let mut requests = requests.into_iter().peekable();
        while let Some(first) = requests.next() {
            let kind = first.kind();
            // Room for the rest at once (a pass's reads are usually one run of gets), rather
            // than growing by doubling.
            let mut run = Vec::with_capacity(requests.size_hint().0 + 1);
            run.push(first);
            while let Some(next) = requests.next_if(|next| next.kind() == kind) {
                run.push(next);
            }
            self.handle_run(run);
        }
    }

    pub fn new(engine: Box<dyn ShardEngine>) -> Gate {
        Gate {
            engine,
            locked: BTreeMap::new(),
            parts: HashMap::default(),
            failed: BTreeMap::new(),
            parked: VecDeque::new(),
            intercepted: Vec::new(),
        }
    }

    /// Locks a part's keys; call before its `PreparePart` reaches the engine.
    pub fn lock(&mut self, coordinator: Arc<dyn Coordinator>, ops: &[BatchOp]) {
        let gsn = coordinator.gsn();
        for op in ops {
            let value = match op {
                BatchOp::Put { value, .. } => Some(value.clone()),
                BatchOp::Delete { .. } => None,
            };
            self.locked.entry(op.key().to_vec()).or_default().push(Hold { gsn, value });
        }
        self.parts.insert(gsn, coordinator);
    }

    /// Unlocks a part's keys once it is applied (or erased) in the engine, and hands the
    /// requests that no longer wait to the engine.
    pub fn unlock(&mut self, gsn: u64, ops: &[BatchOp]) {
        for op in ops {
            if let Some(holds) = self.locked.get_mut(op.key()) {
                holds.retain(|hold| hold.gsn != gsn);
                if holds.is_empty() {
                    self.locked.remove(op.key());
                }
            }
        }
        self.parts.remove(&gsn);
        self.release_parked();
    }

    /// A committed part failed to apply here (the store is poisoned). Its keys keep their locks,
    /// so reads answer the batch's values (recovery will commit the batch: every part was durable
    /// before the decision); their writes, parked or not, are refused from now on.
    pub fn fail(&mut self, gsn: u64, ops: &[BatchOp]) {
        debug_assert!(self.committed(gsn), "only a committed part fails to apply");
        for op in ops {
            self.failed.insert(op.key().to_vec(), ());
        }
        self.release_parked();
    }

    /// The committed value a locked key reads as, if its batch is committed: Some(None) for a
    /// delete; None when the engine's state stands.
    fn overlay(&self, key: &[u8]) -> Option<Option<&[u8]>> {
        let holds = self.locked.get(key)?;
        holds.iter().rev().find(|hold| self.committed(hold.gsn)).map(|hold| hold.value.as_deref())
    }

    /// The holds on `key` now, for a read handed to the engine now (`HoldsAt`).
    fn holds_at(&self, key: &[u8]) -> HoldsAt {
        let Some(holds) = self.locked.get(key) else { return Vec::new() };
        holds
            .iter()
            .filter_map(|hold| {
                let part = self.parts.get(&hold.gsn)?;
                Some((part.clone(), hold.value.clone()))
            })
            .collect()
    }

    fn committed(&self, gsn: u64) -> bool {
        self.parts.get(&gsn).is_some_and(|part| matches!(part.decision(), Decision::Committed))
    }

    /// Committed overlay entries in a range, in key order.
    fn overlay_range(&self, start: Bound<&[u8]>, end: Bound<&[u8]>) -> Vec<(&[u8], Option<&[u8]>)> {
        if self.locked.is_empty() || !range_is_valid(start, end) {
            return Vec::new();
        }
        self.locked
            .range::<[u8], _>((start, end))
            .filter_map(|(key, _)| self.overlay(key).map(|value| (key.as_slice(), value)))
            .collect()
    }

    fn locked_in_range(&self, start: Bound<&[u8]>, end: Bound<&[u8]>) -> usize {
        if self.locked.is_empty() || !range_is_valid(start, end) {
            return 0;
        }
        self.locked.range::<[u8], _>((start, end)).count()
    }

    /// Answers the intercepted reads the engine has answered. Call after the round's
    /// completions and before any `unlock` (invariant 2).
    pub fn poll(&mut self) -> bool {
        if self.intercepted.is_empty() {
            return false;
        }
        let mut answered = false;
        for read in std::mem::take(&mut self.intercepted) {
            match read {
                Intercepted::Get { key, mut receiver, reply } => match receiver.try_recv() {
                    Ok(None) => self.intercepted.push(Intercepted::Get { key, receiver, reply }),
                    Ok(Some(result)) => {
                        let result = match self.overlay(&key) {
                            Some(value) => result.map(|_| value.map(<[u8]>::to_vec)),
                            None => result,
                        };
                        let _ = reply.send(result);
                        answered = true;
                    }
                    Err(oneshot::Canceled) => {
                        let _ = reply.send(Err(ReadError::Closed));
                        answered = true;
                    }
                },
                Intercepted::MultiGet { holds, mut receiver, reply } => match receiver.try_recv() {
                    Ok(None) => {
                        self.intercepted.push(Intercepted::MultiGet { holds, receiver, reply })
                    }
                    Ok(Some(result)) => {
                        let result = result.map(|mut values| {
                            for (holds, value) in holds.iter().zip(&mut values) {
                                if let Some(overlay) = committed_hold(holds) {
                                    *value = overlay.map(<[u8]>::to_vec);
                                }
                            }
                            values
                        });
                        let _ = reply.send(result);
                        answered = true;
                    }
                    Err(oneshot::Canceled) => {
                        let _ = reply.send(Err(ReadError::Closed));
                        answered = true;
                    }
                },
                Intercepted::Scan { holds, limit, mut receiver, reply } => {
                    match receiver.try_recv() {
                        Ok(None) => {
                            self.intercepted.push(Intercepted::Scan { holds, limit, receiver, reply })
                        }
                        Ok(Some(result)) => {
                            let result = result.map(|items| {
                                overlay_items(items, overlay_of(&holds), holds.len(), limit)
                            });
                            let _ = reply.send(result);
                            answered = true;
                        }
                        Err(oneshot::Canceled) => {
                            let _ = reply.send(Err(ReadError::Closed));
                            answered = true;
                        }
                    }
                }
            }
        }
        answered
    }

    /// Whether `request` must wait for a locked key, or has a key whose part failed.
    fn blocked(&self, request: &Request) -> Blocked {
        let keys: &mut dyn Iterator<Item = &[u8]> = match request {
            Request::Put { key, .. } | Request::Delete { key, .. } => {
                &mut std::iter::once(key.as_slice())
            }
            Request::Batch { ops, .. } => &mut ops.iter().map(BatchOp::key),
            // Reads of locked keys (failed ones included) are intercepted, not held back.
            Request::Get { .. }
            | Request::MultiGet { .. }
            | Request::Scan { .. }
            | Request::Stats { .. }
            | Request::Scrub { .. } => return Blocked::No,
            Request::Flush { .. } | Request::Settle { .. } => {
                return if self.parked.is_empty() { Blocked::No } else { Blocked::Wait };
            }
            Request::PreparePart { .. }
            | Request::CommitPart { .. }
            | Request::ForgetPart { .. } => return Blocked::No,
        };
        let mut wait = false;
        for key in keys {
            if self.failed.contains_key(key) {
                return Blocked::Failed;
            }
            wait |= self.locked.contains_key(key);
        }
        if wait {
            Blocked::Wait
        } else {
            Blocked::No
        }
    }

    /// Passes a request on, parks it, intercepts it, or refuses it.
    fn admit(&mut self, request: Request) -> Option<Request> {
        match self.blocked(&request) {
            Blocked::Failed => {
                refuse_failed(request, self.engine.shard_id());
                return None;
            }
            Blocked::Wait => {
                self.parked.push_back(request);
                return None;
            }
            Blocked::No => {}
        }
        if self.locked.is_empty() {
            return Some(request);
        }
        match request {
            Request::Get { key, reply } => {
                let (inner, receiver) = oneshot::channel();
                self.engine.handle(Request::Get { key: key.clone(), reply: inner });
                self.intercepted.push(Intercepted::Get { key, receiver, reply });
                None
            }
            Request::MultiGet { keys, reply }
                if keys.iter().any(|key| self.locked.contains_key(key)) =>
            {
                let (inner, receiver) = oneshot::channel();
                let holds = keys.iter().map(|key| self.holds_at(key)).collect();
                self.engine.handle(Request::MultiGet { keys, reply: inner });
                self.intercepted.push(Intercepted::MultiGet { holds, receiver, reply });
                None
            }
            Request::Scan { start, end, limit, reply }
                if self.locked_in_range(bound_ref(&start), bound_ref(&end)) > 0 =>
            {
                let (inner, receiver) = oneshot::channel();
                let holds: Vec<(Vec<u8>, HoldsAt)> = self
                    .locked
                    .range::<[u8], _>((bound_ref(&start), bound_ref(&end)))
                    .map(|(key, _)| (key.clone(), self.holds_at(key)))
                    .collect();
                // Asked for the locked keys too, so that deletes in the overlay never shorten
                // the answer below what exists.
                let asked = limit + holds.len();
                self.engine.handle(Request::Scan { start, end, limit: asked, reply: inner });
                self.intercepted.push(Intercepted::Scan { holds, limit, receiver, reply });
                None
            }
            other => Some(other),
        }
    }

    /// Hands parked requests whose keys are free to the engine, in order. A request behind a
    /// still-parked one that writes the same key stays parked (invariant 3).
    fn release_parked(&mut self) {
        if self.parked.is_empty() {
            return;
        }
        let mut still: VecDeque<Request> = VecDeque::new();
        let mut held: BTreeMap<Vec<u8>, ()> = BTreeMap::new();
        for request in std::mem::take(&mut self.parked) {
            let behind = match &request {
                Request::Put { key, .. } | Request::Delete { key, .. } => held.contains_key(key),
                Request::Batch { ops, .. } => ops.iter().any(|op| held.contains_key(op.key())),
                Request::Flush { .. } | Request::Settle { .. } => !still.is_empty(),
                _ => false,
            };
            let waits = behind || {
                // `blocked` checks `parked`, which is empty while we sort it.
                std::mem::swap(&mut self.parked, &mut still);
                let blocked = self.blocked(&request);
                std::mem::swap(&mut self.parked, &mut still);
                matches!(blocked, Blocked::Wait)
            };
            if waits {
                match &request {
                    Request::Put { key, .. } | Request::Delete { key, .. } => {
                        held.insert(key.clone(), ());
                    }
                    Request::Batch { ops, .. } => {
                        for op in ops {
                            held.insert(op.key().to_vec(), ());
                        }
                    }
                    _ => {}
                }
                still.push_back(request);
            } else if let Some(request) = self.admit(request) {
                self.engine.handle(request);
            }
        }
        self.parked = still;
    }
}

enum Blocked {
    No,
    Wait,
    Failed,
}

fn refuse_failed(request: Request, shard: u32) {
    tracing::debug!(shard, "a write of a key whose committed part failed to apply is refused");
    match request {
        Request::Delete { reply, .. } => {
            let _ = reply.send(Err(WriteError::Poisoned));
        }
        Request::Put { reply, .. } | Request::Batch { reply, .. } => {
            let _ = reply.send(Err(WriteError::Poisoned));
        }
        other => unreachable!("only keyed requests are refused: {:?}", other.kind()),
    }
}

/// What the newest committed part of `holds` writes (Some(None): a delete); None if none of
/// them is committed.
fn committed_hold(holds: &HoldsAt) -> Option<Option<&[u8]>> {
    holds
        .iter()
        .rev()
        .find(|(part, _)| matches!(part.decision(), Decision::Committed))
        .map(|(_, value)| value.as_deref())
}

/// The committed overlay of `holds` (a range's locked keys, in key order).
fn overlay_of(holds: &[(Vec<u8>, HoldsAt)]) -> Vec<(&[u8], Option<&[u8]>)> {
    holds
        .iter()
        .filter_map(|(key, holds)| committed_hold(holds).map(|value| (key.as_slice(), value)))
        .collect()
}

/// A scan's items with `overlay` (committed values of locked keys in key order, Some(None) a
/// delete) applied, cut at `limit`. The engine was asked for `limit` plus the range's `locked`
/// keys, so deletes in the overlay never shorten the answer below what exists.
fn overlay_items(
    items: Vec<KeyValue>,
    overlay: Vec<(&[u8], Option<&[u8]>)>,
    locked: usize,
    limit: usize,
) -> Vec<KeyValue> {
    if overlay.is_empty() {
        let mut items = items;
        items.truncate(limit);
        return items;
    }
    let mut merged: BTreeMap<Vec<u8>, Vec<u8>> = items.into_iter().collect();
    let asked_past = merged.keys().next_back().cloned();
    let complete = merged.len() < limit + locked;
    for (key, value) in overlay {
        // A key past the last item of a cut answer may have neighbours the engine did not
        // return; adding it would skip them.
        let beyond = !complete && asked_past.as_deref().is_some_and(|last| key > last);
        match value {
            Some(value) if !beyond => {
                merged.insert(key.to_vec(), value.to_vec());
            }
            Some(_) => {}
            None => {
                merged.remove(key);
            }
        }
    }
    merged.into_iter().take(limit).collect()
}

fn bound_ref(bound: &Bound<Vec<u8>>) -> Bound<&[u8]> {
    match bound {
        Bound::Included(key) => Bound::Included(key),
        Bound::Excluded(key) => Bound::Excluded(key),
        Bound::Unbounded => Bound::Unbounded,
    }
}

/// BTreeMap::range panics on an empty or inverted range; such a range holds no key.
fn range_is_valid(start: Bound<&[u8]>, end: Bound<&[u8]>) -> bool {
    match (start, end) {
        (Bound::Included(s), Bound::Included(e)) => s <= e,
        (Bound::Included(s), Bound::Excluded(e)) | (Bound::Excluded(s), Bound::Included(e)) => {
            s < e
        }
        (Bound::Excluded(s), Bound::Excluded(e)) => s < e,
        _ => true,
    }
}

/// The gate is the engine as the shard loop and exec programs see it.
impl ShardEngine for Gate {
    fn shard_id(&self) -> u32 {
        self.engine.shard_id()
    }

    fn handle_run(&mut self, run: Vec<Request>) {
        if self.locked.is_empty() && self.parked.is_empty() && self.failed.is_empty() {
            return self.engine.handle_run(run);
        }
        let kind = run.first().map(Request::kind);
        let admitted: Vec<Request> = run.into_iter().filter_map(|r| self.admit(r)).collect();
        if admitted.is_empty() {
            return;
        }
        debug_assert!(admitted.iter().all(|request| Some(request.kind()) == kind));
        self.engine.handle_run(admitted);
    }

    fn handle(&mut self, request: Request) {
        if request.kind() == RequestKind::Part {
            return self.engine.handle(request);
        }
        if let Some(request) = self.admit(request) {
            self.engine.handle(request);
        }
    }

    fn end_round(&mut self) {
        self.engine.end_round();
    }

    fn reap(&mut self, wait: bool) {
        self.engine.reap(wait);
    }

    fn is_idle(&self) -> bool {
        self.engine.is_idle()
    }

    fn has_io_in_flight(&self) -> bool {
        self.engine.has_io_in_flight()
    }

    /// Parked requests wait for a part's unlock, which a message brings (a decision's wake),
    /// and intercepted reads for the engine's answer: neither makes the gate ready by itself.
    fn has_work_ready(&self) -> bool {
        self.engine.has_work_ready()
    }

    fn completion_fd(&self) -> Option<BorrowedFd<'_>> {
        self.engine.completion_fd()
    }

    fn next_deadline(&self) -> Option<Instant> {
        self.engine.next_deadline()
    }

    fn can_share_thread(&self) -> bool {
        self.engine.can_share_thread()
    }

    fn defer_submission(&mut self, on: bool) {
        self.engine.defer_submission(on);
    }

    fn has_deferred_submission(&self) -> bool {
        self.engine.has_deferred_submission()
    }

    fn take_reads(&mut self, max: usize) -> Vec<crate::device::TakenRead> {
        self.engine.take_reads(max)
    }

    fn give_back(&mut self, reads: Vec<crate::device::TakenRead>) {
        self.engine.give_back(reads);
    }

    fn taken_reads(&self) -> usize {
        self.engine.taken_reads()
    }

    fn has_io_in_kernel(&self) -> bool {
        self.engine.has_io_in_kernel()
    }

    fn contains_key(&self, key: &[u8]) -> bool {
        match self.overlay(key) {
            Some(value) => value.is_some(),
            None => self.engine.contains_key(key),
        }
    }

    fn index_keys(&self, start: Bound<&[u8]>, end: Bound<&[u8]>, limit: usize) -> Vec<Vec<u8>> {
        let overlay = self.overlay_range(start, end);
        if overlay.is_empty() {
            return self.engine.index_keys(start, end, limit);
        }
        let asked = limit + self.locked_in_range(start, end);
        let items =
            self.engine.index_keys(start, end, asked).into_iter().map(|key| (key, Vec::new()));
        overlay_items(items.collect(), overlay, asked - limit, limit)
            .into_iter()
            .map(|(key, _)| key)
            .collect()
    }

    fn has_keys_starting_with(&self, byte: u8) -> bool {
        let (start, end) = crate::engine::first_byte_range(&byte);
        if self.overlay_range(start, end).is_empty() {
            self.engine.has_keys_starting_with(byte)
        } else {
            self.count_keys(start, end, 1) > 0
        }
    }

    fn count_keys(&self, start: Bound<&[u8]>, end: Bound<&[u8]>, limit: usize) -> usize {
        let overlay = self.overlay_range(start, end);
        if overlay.is_empty() {
            return self.engine.count_keys(start, end, limit);
        }
        let mut count = self.engine.count_keys(start, end, usize::MAX) as i64;
        for (key, value) in overlay {
            match (self.engine.contains_key(key), value.is_some()) {
                (false, true) => count += 1,
                (true, false) => count -= 1,
                _ => {}
            }
        }
        (count.max(0) as usize).min(limit)
    }

    fn recovered_parts(&self) -> Vec<PartRecord> {
        self.engine.recovered_parts()
    }

    fn close(&mut self) -> Result<(), WriteError> {
        // Parked requests wait for parts that can no longer be decided: the store is closing.
        for request in std::mem::take(&mut self.parked) {
            super::reject(request);
        }
        let result = self.engine.close();
        self.poll();
        result
    }
}
