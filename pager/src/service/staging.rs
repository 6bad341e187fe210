//! Staging: prefetch markers read ahead of the program and held back unmapped (in the
//! stash, or in their frames with zero copy) until it touches them, so the fault on a
//! marker tells the prefetch policy where the program is. A held marker keeps its read's
//! reservation in the budget until it is installed or discarded.

use super::block_state::{BlockEvent, BlockState, StagedIn};
use super::page_tables::{punch_region_pages, release_frame};
use super::FaultService;
use crate::policy::BlockRef;

impl FaultService {
    /// Takes `block` off the list of held markers (it is being installed or discarded).
    pub(super) fn unstage(&mut self, block: BlockRef) {
        if let Some(position) = self.staged.iter().position(|&staged| staged == block) {
            self.staged.remove(position);
        }
    }

    /// Gives up a held-back marker: its data is discarded and its budget released.
    pub(super) fn discard_staged(&mut self, block: BlockRef) {
        self.unstage(block);
        if let Some(region) = self.regions.get_mut(&block.region) {
            if let BlockState::Staged(place) = region.state(block.index) {
                region.advance(block.index, BlockEvent::Released);
                self.budget
                    .unreserve(region.layout.block_bytes(block.index));
                match place {
                    StagedIn::InPlace
                        if region.view.is_some() && !(self.pages_kept || region.pages_kept) =>
                    {
                        // Its pages are in the region's file: punched out, as an evicted
                        // block's (a failure leaves them, to be read over next time).
                        let memory = region.layout.block_memory(block.index);
                        let _ = punch_region_pages(region, memory);
                    }
                    StagedIn::InPlace if region.view.is_some() => {}
                    StagedIn::InPlace => release_frame(&mut self.store, region, block.index, false),
                    StagedIn::Stash(stash) => self.stash.release(stash),
                }
            }
        }
    }
}

/// Most markers held back at once: one per queue slot, within 4 MiB of stash.
pub(super) fn max_staged(queue_depth: u32, block_size: u64) -> usize {
    (queue_depth as u64).min((4 << 20) / block_size).max(1) as usize
}
