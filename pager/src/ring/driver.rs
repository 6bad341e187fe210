//! What the ring asks of the kernel, and the one place that talks to io_uring: requests
//! pushed and submitted, completions posted. `ReadRing` (its slots and buffers) stands
//! on this; the service's unit tests stand it on a scripted stand-in instead
//! (`super::scripted`), which posts what a script says.

use std::io;
use std::os::fd::RawFd;
use std::time::{Duration, Instant};

use io_uring::{cqueue, opcode, squeue, types, IoUring, Probe};
use thiserror::Error;

/// Why the service cannot use io_uring.
#[derive(Debug, Error)]
pub enum RingError {
    #[error(
        "io_uring is not permitted ({source}); check sysctl kernel.io_uring_disabled \
         (0 allows it for everyone, 1 for members of kernel.io_uring_group, 2 for no one)"
    )]
    NotPermitted { source: io::Error },
    #[error("io_uring is not available in this kernel ({source})")]
    Unsupported { source: io::Error },
    #[error("cannot create an io_uring with {entries} entries: {source} (RLIMIT_MEMLOCK too low on an old kernel?)")]
    Setup { entries: u32, source: io::Error },
    #[error("this kernel's io_uring lacks {0}")]
    MissingOpcode(&'static str),
    #[error("cannot allocate {bytes} bytes of read buffers: {source}")]
    Buffers { bytes: usize, source: io::Error },
    #[error("io_uring submit failed: {0}")]
    Submit(io::Error),
}

/// A request the ring makes.
#[derive(Debug, Clone, Copy)]
pub(super) enum Request {
    /// Reads `len` bytes at `offset` of `fd` into `dest`; `off_thread`: issued from the
    /// kernel's io_uring workers (IOSQE_ASYNC).
    Read {
        fd: RawFd,
        dest: *mut u8,
        len: u32,
        offset: u64,
        off_thread: bool,
        user_data: u64,
    },
    /// A multishot poll for readability of `fd`.
    Poll { fd: RawFd, user_data: u64 },
    /// Ends the multishot poll started with `target` as its `user_data`.
    PollRemove { target: u64, user_data: u64 },
}

/// A completion as the kernel posts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Posted {
    pub user_data: u64,
    /// Bytes read, a poll's event mask, or a negated errno.
    pub result: i32,
    /// The multishot poll goes on (IORING_CQE_F_MORE); false for everything else.
    pub more: bool,
}

/// Who carries out the ring's requests.
pub(super) enum Driver {
    Uring(IoUring),
    #[cfg(test)]
    Scripted(super::scripted::ScriptedDriver),
}

impl Driver {
    /// An io_uring of `entries` submission entries that can read and poll.
    pub(super) fn uring(entries: u32) -> Result<Self, RingError> {
        // Cooperative task running: a completion (or a poll readiness) is not signalled
        // to the service thread with an inter-processor interrupt while it runs; it is
        // processed at its next system call, which the service makes constantly, or
        // when the taskrun flag tells a polling loop to enter. A sleeping service is
        // still woken.
        // Kernels before 5.19 refuse the flags (EINVAL): run without them there.
        let build = |cooperative: bool| {
            let mut builder = IoUring::builder();
            builder.setup_cqsize(entries * 2);
            if cooperative {
                builder.setup_coop_taskrun().setup_taskrun_flag();
            }
            builder.build(entries)
        };
        let ring = build(true)
            .or_else(|error| match error.raw_os_error() {
                Some(libc::EINVAL) => build(false),
                _ => Err(error),
            })
            .map_err(|source| match source.raw_os_error() {
                Some(libc::EPERM) => RingError::NotPermitted { source },
                Some(libc::ENOSYS) => RingError::Unsupported { source },
                _ => RingError::Setup { entries, source },
            })?;
        let mut probe = Probe::new();
        ring.submitter()
            .register_probe(&mut probe)
            .map_err(|source| RingError::Unsupported { source })?;
        for (code, name) in [
            (opcode::Read::CODE, "IORING_OP_READ"),
            (opcode::PollAdd::CODE, "IORING_OP_POLL_ADD"),
        ] {
            if !probe.is_supported(code) {
                return Err(RingError::MissingOpcode(name));
            }
        }
        Ok(Driver::Uring(ring))
    }

    /// Queues `request`; with io_uring, a full submission queue is submitted first.
    ///
    /// # Safety
    /// A read's `dest..dest + len` must stay mapped, writable and unused by anything
    /// else until its completion is reaped.
    pub(super) unsafe fn push(&mut self, request: Request) -> Result<(), RingError> {
        match self {
            Driver::Uring(ring) => {
                let entry = uring_entry(request);
                loop {
                    // SAFETY: a read's destination stays valid until its completion is
                    // reaped (this function's contract); other entries reference no
                    // memory.
                    if unsafe { ring.submission().push(&entry) }.is_ok() {
                        return Ok(());
                    }
                    // Submission queue full: hand what is queued to the kernel and retry.
                    ring.submit().map_err(RingError::Submit)?;
                }
            }
            #[cfg(test)]
            Driver::Scripted(scripted) => {
                scripted.push(request);
                Ok(())
            }
        }
    }

    /// Submits queued requests and waits until at least `want` completions are ready.
    pub(super) fn submit_and_wait(&mut self, want: usize) -> Result<(), RingError> {
        match self {
            Driver::Uring(ring) => uring_submit_and_wait(ring, want),
            #[cfg(test)]
            Driver::Scripted(scripted) => {
                scripted.submit_and_wait(want);
                Ok(())
            }
        }
    }

    /// Submits queued requests, then polls the completion queue for up to `spin` before
    /// sleeping in the kernel until one arrives.
    pub(super) fn submit_and_spin(&mut self, spin: Duration) -> Result<(), RingError> {
        match self {
            Driver::Uring(ring) => uring_submit_and_spin(ring, spin),
            #[cfg(test)]
            Driver::Scripted(scripted) => {
                scripted.submit_and_wait(1);
                Ok(())
            }
        }
    }

    /// Hands every posted completion to `each`, in the order posted.
    pub(super) fn reap(&mut self, mut each: impl FnMut(Posted)) {
        match self {
            Driver::Uring(ring) => {
                for entry in ring.completion() {
                    each(Posted {
                        user_data: entry.user_data(),
                        result: entry.result(),
                        more: cqueue::more(entry.flags()),
                    });
                }
            }
            #[cfg(test)]
            Driver::Scripted(scripted) => scripted.reap(each),
        }
    }
}

fn uring_submit_and_wait(ring: &mut IoUring, want: usize) -> Result<(), RingError> {
    loop {
        match ring.submit_and_wait(want) {
            Ok(_) => return Ok(()),
            Err(error) if error.raw_os_error() == Some(libc::EINTR) => continue,
            // The completion queue is full: the caller must reap before submitting.
            Err(error) if error.raw_os_error() == Some(libc::EBUSY) => return Ok(()),
            Err(error) => return Err(RingError::Submit(error)),
        }
    }
}

fn uring_submit_and_spin(ring: &mut IoUring, spin: Duration) -> Result<(), RingError> {
    loop {
        match ring.submit() {
            Ok(_) => break,
            Err(error) if error.raw_os_error() == Some(libc::EINTR) => continue,
            Err(error) if error.raw_os_error() == Some(libc::EBUSY) => return Ok(()),
            Err(error) => return Err(RingError::Submit(error)),
        }
    }
    let deadline = Instant::now() + spin;
    loop {
        if ring.submission().taskrun() {
            // Completions wait as task work (cooperative task running): enter the
            // kernel to have them posted.
            uring_submit_and_wait(ring, 0)?;
        }
        let ready = {
            let mut completions = ring.completion();
            completions.sync();
            !completions.is_empty()
        };
        if ready {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return uring_submit_and_wait(ring, 1);
        }
        std::hint::spin_loop();
    }
}

/// The io_uring entry for `request`.
fn uring_entry(request: Request) -> squeue::Entry {
    match request {
        Request::Read {
            fd,
            dest,
            len,
            offset,
            off_thread,
            user_data,
        } => {
            let entry = opcode::Read::new(types::Fd(fd), dest, len)
                .offset(offset)
                .build()
                .user_data(user_data);
            if off_thread {
                entry.flags(squeue::Flags::ASYNC)
            } else {
                entry
            }
        }
        Request::Poll { fd, user_data } => opcode::PollAdd::new(types::Fd(fd), libc::POLLIN as u32)
            .multi(true)
            .build()
            .user_data(user_data),
        Request::PollRemove { target, user_data } => {
            opcode::PollRemove::new(target).build().user_data(user_data)
        }
    }
}
