//! Frozen stores written by earlier builds (`tests/fixtures/NAME/`): every later build must open
//! each one, read exactly what it was given, and check it clean. The bytes are checked in and
//! never regenerated, so a change to any on-disk format (slab header, record layout, Batch and
//! Watermark records, manifest) that old stores cannot follow fails here. `compat.rs` tests the
//! upgrade path with stores rewritten by today's encoder; this file holds the bytes themselves.
//!
//! A fixture directory holds:
//! - `store/`: the store as its build left it after a clean close;
//! - `fixture.txt`: how to open it (`engine`, `shards`) and who wrote it (`written_by`);
//! - `contents.txt`: every key the recipe touched, with its value's length and xxh3-64, or
//!   `absent`. It is what the store must answer, whatever the recipe of a later build does.
//!
//! To freeze a new fixture (when a format version changes, keep the old ones and add one):
//! `COPSE_FREEZE_FIXTURE=<name>:<in-place|append> cargo test --release -p copse --test fixtures
//! -- --ignored freeze`, then commit `tests/fixtures/<name>/`. Each fixture is opened from a
//! copy, so the checked-in bytes stay as written.
//!
//! `<name>:crashed-chain` freezes a store that did not close: the recipe written with batch
//! records of at most `CHAIN_RECORD_BYTES` (so its batch and parts are chains of Chunk records),
//! then a single-shard batch whose chain became durable when the disk crashed, before any of its
//! members was written (on the simulated device, whose durable image is then written out as the
//! store). Opening it must replay that batch from its chain.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::make_value;
use copse::interfaces::check::{check_store, CheckOptions};
use copse::{Db, EngineKind, Options, PlacementSetting, WriteBatch};
use xxhash_rust::xxh3::xxh3_64;

/// Shards of every fixture the recipe writes: two, so that its batch crosses shards.
const FIXTURE_SHARDS: usize = 2;
/// Batch records of a crashed-chain fixture hold at most this many bytes (so they chain).
const CHAIN_RECORD_BYTES: usize = 512;
/// Puts of the batch a crashed-chain fixture leaves recorded but not applied.
const CHAIN_BATCH_PUTS: usize = 24;
/// Keys the recipe writes (each a few times, some deleted).
const RECIPE_KEYS: usize = 160;

fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests").join("fixtures")
}

/// The value length of key `i`'s write number `round`: two in-page size classes (several and
/// one record per page), a multi-page one, and a 70 KB value now and then. Few classes, since
/// each costs a 1 MiB slab file per shard in the repository.
fn recipe_len(i: usize, round: usize) -> usize {
    if i.is_multiple_of(53) {
        return 70_000;
    }
    RECIPE_LENS[(i + round) % RECIPE_LENS.len()]
}

const RECIPE_LENS: [usize; 3] = [100, 2_000, 9_000];

fn recipe_key(i: usize) -> Vec<u8> {
    format!("fixture-{i:04}").into_bytes()
}

/// Writes the recipe into an open store and returns what every touched key must read as:
/// puts, overwrites in other size classes (stale copies stay behind), deletes, a cross-shard
/// batch, and keys deleted and written again.
fn write_recipe(db: &Db) -> BTreeMap<Vec<u8>, Option<Vec<u8>>> {
    let mut model = BTreeMap::new();
    let mut put = |db: &Db, key: Vec<u8>, value: Vec<u8>| {
        db.put(&key, &value).unwrap();
        model.insert(key, Some(value));
    };
    for i in 0..RECIPE_KEYS {
        put(db, recipe_key(i), make_value(&format!("fixture-{i}-r0"), recipe_len(i, 0)));
    }
    for i in (0..RECIPE_KEYS).step_by(3) {
        put(db, recipe_key(i), make_value(&format!("fixture-{i}-r1"), recipe_len(i, 1)));
    }
    let mut batch = WriteBatch::default();
    for i in 0..12 {
        let key = format!("batch-{i:02}").into_bytes();
        let value = make_value(&format!("batch-{i}"), RECIPE_LENS[i % RECIPE_LENS.len()]);
        batch.put(key.clone(), value.clone());
        model.insert(key, Some(value));
    }
    for i in (1..RECIPE_KEYS).step_by(11) {
        batch.delete(recipe_key(i));
        model.insert(recipe_key(i), None);
    }
    db.write_batch(batch).unwrap();
    for i in (0..RECIPE_KEYS).step_by(7) {
        db.delete(&recipe_key(i)).unwrap();
        model.insert(recipe_key(i), None);
    }
    for i in (0..RECIPE_KEYS).step_by(14) {
        let value = make_value(&format!("fixture-{i}-r2"), recipe_len(i, 2));
        db.put(&recipe_key(i), &value).unwrap();
        model.insert(recipe_key(i), Some(value));
    }
    model
}

fn options(engine: EngineKind, shards: usize, placement: PlacementSetting) -> Options {
    Options {
        shards,
        cache_bytes: 4 << 20,
        show_progress: false,
        pin_threads: false,
        engine,
        placement,
        ..Options::default()
    }
}

/// One line of `contents.txt`.
fn describe(key: &[u8], value: &Option<Vec<u8>>) -> String {
    let key = String::from_utf8(key.to_vec()).expect("recipe keys are ASCII");
    match value {
        Some(value) => format!("{key} {} {:016x}", value.len(), xxh3_64(value)),
        None => format!("{key} absent"),
    }
}

/// `name: value` lines of `fixture.txt`.
fn fixture_settings(dir: &Path) -> BTreeMap<String, String> {
    let text = std::fs::read_to_string(dir.join("fixture.txt")).unwrap();
    text.lines()
        .filter_map(|line| line.split_once(": "))
        .map(|(name, value)| (name.to_string(), value.to_string()))
        .collect()
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

/// Opens a copy of one fixture and checks every key of `contents.txt`, then the store's check.
fn verify_fixture(fixture: &Path) -> usize {
    let name = fixture.file_name().unwrap().to_string_lossy().to_string();
    let settings = fixture_settings(fixture);
    let engine: EngineKind = settings["engine"].parse().unwrap();
    let shards: usize = settings["shards"].parse().unwrap();
    let copy = tempfile::tempdir().unwrap();
    let store = copy.path().join("store");
    copy_dir(&fixture.join("store"), &store);

    let report = check_store(&store, &CheckOptions::default()).unwrap();
    assert!(report.is_clean(), "fixture {name} does not check clean: {:#?}", report.problems);

    // Placement is the store's own (from its manifest); the setting here only applies to a
    // new store.
    let db = Db::open(&store, options(engine, shards, PlacementSetting::InPlace))
        .unwrap_or_else(|err| panic!("fixture {name} does not open: {err}"));
    let contents = std::fs::read_to_string(fixture.join("contents.txt")).unwrap();
    let mut keys = 0;
    for line in contents.lines().filter(|line| !line.is_empty()) {
        let key = line.split(' ').next().unwrap().as_bytes();
        let got = db.get(key).unwrap_or_else(|err| panic!("fixture {name}: {line}: {err}"));
        assert_eq!(describe(key, &got), line, "fixture {name} reads wrong");
        keys += 1;
    }
    assert!(keys > 0, "fixture {name} lists no keys");
    db.close().unwrap();
    let live = contents.lines().filter(|line| !line.ends_with(" absent")).count() as u64;
    assert_eq!(report.live_keys, live, "fixture {name} holds keys its contents do not list");
    keys
}

#[test]
fn every_frozen_fixture_opens_and_reads_what_it_was_given() {
    let mut fixtures: Vec<PathBuf> = std::fs::read_dir(fixtures_dir())
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.join("fixture.txt").exists())
        .collect();
    fixtures.sort();
    assert!(fixtures.len() >= 2, "the frozen fixtures are missing: {fixtures:?}");
    for fixture in &fixtures {
        let keys = verify_fixture(fixture);
        println!("fixture {}: {keys} keys read as frozen", fixture.display());
    }
}

/// Writes a new fixture (see the module header); ignored, run by hand.
#[test]
#[ignore]
fn freeze() {
    let spec = std::env::var("COPSE_FREEZE_FIXTURE")
        .expect("COPSE_FREEZE_FIXTURE=<name>:<in-place|append>");
    let (name, placement) = spec.split_once(':').expect("<name>:<placement>");
    let fixture = fixtures_dir().join(name);
    assert!(!fixture.exists(), "{} exists: fixtures are never rewritten", fixture.display());
    let store = fixture.join("store");
    let (placement, model) = match placement {
        "crashed-chain" => (PlacementSetting::InPlace, freeze_crashed_chain(&store)),
        placement => {
            let placement: PlacementSetting = placement.parse().unwrap();
            let db =
                Db::open(&store, options(EngineKind::Native, FIXTURE_SHARDS, placement)).unwrap();
            let model = write_recipe(&db);
            db.close().unwrap();
            (placement, model)
        }
    };
    let contents: Vec<String> = model.iter().map(|(key, value)| describe(key, value)).collect();
    std::fs::write(fixture.join("contents.txt"), contents.join("\n") + "\n").unwrap();
    let commit = std::process::Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .map(|out| String::from_utf8_lossy(&out.stdout).trim().to_string())
        .unwrap_or_default();
    let settings = format!(
        "engine: native\nshards: {FIXTURE_SHARDS}\nplacement: {}\nwritten_by: copse {} (commit {commit})\n",
        placement_name(placement),
        env!("CARGO_PKG_VERSION"),
    );
    std::fs::write(fixture.join("fixture.txt"), settings).unwrap();
    verify_fixture(&fixture);
}

/// Writes a crashed-chain fixture's store into `store` (see the module header) and returns what
/// it must read as once opened.
fn freeze_crashed_chain(store: &Path) -> BTreeMap<Vec<u8>, Option<Vec<u8>>> {
    use copse::device::sim::{PointFault, SimDisk};
    use copse::device::{FaultPoint, WriteDurability};
    let disk = SimDisk::new(20_261_128);
    let chained = Options {
        batch_record_bytes_max: CHAIN_RECORD_BYTES,
        ..options(EngineKind::Native, FIXTURE_SHARDS, PlacementSetting::InPlace)
    };
    let storage = Arc::new(disk.storage(WriteDurability::FlushPerRound));
    let db = Db::open_with_storage(storage, chained).unwrap();
    let mut model = write_recipe(&db);
    // One shard's batch, recorded as a chain; the disk dies once the chain is durable.
    let mut batch = WriteBatch::default();
    let mut i = 0;
    while batch.len() < CHAIN_BATCH_PUTS {
        let key = format!("chained-{i:03}").into_bytes();
        if copse::router::shard_of(&key, FIXTURE_SHARDS as u32) == 0 {
            let value = make_value(&format!("chained-{i}"), 300);
            batch.put(key.clone(), value.clone());
            model.insert(key, Some(value));
        }
        i += 1;
    }
    disk.fault_at_point(FaultPoint::BatchRecordedBeforeMembers, 1, PointFault::Crash);
    assert!(db.write_batch(batch).is_err(), "the disk crashed before the batch's members");
    drop(db);
    let image = disk.restart();
    for name in image.file_names() {
        let path = store.join(&name);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, image.read_file(&name).unwrap()).unwrap();
    }
    model
}

fn placement_name(placement: PlacementSetting) -> &'static str {
    match placement {
        PlacementSetting::InPlace => "in-place",
        PlacementSetting::Append => "append",
        _ => "auto",
    }
}

/// The crashed-chain fixture holds a whole chain of Chunk records and none of its batch's
/// members: opening it replays the batch from the chain, and erases the chain.
#[test]
fn the_crashed_chain_fixture_replays_its_batch_from_the_chain() {
    let fixture = fixtures_dir().join("native-chain-v0.3");
    let copy = tempfile::tempdir().unwrap();
    let store = copy.path().join("store");
    copy_dir(&fixture.join("store"), &store);
    let before = check_store(&store, &CheckOptions::default()).unwrap();
    assert!(before.slots.chunk_records >= 2, "no chain in the fixture: {:?}", before.slots);
    let db =
        Db::open(&store, options(EngineKind::Native, FIXTURE_SHARDS, PlacementSetting::InPlace))
            .unwrap();
    let stats = db.stats().unwrap();
    assert_eq!(stats.shards[0].recovery.batches_replayed, 1, "{:?}", stats.shards[0].recovery);
    assert_eq!(stats.shards[0].recovery.broken_chain_records, 0);
    let contents = std::fs::read_to_string(fixture.join("contents.txt")).unwrap();
    let chained: Vec<&str> = contents.lines().filter(|line| line.starts_with("chained-")).collect();
    assert_eq!(chained.len(), CHAIN_BATCH_PUTS);
    for line in chained {
        let key = line.split(' ').next().unwrap().as_bytes();
        assert_eq!(describe(key, &db.get(key).unwrap()), line, "not replayed");
    }
    db.close().unwrap();
    let after = check_store(&store, &CheckOptions::default()).unwrap();
    assert!(after.is_clean(), "{:?}", after.problems);
    assert_eq!(after.slots.chunk_records, 0, "the chain was not erased: {:?}", after.slots);
}
