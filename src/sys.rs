//! Memory-management system calls, issued directly rather than through libc's symbols.
//!
//! Inside a program run under the LD_PRELOAD shim, `mmap`, `munmap` and `madvise` resolve
//! to the shim's own interposed functions; the pager's internal calls must reach the
//! kernel unchanged, so they bypass the symbols. See mmap(2), munmap(2), madvise(2).

use std::io;

/// mmap(2). Returns the address or the error.
///
/// # Safety
/// As for mmap(2): with `MAP_FIXED`, or a file the caller does not own, the call can
/// replace or expose memory other code relies on.
pub unsafe fn mmap(
    addr: usize,
    len: usize,
    prot: i32,
    flags: i32,
    fd: i32,
    offset: i64,
) -> io::Result<usize> {
    // SAFETY: the caller upholds mmap(2)'s contract.
    let rc = unsafe { libc::syscall(libc::SYS_mmap, addr, len, prot, flags, fd, offset) };
    if rc < 0 || rc as usize > usize::MAX - 4095 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc as usize)
    }
}

/// munmap(2).
///
/// # Safety
/// Nothing may reference `[addr, addr + len)` afterwards.
pub unsafe fn munmap(addr: usize, len: usize) -> io::Result<()> {
    // SAFETY: the caller guarantees the range is no longer referenced.
    let rc = unsafe { libc::syscall(libc::SYS_munmap, addr, len) };
    if rc != 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// getpid(2) from the kernel: right in any child, however it was made (fork, `_Fork`,
/// a raw clone), where a libc that caches the pid may not have updated it.
pub fn getpid() -> libc::pid_t {
    // SAFETY: getpid takes no arguments and has no memory effects.
    unsafe { libc::syscall(libc::SYS_getpid) as libc::pid_t }
}

/// mprotect(2).
///
/// # Safety
/// Code relying on the range's current protection must tolerate the new one.
pub unsafe fn mprotect(addr: usize, len: usize, prot: i32) -> io::Result<()> {
    // SAFETY: the caller guarantees the change is harmless to the range's users.
    let rc = unsafe { libc::syscall(libc::SYS_mprotect, addr, len, prot) };
    if rc != 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// madvise(2).
///
/// # Safety
/// Advice that discards contents (`MADV_DONTNEED`, `MADV_FREE`, `MADV_REMOVE`) must only
/// be given for memory whose contents can be recreated or are no longer needed.
pub unsafe fn madvise(addr: usize, len: usize, advice: i32) -> io::Result<()> {
    // SAFETY: the caller guarantees the advice is harmless to the range's users.
    let rc = unsafe { libc::syscall(libc::SYS_madvise, addr, len, advice) };
    if rc != 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
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
    match unsafe { madvise(addr, len, libc::MADV_DONTNEED_LOCKED) } {
        // SAFETY: as above.
        Err(error) if error.raw_os_error() == Some(libc::EINVAL) => unsafe {
            madvise(addr, len, libc::MADV_DONTNEED)
        },
        result => result,
    }
}
