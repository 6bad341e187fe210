//! Processes and threads: their ids, pidfds that poll readable when they end, whether
//! one still exists, and what a process sets for itself (its descriptor limit, a
//! thread's nice value, fork handlers).

use std::io;
use std::os::fd::OwnedFd;

use rustix::io::Errno;
use rustix::process::{Pid, PidfdFlags};

use super::errno;

/// `PIDFD_THREAD` (pidfd_open(2), Linux 6.9): the descriptor is of one thread, and polls
/// readable when that thread exits, not when its whole process does. rustix does not
/// name it; it is `O_EXCL`'s bit, libc's constant.
const PIDFD_THREAD: u32 = libc::O_EXCL as u32;

/// gettid(2).
pub fn gettid() -> i32 {
    rustix::thread::gettid().as_raw_pid()
}

/// getpid(2) from the kernel: right in any child, however it was made (fork, `_Fork`,
/// a raw clone), where a libc that caches the pid may not have updated it.
pub fn getpid() -> i32 {
    rustix::process::getpid().as_raw_pid()
}

/// Whether process `pid` exists (kill(2) with signal 0; a zombie does). Not a pid (0
/// or negative, which kill(2) would take for a process group): false.
pub fn process_exists(pid: i32) -> bool {
    pid > 0
        && Pid::from_raw(pid)
            .is_some_and(|pid| !matches!(rustix::process::test_kill_process(pid), Err(Errno::SRCH)))
}

/// A pidfd of process `pid` (pidfd_open(2)): it polls readable once the process has
/// exited. EINVAL for a number that is not a pid (0 or negative).
pub fn pidfd(pid: i32) -> io::Result<OwnedFd> {
    let pid = (pid > 0)
        .then(|| Pid::from_raw(pid))
        .flatten()
        .ok_or_else(|| errno(Errno::INVAL))?;
    Ok(rustix::process::pidfd_open(pid, PidfdFlags::empty())?)
}

/// A pidfd of the calling thread (`PIDFD_THREAD`): it polls readable once this thread
/// has exited, whether alone, with its process, or because another thread exec'd.
pub fn own_thread_pidfd() -> io::Result<OwnedFd> {
    let tid = rustix::thread::gettid();
    let flags = PidfdFlags::from_bits_retain(PIDFD_THREAD);
    Ok(rustix::process::pidfd_open(tid, flags)?)
}

/// Raises this process's soft limit of open descriptors to its hard limit.
pub fn raise_fd_limit() {
    use rustix::process::Resource;
    let limit = rustix::process::getrlimit(Resource::Nofile);
    if let Some(maximum) = limit.maximum {
        let raised = rustix::process::Rlimit {
            current: Some(maximum),
            maximum: Some(maximum),
        };
        let _ = rustix::process::setrlimit(Resource::Nofile, raised);
    }
}

/// Sets the calling thread's nice value (nice values are per thread on Linux) and
/// returns the one it has afterwards (the old one if the change was refused).
pub fn set_thread_nice(nice: i32) -> io::Result<i32> {
    // A refusal (EACCES without CAP_SYS_NICE) is answered by the value read back.
    let _ = rustix::process::setpriority_process(None, nice);
    Ok(rustix::process::getpriority_process(None)?)
}

/// Registers fork handlers with libc (pthread_atfork(3)): not a system call, but the
/// only way to run code around a libc `fork` in the forking process; so libc's.
pub fn at_fork(
    prepare: extern "C" fn(),
    parent: extern "C" fn(),
    child: extern "C" fn(),
) -> io::Result<()> {
    // SAFETY: registers three plain extern "C" functions taking no arguments, which live
    // as long as the program (the library is never unloaded while a pager runs).
    let rc = unsafe { libc::pthread_atfork(Some(prepare), Some(parent), Some(child)) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::from_raw_os_error(rc))
    }
}
