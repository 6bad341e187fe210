//! The page-table operations: what changes the program's view of a region. A finished
//! read is copied in (`install`, UFFDIO_COPY, on the service thread or the install
//! workers), its frame mapped over the block (`map_frame`) or the block continued from
//! the region's file (`continue_mapped`); pages whose read failed are poisoned; pages of
//! evicted blocks are discarded or punched out of the region's file. Each function takes
//! only what it changes; `installs` and the other parts decide what to do where, and no
//! other code of the service changes page tables.

use std::ops::Range;
use std::os::fd::{AsFd, OwnedFd};

use rustix::io::Errno;
use userfaultfd::{RegisterMode, Uffd};

use super::region::ServedRegion;
use super::ServiceError;
use crate::shared_store::FrameStore;
use crate::uffd_ext::{self, Partial};

/// Why an install failed; the service cannot continue after one.
#[derive(Debug, thiserror::Error)]
pub(crate) enum InstallError {
    #[error("installing a block at {addr:#x} failed: {errno}")]
    Copy { addr: usize, errno: Errno },
    #[error("installing a block failed: {0}")]
    Other(String),
}

/// Copies `len` bytes from `source` into the region at `target` (page aligned), waking
/// the threads waiting there. Pages already present or no longer mapped are skipped.
///
/// UFFDIO_COPY rather than UFFDIO_MOVE: the kernel refuses to move pages into non-writable
/// mappings (`validate_move_areas`), and a region keeps the program's read-only
/// protection.
///
/// # Safety
/// `source..source + len` must be readable and not written until this returns; `target`
/// must lie in a range registered with `uffd` that stays so until this returns.
///
/// `on_busy` runs each time the kernel refuses with EAGAIN having copied nothing: with
/// fork events enabled that is a fork waiting for the service to read its event
/// (`children`), which the service thread must do before the copy can succeed.
pub(crate) unsafe fn install(
    uffd: &Uffd,
    source: *const u8,
    target: usize,
    len: usize,
    page: usize,
    on_busy: &mut dyn FnMut(),
) -> Result<(), InstallError> {
    let mut done = 0usize;
    // One call for the whole range; after a refusal, page by page until past the page
    // that stopped it.
    let mut page_by_page_until = 0usize;
    let mut stalls = 0u32;
    // A fork of a large process takes milliseconds; a million refusals, each after
    // reading events and yielding, are seconds.
    let mut busy = 0u32;
    while done < len {
        let chunk = if done < page_by_page_until {
            page
        } else {
            len - done
        };
        // SAFETY: the caller guarantees the source is readable and the target registered;
        // `done + chunk <= len`.
        let result = unsafe {
            uffd.copy(
                source.wrapping_add(done).cast(),
                (target + done) as *mut libc::c_void,
                chunk,
                true,
            )
        };
        let (copied, errno) = match result {
            Ok(n) => (n.max(page).min(len - done), None),
            Err(userfaultfd::Error::PartiallyCopied(n)) => (n, Some(Errno::AGAIN)),
            Err(userfaultfd::Error::CopyFailed(errno)) => {
                (0, Some(Errno::from_raw_os_error(errno as i32)))
            }
            Err(other) => return Err(InstallError::Other(format!("{other:?}"))),
        };
        done += copied;
        match errno {
            None => {}
            Some(_) if copied > 0 => page_by_page_until = done + page,
            // The first page exists (EEXIST) or is no longer mapped (ENOENT: the program
            // unmapped part of the region): skip it.
            Some(Errno::EXIST | Errno::NOENT) if chunk == page => done += page,
            // EAGAIN with nothing copied: the address space is changing (a fork whose
            // event is unread; otherwise it settles): go page by page.
            Some(Errno::AGAIN) if busy < 1_000_000 => {
                busy += 1;
                on_busy();
                page_by_page_until = done + page
            }
            Some(Errno::EXIST | Errno::NOENT | Errno::AGAIN) if stalls < 10_000 => {
                stalls += 1;
                page_by_page_until = done + page
            }
            // The process is exiting: nobody is left to wait for these pages.
            Some(Errno::SRCH) => return Ok(()),
            Some(errno) => {
                return Err(InstallError::Copy {
                    addr: target + done,
                    errno,
                })
            }
        }
    }
    Ok(())
}

/// Copies `source` into the part of `range` (region offsets) the program still maps.
///
/// # Safety
/// `source` must hold `range`'s bytes and not be written until this returns; the region
/// must stay registered meanwhile.
pub(super) unsafe fn install_mapped(
    uffd: &Uffd,
    region: &ServedRegion,
    source: *const u8,
    range: Range<u64>,
    page: usize,
    on_busy: &mut dyn FnMut(),
) -> Result<(), InstallError> {
    let target = region.base + range.start as usize;
    for part in region.mapped_parts(range) {
        // SAFETY: the part lies inside the range `source` holds, in a mapped part of a
        // registered region (the caller's guarantees).
        unsafe {
            install(
                uffd,
                source.wrapping_add(part.start - target),
                part.start,
                part.end - part.start,
                page,
                on_busy,
            )
        }?;
    }
    Ok(())
}

/// Maps block `index`'s frame over the parts of the block the program still maps,
/// populated, registers them for missing and minor faults, and wakes the threads
/// waiting there (the zero-copy install). A thread touching the block meanwhile sees
/// either the old mapping, which faults, or the new one, which holds the block's bytes:
/// the frame was filled before it is mapped.
pub(super) fn map_frame(
    uffd: &Uffd,
    store: &FrameStore,
    region: &ServedRegion,
    index: u32,
) -> Result<(), ServiceError> {
    let frame = region.frames[index as usize].expect("a block mapped from its frame has one");
    let memory = region.layout.block_memory(index);
    let target = region.base + memory.start as usize;
    let len = (memory.end - memory.start) as usize;
    let map_error = |addr: usize, error: std::io::Error| ServiceError::MapFrame { addr, error };
    for part in region.mapped_parts(memory) {
        let bytes = part.end - part.start;
        let offset = store.offset(frame) + (part.start - target) as u64;
        // SAFETY: replaces a part of a live region that the program still maps (the
        // service learns of every unmap before it happens) with the block's own bytes;
        // nothing but the program's reads reaches this range.
        unsafe {
            crate::sys::memory::mmap(
                part.start,
                bytes,
                region.prot,
                libc::MAP_SHARED | libc::MAP_FIXED | libc::MAP_POPULATE,
                Some(store.fd(frame)),
                offset as i64,
            )
        }
        .map_err(|error| map_error(part.start, error))?;
        // As for the reservation: a forked child must not see the range.
        // SAFETY: advises a mapping of the service's own; DONTFORK discards nothing.
        unsafe {
            crate::sys::memory::madvise(
                part.start,
                bytes,
                crate::sys::memory::Advice::LinuxDontFork,
            )
        }
        .map_err(|error| map_error(part.start, error))?;
        uffd.register_with_mode(
            part.start as *mut libc::c_void,
            bytes,
            RegisterMode::MISSING | RegisterMode::MINOR,
        )
        .map_err(|error| map_error(part.start, std::io::Error::other(format!("{error:?}"))))?;
    }
    let _ = uffd.wake(target as *mut libc::c_void, len);
    Ok(())
}

/// Maps the part of `range` (region offsets of a region read in place) the program still
/// maps from the region's file (UFFDIO_CONTINUE), waking the threads waiting there.
pub(super) fn continue_mapped(uffd: &Uffd, region: &ServedRegion, range: Range<u64>, page: usize) {
    if region.moving() {
        // The program still maps the old mapping there (`shaping`); its waiters are
        // woken once the new one is in place.
        return;
    }
    for part in region.mapped_parts(range) {
        uffd_ext::continue_or_wake(uffd.as_fd(), part.start, part.end - part.start, page);
    }
}

/// Gives block `index`'s frame back to the store (see `FrameStore::release`), if it
/// has one.
pub(super) fn release_frame(
    store: &mut Option<FrameStore>,
    region: &mut ServedRegion,
    index: u32,
    free_memory: bool,
) {
    if let (Some(store), Some(frame)) = (store, region.frames.get_mut(index as usize)) {
        if let Some(frame) = frame.take() {
            store.release(frame, free_memory);
        }
    }
}

/// Poisons the missing pages of `[start, start + len)` (SIGBUS on access) and wakes their
/// waiters; pages already present are left alone. Returns how many pages were poisoned.
pub(super) fn poison_range(uffd: &Uffd, start: usize, len: usize, page: usize) -> u64 {
    let mut poisoned = 0u64;
    let mut at = start;
    let end = start + len;
    while at < end {
        match uffd_ext::poison(uffd.as_fd(), at, end - at) {
            Partial::Done => {
                poisoned += ((end - at) / page) as u64;
                break;
            }
            Partial::Stopped { done, .. } => {
                poisoned += done / page as u64;
                // The page after what was done exists, vanished, or the address space is
                // changing under a fork (EAGAIN): skip it, waking whoever waits there (it
                // finds its page, or faults again and is answered then).
                at += done as usize;
                let _ = uffd.wake(at as *mut libc::c_void, page);
                at += page;
            }
        }
    }
    poisoned
}

/// Drops pages so the range faults again on next access.
pub(super) fn discard_pages(start: usize, end: usize) -> Result<(), ServiceError> {
    // Locked pages too (see `sys::memory::discard`): the budget bounds the region whatever the
    // program asked of the kernel. Plain MADV_DONTNEED on a region the program had
    // mlocked through the kernel failed here, which stopped the service and the program.
    // SAFETY: the range is a page-aligned part of a region this service serves; its
    // contents are file bytes that can be read again, and no reference the service holds
    // points into it.
    match unsafe { crate::sys::memory::discard(start, end - start) } {
        // ENOMEM: part of the range was unmapped by the program (a block cut by a
        // partial munmap); the kernel still dropped the pages of the mapped parts.
        Err(error) if error.raw_os_error() == Some(libc::ENOMEM) => Ok(()),
        result => result.map_err(|error| ServiceError::Evict { addr: start, error }),
    }
}

/// Drops the pages of `part` (addresses in `region`, file-shaped) from the region's
/// file: gone from every process that maps it, so the next access anywhere faults.
pub(super) fn punch_pages(
    file: &OwnedFd,
    region: &ServedRegion,
    part: Range<usize>,
) -> Result<(), ServiceError> {
    let (start, end) = (
        (part.start - region.base) as u64,
        (part.end - region.base) as u64,
    );
    let Some((offset, len)) = crate::shaped_region::file_range(start, end, region.shape_len) else {
        return Ok(());
    };
    crate::sys::files::punch_hole(file.as_fd(), offset, len).map_err(|error| ServiceError::Evict {
        addr: part.start,
        error,
    })
}

/// Drops the pages of `range` (region offsets) from a file-shaped region's file, the
/// parts the program unmapped too: a read in place fills the whole block, and forked
/// children may still map those parts.
pub(super) fn punch_region_pages(
    region: &ServedRegion,
    range: Range<u64>,
) -> Result<(), ServiceError> {
    let Some(file) = &region.shape else {
        return Ok(());
    };
    let Some((offset, len)) =
        crate::shaped_region::file_range(range.start, range.end, region.shape_len)
    else {
        return Ok(());
    };
    crate::sys::files::punch_hole(file.as_fd(), offset, len).map_err(|error| ServiceError::Evict {
        addr: region.base + range.start as usize,
        error,
    })
}

/// Whether the page at `addr` (page aligned, in a region this service serves) is in the
/// process's page tables (or in swap: a fault there is no userfault).
pub(super) fn page_present(addr: usize) -> bool {
    // A failure (the page was unmapped meanwhile) is answered as present: waking the
    // thread is then what the fault needs.
    crate::sys::memory::page_resident(addr).unwrap_or(true)
}
