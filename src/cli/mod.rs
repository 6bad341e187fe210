//! The `hyperoffload` command line: one subcommand per module.

use clap::{Parser, Subcommand};

mod simulate;

#[derive(Parser)]
#[command(name = "hyperoffload", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Replay a block-access sequence against a budget with a policy and count the reads.
    Simulate(simulate::SimulateArgs),
}

pub fn run() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Simulate(args) => simulate::run(args),
    }
}
