//! A thread of the shim's own that calls a function at a fixed period for as long as
//! the process runs (or until the function says to stop).
//!
//! The thread blocks every signal: a signal sent to the process goes to one of its
//! threads that does not block it, and must reach the program's own threads, whose
//! handlers (or `sigwait`) expect it, never this one. A new thread starts with the
//! signal mask of the thread that creates it, so the mask is set around its creation
//! (there is no moment at which it could take a signal). Nothing it calls may fault on
//! managed memory: a blocked SIGSEGV or SIGBUS kills the process.

use std::time::Duration;

/// Starts a thread named `name` that calls `tick` now and then every `period`, until
/// `tick` returns false.
pub fn every(
    name: &str,
    period: Duration,
    mut tick: impl FnMut() -> bool + Send + 'static,
) -> std::io::Result<()> {
    // SAFETY: sigset_t is plain data; sigfillset and pthread_sigmask only write the sets
    // given (glibc leaves its own internal signals unblocked).
    let previous = unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut previous: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut previous);
        previous
    };
    let spawned = std::thread::Builder::new()
        .name(name.to_string())
        .spawn(move || {
            while tick() {
                std::thread::sleep(period);
            }
        });
    // SAFETY: puts back this thread's own mask, saved above.
    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &previous, std::ptr::null_mut()) };
    spawned.map(|_| ())
}
