//! The OS layer: the only code in the library and the LD_PRELOAD shim that calls the
//! kernel (apart from the `userfaultfd` and `io-uring` crates' own ioctls and rings).
//!
//! Every call goes to the kernel directly, never through a libc symbol: inside a program
//! run under the shim, `mmap`, `munmap`, `madvise`, `mlock`... resolve to the shim's own
//! interposed functions, and the pager's internal calls must reach the kernel unchanged.
//! The calls are made with rustix, whose `linux_raw` backend (the default on Linux; the
//! `use-libc` feature stays off) issues the system calls itself. The few calls rustix
//! does not offer are raw `libc::syscall`s, each saying why.
//!
//! One error convention: `io::Result`, with the kernel's errno inside
//! (`io::Error::raw_os_error`). The shim turns it into errno at its C ABI edge.

use std::ffi::{c_void, CStr};
use std::io;
use std::num::NonZeroU64;
use std::os::fd::{BorrowedFd, OwnedFd, RawFd};

use rustix::fs::{FallocateFlags, Mode, OFlags};
use rustix::mm::{MapFlags, MlockFlags, MprotectFlags, MremapFlags, ProtFlags};
use rustix::mount::{FsMountFlags, FsOpenFlags, MountAttrFlags};

pub use rustix::fs::Stat;
pub use rustix::mm::Advice;

/// Size of a huge page (x86-64 and arm64 with 4 KiB pages): the tmpfs frames' page and
/// the read ring's buffer alignment.
pub const HUGE_PAGE: u64 = 2 << 20;

/// The kernel's page size (from the auxiliary vector).
pub fn page_size() -> u64 {
    rustix::param::page_size() as u64
}

fn errno(code: i32) -> io::Error {
    io::Error::from_raw_os_error(code)
}

// ---------------------------------------------------------------------------------------
// Memory mappings

/// mmap(2) with the raw arguments a C caller passes. Returns the address.
///
/// # Safety
/// As for mmap(2): with `MAP_FIXED`, or a file the caller does not own, the call can
/// replace or expose memory other code relies on.
pub unsafe fn mmap(
    addr: usize,
    len: usize,
    prot: i32,
    flags: i32,
    fd: RawFd,
    offset: i64,
) -> io::Result<usize> {
    let prot = ProtFlags::from_bits_retain(prot as u32);
    let flags = MapFlags::from_bits_retain(flags as u32);
    let addr = addr as *mut c_void;
    let result = if fd == -1 {
        // rustix cannot name fd -1 (a `BorrowedFd` never is): an anonymous mapping goes
        // through `mmap_anonymous`, which passes -1 and adds MAP_ANONYMOUS; the checks
        // keep the kernel's answers for what it would refuse.
        let anonymous = MapFlags::from_bits_retain(libc::MAP_ANONYMOUS as u32);
        if !flags.contains(anonymous) {
            return Err(errno(libc::EBADF));
        }
        if offset as u64 % page_size() != 0 {
            return Err(errno(libc::EINVAL));
        }
        let flags = flags.difference(anonymous);
        // SAFETY: the caller upholds mmap(2)'s contract.
        unsafe { rustix::mm::mmap_anonymous(addr, len, prot, flags) }
    } else {
        // SAFETY: `fd` is not -1; the kernel checks that it is open (EBADF otherwise) and
        // keeps no borrow of it beyond the call.
        let fd = unsafe { BorrowedFd::borrow_raw(fd) };
        // SAFETY: the caller upholds mmap(2)'s contract.
        unsafe { rustix::mm::mmap(addr, len, prot, flags, fd, offset as u64) }
    };
    Ok(result? as usize)
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

/// mremap(2); `new_addr` is used with `MREMAP_FIXED` only. Returns the new address.
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
    let fixed = MremapFlags::from_bits_retain(libc::MREMAP_FIXED as u32);
    let moved = if flags.contains(fixed) {
        // SAFETY: the caller upholds mremap(2)'s contract; rustix adds MREMAP_FIXED back.
        unsafe {
            rustix::mm::mremap_fixed(
                old,
                old_len,
                new_len,
                flags.difference(fixed),
                new_addr as *mut c_void,
            )
        }
    } else {
        // SAFETY: as above.
        unsafe { rustix::mm::mremap(old, old_len, new_len, flags) }
    };
    Ok(moved? as usize)
}

/// mprotect(2).
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
    match unsafe { madvise(addr, len, Advice::LinuxDontneedLocked) } {
        // SAFETY: as above.
        Err(error) if error.raw_os_error() == Some(libc::EINVAL) => unsafe {
            madvise(addr, len, Advice::LinuxDontNeed)
        },
        result => result,
    }
}

/// mlock(2), or mlock2(2) when `flags` is not 0.
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

/// Whether the page at `addr` is in the process's page tables (or in swap), by
/// mincore(2). A raw syscall: rustix has no mincore.
pub fn page_resident(addr: usize) -> io::Result<bool> {
    let mut state = 0u8;
    // SAFETY: mincore reads the page tables of the one page at `addr` (any address is
    // safe: an unmapped one is ENOMEM) and writes one byte into `state`, which is live.
    let rc = unsafe { libc::syscall(libc::SYS_mincore, addr, 1usize, &mut state as *mut u8) };
    if rc != 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(state & 1 == 1)
    }
}

// ---------------------------------------------------------------------------------------
// userfaultfd ioctls the `userfaultfd` crate lacks

#[repr(C)]
struct UffdioRange {
    start: u64,
    len: u64,
}

/// `struct uffdio_poison` (include/uapi/linux/userfaultfd.h).
#[repr(C)]
struct UffdioPoison {
    range: UffdioRange,
    mode: u64,
    updated: i64,
}

const UFFDIO_POISON: rustix::ioctl::Opcode =
    rustix::ioctl::opcode::read_write::<UffdioPoison>(0xAA, 0x08);

/// UFFDIO_POISON (Linux 6.6) on `[start, start + len)` of a range registered on `uffd`.
/// Returns the outcome and the kernel's `updated` field (bytes done, or a negated errno
/// when none were).
pub fn uffdio_poison(uffd: BorrowedFd<'_>, start: usize, len: usize) -> (io::Result<()>, i64) {
    let mut arg = UffdioPoison {
        range: UffdioRange {
            start: start as u64,
            len: len as u64,
        },
        mode: 0,
        updated: 0,
    };
    // SAFETY: UFFDIO_POISON reads and writes one `struct uffdio_poison`, which `arg` is,
    // live and correctly laid out for the call. The ioctl changes page tables of a range
    // registered with this uffd only; it never writes user memory.
    let result = unsafe {
        rustix::ioctl::ioctl(
            uffd,
            rustix::ioctl::Updater::<UFFDIO_POISON, UffdioPoison>::new(&mut arg),
        )
    };
    (result.map_err(io::Error::from), arg.updated)
}

/// `struct uffdio_continue` (include/uapi/linux/userfaultfd.h).
#[repr(C)]
struct UffdioContinue {
    range: UffdioRange,
    mode: u64,
    mapped: i64,
}

const UFFDIO_CONTINUE: rustix::ioctl::Opcode =
    rustix::ioctl::opcode::read_write::<UffdioContinue>(0xAA, 0x07);

/// UFFDIO_CONTINUE on `[start, start + len)` of a range registered on `uffd` for minor
/// faults: maps the pages the shared-memory file behind the range already holds into
/// the address space `uffd` serves, and wakes the threads waiting there. Returns the
/// outcome and the kernel's `mapped` field (bytes done, or a negated errno when none
/// were).
pub fn uffdio_continue(uffd: BorrowedFd<'_>, start: usize, len: usize) -> (io::Result<()>, i64) {
    let mut arg = UffdioContinue {
        range: UffdioRange {
            start: start as u64,
            len: len as u64,
        },
        mode: 0,
        mapped: 0,
    };
    // SAFETY: UFFDIO_CONTINUE reads and writes one `struct uffdio_continue`, which `arg`
    // is. It maps pages the file already holds into a range registered with this uffd;
    // it never writes user memory.
    let result = unsafe {
        rustix::ioctl::ioctl(
            uffd,
            rustix::ioctl::Updater::<UFFDIO_CONTINUE, UffdioContinue>::new(&mut arg),
        )
    };
    (result.map_err(io::Error::from), arg.mapped)
}

const UFFDIO_WAKE: rustix::ioctl::Opcode = rustix::ioctl::opcode::read::<UffdioRange>(0xAA, 0x02);

/// UFFDIO_WAKE: wakes the threads waiting on faults in `[start, start + len)`.
pub fn uffdio_wake(uffd: BorrowedFd<'_>, start: usize, len: usize) -> io::Result<()> {
    let mut range = UffdioRange {
        start: start as u64,
        len: len as u64,
    };
    // SAFETY: UFFDIO_WAKE reads one `struct uffdio_range`, which `range` is; it changes
    // no memory.
    unsafe {
        rustix::ioctl::ioctl(
            uffd,
            rustix::ioctl::Updater::<UFFDIO_WAKE, UffdioRange>::new(&mut range),
        )
    }
    .map_err(io::Error::from)
}

/// `struct uffdio_writeprotect` (include/uapi/linux/userfaultfd.h).
#[repr(C)]
struct UffdioWriteprotect {
    range: UffdioRange,
    mode: u64,
}

const UFFDIO_WRITEPROTECT: rustix::ioctl::Opcode =
    rustix::ioctl::opcode::read_write::<UffdioWriteprotect>(0xAA, 0x06);

/// Whether the address space `uffd` serves still exists. UFFDIO_WRITEPROTECT takes a
/// reference on the address space before it looks at the range and fails with ESRCH
/// once the process exited or exec'd; the kernel gives a userfaultfd no other sign of
/// that (no event, no hangup on poll). Asked to remove write protection from a range
/// not registered for it (ours never are), it changes nothing and fails with ENOENT;
/// so any page-aligned `addr` the kernel accepts will do. (UFFDIO_CONTINUE would tell as
/// well, but on a range registered for minor faults it maps whatever page the file
/// holds, and a page being read is there before its bytes are.)
pub fn uffd_process_alive(uffd: BorrowedFd<'_>, addr: usize) -> bool {
    let mut arg = UffdioWriteprotect {
        range: UffdioRange {
            start: addr as u64,
            len: page_size(),
        },
        // Neither MODE_WP nor MODE_DONTWAKE: un-protect, which on a range without write
        // protection is refused before it changes anything.
        mode: 0,
    };
    // SAFETY: UFFDIO_WRITEPROTECT reads one `struct uffdio_writeprotect`, which `arg`
    // is; on ranges not registered for write protection it changes nothing.
    let result = unsafe {
        rustix::ioctl::ioctl(
            uffd,
            rustix::ioctl::Updater::<UFFDIO_WRITEPROTECT, UffdioWriteprotect>::new(&mut arg),
        )
    };
    !matches!(result, Err(rustix::io::Errno::SRCH))
}

// ---------------------------------------------------------------------------------------
// Files and descriptors

/// A new anonymous shared-memory file (memfd_create(2), close-on-exec, small pages) of
/// `len` bytes, all holes, read-write.
pub fn memfd(name: &CStr, len: u64) -> io::Result<OwnedFd> {
    let file = rustix::fs::memfd_create(name, rustix::fs::MemfdFlags::CLOEXEC)?;
    rustix::fs::ftruncate(&file, len)?;
    Ok(file)
}

/// A non-blocking, close-on-exec eventfd(2) with counter 0.
pub fn eventfd() -> io::Result<OwnedFd> {
    use rustix::event::EventfdFlags;
    Ok(rustix::event::eventfd(
        0,
        EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK,
    )?)
}

/// open(2) of `path` for reading, close-on-exec (no allocation: usable in a
/// constructor and in a child after fork).
pub fn open_read(path: &CStr) -> io::Result<OwnedFd> {
    Ok(rustix::fs::open(
        path,
        OFlags::RDONLY | OFlags::CLOEXEC,
        Mode::empty(),
    )?)
}

/// openat(2) as a C caller makes it: a raw directory descriptor (`libc::AT_FDCWD` for
/// the working directory), the flags and mode bit for bit; the new descriptor. The mode
/// reaches the kernel only where the flags create a file (as libc passes it).
pub fn openat_raw(dirfd: RawFd, path: &CStr, flags: i32, mode: u32) -> io::Result<RawFd> {
    use std::os::fd::IntoRawFd;
    let flags = OFlags::from_bits_retain(flags as u32);
    let mode = if flags.intersects(OFlags::CREATE | OFlags::TMPFILE) {
        Mode::from_bits_retain(mode)
    } else {
        Mode::empty()
    };
    let opened = if dirfd == libc::AT_FDCWD {
        rustix::fs::openat(rustix::fs::CWD, path, flags, mode)
    } else if dirfd < 0 {
        return Err(errno(libc::EBADF));
    } else {
        // SAFETY: `dirfd` is not -1; the kernel checks it is open and keeps no borrow.
        let dirfd = unsafe { BorrowedFd::borrow_raw(dirfd) };
        rustix::fs::openat(dirfd, path, flags, mode)
    };
    Ok(opened?.into_raw_fd())
}

/// open(2) of `path` for reading and writing, non-blocking and close-on-exec: a PSI
/// trigger is written to such a descriptor and then polled.
pub fn open_read_write_nonblock(path: &CStr) -> io::Result<OwnedFd> {
    Ok(rustix::fs::open(
        path,
        OFlags::RDWR | OFlags::NONBLOCK | OFlags::CLOEXEC,
        Mode::empty(),
    )?)
}

/// open(2) of `path` for writing, close-on-exec (a cgroup control file).
pub fn open_write(path: &CStr) -> io::Result<OwnedFd> {
    Ok(rustix::fs::open(
        path,
        OFlags::WRONLY | OFlags::CLOEXEC,
        Mode::empty(),
    )?)
}

pub use rustix::event::{PollFd, PollFlags};

/// poll(2): waits up to `timeout` for one of `fds` to be ready and returns how many
/// are (their `revents` say how). Interrupted by a signal, none are.
pub fn poll(fds: &mut [PollFd<'_>], timeout: std::time::Duration) -> io::Result<usize> {
    let timeout = rustix::event::Timespec {
        tv_sec: timeout.as_secs() as i64,
        tv_nsec: timeout.subsec_nanos() as i64,
    };
    match rustix::event::poll(fds, Some(&timeout)) {
        Ok(ready) => Ok(ready),
        Err(rustix::io::Errno::INTR) => Ok(0),
        Err(error) => Err(error.into()),
    }
}

/// read(2).
pub fn read(fd: BorrowedFd<'_>, buffer: &mut [u8]) -> io::Result<usize> {
    Ok(rustix::io::read(fd, buffer)?)
}

/// pread(2).
pub fn pread(fd: BorrowedFd<'_>, buffer: &mut [u8], offset: u64) -> io::Result<usize> {
    Ok(rustix::io::pread(fd, buffer, offset)?)
}

/// pwrite(2): writes what it can of `buffer` at `offset`, and says how much.
pub fn pwrite(fd: BorrowedFd<'_>, buffer: &[u8], offset: u64) -> io::Result<usize> {
    Ok(rustix::io::pwrite(fd, buffer, offset)?)
}

/// The holes of the first `len` bytes of `fd` (lseek(2) SEEK_DATA/SEEK_HOLE), as
/// ranges of offsets, ascending. A file system without hole tracking reports none: one
/// data extent up to its size.
pub fn holes(fd: BorrowedFd<'_>, len: u64) -> io::Result<Vec<std::ops::Range<u64>>> {
    use rustix::fs::SeekFrom;
    let mut holes = Vec::new();
    let mut at = 0;
    while at < len {
        let hole = rustix::fs::seek(fd, SeekFrom::Hole(at))?.min(len);
        if hole >= len {
            break;
        }
        let data = match rustix::fs::seek(fd, SeekFrom::Data(hole)) {
            Ok(data) => data.min(len),
            // ENXIO: no data past `hole`.
            Err(rustix::io::Errno::NXIO) => len,
            Err(error) => return Err(error.into()),
        };
        holes.push(hole..data);
        at = data;
    }
    Ok(holes)
}

/// Whether offset `at` of `fd` is in a hole (lseek(2) SEEK_HOLE finds one there); past
/// the end of the file, no.
pub fn is_hole(fd: BorrowedFd<'_>, at: u64) -> io::Result<bool> {
    match rustix::fs::seek(fd, rustix::fs::SeekFrom::Hole(at)) {
        Ok(hole) => Ok(hole == at),
        Err(rustix::io::Errno::NXIO) => Ok(false),
        Err(error) => Err(error.into()),
    }
}

/// write(2).
pub fn write(fd: BorrowedFd<'_>, buffer: &[u8]) -> io::Result<usize> {
    Ok(rustix::io::write(fd, buffer)?)
}

/// Writes a whole message to stderr with write(2): no stdio lock (which a thread faulting
/// on a managed page may hold), no allocation. Best effort.
pub fn write_stderr(message: &[u8]) {
    let mut rest = message;
    while !rest.is_empty() {
        match rustix::io::write(rustix::stdio::stderr(), rest) {
            Ok(0) => return,
            Ok(n) => rest = &rest[n..],
            Err(rustix::io::Errno::INTR) => continue,
            Err(_) => return,
        }
    }
}

/// fstat(2) of a raw descriptor (the shim's callers hand it raw numbers).
pub fn fstat(fd: RawFd) -> io::Result<Stat> {
    if fd < 0 {
        return Err(errno(libc::EBADF));
    }
    // SAFETY: `fd` is not -1; the kernel checks it is open and keeps no borrow of it.
    let fd = unsafe { BorrowedFd::borrow_raw(fd) };
    Ok(rustix::fs::fstat(fd)?)
}

/// posix_fadvise(2) with the advice number a C caller passes. Offset and length reach
/// the kernel bit for bit (it judges negative ones itself).
pub fn fadvise(fd: RawFd, offset: i64, len: i64, advice: i32) -> io::Result<()> {
    use rustix::fs::Advice as F;
    if fd < 0 {
        return Err(errno(libc::EBADF));
    }
    let advice = match advice {
        libc::POSIX_FADV_NORMAL => F::Normal,
        libc::POSIX_FADV_SEQUENTIAL => F::Sequential,
        libc::POSIX_FADV_RANDOM => F::Random,
        libc::POSIX_FADV_NOREUSE => F::NoReuse,
        libc::POSIX_FADV_WILLNEED => F::WillNeed,
        libc::POSIX_FADV_DONTNEED => F::DontNeed,
        // rustix's Advice is a closed enum; the kernel refuses advice it does not know
        // with EINVAL too.
        _ => return Err(errno(libc::EINVAL)),
    };
    // SAFETY: `fd` is not -1; the kernel checks it is open and keeps no borrow of it.
    let fd = unsafe { BorrowedFd::borrow_raw(fd) };
    Ok(rustix::fs::fadvise(
        fd,
        offset as u64,
        NonZeroU64::new(len as u64),
        advice,
    )?)
}

/// readlink(2) of `path` into `buffer`; returns the bytes written (possibly truncated:
/// a result filling the buffer may be cut short).
pub fn readlink<'b>(path: &CStr, buffer: &'b mut [u8]) -> io::Result<&'b [u8]> {
    let len = rustix::fs::readlinkat_raw(rustix::fs::CWD, path, &mut *buffer)?;
    Ok(&buffer[..len])
}

/// A detached tmpfs mount (fsopen/fsconfig/fsmount, never attached to a directory) with
/// the given string options. Fails with EPERM without CAP_SYS_ADMIN, ENOSYS before Linux
/// 5.2.
pub fn mount_tmpfs(options: &[(&CStr, &CStr)]) -> io::Result<OwnedFd> {
    let context = rustix::mount::fsopen(c"tmpfs", FsOpenFlags::FSOPEN_CLOEXEC)?;
    for &(key, value) in options {
        rustix::mount::fsconfig_set_string(&context, key, value)?;
    }
    rustix::mount::fsconfig_create(&context)?;
    Ok(rustix::mount::fsmount(
        &context,
        FsMountFlags::FSMOUNT_CLOEXEC,
        MountAttrFlags::empty(),
    )?)
}

/// A new unnamed (O_TMPFILE) read-write file of `len` bytes, all holes, in directory `dir`.
pub fn create_tmpfile(dir: BorrowedFd<'_>, len: u64) -> io::Result<OwnedFd> {
    let file = rustix::fs::openat(
        dir,
        c".",
        OFlags::TMPFILE | OFlags::RDWR | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o600),
    )?;
    rustix::fs::ftruncate(&file, len)?;
    Ok(file)
}

/// Frees the file's pages in `[offset, offset + len)` (a hole; the size is kept).
pub fn punch_hole(fd: BorrowedFd<'_>, offset: u64, len: u64) -> io::Result<()> {
    Ok(rustix::fs::fallocate(
        fd,
        FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE,
        offset,
        len,
    )?)
}

/// Takes an exclusive `flock` on `fd` without waiting: false when another open file
/// description holds one (the remote cache tier's one-mount-per-directory lock).
pub fn try_lock_exclusive(fd: BorrowedFd<'_>) -> io::Result<bool> {
    match rustix::fs::flock(fd, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => Ok(true),
        Err(rustix::io::Errno::WOULDBLOCK) => Ok(false),
        Err(error) => Err(error.into()),
    }
}

/// Detaches the mount at `path` (`umount -l`): it is gone from the tree at once, and
/// ends when the last file open in it is closed.
pub fn unmount_lazy(path: &std::path::Path) -> io::Result<()> {
    Ok(rustix::mount::unmount(
        path,
        rustix::mount::UnmountFlags::DETACH,
    )?)
}

// ---------------------------------------------------------------------------------------
// Unix sockets (the keeper's channel, `crate::keeper`)

/// A connected pair of unix `SOCK_SEQPACKET` sockets (socketpair(2)), both close-on-exec:
/// messages keep their boundaries, and descriptors travel with them.
pub fn seqpacket_pair() -> io::Result<(OwnedFd, OwnedFd)> {
    use rustix::net::{AddressFamily, SocketFlags, SocketType};
    Ok(rustix::net::socketpair(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )?)
}

/// Whether `fd` is an open unix `SOCK_SEQPACKET` socket (what `seqpacket_pair` makes).
pub fn is_seqpacket(fd: RawFd) -> bool {
    if fd < 0 {
        return false;
    }
    // SAFETY: `fd` is not -1; the kernel checks that it is open and keeps no borrow.
    let fd = unsafe { BorrowedFd::borrow_raw(fd) };
    matches!(
        rustix::net::sockopt::socket_type(fd),
        Ok(rustix::net::SocketType::SEQPACKET)
    )
}

/// A close-on-exec duplicate of `fd` (fcntl(2) F_DUPFD_CLOEXEC), at 3 or above.
pub fn dup_cloexec(fd: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    Ok(rustix::io::fcntl_dupfd_cloexec(fd, 3)?)
}

/// Sends `bytes` as one message on a `SOCK_SEQPACKET` socket, with `fds` (SCM_RIGHTS);
/// blocks while the socket's buffer is full. No SIGPIPE: a peer gone is EPIPE.
pub fn send_with_fds(
    socket: BorrowedFd<'_>,
    bytes: &[u8],
    fds: &[BorrowedFd<'_>],
) -> io::Result<()> {
    use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
    use std::mem::MaybeUninit;
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_SENT_FDS))];
    if fds.len() > MAX_SENT_FDS {
        return Err(errno(libc::EINVAL));
    }
    loop {
        let mut control = SendAncillaryBuffer::new(&mut space);
        if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
            return Err(errno(libc::EINVAL));
        }
        let iov = [io::IoSlice::new(bytes)];
        match rustix::net::sendmsg(socket, &iov, &mut control, SendFlags::NOSIGNAL) {
            Ok(_) => return Ok(()),
            Err(rustix::io::Errno::INTR) => continue,
            Err(error) => return Err(error.into()),
        }
    }
}

/// A unix `SOCK_SEQPACKET` socket listening at `path` (bind(2), listen(2)),
/// close-on-exec and nonblocking (`accept_seqpacket` answers None when nobody waits).
pub fn listen_seqpacket(path: &std::path::Path) -> io::Result<OwnedFd> {
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    let socket = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
        None,
    )?;
    let address = SocketAddrUnix::new(path)?;
    rustix::net::bind(&socket, &address)?;
    rustix::net::listen(&socket, 64)?;
    Ok(socket)
}

/// Takes one connection waiting on `listener` (accept4(2)), close-on-exec and
/// nonblocking; None when none waits.
pub fn accept_seqpacket(listener: BorrowedFd<'_>) -> io::Result<Option<OwnedFd>> {
    use rustix::net::SocketFlags;
    loop {
        match rustix::net::accept_with(listener, SocketFlags::CLOEXEC | SocketFlags::NONBLOCK) {
            Ok(socket) => return Ok(Some(socket)),
            Err(rustix::io::Errno::INTR) => continue,
            Err(rustix::io::Errno::AGAIN) => return Ok(None),
            Err(error) => return Err(error.into()),
        }
    }
}

/// The pid of the process at the other end of a connected unix socket (as it was when
/// it connected: SO_PEERCRED).
pub fn peer_pid(socket: BorrowedFd<'_>) -> io::Result<i32> {
    let credentials = rustix::net::sockopt::socket_peercred(socket)?;
    Ok(credentials.pid.as_raw_nonzero().get())
}

/// A unix `SOCK_SEQPACKET` socket connected to `path` (which may be a symlink to the
/// socket), close-on-exec, blocking.
pub fn connect_seqpacket(path: &std::path::Path) -> io::Result<OwnedFd> {
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    let socket = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )?;
    let address = SocketAddrUnix::new(path)?;
    loop {
        match rustix::net::connect(&socket, &address) {
            Ok(()) => return Ok(socket),
            Err(rustix::io::Errno::INTR) => continue,
            Err(error) => return Err(error.into()),
        }
    }
}

/// Receives one message on a `SOCK_SEQPACKET` socket, waiting for it (`recv_with_fds`
/// otherwise), up to `timeout`.
pub fn recv_with_fds_waiting(
    socket: BorrowedFd<'_>,
    buffer: &mut [u8],
    timeout: std::time::Duration,
) -> io::Result<Received> {
    let mut fds = [PollFd::new(&socket, PollFlags::IN)];
    if poll(&mut fds, timeout)? == 0 {
        return Err(errno(libc::ETIMEDOUT));
    }
    recv_with_fds(socket, buffer)
}

/// Whether process `pid` exists (kill(2) with signal 0; a zombie does).
pub fn process_exists(pid: i32) -> bool {
    rustix::process::Pid::from_raw(pid).is_some_and(|pid| {
        !matches!(
            rustix::process::test_kill_process(pid),
            Err(rustix::io::Errno::SRCH)
        )
    })
}

/// symlink(2): `link` made to lead to `target`; EEXIST if `link` exists.
pub fn symlink(target: &std::path::Path, link: &std::path::Path) -> io::Result<()> {
    Ok(rustix::fs::symlink(target, link)?)
}

/// unlink(2).
pub fn unlink(path: &std::path::Path) -> io::Result<()> {
    Ok(rustix::fs::unlink(path)?)
}

/// The most descriptors `send_with_fds` sends with one message, and `recv_with_fds`
/// takes from one.
pub const MAX_SENT_FDS: usize = 4;

/// What `recv_with_fds` received.
pub enum Received {
    /// A message of this many bytes, with the descriptors it carried (close-on-exec).
    Message(usize, Vec<OwnedFd>),
    /// Nothing queued now.
    Empty,
    /// Every peer is gone and nothing is left to read.
    Closed,
}

/// Takes one message from a `SOCK_SEQPACKET` socket without blocking: its bytes into
/// `buffer` (a longer message is cut), its descriptors returned.
pub fn recv_with_fds(socket: BorrowedFd<'_>, buffer: &mut [u8]) -> io::Result<Received> {
    use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
    use std::mem::MaybeUninit;
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_SENT_FDS))];
    loop {
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let mut iov = [io::IoSliceMut::new(buffer)];
        let flags = RecvFlags::DONTWAIT | RecvFlags::CMSG_CLOEXEC;
        let received = match rustix::net::recvmsg(socket, &mut iov, &mut control, flags) {
            Ok(received) => received,
            Err(rustix::io::Errno::INTR) => continue,
            Err(rustix::io::Errno::AGAIN) => return Ok(Received::Empty),
            Err(error) => return Err(error.into()),
        };
        let mut fds = Vec::new();
        for message in control.drain() {
            if let RecvAncillaryMessage::ScmRights(rights) = message {
                fds.extend(rights);
            }
        }
        if received.bytes == 0 && fds.is_empty() {
            return Ok(Received::Closed);
        }
        return Ok(Received::Message(received.bytes.min(buffer.len()), fds));
    }
}

// ---------------------------------------------------------------------------------------
// Process and system

/// gettid(2).
pub fn gettid() -> i32 {
    rustix::thread::gettid().as_raw_pid()
}

/// `PIDFD_THREAD` (pidfd_open(2), Linux 6.9): the descriptor is of one thread, and polls
/// readable when that thread exits, not when its whole process does.
const PIDFD_THREAD: u32 = libc::O_EXCL as u32;

/// A pidfd of the calling thread (`PIDFD_THREAD`): it polls readable once this thread
/// has exited, whether alone, with its process, or because another thread exec'd.
pub fn own_thread_pidfd() -> io::Result<OwnedFd> {
    let tid = rustix::thread::gettid();
    let flags = rustix::process::PidfdFlags::from_bits_retain(PIDFD_THREAD);
    Ok(rustix::process::pidfd_open(tid, flags)?)
}

/// A pidfd of process `pid` (pidfd_open(2)): it polls readable once the process has
/// exited.
pub fn pidfd(pid: i32) -> io::Result<OwnedFd> {
    let pid = rustix::process::Pid::from_raw(pid).ok_or_else(|| errno(libc::EINVAL))?;
    Ok(rustix::process::pidfd_open(
        pid,
        rustix::process::PidfdFlags::empty(),
    )?)
}

/// Raises this process's soft limit of open descriptors to its hard limit.
pub fn raise_fd_limit() {
    use rustix::process::Resource;
    let limit = rustix::process::getrlimit(Resource::Nofile);
    if let Some(maximum) = limit.maximum {
        let raised = rustix::process::Rlimit {
            current: Some(maximum),
            maximum: Some(maximum),
        };
        let _ = rustix::process::setrlimit(Resource::Nofile, raised);
    }
}

/// getpid(2) from the kernel: right in any child, however it was made (fork, `_Fork`,
/// a raw clone), where a libc that caches the pid may not have updated it.
pub fn getpid() -> i32 {
    rustix::process::getpid().as_raw_pid()
}

/// Sets the calling thread's nice value (nice values are per thread on Linux) and
/// returns the one it has afterwards (the old one if the change was refused).
pub fn set_thread_nice(nice: i32) -> io::Result<i32> {
    // A refusal (EACCES without CAP_SYS_NICE) is answered by the value read back.
    let _ = rustix::process::setpriority_process(None, nice);
    Ok(rustix::process::getpriority_process(None)?)
}

/// Registers fork handlers with libc (pthread_atfork(3)): not a system call, but the
/// only way to run code around a libc `fork` in the forking process.
pub fn at_fork(
    prepare: extern "C" fn(),
    parent: extern "C" fn(),
    child: extern "C" fn(),
) -> io::Result<()> {
    // SAFETY: registers three plain extern "C" functions taking no arguments, which live
    // as long as the program (the library is never unloaded while a pager runs).
    let rc = unsafe { libc::pthread_atfork(Some(prepare), Some(parent), Some(child)) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::from_raw_os_error(rc))
    }
}

/// Physical RAM of this machine in bytes (0 if unknown), from sysinfo(2), as glibc's
/// `sysconf(_SC_PHYS_PAGES)` computes it.
pub fn physical_ram() -> u64 {
    let info = rustix::system::sysinfo();
    info.totalram as u64 * u64::from(info.mem_unit.max(1))
}
