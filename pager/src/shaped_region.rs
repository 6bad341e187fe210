//! File-shaped regions: the backing of a region whose pager serves forked children
//! (`PagerBuilder::serve_forks`).
//!
//! The region's data pages are one shared-memory file, block `b` at the region offset
//! of block `b`, mapped `MAP_SHARED` over the reservation. The service evicts a block by
//! punching a hole in the file (`sys::files::punch_hole`), which drops the page from every
//! process that maps it. Because the pages belong to the file, a child of `fork` (with
//! `UFFD_FEATURE_EVENT_FORK`, and the range not MADV_DONTFORK) maps the same file: the
//! blocks resident when it touches them cost nothing more, and its faults on holes come
//! on the userfaultfd the fork event hands the service, which serves them from the same
//! block states and the same budget.
//!
//! A block gets into the file one of two ways:
//! - **Read in place** (the default; `ShapeFiles`): the read lands in the file through
//!   the service's own view of it (O_DIRECT, no copy), and the block is then mapped in
//!   the faulting process with UFFDIO_CONTINUE. The file's pages exist from the moment
//!   the read pins them, before the device has written them, so the range is registered
//!   for minor faults as well as missing ones in every process: a thread touching a
//!   page the file holds but its own page tables do not meets a minor fault, which the
//!   service answers only once the block's read is done. The file lives in a private
//!   huge-page tmpfs (`shared_store::Tmpfs`) when every block is whole 2 MiB pages, so
//!   reads land in huge pages (a virtio disk gives about twice the bandwidth into them);
//!   otherwise in one with small pages, or a memfd without CAP_SYS_ADMIN. CONTINUE maps
//!   the pages one page-table entry each; the copy it saves is the larger cost.
//! - **Copied** (without minor faults on shmem, with zero copy turned off, or in a
//!   pager whose regions other processes of the run attach to, `crate::share`: a guest
//!   maps the file's pages itself, from its own thread, and would map a page a read had
//!   allocated but not yet filled): the range is registered for missing faults only and
//!   a block is installed with UFFDIO_COPY, which puts each page in the file (and maps it
//!   in the faulting process) with its bytes in one step.
//!
//! After the service, the keeper (`crate::keeper`) rewrites a whole 2 MiB piece of the
//! file from the model before it maps any of it for a child (`hole_fill::rewrite_chunk`):
//! a read in place the service never finished may have left pages there, and a page
//! written alone into a hole of a huge-page file would leave its neighbours present as
//! zeros.
//!
//! The mapping is made from the read-write descriptor: userfaultfd refuses to register
//! a shared mapping that could never be made writable (EPERM without VM_MAYWRITE, since
//! UFFDIO_COPY writes through it), so a read-only descriptor's mapping cannot be served.
//! As with the anonymous regions, an `mprotect` adding PROT_WRITE behind the shim's
//! back is not prevented.

use std::os::fd::{AsFd, OwnedFd};

use crate::shared_store::Tmpfs;
use crate::sys;

/// Where the files of regions whose blocks are read in place are made: private tmpfs
/// mounts, one with huge pages and one without, where they could be made (they need
/// CAP_SYS_ADMIN; else memfds).
#[derive(Debug)]
pub struct ShapeFiles {
    huge: Option<Tmpfs>,
    small: Option<Tmpfs>,
}

impl ShapeFiles {
    pub fn new() -> Self {
        Self {
            huge: Tmpfs::new(true).ok(),
            small: Tmpfs::new(false).ok(),
        }
    }

    /// A new file of `len` bytes, all holes, read-write: of huge pages if `huge_pages`
    /// (every block of the region starts and ends on a 2 MiB boundary of the file, or
    /// at its end) and the mount could be made.
    pub fn create(&self, len: u64, huge_pages: bool) -> std::io::Result<OwnedFd> {
        let mount = if huge_pages { &self.huge } else { &None };
        match mount.as_ref().or(self.small.as_ref()) {
            Some(tmpfs) => tmpfs.create_file(len),
            None => sys::files::memfd(c"hyperoffload-region", len),
        }
    }
}

impl Default for ShapeFiles {
    fn default() -> Self {
        Self::new()
    }
}

/// Maps `file` (`len` bytes: the region's data, page rounded; read-write) over `base`,
/// inaccessible (the caller gives it the program's protection once registered).
///
/// # Safety
/// `base..base + len` must be a reservation the caller owns and nothing uses yet: it is
/// replaced.
pub unsafe fn map_file_over(base: usize, len: usize, file: &OwnedFd) -> std::io::Result<()> {
    // SAFETY: the caller's reservation, replaced by a shared mapping of a file of the
    // region's own; MAP_NORESERVE as for the reservation.
    unsafe {
        sys::memory::mmap(
            base,
            len,
            libc::PROT_NONE,
            libc::MAP_SHARED | libc::MAP_FIXED | libc::MAP_NORESERVE,
            Some(file.as_fd()),
            0,
        )
    }?;
    Ok(())
}

/// Maps a new memfd of `len` bytes (the region's data, page rounded) over `base`,
/// inaccessible (the caller gives it the program's protection once registered), and
/// returns the file, read-write, for the service.
///
/// # Safety
/// `base..base + len` must be a reservation the caller owns and nothing uses yet: it is
/// replaced.
pub unsafe fn map_shaped(base: usize, len: usize) -> std::io::Result<OwnedFd> {
    let file = sys::files::memfd(c"hyperoffload-region", len as u64)?;
    // SAFETY: the caller's guarantees.
    unsafe { map_file_over(base, len, &file) }?;
    Ok(file)
}

/// The service's read-write view of a region's file, where reads in place land.
/// Unmapped when dropped.
#[derive(Debug)]
pub struct FileView {
    addr: usize,
    len: usize,
}

impl FileView {
    /// Maps all `len` bytes of `file` (read-write), shared, not inherited by a fork.
    pub fn new(file: &OwnedFd, len: u64) -> std::io::Result<Self> {
        let len = len as usize;
        // Made writable only once mapped: accessible at once under mlockall(MCL_FUTURE),
        // the whole file would be allocated.
        let addr = sys::memory::map_shared_inaccessible(file.as_fd(), len)?;
        let view = Self { addr, len };
        // SAFETY: the mapping just made, which nothing uses yet.
        unsafe { sys::memory::mprotect(addr, len, libc::PROT_READ | libc::PROT_WRITE) }?;
        // A forked child must not share the service's view (and cannot use it).
        // SAFETY: advises only the mapping just made; DONTFORK discards nothing.
        unsafe { sys::memory::madvise(addr, len, sys::memory::Advice::LinuxDontFork) }?;
        Ok(view)
    }

    /// The view of the file's byte `offset` (below its length). Reads land where this
    /// points: an offset past the view is a service bug that would have the kernel write
    /// into whatever is mapped after it, so it stops the service, in every build.
    pub fn at(&self, offset: u64) -> *mut u8 {
        assert!(
            (offset as usize) < self.len,
            "offset {offset} past a view of {} bytes",
            self.len
        );
        (self.addr + offset as usize) as *mut u8
    }
}

impl FileView {
    /// Drops the view's page-table entries of `len` bytes at `offset` (a read that
    /// landed there is done): the file keeps the pages, and the process's resident set
    /// counts them once (the program's mapping), not twice.
    pub fn forget(&self, offset: u64, len: usize) {
        let start = self.addr + offset as usize;
        let len = len.min(self.len.saturating_sub(offset as usize));
        // SAFETY: MADV_DONTNEED on a shared mapping of the view's own only unmaps it:
        // the file keeps its bytes, and nothing holds a reference into it. (Locked too:
        // under mlockall(MCL_FUTURE) the view is.)
        let _ = unsafe { sys::memory::discard(start, len) };
    }
}

impl Drop for FileView {
    fn drop(&mut self) {
        // SAFETY: the view is this value's own mapping; reads landing in it are done
        // (the service drops a region's view only once none are in flight).
        let _ = unsafe { sys::memory::munmap(self.addr, self.len) };
    }
}

/// Whether a region's blocks are whole 2 MiB pages of its file: blocks of a multiple of
/// 2 MiB, and every cut (a file offset where a block ends early) 2 MiB from the region's
/// start in the file. A huge page holding parts of two blocks would keep the evicted
/// one's memory while the other is resident.
pub fn blocks_are_huge_pages(block_size: u64, region_file_offset: u64, cuts: &[u64]) -> bool {
    let huge = sys::memory::HUGE_PAGE;
    block_size % huge == 0
        && cuts
            .iter()
            .all(|&cut| cut.wrapping_sub(region_file_offset) % huge == 0)
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
    fn blocks_are_huge_pages_only_when_every_boundary_is_on_one() {
        let mib = 1 << 20;
        assert!(blocks_are_huge_pages(2 * mib, 0, &[]));
        assert!(blocks_are_huge_pages(4 * mib, 4096, &[4096 + 6 * mib]));
        assert!(!blocks_are_huge_pages(mib, 0, &[]), "half a huge page");
        assert!(
            !blocks_are_huge_pages(2 * mib, 0, &[3 * mib]),
            "a cut inside one"
        );
        assert!(
            !blocks_are_huge_pages(2 * mib, 4096, &[2 * mib]),
            "off the region's start"
        );
    }

    #[test]
    fn a_punch_covers_only_the_files_part() {
        assert_eq!(file_range(0, 8192, 16384), Some((0, 8192)));
        assert_eq!(file_range(8192, 32768, 16384), Some((8192, 8192)));
        assert_eq!(file_range(16384, 32768, 16384), None);
    }

    #[test]
    fn holes_punched_in_the_file_read_as_missing_again() {
        let page = sys::memory::page_size() as usize;
        let len = 4 * page;
        // SAFETY: a fresh private reservation of our own, nothing else uses it.
        let base = unsafe {
            sys::memory::mmap(
                0,
                len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                None,
                0,
            )
        }
        .unwrap();
        // SAFETY: the reservation just made.
        let file = unsafe { map_shaped(base, len) }.unwrap();
        let fd = file.as_fd();
        sys::files::write(fd, &[7u8; 64]).unwrap();
        // SAFETY: our own mapping; read access only.
        unsafe { sys::memory::mprotect(base, len, libc::PROT_READ) }.unwrap();
        // SAFETY: the first page is in the file and mapped readable.
        assert_eq!(unsafe { *(base as *const u8) }, 7);
        assert!(sys::memory::page_resident(base).unwrap());
        sys::files::punch_hole(fd, 0, page as u64).unwrap();
        assert!(
            !sys::memory::page_resident(base).unwrap(),
            "gone from the mapping too"
        );
        // SAFETY: unmaps our own mapping.
        unsafe { sys::memory::munmap(base, len) }.unwrap();
    }
}
