//! The native engine (KVell): one shard's unsorted size-class slabs, its index, page cache and
//! free lists, driven by the shard thread as a state machine over batched asynchronous I/O.
//!
//! Reading order: `format.rs` (what is on disk), this file (state and the I/O plumbing),
//! `write.rs` (puts, deletes, freeing slots), `batch.rs`, `parts.rs`, `read.rs` (gets, scans),
//! `recovery.rs` (rebuilding state from the slabs).
//!
//! Invariants (the reasons are in docs/durability.md):
//! 1. The bytes of a live record (the one the index points to) are never overwritten. A new
//!    version goes to a free slot; the old slot is freed only after the new one is durable, and
//!    the index is updated at that moment, so a torn write can only damage a slot nobody needs.
//! 2. A write is answered only when durable (`WriteDurability`): its completion was reaped
//!    before a flush began, and that flush finished (or, under `Dsync`, it completed). Checked,
//!    in release builds too, against the device's own count of what its flushes covered
//!    (`PendingWrite::reaped_through`, asserted in `write_durable`).
//! 3. A page has at most one write in flight; modifications made meanwhile ride the next write
//!    (asserted where a page write is queued and where it completes).
//! 4. For every key, the disk holds at most: its newest record (live item or tombstone) and
//!    older copies that are stale. Every stale copy is counted in `stale_counts` under the key's
//!    hash until it is overwritten or erased; a tombstone is kept while its key's count is
//!    non-zero, so no stale copy can come back at recovery.
//! 5. Writes of one key may be in flight together; each carries a sequence number and only the
//!    highest one that completed is applied (`Flight`), so completion order does not matter.
//!    Asserted where the index changes: a put replaces only a lower seq, a collector move keeps
//!    the seq and the slot the index pointed to, recovery indexes each key once.

pub mod batch;
pub mod cache;
pub mod check;
pub mod format;
pub mod free_list;
mod gc;
pub mod index;
mod parts;
pub mod placement;
mod read;
pub mod recovery;
mod scrub;
mod write;

use std::collections::{BTreeMap, VecDeque};

use crate::hash::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::device::{
    AlignedBuf, BlockDevice, FaultPoint, FileId, IoCompletion, IoKind, IoRequest, WriteDurability,
};
use crate::engine::{ClassStats, RecoveryStats, Reply, Request, ShardEngine, ShardStats};
use crate::error::{OpenError, ReadError, WriteError};
use crate::limits::PAGE_BYTES;

use cache::{PageCache, PageKey};
use format::{Loc, RecordLayout, SizeClass, CLASS_COUNT};
use free_list::FreeList;
use index::Index;
use placement::{AppendClass, Placement};

type WriteId = u64;
type Key = Box<[u8]>;

/// Settings of one shard's engine.
pub struct EngineConfig {
    pub shard_id: u32,
    pub cache_pages: usize,
    pub io_depth_max: usize,
    /// The least a slab file grows by (and its first size): `limits::SLAB_GROWTH_BYTES_MIN`
    /// in a store; tests set it small to make growth frequent.
    pub slab_growth_bytes_min: u64,
    /// The placement of each class (`CLASS_COUNT` entries; multi-page classes are in place).
    pub placements: Vec<Placement>,
    /// Pages per block of an append class: `limits::APPEND_BLOCK_PAGES` in a store; tests set
    /// it small to make collections frequent.
    pub append_block_pages: u32,
    /// The collector keeps an append class's file under this many times its live slots (plus
    /// a growth step: docs/placement.md).
    pub space_amplification_max: f64,
    /// Shared by all shards: once any write or flush fails, every shard refuses writes.
    pub poisoned: Arc<AtomicBool>,
}

/// A slab file of one class.
struct ClassFile {
    file: FileId,
    /// Slots at and past this index have never been handed out since the file was scanned.
    next_append_slot: u64,
    /// Pages at and past this one were never written (zero-filled): no read needed to fill them.
    frontier_page: u64,
    file_bytes: u64,
    /// How its records are laid out (from its format version, which a file keeps for life).
    layout: RecordLayout,
    /// Append placement: pages [start, end) of the open block hold nothing live and were not
    /// written since it was opened, so their image is zeros, no read needed. The start moves
    /// past every page a record is placed in, whether its image was cached, read or zeroed.
    fresh_pages: (u64, u64),
}

/// Who is waiting for a write, and what it does once durable.
enum Origin {
    Put(Reply<(), WriteError>),
    Delete(Reply<bool, WriteError>),
    /// A member of a write batch (applied with the whole batch).
    Batch(u64),
}

enum Effect {
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
    /// `retires`: the sequence number of a torn record this erases (see `unfinished_seqs`).
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
    /// The collector's copy of a live record from `from` (`gc.rs`); `bytes`: the record's size.
    Moved {
        key: Key,
        seq: u64,
        from: Loc,
        tombstone: bool,
        bytes: u64,
    },
}

/// Whose record a free record erases, to be told once the erasure is durable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ErasedRecord {
    /// Releases the batch's keys.
    Batch(u64),
    /// Erases the part's next record, or finishes forgetting it.
    Part(u64),
}

struct PendingWrite {
    /// Once its I/O completed: the device's `write_completions_reaped` after the reap that
    /// returned it (at or past the write's own number). It may be acknowledged only once the
    /// device's `write_completions_durable` has reached this.
    reaped_through: Option<u64>,
    loc: Loc,
    /// Stale key hash of what the slot held before; released once this write is durable.
    overwritten: Option<u64>,
    effect: Effect,
}

/// Writes of one key that are in flight (invariant 5).
#[derive(Default)]
struct Flight {
    in_flight: u32,
    applied_seq: u64,
}

enum PageWaiter {
    Place { write: WriteId, offset: usize, record: Vec<u8> },
    Get { key: Vec<u8>, reply: Reply<Option<Vec<u8>>, ReadError> },
    ScanItem { scan: u64, item: usize },
    ChainPop { class: u8, chain: usize, slot: u64 },
}

enum DirectRead {
    Get { key: Vec<u8>, loc: Loc, reply: Reply<Option<Vec<u8>>, ReadError> },
    ScanItem { scan: u64, item: usize, loc: Loc },
    ChainPop { class: u8, chain: usize, slot: u64 },
}

enum IoPurpose {
    PageLoad(PageKey),
    /// `pages` consecutive pages from `page`, written with one I/O.
    PageWrite {
        page: PageKey,
        pages: u64,
        writes: Vec<WriteId>,
    },
    DirectWrite(WriteId),
    DirectRead(DirectRead),
    /// A synchronous request issued by `sync_io`.
    Sync,
    /// A read of the online scrub (`scrub.rs`).
    ScrubRead(scrub::ScrubRead),
    /// The collector's read of its victim block (`gc.rs`).
    GcRead(gc::GcRead),
}

pub struct NativeEngine {
    shard_id: u32,
    device: Box<dyn BlockDevice>,
    durability: WriteDurability,
    io_depth_max: usize,
    slab_growth_bytes_min: u64,
    poisoned: Arc<AtomicBool>,
    placements: Vec<Placement>,
    append_block_pages: u32,
    space_amplification_max: f64,

    classes: Vec<Option<ClassFile>>,
    /// Block accounting of each class in append placement (once its file is open).
    append: Vec<Option<AppendClass>>,
    /// The collection under way, if any, and the moves it has in flight.
    gc: Option<gc::GcRun>,
    gc_moves_in_flight: usize,
    /// A class wanted a collection when last asked (so the shard keeps turning rounds).
    gc_wanted: bool,
    /// Slots appended this round (the collector's budget grows with them).
    appended_this_round: usize,
    settle_waiters: Vec<Reply<(), WriteError>>,
    /// `close` was called: no new collection starts.
    closing: bool,
    /// Per class: bytes the device was asked to write for it, and bytes of keys and values
    /// users asked to write (write amplification is their ratio).
    device_bytes_written: Vec<u64>,
    user_bytes_written: Vec<u64>,
    free: Vec<FreeList>,
    index: Index,
    cache: PageCache,
    next_seq: u64,

    io_ready: VecDeque<IoRequest>,
    io_purpose: HashMap<u64, IoPurpose>,
    next_token: u64,
    /// Completions reaped by `sync_io` that belong to the asynchronous machinery.
    stashed: Vec<IoCompletion>,

    loading: HashMap<PageKey, Vec<PageWaiter>>,
    /// Pages with modifications not yet submitted, and the writes those modifications carry.
    dirty: HashMap<PageKey, Vec<WriteId>>,
    pages_in_flight: HashSet<PageKey>,
    writes: BTreeMap<WriteId, PendingWrite>,
    next_write_id: WriteId,
    awaiting_flush: Vec<WriteId>,
    flush_waiters: Vec<(WriteId, Reply<(), WriteError>)>,

    flights: HashMap<Key, Flight>,
    /// Sequence numbers handed out whose records are not yet durable (count of holders). Every
    /// record carries the durable watermark (below the smallest of these) so that recovery can
    /// tell a damaged record that was once durable (bit rot) from a torn in-flight write.
    unfinished_seqs: BTreeMap<u64, u32>,
    next_seq_at_open: u64,
    stale_counts: HashMap<u64, u32>,
    /// Tombstones kept (with their keys) until no older copy of the key can remain on disk.
    tombstone_guards: HashMap<u64, Vec<(Loc, Key)>>,
    /// Frees that found every chain of their class busy; retried each round (already counted).
    deferred_frees: VecDeque<(Loc, Option<u64>, bool, Option<ErasedRecord>)>,
    batches: HashMap<u64, batch::BatchState>,
    next_batch_id: u64,
    /// Cross-shard parts from `PreparePart` (or recovery) until `ForgetPart`, by gsn.
    parts: HashMap<u64, parts::Part>,
    /// What recovery found, for `recovered_parts`.
    recovered_parts: Vec<crate::engine::part::PartRecord>,
    scans: HashMap<u64, read::ScanState>,
    next_scan_id: u64,
    /// The online scrub under way, if any.
    scrub: Option<scrub::Scrub>,

    recovery: RecoveryStats,
}

impl NativeEngine {
    /// Opens the shard: scans its slabs (recovery), then replays any batch whose record is
    /// durable but whose members are not all applied.
    pub fn open(
        device: Box<dyn BlockDevice>,
        config: EngineConfig,
        progress: Option<&indicatif::ProgressBar>,
    ) -> Result<NativeEngine, OpenError> {
        let durability = device.durability();
        let mut engine = NativeEngine {
            shard_id: config.shard_id,
            device,
            durability,
            io_depth_max: config.io_depth_max.max(1),
            slab_growth_bytes_min: config.slab_growth_bytes_min.max(PAGE_BYTES as u64),
            poisoned: config.poisoned,
            placements: {
                assert_eq!(config.placements.len(), CLASS_COUNT);
                config.placements
            },
            append_block_pages: config.append_block_pages.max(1),
            space_amplification_max: config.space_amplification_max,
            classes: (0..CLASS_COUNT).map(|_| None).collect(),
            append: (0..CLASS_COUNT).map(|_| None).collect(),
            gc: None,
            gc_moves_in_flight: 0,
            gc_wanted: false,
            appended_this_round: 0,
            settle_waiters: Vec::new(),
            closing: false,
            device_bytes_written: vec![0; CLASS_COUNT],
            user_bytes_written: vec![0; CLASS_COUNT],
            free: (0..CLASS_COUNT).map(|_| FreeList::default()).collect(),
            index: Index::default(),
            cache: PageCache::new(config.cache_pages),
            next_seq: 1,
            io_ready: VecDeque::new(),
            io_purpose: HashMap::default(),
            next_token: 1,
            stashed: Vec::new(),
            loading: HashMap::default(),
            dirty: HashMap::default(),
            pages_in_flight: HashSet::default(),
            writes: BTreeMap::new(),
            next_write_id: 1,
            awaiting_flush: Vec::new(),
            flush_waiters: Vec::new(),
            flights: HashMap::default(),
            unfinished_seqs: BTreeMap::new(),
            next_seq_at_open: 0,
            stale_counts: HashMap::default(),
            tombstone_guards: HashMap::default(),
            deferred_frees: VecDeque::new(),
            batches: HashMap::default(),
            next_batch_id: 1,
            parts: HashMap::default(),
            recovered_parts: Vec::new(),
            scans: HashMap::default(),
            next_scan_id: 1,
            scrub: None,
            recovery: RecoveryStats::default(),
        };
        engine.recover(progress)?;
        engine.next_seq_at_open = engine.next_seq;
        // Replayed batches must be applied before the shard answers anyone. A replay that failed
        // forgets its batch (even the last one), so the poison is what says the open failed:
        // the batch's keys are not applied, and a poisoned store refuses every write.
        while !engine.batches.is_empty() && !engine.is_poisoned() {
            engine.end_round();
            engine.device.fault_point(FaultPoint::RecoveryReplayingBatch)?;
            engine.reap(true);
        }
        if engine.is_poisoned() {
            return Err(OpenError::Device(crate::device::DeviceError::Io {
                what: "replaying write batches during recovery".into(),
            }));
        }
        Ok(engine)
    }

    /// Records, durably, that every write so far is durable: recovery then treats any damaged
    /// record up to here as rot rather than as a torn write.
    fn write_watermark_record(&mut self) -> Result<(), WriteError> {
        if self.next_seq == self.next_seq_at_open {
            // Nothing written since open: the records on disk are what recovery saw.
            return Ok(());
        }
        let class = format::SizeClass::get(0);
        let watermark = self.durable_watermark();
        let (slot, overwritten) = self.allocate(class, None)?;
        let seq = self.take_seq();
        let loc = Loc::new(class.id, slot, 0);
        let write = self.new_write(loc, overwritten, Effect::Watermark);
        // Every write is durable and applied (the shard is idle): the index is what the disk
        // holds, and what recovery must find again.
        let digest = self.index.digest().encode();
        self.place(write, loc, format::RecordKind::Watermark, seq, watermark, &[], &digest);
        while !self.is_idle() {
            self.end_round();
            self.reap(true);
            if self.is_poisoned() {
                return Err(WriteError::Poisoned);
            }
        }
        Ok(())
    }

    /// Sets up the block accounting of a class in append placement whose file holds
    /// `file_bytes`, of which the slots below `frontier` were handed out at some time.
    fn open_placement(&mut self, class: SizeClass, file_bytes: u64, frontier: u64) {
        if self.placements[class.id as usize] == Placement::Append && !class.is_multi_page() {
            self.append[class.id as usize] = Some(AppendClass::new(
                class,
                self.append_block_pages,
                class.slots_in_file(file_bytes),
                frontier,
            ));
        }
    }

    fn is_poisoned(&self) -> bool {
        self.poisoned.load(Ordering::Acquire)
    }

    fn poison(&mut self) {
        if !self.poisoned.swap(true, Ordering::AcqRel) {
            tracing::error!(
                shard = self.shard_id,
                "a write or flush failed: the store now refuses writes"
            );
        }
    }

    fn take_token(&mut self) -> u64 {
        let token = self.next_token;
        self.next_token += 1;
        token
    }

    fn queue_io(
        &mut self,
        kind: IoKind,
        file: FileId,
        offset: u64,
        buf: AlignedBuf,
        purpose: IoPurpose,
    ) {
        let token = self.take_token();
        self.io_purpose.insert(token, purpose);
        self.io_ready.push_back(IoRequest { token, file, offset, kind, buf });
    }

    /// Submits queued I/O up to the queue-depth bound, with one system call.
    fn submit_ready(&mut self) {
        let room = self.io_depth_max.saturating_sub(self.device.in_flight());
        let count = room.min(self.io_ready.len());
        if count == 0 {
            return;
        }
        let requests: Vec<IoRequest> = self.io_ready.drain(..count).collect();
        let tokens: Vec<(u64, FileId, u64, IoKind)> =
            requests.iter().map(|r| (r.token, r.file, r.offset, r.kind)).collect();
        if let Err(err) = self.device.submit(requests) {
            // The device took none of them: complete each with the error.
            tracing::error!(shard = self.shard_id, %err, "submitting I/O failed");
            for (token, file, offset, kind) in tokens {
                self.stashed.push(IoCompletion {
                    token,
                    file,
                    offset,
                    kind,
                    buf: AlignedBuf::zeroed(PAGE_BYTES),
                    result: Err(err.clone()),
                });
            }
        }
    }

    /// Performs one request synchronously (slab creation), stashing unrelated completions.
    fn sync_io(&mut self, request: IoRequest) -> Result<AlignedBuf, crate::device::DeviceError> {
        let token = request.token;
        self.io_purpose.insert(token, IoPurpose::Sync);
        self.device.submit(vec![request]).inspect_err(|_| {
            self.io_purpose.remove(&token);
        })?;
        loop {
            let mut completions = Vec::new();
            self.device.reap(1, &mut completions)?;
            let mut mine = None;
            // Everything else reaped here belongs to the asynchronous machinery: keep it all.
            for completion in completions {
                if completion.token == token {
                    mine = Some(completion);
                } else {
                    self.stashed.push(completion);
                }
            }
            if let Some(completion) = mine {
                self.io_purpose.remove(&token);
                completion.result?;
                return Ok(completion.buf);
            }
        }
    }

    fn complete(&mut self, completion: IoCompletion) {
        let Some(purpose) = self.io_purpose.remove(&completion.token) else {
            tracing::error!(
                shard = self.shard_id,
                token = completion.token,
                "completion for unknown I/O"
            );
            return;
        };
        match purpose {
            IoPurpose::PageLoad(page) => self.page_loaded(page, completion),
            IoPurpose::PageWrite { page, pages, writes } => {
                for number in page.1..page.1 + pages {
                    let was_in_flight = self.pages_in_flight.remove(&(page.0, number));
                    assert!(was_in_flight, "a page write completed that was not in flight");
                    self.cache.unpin((page.0, number));
                }
                self.writes_completed(writes, completion.result);
            }
            IoPurpose::DirectWrite(write) => self.writes_completed(vec![write], completion.result),
            IoPurpose::DirectRead(read) => self.direct_read_done(read, completion),
            IoPurpose::Sync => unreachable!("sync completions are consumed by sync_io"),
            IoPurpose::ScrubRead(read) => self.scrub_read_done(read, completion),
            IoPurpose::GcRead(read) => self.gc_read_done(read, completion),
        }
    }

    fn writes_completed(
        &mut self,
        writes: Vec<WriteId>,
        result: Result<(), crate::device::DeviceError>,
    ) {
        let reaped_through = self.device.write_completions_reaped();
        for write in &writes {
            if let Some(pending) = self.writes.get_mut(write) {
                pending.reaped_through = Some(reaped_through);
            }
        }
        match result {
            Ok(()) => match self.durability {
                WriteDurability::Dsync => self.writes_durable(writes),
                WriteDurability::FlushPerRound => self.awaiting_flush.extend(writes),
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

    /// FlushPerRound: one flush makes every write that completed this round durable.
    fn flush_round(&mut self) {
        if self.awaiting_flush.is_empty() {
            return;
        }
        let writes = std::mem::take(&mut self.awaiting_flush);
        match self.device.flush() {
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
        if let Err(err) = self.device.fault_point(FaultPoint::SlabWrittenBeforeIndexUpdate) {
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

    fn answer_flush_waiters(&mut self) {
        if self.flush_waiters.is_empty() {
            return;
        }
        let oldest = self.writes.keys().next().copied().unwrap_or(WriteId::MAX);
        let ready: Vec<_> = {
            let (ready, waiting) = std::mem::take(&mut self.flush_waiters)
                .into_iter()
                .partition(|(watermark, _)| oldest >= *watermark);
            self.flush_waiters = waiting;
            ready
        };
        if ready.is_empty() {
            return;
        }
        let result = if self.is_poisoned() {
            Err(WriteError::Poisoned)
        } else {
            self.device.flush().map_err(|err| {
                self.poison();
                WriteError::from_device(err)
            })
        };
        for (_, reply) in ready {
            let _ = reply.send(result.clone());
        }
    }

    /// Where a slot starts: (file, byte offset of its first page).
    fn slot_position(&self, loc: Loc) -> (FileId, u64) {
        let class = SizeClass::get(loc.class());
        let file = self.classes[loc.class() as usize].as_ref().expect("class file is open");
        (file.file, class.page_of_slot(loc.slot()) * PAGE_BYTES as u64)
    }

    /// The record layout of a class's slab file (which must be open).
    fn layout_of(&self, class: u8) -> RecordLayout {
        self.classes[class as usize].as_ref().expect("class file is open").layout
    }

    fn page_of(loc: Loc) -> PageKey {
        let class = SizeClass::get(loc.class());
        (loc.class(), class.page_of_slot(loc.slot()))
    }

    /// Registers a waiter for a page image, reading the page if no read is under way.
    fn wait_page(&mut self, page: PageKey, waiter: PageWaiter) {
        let first = !self.loading.contains_key(&page);
        self.loading.entry(page).or_default().push(waiter);
        if first {
            let file = self.classes[page.0 as usize].as_ref().expect("class file is open").file;
            self.queue_io(
                IoKind::Read,
                file,
                page.1 * PAGE_BYTES as u64,
                AlignedBuf::zeroed(PAGE_BYTES),
                IoPurpose::PageLoad(page),
            );
        }
    }

    fn page_loaded(&mut self, page: PageKey, completion: IoCompletion) {
        let waiters = self.loading.remove(&page).unwrap_or_default();
        if let Err(err) = completion.result {
            tracing::error!(shard = self.shard_id, ?page, %err, "page read failed");
            for waiter in waiters {
                self.page_waiter_failed(waiter, &err);
            }
            return;
        }
        assert!(!self.cache.contains(page), "a page was read while a newer image was cached");
        self.cache.insert(page, &completion.buf[..PAGE_BYTES]);
        // Pin while the waiters run so that a waiter's own page reads cannot evict it.
        self.cache.pin(page);
        for waiter in waiters {
            self.run_page_waiter(waiter);
        }
        self.cache.unpin(page);
    }

    fn run_page_waiter(&mut self, waiter: PageWaiter) {
        match waiter {
            PageWaiter::Place { write, offset, record } => {
                let loc = self.writes[&write].loc;
                self.place_in_page(Self::page_of(loc), offset, record, write);
            }
            PageWaiter::Get { key, reply } => self.get(key, reply),
            PageWaiter::ScanItem { scan, item } => self.scan_item(scan, item),
            PageWaiter::ChainPop { class, chain, slot } => {
                let class_info = SizeClass::get(class);
                let page = (class, class_info.page_of_slot(slot));
                let offset = class_info.offset_in_page(slot);
                let image = self.cache.image(page).expect("page was just loaded");
                let bytes = image[offset..offset + class_info.slot_bytes as usize].to_vec();
                self.chain_head_read(class, chain, slot, &bytes);
            }
        }
    }

    fn page_waiter_failed(&mut self, waiter: PageWaiter, err: &crate::device::DeviceError) {
        match waiter {
            PageWaiter::Place { write, .. } => {
                self.write_failed(write, WriteError::from_device(err.clone()))
            }
            PageWaiter::Get { reply, .. } => {
                let _ = reply.send(Err(ReadError::Device(err.clone())));
            }
            PageWaiter::ScanItem { scan, .. } => {
                self.scan_item_failed(scan, ReadError::Device(err.clone()))
            }
            PageWaiter::ChainPop { class, chain, .. } => self.free[class as usize].abort(chain),
        }
    }

    fn direct_read_done(&mut self, read: DirectRead, completion: IoCompletion) {
        if let Err(err) = completion.result {
            match read {
                DirectRead::Get { reply, .. } => {
                    let _ = reply.send(Err(ReadError::Device(err)));
                }
                DirectRead::ScanItem { scan, .. } => {
                    self.scan_item_failed(scan, ReadError::Device(err))
                }
                DirectRead::ChainPop { class, chain, .. } => self.free[class as usize].abort(chain),
            }
            return;
        }
        match read {
            DirectRead::Get { key, loc, reply } => {
                self.direct_get_done(key, loc, reply, &completion.buf)
            }
            DirectRead::ScanItem { scan, item, loc } => {
                self.direct_scan_item_done(scan, item, loc, &completion.buf)
            }
            DirectRead::ChainPop { class, chain, slot } => {
                self.chain_head_read(class, chain, slot, &completion.buf)
            }
        }
    }

    /// Forgets every cached page that matches the disk, so that the next reads go to the device
    /// (a cold-cache benchmark, or a simulator checking what the device really holds). Pages
    /// with modifications not yet durable stay.
    pub fn drop_clean_pages(&mut self) {
        self.cache.drop_unpinned();
    }

    /// Whether the collector is emptying a block now (for tests that crash during collection).
    pub fn collecting(&self) -> bool {
        self.gc.is_some()
    }

    pub fn stats(&self) -> ShardStats {
        let mut classes = Vec::new();
        let mut file_bytes = 0;
        for (id, file) in self.classes.iter().enumerate() {
            let Some(file) = file else { continue };
            let class = SizeClass::get(id as u8);
            file_bytes += file.file_bytes;
            let free_in_memory = self.free[id].in_memory() as u64;
            let free_on_disk = self.free[id].on_disk();
            let slot_bytes = class.slot_bytes as u64;
            let (live_slots, dead_slots, append) = match &self.append[id] {
                Some(append) => {
                    let figures = append.figures();
                    (figures.used_slots, figures.dead_slots, figures)
                }
                None => {
                    let free = free_in_memory + free_on_disk;
                    (file.next_append_slot.saturating_sub(free), free, Default::default())
                }
            };
            classes.push(ClassStats {
                class: id as u8,
                slot_bytes: class.slot_bytes,
                placement: self.placements[id],
                file_bytes: file.file_bytes,
                slots_used: file.next_append_slot,
                free_in_memory,
                free_on_disk,
                live_bytes: live_slots * slot_bytes,
                dead_bytes: dead_slots * slot_bytes,
                append,
                device_bytes_written: self.device_bytes_written[id],
                user_bytes_written: self.user_bytes_written[id],
            });
        }
        ShardStats {
            shard: self.shard_id,
            items: self.index.len() as u64,
            file_bytes,
            index_bytes: self.index.memory_bytes(),
            cache_pages: self.cache.len_pages() as u64,
            cache_capacity_pages: self.cache.capacity_frames() as u64,
            cache_hits: self.cache.hits,
            cache_misses: self.cache.misses,
            device: self.device.stats(),
            recovery: self.recovery.clone(),
            classes,
            tombstones_held: self.tombstone_guards.values().map(|locs| locs.len() as u64).sum(),
            parts_held: self.parts.len() as u64,
        }
    }
}

impl NativeEngine {
    /// Every sequence number up to this one belongs to a record that is durable (or to nothing
    /// on disk). Written into each record's `aux`.
    fn durable_watermark(&self) -> u64 {
        match self.unfinished_seqs.keys().next() {
            Some(&oldest) => oldest - 1,
            None => self.next_seq - 1,
        }
    }

    fn hold_seq(&mut self, seq: u64) {
        *self.unfinished_seqs.entry(seq).or_default() += 1;
    }

    fn finish_seq(&mut self, seq: u64) {
        let holders =
            self.unfinished_seqs.get_mut(&seq).expect("finishing a sequence number never held");
        *holders -= 1;
        if *holders == 0 {
            self.unfinished_seqs.remove(&seq);
        }
    }
}

/// The hash under which stale copies of a key are counted (invariant 4).
fn key_hash(key: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(key, 0x5741_4c45)
}

/// The native engine is a shard engine (the contract: `engine::ShardEngine`).
impl ShardEngine for NativeEngine {
    fn shard_id(&self) -> u32 {
        self.shard_id
    }

    /// Handles a run of requests of one kind. The native engine needs no special treatment of a
    /// run: its batching happens at the page level, when the round ends.
    fn handle_run(&mut self, run: Vec<Request>) {
        debug_assert!(run.windows(2).all(|pair| pair[0].kind() == pair[1].kind()));
        for request in run {
            self.handle(request);
        }
    }

    /// Handles one request: answers it now (cache hits, misses of the index, bad state) or
    /// queues the I/O it needs.
    fn handle(&mut self, request: Request) {
        match request {
            Request::Get { key, reply } => self.get(key, reply),
            Request::Put { key, value, reply } => self.put(key, value, Origin::Put(reply), None),
            Request::Delete { key, reply } => self.delete(key, reply),
            Request::Batch { ops, reply } => self.batch(ops, reply),
            Request::Scan { start, end, limit, reply } => self.scan(start, end, limit, reply),
            // In place, a write is at its final place once durable, so settling is flushing; in
            // append placement it also waits for the collector to rest.
            Request::Settle { reply } => self.settle(reply),
            Request::Flush { reply } => {
                if self.is_poisoned() {
                    let _ = reply.send(Err(WriteError::Poisoned));
                } else {
                    self.flush_waiters.push((self.next_write_id, reply));
                }
            }
            Request::Stats { reply } => {
                let _ = reply.send(Ok(self.stats()));
            }
            Request::Scrub { reply } => self.scrub(reply),
            Request::PreparePart { gsn, participants, ops, reply } => {
                self.prepare_part(gsn, participants, ops, reply)
            }
            Request::CommitPart { gsn, reply } => self.commit_part(gsn, reply),
            Request::ForgetPart { gsn, reply } => self.forget_part(gsn, reply),
        }
    }

    /// Ends a round: hands dirty pages to the device and submits the round's I/O with one call.
    fn end_round(&mut self) {
        self.retry_deferred_frees();
        self.refill_free_lists();
        self.schedule_page_writes();
        self.gc_step();
        // The collector's moves join this round's page writes.
        self.schedule_page_writes();
        self.settle_step();
        self.scrub_step();
        self.submit_ready();
        self.answer_flush_waiters();
    }

    /// Reaps completions (waiting for at least one if `wait` and I/O is in flight) and
    /// completes the requests they finish.
    fn reap(&mut self, wait: bool) {
        let mut completions = std::mem::take(&mut self.stashed);
        let min = usize::from(wait && completions.is_empty() && self.device.in_flight() > 0);
        if let Err(err) = self.device.reap(min, &mut completions) {
            tracing::error!(shard = self.shard_id, %err, "reaping I/O failed");
            self.poison();
        }
        for completion in completions {
            self.complete(completion);
        }
        self.flush_round();
        self.answer_flush_waiters();
    }

    /// True when nothing is queued, in flight, or waiting for a later round.
    fn is_idle(&self) -> bool {
        self.io_ready.is_empty()
            && self.device.in_flight() == 0
            && self.dirty.is_empty()
            && self.awaiting_flush.is_empty()
            && self.stashed.is_empty()
            && self.flush_waiters.is_empty()
            && self.deferred_frees.is_empty()
            && !self.scrub_running()
            && self.gc.is_none()
            && self.settle_waiters.is_empty()
    }

    /// Whether the index holds `key` (its newest durable version is live). No I/O.
    fn contains_key(&self, key: &[u8]) -> bool {
        self.index.contains(key)
    }

    /// Up to `limit` indexed keys of the range, in order. No I/O.
    fn index_keys(
        &self,
        start: std::ops::Bound<&[u8]>,
        end: std::ops::Bound<&[u8]>,
        limit: usize,
    ) -> Vec<Vec<u8>> {
        self.index.range(start, end, limit).into_iter().map(|(key, _)| key.into_vec()).collect()
    }

    /// Indexed keys in the range, counting no further than `limit`. No I/O.
    fn count_keys(
        &self,
        start: std::ops::Bound<&[u8]>,
        end: std::ops::Bound<&[u8]>,
        limit: usize,
    ) -> usize {
        self.index.count(start, end, limit)
    }

    fn has_io_in_flight(&self) -> bool {
        self.device.in_flight() > 0
    }

    /// With no I/O in flight, every state that keeps the engine from idling moves at the next
    /// round by itself: I/O queued by the last completions is submitted (`io_ready`, and the
    /// pages in `dirty`, none of which can have a write in flight), stashed completions are
    /// reaped, deferred frees find their chains free (a chain is busy only while its push or
    /// pop has I/O queued or in flight), a scrub or a collection issues its next reads or moves
    /// (at least `GC_MOVES_PER_ROUND_MIN` a round), settles pass to the flush waiters once the
    /// collector rests, and flush waiters wait only for writes in one of those states. So the
    /// engine never waits on a timer: it is ready exactly when it is neither idle nor in I/O.
    fn has_work_ready(&self) -> bool {
        !self.is_idle() && !self.has_io_in_flight()
    }

    /// The device's fd, unless completions reaped by `sync_io` wait in `stashed`: then the
    /// next reap has work at once.
    fn completion_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        if self.stashed.is_empty() {
            self.device.completion_fd()
        } else {
            None
        }
    }

    fn recovered_parts(&self) -> Vec<crate::engine::part::PartRecord> {
        self.recovered_parts.clone()
    }

    /// Finishes all outstanding work and makes it durable.
    fn close(&mut self) -> Result<(), WriteError> {
        self.closing = true;
        while !self.is_idle() {
            self.end_round();
            self.reap(true);
            if self.is_poisoned() && self.device.in_flight() == 0 {
                break;
            }
        }
        if self.is_poisoned() {
            return Err(WriteError::Poisoned);
        }
        self.write_watermark_record()?;
        self.device.flush().map_err(WriteError::from_device)
    }
}
