//! Worker threads that install prefetched reads into regions (UFFDIO_COPY,
//! `page_tables::install`) beside the fault service thread.
//!
//! Installing is most of the pager's CPU time: per 4 KiB page the kernel allocates a
//! page, charges the memory cgroup, copies, maps and adds the page to an LRU list. Perf
//! of the service thread during llama.cpp decode at half the model's size put 40 % of its
//! time in `mfill_atomic_copy` and 12 % in evictions, and a single thread doing all of it
//! tops out near 1.6 GB/s, under half of what the device delivers. Workers take
//! prefetched reads off the service thread, which meanwhile reaps completions, issues
//! reads and installs what a thread is waiting for itself.
//!
//! A worker only copies. Everything the service's bookkeeping needs to know comes back
//! through `InstallPool::collect` (with an eventfd the service's ring watches,
//! `Watch::Installed`; `collect_installs`, here, does the bookkeeping), so block
//! states, budget and policies stay single-threaded. A block being installed is still
//! "reading" to the service: it cannot be evicted, and a fault on it waits for the copy,
//! which wakes it. Before any command that changes mappings (drop, unmap, remove) the
//! service waits for the workers to finish (`wait_idle`), so a copy never lands in a
//! range the program has since unmapped and mapped again.

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Instant;

use userfaultfd::Uffd;

use super::page_tables::{install, InstallError};
use super::watch::Watch;
use super::{FaultService, ServiceError};
use crate::event::EventFd;

/// One read to install: its ring slot (held by the service until the install is
/// collected), the buffer holding it, and where it goes.
pub(crate) struct InstallJob {
    pub slot: u32,
    pub source: *const u8,
    pub target: usize,
    pub len: usize,
}

// SAFETY: `source` points into a ring buffer the service neither reuses nor frees while
// the job's slot is checked out, which lasts until the job is collected.
unsafe impl Send for InstallJob {}

/// A finished install.
pub(crate) struct Installed {
    pub slot: u32,
    pub result: Result<(), InstallError>,
    /// When the copy finished (and woke the threads waiting on it).
    pub at: Instant,
}

struct PoolState {
    jobs: VecDeque<InstallJob>,
    done: Vec<Installed>,
    stop: bool,
}

struct PoolShared {
    state: Mutex<PoolState>,
    /// Signalled when a job is queued or the pool stops.
    work: Condvar,
    /// Signalled when a job is done.
    finished: Condvar,
    /// Written once per finished job; the service's ring watches it.
    done_event: EventFd,
    /// Jobs finished since the pool started, readable without the lock.
    finished_count: AtomicUsize,
    uffd: Arc<Uffd>,
    page: usize,
    nice: i32,
}

impl PoolShared {
    fn lock(&self) -> MutexGuard<'_, PoolState> {
        // A worker never panics while holding the lock; if one did, the data is plain.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Worker threads that install reads.
pub(crate) struct InstallPool {
    shared: Arc<PoolShared>,
    workers: Vec<JoinHandle<()>>,
    /// Jobs submitted and not yet collected.
    in_flight: usize,
    /// Jobs collected since the pool started.
    collected: usize,
}

impl InstallPool {
    pub(crate) fn new(
        threads: usize,
        uffd: Arc<Uffd>,
        page: usize,
        nice: i32,
    ) -> std::io::Result<Self> {
        let done_event = EventFd::new()?;
        let shared = Arc::new(PoolShared {
            state: Mutex::new(PoolState {
                jobs: VecDeque::new(),
                done: Vec::new(),
                stop: false,
            }),
            work: Condvar::new(),
            finished: Condvar::new(),
            done_event,
            finished_count: AtomicUsize::new(0),
            uffd,
            page,
            nice,
        });
        let mut pool = Self {
            shared,
            workers: Vec::new(),
            in_flight: 0,
            collected: 0,
        };
        for n in 0..threads {
            let shared = Arc::clone(&pool.shared);
            let worker = std::thread::Builder::new()
                .name(format!("hyperoffload-in{n}"))
                .spawn(move || work(&shared))?;
            pool.workers.push(worker);
        }
        Ok(pool)
    }

    pub(crate) fn threads(&self) -> usize {
        self.workers.len()
    }

    /// The descriptor that becomes readable when jobs finish.
    pub(crate) fn event_fd(&self) -> RawFd {
        self.shared.done_event.as_raw_fd()
    }

    /// Jobs submitted and not yet finished (some finished ones may be uncollected).
    pub(crate) fn unfinished(&self) -> usize {
        self.in_flight - self.finished_uncollected()
    }

    /// Whether finished jobs wait to be collected; cheap (no lock, no system call).
    pub(crate) fn finished_uncollected(&self) -> usize {
        self.shared.finished_count.load(Ordering::Acquire) - self.collected
    }

    pub(crate) fn submit(&mut self, job: InstallJob) {
        self.shared.lock().jobs.push_back(job);
        self.in_flight += 1;
        self.shared.work.notify_one();
    }

    /// Moves finished jobs to `out` without waiting.
    pub(crate) fn collect(&mut self, out: &mut Vec<Installed>) {
        // Drained before taking the list, so a job finished after this signals again.
        self.shared.done_event.drain();
        let mut state = self.shared.lock();
        self.in_flight -= state.done.len();
        self.collected += state.done.len();
        out.append(&mut state.done);
    }

    /// Waits until every submitted job has finished, moving them to `out`.
    pub(crate) fn wait_idle(&mut self, out: &mut Vec<Installed>) {
        let mut state = self.shared.lock();
        while state.done.len() < self.in_flight {
            state = self
                .shared
                .finished
                .wait(state)
                .unwrap_or_else(|e| e.into_inner());
        }
        self.in_flight -= state.done.len();
        self.collected += state.done.len();
        out.append(&mut state.done);
    }
}

impl Drop for InstallPool {
    fn drop(&mut self) {
        self.shared.lock().stop = true;
        self.shared.work.notify_all();
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}

impl FaultService {
    /// The workers' eventfd is readable (`Watch::Installed`): finishes what they
    /// installed.
    pub(super) fn installs_readable(&mut self, rearm: bool) -> Result<(), ServiceError> {
        self.collect_installs(false)?;
        if let (true, Some(pool)) = (rearm, &self.installs) {
            self.ring.watch(pool.event_fd(), Watch::Installed.token())?;
        }
        Ok(())
    }

    /// Finishes installs done by the workers; with `wait`, all of them, waiting for
    /// those still copying.
    pub(super) fn collect_installs(&mut self, wait: bool) -> Result<(), ServiceError> {
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
}

/// Sets the calling thread's nice value to `nice` if it is allowed to (CAP_SYS_NICE or
/// RLIMIT_NICE), and returns the value it runs at.
///
/// The pager's threads are the program's I/O path: the kernel would do their work in
/// interrupt context and in the faulting thread itself, ahead of any user thread. At
/// equal priority they share the CPU with the program's threads, and inference
/// programs spin while they wait (OpenMP barriers): with two cores, llama.cpp's threads
/// spinning at a barrier took as much CPU as the installs they waited for (docs/design.md,
/// "The fault service, measured").
pub(crate) fn raise_priority(nice: i32) -> i32 {
    crate::sys::processes::set_thread_nice(nice).unwrap_or(-1)
}

fn work(shared: &PoolShared) {
    raise_priority(shared.nice);
    loop {
        let job = {
            let mut state = shared.lock();
            loop {
                if let Some(job) = state.jobs.pop_front() {
                    break job;
                }
                if state.stop {
                    return;
                }
                state = shared.work.wait(state).unwrap_or_else(|e| e.into_inner());
            }
        };
        // Workers only run where forks are not served: a refusal settles by itself.
        let mut on_busy = std::thread::yield_now;
        // SAFETY: the job's buffer and target are held for it by the service (see
        // `InstallJob`); the service waits for all jobs before letting any range go.
        let result = unsafe {
            install(
                &shared.uffd,
                job.source,
                job.target,
                job.len,
                shared.page,
                &mut on_busy,
            )
        };
        let at = Instant::now();
        {
            let mut state = shared.lock();
            state.done.push(Installed {
                slot: job.slot,
                result,
                at,
            });
            // Under the lock, so the count never runs ahead of the list.
            shared.finished_count.fetch_add(1, Ordering::Release);
        }
        shared.finished.notify_all();
        shared.done_event.signal();
    }
}
