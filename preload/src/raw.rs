//! The kernel's own behaviour for every interposed call, through the raw system call:
//! never through a libc symbol (which would be the shim again) and never through the
//! allocator. Each returns what the libc function would, errno included.

use libc::{c_int, c_long, c_void, off_t, size_t};

/// Sets errno, as libc functions do on failure.
pub fn set_errno(errno: c_int) {
    // SAFETY: __errno_location returns this thread's errno slot, valid for the thread's life.
    unsafe { *libc::__errno_location() = errno };
}

pub fn errno() -> c_int {
    // SAFETY: as in `set_errno`.
    unsafe { *libc::__errno_location() }
}

/// A raw call's return code as a result: `Err(errno)` when it failed.
pub fn check(rc: c_int) -> Result<(), c_int> {
    if rc == 0 {
        Ok(())
    } else {
        Err(errno())
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
    // SAFETY: the caller's request, passed on unchanged; syscall(2) sets errno and
    // returns -1 on failure, which is MAP_FAILED.
    unsafe { libc::syscall(libc::SYS_mmap, addr, len, prot, flags, fd, offset) as *mut c_void }
}

/// munmap(2).
///
/// # Safety
/// As munmap(2).
pub unsafe fn munmap(addr: *mut c_void, len: size_t) -> c_int {
    // SAFETY: the caller's request, unchanged.
    unsafe { libc::syscall(libc::SYS_munmap, addr, len) as c_int }
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
    unsafe {
        libc::syscall(libc::SYS_mremap, old, old_len, new_len, flags, new_addr) as *mut c_void
    }
}

/// madvise(2).
///
/// # Safety
/// As madvise(2): destructive advice discards the contents of the range.
pub unsafe fn madvise(addr: *mut c_void, len: size_t, advice: c_int) -> c_int {
    // SAFETY: the caller's request, unchanged.
    unsafe { libc::syscall(libc::SYS_madvise, addr, len, advice) as c_int }
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
    let saved = errno();
    // SAFETY: non-destructive advice on the caller's range.
    let rc = unsafe { madvise(addr, len, advice) };
    let result = if rc == 0 { 0 } else { errno() };
    set_errno(saved);
    result
}

/// posix_fadvise(2): returns the error number instead of setting errno.
pub fn posix_fadvise(fd: c_int, offset: off_t, len: off_t, advice: c_int) -> c_int {
    let saved = errno();
    // SAFETY: fadvise64 only affects the page cache of the file behind `fd`.
    let rc: c_long = unsafe { libc::syscall(libc::SYS_fadvise64, fd, offset, len, advice) };
    let result = if rc == 0 { 0 } else { errno() };
    set_errno(saved);
    result
}

/// mlock(2).
///
/// # Safety
/// As mlock(2) (faults the whole range in).
pub unsafe fn mlock(addr: *const c_void, len: size_t) -> c_int {
    // SAFETY: the caller's request, unchanged.
    unsafe { libc::syscall(libc::SYS_mlock, addr, len) as c_int }
}

/// mlock2(2).
///
/// # Safety
/// As mlock2(2).
pub unsafe fn mlock2(addr: *const c_void, len: size_t, flags: libc::c_uint) -> c_int {
    // SAFETY: the caller's request, unchanged.
    unsafe { libc::syscall(libc::SYS_mlock2, addr, len, flags) as c_int }
}

/// munlock(2).
///
/// # Safety
/// As munlock(2).
pub unsafe fn munlock(addr: *const c_void, len: size_t) -> c_int {
    // SAFETY: the caller's request, unchanged.
    unsafe { libc::syscall(libc::SYS_munlock, addr, len) as c_int }
}

/// fstat(2) of a descriptor: `None` if it fails (errno left as the kernel set it).
pub fn fstat(fd: c_int) -> Option<libc::stat> {
    // SAFETY: all-zero is a valid `stat` (plain integers).
    let mut stat: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat writes one `struct stat` to a live, correctly typed destination.
    let rc = unsafe { libc::syscall(libc::SYS_fstat, fd, &mut stat as *mut libc::stat) };
    (rc == 0).then_some(stat)
}

/// The path behind a descriptor (readlink of /proc/self/fd/N) into `buffer`; `None` if it
/// has none or does not fit.
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
    // SAFETY: readlink reads the NUL-terminated path in `link` and writes at most
    // `buffer.len()` bytes into `buffer`.
    let len = unsafe {
        libc::syscall(
            libc::SYS_readlink,
            link.as_ptr(),
            buffer.as_mut_ptr(),
            buffer.len(),
        )
    };
    if len <= 0 || len as usize >= buffer.len() || buffer[0] != b'/' {
        return None;
    }
    Some(&buffer[..len as usize])
}

/// Writes a whole message to stderr with write(2): no stdio lock, which a thread
/// faulting on a managed page may hold.
pub fn write_stderr(message: &[u8]) {
    let mut rest = message;
    while !rest.is_empty() {
        // SAFETY: writes from a live slice to fd 2.
        let n = unsafe { libc::syscall(libc::SYS_write, 2, rest.as_ptr(), rest.len()) };
        if n <= 0 {
            if n < 0 && errno() == libc::EINTR {
                continue;
            }
            return;
        }
        rest = &rest[n as usize..];
    }
}
