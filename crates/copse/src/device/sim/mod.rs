//! The simulated device: an in-memory disk for tests, deterministic from a seed, with crashes,
//! torn writes, bit flips and injected errors.
//!
//! Model. A [`SimDisk`] is one disk shared by every shard thread (`Arc<Mutex<State>>`); each
//! [`SimDevice`] opened on it has its own file-id table and in-flight queue, but file names are the
//! disk's. Every file has two images:
//! - *volatile*: what a read returns now (every completed write applied);
//! - *durable*: what a reboot is sure to find.
//!
//! A write is applied to the volatile image when it completes (at `reap`). Under `Dsync` it is
//! durable at that moment; otherwise it is remembered in `pending` ("completed, not durable")
//! until a `flush` *of the device that completed it* applies it to the durable image. A flush
//! covers only the writes its device completed before the flush began, as an fdatasync covers
//! only its own file: never a write still in flight, never another shard's writes. Completions
//! may be held back across several reaps ([`SimDisk::hold_completions`]), so a write submitted
//! in one round can complete after later rounds were flushed and acknowledged. `grow_file` and
//! file creation are durable at once (the real devices fsync them).
//!
//! Crash. After a crash every operation fails with `Crashed`. [`SimDisk::restart`] builds the
//! image a reboot would find: the durable image, then each pending write in completion order, then
//! each write in flight at the crash, each independently kept whole, dropped, or torn (a prefix or
//! a random subset of its 512-byte sectors new, the rest old, never all or none). A pending
//! `Dsync` write (one that completed while non-durable writes were pending) is always kept, after
//! the ones before it, so it is never undone by an older write replayed over it.
//!
//! Invariants:
//! - `pending` is empty or starts with a non-durable write: a durable write with nothing pending
//!   goes straight to the durable image, so a `Dsync`-only workload keeps no history.
//! - Every random choice comes from the disk's one `ChaCha8Rng`, and every map is ordered, so one
//!   device driven from one thread gives the same results for the same seed and calls.
//! - Nothing panics on an I/O path: bad requests and injected faults become completion errors.
//!   The test helpers (`flip_bit`, …) assert on misuse.
//!
//! Reads past the end of a file complete with `Short` (and the bytes that exist), as on the real
//! devices, so an engine test sees the same error for a truncated file on either.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::files;
use super::{
    BlockDevice, DeviceError, DeviceStats, FaultPoint, FileId, IoCompletion, IoKind, IoRequest,
    Storage, WriteDurability,
};
use crate::limits::SECTOR_BYTES;

mod device;
pub use device::{SimDevice, SimStorage};

/// `InFlight::held_reaps` of a write held by pattern: it never counts down.
const HELD_UNTIL_RELEASED: u32 = u32::MAX;

/// The simulator keeps whole files in memory; a write that would make a file larger than this is
/// rejected as a bad request (it is an engine bug, and would exhaust the test machine's memory).
pub const SIM_FILE_BYTES_MAX: u64 = 1 << 32;

/// The kind of operation a fault injected with [`SimDisk::fail_nth`] applies to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultOp {
    Read,
    Write,
    Flush,
    Grow,
    /// Any of the above.
    Any,
}

/// The error an injected fault produces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultError {
    /// EIO: `DeviceError::Io`.
    Io,
    /// ENOSPC: `DeviceError::NoSpace`.
    NoSpace,
}

/// What a fault armed at a named point with [`SimDisk::fault_at_point`] does when it fires.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PointFault {
    /// The disk crashes there (as [`SimDisk::crash_now`]); the point answers `Crashed`.
    Crash,
    /// The point answers this error; the disk goes on.
    Fail(FaultError),
}

/// A silent write fault armed with [`SimDisk::fault_nth_write`]: the device reports success.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WriteFault {
    /// Acknowledged but never stored: neither a read nor a restart sees it.
    Lost,
    /// Stored at another page-aligned offset of the same file (chosen from the seed), so the
    /// intended place keeps its old bytes and the place it lands on loses its own.
    Misdirected,
}

/// A silent write fault that fired: where the write was meant to go, and where it went.
#[derive(Clone, PartialEq, Eq)]
pub struct InjectedWriteFault {
    pub fault: WriteFault,
    pub name: String,
    pub offset: u64,
    pub len: u64,
    /// For a misdirected write: the offset it was stored at.
    pub landed_at: Option<u64>,
    /// The bytes the write carried (never stored where they were sent).
    pub sent: Vec<u8>,
    /// The bytes the fault left in force in place of `sent`: for a lost write those already at
    /// `offset`; for a misdirected one those it overwrote at `landed_at` (lost themselves).
    /// Later writes may carry either on: a page read back and rewritten keeps what the fault
    /// left, so the damage can outlive the pages it first struck.
    pub displaced: Vec<u8>,
    /// The bytes at `offset` before the write, which stay there in place of `sent` (for a lost
    /// write, the same as `displaced`). A write that was to erase a record leaves it in force.
    pub kept: Vec<u8>,
}

impl std::fmt::Debug for InjectedWriteFault {
    // The bytes are pages long: their lengths say enough in a failure message.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InjectedWriteFault")
            .field("fault", &self.fault)
            .field("name", &self.name)
            .field("offset", &self.offset)
            .field("len", &self.len)
            .field("landed_at", &self.landed_at)
            .field("sent_bytes", &self.sent.len())
            .field("displaced_bytes", &self.displaced.len())
            .finish()
    }
}

/// What [`SimDisk::restart`] did to the writes that were not durable at the crash (completed but
/// not flushed, or in flight). One count per write request, whatever its length.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RestartStats {
    pub kept_writes: u64,
    pub dropped_writes: u64,
    pub torn_writes: u64,
}

/// An in-memory disk shared by the devices of every shard thread. Cloning shares the disk.
#[derive(Clone)]
pub struct SimDisk {
    state: Arc<Mutex<State>>,
}

#[derive(Default)]
struct SimFile {
    durable: Vec<u8>,
    volatile: Vec<u8>,
    /// Once a silent write fault fired on the disk: the volatile image as it would be had every
    /// write landed where it was sent (`None`: the same as `volatile`). It follows writes only.
    intended: Option<Vec<u8>>,
}

/// A write that is not (known to be) durable: completed and pending, or in flight at a crash.
struct WriteRecord {
    /// The device that completed it: only that device's flush makes it durable.
    device: u64,
    name: String,
    offset: u64,
    data: Vec<u8>,
    /// Completed under `Dsync`: a crash keeps it whole.
    durable: bool,
}

struct Fault {
    op: FaultOp,
    error: FaultError,
    /// 1-based: the `nth` matching operation after arming fails.
    nth: u64,
    seen: u64,
    persistent: bool,
}

struct InFlight {
    request: IoRequest,
    name: String,
    /// Decided at submit: `Err` for a bad request or an injected fault.
    outcome: Result<(), DeviceError>,
    /// Reaps this request sits out before it may complete (see `hold_completions`); a reap
    /// that must return more completions than the unheld requests can give releases it early.
    held_reaps: u32,
}

#[derive(Default)]
struct DeviceSlot {
    in_flight: Vec<InFlight>,
    stats: DeviceStats,
    write_completions_reaped: u64,
    write_completions_durable: u64,
}

struct State {
    seed: u64,
    rng: ChaCha8Rng,
    files: BTreeMap<String, SimFile>,
    /// Completed writes not yet durable, in completion order (see the header's invariant).
    pending: Vec<WriteRecord>,
    devices: BTreeMap<u64, DeviceSlot>,
    next_device_id: u64,
    /// Counted operations so far (requests at submit, flushes, grows).
    ops: u64,
    /// The operation count at which the disk crashes (the op that would make it `ops + 1`).
    crash_at_ops: Option<u64>,
    crashed: bool,
    in_flight_at_crash: Vec<WriteRecord>,
    faults: Vec<Fault>,
    /// Armed silent write faults: (fault, the successful write it hits, 1-based from arming).
    write_faults: Vec<(WriteFault, u64)>,
    /// Successful writes performed since the disk was made (counts for `write_faults`).
    writes_performed: u64,
    injected_write_faults: Vec<InjectedWriteFault>,
    /// Armed faults at named points: (point, the hit it fires at, counted in `point_hits`).
    point_faults: Vec<(FaultPoint, u64, PointFault)>,
    /// How often each named fault point was reached (on a disk that had not crashed).
    point_hits: BTreeMap<FaultPoint, u64>,
    points_fired: Vec<(FaultPoint, PointFault)>,
    stats: DeviceStats,
    restart_stats: RestartStats,
    /// `hold_completions`: the chance that a submitted request is held, and for how many reaps
    /// at most.
    hold_probability: f64,
    hold_reaps_max: u32,
    /// Requests held back so far.
    held_requests: u64,
    /// `hold_writes_containing`: writes whose bytes contain this are held until released.
    hold_pattern: Option<Vec<u8>>,
}

impl State {
    fn new(seed: u64, rng: ChaCha8Rng) -> State {
        State {
            seed,
            rng,
            files: BTreeMap::new(),
            pending: Vec::new(),
            devices: BTreeMap::new(),
            next_device_id: 0,
            ops: 0,
            crash_at_ops: None,
            crashed: false,
            in_flight_at_crash: Vec::new(),
            faults: Vec::new(),
            write_faults: Vec::new(),
            writes_performed: 0,
            injected_write_faults: Vec::new(),
            point_faults: Vec::new(),
            point_hits: BTreeMap::new(),
            points_fired: Vec::new(),
            stats: DeviceStats::default(),
            restart_stats: RestartStats::default(),
            hold_probability: 0.0,
            hold_reaps_max: 0,
            held_requests: 0,
            hold_pattern: None,
        }
    }

    /// The gate of every counted operation: crashes the disk when the armed crash point is
    /// reached, counts the operation, and fires matching faults.
    fn begin_op(
        &mut self,
        kind: FaultOp,
        what: impl FnOnce() -> String,
    ) -> Result<(), DeviceError> {
        if self.crashed {
            return Err(DeviceError::Crashed);
        }
        if self.crash_at_ops.is_some_and(|at| self.ops >= at) {
            self.crash();
            return Err(DeviceError::Crashed);
        }
        self.ops += 1;
        let mut fired = None;
        for fault in &mut self.faults {
            if fault.op == FaultOp::Any || fault.op == kind {
                fault.seen += 1;
                if fault.seen == fault.nth || (fault.persistent && fault.seen > fault.nth) {
                    fired.get_or_insert(fault.error);
                }
            }
        }
        match fired {
            None => Ok(()),
            Some(FaultError::Io) => Err(DeviceError::Io { what: what() }),
            Some(FaultError::NoSpace) => Err(DeviceError::NoSpace { what: what() }),
        }
    }

    /// Marks the disk crashed and records the writes in flight at this moment.
    fn crash(&mut self) {
        if self.crashed {
            return;
        }
        self.crashed = true;
        self.crash_at_ops = None;
        for slot in self.devices.values() {
            for item in &slot.in_flight {
                // A bad or faulted request never reaches the media.
                if item.request.kind == IoKind::Write && item.outcome.is_ok() {
                    self.in_flight_at_crash.push(WriteRecord {
                        device: u64::MAX,
                        name: item.name.clone(),
                        offset: item.request.offset,
                        data: item.request.buf.to_vec(),
                        durable: false,
                    });
                }
            }
        }
    }

    /// Applies `update` to the disk's stats and to those of `device` (if it is still open).
    fn bump(&mut self, device: u64, update: impl Fn(&mut DeviceStats)) {
        update(&mut self.stats);
        if let Some(slot) = self.devices.get_mut(&device) {
            update(&mut slot.stats);
        }
    }

    /// Performs a request that leaves the in-flight queue.
    fn complete(
        &mut self,
        device: u64,
        durability: WriteDurability,
        item: InFlight,
    ) -> IoCompletion {
        let InFlight { mut request, name, outcome, .. } = item;
        let result = if self.crashed {
            Err(DeviceError::Crashed)
        } else {
            outcome.and_then(|()| self.perform(device, durability, &mut request, &name))
        };
        if result.is_ok() {
            let bytes = request.buf.len() as u64;
            match request.kind {
                IoKind::Read => self.bump(device, |s| {
                    s.reads += 1;
                    s.bytes_read += bytes;
                }),
                IoKind::Write => self.bump(device, |s| {
                    s.writes += 1;
                    s.bytes_written += bytes;
                }),
            }
        }
        IoCompletion::of(request, result)
    }

    fn perform(
        &mut self,
        device: u64,
        durability: WriteDurability,
        request: &mut IoRequest,
        name: &str,
    ) -> Result<(), DeviceError> {
        let Some(file) = self.files.get_mut(name) else {
            // Files are never deleted, so this is a simulator bug; report it, do not panic.
            return Err(DeviceError::NotFound { name: name.to_string() });
        };
        let start = request.offset as usize;
        match request.kind {
            IoKind::Read => {
                // Like pread: the bytes up to the end of the file, then a short count.
                let available = file.volatile.len().saturating_sub(start).min(request.buf.len());
                if available > 0 {
                    request.buf[..available]
                        .copy_from_slice(&file.volatile[start..start + available]);
                }
                files::transfer_result(request, name, available)
            }
            IoKind::Write => {
                self.writes_performed += 1;
                let performed = self.writes_performed;
                // Where the bytes land: `None` for a lost write.
                let mut landing = Some(request.offset);
                if let Some(at) = self.write_faults.iter().position(|(_, nth)| *nth == performed) {
                    let (fault, _) = self.write_faults.swap_remove(at);
                    for file in self.files.values_mut() {
                        if file.intended.is_none() {
                            file.intended = Some(file.volatile.clone());
                        }
                    }
                    let offset = request.offset;
                    let len = request.buf.len() as u64;
                    let mut injected = InjectedWriteFault {
                        fault,
                        name: name.to_string(),
                        offset,
                        len,
                        landed_at: None,
                        sent: request.buf.to_vec(),
                        displaced: Vec::new(),
                        kept: Vec::new(),
                    };
                    // Another whole-page position inside the file; a file with room for this
                    // write only once loses it instead.
                    let file_len = self.files.get(name).map_or(0, |f| f.volatile.len());
                    let page = crate::limits::PAGE_BYTES as u64;
                    let positions = (file_len as u64).saturating_sub(len) / page + 1;
                    if fault == WriteFault::Lost || positions < 2 {
                        injected.fault = WriteFault::Lost;
                        landing = None;
                    } else {
                        let mut landed = self.rng.gen_range(0..positions - 1) * page;
                        if landed >= offset {
                            landed += page;
                        }
                        injected.landed_at = Some(landed);
                        landing = Some(landed);
                    }
                    let left_at = injected.landed_at.unwrap_or(offset) as usize;
                    let volatile = self.files.get(name).map_or(&[][..], |f| &f.volatile[..]);
                    let bytes_at = |start: usize| -> Vec<u8> {
                        (start..start + len as usize)
                            .map(|at| volatile.get(at).copied().unwrap_or(0))
                            .collect()
                    };
                    injected.displaced = bytes_at(left_at);
                    injected.kept = bytes_at(offset as usize);
                    self.injected_write_faults.push(injected);
                }
                let file = self.files.get_mut(name).expect("looked up above");
                if let Some(intended) = &mut file.intended {
                    write_into(intended, request.offset, &request.buf);
                }
                let Some(offset) = landing else {
                    return Ok(());
                };
                write_into(&mut file.volatile, offset, &request.buf);
                if durability == WriteDurability::Dsync && self.pending.is_empty() {
                    write_into(&mut file.durable, offset, &request.buf);
                } else {
                    self.pending.push(WriteRecord {
                        device,
                        name: name.to_string(),
                        offset,
                        data: request.buf.to_vec(),
                        durable: durability == WriteDurability::Dsync,
                    });
                }
                Ok(())
            }
        }
    }

    /// Makes durable the pending writes that `device` completed, then any durable (`Dsync`)
    /// writes now at the head of `pending` (the header's invariant). Shards write disjoint
    /// files, so the writes left pending never overlap the ones applied.
    fn flush_pending(&mut self, device: u64) {
        let (mine, others): (Vec<_>, Vec<_>) =
            std::mem::take(&mut self.pending).into_iter().partition(|r| r.device == device);
        self.pending = others;
        for record in mine {
            let file = self.files.entry(record.name).or_default();
            write_into(&mut file.durable, record.offset, &record.data);
        }
        let durable_head = self.pending.iter().take_while(|record| record.durable).count();
        for record in self.pending.drain(..durable_head).collect::<Vec<_>>() {
            let file = self.files.entry(record.name).or_default();
            write_into(&mut file.durable, record.offset, &record.data);
        }
    }
}

/// Copies `data` into `image` at `offset`, extending the image with zeros as needed.
fn write_into(image: &mut Vec<u8>, offset: u64, data: &[u8]) {
    let start = offset as usize;
    let end = start + data.len();
    if image.len() < end {
        image.resize(end, 0);
    }
    image[start..end].copy_from_slice(data);
}

/// What a crash does to one non-durable write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fate {
    Kept,
    Dropped,
    Torn,
}

/// Applies a torn version of `data`: a prefix of its sectors (power lost mid-transfer) or a random
/// subset (the device reorders sectors), never all or none.
fn tear(rng: &mut ChaCha8Rng, image: &mut Vec<u8>, offset: u64, data: &[u8]) {
    let sectors = data.len() / SECTOR_BYTES;
    assert!(sectors >= 2, "a page-aligned write has at least two sectors");
    let mut new_sector = vec![false; sectors];
    if rng.gen_bool(0.5) {
        let prefix = rng.gen_range(1..sectors);
        new_sector[..prefix].fill(true);
    } else {
        for new in new_sector.iter_mut() {
            *new = rng.gen_bool(0.5);
        }
        let pick = rng.gen_range(0..sectors);
        if new_sector.iter().all(|&new| new) {
            new_sector[pick] = false;
        } else if new_sector.iter().all(|&new| !new) {
            new_sector[pick] = true;
        }
    }
    for (index, new) in new_sector.into_iter().enumerate() {
        if new {
            let range = index * SECTOR_BYTES..(index + 1) * SECTOR_BYTES;
            write_into(image, offset + range.start as u64, &data[range]);
        }
    }
}

impl SimDisk {
    pub fn new(seed: u64) -> SimDisk {
        let state = State::new(seed, ChaCha8Rng::seed_from_u64(seed));
        SimDisk { state: Arc::new(Mutex::new(state)) }
    }

    /// A lock that survives a panicking test thread (the state stays consistent: every mutation
    /// completes under the lock before anything can panic).
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn seed(&self) -> u64 {
        self.lock().seed
    }

    /// A `Storage` whose devices all work on this disk.
    pub fn storage(&self, durability: WriteDurability) -> SimStorage {
        SimStorage { disk: self.clone(), durability }
    }

    /// A device on this disk (what `storage(durability).open_device()` returns, unboxed).
    pub fn device(&self, durability: WriteDurability) -> SimDevice {
        let mut state = self.lock();
        let id = state.next_device_id;
        state.next_device_id += 1;
        state.devices.insert(id, DeviceSlot::default());
        SimDevice { disk: self.clone(), id, durability, files: Vec::new() }
    }

    /// Arms a crash: the next `ops` counted operations run, and the one after them (and every
    /// later one) fails with `Crashed`. Counted: each request at submit, each flush, each grow.
    /// `crash_after_ops(0)` crashes at the next operation. No effect on a crashed disk.
    pub fn crash_after_ops(&self, ops: u64) {
        let mut state = self.lock();
        if !state.crashed {
            state.crash_at_ops = Some(state.ops + ops);
        }
    }

    /// Crashes now: requests in flight are "in flight at the crash".
    pub fn crash_now(&self) {
        self.lock().crash();
    }

    pub fn has_crashed(&self) -> bool {
        self.lock().crashed
    }

    /// The disk a reboot would find, as a new disk (fresh op counter, no faults or crash armed,
    /// the random stream and `hold_completions` continued). Crashes this disk first if it has not crashed.
    pub fn restart(&self) -> SimDisk {
        let mut guard = self.lock();
        guard.crash();
        let state = &mut *guard;
        let mut images: BTreeMap<String, Vec<u8>> =
            state.files.iter().map(|(name, file)| (name.clone(), file.durable.clone())).collect();
        let mut stats = RestartStats::default();
        for record in state.pending.iter().chain(state.in_flight_at_crash.iter()) {
            let image = images.entry(record.name.clone()).or_default();
            if record.durable {
                write_into(image, record.offset, &record.data);
                continue;
            }
            let fate = match state.rng.gen_range(0..3) {
                0 => Fate::Kept,
                1 => Fate::Dropped,
                _ => Fate::Torn,
            };
            match fate {
                Fate::Kept => {
                    stats.kept_writes += 1;
                    write_into(image, record.offset, &record.data);
                }
                Fate::Dropped => stats.dropped_writes += 1,
                Fate::Torn => {
                    stats.torn_writes += 1;
                    tear(&mut state.rng, image, record.offset, &record.data);
                }
            }
        }
        let mut next = State::new(state.seed, state.rng.clone());
        next.files = images
            .into_iter()
            .map(|(name, image)| {
                (name, SimFile { durable: image.clone(), volatile: image, intended: None })
            })
            .collect();
        next.restart_stats = stats;
        // The disk holds completions back after a reboot as before it.
        next.hold_probability = state.hold_probability;
        next.hold_reaps_max = state.hold_reaps_max;
        SimDisk { state: Arc::new(Mutex::new(next)) }
    }

    /// From now on each request submitted is held back with chance `probability`: it sits out
    /// 1 to `reaps_max` reaps of its device (chosen from the seed) before it may complete, so
    /// later rounds may complete, flush and be acknowledged first. A reap that must return more
    /// completions than the other requests can give releases held ones.
    pub fn hold_completions(&self, probability: f64, reaps_max: u32) {
        assert!((0.0..=1.0).contains(&probability) && reaps_max >= 1);
        let mut state = self.lock();
        state.hold_probability = probability;
        state.hold_reaps_max = reaps_max;
    }

    /// From now on every write whose bytes contain `pattern` is held back, in flight, until
    /// [`SimDisk::release_held_writes`] (or until a reap cannot return its minimum without it):
    /// a test can keep one chosen write landing late (a collector's move of a chosen value).
    pub fn hold_writes_containing(&self, pattern: &[u8]) {
        assert!(!pattern.is_empty());
        self.lock().hold_pattern = Some(pattern.to_vec());
    }

    /// Writes held by `hold_writes_containing` and still in flight.
    pub fn writes_held_until_released(&self) -> usize {
        let state = self.lock();
        let held = |slot: &DeviceSlot| {
            slot.in_flight.iter().filter(|item| item.held_reaps == HELD_UNTIL_RELEASED).count()
        };
        state.devices.values().map(held).sum()
    }

    /// Stops holding writes by pattern, and lets every held request complete at the next reap.
    pub fn release_held_writes(&self) {
        let mut state = self.lock();
        state.hold_pattern = None;
        for slot in state.devices.values_mut() {
            for item in &mut slot.in_flight {
                item.held_reaps = 0;
            }
        }
    }

    /// Requests held back by `hold_completions` or `hold_writes_containing` on this disk (a
    /// restarted disk counts from 0).
    pub fn held_requests(&self) -> u64 {
        self.lock().held_requests
    }

    /// On a disk returned by `restart`: what happened to the non-durable writes. Zero otherwise.
    pub fn restart_stats(&self) -> RestartStats {
        self.lock().restart_stats
    }

    /// Arms a fault: the `n`th (1-based, counting from now) operation of kind `op` fails with
    /// `error`; if `persistent`, so does every later one of that kind. A failed write changes
    /// nothing; a failed flush makes nothing durable; a failed grow leaves the size.
    pub fn fail_nth(&self, n: u64, op: FaultOp, error: FaultError, persistent: bool) {
        assert!(n >= 1, "fail_nth counts from 1");
        self.lock().faults.push(Fault { op, error, nth: n, seen: 0, persistent });
    }

    /// Arms a silent write fault: the `n`th (1-based, counting from now) write the device
    /// performs successfully reports success but is lost or misdirected (see [`WriteFault`]).
    pub fn fault_nth_write(&self, n: u64, fault: WriteFault) {
        assert!(n >= 1, "fault_nth_write counts from 1");
        let mut state = self.lock();
        let nth = state.writes_performed + n;
        state.write_faults.push((fault, nth));
    }

    /// Arms a fault at a named point: the `n`th (1-based, counting from now) time the engine
    /// reaches `point` on this disk, `fault` happens there (once).
    pub fn fault_at_point(&self, point: FaultPoint, n: u64, fault: PointFault) {
        assert!(n >= 1, "fault_at_point counts from 1");
        let mut state = self.lock();
        let at_hit = state.point_hits.get(&point).copied().unwrap_or(0) + n;
        state.point_faults.push((point, at_hit, fault));
    }

    /// How often each named point was reached on this disk (a restarted disk starts at zero).
    pub fn fault_point_hits(&self) -> BTreeMap<FaultPoint, u64> {
        self.lock().point_hits.clone()
    }

    /// The faults armed with [`SimDisk::fault_at_point`] that fired, in order.
    pub fn fault_points_fired(&self) -> Vec<(FaultPoint, PointFault)> {
        self.lock().points_fired.clone()
    }

    /// The pages (file name, byte offset) whose bytes differ from what they would be had every
    /// write landed where it was sent: the damage of the silent write faults that fired, less
    /// what later writes covered. Past a file's end the images read as zeros.
    pub fn silently_damaged_pages(&self) -> Vec<(String, u64)> {
        let page = crate::limits::PAGE_BYTES;
        let state = self.lock();
        let mut damaged = Vec::new();
        for (name, file) in &state.files {
            let Some(intended) = &file.intended else { continue };
            let len = intended.len().max(file.volatile.len());
            let byte = |image: &[u8], at: usize| image.get(at).copied().unwrap_or(0);
            for start in (0..len).step_by(page) {
                let end = (start + page).min(len);
                if (start..end).any(|at| byte(intended, at) != byte(&file.volatile, at)) {
                    damaged.push((name.clone(), start as u64));
                }
            }
        }
        damaged
    }

    /// The bytes of a file as they would be had every write landed where it was sent (see
    /// [`SimDisk::silently_damaged_pages`]); `None` if there is no such file.
    pub fn intended_file(&self, name: &str) -> Option<Vec<u8>> {
        let state = self.lock();
        let file = state.files.get(name)?;
        Some(file.intended.clone().unwrap_or_else(|| file.volatile.clone()))
    }

    /// The silent write faults that fired so far, in order.
    pub fn injected_write_faults(&self) -> Vec<InjectedWriteFault> {
        self.lock().injected_write_faults.clone()
    }

    /// Flips one bit in the durable and in the volatile image (where the byte exists in each).
    /// Pending writes are not changed: to corrupt stored data, flip after a flush or a restart.
    pub fn flip_bit(&self, name: &str, byte_offset: u64, bit: u8) {
        assert!(bit < 8, "bit {bit} is not in a byte");
        let mut state = self.lock();
        let Some(file) = state.files.get_mut(name) else {
            panic!("flip_bit: no file {name:?}");
        };
        let at = byte_offset as usize;
        let mut flipped = false;
        for image in [&mut file.durable, &mut file.volatile] {
            if let Some(byte) = image.get_mut(at) {
                *byte ^= 1 << bit;
                flipped = true;
            }
        }
        assert!(flipped, "flip_bit: offset {byte_offset} is past the end of {name:?}");
    }

    /// Every file name on the disk, sorted.
    pub fn file_names(&self) -> Vec<String> {
        self.lock().files.keys().cloned().collect()
    }

    /// The volatile image of a file (what a read would return), or `None` if there is no file.
    pub fn read_file(&self, name: &str) -> Option<Vec<u8>> {
        self.lock().files.get(name).map(|file| file.volatile.clone())
    }

    /// Test helper: overwrites bytes in both images (creating the file, extending it with zeros),
    /// as if written and flushed. Pending writes replayed by a later `restart` may cover them.
    pub fn write_file_raw(&self, name: &str, offset: u64, bytes: &[u8]) {
        let mut state = self.lock();
        let file = state.files.entry(name.to_string()).or_default();
        write_into(&mut file.durable, offset, bytes);
        write_into(&mut file.volatile, offset, bytes);
    }

    /// Counted operations since this disk was created (or restarted).
    pub fn ops(&self) -> u64 {
        self.lock().ops
    }

    /// The sum of the stats of every device opened on this disk.
    pub fn stats(&self) -> DeviceStats {
        self.lock().stats
    }
}

impl std::fmt::Debug for SimDisk {
    // The images would flood the output; the identity and state are what a failing test needs.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = self.lock();
        f.debug_struct("SimDisk")
            .field("seed", &state.seed)
            .field("ops", &state.ops)
            .field("crashed", &state.crashed)
            .field("files", &state.files.len())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::AlignedBuf;
    use crate::limits::PAGE_BYTES;

    const PAGE: u64 = PAGE_BYTES as u64;

    /// A page whose every sector differs from the same sector of any other `fill`.
    fn page(fill: u8) -> AlignedBuf {
        let mut buf = AlignedBuf::zeroed(PAGE_BYTES);
        for (i, b) in buf.iter_mut().enumerate() {
            *b = fill.wrapping_add((i % 13) as u8);
        }
        buf
    }

    fn write(token: u64, file: FileId, page_no: u64, fill: u8) -> IoRequest {
        IoRequest { token, file, offset: page_no * PAGE, kind: IoKind::Write, buf: page(fill) }
    }

    fn read(token: u64, file: FileId, page_no: u64, pages: usize) -> IoRequest {
        IoRequest {
            token,
            file,
            offset: page_no * PAGE,
            kind: IoKind::Read,
            buf: AlignedBuf::zeroed(pages * PAGE_BYTES),
        }
    }

    fn reap_all(device: &mut dyn BlockDevice) -> Vec<IoCompletion> {
        let mut out = Vec::new();
        while device.in_flight() > 0 {
            device.reap(1, &mut out).unwrap();
        }
        out
    }

    fn page_of(image: &[u8], page_no: u64) -> &[u8] {
        &image[(page_no * PAGE) as usize..((page_no + 1) * PAGE) as usize]
    }

    #[test]
    fn round_trip_through_storage() {
        let disk = SimDisk::new(1);
        let storage = disk.storage(WriteDurability::FlushPerRound);
        assert!(storage.describe().contains("seed 1"));
        let mut device = storage.open_device().unwrap();
        let name = "shard-000/class-04.slab";
        assert_eq!(device.open_file(name, false), Err(DeviceError::NotFound { name: name.into() }));
        assert!(matches!(device.open_file("a/../b", true), Err(DeviceError::BadRequest(_))));
        let file = device.open_file(name, true).unwrap();
        assert_eq!(device.open_file(name, false).unwrap(), file);
        device.grow_file(file, 4 * PAGE).unwrap();
        device.grow_file(file, 2 * PAGE).unwrap();
        assert_eq!(device.file_len_bytes(file).unwrap(), 4 * PAGE);
        assert!(matches!(device.grow_file(file, 100), Err(DeviceError::BadRequest(_))));

        device.submit(vec![write(1, file, 0, 10), write(2, file, 3, 30)]).unwrap();
        assert_eq!(device.in_flight(), 2);
        let done = reap_all(device.as_mut());
        assert!(done.iter().all(|c| c.result.is_ok()));
        let mut tokens: Vec<u64> = done.iter().map(|c| c.token).collect();
        tokens.sort_unstable();
        assert_eq!(tokens, vec![1, 2]);

        device
            .submit(vec![
                read(10, file, 0, 4),
                read(11, file, 4, 1), // past the end
                read(12, file, 3, 2), // straddles the end
                IoRequest { offset: 512, ..read(13, file, 0, 1) }, // misaligned
                read(14, 9, 0, 1),    // unknown file
            ])
            .unwrap();
        let mut done = reap_all(device.as_mut());
        done.sort_by_key(|c| c.token);
        assert_eq!(done[0].result, Ok(()));
        assert_eq!(page_of(&done[0].buf, 0), &page(10)[..]);
        assert_eq!(page_of(&done[0].buf, 1), &[0u8; PAGE_BYTES][..]);
        assert_eq!(page_of(&done[0].buf, 3), &page(30)[..]);
        assert!(matches!(done[1].result, Err(DeviceError::Short { done: 0, wanted: 4096, .. })));
        assert!(matches!(done[2].result, Err(DeviceError::Short { done: 4096, wanted: 8192, .. })));
        assert_eq!(page_of(&done[2].buf, 0), &page(30)[..]);
        assert!(matches!(done[3].result, Err(DeviceError::BadRequest(_))));
        assert!(matches!(done[4].result, Err(DeviceError::BadRequest(_))));
        device.flush().unwrap();

        let other = disk.device(WriteDurability::FlushPerRound);
        drop(other);
        let mut second = storage.open_device().unwrap();
        second.open_file("shard-000/b.slab", true).unwrap();
        second.open_file("shard-001/c.slab", true).unwrap();
        second.open_file("top", true).unwrap();
        assert_eq!(second.list_files("shard-000").unwrap(), vec!["b.slab", "class-04.slab"]);
        assert_eq!(second.list_files("").unwrap(), vec!["top"]);
        assert_eq!(second.list_files("nothing").unwrap(), Vec::<String>::new());
        assert!(matches!(
            second.open_file("top/x", true),
            Err(DeviceError::Os { errno: libc::ENOTDIR, .. })
        ));
        assert!(matches!(
            second.open_file("shard-001", true),
            Err(DeviceError::Os { errno: libc::EISDIR, .. })
        ));
        assert_eq!(
            disk.file_names(),
            vec!["shard-000/b.slab", "shard-000/class-04.slab", "shard-001/c.slab", "top"]
        );

        let stats = device.stats();
        assert_eq!((stats.writes, stats.reads, stats.flushes), (2, 1, 1));
        assert_eq!((stats.bytes_written, stats.bytes_read), (2 * PAGE, 4 * PAGE));
        assert_eq!(disk.stats().writes, 2);
        // Counted: 2 writes + 3 valid reads (the past-the-end ones too) + 2 grows + 1 flush.
        assert_eq!(disk.ops(), 8);
        assert_eq!(disk.read_file(name).unwrap().len(), 4 * PAGE_BYTES);
        assert_eq!(disk.read_file("missing"), None);
    }

    #[test]
    fn completions_come_out_of_submission_order() {
        let disk = SimDisk::new(7);
        let mut device = disk.device(WriteDurability::Dsync);
        let file = device.open_file("f", true).unwrap();
        device.grow_file(file, 64 * PAGE).unwrap();
        device.submit((0..64).map(|p| write(p, file, p, p as u8)).collect()).unwrap();
        let mut out = Vec::new();
        let mut reaps = 0;
        while device.in_flight() > 0 {
            let before = out.len();
            device.reap(1, &mut out).unwrap();
            assert!(out.len() > before, "reap(1) must complete at least one");
            reaps += 1;
        }
        let tokens: Vec<u64> = out.iter().map(|c| c.token).collect();
        assert_ne!(tokens, (0..64).collect::<Vec<_>>(), "completions in submission order");
        let mut sorted = tokens.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..64).collect::<Vec<_>>());
        assert!(reaps > 1 && reaps < 64, "reap completed a random number: {reaps} calls");
        let image = disk.read_file("f").unwrap();
        for p in 0..64 {
            assert_eq!(page_of(&image, p), &page(p as u8)[..]);
        }
        // reap(0) may complete nothing, never more than is in flight, and works when idle.
        device.reap(0, &mut out).unwrap();
        device.reap(5, &mut out).unwrap();
        assert_eq!(out.len(), 64);
    }

    /// A workload whose crash image depends on every random choice: flushed pattern A, then
    /// pattern B on every page (some reaped, some still in flight), then a crash.
    fn crash_workload(seed: u64) -> (SimDisk, Vec<u64>) {
        let disk = SimDisk::new(seed);
        let mut device = disk.device(WriteDurability::FlushPerRound);
        let file = device.open_file("s/slab", true).unwrap();
        device.grow_file(file, 16 * PAGE).unwrap();
        device.submit((0..16).map(|p| write(p, file, p, 1)).collect()).unwrap();
        let mut order: Vec<u64> = reap_all(&mut device).iter().map(|c| c.token).collect();
        device.flush().unwrap();
        device.submit((0..16).map(|p| write(100 + p, file, p, 100)).collect()).unwrap();
        let mut out = Vec::new();
        device.reap(8, &mut out).unwrap();
        order.extend(out.iter().map(|c| c.token));
        disk.crash_now();
        (disk.restart(), order)
    }

    #[test]
    fn same_seed_same_results() {
        for seed in [0, 1, 99] {
            let (first, order_first) = crash_workload(seed);
            let (second, order_second) = crash_workload(seed);
            assert_eq!(order_first, order_second);
            assert_eq!(first.read_file("s/slab"), second.read_file("s/slab"));
            assert_eq!(first.restart_stats(), second.restart_stats());
        }
        let images: std::collections::BTreeSet<Vec<u8>> =
            (0..8).map(|seed| crash_workload(seed).0.read_file("s/slab").unwrap()).collect();
        assert!(images.len() > 1, "the seed changes nothing");
    }

    /// Sorts each page of a crash image into old (A), new (B) or torn, checking a torn page
    /// mixes whole 512-byte sectors of A and B.
    fn classify(image: &[u8], pages: u64, old: &[u8], new: &[u8]) -> RestartStats {
        let mut seen = RestartStats::default();
        for p in 0..pages {
            let got = page_of(image, p);
            if got == old {
                seen.dropped_writes += 1;
            } else if got == new {
                seen.kept_writes += 1;
            } else {
                seen.torn_writes += 1;
                for (s, sector) in got.chunks(SECTOR_BYTES).enumerate() {
                    let range = s * SECTOR_BYTES..(s + 1) * SECTOR_BYTES;
                    assert!(
                        sector == &old[range.clone()] || sector == &new[range],
                        "page {p} sector {s} is neither old nor new"
                    );
                }
            }
        }
        seen
    }

    #[test]
    fn crash_keeps_drops_and_tears_unflushed_writes() {
        let mut total = RestartStats::default();
        for seed in 0..40 {
            let (disk, _) = crash_workload(seed);
            let image = disk.read_file("s/slab").unwrap();
            assert_eq!(image.len(), 16 * PAGE_BYTES);
            let seen = classify(&image, 16, &page(1), &page(100));
            assert_eq!(seen, disk.restart_stats(), "seed {seed}");
            total.kept_writes += seen.kept_writes;
            total.dropped_writes += seen.dropped_writes;
            total.torn_writes += seen.torn_writes;
        }
        assert!(
            total.kept_writes > 0 && total.dropped_writes > 0 && total.torn_writes > 0,
            "{total:?}"
        );
    }

    #[test]
    fn in_flight_writes_at_crash_fail_and_may_land() {
        let mut landed = 0;
        for seed in 0..20 {
            let disk = SimDisk::new(seed);
            let mut device = disk.device(WriteDurability::Dsync);
            let file = device.open_file("f", true).unwrap();
            device.grow_file(file, 8 * PAGE).unwrap();
            device.submit((0..8).map(|p| write(p, file, p, 50)).collect()).unwrap();
            disk.crash_now();
            assert!(disk.has_crashed());
            let done = reap_all(&mut device);
            assert_eq!(done.len(), 8);
            assert!(done.iter().all(|c| c.result == Err(DeviceError::Crashed)));
            assert_eq!(device.flush(), Err(DeviceError::Crashed));
            assert_eq!(device.submit(vec![write(9, file, 0, 1)]), Err(DeviceError::Crashed));
            assert_eq!(device.in_flight(), 0);
            let rebooted = disk.restart();
            let stats = rebooted.restart_stats();
            assert_eq!(stats.kept_writes + stats.dropped_writes + stats.torn_writes, 8);
            let seen =
                classify(&rebooted.read_file("f").unwrap(), 8, &[0u8; PAGE_BYTES], &page(50));
            assert_eq!(seen, stats);
            landed += stats.kept_writes + stats.torn_writes;
            assert!(!rebooted.has_crashed());
            assert_eq!(rebooted.ops(), 0);
        }
        assert!(landed > 0);
    }

    #[test]
    fn durable_writes_survive_a_crash() {
        for seed in 0..10 {
            // Dsync: durable at completion, no flush.
            let disk = SimDisk::new(seed);
            let mut device = disk.device(WriteDurability::Dsync);
            let file = device.open_file("f", true).unwrap();
            device.grow_file(file, 8 * PAGE).unwrap();
            device.submit((0..8).map(|p| write(p, file, p, 70)).collect()).unwrap();
            reap_all(&mut device);
            let rebooted = disk.restart();
            assert_eq!(rebooted.restart_stats(), RestartStats::default());
            let image = rebooted.read_file("f").unwrap();
            for p in 0..8 {
                assert_eq!(page_of(&image, p), &page(70)[..], "seed {seed} page {p}");
            }

            // FlushPerRound: durable after flush; a Dsync write behind a pending write is kept.
            let disk = SimDisk::new(seed);
            let mut plain = disk.device(WriteDurability::FlushPerRound);
            let mut dsync = disk.device(WriteDurability::Dsync);
            let file = plain.open_file("g", true).unwrap();
            let same = dsync.open_file("g", false).unwrap();
            plain.grow_file(file, 2 * PAGE).unwrap();
            plain.submit(vec![write(0, file, 0, 80)]).unwrap();
            reap_all(&mut plain);
            plain.flush().unwrap();
            plain.submit(vec![write(1, file, 1, 81)]).unwrap();
            reap_all(&mut plain);
            dsync.submit(vec![write(2, same, 1, 82)]).unwrap();
            reap_all(&mut dsync);
            let image = disk.restart().read_file("g").unwrap();
            assert_eq!(page_of(&image, 0), &page(80)[..]);
            assert_eq!(
                page_of(&image, 1),
                &page(82)[..],
                "seed {seed}: older write replayed over a durable one"
            );
        }
    }

    #[test]
    fn crash_after_ops_counts_requests_flushes_and_grows() {
        let disk = SimDisk::new(3);
        let mut device = disk.device(WriteDurability::FlushPerRound);
        let file = device.open_file("f", true).unwrap();
        disk.crash_after_ops(4);
        device.grow_file(file, 8 * PAGE).unwrap(); // 1
        device.submit(vec![write(0, file, 0, 5), write(1, file, 1, 5)]).unwrap(); // 2, 3
        reap_all(&mut device);
        device.flush().unwrap(); // 4
        assert!(!disk.has_crashed());
        assert_eq!(device.grow_file(file, 16 * PAGE), Err(DeviceError::Crashed));
        assert!(disk.has_crashed());
        assert_eq!(disk.ops(), 4);
        let image = disk.restart().read_file("f").unwrap();
        assert_eq!(image.len(), 8 * PAGE_BYTES, "the crashed grow must not happen");
        assert_eq!(page_of(&image, 1), &page(5)[..], "flushed before the crash");

        // A crash in the middle of one submit: the first two requests were in flight at the crash,
        // the call fails, and none of its requests come back.
        let disk = SimDisk::new(4);
        let mut device = disk.device(WriteDurability::FlushPerRound);
        let file = device.open_file("f", true).unwrap();
        device.grow_file(file, 8 * PAGE).unwrap();
        disk.crash_after_ops(2);
        let batch = (0..4).map(|p| write(p, file, p, 9)).collect();
        assert_eq!(device.submit(batch), Err(DeviceError::Crashed));
        assert_eq!(device.in_flight(), 0);
        let stats = disk.restart().restart_stats();
        assert_eq!(stats.kept_writes + stats.dropped_writes + stats.torn_writes, 2);
    }

    #[test]
    fn fail_nth_fails_exactly_the_nth() {
        let disk = SimDisk::new(5);
        let mut device = disk.device(WriteDurability::FlushPerRound);
        let file = device.open_file("f", true).unwrap();
        device.grow_file(file, 8 * PAGE).unwrap();
        disk.fail_nth(3, FaultOp::Write, FaultError::Io, false);
        disk.fail_nth(2, FaultOp::Read, FaultError::NoSpace, false);
        for p in 0..5 {
            device.submit(vec![write(p, file, p, 40)]).unwrap();
            if p == 1 {
                // Read number 1; it does not advance the write fault's count.
                device.submit(vec![read(90, file, 0, 1)]).unwrap();
            }
        }
        let mut done = reap_all(&mut device);
        done.sort_by_key(|c| c.token);
        let results: Vec<bool> = done.iter().map(|c| c.result.is_ok()).collect();
        assert_eq!(results, vec![true, true, false, true, true, true]);
        assert!(matches!(done[2].result, Err(DeviceError::Io { .. })));
        let image = disk.read_file("f").unwrap();
        assert_eq!(page_of(&image, 2), &[0u8; PAGE_BYTES][..], "a failed write changes nothing");
        assert_eq!(page_of(&image, 3), &page(40)[..]);
        device.submit(vec![read(91, file, 0, 1), read(92, file, 0, 1)]).unwrap();
        let mut done = reap_all(&mut device);
        done.sort_by_key(|c| c.token);
        assert!(matches!(done[0].result, Err(DeviceError::NoSpace { .. })), "{:?}", done[0].result);
        assert_eq!(done[1].result, Ok(()));

        disk.fail_nth(2, FaultOp::Flush, FaultError::NoSpace, true);
        device.flush().unwrap();
        device.submit(vec![write(5, file, 5, 41)]).unwrap();
        assert_eq!(reap_all(&mut device)[0].result, Ok(()));
        for _ in 0..3 {
            assert!(matches!(device.flush(), Err(DeviceError::NoSpace { .. })));
        }
        // A persistent flush fault leaves grows alone; an Any fault catches the next grow.
        device.grow_file(file, 16 * PAGE).unwrap();
        disk.fail_nth(1, FaultOp::Any, FaultError::Io, false);
        assert!(matches!(device.grow_file(file, 32 * PAGE), Err(DeviceError::Io { .. })));
        assert_eq!(device.file_len_bytes(file).unwrap(), 16 * PAGE);
        device.grow_file(file, 32 * PAGE).unwrap();
        // The write after the good flush did not become durable through the failed ones.
        let rebooted = disk.restart();
        let stats = rebooted.restart_stats();
        assert_eq!(stats.kept_writes + stats.dropped_writes + stats.torn_writes, 1);
    }

    #[test]
    fn silent_write_faults_damage_pages_until_rewritten() {
        let disk = SimDisk::new(9);
        let mut device = disk.device(WriteDurability::Dsync);
        let file = device.open_file("f", true).unwrap();
        device.grow_file(file, 8 * PAGE).unwrap();
        device.submit(vec![write(0, file, 1, 10)]).unwrap();
        reap_all(&mut device);
        assert!(disk.silently_damaged_pages().is_empty());
        disk.fault_nth_write(1, WriteFault::Lost);
        disk.fault_nth_write(2, WriteFault::Misdirected);
        for (token, page_no, fill) in [(1, 1, 11), (2, 2, 12)] {
            device.submit(vec![write(token, file, page_no, fill)]).unwrap();
            assert_eq!(reap_all(&mut device)[0].result, Ok(()), "a silent fault reports success");
        }
        let faults = disk.injected_write_faults();
        assert_eq!(
            faults.iter().map(|f| f.fault).collect::<Vec<_>>(),
            [WriteFault::Lost, WriteFault::Misdirected]
        );
        let landed = faults[1].landed_at.expect("misdirected");
        assert_ne!(landed, 2 * PAGE);
        let image = disk.read_file("f").unwrap();
        assert_eq!(page_of(&image, landed / PAGE), &page(12)[..]);
        if landed != PAGE {
            assert_eq!(page_of(&image, 1), &page(10)[..], "the lost write left the old bytes");
        }
        let intended = disk.intended_file("f").unwrap();
        assert_eq!(page_of(&intended, 1), &page(11)[..]);
        assert_eq!(page_of(&intended, 2), &page(12)[..]);
        let mut expected: Vec<(String, u64)> =
            [PAGE, 2 * PAGE, landed].into_iter().map(|at| ("f".to_string(), at)).collect();
        expected.sort();
        expected.dedup();
        assert_eq!(disk.silently_damaged_pages(), expected);
        // A later write of the whole page repairs it.
        device.submit(vec![write(3, file, 1, 13)]).unwrap();
        reap_all(&mut device);
        expected.retain(|(_, at)| *at != PAGE);
        assert_eq!(disk.silently_damaged_pages(), expected);
    }

    #[test]
    fn a_fault_at_a_named_point_fires_once_at_its_hit() {
        let disk = SimDisk::new(8);
        let mut device = disk.device(WriteDurability::FlushPerRound);
        let file = device.open_file("f", true).unwrap();
        device.grow_file(file, 4 * PAGE).unwrap();
        let grown = FaultPoint::SlabFileGrown;
        device.fault_point(grown).unwrap();
        // Counted from arming: the 2nd hit from now is the 3rd in all.
        disk.fault_at_point(grown, 2, PointFault::Fail(FaultError::NoSpace));
        disk.fault_at_point(FaultPoint::RecoveryScanned, 1, PointFault::Crash);
        device.fault_point(grown).unwrap();
        assert!(matches!(device.fault_point(grown), Err(DeviceError::NoSpace { .. })));
        device.fault_point(grown).unwrap();
        assert!(!disk.has_crashed(), "a failing point leaves the disk running");
        device.submit(vec![write(0, file, 1, 7)]).unwrap();
        assert_eq!(reap_all(&mut device)[0].result, Ok(()));
        assert_eq!(device.fault_point(FaultPoint::RecoveryScanned), Err(DeviceError::Crashed));
        assert!(disk.has_crashed());
        assert_eq!(device.flush(), Err(DeviceError::Crashed));
        // Hits on a crashed disk are not counted.
        device.fault_point(grown).unwrap();
        assert_eq!(
            disk.fault_point_hits(),
            BTreeMap::from([(grown, 4), (FaultPoint::RecoveryScanned, 1)])
        );
        assert_eq!(
            disk.fault_points_fired(),
            vec![
                (grown, PointFault::Fail(FaultError::NoSpace)),
                (FaultPoint::RecoveryScanned, PointFault::Crash)
            ]
        );
        // The write that completed but was never flushed is subject to the crash.
        let stats = disk.restart().restart_stats();
        assert_eq!(stats.kept_writes + stats.dropped_writes + stats.torn_writes, 1);
    }

    #[test]
    fn flip_bit_flips_one_bit_in_both_images() {
        let disk = SimDisk::new(6);
        let mut device = disk.device(WriteDurability::Dsync);
        let file = device.open_file("f", true).unwrap();
        device.grow_file(file, 2 * PAGE).unwrap();
        device.submit(vec![write(0, file, 1, 33)]).unwrap();
        reap_all(&mut device);
        let before = disk.read_file("f").unwrap();
        disk.flip_bit("f", PAGE + 100, 3);
        let after = disk.read_file("f").unwrap();
        let differing: Vec<(usize, u8)> = before
            .iter()
            .zip(&after)
            .enumerate()
            .filter(|(_, (a, b))| a != b)
            .map(|(i, (a, b))| (i, a ^ b))
            .collect();
        assert_eq!(differing, vec![(PAGE_BYTES + 100, 0b1000)]);
        device.submit(vec![read(1, file, 1, 1)]).unwrap();
        let done = reap_all(&mut device);
        assert_eq!(done[0].buf[100], before[PAGE_BYTES + 100] ^ 0b1000);
        let durable = disk.restart().read_file("f").unwrap();
        assert_eq!(durable, after, "the durable image is flipped too");
    }

    #[test]
    fn write_file_raw_is_durable() {
        let disk = SimDisk::new(8);
        disk.write_file_raw("meta/header", 10, b"garbage");
        let image = disk.restart().read_file("meta/header").unwrap();
        assert_eq!(image.len(), 17);
        assert_eq!(&image[10..], b"garbage");
    }

    #[test]
    fn shard_threads_share_one_disk() {
        let disk = SimDisk::new(11);
        let storage = disk.storage(WriteDurability::FlushPerRound);
        let threads: Vec<_> = (0..4u8)
            .map(|shard| {
                let storage = storage.clone();
                std::thread::spawn(move || {
                    let mut device = storage.open_device().unwrap();
                    let file = device.open_file(&format!("shard-{shard}/slab"), true).unwrap();
                    device.grow_file(file, 32 * PAGE).unwrap();
                    for round in 0..8u64 {
                        let batch =
                            (0..4).map(|i| write(i, file, round * 4 + i, shard * 10)).collect();
                        device.submit(batch).unwrap();
                        reap_all(device.as_mut());
                        device.flush().unwrap();
                    }
                })
            })
            .collect();
        for thread in threads {
            thread.join().unwrap();
        }
        let rebooted = disk.restart();
        for shard in 0..4u8 {
            let image = rebooted.read_file(&format!("shard-{shard}/slab")).unwrap();
            for p in 0..32 {
                assert_eq!(page_of(&image, p), &page(shard * 10)[..]);
            }
        }
        assert_eq!(disk.stats().writes, 4 * 32);
        assert_eq!(disk.stats().flushes, 4 * 8);
    }
}
