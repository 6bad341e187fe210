//! Installs: what the program sees of a finished read. Finished reads are copied in
//! (UFFDIO_COPY, on this thread or the install workers) or their frames mapped over the
//! block; staged markers are installed when touched. After an install, the bookkeeping
//! makes the blocks resident and wakes the threads waiting on them.
//!
//! The page-table operations themselves are `page_tables`', each taking only what it
//! changes; the methods here decide what to install where.

use std::collections::VecDeque;
use std::ops::Range;

use super::block_state::{BlockEvent, BlockState, StagedIn};
use super::children::read_into_backlog;
use super::install_pool::InstallJob;
use super::page_tables::{continue_mapped, install_mapped, map_frame, release_frame};
use super::{FaultService, ServiceError};
use crate::policy::{BlockRef, RegionId};

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
