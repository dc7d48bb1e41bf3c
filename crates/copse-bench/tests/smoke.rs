//! A seconds-long run of every workload on every engine built by default (copse), closed and
//! open loop, so the harness cannot rot: the JSON has every field, and its counts add up.

use copse_bench::engine::{EngineConfig, EngineKind};
use copse_bench::generator::key_name;
use copse_bench::runner::{self, DeviceLimits, Mode, RunConfig};
use copse_bench::workload::{PhaseSpec, RecordSize};
use serde_json::Value;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use copse_bench::engine::{BenchEngine, EngineError, EngineFigures};

const RECORDS: u64 = 400;

fn config(dir: &std::path::Path, phases: &str, record_size: RecordSize, mode: Mode) -> RunConfig {
    RunConfig {
        engine: EngineConfig {
            kind: EngineKind::Copse(copse::PlacementSetting::Auto),
            dir: dir.join("store"),
            cache_bytes: 1 << 20,
            shards: Some(2),
            space_amplification_max: None,
            background_jobs: None,
        },
        record_count: RECORDS,
        record_size,
        threads: 4,
        phases: phases.split(',').map(|p| PhaseSpec::parse(p).unwrap()).collect(),
        mode,
        phase_ops_max: Some(300),
        phase_seconds_max: Some(5.0),
        seed: 42,
        device: Some(DeviceLimits { read_iops: 40_000.0, write_iops: 40_000.0 }),
        progress: false,
        keep_data: false,
    }
}

/// Runs, round-trips the report through JSON, and checks what every run must satisfy.
fn run_and_check(config: &RunConfig) -> Value {
    let report = runner::run(config).expect("run");
    let json: Value = serde_json::from_str(&serde_json::to_string(&report).unwrap()).unwrap();
    for field in ["schema_version", "date_utc", "machine", "config", "phases", "disk_bytes_end"] {
        assert!(json.get(field).is_some(), "report lacks {field}");
    }
    assert_eq!(
        json["errors"],
        0,
        "errors: {:?}",
        report.phases.iter().map(|p| &p.error_samples).collect::<Vec<_>>()
    );
    assert!(json["peak_rss_bytes"].as_u64().unwrap() > 0);
    assert!(json["engine_figures"]["index_bytes_per_item"].as_f64().unwrap() > 0.0);
    assert!(!config.engine.dir.exists(), "the run removes its store");
    let phases = json["phases"].as_array().unwrap();
    assert_eq!(phases.len(), config.phases.len() + 1, "load plus each phase");
    for phase in phases {
        let name = phase["phase"].as_str().unwrap();
        for field in [
            "ops_per_second",
            "timeline_ops_per_second",
            "latency",
            "cpu_user_seconds",
            "cpu_system_seconds",
            "device_read_bytes",
            "device_write_bytes",
            "read_ios_per_op",
            "write_ios_per_op",
            "device_limit_ops_per_second",
            "device_utilisation",
            "rss_bytes_end",
            "disk_bytes_end",
            "engine_figures",
        ] {
            assert!(phase.get(field).is_some(), "{name} lacks {field}");
        }
        for percentile in ["p50_us", "p90_us", "p99_us", "p999_us", "p9999_us", "max_us"] {
            assert!(phase["latency"][percentile].as_f64().unwrap() > 0.0, "{name} {percentile}");
        }
        let operations = phase["operations"].as_object().unwrap();
        let counted: u64 = operations.values().map(|op| op["count"].as_u64().unwrap()).sum();
        assert_eq!(phase["ops"].as_u64().unwrap(), counted, "{name}: ops are the sum per type");
        assert!(phase["ops"].as_u64().unwrap() > 0, "{name} ran");
        assert!(!phase["timeline_ops_per_second"].as_array().unwrap().is_empty(), "{name}");
        assert!(phase["ops_per_second"].as_f64().unwrap() > 0.0);
    }
    let load = &phases[0];
    assert_eq!(load["phase"], "load");
    assert_eq!(load["ops"].as_u64().unwrap(), RECORDS);
    assert_eq!(load["operations"]["insert"]["count"].as_u64().unwrap(), RECORDS);
    let user_bytes: u64 = (0..RECORDS)
        .map(|record| (key_name(record).len() + config.record_size.value_bytes(record)) as u64)
        .sum();
    assert_eq!(load["user_write_bytes"].as_u64().unwrap(), user_bytes, "every loaded byte counted");
    assert!(load["write_amplification"].as_f64().unwrap() > 0.0);
    json
}

fn shares(phase: &Value) -> std::collections::BTreeMap<String, u64> {
    phase["operations"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(kind, op)| (kind.clone(), op["count"].as_u64().unwrap()))
        .collect()
}

#[test]
fn every_ycsb_workload_closed_loop() {
    let dir = tempfile::tempdir().unwrap();
    let config = config(
        dir.path(),
        "a@uniform,b,c@zipfian,f,d,e@uniform,kvell",
        RecordSize::Fixed(1024),
        Mode::Closed,
    );
    let json = run_and_check(&config);
    let phases = json["phases"].as_array().unwrap();
    let kinds = |index: usize| shares(&phases[index]).into_keys().collect::<Vec<_>>();
    assert_eq!(kinds(1), ["read", "update"]);
    let a = shares(&phases[1]);
    let read_share = a["read"] as f64 / (a["read"] + a["update"]) as f64;
    assert!((0.35..0.65).contains(&read_share), "A is 50/50: read share {read_share}");
    assert_eq!(kinds(3), ["read"]);
    assert_eq!(kinds(4), ["read", "read-modify-write"]);
    assert_eq!(kinds(5), ["insert", "read"]);
    assert!(kinds(6).contains(&"scan".to_string()), "E scans: {:?}", kinds(6));
    assert!(kinds(7).contains(&"update".to_string()) && kinds(7).contains(&"read".to_string()));
    assert_eq!(phases[5]["distribution"], "latest", "D runs on YCSB's latest by default");
}

#[test]
fn kvell_mix_and_small_records() {
    let dir = tempfile::tempdir().unwrap();
    run_and_check(&config(dir.path(), "kvell@uniform", RecordSize::KvellMix, Mode::Closed));
    let dir = tempfile::tempdir().unwrap();
    run_and_check(&config(dir.path(), "a", RecordSize::Fixed(128), Mode::Closed));
}

#[test]
fn open_loop_paces_requests() {
    let dir = tempfile::tempdir().unwrap();
    let mut config =
        config(dir.path(), "a", RecordSize::Fixed(1024), Mode::Open { ops_per_second: 400.0 });
    config.phase_ops_max = Some(200);
    let json = run_and_check(&config);
    let phase = &json["phases"][1];
    assert_eq!(phase["mode"], "open");
    // 200 requests due at 400/s take half a second at least, however fast the engine is.
    let seconds = phase["seconds"].as_f64().unwrap();
    assert!(seconds >= 0.49, "open loop at 400/s finished 200 requests in {seconds} s");
    assert_eq!(json["config"]["target_ops_per_second"], 400.0);
}

/// An in-memory engine that pauses everything once for `PAUSE`, like a write stall. It tests
/// the harness's measurement, so it stands in for no part of copse.
struct PausingEngine {
    values: Mutex<HashMap<Vec<u8>, usize>>,
    requests: AtomicU64,
    pause_at_request: u64,
}

const PAUSE: Duration = Duration::from_millis(300);

impl BenchEngine for PausingEngine {
    fn read(&self, key: &[u8]) -> Result<Option<usize>, EngineError> {
        let values = self.values.lock().unwrap();
        if self.requests.fetch_add(1, Ordering::SeqCst) == self.pause_at_request {
            std::thread::sleep(PAUSE); // holding the lock: every request waits
        }
        Ok(values.get(key).copied())
    }
    fn write(&self, key: &[u8], value: &[u8]) -> Result<(), EngineError> {
        self.values.lock().unwrap().insert(key.to_vec(), value.len());
        Ok(())
    }
    fn scan(&self, _: &[u8], _: usize) -> Result<usize, EngineError> {
        Ok(1)
    }
    fn figures(&self) -> Result<EngineFigures, EngineError> {
        Ok(EngineFigures::default())
    }
    fn settle(&self) -> Result<(), EngineError> {
        Ok(())
    }
    fn close(&self) -> Result<(), EngineError> {
        Ok(())
    }
}

/// Open loop measures from each request's due time: a 300 ms pause delays every request due
/// during it, and the percentiles show that queue, where measuring from the actual start would
/// show one slow request (coordinated omission).
#[test]
fn open_loop_latency_includes_the_queue_behind_a_stall() {
    let dir = tempfile::tempdir().unwrap();
    let mut config =
        config(dir.path(), "c", RecordSize::Fixed(100), Mode::Open { ops_per_second: 1000.0 });
    config.phase_ops_max = Some(1000);
    let engine = PausingEngine {
        values: Mutex::new(HashMap::new()),
        requests: AtomicU64::new(0),
        pause_at_request: RECORDS + 200,
    };
    let (phases, _) = runner::run_phases(&config, &engine).unwrap();
    let phase = &phases[1];
    assert_eq!((phase.ops, phase.errors), (1000, 0));
    // ~300 of 1,000 requests were due during the pause: p90 sits well inside it.
    assert!(phase.latency.p90_us >= 50_000.0, "p90 {} µs hides the queue", phase.latency.p90_us);
    assert!(phase.latency.max_us >= 250_000.0, "max {} µs", phase.latency.max_us);
    let mut closed = config.clone();
    closed.mode = Mode::Closed;
    engine.requests.store(0, Ordering::SeqCst);
    let (phases, _) = runner::run_phases(&closed, &engine).unwrap();
    assert!(
        phases[1].latency.p90_us < 50_000.0,
        "closed loop: the pause is one slow request per thread"
    );
}

#[test]
fn a_non_empty_directory_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let config = config(dir.path(), "a", RecordSize::Fixed(100), Mode::Closed);
    std::fs::create_dir_all(&config.engine.dir).unwrap();
    std::fs::write(config.engine.dir.join("precious"), b"data").unwrap();
    let err = runner::run(&config).unwrap_err();
    assert!(err.to_string().contains("not empty"), "{err}");
    assert!(config.engine.dir.join("precious").exists(), "nothing removed");
}

/// With the `rocksdb` feature (`make bench` builds it), the baselines run every workload too.
#[cfg(feature = "rocksdb")]
#[test]
fn rocksdb_engines_run_every_workload() {
    for kind in [EngineKind::Rocksdb, EngineKind::RocksdbRelaxed, EngineKind::RocksdbSharded] {
        let dir = tempfile::tempdir().unwrap();
        let mut config =
            config(dir.path(), "a,b,c,f,d,e,kvell", RecordSize::Fixed(1024), Mode::Closed);
        config.engine.kind = kind;
        let report = runner::run(&config).unwrap();
        assert_eq!(report.errors, 0, "{kind:?}");
        assert_eq!(report.config.durable, kind != EngineKind::RocksdbRelaxed);
        assert_eq!(report.phases.len(), 8);
    }
}
