//! A non-blocking eventfd(2): how other threads wake the fault service, whose io_uring
//! ring watches it with a multishot poll.

use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};

use crate::sys;

pub(crate) struct EventFd(OwnedFd);

impl EventFd {
    pub(crate) fn new() -> io::Result<Self> {
        Ok(Self(sys::files::eventfd()?))
    }

    /// Makes the descriptor readable. A full counter (EAGAIN) already means it is.
    pub(crate) fn signal(&self) {
        let _ = sys::files::write(self.0.as_fd(), &1u64.to_ne_bytes());
    }

    /// Resets the counter; signals after this make it readable again. EAGAIN (nothing
    /// pending) is fine.
    pub(crate) fn drain(&self) {
        let mut counter = [0u8; 8];
        let _ = sys::files::read(self.0.as_fd(), &mut counter);
    }
}

impl AsRawFd for EventFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}
