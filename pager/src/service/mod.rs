//! The fault service: one thread that turns userfaultfd page faults into io_uring reads
//! and installs what they read, keeping resident bytes within the budget.
//!
//! Everything waits on the ring: multishot polls on the userfaultfd and on the command
//! eventfd complete like reads do, so one `submit_and_wait` covers faults, commands and
//! finished reads (`serve`, here). The thread never touches a managed page itself, never
//! takes a lock a faulting thread may hold (it does not print; it locks only its own
//! command queue and stats), and if it fails it aborts the process with a message rather
//! than leave threads waiting on faults forever.
//!
//! The parts, in the order a fault meets them (docs/ARCHITECTURE.md has the whole path):
//! - `watch`: which descriptor a readiness reaped from the ring is for (the program's
//!   userfaultfd, the commands, a forked child's userfaultfd, a guest's connection...).
//! - `intake`: a fault is located (region, block) and moves its block's state; the
//!   policies hear of it and plan prefetches.
//! - `reads`: queued blocks become io_uring reads within the queue depth, after `room`
//!   made space in the `budget`; completions are checked, retried or failed.
//! - `installs`: finished reads are copied or mapped in and waiters woken, through
//!   `page_tables`, the only part that changes page tables. `staging` holds prefetch
//!   markers back until the program touches them.
//! - `commands`: the API side's requests (`crate::command`): regions, drops, pins.
//!
//! Each block's state lives in its `region` and changes only through `block_state`'s
//! transition function; the `budget` counts resident, reserved and pinned bytes and
//! nothing else changes them.

mod block_state;
mod breaches;
mod budget;
mod children;
mod commands;
mod fault_log;
mod fork_pause;
mod injection;
mod install_pool;
mod installs;
mod intake;
mod keeping;
mod outliving;
mod page_tables;
mod reads;
mod region;
mod resize;
mod room;
mod shaping;
mod sharing;
mod staging;
#[cfg(test)]
mod tests;
mod watch;

use std::collections::{HashMap, VecDeque};
use std::ops::Range;
use std::os::fd::AsRawFd;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Instant;

use userfaultfd::{EventBuffer, Uffd};

use self::breaches::Breaches;
use self::budget::Budget;
use self::children::{Backlog, Children};
use self::fault_log::{FaultLog, Waiter};
#[cfg(feature = "fault-injection")]
pub(crate) use self::injection::InjectedFaults;
pub(crate) use self::install_pool::InstallPool;
use self::install_pool::{raise_priority, Installed};
use self::page_tables::InstallError;
use self::reads::{ReadLoad, ReadTag};
use self::region::ServedRegion;
use self::staging::max_staged;
use self::watch::Watch;
use crate::command::Shared;
use crate::keeper::link::KeeperLink;
use crate::layout::FaultLocator;
use crate::policy::{BlockRef, EvictionPolicy, PrefetchPolicy, PrefetchRequest, RegionId};
use crate::recent_faults::RecentFaults;
use crate::ring::{Completion, ReadRing, RingError};
use crate::shared_store::FrameStore;
use crate::stash::Stash;
use crate::stats::{LatencyHistogram, Stats};

pub(crate) struct ServiceConfig {
    pub budget: u64,
    /// The least budget `Command::SetBudget` may set (at most `budget`).
    pub budget_floor: u64,
    /// The most budget `Command::SetBudget` may set (at least `budget`): the frame
    /// store holds this many bytes of frames.
    pub budget_ceiling: u64,
    pub block_size: u64,
    pub max_read: u64,
    pub queue_depth: u32,
    pub read_attempts: u32,
    pub page_size: u64,
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
    /// Whether forked children's userfaultfds (fork events) are served; regions are then
    /// file-shaped (`crate::shaped_region`).
    pub serve_forks: bool,
    /// With `serve_forks`: whether reads land in the regions' files through the
    /// service's view of them, and are mapped with UFFDIO_CONTINUE (else copied in).
    pub read_in_place: bool,
    /// Why forked children are not served though asked for.
    pub forks_refused: Option<String>,
    /// With zero copy and `serve_forks` off: where the regions' files are made when the
    /// program first forks, which makes them file-shaped and sets `serve_forks`
    /// (`shaping`); None: forked children are not served.
    pub shape_at_fork: Option<Arc<crate::shaped_region::ShapeFiles>>,
    /// With `serve_forks`: the keeper's socket (`crate::keeper`), a session on which
    /// the service starts from its own thread.
    pub keeper: Option<std::os::fd::OwnedFd>,
    /// With `serve_forks`: the run's share directory (`crate::share`), where this
    /// pager lets other processes of the run attach to its regions.
    pub share_dir: Option<std::path::PathBuf>,
    #[cfg(feature = "fault-injection")]
    pub faults: InjectedFaults,
    /// Unit tests: reads end as this says, on a scripted ring instead of io_uring.
    #[cfg(test)]
    pub read_script: Option<crate::ring::scripted::ReadScript>,
}

pub(crate) struct FaultService {
    config: ServiceConfig,
    uffd: Arc<Uffd>,
    shared: Arc<Shared>,
    ring: ReadRing<ReadTag>,
    prefetch: Box<dyn PrefetchPolicy>,
    eviction: Box<dyn EvictionPolicy>,
    regions: HashMap<RegionId, ServedRegion>,
    locator: FaultLocator,
    demand: VecDeque<BlockRef>,
    prefetch_queue: VecDeque<PrefetchRequest>,
    /// Blocks to read while the device idles, into free budget (`Urgency::IdleFill`).
    idle_fill: VecDeque<BlockRef>,
    staged: VecDeque<BlockRef>,
    /// Fault times of threads waiting on each block, for the latency histogram.
    waiters: HashMap<BlockRef, Vec<Waiter>>,
    budget: Budget,
    /// Invariants broken and stepped over (`breaches`), counted in the stats.
    breaches: Breaches,
    load: ReadLoad,
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
    /// Readiness reaped while the service waited for its reads alone
    /// (`finish_reads_in_flight`), handled on the next turn.
    deferred: Vec<Completion>,
    /// Worker threads that install prefetched reads (none: all installs on this thread).
    installs: Option<InstallPool>,
    installed: Vec<Installed>,
    /// Finished reads nobody waits for yet, to install once new reads are issued.
    ready: VecDeque<u32>,
    /// The bytes of staged markers.
    stash: Stash,
    /// With zero copy: the frames reads land in and regions map.
    store: Option<FrameStore>,
    /// Forked children served (with `ServiceConfig::serve_forks`).
    children: Children,
    /// Events read while an install waited on a fork, to serve next.
    backlog: Backlog,
    /// Set once regions' files were filled for children that outlive the service
    /// (`outliving`): an eviction then leaves the pages in the files, since a hole
    /// would read as zeros in those children once the service is gone.
    pages_kept: bool,
    /// The keeper outside the process, told of regions and children (with
    /// `ServiceConfig::keeper`).
    keeper: Option<KeeperLink>,
    /// Guests attached to this pager's regions (with `ServiceConfig::share_dir`).
    share: Option<sharing::ShareHost>,
    /// Commands that wait while regions are being moved at a fork
    /// (`Command::waits_for_moves`).
    held_for_moves: VecDeque<crate::command::Command>,
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
        mut config: ServiceConfig,
        uffd: Arc<Uffd>,
        shared: Arc<Shared>,
        prefetch: Box<dyn PrefetchPolicy>,
        eviction: Box<dyn EvictionPolicy>,
        installs: Option<InstallPool>,
        store: Option<FrameStore>,
    ) -> Result<Self, RingError> {
        let ring = read_ring(&mut config)?;
        let stash = Stash::new(
            max_staged(config.queue_depth, config.block_size) as u32,
            config.block_size as usize,
            config.page_size as usize,
        );
        let trace_limit = config.trace_limit;
        let budget = Budget::new(config.budget);
        let stats = Stats {
            budget_bytes: config.budget,
            budget_history: vec![crate::budget::history::BudgetPoint {
                t_s: 0.0,
                bytes: config.budget,
            }],
            block_size: config.block_size,
            queue_depth: config.queue_depth,
            install_threads: installs.as_ref().map_or(0, |pool| pool.threads() as u32),
            direct_io: true,
            zero_copy: store.is_some(),
            zero_copy_refused: config.zero_copy_refused.clone(),
            serve_forks: config.serve_forks,
            forks_refused: config.forks_refused.clone(),
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
            idle_fill: VecDeque::new(),
            staged: VecDeque::new(),
            waiters: HashMap::new(),
            budget,
            breaches: Breaches::default(),
            load: ReadLoad::default(),
            stats,
            log: FaultLog::new(trace_limit),
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
            deferred: Vec::new(),
            installs,
            installed: Vec::new(),
            ready: VecDeque::new(),
            stash,
            store,
            children: Children::default(),
            backlog: Backlog::default(),
            pages_kept: false,
            keeper: None,
            share: None,
            held_for_moves: VecDeque::new(),
        })
    }

    /// Serves until shutdown. Any failure ends the process: a thread waiting on a fault
    /// that nobody will serve would otherwise hang forever.
    pub(crate) fn run(mut self) {
        self.stats.thread_nice = raise_priority(self.config.thread_nice);
        if let Some(socket) = self.config.keeper.take() {
            match KeeperLink::start(socket) {
                Ok(link) => self.keeper = Some(link),
                Err(error) => crate::sys::files::write_stderr(
                    format!(
                        "hyperoffload: cannot reach the keeper ({error}): forked children alive \
                         when this process ends by _exit, a signal or an exec may read zeros \
                         where a block was not resident\n"
                    )
                    .as_bytes(),
                ),
            }
        }
        let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| self.serve()));
        let why = match outcome {
            Ok(Ok(())) => {
                self.shared
                    .stopped
                    .store(true, std::sync::atomic::Ordering::Release);
                return;
            }
            Ok(Err(error)) => error.to_string(),
            Err(panic) => panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "panic".into()),
        };
        fatal(&why);
    }

    pub(super) fn page(&self) -> usize {
        self.config.page_size as usize
    }

    pub(super) fn now_ns(&self) -> u64 {
        self.start.elapsed().as_nanos() as u64
    }

    /// The blocks of region `id` overlapping `range` (none if it is gone).
    pub(super) fn blocks_of(&self, id: RegionId, range: &Range<u64>) -> Range<u32> {
        self.regions
            .get(&id)
            .map(|region| region.layout.blocks_overlapping(range.clone()))
            .unwrap_or(0..0)
    }

    fn serve(&mut self) -> Result<(), ServiceError> {
        self.ring
            .watch(self.uffd.as_raw_fd(), Watch::Faults.token())?;
        self.ring
            .watch(self.shared.wakeup.as_raw_fd(), Watch::Commands.token())?;
        if let Some(pool) = &self.installs {
            self.ring.watch(pool.event_fd(), Watch::Installed.token())?;
        }
        self.start_sharing()?;
        loop {
            if self.load.demand_in_flight() >= self.config.demand_spin_min_reads
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
            completions.append(&mut self.deferred);
            for completion in completions.drain(..) {
                self.complete(completion)?;
            }
            self.completions = completions;
            // Faults read while an install waited on a fork.
            self.take_backlog()?;
            // After the budget shrank, what reads in flight held is evicted as they end.
            self.shed_excess()?;
            // Keep the device busy first: issue reads for the slots and budget free
            // now, then install what finished (installs take far longer than issuing).
            self.pump()?;
            if !self.ready.is_empty() {
                self.ring.submit()?;
                self.install_ready()?;
                // Installs freed slots: fill them (submitted on the next turn).
                self.pump()?;
            }
            if !self.backlog.is_empty() {
                self.take_backlog()?;
                self.pump()?;
            }
            // Children's threads whose blocks were installed (or failed) this turn.
            self.settle_children();
            let now = self.now_ns();
            if now - self.last_publish_ns > 100_000_000 {
                self.reap_children()?;
                self.publish();
            }
            if self.shutting_down && self.ring.reads_in_flight() == 0 {
                self.publish();
                return Ok(());
            }
        }
    }

    /// Handles what the ring reaped: a read finished, or a watched descriptor is
    /// readable.
    fn complete(&mut self, completion: Completion) -> Result<(), ServiceError> {
        match completion {
            Completion::Read { slot, result } => self.read_done(slot, result),
            Completion::Readable { token, rearm } => match Watch::from_token(token) {
                Some(watch) => self.readable(watch, rearm),
                // Every poll is armed with a watch's token (`Watch::token`), so another
                // number is a bug in the ring's bookkeeping: no part owns the
                // descriptor, and serving nothing for it is all the service can do.
                None => {
                    self.breaches.record(format_args!(
                        "a poll completed with token {token}, which no watch gives"
                    ));
                    Ok(())
                }
            },
        }
    }

    /// `watch` is readable: the part that owns it serves it, and polls it again if
    /// `rearm` (the kernel ended the multishot poll).
    fn readable(&mut self, watch: Watch, rearm: bool) -> Result<(), ServiceError> {
        match watch {
            Watch::Faults => self.faults_readable(rearm),
            Watch::Commands => self.commands_readable(rearm),
            Watch::Installed => self.installs_readable(rearm),
            Watch::ShareListen => self.share_listen_readable(rearm),
            Watch::Child(number) => self.child_readable(number, rearm),
            Watch::Guest(number) => self.guest_readable(number, rearm),
        }
    }

    fn snapshot(&mut self) -> Stats {
        let mut stats = self.stats.clone();
        stats.resident_bytes = self.budget.resident();
        stats.peak_resident_bytes = self.budget.peak_resident();
        stats.pinned_bytes = self.budget.pinned();
        stats.invariant_breaches = self.breaches.count();
        stats.fault_latency_us = self.log.latency.summary();
        stats.read_latency_us = self.read_latency.summary();
        stats.elapsed_s = self.start.elapsed().as_secs_f64();
        stats.prediction = self.prefetch.confidence();
        stats.co_activation = self.prefetch.co_activation();
        stats.expert_recency = self.prefetch.expert_recency();
        stats.expert_watches = self.prefetch.expert_watches();
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
        self.shared.publish(snapshot);
    }
}

/// The ring the service reads through: io_uring, or in unit tests the scripted ring the
/// configuration asks for (`crate::ring::scripted`).
fn read_ring(config: &mut ServiceConfig) -> Result<ReadRing<ReadTag>, RingError> {
    let (depth, buffer_len) = (config.queue_depth, config.max_read as usize);
    #[cfg(test)]
    if let Some(script) = config.read_script.take() {
        return ReadRing::scripted(depth, buffer_len, script);
    }
    ReadRing::new(depth, buffer_len)
}

/// Reports why the service stopped and ends the process: threads waiting on faults
/// would otherwise hang forever. Written with write(2): stderr's lock may be held by a
/// thread that is itself waiting on a fault.
fn fatal(why: &str) -> ! {
    let message =
        format!("hyperoffload: the fault service failed and the process cannot continue: {why}\n");
    crate::sys::files::write_stderr(message.as_bytes());
    std::process::abort();
}
