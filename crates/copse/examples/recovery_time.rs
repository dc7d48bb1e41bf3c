//! Time to reopen a store: the recovery scan of every slab, which rebuilds each shard's index
//! by one insert per live item. Loads the store once (YCSB-style keys, `--value-bytes` values,
//! batches from 4 threads), closes it, then opens and closes it `--reopens` times.
//!
//! `cargo run --release -p copse --example recovery_time -- --path /tmp/copse-recovery \
//!   --items 1000000 --value-bytes 100 --reopens 3`

use std::time::Instant;

use copse::{Db, Options, WriteBatch};

fn main() {
    let mut path = String::from("/tmp/copse-recovery");
    let mut items = 1_000_000u64;
    let mut value_bytes = 100usize;
    let mut reopens = 3;
    let args: Vec<String> = std::env::args().skip(1).collect();
    for pair in args.chunks(2) {
        let value = pair.get(1).expect("every option takes a value");
        match pair[0].as_str() {
            "--path" => path = value.clone(),
            "--items" => items = value.parse().unwrap(),
            "--value-bytes" => value_bytes = value.parse().unwrap(),
            "--reopens" => reopens = value.parse().unwrap(),
            other => panic!("unknown option {other} (--path, --items, --value-bytes, --reopens)"),
        }
    }
    let options = || Options { show_progress: false, ..Options::default() };
    if !std::path::Path::new(&path).exists() {
        let start = Instant::now();
        let db = Db::open(&path, options()).expect("open");
        let threads = 4u64;
        std::thread::scope(|scope| {
            for thread in 0..threads {
                let db = &db;
                scope.spawn(move || {
                    let value = vec![b'v'; value_bytes];
                    let mut batch = WriteBatch::new();
                    for i in (thread..items).step_by(threads as usize) {
                        let key = format!("user{}", (i.wrapping_mul(0x9E37_79B9_7F4A_7C15)) >> 1);
                        batch.put(key.into_bytes(), value.clone());
                        if batch.len() == 500 {
                            db.write_batch(std::mem::take(&mut batch)).expect("load");
                        }
                    }
                    if !batch.is_empty() {
                        db.write_batch(batch).expect("load");
                    }
                });
            }
        });
        db.close().expect("close");
        println!(
            "loaded {items} items of {value_bytes} B in {:.1} s",
            start.elapsed().as_secs_f64()
        );
    }
    for run in 1..=reopens {
        let start = Instant::now();
        let db = Db::open(&path, options()).expect("reopen");
        let opened = start.elapsed().as_secs_f64();
        let stats = db.stats().expect("stats");
        println!(
            "reopen {run}: {opened:.2} s, {} items, index {:.1} B/item, {:.0} MiB of files",
            stats.items,
            stats.index_bytes_per_item,
            stats.file_bytes as f64 / (1 << 20) as f64
        );
        db.close().expect("close");
    }
}
