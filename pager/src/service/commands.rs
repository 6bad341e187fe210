//! The API side's requests (`crate::command`), carried out between faults: regions come
//! and go, ranges are prefetched, dropped, unmapped, pinned and hinted.

use std::ops::Range;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::mpsc::SyncSender;

use super::block_state::{BlockEvent, BlockState};
use super::page_tables::release_frame;
use super::region::ServedRegion;
use super::watch::Watch;
use super::{FaultService, ServiceError};
use crate::command::{Command, PinRefused, RegionMove};
use crate::file::BackingFile;
use crate::layout::RegionLayout;
use crate::policy::{BlockRef, PrefetchRequest, RegionId};

impl FaultService {
    /// The command eventfd is readable (`Watch::Commands`): carries out every queued
    /// command.
    pub(super) fn commands_readable(&mut self, rearm: bool) -> Result<(), ServiceError> {
        self.drain_commands()?;
        if rearm {
            self.ring
                .watch(self.shared.wakeup.as_raw_fd(), Watch::Commands.token())?;
        }
        Ok(())
    }

    /// Carries out every queued command.
    pub(super) fn drain_commands(&mut self) -> Result<(), ServiceError> {
        self.shared.wakeup.drain();
        while let Some(command) = self.shared.next_command() {
            self.command(command)?;
        }
        Ok(())
    }

    /// Carries out `command`, or holds it while regions are being moved at a fork.
    fn command(&mut self, command: Command) -> Result<(), ServiceError> {
        if command.waits_for_moves() && self.regions.values().any(|region| region.moving()) {
            // Carried out once the forking thread has made its moves (`shaped_for_fork`).
            self.held_for_moves.push_back(command);
            return Ok(());
        }
        if command.changes_residency() {
            // Nothing may be copied into a range this command drops or lets go of.
            self.install_everything_read()?;
        }
        self.carry_out(command)
    }

    /// Installs every finished read, here and on the install workers.
    fn install_everything_read(&mut self) -> Result<(), ServiceError> {
        let ready = std::mem::take(&mut self.ready);
        for slot in ready {
            self.install_read(slot)?;
        }
        self.collect_installs(true)
    }

    /// Does what `command` asks and answers it.
    fn carry_out(&mut self, command: Command) -> Result<(), ServiceError> {
        match command {
            Command::AddRegion {
                id,
                base,
                layout,
                file,
                prot,
                shape,
                reply,
            } => {
                self.add_region(id, base, layout, file, prot, shape);
                let _ = reply.send(());
            }
            Command::RemoveRegion { id, reply } => {
                self.fill_removed_for_children(id)?;
                self.remove_region(id);
                self.tell_keeper_region_gone(id);
                let _ = reply.send(());
            }
            Command::ForkComing {
                generation,
                reply,
                kept,
            } => self.fork_coming(generation, &reply, &kept)?,
            Command::ShapeForFork { reply } => {
                let moves = self.shape_for_fork()?;
                let _ = reply.send(moves);
            }
            Command::ShapedForFork { failed, reply } => self.moves_made(&failed, &reply)?,
            Command::Prefetch { id, range } => {
                for index in self.blocks_of(id, &range) {
                    self.queue_prefetch(PrefetchRequest::eager(BlockRef::new(id, index)));
                }
            }
            Command::Drop { id, range, reply } => {
                self.drop_blocks(id, &range, BlockEvent::Released)?;
                let _ = reply.send(());
            }
            Command::Unmap { id, range, reply } => {
                self.unmap(id, range)?;
                let _ = reply.send(());
            }
            Command::Pin { id, range, reply } => {
                let _ = reply.send(self.pin(id, &range));
            }
            Command::Unpin { id, range } => self.unpin(id, &range),
            Command::Hint { id, range, hint } => {
                let blocks = self.blocks_of(id, &range);
                self.prefetch.hint(id, blocks, hint);
            }
            Command::SetBudget { bytes, reply } => {
                let budget = self.set_budget(bytes)?;
                let _ = reply.send(budget);
            }
            Command::Stats { reply } => {
                // Whether children still live is asked for, not only published.
                self.reap_children()?;
                let snapshot = self.snapshot();
                let _ = reply.send(snapshot);
            }
            Command::TakeTrace { reply } => {
                let _ = reply.send(self.log.take_trace());
            }
            Command::Exiting { reply } => {
                self.fill_for_outliving_children()?;
                let _ = reply.send(());
            }
            Command::Shutdown => {
                self.fill_for_outliving_children()?;
                self.shutting_down = true;
            }
        }
        Ok(())
    }

    /// The program is about to fork: answers once the service is ready for it, then
    /// waits until the fork has returned (`fork_pause`).
    fn fork_coming(
        &mut self,
        generation: u64,
        reply: &SyncSender<()>,
        kept: &SyncSender<()>,
    ) -> Result<(), ServiceError> {
        self.make_ready_for_fork();
        let _ = reply.send(());
        self.pause_for_fork(generation)?;
        // The child's userfaultfd goes to the keeper before the forking thread returns
        // from its fork (it waits for `kept`): a program ending right after the fork
        // leaves the child kept.
        self.take_backlog()?;
        let _ = kept.send(());
        Ok(())
    }

    /// The forking thread has made its moves (`failed`: those it could not make):
    /// answers, then carries out the commands held meanwhile.
    fn moves_made(
        &mut self,
        failed: &[RegionMove],
        reply: &SyncSender<()>,
    ) -> Result<(), ServiceError> {
        self.shaped_for_fork(failed)?;
        let _ = reply.send(());
        for command in std::mem::take(&mut self.held_for_moves) {
            self.command(command)?;
        }
        Ok(())
    }

    fn add_region(
        &mut self,
        id: RegionId,
        base: usize,
        layout: RegionLayout,
        file: BackingFile,
        prot: i32,
        shape: Option<OwnedFd>,
    ) {
        let zero_copy = self.store.is_some();
        let mut region =
            ServedRegion::new(base, layout, file, prot, zero_copy, self.breaches.clone());
        if let Some(file) = shape {
            region.shape_len =
                crate::sys::files::fstat(file.as_fd()).map_or(0, |stat| stat.st_size as u64);
            if self.config.read_in_place {
                region.minor = true;
                // Without a view the region's reads are copied in (UFFDIO_COPY fills holes
                // of any file-shaped region); they are slower, not wrong.
                region.view = crate::shaped_region::FileView::new(&file, region.shape_len).ok();
            }
            region.shape = Some(file);
        }
        self.locator
            .insert(base, region.layout.map_len as usize, id);
        self.tell_keeper_region(id, &region);
        if region.shape.is_some() {
            self.share_region(region.file.identity());
        }
        let info = region.info(id, self.budget.limit(), zero_copy);
        self.prefetch.region_added(&info);
        self.eviction.region_added(&info);
        self.regions.insert(id, region);
    }

    /// The program is unmapping `range` (region offsets): it becomes a hole, and the
    /// blocks wholly inside it are unmapped. The pages of a block the range cuts through
    /// simply fail to install there (ENOENT).
    fn unmap(&mut self, id: RegionId, range: Range<u64>) -> Result<(), ServiceError> {
        let blocks = self.blocks_of(id, &range);
        let Some(region) = self.regions.get_mut(&id) else {
            return Ok(());
        };
        region.holes.add(range.clone());
        let geometry = &region.layout.geometry;
        let within = geometry.blocks_within(range.clone());
        let first = within.start.max(blocks.start);
        let end = within.end.min(blocks.end);
        if first < end {
            let whole = geometry.block_start(first)..geometry.block_start(end);
            self.drop_blocks(id, &whole, BlockEvent::Unmapped)?;
        }
        Ok(())
    }

    /// Forgets region `id`: its blocks leave the budget and the policies; reads in
    /// flight into it finish without installing, then the region is gone.
    fn remove_region(&mut self, id: RegionId) {
        self.recent.region_removed(id);
        let staged: Vec<BlockRef> = self
            .staged
            .iter()
            .copied()
            .filter(|block| block.region == id)
            .collect();
        for block in staged {
            self.discard_staged(block);
        }
        self.waiters.retain(|block, _| block.region != id);
        self.locator.remove(id);
        self.prefetch.region_removed(id);
        self.eviction.region_removed(id);
        let Some(region) = self.regions.get_mut(&id) else {
            return;
        };
        for index in 0..region.block_count() {
            if region.state(index) == BlockState::Resident {
                self.budget
                    .remove_resident(region.layout.block_bytes(index));
                release_frame(&mut self.store, region, index, true);
            }
        }
        for (index, pinned) in region.pinned.iter().enumerate() {
            if *pinned {
                self.budget.unpin(region.layout.block_bytes(index as u32));
            }
        }
        region.removed = true;
        if region.reads_in_flight == 0 {
            self.regions.remove(&id);
        }
    }

    /// Pins the blocks overlapping `range`: out of eviction's reach, and read now.
    fn pin(&mut self, id: RegionId, range: &Range<u64>) -> Result<(), PinRefused> {
        let blocks = self.blocks_of(id, range);
        let Some(region) = self.regions.get_mut(&id) else {
            return Err(PinRefused::UnknownRegion);
        };
        let requested: u64 = blocks
            .clone()
            .filter(|&index| !region.pinned[index as usize])
            .map(|index| region.layout.block_bytes(index))
            .sum();
        self.budget.pin(requested, self.config.block_size)?;
        for index in blocks {
            if region.pinned[index as usize] {
                continue;
            }
            region.pinned[index as usize] = true;
            let block = BlockRef::new(id, index);
            match region.state(index) {
                BlockState::Resident => self.eviction.removed(block),
                BlockState::Missing | BlockState::Poisoned => {
                    region.advance(index, BlockEvent::Queued);
                    self.demand.push_back(block);
                }
                BlockState::Queued => self.demand.push_back(block),
                BlockState::Reading | BlockState::Staged(_) | BlockState::Unmapped => {}
            }
        }
        // Staged pinned blocks are installed right away rather than held back.
        let staged_pinned: Vec<BlockRef> = self
            .staged
            .iter()
            .copied()
            .filter(|block| block.region == id && region.pinned[block.index as usize])
            .collect();
        for block in staged_pinned {
            self.discard_staged(block);
            if let Some(region) = self.regions.get_mut(&id) {
                region.advance(block.index, BlockEvent::Queued);
                self.demand.push_back(block);
            }
        }
        Ok(())
    }

    /// Gives pinned blocks overlapping `range` back to eviction.
    fn unpin(&mut self, id: RegionId, range: &Range<u64>) {
        for index in self.blocks_of(id, range) {
            let region = self
                .regions
                .get_mut(&id)
                .expect("blocks_of found the region");
            if !region.pinned[index as usize] {
                continue;
            }
            region.pinned[index as usize] = false;
            self.budget.unpin(region.layout.block_bytes(index));
            if region.state(index) == BlockState::Resident {
                self.eviction.inserted(BlockRef::new(id, index));
            }
        }
    }
}
