//! The shim's life cycle, in one place: the process-wide state, the re-entry guard and
//! the exit report's handler. One atomic state:
//!
//! ```text
//!  Uninit --first candidate mmap--> Initializing --config ok--> Ready
//!                                        |                        |
//!                                        +--bad config / setuid--> Disabled
//!  Ready --fork, in the child--> ForkedChild   (pass-through for good)
//! ```
//!
//! The state belongs to the process that loaded the shim (its pid is recorded by a
//! constructor). A child made without our `fork` hook (glibc's `daemon` calls its
//! internal `__fork`; `_Fork`, a raw `clone`/`fork` system call and `vfork` run no hook
//! at all) inherits the state unchanged, so every check here also compares the pid: any
//! other process counts as a forked child, without writing anything (a vfork-like child
//! shares the parent's memory, and the parent's state must stay as it is).
//!
//! An image `env_scrub` decided not to serve (a child of the launched process, see
//! `process_claim`) never leaves `Uninit`: `ready_or_init` refuses it before reading any
//! configuration. A child of `fork` first gets kernel mappings of the managed ranges
//! (`fork_child`).
//!
//! Every hook passes straight through unless the state is `Ready`. Configuration is
//! read on the first mapping that could be managed (not in a constructor: the
//! environment and allocator are certainly usable by then). A hook re-entered during
//! initialisation, or called by another thread meanwhile, passes through.
//!
//! A thread inside shim code holds a `Reentry`: a hook it enters again from inside (the
//! pager starting its thread, Rust's runtime mapping a signal stack) passes through.
//!
//! When the shim's pager starts, an atexit handler is registered (once) that writes the
//! exit report (`exit_report`) in the owner; a child never writes it. And where the
//! configuration names a snapshot directory, a thread of the shim's own (`periodic`)
//! writes the stats there every `SNAPSHOT_PERIOD`: a program killed by a signal runs no
//! exit handler, and its launcher then reports the last snapshot.

use std::cell::Cell;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU8, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use hyperoffload::pressure_follower::PressureFollower;
use hyperoffload::shim_config::{BudgetSpec, ShimConfig};
use libc::{c_char, c_int};

use hyperoffload::sys::processes::getpid;

use crate::env_scrub;
use crate::exit_report;
use crate::heap;
use crate::managed::Shim;
use crate::periodic;
use crate::raw;

const UNINIT: u8 = 0;
const INITIALIZING: u8 = 1;
const READY: u8 = 2;
const DISABLED: u8 = 3;
const FORKED_CHILD: u8 = 4;

static STATE: AtomicU8 = AtomicU8::new(UNINIT);
static SHIM: OnceLock<Shim> = OnceLock::new();

/// The process `STATE` and `SHIM` belong to; 0 until recorded.
static OWNER: AtomicI32 = AtomicI32::new(0);

#[used]
#[link_section = ".init_array"]
static RECORD_OWNER_AT_LOAD: extern "C" fn(c_int, *const *const c_char, *const *mut c_char) =
    record_owner;

/// Records the owner when the library loads: before `main`, so before the program can
/// make any child.
extern "C" fn record_owner(_argc: c_int, _argv: *const *const c_char, _envp: *const *mut c_char) {
    owner();
}

/// The owner's pid, recorded now if no constructor has run yet (a hook called from an
/// earlier library's constructor).
fn owner() -> libc::pid_t {
    let recorded = OWNER.load(Ordering::Acquire);
    if recorded != 0 {
        return recorded;
    }
    match OWNER.compare_exchange(0, getpid(), Ordering::AcqRel, Ordering::Acquire) {
        Ok(_) => OWNER.load(Ordering::Acquire),
        Err(other) => other,
    }
}

/// Whether this is the process that loaded the shim, not a child of it, however made.
fn in_owner() -> bool {
    owner() == getpid()
}

/// The shim, if it is serving this process.
pub fn ready() -> Option<&'static Shim> {
    // The state first: the pid costs a system call, paid only while the shim serves.
    if STATE.load(Ordering::Acquire) == READY && in_owner() {
        SHIM.get()
    } else {
        None
    }
}

/// The shim, initialising it first if this is the first candidate mapping. A child never
/// initialises it: it would write the state a vfork-like child shares with its parent.
pub fn ready_or_init() -> Option<&'static Shim> {
    // A child (another pid than the launched process's, see `process_claim`) stays
    // inert for good, without reading the configuration.
    if !in_owner() || !env_scrub::serves_this_process() {
        return None;
    }
    match STATE.compare_exchange(UNINIT, INITIALIZING, Ordering::AcqRel, Ordering::Acquire) {
        Ok(_) => {
            let next = match read_config() {
                Some(config) => {
                    // Only this thread gets here, once.
                    let _ = SHIM.set(Shim::new(config, on_pager_start));
                    READY
                }
                None => DISABLED,
            };
            STATE.store(next, Ordering::Release);
            ready()
        }
        Err(_) => ready(),
    }
}

/// In a child after fork: the managed regions were not inherited (MADV_DONTFORK) and the
/// pager's service thread does not exist here, so nothing of the parent's shim may be
/// touched; its state is leaked, never dropped.
pub fn become_forked_child() {
    STATE.store(FORKED_CHILD, Ordering::Release);
}

/// Whether this process is a child of the shim's owner: through our `fork` hook, or
/// made any other way (then the state still reads as the parent's).
pub fn is_forked_child() -> bool {
    STATE.load(Ordering::Acquire) == FORKED_CHILD || !in_owner()
}

fn read_config() -> Option<ShimConfig> {
    // SAFETY: getauxval only reads the auxiliary vector.
    if unsafe { libc::getauxval(libc::AT_SECURE) } != 0 {
        // A setuid/setgid program: its environment is the caller's, not to be trusted.
        return None;
    }
    match ShimConfig::from_lookup(getenv) {
        Ok(mut config) => {
            // Only the process the launcher started hands its children to the keeper:
            // the launcher keeps only until that process ends.
            if !env_scrub::launched_process() {
                config.keeper_fd = None;
            }
            Some(config)
        }
        Err(error) => {
            raw::write_stderr(
                format!("hyperoffload: {error}; the shim is disabled, the program runs unpaged\n")
                    .as_bytes(),
            );
            None
        }
    }
}

/// getenv(3), without Rust's environment lock (the shim may run inside any call).
fn getenv(name: &str) -> Option<String> {
    let mut key = [0u8; 64];
    if name.len() >= key.len() {
        return None;
    }
    key[..name.len()].copy_from_slice(name.as_bytes());
    // SAFETY: `key` is NUL-terminated; getenv returns NULL or a NUL-terminated string
    // owned by the environment, copied out at once.
    unsafe {
        let value = libc::getenv(key.as_ptr().cast());
        if value.is_null() {
            return None;
        }
        Some(
            std::ffi::CStr::from_ptr(value)
                .to_string_lossy()
                .into_owned(),
        )
    }
}

thread_local! {
    /// Set while this thread runs shim code.
    static IN_SHIM: Cell<bool> = const { Cell::new(false) };
}

/// Marks this thread as inside the shim until dropped.
pub struct Reentry(());

impl Reentry {
    /// The guard, or `None` if this thread is inside the shim already.
    pub fn enter() -> Option<Self> {
        IN_SHIM.with(|flag| {
            if flag.get() {
                None
            } else {
                flag.set(true);
                Some(Reentry(()))
            }
        })
    }
}

impl Drop for Reentry {
    fn drop(&mut self) {
        IN_SHIM.with(|flag| flag.set(false));
    }
}

static EXIT_REPORT_REGISTERED: AtomicBool = AtomicBool::new(false);
static SNAPSHOTS_STARTED: AtomicBool = AtomicBool::new(false);

/// How often the stats snapshot is written: the most the report of a killed program
/// lags behind what it did. Each costs one stats request to the service and a small
/// file written, nothing near a fault's path.
const SNAPSHOT_PERIOD: Duration = Duration::from_millis(500);

/// What the shim calls when its pager starts (in the owner, with the pager slot's lock
/// held: nothing here may wait for it).
fn on_pager_start() {
    if !EXIT_REPORT_REGISTERED.swap(true, Ordering::AcqRel) {
        // SAFETY: registers a plain extern "C" function with no arguments.
        unsafe { libc::atexit(write_exit_report) };
    }
    start_snapshots();
    start_following();
}

static FOLLOWING_STARTED: AtomicBool = AtomicBool::new(false);

/// Under `--budget auto`, starts the thread (once) whose steps make the pager's budget
/// follow memory pressure (`hyperoffload::pressure_follower`): each waits for a
/// pressure event or a period, then sets the budget if it is to change.
fn start_following() {
    let Some(shim) = SHIM.get() else {
        return;
    };
    if shim.config.budget != BudgetSpec::Auto || FOLLOWING_STARTED.swap(true, Ordering::AcqRel) {
        return;
    }
    let (min, max) = (shim.config.budget_min, shim.config.budget_max);
    let mut follower: Option<PressureFollower> = None;
    let started = periodic::every("hyperoffload-follow", Duration::ZERO, move || {
        if is_forked_child() {
            return false;
        }
        let _reentry = Reentry::enter();
        let follower = match &mut follower {
            Some(follower) => follower,
            None => {
                // The thread starts when the pager does, with the slot's lock held: it
                // is running once that lock is free.
                let Some(pager) = shim.pager_if_running() else {
                    return true;
                };
                let made = follower.insert(PressureFollower::new(pager, min, max));
                shim.verbose(|| made.describe());
                made
            }
        };
        follower.step()
    });
    if let Err(error) = started {
        shim.say(&format!(
            "cannot start following memory pressure ({error}): the budget stays where it \
             started"
        ));
    }
}

/// Starts the snapshot thread (once), if the configuration names a directory.
fn start_snapshots() {
    let Some(shim) = SHIM.get() else {
        return;
    };
    let Some(dir) = shim.config.snapshot_dir.clone() else {
        return;
    };
    if SNAPSHOTS_STARTED.swap(true, Ordering::AcqRel) {
        return;
    }
    let started = periodic::every("hyperoffload-snap", SNAPSHOT_PERIOD, move || {
        write_snapshot(&dir)
    });
    if let Err(error) = started {
        shim.say(&format!(
            "cannot start the stats snapshots ({error}): if a signal kills the program, \
             its stats are lost"
        ));
    }
}

/// One snapshot of the pager's stats into `dir`; false once there is no point in more
/// (the directory cannot be written: said once).
fn write_snapshot(dir: &Path) -> bool {
    // Threads do not survive a fork: only the owner runs this; checked all the same.
    if is_forked_child() {
        return false;
    }
    let Some(shim) = SHIM.get() else {
        return false;
    };
    // The thread starts when the pager does: it runs.
    let Some(pager) = shim.pager_if_running() else {
        return true;
    };
    let _reentry = Reentry::enter();
    let written = exit_report::write_snapshot(
        &exit_report::Run {
            config: &shim.config,
            pager: &pager,
            files: shim.files(),
            policy_in_use: shim.policy_in_use(),
            managed_mappings: shim.managed_count(),
            heap_bytes: (heap::in_use(), heap::peak()),
            learning: None,
            experts: None,
            followed_graph: None,
            take_events: &Vec::new,
            say: &|message| shim.say(message),
        },
        dir,
    );
    match written {
        Ok(()) => true,
        Err(error) => {
            shim.say(&format!(
                "cannot write a stats snapshot in {}: {error}; no more are written",
                dir.display()
            ));
            false
        }
    }
}

/// The atexit handler: the exit report of the pager's run, whatever the state now (the
/// pager may have run before the shim was disabled).
extern "C" fn write_exit_report() {
    // A child inherits the handler but not the pager's service thread: asking it for
    // stats would wait forever. However the child was made, the check sees it; the
    // report is the parent's to write.
    if is_forked_child() {
        return;
    }
    let Some(shim) = SHIM.get() else {
        return;
    };
    let Some(pager) = shim.pager_if_running() else {
        return;
    };
    let _reentry = Reentry::enter();
    // Forked children that outlive this process lose their service with it: the
    // pager fills what they map first (and says so), so they read the files' bytes.
    pager.before_exit();
    exit_report::write(&exit_report::Run {
        config: &shim.config,
        pager: &pager,
        files: shim.files(),
        policy_in_use: shim.policy_in_use(),
        managed_mappings: shim.managed_count(),
        heap_bytes: (heap::in_use(), heap::peak()),
        learning: shim.learning(),
        experts: shim.expert_learning(),
        followed_graph: shim.followed_graph(),
        take_events: &|| shim.take_trace(),
        say: &|message| shim.say(message),
    });
}
