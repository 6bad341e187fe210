//! The guest's side of `crate::share`: a process about to map a file that a host of the
//! same run serves maps the host's region file (memfd) instead, registers that mapping
//! with a userfaultfd of its own, and forwards its faults to the host. One thread per
//! attachment polls the userfaultfd, the socket and a stop signal; what it does for each
//! event is `Guest::decide`'s.
//!
//! If the host goes away while the mapping lives, the thread fills every hole of the
//! memfd from the file (`hole_fill`) and wakes the whole mapping; later faults are
//! answered by reading the page into the memfd and waking it.

use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use thiserror::Error;
use userfaultfd::{Event, EventBuffer, FeatureFlags, Uffd, UffdBuilder};

use super::protocol::{FileKey, Message, ProtocolError, MAX_MESSAGE};
use super::{share_link_name, Guest, GuestAction, GuestEvent};
use crate::hole_fill::{fill_holes, fill_page, FillSource, FILL_CHUNK};
use crate::sys;

/// How long a guest waits for the host's answer to `Attach`.
const ATTACH_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, Error)]
pub enum AttachError {
    #[error("no host serves this file ({0})")]
    NoHost(std::io::Error),
    #[error("the host serves this file, but no region of it holds this range")]
    Refused,
    #[error("the host has not mapped the file yet")]
    NotYet,
    #[error("the host's answer: {0}")]
    Protocol(#[from] ProtocolError),
    #[error("the host's answer was not `Attached` or `Refused`")]
    Unexpected,
    #[error("{what} failed: {error}")]
    Sys {
        what: &'static str,
        error: std::io::Error,
    },
}

fn sys_error(what: &'static str) -> impl FnOnce(std::io::Error) -> AttachError {
    move |error| AttachError::Sys { what, error }
}

/// What an attachment did, for the process's report.
#[derive(Debug, Default)]
pub struct GuestCounters {
    pub forwarded: AtomicU64,
    pub filled_pages: AtomicU64,
    pub filled_bytes: AtomicU64,
    pub host_gone: AtomicBool,
}

/// A live attached mapping. Dropping it stops its thread and unmaps it.
pub struct Attachment {
    base: usize,
    map_len: usize,
    host_pid: i32,
    stop: OwnedFd,
    thread: Option<JoinHandle<()>>,
    counters: Arc<GuestCounters>,
    /// Whether dropping it unmaps the mapping (not when the program's munmap does).
    unmap_on_drop: bool,
}

impl Attachment {
    /// Stops serving the mapping and leaves it mapped, for the caller to unmap (the
    /// program's munmap, passed on to the kernel).
    pub fn stop_leaving_mapped(mut self) {
        self.unmap_on_drop = false;
    }

    pub fn base(&self) -> usize {
        self.base
    }

    pub fn map_len(&self) -> usize {
        self.map_len
    }

    /// The host's process id (0 if its socket's name did not say).
    pub fn host_pid(&self) -> i32 {
        self.host_pid
    }

    pub fn counters(&self) -> &Arc<GuestCounters> {
        &self.counters
    }
}

impl Drop for Attachment {
    fn drop(&mut self) {
        let _ = sys::files::write(self.stop.as_fd(), &1u64.to_ne_bytes());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        if self.unmap_on_drop {
            // SAFETY: the attachment owns the mapping; its owner unmaps it by dropping
            // it.
            let _ = unsafe { sys::memory::munmap(self.base, self.map_len) };
        }
    }
}

/// The file key of the file `stat` describes.
pub fn key_of_stat(stat: &sys::files::Stat) -> FileKey {
    FileKey {
        dev: stat.st_dev,
        ino: stat.st_ino,
        size: stat.st_size as u64,
        mtime_ns: (stat.st_mtime as i128 * 1_000_000_000 + stat.st_mtime_nsec as i128) as i64,
    }
}

/// The host's pid from the name its link leads to (`host-<pid>.sock`).
fn host_pid_of(link: &Path) -> i32 {
    std::fs::read_link(link)
        .ok()
        .and_then(|target| {
            let name = target.file_name()?.to_str()?.to_owned();
            name.strip_prefix("host-")?
                .strip_suffix(".sock")?
                .parse()
                .ok()
        })
        .unwrap_or(0)
}

/// Who serves a file in the share directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claim {
    /// This process: it made the link (before starting its pager), or had it already.
    Mine,
    /// Another live process of the run.
    Other(i32),
}

/// Claims the file `key` in `dir` for this process (`share-<dev>-<ino>.sock` made to
/// lead to this process's socket, atomically), unless another live process has it. A
/// link left by a process that is gone is replaced.
pub fn claim(dir: &Path, key: &FileKey) -> std::io::Result<Claim> {
    let link = dir.join(share_link_name(key.dev, key.ino));
    let me = sys::processes::getpid();
    let mine = super::host_socket_name(me);
    for _ in 0..4 {
        match sys::files::symlink(Path::new(&mine), &link) {
            Ok(()) => return Ok(Claim::Mine),
            Err(error) if error.raw_os_error() == Some(libc::EEXIST) => {
                let pid = host_pid_of(&link);
                if pid == me {
                    return Ok(Claim::Mine);
                }
                if pid > 0 && sys::processes::process_exists(pid) {
                    return Ok(Claim::Other(pid));
                }
                let _ = sys::files::unlink(&link);
            }
            Err(error) => return Err(error),
        }
    }
    Err(std::io::Error::from_raw_os_error(libc::EEXIST))
}

/// Gives up this process's claim on `key` (its pager cannot host it: it could not
/// start, or its regions cannot be shared), so that processes waiting for it page the
/// file themselves at once instead of after `STARTING_HOST_WAIT`.
pub fn release_claim(dir: &Path, key: &FileKey) {
    let link = dir.join(share_link_name(key.dev, key.ino));
    if host_pid_of(&link) == sys::processes::getpid() {
        let _ = sys::files::unlink(&link);
    }
}

/// How long a guest keeps asking a host that is starting (no socket yet, or no region
/// of the file yet).
const STARTING_HOST_WAIT: Duration = Duration::from_secs(10);

/// Attaches to the host (`host_pid`) serving `len` bytes of `key`'s file from `offset`:
/// maps its region's file (`map_len` bytes, the program's `prot`, which must not be
/// writable) and serves the mapping's faults through the host. Waits for a host that
/// is starting, while it lives.
pub fn attach(
    dir: &Path,
    host_pid: i32,
    key: &FileKey,
    offset: u64,
    len: u64,
    map_len: usize,
    prot: i32,
) -> Result<Attachment, AttachError> {
    let link = dir.join(share_link_name(key.dev, key.ino));
    let deadline = std::time::Instant::now() + STARTING_HOST_WAIT;
    let pause = || std::thread::sleep(Duration::from_millis(5));
    let starting = |error: &std::io::Error| {
        matches!(
            error.raw_os_error(),
            Some(libc::ENOENT | libc::ECONNREFUSED)
        )
    };
    loop {
        let socket = match sys::sockets::connect_seqpacket(&link) {
            Ok(socket) => socket,
            Err(error)
                if starting(&error)
                    && host_pid_of(&link) == host_pid
                    && sys::processes::process_exists(host_pid)
                    && std::time::Instant::now() < deadline =>
            {
                pause();
                continue;
            }
            Err(error) => return Err(AttachError::NoHost(error)),
        };
        match ask(socket, host_pid, key, offset, len, map_len, prot) {
            Err(AttachError::NotYet)
                if sys::processes::process_exists(host_pid)
                    && std::time::Instant::now() < deadline =>
            {
                pause();
            }
            Err(AttachError::NotYet) => return Err(AttachError::Refused),
            other => return other,
        }
    }
}

/// Asks for the region over `socket`, and maps it.
fn ask(
    socket: OwnedFd,
    host_pid: i32,
    key: &FileKey,
    offset: u64,
    len: u64,
    map_len: usize,
    prot: i32,
) -> Result<Attachment, AttachError> {
    let granted = request_region(&socket, key, offset, len)?;
    let (base, uffd) = map_registered(&granted.memfd, granted.start, map_len, prot)?;
    let unmap = unmap_on_error(base, map_len);
    let stop = sys::files::eventfd().map_err(|error| unmap(sys_error("eventfd")(error)))?;
    let stop_read =
        sys::files::dup_cloexec(stop.as_fd()).map_err(|error| unmap(sys_error("dup")(error)))?;
    let counters = Arc::new(GuestCounters::default());
    let served = Served {
        base,
        map_len,
        region: granted.region,
        data_len: granted.data_len,
        shape_len: granted.shape_len,
        start: granted.start,
        memfd: granted.memfd,
        file: granted.file,
        page: sys::memory::page_size(),
        file_offset: offset - granted.start,
        counters: Arc::clone(&counters),
    };
    let thread = std::thread::Builder::new()
        .name("hyperoffload-guest".into())
        .spawn(move || served.run(uffd, socket, stop_read))
        .map_err(|error| unmap(sys_error("starting the guest thread")(error)))?;
    Ok(Attachment {
        base,
        map_len,
        host_pid,
        stop,
        thread: Some(thread),
        counters,
        unmap_on_drop: true,
    })
}

/// What the host's `Attached` grants: its region (see `Message::Attached`), with the
/// region's memfd and the file it maps.
struct Granted {
    region: u32,
    data_len: u64,
    shape_len: u64,
    start: u64,
    memfd: OwnedFd,
    file: OwnedFd,
}

/// Sends `Attach` for `len` bytes of the file `key` from `offset` over `socket`, and
/// reads the host's answer: refused, not yet, or the region, whose range must start on
/// a page at or before `offset`.
fn request_region(
    socket: &OwnedFd,
    key: &FileKey,
    offset: u64,
    len: u64,
) -> Result<Granted, AttachError> {
    let attach = Message::Attach {
        file: *key,
        offset,
        len,
    };
    sys::sockets::send_with_fds(socket.as_fd(), &attach.encode(), &[])
        .map_err(sys_error("sending Attach"))?;
    let mut buffer = [0u8; MAX_MESSAGE];
    let (bytes, mut fds) =
        match sys::sockets::recv_with_fds_waiting(socket.as_fd(), &mut buffer, ATTACH_TIMEOUT)
            .map_err(sys_error("waiting for the host"))?
        {
            sys::sockets::Received::Message(bytes, fds) => (bytes, fds),
            sys::sockets::Received::Empty | sys::sockets::Received::Closed => {
                return Err(AttachError::NoHost(std::io::Error::from_raw_os_error(
                    libc::ECONNRESET,
                )))
            }
        };
    let (region, data_len, shape_len, start) = match Message::decode(&buffer[..bytes], fds.len())? {
        Message::Attached {
            region,
            data_len,
            shape_len,
            start,
        } => (region, data_len, shape_len, start),
        Message::Refused { not_yet: true } => return Err(AttachError::NotYet),
        Message::Refused { not_yet: false } => return Err(AttachError::Refused),
        _ => return Err(AttachError::Unexpected),
    };
    let file = fds.pop().expect("two descriptors");
    let memfd = fds.pop().expect("two descriptors");
    if start % sys::memory::page_size() != 0 || start > offset {
        return Err(AttachError::Unexpected);
    }
    Ok(Granted {
        region,
        data_len,
        shape_len,
        start,
        memfd,
        file,
    })
}

/// Maps `map_len` bytes of the host's region from `start` of its memfd, registers the
/// mapping with a userfaultfd of its own and gives it the program's protection `prot`;
/// returns where it is, with the userfaultfd. Unmapped again if a step fails.
fn map_registered(
    memfd: &OwnedFd,
    start: u64,
    map_len: usize,
    prot: i32,
) -> Result<(usize, Uffd), AttachError> {
    // SAFETY: a new mapping at an address the kernel picks replaces nothing.
    let base = unsafe {
        sys::memory::mmap(
            0,
            map_len,
            libc::PROT_NONE,
            libc::MAP_SHARED,
            Some(memfd.as_fd()),
            start as i64,
        )
    }
    .map_err(sys_error("mapping the host's region"))?;
    let unmap = unmap_on_error(base, map_len);
    let uffd = new_uffd().map_err(unmap)?;
    // Missing faults only: a host that shares its regions copies blocks in (a page is
    // in its memfd only with its bytes), so a page the memfd holds maps with no fault.
    uffd.register(base as *mut libc::c_void, map_len)
        .map_err(|error| {
            unmap(AttachError::Sys {
                what: "registering the mapping",
                error: std::io::Error::other(format!("{error:?}")),
            })
        })?;
    // SAFETY: the mapping is this function's; advice and protection change only it.
    unsafe {
        // A forked child must not inherit it: its copy would not be registered, and a
        // read of a hole would put a page of zeros into the file every process maps.
        let _ = sys::memory::madvise_raw(base, map_len, libc::MADV_DONTFORK);
        sys::memory::mprotect(base, map_len, prot)
            .map_err(|error| unmap(sys_error("mprotect")(error)))?;
    }
    Ok((base, uffd))
}

/// Passes an error on after unmapping the guest's mapping at `base`, made by
/// `map_registered` and referred to by nothing yet.
fn unmap_on_error(base: usize, map_len: usize) -> impl Fn(AttachError) -> AttachError + Copy {
    move |error| {
        // SAFETY: the mapping was made by `map_registered` and nothing refers to it yet.
        let _ = unsafe { sys::memory::munmap(base, map_len) };
        error
    }
}

fn new_uffd() -> Result<Uffd, AttachError> {
    UffdBuilder::new()
        .close_on_exec(true)
        .non_blocking(true)
        .user_mode_only(false)
        .require_features(FeatureFlags::from_bits_retain(
            crate::uffd_ext::FEATURE_POISON,
        ))
        .create()
        .map_err(|error| AttachError::Sys {
            what: "userfaultfd",
            error: std::io::Error::other(format!("{error:?}")),
        })
}

/// What the guest thread serves. Offsets in messages, fills and `Guest` are the
/// region's (its memfd's); the mapping shows the region from `start` on.
struct Served {
    base: usize,
    map_len: usize,
    region: u32,
    /// The region's data bytes, and its memfd's length.
    data_len: u64,
    shape_len: u64,
    /// Where the mapping starts in the region.
    start: u64,
    memfd: OwnedFd,
    file: OwnedFd,
    page: u64,
    /// Where the region starts in the file.
    file_offset: u64,
    counters: Arc<GuestCounters>,
}

impl Served {
    fn source(&self) -> FillSource<'_> {
        FillSource {
            file: self.file.as_fd(),
            file_offset: self.file_offset,
            data_len: self.data_len,
        }
    }

    /// The part of the region's `offset..offset + len` this mapping shows, as addresses.
    fn addresses(&self, offset: u64, len: u64) -> Option<(usize, usize)> {
        let start = offset.max(self.start);
        let end = (offset + len).min(self.start + self.map_len as u64);
        (start < end).then(|| {
            (
                self.base + (start - self.start) as usize,
                (end - start) as usize,
            )
        })
    }

    fn wake(&self, uffd: &Uffd, offset: u64, len: usize) {
        if let Some((addr, len)) = self.addresses(offset, len as u64) {
            let _ = uffd.wake(addr as *mut libc::c_void, len);
        }
    }

    fn poison(&self, uffd: &Uffd, offset: u64) {
        if let Some((addr, len)) = self.addresses(offset, self.page) {
            let _ = sys::userfaultfd::uffdio_poison(uffd.as_fd(), addr, len);
        }
    }

    /// Reads the page at `offset` into the memfd if it is a hole, and wakes it; SIGBUS
    /// there if it cannot be read.
    fn fill_and_wake(&self, uffd: &Uffd, offset: u64) {
        if offset >= self.data_len {
            return self.poison(uffd, offset);
        }
        match fill_page(self.memfd.as_fd(), self.source(), offset, self.page) {
            Ok(bytes) => {
                self.counters
                    .filled_bytes
                    .fetch_add(bytes, Ordering::Relaxed);
                self.wake(uffd, offset, self.page as usize);
            }
            Err(_) => self.poison(uffd, offset),
        }
    }

    fn act(&self, uffd: &Uffd, socket: &mut Option<OwnedFd>, guest: &mut Guest, event: GuestEvent) {
        match guest.decide(event) {
            GuestAction::Forward(offset) => {
                let message = Message::Fault {
                    region: self.region,
                    offset,
                };
                self.counters.forwarded.fetch_add(1, Ordering::Relaxed);
                let sent = socket.as_ref().is_some_and(|socket| {
                    sys::sockets::send_with_fds(socket.as_fd(), &message.encode(), &[]).is_ok()
                });
                if !sent {
                    *socket = None;
                    self.act(uffd, socket, guest, GuestEvent::HostGone);
                    self.act(uffd, socket, guest, GuestEvent::Fault(offset));
                }
            }
            // The page is in the memfd now, unless it was punched out again since, or
            // the host no longer serves its region (it filled the file first): then
            // read it here.
            GuestAction::Wake(offset) | GuestAction::FillPage(offset) => {
                self.fill_and_wake(uffd, offset)
            }
            GuestAction::Poison(offset) => self.poison(uffd, offset),
            GuestAction::FillAll => {
                *socket = None;
                self.counters.host_gone.store(true, Ordering::Relaxed);
                let mut buffer = vec![0u8; FILL_CHUNK as usize];
                let filled = fill_holes(
                    self.memfd.as_fd(),
                    self.shape_len,
                    self.source(),
                    &mut buffer,
                );
                self.counters
                    .filled_bytes
                    .fetch_add(filled.bytes, Ordering::Relaxed);
                self.wake(uffd, self.start, self.map_len);
            }
            GuestAction::Nothing => {}
        }
    }

    fn run(self, uffd: Uffd, socket: OwnedFd, stop: OwnedFd) {
        let mut socket = Some(socket);
        let mut guest = Guest::default();
        let mut events = EventBuffer::new(64);
        let mut buffer = [0u8; MAX_MESSAGE];
        loop {
            let (uffd_ready, socket_ready, stopped) = {
                let mut fds = vec![
                    sys::files::PollFd::new(&uffd, sys::files::PollFlags::IN),
                    sys::files::PollFd::new(&stop, sys::files::PollFlags::IN),
                ];
                if let Some(socket) = &socket {
                    fds.push(sys::files::PollFd::new(socket, sys::files::PollFlags::IN));
                }
                if sys::files::poll(&mut fds, Duration::from_secs(3600)).is_err() {
                    continue;
                }
                let ready = |fd: &sys::files::PollFd<'_>| !fd.revents().is_empty();
                (
                    ready(&fds[0]),
                    fds.get(2).is_some_and(ready),
                    ready(&fds[1]),
                )
            };
            if stopped {
                return;
            }
            if socket_ready {
                while let Some(open) = &socket {
                    let event = match sys::sockets::recv_with_fds(open.as_fd(), &mut buffer) {
                        Ok(sys::sockets::Received::Message(len, fds)) => {
                            match Message::decode(&buffer[..len], fds.len()) {
                                Ok(Message::Ready { offset, .. }) => GuestEvent::Ready(offset),
                                Ok(Message::Poison { offset, .. }) => GuestEvent::Poison(offset),
                                _ => GuestEvent::HostGone,
                            }
                        }
                        Ok(sys::sockets::Received::Empty) => break,
                        Ok(sys::sockets::Received::Closed) | Err(_) => GuestEvent::HostGone,
                    };
                    self.act(&uffd, &mut socket, &mut guest, event);
                }
            }
            if uffd_ready {
                let Ok(read) = uffd.read_events(&mut events) else {
                    continue;
                };
                let faults: Vec<u64> = read
                    .flatten()
                    .filter_map(|event| match event {
                        Event::Pagefault { addr, .. } => {
                            let at = (addr as usize - self.base) as u64 & !(self.page - 1);
                            Some(self.start + at)
                        }
                        _ => None,
                    })
                    .collect();
                for offset in faults {
                    self.act(&uffd, &mut socket, &mut guest, GuestEvent::Fault(offset));
                }
            }
        }
    }
}
