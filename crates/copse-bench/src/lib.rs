//! The copse benchmark harness (`copse bench ...`): YCSB's core workloads and KVell's production
//! mix over any engine behind [`engine::BenchEngine`], in closed-loop or open-loop mode; the device
//! probe that measures the physical limit line; comparisons that alternate engines run by run and
//! report medians and ratios; SVG plots.
//!
//! Layout: `generator` (YCSB's key choosers, bit for bit), `workload` (operation mixes and key
//! names), `engine` (the engines under test), `runner` (drives one phase and measures it),
//! `report` (the JSON schema of a run, process figures), `device` (the device probe), `compare`
//! (engine-alternating runs, medians, the markdown table), `plot` (SVGs), `flamegraph` (flame
//! graphs of a perf profile), `run_args` (one run's settings, as flags and as a
//! configuration), `cli` (the commands).
//!
//! Invariants: every figure in a report is measured in the run it describes (nothing is carried
//! over or assumed); a run that saw a wrong or missing value reports it in `errors` and the command
//! fails, so a benchmark never silently measures a broken store.

pub mod cli;
pub mod compare;
pub mod device;
pub mod engine;
pub mod flamegraph;
pub mod generator;
pub mod plot;
pub mod report;
pub mod run_args;
pub mod runner;
pub mod workload;
