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
/// Longest phase a run accepts (a typo such as `--seconds 1e30` is an error, not a week).
pub const PHASE_SECONDS_MAX: f64 = 1e6;
/// Slowest open-loop rate: one request per 1,000 seconds.
pub const OPEN_RATE_MIN: f64 = 0.001;
/// Open loop: at least this many clients, so that a slow engine builds a queue of requests
/// in flight (which group commit can batch) before the harness runs out of threads.
pub const OPEN_LOOP_THREADS_MIN: usize = 64;
/// Open loop: a client sleeps until this long before a request is due, then yields until it is,
/// so timer slack does not add to every latency.
const OPEN_LOOP_SPIN: Duration = Duration::from_micros(200);
/// YCSB redraws a zipfian choice beyond the last insert; after this many draws in a row we take
/// the draw modulo the records present instead, so a tiny dataset cannot livelock.
const REDRAWS_MAX: u32 = 1000;
/// The zipfian range covers at most this many times the records present (new records included).
const EXPECTED_NEW_RECORDS_FACTOR_MAX: u64 = 10;

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
        if let Some(seconds) = self.phase_seconds_max {
            if !(seconds > 0.0 && seconds <= PHASE_SECONDS_MAX) {
                return fail(&format!("phase seconds must be in (0, {PHASE_SECONDS_MAX}]"));
            }
        }
        if let Mode::Open { ops_per_second } = self.mode {
            if !(ops_per_second.is_finite() && ops_per_second >= OPEN_RATE_MIN) {
                return fail(&format!(
                    "the open-loop rate must be at least {OPEN_RATE_MIN} requests per second"
                ));
            }
        }
        let value_bytes_max = match self.record_size {
            RecordSize::Fixed(bytes) => bytes,
            RecordSize::KvellMix => crate::workload::KVELL_VALUE_BYTES[3],
        };
        if value_bytes_max > copse::limits::VALUE_BYTES_MAX {
            return fail(&format!(
                "records of {value_bytes_max} bytes exceed copse's value limit of {} bytes",
                copse::limits::VALUE_BYTES_MAX
            ));
        }
        if self.engine.cache_bytes == 0 {
            return fail("the cache budget must be at least 1 MiB");
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
    let guard = DirGuard { dir, keep: config.keep_data };
    let engine = engine::open(&config.engine)?;
    let result = run_phases(config, engine.as_ref());
    let close = engine.close();
    drop(engine);
    let disk_bytes_end = engine::disk_bytes(dir);
    let (phases, engine_figures) = result?;
    close?;
    guard.finish()?;
    let key_bytes_mean = config.key_bytes_mean();
    let record_bytes = config.record_size.mean_value_bytes() + key_bytes_mean;
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
            key_bytes_mean,
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

/// Removes a run's directory however the run ends (an error, a panic), unless told to keep it.
struct DirGuard<'a> {
    dir: &'a PathBuf,
    keep: bool,
}

impl DirGuard<'_> {
    /// Removes the directory now, reporting a failure (the drop can only ignore it).
    fn finish(mut self) -> Result<(), BenchError> {
        let keep = std::mem::replace(&mut self.keep, true);
        if keep || !self.dir.exists() {
            return Ok(());
        }
        std::fs::remove_dir_all(self.dir).map_err(|err| BenchError::Io {
            path: self.dir.display().to_string(),
            message: err.to_string(),
        })
    }
}

impl Drop for DirGuard<'_> {
    fn drop(&mut self) {
        if !self.keep {
            let _ = std::fs::remove_dir_all(self.dir);
        }
    }
}

/// The load and every phase on an engine that is already open (what [`run`] does between
/// opening and closing; public so the harness can be tested against an engine with known
/// behaviour).
pub fn run_phases(
    config: &RunConfig,
    engine: &dyn BenchEngine,
) -> Result<(Vec<PhaseReport>, crate::engine::EngineFigures), BenchError> {
    config.check()?;
    let inserts = Arc::new(AcknowledgedCounter::new(config.record_count));
    let load = PhaseSpec {
        workload: Workload::Load,
        distribution: crate::workload::Distribution::Uniform,
    };
    let mut reports = vec![run_phase(config, engine, (0, load), &inserts, Mode::Closed, 0.0)?];
    for (index, spec) in config.phases.iter().enumerate() {
        let estimate = reports.last().map_or(0.0, |phase: &PhaseReport| phase.ops_per_second);
        reports.push(run_phase(
            config,
            engine,
            (index + 1, *spec),
            &inserts,
            config.mode,
            estimate,
        )?);
    }
    Ok((reports, engine.figures()?))
}

/// What one client thread measured.
struct ThreadTally {
    histograms: Vec<Histogram<u64>>,
    /// Open loop: how late each request was issued after it was due (the harness's own delay).
    schedule_lag: Histogram<u64>,
    errors: [u64; 5],
    error_samples: Vec<String>,
    user_write_bytes: u64,
    /// Requests completed in each whole second since the phase started.
    completed_per_second: Vec<u64>,
}

fn histogram() -> Histogram<u64> {
    Histogram::<u64>::new_with_max(LATENCY_US_MAX, 3).expect("valid bounds")
}

/// Microseconds, rounded, at least 1 (the histograms' lowest value), at most their highest.
fn micros(duration: Duration) -> u64 {
    crate::device::duration_micros(duration).clamp(1, LATENCY_US_MAX)
}

impl ThreadTally {
    fn new() -> ThreadTally {
        ThreadTally {
            histograms: OpKind::ALL.iter().map(|_| histogram()).collect(),
            schedule_lag: histogram(),
            errors: [0; 5],
            error_samples: Vec::new(),
            user_write_bytes: 0,
            completed_per_second: Vec::new(),
        }
    }

    fn record(&mut self, kind: OpKind, latency: Duration, outcome: Result<(), String>) {
        self.histograms[kind.index()].record(micros(latency)).expect("clamped into range");
        if let Err(message) = outcome {
            self.errors[kind.index()] += 1;
            if self.error_samples.len() < ERROR_SAMPLES_MAX {
                self.error_samples.push(format!("{}: {message}", kind.name()));
            }
        }
    }

    fn completed_at(&mut self, since_start: Duration) {
        let second = since_start.as_secs() as usize;
        if self.completed_per_second.len() <= second {
            self.completed_per_second.resize(second + 1, 0);
        }
        self.completed_per_second[second] += 1;
    }

    fn merge(&mut self, other: ThreadTally) {
        for (mine, theirs) in self.histograms.iter_mut().zip(other.histograms) {
            mine.add(theirs).expect("same bounds");
        }
        self.schedule_lag.add(other.schedule_lag).expect("same bounds");
        for (mine, theirs) in self.errors.iter_mut().zip(other.errors) {
            *mine += theirs;
        }
        let room = ERROR_SAMPLES_MAX.saturating_sub(self.error_samples.len());
        self.error_samples.extend(other.error_samples.into_iter().take(room));
        self.user_write_bytes += other.user_write_bytes;
        if self.completed_per_second.len() < other.completed_per_second.len() {
            self.completed_per_second.resize(other.completed_per_second.len(), 0);
        }
        for (mine, theirs) in self.completed_per_second.iter_mut().zip(other.completed_per_second) {
            *mine += theirs;
        }
    }

    /// Requests per second for each whole second, and the last partial second as a rate over
    /// its length when it is long enough to mean something.
    fn timeline(&self, seconds: f64) -> Vec<f64> {
        const PARTIAL_SECOND_MIN: f64 = 0.1;
        let whole = seconds.floor() as usize;
        let mut timeline: Vec<f64> = (0..whole)
            .map(|second| *self.completed_per_second.get(second).unwrap_or(&0) as f64)
            .collect();
        let partial = seconds - whole as f64;
        if partial >= PARTIAL_SECOND_MIN || timeline.is_empty() {
            let count = self.completed_per_second.iter().skip(whole).sum::<u64>();
            timeline.push(count as f64 / partial.max(PARTIAL_SECOND_MIN));
        }
        timeline
    }
}

/// The per-thread means of issuing requests: a value buffer, a random source and the generator.
struct Client<'a> {
    engine: &'a dyn BenchEngine,
    record_size: RecordSize,
    inserts: &'a AcknowledgedCounter,
    value: Vec<u8>,
    key: String,
    rng: StdRng,
}

impl Client<'_> {
    /// Issues one request. The key and any value are prepared first; the returned instant is
    /// taken just before the first engine call, so closed-loop latency is the engine's alone.
    /// `Err` describes a wrong value or an engine error.
    fn execute(&mut self, op: Op, tally: &mut ThreadTally) -> (Instant, Result<(), String>) {
        self.key = key_name(op.record);
        if op.kind.writes() {
            fill_value(&mut self.rng, &mut self.value, self.record_size.value_bytes(op.record));
        }
        let issued = Instant::now();
        let outcome = match op.kind {
            OpKind::Read => self.read_checked(op.record),
            OpKind::Update => self.write(tally),
            OpKind::Insert => {
                let outcome = self.write(tally);
                // Acknowledged whatever the outcome (as YCSB does), or the sequence would stall
                // behind a failed insert; the failure is counted as an error and fails the run.
                self.inserts.acknowledge(op.record);
                outcome
            }
            OpKind::Scan => match self.engine.scan(self.key.as_bytes(), op.scan_items) {
                Ok(0) => Err(format!("scan from existing key {} found nothing", self.key)),
                Ok(_) => Ok(()),
                Err(err) => Err(err.to_string()),
            },
            OpKind::ReadModifyWrite => {
                self.read_checked(op.record).and_then(|()| self.write(tally))
            }
        };
        (issued, outcome)
    }

    fn read_checked(&mut self, record: u64) -> Result<(), String> {
        let expected = self.record_size.value_bytes(record);
        match self.engine.read(self.key.as_bytes()).map_err(|err| err.to_string())? {
            Some(bytes) if bytes == expected => Ok(()),
            Some(bytes) => {
                Err(format!("{}: value of {bytes} bytes, expected {expected}", self.key))
            }
            None => Err(format!("{}: missing", self.key)),
        }
    }

    fn write(&mut self, tally: &mut ThreadTally) -> Result<(), String> {
        self.engine.write(self.key.as_bytes(), &self.value).map_err(|err| err.to_string())?;
        tally.user_write_bytes += (self.key.len() + self.value.len()) as u64;
        Ok(())
    }
}

/// Waits until `due`: sleeps most of the way, then yields, so the request starts on time.
fn wait_until(due: Instant) {
    if let Some(wait) = due.checked_duration_since(Instant::now()) {
        if wait > OPEN_LOOP_SPIN {
            std::thread::sleep(wait - OPEN_LOOP_SPIN);
        }
        while Instant::now() < due {
            std::thread::yield_now();
        }
    }
}

/// Records a phase will insert, for the zipfian chooser's range: YCSB's `expectednewkeys`
/// (operations x insert share x 2); when the phase is bounded by time, its operations are
/// estimated from the previous phase's throughput. Capped so that redraws stay rare.
fn expected_new_records(
    ops_max: Option<u64>,
    seconds_max: Option<f64>,
    throughput_estimate: f64,
    insert_share: f64,
    records: u64,
) -> u64 {
    let by_time = seconds_max.map(|seconds| seconds * throughput_estimate);
    let ops = match (ops_max.map(|ops| ops as f64), by_time) {
        (Some(ops), Some(by_time)) => ops.min(by_time),
        (Some(ops), None) => ops,
        (None, Some(by_time)) => by_time,
        (None, None) => 0.0,
    };
    ((ops * insert_share * 2.0) as u64).min(records.saturating_mul(EXPECTED_NEW_RECORDS_FACTOR_MAX))
}

fn run_phase(
    config: &RunConfig,
    engine: &dyn BenchEngine,
    (index, spec): (usize, PhaseSpec),
    inserts: &Arc<AcknowledgedCounter>,
    mode: Mode,
    throughput_estimate: f64,
) -> Result<PhaseReport, BenchError> {
    let is_load = spec.workload == Workload::Load;
    let (ops_max, seconds_max) = if is_load {
        (Some(config.record_count), None)
    } else {
        (config.phase_ops_max, config.phase_seconds_max)
    };
    let records = inserts.last_value() + 1;
    let shared = Arc::new(Shared {
        inserts: inserts.clone(),
        record_count: records,
        expected_new_records: expected_new_records(
            ops_max,
            seconds_max,
            throughput_estimate,
            spec.workload.mix().insert,
            records,
        ),
        redraws_max: REDRAWS_MAX,
    });
    let ops_max = ops_max.unwrap_or(u64::MAX);
    let phase_seed = config.seed ^ crate::generator::fnv_hash64(index as u64 + 1);
    let template = (!is_load).then(|| OpGenerator::new(spec, shared.clone(), phase_seed));
    let threads = match mode {
        Mode::Closed => config.threads,
        Mode::Open { .. } => config.threads.max(OPEN_LOOP_THREADS_MIN),
    };

    let progress = progress_bar(config.progress, &spec, ops_max, seconds_max);
    let issued = AtomicU64::new(0);
    let completed = AtomicU64::new(0);
    let before = ProcessSample::now();
    let started = Instant::now();
    let deadline = seconds_max.map(|seconds| started + Duration::from_secs_f64(seconds));
    let (stop_progress, progress_stopped) = mpsc::channel::<()>();

    let tally = std::thread::scope(|scope| {
        scope.spawn(|| {
            show_progress(started, &completed, &progress, progress_stopped, seconds_max.is_some())
        });
        let workers: Vec<_> = (0..threads as u64)
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
                        key: String::new(),
                        rng: StdRng::seed_from_u64(phase_seed ^ (thread << 32)),
                    };
                    let mut tally = ThreadTally::new();
                    loop {
                        let n = issued.fetch_add(1, Ordering::Relaxed);
                        if n >= ops_max {
                            break;
                        }
                        let due = match mode {
                            Mode::Closed => None,
                            Mode::Open { ops_per_second } => {
                                Some(started + Duration::from_secs_f64(n as f64 / ops_per_second))
                            }
                        };
                        let now = Instant::now();
                        if deadline.is_some_and(|deadline| due.unwrap_or(now) >= deadline) {
                            break;
                        }
                        let op = match generator.as_mut() {
                            Some(generator) => generator.next_op(),
                            None => Op { kind: OpKind::Insert, record: n, scan_items: 0 },
                        };
                        if let Some(due) = due {
                            wait_until(due);
                        }
                        let (issued_at, outcome) = client.execute(op, &mut tally);
                        let finished = Instant::now();
                        if let Some(due) = due {
                            let lag = issued_at.saturating_duration_since(due);
                            tally.schedule_lag.record(micros(lag)).expect("clamped");
                        }
                        // Open loop: from when the request was due, so queueing counts.
                        let latency = finished.duration_since(due.unwrap_or(issued_at));
                        tally.record(op.kind, latency, outcome);
                        tally.completed_at(finished.duration_since(started));
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
        drop(stop_progress);
        tally
    });
    let seconds = started.elapsed().as_secs_f64();
    let after = ProcessSample::now();
    progress.finish_and_clear();
    // The background work this phase caused, finished and measured outside its window.
    let settle_started = Instant::now();
    engine.settle()?;
    let settled =
        Settle { seconds: settle_started.elapsed().as_secs_f64(), sample: ProcessSample::now() };
    let measured = Measured { mode, threads, seconds, before, after, settled };
    phase_report(config, engine, spec, tally, measured)
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

/// Moves the progress bar until the phase ends.
fn show_progress(
    started: Instant,
    completed: &AtomicU64,
    progress: &ProgressBar,
    stop: mpsc::Receiver<()>,
    by_time: bool,
) {
    const TICK: Duration = Duration::from_millis(250);
    while let Err(mpsc::RecvTimeoutError::Timeout) = stop.recv_timeout(TICK) {
        let done = completed.load(Ordering::Relaxed);
        let seconds = started.elapsed().as_secs_f64();
        progress.set_position(if by_time { seconds as u64 } else { done });
        progress.set_message(format!("{:.0} ops/s", done as f64 / seconds.max(1e-9)));
    }
}

/// The settle step after a phase: how long it took and the counters when it was done.
struct Settle {
    seconds: f64,
    sample: ProcessSample,
}

/// A phase's window: how it ran and the counters around it.
struct Measured {
    mode: Mode,
    threads: usize,
    seconds: f64,
    before: ProcessSample,
    after: ProcessSample,
    settled: Settle,
}

fn phase_report(
    config: &RunConfig,
    engine: &dyn BenchEngine,
    spec: PhaseSpec,
    tally: ThreadTally,
    measured: Measured,
) -> Result<PhaseReport, BenchError> {
    let Measured { mode, threads, seconds, before, after, settled } = measured;
    let mut operations = BTreeMap::new();
    let mut all = histogram();
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
    let settle_read_bytes = settled.sample.read_bytes.saturating_sub(after.read_bytes);
    let settle_write_bytes = settled.sample.write_bytes.saturating_sub(after.write_bytes);
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
    let amplification = |bytes: u64| {
        (tally.user_write_bytes > 0).then(|| bytes as f64 / tally.user_write_bytes as f64)
    };
    let cpu = |sample: &ProcessSample| sample.cpu_user_seconds + sample.cpu_system_seconds;
    Ok(PhaseReport {
        phase: spec.label(),
        workload: spec.workload.name().to_string(),
        distribution: if spec.workload == Workload::Load {
            "none".to_string()
        } else {
            spec.distribution.name().to_string()
        },
        mode: mode.name().to_string(),
        threads,
        ops,
        seconds,
        ops_per_second,
        timeline_ops_per_second: tally.timeline(seconds),
        operations,
        latency: LatencySummary::from_histogram(&all),
        schedule_lag: (!tally.schedule_lag.is_empty())
            .then(|| LatencySummary::from_histogram(&tally.schedule_lag)),
        errors: tally.errors.iter().sum(),
        error_samples: tally.error_samples,
        cpu_user_seconds: after.cpu_user_seconds - before.cpu_user_seconds,
        cpu_system_seconds: after.cpu_system_seconds - before.cpu_system_seconds,
        device_read_bytes: read_bytes,
        device_write_bytes: write_bytes,
        user_write_bytes: tally.user_write_bytes,
        write_amplification: amplification(write_bytes),
        settle_seconds: settled.seconds,
        settle_cpu_seconds: cpu(&settled.sample) - cpu(&after),
        settle_device_read_bytes: settle_read_bytes,
        settle_device_write_bytes: settle_write_bytes,
        write_amplification_with_settle: amplification(write_bytes + settle_write_bytes),
        read_ios_per_op,
        write_ios_per_op,
        device_limit_ops_per_second,
        device_utilisation: device_limit_ops_per_second.map(|limit| ops_per_second / limit),
        rss_bytes_end: after.rss_bytes,
        disk_bytes_end: engine::disk_bytes(&config.engine.dir),
        engine_figures: engine.figures()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeline_counts_whole_seconds_and_a_long_enough_tail() {
        let mut tally = ThreadTally::new();
        for millis in [10, 20, 1500, 2950] {
            tally.completed_at(Duration::from_millis(millis));
        }
        assert_eq!(tally.timeline(2.5), vec![2.0, 1.0, 2.0], "0.5 s tail with one request");
        assert_eq!(tally.timeline(2.05), vec![2.0, 1.0], "a 50 ms tail is dropped");
        let mut short = ThreadTally::new();
        short.completed_at(Duration::from_millis(30));
        assert_eq!(short.timeline(0.05), vec![10.0], "a short phase still has a point");
    }

    #[test]
    fn expected_new_records_follow_ycsb_and_are_capped() {
        assert_eq!(expected_new_records(Some(1000), None, 0.0, 0.05, 100), 100);
        assert_eq!(expected_new_records(None, Some(10.0), 500.0, 0.05, 1000), 500);
        assert_eq!(expected_new_records(Some(1_000_000), Some(10.0), 500.0, 0.05, 1000), 500);
        assert_eq!(expected_new_records(Some(u64::MAX / 2), None, 0.0, 0.05, 10), 100);
        assert_eq!(expected_new_records(Some(1000), None, 0.0, 0.0, 10), 0);
    }
}
