//! Shards handed to a host (`Db::hand_off_shards`, shard/event_loop.rs): the host runs each
//! shard's turns on a thread of its own choosing, and the store behaves as before. The drivers
//! here are plain threads, so that a lost wakeup shows as a timeout rather than being hidden by
//! a busy runtime: a wait that only a message can end parks the thread with no timer at all.

mod common;

use std::sync::Arc;
use std::task::{Wake, Waker};
use std::thread::Thread;
use std::time::{Duration, Instant};

use copse::{Backend, Db, EngineKind, Options, ShardLoop, ShardTurn};

/// How long a message-only wait may last before the test calls the wakeup lost (no shard is
/// left alone for more than a few milliseconds; a prompt wake takes microseconds).
const LOST_WAKEUP_SECONDS: u64 = 10;
/// How long a driver polls the completion fd per try while waiting on I/O.
const COMPLETION_POLL_MS: i32 = 5;

struct Unpark(Thread);

impl Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
}

fn hostable_options(backend: Backend) -> Options {
    Options { backend, engine: EngineKind::Native, ..common::options(2) }
}

/// Whether `fd` polls readable within `timeout_ms`.
fn poll_readable(fd: std::os::fd::RawFd, timeout_ms: i32) -> bool {
    let mut entry = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    // SAFETY: one initialized pollfd that outlives the call; the kernel writes its revents.
    unsafe { libc::poll(&mut entry, 1, timeout_ms) > 0 }
}

/// Runs `shard` on the calling thread until it stops; returns how many waits it made.
fn drive(mut shard: ShardLoop) -> u64 {
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut waits = 0;
    loop {
        let wait = match shard.turn() {
            ShardTurn::Again => continue,
            ShardTurn::Stopped => return waits,
            ShardTurn::Wait(wait) => wait,
        };
        waits += 1;
        shard.begin_wait();
        let started = Instant::now();
        loop {
            if shard.poll_messages(&waker).is_ready() {
                break;
            }
            if wait.deadline.is_some_and(|deadline| Instant::now() >= deadline) {
                break;
            }
            if wait.completions {
                use std::os::fd::AsRawFd;
                let fd = shard.completion_fd().expect("a wait for completions has a completion fd");
                if poll_readable(fd.as_raw_fd(), COMPLETION_POLL_MS) {
                    break;
                }
            } else if let Some(deadline) = wait.deadline {
                std::thread::park_timeout(deadline.saturating_duration_since(Instant::now()));
            } else {
                // Only a message can end this wait: no timer hides a lost wakeup.
                std::thread::park_timeout(Duration::from_secs(LOST_WAKEUP_SECONDS));
                // The test never leaves a shard alone this long: a wait that lasted it was
                // not woken by the message that ended it.
                assert!(
                    started.elapsed() < Duration::from_secs(LOST_WAKEUP_SECONDS),
                    "shard {}: a message-only wait was not woken",
                    shard.shard_id()
                );
            }
        }
        shard.end_wait();
    }
}

#[test]
fn hosted_shards_serve_reads_and_writes_and_stop_at_close() {
    let dir = tempfile::tempdir().unwrap();
    let db = Db::open(dir.path(), hostable_options(Backend::Uring)).unwrap();
    db.put(b"before", b"the hand-off").unwrap();
    let shards = db.hand_off_shards();
    assert_eq!(shards.len(), 2, "both native shards on io_uring can share a thread");
    let drivers: Vec<_> =
        shards.into_iter().map(|shard| std::thread::spawn(|| drive(shard))).collect();
    // Writers on other threads, with pauses so that the shards go to sleep between them.
    for round in 0..20u32 {
        for i in 0..50u32 {
            let key = format!("key{}", round * 50 + i);
            db.put(key.as_bytes(), &common::make_value(&key, 100 + (i as usize * 97) % 3000))
                .unwrap();
        }
        if round % 5 == 0 {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    assert_eq!(db.get(b"before").unwrap().as_deref(), Some(&b"the hand-off"[..]));
    db.delete(b"key3").unwrap();
    db.flush().unwrap();
    // Close answers only once the hosted loops have stopped, and the drivers end with them.
    db.close().unwrap();
    let waits: u64 = drivers.into_iter().map(|driver| driver.join().unwrap()).sum();
    assert!(waits > 0, "the hosted shards never slept");
    let reopened = Db::open(dir.path(), hostable_options(Backend::Uring)).unwrap();
    for n in 0..1000u32 {
        let key = format!("key{n}");
        let expected =
            (n != 3).then(|| common::make_value(&key, 100 + ((n % 50) as usize * 97) % 3000));
        assert_eq!(reopened.get(key.as_bytes()).unwrap(), expected, "{key}");
    }
    reopened.close().unwrap();
}

#[test]
fn a_store_whose_engine_blocks_keeps_its_shard_threads() {
    let dir = tempfile::tempdir().unwrap();
    let db = Db::open(dir.path(), hostable_options(Backend::Sync)).unwrap();
    assert!(db.hand_off_shards().is_empty(), "pread/pwrite shards block: none is handed off");
    db.put(b"k", b"v").unwrap();
    assert_eq!(db.get(b"k").unwrap().as_deref(), Some(&b"v"[..]));
    db.close().unwrap();
}

#[test]
fn a_shard_dropped_by_its_host_does_not_hang_the_close() {
    let dir = tempfile::tempdir().unwrap();
    let db = Db::open(dir.path(), hostable_options(Backend::Uring)).unwrap();
    db.put(b"k", b"v").unwrap();
    let shards = db.hand_off_shards();
    assert!(!shards.is_empty());
    drop(shards);
    // The dropped shards are gone: their requests fail as closed, and close returns.
    let shard_gone =
        (0..64u32).map(|n| format!("probe{n}")).any(|key| db.get(key.as_bytes()).is_err());
    assert!(shard_gone, "a request to a dropped shard must fail, not hang");
    let _ = db.close();
}
