//! The `hyperoffload` command line: one module per subcommand.

mod synth;

use clap::{Parser, Subcommand};

/// A user-space pager that runs models larger than RAM.
#[derive(Debug, Parser)]
#[command(name = "hyperoffload", version, about)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands, one per line.
#[derive(Debug, Subcommand)]
pub enum Command {
    Synth(synth::SynthArgs),
}

/// Parses the command line and runs the subcommand.
pub fn run() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Synth(args) => synth::run(args),
    }
}
