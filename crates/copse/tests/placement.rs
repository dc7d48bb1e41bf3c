//! Append placement and its collector, end to end (docs/placement.md).
//!
//! Risks covered: an update-only workload growing an append store without bound (the collector
//! not keeping up, or freeing nothing); a collection losing or reviving an item; `auto` not
//! probing, or its decision not kept in the manifest across reopens.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use copse::device::sim::SimDisk;
use copse::{Db, Options, Placement, PlacementSetting, WriteDurability};
use futures::future::join_all;

fn append_options(space_amplification_max: f64) -> Options {
    Options {
        shards: 1,
        cache_bytes: 1 << 20,
        show_progress: false,
        pin_threads: false,
        placement: PlacementSetting::Append,
        space_amplification_max,
        append_block_pages: 4,
        ..Options::default()
    }
}

fn value(key: usize, version: usize) -> Vec<u8> {
    common::make_value(&format!("k{key}v{version}"), 100)
}

/// `count` key numbers below `keys`, drawn with replacement by xorshift from `state`.
fn random_keys(state: &mut u64, count: usize, keys: usize) -> Vec<usize> {
    (0..count)
        .map(|_| {
            *state ^= *state << 13;
            *state ^= *state >> 7;
            *state ^= *state << 17;
            (*state % keys as u64) as usize
        })
        .collect()
}

/// Writes every key once, then overwrites random keys for `rounds` times the key count, many
/// puts in flight at once; checks disk use against the ceiling after each round.
#[test]
fn an_update_only_run_keeps_disk_use_under_the_space_ceiling() {
    const KEYS: usize = 20_000;
    const ROUNDS: usize = 12;
    const IN_FLIGHT: usize = 256;
    let ceiling = 1.5;
    let disk = SimDisk::new(11);
    let db = Db::open_with_storage(
        Arc::new(disk.storage(WriteDurability::Dsync)),
        append_options(ceiling),
    )
    .unwrap();
    let mut model: BTreeMap<usize, usize> = BTreeMap::new();
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let write_round = |keys: Vec<usize>, model: &mut BTreeMap<usize, usize>| {
        for chunk in keys.chunks(IN_FLIGHT) {
            let writes: Vec<(Vec<u8>, Vec<u8>)> = chunk
                .iter()
                .map(|&key| {
                    let version = model.get(&key).map_or(0, |v| v + 1);
                    model.insert(key, version);
                    (format!("key{key:06}").into_bytes(), value(key, version))
                })
                .collect();
            let results = futures::executor::block_on(join_all(
                writes.iter().map(|(key, value)| db.put_async(key, value)),
            ));
            assert!(results.iter().all(Result::is_ok));
        }
    };
    write_round((0..KEYS).collect(), &mut model);
    let after_load = db.stats().unwrap();
    let mut worst_ratio: f64 = 0.0;
    for round in 0..ROUNDS {
        write_round(random_keys(&mut state, KEYS, KEYS), &mut model);
        let stats = db.stats().unwrap();
        let class = stats
            .classes
            .iter()
            .find(|class| class.user_bytes_written > 0)
            .expect("one class holds the items");
        assert_eq!(class.placement, Placement::Append);
        let ratio = class.file_bytes as f64 / class.live_bytes as f64;
        worst_ratio = worst_ratio.max(ratio);
        // The file grows by a growth step at a time (1 MiB, or an eighth of it). The collector
        // starts short of the ceiling, but a burst of 256 writes in flight can outrun it for
        // a moment: the file may then take one more step (docs/placement.md).
        let step = (class.file_bytes / 8).max(copse::limits::SLAB_GROWTH_BYTES_MIN);
        assert!(
            (class.file_bytes as f64) <= ceiling * class.live_bytes as f64 + 2.0 * step as f64,
            "round {round}: file {} bytes for {} live bytes (ceiling {ceiling})",
            class.file_bytes,
            class.live_bytes
        );
        println!(
            "round {round}: file/live {ratio:.3}, dead {} bytes, collections {}, blocks freed {}, moved {} bytes, write amplification {:.2}",
            class.dead_bytes,
            class.append.gc_runs,
            class.append.gc_blocks_freed,
            class.append.gc_bytes_moved,
            class.write_amplification()
        );
    }
    let stats = db.stats().unwrap();
    let class = stats.classes.iter().find(|class| class.user_bytes_written > 0).unwrap();
    assert!(class.append.gc_blocks_freed > 0, "the collector freed no block");
    assert!(class.append.gc_bytes_moved > 0, "the collector moved nothing");
    let load_amplification = after_load.write_amplification;
    println!(
        "worst file/live {worst_ratio:.3}; write amplification {:.2} (load alone {load_amplification:.2})",
        stats.write_amplification
    );
    // Every item reads back as last written, also after a reopen (recovery rebuilds the blocks).
    let check = |db: &Db| {
        for (&key, &version) in &model {
            let found = db.get(format!("key{key:06}").as_bytes()).unwrap();
            assert_eq!(found, Some(value(key, version)), "key {key}");
        }
    };
    check(&db);
    db.close().unwrap();
    let db = Db::open_with_storage(
        Arc::new(disk.storage(WriteDurability::Dsync)),
        append_options(ceiling),
    )
    .unwrap();
    check(&db);
    assert_eq!(db.stats().unwrap().items, KEYS as u64);
    db.close().unwrap();
}

/// `auto` probes the device when the store is created and records what it chose; a reopen that
/// asks for something else keeps the store's placement.
#[test]
fn auto_placement_probes_once_and_the_manifest_keeps_the_choice() {
    let dir = tempfile::tempdir().unwrap();
    let options = |placement| Options {
        shards: 1,
        show_progress: false,
        pin_threads: false,
        placement,
        ..Options::default()
    };
    let db = Db::open(dir.path(), options(PlacementSetting::Auto)).unwrap();
    let created = db.stats().unwrap().placement;
    db.close().unwrap();
    assert_eq!(created.asked, Some(PlacementSetting::Auto));
    let ratio = created.probe_sequential_over_random.expect("auto probed the device");
    assert!(ratio > 0.0);
    assert!(!dir.path().join("PROBE.tmp").exists(), "the probe's file was removed");
    // The decision follows the documented cost model.
    for (class, placement) in created.classes.iter().enumerate() {
        let expected = copse::engine::native::placement::choose_placement(
            copse::engine::native::format::SizeClass::get(class as u8),
            ratio,
            copse::limits::SPACE_AMPLIFICATION_DEFAULT,
        );
        // The ratio is stored to 1/1000; a class at the boundary could go either way.
        let boundary = 2.0 / (1.0 - 1.0 / copse::limits::SPACE_AMPLIFICATION_DEFAULT)
            * copse::engine::native::format::SizeClass::get(class as u8).slot_bytes as f64
            / copse::limits::PAGE_BYTES as f64;
        if (ratio - boundary).abs() > 0.01 {
            assert_eq!(*placement, expected, "class {class} at ratio {ratio}");
        }
    }
    let db = Db::open(dir.path(), options(PlacementSetting::InPlace)).unwrap();
    let reopened = db.stats().unwrap().placement;
    db.close().unwrap();
    assert_eq!(reopened.classes, created.classes);
    assert_eq!(reopened.asked, Some(PlacementSetting::Auto));
}

/// A per-class exception wins over the store's setting, and out-of-range settings are refused.
#[test]
fn placement_by_class_overrides_and_bad_settings_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let options = Options {
        shards: 1,
        show_progress: false,
        pin_threads: false,
        placement: PlacementSetting::InPlace,
        placement_by_class: vec![(3, PlacementSetting::Append)],
        ..Options::default()
    };
    let db = Db::open(dir.path(), options.clone()).unwrap();
    let placement = db.stats().unwrap().placement;
    db.close().unwrap();
    assert_eq!(placement.classes[3], Placement::Append);
    assert_eq!(placement.classes.iter().filter(|p| **p == Placement::Append).count(), 1);
    assert_eq!(placement.probe_sequential_over_random, None, "no class asked for auto");
    let other = tempfile::tempdir().unwrap();
    for bad in [
        Options { placement_by_class: vec![(13, PlacementSetting::Append)], ..options.clone() },
        Options { space_amplification_max: 1.0, ..options.clone() },
        Options { append_block_pages: 0, ..options.clone() },
    ] {
        match Db::open(other.path(), bad) {
            Err(copse::OpenError::InvalidOption(_)) => {}
            other => panic!("expected InvalidOption, got {:?}", other.map(|_| ())),
        }
    }
}

/// A store of a dozen blocks' worth of items under random overwrites in small rounds (a
/// pipeline of 16): the collector must not churn. 0.64 moves per overwrite; with
/// `GC_ROOM_BLOCKS_MIN` at 0, 1.69 (fails). (Counting the collector's own moves in its pace,
/// or taking a block's worth of dead slots per collection, changes nothing at this size once
/// the floor is there: 0.65 and 0.71; docs/benchmarks.md, 2026-11-27.)
#[test]
fn a_small_store_s_collector_moves_less_than_a_record_per_overwrite() {
    const KEYS: usize = 2048;
    const OVERWRITES: usize = 3 * KEYS;
    const IN_FLIGHT: usize = 16;
    let disk = SimDisk::new(12);
    let options =
        Options { append_block_pages: copse::limits::APPEND_BLOCK_PAGES, ..append_options(1.5) };
    let db =
        Db::open_with_storage(Arc::new(disk.storage(WriteDurability::Dsync)), options).unwrap();
    let write = |keys: &[usize], version: usize| {
        for chunk in keys.chunks(IN_FLIGHT) {
            let values: Vec<Vec<u8>> = chunk
                .iter()
                .map(|&key| common::make_value(&format!("k{key}v{version}"), 1000))
                .collect();
            let keys: Vec<Vec<u8>> =
                chunk.iter().map(|key| format!("key{key:06}").into_bytes()).collect();
            let results = futures::executor::block_on(join_all(
                keys.iter().zip(&values).map(|(key, value)| db.put_async(key, value)),
            ));
            assert!(results.iter().all(Result::is_ok));
        }
    };
    write(&(0..KEYS).collect::<Vec<_>>(), 0);
    let moved_before = moved_slots(&db);
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    write(&random_keys(&mut state, OVERWRITES, KEYS), 1);
    let moves_per_overwrite = (moved_slots(&db) - moved_before) as f64 / OVERWRITES as f64;
    println!("{moves_per_overwrite:.2} collector moves per overwrite");
    assert!(moves_per_overwrite < 1.0, "{moves_per_overwrite:.2} collector moves per overwrite");
    db.close().unwrap();
}

fn moved_slots(db: &Db) -> u64 {
    db.stats().unwrap().classes.iter().map(|class| class.append.gc_slots_moved).sum()
}
