//! Cross-shard atomic batches (router/txn.rs, docs/atomic-batches.md): a batch over several
//! shards is applied whole or not at all, also across a crash, and no reader sees half of it.
//!
//! The engine-generic tests run over real files with the engine under test
//! (`COPSE_TEST_ENGINE`); the crash test runs the native engine on the simulated device
//! (`simulated` in its name keeps it out of the RocksDB run).

mod common;
use common::env_u64;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use copse::device::sim::SimDisk;
use copse::router::shard_of;
use copse::{Db, Options, WriteBatch, WriteDurability, WriteError};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const SHARDS: usize = 3;
/// Keys per group: at least one in every shard, plus a few more.
const GROUP_KEYS: usize = 6;
/// How long the concurrent-reader test runs.
const READER_TEST_SECONDS: u64 = 3;
/// Seeds of the crash test in `make test` (`COPSE_BATCH_CRASH_SEEDS` to change,
/// `COPSE_BATCH_CRASH_SEED_START` to replay).
const CRASH_SEEDS_DEFAULT: u64 = 1_000;
/// Device operations before the crash, at most (a few batches' worth).
const CRASH_OPS_MAX: u64 = 400;
const CRASH_WRITERS: usize = 2;
const CRASH_BATCHES_PER_WRITER_MAX: u64 = 40;

/// `GROUP_KEYS` keys named after `group` that cover every shard of `shards`.
fn group_keys(group: &str, shards: usize) -> Vec<Vec<u8>> {
    let mut keys: Vec<Vec<u8>> = Vec::new();
    let mut covered = vec![false; shards];
    let mut i = 0;
    while keys.len() < GROUP_KEYS || covered.iter().any(|c| !c) {
        let key = format!("{group}-key{i}").into_bytes();
        let shard = shard_of(&key, shards as u32) as usize;
        if !covered[shard] || keys.len() + covered.iter().filter(|c| !**c).count() < GROUP_KEYS {
            covered[shard] = true;
            keys.push(key);
        }
        i += 1;
    }
    keys
}

/// A batch writing `value` to every key (or deleting them all, for `None`).
fn batch_of(keys: &[Vec<u8>], value: Option<&[u8]>) -> WriteBatch {
    let mut batch = WriteBatch::new();
    for key in keys {
        match value {
            Some(value) => batch.put(key.clone(), value.to_vec()),
            None => batch.delete(key.clone()),
        };
    }
    batch
}

/// The one value all of `values` share, or a description of the mix.
fn whole(values: &[Option<Vec<u8>>]) -> Result<Option<Vec<u8>>, String> {
    if values.windows(2).all(|pair| pair[0] == pair[1]) {
        Ok(values.first().cloned().flatten())
    } else {
        let shown: Vec<String> = values
            .iter()
            .map(|v| v.as_ref().map_or("absent".into(), |v| String::from_utf8_lossy(v).into()))
            .collect();
        Err(format!("half a batch: {shown:?}"))
    }
}

fn open(dir: &std::path::Path) -> Db {
    Db::open(dir, common::options(SHARDS)).expect("open")
}

#[test]
fn a_batch_over_every_shard_is_applied_whole_and_survives_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let keys = group_keys("whole", SHARDS);
    {
        let db = open(dir.path());
        db.put(&keys[0], b"before").unwrap();
        db.write_batch(batch_of(&keys, Some(b"v1"))).unwrap();
        assert_eq!(whole(&db.multi_get(&keys).unwrap()).unwrap(), Some(b"v1".to_vec()));
        for key in &keys {
            assert_eq!(db.get(key).unwrap(), Some(b"v1".to_vec()));
        }
        let mut mixed = WriteBatch::new();
        mixed.put(keys[1].clone(), b"v2".to_vec()).delete(keys[2].clone());
        mixed.put(keys[1].clone(), b"v3".to_vec());
        db.write_batch(mixed).unwrap();
        assert_eq!(db.get(&keys[1]).unwrap(), Some(b"v3".to_vec()), "the last op of a key wins");
        assert_eq!(db.get(&keys[2]).unwrap(), None);
        let scanned = db.scan(b"whole-".to_vec()..b"whole.".to_vec(), 100).unwrap();
        assert_eq!(scanned.len(), keys.len() - 1);
        db.close().unwrap();
    }
    let db = open(dir.path());
    assert_eq!(db.get(&keys[0]).unwrap(), Some(b"v1".to_vec()));
    assert_eq!(db.get(&keys[1]).unwrap(), Some(b"v3".to_vec()));
    assert_eq!(db.get(&keys[2]).unwrap(), None);
    assert_eq!(db.stats().unwrap().items, keys.len() as u64 - 1, "no part left as an item");
}

#[test]
fn a_batch_with_a_part_over_the_limits_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let db = open(dir.path());
    let keys = group_keys("limits", SHARDS);
    db.write_batch(batch_of(&keys, Some(b"old"))).unwrap();
    let mut batch = batch_of(&keys, Some(b"new"));
    batch.put(Vec::new(), b"empty key".to_vec());
    assert!(matches!(db.write_batch(batch), Err(WriteError::Input(_))));
    assert_eq!(whole(&db.multi_get(&keys).unwrap()).unwrap(), Some(b"old".to_vec()));
}

/// One writer rewrites a group of keys (one in every shard) with batch after batch, each value
/// its number, deleting the group every few batches. Readers check that
/// - a multi-get and a scan of the group never see two batches (or a batch and a delete);
/// - a thread reading the keys one by one never sees a batch older than one it saw before.
#[test]
fn concurrent_readers_never_see_half_a_batch() {
    let dir = tempfile::tempdir().unwrap();
    let db = open(dir.path());
    let keys = group_keys("readers", SHARDS);
    db.write_batch(batch_of(&keys, Some(b"0000000"))).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let batches = Arc::new(AtomicU64::new(0));
    let start = Arc::new(Barrier::new(4));
    let writer = {
        let (db, keys, stop, batches, start) =
            (db.clone(), keys.clone(), stop.clone(), batches.clone(), start.clone());
        std::thread::spawn(move || {
            start.wait();
            let mut n = 1u64;
            while !stop.load(Ordering::Relaxed) {
                let value = format!("{n:07}");
                let value = (!n.is_multiple_of(5)).then_some(value.as_bytes());
                db.write_batch(batch_of(&keys, value)).expect("batch");
                batches.store(n, Ordering::Relaxed);
                n += 1;
            }
        })
    };
    let multi = {
        let (db, keys, stop, start) = (db.clone(), keys.clone(), stop.clone(), start.clone());
        std::thread::spawn(move || {
            start.wait();
            let mut reads = 0u64;
            let mut scans = 0u64;
            while !stop.load(Ordering::Relaxed) {
                whole(&db.multi_get(&keys).unwrap()).unwrap();
                reads += 1;
                let items = db.scan(b"readers-".to_vec()..b"readers.".to_vec(), 100).unwrap();
                assert!(
                    items.is_empty() || items.len() == keys.len(),
                    "a scan saw {} of {} keys",
                    items.len(),
                    keys.len()
                );
                let values: Vec<_> = items.into_iter().map(|(_, v)| Some(v)).collect();
                whole(&values).unwrap();
                scans += 1;
            }
            (reads, scans)
        })
    };
    let sequential = {
        let (db, keys, stop, start) = (db.clone(), keys.clone(), stop.clone(), start.clone());
        std::thread::spawn(move || {
            start.wait();
            // The newest batch seen so far, and whether it was a delete (absent values).
            let mut newest_seen = 0u64;
            let mut checks = 0u64;
            let mut rng = ChaCha8Rng::seed_from_u64(7);
            while !stop.load(Ordering::Relaxed) {
                let key = &keys[rng.gen_range(0..keys.len())];
                if let Some(value) = db.get(key).unwrap() {
                    let n: u64 = String::from_utf8(value).unwrap().parse().unwrap();
                    assert!(n >= newest_seen, "read batch {n} after batch {newest_seen}");
                    // A delete batch may come in between; values only move forward.
                    newest_seen = n;
                    checks += 1;
                }
            }
            checks
        })
    };
    start.wait();
    std::thread::sleep(Duration::from_secs(READER_TEST_SECONDS));
    stop.store(true, Ordering::Relaxed);
    writer.join().unwrap();
    let (reads, scans) = multi.join().unwrap();
    let checks = sequential.join().unwrap();
    let written = batches.load(Ordering::Relaxed);
    eprintln!("{written} batches, {reads} multi-gets, {scans} scans, {checks} single reads");
    assert!(written >= 10 && reads >= 10 && scans >= 10 && checks >= 10, "too little overlap");
}

/// Batches over overlapping keys from several threads, and plain puts of the same keys: no
/// deadlock (shards are taken in one order), nothing lost, and every batch whole at the end.
#[test]
fn overlapping_batches_and_plain_writes_neither_deadlock_nor_tear() {
    let dir = tempfile::tempdir().unwrap();
    let db = open(dir.path());
    let keys = group_keys("overlap", SHARDS);
    let threads: Vec<_> = (0..3)
        .map(|t| {
            let (db, keys) = (db.clone(), keys.clone());
            std::thread::spawn(move || {
                for n in 0..30 {
                    let value = format!("t{t}-{n}");
                    db.write_batch(batch_of(&keys, Some(value.as_bytes()))).unwrap();
                }
            })
        })
        .collect();
    let plain = {
        let (db, key) = (db.clone(), group_keys("plain", SHARDS)[0].clone());
        std::thread::spawn(move || {
            for n in 0..100 {
                let value = format!("p{n}");
                db.put(&key, value.as_bytes()).unwrap();
                assert_eq!(db.get(&key).unwrap(), Some(value.into_bytes()));
            }
        })
    };
    let deadline = Instant::now() + Duration::from_secs(120);
    for thread in threads {
        while !thread.is_finished() {
            assert!(Instant::now() < deadline, "batches over overlapping keys deadlocked");
            std::thread::sleep(Duration::from_millis(10));
        }
        thread.join().unwrap();
    }
    plain.join().unwrap();
    // A plain put of a key in a batch lands after or before the batch, never inside it.
    db.put(&keys[0], b"after").unwrap();
    assert_eq!(db.get(&keys[0]).unwrap(), Some(b"after".to_vec()));
    let rest = whole(&db.multi_get(&keys[1..]).unwrap()).unwrap();
    assert!(rest.is_some_and(|v| v.starts_with(b"t")));
}

// ---- Crash test on the simulated device (native engine) -------------------------------------

/// What one writer knows about its own group: the batches it attempted and which were
/// acknowledged. Batch `n` writes value `w{writer}-{n}` to every key, or deletes them all when
/// `n % 4 == 3`.
struct WriterLog {
    attempted: u64,
    acked: u64,
}

fn writer_value(writer: usize, n: u64) -> Option<Vec<u8>> {
    (n % 4 != 3).then(|| format!("w{writer}-{n}").into_bytes())
}

fn open_sim(disk: &SimDisk, shards: usize, record_max: usize) -> Result<Db, copse::OpenError> {
    let options = Options {
        shards,
        batch_record_bytes_max: record_max,
        cache_bytes: 1 << 20,
        show_progress: false,
        pin_threads: false,
        ..Options::default()
    };
    Db::open_with_storage(Arc::new(disk.storage(WriteDurability::FlushPerRound)), options)
}

/// After a crash and recovery, each writer's group holds exactly the state of one batch it
/// attempted, no older than its last acknowledged one.
fn check_groups(db: &Db, groups: &[Vec<Vec<u8>>], logs: &[WriterLog]) -> Result<(), String> {
    for (writer, (keys, log)) in groups.iter().zip(logs).enumerate() {
        let values = db.multi_get(keys).map_err(|err| format!("reading: {err}"))?;
        let state = whole(&values).map_err(|err| format!("writer {writer}: {err}"))?;
        let explained = (log.acked..=log.attempted).any(|n| writer_value(writer, n) == state)
            || (log.acked == 0 && state.is_none());
        if !explained {
            return Err(format!(
                "writer {writer}: group holds {:?}, acked {} attempted {}",
                state.map(|v| String::from_utf8_lossy(&v).into_owned()),
                log.acked,
                log.attempted
            ));
        }
    }
    Ok(())
}

/// Parts the final recovery of a seed found: (prepared only, committed), and the records of
/// incomplete chains it erased.
fn run_crash_seed(seed: u64) -> Result<(u64, u64, u64), String> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x0ba7_c4e5);
    let shards = 2 + (seed % 3) as usize;
    // Half the seeds record each part in a chain of small records (prepared and committed).
    let record_max = match seed % 2 {
        0 => copse::limits::BATCH_RECORD_BYTES_MAX,
        _ => copse::limits::BATCH_RECORD_BYTES_MIN << (seed / 2 % 2),
    };
    let disk = SimDisk::new(seed);
    let groups: Vec<Vec<Vec<u8>>> =
        (0..CRASH_WRITERS).map(|w| group_keys(&format!("g{w}"), shards)).collect();
    disk.crash_after_ops(rng.gen_range(0..CRASH_OPS_MAX));
    let logs: Vec<WriterLog> = match open_sim(&disk, shards, record_max) {
        Err(_) if disk.has_crashed() => {
            (0..CRASH_WRITERS).map(|_| WriterLog { attempted: 0, acked: 0 }).collect()
        }
        Err(err) => return Err(format!("open without a crash failed: {err}")),
        Ok(db) => {
            let handles: Vec<_> = groups
                .iter()
                .enumerate()
                .map(|(writer, keys)| {
                    let (db, keys) = (db.clone(), keys.clone());
                    std::thread::spawn(move || {
                        let mut log = WriterLog { attempted: 0, acked: 0 };
                        for n in 1..=CRASH_BATCHES_PER_WRITER_MAX {
                            log.attempted = n;
                            let value = writer_value(writer, n);
                            match db.write_batch(batch_of(&keys, value.as_deref())) {
                                Ok(()) => log.acked = n,
                                Err(_) => break,
                            }
                        }
                        log
                    })
                })
                .collect();
            let logs: Vec<WriterLog> = handles.into_iter().map(|h| h.join().unwrap()).collect();
            if !disk.has_crashed() {
                disk.crash_now();
            }
            let _ = db.close();
            logs
        }
    };
    // Recover; a third of the seeds crash during recovery too (while it resolves batches).
    let mut rebooted = disk.restart();
    if rng.gen_bool(0.33) {
        rebooted.crash_after_ops(rng.gen_range(0..60));
        if let Ok(db) = open_sim(&rebooted, shards, record_max) {
            if !rebooted.has_crashed() {
                let checked = check_groups(&db, &groups, &logs);
                // The crash point may fall among the check's own reads, which then fail.
                if !rebooted.has_crashed() {
                    checked?;
                    rebooted.crash_now();
                }
            }
            let _ = db.close();
        }
        rebooted = rebooted.restart();
    }
    let db =
        open_sim(&rebooted, shards, record_max).map_err(|err| format!("recovery failed: {err}"))?;
    let recovered = db.stats().map_err(|err| format!("stats: {err}"))?;
    let parts: u64 = recovered.shards.iter().map(|shard| shard.recovery.parts).sum();
    let committed: u64 = recovered.shards.iter().map(|shard| shard.recovery.parts_committed).sum();
    let broken: u64 =
        recovered.shards.iter().map(|shard| shard.recovery.broken_chain_records).sum();
    check_groups(&db, &groups, &logs)?;
    // The store is whole again: a new batch over every group works.
    for keys in &groups {
        db.write_batch(batch_of(keys, Some(b"after"))).map_err(|e| format!("after: {e}"))?;
    }
    db.close().map_err(|err| format!("close: {err}"))?;
    Ok((parts - committed, committed, broken))
}

#[test]
fn simulated_crashes_leave_every_cross_shard_batch_whole_or_absent() {
    let start = env_u64("COPSE_BATCH_CRASH_SEED_START", 0);
    let seeds = env_u64("COPSE_BATCH_CRASH_SEEDS", CRASH_SEEDS_DEFAULT);
    let mut failures = Vec::new();
    let (mut prepared, mut committed, mut broken) = (0, 0, 0);
    for seed in start..start + seeds {
        match run_crash_seed(seed) {
            Ok(found) => {
                prepared += found.0;
                committed += found.1;
                broken += found.2;
            }
            Err(failure) => failures.push(format!(
                "seed {seed}: {failure} (replay: COPSE_BATCH_CRASH_SEED_START={seed} COPSE_BATCH_CRASH_SEEDS=1)"
            )),
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {seeds} seeds failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
    eprintln!(
        "{seeds} seeds: recoveries found {prepared} prepared and {committed} committed parts, \
         and erased {broken} records of incomplete chains"
    );
    if seeds >= CRASH_SEEDS_DEFAULT {
        // Otherwise the crashes never hit the protocol's windows and the test shows nothing.
        assert!(prepared > 0 && committed > 0, "prepared {prepared}, committed {committed}");
        assert!(broken > 0, "no crash left a part's chain incomplete");
    }
}
