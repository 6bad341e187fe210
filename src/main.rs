//! The `hyperoffload` command line.

mod cli;

fn main() -> anyhow::Result<()> {
    cli::run()
}
