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
#[cfg(test)]
pub mod moe;
mod workload;

use std::path::Path;
use std::sync::Arc;

use thiserror::Error;

pub use belady::BeladyEviction;
pub use frequency::FrequencyEviction;
pub use workload::Workload;

use hyperoffload::graph::{BlockLayout, ModelGraph};
use hyperoffload::policy::{
    BlockRef, ClockEviction, EvictionPolicy, FaultEvent, FaultOutcome, FifoEviction,
    GraphPrediction, Install, LruEviction, NoPrefetch, PrefetchKind, PrefetchPolicy,
    PrefetchRequest, ReadKind, RegionId, RegionInfo,
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
    let layout = workload.layout;
    let region = RegionId(0);
    let info = RegionInfo {
        id: region,
        path: Path::new("<simulated>"),
        file_offset: layout.file_offset,
        data_len: layout.data_len,
        block_size: layout.block_size,
        block_count: layout.block_count(),
        budget: budget_bytes,
        watch_resident,
    };
    prefetch.region_added(&info);
    eviction.region_added(&info);

    let mut replay = Replay {
        layout,
        budget_bytes,
        timing,
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
    let mut watch = Vec::new();
    let mut now_ns = 0f64;
    let mut requests = Vec::new();
    let mut next_token = 0;
    let mut token_start_bytes = 0;
    for (i, &index) in workload.accesses.iter().enumerate() {
        while workload.token_starts.get(next_token) == Some(&i) {
            if next_token > 0 {
                let read = replay.report.bytes_read - token_start_bytes;
                replay.report.bytes_per_token.push(read);
            }
            token_start_bytes = replay.report.bytes_read;
            next_token += 1;
        }
        if index >= layout.block_count() {
            continue;
        }
        let block = BlockRef::new(region, index);
        let offset_in_block = workload.offsets.get(i).copied();
        now_ns += layout.block_len(index) as f64 / timing.consume_bytes_per_s * 1e9;
        let state = replay.states[index as usize];
        let watched = std::mem::take(&mut replay.watched[index as usize]);
        let outcome = match state {
            State::Resident if watched => {
                replay.report.watch_faults += 1;
                FaultOutcome::Resident
            }
            State::Resident => {
                if every_access {
                    eviction.touched(&FaultEvent {
                        block,
                        time_ns: now_ns as u64,
                        outcome: FaultOutcome::Resident,
                        offset_in_block,
                    });
                }
                continue;
            }
            State::Staged => FaultOutcome::Staged,
            State::Absent => FaultOutcome::Missing,
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
        match state {
            State::Staged => replay.states[index as usize] = State::Resident,
            State::Resident => {}
            State::Absent => {
                replay.make_room(eviction, block, ReadKind::Demand)?;
                replay.read(prefetch, eviction, block, Install::Eager);
                replay.report.demand_misses += 1;
                replay.report.demand_bytes += layout.block_len(index);
            }
        }
        for &PrefetchRequest { block, install } in &requests {
            let wanted = block.region == region
                && replay.states.get(block.index as usize) == Some(&State::Absent);
            if !wanted {
                continue;
            }
            if !replay.make_room(eviction, block, ReadKind::Prefetch)? {
                break;
            }
            replay.read(prefetch, eviction, block, install);
            replay.report.prefetched_blocks += 1;
            replay.report.prefetch_bytes += layout.block_len(block.index);
        }
        if watch_resident {
            watch.clear();
            eviction.watch(&mut watch);
            for block in &watch {
                if replay.states.get(block.index as usize) == Some(&State::Resident) {
                    replay.watched[block.index as usize] = true;
                }
            }
        }
    }
    if next_token > 0 {
        let read = replay.report.bytes_read - token_start_bytes;
        replay.report.bytes_per_token.push(read);
    }
    Ok(replay.report)
}

struct Replay {
    layout: BlockLayout,
    budget_bytes: u64,
    timing: Timing,
    states: Vec<State>,
    /// Per block: watched at the eviction policy's request (meaningful while resident).
    watched: Vec<bool>,
    resident_bytes: u64,
    report: SimReport,
}

impl Replay {
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
