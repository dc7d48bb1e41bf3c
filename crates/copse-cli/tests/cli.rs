//! The `copse` binary as a script sees it: stdout, stderr and exit codes, against a real store in
//! a temporary directory. Risks covered: a command that prints the wrong thing or exits 0 on
//! failure, bad input that panics instead of failing cleanly, a check that misses damage, and a
//! store reopened with another shard count.

use std::path::Path;
use std::process::{Command, Output};

const EXIT_KEY_NOT_FOUND: i32 = 1;
const EXIT_PROBLEMS_FOUND: i32 = 2;
const EXIT_FAILED: i32 = 3;

/// Runs `copse --path DIR --cache-mb 8 ARGS...` (shards as given in `args`, if any).
fn copse(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_copse"))
        .arg("--path")
        .arg(dir)
        .args(["--cache-mb", "8"])
        .args(args)
        .env("COPSE_LOG", "warn")
        .output()
        .expect("the copse binary runs")
}

fn stdout(output: &Output) -> String {
    String::from_utf8(output.stdout.clone()).expect("stdout is UTF-8")
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// Asserts success and returns stdout.
fn ok(output: Output) -> String {
    assert_eq!(output.status.code(), Some(0), "stderr: {}", stderr(&output));
    stdout(&output)
}

/// Asserts a clean failure: the given exit code, one `copse: ` line on stderr, no panic.
fn fails_with(output: &Output, code: i32, message: &str) {
    let err = stderr(output);
    assert_eq!(output.status.code(), Some(code), "stdout: {} stderr: {err}", stdout(output));
    assert!(err.contains(message), "stderr {err:?} lacks {message:?}");
    assert!(!err.contains("panicked"), "panic: {err}");
}

fn flip_byte(path: &Path, offset: u64) {
    use std::os::unix::fs::FileExt;
    let file = std::fs::OpenOptions::new().read(true).write(true).open(path).unwrap();
    let mut byte = [0u8; 1];
    file.read_exact_at(&mut byte, offset).unwrap();
    byte[0] ^= 0x5a;
    file.write_all_at(&byte, offset).unwrap();
}

#[test]
fn put_get_del_scan_stats_check_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    for (key, value) in [("apple", "red"), ("banana", "yellow"), ("cherry", "dark red")] {
        assert_eq!(ok(copse(dir, &["--shards", "2", "put", key, value])), "OK\n");
    }
    // Without --shards the count comes from the manifest.
    assert_eq!(ok(copse(dir, &["get", "banana"])), "yellow\n");
    assert_eq!(ok(copse(dir, &["get", "--hex", "apple"])), "726564\n");
    assert_eq!(ok(copse(dir, &["del", "banana"])), "deleted\n");
    assert_eq!(ok(copse(dir, &["del", "banana"])), "not found\n");

    assert_eq!(ok(copse(dir, &["scan"])), "apple\tred\ncherry\tdark red\n");
    assert_eq!(ok(copse(dir, &["scan", "b"])), "cherry\tdark red\n");
    assert_eq!(ok(copse(dir, &["scan", "a", "cherry"])), "apple\tred\n");
    assert_eq!(ok(copse(dir, &["scan", "--hex", "--limit", "1"])), "6170706c65\t726564\n");
    let limited = copse(dir, &["scan", "--limit", "1"]);
    assert!(stderr(&limited).contains("more follow"), "{}", stderr(&limited));
    assert_eq!(ok(limited), "apple\tred\n");

    let stats: serde_json::Value = serde_json::from_str(&ok(copse(dir, &["stats"]))).unwrap();
    assert_eq!(stats["items"], 2);
    assert_eq!(stats["shards"].as_array().unwrap().len(), 2);

    let report: serde_json::Value = serde_json::from_str(&ok(copse(dir, &["check"]))).unwrap();
    assert_eq!(report["problems_found"], 0);
    assert_eq!(report["live_keys"], 2);
    assert_eq!(report["manifest"]["shard_count"], 2);
}

#[test]
fn get_of_a_missing_key_exits_1() {
    let dir = tempfile::tempdir().unwrap();
    ok(copse(dir.path(), &["--shards", "1", "put", "present", "yes"]));
    let output = copse(dir.path(), &["get", "absent"]);
    fails_with(&output, EXIT_KEY_NOT_FOUND, "copse: key not found: absent");
    assert_eq!(stdout(&output), "");
}

#[test]
fn bad_keys_fail_cleanly_and_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    ok(copse(dir, &["--shards", "1", "put", "k", "v"]));
    fails_with(&copse(dir, &["put", "", "value"]), EXIT_FAILED, "copse: key is empty");
    fails_with(&copse(dir, &["get", ""]), EXIT_FAILED, "key is empty");
    let long_key = "k".repeat(2000);
    fails_with(
        &copse(dir, &["put", &long_key, "value"]),
        EXIT_FAILED,
        "key of 2000 bytes exceeds the limit of 1024 bytes",
    );
    fails_with(&copse(dir, &["get", &long_key]), EXIT_FAILED, "exceeds the limit of 1024 bytes");
    fails_with(&copse(dir, &["scan", &long_key]), EXIT_FAILED, "exceeds the limit of 1024 bytes");
    assert_eq!(ok(copse(dir, &["scan"])), "k\tv\n");
}

#[test]
fn usage_errors_and_missing_stores_fail_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-store-here");
    fails_with(&copse(&missing, &["get", "k"]), EXIT_FAILED, "copse: no store at");
    fails_with(&copse(&missing, &["check"]), EXIT_FAILED, "copse: no store at");
    assert!(!missing.exists(), "reading commands must not create a store");
    fails_with(&copse(dir.path(), &["frobnicate"]), EXIT_FAILED, "unrecognized subcommand");
    fails_with(
        &copse(dir.path(), &["--shards", "0", "put", "k", "v"]),
        EXIT_FAILED,
        "shard count 0",
    );
    assert!(ok(copse(dir.path(), &["--help"])).contains("Usage"));
}

#[test]
fn check_exits_2_after_a_slot_byte_is_flipped() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    // One shard, one small item: it lands in slot 0 of shard-000/class-36.slab (the packed
    // class of 64-byte slots).
    ok(copse(dir, &["--shards", "1", "put", "key-1", "a value of twenty b"]));
    let slab = dir.join("shard-000").join("class-36.slab");
    assert!(slab.is_file());
    // Page 1 is the first slot page; byte 40 is inside the record (32-byte header, key, value).
    flip_byte(&slab, 4096 + 40);

    let output = copse(dir, &["check"]);
    fails_with(&output, EXIT_PROBLEMS_FOUND, "copse: check found 1 problem");
    let report: serde_json::Value = serde_json::from_str(&stdout(&output)).unwrap();
    assert_eq!(report["problems_found"], 1);
    let problem = &report["problems"][0];
    assert_eq!(problem["file"], "shard-000/class-36.slab");
    assert_eq!(problem["shard"], 0);
    assert_eq!(problem["slot"], 0);
    assert_eq!(problem["byte_offset"], 4096);
    assert!(problem["what"].as_str().unwrap().contains("checksum mismatch"));
}

#[test]
fn reopening_with_another_explicit_shard_count_fails() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    ok(copse(dir, &["--shards", "2", "put", "k", "v"]));
    let output = copse(dir, &["--shards", "3", "get", "k"]);
    fails_with(&output, EXIT_FAILED, "has 2 shards; it cannot be opened with 3");
    assert_eq!(stdout(&output), "");
    // The store is untouched: the right count (or none) still opens it.
    assert_eq!(ok(copse(dir, &["--shards", "2", "get", "k"])), "v\n");
    assert_eq!(ok(copse(dir, &["get", "k"])), "v\n");
}

#[test]
fn placement_flags_shape_a_new_store_and_bad_ones_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let output = copse(&store, &["--space-amplification-max", "50", "put", "k", "v"]);
    fails_with(&output, EXIT_FAILED, "space_amplification_max 50 is out of range");
    assert!(!store.exists(), "a refused open leaves no directory behind");
    let output = copse(&store, &["--placement", "sideways", "put", "k", "v"]);
    assert_ne!(output.status.code(), Some(0));
    assert!(stderr(&output).contains("expected in-place, append or auto"), "{}", stderr(&output));
    assert!(!store.exists());
    ok(copse(&store, &["--shards", "1", "--placement", "append", "put", "k", "v"]));
    let stats: serde_json::Value = serde_json::from_str(&ok(copse(&store, &["stats"]))).unwrap();
    assert_eq!(stats["placement"]["asked"], "append");
    // Every class of slots up to a page appends (the paged classes 0 to 12 and the packed ones
    // from 36); the multi-page classes 13 to 35 are always in place.
    let classes = stats["placement"]["classes"].as_array().unwrap();
    assert_eq!(classes.len(), 76, "{classes:?}");
    for (class, placement) in classes.iter().enumerate() {
        let expected = if (13..36).contains(&class) { "in-place" } else { "append" };
        assert_eq!(placement, expected, "class {class}");
    }
    // The layout is the store's: asking for another one later changes nothing.
    assert_eq!(ok(copse(&store, &["--placement", "in-place", "get", "k"])), "v\n");
    let stats: serde_json::Value = serde_json::from_str(&ok(copse(&store, &["stats"]))).unwrap();
    assert_eq!(stats["placement"]["asked"], "append");
}

#[test]
fn demo_writes_reads_and_suggests_next_steps() {
    let dir = tempfile::tempdir().unwrap();
    let out = ok(copse(dir.path(), &["--shards", "2", "demo"]));
    assert!(out.contains("get  greeting -> hello from copse"), "{out}");
    assert!(out.contains("get greeting"), "{out}");
    assert!(out.contains("stats"), "{out}");
    assert_eq!(ok(copse(dir.path(), &["get", "greeting"])), "hello from copse\n");
}
