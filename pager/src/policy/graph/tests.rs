use std::path::Path;

use super::streaming::STREAM_DEVICE_BYTES;
use super::*;
use crate::geometry::BlockGeometry;
use crate::graph::CyclicOrder;
use crate::model::TensorInfo;
use crate::policy::{
    BlockRef, EvictionPolicy, FaultEvent, FaultOutcome, Install, PrefetchPolicy, ReadKind,
    RegionId, RegionInfo, Urgency,
};

const BLOCK: u64 = 4096;

fn b(index: u32) -> BlockRef {
    BlockRef::new(RegionId(0), index)
}

/// A graph whose predicted order is `pass`, over `blocks` blocks, bound to region 0.
fn policies(pass: &[u32], blocks: u32) -> (GraphPrefetch, GraphEviction) {
    guarded_policies(pass, blocks, 0)
}

/// As `policies`, sparing `guard` positions behind the latest fault.
fn guarded_policies(pass: &[u32], blocks: u32, guard: u32) -> (GraphPrefetch, GraphEviction) {
    bound_policies(pass, blocks, BLOCK, guard, u64::MAX)
}

/// Both policies over a graph whose predicted order is `pass`, over `blocks` blocks of
/// `block` bytes, bound to region 0 under `budget` bytes.
fn bound_policies(
    pass: &[u32],
    blocks: u32,
    block: u64,
    guard: u32,
    budget: u64,
) -> (GraphPrefetch, GraphEviction) {
    let layout = BlockGeometry::new(0, blocks as u64 * block, block).unwrap();
    let graph = Arc::new(ModelGraph::from_pass(layout.clone(), pass).with_lag_guard(guard));
    let (mut prefetch, mut eviction) = graph_policies(graph);
    let info = RegionInfo {
        id: RegionId(0),
        path: Path::new("/model"),
        geometry: layout,
        budget,
        watch_resident: false,
    };
    prefetch.region_added(&info);
    eviction.region_added(&info);
    (prefetch, eviction)
}

fn fault(index: u32, time_ns: u64) -> FaultEvent {
    FaultEvent {
        block: b(index),
        time_ns,
        outcome: FaultOutcome::Missing,
        offset_in_block: None,
    }
}

#[test]
fn evicts_the_block_used_furthest_ahead() {
    let pass: Vec<u32> = (0..10).collect();
    let (_, mut eviction) = policies(&pass, 10);
    for i in 0..5 {
        eviction.inserted(b(i));
    }
    eviction.touched(&fault(5, 0));
    // 4 was just used: its next use is a whole pass away.
    assert_eq!(eviction.victim(b(5), ReadKind::Demand), Some(b(4)));
    // A prefetch of 6 (next) displaces 3 (a pass away).
    assert_eq!(eviction.victim(b(6), ReadKind::Prefetch), Some(b(3)));
    assert_eq!(eviction.tracked(), 3);
}

#[test]
fn blocks_a_lagging_thread_may_still_read_are_evicted_last() {
    let pass: Vec<u32> = (0..10).collect();
    let (_, mut eviction) = guarded_policies(&pass, 10, 3);
    for i in [0, 1, 2, 3, 4, 8] {
        eviction.inserted(b(i));
    }
    // A thread faults on 5 while another may still be reading 2..5: 1 and 0 go first,
    // though 4 is the block used furthest ahead.
    eviction.touched(&fault(5, 0));
    assert_eq!(eviction.victim(b(5), ReadKind::Demand), Some(b(1)));
    assert_eq!(eviction.victim(b(6), ReadKind::Prefetch), Some(b(0)));
    // Then the guarded ones, oldest first (the thread behind is more likely still to
    // read the newer ones): they are used again next pass at the latest, where 8 is
    // still to be used in this one.
    assert_eq!(eviction.victim(b(7), ReadKind::Demand), Some(b(2)));
    assert_eq!(eviction.victim(b(7), ReadKind::Demand), Some(b(3)));
    assert_eq!(eviction.victim(b(7), ReadKind::Demand), Some(b(4)));
    assert_eq!(eviction.victim(b(7), ReadKind::Demand), Some(b(8)));
}

#[test]
fn without_a_bound_from_the_model_the_observed_lag_guards() {
    let pass: Vec<u32> = (0..64).collect();
    let (_, mut eviction) = policies(&pass, 64);
    for i in 0..10 {
        eviction.inserted(b(i));
    }
    // Two threads: one faults at 10, the other 3 blocks behind it, then the first goes on.
    eviction.touched(&fault(10, 0));
    eviction.touched(&fault(7, 1));
    eviction.touched(&fault(11, 2));
    // 8, 9 and 10 lie within the observed lag of 11: older blocks go first.
    assert_eq!(eviction.victim(b(12), ReadKind::Demand), Some(b(7)));
    assert_eq!(eviction.victim(b(12), ReadKind::Demand), Some(b(6)));
}

/// The pass of a layer whose norm shares block 2 with the start of its last matrix
/// (blocks 2..=5), used 39 positions later: 0 1 2 [10..=47] 2 3 4 5 (45 positions).
fn shared_block_pass() -> Vec<u32> {
    let mut pass = vec![0, 1, 2];
    pass.extend(10..=47);
    pass.extend([2, 3, 4, 5]);
    pass
}

#[test]
fn a_fault_on_a_block_used_just_behind_is_a_lagging_thread_there() {
    let pass = shared_block_pass();
    let (_, mut eviction) = policies(&pass, 48);
    // One thread starts the last matrix at 3 (position 42); the other faults on its
    // first block, 2: one position behind, not a pass ahead at position 2.
    eviction.touched(&fault(3, 0));
    eviction.touched(&fault(2, 1));
    assert_eq!(eviction.prediction.cursor(), 41);
    assert_eq!(eviction.prediction.lock().lag_seen, 1);
}

#[test]
fn a_block_used_last_inside_the_guard_is_guarded_whatever_its_next_use() {
    let pass = shared_block_pass();
    let (_, mut eviction) = guarded_policies(&pass, 48, 3);
    for i in [2, 3, 47] {
        eviction.inserted(b(i));
    }
    // The program is at 4 (position 43), the guard is positions 40..43. Block 2 was
    // last used at 41, inside it, though its next use (position 2) lies behind it: it
    // goes with the guarded ones, oldest first, not before them.
    eviction.touched(&fault(4, 0));
    assert_eq!(eviction.victim(b(5), ReadKind::Demand), Some(b(47)));
    assert_eq!(eviction.victim(b(5), ReadKind::Demand), Some(b(2)));
    assert_eq!(eviction.victim(b(5), ReadKind::Demand), Some(b(3)));
}

#[test]
fn a_prefetch_never_displaces_a_block_needed_sooner() {
    let pass: Vec<u32> = (0..10).collect();
    let (_, mut eviction) = policies(&pass, 10);
    eviction.inserted(b(6));
    eviction.inserted(b(7));
    eviction.touched(&fault(5, 0));
    assert_eq!(eviction.victim(b(9), ReadKind::Prefetch), None);
    assert_eq!(eviction.victim(b(8), ReadKind::Prefetch), None);
    // An unpredicted incoming block displaces nothing predicted either.
    assert_eq!(
        eviction.victim(BlockRef::new(RegionId(3), 0), ReadKind::Prefetch),
        None
    );
    // A demand read always gets room: the furthest goes.
    assert_eq!(eviction.victim(b(9), ReadKind::Demand), Some(b(7)));
}

#[test]
fn a_prefetch_for_a_thread_behind_the_cursor_is_not_refused() {
    let pass: Vec<u32> = (0..10).collect();
    let (_, mut eviction) = guarded_policies(&pass, 10, 3);
    for i in [0, 1, 2, 3, 8] {
        eviction.inserted(b(i));
    }
    // One thread faults at 6; 4 lies within the step behind it, where another thread
    // is still to read it: it is needed now, not a pass from now, and the block used
    // furthest ahead outside the guard (2) makes room for it.
    eviction.touched(&fault(6, 0));
    assert_eq!(eviction.victim(b(4), ReadKind::Prefetch), Some(b(2)));
}

/// Policies over `blocks` blocks of 2 MiB (one streaming chunk each), predicted order
/// `pass`, under a budget of `budget_blocks` blocks.
fn streaming_policies(
    pass: &[u32],
    blocks: u32,
    budget_blocks: u64,
) -> (GraphPrefetch, GraphEviction) {
    let block = 2 << 20;
    bound_policies(pass, blocks, block, 0, budget_blocks * block)
}

#[test]
fn streamed_blocks_are_evicted_before_kept_ones() {
    // 30 blocks, a budget of 24: 6 must stream, 8 more for the window, 1 behind; the
    // 15 kept are spread evenly: every other block.
    let pass: Vec<u32> = (0..30).collect();
    let (prefetch, mut eviction) = streaming_policies(&pass, 30, 24);
    let plan = eviction.prediction.stream_plan();
    let kept: Vec<u32> = (0..30).filter(|&b| !plan.is_streamed(b)).collect();
    assert_eq!(kept, (0..30).step_by(2).collect::<Vec<_>>());
    assert_eq!(prefetch.max_lookahead_bytes, 8 * (2 << 20), "the window");
    for i in 0..10 {
        eviction.inserted(b(i));
    }
    eviction.touched(&fault(9, 0));
    // Streamed blocks the program passed, the latest first; then the streamed block
    // still to be used (9, at the cursor); only then kept ones, by Belady's rule.
    let victims: Vec<u32> = (0..10)
        .map(|_| eviction.victim(b(10), ReadKind::Demand).unwrap().index)
        .collect();
    assert_eq!(victims, [7, 5, 3, 1, 9, 8, 6, 4, 2, 0]);
}

#[test]
fn the_device_bound_holds_from_the_second_pass() {
    let pass: Vec<u32> = (0..30).collect();
    let (mut prefetch, _) = streaming_policies(&pass, 30, 20);
    let mut requests = Vec::new();
    // The first pass reads every block: the device's full depth.
    for i in 0..30 {
        prefetch.plan(&fault(i, i as u64), &mut requests);
        assert_eq!(prefetch.device_bytes(), None, "at {i}");
    }
    prefetch.plan(&fault(0, 30), &mut requests);
    assert_eq!(prefetch.device_bytes(), Some(STREAM_DEVICE_BYTES));
}

#[test]
fn a_model_that_fits_streams_nothing() {
    let pass: Vec<u32> = (0..20).collect();
    let (prefetch, eviction) = streaming_policies(&pass, 20, 20);
    assert!(!eviction.prediction.stream_plan().streams());
    // The lookahead is bounded by the budget then, not by a streaming window, and the
    // device may take a whole queue.
    assert_eq!(prefetch.max_lookahead_bytes, 20 * (2 << 20) / 8);
    assert_eq!(prefetch.device_bytes(), None);
}

#[test]
fn a_contiguous_stream_looks_ahead_an_eighth_at_most_and_never_past_the_cap() {
    // Below two thirds of the model nothing is spread: an eighth of the budget or of
    // what streams, whichever is less, and at most `STREAM_LOOKAHEAD_MAX`.
    let block = 2u64 << 20;
    let pass: Vec<u32> = (0..1536).collect();
    let quarter = bound_policies(&pass, 1536, block, 0, 384 * block).0;
    assert_eq!(quarter.max_lookahead_bytes, 384 * block / 8);
    let half = bound_policies(&pass, 1536, block, 0, 768 * block).0;
    assert_eq!(half.max_lookahead_bytes, STREAM_LOOKAHEAD_MAX);
    assert!(768 * block / 8 > STREAM_LOOKAHEAD_MAX);
    assert_eq!(half.device_bytes(), None, "no spread set, no device bound");
}

#[test]
fn the_lookahead_follows_the_budget_down_and_back() {
    let block = 2u64 << 20;
    // A contiguous stream (half the model): the cap, STREAM_LOOKAHEAD_MAX.
    let pass: Vec<u32> = (0..1536).collect();
    let mut prefetch = bound_policies(&pass, 1536, block, 0, 768 * block).0;
    assert_eq!(prefetch.max_lookahead_bytes, STREAM_LOOKAHEAD_MAX);
    assert_eq!(prefetch.initial_lookahead_bytes, 4 << 20);
    // An eighth of a budget shrunk to 96 blocks, then of 8 blocks (below the initial
    // lookahead, which follows).
    prefetch.budget_changed(96 * block);
    assert_eq!(prefetch.max_lookahead_bytes, 96 * block / 8);
    prefetch.budget_changed(8 * block);
    assert_eq!(prefetch.max_lookahead_bytes, block);
    assert_eq!(prefetch.initial_lookahead_bytes, block);
    assert_eq!(prefetch.lookahead_bytes(), block);
    // Grown back: the limits as they were.
    prefetch.budget_changed(768 * block);
    assert_eq!(prefetch.max_lookahead_bytes, STREAM_LOOKAHEAD_MAX);
    assert_eq!(prefetch.initial_lookahead_bytes, 4 << 20);

    // A spread set (30 blocks, budget 24): its window. The set is chosen again for
    // each budget: at 20 (a third of the model streams) a spread set again, with its
    // window; at 4 a contiguous stream, an eighth of the budget; at 30 the model fits,
    // an eighth of the budget and no device bound.
    let pass: Vec<u32> = (0..30).collect();
    let (mut prefetch, _) = streaming_policies(&pass, 30, 24);
    assert_eq!(prefetch.max_lookahead_bytes, 8 * block, "the window");
    prefetch.budget_changed(20 * block);
    assert!(prefetch.prediction.stream_plan().streams());
    assert_eq!(
        prefetch.max_lookahead_bytes,
        8 * block,
        "the new set's window"
    );
    prefetch.budget_changed(4 * block);
    assert!(!prefetch.prediction.stream_plan().streams());
    assert_eq!(
        prefetch.max_lookahead_bytes,
        4 * block / 8,
        "an eighth of the budget"
    );
    prefetch.budget_changed(24 * block);
    assert_eq!(prefetch.max_lookahead_bytes, 8 * block);
    prefetch.budget_changed(30 * block);
    assert!(!prefetch.prediction.stream_plan().streams());
    assert_eq!(prefetch.max_lookahead_bytes, 30 * block / 8);
}

#[test]
fn a_budget_change_chooses_the_streamed_set_again() {
    // The model fits at first: nothing streams and eviction is Belady's alone. Shrunk
    // to 24 of 30 blocks, the set `streamed_blocks_are_evicted_before_kept_ones` shows
    // streams, and resident blocks of it go first; grown back, Belady's order again.
    let pass: Vec<u32> = (0..30).collect();
    let victims = |budget_blocks: Option<u64>| {
        let (_, mut eviction) = streaming_policies(&pass, 30, 30);
        assert!(!eviction.prediction.stream_plan().streams());
        for i in 0..10 {
            eviction.inserted(b(i));
        }
        eviction.touched(&fault(9, 0));
        if let Some(blocks) = budget_blocks {
            eviction.budget_changed(blocks * (2 << 20));
        }
        (0..10)
            .map(|_| eviction.victim(b(10), ReadKind::Demand).unwrap().index)
            .collect::<Vec<u32>>()
    };
    let belady = victims(None);
    assert_eq!(belady, [8, 7, 6, 5, 4, 3, 2, 1, 0, 9]);
    assert_eq!(victims(Some(24)), [7, 5, 3, 1, 9, 8, 6, 4, 2, 0]);
    assert_eq!(victims(Some(30)), belady);
}

#[test]
fn unpredicted_blocks_go_first() {
    let (_, mut eviction) = policies(&[0, 1, 2], 10);
    eviction.inserted(b(1));
    eviction.inserted(b(8)); // not in the pass
    eviction.inserted(BlockRef::new(RegionId(4), 0)); // another region
    eviction.touched(&fault(0, 0));
    let first = eviction.victim(b(2), ReadKind::Prefetch);
    let second = eviction.victim(b(2), ReadKind::Prefetch);
    let mut got = vec![first, second];
    got.sort();
    assert_eq!(got, vec![Some(b(8)), Some(BlockRef::new(RegionId(4), 0))]);
    assert_eq!(eviction.victim(b(2), ReadKind::Demand), Some(b(1)));
}

#[test]
fn an_unplaced_block_read_in_every_token_outlasts_one_read_once() {
    // Blocks 8 and 9 lie in no position of the pass, as embedding rows do. Block 8 is
    // read in each of 8 tokens (evicted in between), block 9 once, after it: by arrival
    // (oldest first) block 8 would go; by reads per token, block 9.
    let (_, mut eviction) = policies(&[0, 1, 2], 10);
    let mut time = 0;
    for _ in 0..8 {
        eviction.inserted(b(8));
        for position in 0..3 {
            time += 1;
            eviction.touched(&fault(position, time));
        }
        eviction.removed(b(8));
    }
    eviction.inserted(b(8));
    eviction.inserted(b(9));
    assert_eq!(eviction.victim(b(2), ReadKind::Demand), Some(b(9)));
    assert_eq!(eviction.victim(b(2), ReadKind::Demand), Some(b(8)));
}

#[test]
fn a_resident_unplaced_block_is_watched_and_its_uses_counted() {
    // As above, but block 8 stays resident and the pager watches: its use in each of
    // 8 tokens is a watch fault, counted, so it outlasts block 9 read once after it.
    let pass = [0, 1, 2];
    let layout = BlockGeometry::new(0, 10 * BLOCK, BLOCK).unwrap();
    let graph = Arc::new(ModelGraph::from_pass(layout.clone(), &pass));
    let (_, mut eviction) = graph_policies(graph);
    eviction.region_added(&RegionInfo {
        id: RegionId(0),
        path: Path::new("/model"),
        geometry: layout,
        budget: 5 * BLOCK,
        watch_resident: true,
    });
    let mut time = 0;
    let watch = |eviction: &mut GraphEviction| {
        let mut out = Vec::new();
        eviction.watch(&mut out);
        out
    };
    // Read in the first pass: watched from the next.
    eviction.inserted(b(8));
    for position in 0..3 {
        time += 1;
        eviction.touched(&fault(position, time));
    }
    for _ in 0..8 {
        time += 1;
        eviction.touched(&fault(0, time));
        assert_eq!(watch(&mut eviction), [b(8)], "watched again in each pass");
        eviction.touched(&FaultEvent {
            block: b(8),
            time_ns: time,
            outcome: FaultOutcome::Resident,
            offset_in_block: None,
        });
        assert!(watch(&mut eviction).is_empty(), "once a pass");
        for position in 1..3 {
            time += 1;
            eviction.touched(&fault(position, time));
        }
    }
    eviction.inserted(b(9));
    assert_eq!(eviction.victim(b(2), ReadKind::Demand), Some(b(9)));
    assert_eq!(eviction.victim(b(2), ReadKind::Demand), Some(b(8)));
}

#[test]
fn a_block_used_twice_per_pass_counts_its_nearest_use() {
    // Block 1 is used at positions 0 and 3.
    let (_, mut eviction) = policies(&[1, 2, 3, 1, 4], 5);
    for i in [1, 2, 4] {
        eviction.inserted(b(i));
    }
    eviction.touched(&fault(3, 0)); // position 2
                                    // From position 2: 1 in 1 step, 4 in 2, 2 in 4.
    assert_eq!(eviction.victim(b(0), ReadKind::Demand), Some(b(2)));
    assert_eq!(eviction.victim(b(0), ReadKind::Demand), Some(b(4)));
    assert_eq!(eviction.victim(b(0), ReadKind::Demand), Some(b(1)));
}

#[test]
fn prefetch_walks_the_order_skipping_resident_blocks_with_markers() {
    let pass = [5, 3, 8, 1, 9, 0, 2, 7, 6, 4];
    let (mut prefetch, mut eviction) = policies(&pass, 10);
    prefetch.initial_lookahead_bytes = 4 * BLOCK;
    prefetch.markers_per_window = 2;
    eviction.inserted(b(8));
    let mut out = Vec::new();
    prefetch.plan(&fault(3, 0), &mut out);
    let blocks: Vec<u32> = out.iter().map(|r| r.block.index).collect();
    assert_eq!(blocks, vec![1, 9, 0, 2]);
    // Markers at positions that are multiples of 4 / 2 = 2 (9 sits at 4, 2 at 6), and
    // on the first block after a resident one this policy did not read (8).
    let markers: Vec<u32> = out
        .iter()
        .filter(|r| r.install == Install::OnFault)
        .map(|r| r.block.index)
        .collect();
    assert_eq!(markers, vec![1, 9, 2]);
    // The walk wraps round the cycle into the next pass.
    out.clear();
    prefetch.plan(&fault(6, 1), &mut out);
    let blocks: Vec<u32> = out.iter().map(|r| r.block.index).collect();
    assert_eq!(blocks, vec![4, 5, 3, 1]);
}

#[test]
fn lookahead_follows_progress_and_read_latency() {
    let pass: Vec<u32> = (0..1000).collect();
    let (mut prefetch, _) = policies(&pass, 1000);
    prefetch.initial_lookahead_bytes = 5 * BLOCK;
    let mut out = Vec::new();
    // 10 blocks per millisecond: 40.96 MB/s of progress.
    prefetch.plan(&fault(0, 0), &mut out);
    // Reads take 5 ms: cover 2 x 5 ms of progress = 100 blocks.
    prefetch.read_completed(b(1), BLOCK, 5_000_000);
    out.clear();
    prefetch.plan(&fault(10, 1_000_000), &mut out);
    assert_eq!(prefetch.lookahead_bytes(), 100 * BLOCK);
    assert_eq!(out.len(), 100);
    out.clear();
    prefetch.plan(&fault(20, 2_000_000), &mut out);
    // Blocks requested by the plan at 10 are not asked for again.
    let blocks: Vec<u32> = out.iter().map(|r| r.block.index).collect();
    assert_eq!(blocks, (111..=120).collect::<Vec<_>>());
}

#[test]
fn without_a_matching_region_the_policies_predict_nothing() {
    let (mut prefetch, mut eviction) = policies(&[0, 1, 2], 3);
    let other = BlockRef::new(RegionId(9), 1);
    let mut out = Vec::new();
    prefetch.plan(
        &FaultEvent {
            block: other,
            time_ns: 0,
            outcome: FaultOutcome::Missing,
            offset_in_block: None,
        },
        &mut out,
    );
    assert!(out.is_empty());
    // Unbound blocks are evicted in arrival order.
    eviction.inserted(BlockRef::new(RegionId(9), 2));
    eviction.inserted(other);
    assert_eq!(
        eviction.victim(other, ReadKind::Demand),
        Some(BlockRef::new(RegionId(9), 2))
    );
    // Built without a graph: FIFO.
    let mut empty = GraphEviction::new(GraphPrediction::empty());
    empty.inserted(b(2));
    empty.inserted(b(1));
    assert_eq!(empty.victim(b(0), ReadKind::Demand), Some(b(2)));
}

#[test]
fn a_fault_a_little_behind_the_last_is_no_progress_not_a_pass() {
    let order = CyclicOrder::from_sequence(0..1000, 1000);
    assert_eq!(progress_steps(&order, 500, 510), 10);
    // Another thread of the same tensor, a few blocks behind.
    assert_eq!(progress_steps(&order, 510, 505), 0);
    // The next pass starts: a genuine wrap forward.
    assert_eq!(progress_steps(&order, 990, 5), 15);
    // Far behind is taken as far ahead (most of a pass), as before.
    assert_eq!(progress_steps(&order, 800, 100), 300);
}

/// A model in two files of 8 blocks each (one tensor each, run in file order), and the
/// policies bound to region 0 for the first file and region 1 for the second; region 2
/// has the second file's geometry under another name.
fn split_policies() -> (GraphPrefetch, GraphEviction) {
    use crate::graph::PartTensors;
    let tensor = |name: &str| TensorInfo {
        name: name.to_string(),
        dtype: "F32".to_string(),
        shape: vec![8 * BLOCK / 4],
        file_range: 0..8 * BLOCK,
    };
    let (first, second) = (
        [tensor("blk.0.ffn_down.weight")],
        [tensor("blk.1.ffn_down.weight")],
    );
    let parts = [
        PartTensors {
            path: Path::new("/m-00001-of-00002.gguf"),
            file_len: 8 * BLOCK,
            tensors: &first,
        },
        PartTensors {
            path: Path::new("/m-00002-of-00002.gguf"),
            file_len: 8 * BLOCK,
            tensors: &second,
        },
    ];
    let graph = Arc::new(ModelGraph::from_parts(&parts, BLOCK).unwrap());
    let (mut prefetch, mut eviction) = graph_policies(graph);
    for (id, path) in [
        (0, "/m-00001-of-00002.gguf"),
        (1, "/m-00002-of-00002.gguf"),
        (2, "/other.gguf"),
    ] {
        let info = RegionInfo {
            id: RegionId(id),
            path: Path::new(path),
            geometry: BlockGeometry::new(0, 8 * BLOCK, BLOCK).unwrap(),
            budget: u64::MAX,
            watch_resident: false,
        };
        prefetch.region_added(&info);
        eviction.region_added(&info);
    }
    (prefetch, eviction)
}

#[test]
fn a_split_model_is_followed_across_its_files() {
    let (mut prefetch, mut eviction) = split_policies();
    // Near the end of the first file the plan reaches into the second, in its region's
    // own block numbers.
    let mut out = Vec::new();
    prefetch.plan(&fault(6, 1_000), &mut out);
    let requested: Vec<BlockRef> = out.iter().map(|request| request.block).collect();
    assert!(
        requested.contains(&BlockRef::new(RegionId(1), 0)),
        "{requested:?}"
    );
    assert!(
        requested
            .iter()
            .all(|block| block.region != RegionId(2) && block.index < 8),
        "{requested:?}"
    );
    // With the program at the first file's start, the second file's last block is the
    // one used furthest ahead; the look-alike region's blocks are not the model's and
    // go first.
    let (_, mut eviction_only) = split_policies();
    for index in 0..4 {
        eviction_only.inserted(BlockRef::new(RegionId(1), index));
    }
    eviction_only.touched(&fault(0, 0));
    assert_eq!(
        eviction_only.victim(b(1), ReadKind::Demand),
        Some(BlockRef::new(RegionId(1), 3))
    );
    eviction.inserted(BlockRef::new(RegionId(1), 0));
    eviction.inserted(BlockRef::new(RegionId(2), 0));
    assert_eq!(
        eviction.victim(b(1), ReadKind::Demand),
        Some(BlockRef::new(RegionId(2), 0))
    );
}

#[test]
fn a_model_mapped_twice_is_read_into_the_mapping_that_faulted() {
    let pass: Vec<u32> = (0..16).collect();
    let (mut prefetch, _) = policies(&pass, 16);
    let second = RegionInfo {
        id: RegionId(1),
        path: Path::new("/model"),
        geometry: BlockGeometry::new(0, 16 * BLOCK, BLOCK).unwrap(),
        budget: u64::MAX,
        watch_resident: false,
    };
    prefetch.region_added(&second);
    let mut out = Vec::new();
    let in_second = FaultEvent {
        block: BlockRef::new(RegionId(1), 2),
        ..fault(2, 1_000)
    };
    prefetch.plan(&in_second, &mut out);
    assert!(!out.is_empty());
    assert!(
        out.iter()
            .all(|request| request.block.region == RegionId(1)),
        "{out:?}"
    );
}

/// The tensor table of a coarse mixture of experts as a GGUF converter lays it out (the
/// simulator's coarse shape, src/cli/sim/moe.rs): 8 layers of 16
/// experts (2 used), Q8_0 merged expert tensors with the expert index outermost, layers
/// sorted as strings and their tensors alphabetically; 32-byte aligned after a header.
fn coarse_moe_tensors() -> Vec<TensorInfo> {
    const LAYERS: u32 = 8;
    let (embd, ff, experts, vocab) = (1024u64, 2816u64, 16u64, 32_000u64);
    let q8_0 = |rows: u64, columns: u64| rows * columns.div_ceil(32) * 34;
    let layer_tensor = |name: &str| -> (&'static str, Vec<u64>, u64) {
        match name {
            "attn_q" | "attn_output" => ("Q8_0", vec![embd, embd], q8_0(embd, embd)),
            "attn_k" | "attn_v" => ("Q8_0", vec![embd / 4, embd], q8_0(embd / 4, embd)),
            "ffn_gate_inp" => ("F32", vec![experts, embd], experts * embd * 4),
            "ffn_gate_exps" | "ffn_up_exps" => {
                ("Q8_0", vec![experts, ff, embd], experts * q8_0(ff, embd))
            }
            "ffn_down_exps" => ("Q8_0", vec![experts, embd, ff], experts * q8_0(embd, ff)),
            _ => ("F32", vec![embd], embd * 4),
        }
    };
    let mut entries = vec![(
        "token_embd.weight".to_string(),
        ("Q8_0", vec![vocab, embd], q8_0(vocab, embd)),
    )];
    let mut layers: Vec<String> = (0..LAYERS).map(|l| l.to_string()).collect();
    layers.sort();
    let mut per_layer = [
        "attn_norm",
        "attn_q",
        "attn_k",
        "attn_v",
        "attn_output",
        "ffn_norm",
        "ffn_gate_inp",
        "ffn_gate_exps",
        "ffn_up_exps",
        "ffn_down_exps",
    ];
    per_layer.sort();
    for layer in &layers {
        for tensor in per_layer {
            entries.push((format!("blk.{layer}.{tensor}.weight"), layer_tensor(tensor)));
        }
    }
    entries.push(("output_norm.weight".into(), ("F32", vec![embd], embd * 4)));
    entries.push((
        "output.weight".into(),
        ("Q8_0", vec![vocab, embd], q8_0(vocab, embd)),
    ));
    let mut at = 1_700_000u64;
    entries
        .into_iter()
        .map(|(name, (dtype, shape, bytes))| {
            let start = at.next_multiple_of(32);
            at = start + bytes;
            TensorInfo {
                name,
                dtype: dtype.into(),
                shape,
                file_range: start..start + bytes,
            }
        })
        .collect()
}

/// A mixture of experts (`coarse_moe_tensors`) in 1 MiB blocks, bound to region 0 under
/// half its size; watching honoured if `watch`.
fn moe_policies(watch: bool) -> (Arc<ModelGraph>, GraphPrefetch, GraphEviction) {
    let tensors = coarse_moe_tensors();
    let file_len = tensors.iter().map(|t| t.file_range.end).max().unwrap();
    let layout = BlockGeometry::new(0, file_len, 1 << 20).unwrap();
    let graph =
        Arc::new(ModelGraph::from_tensors(&tensors, layout.clone()).with_experts_used(Some(2)));
    let (mut prefetch, mut eviction) = graph_policies(Arc::clone(&graph));
    let info = RegionInfo {
        id: RegionId(0),
        path: Path::new("/model"),
        geometry: layout.clone(),
        budget: layout.data_len / 2,
        watch_resident: watch,
    };
    prefetch.region_added(&info);
    eviction.region_added(&info);
    (graph, prefetch, eviction)
}

/// The group of `expert` in `layer`.
fn group_of(graph: &ModelGraph, layer: u32, expert: u32) -> u32 {
    let groups = graph.experts().groups();
    groups
        .iter()
        .position(|g| g.layer == layer && g.expert == expert)
        .unwrap() as u32
}

/// A fault at the first byte of `group`'s first slice.
fn expert_fault(graph: &ModelGraph, group: u32, outcome: FaultOutcome) -> FaultEvent {
    let at = graph.experts().group(group).bytes[0].start;
    let block = graph.geometry().block_size;
    FaultEvent {
        block: b((at / block) as u32),
        time_ns: 0,
        outcome,
        offset_in_block: Some((at % block) as u32),
    }
}

/// A fault at `block`, an expert's block the policy asked to watch.
fn watch_fault(block: BlockRef) -> FaultEvent {
    FaultEvent {
        block,
        time_ns: 0,
        outcome: FaultOutcome::Resident,
        offset_in_block: None,
    }
}

fn distinct_blocks(graph: &ModelGraph, group: u32) -> Vec<u32> {
    let mut blocks: Vec<u32> = graph.experts().group(group).blocks().collect();
    blocks.sort_unstable();
    blocks.dedup();
    blocks
}

fn watched(eviction: &mut GraphEviction) -> Vec<BlockRef> {
    let mut out = Vec::new();
    eviction.watch(&mut out);
    out
}

#[test]
fn a_resident_expert_is_watched_once_the_program_has_left_its_layer() {
    let (graph, _, mut eviction) = moe_policies(true);
    let (a, later) = (group_of(&graph, 0, 0), group_of(&graph, 1, 3));
    // Expert a of layer 0 faults and is read whole.
    eviction.touched(&expert_fault(&graph, a, FaultOutcome::Missing));
    for block in distinct_blocks(&graph, a) {
        eviction.inserted(b(block));
    }
    assert!(watched(&mut eviction).is_empty(), "still in layer 0");
    // The program reaches layer 1: a is watched, through one block that is its own.
    eviction.touched(&expert_fault(&graph, later, FaultOutcome::Missing));
    let first = watched(&mut eviction);
    assert_eq!(first.len(), 1, "{first:?}");
    assert_eq!(graph.experts().groups_of(first[0].index), [a]);
    assert!(watched(&mut eviction).is_empty(), "watched once");
    // Next token: a's use faults on its watched block; it is watched again only once
    // the program has left layer 0 again.
    eviction.touched(&watch_fault(first[0]));
    assert!(watched(&mut eviction).is_empty());
    eviction.touched(&expert_fault(&graph, later, FaultOutcome::Missing));
    assert_eq!(watched(&mut eviction), first);
    // Counted for the stats: two watches asked, one fired.
    let counts = eviction.prediction.expert_watches();
    assert_eq!(
        counts,
        Some(ExpertWatches {
            asked: 2,
            faults: 1
        })
    );

    // A pager that cannot watch is never asked to.
    let (graph, _, mut eviction) = moe_policies(false);
    eviction.touched(&expert_fault(&graph, a, FaultOutcome::Missing));
    for block in distinct_blocks(&graph, a) {
        eviction.inserted(b(block));
    }
    eviction.touched(&expert_fault(&graph, later, FaultOutcome::Missing));
    assert!(watched(&mut eviction).is_empty());
}

#[test]
fn a_watched_expert_left_unused_goes_before_one_used_every_token() {
    let (graph, _, mut eviction) = moe_policies(true);
    let (used, unused) = (group_of(&graph, 0, 0), group_of(&graph, 0, 8));
    let (other, elsewhere) = (group_of(&graph, 0, 15), group_of(&graph, 1, 3));
    // Both read in the first token, as the router chose them.
    for group in [used, unused] {
        eviction.touched(&expert_fault(&graph, group, FaultOutcome::Missing));
        for block in distinct_blocks(&graph, group) {
            eviction.inserted(b(block));
        }
    }
    eviction.touched(&expert_fault(&graph, elsewhere, FaultOutcome::Missing));
    let mut sentinels = watched(&mut eviction);
    assert_eq!(sentinels.len(), 2);
    // 40 tokens: layer 0 runs `used` (resident: its watched block faults) and `other`
    // (never resident), layer 1 runs `elsewhere`.
    for _ in 0..40 {
        let sentinel = *sentinels
            .iter()
            .find(|s| graph.experts().groups_of(s.index) == [used])
            .unwrap();
        eviction.touched(&watch_fault(sentinel));
        eviction.touched(&expert_fault(&graph, other, FaultOutcome::Missing));
        eviction.touched(&expert_fault(&graph, elsewhere, FaultOutcome::Missing));
        sentinels.retain(|&s| s != sentinel);
        sentinels.extend(watched(&mut eviction));
    }
    let incoming = b(distinct_blocks(&graph, other)[0]);
    for _ in distinct_blocks(&graph, unused) {
        let victim = eviction.victim(incoming, ReadKind::Demand).unwrap();
        assert!(
            graph.experts().groups_of(victim.index).contains(&unused)
                && !graph.experts().groups_of(victim.index).contains(&used),
            "evicted {victim:?} of {:?} before the unused expert",
            graph.experts().groups_of(victim.index)
        );
    }
}

#[test]
fn a_demand_read_may_displace_an_expert_in_use_when_nothing_else_is_held() {
    // A budget smaller than the experts of one layer: everything held is an expert the
    // program is reading now. A demand read must still get room (no read in flight
    // would free any); a speculative one never takes it.
    let (graph, _, mut eviction) = moe_policies(false);
    let (a, next) = (group_of(&graph, 0, 0), group_of(&graph, 0, 1));
    eviction.touched(&expert_fault(&graph, a, FaultOutcome::Missing));
    // Blocks of one expert alone: one it shares with a neighbour expert is not in use,
    // one it shares with a dense tensor is ranked by the order.
    let own = |group: u32| -> Vec<u32> {
        distinct_blocks(&graph, group)
            .into_iter()
            .filter(|&block| {
                graph.experts().groups_of(block) == [group] && !graph.order().contains(block)
            })
            .collect()
    };
    let held = own(a);
    assert!(!held.is_empty());
    for &block in &held {
        eviction.inserted(b(block));
    }
    eviction.touched(&expert_fault(&graph, next, FaultOutcome::Missing));
    let incoming = b(own(next)[0]);
    assert_eq!(eviction.victim(incoming, ReadKind::Prefetch), None);
    let victim = eviction
        .victim(incoming, ReadKind::Demand)
        .expect("room for a demand read");
    assert!(held.contains(&victim.index), "{victim:?} was not held");
}

/// Hears of a fault as the service does (eviction first, then prefetch) and returns how
/// many blocks the plan asked for.
fn heard(prefetch: &mut GraphPrefetch, eviction: &mut GraphEviction, event: &FaultEvent) -> usize {
    eviction.touched(event);
    let mut out = Vec::new();
    prefetch.plan(event, &mut out);
    out.len()
}

#[test]
fn prefetch_stops_where_the_program_leaves_the_order_and_resumes_when_it_returns() {
    let pass: Vec<u32> = (0..256).collect();
    // 2 MiB blocks under a quarter of the order: plans read a few blocks ahead.
    let block = 2 << 20;
    let (mut prefetch, mut eviction) = bound_policies(&pass, 256, block, 0, 64 * block);
    let mut time = 0;
    let mut next_fault = |index: u32| {
        time += 1_000_000;
        fault(index, time)
    };
    // In order: every plan reads ahead, and nothing is a surprise.
    for index in 0..64 {
        let event = next_fault(index);
        assert!(
            heard(&mut prefetch, &mut eviction, &event) > 0,
            "at {index}"
        );
    }
    assert_eq!(prefetch.confidence().unwrap().surprise_faults, 0);
    // Jumping about the order: within a few faults, plans landing in parts the program
    // never followed read nothing. (The parts it followed, 0..64, keep their own
    // scores: each needs a few surprises of its own.)
    let mut state = 7u32;
    let mut asked = Vec::new();
    for _ in 0..64 {
        state = state.wrapping_mul(1_103_515_245).wrapping_add(12_345);
        let at = (state >> 8) % 256;
        let event = next_fault(at);
        asked.push((at, heard(&mut prefetch, &mut eviction, &event)));
    }
    let late_unfollowed = asked[16..].iter().filter(|&&(at, _)| at >= 64);
    assert!(late_unfollowed.clone().count() > 20, "{asked:?}");
    assert!(late_unfollowed.clone().all(|&(_, n)| n == 0), "{asked:?}");
    let confidence = prefetch.confidence().unwrap();
    // At least every part the program never followed (8..32 of 32).
    assert!(confidence.failing_parts >= 24, "{confidence:?}");
    // Following the order again, from where it left off: each part is trusted again
    // once it has been followed a few times (a pass, reading on demand), and then
    // reading ahead resumes everywhere.
    let start = (state >> 8) % 256;
    let resumed = (1..=512)
        .map(|step| {
            let event = next_fault((start + step) % 256);
            heard(&mut prefetch, &mut eviction, &event)
        })
        .collect::<Vec<_>>();
    assert!(resumed[256..].iter().all(|&n| n > 0), "{resumed:?}");
    assert_eq!(prefetch.confidence().unwrap().failing_parts, 0);
}

/// The blocks a plan asks to read into free budget while the device idles, in order.
fn idle_fill_asked(prefetch: &mut GraphPrefetch, event: &FaultEvent) -> Vec<u32> {
    let mut out = Vec::new();
    prefetch.plan(event, &mut out);
    out.iter()
        .filter(|request| request.urgency == Urgency::IdleFill)
        .map(|request| request.block.index)
        .collect()
}

#[test]
fn idle_fill_asks_for_the_most_used_experts_that_are_not_resident() {
    let (graph, mut prefetch, mut eviction) = moe_policies(false);
    let uses = |layer, expert| match (layer, expert) {
        (3, 5) => 90.0,
        (7, 1) => 60.0,
        _ => 1.0,
    };
    let counts = ExpertCounts {
        experts: (graph.experts().groups().iter())
            .map(|g| ExpertCount {
                layer: g.layer,
                expert: g.expert,
                uses: uses(g.layer, g.expert),
                tokens: 100.0,
                paired_tokens: 0.0,
            })
            .collect(),
        pairs: Vec::new(),
    };
    prefetch.prediction.seed_expert_counts(&counts);
    let (first, second) = (group_of(&graph, 3, 5), group_of(&graph, 7, 1));
    // The most used expert is resident already: the next one is asked for first.
    for block in distinct_blocks(&graph, first) {
        eviction.inserted(b(block));
    }
    let event = expert_fault(&graph, group_of(&graph, 0, 0), FaultOutcome::Missing);
    eviction.touched(&event);
    let asked = idle_fill_asked(&mut prefetch, &event);
    let wanted = distinct_blocks(&graph, second);
    let mut first_asked = asked[..wanted.len()].to_vec();
    first_asked.sort_unstable();
    assert_eq!(first_asked, wanted, "{asked:?}");
    assert!(
        !asked
            .iter()
            .any(|block| distinct_blocks(&graph, first).contains(block)),
        "a resident expert is not asked for: {asked:?}"
    );
    // Asked for once a token: the next fault of the same token asks for others.
    let again = idle_fill_asked(&mut prefetch, &event);
    assert!(
        !again.iter().any(|block| wanted.contains(block)),
        "{again:?}"
    );
}

#[test]
fn a_dense_model_asks_for_no_idle_fill() {
    let (mut prefetch, _) = policies(&[0, 1, 2, 3], 8);
    assert!(idle_fill_asked(&mut prefetch, &fault(0, 0)).is_empty());
}

#[test]
fn idle_fill_stops_once_the_budget_has_filled_until_it_is_set_again() {
    let (graph, mut prefetch, mut eviction) = moe_policies(false);
    let counts = ExpertCounts {
        experts: (graph.experts().groups().iter())
            .map(|g| ExpertCount {
                layer: g.layer,
                expert: g.expert,
                uses: if g.expert == 1 { 80.0 } else { 5.0 },
                tokens: 100.0,
                paired_tokens: 0.0,
            })
            .collect(),
        pairs: Vec::new(),
    };
    prefetch.prediction.seed_expert_counts(&counts);
    // A token's experts: the first layer's, then the seventh's.
    let token = |eviction: &mut GraphEviction, prefetch: &mut GraphPrefetch| {
        let mut asked = Vec::new();
        for layer in [0, 7] {
            let event = expert_fault(&graph, group_of(&graph, layer, 0), FaultOutcome::Missing);
            eviction.touched(&event);
            asked.extend(idle_fill_asked(prefetch, &event));
        }
        asked
    };
    assert!(!token(&mut eviction, &mut prefetch).is_empty());
    // The budget evicts: no fill from then on.
    let resident = distinct_blocks(&graph, group_of(&graph, 3, 2));
    for &block in &resident {
        eviction.inserted(b(block));
    }
    let incoming = b(distinct_blocks(&graph, group_of(&graph, 5, 3))[0]);
    assert!(eviction.victim(incoming, ReadKind::Demand).is_some());
    // The rest of this token, and the next one.
    let event = expert_fault(&graph, group_of(&graph, 7, 0), FaultOutcome::Missing);
    eviction.touched(&event);
    assert!(idle_fill_asked(&mut prefetch, &event).is_empty());
    for _ in 0..4 {
        // Tokens without an eviction: the room left is still the program's.
        let asked = token(&mut eviction, &mut prefetch);
        assert!(asked.is_empty(), "asked once the budget filled: {asked:?}");
    }
    // A budget set again (grown) has room to fill.
    eviction.budget_changed(1 << 40);
    prefetch.budget_changed(1 << 40);
    assert!(!token(&mut eviction, &mut prefetch).is_empty());
}
