//! `SyncDevice`: the fallback device, pread/pwrite on O_DIRECT files, for kernels or sandboxes
//! without io_uring.
//!
//! Invariants:
//! - `submit` performs every request before it returns, in order, and queues its completion;
//!   `reap` hands the queue over. So `in_flight` is the queue's length and no buffer is ever
//!   shared with the kernel past a system call.
//! - Under `Dsync` files are opened with O_DSYNC (pwrite has no per-call flag without pwritev2),
//!   so each pwrite returns only once durable, and `flush` does nothing. Under `FlushPerRound`
//!   `flush` fdatasyncs every file written since its last fdatasync began (a pwrite has
//!   completed when it returns, inside `submit`, so marking there is marking at completion).
//! - `submit_calls` counts every pread/pwrite: this backend cannot batch, and the stat says so.
//! - A completion is `Ok` only for a whole transfer, as with io_uring.

use std::collections::VecDeque;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::files::{self, OpenFile};
use super::{
    BlockDevice, DeviceError, DeviceStats, FileId, IoCompletion, IoKind, IoObserver, IoRequest,
    WriteDurability,
};

pub struct SyncDevice {
    root: PathBuf,
    durability: WriteDurability,
    files: Vec<OpenFile>,
    /// Per file id: written since the last flush (tracked only under `FlushPerRound`).
    dirty: Vec<bool>,
    /// Completions of performed requests, in submission order, not yet reaped.
    ready: VecDeque<IoCompletion>,
    stats: DeviceStats,
    ledger: files::FlushLedger,
    observer: Option<Arc<dyn IoObserver>>,
}

impl SyncDevice {
    pub fn new(root: &Path, durability: WriteDurability) -> Result<SyncDevice, DeviceError> {
        Ok(SyncDevice {
            root: root.to_path_buf(),
            durability,
            files: Vec::new(),
            dirty: Vec::new(),
            ready: VecDeque::new(),
            stats: DeviceStats::default(),
            ledger: files::FlushLedger::default(),
            observer: None,
        })
    }

    /// Reports this device's system calls to `observer` (power-loss tests).
    pub fn with_observer(mut self, observer: Option<Arc<dyn IoObserver>>) -> SyncDevice {
        self.observer = observer;
        self
    }

    fn open_flags(&self) -> i32 {
        match self.durability {
            WriteDurability::Dsync => libc::O_DSYNC,
            WriteDurability::FlushPerRound => 0,
        }
    }

    /// One pread or pwrite of the whole buffer (EINTR retried); a short transfer is an error.
    fn perform(&mut self, request: &mut IoRequest) -> Result<(), DeviceError> {
        files::check_request(request, self.files.len())?;
        let open = &self.files[request.file as usize];
        let done_bytes = loop {
            self.stats.submit_calls += 1;
            let result = match request.kind {
                IoKind::Read => open.file.read_at(&mut request.buf, request.offset),
                IoKind::Write => open.file.write_at(&request.buf, request.offset),
            };
            match result {
                Ok(done_bytes) => break done_bytes,
                Err(err) if err.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(err) => {
                    return Err(DeviceError::from_io(&err, files::describe(request, &open.name)))
                }
            }
        };
        files::transfer_result(request, &open.name, done_bytes)?;
        self.stats.count_done(request.kind, request.buf.len() as u64);
        Ok(())
    }
}

impl BlockDevice for SyncDevice {
    fn open_file(&mut self, name: &str, create: bool) -> Result<FileId, DeviceError> {
        let flags = self.open_flags();
        let observer = self.observer.as_deref();
        let id = files::open_observed(&mut self.files, &self.root, name, create, flags, observer)?;
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

    fn submit(&mut self, requests: Vec<IoRequest>) -> Result<(), DeviceError> {
        for mut request in requests {
            let observed = match (&self.observer, request.kind) {
                (Some(observer), IoKind::Write) if (request.file as usize) < self.files.len() => {
                    let name = &self.files[request.file as usize].name;
                    Some(observer.write_submitted(name, request.offset, &request.buf))
                }
                _ => None,
            };
            let result = self.perform(&mut request);
            if let (Some(observer), Some(tag)) = (&self.observer, observed) {
                observer.write_completed(tag, result.is_ok());
            }
            // Even a failed write may have changed part of the range, so the file is dirty.
            if request.kind == IoKind::Write
                && self.durability == WriteDurability::FlushPerRound
                && (request.file as usize) < self.dirty.len()
            {
                self.dirty[request.file as usize] = true;
            }
            self.ready.push_back(IoCompletion::of(request, result));
        }
        Ok(())
    }

    fn reap(
        &mut self,
        _min_complete: usize,
        out: &mut Vec<IoCompletion>,
    ) -> Result<(), DeviceError> {
        // Everything submitted has already completed, so any `min_complete` is met.
        self.ledger.hand_out(self.ready.drain(..), out);
        Ok(())
    }

    fn in_flight(&self) -> usize {
        self.ready.len()
    }

    fn flush(&mut self) -> Result<(), DeviceError> {
        self.stats.flushes += 1;
        if self.durability == WriteDurability::Dsync {
            return Ok(()); // O_DSYNC: every completed write was already durable
        }
        self.ledger.flush(&self.files, &mut self.dirty, self.observer.as_deref())
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::AlignedBuf;
    use crate::limits::PAGE_BYTES;

    fn device(durability: WriteDurability) -> Option<(tempfile::TempDir, SyncDevice)> {
        let dir = tempfile::tempdir().unwrap();
        let mut device = SyncDevice::new(dir.path(), durability).unwrap();
        if let Err(err) = device.open_file("probe-direct", true) {
            eprintln!("skipping sync-device test: O_DIRECT unavailable in temp dir: {err}");
            return None;
        }
        Some((dir, device))
    }

    #[test]
    fn round_trip_both_durabilities() {
        for durability in [WriteDurability::Dsync, WriteDurability::FlushPerRound] {
            let Some((dir, mut device)) = device(durability) else {
                return;
            };
            files::testing::round_trip(&mut device, dir.path());
            // One system call per request: 3 writes + 6 requests, of which 2 were rejected.
            assert_eq!(device.stats().submit_calls, 3 + 4);
        }
    }

    /// The fallback device under the same rule as io_uring (issue 20, finding 1): what a flush
    /// reports as durable is only what it synced after the write completed.
    #[test]
    fn a_flush_covers_what_completed_before_it() {
        use crate::device::observer::testing::EventLog;
        let Some((_dir, device)) = device(WriteDurability::FlushPerRound) else {
            return;
        };
        let log = std::sync::Arc::new(EventLog::default());
        let mut device = device.with_observer(Some(log.clone()));
        let file = device.open_file("a.slab", true).unwrap();
        device.grow_file(file, 4 * PAGE_BYTES as u64).unwrap();
        let mut buf = AlignedBuf::zeroed(PAGE_BYTES);
        buf.fill(9);
        device
            .submit(vec![IoRequest { token: 1, file, offset: 0, kind: IoKind::Write, buf }])
            .unwrap();
        device.flush().unwrap();
        let mut out = Vec::new();
        device.reap(1, &mut out).unwrap();
        assert_eq!(device.write_completions_reaped(), 1);
        assert_eq!(device.write_completions_durable(), 0, "reaped after the flush began");
        // pwrite returned before that fdatasync began, so it did cover the write.
        let tag = log.first_write_to("a.slab").expect("the write was observed");
        assert!(log.synced_after_completion(tag, "a.slab"));
        device.flush().unwrap();
        assert_eq!(device.write_completions_durable(), 1);
    }

    #[test]
    fn completions_come_back_in_submission_order() {
        let Some((_dir, mut device)) = device(WriteDurability::FlushPerRound) else {
            return;
        };
        let file = device.open_file("x/y.slab", true).unwrap();
        device.grow_file(file, 32 * PAGE_BYTES as u64).unwrap();
        let requests = (0..32u64)
            .map(|p| {
                let mut buf = AlignedBuf::zeroed(PAGE_BYTES);
                buf.fill(p as u8 + 1);
                IoRequest {
                    token: 100 + p,
                    file,
                    offset: p * PAGE_BYTES as u64,
                    kind: IoKind::Write,
                    buf,
                }
            })
            .collect();
        device.submit(requests).unwrap();
        assert_eq!(device.in_flight(), 32);
        let mut out = Vec::new();
        device.reap(32, &mut out).unwrap();
        assert_eq!(device.in_flight(), 0);
        assert_eq!(out.iter().map(|c| c.token).collect::<Vec<_>>(), (100..132).collect::<Vec<_>>());
        device.flush().unwrap();
        let reread = vec![IoRequest {
            token: 1,
            file,
            offset: 5 * PAGE_BYTES as u64,
            kind: IoKind::Read,
            buf: AlignedBuf::zeroed(2 * PAGE_BYTES),
        }];
        device.submit(reread).unwrap();
        out.clear();
        device.reap(1, &mut out).unwrap();
        assert_eq!(out[0].result, Ok(()));
        assert!(out[0].buf[..PAGE_BYTES].iter().all(|&b| b == 6));
        assert!(out[0].buf[PAGE_BYTES..].iter().all(|&b| b == 7));
    }
}
