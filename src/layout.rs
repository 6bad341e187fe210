//! Pure address arithmetic: which block of which region an address falls in, and what
//! bytes of the file each block holds. No syscalls, so it is tested without the kernel.
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

use crate::policy::RegionId;

/// Where an offset inside a region lands.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Location {
    Block(u32),
    /// A whole page past the file data: SIGBUS, as with a file mapping.
    PastEof,
}

/// The block geometry of one region.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegionLayout {
    /// Bytes of file data presented (a suffix of the last page reads as zeros).
    pub data_len: u64,
    /// Length of the mapping: at least the data rounded up to a page.
    pub map_len: u64,
    pub block_size: u64,
    pub page_size: u64,
}

impl RegionLayout {
    /// `block_size` and `page_size` must be powers of two with `block_size >= page_size`,
    /// `map_len` a page multiple at least `data_len` rounded up to a page; the pager's
    /// constructors check these before building a layout.
    pub fn new(data_len: u64, map_len: u64, block_size: u64, page_size: u64) -> Self {
        debug_assert!(block_size.is_power_of_two() && page_size.is_power_of_two());
        debug_assert!(block_size >= page_size);
        debug_assert!(map_len % page_size == 0 && map_len >= data_len.next_multiple_of(page_size));
        Self {
            data_len,
            map_len,
            block_size,
            page_size,
        }
    }

    /// Offset of the end of the last page holding file data.
    pub fn data_pages_end(&self) -> u64 {
        self.data_len.next_multiple_of(self.page_size)
    }

    pub fn block_count(&self) -> u32 {
        self.data_len.div_ceil(self.block_size) as u32
    }

    pub fn locate(&self, offset: u64) -> Location {
        if offset >= self.data_pages_end() {
            Location::PastEof
        } else {
            Location::Block((offset / self.block_size) as u32)
        }
    }

    /// Region offsets of the memory a block occupies (page aligned).
    pub fn block_memory(&self, index: u32) -> Range<u64> {
        let start = index as u64 * self.block_size;
        start..(start + self.block_size).min(self.data_pages_end())
    }

    /// Bytes of memory a resident block occupies: what it costs against the budget.
    pub fn block_bytes(&self, index: u32) -> u64 {
        let memory = self.block_memory(index);
        memory.end - memory.start
    }

    /// Bytes of file data in a block (less than `block_bytes` only for the last block).
    pub fn block_data_len(&self, index: u32) -> u64 {
        let start = index as u64 * self.block_size;
        (start + self.block_size).min(self.data_len) - start
    }

    /// Blocks overlapping a range of region offsets, clipped to the data.
    pub fn blocks_overlapping(&self, range: Range<u64>) -> Range<u32> {
        let end = range.end.min(self.data_pages_end());
        if range.start >= end {
            return 0..0;
        }
        (range.start / self.block_size) as u32..end.div_ceil(self.block_size) as u32
    }

    /// Whole pages in `[data_pages_end, map_len)`: the part that raises SIGBUS.
    pub fn past_eof(&self) -> Range<u64> {
        self.data_pages_end()..self.map_len
    }
}

/// The parts of `range` outside every hole (ranges the program unmapped), in order.
///
/// The service must never touch a hole: the program may have mapped something else
/// there since, and MADV_DONTNEED on it would zero another mapping's pages.
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
#[derive(Default, Debug)]
pub struct FaultLocator {
    /// (base, end, region), sorted by base, non-overlapping.
    spans: Vec<(usize, usize, RegionId)>,
}

impl FaultLocator {
    pub fn insert(&mut self, base: usize, len: usize, region: RegionId) {
        let at = self.spans.partition_point(|&(start, _, _)| start < base);
        self.spans.insert(at, (base, base + len, region));
    }

    pub fn remove(&mut self, region: RegionId) {
        self.spans.retain(|&(_, _, id)| id != region);
    }

    /// The region containing `addr` and the offset of `addr` inside it.
    pub fn lookup(&self, addr: usize) -> Option<(RegionId, u64)> {
        let after = self.spans.partition_point(|&(start, _, _)| start <= addr);
        let &(start, end, region) = self.spans.get(after.checked_sub(1)?)?;
        (addr < end).then_some((region, (addr - start) as u64))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: u64 = 4096;

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
        let layout = RegionLayout::new(2 * 65536 + 100, 4 * 65536, 65536, PAGE);
        assert_eq!(layout.block_count(), 3);
        assert_eq!(layout.locate(0), Location::Block(0));
        assert_eq!(layout.locate(65535), Location::Block(0));
        assert_eq!(layout.locate(2 * 65536 + 4095), Location::Block(2));
        assert_eq!(layout.locate(2 * 65536 + 4096), Location::PastEof);
        assert_eq!(layout.block_memory(2), 2 * 65536..2 * 65536 + PAGE);
        assert_eq!(layout.block_bytes(2), PAGE);
        assert_eq!(layout.block_data_len(2), 100);
        assert_eq!(layout.block_data_len(1), 65536);
        assert_eq!(layout.past_eof(), 2 * 65536 + PAGE..4 * 65536);
    }

    #[test]
    fn a_file_smaller_than_a_page_is_one_short_block() {
        let layout = RegionLayout::new(10, PAGE, 1 << 20, PAGE);
        assert_eq!(layout.block_count(), 1);
        assert_eq!(layout.block_memory(0), 0..PAGE);
        assert_eq!(layout.block_data_len(0), 10);
        assert_eq!(layout.past_eof(), PAGE..PAGE);
    }

    #[test]
    fn overlapping_blocks_are_clipped_to_data() {
        let layout = RegionLayout::new(10 * 65536, 16 * 65536, 65536, PAGE);
        assert_eq!(layout.blocks_overlapping(0..1), 0..1);
        assert_eq!(layout.blocks_overlapping(65535..65537), 0..2);
        assert_eq!(layout.blocks_overlapping(3 * 65536..100 * 65536), 3..10);
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
}
