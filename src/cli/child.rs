//! What the launcher (`run`) and `trace` do alike for the one child they supervise: the
//! child goes when they do, and the terminal's interrupts are the child's to act on.

use std::os::unix::process::CommandExt;
use std::process::Command;

/// Has the kernel send `signal` to the child `command` starts when this process dies
/// (PR_SET_PDEATHSIG), so it does not run on unsupervised; a child whose parent is
/// already gone by then exits at once, as if that signal had come.
pub fn end_with_this_process(command: &mut Command, signal: libc::c_int) {
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: the closure runs between fork and exec and only calls prctl, getppid and
    // _exit (async-signal-safe); it allocates nothing.
    unsafe {
        command.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, signal) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // Gone before the line above took effect.
            if libc::getppid() != parent {
                libc::_exit(128 + signal);
            }
            Ok(())
        });
    }
}

/// Signal handlers to put back.
pub type Handlers = [libc::sighandler_t; 2];

/// Ignores the terminal's ^C and ^\ in this process (they reach the child's process
/// group too); call after starting the child, or it would inherit SIG_IGN.
pub fn ignore_interrupts() -> Handlers {
    // SAFETY: setting SIG_IGN for two signals; the previous handlers are returned.
    unsafe {
        [
            libc::signal(libc::SIGINT, libc::SIG_IGN),
            libc::signal(libc::SIGQUIT, libc::SIG_IGN),
        ]
    }
}

pub fn restore_interrupts(previous: Handlers) {
    // SAFETY: puts back the handlers `ignore_interrupts` replaced.
    unsafe {
        libc::signal(libc::SIGINT, previous[0]);
        libc::signal(libc::SIGQUIT, previous[1]);
    }
}
