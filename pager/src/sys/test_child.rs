//! Tests' child processes: a copy of the test process made with a raw clone(2), so that
//! no fork handler runs (the pager's own, registered by other tests in the same binary,
//! would pause their services), which runs one closure and exits with its value.

use rustix::process::{Pid, WaitOptions};

/// Runs `body` in a new child process and returns the child's pid; the child exits
/// with `body`'s value, without unwinding or running destructors.
///
/// # Safety
/// The child is a copy of this process with the calling thread alone, and no libc
/// fork handler has run: locks other threads held stay held there forever. `body` must
/// make only direct system calls (rustix's, this module's `sys` functions that allocate
/// nothing) and must not panic.
pub unsafe fn spawn(body: impl FnOnce() -> i32) -> Pid {
    // SAFETY: clone(2) with only SIGCHLD is fork(2) without libc's handlers; the flags
    // ask for no shared memory, so the child writes its own copy of the stack.
    let rc = unsafe { libc::syscall(libc::SYS_clone, libc::SIGCHLD, 0, 0, 0, 0) };
    match rc {
        -1 => panic!("clone: {}", std::io::Error::last_os_error()),
        0 => {
            let code = body();
            // SAFETY: exit_group(2) ends the child here: nothing after it runs.
            unsafe { libc::syscall(libc::SYS_exit_group, code) };
            unreachable!("exit_group returned")
        }
        pid => Pid::from_raw(pid as i32).expect("a child's pid is positive"),
    }
}

/// Waits for `child` to end and returns its exit code.
pub fn wait(child: Pid) -> i32 {
    let (_, status) = rustix::process::waitpid(Some(child), WaitOptions::empty())
        .expect("waitpid")
        .expect("a status");
    status.exit_status().expect("the child exited")
}
