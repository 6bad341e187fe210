//! A value per block for the few regions a pager has: dense vectors, grown on demand.
//! The eviction policies touch every block read, so a hash map keyed by block cost a
//! cache miss and a hash per block (a third of the fault service's time at 4 KiB blocks).

use super::{BlockRef, RegionId};

#[derive(Debug)]
pub(crate) struct PerBlock<T> {
    regions: Vec<(RegionId, Vec<T>)>,
}

impl<T> Default for PerBlock<T> {
    fn default() -> Self {
        Self {
            regions: Vec::new(),
        }
    }
}

impl<T: Clone + Default> PerBlock<T> {
    /// The block's value (`T::default()` until set).
    pub(crate) fn get_mut(&mut self, block: BlockRef) -> &mut T {
        let at = match self.regions.iter().position(|(id, _)| *id == block.region) {
            Some(at) => at,
            None => {
                self.regions.push((block.region, Vec::new()));
                self.regions.len() - 1
            }
        };
        let values = &mut self.regions[at].1;
        let index = block.index as usize;
        if index >= values.len() {
            values.resize(index + 1, T::default());
        }
        &mut values[index]
    }

    /// A region's values, indexed by block (shorter than the region if never grown).
    pub(crate) fn region(&self, region: RegionId) -> &[T] {
        self.regions
            .iter()
            .find(|(id, _)| *id == region)
            .map_or(&[], |(_, values)| values.as_slice())
    }

    /// Every region's values, indexed by block.
    pub(crate) fn regions(&self) -> impl Iterator<Item = (RegionId, &[T])> {
        self.regions
            .iter()
            .map(|(id, values)| (*id, values.as_slice()))
    }

    /// Forgets a region's values.
    pub(crate) fn remove_region(&mut self, region: RegionId) {
        self.regions.retain(|(id, _)| *id != region);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_default_grow_and_go_with_their_region() {
        let mut values = PerBlock::<u64>::default();
        let a = BlockRef::new(RegionId(1), 5);
        assert_eq!(*values.get_mut(a), 0);
        *values.get_mut(a) = 7;
        *values.get_mut(BlockRef::new(RegionId(2), 0)) = 9;
        assert_eq!(values.region(RegionId(1)), &[0, 0, 0, 0, 0, 7]);
        values.remove_region(RegionId(1));
        assert!(values.region(RegionId(1)).is_empty());
        assert_eq!(values.region(RegionId(2)), &[9]);
    }
}
