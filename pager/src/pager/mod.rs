//! The public face of the pager: a `Pager` owns one userfaultfd, one io_uring and the
//! service thread that serves them, under one RAM budget shared by all its regions; a
//! `Region` presents a file's bytes at a reserved address.
//!
//! ```no_run
//! use hyperoffload::{Pager, MapOptions};
//! let pager = Pager::builder().budget(256 << 20).build()?;
//! let region = pager.map_file("model.gguf".as_ref(), MapOptions::default())?;
//! let bytes: &[u8] = region.as_slice(); // faults are served from the file
//! println!("{}", bytes[0]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::os::fd::OwnedFd;
use std::path::Path;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::mpsc::sync_channel;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use thiserror::Error;
use userfaultfd::{RegisterMode, Uffd};

use crate::command::{Command, Shared};
use crate::file::{BackingFile, OpenError};
use crate::geometry::{BlockGeometry, GeometryError};
use crate::layout::RegionLayout;
use crate::lock::lock;
use crate::map_count;
use crate::policy::RegionId;
use crate::ring::RingError;
use crate::stats::Stats;
use crate::sys;
use crate::trace::TraceRecord;

mod builder;
mod fork_guard;
mod map_extent;
mod region;
mod uffd;

pub use self::builder::PagerBuilder;
use self::map_extent::MapExtent;
pub use self::region::Region;
use self::region::{Mapping, MappingPromise};

/// Default block size: the unit of residency, eviction and demand reads. Chosen by
/// measurement (`benches/scan.rs`, 2 GiB file, cold, medians of 3): with 8 threads
/// touching random pages the fault latency p50 was 208 us at 4 KiB blocks, 249 at
/// 16 KiB and 394 at 64 KiB (the kernel's own major fault: 141), while a sequential scan
/// lost less (1.60 GB/s at 4 KiB against 1.87 at 64 KiB: prefetch merges neighbouring
/// blocks into reads of up to `DEFAULT_MAX_READ`, but per-block bookkeeping remains).
pub const DEFAULT_BLOCK_SIZE: u64 = 4 << 10;
/// Largest single read: prefetches of neighbouring blocks are merged up to this size.
pub const DEFAULT_MAX_READ: u64 = 1 << 20;
/// Reads in flight at once.
pub const DEFAULT_QUEUE_DEPTH: u32 = 32;
/// Polling for a demand read's completion (see `PagerBuilder::demand_spin`).
pub const DEFAULT_DEMAND_SPIN: std::time::Duration = std::time::Duration::from_micros(200);

/// Demand reads in flight from which the service polls (see
/// `PagerBuilder::demand_spin_min_reads`): more than twice the cores, so that the
/// threads woken by installs keep the other cores busy while this one polls.
pub fn default_demand_spin_min_reads() -> u32 {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (2 * cores + 1) as u32
}

/// Install workers beside the fault service thread (see `PagerBuilder::install_threads`).
/// Measured on two cores: llama-bench tg8 on a 3 GiB model at a 50 % budget, nice -10,
/// 1.27 tok/s with none, 1.35 with one, 1.44 with two; `cargo bench --bench scan`, cold
/// 2 GiB sequential scan at 4 KiB blocks, 3091 MB/s with none, 3371 with two.
pub const DEFAULT_INSTALL_THREADS: usize = 2;
/// Nice value the pager's threads ask for (see `PagerBuilder::thread_nice`).
pub const DEFAULT_THREAD_NICE: i32 = -10;
/// Frames of the zero-copy store beyond the budget's worth (see `PagerBuilder::build`).
const SPARE_FRAMES: u32 = 1024;

/// Why a pager could not be created.
#[derive(Debug, Error)]
pub enum PagerError {
    #[error("block size {0} is not a power of two of at least one page (4096)")]
    BadBlockSize(u64),
    #[error("read size {read} must be a multiple of the block size {block}")]
    BadReadSize { read: u64, block: u64 },
    #[error("budget of {budget} bytes is smaller than one block ({block} bytes)")]
    BudgetTooSmall { budget: u64, block: u64 },
    #[error("queue depth must be at least 1")]
    BadQueueDepth,
    #[error(
        "userfaultfd is not permitted ({0}): run as root, give this user read-write access \
         to /dev/userfaultfd, or set sysctl vm.unprivileged_userfaultfd=1 (kernel-mode \
         faults need root or /dev/userfaultfd)"
    )]
    UffdNotPermitted(String),
    #[error("userfaultfd is not available: {0}")]
    UffdUnavailable(String),
    #[error(
        "this kernel's userfaultfd lacks UFFD_FEATURE_POISON (Linux 6.6+), needed to report \
         read errors as SIGBUS"
    )]
    UffdNoPoison,
    #[error(transparent)]
    Ring(#[from] RingError),
    #[error("cannot create the service's eventfd: {0}")]
    EventFd(std::io::Error),
    #[error("cannot start the fault service thread: {0}")]
    Spawn(std::io::Error),
}

/// Why a region could not be mapped.
#[derive(Debug, Error)]
pub enum MapError {
    #[error(transparent)]
    Open(#[from] OpenError),
    #[error("{path}: offset {offset} is not a multiple of the page size (4096)")]
    UnalignedOffset { path: String, offset: u64 },
    #[error("{path}: block cut at file offset {offset} is not a multiple of the page size (4096)")]
    UnalignedCut { path: String, offset: u64 },
    #[error("{path}: range {offset}+{len} is outside the file ({file_len} bytes)")]
    OutOfRange {
        path: String,
        offset: u64,
        len: u64,
        file_len: u64,
    },
    #[error("{path}: length is zero")]
    ZeroLength { path: String },
    #[error("mapping length {map_len} is shorter than the data it must hold ({needed} bytes, page rounded)")]
    MapTooShort { map_len: u64, needed: u64 },
    #[error("writable regions are not supported: evicting a written page would lose the write")]
    Writable,
    #[error("cannot reserve {len} bytes of address space: {source}")]
    Reserve { len: u64, source: std::io::Error },
    #[error("cannot register the region with userfaultfd: {0}")]
    Register(String),
    #[error(
        "{path}: zero copy maps each of its {blocks} blocks from a frame of its own, up to \
         {needed} memory mappings, and this process has {available} to spare under \
         vm.max_map_count ({limit}): use larger blocks, copy mode (--no-zero-copy), or \
         raise vm.max_map_count"
    )]
    TooManyMappings {
        path: String,
        blocks: u64,
        needed: u64,
        available: u64,
        limit: u64,
    },
    #[error(transparent)]
    Geometry(#[from] GeometryError),
    #[error("the fault service has stopped")]
    ServiceGone,
    #[error("this pager serves process {owner}; a child forked from it cannot use it")]
    ForkedChild { owner: i32 },
}

/// Why a hint was refused.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum HintError {
    #[error("range {start}..{end} is outside the region ({len} bytes)")]
    OutOfRange { start: u64, end: u64, len: u64 },
    #[error(
        "pinning {requested} more bytes would pin {total} of a {budget}-byte budget; at \
         least one block ({block} bytes) must stay unpinned for demand faults"
    )]
    PinExceedsBudget {
        requested: u64,
        total: u64,
        budget: u64,
        block: u64,
    },
    #[error("the fault service has stopped")]
    ServiceGone,
    #[error("this pager serves process {owner}; a child forked from it cannot use it")]
    ForkedChild { owner: i32 },
}

/// Why the budget could not be changed.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum BudgetError {
    #[error("the fault service has stopped")]
    ServiceGone,
    #[error("this pager serves process {owner}; a child forked from it cannot use it")]
    ForkedChild { owner: i32 },
}

/// Where and how a region maps a file.
#[derive(Debug, Clone)]
pub struct MapOptions {
    /// File offset of the region's first byte; a multiple of the page size.
    pub offset: u64,
    /// Bytes of the file to present; `None` for everything from `offset` to the end.
    pub len: Option<u64>,
    /// Length of the mapping, if longer than the data rounded up to a page: whole pages
    /// past the end of the file raise SIGBUS, as with mmap.
    pub map_len: Option<u64>,
    /// `PROT_READ`, optionally with `PROT_EXEC`.
    pub prot: i32,
    /// File offsets where a block starts besides the block-size grid (page multiples;
    /// those outside the region are ignored): where the program reads a piece on its
    /// own, such as one expert's slice of a tensor (`graph::experts::expert_block_cuts`),
    /// so that a fault there reads that piece and not its neighbours.
    pub block_cuts: Vec<u64>,
}

impl Default for MapOptions {
    fn default() -> Self {
        Self {
            offset: 0,
            len: None,
            map_len: None,
            prot: libc::PROT_READ,
            block_cuts: Vec::new(),
        }
    }
}

struct PagerInner {
    uffd: Arc<Uffd>,
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
    next_region: AtomicU32,
    /// The budget last set (the service's is the one in force).
    budget: AtomicU64,
    /// The least and the most `set_budget` may set.
    budget_bounds: (u64, u64),
    block_size: u64,
    /// Whether blocks are mapped from the frame store rather than copied in.
    zero_copy: bool,
    /// The most memory mappings the live zero-copy regions may take (`map_count`).
    mappings_promised: AtomicU64,
    /// Serving forks with blocks read in place (from the start or from the first fork):
    /// where regions' files are made (None: blocks are copied into memfds).
    shape_files: Option<Arc<crate::shaped_region::ShapeFiles>>,
    /// The process the service thread runs in. A forked child has a copy of this value
    /// but no service thread, and the regions are not mapped there (MADV_DONTFORK):
    /// asking the service would wait forever, and unregistering or unmapping would act
    /// on the parent's userfaultfd or on the child's own later mappings.
    owner: i32,
}

impl PagerInner {
    /// Whether this is the process the service runs in, not a forked child.
    fn serving_here(&self) -> bool {
        sys::processes::getpid() == self.owner
    }

    /// Whether forked children are served (`PagerBuilder::serve_forks`, or since the
    /// first fork with `serve_forks_at_fork`): regions are file-shaped and inherited.
    fn serve_forks(&self) -> bool {
        self.shared.serving_forks.load(Ordering::Acquire)
    }
}

impl Drop for PagerInner {
    fn drop(&mut self) {
        // Exclusive access: no lock, which a fork may have left held.
        let thread = self
            .thread
            .get_mut()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .take();
        if !self.serving_here() {
            // A forked child: the thread is the parent's; joining it would wait forever.
            std::mem::forget(thread);
            return;
        }
        self.shared.send(Command::Shutdown);
        if let Some(thread) = thread {
            // The service aborts the process rather than unwinding, so join only fails
            // if it was already gone.
            let _ = thread.join();
        }
    }
}

/// A pager: one budget, one fault service, any number of regions. Cheap to clone.
#[derive(Clone)]
pub struct Pager {
    inner: Arc<PagerInner>,
}

impl Pager {
    pub fn builder() -> PagerBuilder {
        PagerBuilder::default()
    }

    /// The budget: what it started with, or was last set to.
    pub fn budget(&self) -> u64 {
        self.inner.budget.load(Ordering::Acquire)
    }

    /// The least and the most `set_budget` may set: the floor below which the program's
    /// threads would evict each other's last blocks for good (`budget::floor`, at most
    /// the starting budget) and `PagerBuilder::max_budget`.
    pub fn budget_bounds(&self) -> (u64, u64) {
        self.inner.budget_bounds
    }

    /// Changes the budget to `bytes`, within `budget_bounds` (and at least the pinned
    /// bytes and one block more), and returns the budget now in force. A larger budget
    /// gives reads room at once. A smaller one is met before this returns: the
    /// eviction policy chooses blocks to evict until resident bytes and the bytes
    /// reserved for reads in flight fit the new budget, and their memory goes back to
    /// the system. What cannot go yet (reads in flight, pinned blocks, each thread's
    /// last two blocks) is evicted as those reads finish, before any new read starts:
    /// at most the queue depth times the largest read over the budget, for as long as
    /// those reads take.
    pub fn set_budget(&self, bytes: u64) -> Result<u64, BudgetError> {
        if !self.inner.serving_here() {
            return Err(BudgetError::ForkedChild {
                owner: self.inner.owner,
            });
        }
        let (reply, answer) = sync_channel(1);
        self.inner.shared.send(Command::SetBudget { bytes, reply });
        let budget = answer.recv().map_err(|_| BudgetError::ServiceGone)?;
        self.inner.budget.store(budget, Ordering::Release);
        Ok(budget)
    }

    pub fn block_size(&self) -> u64 {
        self.inner.block_size
    }

    /// Whether a child of `fork` is served by this pager's service, from the same
    /// resident blocks and within the same budget (`PagerBuilder::serve_forks`, granted):
    /// its regions are inherited and file-shaped. Otherwise they are MADV_DONTFORK.
    pub fn serves_forks(&self) -> bool {
        self.inner.serve_forks()
    }

    /// Makes the regions inheritable now, if this pager serves forked children from the
    /// program's first fork on (`PagerBuilder::serve_forks_at_fork`) and has not yet:
    /// what its fork handler does before a fork, for a caller that must know before
    /// then (the shim plans a child's mappings in a fork handler of its own, which may
    /// run first). Returns `serves_forks()`.
    pub fn make_inheritable(&self) -> bool {
        if self.inner.serving_here() && !self.serves_forks() && self.inner.shape_files.is_some() {
            fork_guard::shape_regions(&self.inner.shared);
        }
        self.serves_forks()
    }

    /// The program is about to exit (the pager's service, a thread of it, ends with it):
    /// if forked children it serves still live, every region's data is filled into the
    /// file they share, beyond the budget, so they go on reading the files' bytes
    /// without the service (preload/README.md, "Serving forked children"), and a message
    /// says so. Returns once done; nothing happens without `serves_forks` or children,
    /// or in a forked child. Dropping the pager does the same.
    pub fn before_exit(&self) {
        if !self.inner.serve_forks() || !self.inner.serving_here() {
            return;
        }
        let (reply, answer) = sync_channel(1);
        self.inner.shared.send(Command::Exiting { reply });
        let _ = answer.recv();
    }

    /// Current statistics (asks the service; falls back to its last published snapshot
    /// if it has stopped).
    pub fn stats(&self) -> Stats {
        if !self.inner.serving_here() {
            // A forked child: the snapshot as the fork left it, if its lock is free.
            return match self.inner.shared.stats.try_lock() {
                Ok(stats) => stats.clone(),
                Err(_) => Stats::default(),
            };
        }
        let (reply, answer) = sync_channel(1);
        self.inner.shared.send(Command::Stats { reply });
        answer
            .recv()
            .unwrap_or_else(|_| lock(&self.inner.shared.stats).clone())
    }

    /// The faults recorded since the last call, in fault order, and how many were not
    /// recorded because the trace limit was reached. Empty unless built with `trace`.
    pub fn take_trace(&self) -> (Vec<TraceRecord>, u64) {
        if !self.inner.serving_here() {
            return (Vec::new(), 0);
        }
        let (reply, answer) = sync_channel(1);
        self.inner.shared.send(Command::TakeTrace { reply });
        let (mut trace, untraced) = answer.recv().unwrap_or_default();
        // Recorded when served; a trace reads in fault order.
        trace.sort_by_key(|record| record.t_ns);
        (trace, untraced)
    }

    /// With zero copy, reserves for a region of `blocks` blocks the most memory mappings
    /// it can take (see `map_count`), or refuses it if the process cannot have them:
    /// reaching the limit later would stop the program. Returns what was reserved, to
    /// give back when the region goes.
    fn promise_mappings(&self, path: &str, blocks: u64) -> Result<MappingPromise, MapError> {
        let needed = if self.inner.zero_copy && !self.inner.serve_forks() {
            map_count::zero_copy_mappings(blocks)
        } else {
            0
        };
        let promised = self
            .inner
            .mappings_promised
            .fetch_add(needed, Ordering::AcqRel);
        // Given back if refused, or if the region fails to map.
        let promise = MappingPromise {
            pager: self.clone(),
            count: needed,
        };
        if needed == 0 {
            return Ok(promise);
        }
        if let Some((limit, in_use)) = map_count::limit_and_in_use() {
            let available = map_count::mappings_available(in_use, promised, limit);
            if needed > available {
                return Err(MapError::TooManyMappings {
                    path: path.to_owned(),
                    blocks,
                    needed,
                    available,
                    limit,
                });
            }
        }
        Ok(promise)
    }

    /// Maps `path` (or part of it, per `options`) into a new region.
    pub fn map_file(&self, path: &Path, options: MapOptions) -> Result<Region, MapError> {
        let served_before = self.inner.serve_forks();
        let region = self.map_file_once(path, options.clone())?;
        if !served_before && self.inner.serve_forks() {
            // Another thread's fork made the regions inheritable meanwhile: this one,
            // made the old way, may have been added after the conversion and would not
            // be inherited. Made again, the new way.
            drop(region);
            return self.map_file_once(path, options);
        }
        Ok(region)
    }

    fn map_file_once(&self, path: &Path, options: MapOptions) -> Result<Region, MapError> {
        if !self.inner.serving_here() {
            return Err(MapError::ForkedChild {
                owner: self.inner.owner,
            });
        }
        if options.prot & libc::PROT_WRITE != 0 {
            return Err(MapError::Writable);
        }
        let file = BackingFile::open(path)?;
        let page = sys::memory::page_size();
        let MapExtent {
            len,
            needed,
            map_len,
        } = MapExtent::check(&options, path, file.len(), page)?;
        let geometry = BlockGeometry::new(options.offset, len, self.inner.block_size)?
            .with_file_cuts(options.block_cuts.iter().copied())?;
        // Mapped from frames, blocks are huge pages only at huge-page-aligned addresses.
        let align = if self.inner.zero_copy && !self.inner.serve_forks() {
            self.inner.block_size as usize
        } else {
            page as usize
        };
        // The blocks, and the block-sized pieces of the mapping past the data.
        let past_data = (map_len - needed).div_ceil(self.inner.block_size);
        let mappings = self.promise_mappings(
            &path.display().to_string(),
            geometry.block_count() as u64 + past_data,
        )?;
        // Reserved inaccessible, registered, and only then given the program's
        // protection. Under mlockall(MCL_FUTURE) the kernel fills every new accessible
        // mapping as it creates it: a readable reservation got zero pages before it was
        // registered, no fault ever reached the service, and the program read zeros
        // where the file has its bytes. An inaccessible mapping is not filled, and making
        // it readable fills nothing.
        let serve_forks = self.inner.serve_forks();
        let mapping = Mapping::reserve(map_len as usize, align, serve_forks)?;
        let shape = self.shape_reservation(&mapping, serve_forks, needed, map_len, &options)?;
        self.register_reservation(
            &mapping,
            needed as usize,
            shape.is_some() && self.inner.shape_files.is_some(),
        )?;
        let id = RegionId(self.inner.next_region.fetch_add(1, Ordering::Relaxed));
        let layout = RegionLayout::new(geometry, map_len, page);
        let (reply, answer) = sync_channel(1);
        self.inner.shared.send(Command::AddRegion {
            id,
            base: mapping.base,
            layout,
            file,
            prot: options.prot,
            shape,
            reply,
        });
        answer.recv().map_err(|_| MapError::ServiceGone)?;
        let region = Region {
            pager: self.clone(),
            id,
            mapping,
            data_len: len,
            _mappings: mappings,
        };
        // SAFETY: the reservation is this region's own, and nothing reads it yet.
        unsafe { sys::memory::mprotect(region.mapping.base, region.mapping.len, options.prot) }
            .map_err(|source| MapError::Reserve {
                len: map_len,
                source,
            })?;
        Ok(region)
    }

    /// For a pager that serves forked children: the file the data pages of `mapping`
    /// (`needed` bytes, of a reservation of `map_len`) are made a shared mapping of, so
    /// that children inherit the region (`shaped_region`); a file of `shape_files` when
    /// blocks are read in place, else a memfd. `None` otherwise.
    fn shape_reservation(
        &self,
        mapping: &Mapping,
        serve_forks: bool,
        needed: u64,
        map_len: u64,
        options: &MapOptions,
    ) -> Result<Option<OwnedFd>, MapError> {
        let reserve_error = |source| MapError::Reserve {
            len: map_len,
            source,
        };
        Ok(match (serve_forks, &self.inner.shape_files) {
            (false, _) => None,
            (true, Some(files)) => {
                let huge = crate::shaped_region::blocks_are_huge_pages(
                    self.inner.block_size,
                    options.offset,
                    &options.block_cuts,
                );
                let file = files.create(needed, huge).map_err(reserve_error)?;
                // SAFETY: the data pages of the reservation just made, which nothing
                // uses.
                unsafe {
                    crate::shaped_region::map_file_over(mapping.base, needed as usize, &file)
                }
                .map_err(reserve_error)?;
                Some(file)
            }
            // SAFETY: the data pages of the reservation just made, which nothing uses.
            (true, None) => Some(
                unsafe { crate::shaped_region::map_shaped(mapping.base, needed as usize) }
                    .map_err(reserve_error)?,
            ),
        })
    }

    /// Registers `mapping` with the userfaultfd: missing faults everywhere, and minor
    /// faults too on its first `needed` bytes (the data) when `read_in_place`.
    fn register_reservation(
        &self,
        mapping: &Mapping,
        needed: usize,
        read_in_place: bool,
    ) -> Result<(), MapError> {
        let register = |start: usize, len: usize, mode| {
            self.inner
                .uffd
                .register_with_mode(start as *mut libc::c_void, len, mode)
                .map_err(|error| MapError::Register(format!("{error:?}")))
        };
        if read_in_place {
            // Read in place: the file's pages exist before their bytes do (see
            // `shaped_region`). The reservation past the data is anonymous, where minor
            // faults cannot be registered.
            register(
                mapping.base,
                needed,
                RegisterMode::MISSING | RegisterMode::MINOR,
            )?;
            if mapping.len > needed {
                register(
                    mapping.base + needed,
                    mapping.len - needed,
                    RegisterMode::MISSING,
                )?;
            }
        } else {
            register(mapping.base, mapping.len, RegisterMode::MISSING)?;
        }
        Ok(())
    }
}
