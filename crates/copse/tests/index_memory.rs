//! The index's reported memory (`copse stats`: index bytes per item) is an estimate; this checks
//! it against what the allocator actually hands out, so the figure cannot drift into fiction.
//! The engine's `Index` is the `CompactIndex`; the `BTreeIndex` it replaced is checked too, as
//! `examples/index_bench.rs` reports its figure beside the compact one.

use copse::alloc_count::{allocated_bytes, CountingAllocator};
use copse::engine::native::format::Loc;
use copse::engine::native::index::BTreeIndex;
use copse::engine::native::index::CompactIndex;

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator;

/// The count is process-wide: tests that measure it take turns.
static MEASURING: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// `items` distinct keys of `key_bytes` bytes, in hashed order, shaped like YCSB's.
fn ycsb_like_keys(key_bytes: usize, items: u64) -> Vec<Vec<u8>> {
    (0..items)
        .map(|i| {
            let mut key = format!("user{:020}", i.wrapping_mul(0x9E37_79B9_7F4A_7C15)).into_bytes();
            key.resize(key_bytes, b'x');
            key
        })
        .collect()
}

fn measure(key_bytes: usize, items: u64) -> (f64, f64) {
    let keys = ycsb_like_keys(key_bytes, items);
    let before = allocated_bytes();
    let mut index = BTreeIndex::default();
    for (i, key) in keys.iter().enumerate() {
        index.insert(key, Loc::new(10, i as u64, 0), i as u64);
    }
    let measured = (allocated_bytes() - before) as f64 / items as f64;
    let estimated = index.memory_bytes() as f64 / items as f64;
    assert_eq!(index.len() as u64, items);
    (measured, estimated)
}

/// The same for the compact index, also after removing half the keys (blocks merge, the slot
/// table shrinks or keeps tombstones).
fn measure_compact(key_bytes: usize, items: u64) -> [(f64, f64); 2] {
    let keys = ycsb_like_keys(key_bytes, items);
    let before = allocated_bytes();
    let mut index = CompactIndex::default();
    for (i, key) in keys.iter().enumerate() {
        index.insert(key, Loc::new(10, i as u64, 0), i as u64);
    }
    let per_item = |index: &CompactIndex| {
        let measured = (allocated_bytes() - before) as f64;
        (measured / index.len() as f64, index.memory_bytes() as f64 / index.len() as f64)
    };
    let full = per_item(&index);
    for key in keys.iter().step_by(2) {
        assert!(index.remove(key).is_some());
    }
    assert_eq!(index.len() as u64, items / 2);
    [full, per_item(&index)]
}

#[test]
fn btree_index_memory_estimate_is_within_a_quarter_of_the_allocators_count() {
    let _turn = MEASURING.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    for key_bytes in [16, 24, 64, 200] {
        let (measured, estimated) = measure(key_bytes, 200_000);
        let ratio = estimated / measured;
        println!(
            "key {key_bytes} B: measured {measured:.1} B/item, estimated {estimated:.1} B/item"
        );
        assert!(
            (0.75..=1.25).contains(&ratio),
            "key {key_bytes} B: estimate {estimated:.1} vs measured {measured:.1} B/item"
        );
    }
}

#[test]
fn compact_index_memory_is_within_a_tenth_of_the_allocators_count() {
    let _turn = MEASURING.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    for key_bytes in [16, 24, 64, 200] {
        for (when, (measured, estimated)) in
            ["full", "half removed"].into_iter().zip(measure_compact(key_bytes, 200_000))
        {
            let ratio = estimated / measured;
            println!(
                "compact, key {key_bytes} B, {when}: measured {measured:.1} B/item, \
                 estimated {estimated:.1} B/item"
            );
            assert!(
                (0.9..=1.1).contains(&ratio),
                "key {key_bytes} B, {when}: estimate {estimated:.1} vs measured {measured:.1} B/item"
            );
        }
    }
}
