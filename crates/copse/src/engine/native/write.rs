//! Writes: placing records out of place, page write coalescing, applying durable writes to the
//! index, and freeing slots (in-memory set, on-disk chains, tombstone guards).
//!
//! A write's life: allocate a free slot (beside the key's old copy when that page has one) →
//! encode the record into the page image (reading the page first if it is not cached) → the page
//! joins the round's writes (at most one write per page in flight; later modifications wait for
//! the next) → durable → applied: the index points at the new slot and the old slot is freed,
//! or, if a newer write of the key was applied first, the new slot itself is freed.

use super::format::{
    encode_record, encode_slab_header, pages_for, record_bytes, Loc, RecordKind, RecordLayout,
    SizeClass, SlabHeader, SLAB_FORMAT_VERSION,
};
use super::pages::{PageWaiter, Pages};
use super::seqs::key_hash;
use super::{
    ClassFile, Effect, ErasedRecord, IoPurpose, NativeEngine, Origin, PageKey, PendingWrite,
    WriteId,
};
use crate::device::{AlignedBuf, FaultPoint, IoKind, IoRequest};
use crate::engine::Reply;
use crate::error::WriteError;
use crate::limits::{PAGE_BYTES, SLAB_GROWTH_DIVISOR};

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
                origin => Self::answer(origin, Err(WriteError::Poisoned), false),
            }
            return;
        }
        let (loc, overwritten) = match slot {
            Some(slot) => slot,
            None => match self.allocate_for(&key, value.len()) {
                Ok(allocation) => allocation,
                Err(err) => {
                    Self::answer(origin, Err(err), false);
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
        self.user_bytes_written[loc.class() as usize] += (key.len() + value.len()) as u64;
        let key: Box<[u8]> = key.into();
        if !matches!(origin, Origin::Batch(_)) {
            // A batch registered its keys when it took its sequence number.
            self.seqs.flight_begin(&key);
        }
        let write = self.new_write(
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

    pub(super) fn new_write(
        &mut self,
        loc: Loc,
        overwritten: Option<u64>,
        effect: Effect,
    ) -> WriteId {
        let id = self.next_write_id;
        self.next_write_id += 1;
        self.writes.insert(id, PendingWrite { reaped_through: None, loc, overwritten, effect });
        id
    }

    /// Allocates the slot for a record of `key` with a value of `value_bytes`.
    pub(super) fn allocate_for(
        &mut self,
        key: &[u8],
        value_bytes: usize,
    ) -> Result<(Loc, Option<u64>), WriteError> {
        let bytes = record_bytes(key.len(), value_bytes);
        let class = SizeClass::for_record(bytes);
        let near = self.index.get(key);
        let (slot, overwritten) = self.allocate(class, near)?;
        let pages = if class.is_multi_page() { pages_for(bytes) } else { 0 };
        Ok((Loc::new(class.id, slot, pages), overwritten))
    }

    /// Finds a slot for a record of `class`. In place: beside `near` if its cached page has a
    /// free slot, else the most recently freed slot, else a new slot at the end of the file
    /// (growing it). Appended: the next slot of the open block. Returns the slot and the stale
    /// key hash of what it held.
    pub(super) fn allocate(
        &mut self,
        class: SizeClass,
        near: Option<Loc>,
    ) -> Result<(u64, Option<u64>), WriteError> {
        self.ensure_class_file(class)?;
        if self.append[class.id as usize].is_some() {
            return self.allocate_appended(class);
        }
        let free = &mut self.free[class.id as usize];
        if let Some(near) = near.filter(|near| near.class() == class.id && !class.is_multi_page()) {
            let page = class.page_of_slot(near.slot());
            if self.pages.cache.contains((class.id, page)) {
                let first = class.first_slot_of_page(page);
                for slot in first..first + class.slots_per_page as u64 {
                    if let Some(tag) = free.take(slot) {
                        return Ok((slot, tag));
                    }
                }
            }
        }
        if let Some(found) = free.pop() {
            return Ok(found);
        }
        let file = self.classes[class.id as usize].as_ref().expect("ensured above");
        let slot = file.next_append_slot;
        self.grow_for_slot(class, slot, slot + 1)?;
        let file = self.classes[class.id as usize].as_mut().expect("ensured above");
        file.next_append_slot += 1;
        Ok((slot, None))
    }

    /// The next slot of the open block of an append class, growing the file to hold its block.
    fn allocate_appended(&mut self, class: SizeClass) -> Result<(u64, Option<u64>), WriteError> {
        let append = self.append[class.id as usize].as_ref().expect("an append class");
        let next = append.peek();
        let block_end_slot = (next.slot / append.slots_per_block() + 1) * append.slots_per_block();
        self.grow_for_slot(class, next.slot, block_end_slot)?;
        let file = self.classes[class.id as usize].as_mut().expect("ensured by the caller");
        let append = self.append[class.id as usize].as_mut().expect("an append class");
        append.cover(class.slots_in_file(file.file_bytes));
        let (slot, tag) = append.take();
        assert_eq!(slot, next.slot);
        if let Some(pages) = next.opens {
            file.fresh_pages = pages;
        }
        file.next_append_slot = file.next_append_slot.max(slot + 1);
        self.appended_this_round += 1;
        Ok((slot, tag))
    }

    /// Grows the class's file, if `slot` lies past its end, by a growth step and to hold at
    /// least `slots` slots.
    fn grow_for_slot(&mut self, class: SizeClass, slot: u64, slots: u64) -> Result<(), WriteError> {
        let file = self.classes[class.id as usize].as_mut().expect("class file is open");
        if slot < class.slots_in_file(file.file_bytes) {
            return Ok(());
        }
        let growth = (file.file_bytes / SLAB_GROWTH_DIVISOR).max(self.slab_growth_bytes_min);
        let wanted = (file.file_bytes + growth)
            .max(class.file_bytes_for_slots(slots))
            .next_multiple_of(PAGE_BYTES as u64);
        self.io
            .device
            .grow_file(file.file, wanted)
            .and_then(|()| self.io.device.fault_point(FaultPoint::SlabFileGrown))
            .map_err(WriteError::from_device)?;
        file.file_bytes = wanted;
        assert!(slot < class.slots_in_file(wanted));
        Ok(())
    }

    /// Opens (creating, with its header page written durably) the slab file of a class.
    pub(super) fn ensure_class_file(&mut self, class: SizeClass) -> Result<(), WriteError> {
        if self.classes[class.id as usize].is_some() {
            return Ok(());
        }
        let name = class.file_name(self.shard_id);
        let file = self.io.device.open_file(&name, true).map_err(WriteError::from_device)?;
        self.initialize_class_file(class, file).map_err(WriteError::from_device)?;
        Ok(())
    }

    /// Writes the header page of a new (or never initialized) slab file and records the file.
    pub(super) fn initialize_class_file(
        &mut self,
        class: SizeClass,
        file: crate::device::FileId,
    ) -> Result<(), crate::device::DeviceError> {
        let file_bytes = class.file_bytes_for_slots(0).max(self.slab_growth_bytes_min);
        self.io.device.grow_file(file, file_bytes)?;
        self.io.device.fault_point(FaultPoint::SlabFileCreatedBeforeHeader)?;
        self.write_slab_header(class, file)?;
        self.classes[class.id as usize] = Some(ClassFile {
            file,
            next_append_slot: 0,
            frontier_page: 1,
            file_bytes,
            layout: RecordLayout::current(),
            fresh_pages: (0, 0),
        });
        self.open_placement(class, file_bytes, 0);
        Ok(())
    }

    /// Writes a slab file's header page (this build's format) and makes it durable: before any
    /// record of the file is written, and again by recovery when a device lost it.
    pub(super) fn write_slab_header(
        &mut self,
        class: SizeClass,
        file: crate::device::FileId,
    ) -> Result<(), crate::device::DeviceError> {
        let mut page = AlignedBuf::zeroed(PAGE_BYTES);
        encode_slab_header(
            &mut page,
            &SlabHeader {
                format_version: SLAB_FORMAT_VERSION,
                class_id: class.id,
                slot_bytes: class.slot_bytes,
                slots_per_page: class.slots_per_page,
                pages_per_slot: class.pages_per_slot,
                shard_id: self.shard_id,
            },
        );
        let token = self.io.take_token();
        self.io.sync_io(IoRequest { token, file, offset: 0, kind: IoKind::Write, buf: page })?;
        self.io.device.flush()
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
        let layout = self.layout_of(loc.class());
        if class.is_multi_page() {
            let pages = loc.pages_used().max(1) as usize;
            assert!(bytes <= pages * PAGE_BYTES);
            let mut buf = AlignedBuf::zeroed(pages * PAGE_BYTES);
            encode_record(&mut buf, layout, self.shard_id, loc, kind, seq, aux, key, value);
            self.device_bytes_written[loc.class() as usize] += buf.len() as u64;
            let (file, offset) = self.slot_position(loc);
            self.io.queue(IoKind::Write, file, offset, buf, IoPurpose::DirectWrite(write));
        } else {
            let mut record = vec![0u8; bytes];
            encode_record(&mut record, layout, self.shard_id, loc, kind, seq, aux, key, value);
            let page = Pages::page_of(loc);
            self.place_in_page(page, class.offset_in_page(loc.slot()), record, write);
        }
    }

    pub(super) fn place_in_page(
        &mut self,
        page: (u8, u64),
        offset: usize,
        record: Vec<u8>,
        write: WriteId,
    ) {
        // A page of the open block that gets a record is no longer fresh, however its image is
        // found (cached, being read, or zeros): once it may be written, a later miss must read
        // it back. (Moving the start only on a miss let a page imaged from the cache be zeroed
        // after its eviction, wiping a live record: simulator seed 9188.)
        let file = self.classes[page.0 as usize].as_mut().expect("class file is open");
        let (fresh_start, fresh_end) = file.fresh_pages;
        let fresh = (fresh_start..fresh_end).contains(&page.1);
        if fresh {
            file.fresh_pages.0 = page.1 + 1;
        }
        if self.pages.is_loading(page) {
            self.pages.join_read(page, PageWaiter::Place { write, offset, record });
            return;
        }
        if !self.pages.cache.contains(page) {
            let file = self.classes[page.0 as usize].as_mut().expect("class file is open");
            if page.1 >= file.frontier_page || fresh {
                // Never written, or in the part of an open block nothing was written to since
                // it was opened: its image is zeros, no read needed.
                file.frontier_page = file.frontier_page.max(page.1 + 1);
                self.pages.cache.insert(page, &[0u8; PAGE_BYTES]);
            } else {
                self.wait_page(page, PageWaiter::Place { write, offset, record });
                return;
            }
        }
        let slot_bytes = SizeClass::get(page.0).slot_bytes as usize;
        assert!(offset + record.len() <= PAGE_BYTES && record.len() <= slot_bytes);
        let image = self.pages.cache.image_mut(page).expect("checked above");
        let slot_bytes_in_page = &mut image[offset..offset + slot_bytes];
        slot_bytes_in_page[..record.len()].copy_from_slice(&record);
        // Clear the rest of the slot so a shorter record leaves no stale tail behind it.
        slot_bytes_in_page[record.len()..].fill(0);
        self.pages.mark_dirty(page, write);
    }

    /// Hands every dirty page without a write in flight to the device (invariant 3), each run
    /// of consecutive pages of a file as one write of up to `WRITE_PAGES_PER_IO_MAX` pages (the
    /// pages an append class fills in a round go out as one sequential I/O).
    pub(super) fn schedule_page_writes(&mut self) {
        if self.pages.is_clean() {
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
        let mut buf = AlignedBuf::zeroed(run.len() * PAGE_BYTES);
        for (index, &page) in run.iter().enumerate() {
            buf[index * PAGE_BYTES..(index + 1) * PAGE_BYTES]
                .copy_from_slice(self.pages.cache.image(page).expect("dirty pages are pinned"));
            // Invariant 3: at most one write of a page in flight.
            self.pages.begin_write(page);
            self.scrub_page_written(page);
        }
        self.device_bytes_written[first.0 as usize] += buf.len() as u64;
        let file = self.classes[first.0 as usize].as_ref().expect("class file is open").file;
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
        let PendingWrite { reaped_through, loc, overwritten, effect } =
            self.writes.remove(&write).expect("durable write is pending");
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
                Self::answer(origin, Ok(()), false);
            }
            Effect::Tombstone { key, seq, origin } => {
                self.seqs.finish(seq);
                let existed = self.apply_tombstone(&key, seq, loc);
                Self::answer(origin, Ok(()), existed);
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
            Effect::Moved { key, seq, from, tombstone, bytes } => {
                self.gc_moved(&key, seq, from, loc, tombstone, bytes)
            }
        }
    }

    /// A write failed (the store is poisoned by then): answer its origin, forget its flight.
    pub(super) fn write_failed(&mut self, write: WriteId, err: WriteError) {
        let Some(PendingWrite { loc, effect, .. }) = self.writes.remove(&write) else { return };
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
                    origin => Self::answer(origin, Err(err), false),
                }
            }
            Effect::BatchRecord { batch } => self.batch_member_failed(batch, err),
            Effect::Watermark => {}
            Effect::Erase { chain, .. } => {
                if let Some(chain) = chain {
                    self.free[loc.class() as usize].abort(chain);
                }
            }
            Effect::RecordErased { owner, chain } => {
                // The batch was applied; only its record stays on disk (replayed harmlessly:
                // nothing older than it can win). Its keys stay held until the next recovery.
                // A part's record stays too, and the next open reports it again.
                match owner {
                    ErasedRecord::Batch(batch) => {
                        self.batches.remove(&batch);
                    }
                    ErasedRecord::Part(gsn) => self.part_erase_failed(gsn, err),
                }
                if let Some(chain) = chain {
                    self.free[loc.class() as usize].abort(chain);
                }
            }
            Effect::PartPrepared { gsn, seq } => {
                if nothing_on_disk {
                    self.seqs.finish(seq);
                }
                self.part_prepare_failed(gsn, err);
            }
            Effect::Moved { key, seq, .. } => self.gc_move_failed(&key, seq),
        }
    }

    pub(super) fn answer(origin: Origin, result: Result<(), WriteError>, existed: bool) {
        match origin {
            Origin::Put(reply) => {
                let _ = reply.send(result);
            }
            Origin::Delete(reply) => {
                let _ = reply.send(result.map(|()| existed));
            }
            Origin::Batch(_) => unreachable!("batch members are answered with their batch"),
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

    /// Frees a slot. `tag` is the hash of the key whose stale copy the slot still holds.
    /// `erase` forces a free record over the slot before reuse (corrupt slots, batch records).
    pub(super) fn release_slot(&mut self, loc: Loc, tag: Option<u64>, erase: bool) {
        if let Some(hash) = tag {
            self.seqs.count_stale(hash);
        }
        self.place_free(loc, tag, erase, None);
    }

    /// Writes free records over the in-memory free slots that hold a stale copy under `hash`
    /// (each stays counted until its erasure is durable).
    fn erase_stale_copies(&mut self, hash: u64) {
        for class in 0..self.free.len() {
            for slot in self.free[class].take_tagged(hash) {
                self.place_free(Loc::new(class as u8, slot, 0), Some(hash), true, None);
            }
        }
    }

    /// Erases a slot holding a torn record of sequence number `seq` (recovery): the watermark
    /// stays below `seq` until the erasure is durable.
    pub(super) fn erase_torn(&mut self, loc: Loc, seq: u64) {
        self.seqs.hold(seq);
        self.write_free_record(loc, None, None, None, Some(seq));
    }

    /// Puts an (already counted) free slot in memory, or writes its free record.
    pub(super) fn place_free(
        &mut self,
        loc: Loc,
        tag: Option<u64>,
        erase: bool,
        owner: Option<ErasedRecord>,
    ) {
        if let Some(append) = self.append[loc.class() as usize].as_mut() {
            // Append placement: a freed slot is dead in its block until the block is reused;
            // an erasure is written in place first (it changes no live record).
            if !erase && owner.is_none() {
                append.release(loc.slot(), tag);
            } else {
                self.write_free_record(loc, tag, None, owner, None);
            }
            return;
        }
        let free = &mut self.free[loc.class() as usize];
        if !erase && owner.is_none() && free.has_room() {
            free.push(loc.slot(), tag);
            return;
        }
        let (chain, next) = if free.has_room() {
            (None, None)
        } else {
            match free.begin_push() {
                Some((chain, head)) => (Some(chain), head),
                None => {
                    self.deferred_frees.push_back((loc, tag, erase, owner));
                    return;
                }
            }
        };
        self.write_free_record(loc, tag, chain.map(|chain| (chain, next)), owner, None);
    }

    /// Writes a free record over `loc` (pointing to `next` when pushed onto `chain`).
    fn write_free_record(
        &mut self,
        loc: Loc,
        tag: Option<u64>,
        chain: Option<(usize, Option<u64>)>,
        owner: Option<ErasedRecord>,
        retires: Option<u64>,
    ) {
        let next = chain.and_then(|(_, next)| next);
        let chain = chain.map(|(chain, _)| chain);
        let effect = match owner {
            Some(owner) => Effect::RecordErased { owner, chain },
            None => Effect::Erase { chain, retires },
        };
        let write = self.new_write(loc.slot_only(), tag, effect);
        let aux = next.map_or(0, |slot| slot + 1);
        self.place(write, loc.slot_only(), RecordKind::Free, 0, aux, &[], &[]);
    }

    /// Erases a finished batch record; its keys are released when the erasure is durable.
    pub(super) fn erase_batch_record(&mut self, loc: Loc, batch: u64) {
        self.place_free(loc.slot_only(), None, true, Some(ErasedRecord::Batch(batch)));
    }

    /// A free record is durable: the slot is free.
    fn erased(&mut self, loc: Loc, chain: Option<usize>) {
        match chain {
            Some(chain) => self.free[loc.class() as usize].end_push(chain, loc.slot()),
            None => self.place_free(loc.slot_only(), None, false, None),
        }
    }

    /// A stale copy counted under `tag` is gone; tombstones waiting on it may go too.
    pub(super) fn release_tag(&mut self, tag: Option<u64>) {
        let Some(hash) = tag else { return };
        if self.seqs.release_stale(hash) {
            self.release_guards(hash);
        }
    }

    /// Frees the tombstones kept for `hash` once no stale copy under it remains and no older
    /// write of their key is still in flight (it would land as a stale copy with nothing above
    /// it). Called whenever either condition may have become true.
    pub(super) fn release_guards(&mut self, hash: u64) {
        for tombstone in self.seqs.releasable_guards(hash) {
            self.release_slot(tombstone, None, false);
        }
    }

    pub(super) fn retry_deferred_frees(&mut self) {
        for _ in 0..self.deferred_frees.len() {
            let Some((loc, tag, erase, owner)) = self.deferred_frees.pop_front() else { break };
            self.place_free(loc, tag, erase, owner);
        }
    }

    /// Starts reading chain heads of classes whose in-memory free set runs low.
    pub(super) fn refill_free_lists(&mut self) {
        for class_id in 0..self.free.len() {
            let free = &mut self.free[class_id];
            if free.in_memory() >= crate::limits::FREE_SLOTS_IN_MEMORY_MAX / 2 {
                continue;
            }
            let Some((chain, slot)) = free.begin_pop() else { continue };
            let class = SizeClass::get(class_id as u8);
            let loc = Loc::new(class.id, slot, 0);
            if class.is_multi_page() {
                let (file, offset) = self.slot_position(loc);
                self.io.queue(
                    IoKind::Read,
                    file,
                    offset,
                    AlignedBuf::zeroed(PAGE_BYTES),
                    IoPurpose::DirectRead(super::DirectRead::ChainPop {
                        class: class.id,
                        chain,
                        slot,
                    }),
                );
            } else {
                let page = Pages::page_of(loc);
                if self.pages.cache.contains(page) {
                    let offset = class.offset_in_page(slot);
                    let bytes = self.pages.cache.image(page).unwrap()
                        [offset..offset + class.slot_bytes as usize]
                        .to_vec();
                    self.chain_head_read(class.id, chain, slot, &bytes);
                } else {
                    self.wait_page(page, PageWaiter::ChainPop { class: class.id, chain, slot });
                }
            }
        }
    }

    /// The free record at a chain's head was read: move the head to memory.
    pub(super) fn chain_head_read(&mut self, class: u8, chain: usize, slot: u64, bytes: &[u8]) {
        let slot_bytes = SizeClass::get(class).slot_bytes as usize;
        let loc = Loc::new(class, slot, 0);
        let layout = self.layout_of(class);
        match super::format::decode_slot(bytes, layout, self.shard_id, loc, slot_bytes) {
            Ok(super::format::Slot::Record { header, .. }) if header.kind == RecordKind::Free => {
                let next = header.aux.checked_sub(1);
                self.free[class as usize].end_pop(chain, next);
            }
            other => {
                tracing::error!(shard = self.shard_id, ?loc, ?other, "free chain head is not a free record; dropping the chain until the next recovery");
                self.free[class as usize].drop_chain(chain);
            }
        }
    }
}
