//! `copse bench` as a newcomer runs it: the commands exist, write what they promise (JSON,
//! markdown, SVG plots, a refreshed document section) and refuse what they cannot do. Sizes are
//! tiny: this is a smoke test of the harness, not a measurement.

use std::path::Path;
use std::process::{Command, Output};

fn copse(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_copse"))
        .args(args)
        .env("COPSE_LOG", "warn")
        .output()
        .expect("the copse binary runs")
}

fn ok(output: Output) -> String {
    assert!(
        output.status.success(),
        "status {:?}\nstdout: {}\nstderr: {}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).unwrap()
}

fn json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn ycsb_writes_a_report() {
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("run.json");
    let data = dir.path().join("data");
    let args = [
        "--cache-mb=1",
        "--shards=2",
        "bench",
        "ycsb",
        "--records=300",
        "--ops=200",
        "--seconds=5",
        "--threads=4",
        "--phases=a,e",
        "--quiet",
    ];
    let mut all: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    all.push(format!("--dir={}", data.display()));
    all.push(format!("--json={}", report.display()));
    let stdout = ok(copse(&all.iter().map(String::as_str).collect::<Vec<_>>()));
    assert!(stdout.contains("| a@zipfian |") && stdout.contains("| e@zipfian |"), "{stdout}");
    // The CPU cost of a request is printed beside its throughput (the column before `errors`).
    assert!(stdout.contains("| CPU µs/op | errors |"), "{stdout}");
    let row = stdout.lines().find(|line| line.starts_with("| a@zipfian |")).unwrap();
    let cpu = row.split('|').nth(10).and_then(|cell| cell.trim().parse::<f64>().ok());
    // A number (a run this short may use less CPU than /proc's 10 ms tick shows: 0.0).
    assert!(cpu.is_some_and(|us| us >= 0.0), "CPU µs/op in {row}");
    let run = json(&report);
    assert_eq!(run["config"]["cache_bytes"], 1 << 20, "the global --cache-mb reaches the run");
    assert_eq!(run["config"]["shards"], 2);
    assert_eq!(run["phases"][1]["ops"], 200);
    assert_eq!(run["errors"], 0);
    assert_eq!(std::fs::read_dir(&data).unwrap().count(), 0, "the run's store is removed");
}

#[test]
fn rocksdb_without_the_feature_is_a_clear_error() {
    if cfg!(feature = "rocksdb") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let output = copse(&[
        "bench",
        "ycsb",
        "--engine=rocksdb",
        "--records=10",
        "--quiet",
        &format!("--dir={}", dir.path().display()),
    ]);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("--features rocksdb"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn device_probe_reports_every_test() {
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("device.json");
    let stdout = ok(copse(&[
        "bench",
        "device",
        "--file-mib=8",
        "--seconds=0.2",
        "--depths=1,4",
        "--quiet",
        &format!("--dir={}", dir.path().display()),
        &format!("--json={}", report.display()),
    ]));
    assert!(stdout.contains("randread-4k") && stdout.contains("seqwrite-128k"), "{stdout}");
    let device = json(&report);
    let tests: Vec<&str> =
        device["results"].as_array().unwrap().iter().map(|r| r["test"].as_str().unwrap()).collect();
    for test in ["randread-4k", "randwrite-4k", "seqread-128k", "seqwrite-128k", "fdatasync"] {
        assert!(tests.contains(&test), "{test} missing from {tests:?}");
    }
}

#[test]
fn compare_alternates_runs_and_refreshes_a_document() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let doc = dir.path().join("doc.md");
    std::fs::write(&doc, "# Benchmarks\n\nHand-written text.\n").unwrap();
    let device = dir.path().join("device.json");
    ok(copse(&[
        "bench",
        "device",
        "--file-mib=8",
        "--seconds=0.1",
        "--depths=1,4",
        "--quiet",
        &format!("--dir={}", dir.path().display()),
        &format!("--json={}", device.display()),
    ]));
    let stdout = ok(copse(&[
        "--cache-mb=1",
        "bench",
        "compare",
        "--engines=copse",
        "--repeats=2",
        "--records=200",
        "--ops=100",
        "--seconds=5",
        "--threads=2",
        "--phases=a@uniform,c",
        "--open-phases=a@uniform",
        "--open-fraction=0.5",
        "--section=smoke",
        "--title=Smoke",
        &format!("--dir={}", dir.path().join("data").display()),
        &format!("--out-dir={}", out.display()),
        &format!("--doc={}", doc.display()),
        &format!("--device-json={}", device.display()),
    ]));
    for run in ["closed-copse-0.json", "closed-copse-1.json", "open-copse-a@uniform-0.json"] {
        assert!(out.join(run).exists(), "{run} written");
    }
    for plot in [
        "closed-a-uniform-throughput.svg",
        "closed-c-zipfian-latency.svg",
        "open-a-uniform-latency.svg",
    ] {
        let svg = std::fs::read_to_string(out.join(plot)).unwrap();
        assert!(svg.contains("<polyline"), "{plot} has lines");
    }
    assert!(stdout.contains("| a@uniform | copse |") && stdout.contains("1.00x"), "{stdout}");
    assert!(stdout.contains("Open loop, a@uniform"), "{stdout}");
    let text = std::fs::read_to_string(&doc).unwrap();
    assert!(text.starts_with("# Benchmarks\n\nHand-written text.\n"), "{text}");
    assert!(text.contains("<!-- copse-bench:smoke:begin -->") && text.contains("### Smoke"));
    let closed = json(&out.join("closed-copse-0.json"));
    let utilisation = closed["phases"][1]["device_utilisation"].as_f64();
    assert!(utilisation.is_some_and(|u| u > 0.0), "utilisation from the probe: {utilisation:?}");
    let row = text.lines().find(|line| line.starts_with("| a@uniform | copse |")).unwrap();
    assert!(row.split('|').nth(9).is_some_and(|cell| cell.trim().ends_with('%')), "{row}");
    let cpu = row.split('|').nth(11).and_then(|cell| cell.trim().parse::<f64>().ok());
    // A number (a run this short may use less CPU than /proc's 10 ms tick shows: 0.0).
    assert!(cpu.is_some_and(|us| us >= 0.0), "CPU µs/op in {row}");
    let open = json(&out.join("open-copse-a@uniform-0.json"));
    assert_eq!(open["config"]["mode"], "open");
    assert!(open["config"]["target_ops_per_second"].as_f64().unwrap() > 0.0);
}
