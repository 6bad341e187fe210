//! How a region cuts its part of a file into blocks: the one place block counts, block
//! indices and block byte ranges are computed, for the service, the graphs and the
//! policies alike.
//!
//! A region presents `file_offset..file_offset + data_len` of a file. Its blocks are
//! `block_size`-long pieces of that range counted from the region's start (not from
//! absolute file offsets); the last one may be short. "Region offsets" below are offsets
//! from the region's first byte; "file ranges" are offsets in the file.

use std::ops::Range;
use std::sync::Arc;

use thiserror::Error;

/// Why a geometry cannot be built.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum GeometryError {
    #[error("block size is zero")]
    ZeroBlockSize,
    #[error("{data_len} bytes in blocks of {block_size} is more than 2^32 blocks")]
    TooManyBlocks { data_len: u64, block_size: u64 },
}

/// The block geometry of a region. Blocks lie on a grid of `block_size` from the
/// region's start, and may be cut further at given offsets (`with_cuts`: an expert's
/// slice of a tensor is then blocks of its own, so that reading one expert does not read
/// its neighbours). Invariants (checked by the constructors): `block_size > 0`, every
/// block index fits a `u32` (`BlockRef::index`), no block is longer than `block_size`,
/// and a block of exactly `block_size` bytes starts on the grid.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BlockGeometry {
    /// File offset of the region's first byte.
    pub file_offset: u64,
    /// Bytes of file data in the region.
    pub data_len: u64,
    /// Length of every block of a uniform geometry but possibly the last; the longest
    /// block of a cut one.
    pub block_size: u64,
    /// Every block's start (region offsets, ascending, the first 0) where the geometry
    /// is cut; empty for a uniform one, whose block `i` starts at `i * block_size`.
    #[serde(default, skip_serializing_if = "<[u64]>::is_empty")]
    starts: Arc<[u64]>,
}

impl BlockGeometry {
    /// A uniform geometry: blocks of `block_size`, the last one possibly short.
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
            starts: Arc::from([]),
        })
    }

    /// The same geometry with blocks also starting at every offset of `cuts` (region
    /// offsets; those outside `1..data_len` or on the grid change nothing). The caller
    /// aligns cuts as the region's pages need.
    pub fn with_cuts(self, cuts: impl IntoIterator<Item = u64>) -> Result<Self, GeometryError> {
        let grid = self.block_size;
        let mut off_grid: Vec<u64> = cuts
            .into_iter()
            .filter(|&cut| cut > 0 && cut < self.data_len && cut % grid != 0)
            .collect();
        off_grid.extend(
            self.starts
                .iter()
                .copied()
                .filter(|start| start % grid != 0),
        );
        if off_grid.is_empty() {
            return Ok(self);
        }
        let mut starts: Vec<u64> = (0..self.data_len.div_ceil(grid))
            .map(|block| block * grid)
            .chain(off_grid)
            .collect();
        starts.sort_unstable();
        starts.dedup();
        if starts.len() > u32::MAX as usize {
            return Err(GeometryError::TooManyBlocks {
                data_len: self.data_len,
                block_size: grid,
            });
        }
        Ok(Self {
            starts: starts.into(),
            ..self
        })
    }

    /// `with_cuts` at file offsets `cuts` (those outside the region are ignored).
    pub fn with_file_cuts(
        self,
        cuts: impl IntoIterator<Item = u64>,
    ) -> Result<Self, GeometryError> {
        let region = self.file_range();
        let offsets: Vec<u64> = cuts
            .into_iter()
            .filter(|cut| region.contains(cut))
            .map(|cut| cut - region.start)
            .collect();
        self.with_cuts(offsets)
    }

    /// Whether every block but the last is `block_size` long.
    pub fn is_uniform(&self) -> bool {
        self.starts.is_empty()
    }

    pub fn block_count(&self) -> u32 {
        // Bounded by the constructors.
        if self.is_uniform() {
            self.data_len.div_ceil(self.block_size) as u32
        } else {
            self.starts.len() as u32
        }
    }

    /// The block holding region offset `offset`. Not clipped: past the data it names a
    /// block the region does not have.
    pub fn block_of(&self, offset: u64) -> u32 {
        if self.is_uniform() {
            return (offset / self.block_size) as u32;
        }
        if offset >= self.data_len {
            let past = (offset - self.data_len) / self.block_size;
            return (self.starts.len() as u64 + past).min(u32::MAX as u64) as u32;
        }
        // starts[0] == 0 <= offset: at least one start is not after it.
        (self.starts.partition_point(|&start| start <= offset) - 1) as u32
    }

    /// Region offset of block `index`'s first byte (past the last block: the end of
    /// the data, then a block size per index further).
    pub fn block_start(&self, index: u32) -> u64 {
        match self.starts.get(index as usize) {
            Some(&start) => start,
            None if self.is_uniform() => index as u64 * self.block_size,
            None => self.data_len + (index as u64 - self.starts.len() as u64) * self.block_size,
        }
    }

    /// Bytes of file data in block `index`: at most `block_size`, less for a short
    /// last block or a cut one; 0 past the end.
    pub fn block_len(&self, index: u32) -> u64 {
        let range = self.block_range(index);
        range.end - range.start
    }

    /// Region offsets of the file data in the run of blocks `blocks` (clipped to the data).
    pub fn data_range(&self, blocks: Range<u32>) -> Range<u64> {
        let end = self.block_start(blocks.end).min(self.data_len);
        self.block_start(blocks.start).min(end)..end
    }

    /// Region offsets of the file data in block `index`.
    pub fn block_range(&self, index: u32) -> Range<u64> {
        self.data_range(index..index.saturating_add(1))
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
        self.block_of(range.start)..self.block_of(end - 1) + 1
    }

    /// Blocks lying wholly inside `range` (region offsets; a block ending at the end of
    /// the data lies inside any range reaching it).
    pub fn blocks_within(&self, range: Range<u64>) -> Range<u32> {
        let mut first = self.block_of(range.start);
        if self.block_start(first) < range.start {
            first += 1;
        }
        let end = if range.end >= self.data_len {
            self.block_count()
        } else {
            self.block_of(range.end)
        };
        first.min(end)..end
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
    fn cuts_split_blocks_between_grid_points() {
        // Grid of 8192 over 20_000 bytes, cut at 3000 (off grid), 8192 (on it: no
        // change), 12_288 and 0 and 30_000 (outside: ignored).
        let geometry = BlockGeometry::new(100, 20_000, 8192)
            .unwrap()
            .with_cuts([3000, 8192, 12_288, 0, 30_000])
            .unwrap();
        assert!(!geometry.is_uniform());
        assert_eq!(geometry.block_count(), 5);
        let ranges: Vec<_> = (0..5).map(|b| geometry.block_range(b)).collect();
        assert_eq!(
            ranges,
            [
                0..3000,
                3000..8192,
                8192..12_288,
                12_288..16_384,
                16_384..20_000
            ]
        );
        assert_eq!(geometry.block_of(2999), 0);
        assert_eq!(geometry.block_of(3000), 1);
        assert_eq!(geometry.block_of(12_287), 2);
        assert_eq!(geometry.block_of(19_999), 4);
        assert_eq!(geometry.block_of(20_000), 5, "past the data: no block");
        assert_eq!(geometry.block_len(5), 0);
        assert_eq!(geometry.blocks_overlapping(2000..9000), 0..3);
        assert_eq!(geometry.blocks_overlapping(3000..8192), 1..2);
        assert_eq!(geometry.block_file_range(1), 3100..8292);
        assert_eq!(geometry.data_range(1..4), 3000..16_384);
        assert!((0..5).all(|b| geometry.block_len(b) <= 8192));
        assert_eq!(geometry.blocks_within(2000..12_288), 1..3);
        assert_eq!(geometry.blocks_within(3000..12_000), 1..2);
        assert_eq!(
            geometry.blocks_within(16_384..24_576),
            4..5,
            "the last block"
        );
        assert_eq!(geometry.blocks_within(4000..5000), 1..1);
    }

    #[test]
    fn cutting_again_keeps_earlier_cuts_and_no_cut_stays_uniform() {
        let uniform = BlockGeometry::new(0, 10_000, 4096).unwrap();
        assert_eq!(uniform.clone().with_cuts([4096, 0]).unwrap(), uniform);
        let twice = uniform
            .clone()
            .with_cuts([1000])
            .unwrap()
            .with_cuts([5000])
            .unwrap();
        assert_eq!(twice, uniform.with_cuts([5000, 1000]).unwrap());
        assert_eq!(twice.block_count(), 5);
    }

    #[test]
    fn a_cut_geometry_survives_a_round_trip_through_json() {
        let geometry = BlockGeometry::new(0, 10_000, 4096)
            .unwrap()
            .with_cuts([1000])
            .unwrap();
        let json = serde_json::to_string(&geometry).unwrap();
        assert_eq!(
            serde_json::from_str::<BlockGeometry>(&json).unwrap(),
            geometry
        );
        let uniform = BlockGeometry::new(0, 10_000, 4096).unwrap();
        let json = serde_json::to_string(&uniform).unwrap();
        assert!(!json.contains("starts"), "{json}");
    }

    #[test]
    fn rejects_degenerate_geometry() {
        assert_eq!(
            BlockGeometry::new(0, 1, 0),
            Err(GeometryError::ZeroBlockSize)
        );
        assert_eq!(
            BlockGeometry::new(0, u64::MAX, 1),
            Err(GeometryError::TooManyBlocks {
                data_len: u64::MAX,
                block_size: 1
            })
        );
        // 2^32 blocks is one too many (block indexes are u32).
        assert_eq!(
            BlockGeometry::new(0, 1 << 32, 1),
            Err(GeometryError::TooManyBlocks {
                data_len: 1 << 32,
                block_size: 1
            })
        );
        assert!(BlockGeometry::new(0, u32::MAX as u64, 1).is_ok());
    }
}
