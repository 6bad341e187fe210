//! The host's side of `crate::share`: other processes of the run's tree (guests) map
//! this pager's file-shaped regions and forward their faults here.
//!
//! The service listens on `<share dir>/host-<pid>.sock` and, for each file it serves,
//! makes `<share dir>/share-<dev>-<ino>.sock` lead there. It polls the listening socket
//! and each guest's connection on its ring. An `Attach` is answered with the region's
//! memfd and model file (or `Refused`); a `Fault` is served as a forked child's is
//! (`Source::Guest`: the same block states and budget, the policies told), and answered
//! `Ready` or `Poison` once its block settles (`settle_children`) instead of a wake-up.
//! Guests count as children for the outliving fill (`outliving`).

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use super::children::Source;
use super::watch::Watch;
use super::{FaultService, ServiceError};
use crate::policy::RegionId;
use crate::share::protocol::{FileKey, Message, MAX_MESSAGE};
use crate::share::{host_socket_name, region_for_attach, share_link_name, HostRegion};
use crate::sys;

struct GuestConn {
    socket: OwnedFd,
    /// Its number (`Watch::Guest`).
    number: u32,
}

/// The listening socket, the links made, the guests connected.
pub(super) struct ShareHost {
    dir: PathBuf,
    socket_path: PathBuf,
    listener: OwnedFd,
    guests: Vec<GuestConn>,
    /// The number the next guest connected gets.
    next_number: u32,
    links: Vec<PathBuf>,
}

impl ShareHost {
    /// Listens in `dir` (the run's share directory).
    pub(super) fn start(dir: &Path) -> std::io::Result<Self> {
        let socket_path = dir.join(host_socket_name(sys::processes::getpid()));
        // A socket left by an earlier image of this process (an exec): gone with it.
        let _ = sys::files::unlink(&socket_path);
        let listener = sys::sockets::listen_seqpacket(&socket_path)?;
        Ok(Self {
            dir: dir.to_path_buf(),
            socket_path,
            listener,
            guests: Vec::new(),
            next_number: 0,
            links: Vec::new(),
        })
    }

    pub(super) fn has_guests(&self) -> bool {
        !self.guests.is_empty()
    }

    /// Guest `number`'s connection (None: it is gone).
    fn get(&self, number: u32) -> Option<&OwnedFd> {
        self.guests
            .iter()
            .find(|guest| guest.number == number)
            .map(|guest| &guest.socket)
    }

    /// Makes the file (`dev`, `ino`) findable, unless another live host serves it.
    fn publish(&mut self, dev: u64, ino: u64) {
        let link = self.dir.join(share_link_name(dev, ino));
        if self.links.contains(&link) {
            return;
        }
        let target = Path::new(self.socket_path.file_name().unwrap_or_default());
        if std::fs::read_link(&link).is_ok_and(|to| to == target) {
            // Claimed by this process's shim before it started the pager.
            self.links.push(link);
            return;
        }
        for _ in 0..2 {
            match sys::files::symlink(target, &link) {
                Ok(()) => {
                    self.links.push(link);
                    return;
                }
                Err(error) if error.raw_os_error() == Some(libc::EEXIST) => {
                    // Another host's, if it answers; else stale (its host is gone).
                    if sys::sockets::connect_seqpacket(&link).is_ok() {
                        return;
                    }
                    let _ = sys::files::unlink(&link);
                }
                Err(_) => return,
            }
        }
    }

    /// Sends `message` to guest `number`; false if it cannot (the guest is then lost).
    fn send(&self, number: u32, message: &Message, fds: &[std::os::fd::BorrowedFd<'_>]) -> bool {
        self.get(number).is_some_and(|socket| {
            sys::sockets::send_with_fds(socket.as_fd(), &message.encode(), fds).is_ok()
        })
    }
}

impl Drop for ShareHost {
    fn drop(&mut self) {
        for link in &self.links {
            let _ = sys::files::unlink(link);
        }
        let _ = sys::files::unlink(&self.socket_path);
    }
}

/// The key of the file `identity` describes, as guests name it.
fn key_of(identity: crate::file::FileIdentity) -> FileKey {
    FileKey {
        dev: identity.dev,
        ino: identity.ino,
        size: identity.len,
        mtime_ns: identity.mtime_ns as i64,
    }
}

impl FaultService {
    /// Starts listening, if the run shares (`ServiceConfig::share_dir`).
    pub(super) fn start_sharing(&mut self) -> Result<(), ServiceError> {
        let Some(dir) = self.config.share_dir.clone() else {
            return Ok(());
        };
        match ShareHost::start(&dir) {
            Ok(host) => {
                self.ring
                    .watch(host.listener.as_raw_fd(), Watch::ShareListen.token())?;
                self.share = Some(host);
            }
            Err(error) => sys::files::write_stderr(
                format!(
                    "hyperoffload: cannot share this process's models with the others of the \
                     run ({}: {error}); they read them on their own\n",
                    dir.display()
                )
                .as_bytes(),
            ),
        }
        Ok(())
    }

    /// A file-shaped region of `identity`'s file was added: guests may find it.
    pub(super) fn share_region(&mut self, identity: crate::file::FileIdentity) {
        if let Some(share) = &mut self.share {
            share.publish(identity.dev, identity.ino);
        }
    }

    /// Whether guests are attached (they count as children for the outliving fill).
    pub(super) fn has_guests(&self) -> bool {
        self.share.as_ref().is_some_and(ShareHost::has_guests)
    }

    /// How many guests are connected.
    pub(super) fn guest_count(&self) -> usize {
        self.share.as_ref().map_or(0, |share| share.guests.len())
    }

    /// The listening socket is readable: takes every guest waiting.
    pub(super) fn share_listen_readable(&mut self, rearm: bool) -> Result<(), ServiceError> {
        let Some(share) = &mut self.share else {
            return Ok(());
        };
        while let Ok(Some(socket)) = sys::sockets::accept_seqpacket(share.listener.as_fd()) {
            if let Ok(pid) = sys::sockets::peer_pid(socket.as_fd()) {
                // For the launcher's summary: which processes this pager served.
                // The program's file name (comm is cut to 15 bytes).
                let program = std::fs::read_link(format!("/proc/{pid}/exe"))
                    .ok()
                    .and_then(|exe| Some(exe.file_name()?.to_string_lossy().into_owned()))
                    .unwrap_or_default();
                let process = format!("{pid} ({program})");
                if !self.stats.guest_processes.contains(&process) {
                    self.stats.guest_processes.push(process);
                }
            }
            let number = share.next_number;
            share.next_number += 1;
            self.ring
                .watch(socket.as_raw_fd(), Watch::Guest(number).token())?;
            share.guests.push(GuestConn { socket, number });
        }
        if rearm {
            self.ring
                .watch(share.listener.as_raw_fd(), Watch::ShareListen.token())?;
        }
        Ok(())
    }

    /// Guest `token`'s connection is readable: answers its messages, serves its faults.
    /// (`token` is the guest's number, `Watch::Guest`.)
    pub(super) fn guest_readable(&mut self, token: u32, rearm: bool) -> Result<(), ServiceError> {
        let mut buffer = [0u8; MAX_MESSAGE];
        let mut faults = Vec::new();
        loop {
            let Some(socket) = self.share.as_ref().and_then(|share| share.get(token)) else {
                return Ok(());
            };
            let message = match sys::sockets::recv_with_fds(socket.as_fd(), &mut buffer) {
                Ok(sys::sockets::Received::Message(len, fds)) => {
                    Message::decode(&buffer[..len], fds.len())
                }
                Ok(sys::sockets::Received::Empty) => break,
                Ok(sys::sockets::Received::Closed) | Err(_) => return self.forget_guest(token),
            };
            match message {
                Ok(Message::Attach { file, offset, len }) => {
                    if !self.answer_attach(token, &file, offset, len) {
                        return self.forget_guest(token);
                    }
                }
                Ok(Message::Fault { region, offset }) => faults.push((region, offset)),
                // A message only a host sends, or none: the guest is not followed.
                _ => return self.forget_guest(token),
            }
        }
        // The guest's ring token stands for its faulting thread (`recent_faults`, the
        // trace): it is above any thread id (`watch`).
        let thread = Watch::Guest(token).token();
        let mut addrs = Vec::with_capacity(faults.len());
        for (region, offset) in faults {
            match self.regions.get(&RegionId(region)) {
                Some(served) if !served.removed && offset < served.layout.map_len => {
                    self.stats.guest_faults += 1;
                    addrs.push((served.base + offset as usize, thread));
                }
                // The region is gone (filled for the guests first) or the offset is
                // outside it: the guest checks the page and reads it itself if needed.
                _ => self.answer_guest(token, region, offset, true),
            }
        }
        self.serve_faults(&addrs, Source::Guest(token))?;
        if rearm {
            if let Some(socket) = self.share.as_ref().and_then(|share| share.get(token)) {
                self.ring
                    .watch(socket.as_raw_fd(), Watch::Guest(token).token())?;
            }
        }
        Ok(())
    }

    /// Answers guest `guest`'s `Attach`; false if the answer could not be sent.
    fn answer_attach(&mut self, guest: u32, file: &FileKey, offset: u64, len: u64) -> bool {
        let candidates = self.regions.iter().map(|(id, region)| HostRegion {
            id: id.0,
            file: key_of(region.file.identity()),
            file_offset: region.layout.geometry.file_offset,
            data_len: region.layout.geometry.data_len,
            shaped: region.shape.is_some(),
            removed: region.removed,
        });
        let Some(share) = &self.share else {
            return false;
        };
        let found = region_for_attach(candidates, file, offset, len);
        let region =
            found.and_then(|(id, start)| self.regions.get(&RegionId(id)).map(|r| (id, start, r)));
        match region {
            Some((id, start, region)) => {
                let Some(shape) = &region.shape else {
                    return share.send(guest, &Message::Refused { not_yet: false }, &[]);
                };
                let message = Message::Attached {
                    region: id,
                    data_len: region.layout.geometry.data_len,
                    shape_len: region.shape_len,
                    start,
                };
                let sent = share.send(guest, &message, &[shape.as_fd(), region.file.buffered()]);
                if sent {
                    self.stats.guests += 1;
                }
                sent
            }
            None => {
                // No region of the file at all: this process claimed it (the link) and
                // has not mapped it yet.
                let not_yet = !self
                    .regions
                    .values()
                    .any(|region| key_of(region.file.identity()) == *file);
                share.send(guest, &Message::Refused { not_yet }, &[])
            }
        }
    }

    /// Tells guest `guest` the page at `offset` of `region` is in the memfd (`ready`) or
    /// cannot be read. A guest that cannot be told is forgotten at its next readiness.
    pub(super) fn answer_guest(&self, guest: u32, region: u32, offset: u64, ready: bool) {
        let message = if ready {
            Message::Ready { region, offset }
        } else {
            Message::Poison { region, offset }
        };
        if let Some(share) = &self.share {
            share.send(guest, &message, &[]);
        }
    }

    /// Answers guest `guest`'s fault at the program's address `page_addr`.
    pub(super) fn answer_guest_at(&self, guest: u32, page_addr: usize, ready: bool) {
        let Some((id, offset)) = self.locator.lookup(page_addr) else {
            return self.answer_guest(guest, u32::MAX, 0, true);
        };
        self.answer_guest(guest, id.0, offset, ready);
    }

    /// A guest hung up (or broke the protocol): forgets it and its waits.
    fn forget_guest(&mut self, number: u32) -> Result<(), ServiceError> {
        if let Some(share) = &mut self.share {
            share.guests.retain(|guest| guest.number != number);
        }
        self.ring.unwatch(Watch::Guest(number).token())?;
        self.children.forget_waits(Source::Guest(number));
        Ok(())
    }
}
