//! A short write probe of a real device, run when a store with `auto` placement is created: how
//! many 4 KiB pages per second it takes written at random, and how many written sequentially in
//! large I/Os, each made durable the way the store will make them durable. Their ratio decides
//! which classes append (engine/native/placement.rs, docs/placement.md).
//!
//! The probe writes a scratch file in the store directory (`PROBE_FILE`), first whole (so later
//! writes land on allocated, written space, as a store's steady state does), then random pages
//! for `PROBE_PHASE_MS`, then sequential runs for as long, and removes it. Results are cached per
//! file system for the life of the process, so a process that creates many stores probes once.

use std::time::{Duration, Instant};

use super::{AlignedBuf, BlockDevice, DeviceError, IoKind, IoRequest, WriteDurability};
use crate::limits::{
    PAGE_BYTES, PROBE_FILE_BYTES, PROBE_PHASE_MS, PROBE_RANDOM_DEPTH, PROBE_SEQUENTIAL_IO_BYTES,
};

/// The scratch file, relative to the store directory.
pub const PROBE_FILE: &str = "PROBE.tmp";

/// What the probe measured.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct WriteProbe {
    pub random_pages_per_second: f64,
    pub sequential_pages_per_second: f64,
}

impl WriteProbe {
    pub fn sequential_over_random(&self) -> f64 {
        self.sequential_pages_per_second / self.random_pages_per_second.max(1e-9)
    }
}

/// Runs the probe on `device` (which must have nothing in flight) in the file `PROBE_FILE`.
/// The caller removes the file.
pub fn probe_writes(device: &mut dyn BlockDevice) -> Result<WriteProbe, DeviceError> {
    let file = device.open_file(PROBE_FILE, true)?;
    device.grow_file(file, PROBE_FILE_BYTES)?;
    let pages = PROBE_FILE_BYTES / PAGE_BYTES as u64;
    let run_pages = (PROBE_SEQUENTIAL_IO_BYTES / PAGE_BYTES) as u64;
    // Fill it once, so both phases write over written space.
    let mut offset = 0;
    while offset < PROBE_FILE_BYTES {
        let batch: Vec<(u64, usize)> = (0..4)
            .map(|i| offset + i * PROBE_SEQUENTIAL_IO_BYTES as u64)
            .filter(|&at| at < PROBE_FILE_BYTES)
            .map(|at| (at, PROBE_SEQUENTIAL_IO_BYTES))
            .collect();
        offset += 4 * PROBE_SEQUENTIAL_IO_BYTES as u64;
        write_batch(device, file, &batch)?;
    }
    let phase = Duration::from_millis(PROBE_PHASE_MS);
    // A small deterministic generator: the probe needs spread, not quality.
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next_page = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state % pages
    };
    let started = Instant::now();
    let mut random_pages = 0u64;
    while started.elapsed() < phase {
        let batch: Vec<(u64, usize)> = (0..PROBE_RANDOM_DEPTH)
            .map(|_| (next_page() * PAGE_BYTES as u64, PAGE_BYTES))
            .collect();
        write_batch(device, file, &batch)?;
        random_pages += PROBE_RANDOM_DEPTH as u64;
    }
    let random_seconds = started.elapsed().as_secs_f64();
    let started = Instant::now();
    let mut sequential_pages = 0u64;
    let mut run = 0u64;
    let runs = pages / run_pages;
    while started.elapsed() < phase {
        let batch: Vec<(u64, usize)> = (0..4)
            .map(|i| ((run + i) % runs * run_pages * PAGE_BYTES as u64, PROBE_SEQUENTIAL_IO_BYTES))
            .collect();
        run += 4;
        write_batch(device, file, &batch)?;
        sequential_pages += 4 * run_pages;
    }
    let sequential_seconds = started.elapsed().as_secs_f64();
    Ok(WriteProbe {
        random_pages_per_second: random_pages as f64 / random_seconds,
        sequential_pages_per_second: sequential_pages as f64 / sequential_seconds,
    })
}

/// Writes `(offset, bytes)` pieces with one submit, waits for them, and makes them durable as the
/// device's durability mode says a round of writes is made durable.
fn write_batch(
    device: &mut dyn BlockDevice,
    file: super::FileId,
    pieces: &[(u64, usize)],
) -> Result<(), DeviceError> {
    let requests: Vec<IoRequest> = pieces
        .iter()
        .enumerate()
        .map(|(token, &(offset, bytes))| {
            let mut buf = AlignedBuf::zeroed(bytes);
            buf.iter_mut().enumerate().for_each(|(i, byte)| *byte = (i as u64 ^ offset) as u8);
            IoRequest { token: token as u64, file, offset, kind: IoKind::Write, buf }
        })
        .collect();
    let count = requests.len();
    device.submit(requests)?;
    let mut done = Vec::new();
    while done.len() < count {
        device.reap(1, &mut done)?;
    }
    for completion in done {
        completion.result?;
    }
    if device.durability() == WriteDurability::FlushPerRound {
        device.flush()?;
    }
    Ok(())
}
