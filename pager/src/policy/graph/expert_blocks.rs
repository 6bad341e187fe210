//! The routed-expert blocks the graph eviction policy holds: which goes first, and which
//! are watched so that a resident expert's use is seen.
//!
//! An expert's blocks lie outside the predicted order (a token reads them only when the
//! router picks the expert), so they are ranked by expectation: the block whose expert
//! is expected to be used furthest ahead goes first (`Progress::expected_next_use`,
//! stretched by the tokens since it ran where the run shows recency pays:
//! `eviction_distance`). That expectation is only as good as the use counts
//! (`ExpertUse`), and a wholly resident expert is used without faulting. Where the
//! pager can watch resident blocks, each wholly resident expert has one block watched
//! (its *sentinel*: a block holding only its bytes where it has one), from the time the
//! program has left the expert's layer until its next use, which then costs one fault
//! without a read and is counted. The watch is taken again once the program has left
//! the layer again, so every token of a resident expert is observed.

use std::collections::HashMap;

use super::expert_use::ExpertUse;
use super::{is_routed_expert, Progress};
use crate::graph::ModelGraph;
use crate::policy::BlockRef;

pub(super) struct ExpertBlocks {
    /// Tracked (resident, evictable) expert blocks: the region's block and the graph's.
    tracked: Vec<(BlockRef, u32)>,
    /// Where each tracked block is in `tracked`.
    slot: HashMap<BlockRef, usize>,
    /// Per group: the block whose watch shows its use; `None` where the group has no
    /// block of routed experts only (one it shares with a tensor every token reads).
    sentinels: Vec<Option<u32>>,
    /// Per block of the graph: watched now.
    watched: Vec<bool>,
    /// Wholly resident groups to watch once the program has left their layer.
    pending: Vec<u32>,
    is_pending: Vec<bool>,
    /// Whether watches are asked for: the pager honours them, and the model does not
    /// fit the budget (a model that fits never evicts, so use counts change nothing).
    pub(super) watching: bool,
    /// `coldest`'s scratch: per group, its blocks' expected next use (NaN: not yet
    /// computed in this call), and the groups computed.
    expected_of_group: Vec<f64>,
    expected_known: Vec<u32>,
}

impl ExpertBlocks {
    pub(super) fn new(graph: &ModelGraph) -> Self {
        let experts = graph.experts();
        let sentinels = experts
            .groups()
            .iter()
            .enumerate()
            .map(|(id, group)| {
                let routed: Vec<u32> = group
                    .blocks()
                    .filter(|&block| is_routed_expert(graph, block))
                    .collect();
                let own = routed
                    .iter()
                    .copied()
                    .find(|&block| experts.groups_of(block) == [id as u32]);
                own.or_else(|| routed.first().copied())
            })
            .collect();
        let groups = experts.groups().len();
        Self {
            tracked: Vec::new(),
            slot: HashMap::new(),
            sentinels,
            watched: vec![false; graph.geometry().block_count() as usize],
            pending: Vec::new(),
            is_pending: vec![false; groups],
            watching: false,
            expected_of_group: vec![f64::NAN; groups],
            expected_known: Vec::new(),
        }
    }

    /// `block` (the graph's `global`) became resident and evictable.
    pub(super) fn insert(
        &mut self,
        block: BlockRef,
        global: u32,
        graph: &ModelGraph,
        use_: &mut ExpertUse,
    ) {
        if self.slot.contains_key(&block) {
            return;
        }
        self.slot.insert(block, self.tracked.len());
        self.tracked.push((block, global));
        for &group in graph.experts().groups_of(global) {
            use_.block_changed(group, true);
            if use_.wholly_resident(group) {
                self.queue(group);
            }
        }
    }

    /// `block` is no longer resident or no longer evictable.
    pub(super) fn remove(
        &mut self,
        block: BlockRef,
        global: u32,
        graph: &ModelGraph,
        use_: &mut ExpertUse,
    ) {
        let Some(at) = self.slot.remove(&block) else {
            return;
        };
        self.tracked.swap_remove(at);
        if let Some(&(moved, _)) = self.tracked.get(at) {
            self.slot.insert(moved, at);
        }
        let groups = graph.experts().groups_of(global);
        for &group in groups {
            use_.block_changed(group, false);
        }
        if std::mem::take(&mut self.watched[global as usize]) {
            // Missing now: the group is observed through its missing block instead.
            for &group in groups {
                if self.sentinels[group as usize] == Some(global) {
                    use_.set_watched(group, false, true);
                }
            }
        }
    }

    /// A fault on the graph's block `global` (after `use_` counted the groups it shows
    /// in use): a watched block is watched no more, and its groups are watched again
    /// after their layer. True if it was watched.
    pub(super) fn fault(&mut self, global: u32, graph: &ModelGraph, use_: &mut ExpertUse) -> bool {
        if !std::mem::take(&mut self.watched[global as usize]) {
            return false;
        }
        for &group in graph.experts().groups_of(global) {
            if self.sentinels[group as usize] == Some(global) {
                let seen = use_.used_now(group);
                use_.set_watched(group, false, seen);
                self.queue(group);
            }
        }
        true
    }

    fn queue(&mut self, group: u32) {
        if self.watching && !std::mem::replace(&mut self.is_pending[group as usize], true) {
            self.pending.push(group);
        }
    }

    /// Appends the blocks to watch now: the sentinels of the pending groups outside
    /// the program's current layer, still wholly resident and tracked. `local` gives a
    /// graph block's block in a bound region.
    pub(super) fn watch(
        &mut self,
        use_: &mut ExpertUse,
        local: impl Fn(u32) -> Option<BlockRef>,
        out: &mut Vec<BlockRef>,
    ) {
        if !self.watching || self.pending.is_empty() {
            return;
        }
        let current = use_.current_layer();
        let mut pending = std::mem::take(&mut self.pending);
        pending.retain(|&group| {
            if use_.layer(group) == current {
                return true;
            }
            self.is_pending[group as usize] = false;
            let Some(sentinel) = self.sentinels[group as usize] else {
                return false;
            };
            if !use_.wholly_resident(group) || use_.watched(group) {
                return false;
            }
            let Some(block) = local(sentinel).filter(|block| self.slot.contains_key(block)) else {
                return false;
            };
            if !std::mem::replace(&mut self.watched[sentinel as usize], true) {
                out.push(block);
            }
            use_.set_watched(group, true, true);
            false
        });
        self.pending = pending;
    }

    /// The tracked expert block expected to be used furthest ahead, with that
    /// expectation (`Progress::expected_next_use`). Blocks of an expert the program is
    /// reading now (expected at 0) come last: one is named only when every tracked
    /// block is such, for when a budget smaller than one layer's experts holds nothing
    /// else, where naming none would leave a demand read waiting for room no read in
    /// flight frees. A speculative read never displaces one (it is needed no sooner).
    ///
    /// A block's expectation depends only on its experts, so it is computed once per
    /// expert: a budget holds thousands of blocks of a few hundred experts, and this
    /// runs for every victim.
    pub(super) fn coldest(
        &mut self,
        graph: &ModelGraph,
        progress: &Progress,
    ) -> Option<(BlockRef, f64)> {
        let mut best: Option<(BlockRef, f64)> = None;
        let mut needed_now = None;
        let experts = graph.experts();
        let age_exponent = AGE_EXPONENT * progress.experts.recency_weight();
        for &(block, global) in &self.tracked {
            let expected = match *experts.groups_of(global) {
                [group] => {
                    let known = &mut self.expected_of_group[group as usize];
                    if known.is_nan() {
                        *known = eviction_distance(graph, progress, global, age_exponent);
                        self.expected_known.push(group);
                    }
                    *known
                }
                _ => eviction_distance(graph, progress, global, age_exponent),
            };
            if expected == 0.0 {
                needed_now.get_or_insert((block, expected));
                continue;
            }
            if best.is_none_or(|(_, furthest)| expected > furthest) {
                best = Some((block, expected));
            }
        }
        for group in self.expected_known.drain(..) {
            self.expected_of_group[group as usize] = f64::NAN;
        }
        best.or(needed_now)
    }
}

/// The exponent of an expert's age where the mixture gives recency all the weight.
/// Measured with the simulator's suite (three shapes, both routers, 25/50/75 %, the
/// pager's cut geometry, seed 11), ranking by `expected * (age + 1)^(k * recency)`
/// with `recency` the mixture's weight of recency over all layers: k = 0.5 took the
/// locality rows from 0.85-1.22x LRU to 0.84-1.02x (at most 1.06x on seeds 23 and 37)
/// and cost the independent rows 0-2.8 %. A fixed exponent of 0.25 whatever the weight
/// cost them up to 6.6 %, 1 up to 10 %; each layer's own weight instead of all layers'
/// mean, up to 6 %.
const AGE_EXPONENT: f64 = 0.5;
/// Ages are capped here (tokens): beyond it an expert is as cold as it gets.
const MAX_AGE: u64 = 1 << 20;

/// How far ahead the routed-expert block `global` counts as used next when choosing a
/// victim: its expected next use (`Progress::expected_next_use`), stretched by the
/// tokens since its experts last ran to the power `age_exponent` (`AGE_EXPONENT` times
/// the weight the mixture gives recency, `UseMixture`). The mixture's estimate is made
/// for the next token, and its short memories and age table tell little apart among
/// experts unused for tens of tokens, which are the ones near the eviction boundary:
/// where routing is sticky and popularity drifts, the longer an expert has not run the
/// colder it is likely to have become, and LRU's order of them beats the estimate's.
/// Where the run shows recency pays, the age orders them; where it does not
/// (independent routing), the exponent stays near 0 and the estimate ranks alone.
fn eviction_distance(
    graph: &ModelGraph,
    progress: &Progress,
    global: u32,
    age_exponent: f64,
) -> f64 {
    let expected = progress.expected_next_use(graph, global);
    if expected == 0.0 || !expected.is_finite() {
        return expected;
    }
    let age = graph
        .experts()
        .groups_of(global)
        .iter()
        .map(|&group| progress.experts.tokens_since_use(group))
        .min()
        .unwrap_or(u64::MAX)
        .min(MAX_AGE);
    expected * ((age + 1) as f64).powf(age_exponent)
}
