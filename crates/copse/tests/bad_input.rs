//! Bad input and bad media: every refused request gets its own clear error and changes nothing;
//! every damaged file or failing device operation is reported as such, never as wrong data, and
//! never with a panic.
//!
//! "Changes nothing" is checked three ways where it applies: the store's contents (a full scan)
//! and item count are the same before and after, and a request refused at the API never reaches
//! the (simulated) device at all.

use std::collections::BTreeMap;
use std::sync::Arc;

use copse::device::sim::{FaultError, FaultOp, SimDisk};
use copse::device::DeviceError;
use copse::limits::{
    KEY_BYTES_MAX, SCAN_ITEMS_MAX, VALUE_BYTES_MAX, WRITE_BATCH_BYTES_MAX, WRITE_BATCH_OPS_MAX,
};
use copse::router::shard_of;
use copse::{
    BatchOp, Db, InputError, KeyValue, OpenError, Options, ReadError, WriteBatch, WriteDurability,
    WriteError,
};

fn options(shards: usize) -> Options {
    Options {
        shards,
        cache_bytes: 4 << 20,
        show_progress: false,
        pin_threads: false,
        ..Options::default()
    }
}

fn open_sim(disk: &SimDisk, shards: usize) -> Result<Db, OpenError> {
    Db::open_with_storage(Arc::new(disk.storage(WriteDurability::Dsync)), options(shards))
}

fn contents(db: &Db) -> Vec<KeyValue> {
    db.scan(.., SCAN_ITEMS_MAX).expect("full scan")
}

/// Every file of the disk, byte for byte.
fn disk_image(disk: &SimDisk) -> BTreeMap<String, Vec<u8>> {
    disk.file_names()
        .into_iter()
        .map(|name| {
            let bytes = disk.read_file(&name).expect("listed file");
            (name, bytes)
        })
        .collect()
}

/// `len` bytes that start with `tag` and then count, so each value is findable in a slab file.
fn value(tag: &[u8], len: usize) -> Vec<u8> {
    let mut out = tag.to_vec();
    let mut counter = 0u32;
    while out.len() < len {
        out.extend_from_slice(&counter.to_le_bytes());
        counter = counter.wrapping_add(0x9E37_79B9);
    }
    out.truncate(len);
    out
}

/// A store on a simulated disk with a few items of in-page and multi-page sizes.
fn populated(seed: u64, shards: usize) -> (SimDisk, Db) {
    let disk = SimDisk::new(seed);
    let db = open_sim(&disk, shards).unwrap();
    db.put(b"alpha", b"1").unwrap();
    db.put(b"beta", &value(b"beta", 3_000)).unwrap();
    db.put(b"gamma", &value(b"gamma", 70_000)).unwrap();
    db.put(b"empty", b"").unwrap();
    db.flush().unwrap();
    (disk, db)
}

/// Runs a request that must be refused; checks that it did not reach the device and that the
/// store's contents did not change. Returns the request's result.
fn refused<T>(disk: &SimDisk, db: &Db, request: impl FnOnce(&Db) -> T) -> T {
    db.flush().unwrap();
    let before = contents(db);
    let items = db.stats().unwrap().items;
    let ops = disk.ops();
    let result = request(db);
    assert_eq!(disk.ops(), ops, "a refused request reached the device");
    assert_eq!(contents(db), before, "a refused request changed the store");
    assert_eq!(db.stats().unwrap().items, items);
    result
}

fn too_long_key() -> Vec<u8> {
    vec![b'k'; KEY_BYTES_MAX + 1]
}

#[test]
fn empty_keys_are_refused_everywhere_and_change_nothing() {
    let (disk, db) = populated(1, 2);
    assert_eq!(refused(&disk, &db, |db| db.get(b"")), Err(ReadError::Input(InputError::KeyEmpty)));
    assert_eq!(
        refused(&disk, &db, |db| db.put(b"", b"value")),
        Err(WriteError::Input(InputError::KeyEmpty))
    );
    assert_eq!(
        refused(&disk, &db, |db| db.delete(b"")),
        Err(WriteError::Input(InputError::KeyEmpty))
    );
    // One bad operation refuses the whole batch: the good ones before and after it are not
    // applied (some would change existing keys).
    let result = refused(&disk, &db, |db| {
        let mut batch = WriteBatch::new();
        batch.put(b"alpha".to_vec(), b"changed".to_vec()).put(Vec::new(), b"x".to_vec());
        batch.delete(b"beta".to_vec()).put(b"new".to_vec(), b"new".to_vec());
        db.write_batch(batch)
    });
    assert_eq!(result, Err(WriteError::Input(InputError::KeyEmpty)));
    let result = refused(&disk, &db, |db| {
        let mut batch = WriteBatch::new();
        batch.put(b"alpha".to_vec(), b"changed".to_vec()).delete(Vec::new());
        db.write_batch(batch)
    });
    assert_eq!(result, Err(WriteError::Input(InputError::KeyEmpty)));
}

#[test]
fn keys_one_byte_over_the_limit_are_refused_everywhere_and_change_nothing() {
    let (disk, db) = populated(2, 2);
    let key = too_long_key();
    let too_large = InputError::KeyTooLarge { bytes: KEY_BYTES_MAX + 1, max: KEY_BYTES_MAX };
    assert_eq!(refused(&disk, &db, |db| db.get(&key)), Err(ReadError::Input(too_large.clone())));
    assert_eq!(
        refused(&disk, &db, |db| db.put(&key, b"value")),
        Err(WriteError::Input(too_large.clone()))
    );
    assert_eq!(
        refused(&disk, &db, |db| db.delete(&key)),
        Err(WriteError::Input(too_large.clone()))
    );
    let result = refused(&disk, &db, |db| {
        let mut batch = WriteBatch::new();
        batch.put(b"alpha".to_vec(), b"changed".to_vec()).put(key.clone(), b"x".to_vec());
        db.write_batch(batch)
    });
    assert_eq!(result, Err(WriteError::Input(too_large.clone())));
    let result = refused(&disk, &db, |db| {
        let mut batch = WriteBatch::new();
        batch.delete(b"alpha".to_vec()).delete(key.clone());
        db.write_batch(batch)
    });
    assert_eq!(result, Err(WriteError::Input(too_large.clone())));
    // Scan bounds are keys too.
    assert_eq!(
        refused(&disk, &db, |db| db.scan(key.clone().., 10)),
        Err(ReadError::Input(too_large.clone()))
    );
    assert_eq!(
        refused(&disk, &db, |db| db.scan(..=key.clone(), 10)),
        Err(ReadError::Input(too_large))
    );
}

#[test]
fn values_one_byte_over_the_limit_are_refused_and_change_nothing() {
    let (disk, db) = populated(3, 1);
    let big = vec![0x5a; VALUE_BYTES_MAX + 1];
    let too_large = InputError::ValueTooLarge { bytes: VALUE_BYTES_MAX + 1, max: VALUE_BYTES_MAX };
    assert_eq!(
        refused(&disk, &db, |db| db.put(b"alpha", &big)),
        Err(WriteError::Input(too_large.clone()))
    );
    let result = refused(&disk, &db, |db| {
        let mut batch = WriteBatch::new();
        batch.delete(b"alpha".to_vec()).put(b"big".to_vec(), big.clone());
        db.write_batch(batch)
    });
    assert_eq!(result, Err(WriteError::Input(too_large)));
}

#[test]
fn batches_over_the_operation_or_byte_limit_are_refused_and_change_nothing() {
    let (disk, db) = populated(4, 2);
    let result = refused(&disk, &db, |db| {
        let mut batch = WriteBatch::new();
        batch.delete(b"alpha".to_vec());
        for i in 0..WRITE_BATCH_OPS_MAX {
            batch.delete(format!("{i:x}").into_bytes());
        }
        db.write_batch(batch)
    });
    assert_eq!(
        result,
        Err(WriteError::Input(InputError::BatchTooManyOps {
            ops: WRITE_BATCH_OPS_MAX + 1,
            max: WRITE_BATCH_OPS_MAX
        }))
    );

    // Values within the value limit whose batch is over the byte limit. Encoded: 4-byte count,
    // then 7 bytes of header, the key and the value per operation. (Zeroed buffers: the pages of
    // 1 GiB of values are never touched, since the batch is refused on its lengths.)
    let values = WRITE_BATCH_BYTES_MAX / VALUE_BYTES_MAX + 1;
    let result = refused(&disk, &db, |db| {
        let mut batch = WriteBatch::new();
        batch.put(b"alpha".to_vec(), b"changed".to_vec());
        for i in 0..values {
            batch.put(format!("b{i:02}").into_bytes(), vec![0; VALUE_BYTES_MAX]);
        }
        db.write_batch(batch)
    });
    let bytes = 4 + (7 + 5 + 7) + values * (7 + 3 + VALUE_BYTES_MAX);
    assert!(bytes > WRITE_BATCH_BYTES_MAX);
    assert_eq!(
        result,
        Err(WriteError::Input(InputError::BatchTooLarge { bytes, max: WRITE_BATCH_BYTES_MAX }))
    );
}

/// The input check accepts batches exactly at the limits (writing one is `large_batches.rs`'s
/// job at a size a test can afford: a batch of 1 GiB is not written here).
#[test]
fn batches_exactly_at_the_operation_and_byte_limits_pass_the_input_check() {
    let deletes: Vec<BatchOp> = (0..WRITE_BATCH_OPS_MAX)
        .map(|i| BatchOp::Delete { key: format!("{i:x}").into_bytes() })
        .collect();
    assert_eq!(copse::check_batch(&deletes), Ok(()));
    drop(deletes);
    // Puts whose encoding is exactly the byte limit: full values, then one that fills the rest.
    let per_put = |value: usize| 7 + 3 + value;
    let full = (WRITE_BATCH_BYTES_MAX - 4) / per_put(VALUE_BYTES_MAX);
    let mut puts: Vec<BatchOp> = (0..full)
        .map(|i| BatchOp::Put {
            key: format!("b{i:02}").into_bytes(),
            value: vec![0; VALUE_BYTES_MAX],
        })
        .collect();
    let rest = WRITE_BATCH_BYTES_MAX - 4 - full * per_put(VALUE_BYTES_MAX) - per_put(0);
    assert!(rest <= VALUE_BYTES_MAX);
    puts.push(BatchOp::Put { key: b"end".to_vec(), value: vec![0; rest] });
    assert_eq!(copse::encoded_batch_bytes(&puts), WRITE_BATCH_BYTES_MAX);
    assert_eq!(copse::check_batch(&puts), Ok(()));
    puts.push(BatchOp::Delete { key: b"x".to_vec() });
    assert!(copse::check_batch(&puts).is_err());
}

#[test]
fn scan_limit_over_the_maximum_is_refused_and_the_maximum_is_accepted() {
    let (disk, db) = populated(6, 2);
    assert_eq!(
        refused(&disk, &db, |db| db.scan(.., SCAN_ITEMS_MAX + 1)),
        Err(ReadError::Input(InputError::ScanLimitTooLarge {
            limit: SCAN_ITEMS_MAX + 1,
            max: SCAN_ITEMS_MAX
        }))
    );
    assert_eq!(
        refused(&disk, &db, |db| db.scan(b"a".to_vec()..b"z".to_vec(), usize::MAX)),
        Err(ReadError::Input(InputError::ScanLimitTooLarge {
            limit: usize::MAX,
            max: SCAN_ITEMS_MAX
        }))
    );
    assert_eq!(db.scan(.., SCAN_ITEMS_MAX).unwrap().len(), 4);
}

#[test]
fn largest_key_and_largest_value_are_accepted_and_read_back() {
    let disk = SimDisk::new(7);
    let db = open_sim(&disk, 2).unwrap();
    let key = vec![0xab; KEY_BYTES_MAX];
    let big = value(b"largest value", VALUE_BYTES_MAX);
    db.put(&key, &big).unwrap();
    db.put(b"small", b"s").unwrap();
    assert!(db.get(&key).unwrap() == Some(big.clone()), "largest item did not read back");
    let all = contents(&db);
    assert_eq!(all.len(), 2);
    assert!(all[1] == (key.clone(), big.clone()), "scan did not return the largest item");
    // The largest key also works as a scan bound and in a batch.
    let mut batch = WriteBatch::new();
    batch.put(key.clone(), b"small now".to_vec()).put(vec![0xac; KEY_BYTES_MAX], b"".to_vec());
    db.write_batch(batch).unwrap();
    assert_eq!(
        db.scan(key.clone()..=key.clone(), 10).unwrap(),
        vec![(key.clone(), b"small now".to_vec())]
    );
    db.put(&key, &big).unwrap();
    db.close().unwrap();
    drop(db);
    let db = open_sim(&disk, 2).unwrap();
    assert!(db.get(&key).unwrap() == Some(big), "largest item did not survive a reopen");
    assert_eq!(db.get(&[0xac; KEY_BYTES_MAX]).unwrap(), Some(Vec::new()));
    assert_eq!(db.stats().unwrap().items, 3);
}

#[test]
fn invalid_options_are_refused_before_anything_is_written() {
    let disk = SimDisk::new(8);
    for shards in [0, copse::limits::SHARDS_MAX + 1] {
        let result = open_sim(&disk, shards);
        assert!(
            matches!(result, Err(OpenError::ShardCountOutOfRange(n)) if n == shards),
            "{shards} shards: {:?}",
            result.err()
        );
    }
    for io_depth in [0, copse::limits::IO_DEPTH_MAX + 1] {
        let result = Db::open_with_storage(
            Arc::new(disk.storage(WriteDurability::Dsync)),
            Options { io_depth, ..options(1) },
        );
        assert!(
            matches!(result, Err(OpenError::InvalidOption(_))),
            "io_depth {io_depth}: {:?}",
            result.err()
        );
    }
    let result = Db::open_with_storage(
        Arc::new(disk.storage(WriteDurability::Dsync)),
        Options { create_if_missing: false, ..options(1) },
    );
    assert!(matches!(result, Err(OpenError::NotFound(_))), "{:?}", result.err());
    assert_eq!(disk.file_names(), Vec::<String>::new(), "a refused open created files");
}

#[test]
fn reopening_with_another_shard_count_is_refused_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().display().to_string();
    {
        let db = Db::open(dir.path(), options(2)).unwrap();
        for i in 0..50u32 {
            db.put(format!("key{i}").as_bytes(), &i.to_le_bytes()).unwrap();
        }
        db.close().unwrap();
    }
    let manifest = std::fs::read(dir.path().join("MANIFEST")).unwrap();
    for requested in [1u32, 3, 4] {
        let result = Db::open(dir.path(), options(requested as usize));
        match result {
            Err(OpenError::ShardCountMismatch { path: named, found: 2, requested: r })
                if r == requested && named == path => {}
            other => {
                panic!("{requested} shards: expected ShardCountMismatch, got {:?}", other.err())
            }
        }
    }
    assert_eq!(std::fs::read(dir.path().join("MANIFEST")).unwrap(), manifest);
    assert!(!dir.path().join("shard-002").exists(), "a refused open created a shard");
    let db = Db::open(dir.path(), options(2)).expect("the right shard count still opens");
    assert_eq!(db.stats().unwrap().items, 50);
    for i in 0..50u32 {
        assert_eq!(db.get(format!("key{i}").as_bytes()).unwrap(), Some(i.to_le_bytes().to_vec()));
    }
}

/// The first slab file of shard 0, and the disk image with the store closed.
fn closed_store_with_slabs(seed: u64, shards: usize) -> (SimDisk, String, Vec<KeyValue>) {
    let (disk, db) = populated(seed, shards);
    for i in 0..40u32 {
        db.put(format!("more{i}").as_bytes(), &value(b"more", 100 + i as usize * 37)).unwrap();
    }
    let expected = contents(&db);
    db.close().unwrap();
    drop(db);
    let slab = disk
        .file_names()
        .into_iter()
        .find(|name| name.starts_with("shard-000/class-") && name.ends_with(".slab"))
        .expect("shard 0 has a slab file");
    (disk, slab, expected)
}

#[test]
fn a_damaged_slab_header_is_refused_naming_the_file_and_changes_nothing() {
    let (disk, slab, expected) = closed_store_with_slabs(9, 2);
    let header = disk.read_file(&slab).unwrap()[..4096].to_vec();
    // Byte 0 is the magic; bytes 32..36 the header's crc32c; byte 12 the class id (caught by the
    // crc, as is any other header byte).
    for (offset, what) in [(0usize, "magic"), (33, "crc"), (12, "class id")] {
        disk.write_file_raw(&slab, offset as u64, &[header[offset] ^ 0x41]);
        let before = disk_image(&disk);
        match open_sim(&disk, 2) {
            Err(OpenError::CorruptSlabHeader { file, reason }) => {
                assert_eq!(file, slab, "damaged {what}: the error names another file ({reason})")
            }
            other => panic!("damaged {what}: expected CorruptSlabHeader, got {:?}", other.err()),
        }
        assert!(disk_image(&disk) == before, "damaged {what}: the refused open wrote to the disk");
        disk.write_file_raw(&slab, offset as u64, &header[offset..offset + 1]);
        let db = open_sim(&disk, 2).expect("the repaired store opens");
        assert!(contents(&db) == expected, "damaged {what}: contents changed");
        db.close().unwrap();
    }
}

#[test]
fn a_damaged_manifest_is_refused_and_changes_nothing() {
    let (disk, _, expected) = closed_store_with_slabs(10, 2);
    let manifest = disk.read_file("MANIFEST").unwrap()[..4096].to_vec();
    // Magic, version, shard count, crc.
    for offset in [0usize, 8, 12, 25] {
        disk.write_file_raw("MANIFEST", offset as u64, &[manifest[offset] ^ 0x10]);
        let before = disk_image(&disk);
        for shards in [2, 3] {
            let result = open_sim(&disk, shards);
            assert!(
                matches!(result, Err(OpenError::CorruptManifest(_))),
                "manifest byte {offset} damaged, {shards} shards: {:?}",
                result.err()
            );
        }
        assert!(disk_image(&disk) == before, "the refused open wrote to the disk");
        disk.write_file_raw("MANIFEST", offset as u64, &manifest[offset..offset + 1]);
    }
    // A blank manifest beside slab files is corruption, not a new store.
    disk.write_file_raw("MANIFEST", 0, &[0; 4096]);
    let before = disk_image(&disk);
    let result = open_sim(&disk, 2);
    assert!(
        matches!(result, Err(OpenError::CorruptManifest(_))),
        "blank manifest: {:?}",
        result.err()
    );
    assert!(disk_image(&disk) == before, "the refused open wrote to the disk");
    disk.write_file_raw("MANIFEST", 0, &manifest);
    let db = open_sim(&disk, 2).unwrap();
    assert!(contents(&db) == expected);
}

/// (Failed before commit 59e1bf6: only shard directories up to the requested count were looked at.)
#[test]
fn a_blank_manifest_beside_slabs_of_any_shard_is_refused() {
    let disk = SimDisk::new(11);
    let db = open_sim(&disk, 4).unwrap();
    // Keys of shard 3 only, so shards 0, 1 and 2 have no slab file.
    let keys: Vec<Vec<u8>> = (0..1000u32)
        .map(|i| format!("k{i}").into_bytes())
        .filter(|key| shard_of(key, 4) == 3)
        .take(10)
        .collect();
    for key in &keys {
        db.put(key, b"value").unwrap();
    }
    db.close().unwrap();
    drop(db);
    assert!(disk.file_names().iter().all(|name| !name.starts_with("shard-000/")));
    disk.write_file_raw("MANIFEST", 0, &[0; 4096]);
    let result = open_sim(&disk, 1);
    let accepted = result.is_ok();
    drop(result);
    // Had it been accepted, the store would now be a new, empty one-shard store: the keys of
    // shard 3 are unreachable, and the original count is refused from now on.
    let reopened = open_sim(&disk, 4);
    assert!(
        !accepted,
        "a blank manifest beside shard-003's slab files was taken for a new store; reopening \
         with the original 4 shards now gives {:?}",
        reopened.err()
    );
}

#[test]
fn a_slab_that_cannot_grow_refuses_the_write_without_poisoning() {
    let disk = SimDisk::new(12);
    let db = open_sim(&disk, 1).unwrap();
    db.put(b"small-0", b"").unwrap();
    // 100 KiB values: a class of 32-page slots, 7 of which fit the first 1 MiB of its file.
    let big = |i: u32| value(format!("big-{i}").as_bytes(), 100 * 1024);
    db.put(b"big-0", &big(0)).unwrap();
    disk.fail_nth(1, FaultOp::Grow, FaultError::NoSpace, true);
    let mut acknowledged = vec![0u32];
    let mut refused_at = None;
    for i in 1..20u32 {
        match db.put(format!("big-{i}").as_bytes(), &big(i)) {
            Ok(()) => acknowledged.push(i),
            Err(WriteError::NoSpace(DeviceError::NoSpace { .. })) => {
                refused_at = Some(i);
                break;
            }
            Err(other) => panic!("put big-{i}: expected NoSpace, got {other:?}"),
        }
    }
    let refused_at = refused_at.expect("the slab had to grow and could not");
    assert!(refused_at >= 5, "refused before the slab was full (at big-{refused_at})");
    let check = |db: &Db| {
        for &i in &acknowledged {
            assert!(db.get(format!("big-{i}").as_bytes()).unwrap() == Some(big(i)), "big-{i}");
        }
        assert_eq!(db.get(format!("big-{refused_at}").as_bytes()).unwrap(), None);
    };
    check(&db);
    assert_eq!(db.stats().unwrap().items, acknowledged.len() as u64 + 1);

    // Not poisoned: writes that need no growth go on.
    db.put(b"small-1", b"still writable").unwrap();
    // A batch that needs growth for one member is refused whole.
    let mut batch = WriteBatch::new();
    batch.put(b"small-0".to_vec(), b"changed".to_vec()).put(b"big-new".to_vec(), big(99));
    assert!(matches!(db.write_batch(batch), Err(WriteError::NoSpace(_))), "a batch needing growth");
    assert_eq!(db.get(b"small-0").unwrap(), Some(Vec::new()), "a refused batch changed a key");
    assert_eq!(db.get(b"big-new").unwrap(), None);
    // Deleting frees a slot that the next big put (the same key and value again) reuses
    // without growing (once the delete's own writes are durable: hence the flush).
    assert!(db.delete(b"big-0").unwrap());
    assert_eq!(db.get(b"big-0").unwrap(), None);
    db.flush().unwrap();
    db.put(b"big-0", &big(0)).unwrap();
    db.flush().unwrap();
    db.close().unwrap();
    drop(db);

    // A fresh storage of the same disk without the fault: growth works again.
    let disk = disk.restart();
    let db = open_sim(&disk, 1).unwrap();
    check(&db);
    for i in 20..30u32 {
        db.put(format!("big-{i}").as_bytes(), &big(i)).unwrap();
        assert!(db.get(format!("big-{i}").as_bytes()).unwrap() == Some(big(i)));
    }
    assert_eq!(db.stats().unwrap().items, acknowledged.len() as u64 + 2 + 10);
}

#[test]
fn a_failed_write_poisons_the_store_but_keeps_acknowledged_data() {
    let disk = SimDisk::new(13);
    let db = open_sim(&disk, 2).unwrap();
    let mut expected: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
    for i in 0..30u32 {
        let (key, val) =
            (format!("key{i}").into_bytes(), value(b"v1", 50 + 997 * i as usize % 9000));
        db.put(&key, &val).unwrap();
        expected.insert(key, val);
    }
    db.put(b"blob", &value(b"blob", 60_000)).unwrap();
    expected.insert(b"blob".to_vec(), value(b"blob", 60_000));
    db.flush().unwrap();

    // An update of the same size: its slab file exists, so the failed write is a data write
    // (a failed write of a new slab file's header is the next test's subject).
    let update = value(b"never written", expected[&b"key3"[..]].len());
    disk.fail_nth(1, FaultOp::Write, FaultError::NoSpace, false);
    let result = db.put(b"key3", &update);
    assert!(matches!(result, Err(WriteError::NoSpace(DeviceError::NoSpace { .. }))), "{result:?}");
    // Poisoned: every later write is refused, whatever its shard.
    for i in 0..8u32 {
        let key = format!("key{i}");
        assert_eq!(db.put(key.as_bytes(), b"x"), Err(WriteError::Poisoned), "put {key}");
        let new = format!("new{i}");
        assert_eq!(db.put(new.as_bytes(), b"x"), Err(WriteError::Poisoned), "put {new}");
        assert_eq!(db.delete(key.as_bytes()), Err(WriteError::Poisoned), "delete {key}");
    }
    let mut batch = WriteBatch::new();
    batch.put(b"key1".to_vec(), b"x".to_vec()).delete(b"key2".to_vec());
    assert_eq!(db.write_batch(batch), Err(WriteError::Poisoned));
    assert_eq!(db.flush(), Err(WriteError::Poisoned));
    // Reads keep working and see every acknowledged write, and not the failed one.
    let all: BTreeMap<_, _> = contents(&db).into_iter().collect();
    assert!(all == expected, "contents changed after the failed write");
    for (key, val) in &expected {
        assert_eq!(db.get(key).unwrap().as_ref(), Some(val));
    }
    assert_eq!(db.close(), Err(WriteError::Poisoned));
    drop(db);

    // After a reopen (no fault) the store works again, with the acknowledged data.
    let disk = disk.restart();
    let db = open_sim(&disk, 2).unwrap();
    let all: BTreeMap<_, _> = contents(&db).into_iter().collect();
    assert!(all == expected, "contents after reopen differ from the acknowledged writes");
    db.put(b"key3", b"written now").unwrap();
    assert_eq!(db.get(b"key3").unwrap(), Some(b"written now".to_vec()));
    db.close().unwrap();
}

/// Creating a slab file writes its header page; that write failing must neither lose data nor
/// leave a file that keeps the store from opening.
#[test]
fn a_failed_write_of_a_new_slab_header_refuses_the_write_and_loses_nothing() {
    let disk = SimDisk::new(18);
    let db = open_sim(&disk, 1).unwrap();
    db.put(b"small", b"s").unwrap();
    db.flush().unwrap();
    disk.fail_nth(1, FaultOp::Write, FaultError::Io, false);
    // A value of a class with no slab file yet.
    let result = db.put(b"first-of-its-class", &value(b"new class", 20_000));
    assert!(matches!(result, Err(WriteError::Device(DeviceError::Io { .. }))), "{result:?}");
    assert_eq!(db.get(b"first-of-its-class").unwrap(), None);
    assert_eq!(db.get(b"small").unwrap(), Some(b"s".to_vec()));
    // The next write of that class creates the file, or is refused because the store is poisoned.
    match db.put(b"second-of-its-class", &value(b"new class", 20_000)) {
        Ok(()) => {
            assert!(db.get(b"second-of-its-class").unwrap() == Some(value(b"new class", 20_000)))
        }
        Err(WriteError::Poisoned) => {}
        Err(other) => panic!("the retried write: {other:?}"),
    }
    let acknowledged = contents(&db);
    drop(db);
    let disk = disk.restart();
    let db = open_sim(&disk, 1).expect("the store opens after a failed slab header write");
    assert!(contents(&db) == acknowledged);
    db.put(b"third-of-its-class", &value(b"new class", 20_000)).unwrap();
    assert!(db.get(b"third-of-its-class").unwrap() == Some(value(b"new class", 20_000)));
}

#[test]
fn a_read_error_fails_that_read_only() {
    let (disk, db) = populated(14, 1);
    db.close().unwrap();
    drop(db);
    // Reopened: the page cache is empty, so every get reads the device.
    let db = open_sim(&disk, 1).unwrap();
    for key in [&b"beta"[..], b"gamma"] {
        disk.fail_nth(1, FaultOp::Read, FaultError::Io, false);
        let result = db.get(key);
        assert!(
            matches!(result, Err(ReadError::Device(DeviceError::Io { .. }))),
            "get {key:?}: expected an I/O error, got {result:?}"
        );
        let again = db.get(key).unwrap().expect("the item is still there");
        assert!(again.starts_with(key), "get {key:?} after the failed read");
    }
    db.close().unwrap();
    drop(db);
    let db = open_sim(&disk, 1).unwrap();
    disk.fail_nth(1, FaultOp::Read, FaultError::Io, false);
    let result = db.scan(.., 100);
    assert!(matches!(result, Err(ReadError::Device(DeviceError::Io { .. }))), "scan: {result:?}");
    assert_eq!(db.scan(.., 100).unwrap().len(), 4);
    // A failed read does not poison the store.
    db.put(b"delta", b"4").unwrap();
    assert_eq!(db.get(b"delta").unwrap(), Some(b"4".to_vec()));
}

/// The file and offset of the only copy of `needle` on the disk.
fn locate(disk: &SimDisk, needle: &[u8]) -> (String, usize) {
    let mut found = Vec::new();
    for name in disk.file_names() {
        let bytes = disk.read_file(&name).unwrap();
        found.extend(
            bytes
                .windows(needle.len())
                .enumerate()
                .filter(|(_, w)| *w == needle)
                .map(|(at, _)| (name.clone(), at)),
        );
    }
    assert_eq!(found.len(), 1, "expected one copy of the value on the disk: {found:?}");
    found.pop().unwrap()
}

#[test]
fn a_flipped_bit_in_a_stored_item_is_reported_as_corrupt_never_returned() {
    let disk = SimDisk::new(15);
    let db = open_sim(&disk, 1).unwrap();
    let small = value(b"victim in a shared page", 300);
    let large = value(b"victim spanning pages", 50_000);
    db.put(b"small-victim", &small).unwrap();
    db.put(b"neighbour", &value(b"neighbour", 300)).unwrap();
    db.put(b"large-victim", &large).unwrap();
    db.close().unwrap();
    drop(db);
    // Reopened, so nothing is cached: the gets read the flipped bytes from the device.
    let db = open_sim(&disk, 1).unwrap();
    for (key, val, bit) in [(&b"small-victim"[..], &small, 3u8), (b"large-victim", &large, 6)] {
        let (file, at) = locate(&disk, &val[..24]);
        disk.flip_bit(&file, (at + val.len() / 2) as u64, bit);
        for attempt in 0..2 {
            let result = db.get(key);
            assert!(
                matches!(result, Err(ReadError::Corrupt { shard: 0, .. })),
                "get {key:?} (attempt {attempt}): expected Corrupt, got {:?}",
                result.map(|v| v.map(|v| v.len()))
            );
        }
    }
    let result = db.scan(.., 10);
    assert!(matches!(result, Err(ReadError::Corrupt { .. })), "scan over corrupt items");
    assert_eq!(db.get(b"neighbour").unwrap(), Some(value(b"neighbour", 300)));
    assert_eq!(db.scan(b"n".to_vec()..b"o".to_vec(), 10).unwrap().len(), 1);
    // A corrupt item can be overwritten.
    db.put(b"small-victim", b"fresh").unwrap();
    assert_eq!(db.get(b"small-victim").unwrap(), Some(b"fresh".to_vec()));
}

#[test]
fn a_flipped_bit_found_at_recovery_drops_the_item_and_never_returns_it() {
    let disk = SimDisk::new(16);
    let db = open_sim(&disk, 1).unwrap();
    let val = value(b"only copy", 2_000);
    db.put(b"victim", &val).unwrap();
    db.put(b"other", b"fine").unwrap();
    db.close().unwrap();
    drop(db);
    let (file, at) = locate(&disk, &val[..24]);
    disk.flip_bit(&file, (at + 1000) as u64, 0);
    let db = open_sim(&disk, 1).unwrap();
    let stats = db.stats().unwrap();
    assert_eq!(stats.shards[0].recovery.torn_or_corrupt, 1, "recovery must count the corrupt slot");
    let result = db.get(b"victim");
    assert!(
        matches!(result, Ok(None) | Err(ReadError::Corrupt { .. })),
        "got {:?}",
        result.map(|v| v.map(|v| v.len()))
    );
    assert_eq!(db.get(b"other").unwrap(), Some(b"fine".to_vec()));
}

/// The offsets of the tombstones of `key` on the disk (copies of the key whose record header,
/// 32 bytes before it, has kind 2).
fn locate_tombstones(disk: &SimDisk, key: &[u8]) -> Vec<(String, usize)> {
    let mut found = Vec::new();
    for name in disk.file_names() {
        let bytes = disk.read_file(&name).unwrap();
        for (at, window) in bytes.windows(key.len()).enumerate() {
            if window == key && at >= 32 && bytes[at - 32] == 2 {
                found.push((name.clone(), at));
            }
        }
    }
    found
}

/// Where a bit is flipped in the newest record of a key.
#[derive(Clone, Copy, Debug)]
enum FlipIn {
    Value,
    Key,
    /// The record's crc32c (header bytes 24..28).
    Checksum,
}

/// Writes `key` twice (or once, then deletes it), closes the store, flips one bit of the newest
/// record (the second put, or the tombstone), reopens, and returns what `get` answers, the older
/// version for comparison, and the item count.
fn get_after_flip_in_newest(
    seed: u64,
    delete: bool,
    flip: FlipIn,
) -> (Result<Option<Vec<u8>>, ReadError>, Vec<u8>, u64) {
    let key: &[u8] = if delete { b"deleted" } else { b"updated" };
    let disk = SimDisk::new(seed);
    let db = open_sim(&disk, 1).unwrap();
    let (older, newer) = (value(b"the older version", 500), value(b"the newer version", 500));
    db.put(key, &older).unwrap();
    if delete {
        // The tombstone must be kept while the stale copy of the older version remains.
        assert!(db.delete(key).unwrap());
    } else {
        db.put(key, &newer).unwrap();
    }
    db.close().unwrap();
    drop(db);
    // (The older copy may already be erased; then nothing can come back.)
    // The newest record's key: before its value, or in the tombstone. A tombstone may be gone
    // too, once no older copy needs it; then there is nothing to flip.
    let target = if delete {
        let mut tombstones = locate_tombstones(&disk, key);
        assert!(tombstones.len() <= 1, "tombstones of {key:?}: {tombstones:?}");
        tombstones.pop()
    } else {
        let (file, value_at) = locate(&disk, &newer[..24]);
        Some((file, value_at - key.len()))
    };
    if let Some((file, key_at)) = target {
        let at = match flip {
            FlipIn::Value => {
                assert!(!delete, "a tombstone has no value");
                key_at + key.len() + 250
            }
            FlipIn::Key => key_at + 1,
            FlipIn::Checksum => key_at - 32 + 25,
        };
        disk.flip_bit(&file, at as u64, 2);
    }
    let db = open_sim(&disk, 1).unwrap();
    let items = db.stats().unwrap().items;
    (db.get(key), older, items)
}

/// Bit rot in the newest record of a key never brings back an older version, with one documented
/// exception (docs/durability.md): rot inside the key bytes of an updated key's newest record
/// leaves no way to tell whose record it was, so the older copy is used. Even then recovery
/// must not invent a key from the damaged bytes, and the damage is counted.
#[test]
fn a_corrupt_newest_record_never_resurrects_an_older_version() {
    let mut wrong = Vec::new();
    // (delete, where the bit flips, whether the older version may come back)
    let scenarios = [
        (false, FlipIn::Value, false),
        (false, FlipIn::Key, true),
        (false, FlipIn::Checksum, false),
        (true, FlipIn::Key, false),
        (true, FlipIn::Checksum, false),
    ];
    for (seed, (delete, flip, older_allowed)) in (17..).zip(scenarios) {
        let what = format!(
            "{} with a bit flipped in its {flip:?}",
            if delete { "tombstone" } else { "update" }
        );
        let (got, older, items) = get_after_flip_in_newest(seed, delete, flip);
        match got {
            Ok(Some(got)) if got == older => {
                if !older_allowed {
                    wrong.push(format!("{what}: the older version came back"))
                }
            }
            Ok(None) | Err(ReadError::Corrupt { .. }) => {}
            other => panic!("{what}: {:?}", other.map(|v| v.map(|v| v.len()))),
        }
        // One key was ever written: recovery must not invent another from damaged bytes.
        if items > 1 {
            wrong.push(format!("{what}: {items} items after recovery, one key was ever written"));
        }
    }
    assert!(wrong.is_empty(), "after a corrupt newest record: {wrong:#?}");
}

#[test]
fn a_directory_in_use_is_refused_with_locked() {
    let dir = tempfile::tempdir().unwrap();
    let first = Db::open(dir.path(), options(2)).unwrap();
    first.put(b"key", b"value").unwrap();
    match Db::open(dir.path(), options(2)) {
        Err(OpenError::Locked(path)) => assert_eq!(path, dir.path().display().to_string()),
        other => panic!("expected Locked, got {:?}", other.err()),
    }
    // The first handle is unaffected, and the lock goes with it.
    assert_eq!(first.get(b"key").unwrap(), Some(b"value".to_vec()));
    first.close().unwrap();
    let second = Db::open(dir.path(), options(2)).expect("opens once the first is closed");
    assert_eq!(second.get(b"key").unwrap(), Some(b"value".to_vec()));
    drop(first);
    assert!(matches!(Db::open(dir.path(), options(2)), Err(OpenError::Locked(_))));
}
