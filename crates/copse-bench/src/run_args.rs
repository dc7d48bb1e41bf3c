//! The settings of one benchmark run (`WorkloadArgs`): parsed from `bench ycsb`'s and `bench
//! compare`'s flags (`cli.rs`), turned into a run's configuration, and written back as flags for
//! the child `bench ycsb` that `compare.rs` starts for each run.

use std::path::{Path, PathBuf};

use clap::Args;

use crate::device;
use crate::engine::{EngineConfig, EngineKind};
use crate::runner::{DeviceLimits, Mode, RunConfig};
use crate::workload::{PhaseSpec, RecordSize};

/// Bytes in a MiB, for the flags that take sizes in MiB.
pub const MIB: u64 = 1 << 20;
/// The benchmark's cache budget when `--cache-mb` is not given: small, so that a dataset a few
/// times larger loads in minutes on this machine.
pub const CACHE_MIB_DEFAULT: u64 = 32;

/// What a run does: shared by `ycsb` and `compare` (which passes them on to each run).
#[derive(Args, Debug, Clone)]
pub struct WorkloadArgs {
    /// Parent directory for the store (each run makes and removes its own directory inside).
    #[arg(long, default_value = "./bench-data")]
    pub dir: PathBuf,
    /// Records loaded before the phases.
    #[arg(long, default_value_t = 100_000)]
    pub records: u64,
    /// Value bytes per record, or `kvell` for KVell's production size mix.
    #[arg(long, default_value = "1024", value_parser = RecordSize::parse)]
    pub record_bytes: RecordSize,
    /// Cache budget for every engine, in MiB (copse's page cache, RocksDB's block cache): the
    /// global `--cache-mb` flag, default [`CACHE_MIB_DEFAULT`].
    #[arg(skip = CACHE_MIB_DEFAULT)]
    pub cache_mib: u64,
    /// Client threads.
    #[arg(long, default_value_t = 16)]
    pub threads: usize,
    /// Phases after the load, comma-separated: a workload (load, a..f, kvell) with an optional
    /// `@uniform`, `@zipfian` or `@latest` (default: YCSB's distribution for the workload).
    #[arg(long, default_value = "a,b,c,f,d,e", value_delimiter = ',', value_parser = PhaseSpec::parse)]
    pub phases: Vec<PhaseSpec>,
    /// A phase stops after this many requests...
    #[arg(long)]
    pub ops: Option<u64>,
    /// ...or after this many seconds, whichever comes first.
    #[arg(long, default_value_t = 10.0)]
    pub seconds: f64,
    /// Open loop: requests arrive at this rate (per second) instead of back to back.
    #[arg(long)]
    pub rate: Option<f64>,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// copse shards: the global `--shards` flag (default one per core).
    #[arg(skip)]
    pub shards: Option<usize>,
    /// copse's space ceiling for append classes: the global `--space-amplification-max` flag
    /// (default copse's own).
    #[arg(skip)]
    pub space_amplification_max: Option<f64>,
    /// A `copse bench device --json` report: its random 4 KiB IOPS are the limit line for the
    /// device utilisation figures.
    #[arg(long)]
    pub device_json: Option<PathBuf>,
}

impl WorkloadArgs {
    /// The same settings as flags, for a child `bench ycsb`.
    pub fn to_args(&self) -> Vec<String> {
        let phases: Vec<String> = self.phases.iter().map(PhaseSpec::label).collect();
        let mut args = vec![
            format!("--dir={}", self.dir.display()),
            format!("--records={}", self.records),
            format!("--record-bytes={}", self.record_bytes.label()),
            format!("--cache-mb={}", self.cache_mib),
            format!("--threads={}", self.threads),
            format!("--phases={}", phases.join(",")),
            format!("--seconds={}", self.seconds),
            format!("--seed={}", self.seed),
        ];
        let optional = [
            ("ops", self.ops.map(|ops| ops.to_string())),
            ("rate", self.rate.map(|rate| rate.to_string())),
            ("shards", self.shards.map(|shards| shards.to_string())),
            (
                "space-amplification-max",
                self.space_amplification_max.map(|ratio| ratio.to_string()),
            ),
            ("device-json", self.device_json.as_ref().map(|path| path.display().to_string())),
        ];
        for (name, value) in optional {
            if let Some(value) = value {
                args.push(format!("--{name}={value}"));
            }
        }
        args
    }

    pub fn run_config(
        &self,
        kind: EngineKind,
        progress: bool,
        keep_data: bool,
    ) -> Result<RunConfig, String> {
        let device = match &self.device_json {
            Some(path) => {
                let report = device::read_report(path)?;
                Some(DeviceLimits::from_report(&report).ok_or_else(|| {
                    format!("{}: no random 4 KiB read and write IOPS in it", path.display())
                })?)
            }
            None => None,
        };
        let run_dir = self.dir.join(format!("run-{}-{}", kind.name(), std::process::id()));
        Ok(RunConfig {
            engine: EngineConfig {
                kind,
                dir: run_dir,
                cache_bytes: (self.cache_mib * MIB) as usize,
                shards: self.shards,
                space_amplification_max: self.space_amplification_max,
                background_jobs: None,
            },
            record_count: self.records,
            record_size: self.record_bytes,
            threads: self.threads,
            phases: self.phases.clone(),
            mode: match self.rate {
                Some(ops_per_second) => Mode::Open { ops_per_second },
                None => Mode::Closed,
            },
            phase_ops_max: self.ops,
            phase_seconds_max: Some(self.seconds),
            seed: self.seed,
            device,
            progress,
            keep_data,
        })
    }
}

/// Used by `compare` to run one engine's `bench ycsb` in this process's own binary.
pub fn ycsb_command_args(
    engine: EngineKind,
    workload: &WorkloadArgs,
    json: &Path,
    mode_rate: Option<f64>,
) -> Vec<String> {
    let mut workload = workload.clone();
    if mode_rate.is_some() {
        workload.rate = mode_rate;
    }
    let mut args = vec![
        "bench".to_string(),
        "ycsb".to_string(),
        format!("--engine={}", engine.name()),
        format!("--json={}", json.display()),
        "--quiet".to_string(),
    ];
    args.extend(workload.to_args());
    args
}
