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
//! Descriptors are owned (`OwnedFd`) or borrowed (`BorrowedFd`) everywhere; a raw number
//! is taken only where it is a number and not yet a descriptor (`files::is_open`). The
//! shim turns the numbers a program passes into borrows at its C ABI edge.
//!
//! One error convention: `io::Result`, with the kernel's errno inside
//! (`io::Error::raw_os_error`). The shim turns it into errno at its C ABI edge.
//!
//! One module per topic:
//! - `memory`: mappings, their protection and advice, locking, residency, page sizes;
//! - `userfaultfd`: the userfaultfd ioctls the `userfaultfd` crate lacks;
//! - `files`: opening, reading and writing files, their holes, mounts, links, and the
//!   descriptors made to be polled (eventfd, `poll`);
//! - `sockets`: the unix `SOCK_SEQPACKET` sockets that carry descriptors;
//! - `processes`: processes and threads: ids, pidfds, limits, priority, fork handlers.

use std::io;

pub mod files;
pub mod memory;
pub mod processes;
pub mod sockets;
pub mod userfaultfd;

#[cfg(test)]
mod test_child;

/// The error the kernel would give as `code`.
fn errno(code: rustix::io::Errno) -> io::Error {
    io::Error::from(code)
}

/// The result of a raw `libc::syscall` that returns 0 or more on success and -1 with
/// errno on failure.
fn syscall_result(rc: libc::c_long) -> io::Result<libc::c_long> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}
