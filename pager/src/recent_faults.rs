//! The blocks each thread faulted on last, which eviction spares.
//!
//! One instruction can need two blocks at once: a load that straddles a block boundary
//! faults on the first block, then (retried once it is served) on the second. Evicting
//! the first to make room for the second has the retry fault on the first again, and so
//! on for good: a livelock no policy is meant to cause, but any can (the graph policies
//! evict blocks they do not predict first, and the just-served block may be the only
//! one; Belady's rule evicts the block just passed). The kernel never does this to a
//! program because the page it just faulted in is the newest it has. So the last two
//! blocks a thread faulted on stay resident while other blocks can be evicted instead;
//! when nothing else can, they go too (a budget below two blocks a thread cannot hold
//! them).
//!
//! Threads are told apart by the id the fault message carries. Only the threads that
//! faulted most recently are remembered (`MAX_THREADS`): a thread that has gone quiet,
//! or exited, does not hold its blocks for ever.

use crate::policy::{BlockRef, RegionId};

/// Threads whose last blocks are spared.
pub const MAX_THREADS: usize = 64;

#[derive(Debug, Clone, Copy)]
struct ThreadFaults {
    tid: u32,
    /// The latest block first.
    blocks: [Option<BlockRef>; 2],
    /// When it last faulted, in faults recorded.
    last: u64,
}

/// The last two blocks of each of the threads that faulted most recently.
#[derive(Debug, Default)]
pub struct RecentFaults {
    threads: Vec<ThreadFaults>,
    faults: u64,
}

impl RecentFaults {
    /// Thread `tid` faulted on `block`.
    pub fn record(&mut self, tid: u32, block: BlockRef) {
        self.faults += 1;
        let now = self.faults;
        if let Some(thread) = self.threads.iter_mut().find(|t| t.tid == tid) {
            if thread.blocks[0] != Some(block) {
                thread.blocks = [Some(block), thread.blocks[0]];
            }
            thread.last = now;
            return;
        }
        let entry = ThreadFaults {
            tid,
            blocks: [Some(block), None],
            last: now,
        };
        if self.threads.len() < MAX_THREADS {
            self.threads.push(entry);
        } else if let Some(oldest) = self.threads.iter_mut().min_by_key(|t| t.last) {
            *oldest = entry;
        }
    }

    /// Whether `block` is one of a remembered thread's last two.
    pub fn spares(&self, block: BlockRef) -> bool {
        self.threads
            .iter()
            .any(|thread| thread.blocks.contains(&Some(block)))
    }

    /// The region is gone: its blocks are spared no more.
    pub fn region_removed(&mut self, region: RegionId) {
        for thread in &mut self.threads {
            for slot in &mut thread.blocks {
                if slot.is_some_and(|block| block.region == region) {
                    *slot = None;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(index: u32) -> BlockRef {
        BlockRef::new(RegionId(1), index)
    }

    #[test]
    fn a_thread_keeps_its_last_two_blocks() {
        let mut recent = RecentFaults::default();
        recent.record(7, block(2));
        recent.record(7, block(3));
        assert!(recent.spares(block(2)) && recent.spares(block(3)));
        // Faulting on the same block again does not push the other out.
        recent.record(7, block(3));
        assert!(recent.spares(block(2)));
        recent.record(7, block(4));
        assert!(!recent.spares(block(2)));
        assert!(recent.spares(block(3)) && recent.spares(block(4)));
    }

    #[test]
    fn threads_are_remembered_apart_and_the_quietest_is_forgotten_first() {
        let mut recent = RecentFaults::default();
        recent.record(1, block(100));
        for tid in 2..=MAX_THREADS as u32 {
            recent.record(tid, block(tid));
        }
        recent.record(1, block(101));
        assert!(recent.spares(block(100)) && recent.spares(block(2)));
        // One thread more: thread 2 faulted longest ago.
        recent.record(1000, block(1000));
        assert!(!recent.spares(block(2)));
        assert!(recent.spares(block(100)) && recent.spares(block(1000)));
    }

    #[test]
    fn a_removed_region_is_spared_no_more() {
        let mut recent = RecentFaults::default();
        recent.record(1, block(5));
        recent.record(1, BlockRef::new(RegionId(2), 5));
        recent.region_removed(RegionId(1));
        assert!(!recent.spares(block(5)));
        assert!(recent.spares(BlockRef::new(RegionId(2), 5)));
    }
}
