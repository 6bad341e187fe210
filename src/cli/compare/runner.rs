//! One run of the program, on one side, with everything recorded: a fresh memory
//! cgroup, two tracefs instances (the program's own events; the model device's block
//! requests), memory sampling, and the figures reduced from them. The model's files and
//! disks are `model_target`'s; starting the program traced and waiting for it,
//! `launch`'s; the reduction, `reduce`'s.

mod launch;
mod model_target;
mod reduce;

use std::ffi::OsString;
use std::io;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::sync::atomic::AtomicBool;

use thiserror::Error;

use super::cgroup::{CgroupError, MemoryCgroup};
use super::figures::{bandwidth_series, latency_cdf, thin};
use super::program_output::ProgramFigures;
use super::record::{MemoryFigures, RunRecord, RunSeries, Side, TracingFigures};
use super::tracefs::TracefsError;
use super::PagerBudget;
use hyperoffload::trace::TraceError;
use launch::{program_command, spawn_traced, start_sampler, wait_for, RunTraces};
use model_target::cached_bytes;
pub use model_target::{ModelTarget, ModelTargetError};
use reduce::{fault_figures, io_figures, kernel_side, model_reads, pager_side, read_events};

const BANDWIDTH_BIN_NS: u64 = 100_000_000;
const PLOT_POINTS: usize = 20_000;

#[derive(Debug, Error)]
pub enum RunError {
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    #[error(transparent)]
    Tracefs(#[from] TracefsError),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: io::Error,
    },
    #[error("pager trace: {0}")]
    PagerTrace(#[from] TraceError),
    #[error("interrupted")]
    Interrupted,
}

fn io_error(what: impl Into<String>) -> impl FnOnce(io::Error) -> RunError {
    let what = what.into();
    move |source| RunError::Io { what, source }
}

/// What to run and where to put what it leaves.
pub struct RunSpec<'a> {
    pub side: Side,
    pub index: usize,
    pub program: &'a [OsString],
    pub budget: PagerBudget,
    /// Both sides' memory cgroup limit; without it the kernel side's is the budget.
    pub cgroup_limit: Option<u64>,
    pub model: &'a ModelTarget,
    pub out_dir: &'a Path,
    /// The `hyperoffload` binary, whose `run` subcommand starts a program under the
    /// shim.
    pub launcher: &'a Path,
    /// Whether a pager run uses the expert use earlier runs saved (`CompareConfig`).
    pub saved_experts: bool,
    /// Set by a signal handler: the run is stopped and cleaned up.
    pub interrupted: &'a AtomicBool,
}

/// The files one run leaves in the output directory, named by side and index.
struct RunFiles {
    program_events: String,
    device_events: String,
    stdout: String,
    stderr: String,
    stats: String,
    pager_trace: String,
}

impl RunFiles {
    fn new(tag: &str) -> Self {
        let name = |suffix: &str| format!("run-{tag}.{suffix}");
        Self {
            program_events: name("events.txt"),
            device_events: name("block.txt"),
            stdout: name("stdout"),
            stderr: name("stderr"),
            stats: name("stats.json"),
            pager_trace: name("faults.csv"),
        }
    }
}

/// Drops the page cache; whether that left none of the model cached (a cold run), and
/// the model's bytes still cached.
fn start_cold(model: &ModelTarget) -> (bool, u64) {
    let dropped = crate::cli::device::drop_page_cache();
    let cached: u64 = model
        .files
        .parts()
        .iter()
        .map(|part| cached_bytes(&part.path).unwrap_or(0))
        .sum();
    (dropped && cached == 0, cached)
}

/// Runs the program once on `spec.side`, from a dropped page cache, in a memory cgroup
/// of its own (limited to the budget on the kernel side), traced and sampled, and
/// reduces what it recorded to the run's figures.
pub fn run_once(spec: &RunSpec) -> Result<RunRecord, RunError> {
    let tag = format!("{}-{}", spec.side.name(), spec.index);
    let files = RunFiles::new(&tag);
    let out = |name: &str| spec.out_dir.join(name);
    let (cold, model_cached_bytes) = start_cold(spec.model);

    let unique = format!("hyperoffload-{}-{tag}", std::process::id());
    let limit = match spec.side {
        Side::Kernel => spec.cgroup_limit.or(spec.budget.bytes()),
        Side::Pager => spec.cgroup_limit,
    };
    let cgroup = MemoryCgroup::create(&unique, limit)?;
    let traces = RunTraces::start(&unique, spec, &files)?;
    let command = program_command(spec, &files)?;
    let (mut child, origin_mono_ns, origin) = spawn_traced(command, &cgroup, &traces)?;
    let sampler = start_sampler(&cgroup, spec.model, origin);
    let status = wait_for(&mut child, spec.interrupted)?;
    let wall_s = origin.elapsed().as_secs_f64();
    traces.stop()?;
    let sampled = sampler.finish();
    traces.finish()?;
    let cgroup_peak = cgroup.peak_bytes().ok();
    drop(cgroup);

    let mut tracing = TracingFigures {
        event_files: vec![files.program_events.clone(), files.device_events.clone()],
        ..Default::default()
    };
    let program_events = read_events(&out(&files.program_events), &mut tracing)?;
    let device_events = read_events(&out(&files.device_events), &mut tracing)?;
    let reads = model_reads(&device_events, child.id(), spec.model, origin_mono_ns);
    let side = match spec.side {
        Side::Kernel => kernel_side(&program_events, &sampled, origin_mono_ns),
        Side::Pager => pager_side(spec, &files)?,
    };

    let stdout = std::fs::read_to_string(out(&files.stdout)).unwrap_or_default();
    let stderr = std::fs::read_to_string(out(&files.stderr)).unwrap_or_default();
    let bandwidth = bandwidth_series(&reads, BANDWIDTH_BIN_NS);
    let fault_points: Vec<(f64, u64)> = side
        .faults
        .iter()
        .map(|f| (f.t_ns as f64 / 1e9, f.file_offset))
        .collect();
    Ok(RunRecord {
        side: spec.side,
        index: spec.index,
        cold,
        model_cached_bytes,
        exit_code: status.code().or_else(|| status.signal().map(|s| -s)),
        wall_s,
        program: ProgramFigures::parse(&stdout, &stderr),
        io: io_figures(&reads, &bandwidth, wall_s),
        faults: fault_figures(&side.faults),
        memory: MemoryFigures {
            cgroup_peak_bytes: cgroup_peak,
            model_peak_resident_bytes: side.model_peak,
            process_peak_rss_bytes: sampled
                .memory
                .iter()
                .filter_map(|m| m.process_rss_bytes)
                .max(),
        },
        pager_stats: side.pager_stats,
        tracing,
        stdout_file: files.stdout,
        stderr_file: files.stderr,
        pager_trace_file: (spec.side == Side::Pager).then_some(files.pager_trace),
        series: RunSeries {
            memory: sampled.memory,
            bandwidth_mb_s: bandwidth,
            fault_map: thin(&fault_points, PLOT_POINTS),
            latency_cdf: latency_cdf(&side.faults, 2_000),
        },
    })
}

/// Every file a pager run writes in the output directory, given its `--stats` and
/// `--trace` names: the shim puts its own events beside the trace
/// (`<trace>.events.jsonl`).
fn pager_outputs(stats_file: &str, trace_file: &str) -> [String; 3] {
    [
        stats_file.to_string(),
        trace_file.to_string(),
        events_path_of(trace_file),
    ]
}

/// The shim's event log beside the trace `trace_file` (`trace::events_path`).
fn events_path_of(trace_file: &str) -> String {
    format!("{trace_file}.events.jsonl")
}
