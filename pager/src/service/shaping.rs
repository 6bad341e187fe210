//! Serving forks from the program's first fork on (`PagerBuilder::serve_forks_at_fork`):
//! regions start mapped from frames (zero copy, the fastest way to serve one process),
//! and the first fork makes them file-shaped (`crate::shaped_region`, read in place), so
//! that the child inherits them and the service serves it from the same blocks and
//! budget.
//!
//! A frame cannot be inherited: it is reused for another block by mapping it elsewhere
//! in the program, and a child's copy of the mapping would not follow. So, before the
//! fork (`Command::ShapeForFork`, from `pager::fork_guard`'s prepare handler), the
//! service:
//! 1. finishes the reads in flight and installs those done (they land in frames; a
//!    completion the service has taken off the ring but not yet handled is handled
//!    after, against the file, which by then holds what the frame held);
//! 2. makes each region's file and maps it at a new address, registered for missing and
//!    minor faults, with the program's protection: if any of that fails for any region,
//!    nothing changes and children map the files from the page cache, as without this;
//! 3. writes each held block's bytes from its frame into the file (`pwrite` allocates
//!    the file's pages without clearing them first) and frees the frame, one block at a
//!    time, so the memory held grows by one block at most; a block that cannot be written
//!    is evicted instead;
//! 4. answers with the moves: each part of the region the program still maps, from the
//!    new mapping onto the region, which the forking thread makes with `mremap`.
//!
//! `mremap` moves the new mapping's userfaultfd registration with it
//! (`UFFD_FEATURE_EVENT_REMAP`; the service only has to read the event, which the
//! move waits for) and replaces the old mapping in one step: no thread ever sees the
//! range unregistered, where a hole of the file would read as zeros. Until the forking
//! thread says the moves are made (`Command::ShapedForFork`), the region has a
//! `pending_move`: a fault on the old mapping is left waiting (its block's frame may be
//! gone already, and nothing may be mapped there), and commands that would add, remove
//! or unmap a region wait too (`Command::waits_for_moves`). Then the waiting threads
//! are woken, fault again on the new mapping and are served from the file. The frame
//! store is let go: every region, and every region mapped from now on, is read in
//! place. The policies go on watching the converted regions' resident blocks (their
//! page-table entries in the program dropped, the file keeping the pages, so the next
//! access is a minor fault they hear of), as they did with frames; regions
//! file-shaped from the start are not watched.

use std::ops::Range;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::Ordering;

use userfaultfd::RegisterMode;

use super::block_state::{BlockEvent, BlockState, StagedIn};
use super::page_tables::release_frame;
use super::region::PendingMove;
use super::{FaultService, ServiceError};
use crate::command::RegionMove;
use crate::policy::RegionId;
use crate::shaped_region::{FileView, ShapeFiles};
use crate::sys;

/// A region's new mapping, made but not yet moved over the region: unmapped when
/// dropped (a conversion given up).
struct NewMapping {
    addr: usize,
    len: usize,
}

impl Drop for NewMapping {
    fn drop(&mut self) {
        // SAFETY: the mapping is this value's own; nothing refers into it.
        let _ = unsafe { sys::memory::munmap(self.addr, self.len) };
    }
}

/// Everything a region needs to become file-shaped, made before anything changes.
struct Prepared {
    id: RegionId,
    file: OwnedFd,
    view: FileView,
    mapping: NewMapping,
}

impl FaultService {
    /// Carries out `Command::ShapeForFork` (see the module's comment): the moves to
    /// make, none if the regions stay as they are.
    pub(super) fn shape_for_fork(&mut self) -> Result<Vec<RegionMove>, ServiceError> {
        let Some(files) = self.config.shape_at_fork.clone() else {
            return Ok(Vec::new());
        };
        if self.config.serve_forks || self.store.is_none() {
            return Ok(Vec::new());
        }
        // Reads land in frames: finished and installed first. A finished read the
        // service holds back keeps its bytes in its frame, written below as well.
        self.finish_reads_in_flight()?;
        let prepared = match self.prepare_shapes(&files) {
            Ok(prepared) => prepared,
            Err(error) => {
                // Once: a later fork would fail the same way.
                self.config.shape_at_fork = None;
                let message = format!(
                    "hyperoffload: cannot make the regions inheritable at this fork \
                     ({error}): forked children map the model files from the page cache, \
                     outside the budget\n"
                );
                sys::files::write_stderr(message.as_bytes());
                self.stats.forks_refused = Some(error.to_string());
                return Ok(Vec::new());
            }
        };
        let mut moves = Vec::new();
        for prepared in prepared {
            moves.extend(self.shape_region(prepared)?);
        }
        if let Some(store) = self.store.take() {
            (
                self.stats.frame_memory_bytes,
                self.stats.peak_frame_memory_bytes,
            ) = store.memory_bytes();
            self.stats.frame_memory_bytes = 0;
        }
        self.config.serve_forks = true;
        self.config.read_in_place = true;
        self.stats.serve_forks = true;
        self.stats.forks_refused = None;
        if moves.is_empty() {
            // Nothing to move (no region, or none the program still maps).
            self.shared.serving_forks.store(true, Ordering::Release);
        }
        Ok(moves)
    }

    /// Each live region's file, the service's view of it and its new mapping.
    fn prepare_shapes(&self, files: &ShapeFiles) -> std::io::Result<Vec<Prepared>> {
        let mut prepared = Vec::new();
        for (&id, region) in &self.regions {
            if region.removed {
                continue;
            }
            let geometry = &region.layout.geometry;
            let len = geometry.data_len.next_multiple_of(self.config.page_size);
            let huge = (0..region.block_count())
                .all(|index| region.layout.block_memory(index).start % sys::memory::HUGE_PAGE == 0)
                && self.config.block_size % sys::memory::HUGE_PAGE == 0;
            let file = files.create(len, huge)?;
            let view = FileView::new(&file, len)?;
            // Inaccessible until registered: under mlockall(MCL_FUTURE) an accessible
            // mapping would be filled at once, with the file's holes as zeros.
            let addr = sys::memory::map_shared_inaccessible(file.as_fd(), len as usize)?;
            let mapping = NewMapping {
                addr,
                len: len as usize,
            };
            self.uffd
                .register_with_mode(
                    addr as *mut libc::c_void,
                    len as usize,
                    RegisterMode::MISSING | RegisterMode::MINOR,
                )
                .map_err(|error| std::io::Error::other(format!("{error:?}")))?;
            // SAFETY: the mapping just made, registered, which nothing uses yet.
            unsafe { sys::memory::mprotect(addr, len as usize, region.prot) }?;
            prepared.push(Prepared {
                id,
                file,
                view,
                mapping,
            });
        }
        Ok(prepared)
    }

    /// Moves a prepared region's blocks from their frames into its file, makes it
    /// file-shaped and moving, and returns the moves of the parts the program maps.
    fn shape_region(&mut self, prepared: Prepared) -> Result<Vec<RegionMove>, ServiceError> {
        let Prepared {
            id,
            file,
            view,
            mapping,
        } = prepared;
        let shape_len = mapping.len as u64;
        let region = self
            .regions
            .get_mut(&id)
            .expect("prepared for a live region");
        let mut unwritten = Vec::new();
        for index in 0..region.block_count() {
            let Some(frame) = region.frames[index as usize] else {
                continue;
            };
            // Read, installed or not, or held back: the frame has the block's bytes.
            let holds_bytes = matches!(
                region.state(index),
                BlockState::Resident | BlockState::Reading | BlockState::Staged(StagedIn::InPlace)
            );
            if holds_bytes {
                let memory = region.layout.block_memory(index);
                let end = memory.end.min(shape_len);
                let store = self.store.as_ref().expect("checked by shape_for_fork");
                // SAFETY: the frame is this block's and is not reused while the service,
                // this thread, copies it. It holds the block's bytes, unless a read whose
                // completion is still unhandled landed short or failed: then the read's
                // handling finishes the block in the file as it would have in the frame
                // (the rest read, the tail zeroed, or the pages punched), and minor
                // faults keep every process waiting until then.
                let bytes = unsafe {
                    std::slice::from_raw_parts(store.view(frame), (end - memory.start) as usize)
                };
                if write_all_at(&file, bytes, memory.start).is_err() {
                    unwritten.push(index);
                }
            }
            release_frame(&mut self.store, region, index, true);
        }
        region.frames = Vec::new();
        // Every block's pages are missing from the new mapping: the first access to each
        // is a minor fault, as to a watched one, but not news to the policies.
        region.watched.fill(false);
        region.shape_len = shape_len;
        region.view = Some(view);
        region.minor = true;
        region.shape = Some(file);
        let live: Vec<Range<u64>> = region
            .mapped_parts(0..shape_len)
            .into_iter()
            .map(|part| (part.start - region.base) as u64..(part.end - region.base) as u64)
            .collect();
        let moves = moves_over(mapping.addr, region.base, &live);
        if !moves.is_empty() {
            region.pending_move = Some(PendingMove {
                new_mapping: mapping.addr..mapping.addr + mapping.len,
                parts: live,
            });
            // From here on the mapping is the region's: moved, or unmapped piece by
            // piece once the moves are made (`shaped_for_fork`).
            std::mem::forget(mapping);
        }
        for index in unwritten {
            // Its bytes are lost with the frame: read again when next needed.
            let memory = self.regions[&id].layout.block_memory(index);
            self.drop_blocks(id, &memory, BlockEvent::Released)?;
        }
        if let Some(region) = self.regions.remove(&id) {
            self.tell_keeper_region(id, &region);
            self.regions.insert(id, region);
        }
        Ok(moves)
    }

    /// Carries out `Command::ShapedForFork`: a part whose move the kernel refused gets
    /// the file mapped over it in place, the new mappings' leftovers are unmapped, and
    /// the threads left waiting are woken to fault on the file-shaped regions.
    pub(super) fn shaped_for_fork(&mut self, failed: &[RegionMove]) -> Result<(), ServiceError> {
        for region in self.regions.values_mut() {
            let Some(PendingMove {
                new_mapping: new,
                parts: live,
            }) = region.pending_move.take()
            else {
                continue;
            };
            // The parts sent (the region could not change since: commands that would
            // change it waited, `Command::waits_for_moves`).
            let refused: Vec<&RegionMove> = failed
                .iter()
                .filter(|failed| new.contains(&failed.from))
                .collect();
            for failed in &refused {
                let file = region.shape.as_ref().expect("shaped");
                let offset = (failed.from - new.start) as i64;
                if let Err(error) = map_in_place(&self.uffd, file, failed, offset, region.prot) {
                    let message = format!(
                        "hyperoffload: cannot map the region's file at {:#x} after a refused \
                         move ({error}): its pages fault forever\n",
                        failed.to
                    );
                    sys::files::write_stderr(message.as_bytes());
                }
            }
            let refused_ranges: Vec<Range<u64>> = refused
                .iter()
                .map(|failed| {
                    let start = (failed.from - new.start) as u64;
                    start..start + failed.len as u64
                })
                .collect();
            for left in leftovers(region.shape_len, &live, &refused_ranges) {
                // SAFETY: a part of the service's own new mapping that no move took
                // (a hole of the region, or a refused move): still mapped there, since
                // only the moves sent took parts of it.
                let _ = unsafe {
                    sys::memory::munmap(
                        new.start + left.start as usize,
                        (left.end - left.start) as usize,
                    )
                };
            }
            let map_len = region.layout.map_len as usize;
            let _ = self.uffd.wake(region.base as *mut libc::c_void, map_len);
        }
        self.shared.serving_forks.store(true, Ordering::Release);
        Ok(())
    }
}

/// Writes all of `bytes` at `offset` of `file`.
fn write_all_at(file: &OwnedFd, mut bytes: &[u8], mut offset: u64) -> std::io::Result<()> {
    while !bytes.is_empty() {
        match sys::files::pwrite(file.as_fd(), bytes, offset) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(written) => {
                bytes = &bytes[written..];
                offset += written as u64;
            }
            Err(error) if error.kind() == std::io::ErrorKind::Interrupted => {}
            Err(error) => return Err(error),
        }
    }
    Ok(())
}

/// Maps `file` from `offset` over `failed.to` (a part of a region whose move was
/// refused), registered, with `prot`: inaccessible while it is not registered, so a
/// thread touching it meanwhile gets SIGSEGV rather than a hole's zeros.
fn map_in_place(
    uffd: &userfaultfd::Uffd,
    file: &OwnedFd,
    failed: &RegionMove,
    offset: i64,
    prot: i32,
) -> std::io::Result<()> {
    // SAFETY: replaces a part of a region this service serves, whose old mapping (of
    // frames let go) serves nothing any more.
    unsafe {
        sys::memory::mmap(
            failed.to,
            failed.len,
            libc::PROT_NONE,
            libc::MAP_SHARED | libc::MAP_FIXED | libc::MAP_NORESERVE,
            Some(file.as_fd()),
            offset,
        )
    }?;
    uffd.register_with_mode(
        failed.to as *mut libc::c_void,
        failed.len,
        RegisterMode::MISSING | RegisterMode::MINOR,
    )
    .map_err(|error| std::io::Error::other(format!("{error:?}")))?;
    // SAFETY: the mapping just made and registered.
    unsafe { sys::memory::mprotect(failed.to, failed.len, prot) }
}

/// The moves that put the parts `live` (region offsets) of a new mapping at `from` over
/// the region at `to`.
fn moves_over(from: usize, to: usize, live: &[Range<u64>]) -> Vec<RegionMove> {
    live.iter()
        .filter(|part| part.start < part.end)
        .map(|part| RegionMove {
            from: from + part.start as usize,
            to: to + part.start as usize,
            len: (part.end - part.start) as usize,
        })
        .collect()
}

/// The parts of a new mapping of `len` bytes still at its own address once the moves of
/// `live` were made, except those `refused`: the holes between the live parts, and the
/// refused parts (region offsets, sorted).
fn leftovers(len: u64, live: &[Range<u64>], refused: &[Range<u64>]) -> Vec<Range<u64>> {
    let mut moved: Vec<Range<u64>> = live
        .iter()
        .filter(|part| !refused.contains(part))
        .cloned()
        .collect();
    moved.sort_by_key(|part| part.start);
    let mut left = Vec::new();
    let mut at = 0;
    for part in moved {
        if part.start > at {
            left.push(at..part.start);
        }
        at = at.max(part.end);
    }
    if at < len {
        left.push(at..len);
    }
    left
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_live_part_moves_to_its_place_in_the_region() {
        let moves = moves_over(0x10_0000, 0x70_0000, &[0..0x2000, 0x5000..0x8000]);
        assert_eq!(
            moves,
            vec![
                RegionMove {
                    from: 0x10_0000,
                    to: 0x70_0000,
                    len: 0x2000
                },
                RegionMove {
                    from: 0x10_5000,
                    to: 0x70_5000,
                    len: 0x3000
                },
            ]
        );
        assert!(moves_over(0, 0x1000, &[]).is_empty());
    }

    #[test]
    fn what_no_move_took_is_left_to_unmap() {
        assert_eq!(leftovers(0x8000, &[0..0x4000, 0x4000..0x8000], &[]), vec![]);
        assert_eq!(
            leftovers(0x8000, &[0x1000..0x3000, 0x5000..0x6000], &[]),
            vec![0..0x1000, 0x3000..0x5000, 0x6000..0x8000]
        );
        assert_eq!(
            leftovers(
                0x8000,
                &[0..0x1000, 0x3000..0x4000, 0x5000..0x8000],
                &[0..0x1000, 0x5000..0x8000]
            ),
            vec![0..0x3000, 0x4000..0x8000],
            "a refused move's part stays too"
        );
    }
}
