//! Around a libc `fork` of a process whose pager serves forks: the prepare handler
//! first has a pager that serves them only from the first fork on make its regions
//! file-shaped (`Command::ShapeForFork`, `service::shaping`), moving each new mapping
//! over its region with `mremap`; then it tells each pager serving forks that a fork is
//! coming and waits for its answer, so
//! that the service reads the fork event without allocating (see
//! `service::fork_pause`); the parent handler counts the fork done, which ends a pause
//! that saw no fork event (the fork failed, or no region was there to copy), and waits
//! until the service has handed the child's userfaultfd to the keeper, if there is one
//! (`crate::keeper`), so that a program ending right after `fork` returns leaves the
//! child kept.
//!
//! Handlers registered once per process, when the first such pager is built. A fork
//! that runs no handlers (`_Fork`, a raw system call) takes no allocator locks either,
//! and the service reads its event in its own time.

use std::cell::RefCell;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::{Arc, Mutex, Once, Weak};
use std::time::Duration;

use crate::command::{Command, Shared};
use crate::lock::lock;
use crate::sys;

/// The pagers that serve forks: their shared state, and the process each serves.
static PAGERS: Mutex<Vec<(Weak<Shared>, i32)>> = Mutex::new(Vec::new());
static REGISTER: Once = Once::new();

/// How long a prepare handler waits for a service's answer: a service that stopped
/// answers never, and the fork must go on.
const ANSWER_WAIT: Duration = Duration::from_secs(5);

/// How long a parent handler waits for a service to have handed the child to the
/// keeper (a service that stopped never does, and the program must go on).
const KEPT_WAIT: Duration = Duration::from_secs(5);

thread_local! {
    /// The pagers told of the fork in progress on this thread, and where each says the
    /// child was handed to the keeper.
    static TOLD: RefCell<Vec<(Arc<Shared>, Receiver<()>)>> = const { RefCell::new(Vec::new()) };
}

/// Has forks of this process announced to `shared`'s service.
pub(super) fn guard(shared: &Arc<Shared>) {
    REGISTER.call_once(|| {
        if let Err(error) = sys::processes::at_fork(prepare, parent, child) {
            let message = format!(
                "hyperoffload: cannot register the fork handlers ({error}): a fork may stop \
                 the fault service\n"
            );
            sys::files::write_stderr(message.as_bytes());
        }
    });
    let mut pagers = lock(&PAGERS);
    pagers.retain(|(pager, _)| pager.strong_count() > 0);
    pagers.push((Arc::downgrade(shared), sys::processes::getpid()));
}

extern "C" fn prepare() {
    let pid = sys::processes::getpid();
    let live: Vec<Arc<Shared>> = lock(&PAGERS)
        .iter()
        .filter(|(_, owner)| *owner == pid)
        .filter_map(|(pager, _)| pager.upgrade())
        .collect();
    // Every pager's regions made inheritable first: a service told of the fork reads
    // only its userfaultfd until the fork, and its program's faults would wait for
    // another pager's conversion.
    for shared in &live {
        if !shared.serving_forks.load(Ordering::Acquire) {
            shape_regions(shared);
        }
    }
    let mut told = Vec::with_capacity(live.len());
    for shared in live {
        if !shared.serving_forks.load(Ordering::Acquire) {
            // Not made inheritable: the regions are MADV_DONTFORK, and the child maps
            // the files from the page cache (the shim's plan).
            continue;
        }
        let generation = shared.forks_done.load(Ordering::Acquire);
        let (reply, answer) = sync_channel(1);
        let (kept, kept_answer) = sync_channel(1);
        shared.send(Command::ForkComing {
            generation,
            reply,
            kept,
        });
        let _ = answer.recv_timeout(ANSWER_WAIT);
        told.push((shared, kept_answer));
    }
    TOLD.with(|slot| *slot.borrow_mut() = told);
}

/// Has `shared`'s service make its regions file-shaped, and makes the moves it answers
/// with. libc takes no lock before the prepare handlers end: the service may allocate,
/// and the moves wait only for it to read their events.
pub(super) fn shape_regions(shared: &Shared) {
    let (reply, answer) = sync_channel(1);
    shared.send(Command::ShapeForFork { reply });
    // No time limit while the service runs: it writes every resident block into the
    // files first, and until the moves are made the program's faults on the regions
    // wait.
    let Some(moves) = answer_while_serving(shared, &answer) else {
        return;
    };
    if moves.is_empty() {
        return;
    }
    let failed = moves
        .into_iter()
        .filter(|step| {
            // SAFETY: moves the service's new mapping of a region's file over the part
            // of the region the program maps, replacing the old mapping (of frames the
            // service let go) in one step; the service answers faults on neither meanwhile.
            let moved = unsafe {
                sys::memory::mremap(
                    step.from,
                    step.len,
                    step.len,
                    libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
                    step.to,
                )
            };
            moved.is_err()
        })
        .collect();
    let (reply, answer) = sync_channel(1);
    shared.send(Command::ShapedForFork { failed, reply });
    // Once answered the regions are in place, and forks served from then on.
    let _ = answer_while_serving(shared, &answer);
}

/// The service's answer on `answer`, or None once it has stopped (a pager being dropped
/// while another thread forks): a command sent after it ended is never answered.
fn answer_while_serving<T>(shared: &Shared, answer: &Receiver<T>) -> Option<T> {
    loop {
        match answer.recv_timeout(Duration::from_millis(50)) {
            Ok(value) => return Some(value),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return None,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                if shared.stopped.load(Ordering::Acquire) {
                    return None;
                }
            }
        }
    }
}

extern "C" fn parent() {
    // libc has let go of its locks: allocating and waking are safe.
    let told = TOLD.with(|told| std::mem::take(&mut *told.borrow_mut()));
    for (shared, _) in &told {
        shared.forks_done.fetch_add(1, Ordering::AcqRel);
        shared.wakeup.signal();
    }
    // The fork returns once the service has handed its child to the keeper (see
    // `crate::keeper`): the program may end right after.
    for (_, kept) in told {
        let _ = kept.recv_timeout(KEPT_WAIT);
    }
}

extern "C" fn child() {
    // The child has no service; its copies of the handles are simply let go.
    TOLD.with(|told| told.borrow_mut().clear());
}
