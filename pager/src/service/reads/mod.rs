//! Reads: queued blocks become io_uring reads (demand first, prefetch within its share
//! of the queue and the device), each after room was made in the budget; completions are
//! checked, continued when short, retried, moved off O_DIRECT when refused, failed for
//! good (split first, then poisoned) or handed on to be installed.
//!
//! The decisions are apart, without a ring or a kernel: `tag` says what a completion
//! asks for next, `load` counts reads against the queue and the device, `landed` says
//! where a finished read goes.

use std::io;
use std::ops::Range;

use super::block_state::{BlockEvent, BlockState, StagedIn};
use super::page_tables::{poison_range, punch_region_pages, release_frame};
use super::staging::max_staged;
use super::{FaultService, ServiceError};
use crate::policy::{BlockRef, Install, PrefetchRequest, ReadKind};
use crate::ring::Landing;

mod landed;
mod load;
mod tag;

use self::landed::{Landed, NextForRead};
pub(super) use self::load::ReadLoad;
use self::tag::ReadStep;
pub(super) use self::tag::ReadTag;

/// O_DIRECT needs lengths in multiples of the logical block size; 4096 covers every
/// device we meet.
const DIRECT_IO_ALIGN: u64 = 4096;

/// Most prefetch bytes on the device while an idle-fill read starts: what a read the
/// program comes to wait on may find ahead of it. One expert slice of a coarse model
/// (3.6 MiB for 16 experts of a 3 GiB model), a few of a fine-grained one.
const IDLE_FILL_DEVICE_BYTES: u64 = 4 << 20;

/// How many prefetch requests, `first` and those following it in the queue, one read
/// takes: the next blocks of the same region, eager all (a marker stays alone, since
/// it is held back as a unit), at most `max_blocks`, each still `queued`.
pub(super) fn merged_count<'a>(
    first: &PrefetchRequest,
    following: impl Iterator<Item = &'a PrefetchRequest>,
    max_blocks: u32,
    block_count: u32,
    queued: impl Fn(u32) -> bool,
) -> u32 {
    let mut count = 1u32;
    if first.install != Install::Eager {
        return count;
    }
    for next in following {
        let index = first.block.index + count;
        if count >= max_blocks
            || next.block.region != first.block.region
            || next.block.index != index
            || next.install != Install::Eager
            || index >= block_count
            || !queued(index)
        {
            break;
        }
        count += 1;
    }
    count
}

/// Prefetch requests the budget refuses in a row before the rest of the queue is dropped
/// (see `pump`).
const PREFETCHES_REFUSED_BEFORE_DROP: u32 = 4;

impl FaultService {
    /// Issues queued reads: demand first, then prefetch, within the budget and the
    /// queue depth. Prefetch leaves a quarter of the slots for demand reads.
    pub(super) fn pump(&mut self) -> Result<(), ServiceError> {
        self.pump_demand()?;
        self.pump_prefetch()?;
        self.pump_idle_fill()
    }

    /// Whether `block` still waits in a queue (its region removed or it read since: stale).
    fn still_queued(&self, block: BlockRef) -> bool {
        self.regions.get(&block.region).is_some_and(|region| {
            !region.removed && region.state(block.index) == BlockState::Queued
        })
    }

    /// Reads the blocks threads wait on, one block a read, while the ring has slots,
    /// the frame store frames and the budget room.
    fn pump_demand(&mut self) -> Result<(), ServiceError> {
        while let Some(&block) = self.demand.front() {
            if !self.still_queued(block) {
                self.demand.pop_front();
                continue;
            }
            let bytes = self.regions[&block.region].layout.block_bytes(block.index);
            if !self.ring.has_free_slot() || !self.frame_free(bytes) {
                break;
            }
            if !self.make_room(bytes, block, ReadKind::Demand)? {
                break;
            }
            let Some(slot) = self.ring.checkout() else {
                self.budget.unreserve(bytes);
                break;
            };
            self.demand.pop_front();
            self.start_read(slot, block, 1, bytes, Install::Eager, false)?;
        }
        Ok(())
    }

    /// Reads the prefetch queue's requests, neighbours merged into reads of up to
    /// `max_read`, while the device takes more prefetch and the budget makes room.
    fn pump_prefetch(&mut self) -> Result<(), ServiceError> {
        let max_blocks = (self.config.max_read / self.config.block_size) as u32;
        let device_limit = self.prefetch.device_bytes().unwrap_or(u64::MAX);
        let mut refused_in_a_row = 0;
        while self
            .load
            .prefetch_may_start(self.config.queue_depth, device_limit)
            && self.ring.has_free_slot()
        {
            let Some(&first) = self.prefetch_queue.front() else {
                break;
            };
            if !self.still_queued(first.block) {
                self.prefetch_queue.pop_front();
                continue;
            }
            let region = &self.regions[&first.block.region];
            let count = merged_count(
                &first,
                self.prefetch_queue.iter().skip(1),
                max_blocks,
                region.block_count(),
                |index| region.state(index) == BlockState::Queued,
            );
            let bytes: u64 = (first.block.index..first.block.index + count)
                .map(|index| region.layout.block_bytes(index))
                .sum();
            if !self.frame_free(bytes) {
                break;
            }
            if !self.make_room(bytes, first.block, ReadKind::Prefetch)? {
                // Nothing resident is worth less than this block. Requests are queued
                // in the order they are needed, so the rest are worth as little, unless
                // this one is stale: the program passed it while it waited for the
                // device. Drop it alone: dropping the whole queue would leave the blocks
                // just ahead to be read on demand. But after a few refused in a row
                // the rest would be too, and every refusal costs the policy a ranking
                // of all it holds (thousands of blocks): drop them all, the policy
                // plans anew at the next fault.
                self.prefetch_queue.pop_front();
                self.cancel_request(first.block);
                refused_in_a_row += 1;
                if refused_in_a_row == PREFETCHES_REFUSED_BEFORE_DROP {
                    for request in std::mem::take(&mut self.prefetch_queue) {
                        self.cancel_request(request.block);
                    }
                    break;
                }
                continue;
            }
            refused_in_a_row = 0;
            let Some(slot) = self.ring.checkout() else {
                self.budget.unreserve(bytes);
                break;
            };
            for _ in 0..count {
                self.prefetch_queue.pop_front();
            }
            self.start_read(slot, first.block, count, bytes, first.install, true)?;
            self.stats.blocks_prefetched += count as u64;
        }
        Ok(())
    }

    /// Reads idle-fill blocks (`Urgency::IdleFill`) while nothing the program needs is
    /// queued or on the device, with at most `IDLE_FILL_DEVICE_BYTES` of prefetch on the
    /// device, into budget no block holds. When the budget has no such room, the whole
    /// queue is dropped: its blocks are missing again and the policy asks anew.
    fn pump_idle_fill(&mut self) -> Result<(), ServiceError> {
        while let Some(&block) = self.idle_fill.front() {
            if !self.still_queued(block) {
                self.idle_fill.pop_front();
                continue;
            }
            let device_idle = self.demand.is_empty()
                && self.prefetch_queue.is_empty()
                && self.load.demand_in_flight() == 0
                && self.load.prefetch_bytes_on_device() < IDLE_FILL_DEVICE_BYTES;
            if !device_idle || !self.ring.has_free_slot() {
                break;
            }
            let bytes = self.regions[&block.region].layout.block_bytes(block.index);
            if self.budget.shortfall(bytes) > 0 || !self.frame_free(bytes) {
                for block in std::mem::take(&mut self.idle_fill) {
                    self.cancel_request(block);
                }
                break;
            }
            let Some(slot) = self.ring.checkout() else {
                break;
            };
            self.budget.reserve(bytes);
            self.idle_fill.pop_front();
            self.start_read(slot, block, 1, bytes, Install::Eager, true)?;
            self.stats.blocks_prefetched += 1;
            self.stats.blocks_idle_filled += 1;
        }
        Ok(())
    }

    pub(super) fn start_read(
        &mut self,
        slot: u32,
        first: BlockRef,
        count: u32,
        reserved: u64,
        install: Install,
        prefetch: bool,
    ) -> Result<(), ServiceError> {
        let now = self.now_ns();
        let region = self
            .regions
            .get_mut(&first.region)
            .expect("reads start only for live regions");
        let geometry = region.layout.geometry.clone();
        let Range { start, end } = geometry.data_range(first.index..first.index + count);
        let valid = (end - start) as usize;
        let len = (end - start).next_multiple_of(DIRECT_IO_ALIGN) as usize;
        for index in first.index..first.index + count {
            region.advance(index, BlockEvent::ReadIssued);
        }
        region.reads_in_flight += 1;
        let file_offset = geometry.file_offset + start;
        let fd = region.file.read_fd();
        let landing = match &mut self.store {
            Some(store) => {
                assert_eq!(count, 1, "a frame holds one block");
                let frame = store
                    .take(len as u64)
                    .expect("pump checked a frame is free");
                region.frames[first.index as usize] = Some(frame.index);
                // A frame's first read faults its pages in, and the kernel clears them
                // first: inside this thread's submit, which would serve nobody meanwhile.
                // A cold frame's read is punted to the kernel's io_uring workers, which
                // clear several frames at once (docs/design.md, "The fault service,
                // measured").
                Some(Landing {
                    dest: store.view(frame.index),
                    len,
                    off_thread: !frame.warm,
                })
            }
            // Read in place: straight into the region's file. The block's pages were
            // punched out when it was last evicted, so the read allocates and clears them
            // first: off this thread, as for a cold frame.
            None => region.view.as_ref().map(|view| Landing {
                dest: view.at(start),
                len,
                off_thread: true,
            }),
        };
        let tag = ReadTag {
            region: first.region,
            first: first.index,
            count,
            file_offset,
            len,
            valid,
            done: 0,
            attempts: 1,
            submitted_ns: now,
            reserved,
            install,
            prefetch,
        };
        match landing {
            Some(landing) => {
                // SAFETY: the store's view lives as long as the service; the frame was
                // just taken, and no other read lands in it or region maps it until it
                // is freed.
                unsafe { self.ring.read_into(slot, fd, file_offset, landing, tag) }?
            }
            None => self.ring.read(slot, fd, file_offset, 0, len, tag)?,
        }
        self.load.issued(prefetch, len as u64);
        self.stats.read_requests += 1;
        Ok(())
    }

    /// Handles the completion of the read in `slot`: `result` is what the ring reaped.
    pub(super) fn read_done(
        &mut self,
        slot: u32,
        result: io::Result<usize>,
    ) -> Result<(), ServiceError> {
        let Some(tag) = self.ring.tag(slot) else {
            return Ok(());
        };
        let region_id = tag.region;
        // What was submitted last for this slot: the request's rest.
        self.load
            .device_answered(tag.prefetch, (tag.len - tag.done) as u64);
        let result = self.injected_read_result(slot, result);
        let live = self
            .regions
            .get(&region_id)
            .is_some_and(|region| !region.removed);
        if !live {
            if let Some(region) = self.regions.get_mut(&region_id) {
                let tag = self.ring.tag(slot).expect("checked above");
                for index in tag.first..tag.first + tag.count {
                    release_frame(&mut self.store, region, index, true);
                }
            }
            self.finish_read(slot);
            return Ok(());
        }
        let region = self.regions.get_mut(&region_id).expect("checked live");
        let tag = self.ring.tag_mut(slot).expect("checked above");
        match tag.step(&result, self.config.read_attempts, region.file.is_direct()) {
            ReadStep::Complete => self.read_complete(slot),
            ReadStep::Continue => self.continue_read(slot),
            ReadStep::Retry => {
                self.stats.read_retries += 1;
                self.continue_read(slot)
            }
            ReadStep::GoBuffered => {
                let error = result.expect_err("only an error goes buffered");
                region.file.give_up_direct(format!(
                    "O_DIRECT read refused ({error}); reading through the page cache"
                ));
                self.continue_read(slot)
            }
            ReadStep::FileShrank => {
                // The kernel raises SIGBUS for pages past the end of a file; so do we
                // (and say why once).
                region.file_changed();
                self.fail_read(slot);
                Ok(())
            }
            ReadStep::Fail => {
                self.fail_read(slot);
                Ok(())
            }
        }
    }

    /// Re-issues the unread rest of a request (after a short read or a retry).
    pub(super) fn continue_read(&mut self, slot: u32) -> Result<(), ServiceError> {
        let tag = self.ring.tag(slot).expect("continuing a read in flight");
        let region = self
            .regions
            .get(&tag.region)
            .expect("continuing a live region");
        // A short read may end off the direct-I/O alignment; finish such a rest buffered.
        let fd = if tag.rest_is_aligned() {
            region.file.read_fd()
        } else {
            region.file.buffered_fd()
        };
        let (offset, done, len) = (
            tag.file_offset + tag.done as u64,
            tag.done,
            tag.len - tag.done,
        );
        // On this thread: the first attempt faulted the frame's pages in (short reads and
        // retries are rare enough not to need a worker either way).
        let landing = match &self.store {
            Some(store) => Some(Landing {
                dest: store.view(region.frame(tag.first)).wrapping_add(done),
                len,
                off_thread: false,
            }),
            None => region.view.as_ref().map(|view| Landing {
                dest: view.at(region.region_offset(tag.file_offset) + done as u64),
                len,
                off_thread: false,
            }),
        };
        let tag = self.ring.reclaim(slot);
        self.load.resubmitted(tag.prefetch, len as u64);
        match landing {
            Some(landing) => {
                // SAFETY: as in `start_read`: the rest of the same frame.
                unsafe { self.ring.read_into(slot, fd, offset, landing, tag) }?
            }
            None => self.ring.read(slot, fd, offset, done, len, tag)?,
        }
        Ok(())
    }

    /// The memory the read in `slot` lands in: its ring buffer, or its block's frame.
    /// Only for a read that is not in flight.
    pub(super) fn landing(&mut self, slot: u32) -> &mut [u8] {
        let tag = self.ring.tag(slot).expect("a read in the ring");
        let len = tag.len;
        match &mut self.store {
            Some(store) => {
                let frame = self.regions[&tag.region].frame(tag.first);
                // SAFETY: the read has completed (or not started), so nothing else
                // writes the frame, and the service is its only user meanwhile.
                unsafe { store.bytes_mut(frame, len) }
            }
            None => {
                let region = &self.regions[&tag.region];
                match &region.view {
                    Some(view) => {
                        let start = region.region_offset(tag.file_offset);
                        // SAFETY: the read into the view has completed (or not started):
                        // the device writes there no more, and no process maps these
                        // pages until the block is installed.
                        unsafe { std::slice::from_raw_parts_mut(view.at(start), len) }
                    }
                    None => self.ring.buffer_mut(slot),
                }
            }
        }
    }

    pub(super) fn read_complete(&mut self, slot: u32) -> Result<(), ServiceError> {
        let now = self.now_ns();
        let tag = self.ring.tag(slot).expect("completing a read in flight");
        let (region_id, first, count, valid) = (tag.region, tag.first, tag.count, tag.valid);
        let elapsed = now.saturating_sub(tag.submitted_ns);
        let install = tag.install;
        let region = self.regions.get_mut(&region_id).expect("checked live");
        if region.file_changed() {
            self.fail_read(slot);
            return Ok(());
        }
        // Bytes past the end of the file in the last page read as zeros, as with mmap.
        let page = self.config.page_size as usize;
        let landing = self.landing(slot);
        let tail = valid..valid.next_multiple_of(page).min(landing.len());
        landing[tail].fill(0);
        if let Some(store) = &self.store {
            // Whether it is mapped now or held back, the service is done with the
            // frame's bytes: the process's resident set counts them once (the region's).
            store.forget_view(self.regions[&region_id].frame(first));
        }
        let region = &self.regions[&region_id];
        if let Some(view) = &region.view {
            let tag = self.ring.tag(slot).expect("completing a read in flight");
            view.forget(region.region_offset(tag.file_offset), tag.len);
        }
        self.read_latency.record_ns(elapsed);
        self.stats.bytes_read += valid as u64;
        self.stats.blocks_read += count as u64;
        let block = BlockRef::new(region_id, first);
        self.prefetch.read_completed(block, valid as u64, elapsed);
        let staged_max = max_staged(self.config.queue_depth, self.config.block_size);
        let landed = Landed {
            install,
            state: self.regions[&region_id].state(first),
            waited: self.waiters.contains_key(&block),
            in_place: self.store.is_some() || self.regions[&region_id].view.is_some(),
            marker_room: self.staged.len() < staged_max,
        };
        match landed.next() {
            NextForRead::HoldInPlace => {
                // With zero copy or reads in place the marker's bytes are already where
                // they will be mapped from: hold it back unmapped, and map it when the
                // program faults on it.
                let region = self.regions.get_mut(&region_id).expect("checked live");
                region.advance(first, BlockEvent::Staged(StagedIn::InPlace));
                self.keep_as_marker(slot);
                return Ok(());
            }
            NextForRead::HoldInStash => {
                let region = self.regions.get_mut(&region_id).expect("checked live");
                let memory = region.layout.block_memory(first);
                let len = (memory.end - memory.start) as usize;
                // With the stash full this marker is installed like any prefetch: the
                // markers already held are nearer the program, and they are the ones
                // that keep its position known.
                if let Some(stash) = self.stash.put(&self.ring.buffer(slot)[..len]) {
                    region.advance(first, BlockEvent::Staged(StagedIn::Stash(stash)));
                    self.keep_as_marker(slot);
                    return Ok(());
                }
            }
            NextForRead::Install => {}
        }
        // Installed after the next reads are submitted (`serve`), waited ones first:
        // issuing a read takes microseconds, mapping or copying a block far longer, and
        // the device would idle meanwhile.
        self.ready.push_back(slot);
        Ok(())
    }

    /// Holds the (one-block) read in `slot` back as a staged marker and frees the slot;
    /// the marker keeps the read's reservation until it is installed or discarded.
    fn keep_as_marker(&mut self, slot: u32) {
        let tag = self
            .ring
            .tag_mut(slot)
            .expect("completing a read in flight");
        tag.reserved = 0;
        self.staged.push_back(BlockRef::new(tag.region, tag.first));
        self.finish_read(slot);
    }

    /// Whether a thread waits on a block of the read in `slot`.
    pub(super) fn read_has_waiters(&self, slot: u32) -> bool {
        if self.waiters.is_empty() {
            return false;
        }
        let tag = self.ring.tag(slot).expect("a read in flight");
        (tag.first..tag.first + tag.count)
            .any(|index| self.waiters.contains_key(&BlockRef::new(tag.region, index)))
    }

    /// Releases a read's slot and reservation, whatever became of it.
    pub(super) fn finish_read(&mut self, slot: u32) {
        if let Some(tag) = self.ring.checkin(slot) {
            self.budget.unreserve(tag.reserved);
            self.load.finished(tag.prefetch);
            if let Some(region) = self.regions.get_mut(&tag.region) {
                region.reads_in_flight -= 1;
                if region.removed && region.reads_in_flight == 0 {
                    self.regions.remove(&tag.region);
                }
            }
        }
    }

    /// A read failed for good: threads waiting on its blocks get SIGBUS (their pages are
    /// poisoned); blocks nobody waits for are left missing, to be tried again on demand.
    /// A merged read is first split: each block is tried alone, so one bad sector costs
    /// one block, not its neighbours.
    pub(super) fn fail_read(&mut self, slot: u32) {
        let tag = self.ring.tag(slot).expect("failing a read in flight");
        let (region_id, first, count) = (tag.region, tag.first, tag.count);
        let now = self.now_ns();
        let region = self
            .regions
            .get_mut(&region_id)
            .expect("failing a live region's read");
        if region.view.is_some() && !(self.pages_kept || region.pages_kept) {
            // Read in place: whatever the read left in the file goes, so that nobody maps
            // it and the blocks are missing (or poisoned) there again.
            let memory = region.layout.block_memory(first).start
                ..region.layout.block_memory(first + count - 1).end;
            let _ = punch_region_pages(region, memory);
        }
        if count > 1 && !region.changed {
            for index in first..first + count {
                if region.state(index) == BlockState::Unmapped {
                    continue;
                }
                let block = BlockRef::new(region_id, index);
                if self.waiters.contains_key(&block) || region.pinned[index as usize] {
                    region.advance(index, BlockEvent::Requeued);
                    self.demand.push_back(block);
                } else {
                    region.advance(index, BlockEvent::ReadFailed);
                }
            }
            self.finish_read(slot);
            return;
        }
        let page = self.config.page_size as usize;
        self.stats.read_errors += 1;
        for index in first..first + count {
            // Emptied: the failed read's pages may still be in the service's view.
            release_frame(&mut self.store, region, index, true);
            if region.state(index) == BlockState::Unmapped {
                // Unmapped while it was read: nobody waits, nothing is mapped to poison.
                continue;
            }
            let block = BlockRef::new(region_id, index);
            let waited = self.waiters.remove(&block);
            let memory = region.layout.block_memory(index);
            if waited.is_some() || region.pinned[index as usize] {
                for part in region.mapped_parts(memory) {
                    self.stats.poisoned_pages +=
                        poison_range(&self.uffd, part.start, part.end - part.start, page);
                }
                region.advance(index, BlockEvent::Poisoned);
            } else {
                region.advance(index, BlockEvent::ReadFailed);
            }
            self.log.served(
                block,
                region.block_file_offset(index),
                region.layout.geometry.block_size,
                waited.into_iter().flatten(),
                now,
            );
        }
        self.finish_read(slot);
    }
}

#[cfg(test)]
mod tests;
