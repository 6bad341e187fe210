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

#[cfg(test)]
mod tests {
    use std::os::fd::AsRawFd;
    use std::time::Duration;

    use super::*;
    use crate::sys::files::{poll, PollFd, PollFlags};
    use crate::sys::test_child;

    /// Whether `pidfd` polls readable (its process or thread has exited) within `wait`.
    fn ended(pidfd: &OwnedFd, wait: Duration) -> bool {
        let mut fds = [PollFd::new(pidfd, PollFlags::IN)];
        poll(&mut fds, wait).unwrap() == 1
    }

    #[test]
    fn ids_are_the_kernels() {
        assert_eq!(getpid(), std::process::id() as i32);
        let here = gettid();
        let there = std::thread::spawn(gettid).join().unwrap();
        assert_ne!(here, there, "a thread id per thread");
        assert!(here > 0 && there > 0);
    }

    #[test]
    fn a_child_exists_until_reaped_and_its_pidfd_says_when_it_ended() {
        let me = pidfd(getpid()).unwrap();
        assert!(!ended(&me, Duration::ZERO));
        assert!(process_exists(getpid()));
        let flags = rustix::pipe::PipeFlags::CLOEXEC;
        let (read_end, write_end) = rustix::pipe::pipe_with(flags).unwrap();
        let write_number = write_end.as_raw_fd();
        let body = || {
            // SAFETY: the child's copy of the write end, which nothing in the child uses
            // or closes again (it ends without running destructors).
            unsafe { rustix::io::close(write_number) };
            // Waits for the parent to close its end too (EOF), then exits.
            let mut byte = [0u8; 1];
            let _ = rustix::io::read(&read_end, &mut byte);
            7
        };
        // SAFETY: the child makes direct system calls only and allocates nothing.
        let child = unsafe { test_child::spawn(body) };
        drop(read_end);
        let child_pidfd = pidfd(child.as_raw_pid()).unwrap();
        assert!(
            !ended(&child_pidfd, Duration::from_millis(5)),
            "still running"
        );
        drop(write_end);
        assert!(ended(&child_pidfd, Duration::from_secs(10)));
        assert!(process_exists(child.as_raw_pid()), "a zombie exists");
        assert_eq!(test_child::wait(child), 7);
        assert!(!process_exists(child.as_raw_pid()), "reaped");
        assert!(!process_exists(0) && !process_exists(-1));
        assert_eq!(pidfd(0).unwrap_err().raw_os_error(), Some(libc::EINVAL));
        assert_eq!(pidfd(-3).unwrap_err().raw_os_error(), Some(libc::EINVAL));
    }

    #[test]
    fn a_threads_own_pidfd_polls_readable_once_the_thread_ended() {
        let (sender, receiver) = std::sync::mpsc::channel();
        let (release, wait) = std::sync::mpsc::channel::<()>();
        let thread = std::thread::spawn(move || {
            sender.send(own_thread_pidfd()).unwrap();
            let _ = wait.recv();
        });
        let thread_pidfd = match receiver.recv().unwrap() {
            Ok(pidfd) => pidfd,
            // PIDFD_THREAD came with Linux 6.9: an older kernel is the environment.
            Err(error) if error.raw_os_error() == Some(libc::EINVAL) => {
                eprintln!("no thread pidfds here: {error}");
                drop(release);
                thread.join().unwrap();
                return;
            }
            Err(error) => panic!("own_thread_pidfd: {error}"),
        };
        assert!(
            !ended(&thread_pidfd, Duration::from_millis(5)),
            "the thread runs"
        );
        drop(release);
        thread.join().unwrap();
        assert!(ended(&thread_pidfd, Duration::from_secs(10)));
        // While this process lives on.
        assert!(!ended(&pidfd(getpid()).unwrap(), Duration::ZERO));
    }

    #[test]
    fn the_descriptor_limit_is_raised_to_the_hard_one() {
        use rustix::process::{getrlimit, Resource};
        raise_fd_limit();
        let limit = getrlimit(Resource::Nofile);
        assert_eq!(limit.current, limit.maximum);
    }

    #[test]
    fn a_thread_can_lower_its_own_priority_and_only_its_own() {
        use rustix::process::getpriority_process;
        let here = getpriority_process(None).unwrap();
        let there = std::thread::spawn(move || set_thread_nice(here + 3).unwrap());
        assert_eq!(there.join().unwrap(), (here + 3).min(19));
        assert_eq!(
            getpriority_process(None).unwrap(),
            here,
            "this thread's is unchanged"
        );
    }
}
