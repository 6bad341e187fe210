//! The `hyperoffload` command line: one module per subcommand.

use clap::{Parser, Subcommand};

mod exec_check;
mod run;
mod scan;

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
    /// Run a program with its model files served by the pager (LD_PRELOAD shim), then
    /// summarise what the pager did.
    Run(run::RunArgs),
}

pub fn run() -> anyhow::Result<std::process::ExitCode> {
    let cli = Cli::parse();
    match cli.command {
        Command::Scan(args) => scan::run(args),
        Command::Run(args) => run::run(args),
    }
}

/// Parses a size argument (`64K`, `4G`) for clap.
pub(crate) fn size_arg(text: &str) -> Result<u64, String> {
    hyperoffload::size::parse_size(text).map_err(|error| error.to_string())
}
