//! File-shaped regions: the backing of a region whose pager serves forked children
//! (`PagerBuilder::serve_forks`).
//!
//! The region's data pages are one shared-memory file (memfd, small pages), block `b` at
//! the region offset of block `b`, mapped `MAP_SHARED` over the reservation and
//! registered for missing faults. A fault is a hole in the file; the service installs a
//! block with UFFDIO_COPY, which puts the page in the file (and maps it in the faulting
//! process) in one step, so no process ever sees a page before its bytes are in it; it
//! evicts a block by punching a hole in the file (`sys::punch_hole`), which drops the
//! page from every process that maps it. Because the pages belong to the file, a child
//! of `fork` (with `UFFD_FEATURE_EVENT_FORK`, and the range not MADV_DONTFORK) maps the
//! same file: the blocks resident when it touches them cost nothing more, and its
//! faults on holes come on the userfaultfd the fork event hands the service, which
//! serves them from the same block states and the same budget.
//!
//! Why not read straight into the file through the service's own mapping of it and
//! wake the thread after (as the zero-copy frames do): the page would exist in the file
//! from the moment the read pins it, before the device has written it, and a thread of
//! any process touching it then maps it without a fault and reads zeros. That needs
//! minor-fault registration (UFFDIO_CONTINUE once the read is done) in every process;
//! UFFDIO_COPY needs nothing more.
//!
//! The mapping is made from the read-write descriptor: userfaultfd refuses to register
//! a shared mapping that could never be made writable (EPERM without VM_MAYWRITE, since
//! UFFDIO_COPY writes through it), so a read-only descriptor's mapping cannot be served.
//! As with the anonymous regions, an `mprotect` adding PROT_WRITE behind the shim's
//! back is not prevented.

use std::os::fd::{AsRawFd, OwnedFd};

use crate::sys;

/// Maps a new file of `len` bytes (the region's data, page rounded) over `base`,
/// inaccessible (the caller gives it the program's protection once registered), and
/// returns the file, read-write, for the service.
///
/// # Safety
/// `base..base + len` must be a reservation the caller owns and nothing uses yet: it is
/// replaced.
pub unsafe fn map_shaped(base: usize, len: usize) -> std::io::Result<OwnedFd> {
    let file = sys::memfd(c"hyperoffload-region", len as u64)?;
    // SAFETY: the caller's reservation, replaced by a shared mapping of a file this
    // function just made; MAP_NORESERVE as for the reservation.
    unsafe {
        sys::mmap(
            base,
            len,
            libc::PROT_NONE,
            libc::MAP_SHARED | libc::MAP_FIXED | libc::MAP_NORESERVE,
            file.as_raw_fd(),
            0,
        )
    }?;
    Ok(file)
}

/// The part of `start..end` (region offsets) inside a file of `file_len` bytes: what a
/// punch must cover (the mapping past the data is not the file's).
pub fn file_range(start: u64, end: u64, file_len: u64) -> Option<(u64, u64)> {
    let end = end.min(file_len);
    (start < end).then_some((start, end - start))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn a_punch_covers_only_the_files_part() {
        assert_eq!(file_range(0, 8192, 16384), Some((0, 8192)));
        assert_eq!(file_range(8192, 32768, 16384), Some((8192, 8192)));
        assert_eq!(file_range(16384, 32768, 16384), None);
    }

    #[test]
    fn holes_punched_in_the_file_read_as_missing_again() {
        let page = sys::page_size() as usize;
        let len = 4 * page;
        // SAFETY: a fresh private reservation of our own, nothing else uses it.
        let base = unsafe {
            sys::mmap(
                0,
                len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        }
        .unwrap();
        // SAFETY: the reservation just made.
        let file = unsafe { map_shaped(base, len) }.unwrap();
        let fd = file.as_fd();
        sys::write(fd, &[7u8; 64]).unwrap();
        // SAFETY: our own mapping; read access only.
        unsafe { sys::mprotect(base, len, libc::PROT_READ) }.unwrap();
        // SAFETY: the first page is in the file and mapped readable.
        assert_eq!(unsafe { *(base as *const u8) }, 7);
        assert!(sys::page_resident(base).unwrap());
        sys::punch_hole(fd, 0, page as u64).unwrap();
        assert!(
            !sys::page_resident(base).unwrap(),
            "gone from the mapping too"
        );
        // SAFETY: unmaps our own mapping.
        unsafe { sys::munmap(base, len) }.unwrap();
    }
}
