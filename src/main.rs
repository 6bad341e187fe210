//! The `hyperoffload` command line.

mod cli;

fn main() -> std::process::ExitCode {
    // Printing to a closed pipe (`hyperoffload scan ... | head -1`) ends quietly, as
    // Unix tools do, instead of panicking.
    // SAFETY: restores the default disposition of SIGPIPE before any thread exists.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    match cli::run() {
        Ok(code) => code,
        Err(error) => {
            eprintln!("hyperoffload: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
