//! Write batches, all-or-nothing within a shard, also across a crash.
//!
//! A batch is first written whole as one `Batch` record (one checksum, so it is either entirely
//! on disk or detected as torn), or, when its encoding is larger than one record may be, as a
//! chain of Chunk records (`chain.rs`) that recovery replays only when it finds all of them.
//! A chain's records are placed `CHAIN_RECORDS_IN_FLIGHT_MAX` at a time, the next as each is
//! durable (`ChainRest`), so that its page images stay a few records' worth whatever its size.
//! Once every record of the batch is durable, each operation is written as an ordinary record
//! with the batch's sequence number, at most `BATCH_MEMBERS_IN_FLIGHT_MAX` (and
//! `BATCH_MEMBER_BYTES_IN_FLIGHT_MAX` bytes) at a time, the next ones once those are durable.
//! When all of them are durable they are applied to the index together (readers never see part
//! of a batch) and the batch is answered. Last, the batch's records are erased. Until that
//! erasure is durable, each key of the batch counts as having a stale copy (the batch's records
//! mention it), so a tombstone of such a key outlives them.
//!
//! Recovery replays a batch record (or whole chain) it finds: each operation whose key has no
//! record at least as new as the batch is written again with the batch's sequence number (see
//! `recovery.rs`).
//!
//! The batch's value is the engine-neutral encoding of `engine/batch_codec.rs`.
//!
//! `Batches` holds the batches under way, by id: a batch is in it from `start_batch` until it
//! fails or the erasure of its records is durable (a committed part's batch until it is
//! applied); `members_waiting` counts its members written and not yet durable and `queued` those
//! not yet written, so it is applied once, when both are empty.

use std::collections::VecDeque;

use super::chain::{encode_chunk, record_value_lens};
use super::numbered::Numbered;
use super::format::{Loc, RecordKind};
use super::seqs::key_hash;
use super::write::{Effect, Origin};
use super::{Key, NativeEngine};
use crate::device::FaultPoint;
use crate::engine::batch_codec::{dedupe_batch, encode_batch};
use crate::engine::{BatchOp, Reply};
use crate::error::WriteError;
use crate::limits::{
    BATCH_MEMBERS_IN_FLIGHT_MAX, BATCH_MEMBER_BYTES_IN_FLIGHT_MAX, CHAIN_RECORDS_IN_FLIGHT_MAX,
};

/// A slot for a record, and the stale key hash of what it held (`allocate_for`).
pub(super) type Allocation = (Loc, Option<u64>);

/// The records of a chain not placed yet (`place_records`), and the value they carry pieces of.
/// Its owner (a batch, or a part being prepared) places the next as each record is durable.
pub(super) struct ChainRest {
    /// The kind of the whole the chain records (Batch or Part).
    kind: RecordKind,
    seq: u64,
    value: Vec<u8>,
    /// The index in the chain of the record `slots` starts with.
    next_index: usize,
    slots: VecDeque<Allocation>,
}

pub(super) struct BatchState {
    /// The members not yet written, each with its slot, allocated before anything is written
    /// so that a batch that cannot get its slots fails without leaving a record behind.
    queued: VecDeque<(BatchOp, Allocation)>,
    seq: u64,
    /// The batch's durable records: its Batch (or committed Part) record, or its chain's.
    records: Vec<Loc>,
    /// Its records not yet durable (placed or not).
    records_waiting: usize,
    /// Its chain's records not placed yet.
    chain_rest: Option<ChainRest>,
    /// Members written and not yet durable.
    members_waiting: usize,
    /// Erasures of its records not yet durable, once it is applied.
    erasures_waiting: usize,
    durable: Vec<(Key, u64, Loc, RecordKind)>,
    reply: Option<Reply<(), WriteError>>,
    /// Key hashes counted as stale while the batch's records exist.
    held: Vec<u64>,
    /// The gsn when this is a cross-shard part being committed (`parts.rs`): its records are the
    /// committed Part record (or chain), kept (not erased) once the members are applied.
    part: Option<u64>,
}

impl BatchState {
    /// Every record of the batch is durable: recovery would replay it.
    fn recorded(&self) -> bool {
        self.records_waiting == 0 && !self.records.is_empty()
    }
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
        self.start_recorded_batch(ops, RecordKind::Batch, value, None, reply);
    }

    /// Writes `ops` all or nothing: first the record of `kind` holding `value` (which names every
    /// operation), or its chain, then the members. `part`: the gsn of a cross-shard part being
    /// committed. If no slot can be had, answers `reply` with the error (and `part` stays as it
    /// was).
    pub(super) fn start_recorded_batch(
        &mut self,
        ops: Vec<BatchOp>,
        kind: RecordKind,
        value: Vec<u8>,
        part: Option<u64>,
        reply: Reply<(), WriteError>,
    ) {
        let allocated = self.allocate_members(&ops).and_then(|slots| {
            match self.allocate_records(value.len()) {
                Ok(records) => Ok((slots, records)),
                Err(err) => {
                    self.free_allocations(slots);
                    Err(err)
                }
            }
        });
        let (slots, records) = match allocated {
            Ok(allocated) => allocated,
            Err(err) => {
                // Nothing was written: a part being committed is only prepared still.
                if let Some(gsn) = part {
                    self.part_commit_failed(gsn);
                }
                let _ = reply.send(Err(err));
                return;
            }
        };
        let seq = self.seqs.take();
        let held = self.hold_batch_keys(&ops);
        let batch = self.start_batch(ops, slots, seq, held, Vec::new(), Some(reply), part);
        self.batches.get_mut(batch).expect("just started").records_waiting = records.len();
        let rest = self.place_records(records, kind, seq, value, || Effect::BatchRecord { batch });
        // Gone if a record failed at once (the store is poisoned then).
        if let Some(state) = self.batches.get_mut(batch) {
            state.chain_rest = rest;
        }
    }

    /// Slots for the records of a value of `value_bytes` (Batch or Part): one, or a chain's,
    /// or none at all.
    pub(super) fn allocate_records(
        &mut self,
        value_bytes: usize,
    ) -> Result<Vec<Allocation>, WriteError> {
        let lens = record_value_lens(value_bytes, self.batch_record_bytes_max);
        let mut records = Vec::with_capacity(lens.len());
        for len in lens {
            // A record has no key: `allocate_for` sizes its slot and finds no old copy to sit by.
            match self.allocate_for(&[], len) {
                Ok(allocation) => records.push(allocation),
                Err(err) => {
                    self.free_allocations(records);
                    return Err(err);
                }
            }
        }
        Ok(records)
    }

    /// Writes the record of `kind` holding `value` into the one slot of `records`, or the first
    /// records of its chain of Chunk records into theirs (at most `CHAIN_RECORDS_IN_FLIGHT_MAX`),
    /// each with sequence number `seq` and an effect `effect` makes. Returns the chain's records
    /// not placed yet, for `place_chain_records` as earlier ones become durable.
    pub(super) fn place_records(
        &mut self,
        records: Vec<Allocation>,
        kind: RecordKind,
        seq: u64,
        value: Vec<u8>,
        effect: impl Fn() -> Effect,
    ) -> Option<ChainRest> {
        if let [(loc, overwritten)] = records[..] {
            let watermark = self.seqs.durable_watermark();
            let write = self.writes.add(loc, overwritten, effect());
            self.place(write, loc, kind, seq, watermark, &[], &value);
            return None;
        }
        let rest = ChainRest { kind, seq, value, next_index: 0, slots: records.into() };
        self.place_chain_records(rest, CHAIN_RECORDS_IN_FLIGHT_MAX, effect)
    }

    /// Places the next `count` records of a chain; returns the rest, if any.
    pub(super) fn place_chain_records(
        &mut self,
        mut rest: ChainRest,
        count: usize,
        effect: impl Fn() -> Effect,
    ) -> Option<ChainRest> {
        let watermark = self.seqs.durable_watermark();
        for _ in 0..count {
            let Some((loc, overwritten)) = rest.slots.pop_front() else { break };
            let piece =
                encode_chunk(rest.kind, &rest.value, rest.next_index, self.batch_record_bytes_max);
            rest.next_index += 1;
            let write = self.writes.add(loc, overwritten, effect());
            self.place(write, loc, RecordKind::Chunk, rest.seq, watermark, &[], &piece);
        }
        (!rest.slots.is_empty()).then_some(rest)
    }

    fn free_allocations(&mut self, allocations: Vec<Allocation>) {
        for (loc, tag) in allocations {
            self.place_free(loc.slot_only(), tag, false, None);
        }
    }

    /// Allocates a slot for each operation, or none at all.
    fn allocate_members(&mut self, ops: &[BatchOp]) -> Result<Vec<Allocation>, WriteError> {
        let mut slots = Vec::with_capacity(ops.len());
        for op in ops {
            let value_bytes = match op {
                BatchOp::Put { value, .. } => value.len(),
                BatchOp::Delete { .. } => 0,
            };
            match self.allocate_for(op.key(), value_bytes) {
                Ok(slot) => slots.push(slot),
                Err(err) => {
                    self.free_allocations(slots);
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

    /// Recovery found a durable batch record or whole chain (or committed Part record or chain,
    /// `part`) at `records`: write again the operations in `ops` (those whose keys have nothing
    /// newer on disk), then erase the batch's records (a part's are kept until it is forgotten).
    pub(super) fn replay_batch(
        &mut self,
        records: Vec<Loc>,
        seq: u64,
        all_ops: &[BatchOp],
        ops: Vec<BatchOp>,
        part: Option<u64>,
    ) -> Result<(), WriteError> {
        let slots = self.allocate_members(&ops)?;
        let held = self.hold_batch_keys(all_ops);
        let batch = self.start_batch(ops, slots, seq, held, records, None, part);
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
        slots: Vec<Allocation>,
        seq: u64,
        held: Vec<u64>,
        records: Vec<Loc>,
        reply: Option<Reply<(), WriteError>>,
        part: Option<u64>,
    ) -> u64 {
        self.seqs.hold(seq);
        for op in &ops {
            self.seqs.flight_begin(op.key());
        }
        let state = BatchState {
            queued: ops.into_iter().zip(slots).collect(),
            seq,
            records,
            records_waiting: 0,
            chain_rest: None,
            members_waiting: 0,
            erasures_waiting: 0,
            durable: Vec::new(),
            reply,
            held,
            part,
        };
        self.batches.insert(state)
    }

    /// One record of the batch (its only one, or one of its chain's) is durable; once all are,
    /// so is the batch, and its members are written.
    pub(super) fn batch_record_durable(&mut self, batch: u64, loc: Loc) {
        let Some(state) = self.batches.get_mut(batch) else { return };
        state.records.push(loc);
        state.records_waiting -= 1;
        if state.records_waiting > 0 {
            if let Some(rest) = state.chain_rest.take() {
                if self.is_poisoned() {
                    // Nothing more is written; the chain stays incomplete, recovery's to erase.
                    return self.batch_member_failed(batch, WriteError::Poisoned);
                }
                let rest = self.place_chain_records(rest, 1, || Effect::BatchRecord { batch });
                if let Some(state) = self.batches.get_mut(batch) {
                    state.chain_rest = rest;
                }
            }
            return;
        }
        if let Err(err) = self.io.device.fault_point(FaultPoint::BatchRecordedBeforeMembers) {
            // The records are durable: batch_member_failed poisons the store, and recovery
            // replays the batch.
            self.batch_member_failed(batch, WriteError::from_device(err));
            return;
        }
        self.write_batch_members(batch);
    }

    /// Writes the batch's next members: as many as are queued, up to the bounds of one wave.
    fn write_batch_members(&mut self, batch: u64) {
        let Some(state) = self.batches.get(batch) else { return };
        if state.queued.is_empty() && state.members_waiting == 0 {
            self.batch_applied(batch);
            return;
        }
        let seq = state.seq;
        if self.is_poisoned() {
            // Nothing more is written; the members not yet written end their flights there.
            self.batch_member_failed(batch, WriteError::Poisoned);
            return;
        }
        let mut wave_bytes = 0usize;
        for _ in 0..BATCH_MEMBERS_IN_FLIGHT_MAX {
            // A member may fail at once (a poisoned store), which forgets the batch.
            let Some(state) = self.batches.get_mut(batch) else { return };
            if wave_bytes >= BATCH_MEMBER_BYTES_IN_FLIGHT_MAX {
                break;
            }
            let Some((op, slot)) = state.queued.pop_front() else { break };
            state.members_waiting += 1;
            let origin = Origin::Batch(batch);
            match op {
                BatchOp::Put { key, value } => {
                    wave_bytes += key.len() + value.len();
                    self.write_record(key, value, origin, Some(seq), RecordKind::Put, Some(slot))
                }
                BatchOp::Delete { key } => {
                    wave_bytes += key.len();
                    self.write_record(
                        key,
                        Vec::new(),
                        origin,
                        Some(seq),
                        RecordKind::Tombstone,
                        Some(slot),
                    )
                }
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
            // The wave is durable: the next one, or, if none is left, the batch is applied.
            self.write_batch_members(batch);
        }
    }

    /// Every member is durable: apply them together, answer, and erase the batch's records (or
    /// hand a committed part's records and held keys to its part).
    fn batch_applied(&mut self, batch: u64) {
        let state = self.batches.get_mut(batch).expect("unknown batch");
        assert!(state.recorded(), "members are written after the batch's records");
        assert!(state.queued.is_empty() && state.members_waiting == 0);
        let durable = std::mem::take(&mut state.durable);
        let reply = state.reply.take();
        let records = std::mem::take(&mut state.records);
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
                self.part_committed(gsn, records, state.held);
            }
            None => {
                self.batches.get_mut(batch).expect("applied above").erasures_waiting =
                    records.len();
                for record in records {
                    self.erase_batch_record(record, batch);
                }
            }
        }
    }

    /// The erasure of one of the batch's records is durable; once all are, its keys no longer
    /// have a copy in them.
    pub(super) fn batch_erased(&mut self, batch: u64) {
        // Gone if an erasure of another of its records failed (`write_failed`).
        let Some(state) = self.batches.get_mut(batch) else { return };
        state.erasures_waiting -= 1;
        if state.erasures_waiting > 0 {
            return;
        }
        let state = self.batches.remove(batch).expect("looked up above");
        for hash in state.held {
            self.release_tag(Some(hash));
        }
    }

    /// A member or a record failed (the store is poisoned by then, or the batch never got a
    /// slot): answer the error and forget the batch; members and records that still complete
    /// are dropped.
    pub(super) fn batch_member_failed(&mut self, batch: u64, err: WriteError) {
        let Some(mut state) = self.batches.remove(batch) else { return };
        let recorded = state.recorded();
        let chained = state.records.len() + state.records_waiting > 1;
        if !recorded && chained && !self.is_poisoned() {
            // A record of a chain failed while others may still be in flight or durable: their
            // sequence number cannot be finished, nor their slots freed, until they complete,
            // and a half-written chain is recovery's to erase. The engine stops writing (the
            // failure is a device's: a page read or write failed).
            tracing::error!(shard = self.shard_id, %err, "a record of a batch's chain failed");
            self.poison();
        }
        if recorded && !self.is_poisoned() {
            // The batch's records are durable, so recovery will apply the batch: refuse further
            // writes rather than carry on as if it had not happened.
            tracing::error!(shard = self.shard_id, %err, "a write batch failed after its record was durable");
            self.poison();
        }
        // Members never written, and members durable but never to be applied, end their
        // flights here; those in flight end theirs as they complete (`batch_member_durable` of
        // a forgotten batch, or `write_failed`).
        for (op, _) in std::mem::take(&mut state.queued) {
            self.seqs.flight_end(op.key(), state.seq, false);
            self.release_guards(key_hash(op.key()));
        }
        for (key, seq, _, _) in std::mem::take(&mut state.durable) {
            self.seqs.flight_end(&key, seq, false);
            self.release_guards(key_hash(&key));
        }
        if !recorded {
            // The batch is not durable whole (a chain missing a record is not replayed), and no
            // member was written: undo what it registered when it started. (Its member slots,
            // and the slots of chain records never placed, with the stale tags they carry, stay
            // allocated until the next recovery: the store is poisoned whenever a chain is left
            // unplaced.)
            for hash in std::mem::take(&mut state.held) {
                self.release_tag(Some(hash));
            }
            if !self.is_poisoned() {
                self.seqs.finish(state.seq);
            }
        }
        if let (Some(gsn), false) = (state.part, recorded) {
            self.part_commit_failed(gsn);
        }
        if let Some(reply) = state.reply.take() {
            let _ = reply.send(Err(err));
        }
    }
}
