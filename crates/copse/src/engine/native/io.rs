//! The I/O plumbing of one shard's engine (`Io`): its device, the requests queued for the
//! round's one submission, what each request queued or in flight is for, and completions that
//! were reaped early.
//!
//! Invariants:
//! - Every token is handed out once, and names at most one request. From the moment a request
//!   is queued until its completion is handed back, its token has exactly one purpose in
//!   `purposes` (asserted in `queue`); `NativeEngine::complete` takes the purpose once.
//! - The asynchronous machinery never has more than `depth_max` requests in flight: a round's
//!   requests wait in `ready` and `submit_ready` submits only what fits (`sync_io`, the
//!   synchronous header write of a new slab file, may add one more, which it reaps itself).
//! - A submission the device refused is completed with its error, so every queued request is
//!   answered exactly once (by the device or by `submit_ready`).
//! - Completions that `sync_io` reaps for other requests are kept in `stashed` and handed, in
//!   the order reaped, to the next `reap`: none is lost or taken twice.

use std::collections::VecDeque;

use super::IoPurpose;
use crate::device::{
    AlignedBuf, BlockDevice, DeviceError, FileId, IoCompletion, IoKind, IoRequest, WriteDurability,
};
use crate::hash::HashMap;
use crate::limits::PAGE_BYTES;

pub(super) struct Io {
    /// For the log.
    shard_id: u32,
    pub(super) device: Box<dyn BlockDevice>,
    /// When a completed write is durable (the device's own answer, fixed at open).
    pub(super) durability: WriteDurability,
    /// The most requests of the asynchronous machinery in flight at once.
    depth_max: usize,
    /// Requests queued this round, submitted by `submit_ready`.
    ready: VecDeque<IoRequest>,
    /// What each queued or in-flight request is for, by token.
    purposes: HashMap<u64, IoPurpose>,
    next_token: u64,
    /// Completions reaped by `sync_io` that belong to the asynchronous machinery.
    stashed: Vec<IoCompletion>,
}

impl Io {
    pub(super) fn new(shard_id: u32, device: Box<dyn BlockDevice>, depth_max: usize) -> Io {
        let durability = device.durability();
        Io {
            shard_id,
            device,
            durability,
            depth_max: depth_max.max(1),
            ready: VecDeque::new(),
            purposes: HashMap::default(),
            next_token: 1,
            stashed: Vec::new(),
        }
    }

    pub(super) fn take_token(&mut self) -> u64 {
        let token = self.next_token;
        self.next_token += 1;
        token
    }

    /// Queues a request for the round's submission; `purpose` says what to do on completion.
    pub(super) fn queue(
        &mut self,
        kind: IoKind,
        file: FileId,
        offset: u64,
        buf: AlignedBuf,
        purpose: IoPurpose,
    ) {
        let token = self.take_token();
        let previous = self.purposes.insert(token, purpose);
        assert!(previous.is_none(), "shard {}: I/O token {token} used twice", self.shard_id);
        self.ready.push_back(IoRequest { token, file, offset, kind, buf });
    }

    /// Submits queued I/O up to the queue-depth bound, with one system call.
    pub(super) fn submit_ready(&mut self) {
        let room = self.depth_max.saturating_sub(self.device.in_flight());
        let count = room.min(self.ready.len());
        if count == 0 {
            return;
        }
        let requests: Vec<IoRequest> = self.ready.drain(..count).collect();
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
    pub(super) fn sync_io(&mut self, request: IoRequest) -> Result<AlignedBuf, DeviceError> {
        let token = request.token;
        self.purposes.insert(token, IoPurpose::Sync);
        self.device.submit(vec![request]).inspect_err(|_| {
            self.purposes.remove(&token);
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
                self.purposes.remove(&token);
                completion.result?;
                return Ok(completion.buf);
            }
        }
    }

    /// Hands over the completions stashed earlier, then what the device has reaped (waiting for
    /// one if `wait`, none is at hand and I/O is in flight). On a device error the completions
    /// gathered before it are in `completions` too.
    pub(super) fn reap(
        &mut self,
        wait: bool,
        completions: &mut Vec<IoCompletion>,
    ) -> Result<(), DeviceError> {
        completions.append(&mut self.stashed);
        let min = usize::from(wait && completions.is_empty() && self.device.in_flight() > 0);
        self.device.reap(min, completions)
    }

    /// The purpose of a completed request (once: it is forgotten here).
    pub(super) fn take_purpose(&mut self, token: u64) -> Option<IoPurpose> {
        self.purposes.remove(&token)
    }

    pub(super) fn in_flight(&self) -> usize {
        self.device.in_flight()
    }

    /// The device's fd that polls readable while a completion waits (the shard loop sleeps on
    /// it), unless completions reaped by `sync_io` wait in `stashed`: then the next reap has
    /// work at once, and there is nothing to sleep on.
    pub(super) fn completion_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        if self.stashed.is_empty() {
            self.device.completion_fd()
        } else {
            None
        }
    }

    /// Nothing queued, in flight or stashed.
    pub(super) fn is_quiet(&self) -> bool {
        self.ready.is_empty() && self.device.in_flight() == 0 && self.stashed.is_empty()
    }
}
