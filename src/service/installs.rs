//! Installs: finished reads copied into the region (here or on the install workers) or
//! their frames mapped, staged markers installed when touched, and the bookkeeping that
//! makes blocks resident and wakes the threads waiting on them.

use std::collections::VecDeque;
use std::ops::Range;

use super::block_state::{BlockEvent, BlockState, StagedIn};
use super::install_pool::InstallJob;
use super::pages::{install_mapped, map_frame, release_frame};
use super::{FaultService, ServiceError};
use crate::policy::{BlockRef, RegionId};

impl FaultService {
    /// Installs the finished reads nobody waited for, issuing reads as slots free up.
    pub(super) fn install_ready(&mut self) -> Result<(), ServiceError> {
        if !self.waiters.is_empty() {
            // Threads that faulted on a finished read since it finished go first.
            let ready = std::mem::take(&mut self.ready);
            let (mut waited, rest): (VecDeque<u32>, VecDeque<u32>) = ready
                .into_iter()
                .partition(|&slot| self.read_has_waiters(slot));
            waited.extend(rest);
            self.ready = waited;
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
            debug_assert_eq!(count, 1, "a frame holds one block");
            map_frame(&self.uffd, store, region, first)?;
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
            // Share the work: a worker takes a prefetch unless the workers already have
            // one queued each, in which case this thread copies it itself.
            if prefetch && !waited && !cut && pool.unfinished() < 2 * pool.threads() {
                pool.submit(job);
                return Ok(());
            }
        }
        let region = &self.regions[&region_id];
        // SAFETY: the buffer belongs to this slot's completed read and is not reused
        // until the slot is checked in by `installed`; the region is live, mapped until
        // its RemoveRegion is acknowledged.
        unsafe { install_mapped(&self.uffd, region, job.source, start..end, self.page()) }?;
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
            let store = self
                .store
                .as_ref()
                .expect("markers in frames need the store");
            map_frame(&self.uffd, store, region, block.index)?;
            self.budget
                .unreserve(region.layout.block_bytes(block.index));
            let now = self.now_ns();
            self.blocks_installed(block.region, block.index..block.index + 1, now);
            return Ok(());
        };
        // SAFETY: the stash buffer holds this block's bytes and is not reused until it is
        // released below; the region is live (staged blocks of a removed region are
        // discarded first).
        unsafe {
            install_mapped(
                &self.uffd,
                region,
                self.stash.buffer(stash).as_ptr(),
                memory,
                self.page(),
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

    /// Finishes installs done by the workers; with `wait`, all of them, waiting for
    /// those still copying.
    pub(super) fn collect_installs(&mut self, wait: bool) -> Result<(), ServiceError> {
        let Some(pool) = &mut self.installs else {
            return Ok(());
        };
        let mut installed = std::mem::take(&mut self.installed);
        if wait {
            pool.wait_idle(&mut installed);
        } else {
            pool.collect(&mut installed);
        }
        let mut failure = None;
        for done in installed.drain(..) {
            match done.result {
                Ok(()) => {
                    let at = done.at.saturating_duration_since(self.start).as_nanos() as u64;
                    self.installed(done.slot, at);
                }
                Err(error) => failure = failure.or(Some(error)),
            }
        }
        self.installed = installed;
        match failure {
            Some(error) => Err(error.into()),
            None => Ok(()),
        }
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
            let file_offset = region.block_file_offset(index);
            for waiter in self.waiters.remove(&block).into_iter().flatten() {
                self.log.served(
                    block,
                    file_offset,
                    region.layout.geometry.block_size,
                    waiter,
                    now,
                );
            }
        }
    }
}
