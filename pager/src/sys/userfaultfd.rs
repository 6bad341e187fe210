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
