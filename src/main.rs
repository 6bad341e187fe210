//! The `hyperoffload` command line.

fn main() -> anyhow::Result<()> {
    Ok(())
}
