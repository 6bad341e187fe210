//! How a region cuts a file into blocks: the block index of a byte, the blocks of a
//! byte range.

use std::ops::Range;

use super::GraphError;

/// The block geometry of the region a graph describes: blocks are `block_size`-aligned
/// pieces of `file_offset..file_offset + data_len`, counted from the region's start (not
/// from absolute file offsets), as `RegionInfo` counts them.
#[derive(Copy, Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BlockLayout {
    pub file_offset: u64,
    pub data_len: u64,
    pub block_size: u64,
}

impl BlockLayout {
    /// Checks that blocks are non-empty and that every block index fits a `u32`
    /// (`BlockRef::index`).
    pub fn new(file_offset: u64, data_len: u64, block_size: u64) -> Result<Self, GraphError> {
        if block_size == 0 {
            return Err(GraphError::ZeroBlockSize);
        }
        if data_len.div_ceil(block_size) > u32::MAX as u64 {
            return Err(GraphError::TooManyBlocks {
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

    /// Bytes of file data in block `index` (the last block may be short); 0 past the end.
    pub fn block_len(&self, index: u32) -> u64 {
        let start = index as u64 * self.block_size;
        self.data_len.saturating_sub(start).min(self.block_size)
    }

    /// The blocks covering the part of the file range `range` that lies in the region;
    /// `None` when none of it does. A block shared with a neighbouring range is included:
    /// both ranges need it.
    pub fn blocks_of(&self, range: &Range<u64>) -> Option<Range<u32>> {
        let region_end = self.file_offset + self.data_len;
        let start = range.start.max(self.file_offset);
        let end = range.end.min(region_end);
        if start >= end {
            return None;
        }
        let first = (start - self.file_offset) / self.block_size;
        let last = (end - self.file_offset).div_ceil(self.block_size);
        Some(first as u32..last as u32)
    }
}

/// Block counts and lengths, as decisions over a model's blocks need them: of one
/// region (`BlockLayout`) or of a model in several files (`ModelGraph`).
pub trait BlockLengths {
    fn block_size(&self) -> u64;
    fn block_count(&self) -> u32;
    /// Bytes of file data in block `index`; 0 past the end.
    fn block_len(&self, index: u32) -> u64;
}

impl BlockLengths for BlockLayout {
    fn block_size(&self) -> u64 {
        self.block_size
    }

    fn block_count(&self) -> u32 {
        BlockLayout::block_count(self)
    }

    fn block_len(&self, index: u32) -> u64 {
        BlockLayout::block_len(self, index)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_map_to_the_blocks_they_touch() {
        let layout = BlockLayout::new(0, 10_000, 4096).unwrap();
        assert_eq!(layout.block_count(), 3);
        assert_eq!(layout.blocks_of(&(0..4096)), Some(0..1));
        assert_eq!(layout.blocks_of(&(4000..4100)), Some(0..2));
        assert_eq!(layout.blocks_of(&(9000..20_000)), Some(2..3));
        assert_eq!(layout.blocks_of(&(10_000..20_000)), None);
        assert_eq!(layout.block_len(2), 10_000 - 8192);
        assert_eq!(layout.block_len(3), 0);
    }

    #[test]
    fn blocks_count_from_the_region_start() {
        let layout = BlockLayout::new(1000, 8192, 4096).unwrap();
        assert_eq!(layout.blocks_of(&(1000..1001)), Some(0..1));
        assert_eq!(layout.blocks_of(&(5096..5097)), Some(1..2));
        assert_eq!(layout.blocks_of(&(0..1000)), None);
    }

    #[test]
    fn rejects_degenerate_geometry() {
        assert_eq!(BlockLayout::new(0, 1, 0), Err(GraphError::ZeroBlockSize));
        assert!(BlockLayout::new(0, u64::MAX, 1).is_err());
    }
}
