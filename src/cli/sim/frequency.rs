//! The offline frequency optimum: evict the block the whole sequence accesses least
//! often. It knows how often each block is used in the very sequence replayed, not
//! when. When accesses are drawn independently with fixed odds (a router picking
//! experts token after token), keeping the blocks of the highest odds is the best an
//! online policy can do (the independent reference model's optimum, A0 of Aho, Denning
//! and Ullman, 1971); these counts are the odds plus this one sample's fluctuations,
//! which no online policy can know, so it reads less than that optimum, most where few
//! blocks are left out (`MoeShape::resampled` estimates the odds from other tokens of
//! the same router, and the MoE suite measures both). Where accesses follow one another
//! (a decoder's cyclic pass), order-aware policies beat it.

use std::collections::{BTreeSet, HashMap};

use hyperoffload::policy::{BlockRef, EvictionPolicy, FaultEvent, ReadKind, RegionId};

/// Resident blocks in eviction order: the fewest uses first, then the earliest filed.
#[derive(Default)]
struct ByUses {
    order: BTreeSet<(u64, u64, BlockRef)>,
    keys: HashMap<BlockRef, (u64, u64)>,
    /// Stamps each filing, so equal uses go earliest filed first.
    clock: u64,
}

impl ByUses {
    /// Files `block` (again) under `uses`, after every block filed before.
    fn file(&mut self, block: BlockRef, uses: u64) {
        self.remove(block);
        let key = (uses, self.clock);
        self.clock += 1;
        self.order.insert((key.0, key.1, block));
        self.keys.insert(block, key);
    }

    fn remove(&mut self, block: BlockRef) {
        if let Some((uses, stamp)) = self.keys.remove(&block) {
            self.order.remove(&(uses, stamp, block));
        }
    }

    fn contains(&self, block: BlockRef) -> bool {
        self.keys.contains_key(&block)
    }

    fn remove_region(&mut self, region: RegionId) {
        self.order.retain(|&(_, _, block)| block.region != region);
        self.keys.retain(|block, _| block.region != region);
    }

    fn pop_least_used(&mut self) -> Option<BlockRef> {
        let (_, _, block) = self.order.pop_first()?;
        self.keys.remove(&block);
        Some(block)
    }
}

pub struct FrequencyEviction {
    /// Accesses of each block in the whole sequence.
    uses: HashMap<u32, u64>,
    /// Tracked blocks: the least used, then the oldest, first.
    resident: ByUses,
}

impl FrequencyEviction {
    pub fn new(accesses: &[u32]) -> Self {
        let mut uses = HashMap::new();
        for &block in accesses {
            *uses.entry(block).or_insert(0) += 1;
        }
        Self {
            uses,
            resident: ByUses::default(),
        }
    }
}

impl EvictionPolicy for FrequencyEviction {
    fn name(&self) -> &'static str {
        "frequency"
    }

    fn region_removed(&mut self, region: RegionId) {
        self.resident.remove_region(region);
    }

    fn inserted(&mut self, block: BlockRef) {
        let uses = self.uses.get(&block.index).copied().unwrap_or(0);
        self.resident.file(block, uses);
    }

    fn removed(&mut self, block: BlockRef) {
        self.resident.remove(block);
    }

    fn victim(&mut self, _incoming: BlockRef, _kind: ReadKind) -> Option<BlockRef> {
        self.resident.pop_least_used()
    }
}

/// Online LFU: evict the block accessed least often so far, the least recently used
/// among equals. It hears of every access (as the simulator's LRU does), so it is what
/// learning the counts online costs against `FrequencyEviction`, which knows them from
/// the start: on independent routing it is the best a policy without foresight and
/// without the counts in advance can do, and the distance from it to `frequency` is
/// the learning no policy avoids.
#[derive(Default)]
pub struct OnlineFrequencyEviction {
    /// Accesses of each block so far.
    uses: HashMap<u32, u64>,
    /// Resident blocks: the least used, then the least recently used, first (each
    /// access files its block again).
    resident: ByUses,
}

impl OnlineFrequencyEviction {
    fn file(&mut self, block: BlockRef) {
        let uses = self.uses.get(&block.index).copied().unwrap_or(0);
        self.resident.file(block, uses);
    }
}

impl EvictionPolicy for OnlineFrequencyEviction {
    fn name(&self) -> &'static str {
        "lfu"
    }

    fn region_removed(&mut self, region: RegionId) {
        self.resident.remove_region(region);
    }

    fn inserted(&mut self, block: BlockRef) {
        self.file(block);
    }

    fn removed(&mut self, block: BlockRef) {
        self.resident.remove(block);
    }

    /// Every access counts, resident or not: a block read again later starts from its
    /// whole history.
    fn touched(&mut self, fault: &FaultEvent) {
        *self.uses.entry(fault.block.index).or_insert(0) += 1;
        if self.resident.contains(fault.block) {
            self.file(fault.block);
        }
    }

    fn victim(&mut self, _incoming: BlockRef, _kind: ReadKind) -> Option<BlockRef> {
        self.resident.pop_least_used()
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

    fn touch(policy: &mut OnlineFrequencyEviction, index: u32) {
        policy.touched(&FaultEvent {
            block: BlockRef::new(RegionId(0), index),
            time_ns: 0,
            outcome: hyperoffload::policy::FaultOutcome::Resident,
            offset_in_block: None,
        });
    }

    #[test]
    fn online_lfu_evicts_the_least_used_so_far_then_the_least_recent() {
        let block = |index| BlockRef::new(RegionId(0), index);
        let mut policy = OnlineFrequencyEviction::default();
        // 1 used three times, 2 twice, 3 and 4 once each (4 most recently).
        for index in [1, 2, 1, 3, 2, 1, 4] {
            touch(&mut policy, index);
            if !policy.resident.contains(block(index)) {
                policy.inserted(block(index));
            }
        }
        let incoming = block(9);
        assert_eq!(policy.victim(incoming, ReadKind::Demand), Some(block(3)));
        assert_eq!(policy.victim(incoming, ReadKind::Demand), Some(block(4)));
        // Evicted and read again, 3 keeps its history: two uses, as many as 2, and
        // more recent, so 2 goes first.
        touch(&mut policy, 3);
        policy.inserted(block(3));
        assert_eq!(policy.victim(incoming, ReadKind::Demand), Some(block(2)));
        assert_eq!(policy.victim(incoming, ReadKind::Demand), Some(block(3)));
        assert_eq!(policy.victim(incoming, ReadKind::Demand), Some(block(1)));
        assert_eq!(policy.victim(incoming, ReadKind::Demand), None);
    }
}
