//! userfaultfd ioctls the `userfaultfd` crate lacks: `UFFDIO_POISON` (Linux 6.6); see
//! ioctl_userfaultfd(2).
//!
//! The ioctl itself is issued by the OS layer (`crate::sys`).

use std::os::fd::BorrowedFd;

use rustix::io::Errno;

/// `UFFD_FEATURE_POISON`: lets `UFFDIO_POISON` be used on the registered ranges.
pub const FEATURE_POISON: u64 = 1 << 14;

/// `UFFD_FEATURE_EXACT_ADDRESS` (Linux 5.18): fault events carry the faulting byte's
/// address, not its page's. Where slices of two experts share a page, the byte says
/// whose slice the program was reading.
pub const FEATURE_EXACT_ADDRESS: u64 = 1 << 11;

/// `UFFD_FEATURE_MINOR_SHMEM`: minor-fault mode (and UFFDIO_CONTINUE) on shmem ranges.
pub const FEATURE_MINOR_SHMEM: u64 = 1 << 10;

/// Outcome of an ioctl that may stop part way.
#[derive(Debug, PartialEq, Eq)]
pub enum Partial {
    /// The whole range was done.
    Done,
    /// `done` bytes were done before `errno` stopped it (`EAGAIN`: the address space
    /// changed or a page in the range already existed; `EEXIST`: the first page did).
    Stopped { done: u64, errno: Errno },
}

/// Marks `[start, start + len)` of a registered range as poisoned: any access raises
/// SIGBUS, as a read error on a file mapping does. Wakes the faulting threads.
///
/// The range must be page aligned and inside a range registered on `uffd`; pages that
/// are already present are left as they are (`EEXIST`).
pub fn poison(uffd: BorrowedFd<'_>, start: usize, len: usize) -> Partial {
    let (result, updated) = crate::sys::userfaultfd::uffdio_poison(uffd, start, len);
    partial(result, updated, len)
}

/// Maps `[start, start + len)` (page aligned, in a range registered on `uffd` for minor
/// faults) from the shared-memory file behind it (UFFDIO_CONTINUE), which wakes the
/// threads waiting there. The caller guarantees the file's pages there hold their
/// bytes. One call does the range when it can; after a refusal, the page that stopped
/// it alone, which is passed over and woken if it is refused too: already mapped
/// (EEXIST), not mapped in this address space (ENOENT: the range spans a page the
/// process unmapped, or several mappings), the address space changing under a fork
/// (EAGAIN), or no page in the file (EFAULT: punched since). A thread woken there finds
/// its page or faults again and is served then. (On a range registered for missing
/// faults only the kernel maps the page all the same.) Returns the bytes mapped.
pub fn continue_or_wake(uffd: BorrowedFd<'_>, start: usize, len: usize, page: usize) -> u64 {
    let mut done = 0usize;
    let mut mapped = 0u64;
    // After a refusal, one page alone (the one that stopped it), then the rest at once.
    let mut single_until = 0usize;
    while done < len {
        let chunk = if done < single_until {
            page
        } else {
            len - done
        };
        let (result, field) = crate::sys::userfaultfd::uffdio_continue(uffd, start + done, chunk);
        match partial(result, field, chunk) {
            Partial::Done => {
                done += chunk;
                mapped += chunk as u64;
            }
            // Part done (the kernel then says EAGAIN, whatever stopped it): the page that
            // stopped it alone next.
            Partial::Stopped { done: part, .. } if part > 0 => {
                done += part as usize;
                mapped += part;
                single_until = done + page;
            }
            Partial::Stopped {
                errno: Errno::SRCH, ..
            } => return mapped,
            // The refusal may be of the whole range (ENOENT: it spans mappings).
            Partial::Stopped { .. } if chunk > page => single_until = done + page,
            // Passed over: woken (a thread waiting there finds the page mapped already,
            // or faults again and is served then).
            Partial::Stopped { .. } => {
                wake(uffd, start + done, page);
                done += page;
            }
        }
    }
    mapped
}

/// Maps the page at `addr` from the file behind it (UFFDIO_CONTINUE); whether the
/// fault there is answered: mapped now (by this call or before), or woken because the
/// address space is changing under a fork (EAGAIN: the thread faults again and is
/// served then). False: the file has no page there, or the range is not one the file
/// backs; nothing was woken.
pub fn continue_page(uffd: BorrowedFd<'_>, addr: usize, page: usize) -> bool {
    let (result, field) = crate::sys::userfaultfd::uffdio_continue(uffd, addr, page);
    match partial(result, field, page) {
        Partial::Done => true,
        Partial::Stopped {
            errno: Errno::EXIST,
            ..
        } => true,
        Partial::Stopped {
            errno: Errno::AGAIN,
            ..
        } => {
            wake(uffd, addr, page);
            true
        }
        Partial::Stopped { .. } => false,
    }
}

/// UFFDIO_WAKE of `[start, start + len)`; a failure means nobody waits there.
fn wake(uffd: BorrowedFd<'_>, start: usize, len: usize) {
    let _ = crate::sys::userfaultfd::uffdio_wake(uffd, start, len);
}

fn partial(result: std::io::Result<()>, done_field: i64, len: usize) -> Partial {
    match result {
        Ok(_) => Partial::Done,
        Err(error) => Partial::Stopped {
            // On failure the kernel stores the bytes done, or a negated errno when none.
            done: if done_field > 0 {
                (done_field as u64).min(len as u64)
            } else {
                0
            },
            errno: Errno::from_raw_os_error(error.raw_os_error().unwrap_or(0)),
        },
    }
}
