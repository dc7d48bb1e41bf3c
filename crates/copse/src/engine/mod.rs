//! Engines: what a shard runs its requests against: the native engine (KVell slabs, `native/`)
//! or, behind the `rocksdb` cargo feature, one RocksDB instance per shard (`rocks/`, p2KVS).
//! The Dotori engine comes with its issue behind the same contract.
//!
//! The contract between a shard and its engine is the [`ShardEngine`] trait and the [`Request`]
//! message: the engine answers each request exactly once through its reply channel, and answers
//! a write only when it is durable. Adding an engine means implementing [`ShardEngine`]; the
//! router, the shard loop, exec programs and everything above them then work unchanged.

pub mod batch_codec;
pub mod check;
pub mod factory;
pub mod input;
pub mod native;
pub mod part;
pub mod placement;
#[cfg(feature = "rocksdb")]
pub mod rocks;

use std::ops::Bound;
use std::os::fd::BorrowedFd;
use std::time::Instant;

use futures::channel::oneshot;
use serde::Serialize;

use crate::device::DeviceStats;
use crate::error::{ReadError, WriteError};

pub type Reply<T, E> = oneshot::Sender<Result<T, E>>;

/// Where the RocksDB engine keeps its instances (`rocksdb/shard-NNN`), relative to the store.
/// Here rather than in `rocks/`, so that a build without the `rocksdb` feature still knows it.
pub const ROCKSDB_DIR: &str = "rocksdb";

/// Which engine a store's shards run. Recorded in the manifest at creation; a store is always
/// opened with the engine that created it. persisted: never renumber.
#[repr(u32)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineKind {
    /// KVell slabs over copse's own device layer (`engine/native`).
    #[default]
    Native = 1,
    /// One RocksDB instance per shard (`engine/rocks`); needs the `rocksdb` cargo feature.
    RocksDb = 2,
}

impl EngineKind {
    pub fn from_persisted(value: u32) -> Option<EngineKind> {
        match value {
            1 => Some(EngineKind::Native),
            2 => Some(EngineKind::RocksDb),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            EngineKind::Native => "native",
            EngineKind::RocksDb => "rocksdb",
        }
    }

    /// Whether this build can open stores of this engine.
    pub fn available(self) -> bool {
        match self {
            EngineKind::Native => true,
            EngineKind::RocksDb => cfg!(feature = "rocksdb"),
        }
    }
}

impl std::str::FromStr for EngineKind {
    type Err = String;
    fn from_str(text: &str) -> Result<EngineKind, String> {
        match text {
            "native" => Ok(EngineKind::Native),
            "rocksdb" => Ok(EngineKind::RocksDb),
            other => Err(format!("unknown engine {other:?} (expected native or rocksdb)")),
        }
    }
}

impl std::fmt::Display for EngineKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Whether no key lies in the range `start..end`, an inverted one included. `BTreeMap::range`
/// panics on an inverted range; to every caller (an index, a view over a write group) it is
/// simply empty.
pub fn is_empty_range(start: Bound<&[u8]>, end: Bound<&[u8]>) -> bool {
    if let (Bound::Included(s) | Bound::Excluded(s), Bound::Included(e) | Bound::Excluded(e)) =
        (start, end)
    {
        return s > e
            || (s == e
                && !(matches!(start, Bound::Included(_)) && matches!(end, Bound::Included(_))));
    }
    false
}

/// One operation of a write batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BatchOp {
    Put { key: Vec<u8>, value: Vec<u8> },
    Delete { key: Vec<u8> },
}

impl BatchOp {
    pub fn key(&self) -> &[u8] {
        match self {
            BatchOp::Put { key, .. } | BatchOp::Delete { key } => key,
        }
    }
}

pub type KeyValue = (Vec<u8>, Vec<u8>);

/// A message to a shard. Limits were checked by the caller.
pub enum Request {
    Get {
        key: Vec<u8>,
        reply: Reply<Option<Vec<u8>>, ReadError>,
    },
    /// Several keys' values, as of one moment (a batch is seen whole or not at all), in the
    /// keys' order.
    MultiGet {
        keys: Vec<Vec<u8>>,
        reply: Reply<Vec<Option<Vec<u8>>>, ReadError>,
    },
    Put {
        key: Vec<u8>,
        value: Vec<u8>,
        reply: Reply<(), WriteError>,
    },
    /// Answers whether the key existed.
    Delete {
        key: Vec<u8>,
        reply: Reply<bool, WriteError>,
    },
    /// All-or-nothing within the shard, also across a crash.
    Batch {
        ops: Vec<BatchOp>,
        reply: Reply<(), WriteError>,
    },
    /// The shard's first `limit` items in the range, in key order.
    Scan {
        start: Bound<Vec<u8>>,
        end: Bound<Vec<u8>>,
        limit: usize,
        reply: Reply<Vec<KeyValue>, ReadError>,
    },
    /// Answers once every write the shard accepted before it is durable.
    Flush {
        reply: Reply<(), WriteError>,
    },
    /// As `Flush`, and also waits until the engine's background work (RocksDB's flushes and
    /// compactions) is done, so that a benchmark phase does not pay for the previous one's.
    Settle {
        reply: Reply<(), WriteError>,
    },
    Stats {
        reply: Reply<ShardStats, ReadError>,
    },
    /// Verifies every item and page checksum the shard holds against the device (not the
    /// cache), paced so that foreground requests keep flowing; answers with what it found. A
    /// scrub asked for while one runs shares its report.
    Scrub {
        reply: Reply<ScrubReport, ReadError>,
    },
    /// Makes this shard's part of a cross-shard batch durable without applying it (see
    /// `part.rs`): nothing reads its operations until `CommitPart`. Answers once durable. The
    /// shard never sends two parts with the same gsn, nor a part whose keys another live part
    /// holds. `ops` hold one operation per key and pass `input::check_part`.
    PreparePart {
        gsn: u64,
        participants: Vec<u32>,
        ops: Vec<BatchOp>,
        reply: Reply<(), WriteError>,
    },
    /// Applies a prepared part (from `PreparePart`, or found by recovery) and marks it
    /// committed, both or neither across a crash: its writes are newer than every write the
    /// engine accepted before. Answers once durable and visible. A committed part stays stored
    /// until `ForgetPart`.
    CommitPart {
        gsn: u64,
        reply: Reply<(), WriteError>,
    },
    /// Erases a part, prepared or committed, durably; answers once the erasure is durable. A
    /// prepared part's operations are dropped unapplied. Forgetting an unknown gsn is Ok.
    ForgetPart {
        gsn: u64,
        reply: Reply<(), WriteError>,
    },
}

impl Request {
    /// Requests of one kind form a run that the shard hands to its engine together.
    pub fn kind(&self) -> RequestKind {
        match self {
            Request::Get { .. } => RequestKind::Get,
            Request::Put { .. } | Request::Delete { .. } | Request::Batch { .. } => {
                RequestKind::Write
            }
            Request::Scan { .. } | Request::MultiGet { .. } => RequestKind::Scan,
            Request::Flush { .. }
            | Request::Settle { .. }
            | Request::Stats { .. }
            | Request::Scrub { .. } => RequestKind::Control,
            Request::PreparePart { .. }
            | Request::CommitPart { .. }
            | Request::ForgetPart { .. } => RequestKind::Part,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestKind {
    Get,
    Write,
    /// Reads of several keys at one moment: scans and multi-gets.
    Scan,
    Control,
    /// The cross-shard batch protocol; never parked behind the keys it holds.
    Part,
}

/// What recovery found when the shard opened.
#[derive(Clone, Debug, Default, Serialize)]
pub struct RecoveryStats {
    pub bytes_scanned: u64,
    pub items: u64,
    pub stale_copies: u64,
    pub tombstones: u64,
    pub free_slots: u64,
    /// Slots whose bytes did not verify (torn writes, bit flips). Never indexed.
    pub torn_or_corrupt: u64,
    /// Keys whose newest record was durable once and is damaged now (bit rot): they read as
    /// corrupt until rewritten, never as an older value.
    pub damaged_items: u64,
    /// The first defective slots found (up to 20), each with its location and what is wrong:
    /// where to look when `torn_or_corrupt` is not zero.
    pub defects_sample: Vec<String>,
    pub batches_replayed: u64,
    /// Records of chains (a batch or part too large for one record) found incomplete and erased:
    /// the crash came before the chain was whole (nothing of it was written or acknowledged) or
    /// while it was being erased.
    pub broken_chain_records: u64,
    /// 1 if the shard was last closed cleanly, nothing was written since, and the live items
    /// found differ from the digest that close recorded: a write acknowledged before the close
    /// was lost or misdirected by the device, or a record's name rotted away. Which key, the
    /// digest cannot tell; `defects_sample` says what differs.
    pub lost_writes_detected: u64,
    /// Cross-shard parts found (prepared or committed), reported to the router.
    pub parts: u64,
    /// Of those, parts found committed (replayed by the shard itself).
    pub parts_committed: u64,
    pub seconds: f64,
}

/// Problems a scrub lists at most; the rest are only counted.
pub const SCRUB_PROBLEMS_LISTED_MAX: usize = 100;

/// What an online scrub of one shard (or, merged, of the store) found.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ScrubReport {
    /// Pages read and verified slot by slot (slab headers included).
    pub pages_checked: u64,
    /// Live items read from the device and matched against the index (key and seq).
    pub items_checked: u64,
    /// Pages read again because a write to them started while they were being read.
    pub pages_reread: u64,
    pub problems_found: u64,
    /// The first `SCRUB_PROBLEMS_LISTED_MAX` problems, each with its location.
    pub problems: Vec<String>,
}

impl ScrubReport {
    pub fn problem(&mut self, what: String) {
        self.problems_found += 1;
        if self.problems.len() < SCRUB_PROBLEMS_LISTED_MAX {
            self.problems.push(what);
        }
    }

    pub fn merge(&mut self, other: ScrubReport) {
        self.pages_checked += other.pages_checked;
        self.items_checked += other.items_checked;
        self.pages_reread += other.pages_reread;
        self.problems_found += other.problems_found;
        let room = SCRUB_PROBLEMS_LISTED_MAX.saturating_sub(self.problems.len());
        self.problems.extend(other.problems.into_iter().take(room));
    }
}

/// One size class's figures (of a shard, or summed over a store's shards).
#[derive(Clone, Debug, Default, Serialize)]
pub struct ClassStats {
    pub class: u8,
    pub slot_bytes: u32,
    pub placement: placement::Placement,
    pub file_bytes: u64,
    /// Slots ever handed out (the file's written part).
    pub slots_used: u64,
    pub free_in_memory: u64,
    pub free_on_disk: u64,
    /// Slots holding something live (items, tombstones still needed, records in flight).
    pub live_bytes: u64,
    /// Slots holding nothing live: in place, free slots waiting for reuse; appended, dead
    /// slots of blocks not yet collected.
    pub dead_bytes: u64,
    /// Append placement: blocks and the collector's work (zeros in place).
    pub append: placement::AppendFigures,
    /// Bytes the device was asked to write for this class, and bytes of keys and values users
    /// asked to write into it; their ratio is the class's write amplification.
    pub device_bytes_written: u64,
    pub user_bytes_written: u64,
}

impl ClassStats {
    /// Adds another shard's figures of the same class.
    pub fn merge(&mut self, other: &ClassStats) {
        debug_assert_eq!(self.class, other.class);
        self.file_bytes += other.file_bytes;
        self.slots_used += other.slots_used;
        self.free_in_memory += other.free_in_memory;
        self.free_on_disk += other.free_on_disk;
        self.live_bytes += other.live_bytes;
        self.dead_bytes += other.dead_bytes;
        self.append.merge(&other.append);
        self.device_bytes_written += other.device_bytes_written;
        self.user_bytes_written += other.user_bytes_written;
    }

    /// Device bytes written per user byte written (0 before any user write).
    pub fn write_amplification(&self) -> f64 {
        write_amplification(self.device_bytes_written, self.user_bytes_written)
    }
}

/// Device bytes written per user byte written (0 before any user write): one definition for a
/// class's figure and the store's.
pub fn write_amplification(device_bytes_written: u64, user_bytes_written: u64) -> f64 {
    if user_bytes_written == 0 {
        0.0
    } else {
        device_bytes_written as f64 / user_bytes_written as f64
    }
}

/// One shard's figures, for `copse stats`.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ShardStats {
    pub shard: u32,
    pub items: u64,
    pub file_bytes: u64,
    pub index_bytes: u64,
    pub cache_pages: u64,
    pub cache_capacity_pages: u64,
    pub cache_hits: u64,
    pub cache_misses: u64,
    pub device: DeviceStats,
    pub recovery: RecoveryStats,
    pub classes: Vec<ClassStats>,
    pub tombstones_held: u64,
    /// Parts of cross-shard batches held (prepared or committed, not yet forgotten).
    pub parts_held: u64,
    /// Reads of the embedded API (`Db::get`) whose caller ran the shard's turns itself (flat combining, `shard/combine.rs`) instead of waking the shard's thread.
    pub requests_combined: u64,
    /// Such callers that found the loop held by another driver and woke the thread instead.
    pub combine_found_busy: u64,
    /// Combining callers that left I/O held back for the shard's thread to submit.
    pub combine_left_io_for_thread: u64,
    /// Reads that combining callers took from their turns and performed on their own threads
    /// without the loop (`shard/combine.rs`, invariant 5).
    pub combine_reads_taken: u64,
}

/// One shard's engine, as the shard thread drives it (`shard/mod.rs`). The shard thread owns the
/// engine; nothing else touches it. The loop, per round:
/// 1. hands over the round's requests in runs of one kind, in arrival order ([`handle_run`]): an
///    engine may turn a run of puts into one write and a run of gets into one multi-read;
/// 2. lets exec programs add their reads and writes ([`handle`]) and ask index questions
///    ([`contains_key`], [`index_keys`], [`count_keys`]: answered from memory, no I/O);
/// 3. ends the round ([`end_round`]: submit the round's I/O together);
/// 4. reaps completions ([`reap`], blocking for one only when told to) and answers what they
///    finish.
///
/// Between rounds that bring nothing new the loop sleeps, never for a fixed time: until a
/// message, a completion ([`completion_fd`]) or the engine's [`next_deadline`]. Which of those it
/// waits for, the engine says:
/// - [`is_idle`]: nothing is queued, in flight or deferred; the loop waits for a message (or the
///   deadline).
/// - [`has_io_in_flight`]: the loop waits for a completion: it polls [`completion_fd`] with its
///   queue and the deadline, then reaps; with no fd it calls `reap(true)`, which must then return
///   without a long wait (the device completes on demand).
/// - otherwise, [`has_work_ready`]: the next round moves without anything arriving, so the loop
///   runs it at once; or not, and then the engine must give a [`next_deadline`], which the loop
///   sleeps until (a message may come first).
///
/// Obligations: answer every request exactly once (also on failure, also at [`close`]); answer a
/// write only once it is durable; never panic on a request (limits were checked by the caller,
/// but I/O errors and corrupt data are answered as errors); after a failed flush refuse writes
/// (poisoned). [`is_idle`] must be true only when nothing is queued, in flight or deferred, so the
/// loop may block on its queue. An engine that is not idle and has no I/O in flight is either
/// ready ([`has_work_ready`], and then the next round makes progress, so the loop never spins
/// while waiting) or has a deadline; it never waits on something that can wake neither.
///
/// [`handle_run`]: ShardEngine::handle_run
/// [`handle`]: ShardEngine::handle
/// [`contains_key`]: ShardEngine::contains_key
/// [`index_keys`]: ShardEngine::index_keys
/// [`count_keys`]: ShardEngine::count_keys
/// [`end_round`]: ShardEngine::end_round
/// [`reap`]: ShardEngine::reap
/// [`close`]: ShardEngine::close
/// [`is_idle`]: ShardEngine::is_idle
/// [`has_io_in_flight`]: ShardEngine::has_io_in_flight
/// [`has_work_ready`]: ShardEngine::has_work_ready
/// [`completion_fd`]: ShardEngine::completion_fd
/// [`next_deadline`]: ShardEngine::next_deadline
pub trait ShardEngine: Send {
    fn shard_id(&self) -> u32;
    /// A run of requests of one kind, in arrival order.
    fn handle_run(&mut self, run: Vec<Request>);
    /// One request (exec programs issue theirs one at a time).
    fn handle(&mut self, request: Request);
    /// Submits the round's work.
    fn end_round(&mut self);
    /// Completes finished work, waiting for at least one completion if `wait` and any is in
    /// flight.
    fn reap(&mut self, wait: bool);
    fn is_idle(&self) -> bool;
    fn has_io_in_flight(&self) -> bool;
    /// Asked after a round's reap when the engine is neither idle nor has I/O in flight: whether
    /// the next round makes progress with nothing new arriving (work deferred to it, such as I/O
    /// queued by the last completions). False means the engine waits for its `next_deadline`.
    fn has_work_ready(&self) -> bool;
    /// With I/O in flight: a file descriptor that polls readable once a completion can be
    /// reaped, so the loop can wait for one together with its queue. `None` when `reap(true)`
    /// returns at once (completions are already held, or the device makes them on demand).
    fn completion_fd(&self) -> Option<BorrowedFd<'_>> {
        None
    }
    /// The earliest time at which the engine has work that nothing else will bring (a timer, a
    /// poll of background work); the loop runs a round by then at the latest. `None`: no such
    /// time. Asked each time the loop is about to sleep.
    fn next_deadline(&self) -> Option<Instant> {
        None
    }
    /// Holds back (`on`) the system call that hands the round's I/O to the kernel, or makes it
    /// now (`false`): a caller running the shard's turn on its own thread defers, the shard's
    /// thread does not (`BlockDevice::defer_submission`, `shard/combine.rs`).
    fn defer_submission(&mut self, on: bool) {
        let _ = on;
    }
    /// I/O queued and held back by `defer_submission`: the shard's thread must submit it.
    fn has_deferred_submission(&self) -> bool {
        false
    }
    /// The held-back I/O, if it is at most `max` reads, for a combining caller to perform on its
    /// own thread and give back (`BlockDevice::take_reads`, `shard/combine.rs`, invariant 5).
    fn take_reads(&mut self, max: usize) -> Vec<crate::device::TakenRead> {
        let _ = max;
        Vec::new()
    }
    /// Completes reads taken by `take_reads`; the next `reap` hands them to the engine.
    fn give_back(&mut self, reads: Vec<crate::device::TakenRead>) {
        assert!(reads.is_empty(), "this engine hands out no reads to take");
    }
    /// Reads taken by `take_reads` and not yet given back: I/O in flight that no completion of
    /// the device will announce.
    fn taken_reads(&self) -> usize {
        0
    }
    /// Whether I/O is in flight that the device will announce a completion of (`completion_fd`):
    /// any but reads taken by `take_reads`.
    fn has_io_in_kernel(&self) -> bool {
        self.has_io_in_flight()
    }
    /// Whether the engine's rounds may run on a thread that also serves other work (a server's
    /// network thread, thread-per-core): its I/O is submitted and completed without blocking
    /// the thread, and a completion is announced through `completion_fd`. An engine that
    /// reads, writes or syncs in place (RocksDB, the synchronous device) keeps a thread of its
    /// own.
    fn can_share_thread(&self) -> bool {
        false
    }
    /// Whether `key` holds a live value. No I/O.
    fn contains_key(&self, key: &[u8]) -> bool;
    /// Up to `limit` live keys of the range, in order. No I/O.
    fn index_keys(&self, start: Bound<&[u8]>, end: Bound<&[u8]>, limit: usize) -> Vec<Vec<u8>>;
    /// Live keys in the range, counting no further than `limit`. No I/O.
    fn count_keys(&self, start: Bound<&[u8]>, end: Bound<&[u8]>, limit: usize) -> usize;
    /// Whether a live key starts with `byte`. No I/O; the native engine answers from a count per
    /// first byte, with no lookup.
    fn has_keys_starting_with(&self, byte: u8) -> bool {
        let (start, end) = first_byte_range(&byte);
        self.count_keys(start, end, 1) > 0
    }
    /// The parts recovery found when the engine opened and that are not forgotten yet (see
    /// `part.rs`), each with the state on the device. Asked once, right after open.
    fn recovered_parts(&self) -> Vec<part::PartRecord>;
    /// Finishes all outstanding work and makes it durable.
    fn close(&mut self) -> Result<(), WriteError>;
}

/// The range of keys whose first byte is `*byte`.
pub(crate) fn first_byte_range(byte: &u8) -> (Bound<&[u8]>, Bound<&'static [u8]>) {
    const NEXT: [[u8; 1]; 256] = {
        let mut next = [[0u8; 1]; 256];
        let mut at = 0;
        while at < 255 {
            next[at] = [at as u8 + 1];
            at += 1;
        }
        next
    };
    let end = match *byte {
        u8::MAX => Bound::Unbounded,
        below => Bound::Excluded(&NEXT[below as usize][..]),
    };
    (Bound::Included(std::slice::from_ref(byte)), end)
}
