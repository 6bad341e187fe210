//! `hyperoffload compare`: the kernel's paging against the pager's, same program, same
//! budget, with a report and plots.

use std::ffi::OsString;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{bail, Context};
use indicatif::{ProgressBar, ProgressStyle};

use super::report::failed_runs;
use super::{compare, find_model_argument, CompareConfig, PagerBudget};
use hyperoffload::model::split::model_len;
use hyperoffload::size::format_size;

#[derive(clap::Args)]
pub struct CompareArgs {
    /// RAM for the model: a size (`48M`) or a share of the model (`50%`; of all its
    /// files for a split GGUF). The kernel side's cgroup gets the same limit, page
    /// cache included. `auto` (with --cgroup-limit): the pager follows what the
    /// cgroup can spare, as `run`'s default does.
    #[arg(long)]
    budget: String,
    /// Run both sides in a memory cgroup of this size (page cache and the pager's
    /// frames included), as in a container with a memory limit: a size or a share of
    /// the model. The kernel side gets this limit instead of the budget.
    #[arg(long, value_name = "SIZE")]
    cgroup_limit: Option<String>,
    /// Runs per side.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Where report.md, report.json, the plots and the raw traces go.
    #[arg(long, default_value = "compare-out")]
    out: PathBuf,
    /// The model file the program maps, or any part of a split GGUF (default: the
    /// first *.gguf / *.safetensors argument).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Let pager runs start from the expert use earlier runs saved beside a mixture of
    /// experts (and save their own). By default each pager run learns the routing from
    /// its own tokens, as each kernel run starts with the page cache dropped.
    #[arg(long)]
    saved_experts: bool,
    /// The program and its arguments.
    #[arg(last = true, required = true)]
    program: Vec<OsString>,
}

pub(crate) static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_interrupt(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::Relaxed);
}

/// Ctrl-C stops the run in progress, and the cgroup and trace instances are removed
/// on the way out instead of being left behind by a killed process.
pub(crate) fn catch_interrupts() {
    let handler = on_interrupt as extern "C" fn(libc::c_int) as libc::sighandler_t;
    for signal in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        unsafe { libc::signal(signal, handler) };
    }
}

pub fn run(args: CompareArgs) -> anyhow::Result<()> {
    if args.runs == 0 {
        bail!("--runs must be at least 1");
    }
    let model = match &args.model {
        Some(model) => model.clone(),
        None => find_model_argument(&args.program).context(
            "no *.gguf or *.safetensors file among the program's arguments: give --model",
        )?,
    };
    // All the parts of a split model, as the shim resolves a share for the pager side.
    let model_len = model_len(&model).with_context(|| model.display().to_string())?;
    let cgroup_limit = args
        .cgroup_limit
        .as_deref()
        .map(|text| crate::cli::memory_bytes("--cgroup-limit", text, model_len))
        .transpose()?;
    let budget = match (args.budget.as_str(), cgroup_limit) {
        ("auto", Some(_)) => PagerBudget::Auto,
        ("auto", None) => bail!(
            "--budget auto needs --cgroup-limit: the kernel side is limited to the budget, and auto has no size until the pager runs"
        ),
        (text, _) => PagerBudget::Bytes(crate::cli::budget_bytes(text, model_len)?),
    };
    if euid() != 0 {
        eprintln!("warning: not root: the page cache cannot be dropped, so the comparison is not cold (the report says so); cgroups and tracefs will likely fail too");
    }
    catch_interrupts();
    let config = CompareConfig {
        program: args.program,
        budget,
        cgroup_limit,
        runs: args.runs,
        out_dir: args.out.clone(),
        model: Some(model),
        launcher: std::env::current_exe().context("finding this executable for `run`")?,
        saved_experts: args.saved_experts,
    };
    let progress = ProgressBar::new(2 * args.runs as u64);
    progress.set_style(
        ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} runs {msg}",
        )
        .expect("a valid progress template"),
    );
    progress.enable_steady_tick(std::time::Duration::from_millis(200));
    progress.set_message(format!("budget {}", budget.describe()));
    let report = compare(&config, &INTERRUPTED, |run| {
        progress.inc(1);
        progress.set_message(format!(
            "{} run {}: {:.1} s, read {}",
            run.side.name(),
            run.index,
            run.wall_s,
            format_size(run.io.bytes_read)
        ));
    });
    progress.finish_and_clear();
    let report = report?;
    println!("{}", report.to_markdown());
    eprintln!(
        "wrote {}/report.md, report.json and plots",
        args.out.display()
    );
    // The report is written either way (a failure is worth reading), but a script
    // running compare must not take a run that failed for a comparison made.
    let failed = failed_runs(&report.runs);
    if !failed.is_empty() {
        bail!(
            "{} of {} runs failed, left out of the figures: {}",
            failed.len(),
            report.runs.len(),
            failed.join(", ")
        );
    }
    Ok(())
}

fn euid() -> u32 {
    // SAFETY: geteuid(2) cannot fail and has no preconditions.
    unsafe { libc::geteuid() }
}
