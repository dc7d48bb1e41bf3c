//! The native engine (KVell): one shard's unsorted size-class slabs, its index, page cache and
//! free lists, driven by the shard thread as a state machine over batched asynchronous I/O.
//!
//! `NativeEngine` is a set of parts, each in its own file with the methods that change it:
//! `Io` (`io.rs`: device, queued requests, what each is for), `Pages` (`pages.rs`: page cache,
//! page reads and their waiters, dirty pages, pages with a write in flight), `Slabs`
//! (`slabs.rs`: slab files, free lists, growth), `Seqs` (`seqs.rs`: sequence numbers, flights,
//! stale copies, tombstone guards), `Writes` (`write.rs`: writes until durable, flush and
//! settle waiters), `Collector` (`gc.rs`: placement and the collector), `Index` (`index.rs`),
//! `Batches` (`batch.rs`), `Scans` (`read.rs`), cross-shard parts (`parts.rs`) and the scrub
//! (`scrub.rs`). The engine keeps what coordinates several parts: opening, the dispatch of
//! requests and completions (`IoPurpose`), the stats, and `ShardEngine`; the operations that
//! span parts live with the part they mostly serve, as further `impl NativeEngine` blocks.
//!
//! Reading order: `format.rs` (what is on disk), this file (the parts, open, dispatch), `io.rs`,
//! `pages.rs`, `slabs.rs` (allocating and freeing slots), `seqs.rs`, `write.rs` (puts, deletes,
//! placing records, durability), `batch.rs`, `parts.rs`, `read.rs` (gets, scans), `recovery.rs`
//! (rebuilding state from the slabs), then `placement.rs` + `gc.rs`, `scrub.rs`, `check.rs`.
//!
//! Invariants (the reasons are in docs/durability.md):
//! 1. The bytes of a live record (the one the index points to) are never overwritten. A new
//!    version goes to a free slot; the old slot is freed only after the new one is durable, and
//!    the index is updated at that moment, so a torn write can only damage a slot nobody needs.
//!    Asserted where a record is encoded (`place`, `place_in_page` in `write.rs`).
//! 2. A write is answered only when durable (`WriteDurability`): its completion was reaped
//!    before a flush began, and that flush finished (or, under `Dsync`, it completed). Checked,
//!    in release builds too, against the device's own count of what its flushes covered
//!    (`PendingWrite::reaped_through`, asserted in `write_durable`).
//! 3. A page has at most one write in flight; modifications made meanwhile ride the next write
//!    (asserted where a page write is queued and where it completes: `Pages::begin_write`,
//!    `Pages::end_write`).
//! 4. For every key, the disk holds at most: its newest record (live item or tombstone) and
//!    older copies that are stale. Every stale copy is counted (`Seqs`) under the key's
//!    hash until it is overwritten or erased; a tombstone is kept while its key's count is
//!    non-zero, so no stale copy can come back at recovery.
//! 5. Writes of one key may be in flight together; each carries a sequence number and only the
//!    highest one that completed is applied (`Flight`), so completion order does not matter.
//!    Asserted where the index changes: a put replaces only a lower seq, a collector move keeps
//!    the seq and the slot the index pointed to, recovery indexes each key once.

pub mod batch;
pub mod chain;
pub mod cache;
pub mod check;
mod cluster;
pub mod format;
pub mod free_list;
mod gc;

pub mod index;
mod io;
mod numbered;
mod pages;
mod parts;
pub mod placement;
mod read;
pub mod recovery;
mod scrub;
mod seqs;
mod slabs;
mod write;

use crate::hash::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::device::{BlockDevice, FaultPoint, IoCompletion};
use crate::engine::{ClassStats, RecoveryStats, Request, ShardEngine, ShardStats};
use crate::error::{OpenError, WriteError};

use batch::Batches;
use cache::PageKey;
use format::{Loc, SizeClass};
use gc::Collector;
use index::Index;
use io::Io;
use pages::Pages;
use placement::Placement;
use read::Scans;
use seqs::Seqs;
use slabs::Slabs;
use write::{Effect, Origin, Writes};

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
    /// The least room, in blocks, the collector leaves an append class past its live slots:
    /// `limits::GC_ROOM_BLOCKS_MIN` in a store; the simulator sets 0 so that its small stores
    /// collect all the time (what it tests is the collector's safety, not its pace).
    pub gc_room_blocks_min: u64,
    /// The largest value of one batch or part record; a larger one is a chain (`chain.rs`):
    /// `limits::BATCH_RECORD_BYTES_MAX` unless a test asks for less (`Options`).
    pub batch_record_bytes_max: usize,
    /// Shared by all shards: once any write or flush fails, every shard refuses writes.
    pub poisoned: Arc<AtomicBool>,
}

/// What a request queued or in flight is for (by its token, in `Io`): `complete` dispatches
/// each completion to the part that asked.
enum IoPurpose {
    /// A read of `pages` consecutive pages from `page` into the cache.
    PageLoad {
        page: PageKey,
        pages: u64,
    },
    /// `pages` consecutive pages from `page`, written with one I/O.
    PageWrite {
        page: PageKey,
        pages: u64,
        writes: Vec<WriteId>,
    },
    DirectWrite(WriteId),
    DirectRead(read::DirectRead),
    /// A synchronous request issued by `sync_io`.
    Sync,
    /// A read of the online scrub (`scrub.rs`).
    ScrubRead(scrub::ScrubRead),
    /// The collector's read of its victim block (`gc.rs`).
    GcRead(gc::GcRead),
}

pub struct NativeEngine {
    shard_id: u32,
    /// Shared by all shards: once any write or flush fails, every shard refuses writes.
    poisoned: Arc<AtomicBool>,
    /// `close` was called: no new collection starts.
    closing: bool,
    /// Per background flush in flight, oldest first: the writes it covers (`write::flush_round`).
    flushing: std::collections::VecDeque<Vec<WriteId>>,

    io: Io,
    pages: Pages,
    slabs: Slabs,
    seqs: Seqs,
    writes: Writes,
    collector: Collector,
    /// Scans' scattered items waiting to be rewritten side by side.
    clusters: cluster::Clusters,
    index: Index,

    batches: Batches,
    /// Cross-shard parts from `PreparePart` (or recovery) until `ForgetPart`, by gsn.
    parts: HashMap<u64, parts::Part>,
    /// What recovery found, for `recovered_parts`.
    recovered_parts: Vec<crate::engine::part::PartRecord>,
    scans: Scans,
    multi_gets: read::MultiGets,
    /// The online scrub under way, if any.
    scrub: Option<scrub::Scrub>,

    recovery: RecoveryStats,
    /// An in-page record being encoded (`write::place`), kept between records so that placing
    /// one allocates nothing; a record that must wait for its page takes it along.
    record_scratch: Vec<u8>,
    /// The largest value of one batch or part record (`EngineConfig`).
    batch_record_bytes_max: usize,
}

impl NativeEngine {
    /// Opens the shard: scans its slabs (recovery), then replays any batch whose record is
    /// durable but whose members are not all applied.
    pub fn open(
        device: Box<dyn BlockDevice>,
        config: EngineConfig,
        progress: Option<&indicatif::ProgressBar>,
    ) -> Result<NativeEngine, OpenError> {
        let mut engine = NativeEngine {
            shard_id: config.shard_id,
            poisoned: config.poisoned,
            closing: false,
            flushing: std::collections::VecDeque::new(),
            io: Io::new(config.shard_id, device, config.io_depth_max),
            pages: Pages::new(config.shard_id, config.cache_pages),
            slabs: Slabs::new(config.slab_growth_bytes_min),
            seqs: Seqs::new(),
            writes: Writes::new(),
            collector: Collector::new(
                config.placements,
                config.append_block_pages,
                config.space_amplification_max,
                config.gc_room_blocks_min,
            ),
            clusters: cluster::Clusters::new(),
            index: Index::default(),
            batches: Batches::new(),
            parts: HashMap::default(),
            recovered_parts: Vec::new(),
            scans: Scans::new(),
            multi_gets: read::MultiGets::new(),
            scrub: None,
            record_scratch: Vec::new(),
            recovery: RecoveryStats::default(),
            batch_record_bytes_max: config.batch_record_bytes_max,
        };
        engine.recover(progress)?;
        engine.seqs.mark_open();
        // Replayed batches must be applied before the shard answers anyone. A replay that failed
        // forgets its batch (even the last one), so the poison is what says the open failed:
        // the batch's keys are not applied, and a poisoned store refuses every write.
        while !engine.batches.is_empty() && !engine.is_poisoned() {
            engine.end_round();
            engine.io.device.fault_point(FaultPoint::RecoveryReplayingBatch)?;
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
        if !self.seqs.written_since_open() {
            // Nothing written since open: the records on disk are what recovery saw.
            return Ok(());
        }
        let class =
            format::SizeClass::for_record(format::record_bytes(0, format::LIVE_DIGEST_BYTES));
        let watermark = self.seqs.durable_watermark();
        let (slot, overwritten) = self.allocate(class, None, slabs::Appender::Foreground)?;
        let seq = self.seqs.take();
        let loc = Loc::new(class.id, slot, 0);
        let write = self.writes.add(loc, overwritten, Effect::Watermark);
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

    fn complete(&mut self, completion: IoCompletion) {
        let Some(purpose) = self.io.take_purpose(completion.token) else {
            tracing::error!(
                shard = self.shard_id,
                token = completion.token,
                "completion for unknown I/O"
            );
            return;
        };
        match purpose {
            IoPurpose::PageLoad { page, pages } => self.page_loaded(page, pages, completion),
            IoPurpose::PageWrite { page, pages, writes } => {
                for number in page.1..page.1 + pages {
                    self.pages.end_write((page.0, number));
                }
                self.pages.keep_buffer(completion.buf);
                let writes = match completion.result {
                    Ok(()) => self.writes.page_writes_done(writes),
                    // Every write that rode it fails, each once.
                    Err(_) => {
                        let mut writes = writes;
                        writes.sort_unstable();
                        writes.dedup();
                        writes
                    }
                };
                self.writes_completed(writes, completion.result);
            }
            IoPurpose::DirectWrite(write) => self.writes_completed(vec![write], completion.result),
            IoPurpose::DirectRead(read) => self.direct_read_done(read, completion),
            IoPurpose::Sync => unreachable!("sync completions are consumed by sync_io"),
            IoPurpose::ScrubRead(read) => self.scrub_read_done(read, completion),
            IoPurpose::GcRead(read) => self.gc_read_done(read, completion),
        }
    }

    /// Forgets every cached page that matches the disk, so that the next reads go to the device
    /// (a cold-cache benchmark, or a simulator checking what the device really holds). Pages
    /// with modifications not yet durable stay.
    #[cfg(any(test, feature = "testing"))]
    pub fn drop_clean_pages(&mut self) {
        self.pages.cache.drop_unpinned();
    }

    /// Whether the collector is emptying a block now (for tests that crash during collection).
    #[cfg(any(test, feature = "testing"))]
    pub fn collecting(&self) -> bool {
        self.collector.collecting()
    }

    pub fn stats(&self) -> ShardStats {
        let mut classes = Vec::new();
        let mut file_bytes = 0;
        for (class_id, file) in self.slabs.files() {
            let id = class_id as usize;
            let class = SizeClass::get(class_id);
            file_bytes += file.file_bytes;
            let free_in_memory = self.slabs.free[id].in_memory() as u64;
            let free_on_disk = self.slabs.free[id].on_disk();
            let (device_bytes_written, user_bytes_written) = self.slabs.written(class_id);
            let slot_bytes = class.slot_bytes as u64;
            let (live_slots, dead_slots, append) = match self.collector.append(class_id) {
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
                placement: self.collector.placement(class_id),
                file_bytes: file.file_bytes,
                slots_used: file.next_append_slot,
                free_in_memory,
                free_on_disk,
                live_bytes: live_slots * slot_bytes,
                dead_bytes: dead_slots * slot_bytes,
                append,
                device_bytes_written,
                user_bytes_written,
            });
        }
        ShardStats {
            shard: self.shard_id,
            items: self.index.len() as u64,
            file_bytes,
            index_bytes: self.index.memory_bytes(),
            cache_pages: self.pages.cache.len_pages() as u64,
            cache_capacity_pages: self.pages.cache.capacity_frames() as u64,
            cache_hits: self.pages.cache.hits,
            cache_misses: self.pages.cache.misses,
            device: self.io.device.stats(),
            recovery: self.recovery.clone(),
            classes,
            tombstones_held: self.seqs.tombstones_held(),
            parts_held: self.parts.len() as u64,
            // Counted beside the shard's loop; `Db::stats` fills them in.
            ..ShardStats::default()
        }
    }
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
        if run.len() > 1 && matches!(run[0], Request::Get { .. }) {
            let gets = run
                .into_iter()
                .map(|request| match request {
                    Request::Get { key, reply } => (key, reply),
                    _ => unreachable!("a run is of one kind"),
                })
                .collect();
            return self.get_run(gets);
        }
        for request in run {
            self.handle(request);
        }
    }

    /// Handles one request: answers it now (cache hits, misses of the index, bad state) or
    /// queues the I/O it needs.
    fn handle(&mut self, request: Request) {
        match request {
            Request::Get { key, reply } => self.get(key, reply),
            Request::MultiGet { keys, reply } => self.multi_get(keys, reply),
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
                    self.writes.wait_for_flush(reply);
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
        self.cluster_step();
        self.gc_step();
        // The clustering and collector moves join this round's page writes.
        self.schedule_page_writes();
        self.settle_step();
        self.scrub_step();
        self.io.submit_ready();
        self.answer_flush_waiters();
    }

    /// Reaps completions (waiting for at least one if `wait` and I/O is in flight) and
    /// completes the requests they finish.
    fn reap(&mut self, wait: bool) {
        let mut completions = Vec::new();
        if let Err(err) = self.io.reap(wait, &mut completions) {
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
        self.io.is_quiet()
            && self.pages.is_clean()
            && self.writes.is_quiet()
            && !self.slabs.has_deferred_frees()
            && !self.scrub_running()
            && !self.collector.collecting()
            && self.clusters.is_empty()
    }

    /// Whether the index holds `key` (its newest durable version is live). No I/O.
    fn contains_key(&self, key: &[u8]) -> bool {
        self.index.contains(key)
    }

    fn has_keys_starting_with(&self, byte: u8) -> bool {
        self.index.has_first_byte(byte)
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
        self.io.in_flight() > 0
    }

    /// With no I/O in flight, every state that keeps the engine from idling moves at the next
    /// round by itself: I/O queued by the last completions is submitted (`io_ready`, and the
    /// pages in `dirty`, none of which can have a write in flight; a few writes' pages wait only
    /// while a background flush runs, which is I/O in flight: `schedule_page_writes`), stashed
    /// completions are reaped, deferred frees find their chains free (a chain is busy only while
    /// its push or pop has I/O queued or in flight), a scrub or a collection issues its next
    /// reads or moves (at least `GC_MOVES_PER_ROUND_MIN` a round), settles pass to the flush
    /// waiters once the collector rests, and flush waiters wait only for writes in one of those
    /// states. So the engine never waits on a timer: it is ready exactly when it is neither idle
    /// nor in I/O.
    fn has_work_ready(&self) -> bool {
        !self.is_idle() && !self.has_io_in_flight()
    }

    /// The device's fd, unless stashed completions wait (`Io::completion_fd`).
    fn completion_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        self.io.completion_fd()
    }

    fn defer_submission(&mut self, on: bool) {
        if let Err(err) = self.io.device.defer_submission(on) {
            tracing::error!(shard = self.shard_id, %err, "submitting I/O failed");
            self.poison();
        }
    }

    fn has_deferred_submission(&self) -> bool {
        self.io.device.has_deferred_submission()
    }

    fn take_reads(&mut self, max: usize) -> Vec<crate::device::TakenRead> {
        self.io.device.take_reads(max)
    }

    fn give_back(&mut self, reads: Vec<crate::device::TakenRead>) {
        self.io.device.give_back(reads);
    }

    fn taken_reads(&self) -> usize {
        self.io.device.taken_reads()
    }

    fn has_io_in_kernel(&self) -> bool {
        self.io.in_flight() > self.io.device.taken_reads()
    }

    /// Reads, writes and the round's flush go through the ring (the flush in the background:
    /// `write::flush_round`); what still runs in place is rare (creating or growing a file,
    /// `Db::flush`, close).
    fn can_share_thread(&self) -> bool {
        self.io.device.completes_asynchronously()
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
            if self.is_poisoned() && self.io.in_flight() == 0 {
                break;
            }
        }
        if self.is_poisoned() {
            return Err(WriteError::Poisoned);
        }
        self.write_watermark_record()?;
        self.io.device.flush().map_err(WriteError::from_device)
    }
}
