//! The kernel's own behaviour for every interposed call, at the C ABI edge: the calls
//! themselves are the library's OS layer (`hyperoffload::sys`), which reaches the kernel
//! directly (never through a libc symbol, which would be the shim again, and never
//! through the allocator). Here its `io::Result`s become what the libc function would
//! return, errno included; and the descriptor numbers they pass become borrows
//! (`with_program_fd`), which is what the OS layer takes.

use std::ffi::CStr;
use std::io;
use std::os::fd::{BorrowedFd, IntoRawFd};

use libc::{c_int, c_uint, c_void, off_t, size_t};

use hyperoffload::sys;

pub use hyperoffload::sys::files::write_stderr;

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

/// Runs `call` with the descriptor `fd` that the program passed to an interposed call
/// (or that one returned to it), borrowed for `call` only; EBADF for a negative number,
/// as the kernel answers.
fn with_program_fd<T>(
    fd: c_int,
    call: impl FnOnce(BorrowedFd<'_>) -> io::Result<T>,
) -> io::Result<T> {
    if fd < 0 {
        return Err(io::Error::from_raw_os_error(libc::EBADF));
    }
    // SAFETY: the number is the program's, passed to the call in progress on this thread
    // (or just returned to it): a program keeps a descriptor open while a call uses it,
    // as libc's function requires too, and the borrow ends with `call`, inside that
    // call. A number the program got wrong reaches the kernel all the same, which
    // answers EBADF (or acts on the file open at that number), as for libc's function.
    let fd = unsafe { BorrowedFd::borrow_raw(fd) };
    call(fd)
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
    let addr = addr as usize;
    let mapped = if flags & libc::MAP_ANONYMOUS != 0 {
        // SAFETY: the caller's request, passed on unchanged; the kernel ignores the
        // descriptor of an anonymous mapping.
        unsafe { sys::memory::mmap(addr, len, prot, flags, None, offset) }
    } else {
        with_program_fd(fd, |file| {
            // SAFETY: the caller's request, passed on unchanged.
            unsafe { sys::memory::mmap(addr, len, prot, flags, Some(file), offset) }
        })
    };
    c_address(mapped)
}

/// munmap(2).
///
/// # Safety
/// As munmap(2).
pub unsafe fn munmap(addr: *mut c_void, len: size_t) -> c_int {
    // SAFETY: the caller's request, unchanged.
    c_int_result(unsafe { sys::memory::munmap(addr as usize, len) })
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
    c_address(unsafe {
        sys::memory::mremap(old as usize, old_len, new_len, flags, new_addr as usize)
    })
}

/// madvise(2).
///
/// # Safety
/// As madvise(2): destructive advice discards the contents of the range.
pub unsafe fn madvise(addr: *mut c_void, len: size_t, advice: c_int) -> c_int {
    // SAFETY: the caller's request, unchanged.
    c_int_result(unsafe { sys::memory::madvise_raw(addr as usize, len, advice) })
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
    check(unsafe { sys::memory::madvise_raw(addr as usize, len, advice) })
        .err()
        .unwrap_or(0)
}

/// posix_fadvise(2): returns the error number instead of setting errno.
pub fn posix_fadvise(fd: c_int, offset: off_t, len: off_t, advice: c_int) -> c_int {
    check(with_program_fd(fd, |fd| {
        sys::files::fadvise(fd, offset, len, advice)
    }))
    .err()
    .unwrap_or(0)
}

/// mlock(2).
///
/// # Safety
/// As mlock(2) (faults the whole range in).
pub unsafe fn mlock(addr: *const c_void, len: size_t) -> c_int {
    // SAFETY: the caller's request, unchanged.
    c_int_result(unsafe { sys::memory::mlock(addr as usize, len, 0) })
}

/// mlock2(2).
///
/// # Safety
/// As mlock2(2).
pub unsafe fn mlock2(addr: *const c_void, len: size_t, flags: c_uint) -> c_int {
    // SAFETY: the caller's request, unchanged.
    c_int_result(unsafe { sys::memory::mlock(addr as usize, len, flags) })
}

/// munlock(2).
///
/// # Safety
/// As munlock(2).
pub unsafe fn munlock(addr: *const c_void, len: size_t) -> c_int {
    // SAFETY: the caller's request, unchanged.
    c_int_result(unsafe { sys::memory::munlock(addr as usize, len) })
}

/// fstat(2) of a descriptor: `None` if it fails.
pub fn fstat(fd: c_int) -> Option<sys::files::Stat> {
    with_program_fd(fd, sys::files::fstat).ok()
}

/// openat(2) as the kernel does it; the new descriptor, the program's from now on. The
/// kernel ignores the directory of an absolute path, whatever number it is.
pub fn openat(dirfd: c_int, path: &CStr, flags: c_int, mode: c_uint) -> io::Result<c_int> {
    let open = |dir: BorrowedFd<'_>| sys::files::openat(dir, path, flags, mode);
    let file = if dirfd == libc::AT_FDCWD || path.to_bytes().first() == Some(&b'/') {
        open(sys::files::CWD)
    } else {
        with_program_fd(dirfd, open)
    }?;
    Ok(file.into_raw_fd())
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
    let path = sys::files::readlink(link, buffer).ok()?;
    if path.is_empty() || path.len() >= len || path[0] != b'/' {
        return None;
    }
    Some(path)
}
