//! End-to-end behaviour of the API on the real device (io_uring, O_DIRECT) and the simulated one.

mod common;

use std::sync::Arc;

use copse::device::sim::SimDisk;
use copse::{Db, WriteBatch, WriteDurability};

fn exercise(db: &Db) {
    db.put(b"alpha", b"1").unwrap();
    db.put(b"beta", b"2").unwrap();
    db.put(b"alpha", b"one").unwrap();
    assert_eq!(db.get(b"alpha").unwrap().as_deref(), Some(&b"one"[..]));
    assert_eq!(db.get(b"beta").unwrap().as_deref(), Some(&b"2"[..]));
    assert_eq!(db.get(b"gamma").unwrap(), None);
    assert!(db.delete(b"beta").unwrap());
    assert!(!db.delete(b"beta").unwrap());
    assert_eq!(db.get(b"beta").unwrap(), None);
    let big = vec![7u8; 100_000];
    db.put(b"big", &big).unwrap();
    assert_eq!(db.get(b"big").unwrap().unwrap(), big);
    let mut batch = WriteBatch::new();
    batch
        .put(b"k1".to_vec(), b"v1".to_vec())
        .put(b"k2".to_vec(), b"v2".to_vec())
        .delete(b"alpha".to_vec());
    db.write_batch(batch).unwrap();
    assert_eq!(db.get(b"alpha").unwrap(), None);
    let all = db.scan(.., 100).unwrap();
    let keys: Vec<_> = all.iter().map(|(k, _)| k.clone()).collect();
    assert_eq!(keys, vec![b"big".to_vec(), b"k1".to_vec(), b"k2".to_vec()]);
}

#[test]
fn real_device_round_trip_survives_reopen() {
    let dir = tempfile::tempdir().unwrap();
    {
        let db = Db::open(dir.path(), common::options(2)).unwrap();
        exercise(&db);
        db.close().unwrap();
    }
    let db = Db::open(dir.path(), common::options(2)).unwrap();
    assert_eq!(db.get(b"k1").unwrap().as_deref(), Some(&b"v1"[..]));
    assert_eq!(db.get(b"big").unwrap().unwrap(), vec![7u8; 100_000]);
    assert_eq!(db.get(b"alpha").unwrap(), None);
    assert_eq!(db.stats().unwrap().items, 3);
}

#[test]
fn simulated_device_round_trip_survives_reopen() {
    let disk = SimDisk::new(7);
    {
        let db = Db::open_with_storage(
            Arc::new(disk.storage(WriteDurability::Dsync)),
            common::options(3),
        )
        .unwrap();
        exercise(&db);
        db.close().unwrap();
    }
    let db =
        Db::open_with_storage(Arc::new(disk.storage(WriteDurability::Dsync)), common::options(3))
            .unwrap();
    assert_eq!(db.get(b"k2").unwrap().as_deref(), Some(&b"v2"[..]));
    assert_eq!(db.scan(.., 10).unwrap().len(), 3);
}
