//! The launcher's signals passed on to the program it runs: SIGTERM, SIGHUP, SIGINT and
//! SIGQUIT sent to the launcher alone (by `kill`, a service manager, a script) go to the
//! program, whose end is then reported as any other.
//!
//! - One the terminal sends (^C, ^\) is not passed on: it goes to the whole foreground
//!   process group, the program included, and passing it on would deliver it twice. The
//!   kernel marks those `SI_KERNEL`; one sent with kill(2) is `SI_USER`.
//! - A signal the launcher was started ignoring (`nohup`, a script's background job) is
//!   ignored by the program too, as it would have been without the launcher (see
//!   `keep_ignored`), and still passed on: a program that handles it (llama-completion
//!   installs a SIGINT handler) gets it as if it had been sent to it directly.
//! - The handlers are installed before the program starts (one arriving meanwhile is
//!   passed on once it has); handlers, unlike ignored signals, do not survive its exec.
//! - They stop passing signals on before the program is reaped: its pid can be reused
//!   only after that.

use std::os::unix::process::CommandExt;
use std::process::Command;
use std::sync::atomic::{AtomicI32, Ordering};

/// The signals passed on.
pub const PASSED_ON: [libc::c_int; 4] = [libc::SIGTERM, libc::SIGHUP, libc::SIGINT, libc::SIGQUIT];

/// The program's pid, for the handler; 0 before it started and after it ended.
static PROGRAM: AtomicI32 = AtomicI32::new(0);
/// A signal that arrived before the program started.
static PENDING: AtomicI32 = AtomicI32::new(0);
/// The last signal passed on (or pending), for the report.
static LAST: AtomicI32 = AtomicI32::new(0);

extern "C" fn pass_on(
    signal: libc::c_int,
    info: *mut libc::siginfo_t,
    _context: *mut libc::c_void,
) {
    // SAFETY: with SA_SIGINFO the kernel passes a valid siginfo_t (checked for null all
    // the same); reading its code is async-signal-safe.
    if !info.is_null() && unsafe { (*info).si_code } == libc::SI_KERNEL {
        return;
    }
    LAST.store(signal, Ordering::SeqCst);
    let pid = PROGRAM.load(Ordering::SeqCst);
    if pid > 0 {
        // SAFETY: kill is async-signal-safe; `pid` is the launcher's own child, not yet
        // reaped (`stop` is called before it is).
        unsafe { libc::kill(pid, signal) };
    } else {
        PENDING.store(signal, Ordering::SeqCst);
    }
}

/// The handlers replaced, to put back.
pub struct Forwarding {
    previous: [libc::sigaction; PASSED_ON.len()],
}

/// From now on the signals are caught, to be passed on once the program starts (`to`).
pub fn start() -> Forwarding {
    let previous = PASSED_ON.map(|signal| {
        // SAFETY: sigaction is plain data, valid all zero; the mask is emptied below.
        let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
        action.sa_sigaction = pass_on
            as extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void)
            as libc::sighandler_t;
        action.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART;
        // SAFETY: sigaction is plain data, valid all zero.
        let mut previous: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: installs a handler that only reads its siginfo, stores atomics and
        // calls kill (all async-signal-safe); the previous action is kept to restore.
        unsafe {
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(signal, &action, &mut previous);
        }
        previous
    });
    Forwarding { previous }
}

/// The program is `pid`: signals go to it from now on, and one that came before goes now.
pub fn to(pid: libc::pid_t) {
    PROGRAM.store(pid, Ordering::SeqCst);
    let pending = PENDING.swap(0, Ordering::SeqCst);
    if pending != 0 {
        // SAFETY: signals our own child, just started.
        unsafe { libc::kill(pid, pending) };
    }
}

impl Forwarding {
    /// Has the program `command` starts ignore the signals this process was started
    /// ignoring: it would have inherited that without the launcher, whose handlers are
    /// reset to the default at its exec instead.
    pub fn keep_ignored(&self, command: &mut Command) {
        let ignored: Vec<libc::c_int> = PASSED_ON
            .into_iter()
            .zip(&self.previous)
            .filter(|(_, previous)| previous.sa_sigaction == libc::SIG_IGN)
            .map(|(signal, _)| signal)
            .collect();
        if ignored.is_empty() {
            return;
        }
        // SAFETY: the closure runs between fork and exec and only calls signal(2)
        // (async-signal-safe) over a list allocated before the fork.
        unsafe {
            command.pre_exec(move || {
                for &signal in &ignored {
                    libc::signal(signal, libc::SIG_IGN);
                }
                Ok(())
            });
        }
    }

    /// Puts the handlers back (before the program is reaped) and returns the last
    /// signal passed on, if any.
    pub fn stop(self) -> Option<libc::c_int> {
        for (signal, previous) in PASSED_ON.into_iter().zip(self.previous) {
            // SAFETY: puts back the action `start` replaced.
            unsafe { libc::sigaction(signal, &previous, std::ptr::null_mut()) };
        }
        PROGRAM.store(0, Ordering::SeqCst);
        PENDING.store(0, Ordering::SeqCst);
        match LAST.swap(0, Ordering::SeqCst) {
            0 => None,
            signal => Some(signal),
        }
    }
}
