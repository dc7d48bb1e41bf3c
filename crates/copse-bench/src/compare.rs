//! `copse bench compare`: the same workloads for several engines, engines alternating run by run
//! (A B A B ...) so that a slow period of this shared machine hits every engine alike; the medians
//! of each figure per engine and phase, and each engine's throughput as a ratio to the first's.
//!
//! Every run is a child process (`copse bench ycsb --json ...`), so its CPU, I/O and peak memory
//! are its own, and a crash of one engine cannot take the comparison's figures with it.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use crate::engine::EngineKind;
use crate::plot;
use crate::report::{read_run, PhaseReport, RunReport};
use crate::run_args::{ycsb_command_args, WorkloadArgs};
use crate::workload::PhaseSpec;

/// Runs a comparison may ask for (each is a process with a full load).
pub const REPEATS_MAX: usize = 100;

/// Open-loop phases after the closed-loop comparison.
#[derive(Clone, Debug)]
pub struct OpenLoop {
    pub phases: Vec<PhaseSpec>,
    /// Of the reference engine's median closed-loop throughput on the same phase.
    pub fraction: f64,
    pub reference: EngineKind,
}

#[derive(Clone, Debug)]
pub struct CompareConfig {
    pub engines: Vec<EngineKind>,
    pub repeats: usize,
    pub workload: WorkloadArgs,
    pub out_dir: PathBuf,
    pub plots_dir: PathBuf,
    pub markdown: Option<PathBuf>,
    /// A document and the section in it to replace with the table.
    pub doc: Option<(PathBuf, String)>,
    pub title: String,
    pub open_loop: Option<OpenLoop>,
}

/// Runs everything and returns the markdown it wrote.
pub fn compare(config: &CompareConfig) -> Result<String, String> {
    if config.engines.is_empty() || config.repeats == 0 || config.repeats > REPEATS_MAX {
        return Err(format!("need at least one engine and 1..={REPEATS_MAX} repeats"));
    }
    if let Some(open) = &config.open_loop {
        if !(open.fraction > 0.0 && open.fraction.is_finite()) {
            return Err("--open-fraction must be a positive number".to_string());
        }
    }
    std::fs::create_dir_all(&config.out_dir)
        .map_err(|err| format!("{}: {err}", config.out_dir.display()))?;
    let mut runs: Vec<RunReport> = Vec::new();
    for repeat in 0..config.repeats {
        for engine in &config.engines {
            let json = config.out_dir.join(format!("closed-{}-{repeat}.json", engine.name()));
            runs.push(run_child(*engine, &config.workload, &json, None)?);
        }
    }
    let closed = Table::new(&config.engines, &runs);
    let mut markdown = String::new();
    let _ = writeln!(markdown, "### {}\n", config.title);
    markdown.push_str(&context(config, &runs));
    markdown.push_str(&closed.markdown());
    markdown.push_str(&engine_lines(&config.engines, &runs));
    markdown.push_str(&closed.losses());
    markdown.push_str(&plots(config, "closed", &closed)?);

    if let Some(open) = &config.open_loop {
        let mut open_runs = Vec::new();
        for spec in &open.phases {
            let label = spec.label();
            let peak = closed
                .median(open.reference, &label, |phase| phase.ops_per_second)
                .ok_or_else(|| {
                    format!(
                        "no closed-loop run of {label} for {} to take the open-loop rate from",
                        open.reference.name()
                    )
                })?;
            let rate = (peak * open.fraction).max(1.0);
            let mut workload = config.workload.clone();
            workload.phases = vec![*spec];
            for repeat in 0..config.repeats {
                for engine in &config.engines {
                    let json = config
                        .out_dir
                        .join(format!("open-{}-{label}-{repeat}.json", engine.name()));
                    open_runs.push(run_child(*engine, &workload, &json, Some(rate))?);
                }
            }
            let _ = writeln!(
                markdown,
                "\n**Open loop, {label}**: requests arrive at {rate:.0}/s ({:.0}% of {}'s closed-loop median {peak:.0}/s); latency is measured from each request's intended start.\n",
                open.fraction * 100.0,
                open.reference.name()
            );
        }
        let mut table = Table::new(&config.engines, &open_runs);
        // Each open-loop run loads first (closed loop); only the open phases belong here.
        let open_labels: Vec<String> = open.phases.iter().map(PhaseSpec::label).collect();
        table.phases.retain(|phase| open_labels.contains(phase));
        markdown.push_str(&table.markdown());
        markdown.push_str(&plots(config, "open", &table)?);
        runs.extend(open_runs);
    }
    let errors: u64 = runs.iter().map(|run| run.errors).sum();
    let _ = writeln!(
        markdown,
        "\nErrors (wrong or missing values, engine errors) over all {} runs: {errors}.",
        runs.len()
    );
    if let Some(path) = &config.markdown {
        write_file(path, &markdown)?;
    }
    if let Some((doc, section)) = &config.doc {
        update_doc(doc, section, &markdown)?;
    }
    Ok(markdown)
}

fn run_child(
    engine: EngineKind,
    workload: &WorkloadArgs,
    json: &Path,
    rate: Option<f64>,
) -> Result<RunReport, String> {
    let exe = std::env::current_exe().map_err(|err| format!("finding this program: {err}"))?;
    let args = ycsb_command_args(engine, workload, json, rate);
    eprintln!("copse bench compare: {} {}", exe.display(), args.join(" "));
    let status = std::process::Command::new(&exe)
        .args(&args)
        .status()
        .map_err(|err| format!("starting {}: {err}", exe.display()))?;
    if !status.success() {
        return Err(format!("run of {} failed ({status}); see its output above", engine.name()));
    }
    read_run(json)
}

fn context(config: &CompareConfig, runs: &[RunReport]) -> String {
    let Some(first) = runs.first() else { return String::new() };
    let command: Vec<String> = std::env::args().collect();
    let c = &first.config;
    let mut text = String::new();
    let _ = writeln!(text, "- Command: `{}`", command.join(" "));
    let _ = writeln!(
        text,
        "- Date: {} (first run); machine: {}",
        first.date_utc,
        first.machine.describe()
    );
    let _ = writeln!(
        text,
        "- Data: {} records of {} B values (keys ~{:.0} B), {:.0} MiB, {:.1}x the {} MiB cache every engine gets; {} client threads; each phase {}; {} run(s) per engine, engines alternating; figures are medians over runs.",
        c.record_count,
        c.record_bytes,
        c.key_bytes_mean,
        c.dataset_bytes as f64 / MIB,
        c.dataset_to_cache,
        c.cache_bytes / (1 << 20),
        c.threads,
        bound_text(c.phase_ops_max, c.phase_seconds_max),
        config.repeats,
    );
    let _ = writeln!(
        text,
        "- After each phase the engine finishes the background work it caused (RocksDB: memtable flushes and compactions), outside the phase's window; `CPU s`, `CPU µs/op` (process CPU time, user + system, over the phase's operations) and `write amp` include that settle, so each phase is charged for its own work."
    );
    if let (Some(read), Some(write)) = (c.device_read_iops, c.device_write_iops) {
        let _ = writeln!(
            text,
            "- Device limit line (copse bench device, random 4 KiB, best queue depth): {read:.0} read IOPS, {write:.0} write IOPS. Device utilisation = throughput / (device IOPS / I/Os per request)."
        );
    }
    let relaxed = config
        .engines
        .iter()
        .filter(|engine| !engine.durable())
        .map(|engine| engine.name())
        .collect::<Vec<_>>();
    if !relaxed.is_empty() {
        let _ = writeln!(
            text,
            "- Not durable (acknowledges before the write is on the device): {}.",
            relaxed.join(", ")
        );
    }
    text.push('\n');
    text
}

/// Per engine, over its runs: peak RSS, disk use at the end, and index bytes per item.
fn engine_lines(engines: &[EngineKind], runs: &[RunReport]) -> String {
    let mut text = String::from("\n");
    for engine in engines {
        let mine: Vec<&RunReport> =
            runs.iter().filter(|run| run.config.engine == engine.name()).collect();
        let peak = median(mine.iter().map(|run| run.peak_rss_bytes as f64).collect());
        let disk = median(mine.iter().map(|run| run.disk_bytes_end as f64).collect());
        let index =
            median(mine.iter().filter_map(|run| run.engine_figures.index_bytes_per_item).collect());
        let amplification =
            median(mine.iter().filter_map(|run| run.engine_figures.write_amplification).collect());
        let probe = median(
            mine.iter().filter_map(|run| run.engine_figures.probe_sequential_over_random).collect(),
        );
        // Each run makes its own store, so `auto` may choose differently run by run: list each.
        let mut placements: Vec<&str> =
            mine.iter().filter_map(|run| run.engine_figures.placement.as_deref()).collect();
        placements.dedup();
        let _ = writeln!(
            text,
            "- {}: peak RSS {:.0} MiB, {:.0} MiB on disk after the run{}{}{}{} (medians over runs).",
            engine.name(),
            peak.unwrap_or(f64::NAN) / MIB,
            disk.unwrap_or(f64::NAN) / MIB,
            index.map_or(String::new(), |bytes| format!(", index {bytes:.1} B per item")),
            amplification.map_or(String::new(), |wa| format!(
                ", slab write amplification {wa:.2} over the store's life"
            )),
            if placements.is_empty() {
                String::new()
            } else {
                format!(", placement {}", placements.join(" / "))
            },
            probe.map_or(String::new(), |ratio| format!(
                ", write probe sequential/random {ratio:.1}"
            )),
        );
    }
    text
}

fn bound_text(ops: Option<u64>, seconds: Option<f64>) -> String {
    match (ops, seconds) {
        (Some(ops), Some(seconds)) => format!("{ops} requests or {seconds} s, whichever first"),
        (Some(ops), None) => format!("{ops} requests"),
        (None, Some(seconds)) => format!("{seconds} s"),
        (None, None) => "unbounded".to_string(),
    }
}

const MIB: f64 = (1u64 << 20) as f64;

/// Runs grouped by engine and phase.
struct Table<'a> {
    engines: Vec<EngineKind>,
    /// Phase labels in run order.
    phases: Vec<String>,
    cells: BTreeMap<(usize, String), Vec<&'a PhaseReport>>,
}

impl<'a> Table<'a> {
    fn new(engines: &[EngineKind], runs: &'a [RunReport]) -> Table<'a> {
        let mut phases: Vec<String> = Vec::new();
        let mut cells: BTreeMap<(usize, String), Vec<&PhaseReport>> = BTreeMap::new();
        for run in runs {
            let Some(engine) = engines.iter().position(|e| e.name() == run.config.engine) else {
                continue;
            };
            for phase in &run.phases {
                if !phases.contains(&phase.phase) {
                    phases.push(phase.phase.clone());
                }
                cells.entry((engine, phase.phase.clone())).or_default().push(phase);
            }
        }
        Table { engines: engines.to_vec(), phases, cells }
    }

    fn median(
        &self,
        engine: EngineKind,
        phase: &str,
        figure: impl Fn(&PhaseReport) -> f64,
    ) -> Option<f64> {
        self.optional_median(engine, phase, |p| Some(figure(p)))
    }

    fn optional_median(
        &self,
        engine: EngineKind,
        phase: &str,
        figure: impl Fn(&PhaseReport) -> Option<f64>,
    ) -> Option<f64> {
        let index = self.engines.iter().position(|e| *e == engine)?;
        median(
            self.cells.get(&(index, phase.to_string()))?.iter().filter_map(|p| figure(p)).collect(),
        )
    }

    fn markdown(&self) -> String {
        let mut text = String::from(
            "| phase | engine | ops/s (min–max) | ratio | p99 µs | p99.9 µs | max µs | I/Os per op (r+w) | device util | CPU s | CPU µs/op | write amp | RSS MiB | disk MiB |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
        );
        for phase in &self.phases {
            let baseline = self.median(self.engines[0], phase, |p| p.ops_per_second);
            for engine in &self.engines {
                let Some(ops) = self.median(*engine, phase, |p| p.ops_per_second) else { continue };
                let index = self.engines.iter().position(|e| e == engine).unwrap_or(0);
                let all: Vec<f64> =
                    self.cells[&(index, phase.clone())].iter().map(|p| p.ops_per_second).collect();
                let low = all.iter().cloned().fold(f64::INFINITY, f64::min);
                let high = all.iter().cloned().fold(0.0, f64::max);
                let figure = |f: &dyn Fn(&PhaseReport) -> f64| {
                    self.median(*engine, phase, f).unwrap_or(f64::NAN)
                };
                let ratio =
                    baseline.map_or("–".to_string(), |base| format!("{:.2}x", ops / base));
                let utilisation = self
                    .optional_median(*engine, phase, |p| p.device_utilisation)
                    .map_or("–".to_string(), |u| format!("{:.0}%", u * 100.0));
                let amplification = self
                    .optional_median(*engine, phase, |p| p.write_amplification_with_settle)
                    .map_or("–".to_string(), |a| format!("{a:.1}"));
                let _ = writeln!(
                    text,
                    "| {phase} | {} | {ops:.0} ({low:.0}–{high:.0}) | {ratio} | {:.0} | {:.0} | {:.0} | {:.2}+{:.2} | {utilisation} | {:.1} | {:.1} | {amplification} | {:.0} | {:.0} |",
                    engine.name(),
                    figure(&|p| p.latency.p99_us),
                    figure(&|p| p.latency.p999_us),
                    figure(&|p| p.latency.max_us),
                    figure(&|p| p.read_ios_per_op),
                    figure(&|p| p.write_ios_per_op),
                    figure(&|p| p.cpu_user_seconds + p.cpu_system_seconds + p.settle_cpu_seconds),
                    figure(&PhaseReport::cpu_us_per_op),
                    figure(&|p| p.rss_bytes_end as f64) / MIB,
                    figure(&|p| p.disk_bytes_end as f64) / MIB,
                );
            }
        }
        text
    }

    /// A plain list of the phases where copse's median throughput is below another engine's.
    fn losses(&self) -> String {
        // copse as a user gets it (`auto`) when it runs, else the first copse engine; it is
        // held against the other engines, not against copse with another placement.
        let is_copse = |engine: &EngineKind| matches!(engine, EngineKind::Copse(_));
        let default = EngineKind::Copse(copse::PlacementSetting::Auto);
        let Some(copse) = self
            .engines
            .iter()
            .position(|engine| *engine == default)
            .or_else(|| self.engines.iter().position(is_copse))
        else {
            return String::new();
        };
        let mut lines = Vec::new();
        for phase in &self.phases {
            let Some(mine) = self.median(self.engines[copse], phase, |p| p.ops_per_second) else {
                continue;
            };
            for other in self.engines.iter().filter(|engine| !is_copse(engine)) {
                if let Some(theirs) = self.median(*other, phase, |p| p.ops_per_second) {
                    if mine < theirs {
                        lines.push(format!("{phase} ({:.2}x of {})", mine / theirs, other.name()));
                    }
                }
            }
        }
        let name = self.engines[copse].name();
        if lines.is_empty() {
            format!(
                "\n{name}'s median throughput is at least every other engine's in every phase.\n"
            )
        } else {
            format!("\n{name} is slower in: {}.\n", lines.join(", "))
        }
    }
}

fn median(mut values: Vec<f64>) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    values.sort_by(f64::total_cmp);
    let middle = values.len() / 2;
    Some(if values.len().is_multiple_of(2) {
        (values[middle - 1] + values[middle]) / 2.0
    } else {
        values[middle]
    })
}

/// Per phase: throughput over time (every run) and latency percentile curves (each engine's
/// run closest to its median throughput). Returns markdown links.
fn plots(config: &CompareConfig, prefix: &str, table: &Table) -> Result<String, String> {
    std::fs::create_dir_all(&config.plots_dir)
        .map_err(|err| format!("{}: {err}", config.plots_dir.display()))?;
    let link_base = config
        .doc
        .as_ref()
        .map(|(doc, _)| doc.clone())
        .or_else(|| config.markdown.clone())
        .and_then(|path| path.parent().map(Path::to_path_buf));
    let mut text = String::from("\n");
    for phase in &table.phases {
        let mut timelines = Vec::new();
        let mut curves = Vec::new();
        for (index, engine) in table.engines.iter().enumerate() {
            let Some(reports) = table.cells.get(&(index, phase.clone())) else { continue };
            for (repeat, report) in reports.iter().enumerate() {
                timelines.push(plot::Series {
                    label: format!("{} #{}", engine.name(), repeat + 1),
                    color_index: index,
                    points: report
                        .timeline_ops_per_second
                        .iter()
                        .enumerate()
                        .map(|(second, ops)| (second as f64 + 1.0, *ops))
                        .collect(),
                });
            }
            let median_ops = table.median(*engine, phase, |p| p.ops_per_second).unwrap_or(0.0);
            if let Some(report) = reports.iter().min_by(|a, b| {
                (a.ops_per_second - median_ops)
                    .abs()
                    .total_cmp(&(b.ops_per_second - median_ops).abs())
            }) {
                for (kind, op) in &report.operations {
                    curves.push(plot::Series {
                        label: format!("{} {kind}", engine.name()),
                        color_index: index,
                        points: op.curve_us.clone(),
                    });
                }
            }
        }
        let slug = format!("{prefix}-{}", phase.replace('@', "-"));
        let timeline_path = config.plots_dir.join(format!("{slug}-throughput.svg"));
        let latency_path = config.plots_dir.join(format!("{slug}-latency.svg"));
        plot::timeline(&timeline_path, &format!("{phase}: throughput"), &timelines)?;
        plot::latency_curves(&latency_path, &format!("{phase}: latency percentiles"), &curves)?;
        let link = |path: &Path| match &link_base {
            Some(base) => path.strip_prefix(base).unwrap_or(path).display().to_string(),
            None => path.display().to_string(),
        };
        let _ = writeln!(
            text,
            "- {phase}: [throughput]({}) · [latency]({})",
            link(&timeline_path),
            link(&latency_path)
        );
    }
    Ok(text)
}

fn write_file(path: &Path, text: &str) -> Result<(), String> {
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(|err| format!("{}: {err}", parent.display()))?;
    }
    std::fs::write(path, text).map_err(|err| format!("{}: {err}", path.display()))
}

/// Replaces the text between the section's markers in `doc` (or appends the section).
pub fn update_doc(doc: &Path, section: &str, body: &str) -> Result<(), String> {
    let begin = format!("<!-- copse-bench:{section}:begin -->");
    let end = format!("<!-- copse-bench:{section}:end -->");
    let current = std::fs::read_to_string(doc).unwrap_or_default();
    let block = format!("{begin}\n{}\n{end}", body.trim_end());
    let updated = match (current.find(&begin), current.find(&end)) {
        (Some(start), Some(stop)) if stop > start => {
            format!("{}{block}{}", &current[..start], &current[stop + end.len()..])
        }
        _ => format!("{}\n{block}\n", current.trim_end()),
    };
    write_file(doc, &updated)
}

/// A short human summary of one run (what `copse bench ycsb` prints).
pub fn run_summary(report: &RunReport) -> String {
    let mut text = format!(
        "{} · {} records of {} B · cache {} MiB · {} threads · {}\n| phase | ops | ops/s | p50 µs | p99 µs | p99.9 µs | max µs | I/Os/op | util | CPU µs/op | errors |\n|---|---|---|---|---|---|---|---|---|---|---|\n",
        report.config.engine,
        report.config.record_count,
        report.config.record_bytes,
        report.config.cache_bytes >> 20,
        report.config.threads,
        report.config.mode,
    );
    for phase in &report.phases {
        let _ = writeln!(
            text,
            "| {} | {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.2} | {} | {:.1} | {} |",
            phase.phase,
            phase.ops,
            phase.ops_per_second,
            phase.latency.p50_us,
            phase.latency.p99_us,
            phase.latency.p999_us,
            phase.latency.max_us,
            phase.read_ios_per_op + phase.write_ios_per_op,
            phase.device_utilisation.map_or("–".to_string(), |u| format!("{:.0}%", u * 100.0)),
            phase.cpu_us_per_op(),
            phase.errors,
        );
    }
    let _ = write!(
        text,
        "disk {:.1} MiB · peak RSS {:.1} MiB · index {} B/item",
        report.disk_bytes_end as f64 / MIB,
        report.peak_rss_bytes as f64 / MIB,
        report.engine_figures.index_bytes_per_item.map_or("–".to_string(), |b| format!("{b:.1}")),
    );
    if let Some(placement) = &report.engine_figures.placement {
        let _ = write!(text, " · placement {placement}");
    }
    if let Some(ratio) = report.engine_figures.probe_sequential_over_random {
        let _ = write!(text, " · write probe sequential/random {ratio:.1}");
    }
    if let Some(amplification) = report.engine_figures.write_amplification {
        let _ = write!(text, " · slab write amplification {amplification:.2}");
    }
    if let Some(rate) = report.engine_figures.cache_hit_rate {
        let _ = write!(text, " · page cache hit rate {rate:.3}");
    }
    if let Some(counts) = report.engine_figures.combining {
        let _ = write!(
            text,
            " · gets run by their caller {} (loop busy {}), reads taken {}, I/O left to the \
             thread {}",
            counts.combined, counts.found_busy, counts.reads_taken, counts.left_io_for_thread
        );
    }
    if let Some(moves) = report.engine_figures.moves {
        let _ = write!(
            text,
            " · records moved by the collector {}, side by side for scans {} ({} scans)",
            moves.collected, moves.clustered, moves.cluster_runs
        );
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_of_odd_and_even_counts() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(median(vec![]), None);
    }

    #[test]
    fn doc_sections_are_replaced_in_place() {
        let dir = tempfile::tempdir().unwrap();
        let doc = dir.path().join("doc.md");
        std::fs::write(&doc, "# Title\n\nbefore\n").unwrap();
        update_doc(&doc, "std", "first").unwrap();
        std::fs::write(&doc, std::fs::read_to_string(&doc).unwrap() + "\nafter\n").unwrap();
        update_doc(&doc, "std", "second").unwrap();
        let text = std::fs::read_to_string(&doc).unwrap();
        assert!(text.contains("second") && !text.contains("first"), "{text}");
        assert!(text.starts_with("# Title\n\nbefore\n") && text.ends_with("after\n"), "{text}");
        assert_eq!(text.matches("copse-bench:std:begin").count(), 1);
    }
}
