//! Calls over an address range that may hold managed memory, walked piece by piece:
//! munmap, and the release of what a MAP_FIXED request replaces.

use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use hyperoffload::sys;

use super::{lock, page, Errno, ManagedPiece, ManagedRegion, Shim};
use crate::raw;
use crate::registry::Piece;

impl Shim {
    fn pieces(&self, addr: usize, len: usize) -> Option<Vec<Piece<Arc<ManagedRegion>>>> {
        if !self.has_mappings() || addr % page() != 0 {
            return None;
        }
        let end = addr.checked_add(len)?.checked_next_multiple_of(page())?;
        let pieces = lock(&self.registry).split(addr..end);
        pieces
            .iter()
            .any(|piece| matches!(piece, Piece::Managed { .. }))
            .then_some(pieces)
    }

    /// Walks the pieces of `[addr, addr + len)` in address order, calling `managed` on
    /// each managed piece and `kernel` on each other one. Every piece is visited; the
    /// result is the first error. `None` when the range touches no managed memory (the
    /// call is then the kernel's alone).
    pub(super) fn for_each_piece(
        &self,
        addr: usize,
        len: usize,
        mut managed: impl FnMut(ManagedPiece) -> Errno,
        mut kernel: impl FnMut(Range<usize>) -> Errno,
    ) -> Option<Errno> {
        let mut result = Ok(());
        for piece in self.pieces(addr, len)? {
            let outcome = match piece {
                Piece::Managed { value, base, range } => managed(ManagedPiece {
                    offsets: (range.start - base) as u64..(range.end - base) as u64,
                    mapping: value,
                    base,
                    pages: range,
                }),
                Piece::Kernel(range) => kernel(range),
            };
            if result.is_ok() {
                result = outcome;
            }
        }
        Some(result)
    }

    /// Releases a managed piece: the region forgets its blocks there and the registry
    /// its pages. A mapping with nothing left is dropped after the registry lock is
    /// released (the region tells the service and waits for it).
    fn release(&self, piece: ManagedPiece) {
        let _ = piece.mapping.region.unmap_part(piece.offsets);
        let gone = lock(&self.registry).unmapped(piece.base, piece.pages);
        if let Some(gone) = gone {
            self.mapped.fetch_sub(1, Ordering::AcqRel);
            drop(gone);
        }
    }

    /// munmap: releases exactly the managed part of the range and unmaps the rest as the
    /// kernel would.
    pub fn unmap(&self, addr: usize, len: usize) -> Option<Errno> {
        self.unmap_attached(addr, len);
        if !self.has_mappings() {
            return None;
        }
        let _layout = lock(&self.layout);
        self.for_each_piece(
            addr,
            len,
            |piece| {
                self.record(|| {
                    serde_json::json!({"op": "unmap", "file": piece.mapping.file,
                        "start": piece.offsets.start, "end": piece.offsets.end})
                });
                self.release(piece);
                Ok(())
            },
            |range| {
                // SAFETY: the program asked for this range to be unmapped; it is not
                // managed memory.
                raw::check(unsafe { sys::memory::munmap(range.start, range.len()) })
            },
        )
    }

    /// A MAP_FIXED request over managed memory replaces it: release the managed part
    /// first (the request itself then goes to the kernel).
    pub fn release_for_fixed(&self, addr: usize, len: usize) {
        if !self.has_mappings() {
            return;
        }
        let _layout = lock(&self.layout);
        let _ = self.for_each_piece(
            addr,
            len,
            |piece| {
                self.release(piece);
                Ok(())
            },
            |_| Ok(()),
        );
    }
}
