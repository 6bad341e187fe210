//! The `hyperoffload` command line: one module per subcommand, and the parts only the
//! command line uses, outside the library: `compare` (a program under the kernel's
//! paging and under the pager, measured alike; `bench`, `trace` and `inspect` use its
//! parts too), `sim` (the policy simulator behind `simulate` and `bench`'s floors) and
//! `device` (the device's read rate, `bench`'s yardstick). They use the library as any
//! client does, through `hyperoffload::`.

use clap::{Parser, Subcommand};

mod bench;
mod child;
mod closing;
mod compare;
mod device;
mod exec_check;
mod exit_status;
mod forward;
mod inspect;
mod mount;
mod provenance;
mod run;
mod scan;
mod sim;
mod simulate;
mod synth;
mod trace;

#[derive(Parser)]
#[command(
    name = "hyperoffload",
    version,
    about = "A user-space pager for models larger than RAM"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Read a file through a pager region and report throughput and the pager's stats.
    Scan(scan::ScanArgs),
    /// The headline benchmark: llama-bench decode at several budgets, kernel against
    /// pager, with the floor each budget allows; writes results.md.
    Bench(bench::BenchArgs),
    /// Run a program under the kernel's paging (memory cgroup at the budget) and under
    /// the pager, alternately, and report reads, faults, memory and speed with plots.
    Compare(compare::command::CompareArgs),
    /// Run a program under the pager and record every fault: Chrome/Perfetto trace JSON
    /// and the CSV `simulate` reads.
    Trace(trace::TraceArgs),
    /// Show a model file's tensors, sizes per layer and kind, predicted execution order
    /// and most central graph nodes (or the graph for Graphviz with --dot).
    Inspect(inspect::InspectArgs),
    /// Replay a block-access sequence against a budget with a policy and count the reads.
    Simulate(simulate::SimulateArgs),
    /// Write a llama-shaped GGUF of a given size from a small one (random weights).
    Synth(synth::SynthArgs),
    /// Run a program with its model files served by the pager (LD_PRELOAD shim), then
    /// summarise what the pager did.
    Run(run::RunArgs),
    /// Serve the objects of an S3-compatible store or an HTTP server as read-only files
    /// (FUSE), through a local cache tier that persists across mounts.
    Mount(mount::MountArgs),
}

pub fn run() -> anyhow::Result<std::process::ExitCode> {
    let cli = Cli::parse();
    match cli.command {
        Command::Scan(args) => scan::run(args),
        Command::Bench(args) => bench::run(args).map(|()| std::process::ExitCode::SUCCESS),
        Command::Compare(args) => {
            compare::command::run(args).map(|()| std::process::ExitCode::SUCCESS)
        }
        Command::Trace(args) => trace::run(args),
        Command::Inspect(args) => inspect::run(args).map(|()| std::process::ExitCode::SUCCESS),
        Command::Simulate(args) => simulate::run(args).map(|()| std::process::ExitCode::SUCCESS),
        Command::Synth(args) => synth::run(args).map(|()| std::process::ExitCode::SUCCESS),
        Command::Run(args) => run::run(args),
        Command::Mount(args) => mount::run(args),
    }
}

/// Parses a size argument (`64K`, `4G`) for clap.
pub(crate) fn size_arg(text: &str) -> Result<u64, String> {
    hyperoffload::size::parse_size(text).map_err(|error| error.to_string())
}

/// Every part of the split GGUF `model` is part of; None for a whole model, or when the
/// parts cannot be gathered, which a warning says (the file is then taken alone, as the
/// shim takes it).
pub(crate) fn split_parts_or_warn(
    model: &hyperoffload::model::ModelFile,
) -> Option<Vec<hyperoffload::model::ModelFile>> {
    hyperoffload::model::split::split_parts(model)
        .inspect_err(|error| eprintln!("warning: {error}; this file is taken alone"))
        .ok()
        .flatten()
}

/// The tensor table of a model file, for naming faults by tensor.
pub(crate) fn model_tensors(
    model: &std::path::Path,
) -> anyhow::Result<Vec<hyperoffload::model::TensorInfo>> {
    Ok(hyperoffload::model::ModelFile::open(model)?.tensors)
}

/// A `--budget` argument: a size (`128M`) or a share of `total` bytes (`50%`). Zero,
/// negative, NaN or infinite shares, and budgets that come to nothing, are refused: a
/// budget of 0 bytes would fail every run.
pub(crate) fn budget_bytes(text: &str, total: u64) -> anyhow::Result<u64> {
    memory_bytes("--budget", text, total)
}

/// Bytes of memory given to the option `flag` as a size (`48M`) or a share of `total`
/// (`50%`); never zero.
pub(crate) fn memory_bytes(flag: &str, text: &str, total: u64) -> anyhow::Result<u64> {
    use anyhow::{bail, Context};
    let bytes = match text.strip_suffix('%') {
        Some(share) => {
            let share: f64 = share
                .trim()
                .parse()
                .with_context(|| format!("{flag} {text}: not a percentage"))?;
            if !share.is_finite() || share <= 0.0 {
                bail!("{flag} {text}: the share must be a positive number of percent");
            }
            (total as f64 * share / 100.0) as u64
        }
        None => hyperoffload::size::parse_size(text).with_context(|| format!("{flag} {text}"))?,
    };
    if bytes == 0 {
        bail!("{flag} {text}: that is no memory at all");
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budgets_are_sizes_or_positive_shares() {
        assert_eq!(budget_bytes("50%", 1000).unwrap(), 500);
        assert_eq!(budget_bytes("125%", 1000).unwrap(), 1250);
        assert_eq!(budget_bytes("64K", 1000).unwrap(), 64 << 10);
        for bad in ["0%", "-5%", "nan%", "inf%", "x%", "0", "0.01%"] {
            let error = budget_bytes(bad, 1000).unwrap_err().to_string();
            assert!(error.contains(bad), "{bad}: {error}");
        }
    }
}
