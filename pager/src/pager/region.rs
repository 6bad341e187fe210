//! `Region`: a file's bytes at a reserved address, and the mapping behind it (reserved,
//! registered, its unmapped holes tracked) until it is dropped.

use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::mpsc::sync_channel;
use std::sync::Mutex;

use super::{HintError, MapError, Pager};
use crate::command::{Command, PinRefused};
use crate::layout::Holes;
use crate::lock::lock;
use crate::policy::{AccessHint, RegionId};
use crate::sys;

/// An anonymous reservation owned by a region. Dropping it unmaps what the program has
/// not unmapped already: a hole may have been reused by another mapping since, which
/// must survive.
pub(super) struct Mapping {
    pub(super) base: usize,
    pub(super) len: usize,
    /// Offsets the program unmapped, in no particular order.
    pub(super) holes: Mutex<Holes>,
}

impl Mapping {
    /// Reserves `len` bytes of inaccessible anonymous memory at an address aligned to
    /// `align` (a power of two, at least a page); `map_file` gives it the program's
    /// protection once it is registered. With `inherited`, a forked child keeps the range
    /// (its pager serves forks: `shaped_region`); otherwise it is MADV_DONTFORK.
    pub(super) fn reserve(len: usize, align: usize, inherited: bool) -> Result<Self, MapError> {
        let reserve_error = |source| MapError::Reserve {
            len: len as u64,
            source,
        };
        let extra = align - sys::memory::page_size() as usize;
        // SAFETY: a fresh private anonymous mapping at a kernel-chosen address touches no
        // existing memory. MAP_NORESERVE: the budget, not swap accounting, bounds it.
        let start = unsafe {
            sys::memory::mmap(
                0,
                len + extra,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                None,
                0,
            )
        }
        .map_err(reserve_error)?;
        // Keep the aligned part; give back the rest on either side.
        let base = start.next_multiple_of(align);
        let tail = start + len + extra - (base + len);
        for (from, bytes) in [(start, base - start), (base + len, tail)] {
            if bytes > 0 {
                // SAFETY: unmaps only parts of the mapping just created, outside the part
                // kept.
                unsafe { sys::memory::munmap(from, bytes) }.map_err(reserve_error)?;
            }
        }
        let mapping = Self {
            base,
            len,
            holes: Mutex::new(Holes::default()),
        };
        if inherited {
            return Ok(mapping);
        }
        // A forked child would inherit the range unregistered and read zeros where the
        // parent reads the file. Not inheriting it makes a child's access fault loudly.
        // SAFETY: advises only the mapping just created; DONTFORK discards nothing.
        unsafe { sys::memory::madvise(base, len, sys::memory::Advice::LinuxDontFork) }
            .map_err(reserve_error)?;
        Ok(mapping)
    }
}

impl Mapping {
    /// The parts of the reservation still mapped, in address order.
    pub(super) fn live_parts(&self) -> Vec<Range<usize>> {
        lock(&self.holes)
            .outside(0..self.len as u64)
            .into_iter()
            .map(|part| part.start as usize..part.end as usize)
            .collect()
    }
}

impl Mapping {
    /// Lets go of the whole reservation without unmapping it: in a forked child, which
    /// does not have it (and may have mapped something else there since).
    pub(super) fn forget(&mut self) {
        // Exclusive access: no lock, which a fork may have left held.
        let holes = self
            .holes
            .get_mut()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        holes.add(0..self.len as u64);
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        for part in self.live_parts() {
            // SAFETY: unmaps a part of the reservation this value owns that the program
            // has not unmapped; the region dropping it holds no references into it any
            // more (`as_slice` borrows the region).
            let result =
                unsafe { sys::memory::munmap(self.base + part.start, part.end - part.start) };
            if let Err(error) = result {
                panic!("munmap of a region failed: {error}");
            }
        }
    }
}

/// A file's bytes at a reserved address, served on fault. Dropping it stops serving it
/// and unmaps it.
pub struct Region {
    pub(super) pager: Pager,
    pub(super) id: RegionId,
    pub(super) mapping: Mapping,
    pub(super) data_len: u64,
    /// Dropped after `mapping` is unmapped.
    pub(super) _mappings: MappingPromise,
}

/// Memory mappings reserved for a zero-copy region (see `Pager::promise_mappings`),
/// given back when dropped.
pub(super) struct MappingPromise {
    pub(super) pager: Pager,
    pub(super) count: u64,
}

impl Drop for MappingPromise {
    fn drop(&mut self) {
        self.pager
            .inner
            .mappings_promised
            .fetch_sub(self.count, Ordering::AcqRel);
    }
}

impl Region {
    pub fn id(&self) -> RegionId {
        self.id
    }

    pub fn as_ptr(&self) -> *const u8 {
        self.mapping.base as *const u8
    }

    /// Bytes of file data the region presents.
    pub fn len(&self) -> usize {
        self.data_len as usize
    }

    pub fn is_empty(&self) -> bool {
        self.data_len == 0
    }

    /// Length of the mapping (data rounded up to a page, or the requested `map_len`).
    pub fn map_len(&self) -> usize {
        self.mapping.len
    }

    /// The file's bytes. Reading them faults pages in through the service.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the mapping is live for as long as self; its pages are only ever
        // installed whole by the service (UFFDIO_COPY is atomic per page) and never
        // written afterwards, so the bytes do not change under a shared reference.
        // An evicted page is refilled with the same file bytes on the next access.
        unsafe { std::slice::from_raw_parts(self.as_ptr(), self.data_len as usize) }
    }

    /// Whether a hint on `range` can be sent: inside the region, and from the process
    /// the service runs in.
    fn check(&self, range: &Range<u64>) -> Result<(), HintError> {
        if !self.pager.inner.serving_here() {
            return Err(HintError::ForkedChild {
                owner: self.pager.inner.owner,
            });
        }
        if range.start > range.end || range.end > self.mapping.len as u64 {
            return Err(HintError::OutOfRange {
                start: range.start,
                end: range.end,
                len: self.mapping.len as u64,
            });
        }
        Ok(())
    }

    /// Starts reading `range` (region offsets) within the budget; returns at once.
    pub fn prefetch(&self, range: Range<u64>) -> Result<(), HintError> {
        self.check(&range)?;
        self.pager
            .inner
            .shared
            .send(Command::Prefetch { id: self.id, range });
        Ok(())
    }

    /// Drops the resident blocks wholly inside `range`; they fault in again when touched.
    pub fn drop_range(&self, range: Range<u64>) -> Result<(), HintError> {
        self.check(&range)?;
        let (reply, answer) = sync_channel(1);
        self.pager.inner.shared.send(Command::Drop {
            id: self.id,
            range,
            reply,
        });
        answer.recv().map_err(|_| HintError::ServiceGone)
    }

    /// Keeps the blocks overlapping `range` resident (reading them now). Pinned bytes
    /// count against the budget; pinning all of it is refused.
    pub fn pin(&self, range: Range<u64>) -> Result<(), HintError> {
        self.check(&range)?;
        let (reply, answer) = sync_channel(1);
        self.pager.inner.shared.send(Command::Pin {
            id: self.id,
            range,
            reply,
        });
        match answer.recv() {
            Ok(Ok(())) => Ok(()),
            Ok(Err(PinRefused::UnknownRegion)) | Err(_) => Err(HintError::ServiceGone),
            Ok(Err(PinRefused::ExceedsBudget {
                requested,
                total,
                budget,
                block,
            })) => Err(HintError::PinExceedsBudget {
                requested,
                total,
                budget,
                block,
            }),
        }
    }

    pub fn unpin(&self, range: Range<u64>) -> Result<(), HintError> {
        self.check(&range)?;
        self.pager
            .inner
            .shared
            .send(Command::Unpin { id: self.id, range });
        Ok(())
    }

    /// Tells the prefetch policy how `range` will be read (`madvise` advice).
    pub fn advise(&self, range: Range<u64>, hint: AccessHint) -> Result<(), HintError> {
        self.check(&range)?;
        self.pager.inner.shared.send(Command::Hint {
            id: self.id,
            range,
            hint,
        });
        Ok(())
    }

    pub fn pager(&self) -> &Pager {
        &self.pager
    }

    /// Unmaps `range` (page-aligned region offsets) as munmap(2) would, for a program
    /// that unmaps part of a mapping: the blocks wholly inside it are forgotten (never
    /// read or installed again, their budget released), then the pages are unmapped.
    /// The rest of the region keeps working.
    pub fn unmap_part(&self, range: Range<u64>) -> Result<(), HintError> {
        self.check(&range)?;
        let page = sys::memory::page_size();
        let range = range.start / page * page..range.end.next_multiple_of(page);
        if range.is_empty() {
            return Ok(());
        }
        let (reply, answer) = sync_channel(1);
        self.pager.inner.shared.send(Command::Unmap {
            id: self.id,
            range: range.clone(),
            reply,
        });
        answer.recv().map_err(|_| HintError::ServiceGone)?;
        // SAFETY: unmaps part of this region's own reservation, at the program's request;
        // the service has been told and no reference we hold points there. It cannot
        // fail for a page-aligned range inside a mapping we own.
        let _ = unsafe {
            sys::memory::munmap(
                self.mapping.base + range.start as usize,
                (range.end - range.start) as usize,
            )
        };
        lock(&self.mapping.holes).add(range.clone());
        Ok(())
    }

    /// Whether every page of the mapping has been unmapped by `unmap_part`.
    pub fn fully_unmapped(&self) -> bool {
        self.mapping.live_parts().is_empty()
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        if !self.pager.inner.serving_here() {
            // A forked child: nothing of the region is here (see `PagerInner::owner`).
            self.mapping.forget();
            return;
        }
        let (reply, answer) = sync_channel(1);
        self.pager
            .inner
            .shared
            .send(Command::RemoveRegion { id: self.id, reply });
        // Once acknowledged, the service never touches the range again. If the service is
        // gone the process is aborting anyway.
        let _ = answer.recv();
        // Unregistering wakes any thread still waiting on the range; munmap (in
        // `Mapping::drop`) follows. Only the parts still ours: a hole the program
        // unmapped may since hold another region of this pager, registered on the same
        // userfaultfd.
        for part in self.mapping.live_parts() {
            let _ = self.pager.inner.uffd.unregister(
                (self.mapping.base + part.start) as *mut libc::c_void,
                part.end - part.start,
            );
        }
    }
}
