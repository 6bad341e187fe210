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

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

pub use self::co_activation::CoActivationSummary;
pub use self::confidence::ConfidenceSummary;
use self::confidence::{lands_as_planned, Confidence, Planned};
use self::expert_use::ExpertUse;
use self::streaming::{plan_streaming, StreamPlan};
use super::{BlockRef, FaultEvent, RegionId, RegionInfo};
use crate::geometry::BlockGeometry;
use crate::graph::expert_store::{ExpertCount, ExpertCounts, ExpertPair};
use crate::graph::{CyclicOrder, GraphSource, ModelGraph};

mod co_activation;
mod confidence;
mod eviction;
mod expert_blocks;
mod expert_use;
mod idle_fill;
mod prefetch;
pub mod streaming;
mod unplaced;
mod use_mixture;

pub use self::eviction::GraphEviction;
pub use self::prefetch::{GraphPrefetch, STREAM_LOOKAHEAD_MAX};

/// How the graph eviction watched routed experts' blocks (`expert_blocks`): blocks it
/// asked the service to watch, and watch faults on them (a resident expert's use seen).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ExpertWatches {
    pub asked: u64,
    pub faults: u64,
}

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
    /// How well the program follows each part of the order (`confidence`).
    confidence: Confidence,
    /// What the latest prefetch plan covered: where the next fault should land.
    planned: Option<Planned>,
    /// The latest fault judged: both policies hear of each fault, it is judged once.
    judged: Option<(u64, BlockRef)>,
    /// Whether the graph eviction has chosen a victim since the budget was last set or
    /// a region came or went (`budget_filled`).
    budget_filled: bool,
    /// Routed experts' blocks watched, and their watch faults.
    expert_watches: ExpertWatches,
    /// Positions the program has moved along the order since the start, as faults show
    /// it (`progress_steps`): the clock by which unpredicted blocks age.
    travelled: u64,
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
                confidence: Confidence::new(
                    graph.order().len(),
                    graph.source() == GraphSource::Learned,
                ),
                planned: None,
                judged: None,
                budget_filled: false,
                expert_watches: ExpertWatches::default(),
                travelled: 0,
            }),
            graph,
        })
    }

    /// A prediction of nothing: the graph policies built without a graph.
    pub fn empty() -> Arc<Self> {
        // A zero-length layout is always valid.
        let layout = BlockGeometry::new(0, 0, 1).expect("a zero-length layout is valid");
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

    /// Chooses the streamed set again for `budget` (a model bound, the budget moved):
    /// the blocks that stream are the ones a pass under this budget must read.
    fn replan_streaming(&self, budget: u64) {
        let mut progress = self.lock();
        if progress.regions.is_empty() {
            return;
        }
        progress.stream = plan_streaming(
            self.graph.order(),
            &*self.graph,
            budget,
            self.graph.lag_guard(),
        );
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
        let pairs = progress
            .experts
            .pairs()
            .map(|pair| {
                let (from, to) = (experts.group(pair.from), experts.group(pair.to));
                ExpertPair {
                    layer: from.layer,
                    expert: from.expert,
                    next_layer: to.layer,
                    next_expert: to.expert,
                    tokens: pair.tokens,
                }
            })
            .collect();
        Some(ExpertCounts {
            experts: counts
                .map(|(id, uses, tokens)| {
                    let group = experts.group(id);
                    ExpertCount {
                        layer: group.layer,
                        expert: group.expert,
                        uses: uses.min(tokens),
                        tokens,
                        paired_tokens: progress.experts.pair_basis(id),
                    }
                })
                .collect(),
            pairs,
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
        let mut pairs: HashMap<u32, Vec<(u32, f64)>> = HashMap::new();
        for pair in &counts.pairs {
            let from = groups.get(&(pair.layer, pair.expert));
            let to = groups.get(&(pair.next_layer, pair.next_expert));
            if let (Some(&from), Some(&to)) = (from, to) {
                pairs.entry(from).or_default().push((to, pair.tokens));
            }
        }
        let mut progress = self.lock();
        let mut matched = 0;
        for count in &counts.experts {
            if let Some(&group) = groups.get(&(count.layer, count.expert)) {
                progress.experts.seed(group, count.uses, count.tokens);
                let from_it = pairs.get(&group).map_or(&[][..], Vec::as_slice);
                progress
                    .experts
                    .seed_pairs(group, count.paired_tokens, from_it);
                matched += 1;
            }
        }
        matched
    }

    /// How often the program landed where the prefetch plans said, and how many parts
    /// of the order prefetch leaves to demand paging now.
    pub fn confidence(&self) -> ConfidenceSummary {
        self.lock().confidence.summary()
    }

    /// How well co-activation predicts the next layer's experts; `None` for a model
    /// without routed experts.
    pub fn co_activation(&self) -> Option<CoActivationSummary> {
        (!self.graph.experts().is_empty()).then(|| self.lock().experts.co_activation())
    }

    /// The weight the estimate of the next token's experts has learned to give
    /// recency (`ExpertUse::recency_weight`); `None` for a model without routed experts.
    pub fn expert_recency(&self) -> Option<f64> {
        (!self.graph.experts().is_empty()).then(|| self.lock().experts.recency_weight())
    }

    /// How routed experts' blocks were watched; `None` for a model without them.
    pub fn expert_watches(&self) -> Option<ExpertWatches> {
        (!self.graph.experts().is_empty()).then(|| self.lock().expert_watches)
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
            self.travelled += progress_steps(order, self.cursor, position);
            self.cursor = position;
            return Some(position);
        }
        let (position, lag) = locate(order, self.cursor, global)?;
        if let Some(behind) = lag {
            self.lag_seen = self.lag_seen.max(behind);
        }
        self.judge(graph, fault, position);
        self.travelled += progress_steps(order, self.cursor, position);
        self.cursor = position;
        Some(position)
    }

    /// Judges whether the fault that put the program at `position` landed where the
    /// latest plan said (once per fault, whichever policy hears of it first).
    fn judge(&mut self, graph: &ModelGraph, fault: &FaultEvent, position: u32) {
        let order = graph.order();
        let key = (fault.time_ns, fault.block);
        let Some(planned) = self.planned.filter(|_| self.judged != Some(key)) else {
            return;
        };
        self.judged = Some(key);
        let ahead = order.distance(planned.from, position);
        let behind = lag_behind(order, planned.from, position);
        let into_step = graph.lag_guard_at(position);
        self.confidence.judge(
            position,
            lands_as_planned(planned, ahead, into_step, behind),
        );
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
        let groups =
            graph
                .experts()
                .groups_in_use(global, offset, graph.geometry().block_range(global));
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
    /// used next: to its layer (`d`), used there with probability `q`, else a pass more
    /// for every `1/p` (`p` its use per token): `d + (1 - q) L / p` for a pass of `L`.
    /// `q` is `p` but for the layers just ahead of the current token, where what the
    /// token used in this layer tells more (`ExpertUse::this_token_probability`);
    /// with `q = p` it is `d + L (1/p - 1)`, the expected wait of a block used with
    /// probability `p` each pass.
    fn expected_next_use(&self, graph: &ModelGraph, global: u32) -> f64 {
        let groups = graph.experts().groups_of(global);
        if groups.iter().any(|&group| self.experts.reading_now(group)) {
            return 0.0;
        }
        let (probability, anchor) = self.expert_block_use(graph, global);
        let this_token = self.experts.this_token_block_probability(groups);
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
        to_layer + order.len().max(1) as f64 * (1.0 - this_token).max(0.0) / probability
    }

    /// Whether the budget has filled: the graph eviction has chosen a victim since the
    /// budget was last set or a region was mapped or unmapped. Room free after that is
    /// the odd bytes a victim larger than the block read in its place leaves, or room
    /// the program's reads take back within a few tokens, not room the program leaves
    /// idle (`idle_fill`). (Room a hint drops is not counted as free again: the fill
    /// waits for the next budget change there.)
    fn budget_filled(&self) -> bool {
        self.budget_filled
    }

    /// Positions behind the cursor that a lagging thread may still be reading: back to
    /// the start of the cursor's step when the graph knows the model's steps
    /// (`ModelGraph::lag_guard_at`), and at least the lag observed.
    fn lag_guard(&self, graph: &ModelGraph) -> u32 {
        graph.lag_guard_at(self.cursor).max(self.lag_seen)
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

/// A prediction that has followed a demand trace's expert faults: `faults` are the
/// blocks (and offsets in them) a program faulted on, in order, through one region
/// presenting the whole model of `graph` (as `hyperoffload run --policy demand` records
/// them: every block a token uses faults), counted as the graph policy counts them,
/// tokens told apart by the layers of the expert faults.
fn replayed(
    graph: &Arc<ModelGraph>,
    faults: impl IntoIterator<Item = (u32, Option<u32>)>,
) -> Arc<GraphPrediction> {
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
    prediction
}

/// What a demand trace says of a model's experts (see `replayed`): how often each ran,
/// and how well co-activation, replayed in order, predicted each next layer's. `None`
/// for a model without routed experts.
pub fn expert_use_from_faults(
    graph: &Arc<ModelGraph>,
    faults: impl IntoIterator<Item = (u32, Option<u32>)>,
) -> Option<(ExpertCounts, CoActivationSummary)> {
    let prediction = replayed(graph, faults);
    Some((prediction.expert_counts()?, prediction.co_activation()?))
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
