//! A region the service serves: where it is, what file backs it, and the state of each
//! of its blocks (changed only through `advance`, see `block_state`).

use std::ops::Range;
use std::os::fd::OwnedFd;

use super::block_state::{transition, BlockEvent, BlockState};
use super::breaches::Breaches;
use crate::file::BackingFile;
use crate::layout::{Holes, RegionLayout};
use crate::policy::{RegionId, RegionInfo};

/// A region's new, file-shaped mapping, sent to be moved over it (`shaping`).
pub(super) struct PendingMove {
    /// The new mapping's addresses, until moved over the region.
    pub new_mapping: Range<usize>,
    /// The parts of it (region offsets) sent to be moved.
    pub parts: Vec<Range<u64>>,
}

pub(super) struct ServedRegion {
    pub base: usize,
    pub layout: RegionLayout,
    pub file: BackingFile,
    blocks: Vec<BlockState>,
    pub pinned: Vec<bool>,
    /// Reads in flight into this region; a removed region is forgotten when none are.
    pub reads_in_flight: u32,
    pub removed: bool,
    /// The open file was modified in place since it was opened: nothing more is read
    /// from it (see `file_changed`).
    pub changed: bool,
    /// Ranges (region offsets) the program unmapped: never installed into or dropped,
    /// since something else may be mapped there now.
    pub holes: Holes,
    /// With zero copy: each block's frame, if it has one; else empty.
    pub frames: Vec<Option<u32>>,
    /// With zero copy: whether each resident block is watched (its pages dropped at the
    /// eviction policy's request, its frame kept), else empty. Meaningful only while the
    /// block is resident; cleared when it is installed.
    pub watched: Vec<bool>,
    /// The program's protection of the region (frames are mapped with it).
    pub prot: i32,
    /// With a pager that serves forks: the file the region's data pages are
    /// (`crate::shaped_region`), read-write. Evicting punches holes in it.
    pub shape: Option<OwnedFd>,
    /// That file's length: the region's data, page rounded.
    pub shape_len: u64,
    /// With reads in place (`ServiceConfig::read_in_place`): the service's view of that
    /// file, where its reads land (None if it could not be made: reads are copied in).
    pub view: Option<crate::shaped_region::FileView>,
    /// Whether the region is registered for minor faults (reads in place), in the
    /// program and in its forked children: a page the file holds is mapped in a process
    /// only by UFFDIO_CONTINUE, never by a wake-up.
    pub minor: bool,
    /// Whether the file's pages stay, whatever is evicted: filled for forked children
    /// the program left it to (the region removed while they map it).
    pub pages_kept: bool,
    /// Being made file-shaped at a fork (`shaping`): the program still maps the old
    /// mapping, whose faults wait until the new one is moved over it.
    pub pending_move: Option<PendingMove>,
    /// Where an event its state does not allow is counted (`advance`).
    breaches: Breaches,
}

impl ServedRegion {
    pub(super) fn new(
        base: usize,
        layout: RegionLayout,
        file: BackingFile,
        prot: i32,
        zero_copy: bool,
        breaches: Breaches,
    ) -> Self {
        let blocks = layout.block_count() as usize;
        let (frames, watched) = match zero_copy {
            true => (vec![None; blocks], vec![false; blocks]),
            false => (Vec::new(), Vec::new()),
        };
        Self {
            base,
            file,
            blocks: vec![BlockState::Missing; blocks],
            pinned: vec![false; blocks],
            reads_in_flight: 0,
            removed: false,
            changed: false,
            holes: Holes::default(),
            frames,
            watched,
            prot,
            shape: None,
            shape_len: 0,
            view: None,
            minor: false,
            pages_kept: false,
            pending_move: None,
            layout,
            breaches,
        }
    }

    /// Whether the region is being moved at a fork (see `pending_move`).
    pub(super) fn moving(&self) -> bool {
        self.pending_move.is_some()
    }

    /// The region offset of the file's byte `file_offset` (within the region's data):
    /// where a read of it lands in the region's file.
    pub(super) fn region_offset(&self, file_offset: u64) -> u64 {
        file_offset - self.layout.geometry.file_offset
    }

    /// Block `index`'s state.
    pub(super) fn state(&self, index: u32) -> BlockState {
        self.blocks[index as usize]
    }

    /// Moves block `index` on `event`. An event its state does not allow is a service
    /// bug, counted and reported as a breach (in every build); the block takes the
    /// event's target state, since the event did happen. The state is the service's
    /// record of the block, not its bytes: what is installed is still what was read for
    /// it, and the budget, which refuses to count below zero (`Budget`), stops the
    /// process if its counts go wrong.
    pub(super) fn advance(&mut self, index: u32, event: BlockEvent) {
        let state = &mut self.blocks[index as usize];
        *state = match transition(*state, event) {
            Ok(next) => next,
            Err(invalid) => {
                self.breaches
                    .record(format_args!("block {index}: {invalid}"));
                event.target()
            }
        };
    }

    /// The frame block `index`'s read landed in (zero copy, while it has one).
    pub(super) fn frame(&self, index: u32) -> u32 {
        self.frames[index as usize].expect("the block has a frame")
    }

    pub(super) fn block_count(&self) -> u32 {
        self.blocks.len() as u32
    }

    /// Whether block `index` is resident and not pinned: the only blocks eviction and
    /// watching may take.
    pub(super) fn evictable(&self, index: u32) -> bool {
        self.blocks.get(index as usize) == Some(&BlockState::Resident)
            && !self.pinned[index as usize]
    }

    /// File offset of block `index`'s first byte.
    pub(super) fn block_file_offset(&self, index: u32) -> u64 {
        self.layout.geometry.block_file_range(index).start
    }

    /// Whether the program unmapped any of `range` (region offsets).
    pub(super) fn cuts(&self, range: Range<u64>) -> bool {
        self.holes.cuts(&range)
    }

    /// The parts of `range` (region offsets) still mapped, as absolute address ranges.
    pub(super) fn mapped_parts(&self, range: Range<u64>) -> Vec<Range<usize>> {
        let to_addresses = |r: Range<u64>| self.base + r.start as usize..self.base + r.end as usize;
        if self.holes.is_empty() {
            return vec![to_addresses(range)];
        }
        self.holes
            .outside(range)
            .into_iter()
            .map(to_addresses)
            .collect()
    }

    pub(super) fn info(&self, id: RegionId, budget: u64, watch_resident: bool) -> RegionInfo<'_> {
        RegionInfo {
            id,
            path: self.file.path(),
            geometry: self.layout.geometry.clone(),
            budget,
            watch_resident,
        }
    }

    /// Whether the region's file was modified in place (size or mtime of the open
    /// descriptor differ from when it was opened). Checked after every read, before its
    /// bytes are installed: a writer updates the mtime before it changes the data, so a
    /// read that saw new bytes is caught. From the first change on, nothing more is
    /// installed from the file: the threads waiting get SIGBUS (once, a message says why)
    /// rather than a mix of old and new bytes. A file replaced by rename is not a change:
    /// the region keeps reading the inode it opened, as a kernel mapping does.
    pub(super) fn file_changed(&mut self) -> bool {
        if self.changed {
            return true;
        }
        let Ok(now) = self.file.open_identity() else {
            return false;
        };
        let then = self.file.identity();
        if now.len == then.len && now.mtime_ns == then.mtime_ns {
            return false;
        }
        self.changed = true;
        let message = format!(
            "hyperoffload: {} was modified while mapped (size {} -> {}, mtime changed: {}); \
             its pages not yet read raise SIGBUS\n",
            self.file.path().display(),
            then.len,
            now.len,
            now.mtime_ns != then.mtime_ns
        );
        // Not through stderr's lock, which a faulting thread may hold.
        crate::sys::files::write_stderr(message.as_bytes());
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::BlockGeometry;

    #[test]
    fn an_event_its_state_does_not_allow_is_a_counted_breach() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml");
        let file = BackingFile::open(&path).unwrap();
        let geometry = BlockGeometry::new(0, 8192, 4096).unwrap();
        let layout = RegionLayout::new(geometry, 8192, 4096);
        let breaches = Breaches::default();
        let mut region =
            ServedRegion::new(0, layout, file, libc::PROT_READ, false, breaches.clone());
        region.advance(0, BlockEvent::Queued);
        region.advance(0, BlockEvent::ReadIssued);
        assert_eq!(
            (region.state(0), breaches.count()),
            (BlockState::Reading, 0)
        );
        // Installed on a block never read: refused by `transition`, counted, and the
        // block takes the event's state.
        region.advance(1, BlockEvent::Installed);
        assert_eq!(
            (region.state(1), breaches.count()),
            (BlockState::Resident, 1)
        );
        region.advance(0, BlockEvent::Installed);
        assert_eq!(
            (region.state(0), breaches.count()),
            (BlockState::Resident, 1)
        );
    }
}
