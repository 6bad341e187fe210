//! FIFO eviction: the block resident longest goes first.

use std::collections::VecDeque;

use super::per_block::PerBlock;
use super::{BlockRef, EvictionPolicy, ReadKind, RegionId};

/// Evicts in the order blocks became resident. Removal is lazy: a removed block stays in
/// the queue with a stale sequence number and is skipped when it reaches the front.
#[derive(Default)]
pub struct FifoEviction {
    queue: VecDeque<(BlockRef, u64)>,
    /// Per region, per block: the sequence number of its live queue entry (0: none).
    /// Dense, since every block read passes through here.
    live: PerBlock<u64>,
    tracked: usize,
    next_seq: u64,
}

impl FifoEviction {
    pub fn tracked(&self) -> usize {
        self.tracked
    }

    fn live_seq(&mut self, block: BlockRef) -> &mut u64 {
        self.live.get_mut(block)
    }

    fn compact_if_stale(&mut self) {
        if self.queue.len() > 2 * self.tracked + 64 {
            let mut queue = std::mem::take(&mut self.queue);
            queue.retain(|&(block, seq)| *self.live_seq(block) == seq);
            self.queue = queue;
        }
    }
}

impl EvictionPolicy for FifoEviction {
    fn name(&self) -> &'static str {
        "fifo"
    }

    fn region_removed(&mut self, region: RegionId) {
        self.tracked -= self
            .live
            .region(region)
            .iter()
            .filter(|&&seq| seq != 0)
            .count();
        self.live.remove_region(region);
        self.compact_if_stale();
    }

    fn inserted(&mut self, block: BlockRef) {
        self.next_seq += 1;
        let seq = self.next_seq;
        let live = self.live_seq(block);
        let was_live = *live != 0;
        *live = seq;
        if !was_live {
            self.tracked += 1;
        }
        self.queue.push_back((block, seq));
    }

    fn removed(&mut self, block: BlockRef) {
        let live = self.live_seq(block);
        let was_live = std::mem::take(live) != 0;
        if was_live {
            self.tracked -= 1;
        }
        self.compact_if_stale();
    }

    fn victim(&mut self, _incoming: BlockRef, kind: ReadKind) -> Option<BlockRef> {
        // A prefetched block is worth no more than the oldest resident one under FIFO:
        // prefetch evicts too, which is what a FIFO pager does.
        let _ = kind;
        while let Some((block, seq)) = self.queue.pop_front() {
            let live = self.live_seq(block);
            if *live == seq {
                *live = 0;
                self.tracked -= 1;
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
