//! `PagerBuilder`: the pager's settings, and starting it (the userfaultfd, the frame
//! store, the install workers and the fault service thread).

#[cfg(feature = "fault-injection")]
use std::ops::Range;
use std::sync::atomic::{AtomicU32, AtomicU64};
use std::sync::{Arc, Mutex};

use userfaultfd::{FeatureFlags, Uffd};

use super::uffd::create_uffd;
use super::{
    default_demand_spin_min_reads, Pager, PagerError, PagerInner, DEFAULT_BLOCK_SIZE,
    DEFAULT_DEMAND_SPIN, DEFAULT_INSTALL_THREADS, DEFAULT_MAX_READ, DEFAULT_QUEUE_DEPTH,
    DEFAULT_THREAD_NICE, SPARE_FRAMES,
};
use crate::budget::floor;
use crate::command::Shared;
use crate::event::EventFd;
use crate::policy::{EvictionKind, EvictionPolicy, PrefetchKind, PrefetchPolicy};
#[cfg(feature = "fault-injection")]
use crate::service::InjectedFaults;
use crate::service::{FaultService, InstallPool, ServiceConfig};
use crate::shaped_region::ShapeFiles;
use crate::shared_store::{FrameStore, Tmpfs};
use crate::sys::memory::HUGE_PAGE;
use crate::{sys, uffd_ext};

/// Builds a pager.
pub struct PagerBuilder {
    budget: u64,
    max_budget: Option<u64>,
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
    serve_forks: bool,
    serve_forks_at_fork: bool,
    keeper: Option<std::os::fd::OwnedFd>,
    share_dir: Option<std::path::PathBuf>,
    #[cfg(feature = "fault-injection")]
    faults: InjectedFaults,
    /// Unit tests: the reads' outcomes, carried out by a scripted ring, not io_uring.
    #[cfg(test)]
    read_script: Option<crate::ring::scripted::ReadScript>,
}

impl Default for PagerBuilder {
    fn default() -> Self {
        Self {
            budget: 1 << 30,
            max_budget: None,
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
            serve_forks: false,
            serve_forks_at_fork: false,
            keeper: None,
            share_dir: None,
            #[cfg(feature = "fault-injection")]
            faults: InjectedFaults::default(),
            #[cfg(test)]
            read_script: None,
        }
    }
}

impl PagerBuilder {
    /// Resident bytes of all regions together never exceed this.
    pub fn budget(mut self, bytes: u64) -> Self {
        self.budget = bytes;
        self
    }

    /// The most `Pager::set_budget` may raise the budget to (default: the budget it
    /// starts with). With zero copy the frame store is sized for it: its frames take
    /// memory only once filled, so a high ceiling costs address space, not RAM.
    pub fn max_budget(mut self, bytes: u64) -> Self {
        self.max_budget = Some(bytes);
        self
    }

    /// The most the budget may grow to, and the least it may shrink to: the floor
    /// below which the program's threads would evict each other's last blocks (see
    /// `budget::floor`), never above the budget the pager starts with.
    fn budget_bounds(&self) -> (u64, u64) {
        let floor = floor::floor(self.block_size, floor::threads()).min(self.budget);
        (floor, self.max_budget.unwrap_or(0).max(self.budget))
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

    /// Whether a child of `fork` is served too: its copy of every region is served by
    /// this pager's service (`UFFD_FEATURE_EVENT_FORK`), from the same resident blocks
    /// and within the same budget, so a block read for one process is not read again for
    /// another. Regions are then file-shaped (`shaped_region`: their pages belong to one
    /// shared-memory file, which a child maps too) and blocks are copied in (zero copy
    /// is not used even if asked for, nor install workers). Needs CAP_SYS_PTRACE; without it the pager is built
    /// as if this were off and `Stats::forks_refused` says why. Off by default (as is
    /// `serve_forks_at_fork`): the service is a thread of this process, and a child that
    /// outlives it is safe only if `Pager::before_exit` (or dropping the pager) ran
    /// first, which fills what the children map beyond the budget, or a keeper
    /// (`keeper`) serves it; after an exit that runs neither (`_exit`, a signal, exec)
    /// a child reads zeros where a block was not resident (preload/README.md,
    /// "Processes").
    pub fn serve_forks(mut self, on: bool) -> Self {
        self.serve_forks = on;
        self
    }

    /// Whether forked children are served from the program's first fork on, with zero
    /// copy until then: blocks are mapped from frames while the program is alone, and
    /// the first fork (one that runs libc's fork handlers) makes every region
    /// file-shaped, as `serve_forks` makes them from the start, before the child is
    /// made (`service::shaping`). Costs nothing to a program that never forks; the
    /// fork that converts waits while the resident blocks are written into the regions'
    /// files (about 0.3 s a GiB here). Used only with zero copy in effect and not
    /// `serve_forks`; needs CAP_SYS_PTRACE for fork events, and `Stats::forks_refused`
    /// says why children are not served otherwise. Off by default.
    pub fn serve_forks_at_fork(mut self, on: bool) -> Self {
        self.serve_forks_at_fork = on;
        self
    }

    /// With `serve_forks` or `serve_forks_at_fork`: a socket to the keeper (`crate::keeper`), a process outside
    /// this one that keeps the forked children reading the files' bytes when this
    /// process ends without its exit handlers (`_exit`, a fatal signal, an exec).
    pub fn keeper(mut self, socket: std::os::fd::OwnedFd) -> Self {
        self.keeper = Some(socket);
        self
    }

    pub fn trace(mut self, limit: usize) -> Self {
        self.trace_limit = limit;
        self
    }

    /// The largest read, once the settings are checked to make sense together.
    fn checked_max_read(&self, page: u64) -> Result<u64, PagerError> {
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
        Ok(max_read)
    }

    /// Serving forks: the userfaultfd (with fork events), where file-shaped regions'
    /// files are made when blocks are read straight into them (None: copied in), and
    /// why they are copied if they are.
    fn shaping_uffd(&self) -> Result<(Uffd, Option<ShapeFiles>, Option<String>), PagerError> {
        let fork = FeatureFlags::EVENT_FORK.bits();
        if !self.zero_copy {
            return Ok((create_uffd(fork)?, None, Some("turned off".into())));
        }
        // Read straight into the file, a block's pages are there before its bytes:
        // every process must meet them as minor faults until the read is done.
        match create_uffd(fork | uffd_ext::FEATURE_MINOR_SHMEM) {
            Ok(uffd) => Ok((uffd, Some(ShapeFiles::new()), None)),
            Err(error) => {
                let uffd = create_uffd(fork)?;
                let why = format!("userfaultfd lacks minor faults on shmem ({error})");
                Ok((uffd, None, Some(why)))
            }
        }
    }

    /// The userfaultfd and, with zero copy, the frame store; or why blocks are copied.
    /// With `at_fork` and a frame store: fork and move events too, if the kernel grants
    /// them (the last value: see `serve_forks_at_fork`), or why not.
    fn uffd_and_frames(&self, at_fork: bool) -> Result<UffdAndFrames, PagerError> {
        let (store, zero_copy_refused) = if !self.zero_copy {
            (None, Some("turned off".to_string()))
        } else if self.serve_forks {
            (None, Some("forked children are served".to_string()))
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
            // The budget may grow to its ceiling.
            let ceiling = self.budget_bounds().1;
            let frames = (ceiling / self.block_size) as u32 + SPARE_FRAMES;
            // Their memory: the budget, and a frame for the read that finds every
            // other frame's memory in use (free frames' is given back before); the
            // service lowers and raises it with the budget.
            let memory = self.budget + self.block_size;
            let store = Tmpfs::new(true).and_then(|huge| {
                let pages = Tmpfs::new(false)?;
                FrameStore::new(&huge, &pages, self.block_size, frames, memory)
            });
            match store {
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
        let Some(store) = store else {
            return Ok((create_uffd(0)?, None, zero_copy_refused, Err(None)));
        };
        let minor = uffd_ext::FEATURE_MINOR_SHMEM;
        let mut forks = Err(None);
        if at_fork {
            let events = FeatureFlags::EVENT_FORK.bits() | FeatureFlags::EVENT_REMAP.bits();
            match create_uffd(minor | events) {
                Ok(uffd) => return Ok((uffd, Some(store), None, Ok(()))),
                Err(error) => {
                    forks = Err(Some(format!(
                        "userfaultfd refused fork events ({error}; needs CAP_SYS_PTRACE)"
                    )))
                }
            }
        }
        Ok(match create_uffd(minor) {
            Ok(uffd) => (uffd, Some(store), None, forks),
            Err(error) => (
                create_uffd(0)?,
                None,
                Some(format!("userfaultfd lacks minor faults on shmem ({error})")),
                forks,
            ),
        })
    }

    /// With `serve_forks`: a directory private to the run (`crate::share`) where this
    /// pager lets other processes of the run that map the same files attach to its
    /// regions, so that they share its resident blocks and budget.
    pub fn share_dir(mut self, dir: std::path::PathBuf) -> Self {
        self.share_dir = Some(dir);
        self
    }

    /// Unit tests: reads end as `script` says, carried out by a scripted ring
    /// (`crate::ring::scripted`) instead of io_uring.
    #[cfg(test)]
    pub(crate) fn read_script(mut self, script: crate::ring::scripted::ReadScript) -> Self {
        self.read_script = Some(script);
        self
    }

    pub fn build(self) -> Result<Pager, PagerError> {
        let page = sys::memory::page_size();
        let max_read = self.checked_max_read(page)?;
        let FaultSetup {
            uffd,
            store,
            zero_copy_refused,
            forks_refused,
            serve_forks,
            at_fork,
            shape_files,
        } = self.fault_setup()?;
        let zero_copy = store.is_some();
        // A read fills one frame: blocks are read one at a time (they are 2 MiB or more).
        let max_read = if zero_copy { self.block_size } else { max_read };
        let uffd = Arc::new(uffd);
        let wakeup = EventFd::new().map_err(PagerError::EventFd)?;
        let shared = Arc::new(Shared::new(wakeup));
        shared
            .serving_forks
            .store(serve_forks, std::sync::atomic::Ordering::Release);
        let installs = self.install_pool(zero_copy || serve_forks, &uffd, page)?;
        let (budget_floor, budget_ceiling) = self.budget_bounds();
        let service = FaultService::new(
            ServiceConfig {
                budget: self.budget,
                budget_floor,
                budget_ceiling,
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
                serve_forks,
                read_in_place: serve_forks && shape_files.is_some(),
                forks_refused,
                shape_at_fork: shape_files.clone().filter(|_| at_fork),
                keeper: self.keeper.filter(|_| serve_forks || at_fork),
                share_dir: self.share_dir.filter(|_| serve_forks),
                #[cfg(feature = "fault-injection")]
                faults: self.faults,
                #[cfg(test)]
                read_script: self.read_script,
            },
            uffd.clone(),
            shared.clone(),
            self.prefetch,
            self.eviction,
            installs,
            store,
        )?;
        if serve_forks || at_fork {
            super::fork_guard::guard(&shared);
        }
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
                budget: AtomicU64::new(self.budget),
                budget_bounds: (budget_floor, budget_ceiling),
                block_size: self.block_size,
                zero_copy,
                mappings_promised: AtomicU64::new(0),
                shape_files,
                owner: sys::processes::getpid(),
            }),
        })
    }

    /// How the pager meets faults, as the kernel grants it: the userfaultfd and its
    /// features, the frame store for zero copy, whether forked children are served
    /// (from the start, or from the first fork) and where file-shaped regions' files
    /// are made; with why what was asked for is not granted.
    fn fault_setup(&self) -> Result<FaultSetup, PagerError> {
        let mut shape_files = None;
        let mut at_fork = false;
        let (uffd, store, mut zero_copy_refused, forks_refused) = if self.serve_forks {
            match self.shaping_uffd() {
                Ok((uffd, files, copied)) => {
                    shape_files = files.map(Arc::new);
                    (uffd, None, copied, None)
                }
                Err(error) => {
                    let (uffd, store, refused, _) = self.uffd_and_frames(false)?;
                    let why =
                        format!("userfaultfd refused fork events ({error}; needs CAP_SYS_PTRACE)");
                    (uffd, store, refused, Some(why))
                }
            }
        } else {
            let (uffd, store, refused, forks) =
                self.uffd_and_frames(self.serve_forks_at_fork && self.share_dir.is_none())?;
            at_fork = forks.is_ok();
            if at_fork {
                // Made now, while nothing waits: a fork's prepare handler must not.
                shape_files = Some(Arc::new(ShapeFiles::new()));
            }
            (uffd, store, refused, forks.err().flatten())
        };
        let serve_forks = self.serve_forks && forks_refused.is_none();
        // A pager whose regions other processes attach to copies blocks in: a guest maps
        // the memfd's pages itself, and one a read in place had allocated but not yet
        // filled would be mapped as it is.
        let shape_files =
            shape_files.filter(|_| (serve_forks && self.share_dir.is_none()) || at_fork);
        if serve_forks && self.share_dir.is_some() && zero_copy_refused.is_none() {
            zero_copy_refused =
                Some("its regions are shared with other processes of the run".into());
        }
        Ok(FaultSetup {
            uffd,
            store,
            zero_copy_refused,
            forks_refused,
            serve_forks,
            at_fork,
            shape_files,
        })
    }

    /// The install workers, unless the service thread installs blocks itself
    /// (`service_installs`).
    fn install_pool(
        &self,
        service_installs: bool,
        uffd: &Arc<Uffd>,
        page: u64,
    ) -> Result<Option<InstallPool>, PagerError> {
        // Mapping a frame is cheap: the service thread does it; there is nothing to copy.
        // Serving forks: a fork makes installs wait (EAGAIN) until the service has read
        // its event, which workers could only spin on; the service thread installs.
        let install_threads = if service_installs {
            0
        } else {
            self.install_threads
        };
        Ok(match install_threads {
            0 => None,
            threads => Some(
                InstallPool::new(threads, uffd.clone(), page as usize, self.thread_nice)
                    .map_err(PagerError::Spawn)?,
            ),
        })
    }
}

/// What `PagerBuilder::fault_setup` decided.
struct FaultSetup {
    uffd: Uffd,
    /// The frame store, with zero copy.
    store: Option<FrameStore>,
    /// Why blocks are copied in, if they are.
    zero_copy_refused: Option<String>,
    /// Why forked children are not served, if they were to be.
    forks_refused: Option<String>,
    /// Whether forked children are served from the start.
    serve_forks: bool,
    /// Whether they are served from the first fork on.
    at_fork: bool,
    /// Where file-shaped regions' files are made, for reads in place (from the start)
    /// or at the first fork.
    shape_files: Option<Arc<ShapeFiles>>,
}

/// The userfaultfd, the frame store, why blocks are copied if they are, and whether fork
/// events were granted for `serve_forks_at_fork` (or why not, if asked).
type UffdAndFrames = (
    Uffd,
    Option<FrameStore>,
    Option<String>,
    Result<(), Option<String>>,
);
