//! Files and the descriptors that stand for them: opening (paths, memfds, unnamed tmpfs
//! files, detached tmpfs mounts), reading and writing at offsets, the holes of sparse
//! files and punching new ones, stat, advice, locks, links; with the eventfd and
//! `poll` that the pager's threads wait on.

use std::ffi::CStr;
use std::io;
use std::num::NonZeroU64;
use std::ops::Range;
use std::os::fd::{BorrowedFd, OwnedFd, RawFd};
use std::path::Path;
use std::time::Duration;

use rustix::fs::{FallocateFlags, Mode, OFlags, SeekFrom};
use rustix::io::Errno;
use rustix::mount::{FsMountFlags, FsOpenFlags, MountAttrFlags};

use super::{errno, syscall_result};

pub use rustix::event::{PollFd, PollFlags};
pub use rustix::fs::Stat;
/// The working directory, as a directory to open paths relative to (`AT_FDCWD`).
pub use rustix::fs::CWD;

/// Whether the number `fd` is an open descriptor of this process (fcntl(2) F_GETFD).
/// The one function here taking a raw number: a number handed over by a launcher or a
/// program may no longer be open, and a `BorrowedFd` promises it is; callers ask this
/// before they borrow it. A raw syscall for that reason: rustix's fcntl takes a borrow.
pub fn is_open(fd: RawFd) -> bool {
    // SAFETY: F_GETFD reads the descriptor's flags and changes nothing; a number that is
    // not open is EBADF.
    syscall_result(unsafe { libc::syscall(libc::SYS_fcntl, fd, libc::F_GETFD) }).is_ok()
}

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

/// openat(2) as a C caller makes it: relative to directory `dir` (`CWD` for the working
/// directory), the flags and mode bit for bit. The mode reaches the kernel only where
/// the flags create a file (as libc passes it).
pub fn openat(dir: BorrowedFd<'_>, path: &CStr, flags: i32, mode: u32) -> io::Result<OwnedFd> {
    let flags = OFlags::from_bits_retain(flags as u32);
    let mode = if flags.intersects(OFlags::CREATE | OFlags::TMPFILE) {
        Mode::from_bits_retain(mode)
    } else {
        Mode::empty()
    };
    Ok(rustix::fs::openat(dir, path, flags, mode)?)
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

/// A close-on-exec duplicate of `fd` (fcntl(2) F_DUPFD_CLOEXEC), at 3 or above.
pub fn dup_cloexec(fd: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    Ok(rustix::io::fcntl_dupfd_cloexec(fd, 3)?)
}

/// poll(2): waits up to `timeout` for one of `fds` to be ready and returns how many
/// are (their `revents` say how). Interrupted by a signal, none are.
pub fn poll(fds: &mut [PollFd<'_>], timeout: Duration) -> io::Result<usize> {
    let timeout = rustix::event::Timespec {
        tv_sec: timeout.as_secs() as i64,
        tv_nsec: timeout.subsec_nanos() as i64,
    };
    match rustix::event::poll(fds, Some(&timeout)) {
        Ok(ready) => Ok(ready),
        Err(Errno::INTR) => Ok(0),
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
            Err(Errno::INTR) => continue,
            Err(_) => return,
        }
    }
}

/// The holes of the first `len` bytes of `fd` (lseek(2) SEEK_DATA/SEEK_HOLE), as
/// ranges of offsets, ascending. A file system without hole tracking reports none: one
/// data extent up to its size.
pub fn holes(fd: BorrowedFd<'_>, len: u64) -> io::Result<Vec<Range<u64>>> {
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
            Err(Errno::NXIO) => len,
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
    match rustix::fs::seek(fd, SeekFrom::Hole(at)) {
        Ok(hole) => Ok(hole == at),
        Err(Errno::NXIO) => Ok(false),
        Err(error) => Err(error.into()),
    }
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

/// fstat(2).
pub fn fstat(fd: BorrowedFd<'_>) -> io::Result<Stat> {
    Ok(rustix::fs::fstat(fd)?)
}

/// posix_fadvise(2) with the advice number a C caller passes. Offset and length reach
/// the kernel bit for bit (it judges negative ones itself). The numbers are libc's:
/// rustix's `Advice` is a closed enum with no conversion from one.
pub fn fadvise(fd: BorrowedFd<'_>, offset: i64, len: i64, advice: i32) -> io::Result<()> {
    use rustix::fs::Advice as F;
    let advice = match advice {
        libc::POSIX_FADV_NORMAL => F::Normal,
        libc::POSIX_FADV_SEQUENTIAL => F::Sequential,
        libc::POSIX_FADV_RANDOM => F::Random,
        libc::POSIX_FADV_NOREUSE => F::NoReuse,
        libc::POSIX_FADV_WILLNEED => F::WillNeed,
        libc::POSIX_FADV_DONTNEED => F::DontNeed,
        // The kernel refuses advice it does not know with EINVAL too.
        _ => return Err(errno(Errno::INVAL)),
    };
    let len = NonZeroU64::new(len as u64);
    Ok(rustix::fs::fadvise(fd, offset as u64, len, advice)?)
}

/// Takes an exclusive `flock` on `fd` without waiting: false when another open file
/// description holds one (the remote cache tier's one-mount-per-directory lock).
pub fn try_lock_exclusive(fd: BorrowedFd<'_>) -> io::Result<bool> {
    match rustix::fs::flock(fd, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => Ok(true),
        Err(Errno::WOULDBLOCK) => Ok(false),
        Err(error) => Err(error.into()),
    }
}

/// readlink(2) of `path` into `buffer`; returns the bytes written (possibly truncated:
/// a result filling the buffer may be cut short).
pub fn readlink<'b>(path: &CStr, buffer: &'b mut [u8]) -> io::Result<&'b [u8]> {
    let len = rustix::fs::readlinkat_raw(CWD, path, &mut *buffer)?;
    Ok(&buffer[..len])
}

/// symlink(2): `link` made to lead to `target`; EEXIST if `link` exists.
pub fn symlink(target: &Path, link: &Path) -> io::Result<()> {
    Ok(rustix::fs::symlink(target, link)?)
}

/// unlink(2).
pub fn unlink(path: &Path) -> io::Result<()> {
    Ok(rustix::fs::unlink(path)?)
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

/// Detaches the mount at `path` (`umount -l`): it is gone from the tree at once, and
/// ends when the last file open in it is closed.
pub fn unmount_lazy(path: &Path) -> io::Result<()> {
    Ok(rustix::mount::unmount(
        path,
        rustix::mount::UnmountFlags::DETACH,
    )?)
}
