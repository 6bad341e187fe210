//! LRU and CLOCK eviction: the kernel's page-cache family, as baselines.
//!
//! Both rank by the `touched` signal. In the simulator every access touches; in the
//! pager only faults do (a resident block never faults), so there LRU degrades to FIFO
//! by last fault and CLOCK's reference bits are set only by faults that found a block
//! resident or in flight.

use std::collections::{BTreeMap, HashMap};

use super::{BlockRef, EvictionPolicy, FaultEvent, ReadKind, RegionId};

/// Least recently used first.
#[derive(Default)]
pub struct LruEviction {
    stamp_of: HashMap<BlockRef, u64>,
    by_stamp: BTreeMap<u64, BlockRef>,
    clock: u64,
}

impl LruEviction {
    fn stamp(&mut self, block: BlockRef) {
        if let Some(old) = self.stamp_of.insert(block, self.clock) {
            self.by_stamp.remove(&old);
        }
        self.by_stamp.insert(self.clock, block);
        self.clock += 1;
    }
}

impl EvictionPolicy for LruEviction {
    fn name(&self) -> &'static str {
        "lru"
    }

    fn region_removed(&mut self, region: RegionId) {
        self.stamp_of.retain(|b, _| b.region != region);
        self.by_stamp.retain(|_, b| b.region != region);
    }

    fn inserted(&mut self, block: BlockRef) {
        self.stamp(block);
    }

    fn removed(&mut self, block: BlockRef) {
        if let Some(stamp) = self.stamp_of.remove(&block) {
            self.by_stamp.remove(&stamp);
        }
    }

    fn touched(&mut self, fault: &FaultEvent) {
        if self.stamp_of.contains_key(&fault.block) {
            self.stamp(fault.block);
        }
    }

    fn victim(&mut self, _incoming: BlockRef, _kind: ReadKind) -> Option<BlockRef> {
        let (_, block) = self.by_stamp.pop_first()?;
        self.stamp_of.remove(&block);
        Some(block)
    }
}

/// CLOCK (second chance): a hand sweeps the resident blocks, clearing reference bits and
/// taking the first block found without one.
#[derive(Default)]
pub struct ClockEviction {
    slots: Vec<Option<(BlockRef, bool)>>,
    slot_of: HashMap<BlockRef, usize>,
    free: Vec<usize>,
    hand: usize,
}

impl EvictionPolicy for ClockEviction {
    fn name(&self) -> &'static str {
        "clock"
    }

    fn region_removed(&mut self, region: RegionId) {
        let gone: Vec<BlockRef> = self
            .slot_of
            .keys()
            .filter(|b| b.region == region)
            .copied()
            .collect();
        for block in gone {
            self.removed(block);
        }
    }

    fn inserted(&mut self, block: BlockRef) {
        if let Some(&slot) = self.slot_of.get(&block) {
            self.slots[slot] = Some((block, true));
            return;
        }
        // A new block starts unreferenced: it earns its second chance by being used.
        let slot = match self.free.pop() {
            Some(slot) => {
                self.slots[slot] = Some((block, false));
                slot
            }
            None => {
                self.slots.push(Some((block, false)));
                self.slots.len() - 1
            }
        };
        self.slot_of.insert(block, slot);
    }

    fn removed(&mut self, block: BlockRef) {
        if let Some(slot) = self.slot_of.remove(&block) {
            self.slots[slot] = None;
            self.free.push(slot);
        }
    }

    fn touched(&mut self, fault: &FaultEvent) {
        if let Some(&slot) = self.slot_of.get(&fault.block) {
            if let Some((_, referenced)) = &mut self.slots[slot] {
                *referenced = true;
            }
        }
    }

    fn victim(&mut self, _incoming: BlockRef, _kind: ReadKind) -> Option<BlockRef> {
        if self.slot_of.is_empty() {
            return None;
        }
        // At most two sweeps: the first clears every bit it passes.
        for _ in 0..2 * self.slots.len() {
            let slot = self.hand;
            self.hand = (self.hand + 1) % self.slots.len();
            match &mut self.slots[slot] {
                Some((_, referenced)) if *referenced => *referenced = false,
                Some((block, _)) => {
                    let block = *block;
                    self.removed(block);
                    return Some(block);
                }
                None => {}
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::FaultOutcome;

    fn b(index: u32) -> BlockRef {
        BlockRef::new(RegionId(0), index)
    }

    fn touch(index: u32) -> FaultEvent {
        FaultEvent {
            block: b(index),
            time_ns: 0,
            outcome: FaultOutcome::Resident,
            offset_in_block: None,
        }
    }

    #[test]
    fn lru_evicts_the_least_recently_touched() {
        let mut lru = LruEviction::default();
        for i in 0..3 {
            lru.inserted(b(i));
        }
        lru.touched(&touch(0));
        lru.touched(&touch(9)); // untracked: ignored
        assert_eq!(lru.victim(b(9), ReadKind::Demand), Some(b(1)));
        lru.removed(b(2));
        assert_eq!(lru.victim(b(9), ReadKind::Demand), Some(b(0)));
        assert_eq!(lru.victim(b(9), ReadKind::Demand), None);
    }

    #[test]
    fn clock_gives_referenced_blocks_a_second_chance() {
        let mut clock = ClockEviction::default();
        for i in 0..3 {
            clock.inserted(b(i));
        }
        clock.touched(&touch(0));
        assert_eq!(clock.victim(b(9), ReadKind::Demand), Some(b(1)));
        assert_eq!(clock.victim(b(9), ReadKind::Demand), Some(b(2)));
        // 0's bit was cleared by the first sweep.
        assert_eq!(clock.victim(b(9), ReadKind::Demand), Some(b(0)));
        assert_eq!(clock.victim(b(9), ReadKind::Demand), None);
        clock.inserted(b(5));
        clock.region_removed(RegionId(0));
        assert_eq!(clock.victim(b(9), ReadKind::Demand), None);
    }
}
