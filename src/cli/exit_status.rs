//! A child's exit status passed on as this process's own, so a shell or script sees what
//! the program did: its exit code, or death by the same signal.

use std::os::unix::process::ExitStatusExt;
use std::process::{ExitCode, ExitStatus};

/// How a child ended, as far as passing it on goes.
#[derive(Debug, PartialEq, Eq)]
pub enum Ending {
    /// It exited with this code (the low 8 bits, all a parent sees).
    Code(u8),
    /// A signal killed it.
    Signal(i32),
}

/// A signal's name for people: `SIGTERM`, or `signal 42` for one without a name here.
pub fn signal_name(signal: i32) -> String {
    const NAMES: [(i32, &str); 19] = [
        (libc::SIGHUP, "SIGHUP"),
        (libc::SIGINT, "SIGINT"),
        (libc::SIGQUIT, "SIGQUIT"),
        (libc::SIGILL, "SIGILL"),
        (libc::SIGTRAP, "SIGTRAP"),
        (libc::SIGABRT, "SIGABRT"),
        (libc::SIGBUS, "SIGBUS"),
        (libc::SIGFPE, "SIGFPE"),
        (libc::SIGKILL, "SIGKILL"),
        (libc::SIGUSR1, "SIGUSR1"),
        (libc::SIGSEGV, "SIGSEGV"),
        (libc::SIGUSR2, "SIGUSR2"),
        (libc::SIGPIPE, "SIGPIPE"),
        (libc::SIGALRM, "SIGALRM"),
        (libc::SIGTERM, "SIGTERM"),
        (libc::SIGXCPU, "SIGXCPU"),
        (libc::SIGXFSZ, "SIGXFSZ"),
        (libc::SIGSYS, "SIGSYS"),
        (libc::SIGSTKFLT, "SIGSTKFLT"),
    ];
    NAMES
        .iter()
        .find(|(number, _)| *number == signal)
        .map_or_else(|| format!("signal {signal}"), |(_, name)| name.to_string())
}

/// How `status` ended.
pub fn ending(status: ExitStatus) -> Ending {
    match (status.code(), status.signal()) {
        (Some(code), _) => Ending::Code(code as u8),
        (None, Some(signal)) => Ending::Signal(signal),
        // Neither: not a status `wait` returns for a finished child; say it was killed.
        (None, None) => Ending::Signal(libc::SIGKILL),
    }
}

/// Ends like the child did: its exit code to return from `main`, or this process killed
/// by the child's signal (the code is 128 + N, the shell's convention, if it survives
/// that, as it does for a signal that stops or is ignored by default).
pub fn pass_through(status: ExitStatus) -> ExitCode {
    match ending(status) {
        Ending::Code(code) => ExitCode::from(code),
        Ending::Signal(signal) => {
            // SAFETY: restores the default action for `signal` and sends it to this
            // process: the same death the child had. Nothing is held that needs
            // cleaning up; the caller has written its output.
            unsafe {
                libc::signal(signal, libc::SIG_DFL);
                libc::raise(signal);
            }
            ExitCode::from(128u8.wrapping_add(signal as u8))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_and_signals_are_told_apart() {
        // Raw wait statuses: the code in bits 8-15, a fatal signal in bits 0-6.
        assert_eq!(ending(ExitStatus::from_raw(0)), Ending::Code(0));
        assert_eq!(ending(ExitStatus::from_raw(3 << 8)), Ending::Code(3));
        assert_eq!(ending(ExitStatus::from_raw(255 << 8)), Ending::Code(255));
        assert_eq!(
            ending(ExitStatus::from_raw(libc::SIGTERM)),
            Ending::Signal(libc::SIGTERM)
        );
    }

    #[test]
    fn signals_have_their_names() {
        assert_eq!(signal_name(libc::SIGTERM), "SIGTERM");
        assert_eq!(signal_name(libc::SIGINT), "SIGINT");
        assert_eq!(signal_name(64), "signal 64");
    }
}
