//! The userfaultfd ioctls the `userfaultfd` crate lacks (ioctl_userfaultfd(2)):
//! UFFDIO_POISON, UFFDIO_CONTINUE with the kernel's progress field, UFFDIO_WAKE, and
//! UFFDIO_WRITEPROTECT as the one sign that the address space a userfaultfd serves is
//! gone. The structs are those of include/uapi/linux/userfaultfd.h.

use std::io;
use std::os::fd::BorrowedFd;

use rustix::ioctl::{opcode, Opcode, Updater};

use super::memory::page_size;

/// `struct uffdio_range`.
#[repr(C)]
struct UffdioRange {
    start: u64,
    len: u64,
}

impl UffdioRange {
    fn new(start: usize, len: usize) -> Self {
        Self {
            start: start as u64,
            len: len as u64,
        }
    }
}

/// `struct uffdio_poison`.
#[repr(C)]
struct UffdioPoison {
    range: UffdioRange,
    mode: u64,
    updated: i64,
}

const UFFDIO_POISON: Opcode = opcode::read_write::<UffdioPoison>(0xAA, 0x08);

/// UFFDIO_POISON (Linux 6.6) on `[start, start + len)` of a range registered on `uffd`.
/// Returns the outcome and the kernel's `updated` field (bytes done, or a negated errno
/// when none were).
pub fn uffdio_poison(uffd: BorrowedFd<'_>, start: usize, len: usize) -> (io::Result<()>, i64) {
    let mut arg = UffdioPoison {
        range: UffdioRange::new(start, len),
        mode: 0,
        updated: 0,
    };
    // SAFETY: UFFDIO_POISON reads and writes one `struct uffdio_poison`, which `arg` is,
    // live and correctly laid out for the call. The ioctl changes page tables of a range
    // registered with this uffd only; it never writes user memory.
    let result = unsafe {
        rustix::ioctl::ioctl(uffd, Updater::<UFFDIO_POISON, UffdioPoison>::new(&mut arg))
    };
    (result.map_err(io::Error::from), arg.updated)
}

/// `struct uffdio_continue`.
#[repr(C)]
struct UffdioContinue {
    range: UffdioRange,
    mode: u64,
    mapped: i64,
}

const UFFDIO_CONTINUE: Opcode = opcode::read_write::<UffdioContinue>(0xAA, 0x07);

/// UFFDIO_CONTINUE on `[start, start + len)` of a range registered on `uffd` for minor
/// faults: maps the pages the shared-memory file behind the range already holds into
/// the address space `uffd` serves, and wakes the threads waiting there. Returns the
/// outcome and the kernel's `mapped` field (bytes done, or a negated errno when none
/// were).
pub fn uffdio_continue(uffd: BorrowedFd<'_>, start: usize, len: usize) -> (io::Result<()>, i64) {
    let mut arg = UffdioContinue {
        range: UffdioRange::new(start, len),
        mode: 0,
        mapped: 0,
    };
    // SAFETY: UFFDIO_CONTINUE reads and writes one `struct uffdio_continue`, which `arg`
    // is. It maps pages the file already holds into a range registered with this uffd;
    // it never writes user memory.
    let result = unsafe {
        rustix::ioctl::ioctl(
            uffd,
            Updater::<UFFDIO_CONTINUE, UffdioContinue>::new(&mut arg),
        )
    };
    (result.map_err(io::Error::from), arg.mapped)
}

const UFFDIO_WAKE: Opcode = opcode::read::<UffdioRange>(0xAA, 0x02);

/// UFFDIO_WAKE: wakes the threads waiting on faults in `[start, start + len)`.
pub fn uffdio_wake(uffd: BorrowedFd<'_>, start: usize, len: usize) -> io::Result<()> {
    let mut range = UffdioRange::new(start, len);
    // SAFETY: UFFDIO_WAKE reads one `struct uffdio_range`, which `range` is; it changes
    // no memory.
    unsafe { rustix::ioctl::ioctl(uffd, Updater::<UFFDIO_WAKE, UffdioRange>::new(&mut range)) }
        .map_err(io::Error::from)
}

/// `struct uffdio_writeprotect`.
#[repr(C)]
struct UffdioWriteprotect {
    range: UffdioRange,
    mode: u64,
}

const UFFDIO_WRITEPROTECT: Opcode = opcode::read_write::<UffdioWriteprotect>(0xAA, 0x06);

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
        range: UffdioRange::new(addr, page_size() as usize),
        // Neither MODE_WP nor MODE_DONTWAKE: un-protect, which on a range without write
        // protection is refused before it changes anything.
        mode: 0,
    };
    // SAFETY: UFFDIO_WRITEPROTECT reads one `struct uffdio_writeprotect`, which `arg`
    // is; on ranges not registered for write protection it changes nothing.
    let result = unsafe {
        rustix::ioctl::ioctl(
            uffd,
            Updater::<UFFDIO_WRITEPROTECT, UffdioWriteprotect>::new(&mut arg),
        )
    };
    !matches!(result, Err(rustix::io::Errno::SRCH))
}

#[cfg(test)]
mod tests {
    use std::os::fd::{AsFd, FromRawFd, OwnedFd};
    use std::time::Duration;

    use ::userfaultfd::{FeatureFlags, RegisterMode, Uffd, UffdBuilder};

    use super::*;
    use crate::sys::test_child;
    use crate::sys::{files, memory, sockets, syscall_result};
    use crate::uffd_ext::{FEATURE_MINOR_SHMEM, FEATURE_POISON};

    /// A userfaultfd with `features`, or None where the environment refuses it (no
    /// permission, or a kernel without the features): that is no bug of ours.
    fn new_uffd(features: u64) -> Option<Uffd> {
        let created = UffdBuilder::new()
            .close_on_exec(true)
            .non_blocking(true)
            .user_mode_only(false)
            .require_features(FeatureFlags::from_bits_retain(features))
            .create();
        match created {
            Ok(uffd) => Some(uffd),
            Err(::userfaultfd::Error::SystemError(errno))
                if matches!(errno as i32, libc::EPERM | libc::EINVAL) =>
            {
                eprintln!("userfaultfd with features {features:#x} refused here: {errno}");
                None
            }
            Err(error) => panic!("userfaultfd: {error}"),
        }
    }

    /// A private anonymous read-write mapping of `pages` pages.
    fn anonymous(pages: usize) -> (usize, usize) {
        let len = pages * page_size() as usize;
        let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
        let prot = libc::PROT_READ | libc::PROT_WRITE;
        // SAFETY: a new mapping at an address the kernel picks replaces nothing.
        let addr = unsafe { memory::mmap(0, len, prot, flags, None, 0) }.unwrap();
        (addr, len)
    }

    #[test]
    fn poison_marks_missing_pages_once() {
        let Some(uffd) = new_uffd(FEATURE_POISON) else {
            return;
        };
        let page = page_size() as usize;
        let (addr, len) = anonymous(2);
        uffd.register(addr as *mut libc::c_void, len).unwrap();
        let (result, updated) = uffdio_poison(uffd.as_fd(), addr, page);
        result.unwrap();
        assert_eq!(updated, page as i64);
        // The page holds a poison marker now: a second poisoning finds it there.
        let (result, updated) = uffdio_poison(uffd.as_fd(), addr, page);
        assert_eq!(result.unwrap_err().raw_os_error(), Some(libc::EEXIST));
        assert_eq!(updated, -i64::from(libc::EEXIST));
        drop(uffd);
        // SAFETY: nothing refers to the mapping (the poisoned page was never touched).
        unsafe { memory::munmap(addr, len) }.unwrap();
    }

    #[test]
    fn continue_maps_the_page_the_file_holds_and_only_that() {
        let Some(uffd) = new_uffd(FEATURE_MINOR_SHMEM) else {
            return;
        };
        let page = page_size() as usize;
        let file = files::memfd(c"uffd-continue", 2 * page as u64).unwrap();
        let addr = memory::map_shared_inaccessible(file.as_fd(), 2 * page).unwrap();
        // SAFETY: our own fresh mapping, which nothing reads yet.
        unsafe { memory::mprotect(addr, 2 * page, libc::PROT_READ | libc::PROT_WRITE) }.unwrap();
        let start = addr as *mut libc::c_void;
        uffd.register_with_mode(start, 2 * page, RegisterMode::MINOR)
            .unwrap();
        assert_eq!(files::pwrite(file.as_fd(), b"minor", 0).unwrap(), 5);

        let (result, mapped) = uffdio_continue(uffd.as_fd(), addr, page);
        result.unwrap();
        assert_eq!(mapped, page as i64);
        // SAFETY: the page is mapped now, and readable.
        let seen = unsafe { std::slice::from_raw_parts(addr as *const u8, 5) };
        assert_eq!(seen, b"minor");

        let (result, mapped) = uffdio_continue(uffd.as_fd(), addr, page);
        assert_eq!(result.unwrap_err().raw_os_error(), Some(libc::EEXIST));
        assert_eq!(mapped, -i64::from(libc::EEXIST));
        // The second page is a hole of the file: nothing to map.
        let (result, _) = uffdio_continue(uffd.as_fd(), addr + page, page);
        assert_eq!(result.unwrap_err().raw_os_error(), Some(libc::EFAULT));
        drop(uffd);
        // SAFETY: nothing refers to the mapping any more.
        unsafe { memory::munmap(addr, 2 * page) }.unwrap();
    }

    #[test]
    fn wake_checks_its_range_and_wakes_nobody_gladly() {
        let Some(uffd) = new_uffd(0) else {
            return;
        };
        let (addr, len) = anonymous(1);
        uffd.register(addr as *mut libc::c_void, len).unwrap();
        uffdio_wake(uffd.as_fd(), addr, len).unwrap();
        let error = uffdio_wake(uffd.as_fd(), addr + 1, len).unwrap_err();
        assert_eq!(error.raw_os_error(), Some(libc::EINVAL));
        assert!(uffd_process_alive(uffd.as_fd(), addr));
        drop(uffd);
        // SAFETY: nothing refers to the mapping any more.
        unsafe { memory::munmap(addr, len) }.unwrap();
    }

    /// `struct uffdio_api`, for a userfaultfd made without the `userfaultfd` crate.
    #[repr(C)]
    struct UffdioApi {
        api: u64,
        features: u64,
        ioctls: u64,
    }

    const UFFDIO_API: Opcode = opcode::read_write::<UffdioApi>(0xAA, 0x3F);

    /// A userfaultfd of this process by direct system calls (userfaultfd(2) and the
    /// UFFDIO_API handshake), allocating nothing: usable in `test_child`'s children.
    fn raw_uffd() -> io::Result<OwnedFd> {
        // SAFETY: creates a descriptor and changes no memory.
        let fd = syscall_result(unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC) })?;
        // SAFETY: the descriptor was just made, and nothing else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        let mut api = UffdioApi {
            api: 0xAA,
            features: 0,
            ioctls: 0,
        };
        // SAFETY: UFFDIO_API reads and writes one `struct uffdio_api`, which `api` is.
        unsafe { rustix::ioctl::ioctl(&fd, Updater::<UFFDIO_API, UffdioApi>::new(&mut api)) }?;
        Ok(fd)
    }

    #[test]
    fn a_userfaultfd_of_a_process_that_exited_says_so() {
        let Ok(own) = raw_uffd() else {
            eprintln!("userfaultfd refused here: {:?}", raw_uffd().err());
            return;
        };
        let addr = page_size() as usize * 16;
        assert!(uffd_process_alive(own.as_fd(), addr));
        let (here, there) = sockets::seqpacket_pair().unwrap();
        // SAFETY: the child makes direct system calls only and allocates nothing.
        let child = unsafe {
            test_child::spawn(|| match raw_uffd() {
                Ok(uffd) => sockets::send_with_fds(there.as_fd(), b"uffd", &[uffd.as_fd()])
                    .map_or(2, |()| 0),
                Err(_) => 1,
            })
        };
        let mut buffer = [0u8; 8];
        let received =
            sockets::recv_with_fds_waiting(here.as_fd(), &mut buffer, Duration::from_secs(10));
        assert_eq!(test_child::wait(child), 0);
        let Ok(sockets::Received::Message(4, mut fds)) = received else {
            panic!("the child's userfaultfd: {received:?}");
        };
        let theirs = fds.pop().unwrap();
        assert!(!uffd_process_alive(theirs.as_fd(), addr));
        assert!(uffd_process_alive(own.as_fd(), addr), "ours is alive still");
    }
}
