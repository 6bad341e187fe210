//! Eviction for a run that records the access order to learn a graph from (a file of no
//! known format, see `policy_name`): FIFO, and every resident block watched once the
//! program has gone on to another, so that each access to a block, resident or not,
//! faults and is recorded.
//!
//! Recording only the faults of demand paging under a budget misses the accesses to
//! blocks still resident, and a graph learned from what is left predicts a pass that
//! never happens. Measured on a 256 MiB file read in a fixed shuffled order of 1 MiB
//! chunks, 4 passes, budget 96M: the graph learned from demand faults alone read 3.0
//! GiB per run, twice what demand paging reads; learned from every access (simulated)
//! it reads 0.94 GiB, against Belady's 0.88.

use std::collections::HashSet;

use super::{BlockRef, EvictionPolicy, FaultEvent, FifoEviction, ReadKind, RegionId, RegionInfo};

#[derive(Default)]
pub struct RecordingEviction {
    fifo: FifoEviction,
    /// Resident blocks to watch once the program is on another block.
    to_watch: Vec<BlockRef>,
    watched: HashSet<BlockRef>,
    last_fault: Option<BlockRef>,
    /// Whether the pager watches resident blocks (zero copy).
    watching: bool,
}

impl RecordingEviction {
    fn forget(&mut self, block: BlockRef) {
        self.to_watch.retain(|&b| b != block);
        self.watched.remove(&block);
    }
}

impl EvictionPolicy for RecordingEviction {
    fn name(&self) -> &'static str {
        "fifo, recording every access"
    }

    fn region_added(&mut self, info: &RegionInfo<'_>) {
        self.watching = info.watch_resident;
        self.fifo.region_added(info);
    }

    fn region_removed(&mut self, region: RegionId) {
        self.fifo.region_removed(region);
        self.to_watch.retain(|block| block.region != region);
        self.watched.retain(|block| block.region != region);
    }

    fn inserted(&mut self, block: BlockRef) {
        self.fifo.inserted(block);
        if self.watching {
            self.to_watch.push(block);
        }
    }

    fn removed(&mut self, block: BlockRef) {
        self.fifo.removed(block);
        self.forget(block);
    }

    fn touched(&mut self, fault: &FaultEvent) {
        self.fifo.touched(fault);
        self.last_fault = Some(fault.block);
        if self.watched.remove(&fault.block) {
            self.to_watch.push(fault.block);
        }
    }

    fn watch(&mut self, out: &mut Vec<BlockRef>) {
        let last_fault = self.last_fault;
        let watched = &mut self.watched;
        self.to_watch.retain(|&block| {
            // The block in use now is watched once the program has left it.
            if Some(block) == last_fault {
                return true;
            }
            if watched.insert(block) {
                out.push(block);
            }
            false
        });
    }

    fn victim(&mut self, incoming: BlockRef, kind: ReadKind) -> Option<BlockRef> {
        let victim = self.fifo.victim(incoming, kind)?;
        self.forget(victim);
        Some(victim)
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::geometry::BlockGeometry;
    use crate::policy::FaultOutcome;

    fn b(index: u32) -> BlockRef {
        BlockRef::new(RegionId(0), index)
    }

    fn fault(index: u32) -> FaultEvent {
        FaultEvent {
            block: b(index),
            time_ns: 0,
            outcome: FaultOutcome::Missing,
            offset_in_block: None,
        }
    }

    fn policy(watch_resident: bool) -> RecordingEviction {
        let mut policy = RecordingEviction::default();
        policy.region_added(&RegionInfo {
            id: RegionId(0),
            path: Path::new("/f"),
            geometry: BlockGeometry::new(0, 8 << 20, 1 << 20).unwrap(),
            budget: 4 << 20,
            watch_resident,
        });
        policy
    }

    fn watched(policy: &mut RecordingEviction) -> Vec<BlockRef> {
        let mut out = Vec::new();
        policy.watch(&mut out);
        out
    }

    #[test]
    fn every_resident_block_but_the_one_in_use_is_watched() {
        let mut policy = policy(true);
        policy.touched(&fault(0));
        policy.inserted(b(0));
        assert!(watched(&mut policy).is_empty(), "block 0 is in use");
        policy.touched(&fault(1));
        policy.inserted(b(1));
        assert_eq!(watched(&mut policy), [b(0)]);
        // Block 0 used again: a watch fault; watched again once the program moves on.
        policy.touched(&FaultEvent {
            outcome: FaultOutcome::Resident,
            ..fault(0)
        });
        assert_eq!(watched(&mut policy), [b(1)]);
        policy.touched(&fault(2));
        assert_eq!(watched(&mut policy), [b(0)]);
        // Eviction is FIFO, and an evicted block is watched no more.
        assert_eq!(policy.victim(b(5), ReadKind::Demand), Some(b(0)));
        assert!(watched(&mut policy).is_empty());
    }

    #[test]
    fn without_watching_it_is_fifo() {
        let mut policy = policy(false);
        for index in 0..3 {
            policy.touched(&fault(index));
            policy.inserted(b(index));
        }
        assert!(watched(&mut policy).is_empty());
        assert_eq!(policy.victim(b(5), ReadKind::Demand), Some(b(0)));
    }
}
