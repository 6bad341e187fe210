//! How a region cuts its part of a file into blocks: the one place block counts, block
//! indices and block byte ranges are computed, for the service, the graphs and the
//! policies alike.
//!
//! A region presents `file_offset..file_offset + data_len` of a file. Its blocks are
//! `block_size`-long pieces of that range counted from the region's start (not from
//! absolute file offsets); the last one may be short. "Region offsets" below are offsets
//! from the region's first byte; "file ranges" are offsets in the file.

use std::ops::Range;

use thiserror::Error;

/// Why a geometry cannot be built.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum GeometryError {
    #[error("block size is zero")]
    ZeroBlockSize,
    #[error("{data_len} bytes in blocks of {block_size} is more than 2^32 blocks")]
    TooManyBlocks { data_len: u64, block_size: u64 },
}

/// The block geometry of a region. Invariant (checked by `new`): `block_size > 0` and
/// every block index fits a `u32` (`BlockRef::index`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BlockGeometry {
    /// File offset of the region's first byte.
    pub file_offset: u64,
    /// Bytes of file data in the region.
    pub data_len: u64,
    /// Length of every block but possibly the last.
    pub block_size: u64,
}

impl BlockGeometry {
    pub fn new(file_offset: u64, data_len: u64, block_size: u64) -> Result<Self, GeometryError> {
        if block_size == 0 {
            return Err(GeometryError::ZeroBlockSize);
        }
        if data_len.div_ceil(block_size) > u32::MAX as u64 {
            return Err(GeometryError::TooManyBlocks {
                data_len,
                block_size,
            });
        }
        Ok(Self {
            file_offset,
            data_len,
            block_size,
        })
    }

    pub fn block_count(&self) -> u32 {
        // Bounded by `new`.
        self.data_len.div_ceil(self.block_size) as u32
    }

    /// The block holding region offset `offset`. Not clipped: past the data it names a
    /// block the region does not have.
    pub fn block_of(&self, offset: u64) -> u32 {
        (offset / self.block_size) as u32
    }

    /// Region offset of block `index`'s first byte.
    pub fn block_start(&self, index: u32) -> u64 {
        index as u64 * self.block_size
    }

    /// Bytes of file data in block `index`: `block_size` but for a short last block; 0
    /// past the end.
    pub fn block_len(&self, index: u32) -> u64 {
        self.data_len
            .saturating_sub(self.block_start(index))
            .min(self.block_size)
    }

    /// Region offsets of the file data in the run of blocks `blocks` (clipped to the data).
    pub fn data_range(&self, blocks: Range<u32>) -> Range<u64> {
        let end = self.block_start(blocks.end).min(self.data_len);
        self.block_start(blocks.start).min(end)..end
    }

    /// Region offsets of the file data in block `index`.
    pub fn block_range(&self, index: u32) -> Range<u64> {
        self.data_range(index..index + 1)
    }

    /// The file byte range block `index` holds.
    pub fn block_file_range(&self, index: u32) -> Range<u64> {
        let range = self.block_range(index);
        self.file_offset + range.start..self.file_offset + range.end
    }

    /// The file byte range the region presents.
    pub fn file_range(&self) -> Range<u64> {
        self.file_offset..self.file_offset + self.data_len
    }

    /// Blocks overlapping `range` (region offsets), clipped to the data; empty when
    /// none do.
    pub fn blocks_overlapping(&self, range: Range<u64>) -> Range<u32> {
        let end = range.end.min(self.data_len);
        if range.start >= end {
            return 0..0;
        }
        self.block_of(range.start)..end.div_ceil(self.block_size) as u32
    }

    /// The region offsets of the part of file range `range` inside the region; `None`
    /// when none of it is.
    pub fn region_offsets(&self, range: &Range<u64>) -> Option<Range<u64>> {
        let region = self.file_range();
        let start = range.start.max(region.start);
        let end = range.end.min(region.end);
        (start < end).then(|| start - self.file_offset..end - self.file_offset)
    }

    /// The blocks covering the part of file range `range` inside the region; `None`
    /// when none of it is. A block shared with a neighbouring range is included: both
    /// ranges need it.
    pub fn blocks_of_file_range(&self, range: &Range<u64>) -> Option<Range<u32>> {
        self.region_offsets(range)
            .map(|offsets| self.blocks_overlapping(offsets))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_blocks_and_the_short_last_one() {
        let geometry = BlockGeometry::new(0, 10_000, 4096).unwrap();
        assert_eq!(geometry.block_count(), 3);
        assert_eq!(geometry.block_len(0), 4096);
        assert_eq!(geometry.block_len(2), 10_000 - 8192);
        assert_eq!(geometry.block_len(3), 0);
        assert_eq!(geometry.block_range(2), 8192..10_000);
        assert_eq!(geometry.block_range(3), 10_000..10_000);
        assert_eq!(geometry.data_range(1..3), 4096..10_000);
        assert_eq!(BlockGeometry::new(0, 0, 4096).unwrap().block_count(), 0);
    }

    #[test]
    fn offsets_map_to_blocks_from_the_region_start() {
        let geometry = BlockGeometry::new(1000, 8192, 4096).unwrap();
        assert_eq!(geometry.block_of(0), 0);
        assert_eq!(geometry.block_of(4095), 0);
        assert_eq!(geometry.block_of(4096), 1);
        assert_eq!(geometry.block_start(1), 4096);
        assert_eq!(geometry.block_file_range(1), 5096..9192);
        assert_eq!(geometry.file_range(), 1000..9192);
    }

    #[test]
    fn overlapping_blocks_are_clipped_to_data() {
        let geometry = BlockGeometry::new(0, 10 * 65536, 65536).unwrap();
        assert_eq!(geometry.blocks_overlapping(0..1), 0..1);
        assert_eq!(geometry.blocks_overlapping(65535..65537), 0..2);
        assert_eq!(geometry.blocks_overlapping(3 * 65536..100 * 65536), 3..10);
        assert_eq!(geometry.blocks_overlapping(12 * 65536..13 * 65536), 0..0);
        assert_eq!(geometry.blocks_overlapping(5..5), 0..0);
    }

    #[test]
    fn file_ranges_map_to_the_blocks_they_touch() {
        let geometry = BlockGeometry::new(0, 10_000, 4096).unwrap();
        assert_eq!(geometry.blocks_of_file_range(&(0..4096)), Some(0..1));
        assert_eq!(geometry.blocks_of_file_range(&(4000..4100)), Some(0..2));
        assert_eq!(geometry.blocks_of_file_range(&(9000..20_000)), Some(2..3));
        assert_eq!(geometry.blocks_of_file_range(&(10_000..20_000)), None);

        let offset = BlockGeometry::new(1000, 8192, 4096).unwrap();
        assert_eq!(offset.blocks_of_file_range(&(1000..1001)), Some(0..1));
        assert_eq!(offset.blocks_of_file_range(&(5096..5097)), Some(1..2));
        assert_eq!(offset.blocks_of_file_range(&(0..1000)), None);
        assert_eq!(offset.region_offsets(&(0..2000)), Some(0..1000));
        assert_eq!(offset.region_offsets(&(9000..10_000)), Some(8000..8192));
    }

    #[test]
    fn rejects_degenerate_geometry() {
        assert_eq!(
            BlockGeometry::new(0, 1, 0),
            Err(GeometryError::ZeroBlockSize)
        );
        assert!(BlockGeometry::new(0, u64::MAX, 1).is_err());
    }
}
