//! The JSON a run writes (one file per run; `SCHEMA_VERSION` names its shape) and the process
//! figures it is made of: CPU seconds and device bytes from /proc (the same source for every
//! engine, so the figures compare), resident memory, the machine and the date.
//!
//! Invariant: every field is a measurement of this run or its configuration; a figure the run
//! could not measure is `null`, never a guess.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::device::LatencySummary;
use crate::engine::EngineFigures;

/// Version of the run JSON (spec: docs/format/bench-run.md). History: 1 (2026-11-22) first.
pub const SCHEMA_VERSION: u32 = 1;
/// Linux reports CPU time in clock ticks of USER_HZ, which is 100 on every Linux ABI.
const USER_HZ: f64 = 100.0;
/// Percentiles of the latency curves stored with each operation type (for plots).
pub const CURVE_PERCENTILES: [f64; 13] =
    [0.0, 50.0, 75.0, 90.0, 95.0, 99.0, 99.5, 99.9, 99.95, 99.99, 99.995, 99.999, 100.0];

/// One run: an engine, a load, and the phases after it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RunReport {
    pub schema_version: u32,
    pub date_utc: String,
    pub unix_seconds: u64,
    pub machine: Machine,
    pub config: RunConfigReport,
    pub phases: Vec<PhaseReport>,
    /// Bytes the store occupies on disk after the last phase.
    pub disk_bytes_end: u64,
    /// Highest resident set of the process over the whole run.
    pub peak_rss_bytes: u64,
    pub engine_figures: EngineFigures,
    /// Wrong or missing values and engine errors over all phases (must be 0).
    pub errors: u64,
}

/// The configuration as it ran.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RunConfigReport {
    pub engine: String,
    pub durable: bool,
    pub record_count: u64,
    pub record_bytes: String,
    pub key_bytes_mean: f64,
    pub dataset_bytes: u64,
    pub cache_bytes: u64,
    pub dataset_to_cache: f64,
    pub threads: usize,
    pub mode: String,
    pub target_ops_per_second: Option<f64>,
    pub phase_ops_max: Option<u64>,
    pub phase_seconds_max: Option<f64>,
    pub seed: u64,
    pub shards: Option<usize>,
    /// The device probe whose limits the utilisation figures use, if one was given.
    pub device_read_iops: Option<f64>,
    pub device_write_iops: Option<f64>,
}

/// One phase (the load, or a workload under a distribution).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PhaseReport {
    pub phase: String,
    pub workload: String,
    pub distribution: String,
    pub mode: String,
    pub threads: usize,
    pub ops: u64,
    pub seconds: f64,
    pub ops_per_second: f64,
    /// Operations finished in each whole second of the phase.
    pub timeline_ops_per_second: Vec<f64>,
    pub operations: BTreeMap<String, OpReport>,
    /// Every operation together.
    pub latency: LatencySummary,
    /// Open loop: how late requests were issued after they were due (the harness's own delay,
    /// included in the latencies); null in closed loop.
    pub schedule_lag: Option<LatencySummary>,
    pub errors: u64,
    /// The first few errors, for the reader.
    pub error_samples: Vec<String>,
    pub cpu_user_seconds: f64,
    pub cpu_system_seconds: f64,
    pub device_read_bytes: u64,
    pub device_write_bytes: u64,
    /// Key and value bytes the clients wrote.
    pub user_write_bytes: u64,
    /// Device bytes written per user byte written in the phase's window (null when nothing
    /// was written).
    pub write_amplification: Option<f64>,
    /// After the phase the engine finishes the background work it caused (RocksDB: flushes and
    /// compactions; copse: nothing), measured here and charged to this phase.
    pub settle_seconds: f64,
    pub settle_cpu_seconds: f64,
    pub settle_device_read_bytes: u64,
    pub settle_device_write_bytes: u64,
    /// Device bytes written in the window and the settle, per user byte.
    pub write_amplification_with_settle: Option<f64>,
    /// 4 KiB-equivalent device I/Os per request, read and write.
    pub read_ios_per_op: f64,
    pub write_ios_per_op: f64,
    /// Requests per second the device allows at these I/Os per request, from the probe's random
    /// 4 KiB IOPS; null without a probe.
    pub device_limit_ops_per_second: Option<f64>,
    /// Throughput as a fraction of that limit.
    pub device_utilisation: Option<f64>,
    pub rss_bytes_end: u64,
    pub disk_bytes_end: u64,
    pub engine_figures: EngineFigures,
}

impl PhaseReport {
    /// The process's CPU time (user + system, the settle after the phase included) per
    /// operation, in µs: the CPU cost of a request, which throughput alone hides. NaN before
    /// any operation.
    pub fn cpu_us_per_op(&self) -> f64 {
        let cpu_seconds = self.cpu_user_seconds + self.cpu_system_seconds + self.settle_cpu_seconds;
        if self.ops == 0 {
            return f64::NAN;
        }
        cpu_seconds * 1e6 / self.ops as f64
    }
}

/// One operation type within a phase.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct OpReport {
    pub count: u64,
    pub errors: u64,
    pub latency: LatencySummary,
    /// (percentile, microseconds) at [`CURVE_PERCENTILES`].
    pub curve_us: Vec<(f64, f64)>,
}

/// The machine a run happened on.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Machine {
    pub hostname: String,
    pub cores: usize,
    pub memory_bytes: u64,
    pub kernel: String,
}

impl Machine {
    pub fn current() -> Machine {
        let read =
            |path: &str| std::fs::read_to_string(path).unwrap_or_default().trim().to_string();
        Machine {
            hostname: read("/proc/sys/kernel/hostname"),
            cores: std::thread::available_parallelism().map_or(1, |cores| cores.get()),
            memory_bytes: proc_field("/proc/meminfo", "MemTotal:").unwrap_or(0) * 1024,
            kernel: read("/proc/sys/kernel/osrelease"),
        }
    }

    pub fn describe(&self) -> String {
        format!(
            "{} ({} cores, {:.0} GiB, Linux {})",
            self.hostname,
            self.cores,
            self.memory_bytes as f64 / (1u64 << 30) as f64,
            self.kernel
        )
    }
}

/// The process's counters at one instant.
#[derive(Clone, Copy, Debug, Default)]
pub struct ProcessSample {
    pub cpu_user_seconds: f64,
    pub cpu_system_seconds: f64,
    /// Bytes the process caused to be read from / written to storage (/proc/self/io), which
    /// counts direct I/O, io_uring and page-cache writeback alike.
    pub read_bytes: u64,
    pub write_bytes: u64,
    pub rss_bytes: u64,
    pub peak_rss_bytes: u64,
}

impl ProcessSample {
    pub fn now() -> ProcessSample {
        let (cpu_user_seconds, cpu_system_seconds) = cpu_seconds();
        ProcessSample {
            cpu_user_seconds,
            cpu_system_seconds,
            read_bytes: proc_field("/proc/self/io", "read_bytes:").unwrap_or(0),
            write_bytes: proc_field("/proc/self/io", "write_bytes:").unwrap_or(0),
            rss_bytes: proc_field("/proc/self/status", "VmRSS:").unwrap_or(0) * 1024,
            peak_rss_bytes: proc_field("/proc/self/status", "VmHWM:").unwrap_or(0) * 1024,
        }
    }
}

/// User and system CPU seconds of the whole process (every thread, live or exited):
/// /proc/self/stat fields 14 and 15.
fn cpu_seconds() -> (f64, f64) {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // The command name (field 2) may hold spaces; the fields after it start past the last ')'.
    let after_name = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    // fields[0] is field 3 (state), so utime (field 14) is fields[11].
    let ticks = |index: usize| fields.get(index).and_then(|f| f.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) / USER_HZ, ticks(12) / USER_HZ)
}

/// The first number after `name` on its line (/proc files give kB figures as a number of KiB).
fn proc_field(path: &str, name: &str) -> Option<u64> {
    let text = std::fs::read_to_string(path).ok()?;
    text.lines()
        .find_map(|line| line.strip_prefix(name))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|number| number.parse().ok())
}

/// The UTC date and time of a Unix timestamp, as `YYYY-MM-DD HH:MM:SS UTC`.
pub fn format_utc(unix_seconds: u64) -> String {
    let days = (unix_seconds / 86_400) as i64;
    let seconds_of_day = unix_seconds % 86_400;
    let (year, month, day) = civil_from_days(days);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02} UTC",
        seconds_of_day / 3600,
        seconds_of_day / 60 % 60,
        seconds_of_day % 60
    )
}

/// Days since 1970-01-01 to a proleptic Gregorian date (Howard Hinnant's algorithm); written
/// out because a date library for one line of a report is not worth a dependency.
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z.rem_euclid(146_097);
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_index = (5 * day_of_year + 2) / 153;
    let day = (day_of_year - (153 * month_index + 2) / 5 + 1) as u32;
    let month = if month_index < 10 { month_index + 3 } else { month_index - 9 } as u32;
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

pub fn unix_seconds_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_secs())
}

/// Reads a run's JSON file.
pub fn read_run(path: &std::path::Path) -> Result<RunReport, String> {
    let text = std::fs::read_to_string(path).map_err(|err| format!("{}: {err}", path.display()))?;
    serde_json::from_str(&text).map_err(|err| format!("{}: {err}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_format_in_utc() {
        assert_eq!(format_utc(0), "1970-01-01 00:00:00 UTC");
        // 2026-11-22 12:34:56 UTC, from `date -u -d "2026-11-22 12:34:56" +%s`.
        assert_eq!(format_utc(1_795_350_896), "2026-11-22 12:34:56 UTC");
        assert_eq!(format_utc(951_782_400), "2000-02-29 00:00:00 UTC");
    }

    #[test]
    fn process_counters_move_with_work() {
        // Spin until the counter shows 0.1 CPU seconds; on a busy machine that takes longer than
        // 0.1 s of wall time, so the bound is on CPU, and a counter that never moves fails.
        let cpu = |sample: &ProcessSample| sample.cpu_user_seconds + sample.cpu_system_seconds;
        let before = ProcessSample::now();
        let started = std::time::Instant::now();
        let mut spin = 0u64;
        while cpu(&ProcessSample::now()) - cpu(&before) < 0.1 {
            for _ in 0..1_000_000 {
                spin = std::hint::black_box(spin.wrapping_add(1));
            }
            assert!(started.elapsed().as_secs() < 30, "CPU seconds never advanced");
        }
        let after = ProcessSample::now();
        assert!(after.rss_bytes > 0 && after.peak_rss_bytes >= after.rss_bytes);
    }
}
