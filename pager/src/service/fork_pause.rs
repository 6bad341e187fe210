//! The service's side of a fork of the program (`Command::ForkComing`).
//!
//! glibc's `fork` takes every allocator lock after running the `pthread_atfork` prepare
//! handlers and keeps them until the fork system call returns; with fork events on, the
//! system call returns only once the service has read the fork event from the program's
//! userfaultfd. A service that allocated (or took any lock the forking thread holds) in
//! between would wait on the forking thread, which waits on it: measured, the second
//! fork of a test hung that way with the service thread in `futex_wait`. So once the
//! prepare handler (`pager::fork_guard`) is answered, the service only polls and reads
//! the program's userfaultfd into room reserved beforehand, until the fork event (or
//! the parent handler's word that the fork returned without one), and serves what it
//! read afterwards.

use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use userfaultfd::Event;

use super::{FaultService, ServiceError};
use crate::sys::files::{PollFd, PollFlags};

/// Faults read while paused, at most: one per thread of the program is pending at a
/// time, so this is the most threads a paused fork serves without a lost fault.
const PAUSED_FAULTS: usize = 4096;
/// Forks handed over in one pause, at most (one is usual: two threads forking at once
/// queue behind each other in glibc).
const PAUSED_FORKS: usize = 16;
/// A pause lasts at most this long: a fork that neither sends its event nor returns
/// (the forking thread stopped by a debugger) must not stop the service for good.
const MAX_PAUSE: Duration = Duration::from_secs(30);

/// What a wait in a pause says to do next (pure: `pause_step`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) enum PauseStep {
    /// Read the program's events.
    Read,
    /// The fork is over: resume serving.
    Resume,
    /// Wait again.
    Wait,
}

/// The next step of a pause for the fork numbered `generation`: resume once a fork
/// event was read, once the parent handler counted that fork done, or past the limit;
/// read when the userfaultfd is readable.
pub(super) fn pause_step(
    forked: bool,
    forks_done: u64,
    generation: u64,
    uffd_readable: bool,
    elapsed: Duration,
) -> PauseStep {
    if forked || forks_done > generation || elapsed >= MAX_PAUSE {
        PauseStep::Resume
    } else if uffd_readable {
        PauseStep::Read
    } else {
        PauseStep::Wait
    }
}

impl FaultService {
    /// Before answering a fork's prepare handler: room for what the pause will read.
    pub(super) fn make_ready_for_fork(&mut self) {
        self.backlog.reserve(PAUSED_FAULTS, PAUSED_FORKS);
    }

    /// Reads the program's userfaultfd, allocating nothing, until the fork event of the
    /// fork numbered `generation` (see the module's comment).
    pub(super) fn pause_for_fork(&mut self, generation: u64) -> Result<(), ServiceError> {
        let start = Instant::now();
        let mut forked = false;
        loop {
            let done = self.shared.forks_done.load(Ordering::Acquire);
            let readable = readable(self.uffd.as_fd(), Duration::from_millis(5));
            match pause_step(forked, done, generation, readable, start.elapsed()) {
                PauseStep::Resume => break,
                PauseStep::Wait => continue,
                PauseStep::Read => {}
            }
            let events = self
                .uffd
                .read_events(&mut self.events)
                .map_err(|error| ServiceError::Events(format!("{error:?}")))?;
            for event in events.flatten() {
                match event {
                    Event::Pagefault {
                        addr, thread_id, ..
                    } => {
                        let kept = self
                            .backlog
                            .push_fault_within_room(addr as usize, thread_id.as_raw() as u32);
                        if !kept {
                            // Woken, the thread faults again after the pause.
                            let page = self.config.page_size as usize;
                            let page_addr = addr as usize & !(page - 1);
                            let _ = self.uffd.wake(page_addr as *mut libc::c_void, page);
                        }
                    }
                    Event::Fork { uffd } => {
                        forked = true;
                        self.backlog.push_fork_within_room(uffd);
                    }
                    _ => {}
                }
            }
        }
        // Allocating is safe again once the fork returned; the backlog is served on the
        // next turn of the loop.
        Ok(())
    }
}

/// Whether `fd` becomes readable within `timeout`.
fn readable(fd: BorrowedFd<'_>, timeout: Duration) -> bool {
    let mut fds = [PollFd::new(&fd, PollFlags::IN)];
    matches!(crate::sys::files::poll(&mut fds, timeout), Ok(n) if n > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pause_ends_with_the_fork_event_the_forks_return_or_the_limit() {
        let short = Duration::from_millis(1);
        assert_eq!(pause_step(false, 3, 3, false, short), PauseStep::Wait);
        assert_eq!(pause_step(false, 3, 3, true, short), PauseStep::Read);
        assert_eq!(pause_step(true, 3, 3, true, short), PauseStep::Resume);
        assert_eq!(
            pause_step(false, 4, 3, true, short),
            PauseStep::Resume,
            "the fork returned without an event (no region to copy, or it failed)"
        );
        assert_eq!(pause_step(false, 3, 3, true, MAX_PAUSE), PauseStep::Resume);
    }
}
