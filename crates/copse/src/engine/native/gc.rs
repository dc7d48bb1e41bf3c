//! The garbage collector of append placement (RStore §3.3): empties the block with the most dead
//! slots by rewriting its live records through the normal append path. Block accounting and the
//! victim heap are in `placement.rs`; the guide is docs/placement.md.
//!
//! A collection: pick a victim (when the class wants one, `AppendClass::wants_collection`) →
//! read the block's written pages with one I/O → list its live records: puts the index points at
//! (same slot, same seq) and tombstones still guarding stale copies → move them, a bounded number
//! per round → the block is free once every slot is released, which for a moved record happens
//! when its move is durable.
//!
//! Invariants:
//! - A move keeps the record's key, value and seq, and is re-encoded for its new slot (the crc
//!   covers the location). Two valid copies with one seq are the same version, so recovery may
//!   keep either; the other is a stale copy, tagged like any other.
//! - A move is applied only if, once durable, the index (or the tombstone guard) still points
//!   at the old slot with the same seq; otherwise a newer write won meanwhile and the moved copy
//!   is freed as a stale copy. The old slot is freed only after the move is durable, so a crash
//!   at any point leaves at least one valid copy of every live record.
//! - A move in flight is a write of its key in flight (`flight_begin` .. `flight_end`), like any
//!   other: a tombstone of the key written meanwhile is kept (`release_guards`) until the moved
//!   copy is durable and counted as a stale copy. Otherwise the tombstone could be freed and
//!   overwritten while the copy was still landing, and the copy would bring the deleted key
//!   back at the next open (issue 20, finding 2). Checked when a move ends.
//! - One collection at a time per shard; at most `GC_MOVES_PER_ROUND_MAX` moves issued per round,
//!   so foreground requests of the round are never queued behind a whole block.
//! - Nothing runs while the store is poisoned.

use super::format::{decode_slot, Loc, RecordKind, SizeClass, Slot};
use super::seqs::key_hash;
use super::write::Effect;
use super::{IoPurpose, NativeEngine};
use crate::device::{AlignedBuf, IoCompletion, IoKind};
use crate::engine::Reply;
use crate::error::WriteError;
use crate::limits::{
    GC_FREE_PER_APPENDED, GC_MOVES_PER_APPENDED_SLOT, GC_MOVES_PER_ROUND_MAX,
    GC_MOVES_PER_ROUND_MIN, GC_VICTIMS_PER_RUN_MAX, PAGE_BYTES,
};

/// A record to move out of the victim.
pub(super) struct Candidate {
    slot: u64,
    key: Box<[u8]>,
    value: Vec<u8>,
    seq: u64,
    tombstone: bool,
}

pub(super) struct GcRun {
    class: u8,
    /// The victims, collected together so that one run frees at least what a busy round
    /// appends.
    blocks: Vec<u32>,
    /// Victims still being read.
    reads_in_flight: usize,
    /// What the reads found, then (once every read is in) what is left to move.
    found: Vec<Candidate>,
    candidates: Option<std::vec::IntoIter<Candidate>>,
}

/// The victim's read.
pub(super) struct GcRead {
    class: u8,
    block: u32,
    first_page: u64,
}

impl NativeEngine {
    /// One round's share of collection: start a collection if a class wants one, or issue the
    /// next moves of the one under way. Called at the end of every round.
    pub(super) fn gc_step(&mut self) {
        let appended = std::mem::take(&mut self.appended_this_round);
        if self.is_poisoned() {
            self.gc = None;
            self.gc_wanted = false;
            return;
        }
        if self.gc.is_none() && !self.closing {
            self.gc_start(appended);
        }
        let Some(run) = self.gc.as_ref() else { return };
        let class = run.class;
        if run.candidates.is_none() {
            return; // still reading the victims
        }
        let budget = (GC_MOVES_PER_ROUND_MIN + GC_MOVES_PER_APPENDED_SLOT * appended)
            .min(GC_MOVES_PER_ROUND_MAX);
        let candidates = self.gc.as_mut().and_then(|run| run.candidates.as_mut()).expect("listed");
        let issued: Vec<Candidate> = candidates.by_ref().take(budget).collect();
        let finished = candidates.len() == 0;
        let append = self.append[class as usize].as_ref().expect("append");
        // A victim may have been freed under the collection (every slot released): then it may
        // be open again, and nothing of it is to move.
        let issued: Vec<Candidate> = issued
            .into_iter()
            .filter(|candidate| append.is_collecting(append.block_of(candidate.slot)))
            .collect();
        for candidate in issued {
            if self.gc_move(class, candidate).is_err() {
                // No slot to move to (the file could not grow): stop this collection.
                self.gc.as_mut().expect("running").candidates = Some(Vec::new().into_iter());
                break;
            }
        }
        if finished && self.gc_moves_in_flight == 0 {
            self.gc_finish();
        }
    }

    /// Picks victims in a class that wants a collection, enough to free `GC_FREE_PER_APPENDED`
    /// times what this round appended, and at least what the class stands past the start of
    /// collection (and one block): a collection takes a few rounds (read, move, durable), so it
    /// must free more than a round uses. Then starts reading them.
    fn gc_start(&mut self, appended: usize) {
        self.gc_wanted = false;
        for class in 0..self.append.len() {
            let ratio = self.space_amplification_max;
            let Some(append) = self.append[class].as_mut() else { continue };
            if !append.wants_collection(ratio) {
                continue;
            }
            // What this round's pace asks for, and at least what the class stands past the
            // start: a small round may start a collection while a burst is under way.
            let wanted_slots = (GC_FREE_PER_APPENDED * appended as u64)
                .max(append.slots_past_start(ratio))
                .max(append.slots_per_block());
            let mut blocks = Vec::new();
            let mut dead_slots = 0;
            while dead_slots < wanted_slots && blocks.len() < GC_VICTIMS_PER_RUN_MAX {
                let Some((block, dead)) = append.pick_victim() else { break };
                blocks.push(block);
                dead_slots += dead as u64;
            }
            if blocks.is_empty() {
                continue;
            }
            self.gc_wanted = true;
            let file = self.slabs.file(class as u8).expect("an append class has a file");
            let (fid, frontier_page) = (file.file, file.frontier_page);
            let mut reads = Vec::new();
            for &block in &blocks {
                let (first_page, end_page) = append.pages_of(block);
                // Pages past the frontier were never written: nothing in them lives.
                let pages = end_page.min(frontier_page).saturating_sub(first_page);
                if pages > 0 {
                    reads.push((block, first_page, pages));
                }
            }
            self.gc = Some(GcRun {
                class: class as u8,
                blocks,
                reads_in_flight: reads.len(),
                found: Vec::new(),
                candidates: reads.is_empty().then(|| Vec::new().into_iter()),
            });
            for (block, first_page, pages) in reads {
                self.io.queue(
                    IoKind::Read,
                    fid,
                    first_page * PAGE_BYTES as u64,
                    AlignedBuf::zeroed(pages as usize * PAGE_BYTES),
                    IoPurpose::GcRead(GcRead { class: class as u8, block, first_page }),
                );
            }
            return;
        }
    }

    /// A victim was read: list what lives in it.
    pub(super) fn gc_read_done(&mut self, read: GcRead, completion: IoCompletion) {
        let GcRead { class, block, first_page } = read;
        let Some(run) = self.gc.as_mut() else { return };
        assert!(run.class == class && run.blocks.contains(&block));
        let mut candidates = Vec::new();
        match completion.result {
            Err(err) => {
                tracing::warn!(shard = self.shard_id, class, block, %err, "reading a collection victim failed; the block stays");
            }
            Ok(()) => {
                let info = SizeClass::get(class);
                let layout = self.slabs.layout_of(class);
                let slot_bytes = info.slot_bytes as usize;
                self.append[class as usize].as_mut().expect("append").figures.gc_bytes_read +=
                    completion.buf.len() as u64;
                for (index, page) in completion.buf.chunks_exact(PAGE_BYTES).enumerate() {
                    let first_slot = info.first_slot_of_page(first_page + index as u64);
                    for in_page in 0..info.slots_per_page as usize {
                        let slot = first_slot + in_page as u64;
                        let loc = Loc::new(class, slot, 0);
                        let bytes = &page[in_page * slot_bytes..(in_page + 1) * slot_bytes];
                        let Ok(Slot::Record { header, key, value }) =
                            decode_slot(bytes, layout, self.shard_id, loc, slot_bytes)
                        else {
                            continue;
                        };
                        let tombstone = match header.kind {
                            RecordKind::Put => false,
                            RecordKind::Tombstone => true,
                            _ => continue,
                        };
                        if self.gc_still_live(loc, key, header.seq, tombstone) {
                            candidates.push(Candidate {
                                slot,
                                key: key.into(),
                                value: value.to_vec(),
                                seq: header.seq,
                                tombstone,
                            });
                        }
                    }
                }
            }
        }
        let run = self.gc.as_mut().expect("running");
        run.found.extend(candidates);
        run.reads_in_flight -= 1;
        if run.reads_in_flight == 0 {
            run.candidates = Some(std::mem::take(&mut run.found).into_iter());
        }
    }

    /// Whether the record `seq` of `key` at `loc` is still what the index (or the tombstone
    /// guard of its key) holds.
    fn gc_still_live(&self, loc: Loc, key: &[u8], seq: u64, tombstone: bool) -> bool {
        if tombstone {
            self.seqs.guards_at(loc, key)
        } else {
            self.index.entry(key).is_some_and(|entry| entry.loc == loc && entry.seq == seq)
        }
    }

    /// Rewrites one live record of the victim into the open block.
    fn gc_move(&mut self, class: u8, candidate: Candidate) -> Result<(), WriteError> {
        let Candidate { slot, key, value, seq, tombstone } = candidate;
        let from = Loc::new(class, slot, 0);
        if !self.gc_still_live(from, &key, seq, tombstone) {
            return Ok(());
        }
        let (new_slot, overwritten) = self.allocate(SizeClass::get(class), None)?;
        let loc = Loc::new(class, new_slot, 0);
        let bytes = super::format::record_bytes(key.len(), value.len()) as u64;
        self.seqs.flight_begin(&key);
        let write = self.writes.add(
            loc,
            overwritten,
            Effect::Moved { key: key.clone(), seq, from, tombstone, bytes },
        );
        let watermark = self.seqs.durable_watermark();
        let kind = if tombstone { RecordKind::Tombstone } else { RecordKind::Put };
        self.place(write, loc, kind, seq, watermark, &key, &value);
        self.gc_moves_in_flight += 1;
        Ok(())
    }

    /// A move is durable: the record now lives at `loc`, unless a newer write won meanwhile.
    pub(super) fn gc_moved(
        &mut self,
        key: &[u8],
        seq: u64,
        from: Loc,
        to: Loc,
        tombstone: bool,
        bytes: u64,
    ) {
        self.gc_moves_in_flight -= 1;
        // Not `applied`: whether the copy is live is the index's word (below), not the flight's.
        self.seqs.flight_end(key, seq, false);
        let hash = key_hash(key);
        // A put left behind is a stale copy of its key until its slot is written again.
        let tag = (!tombstone).then_some(hash);
        if !self.gc_still_live(from, key, seq, tombstone) {
            // The copy must stay below something newer of its key: the key's live record, a
            // tombstone kept for it, or a write of it still in flight.
            let covered = tombstone
                || self.is_poisoned()
                || self.index.contains(key)
                || self.seqs.in_flight(key)
                || self.seqs.guards_key(key);
            assert!(
                covered,
                "shard {}: the collector's copy of a deleted key at {to:?} outlived the key's \
                 tombstone (it would bring the key back at the next open)",
                self.shard_id
            );
            self.release_slot(to, tag, false);
        } else if tombstone {
            self.seqs.move_guard(key, from, to);
            self.release_slot(from, tag, false);
        } else {
            let old = self.index.insert(key, to, seq);
            // A move carries the live record as it is: same seq, from where the index pointed.
            assert!(
                old.is_some_and(|old| old.seq == seq && old.loc == from),
                "shard {}: the collector moved seq {seq} of a key from {from:?} to {to:?}, but the                  index held {old:?}",
                self.shard_id
            );
            self.release_slot(from, tag, false);
        }
        let figures = &mut self.append[to.class() as usize].as_mut().expect("append").figures;
        figures.gc_slots_moved += 1;
        figures.gc_bytes_moved += bytes;
        // The move's flight has ended: tombstones kept for it may go now.
        self.release_guards(hash);
    }

    /// A move's write failed (the store is poisoned): nothing moved.
    pub(super) fn gc_move_failed(&mut self, key: &[u8], seq: u64) {
        self.gc_moves_in_flight -= 1;
        self.seqs.flight_end(key, seq, false);
        self.release_guards(key_hash(key));
    }

    fn gc_finish(&mut self) {
        let Some(run) = self.gc.take() else { return };
        if let Some(append) = self.append[run.class as usize].as_mut() {
            for block in run.blocks {
                append.collection_ended(block);
            }
        }
    }

    /// Whether collection has work now (a collection under way, or a class over its ceiling with
    /// a victim to offer when last asked). Only a collection under way keeps an idle shard
    /// turning rounds: more start with the rounds that write (which are what use space), or
    /// when a settle waits for the collector to rest.
    pub(super) fn gc_busy(&self) -> bool {
        self.gc.is_some() || self.gc_wanted
    }

    /// A settle waits for the collector to rest, then for a flush.
    pub(super) fn settle(&mut self, reply: Reply<(), WriteError>) {
        if self.is_poisoned() {
            let _ = reply.send(Err(WriteError::Poisoned));
        } else {
            self.writes.wait_to_settle(reply);
        }
    }

    /// Hands the settles to the flush waiters once the collector rests.
    pub(super) fn settle_step(&mut self) {
        if !self.writes.has_settle_waiters() || self.gc_busy() {
            return;
        }
        self.writes.settles_to_flush();
    }
}
