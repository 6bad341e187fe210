//! `hyperoffload compare`: the same program under the kernel's paging (a memory cgroup
//! at the budget) and under the pager (the shim at the same budget), alternately, with
//! the kernel's tracepoints and the pager's own records reduced to the same figures.
//!
//! Pure parts (parsers, reductions, report, plots) are separate from the parts that
//! touch the system (`cgroup`, `tracefs`, `sampler`, `runner`). `compare` runs the sides
//! alternately, kernel first, through `runner::run_once`; each run is reduced to a
//! `record::RunRecord`, and the report is made of those alone. `command` is the
//! subcommand's arguments and progress; `bench` calls `compare` per budget.

pub mod budget_curve;
pub mod cgroup;
pub mod chrome_trace;
pub mod command;
pub mod figures;
pub mod heat_map;
pub mod kernel_events;
pub mod model_files;
pub mod model_summary;
pub mod plots;
pub mod proc_maps;
pub mod program_output;
pub mod record;
pub mod report;
pub mod runner;
pub mod sampler;
pub mod samples;
pub mod svg;
pub mod trace_event;
pub mod tracefs;

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;

use thiserror::Error;

use record::{RunRecord, Side};
use report::{Report, ReportHeader, METHOD};
use runner::{run_once, ModelTarget, ModelTargetError, RunError, RunSpec};

#[derive(Debug, Error)]
pub enum CompareError {
    #[error("no model file among the program's arguments (an existing *.gguf or *.safetensors); name it with --model")]
    NoModel,
    #[error("model {path}: {source}")]
    Model {
        path: PathBuf,
        #[source]
        source: ModelTargetError,
    },
    #[error("{side} run {index}: {source}")]
    Run {
        side: &'static str,
        index: usize,
        #[source]
        source: RunError,
    },
    #[error("an automatic budget needs a cgroup limit: the kernel side has no other")]
    AutoWithoutLimit,
    #[error("{path}: {source}")]
    Output {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// The first argument naming an existing model file.
pub fn find_model_argument(program: &[OsString]) -> Option<PathBuf> {
    program.iter().skip(1).map(PathBuf::from).find(|path| {
        let model_extension = path
            .extension()
            .and_then(|e| e.to_str())
            .is_some_and(|e| e == "gguf" || e == "safetensors");
        model_extension && path.is_file()
    })
}

/// The pager side's budget.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum PagerBudget {
    Bytes(u64),
    /// `run --budget auto`: what the cgroup and the machine can spare, followed.
    Auto,
}

impl PagerBudget {
    pub fn bytes(self) -> Option<u64> {
        match self {
            PagerBudget::Bytes(bytes) => Some(bytes),
            PagerBudget::Auto => None,
        }
    }

    pub fn describe(self) -> String {
        match self {
            PagerBudget::Bytes(bytes) => hyperoffload::size::format_size(bytes),
            PagerBudget::Auto => "auto".to_string(),
        }
    }
}

pub struct CompareConfig {
    pub program: Vec<OsString>,
    pub budget: PagerBudget,
    /// Both sides run in a memory cgroup of this many bytes (the kernel side's limit
    /// otherwise is the budget). Required with `PagerBudget::Auto`.
    pub cgroup_limit: Option<u64>,
    pub runs: usize,
    pub out_dir: PathBuf,
    pub model: Option<PathBuf>,
    /// The `hyperoffload` binary (for `run`).
    pub launcher: PathBuf,
    /// Pager runs start from the expert use earlier runs saved beside the model and save
    /// their own; otherwise each learns alone (`run --fresh-experts`), as each kernel
    /// run starts with its page cache dropped.
    pub saved_experts: bool,
}

/// Runs both sides `runs` times, alternately (kernel first), and writes `report.md`,
/// `report.json` and the plots to the output directory. `on_run` hears of every
/// finished run.
pub fn compare(
    config: &CompareConfig,
    interrupted: &AtomicBool,
    on_run: impl FnMut(&RunRecord),
) -> Result<Report, CompareError> {
    if config.budget == PagerBudget::Auto && config.cgroup_limit.is_none() {
        return Err(CompareError::AutoWithoutLimit);
    }
    let model_path = match &config.model {
        Some(path) => path.clone(),
        None => find_model_argument(&config.program).ok_or(CompareError::NoModel)?,
    };
    let model = ModelTarget::find(&model_path).map_err(|source| CompareError::Model {
        path: model_path.clone(),
        source,
    })?;
    std::fs::create_dir_all(&config.out_dir).map_err(|source| CompareError::Output {
        path: config.out_dir.clone(),
        source,
    })?;
    let runs = run_sides(config, &model, interrupted, on_run)?;
    let (latency_edges_us, request_size_edges) = report::standard_edges();
    let report = Report {
        header: report_header(config, &model, &runs),
        method: METHOD.to_string(),
        latency_edges_us,
        request_size_edges,
        runs,
    };
    write_outputs(&report, &config.out_dir)?;
    Ok(report)
}

/// The runs of both sides on `model`, alternately, kernel first; the first that fails
/// ends the comparison.
fn run_sides(
    config: &CompareConfig,
    model: &ModelTarget,
    interrupted: &AtomicBool,
    mut on_run: impl FnMut(&RunRecord),
) -> Result<Vec<RunRecord>, CompareError> {
    let mut runs = Vec::new();
    for index in 1..=config.runs {
        for side in [Side::Kernel, Side::Pager] {
            let spec = RunSpec {
                side,
                index,
                program: &config.program,
                budget: config.budget,
                cgroup_limit: config.cgroup_limit,
                model,
                out_dir: &config.out_dir,
                launcher: &config.launcher,
                saved_experts: config.saved_experts,
                interrupted,
            };
            let record = run_once(&spec).map_err(|source| CompareError::Run {
                side: side.name(),
                index,
                source,
            })?;
            on_run(&record);
            runs.push(record);
        }
    }
    Ok(runs)
}

/// What the report says of the comparison: the command, the model and its disks, the
/// budget, and the machine.
fn report_header(config: &CompareConfig, model: &ModelTarget, runs: &[RunRecord]) -> ReportHeader {
    let files = &model.files;
    ReportHeader {
        command: config
            .program
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect(),
        model: files.first().path.display().to_string(),
        model_parts: if files.is_split() {
            files
                .parts()
                .iter()
                .map(|part| part.path.display().to_string())
                .collect()
        } else {
            Vec::new()
        },
        model_bytes: files.total_len(),
        budget_bytes: config.budget.bytes().unwrap_or(0),
        budget_auto: config.budget == PagerBudget::Auto,
        cgroup_limit_bytes: config.cgroup_limit,
        device: model
            .devices
            .iter()
            .map(|device| device.to_string())
            .collect::<Vec<_>>()
            .join(", "),
        runs_per_side: config.runs,
        cold: runs.iter().all(|r| r.cold),
        cgroup_version: cgroup::memory_hierarchy()
            .map(|(_, version)| format!("{version:?}"))
            .unwrap_or_default(),
        kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .unwrap_or_default()
            .trim()
            .to_string(),
    }
}

/// Writes `report.md`, `report.json` and the SVG plots.
pub fn write_outputs(report: &Report, out_dir: &Path) -> Result<(), CompareError> {
    let write = |name: &str, text: &str| {
        let path = out_dir.join(name);
        std::fs::write(&path, text).map_err(|source| CompareError::Output { path, source })
    };
    write("report.md", &report.to_markdown())?;
    // Plain data: serialization cannot fail.
    write(
        "report.json",
        &serde_json::to_string_pretty(report).expect("the report serializes to JSON"),
    )?;
    for (name, svg) in plots::render_plots(report) {
        write(name, &svg)?;
    }
    Ok(())
}
