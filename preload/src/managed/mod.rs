//! What the shim does to the calls it takes over: the process-wide pager, the registry of
//! managed mappings, and one method per kind of call. Every method returns `None` when
//! the call is not the shim's business, and the hook then passes it to the kernel.
//!
//! A `Shim` knows nothing of the process's state (`state` holds the one instance and
//! decides when hooks reach it); what must happen when its pager starts (the exit
//! report's registration) is the function given to `Shim::new`.
//!
//! Locks: the registry lock is held only to look up or edit the registry, never while
//! talking to the fault service or touching managed memory, and the service never takes
//! it. `layout` serialises the calls that create or remove managed mappings, so that a
//! region being torn down cannot meet a new one the kernel placed at its old address.
//! Calls over a range walk its pieces (`for_each_piece`): managed ones are served by
//! their region, the others go to the kernel, and the first error is the call's.
//!
//! Here: the shim's state and the start of its pager. Each kind of call is a child's:
//! `take_file` (which files mmap takes over), `map` (mmap), `pieces` (munmap and
//! MAP_FIXED), `calls` (madvise, mlock, mremap), `attached` (another process's pager),
//! `fork`, and `seen_files` (what became of each model file).

use std::ops::Range;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use hyperoffload::budget::floor;
use hyperoffload::budget::memory_limits::{self, budget_warning};
use hyperoffload::policy::graph::GraphPrediction;
use hyperoffload::policy_name::{policies_by_name, ModelHint};
use hyperoffload::shim_config::{BudgetSpec, ShimConfig, Sizing};
use hyperoffload::size::format_size;
use hyperoffload::sys;
use hyperoffload::{Pager, Region};
use libc::c_int;

use crate::raw;
use crate::read_ahead;
use crate::registry::Registry;
use crate::seen::Seen;

mod attached;
mod calls;
mod fork;
mod map;
mod pieces;
mod seen_files;
mod take_file;

/// The kernel's page size.
pub fn page() -> usize {
    sys::memory::page_size() as usize
}

/// A region the shim made, and which file it presents.
pub struct ManagedRegion {
    region: Region,
    file: usize,
    /// Where the region starts in its file, and the protection the program asked for:
    /// what a forked child maps in its place (see `fork`).
    file_offset: u64,
    prot: c_int,
    /// The loading hints granted this region (see `read_ahead`): how far, and what they
    /// took of the process's allowance, given back when the region goes.
    read_ahead: Mutex<RegionReadAhead>,
    allowance: Arc<AtomicU64>,
}

#[derive(Default)]
struct RegionReadAhead {
    granted_end: u64,
    charged: u64,
}

impl Drop for ManagedRegion {
    fn drop(&mut self) {
        let taken = self
            .read_ahead
            .get_mut()
            .map_or(0, |read_ahead| read_ahead.charged);
        let _ = self
            .allowance
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                Some(used.saturating_sub(taken))
            });
    }
}

/// A file a mapping request is for, as the shim screened it (see `Shim::take_file`).
struct MappedFile {
    stat: sys::files::Stat,
    /// The kernel's name for it: the one the pager opens.
    path: PathBuf,
    /// The name the program gave it (see `given_name`), else `path`.
    name: PathBuf,
    size: u64,
    /// The bytes of the model it belongs to (all its files for a split GGUF).
    model_len: u64,
}

/// A managed piece of an address range (see `Shim::for_each_piece`): its mapping, where
/// it lies (`pages`, in the mapping starting at `base`) and its offsets in the region.
struct ManagedPiece {
    mapping: Arc<ManagedRegion>,
    base: usize,
    pages: Range<usize>,
    offsets: Range<u64>,
}

/// A file the shim has managed at least one mapping of.
pub struct ManagedFile {
    pub path: PathBuf,
    pub size: u64,
    dev: u64,
    ino: u64,
}

enum PagerSlot {
    NotYet,
    Running(Pager),
    /// It could not start: the error, for the record of each file left to the kernel.
    Failed(String),
}

pub struct Shim {
    pub config: ShimConfig,
    pager: Mutex<PagerSlot>,
    registry: Mutex<Registry<Arc<ManagedRegion>>>,
    /// Managed mappings alive: lets hooks skip the registry while there are none.
    mapped: AtomicUsize,
    /// Bytes the live regions' MAP_POPULATE and WILLNEED read ahead (see
    /// `bounded_prefetch`).
    read_ahead: Arc<AtomicU64>,
    layout: Mutex<()>,
    files: Mutex<Vec<ManagedFile>>,
    trace: Mutex<Vec<String>>,
    /// What the pager runs ("graph (tensor table, ...)"), once started.
    policy_in_use: Mutex<String>,
    /// The model whose graph this run learns, and the layout to save it for.
    learning: Mutex<Option<(PathBuf, hyperoffload::geometry::BlockGeometry)>>,
    /// A mixture of experts' model, and the prediction whose expert counts are saved
    /// for its next run.
    experts: Mutex<Option<(PathBuf, Arc<GraphPrediction>)>>,
    /// The saved graph this run follows, if it is a learned one (`PolicyPair`).
    followed_graph: Mutex<Option<PathBuf>>,
    start: Instant,
    warned_mremap: AtomicBool,
    warned_advice: AtomicBool,
    warned_mlock: AtomicBool,
    warned_map: AtomicBool,
    /// Called once the pager runs (the owner registers the exit report then).
    on_pager_start: fn(),
    /// What became of each model file the program opened or mapped.
    seen: Seen,
    /// The program's arguments (`/proc/self/cmdline`), read once: the names it gave its
    /// files are those it started with (see `given_name`).
    cmdline: std::sync::OnceLock<Vec<u8>>,
    /// Mappings served by another process's pager (`attached`), and how many.
    attached: Mutex<Vec<attached::Attached>>,
    attached_count: AtomicUsize,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Most faults kept for `HYPEROFFLOAD_TRACE` (about 50 bytes each).
const TRACE_LIMIT: usize = 10_000_000;

/// Errno for a managed-range operation, or success.
pub type Errno = Result<(), c_int>;

impl Shim {
    /// The shim for `config`; `on_pager_start` is called when its pager starts.
    pub fn new(config: ShimConfig, on_pager_start: fn()) -> Self {
        Self {
            seen: Seen::new(
                config.snapshot_dir.clone(),
                config.min_size,
                config.patterns.clone(),
            ),
            config,
            pager: Mutex::new(PagerSlot::NotYet),
            registry: Mutex::new(Registry::default()),
            mapped: AtomicUsize::new(0),
            read_ahead: Arc::new(AtomicU64::new(0)),
            layout: Mutex::new(()),
            files: Mutex::new(Vec::new()),
            trace: Mutex::new(Vec::new()),
            policy_in_use: Mutex::new(String::new()),
            learning: Mutex::new(None),
            experts: Mutex::new(None),
            followed_graph: Mutex::new(None),
            start: Instant::now(),
            warned_mremap: AtomicBool::new(false),
            warned_advice: AtomicBool::new(false),
            warned_mlock: AtomicBool::new(false),
            warned_map: AtomicBool::new(false),
            on_pager_start,
            cmdline: std::sync::OnceLock::new(),
            attached: Mutex::new(Vec::new()),
            attached_count: AtomicUsize::new(0),
        }
    }

    pub fn say(&self, message: &str) {
        raw::write_stderr(format!("hyperoffload: {message}\n").as_bytes());
    }

    pub fn verbose(&self, message: impl FnOnce() -> String) {
        if self.config.verbose {
            self.say(&message());
        }
    }

    fn warn_once(&self, flag: &AtomicBool, message: impl FnOnce() -> String) {
        if !flag.swap(true, Ordering::Relaxed) {
            self.say(&message());
        }
    }

    fn record(&self, event: impl FnOnce() -> serde_json::Value) {
        if self.config.trace_path.is_some() {
            let mut line = event();
            line["t_ms"] = (self.start.elapsed().as_secs_f64() * 1e3).into();
            lock(&self.trace).push(line.to_string());
        }
    }

    /// Whether any managed mapping is alive (a hint: checked again under the lock).
    pub fn has_mappings(&self) -> bool {
        self.mapped.load(Ordering::Acquire) > 0
    }

    pub fn pager_if_running(&self) -> Option<Pager> {
        match &*lock(&self.pager) {
            PagerSlot::Running(pager) => Some(pager.clone()),
            _ => None,
        }
    }

    pub fn files(&self) -> Vec<(PathBuf, u64)> {
        lock(&self.files)
            .iter()
            .map(|file| (file.path.clone(), file.size))
            .collect()
    }

    pub fn managed_count(&self) -> usize {
        self.mapped.load(Ordering::Acquire)
    }

    pub fn policy_in_use(&self) -> String {
        lock(&self.policy_in_use).clone()
    }

    /// The model to learn a graph for, if this run records one.
    pub fn learning(&self) -> Option<(PathBuf, hyperoffload::geometry::BlockGeometry)> {
        lock(&self.learning).clone()
    }

    /// The mixture of experts this run learns the routing of, if it is one.
    pub fn expert_learning(&self) -> Option<(PathBuf, Arc<GraphPrediction>)> {
        lock(&self.experts).clone()
    }

    /// The learned graph this run follows, if it follows one.
    pub fn followed_graph(&self) -> Option<PathBuf> {
        lock(&self.followed_graph).clone()
    }

    pub fn take_trace(&self) -> Vec<String> {
        std::mem::take(&mut *lock(&self.trace))
    }

    /// A descriptor of the keeper's socket for a pager that serves forks (see
    /// `hyperoffload::keeper`), private to this image (close-on-exec: the inherited one
    /// stays for the next image of this process).
    fn keeper_socket(&self) -> Option<std::os::fd::OwnedFd> {
        let forks = self.config.serve_forks || self.config.serve_forks_at_fork;
        let fd = self.config.keeper_fd.filter(|_| forks)?;
        // A number from the environment: the program may have closed it since.
        let open = hyperoffload::sys::files::is_open(fd).then(|| {
            // SAFETY: `fd` is open (checked just now) and is the launcher's socket, which
            // the shim never closes and the program has no reason to (only the shim's
            // environment names it); borrowed for the two calls below only.
            unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) }
        });
        let Some(borrowed) = open.filter(|&fd| hyperoffload::sys::sockets::is_seqpacket(fd)) else {
            self.say(&format!(
                "descriptor {fd} is not the keeper's socket any more (the program closed \
                 it): forked children alive when this process ends by _exit, a signal or an \
                 exec may read zeros where a block was not resident"
            ));
            return None;
        };
        hyperoffload::sys::files::dup_cloexec(borrowed).ok()
    }

    /// The process's pager, created at the first managed mapping as `sizing` says (its
    /// model's size, all its files for a split GGUF, sets a percentage budget: see
    /// `pager_for`). The one thread that starts it says first if the budget was raised
    /// to what the pager needs, or, for a percentage (a budget in bytes was checked by
    /// the launcher), if it is more than the machine can give.
    fn pager(&self, first: &ModelHint<'_>, sizing: &Sizing) -> Option<Pager> {
        let mut slot = lock(&self.pager);
        match &*slot {
            PagerSlot::Running(pager) => return Some(pager.clone()),
            PagerSlot::Failed(_) => return None,
            PagerSlot::NotYet => {}
        }
        let budget = sizing.budget;
        if let Some(raise) = sizing.raised {
            self.say(&raise.to_string());
        }
        if matches!(self.config.budget, BudgetSpec::ModelPercent(_)) {
            if let Some(warning) = budget_warning(budget, &memory_limits::read()) {
                self.say(&warning.to_string());
            }
        }
        let built = self.build_pager(first, budget);
        match built {
            Ok(BuiltPager {
                pager,
                policy,
                learn,
                experts,
                followed,
            }) => {
                *lock(&self.followed_graph) = followed;
                *slot = PagerSlot::Running(pager.clone());
                *lock(&self.policy_in_use) = policy.clone();
                *lock(&self.learning) = learn.map(|layout| (first.path.to_path_buf(), layout));
                *lock(&self.experts) =
                    experts.map(|prediction| (first.path.to_path_buf(), prediction));
                (self.on_pager_start)();
                self.verbose(|| {
                    format!(
                        "pager started: budget {} ({}), policy {policy}",
                        format_size(budget),
                        self.config.budget,
                    )
                });
                Some(pager)
            }
            Err(error) => {
                *slot = PagerSlot::Failed(error.clone());
                self.say(&format!(
                    "cannot start the pager: {error}; model files are left to the kernel"
                ));
                None
            }
        }
    }

    /// A pager of `budget` with the policies the configuration names, for the model
    /// `first` was mapped from.
    fn build_pager(&self, first: &ModelHint<'_>, budget: u64) -> Result<BuiltPager, String> {
        let policies = policies_by_name(&self.config.policy, Some(first))
            .map_err(|error| error.to_string())?;
        let mut builder = Pager::builder()
            .budget(budget)
            .block_size(first.block_size)
            .zero_copy(self.config.zero_copy)
            .serve_forks(self.config.serve_forks)
            .serve_forks_at_fork(self.config.serve_forks_at_fork)
            .prefetch(policies.prefetch)
            .eviction(policies.eviction);
        if let Some(threads) = self.config.install_threads {
            builder = builder.install_threads(threads);
        }
        if let Some(socket) = self.keeper_socket() {
            builder = builder.keeper(socket);
        }
        if let Some(dir) = &self.config.share_dir {
            builder = builder.share_dir(dir.clone());
        }
        if self.config.budget == BudgetSpec::Auto {
            // The budget follows pressure (see `state::start_following`), up to this.
            let ceiling = self
                .config
                .auto_ceiling(budget, hyperoffload::sys::memory::physical_ram());
            builder = builder.max_budget(ceiling);
        }
        if self.config.trace_path.is_some() || policies.learn.is_some() {
            builder = builder.trace(TRACE_LIMIT);
        }
        let pager = builder.build().map_err(|error| error.to_string())?;
        Ok(BuiltPager {
            pager,
            policy: policies.description,
            learn: policies.learn,
            experts: policies.experts,
            followed: policies.followed_graph,
        })
    }

    /// The pager, to map `data_len` bytes at `offset` of `file` (blocks cut at
    /// `block_cuts`): started if this is the first mapping (its model sets the budget,
    /// and the budget the block size).
    fn pager_for(
        &self,
        file: &MappedFile,
        offset: u64,
        data_len: u64,
        block_cuts: &[u64],
    ) -> Option<Pager> {
        match &*lock(&self.pager) {
            PagerSlot::Running(pager) => return Some(pager.clone()),
            PagerSlot::Failed(_) => return None,
            PagerSlot::NotYet => {}
        }
        // Another thread may start it meanwhile: `pager` then returns that one.
        let auto = || {
            self.config
                .bounded_auto(hyperoffload::budget::memory_limits::auto_budget_now())
        };
        let sizing = self.config.sizing(
            self.config.budget.resolve(file.model_len, auto),
            file.model_len,
            floor::threads(),
        );
        let hint = ModelHint {
            path: &file.name,
            file_offset: offset,
            data_len,
            block_size: sizing.block_size,
            block_cuts,
            saved_experts: self.config.saved_experts,
        };
        self.pager(&hint, &sizing)
    }

    /// Whether `fd` is a file the shim manages mappings of.
    pub fn is_managed_file(&self, fd: c_int) -> bool {
        let Some(stat) = raw::fstat(fd) else {
            return false;
        };
        lock(&self.files)
            .iter()
            .any(|f| f.dev == stat.st_dev && f.ino == stat.st_ino)
    }

    /// Reads ahead what `read_ahead::grant` allows of a MAP_POPULATE or WILLNEED over
    /// `range`: at most half the budget, loading's hints of all live regions together.
    fn bounded_prefetch(&self, managed: &ManagedRegion, range: Range<u64>) {
        let cap = managed.region.pager().budget() / 2;
        let mapping_len = managed.region.len() as u64;
        let mut state = lock(&managed.read_ahead);
        let mut grant = None;
        let _ = self
            .read_ahead
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                let left = cap.saturating_sub(used);
                let chosen =
                    read_ahead::grant(range.clone(), mapping_len, state.granted_end, left, cap);
                let charged = chosen.charged;
                grant = Some(chosen);
                Some(used + charged)
            });
        let Some(grant) = grant.filter(|grant| !grant.read.is_empty()) else {
            return;
        };
        if grant.charged > 0 {
            state.charged += grant.charged;
            state.granted_end = state.granted_end.max(grant.read.end);
        }
        drop(state);
        let _ = managed.region.prefetch(grant.read);
    }
}

/// A pager just built, and what its policies said of themselves.
struct BuiltPager {
    pager: Pager,
    /// The policies' description, for people.
    policy: String,
    /// The geometry of the model to learn a graph for, if this run records one.
    learn: Option<hyperoffload::geometry::BlockGeometry>,
    /// The mixture of experts whose routing this run learns, if it is one.
    experts: Option<Arc<GraphPrediction>>,
    /// The learned graph the run follows, if it follows one.
    followed: Option<PathBuf>,
}
