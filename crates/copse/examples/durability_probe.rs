//! Measures which `WriteDurability` should be the default: random 4 KiB writes through
//! `UringDevice` at queue depths 1, 16 and 64, in rounds as a shard issues them:
//! - `dsync`: a round of N writes, each with RWF_DSYNC, acknowledged at its own completion;
//! - `flush-per-round`: a round of N plain writes, all reaped, then one `flush` (fdatasync);
//!   every write of the round is acknowledged when the flush returns.
//!
//! Each (mode, depth) runs for a few seconds on two kinds of file:
//! - `overwrite`: every page already written once (a slab in steady state);
//! - `fresh`: just grown with fallocate, so each write lands on an unwritten extent and the
//!   filesystem must also commit the extent conversion (a slab being filled).
//!
//! Usage: `durability_probe [DIR] [SECONDS_PER_CELL]` (default `./data`, 3 s). Files are created in
//! DIR and the fresh ones removed afterwards.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use copse::device::uring::UringDevice;
use copse::device::{AlignedBuf, BlockDevice, FileId, IoKind, IoRequest, WriteDurability};
use copse::limits::PAGE_BYTES;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const OVERWRITE_FILE_BYTES: u64 = 256 * 1024 * 1024;
/// Large enough that a cell never runs out of never-written pages.
const FRESH_FILE_BYTES: u64 = 1024 * 1024 * 1024;
const DEPTHS: [usize; 3] = [1, 16, 64];
const RING_ENTRIES: u32 = 128;
const PREFILL_CHUNK_BYTES: usize = 1024 * 1024;

type Error = Box<dyn std::error::Error>;

#[derive(Clone, Copy, PartialEq, Eq)]
enum FileKind {
    Overwrite,
    Fresh,
}

struct Cell {
    mode: WriteDurability,
    file_kind: FileKind,
    depth: usize,
    writes: u64,
    elapsed: Duration,
    latencies_us: Vec<u64>,
    flushes: u64,
}

fn main() -> Result<(), Error> {
    let mut args = std::env::args().skip(1);
    let root = PathBuf::from(args.next().unwrap_or_else(|| "./data".into()));
    let seconds: f64 = args.next().map(|s| s.parse()).transpose()?.unwrap_or(3.0);
    let cell_time = Duration::from_secs_f64(seconds);
    std::fs::create_dir_all(&root)?;
    copse::device::uring::probe()?;

    println!("durability probe in {} ({seconds} s per cell)", root.display());
    prefill(&root, "probe-overwrite.dat")?;

    let mut cells = Vec::new();
    // Modes alternate within each depth, so drift in a shared device's load hits both alike.
    for file_kind in [FileKind::Overwrite, FileKind::Fresh] {
        for depth in DEPTHS {
            for mode in [WriteDurability::Dsync, WriteDurability::FlushPerRound] {
                let cell = run_cell(&root, mode, file_kind, depth, cell_time)?;
                print_cell(&cell);
                cells.push(cell);
            }
        }
    }
    println!();
    println!("summary (IOPS, dsync / flush-per-round):");
    for file_kind in [FileKind::Overwrite, FileKind::Fresh] {
        for depth in DEPTHS {
            let iops = |mode| {
                cells
                    .iter()
                    .find(|c| c.mode == mode && c.file_kind == file_kind && c.depth == depth)
                    .map_or(0.0, |c| c.writes as f64 / c.elapsed.as_secs_f64())
            };
            let dsync = iops(WriteDurability::Dsync);
            let flush = iops(WriteDurability::FlushPerRound);
            println!(
                "  {:<9} qd {:>2}: {:>8.0} / {:>8.0}  (dsync is {:.2}x)",
                kind_name(file_kind),
                depth,
                dsync,
                flush,
                dsync / flush.max(1.0)
            );
        }
    }
    Ok(())
}

fn kind_name(kind: FileKind) -> &'static str {
    match kind {
        FileKind::Overwrite => "overwrite",
        FileKind::Fresh => "fresh",
    }
}

fn mode_name(mode: WriteDurability) -> &'static str {
    match mode {
        WriteDurability::Dsync => "dsync",
        WriteDurability::FlushPerRound => "flush-per-round",
    }
}

/// Grows `name` and writes every page once, so later writes overwrite allocated, written blocks.
fn prefill(root: &Path, name: &str) -> Result<(), Error> {
    let started = Instant::now();
    let mut device = UringDevice::new(root, WriteDurability::FlushPerRound, RING_ENTRIES)?;
    let file = device.open_file(name, true)?;
    device.grow_file(file, OVERWRITE_FILE_BYTES)?;
    let mut buf_pool: Vec<AlignedBuf> = Vec::new();
    let mut offset = 0u64;
    let mut out = Vec::new();
    while offset < OVERWRITE_FILE_BYTES || device.in_flight() > 0 {
        let mut batch = Vec::new();
        while offset < OVERWRITE_FILE_BYTES && device.in_flight() + batch.len() < 8 {
            let mut buf = buf_pool.pop().unwrap_or_else(|| AlignedBuf::zeroed(PREFILL_CHUNK_BYTES));
            buf.fill(0x5a);
            batch.push(IoRequest { token: 0, file, offset, kind: IoKind::Write, buf });
            offset += PREFILL_CHUNK_BYTES as u64;
        }
        if !batch.is_empty() {
            device.submit(batch)?;
        }
        out.clear();
        device.reap(1, &mut out)?;
        for completion in out.drain(..) {
            completion.result?;
            buf_pool.push(completion.buf);
        }
    }
    device.flush()?;
    println!(
        "prefilled {} MiB in {:.1} s",
        OVERWRITE_FILE_BYTES >> 20,
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

fn run_cell(
    root: &Path,
    mode: WriteDurability,
    file_kind: FileKind,
    depth: usize,
    cell_time: Duration,
) -> Result<Cell, Error> {
    let mut device = UringDevice::new(root, mode, RING_ENTRIES)?;
    let mut rng = ChaCha8Rng::seed_from_u64(depth as u64);
    let fresh_name = format!("probe-fresh-{}-{depth}.dat", mode_name(mode));
    let (file, mut pages): (FileId, Vec<u64>) = match file_kind {
        FileKind::Overwrite => (device.open_file("probe-overwrite.dat", false)?, Vec::new()),
        FileKind::Fresh => {
            let file = device.open_file(&fresh_name, true)?;
            device.grow_file(file, FRESH_FILE_BYTES)?;
            // Every write goes to a page never written before.
            let mut pages: Vec<u64> = (0..FRESH_FILE_BYTES / PAGE_BYTES as u64).collect();
            pages.shuffle(&mut rng);
            (file, pages)
        }
    };
    let overwrite_pages = OVERWRITE_FILE_BYTES / PAGE_BYTES as u64;
    let mut bufs: Vec<AlignedBuf> = (0..depth).map(|_| AlignedBuf::zeroed(PAGE_BYTES)).collect();
    let mut latencies_us = Vec::new();
    let mut writes = 0u64;
    let mut out = Vec::new();
    let started = Instant::now();
    while started.elapsed() < cell_time {
        if file_kind == FileKind::Fresh && pages.len() < depth {
            break;
        }
        let mut batch = Vec::with_capacity(depth);
        for token in 0..depth {
            let page = match file_kind {
                FileKind::Overwrite => rng.gen_range(0..overwrite_pages),
                FileKind::Fresh => pages.pop().unwrap_or(0),
            };
            let mut buf = bufs.pop().unwrap_or_else(|| AlignedBuf::zeroed(PAGE_BYTES));
            buf[..8].copy_from_slice(&writes.to_le_bytes());
            batch.push(IoRequest {
                token: token as u64,
                file,
                offset: page * PAGE_BYTES as u64,
                kind: IoKind::Write,
                buf,
            });
        }
        let round_start = Instant::now();
        device.submit(batch)?;
        let mut done = 0;
        let mut completed_at = Vec::with_capacity(depth);
        while done < depth {
            out.clear();
            device.reap(1, &mut out)?;
            let now = Instant::now();
            for completion in out.drain(..) {
                completion.result?;
                bufs.push(completion.buf);
                completed_at.push(now);
                done += 1;
            }
        }
        device.flush()?;
        let acked_at = Instant::now();
        for at in completed_at {
            // dsync acknowledges each write at its completion; flush-per-round after the flush.
            let ack = if mode == WriteDurability::Dsync { at } else { acked_at };
            latencies_us.push((ack - round_start).as_micros() as u64);
        }
        writes += depth as u64;
    }
    let elapsed = started.elapsed();
    let flushes = device.stats().flushes;
    drop(device);
    if file_kind == FileKind::Fresh {
        std::fs::remove_file(root.join(&fresh_name))?;
    }
    Ok(Cell { mode, file_kind, depth, writes, elapsed, latencies_us, flushes })
}

fn percentile(sorted: &[u64], fraction: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let index = ((sorted.len() as f64 * fraction).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[index]
}

fn print_cell(cell: &Cell) {
    let mut sorted = cell.latencies_us.clone();
    sorted.sort_unstable();
    println!(
        "{:<15} {:<9} qd {:>2}: {:>8.0} IOPS  p50 {:>7} us  p99 {:>7} us  \
         ({} writes, {} flush calls)",
        mode_name(cell.mode),
        kind_name(cell.file_kind),
        cell.depth,
        cell.writes as f64 / cell.elapsed.as_secs_f64(),
        percentile(&sorted, 0.50),
        percentile(&sorted, 0.99),
        cell.writes,
        cell.flushes,
    );
}
