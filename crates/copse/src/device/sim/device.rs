//! The simulated disk's devices: [`SimStorage`] (a `Storage` that opens devices on one
//! [`SimDisk`]) and [`SimDevice`] (a `BlockDevice`: its own file-id table and in-flight queue over
//! the disk's files). The disk's model and invariants are in `mod.rs`; nothing here panics on an
//! I/O path (bad requests and injected faults become completion errors).

// The devices work on the disk's private state (`State`, its files and queues), which `mod.rs`
// owns; everything of the parent is theirs to use.
use super::*;

/// `Storage` over a [`SimDisk`].
#[derive(Clone, Debug)]
pub struct SimStorage {
    pub(super) disk: SimDisk,
    pub(super) durability: WriteDurability,
}

impl SimStorage {
    pub fn disk(&self) -> &SimDisk {
        &self.disk
    }
}

impl Storage for SimStorage {
    fn open_device(&self) -> Result<Box<dyn BlockDevice>, DeviceError> {
        if self.disk.has_crashed() {
            return Err(DeviceError::Crashed);
        }
        Ok(Box::new(self.disk.device(self.durability)))
    }

    fn describe(&self) -> String {
        format!("simulated disk (seed {}, {:?})", self.disk.seed(), self.durability)
    }
}

/// One thread's device on a [`SimDisk`].
pub struct SimDevice {
    pub(super) disk: SimDisk,
    pub(super) id: u64,
    pub(super) durability: WriteDurability,
    /// Names by `FileId`.
    pub(super) files: Vec<String>,
}

impl SimDevice {
    fn name(&self, file: FileId) -> Result<&str, DeviceError> {
        self.files
            .get(file as usize)
            .map(String::as_str)
            .ok_or_else(|| DeviceError::BadRequest(format!("unknown file id {file}")))
    }
}

impl BlockDevice for SimDevice {
    fn open_file(&mut self, name: &str, create: bool) -> Result<FileId, DeviceError> {
        let mut state = self.disk.lock();
        if state.crashed {
            return Err(DeviceError::Crashed);
        }
        files::check_name(name)?;
        if let Some(index) = self.files.iter().position(|open| open == name) {
            return Ok(index as FileId);
        }
        if !state.files.contains_key(name) {
            if !create {
                return Err(DeviceError::NotFound { name: name.to_string() });
            }
            // A real filesystem cannot have a file and a directory of one name.
            let under_file =
                name.match_indices('/').any(|(slash, _)| state.files.contains_key(&name[..slash]));
            if under_file {
                return Err(DeviceError::from_errno(libc::ENOTDIR, name));
            }
            let prefix = format!("{name}/");
            if state
                .files
                .range(prefix.clone()..)
                .next()
                .is_some_and(|(k, _)| k.starts_with(&prefix))
            {
                return Err(DeviceError::from_errno(libc::EISDIR, name));
            }
            state.files.insert(name.to_string(), SimFile::default());
        }
        let Ok(id) = FileId::try_from(self.files.len()) else {
            return Err(DeviceError::BadRequest("too many open files".into()));
        };
        self.files.push(name.to_string());
        Ok(id)
    }

    fn list_files(&mut self, dir: &str) -> Result<Vec<String>, DeviceError> {
        let state = self.disk.lock();
        if state.crashed {
            return Err(DeviceError::Crashed);
        }
        files::check_dir(dir)?;
        let prefix = if dir.is_empty() { String::new() } else { format!("{dir}/") };
        Ok(state
            .files
            .range(prefix.clone()..)
            .take_while(|(name, _)| name.starts_with(&prefix))
            .map(|(name, _)| &name[prefix.len()..])
            .filter(|rest| !rest.contains('/'))
            .map(str::to_string)
            .collect())
    }

    fn file_len_bytes(&mut self, file: FileId) -> Result<u64, DeviceError> {
        let name = self.name(file)?;
        let state = self.disk.lock();
        if state.crashed {
            return Err(DeviceError::Crashed);
        }
        Ok(state.files.get(name).map_or(0, |f| f.volatile.len() as u64))
    }

    fn grow_file(&mut self, file: FileId, len_bytes: u64) -> Result<(), DeviceError> {
        let mut state = self.disk.lock();
        if state.crashed {
            return Err(DeviceError::Crashed);
        }
        let name = self.name(file)?.to_string();
        if !files::page_aligned(len_bytes) || len_bytes > SIM_FILE_BYTES_MAX {
            return Err(DeviceError::BadRequest(format!("grow {name} to {len_bytes} bytes")));
        }
        state.begin_op(FaultOp::Grow, || format!("fallocate {name}"))?;
        let file = state.files.entry(name).or_default();
        let len = len_bytes as usize;
        for image in [&mut file.durable, &mut file.volatile] {
            if image.len() < len {
                image.resize(len, 0);
            }
        }
        Ok(())
    }

    /// A request is counted (and may crash the disk or fault) at submit; it takes effect at
    /// `reap`. If the disk crashes during this call, `Err(Crashed)` is returned and none of this
    /// call's requests come back; those counted before the crash point were in flight at the
    /// crash (a restart may keep, drop or tear them).
    fn submit(&mut self, requests: Vec<IoRequest>) -> Result<(), DeviceError> {
        let mut guard = self.disk.lock();
        let state = &mut *guard;
        state.bump(self.id, |s| s.submit_calls += 1);
        let queued_before = state.devices.get(&self.id).map_or(0, |slot| slot.in_flight.len());
        let mut crashed = false;
        for request in requests {
            let checked = files::check_request(&request, self.files.len()).and_then(|()| {
                match request.offset.checked_add(request.buf.len() as u64) {
                    Some(end) if end <= SIM_FILE_BYTES_MAX => Ok(()),
                    _ => Err(DeviceError::BadRequest(format!(
                        "request ends past the simulator's {SIM_FILE_BYTES_MAX}-byte file limit"
                    ))),
                }
            });
            let name = self.files.get(request.file as usize).cloned().unwrap_or_default();
            let outcome = match checked {
                // Malformed requests are not device operations: not counted, never faulted.
                Err(err) => Err(err),
                Ok(()) => {
                    let kind = match request.kind {
                        IoKind::Read => FaultOp::Read,
                        IoKind::Write => FaultOp::Write,
                    };
                    let gate = state.begin_op(kind, || files::describe(&request, &name));
                    if gate == Err(DeviceError::Crashed) {
                        crashed = true;
                        break;
                    }
                    gate
                }
            };
            let held_by_pattern = request.kind == IoKind::Write
                && state.hold_pattern.as_ref().is_some_and(|pattern| {
                    request.buf.windows(pattern.len()).any(|window| window == &pattern[..])
                });
            let held_reaps = if held_by_pattern {
                state.held_requests += 1;
                HELD_UNTIL_RELEASED
            } else if state.hold_probability > 0.0 && state.rng.gen_bool(state.hold_probability) {
                state.held_requests += 1;
                state.rng.gen_range(1..=state.hold_reaps_max)
            } else {
                0
            };
            // Queued before the next request's gate, so a crash there records it as in flight.
            if let Some(slot) = state.devices.get_mut(&self.id) {
                slot.in_flight.push(InFlight { request, name, outcome, held_reaps });
            }
        }
        if crashed {
            if let Some(slot) = state.devices.get_mut(&self.id) {
                slot.in_flight.truncate(queued_before);
            }
            return Err(DeviceError::Crashed);
        }
        Ok(())
    }

    /// Completes between `min_complete` and all of the in-flight requests that are not held
    /// (a seeded random number), picked in seeded random order; held requests are released
    /// when `min_complete` needs them.
    fn reap(
        &mut self,
        min_complete: usize,
        out: &mut Vec<IoCompletion>,
    ) -> Result<(), DeviceError> {
        let mut guard = self.disk.lock();
        let state = &mut *guard;
        let queue = match state.devices.get_mut(&self.id) {
            Some(slot) => std::mem::take(&mut slot.in_flight),
            None => return Ok(()),
        };
        if queue.is_empty() {
            return Ok(());
        }
        let wanted = min_complete.min(queue.len());
        if wanted > 0 {
            state.bump(self.id, |s| s.submit_calls += 1);
        }
        // Held requests stay behind, unless needed to reach `wanted`.
        let (mut held, mut ready): (Vec<_>, Vec<_>) =
            queue.into_iter().partition(|item| item.held_reaps > 0);
        while ready.len() < wanted {
            let mut released = held.remove(0);
            released.held_reaps = 0;
            ready.push(released);
        }
        for item in held.iter_mut().filter(|item| item.held_reaps != HELD_UNTIL_RELEASED) {
            item.held_reaps -= 1;
        }
        let count = state.rng.gen_range(wanted..=ready.len());
        let mut writes = 0;
        for _ in 0..count {
            let pick = state.rng.gen_range(0..ready.len());
            let item = ready.swap_remove(pick);
            writes += u64::from(item.request.kind == IoKind::Write);
            out.push(state.complete(self.id, self.durability, item));
        }
        ready.extend(held);
        if let Some(slot) = state.devices.get_mut(&self.id) {
            slot.in_flight = ready;
            slot.write_completions_reaped += writes;
        }
        Ok(())
    }

    fn in_flight(&self) -> usize {
        self.disk.lock().devices.get(&self.id).map_or(0, |slot| slot.in_flight.len())
    }

    fn flush(&mut self) -> Result<(), DeviceError> {
        let mut state = self.disk.lock();
        state.begin_op(FaultOp::Flush, || "fdatasync".to_string())?;
        state.bump(self.id, |s| s.flushes += 1);
        state.flush_pending(self.id);
        if let Some(slot) = state.devices.get_mut(&self.id) {
            slot.write_completions_durable = slot.write_completions_reaped;
        }
        Ok(())
    }

    fn write_completions_reaped(&self) -> u64 {
        self.disk.lock().devices.get(&self.id).map_or(0, |slot| slot.write_completions_reaped)
    }

    fn write_completions_durable(&self) -> u64 {
        let state = self.disk.lock();
        let Some(slot) = state.devices.get(&self.id) else { return 0 };
        match self.durability {
            WriteDurability::Dsync => slot.write_completions_reaped,
            WriteDurability::FlushPerRound => slot.write_completions_durable,
        }
    }

    fn durability(&self) -> WriteDurability {
        self.durability
    }

    fn stats(&self) -> DeviceStats {
        self.disk.lock().devices.get(&self.id).map_or_else(DeviceStats::default, |slot| slot.stats)
    }

    /// Counts the hit and fires a fault armed for it. A crashed disk counts nothing: the
    /// engine's next device operation fails anyway.
    fn fault_point(&mut self, point: FaultPoint) -> Result<(), DeviceError> {
        let mut state = self.disk.lock();
        if state.crashed {
            return Ok(());
        }
        let hits = state.point_hits.entry(point).or_default();
        *hits += 1;
        let hits = *hits;
        let Some(at) = state.point_faults.iter().position(|&(p, at, _)| p == point && at == hits)
        else {
            return Ok(());
        };
        let (_, _, fault) = state.point_faults.swap_remove(at);
        state.points_fired.push((point, fault));
        let what = || format!("fault point {point}");
        match fault {
            PointFault::Crash => {
                state.crash();
                Err(DeviceError::Crashed)
            }
            PointFault::Fail(FaultError::Io) => Err(DeviceError::Io { what: what() }),
            PointFault::Fail(FaultError::NoSpace) => Err(DeviceError::NoSpace { what: what() }),
        }
    }
}

impl Drop for SimDevice {
    /// Like the real device, waits for (here: performs) what is in flight, in submission order.
    fn drop(&mut self) {
        let mut state = self.disk.lock();
        let Some(slot) = state.devices.remove(&self.id) else {
            return;
        };
        for item in slot.in_flight {
            drop(state.complete(self.id, self.durability, item));
        }
    }
}
