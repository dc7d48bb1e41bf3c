//! Device layer: batched block I/O on page-aligned buffers.
//!
//! Everything above this module reaches storage only through [`BlockDevice`] (one instance per
//! shard thread: its own ring, its own file handles) and [`Storage`] (the factory that opens a
//! device per shard over one store directory). Three implementations:
//! - [`uring::UringDevice`]: io_uring on files opened with O_DIRECT (the real one);
//! - [`sync::SyncDevice`]: pread/pwrite on O_DIRECT files, for kernels or sandboxes without
//!   io_uring (chosen at open and logged);
//! - [`sim::SimDevice`]: in memory, deterministic from a seed, with crashes, torn writes, bit flips
//!   and injected errors, for tests.
//!
//! Contract (all implementations):
//! - Buffers, offsets and lengths are multiples of `PAGE_BYTES` (buffers are [`AlignedBuf`]).
//! - `submit` hands over a whole round of requests with one system call; the device never holds
//!   more than the caller submitted. The caller bounds the queue depth.
//! - A write completion means the bytes reached the device. Whether they are *durable* at
//!   completion depends on [`WriteDurability`]: with `Dsync` every write carries RWF_DSYNC (FUA or
//!   a cache flush), so a completed write is durable; with `FlushPerRound` the caller must call
//!   `flush` after a round's writes complete and before acknowledging them.
//! - A flush covers exactly the writes whose completions `reap` handed out before the flush
//!   began, whichever round submitted them: a write submitted before one flush and completed
//!   after it is covered by the next. The device tracks what needs syncing by completion, never
//!   by submission, and says what a flush covered through two counters,
//!   [`BlockDevice::write_completions_reaped`] and [`BlockDevice::write_completions_durable`],
//!   which the engine checks at every acknowledgement.
//! - A read handed to the caller by `take_reads` (io_uring only) stays in flight until the caller
//!   gives it back; `reap` never waits for it, and the device never touches its buffer meanwhile.
//! - A failed request completes with an error; it never panics. After a failed write or flush the
//!   caller must assume nothing about that range (the engine poisons the store).

pub mod aligned;
pub mod fault_point;
pub(crate) mod files;
pub mod observer;
pub mod probe;
#[cfg(any(test, feature = "testing"))]
pub mod sim;
pub mod sync;
pub mod uring;

pub use aligned::AlignedBuf;
pub use fault_point::FaultPoint;
pub use observer::IoObserver;

use std::os::fd::BorrowedFd;
use std::path::{Path, PathBuf};

/// A file opened on a device, valid for that device instance only.
pub type FileId = u32;

/// How a completed write becomes durable. Stored in no file; chosen at open.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum WriteDurability {
    /// Each write is issued with RWF_DSYNC: durable when it completes.
    Dsync,
    /// Writes are plain; `flush` (one fdatasync per written file) makes a round durable.
    FlushPerRound,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoKind {
    Read,
    Write,
}

/// One page-aligned read or write. The buffer travels with the request and comes back in the
/// completion, so it is owned by the device while the kernel may touch it.
#[derive(Debug)]
pub struct IoRequest {
    /// Caller's tag, returned unchanged in the completion.
    pub token: u64,
    pub file: FileId,
    /// Byte offset in the file; a multiple of `PAGE_BYTES`.
    pub offset: u64,
    pub kind: IoKind,
    /// For a read, filled with the file's bytes; for a write, the bytes to write.
    pub buf: AlignedBuf,
}

#[derive(Debug)]
pub struct IoCompletion {
    pub token: u64,
    pub file: FileId,
    pub offset: u64,
    pub kind: IoKind,
    pub buf: AlignedBuf,
    pub result: Result<(), DeviceError>,
}

impl IoCompletion {
    /// The completion of `request` with `result`: the request's buffer comes back with it (read
    /// into, for a read). Every device completes through this.
    pub fn of(request: IoRequest, result: Result<(), DeviceError>) -> IoCompletion {
        IoCompletion {
            token: request.token,
            file: request.file,
            offset: request.offset,
            kind: request.kind,
            buf: request.buf,
            result,
        }
    }
}

/// A read a device handed to its caller to perform (`BlockDevice::take_reads`): for a caller
/// that runs a shard's turn on its own thread and would otherwise sleep while the shard's
/// thread submits the read and wakes it with the answer (`shard/combine.rs`, invariant 5). It
/// points into the buffer of a request the device keeps in flight; the device neither frees
/// nor touches that buffer until the read is given back (or, if it is dropped first, leaks it).
pub struct TakenRead {
    user_data: u64,
    fd: std::os::fd::RawFd,
    offset: u64,
    buf: *mut u8,
    len: usize,
    /// Bytes read, or a negated errno, as an io_uring completion reports it.
    result: i32,
    calls: u64,
}

impl TakenRead {
    pub(crate) fn new(user_data: u64, fd: std::os::fd::RawFd, request: &mut IoRequest) -> Self {
        TakenRead {
            user_data,
            fd,
            offset: request.offset,
            buf: request.buf.as_mut_ptr(),
            len: request.buf.len(),
            result: -libc::ECANCELED,
            calls: 0,
        }
    }

    /// One pread(2) of the whole buffer on the calling thread (EINTR retried), as the ring would
    /// make it: a short read is reported by the completion, not retried. The kernel completes
    /// an O_DIRECT read by waking the thread that waits in it, with no task work on any other.
    pub fn perform(&mut self) {
        self.result = loop {
            self.calls += 1;
            // SAFETY: `buf..buf + len` is the buffer of a request the device keeps in flight
            // and leaves alone until this read is given back (or leaks, if the device is
            // dropped first). The fd may have been closed only if the device was dropped: then
            // pread fails or reads another file into leaked memory, both harmless.
            let read = unsafe {
                libc::pread(self.fd, self.buf.cast(), self.len, self.offset as libc::off_t)
            };
            if read >= 0 {
                // At most `len`, which the device bounds by `IO_BYTES_MAX` (fits in i32).
                break read as i32;
            }
            match std::io::Error::last_os_error().raw_os_error() {
                Some(libc::EINTR) => {}
                Some(errno) => break -errno,
                None => break -libc::EIO,
            }
        };
    }

    pub(crate) fn user_data(&self) -> u64 {
        self.user_data
    }

    pub(crate) fn result(&self) -> i32 {
        self.result
    }

    /// System calls `perform` made.
    pub(crate) fn calls(&self) -> u64 {
        self.calls
    }
}

/// Device failures. Each errno is named with its meaning.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DeviceError {
    #[error("I/O error (EIO) on {what}")]
    Io { what: String },
    #[error("no space left on device (ENOSPC) on {what}")]
    NoSpace { what: String },
    #[error("short {kind:?} on {what}: {done} of {wanted} bytes")]
    Short { what: String, kind: IoKind, done: usize, wanted: usize },
    #[error("file not found: {name}")]
    NotFound { name: String },
    #[error("the simulated device has crashed")]
    Crashed,
    #[error("{what}: {message} (errno {errno})")]
    Os { what: String, errno: i32, message: String },
    #[error("bad request: {0}")]
    BadRequest(String),
    #[error("io_uring is not available: {0}")]
    UringUnavailable(String),
}

impl DeviceError {
    /// Maps an errno to the variant that names it.
    pub fn from_errno(errno: i32, what: impl Into<String>) -> DeviceError {
        let what = what.into();
        match errno {
            libc::EIO => DeviceError::Io { what },
            libc::ENOSPC | libc::EDQUOT => DeviceError::NoSpace { what },
            libc::ENOENT => DeviceError::NotFound { name: what },
            _ => DeviceError::Os {
                what,
                errno,
                message: std::io::Error::from_raw_os_error(errno).to_string(),
            },
        }
    }

    pub fn from_io(err: &std::io::Error, what: impl Into<String>) -> DeviceError {
        match err.raw_os_error() {
            Some(errno) => DeviceError::from_errno(errno, what),
            None => DeviceError::Os { what: what.into(), errno: 0, message: err.to_string() },
        }
    }
}

/// Counters a device keeps; read by `copse stats`.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct DeviceStats {
    pub reads: u64,
    pub writes: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    pub flushes: u64,
    /// System calls that submitted or reaped I/O (one per round when batching works).
    pub submit_calls: u64,
}

impl DeviceStats {
    /// Counts the zeros a file's growth wrote (`files::grow_file`), in writes of at most
    /// `GROW_ZERO_FILL_CHUNK_BYTES`.
    pub(crate) fn count_zero_fill(&mut self, bytes: u64) {
        let chunk = crate::limits::GROW_ZERO_FILL_CHUNK_BYTES as u64;
        self.writes += bytes.div_ceil(chunk);
        self.bytes_written += bytes;
    }

    /// Counts one request of `kind` that moved `bytes` successfully.
    pub(crate) fn count_done(&mut self, kind: IoKind, bytes: u64) {
        match kind {
            IoKind::Read => {
                self.reads += 1;
                self.bytes_read += bytes;
            }
            IoKind::Write => {
                self.writes += 1;
                self.bytes_written += bytes;
            }
        }
    }
}

impl std::ops::Add for DeviceStats {
    type Output = DeviceStats;

    /// Figures of two devices together (a store's total over its shards).
    fn add(self, other: DeviceStats) -> DeviceStats {
        DeviceStats {
            reads: self.reads + other.reads,
            writes: self.writes + other.writes,
            bytes_read: self.bytes_read + other.bytes_read,
            bytes_written: self.bytes_written + other.bytes_written,
            flushes: self.flushes + other.flushes,
            submit_calls: self.submit_calls + other.submit_calls,
        }
    }
}

/// Batched block I/O on one store directory, owned by one thread.
pub trait BlockDevice: Send {
    /// Opens the file `name` (a relative path such as `shard-000/class-04.slab`), creating it
    /// (and its parent directories, durably) when `create` is set.
    fn open_file(&mut self, name: &str, create: bool) -> Result<FileId, DeviceError>;
    /// Names of the files under `dir` (relative, no recursion), sorted.
    fn list_files(&mut self, dir: &str) -> Result<Vec<String>, DeviceError>;
    fn file_len_bytes(&mut self, file: FileId) -> Result<u64, DeviceError>;
    /// Grows the file to `len_bytes` (zero filled, space allocated) and makes the new size
    /// durable. Never shrinks.
    fn grow_file(&mut self, file: FileId, len_bytes: u64) -> Result<(), DeviceError>;
    /// Queues all requests with one system call. Fails only if the requests are malformed or the
    /// device is unusable; individual I/O failures come back as completions.
    fn submit(&mut self, requests: Vec<IoRequest>) -> Result<(), DeviceError>;
    /// Moves completed requests to `out`, waiting until at least `min_complete` have completed
    /// (never more than are in flight).
    fn reap(&mut self, min_complete: usize, out: &mut Vec<IoCompletion>)
        -> Result<(), DeviceError>;
    /// Requests submitted and not yet reaped.
    fn in_flight(&self) -> usize;
    /// A file descriptor that polls readable (POLLIN) while a completion waits in the kernel,
    /// so that the owner can wait for completions together with other events and then `reap`
    /// without waiting. `None` (the default) when `reap(1, ..)` returns at once: the device
    /// completes requests at submit or at reap (sync, simulated), or it already holds a
    /// completion it has not handed out.
    fn completion_fd(&self) -> Option<BorrowedFd<'_>> {
        None
    }
    /// Whether reads, writes and flushes (`submit_flush`) are submitted and completed without
    /// blocking the calling thread, with completions announced through `completion_fd`
    /// (io_uring): the engine flushes in the background and can share its thread
    /// (`ShardEngine::can_share_thread`). Otherwise `flush` is the only way to flush.
    fn completes_asynchronously(&self) -> bool {
        false
    }
    /// From `on` until it is called with `false`, queue requests (and background flushes)
    /// without the system call that hands them to the kernel; with `false`, make that call now
    /// for what was held back. For a caller that runs a shard's turn on its own thread
    /// (`shard/combine.rs`): io_uring posts a request's completion through task work on the
    /// thread that submitted it, so a caller that submitted and then slept on its answer would
    /// be woken just to post the completion. Devices that submit in place ignore it.
    fn defer_submission(&mut self, on: bool) -> Result<(), DeviceError> {
        let _ = on;
        Ok(())
    }
    /// Requests queued and held back by `defer_submission`, not yet handed to the kernel.
    fn has_deferred_submission(&self) -> bool {
        false
    }
    /// The requests held back by `defer_submission`, when they are all reads and at most `max`:
    /// the caller performs them on its own thread ([`TakenRead::perform`], without holding
    /// whatever guards this device) and gives them back with `give_back`; until then they
    /// count in `in_flight`, and `reap` never waits for them. Empty when the held-back requests
    /// are anything else (they stay held back), or when the device submits in place.
    fn take_reads(&mut self, max: usize) -> Vec<TakenRead> {
        let _ = max;
        Vec::new()
    }
    /// Completes reads taken by `take_reads` (performed or not): the next `reap` hands them out.
    fn give_back(&mut self, reads: Vec<TakenRead>) {
        assert!(reads.is_empty(), "this device hands out no reads to take");
    }
    /// Reads taken by `take_reads` and not yet given back.
    fn taken_reads(&self) -> usize {
        0
    }
    /// Makes durable every write whose completion `reap` has handed out (no-op cost under
    /// `Dsync` beyond the call). On success `write_completions_durable` rises to the value
    /// `write_completions_reaped` had when the flush began. Waits for a background flush in
    /// flight first (its end is still taken with `take_flush_done`).
    fn flush(&mut self) -> Result<(), DeviceError>;
    /// Starts a flush of every write whose completion `reap` has handed out, without waiting
    /// for it (the caller bounds how many are in flight). It counts in `in_flight` until taken,
    /// and its end is announced like any completion (the completion fd; `reap` returns once one
    /// has ended). Ends are taken in submission order, each only after every earlier one. On
    /// success `write_completions_durable` then rises to the value `write_completions_reaped`
    /// had at this call. On `Err` this flush is not in flight (nor reported).
    fn submit_flush(&mut self) -> Result<(), DeviceError> {
        Err(DeviceError::BadRequest("this device does not flush in the background".into()))
    }
    /// The end of the oldest background flush not yet taken, once it (and every earlier one)
    /// has ended (after a `reap` or a `flush`).
    fn take_flush_done(&mut self) -> Option<Result<(), DeviceError>> {
        None
    }
    /// Write completions (successful or not) that `reap` has handed out so far; never decreases.
    fn write_completions_reaped(&self) -> u64;
    /// Every write whose completion `reap` handed out while `write_completions_reaped` was at
    /// most this is durable. Under `Dsync` it equals `write_completions_reaped`.
    fn write_completions_durable(&self) -> u64;
    fn durability(&self) -> WriteDurability;
    fn stats(&self) -> DeviceStats;
    /// The engine has reached the named place `point` (see [`fault_point`]). Real devices do
    /// nothing; the simulated one counts the hit and may crash or fail here. On `Err` the engine
    /// takes the failure path of the device operation next to the point.
    fn fault_point(&mut self, point: FaultPoint) -> Result<(), DeviceError> {
        let _ = point;
        Ok(())
    }
}

/// Opens devices over one store directory: one per shard thread, plus one for store metadata.
pub trait Storage: Send + Sync {
    fn open_device(&self) -> Result<Box<dyn BlockDevice>, DeviceError>;
    /// A human-readable description (path and backend), for logs and `copse stats`.
    fn describe(&self) -> String;
    /// Measures random against sequential write throughput (device/probe.rs), for `auto`
    /// placement. `None`: this storage cannot be probed (the simulated device has no timing).
    fn probe_writes(&self) -> Result<Option<probe::WriteProbe>, DeviceError> {
        Ok(None)
    }
}

/// Which real backend to use for a directory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Backend {
    /// io_uring when the kernel allows it, else pread/pwrite (logged).
    Auto,
    Uring,
    Sync,
}

/// Real storage under a directory: io_uring or pread/pwrite, both with O_DIRECT.
pub struct DirStorage {
    root: PathBuf,
    backend: Backend,
    durability: WriteDurability,
    ring_entries: u32,
    /// Attached to every device this storage opens (power-loss tests).
    observer: Option<std::sync::Arc<dyn IoObserver>>,
}

impl DirStorage {
    /// Resolves `Backend::Auto` by probing io_uring once; logs the choice.
    pub fn new(
        root: &Path,
        backend: Backend,
        durability: WriteDurability,
        ring_entries: u32,
    ) -> Result<DirStorage, DeviceError> {
        let backend = match backend {
            Backend::Auto => match uring::probe() {
                Ok(()) => Backend::Uring,
                Err(err) => {
                    tracing::warn!(%err, "io_uring unavailable; using pread/pwrite fallback");
                    Backend::Sync
                }
            },
            chosen => chosen,
        };
        tracing::info!(?backend, ?durability, root = %root.display(), "device backend chosen");
        Ok(DirStorage {
            root: root.to_path_buf(),
            backend,
            durability,
            ring_entries,
            observer: None,
        })
    }

    /// Reports every device's system calls to `observer` (see [`observer`]).
    pub fn with_observer(mut self, observer: std::sync::Arc<dyn IoObserver>) -> DirStorage {
        self.observer = Some(observer);
        self
    }

    pub fn backend(&self) -> Backend {
        self.backend
    }
}

impl DirStorage {
    fn open_device_observed_by(
        &self,
        observer: Option<std::sync::Arc<dyn IoObserver>>,
    ) -> Result<Box<dyn BlockDevice>, DeviceError> {
        match self.backend {
            Backend::Uring | Backend::Auto => Ok(Box::new(
                uring::UringDevice::new(&self.root, self.durability, self.ring_entries)?
                    .with_observer(observer),
            )),
            Backend::Sync => Ok(Box::new(
                sync::SyncDevice::new(&self.root, self.durability)?.with_observer(observer),
            )),
        }
    }
}

impl Storage for DirStorage {
    fn open_device(&self) -> Result<Box<dyn BlockDevice>, DeviceError> {
        self.open_device_observed_by(self.observer.clone())
    }

    /// The directory (the backend and durability mode are logged when chosen).
    fn describe(&self) -> String {
        self.root.display().to_string()
    }

    /// Probes the file system under the directory once per process (device/probe.rs).
    fn probe_writes(&self) -> Result<Option<probe::WriteProbe>, DeviceError> {
        use std::os::unix::fs::MetadataExt;
        static PROBES: std::sync::Mutex<Vec<(u64, WriteDurability, probe::WriteProbe)>> =
            std::sync::Mutex::new(Vec::new());
        let device_id = std::fs::metadata(&self.root)
            .map_err(|err| DeviceError::from_io(&err, self.root.display().to_string()))?
            .dev();
        let mut probes = PROBES.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some((_, _, found)) = probes
            .iter()
            .find(|(id, durability, _)| *id == device_id && *durability == self.durability)
        {
            return Ok(Some(*found));
        }
        // Unobserved: the probe's scratch file is deleted below and is no part of the store.
        let mut device = self.open_device_observed_by(None)?;
        let result = probe::probe_writes(device.as_mut());
        drop(device);
        let path = self.root.join(probe::PROBE_FILE);
        if let Err(err) = std::fs::remove_file(&path) {
            if err.kind() != std::io::ErrorKind::NotFound {
                return Err(DeviceError::from_io(&err, path.display().to_string()));
            }
        }
        let found = result?;
        tracing::info!(
            random_pages_per_second = found.random_pages_per_second as u64,
            sequential_pages_per_second = found.sequential_pages_per_second as u64,
            "device write probe"
        );
        probes.push((device_id, self.durability, found));
        Ok(Some(found))
    }
}

/// One read, waited for: for the manifest, recovery's headers and the offline check, before
/// (or without) the engine's asynchronous machinery. Refuses to run with I/O in flight.
pub fn read_sync(
    device: &mut dyn BlockDevice,
    file: FileId,
    offset: u64,
    bytes: usize,
) -> Result<AlignedBuf, DeviceError> {
    assert_eq!(device.in_flight(), 0, "read_sync with I/O in flight");
    device.submit(vec![IoRequest {
        token: 0,
        file,
        offset,
        kind: IoKind::Read,
        buf: AlignedBuf::zeroed(bytes),
    }])?;
    let mut done = Vec::new();
    device.reap(1, &mut done)?;
    let completion = done.pop().expect("reap(1) returns a completion");
    completion.result?;
    Ok(completion.buf)
}
