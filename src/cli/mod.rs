//! The `hyperoffload` command line: one module per subcommand.

use clap::{Parser, Subcommand};

mod compare;
mod scan;
mod simulate;

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
    /// Run a program under the kernel's paging (memory cgroup at the budget) and under
    /// the pager, alternately, and report reads, faults, memory and speed with plots.
    Compare(compare::CompareArgs),
    /// Replay a block-access sequence against a budget with a policy and count the reads.
    Simulate(simulate::SimulateArgs),
}

pub fn run() -> anyhow::Result<std::process::ExitCode> {
    let cli = Cli::parse();
    match cli.command {
        Command::Scan(args) => scan::run(args),
        Command::Compare(args) => compare::run(args).map(|()| std::process::ExitCode::SUCCESS),
        Command::Simulate(args) => simulate::run(args).map(|()| std::process::ExitCode::SUCCESS),
    }
}

/// Parses a size argument (`64K`, `4G`) for clap.
pub(crate) fn size_arg(text: &str) -> Result<u64, String> {
    hyperoffload::size::parse_size(text).map_err(|error| error.to_string())
}
