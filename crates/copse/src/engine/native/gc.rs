//! The garbage collector of append placement (RStore §3.3): empties the block with the most dead
//! slots by rewriting its live records through the normal append path. `Collector` holds the
//! placement of each class, the block accounting of each append class (`AppendClass`, whose
//! block accounting and victim heap are in `placement.rs`) and the collection under way; the
//! engine's collection steps follow (`impl NativeEngine`). The guide is docs/placement.md.
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
//!   so foreground requests of the round are never queued behind a whole block. A collection
//!   ends only once none of its moves is in flight (`moves_in_flight` never goes below zero:
//!   asserted in `Collector::move_ended`).
//! - Nothing runs while the store is poisoned.

use super::format::{decode_slot, Loc, RecordKind, SizeClass, Slot, CLASS_COUNT};
use super::index::Entry;
use super::placement::{AppendClass, Placement};
use super::seqs::key_hash;
use super::slabs::Appender;
use super::write::{Effect, MoveCause};
use super::{IoPurpose, NativeEngine};
use crate::device::{AlignedBuf, IoCompletion, IoKind};
use crate::engine::Reply;
use crate::error::WriteError;
use crate::limits::{
    GC_FREE_PER_APPENDED, GC_MOVES_PER_APPENDED_SLOT, GC_MOVES_PER_ROUND_MAX,
    GC_MOVES_PER_ROUND_MIN, GC_READ_BUFFERS_KEPT, GC_VICTIMS_PER_RUN_MAX, PAGE_BYTES,
};

/// A record to move: out of a victim, or beside its neighbours (`cluster.rs`).
pub(super) struct Candidate {
    slot: u64,
    key: Box<[u8]>,
    value: Vec<u8>,
    seq: u64,
    tombstone: bool,
}

impl Candidate {
    /// The put of `key` at `seq` in `slot`, whose value is `value`.
    pub(super) fn put(slot: u64, key: Box<[u8]>, value: Vec<u8>, seq: u64) -> Candidate {
        Candidate { slot, key, value, seq, tombstone: false }
    }

    pub(super) fn key(&self) -> &[u8] {
        &self.key
    }
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

/// Where each class puts new records, and the collector of the append classes.
pub(super) struct Collector {
    /// The placement of each class (fixed at the store's creation).
    placements: Vec<Placement>,
    /// Pages per block of an append class.
    block_pages: u32,
    /// The collector keeps an append class's file under this many times its live slots.
    space_amplification_max: f64,
    /// `EngineConfig::gc_room_blocks_min`.
    room_blocks_min: u64,
    /// Block accounting of each class in append placement (once its file is open).
    append: Vec<Option<AppendClass>>,
    /// The collection under way, if any.
    run: Option<GcRun>,
    /// Moves of the collection written and not yet durable (or failed).
    moves_in_flight: usize,
    /// A class wanted a collection when last asked (so the shard keeps turning rounds).
    wanted: bool,
    /// Slots appended this round (the collector's budget grows with them).
    appended_this_round: usize,
    /// Buffers of victim reads done, for the next ones (at most `GC_READ_BUFFERS_KEPT`). A
    /// read fills its buffer whole or fails (a short read is an error), so what an earlier
    /// victim left in it is never taken for this one's records.
    read_buffers: Vec<AlignedBuf>,
}

impl Collector {
    pub(super) fn new(
        placements: Vec<Placement>,
        block_pages: u32,
        space_amplification_max: f64,
        room_blocks_min: u64,
    ) -> Collector {
        assert_eq!(placements.len(), CLASS_COUNT);
        Collector {
            placements,
            block_pages: block_pages.max(1),
            space_amplification_max,
            room_blocks_min,
            append: (0..CLASS_COUNT).map(|_| None).collect(),
            run: None,
            moves_in_flight: 0,
            wanted: false,
            appended_this_round: 0,
            read_buffers: Vec::new(),
        }
    }

    /// A buffer for a victim read of `len_bytes`: a kept one of that length, else a new one.
    fn read_buffer(&mut self, len_bytes: usize) -> AlignedBuf {
        match self.read_buffers.iter().position(|buf| buf.len() == len_bytes) {
            Some(at) => self.read_buffers.swap_remove(at),
            None => AlignedBuf::zeroed(len_bytes),
        }
    }

    /// A victim read's buffer is free again.
    fn keep_read_buffer(&mut self, buf: AlignedBuf) {
        if self.read_buffers.len() < GC_READ_BUFFERS_KEPT {
            self.read_buffers.push(buf);
        }
    }

    pub(super) fn placement(&self, class: u8) -> Placement {
        self.placements[class as usize]
    }

    /// Sets up the block accounting of a class in append placement whose file holds
    /// `file_bytes`, of which the slots below `frontier` were handed out at some time.
    pub(super) fn open_class(&mut self, class: SizeClass, file_bytes: u64, frontier: u64) {
        if self.placements[class.id as usize] == Placement::Append && !class.is_multi_page() {
            self.append[class.id as usize] = Some(AppendClass::new(
                class,
                self.block_pages,
                class.slots_in_file(file_bytes),
                frontier,
            ));
        }
    }

    /// The block accounting of a class, if it is appended (and its file is open).
    pub(super) fn append(&self, class: u8) -> Option<&AppendClass> {
        self.append[class as usize].as_ref()
    }

    pub(super) fn append_mut(&mut self, class: u8) -> Option<&mut AppendClass> {
        self.append[class as usize].as_mut()
    }

    /// A slot was appended this round.
    pub(super) fn count_appended(&mut self) {
        self.appended_this_round += 1;
    }

    /// Whether a collection is under way.
    pub(super) fn collecting(&self) -> bool {
        self.run.is_some()
    }

    /// Whether collection has work now (a collection under way, or a class over its ceiling with
    /// a victim to offer when last asked). Only a collection under way keeps an idle shard
    /// turning rounds: more start with the rounds that write (which are what use space), or
    /// when a settle waits for the collector to rest.
    pub(super) fn busy(&self) -> bool {
        self.run.is_some() || self.wanted
    }

    /// Picks victims in a class that wants a collection, enough to free `GC_FREE_PER_APPENDED`
    /// times what this round appended (`appended`), and at least what the class stands past
    /// the start of collection. Returns the class and its victims. (No block's worth at least:
    /// in a class of a few dozen blocks that took livelier victims than the pace needed, 3.1
    /// moves per SET against 2.4 with 2,048 live 1 KiB records per shard.)
    fn pick_victims(&mut self, appended: usize) -> Option<(u8, Vec<u32>)> {
        self.wanted = false;
        let (ratio, room) = (self.space_amplification_max, self.room_blocks_min);
        for (class, append) in self.append.iter_mut().enumerate() {
            let Some(append) = append.as_mut() else { continue };
            if !append.wants_collection(ratio, room) {
                continue;
            }
            // What this round's pace asks for, and at least what the class stands past the
            // start: a small round may start a collection while a burst is under way.
            let wanted_slots =
                (GC_FREE_PER_APPENDED * appended as u64).max(append.slots_past_start(ratio, room));
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
            self.wanted = true;
            return Some((class as u8, blocks));
        }
        None
    }

    /// The next moves of the collection under way, at most `budget`, with the class and whether
    /// none is left after them; `None` while no collection is listing its moves.
    fn next_moves(&mut self, budget: usize) -> Option<(u8, Vec<Candidate>, bool)> {
        let run = self.run.as_mut()?;
        let class = run.class;
        let candidates = run.candidates.as_mut()?;
        let issued: Vec<Candidate> = candidates.by_ref().take(budget).collect();
        let finished = candidates.len() == 0;
        let append = self.append[class as usize].as_ref().expect("append");
        // A victim may have been freed under the collection (every slot released): then it may
        // be open again, and nothing of it is to move.
        let issued = issued
            .into_iter()
            .filter(|candidate| append.is_collecting(append.block_of(candidate.slot)))
            .collect();
        Some((class, issued, finished))
    }

    /// No slot to move to (the file could not grow): the collection under way moves no more.
    fn stop_moves(&mut self) {
        self.run.as_mut().expect("running").candidates = Some(Vec::new().into_iter());
    }

    /// A move of `cause` was written. Only the collection's own moves hold it open: clustering
    /// moves, which a busy scanner issues every round, would keep it from ever ending.
    fn move_started(&mut self, cause: MoveCause) {
        if cause == MoveCause::Collect {
            self.moves_in_flight += 1;
        }
    }

    fn move_ended(&mut self, cause: MoveCause) {
        if cause != MoveCause::Collect {
            return;
        }
        assert!(self.moves_in_flight > 0, "a collector move ended that was not in flight");
        self.moves_in_flight -= 1;
    }

    /// Ends the collection under way: a victim it could not empty waits until one of its slots
    /// is freed.
    fn finish(&mut self) {
        let Some(run) = self.run.take() else { return };
        if let Some(append) = self.append[run.class as usize].as_mut() {
            for block in run.blocks {
                append.collection_ended(block);
            }
        }
    }
}

impl NativeEngine {
    /// One round's share of collection: start a collection if a class wants one, or issue the
    /// next moves of the one under way. Called at the end of every round.
    pub(super) fn gc_step(&mut self) {
        let appended = std::mem::take(&mut self.collector.appended_this_round);
        if self.is_poisoned() {
            self.collector.run = None;
            self.collector.wanted = false;
            return;
        }
        if self.collector.run.is_none() && !self.closing {
            self.gc_start(appended);
        }
        let budget = (GC_MOVES_PER_ROUND_MIN + GC_MOVES_PER_APPENDED_SLOT * appended)
            .min(GC_MOVES_PER_ROUND_MAX);
        // None: no collection, or still reading the victims.
        let Some((class, issued, finished)) = self.collector.next_moves(budget) else { return };
        for candidate in issued {
            if self.move_record(class, candidate, MoveCause::Collect).is_err() {
                // No slot to move to (the file could not grow): stop this collection.
                self.collector.stop_moves();
                break;
            }
        }
        if finished && self.collector.moves_in_flight == 0 {
            self.collector.finish();
        }
    }

    /// Picks victims (`Collector::pick_victims`): a collection takes a few rounds (read, move,
    /// durable), so it must free more than a round uses. Then starts reading them.
    fn gc_start(&mut self, appended: usize) {
        let Some((class, blocks)) = self.collector.pick_victims(appended) else { return };
        let file = self.slabs.file(class).expect("an append class has a file");
        let (fid, frontier_page) = (file.file, file.frontier_page);
        let append = self.collector.append(class).expect("an append class");
        let mut reads = Vec::new();
        for &block in &blocks {
            let (first_page, end_page) = append.pages_of(block);
            // Pages past the frontier were never written: nothing in them lives. Whole units
            // are read, so every slot the frontier's unit holds is listed.
            let unit_pages = SizeClass::get(class).unit_pages();
            let pages = end_page
                .min(frontier_page)
                .saturating_sub(first_page)
                .next_multiple_of(unit_pages)
                .min(end_page - first_page);
            if pages > 0 {
                reads.push((block, first_page, pages));
            }
        }
        self.collector.run = Some(GcRun {
            class,
            blocks,
            reads_in_flight: reads.len(),
            found: Vec::new(),
            candidates: reads.is_empty().then(|| Vec::new().into_iter()),
        });
        for (block, first_page, pages) in reads {
            let buf = self.collector.read_buffer(pages as usize * PAGE_BYTES);
            self.io.queue(
                IoKind::Read,
                fid,
                first_page * PAGE_BYTES as u64,
                buf,
                IoPurpose::GcRead(GcRead { class, block, first_page }),
            );
        }
    }

    /// A victim was read: list what lives in it.
    pub(super) fn gc_read_done(&mut self, read: GcRead, completion: IoCompletion) {
        let GcRead { class, block, first_page } = read;
        let Some(run) = self.collector.run.as_ref() else { return };
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
                let append = self.collector.append_mut(class).expect("append");
                append.figures.gc_bytes_read += completion.buf.len() as u64;
                // Every record of the victim, then the index's entries of all their keys in one
                // batch (`CompactIndex::entries` overlaps the lookups' cache misses): the
                // liveness check of a whole block, not one lookup after another.
                let mut records = Vec::new();
                // Slots released since the block was filled hold stale copies: skipped before
                // they are decoded or looked up (about half a victim's slots under overwrites).
                let released = append.released_slots(block);
                for (slot, bytes) in info.slots_in_units(first_page, &completion.buf) {
                    let loc = Loc::new(class, slot, 0);
                    if released.contains(slot) {
                        // A released slot is dead (its index half checked in test builds).
                        self.assert_not_live(loc, bytes, "the collector skipped as released");
                        continue;
                    }
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
                    records.push((slot, loc, key, value, header.seq, tombstone));
                }
                let keys: Vec<&[u8]> = records.iter().map(|record| record.2).collect();
                let mut entries = Vec::with_capacity(keys.len());
                self.index.entries(&keys, &mut entries);
                for ((slot, loc, key, value, seq, tombstone), entry) in records.into_iter().zip(entries)
                {
                    if self.gc_live_given(loc, key, seq, tombstone, entry) {
                        candidates.push(Candidate {
                            slot,
                            key: key.into(),
                            value: value.to_vec(),
                            seq,
                            tombstone,
                        });
                    }
                }
            }
        }
        self.collector.keep_read_buffer(completion.buf);
        let run = self.collector.run.as_mut().expect("running");
        run.found.extend(candidates);
        run.reads_in_flight -= 1;
        if run.reads_in_flight == 0 {
            run.candidates = Some(std::mem::take(&mut run.found).into_iter());
        }
    }

    /// Whether the record `seq` of `key` at `loc` is still what the index (or the tombstone
    /// guard of its key) holds.
    fn gc_still_live(&self, loc: Loc, key: &[u8], seq: u64, tombstone: bool) -> bool {
        let entry = if tombstone { None } else { self.index.entry(key) };
        self.gc_live_given(loc, key, seq, tombstone, entry)
    }

    /// `gc_still_live`, given the index's `entry` of `key` (looked up by the caller; unused for
    /// a tombstone).
    fn gc_live_given(
        &self,
        loc: Loc,
        key: &[u8],
        seq: u64,
        tombstone: bool,
        entry: Option<Entry>,
    ) -> bool {
        if tombstone {
            self.seqs.guards_at(loc, key)
        } else {
            entry.is_some_and(|entry| entry.loc == loc && entry.seq == seq)
        }
    }

    /// Rewrites one live record into the open block of its (append) class; nothing if it is no
    /// longer live. Err: no slot (the file could not grow).
    ///
    /// A collection's put is not looked up again here: it was live when its victim was read,
    /// and a put stops being live only when its key is re-pointed or deleted, which releases
    /// its slot. A released slot of a victim still collecting is not reused (`next_moves` drops
    /// the candidates of a victim freed meanwhile), so it still holds the stale copy, counted,
    /// and any tombstone of its key is still kept: the copy lands below something newer, and
    /// `gc_moved`'s own lookup (`replace_if`) finds it dead and frees it. Such a wasted move
    /// needs a write of the key between the victim's read and the move, a few rounds; the saved
    /// lookup is one of about five per overwrite. A clustering candidate has no such guarantee
    /// (its slot may be reused before the move), so it is looked up.
    pub(super) fn move_record(
        &mut self,
        class: u8,
        candidate: Candidate,
        cause: MoveCause,
    ) -> Result<(), WriteError> {
        let Candidate { slot, key, value, seq, tombstone } = candidate;
        let from = Loc::new(class, slot, 0);
        let looked_up = tombstone || cause == MoveCause::Cluster;
        if looked_up && !self.gc_still_live(from, &key, seq, tombstone) {
            return Ok(());
        }
        if cfg!(any(debug_assertions, feature = "testing")) && !looked_up {
            self.assert_released_if_dead(class, slot, &key, seq);
        }
        let (new_slot, overwritten) =
            self.allocate(SizeClass::get(class), None, Appender::Mover)?;
        let loc = Loc::new(class, new_slot, 0);
        let bytes = super::format::record_bytes(key.len(), value.len()) as u64;
        self.seqs.flight_begin(&key);
        let write = self.writes.add(
            loc,
            overwritten,
            Effect::Moved { key: key.clone(), seq, from, tombstone, bytes, cause },
        );
        let watermark = self.seqs.durable_watermark();
        let kind = if tombstone { RecordKind::Tombstone } else { RecordKind::Put };
        self.place(write, loc, kind, seq, watermark, &key, &value);
        self.collector.move_started(cause);
        Ok(())
    }

    /// Test builds: a collection's put moved without a lookup (`move_record`) is either still
    /// live or its slot was released since its victim was read, so that its key's newer record
    /// or kept tombstone covers the copy.
    fn assert_released_if_dead(&self, class: u8, slot: u64, key: &[u8], seq: u64) {
        if self.gc_still_live(Loc::new(class, slot, 0), key, seq, false) {
            return;
        }
        let append = self.collector.append(class).expect("an append class");
        let block = append.block_of(slot);
        assert!(append.is_collecting(block), "a move from a victim no longer collected");
        assert!(
            append.released_slots(block).contains(slot),
            "shard {}: the collector would move a dead put at slot {slot} of class {class} \
             whose slot was never released",
            self.shard_id
        );
    }

    /// A move is durable: the record now lives at `loc`, unless a newer write won meanwhile.
    #[allow(clippy::too_many_arguments)] // the fields of `Effect::Moved`, and where it landed
    pub(super) fn gc_moved(
        &mut self,
        key: &[u8],
        seq: u64,
        from: Loc,
        to: Loc,
        tombstone: bool,
        bytes: u64,
        cause: MoveCause,
    ) {
        self.collector.move_ended(cause);
        // Not `applied`: whether the copy is live is the index's word (below), not the flight's.
        self.seqs.flight_end(key, seq, false);
        let hash = key_hash(key);
        // A put left behind is a stale copy of its key until its slot is written again.
        let tag = (!tombstone).then_some(hash);
        // One index lookup checks the record is still live and points the key at its new slot.
        let live = if tombstone {
            self.seqs.guards_at(from, key)
        } else {
            let expected = Entry { loc: from, seq };
            self.index.replace_if(key, expected, to) == Some(expected)
        };
        if !live {
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
            self.release_slot(from, tag, false);
        }
        let figures = &mut self.collector.append_mut(to.class()).expect("append").figures;
        match cause {
            MoveCause::Collect => {
                figures.gc_slots_moved += 1;
                figures.gc_slots_moved_dead += u64::from(!live);
                figures.gc_bytes_moved += bytes;
            }
            MoveCause::Cluster => {
                figures.cluster_slots_moved += 1;
                figures.cluster_bytes_moved += bytes;
            }
        }
        // The move's flight has ended: tombstones kept for it may go now.
        self.release_guards(hash);
    }

    /// A move's write failed (the store is poisoned): nothing moved.
    pub(super) fn gc_move_failed(&mut self, key: &[u8], seq: u64, cause: MoveCause) {
        self.collector.move_ended(cause);
        self.seqs.flight_end(key, seq, false);
        self.release_guards(key_hash(key));
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
        if !self.writes.has_settle_waiters() || self.collector.busy() {
            return;
        }
        self.writes.settles_to_flush();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only the collection's own moves hold it open: scans that issue clustering moves every
    /// round (cluster.rs) would otherwise keep a collection from ever ending, and with it every
    /// later one, while the file grows past its ceiling.
    #[test]
    fn clustering_moves_in_flight_do_not_hold_a_collection_open() {
        let mut collector = Collector::new(vec![Placement::Append; CLASS_COUNT], 4, 1.5, 0);
        collector.move_started(MoveCause::Collect);
        collector.move_started(MoveCause::Cluster);
        collector.move_started(MoveCause::Cluster);
        assert_eq!(collector.moves_in_flight, 1, "the collection waits for its own move only");
        collector.move_ended(MoveCause::Cluster);
        collector.move_ended(MoveCause::Collect);
        assert_eq!(collector.moves_in_flight, 0, "its move is durable: it may end");
        collector.move_ended(MoveCause::Cluster);
        assert_eq!(collector.moves_in_flight, 0);
    }
}
