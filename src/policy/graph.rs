//! Graph-driven prefetch and eviction: both follow the model graph's predicted cyclic
//! order of blocks (one token's pass, repeated every token).
//!
//! `GraphPrefetch` walks the order from each fault and keeps enough bytes ahead of the
//! program in flight to cover the time until they are used. `GraphEviction` applies
//! Belady's rule to the prediction: the resident block whose next use is furthest along
//! the order goes first. For a cyclic scan larger than the budget this keeps a fixed part
//! of the model resident and streams the rest through a small window, which is the
//! optimum (M - B bytes read per token).
//!
//! Which part streams matters for speed, not only how much: when the budget holds at
//! least two thirds of the model, the streamed blocks are chosen up front, spread evenly along
//! the order ([`streaming`]), eviction takes them before kept ones, and prefetch reads
//! them a few at a time just ahead of the program, so the device reads while the
//! program computes through the kept blocks between them.
//!
//! The two share a [`GraphPrediction`]: the graph, the current position in the order
//! (advanced by every fault either policy hears of), and which blocks are resident
//! (kept by the eviction side, so the prefetch side counts only bytes still to read).
//! Either works alone: eviction advances the position from `touched`.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};

use self::expert_blocks::ExpertBlocks;
use self::expert_use::ExpertUse;
use self::streaming::{plan_streaming, StreamPlan};
use super::per_block::PerBlock;
use super::position_set::PositionSet;
use super::{
    BlockRef, EvictionPolicy, FaultEvent, PrefetchPolicy, PrefetchRequest, ReadKind, RegionId,
    RegionInfo,
};
use crate::geometry::BlockGeometry;
use crate::graph::expert_store::{ExpertCount, ExpertCounts};
use crate::graph::{CyclicOrder, ModelGraph};

mod expert_blocks;
mod expert_use;
pub mod streaming;

/// The prediction both graph policies follow, and the progress along it.
pub struct GraphPrediction {
    graph: Arc<ModelGraph>,
    progress: Mutex<Progress>,
}

struct Progress {
    /// Regions presenting the graph's model with the graph's block geometry, each with
    /// the part (file) it presents: its index in `ModelGraph::parts`.
    regions: Vec<(RegionId, usize)>,
    /// Position in the order of the latest fault.
    cursor: u32,
    /// Per block of the graph (the graph's numbering, across parts): resident and
    /// evictable, as the eviction side knows it.
    resident: Vec<bool>,
    /// The farthest a fault has landed a little behind the cursor (`lag_behind`): how
    /// far threads sharing a step lag behind the one ahead, as observed.
    lag_seen: u32,
    /// Which blocks stream each pass when the model does not fit the budget.
    stream: StreamPlan,
    /// How often a token uses each routed expert (nothing for a dense model).
    experts: ExpertUse,
}

impl GraphPrediction {
    pub fn new(graph: Arc<ModelGraph>) -> Arc<Self> {
        let blocks = graph.geometry().block_count() as usize;
        Arc::new(Self {
            progress: Mutex::new(Progress {
                regions: Vec::new(),
                cursor: 0,
                resident: vec![false; blocks],
                lag_seen: 0,
                stream: StreamPlan::default(),
                experts: ExpertUse::new(graph.experts(), |block| is_routed_expert(&graph, block)),
            }),
            graph,
        })
    }

    /// A prediction of nothing: the graph policies built without a graph.
    pub fn empty() -> Arc<Self> {
        // A zero-length layout is always valid.
        let layout = BlockGeometry {
            file_offset: 0,
            data_len: 0,
            block_size: 1,
        };
        Self::new(Arc::new(ModelGraph::from_tensors(&[], layout)))
    }

    pub fn graph(&self) -> &Arc<ModelGraph> {
        &self.graph
    }

    /// The current position in the predicted order.
    pub fn cursor(&self) -> u32 {
        self.lock().cursor
    }

    fn lock(&self) -> MutexGuard<'_, Progress> {
        // A policy that panicked mid-update leaves plain data behind: keep using it.
        self.progress.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Binds a region that presents one of the graph's parts: same file range and block
    /// size, and the part's file when the graph has several.
    fn region_added(&self, info: &RegionInfo<'_>) {
        let part = self.graph.parts().iter().position(|part| {
            info.geometry == part.geometry
                && info.geometry.data_len > 0
                && part
                    .path
                    .as_deref()
                    .is_none_or(|path| same_file(path, info.path))
        });
        let mut progress = self.lock();
        if let Some(part) = part {
            if !progress.bound(info.id) {
                progress.regions.push((info.id, part));
                progress.stream = plan_streaming(
                    self.graph.order(),
                    &*self.graph,
                    info.budget,
                    self.graph.lag_guard(),
                );
            }
        }
    }

    /// What was learned of how often each expert runs, for the next run of the model
    /// (`graph::expert_store`); `None` for a model without routed experts.
    pub fn expert_counts(&self) -> Option<ExpertCounts> {
        let experts = self.graph.experts();
        if experts.is_empty() {
            return None;
        }
        let progress = self.lock();
        let counts = progress
            .experts
            .counts()
            .filter(|&(_, _, tokens)| tokens > 0.0);
        Some(ExpertCounts {
            experts: counts
                .map(|(group, uses, tokens)| {
                    let group = experts.group(group);
                    ExpertCount {
                        layer: group.layer,
                        expert: group.expert,
                        uses: uses.min(tokens),
                        tokens,
                    }
                })
                .collect(),
        })
    }

    /// Tokens the expert counts have followed in this run (0 for a dense model).
    pub fn expert_tokens(&self) -> u64 {
        self.lock().experts.tokens()
    }

    /// Starts the expert use estimates from an earlier run's counts; returns how many of
    /// the model's experts they matched.
    pub fn seed_expert_counts(&self, counts: &ExpertCounts) -> usize {
        let groups: HashMap<(u32, u32), u32> = (self.graph.experts().groups().iter())
            .enumerate()
            .map(|(id, group)| ((group.layer, group.expert), id as u32))
            .collect();
        let mut progress = self.lock();
        let mut matched = 0;
        for count in &counts.experts {
            if let Some(&group) = groups.get(&(count.layer, count.expert)) {
                progress.experts.seed(group, count.uses, count.tokens);
                matched += 1;
            }
        }
        matched
    }

    /// The streamed set chosen for the bound model (empty until a region binds).
    pub fn stream_plan(&self) -> StreamPlan {
        self.lock().stream.clone()
    }

    fn region_removed(&self, region: RegionId) {
        self.lock().regions.retain(|&(r, _)| r != region);
    }
}

/// The block of one of `regions` that presents the graph's block `global`: of region
/// `preferred` if it presents that part, else of the first that does.
fn local_in(
    regions: &[(RegionId, usize)],
    graph: &ModelGraph,
    global: u32,
    preferred: Option<RegionId>,
) -> Option<BlockRef> {
    let part = graph.part_of(global)?;
    let presents = |&&(r, p): &&(RegionId, usize)| p == part && Some(r) == preferred;
    let &(region, _) =
        (regions.iter().find(presents)).or_else(|| regions.iter().find(|&&(_, p)| p == part))?;
    Some(BlockRef::new(
        region,
        global - graph.parts()[part].first_block,
    ))
}

/// Whether two paths name the same file (the shim names a file as the kernel resolves
/// its descriptor, a split model's parts are named from the first).
fn same_file(a: &std::path::Path, b: &std::path::Path) -> bool {
    a == b
        || matches!(
            (std::fs::canonicalize(a), std::fs::canonicalize(b)),
            (Ok(a), Ok(b)) if a == b
        )
}

impl Progress {
    fn bound(&self, region: RegionId) -> bool {
        self.regions.iter().any(|&(r, _)| r == region)
    }

    /// The graph's number for `block` of a bound region.
    fn global(&self, graph: &ModelGraph, block: BlockRef) -> Option<u32> {
        let &(_, part) = self.regions.iter().find(|&&(r, _)| r == block.region)?;
        let global = graph.parts()[part].first_block.checked_add(block.index)?;
        (graph.part_of(global) == Some(part)).then_some(global)
    }

    /// The block of a bound region that presents the graph's block `global`: of region
    /// `preferred` if it presents that part (a file mapped twice is read into the
    /// mapping the program is using), else of the first that does; `None` when none.
    fn local(&self, graph: &ModelGraph, global: u32, preferred: RegionId) -> Option<BlockRef> {
        local_in(&self.regions, graph, global, Some(preferred))
    }

    /// Moves the cursor to the fault's block (see `locate`) and returns the new
    /// position; `None` when the block is not predicted. A fault in a routed expert
    /// counts the expert as used (`ExpertUse`) and puts the program where its layer's
    /// experts run.
    fn advance(&mut self, graph: &ModelGraph, fault: &FaultEvent) -> Option<u32> {
        let global = self.global(graph, fault.block)?;
        let order = graph.order();
        if let Some(groups) = self.experts_in_use(graph, global, fault.offset_in_block) {
            for &group in &groups {
                self.experts.used(group);
            }
            let anchor = graph.experts().group(*groups.first()?).anchor;
            let anchor_block = *order.sequence().get(anchor as usize)?;
            // A lagging thread's expert fault says nothing of the lag within a step.
            let (position, _) = locate(order, self.cursor, anchor_block)?;
            self.cursor = position;
            return Some(position);
        }
        let (position, lag) = locate(order, self.cursor, global)?;
        if let Some(behind) = lag {
            self.lag_seen = self.lag_seen.max(behind);
        }
        self.cursor = position;
        Some(position)
    }

    /// For a block of routed experts (outside the order), the experts a fault at
    /// `offset` in it shows in use; `None` for any other block.
    fn experts_in_use(
        &self,
        graph: &ModelGraph,
        global: u32,
        offset: Option<u32>,
    ) -> Option<Vec<u32>> {
        if !is_routed_expert(graph, global) {
            return None;
        }
        let groups = graph
            .experts()
            .groups_in_use(global, offset, graph.geometry().block_size);
        (!groups.is_empty()).then_some(groups)
    }

    /// The chance a token reads the routed-expert block `global`, and where in the pass
    /// its layer's experts run.
    fn expert_block_use(&self, graph: &ModelGraph, global: u32) -> (f64, u32) {
        let experts = graph.experts();
        let groups = experts.groups_of(global);
        let probability = self.experts.block_probability(groups);
        let anchor = groups
            .iter()
            .map(|&group| experts.group(group).anchor)
            .min_by_key(|&anchor| graph.order().distance(self.cursor, anchor))
            .unwrap_or(0);
        (probability, anchor)
    }

    /// How many positions ahead the routed-expert block `global` is expected to be
    /// used next: to its layer, then `1/p - 1` passes more (`p` its use per token), as
    /// the expected wait of a block used with probability `p` each pass.
    fn expected_next_use(&self, graph: &ModelGraph, global: u32) -> f64 {
        let groups = graph.experts().groups_of(global);
        if groups.iter().any(|&group| self.experts.reading_now(group)) {
            return 0.0;
        }
        let (probability, anchor) = self.expert_block_use(graph, global);
        let order = graph.order();
        let to_layer = if order.is_empty() {
            0.0
        } else {
            order.distance(
                self.cursor.min(order.len() - 1),
                anchor.min(order.len() - 1),
            ) as f64
        };
        if probability <= 0.0 {
            return f64::INFINITY;
        }
        to_layer + order.len().max(1) as f64 * (1.0 / probability - 1.0)
    }

    /// Positions behind the cursor that a lagging thread may still be reading: back to
    /// the start of the cursor's step when the graph knows the model's steps
    /// (`ModelGraph::lag_guard_at`), and at least the lag observed.
    fn lag_guard(&self, graph: &ModelGraph) -> u32 {
        graph.lag_guard_at(self.cursor).max(self.lag_seen)
    }
}

/// Prefetch along the predicted order.
pub struct GraphPrefetch {
    prediction: Arc<GraphPrediction>,
    /// Lookahead before the consumption rate and read latency are known.
    pub initial_lookahead_bytes: u64,
    pub min_lookahead_bytes: u64,
    pub max_lookahead_bytes: u64,
    /// Markers per lookahead window: the program reports back this often.
    pub markers_per_window: u64,
    /// The previous fault: position and time.
    last: Option<(u32, u64)>,
    /// Program progress along the order, bytes per second (moving average).
    consume_bytes_per_s: Option<f64>,
    /// Time from submitting a read to its completion, ns (moving average).
    read_ns: Option<f64>,
    /// Positions the program has advanced since the first fault, unwrapped.
    progress_steps: u64,
    /// Per block: the position (unwrapped, as `progress_steps`) it was last requested
    /// for. A resident block whose target is still ahead was read for this pass.
    target: Vec<u64>,
    /// The device depth asked for (`PrefetchPolicy::device_bytes`): shallow while a
    /// spread set streams.
    device_bytes: Option<u64>,
}

/// Most lookahead while a contiguous stretch streams (below two thirds of the model).
/// Read ahead and not yet used, a block holds budget the kept part would otherwise have,
/// so each byte beyond what keeps the device busy is read again every pass. 3 GiB llama,
/// llama-bench tg16, five alternating pairs at half its size: a cap of 128 MiB (a twelfth
/// of the budget) read 2 % less than 192 MiB (an eighth) in whole runs, with demand reads
/// 1-16 instead of 88-158 per run, at the same speed (1.88-1.95 tok/s against
/// 1.90-1.94); 96 MiB (a sixteenth) decoded at 1.82-1.91. At a quarter (tg8), where an
/// eighth is 96 MiB, a twelfth (64 MiB) decoded 7 % slower.
pub const STREAM_LOOKAHEAD_MAX: u64 = 128 << 20;

/// Weight of the newest sample in the moving averages.
const EWMA: f64 = 0.25;
/// Lookahead covers this many read latencies of progress: one for the read itself, one
/// for the queue it waits in.
const LATENCY_COVER: f64 = 2.0;

fn ewma(average: Option<f64>, sample: f64) -> Option<f64> {
    Some(average.map_or(sample, |a| a + EWMA * (sample - a)))
}

impl GraphPrefetch {
    pub fn new(prediction: Arc<GraphPrediction>) -> Self {
        Self {
            initial_lookahead_bytes: 4 << 20,
            min_lookahead_bytes: 256 << 10,
            max_lookahead_bytes: 512 << 20,
            markers_per_window: 4,
            last: None,
            consume_bytes_per_s: None,
            read_ns: None,
            progress_steps: 0,
            target: vec![0; prediction.graph.geometry().block_count() as usize],
            device_bytes: None,
            prediction,
        }
    }

    /// Bytes to keep in flight ahead of the program: what it consumes while a read
    /// completes, with room for queueing.
    pub fn lookahead_bytes(&self) -> u64 {
        match (self.consume_bytes_per_s, self.read_ns) {
            (Some(rate), Some(read_ns)) => {
                let bytes = rate * read_ns * 1e-9 * LATENCY_COVER;
                (bytes as u64).clamp(self.min_lookahead_bytes, self.max_lookahead_bytes)
            }
            _ => self.initial_lookahead_bytes,
        }
    }
}

impl PrefetchPolicy for GraphPrefetch {
    fn name(&self) -> &'static str {
        "graph"
    }

    fn region_added(&mut self, info: &RegionInfo<'_>) {
        self.prediction.region_added(info);
        // With a spread streamed set (see `streaming`), the window is the room the plan
        // keeps for it. Otherwise (the model fits, or Belady's contiguous stream):
        // bytes in flight hold budget that the resident part of the model no longer
        // has: every byte of lookahead beyond what hides the read latency is read again
        // each token. Measured read latency grows with the queue the lookahead itself
        // fills, so the estimate is also capped at a fraction of the budget.
        // Nor is it worth more than a part of what has to stream each pass: at a budget
        // close to the model, a lookahead of budget/8 would be larger than the stream.
        // An eighth: with zero copy (no copying CPU left to hide) a quarter read 1.15x
        // M - B per token at 75 and 90 % of a 3 GiB model and an eighth 1.05-1.09x, at
        // the same speed (3.13-3.22 against 3.14-3.17 tok/s at 75 %, 5.47-5.54 against
        // 5.18-5.56 at 90 %); a sixteenth read 1.04x but decoded 6-7 % slower.
        // And never more than `STREAM_LOOKAHEAD_MAX`: what keeps the device busy does not
        // grow with the model or the budget. (When the model fits, nothing streams after
        // the first pass, which still reads the whole model: no such cap then.)
        let plan_window = self.prediction.lock().stream.window_bytes;
        let streamed = self
            .prediction
            .graph()
            .predicted_bytes()
            .saturating_sub(info.budget);
        let cap = match (plan_window, streamed) {
            (0, 0) => info.budget / 8,
            (0, streamed) => (info.budget / 8)
                .min(streamed / 8)
                .min(STREAM_LOOKAHEAD_MAX),
            (window, _) => window,
        };
        self.max_lookahead_bytes = self
            .max_lookahead_bytes
            .min(cap.max(self.min_lookahead_bytes));
        self.device_bytes = (plan_window > 0).then_some(streaming::STREAM_DEVICE_BYTES);
        self.initial_lookahead_bytes = self.initial_lookahead_bytes.min(self.max_lookahead_bytes);
    }

    fn region_removed(&mut self, region: RegionId) {
        self.prediction.region_removed(region);
    }

    fn read_completed(&mut self, _block: BlockRef, _bytes: u64, elapsed_ns: u64) {
        self.read_ns = ewma(self.read_ns, elapsed_ns as f64);
    }

    fn device_bytes(&self) -> Option<u64> {
        // Not in the first pass: every block is missing then, the kept ones too, and
        // the program waits on the device throughout, so its full depth is what pays.
        // Measured (llama-completion -n 1, cold, 3 GiB llama): start to first token
        // at 90 % of the model 1.6-3.9 s bounded, against 1.6 at 125 % (no bound).
        let warm = self.progress_steps >= self.prediction.graph().order().len() as u64;
        self.device_bytes.filter(|_| warm)
    }

    fn plan(&mut self, fault: &FaultEvent, out: &mut Vec<PrefetchRequest>) {
        let prediction = Arc::clone(&self.prediction);
        let graph = prediction.graph();
        let order = graph.order();
        let layout = graph.geometry();
        let mut progress = prediction.lock();
        // A routed expert in use: the rest of its slices (gate, up, down) follow at once.
        let global = progress.global(graph, fault.block);
        let in_use =
            global.and_then(|global| progress.experts_in_use(graph, global, fault.offset_in_block));
        if let (Some(global), Some(groups)) = (global, &in_use) {
            let experts = graph.experts();
            let mut wanted: Vec<u32> = groups
                .iter()
                .flat_map(|&group| experts.group(group).blocks())
                .filter(|&block| block != global && !progress.resident[block as usize])
                .collect();
            wanted.dedup();
            for block in wanted {
                if let Some(block_ref) = progress.local(graph, block, fault.block.region) {
                    out.push(PrefetchRequest::eager(block_ref));
                }
            }
        }
        let Some(position) = progress.advance(graph, fault) else {
            return;
        };
        if let Some((last_position, last_ns)) = self.last {
            let steps = progress_steps(order, last_position, position);
            self.progress_steps += steps;
            if fault.time_ns > last_ns && steps > 0 {
                let bytes = (steps * layout.block_size) as f64;
                let seconds = (fault.time_ns - last_ns) as f64 * 1e-9;
                self.consume_bytes_per_s = ewma(self.consume_bytes_per_s, bytes / seconds);
            }
        }
        self.last = Some((position, fault.time_ns));
        // The fault's block, in the graph's numbering.
        let faulted = order.block_at(position);

        // Every block used within the lookahead (`window` positions) must be resident or
        // in flight. Blocks this policy requested for a position still ahead count
        // towards the window whether read yet or not. Other resident blocks are the part
        // of the model kept resident: they do not count, and the walk goes through them
        // to the blocks after, because the program raises no fault while it runs through
        // resident blocks, so the next plan would come too late. The first block after
        // such a stretch is a marker, so the program reports back as it leaves it.
        let lookahead = self.lookahead_bytes();
        let window = lookahead.div_ceil(layout.block_size).max(1);
        // Other markers sit at fixed positions (multiples of a power-of-two stride), so
        // successive plans agree on them: a block first requested without a marker is
        // never meant to carry one.
        let stride = prev_power_of_two((window / self.markers_per_window.max(1)).max(1));
        let mut counted = 0u64;
        let mut after_resident_stretch = false;
        for step in 1..order.len() as u64 {
            let at = ((position as u64 + step) % order.len() as u64) as u32;
            let block = order.block_at(at);
            let target = self.progress_steps + step;
            let ours = self.target[block as usize] > self.progress_steps;
            let resident = block == faulted || progress.resident[block as usize];
            if resident && !ours {
                after_resident_stretch = true;
                continue;
            }
            counted += 1;
            if counted > window {
                break;
            }
            if resident || self.target[block as usize] == target {
                continue;
            }
            // A part of the model no region presents (not mapped yet, or any more).
            let Some(block_ref) = progress.local(graph, block, fault.block.region) else {
                continue;
            };
            self.target[block as usize] = target;
            let marker = at as u64 % stride == 0 || after_resident_stretch;
            after_resident_stretch = false;
            out.push(if marker {
                PrefetchRequest::marker(block_ref)
            } else {
                PrefetchRequest::eager(block_ref)
            });
        }
    }
}

/// Where a fault on `block` puts the program when the cursor is at `cursor`: the
/// block's next use (the program moves forward), or its last use when that lies a
/// little behind (`lag_behind`) and nearer than the next, with how far behind: a
/// thread lagging behind the one that faulted before it. A block used at two places
/// is judged by both: a block that two tensors share (the end of one layer's
/// attn_norm and the start of its ffn_down, 60 positions on, in a 3 GiB llama at
/// 2 MiB blocks) faulted on by the thread still at the start of ffn_down is that
/// thread a step behind, not a pass ahead at attn_norm. Taking the next use (as this
/// did) moved the cursor back 60 positions at every layer.
fn locate(order: &CyclicOrder, cursor: u32, block: u32) -> Option<(u32, Option<u32>)> {
    let ahead = order.next_position(block, cursor)?;
    let behind = order.prev_position(block, cursor)?;
    Some(match lag_behind(order, cursor, behind) {
        Some(lag) if lag < order.distance(cursor, ahead) => (behind, Some(lag)),
        _ => (ahead, None),
    })
}

/// How far the program moved along the order from `from` to `to`. Threads sharing a
/// tensor fault slightly out of order: a fault a little behind the last one is the
/// program still there, not a whole pass ahead. Counting it as a pass (as this did)
/// made every block read for the current pass look stale, so the next plan read a
/// second window's worth ahead and evicted kept blocks for it: measured 314 such
/// faults in one 8-token llama-bench run at half the model, and about 20 % more bytes
/// read per token.
fn progress_steps(order: &CyclicOrder, from: u32, to: u32) -> u64 {
    match lag_behind(order, from, to) {
        Some(_) => 0,
        None => order.distance(from, to) as u64,
    }
}

/// How far a fault at `to` lies behind the previous one at `from`, when it is a little
/// behind (at most a sixteenth of the order, and nearer backwards than forwards): a
/// thread lagging behind the one that faulted before it.
fn lag_behind(order: &CyclicOrder, from: u32, to: u32) -> Option<u32> {
    let forward = order.distance(from, to);
    let backward = order.distance(to, from);
    (backward > 0 && backward < forward && backward <= order.len() / 16).then_some(backward)
}

/// Whether the graph's block `global` holds only routed experts: outside the order
/// (a block shared with a tensor every token reads is in it) and in some expert group.
fn is_routed_expert(graph: &ModelGraph, global: u32) -> bool {
    !graph.order().contains(global) && !graph.experts().groups_of(global).is_empty()
}

fn prev_power_of_two(n: u64) -> u64 {
    1 << (63 - n.max(1).leading_zeros())
}

/// Belady's rule on the predicted order.
///
/// Blocks the graph does not predict (other regions, embedding rows) go first, the least
/// central first, then in the order they arrived. Among predicted blocks, the one used
/// furthest ahead of the current position goes; when the model does not fit, a streamed
/// block (see [`streaming`]) before a kept one used as far ahead in the same sense
/// (passed, or still to come this pass).
pub struct GraphEviction {
    prediction: Arc<GraphPrediction>,
    /// Per region: every position of every tracked predicted block.
    positions: Vec<RegionPositions>,
    /// Per region: the positions of the tracked predicted blocks that stream.
    streamed_positions: Vec<RegionPositions>,
    /// Unpredicted blocks by (centrality bits, arrival).
    unpredicted: BTreeSet<(u64, u64, BlockRef)>,
    /// Per region, per block: how it is tracked. Dense, since every block of a bound
    /// region passes through here once per token.
    tracked: PerBlock<Tracked>,
    /// The keys of tracked unpredicted blocks in `unpredicted`.
    unpredicted_keys: HashMap<BlockRef, (u64, u64)>,
    /// Routed-expert blocks: ranked by expected use, watched to learn it.
    experts: ExpertBlocks,
    tracked_count: usize,
    arrivals: u64,
}

#[derive(Copy, Clone, Default, PartialEq, Eq)]
enum Tracked {
    #[default]
    No,
    /// With the block's number in the graph (its part's first block plus its index).
    Predicted(u32),
    /// A block of routed experts, with its number in the graph.
    Expert(u32),
    Unpredicted,
}

/// Positions in the order of one region's tracked blocks.
struct RegionPositions {
    region: RegionId,
    /// The graph's number for the region's block 0 (see `GraphPart::first_block`).
    first_block: u32,
    set: PositionSet,
}

impl GraphEviction {
    pub fn new(prediction: Arc<GraphPrediction>) -> Self {
        Self {
            experts: ExpertBlocks::new(&prediction.graph),
            prediction,
            positions: Vec::new(),
            streamed_positions: Vec::new(),
            unpredicted: BTreeSet::new(),
            tracked: PerBlock::default(),
            unpredicted_keys: HashMap::new(),
            tracked_count: 0,
            arrivals: 0,
        }
    }

    pub fn tracked(&self) -> usize {
        self.tracked_count
    }

    fn tracked_mut(&mut self, block: BlockRef) -> &mut Tracked {
        self.tracked.get_mut(block)
    }

    /// Adds (or removes) every position of `block` (`global` in the graph) to its
    /// region's sets: all tracked predicted blocks, and the streamed ones if it streams.
    fn set_positions(&mut self, block: BlockRef, global: u32, streamed: bool, present: bool) {
        let order = self.prediction.graph.order();
        let lists: &mut [&mut Vec<RegionPositions>] = if streamed {
            &mut [&mut self.positions, &mut self.streamed_positions]
        } else {
            &mut [&mut self.positions]
        };
        for sets in lists.iter_mut() {
            let at = match sets.iter().position(|sets| sets.region == block.region) {
                Some(at) => at,
                None => {
                    sets.push(RegionPositions {
                        region: block.region,
                        first_block: global - block.index,
                        set: PositionSet::new(order.len()),
                    });
                    sets.len() - 1
                }
            };
            let set = &mut sets[at].set;
            for &position in order.positions(global) {
                if present {
                    set.insert(position);
                } else {
                    set.remove(position);
                }
            }
        }
    }

    fn forget(&mut self, block: BlockRef, progress: &mut Progress) {
        let state = std::mem::replace(self.tracked_mut(block), Tracked::No);
        match state {
            Tracked::Predicted(global) => {
                let streamed = progress.stream.is_streamed(global);
                self.set_positions(block, global, streamed, false);
                if let Some(slot) = progress.resident.get_mut(global as usize) {
                    *slot = false;
                }
                self.tracked_count -= 1;
            }
            Tracked::Expert(global) => {
                let graph = &self.prediction.graph;
                self.experts
                    .remove(block, global, graph, &mut progress.experts);
                if let Some(slot) = progress.resident.get_mut(global as usize) {
                    *slot = false;
                }
                self.tracked_count -= 1;
            }
            Tracked::Unpredicted => {
                if let Some((rank, arrival)) = self.unpredicted_keys.remove(&block) {
                    self.unpredicted.remove(&(rank, arrival, block));
                }
                self.tracked_count -= 1;
            }
            Tracked::No => {}
        }
    }

    /// The tracked predicted block to evict with the program at `cursor`, and how many
    /// steps ahead it is used next. Belady's choice is the block used furthest ahead:
    /// scanning backwards from just behind the cursor round the cycle, the first entry
    /// that is its block's next use. The `guard` positions just behind the cursor may
    /// still be read by a thread lagging behind the one that faulted last (see
    /// `ModelGraph::lag_guard`): they are passed over for older ones, taken only
    /// before blocks still to be used this pass, and then the oldest first. With a
    /// streamed set planned, a streamed block goes before any kept one.
    fn furthest(&self, cursor: u32, guard: u32) -> Option<(BlockRef, u32)> {
        let streamed = furthest_in(
            &self.prediction.graph,
            &self.streamed_positions,
            cursor,
            guard,
        );
        let any = || furthest_in(&self.prediction.graph, &self.positions, cursor, guard);
        let (block, _, distance) = streamed.or_else(any)?;
        Some((block, distance))
    }
}

/// Belady's choice among the positions in `sets` (see `GraphEviction::furthest`): the
/// block, its zone (0: behind the guard, 1: inside it, 2: still to come) and how far
/// ahead it is used next.
fn furthest_in(
    graph: &ModelGraph,
    sets: &[RegionPositions],
    cursor: u32,
    guard: u32,
) -> Option<(BlockRef, u32, u32)> {
    let order = graph.order();
    let guarded_from = cursor.saturating_sub(guard);
    // (zone, distance): the earlier zone first, then the furthest next use.
    let mut best: Option<(BlockRef, u32, u32)> = None;
    for RegionPositions {
        region,
        first_block,
        set,
    } in sets
    {
        // The next and the last use of the block at `position`, seen from the cursor.
        let next_use = |position: u32| order.next_position(order.block_at(position), cursor);
        let last_use = |position: u32| order.prev_position(order.block_at(position), cursor);
        let is_next_use = |position: u32| next_use(position) == Some(position);
        // A block used at two places is in the zone of its last use, not of its next
        // (see `locate`): one that two tensors share, used last inside the guard, is
        // still being read whatever pass its next use is in.
        let passed_before_guard = |position: u32| {
            is_next_use(position) && last_use(position).is_some_and(|last| last < guarded_from)
        };
        let last_used_in_guard = |position: u32| {
            last_use(position) == Some(position)
                && next_use(position).is_some_and(|next| next < cursor)
        };
        // Behind the guard, then inside it (both used this pass already), then from
        // the end of the cycle down to the cursor (still to be used this pass).
        let zones = [
            (0, guarded_from, 0),
            (1, cursor, guarded_from),
            (2, order.len(), cursor),
        ];
        let found = zones.iter().find_map(|&(zone, end, floor)| {
            let last = end.checked_sub(1).filter(|&last| last >= floor)?;
            let position = match zone {
                // Inside the guard the oldest first: threads sharing a step move
                // through it together from its start, so the block passed first is the
                // one both are most likely done with, and the block passed last may be
                // one the thread behind has still to read.
                1 => first_matching(set, floor, last, last_used_in_guard),
                0 => last_matching(set, last, floor, passed_before_guard),
                _ => last_matching(set, last, floor, is_next_use),
            };
            position.map(|position| (zone, position))
        });
        if let Some((zone, position)) = found {
            let block = order.block_at(position);
            let distance = order.next_use(block, cursor).unwrap_or(0);
            let better = best.is_none_or(|(_, best_zone, best_distance)| {
                (zone, std::cmp::Reverse(distance)) < (best_zone, std::cmp::Reverse(best_distance))
            });
            if better {
                best = Some((BlockRef::new(*region, block - first_block), zone, distance));
            }
        }
    }
    best
}

/// The first member of `set` in `from..=ceiling` for which `accept` holds.
fn first_matching(
    set: &PositionSet,
    mut from: u32,
    ceiling: u32,
    accept: impl Fn(u32) -> bool,
) -> Option<u32> {
    loop {
        let position = set.first_at_or_after(from).filter(|&p| p <= ceiling)?;
        if accept(position) {
            return Some(position);
        }
        from = position.checked_add(1)?;
    }
}

/// The last member of `set` in `floor..=from` for which `accept` holds.
fn last_matching(
    set: &PositionSet,
    mut from: u32,
    floor: u32,
    accept: impl Fn(u32) -> bool,
) -> Option<u32> {
    loop {
        let position = set.last_at_or_before(from).filter(|&p| p >= floor)?;
        if accept(position) {
            return Some(position);
        }
        from = position.checked_sub(1)?;
    }
}

impl EvictionPolicy for GraphEviction {
    fn name(&self) -> &'static str {
        "graph"
    }

    fn region_added(&mut self, info: &RegionInfo<'_>) {
        self.prediction.region_added(info);
        let graph = &self.prediction.graph;
        if self.prediction.lock().bound(info.id) {
            // Use counts matter only where experts get evicted.
            self.experts.watching = info.watch_resident
                && !graph.experts().is_empty()
                && graph.geometry().data_len > info.budget;
        }
    }

    fn region_removed(&mut self, region: RegionId) {
        let prediction = Arc::clone(&self.prediction);
        let mut progress = prediction.lock();
        let tracked: Vec<u32> = self
            .tracked
            .region(region)
            .iter()
            .enumerate()
            .filter(|(_, &state)| state != Tracked::No)
            .map(|(index, _)| index as u32)
            .collect();
        for index in tracked {
            self.forget(BlockRef::new(region, index), &mut progress);
        }
        self.tracked.remove_region(region);
        self.positions.retain(|sets| sets.region != region);
        self.streamed_positions.retain(|sets| sets.region != region);
        progress.regions.retain(|&(r, _)| r != region);
    }

    fn inserted(&mut self, block: BlockRef) {
        let prediction = Arc::clone(&self.prediction);
        let mut progress = prediction.lock();
        self.forget(block, &mut progress);
        let graph = &prediction.graph;
        let global = progress.global(graph, block);
        if let Some(global) = global.filter(|&global| is_routed_expert(graph, global)) {
            self.experts
                .insert(block, global, graph, &mut progress.experts);
            progress.resident[global as usize] = true;
            *self.tracked_mut(block) = Tracked::Expert(global);
        } else if let Some(global) = global.filter(|&global| graph.order().contains(global)) {
            let streamed = progress.stream.is_streamed(global);
            self.set_positions(block, global, streamed, true);
            progress.resident[global as usize] = true;
            *self.tracked_mut(block) = Tracked::Predicted(global);
        } else {
            let rank = global.map_or(0.0, |global| graph.block_rank(global));
            // Non-negative floats order like their bit patterns.
            let key = (rank.max(0.0).to_bits(), self.arrivals);
            self.arrivals += 1;
            self.unpredicted.insert((key.0, key.1, block));
            self.unpredicted_keys.insert(block, key);
            *self.tracked_mut(block) = Tracked::Unpredicted;
        }
        self.tracked_count += 1;
    }

    fn removed(&mut self, block: BlockRef) {
        let prediction = Arc::clone(&self.prediction);
        let mut progress = prediction.lock();
        self.forget(block, &mut progress);
    }

    fn touched(&mut self, fault: &FaultEvent) {
        let prediction = Arc::clone(&self.prediction);
        let graph = &prediction.graph;
        let mut progress = prediction.lock();
        progress.advance(graph, fault);
        if let Some(global) = progress.global(graph, fault.block) {
            if is_routed_expert(graph, global) {
                self.experts.fault(global, graph, &mut progress.experts);
            }
        }
    }

    fn watch(&mut self, out: &mut Vec<BlockRef>) {
        let prediction = Arc::clone(&self.prediction);
        let graph = &prediction.graph;
        let mut progress = prediction.lock();
        let Progress {
            regions, experts, ..
        } = &mut *progress;
        let local = |global| local_in(regions, graph, global, None);
        self.experts.watch(experts, local, out);
    }

    fn victim(&mut self, incoming: BlockRef, kind: ReadKind) -> Option<BlockRef> {
        let prediction = Arc::clone(&self.prediction);
        let mut progress = prediction.lock();
        if let Some(&(_, _, block)) = self.unpredicted.first() {
            self.forget(block, &mut progress);
            return Some(block);
        }
        let cursor = progress.cursor;
        let guard = progress.lag_guard(&prediction.graph);
        // Belady on expectations: the dense block used furthest ahead, or the expert
        // block expected to be used furthest ahead, whichever is further.
        let dense = self.furthest(cursor, guard);
        let expert = self.experts.coldest(&prediction.graph, &progress);
        let (block, distance) = match (dense, expert) {
            (Some((dense, distance)), Some((_, expected))) if expected < distance as f64 => {
                (dense, distance as f64)
            }
            (_, Some(expert)) => expert,
            (Some((dense, distance)), None) => (dense, distance as f64),
            (None, None) => return None,
        };
        if kind == ReadKind::Prefetch {
            // A speculative read only displaces a block needed later than itself; an
            // unpredicted incoming block displaces nothing predicted.
            let order = prediction.graph.order();
            let incoming = progress.global(&prediction.graph, incoming)?;
            if is_routed_expert(&prediction.graph, incoming) {
                // The rest of an expert just used is needed now; any other expert when
                // expected.
                let experts = prediction.graph.experts();
                let needed_now = experts
                    .groups_of(incoming)
                    .iter()
                    .any(|&group| progress.experts.used_now(group));
                let incoming_distance = if needed_now {
                    0.0
                } else {
                    progress.expected_next_use(&prediction.graph, incoming)
                };
                if distance <= incoming_distance {
                    return None;
                }
                self.forget(block, &mut progress);
                return Some(block);
            }
            let incoming_distance = order.next_use(incoming, cursor)?;
            // A block a little behind the cursor is one a lagging thread has yet to
            // read (the cursor follows whichever thread faulted last): needed now, not
            // a pass from now.
            let lagging = order
                .next_position(incoming, cursor.saturating_sub(guard))
                .is_some_and(|position| {
                    order.distance(position, cursor) <= guard && position <= cursor
                });
            let incoming_distance = if lagging { 0 } else { incoming_distance };
            if distance <= incoming_distance as f64 {
                return None;
            }
        }
        self.forget(block, &mut progress);
        Some(block)
    }
}

/// How often each expert ran in a demand trace: `faults` are the blocks (and offsets in
/// them) a program faulted on, in order, through one region presenting the whole model
/// of `graph` (as `hyperoffload run --policy demand` records them: every block a token
/// uses faults). Counted as the graph policy counts them, tokens told apart by the
/// layers of the expert faults. `None` for a model without routed experts.
pub fn expert_counts_from_faults(
    graph: &Arc<ModelGraph>,
    faults: impl IntoIterator<Item = (u32, Option<u32>)>,
) -> Option<ExpertCounts> {
    let prediction = GraphPrediction::new(Arc::clone(graph));
    {
        let mut progress = prediction.lock();
        for (block, offset) in faults {
            for group in progress
                .experts_in_use(graph, block, offset)
                .unwrap_or_default()
            {
                progress.experts.used(group);
            }
        }
    }
    prediction.expert_counts()
}

/// Both graph policies over one shared prediction.
pub fn graph_policies(graph: Arc<ModelGraph>) -> (GraphPrefetch, GraphEviction) {
    let prediction = GraphPrediction::new(graph);
    (
        GraphPrefetch::new(Arc::clone(&prediction)),
        GraphEviction::new(prediction),
    )
}

#[cfg(test)]
mod tests;
