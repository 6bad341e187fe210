//! Belady's offline optimum: evict the block whose next access is furthest in the future.
//! It knows the whole access sequence, so it is the floor no online policy beats for
//! demand reads (equal-sized blocks).

use std::collections::{BTreeSet, HashMap};

use hyperoffload::policy::{BlockRef, EvictionPolicy, FaultEvent, ReadKind, RegionId};

/// Needs `touched` once per access, in order (the simulator's every-access mode): the
/// n-th call is access n.
pub struct BeladyEviction {
    /// Per access: the index of the next access to the same block, `usize::MAX` if none.
    next_use: Vec<usize>,
    accesses_seen: usize,
    /// Next use of each block as of its latest access.
    latest: HashMap<BlockRef, usize>,
    tracked: HashMap<BlockRef, usize>,
    by_next_use: BTreeSet<(usize, BlockRef)>,
}

impl BeladyEviction {
    pub fn new(accesses: &[u32]) -> Self {
        let mut next_use = vec![usize::MAX; accesses.len()];
        let mut seen_at: HashMap<u32, usize> = HashMap::new();
        for (i, &block) in accesses.iter().enumerate().rev() {
            if let Some(&later) = seen_at.get(&block) {
                next_use[i] = later;
            }
            seen_at.insert(block, i);
        }
        Self {
            next_use,
            accesses_seen: 0,
            latest: HashMap::new(),
            tracked: HashMap::new(),
            by_next_use: BTreeSet::new(),
        }
    }

    fn set(&mut self, block: BlockRef, next: usize) {
        if let Some(old) = self.tracked.insert(block, next) {
            self.by_next_use.remove(&(old, block));
        }
        self.by_next_use.insert((next, block));
    }
}

impl EvictionPolicy for BeladyEviction {
    fn name(&self) -> &'static str {
        "belady"
    }

    fn region_removed(&mut self, region: RegionId) {
        self.tracked.retain(|b, _| b.region != region);
        self.by_next_use.retain(|(_, b)| b.region != region);
    }

    fn inserted(&mut self, block: BlockRef) {
        let next = self.latest.get(&block).copied().unwrap_or(usize::MAX);
        self.set(block, next);
    }

    fn removed(&mut self, block: BlockRef) {
        if let Some(next) = self.tracked.remove(&block) {
            self.by_next_use.remove(&(next, block));
        }
    }

    fn touched(&mut self, fault: &FaultEvent) {
        let next = self
            .next_use
            .get(self.accesses_seen)
            .copied()
            .unwrap_or(usize::MAX);
        self.accesses_seen += 1;
        self.latest.insert(fault.block, next);
        if self.tracked.contains_key(&fault.block) {
            self.set(fault.block, next);
        }
    }

    fn victim(&mut self, _incoming: BlockRef, _kind: ReadKind) -> Option<BlockRef> {
        let (_, block) = self.by_next_use.pop_last()?;
        self.tracked.remove(&block);
        Some(block)
    }
}
