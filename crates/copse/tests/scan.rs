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

/// The number `key` wrote into a key.
fn number_of(key: &[u8]) -> u32 {
    std::str::from_utf8(&key[3..]).unwrap().parse().unwrap()
}

/// A scan's items are in key order with no key twice, and hold every one of `stable` (keys
/// present throughout) up to the last key returned.
fn assert_ordered_and_complete(
    items: &[(Vec<u8>, Vec<u8>)],
    stable: impl Iterator<Item = Vec<u8>>,
) {
    let returned: Vec<&Vec<u8>> = items.iter().map(|(k, _)| k).collect();
    assert!(returned.windows(2).all(|pair| pair[0] < pair[1]), "ordered, no duplicates");
    let last = returned.last().unwrap().to_vec();
    for stable in stable.filter(|k| *k <= last) {
        assert!(returned.contains(&&stable), "stable key {stable:?} skipped");
    }
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
        assert_ordered_and_complete(&items, (0..ITEMS).step_by(2).map(key));
        for (k, v) in &items {
            assert_eq!(v, format!("value{}", number_of(k)).as_bytes());
        }
    }
    deleter.join().unwrap();
    let items = db.scan(.., ITEMS as usize).unwrap();
    assert_eq!(items.len(), ITEMS as usize / 2, "only the even keys remain");
}

/// Keys written between a scan's two steps join the shard's range read: a scan stays ordered,
/// has no key twice, holds at most `limit` items and skips no key that was there all along.
#[test]
fn scans_stay_full_and_ordered_while_keys_are_inserted() {
    const STABLE: u32 = 1000;
    const LIMIT: usize = 300;
    let dir = tempfile::tempdir().unwrap();
    let db = Db::open(dir.path(), common::options(3)).unwrap();
    for i in 0..STABLE {
        db.put(&key(2 * i), b"stable").unwrap();
    }
    let done = Arc::new(AtomicBool::new(false));
    let inserter = {
        let (db, done) = (db.clone(), done.clone());
        std::thread::spawn(move || {
            // Odd keys arrive, front to back, between the stable ones.
            for i in 0..STABLE {
                db.put(&key(2 * i + 1), b"new").unwrap();
            }
            done.store(true, Ordering::SeqCst);
        })
    };
    let mut scans = 0;
    while !done.load(Ordering::SeqCst) || scans < 5 {
        let items = db.scan(.., LIMIT).unwrap();
        scans += 1;
        assert_eq!(items.len(), LIMIT, "a scan of a range of 1,000 or more keys is full");
        assert_ordered_and_complete(&items, (0..STABLE).map(|i| key(2 * i)));
    }
    inserter.join().unwrap();
    assert_eq!(db.scan(.., 3 * STABLE as usize).unwrap().len(), 2 * STABLE as usize);
}

/// Options for the clustering tests: append placement (clustering applies to appended classes).
fn appended(shards: usize) -> copse::Options {
    copse::Options { placement: copse::PlacementSetting::Append, ..common::options(shards) }
}

/// Keys written in an order far from key order, so that neighbours in key order lie on
/// different pages.
fn scattered_order(items: u32) -> impl Iterator<Item = u32> {
    (0..items).map(move |n| (n as u64 * 2503 % items as u64) as u32)
}

fn cluster_moves(db: &Db) -> u64 {
    let stats = db.stats().unwrap();
    stats
        .shards
        .iter()
        .flat_map(|shard| shard.classes.iter())
        .map(|class| class.append.cluster_slots_moved)
        .sum()
}

/// Clustering (docs/placement.md): a scan that finds its items scattered has them rewritten side
/// by side, so the same scan after a restart (cold cache) reads a few runs of consecutive pages,
/// one I/O each, instead of one page per item, and every value survives the moves and the
/// restart. Risks: moves that never happen (or never pay), a restart that puts the old copies
/// back, reads not coalesced, and a moved item read back wrong or lost at reopen.
#[test]
fn a_scan_clusters_scattered_items_so_the_next_scan_reads_fewer_pages() {
    const ITEMS: u32 = 4000;
    const LIMIT: usize = 200;
    let value = |i: u32| common::make_value(&format!("v{i}"), 1000);
    let dir = tempfile::tempdir().unwrap();
    {
        let db = Db::open(dir.path(), appended(1)).unwrap();
        for i in scattered_order(ITEMS) {
            db.put(&key(i), &value(i)).unwrap();
        }
        db.close().unwrap();
    }
    let scan_and_count_reads = |db: &Db| {
        let before = db.stats().unwrap().device.reads;
        let items = db.scan(key(1000).., LIMIT).unwrap();
        let reads = db.stats().unwrap().device.reads - before;
        assert_eq!(items.len(), LIMIT);
        for ((k, v), i) in items.iter().zip(1000u32..) {
            assert_eq!((k, v), (&key(i), &value(i)), "item {i}");
        }
        reads
    };
    let reads_scattered = {
        let db = Db::open(dir.path(), appended(1)).unwrap();
        let reads = scan_and_count_reads(&db);
        db.flush().unwrap();
        assert!(
            cluster_moves(&db) >= LIMIT as u64 / 2,
            "{} items moved after a scan of {LIMIT} scattered items",
            cluster_moves(&db)
        );
        db.close().unwrap();
        reads
    };
    let db = Db::open(dir.path(), appended(1)).unwrap();
    let reads_clustered = scan_and_count_reads(&db);
    // 200 items of ~1 KiB: about 190 pages scattered; side by side, 54 consecutive pages, which
    // the scan reads with one I/O per run (`READ_PAGES_PER_IO_MAX` pages at most).
    assert!(
        reads_scattered >= 150 && reads_clustered <= 3,
        "the scan made {reads_scattered} reads scattered and {reads_clustered} clustered"
    );
    for i in 0..ITEMS {
        assert_eq!(db.get(&key(i)).unwrap(), Some(value(i)), "key {i} after the moves");
    }
}

/// Clustering races writes: writers rewrite keys while scans of the same ranges move them. A
/// move must never land over a newer version (it carries the version the scan read, and is
/// applied only if that is still the key's newest once durable), before or after a reopen.
#[test]
fn clustering_moves_never_bring_back_an_older_version() {
    const ITEMS: u32 = 3000;
    const WRITERS: u32 = 2;
    const REWRITES_EACH: u32 = 3000;
    let dir = tempfile::tempdir().unwrap();
    let db = Db::open(dir.path(), appended(2)).unwrap();
    for i in scattered_order(ITEMS) {
        db.put(&key(i), &common::make_value(&format!("k{i}v0"), 700)).unwrap();
    }
    let done = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = (0..WRITERS)
        .map(|writer| {
            let db = db.clone();
            std::thread::spawn(move || {
                // Each writer owns the keys of its residue, so it knows each key's last version.
                let mut last = std::collections::HashMap::new();
                let mut x = 0x2545_f491_4f6c_dd1du64 ^ writer as u64;
                for version in 1..=REWRITES_EACH {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let i = (x % (ITEMS / WRITERS) as u64) as u32 * WRITERS + writer;
                    let value = common::make_value(&format!("k{i}v{version}"), 700);
                    db.put(&key(i), &value).unwrap();
                    last.insert(i, value);
                }
                last
            })
        })
        .collect();
    let scanners: Vec<_> = (0..2u32)
        .map(|scanner| {
            let (db, done) = (db.clone(), done.clone());
            std::thread::spawn(move || {
                let mut start = scanner * 1500;
                while !done.load(Ordering::SeqCst) {
                    for (k, v) in db.scan(key(start).., 120).unwrap() {
                        let tag = format!("k{}v", number_of(&k));
                        assert!(v.starts_with(tag.as_bytes()), "{k:?} holds another key's value");
                    }
                    start = (start + 97) % ITEMS;
                }
            })
        })
        .collect();
    let mut last = std::collections::HashMap::new();
    for writer in writers {
        last.extend(writer.join().unwrap());
    }
    done.store(true, Ordering::SeqCst);
    for scanner in scanners {
        scanner.join().unwrap();
    }
    db.flush().unwrap();
    let moved = cluster_moves(&db);
    assert!(moved > 0, "no scan clustered anything: the test no longer races moves");
    let check = |db: &Db, when: &str| {
        for (i, value) in &last {
            let read = db.get(&key(*i)).unwrap();
            assert!(
                read.as_deref() == Some(value.as_slice()),
                "key {i} {when}: {} where the last write was {}",
                common::describe_value(read.as_deref()),
                common::describe_value(Some(value))
            );
        }
    };
    check(&db, "after the race");
    db.close().unwrap();
    let db = Db::open(dir.path(), appended(2)).unwrap();
    check(&db, "after a reopen");
    eprintln!("{moved} clustering moves raced {} rewrites", WRITERS * REWRITES_EACH);
}
