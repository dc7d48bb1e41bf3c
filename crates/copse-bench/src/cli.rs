//! `copse bench ...`: the commands and their flags. The `copse` binary embeds [`BenchCommand`];
//! `compare` re-runs this binary's `bench ycsb` once per run, so every run is its own process
//! and its CPU, I/O and memory figures are its own.

use std::path::{Path, PathBuf};

use clap::{Args, Subcommand};

use crate::compare::{self, CompareConfig, OpenLoop};
use crate::device::{self, DeviceProbeConfig};
use crate::engine::EngineKind;
use crate::run_args::{WorkloadArgs, CACHE_MIB_DEFAULT, MIB};
use crate::runner;
use crate::workload::PhaseSpec;

#[derive(Subcommand, Debug, Clone)]
pub enum BenchCommand {
    /// Loads records, then runs YCSB workloads (A-F, KVell's mix) on one engine; writes a JSON
    /// report (--json) and prints a summary.
    Ycsb(YcsbArgs),
    /// Measures the device through copse's I/O layer: random 4 KiB IOPS at several queue depths,
    /// 128 KiB sequential bandwidth, fdatasync latency.
    Device(DeviceArgs),
    /// Runs the same workloads for several engines, alternating engines run by run; prints and
    /// writes a table of medians and ratios against the first engine, with SVG plots.
    Compare(CompareArgs),
    /// Draws the flame graph (SVG) of a `perf record -g` profile, through `perf script` and
    /// inferno (`make profile` profiles the server with it).
    Flamegraph(FlamegraphArgs),
}

#[derive(Args, Debug, Clone)]
pub struct FlamegraphArgs {
    /// The profile `perf record -g` wrote.
    #[arg(long)]
    pub perf_data: PathBuf,
    /// Where to write the SVG.
    #[arg(long)]
    pub svg: PathBuf,
    /// The graph's title.
    #[arg(long, default_value = "copse profile")]
    pub title: String,
}

#[derive(Args, Debug, Clone)]
pub struct YcsbArgs {
    /// copse (placement chosen by the store), copse-in-place, copse-append, rocksdb (WAL synced
    /// per write), rocksdb-relaxed (WAL not synced: not durable) or rocksdb-sharded (copse's
    /// router over one RocksDB per shard).
    #[arg(long, default_value = "copse")]
    pub engine: String,
    #[command(flatten)]
    pub workload: WorkloadArgs,
    /// Write the run's report here (JSON).
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Keep the store's directory afterwards.
    #[arg(long)]
    pub keep_data: bool,
    /// No progress bars.
    #[arg(long)]
    pub quiet: bool,
}

#[derive(Args, Debug, Clone)]
pub struct DeviceArgs {
    /// Directory for the probe's file (the store's data directory, to measure its device).
    #[arg(long, default_value = "./bench-data")]
    pub dir: PathBuf,
    #[arg(long, default_value_t = 1024)]
    pub file_mib: u64,
    #[arg(long, default_value_t = 3.0)]
    pub seconds: f64,
    #[arg(long, default_value = "1,32,128", value_delimiter = ',')]
    pub depths: Vec<usize>,
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Also put the table into this document, between `<!-- copse-bench:SECTION:begin/end -->`
    /// markers (appended when absent).
    #[arg(long, requires = "section")]
    pub doc: Option<PathBuf>,
    #[arg(long)]
    pub section: Option<String>,
    #[arg(long)]
    pub quiet: bool,
}

#[derive(Args, Debug, Clone)]
pub struct CompareArgs {
    /// Engines, the first being the baseline of the ratios.
    #[arg(long, default_value = "copse", value_delimiter = ',')]
    pub engines: Vec<String>,
    /// Runs per engine; engines alternate run by run (A B A B ...).
    #[arg(long, default_value_t = 2)]
    pub repeats: usize,
    #[command(flatten)]
    pub workload: WorkloadArgs,
    /// Where each run's JSON goes.
    #[arg(long, default_value = "./bench-data/compare")]
    pub out_dir: PathBuf,
    /// Where the SVG plots go (default: --out-dir).
    #[arg(long)]
    pub plots_dir: Option<PathBuf>,
    /// Write the table (markdown) to this file.
    #[arg(long)]
    pub markdown: Option<PathBuf>,
    /// Also put the table into this document, between `<!-- copse-bench:SECTION:begin/end -->`
    /// markers (appended when absent).
    #[arg(long, requires = "section")]
    pub doc: Option<PathBuf>,
    #[arg(long)]
    pub section: Option<String>,
    /// A title for the table.
    #[arg(long, default_value = "Comparison")]
    pub title: String,
    /// Then run these phases open-loop (comma-separated), at --open-fraction of the median
    /// closed-loop throughput the first engine reached on the same phase.
    #[arg(long, value_delimiter = ',', value_parser = PhaseSpec::parse)]
    pub open_phases: Vec<PhaseSpec>,
    #[arg(long, default_value_t = 0.8)]
    pub open_fraction: f64,
    /// The engine whose closed-loop peak sets the open-loop rate (default: the first engine).
    #[arg(long)]
    pub open_reference: Option<String>,
}

fn write_json<T: serde::Serialize>(path: &Path, value: &T) -> Result<(), String> {
    if let Some(parent) = path.parent().filter(|parent| !parent.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(|err| format!("{}: {err}", parent.display()))?;
    }
    let text = serde_json::to_string_pretty(value).map_err(|err| err.to_string())?;
    std::fs::write(path, text + "\n").map_err(|err| format!("{}: {err}", path.display()))
}

impl BenchCommand {
    /// Takes the `copse` tool's global `--cache-mb` and `--shards` flags.
    pub fn apply_globals(
        &mut self,
        cache_mib: Option<u64>,
        shards: Option<usize>,
        space_amplification_max: Option<f64>,
    ) {
        let workload = match self {
            BenchCommand::Ycsb(args) => &mut args.workload,
            BenchCommand::Compare(args) => &mut args.workload,
            BenchCommand::Device(_) | BenchCommand::Flamegraph(_) => return,
        };
        workload.cache_mib = cache_mib.unwrap_or(CACHE_MIB_DEFAULT);
        workload.shards = shards;
        workload.space_amplification_max = space_amplification_max;
    }
}

/// Runs a bench command; the error is the message to print.
pub fn run(command: BenchCommand) -> Result<(), String> {
    match command {
        BenchCommand::Ycsb(args) => ycsb(args),
        BenchCommand::Device(args) => device_probe(args),
        BenchCommand::Compare(args) => compare(args),
        BenchCommand::Flamegraph(args) => {
            crate::flamegraph::flamegraph_of_perf_data(&args.perf_data, &args.svg, &args.title)
        }
    }
}

fn ycsb(args: YcsbArgs) -> Result<(), String> {
    let kind = EngineKind::parse(&args.engine).map_err(|err| err.to_string())?;
    let config = args.workload.run_config(kind, !args.quiet, args.keep_data)?;
    let report = runner::run(&config).map_err(|err| err.to_string())?;
    if let Some(path) = &args.json {
        write_json(path, &report)?;
    }
    println!("{}", compare::run_summary(&report));
    if report.errors > 0 {
        return Err(format!(
            "{} requests saw a wrong value or an error; the figures are not valid",
            report.errors
        ));
    }
    Ok(())
}

fn device_probe(args: DeviceArgs) -> Result<(), String> {
    let config = DeviceProbeConfig {
        dir: args.dir,
        file_bytes: args.file_mib * MIB,
        seconds_per_test: args.seconds,
        queue_depths: args.depths,
        ..DeviceProbeConfig::default()
    };
    std::fs::create_dir_all(&config.dir)
        .map_err(|err| format!("{}: {err}", config.dir.display()))?;
    let started = crate::report::unix_seconds_now();
    let report = device::probe(&config, !args.quiet).map_err(|err| err.to_string())?;
    if let Some(path) = &args.json {
        write_json(path, &report)?;
    }
    println!("{}", report.markdown());
    if let (Some(doc), Some(section)) = (&args.doc, &args.section) {
        let command: Vec<String> = std::env::args().collect();
        let body = format!(
            "### Device limit line\n\n- Command: `{}`\n- Date: {}; machine: {}\n- File: {} MiB in {}, backend {}\n\n{}",
            command.join(" "),
            crate::report::format_utc(started),
            crate::report::Machine::current().describe(),
            report.file_bytes >> 20,
            report.dir,
            report.backend,
            report.markdown()
        );
        compare::update_doc(doc, section, &body)?;
    }
    Ok(())
}

fn compare(args: CompareArgs) -> Result<(), String> {
    let engines = args
        .engines
        .iter()
        .map(|name| EngineKind::parse(name))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|err| err.to_string())?;
    let open_reference = match &args.open_reference {
        Some(name) => EngineKind::parse(name).map_err(|err| err.to_string())?,
        None => engines[0],
    };
    let config = CompareConfig {
        engines,
        repeats: args.repeats,
        plots_dir: args.plots_dir.clone().unwrap_or_else(|| args.out_dir.clone()),
        out_dir: args.out_dir,
        workload: args.workload,
        markdown: args.markdown,
        doc: args.doc.zip(args.section),
        title: args.title,
        open_loop: (!args.open_phases.is_empty()).then_some(OpenLoop {
            phases: args.open_phases,
            fraction: args.open_fraction,
            reference: open_reference,
        }),
    };
    let table = compare::compare(&config)?;
    println!("{table}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::RecordSize;
    use clap::Parser;

    /// The `copse` tool's global flags that bench commands take.
    #[derive(Parser, Debug)]
    struct Cli {
        #[arg(long, global = true)]
        cache_mb: Option<u64>,
        #[arg(long, global = true)]
        shards: Option<usize>,
        #[command(subcommand)]
        bench: BenchCommand,
    }

    #[test]
    fn workload_flags_round_trip_through_to_args() {
        let cli = Cli::try_parse_from([
            "copse",
            "ycsb",
            "--records=500",
            "--record-bytes=kvell",
            "--phases=a@uniform,e",
            "--ops=100",
            "--rate=2000",
        ])
        .unwrap();
        let BenchCommand::Ycsb(args) = cli.bench else { panic!("parsed as ycsb") };
        let mut again = vec!["copse".to_string(), "ycsb".to_string()];
        again.extend(args.workload.to_args());
        let BenchCommand::Ycsb(reparsed) = Cli::try_parse_from(again).unwrap().bench else {
            panic!("parsed as ycsb")
        };
        assert_eq!(reparsed.workload.to_args(), args.workload.to_args());
        assert_eq!(reparsed.workload.record_bytes, RecordSize::KvellMix);
        assert_eq!(reparsed.workload.phases.len(), 2);
        assert_eq!(reparsed.workload.rate, Some(2000.0));
    }

    #[test]
    fn bad_flags_are_refused() {
        assert!(Cli::try_parse_from(["copse", "ycsb", "--phases=z"]).is_err());
        assert!(Cli::try_parse_from(["copse", "ycsb", "--record-bytes=0"]).is_err());
    }
}
