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

use std::ops::Range;
use std::path::Path;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::mpsc::sync_channel;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use thiserror::Error;
use userfaultfd::{FeatureFlags, Uffd, UffdBuilder};

use crate::command::{Command, PinRefused, Shared};
use crate::event::EventFd;
use crate::file::{BackingFile, OpenError};
use crate::geometry::{BlockGeometry, GeometryError};
use crate::layout::RegionLayout;
use crate::lock::lock;
use crate::map_count;
use crate::policy::{
    AccessHint, EvictionKind, EvictionPolicy, PrefetchKind, PrefetchPolicy, RegionId,
};
use crate::ring::RingError;
#[cfg(feature = "fault-injection")]
use crate::service::InjectedFaults;
use crate::service::{FaultService, InstallPool, ServiceConfig};
use crate::shared_store::{FrameStore, HugeTmpfs};
use crate::stats::Stats;
use crate::sys::HUGE_PAGE;
use crate::trace::TraceRecord;
use crate::{sys, uffd_ext};

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
}

impl Default for MapOptions {
    fn default() -> Self {
        Self {
            offset: 0,
            len: None,
            map_len: None,
            prot: libc::PROT_READ,
        }
    }
}

/// Builds a pager.
pub struct PagerBuilder {
    budget: u64,
    block_size: u64,
    max_read: u64,
    queue_depth: u32,
    read_attempts: u32,
    prefetch: Box<dyn PrefetchPolicy>,
    eviction: Box<dyn EvictionPolicy>,
    trace_limit: usize,
    demand_spin: std::time::Duration,
    demand_spin_min_reads: u32,
    install_threads: usize,
    thread_nice: i32,
    zero_copy: bool,
    #[cfg(feature = "fault-injection")]
    faults: InjectedFaults,
}

impl Default for PagerBuilder {
    fn default() -> Self {
        Self {
            budget: 1 << 30,
            block_size: DEFAULT_BLOCK_SIZE,
            max_read: DEFAULT_MAX_READ,
            queue_depth: DEFAULT_QUEUE_DEPTH,
            read_attempts: 3,
            prefetch: PrefetchKind::Readahead.build(),
            eviction: EvictionKind::Fifo.build(),
            trace_limit: 0,
            demand_spin: DEFAULT_DEMAND_SPIN,
            demand_spin_min_reads: default_demand_spin_min_reads(),
            install_threads: DEFAULT_INSTALL_THREADS,
            thread_nice: DEFAULT_THREAD_NICE,
            zero_copy: false,
            #[cfg(feature = "fault-injection")]
            faults: InjectedFaults::default(),
        }
    }
}

impl PagerBuilder {
    /// Resident bytes of all regions together never exceed this.
    pub fn budget(mut self, bytes: u64) -> Self {
        self.budget = bytes;
        self
    }

    pub fn block_size(mut self, bytes: u64) -> Self {
        self.block_size = bytes;
        self
    }

    /// Largest read; neighbouring prefetched blocks are merged up to it.
    pub fn max_read(mut self, bytes: u64) -> Self {
        self.max_read = bytes;
        self
    }

    pub fn queue_depth(mut self, depth: u32) -> Self {
        self.queue_depth = depth;
        self
    }

    /// How many times a failed read is tried before its pages are poisoned.
    pub fn read_attempts(mut self, attempts: u32) -> Self {
        self.read_attempts = attempts.max(1);
        self
    }

    pub fn prefetch(mut self, policy: Box<dyn PrefetchPolicy>) -> Self {
        self.prefetch = policy;
        self
    }

    pub fn eviction(mut self, policy: Box<dyn EvictionPolicy>) -> Self {
        self.eviction = policy;
        self
    }

    /// Test-only: reads of the given file byte range fail with `errno`, to test error
    /// paths end to end (the read is issued; its result is replaced).
    #[cfg(feature = "fault-injection")]
    pub fn inject_read_error(mut self, file_range: Range<u64>, errno: i32) -> Self {
        self.faults.read_error = Some((file_range, errno));
        self
    }

    /// Test-only: every read returns at most half of what it asked for (the rest is read
    /// again by the service's short-read continuation, as after a real short read).
    #[cfg(feature = "fault-injection")]
    pub fn inject_short_reads(mut self, on: bool) -> Self {
        self.faults.short_reads = on;
        self
    }

    /// Test-only: every read completion is handled `delay` late (the service thread
    /// sleeps), as if the device were that slow and served one read at a time.
    #[cfg(feature = "fault-injection")]
    pub fn inject_read_delay(mut self, delay: std::time::Duration) -> Self {
        self.faults.read_delay = delay;
        self
    }

    /// Test-only: the service thread panics on fault number `faults + 1`.
    #[cfg(feature = "fault-injection")]
    pub fn inject_service_panic_after(mut self, faults: u64) -> Self {
        self.faults.panic_after_faults = Some(faults);
        self
    }

    /// How long the service thread polls for a completion, instead of sleeping, while
    /// threads wait on demand reads (zero: never); see `demand_spin_min_reads`.
    pub fn demand_spin(mut self, spin: std::time::Duration) -> Self {
        self.demand_spin = spin;
        self
    }

    /// Poll for completions only while at least this many demand reads are in flight
    /// (default: `default_demand_spin_min_reads`). Measured on two virtual cores
    /// (random 4 KiB touches, p50 fault latency, spin 200 us, median of 3): with 8
    /// threads, 178 us never polling, 158 polling from 1 read in flight, 155 from 5; with
    /// 4 threads, 101, 130 and 104; with 2 threads, 78, 100 and 80. Polling keeps the
    /// service's core busy, so an install's wake-up goes to the other core, halted when
    /// few threads run, and waking a halted virtual CPU costs more than polling saves.
    pub fn demand_spin_min_reads(mut self, reads: u32) -> Self {
        self.demand_spin_min_reads = reads.max(1);
        self
    }

    /// Threads that install prefetched reads beside the fault service thread (0: the
    /// service thread installs everything itself). See `service::install_pool`. None run with zero
    /// copy, where an install maps a frame instead of copying.
    pub fn install_threads(mut self, threads: usize) -> Self {
        self.install_threads = threads;
        self
    }

    /// Nice value for the service and install threads (-20..19). Raising priority needs
    /// CAP_SYS_NICE or RLIMIT_NICE; without either they stay at the process's nice value
    /// and `Stats::thread_nice` says so.
    pub fn thread_nice(mut self, nice: i32) -> Self {
        self.thread_nice = nice.clamp(-20, 19);
        self
    }

    /// Records every fault (time, thread, block, outcome, latency), keeping at most
    /// `limit` of them; `Pager::take_trace` hands them over.
    /// Whether to install blocks without copying them when the blocks are whole huge
    /// pages (a multiple of 2 MiB): reads land in frames of a file of a private
    /// huge-page tmpfs, and a block is installed by mapping its frame over its place in
    /// the region (see `shared_store`). Used only when the blocks allow it and the
    /// process may create the mount (CAP_SYS_ADMIN); otherwise blocks are copied in and
    /// `Stats::zero_copy_refused` says why. Off by default: a reused frame's page is
    /// overwritten even if the kernel still holds it for a `write(2)` from the region.
    pub fn zero_copy(mut self, on: bool) -> Self {
        self.zero_copy = on;
        self
    }

    pub fn trace(mut self, limit: usize) -> Self {
        self.trace_limit = limit;
        self
    }

    pub fn build(self) -> Result<Pager, PagerError> {
        let page = sys::page_size();
        if !self.block_size.is_power_of_two() || self.block_size < page {
            return Err(PagerError::BadBlockSize(self.block_size));
        }
        let max_read = self.max_read.max(self.block_size);
        if max_read % self.block_size != 0 {
            return Err(PagerError::BadReadSize {
                read: self.max_read,
                block: self.block_size,
            });
        }
        if self.budget < self.block_size {
            return Err(PagerError::BudgetTooSmall {
                budget: self.budget,
                block: self.block_size,
            });
        }
        if self.queue_depth == 0 {
            return Err(PagerError::BadQueueDepth);
        }
        let (store, zero_copy_refused) = if !self.zero_copy {
            (None, Some("turned off".to_string()))
        } else if self.block_size % HUGE_PAGE != 0 {
            (
                None,
                Some(format!(
                    "blocks of {} bytes are not whole 2 MiB pages",
                    self.block_size
                )),
            )
        } else {
            // Every block held (resident, read or held back) has a frame, and the budget
            // bounds them, counting a region's short last block at its length: the
            // spare frames cover those, up to that many regions at once.
            let frames = (self.budget / self.block_size) as u32 + SPARE_FRAMES;
            match HugeTmpfs::new()
                .and_then(|tmpfs| FrameStore::new(&tmpfs, self.block_size, frames))
            {
                Ok(store) => (Some(store), None),
                Err(error) => (
                    None,
                    Some(format!(
                        "cannot create a huge-page tmpfs ({error}; needs CAP_SYS_ADMIN)"
                    )),
                ),
            }
        };
        // Evicted blocks stay mapped to their old frames with their pages unmapped:
        // minor faults must reach the service (see `service::map_frame`).
        let (uffd, store, zero_copy_refused) = match store {
            Some(store) => match create_uffd(uffd_ext::FEATURE_MINOR_SHMEM) {
                Ok(uffd) => (uffd, Some(store), None),
                Err(error) => (
                    create_uffd(0)?,
                    None,
                    Some(format!("userfaultfd lacks minor faults on shmem ({error})")),
                ),
            },
            None => (create_uffd(0)?, None, zero_copy_refused),
        };
        let zero_copy = store.is_some();
        // A read fills one frame: blocks are read one at a time (they are 2 MiB or more).
        let max_read = if zero_copy { self.block_size } else { max_read };
        let uffd = Arc::new(uffd);
        let wakeup = EventFd::new().map_err(PagerError::EventFd)?;
        let shared = Arc::new(Shared::new(wakeup));
        // Mapping a frame is cheap: the service thread does it; there is nothing to copy.
        let install_threads = if zero_copy { 0 } else { self.install_threads };
        let installs = match install_threads {
            0 => None,
            threads => Some(
                InstallPool::new(threads, uffd.clone(), page as usize, self.thread_nice)
                    .map_err(PagerError::Spawn)?,
            ),
        };
        let service = FaultService::new(
            ServiceConfig {
                budget: self.budget,
                block_size: self.block_size,
                max_read,
                queue_depth: self.queue_depth,
                read_attempts: self.read_attempts,
                page_size: page,
                trace_limit: self.trace_limit,
                demand_spin: self.demand_spin,
                demand_spin_min_reads: self.demand_spin_min_reads,
                thread_nice: self.thread_nice,
                zero_copy_refused,
                #[cfg(feature = "fault-injection")]
                faults: self.faults,
            },
            uffd.clone(),
            shared.clone(),
            self.prefetch,
            self.eviction,
            installs,
            store,
        )?;
        let thread = std::thread::Builder::new()
            .name("hyperoffload-fault".into())
            .spawn(move || service.run())
            .map_err(PagerError::Spawn)?;
        Ok(Pager {
            inner: Arc::new(PagerInner {
                uffd,
                shared,
                thread: Mutex::new(Some(thread)),
                next_region: AtomicU32::new(0),
                budget: self.budget,
                block_size: self.block_size,
                zero_copy,
                mappings_promised: AtomicU64::new(0),
                owner: sys::getpid(),
            }),
        })
    }
}

/// The pager's userfaultfd, with `extra` features beside those always needed.
fn create_uffd(extra: u64) -> Result<Uffd, PagerError> {
    let build = |features: u64| {
        UffdBuilder::new()
            .close_on_exec(true)
            .non_blocking(true)
            // Kernel-mode accesses (write(2) from a region, O_DIRECT into... ) must fault
            // like user accesses, not fail with EFAULT: needs root or /dev/userfaultfd.
            .user_mode_only(false)
            .require_features(FeatureFlags::from_bits_retain(features))
            .create()
    };
    let features = FeatureFlags::THREAD_ID.bits()
        | uffd_ext::FEATURE_POISON
        | uffd_ext::FEATURE_EXACT_ADDRESS
        | extra;
    match build(features) {
        Ok(uffd) => Ok(uffd),
        Err(userfaultfd::Error::SystemError(nix::errno::Errno::EPERM)) => Err(
            PagerError::UffdNotPermitted(nix::errno::Errno::EPERM.desc().into()),
        ),
        Err(userfaultfd::Error::OpenDevUserfaultfd(error))
            if error.kind() == std::io::ErrorKind::PermissionDenied =>
        {
            Err(PagerError::UffdNotPermitted(error.to_string()))
        }
        Err(userfaultfd::Error::SystemError(nix::errno::Errno::EINVAL)) => {
            // The API handshake refused the features: check whether POISON is the reason.
            match UffdBuilder::new().user_mode_only(false).create() {
                Ok(_) => Err(PagerError::UffdNoPoison),
                Err(error) => Err(PagerError::UffdUnavailable(error.to_string())),
            }
        }
        Err(error) => Err(PagerError::UffdUnavailable(error.to_string())),
    }
}

struct PagerInner {
    uffd: Arc<Uffd>,
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
    next_region: AtomicU32,
    budget: u64,
    block_size: u64,
    /// Whether blocks are mapped from the frame store rather than copied in.
    zero_copy: bool,
    /// The most memory mappings the live zero-copy regions may take (`map_count`).
    mappings_promised: AtomicU64,
    /// The process the service thread runs in. A forked child has a copy of this value
    /// but no service thread, and the regions are not mapped there (MADV_DONTFORK):
    /// asking the service would wait forever, and unregistering or unmapping would act
    /// on the parent's userfaultfd or on the child's own later mappings.
    owner: i32,
}

impl PagerInner {
    /// Whether this is the process the service runs in, not a forked child.
    fn serving_here(&self) -> bool {
        sys::getpid() == self.owner
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

    pub fn budget(&self) -> u64 {
        self.inner.budget
    }

    pub fn block_size(&self) -> u64 {
        self.inner.block_size
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

    /// With zero copy, reserves for a region of `map_len` bytes the most memory mappings
    /// it can take (see `map_count`), or refuses it if the process cannot have them:
    /// reaching the limit later would stop the program. Returns what was reserved, to
    /// give back when the region goes.
    fn promise_mappings(&self, path: &str, map_len: u64) -> Result<MappingPromise, MapError> {
        let blocks = map_len.div_ceil(self.inner.block_size);
        let needed = if self.inner.zero_copy {
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
        if !self.inner.serving_here() {
            return Err(MapError::ForkedChild {
                owner: self.inner.owner,
            });
        }
        if options.prot & libc::PROT_WRITE != 0 {
            return Err(MapError::Writable);
        }
        let file = BackingFile::open(path)?;
        let name = || path.display().to_string();
        let page = sys::page_size();
        if options.offset % page != 0 {
            return Err(MapError::UnalignedOffset {
                path: name(),
                offset: options.offset,
            });
        }
        let file_len = file.len();
        let len = match options.len {
            Some(0) => return Err(MapError::ZeroLength { path: name() }),
            Some(len) => len,
            None => file_len.saturating_sub(options.offset),
        };
        if options.offset >= file_len || len > file_len - options.offset {
            return Err(MapError::OutOfRange {
                path: name(),
                offset: options.offset,
                len,
                file_len,
            });
        }
        let needed = len.next_multiple_of(page);
        let map_len = options.map_len.unwrap_or(needed).next_multiple_of(page);
        if map_len < needed {
            return Err(MapError::MapTooShort { map_len, needed });
        }
        let geometry = BlockGeometry::new(options.offset, len, self.inner.block_size)?;
        // Mapped from frames, blocks are huge pages only at huge-page-aligned addresses.
        let align = if self.inner.zero_copy {
            self.inner.block_size as usize
        } else {
            page as usize
        };
        let mappings = self.promise_mappings(&name(), map_len)?;
        // Reserved inaccessible, registered, and only then given the program's
        // protection. Under mlockall(MCL_FUTURE) the kernel fills every new accessible
        // mapping as it creates it: a readable reservation got zero pages before it was
        // registered, no fault ever reached the service, and the program read zeros
        // where the file has its bytes. An inaccessible mapping is not filled, and making
        // it readable fills nothing.
        let mapping = Mapping::reserve(map_len as usize, align)?;
        // SAFETY: registers exactly the mapping just reserved, which this region owns.
        self.inner
            .uffd
            .register(mapping.base as *mut libc::c_void, mapping.len)
            .map_err(|error| MapError::Register(format!("{error:?}")))?;
        let id = RegionId(self.inner.next_region.fetch_add(1, Ordering::Relaxed));
        let layout = RegionLayout::new(geometry, map_len, page);
        let (reply, answer) = sync_channel(1);
        self.inner.shared.send(Command::AddRegion {
            id,
            base: mapping.base,
            layout,
            file,
            prot: options.prot,
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
        unsafe { sys::mprotect(region.mapping.base, region.mapping.len, options.prot) }.map_err(
            |source| MapError::Reserve {
                len: map_len,
                source,
            },
        )?;
        Ok(region)
    }
}

/// An anonymous reservation owned by a region. Dropping it unmaps what the program has
/// not unmapped already: a hole may have been reused by another mapping since, which
/// must survive.
struct Mapping {
    base: usize,
    len: usize,
    /// Offsets the program unmapped, in no particular order.
    holes: Mutex<Vec<Range<usize>>>,
}

impl Mapping {
    /// Reserves `len` bytes of inaccessible anonymous memory at an address aligned to
    /// `align` (a power of two, at least a page); `map_file` gives it the program's
    /// protection once it is registered.
    fn reserve(len: usize, align: usize) -> Result<Self, MapError> {
        let reserve_error = |source| MapError::Reserve {
            len: len as u64,
            source,
        };
        let extra = align - sys::page_size() as usize;
        // SAFETY: a fresh private anonymous mapping at a kernel-chosen address touches no
        // existing memory. MAP_NORESERVE: the budget, not swap accounting, bounds it.
        let start = unsafe {
            sys::mmap(
                0,
                len + extra,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        }
        .map_err(reserve_error)?;
        // Keep the aligned part; give back the rest on either side.
        let base = start.next_multiple_of(align);
        let tail = start + len + extra - (base + len);
        for (from, bytes) in [(start, base - start), (base + len, tail)] {
            if bytes > 0 {
                // SAFETY: unmaps only parts of the mapping just created, outside the part
                // kept.
                unsafe { sys::munmap(from, bytes) }.map_err(reserve_error)?;
            }
        }
        let mapping = Self {
            base,
            len,
            holes: Mutex::new(Vec::new()),
        };
        // A forked child would inherit the range unregistered and read zeros where the
        // parent reads the file. Not inheriting it makes a child's access fault loudly.
        // SAFETY: advises only the mapping just created; DONTFORK discards nothing.
        unsafe { sys::madvise(base, len, sys::Advice::LinuxDontFork) }.map_err(reserve_error)?;
        Ok(mapping)
    }
}

impl Mapping {
    /// The parts of the reservation still mapped, in address order.
    fn live_parts(&self) -> Vec<Range<usize>> {
        let mut holes = lock(&self.holes).clone();
        holes.sort_by_key(|hole| hole.start);
        let mut parts = Vec::new();
        let mut at = 0;
        for hole in holes {
            if hole.start > at {
                parts.push(at..hole.start);
            }
            at = at.max(hole.end);
        }
        if at < self.len {
            parts.push(at..self.len);
        }
        parts
    }
}

impl Mapping {
    /// Lets go of the whole reservation without unmapping it: in a forked child, which
    /// does not have it (and may have mapped something else there since).
    fn forget(&mut self) {
        // Exclusive access: no lock, which a fork may have left held.
        let holes = self
            .holes
            .get_mut()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        holes.clear();
        holes.push(0..self.len);
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        for part in self.live_parts() {
            // SAFETY: unmaps a part of the reservation this value owns that the program
            // has not unmapped; the region dropping it holds no references into it any
            // more (`as_slice` borrows the region).
            let result = unsafe { sys::munmap(self.base + part.start, part.end - part.start) };
            if let Err(error) = result {
                panic!("munmap of a region failed: {error}");
            }
        }
    }
}

/// A file's bytes at a reserved address, served on fault. Dropping it stops serving it
/// and unmaps it.
pub struct Region {
    pager: Pager,
    id: RegionId,
    mapping: Mapping,
    data_len: u64,
    /// Dropped after `mapping` is unmapped.
    _mappings: MappingPromise,
}

/// Memory mappings reserved for a zero-copy region (see `Pager::promise_mappings`),
/// given back when dropped.
struct MappingPromise {
    pager: Pager,
    count: u64,
}

impl Drop for MappingPromise {
    fn drop(&mut self) {
        self.pager
            .inner
            .mappings_promised
            .fetch_sub(self.count, Ordering::AcqRel);
    }
}

impl Region {
    pub fn id(&self) -> RegionId {
        self.id
    }

    pub fn as_ptr(&self) -> *const u8 {
        self.mapping.base as *const u8
    }

    /// Bytes of file data the region presents.
    pub fn len(&self) -> usize {
        self.data_len as usize
    }

    pub fn is_empty(&self) -> bool {
        self.data_len == 0
    }

    /// Length of the mapping (data rounded up to a page, or the requested `map_len`).
    pub fn map_len(&self) -> usize {
        self.mapping.len
    }

    /// The file's bytes. Reading them faults pages in through the service.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the mapping is live for as long as self; its pages are only ever
        // installed whole by the service (UFFDIO_COPY is atomic per page) and never
        // written afterwards, so the bytes do not change under a shared reference.
        // An evicted page is refilled with the same file bytes on the next access.
        unsafe { std::slice::from_raw_parts(self.as_ptr(), self.data_len as usize) }
    }

    /// Whether a hint on `range` can be sent: inside the region, and from the process
    /// the service runs in.
    fn check(&self, range: &Range<u64>) -> Result<(), HintError> {
        if !self.pager.inner.serving_here() {
            return Err(HintError::ForkedChild {
                owner: self.pager.inner.owner,
            });
        }
        if range.start > range.end || range.end > self.mapping.len as u64 {
            return Err(HintError::OutOfRange {
                start: range.start,
                end: range.end,
                len: self.mapping.len as u64,
            });
        }
        Ok(())
    }

    /// Starts reading `range` (region offsets) within the budget; returns at once.
    pub fn prefetch(&self, range: Range<u64>) -> Result<(), HintError> {
        self.check(&range)?;
        self.pager
            .inner
            .shared
            .send(Command::Prefetch { id: self.id, range });
        Ok(())
    }

    /// Drops the resident blocks wholly inside `range`; they fault in again when touched.
    pub fn drop_range(&self, range: Range<u64>) -> Result<(), HintError> {
        self.check(&range)?;
        let (reply, answer) = sync_channel(1);
        self.pager.inner.shared.send(Command::Drop {
            id: self.id,
            range,
            reply,
        });
        answer.recv().map_err(|_| HintError::ServiceGone)
    }

    /// Keeps the blocks overlapping `range` resident (reading them now). Pinned bytes
    /// count against the budget; pinning all of it is refused.
    pub fn pin(&self, range: Range<u64>) -> Result<(), HintError> {
        self.check(&range)?;
        let (reply, answer) = sync_channel(1);
        self.pager.inner.shared.send(Command::Pin {
            id: self.id,
            range,
            reply,
        });
        match answer.recv() {
            Ok(Ok(())) => Ok(()),
            Ok(Err(PinRefused::UnknownRegion)) | Err(_) => Err(HintError::ServiceGone),
            Ok(Err(PinRefused::ExceedsBudget {
                requested,
                total,
                budget,
                block,
            })) => Err(HintError::PinExceedsBudget {
                requested,
                total,
                budget,
                block,
            }),
        }
    }

    pub fn unpin(&self, range: Range<u64>) -> Result<(), HintError> {
        self.check(&range)?;
        self.pager
            .inner
            .shared
            .send(Command::Unpin { id: self.id, range });
        Ok(())
    }

    /// Tells the prefetch policy how `range` will be read (`madvise` advice).
    pub fn advise(&self, range: Range<u64>, hint: AccessHint) -> Result<(), HintError> {
        self.check(&range)?;
        self.pager.inner.shared.send(Command::Hint {
            id: self.id,
            range,
            hint,
        });
        Ok(())
    }

    pub fn pager(&self) -> &Pager {
        &self.pager
    }

    /// Unmaps `range` (page-aligned region offsets) as munmap(2) would, for a program
    /// that unmaps part of a mapping: the blocks wholly inside it are forgotten (never
    /// read or installed again, their budget released), then the pages are unmapped.
    /// The rest of the region keeps working.
    pub fn unmap_part(&self, range: Range<u64>) -> Result<(), HintError> {
        self.check(&range)?;
        let page = sys::page_size();
        let range = range.start / page * page..range.end.next_multiple_of(page);
        if range.is_empty() {
            return Ok(());
        }
        let (reply, answer) = sync_channel(1);
        self.pager.inner.shared.send(Command::Unmap {
            id: self.id,
            range: range.clone(),
            reply,
        });
        answer.recv().map_err(|_| HintError::ServiceGone)?;
        // SAFETY: unmaps part of this region's own reservation, at the program's request;
        // the service has been told and no reference we hold points there. It cannot
        // fail for a page-aligned range inside a mapping we own.
        let _ = unsafe {
            sys::munmap(
                self.mapping.base + range.start as usize,
                (range.end - range.start) as usize,
            )
        };
        lock(&self.mapping.holes).push(range.start as usize..range.end as usize);
        Ok(())
    }

    /// Whether every page of the mapping has been unmapped by `unmap_part`.
    pub fn fully_unmapped(&self) -> bool {
        self.mapping.live_parts().is_empty()
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        if !self.pager.inner.serving_here() {
            // A forked child: nothing of the region is here (see `PagerInner::owner`).
            self.mapping.forget();
            return;
        }
        let (reply, answer) = sync_channel(1);
        self.pager
            .inner
            .shared
            .send(Command::RemoveRegion { id: self.id, reply });
        // Once acknowledged, the service never touches the range again. If the service is
        // gone the process is aborting anyway.
        let _ = answer.recv();
        // Unregistering wakes any thread still waiting on the range; munmap (in
        // `Mapping::drop`) follows. Only the parts still ours: a hole the program
        // unmapped may since hold another region of this pager, registered on the same
        // userfaultfd.
        for part in self.mapping.live_parts() {
            let _ = self.pager.inner.uffd.unregister(
                (self.mapping.base + part.start) as *mut libc::c_void,
                part.end - part.start,
            );
        }
    }
}
