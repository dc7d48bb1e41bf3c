//! `UringDevice`: the real device, io_uring on O_DIRECT files.
//!
//! Invariants:
//! - Every request the kernel may touch is owned by `slots` (keyed by the SQE's `user_data`) from
//!   the moment its SQE is pushed until its CQE is drained, so its buffer outlives the kernel's
//!   use of it. `Drop` waits for all of them before the buffers are freed.
//! - `submit` makes one `io_uring_enter` per batch (more only if the batch overflows the SQ);
//!   `reap` enters the kernel only when the CQ does not already hold `min_complete` completions.
//!   Both count their enters in `DeviceStats::submit_calls`.
//! - A completion is `Ok` only if the whole buffer was transferred; anything else is an error
//!   (negative result → errno, short transfer → `DeviceError::Short`).
//! - The ring's own fd is the completion fd (`BlockDevice::completion_fd`): the kernel reports it
//!   readable while the CQ holds an entry. It is offered only while `ready` is empty, so a poll
//!   on it never sleeps past a completion the device already holds.
//!
//! Durability: with `Dsync` each write carries RWF_DSYNC, which the block layer turns into a FUA
//! write (or a write plus cache flush on devices without FUA), and the filesystem commits any
//! metadata the write needed (e.g. converting an unwritten extent). The write is durable when it
//! completes and `flush` does nothing. With `FlushPerRound` writes are plain and `flush` issues
//! one fdatasync per file with a write completed since that file's last fdatasync began: one
//! cache flush covers the whole round instead of one per write. A file is marked for syncing when
//! a write's completion is drained, not when it is submitted: a write submitted before a flush
//! and completed after it must be covered by a later fdatasync (marking at submit let the flush
//! clear the mark of a write still in flight, and the next flush skipped its file). Which is faster depends on the device (FUA support, queue depth,
//! cache size); `examples/durability_probe.rs` measures it. Per-write RWF_DSYNC (not an O_DSYNC
//! open flag) keeps reads and the choice per write free of the open mode.
//!
//! A background flush (`submit_flush`) is the same fdatasyncs as IORING_OP_FSYNC entries in the
//! ring, one per marked file, each file's mark cleared as its entry is queued; the flush ends
//! when the last of them completes, and covers what was reaped when it was submitted. Several
//! may be in flight (the engine bounds them: `FLUSHES_IN_FLIGHT_MAX`); their ends are handed
//! out in submission order, each only once every earlier one has ended, so a flush's end
//! always means everything before it is durable too. A flush in place (`flush`) waits for the
//! background ones first, so it never answers while a file it skipped is still syncing.

use std::collections::VecDeque;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use io_uring::{opcode, types, IoUring, Probe};

use super::files::{self, OpenFile};
use super::{
    BlockDevice, DeviceError, DeviceStats, FileId, IoCompletion, IoKind, IoObserver, IoRequest,
    TakenRead, WriteDurability,
};

/// The `user_data` of a background flush's fsync entries: this bit, the flush's number above
/// `FSYNC_FILE_BITS` and the file's id below (a request's `user_data` is its slot, far below).
const FSYNC_USER_DATA: u64 = 1 << 63;
const FSYNC_FILE_BITS: u32 = 24;
const FSYNC_FILE_MASK: u64 = (1 << FSYNC_FILE_BITS) - 1;
const FSYNC_FLUSH_MASK: u64 = (FSYNC_USER_DATA - 1) >> FSYNC_FILE_BITS;

/// A background flush in flight (`submit_flush`).
struct BackgroundFlush {
    /// Its number (counting from 0 per device; in `user_data`, masked).
    number: u64,
    /// Its fsyncs not completed yet.
    fsyncs_left: usize,
    /// The first error among them.
    result: Result<(), DeviceError>,
    /// `write_completions_reaped` when it was submitted: what it makes durable.
    covered: u64,
    /// Its submission failed and the caller was told so: its fsyncs already queued are waited
    /// for, but its end is not reported and covers nothing.
    abandoned: bool,
}

/// Enters that may fail with EBUSY/EAGAIN (the kernel is short of completion space or memory)
/// before the device gives up; each retry first drains the CQ, which is what frees that space.
const ENTER_RETRIES_MAX: u32 = 1000;

/// Checks that this kernel and sandbox allow io_uring with the opcodes the device uses.
pub fn probe() -> Result<(), DeviceError> {
    let unavailable =
        |what: &str, err: std::io::Error| DeviceError::UringUnavailable(format!("{what}: {err}"));
    let mut ring = IoUring::new(2).map_err(|err| unavailable("io_uring_setup", err))?;
    let mut opcodes = Probe::new();
    ring.submitter()
        .register_probe(&mut opcodes)
        .map_err(|err| unavailable("IORING_REGISTER_PROBE", err))?;
    let needed = [
        (opcode::Read::CODE, "READ"),
        (opcode::Write::CODE, "WRITE"),
        (opcode::Fsync::CODE, "FSYNC"),
    ];
    for (code, name) in needed {
        if !opcodes.is_supported(code) {
            return Err(DeviceError::UringUnavailable(format!("opcode IORING_OP_{name} missing")));
        }
    }
    const NOP_TOKEN: u64 = 0x6e6f70;
    let nop = opcode::Nop::new().build().user_data(NOP_TOKEN);
    // SAFETY: a NOP references no memory, so nothing has to outlive its submission.
    unsafe { ring.submission().push(&nop) }
        .map_err(|_| DeviceError::UringUnavailable("fresh submission queue is full".into()))?;
    loop {
        match ring.submit_and_wait(1) {
            Ok(_) => break,
            Err(err) if err.raw_os_error() == Some(libc::EINTR) => continue,
            Err(err) => return Err(unavailable("io_uring_enter", err)),
        }
    }
    let completed = ring.completion().next().map(|cqe| (cqe.user_data(), cqe.result()));
    match completed {
        Some((NOP_TOKEN, result)) if result >= 0 => Ok(()),
        Some((_, result)) => {
            Err(DeviceError::UringUnavailable(format!("NOP completed with {result}")))
        }
        None => Err(DeviceError::UringUnavailable("NOP did not complete".into())),
    }
}

pub struct UringDevice {
    ring: IoUring,
    root: PathBuf,
    durability: WriteDurability,
    files: Vec<OpenFile>,
    /// Requests handed to the ring, indexed by their SQE's user_data. `None` = free slot.
    slots: Vec<Option<IoRequest>>,
    free_slots: Vec<usize>,
    /// Occupied entries of `slots`: the requests the kernel may still touch.
    slots_in_use: usize,
    /// Finished requests not yet returned by `reap` (drained CQEs and rejected requests).
    ready: VecDeque<IoCompletion>,
    /// Per file id: a write to it completed since its last fdatasync began (tracked only under
    /// `FlushPerRound`). Set when the completion is drained, whatever its outcome (a failed
    /// write may have changed part of its range).
    dirty: Vec<bool>,
    stats: DeviceStats,
    ledger: files::FlushLedger,
    observer: Option<Arc<dyn IoObserver>>,
    /// Per slot: the observer's tag of the write in it.
    observed_tags: Vec<u64>,
    /// The kernel said, at the last drain, that completions overflowed the CQ into its own
    /// list, which only an enter moves back into the CQ.
    cq_overflowed: bool,
    /// The background flushes not yet ended, or ended before an earlier one, in submission
    /// order.
    background_flushes: VecDeque<BackgroundFlush>,
    next_flush_number: u64,
    /// Background flushes that ended (in order), until `take_flush_done`.
    flushes_done: VecDeque<Result<(), DeviceError>>,
    /// Submissions are held back (`defer_submission`).
    deferring: bool,
    /// Requests submitted while deferring, in order, with no SQE yet: they go to the SQ at the
    /// next enter, or to a caller that takes them (`take_reads`).
    held: Vec<usize>,
    /// Entries sit in the SQ or in `held`, held back, until the next enter.
    held_back: bool,
    /// Slots of reads a caller took to perform itself (`take_reads`), not yet returned.
    taken: usize,
}

impl UringDevice {
    /// A device over the store directory `root` with a ring of `ring_entries` submission entries
    /// (the kernel rounds up to a power of two; the CQ is twice that).
    pub fn new(
        root: &Path,
        durability: WriteDurability,
        ring_entries: u32,
    ) -> Result<UringDevice, DeviceError> {
        let ring = IoUring::new(ring_entries.max(1)).map_err(|err| {
            DeviceError::UringUnavailable(format!("io_uring_setup({ring_entries}): {err}"))
        })?;
        Ok(UringDevice {
            ring,
            root: root.to_path_buf(),
            durability,
            files: Vec::new(),
            slots: Vec::new(),
            free_slots: Vec::new(),
            slots_in_use: 0,
            ready: VecDeque::new(),
            dirty: Vec::new(),
            stats: DeviceStats::default(),
            ledger: files::FlushLedger::default(),
            observer: None,
            observed_tags: Vec::new(),
            cq_overflowed: false,
            background_flushes: VecDeque::new(),
            next_flush_number: 0,
            flushes_done: VecDeque::new(),
            deferring: false,
            held: Vec::new(),
            held_back: false,
            taken: 0,
        })
    }

    /// Reports this device's system calls to `observer` (power-loss tests).
    pub fn with_observer(mut self, observer: Option<Arc<dyn IoObserver>>) -> UringDevice {
        self.observer = observer;
        self
    }

    fn insert_slot(&mut self, request: IoRequest) -> usize {
        self.slots_in_use += 1;
        match self.free_slots.pop() {
            Some(slot) => {
                self.slots[slot] = Some(request);
                slot
            }
            None => {
                self.slots.push(Some(request));
                self.slots.len() - 1
            }
        }
    }

    fn remove_slot(&mut self, slot: usize) -> Option<IoRequest> {
        let request = self.slots.get_mut(slot)?.take()?;
        self.slots_in_use -= 1;
        self.free_slots.push(slot);
        Some(request)
    }

    /// The SQE for the request in `slot`.
    fn entry(&mut self, slot: usize) -> io_uring::squeue::Entry {
        let dsync = self.durability == WriteDurability::Dsync;
        let Some(request) = self.slots[slot].as_mut() else {
            unreachable!("entry() for an empty slot");
        };
        let fd = types::Fd(self.files[request.file as usize].file.as_raw_fd());
        // check_request bounds the length by IO_BYTES_MAX, which fits in u32.
        let len = request.buf.len() as u32;
        let entry = match request.kind {
            IoKind::Read => {
                opcode::Read::new(fd, request.buf.as_mut_ptr(), len).offset(request.offset).build()
            }
            IoKind::Write => opcode::Write::new(fd, request.buf.as_ptr(), len)
                .offset(request.offset)
                .rw_flags(if dsync { libc::RWF_DSYNC } else { 0 })
                .build(),
        };
        entry.user_data(slot as u64)
    }

    /// One io_uring_enter: submits what is in the SQ and waits for `want` completions. Retries
    /// EINTR, and EBUSY/EAGAIN after draining the CQ.
    fn enter(&mut self, want: usize) -> Result<(), DeviceError> {
        let mut retries = 0;
        loop {
            self.stats.submit_calls += 1;
            match self.ring.submit_and_wait(want) {
                Ok(_) => {
                    // An enter hands the kernel the whole SQ (or fails and is retried).
                    self.held_back = false;
                    return Ok(());
                }
                Err(err) => match err.raw_os_error() {
                    Some(libc::EINTR) => continue,
                    Some(libc::EBUSY | libc::EAGAIN) if retries < ENTER_RETRIES_MAX => {
                        retries += 1;
                        self.drain_cq();
                    }
                    _ => return Err(DeviceError::from_io(&err, "io_uring_enter")),
                },
            }
        }
    }

    /// Moves every CQE into `ready` as a completion.
    fn drain_cq(&mut self) {
        // Collect first: the CQ borrows the ring, and completing a request touches other fields.
        let finished: Vec<(u64, i32)> =
            self.ring.completion().map(|cqe| (cqe.user_data(), cqe.result())).collect();
        self.cq_overflowed = self.ring.submission().cq_overflow();
        for (user_data, result) in finished {
            if user_data & FSYNC_USER_DATA != 0 {
                let flush = (user_data >> FSYNC_FILE_BITS) & FSYNC_FLUSH_MASK;
                self.fsync_completed(flush, (user_data & FSYNC_FILE_MASK) as usize, result);
                continue;
            }
            self.complete_slot(user_data, result);
        }
    }

    /// The request in slot `user_data` finished with `result` (a CQE's: bytes moved, or a
    /// negated errno): moves it into `ready` as a completion.
    fn complete_slot(&mut self, user_data: u64, result: i32) {
        let Some(request) = usize::try_from(user_data).ok().and_then(|s| self.remove_slot(s))
        else {
            tracing::error!(user_data, result, "completion for no request in flight; ignored");
            return;
        };
        if request.kind == IoKind::Write {
            if self.durability == WriteDurability::FlushPerRound {
                self.dirty[request.file as usize] = true;
            }
            if let Some(observer) = &self.observer {
                let tag = self.observed_tags[user_data as usize];
                observer.write_completed(tag, result == request.buf.len() as i32);
            }
        }
        let name = &self.files[request.file as usize].name;
        let outcome = if result < 0 {
            Err(DeviceError::from_errno(-result, files::describe(&request, name)))
        } else {
            files::transfer_result(&request, name, result as usize)
        };
        if outcome.is_ok() {
            self.stats.count_done(request.kind, request.buf.len() as u64);
        }
        self.ready.push_back(IoCompletion::of(request, outcome));
    }

    /// One fsync of background flush `number` (masked) completed (`result`: the syscall's).
    fn fsync_completed(&mut self, number: u64, file: usize, result: i32) {
        let Some(name) = self.files.get(file).map(|open| open.name.clone()) else {
            tracing::error!(file, result, "fsync completion for no open file; ignored");
            return;
        };
        if let Some(observer) = &self.observer {
            observer.sync_finished(&name, result >= 0);
        }
        let flush = self
            .background_flushes
            .iter_mut()
            .find(|flush| flush.number & FSYNC_FLUSH_MASK == number && flush.fsyncs_left > 0);
        let Some(flush) = flush else {
            tracing::error!(file = %name, result, "fsync completion for no flush in flight; ignored");
            return;
        };
        if result < 0 {
            // The file's writes are not known durable: the next flush syncs it again.
            self.dirty[file] = true;
            if flush.result.is_ok() {
                flush.result =
                    Err(DeviceError::from_errno(-result, format!("fdatasync {name} (io_uring)")));
            }
        }
        flush.fsyncs_left -= 1;
        self.end_background_flushes();
    }

    /// Ends the background flushes at the front whose fsyncs have all completed, in order.
    fn end_background_flushes(&mut self) {
        while self.background_flushes.front().is_some_and(|flush| flush.fsyncs_left == 0) {
            let Some(flush) = self.background_flushes.pop_front() else { break };
            if flush.abandoned {
                continue;
            }
            if flush.result.is_ok() {
                self.ledger.covered_in_background(flush.covered);
            }
            self.flushes_done.push_back(flush.result);
        }
    }

    /// The background flush being submitted (the last) failed, and the caller gets the error:
    /// forget it once its fsyncs already queued have completed.
    fn background_flush_failed(&mut self) {
        if let Some(flush) = self.background_flushes.back_mut() {
            flush.abandoned = true;
        }
        self.end_background_flushes();
    }

    /// Puts the SQE of the request in `slot` into the SQ, handing the SQ to the kernel first if
    /// it is full. On `Err` the request is dropped (its SQE never reached the SQ).
    fn queue_slot(&mut self, slot: usize) -> Result<(), DeviceError> {
        let entry = self.entry(slot);
        loop {
            // SAFETY: the SQE points into the buffer of the request now owned by
            // `slots[slot]`. That buffer is a separate heap allocation, so it does not move
            // when `slots` grows, and it is freed only after the CQE for `slot` is drained
            // (`drain_cq`) or, in `Drop`, after every submitted request has completed. The fd
            // belongs to `files`, which is only appended to while the device lives.
            let pushed = unsafe { self.ring.submission().push(&entry) };
            if pushed.is_ok() {
                return Ok(());
            }
            // SQ full: hand over what is there and continue with the rest of the batch.
            if let Err(err) = self.enter(0) {
                drop(self.remove_slot(slot));
                return Err(err);
            }
            if self.sq_len() >= self.ring.params().sq_entries() as usize {
                // The kernel took nothing; wait for a completion to free resources.
                self.enter(1)?;
                self.drain_cq();
            }
        }
    }

    /// Moves the requests held back without an SQE into the SQ, in order.
    fn queue_held(&mut self) -> Result<(), DeviceError> {
        let held = std::mem::take(&mut self.held);
        for (index, &slot) in held.iter().enumerate() {
            if let Err(err) = self.queue_slot(slot) {
                // The ones not queued yet never reach the kernel: drop them as the batch's rest.
                for &rest in &held[index + 1..] {
                    drop(self.remove_slot(rest));
                }
                return Err(err);
            }
        }
        Ok(())
    }

    /// Queues one entry, making room in the SQ if it is full.
    fn push_entry(&mut self, entry: &io_uring::squeue::Entry) -> Result<(), DeviceError> {
        loop {
            // SAFETY: the entries pushed here (fsyncs) reference no memory, only a file
            // descriptor owned by `files`, which is only appended to while the device lives.
            if unsafe { self.ring.submission().push(entry) }.is_ok() {
                return Ok(());
            }
            self.enter(0)?;
            if self.sq_len() >= self.ring.params().sq_entries() as usize {
                self.enter(1)?;
                self.drain_cq();
            }
        }
    }

    /// Hands the SQ's entries to the kernel unless submissions are held back. One enter per
    /// batch; loops only if the kernel stopped partway (it then leaves the rest in the SQ, and
    /// each enter takes at least one entry or fails).
    fn enter_queued(&mut self) -> Result<(), DeviceError> {
        if self.deferring {
            self.held_back = self.sq_len() > 0 || !self.held.is_empty();
            return Ok(());
        }
        self.queue_held()?;
        while self.sq_len() > 0 {
            self.enter(0)?;
        }
        Ok(())
    }

    fn sq_len(&mut self) -> usize {
        self.ring.submission().len()
    }
}

impl BlockDevice for UringDevice {
    fn open_file(&mut self, name: &str, create: bool) -> Result<FileId, DeviceError> {
        let observer = self.observer.as_deref();
        let id = files::open_observed(&mut self.files, &self.root, name, create, 0, observer)?;
        self.dirty.resize(self.files.len(), false);
        Ok(id)
    }

    fn list_files(&mut self, dir: &str) -> Result<Vec<String>, DeviceError> {
        files::list_files(&self.root, dir)
    }

    fn file_len_bytes(&mut self, file: FileId) -> Result<u64, DeviceError> {
        let open = files::lookup(&self.files, file)?;
        files::file_len_bytes(&open.file, &open.name)
    }

    fn grow_file(&mut self, file: FileId, len_bytes: u64) -> Result<(), DeviceError> {
        files::grow_observed(
            &self.files,
            file,
            len_bytes,
            self.observer.as_deref(),
            &mut self.stats,
        )
    }

    /// Malformed requests complete with `BadRequest` (returned by the next `reap`). On `Err` (the
    /// ring is unusable) the requests already queued stay in flight and complete as usual; the
    /// rest of the batch is dropped.
    fn submit(&mut self, requests: Vec<IoRequest>) -> Result<(), DeviceError> {
        for request in requests {
            if let Err(err) = files::check_request(&request, self.files.len()) {
                self.ready.push_back(IoCompletion::of(request, Err(err)));
                continue;
            }
            let tag = match (&self.observer, request.kind) {
                (Some(observer), IoKind::Write) => observer.write_submitted(
                    &self.files[request.file as usize].name,
                    request.offset,
                    &request.buf,
                ),
                _ => 0,
            };
            let slot = self.insert_slot(request);
            if self.observed_tags.len() <= slot {
                self.observed_tags.resize(slot + 1, 0);
            }
            self.observed_tags[slot] = tag;
            if self.deferring {
                self.held.push(slot);
                continue;
            }
            self.queue_slot(slot)?;
        }
        self.enter_queued()
    }

    fn reap(
        &mut self,
        min_complete: usize,
        out: &mut Vec<IoCompletion>,
    ) -> Result<(), DeviceError> {
        // A background flush that ends during this call counts as a completion (the caller
        // takes it next); one that had ended before does not, so that a caller waiting for its
        // own request (`sync_io`) waits for it rather than returning at once again and again.
        let carried = self.flushes_done.len();
        // A read a caller took completes only when it gives the read back: never wait for one.
        let wanted = min_complete.min(self.in_flight() - carried - self.taken);
        self.drain_cq();
        let at_hand = |device: &Self| device.ready.len() + device.flushes_done.len() - carried;
        if at_hand(self) < wanted && !self.held.is_empty() {
            // Waiting means handing over what is held back (`Io::sync_io` while a combining
            // caller's turn defers submission).
            self.queue_held()?;
        }
        while at_hand(self) < wanted {
            // What is missing is in the kernel (requests or the flush's fsyncs).
            self.enter(wanted - at_hand(self))?;
            self.drain_cq();
        }
        self.ledger.hand_out(self.ready.drain(..), out);
        Ok(())
    }

    fn in_flight(&self) -> usize {
        let fsyncs: usize = self.background_flushes.iter().map(|flush| flush.fsyncs_left).sum();
        // A flush whose fsyncs have all completed but that waits behind an earlier one counts
        // too, so that the loop never sleeps with nothing left to wake it.
        let waiting = self.background_flushes.iter().filter(|flush| flush.fsyncs_left == 0).count();
        self.slots_in_use + self.ready.len() + fsyncs + waiting + self.flushes_done.len()
    }

    /// The ring's own fd: the kernel reports it readable while the completion queue holds an
    /// entry (level-triggered, so one posted before the poll began ends it at once). Completions
    /// already drained into `ready` (by a submit that found the SQ full, or rejected requests)
    /// are not in the queue, so then there is no fd: the next reap hands them out at once. Nor
    /// after the CQ overflowed: the fd would stay readable while a drain finds nothing, and the
    /// enter of `reap(1)` is what brings those completions back.
    fn completion_fd(&self) -> Option<BorrowedFd<'_>> {
        (self.ready.is_empty() && self.flushes_done.is_empty() && !self.cq_overflowed)
            .then(|| self.ring.as_fd())
    }

    fn completes_asynchronously(&self) -> bool {
        true
    }

    fn flush(&mut self) -> Result<(), DeviceError> {
        self.stats.flushes += 1;
        if self.durability == WriteDurability::Dsync {
            return Ok(()); // every completed write was already durable
        }
        // A file whose fsync is in flight is not marked: wait for it, or this flush would
        // answer before that file's writes are durable.
        while !self.background_flushes.is_empty() {
            self.enter(1)?;
            self.drain_cq();
        }
        self.ledger.flush(&self.files, &mut self.dirty, self.observer.as_deref())
    }

    fn submit_flush(&mut self) -> Result<(), DeviceError> {
        self.stats.flushes += 1;
        let covered = self.ledger.reaped();
        let number = self.next_flush_number;
        self.next_flush_number += 1;
        self.background_flushes.push_back(BackgroundFlush {
            number,
            fsyncs_left: 0,
            result: Ok(()),
            covered,
            abandoned: false,
        });
        if self.durability == WriteDurability::FlushPerRound {
            for file in 0..self.files.len() {
                if !self.dirty[file] {
                    continue;
                }
                debug_assert!(
                    file as u64 <= FSYNC_FILE_MASK,
                    "file id {file} past user_data's field"
                );
                let fd = types::Fd(self.files[file].file.as_raw_fd());
                let entry =
                    opcode::Fsync::new(fd).flags(types::FsyncFlags::DATASYNC).build().user_data(
                        FSYNC_USER_DATA
                            | (number & FSYNC_FLUSH_MASK) << FSYNC_FILE_BITS
                            | file as u64 & FSYNC_FILE_MASK,
                    );
                if let Err(err) = self.push_entry(&entry) {
                    // Not queued: nothing of it is in flight, and the file stays marked. The
                    // fsyncs queued before it complete and are counted as usual.
                    self.background_flush_failed();
                    return Err(err);
                }
                // Cleared once queued, before it can begin: a write completing from here on
                // marks the file again for the next flush.
                self.dirty[file] = false;
                if let Some(observer) = &self.observer {
                    observer.sync_started(&self.files[file].name);
                }
                if let Some(flush) = self.background_flushes.back_mut() {
                    flush.fsyncs_left += 1;
                }
            }
        }
        // Nothing to sync (no marked file, or Dsync): it ends once the flushes before it have.
        self.end_background_flushes();
        self.enter_queued().inspect_err(|_| self.background_flush_failed())
    }

    fn defer_submission(&mut self, on: bool) -> Result<(), DeviceError> {
        self.deferring = on;
        self.enter_queued()
    }

    fn has_deferred_submission(&self) -> bool {
        self.held_back
    }

    /// The held-back requests, if they are all reads and at most `max`: the caller performs
    /// them with pread(2) on its own thread (`TakenRead::perform`) and gives them back.
    fn take_reads(&mut self, max: usize) -> Vec<TakenRead> {
        let all_reads = self.held.iter().all(|&slot| {
            self.slots[slot].as_ref().is_some_and(|request| request.kind == IoKind::Read)
        });
        if self.held.is_empty() || self.held.len() > max || !all_reads {
            return Vec::new();
        }
        let mut taken = Vec::with_capacity(self.held.len());
        for slot in std::mem::take(&mut self.held) {
            let Some(request) = self.slots[slot].as_mut() else {
                unreachable!("a held slot holds its request");
            };
            let fd = self.files[request.file as usize].file.as_raw_fd();
            taken.push(TakenRead::new(slot as u64, fd, request));
        }
        self.taken += taken.len();
        self.held_back = self.sq_len() > 0;
        taken
    }

    fn give_back(&mut self, reads: Vec<TakenRead>) {
        for read in reads {
            self.taken -= 1;
            self.stats.submit_calls += read.calls();
            self.complete_slot(read.user_data(), read.result());
        }
    }

    fn taken_reads(&self) -> usize {
        self.taken
    }

    fn take_flush_done(&mut self) -> Option<Result<(), DeviceError>> {
        self.flushes_done.pop_front()
    }

    fn write_completions_reaped(&self) -> u64 {
        self.ledger.reaped()
    }

    fn write_completions_durable(&self) -> u64 {
        self.ledger.durable(self.durability)
    }

    fn durability(&self) -> WriteDurability {
        self.durability
    }

    fn stats(&self) -> DeviceStats {
        self.stats
    }
}

impl Drop for UringDevice {
    fn drop(&mut self) {
        // The kernel may still write into (or read from) buffers owned by `slots`; they must not
        // be freed before their CQEs arrive.
        if self.queue_held().is_err() {
            tracing::error!("cannot submit held-back I/O at drop; its buffers are freed unsent");
        }
        if self.taken > 0 {
            // A caller may still be reading into a taken read's buffer (a panic took the loop
            // away meanwhile): those buffers must outlive it, so everything is leaked below
            // once the kernel is done with the rest.
            tracing::error!(taken = self.taken, "device dropped with reads taken by callers");
        }
        let mut failures = 0;
        while self.slots_in_use > self.taken {
            let wanted = self.slots_in_use - self.taken;
            match self.enter(wanted) {
                Ok(()) => self.drain_cq(),
                Err(err) => {
                    failures += 1;
                    if failures >= 3 {
                        tracing::error!(
                            %err,
                            in_flight = wanted,
                            "cannot wait for in-flight I/O; leaking its buffers"
                        );
                        // Leaking is safe: the kernel may keep using the memory, nobody else will.
                        std::mem::forget(std::mem::take(&mut self.slots));
                        return;
                    }
                }
            }
        }
        if self.taken > 0 {
            std::mem::forget(std::mem::take(&mut self.slots));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::AlignedBuf;
    use crate::limits::PAGE_BYTES;

    /// A device on a fresh directory, or `None` (with a note) where io_uring or O_DIRECT is not
    /// available, so the suite still runs in restricted sandboxes.
    fn device(durability: WriteDurability) -> Option<(tempfile::TempDir, UringDevice)> {
        if let Err(err) = probe() {
            eprintln!("skipping io_uring test: {err}");
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        let mut device = UringDevice::new(dir.path(), durability, 64).unwrap();
        match device.open_file("probe-direct", true) {
            Ok(_) => {}
            Err(err) => {
                eprintln!("skipping io_uring test: O_DIRECT unavailable in temp dir: {err}");
                return None;
            }
        }
        Some((dir, device))
    }

    fn page(fill: u8, pages: usize) -> AlignedBuf {
        let mut buf = AlignedBuf::zeroed(pages * PAGE_BYTES);
        for (i, b) in buf.iter_mut().enumerate() {
            *b = fill ^ (i / 7) as u8;
        }
        buf
    }

    fn request(token: u64, file: FileId, page_no: u64, kind: IoKind, buf: AlignedBuf) -> IoRequest {
        IoRequest { token, file, offset: page_no * PAGE_BYTES as u64, kind, buf }
    }

    fn reap_all(device: &mut dyn BlockDevice) -> Vec<IoCompletion> {
        let mut out = Vec::new();
        while device.in_flight() > 0 {
            device.reap(1, &mut out).unwrap();
        }
        out
    }

    #[test]
    fn probe_succeeds_here_or_says_why() {
        match probe() {
            Ok(()) => {}
            Err(DeviceError::UringUnavailable(why)) => assert!(!why.is_empty()),
            Err(other) => panic!("probe returned {other:?}"),
        }
    }

    #[test]
    fn round_trip_both_durabilities() {
        for durability in [WriteDurability::Dsync, WriteDurability::FlushPerRound] {
            let Some((dir, mut device)) = device(durability) else {
                return;
            };
            crate::device::files::testing::round_trip(&mut device, dir.path());
            let stats = device.stats();
            assert!(stats.submit_calls >= 2, "{stats:?}");
        }
    }

    #[test]
    fn many_requests_one_submit() {
        let Some((_dir, mut device)) = device(WriteDurability::FlushPerRound) else {
            return;
        };
        let file = device.open_file("many/a.slab", true).unwrap();
        let pages = 200u64; // more than the 64-entry SQ: exercises the SQ-full path
        device.grow_file(file, pages * PAGE_BYTES as u64).unwrap();
        let writes =
            (0..pages).map(|p| request(p, file, p, IoKind::Write, page(p as u8, 1))).collect();
        let calls_before = device.stats().submit_calls;
        device.submit(writes).unwrap();
        let calls_submit = device.stats().submit_calls - calls_before;
        assert!((1..=5).contains(&calls_submit), "submit made {calls_submit} enters");
        assert_eq!(device.in_flight(), pages as usize);
        let done = reap_all(&mut device);
        assert_eq!(done.len(), pages as usize);
        let mut tokens: Vec<u64> = done.iter().map(|c| c.token).collect();
        tokens.sort_unstable();
        assert_eq!(tokens, (0..pages).collect::<Vec<_>>());
        assert!(done.iter().all(|c| c.result.is_ok()));
        device.flush().unwrap();

        let reads = (0..pages)
            .rev()
            .map(|p| request(1000 + p, file, p, IoKind::Read, AlignedBuf::zeroed(PAGE_BYTES)))
            .collect();
        device.submit(reads).unwrap();
        for completion in reap_all(&mut device) {
            let p = completion.token - 1000;
            assert_eq!(completion.offset, p * PAGE_BYTES as u64);
            completion.result.unwrap();
            assert_eq!(&completion.buf[..], &page(p as u8, 1)[..], "page {p}");
        }
        let stats = device.stats();
        // The growth's zero-fill (200 pages: one write) counts as a write too.
        assert_eq!((stats.writes, stats.reads), (pages + 1, pages));
        assert_eq!(stats.bytes_written, 2 * pages * PAGE_BYTES as u64);
        assert_eq!(stats.bytes_read, pages * PAGE_BYTES as u64);
    }

    /// A read held back while deferring can be taken by the caller (`take_reads`): it stays in
    /// flight, `reap` does not wait for it (a wait would never end: no CQE will come), and once
    /// performed and given back it completes with the file's bytes. Held-back writes, or more
    /// reads than asked for, are not taken; they go to the kernel at the next enter.
    #[test]
    fn a_taken_read_completes_when_given_back_and_is_never_waited_for() {
        let Some((_dir, mut device)) = device(WriteDurability::FlushPerRound) else {
            return;
        };
        let file = device.open_file("taken/a.slab", true).unwrap();
        device.grow_file(file, 4 * PAGE_BYTES as u64).unwrap();
        device
            .submit(
                (0..4).map(|p| request(p, file, p, IoKind::Write, page(p as u8 + 1, 1))).collect(),
            )
            .unwrap();
        reap_all(&mut device);

        device.defer_submission(true).unwrap();
        let read = |token, page_no| {
            request(token, file, page_no, IoKind::Read, AlignedBuf::zeroed(PAGE_BYTES))
        };
        device.submit(vec![read(10, 1), read(11, 2)]).unwrap();
        assert!(device.has_deferred_submission());
        assert!(device.take_reads(1).is_empty(), "two reads held, one asked for");
        let mut taken = device.take_reads(2);
        assert_eq!(taken.len(), 2);
        assert!(!device.has_deferred_submission());
        assert_eq!((device.in_flight(), device.taken_reads()), (2, 2));
        let mut out = Vec::new();
        device.reap(1, &mut out).unwrap();
        assert!(out.is_empty(), "reap handed out a read still taken");
        for read in &mut taken {
            read.perform();
        }
        device.give_back(taken);
        assert_eq!((device.in_flight(), device.taken_reads()), (2, 0));
        device.reap(2, &mut out).unwrap();
        out.sort_by_key(|completion| completion.token);
        for (completion, page_no) in out.iter().zip(1u64..) {
            completion.result.as_ref().unwrap();
            assert_eq!(&completion.buf[..], &page(page_no as u8 + 1, 1)[..], "page {page_no}");
        }

        // A write held back is never taken, nor a read beside it.
        device.submit(vec![read(12, 3), request(13, file, 0, IoKind::Write, page(9, 1))]).unwrap();
        assert!(device.take_reads(8).is_empty());
        device.defer_submission(false).unwrap();
        assert_eq!(reap_all(&mut device).len(), 2);
    }

    /// Finding 1 of issue 20: a write submitted before a flush and completed after it must be
    /// covered by a later fdatasync of its file before the device says it is durable. (With the
    /// file marked dirty at submit, the first flush cleared the mark while the write was in
    /// flight, the second skipped the file, and the engine acknowledged an unsynced write.)
    #[test]
    fn a_write_completed_after_a_flush_is_synced_by_the_next() {
        use crate::device::observer::testing::EventLog;
        let Some((_dir, device)) = device(WriteDurability::FlushPerRound) else {
            return;
        };
        let log = std::sync::Arc::new(EventLog::default());
        let mut device = device.with_observer(Some(log.clone()));
        let file = device.open_file("late.slab", true).unwrap();
        device.grow_file(file, 4 * PAGE_BYTES as u64).unwrap();
        // A flush of the file while no write of it is known to have completed: it must not
        // count for the write submitted below, whose completion nobody has drained yet.
        device.submit(vec![request(1, file, 0, IoKind::Write, page(1, 1))]).unwrap();
        let reaped_before = device.write_completions_reaped();
        device.flush().unwrap();
        assert_eq!(device.write_completions_durable(), reaped_before);
        let done = reap_all(&mut device);
        assert!(done.iter().all(|c| c.result.is_ok()));
        assert_eq!(device.write_completions_reaped(), reaped_before + 1);
        assert!(
            device.write_completions_durable() < device.write_completions_reaped(),
            "the reaped write counts as durable before any flush after its completion"
        );
        device.flush().unwrap();
        assert_eq!(device.write_completions_durable(), device.write_completions_reaped());
        let tag = log.first_write_to("late.slab").expect("the write was observed");
        assert!(
            log.synced_after_completion(tag, "late.slab"),
            "no fdatasync of the file began after the write completed: {:?}",
            log.events()
        );
    }

    /// A background flush covers what was reaped when it was submitted, and nothing reaped
    /// after (even a write that completes before the flush ends); it counts as in flight until
    /// its end is taken, and a flush in place waits for it.
    #[test]
    fn a_background_flush_covers_what_was_reaped_when_it_was_submitted() {
        use crate::device::observer::testing::EventLog;
        let Some((_dir, device)) = device(WriteDurability::FlushPerRound) else {
            return;
        };
        let log = std::sync::Arc::new(EventLog::default());
        let mut device = device.with_observer(Some(log.clone()));
        let file = device.open_file("background.slab", true).unwrap();
        device.grow_file(file, 4 * PAGE_BYTES as u64).unwrap();
        device.submit(vec![request(1, file, 0, IoKind::Write, page(1, 1))]).unwrap();
        assert_eq!(reap_all(&mut device).len(), 1);
        let covered = device.write_completions_reaped();
        device.submit_flush().unwrap();
        assert!(device.in_flight() >= 1, "the flush is in flight until its end is taken");
        // A second write, reaped while the flush may still run: not covered by it.
        device.submit(vec![request(2, file, 1, IoKind::Write, page(2, 1))]).unwrap();
        let mut out = Vec::new();
        let mut ended = None;
        while device.in_flight() > 0 {
            device.reap(1, &mut out).unwrap();
            if let Some(result) = device.take_flush_done() {
                ended = Some(result);
            }
        }
        assert!(matches!(ended, Some(Ok(()))), "the flush ended: {ended:?}");
        assert_eq!(out.len(), 1);
        assert_eq!(device.write_completions_reaped(), covered + 1);
        assert_eq!(device.write_completions_durable(), covered, "covers only what came before");
        let first = log.first_write_to("background.slab").expect("the first write was observed");
        assert!(log.synced_after_completion(first, "background.slab"), "{:?}", log.events());
        // The second write marked the file again: the next flush syncs it.
        device.submit_flush().unwrap();
        device.flush().unwrap();
        assert_eq!(device.take_flush_done().map(|r| r.is_ok()), Some(true));
        assert_eq!(device.write_completions_durable(), device.write_completions_reaped());
        assert_eq!(device.in_flight(), 0);
    }

    /// Two background flushes in flight end in submission order, each covering what was reaped
    /// before it, and the file synced by both is marked again in between.
    #[test]
    fn background_flushes_in_flight_together_end_in_order() {
        let Some((_dir, mut device)) = device(WriteDurability::FlushPerRound) else {
            return;
        };
        let file = device.open_file("two.slab", true).unwrap();
        device.grow_file(file, 4 * PAGE_BYTES as u64).unwrap();
        let mut covered = Vec::new();
        for page_no in 0..2u64 {
            device
                .submit(vec![request(page_no, file, page_no, IoKind::Write, page(3, 1))])
                .unwrap();
            let mut out = Vec::new();
            // Reap the write (a flush ending meanwhile stays to be taken below).
            while out.is_empty() {
                device.reap(1, &mut out).unwrap();
            }
            covered.push(device.write_completions_reaped());
            device.submit_flush().unwrap();
        }
        let mut ends = Vec::new();
        while device.in_flight() > 0 {
            let mut out = Vec::new();
            device.reap(1, &mut out).unwrap();
            while let Some(result) = device.take_flush_done() {
                assert!(result.is_ok());
                ends.push(device.write_completions_durable());
            }
        }
        assert_eq!(ends.len(), 2, "both flushes ended");
        assert!(ends[0] >= covered[0] && ends[1] == covered[1], "{ends:?} against {covered:?}");
        assert_eq!(device.write_completions_durable(), device.write_completions_reaped());
    }

    /// The shard sleeps in poll(2) on this fd while I/O is in flight (shard/wake.rs): it must
    /// turn readable once a completion waits, and quiet again once it is reaped.
    #[test]
    fn the_completion_fd_is_readable_exactly_while_a_completion_waits() {
        let Some((_dir, mut device)) = device(WriteDurability::FlushPerRound) else {
            return;
        };
        let file = device.open_file("fd.slab", true).unwrap();
        device.grow_file(file, 4 * PAGE_BYTES as u64).unwrap();
        let readable = |device: &UringDevice, timeout_ms: i32| {
            let fd = device.completion_fd().expect("nothing held: the ring's fd");
            let mut entry = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
            // SAFETY: one initialized pollfd that outlives the call; the kernel writes only its
            // `revents`.
            let ready = unsafe { libc::poll(&mut entry, 1, timeout_ms) };
            ready == 1 && entry.revents & libc::POLLIN != 0
        };
        assert!(!readable(&device, 0), "readable with nothing submitted");
        let read = request(1, file, 0, IoKind::Read, AlignedBuf::zeroed(PAGE_BYTES));
        device.submit(vec![read]).unwrap();
        assert!(readable(&device, 10_000), "no completion within 10 s");
        let mut out = Vec::new();
        device.reap(0, &mut out).unwrap();
        assert_eq!(out.len(), 1);
        assert!(out[0].result.is_ok());
        assert!(!readable(&device, 0), "still readable after the completion was reaped");
        // A completion the device holds (a rejected request) is no CQE: no fd, so the owner
        // reaps instead of polling.
        let bad = request(2, 99, 0, IoKind::Read, AlignedBuf::zeroed(PAGE_BYTES));
        device.submit(vec![bad]).unwrap();
        assert!(device.completion_fd().is_none());
        device.reap(1, &mut out).unwrap();
        assert!(device.completion_fd().is_some());
    }

    #[test]
    fn drop_waits_for_in_flight_io() {
        let Some((_dir, mut device)) = device(WriteDurability::Dsync) else {
            return;
        };
        let file = device.open_file("d.slab", true).unwrap();
        device.grow_file(file, 64 * PAGE_BYTES as u64).unwrap();
        let writes = (0..64).map(|p| request(p, file, p, IoKind::Write, page(3, 1))).collect();
        device.submit(writes).unwrap();
        drop(device); // must not free buffers the kernel is still reading
    }
}
