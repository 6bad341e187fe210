//! Installs: what the program sees in a region changes here and nowhere else. Finished
//! reads are copied in (UFFDIO_COPY, on this thread or the install workers) or their
//! frames mapped over the block; staged markers are installed when touched; pages whose
//! read failed are poisoned and pages of evicted blocks dropped. After an install, the
//! bookkeeping makes the blocks resident and wakes the threads waiting on them.
//!
//! The page-table operations are free functions at the end of this file, each taking
//! only what it changes; the methods above them decide what to install where.

use std::collections::VecDeque;
use std::ops::Range;
use std::os::fd::{AsFd, OwnedFd};

use rustix::io::Errno;
use userfaultfd::{RegisterMode, Uffd};

use super::block_state::{BlockEvent, BlockState, StagedIn};
use super::children::read_into_backlog;
use super::install_pool::InstallJob;
use super::region::ServedRegion;
use super::{FaultService, ServiceError};
use crate::policy::{BlockRef, RegionId};
use crate::shared_store::FrameStore;
use crate::uffd_ext::{self, Partial};

impl FaultService {
    /// Installs the finished reads nobody waited for, issuing reads as slots free up.
    pub(super) fn install_ready(&mut self) -> Result<(), ServiceError> {
        if !self.waiters.is_empty() {
            let ready = std::mem::take(&mut self.ready);
            self.ready = waited_first(ready, |slot| self.read_has_waiters(slot));
        }
        while let Some(slot) = self.ready.pop_front() {
            self.install_read(slot)?;
            if self.ring.has_free_slot() && !self.ready.is_empty() {
                self.pump()?;
                self.ring.submit_and_wait(0)?;
            }
        }
        Ok(())
    }

    /// Installs every block of a finished read (here, or on an install worker when the
    /// read was a prefetch nobody waits for yet), wakes their waiters, frees the slot.
    pub(super) fn install_read(&mut self, slot: u32) -> Result<(), ServiceError> {
        let tag = self.ring.tag(slot).expect("installing a read in flight");
        let (region_id, first, count, prefetch) = (tag.region, tag.first, tag.count, tag.prefetch);
        let region = self
            .regions
            .get_mut(&region_id)
            .expect("installing into a region still known");
        if region.removed {
            for index in first..first + count {
                release_frame(&mut self.store, region, index, true);
            }
            self.finish_read(slot);
            return Ok(());
        }
        let region = &self.regions[&region_id];
        // The blocks of one read are neighbours in the buffer and in the region: one
        // call installs them all.
        let start = region.layout.block_memory(first).start;
        let end = region.layout.block_memory(first + count - 1).end;
        if let Some(store) = &self.store {
            assert_eq!(count, 1, "a frame holds one block");
            map_frame(&self.uffd, store, region, first)?;
            let now = self.now_ns();
            self.installed(slot, now);
            return Ok(());
        }
        if region.view.is_some() {
            // Read in place: the bytes are in the file; map them in the program.
            continue_mapped(&self.uffd, region, start..end, self.page());
            let now = self.now_ns();
            self.installed(slot, now);
            return Ok(());
        }
        let job = InstallJob {
            slot,
            source: self.ring.buffer(slot).as_ptr(),
            target: region.base + start as usize,
            len: (end - start) as usize,
        };
        // A read the program unmapped part of is installed here, around the holes.
        let cut = region.cuts(start..end);
        if self
            .installs
            .as_ref()
            .is_some_and(|pool| pool.finished_uncollected() > 0)
        {
            // Free the slots of finished installs first: they are reads waiting to issue.
            self.collect_installs(false)?;
        }
        let waited = self.read_has_waiters(slot);
        if let Some(pool) = &mut self.installs {
            let load = WorkerLoad {
                unfinished: pool.unfinished(),
                threads: pool.threads(),
            };
            if on_a_worker(prefetch && !waited, cut, load) {
                pool.submit(job);
                return Ok(());
            }
        }
        let region = &self.regions[&region_id];
        let page = self.page();
        let (uffd, events, backlog) = (&self.uffd, &mut self.events, &mut self.backlog);
        let mut on_busy = || read_into_backlog(uffd, events, backlog);
        // SAFETY: the buffer belongs to this slot's completed read and is not reused
        // until the slot is checked in by `installed`; the region is live, mapped until
        // its RemoveRegion is acknowledged.
        unsafe { install_mapped(uffd, region, job.source, start..end, page, &mut on_busy) }?;
        let now = self.now_ns();
        self.installed(slot, now);
        Ok(())
    }

    /// Installs a staged marker from where it waits and wakes its waiters.
    pub(super) fn install_staged(
        &mut self,
        block: BlockRef,
        place: StagedIn,
    ) -> Result<(), ServiceError> {
        let region = &self.regions[&block.region];
        let memory = region.layout.block_memory(block.index);
        let StagedIn::Stash(stash) = place else {
            match &self.store {
                Some(store) => map_frame(&self.uffd, store, region, block.index)?,
                None => continue_mapped(&self.uffd, region, memory, self.page()),
            }
            self.budget
                .unreserve(region.layout.block_bytes(block.index));
            let now = self.now_ns();
            self.blocks_installed(block.region, block.index..block.index + 1, now);
            return Ok(());
        };
        let page = self.page();
        let (uffd, events, backlog) = (&self.uffd, &mut self.events, &mut self.backlog);
        let mut on_busy = || read_into_backlog(uffd, events, backlog);
        // SAFETY: the stash buffer holds this block's bytes and is not reused until it is
        // released below; the region is live (staged blocks of a removed region are
        // discarded first).
        unsafe {
            install_mapped(
                uffd,
                region,
                self.stash.buffer(stash).as_ptr(),
                memory,
                page,
                &mut on_busy,
            )
        }?;
        self.stash.release(stash);
        // Its bytes move from reserved (held back) to resident.
        self.budget
            .unreserve(region.layout.block_bytes(block.index));
        let now = self.now_ns();
        self.blocks_installed(block.region, block.index..block.index + 1, now);
        Ok(())
    }

    /// The bookkeeping after a read's blocks were installed at `now`.
    pub(super) fn installed(&mut self, slot: u32, now: u64) {
        let tag = self.ring.tag(slot).expect("installed a read in flight");
        let (region_id, blocks) = (tag.region, tag.first..tag.first + tag.count);
        self.blocks_installed(region_id, blocks, now);
        self.finish_read(slot);
    }

    /// Marks installed blocks resident, hands them to the eviction policy and records
    /// the threads that waited on them.
    pub(super) fn blocks_installed(&mut self, region_id: RegionId, blocks: Range<u32>, now: u64) {
        let region = self
            .regions
            .get_mut(&region_id)
            .expect("installed into a live region");
        for index in blocks {
            if region.state(index) == BlockState::Unmapped {
                // The program unmapped the whole block while it was read: nothing was
                // installed, and it must never be evicted (something else may be
                // mapped there by now). Its frame goes back, emptied.
                release_frame(&mut self.store, region, index, true);
                continue;
            }
            let bytes = region.layout.block_bytes(index);
            // Pages of a block the program partly unmapped were skipped; the block is
            // still counted whole, which errs on the side of the budget.
            region.advance(index, BlockEvent::Installed);
            if let Some(watched) = region.watched.get_mut(index as usize) {
                *watched = false;
            }
            self.budget.add_resident(bytes);
            if !region.pinned[index as usize] {
                self.eviction.inserted(BlockRef::new(region_id, index));
            }
            if self.waiters.is_empty() {
                continue;
            }
            let block = BlockRef::new(region_id, index);
            self.log.served(
                block,
                region.block_file_offset(index),
                region.layout.geometry.block_size,
                self.waiters.remove(&block).into_iter().flatten(),
                now,
            );
        }
    }
}

/// The finished reads in `ready`, those a thread waits on first (threads that faulted on
/// a read after it finished), each part in its order.
fn waited_first(ready: VecDeque<u32>, waited: impl Fn(u32) -> bool) -> VecDeque<u32> {
    let (mut first, rest): (VecDeque<u32>, VecDeque<u32>) =
        ready.into_iter().partition(|&slot| waited(slot));
    first.extend(rest);
    first
}

/// How busy the install workers are.
#[derive(Copy, Clone, Debug)]
struct WorkerLoad {
    /// Installs submitted and not yet collected.
    unfinished: usize,
    threads: usize,
}

/// Whether a read's copy goes to an install worker rather than this thread: only a
/// prefetch nobody waits for (a waiting thread is woken soonest from here), installed
/// whole (a read the program unmapped part of is copied around its holes, here), and
/// only while the workers have fewer than two installs queued each; past that this
/// thread shares the copying.
fn on_a_worker(unwaited_prefetch: bool, cut: bool, workers: WorkerLoad) -> bool {
    unwaited_prefetch && !cut && workers.unfinished < 2 * workers.threads
}

// The page-table operations.

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_thread_waits_on_are_installed_first_in_their_order() {
        let ready = VecDeque::from([4, 7, 1, 9, 2]);
        let waited = waited_first(ready, |slot| slot == 9 || slot == 7);
        assert_eq!(waited, VecDeque::from([7, 9, 4, 1, 2]));
        let none = waited_first(VecDeque::from([3, 1]), |_| false);
        assert_eq!(none, VecDeque::from([3, 1]));
    }

    #[test]
    fn only_whole_unwaited_prefetches_go_to_workers_with_room() {
        let idle = WorkerLoad {
            unfinished: 0,
            threads: 2,
        };
        assert!(on_a_worker(true, false, idle));
        assert!(!on_a_worker(false, false, idle), "waited on, or demand");
        assert!(!on_a_worker(true, true, idle), "cut by an unmap");
        let busy = WorkerLoad {
            unfinished: 4,
            threads: 2,
        };
        assert!(!on_a_worker(true, false, busy), "two queued per worker");
        let one_short = WorkerLoad {
            unfinished: 3,
            threads: 2,
        };
        assert!(on_a_worker(true, false, one_short));
    }
}
