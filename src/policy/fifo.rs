//! FIFO eviction: the block resident longest goes first.

use std::collections::{HashMap, VecDeque};

use super::{BlockRef, EvictionPolicy, ReadKind, RegionId};

/// Evicts in the order blocks became resident. Removal is lazy: a removed block stays in
/// the queue with a stale sequence number and is skipped when it reaches the front.
#[derive(Default)]
pub struct FifoEviction {
    queue: VecDeque<(BlockRef, u64)>,
    live: HashMap<BlockRef, u64>,
    next_seq: u64,
}

impl FifoEviction {
    pub fn tracked(&self) -> usize {
        self.live.len()
    }

    fn compact_if_stale(&mut self) {
        if self.queue.len() > 2 * self.live.len() + 64 {
            let live = &self.live;
            self.queue
                .retain(|(block, seq)| live.get(block) == Some(seq));
        }
    }
}

impl EvictionPolicy for FifoEviction {
    fn name(&self) -> &'static str {
        "fifo"
    }

    fn region_removed(&mut self, region: RegionId) {
        self.live.retain(|block, _| block.region != region);
        self.compact_if_stale();
    }

    fn inserted(&mut self, block: BlockRef) {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.live.insert(block, seq);
        self.queue.push_back((block, seq));
    }

    fn removed(&mut self, block: BlockRef) {
        self.live.remove(&block);
        self.compact_if_stale();
    }

    fn victim(&mut self, _incoming: BlockRef, kind: ReadKind) -> Option<BlockRef> {
        // A prefetched block is worth no more than the oldest resident one under FIFO:
        // prefetch evicts too, which is what a FIFO pager does.
        let _ = kind;
        while let Some((block, seq)) = self.queue.pop_front() {
            if self.live.get(&block) == Some(&seq) {
                self.live.remove(&block);
                return Some(block);
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(index: u32) -> BlockRef {
        BlockRef::new(RegionId(0), index)
    }

    #[test]
    fn evicts_oldest_first_and_skips_removed() {
        let mut fifo = FifoEviction::default();
        for i in 0..4 {
            fifo.inserted(b(i));
        }
        fifo.removed(b(0));
        assert_eq!(fifo.victim(b(9), ReadKind::Demand), Some(b(1)));
        fifo.inserted(b(1));
        assert_eq!(fifo.victim(b(9), ReadKind::Demand), Some(b(2)));
        assert_eq!(fifo.victim(b(9), ReadKind::Prefetch), Some(b(3)));
        assert_eq!(fifo.victim(b(9), ReadKind::Demand), Some(b(1)));
        assert_eq!(fifo.victim(b(9), ReadKind::Demand), None);
    }

    #[test]
    fn forgets_a_removed_region() {
        let mut fifo = FifoEviction::default();
        fifo.inserted(BlockRef::new(RegionId(1), 0));
        fifo.inserted(b(5));
        fifo.region_removed(RegionId(1));
        assert_eq!(fifo.victim(b(9), ReadKind::Demand), Some(b(5)));
        assert_eq!(fifo.tracked(), 0);
    }

    #[test]
    fn stale_entries_do_not_accumulate() {
        let mut fifo = FifoEviction::default();
        for round in 0..10_000u32 {
            fifo.inserted(b(round % 7));
            fifo.removed(b(round % 7));
        }
        assert!(fifo.queue.len() <= 64 + 1);
    }
}
