//! Write batches larger than one record (issue 23, item 7): within one shard, a batch of any
//! size the limits allow is one atomic write. The native engine records such a batch as a chain
//! of Chunk records and writes its members in waves (`engine/native/chain.rs`, `batch.rs`);
//! these tests run over real files with the engine under test (`COPSE_TEST_ENGINE`). Crashes
//! in the middle of chains are the simulated-device tests' job (`crash.rs`, `batches.rs` set
//! small records in some seeds).

mod common;
use common::make_value;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use copse::interfaces::check::{check_store, CheckOptions};
use copse::limits::{BATCH_MEMBERS_IN_FLIGHT_MAX, BATCH_RECORD_BYTES_MAX, WRITE_BATCH_OPS_MAX};
use copse::{Db, Options, WriteBatch, WriteError};

/// Keys of the large batches: four waves of members.
const KEYS: usize = BATCH_MEMBERS_IN_FLIGHT_MAX * 4;
/// Values of 600 bytes: the batch's encoding (~25 MiB) takes two records of the default size.
const VALUE_BYTES: usize = 600;
const _: () = assert!(KEYS * VALUE_BYTES > BATCH_RECORD_BYTES_MAX, "the batches must chain");

fn key(i: usize) -> Vec<u8> {
    format!("large-batch-{i:06}").into_bytes()
}

fn value(round: usize, i: usize) -> Vec<u8> {
    make_value(&format!("r{round}-{i}"), VALUE_BYTES)
}

fn batch(round: usize) -> WriteBatch {
    let mut batch = WriteBatch::new();
    for i in 0..KEYS {
        batch.put(key(i), value(round, i));
    }
    batch
}

/// One shard, so the whole batch is one shard's write, not a cross-shard batch.
fn options() -> Options {
    common::options(1)
}

/// The round whose batch wrote `value` (0: no value).
fn round_in(value: Option<Vec<u8>>) -> usize {
    value.map_or(0, |value| {
        let tag_end = value.iter().position(|&b| b == b'|').expect("a tagged value");
        let tag = std::str::from_utf8(&value[1..tag_end]).expect("ascii");
        tag.split('-').next().unwrap().parse().expect("a round")
    })
}

/// Reads the probe keys one after another, each read starting once the one before is answered,
/// and returns the rounds found, in `probes` order. Each get returns the value live at some
/// moment between its start and its answer, and batches are written in increasing rounds; so
/// if every batch becomes visible at one moment, the rounds never decrease along the reads. A
/// batch applied key by key would show a later key older than an earlier one whenever the reads
/// pass the keys in the other order than the batch applies them: the reader tries both orders.
/// (The reads are not one snapshot: a batch applied between two of them shows, and that is
/// allowed.)
fn rounds_in_order(db: &Db, probes: &[usize]) -> Result<Vec<usize>, String> {
    let mut rounds = Vec::with_capacity(probes.len());
    for &i in probes {
        rounds.push(round_in(db.get(&key(i)).map_err(|err| err.to_string())?));
    }
    if rounds.windows(2).all(|pair| pair[0] <= pair[1]) {
        Ok(rounds)
    } else {
        Err(format!("half a batch: rounds {rounds:?} read in turn at keys {probes:?}"))
    }
}

/// The round all the probe keys hold in one `multi_get`, which reads them at one moment.
fn round_at_one_moment(db: &Db, probes: &[usize]) -> Result<usize, String> {
    let keys: Vec<Vec<u8>> = probes.iter().map(|&i| key(i)).collect();
    let values = db.multi_get(&keys).map_err(|err| err.to_string())?;
    let rounds: Vec<usize> = values.into_iter().map(round_in).collect();
    if rounds.windows(2).all(|pair| pair[0] == pair[1]) {
        Ok(rounds[0])
    } else {
        Err(format!("half a batch: rounds {rounds:?} in one multi_get of keys {probes:?}"))
    }
}

#[test]
fn a_batch_larger_than_one_record_is_one_atomic_write_and_survives_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let db = Db::open(dir.path(), options()).unwrap();
    // A reader probes keys from the first wave, the middle and the last wave, in turn
    // (forwards and backwards) and in one multi_get, while batches of every key are written:
    // it must never see a batch in part.
    let probes = [0, 1, KEYS / 2, KEYS - 2, KEYS - 1];
    let backwards: Vec<usize> = probes.iter().rev().copied().collect();
    let stop = Arc::new(AtomicBool::new(false));
    let reads = Arc::new(AtomicU64::new(0));
    let reader = {
        let (db, stop, reads) = (db.clone(), stop.clone(), reads.clone());
        std::thread::spawn(move || -> Result<(), String> {
            while !stop.load(Ordering::Relaxed) {
                rounds_in_order(&db, &probes)?;
                rounds_in_order(&db, &backwards)?;
                round_at_one_moment(&db, &probes)?;
                reads.fetch_add(1, Ordering::Relaxed);
            }
            Ok(())
        })
    };
    for round in 1..=3 {
        db.write_batch(batch(round)).unwrap();
        assert_eq!(round_at_one_moment(&db, &probes).unwrap(), round);
    }
    stop.store(true, Ordering::Relaxed);
    reader.join().unwrap().unwrap();
    assert!(reads.load(Ordering::Relaxed) > 0);
    for i in (0..KEYS).step_by(97) {
        assert_eq!(db.get(&key(i)).unwrap(), Some(value(3, i)), "key {i}");
    }
    db.close().unwrap();

    // After a clean close no record of any batch is left (chains included), and a reopen finds
    // every item of the last one.
    let report = check_store(dir.path(), &CheckOptions::default()).unwrap();
    assert!(report.is_clean(), "{report:?}");
    assert_eq!(report.slots.batch_records + report.slots.chunk_records, 0, "{report:?}");
    let db = Db::open(dir.path(), options()).unwrap();
    assert_eq!(db.stats().unwrap().items, KEYS as u64);
    for i in (0..KEYS).step_by(89) {
        assert_eq!(db.get(&key(i)).unwrap(), Some(value(3, i)), "key {i} after reopen");
    }
    // Deleting them all is one batch too.
    let mut delete_all = WriteBatch::new();
    for i in 0..KEYS {
        delete_all.delete(key(i));
    }
    db.write_batch(delete_all).unwrap();
    assert_eq!(db.stats().unwrap().items, 0);
    assert_eq!(round_at_one_moment(&db, &probes).unwrap(), 0);
}

/// A `multi_get` of one shard's keys reads them at one moment, also when some keys are
/// answered from the cache at once and others need a read of the device: readers never see a
/// batch in part, over batch after batch. Half the keys hold 100-byte values (their pages stay
/// cached), half 20 KiB values (multi-page records, read from the device every time), so each
/// multi-get has answered keys of both kinds while batches are applied.
#[test]
fn a_multi_get_of_one_shard_reads_its_keys_at_one_moment() {
    const KEYS_HERE: usize = 64;
    const ROUNDS: usize = 300;
    const READERS: usize = 2;
    let value_bytes = |i: usize| if i.is_multiple_of(2) { 100 } else { 20 << 10 };
    let dir = tempfile::tempdir().unwrap();
    let db = Db::open(dir.path(), options()).unwrap();
    let probes: Vec<usize> = (0..KEYS_HERE).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let reads = Arc::new(AtomicU64::new(0));
    let readers: Vec<_> = (0..READERS)
        .map(|_| {
            let (db, stop, reads, probes) =
                (db.clone(), stop.clone(), reads.clone(), probes.clone());
            std::thread::spawn(move || -> Result<(), String> {
                while !stop.load(Ordering::Relaxed) {
                    round_at_one_moment(&db, &probes)?;
                    reads.fetch_add(1, Ordering::Relaxed);
                }
                Ok(())
            })
        })
        .collect();
    for round in 1..=ROUNDS {
        let mut batch = WriteBatch::new();
        for i in 0..KEYS_HERE {
            batch.put(key(i), make_value(&format!("r{round}-{i}"), value_bytes(i)));
        }
        db.write_batch(batch).unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    for reader in readers {
        reader.join().unwrap().unwrap();
    }
    assert!(reads.load(Ordering::Relaxed) > 0);
    assert_eq!(round_at_one_moment(&db, &probes).unwrap(), ROUNDS);
}

/// With records of 256 bytes, even small batches are chains of many records: a mix of batch
/// sizes, overwrites and deletes reads back exactly, before and after a reopen.
#[test]
fn batches_recorded_in_chains_of_small_records_read_back_exactly() {
    if common::engine() != copse::EngineKind::Native {
        return; // The record size is the native engine's.
    }
    let dir = tempfile::tempdir().unwrap();
    let options = Options { batch_record_bytes_max: 256, ..common::options(2) };
    let db = Db::open(dir.path(), options.clone()).unwrap();
    let mut model = std::collections::BTreeMap::new();
    for round in 0..40usize {
        let mut batch = WriteBatch::new();
        let size = [1, 2, 7, 50, 300][round % 5];
        for j in 0..size {
            let i = (round * 31 + j * 7) % 400;
            if (round + j) % 6 == 5 {
                batch.delete(key(i));
                model.insert(i, None);
            } else {
                let value = make_value(&format!("c{round}-{i}"), 10 + (round * j) % 900);
                batch.put(key(i), value.clone());
                model.insert(i, Some(value));
            }
        }
        db.write_batch(batch).unwrap();
    }
    let check = |db: &Db, when: &str| {
        for (&i, expected) in &model {
            assert_eq!(&db.get(&key(i)).unwrap(), expected, "key {i} {when}");
        }
    };
    check(&db, "before the close");
    db.close().unwrap();
    let report = check_store(dir.path(), &CheckOptions::default()).unwrap();
    assert!(report.is_clean(), "{report:?}");
    assert_eq!(report.slots.chunk_records, 0, "a chain was left behind: {report:?}");
    let db = Db::open(dir.path(), options).unwrap();
    check(&db, "after a reopen");
    let recovered = db.stats().unwrap();
    assert!(recovered.shards.iter().all(|shard| shard.recovery.broken_chain_records == 0));
}

#[test]
fn a_batch_over_the_limits_is_refused_whole_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let db = Db::open(dir.path(), options()).unwrap();
    db.put(b"kept", b"before").unwrap();
    let mut batch = WriteBatch::new();
    batch.put(b"kept".to_vec(), b"after".to_vec());
    for i in 0..WRITE_BATCH_OPS_MAX {
        batch.delete(format!("{i:x}").into_bytes());
    }
    assert!(matches!(db.write_batch(batch), Err(WriteError::Input(_))));
    assert_eq!(db.get(b"kept").unwrap(), Some(b"before".to_vec()));
}

/// A batch of 20,500 puts in chain records of 4 KiB (so its chain is long and its members go in
/// three waves) over 20,500 keys written before, on the simulated device, crashed at device
/// operations spread over the whole write (its chain, each wave, the erasure): after recovery
/// every key holds the old value or every key the new one, and an acknowledged batch is whole.
/// (Adapted from a review of the chains, which found no fault here.)
#[test]
fn simulated_crashes_during_a_batch_of_several_waves_leave_it_whole_or_absent() {
    use copse::device::sim::SimDisk;
    use copse::WriteDurability;
    const PUTS: usize = BATCH_MEMBERS_IN_FLIGHT_MAX * 2 + 500;
    const CRASH_POINTS: u64 = 24;
    let open = |disk: &SimDisk| {
        let options = Options {
            shards: 1,
            batch_record_bytes_max: 4096,
            cache_bytes: 1 << 20,
            show_progress: false,
            pin_threads: false,
            ..Options::default()
        };
        Db::open_with_storage(Arc::new(disk.storage(WriteDurability::FlushPerRound)), options)
    };
    let wave_key = |i: usize| format!("wave-{i:06}").into_bytes();
    let batch = |tag: &str| {
        let mut batch = WriteBatch::new();
        for i in 0..PUTS {
            batch.put(wave_key(i), format!("{tag}-{i}").into_bytes());
        }
        batch
    };
    // Which tags the keys hold, with how many keys each.
    let tags = |db: &Db| {
        let mut tags = std::collections::BTreeMap::new();
        let keys: Vec<Vec<u8>> = (0..PUTS).map(wave_key).collect();
        for chunk in keys.chunks(5_000) {
            for value in db.multi_get(chunk).unwrap() {
                let tag = value
                    .map(|v| String::from_utf8(v).unwrap().split('-').next().unwrap().to_string());
                *tags.entry(tag).or_insert(0usize) += 1;
            }
        }
        tags
    };
    let base = SimDisk::new(7);
    let db = open(&base).unwrap();
    db.write_batch(batch("old")).unwrap();
    db.close().unwrap();
    // How many device operations the new batch takes, on a copy of the store.
    let probe = base.restart();
    let db = open(&probe).unwrap();
    let before = probe.ops();
    db.write_batch(batch("new")).unwrap();
    let total = probe.ops() - before;
    db.close().unwrap();
    let (mut replayed, mut broken, mut acked_count) = (0, 0, 0);
    for point in 0..CRASH_POINTS {
        let crash_after = total * point / (CRASH_POINTS - 1);
        let disk = base.restart();
        let db = open(&disk).unwrap();
        disk.crash_after_ops(crash_after);
        let acked = db.write_batch(batch("new")).is_ok();
        let _ = db.close();
        drop(db);
        let rebooted = disk.restart();
        let db = open(&rebooted).unwrap();
        let found = tags(&db);
        let whole_new = found.len() == 1 && found.get(&Some("new".to_string())) == Some(&PUTS);
        let whole_old = found.len() == 1 && found.get(&Some("old".to_string())) == Some(&PUTS);
        assert!(
            whole_new || (whole_old && !acked),
            "crash after {crash_after} of {total} ops (acknowledged: {acked}): keys hold {found:?}"
        );
        let recovery = db.stats().unwrap().shards[0].recovery.clone();
        replayed += recovery.batches_replayed;
        broken += recovery.broken_chain_records;
        acked_count += u64::from(acked);
        db.close().unwrap();
    }
    // The crash points must have struck the chain half written, the waves and the end.
    assert!(replayed > 0 && broken > 0 && acked_count > 0, "{replayed} {broken} {acked_count}");
}

/// The store of `large_batch_memory_child`, which runs only when the parent test starts it.
const MEMORY_CHILD_DIR_ENV: &str = "COPSE_LARGE_BATCH_CHILD_DIR";
/// The values of the batch the child writes: 256 MiB, in records of 4,000 bytes (16 chain
/// records of 16 MiB, 67,108 members in 7 waves).
const MEMORY_BATCH_BYTES: usize = 256 << 20;
/// What a batch may hold beyond its operations while it is written: its encoding (1x), plus
/// `MEMORY_SLACK_BYTES` for the page images of two chain records (`CHAIN_RECORDS_IN_FLIGHT_MAX`,
/// 32 MiB) and of one wave of members (16 MiB), the 4 MiB cache and the allocator.
const MEMORY_BATCH_FACTOR_MAX: f64 = 1.0;
const MEMORY_SLACK_BYTES: u64 = 128 << 20;

/// A memory figure of this process from /proc/self/status (`VmHWM:` the peak resident size,
/// `VmRSS:` the current one), in bytes.
fn status_bytes(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|line| line.starts_with(field)).unwrap();
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
}

#[test]
#[ignore = "the child process of the_memory_a_large_batch_takes_is_bounded; runs only when that test starts it"]
fn large_batch_memory_child() {
    let Ok(dir) = std::env::var(MEMORY_CHILD_DIR_ENV) else { return };
    let db = Db::open(std::path::Path::new(&dir), options()).unwrap();
    const VALUE_BYTES_HERE: usize = 4000;
    let mut batch = WriteBatch::new();
    for i in 0..MEMORY_BATCH_BYTES / VALUE_BYTES_HERE {
        batch.put(key(i), make_value(&format!("m-{i}"), VALUE_BYTES_HERE));
    }
    let before = status_bytes("VmRSS:");
    let started = std::time::Instant::now();
    db.write_batch(batch).unwrap();
    let write_ms = started.elapsed().as_millis();
    let peak = status_bytes("VmHWM:");
    println!("MEMORY before={before} peak={peak} write_ms={write_ms}");
}

/// The memory a batch takes beyond its operations, measured as the peak resident size of a child
/// process that writes one batch of `MEMORY_BATCH_BYTES`. The chain's records are placed
/// `CHAIN_RECORDS_IN_FLIGHT_MAX` at a time and the members in waves of
/// `BATCH_MEMBERS_IN_FLIGHT_MAX` / `BATCH_MEMBER_BYTES_IN_FLIGHT_MAX`: placed all at once, each
/// would add another 1x (2.15x measured with the chain placed at once, 3.21x with the members
/// too).
#[test]
fn the_memory_a_large_batch_takes_is_bounded() {
    if common::engine() != copse::EngineKind::Native {
        // The waves are the native engine's; RocksDB holds its own write batch and memtable
        // (2.06x measured here).
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let output = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "large_batch_memory_child",
            "--nocapture",
            "--ignored",
            "--test-threads=1",
        ])
        .env(MEMORY_CHILD_DIR_ENV, dir.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}{}", String::from_utf8_lossy(&output.stderr));
    // The test harness may print the test's name on the same line first.
    let line = stdout.split("MEMORY ").nth(1).and_then(|rest| rest.lines().next());
    let line = line.expect("the child's figures");
    let figure = |name: &str| -> u64 {
        let part = line.split_whitespace().find(|part| part.starts_with(name)).unwrap();
        part[name.len() + 1..].parse().unwrap()
    };
    let extra = figure("peak") - figure("before");
    let bound = (MEMORY_BATCH_FACTOR_MAX * MEMORY_BATCH_BYTES as f64) as u64 + MEMORY_SLACK_BYTES;
    println!(
        "a batch of {MEMORY_BATCH_BYTES} bytes took {extra} bytes more at its peak ({:.2}x; \
         bound {bound}), written in {} ms",
        extra as f64 / MEMORY_BATCH_BYTES as f64,
        figure("write_ms")
    );
    assert!(extra <= bound, "a batch of {MEMORY_BATCH_BYTES} bytes took {extra} bytes more");
}
