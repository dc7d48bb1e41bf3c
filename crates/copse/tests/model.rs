//! Model-based tests: random sequences of gets, puts, deletes, scans, write batches, flushes and
//! reopens run against the store and against a `BTreeMap` model; every answer must match the
//! model exactly.
//!
//! Risks covered: a read returning a stale or foreign value after updates that move a key between
//! size classes (in-page ↔ multi-page), a delete reporting the wrong "existed", a scan losing,
//! duplicating or misordering keys or ignoring its bounds or limit, a batch applying anything but
//! the last operation of a repeated key, and recovery (reopen) resurrecting old versions or
//! deleted keys, or losing acknowledged writes — on 1 to 4 shards, on the simulated device (both
//! durability modes) and on the real one.
//!
//! A failure prints the shrunk operation list; values are described by (length, seed), so it is
//! short. `PROPTEST_CASES` overrides the number of cases.

mod common;

use std::collections::BTreeMap;
use std::ops::Bound;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use copse::device::sim::SimDisk;
use copse::limits::SCAN_ITEMS_MAX;
use copse::{Db, Options, WriteBatch, WriteDurability};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

type Model = BTreeMap<Vec<u8>, Vec<u8>>;

fn options(shards: usize) -> Options {
    // A small cache (the per-shard minimum of 256 pages) so that reads also go to the device.
    Options {
        shards,
        cache_bytes: 1 << 20,
        show_progress: false,
        // Many stores run at once in a test run; pinning would stack their shards on core 0.
        pin_threads: false,
        engine: common::engine(),
        ..Options::default()
    }
}

/// A value described by its length and a seed; the bytes are generated (cheap to print).
#[derive(Clone, Copy, Debug)]
struct ValueSpec {
    len: usize,
    seed: u32,
}

impl ValueSpec {
    fn bytes(self) -> Vec<u8> {
        value_bytes(self.len, u64::from(self.seed))
    }
}

/// `len` pseudo-random bytes from `seed` (splitmix64), so that two versions of a key differ
/// throughout and a value read from the wrong slot or a stale copy never matches by chance.
fn value_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (len as u64);
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        out.extend_from_slice(&z.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// A key of the case's pool, by position (modulo the pool's size; shrinks towards the first).
type KeyIx = usize;

fn key_ix() -> impl Strategy<Value = KeyIx> {
    0usize..40
}

#[derive(Clone, Debug)]
enum KeySpec {
    /// A key of the case's pool (so operations collide often).
    Pool(KeyIx),
    /// Any short byte string, possibly empty (scan bounds only).
    Raw(Vec<u8>),
}

#[derive(Clone, Debug)]
enum BoundSpec {
    Unbounded,
    Included(KeySpec),
    Excluded(KeySpec),
}

#[derive(Clone, Debug)]
enum BatchSpec {
    Put(KeyIx, ValueSpec),
    Delete(KeyIx),
}

#[derive(Clone, Debug)]
enum Op {
    Get(KeyIx),
    Put(KeyIx, ValueSpec),
    Delete(KeyIx),
    Scan { start: BoundSpec, end: BoundSpec, limit: usize },
    Batch(Vec<BatchSpec>),
    Flush,
    Reopen,
}

/// Bytes from a small alphabet, so keys share prefixes and order around 0x00 and 0xff matters.
fn key_byte() -> impl Strategy<Value = u8> {
    prop::sample::select(vec![0x00u8, 0x01, b'a', b'b', b'k', 0x7f, 0x80, 0xff])
}

fn key_pool() -> impl Strategy<Value = Vec<Vec<u8>>> {
    let size = prop_oneof![1usize..=5, 1usize..=40];
    size.prop_flat_map(|size| {
        prop::collection::vec(prop::collection::vec(key_byte(), 1..=24), size)
    })
}

fn value_spec() -> impl Strategy<Value = ValueSpec> {
    let len = prop_oneof![
        4 => 0usize..=64,
        5 => 0usize..=10 * 1024,
        1 => 20 * 1024usize..=200 * 1024,
    ];
    (len, any::<u32>()).prop_map(|(len, seed)| ValueSpec { len, seed })
}

fn key_spec() -> impl Strategy<Value = KeySpec> {
    prop_oneof![
        3 => key_ix().prop_map(KeySpec::Pool),
        1 => prop::collection::vec(key_byte(), 0..=4).prop_map(KeySpec::Raw),
    ]
}

fn bound_spec() -> impl Strategy<Value = BoundSpec> {
    prop_oneof![
        1 => Just(BoundSpec::Unbounded),
        2 => key_spec().prop_map(BoundSpec::Included),
        2 => key_spec().prop_map(BoundSpec::Excluded),
    ]
}

fn batch_spec() -> impl Strategy<Value = BatchSpec> {
    prop_oneof![
        3 => (key_ix(), value_spec()).prop_map(|(key, value)| BatchSpec::Put(key, value)),
        1 => key_ix().prop_map(BatchSpec::Delete),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        20 => key_ix().prop_map(Op::Get),
        25 => (key_ix(), value_spec()).prop_map(|(key, value)| Op::Put(key, value)),
        8 => key_ix().prop_map(Op::Delete),
        8 => (bound_spec(), bound_spec(), prop_oneof![0usize..=5, 0usize..=50])
            .prop_map(|(start, end, limit)| Op::Scan { start, end, limit }),
        8 => prop::collection::vec(batch_spec(), 1..=8).prop_map(Op::Batch),
        2 => Just(Op::Flush),
        2 => Just(Op::Reopen),
    ]
}

/// Runs `ops` against the store that `open` opens (the same storage each time) and the model.
struct Harness<'a> {
    open: &'a dyn Fn() -> Db,
    db: Option<Db>,
    pool: Vec<Vec<u8>>,
    model: Model,
    /// The step under way, for the report of a case that hangs.
    step: Arc<AtomicUsize>,
}

fn bound(spec: &BoundSpec, pool: &[Vec<u8>]) -> Bound<Vec<u8>> {
    let key = |spec: &KeySpec| match spec {
        KeySpec::Pool(index) => pool[index % pool.len()].clone(),
        KeySpec::Raw(bytes) => bytes.clone(),
    };
    match spec {
        BoundSpec::Unbounded => Bound::Unbounded,
        BoundSpec::Included(spec) => Bound::Included(key(spec)),
        BoundSpec::Excluded(spec) => Bound::Excluded(key(spec)),
    }
}

/// The model's answer to a scan. Written by hand: `BTreeMap::range` panics on inverted bounds,
/// which the store must answer with an empty list.
fn model_scan(
    model: &Model,
    start: &Bound<Vec<u8>>,
    end: &Bound<Vec<u8>>,
    limit: usize,
) -> Vec<(Vec<u8>, Vec<u8>)> {
    let after_start = |key: &Vec<u8>| match start {
        Bound::Unbounded => true,
        Bound::Included(start) => key >= start,
        Bound::Excluded(start) => key > start,
    };
    let before_end = |key: &Vec<u8>| match end {
        Bound::Unbounded => true,
        Bound::Included(end) => key <= end,
        Bound::Excluded(end) => key < end,
    };
    model
        .iter()
        .filter(|(key, _)| after_start(key) && before_end(key))
        .take(limit)
        .map(|(key, value)| (key.clone(), value.clone()))
        .collect()
}

/// Shortens (key, value) lists for failure messages: values become (length, first bytes).
fn describe(items: &[(Vec<u8>, Vec<u8>)]) -> Vec<(Vec<u8>, usize, Vec<u8>)> {
    items
        .iter()
        .map(|(key, value)| (key.clone(), value.len(), value.iter().take(8).copied().collect()))
        .collect()
}

impl Harness<'_> {
    fn db(&self) -> &Db {
        self.db.as_ref().expect("the store is open")
    }

    fn key(&self, index: &KeyIx) -> Vec<u8> {
        self.pool[index % self.pool.len()].clone()
    }

    /// Everything the store holds equals the model, and `stats` counts the model's items.
    fn check_all(&self, when: &str) -> Result<(), TestCaseError> {
        let all = self
            .db()
            .scan(.., SCAN_ITEMS_MAX)
            .map_err(|err| TestCaseError::fail(format!("{when}: full scan failed: {err}")))?;
        let expected: Vec<_> = self.model.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        prop_assert!(
            all == expected,
            "{when}: store holds {:?}, model {:?}",
            describe(&all),
            describe(&expected)
        );
        let stats = self
            .db()
            .stats()
            .map_err(|err| TestCaseError::fail(format!("{when}: stats failed: {err}")))?;
        prop_assert_eq!(stats.items, self.model.len() as u64, "{}: stats item count", when);
        Ok(())
    }

    fn run(&mut self, ops: &[Op]) -> Result<(), TestCaseError> {
        for (step, op) in ops.iter().enumerate() {
            self.step.store(step, Ordering::Relaxed);
            match op {
                Op::Get(index) => {
                    let key = self.key(index);
                    let got = self.db().get(&key);
                    let expected = self.model.get(&key).cloned();
                    match got {
                        Ok(got) => prop_assert!(
                            got == expected,
                            "step {step}: get {key:?} returned {:?} bytes, model has {:?} bytes (values differ)",
                            got.as_ref().map(Vec::len),
                            expected.as_ref().map(Vec::len)
                        ),
                        Err(err) => prop_assert!(false, "step {step}: get {key:?} failed: {err}"),
                    }
                }
                Op::Put(index, value) => {
                    let key = self.key(index);
                    let value = value.bytes();
                    let result = self.db().put(&key, &value);
                    prop_assert!(result.is_ok(), "step {step}: put {key:?} failed: {:?}", result);
                    self.model.insert(key, value);
                }
                Op::Delete(index) => {
                    let key = self.key(index);
                    let result = self.db().delete(&key);
                    let existed = self.model.remove(&key).is_some();
                    prop_assert_eq!(result, Ok(existed), "step {}: delete {:?}", step, key);
                }
                Op::Scan { start, end, limit } => {
                    let start = bound(start, &self.pool);
                    let end = bound(end, &self.pool);
                    let expected = model_scan(&self.model, &start, &end, *limit);
                    match self.db().scan((start.clone(), end.clone()), *limit) {
                        Ok(got) => prop_assert!(
                            got == expected,
                            "step {step}: scan ({start:?}, {end:?}) limit {limit} returned {:?}, model {:?}",
                            describe(&got),
                            describe(&expected)
                        ),
                        Err(err) => prop_assert!(false, "step {step}: scan failed: {err}"),
                    }
                }
                Op::Batch(specs) => {
                    let mut batch = WriteBatch::new();
                    let mut applied = self.model.clone();
                    for spec in specs {
                        match spec {
                            BatchSpec::Put(index, value) => {
                                let (key, value) = (self.key(index), value.bytes());
                                batch.put(key.clone(), value.clone());
                                applied.insert(key, value);
                            }
                            BatchSpec::Delete(index) => {
                                let key = self.key(index);
                                batch.delete(key.clone());
                                applied.remove(&key);
                            }
                        }
                    }
                    let result = self.db().write_batch(batch);
                    prop_assert!(result.is_ok(), "step {step}: write_batch failed: {:?}", result);
                    self.model = applied;
                }
                Op::Flush => {
                    let result = self.db().flush();
                    prop_assert!(result.is_ok(), "step {step}: flush failed: {:?}", result);
                }
                Op::Reopen => {
                    let db = self.db.take().expect("the store is open");
                    let result = db.close();
                    prop_assert!(result.is_ok(), "step {step}: close failed: {:?}", result);
                    drop(db);
                    self.db = Some((self.open)());
                    self.check_all(&format!("step {step}: after reopen"))?;
                    let stats =
                        self.db().stats().map_err(|err| TestCaseError::fail(err.to_string()))?;
                    let corrupt: u64 =
                        stats.shards.iter().map(|shard| shard.recovery.torn_or_corrupt).sum();
                    prop_assert_eq!(
                        corrupt,
                        0,
                        "step {}: a clean close left slots that do not verify",
                        step
                    );
                }
            }
        }
        self.step.store(ops.len(), Ordering::Relaxed);
        self.check_all("at the end")?;
        // And once more from the disk alone.
        let db = self.db.take().expect("the store is open");
        prop_assert!(db.close().is_ok());
        drop(db);
        self.db = Some((self.open)());
        self.check_all("after the final reopen")
    }
}

/// A case that takes longer than this is reported as a hang (a case normally takes milliseconds).
const CASE_DEADLINE: Duration = Duration::from_secs(5);

/// Runs one case on its own thread: the store's storage is made by `storage` (on that thread),
/// and `open` opens the store on it. A hang fails the case, naming the step that hung; the stuck
/// threads are left behind.
fn run_case<S: 'static>(
    storage: impl FnOnce() -> S + Send + 'static,
    open: fn(&S) -> Db,
    pool: Vec<Vec<u8>>,
    ops: Vec<Op>,
) -> Result<(), TestCaseError> {
    let step = Arc::new(AtomicUsize::new(0));
    let final_check = ops.len();
    let (done, result) = std::sync::mpsc::channel();
    let progress = step.clone();
    std::thread::spawn(move || {
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let storage = storage();
            let open = || open(&storage);
            let mut harness = Harness {
                open: &open,
                db: Some(open()),
                pool,
                model: Model::new(),
                step: progress,
            };
            harness.run(&ops)
        }));
        let _ = done.send(outcome);
    });
    match result.recv_timeout(CASE_DEADLINE) {
        Ok(Ok(result)) => result,
        Ok(Err(panic)) => std::panic::resume_unwind(panic),
        Err(_) => Err(TestCaseError::fail(format!(
            "hang: step {} (counting from 0; {final_check} is the final check) did not finish within {CASE_DEADLINE:?}",
            step.load(Ordering::Relaxed),
        ))),
    }
}

/// The store's options with every in-page class in place, or appended in one-page blocks under
/// a tight space ceiling (so that even a short case collects).
fn placed(shards: usize, append: bool) -> Options {
    let options = options(shards);
    if append {
        Options {
            placement: copse::PlacementSetting::Append,
            append_block_pages: 1,
            space_amplification_max: 1.2,
            ..options
        }
    } else {
        Options { placement: copse::PlacementSetting::InPlace, ..options }
    }
}

fn open_sim((storage, shards, append): &(copse::device::sim::SimStorage, usize, bool)) -> Db {
    Db::open_with_storage(Arc::new(storage.clone()), placed(*shards, *append))
        .expect("open the simulated store")
}

fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|cases| cases.parse().ok()).unwrap_or(default)
}

fn config(cases: u32) -> ProptestConfig {
    // No regression files: this suite's files are the test sources only. A failure prints the
    // shrunk case, which reproduces it.
    ProptestConfig { cases, failure_persistence: None, ..ProptestConfig::default() }
}

proptest! {
    #![proptest_config(config(cases(512)))]

    #[test]
    fn simulated_store_matches_a_btreemap_model(
        seed in any::<u64>(),
        shards in 1usize..=4,
        flush_per_round in any::<bool>(),
        append in any::<bool>(),
        pool in key_pool(),
        ops in prop::collection::vec(op(), 1..=60),
    ) {
        let durability = if flush_per_round { WriteDurability::FlushPerRound } else { WriteDurability::Dsync };
        let storage = move || (SimDisk::new(seed).storage(durability), shards, append);
        run_case(storage, open_sim, pool, ops)?;
    }
}

fn open_real((dir, shards, append): &(tempfile::TempDir, usize, bool)) -> Db {
    Db::open(dir.path(), placed(*shards, *append)).expect("open the store in a temporary directory")
}

proptest! {
    #![proptest_config(config(cases(64)))]

    #[test]
    fn real_device_store_matches_a_btreemap_model(
        shards in 1usize..=4,
        append in any::<bool>(),
        pool in key_pool(),
        ops in prop::collection::vec(op(), 1..=40),
    ) {
        let storage = move || (tempfile::tempdir().expect("temporary directory"), shards, append);
        run_case(storage, open_real, pool, ops)?;
    }
}

/// Many updates of a few keys whose values alternate between in-page and multi-page sizes: each
/// update moves the key to another class and frees its old slot. Risks: an old copy surviving
/// the move (read back, or resurrected by recovery), the item count drifting, and freed slots
/// never being reused (the slab files growing with every pass over the same working set).
#[test]
fn updates_alternating_between_small_and_large_values_keep_one_live_copy() {
    const SIZES: [usize; 10] = [0, 40_000, 7, 150_000, 3_000, 12, 70_000, 4_000, 200_000, 100];
    const KEYS: [&[u8]; 4] = [b"a", b"b", b"key-c", b"\xffd"];
    const PASSES: usize = 8;
    let disk = SimDisk::new(42);
    let open = || {
        Db::open_with_storage(Arc::new(disk.storage(WriteDurability::Dsync)), options(2)).unwrap()
    };
    let db = open();
    let mut model = Model::new();
    let mut file_bytes_after_pass = Vec::new();
    let mut seed = 0u64;
    for pass in 0..PASSES {
        for round in 0..SIZES.len() {
            for (k, &key) in KEYS.iter().enumerate() {
                seed += 1;
                // Keys are out of step with each other, so small and large copies mix.
                let len = SIZES[(round + k * 3) % SIZES.len()];
                let value = value_bytes(len, seed);
                db.put(key, &value).unwrap();
                model.insert(key.to_vec(), value);
                assert_eq!(
                    db.get(key).unwrap().as_ref(),
                    model.get(key),
                    "pass {pass} round {round} key {key:?}"
                );
            }
            if round % 4 == 3 {
                // A delete and re-put in the middle of the churn.
                assert!(db.delete(KEYS[round % KEYS.len()]).unwrap());
                model.remove(KEYS[round % KEYS.len()]);
            }
        }
        file_bytes_after_pass.push(db.stats().unwrap().file_bytes);
    }
    assert_eq!(db.stats().unwrap().items, model.len() as u64);
    // The working set is the same on every pass: once the first passes have sized the slabs,
    // freed slots must be reused rather than the files grown.
    assert_eq!(
        file_bytes_after_pass[PASSES - 1],
        file_bytes_after_pass[2],
        "slab files keep growing over the same working set: {file_bytes_after_pass:?}"
    );
    db.close().unwrap();
    drop(db);

    let db = open();
    let stats = db.stats().unwrap();
    assert_eq!(stats.items, model.len() as u64, "item count after reopen");
    let corrupt: u64 = stats.shards.iter().map(|shard| shard.recovery.torn_or_corrupt).sum();
    assert_eq!(corrupt, 0);
    for key in KEYS {
        assert_eq!(db.get(key).unwrap().as_ref(), model.get(key), "after reopen: key {key:?}");
    }
    let all = db.scan(.., 100).unwrap();
    let expected: Vec<_> = model.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    assert!(all == expected, "scan after reopen differs from the model");
}

/// Runs `work` on its own thread; false if it did not finish within `deadline` (it is left
/// running). A panic in `work` is passed on.
fn finishes_within(deadline: Duration, work: impl FnOnce() + Send + 'static) -> bool {
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(work));
        let _ = done.send(outcome);
    });
    match finished.recv_timeout(deadline) {
        Ok(Ok(())) => true,
        Ok(Err(panic)) => std::panic::resume_unwind(panic),
        Err(_) => false,
    }
}

/// Creating a slab file (the first write of a size class in a shard) performs one synchronous
/// write while the shard's other I/O may be in flight; every completion reaped meanwhile must
/// still reach its request. Writer threads keep I/O in flight while one thread writes values of
/// ever larger classes; every write must be answered and the store must close. (Hung before
/// commit 59e1bf6: `sync_io` dropped the completions reaped together with its own.)
#[test]
fn size_class_opened_while_writes_are_in_flight_loses_no_completion() {
    const LENGTHS: [usize; 20] = [
        100, 200, 400, 700, 900, 1_200, 1_500, 2_500, 3_500, 6_000, 10_000, 14_000, 20_000, 28_000,
        45_000, 60_000, 90_000, 120_000, 180_000, 250_000,
    ];
    let finished = finishes_within(Duration::from_secs(30), || {
        for seed in 0..10u64 {
            let disk = SimDisk::new(seed);
            let storage = Arc::new(disk.storage(WriteDurability::Dsync));
            let db = Db::open_with_storage(storage, options(1)).unwrap();
            db.put(b"warm", &[0; 40]).unwrap();
            let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let writers: Vec<_> = (0..3u8)
                .map(|writer| {
                    let (db, stop) = (db.clone(), stop.clone());
                    std::thread::spawn(move || {
                        let mut i = 0u32;
                        while !stop.load(Ordering::Relaxed) {
                            let key = format!("w{writer}-{}", i % 50);
                            db.put(key.as_bytes(), &[writer; 40]).unwrap();
                            i += 1;
                        }
                    })
                })
                .collect();
            for (i, &len) in LENGTHS.iter().enumerate() {
                db.put(format!("class{i}").as_bytes(), &vec![i as u8; len]).unwrap();
            }
            stop.store(true, Ordering::Relaxed);
            for writer in writers {
                writer.join().unwrap();
            }
            db.flush().unwrap();
            db.close().unwrap();
        }
    });
    assert!(finished, "writes hung after slab files were created with I/O in flight");
}
