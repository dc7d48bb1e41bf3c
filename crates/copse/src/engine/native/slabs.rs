//! Slots and where they come from (`Slabs`): the slab file of each size class (`ClassFile`),
//! the free slots of each class (`free_list.rs`), frees waiting for a busy chain, and what was
//! written per class. Then the engine's allocation and freeing (`impl NativeEngine`): finding a
//! slot for a record (in place, or appended through `placement.rs`), creating and growing slab
//! files, freeing a slot (in memory, chained on disk through Free records, or dead in its
//! append block), erasing slots, and releasing the tombstones a freed stale copy held.
//!
//! Invariants:
//! - A class has at most one slab file, and its header page is durable before any slot of it
//!   is handed out (`initialize_class_file` writes and flushes it first).
//! - Every slot handed out lies inside its file: the file grows first (asserted in
//!   `grow_for_slot`). Slots at and past `next_append_slot` were never handed out since the
//!   file was scanned, so a slot taken from the free list lies below it (asserted in
//!   `allocate_in_place`).
//! - Pages at and past `frontier_page` were never written, and `frontier_page` only grows: their
//!   image is zeros without a read. Likewise the open append block's `fresh_pages`, whose start
//!   moves past every page a record is placed in (`ClassFile::take_fresh`).
//! - A slot is in at most one place: in use, the in-memory free set, one on-disk chain, dead in
//!   its append block, or a deferred free (`free_list.rs` asserts the in-memory part). A freed
//!   slot's stale copy is counted (`Seqs::count_stale`) before the slot is placed anywhere.

use std::collections::VecDeque;

use super::format::{
    decode_slot, encode_slab_header, pages_for, record_bytes, Loc, RecordKind, RecordLayout,
    SizeClass, SlabHeader, Slot, CLASS_COUNT, SLAB_FORMAT_VERSION,
};
use super::free_list::FreeList;
use super::pages::PageWaiter;
use super::read::DirectRead;
use super::write::{Effect, ErasedRecord};
use super::{IoPurpose, NativeEngine};
use crate::device::{AlignedBuf, BlockDevice, DeviceError, FaultPoint, FileId, IoKind, IoRequest};
use crate::error::WriteError;
use crate::limits::{
    FREE_SLOTS_IN_MEMORY_MAX, PAGE_BYTES, SLAB_GROWTH_BYTES_MAX, SLAB_GROWTH_DIVISOR,
};

/// A slab file of one class.
pub(super) struct ClassFile {
    pub(super) file: FileId,
    /// Slots at and past this index have never been handed out since the file was scanned.
    pub(super) next_append_slot: u64,
    /// Pages at and past this one were never written (zero-filled): no read needed to fill them.
    pub(super) frontier_page: u64,
    pub(super) file_bytes: u64,
    /// How its records are laid out (from its format version, which a file keeps for life).
    pub(super) layout: RecordLayout,
    /// Append placement: pages [start, end) of the open block hold nothing live and were not
    /// written since it was opened, so their image is zeros, no read needed. The start moves
    /// past every page a record is placed in, whether its image was cached, read or zeroed.
    fresh_pages: (u64, u64),
}

impl ClassFile {
    /// A new file of `file_bytes`, its header just written.
    fn created(file: FileId, file_bytes: u64) -> ClassFile {
        ClassFile {
            file,
            next_append_slot: 0,
            frontier_page: 1,
            file_bytes,
            layout: RecordLayout::current(),
            fresh_pages: (0, 0),
        }
    }

    /// A file recovery scanned, whose slots below `next_append_slot` were used at some time.
    pub(super) fn scanned(
        class: SizeClass,
        file: FileId,
        file_bytes: u64,
        layout: RecordLayout,
        next_append_slot: u64,
    ) -> ClassFile {
        let frontier_page = class.page_after_slots(next_append_slot);
        ClassFile { file, next_append_slot, frontier_page, file_bytes, layout, fresh_pages: (0, 0) }
    }

    /// A record is placed in `page`: returns whether the page was fresh (its image is zeros);
    /// it is not fresh any more.
    pub(super) fn take_fresh(&mut self, page: u64) -> bool {
        let (fresh_start, fresh_end) = self.fresh_pages;
        let fresh = (fresh_start..fresh_end).contains(&page);
        if fresh {
            self.fresh_pages.0 = page + 1;
        }
        fresh
    }

    /// Whether the image of `page` (not cached) is zeros without a read: never written, or
    /// `fresh`. If so the page counts as written from now on.
    pub(super) fn image_is_zeros(&mut self, page: u64, fresh: bool) -> bool {
        if page >= self.frontier_page || fresh {
            self.frontier_page = self.frontier_page.max(page + 1);
            return true;
        }
        false
    }
}

/// A free that found every chain of its class busy; retried each round (already counted).
struct DeferredFree {
    loc: Loc,
    tag: Option<u64>,
    erase: bool,
    owner: Option<ErasedRecord>,
}

pub(super) struct Slabs {
    /// The least a slab file grows by (and its first size).
    growth_bytes_min: u64,
    classes: Vec<Option<ClassFile>>,
    pub(super) free: Vec<FreeList>,
    deferred_frees: VecDeque<DeferredFree>,
    /// Per class: bytes the device was asked to write for it, and bytes of keys and values
    /// users asked to write (write amplification is their ratio).
    device_bytes_written: Vec<u64>,
    user_bytes_written: Vec<u64>,
}

impl Slabs {
    pub(super) fn new(growth_bytes_min: u64) -> Slabs {
        Slabs {
            growth_bytes_min: growth_bytes_min.max(PAGE_BYTES as u64),
            classes: (0..CLASS_COUNT).map(|_| None).collect(),
            free: (0..CLASS_COUNT).map(|_| FreeList::default()).collect(),
            deferred_frees: VecDeque::new(),
            device_bytes_written: vec![0; CLASS_COUNT],
            user_bytes_written: vec![0; CLASS_COUNT],
        }
    }

    /// The slab file of a class, if it has one.
    pub(super) fn file(&self, class: u8) -> Option<&ClassFile> {
        self.classes[class as usize].as_ref()
    }

    /// The slab file of a class, which must be open.
    pub(super) fn open_file(&mut self, class: u8) -> &mut ClassFile {
        self.classes[class as usize].as_mut().expect("class file is open")
    }

    /// The classes with a slab file.
    pub(super) fn files(&self) -> impl Iterator<Item = (u8, &ClassFile)> {
        (self.classes.iter().enumerate())
            .filter_map(|(id, file)| file.as_ref().map(|file| (id as u8, file)))
    }

    /// Records the slab file of a class (created, or scanned by recovery).
    pub(super) fn add_file(&mut self, class: u8, file: ClassFile) {
        self.classes[class as usize] = Some(file);
    }

    /// The device file of a class's slab file (which must be open).
    pub(super) fn file_of(&self, class: u8) -> FileId {
        self.classes[class as usize].as_ref().expect("class file is open").file
    }

    /// Where a slot starts: (file, byte offset of its first page).
    pub(super) fn slot_position(&self, loc: Loc) -> (FileId, u64) {
        let class = SizeClass::get(loc.class());
        (self.file_of(loc.class()), class.page_of_slot(loc.slot()) * PAGE_BYTES as u64)
    }

    /// Pages a read of the record at `loc` takes from `slot_position`: a multi-page record's
    /// pages, or the one or two pages of an in-page slot.
    pub(super) fn pages_to_read(&self, loc: Loc) -> usize {
        let class = SizeClass::get(loc.class());
        if class.is_multi_page() {
            loc.pages_used().max(1) as usize
        } else {
            class.span(loc.slot()).pages as usize
        }
    }

    /// The record layout of a class's slab file (which must be open).
    pub(super) fn layout_of(&self, class: u8) -> RecordLayout {
        self.classes[class as usize].as_ref().expect("class file is open").layout
    }

    pub(super) fn count_device_write(&mut self, class: u8, bytes: u64) {
        self.device_bytes_written[class as usize] += bytes;
    }

    pub(super) fn count_user_write(&mut self, class: u8, bytes: u64) {
        self.user_bytes_written[class as usize] += bytes;
    }

    /// (device bytes, user bytes) written for a class.
    pub(super) fn written(&self, class: u8) -> (u64, u64) {
        (self.device_bytes_written[class as usize], self.user_bytes_written[class as usize])
    }

    pub(super) fn has_deferred_frees(&self) -> bool {
        !self.deferred_frees.is_empty()
    }

    /// Grows the class's file, if `slot` lies past its end, by a growth step and to hold at
    /// least `slots` slots.
    fn grow_for_slot(
        &mut self,
        device: &mut dyn BlockDevice,
        class: SizeClass,
        slot: u64,
        slots: u64,
    ) -> Result<(), WriteError> {
        let growth_bytes_min = self.growth_bytes_min;
        let file = self.open_file(class.id);
        if slot < class.slots_in_file(file.file_bytes) {
            return Ok(());
        }
        let growth = (file.file_bytes / SLAB_GROWTH_DIVISOR)
            .min(SLAB_GROWTH_BYTES_MAX)
            .max(growth_bytes_min);
        // Whole units: a partial one holds no slot.
        let wanted =
            class.whole_units_file_bytes((file.file_bytes + growth).max(class.file_bytes_for_slots(slots)));
        device
            .grow_file(file.file, wanted)
            .and_then(|()| device.fault_point(FaultPoint::SlabFileGrown))
            .map_err(WriteError::from_device)?;
        file.file_bytes = wanted;
        assert!(slot < class.slots_in_file(wanted));
        Ok(())
    }

    /// A slot of an in-place class (whose file is open): a free one in `near_page` (a cached
    /// page), else the most recently freed one, else a new one at the end of the file (growing
    /// it). Returns the slot and the stale key hash of what it held.
    fn allocate_in_place(
        &mut self,
        device: &mut dyn BlockDevice,
        class: SizeClass,
        near_page: Option<u64>,
    ) -> Result<(u64, Option<u64>), WriteError> {
        let next_append_slot = self.open_file(class.id).next_append_slot;
        let free = &mut self.free[class.id as usize];
        let mut found = None;
        if let Some(page) = near_page {
            found = class
                .slots_starting_in_page(page)
                .find_map(|slot| free.take(slot).map(|tag| (slot, tag)));
        }
        if let Some((slot, tag)) = found.or_else(|| free.pop()) {
            assert!(
                slot < next_append_slot,
                "free slot {slot} of class {} was never handed out (next new slot {next_append_slot})",
                class.id
            );
            return Ok((slot, tag));
        }
        let slot = next_append_slot;
        self.grow_for_slot(device, class, slot, slot + 1)?;
        self.open_file(class.id).next_append_slot += 1;
        Ok((slot, None))
    }
}

/// Who takes an appended slot. The collector paces itself on what the foreground appends
/// (`Collector::count_appended`); its own moves must not count, or each collection would ask
/// the next for more than the writes used, moving ever livelier victims (2,048 live 1 KiB
/// records per shard: 3 to 22 moves per SET counted, 2.6 to 3 not; docs/benchmarks.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Appender {
    /// A write of the store's users (or its own records: batches, watermarks).
    Foreground,
    /// A move of the collector or of clustering.
    Mover,
}

impl NativeEngine {
    /// Allocates the slot for a record of `key` with a value of `value_bytes`.
    pub(super) fn allocate_for(
        &mut self,
        key: &[u8],
        value_bytes: usize,
    ) -> Result<(Loc, Option<u64>), WriteError> {
        let bytes = record_bytes(key.len(), value_bytes);
        let class = SizeClass::for_record(bytes);
        // Only an in-place class places beside the key's old copy: an append class would pay
        // an index lookup per write for nothing (issue 22: one lookup per key per command).
        let near = if self.collector.append(class.id).is_some() { None } else { self.index.get(key) };
        let (slot, overwritten) = self.allocate(class, near, Appender::Foreground)?;
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
        appender: Appender,
    ) -> Result<(u64, Option<u64>), WriteError> {
        self.ensure_class_file(class)?;
        if self.collector.append(class.id).is_some() {
            return self.allocate_appended(class, appender);
        }
        let near_page = near
            .filter(|near| near.class() == class.id && !class.is_multi_page())
            .map(|near| class.page_of_slot(near.slot()))
            .filter(|&page| self.pages.cache.contains((class.id, page)));
        self.slabs.allocate_in_place(self.io.device.as_mut(), class, near_page)
    }

    /// The next slot of the open block of an append class, growing the file to hold its block.
    fn allocate_appended(
        &mut self,
        class: SizeClass,
        appender: Appender,
    ) -> Result<(u64, Option<u64>), WriteError> {
        let append = self.collector.append(class.id).expect("an append class");
        let next = append.peek();
        let block_end_slot = (next.slot / append.slots_per_block() + 1) * append.slots_per_block();
        self.slabs.grow_for_slot(self.io.device.as_mut(), class, next.slot, block_end_slot)?;
        let file = self.slabs.open_file(class.id);
        let append = self.collector.append_mut(class.id).expect("an append class");
        append.cover(class.slots_in_file(file.file_bytes));
        let (slot, tag) = append.take();
        assert_eq!(slot, next.slot);
        if let Some(pages) = next.opens {
            file.fresh_pages = pages;
        }
        file.next_append_slot = file.next_append_slot.max(slot + 1);
        if appender == Appender::Foreground {
            self.collector.count_appended();
        }
        Ok((slot, tag))
    }

    /// Opens (creating, with its header page written durably) the slab file of a class.
    pub(super) fn ensure_class_file(&mut self, class: SizeClass) -> Result<(), WriteError> {
        if self.slabs.file(class.id).is_some() {
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
        file: FileId,
    ) -> Result<(), DeviceError> {
        let file_bytes =
            class.whole_units_file_bytes(class.file_bytes_for_slots(0).max(self.slabs.growth_bytes_min));
        self.io.device.grow_file(file, file_bytes)?;
        self.io.device.fault_point(FaultPoint::SlabFileCreatedBeforeHeader)?;
        self.write_slab_header(class, file)?;
        self.slabs.add_file(class.id, ClassFile::created(file, file_bytes));
        self.collector.open_class(class, file_bytes, 0);
        Ok(())
    }

    /// Writes a slab file's header page (this build's format) and makes it durable: before any
    /// record of the file is written, and again by recovery when a device lost it.
    pub(super) fn write_slab_header(
        &mut self,
        class: SizeClass,
        file: FileId,
    ) -> Result<(), DeviceError> {
        let mut page = AlignedBuf::zeroed(PAGE_BYTES);
        encode_slab_header(
            &mut page,
            &SlabHeader {
                format_version: SLAB_FORMAT_VERSION,
                class_id: class.id,
                slot_bytes: class.slot_bytes,
                slots_per_unit: class.slots_per_unit,
                pages_per_unit: class.pages_per_unit,
                shard_id: self.shard_id,
            },
        );
        let token = self.io.take_token();
        self.io.sync_io(IoRequest { token, file, offset: 0, kind: IoKind::Write, buf: page })?;
        self.io.device.flush()
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
    pub(super) fn erase_stale_copies(&mut self, hash: u64) {
        for class in 0..self.slabs.free.len() {
            for slot in self.slabs.free[class].take_tagged(hash) {
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
        if let Some(append) = self.collector.append_mut(loc.class()) {
            // Append placement: a freed slot is dead in its block until the block is reused;
            // an erasure is written in place first (it changes no live record).
            if !erase && owner.is_none() {
                append.release(loc.slot(), tag);
            } else {
                self.write_free_record(loc, tag, None, owner, None);
            }
            return;
        }
        let free = &mut self.slabs.free[loc.class() as usize];
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
                    self.slabs.deferred_frees.push_back(DeferredFree { loc, tag, erase, owner });
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
        let write = self.writes.add(loc.slot_only(), tag, effect);
        let aux = next.map_or(0, |slot| slot + 1);
        self.place(write, loc.slot_only(), RecordKind::Free, 0, aux, &[], &[]);
    }

    /// Erases a finished batch record; its keys are released when the erasure is durable.
    pub(super) fn erase_batch_record(&mut self, loc: Loc, batch: u64) {
        self.place_free(loc.slot_only(), None, true, Some(ErasedRecord::Batch(batch)));
    }

    /// A free record is durable: the slot is free.
    pub(super) fn erased(&mut self, loc: Loc, chain: Option<usize>) {
        match chain {
            Some(chain) => self.slabs.free[loc.class() as usize].end_push(chain, loc.slot()),
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
        for DeferredFree { loc, tag, erase, owner } in
            std::mem::take(&mut self.slabs.deferred_frees)
        {
            self.place_free(loc, tag, erase, owner);
        }
    }

    /// Starts reading chain heads of classes whose in-memory free set runs low.
    pub(super) fn refill_free_lists(&mut self) {
        for class_id in 0..self.slabs.free.len() {
            let free = &mut self.slabs.free[class_id];
            if free.in_memory() >= FREE_SLOTS_IN_MEMORY_MAX / 2 {
                continue;
            }
            let Some((chain, slot)) = free.begin_pop() else { continue };
            self.pop_chain_head(class_id as u8, chain, slot);
        }
    }

    /// Reads the free record at the head of a chain (`slot`), then moves the head to memory:
    /// from the cached pages, or once they or the record's pages are read.
    pub(super) fn pop_chain_head(&mut self, class: u8, chain: usize, slot: u64) {
        let loc = Loc::new(class, slot, 0);
        if SizeClass::get(class).is_multi_page() {
            let (file, offset) = self.slabs.slot_position(loc);
            self.io.queue(
                IoKind::Read,
                file,
                offset,
                AlignedBuf::zeroed(PAGE_BYTES),
                IoPurpose::DirectRead(DirectRead::ChainPop { class, chain, slot }),
            );
            return;
        }
        match self.pages.slot_image(loc) {
            Some(bytes) => {
                let bytes = bytes.into_owned();
                self.chain_head_read(class, chain, slot, &bytes);
            }
            None => self.wait_slot(loc, PageWaiter::ChainPop { class, chain, slot }),
        }
    }

    /// The free record at a chain's head was read: move the head to memory.
    pub(super) fn chain_head_read(&mut self, class: u8, chain: usize, slot: u64, bytes: &[u8]) {
        let slot_bytes = SizeClass::get(class).slot_bytes as usize;
        let loc = Loc::new(class, slot, 0);
        let layout = self.slabs.layout_of(class);
        match decode_slot(bytes, layout, self.shard_id, loc, slot_bytes) {
            Ok(Slot::Record { header, .. }) if header.kind == RecordKind::Free => {
                let next = header.aux.checked_sub(1);
                self.slabs.free[class as usize].end_pop(chain, next);
            }
            other => {
                tracing::error!(shard = self.shard_id, ?loc, ?other, "free chain head is not a free record; dropping the chain until the next recovery");
                self.slabs.free[class as usize].drop_chain(chain);
            }
        }
    }
}
