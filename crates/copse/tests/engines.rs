//! The engine a store runs is chosen at creation and recorded in its manifest. Risks: a store
//! opened with another engine than the one that wrote it (every key would read as missing, and
//! writes would split the data over two engines), a build without an engine opening a store of
//! that engine, and, for the RocksDB engine, a run of gets answered with another key's value
//! (p2KVS's public harness read one key's buffer for every key of a multi-get).

mod common;

use copse::{Db, EngineKind, OpenError, Options};

fn options(engine: EngineKind) -> Options {
    Options {
        shards: 2,
        cache_bytes: 4 << 20,
        show_progress: false,
        pin_threads: false,
        engine,
        ..Options::default()
    }
}

fn other(engine: EngineKind) -> EngineKind {
    match engine {
        EngineKind::Native => EngineKind::RocksDb,
        EngineKind::RocksDb => EngineKind::Native,
    }
}

#[test]
fn a_store_is_refused_with_another_engine_than_the_one_that_made_it() {
    let engine = common::engine();
    let dir = tempfile::tempdir().unwrap();
    let db = Db::open(dir.path(), options(engine)).unwrap();
    db.put(b"key", b"value").unwrap();
    db.close().unwrap();
    drop(db);
    let manifest = copse::store::manifest::read_manifest(dir.path()).unwrap().unwrap();
    assert_eq!(manifest.engine, engine, "the manifest records the engine");
    match Db::open(dir.path(), options(other(engine))) {
        Err(OpenError::EngineMismatch { found, requested, .. }) => {
            assert_eq!((found, requested), (engine, other(engine)));
        }
        Err(OpenError::EngineUnavailable(kind)) => {
            assert_eq!(kind, EngineKind::RocksDb);
            assert!(!kind.available(), "refused an engine this build has");
        }
        Err(err) => panic!("unexpected error {err}"),
        Ok(_) => panic!("opened a {engine} store with the {} engine", other(engine)),
    }
    let db = Db::open(dir.path(), options(engine)).unwrap();
    assert_eq!(db.get(b"key").unwrap().as_deref(), Some(&b"value"[..]));
}

#[cfg(not(feature = "rocksdb"))]
#[test]
fn a_build_without_rocksdb_refuses_the_engine_and_creates_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    match Db::open(&store, options(EngineKind::RocksDb)) {
        Err(err @ OpenError::EngineUnavailable(_)) => {
            assert!(err.to_string().contains("--features rocksdb"), "{err}");
        }
        Err(err) => panic!("unexpected error {err}"),
        Ok(_) => panic!("opened a rocksdb store without the engine"),
    }
    assert!(!store.exists(), "a refused open leaves nothing behind");
}

/// Many concurrent readers: their gets meet in the shard's rounds and reach the engine as runs
/// (for RocksDB, one multi_get per run); each must get its own key's value.
#[test]
fn gets_that_share_a_round_each_get_their_own_value() {
    let dir = tempfile::tempdir().unwrap();
    let db = Db::open(dir.path(), options(common::engine())).unwrap();
    const KEYS: u32 = 500;
    for i in 0..KEYS {
        db.put(format!("key{i}").as_bytes(), format!("value of {i}").as_bytes()).unwrap();
    }
    let readers: Vec<_> = (0..8u32)
        .map(|reader| {
            let db = db.clone();
            std::thread::spawn(move || {
                for round in 0..5u32 {
                    for i in (0..KEYS).map(|i| (i * 7 + reader * 13 + round) % (KEYS + 20)) {
                        let got = db.get(format!("key{i}").as_bytes()).unwrap();
                        let expected = (i < KEYS).then(|| format!("value of {i}").into_bytes());
                        assert_eq!(got, expected, "key{i}");
                    }
                }
            })
        })
        .collect();
    for reader in readers {
        reader.join().unwrap();
    }
}

/// Deletes in one round answer as if they ran one by one: the second delete of a key sees the
/// first. Many threads delete the same keys at once; exactly one delete per key may say it
/// existed.
#[test]
fn concurrent_deletes_of_one_key_report_it_existed_exactly_once() {
    let dir = tempfile::tempdir().unwrap();
    let db = Db::open(dir.path(), options(common::engine())).unwrap();
    const KEYS: u32 = 300;
    for i in 0..KEYS {
        db.put(format!("key{i}").as_bytes(), b"x").unwrap();
    }
    let deleters: Vec<_> = (0..6)
        .map(|_| {
            let db = db.clone();
            std::thread::spawn(move || {
                (0..KEYS).filter(|i| db.delete(format!("key{i}").as_bytes()).unwrap()).count()
            })
        })
        .collect();
    let existed: usize = deleters.into_iter().map(|deleter| deleter.join().unwrap()).sum();
    assert_eq!(existed, KEYS as usize);
    assert!(db.scan(.., 10).unwrap().is_empty());
}

/// `copse check` reads a store of either engine: its report counts the live keys the store
/// holds, and it finds no problem in a store closed cleanly.
#[test]
fn check_counts_the_live_keys_of_a_store_of_either_engine() {
    let dir = tempfile::tempdir().unwrap();
    {
        let db = Db::open(dir.path(), options(common::engine())).unwrap();
        for i in 0..120u32 {
            db.put(format!("key{i}").as_bytes(), &vec![i as u8; 200 + i as usize]).unwrap();
        }
        for i in (0..120u32).step_by(3) {
            assert!(db.delete(format!("key{i}").as_bytes()).unwrap());
        }
        db.close().unwrap();
    }
    let report = copse::interfaces::check::check_store(dir.path(), &Default::default()).unwrap();
    assert!(report.is_clean(), "{:?}", report.problems);
    assert_eq!(report.live_keys, 80);
    assert_eq!(report.manifest.unwrap().engine, common::engine());
}

#[cfg(feature = "rocksdb")]
mod rocksdb_store {
    use super::*;
    use copse::interfaces::check::check_store;

    /// A RocksDB store of 2 shards with 100 keys, closed.
    fn store() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open(dir.path(), options(EngineKind::RocksDb)).unwrap();
        for i in 0..100u32 {
            db.put(format!("key{i}").as_bytes(), b"value").unwrap();
        }
        db.close().unwrap();
        dir
    }

    #[test]
    fn a_native_store_is_refused_by_the_rocksdb_engine() {
        let dir = tempfile::tempdir().unwrap();
        Db::open(dir.path(), options(EngineKind::Native)).unwrap().close().unwrap();
        match Db::open(dir.path(), options(EngineKind::RocksDb)) {
            Err(OpenError::EngineMismatch { found: EngineKind::Native, .. }) => {}
            Err(err) => panic!("unexpected error {err}"),
            Ok(_) => panic!("opened a native store with the rocksdb engine"),
        }
    }

    /// Losing the manifest must not make the store look new: recreating it with another shard
    /// count (or engine) would route keys to the wrong instances.
    #[test]
    fn a_rocksdb_store_whose_manifest_is_lost_is_refused_not_recreated() {
        let dir = store();
        std::fs::write(dir.path().join("MANIFEST"), vec![0u8; 4096]).unwrap();
        for engine in [EngineKind::RocksDb, EngineKind::Native] {
            let reopened = Db::open(dir.path(), Options { shards: 4, ..options(engine) });
            match reopened {
                Err(OpenError::CorruptManifest(reason)) => {
                    assert!(reason.contains("RocksDB instances"), "{reason}");
                }
                Err(err) => panic!("unexpected error {err}"),
                Ok(_) => panic!("a store with a lost manifest opened as new ({engine})"),
            }
        }
        let report = check_store(dir.path(), &Default::default()).unwrap();
        assert_eq!(report.problems_found, 1, "{:?}", report.problems);
        assert_eq!(report.problems[0].file, "MANIFEST");
    }

    /// Every column family runs with the store's budget: one opened with RocksDB's defaults
    /// (64 MiB memtables, its own block cache, compression) held a whole benchmark dataset in
    /// memory outside the budget. RocksDB writes each family's effective options to its
    /// OPTIONS file.
    #[test]
    fn every_column_family_has_the_budgeted_options() {
        let dir = store();
        for shard in 0..2 {
            let instance = dir.path().join(format!("rocksdb/shard-{shard:03}"));
            let newest = std::fs::read_dir(&instance)
                .unwrap()
                .flatten()
                .map(|entry| entry.file_name().to_string_lossy().into_owned())
                .filter(|name| name.starts_with("OPTIONS-"))
                .max_by_key(|name| name[8..].parse::<u64>().unwrap_or(0))
                .expect("RocksDB wrote an OPTIONS file");
            let text = std::fs::read_to_string(instance.join(newest)).unwrap();
            let families: Vec<&str> = text.split("[CFOptions ").skip(1).collect();
            assert_eq!(families.len(), 2, "default and parts families");
            let budget = options(EngineKind::RocksDb).cache_bytes;
            let memtable =
                (budget / copse::limits::ROCKSDB_MEMTABLE_BUDGET_DIVISOR / 2).max(1 << 20);
            for family in families {
                let name = family.lines().next().unwrap_or_default();
                assert!(
                    family.contains(&format!("write_buffer_size={memtable}\n")),
                    "{name}: not the budgeted memtable size"
                );
                assert!(family.contains("compression=kNoCompression\n"), "{name}: compressed");
            }
        }
    }

    /// An instance directory that disappears must not come back empty.
    #[test]
    fn a_lost_instance_is_refused_not_recreated_empty() {
        let dir = store();
        std::fs::remove_dir_all(dir.path().join("rocksdb/shard-001")).unwrap();
        match Db::open(dir.path(), options(EngineKind::RocksDb)) {
            Err(OpenError::Engine(reason)) => assert!(reason.contains("missing"), "{reason}"),
            Err(err) => panic!("unexpected error {err}"),
            Ok(_) => panic!("opened a store that lost an instance"),
        }
        assert!(!dir.path().join("rocksdb/shard-001").exists(), "nothing recreated");
        let report = check_store(dir.path(), &Default::default()).unwrap();
        assert_eq!(report.problems_found, 1, "{:?}", report.problems);
        assert_eq!(report.problems[0].shard, Some(1));
    }
}

#[test]
fn an_online_scrub_checks_every_item_and_finds_a_healthy_store_clean() {
    let engine = common::engine();
    let dir = tempfile::tempdir().unwrap();
    let db = Db::open(dir.path(), options(engine)).unwrap();
    let mut live = 0u64;
    for i in 0..300u32 {
        let key = format!("scrub{i:04}").into_bytes();
        // Small items, items near a page, and multi-page ones.
        let len = [40, 3_000, 20_000][i as usize % 3];
        db.put(&key, &common::make_value(&format!("v{i}"), len)).unwrap();
        live += 1;
        if i % 7 == 0 {
            db.delete(&key).unwrap();
            live -= 1;
        }
    }
    assert!(db.last_scrub().is_none(), "a scrub recorded before any ran");
    let report = db.scrub().unwrap();
    assert_eq!(report.problems_found, 0, "{:?}", report.problems);
    assert_eq!(report.items_checked, live);
    if engine == EngineKind::Native {
        assert!(report.pages_checked > 0);
    }
    let last = db.last_scrub().expect("the finished scrub is kept");
    assert_eq!(last.report, report);
    assert!(last.finished_unix_secs > 1_700_000_000, "finished at {}", last.finished_unix_secs);
    assert!(!db.scrub_running());
    db.close().unwrap();
}
