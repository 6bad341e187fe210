//! Fault intake: a userfaultfd event becomes a block's state change, a waiter, and news
//! for the policies (what was touched, what to prefetch, what to watch).

use std::os::fd::{AsFd, AsRawFd};

use userfaultfd::Event;

use super::block_state::{BlockEvent, BlockState};
use super::children::Source;
use super::fault_log::Waiter;
use super::page_tables::{continue_mapped, discard_pages, map_frame, page_present, poison_range};
use super::watch::Watch;
use super::{FaultService, ServiceError};
use crate::layout::Location;
use crate::policy::{BlockRef, FaultEvent, FaultOutcome, PrefetchRequest, RegionId, Urgency};
use crate::uffd_ext;

/// Most prefetch requests held waiting for a free read slot.
const MAX_QUEUED_PREFETCH: usize = 1 << 16;

/// A fault on a block of one of our regions.
#[derive(Copy, Clone, Debug)]
struct BlockFault {
    block: BlockRef,
    /// The faulting page's address.
    page_addr: usize,
    /// Whose userfaultfd it came on.
    source: Source,
    waiter: Waiter,
}

impl FaultService {
    /// The program's userfaultfd is readable (`Watch::Faults`): serves its faults.
    pub(super) fn faults_readable(&mut self, rearm: bool) -> Result<(), ServiceError> {
        self.drain_faults()?;
        if rearm {
            self.ring
                .watch(self.uffd.as_raw_fd(), Watch::Faults.token())?;
        }
        Ok(())
    }

    /// Serves every fault the program's userfaultfd has queued (and those read while an
    /// install waited for a fork, first).
    pub(super) fn drain_faults(&mut self) -> Result<(), ServiceError> {
        self.take_backlog()?;
        self.drain_from(Source::Parent)
    }

    /// Serves every fault `source`'s userfaultfd has queued, and adopts the children
    /// its fork events hand over.
    pub(super) fn drain_from(&mut self, source: Source) -> Result<(), ServiceError> {
        loop {
            self.fault_addrs.clear();
            let mut forked = Vec::new();
            let uffd = match source {
                Source::Parent => &*self.uffd,
                Source::Child(child) => match self.children.get(child) {
                    Some(uffd) => uffd,
                    None => return Ok(()),
                },
                // A guest's faults come as messages (`sharing::guest_readable`).
                Source::Guest(_) => return Ok(()),
            };
            let events = uffd
                .read_events(&mut self.events)
                .map_err(|error| ServiceError::Events(format!("{error:?}")))?;
            for event in events {
                // Page faults, and fork events where forked children are served: no
                // other events are enabled.
                match event.map_err(|error| ServiceError::Events(format!("{error:?}")))? {
                    Event::Pagefault {
                        addr, thread_id, ..
                    } => self
                        .fault_addrs
                        .push((addr as usize, thread_id.as_raw() as u32)),
                    Event::Fork { uffd } => forked.push(uffd),
                    _ => {}
                }
            }
            let adopted = !forked.is_empty();
            self.adopt_children(forked)?;
            if self.fault_addrs.is_empty() && !adopted {
                return Ok(());
            }
            let addrs = std::mem::take(&mut self.fault_addrs);
            self.serve_faults(&addrs, source)?;
            self.fault_addrs = addrs;
        }
    }

    /// Serves faults at `addrs` (address, thread) that came from `source`.
    pub(super) fn serve_faults(
        &mut self,
        addrs: &[(usize, u32)],
        source: Source,
    ) -> Result<(), ServiceError> {
        for &(addr, tid) in addrs {
            if let Some(fault) = self.locate_fault(addr, tid, source) {
                self.serve_block_fault(fault)?;
            }
        }
        Ok(())
    }

    /// The block a fault at `addr` by thread `tid` is on, or None when the fault was
    /// answered here (not a block of a live region: woken or poisoned).
    fn locate_fault(&mut self, addr: usize, tid: u32, source: Source) -> Option<BlockFault> {
        let now = self.now_ns();
        let page = self.page();
        let page_addr = addr & !(page - 1);
        let Some((id, offset)) = self.locator.lookup(addr) else {
            self.answer_outside_regions(source, page_addr);
            return None;
        };
        if let Source::Child(child) = source {
            if !self.children.maps(child, id) {
                // A region the program mapped after the fork, where the child still maps
                // one the program unmapped (and filled) before: not the child's.
                self.orphaned_child_fault(child, page_addr);
                return None;
            }
        }
        let region = self.regions.get(&id)?;
        let index = match region.layout.locate(offset) {
            Location::PastEof => {
                // As with a file mapping: a whole page past the end of the file is SIGBUS.
                if let Source::Guest(guest) = source {
                    self.answer_guest(guest, id.0, offset & !(page as u64 - 1), false);
                    return None;
                }
                poison_range(self.uffd_of(source), page_addr, page, page);
                return None;
            }
            Location::Block(index) => index,
        };
        if region.moving() {
            // The region is being made file-shaped for a fork (`shaping`): the thread
            // waits until the new mapping is in place, then is woken to fault there.
            return None;
        }
        let page_offset = offset & !(page as u64 - 1);
        let in_a_hole = region.cuts(page_offset..page_offset + page as u64);
        let unmapped = region.state(index) == BlockState::Unmapped;
        let block_start = region.layout.geometry.block_start(index);
        // A hole is a range the program unmapped: its own faults there are not on this
        // region (userfaultfd no longer covers it), only a child's or a guest's mapping
        // can still fault there.
        if unmapped || (in_a_hole && source != Source::Parent) {
            self.answer_unmapped_page(source, id, page_offset, page_addr);
            return None;
        }
        if let Source::Child(_) = source {
            self.stats.child_faults += 1;
        }
        Some(BlockFault {
            block: BlockRef::new(id, index),
            page_addr,
            source,
            waiter: Waiter {
                t_ns: now,
                tid,
                outcome: FaultOutcome::Missing,
                offset_in_block: (offset - block_start) as u32,
            },
        })
    }

    /// Answers a fault at `page_addr` where no live region is.
    fn answer_outside_regions(&mut self, source: Source, page_addr: usize) {
        match source {
            // Checked when the message came: not reached. Told to look for itself.
            Source::Guest(guest) => self.answer_guest_at(guest, page_addr, true),
            // The program unmapped the region the child still maps: nothing is served
            // there any more.
            Source::Child(child) => self.orphaned_child_fault(child, page_addr),
            // A range being unmapped: its owner is waiting for us to let go. Waking is
            // harmless; the thread retries against whatever is mapped there now.
            Source::Parent => {
                let _ = self.uffd.wake(page_addr as *mut libc::c_void, self.page());
            }
        }
    }

    /// Answers a fault on a page of region `id` that the program unmapped: a child's or
    /// a guest's inside a hole cut in the region, or anyone's on a block being unmapped.
    fn answer_unmapped_page(
        &mut self,
        source: Source,
        id: RegionId,
        page_offset: u64,
        page_addr: usize,
    ) {
        match source {
            // The guest reads the page into the memfd itself (it checks the page on
            // `Ready`).
            Source::Guest(guest) => self.answer_guest(guest, id.0, page_offset, true),
            // Installs go through the program's mapping and would never reach the
            // child's (the child would fault again and again): the page is written into
            // the file instead.
            Source::Child(child) => self.fill_page_for_child(child, id, page_offset, page_addr),
            // The program is unmapping the block: the service has been told, the
            // kernel's munmap follows. (A region of ours mapped there since is newer,
            // and `lookup` answers with it.) Woken, the thread faults again until the
            // range is gone, then as without a pager: SIGSEGV. Not a model access: the
            // policies do not hear of it.
            Source::Parent => {
                let _ = self.uffd.wake(page_addr as *mut libc::c_void, self.page());
            }
        }
    }

    /// Serves a fault on a block: by its state, maps, wakes, waits on a read or queues
    /// one; then tells the policies.
    fn serve_block_fault(&mut self, fault: BlockFault) -> Result<(), ServiceError> {
        let block = fault.block;
        self.stats.faults += 1;
        self.recent.record(fault.waiter.tid, block);
        self.check_injected_panic();
        let region = &self.regions[&block.region];
        // Read in place, a resident block's pages missing from a process's page tables
        // are its minor faults, served below; but one whose page is gone from the file
        // (punched by another process, MADV_REMOVE) would be answered by CONTINUE with a
        // wake-up, forever.
        let resident = region.state(block.index) == BlockState::Resident;
        let lost = match (&region.shape, region.minor) {
            (Some(shape), true) => {
                let offset = (fault.page_addr - region.base) as u64;
                resident && crate::sys::files::is_hole(shape.as_fd(), offset).unwrap_or(false)
            }
            _ => self.store.is_none() && resident && !page_present(fault.page_addr),
        };
        if lost {
            // Resident, yet the page is gone: dropped behind the service's back (advice
            // given to the kernel directly, say MADV_DONTNEED_LOCKED through a path the
            // shim does not see). Waking the thread, as for a fault that raced with the
            // install, would have it fault again forever: read the block again.
            let memory = region.layout.block_memory(block.index);
            self.drop_blocks(block.region, &memory, BlockEvent::Released)?;
            self.stats.lost_blocks += 1;
        }
        let (outcome, watch_fault) = self.fault_outcome(fault)?;
        match outcome {
            FaultOutcome::Missing => self.stats.demand_faults += 1,
            _ if watch_fault => self.stats.watch_faults += 1,
            _ => self.stats.prefetch_hits += 1,
        }
        if outcome == FaultOutcome::Resident {
            let region = &self.regions[&block.region];
            let file_offset = region.block_file_offset(block.index);
            let waiter = Waiter {
                outcome,
                ..fault.waiter
            };
            let done = self.now_ns();
            self.log
                .served(block, file_offset, self.config.block_size, [waiter], done);
        }
        self.tell_policies(&FaultEvent {
            block,
            time_ns: fault.waiter.t_ns,
            outcome,
            offset_in_block: Some(fault.waiter.offset_in_block),
        })
    }

    /// What the block's state makes of the fault, acted upon; and whether it was the
    /// first access to a watched block.
    fn fault_outcome(&mut self, fault: BlockFault) -> Result<(FaultOutcome, bool), ServiceError> {
        let block = fault.block;
        let region = self
            .regions
            .get_mut(&block.region)
            .expect("located in a live region");
        let waiter = |outcome| Waiter {
            outcome,
            ..fault.waiter
        };
        let outcome = match region.state(block.index) {
            BlockState::Resident => return self.fault_on_resident(fault),
            BlockState::Reading => FaultOutcome::InFlight,
            BlockState::Queued => {
                // Whatever queue it is in, it is now needed: serve it first.
                self.demand.push_back(block);
                FaultOutcome::InFlight
            }
            BlockState::Staged(place) => {
                self.unstage(block);
                self.waiters
                    .entry(block)
                    .or_default()
                    .push(waiter(FaultOutcome::Staged));
                self.wait_as_child(&fault);
                self.install_staged(block, place)?;
                return Ok((FaultOutcome::Staged, false));
            }
            BlockState::Missing | BlockState::Poisoned => {
                region.advance(block.index, BlockEvent::Queued);
                self.demand.push_back(block);
                FaultOutcome::Missing
            }
            BlockState::Unmapped => unreachable!("answered by locate_fault"),
        };
        self.waiters.entry(block).or_default().push(waiter(outcome));
        self.wait_as_child(&fault);
        Ok((outcome, false))
    }

    /// Installs wake the program's threads; a child's are woken (a guest's answered)
    /// once the block settles (`settle_children`), which this records.
    fn wait_as_child(&mut self, fault: &BlockFault) {
        if fault.source != Source::Parent {
            let base = self.regions[&fault.block.region].base;
            let offset = (fault.page_addr - base) as u64;
            self.children
                .wait(fault.source, fault.block, fault.page_addr, offset);
        }
    }

    /// A fault on a resident block, answered: its frame mapped again, its page
    /// continued from the file, or its thread woken. Whether it was the first access
    /// to a watched block.
    fn fault_on_resident(
        &mut self,
        fault: BlockFault,
    ) -> Result<(FaultOutcome, bool), ServiceError> {
        let block = fault.block;
        let region = self
            .regions
            .get_mut(&block.region)
            .expect("located in a live region");
        if let Some(store) = &self.store {
            // The install raced with the fault, the block is watched, or the program
            // dropped the pages of the frame's mapping (a minor fault): map the frame
            // again.
            map_frame(&self.uffd, store, region, block.index)?;
            let watched = &mut region.watched[block.index as usize];
            return Ok((FaultOutcome::Resident, std::mem::take(watched)));
        }
        // The fault raced with the install that already woke it (or, in a forked child,
        // the install woke the program's threads only); read in place, the block is in
        // the file but not yet in this process's page tables (a minor fault).
        let page = self.config.page_size as usize;
        let in_place = region.minor;
        let memory = region.layout.block_memory(block.index);
        if let Source::Guest(guest) = fault.source {
            self.answer_guest_at(guest, fault.page_addr, true);
        } else if in_place && fault.source == Source::Parent {
            continue_mapped(&self.uffd, region, memory, page);
            // Watched since the first fork made the region file-shaped.
            let watched = region.watched.get_mut(block.index as usize);
            return Ok((FaultOutcome::Resident, watched.is_some_and(std::mem::take)));
        } else if in_place {
            // A child: its mapping is the program's as it was at the fork.
            let (base, uffd) = (region.base, self.uffd_of(fault.source));
            let (start, len) = (base + memory.start as usize, memory.end - memory.start);
            uffd_ext::continue_or_wake(uffd.as_fd(), start, len as usize, page);
        } else {
            let _ = self
                .uffd_of(fault.source)
                .wake(fault.page_addr as *mut libc::c_void, page);
        }
        Ok((FaultOutcome::Resident, false))
    }

    /// Tells the policies of an access: eviction learns, prefetch plans, and (with zero
    /// copy) eviction names resident blocks to watch.
    fn tell_policies(&mut self, event: &FaultEvent) -> Result<(), ServiceError> {
        self.eviction.touched(event);
        let mut plan = std::mem::take(&mut self.plan);
        plan.clear();
        self.prefetch.plan(event, &mut plan);
        for request in plan.drain(..) {
            self.queue_prefetch(request);
        }
        self.plan = plan;
        // Regions announced to the policies as watched (zero copy: from frames, or read
        // in place since the first fork).
        if self.stats.zero_copy {
            let mut watch = std::mem::take(&mut self.watch);
            watch.clear();
            self.eviction.watch(&mut watch);
            for &block in &watch {
                self.watch_block(block)?;
            }
            self.watch = watch;
        }
        Ok(())
    }

    /// Drops the pages of a resident block and keeps its frame, so that the program's
    /// next access is a minor fault the policies hear of (`EvictionPolicy::watch`).
    fn watch_block(&mut self, block: BlockRef) -> Result<(), ServiceError> {
        let Some(region) = self.regions.get_mut(&block.region) else {
            return Ok(());
        };
        if !region.evictable(block.index) {
            self.breaches.record(format_args!(
                "the eviction policy watched {block:?}, not evictable"
            ));
            return Ok(());
        }
        if region.watched.is_empty() || region.moving() {
            // Not a region of frames or one made file-shaped at a fork (or one being
            // moved): its resident blocks are not watched.
            return Ok(());
        }
        if std::mem::replace(&mut region.watched[block.index as usize], true) {
            return Ok(());
        }
        self.stats.watched_blocks += 1;
        let memory = region.layout.block_memory(block.index);
        for part in region.mapped_parts(memory) {
            discard_pages(part.start, part.end)?;
        }
        Ok(())
    }

    /// Queues a prefetch of a missing block (others are in memory or on their way).
    pub(super) fn queue_prefetch(&mut self, request: PrefetchRequest) {
        if self.prefetch_queue.len() + self.idle_fill.len() >= MAX_QUEUED_PREFETCH {
            return;
        }
        let Some(region) = self.regions.get_mut(&request.block.region) else {
            return;
        };
        if request.block.index < region.block_count()
            && region.state(request.block.index) == BlockState::Missing
        {
            region.advance(request.block.index, BlockEvent::Queued);
            match request.urgency {
                Urgency::Ahead => self.prefetch_queue.push_back(request),
                Urgency::IdleFill => self.idle_fill.push_back(request.block),
            }
        }
    }
}
