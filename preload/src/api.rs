//! Every C symbol the shim exports, in one place: the whole ABI surface.
//!
//! Each hook first decides cheaply whether the call could concern managed memory; if not
//! (or the shim is not ready, or this thread is already inside the shim) it makes the
//! raw system call, exactly as the kernel would see it from libc.
//!
//! The open calls (`open`, `openat`, `fopen` and their variants) change nothing: they
//! make the call as libc would and then let the shim note a model file the program
//! opened (`served_files`: so that one read rather than mapped can be named at exit).

use libc::{c_char, c_int, c_uint, c_void, off_t, pid_t, size_t, FILE};

use crate::map_candidate::{screen_request, MapRequest, PassReason};

use crate::fork_child;
use crate::managed::{page, Errno, Shim};
use crate::raw;
use crate::state::{self, Reentry};

/// Runs `f` with the shim if it is serving this process and this thread is not
/// already inside it.
fn with_shim<T>(f: impl FnOnce(&'static Shim) -> Option<T>) -> Option<T> {
    let shim = state::ready()?;
    if !shim.has_mappings() {
        return None;
    }
    let _reentry = Reentry::enter()?;
    f(shim)
}

/// A libc-style return: 0, or -1 with errno.
fn c_result(result: Errno) -> c_int {
    match result {
        Ok(()) => 0,
        Err(errno) => {
            raw::set_errno(errno);
            -1
        }
    }
}

/// # Safety
/// As mmap(2).
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn mmap(
    addr: *mut c_void,
    len: size_t,
    prot: c_int,
    flags: c_int,
    fd: c_int,
    offset: off_t,
) -> *mut c_void {
    let request = MapRequest {
        addr: addr as usize,
        len,
        prot,
        flags,
        fd,
        offset,
    };
    match screen_request(&request, page() as u64) {
        Ok(()) => {
            if let Some(_reentry) = Reentry::enter() {
                if let Some(base) = state::ready_or_init().and_then(|shim| shim.map(&request)) {
                    fork_child::register_once();
                    return base as *mut c_void;
                }
            }
        }
        Err(reason) => {
            if flags & libc::MAP_FIXED != 0 {
                with_shim(|shim| {
                    shim.release_for_fixed(addr as usize, len);
                    Some(())
                });
            }
            note_refused_request(&request, reason);
        }
    }
    // SAFETY: the caller's request, unchanged.
    unsafe { raw::mmap(addr, len, prot, flags, fd, offset) }
}

/// # Safety
/// As mmap(2).
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn mmap64(
    addr: *mut c_void,
    len: size_t,
    prot: c_int,
    flags: c_int,
    fd: c_int,
    offset: off_t,
) -> *mut c_void {
    // SAFETY: same contract (off_t is 64 bits on x86_64).
    unsafe { mmap(addr, len, prot, flags, fd, offset) }
}

/// Records a file mapping the shim refused by its arguments, if its file is a model
/// (see `served_files`); errno is kept.
fn note_refused_request(request: &MapRequest, reason: PassReason) {
    if request.fd < 0 || matches!(reason, PassReason::Anonymous | PassReason::ZeroLength) {
        return;
    }
    let saved = raw::errno();
    if let Some(_reentry) = Reentry::enter() {
        if let Some(shim) = state::ready_or_init() {
            shim.note_refused_request(request.fd, request.prot, reason);
        }
    }
    raw::set_errno(saved);
}

/// Records what the program opened as `fd`, if it is a model file (see `served_files`):
/// called after the open succeeded; errno is kept.
fn note_open(fd: c_int, flags: c_int) {
    // A descriptor that cannot be read from is no model being loaded.
    if fd < 0 || flags & libc::O_PATH != 0 || flags & libc::O_ACCMODE == libc::O_WRONLY {
        return;
    }
    let saved = raw::errno();
    if let Some(_reentry) = Reentry::enter() {
        if let Some(shim) = state::ready_or_init() {
            shim.note_open(fd);
        }
    }
    raw::set_errno(saved);
}

/// openat(2) as the kernel does it, then `note_open`. Shared by every open variant: libc's
/// do the same system call (open is openat at the working directory; the 64-bit and
/// fortified variants differ only in how the compiler reached them).
///
/// # Safety
/// `path` is a NUL-terminated string, as for openat(2).
unsafe fn open_at(dirfd: c_int, path: *const c_char, flags: c_int, mode: c_uint) -> c_int {
    if path.is_null() {
        raw::set_errno(libc::EFAULT);
        return -1;
    }
    // SAFETY: the caller's NUL-terminated path, read only during this call.
    let name = unsafe { std::ffi::CStr::from_ptr(path) };
    match raw::openat(dirfd, name, flags, mode) {
        Ok(fd) => {
            note_open(fd, flags);
            fd
        }
        Err(error) => {
            raw::set_errno(raw::errno_of(error));
            -1
        }
    }
}

/// open is declared variadic in C; the mode is only read with O_CREAT or O_TMPFILE, and
/// reading its register otherwise is harmless on x86_64 (as for `mremap`).
///
/// # Safety
/// As open(2).
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn open(path: *const c_char, flags: c_int, mode: c_uint) -> c_int {
    // SAFETY: as open(2).
    unsafe { open_at(libc::AT_FDCWD, path, flags, mode) }
}

/// # Safety
/// As open(2).
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn open64(path: *const c_char, flags: c_int, mode: c_uint) -> c_int {
    // SAFETY: as open(2).
    unsafe { open_at(libc::AT_FDCWD, path, flags, mode) }
}

/// # Safety
/// As openat(2).
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn openat(
    dirfd: c_int,
    path: *const c_char,
    flags: c_int,
    mode: c_uint,
) -> c_int {
    // SAFETY: as openat(2).
    unsafe { open_at(dirfd, path, flags, mode) }
}

/// # Safety
/// As openat(2).
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn openat64(
    dirfd: c_int,
    path: *const c_char,
    flags: c_int,
    mode: c_uint,
) -> c_int {
    // SAFETY: as openat(2).
    unsafe { open_at(dirfd, path, flags, mode) }
}

/// What `open` becomes under _FORTIFY_SOURCE where the flags are not known to the
/// compiler: no mode (glibc aborts on O_CREAT without one; the kernel refuses it here).
///
/// # Safety
/// As open(2).
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn __open_2(path: *const c_char, flags: c_int) -> c_int {
    // SAFETY: as open(2).
    unsafe { open_at(libc::AT_FDCWD, path, flags, 0) }
}

/// # Safety
/// As open(2).
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn __open64_2(path: *const c_char, flags: c_int) -> c_int {
    // SAFETY: as open(2).
    unsafe { open_at(libc::AT_FDCWD, path, flags, 0) }
}

/// # Safety
/// As openat(2).
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn __openat_2(dirfd: c_int, path: *const c_char, flags: c_int) -> c_int {
    // SAFETY: as openat(2).
    unsafe { open_at(dirfd, path, flags, 0) }
}

/// # Safety
/// As openat(2).
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn __openat64_2(dirfd: c_int, path: *const c_char, flags: c_int) -> c_int {
    // SAFETY: as openat(2).
    unsafe { open_at(dirfd, path, flags, 0) }
}

type FopenFn = unsafe extern "C" fn(*const c_char, *const c_char) -> *mut FILE;

/// libc's fopen (it opens through libc's internal open, which no hook sees), then
/// `note_open`.
///
/// # Safety
/// As fopen(3).
unsafe fn fopen_next(
    symbol: &std::ffi::CStr,
    cache: &std::sync::atomic::AtomicUsize,
    path: *const c_char,
    mode: *const c_char,
) -> *mut FILE {
    let address = next_symbol(symbol, cache);
    if address == 0 {
        raw::set_errno(libc::ENOSYS);
        return std::ptr::null_mut();
    }
    // SAFETY: a non-null result of dlsym for fopen or fopen64 is libc's, of this signature.
    let real = unsafe { std::mem::transmute::<usize, FopenFn>(address) };
    // SAFETY: libc's fopen, called as the program called ours.
    let stream = unsafe { real(path, mode) };
    if !stream.is_null() {
        // SAFETY: a stream fopen just returned.
        let fd = unsafe { libc::fileno(stream) };
        // SAFETY: fopen's mode is a NUL-terminated string.
        let writing_only = unsafe { *mode } as u8 != b'r'
            && !unsafe { std::ffi::CStr::from_ptr(mode) }
                .to_bytes()
                .contains(&b'+');
        note_open(
            fd,
            if writing_only {
                libc::O_WRONLY
            } else {
                libc::O_RDONLY
            },
        );
    }
    stream
}

/// # Safety
/// As fopen(3).
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn fopen(path: *const c_char, mode: *const c_char) -> *mut FILE {
    static REAL: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    // SAFETY: as fopen(3).
    unsafe { fopen_next(c"fopen", &REAL, path, mode) }
}

/// # Safety
/// As fopen(3).
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn fopen64(path: *const c_char, mode: *const c_char) -> *mut FILE {
    static REAL: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    // SAFETY: as fopen(3).
    unsafe { fopen_next(c"fopen64", &REAL, path, mode) }
}

/// The next definition of `symbol` after the shim's (libc's), looked up once into `cache`:
/// lazily, at the first call, when the dynamic linker is long initialised. 0 if none.
fn next_symbol(symbol: &std::ffi::CStr, cache: &std::sync::atomic::AtomicUsize) -> usize {
    use std::sync::atomic::Ordering;
    let mut address = cache.load(Ordering::Acquire);
    if address == 0 {
        // SAFETY: dlsym with RTLD_NEXT and a NUL-terminated name.
        address = unsafe { libc::dlsym(libc::RTLD_NEXT, symbol.as_ptr()) } as usize;
        cache.store(address, Ordering::Release);
    }
    address
}

/// # Safety
/// As munmap(2).
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn munmap(addr: *mut c_void, len: size_t) -> c_int {
    if let Some(result) = with_shim(|shim| shim.unmap(addr as usize, len)) {
        return c_result(result);
    }
    fork_child::unmapped_in_child(addr as usize, len);
    // SAFETY: the caller's request, unchanged.
    unsafe { raw::munmap(addr, len) }
}

/// mremap is declared variadic in C; the fifth argument is only read with MREMAP_FIXED,
/// and reading its register otherwise is harmless on x86_64.
///
/// # Safety
/// As mremap(2).
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn mremap(
    old: *mut c_void,
    old_len: size_t,
    new_len: size_t,
    flags: c_int,
    new_addr: *mut c_void,
) -> *mut c_void {
    let fixed = (flags & libc::MREMAP_FIXED != 0).then_some((new_addr as usize, new_len));
    if with_shim(|shim| {
        shim.refuses_remap(old as usize, old_len, fixed)
            .then_some(())
    })
    .is_some()
        || fork_child::refuses_remap_in_child(old as usize, old_len, fixed)
    {
        raw::set_errno(libc::EINVAL);
        return libc::MAP_FAILED;
    }
    // SAFETY: the caller's request, unchanged.
    unsafe { raw::mremap(old, old_len, new_len, flags, new_addr) }
}

/// # Safety
/// As madvise(2).
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn madvise(addr: *mut c_void, len: size_t, advice: c_int) -> c_int {
    if let Some(result) = with_shim(|shim| shim.advise(addr as usize, len, advice, false)) {
        return c_result(result);
    }
    // SAFETY: the caller's request, unchanged.
    unsafe { raw::madvise(addr, len, advice) }
}

/// glibc's posix_madvise does not call madvise, so it is interposed separately. Returns
/// an error number, not -1.
///
/// # Safety
/// As posix_madvise(3).
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn posix_madvise(addr: *mut c_void, len: size_t, advice: c_int) -> c_int {
    if let Some(result) = with_shim(|shim| shim.advise(addr as usize, len, advice, true)) {
        return result.err().unwrap_or(0);
    }
    // SAFETY: the caller's request, unchanged.
    unsafe { raw::posix_madvise(addr, len, advice) }
}

/// WILLNEED on a managed file is dropped: it would read the whole file into the page
/// cache, outside the budget. Returns an error number, not -1.
#[cfg_attr(not(test), no_mangle)]
pub extern "C" fn posix_fadvise(fd: c_int, offset: off_t, len: off_t, advice: c_int) -> c_int {
    if advice == libc::POSIX_FADV_WILLNEED
        && with_shim(|shim| shim.is_managed_file(fd).then_some(())).is_some()
    {
        return 0;
    }
    raw::posix_fadvise(fd, offset, len, advice)
}

#[cfg_attr(not(test), no_mangle)]
pub extern "C" fn posix_fadvise64(fd: c_int, offset: off_t, len: off_t, advice: c_int) -> c_int {
    posix_fadvise(fd, offset, len, advice)
}

/// # Safety
/// As mlock(2).
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn mlock(addr: *const c_void, len: size_t) -> c_int {
    if let Some(result) = with_shim(|shim| shim.lock_range(addr as usize, len, 0)) {
        return c_result(result);
    }
    // SAFETY: the caller's request, unchanged.
    unsafe { raw::mlock(addr, len) }
}

/// # Safety
/// As mlock2(2).
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn mlock2(addr: *const c_void, len: size_t, flags: c_uint) -> c_int {
    if let Some(result) = with_shim(|shim| shim.lock_range(addr as usize, len, flags)) {
        return c_result(result);
    }
    // SAFETY: the caller's request, unchanged.
    unsafe { raw::mlock2(addr, len, flags) }
}

/// # Safety
/// As munlock(2).
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn munlock(addr: *const c_void, len: size_t) -> c_int {
    if let Some(result) = with_shim(|shim| shim.unlock_range(addr as usize, len)) {
        return c_result(result);
    }
    // SAFETY: the caller's request, unchanged.
    unsafe { raw::munlock(addr, len) }
}

/// fork through libc's own (it runs the atfork handlers, among them `fork_child`'s,
/// which give the child kernel mappings of the model files); the child runs unpaged.
/// Only calls through this symbol get here; `state` recognises children made any other
/// way by their pid and treats them the same.
#[cfg_attr(not(test), no_mangle)]
pub extern "C" fn fork() -> pid_t {
    let Some(real_fork) = real_fork() else {
        raw::set_errno(libc::ENOSYS);
        return -1;
    };
    // SAFETY: libc's fork, called as the program called ours.
    let pid = unsafe { real_fork() };
    if pid == 0 {
        state::become_forked_child();
    }
    pid
}

type ForkFn = unsafe extern "C" fn() -> pid_t;

fn real_fork() -> Option<ForkFn> {
    static REAL_FORK: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let address = next_symbol(c"fork", &REAL_FORK);
    // SAFETY: a non-null result of dlsym("fork") is libc's fork, of this signature.
    (address != 0).then(|| unsafe { std::mem::transmute::<usize, ForkFn>(address) })
}
