//! The `hyperoffload` command line: one module per subcommand.

use clap::{Parser, Subcommand};

mod scan;
mod simulate;
mod synth;

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
    /// Replay a block-access sequence against a budget with a policy and count the reads.
    Simulate(simulate::SimulateArgs),
    /// Write a llama-shaped GGUF of a given size from a small one (random weights).
    Synth(synth::SynthArgs),
}

pub fn run() -> anyhow::Result<std::process::ExitCode> {
    let cli = Cli::parse();
    match cli.command {
        Command::Scan(args) => scan::run(args),
        Command::Simulate(args) => simulate::run(args).map(|()| std::process::ExitCode::SUCCESS),
        Command::Synth(args) => synth::run(args).map(|()| std::process::ExitCode::SUCCESS),
    }
}

/// Parses a size argument (`64K`, `4G`) for clap.
pub(crate) fn size_arg(text: &str) -> Result<u64, String> {
    hyperoffload::size::parse_size(text).map_err(|error| error.to_string())
}
