//! Policy interfaces: which blocks to read ahead of a fault and which resident blocks to
//! give up when the budget is full.
//!
//! Policies are pure decision logic. The fault service owns all kernel state and calls
//! them with block identities only, so every policy can be unit-tested and replayed by
//! the simulator without userfaultfd or io_uring.
//!
//! What a userfaultfd pager can observe is narrower than what the kernel sees: a block
//! that is resident never faults again, so there is no "access" signal for resident
//! data. `EvictionPolicy::touched` is called on faults only (a demand fault, or a fault
//! that found its block already in flight). An "LRU" built on that signal is really
//! FIFO by first fault, as UMap's is. A policy that needs to know whether a resident
//! block is still in use asks to `watch` it: with zero copy the pager drops the block's
//! page-table entries and keeps its bytes, so the next access costs a minor fault (a
//! round trip through the service, no read), much as the kernel's reclaim samples
//! accessed bits.

use std::path::Path;
use std::sync::Arc;

use crate::geometry::BlockGeometry;

mod fifo;
pub mod graph;
mod lru;
mod per_block;
mod position_set;
mod readahead;
mod recording;

pub use fifo::FifoEviction;
pub use graph::{
    graph_policies, CoActivationSummary, ConfidenceSummary, ExpertWatches, GraphEviction,
    GraphPrediction, GraphPrefetch,
};
pub use lru::{ClockEviction, LruEviction};
pub use readahead::{NoPrefetch, SequentialReadahead};
pub use recording::RecordingEviction;

/// Identifies one region of a pager.
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RegionId(pub u32);

/// Identifies a block: the `index`-th block-sized piece of region `region`, counted from
/// the region's start.
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BlockRef {
    pub region: RegionId,
    pub index: u32,
}

impl BlockRef {
    pub fn new(region: RegionId, index: u32) -> Self {
        Self { region, index }
    }
}

/// What a policy is told about a region when it is added to the pager.
#[derive(Debug, Clone)]
pub struct RegionInfo<'a> {
    pub id: RegionId,
    /// The file the region presents.
    pub path: &'a Path,
    /// How the region cuts its part of the file into blocks.
    pub geometry: BlockGeometry,
    /// The pager's budget, shared with its other regions: how far ahead it is worth
    /// reading before what was read is evicted unused.
    pub budget: u64,
    /// Whether the pager honours `EvictionPolicy::watch` for this region: it can make
    /// the next access to a resident block fault without reading the block again (with
    /// zero copy: the block's page-table entries are dropped, its frame keeps the bytes).
    pub watch_resident: bool,
}

/// Why the pager is looking for room.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum ReadKind {
    /// A thread is waiting on this block: room must be made if any block is evictable.
    Demand,
    /// Speculative: the policy may refuse to evict anything worth more than the incoming
    /// block.
    Prefetch,
}

/// What a fault found when the service looked up its block.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultOutcome {
    /// The block had to be read: a demand read.
    Missing,
    /// A read of the block (a prefetch, or another thread's demand) was already in flight.
    InFlight,
    /// The block had been read ahead and held back until this fault: a prefetch marker,
    /// installed now. It tells the prefetch policy that the program reached this point.
    Staged,
    /// The block was already installed (the fault raced with the install).
    Resident,
}

/// When a prefetched block is installed.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Install {
    /// As soon as its read completes.
    Eager,
    /// Held back (staged) until the program faults on it. A resident block never faults
    /// again, so without such markers a prefetch policy would hear nothing from a
    /// program that runs entirely on prefetched data, and would stop reading ahead: the
    /// same reason the kernel marks one page of each readahead window `PG_readahead`.
    OnFault,
}

/// How urgently a prefetched block is wanted, and what it may displace.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Urgency {
    /// Needed soon: read within the prefetch share of the device, evicting what the
    /// eviction policy says is worth less.
    Ahead,
    /// Worth holding, not needed at any known time (a popular expert not yet read):
    /// read only while the device has nothing else to do, and only into budget nothing
    /// holds. It never evicts and never delays a read the program waits on by more
    /// than one read already on the device.
    IdleFill,
}

/// One block a prefetch policy asks for.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct PrefetchRequest {
    pub block: BlockRef,
    pub install: Install,
    pub urgency: Urgency,
}

impl PrefetchRequest {
    pub fn eager(block: BlockRef) -> Self {
        Self {
            block,
            install: Install::Eager,
            urgency: Urgency::Ahead,
        }
    }

    pub fn marker(block: BlockRef) -> Self {
        Self {
            block,
            install: Install::OnFault,
            urgency: Urgency::Ahead,
        }
    }

    /// A block to read into free budget while the device idles (`Urgency::IdleFill`).
    pub fn idle_fill(block: BlockRef) -> Self {
        Self {
            block,
            install: Install::Eager,
            urgency: Urgency::IdleFill,
        }
    }
}

/// One fault, as policies see it.
#[derive(Copy, Clone, Debug)]
pub struct FaultEvent {
    pub block: BlockRef,
    /// Monotonic time of the fault in nanoseconds since the pager started.
    pub time_ns: u64,
    pub outcome: FaultOutcome,
    /// Where in the block the faulting byte lies, when known: which of the pieces of a
    /// block shared by several (an expert's slice and its neighbour's) is in use.
    pub offset_in_block: Option<u32>,
}

/// Program hints about how a range will be accessed (`madvise`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum AccessHint {
    Normal,
    Sequential,
    Random,
}

/// Decides which blocks to read ahead of a fault.
pub trait PrefetchPolicy: Send {
    fn name(&self) -> &'static str;

    fn region_added(&mut self, _info: &RegionInfo<'_>) {}

    fn region_removed(&mut self, _region: RegionId) {}

    /// The pager's budget is `budget` now (`Pager::set_budget`): a policy whose
    /// lookahead is sized by the budget (`RegionInfo::budget`) resizes it, so that what
    /// it reads ahead still fits beside what stays resident. Called after the service
    /// has evicted down to the new budget.
    fn budget_changed(&mut self, _budget: u64) {}

    /// Appends to `out` the blocks worth reading after this fault, most urgent first.
    /// The service skips blocks already resident or in flight, reads the rest in order,
    /// and stops early when the queue is full or the eviction policy finds nothing worth
    /// evicting for the next one. Called for every fault, whatever its outcome. A policy
    /// that wants to hear from the program again before it has used up what was read
    /// ahead marks a block `Install::OnFault`.
    fn plan(&mut self, fault: &FaultEvent, out: &mut Vec<PrefetchRequest>);

    /// A read finished: `bytes` took `elapsed_ns` from submission to completion. Lets a
    /// policy size its lookahead to the measured bandwidth.
    fn read_completed(&mut self, _block: BlockRef, _bytes: u64, _elapsed_ns: u64) {}

    /// Most bytes of this policy's reads the device should have at once; `None`: as
    /// many as the queue depth allows. A deep queue keeps the device busy; a shallow one
    /// delivers the block needed first sooner (a virtual disk may complete its whole
    /// queue together), which pays when the program computes between reads.
    fn device_bytes(&self) -> Option<u64> {
        None
    }

    fn hint(&mut self, _region: RegionId, _blocks: std::ops::Range<u32>, _hint: AccessHint) {}

    /// For a policy that follows a prediction: how often the program landed where it
    /// said, and where the policy has stopped reading ahead because it did not.
    fn confidence(&self) -> Option<ConfidenceSummary> {
        None
    }

    /// For a policy that learns which experts of a mixture run together: how well
    /// that predicts the next layer's.
    fn co_activation(&self) -> Option<CoActivationSummary> {
        None
    }

    /// For a policy that estimates a mixture of experts' next token from recency and
    /// frequency: the weight it has learned to give recency (0 to 1, mean over layers).
    fn expert_recency(&self) -> Option<f64> {
        None
    }

    /// For a policy that watches resident experts' blocks to see them used: how many it
    /// watched and saw used.
    fn expert_watches(&self) -> Option<ExpertWatches> {
        None
    }
}

/// Ranks resident blocks for eviction.
///
/// The service tells the policy about every evictable resident block (`inserted`) and
/// every block that stops being one (`removed`: evicted, dropped by a hint, pinned, or its
/// region unmapped). Pinned and in-flight blocks are never offered.
pub trait EvictionPolicy: Send {
    fn name(&self) -> &'static str;

    fn region_added(&mut self, _info: &RegionInfo<'_>) {}

    /// The region is gone; forget all of its blocks (no `removed` calls follow).
    fn region_removed(&mut self, region: RegionId);

    /// The pager's budget is `budget` now (`Pager::set_budget`): a policy that ranks
    /// blocks by what the budget holds (`RegionInfo::budget`) ranks them again. Called
    /// before the service evicts down to a smaller budget, so that it evicts by the new
    /// ranking.
    fn budget_changed(&mut self, _budget: u64) {}

    /// `block` is resident and evictable.
    fn inserted(&mut self, block: BlockRef);

    /// `block` is no longer resident or no longer evictable.
    fn removed(&mut self, block: BlockRef);

    /// A fault touched `block` (whatever its state).
    fn touched(&mut self, _fault: &FaultEvent) {}

    /// Resident blocks whose next access the policy wants to hear of: each is appended
    /// to `out`, and its next access is a fault with outcome `Resident` (then the block
    /// is mapped again and watched no more). Called after every fault, once the
    /// policies have heard of it; only where `RegionInfo::watch_resident` is set, and
    /// only with blocks the policy tracks (resident and evictable). A watched block that
    /// is evicted or dropped is watched no more.
    fn watch(&mut self, _out: &mut Vec<BlockRef>) {}

    /// Chooses one tracked block to evict so that `incoming` can be read. The block is
    /// treated as removed once returned (the service does not call `removed` for it).
    /// For `ReadKind::Demand` the policy must return a block whenever it tracks any;
    /// for `ReadKind::Prefetch` it returns `None` when every tracked block is worth
    /// more than `incoming` (e.g. will be used sooner).
    fn victim(&mut self, incoming: BlockRef, kind: ReadKind) -> Option<BlockRef>;
}

/// Policies by name, for the CLI and the shim's configuration.
#[derive(Copy, Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PrefetchKind {
    /// Read only what faults.
    None,
    /// Read the blocks following a fault, growing the window while faults stay sequential.
    Readahead,
    /// Read ahead along the model graph's predicted order (with no graph of the file,
    /// nothing is read ahead).
    Graph,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EvictionKind {
    /// Evict in the order blocks became resident.
    Fifo,
    /// Evict the block used least recently (in the pager: faulted least recently).
    Lru,
    /// Second chance (in the pager: reference bits set by faults only).
    Clock,
    /// Evict the block whose predicted next use is furthest (with no graph of the file,
    /// in the order blocks became resident).
    Graph,
}

impl PrefetchKind {
    /// Builds the policy; `Graph` without a graph predicts nothing (use `build_with`).
    pub fn build(self) -> Box<dyn PrefetchPolicy> {
        self.build_with(None)
    }

    /// Builds the policy; graph policies follow `prediction`. Give the prefetch and
    /// eviction policies the same prediction so they share the current position.
    pub fn build_with(self, prediction: Option<&Arc<GraphPrediction>>) -> Box<dyn PrefetchPolicy> {
        match self {
            PrefetchKind::None => Box::new(NoPrefetch),
            PrefetchKind::Readahead => Box::new(SequentialReadahead::default()),
            PrefetchKind::Graph => Box::new(GraphPrefetch::new(
                prediction.cloned().unwrap_or_else(GraphPrediction::empty),
            )),
        }
    }
}

impl EvictionKind {
    /// Builds the policy; `Graph` without a graph evicts like FIFO (use `build_with`).
    pub fn build(self) -> Box<dyn EvictionPolicy> {
        self.build_with(None)
    }

    /// Builds the policy; graph policies follow `prediction` (see `PrefetchKind`).
    pub fn build_with(self, prediction: Option<&Arc<GraphPrediction>>) -> Box<dyn EvictionPolicy> {
        match self {
            EvictionKind::Fifo => Box::new(FifoEviction::default()),
            EvictionKind::Lru => Box::new(LruEviction::default()),
            EvictionKind::Clock => Box::new(ClockEviction::default()),
            EvictionKind::Graph => Box::new(GraphEviction::new(
                prediction.cloned().unwrap_or_else(GraphPrediction::empty),
            )),
        }
    }
}
