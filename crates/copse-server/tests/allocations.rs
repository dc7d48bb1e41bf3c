//! Allocations per request on the server's hot path (issue 22, item 2): the server started
//! in-process under a counting allocator, a client that allocates nothing while it is measured,
//! and waves of pipelined GETs and SETs of 1 KiB values. The count is process-wide, so this file
//! holds one test and the client reuses its buffers.
//!
//! To see where the allocations come from: set `ALLOCATIONS_PROFILE=get` (or `set`) and the test
//! only sends that command's waves after the warm-up, for a profiler to attribute, e.g.
//! `perf probe -x /lib/x86_64-linux-gnu/libc.so.6 --add malloc` then
//! `perf record -e probe_libc:malloc --call-graph dwarf,8192 TEST_BINARY`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicU64, Ordering};

use copse_server::resp::encode_request;
use copse_server::ServerConfig;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

/// Counts every allocation (and reallocation, which may move) and forwards to the system's.
struct CountingCalls;

// SAFETY: forwards to the system allocator unchanged; only counts calls.
unsafe impl GlobalAlloc for CountingCalls {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same layout as the caller's request.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: as the caller's contract.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: CountingCalls = CountingCalls;

/// What a cached GET of a 1 KiB value allocates, in waves of 16 (8.9 measured on 2026-11-27,
/// from 23.6 before issue 22's item 2): the request's two arguments, the program, its answer's
/// channel, its read (the item's key, the engine's answer channel, the results list), the
/// value read, and per wave the message to each shard and the lists the shard and the engine
/// keep for a round. (The key's lock travels as its hash, `copse::exec::lock_ids`, and a step's
/// one read in place, `copse::exec::ReadOps`: no copy of the key, no lists.)
const GET_ALLOCATIONS_MAX: f64 = 10.0;
/// What a SET of a 1 KiB value allocates, collector included (17.8 measured on a quiet machine;
/// 2-3 more on a loaded one: when the collector's rounds fall depends on the threads'
/// scheduling; from 173 before, most of that the collector churning a store of a few blocks,
/// `GC_ROOM_BLOCKS_MIN`).
const SET_ALLOCATIONS_MAX: f64 = 24.0;

const KEYS: usize = 512;
const VALUE_BYTES: usize = 1024;
const PIPELINE: usize = 16;
const WAVES: usize = 400;

fn key(i: usize) -> String {
    format!("key:{i:020}")
}

/// Reads until `expected` bytes of replies arrived, into `buffer` (sized beforehand).
fn read_replies(stream: &mut TcpStream, buffer: &mut [u8], expected: usize) {
    let mut have = 0;
    while have < expected {
        let read = stream.read(&mut buffer[have..expected]).unwrap();
        assert!(read > 0, "the server closed the connection");
        have += read;
    }
}

/// Sends `waves` of the prepared pipelines (one per wave, cycling) and returns the allocations
/// made meanwhile per command. Each wave's replies are `reply_bytes` long.
fn allocations_per_command(
    stream: &mut TcpStream,
    pipelines: &[Vec<u8>],
    reply_bytes: usize,
    buffer: &mut [u8],
    waves: usize,
) -> f64 {
    let before = ALLOCATIONS.load(Ordering::Relaxed);
    for wave in 0..waves {
        stream.write_all(&pipelines[wave % pipelines.len()]).unwrap();
        read_replies(stream, buffer, reply_bytes);
    }
    let after = ALLOCATIONS.load(Ordering::Relaxed);
    (after - before) as f64 / (waves * PIPELINE) as f64
}

#[test]
fn a_cached_get_and_a_set_allocate_at_most_a_few_times() {
    let dir = tempfile::tempdir().unwrap();
    let config = ServerConfig {
        path: dir.path().to_path_buf(),
        port: 0,
        shards: 2,
        threads: 2,
        cache_mb: 16,
        ..ServerConfig::default()
    };
    let running = copse_server::start(config).unwrap();
    let mut stream = TcpStream::connect(running.local_addr).unwrap();
    stream.set_nodelay(true).unwrap();
    let value = vec![b'v'; VALUE_BYTES];

    // Waves of SETs over the keys, then of GETs, each prepared before anything is counted.
    let mut sets = Vec::new();
    let mut gets = Vec::new();
    for first in (0..KEYS).step_by(PIPELINE) {
        let (mut set_wave, mut get_wave) = (Vec::new(), Vec::new());
        for i in first..first + PIPELINE {
            encode_request::<&[u8]>(&[b"SET", key(i).as_bytes(), &value], &mut set_wave);
            encode_request::<&[u8]>(&[b"GET", key(i).as_bytes()], &mut get_wave);
        }
        sets.push(set_wave);
        gets.push(get_wave);
    }
    let set_reply_bytes = PIPELINE * b"+OK\r\n".len();
    let get_reply_bytes =
        PIPELINE * format!("${VALUE_BYTES}\r\n").len() + PIPELINE * (VALUE_BYTES + 2);
    let mut buffer = vec![0u8; get_reply_bytes.max(set_reply_bytes)];

    // Warm up: every key written and read once, so pools, caches and buffers are grown.
    for wave in 0..sets.len() * 2 {
        stream.write_all(&sets[wave % sets.len()]).unwrap();
        read_replies(&mut stream, &mut buffer, set_reply_bytes);
        stream.write_all(&gets[wave % gets.len()]).unwrap();
        read_replies(&mut stream, &mut buffer, get_reply_bytes);
    }
    assert!(buffer.starts_with(format!("${VALUE_BYTES}\r\n").as_bytes()), "a GET missed");

    if let Ok(command) = std::env::var("ALLOCATIONS_PROFILE") {
        let (pipelines, reply_bytes) = match command.as_str() {
            "get" => (&gets, get_reply_bytes),
            "set" => (&sets, set_reply_bytes),
            other => panic!("ALLOCATIONS_PROFILE={other}: get or set"),
        };
        // Long enough for the warm-up's allocations to be a small part of a profile.
        let waves = WAVES * 20;
        let per_command =
            allocations_per_command(&mut stream, pipelines, reply_bytes, &mut buffer, waves);
        eprintln!("allocations per {command}: {per_command:.2}");
        running.stop().unwrap();
        return;
    }
    let per_get = allocations_per_command(&mut stream, &gets, get_reply_bytes, &mut buffer, WAVES);
    let per_set = allocations_per_command(&mut stream, &sets, set_reply_bytes, &mut buffer, WAVES);
    eprintln!("allocations per GET: {per_get:.2}, per SET: {per_set:.2}");
    running.stop().unwrap();
    assert!(per_get <= GET_ALLOCATIONS_MAX, "{per_get:.2} allocations per cached GET");
    assert!(per_set <= SET_ALLOCATIONS_MAX, "{per_set:.2} allocations per SET");
}
