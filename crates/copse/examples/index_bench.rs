//! Measures the per-shard index options side by side (docs/index-design.md): heap bytes per
//! item (counted by a counting allocator, and as each index reports it), ns per insert, get hit,
//! get miss, range of 100 and remove, for the B-tree index (`BTreeIndex`, the engine's index before issue 22) and the `CompactIndex`
//! (the engine's `Index` since).
//!
//! `cargo run --release -p copse --example index_bench -- --items 1000000,5000000`
//!
//! Key sets: `ycsb` (YCSB's `user` + the FNV-64 hash of the item number in decimal, 23-24 B, in
//! hashed order) and `redis` (copse-server's meta items: `m`, the 8-byte scan hash, the Redis key
//! `key:NNNNNNNNNNNN`, the type byte: 26 B). Single-threaded; lookups in a shuffled order.

use std::hint::black_box;
use std::ops::Bound;
use std::time::Instant;

use copse::alloc_count::{allocated_bytes, CountingAllocator};
use copse::engine::native::format::Loc;
use copse::engine::native::index::CompactIndex;
use copse::engine::native::index::{BTreeIndex, Entry};

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator;

/// The operations both indexes offer, so one driver measures either.
trait Bench: Sized {
    fn name(&self) -> String;
    fn insert(&mut self, key: &[u8], loc: Loc, seq: u64) -> Option<Entry>;
    fn entry(&self, key: &[u8]) -> Option<Entry>;
    fn remove(&mut self, key: &[u8]) -> Option<Loc>;
    fn range(&self, start: &[u8], limit: usize) -> usize;
    fn memory_bytes(&self) -> u64;
    /// ns per hit looked up in batches of 16 (as one lookup each where the index has no batch).
    fn batch_hit_ns(&self, keys: &Keys, order: &[usize]) -> f64 {
        let start = Instant::now();
        for &i in order {
            assert!(black_box(self.entry(keys.get(i))).is_some());
        }
        ns_per(start, order.len())
    }
}

struct BTree(BTreeIndex);

/// The index operations the benchmark times, forwarded to the index in field 0.
macro_rules! forward_bench_ops {
    () => {
        fn insert(&mut self, key: &[u8], loc: Loc, seq: u64) -> Option<Entry> {
            self.0.insert(key, loc, seq)
        }
        fn entry(&self, key: &[u8]) -> Option<Entry> {
            self.0.entry(key)
        }
        fn remove(&mut self, key: &[u8]) -> Option<Loc> {
            self.0.remove(key)
        }
        fn range(&self, start: &[u8], limit: usize) -> usize {
            self.0.range(Bound::Included(start), Bound::Unbounded, limit).len()
        }
        fn memory_bytes(&self) -> u64 {
            self.0.memory_bytes()
        }
    };
}

impl Bench for BTree {
    fn name(&self) -> String {
        "btree".into()
    }
    forward_bench_ops!();
}

struct Compact(CompactIndex, usize);

impl Bench for Compact {
    fn name(&self) -> String {
        format!("compact/{}", self.1)
    }
    forward_bench_ops!();
    fn batch_hit_ns(&self, keys: &Keys, order: &[usize]) -> f64 {
        let mut out = Vec::with_capacity(16);
        let start = Instant::now();
        for chunk in order.chunks(16) {
            let batch: Vec<&[u8]> = chunk.iter().map(|&i| keys.get(i)).collect();
            out.clear();
            self.0.entries(&batch, &mut out);
            assert!(black_box(&out).iter().all(Option::is_some));
        }
        ns_per(start, order.len())
    }
}

/// Keys in one flat buffer, so the bench's own key storage is one allocation.
struct Keys {
    bytes: Vec<u8>,
    ends: Vec<usize>,
}

impl Keys {
    fn get(&self, i: usize) -> &[u8] {
        let start = if i == 0 { 0 } else { self.ends[i - 1] };
        &self.bytes[start..self.ends[i]]
    }
    fn len(&self) -> usize {
        self.ends.len()
    }
}

fn fnv64(mut value: u64) -> u64 {
    let mut hash: u64 = 0xCBF2_9CE4_8422_2325;
    for _ in 0..8 {
        hash ^= value & 0xFF;
        hash = hash.wrapping_mul(0x0100_0000_01B3);
        value >>= 8;
    }
    hash
}

fn make_keys(set: &str, from: u64, count: u64) -> Keys {
    let mut keys = Keys { bytes: Vec::new(), ends: Vec::with_capacity(count as usize) };
    for i in from..from + count {
        match set {
            "ycsb" => keys.bytes.extend_from_slice(format!("user{}", fnv64(i) >> 1).as_bytes()),
            "redis" => {
                let name = format!("key:{i:012}");
                let hash = (xxhash_rust::xxh3::xxh3_64(name.as_bytes()) >> 1) + 1;
                keys.bytes.push(b'm');
                keys.bytes.extend_from_slice(&hash.to_be_bytes());
                keys.bytes.extend_from_slice(name.as_bytes());
                keys.bytes.push(b's');
            }
            _ => panic!("unknown key set {set}"),
        }
        keys.ends.push(keys.bytes.len());
    }
    keys
}

fn shuffled(count: usize, seed: u64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..count).collect();
    let mut state = seed;
    for i in (1..count).rev() {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        order.swap(i, (z % (i as u64 + 1)) as usize);
    }
    order
}

fn ns_per(start: Instant, ops: usize) -> f64 {
    start.elapsed().as_nanos() as f64 / ops as f64
}

fn run<B: Bench>(mut index: B, set: &str, keys: &Keys, misses: &Keys) {
    let items = keys.len();
    let before = allocated_bytes();
    let start = Instant::now();
    for i in 0..items {
        let loc = Loc::new((i % 8) as u8 + 4, (i / 8) as u64, 0);
        black_box(index.insert(keys.get(i), loc, i as u64 + 1));
    }
    let insert_ns = ns_per(start, items);
    let heap = (allocated_bytes() - before) as f64 / items as f64;
    let reported = index.memory_bytes() as f64 / items as f64;

    let lookups = items.min(1_000_000);
    let order = shuffled(items, 7);
    let start = Instant::now();
    for &i in &order[..lookups] {
        assert!(black_box(index.entry(keys.get(i))).is_some());
    }
    let hit_ns = ns_per(start, lookups);
    // Hits looked up 16 at a time (a round's GETs), where the index can overlap them.
    let batch_ns = index.batch_hit_ns(keys, &order[..lookups]);
    let start = Instant::now();
    for i in 0..lookups.min(misses.len()) {
        assert!(black_box(index.entry(misses.get(i))).is_none());
    }
    let miss_ns = ns_per(start, lookups.min(misses.len()));

    let ranges = 100_000;
    let start = Instant::now();
    for &i in &order[..ranges.min(items)] {
        black_box(index.range(keys.get(i), 100));
    }
    let range_ns = ns_per(start, ranges.min(items));

    let updates = lookups;
    let start = Instant::now();
    for &i in &order[..updates] {
        let loc = Loc::new((i % 8) as u8 + 4, (i / 8) as u64 + 1, 0);
        assert!(black_box(index.insert(keys.get(i), loc, (items + i) as u64 + 1)).is_some());
    }
    let update_ns = ns_per(start, updates);

    let removes = lookups;
    let start = Instant::now();
    for &i in &order[..removes] {
        assert!(black_box(index.remove(keys.get(i))).is_some());
    }
    let remove_ns = ns_per(start, removes);

    println!(
        "| {set} | {items} | {} | {heap:.1} | {reported:.1} | {insert_ns:.0} | {hit_ns:.0} | {batch_ns:.0} | \
         {miss_ns:.0} | {update_ns:.0} | {range_ns:.0} | {remove_ns:.0} |",
        index.name()
    );
}

fn main() {
    let mut items_list = vec![1_000_000u64];
    let mut block_sizes = vec![1024usize];
    let mut sets = vec!["ycsb".to_string(), "redis".to_string()];
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: index_bench [--items N,N..] [--blocks BYTES,..] [--sets ycsb,redis]";
    let fail = |message: String| -> ! {
        eprintln!("index_bench: {message}\n{usage}");
        std::process::exit(2)
    };
    fn numbers<T: std::str::FromStr>(value: &str) -> Option<Vec<T>> {
        value.split(',').map(|v| v.parse().ok()).collect()
    }
    for pair in args.chunks(2) {
        let Some(value) = pair.get(1) else { fail(format!("{} takes a value", pair[0])) };
        match pair[0].as_str() {
            "--items" => {
                items_list = numbers(value).unwrap_or_else(|| fail(format!("bad --items {value}")))
            }
            "--blocks" => {
                block_sizes =
                    numbers(value).unwrap_or_else(|| fail(format!("bad --blocks {value}")))
            }
            "--sets" => sets = value.split(',').map(String::from).collect(),
            other => fail(format!("unknown option {other}")),
        }
    }
    println!(
        "| keys | items | index | heap B/item (counted) | B/item (reported) | insert ns | \
         get hit ns | hit in 16s ns | get miss ns | update ns | range 100 ns | remove ns |"
    );
    println!("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for set in &sets {
        for &items in &items_list {
            let keys = make_keys(set, 0, items);
            let misses = make_keys(set, items, items.min(1_000_000));
            run(BTree(BTreeIndex::default()), set, &keys, &misses);
            for &block in &block_sizes {
                run(Compact(CompactIndex::with_block_bytes_max(block), block), set, &keys, &misses);
            }
        }
    }
}
