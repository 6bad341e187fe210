//! Memory mappings: making, moving, protecting and unmapping them, advice on them
//! (madvise(2)), locking them, and asking which of their pages are resident; with the
//! page sizes and the machine's RAM that the callers size them by.

use std::ffi::c_void;
use std::io;
use std::os::fd::BorrowedFd;

use rustix::io::Errno;
use rustix::mm::{MapFlags, MlockFlags, MprotectFlags, MremapFlags, ProtFlags};

use super::{errno, syscall_result};

pub use rustix::mm::Advice;

/// Size of a huge page (x86-64 and arm64 with 4 KiB pages): the tmpfs frames' page and
/// the read ring's buffer alignment.
pub const HUGE_PAGE: u64 = 2 << 20;

/// `MAP_ANONYMOUS`, which rustix does not name as a flag (its `mmap_anonymous` adds it),
/// but which arrives in the flags a C caller passes: libc's constant.
const MAP_ANONYMOUS: MapFlags = MapFlags::from_bits_retain(libc::MAP_ANONYMOUS as u32);

/// `MREMAP_FIXED`, which rustix does not name as a flag (its `mremap_fixed` adds it),
/// but which arrives in the flags a C caller passes: libc's constant.
const MREMAP_FIXED: MremapFlags = MremapFlags::from_bits_retain(libc::MREMAP_FIXED as u32);

/// The kernel's page size (from the auxiliary vector).
pub fn page_size() -> u64 {
    rustix::param::page_size() as u64
}

/// Physical RAM of this machine in bytes (0 if unknown), from sysinfo(2), as glibc's
/// `sysconf(_SC_PHYS_PAGES)` computes it.
pub fn physical_ram() -> u64 {
    let info = rustix::system::sysinfo();
    info.totalram as u64 * u64::from(info.mem_unit.max(1))
}

/// mmap(2) with the raw protection and flags a C caller passes, of `file` or, with
/// `None` (a C caller's fd -1), anonymous memory. Returns the address.
///
/// # Safety
/// As for mmap(2): with `MAP_FIXED`, or a file the caller does not own, the call can
/// replace or expose memory other code relies on.
pub unsafe fn mmap(
    addr: usize,
    len: usize,
    prot: i32,
    flags: i32,
    file: Option<BorrowedFd<'_>>,
    offset: i64,
) -> io::Result<usize> {
    let prot = ProtFlags::from_bits_retain(prot as u32);
    let flags = MapFlags::from_bits_retain(flags as u32);
    let addr = addr as *mut c_void;
    let mapped = match file {
        // SAFETY: the caller upholds mmap(2)'s contract; the kernel keeps its own
        // reference to the file, none to the borrow.
        Some(file) => unsafe { rustix::mm::mmap(addr, len, prot, flags, file, offset as u64) },
        None => {
            // `mmap_anonymous` passes fd -1 and adds MAP_ANONYMOUS; these checks keep the
            // kernel's answers for what it would refuse of a C caller's fd -1.
            if !flags.contains(MAP_ANONYMOUS) {
                return Err(errno(Errno::BADF));
            }
            if offset as u64 % page_size() != 0 {
                return Err(errno(Errno::INVAL));
            }
            let flags = flags.difference(MAP_ANONYMOUS);
            // SAFETY: the caller upholds mmap(2)'s contract.
            unsafe { rustix::mm::mmap_anonymous(addr, len, prot, flags) }
        }
    };
    Ok(mapped? as usize)
}

/// A new shared mapping of `len` bytes of `file` from its start, at an address the kernel
/// picks, inaccessible (`PROT_NONE`, `MAP_NORESERVE`): the caller gives it access once
/// ready. Under mlockall(MCL_FUTURE) the kernel fills every new accessible mapping at
/// once, which would allocate the whole file (or, registered later, read its holes as
/// zeros); an inaccessible one is not filled. Returns the address.
pub fn map_shared_inaccessible(file: BorrowedFd<'_>, len: usize) -> io::Result<usize> {
    // SAFETY: a new mapping at an address the kernel picks replaces nothing, and an
    // inaccessible one exposes nothing.
    let addr = unsafe {
        rustix::mm::mmap(
            std::ptr::null_mut(),
            len,
            ProtFlags::empty(),
            MapFlags::SHARED | MapFlags::NORESERVE,
            file,
            0,
        )
    }?;
    Ok(addr as usize)
}

/// munmap(2).
///
/// # Safety
/// Nothing may reference `[addr, addr + len)` afterwards.
pub unsafe fn munmap(addr: usize, len: usize) -> io::Result<()> {
    // SAFETY: the caller guarantees the range is no longer referenced.
    Ok(unsafe { rustix::mm::munmap(addr as *mut c_void, len) }?)
}

/// mremap(2) with the raw flags a C caller passes; `new_addr` is used with
/// `MREMAP_FIXED` only. Returns the new address.
///
/// # Safety
/// As for mremap(2): the old range must no longer be referenced if it moves, and a fixed
/// destination replaces whatever was there.
pub unsafe fn mremap(
    old: usize,
    old_len: usize,
    new_len: usize,
    flags: i32,
    new_addr: usize,
) -> io::Result<usize> {
    let flags = MremapFlags::from_bits_retain(flags as u32);
    let old = old as *mut c_void;
    let moved = if flags.contains(MREMAP_FIXED) {
        let new_addr = new_addr as *mut c_void;
        let flags = flags.difference(MREMAP_FIXED);
        // SAFETY: the caller upholds mremap(2)'s contract; rustix adds MREMAP_FIXED back.
        unsafe { rustix::mm::mremap_fixed(old, old_len, new_len, flags, new_addr) }
    } else {
        // SAFETY: as above.
        unsafe { rustix::mm::mremap(old, old_len, new_len, flags) }
    };
    Ok(moved? as usize)
}

/// mprotect(2) with the raw protection a C caller passes.
///
/// # Safety
/// Code relying on the range's current protection must tolerate the new one.
pub unsafe fn mprotect(addr: usize, len: usize, prot: i32) -> io::Result<()> {
    let prot = MprotectFlags::from_bits_retain(prot as u32);
    // SAFETY: the caller guarantees the change is harmless to the range's users.
    Ok(unsafe { rustix::mm::mprotect(addr as *mut c_void, len, prot) }?)
}

/// madvise(2) with one of the advices rustix names.
///
/// # Safety
/// Advice that discards contents (`MADV_DONTNEED`, `MADV_FREE`, `MADV_REMOVE`) must only
/// be given for memory whose contents can be recreated or are no longer needed.
pub unsafe fn madvise(addr: usize, len: usize, advice: Advice) -> io::Result<()> {
    // SAFETY: the caller guarantees the advice is harmless to the range's users.
    Ok(unsafe { rustix::mm::madvise(addr as *mut c_void, len, advice) }?)
}

/// madvise(2) with any advice number, passed on unchanged: the shim forwards what a
/// program asks, and the kernel decides what it means. A raw syscall because rustix's
/// `Advice` is a closed enum: a number it does not name (a newer kernel's advice, or a
/// wrong one the kernel must refuse with EINVAL) cannot be made into one.
///
/// # Safety
/// As for madvise(2): destructive advice discards the contents of the range.
pub unsafe fn madvise_raw(addr: usize, len: usize, advice: i32) -> io::Result<()> {
    // SAFETY: the caller's request, unchanged; the kernel only changes the range's pages.
    syscall_result(unsafe { libc::syscall(libc::SYS_madvise, addr, len, advice) })?;
    Ok(())
}

/// Drops the pages of `[addr, addr + len)` (MADV_DONTNEED), locked ones too: with
/// MADV_DONTNEED_LOCKED (Linux 5.18), since memory can be mlocked behind the pager's
/// back (mlockall, or an mlock that bypassed the shim) and plain MADV_DONTNEED refuses
/// locked memory with EINVAL. On an older kernel, plain MADV_DONTNEED.
///
/// # Safety
/// As for `madvise` with MADV_DONTNEED: the range's contents must be recreatable or no
/// longer needed.
pub unsafe fn discard(addr: usize, len: usize) -> io::Result<()> {
    // SAFETY: the caller guarantees the contents may go.
    match unsafe { madvise(addr, len, Advice::LinuxDontneedLocked) } {
        // SAFETY: as above.
        Err(error) if error.raw_os_error() == Some(Errno::INVAL.raw_os_error()) => unsafe {
            madvise(addr, len, Advice::LinuxDontNeed)
        },
        result => result,
    }
}

/// mlock(2), or mlock2(2) when `flags` (a C caller's raw flags) is not 0.
///
/// # Safety
/// As for mlock(2): the whole range is faulted in.
pub unsafe fn mlock(addr: usize, len: usize, flags: u32) -> io::Result<()> {
    let addr = addr as *mut c_void;
    if flags == 0 {
        // SAFETY: the caller's request, unchanged.
        Ok(unsafe { rustix::mm::mlock(addr, len) }?)
    } else {
        // SAFETY: as above.
        Ok(unsafe { rustix::mm::mlock_with(addr, len, MlockFlags::from_bits_retain(flags)) }?)
    }
}

/// munlock(2).
///
/// # Safety
/// As for munlock(2).
pub unsafe fn munlock(addr: usize, len: usize) -> io::Result<()> {
    // SAFETY: the caller's request, unchanged.
    Ok(unsafe { rustix::mm::munlock(addr as *mut c_void, len) }?)
}

/// Whether the page at `addr` (page aligned; EINVAL otherwise) is resident, by
/// mincore(2): in the process's page tables or in swap; and, in a file mapping, also
/// when the file's page is in the page cache though not mapped here yet. A raw syscall:
/// rustix has no mincore.
pub fn page_resident(addr: usize) -> io::Result<bool> {
    let mut state = 0u8;
    // SAFETY: mincore reads the page tables of the one page at `addr` (any address is
    // safe: an unmapped one is ENOMEM) and writes one byte into `state`, which is live.
    let rc = unsafe { libc::syscall(libc::SYS_mincore, addr, 1usize, &mut state as *mut u8) };
    syscall_result(rc)?;
    Ok(state & 1 == 1)
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd;

    use super::*;
    use crate::sys::files;

    /// A private anonymous read-write mapping of `pages` pages, none touched yet.
    fn anonymous(pages: usize) -> (usize, usize) {
        let len = pages * page_size() as usize;
        // SAFETY: a new mapping at an address the kernel picks replaces nothing.
        let addr = unsafe {
            mmap(
                0,
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                None,
                0,
            )
        }
        .unwrap();
        (addr, len)
    }

    #[test]
    fn page_sizes_and_ram_are_the_machines() {
        let page = page_size();
        assert!(page.is_power_of_two() && page >= 4096, "{page}");
        assert_eq!(HUGE_PAGE % page, 0);
        // More RAM than one huge page: anything less is a wrong unit.
        assert!(physical_ram() > HUGE_PAGE, "{}", physical_ram());
    }

    #[test]
    fn a_page_is_resident_once_touched_and_not_after_a_discard() {
        let (addr, len) = anonymous(2);
        assert!(!page_resident(addr).unwrap(), "untouched");
        // SAFETY: our own fresh read-write mapping.
        unsafe { (addr as *mut u8).write(7) };
        assert!(page_resident(addr).unwrap());
        assert!(!page_resident(addr + page_size() as usize).unwrap());
        // SAFETY: our own mapping; the byte written may go.
        unsafe { discard(addr, len) }.unwrap();
        assert!(!page_resident(addr).unwrap());
        // SAFETY: our own mapping, read after the discard: a fresh zero page.
        assert_eq!(unsafe { (addr as *const u8).read() }, 0);
        // SAFETY: nothing refers to the mapping any more.
        unsafe { munmap(addr, len) }.unwrap();
        let unmapped = page_resident(addr).unwrap_err();
        assert_eq!(unmapped.raw_os_error(), Some(libc::ENOMEM));
    }

    #[test]
    fn an_anonymous_mapping_needs_the_anonymous_flag_and_an_aligned_offset() {
        let page = page_size() as usize;
        // SAFETY: refused before anything is mapped.
        let error = unsafe { mmap(0, page, libc::PROT_READ, libc::MAP_PRIVATE, None, 0) };
        assert_eq!(error.unwrap_err().raw_os_error(), Some(libc::EBADF));
        let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
        // SAFETY: as above.
        let error = unsafe { mmap(0, page, libc::PROT_READ, flags, None, 1) };
        assert_eq!(error.unwrap_err().raw_os_error(), Some(libc::EINVAL));
    }

    #[test]
    fn mprotect_changes_the_protection_and_keeps_the_pages() {
        let (addr, len) = anonymous(1);
        // SAFETY: our own fresh read-write mapping.
        unsafe { (addr as *mut u8).write(9) };
        // SAFETY: nothing writes the mapping afterwards.
        unsafe { mprotect(addr, len, libc::PROT_READ) }.unwrap();
        assert!(page_resident(addr).unwrap());
        // SAFETY: still readable.
        assert_eq!(unsafe { (addr as *const u8).read() }, 9);
        let unaligned = addr + 1;
        // SAFETY: refused: not page aligned.
        let error = unsafe { mprotect(unaligned, len, libc::PROT_NONE) }.unwrap_err();
        assert_eq!(error.raw_os_error(), Some(libc::EINVAL));
        // SAFETY: nothing refers to the mapping any more.
        unsafe { munmap(addr, len) }.unwrap();
    }

    #[test]
    fn mremap_moves_a_mapping_with_its_bytes_to_a_fixed_place() {
        let (from, len) = anonymous(1);
        let (to, _) = anonymous(1);
        // SAFETY: our own fresh read-write mapping.
        unsafe { (from as *mut u8).write(42) };
        let flags = libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED;
        // SAFETY: moves our own mapping over another of ours; neither is referenced.
        let moved = unsafe { mremap(from, len, len, flags, to) }.unwrap();
        assert_eq!(moved, to);
        // SAFETY: the moved mapping, readable.
        assert_eq!(unsafe { (to as *const u8).read() }, 42);
        assert_eq!(
            page_resident(from).unwrap_err().raw_os_error(),
            Some(libc::ENOMEM)
        );
        // SAFETY: nothing refers to the mapping any more.
        unsafe { munmap(to, len) }.unwrap();
    }

    #[test]
    fn madvise_raw_passes_the_number_on_and_the_kernel_judges_it() {
        let (addr, len) = anonymous(1);
        // SAFETY: non-destructive advice on our own mapping.
        unsafe { madvise_raw(addr, len, libc::MADV_WILLNEED) }.unwrap();
        // SAFETY: a number no kernel names: refused, nothing changes.
        let error = unsafe { madvise_raw(addr, len, 12345) }.unwrap_err();
        assert_eq!(error.raw_os_error(), Some(libc::EINVAL));
        // SAFETY: nothing refers to the mapping any more.
        unsafe { munmap(addr, len) }.unwrap();
    }

    #[test]
    fn mlock_faults_the_range_in() {
        let (addr, len) = anonymous(2);
        // SAFETY: our own mapping, faulted in.
        match unsafe { mlock(addr, len, 0) } {
            // The environment's limit (RLIMIT_MEMLOCK without CAP_IPC_LOCK), not a bug.
            Err(error) if matches!(error.raw_os_error(), Some(libc::EPERM | libc::ENOMEM)) => {
                eprintln!("mlock not allowed here: {error}");
            }
            result => {
                result.unwrap();
                assert!(page_resident(addr).unwrap());
                assert!(page_resident(addr + len - page_size() as usize).unwrap());
                // SAFETY: our own mapping.
                unsafe { munlock(addr, len) }.unwrap();
            }
        }
        // SAFETY: nothing refers to the mapping any more.
        unsafe { munmap(addr, len) }.unwrap();
    }

    #[test]
    fn a_shared_file_mapping_shows_the_files_bytes_once_made_accessible() {
        let page = page_size() as usize;
        let file = files::memfd(c"memory-test", page as u64).unwrap();
        let addr = map_shared_inaccessible(file.as_fd(), page).unwrap();
        assert!(!page_resident(addr).unwrap(), "a hole of the file");
        assert_eq!(files::pwrite(file.as_fd(), b"bytes", 0).unwrap(), 5);
        // In a file mapping, resident means in the page cache, mapped here or not.
        assert!(page_resident(addr).unwrap());
        // SAFETY: our own fresh mapping, which nothing reads yet.
        unsafe { mprotect(addr, page, libc::PROT_READ) }.unwrap();
        // SAFETY: readable now, and `page` bytes long.
        let seen = unsafe { std::slice::from_raw_parts(addr as *const u8, 5) };
        assert_eq!(seen, b"bytes");
        // SAFETY: nothing refers to the mapping any more.
        unsafe { munmap(addr, page) }.unwrap();
    }
}
