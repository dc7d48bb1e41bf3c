//! Writes: what the engine tracks of each write until it is durable (`Writes`: the pending
//! writes, the flushes they wait for, and who waits for a flush or a settle), and the engine's
//! write operations: placing records out of place, page write coalescing, and applying durable
//! writes to the index. Allocation and freeing of slots are in `slabs.rs`.
//!
//! A write's life: allocate a free slot (beside the key's old copy when that page has one) →
//! encode the record into the page image (reading the page first if it is not cached) → the page
//! joins the round's writes (at most one write per page in flight; later modifications wait for
//! the next) → durable → applied: the index points at the new slot and the old slot is freed,
//! or, if a newer write of the key was applied first, the new slot itself is freed.
//!
//! Invariants:
//! - Write ids are handed out once, in increasing order; a write is pending from `Writes::add`
//!   until it is durable or failed, and its completion is recorded once (asserted in
//!   `Writes::completed`).
//! - A write is applied and answered only once durable (invariant 2 of `mod.rs`): its
//!   completion was reaped before a flush that has finished began (asserted in
//!   `write_durable` against the device's own counts).
//! - A record is never encoded over a live one (invariant 1): in a page image, not over bytes
//!   that name a key the index points to at that slot, or a tombstone kept there (asserted in
//!   `place_in_page`, before the image changes; one index lookup, no checksum computed), which
//!   covers its own key's live slot too; a multi-page record, whose slot's old bytes are not in
//!   memory, not into the slot the index points to for its own key (asserted in `place`).
//! - A page write carries exactly the writes whose records lie in its pages (asserted in
//!   `write_pages`, before the write is queued), so a write is acknowledged only when the pages
//!   holding its record are durable.
//! - A flush waiter registered when the next write id was N is answered only once no write
//!   below N is pending, and after one more flush; a settle waiter becomes a flush waiter once
//!   the collector rests.

use std::collections::BTreeMap;

use super::format::{
    encode_record, peek_header, record_bytes, Loc, RecordKind, RecordLayout, SizeClass,
    RECORD_HEADER_BYTES,
};
use super::pages::PageWaiter;
use super::seqs::key_hash;
use super::{IoPurpose, Key, NativeEngine, PageKey, WriteId};
use crate::device::{AlignedBuf, DeviceError, FaultPoint, IoKind, WriteDurability};
use crate::engine::Reply;
use crate::error::WriteError;
use crate::limits::{FLUSHES_IN_FLIGHT_MAX, WRITES_HELD_BEHIND_FLUSH_MAX};
use crate::limits::PAGE_BYTES;

/// Who is waiting for a write, and what it does once durable.
pub(super) enum Origin {
    Put(Reply<(), WriteError>),
    Delete(Reply<bool, WriteError>),
    /// A member of a write batch (applied with the whole batch).
    Batch(u64),
}

/// What a write does once durable.
pub(super) enum Effect {
    Put {
        key: Key,
        seq: u64,
        origin: Origin,
    },
    Tombstone {
        key: Key,
        seq: u64,
        origin: Origin,
    },
    BatchRecord {
        batch: u64,
    },
    /// A free record: the slot joins the in-memory free set, or chain `chain` once durable.
    /// `retires`: the sequence number of a torn record this erases (see `Seqs::unfinished_seqs`).
    Erase {
        chain: Option<usize>,
        retires: Option<u64>,
    },
    /// The watermark record of a clean close: nothing to do once durable.
    Watermark,
    /// The free record over a finished batch record or a forgotten part's record.
    RecordErased {
        owner: ErasedRecord,
        chain: Option<usize>,
    },
    /// A prepared Part record (`parts.rs`): the part is durable once this is.
    PartPrepared {
        gsn: u64,
        seq: u64,
    },
    /// The collector's copy of a live record from `from` (`gc.rs`), or a clustering move
    /// (`cluster.rs`); `bytes`: the record's size.
    Moved {
        key: Key,
        seq: u64,
        from: Loc,
        tombstone: bool,
        bytes: u64,
        cause: MoveCause,
    },
}

/// Why a record moves, for the figures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum MoveCause {
    /// The collector empties its block.
    Collect,
    /// A scan found it far from its neighbours (`cluster.rs`).
    Cluster,
}

/// Whose record a free record erases, to be told once the erasure is durable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum ErasedRecord {
    /// Releases the batch's keys.
    Batch(u64),
    /// Erases the part's next record, or finishes forgetting it.
    Part(u64),
}

/// A write from `Writes::add` until it is durable (or failed).
pub(super) struct PendingWrite {
    /// Once its I/O completed: the device's `write_completions_reaped` after the reap that
    /// returned it (at or past the write's own number). It may be acknowledged only once the
    /// device's `write_completions_durable` has reached this.
    reaped_through: Option<u64>,
    /// Page writes still to complete before the write's I/O is done: a record of a packed slot
    /// that crosses a page boundary rides the writes of both its pages, which may go out in
    /// different I/Os (one page may have a write in flight when the other is written).
    page_writes_left: u8,
    loc: Loc,
    /// Stale key hash of what the slot held before; released once this write is durable.
    overwritten: Option<u64>,
    effect: Effect,
}

impl Origin {
    /// Answers the writer of a put or a delete (`existed`: whether the delete removed an item).
    pub(super) fn answer(self, result: Result<(), WriteError>, existed: bool) {
        match self {
            Origin::Put(reply) => {
                let _ = reply.send(result);
            }
            Origin::Delete(reply) => {
                let _ = reply.send(result.map(|()| existed));
            }
            Origin::Batch(_) => unreachable!("batch members are answered with their batch"),
        }
    }
}

/// The writes the engine tracks until durable, and who waits for flushes and settles.
pub(super) struct Writes {
    pending: BTreeMap<WriteId, PendingWrite>,
    next_id: WriteId,
    /// FlushPerRound: writes completed this round, durable after the round's flush.
    awaiting_flush: Vec<WriteId>,
    /// Flushes waiting for every write below their id to be durable (or failed).
    flush_waiters: Vec<(WriteId, Reply<(), WriteError>)>,
    /// Settles waiting for the collector to rest (then they wait like flushes).
    settle_waiters: Vec<Reply<(), WriteError>>,
}

impl Writes {
    pub(super) fn new() -> Writes {
        Writes {
            pending: BTreeMap::new(),
            next_id: 1,
            awaiting_flush: Vec::new(),
            flush_waiters: Vec::new(),
            settle_waiters: Vec::new(),
        }
    }

    /// A new write of a record at `loc`; `overwritten`: the stale key hash of what the slot
    /// held, released once this write is durable.
    pub(super) fn add(&mut self, loc: Loc, overwritten: Option<u64>, effect: Effect) -> WriteId {
        let id = self.next_id;
        self.next_id += 1;
        self.pending.insert(
            id,
            PendingWrite { reaped_through: None, page_writes_left: 0, loc, overwritten, effect },
        );
        id
    }

    /// The record of `write` was placed in a page image: the write now also rides that page's
    /// next write.
    pub(super) fn rides_page_write(&mut self, write: WriteId) {
        let pending = self.pending.get_mut(&write).expect("a placed write is pending");
        pending.page_writes_left += 1;
    }

    /// A page write that `writes` rode completed (a write listed once per page it has in the
    /// I/O): the writes whose every page write has now completed, each once. A write that
    /// already failed is not among them.
    pub(super) fn page_writes_done(&mut self, writes: Vec<WriteId>) -> Vec<WriteId> {
        let mut done = Vec::with_capacity(writes.len());
        for write in writes {
            let Some(pending) = self.pending.get_mut(&write) else { continue };
            assert!(pending.page_writes_left > 0, "write {write} rode more page writes than it had");
            pending.page_writes_left -= 1;
            if pending.page_writes_left == 0 {
                done.push(write);
            }
        }
        done
    }

    /// Where a pending write puts its record.
    pub(super) fn loc_of(&self, write: WriteId) -> Loc {
        self.pending[&write].loc
    }

    /// Takes a write that is durable or failed (`None` if it already failed).
    pub(super) fn take(&mut self, write: WriteId) -> Option<PendingWrite> {
        self.pending.remove(&write)
    }

    /// The I/O of `writes` completed, reaped with the device's `write_completions_reaped` at
    /// `reaped_through`.
    pub(super) fn completed(&mut self, writes: &[WriteId], reaped_through: u64) {
        for write in writes {
            if let Some(pending) = self.pending.get_mut(write) {
                assert!(pending.reaped_through.is_none(), "write {write} completed twice");
                pending.reaped_through = Some(reaped_through);
            }
        }
    }

    pub(super) fn await_flush(&mut self, writes: Vec<WriteId>) {
        self.awaiting_flush.extend(writes);
    }

    pub(super) fn take_awaiting_flush(&mut self) -> Vec<WriteId> {
        std::mem::take(&mut self.awaiting_flush)
    }

    /// A flush waits for every write handed out so far.
    pub(super) fn wait_for_flush(&mut self, reply: Reply<(), WriteError>) {
        self.flush_waiters.push((self.next_id, reply));
    }

    /// Takes the flush waiters no pending write is older than.
    pub(super) fn take_ready_flush_waiters(&mut self) -> Vec<Reply<(), WriteError>> {
        if self.flush_waiters.is_empty() {
            return Vec::new();
        }
        let oldest = self.pending.keys().next().copied().unwrap_or(WriteId::MAX);
        let (ready, waiting) = std::mem::take(&mut self.flush_waiters)
            .into_iter()
            .partition(|(watermark, _)| oldest >= *watermark);
        self.flush_waiters = waiting;
        ready.into_iter().map(|(_, reply)| reply).collect()
    }

    pub(super) fn wait_to_settle(&mut self, reply: Reply<(), WriteError>) {
        self.settle_waiters.push(reply);
    }

    pub(super) fn has_settle_waiters(&self) -> bool {
        !self.settle_waiters.is_empty()
    }

    /// The collector rests: the settles wait for a flush now.
    pub(super) fn settles_to_flush(&mut self) {
        for reply in std::mem::take(&mut self.settle_waiters) {
            self.flush_waiters.push((self.next_id, reply));
        }
    }

    /// Nothing waits for a flush or a settle.
    pub(super) fn is_quiet(&self) -> bool {
        self.awaiting_flush.is_empty()
            && self.flush_waiters.is_empty()
            && self.settle_waiters.is_empty()
    }
}

impl NativeEngine {
    pub(super) fn put(&mut self, key: Vec<u8>, value: Vec<u8>, origin: Origin, seq: Option<u64>) {
        self.write_record(key, value, origin, seq, RecordKind::Put, None);
    }

    pub(super) fn delete(&mut self, key: Vec<u8>, reply: Reply<bool, WriteError>) {
        if self.is_poisoned() {
            let _ = reply.send(Err(WriteError::Poisoned));
            return;
        }
        // Nothing durable and nothing in flight: there is nothing a tombstone could hide.
        if !self.index.contains(&key) && !self.seqs.in_flight(&key) {
            let _ = reply.send(Ok(false));
            return;
        }
        self.write_record(
            key,
            Vec::new(),
            Origin::Delete(reply),
            None,
            RecordKind::Tombstone,
            None,
        );
    }

    /// Writes a put or a tombstone for `key` into a free slot (or into `slot`, allocated
    /// beforehand by a batch).
    pub(super) fn write_record(
        &mut self,
        key: Vec<u8>,
        value: Vec<u8>,
        origin: Origin,
        seq: Option<u64>,
        kind: RecordKind,
        slot: Option<(Loc, Option<u64>)>,
    ) {
        if self.is_poisoned() {
            match origin {
                Origin::Batch(batch) => self.batch_member_failed(batch, WriteError::Poisoned),
                origin => origin.answer(Err(WriteError::Poisoned), false),
            }
            return;
        }
        let (loc, overwritten) = match slot {
            Some(slot) => slot,
            None => match self.allocate_for(&key, value.len()) {
                Ok(allocation) => allocation,
                Err(err) => {
                    origin.answer(Err(err), false);
                    return;
                }
            },
        };
        // A batch member shares (and is held by) its batch's sequence number.
        let seq = seq.unwrap_or_else(|| {
            let seq = self.seqs.take();
            self.seqs.hold(seq);
            seq
        });
        self.slabs.count_user_write(loc.class(), (key.len() + value.len()) as u64);
        let key: Box<[u8]> = key.into();
        if !matches!(origin, Origin::Batch(_)) {
            // A batch registered its keys when it took its sequence number.
            self.seqs.flight_begin(&key);
        }
        let write = self.writes.add(
            loc,
            overwritten,
            match kind {
                RecordKind::Put => Effect::Put { key: key.clone(), seq, origin },
                _ => Effect::Tombstone { key: key.clone(), seq, origin },
            },
        );
        let watermark = self.seqs.durable_watermark();
        self.place(write, loc, kind, seq, watermark, &key, &value);
    }

    /// Encodes a record into its slot: straight into an I/O buffer for multi-page classes,
    /// into the page image for in-page classes.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn place(
        &mut self,
        write: WriteId,
        loc: Loc,
        kind: RecordKind,
        seq: u64,
        aux: u64,
        key: &[u8],
        value: &[u8],
    ) {
        let class = SizeClass::get(loc.class());
        let bytes = record_bytes(key.len(), value.len());
        let layout = self.slabs.layout_of(loc.class());
        if class.is_multi_page() {
            // Invariant 1: a new version never goes into the slot of its key's live record. (An
            // in-page record is checked in `place_in_page`, against the slot's old bytes, which
            // covers this case too: one index lookup per record, not two.)
            assert!(
                key.is_empty()
                    || self.index.get(key).is_none_or(|live| live.slot_only() != loc.slot_only()),
                "shard {}: a {kind:?} record of a key was placed over the key's live record at \
                 {loc:?}",
                self.shard_id
            );
            let pages = loc.pages_used().max(1) as usize;
            assert!(bytes <= pages * PAGE_BYTES);
            let mut buf = AlignedBuf::zeroed(pages * PAGE_BYTES);
            encode_record(&mut buf, layout, self.shard_id, loc, kind, seq, aux, key, value);
            self.slabs.count_device_write(loc.class(), buf.len() as u64);
            let (file, offset) = self.slabs.slot_position(loc);
            self.io.queue(IoKind::Write, file, offset, buf, IoPurpose::DirectWrite(write));
        } else {
            let mut record = std::mem::take(&mut self.record_scratch);
            record.clear();
            record.resize(bytes, 0);
            encode_record(&mut record, layout, self.shard_id, loc, kind, seq, aux, key, value);
            self.place_in_pages(record, write);
        }
    }

    /// Copies an encoded record into the cached images of its in-page slot's pages (one, or
    /// two for a packed slot crossing a page boundary), reading first any page whose image is
    /// not known; the pages join the next round's writes.
    pub(super) fn place_in_pages(&mut self, record: Vec<u8>, write: WriteId) {
        let loc = self.writes.loc_of(write);
        let class = SizeClass::get(loc.class());
        let span = class.span(loc.slot());
        let mut missing = false;
        // Pages found are pinned until the record is in them: a page imaged as zeros for the
        // slot's second page must not evict its first.
        // An in-page slot spans one page or two: pinned pages fit in place, no allocation.
        assert!(span.pages <= 2, "an in-page slot spans {} pages", span.pages);
        let mut pinned: [Option<PageKey>; 2] = [None; 2];
        for (index, number) in span.page_numbers().enumerate() {
            let page = (loc.class(), number);
            // A page of the open block that gets a record is no longer fresh, however its image
            // is found (cached, being read, or zeros): once it may be written, a later miss
            // must read it back. (Moving the start only on a miss let a page imaged from the
            // cache be zeroed after its eviction, wiping a live record: simulator seed 9188.)
            let fresh = self.slabs.open_file(page.0).take_fresh(number);
            if !self.pages.cache.contains(page) {
                if self.pages.is_loading(page)
                    || !self.slabs.open_file(page.0).image_is_zeros(number, fresh)
                {
                    missing = true;
                    continue;
                }
                // Never written, or in the part of an open block nothing was written to since
                // it was opened: its image is zeros, no read needed.
                self.pages.cache.insert(page, &[0u8; PAGE_BYTES]);
            }
            self.pages.cache.pin(page);
            pinned[index] = Some(page);
        }
        if missing {
            for page in pinned.into_iter().flatten() {
                self.pages.cache.unpin(page);
            }
            self.wait_slot(loc, PageWaiter::Place { write, record });
            return;
        }
        let slot_bytes = class.slot_bytes as usize;
        assert!(record.len() <= slot_bytes);
        let old = self.pages.slot_image(loc).expect("every page of the slot is cached");
        self.assert_not_live(loc, &old, "a record was placed over");
        let mut written = 0;
        for (index, number) in span.page_numbers().enumerate() {
            let page = (loc.class(), number);
            let start = if index == 0 { span.offset } else { 0 };
            let len = (PAGE_BYTES - start).min(slot_bytes - written);
            let image = self.pages.cache.image_mut(page).expect("checked above");
            let part = &mut image[start..start + len];
            let rest = record.get(written..).unwrap_or_default();
            let from_record = rest.len().min(len);
            part[..from_record].copy_from_slice(&rest[..from_record]);
            // Clear the rest of the slot so a shorter record leaves no stale tail behind it.
            part[from_record..].fill(0);
            written += len;
            self.pages.mark_dirty(page, write);
            self.writes.rides_page_write(write);
        }
        assert_eq!(written, slot_bytes);
        for page in pinned.into_iter().flatten() {
            self.pages.cache.unpin(page);
        }
        // The buffer serves the next record.
        self.record_scratch = record;
    }

    /// Invariant 1, checked where a record is about to be encoded over the bytes `old` of the
    /// in-page slot `loc` (and where the collector skips a slot as dead): they are not the live
    /// record of the key they name (the index points there), nor a tombstone kept there. A
    /// violation is a bug that would lose an item; `what` says what was about to happen.
    ///
    /// The index half of the check costs one index lookup per record written (6% of a shard's
    /// CPU under a SET load, docs/benchmarks.md), so it runs in debug builds and in every build
    /// with the `testing` feature (all tests, the simulator, the torture campaigns), not in a
    /// production build; the tombstone half is one hash probe and always runs.
    pub(super) fn assert_not_live(&self, loc: Loc, old: &[u8], what: &str) {
        let Some((kind, key)) = named_key(old, self.slabs.layout_of(loc.class())) else { return };
        let indexed = cfg!(any(debug_assertions, feature = "testing"))
            && self.index.get(key).is_some_and(|live| live.slot_only() == loc.slot_only());
        let kept = kind == RecordKind::Tombstone && self.seqs.guards_at(loc.slot_only(), key);
        assert!(
            !indexed && !kept,
            "shard {}: {what} the live {kind:?} record of a key at {loc:?} (indexed: {indexed}, \
             a kept tombstone: {kept})",
            self.shard_id
        );
    }

    /// Hands every dirty page without a write in flight to the device (invariant 3), each run
    /// of consecutive pages of a file as one write of up to `WRITE_PAGES_PER_IO_MAX` pages (the
    /// pages an append class fills in a round go out as one sequential I/O).
    pub(super) fn schedule_page_writes(&mut self) {
        if self.pages.is_clean() {
            return;
        }
        // A few writes wait for the flush in flight rather than going out beside it: each
        // device write and flush costs about the same CPU whatever it carries (a doorbell, an
        // interrupt, a kernel worker's wake-up for the fsync), so under many clients each with
        // one request a write and a flush per handful of SETs made CPU, not the device, the
        // limit. The flush in flight counts as I/O in flight, so the loop wakes at its end and
        // the pages go then (docs/durability.md, "Writes held behind a flush").
        if !self.flushing.is_empty() && self.pages.dirty_writes() < WRITES_HELD_BEHIND_FLUSH_MAX {
            return;
        }
        for run in self.pages.writable_runs() {
            self.write_pages(&run);
        }
    }

    /// Writes consecutive dirty pages of one file with one I/O.
    fn write_pages(&mut self, run: &[PageKey]) {
        let mut writes = Vec::new();
        for page in run {
            writes.extend(self.pages.take_dirty(*page));
        }
        if self.is_poisoned() {
            for &page in run {
                self.pages.cache.unpin(page);
            }
            for write in writes {
                self.write_failed(write, WriteError::Poisoned);
            }
            return;
        }
        let first = run[0];
        let pages = first.1..first.1 + run.len() as u64;
        for &write in &writes {
            let loc = self.writes.loc_of(write);
            let span = SizeClass::get(loc.class()).span(loc.slot());
            let page = (loc.class(), span.first_page);
            assert!(
                page.0 == first.0 && span.page_numbers().any(|number| pages.contains(&number)),
                "shard {}: write {write} in page {page:?} rides the write of pages {pages:?} of \
                 class {}",
                self.shard_id,
                first.0
            );
        }
        let buf = if let [page] = run {
            self.pages.write_buffer(*page)
        } else {
            let images: Vec<&[u8]> = run
                .iter()
                .map(|&page| self.pages.cache.image(page).expect("dirty pages are pinned"))
                .collect();
            AlignedBuf::from_pages(&images)
        };
        for &page in run {
            // Invariant 3: at most one write of a page in flight.
            self.pages.begin_write(page);
            self.scrub_page_written(page);
        }
        self.slabs.count_device_write(first.0, buf.len() as u64);
        let file = self.slabs.file_of(first.0);
        self.io.queue(
            IoKind::Write,
            file,
            first.1 * PAGE_BYTES as u64,
            buf,
            IoPurpose::PageWrite { page: first, pages: run.len() as u64, writes },
        );
    }

    /// A write is durable: release what its slot held, then apply its effect.
    pub(super) fn write_durable(&mut self, write: WriteId) {
        let PendingWrite { reaped_through, page_writes_left, loc, overwritten, effect } =
            self.writes.take(write).expect("durable write is pending");
        assert_eq!(page_writes_left, 0, "write {write} at {loc:?} is durable with pages unwritten");
        // Invariant 2, checked at the moment everything below may acknowledge the write: a
        // flush that began after its completion was reaped has finished. (A violation is a bug
        // in the engine or the device; answering would break the durability promise.)
        let covered = self.io.device.write_completions_durable();
        assert!(
            reaped_through.is_some_and(|reaped| reaped <= covered),
            "shard {}: write {write} at {loc:?} would be acknowledged before a flush covered it \
             (its completion reaped through {reaped_through:?}, flushes cover {covered})",
            self.shard_id
        );
        self.release_tag(overwritten);
        match effect {
            Effect::Put { key, seq, origin: Origin::Batch(batch) } => {
                self.batch_member_durable(batch, key, seq, loc, RecordKind::Put)
            }
            Effect::Tombstone { key, seq, origin: Origin::Batch(batch) } => {
                self.batch_member_durable(batch, key, seq, loc, RecordKind::Tombstone)
            }
            Effect::Put { key, seq, origin } => {
                self.seqs.finish(seq);
                self.apply_put(&key, seq, loc);
                origin.answer(Ok(()), false);
            }
            Effect::Tombstone { key, seq, origin } => {
                self.seqs.finish(seq);
                let existed = self.apply_tombstone(&key, seq, loc);
                origin.answer(Ok(()), existed);
            }
            Effect::BatchRecord { batch } => self.batch_record_durable(batch, loc),
            Effect::Watermark => {}
            Effect::Erase { chain, retires } => {
                if let Some(seq) = retires {
                    self.seqs.finish(seq);
                }
                self.erased(loc, chain)
            }
            Effect::RecordErased { owner: ErasedRecord::Batch(batch), chain } => {
                self.batch_erased(batch);
                self.erased(loc, chain);
            }
            Effect::RecordErased { owner: ErasedRecord::Part(gsn), chain } => {
                self.erased(loc, chain);
                self.part_record_erased(gsn);
            }
            Effect::PartPrepared { gsn, seq } => self.part_prepared(gsn, seq, loc),
            Effect::Moved { key, seq, from, tombstone, bytes, cause } => {
                self.gc_moved(&key, seq, from, loc, tombstone, bytes, cause)
            }
        }
    }

    /// A write failed (the store is poisoned by then): answer its origin, forget its flight.
    pub(super) fn write_failed(&mut self, write: WriteId, err: WriteError) {
        let Some(PendingWrite { loc, effect, .. }) = self.writes.take(write) else { return };
        // Unless the store is poisoned (a device write failed: it may have reached the disk),
        // the failure happened before the write was issued, so nothing of it is on disk.
        let nothing_on_disk = !self.is_poisoned();
        match effect {
            Effect::Put { key, seq, origin } | Effect::Tombstone { key, seq, origin } => {
                self.seqs.flight_end(&key, seq, false);
                self.release_guards(key_hash(&key));
                if nothing_on_disk && !matches!(origin, Origin::Batch(_)) {
                    self.seqs.finish(seq);
                }
                match origin {
                    Origin::Batch(batch) => self.batch_member_failed(batch, err),
                    origin => origin.answer(Err(err), false),
                }
            }
            Effect::BatchRecord { batch } => self.batch_member_failed(batch, err),
            Effect::Watermark => {}
            Effect::Erase { chain, .. } => {
                if let Some(chain) = chain {
                    self.slabs.free[loc.class() as usize].abort(chain);
                }
            }
            Effect::RecordErased { owner, chain } => {
                // The batch was applied; only its record stays on disk (replayed harmlessly:
                // nothing older than it can win). Its keys stay held until the next recovery.
                // A part's record stays too, and the next open reports it again.
                match owner {
                    ErasedRecord::Batch(batch) => {
                        self.batches.remove(batch);
                    }
                    ErasedRecord::Part(gsn) => self.part_erase_failed(gsn, err),
                }
                if let Some(chain) = chain {
                    self.slabs.free[loc.class() as usize].abort(chain);
                }
            }
            Effect::PartPrepared { gsn, seq } => {
                if self.part_preparing_a_chain(gsn) && !self.is_poisoned() {
                    // Its sibling records may be in flight or durable: as for a batch's chain
                    // (`batch_member_failed`), the engine stops writing.
                    tracing::error!(shard = self.shard_id, %err, "a record of a part's chain failed");
                    self.poison();
                }
                // Once per part (a chain's other records find it gone), and only when nothing
                // of it can be on disk.
                if !self.is_poisoned() && self.parts.contains_key(&gsn) {
                    self.seqs.finish(seq);
                }
                self.part_prepare_failed(gsn, err);
            }
            Effect::Moved { key, seq, cause, .. } => self.gc_move_failed(&key, seq, cause),
        }
    }

    /// A put of `key` at `loc` is durable: it becomes live unless a newer write already is.
    pub(super) fn apply_put(&mut self, key: &[u8], seq: u64, loc: Loc) {
        let hash = key_hash(key);
        if self.seqs.flight_end(key, seq, true) {
            if let Some(old) = self.index.insert(key, loc, seq) {
                // Invariant 5: only the newest completed write of a key is applied.
                assert!(
                    old.seq < seq,
                    "shard {}: put seq {seq} at {loc:?} replaced a newer or equal seq {} at {:?}",
                    self.shard_id,
                    old.seq,
                    old.loc
                );
                self.release_slot(old.loc.slot_only(), Some(hash), false);
            }
        } else {
            self.release_slot(loc.slot_only(), Some(hash), false);
            if self.seqs.has_guards(hash) {
                // Landed under a tombstone: erase it now, as the delete did the older copies.
                self.erase_stale_copies(hash);
            }
        }
        self.release_guards(hash);
    }

    /// A tombstone of `key` at `loc` is durable. Returns whether a live item was deleted.
    pub(super) fn apply_tombstone(&mut self, key: &[u8], seq: u64, loc: Loc) -> bool {
        if !self.seqs.flight_end(key, seq, true) {
            self.release_slot(loc.slot_only(), None, false);
            self.release_guards(key_hash(key));
            return false;
        }
        let hash = key_hash(key);
        let old = self.index.remove(key);
        if let Some(old) = old {
            self.release_slot(old.slot_only(), Some(hash), false);
        }
        let stale_copies = self.seqs.has_stale(hash);
        // Older writes of the key still in flight will land as stale copies.
        let older_in_flight = self.seqs.in_flight(key);
        if stale_copies || older_in_flight {
            // The tombstone must outlive every older copy of the key on disk. Erase the copies
            // waiting in memory now rather than whenever their slots are reused: a deleted key
            // then leaves nothing behind that a damaged tombstone could let back.
            self.seqs.guard(hash, loc.slot_only(), key.into());
            self.erase_stale_copies(hash);
        } else {
            self.release_slot(loc.slot_only(), None, false);
        }
        old.is_some()
    }

    pub(super) fn writes_completed(
        &mut self,
        writes: Vec<WriteId>,
        result: Result<(), DeviceError>,
    ) {
        let reaped_through = self.io.device.write_completions_reaped();
        self.writes.completed(&writes, reaped_through);
        match result {
            Ok(()) => match self.io.durability {
                WriteDurability::Dsync => self.writes_durable(writes),
                WriteDurability::FlushPerRound => self.writes.await_flush(writes),
            },
            Err(err) => {
                tracing::error!(shard = self.shard_id, %err, "write failed");
                self.poison();
                for write in writes {
                    self.write_failed(write, WriteError::from_device(err.clone()));
                }
            }
        }
    }

    /// FlushPerRound: one flush makes every write that completed this round durable. On a
    /// device that flushes in the background (io_uring) the flush is submitted and the writes
    /// wait for its end, which a later reap brings; up to `FLUSHES_IN_FLIGHT_MAX` are in flight,
    /// so a write completing while one runs starts the next instead of waiting for it to end,
    /// and past that bound the writes wait for the next (group commit while the thread goes on).
    pub(super) fn flush_round(&mut self) {
        if !self.io.device.completes_asynchronously() {
            let writes = self.writes.take_awaiting_flush();
            if !writes.is_empty() {
                let flushed = self.io.device.flush();
                self.flush_ended(writes, flushed);
            }
            return;
        }
        loop {
            while let Some(flushed) = self.io.device.take_flush_done() {
                let writes =
                    self.flushing.pop_front().expect("a background flush ended for no writes");
                self.flush_ended(writes, flushed);
            }
            if self.flushing.len() >= FLUSHES_IN_FLIGHT_MAX {
                return;
            }
            let writes = self.writes.take_awaiting_flush();
            if writes.is_empty() {
                return;
            }
            match self.io.device.submit_flush() {
                // A flush with nothing to sync may have ended already: the loop takes it.
                Ok(()) => self.flushing.push_back(writes),
                Err(err) => {
                    self.flush_ended(writes, Err(err));
                    return;
                }
            }
        }
    }

    /// A flush covering `writes` ended with `flushed`.
    fn flush_ended(&mut self, writes: Vec<WriteId>, flushed: Result<(), DeviceError>) {
        match flushed {
            Ok(()) => self.writes_durable(writes),
            Err(err) => {
                tracing::error!(shard = self.shard_id, %err, "flush failed");
                self.poison();
                for write in writes {
                    self.write_failed(write, WriteError::from_device(err.clone()));
                }
            }
        }
    }

    /// Writes are durable: apply and answer each. A failure at the fault point between the two
    /// is handled like a failed flush, so the writes are answered with the error (recovery may
    /// still find them, as it may find any write in flight at a failure).
    fn writes_durable(&mut self, writes: Vec<WriteId>) {
        if let Err(err) = self.io.device.fault_point(FaultPoint::SlabWrittenBeforeIndexUpdate) {
            tracing::error!(shard = self.shard_id, %err, "failed after writes were durable");
            self.poison();
            for write in writes {
                self.write_failed(write, WriteError::from_device(err.clone()));
            }
            return;
        }
        for write in writes {
            self.write_durable(write);
        }
    }

    pub(super) fn answer_flush_waiters(&mut self) {
        let ready = self.writes.take_ready_flush_waiters();
        if ready.is_empty() {
            return;
        }
        let result = if self.is_poisoned() {
            Err(WriteError::Poisoned)
        } else {
            self.io.device.flush().map_err(|err| {
                self.poison();
                WriteError::from_device(err)
            })
        };
        for reply in ready {
            let _ = reply.send(result.clone());
        }
    }
}

/// The kind and key that a slot's bytes name, unverified (no checksum): what the slot held
/// before a record is encoded over it. `None` for an empty slot or bytes no header parses from.
fn named_key(slot: &[u8], layout: RecordLayout) -> Option<(RecordKind, &[u8])> {
    let header = peek_header(slot, layout)?;
    let key_end = RECORD_HEADER_BYTES + header.key_bytes as usize;
    Some((header.kind, slot.get(RECORD_HEADER_BYTES..key_end)?))
}

#[cfg(test)]
mod tests {
    use futures::channel::oneshot;

    use super::super::format::{SizeClass, CLASS_COUNT};
    use super::super::placement::Placement;
    use super::super::{EngineConfig, NativeEngine};
    use crate::device::uring::{probe, UringDevice};
    use crate::device::WriteDurability;
    use crate::engine::{Request, ShardEngine};
    use crate::limits::WRITES_HELD_BEHIND_FLUSH_MAX;

    /// One shard over io_uring (whose flushes run in the background) in a temporary directory,
    /// appending every in-page class; `None` where io_uring or O_DIRECT is unavailable.
    fn engine_on_uring() -> Option<(tempfile::TempDir, NativeEngine)> {
        if let Err(err) = probe() {
            eprintln!("skipping: {err}");
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        let device = match UringDevice::new(dir.path(), WriteDurability::FlushPerRound, 64) {
            Ok(device) => device,
            Err(err) => {
                eprintln!("skipping: {err}");
                return None;
            }
        };
        let config = EngineConfig {
            shard_id: 0,
            cache_pages: 256,
            io_depth_max: 64,
            slab_growth_bytes_min: 64 * 4096,
            placements: (0..CLASS_COUNT)
                .map(|class| {
                    if SizeClass::get(class as u8).is_placeable() {
                        Placement::Append
                    } else {
                        Placement::InPlace
                    }
                })
                .collect(),
            append_block_pages: 4,
            space_amplification_max: 1.5,
            gc_room_blocks_min: 0,
            batch_record_bytes_max: crate::limits::BATCH_RECORD_BYTES_MAX,
            poisoned: Default::default(),
        };
        match NativeEngine::open(Box::new(device), config, None) {
            Ok(engine) => Some((dir, engine)),
            Err(err) => {
                eprintln!("skipping: O_DIRECT unavailable in the temp dir? {err}");
                None
            }
        }
    }

    type Answer = oneshot::Receiver<Result<(), crate::error::WriteError>>;

    fn put(engine: &mut NativeEngine, key: String, answers: &mut Vec<Answer>) {
        let (reply, answer) = oneshot::channel();
        engine.handle_run(vec![Request::Put { key: key.into_bytes(), value: vec![7; 100], reply }]);
        answers.push(answer);
    }

    /// A first write goes out at once, and its flush is submitted once it completes.
    fn first_write_flushing(engine: &mut NativeEngine, answers: &mut Vec<Answer>) {
        put(engine, "first".into(), answers);
        engine.end_round();
        assert!(engine.pages.is_clean(), "nothing in flight: the first write goes at once");
        while engine.flushing.is_empty() {
            engine.reap(true);
        }
    }

    fn settle(engine: &mut NativeEngine, answers: Vec<Answer>) {
        while !engine.is_idle() {
            engine.end_round();
            engine.reap(true);
        }
        for mut answer in answers {
            let outcome = answer.try_recv().expect("the sender is kept until answered");
            assert!(matches!(outcome, Some(Ok(()))), "every write answered Ok: {outcome:?}");
        }
    }

    /// Under many clients with one request each, a device write and a flush per handful of
    /// writes made CPU the limit: a few writes arriving while a flush runs wait for it, and go
    /// together when it ends (checked: with the hold removed, the pages go at once).
    #[test]
    fn a_few_writes_wait_for_the_flush_in_flight_and_go_when_it_ends() {
        let Some((_dir, mut engine)) = engine_on_uring() else { return };
        let mut answers = Vec::new();
        first_write_flushing(&mut engine, &mut answers);
        let writes_before = engine.io.device.stats().writes;
        for number in 0..3 {
            put(&mut engine, format!("held-{number}"), &mut answers);
        }
        engine.end_round();
        assert_eq!(engine.pages.dirty_writes(), 3, "the three writes wait in their page");
        assert_eq!(engine.io.device.stats().writes, writes_before, "no write beside the flush");
        while !engine.flushing.is_empty() {
            engine.reap(true);
        }
        engine.end_round();
        assert!(engine.pages.is_clean(), "the flush ended: the held page went");
        settle(&mut engine, answers);
        // (The device counts a write when it completes.)
        assert_eq!(engine.io.device.stats().writes, writes_before + 1, "one write for the three");
    }

    /// Past `WRITES_HELD_BEHIND_FLUSH_MAX`, a group is large enough to pay for its own write:
    /// it goes beside the flush in flight, so that the device is not left idle under load.
    #[test]
    fn a_large_group_goes_beside_the_flush_in_flight() {
        let Some((_dir, mut engine)) = engine_on_uring() else { return };
        let mut answers = Vec::new();
        first_write_flushing(&mut engine, &mut answers);
        for number in 0..WRITES_HELD_BEHIND_FLUSH_MAX {
            put(&mut engine, format!("group-{number:04}"), &mut answers);
        }
        engine.end_round();
        assert!(!engine.flushing.is_empty(), "the first flush is still in flight");
        assert!(engine.pages.is_clean(), "a full group is written at once");
        settle(&mut engine, answers);
    }
}
