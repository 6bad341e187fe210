//! The keeper's loop, on a thread of the launcher: receives what services send, holds
//! it (`state::Keeper`), and when a service's thread has ended fills the regions its
//! live children map (`finish_session`), wakes those children, and from then on serves
//! their userfaultfds itself until they exit (`Orphan`).
//!
//! Why serve rather than close: closing the keeper's descriptor of a child's
//! userfaultfd unregisters the child's ranges (and wakes its faults) only if it is the
//! last reference, and it may not be: a sibling forked later inherited a copy from the
//! program's descriptor table, and an io_uring poll of the service's may still hold one
//! (seen here: a child blocked in `handle_userfault` after its parent was killed, with
//! no descriptor of its userfaultfd left in any process). While the registration lives,
//! a fault that found a hole just before the fill, and queued itself just after the
//! keeper's wake-up, would wait for good. Served, its event is read and the page woken.

use std::os::fd::{AsFd, FromRawFd, IntoRawFd, OwnedFd};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use userfaultfd::{Event, EventBuffer, Uffd};

use super::protocol::{Message, SessionId};
use super::state::{Ending, HeldRegion, Keeper};
use crate::hole_fill::{fill_holes, rewrite_chunk, FillSource, FILL_CHUNK};
use crate::sys;
use crate::sys::files::{PollFd, PollFlags};
use crate::sys::sockets::Received;

/// The largest message (a child handed over with some thousand regions).
const MAX_MESSAGE: usize = 64 << 10;

/// How often served children are asked whether they still live.
const PROBE_EVERY: Duration = Duration::from_millis(500);

/// What the keeper did for children whose service ended without filling for them.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct KeeperReport {
    /// Sessions (pagers' services) seen.
    pub sessions: u64,
    /// Children of ended sessions still alive then, served by the keeper since.
    pub outliving_children: u64,
    /// Bytes the keeper wrote into regions' files for them.
    pub filled_bytes: u64,
    /// Messages it could not act on.
    pub refused: u64,
}

/// The keeper thread, and how to tell it the program has ended.
pub struct KeeperThread {
    thread: JoinHandle<()>,
    ended: OwnedFd,
    report: Receiver<KeeperReport>,
}

/// The keeper after the program ended: serving the children that outlive it.
pub struct KeptChildren {
    thread: JoinHandle<()>,
}

/// Starts keeping what arrives on `socket` (the launcher's end; the program has the
/// other).
pub fn start(socket: OwnedFd) -> std::io::Result<KeeperThread> {
    // Each forked child is a descriptor held here until it is gone.
    sys::processes::raise_fd_limit();
    let ended = sys::files::eventfd()?;
    let ended_here = sys::files::dup_cloexec(ended.as_fd())?;
    let (report_tx, report) = sync_channel(1);
    let thread = std::thread::Builder::new()
        .name("hyperoffload-keeper".into())
        .spawn(move || keep(socket, ended_here, report_tx))?;
    Ok(KeeperThread {
        thread,
        ended,
        report,
    })
}

impl KeeperThread {
    /// The program has ended (all its threads with it): every session still held is
    /// finished (filled where children live). Returns what the keeper did, and the
    /// children it goes on serving.
    pub fn finish(self) -> (KeeperReport, KeptChildren) {
        let _ = sys::files::write(self.ended.as_fd(), &1u64.to_ne_bytes());
        let report = self.report.recv().unwrap_or_default();
        (
            report,
            KeptChildren {
                thread: self.thread,
            },
        )
    }
}

impl KeptChildren {
    /// Waits until every child the keeper serves has exited (or exec'd).
    pub fn wait(self) {
        let _ = self.thread.join();
    }
}

/// A served child whose service has ended: the keeper answers its faults.
struct Orphan {
    uffd: Uffd,
    regions: Arc<Vec<HeldRegion<OwnedFd>>>,
}

fn keep(socket: OwnedFd, ended: OwnedFd, report_tx: SyncSender<KeeperReport>) {
    let mut keeper = Keeper::<OwnedFd>::default();
    let mut report = KeeperReport::default();
    let mut orphans: Vec<Orphan> = Vec::new();
    let mut buffer = vec![0u8; MAX_MESSAGE];
    let mut events = EventBuffer::new(64);
    let mut socket_open = true;
    let mut program_ended = false;
    let mut last_probe = Instant::now();
    loop {
        let ready = wait_ready(
            &ended,
            &socket,
            &keeper,
            &orphans,
            socket_open,
            program_ended,
        );
        program_ended |= ready.program_ended;
        let (finished, readable) = (ready.finished_sessions, ready.readable_orphans);
        // Everything a service sent before its thread ended is queued by now: take it
        // all before deciding what that service's children need.
        if socket_open {
            socket_open = drain(&socket, &mut buffer, &mut keeper, &mut report);
        }
        let mut endings: Vec<Ending<OwnedFd>> = finished
            .into_iter()
            .filter_map(|session| keeper.end(session))
            .collect();
        if program_ended {
            endings.extend(keeper.end_all());
        }
        for ending in endings {
            orphans.extend(finish_session(ending, &mut report));
        }
        for index in readable {
            serve_orphan(&mut orphans, index, &mut events);
        }
        if last_probe.elapsed() >= PROBE_EVERY {
            last_probe = Instant::now();
            orphans.retain(|orphan| alive(&orphan.uffd, &orphan.regions));
        }
        if program_ended {
            // Said once: the launcher reports, then waits for the children served.
            let _ = report_tx.try_send(report.clone());
            if orphans.is_empty() {
                return;
            }
        }
    }
}

/// What one wait of the keeper found ready.
struct Ready {
    /// Sessions whose service's process ended (their pidfd is readable).
    finished_sessions: Vec<SessionId>,
    /// Orphans (by index) whose userfaultfd has events.
    readable_orphans: Vec<usize>,
    /// The program ended (or the keeper cannot wait any more).
    program_ended: bool,
}

/// Waits up to `PROBE_EVERY` for the program's end (`ended`), a message on `socket`
/// (while `socket_open` and the program runs), a session's end, or an orphan's fault.
fn wait_ready(
    ended: &OwnedFd,
    socket: &OwnedFd,
    keeper: &Keeper<OwnedFd>,
    orphans: &[Orphan],
    socket_open: bool,
    program_ended: bool,
) -> Ready {
    let sessions: Vec<_> = keeper.pidfds().map(|(id, fd)| (id, fd.as_fd())).collect();
    let mut fds = Vec::with_capacity(sessions.len() + orphans.len() + 2);
    fds.push(PollFd::new(ended, PollFlags::IN));
    fds.push(PollFd::new(socket, PollFlags::IN));
    for (_, pidfd) in &sessions {
        fds.push(PollFd::from_borrowed_fd(*pidfd, PollFlags::IN));
    }
    for orphan in orphans {
        fds.push(PollFd::from_borrowed_fd(orphan.uffd.as_fd(), PollFlags::IN));
    }
    if program_ended || !socket_open {
        // Not watched any more (`PollFd` has no empty set: poll the eventfd twice
        // instead).
        fds[1] = PollFd::new(ended, PollFlags::empty());
    }
    if program_ended {
        fds[0] = PollFd::new(ended, PollFlags::empty());
    }
    let mut ready = Ready {
        finished_sessions: Vec::new(),
        readable_orphans: Vec::new(),
        program_ended: false,
    };
    if let Err(error) = sys::files::poll(&mut fds, PROBE_EVERY) {
        let text = format!("hyperoffload: the keeper cannot wait ({error})\n");
        sys::files::write_stderr(text.as_bytes());
        ready.program_ended = true;
    }
    if !program_ended && !fds[0].revents().is_empty() {
        ready.program_ended = true;
    }
    for (index, (session, _)) in sessions.iter().enumerate() {
        if !fds[2 + index].revents().is_empty() {
            ready.finished_sessions.push(*session);
        }
    }
    let first_orphan = 2 + sessions.len();
    for index in 0..orphans.len() {
        if !fds[first_orphan + index].revents().is_empty() {
            ready.readable_orphans.push(index);
        }
    }
    ready
}

/// Takes every queued message; false once every sender is gone.
fn drain(
    socket: &OwnedFd,
    buffer: &mut [u8],
    keeper: &mut Keeper<OwnedFd>,
    report: &mut KeeperReport,
) -> bool {
    loop {
        match sys::sockets::recv_with_fds(socket.as_fd(), buffer) {
            Ok(Received::Message(len, fds)) => {
                let outcome = Message::decode(&buffer[..len], fds.len())
                    .map_err(|error| error.to_string())
                    .and_then(|message| {
                        let session = matches!(message, Message::Session { .. });
                        keeper
                            .receive(message, fds)
                            .map(|()| session)
                            .map_err(|error| error.to_string())
                    });
                match outcome {
                    Ok(session) => report.sessions += u64::from(session),
                    Err(why) => {
                        report.refused += 1;
                        if report.refused == 1 {
                            let text =
                                format!("hyperoffload: the keeper ignored a message: {why}\n");
                            sys::files::write_stderr(text.as_bytes());
                        }
                    }
                }
            }
            Ok(Received::Empty) => return true,
            Ok(Received::Closed) => return false,
            Err(error) => {
                let text = format!("hyperoffload: the keeper cannot receive ({error})\n");
                sys::files::write_stderr(text.as_bytes());
                return false;
            }
        }
    }
}

/// Whether the child `uffd` serves still has an address space.
fn alive(uffd: &Uffd, regions: &[HeldRegion<OwnedFd>]) -> bool {
    let at = regions
        .first()
        .map_or(super::state::PROBE_ELSEWHERE, |region| region.base);
    sys::userfaultfd::uffd_process_alive(uffd.as_fd(), at as usize)
}

/// A service has ended: fills the regions its live children map and wakes every fault
/// of theirs waiting meanwhile; returns those children, to serve from now on. What
/// was held for children gone, and for regions no live child has, is let go.
fn finish_session(ending: Ending<OwnedFd>, report: &mut KeeperReport) -> Vec<Orphan> {
    let live: Vec<bool> = ending
        .children
        .iter()
        .map(|child| {
            sys::userfaultfd::uffd_process_alive(
                child.uffd.as_fd(),
                ending.probe_address(child) as usize,
            )
        })
        .collect();
    let to_fill = ending.to_fill(&live);
    // Served even if they map no region held: they may map one the program unmapped
    // (filled then), where their faults still come here (minor ones, for a region read
    // in place).
    if !live.contains(&true) {
        return Vec::new();
    }
    let outliving = live.iter().filter(|&&alive| alive).count() as u64;
    report.outliving_children += outliving;
    fill_for_children(&ending, &to_fill, outliving, report);
    let Ending {
        regions, children, ..
    } = ending;
    let regions: Arc<Vec<HeldRegion<OwnedFd>>> = Arc::new(
        regions
            .into_iter()
            .filter(|(id, _)| to_fill.contains(id))
            .map(|(_, region)| region)
            .collect(),
    );
    let mut orphans = Vec::new();
    for (child, live) in children.into_iter().zip(live) {
        if !live {
            continue;
        }
        // SAFETY: the descriptor is a userfaultfd (a fork event's), owned here and
        // handed whole to the `Uffd`, which closes it.
        let uffd = unsafe { Uffd::from_raw_fd(child.uffd.into_raw_fd()) };
        // Every fault that waited through the end of the service and the fill finds its
        // page now.
        for region in regions.iter() {
            let _ = uffd.wake(region.base as *mut libc::c_void, region.shape_len as usize);
        }
        orphans.push(Orphan {
            uffd,
            regions: regions.clone(),
        });
    }
    orphans
}

/// Fills regions `to_fill` of `ending` from their files for the `outliving` children
/// that still map them, and says so (and what failed) on stderr.
fn fill_for_children(
    ending: &Ending<OwnedFd>,
    to_fill: &[u32],
    outliving: u64,
    report: &mut KeeperReport,
) {
    let mut buffer = vec![0u8; FILL_CHUNK as usize];
    let mut bytes = 0;
    let mut failures = Vec::new();
    for id in to_fill {
        let region = &ending.regions[id];
        let filled = fill_holes(
            region.shape.as_fd(),
            region.shape_len,
            source(region),
            &mut buffer,
        );
        bytes += filled.bytes;
        if let Some(error) = filled.error {
            failures.push(format!("{}: {error}", region.path));
        }
    }
    report.filled_bytes += bytes;
    if bytes > 0 || !failures.is_empty() {
        let mut text = format!(
            "hyperoffload: a served process ended (exit without its exit handlers, a \
             signal or an exec) while {outliving} forked child process(es) it served lived: \
             the keeper filled {:.1} MiB of the models they map from the files, beyond the \
             budget, and serves those children until they exit\n",
            bytes as f64 / (1 << 20) as f64
        );
        if !failures.is_empty() {
            text.push_str(&format!(
                "hyperoffload: the keeper's fill failed ({}): those children get SIGBUS \
                 where a block was not resident\n",
                failures.join("; ")
            ));
        }
        sys::files::write_stderr(text.as_bytes());
    }
}

fn source(region: &HeldRegion<OwnedFd>) -> FillSource<'_> {
    FillSource {
        file: region.file.as_fd(),
        file_offset: region.file_offset,
        data_len: region.data_len,
    }
}

/// Answers the events of `orphans[index]`: a fault's page is filled if it still is a
/// hole (a region the fill skipped) and woken, or poisoned (SIGBUS) where it cannot be;
/// a fork's child is served too.
fn serve_orphan(orphans: &mut Vec<Orphan>, index: usize, events: &mut EventBuffer) {
    let page = sys::memory::page_size();
    let mut forked = Vec::new();
    {
        let orphan = &orphans[index];
        let Ok(read) = orphan.uffd.read_events(events) else {
            return;
        };
        for event in read.flatten() {
            match event {
                Event::Pagefault { addr, .. } => {
                    let page_addr = addr as u64 & !(page - 1);
                    let served = orphan.regions.iter().find_map(|region| {
                        let offset = page_addr.checked_sub(region.base)?;
                        (offset < region.shape_len).then(|| {
                            // Rewritten whatever the file holds there: a read in place
                            // the service did not finish may have left its pages.
                            let chunk =
                                rewrite_chunk(region.shape.as_fd(), source(region), offset)?;
                            Ok::<_, std::io::Error>(
                                region.base + chunk.start..region.base + chunk.end,
                            )
                        })
                    });
                    let uffd = orphan.uffd.as_fd();
                    let page = page as usize;
                    match served {
                        // Mapped from the file where the child's range is registered for
                        // minor faults (reads in place: every page the file holds comes
                        // here once), else woken to map it itself.
                        Some(Ok(chunk)) => {
                            let (start, end) = (chunk.start as usize, chunk.end as usize);
                            let end = end.next_multiple_of(page);
                            crate::uffd_ext::continue_or_wake(uffd, start, end - start, page);
                        }
                        // Outside the regions held (one the program unmapped, filled
                        // before it forgot it): mapped if the file holds the page.
                        None if crate::uffd_ext::continue_page(uffd, page_addr as usize, page) => {}
                        // A page nobody can give: SIGBUS, as a file mapping gives for an
                        // unreadable page, rather than a fault answered forever.
                        _ => {
                            let _ = sys::userfaultfd::uffdio_poison(uffd, page_addr as usize, page);
                        }
                    }
                }
                Event::Fork { uffd } => forked.push(Orphan {
                    uffd,
                    regions: orphan.regions.clone(),
                }),
                _ => {}
            }
        }
    }
    orphans.extend(forked);
}
