//! A read on the ring: what it carries (`ReadTag`) and what its completion asks for
//! next (`ReadTag::step`), a decision made from the tag and the result alone.

use std::io;

use super::DIRECT_IO_ALIGN;
use crate::policy::{Install, RegionId};

/// A read the ring is doing for us.
pub(in crate::service) struct ReadTag {
    pub region: RegionId,
    pub first: u32,
    pub count: u32,
    /// File offset and length of the whole request (length O_DIRECT aligned).
    pub file_offset: u64,
    pub len: usize,
    /// Bytes of file data the request must deliver.
    pub valid: usize,
    /// Bytes received so far (short reads continue).
    pub done: usize,
    pub attempts: u32,
    pub submitted_ns: u64,
    /// Bytes of budget reserved for the blocks.
    pub reserved: u64,
    pub install: Install,
    pub prefetch: bool,
}

/// What a read's completion asks for next (`ReadTag::step`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(in crate::service) enum ReadStep {
    /// Every byte the request must deliver has arrived.
    Complete,
    /// Short: the rest is read next (`done` already counts what arrived).
    Continue,
    /// Failed with attempts left: the rest is read again.
    Retry,
    /// The filesystem refused an O_DIRECT read it had accepted at open: the rest is
    /// read through the page cache, and so is everything after.
    GoBuffered,
    /// End of file before the data the region was made for: the file shrank.
    FileShrank,
    /// Failed with no attempts left.
    Fail,
}

impl ReadTag {
    /// Takes a completion's result (bytes read, or the error) into the request's
    /// progress and says what comes next. Any error is retried while attempts are left
    /// (EINTR and EAGAIN as much as EIO); EINVAL from an O_DIRECT read is the
    /// filesystem refusing it. `direct`: whether the file is still read with O_DIRECT.
    pub(in crate::service) fn step(
        &mut self,
        result: &io::Result<usize>,
        max_attempts: u32,
        direct: bool,
    ) -> ReadStep {
        let bytes = match result {
            Ok(bytes) => *bytes,
            Err(error) if direct && error.raw_os_error() == Some(libc::EINVAL) => {
                return ReadStep::GoBuffered;
            }
            Err(_) if self.attempts < max_attempts => {
                self.attempts += 1;
                return ReadStep::Retry;
            }
            Err(_) => return ReadStep::Fail,
        };
        if bytes == 0 && self.done < self.valid {
            return ReadStep::FileShrank;
        }
        self.done += bytes;
        if self.done < self.valid {
            ReadStep::Continue
        } else {
            ReadStep::Complete
        }
    }

    /// Whether the rest of the request can still be read with O_DIRECT: a short read may
    /// end off its alignment.
    pub(in crate::service) fn rest_is_aligned(&self) -> bool {
        self.done as u64 % DIRECT_IO_ALIGN == 0
    }
}
