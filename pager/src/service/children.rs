//! Forked children (`PagerBuilder::serve_forks`): each fork of the program (or of a
//! child) hands the service a new userfaultfd for the child's copy of the regions
//! (`UFFD_FEATURE_EVENT_FORK`). The service polls it on the ring like the program's,
//! serves its faults from the same block states and budget (the regions are
//! file-shaped: a block installed for one process is in the file every process maps),
//! and wakes the child's threads once their block settles, since installs wake only
//! the program's.
//!
//! The kernel says nothing when a child exits or execs: its userfaultfd never hangs up
//! and no event comes. `UFFDIO_CONTINUE` tells (ESRCH once the address space has no
//! users, `sys::userfaultfd::uffd_process_alive`); the service asks every child at each stats
//! publication and closes the userfaultfds of those gone.
//!
//! A fork makes the parent's UFFDIO_COPY fail with EAGAIN from the moment the child's
//! copy of a registered range is made until the service has read the fork event (the
//! forking thread waits for that too). An install that meets it reads the program's
//! events into `Backlog` and tries again (`page_tables::install`); the backlog is served
//! right after.

use std::os::fd::{AsFd, AsRawFd};

use userfaultfd::{Event, EventBuffer, Uffd};

use super::block_state::BlockState;
use super::page_tables::poison_range;
use super::watch::Watch;
use super::{FaultService, ServiceError};
use crate::policy::{BlockRef, RegionId};
use crate::uffd_ext;

/// Where to ask whether a child lives when no region is left: above any
/// `vm.mmap_min_addr`, below any task size.
const PROBE_WITHOUT_REGIONS: usize = 1 << 30;

/// Whose userfaultfd a fault came on.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) enum Source {
    /// The program's (the process the service runs in).
    Parent,
    /// A forked child's, by its number (`Watch::Child`).
    Child(u32),
    /// A guest's (another process of the run mapping a region's file, `sharing`), by
    /// its number (`Watch::Guest`): answered with a message, not on a userfaultfd.
    Guest(u32),
}

/// What a child's thread waiting on a block needs, by the block's state.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) enum Settle {
    /// Its read is queued or in flight: keep waiting.
    Wait,
    /// Its bytes are in the file: wake the thread, which maps them.
    Wake,
    /// Its read failed for good, or the program unmapped it: SIGBUS, as a file mapping
    /// gives for an unreadable page.
    Poison,
}

/// The decision for a child's waiter on a block in `state` (None: the region is gone).
pub(super) fn settle(state: Option<BlockState>) -> Settle {
    match state {
        Some(BlockState::Queued | BlockState::Reading | BlockState::Staged(_)) => Settle::Wait,
        Some(BlockState::Resident) => Settle::Wake,
        // A block left missing (a prefetch read that failed): woken, the thread faults
        // again and the block is read on demand.
        Some(BlockState::Missing) => Settle::Wake,
        Some(BlockState::Poisoned | BlockState::Unmapped) | None => Settle::Poison,
    }
}

struct Child {
    uffd: Uffd,
    /// Its number (`Watch::Child`).
    number: u32,
    /// The regions it was forked with: an address the program maps another region at
    /// since (after unmapping one the child still maps) is not this child's.
    regions: Vec<RegionId>,
}

/// A child's thread waiting on a block, or a guest's fault.
struct ChildWait {
    /// `Source::Child` or `Source::Guest`: the program's threads are woken by installs.
    source: Source,
    block: BlockRef,
    page_addr: usize,
    /// The page's offset in its region (a guest is answered with it).
    offset: u64,
}

/// The forked children served, and their threads waiting.
#[derive(Default)]
pub(super) struct Children {
    list: Vec<Child>,
    /// The number the next child adopted gets.
    next_number: u32,
    waits: Vec<ChildWait>,
    /// Whether the one message for a child faulting where the program unmapped its
    /// region was written.
    said_orphaned: bool,
}

impl Children {
    /// Whether child `number` was forked with region `id` (unknown children: no).
    pub(super) fn maps(&self, number: u32, id: RegionId) -> bool {
        self.list
            .iter()
            .any(|child| child.number == number && child.regions.contains(&id))
    }

    /// Child `number`'s userfaultfd (None: it is gone).
    pub(super) fn get(&self, number: u32) -> Option<&Uffd> {
        self.list
            .iter()
            .find(|child| child.number == number)
            .map(|child| &child.uffd)
    }

    /// Records that a fault from `source` (a child or a guest) waits on `block`.
    pub(super) fn wait(&mut self, source: Source, block: BlockRef, page_addr: usize, offset: u64) {
        debug_assert_ne!(
            source,
            Source::Parent,
            "installs wake the program's threads"
        );
        self.waits.push(ChildWait {
            source,
            block,
            page_addr,
            offset,
        });
    }

    /// Forgets what `source` (a child or guest gone) waited for.
    pub(super) fn forget_waits(&mut self, source: Source) {
        self.waits.retain(|wait| wait.source != source);
    }

    pub(super) fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// Every child's userfaultfd.
    pub(super) fn uffds(&self) -> impl Iterator<Item = &Uffd> {
        self.list.iter().map(|child| &child.uffd)
    }

    pub(super) fn live(&self) -> u64 {
        self.list.len() as u64
    }
}

/// What was read from the program's userfaultfd while an install waited on a fork.
#[derive(Default)]
pub(super) struct Backlog {
    faults: Vec<(usize, u32)>,
    forks: Vec<Uffd>,
}

impl Backlog {
    pub(super) fn is_empty(&self) -> bool {
        self.faults.is_empty() && self.forks.is_empty()
    }

    /// Makes room for `faults` and `forks` more without allocating (`fork_pause`).
    pub(super) fn reserve(&mut self, faults: usize, forks: usize) {
        self.faults.reserve(faults);
        self.forks.reserve(forks);
    }

    /// Keeps a fault if there is room for it without allocating; past that its thread
    /// is woken instead (it faults again, and is heard of then).
    pub(super) fn push_fault_within_room(&mut self, addr: usize, tid: u32) -> bool {
        if self.faults.len() < self.faults.capacity() {
            self.faults.push((addr, tid));
            true
        } else {
            false
        }
    }

    /// Keeps a child's userfaultfd. Never dropped for want of room: closing it would
    /// leave the child's regions unserved, reading zeros.
    pub(super) fn push_fork_within_room(&mut self, uffd: Uffd) {
        self.forks.push(uffd);
    }
}

/// Reads the program's pending events into `backlog` (an install met EAGAIN: a fork is
/// waiting for its event to be read).
pub(super) fn read_into_backlog(uffd: &Uffd, events: &mut EventBuffer, backlog: &mut Backlog) {
    if let Ok(read) = uffd.read_events(events) {
        for event in read.flatten() {
            match event {
                Event::Pagefault {
                    addr, thread_id, ..
                } => backlog
                    .faults
                    .push((addr as usize, thread_id.as_raw() as u32)),
                Event::Fork { uffd } => backlog.forks.push(uffd),
                _ => {}
            }
        }
    }
    std::thread::yield_now();
}

impl FaultService {
    /// The userfaultfd faults from `source` are answered on (the program's for a child
    /// gone meanwhile: the answer then reaches nobody).
    pub(super) fn uffd_of(&self, source: Source) -> &Uffd {
        match source {
            Source::Parent => &self.uffd,
            Source::Child(child) => self.children.get(child).unwrap_or(&self.uffd),
            Source::Guest(_) => &self.uffd,
        }
    }

    /// Starts serving the children whose userfaultfds fork events handed over.
    pub(super) fn adopt_children(&mut self, forked: Vec<Uffd>) -> Result<(), ServiceError> {
        // What a fork copies: the regions the program maps now (a grandchild's are its
        // parent's at most, which these include).
        let live: Vec<RegionId> = self
            .regions
            .iter()
            .filter(|(_, region)| !region.removed)
            .map(|(&id, _)| id)
            .collect();
        for uffd in forked {
            let number = self.children.next_number;
            self.children.next_number += 1;
            self.ring
                .watch(uffd.as_raw_fd(), Watch::Child(number).token())?;
            self.tell_keeper_child(number, &uffd);
            self.children.list.push(Child {
                uffd,
                number,
                regions: live.clone(),
            });
            self.stats.forked_children += 1;
        }
        self.stats.live_children = self.children.live();
        Ok(())
    }

    /// Child `number`'s userfaultfd is readable: serves its faults. Readiness of
    /// children already closed is ignored.
    pub(super) fn child_readable(&mut self, number: u32, rearm: bool) -> Result<(), ServiceError> {
        let Some(uffd) = self.children.get(number) else {
            return Ok(());
        };
        let fd = uffd.as_raw_fd();
        self.drain_from(Source::Child(number))?;
        if rearm {
            self.ring.watch(fd, Watch::Child(number).token())?;
        }
        Ok(())
    }

    /// Serves what an install read from the program's userfaultfd while it waited.
    pub(super) fn take_backlog(&mut self) -> Result<(), ServiceError> {
        if self.backlog.is_empty() {
            return Ok(());
        }
        let backlog = std::mem::take(&mut self.backlog);
        self.adopt_children(backlog.forks)?;
        self.serve_faults(&backlog.faults, Source::Parent)
    }

    /// Wakes (or poisons) the children's threads whose blocks are no longer on their
    /// way.
    pub(super) fn settle_children(&mut self) {
        if self.children.waits.is_empty() {
            return;
        }
        let page = self.page();
        let mut waits = std::mem::take(&mut self.children.waits);
        let mut gone = Vec::new();
        waits.retain(|wait| {
            let state = self
                .regions
                .get(&wait.block.region)
                .filter(|region| !region.removed)
                .map(|region| region.state(wait.block.index));
            let child = match wait.source {
                Source::Guest(guest) => {
                    // A region unmapped meanwhile was filled for the guests first: told
                    // ready, the guest checks the page and reads it itself if need be.
                    let ready = match settle(state) {
                        Settle::Wait => return true,
                        Settle::Wake => true,
                        Settle::Poison => state != Some(BlockState::Poisoned),
                    };
                    self.answer_guest(guest, wait.block.region.0, wait.offset, ready);
                    return false;
                }
                Source::Child(child) => child,
                // Never recorded (`Children::wait`): installs wake the program's threads.
                Source::Parent => return false,
            };
            let Some(uffd) = self.children.get(child) else {
                return false;
            };
            match settle(state) {
                Settle::Wait => true,
                Settle::Wake => {
                    // Read in place, the child maps the block from the file itself (its
                    // mapping is the program's as it was at the fork); copied in, the
                    // page is there and the child's fault maps it.
                    let region = &self.regions[&wait.block.region];
                    match (region.minor, state) {
                        (true, Some(BlockState::Resident)) => {
                            let memory = region.layout.block_memory(wait.block.index);
                            let start = region.base + memory.start as usize;
                            let len = (memory.end - memory.start) as usize;
                            uffd_ext::continue_or_wake(uffd.as_fd(), start, len, page);
                        }
                        _ => {
                            let _ = uffd.wake(wait.page_addr as *mut libc::c_void, page);
                        }
                    }
                    false
                }
                // The program unmapped the block, or the region, while it was read: the
                // child still maps it, and is served as any fault of its there.
                Settle::Poison if state != Some(BlockState::Poisoned) => {
                    gone.push((child, wait.block.region, wait.offset, wait.page_addr));
                    false
                }
                Settle::Poison => {
                    self.stats.poisoned_pages += poison_range(uffd, wait.page_addr, page, page);
                    false
                }
            }
        });
        // Waits recorded meanwhile (none: nothing above faults) go after these.
        waits.append(&mut self.children.waits);
        self.children.waits = waits;
        for (child, id, offset, page_addr) in gone {
            match self.regions.get(&id).filter(|region| !region.removed) {
                Some(_) => {
                    self.fill_page_for_child(child, id, offset & !(page as u64 - 1), page_addr)
                }
                None => self.orphaned_child_fault(child, page_addr),
            }
        }
    }

    /// A child faulted where the program no longer maps a region: SIGBUS there, with
    /// one message for the run.
    pub(super) fn orphaned_child_fault(&mut self, child: u32, page_addr: usize) {
        let page = self.page();
        let Some(uffd) = self.children.get(child) else {
            return;
        };
        // Registered for minor faults, the child faults on pages the file holds too: the
        // program filled the region before it let it go, and such a page is mapped.
        if uffd_ext::continue_page(uffd.as_fd(), page_addr, page) {
            return;
        }
        self.stats.poisoned_pages += poison_range(uffd, page_addr, page, page);
        if !std::mem::replace(&mut self.children.said_orphaned, true) {
            crate::sys::files::write_stderr(
                b"hyperoffload: a forked child read a model range its parent has unmapped: \
                  the pager no longer serves it there (SIGBUS)\n",
            );
        }
    }

    /// Closes the userfaultfds of children that exited or exec'd.
    pub(super) fn reap_children(&mut self) -> Result<(), ServiceError> {
        if self.children.is_empty() {
            return Ok(());
        }
        // A registered address, where the probe changes nothing; without a region (the
        // program unmapped them all, as at its exit) any address the kernel accepts,
        // where the probe finds nothing of this userfaultfd's (ENOENT).
        let addr = self
            .regions
            .values()
            .find(|region| !region.removed)
            .map_or(PROBE_WITHOUT_REGIONS, |region| region.base);
        let mut gone = Vec::new();
        self.children.list.retain(|child| {
            let alive = crate::sys::userfaultfd::uffd_process_alive(child.uffd.as_fd(), addr);
            if !alive {
                gone.push(child.number);
            }
            alive
        });
        for number in gone {
            self.ring.unwatch(Watch::Child(number).token())?;
            self.tell_keeper_child_gone(number);
            self.children.forget_waits(Source::Child(number));
        }
        self.stats.live_children = self.children.live();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::service::block_state::StagedIn;

    #[test]
    fn a_childs_thread_waits_for_reads_and_is_woken_or_told_after() {
        assert_eq!(settle(Some(BlockState::Queued)), Settle::Wait);
        assert_eq!(settle(Some(BlockState::Reading)), Settle::Wait);
        assert_eq!(
            settle(Some(BlockState::Staged(StagedIn::InPlace))),
            Settle::Wait
        );
        assert_eq!(settle(Some(BlockState::Resident)), Settle::Wake);
        assert_eq!(settle(Some(BlockState::Missing)), Settle::Wake);
        assert_eq!(settle(Some(BlockState::Poisoned)), Settle::Poison);
        assert_eq!(settle(Some(BlockState::Unmapped)), Settle::Poison);
        assert_eq!(settle(None), Settle::Poison, "the region is gone");
    }
}
