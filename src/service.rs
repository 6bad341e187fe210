//! The fault service: one thread that turns userfaultfd page faults into io_uring reads
//! and installs what they read, keeping resident bytes within the budget.
//!
//! Everything waits on the ring: multishot polls on the userfaultfd and on the command
//! eventfd complete like reads do, so one `submit_and_wait` covers faults, commands and
//! finished reads. The thread never touches a managed page itself, never takes a lock a
//! faulting thread may hold (it does not print; it locks only its own command queue and
//! stats), and if it fails it aborts the process with a message rather than leave
//! threads waiting on faults forever.
//!
//! Budget accounting is exact: a read reserves its blocks' bytes before it is issued,
//! evicting first if needed, so resident + reserved never exceeds the budget. Evictions
//! are batched per read request (all victims for one request are dropped together, in
//! runs of contiguous blocks).

use std::collections::{HashMap, VecDeque};
use std::ops::Range;
use std::os::fd::AsRawFd;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Instant;

use userfaultfd::{Event, EventBuffer, RegisterMode, Uffd};

use crate::file::BackingFile;
use crate::installer::{install, raise_priority, InstallError, InstallJob, InstallPool, Installed};
use crate::layout::{outside_holes, FaultLocator, Location, RegionLayout};
use crate::pager::{Command, HintError, Shared};
use crate::policy::{
    BlockRef, EvictionPolicy, FaultEvent, FaultOutcome, Install, PrefetchPolicy, PrefetchRequest,
    ReadKind, RegionId, RegionInfo,
};
use crate::recent_faults::RecentFaults;
use crate::ring::{Completion, Landing, ReadRing, RingError};
use crate::shared_store::FrameStore;
use crate::stash::Stash;
use crate::stats::{LatencyHistogram, Stats};
use crate::trace::TraceRecord;
use crate::uffd_ext::{self, Partial};

const TOKEN_UFFD: u32 = 0;
const TOKEN_COMMANDS: u32 = 1;
const TOKEN_INSTALLED: u32 = 2;
/// O_DIRECT needs lengths in multiples of the logical block size; 4096 covers every
/// device we meet.
const DIRECT_IO_ALIGN: u64 = 4096;
/// Most prefetch requests held waiting for a free read slot.
const MAX_QUEUED_PREFETCH: usize = 1 << 16;
/// The stash index of a staged marker whose bytes wait in its frame.
const IN_FRAME: u32 = u32::MAX;
/// A block without a frame.
const NO_FRAME: u32 = u32::MAX;

/// Makes reads overlapping `file_range` fail with `errno` (tests of the error path).
#[derive(Debug, Clone)]
pub(crate) struct ReadInjection {
    pub file_range: Range<u64>,
    pub errno: i32,
}

/// Test-only faults injected into the service (`PagerBuilder::inject_*`).
#[derive(Debug, Clone, Default)]
pub(crate) struct ServiceFaults {
    /// Every read delivers at most half of what it asked for.
    pub short_reads: bool,
    /// Each read completion is handled this late.
    pub read_delay: std::time::Duration,
    /// Panic on fault number n + 1.
    pub panic_after_faults: Option<u64>,
}

pub(crate) struct ServiceConfig {
    pub budget: u64,
    pub block_size: u64,
    pub max_read: u64,
    pub queue_depth: u32,
    pub read_attempts: u32,
    pub page_size: u64,
    pub injection: Option<ReadInjection>,
    /// Most faults kept in the trace; 0 keeps none.
    pub trace_limit: usize,
    /// How long to poll for completions while demand reads are in flight.
    pub demand_spin: std::time::Duration,
    /// Poll only while at least this many demand reads are in flight.
    pub demand_spin_min_reads: u32,
    /// Nice value asked for the service and install threads.
    pub thread_nice: i32,
    /// Why blocks are copied rather than mapped from a store (None: they are mapped).
    pub zero_copy_refused: Option<String>,
    pub faults: ServiceFaults,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum BlockState {
    Missing,
    /// Waiting in the demand or prefetch queue for a read slot.
    Queued,
    Reading,
    /// Read and held in the stash (or in its frame, not mapped) until the
    /// program faults on it (a prefetch marker); its bytes stay reserved in the budget
    /// meanwhile.
    Staged {
        stash: u32,
    },
    Resident,
    /// Its read failed: its pages raise SIGBUS.
    Poisoned,
    /// The program unmapped it: never read or installed again.
    Unmapped,
}

struct RegionEntry {
    base: usize,
    layout: RegionLayout,
    file: BackingFile,
    file_offset: u64,
    blocks: Vec<BlockState>,
    pinned: Vec<bool>,
    /// Reads in flight into this region; a removed region is forgotten when none are.
    reads_in_flight: u32,
    removed: bool,
    /// The open file was modified in place since it was opened: nothing more is read
    /// from it (see `FaultService::file_changed`).
    changed: bool,
    /// Ranges (region offsets) the program unmapped: never installed into or dropped,
    /// since something else may be mapped there now.
    holes: Vec<Range<u64>>,
    /// With zero copy: each block's frame (NO_FRAME if none), else empty.
    frames: Vec<u32>,
    /// With zero copy: whether each resident block is watched (its pages dropped at the
    /// eviction policy's request, its frame kept), else empty. Meaningful only while the
    /// block is resident; cleared when it is installed.
    watched: Vec<bool>,
    /// The program's protection of the region.
    prot: i32,
}

impl RegionEntry {
    /// Whether the program unmapped any of `range` (region offsets).
    fn cuts(&self, range: Range<u64>) -> bool {
        self.holes
            .iter()
            .any(|hole| hole.start < range.end && range.start < hole.end)
    }

    /// The parts of `range` (region offsets) still mapped, as absolute address ranges.
    fn mapped_parts(&self, range: Range<u64>) -> Vec<Range<usize>> {
        let to_addresses = |r: Range<u64>| self.base + r.start as usize..self.base + r.end as usize;
        if self.holes.is_empty() {
            return vec![to_addresses(range)];
        }
        outside_holes(range, &self.holes)
            .into_iter()
            .map(to_addresses)
            .collect()
    }
}

impl RegionEntry {
    fn info(&self, id: RegionId, budget: u64, watch_resident: bool) -> RegionInfo<'_> {
        RegionInfo {
            id,
            path: self.file.path(),
            file_offset: self.file_offset,
            data_len: self.layout.data_len,
            block_size: self.layout.block_size,
            block_count: self.layout.block_count(),
            budget,
            watch_resident,
        }
    }
}

/// A thread waiting on a block.
#[derive(Copy, Clone, Debug)]
struct Waiter {
    t_ns: u64,
    tid: u32,
    outcome: FaultOutcome,
    /// Where in the block the faulting page lies.
    offset_in_block: u32,
}

/// Where each served fault is recorded: the latency histogram, and the trace when one
/// is kept.
struct FaultLog {
    latency: LatencyHistogram,
    trace: Option<Vec<TraceRecord>>,
    trace_limit: usize,
    /// Faults not traced because the trace was full.
    untraced: u64,
}

impl FaultLog {
    /// `waiter`'s thread was woken (or told of an error) at `now`.
    fn served(
        &mut self,
        block: BlockRef,
        file_offset: u64,
        block_size: u64,
        waiter: Waiter,
        now: u64,
    ) {
        let latency_ns = now.saturating_sub(waiter.t_ns);
        self.latency.record_ns(latency_ns);
        if let Some(trace) = &mut self.trace {
            if trace.len() < self.trace_limit {
                trace.push(TraceRecord {
                    t_ns: waiter.t_ns,
                    tid: waiter.tid,
                    region: block.region.0,
                    file_offset,
                    block: block.index,
                    block_size,
                    outcome: waiter.outcome,
                    latency_ns,
                    offset_in_block: Some(waiter.offset_in_block),
                });
            } else {
                self.untraced += 1;
            }
        }
    }
}

/// A read the ring is doing for us.
struct ReadTag {
    region: RegionId,
    first: u32,
    count: u32,
    /// File offset and length of the whole request (length O_DIRECT aligned).
    file_offset: u64,
    len: usize,
    /// Bytes of file data the request must deliver.
    valid: usize,
    /// Bytes received so far (short reads continue).
    done: usize,
    attempts: u32,
    submitted_ns: u64,
    /// Bytes of budget reserved for the blocks.
    reserved: u64,
    install: Install,
    prefetch: bool,
}

pub(crate) struct FaultService {
    config: ServiceConfig,
    uffd: Arc<Uffd>,
    shared: Arc<Shared>,
    ring: ReadRing<ReadTag>,
    prefetch: Box<dyn PrefetchPolicy>,
    eviction: Box<dyn EvictionPolicy>,
    regions: HashMap<RegionId, RegionEntry>,
    locator: FaultLocator,
    demand: VecDeque<BlockRef>,
    prefetch_queue: VecDeque<PrefetchRequest>,
    staged: VecDeque<BlockRef>,
    /// Fault times of threads waiting on each block, for the latency histogram.
    waiters: HashMap<BlockRef, Vec<Waiter>>,
    resident: u64,
    reserved: u64,
    pinned: u64,
    prefetch_reads_in_flight: u32,
    /// Bytes of prefetch reads submitted and not yet completed by the device (a read
    /// completed but not yet installed no longer counts).
    prefetch_bytes_on_device: u64,
    demand_reads_in_flight: u32,
    stats: Stats,
    log: FaultLog,
    read_latency: LatencyHistogram,
    start: Instant,
    last_publish_ns: u64,
    shutting_down: bool,
    events: EventBuffer,
    fault_addrs: Vec<(usize, u32)>,
    plan: Vec<PrefetchRequest>,
    victims: Vec<BlockRef>,
    /// Scratch: blocks the eviction policy asks to watch.
    watch: Vec<BlockRef>,
    /// Scratch for `make_room`: victims the policy named that `recent` spares.
    spared: Vec<BlockRef>,
    /// Each thread's last two blocks, which eviction spares (see `recent_faults`).
    recent: RecentFaults,
    completions: Vec<Completion>,
    /// Worker threads that install prefetched reads (none: all installs on this thread).
    installs: Option<InstallPool>,
    installed: Vec<Installed>,
    /// Finished reads nobody waits for yet, to install once new reads are issued.
    ready: VecDeque<u32>,
    /// The bytes of staged markers.
    stash: Stash,
    /// With zero copy: the frames reads land in and regions map.
    store: Option<FrameStore>,
}

/// Why serving stopped; every one of these ends the process (see `run`).
#[derive(Debug, thiserror::Error)]
enum ServiceError {
    #[error(transparent)]
    Ring(#[from] RingError),
    #[error("reading userfaultfd events failed: {0}")]
    Events(String),
    #[error(transparent)]
    Install(#[from] InstallError),
    #[error("dropping evicted pages at {addr:#x} failed: {error}")]
    Evict { addr: usize, error: std::io::Error },
    #[error("mapping a block's frame at {addr:#x} failed: {error}")]
    MapFrame { addr: usize, error: std::io::Error },
}

impl FaultService {
    pub(crate) fn new(
        config: ServiceConfig,
        uffd: Arc<Uffd>,
        shared: Arc<Shared>,
        prefetch: Box<dyn PrefetchPolicy>,
        eviction: Box<dyn EvictionPolicy>,
        installs: Option<InstallPool>,
        store: Option<FrameStore>,
    ) -> Result<Self, RingError> {
        let ring = ReadRing::new(config.queue_depth, config.max_read as usize)?;
        let stash = Stash::new(
            max_staged(config.queue_depth, config.block_size) as u32,
            config.block_size as usize,
            config.page_size as usize,
        );
        let trace_limit = config.trace_limit;
        let stats = Stats {
            budget_bytes: config.budget,
            block_size: config.block_size,
            queue_depth: config.queue_depth,
            install_threads: installs.as_ref().map_or(0, |pool| pool.threads() as u32),
            direct_io: true,
            zero_copy: store.is_some(),
            zero_copy_refused: config.zero_copy_refused.clone(),
            ..Stats::default()
        };
        Ok(Self {
            config,
            uffd,
            shared,
            ring,
            prefetch,
            eviction,
            regions: HashMap::new(),
            locator: FaultLocator::default(),
            demand: VecDeque::new(),
            prefetch_queue: VecDeque::new(),
            staged: VecDeque::new(),
            waiters: HashMap::new(),
            resident: 0,
            reserved: 0,
            pinned: 0,
            prefetch_reads_in_flight: 0,
            prefetch_bytes_on_device: 0,
            demand_reads_in_flight: 0,
            stats,
            log: FaultLog {
                latency: LatencyHistogram::default(),
                trace: (trace_limit > 0).then(Vec::new),
                trace_limit,
                untraced: 0,
            },
            read_latency: LatencyHistogram::default(),
            start: Instant::now(),
            last_publish_ns: 0,
            shutting_down: false,
            events: EventBuffer::new(64),
            fault_addrs: Vec::new(),
            plan: Vec::new(),
            victims: Vec::new(),
            watch: Vec::new(),
            spared: Vec::new(),
            recent: RecentFaults::default(),
            completions: Vec::new(),
            installs,
            installed: Vec::new(),
            ready: VecDeque::new(),
            stash,
            store,
        })
    }

    /// Serves until shutdown. Any failure ends the process: a thread waiting on a fault
    /// that nobody will serve would otherwise hang forever.
    pub(crate) fn run(mut self) {
        self.stats.thread_nice = raise_priority(self.config.thread_nice);
        let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| self.serve()));
        let why = match outcome {
            Ok(Ok(())) => return,
            Ok(Err(error)) => error.to_string(),
            Err(panic) => panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "panic".into()),
        };
        fatal(&why);
    }

    fn page(&self) -> usize {
        self.config.page_size as usize
    }

    fn now_ns(&self) -> u64 {
        self.start.elapsed().as_nanos() as u64
    }

    fn serve(&mut self) -> Result<(), ServiceError> {
        self.ring.watch(self.uffd.as_raw_fd(), TOKEN_UFFD)?;
        self.ring
            .watch(self.shared.wakeup.as_raw_fd(), TOKEN_COMMANDS)?;
        if let Some(pool) = &self.installs {
            self.ring.watch(pool.event_fd(), TOKEN_INSTALLED)?;
        }
        loop {
            if self.demand_reads_in_flight >= self.config.demand_spin_min_reads
                && !self.config.demand_spin.is_zero()
            {
                // Many threads are blocked on reads: reaping their completions (and new
                // faults) without a wake-up of this thread shortens their waits. With
                // few, polling costs more than it saves: it keeps this core busy, so the
                // thread an install wakes is sent to another core, idle and halted,
                // and waking a halted virtual CPU costs tens of microseconds.
                self.ring.submit_and_spin(self.config.demand_spin)?;
            } else {
                self.ring.submit_and_wait(1)?;
            }
            let mut completions = std::mem::take(&mut self.completions);
            completions.clear();
            self.ring.reap(&mut completions);
            for completion in completions.drain(..) {
                match completion {
                    Completion::Read { slot, result } => self.read_done(slot, result)?,
                    Completion::Readable { token, rearm } => {
                        if token == TOKEN_UFFD {
                            self.drain_faults()?;
                            if rearm {
                                self.ring.watch(self.uffd.as_raw_fd(), TOKEN_UFFD)?;
                            }
                        } else if token == TOKEN_INSTALLED {
                            self.collect_installs(false)?;
                            if let (true, Some(pool)) = (rearm, &self.installs) {
                                self.ring.watch(pool.event_fd(), TOKEN_INSTALLED)?;
                            }
                        } else {
                            self.drain_commands()?;
                            if rearm {
                                self.ring
                                    .watch(self.shared.wakeup.as_raw_fd(), TOKEN_COMMANDS)?;
                            }
                        }
                    }
                }
            }
            self.completions = completions;
            // Keep the device busy first: issue reads for the slots and budget free
            // now, then install what finished (installs take far longer than issuing).
            self.pump()?;
            if !self.ready.is_empty() {
                self.ring.submit()?;
                self.install_ready()?;
                // Installs freed slots: fill them (submitted on the next turn).
                self.pump()?;
            }
            let now = self.now_ns();
            if now - self.last_publish_ns > 100_000_000 {
                self.publish();
            }
            if self.shutting_down && self.ring.reads_in_flight() == 0 {
                self.publish();
                return Ok(());
            }
        }
    }

    fn snapshot(&mut self) -> Stats {
        let mut stats = self.stats.clone();
        stats.resident_bytes = self.resident;
        stats.pinned_bytes = self.pinned;
        stats.fault_latency_us = self.log.latency.summary();
        stats.read_latency_us = self.read_latency.summary();
        stats.elapsed_s = self.start.elapsed().as_secs_f64();
        let refused = self
            .regions
            .values()
            .find_map(|region| region.file.direct_refused().map(str::to_owned));
        stats.direct_io = refused.is_none();
        stats.direct_io_fallback = refused;
        if let Some(store) = &self.store {
            (stats.frame_memory_bytes, stats.peak_frame_memory_bytes) = store.memory_bytes();
        }
        stats
    }

    fn publish(&mut self) {
        self.last_publish_ns = self.now_ns();
        let snapshot = self.snapshot();
        *self
            .shared
            .stats
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = snapshot;
    }

    // ---- faults -------------------------------------------------------------------

    fn drain_faults(&mut self) -> Result<(), ServiceError> {
        loop {
            self.fault_addrs.clear();
            let events = self
                .uffd
                .read_events(&mut self.events)
                .map_err(|error| ServiceError::Events(format!("{error:?}")))?;
            for event in events {
                // No other events are enabled.
                if let Event::Pagefault {
                    addr, thread_id, ..
                } = event.map_err(|error| ServiceError::Events(format!("{error:?}")))?
                {
                    self.fault_addrs
                        .push((addr as usize, thread_id.as_raw() as u32));
                }
            }
            if self.fault_addrs.is_empty() {
                return Ok(());
            }
            let addrs = std::mem::take(&mut self.fault_addrs);
            for &(addr, tid) in &addrs {
                self.handle_fault(addr, tid)?;
            }
            self.fault_addrs = addrs;
        }
    }

    fn handle_fault(&mut self, addr: usize, tid: u32) -> Result<(), ServiceError> {
        let now = self.now_ns();
        let page = self.config.page_size as usize;
        let page_addr = addr & !(page - 1);
        let Some((id, offset)) = self.locator.lookup(addr) else {
            // A range being unmapped: its owner is waiting for us to let go. Waking is
            // harmless; the thread retries against whatever is mapped there now.
            let _ = self.uffd.wake(page_addr as *mut libc::c_void, page);
            return Ok(());
        };
        let Some(region) = self.regions.get_mut(&id) else {
            return Ok(());
        };
        let index = match region.layout.locate(offset) {
            Location::PastEof => {
                // As with a file mapping: a whole page past the end of the file is SIGBUS.
                poison_range(&self.uffd, page_addr, page, page);
                return Ok(());
            }
            Location::Block(index) => index,
        };
        let block_start = index as u64 * region.layout.block_size;
        let block = BlockRef::new(id, index);
        if region.blocks[index as usize] == BlockState::Unmapped {
            // The program is unmapping it: the service has been told, the kernel's
            // munmap follows. (A region of ours mapped there since is newer, and
            // `lookup` answers with it.) Woken, the thread faults again until the range
            // is gone, then as without a pager: SIGSEGV. Served as a missing block (as
            // it was), the read installed nothing in the hole and the thread waited
            // for good. Not a model access: the policies do not hear of it.
            let _ = self.uffd.wake(page_addr as *mut libc::c_void, page);
            return Ok(());
        }
        self.stats.faults += 1;
        self.recent.record(tid, block);
        if let Some(n) = self.config.faults.panic_after_faults {
            if self.stats.faults > n {
                panic!("injected panic after {n} faults");
            }
        }
        if self.store.is_none()
            && region.blocks[index as usize] == BlockState::Resident
            && !page_present(page_addr)
        {
            // Resident, yet the page is gone: dropped behind the service's back (advice
            // given to the kernel directly, say MADV_DONTNEED_LOCKED through a path the
            // shim does not see). Waking the thread, as for a fault that raced with the
            // install, would have it fault again forever: read the block again.
            let memory = region.layout.block_memory(index);
            self.drop_blocks(id, &(memory.start..memory.end), BlockState::Missing)?;
            self.stats.lost_blocks += 1;
        }
        let Some(region) = self.regions.get_mut(&id) else {
            return Ok(());
        };
        let offset_in_block = (offset - block_start) as u32;
        let waiter = |outcome| Waiter {
            t_ns: now,
            tid,
            outcome,
            offset_in_block,
        };
        let mut watch_fault = false;
        let outcome = match region.blocks[index as usize] {
            BlockState::Resident if self.store.is_some() => {
                // The install raced with the fault, the block is watched, or the program
                // dropped the pages of the frame's mapping (a minor fault): map the frame
                // again.
                let store = self.store.as_ref().expect("checked");
                map_frame(&self.uffd, store, region, index)?;
                watch_fault = std::mem::take(&mut region.watched[index as usize]);
                FaultOutcome::Resident
            }
            BlockState::Resident => {
                // The fault raced with the install that already woke it.
                let _ = self.uffd.wake(page_addr as *mut libc::c_void, page);
                FaultOutcome::Resident
            }
            BlockState::Reading => {
                self.waiters
                    .entry(block)
                    .or_default()
                    .push(waiter(FaultOutcome::InFlight));
                FaultOutcome::InFlight
            }
            BlockState::Queued => {
                self.waiters
                    .entry(block)
                    .or_default()
                    .push(waiter(FaultOutcome::InFlight));
                // Whatever queue it is in, it is now needed: serve it first.
                self.demand.push_back(block);
                FaultOutcome::InFlight
            }
            BlockState::Staged { stash } => {
                self.unstage(block);
                self.waiters
                    .entry(block)
                    .or_default()
                    .push(waiter(FaultOutcome::Staged));
                self.install_staged(block, stash)?;
                FaultOutcome::Staged
            }
            // (Unmapped: answered above.)
            BlockState::Missing | BlockState::Poisoned | BlockState::Unmapped => {
                region.blocks[index as usize] = BlockState::Queued;
                self.waiters
                    .entry(block)
                    .or_default()
                    .push(waiter(FaultOutcome::Missing));
                self.demand.push_back(block);
                FaultOutcome::Missing
            }
        };
        match outcome {
            FaultOutcome::Missing => self.stats.demand_faults += 1,
            _ if watch_fault => self.stats.watch_faults += 1,
            _ => self.stats.prefetch_hits += 1,
        }
        if outcome == FaultOutcome::Resident {
            let file_offset = region_file_offset(&self.regions, block);
            let done = self.now_ns();
            self.log.served(
                block,
                file_offset,
                self.config.block_size,
                waiter(FaultOutcome::Resident),
                done,
            );
        }
        let event = FaultEvent {
            block,
            time_ns: now,
            outcome,
            offset_in_block: Some(offset_in_block),
        };
        self.eviction.touched(&event);
        let mut plan = std::mem::take(&mut self.plan);
        plan.clear();
        self.prefetch.plan(&event, &mut plan);
        for request in plan.drain(..) {
            self.queue_prefetch(request);
        }
        self.plan = plan;
        if self.store.is_some() {
            let mut watch = std::mem::take(&mut self.watch);
            watch.clear();
            self.eviction.watch(&mut watch);
            for &block in &watch {
                self.watch_block(block)?;
            }
            self.watch = watch;
        }
        Ok(())
    }

    /// Drops the pages of a resident block and keeps its frame, so that the program's
    /// next access is a minor fault the policies hear of (`EvictionPolicy::watch`).
    fn watch_block(&mut self, block: BlockRef) -> Result<(), ServiceError> {
        let Some(region) = self.regions.get_mut(&block.region) else {
            return Ok(());
        };
        let index = block.index as usize;
        if region.blocks.get(index) != Some(&BlockState::Resident) || region.pinned[index] {
            debug_assert!(false, "eviction policy watched a non-evictable {block:?}");
            return Ok(());
        }
        if std::mem::replace(&mut region.watched[index], true) {
            return Ok(());
        }
        self.stats.watched_blocks += 1;
        let memory = region.layout.block_memory(block.index);
        for part in region.mapped_parts(memory) {
            discard_pages(part.start, part.end)?;
        }
        Ok(())
    }

    fn queue_prefetch(&mut self, request: PrefetchRequest) {
        if self.prefetch_queue.len() >= MAX_QUEUED_PREFETCH {
            return;
        }
        let Some(region) = self.regions.get_mut(&request.block.region) else {
            return;
        };
        if let Some(state @ BlockState::Missing) =
            region.blocks.get_mut(request.block.index as usize)
        {
            *state = BlockState::Queued;
            self.prefetch_queue.push_back(request);
        }
    }

    // ---- reads --------------------------------------------------------------------

    /// Issues queued reads: demand first, then prefetch, within the budget and the
    /// queue depth. Prefetch leaves a quarter of the slots for demand reads.
    fn pump(&mut self) -> Result<(), ServiceError> {
        while let Some(&block) = self.demand.front() {
            let Some(region) = self.regions.get(&block.region) else {
                self.demand.pop_front();
                continue;
            };
            if region.removed || region.blocks[block.index as usize] != BlockState::Queued {
                self.demand.pop_front();
                continue;
            }
            let bytes = region.layout.block_bytes(block.index);
            if !self.ring.has_free_slot() || !self.frame_free() {
                break;
            }
            if !self.make_room(bytes, block, ReadKind::Demand)? {
                break;
            }
            let Some(slot) = self.ring.checkout()? else {
                self.reserved -= bytes;
                break;
            };
            self.demand.pop_front();
            self.start_read(slot, block, 1, bytes, Install::Eager, false)?;
        }
        let prefetch_limit = (self.config.queue_depth - self.config.queue_depth / 4).max(1);
        let max_blocks = (self.config.max_read / self.config.block_size) as u32;
        let device_limit = self.prefetch.device_bytes().unwrap_or(u64::MAX);
        while self.prefetch_reads_in_flight < prefetch_limit
            && self.prefetch_bytes_on_device < device_limit
            && self.ring.has_free_slot()
            && self.frame_free()
        {
            let Some(&first) = self.prefetch_queue.front() else {
                break;
            };
            let Some(region) = self.regions.get(&first.block.region) else {
                self.prefetch_queue.pop_front();
                continue;
            };
            if region.removed || region.blocks[first.block.index as usize] != BlockState::Queued {
                self.prefetch_queue.pop_front();
                continue;
            }
            let install = first.install;
            // Merge following requests for the next blocks into one read; a marker
            // stays alone, since it is held back as a unit.
            let mut count = 1u32;
            if install == Install::Eager {
                for next in self.prefetch_queue.iter().skip(1) {
                    let index = first.block.index + count;
                    if count >= max_blocks
                        || next.block.region != first.block.region
                        || next.block.index != index
                        || next.install != Install::Eager
                        || region.blocks.get(index as usize) != Some(&BlockState::Queued)
                    {
                        break;
                    }
                    count += 1;
                }
            }
            let bytes: u64 = (first.block.index..first.block.index + count)
                .map(|index| region.layout.block_bytes(index))
                .sum();
            if !self.make_room(bytes, first.block, ReadKind::Prefetch)? {
                // Nothing resident is worth less than this block. Requests are queued
                // in the order they are needed, so the rest are worth as little, unless
                // this one is stale: the program passed it while it waited for the
                // device. Drop it alone (measured at a quarter of a 3 GiB llama:
                // dropping the queue on a stale request left runs of the blocks just
                // ahead to be read on demand).
                self.prefetch_queue.pop_front();
                self.cancel_request(first.block);
                continue;
            }
            let Some(slot) = self.ring.checkout()? else {
                self.reserved -= bytes;
                break;
            };
            for _ in 0..count {
                self.prefetch_queue.pop_front();
            }
            self.start_read(slot, first.block, count, bytes, install, true)?;
            self.stats.blocks_prefetched += count as u64;
        }
        Ok(())
    }

    /// Whether a read can have a frame (always, without zero copy). Frames run out
    /// only if more regions than the spare frames hold a short last block each.
    fn frame_free(&self) -> bool {
        self.store.as_ref().is_none_or(FrameStore::has_free)
    }

    /// Forgets a prefetch request taken off the queue: its block is missing again
    /// unless a thread waits on it (then it is in the demand queue too).
    fn cancel_request(&mut self, block: BlockRef) {
        if let Some(region) = self.regions.get_mut(&block.region) {
            let state = &mut region.blocks[block.index as usize];
            if *state == BlockState::Queued && !self.waiters.contains_key(&block) {
                *state = BlockState::Missing;
            }
        }
    }

    /// Reserves `bytes` of budget for a read of `incoming`, evicting as the policy says.
    /// False if no room can be made now (for a demand read: everything is in flight or
    /// pinned, so room appears when reads complete).
    fn make_room(
        &mut self,
        bytes: u64,
        incoming: BlockRef,
        kind: ReadKind,
    ) -> Result<bool, ServiceError> {
        let mut victims = std::mem::take(&mut self.victims);
        victims.clear();
        let mut spared = std::mem::take(&mut self.spared);
        spared.clear();
        // Spared victims a demand read took after all, from the first named.
        let mut spared_taken = 0;
        let mut freed = 0u64;
        let mut room = true;
        while self.resident + self.reserved + bytes > self.config.budget + freed {
            let victim = match self.eviction.victim(incoming, kind) {
                Some(victim) => {
                    let Some(region) = self.regions.get(&victim.region) else {
                        continue;
                    };
                    let index = victim.index as usize;
                    // A policy may only name evictable resident blocks; skip any other.
                    if region.blocks.get(index) != Some(&BlockState::Resident)
                        || region.pinned[index]
                    {
                        debug_assert!(false, "eviction policy named a non-evictable {victim:?}");
                        continue;
                    }
                    if self.recent.spares(victim) {
                        spared.push(victim);
                        continue;
                    }
                    victim
                }
                None if kind == ReadKind::Demand => {
                    // Held-back markers are the only other thing a demand read can take
                    // room from; then the blocks threads faulted on last.
                    if let Some(staged) = self.staged.front().copied() {
                        self.discard_staged(staged);
                        continue;
                    }
                    match spared.get(spared_taken) {
                        Some(&victim) => {
                            spared_taken += 1;
                            victim
                        }
                        None => {
                            room = false;
                            break;
                        }
                    }
                }
                None => {
                    room = false;
                    break;
                }
            };
            let region = &self.regions[&victim.region];
            freed += region.layout.block_bytes(victim.index);
            victims.push(victim);
        }
        // The policy handed the spared blocks over as victims: give back those kept.
        for &block in &spared[spared_taken..] {
            self.eviction.inserted(block);
        }
        self.spared = spared;
        self.evict(&mut victims)?;
        self.victims = victims;
        if room {
            self.reserved += bytes;
        }
        Ok(room)
    }

    /// Drops the victims' pages, in runs of neighbouring blocks.
    fn evict(&mut self, victims: &mut [BlockRef]) -> Result<(), ServiceError> {
        victims.sort_unstable();
        // (region, start, end): region offsets of a run of neighbouring victims.
        let mut run: Option<(RegionId, u64, u64)> = None;
        for &victim in victims.iter() {
            let region = self
                .regions
                .get_mut(&victim.region)
                .expect("victims were checked to belong to live regions");
            region.blocks[victim.index as usize] = BlockState::Missing;
            // The frame takes the next read; its pages stay (warm) in the store.
            release_frame(&mut self.store, region, victim.index, false);
            let memory = region.layout.block_memory(victim.index);
            let bytes = memory.end - memory.start;
            self.resident -= bytes;
            self.stats.evictions += 1;
            self.stats.evicted_bytes += bytes;
            run = match run {
                Some((id, start, end)) if id == victim.region && end == memory.start => {
                    Some((id, start, memory.end))
                }
                Some(done) => {
                    self.discard_run(done)?;
                    Some((victim.region, memory.start, memory.end))
                }
                None => Some((victim.region, memory.start, memory.end)),
            };
        }
        if let Some(done) = run {
            self.discard_run(done)?;
        }
        Ok(())
    }

    /// Drops the pages of a run of blocks (region offsets), skipping unmapped parts.
    fn discard_run(&self, (id, start, end): (RegionId, u64, u64)) -> Result<(), ServiceError> {
        let region = self.regions.get(&id).expect("a run of a live region");
        // With zero copy the parts stay mapped to the evicted frames: dropping their
        // page-table entries makes the next access a minor fault.
        for part in region.mapped_parts(start..end) {
            discard_pages(part.start, part.end)?;
        }
        Ok(())
    }

    fn start_read(
        &mut self,
        slot: u32,
        first: BlockRef,
        count: u32,
        reserved: u64,
        install: Install,
        prefetch: bool,
    ) -> Result<(), ServiceError> {
        let now = self.now_ns();
        let region = self
            .regions
            .get_mut(&first.region)
            .expect("reads start only for live regions");
        let start = first.index as u64 * region.layout.block_size;
        let end =
            ((first.index + count) as u64 * region.layout.block_size).min(region.layout.data_len);
        let valid = (end - start) as usize;
        let len = (end - start).next_multiple_of(DIRECT_IO_ALIGN) as usize;
        for index in first.index..first.index + count {
            region.blocks[index as usize] = BlockState::Reading;
        }
        region.reads_in_flight += 1;
        let file_offset = region.file_offset + start;
        let fd = region.file.read_fd();
        let landing = match &mut self.store {
            Some(store) => {
                debug_assert_eq!(count, 1, "a frame holds one block");
                let frame = store.take().expect("pump checked a frame is free");
                region.frames[first.index as usize] = frame.index;
                // A frame's first read faults its pages in, and the kernel clears them
                // first: inside this thread's submit, which then serves nobody meanwhile.
                // Slow when the host must back the memory anew (a VM whose freed memory
                // went back to the host): 2 MiB took 4 ms here, and the cold start to the
                // first token spent 45 % of all CPU clearing on this thread. The kernel's
                // io_uring workers clear several frames at once instead. llama-completion
                // -n 1 cold, 3 GiB llama at 125 %, memory idle 8 s before (three runs
                // each): 6.66-7.59 s on this thread, 5.17-5.19 punted; memory just freed
                // by the run before: 1.28 and 1.29-1.33 s.
                Some(Landing {
                    dest: store.view(frame.index),
                    len,
                    off_thread: !frame.warm,
                })
            }
            None => None,
        };
        let tag = ReadTag {
            region: first.region,
            first: first.index,
            count,
            file_offset,
            len,
            valid,
            done: 0,
            attempts: 1,
            submitted_ns: now,
            reserved,
            install,
            prefetch,
        };
        match landing {
            Some(landing) => {
                // SAFETY: the store's view lives as long as the service; the frame was
                // just taken, and no other read lands in it or region maps it until it
                // is freed.
                unsafe { self.ring.read_into(slot, fd, file_offset, landing, tag) }?
            }
            None => self.ring.read(slot, fd, file_offset, 0, len, tag)?,
        }
        if prefetch {
            self.prefetch_reads_in_flight += 1;
            self.prefetch_bytes_on_device += len as u64;
        } else {
            self.demand_reads_in_flight += 1;
        }
        self.stats.read_requests += 1;
        Ok(())
    }

    fn read_done(&mut self, slot: u32, mut result: i32) -> Result<(), ServiceError> {
        let Some(tag) = self.ring.tag(slot) else {
            return Ok(());
        };
        let region_id = tag.region;
        if tag.prefetch {
            // What was submitted last for this slot: the request's rest.
            self.prefetch_bytes_on_device -= (tag.len - tag.done) as u64;
        }
        if !self.config.faults.read_delay.is_zero() {
            std::thread::sleep(self.config.faults.read_delay);
        }
        if self.config.faults.short_reads && result > 1 {
            let (len, done) = (tag.len, tag.done);
            let asked = (len - done) as i32;
            let full = result as usize;
            result = result.min(asked / 2).max(1);
            // What the shortened read did not deliver must not be in the buffer either.
            let (from, to) = (done + result as usize, done + full);
            self.landing(slot)[from..to].fill(0xEE);
        }
        if let Some(injection) = &self.config.injection {
            let tag = self.ring.tag(slot).expect("checked above");
            let range = tag.file_offset..tag.file_offset + tag.valid as u64;
            if range.start < injection.file_range.end && injection.file_range.start < range.end {
                result = -injection.errno;
            }
        }
        let live = self
            .regions
            .get(&region_id)
            .is_some_and(|region| !region.removed);
        if !live {
            if let Some(region) = self.regions.get_mut(&region_id) {
                let tag = self.ring.tag(slot).expect("checked above");
                for index in tag.first..tag.first + tag.count {
                    release_frame(&mut self.store, region, index, true);
                }
            }
            self.finish_read(slot);
            return Ok(());
        }
        if result < 0 {
            let errno = -result;
            let region = self.regions.get_mut(&region_id).expect("checked live");
            let tag = self.ring.tag_mut(slot).expect("checked above");
            if errno == libc::EINVAL && region.file.is_direct() {
                // The filesystem took O_DIRECT at open but refuses the read: go buffered.
                region.file.give_up_direct(format!(
                    "O_DIRECT read refused ({}); reading through the page cache",
                    std::io::Error::from_raw_os_error(errno)
                ));
            } else if tag.attempts < self.config.read_attempts {
                tag.attempts += 1;
                self.stats.read_retries += 1;
            } else {
                self.fail_read(slot);
                return Ok(());
            }
            return self.continue_read(slot);
        }
        let tag = self.ring.tag_mut(slot).expect("checked above");
        if result == 0 && tag.done < tag.valid {
            // End of file before the data the region was made for: the file shrank under
            // us. The kernel raises SIGBUS for such pages; so do we (and say why once).
            self.file_changed(region_id);
            self.fail_read(slot);
            return Ok(());
        }
        tag.done += result as usize;
        if tag.done < tag.valid {
            return self.continue_read(slot);
        }
        self.read_complete(slot)
    }

    /// Re-issues the unread rest of a request (after a short read or a retry).
    fn continue_read(&mut self, slot: u32) -> Result<(), ServiceError> {
        let tag = self.ring.tag(slot).expect("continuing a read in flight");
        let region = self
            .regions
            .get(&tag.region)
            .expect("continuing a live region");
        // A short read may end off the direct-I/O alignment; finish such a rest buffered.
        let fd = if tag.done as u64 % DIRECT_IO_ALIGN == 0 {
            region.file.read_fd()
        } else {
            region.file.buffered_fd()
        };
        let (offset, done, len) = (
            tag.file_offset + tag.done as u64,
            tag.done,
            tag.len - tag.done,
        );
        // On this thread: the first attempt faulted the frame's pages in (short reads and
        // retries are rare enough not to need a worker either way).
        let landing = self.store.as_ref().map(|store| Landing {
            dest: store
                .view(region.frames[tag.first as usize])
                .wrapping_add(done),
            len,
            off_thread: false,
        });
        let tag = self
            .ring
            .checkin(slot)
            .expect("continuing a read in flight");
        if tag.prefetch {
            self.prefetch_bytes_on_device += len as u64;
        }
        // Re-checking out the same slot cannot fail: it was just returned.
        let again = self.ring.checkout()?.expect("a slot was just returned");
        debug_assert_eq!(again, slot);
        match landing {
            Some(landing) => {
                // SAFETY: as in `start_read`: the rest of the same frame.
                unsafe { self.ring.read_into(again, fd, offset, landing, tag) }?
            }
            None => self.ring.read(again, fd, offset, done, len, tag)?,
        }
        Ok(())
    }

    /// The memory the read in `slot` lands in: its ring buffer, or its block's frame.
    /// Only for a read that is not in flight.
    fn landing(&mut self, slot: u32) -> &mut [u8] {
        let tag = self.ring.tag(slot).expect("a read in the ring");
        let len = tag.len;
        match &mut self.store {
            Some(store) => {
                let frame = self.regions[&tag.region].frames[tag.first as usize];
                // SAFETY: the read has completed (or not started), so nothing else
                // writes the frame, and the service is its only user meanwhile.
                unsafe { store.bytes_mut(frame, len) }
            }
            None => self.ring.buffer_mut(slot),
        }
    }

    fn read_complete(&mut self, slot: u32) -> Result<(), ServiceError> {
        let now = self.now_ns();
        let tag = self.ring.tag(slot).expect("completing a read in flight");
        let (region_id, first, count, valid) = (tag.region, tag.first, tag.count, tag.valid);
        let elapsed = now.saturating_sub(tag.submitted_ns);
        let install = tag.install;
        if self.file_changed(region_id) {
            self.fail_read(slot);
            return Ok(());
        }
        // Bytes past the end of the file in the last page read as zeros, as with mmap.
        let page = self.config.page_size as usize;
        let landing = self.landing(slot);
        let tail = valid..valid.next_multiple_of(page).min(landing.len());
        landing[tail].fill(0);
        if let Some(store) = &self.store {
            // Whether it is mapped now or held back, the service is done with the
            // frame's bytes: the process's resident set counts them once (the region's).
            store.forget_view(self.regions[&region_id].frames[first as usize]);
        }
        self.read_latency.record_ns(elapsed);
        self.stats.bytes_read += valid as u64;
        self.stats.blocks_read += count as u64;
        let block = BlockRef::new(region_id, first);
        self.prefetch.read_completed(block, valid as u64, elapsed);
        let staged_max = max_staged(self.config.queue_depth, self.config.block_size);
        if install == Install::OnFault
            && !self.waiters.contains_key(&block)
            && self.store.is_some()
            && self.staged.len() < staged_max
        {
            // With zero copy the marker's bytes are already where they will be mapped
            // from: hold it back unmapped, and map it when the program faults on it.
            let region = self.regions.get_mut(&region_id).expect("checked live");
            region.blocks[first as usize] = BlockState::Staged { stash: IN_FRAME };
            self.staged.push_back(block);
            let reserved = self.ring.tag(slot).expect("completing").reserved;
            self.finish_read(slot);
            self.reserved += reserved;
            return Ok(());
        }
        if install == Install::OnFault && !self.waiters.contains_key(&block) && self.store.is_none()
        {
            let region = self.regions.get_mut(&region_id).expect("checked live");
            let memory = region.layout.block_memory(first);
            let len = (memory.end - memory.start) as usize;
            // With the stash full this marker is installed like any prefetch: the
            // markers already held are nearer the program, and they are the ones that
            // keep its position known.
            if let Some(stash) = self.stash.put(&self.ring.buffer(slot)[..len]) {
                region.blocks[first as usize] = BlockState::Staged { stash };
                self.staged.push_back(block);
                let reserved = self.ring.tag(slot).expect("completing").reserved;
                self.finish_read(slot);
                // The marker keeps its budget until it is installed or discarded.
                self.reserved += reserved;
                return Ok(());
            }
        }
        // Installed after the next reads are submitted (`serve`), waited ones first:
        // issuing a read takes microseconds, mapping or copying a block far longer, and
        // the device would idle meanwhile.
        self.ready.push_back(slot);
        Ok(())
    }

    /// Whether a thread waits on a block of the read in `slot`.
    fn read_has_waiters(&self, slot: u32) -> bool {
        if self.waiters.is_empty() {
            return false;
        }
        let tag = self.ring.tag(slot).expect("a read in flight");
        (tag.first..tag.first + tag.count)
            .any(|index| self.waiters.contains_key(&BlockRef::new(tag.region, index)))
    }

    /// Installs the finished reads nobody waited for, issuing reads as slots free up.
    fn install_ready(&mut self) -> Result<(), ServiceError> {
        if !self.waiters.is_empty() {
            // Threads that faulted on a finished read since it finished go first.
            let ready = std::mem::take(&mut self.ready);
            let (mut waited, rest): (VecDeque<u32>, VecDeque<u32>) = ready
                .into_iter()
                .partition(|&slot| self.read_has_waiters(slot));
            waited.extend(rest);
            self.ready = waited;
        }
        while let Some(slot) = self.ready.pop_front() {
            self.install_read(slot)?;
            if self.ring.has_free_slot() && !self.ready.is_empty() {
                self.pump()?;
                self.ring.submit_and_wait(0)?;
            }
        }
        Ok(())
    }

    /// Installs every block of a finished read (here, or on an install worker when the
    /// read was a prefetch nobody waits for yet), wakes their waiters, frees the slot.
    fn install_read(&mut self, slot: u32) -> Result<(), ServiceError> {
        let tag = self.ring.tag(slot).expect("installing a read in flight");
        let (region_id, first, count, prefetch) = (tag.region, tag.first, tag.count, tag.prefetch);
        let region = self
            .regions
            .get_mut(&region_id)
            .expect("installing into a region still known");
        if region.removed {
            for index in first..first + count {
                release_frame(&mut self.store, region, index, true);
            }
            self.finish_read(slot);
            return Ok(());
        }
        let region = &self.regions[&region_id];
        // The blocks of one read are neighbours in the buffer and in the region: one
        // call installs them all.
        let start = region.layout.block_memory(first).start;
        let end = region.layout.block_memory(first + count - 1).end;
        if let Some(store) = &self.store {
            debug_assert_eq!(count, 1, "a frame holds one block");
            map_frame(&self.uffd, store, region, first)?;
            let now = self.now_ns();
            self.installed(slot, now);
            return Ok(());
        }
        let job = InstallJob {
            slot,
            source: self.ring.buffer(slot).as_ptr(),
            target: region.base + start as usize,
            len: (end - start) as usize,
        };
        // A read the program unmapped part of is installed here, around the holes.
        let cut = region.cuts(start..end);
        if self
            .installs
            .as_ref()
            .is_some_and(|pool| pool.finished_uncollected() > 0)
        {
            // Free the slots of finished installs first: they are reads waiting to issue.
            self.collect_installs(false)?;
        }
        let waited = self.read_has_waiters(slot);
        if let Some(pool) = &mut self.installs {
            // Share the work: a worker takes a prefetch unless the workers already have
            // one queued each, in which case this thread copies it itself.
            if prefetch && !waited && !cut && pool.unfinished() < 2 * pool.threads() {
                pool.submit(job);
                return Ok(());
            }
        }
        let region = &self.regions[&region_id];
        // SAFETY: the buffer belongs to this slot's completed read and is not reused
        // until the slot is checked in by `installed`; the region is live, mapped until
        // its RemoveRegion is acknowledged.
        unsafe { install_mapped(&self.uffd, region, job.source, start..end, self.page()) }?;
        let now = self.now_ns();
        self.installed(slot, now);
        Ok(())
    }

    /// Installs a staged marker from the stash and wakes its waiters.
    fn install_staged(&mut self, block: BlockRef, stash: u32) -> Result<(), ServiceError> {
        let region = &self.regions[&block.region];
        let memory = region.layout.block_memory(block.index);
        if stash == IN_FRAME {
            let store = self
                .store
                .as_ref()
                .expect("markers in frames need the store");
            map_frame(&self.uffd, store, region, block.index)?;
            self.reserved -= region.layout.block_bytes(block.index);
            let now = self.now_ns();
            self.blocks_installed(block.region, block.index..block.index + 1, now);
            return Ok(());
        }
        // SAFETY: the stash buffer holds this block's bytes and is not reused until it is
        // released below; the region is live (staged blocks of a removed region are
        // discarded first).
        unsafe {
            install_mapped(
                &self.uffd,
                region,
                self.stash.buffer(stash).as_ptr(),
                memory,
                self.page(),
            )
        }?;
        self.stash.release(stash);
        // Its bytes move from reserved (held back) to resident.
        self.reserved -= region.layout.block_bytes(block.index);
        let now = self.now_ns();
        self.blocks_installed(block.region, block.index..block.index + 1, now);
        Ok(())
    }

    /// Finishes installs done by the workers; with `wait`, all of them, waiting for
    /// those still copying.
    fn collect_installs(&mut self, wait: bool) -> Result<(), ServiceError> {
        let Some(pool) = &mut self.installs else {
            return Ok(());
        };
        let mut installed = std::mem::take(&mut self.installed);
        if wait {
            pool.wait_idle(&mut installed);
        } else {
            pool.collect(&mut installed);
        }
        let mut failure = None;
        for done in installed.drain(..) {
            match done.result {
                Ok(()) => {
                    let at = done.at.saturating_duration_since(self.start).as_nanos() as u64;
                    self.installed(done.slot, at);
                }
                Err(error) => failure = failure.or(Some(error)),
            }
        }
        self.installed = installed;
        match failure {
            Some(error) => Err(error.into()),
            None => Ok(()),
        }
    }

    /// The bookkeeping after a read's blocks were installed at `now`.
    fn installed(&mut self, slot: u32, now: u64) {
        let tag = self.ring.tag(slot).expect("installed a read in flight");
        let (region_id, blocks) = (tag.region, tag.first..tag.first + tag.count);
        self.blocks_installed(region_id, blocks, now);
        self.finish_read(slot);
    }

    /// Marks installed blocks resident, hands them to the eviction policy and records
    /// the threads that waited on them.
    fn blocks_installed(&mut self, region_id: RegionId, blocks: Range<u32>, now: u64) {
        let region = self
            .regions
            .get_mut(&region_id)
            .expect("installed into a live region");
        for index in blocks {
            if region.blocks[index as usize] == BlockState::Unmapped {
                // The program unmapped the whole block while it was read: nothing was
                // installed, and it must never be evicted (something else may be
                // mapped there by now). Its frame goes back, emptied.
                release_frame(&mut self.store, region, index, true);
                continue;
            }
            let bytes = region.layout.block_bytes(index);
            // Pages of a block the program partly unmapped were skipped; the block is
            // still counted whole, which errs on the side of the budget.
            region.blocks[index as usize] = BlockState::Resident;
            if let Some(watched) = region.watched.get_mut(index as usize) {
                *watched = false;
            }
            self.resident += bytes;
            if !region.pinned[index as usize] {
                self.eviction.inserted(BlockRef::new(region_id, index));
            }
            if self.waiters.is_empty() {
                continue;
            }
            let block = BlockRef::new(region_id, index);
            let file_offset = region.file_offset + index as u64 * region.layout.block_size;
            for waiter in self.waiters.remove(&block).into_iter().flatten() {
                self.log
                    .served(block, file_offset, region.layout.block_size, waiter, now);
            }
        }
        self.stats.peak_resident_bytes = self.stats.peak_resident_bytes.max(self.resident);
    }

    /// Releases a read's slot and reservation, whatever became of it.
    fn finish_read(&mut self, slot: u32) {
        if let Some(tag) = self.ring.checkin(slot) {
            self.reserved -= tag.reserved;
            if tag.prefetch {
                self.prefetch_reads_in_flight -= 1;
            } else {
                self.demand_reads_in_flight -= 1;
            }
            if let Some(region) = self.regions.get_mut(&tag.region) {
                region.reads_in_flight -= 1;
                if region.removed && region.reads_in_flight == 0 {
                    self.regions.remove(&tag.region);
                }
            }
        }
    }

    /// A read failed for good: threads waiting on its blocks get SIGBUS (their pages are
    /// poisoned); blocks nobody waits for are left missing, to be tried again on demand.
    /// A merged read is first split: each block is tried alone, so one bad sector costs
    /// one block, not its neighbours.
    fn fail_read(&mut self, slot: u32) {
        let tag = self.ring.tag(slot).expect("failing a read in flight");
        let (region_id, first, count) = (tag.region, tag.first, tag.count);
        let now = self.now_ns();
        let region = self
            .regions
            .get_mut(&region_id)
            .expect("failing a live region's read");
        if count > 1 && !region.changed {
            for index in first..first + count {
                let block = BlockRef::new(region_id, index);
                if self.waiters.contains_key(&block) || region.pinned[index as usize] {
                    region.blocks[index as usize] = BlockState::Queued;
                    self.demand.push_back(block);
                } else {
                    region.blocks[index as usize] = BlockState::Missing;
                }
            }
            self.finish_read(slot);
            return;
        }
        let page = self.config.page_size as usize;
        self.stats.read_errors += 1;
        for index in first..first + count {
            let block = BlockRef::new(region_id, index);
            let waited = self.waiters.remove(&block);
            let memory = region.layout.block_memory(index);
            // Emptied: the failed read's pages may still be in the service's view.
            release_frame(&mut self.store, region, index, true);
            if waited.is_some() || region.pinned[index as usize] {
                for part in region.mapped_parts(memory) {
                    self.stats.poisoned_pages +=
                        poison_range(&self.uffd, part.start, part.end - part.start, page);
                }
                region.blocks[index as usize] = BlockState::Poisoned;
            } else {
                region.blocks[index as usize] = BlockState::Missing;
            }
            let file_offset = region.file_offset + index as u64 * region.layout.block_size;
            for waiter in waited.into_iter().flatten() {
                self.log
                    .served(block, file_offset, region.layout.block_size, waiter, now);
            }
        }
        self.finish_read(slot);
    }

    /// Whether the region's file was modified in place (size or mtime of the open
    /// descriptor differ from when it was opened). Checked after every read, before its
    /// bytes are installed: a writer updates the mtime before it changes the data, so a
    /// read that saw new bytes is caught. From the first change on, nothing more is
    /// installed from the file: the threads waiting get SIGBUS (once, a message says why)
    /// rather than a mix of old and new bytes. A file replaced by rename is not a change:
    /// the region keeps reading the inode it opened, as a kernel mapping does.
    fn file_changed(&mut self, id: RegionId) -> bool {
        let Some(region) = self.regions.get_mut(&id) else {
            return false;
        };
        if region.changed {
            return true;
        }
        let Ok(now) = region.file.open_identity() else {
            return false;
        };
        let then = region.file.identity();
        if now.len == then.len && now.mtime_ns == then.mtime_ns {
            return false;
        }
        region.changed = true;
        let message = format!(
            "hyperoffload: {} was modified while mapped (size {} -> {}, mtime changed: {}); \
             its pages not yet read raise SIGBUS\n",
            region.file.path().display(),
            then.len,
            now.len,
            now.mtime_ns != then.mtime_ns
        );
        // SAFETY: writes a live buffer to fd 2 (not through stderr's lock, which a
        // faulting thread may hold).
        unsafe { libc::write(2, message.as_ptr().cast(), message.len()) };
        true
    }

    fn unstage(&mut self, block: BlockRef) {
        if let Some(position) = self.staged.iter().position(|&staged| staged == block) {
            self.staged.remove(position);
        }
    }

    /// Gives up a held-back marker: its data is discarded and its budget released.
    fn discard_staged(&mut self, block: BlockRef) {
        self.unstage(block);
        if let Some(region) = self.regions.get_mut(&block.region) {
            if let BlockState::Staged { stash } = region.blocks[block.index as usize] {
                region.blocks[block.index as usize] = BlockState::Missing;
                self.reserved -= region.layout.block_bytes(block.index);
                if stash == IN_FRAME {
                    release_frame(&mut self.store, region, block.index, false);
                } else {
                    self.stash.release(stash);
                }
            }
        }
    }

    // ---- commands -----------------------------------------------------------------

    fn drain_commands(&mut self) -> Result<(), ServiceError> {
        self.shared.wakeup.drain();
        loop {
            let command = self
                .shared
                .commands
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .pop_front();
            let Some(command) = command else {
                return Ok(());
            };
            self.command(command)?;
        }
    }

    fn command(&mut self, command: Command) -> Result<(), ServiceError> {
        if command.changes_residency() {
            // Nothing may be copied into a range this command drops or lets go of.
            let ready = std::mem::take(&mut self.ready);
            for slot in ready {
                self.install_read(slot)?;
            }
            self.collect_installs(true)?;
        }
        match command {
            Command::AddRegion {
                id,
                base,
                layout,
                file,
                file_offset,
                prot,
                reply,
            } => {
                let blocks = layout.block_count() as usize;
                let (frames, watched) = match self.store {
                    Some(_) => (vec![NO_FRAME; blocks], vec![false; blocks]),
                    None => (Vec::new(), Vec::new()),
                };
                let entry = RegionEntry {
                    base,
                    file,
                    file_offset,
                    blocks: vec![BlockState::Missing; blocks],
                    pinned: vec![false; blocks],
                    reads_in_flight: 0,
                    removed: false,
                    changed: false,
                    holes: Vec::new(),
                    frames,
                    watched,
                    prot,
                    layout,
                };
                self.locator.insert(base, entry.layout.map_len as usize, id);
                let info = entry.info(id, self.config.budget, self.store.is_some());
                self.prefetch.region_added(&info);
                self.eviction.region_added(&info);
                self.regions.insert(id, entry);
                let _ = reply.send(());
            }
            Command::RemoveRegion { id, reply } => {
                self.remove_region(id);
                let _ = reply.send(());
            }
            Command::Prefetch { id, range } => {
                for index in self.blocks_of(id, &range) {
                    self.queue_prefetch(PrefetchRequest::eager(BlockRef::new(id, index)));
                }
            }
            Command::Drop { id, range, reply } => {
                self.drop_blocks(id, &range, BlockState::Missing)?;
                let _ = reply.send(());
            }
            Command::Unmap { id, range, reply } => {
                if let Some(region) = self.regions.get_mut(&id) {
                    region.holes.push(range.clone());
                }
                // Only blocks wholly inside the range go; the pages of a block the range
                // cuts through that were unmapped simply fail to install (ENOENT).
                let blocks = self.blocks_of(id, &range);
                if let Some(region) = self.regions.get(&id) {
                    let size = region.layout.block_size;
                    let first = (range.start.div_ceil(size) as u32).max(blocks.start);
                    let end = ((range.end / size) as u32).min(blocks.end);
                    if first < end {
                        let whole = first as u64 * size..end as u64 * size;
                        self.drop_blocks(id, &whole, BlockState::Unmapped)?;
                    }
                }
                let _ = reply.send(());
            }
            Command::Pin { id, range, reply } => {
                let _ = reply.send(self.pin(id, &range));
            }
            Command::Unpin { id, range } => self.unpin(id, &range),
            Command::Hint { id, range, hint } => {
                let blocks = self.blocks_of(id, &range);
                self.prefetch.hint(id, blocks, hint);
            }
            Command::Stats { reply } => {
                let snapshot = self.snapshot();
                let _ = reply.send(snapshot);
            }
            Command::TakeTrace { reply } => {
                let trace = self
                    .log
                    .trace
                    .as_mut()
                    .map(std::mem::take)
                    .unwrap_or_default();
                let _ = reply.send((trace, std::mem::take(&mut self.log.untraced)));
            }
            Command::Shutdown => self.shutting_down = true,
        }
        Ok(())
    }

    fn blocks_of(&self, id: RegionId, range: &Range<u64>) -> Range<u32> {
        self.regions
            .get(&id)
            .map(|region| region.layout.blocks_overlapping(range.clone()))
            .unwrap_or(0..0)
    }

    fn remove_region(&mut self, id: RegionId) {
        self.recent.region_removed(id);
        let staged: Vec<BlockRef> = self
            .staged
            .iter()
            .copied()
            .filter(|block| block.region == id)
            .collect();
        for block in staged {
            self.discard_staged(block);
        }
        self.waiters.retain(|block, _| block.region != id);
        self.locator.remove(id);
        self.prefetch.region_removed(id);
        self.eviction.region_removed(id);
        let Some(region) = self.regions.get_mut(&id) else {
            return;
        };
        for index in 0..region.blocks.len() {
            if region.blocks[index] == BlockState::Resident {
                self.resident -= region.layout.block_bytes(index as u32);
                release_frame(&mut self.store, region, index as u32, true);
            }
        }
        for (index, pinned) in region.pinned.iter().enumerate() {
            if *pinned {
                self.pinned -= region.layout.block_bytes(index as u32);
            }
        }
        region.removed = true;
        if region.reads_in_flight == 0 {
            self.regions.remove(&id);
        }
    }

    /// Drops the blocks overlapping `range`, leaving them in `to` (`Missing`: they fault
    /// back in; `Unmapped`: the program unmapped them and their pages are gone).
    fn drop_blocks(
        &mut self,
        id: RegionId,
        range: &Range<u64>,
        to: BlockState,
    ) -> Result<(), ServiceError> {
        for index in self.blocks_of(id, range) {
            let block = BlockRef::new(id, index);
            let region = self
                .regions
                .get_mut(&id)
                .expect("blocks_of found the region");
            let bytes = region.layout.block_bytes(index);
            if region.pinned[index as usize] {
                region.pinned[index as usize] = false;
                self.pinned -= bytes;
            } else if region.blocks[index as usize] == BlockState::Resident {
                self.eviction.removed(block);
            }
            match region.blocks[index as usize] {
                BlockState::Resident | BlockState::Poisoned => {
                    if region.blocks[index as usize] == BlockState::Resident {
                        self.resident -= bytes;
                    }
                    region.blocks[index as usize] = to;
                    // A dropped block's frame is emptied: a drop gives memory back.
                    release_frame(&mut self.store, region, index, true);
                    if to != BlockState::Unmapped {
                        let memory = region.layout.block_memory(index);
                        self.discard_run((id, memory.start, memory.end))?;
                    }
                    self.stats.dropped_blocks += 1;
                }
                BlockState::Staged { .. } => {
                    self.discard_staged(block);
                    let region = self.regions.get_mut(&id).expect("still there");
                    region.blocks[index as usize] = to;
                }
                BlockState::Missing => region.blocks[index as usize] = to,
                // Unmapped while queued or read: the read is dropped from its queue or
                // finishes without installing anything (see `installed`). A thread
                // waiting on it would wait forever: woken, it faults again on whatever
                // is mapped there now (nothing: SIGSEGV, as without the pager).
                BlockState::Queued | BlockState::Reading if to == BlockState::Unmapped => {
                    region.blocks[index as usize] = to;
                    if self.waiters.remove(&block).is_some() {
                        let memory = region.layout.block_memory(index);
                        let start = region.base + memory.start as usize;
                        let len = (memory.end - memory.start) as usize;
                        let _ = self.uffd.wake(start as *mut libc::c_void, len);
                    }
                }
                // Dropped while queued or read: the read finishes and installs.
                _ => {}
            }
        }
        Ok(())
    }

    fn pin(&mut self, id: RegionId, range: &Range<u64>) -> Result<(), HintError> {
        let blocks = self.blocks_of(id, range);
        let Some(region) = self.regions.get_mut(&id) else {
            return Err(HintError::ServiceGone);
        };
        let requested: u64 = blocks
            .clone()
            .filter(|&index| !region.pinned[index as usize])
            .map(|index| region.layout.block_bytes(index))
            .sum();
        let total = self.pinned + requested;
        if total + self.config.block_size > self.config.budget {
            return Err(HintError::PinExceedsBudget {
                requested,
                total,
                budget: self.config.budget,
                block: self.config.block_size,
            });
        }
        for index in blocks {
            if region.pinned[index as usize] {
                continue;
            }
            region.pinned[index as usize] = true;
            let block = BlockRef::new(id, index);
            match region.blocks[index as usize] {
                BlockState::Resident => self.eviction.removed(block),
                BlockState::Missing | BlockState::Poisoned => {
                    region.blocks[index as usize] = BlockState::Queued;
                    self.demand.push_back(block);
                }
                BlockState::Queued => self.demand.push_back(block),
                BlockState::Reading | BlockState::Staged { .. } | BlockState::Unmapped => {}
            }
        }
        // Staged pinned blocks are installed right away rather than held back.
        let staged_pinned: Vec<BlockRef> = self
            .staged
            .iter()
            .copied()
            .filter(|block| block.region == id && region.pinned[block.index as usize])
            .collect();
        for block in staged_pinned {
            self.discard_staged(block);
            if let Some(region) = self.regions.get_mut(&id) {
                region.blocks[block.index as usize] = BlockState::Queued;
                self.demand.push_back(block);
            }
        }
        self.pinned = total;
        Ok(())
    }

    fn unpin(&mut self, id: RegionId, range: &Range<u64>) {
        for index in self.blocks_of(id, range) {
            let region = self
                .regions
                .get_mut(&id)
                .expect("blocks_of found the region");
            if !region.pinned[index as usize] {
                continue;
            }
            region.pinned[index as usize] = false;
            self.pinned -= region.layout.block_bytes(index);
            if region.blocks[index as usize] == BlockState::Resident {
                self.eviction.inserted(BlockRef::new(id, index));
            }
        }
    }
}

/// Copies `source` into the part of `range` (region offsets) the program still maps.
///
/// # Safety
/// `source` must hold `range`'s bytes and not be written until this returns; the region
/// must stay registered meanwhile.
unsafe fn install_mapped(
    uffd: &Uffd,
    region: &RegionEntry,
    source: *const u8,
    range: Range<u64>,
    page: usize,
) -> Result<(), InstallError> {
    let target = region.base + range.start as usize;
    for part in region.mapped_parts(range) {
        // SAFETY: the part lies inside the range `source` holds, in a mapped part of a
        // registered region (the caller's guarantees).
        unsafe {
            install(
                uffd,
                source.wrapping_add(part.start - target),
                part.start,
                part.end - part.start,
                page,
            )
        }?;
    }
    Ok(())
}

/// Maps block `index`'s frame over the parts of the block the program still maps,
/// populated, registers them for missing and minor faults, and wakes the threads
/// waiting there (the zero-copy install). A thread touching the block meanwhile sees
/// either the old mapping, which faults, or the new one, which holds the block's bytes:
/// the frame was filled before it is mapped.
fn map_frame(
    uffd: &Uffd,
    store: &FrameStore,
    region: &RegionEntry,
    index: u32,
) -> Result<(), ServiceError> {
    let frame = region.frames[index as usize];
    let memory = region.layout.block_memory(index);
    let target = region.base + memory.start as usize;
    let len = (memory.end - memory.start) as usize;
    let map_error = |addr: usize, error: std::io::Error| ServiceError::MapFrame { addr, error };
    for part in region.mapped_parts(memory) {
        let bytes = part.end - part.start;
        let offset = store.offset(frame) + (part.start - target) as u64;
        // SAFETY: replaces a part of a live region that the program still maps (the
        // service learns of every unmap before it happens) with the block's own bytes;
        // nothing but the program's reads reaches this range.
        unsafe {
            crate::sys::mmap(
                part.start,
                bytes,
                region.prot,
                libc::MAP_SHARED | libc::MAP_FIXED | libc::MAP_POPULATE,
                store.fd(),
                offset as i64,
            )
        }
        .map_err(|error| map_error(part.start, error))?;
        // As for the reservation: a forked child must not see the range.
        // SAFETY: advises a mapping of the service's own; DONTFORK discards nothing.
        unsafe { crate::sys::madvise(part.start, bytes, libc::MADV_DONTFORK) }
            .map_err(|error| map_error(part.start, error))?;
        uffd.register_with_mode(
            part.start as *mut libc::c_void,
            bytes,
            RegisterMode::MISSING | RegisterMode::MINOR,
        )
        .map_err(|error| map_error(part.start, std::io::Error::other(format!("{error:?}"))))?;
    }
    let _ = uffd.wake(target as *mut libc::c_void, len);
    Ok(())
}

/// Gives block `index`'s frame back to the store (see `FrameStore::release`), if it
/// has one.
fn release_frame(
    store: &mut Option<FrameStore>,
    region: &mut RegionEntry,
    index: u32,
    free_memory: bool,
) {
    if let (Some(store), Some(frame)) = (store, region.frames.get_mut(index as usize)) {
        if *frame != NO_FRAME {
            store.release(*frame, free_memory);
            *frame = NO_FRAME;
        }
    }
}

/// Most markers held back at once: one per queue slot, within 4 MiB of stash.
fn max_staged(queue_depth: u32, block_size: u64) -> usize {
    (queue_depth as u64).min((4 << 20) / block_size).max(1) as usize
}

/// File offset of a block's first byte (0 for a region already gone).
fn region_file_offset(regions: &HashMap<RegionId, RegionEntry>, block: BlockRef) -> u64 {
    regions
        .get(&block.region)
        .map(|region| region.file_offset + block.index as u64 * region.layout.block_size)
        .unwrap_or(0)
}

/// Poisons the missing pages of `[start, start + len)` (SIGBUS on access) and wakes their
/// waiters; pages already present are left alone. Returns how many pages were poisoned.
fn poison_range(uffd: &Uffd, start: usize, len: usize, page: usize) -> u64 {
    let mut poisoned = 0u64;
    let mut at = start;
    let end = start + len;
    while at < end {
        match uffd_ext::poison(uffd.as_raw_fd(), at, end - at) {
            Partial::Done => {
                poisoned += ((end - at) / page) as u64;
                break;
            }
            Partial::Stopped { done, .. } => {
                poisoned += done / page as u64;
                // The page after what was done exists (or vanished): skip it.
                at += done as usize + page;
            }
        }
    }
    poisoned
}

/// Drops pages so the range faults again on next access.
fn discard_pages(start: usize, end: usize) -> Result<(), ServiceError> {
    // Locked pages too (see `sys::discard`): the budget bounds the region whatever the
    // program asked of the kernel. Plain MADV_DONTNEED on a region the program had
    // mlocked through the kernel failed here, which stopped the service and the program.
    // SAFETY: the range is a page-aligned part of a region this service serves; its
    // contents are file bytes that can be read again, and no reference the service holds
    // points into it.
    match unsafe { crate::sys::discard(start, end - start) } {
        // ENOMEM: part of the range was unmapped by the program (a block cut by a
        // partial munmap); the kernel still dropped the pages of the mapped parts.
        Err(error) if error.raw_os_error() == Some(libc::ENOMEM) => Ok(()),
        result => result.map_err(|error| ServiceError::Evict { addr: start, error }),
    }
}

/// Whether the page at `addr` (page aligned, in a region this service serves) is in the
/// process's page tables (or in swap: a fault there is no userfault).
fn page_present(addr: usize) -> bool {
    let mut state = 0u8;
    // SAFETY: mincore reads the page tables of one page of a live mapping and writes one
    // byte into `state`.
    let rc = unsafe { libc::mincore(addr as *mut libc::c_void, 1, &mut state) };
    // A failure (the page was unmapped meanwhile) is answered as present: waking the
    // thread is then what the fault needs.
    rc != 0 || state & 1 == 1
}

/// Reports why the service stopped and ends the process: threads waiting on faults
/// would otherwise hang forever. Written with write(2): stderr's lock may be held by a
/// thread that is itself waiting on a fault.
fn fatal(why: &str) -> ! {
    let message =
        format!("hyperoffload: the fault service failed and the process cannot continue: {why}\n");
    // SAFETY: writes a live buffer to fd 2.
    unsafe { libc::write(2, message.as_ptr().cast(), message.len()) };
    std::process::abort();
}
