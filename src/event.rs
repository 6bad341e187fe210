//! A non-blocking eventfd(2): how other threads wake the fault service, whose io_uring
//! ring watches it with a multishot poll.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

pub(crate) struct EventFd(OwnedFd);

impl EventFd {
    pub(crate) fn new() -> io::Result<Self> {
        // SAFETY: eventfd(2) with valid flags has no memory effects; the result is checked.
        let raw = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a freshly created descriptor nothing else owns.
        Ok(Self(unsafe { OwnedFd::from_raw_fd(raw) }))
    }

    /// Makes the descriptor readable. A full counter (EAGAIN) already means it is.
    pub(crate) fn signal(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to an eventfd we own.
        unsafe {
            libc::write(
                self.0.as_raw_fd(),
                (&one as *const u64).cast(),
                std::mem::size_of::<u64>(),
            )
        };
    }

    /// Resets the counter; signals after this make it readable again.
    pub(crate) fn drain(&self) {
        let mut counter = 0u64;
        // SAFETY: reads 8 bytes into a live u64 from an eventfd we own; EAGAIN (nothing
        // pending) is fine.
        unsafe {
            libc::read(
                self.0.as_raw_fd(),
                (&mut counter as *mut u64).cast(),
                std::mem::size_of::<u64>(),
            )
        };
    }
}

impl AsRawFd for EventFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}
