//! The kernel's own behaviour for every interposed call, at the C ABI edge: the calls
//! themselves are the library's OS layer (`hyperoffload::sys`), which reaches the kernel
//! directly (never through a libc symbol, which would be the shim again, and never
//! through the allocator). Here its `io::Result`s become what the libc function would
//! return, errno included.

use std::io;

use libc::{c_int, c_uint, c_void, off_t, size_t};

use hyperoffload::sys;

pub use hyperoffload::sys::write_stderr;

/// Sets errno, as libc functions do on failure.
pub fn set_errno(errno: c_int) {
    // SAFETY: __errno_location returns this thread's errno slot, valid for the thread's life.
    unsafe { *libc::__errno_location() = errno };
}

/// This thread's errno.
pub fn errno() -> c_int {
    // SAFETY: __errno_location returns this thread's errno slot, valid for the thread's life.
    unsafe { *libc::__errno_location() }
}

/// The errno an OS-layer error carries.
pub fn errno_of(error: io::Error) -> c_int {
    error.raw_os_error().unwrap_or(libc::EIO)
}

/// An OS-layer result as the shim's internal `Result<(), errno>`.
pub fn check(result: io::Result<()>) -> Result<(), c_int> {
    result.map_err(errno_of)
}

/// A libc-style return: 0, or -1 with errno.
fn c_int_result(result: io::Result<()>) -> c_int {
    match result {
        Ok(()) => 0,
        Err(error) => {
            set_errno(errno_of(error));
            -1
        }
    }
}

/// A libc-style address: the address, or MAP_FAILED with errno.
fn c_address(result: io::Result<usize>) -> *mut c_void {
    match result {
        Ok(address) => address as *mut c_void,
        Err(error) => {
            set_errno(errno_of(error));
            libc::MAP_FAILED
        }
    }
}

/// mmap(2) as the kernel does it.
///
/// # Safety
/// As mmap(2).
pub unsafe fn mmap(
    addr: *mut c_void,
    len: size_t,
    prot: c_int,
    flags: c_int,
    fd: c_int,
    offset: off_t,
) -> *mut c_void {
    // SAFETY: the caller's request, passed on unchanged.
    c_address(unsafe { sys::mmap(addr as usize, len, prot, flags, fd, offset) })
}

/// munmap(2).
///
/// # Safety
/// As munmap(2).
pub unsafe fn munmap(addr: *mut c_void, len: size_t) -> c_int {
    // SAFETY: the caller's request, unchanged.
    c_int_result(unsafe { sys::munmap(addr as usize, len) })
}

/// mremap(2).
///
/// # Safety
/// As mremap(2).
pub unsafe fn mremap(
    old: *mut c_void,
    old_len: size_t,
    new_len: size_t,
    flags: c_int,
    new_addr: *mut c_void,
) -> *mut c_void {
    // SAFETY: the caller's request, unchanged (new_addr is ignored without MREMAP_FIXED).
    c_address(unsafe { sys::mremap(old as usize, old_len, new_len, flags, new_addr as usize) })
}

/// madvise(2).
///
/// # Safety
/// As madvise(2): destructive advice discards the contents of the range.
pub unsafe fn madvise(addr: *mut c_void, len: size_t, advice: c_int) -> c_int {
    // SAFETY: the caller's request, unchanged.
    c_int_result(unsafe { sys::madvise_raw(addr as usize, len, advice) })
}

/// posix_madvise(3): returns the error number instead of setting errno. glibc makes
/// POSIX_MADV_DONTNEED a no-op (the kernel's MADV_DONTNEED discards data, which POSIX
/// does not allow); so does this.
///
/// # Safety
/// As madvise(2).
pub unsafe fn posix_madvise(addr: *mut c_void, len: size_t, advice: c_int) -> c_int {
    if advice == libc::POSIX_MADV_DONTNEED {
        return 0;
    }
    // SAFETY: non-destructive advice on the caller's range.
    check(unsafe { sys::madvise_raw(addr as usize, len, advice) })
        .err()
        .unwrap_or(0)
}

/// posix_fadvise(2): returns the error number instead of setting errno.
pub fn posix_fadvise(fd: c_int, offset: off_t, len: off_t, advice: c_int) -> c_int {
    check(sys::fadvise(fd, offset, len, advice))
        .err()
        .unwrap_or(0)
}

/// mlock(2).
///
/// # Safety
/// As mlock(2) (faults the whole range in).
pub unsafe fn mlock(addr: *const c_void, len: size_t) -> c_int {
    // SAFETY: the caller's request, unchanged.
    c_int_result(unsafe { sys::mlock(addr as usize, len, 0) })
}

/// mlock2(2).
///
/// # Safety
/// As mlock2(2).
pub unsafe fn mlock2(addr: *const c_void, len: size_t, flags: c_uint) -> c_int {
    // SAFETY: the caller's request, unchanged.
    c_int_result(unsafe { sys::mlock(addr as usize, len, flags) })
}

/// munlock(2).
///
/// # Safety
/// As munlock(2).
pub unsafe fn munlock(addr: *const c_void, len: size_t) -> c_int {
    // SAFETY: the caller's request, unchanged.
    c_int_result(unsafe { sys::munlock(addr as usize, len) })
}

/// fstat(2) of a descriptor: `None` if it fails.
pub fn fstat(fd: c_int) -> Option<sys::Stat> {
    sys::fstat(fd).ok()
}

/// The path behind a descriptor (readlink of /proc/self/fd/N) into `buffer`; `None` if it
/// has none or does not fit. Built on the stack: no allocation.
pub fn fd_path(fd: c_int, buffer: &mut [u8; 4096]) -> Option<&[u8]> {
    let mut link = [0u8; 32];
    let mut at = 0;
    for &byte in b"/proc/self/fd/" {
        link[at] = byte;
        at += 1;
    }
    let mut digits = [0u8; 12];
    let mut n = fd as u32;
    let mut count = 0;
    loop {
        digits[count] = b'0' + (n % 10) as u8;
        count += 1;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    for i in (0..count).rev() {
        link[at] = digits[i];
        at += 1;
    }
    // `link` stays NUL-terminated: it has room to spare and started zeroed.
    let link = std::ffi::CStr::from_bytes_until_nul(&link).ok()?;
    let len = buffer.len();
    let path = sys::readlink(link, buffer).ok()?;
    if path.is_empty() || path.len() >= len || path[0] != b'/' {
        return None;
    }
    Some(path)
}
