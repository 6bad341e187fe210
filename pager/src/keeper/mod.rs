//! The keeper: a process outside the served program (the launcher, `hyperoffload run`)
//! that keeps forked children served from the program's file-shaped regions
//! (`PagerBuilder::serve_forks`) reading the files' bytes when the program ends without
//! its exit handlers: `_exit`, a fatal signal, or an `exec`.
//!
//! Why it is needed: a child's userfaultfd (from `UFFD_FEATURE_EVENT_FORK`) lives in
//! the program's service thread. When the program dies or execs, that descriptor
//! closes; with its last descriptor gone the kernel unregisters the child's ranges, and
//! a shared-memory fault on a hole of a region's file then maps a new page of zeros.
//! The service fills the holes first when it stops cleanly (`service::outliving`), but
//! nothing of the program runs after `_exit`, SIGKILL or an exec.
//!
//! How: the launcher gives the program one end of a `SOCK_SEQPACKET` socket pair
//! (inherited at a descriptor number named by `HYPEROFFLOAD_KEEPER`). Each service in
//! the launched process sends over it (`link`, `protocol`):
//! - when it starts, the pidfd of its own thread (`PIDFD_THREAD`): it polls readable
//!   once that thread has exited, whether the process exited, was killed or exec'd
//!   (exec kills every other thread first);
//! - each region's file and model file as the region is added, before the program can
//!   touch it (so before any child can have it), and a word when it is forgotten;
//! - each child's userfaultfd as soon as the fork event hands it over, and a word when
//!   the child has gone.
//!
//! While the service lives the keeper only holds these (`state`). Holding a child's
//! userfaultfd is what matters: it keeps the child's registration alive after the
//! program's copy closes, so a child's fault on a hole waits (the kernel queues it on
//! that userfaultfd) instead of reading zeros. When the service's thread has ended
//! (`serve`), the keeper takes every message still queued, asks which of that service's
//! children still live (`sys::userfaultfd::uffd_process_alive`), fills every hole of the regions
//! they were handed over with (`hole_fill`, the code the service's own exit fill uses),
//! and closes everything it held for that service. Closing a child's userfaultfd, now
//! its last descriptor, makes the kernel unregister the child's ranges and wake every
//! fault waiting there (and any fork of the child waiting for its event to be read:
//! the grandchild then has no registration either); each retries and finds its page in
//! the filled file. A clean exit has filled already: the keeper finds no hole and says
//! nothing.
//!
//! Races, and how each ends:
//! - A fault blocked before the fill: it waits on the child's userfaultfd (the keeper's
//!   descriptor keeps it registered) until the keeper closes it after the fill.
//! - A child forked just before the program ends: the fork returns in the program only
//!   after its event was read; the pager's `pthread_atfork` parent handler then waits
//!   until the service has sent that child's userfaultfd to the keeper
//!   (`Command::ForkComing`'s `kept`), so an `_exit`, `exec` or `kill` the program
//!   makes after `fork` returns finds the child kept. Left: a fatal signal from outside
//!   landing in the microseconds between the event's read and the send, and forks that
//!   run no handlers (`_Fork`, raw `clone`, a child's own fork making a grandchild) in
//!   that same window.
//! - Grandchildren: their fork events come on the child's userfaultfd, which the service
//!   reads and forwards like any other. One forked after the program ended waits in
//!   its fork until the keeper closes the child's userfaultfd; it then has no
//!   registration, and maps the filled files.
//! - A child exiting: the service closes its userfaultfd (and tells the keeper) at its
//!   next check; at the fill the keeper asks again, and fills only for live children.
//! - The launched process exec'ing: the old image's service thread ends and its session
//!   is finished as above; the new image's pager starts a session of its own.
//! - The keeper itself dying (the launcher killed with SIGKILL) takes the program with
//!   it (PR_SET_PDEATHSIG): its children are then not kept.

pub(crate) mod link;
pub mod protocol;
pub mod serve;
pub mod state;
