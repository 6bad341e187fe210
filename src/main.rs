//! The `hyperoffload` command line.

fn main() -> anyhow::Result<()> {
    hyperoffload::cli::run()
}
