//! Reads the gate intercepts (`shard/gate.rs`): a multi-get or scan of keys a committed
//! cross-shard part holds, handed to the engine while the part is locked and answered after it
//! was applied and unlocked, still sees the batch. The engine read the keys at its own moment,
//! before the part was applied; the gate overlays the holds it recorded then, not the lock
//! table at answer time (which no longer names the part). Found by a review of 199e754: before
//! the fix, 57 of the 300 runs of each test answered the value from before the batch after
//! another read had returned the batch's value. Drives a gate over the native engine on the
//! simulated device (whose held completions spread the reads over rounds), in the order
//! `shard/exec.rs` runs it: poll the intercepted reads, then unlock a part whose commit answered.
use std::sync::Arc;

use copse::device::sim::SimDisk;
use copse::device::WriteDurability;
use copse::engine::native::format::{SizeClass, CLASS_COUNT};
use copse::engine::native::placement::Placement;
use copse::engine::native::{EngineConfig, NativeEngine};
use copse::engine::{BatchOp, Request, ShardEngine};
use copse::limits::PAGE_BYTES;
use copse::shard::coordinator::{Coordinator, Decision};
use copse::shard::gate::Gate;
use copse::{ReadError, WriteError};
use futures::channel::oneshot;

type MultiGetAnswer = Result<Vec<Option<Vec<u8>>>, ReadError>;
type ScanAnswer = Result<Vec<copse::engine::KeyValue>, ReadError>;

/// A coordinator whose batch is committed.
struct Committed;
impl Coordinator for Committed {
    fn gsn(&self) -> u64 {
        7
    }
    fn participants(&self) -> &[u32] {
        &[0, 1]
    }
    fn decision(&self) -> Decision {
        Decision::Committed
    }
    fn prepared(&self, _: u32, _: Result<(), WriteError>) {}
    fn refuse(&self, _: WriteError) {}
    fn applied(&self, _: u32, _: Result<(), WriteError>) {}
    fn all_applied(&self) -> bool {
        false
    }
}

fn config() -> EngineConfig {
    EngineConfig {
        shard_id: 0,
        cache_pages: 64,
        io_depth_max: 64,
        slab_growth_bytes_min: 16 * PAGE_BYTES as u64,
        placements: (0..CLASS_COUNT)
            .map(|class| {
                let _ = SizeClass::get(class as u8);
                Placement::InPlace
            })
            .collect(),
        append_block_pages: 1,
        space_amplification_max: 1.5,
        gc_room_blocks_min: 0,
        batch_record_bytes_max: copse::limits::BATCH_RECORD_BYTES_MAX,
        poisoned: Default::default(),
    }
}

fn wait<T>(gate: &mut Gate, rx: &mut oneshot::Receiver<T>) -> T {
    for _ in 0..10_000 {
        if let Ok(Some(v)) = rx.try_recv() {
            return v;
        }
        gate.end_round();
        gate.reap(false);
        gate.poll();
    }
    panic!("no answer");
}

/// Puts `a` (small, cached) and `b` (20 KiB, a multi-page record read from the device every
/// time), locks `a` under a committed part, reads it once through the gate (the batch's value),
/// commits the part with completions held, and `multi_get_after_rounds` rounds in starts a
/// multi-get of both keys (or a scan): returns what went wrong if it reads `a` from before the
/// batch.
fn run(seed: u64, multi_get_after_rounds: usize, scan: bool) -> Option<String> {
    let disk = SimDisk::new(seed);
    let engine =
        NativeEngine::open(Box::new(disk.device(WriteDurability::FlushPerRound)), config(), None)
            .unwrap();
    let mut gate = Gate::new(Box::new(engine));
    // a: small (cached), b: 20 KiB (a multi-page record, always read from the device).
    for (key, value) in [(b"a".to_vec(), b"old".to_vec()), (b"b".to_vec(), vec![b'B'; 20 << 10])] {
        let (reply, mut rx) = oneshot::channel();
        gate.handle(Request::Put { key, value, reply });
        wait(&mut gate, &mut rx).unwrap();
    }
    let ops = vec![BatchOp::Put { key: b"a".to_vec(), value: b"new".to_vec() }];
    let coordinator: Arc<dyn Coordinator> = Arc::new(Committed);
    gate.lock(coordinator, &ops);
    let (reply, mut rx) = oneshot::channel();
    gate.handle(Request::PreparePart { gsn: 7, participants: vec![0, 1], ops: ops.clone(), reply });
    wait(&mut gate, &mut rx).unwrap();
    // The batch is committed: reader X reads a and sees the batch.
    let (reply, mut x) = oneshot::channel();
    gate.handle(Request::Get { key: b"a".to_vec(), reply });
    let seen = wait(&mut gate, &mut x).unwrap();
    assert_eq!(seen.as_deref(), Some(&b"new"[..]));
    // The shard applies the part (exec.rs: CommitPart, then unlock once it answers).
    disk.hold_completions(0.5, 4);
    let (reply, mut commit) = oneshot::channel();
    gate.handle(Request::CommitPart { gsn: 7, reply });
    let mut y: Option<oneshot::Receiver<MultiGetAnswer>> = None;
    let mut ys: Option<oneshot::Receiver<ScanAnswer>> = None;
    let mut unlocked = false;
    for round in 0..10_000 {
        if round == multi_get_after_rounds && y.is_none() && ys.is_none() {
            if unlocked {
                return None; // too late to be intercepted
            }
            // Reader Y starts after X returned: it must see the batch.
            if scan {
                let (reply, rx) = oneshot::channel();
                gate.handle(Request::Scan {
                    start: std::ops::Bound::Unbounded,
                    end: std::ops::Bound::Unbounded,
                    limit: 10,
                    reply,
                });
                ys = Some(rx);
            } else {
                let (reply, rx) = oneshot::channel();
                gate.handle(Request::MultiGet { keys: vec![b"a".to_vec(), b"b".to_vec()], reply });
                y = Some(rx);
            }
        }
        gate.end_round();
        gate.reap(false);
        // exec.rs `pump`: poll first, then unlock a part whose commit answered.
        gate.poll();
        if !unlocked {
            if let Ok(Some(result)) = commit.try_recv() {
                result.unwrap();
                gate.unlock(7, &ops);
                unlocked = true;
            }
        }
        if let Some(rx) = ys.as_mut() {
            if let Ok(Some(result)) = rx.try_recv() {
                let items = result.unwrap();
                let a = items.iter().find(|(k, _)| k == b"a").map(|(_, v)| v.clone());
                if a.as_deref() != Some(&b"new"[..]) {
                    return Some(format!(
                        "seed {seed}, scan after {multi_get_after_rounds}: a = {:?}",
                        a.as_deref().map(String::from_utf8_lossy)
                    ));
                }
                return None;
            }
        }
        if let Some(rx) = y.as_mut() {
            if let Ok(Some(result)) = rx.try_recv() {
                let values = result.unwrap();
                if values[0].as_deref() != Some(&b"new"[..]) {
                    return Some(format!(
                        "seed {seed}, multi-get after {multi_get_after_rounds} rounds: X read a = \
                         new, then Y's multi-get read a = {:?}",
                        values[0].as_deref().map(String::from_utf8_lossy)
                    ));
                }
                return None;
            }
        }
    }
    panic!("no answer");
}

/// Runs 50 seeds with the read started 0 to 5 rounds into the commit; panics with every stale
/// answer.
fn check_every_start(scan: bool) {
    let failures: Vec<String> =
        (0..50).flat_map(|seed| (0..6).filter_map(move |after| run(seed, after, scan))).collect();
    let what = if scan { "scans" } else { "multi-gets" };
    assert!(failures.is_empty(), "{} stale {what}:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn an_intercepted_multi_get_answered_after_the_unlock_sees_the_batch() {
    check_every_start(false);
}

#[test]
fn an_intercepted_scan_answered_after_the_unlock_sees_the_batch() {
    check_every_start(true);
}
