//! What a cross-shard batch costs against a batch of the same size within one shard, measured in
//! one run (the machine is noisy, so the two alternate, several rounds each, and the medians are
//! compared). Each batch writes `--keys` keys: all in one shard (the plain batch path), or one
//! key in each of `--keys` shards (the two-phase commit of docs/atomic-batches.md). Client
//! threads each keep one batch in flight with the blocking API.
//!
//!     cargo run --release -p copse --example batch_cost -- --path ./bench-data

use std::time::Instant;

use clap::Parser;
use copse::{Db, Options, WriteBatch};
use hdrhistogram::Histogram;

#[derive(Parser, Debug)]
struct Args {
    #[arg(long, default_value = "./bench-data")]
    path: std::path::PathBuf,
    #[arg(long, default_value_t = 4)]
    shards: usize,
    /// Keys per batch; a cross-shard batch puts each in another shard, so at most `--shards`.
    #[arg(long, default_value_t = 4)]
    keys: usize,
    /// Batches per mode per round.
    #[arg(long, default_value_t = 4000)]
    batches: usize,
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    #[arg(long, default_value_t = 16)]
    clients: usize,
    #[arg(long, default_value_t = 100)]
    value_bytes: usize,
    /// Distinct keys per shard the batches cycle through.
    #[arg(long, default_value_t = 5000)]
    keys_per_shard: usize,
}

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    OneShard,
    CrossShard,
}

fn main() {
    let args = Args::parse();
    assert!(args.keys >= 2 && args.keys <= args.shards, "--keys must be 2..=--shards");
    let _ = std::fs::remove_dir_all(&args.path);
    let options = Options { shards: args.shards, show_progress: false, ..Options::default() };
    let db = Db::open(&args.path, options).expect("open");
    // Keys grouped by the shard they route to.
    let mut pools: Vec<Vec<Vec<u8>>> = vec![Vec::new(); args.shards];
    let mut i = 0u64;
    while pools.iter().any(|pool| pool.len() < args.keys_per_shard) {
        let key = format!("batch-key-{i}").into_bytes();
        let pool = &mut pools[db.shard_of(&key) as usize];
        if pool.len() < args.keys_per_shard {
            pool.push(key);
        }
        i += 1;
    }
    let pools = std::sync::Arc::new(pools);
    println!(
        "{} shards, {} keys per batch of {} B values, {} clients, {} batches per mode per round",
        args.shards, args.keys, args.value_bytes, args.clients, args.batches
    );
    println!();
    println!("| round | mode | batches/s | p50 µs | p99 µs | max µs |");
    println!("|---|---|---|---|---|---|");
    let mut rates: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    for round in 0..args.rounds {
        for mode in [Mode::OneShard, Mode::CrossShard] {
            let started = Instant::now();
            let per_client = args.batches / args.clients;
            let handles: Vec<_> = (0..args.clients)
                .map(|client| {
                    let (db, pools) = (db.clone(), pools.clone());
                    let (keys, shards, value_bytes) = (args.keys, args.shards, args.value_bytes);
                    std::thread::spawn(move || {
                        let mut histogram = Histogram::<u64>::new(3).unwrap();
                        for n in 0..per_client {
                            let batch_id = client * per_client + n;
                            let value = vec![b'v'; value_bytes];
                            let mut batch = WriteBatch::new();
                            for k in 0..keys {
                                let (shard, slot) = match mode {
                                    Mode::OneShard => (batch_id % shards, batch_id * keys + k),
                                    Mode::CrossShard => ((batch_id + k) % shards, batch_id),
                                };
                                let pool = &pools[shard];
                                batch.put(pool[slot % pool.len()].clone(), value.clone());
                            }
                            let one = Instant::now();
                            db.write_batch(batch).expect("write_batch");
                            histogram.record(one.elapsed().as_micros() as u64).unwrap();
                        }
                        histogram
                    })
                })
                .collect();
            let mut histogram = Histogram::<u64>::new(3).unwrap();
            for handle in handles {
                histogram.add(handle.join().unwrap()).unwrap();
            }
            let rate = (per_client * args.clients) as f64 / started.elapsed().as_secs_f64();
            let name = match mode {
                Mode::OneShard => "one shard",
                Mode::CrossShard => "cross-shard",
            };
            rates[(mode == Mode::CrossShard) as usize].push(rate);
            println!(
                "| {} | {name} | {rate:.0} | {} | {} | {} |",
                round + 1,
                histogram.value_at_quantile(0.5),
                histogram.value_at_quantile(0.99),
                histogram.max()
            );
        }
    }
    let median = |rates: &mut Vec<f64>| {
        rates.sort_by(|a, b| a.total_cmp(b));
        rates[rates.len() / 2]
    };
    let one = median(&mut rates[0]);
    let cross = median(&mut rates[1]);
    println!();
    println!(
        "median batches/s: one shard {one:.0}, cross-shard {cross:.0}; cross-shard / one shard = {:.2}",
        cross / one
    );
    db.close().expect("close");
    let _ = std::fs::remove_dir_all(&args.path);
}
