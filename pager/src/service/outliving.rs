//! Forked children that outlive the service (`PagerBuilder::serve_forks`).
//!
//! The service is a thread of the program. When the program exits or drops its pager,
//! every child's userfaultfd closes with it; the kernel then unregisters the children's
//! ranges, and a shared-memory fault on a hole of a region's file maps a new page of
//! zeros. A child would read zeros wherever a block was not resident. So, before that,
//! while any child lives, every hole of every region's file is filled with the file's
//! bytes (beyond the budget: the children then hold all of what they map, in memory
//! they share), and from then on nothing is punched out of the files again
//! (`FaultService::pages_kept`). The same holds for one region the program unmaps while
//! children live: its file is filled before the service forgets it, so a child goes on
//! reading the file's bytes there; and for a page a child faults on where the program
//! unmapped part of a region after the fork (installs go through the program's mapping,
//! so would never reach the child's): that page is written into the file, and the child
//! woken.
//!
//! Filling (`crate::hole_fill`) writes into the holes only. A block the service
//! installs later meets EEXIST and counts as installed, with the same bytes.
//!
//! When the program ends without this (`_exit`, a fatal signal, an exec), the keeper
//! outside it fills the same files (`crate::keeper`).

use std::os::fd::AsFd;

use super::block_state::BlockState;
use super::page_tables::punch_region_pages;
use super::region::ServedRegion;
use super::{FaultService, ServiceError};
use crate::hole_fill::{chunk_around, fill_holes, rewrite, FillSource, Filled, FILL_CHUNK};
use crate::policy::RegionId;
use crate::ring::Completion;

/// Fills every hole of `region`'s file (file-shaped regions only) with the bytes of the
/// file it maps, using `buffer` (`FILL_CHUNK` bytes). Read in place (with no read in
/// flight: `finish_reads_in_flight`), the pages of every block that is neither resident
/// nor held back are punched out first: a read that failed, or one whose block was
/// dropped while it was read, may have left pages there that a fill, which writes only
/// holes, would trust.
fn fill_region(region: &ServedRegion, buffer: &mut [u8]) -> Filled {
    let Some(shape) = &region.shape else {
        return Filled::default();
    };
    if region.minor {
        for index in 0..region.block_count() {
            if !matches!(
                region.state(index),
                BlockState::Resident | BlockState::Staged(_)
            ) {
                let _ = punch_region_pages(region, region.layout.block_memory(index));
            }
        }
    }
    let geometry = &region.layout.geometry;
    let source = FillSource {
        file: region.file.buffered(),
        file_offset: geometry.file_offset,
        data_len: geometry.data_len,
    };
    fill_holes(shape.as_fd(), region.shape_len, source, buffer)
}

impl FaultService {
    /// Waits until no read is in flight, completing each (readiness of the userfaultfds
    /// and the command channel is kept for the next turn), and installs the reads that
    /// finished. Read in place, a read in flight pins pages of a region's file as it
    /// goes: a fill, which writes only holes, would trust pages pinned after it looked.
    /// (Waiting for the slots to be free would wait forever: a finished read holds its
    /// slot until it is installed.)
    pub(super) fn finish_reads_in_flight(&mut self) -> Result<(), ServiceError> {
        while self.ring.reads_pending() > 0 {
            self.ring.submit_and_wait(1)?;
            let mut completions = Vec::new();
            self.ring.reap(&mut completions);
            for completion in completions {
                match completion {
                    Completion::Read { slot, result } => self.read_done(slot, result)?,
                    other => self.deferred.push(other),
                }
            }
        }
        for slot in std::mem::take(&mut self.ready) {
            self.install_read(slot)?;
        }
        Ok(())
    }

    /// The service is about to stop (the program exits, or drops its pager): if forked
    /// children still live, fills every region's file so they read the file's bytes
    /// after it, and keeps those pages from then on. Said once, with the bytes.
    pub(super) fn fill_for_outliving_children(&mut self) -> Result<(), ServiceError> {
        if !self.config.serve_forks {
            return Ok(());
        }
        // A fork that returned has had its event read, maybe into the backlog only.
        self.take_backlog()?;
        self.reap_children()?;
        if self.children.is_empty() && !self.has_guests() {
            return Ok(());
        }
        if self.config.read_in_place {
            self.finish_reads_in_flight()?;
        }
        // From here on an eviction must not make a hole again.
        self.pages_kept = true;
        let mut buffer = vec![0u8; FILL_CHUNK as usize];
        let mut bytes = 0;
        let mut failures = Vec::new();
        for region in self.regions.values().filter(|region| !region.removed) {
            let filled = fill_region(region, &mut buffer);
            bytes += filled.bytes;
            if let Some(error) = filled.error {
                failures.push(format!("{}: {error}", region.file.path().display()));
            }
        }
        self.stats.child_fill_bytes += bytes;
        let ids: Vec<RegionId> = self.regions.keys().copied().collect();
        for id in ids {
            self.wake_region(id);
        }
        self.say_filled("outlive this process", bytes, &failures);
        Ok(())
    }

    /// Region `id` is being removed while forked children may still map it: fills its
    /// file first (see the module's comment).
    pub(super) fn fill_removed_for_children(&mut self, id: RegionId) -> Result<(), ServiceError> {
        if !self.config.serve_forks {
            return Ok(());
        }
        self.take_backlog()?;
        if self.children.is_empty() && !self.has_guests() {
            return Ok(());
        }
        self.reap_children()?;
        if self.children.is_empty() && !self.has_guests() {
            return Ok(());
        }
        if self.config.read_in_place {
            self.finish_reads_in_flight()?;
        }
        let Some(region) = self.regions.get(&id) else {
            return Ok(());
        };
        let mut buffer = vec![0u8; FILL_CHUNK as usize];
        let filled = fill_region(region, &mut buffer);
        let failures: Vec<String> = filled
            .error
            .iter()
            .map(|error| format!("{}: {error}", region.file.path().display()))
            .collect();
        self.stats.child_fill_bytes += filled.bytes;
        if let Some(region) = self.regions.get_mut(&id) {
            // Its pages are the children's now: nothing punches them out again (the
            // removal's discarded markers included).
            region.pages_kept = true;
        }
        self.wake_region(id);
        self.say_filled(
            "still map a model this process unmapped",
            filled.bytes,
            &failures,
        );
        Ok(())
    }

    /// A child faulted on the page at `page_offset` of region `id`, which the program
    /// has unmapped (all or part of its block): writes the file's bytes there and wakes
    /// the child's thread; SIGBUS only if that fails.
    pub(super) fn fill_page_for_child(
        &mut self,
        child: u32,
        id: RegionId,
        page_offset: u64,
        page_addr: usize,
    ) {
        let page = self.page();
        // Read in place, the whole huge page around it (`hole_fill::chunk_around`): one
        // page written into a hole of a huge-page file would leave its neighbours present
        // as zeros. Copied in, the page alone: a page written into the file maps in the
        // program with no fault, outside the budget.
        let written = self.regions.get(&id).and_then(|region| {
            let shape = region.shape.as_ref()?;
            let geometry = &region.layout.geometry;
            let source = FillSource {
                file: region.file.buffered(),
                file_offset: geometry.file_offset,
                data_len: geometry.data_len,
            };
            let range = match region.minor {
                true => chunk_around(page_offset, geometry.data_len)?,
                false => {
                    let end = (page_offset + page as u64).min(geometry.data_len);
                    (page_offset < end).then_some(page_offset..end)?
                }
            };
            rewrite(shape.as_fd(), source, range.clone()).ok()?;
            Some((region.base, range))
        });
        match written {
            Some((base, chunk)) => {
                self.stats.child_fill_bytes += chunk.end - chunk.start;
                if let Some(uffd) = self.children.get(child) {
                    // Mapped from the file where the child's range is registered for
                    // minor faults (reads in place), else woken to map it itself.
                    let start = base + chunk.start as usize;
                    let len = ((chunk.end - chunk.start) as usize).next_multiple_of(page);
                    crate::uffd_ext::continue_or_wake(uffd.as_fd(), start, len, page);
                }
            }
            None => self.orphaned_child_fault(child, page_addr),
        }
    }

    /// Wakes every thread, of the program and of the children, waiting on a page of
    /// region `id`: a page filled while its fault waited is never installed by the
    /// service (UFFDIO_COPY meets EEXIST and wakes nobody); woken, the thread finds it.
    fn wake_region(&self, id: RegionId) {
        let Some(region) = self.regions.get(&id) else {
            return;
        };
        let (base, len) = (
            region.base as *mut libc::c_void,
            region.layout.map_len as usize,
        );
        let _ = self.uffd.wake(base, len);
        for uffd in self.children.uffds() {
            let _ = uffd.wake(base, len);
        }
    }

    fn say_filled(&mut self, why: &str, bytes: u64, failures: &[String]) {
        let live = self.children.live();
        let guests = self.guest_count();
        let who = if guests == 0 {
            format!("{live} forked child process(es)")
        } else {
            format!(
                "{live} forked child process(es) and {guests} other process(es) of the run \
                 attached to its regions"
            )
        };
        let mut message = format!(
            "hyperoffload: {who} {why}: filled {:.1} MiB of the \
             models they map from the files, beyond the budget, so that they read the \
             files' bytes without the pager\n",
            bytes as f64 / (1 << 20) as f64
        );
        if !failures.is_empty() {
            message.push_str(&format!(
                "hyperoffload: filling failed ({}): those children read zeros where a block \
                 was not resident\n",
                failures.join("; ")
            ));
        }
        // Not through stderr's lock, which a faulting thread may hold.
        crate::sys::files::write_stderr(message.as_bytes());
    }
}
