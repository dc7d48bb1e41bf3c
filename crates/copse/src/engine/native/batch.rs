//! Write batches, all-or-nothing within a shard, also across a crash.
//!
//! A batch is first written whole as one `Batch` record (one checksum, so it is either entirely
//! on disk or detected as torn). Once that record is durable, each operation is written as an
//! ordinary record with the batch's sequence number. When all of them are durable they are applied
//! to the index together (readers never see part of a batch) and the batch is answered. Last, the
//! batch record is erased. Until that erasure is durable, each key of the batch counts as having a
//! stale copy (the batch record mentions it), so a tombstone of such a key outlives the record.
//!
//! Recovery replays a batch record it finds: each operation whose key has no record at least as
//! new as the batch is written again with the batch's sequence number (see `recovery.rs`).
//!
//! The batch record's value is the engine-neutral encoding of `engine/batch_codec.rs`.
//!
//! `Batches` holds the batches under way, by id: a batch is in it from `start_batch` until it
//! fails or its record's erasure is durable (a committed part's batch until it is applied), and
//! `members_waiting` counts its members not yet durable, so it is applied once, when that count
//! reaches zero.

use super::numbered::Numbered;
use super::format::{Loc, RecordKind};
use super::seqs::key_hash;
use super::write::{Effect, Origin};
use super::{Key, NativeEngine};
use crate::device::FaultPoint;
use crate::engine::batch_codec::{dedupe_batch, encode_batch};
use crate::engine::{BatchOp, Reply};
use crate::error::WriteError;

pub(super) struct BatchState {
    ops: Vec<BatchOp>,
    /// The slot of each operation, allocated before anything is written so that a batch that
    /// cannot get its slots fails without leaving a record behind.
    slots: Vec<(Loc, Option<u64>)>,
    seq: u64,
    record: Option<Loc>,
    members_waiting: usize,
    durable: Vec<(Key, u64, Loc, RecordKind)>,
    reply: Option<Reply<(), WriteError>>,
    /// Key hashes counted as stale while the batch record exists.
    held: Vec<u64>,
    /// The gsn when this is a cross-shard part being committed (`parts.rs`): its record is a
    /// committed Part record, kept (not erased) once the members are applied.
    part: Option<u64>,
}

/// The write batches under way (and the committed parts being applied as batches), by id.
pub(super) type Batches = Numbered<BatchState>;

impl NativeEngine {
    pub(super) fn batch(&mut self, ops: Vec<BatchOp>, reply: Reply<(), WriteError>) {
        if self.is_poisoned() {
            let _ = reply.send(Err(WriteError::Poisoned));
            return;
        }
        let ops = dedupe_batch(ops);
        if ops.is_empty() {
            let _ = reply.send(Ok(()));
            return;
        }
        let value = encode_batch(&ops);
        self.start_recorded_batch(ops, RecordKind::Batch, &value, None, reply);
    }

    /// Writes `ops` all or nothing: first the record of `kind` holding `value` (which names every
    /// operation), then the members. `part`: the gsn of a cross-shard part being committed. If no
    /// slot can be had, answers `reply` with the error (and `part` stays as it was).
    pub(super) fn start_recorded_batch(
        &mut self,
        ops: Vec<BatchOp>,
        kind: RecordKind,
        value: &[u8],
        part: Option<u64>,
        reply: Reply<(), WriteError>,
    ) {
        let mut slots = match self.allocate_members(&ops) {
            Ok(slots) => slots,
            Err(err) => {
                let _ = reply.send(Err(err));
                return;
            }
        };
        // The record has no key: `allocate_for` sizes its slot and finds no old copy to sit by.
        let (loc, overwritten) = match self.allocate_for(&[], value.len()) {
            Ok(allocation) => allocation,
            Err(err) => {
                for (loc, tag) in slots.drain(..) {
                    self.place_free(loc.slot_only(), tag, false, None);
                }
                let _ = reply.send(Err(err));
                return;
            }
        };
        let seq = self.seqs.take();
        let held = self.hold_batch_keys(&ops);
        let batch = self.start_batch(ops, slots, seq, held, None, Some(reply), part);
        let write = self.writes.add(loc, overwritten, Effect::BatchRecord { batch });
        let watermark = self.seqs.durable_watermark();
        self.place(write, loc, kind, seq, watermark, &[], value);
    }

    /// Allocates a slot for each operation, or none at all.
    fn allocate_members(&mut self, ops: &[BatchOp]) -> Result<Vec<(Loc, Option<u64>)>, WriteError> {
        let mut slots = Vec::with_capacity(ops.len());
        for op in ops {
            let value_bytes = match op {
                BatchOp::Put { value, .. } => value.len(),
                BatchOp::Delete { .. } => 0,
            };
            match self.allocate_for(op.key(), value_bytes) {
                Ok(slot) => slots.push(slot),
                Err(err) => {
                    for (loc, tag) in slots {
                        self.place_free(loc.slot_only(), tag, false, None);
                    }
                    return Err(err);
                }
            }
        }
        Ok(slots)
    }

    fn hold_batch_keys(&mut self, ops: &[BatchOp]) -> Vec<u64> {
        let held: Vec<u64> = ops.iter().map(|op| key_hash(op.key())).collect();
        for &hash in &held {
            self.seqs.count_stale(hash);
        }
        held
    }

    /// Recovery found a durable batch record (or committed Part record, `part`): write again the
    /// operations in `ops` (those whose keys have nothing newer on disk), then erase the batch
    /// record (a Part record is kept until its part is forgotten).
    pub(super) fn replay_batch(
        &mut self,
        record: Loc,
        seq: u64,
        all_ops: &[BatchOp],
        ops: Vec<BatchOp>,
        part: Option<u64>,
    ) -> Result<(), WriteError> {
        let slots = self.allocate_members(&ops)?;
        let held = self.hold_batch_keys(all_ops);
        let batch = self.start_batch(ops, slots, seq, held, Some(record), None, part);
        self.write_batch_members(batch);
        Ok(())
    }

    /// Registers a batch: holds its sequence number (the watermark stays below it until it is
    /// applied) and its keys' flights. The flights start now, with the sequence number, so that
    /// a newer write of a key that completes before the members are written still finds the
    /// batch's write pending.
    #[allow(clippy::too_many_arguments)]
    fn start_batch(
        &mut self,
        ops: Vec<BatchOp>,
        slots: Vec<(Loc, Option<u64>)>,
        seq: u64,
        held: Vec<u64>,
        record: Option<Loc>,
        reply: Option<Reply<(), WriteError>>,
        part: Option<u64>,
    ) -> u64 {
        self.seqs.hold(seq);
        for op in &ops {
            self.seqs.flight_begin(op.key());
        }
        let state = BatchState {
            ops,
            slots,
            seq,
            record,
            members_waiting: 0,
            durable: Vec::new(),
            reply,
            held,
            part,
        };
        self.batches.insert(state)
    }

    pub(super) fn batch_record_durable(&mut self, batch: u64, loc: Loc) {
        let Some(state) = self.batches.get_mut(batch) else { return };
        state.record = Some(loc);
        if let Err(err) = self.io.device.fault_point(FaultPoint::BatchRecordedBeforeMembers) {
            // The record is durable: batch_member_failed poisons the store, and recovery
            // replays the batch.
            self.batch_member_failed(batch, WriteError::from_device(err));
            return;
        }
        self.write_batch_members(batch);
    }

    fn write_batch_members(&mut self, batch: u64) {
        let state = self.batches.get_mut(batch).expect("unknown batch");
        let ops = std::mem::take(&mut state.ops);
        let slots = std::mem::take(&mut state.slots);
        let seq = state.seq;
        state.members_waiting = ops.len();
        if ops.is_empty() {
            self.batch_applied(batch);
            return;
        }
        for (op, slot) in ops.into_iter().zip(slots) {
            let origin = Origin::Batch(batch);
            match op {
                BatchOp::Put { key, value } => {
                    self.write_record(key, value, origin, Some(seq), RecordKind::Put, Some(slot))
                }
                BatchOp::Delete { key } => self.write_record(
                    key,
                    Vec::new(),
                    origin,
                    Some(seq),
                    RecordKind::Tombstone,
                    Some(slot),
                ),
            }
        }
    }

    pub(super) fn batch_member_durable(
        &mut self,
        batch: u64,
        key: Key,
        seq: u64,
        loc: Loc,
        kind: RecordKind,
    ) {
        let Some(state) = self.batches.get_mut(batch) else {
            // The batch failed: this member is never applied.
            self.seqs.flight_end(&key, seq, false);
            self.release_guards(key_hash(&key));
            return;
        };
        state.durable.push((key, seq, loc, kind));
        state.members_waiting -= 1;
        if state.members_waiting == 0 {
            self.batch_applied(batch);
        }
    }

    /// Every member is durable: apply them together, answer, and erase the batch record (or hand
    /// a committed part's record and held keys to its part).
    fn batch_applied(&mut self, batch: u64) {
        let state = self.batches.get_mut(batch).expect("unknown batch");
        let durable = std::mem::take(&mut state.durable);
        let reply = state.reply.take();
        let record = state.record.expect("members are written after the record");
        let batch_seq = state.seq;
        let part = state.part;
        self.seqs.finish(batch_seq);
        for (key, seq, loc, kind) in durable {
            match kind {
                RecordKind::Put => self.apply_put(&key, seq, loc),
                _ => {
                    self.apply_tombstone(&key, seq, loc);
                }
            }
        }
        if let Some(reply) = reply {
            let _ = reply.send(Ok(()));
        }
        match part {
            Some(gsn) => {
                let state = self.batches.remove(batch).expect("applied above");
                self.part_committed(gsn, record, state.held);
            }
            None => self.erase_batch_record(record, batch),
        }
    }

    /// The batch record's erasure is durable: its keys no longer have a copy in it.
    pub(super) fn batch_erased(&mut self, batch: u64) {
        let state = self.batches.remove(batch).expect("erased an unknown batch");
        for hash in state.held {
            self.release_tag(Some(hash));
        }
    }

    /// A member or the record failed (the store is poisoned by then, or the batch never got a
    /// slot): answer the error and forget the batch; members that still complete are dropped.
    pub(super) fn batch_member_failed(&mut self, batch: u64, err: WriteError) {
        let Some(mut state) = self.batches.remove(batch) else { return };
        if state.record.is_some() && !self.is_poisoned() {
            // The batch record is durable, so recovery will apply the batch: refuse further
            // writes rather than carry on as if it had not happened.
            tracing::error!(shard = self.shard_id, %err, "a write batch failed after its record was durable");
            self.poison();
        }
        if state.record.is_none() {
            // Nothing of the batch is durable: undo what it registered when it started. (Its
            // member slots stay allocated until the next recovery.)
            for op in std::mem::take(&mut state.ops) {
                self.seqs.flight_end(op.key(), state.seq, false);
                self.release_guards(key_hash(op.key()));
            }
            for hash in std::mem::take(&mut state.held) {
                self.release_tag(Some(hash));
            }
            if !self.is_poisoned() {
                self.seqs.finish(state.seq);
            }
        }
        if let (Some(gsn), None) = (state.part, state.record) {
            self.part_commit_failed(gsn);
        }
        if let Some(reply) = state.reply.take() {
            let _ = reply.send(Err(err));
        }
    }
}
