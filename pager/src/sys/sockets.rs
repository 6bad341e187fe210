//! Unix `SOCK_SEQPACKET` sockets, which keep each message's boundaries and carry
//! descriptors with it (SCM_RIGHTS): the keeper's channel (`crate::keeper`) and the
//! share host's (`crate::share`).

use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::path::Path;
use std::time::Duration;

use rustix::io::Errno;
use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};

use super::errno;
use super::files::{poll, PollFd, PollFlags};

/// The most descriptors `send_with_fds` sends with one message, and `recv_with_fds`
/// takes from one.
pub const MAX_SENT_FDS: usize = 4;

/// What `recv_with_fds` received.
#[derive(Debug)]
pub enum Received {
    /// A message of this many bytes, with the descriptors it carried (close-on-exec).
    Message(usize, Vec<OwnedFd>),
    /// Nothing queued now.
    Empty,
    /// Every peer is gone and nothing is left to read.
    Closed,
}

/// A connected pair of unix `SOCK_SEQPACKET` sockets (socketpair(2)), both close-on-exec:
/// messages keep their boundaries, and descriptors travel with them.
pub fn seqpacket_pair() -> io::Result<(OwnedFd, OwnedFd)> {
    Ok(rustix::net::socketpair(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )?)
}

/// Whether `fd` is a unix `SOCK_SEQPACKET` socket (what `seqpacket_pair` makes).
pub fn is_seqpacket(fd: BorrowedFd<'_>) -> bool {
    matches!(
        rustix::net::sockopt::socket_type(fd),
        Ok(SocketType::SEQPACKET)
    )
}

/// A unix `SOCK_SEQPACKET` socket listening at `path` (bind(2), listen(2)),
/// close-on-exec and nonblocking (`accept_seqpacket` answers None when nobody waits).
pub fn listen_seqpacket(path: &Path) -> io::Result<OwnedFd> {
    let socket = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
        None,
    )?;
    let address = SocketAddrUnix::new(path)?;
    rustix::net::bind(&socket, &address)?;
    rustix::net::listen(&socket, 64)?;
    Ok(socket)
}

/// Takes one connection waiting on `listener` (accept4(2)), close-on-exec and
/// nonblocking; None when none waits.
pub fn accept_seqpacket(listener: BorrowedFd<'_>) -> io::Result<Option<OwnedFd>> {
    loop {
        match rustix::net::accept_with(listener, SocketFlags::CLOEXEC | SocketFlags::NONBLOCK) {
            Ok(socket) => return Ok(Some(socket)),
            Err(Errno::INTR) => continue,
            Err(Errno::AGAIN) => return Ok(None),
            Err(error) => return Err(error.into()),
        }
    }
}

/// A unix `SOCK_SEQPACKET` socket connected to `path` (which may be a symlink to the
/// socket), close-on-exec, blocking.
pub fn connect_seqpacket(path: &Path) -> io::Result<OwnedFd> {
    let socket = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )?;
    let address = SocketAddrUnix::new(path)?;
    loop {
        match rustix::net::connect(&socket, &address) {
            Ok(()) => return Ok(socket),
            Err(Errno::INTR) => continue,
            Err(error) => return Err(error.into()),
        }
    }
}

/// The pid of the process at the other end of a connected unix socket (as it was when
/// it connected: SO_PEERCRED).
pub fn peer_pid(socket: BorrowedFd<'_>) -> io::Result<i32> {
    let credentials = rustix::net::sockopt::socket_peercred(socket)?;
    Ok(credentials.pid.as_raw_nonzero().get())
}

/// Sends `bytes` as one message on a `SOCK_SEQPACKET` socket, with `fds` (SCM_RIGHTS);
/// blocks while the socket's buffer is full. No SIGPIPE: a peer gone is EPIPE.
pub fn send_with_fds(
    socket: BorrowedFd<'_>,
    bytes: &[u8],
    fds: &[BorrowedFd<'_>],
) -> io::Result<()> {
    use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_SENT_FDS))];
    if fds.len() > MAX_SENT_FDS {
        return Err(errno(Errno::INVAL));
    }
    loop {
        let mut control = SendAncillaryBuffer::new(&mut space);
        if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
            return Err(errno(Errno::INVAL));
        }
        let iov = [io::IoSlice::new(bytes)];
        match rustix::net::sendmsg(socket, &iov, &mut control, SendFlags::NOSIGNAL) {
            Ok(_) => return Ok(()),
            Err(Errno::INTR) => continue,
            Err(error) => return Err(error.into()),
        }
    }
}

/// Takes one message from a `SOCK_SEQPACKET` socket without blocking: its bytes into
/// `buffer` (a longer message is cut), its descriptors returned.
pub fn recv_with_fds(socket: BorrowedFd<'_>, buffer: &mut [u8]) -> io::Result<Received> {
    use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_SENT_FDS))];
    loop {
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let mut iov = [io::IoSliceMut::new(buffer)];
        let flags = RecvFlags::DONTWAIT | RecvFlags::CMSG_CLOEXEC;
        let received = match rustix::net::recvmsg(socket, &mut iov, &mut control, flags) {
            Ok(received) => received,
            Err(Errno::INTR) => continue,
            Err(Errno::AGAIN) => return Ok(Received::Empty),
            Err(error) => return Err(error.into()),
        };
        let mut fds = Vec::new();
        for message in control.drain() {
            if let RecvAncillaryMessage::ScmRights(rights) = message {
                fds.extend(rights);
            }
        }
        if received.bytes == 0 && fds.is_empty() {
            return Ok(Received::Closed);
        }
        return Ok(Received::Message(received.bytes.min(buffer.len()), fds));
    }
}

/// Receives one message on a `SOCK_SEQPACKET` socket, waiting for it (`recv_with_fds`
/// otherwise), up to `timeout` (ETIMEDOUT past it).
pub fn recv_with_fds_waiting(
    socket: BorrowedFd<'_>,
    buffer: &mut [u8],
    timeout: Duration,
) -> io::Result<Received> {
    let mut fds = [PollFd::new(&socket, PollFlags::IN)];
    if poll(&mut fds, timeout)? == 0 {
        return Err(errno(Errno::TIMEDOUT));
    }
    recv_with_fds(socket, buffer)
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd;

    use super::*;
    use crate::sys::files;
    use crate::sys::processes::getpid;

    /// Whether two descriptors are of the same file.
    fn same_file(a: BorrowedFd<'_>, b: BorrowedFd<'_>) -> bool {
        let (a, b) = (files::fstat(a).unwrap(), files::fstat(b).unwrap());
        (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
    }

    #[test]
    fn a_descriptor_sent_with_a_message_arrives_as_the_same_file() {
        let (here, there) = seqpacket_pair().unwrap();
        assert!(is_seqpacket(here.as_fd()));
        let file = files::memfd(c"sent", 4096).unwrap();
        assert!(!is_seqpacket(file.as_fd()));
        send_with_fds(here.as_fd(), b"hello", &[file.as_fd()]).unwrap();
        let mut buffer = [0u8; 16];
        let Received::Message(5, fds) = recv_with_fds(there.as_fd(), &mut buffer).unwrap() else {
            panic!("one message of 5 bytes");
        };
        assert_eq!(&buffer[..5], b"hello");
        assert_eq!(fds.len(), 1);
        assert!(same_file(fds[0].as_fd(), file.as_fd()));
        // What is written through one descriptor is read through the other.
        assert_eq!(files::pwrite(fds[0].as_fd(), b"shared", 100).unwrap(), 6);
        assert_eq!(
            files::pread(file.as_fd(), &mut buffer[..6], 100).unwrap(),
            6
        );
        assert_eq!(&buffer[..6], b"shared");
    }

    #[test]
    fn messages_keep_their_boundaries_and_a_long_one_is_cut() {
        let (here, there) = seqpacket_pair().unwrap();
        send_with_fds(here.as_fd(), b"0123456789", &[]).unwrap();
        send_with_fds(here.as_fd(), b"ab", &[]).unwrap();
        let mut buffer = [0u8; 4];
        let first = recv_with_fds(there.as_fd(), &mut buffer).unwrap();
        assert!(matches!(first, Received::Message(4, ref fds) if fds.is_empty()));
        assert_eq!(&buffer, b"0123");
        let second = recv_with_fds(there.as_fd(), &mut buffer).unwrap();
        assert!(matches!(second, Received::Message(2, _)), "{second:?}");
        assert_eq!(&buffer[..2], b"ab");
        assert!(matches!(
            recv_with_fds(there.as_fd(), &mut buffer).unwrap(),
            Received::Empty
        ));
        drop(here);
        assert!(matches!(
            recv_with_fds(there.as_fd(), &mut buffer).unwrap(),
            Received::Closed
        ));
    }

    #[test]
    fn too_many_descriptors_are_refused_and_a_silent_peer_times_out() {
        let (here, there) = seqpacket_pair().unwrap();
        let file = files::memfd(c"many", 0).unwrap();
        let fds = [file.as_fd(); MAX_SENT_FDS + 1];
        let error = send_with_fds(here.as_fd(), b"x", &fds).unwrap_err();
        assert_eq!(error.raw_os_error(), Some(libc::EINVAL));
        send_with_fds(here.as_fd(), b"x", &fds[..MAX_SENT_FDS]).unwrap();
        let mut buffer = [0u8; 4];
        let received = recv_with_fds(there.as_fd(), &mut buffer).unwrap();
        assert!(matches!(received, Received::Message(1, ref fds) if fds.len() == MAX_SENT_FDS));
        let waited = recv_with_fds_waiting(there.as_fd(), &mut buffer, Duration::from_millis(5));
        assert_eq!(waited.unwrap_err().kind(), io::ErrorKind::TimedOut);
        drop(there);
        let error = send_with_fds(here.as_fd(), b"x", &[]).unwrap_err();
        assert_eq!(error.raw_os_error(), Some(libc::EPIPE), "no SIGPIPE, EPIPE");
    }

    #[test]
    fn a_listener_accepts_a_connection_through_a_symlink_and_knows_its_peer() {
        let dir = std::env::temp_dir().join(format!("hyperoffload-sockets-{}", getpid()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).unwrap();
        let listener = listen_seqpacket(&dir.join("socket")).unwrap();
        assert!(is_seqpacket(listener.as_fd()));
        assert!(
            accept_seqpacket(listener.as_fd()).unwrap().is_none(),
            "nobody waits"
        );
        files::symlink(Path::new("socket"), &dir.join("link")).unwrap();
        let client = connect_seqpacket(&dir.join("link")).unwrap();
        let server = accept_seqpacket(listener.as_fd())
            .unwrap()
            .expect("a connection");
        assert_eq!(peer_pid(server.as_fd()).unwrap(), getpid());
        send_with_fds(client.as_fd(), b"hi", &[]).unwrap();
        let mut buffer = [0u8; 2];
        let received = recv_with_fds_waiting(server.as_fd(), &mut buffer, Duration::from_secs(10));
        assert!(
            matches!(received, Ok(Received::Message(2, _))),
            "{received:?}"
        );
        let missing = connect_seqpacket(&dir.join("missing")).unwrap_err();
        assert_eq!(missing.kind(), io::ErrorKind::NotFound);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
