//! Which cache blocks a read of an object touches, and which to read ahead.
//!
//! An object is cut into blocks of one size (the last one shorter); the cache keeps
//! whole blocks and the remote is asked for whole blocks, so a read of any byte range
//! becomes a run of block numbers. Pure: no I/O.

use std::ops::Range;

/// The block grid of one object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockGrid {
    /// The object's size in bytes.
    pub size: u64,
    /// The block size in bytes (more than zero).
    pub block: u64,
}

/// What one read needs: the blocks it reads, and the ones after them to fetch ahead.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadPlan {
    /// Blocks holding the bytes read, in order.
    pub needed: Range<u64>,
    /// Blocks to fetch ahead (after `needed`, within the object), in order.
    pub ahead: Range<u64>,
    /// The bytes actually read: the request cut at the end of the object.
    pub bytes: Range<u64>,
}

impl BlockGrid {
    /// A grid; `block` must be more than zero.
    pub fn new(size: u64, block: u64) -> Self {
        assert!(block > 0, "block size 0");
        Self { size, block }
    }

    /// How many blocks the object has (0 for an empty object).
    pub fn count(&self) -> u64 {
        self.size.div_ceil(self.block)
    }

    /// The byte range of block `index` (shorter for the last block).
    pub fn bytes_of(&self, index: u64) -> Range<u64> {
        let start = index.saturating_mul(self.block).min(self.size);
        start..start.saturating_add(self.block).min(self.size)
    }

    /// The plan for reading `len` bytes at `offset` with `readahead` blocks ahead. A
    /// read at or past the end reads nothing and fetches nothing.
    pub fn plan(&self, offset: u64, len: u64, readahead: u64) -> ReadPlan {
        let end = offset.saturating_add(len).min(self.size);
        if offset >= end {
            return ReadPlan {
                needed: 0..0,
                ahead: 0..0,
                bytes: offset.min(self.size)..offset.min(self.size),
            };
        }
        let first = offset / self.block;
        let last = (end - 1) / self.block;
        let ahead_end = last
            .saturating_add(1)
            .saturating_add(readahead)
            .min(self.count());
        ReadPlan {
            needed: first..last + 1,
            ahead: last + 1..ahead_end,
            bytes: offset..end,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_read_inside_one_block_needs_that_block() {
        let grid = BlockGrid::new(10_000, 4096);
        assert_eq!(grid.count(), 3);
        let plan = grid.plan(100, 10, 0);
        assert_eq!(plan.needed, 0..1);
        assert_eq!(plan.ahead, 1..1);
        assert_eq!(plan.bytes, 100..110);
    }

    #[test]
    fn a_read_across_blocks_needs_each_and_ahead_stops_at_the_end() {
        let grid = BlockGrid::new(10_000, 4096);
        let plan = grid.plan(4000, 200, 8);
        assert_eq!(plan.needed, 0..2);
        assert_eq!(plan.ahead, 2..3);
        assert_eq!(grid.bytes_of(2), 8192..10_000);
    }

    #[test]
    fn a_read_past_the_end_is_cut_or_empty() {
        let grid = BlockGrid::new(10_000, 4096);
        let plan = grid.plan(9_000, 5_000, 2);
        assert_eq!(plan.needed, 2..3);
        assert_eq!(plan.bytes, 9_000..10_000);
        assert!(plan.ahead.is_empty());
        let plan = grid.plan(10_000, 10, 2);
        assert!(plan.needed.is_empty() && plan.ahead.is_empty() && plan.bytes.is_empty());
        let plan = grid.plan(u64::MAX - 1, u64::MAX, 2);
        assert!(plan.needed.is_empty());
    }

    #[test]
    fn block_edges_are_exact() {
        let grid = BlockGrid::new(8192, 4096);
        assert_eq!(grid.plan(4095, 1, 0).needed, 0..1);
        assert_eq!(grid.plan(4096, 1, 0).needed, 1..2);
        assert_eq!(grid.plan(0, 8192, 3).needed, 0..2);
        assert_eq!(grid.bytes_of(1), 4096..8192);
        assert_eq!(BlockGrid::new(0, 4096).count(), 0);
    }
}
