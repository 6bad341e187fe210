//! The simulator: replays a block-access sequence against a budget with the same policy
//! trait objects the pager's fault service drives, and counts what would be read.
//!
//! It models the pager as the policies see it: a resident set within the budget; an
//! access to a missing block is a demand fault (room made with `victim(.., Demand)`);
//! after every fault the prefetch policy plans, and each planned block is read only if
//! `victim(.., Prefetch)` makes room for it; a block planned `Install::OnFault` is staged
//! and its first access is a `Staged` fault the policies hear of. Accesses to resident
//! blocks are silent, as in the pager, unless the policy is one of the every-access
//! baselines (LRU, CLOCK, Belady), which are told of every access, or the block is one
//! the eviction policy asked to watch: its next access is a `Resident` fault, as with the
//! launcher's zero-copy frames (see `EvictionPolicy::watch`).
//!
//! Time is simulated only to feed the policies' rate estimates: the program consumes
//! blocks at a fixed rate and every read takes a fixed latency plus its transfer time.
//! Reads complete at once (no in-flight state), which is optimistic about latency but
//! exact about bytes read, the figure this simulator is for.

mod belady;
mod frequency;
pub mod llama;
pub mod moe;
pub mod router;
mod text;
mod workload;

use std::path::Path;
use std::sync::Arc;

use thiserror::Error;

pub use belady::BeladyEviction;
pub use frequency::{FrequencyEviction, OnlineFrequencyEviction};
pub use workload::Workload;

use hyperoffload::geometry::BlockGeometry;
use hyperoffload::graph::ModelGraph;
use hyperoffload::policy::{
    BlockRef, ClockEviction, EvictionPolicy, FaultEvent, FaultOutcome, FifoEviction,
    GraphPrediction, Install, LruEviction, NoPrefetch, PrefetchKind, PrefetchPolicy,
    PrefetchRequest, ReadKind, RegionId, RegionInfo, Urgency,
};

#[derive(Debug, Error, PartialEq, Eq)]
pub enum SimError {
    #[error("the {0} policy needs a model graph")]
    NeedsGraph(&'static str),
    #[error("the eviction policy chose block {0}, which is not resident")]
    VictimNotResident(u32),
}

/// The simulated clock.
#[derive(Copy, Clone, Debug)]
pub struct Timing {
    /// How fast the program works through its blocks when they are resident.
    pub consume_bytes_per_s: f64,
    pub read_bytes_per_s: f64,
    pub read_latency_ns: u64,
}

impl Default for Timing {
    /// Roughly this project's machines: a CPU decoder consuming 4 GB/s of weights, an
    /// NVMe disk with 2.4 GB/s at depth and 100 us per request.
    fn default() -> Self {
        Self {
            consume_bytes_per_s: 4e9,
            read_bytes_per_s: 2.4e9,
            read_latency_ns: 100_000,
        }
    }
}

/// What a replay read.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct SimReport {
    pub policy: String,
    pub prefetch: String,
    pub budget_bytes: u64,
    pub accesses: u64,
    pub bytes_read: u64,
    /// Accesses that found their block missing.
    pub demand_misses: u64,
    pub demand_bytes: u64,
    pub prefetched_blocks: u64,
    pub prefetch_bytes: u64,
    /// Prefetched blocks evicted before any access.
    pub wasted_prefetch_blocks: u64,
    /// Accesses to watched resident blocks: faults that read nothing.
    pub watch_faults: u64,
    /// Bytes read during each token (empty without token boundaries).
    pub bytes_per_token: Vec<u64>,
}

impl SimReport {
    /// Mean bytes read per token from token `first` on (`None` if there are none).
    pub fn bytes_per_token_from(&self, first: usize) -> Option<f64> {
        let tokens = self
            .bytes_per_token
            .get(first..)
            .filter(|t| !t.is_empty())?;
        Some(tokens.iter().sum::<u64>() as f64 / tokens.len() as f64)
    }

    /// Mean bytes read per token after the first (which starts cold), or over all
    /// `tokens` when boundaries are unknown.
    pub fn steady_bytes_per_token(&self, tokens: Option<u64>) -> Option<f64> {
        match self.bytes_per_token.len() {
            0 => tokens
                .filter(|&t| t > 0)
                .map(|t| self.bytes_read as f64 / t as f64),
            1 => Some(self.bytes_per_token[0] as f64),
            n => Some(self.bytes_per_token[1..].iter().sum::<u64>() as f64 / (n - 1) as f64),
        }
    }
}

#[derive(Copy, Clone, PartialEq, Eq)]
enum State {
    Absent,
    Resident,
    /// Read ahead, held until its first access.
    Staged,
}

/// Replays `workload` against `budget_bytes` with the given policies. `every_access`
/// tells the eviction policy of every access (the simulator-only mode of the LRU, CLOCK
/// and Belady baselines), not just of faults. `watch_resident` honours the eviction
/// policy's `watch` requests, as the pager does with zero copy.
pub fn replay(
    workload: &Workload,
    budget_bytes: u64,
    prefetch: &mut dyn PrefetchPolicy,
    eviction: &mut dyn EvictionPolicy,
    every_access: bool,
    watch_resident: bool,
    timing: Timing,
) -> Result<SimReport, SimError> {
    let layout = workload.layout.clone();
    let region = RegionId(0);
    let info = RegionInfo {
        id: region,
        path: Path::new("<simulated>"),
        geometry: layout.clone(),
        budget: budget_bytes,
        watch_resident,
    };
    prefetch.region_added(&info);
    eviction.region_added(&info);

    let mut replay = Replay {
        layout: layout.clone(),
        budget_bytes,
        timing,
        every_access,
        states: vec![State::Absent; layout.block_count() as usize],
        watched: vec![false; layout.block_count() as usize],
        resident_bytes: 0,
        report: SimReport {
            policy: eviction.name().into(),
            prefetch: prefetch.name().into(),
            budget_bytes,
            accesses: workload.accesses.len() as u64,
            bytes_read: 0,
            demand_misses: 0,
            demand_bytes: 0,
            prefetched_blocks: 0,
            prefetch_bytes: 0,
            wasted_prefetch_blocks: 0,
            watch_faults: 0,
            bytes_per_token: Vec::new(),
        },
    };
    let mut tokens = TokenBytes::default();
    let mut watch = Vec::new();
    let mut now_ns = 0f64;
    let mut requests = Vec::new();
    for (i, &index) in workload.accesses.iter().enumerate() {
        tokens.at_access(i, &workload.token_starts, &mut replay.report);
        if index >= layout.block_count() {
            continue;
        }
        let block = BlockRef::new(region, index);
        let offset_in_block = workload.offsets.get(i).copied();
        now_ns += layout.block_len(index) as f64 / timing.consume_bytes_per_s * 1e9;
        let Some(outcome) = replay.fault_outcome(eviction, block, now_ns as u64, offset_in_block)
        else {
            continue;
        };
        let fault = FaultEvent {
            block,
            time_ns: now_ns as u64,
            outcome,
            offset_in_block,
        };
        eviction.touched(&fault);
        requests.clear();
        prefetch.plan(&fault, &mut requests);
        replay.serve_fault(prefetch, eviction, block)?;
        replay.read_ahead(prefetch, eviction, &requests)?;
        if watch_resident {
            replay.mark_watched(eviction, &mut watch);
        }
    }
    tokens.finish(&mut replay.report);
    Ok(replay.report)
}

/// Bytes read per token, closed at each token's first access.
#[derive(Default)]
struct TokenBytes {
    next_token: usize,
    token_start_bytes: u64,
}

impl TokenBytes {
    /// Before access `i`: closes the token ending there, if one starts at `i`.
    fn at_access(&mut self, i: usize, token_starts: &[usize], report: &mut SimReport) {
        while token_starts.get(self.next_token) == Some(&i) {
            if self.next_token > 0 {
                let read = report.bytes_read - self.token_start_bytes;
                report.bytes_per_token.push(read);
            }
            self.token_start_bytes = report.bytes_read;
            self.next_token += 1;
        }
    }

    /// Closes the last token.
    fn finish(&self, report: &mut SimReport) {
        if self.next_token > 0 {
            let read = report.bytes_read - self.token_start_bytes;
            report.bytes_per_token.push(read);
        }
    }
}

struct Replay {
    layout: BlockGeometry,
    budget_bytes: u64,
    timing: Timing,
    /// The eviction policy hears of every access, not only faults.
    every_access: bool,
    states: Vec<State>,
    /// Per block: watched at the eviction policy's request (meaningful while resident).
    watched: Vec<bool>,
    resident_bytes: u64,
    report: SimReport,
}

impl Replay {
    /// What an access to `block` is to the policies: a fault and its outcome, or None
    /// for an access to a resident block the pager would not see (which every-access
    /// baselines are told of here).
    fn fault_outcome(
        &mut self,
        eviction: &mut dyn EvictionPolicy,
        block: BlockRef,
        time_ns: u64,
        offset_in_block: Option<u32>,
    ) -> Option<FaultOutcome> {
        let index = block.index as usize;
        let watched = std::mem::take(&mut self.watched[index]);
        match self.states[index] {
            State::Resident if watched => {
                self.report.watch_faults += 1;
                Some(FaultOutcome::Resident)
            }
            State::Resident => {
                if self.every_access {
                    eviction.touched(&FaultEvent {
                        block,
                        time_ns,
                        outcome: FaultOutcome::Resident,
                        offset_in_block,
                    });
                }
                None
            }
            State::Staged => Some(FaultOutcome::Staged),
            State::Absent => Some(FaultOutcome::Missing),
        }
    }

    /// Makes the faulting block resident: a staged block is installed, a missing one
    /// read on demand.
    fn serve_fault(
        &mut self,
        prefetch: &mut dyn PrefetchPolicy,
        eviction: &mut dyn EvictionPolicy,
        block: BlockRef,
    ) -> Result<(), SimError> {
        let index = block.index as usize;
        match self.states[index] {
            State::Staged => self.states[index] = State::Resident,
            State::Resident => {}
            State::Absent => {
                self.make_room(eviction, block, ReadKind::Demand)?;
                self.read(prefetch, eviction, block, Install::Eager);
                self.report.demand_misses += 1;
                self.report.demand_bytes += self.layout.block_len(block.index);
            }
        }
        Ok(())
    }

    /// Reads the planned blocks that are missing, in order, until one finds no room.
    fn read_ahead(
        &mut self,
        prefetch: &mut dyn PrefetchPolicy,
        eviction: &mut dyn EvictionPolicy,
        requests: &[PrefetchRequest],
    ) -> Result<(), SimError> {
        for &PrefetchRequest {
            block,
            install,
            urgency,
        } in requests
        {
            let wanted = block.region == RegionId(0)
                && self.states.get(block.index as usize) == Some(&State::Absent);
            if !wanted {
                continue;
            }
            match urgency {
                // As the service: only into budget nothing holds. (The replay has no
                // clock, so the device is always idle for these.)
                Urgency::IdleFill => {
                    if self.resident_bytes + self.layout.block_len(block.index) > self.budget_bytes
                    {
                        continue;
                    }
                }
                Urgency::Ahead => {
                    if !self.make_room(eviction, block, ReadKind::Prefetch)? {
                        break;
                    }
                }
            }
            self.read(prefetch, eviction, block, install);
            self.report.prefetched_blocks += 1;
            self.report.prefetch_bytes += self.layout.block_len(block.index);
        }
        Ok(())
    }

    /// Marks the resident blocks the eviction policy asks to watch: their next access
    /// faults.
    fn mark_watched(&mut self, eviction: &mut dyn EvictionPolicy, watch: &mut Vec<BlockRef>) {
        watch.clear();
        eviction.watch(watch);
        for block in watch.iter() {
            if self.states.get(block.index as usize) == Some(&State::Resident) {
                self.watched[block.index as usize] = true;
            }
        }
    }

    /// Evicts until `incoming` fits. False when a prefetch is refused; a demand read
    /// proceeds over budget only when nothing at all is evictable.
    fn make_room(
        &mut self,
        eviction: &mut dyn EvictionPolicy,
        incoming: BlockRef,
        kind: ReadKind,
    ) -> Result<bool, SimError> {
        let len = self.layout.block_len(incoming.index);
        while self.resident_bytes + len > self.budget_bytes {
            let Some(victim) = eviction.victim(incoming, kind) else {
                return Ok(kind == ReadKind::Demand);
            };
            let state = self
                .states
                .get_mut(victim.index as usize)
                .filter(|s| **s != State::Absent && victim.region == incoming.region)
                .ok_or(SimError::VictimNotResident(victim.index))?;
            if *state == State::Staged {
                self.report.wasted_prefetch_blocks += 1;
            }
            *state = State::Absent;
            self.watched[victim.index as usize] = false;
            self.resident_bytes -= self.layout.block_len(victim.index);
        }
        Ok(true)
    }

    fn read(
        &mut self,
        prefetch: &mut dyn PrefetchPolicy,
        eviction: &mut dyn EvictionPolicy,
        block: BlockRef,
        install: Install,
    ) {
        let len = self.layout.block_len(block.index);
        self.report.bytes_read += len;
        self.resident_bytes += len;
        let elapsed =
            self.timing.read_latency_ns as f64 + len as f64 / self.timing.read_bytes_per_s * 1e9;
        prefetch.read_completed(block, len, elapsed as u64);
        self.states[block.index as usize] = match install {
            Install::Eager => State::Resident,
            Install::OnFault => State::Staged,
        };
        eviction.inserted(block);
    }
}

/// The policies the simulator compares.
#[derive(Copy, Clone, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SimPolicy {
    /// Graph prefetch and graph eviction over one prediction.
    Graph,
    Lru,
    Clock,
    Fifo,
    /// The offline optimum, demand reads only: the floor.
    Belady,
    /// Offline: evict the block the whole sequence uses least, demand reads only. The
    /// floor for a policy that learns how often blocks are used but cannot foresee the
    /// sequence (exact when accesses are drawn independently, as routed experts nearly
    /// are).
    Frequency,
    /// Online: evict the block accessed least often so far (the least recent among
    /// equals), hearing of every access. `frequency` with the counts learned as the
    /// sequence goes: what learning them costs any policy without the counts in advance.
    Lfu,
}

impl SimPolicy {
    pub fn name(self) -> &'static str {
        match self {
            SimPolicy::Graph => "graph",
            SimPolicy::Lru => "lru",
            SimPolicy::Clock => "clock",
            SimPolicy::Fifo => "fifo",
            SimPolicy::Belady => "belady",
            SimPolicy::Frequency => "frequency",
            SimPolicy::Lfu => "lfu",
        }
    }
}

/// Replays `workload` with `policy`. `prefetch` overrides the prefetch policy (default:
/// graph prefetch for `Graph`, none for the others); graph policies need `graph`.
pub fn simulate(
    workload: &Workload,
    budget_bytes: u64,
    policy: SimPolicy,
    prefetch: Option<PrefetchKind>,
    graph: Option<&Arc<ModelGraph>>,
    timing: Timing,
) -> Result<SimReport, SimError> {
    let prediction = graph.map(|g| GraphPrediction::new(Arc::clone(g)));
    let wants_graph = policy == SimPolicy::Graph || prefetch == Some(PrefetchKind::Graph);
    if wants_graph && prediction.is_none() {
        return Err(SimError::NeedsGraph(policy.name()));
    }
    let mut prefetcher: Box<dyn PrefetchPolicy> = match (prefetch, policy) {
        (Some(kind), _) => kind.build_with(prediction.as_ref()),
        (None, SimPolicy::Graph) => PrefetchKind::Graph.build_with(prediction.as_ref()),
        (None, _) => Box::new(NoPrefetch),
    };
    let (mut evictor, every_access): (Box<dyn EvictionPolicy>, bool) = match policy {
        SimPolicy::Graph => (
            hyperoffload::policy::EvictionKind::Graph.build_with(prediction.as_ref()),
            false,
        ),
        SimPolicy::Lru => (Box::new(LruEviction::default()), true),
        SimPolicy::Clock => (Box::new(ClockEviction::default()), true),
        SimPolicy::Fifo => (Box::new(FifoEviction::default()), false),
        SimPolicy::Belady => (Box::new(BeladyEviction::new(&workload.accesses)), true),
        SimPolicy::Frequency => (Box::new(FrequencyEviction::new(&workload.accesses)), true),
        SimPolicy::Lfu => (Box::new(OnlineFrequencyEviction::default()), true),
    };
    // The pager's own policies are modelled as the launcher runs them: zero copy, so
    // their watch requests are honoured.
    replay(
        workload,
        budget_bytes,
        prefetcher.as_mut(),
        evictor.as_mut(),
        every_access,
        !every_access,
        timing,
    )
}

#[cfg(test)]
mod tests;
