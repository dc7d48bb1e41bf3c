//! Scans across shards: key order, no duplicates, every item present, and only the items the
//! merge needs read from the device (the two-step scan of `router/scan.rs`). Risks: a scan that
//! reads `shards x limit` items to return `limit`, and a concurrent delete that shortens a scan
//! or makes it skip a key that never went away.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use copse::Db;

fn key(i: u32) -> Vec<u8> {
    format!("key{i:06}").into_bytes()
}

#[test]
fn a_scan_reads_only_the_items_it_returns() {
    const ITEMS: u32 = 6000;
    const LIMIT: usize = 100;
    let dir = tempfile::tempdir().unwrap();
    {
        let db = Db::open(dir.path(), common::options(4)).unwrap();
        // One item per page (3 KiB values): a read of an uncached item is one device read.
        for i in 0..ITEMS {
            db.put(&key(i), &vec![(i % 251) as u8; 3000]).unwrap();
        }
        db.close().unwrap();
    }
    let db = Db::open(dir.path(), common::options(4)).unwrap();
    let before = db.stats().unwrap().device.reads;
    let items = db.scan(key(1000).., LIMIT).unwrap();
    let reads = db.stats().unwrap().device.reads - before;
    let keys: Vec<Vec<u8>> = items.iter().map(|(k, _)| k.clone()).collect();
    let expected: Vec<Vec<u8>> = (1000..1000 + LIMIT as u32).map(key).collect();
    assert_eq!(keys, expected, "the first {LIMIT} keys from key001000, in order");
    for (i, (_, value)) in (1000u32..).zip(&items) {
        assert_eq!(value, &vec![(i % 251) as u8; 3000]);
    }
    // Four shards each returning LIMIT items would read ~4 x LIMIT pages.
    assert!(reads <= LIMIT as u64 + 4, "{reads} device reads for a scan of {LIMIT} items");
}

#[test]
fn scans_stay_full_and_ordered_while_keys_are_deleted() {
    const ITEMS: u32 = 2000;
    const LIMIT: usize = 300;
    let dir = tempfile::tempdir().unwrap();
    let db = Db::open(dir.path(), common::options(2)).unwrap();
    for i in 0..ITEMS {
        db.put(&key(i), format!("value{i}").as_bytes()).unwrap();
    }
    let done = Arc::new(AtomicBool::new(false));
    let deleter = {
        let (db, done) = (db.clone(), done.clone());
        std::thread::spawn(move || {
            // Odd keys go away, front to back, while the scans run.
            for i in (1..ITEMS).step_by(2) {
                db.delete(&key(i)).unwrap();
            }
            done.store(true, Ordering::SeqCst);
        })
    };
    let mut scans = 0;
    while !done.load(Ordering::SeqCst) || scans < 5 {
        let items = db.scan(.., LIMIT).unwrap();
        scans += 1;
        assert_eq!(items.len(), LIMIT, "1,000 even keys never go away: a scan is never short");
        let last = items.last().unwrap().0.clone();
        let returned: Vec<&Vec<u8>> = items.iter().map(|(k, _)| k).collect();
        assert!(returned.windows(2).all(|pair| pair[0] < pair[1]), "ordered, no duplicates");
        let evens_up_to_last: Vec<Vec<u8>> =
            (0..ITEMS).step_by(2).map(key).filter(|k| *k <= last).collect();
        for even in &evens_up_to_last {
            assert!(returned.contains(&even), "stable key {even:?} skipped");
        }
        for (k, v) in &items {
            let i: u32 = std::str::from_utf8(&k[3..]).unwrap().parse().unwrap();
            assert_eq!(v, format!("value{i}").as_bytes());
        }
    }
    deleter.join().unwrap();
    let items = db.scan(.., ITEMS as usize).unwrap();
    assert_eq!(items.len(), ITEMS as usize / 2, "only the even keys remain");
}
