//! First measurement of the native engine through the Rust API (the full YCSB harness is its own
//! issue): load N items in hashed key order, then N uniform random gets, then N uniform random
//! updates, each phase closed-loop with many requests in flight. Prints throughput, latency
//! percentiles, device I/Os per request and index bytes per item, as a markdown table.
//!
//!     cargo run --release -p copse --example api_bench -- --path ./bench-data --items 1000000

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use clap::Parser;
use copse::{Db, Options};
use hdrhistogram::Histogram;
use rand::{Rng, SeedableRng};

#[derive(Parser, Debug)]
struct Args {
    #[arg(long, default_value = "./bench-data")]
    path: std::path::PathBuf,
    #[arg(long, default_value_t = 1_000_000)]
    items: u64,
    #[arg(long, default_value_t = 1024)]
    value_bytes: usize,
    #[arg(long)]
    shards: Option<usize>,
    #[arg(long, default_value_t = 256)]
    cache_mb: usize,
    /// Client threads; each keeps `--in-flight` requests going with the async API.
    #[arg(long, default_value_t = 4)]
    clients: usize,
    #[arg(long, default_value_t = 32)]
    in_flight: usize,
    #[arg(long, default_value = "dsync")]
    durability: String,
    /// Keep the data directory (default: remove it before and after).
    #[arg(long)]
    keep: bool,
}

/// YCSB's key: "user" + FNV-1a 64 of the record number, so load order is hashed order.
fn key_of(record: u64) -> Vec<u8> {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in record.to_le_bytes() {
        hash ^= byte as u64;
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("user{hash}").into_bytes()
}

#[derive(Clone, Copy)]
enum Phase {
    Load,
    Get,
    Update,
}

struct Outcome {
    seconds: f64,
    histogram: Histogram<u64>,
}

fn run_phase(db: &Db, args: &Args, phase: Phase) -> Outcome {
    let next = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let histograms: Vec<Histogram<u64>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..args.clients)
            .map(|client| {
                let db = db.clone();
                let next = next.clone();
                scope.spawn(move || {
                    let tasks = (0..args.in_flight).map(|task| {
                        let db = db.clone();
                        let next = next.clone();
                        let seed = (client * args.in_flight + task) as u64;
                        async move {
                            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
                            let mut histogram = Histogram::<u64>::new(3).unwrap();
                            let mut value = vec![0u8; args.value_bytes];
                            loop {
                                let n = next.fetch_add(1, Ordering::Relaxed);
                                if n >= args.items {
                                    break;
                                }
                                let started = Instant::now();
                                match phase {
                                    Phase::Load => {
                                        rng.fill(&mut value[..]);
                                        db.put_async(&key_of(n), &value).await.expect("put");
                                    }
                                    Phase::Get => {
                                        let record = rng.gen_range(0..args.items);
                                        let got = db.get_async(&key_of(record)).await.expect("get");
                                        assert_eq!(got.map(|v| v.len()), Some(args.value_bytes));
                                    }
                                    Phase::Update => {
                                        rng.fill(&mut value[..]);
                                        let record = rng.gen_range(0..args.items);
                                        db.put_async(&key_of(record), &value)
                                            .await
                                            .expect("update");
                                    }
                                }
                                histogram.record(started.elapsed().as_micros() as u64).unwrap();
                            }
                            histogram
                        }
                    });
                    let results = futures::executor::block_on(futures::future::join_all(tasks));
                    let mut merged = Histogram::<u64>::new(3).unwrap();
                    for histogram in results {
                        merged.add(histogram).unwrap();
                    }
                    merged
                })
            })
            .collect();
        handles.into_iter().map(|handle| handle.join().unwrap()).collect()
    });
    let mut histogram = Histogram::<u64>::new(3).unwrap();
    for part in histograms {
        histogram.add(part).unwrap();
    }
    Outcome { seconds: started.elapsed().as_secs_f64(), histogram }
}

/// (reads, writes, bytes read, bytes written, flushes) summed over shards.
fn device_totals(db: &Db) -> (u64, u64, u64, u64, u64) {
    let stats = db.stats().unwrap();
    stats.shards.iter().fold((0, 0, 0, 0, 0), |acc, shard| {
        (
            acc.0 + shard.device.reads,
            acc.1 + shard.device.writes,
            acc.2 + shard.device.bytes_read,
            acc.3 + shard.device.bytes_written,
            acc.4 + shard.device.flushes,
        )
    })
}

fn main() {
    let args = Args::parse();
    if !args.keep {
        let _ = std::fs::remove_dir_all(&args.path);
    }
    let durability = match args.durability.as_str() {
        "dsync" => copse::WriteDurability::Dsync,
        "flush-per-round" => copse::WriteDurability::FlushPerRound,
        other => panic!("unknown durability {other}"),
    };
    let mut options = Options {
        cache_bytes: args.cache_mb << 20,
        durability,
        show_progress: false,
        ..Options::default()
    };
    if let Some(shards) = args.shards {
        options.shards = shards;
    }
    let db = Db::open(&args.path, options.clone()).expect("open");
    println!(
        "items {} × {} B values, {} shards, cache {} MiB, {} clients × {} in flight, durability {}",
        args.items,
        args.value_bytes,
        options.shards,
        args.cache_mb,
        args.clients,
        args.in_flight,
        args.durability
    );
    println!();
    println!("| phase | ops/s | p50 µs | p99 µs | p99.9 µs | max µs | device reads/op | device writes/op | flushes/op | KB written/op |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for (name, phase) in
        [("load", Phase::Load), ("get (uniform)", Phase::Get), ("update (uniform)", Phase::Update)]
    {
        let before = device_totals(&db);
        let outcome = run_phase(&db, &args, phase);
        let after = device_totals(&db);
        let ops = args.items as f64;
        let h = &outcome.histogram;
        println!(
            "| {name} | {:.0} | {} | {} | {} | {} | {:.2} | {:.2} | {:.3} | {:.2} |",
            ops / outcome.seconds,
            h.value_at_quantile(0.5),
            h.value_at_quantile(0.99),
            h.value_at_quantile(0.999),
            h.max(),
            (after.0 - before.0) as f64 / ops,
            (after.1 - before.1) as f64 / ops,
            (after.4 - before.4) as f64 / ops,
            (after.3 - before.3) as f64 / ops / 1e3,
        );
    }
    let stats = db.stats().unwrap();
    println!();
    println!(
        "items {}, index bytes/item {:.1}, file bytes {:.2} GiB, cache hit rate {:.3}",
        stats.items,
        stats.index_bytes_per_item,
        stats.file_bytes as f64 / (1u64 << 30) as f64,
        stats.cache_hit_rate
    );
    db.close().unwrap();
    let reopen = Instant::now();
    let db = Db::open(&args.path, options).expect("reopen");
    let recovered = db.stats().unwrap();
    println!(
        "reopen (full recovery scan): {:.2} s for {:.2} GiB, {} items",
        reopen.elapsed().as_secs_f64(),
        recovered.shards.iter().map(|s| s.recovery.bytes_scanned).sum::<u64>() as f64
            / (1u64 << 30) as f64,
        recovered.items
    );
    db.close().unwrap();
    if !args.keep {
        let _ = std::fs::remove_dir_all(&args.path);
    }
}
