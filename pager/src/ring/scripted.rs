//! A stand-in for io_uring in unit tests: requests are carried out synchronously when
//! submitted, on the submitting thread (reads with pread(2), multishot polls with
//! poll(2)), and a script says how each read ends: as the file gives it, failed with an
//! errno, or short. Completions of one submission can be posted in reverse order. So a
//! test sees what the service does with each case, deterministically, with no hook in
//! the service itself.

use std::collections::VecDeque;
use std::os::fd::{BorrowedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::driver::{Posted, Request};
use crate::sys::files::{poll, pread, PollFd, PollFlags};

/// How one read ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ScriptedRead {
    /// As the file gives it.
    AsIs,
    /// Fails with this errno, reading nothing.
    Fail(i32),
    /// Reads at most this many bytes (a multiple of 4096, for O_DIRECT).
    Short(u32),
}

/// How the reads a ring is asked for end, in the order they are issued; those past the
/// script's end are read as the file gives them.
#[derive(Debug, Clone, Default)]
pub(crate) struct ReadScript {
    pub reads: VecDeque<ScriptedRead>,
    /// Each submission's completions are posted last first.
    pub reverse: bool,
    /// What the ring did, for the test to check the script took effect.
    pub log: Arc<ScriptLog>,
}

/// What a scripted ring did.
#[derive(Debug, Default)]
pub(crate) struct ScriptLog {
    /// Reads carried out (failed ones included).
    pub reads: AtomicU64,
    /// Reads the script made fail or come back short.
    pub scripted: AtomicU64,
    /// Submissions of more than one completion posted in reverse.
    pub reversed: AtomicU64,
}

impl ScriptLog {
    pub(crate) fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}

/// The longest a wait may find nothing ready before the test fails: a service waiting
/// on nothing would otherwise hang the test.
const WAIT_LIMIT: Duration = Duration::from_secs(30);

pub(crate) struct ScriptedDriver {
    script: ReadScript,
    queued: Vec<Request>,
    /// Multishot polls armed: (descriptor, user_data).
    polls: Vec<(RawFd, u64)>,
    posted: VecDeque<Posted>,
}

// SAFETY: the raw destinations in queued reads are the ring's buffers or memory its
// caller keeps for the read until its completion is reaped (`ReadRing::read_into`); the
// driver lives inside its ring and is used by whichever one thread owns the ring.
unsafe impl Send for ScriptedDriver {}

impl ScriptedDriver {
    pub(crate) fn new(script: ReadScript) -> Self {
        ScriptedDriver {
            script,
            queued: Vec::new(),
            polls: Vec::new(),
            posted: VecDeque::new(),
        }
    }

    pub(super) fn push(&mut self, request: Request) {
        self.queued.push(request);
    }

    /// Carries out every queued request, then waits until `want` completions are
    /// posted: polls post one completion each time their descriptor is found readable.
    ///
    /// # Panics
    /// If nothing can complete (no poll armed), or nothing did within `WAIT_LIMIT`.
    pub(super) fn submit_and_wait(&mut self, want: usize) {
        self.run_queued();
        let deadline = Instant::now() + WAIT_LIMIT;
        while self.posted.len() < want {
            assert!(
                !self.polls.is_empty(),
                "scripted ring: waiting for a completion with nothing that can complete"
            );
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(
                !left.is_zero(),
                "scripted ring: nothing ready in {WAIT_LIMIT:?}"
            );
            let ready = self.readable(left.min(Duration::from_millis(100)));
            for user_data in ready {
                self.posted.push_back(Posted {
                    user_data,
                    result: libc::POLLIN as i32,
                    more: true,
                });
            }
        }
    }

    pub(super) fn reap(&mut self, mut each: impl FnMut(Posted)) {
        for posted in self.posted.drain(..) {
            each(posted);
        }
    }

    fn run_queued(&mut self) {
        let mut batch = Vec::new();
        for request in std::mem::take(&mut self.queued) {
            match request {
                Request::Read {
                    fd,
                    dest,
                    len,
                    offset,
                    user_data,
                    ..
                } => {
                    let outcome = self.script.reads.pop_front().unwrap_or(ScriptedRead::AsIs);
                    let log = &self.script.log;
                    log.reads.fetch_add(1, Ordering::Relaxed);
                    if outcome != ScriptedRead::AsIs {
                        log.scripted.fetch_add(1, Ordering::Relaxed);
                    }
                    let result = match outcome {
                        ScriptedRead::AsIs => read(fd, dest, len, offset),
                        ScriptedRead::Short(most) => read(fd, dest, len.min(most), offset),
                        ScriptedRead::Fail(errno) => -errno,
                    };
                    batch.push(Posted {
                        user_data,
                        result,
                        more: false,
                    });
                }
                Request::Poll { fd, user_data } => self.polls.push((fd, user_data)),
                Request::PollRemove { target, user_data } => {
                    if let Some(at) = self.polls.iter().position(|&(_, armed)| armed == target) {
                        self.polls.remove(at);
                        // As io_uring ends a removed multishot poll: a last completion
                        // without IORING_CQE_F_MORE.
                        batch.push(Posted {
                            user_data: target,
                            result: -libc::ECANCELED,
                            more: false,
                        });
                    }
                    batch.push(Posted {
                        user_data,
                        result: 0,
                        more: false,
                    });
                }
            }
        }
        if self.script.reverse && batch.len() > 1 {
            batch.reverse();
            self.script.log.reversed.fetch_add(1, Ordering::Relaxed);
        }
        self.posted.extend(batch);
    }

    /// The user_data of the polls whose descriptors are readable, waiting up to
    /// `timeout` for one.
    fn readable(&self, timeout: Duration) -> Vec<u64> {
        // SAFETY: a watched descriptor stays open while its poll is armed (the ring's
        // user unwatches it before closing it, as with io_uring, whose poll would
        // otherwise go on); borrowed for this call only.
        let borrowed: Vec<BorrowedFd<'_>> = self
            .polls
            .iter()
            .map(|&(fd, _)| unsafe { BorrowedFd::borrow_raw(fd) })
            .collect();
        let mut fds: Vec<PollFd<'_>> = borrowed
            .iter()
            .map(|fd| PollFd::from_borrowed_fd(*fd, PollFlags::IN))
            .collect();
        match poll(&mut fds, timeout) {
            Ok(_) => {}
            // A signal: the caller waits again.
            Err(error) if error.kind() == std::io::ErrorKind::Interrupted => return Vec::new(),
            Err(error) => panic!("scripted ring: poll failed: {error}"),
        }
        fds.iter()
            .zip(&self.polls)
            .filter(|(fd, _)| !fd.revents().is_empty())
            .map(|(_, &(_, user_data))| user_data)
            .collect()
    }
}

/// pread(2) of `len` bytes at `offset` of `fd` into `dest`: bytes read, or a negated
/// errno, as io_uring posts a read's result.
fn read(fd: RawFd, dest: *mut u8, len: u32, offset: u64) -> i32 {
    // SAFETY: `fd` stays open until the read's completion is reaped (the ring's user
    // closes a region's file only after its reads end); `dest..dest + len` is the
    // read's destination, which `ReadRing::read_into`'s contract keeps mapped, writable
    // and unused by anything else until then.
    let (fd, buffer) = unsafe {
        (
            BorrowedFd::borrow_raw(fd),
            std::slice::from_raw_parts_mut(dest, len as usize),
        )
    };
    match pread(fd, buffer, offset) {
        Ok(bytes) => bytes as i32,
        Err(error) => -error.raw_os_error().unwrap_or(libc::EIO),
    }
}
