//! Every C symbol the shim exports, in one place: the whole ABI surface.
//!
//! Each hook first decides cheaply whether the call could concern managed memory; if not
//! (or the shim is not ready, or this thread is already inside the shim) it makes the
//! raw system call, exactly as the kernel would see it from libc.

use libc::{c_int, c_uint, c_void, off_t, pid_t, size_t};

use hyperoffload::map_candidate::{screen_request, MapRequest};

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
    if screen_request(&request, page() as u64).is_ok() {
        if let Some(_reentry) = Reentry::enter() {
            if let Some(base) = state::ready_or_init().and_then(|shim| shim.map(&request)) {
                fork_child::register_once();
                return base as *mut c_void;
            }
        }
    } else if flags & libc::MAP_FIXED != 0 {
        with_shim(|shim| {
            shim.release_for_fixed(addr as usize, len);
            Some(())
        });
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

/// # Safety
/// As munmap(2).
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn munmap(addr: *mut c_void, len: size_t) -> c_int {
    if let Some(result) = with_shim(|shim| shim.unmap(addr as usize, len)) {
        return c_result(result);
    }
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
    use std::sync::atomic::{AtomicUsize, Ordering};
    static REAL_FORK: AtomicUsize = AtomicUsize::new(0);
    let mut address = REAL_FORK.load(Ordering::Acquire);
    if address == 0 {
        // SAFETY: dlsym with RTLD_NEXT and a NUL-terminated name; looked up lazily, at
        // the first fork, when the dynamic linker is long initialised.
        address = unsafe { libc::dlsym(libc::RTLD_NEXT, c"fork".as_ptr()) } as usize;
        REAL_FORK.store(address, Ordering::Release);
    }
    // SAFETY: a non-null result of dlsym("fork") is libc's fork, of this signature.
    (address != 0).then(|| unsafe { std::mem::transmute::<usize, ForkFn>(address) })
}
