//! Baseline prefetch policies: none, and sequential readahead with stream detection.

use std::collections::HashMap;

use super::{
    AccessHint, BlockRef, FaultEvent, FaultOutcome, PrefetchPolicy, PrefetchRequest, RegionId,
    RegionInfo,
};

/// Reads nothing but what faults.
pub struct NoPrefetch;

impl PrefetchPolicy for NoPrefetch {
    fn name(&self) -> &'static str {
        "none"
    }

    fn plan(&mut self, _fault: &FaultEvent, _out: &mut Vec<PrefetchRequest>) {}
}

/// Sequential readahead over several concurrent streams per region.
///
/// A fault just after a stream's last fault, or inside the window the stream has read
/// ahead, continues that stream: its window doubles (up to `max_window_bytes`) and the
/// blocks ahead of the fault are requested. One block in the middle of each new window
/// is a marker (installed on fault), so a program running on prefetched data still
/// reaches the policy before the window runs dry. A fault that continues no stream
/// starts one without reading ahead: random access costs no extra I/O. Several streams
/// are tracked because parallel readers (matmul threads sweeping one tensor, `scan
/// --threads`) each advance their own.
pub struct SequentialReadahead {
    /// First window, in bytes, once a stream is confirmed sequential.
    pub initial_window_bytes: u64,
    pub max_window_bytes: u64,
    /// Streams tracked per region; the least recently advanced is replaced.
    pub max_streams: usize,
    regions: HashMap<RegionId, RegionStreams>,
}

impl Default for SequentialReadahead {
    fn default() -> Self {
        Self {
            initial_window_bytes: 1 << 20,
            max_window_bytes: 64 << 20,
            max_streams: 16,
            regions: HashMap::new(),
        }
    }
}

struct RegionStreams {
    block_count: u32,
    block_size: u64,
    initial_window: u32,
    max_window: u32,
    disabled: bool,
    streams: Vec<Stream>,
}

#[derive(Clone, Copy)]
struct Stream {
    /// Last block that faulted in this stream.
    last: u32,
    /// Blocks requested ahead of `last` at its fault; 0 until confirmed sequential.
    window: u32,
    last_time_ns: u64,
}

impl Stream {
    fn continues_with(&self, index: u32) -> bool {
        index > self.last && index - self.last <= self.window.max(1)
    }
}

impl SequentialReadahead {
    fn blocks_for(bytes: u64, block_size: u64) -> u32 {
        bytes.div_ceil(block_size).clamp(1, u32::MAX as u64) as u32
    }

    /// The first and the largest window, in blocks of `block_size`, under `budget`.
    fn windows(&self, budget: u64, block_size: u64) -> (u32, u32) {
        // A window beyond a fraction of the budget would evict what it read before the
        // program got there (a quarter: several streams may be open at once).
        let max_bytes = self.max_window_bytes.min(budget / 4);
        let initial_window = Self::blocks_for(self.initial_window_bytes.min(max_bytes), block_size);
        let max_window = Self::blocks_for(max_bytes, block_size).max(initial_window);
        (initial_window, max_window)
    }
}

impl PrefetchPolicy for SequentialReadahead {
    fn name(&self) -> &'static str {
        "readahead"
    }

    fn region_added(&mut self, info: &RegionInfo<'_>) {
        let block_size = info.geometry.block_size;
        let (initial_window, max_window) = self.windows(info.budget, block_size);
        self.regions.insert(
            info.id,
            RegionStreams {
                block_count: info.geometry.block_count(),
                block_size,
                initial_window,
                max_window,
                disabled: false,
                streams: Vec::new(),
            },
        );
    }

    fn budget_changed(&mut self, budget: u64) {
        let mut regions = std::mem::take(&mut self.regions);
        for state in regions.values_mut() {
            (state.initial_window, state.max_window) = self.windows(budget, state.block_size);
            // Open streams keep their progress; a window beyond the new bound shrinks.
            for stream in &mut state.streams {
                stream.window = stream.window.min(state.max_window);
            }
        }
        self.regions = regions;
    }

    fn region_removed(&mut self, region: RegionId) {
        self.regions.remove(&region);
    }

    fn hint(&mut self, region: RegionId, _blocks: std::ops::Range<u32>, hint: AccessHint) {
        if let Some(state) = self.regions.get_mut(&region) {
            state.disabled = hint == AccessHint::Random;
        }
    }

    fn plan(&mut self, fault: &FaultEvent, out: &mut Vec<PrefetchRequest>) {
        let Some(state) = self.regions.get_mut(&fault.block.region) else {
            return;
        };
        if state.disabled {
            return;
        }
        let index = fault.block.index;
        let continuing = state
            .streams
            .iter()
            .position(|stream| stream.continues_with(index) || stream.last == index);
        let stream = match continuing {
            Some(position) => {
                let stream = &mut state.streams[position];
                if stream.last != index || fault.outcome == FaultOutcome::Staged {
                    stream.window = match stream.window {
                        0 => state.initial_window,
                        window => (window * 2).min(state.max_window),
                    };
                }
                stream.last = index;
                stream.last_time_ns = fault.time_ns;
                *stream
            }
            None => {
                let fresh = Stream {
                    last: index,
                    window: 0,
                    last_time_ns: fault.time_ns,
                };
                if state.streams.len() < self.max_streams {
                    state.streams.push(fresh);
                } else if let Some(oldest) = state.streams.iter_mut().min_by_key(|s| s.last_time_ns)
                {
                    *oldest = fresh;
                }
                fresh
            }
        };
        if stream.window == 0 {
            return;
        }
        let first = index.saturating_add(1);
        let end = index
            .saturating_add(1)
            .saturating_add(stream.window)
            .min(state.block_count);
        // The marker sits half a window ahead: when the program reaches it, the other
        // half is still ahead of it, in flight or resident.
        let marker = first + stream.window / 2;
        for block in first..end {
            let block = BlockRef::new(fault.block.region, block);
            out.push(if block.index == marker {
                PrefetchRequest::marker(block)
            } else {
                PrefetchRequest::eager(block)
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::BlockGeometry;
    use crate::policy::Install;
    use std::path::Path;

    fn policy_with_region(blocks: u32) -> SequentialReadahead {
        let mut policy = SequentialReadahead {
            initial_window_bytes: 4 << 20,
            max_window_bytes: 16 << 20,
            ..Default::default()
        };
        policy.region_added(&RegionInfo {
            id: RegionId(0),
            path: Path::new("/x"),
            geometry: BlockGeometry::new(0, blocks as u64 * (1 << 20), 1 << 20).unwrap(),
            budget: u64::MAX,
            watch_resident: false,
        });
        policy
    }

    fn fault(index: u32, time_ns: u64) -> FaultEvent {
        FaultEvent {
            block: BlockRef::new(RegionId(0), index),
            time_ns,
            outcome: FaultOutcome::Missing,
            offset_in_block: None,
        }
    }

    fn plan(policy: &mut SequentialReadahead, event: FaultEvent) -> Vec<PrefetchRequest> {
        let mut out = Vec::new();
        policy.plan(&event, &mut out);
        out
    }

    #[test]
    fn the_window_follows_the_budget_down_and_back() {
        let mut policy = policy_with_region(1000);
        let windows = |policy: &SequentialReadahead| {
            let state = &policy.regions[&RegionId(0)];
            (state.initial_window, state.max_window)
        };
        assert_eq!(windows(&policy), (4, 16));
        // Grow a stream to the largest window (16 blocks of 1 MiB).
        plan(&mut policy, fault(0, 0));
        plan(&mut policy, fault(1, 1));
        plan(&mut policy, fault(4, 2));
        plan(&mut policy, fault(12, 3));
        // A budget of 8 MiB allows windows of a quarter of it: 2 blocks, the open
        // stream's too.
        policy.budget_changed(8 << 20);
        assert_eq!(windows(&policy), (2, 2));
        let shrunk = plan(&mut policy, fault(13, 4));
        assert!(shrunk.len() <= 2, "{shrunk:?}");
        // Grown back past what the configuration allows: the configured windows.
        policy.budget_changed(1 << 30);
        assert_eq!(windows(&policy), (4, 16));
    }

    #[test]
    fn first_fault_reads_nothing_ahead() {
        let mut policy = policy_with_region(100);
        assert!(plan(&mut policy, fault(10, 0)).is_empty());
    }

    #[test]
    fn sequential_faults_open_and_grow_the_window_with_one_marker() {
        let mut policy = policy_with_region(100);
        plan(&mut policy, fault(0, 0));
        let first = plan(&mut policy, fault(1, 1));
        let indices: Vec<u32> = first.iter().map(|r| r.block.index).collect();
        assert_eq!(indices, vec![2, 3, 4, 5]);
        let markers: Vec<u32> = first
            .iter()
            .filter(|r| r.install == Install::OnFault)
            .map(|r| r.block.index)
            .collect();
        assert_eq!(markers, vec![4]);
        // Reaching the marker doubles the window.
        let second = plan(
            &mut policy,
            FaultEvent {
                outcome: FaultOutcome::Staged,
                ..fault(4, 2)
            },
        );
        assert_eq!(second.len(), 8);
        assert_eq!(second[0].block.index, 5);
        // Capped at the maximum window (16 blocks) and at the end of the region.
        let third = plan(&mut policy, fault(12, 3));
        assert_eq!(third.len(), 16);
        let near_end = plan(&mut policy, fault(95, 4));
        assert!(near_end.is_empty(), "a jump is not a continuation");
        let end = plan(&mut policy, fault(96, 5));
        assert_eq!(end.last().unwrap().block.index, 99);
    }

    #[test]
    fn interleaved_streams_are_tracked_separately() {
        let mut policy = policy_with_region(1000);
        plan(&mut policy, fault(0, 0));
        plan(&mut policy, fault(500, 1));
        assert_eq!(plan(&mut policy, fault(1, 2)).len(), 4);
        assert_eq!(plan(&mut policy, fault(501, 3)).len(), 4);
    }

    #[test]
    fn random_hint_disables_readahead() {
        let mut policy = policy_with_region(100);
        policy.hint(RegionId(0), 0..100, AccessHint::Random);
        plan(&mut policy, fault(0, 0));
        assert!(plan(&mut policy, fault(1, 1)).is_empty());
    }
}
