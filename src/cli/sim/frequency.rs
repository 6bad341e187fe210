//! The offline frequency optimum: evict the block the whole sequence accesses least
//! often. It knows how often each block is used, not when: when accesses are drawn
//! independently (a router picking experts with fixed odds, token after token), keeping
//! the most used blocks is the best any policy can do that does not know the future
//! sequence itself, so this is the floor for learning how often experts are used, as
//! Belady's is for knowing the whole sequence. Where accesses follow one another (a
//! decoder's cyclic pass), order-aware policies beat it.

use std::collections::{BTreeSet, HashMap};

use hyperoffload::policy::{BlockRef, EvictionPolicy, ReadKind, RegionId};

pub struct FrequencyEviction {
    /// Accesses of each block in the whole sequence.
    uses: HashMap<u32, u64>,
    /// Tracked blocks by (uses, arrival): the least used, then the oldest, first.
    tracked: BTreeSet<(u64, u64, BlockRef)>,
    keys: HashMap<BlockRef, (u64, u64)>,
    arrivals: u64,
}

impl FrequencyEviction {
    pub fn new(accesses: &[u32]) -> Self {
        let mut uses = HashMap::new();
        for &block in accesses {
            *uses.entry(block).or_insert(0) += 1;
        }
        Self {
            uses,
            tracked: BTreeSet::new(),
            keys: HashMap::new(),
            arrivals: 0,
        }
    }
}

impl EvictionPolicy for FrequencyEviction {
    fn name(&self) -> &'static str {
        "frequency"
    }

    fn region_removed(&mut self, region: RegionId) {
        self.tracked.retain(|&(_, _, block)| block.region != region);
        self.keys.retain(|block, _| block.region != region);
    }

    fn inserted(&mut self, block: BlockRef) {
        self.removed(block);
        let key = (
            self.uses.get(&block.index).copied().unwrap_or(0),
            self.arrivals,
        );
        self.arrivals += 1;
        self.tracked.insert((key.0, key.1, block));
        self.keys.insert(block, key);
    }

    fn removed(&mut self, block: BlockRef) {
        if let Some((uses, arrival)) = self.keys.remove(&block) {
            self.tracked.remove(&(uses, arrival, block));
        }
    }

    fn victim(&mut self, _incoming: BlockRef, _kind: ReadKind) -> Option<BlockRef> {
        let (_, _, block) = self.tracked.pop_first()?;
        self.keys.remove(&block);
        Some(block)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_least_used_block_goes_first() {
        let accesses = [1, 2, 1, 3, 1, 2];
        let mut policy = FrequencyEviction::new(&accesses);
        let block = |index| BlockRef::new(RegionId(0), index);
        for index in [1, 2, 3, 4] {
            policy.inserted(block(index));
        }
        let incoming = block(9);
        assert_eq!(policy.victim(incoming, ReadKind::Demand), Some(block(4)));
        assert_eq!(policy.victim(incoming, ReadKind::Demand), Some(block(3)));
        policy.removed(block(2));
        assert_eq!(policy.victim(incoming, ReadKind::Demand), Some(block(1)));
        assert_eq!(policy.victim(incoming, ReadKind::Demand), None);
    }
}
