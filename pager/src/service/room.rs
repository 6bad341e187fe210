//! Making room in the budget: choosing victims with the eviction policy (sparing each
//! thread's last blocks while anything else can go) and dropping their pages in runs;
//! dropping the blocks of a range the program released or unmapped.

use std::ops::Range;

use super::block_state::{BlockEvent, BlockState};
use super::page_tables::{discard_pages, punch_pages, release_frame};
use super::{FaultService, ServiceError};
use crate::policy::{BlockRef, ReadKind, RegionId};

/// Why room is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Purpose {
    /// For a read: a demand read takes each thread's last blocks when nothing else is
    /// left, and victims' frames keep their memory for the reads that follow.
    Read,
    /// The budget shrank: each thread's last blocks stay (the budget's floor holds
    /// them), and victims' frames give their memory back to the system.
    Shrink,
}

impl FaultService {
    /// Whether a read of a block of `len` bytes can have a frame (always, without zero
    /// copy). Huge frames run out only if more regions than the spare frames hold a
    /// short last block each; slots, never while the budget holds (see `FrameStore`).
    pub(super) fn frame_free(&self, len: u64) -> bool {
        self.store.as_ref().is_none_or(|store| store.has_free(len))
    }

    /// Forgets a prefetch request taken off the queue: its block is missing again
    /// unless a thread waits on it (then it is in the demand queue too).
    pub(super) fn cancel_request(&mut self, block: BlockRef) {
        if let Some(region) = self.regions.get_mut(&block.region) {
            if region.state(block.index) == BlockState::Queued && !self.waiters.contains_key(&block)
            {
                region.advance(block.index, BlockEvent::Dequeued);
            }
        }
    }

    /// Reserves `bytes` of budget for a read of `incoming`, evicting as the policy says.
    /// False if no room can be made now (for a demand read: everything is in flight or
    /// pinned, so room appears when reads complete).
    pub(super) fn make_room(
        &mut self,
        bytes: u64,
        incoming: BlockRef,
        kind: ReadKind,
    ) -> Result<bool, ServiceError> {
        let room = self.evict_until_fits(bytes, incoming, kind, Purpose::Read)?;
        if room {
            self.budget.reserve(bytes);
        }
        Ok(room)
    }

    /// Evicts as the policy says until `bytes` more fit in the budget (none: until what
    /// is held fits a budget made smaller), for `purpose`. False if that much cannot be
    /// freed now.
    pub(super) fn evict_until_fits(
        &mut self,
        bytes: u64,
        incoming: BlockRef,
        kind: ReadKind,
        purpose: Purpose,
    ) -> Result<bool, ServiceError> {
        let free_memory = purpose == Purpose::Shrink;
        let mut victims = std::mem::take(&mut self.victims);
        victims.clear();
        let mut spared = std::mem::take(&mut self.spared);
        spared.clear();
        // Spared victims a demand read took after all, from the first named.
        let mut spared_taken = 0;
        let mut freed = 0u64;
        let mut room = true;
        while self.budget.shortfall(bytes) > freed {
            let victim = match self.eviction.victim(incoming, kind) {
                Some(victim) => {
                    let Some(region) = self.regions.get(&victim.region) else {
                        continue;
                    };
                    // A policy may only name evictable resident blocks; skip any other.
                    if !region.evictable(victim.index) {
                        self.breaches.record(format_args!(
                            "the eviction policy named {victim:?}, not evictable"
                        ));
                        continue;
                    }
                    if self.recent.spares(victim) {
                        spared.push(victim);
                        continue;
                    }
                    victim
                }
                None if kind == ReadKind::Demand => {
                    // Held-back markers are the only other thing a demand read can take
                    // room from; then the blocks threads faulted on last.
                    if let Some(staged) = self.staged.front().copied() {
                        self.discard_staged(staged);
                        continue;
                    }
                    match spared.get(spared_taken) {
                        Some(&victim) if purpose == Purpose::Read => {
                            spared_taken += 1;
                            victim
                        }
                        _ => {
                            room = false;
                            break;
                        }
                    }
                }
                None => {
                    room = false;
                    break;
                }
            };
            let region = &self.regions[&victim.region];
            freed += region.layout.block_bytes(victim.index);
            victims.push(victim);
        }
        // The policy handed the spared blocks over as victims: give back those kept.
        for &block in &spared[spared_taken..] {
            self.eviction.inserted(block);
        }
        self.spared = spared;
        self.evict(&mut victims, free_memory)?;
        self.victims = victims;
        Ok(room)
    }

    /// Drops the victims' pages, in runs of neighbouring blocks; with `free_memory` their
    /// frames' memory too (see `evict_until_fits`).
    pub(super) fn evict(
        &mut self,
        victims: &mut [BlockRef],
        free_memory: bool,
    ) -> Result<(), ServiceError> {
        victims.sort_unstable();
        // (region, start, end): region offsets of a run of neighbouring victims.
        let mut run: Option<(RegionId, u64, u64)> = None;
        for &victim in victims.iter() {
            let region = self
                .regions
                .get_mut(&victim.region)
                .expect("victims were checked to belong to live regions");
            region.advance(victim.index, BlockEvent::Released);
            // The frame takes the next read; its pages stay (warm) in the store unless
            // the budget shrank and the memory is to be given back.
            release_frame(&mut self.store, region, victim.index, free_memory);
            let memory = region.layout.block_memory(victim.index);
            let bytes = memory.end - memory.start;
            self.budget.remove_resident(bytes);
            self.stats.evictions += 1;
            self.stats.evicted_bytes += bytes;
            run = match run {
                Some((id, start, end)) if id == victim.region && end == memory.start => {
                    Some((id, start, memory.end))
                }
                Some(done) => {
                    self.discard_run(done)?;
                    Some((victim.region, memory.start, memory.end))
                }
                None => Some((victim.region, memory.start, memory.end)),
            };
        }
        if let Some(done) = run {
            self.discard_run(done)?;
        }
        Ok(())
    }

    /// Drops the pages of a run of blocks (region offsets), skipping unmapped parts.
    pub(super) fn discard_run(
        &self,
        (id, start, end): (RegionId, u64, u64),
    ) -> Result<(), ServiceError> {
        let region = self.regions.get(&id).expect("a run of a live region");
        // With zero copy the parts stay mapped to the evicted frames: dropping their
        // page-table entries makes the next access a minor fault.
        for part in region.mapped_parts(start..end) {
            match &region.shape {
                // File-shaped: the pages go from the file, so from every process
                // (unless children outlive the service: `pages_kept`).
                Some(_) if self.pages_kept || region.pages_kept => {}
                Some(file) => punch_pages(file, region, part)?,
                None => discard_pages(part.start, part.end)?,
            }
        }
        Ok(())
    }

    /// Drops the blocks overlapping `range` on `event`: `Released` (they fault back in)
    /// or `Unmapped` (the program unmapped them and their pages are gone).
    pub(super) fn drop_blocks(
        &mut self,
        id: RegionId,
        range: &Range<u64>,
        event: BlockEvent,
    ) -> Result<(), ServiceError> {
        assert!(
            matches!(event, BlockEvent::Released | BlockEvent::Unmapped),
            "dropping blocks on {event:?}"
        );
        let unmapped = event == BlockEvent::Unmapped;
        for index in self.blocks_of(id, range) {
            let block = BlockRef::new(id, index);
            let region = self
                .regions
                .get_mut(&id)
                .expect("blocks_of found the region");
            let bytes = region.layout.block_bytes(index);
            if region.pinned[index as usize] {
                region.pinned[index as usize] = false;
                self.budget.unpin(bytes);
            } else if region.state(index) == BlockState::Resident {
                self.eviction.removed(block);
            }
            match region.state(index) {
                state @ (BlockState::Resident | BlockState::Poisoned) => {
                    if state == BlockState::Resident {
                        self.budget.remove_resident(bytes);
                    }
                    region.advance(index, event);
                    // A dropped block's frame is emptied: a drop gives memory back.
                    release_frame(&mut self.store, region, index, true);
                    if !unmapped {
                        let memory = region.layout.block_memory(index);
                        self.discard_run((id, memory.start, memory.end))?;
                    }
                    self.stats.dropped_blocks += 1;
                }
                BlockState::Staged(_) => {
                    // Discarded, it is missing: unmapped too if so.
                    self.discard_staged(block);
                    if unmapped {
                        let region = self.regions.get_mut(&id).expect("still there");
                        region.advance(index, event);
                    }
                }
                BlockState::Missing => region.advance(index, event),
                // Unmapped while queued or read: the read is dropped from its queue or
                // finishes without installing anything (see `blocks_installed`), a
                // marker's too (never held back: `Landed::next`). A thread
                // waiting on it would wait forever: woken, it faults again on whatever
                // is mapped there now (nothing: SIGSEGV, as without the pager).
                BlockState::Queued | BlockState::Reading if unmapped => {
                    region.advance(index, event);
                    if self.waiters.remove(&block).is_some() {
                        let memory = region.layout.block_memory(index);
                        let start = region.base + memory.start as usize;
                        let len = (memory.end - memory.start) as usize;
                        let _ = self.uffd.wake(start as *mut libc::c_void, len);
                    }
                }
                // Dropped while queued or read: the read finishes and installs.
                _ => {}
            }
        }
        Ok(())
    }
}
