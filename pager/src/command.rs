//! The protocol between the API threads (`pager`) and the fault service (`service`):
//! commands queued in `Shared` and answered on their reply channels, and the statistics
//! the service publishes. Neither side's types appear here, so both depend on this
//! module and not on each other.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::mpsc::SyncSender;
use std::sync::Mutex;

use crate::event::EventFd;
use crate::file::BackingFile;
use crate::layout::RegionLayout;
use crate::lock::lock;
use crate::policy::{AccessHint, RegionId};
use crate::stats::Stats;
use crate::trace::TraceRecord;

/// Why the service refused to pin a range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PinRefused {
    /// The region is gone (being removed).
    UnknownRegion,
    /// Pinning would leave less than one block of the budget for demand faults.
    ExceedsBudget {
        requested: u64,
        total: u64,
        budget: u64,
        block: u64,
    },
}

/// A move of a region's new, file-shaped mapping over its old one
/// (`Command::ShapeForFork`): `len` bytes from `from` to `to`, with `mremap`, which
/// keeps the range registered with the userfaultfd (`UFFD_FEATURE_EVENT_REMAP`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RegionMove {
    pub from: usize,
    pub to: usize,
    pub len: usize,
}

/// A request to the fault service, answered on `reply` when it has been carried out.
pub(crate) enum Command {
    AddRegion {
        id: RegionId,
        base: usize,
        layout: RegionLayout,
        file: BackingFile,
        /// The program's protection of the region (frames are mapped with it).
        prot: i32,
        /// With a pager that serves forks: the file the region's data pages are
        /// (`shaped_region`), read-write, to punch evicted blocks out of.
        shape: Option<std::os::fd::OwnedFd>,
        reply: SyncSender<()>,
    },
    RemoveRegion {
        id: RegionId,
        reply: SyncSender<()>,
    },
    /// A thread of the program is about to fork (`pager::fork_guard`), and its libc will
    /// hold the allocator's locks until the kernel's fork returns, which waits until the
    /// service has read the fork event: the service answers, then reads the program's
    /// userfaultfd without allocating until that event (or until `Shared::forks_done`
    /// passes `generation`: the fork ended without one).
    ForkComing {
        generation: u64,
        reply: SyncSender<()>,
        /// Answered once the fork's child, if any, was handed to the keeper.
        kept: SyncSender<()>,
    },
    /// A thread of the program is about to fork, and this pager serves forks from the
    /// first one on (`PagerBuilder::serve_forks_at_fork`): the service makes every
    /// region file-shaped (`service::shaping`), each built at a new address, and answers
    /// with the moves the forking thread then makes over the regions (empty: nothing to
    /// move). Until `ShapedForFork`, the program's faults on those regions wait.
    ShapeForFork {
        reply: SyncSender<Vec<RegionMove>>,
    },
    /// The forking thread made the moves `ShapeForFork` answered with; the kernel
    /// refused those in `failed`. Answered once the regions are in place.
    ShapedForFork {
        failed: Vec<RegionMove>,
        reply: SyncSender<()>,
    },
    Prefetch {
        id: RegionId,
        range: Range<u64>,
    },
    Drop {
        id: RegionId,
        range: Range<u64>,
        reply: SyncSender<()>,
    },
    Unmap {
        id: RegionId,
        range: Range<u64>,
        reply: SyncSender<()>,
    },
    Pin {
        id: RegionId,
        range: Range<u64>,
        reply: SyncSender<Result<(), PinRefused>>,
    },
    Unpin {
        id: RegionId,
        range: Range<u64>,
    },
    Hint {
        id: RegionId,
        range: Range<u64>,
        hint: AccessHint,
    },
    /// Changes the budget (within the pager's bounds); answered with the budget now in
    /// force once what it holds fits it (see `Pager::set_budget`).
    SetBudget {
        bytes: u64,
        reply: SyncSender<u64>,
    },
    Stats {
        reply: SyncSender<Stats>,
    },
    /// Hands over the faults traced so far, and how many did not fit.
    TakeTrace {
        reply: SyncSender<(Vec<TraceRecord>, u64)>,
    },
    /// The program is about to exit (`Pager::before_exit`): forked children that still
    /// live must go on reading the files' bytes without the service.
    Exiting {
        reply: SyncSender<()>,
    },
    Shutdown,
}

impl Command {
    /// Whether the command must wait while regions are being moved at a fork
    /// (`service::shaping`): it adds, removes or unmaps a region, whose moves were
    /// already worked out, starts another conversion, or ends the service.
    pub(crate) fn waits_for_moves(&self) -> bool {
        matches!(
            self,
            Command::AddRegion { .. }
                | Command::RemoveRegion { .. }
                | Command::Unmap { .. }
                | Command::ShapeForFork { .. }
                | Command::Exiting { .. }
                | Command::Shutdown
        )
    }

    /// Whether the command drops pages, lets go of a range or changes what may be
    /// evicted: the service finishes every install in progress before carrying it out.
    pub(crate) fn changes_residency(&self) -> bool {
        matches!(
            self,
            Command::RemoveRegion { .. }
                | Command::Drop { .. }
                | Command::Unmap { .. }
                | Command::Pin { .. }
                | Command::Unpin { .. }
                | Command::Exiting { .. }
        )
    }
}

/// State shared between API threads and the service thread.
pub(crate) struct Shared {
    pub(crate) commands: Mutex<VecDeque<Command>>,
    /// Written to wake the service when a command is queued.
    pub(crate) wakeup: EventFd,
    /// Last snapshot the service published, readable even after it stopped.
    pub(crate) stats: Mutex<Stats>,
    /// Forks of the program that have returned in it (see `Command::ForkComing`).
    pub(crate) forks_done: std::sync::atomic::AtomicU64,
    /// Whether the program's forked children are served: from the start
    /// (`PagerBuilder::serve_forks`), or since its first fork made the regions
    /// file-shaped. Set by the service (or the builder), read by the API threads.
    pub(crate) serving_forks: std::sync::atomic::AtomicBool,
    /// Set when the service thread ends: commands sent after it are never answered.
    pub(crate) stopped: std::sync::atomic::AtomicBool,
}

impl Shared {
    pub(crate) fn new(wakeup: EventFd) -> Self {
        Self {
            commands: Mutex::new(VecDeque::new()),
            wakeup,
            stats: Mutex::new(Stats::default()),
            forks_done: std::sync::atomic::AtomicU64::new(0),
            serving_forks: std::sync::atomic::AtomicBool::new(false),
            stopped: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Queues `command` and wakes the service (API side).
    pub(crate) fn send(&self, command: Command) {
        lock(&self.commands).push_back(command);
        self.wakeup.signal();
    }

    /// The oldest command not yet carried out (service side).
    pub(crate) fn next_command(&self) -> Option<Command> {
        lock(&self.commands).pop_front()
    }

    /// Replaces the published statistics (service side).
    pub(crate) fn publish(&self, stats: Stats) {
        *lock(&self.stats) = stats;
    }
}
