//! The device probe (`copse bench device`): the physical limit line that engine figures are read
//! against.
//!
//! What it measures, on one file in a given directory and through copse's own device layer
//! ([`DirStorage`] → [`BlockDevice`], so io_uring + O_DIRECT exactly as the engine drives it, not
//! fio and not std::fs):
//! - sequential 128 KiB write and read bandwidth at `SEQ_QUEUE_DEPTH`;
//! - random 4 KiB read and write IOPS at each configured queue depth;
//! - fdatasync latency (write one 4 KiB page, then flush, at queue depth 1), which bounds every
//!   durable write;
//! - per-I/O latency, from the instant the request was submitted to the instant its completion
//!   was reaped, in microseconds.
//!
//! Invariants:
//! - A closed loop keeps exactly `queue_depth` requests in flight: it submits that many, and every
//!   reap of at least one completion is followed by resubmitting as many as came back (until the
//!   test's limit is reached; then the ones in flight are drained and counted).
//! - The file is written in full before anything reads it, so no read is served from an unwritten
//!   extent (which the filesystem answers with zeros without touching the device).
//! - Any failed request or device call ends the probe with an error naming the test; no figure is
//!   reported from a test that saw a failure.
//! - Bad configurations are rejected before anything is created on disk.
//! - The probe file is removed at the end, also (best effort) when a test failed.
//!
//! Caveat: with the pread/pwrite fallback (`sync` backend, for kernels without io_uring) `submit`
//! performs the requests one after another before it returns, so a "queue depth" above 1 only
//! batches them: IOPS stay those of depth 1 and latencies include the wait for the whole batch.
//! The report names the backend so such figures are not mistaken for the device's.

use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use copse::device::{
    AlignedBuf, BlockDevice, DeviceError, DirStorage, FileId, IoKind, IoRequest, Storage,
    WriteDurability,
};
use copse::limits::PAGE_BYTES;
use copse::Backend;
use hdrhistogram::Histogram;
use indicatif::{ProgressBar, ProgressStyle};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

/// The file the probe writes, reads and removes, directly in the probed directory.
pub const PROBE_FILE_NAME: &str = "copse-device-probe.dat";

/// Test names, as they appear in [`ProbeResult::test`].
pub const RANDREAD_TEST: &str = "randread-4k";
pub const RANDWRITE_TEST: &str = "randwrite-4k";
pub const SEQREAD_TEST: &str = "seqread-128k";
pub const SEQWRITE_TEST: &str = "seqwrite-128k";
pub const FDATASYNC_TEST: &str = "fdatasync";

/// Random I/O moves one page: the unit of every copse data I/O.
pub const RANDOM_BLOCK_BYTES: usize = PAGE_BYTES;
/// Sequential I/O moves 128 KiB per request: large enough that per-request costs stop mattering
/// next to the transfer, and no larger than what most devices take in one command
/// (max_sectors_kb), so the kernel does not split it.
pub const SEQ_BLOCK_BYTES: usize = 128 * 1024;
/// Sequential requests in flight: a few 128 KiB requests saturate bandwidth; more only add
/// latency.
pub const SEQ_QUEUE_DEPTH: usize = 8;
/// Submission entries of the probe's ring. The deepest queue the probe keeps must fit in it, so
/// one submit never has to wait for completions to make room.
const RING_ENTRIES: u32 = 256;
/// The deepest queue a configuration may ask for (the ring's size).
pub const QUEUE_DEPTH_MAX: usize = RING_ENTRIES as usize;
/// Iterations of the fdatasync test at most (it also stops after `seconds_per_test`).
pub const FLUSH_SAMPLES: u64 = 200;
/// A test may run this long at most: beyond it, a typo (3000 for 3.0) would hold the machine for
/// hours.
pub const SECONDS_PER_TEST_MAX: f64 = 3600.0;
/// Latency histograms keep 3 significant digits (0.1 % relative error).
const HISTOGRAM_SIGNIFICANT_DIGITS: u8 = 3;
/// The largest latency a histogram tells apart: a slower I/O is recorded as one minute (a device
/// that slow is broken, not slow). The bound is explicit because hdrhistogram's saturating
/// record clamps to the histogram's range instead of growing it.
const LATENCY_US_MAX: u64 = 60_000_000;
/// The progress bar is redrawn at most this often (a redraw per completion would cost more than
/// the I/O at high IOPS).
const PROGRESS_INTERVAL: Duration = Duration::from_millis(100);

const NANOS_PER_MICRO: u64 = 1_000;
const BYTES_PER_MIB: f64 = 1024.0 * 1024.0;

/// Defaults of [`DeviceProbeConfig`].
pub const DEFAULT_DIR: &str = "./data";
pub const DEFAULT_FILE_BYTES: u64 = 1024 * 1024 * 1024;
pub const DEFAULT_SECONDS_PER_TEST: f64 = 3.0;
pub const DEFAULT_QUEUE_DEPTHS: [usize; 3] = [1, 32, 128];
pub const DEFAULT_SEED: u64 = 1;

#[derive(Clone, Debug)]
pub struct DeviceProbeConfig {
    /// Where the probe file is created (the directory is created if missing).
    pub dir: PathBuf,
    /// Size of the probe file: a multiple of `SEQ_BLOCK_BYTES`, at least `SEQ_BLOCK_BYTES` times
    /// the deepest queue (see `validate`).
    pub file_bytes: u64,
    /// Duration of each timed test (sequential read, each random test, fdatasync at most).
    pub seconds_per_test: f64,
    /// Queue depths of the random 4 KiB tests, each 1 to `QUEUE_DEPTH_MAX`.
    pub queue_depths: Vec<usize>,
    pub backend: Backend,
    /// Seeds the random offsets and the bytes written, so two runs issue the same I/O.
    pub seed: u64,
}

impl Default for DeviceProbeConfig {
    fn default() -> DeviceProbeConfig {
        DeviceProbeConfig {
            dir: PathBuf::from(DEFAULT_DIR),
            file_bytes: DEFAULT_FILE_BYTES,
            seconds_per_test: DEFAULT_SECONDS_PER_TEST,
            queue_depths: DEFAULT_QUEUE_DEPTHS.to_vec(),
            backend: Backend::Auto,
            seed: DEFAULT_SEED,
        }
    }
}

/// Percentiles of one latency histogram, in microseconds.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct LatencySummary {
    pub p50_us: f64,
    pub p90_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    pub p9999_us: f64,
    pub max_us: f64,
    pub mean_us: f64,
}

impl LatencySummary {
    /// Summarises a histogram whose values were recorded in microseconds. An empty histogram
    /// gives zeros. Each percentile is the highest value equivalent to the recorded ones at that
    /// rank (hdrhistogram's convention, also used for the max), so the figures never decrease
    /// from p50 to max.
    pub fn from_histogram(h: &Histogram<u64>) -> LatencySummary {
        let at = |quantile: f64| h.value_at_quantile(quantile) as f64;
        LatencySummary {
            p50_us: at(0.50),
            p90_us: at(0.90),
            p99_us: at(0.99),
            p999_us: at(0.999),
            p9999_us: at(0.9999),
            max_us: h.max() as f64,
            mean_us: h.mean(),
        }
    }
}

/// One test at one queue depth.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ProbeResult {
    /// One of `RANDREAD_TEST`, `RANDWRITE_TEST`, `SEQREAD_TEST`, `SEQWRITE_TEST`,
    /// `FDATASYNC_TEST`.
    pub test: String,
    pub queue_depth: usize,
    /// Bytes per request.
    pub block_bytes: u64,
    /// Completed requests (for fdatasync: write-then-flush cycles).
    pub ios: u64,
    /// From the first submit to the last reap (an end-of-test flush is not included).
    pub seconds: f64,
    pub iops: f64,
    pub bytes_per_second: f64,
    /// Per request, submit to reap; for fdatasync, the flush alone.
    pub latency: LatencySummary,
    /// The flush that ended a write test (making its writes durable), not counted in `seconds`;
    /// `None` for tests that end without one.
    #[serde(default)]
    pub flush_us: Option<f64>,
}

/// Everything one probe measured.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct DeviceReport {
    pub dir: String,
    /// The backend `DirStorage` resolved: "uring" or "sync".
    pub backend: String,
    pub file_bytes: u64,
    pub results: Vec<ProbeResult>,
}

impl DeviceReport {
    /// The result of one test at one depth, if measured.
    pub fn find(&self, test: &str, queue_depth: usize) -> Option<&ProbeResult> {
        self.results.iter().find(|result| result.test == test && result.queue_depth == queue_depth)
    }

    /// Highest random 4 KiB read IOPS over the measured depths (the read limit line).
    pub fn read_iops_max(&self) -> Option<f64> {
        self.iops_max(RANDREAD_TEST)
    }

    /// Highest random 4 KiB write IOPS over the measured depths (the write limit line).
    pub fn write_iops_max(&self) -> Option<f64> {
        self.iops_max(RANDWRITE_TEST)
    }

    fn iops_max(&self, test: &str) -> Option<f64> {
        self.results
            .iter()
            .filter(|result| result.test == test)
            .map(|result| result.iops)
            .reduce(f64::max)
    }

    /// A markdown table: test, QD, IOPS, MiB/s, p50/p99/p99.9/max latency in µs, and the flush
    /// that ended a write test.
    pub fn markdown(&self) -> String {
        let mut table = String::from(
            "| test | QD | IOPS | MiB/s | p50 µs | p99 µs | p99.9 µs | max µs | end flush µs |\n\
             |---|--:|--:|--:|--:|--:|--:|--:|--:|\n",
        );
        for result in &self.results {
            let latency = &result.latency;
            let flush = match result.flush_us {
                Some(flush_us) => format!("{flush_us:.0}"),
                None => "-".to_string(),
            };
            table.push_str(&format!(
                "| {} | {} | {:.0} | {:.1} | {:.0} | {:.0} | {:.0} | {:.0} | {} |\n",
                result.test,
                result.queue_depth,
                result.iops,
                result.bytes_per_second / BYTES_PER_MIB,
                latency.p50_us,
                latency.p99_us,
                latency.p999_us,
                latency.max_us,
                flush,
            ));
        }
        table
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    /// A device call or an I/O failed; `test` names the test (and depth) it belonged to.
    #[error("device probe, {test}: {source}")]
    Device {
        test: String,
        #[source]
        source: DeviceError,
    },
    #[error("bad device probe configuration: {0}")]
    Config(String),
    /// Removing the probe file failed (the measurements themselves succeeded).
    #[error("removing the probe file {PROBE_FILE_NAME}: {0}")]
    Io(#[from] std::io::Error),
}

/// Runs every test; `progress` true draws a progress bar per test on stderr.
///
/// Order, and why:
/// 1. create and grow the file (fallocate: allocated but unwritten extents);
/// 2. sequential write over the whole file, then one flush: every later read hits written
///    blocks (an unwritten extent reads as zeros without touching the device, which would fake
///    the read figures), and random writes later overwrite written blocks, as the engine's slab
///    writes do, instead of paying for extent conversion;
/// 3. sequential read; 4. random reads at each depth: the reads run on the freshly written file
///    before random writes leave the device with garbage collection to do;
/// 5. random writes at each depth, each ended by one flush (timed apart);
/// 6. fdatasync latency, last, since it needs written blocks too and disturbs nothing after it;
/// 7. the file is removed, also when a test failed.
pub fn probe(config: &DeviceProbeConfig, progress: bool) -> Result<DeviceReport, ProbeError> {
    validate(config)?;
    let storage =
        DirStorage::new(&config.dir, config.backend, WriteDurability::FlushPerRound, RING_ENTRIES)
            .map_err(|source| ProbeError::Device { test: "open storage".into(), source })?;
    let outcome = run_tests(&storage, config, progress);
    // `run_tests` has dropped its device, which waits for any request still in flight, so no
    // I/O touches the file while it is removed.
    let removed = remove_probe_file(&config.dir);
    match (outcome, removed) {
        (Ok(report), Ok(())) => Ok(report),
        (Ok(_), Err(err)) => Err(ProbeError::Io(err)),
        (Err(err), Ok(())) => Err(err),
        (Err(err), Err(remove_err)) => {
            tracing::warn!(
                %remove_err,
                dir = %config.dir.display(),
                "could not remove the probe file after a failed probe"
            );
            Err(err)
        }
    }
}

/// Rejects what would make a test meaningless or impossible, before anything touches the disk.
fn validate(config: &DeviceProbeConfig) -> Result<(), ProbeError> {
    let bad = |message: String| Err(ProbeError::Config(message));
    if config.queue_depths.is_empty() {
        return bad("no queue depths for the random tests".into());
    }
    for &depth in &config.queue_depths {
        if depth == 0 || depth > QUEUE_DEPTH_MAX {
            return bad(format!("queue depth {depth} is not between 1 and {QUEUE_DEPTH_MAX}"));
        }
    }
    let seconds = config.seconds_per_test;
    if !(seconds.is_finite() && seconds > 0.0 && seconds <= SECONDS_PER_TEST_MAX) {
        return bad(format!(
            "seconds per test {seconds} is not above 0 and at most {SECONDS_PER_TEST_MAX}"
        ));
    }
    let seq_block_bytes = SEQ_BLOCK_BYTES as u64;
    if !config.file_bytes.is_multiple_of(seq_block_bytes) {
        return bad(format!(
            "file size {} bytes is not a multiple of {SEQ_BLOCK_BYTES} (the sequential block)",
            config.file_bytes
        ));
    }
    // The sequential tests keep SEQ_QUEUE_DEPTH distinct blocks in flight, so the file must hold
    // that many; the random tests need room to spread their in-flight pages (at least 32 pages
    // per request in flight), or they would hammer a few pages the device serves from its cache.
    let deepest = config.queue_depths.iter().copied().max().unwrap_or(1).max(SEQ_QUEUE_DEPTH);
    let min_file_bytes = seq_block_bytes * deepest as u64;
    if config.file_bytes < min_file_bytes {
        return bad(format!(
            "file size {} bytes is below {min_file_bytes} ({SEQ_BLOCK_BYTES} bytes per request \
             of the deepest queue, {deepest})",
            config.file_bytes
        ));
    }
    Ok(())
}

fn remove_probe_file(dir: &Path) -> Result<(), std::io::Error> {
    match std::fs::remove_file(dir.join(PROBE_FILE_NAME)) {
        Err(err) if err.kind() != ErrorKind::NotFound => Err(err),
        // Not found: the probe failed before creating it.
        _ => Ok(()),
    }
}

/// Steps 1 to 6 of `probe`. The device is dropped on return.
fn run_tests(
    storage: &DirStorage,
    config: &DeviceProbeConfig,
    progress: bool,
) -> Result<DeviceReport, ProbeError> {
    let setup = |source| ProbeError::Device { test: "setup".into(), source };
    let mut device = storage.open_device().map_err(setup)?;
    let file = device.open_file(PROBE_FILE_NAME, true).map_err(setup)?;
    device.grow_file(file, config.file_bytes).map_err(setup)?;
    let mut probe = Probe {
        device,
        file,
        file_bytes: config.file_bytes,
        rng: StdRng::seed_from_u64(config.seed),
        // `validate` bounded it, so this conversion cannot fail.
        test_time: Duration::from_secs_f64(config.seconds_per_test),
        progress,
    };

    let mut results = Vec::new();
    let whole_file_ios = config.file_bytes / SEQ_BLOCK_BYTES as u64;
    results.push(probe.run_phase(&Phase {
        test: SEQWRITE_TEST,
        kind: IoKind::Write,
        block_bytes: SEQ_BLOCK_BYTES,
        queue_depth: SEQ_QUEUE_DEPTH,
        sequential: true,
        limit: Limit::Ios(whole_file_ios),
    })?);
    results.push(probe.run_phase(&Phase {
        test: SEQREAD_TEST,
        kind: IoKind::Read,
        block_bytes: SEQ_BLOCK_BYTES,
        queue_depth: SEQ_QUEUE_DEPTH,
        sequential: true,
        limit: Limit::Time,
    })?);
    for (test, kind) in [(RANDREAD_TEST, IoKind::Read), (RANDWRITE_TEST, IoKind::Write)] {
        for &queue_depth in &config.queue_depths {
            results.push(probe.run_phase(&Phase {
                test,
                kind,
                block_bytes: RANDOM_BLOCK_BYTES,
                queue_depth,
                sequential: false,
                limit: Limit::Time,
            })?);
        }
    }
    results.push(probe.run_fdatasync()?);

    let backend = match storage.backend() {
        Backend::Uring => "uring",
        Backend::Sync => "sync",
        // `DirStorage::new` resolves Auto; kept distinct should that ever change.
        Backend::Auto => "auto",
    };
    Ok(DeviceReport {
        dir: config.dir.display().to_string(),
        backend: backend.to_string(),
        file_bytes: config.file_bytes,
        results,
    })
}

/// When a test stops submitting.
#[derive(Clone, Copy, Debug)]
enum Limit {
    /// After this many requests (the sequential fill: exactly the whole file).
    Ios(u64),
    /// After `seconds_per_test`.
    Time,
}

/// One closed-loop test.
struct Phase {
    test: &'static str,
    kind: IoKind,
    block_bytes: usize,
    queue_depth: usize,
    /// Consecutive blocks from offset 0, wrapping at the end of the file; else uniformly random
    /// block-aligned offsets over the whole file.
    sequential: bool,
    limit: Limit,
}

impl Phase {
    /// The test and depth, for errors and progress.
    fn label(&self) -> String {
        format!("{} at queue depth {}", self.test, self.queue_depth)
    }
}

struct Probe {
    device: Box<dyn BlockDevice>,
    file: FileId,
    file_bytes: u64,
    rng: StdRng,
    test_time: Duration,
    progress: bool,
}

impl Probe {
    /// Runs one closed-loop test; for writes, ends it with a flush timed apart.
    fn run_phase(&mut self, phase: &Phase) -> Result<ProbeResult, ProbeError> {
        let label = phase.label();
        let fail = |source: DeviceError| ProbeError::Device { test: label.clone(), source };
        let mut histogram = new_histogram()?;
        let bar_len = match phase.limit {
            Limit::Ios(ios) => ios,
            Limit::Time => duration_millis(self.test_time),
        };
        let bar = self.progress_bar(&label, bar_len);
        // One buffer per request in flight, reused from each completion: no allocation in the
        // loop. Written bytes are random so that a compressing or deduplicating device (or
        // host) cannot shortcut them.
        let mut free_buffers: Vec<AlignedBuf> =
            (0..phase.queue_depth).map(|_| self.buffer(phase.kind, phase.block_bytes)).collect();
        // Not zero: `validate` requires several sequential blocks, so the ranges below are never
        // empty.
        let blocks = self.file_bytes / phase.block_bytes as u64;
        let mut next_block = 0u64;
        let mut completions = Vec::with_capacity(phase.queue_depth);
        let mut submitted = 0u64;
        let mut ios = 0u64;
        let start = Instant::now();
        let mut last_reap = start;
        let mut last_draw = start;
        loop {
            let refill = match phase.limit {
                Limit::Ios(total) => total - submitted,
                Limit::Time if last_reap.duration_since(start) < self.test_time => u64::MAX,
                Limit::Time => 0,
            };
            let count = free_buffers.len().min(usize::try_from(refill).unwrap_or(usize::MAX));
            if count > 0 {
                let mut requests = Vec::with_capacity(count);
                let mut offsets = Vec::with_capacity(count);
                for _ in 0..count {
                    let block = if phase.sequential {
                        let block = next_block;
                        next_block = (next_block + 1) % blocks;
                        block
                    } else {
                        self.rng.gen_range(0..blocks)
                    };
                    offsets.push(block * phase.block_bytes as u64);
                }
                // The token is the submit instant (nanoseconds since the test started), taken as
                // late as possible: the latency then includes the submit call, as the engine sees.
                let token = nanos_since(start, Instant::now());
                for (offset, buf) in offsets.into_iter().zip(free_buffers.drain(..count)) {
                    requests.push(IoRequest {
                        token,
                        file: self.file,
                        offset,
                        kind: phase.kind,
                        buf,
                    });
                }
                submitted += count as u64;
                self.device.submit(requests).map_err(fail)?;
            }
            if self.device.in_flight() == 0 {
                break;
            }
            completions.clear();
            self.device.reap(1, &mut completions).map_err(fail)?;
            last_reap = Instant::now();
            let reaped_nanos = nanos_since(start, last_reap);
            for completion in completions.drain(..) {
                completion.result.map_err(fail)?;
                let latency_nanos = reaped_nanos.saturating_sub(completion.token);
                record_us(&mut histogram, nanos_to_micros(latency_nanos));
                ios += 1;
                free_buffers.push(completion.buf);
            }
            if last_reap.duration_since(last_draw) >= PROGRESS_INTERVAL {
                last_draw = last_reap;
                let elapsed = last_reap.duration_since(start);
                bar.set_position(match phase.limit {
                    Limit::Ios(_) => ios,
                    Limit::Time => duration_millis(elapsed).min(bar_len),
                });
                bar.set_message(format!("{:.0} IOPS", rate(ios, elapsed.as_secs_f64())));
            }
        }
        let seconds = last_reap.duration_since(start).as_secs_f64();
        // A write test ends with a flush so that its writes do not linger in the device cache
        // and slow down the next test; it is timed apart because the IOPS figure is the device's
        // plain write limit (the engine flushes once per round, not once per write).
        let flush_us = match phase.kind {
            IoKind::Write => {
                let flush_start = Instant::now();
                self.device.flush().map_err(fail)?;
                Some(flush_start.elapsed().as_secs_f64() * 1e6)
            }
            IoKind::Read => None,
        };
        let result = ProbeResult {
            test: phase.test.to_string(),
            queue_depth: phase.queue_depth,
            block_bytes: phase.block_bytes as u64,
            ios,
            seconds,
            iops: rate(ios, seconds),
            bytes_per_second: rate(ios * phase.block_bytes as u64, seconds),
            latency: LatencySummary::from_histogram(&histogram),
            flush_us,
        };
        finish_bar(&bar, &result);
        Ok(result)
    }

    /// `FLUSH_SAMPLES` cycles (or `seconds_per_test`, whichever ends first; at least one) of: write
    /// one random page, wait for it, flush. Only the flush is recorded: it is what a durable
    /// write costs beyond the write itself.
    fn run_fdatasync(&mut self) -> Result<ProbeResult, ProbeError> {
        let label = format!("{FDATASYNC_TEST} at queue depth 1");
        let fail = |source: DeviceError| ProbeError::Device { test: label.clone(), source };
        let mut histogram = new_histogram()?;
        let bar = self.progress_bar(&label, FLUSH_SAMPLES);
        let pages = self.file_bytes / PAGE_BYTES as u64;
        let mut buf = self.buffer(IoKind::Write, PAGE_BYTES);
        let mut completions = Vec::with_capacity(1);
        let mut samples = 0u64;
        let start = Instant::now();
        while samples < FLUSH_SAMPLES && (samples == 0 || start.elapsed() < self.test_time) {
            let offset = self.rng.gen_range(0..pages) * PAGE_BYTES as u64;
            let request = IoRequest { token: 0, file: self.file, offset, kind: IoKind::Write, buf };
            self.device.submit(vec![request]).map_err(fail)?;
            completions.clear();
            while completions.is_empty() {
                if self.device.in_flight() == 0 {
                    let lost =
                        DeviceError::BadRequest("a write vanished without completing".into());
                    return Err(fail(lost));
                }
                self.device.reap(1, &mut completions).map_err(fail)?;
            }
            let completion = completions.swap_remove(0);
            completion.result.map_err(fail)?;
            buf = completion.buf;
            let flush_start = Instant::now();
            self.device.flush().map_err(fail)?;
            record_us(&mut histogram, duration_micros(flush_start.elapsed()));
            samples += 1;
            bar.set_position(samples);
        }
        let seconds = start.elapsed().as_secs_f64();
        let result = ProbeResult {
            test: FDATASYNC_TEST.to_string(),
            queue_depth: 1,
            block_bytes: PAGE_BYTES as u64,
            ios: samples,
            seconds,
            // Durable 4 KiB writes per second at queue depth 1.
            iops: rate(samples, seconds),
            bytes_per_second: rate(samples * PAGE_BYTES as u64, seconds),
            latency: LatencySummary::from_histogram(&histogram),
            flush_us: None,
        };
        finish_bar(&bar, &result);
        Ok(result)
    }

    /// A buffer for one request: zeros for a read, random bytes for a write.
    fn buffer(&mut self, kind: IoKind, block_bytes: usize) -> AlignedBuf {
        let mut buf = AlignedBuf::zeroed(block_bytes);
        if kind == IoKind::Write {
            self.rng.fill(&mut buf[..]);
        }
        buf
    }

    fn progress_bar(&self, label: &str, len: u64) -> ProgressBar {
        if !self.progress {
            return ProgressBar::hidden();
        }
        let style = ProgressStyle::with_template("{prefix:<32} [{bar:30}] {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar());
        let bar = ProgressBar::new(len).with_style(style);
        bar.set_prefix(label.to_string());
        bar
    }
}

fn finish_bar(bar: &ProgressBar, result: &ProbeResult) {
    bar.finish_with_message(format!(
        "{:.0} IOPS, {:.1} MiB/s, p99 {:.0} µs",
        result.iops,
        result.bytes_per_second / BYTES_PER_MIB,
        result.latency.p99_us
    ));
}

fn new_histogram() -> Result<Histogram<u64>, ProbeError> {
    // Only fails for bounds or digits out of hdrhistogram's range, which constants rule out.
    Histogram::new_with_bounds(1, LATENCY_US_MAX, HISTOGRAM_SIGNIFICANT_DIGITS)
        .map_err(|err| ProbeError::Config(format!("latency histogram: {err}")))
}

/// Records one latency; above `LATENCY_US_MAX` it records the maximum (never an error).
fn record_us(histogram: &mut Histogram<u64>, latency_us: u64) {
    histogram.saturating_record(latency_us.min(LATENCY_US_MAX));
}

/// `count` per second over `seconds`; 0 for an empty interval rather than infinity.
fn rate(count: u64, seconds: f64) -> f64 {
    if seconds > 0.0 {
        count as f64 / seconds
    } else {
        0.0
    }
}

fn nanos_since(start: Instant, now: Instant) -> u64 {
    u64::try_from(now.duration_since(start).as_nanos()).unwrap_or(u64::MAX)
}

/// Rounded to the nearest microsecond, so a 0.6 µs completion does not record as 0.
fn nanos_to_micros(nanos: u64) -> u64 {
    nanos.saturating_add(NANOS_PER_MICRO / 2) / NANOS_PER_MICRO
}

/// A duration in microseconds, rounded to the nearest (the runner records its latencies so too).
pub(crate) fn duration_micros(duration: Duration) -> u64 {
    nanos_to_micros(u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX))
}

fn duration_millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// A device report written by `bench device --json`, read back (for `--device-json`).
pub fn read_report(path: &std::path::Path) -> Result<DeviceReport, String> {
    let text = std::fs::read_to_string(path).map_err(|err| format!("{}: {err}", path.display()))?;
    serde_json::from_str(&text).map_err(|err| format!("{}: {err}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEST_FILE_BYTES: u64 = 8 * 1024 * 1024;
    const TEST_SECONDS: f64 = 0.2;
    const TEST_DEPTHS: [usize; 2] = [1, 4];

    /// A fresh directory that accepts O_DIRECT. Like copse's own tests it starts from the system
    /// temp dir; where that is tmpfs (which refuses O_DIRECT) it falls back to this crate's
    /// directory, which sits on a real filesystem in any checkout.
    fn scratch_dir() -> tempfile::TempDir {
        use std::os::unix::fs::OpenOptionsExt;
        let accepts_direct = |dir: &Path| {
            let check = dir.join("o-direct-check");
            let opened = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .custom_flags(libc::O_DIRECT)
                .open(&check);
            let _ = std::fs::remove_file(&check);
            opened.is_ok()
        };
        let dir = tempfile::tempdir().unwrap();
        if accepts_direct(dir.path()) {
            return dir;
        }
        let dir = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        assert!(accepts_direct(dir.path()), "no directory here accepts O_DIRECT");
        dir
    }

    fn small_config(dir: &Path) -> DeviceProbeConfig {
        DeviceProbeConfig {
            dir: dir.to_path_buf(),
            file_bytes: TEST_FILE_BYTES,
            seconds_per_test: TEST_SECONDS,
            queue_depths: TEST_DEPTHS.to_vec(),
            backend: Backend::Auto,
            seed: 7,
        }
    }

    fn assert_sane(result: &ProbeResult) {
        let name = format!("{} QD{}", result.test, result.queue_depth);
        assert!(result.ios > 0, "{name}: {result:?}");
        assert!(result.seconds > 0.0, "{name}: {result:?}");
        assert!(result.iops > 0.0, "{name}: {result:?}");
        assert!(result.bytes_per_second > 0.0, "{name}: {result:?}");
        let expected_bytes_per_second = result.iops * result.block_bytes as f64;
        assert!(
            (result.bytes_per_second - expected_bytes_per_second).abs()
                < 1e-6 * result.bytes_per_second,
            "{name}"
        );
        let l = &result.latency;
        let chain = [l.p50_us, l.p90_us, l.p99_us, l.p999_us, l.p9999_us, l.max_us];
        assert!(chain.windows(2).all(|pair| pair[0] <= pair[1]), "{name}: {l:?}");
        assert!(l.max_us > 0.0, "{name}: {l:?}");
        assert!(l.mean_us <= l.max_us, "{name}: {l:?}");
        if result.test != FDATASYNC_TEST {
            // Little's law: a closed loop has `queue_depth` requests in flight at most, and close
            // to that many most of the time, so mean latency × IOPS is a little below the depth.
            // The lower bound is loose: the loop's own work between reap and submit counts as
            // time with fewer in flight, and this machine may be busy.
            let in_flight_mean = l.mean_us * 1e-6 * result.iops;
            let depth = result.queue_depth as f64;
            assert!(in_flight_mean <= depth * 1.01 + 0.01, "{name}: {in_flight_mean} in flight");
            assert!(in_flight_mean >= depth * 0.1, "{name}: {in_flight_mean} in flight");
        }
    }

    #[test]
    fn small_probe_measures_everything_and_cleans_up() {
        let dir = scratch_dir();
        let config = small_config(dir.path());
        let report = probe(&config, false).unwrap();

        assert_eq!(report.file_bytes, TEST_FILE_BYTES);
        assert!(["uring", "sync"].contains(&report.backend.as_str()), "{}", report.backend);
        assert_eq!(report.results.len(), 3 + 2 * TEST_DEPTHS.len());
        for result in &report.results {
            assert_sane(result);
        }
        for &depth in &TEST_DEPTHS {
            let read = report.find(RANDREAD_TEST, depth).unwrap();
            assert_eq!(read.block_bytes, PAGE_BYTES as u64);
            assert_eq!(read.flush_us, None);
            let write = report.find(RANDWRITE_TEST, depth).unwrap();
            assert!(write.flush_us.is_some_and(|flush_us| flush_us >= 0.0));
            // Timed tests stop submitting at the limit; draining the last queue adds little.
            assert!(read.seconds >= TEST_SECONDS && read.seconds < TEST_SECONDS + 1.0);
        }
        let seq_write = report.find(SEQWRITE_TEST, SEQ_QUEUE_DEPTH).unwrap();
        assert_eq!(seq_write.block_bytes, SEQ_BLOCK_BYTES as u64);
        assert!(seq_write.ios * SEQ_BLOCK_BYTES as u64 >= TEST_FILE_BYTES, "{seq_write:?}");
        assert!(seq_write.flush_us.is_some());
        assert!(report.find(SEQREAD_TEST, SEQ_QUEUE_DEPTH).is_some());
        let sync = report.find(FDATASYNC_TEST, 1).unwrap();
        assert!(sync.ios <= FLUSH_SAMPLES);

        let read_max = report.read_iops_max().unwrap();
        for &depth in &TEST_DEPTHS {
            assert!(read_max >= report.find(RANDREAD_TEST, depth).unwrap().iops);
        }
        assert!(report.write_iops_max().unwrap() > 0.0);
        assert!(report.find(RANDREAD_TEST, 128).is_none());

        assert!(!dir.path().join(PROBE_FILE_NAME).exists(), "probe file left behind");
        let table = report.markdown();
        assert_eq!(table.lines().count(), 2 + report.results.len(), "{table}");
        assert!(table.contains("| randread-4k | 4 |"), "{table}");
    }

    #[test]
    fn sync_fallback_backend_measures_too() {
        let dir = scratch_dir();
        let config = DeviceProbeConfig { backend: Backend::Sync, ..small_config(dir.path()) };
        let report = probe(&config, false).unwrap();
        assert_eq!(report.backend, "sync");
        assert_eq!(report.results.len(), 3 + 2 * TEST_DEPTHS.len());
        for result in &report.results {
            assert_sane(result);
        }
        assert!(!dir.path().join(PROBE_FILE_NAME).exists(), "probe file left behind");
    }

    #[test]
    fn bad_configs_are_refused_before_touching_the_disk() {
        let parent = scratch_dir();
        let dir = parent.path().join("not-created");
        let base = small_config(&dir);
        let cases = [
            DeviceProbeConfig { queue_depths: vec![1, 0], ..base.clone() },
            DeviceProbeConfig { queue_depths: vec![], ..base.clone() },
            DeviceProbeConfig { queue_depths: vec![QUEUE_DEPTH_MAX + 1], ..base.clone() },
            // Smaller than SEQ_QUEUE_DEPTH sequential blocks.
            DeviceProbeConfig { file_bytes: SEQ_BLOCK_BYTES as u64, ..base.clone() },
            // Smaller than one sequential block per request of the deepest queue.
            DeviceProbeConfig {
                file_bytes: 16 * SEQ_BLOCK_BYTES as u64,
                queue_depths: vec![32],
                ..base.clone()
            },
            DeviceProbeConfig { file_bytes: TEST_FILE_BYTES + PAGE_BYTES as u64, ..base.clone() },
            DeviceProbeConfig { file_bytes: 0, ..base.clone() },
            DeviceProbeConfig { seconds_per_test: 0.0, ..base.clone() },
            DeviceProbeConfig { seconds_per_test: -1.0, ..base.clone() },
            DeviceProbeConfig { seconds_per_test: f64::NAN, ..base.clone() },
            DeviceProbeConfig { seconds_per_test: f64::INFINITY, ..base.clone() },
        ];
        for config in &cases {
            match probe(config, false) {
                Err(ProbeError::Config(message)) => assert!(!message.is_empty()),
                other => panic!("{config:?} gave {other:?}"),
            }
            assert!(!dir.exists(), "{config:?} created the directory");
        }
        assert!(validate(&base).is_ok());
    }

    #[test]
    fn default_config() {
        let config = DeviceProbeConfig::default();
        assert_eq!(config.dir, PathBuf::from("./data"));
        assert_eq!(config.file_bytes, 1 << 30);
        assert_eq!(config.seconds_per_test, 3.0);
        assert_eq!(config.queue_depths, vec![1, 32, 128]);
        assert_eq!(config.backend, Backend::Auto);
        assert_eq!(config.seed, 1);
        assert!(validate(&config).is_ok());
    }

    #[test]
    fn latency_summary_of_known_values() {
        let mut histogram = new_histogram().unwrap();
        for value_us in 1..=1000u64 {
            record_us(&mut histogram, value_us);
        }
        let summary = LatencySummary::from_histogram(&histogram);
        assert_eq!(summary.p50_us, 500.0);
        assert_eq!(summary.p90_us, 900.0);
        assert_eq!(summary.p99_us, 990.0);
        assert_eq!(summary.max_us, 1000.0);
        assert!((summary.mean_us - 500.5).abs() < 0.5, "{summary:?}");

        // Slow I/Os keep their size (0.1 % precision) up to the bound, and saturate there.
        let mut slow = new_histogram().unwrap();
        record_us(&mut slow, 0);
        record_us(&mut slow, 7_654_321);
        let max_us = LatencySummary::from_histogram(&slow).max_us;
        assert!((max_us - 7_654_321.0).abs() <= 7_654.0, "{max_us}");
        assert_eq!(LatencySummary::from_histogram(&slow).p50_us, 0.0);
        record_us(&mut slow, u64::MAX);
        let max_us = LatencySummary::from_histogram(&slow).max_us;
        assert!((max_us - LATENCY_US_MAX as f64).abs() <= LATENCY_US_MAX as f64 / 1000.0);

        let empty = LatencySummary::from_histogram(&new_histogram().unwrap());
        assert_eq!(empty.p50_us, 0.0);
        assert_eq!(empty.max_us, 0.0);
    }

    fn result(test: &str, queue_depth: usize, iops: f64) -> ProbeResult {
        ProbeResult {
            test: test.to_string(),
            queue_depth,
            block_bytes: PAGE_BYTES as u64,
            ios: 10,
            seconds: 1.0,
            iops,
            bytes_per_second: iops * PAGE_BYTES as f64,
            latency: LatencySummary {
                p50_us: 80.0,
                p90_us: 90.0,
                p99_us: 120.0,
                p999_us: 300.0,
                p9999_us: 400.0,
                max_us: 512.0,
                mean_us: 85.0,
            },
            flush_us: None,
        }
    }

    #[test]
    fn report_lookup_limits_markdown_and_json() {
        let mut report = DeviceReport {
            dir: "/d".into(),
            backend: "uring".into(),
            file_bytes: TEST_FILE_BYTES,
            results: vec![
                result(RANDREAD_TEST, 1, 10_000.0),
                result(RANDREAD_TEST, 32, 250_000.0),
                result(RANDREAD_TEST, 128, 240_000.0),
                result(RANDWRITE_TEST, 1, 30_000.0),
            ],
        };
        report.results[3].flush_us = Some(1234.4);
        assert_eq!(report.find(RANDREAD_TEST, 32).unwrap().iops, 250_000.0);
        assert!(report.find(RANDWRITE_TEST, 32).is_none());
        assert_eq!(report.read_iops_max(), Some(250_000.0));
        assert_eq!(report.write_iops_max(), Some(30_000.0));
        let empty = DeviceReport { results: vec![], ..report.clone() };
        assert_eq!((empty.read_iops_max(), empty.write_iops_max()), (None, None));

        let table = report.markdown();
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), 6, "{table}");
        assert!(lines[0].starts_with("| test | QD | IOPS | MiB/s |"), "{table}");
        assert_eq!(lines[3], "| randread-4k | 32 | 250000 | 976.6 | 80 | 120 | 300 | 512 | - |");
        assert!(lines[5].ends_with("| 1234 |"), "{table}");

        let json = serde_json::to_string(&report).unwrap();
        let back: DeviceReport = serde_json::from_str(&json).unwrap();
        assert_eq!(back, report);
    }

    #[test]
    fn micros_round_to_nearest() {
        assert_eq!(nanos_to_micros(0), 0);
        assert_eq!(nanos_to_micros(499), 0);
        assert_eq!(nanos_to_micros(500), 1);
        assert_eq!(nanos_to_micros(1_499), 1);
        assert_eq!(nanos_to_micros(u64::MAX), u64::MAX / NANOS_PER_MICRO);
        assert_eq!(rate(10, 0.0), 0.0);
        assert_eq!(rate(10, 2.0), 5.0);
    }
}
