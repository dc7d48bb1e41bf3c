//! Drives a run: opens the engine in a fresh directory, loads the records, runs each phase with
//! many client threads, and measures it.
//!
//! Two ways to apply load:
//! - closed loop: `threads` clients, each issuing its next request when the last one returns;
//! - open loop: requests are due at a fixed rate (request `n` at `start + n / rate`) whether or
//!   not earlier ones have finished; a pool of `threads` clients serves them in order, and each
//!   latency is measured from the request's *intended* start, so a stall shows as the queueing it
//!   causes instead of vanishing from the figures (coordinated omission).
//!
//! Invariants: the figures of a phase cover exactly its requests (counters are sampled at its
//! start and end); a value is checked on every read (present, with its record's length); an
//! insert is acknowledged to the workload's sequence only once the engine has returned from it,
//! so no request names a record that may not exist.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use indicatif::{ProgressBar, ProgressStyle};
use rand::rngs::StdRng;
use rand::SeedableRng;

use crate::device::{DeviceReport, LatencySummary};
use crate::engine::{self, BenchEngine, EngineConfig, EngineError};
use crate::generator::{key_name, AcknowledgedCounter};
use crate::report::{
    format_utc, unix_seconds_now, Machine, OpReport, PhaseReport, ProcessSample, RunConfigReport,
    RunReport, CURVE_PERCENTILES, SCHEMA_VERSION,
};
use crate::workload::{
    fill_value, Op, OpGenerator, OpKind, PhaseSpec, RecordSize, Shared, Workload,
};

/// Error samples kept per phase (the count is always exact).
pub const ERROR_SAMPLES_MAX: usize = 5;
/// Client threads allowed (each is an OS thread).
pub const THREADS_MAX: usize = 1024;
/// Latencies above this are clamped in the histograms (an hour).
const LATENCY_US_MAX: u64 = 3_600_000_000;
/// Bytes a device page holds: I/Os per request are counted in 4 KiB equivalents.
const IO_UNIT_BYTES: f64 = 4096.0;

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("configuration: {0}")]
    Config(String),
    #[error("{path}: {message}")]
    Io { path: String, message: String },
}

/// How requests arrive.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Mode {
    Closed,
    Open { ops_per_second: f64 },
}

impl Mode {
    pub fn name(&self) -> &'static str {
        match self {
            Mode::Closed => "closed",
            Mode::Open { .. } => "open",
        }
    }
}

/// Random 4 KiB IOPS of the device (from `copse bench device`), the limit line of utilisation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeviceLimits {
    pub read_iops: f64,
    pub write_iops: f64,
}

impl DeviceLimits {
    pub fn from_report(report: &DeviceReport) -> Option<DeviceLimits> {
        Some(DeviceLimits {
            read_iops: report.read_iops_max()?,
            write_iops: report.write_iops_max()?,
        })
    }
}

/// Everything a run needs.
#[derive(Clone, Debug)]
pub struct RunConfig {
    pub engine: EngineConfig,
    pub record_count: u64,
    pub record_size: RecordSize,
    pub threads: usize,
    /// Phases after the load, in order.
    pub phases: Vec<PhaseSpec>,
    /// How the phases after the load apply requests (the load is always closed-loop).
    pub mode: Mode,
    /// A phase ends after this many requests or this many seconds, whichever comes first.
    pub phase_ops_max: Option<u64>,
    pub phase_seconds_max: Option<f64>,
    pub seed: u64,
    pub device: Option<DeviceLimits>,
    pub progress: bool,
    /// Leave the engine's directory in place afterwards (it is removed by default).
    pub keep_data: bool,
}

impl RunConfig {
    fn check(&self) -> Result<(), BenchError> {
        let fail = |message: &str| Err(BenchError::Config(message.to_string()));
        if self.record_count == 0 {
            return fail("record count must be at least 1");
        }
        if self.threads == 0 || self.threads > THREADS_MAX {
            return fail(&format!("threads must be 1..={THREADS_MAX}"));
        }
        if self.phase_ops_max.is_none() && self.phase_seconds_max.is_none() {
            return fail("a phase needs a bound: an operation count, a duration, or both");
        }
        if let Mode::Open { ops_per_second } = self.mode {
            if !(ops_per_second.is_finite() && ops_per_second > 0.0) {
                return fail("the open-loop rate must be a positive number of requests per second");
            }
        }
        if self.phases.iter().any(|phase| phase.workload == Workload::Load) {
            return fail("`load` always runs first; list only the phases after it");
        }
        Ok(())
    }

    fn key_bytes_mean(&self) -> f64 {
        // "user" + up to 19 decimal digits; sampled rather than assumed.
        let sample = self.record_count.min(1000);
        (0..sample).map(|record| key_name(record).len() as f64).sum::<f64>() / sample as f64
    }
}

/// Runs the load and every phase; removes the engine's directory afterwards unless told not to.
pub fn run(config: &RunConfig) -> Result<RunReport, BenchError> {
    config.check()?;
    let dir = &config.engine.dir;
    if dir.exists() && std::fs::read_dir(dir).map_or(true, |mut entries| entries.next().is_some()) {
        return Err(BenchError::Config(format!(
            "{} exists and is not empty; a run starts from an empty directory",
            dir.display()
        )));
    }
    let unix_seconds = unix_seconds_now();
    let engine = engine::open(&config.engine)?;
    let result = run_phases(config, engine.as_ref());
    let close = engine.close();
    drop(engine);
    let disk_bytes_end = engine::disk_bytes(dir);
    if !config.keep_data {
        remove_dir(dir)?;
    }
    let (phases, engine_figures) = result?;
    close?;
    let record_bytes = config.record_size.mean_value_bytes() + config.key_bytes_mean();
    let dataset_bytes = (record_bytes * config.record_count as f64) as u64;
    Ok(RunReport {
        schema_version: SCHEMA_VERSION,
        date_utc: format_utc(unix_seconds),
        unix_seconds,
        machine: Machine::current(),
        config: RunConfigReport {
            engine: config.engine.kind.name().to_string(),
            durable: config.engine.kind.durable(),
            record_count: config.record_count,
            record_bytes: config.record_size.label(),
            key_bytes_mean: config.key_bytes_mean(),
            dataset_bytes,
            cache_bytes: config.engine.cache_bytes as u64,
            dataset_to_cache: dataset_bytes as f64 / config.engine.cache_bytes.max(1) as f64,
            threads: config.threads,
            mode: config.mode.name().to_string(),
            target_ops_per_second: match config.mode {
                Mode::Open { ops_per_second } => Some(ops_per_second),
                Mode::Closed => None,
            },
            phase_ops_max: config.phase_ops_max,
            phase_seconds_max: config.phase_seconds_max,
            seed: config.seed,
            shards: config.engine.shards,
            device_read_iops: config.device.map(|device| device.read_iops),
            device_write_iops: config.device.map(|device| device.write_iops),
        },
        errors: phases.iter().map(|phase| phase.errors).sum(),
        disk_bytes_end,
        peak_rss_bytes: ProcessSample::now().peak_rss_bytes,
        engine_figures,
        phases,
    })
}

fn remove_dir(dir: &PathBuf) -> Result<(), BenchError> {
    std::fs::remove_dir_all(dir)
        .map_err(|err| BenchError::Io { path: dir.display().to_string(), message: err.to_string() })
}

fn run_phases(
    config: &RunConfig,
    engine: &dyn BenchEngine,
) -> Result<(Vec<PhaseReport>, crate::engine::EngineFigures), BenchError> {
    let inserts = Arc::new(AcknowledgedCounter::new(config.record_count));
    let load = PhaseSpec {
        workload: Workload::Load,
        distribution: crate::workload::Distribution::Uniform,
    };
    let mut reports = vec![run_phase(config, engine, (0, load), &inserts, Mode::Closed)?];
    for (index, spec) in config.phases.iter().enumerate() {
        reports.push(run_phase(config, engine, (index + 1, *spec), &inserts, config.mode)?);
    }
    Ok((reports, engine.figures()?))
}

/// What one client thread measured.
struct ThreadTally {
    histograms: Vec<Histogram<u64>>,
    errors: [u64; 5],
    error_samples: Vec<String>,
    user_write_bytes: u64,
}

impl ThreadTally {
    fn new() -> ThreadTally {
        let histogram = || Histogram::<u64>::new_with_max(LATENCY_US_MAX, 3).expect("valid bounds");
        ThreadTally {
            histograms: OpKind::ALL.iter().map(|_| histogram()).collect(),
            errors: [0; 5],
            error_samples: Vec::new(),
            user_write_bytes: 0,
        }
    }

    fn record(&mut self, kind: OpKind, latency: Duration, outcome: Result<(), String>) {
        let micros = (latency.as_micros() as u64).clamp(1, LATENCY_US_MAX);
        self.histograms[kind.index()].record(micros).expect("clamped into range");
        if let Err(message) = outcome {
            self.errors[kind.index()] += 1;
            if self.error_samples.len() < ERROR_SAMPLES_MAX {
                self.error_samples.push(format!("{}: {message}", kind.name()));
            }
        }
    }

    fn merge(&mut self, other: ThreadTally) {
        for (mine, theirs) in self.histograms.iter_mut().zip(other.histograms) {
            mine.add(theirs).expect("same bounds");
        }
        for (mine, theirs) in self.errors.iter_mut().zip(other.errors) {
            *mine += theirs;
        }
        let room = ERROR_SAMPLES_MAX.saturating_sub(self.error_samples.len());
        self.error_samples.extend(other.error_samples.into_iter().take(room));
        self.user_write_bytes += other.user_write_bytes;
    }
}

/// The per-thread means of issuing requests: a value buffer, a random source and the generator.
struct Client<'a> {
    engine: &'a dyn BenchEngine,
    record_size: RecordSize,
    inserts: &'a AcknowledgedCounter,
    value: Vec<u8>,
    rng: StdRng,
}

impl Client<'_> {
    /// Issues one request; `Err` describes a wrong value or an engine error.
    fn execute(&mut self, op: Op, tally: &mut ThreadTally) -> Result<(), String> {
        let key = key_name(op.record);
        match op.kind {
            OpKind::Read => self.read_checked(op.record, &key),
            OpKind::Update | OpKind::Insert => {
                self.write(op.record, &key, tally)?;
                if op.kind == OpKind::Insert {
                    self.inserts.acknowledge(op.record);
                }
                Ok(())
            }
            OpKind::Scan => {
                let found = self
                    .engine
                    .scan(key.as_bytes(), op.scan_items)
                    .map_err(|err| err.to_string())?;
                if found == 0 {
                    return Err(format!("scan from existing key {key} found nothing"));
                }
                Ok(())
            }
            OpKind::ReadModifyWrite => {
                self.read_checked(op.record, &key)?;
                self.write(op.record, &key, tally)
            }
        }
    }

    fn read_checked(&mut self, record: u64, key: &str) -> Result<(), String> {
        let expected = self.record_size.value_bytes(record);
        match self.engine.read(key.as_bytes()).map_err(|err| err.to_string())? {
            Some(bytes) if bytes == expected => Ok(()),
            Some(bytes) => Err(format!("{key}: value of {bytes} bytes, expected {expected}")),
            None => Err(format!("{key}: missing")),
        }
    }

    fn write(&mut self, record: u64, key: &str, tally: &mut ThreadTally) -> Result<(), String> {
        let bytes = self.record_size.value_bytes(record);
        fill_value(&mut self.rng, &mut self.value, bytes);
        self.engine.write(key.as_bytes(), &self.value).map_err(|err| err.to_string())?;
        tally.user_write_bytes += (key.len() + bytes) as u64;
        Ok(())
    }
}

fn run_phase(
    config: &RunConfig,
    engine: &dyn BenchEngine,
    (index, spec): (usize, PhaseSpec),
    inserts: &Arc<AcknowledgedCounter>,
    mode: Mode,
) -> Result<PhaseReport, BenchError> {
    let is_load = spec.workload == Workload::Load;
    let (ops_max, seconds_max) = if is_load {
        (Some(config.record_count), None)
    } else {
        (config.phase_ops_max, config.phase_seconds_max)
    };
    let ops_max = ops_max.unwrap_or(u64::MAX);
    let insert_share = spec.workload.mix().insert;
    let shared = Arc::new(Shared {
        inserts: inserts.clone(),
        record_count: inserts.last_value() + 1,
        // YCSB's expectednewkeys = operationcount * insertproportion * 2; unknown when a phase
        // is bounded by time only, and then new records are reached by `latest` alone.
        expected_new_records: if ops_max == u64::MAX {
            0
        } else {
            (ops_max as f64 * insert_share * 2.0) as u64
        },
    });
    let phase_seed = config.seed ^ crate::generator::fnv_hash64(index as u64 + 1);
    let template = (!is_load).then(|| OpGenerator::new(spec, shared.clone(), phase_seed));

    let progress = progress_bar(config.progress, &spec, ops_max, seconds_max);
    let issued = AtomicU64::new(0);
    let completed = AtomicU64::new(0);
    let before = ProcessSample::now();
    let started = Instant::now();
    let deadline = seconds_max.map(|seconds| started + Duration::from_secs_f64(seconds));
    let (stop_sampler, sampler_stopped) = mpsc::channel::<()>();

    let (tally, timeline) = std::thread::scope(|scope| {
        let sampler = scope.spawn(|| {
            sample_timeline(started, &completed, &progress, sampler_stopped, seconds_max.is_some())
        });
        let workers: Vec<_> = (0..config.threads as u64)
            .map(|thread| {
                let template = template.as_ref();
                let (issued, completed) = (&issued, &completed);
                let shared = &shared;
                scope.spawn(move || {
                    let mut generator = template.map(|t| t.for_thread(thread, phase_seed));
                    let mut client = Client {
                        engine,
                        record_size: config.record_size,
                        inserts: &shared.inserts,
                        value: Vec::new(),
                        rng: StdRng::seed_from_u64(phase_seed ^ (thread << 32)),
                    };
                    let mut tally = ThreadTally::new();
                    loop {
                        let n = issued.fetch_add(1, Ordering::Relaxed);
                        if n >= ops_max {
                            break;
                        }
                        let due = match mode {
                            Mode::Closed => Instant::now(),
                            Mode::Open { ops_per_second } => {
                                started + Duration::from_secs_f64(n as f64 / ops_per_second)
                            }
                        };
                        if deadline.is_some_and(|deadline| due >= deadline) {
                            break;
                        }
                        if let Some(wait) = due.checked_duration_since(Instant::now()) {
                            std::thread::sleep(wait);
                        }
                        let op = match generator.as_mut() {
                            Some(generator) => generator.next_op(),
                            None => Op { kind: OpKind::Insert, record: n, scan_items: 0 },
                        };
                        let outcome = client.execute(op, &mut tally);
                        tally.record(op.kind, due.elapsed(), outcome);
                        completed.fetch_add(1, Ordering::Relaxed);
                    }
                    tally
                })
            })
            .collect();
        let mut tally = ThreadTally::new();
        for worker in workers {
            tally.merge(worker.join().expect("client threads do not panic"));
        }
        drop(stop_sampler);
        (tally, sampler.join().expect("the sampler does not panic"))
    });
    let seconds = started.elapsed().as_secs_f64();
    let after = ProcessSample::now();
    progress.finish_and_clear();
    phase_report(config, engine, spec, mode, tally, timeline, seconds, before, after)
}

fn progress_bar(
    show: bool,
    spec: &PhaseSpec,
    ops_max: u64,
    seconds_max: Option<f64>,
) -> ProgressBar {
    if !show {
        return ProgressBar::hidden();
    }
    let (length, template) = match seconds_max {
        Some(seconds) => (seconds.ceil() as u64, "{prefix:>12} [{bar:30}] {pos}/{len} s  {msg}"),
        None => (ops_max, "{prefix:>12} [{bar:30}] {pos}/{len} ops  {msg}"),
    };
    let bar = ProgressBar::new(length);
    bar.set_style(ProgressStyle::with_template(template).expect("valid template"));
    bar.set_prefix(spec.label());
    bar
}

/// Every second, the requests completed in that second; also moves the progress bar. The last
/// partial second counts as a rate over its length (so a short phase still has a point).
fn sample_timeline(
    started: Instant,
    completed: &AtomicU64,
    progress: &ProgressBar,
    stop: mpsc::Receiver<()>,
    by_time: bool,
) -> Vec<f64> {
    const TICK: Duration = Duration::from_millis(250);
    let mut timeline = Vec::new();
    let mut second_start = started;
    let mut count_at_second = 0u64;
    loop {
        let stopped = matches!(stop.recv_timeout(TICK), Err(mpsc::RecvTimeoutError::Disconnected));
        let now = Instant::now();
        let done = completed.load(Ordering::Relaxed);
        let elapsed = now.duration_since(second_start).as_secs_f64();
        if elapsed >= 1.0 || (stopped && elapsed > 0.0) {
            timeline.push((done - count_at_second) as f64 / elapsed);
            second_start = now;
            count_at_second = done;
        }
        let total_seconds = now.duration_since(started).as_secs_f64();
        progress.set_position(if by_time { total_seconds as u64 } else { done });
        progress.set_message(format!("{:.0} ops/s", done as f64 / total_seconds.max(1e-9)));
        if stopped {
            return timeline;
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn phase_report(
    config: &RunConfig,
    engine: &dyn BenchEngine,
    spec: PhaseSpec,
    mode: Mode,
    tally: ThreadTally,
    timeline: Vec<f64>,
    seconds: f64,
    before: ProcessSample,
    after: ProcessSample,
) -> Result<PhaseReport, BenchError> {
    let mut operations = BTreeMap::new();
    let mut all = Histogram::<u64>::new_with_max(LATENCY_US_MAX, 3).expect("valid bounds");
    for kind in OpKind::ALL {
        let histogram = &tally.histograms[kind.index()];
        if histogram.is_empty() {
            continue;
        }
        all.add(histogram).expect("same bounds");
        let curve_us = CURVE_PERCENTILES
            .iter()
            .map(|percentile| (*percentile, histogram.value_at_percentile(*percentile) as f64))
            .collect();
        operations.insert(
            kind.name().to_string(),
            OpReport {
                count: histogram.len(),
                errors: tally.errors[kind.index()],
                latency: LatencySummary::from_histogram(histogram),
                curve_us,
            },
        );
    }
    let ops = all.len();
    let read_bytes = after.read_bytes.saturating_sub(before.read_bytes);
    let write_bytes = after.write_bytes.saturating_sub(before.write_bytes);
    let per_op =
        |bytes: u64| if ops == 0 { 0.0 } else { bytes as f64 / IO_UNIT_BYTES / ops as f64 };
    let (read_ios_per_op, write_ios_per_op) = (per_op(read_bytes), per_op(write_bytes));
    let ops_per_second = if seconds > 0.0 { ops as f64 / seconds } else { 0.0 };
    // The device spends 1/IOPS per I/O of each kind; a request costs the sum of its I/Os.
    let device_limit_ops_per_second = config.device.and_then(|device| {
        let seconds_per_op =
            read_ios_per_op / device.read_iops + write_ios_per_op / device.write_iops;
        (seconds_per_op > 0.0).then(|| 1.0 / seconds_per_op)
    });
    Ok(PhaseReport {
        phase: spec.label(),
        workload: spec.workload.name().to_string(),
        distribution: if spec.workload == Workload::Load {
            "none".to_string()
        } else {
            spec.distribution.name().to_string()
        },
        mode: mode.name().to_string(),
        threads: config.threads,
        ops,
        seconds,
        ops_per_second,
        timeline_ops_per_second: timeline,
        operations,
        latency: LatencySummary::from_histogram(&all),
        errors: tally.errors.iter().sum(),
        error_samples: tally.error_samples,
        cpu_user_seconds: after.cpu_user_seconds - before.cpu_user_seconds,
        cpu_system_seconds: after.cpu_system_seconds - before.cpu_system_seconds,
        device_read_bytes: read_bytes,
        device_write_bytes: write_bytes,
        user_write_bytes: tally.user_write_bytes,
        write_amplification: (tally.user_write_bytes > 0)
            .then(|| write_bytes as f64 / tally.user_write_bytes as f64),
        read_ios_per_op,
        write_ios_per_op,
        device_limit_ops_per_second,
        device_utilisation: device_limit_ops_per_second.map(|limit| ops_per_second / limit),
        rss_bytes_end: after.rss_bytes,
        disk_bytes_end: engine::disk_bytes(&config.engine.dir),
        engine_figures: engine.figures()?,
    })
}
