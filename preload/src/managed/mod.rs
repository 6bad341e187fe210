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

use std::ffi::OsStr;
use std::ops::Range;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use hyperoffload::budget_floor;
use hyperoffload::map_candidate::{screen_file, FileFacts, MapRequest, PassReason};
use hyperoffload::memory_limits::{self, budget_warning};
use hyperoffload::model::split::model_len;
use hyperoffload::policy::graph::GraphPrediction;
use hyperoffload::policy_name::{policies_by_name, ModelHint};
use hyperoffload::served_files::Refusal;
use hyperoffload::shim_config::{BudgetSpec, ShimConfig, Sizing};
use hyperoffload::size::format_size;
use hyperoffload::sys;
use hyperoffload::{MapOptions, Pager, Region};
use libc::c_int;

use crate::given_name::name_given;
use crate::raw;
use crate::read_ahead;
use crate::registry::{Piece, Registry};
use crate::seen::Seen;

mod attached;
mod calls;
mod fork;
mod seen_files;

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
        let built = policies_by_name(&self.config.policy, Some(first))
            .map_err(|error| error.to_string())
            .and_then(|policies| {
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
                    // The budget follows pressure (see `state::start_following`), up to
                    // this.
                    let ceiling = self
                        .config
                        .auto_ceiling(budget, hyperoffload::sys::memory::physical_ram());
                    builder = builder.max_budget(ceiling);
                }
                if self.config.trace_path.is_some() || policies.learn.is_some() {
                    builder = builder.trace(TRACE_LIMIT);
                }
                let (learn, experts) = (policies.learn, policies.experts);
                let followed = policies.followed_graph;
                builder
                    .build()
                    .map(|pager| (pager, policies.description, learn, experts, followed))
                    .map_err(|error| error.to_string())
            });
        match built {
            Ok((pager, policy, learn, experts, followed)) => {
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

    /// mmap of a request `screen_request` accepted: a region in its place, or `None`.
    pub fn map(&self, request: &MapRequest) -> Option<usize> {
        let file = self.take_file(request)?;
        let offset = request.offset as u64;
        let data_len = (request.len as u64).min(file.size - offset);
        if let Some(base) = self.try_attach(&file, request, offset, data_len) {
            return Some(base);
        }
        let block_cuts = self.block_cuts(&file);
        let pager = self.pager_for(&file, offset, data_len, &block_cuts);
        self.release_claim_unless_hosting(&file, pager.as_ref());
        let Some(pager) = pager else {
            let error = match &*lock(&self.pager) {
                PagerSlot::Failed(error) => error.clone(),
                _ => "it was not started".to_string(),
            };
            let path = file.path.as_os_str().as_bytes();
            let refusal = Refusal::PagerNotStarted(error);
            self.note_refused(request.fd, &file.stat, Some(path), refusal);
            return None;
        };
        let options = MapOptions {
            offset,
            len: Some(data_len),
            map_len: Some((request.len as u64).next_multiple_of(page() as u64)),
            prot: request.prot,
            block_cuts,
        };
        let _layout = lock(&self.layout);
        let managed = match self.map_region(&pager, &file, options, request) {
            Ok(managed) => managed,
            Err(error) => {
                let path = file.path.as_os_str().as_bytes();
                let refusal = Refusal::MapFailed(error);
                self.note_refused(request.fd, &file.stat, Some(path), refusal);
                return None;
            }
        };
        self.note_served(&file.stat, &file.name, file.model_len);
        if request.flags & libc::MAP_POPULATE != 0 {
            self.bounded_prefetch(&managed, 0..managed.region.map_len() as u64);
        }
        Some(managed.region.as_ptr() as usize)
    }

    /// The file `request` maps, if the shim takes it over: its names and its model pass
    /// the configuration (`screen`), and the name the pager opens still leads to it.
    fn take_file(&self, request: &MapRequest) -> Option<MappedFile> {
        let stat = raw::fstat(request.fd)?;
        let mut buffer = [0u8; 4096];
        let Some(path) = raw::fd_path(request.fd, &mut buffer) else {
            self.verbose(|| {
                format!(
                    "fd {}: {}, left to the kernel",
                    request.fd,
                    PassReason::UnknownFile.describe()
                )
            });
            return None;
        };
        let (name, model_len) = match self.screen(request, &stat, path) {
            Ok(taken) => taken,
            Err(reason) => {
                self.verbose(|| {
                    format!(
                        "{}: {}, left to the kernel",
                        String::from_utf8_lossy(path),
                        reason.describe()
                    )
                });
                let refusal = match reason {
                    PassReason::TooSmall => Refusal::TooSmall,
                    PassReason::NameNotMatched => Refusal::NameNotMatched,
                    other => Refusal::Request(other.describe().to_string()),
                };
                self.note_refused(request.fd, &stat, Some(path), refusal);
                return None;
            }
        };
        let path = Path::new(OsStr::from_bytes(path)).to_path_buf();
        // The pager opens the file by name: make sure the name still leads to the
        // descriptor's file (not a replacement, not a deleted one).
        if !names_file(&path, &stat) {
            self.verbose(|| {
                format!(
                    "{}: the name no longer leads to the mapped file, left to the kernel",
                    path.display()
                )
            });
            let kernel_name = path.as_os_str().as_bytes();
            self.note_refused(request.fd, &stat, Some(kernel_name), Refusal::NameChanged);
            return None;
        }
        Some(MappedFile {
            size: stat.st_size as u64,
            stat,
            path,
            name,
            model_len,
        })
    }

    /// Screens the file the kernel names `path` with `screen_file`. If the shim takes
    /// it: the name the program gave it and the size of its model; else why not.
    fn screen(
        &self,
        request: &MapRequest,
        stat: &sys::files::Stat,
        path: &[u8],
    ) -> Result<(PathBuf, u64), PassReason> {
        let size = stat.st_size as u64;
        let is_regular = stat.st_mode & libc::S_IFMT == libc::S_IFREG;
        // The model's size (all its files for a split GGUF) sets a percentage budget,
        // and a small file that is part of a large model is served with the rest. It
        // takes reading the file's header: only for a file the patterns match, the
        // first or a small one.
        let starting = matches!(&*lock(&self.pager), PagerSlot::NotYet);
        let wanted = starting || size < self.config.min_size;
        // The name the patterns and a split model's parts go by: the program's, where it
        // reached the file through symlinks (a Hugging Face cache links each file to a
        // blob named by its hash; see `given_name`), else the kernel's.
        let fd_path = Path::new(OsStr::from_bytes(path));
        let kernel_name_matches = self.config.matches(path);
        let name = if is_regular && (wanted || !kernel_name_matches) {
            self.model_name(fd_path)
        } else {
            fd_path.to_path_buf()
        };
        let (matched, name_matches) = if kernel_name_matches {
            (path, true)
        } else {
            let given = name.as_os_str().as_bytes();
            (given, given != path && self.config.matches(given))
        };
        // A file of no model name is looked at (its first bytes) only if it is large
        // enough to be served: few mappings are.
        let model_header = !name_matches
            && is_regular
            && size >= self.config.min_size
            && starts_as_a_model(request.fd);
        let model_len = if is_regular && wanted && (name_matches || model_header) {
            self.model_len(&name, size)
        } else {
            size
        };
        let facts = FileFacts {
            is_regular,
            size,
            model_len,
            path: matched,
            model_header,
        };
        screen_file(request, &facts, &self.config)?;
        Ok((name, model_len))
    }

    /// Where the blocks of a region of `file` are cut besides the block-size grid: at
    /// its routed experts' slices, for a mixture-of-experts model whose tensor table
    /// reads (see `ENV_EXPERT_BLOCKS`).
    fn block_cuts(&self, file: &MappedFile) -> Vec<u64> {
        if !self.config.expert_blocks {
            return Vec::new();
        }
        match hyperoffload::model::ModelFile::open(&file.name) {
            Ok(model) => hyperoffload::graph::experts::model_block_cuts(&model, page() as u64),
            Err(_) => Vec::new(),
        }
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
                .bounded_auto(hyperoffload::memory_limits::auto_budget_now())
        };
        let sizing = self.config.sizing(
            self.config.budget.resolve(file.model_len, auto),
            file.model_len,
            budget_floor::threads(),
        );
        let hint = ModelHint {
            path: &file.name,
            file_offset: offset,
            data_len,
            block_size: sizing.block_size,
            block_cuts,
        };
        self.pager(&hint, &sizing)
    }

    /// Maps `file` through the pager and registers the region as managed memory; its error
    /// (and a warning once) if the pager cannot map it. The caller holds `layout`.
    fn map_region(
        &self,
        pager: &Pager,
        file: &MappedFile,
        options: MapOptions,
        request: &MapRequest,
    ) -> Result<Arc<ManagedRegion>, String> {
        let offset = options.offset;
        let region = match pager.map_file(&file.path, options) {
            Ok(region) => region,
            Err(error) => {
                self.warn_once(&self.warned_map, || {
                    format!("{error}; this mapping is left to the kernel")
                });
                return Err(error.to_string());
            }
        };
        let base = region.as_ptr() as usize;
        let map_len = region.map_len();
        let index = self.file_index(file);
        let managed = Arc::new(ManagedRegion {
            region,
            file: index,
            file_offset: offset,
            prot: request.prot,
            read_ahead: Mutex::default(),
            allowance: Arc::clone(&self.read_ahead),
        });
        lock(&self.registry).insert(base, map_len, managed.clone());
        self.mapped.fetch_add(1, Ordering::AcqRel);
        self.verbose(|| {
            format!(
                "managing {} offset {} length {} at {:#x}",
                file.path.display(),
                offset,
                request.len,
                base
            )
        });
        self.record(|| {
            serde_json::json!({"op": "map", "file": index, "region": managed.region.id().0,
                "path": file.path.to_string_lossy(), "offset": offset, "len": request.len,
                "flags": request.flags})
        });
        Ok(managed)
    }

    /// The index of `file` among the managed files, added if new.
    fn file_index(&self, file: &MappedFile) -> usize {
        let (dev, ino) = (file.stat.st_dev, file.stat.st_ino);
        let mut files = lock(&self.files);
        if let Some(index) = files.iter().position(|f| f.dev == dev && f.ino == ino) {
            return index;
        }
        files.push(ManagedFile {
            path: file.path.clone(),
            size: file.size,
            dev,
            ino,
        });
        files.len() - 1
    }

    /// The program's name for the mapped file `path`, where one of its arguments leads
    /// there through symlinks, else `path`.
    fn model_name(&self, path: &Path) -> PathBuf {
        name_given(self.cmdline(), path, |arg| std::fs::canonicalize(arg).ok())
            .unwrap_or_else(|| path.to_path_buf())
    }

    /// The program's arguments, NUL-separated (empty if they cannot be read).
    fn cmdline(&self) -> &[u8] {
        self.cmdline
            .get_or_init(|| std::fs::read("/proc/self/cmdline").unwrap_or_default())
    }

    /// The bytes of the model `path` holds (see `model::split::model_len`); `size` (the
    /// file's) when its split siblings cannot be gathered, with a warning.
    fn model_len(&self, path: &Path, size: u64) -> u64 {
        model_len(path).unwrap_or_else(|error| {
            self.say(&format!("{error}; this file is taken for the whole model"));
            size
        })
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

    fn pieces(&self, addr: usize, len: usize) -> Option<Vec<Piece<Arc<ManagedRegion>>>> {
        if !self.has_mappings() || addr % page() != 0 {
            return None;
        }
        let end = addr.checked_add(len)?.checked_next_multiple_of(page())?;
        let pieces = lock(&self.registry).split(addr..end);
        pieces
            .iter()
            .any(|piece| matches!(piece, Piece::Managed { .. }))
            .then_some(pieces)
    }

    /// Walks the pieces of `[addr, addr + len)` in address order, calling `managed` on
    /// each managed piece and `kernel` on each other one. Every piece is visited; the
    /// result is the first error. `None` when the range touches no managed memory (the
    /// call is then the kernel's alone).
    fn for_each_piece(
        &self,
        addr: usize,
        len: usize,
        mut managed: impl FnMut(ManagedPiece) -> Errno,
        mut kernel: impl FnMut(Range<usize>) -> Errno,
    ) -> Option<Errno> {
        let mut result = Ok(());
        for piece in self.pieces(addr, len)? {
            let outcome = match piece {
                Piece::Managed { value, base, range } => managed(ManagedPiece {
                    offsets: (range.start - base) as u64..(range.end - base) as u64,
                    mapping: value,
                    base,
                    pages: range,
                }),
                Piece::Kernel(range) => kernel(range),
            };
            if result.is_ok() {
                result = outcome;
            }
        }
        Some(result)
    }

    /// Releases a managed piece: the region forgets its blocks there and the registry
    /// its pages. A mapping with nothing left is dropped after the registry lock is
    /// released (the region tells the service and waits for it).
    fn release(&self, piece: ManagedPiece) {
        let _ = piece.mapping.region.unmap_part(piece.offsets);
        let gone = lock(&self.registry).unmapped(piece.base, piece.pages);
        if let Some(gone) = gone {
            self.mapped.fetch_sub(1, Ordering::AcqRel);
            drop(gone);
        }
    }

    /// munmap: releases exactly the managed part of the range and unmaps the rest as the
    /// kernel would.
    pub fn unmap(&self, addr: usize, len: usize) -> Option<Errno> {
        self.unmap_attached(addr, len);
        if !self.has_mappings() {
            return None;
        }
        let _layout = lock(&self.layout);
        self.for_each_piece(
            addr,
            len,
            |piece| {
                self.record(|| {
                    serde_json::json!({"op": "unmap", "file": piece.mapping.file,
                        "start": piece.offsets.start, "end": piece.offsets.end})
                });
                self.release(piece);
                Ok(())
            },
            |range| {
                // SAFETY: the program asked for this range to be unmapped; it is not
                // managed memory.
                raw::check(unsafe { sys::memory::munmap(range.start, range.len()) })
            },
        )
    }

    /// A MAP_FIXED request over managed memory replaces it: release the managed part
    /// first (the request itself then goes to the kernel).
    pub fn release_for_fixed(&self, addr: usize, len: usize) {
        if !self.has_mappings() {
            return;
        }
        let _layout = lock(&self.layout);
        let _ = self.for_each_piece(
            addr,
            len,
            |piece| {
                self.release(piece);
                Ok(())
            },
            |_| Ok(()),
        );
    }
}

/// Whether `path` leads to the file `stat` describes (the same device and inode).
fn names_file(path: &Path, stat: &sys::files::Stat) -> bool {
    std::fs::metadata(path).is_ok_and(|meta| meta.dev() == stat.st_dev && meta.ino() == stat.st_ino)
}

/// Whether the file open at `fd` starts as a model does (`model::has_model_header`).
fn starts_as_a_model(fd: i32) -> bool {
    let mut start = [0u8; hyperoffload::model::MODEL_HEADER_LEN];
    // SAFETY: `fd` is the descriptor the program passed to mmap, open for the duration
    // of this call; it is only read from, at an explicit offset (its position is kept).
    let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
    matches!(sys::files::pread(fd, &mut start, 0), Ok(n) if n == start.len())
        && hyperoffload::model::has_model_header(&start)
}
