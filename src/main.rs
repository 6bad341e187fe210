//! The `hyperoffload` command line.

mod cli;

fn main() -> std::process::ExitCode {
    match cli::run() {
        Ok(code) => code,
        Err(error) => {
            eprintln!("hyperoffload: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
