//! The service's side of the keeper: what it sends, on the service thread.
//!
//! A message that cannot be sent (the keeper gone) turns the link off with one message
//! on stderr; the service goes on as without a keeper.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use super::protocol::{Message, SessionId};
use crate::sys;

pub(crate) struct KeeperLink {
    socket: OwnedFd,
    session: SessionId,
    lost: bool,
}

impl KeeperLink {
    /// Starts a session on `socket` for the calling thread (the service's), whose end
    /// the keeper watches through the pidfd sent along.
    pub(crate) fn start(socket: OwnedFd) -> std::io::Result<Self> {
        let pidfd = sys::processes::own_thread_pidfd()?;
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |since| since.subsec_nanos());
        let session = (sys::processes::gettid() as u64) << 32 | u64::from(nanos);
        let message = Message::Session { session }.encode();
        sys::sockets::send_with_fds(socket.as_fd(), &message, &[pidfd.as_fd()])?;
        Ok(Self {
            socket,
            session,
            lost: false,
        })
    }

    pub(crate) fn session(&self) -> SessionId {
        self.session
    }

    /// Sends `message` with `fds`, unless the link was lost.
    pub(crate) fn send(&mut self, message: Message, fds: &[BorrowedFd<'_>]) {
        if self.lost {
            return;
        }
        if let Err(error) = sys::sockets::send_with_fds(self.socket.as_fd(), &message.encode(), fds)
        {
            self.lost = true;
            let text = format!(
                "hyperoffload: lost the keeper ({error}): forked children alive when this \
                 process ends by _exit, a signal or an exec may read zeros where a block \
                 was not resident\n"
            );
            sys::files::write_stderr(text.as_bytes());
        }
    }
}
