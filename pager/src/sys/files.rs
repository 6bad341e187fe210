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

#[cfg(test)]
mod tests {
    use std::ffi::CString;
    use std::os::fd::{AsFd, AsRawFd};
    use std::os::unix::ffi::OsStrExt;
    use std::path::PathBuf;

    use super::*;
    use crate::sys::memory::page_size;

    /// A directory of this test's own, removed with what it holds when dropped.
    struct TestDir(PathBuf);

    impl TestDir {
        fn new(name: &str) -> Self {
            let pid = std::process::id();
            let dir = std::env::temp_dir().join(format!("hyperoffload-sys-{pid}-{name}"));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir(&dir).unwrap();
            Self(dir)
        }

        fn path(&self, name: &str) -> CString {
            CString::new(self.0.join(name).as_os_str().as_bytes()).unwrap()
        }
    }

    impl Drop for TestDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn same_file(a: BorrowedFd<'_>, b: BorrowedFd<'_>) -> bool {
        let (a, b) = (fstat(a).unwrap(), fstat(b).unwrap());
        (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
    }

    #[test]
    fn a_memfd_is_all_holes_until_written_and_again_once_punched() {
        let page = page_size();
        let file = memfd(c"files-test", 4 * page).unwrap();
        let fd = file.as_fd();
        assert_eq!(fstat(fd).unwrap().st_size as u64, 4 * page);
        assert_eq!(holes(fd, 4 * page).unwrap(), vec![0..4 * page]);
        assert_eq!(pwrite(fd, b"data", page + 10).unwrap(), 4);
        assert_eq!(
            holes(fd, 4 * page).unwrap(),
            vec![0..page, 2 * page..4 * page]
        );
        assert!(is_hole(fd, 0).unwrap());
        assert!(!is_hole(fd, page).unwrap());
        assert!(!is_hole(fd, 8 * page).unwrap(), "past the end");
        // Only the first `len` bytes are asked about.
        assert_eq!(holes(fd, page).unwrap(), vec![0..page]);
        let mut buffer = [0u8; 6];
        assert_eq!(pread(fd, &mut buffer, page + 8).unwrap(), 6);
        assert_eq!(&buffer, b"\0\0data");

        punch_hole(fd, page, page).unwrap();
        assert_eq!(holes(fd, 4 * page).unwrap(), vec![0..4 * page]);
        assert_eq!(
            fstat(fd).unwrap().st_size as u64,
            4 * page,
            "the size is kept"
        );
        assert_eq!(pread(fd, &mut buffer, page + 8).unwrap(), 6);
        assert_eq!(buffer, [0; 6]);
    }

    #[test]
    fn openat_creates_with_the_mode_and_refuses_what_the_kernel_refuses() {
        let dir = TestDir::new("openat");
        let dir_fd = open_read(&dir.path("")).unwrap();
        let flags = libc::O_CREAT | libc::O_EXCL | libc::O_RDWR | libc::O_CLOEXEC;
        let file = openat(dir_fd.as_fd(), c"made", flags, 0o600).unwrap();
        assert_eq!(fstat(file.as_fd()).unwrap().st_mode & 0o777, 0o600);
        let again = openat(dir_fd.as_fd(), c"made", flags, 0o600).unwrap_err();
        assert_eq!(again.kind(), io::ErrorKind::AlreadyExists);
        let missing = openat(CWD, &dir.path("missing"), libc::O_RDONLY, 0).unwrap_err();
        assert_eq!(missing.kind(), io::ErrorKind::NotFound);
        // The same file by its full path, from the working directory.
        let by_path = openat(CWD, &dir.path("made"), libc::O_RDONLY, 0).unwrap();
        assert!(same_file(file.as_fd(), by_path.as_fd()));
    }

    #[test]
    fn writes_reach_the_file_and_reads_come_back() {
        let dir = TestDir::new("write");
        let path = dir.path("file");
        std::fs::write(dir.0.join("file"), b"").unwrap();
        let writer = open_write(&path).unwrap();
        assert_eq!(write(writer.as_fd(), b"hello").unwrap(), 5);
        let reader = open_read(&path).unwrap();
        let mut buffer = [0u8; 16];
        assert_eq!(read(reader.as_fd(), &mut buffer).unwrap(), 5);
        assert_eq!(&buffer[..5], b"hello");
        assert_eq!(read(reader.as_fd(), &mut buffer).unwrap(), 0, "at the end");
        let error = write(reader.as_fd(), b"x").unwrap_err();
        assert_eq!(
            error.raw_os_error(),
            Some(libc::EBADF),
            "opened for reading"
        );
        let both = open_read_write_nonblock(&path).unwrap();
        assert_eq!(pwrite(both.as_fd(), b"J", 0).unwrap(), 1);
        assert_eq!(pread(reader.as_fd(), &mut buffer[..5], 0).unwrap(), 5);
        assert_eq!(&buffer[..5], b"Jello");
    }

    #[test]
    fn a_duplicate_is_the_same_file_closed_on_exec_and_open_until_dropped() {
        let file = memfd(c"dup-test", 0).unwrap();
        let copy = dup_cloexec(file.as_fd()).unwrap();
        assert!(copy.as_raw_fd() >= 3);
        assert_ne!(copy.as_raw_fd(), file.as_raw_fd());
        assert!(same_file(file.as_fd(), copy.as_fd()));
        let flags = rustix::io::fcntl_getfd(&copy).unwrap();
        assert!(flags.contains(rustix::io::FdFlags::CLOEXEC));
        assert!(is_open(copy.as_raw_fd()));
        // Numbers no descriptor has (a closed one may be reused by another test at once).
        assert!(!is_open(-1));
        assert!(!is_open(1 << 30));
    }

    #[test]
    fn fadvise_takes_the_posix_numbers_only() {
        let dir = TestDir::new("fadvise");
        std::fs::write(dir.0.join("file"), [1u8; 8192]).unwrap();
        let file = open_read(&dir.path("file")).unwrap();
        fadvise(file.as_fd(), 0, 0, libc::POSIX_FADV_WILLNEED).unwrap();
        fadvise(file.as_fd(), 0, 4096, libc::POSIX_FADV_DONTNEED).unwrap();
        let error = fadvise(file.as_fd(), 0, 0, 99).unwrap_err();
        assert_eq!(error.raw_os_error(), Some(libc::EINVAL));
        let (read_end, _write_end) = rustix::pipe::pipe().unwrap();
        let error = fadvise(read_end.as_fd(), 0, 0, libc::POSIX_FADV_NORMAL).unwrap_err();
        assert_eq!(error.raw_os_error(), Some(libc::ESPIPE), "not on a pipe");
    }

    #[test]
    fn an_eventfd_counts_and_polls_readable_while_it_is_not_zero() {
        let event = eventfd().unwrap();
        let mut fds = [PollFd::new(&event, PollFlags::IN)];
        assert_eq!(poll(&mut fds, Duration::from_millis(1)).unwrap(), 0);
        assert_eq!(write(event.as_fd(), &2u64.to_ne_bytes()).unwrap(), 8);
        assert_eq!(write(event.as_fd(), &3u64.to_ne_bytes()).unwrap(), 8);
        let mut fds = [PollFd::new(&event, PollFlags::IN)];
        assert_eq!(poll(&mut fds, Duration::from_secs(10)).unwrap(), 1);
        assert!(fds[0].revents().contains(PollFlags::IN));
        let mut counter = [0u8; 8];
        assert_eq!(read(event.as_fd(), &mut counter).unwrap(), 8);
        assert_eq!(u64::from_ne_bytes(counter), 5);
        let error = read(event.as_fd(), &mut counter).unwrap_err();
        assert_eq!(
            error.kind(),
            io::ErrorKind::WouldBlock,
            "non-blocking, at zero"
        );
    }

    #[test]
    fn an_exclusive_lock_is_refused_to_a_second_open_file_description() {
        let dir = TestDir::new("lock");
        std::fs::write(dir.0.join("lock"), b"").unwrap();
        let first = open_read(&dir.path("lock")).unwrap();
        let second = open_read(&dir.path("lock")).unwrap();
        assert!(try_lock_exclusive(first.as_fd()).unwrap());
        assert!(
            try_lock_exclusive(first.as_fd()).unwrap(),
            "held by this one already"
        );
        assert!(!try_lock_exclusive(second.as_fd()).unwrap());
        drop(first);
        assert!(try_lock_exclusive(second.as_fd()).unwrap());
    }

    #[test]
    fn links_lead_to_their_target_and_are_made_once() {
        let dir = TestDir::new("links");
        let link = dir.0.join("link");
        symlink(Path::new("target-name"), &link).unwrap();
        let error = symlink(Path::new("other"), &link).unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::AlreadyExists);
        let mut buffer = [0u8; 64];
        assert_eq!(
            readlink(&dir.path("link"), &mut buffer).unwrap(),
            b"target-name"
        );
        let mut short = [0u8; 6];
        assert_eq!(readlink(&dir.path("link"), &mut short).unwrap(), b"target");
        unlink(&link).unwrap();
        assert_eq!(unlink(&link).unwrap_err().kind(), io::ErrorKind::NotFound);
    }

    #[test]
    fn a_detached_tmpfs_holds_unnamed_files() {
        let mount = match mount_tmpfs(&[(c"size", c"4m"), (c"mode", c"0700")]) {
            Ok(mount) => mount,
            // No CAP_SYS_ADMIN (EPERM) or a kernel before 5.2 (ENOSYS): the environment.
            Err(error) if matches!(error.raw_os_error(), Some(libc::EPERM | libc::ENOSYS)) => {
                eprintln!("no tmpfs mount here: {error}");
                return;
            }
            Err(error) => panic!("mount_tmpfs: {error}"),
        };
        let page = page_size();
        let file = create_tmpfile(mount.as_fd(), 2 * page).unwrap();
        assert_eq!(fstat(file.as_fd()).unwrap().st_size as u64, 2 * page);
        assert_eq!(holes(file.as_fd(), 2 * page).unwrap(), vec![0..2 * page]);
        assert_eq!(pwrite(file.as_fd(), b"x", 0).unwrap(), 1);
        assert_eq!(holes(file.as_fd(), 2 * page).unwrap(), vec![page..2 * page]);
        let error = mount_tmpfs(&[(c"no-such-option", c"1")]).unwrap_err();
        assert_eq!(error.raw_os_error(), Some(libc::EINVAL));
    }

    #[test]
    fn unmounting_what_is_no_mount_point_is_refused() {
        let dir = TestDir::new("unmount");
        let error = unmount_lazy(&dir.0).unwrap_err();
        assert_eq!(error.raw_os_error(), Some(libc::EINVAL));
    }
}
