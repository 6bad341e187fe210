//! fork: the child gets plain kernel mappings of the model files in place of the
//! managed regions it did not inherit (see `fork_plan`), with one message for the first
//! such child; the parent goes on being served.
//!
//! pthread_atfork handlers, registered once the first mapping is managed: they run for
//! our `fork` symbol and for every fork inside libc that runs its handlers (`daemon`'s
//! internal `__fork`). `_Fork`, a raw fork/clone system call and `vfork`/`posix_spawn`
//! run none: a vfork-like child shares the parent's memory and execs (nothing to do),
//! and the other two are left as before (their copy of a managed range is absent).
//!
//! - prepare (parent, before the fork): if the shim serves this process, takes the
//!   `layout` lock (no mapping is made or removed across the fork, so the plan is exact
//!   and no thread of the parent is left holding it in the child) and builds the plan.
//! - parent (after): drops the plan and the lock.
//! - child (after, the forking thread alone): marks the process a forked child, maps
//!   the plan, says so the first time, then drops the plan and the lock, unlocking the
//!   child's copy. With a pager that serves forks the plan maps nothing: the child
//!   keeps the ranges it inherits served, and `mremap` of them is refused there as in
//!   the program (`ServedRanges`; `refuses_remap_in_child`).

use std::cell::RefCell;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};

use hyperoffload::size::format_size;
use hyperoffload::sys::processes::getpid;

use crate::fork_plan::{ForkPlan, ServedRanges};
use crate::raw;
use crate::state::{self, Reentry};

/// The plan between prepare and the parent's or child's handler, on the forking thread.
struct Prepared {
    plan: ForkPlan,
    /// What the first child says, written by the parent (the child only writes it).
    message: Vec<u8>,
    _layout: MutexGuard<'static, ()>,
}

thread_local! {
    static PREPARED: RefCell<Option<Prepared>> = const { RefCell::new(None) };
}

/// Set in the parent once a child has been given a plan: later children stay quiet.
static SAID: AtomicBool = AtomicBool::new(false);
static REGISTERED: AtomicBool = AtomicBool::new(false);

/// In a served forked child (and its own children, which inherit the memory): the
/// ranges it inherited served. Never used in the program itself. Only `try_lock`ed: a
/// copy locked by a thread that a later fork left behind stays locked, and the calls
/// then pass through as before.
static SERVED_HERE: Mutex<ServedRanges> = Mutex::new(ServedRanges::empty());
static WARNED_REMAP: AtomicBool = AtomicBool::new(false);
/// Set with `SERVED_HERE`: every other process pays one load for its munmaps and
/// mremaps.
static HAS_SERVED: AtomicBool = AtomicBool::new(false);

/// In a forked child: whether an `mremap` of `old..old + old_len` (to `fixed`, with
/// MREMAP_FIXED) touches a range it inherited served, and is to be refused (a warning
/// once). False in any other process.
pub fn refuses_remap_in_child(old: usize, old_len: usize, fixed: Option<(usize, usize)>) -> bool {
    if !HAS_SERVED.load(Ordering::Acquire) || !state::is_forked_child() {
        return false;
    }
    let Ok(served) = SERVED_HERE.try_lock() else {
        return false;
    };
    if served.is_empty() {
        return false;
    }
    let page = hyperoffload::sys::memory::page_size() as usize;
    let span = |addr: usize, len: usize| -> Range<usize> {
        addr..addr.saturating_add(len.max(1)).next_multiple_of(page)
    };
    let refused = served.touches(&span(old, old_len))
        || fixed.is_some_and(|(a, l)| served.touches(&span(a, l)));
    drop(served);
    if refused && !WARNED_REMAP.swap(true, Ordering::Relaxed) {
        raw::write_stderr(
            b"hyperoffload: mremap of a model mapping a forked child inherited from its \
              served parent is not supported; refused with EINVAL\n",
        );
    }
    refused
}

/// In a forked child: `addr..addr + len` is being unmapped, so whatever is mapped there
/// later is not a served range.
pub fn unmapped_in_child(addr: usize, len: usize) {
    if !HAS_SERVED.load(Ordering::Acquire) || !state::is_forked_child() {
        return;
    }
    if let Ok(mut served) = SERVED_HERE.try_lock() {
        served.forget(&(addr..addr.saturating_add(len)));
    }
}

/// Registers the handlers, once. Called in the owner once a mapping is managed.
pub fn register_once() {
    if REGISTERED.swap(true, Ordering::AcqRel) {
        return;
    }
    // SAFETY: registers three plain extern "C" functions taking no arguments; the shim
    // is never unloaded.
    let rc = unsafe { libc::pthread_atfork(Some(prepare), Some(parent), Some(child)) };
    if rc != 0 {
        raw::write_stderr(
            b"hyperoffload: cannot register the fork handlers: a forked child would \
              fault on the model mappings\n",
        );
    }
}

extern "C" fn prepare() {
    let Some(shim) = state::ready() else {
        return;
    };
    // A thread inside the shim (a signal handler forking in the middle of a hook) may
    // hold `layout`: its child gets no plan rather than a deadlock.
    let Some(reentry) = Reentry::enter() else {
        return;
    };
    let (layout, plan) = shim.prepare_fork();
    let message = if plan.is_empty() || SAID.load(Ordering::Acquire) {
        Vec::new()
    } else {
        format!(
            "hyperoffload: a forked child of pid {} maps its {} model range(s) ({}) from \
             the kernel's page cache, outside the budget, until it execs: the pager \
             serves only the process it started (said for the first child)\n",
            getpid(),
            plan.ranges.len(),
            format_size(plan.bytes())
        )
        .into_bytes()
    };
    drop(reentry);
    PREPARED.with(|prepared| {
        *prepared.borrow_mut() = Some(Prepared {
            plan,
            message,
            _layout: layout,
        })
    });
}

fn take() -> Option<Prepared> {
    PREPARED.with(|prepared| prepared.borrow_mut().take())
}

extern "C" fn parent() {
    if let Some(prepared) = take() {
        if !prepared.plan.is_empty() {
            SAID.store(true, Ordering::Release);
        }
    }
}

extern "C" fn child() {
    state::become_forked_child();
    let Some(mut prepared) = take() else {
        return;
    };
    if !prepared.plan.served.is_empty() {
        // The forking thread alone runs here, and the program never locks it.
        if let Ok(mut served) = SERVED_HERE.try_lock() {
            *served = std::mem::take(&mut prepared.plan.served);
            HAS_SERVED.store(true, Ordering::Release);
        }
    }
    let applied = prepared.plan.apply();
    raw::write_stderr(&prepared.message);
    if applied.failed > 0 {
        raw::write_stderr(
            b"hyperoffload: a forked child could not map some model ranges again (the \
              file was renamed or removed since): reading there faults\n",
        );
    }
}
