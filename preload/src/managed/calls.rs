//! The shim's answers to the calls that change memory it manages, other than mmap and
//! munmap: madvise and posix_madvise, mlock and munlock, mremap.

use std::ops::Range;

use hyperoffload::policy::AccessHint;
use hyperoffload::sys;
use libc::c_int;

use super::{lock, page, Errno, ManagedRegion, Shim};
use crate::raw;

impl Shim {
    /// madvise / posix_madvise (`posix`: DONTNEED is a no-op, as in glibc).
    pub fn advise(&self, addr: usize, len: usize, advice: c_int, posix: bool) -> Option<Errno> {
        self.for_each_piece(
            addr,
            len,
            |piece| {
                self.record(|| {
                    serde_json::json!({"op": "advise", "file": piece.mapping.file,
                        "start": piece.offsets.start, "end": piece.offsets.end, "advice": advice})
                });
                self.advise_managed(&piece.mapping, piece.offsets, advice, posix)
            },
            |range| {
                // SAFETY: the program's own advice on memory the shim does not manage.
                raw::check(unsafe { sys::memory::madvise_raw(range.start, range.len(), advice) })
            },
        )
    }

    fn advise_managed(
        &self,
        managed: &ManagedRegion,
        range: Range<u64>,
        advice: c_int,
        posix: bool,
    ) -> Errno {
        let region = &managed.region;
        let hint = |hint| region.advise(range.clone(), hint).map_err(|_| libc::EINVAL);
        match advice {
            libc::MADV_WILLNEED => {
                self.bounded_prefetch(managed, range);
                Ok(())
            }
            libc::MADV_DONTNEED if posix => Ok(()),
            libc::MADV_DONTNEED | libc::MADV_DONTNEED_LOCKED | libc::MADV_FREE => {
                region.drop_range(range).map_err(|_| libc::EINVAL)
            }
            libc::MADV_NORMAL => hint(AccessHint::Normal),
            libc::MADV_RANDOM => hint(AccessHint::Random),
            libc::MADV_SEQUENTIAL => hint(AccessHint::Sequential),
            // A managed region must never be inherited: a child would read zeros.
            libc::MADV_DOFORK
            | libc::MADV_DONTFORK
            | libc::MADV_WIPEONFORK
            | libc::MADV_KEEPONFORK => Ok(()),
            // Punching a hole in the file needs write access the mapping does not have.
            libc::MADV_REMOVE => Err(libc::EACCES),
            advice if keeps_contents(advice) => {
                // The kernel applies it to the region's own memory.
                let start = region.as_ptr() as usize + range.start as usize;
                let len = (range.end - range.start) as usize;
                // SAFETY: advice that keeps the contents, on the region's own pages.
                raw::check(unsafe { sys::memory::madvise_raw(start, len, advice) })
            }
            _ => {
                // Anything else may drop or fence pages the pager counts resident (guard
                // regions, poisoning, advice newer than this list), and the pager must
                // know which pages are: refused, as the kernel refuses advice it does not
                // know.
                self.warn_once(&self.warned_advice, || {
                    format!("madvise advice {advice} on a model mapping is not supported; refused with EINVAL")
                });
                Err(libc::EINVAL)
            }
        }
    }

    /// mlock/mlock2: pins managed pages within the budget (kernel mlock would fault the
    /// whole range in and keep eviction from ever dropping it).
    pub fn lock_range(&self, addr: usize, len: usize, flags: libc::c_uint) -> Option<Errno> {
        let (addr, len) = page_rounded(addr, len)?;
        self.for_each_piece(
            addr,
            len,
            |piece| {
                piece.mapping.region.pin(piece.offsets).map_err(|error| {
                    self.warn_once(&self.warned_mlock, || {
                        format!("mlock of a model mapping refused: {error}")
                    });
                    libc::ENOMEM
                })
            },
            |range| {
                // SAFETY: the program's own request on memory the shim does not manage.
                raw::check(unsafe { sys::memory::mlock(range.start, range.len(), flags) })
            },
        )
    }

    pub fn unlock_range(&self, addr: usize, len: usize) -> Option<Errno> {
        let (addr, len) = page_rounded(addr, len)?;
        self.for_each_piece(
            addr,
            len,
            |piece| {
                piece
                    .mapping
                    .region
                    .unpin(piece.offsets)
                    .map_err(|_| libc::EINVAL)
            },
            |range| {
                // SAFETY: unlocking memory the shim does not manage.
                raw::check(unsafe { sys::memory::munlock(range.start, range.len()) })
            },
        )
    }

    /// mremap touching managed memory is refused: the pager cannot follow a move (the
    /// registration would silently disappear and the pages read as zeros).
    pub fn refuses_remap(
        &self,
        old: usize,
        old_len: usize,
        new_addr: Option<(usize, usize)>,
    ) -> bool {
        if self.touches_attached(old, old_len)
            || new_addr.is_some_and(|(addr, len)| self.touches_attached(addr, len))
        {
            return true;
        }
        if !self.has_mappings() {
            return false;
        }
        let registry = lock(&self.registry);
        let touches = |addr: usize, len: usize| {
            let end = addr.saturating_add(len.max(1)).next_multiple_of(page());
            registry.overlaps(addr..end)
        };
        let refused = touches(old, old_len) || new_addr.is_some_and(|(a, l)| touches(a, l));
        drop(registry);
        if refused {
            self.warn_once(&self.warned_mremap, || {
                "mremap of a model mapping is not supported; refused with EINVAL".into()
            });
        }
        refused
    }
}

/// `[addr, addr + len)` from the start of its first page, as mlock(2) takes it (the
/// kernel rounds the start down); None if the end overflows.
fn page_rounded(addr: usize, len: usize) -> Option<(usize, usize)> {
    let start = addr - addr % page();
    Some((start, len.checked_add(addr - start)?))
}

/// Advice the kernel may apply to a managed region's memory: it keeps the pages'
/// contents where the pager put them, or moves them in ways that fault back without a
/// userfault (swap), or faults pages in through the pager (populate).
fn keeps_contents(advice: c_int) -> bool {
    matches!(
        advice,
        libc::MADV_HUGEPAGE
            | libc::MADV_NOHUGEPAGE
            | libc::MADV_DONTDUMP
            | libc::MADV_DODUMP
            | libc::MADV_MERGEABLE
            | libc::MADV_UNMERGEABLE
            | libc::MADV_COLD
            | libc::MADV_PAGEOUT
            | libc::MADV_COLLAPSE
            | libc::MADV_POPULATE_READ
            | libc::MADV_POPULATE_WRITE
    )
}
