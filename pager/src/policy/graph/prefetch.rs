//! `GraphPrefetch`: keeps the bytes the prediction says come next in flight, enough to
//! cover the time until they are used.

use std::sync::Arc;

use super::co_activation::CoActivationSummary;
use super::confidence::{ConfidenceSummary, Planned};
use super::idle_fill::IdleFill;
use super::{is_routed_expert, progress_steps, ExpertWatches, GraphPrediction, Progress};
use crate::graph::{CyclicOrder, ModelGraph};
use crate::policy::{BlockRef, FaultEvent, PrefetchPolicy, PrefetchRequest, RegionId, RegionInfo};

/// Prefetch along the predicted order.
pub struct GraphPrefetch {
    pub(super) prediction: Arc<GraphPrediction>,
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
    /// The initial and most lookahead as configured, before any budget bounded them:
    /// what a budget that grows back restores.
    configured: Option<(u64, u64)>,
    /// The budget the prediction's streamed set was chosen for (at the latest region
    /// bound).
    plan_budget: Option<u64>,
    /// Which routed experts to read into free budget next.
    idle_fill: IdleFill,
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
            configured: None,
            plan_budget: None,
            idle_fill: IdleFill::default(),
            prediction,
        }
    }

    /// Bounds the lookahead for `budget`, from the limits as configured: a smaller budget lowers them, a larger one raises them back.
    fn fit_to_budget(&mut self, budget: u64) {
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
        let (initial, max) = *self
            .configured
            .get_or_insert((self.initial_lookahead_bytes, self.max_lookahead_bytes));
        let plan_window = self.prediction.lock().stream.window_bytes;
        let streamed = self
            .prediction
            .graph()
            .predicted_bytes()
            .saturating_sub(budget);
        let proportional = match streamed {
            0 => budget / 8,
            streamed => (budget / 8).min(streamed / 8).min(STREAM_LOOKAHEAD_MAX),
        };
        let cap = match (plan_window, self.plan_budget) {
            (0, _) => proportional,
            // The spread set was chosen for a budget this one reaches: its window.
            (window, Some(planned)) if budget >= planned => window,
            // Below that budget the set streams less than must be read: never more
            // than the window, nor than a budget this small gives room for.
            (window, _) => window.min(proportional),
        };
        self.max_lookahead_bytes = max.min(cap.max(self.min_lookahead_bytes));
        self.initial_lookahead_bytes = initial.min(self.max_lookahead_bytes);
    }

    /// Sizes the lookahead and the device bound for the streamed set chosen for
    /// `budget`.
    fn follow_plan(&mut self, budget: u64) {
        self.plan_budget = Some(budget);
        self.fit_to_budget(budget);
        let plan_window = self.prediction.lock().stream.window_bytes;
        self.device_bytes = (plan_window > 0).then_some(super::streaming::STREAM_DEVICE_BYTES);
    }

    /// Asks for the routed experts most likely to run that are not resident, to be read
    /// into free budget while the device idles (`idle_fill`): not once the budget has
    /// filled (`Progress::budget_filled`), where what the fill reads into the room a
    /// victim or a token without misses leaves is evicted again for the program's next
    /// reads. Measured with `simulate` on demand traces: on 128 tokens at 25 %, asking
    /// while the budget evicted read 42.1 against 35.0 MiB per token on gpt-oss 16x2,
    /// 48.8 against 41.2 on deepseek2 16x2, 80.8 against 74.1 on qwen3moe 64x8; on 512
    /// tokens at 50 %, asking again once a token had passed without an eviction read
    /// 7.09 against 6.93 on gpt-oss 32x4 and 4.41 against 4.33 on qwen3moe 128x8.
    fn ask_idle_fill(
        &mut self,
        graph: &ModelGraph,
        progress: &Progress,
        region: RegionId,
        out: &mut Vec<PrefetchRequest>,
    ) {
        let experts = graph.experts();
        if experts.is_empty() || progress.budget_filled() {
            return;
        }
        let groups = (self.idle_fill).next_groups(&progress.experts, experts.groups().len());
        ask_for_groups(
            graph,
            progress,
            &groups,
            region,
            PrefetchRequest::idle_fill,
            out,
        );
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
        self.follow_plan(info.budget);
    }

    fn budget_changed(&mut self, budget: u64) {
        // The eviction side chooses the set again too; choosing it twice for one
        // budget gives the same set.
        self.prediction.replan_streaming(budget);
        self.follow_plan(budget);
    }

    fn region_removed(&mut self, region: RegionId) {
        self.prediction.region_removed(region);
    }

    fn read_completed(&mut self, _block: BlockRef, _bytes: u64, elapsed_ns: u64) {
        self.read_ns = ewma(self.read_ns, elapsed_ns as f64);
    }

    fn confidence(&self) -> Option<ConfidenceSummary> {
        Some(self.prediction.confidence())
    }

    fn co_activation(&self) -> Option<CoActivationSummary> {
        self.prediction.co_activation()
    }

    fn expert_recency(&self) -> Option<f64> {
        self.prediction.expert_recency()
    }

    fn expert_watches(&self) -> Option<ExpertWatches> {
        self.prediction.expert_watches()
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
        let mut progress = prediction.lock();
        let region = fault.block.region;
        // A routed expert in use: the rest of its slices (gate, up, down) follow at once.
        let global = progress.global(graph, fault.block);
        let in_use =
            global.and_then(|global| progress.experts_in_use(graph, global, fault.offset_in_block));
        if let (Some(global), Some(groups)) = (global, &in_use) {
            ask_rest_of_experts(graph, &progress, global, groups, region, out);
        }
        let Some(position) = progress.advance(graph, fault) else {
            return;
        };
        self.ask_idle_fill(graph, &progress, region, out);
        if in_use.is_some() {
            speculate(graph, &mut progress, region, out);
        }
        self.follow_progress(graph, position, fault.time_ns);
        let planned = self.ask_along_order(graph, &progress, position, region, out);
        progress.planned = Some(planned);
    }
}

impl GraphPrefetch {
    /// The program is at `position` of the order at `time_ns`: counts the positions it
    /// advanced since the previous fault, and from them its rate of progress.
    fn follow_progress(&mut self, graph: &ModelGraph, position: u32, time_ns: u64) {
        if let Some((last_position, last_ns)) = self.last {
            let steps = progress_steps(graph.order(), last_position, position);
            self.progress_steps += steps;
            if time_ns > last_ns && steps > 0 {
                let bytes = (steps * graph.geometry().block_size) as f64;
                let seconds = (time_ns - last_ns) as f64 * 1e-9;
                self.consume_bytes_per_s = ewma(self.consume_bytes_per_s, bytes / seconds);
            }
        }
        self.last = Some((position, time_ns));
    }

    /// Asks for the blocks the order says come after `position` (the fault's), as far
    /// as the lookahead reaches, in the region `region` where it presents them; returns
    /// where the next fault should land.
    ///
    /// Every block used within the lookahead (`window` positions) must be resident or
    /// in flight. Blocks this policy requested for a position still ahead count
    /// towards the window whether read yet or not. Other resident blocks are the part
    /// of the model kept resident: they do not count, and the walk goes through them
    /// to the blocks after, because the program raises no fault while it runs through
    /// resident blocks, so the next plan would come too late. The first block after
    /// such a stretch is a marker, so the program reports back as it leaves it.
    fn ask_along_order(
        &mut self,
        graph: &ModelGraph,
        progress: &Progress,
        position: u32,
        region: RegionId,
        out: &mut Vec<PrefetchRequest>,
    ) -> Planned {
        let order = graph.order();
        let block_size = graph.geometry().block_size;
        // The fault's block, in the graph's numbering.
        let faulted = order.block_at(position);
        let lookahead = self.lookahead_bytes();
        let window = lookahead.div_ceil(block_size).max(1);
        // Other markers sit at fixed positions (multiples of a power-of-two stride), so
        // successive plans agree on them: a block first requested without a marker is
        // never meant to carry one.
        let stride = prev_power_of_two((window / self.markers_per_window.max(1)).max(1));
        let mut counted = 0u64;
        let mut after_resident_stretch = false;
        let mut reach = order.len() as u64;
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
                reach =
                    step - 1 + resident_run(order, at, |block| progress.resident[block as usize]);
                break;
            }
            // Where the program has not followed the order, reading ahead along it
            // only reads what is evicted unused: demand paging there (`confidence`).
            if resident || self.target[block as usize] == target || progress.confidence.failing(at)
            {
                continue;
            }
            // A part of the model no region presents (not mapped yet, or any more).
            let Some(block_ref) = progress.local(graph, block, region) else {
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
        // The next fault should land within what this plan covered (the window, and
        // the blocks resident after it, which the program runs through without a fault),
        // or one window more: a program briefly ahead of its reads.
        Planned {
            from: position,
            reach: (reach + window).min(u32::MAX as u64) as u32,
        }
    }
}

/// At a fault on `global`, a slice of the routed experts `groups`: asks for the rest of
/// their blocks that are not resident, in the region `region` where it presents them.
fn ask_rest_of_experts(
    graph: &ModelGraph,
    progress: &Progress,
    global: u32,
    groups: &[u32],
    region: RegionId,
    out: &mut Vec<PrefetchRequest>,
) {
    let experts = graph.experts();
    let mut wanted: Vec<u32> = groups
        .iter()
        .flat_map(|&group| experts.group(group).blocks())
        .filter(|&block| block != global && !progress.resident[block as usize])
        .collect();
    wanted.dedup();
    for block in wanted {
        if let Some(block_ref) = progress.local(graph, block, region) {
            out.push(PrefetchRequest::eager(block_ref));
        }
    }
}

/// At an expert fault: the experts of the next layer that co-activation makes likely
/// enough, read ahead of the router (`ExpertUse::speculate`).
fn speculate(
    graph: &ModelGraph,
    progress: &mut Progress,
    region: RegionId,
    out: &mut Vec<PrefetchRequest>,
) {
    let groups = progress.experts.speculate();
    ask_for_groups(
        graph,
        progress,
        &groups,
        region,
        PrefetchRequest::eager,
        out,
    );
}

/// Asks, as `request` makes them, for the routed-expert blocks of `groups` that are
/// not resident, in the region `region` where it presents them.
fn ask_for_groups(
    graph: &ModelGraph,
    progress: &Progress,
    groups: &[u32],
    region: RegionId,
    request: fn(BlockRef) -> PrefetchRequest,
    out: &mut Vec<PrefetchRequest>,
) {
    let experts = graph.experts();
    for &group in groups {
        for block in experts.group(group).blocks() {
            if progress.resident[block as usize] || !is_routed_expert(graph, block) {
                continue;
            }
            if let Some(block_ref) = progress.local(graph, block, region) {
                out.push(request(block_ref));
            }
        }
    }
}

/// How many blocks from position `at` on are resident: the stretch the program runs
/// through without a fault from there (at most the whole order).
fn resident_run(order: &CyclicOrder, at: u32, resident: impl Fn(u32) -> bool) -> u64 {
    let len = order.len() as u64;
    (0..len)
        .take_while(|&step| resident(order.block_at(((at as u64 + step) % len) as u32)))
        .count() as u64
}

fn prev_power_of_two(n: u64) -> u64 {
    1 << (63 - n.max(1).leading_zeros())
}
