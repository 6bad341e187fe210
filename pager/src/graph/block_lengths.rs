//! Block counts and lengths, as decisions over a model's blocks need them.

use crate::geometry::BlockGeometry;

/// Block counts and lengths of one region (`BlockGeometry`) or of a model in several
/// files (`ModelGraph`).
pub trait BlockLengths {
    fn block_size(&self) -> u64;
    fn block_count(&self) -> u32;
    /// Bytes of file data in block `index`; 0 past the end.
    fn block_len(&self, index: u32) -> u64;
}

impl BlockLengths for BlockGeometry {
    fn block_size(&self) -> u64 {
        self.block_size
    }

    fn block_count(&self) -> u32 {
        BlockGeometry::block_count(self)
    }

    fn block_len(&self, index: u32) -> u64 {
        BlockGeometry::block_len(self, index)
    }
}
