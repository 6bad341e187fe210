//! `GraphEviction`: Belady's rule applied to the prediction (the resident block whose
//! next use is furthest along the order goes first), streamed blocks before kept ones,
//! cold experts before popular ones.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use super::expert_blocks::ExpertBlocks;
use super::unplaced::UnplacedBlocks;
use super::{is_routed_expert, local_in, GraphPrediction, Progress};
use crate::graph::{CyclicOrder, ModelGraph};
use crate::policy::per_block::PerBlock;
use crate::policy::position_set::PositionSet;
use crate::policy::{BlockRef, EvictionPolicy, FaultEvent, ReadKind, RegionId, RegionInfo};

/// Belady's rule on the predicted order.
///
/// Blocks of other regions go first, in the order they arrived. Blocks of the model the
/// order does not place (the embedding table, of which each token reads a row or two)
/// are ranked as experts are, by how often the run uses each (a word the text repeats
/// reads its row again): the one expected furthest ahead goes when that is further than
/// any predicted block's next use and any expert's expected one (see `unplaced`). Among
/// predicted blocks, the one used furthest ahead of the current position goes; when
/// the model does not fit, a streamed block (see
/// [`streaming`]) before a kept one used as far ahead in the same sense (passed, or
/// still to come this pass).
pub struct GraphEviction {
    pub(super) prediction: Arc<GraphPrediction>,
    /// Per region: every position of every tracked predicted block.
    positions: Vec<RegionPositions>,
    /// Per region: the positions of the tracked predicted blocks that stream.
    streamed_positions: Vec<RegionPositions>,
    /// Tracked blocks of other regions, by arrival.
    other_regions: BTreeMap<u64, BlockRef>,
    /// Per region, per block: how it is tracked. Dense, since every block of a bound
    /// region passes through here once per token.
    tracked: PerBlock<Tracked>,
    /// The arrival of each block in `other_regions`.
    other_region_arrivals: HashMap<BlockRef, u64>,
    /// Tracked blocks of the model the order does not place: ranked by their uses,
    /// watched to count them.
    unplaced: UnplacedBlocks<BlockRef>,
    /// Routed-expert blocks: ranked by expected use, watched to learn it.
    experts: ExpertBlocks,
    tracked_count: usize,
    arrivals: u64,
    /// Whether the service watches resident blocks (`RegionInfo::watch_resident`).
    watch_resident: bool,
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
        let pass = u64::from(prediction.graph.order().len());
        let unplaced = UnplacedBlocks::new(unplaced_blocks(&prediction.graph), pass);
        Self {
            experts: ExpertBlocks::new(&prediction.graph),
            prediction,
            positions: Vec::new(),
            streamed_positions: Vec::new(),
            other_regions: BTreeMap::new(),
            tracked: PerBlock::default(),
            other_region_arrivals: HashMap::new(),
            unplaced,
            tracked_count: 0,
            arrivals: 0,
            watch_resident: false,
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
        mark_positions(&mut self.positions, order, block, global, present);
        if streamed {
            mark_positions(&mut self.streamed_positions, order, block, global, present);
        }
    }

    /// Whether routed experts' use is watched: where the service watches and experts
    /// are evicted at all (the model does not fit `budget`).
    fn watches_experts(&self, budget: u64) -> bool {
        let graph = &self.prediction.graph;
        self.watch_resident && !graph.experts().is_empty() && graph.geometry().data_len > budget
    }

    /// Whether resident unplaced blocks are watched: the pager honours watches and the
    /// model does not fit (one that fits never evicts, so use counts change nothing).
    fn watches_unplaced(&self, budget: u64) -> bool {
        self.watch_resident && self.prediction.graph.geometry().data_len > budget
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
                if let Some(arrival) = self.other_region_arrivals.remove(&block) {
                    self.other_regions.remove(&arrival);
                }
                self.unplaced.remove(block);
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

/// Adds (or removes) every position of `block` (`global` in the graph) to its region's
/// set in `sets`.
fn mark_positions(
    sets: &mut Vec<RegionPositions>,
    order: &CyclicOrder,
    block: BlockRef,
    global: u32,
    present: bool,
) {
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
        let prediction = Arc::clone(&self.prediction);
        let mut progress = prediction.lock();
        if progress.bound(info.id) {
            // Use counts matter only where experts get evicted.
            self.watch_resident = info.watch_resident;
            self.experts.watching = self.watches_experts(info.budget);
            let watching = self.watches_unplaced(info.budget);
            self.unplaced.set_watching(watching, progress.travelled);
            // A model mapped again has the budget's room to fill.
            progress.budget_filled = false;
        }
    }

    fn budget_changed(&mut self, budget: u64) {
        let prediction = Arc::clone(&self.prediction);
        prediction.replan_streaming(budget);
        let mut progress = prediction.lock();
        // A larger budget has room again; a smaller one evicts at once and is full.
        progress.budget_filled = false;
        // The streamed positions again, from the tracked predicted blocks that stream
        // under the new set: those go first from now on.
        self.streamed_positions.clear();
        let streamed: Vec<(BlockRef, u32)> = self
            .tracked
            .regions()
            .flat_map(|(region, blocks)| {
                blocks
                    .iter()
                    .enumerate()
                    .filter_map(move |(index, state)| match *state {
                        Tracked::Predicted(global) => {
                            Some((BlockRef::new(region, index as u32), global))
                        }
                        _ => None,
                    })
            })
            .filter(|&(_, global)| progress.stream.is_streamed(global))
            .collect();
        drop(progress);
        let order = prediction.graph.order();
        for (block, global) in streamed {
            mark_positions(&mut self.streamed_positions, order, block, global, true);
        }
        self.experts.watching = self.watches_experts(budget);
        let watching = self.watches_unplaced(budget);
        let travelled = prediction.lock().travelled;
        self.unplaced.set_watching(watching, travelled);
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
        // Its blocks' room is free again, for the fill too.
        progress.budget_filled = false;
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
            match global {
                Some(global) => {
                    self.unplaced.insert(block, global, progress.travelled);
                }
                None => {
                    self.other_regions.insert(self.arrivals, block);
                    self.other_region_arrivals.insert(block, self.arrivals);
                    self.arrivals += 1;
                }
            }
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
        self.unplaced.fault(fault.block, progress.travelled);
        if let Some(global) = progress.global(graph, fault.block) {
            if is_routed_expert(graph, global)
                && self.experts.fault(global, graph, &mut progress.experts)
            {
                progress.expert_watches.faults += 1;
            }
        }
    }

    fn watch(&mut self, out: &mut Vec<BlockRef>) {
        let prediction = Arc::clone(&self.prediction);
        let graph = &prediction.graph;
        let mut progress = prediction.lock();
        let Progress {
            regions,
            experts,
            expert_watches,
            ..
        } = &mut *progress;
        let local = |global| local_in(regions, graph, global, None);
        let before = out.len();
        self.experts.watch(experts, local, out);
        expert_watches.asked += (out.len() - before) as u64;
        self.unplaced.watch(out, progress.travelled);
    }

    fn victim(&mut self, incoming: BlockRef, kind: ReadKind) -> Option<BlockRef> {
        let prediction = Arc::clone(&self.prediction);
        let mut progress = prediction.lock();
        let victim = self.choose_victim(&prediction, &mut progress, incoming, kind);
        if victim.is_some() {
            progress.budget_filled = true;
        }
        victim
    }
}

/// How many blocks of `graph` the order does not place and no expert holds.
fn unplaced_blocks(graph: &ModelGraph) -> usize {
    let order = graph.order();
    (0..graph.geometry().block_count())
        .filter(|&block| !order.contains(block) && !is_routed_expert(graph, block))
        .count()
}

impl GraphEviction {
    /// The tracked unplaced block expected to be used furthest ahead, with that
    /// expectation in positions of the order (`UnplacedBlocks::furthest`). The first
    /// block of the order is where a pass starts (the embedding rows precede it).
    fn furthest_unplaced(
        &self,
        graph: &ModelGraph,
        progress: &Progress,
    ) -> Option<(BlockRef, f64)> {
        if self.unplaced.is_empty() {
            return None;
        }
        let order = graph.order();
        let to_next_pass = match order.len() {
            0 => 0.0,
            len => f64::from(order.distance(progress.cursor.min(len - 1), 0)),
        };
        self.unplaced.furthest(progress.travelled, to_next_pass)
    }

    /// `EvictionPolicy::victim`'s choice, forgotten once chosen.
    fn choose_victim(
        &mut self,
        prediction: &GraphPrediction,
        progress: &mut Progress,
        incoming: BlockRef,
        kind: ReadKind,
    ) -> Option<BlockRef> {
        if let Some((_, &block)) = self.other_regions.first_key_value() {
            self.forget(block, progress);
            return Some(block);
        }
        let cursor = progress.cursor;
        let guard = progress.lag_guard(&prediction.graph);
        let unplaced = self.furthest_unplaced(&prediction.graph, progress);
        // Belady on expectations: the dense block used furthest ahead, or the expert
        // block expected to be used furthest ahead, whichever is further.
        let dense = self.furthest(cursor, guard);
        let expert = self.experts.coldest(&prediction.graph, progress);
        let predicted = match (dense, expert) {
            (Some((dense, distance)), Some((_, expected))) if expected < distance as f64 => {
                Some((dense, distance as f64))
            }
            (_, Some(expert)) => Some(expert),
            (Some((dense, distance)), None) => Some((dense, distance as f64)),
            (None, None) => None,
        };
        let (block, distance) = match (predicted, unplaced) {
            (Some(predicted), Some(unplaced)) if predicted.1 > unplaced.1 => predicted,
            (_, Some(unplaced)) => unplaced,
            (Some(predicted), None) => predicted,
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
                self.forget(block, progress);
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
        self.forget(block, progress);
        Some(block)
    }
}
