//! Pure address arithmetic: which region an address falls in, and which block of it, or
//! whether it lies past the end of the file. No syscalls, so it is tested without the
//! kernel. The blocks themselves are the region's `BlockGeometry`.
//!
//! A region maps `data_len` bytes of a file starting at a page-aligned file offset, at a
//! page-aligned base address. Blocks are aligned to the region's start, not to absolute
//! addresses or file offsets (the region is only page aligned):
//!
//! ```text
//!  base                                               base + map_len
//!  |<- block 0 ->|<- block 1 ->|<- block 2 ->|<-2'->|  ...  |
//!  |=============|=============|=============|==..  |       |
//!                                            ^     ^        ^
//!                              last data byte  data pages end  end of mapping
//! ```
//! The last block stops at the page after the last data byte (`2'`, zero-filled past
//! the data, as mmap does); whole pages between there and `map_len` are past end of file
//! and raise SIGBUS.

use std::ops::Range;

use crate::geometry::BlockGeometry;
use crate::policy::RegionId;

/// Where an offset inside a region lands.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Location {
    Block(u32),
    /// A whole page past the file data: SIGBUS, as with a file mapping.
    PastEof,
}

/// A region's mapping: its blocks (`geometry`) and the pages around them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegionLayout {
    /// The file data the region presents (a suffix of the last page reads as zeros) and
    /// its blocks.
    pub geometry: BlockGeometry,
    /// Length of the mapping: at least the data rounded up to a page.
    pub map_len: u64,
    pub page_size: u64,
}

impl RegionLayout {
    /// The block size and `page_size` must be powers of two with block size at least
    /// `page_size`, `map_len` a page multiple at least the data rounded up to a page; the
    /// pager's constructors check these before building a layout.
    pub fn new(geometry: BlockGeometry, map_len: u64, page_size: u64) -> Self {
        let block_size = geometry.block_size;
        debug_assert!(block_size.is_power_of_two() && page_size.is_power_of_two());
        debug_assert!(block_size >= page_size);
        debug_assert!(
            map_len % page_size == 0 && map_len >= geometry.data_len.next_multiple_of(page_size)
        );
        Self {
            geometry,
            map_len,
            page_size,
        }
    }

    /// Offset of the end of the last page holding file data.
    pub fn data_pages_end(&self) -> u64 {
        self.geometry.data_len.next_multiple_of(self.page_size)
    }

    pub fn block_count(&self) -> u32 {
        self.geometry.block_count()
    }

    pub fn locate(&self, offset: u64) -> Location {
        if offset >= self.data_pages_end() {
            Location::PastEof
        } else {
            Location::Block(self.geometry.block_of(offset))
        }
    }

    /// Region offsets of the memory a block occupies (page aligned): its data rounded up
    /// to a page.
    pub fn block_memory(&self, index: u32) -> Range<u64> {
        let data = self.geometry.block_range(index);
        data.start..data.end.next_multiple_of(self.page_size)
    }

    /// Bytes of memory a resident block occupies: what it costs against the budget.
    pub fn block_bytes(&self, index: u32) -> u64 {
        let memory = self.block_memory(index);
        memory.end - memory.start
    }

    /// Blocks overlapping a range of region offsets, clipped to the data pages (an offset
    /// in the last page past the data belongs to the last block).
    pub fn blocks_overlapping(&self, range: Range<u64>) -> Range<u32> {
        let end = range.end.min(self.data_pages_end());
        if range.start >= end {
            return 0..0;
        }
        self.geometry.block_of(range.start)..self.geometry.block_of(end - 1) + 1
    }

    /// Whole pages in `[data_pages_end, map_len)`: the part that raises SIGBUS.
    pub fn past_eof(&self) -> Range<u64> {
        self.data_pages_end()..self.map_len
    }
}

/// The ranges of a region (region offsets) the program unmapped: the pager and the
/// service must never touch them again, since the program may have mapped something
/// else there since (MADV_DONTNEED on a hole would zero another mapping's pages).
/// Holes may overlap and come in any order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Holes {
    ranges: Vec<Range<u64>>,
}

impl Holes {
    /// The program unmapped `range`.
    pub fn add(&mut self, range: Range<u64>) {
        if !range.is_empty() {
            self.ranges.push(range);
        }
    }

    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }

    /// Whether any of `range` was unmapped.
    pub fn cuts(&self, range: &Range<u64>) -> bool {
        self.ranges
            .iter()
            .any(|hole| hole.start < range.end && range.start < hole.end)
    }

    /// The parts of `range` still mapped, in order.
    pub fn outside(&self, range: Range<u64>) -> Vec<Range<u64>> {
        outside_holes(range, &self.ranges)
    }
}

/// The parts of `range` outside every hole, in order.
pub fn outside_holes(range: Range<u64>, holes: &[Range<u64>]) -> Vec<Range<u64>> {
    let mut parts = vec![range];
    for hole in holes {
        parts = parts
            .into_iter()
            .flat_map(|part| {
                let before = part.start..part.end.min(hole.start);
                let after = part.start.max(hole.end)..part.end;
                [before, after].into_iter().filter(|r| !r.is_empty())
            })
            .collect();
    }
    parts
}

/// Finds the region an address belongs to. Rebuilt when regions are added or removed,
/// which is rare; lookups are a binary search.
///
/// Regions may overlap: when the program unmaps part of a region (llama.cpp unmaps the
/// head of its model mapping), the kernel may place a later region of the same pager in
/// that hole, inside the first one's extent, even at its base. At an address covered by
/// several regions the newest one is the mapping there: a region is only ever placed where
/// nothing was mapped, so the older ones' pages at its addresses are all gone. (Newest,
/// not smallest: a later region may also straddle the end of an earlier one's tail hole.)
/// Insertion order is mapping order: `Pager::map_file` returns only once the service has
/// added the region, so one mapped into its hole is added after it.
#[derive(Default, Debug)]
pub struct FaultLocator {
    /// (base, end, region) of every region, oldest first.
    spans: Vec<(usize, usize, RegionId)>,
    /// Which region each address belongs to: sorted by start, non-overlapping.
    visible: Vec<Segment>,
}

/// A part of a region's extent not covered by any newer region.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
struct Segment {
    start: usize,
    end: usize,
    region: RegionId,
    /// The region's base, which offsets are counted from.
    base: usize,
}

impl FaultLocator {
    pub fn insert(&mut self, base: usize, len: usize, region: RegionId) {
        self.spans.push((base, base + len, region));
        self.visible = visible_segments(&self.spans);
    }

    pub fn remove(&mut self, region: RegionId) {
        self.spans.retain(|&(_, _, id)| id != region);
        self.visible = visible_segments(&self.spans);
    }

    /// The region containing `addr` and the offset of `addr` inside it.
    pub fn lookup(&self, addr: usize) -> Option<(RegionId, u64)> {
        let after = self
            .visible
            .partition_point(|segment| segment.start <= addr);
        let segment = self.visible.get(after.checked_sub(1)?)?;
        (addr < segment.end).then_some((segment.region, (addr - segment.base) as u64))
    }
}

/// The parts of each span that no newer span covers, sorted by start. `spans` is oldest
/// first, so laying each one over the result of those before it leaves the newest on top.
fn visible_segments(spans: &[(usize, usize, RegionId)]) -> Vec<Segment> {
    let mut segments = Vec::with_capacity(spans.len());
    for &(start, end, region) in spans {
        let top = Segment {
            start,
            end,
            region,
            base: start,
        };
        segments = overlay(segments, top);
    }
    segments
}

/// Lays `top` over sorted, disjoint `segments`: what it covers of them goes, the parts
/// on either side of it stay.
fn overlay(segments: Vec<Segment>, top: Segment) -> Vec<Segment> {
    let mut out = Vec::with_capacity(segments.len() + 2);
    for segment in segments {
        if segment.start < top.start {
            out.push(Segment {
                end: segment.end.min(top.start),
                ..segment
            });
        }
        if segment.end > top.end {
            out.push(Segment {
                start: segment.start.max(top.end),
                ..segment
            });
        }
    }
    let at = out.partition_point(|segment| segment.start < top.start);
    out.insert(at, top);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: u64 = 4096;

    fn region(data_len: u64, map_len: u64, block_size: u64) -> RegionLayout {
        let geometry = BlockGeometry::new(0, data_len, block_size).unwrap();
        RegionLayout::new(geometry, map_len, PAGE)
    }

    #[test]
    fn holes_cut_and_leave_parts() {
        let mut holes = Holes::default();
        assert!(holes.is_empty() && !holes.cuts(&(0..100)));
        assert_eq!(holes.outside(0..100), vec![0..100]);
        holes.add(50..60);
        holes.add(10..20);
        holes.add(15..25);
        holes.add(70..70);
        assert!(holes.cuts(&(24..30)) && !holes.cuts(&(25..50)) && !holes.cuts(&(60..100)));
        assert_eq!(holes.outside(0..100), vec![0..10, 25..50, 60..100]);
        holes.add(0..100);
        assert_eq!(holes.outside(0..100), Vec::<Range<u64>>::new());
    }

    #[test]
    fn parts_outside_holes() {
        assert_eq!(outside_holes(0..100, &[]), vec![0..100]);
        assert_eq!(
            outside_holes(0..100, &[10..20, 50..60]),
            vec![0..10, 20..50, 60..100]
        );
        let whole = 0..100;
        assert_eq!(
            outside_holes(0..100, std::slice::from_ref(&whole)),
            Vec::<Range<u64>>::new()
        );
        assert_eq!(outside_holes(10..20, &[0..15, 18..30]), vec![15..18]);
        let elsewhere = 30..40;
        assert_eq!(
            outside_holes(10..20, std::slice::from_ref(&elsewhere)),
            vec![10..20]
        );
    }

    #[test]
    fn blocks_cover_data_pages_and_the_rest_is_past_eof() {
        // 3 blocks of 64 KiB, the last one holding 100 bytes of data.
        let layout = region(2 * 65536 + 100, 4 * 65536, 65536);
        assert_eq!(layout.block_count(), 3);
        assert_eq!(layout.locate(0), Location::Block(0));
        assert_eq!(layout.locate(65535), Location::Block(0));
        assert_eq!(layout.locate(2 * 65536 + 4095), Location::Block(2));
        assert_eq!(layout.locate(2 * 65536 + 4096), Location::PastEof);
        assert_eq!(layout.block_memory(2), 2 * 65536..2 * 65536 + PAGE);
        assert_eq!(layout.block_bytes(2), PAGE);
        assert_eq!(layout.block_memory(1), 65536..2 * 65536);
        assert_eq!(layout.past_eof(), 2 * 65536 + PAGE..4 * 65536);
    }

    #[test]
    fn a_file_smaller_than_a_page_is_one_short_block() {
        let layout = region(10, PAGE, 1 << 20);
        assert_eq!(layout.block_count(), 1);
        assert_eq!(layout.block_memory(0), 0..PAGE);
        assert_eq!(layout.past_eof(), PAGE..PAGE);
    }

    #[test]
    fn overlapping_blocks_are_clipped_to_data() {
        let layout = region(10 * 65536 + 100, 16 * 65536, 65536);
        assert_eq!(layout.blocks_overlapping(0..1), 0..1);
        assert_eq!(layout.blocks_overlapping(65535..65537), 0..2);
        assert_eq!(layout.blocks_overlapping(3 * 65536..100 * 65536), 3..11);
        // Past the data but in its last page: the last block.
        assert_eq!(
            layout.blocks_overlapping(10 * 65536 + 200..10 * 65536 + 300),
            10..11
        );
        assert_eq!(
            layout.blocks_overlapping(10 * 65536 + PAGE..11 * 65536),
            0..0
        );
        assert_eq!(layout.blocks_overlapping(12 * 65536..13 * 65536), 0..0);
        assert_eq!(layout.blocks_overlapping(5..5), 0..0);
    }

    #[test]
    fn locator_finds_regions_and_rejects_gaps() {
        let mut locator = FaultLocator::default();
        locator.insert(0x20000, 0x1000, RegionId(2));
        locator.insert(0x10000, 0x2000, RegionId(1));
        assert_eq!(locator.lookup(0x0ffff), None);
        assert_eq!(locator.lookup(0x10000), Some((RegionId(1), 0)));
        assert_eq!(locator.lookup(0x11fff), Some((RegionId(1), 0x1fff)));
        assert_eq!(locator.lookup(0x12000), None);
        assert_eq!(locator.lookup(0x20800), Some((RegionId(2), 0x800)));
        locator.remove(RegionId(1));
        assert_eq!(locator.lookup(0x10000), None);
    }

    #[test]
    fn locator_keeps_adjacent_regions_apart() {
        let mut locator = FaultLocator::default();
        locator.insert(0x10000, 0x1000, RegionId(1));
        locator.insert(0x11000, 0x1000, RegionId(2));
        assert_eq!(locator.lookup(0x10fff), Some((RegionId(1), 0xfff)));
        assert_eq!(locator.lookup(0x11000), Some((RegionId(2), 0)));
        assert_eq!(locator.lookup(0x12000), None);
    }

    #[test]
    fn a_region_in_a_hole_of_another_answers_inside_it_and_the_outer_one_around_it() {
        // Region 1 lost 0x12000..0x14000 to an unmap; region 2 was placed there.
        let mut locator = FaultLocator::default();
        locator.insert(0x10000, 0x8000, RegionId(1));
        locator.insert(0x12000, 0x2000, RegionId(2));
        assert_eq!(locator.lookup(0x11fff), Some((RegionId(1), 0x1fff)));
        assert_eq!(locator.lookup(0x12000), Some((RegionId(2), 0)));
        assert_eq!(locator.lookup(0x13fff), Some((RegionId(2), 0x1fff)));
        // Above the inner region: the outer one, with offsets from its own base.
        assert_eq!(locator.lookup(0x14000), Some((RegionId(1), 0x4000)));
        assert_eq!(locator.lookup(0x17fff), Some((RegionId(1), 0x7fff)));
        assert_eq!(locator.lookup(0x18000), None);
        // Once the inner region goes, its addresses are the outer one's again.
        locator.remove(RegionId(2));
        assert_eq!(locator.lookup(0x12000), Some((RegionId(1), 0x2000)));
        assert_eq!(locator.lookup(0x14000), Some((RegionId(1), 0x4000)));
    }

    #[test]
    fn a_region_at_the_base_of_another_wins_there() {
        // Region 1 lost its head (as llama.cpp unmaps a GGUF header); region 2 was placed
        // at the same base. The order of insertion decides, not the order of the ids.
        let mut locator = FaultLocator::default();
        locator.insert(0x10000, 0x8000, RegionId(7));
        locator.insert(0x10000, 0x1000, RegionId(3));
        assert_eq!(locator.lookup(0x10000), Some((RegionId(3), 0)));
        assert_eq!(locator.lookup(0x10fff), Some((RegionId(3), 0xfff)));
        assert_eq!(locator.lookup(0x11000), Some((RegionId(7), 0x1000)));
        // The same extent again (the older region wholly unmapped but not yet removed).
        locator.insert(0x10000, 0x8000, RegionId(9));
        assert_eq!(locator.lookup(0x10000), Some((RegionId(9), 0)));
        assert_eq!(locator.lookup(0x17fff), Some((RegionId(9), 0x7fff)));
        locator.remove(RegionId(9));
        assert_eq!(locator.lookup(0x10000), Some((RegionId(3), 0)));
        locator.remove(RegionId(3));
        assert_eq!(locator.lookup(0x10000), Some((RegionId(7), 0)));
    }

    #[test]
    fn a_region_straddling_the_end_of_another_wins_where_they_overlap() {
        // Region 1 lost its tail; region 2, larger, was placed over it and beyond.
        let mut locator = FaultLocator::default();
        locator.insert(0x10000, 0x4000, RegionId(1));
        locator.insert(0x12000, 0x8000, RegionId(2));
        assert_eq!(locator.lookup(0x11fff), Some((RegionId(1), 0x1fff)));
        assert_eq!(locator.lookup(0x12000), Some((RegionId(2), 0)));
        assert_eq!(locator.lookup(0x19fff), Some((RegionId(2), 0x7fff)));
        assert_eq!(locator.lookup(0x1a000), None);
    }

    #[test]
    fn overlaying_keeps_segments_sorted_and_disjoint() {
        let segment = |start, end, id| Segment {
            start,
            end,
            region: RegionId(id),
            base: start,
        };
        let below = segment(0x0, 0x1000, 1);
        let outer = segment(0x1000, 0x5000, 2);
        let above = segment(0x6000, 0x7000, 3);
        let inner = segment(0x2000, 0x3000, 4);
        assert_eq!(
            overlay(vec![below, outer, above], inner),
            vec![
                below,
                Segment {
                    end: 0x2000,
                    ..outer
                },
                inner,
                Segment {
                    start: 0x3000,
                    ..outer
                },
                above,
            ]
        );
        // Covering several segments whole and one in part.
        let wide = segment(0x800, 0x6800, 5);
        assert_eq!(
            overlay(vec![below, outer, above], wide),
            vec![
                Segment {
                    end: 0x800,
                    ..below
                },
                wide,
                Segment {
                    start: 0x6800,
                    ..above
                },
            ]
        );
    }
}
