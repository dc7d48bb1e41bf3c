//! Cross-shard parts in the native engine (the contract: `engine/part.rs`; the protocol:
//! docs/atomic-batches.md).
//!
//! A part lives in at most two Part records, each in a slot of its own (or each a chain of
//! Chunk records, `chain.rs`, when its operations are too large for one record: below, "the
//! record" is then the whole chain):
//! - `PreparePart` writes the *prepared* record. The part's operations are written nowhere else,
//!   so preparing changes no key and nothing reads them.
//! - `CommitPart` writes the *committed* record, with a fresh sequence number, and then the
//!   operations as ordinary records carrying that number, exactly as a write batch does
//!   (`batch.rs`): applied together once all are durable, newer than every earlier write. The
//!   committed record then stays, and each key of the part counts as having a stale copy while
//!   it does (recovery replays it, so a later tombstone of the key must outlive it).
//! - `ForgetPart` erases the prepared record first and the committed one only once that erasure
//!   is durable. So no crash leaves a shard holding just the prepared record of a part it has
//!   committed: recovery would then commit it again, over newer writes of its keys.
//!
//! Recovery (`recovery.rs`): a gsn with a committed record is replayed like a batch record and
//! reported as committed; a gsn with only its prepared record is reported as prepared, and the
//! router decides it from the other shards' parts.
//!
//! Invariants: a gsn is in `parts` from `PreparePart` (or recovery) until the erasure of its last
//! record is durable; `records` holds its durable records in the order they are to be erased
//! (prepared first); `held` is non-empty only while the committed record exists.

use super::batch::ChainRest;
use super::format::{Loc, RecordKind};
use super::write::{Effect, ErasedRecord};
use super::NativeEngine;
use crate::engine::part::{self, PartRecord, PartState};
use crate::engine::{BatchOp, Reply};
use crate::error::WriteError;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// The prepared record is being written.
    Preparing,
    Prepared,
    /// The committed record and the operations are being written (a batch of `batch.rs`).
    Committing,
    Committed,
    /// The records are being erased, one after the other.
    Forgetting,
}

pub struct Part {
    participants: Vec<u32>,
    ops: Vec<BatchOp>,
    stage: Stage,
    /// Durable records of the part, in erasure order (a chain's records one after the other).
    records: Vec<Loc>,
    /// Records of the prepared record's chain not yet durable, while preparing.
    records_waiting: usize,
    /// Records of the prepared record's chain not placed yet, while preparing.
    chain_rest: Option<ChainRest>,
    /// Key hashes counted as stale while the committed record exists.
    held: Vec<u64>,
    /// Who waits for the prepare or the forget under way.
    reply: Option<Reply<(), WriteError>>,
}

impl Part {
    /// A part recovery found; `records` in erasure order.
    pub(super) fn recovered(record: &PartRecord, records: Vec<Loc>) -> Part {
        Part {
            participants: record.participants.clone(),
            ops: record.ops.clone(),
            stage: match record.state {
                PartState::Prepared => Stage::Prepared,
                // Becomes Committed once its replay is applied (`part_committed`).
                PartState::Committed => Stage::Committing,
            },
            records,
            records_waiting: 0,
            chain_rest: None,
            held: Vec::new(),
            reply: None,
        }
    }
}

impl NativeEngine {
    pub(super) fn prepare_part(
        &mut self,
        gsn: u64,
        participants: Vec<u32>,
        ops: Vec<BatchOp>,
        reply: Reply<(), WriteError>,
    ) {
        if self.is_poisoned() {
            let _ = reply.send(Err(WriteError::Poisoned));
            return;
        }
        if self.parts.contains_key(&gsn) {
            let _ = reply.send(Err(WriteError::Aborted(format!(
                "shard {} already holds a part of batch {gsn}",
                self.shard_id
            ))));
            return;
        }
        // The router checked the part; checked again because the record must fit a slot.
        if let Err(err) = crate::engine::input::check_part(participants.len(), &ops) {
            let _ = reply.send(Err(err.into()));
            return;
        }
        let value = part::encode(PartState::Prepared, gsn, &participants, &ops);
        let records = match self.allocate_records(value.len()) {
            Ok(records) => records,
            Err(err) => {
                let _ = reply.send(Err(err));
                return;
            }
        };
        let seq = self.seqs.take();
        self.seqs.hold(seq);
        self.parts.insert(
            gsn,
            Part {
                participants,
                ops,
                stage: Stage::Preparing,
                records: Vec::new(),
                records_waiting: records.len(),
                chain_rest: None,
                held: Vec::new(),
                reply: Some(reply),
            },
        );
        let rest =
            self.place_records(records, RecordKind::Part, seq, value, || Effect::PartPrepared {
                gsn,
                seq,
            });
        // Gone if a record failed at once (the store is poisoned then).
        if let Some(part) = self.parts.get_mut(&gsn) {
            part.chain_rest = rest;
        }
    }

    /// A record of the prepared record's chain (or the one record) is durable; once all are, so
    /// is the part.
    pub(super) fn part_prepared(&mut self, gsn: u64, seq: u64, loc: Loc) {
        // Gone if another record of its chain failed (the store is poisoned then).
        let Some(part) = self.parts.get_mut(&gsn) else { return };
        assert_eq!(part.stage, Stage::Preparing);
        part.records.push(loc);
        part.records_waiting -= 1;
        if part.records_waiting > 0 {
            if let Some(rest) = part.chain_rest.take() {
                if self.is_poisoned() {
                    // Nothing more is written; the chain stays incomplete, recovery's to erase.
                    return self.part_prepare_failed(gsn, WriteError::Poisoned);
                }
                let rest =
                    self.place_chain_records(rest, 1, || Effect::PartPrepared { gsn, seq });
                if let Some(part) = self.parts.get_mut(&gsn) {
                    part.chain_rest = rest;
                }
            }
            return;
        }
        self.seqs.finish(seq);
        let part = self.parts.get_mut(&gsn).expect("looked up above");
        part.stage = Stage::Prepared;
        if let Some(reply) = part.reply.take() {
            let _ = reply.send(Ok(()));
        }
    }

    /// Whether the part of `gsn` is preparing a chain of several records (whose siblings may be
    /// in flight when one fails).
    pub(super) fn part_preparing_a_chain(&self, gsn: u64) -> bool {
        self.parts.get(&gsn).is_some_and(|part| {
            // While preparing, `records` holds the chain's durable records only.
            part.stage == Stage::Preparing && part.records.len() + part.records_waiting > 1
        })
    }

    pub(super) fn part_prepare_failed(&mut self, gsn: u64, err: WriteError) {
        if let Some(mut part) = self.parts.remove(&gsn) {
            if let Some(reply) = part.reply.take() {
                let _ = reply.send(Err(err));
            }
        }
    }

    pub(super) fn commit_part(&mut self, gsn: u64, reply: Reply<(), WriteError>) {
        if !self.parts.contains_key(&gsn) {
            let _ = reply.send(Err(WriteError::UnknownPart { shard: self.shard_id, gsn }));
            return;
        }
        if let Err(err) = self.part_ready(gsn, &[Stage::Prepared], "commit") {
            let _ = reply.send(Err(err));
            return;
        }
        let part = self.parts.get_mut(&gsn).expect("checked above");
        part.stage = Stage::Committing;
        let value = part::encode(PartState::Committed, gsn, &part.participants, &part.ops);
        let ops = part.ops.clone();
        // On failure the batch answers `reply` and calls `part_commit_failed`.
        self.start_recorded_batch(ops, RecordKind::Part, value, Some(gsn), reply);
    }

    /// Whether the part of `gsn` (which exists) may take a request now: it is in one of `stages`
    /// and the store is not poisoned.
    fn part_ready(&self, gsn: u64, stages: &[Stage], action: &str) -> Result<(), WriteError> {
        let stage = self.parts[&gsn].stage;
        if !stages.contains(&stage) {
            return Err(WriteError::Aborted(format!(
                "shard {} was asked to {action} part {gsn} while it is {stage:?}",
                self.shard_id
            )));
        }
        if self.is_poisoned() {
            return Err(WriteError::Poisoned);
        }
        Ok(())
    }

    /// The committed record and every operation are durable and applied (`batch.rs`); the
    /// record stays until the part is forgotten, holding the part's keys.
    pub(super) fn part_committed(&mut self, gsn: u64, records: Vec<Loc>, held: Vec<u64>) {
        let part = self.parts.get_mut(&gsn).expect("committed an unknown part");
        assert_eq!(part.stage, Stage::Committing);
        part.stage = Stage::Committed;
        part.records.extend(records);
        part.held = held;
    }

    /// The commit failed before its record was durable: the part is still only prepared.
    pub(super) fn part_commit_failed(&mut self, gsn: u64) {
        if let Some(part) = self.parts.get_mut(&gsn) {
            part.stage = Stage::Prepared;
        }
    }

    pub(super) fn forget_part(&mut self, gsn: u64, reply: Reply<(), WriteError>) {
        if !self.parts.contains_key(&gsn) {
            let _ = reply.send(Ok(()));
            return;
        }
        if let Err(err) = self.part_ready(gsn, &[Stage::Prepared, Stage::Committed], "forget") {
            let _ = reply.send(Err(err));
            return;
        }
        let part = self.parts.get_mut(&gsn).expect("checked above");
        part.stage = Stage::Forgetting;
        part.reply = Some(reply);
        let first = *part.records.first().expect("a durable part has a record");
        self.place_free(first.slot_only(), None, true, Some(ErasedRecord::Part(gsn)));
    }

    /// The erasure of the part's first record is durable: erase the next, or finish.
    pub(super) fn part_record_erased(&mut self, gsn: u64) {
        let part = self.parts.get_mut(&gsn).expect("erased a record of an unknown part");
        assert_eq!(part.stage, Stage::Forgetting);
        part.records.remove(0);
        if let Some(&next) = part.records.first() {
            self.place_free(next.slot_only(), None, true, Some(ErasedRecord::Part(gsn)));
            return;
        }
        let mut part = self.parts.remove(&gsn).expect("looked up above");
        for hash in std::mem::take(&mut part.held) {
            self.release_tag(Some(hash));
        }
        if let Some(reply) = part.reply.take() {
            let _ = reply.send(Ok(()));
        }
    }

    /// An erasure failed (the store is poisoned): the remaining records stay on disk, and their
    /// keys stay held, until the next open reports the part again.
    pub(super) fn part_erase_failed(&mut self, gsn: u64, err: WriteError) {
        if let Some(part) = self.parts.get_mut(&gsn) {
            if let Some(reply) = part.reply.take() {
                let _ = reply.send(Err(err));
            }
        }
    }
}
