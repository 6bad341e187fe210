//! One resident copy of a model for the processes of one `hyperoffload run --inherit`
//! tree (issue 21): a *host* (a pager serving a file in a file-shaped region) lets a
//! *guest* (another process of the tree about to map the same file) map the region's
//! memfd and forwards the guest's faults into its own block states and budget. They
//! talk over a `SOCK_SEQPACKET` unix socket (`protocol`); userfaultfds never cross
//! processes.
//!
//! This module holds the pure parts, unit-tested without a kernel: the names in the
//! share directory, the host's choice of a region for an `Attach`, and the guest's
//! answer to each event.

pub mod guest;
pub mod protocol;

use protocol::FileKey;

/// The host's listening socket in the share directory.
pub fn host_socket_name(pid: i32) -> String {
    format!("host-{pid}.sock")
}

/// The symlink that leads a guest from a file to the host serving it.
pub fn share_link_name(dev: u64, ino: u64) -> String {
    format!("share-{dev:x}-{ino}.sock")
}

/// What the host knows of one of its regions, to answer an `Attach`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostRegion {
    pub id: u32,
    pub file: FileKey,
    /// Where the region's data starts in the file, and how many bytes it maps.
    pub file_offset: u64,
    pub data_len: u64,
    /// Whether it is file-shaped (a memfd a guest can map).
    pub shaped: bool,
    /// Whether the program unmapped (all of) it.
    pub removed: bool,
}

/// The region that serves an `Attach` of `len` bytes of `file` from `offset`, and where
/// that range starts in the region: a live file-shaped region of that same file
/// (device, inode, size and modification time) whose data holds the whole range. The
/// newest such (highest id) if several.
pub fn region_for_attach(
    regions: impl IntoIterator<Item = HostRegion>,
    file: &FileKey,
    offset: u64,
    len: u64,
) -> Option<(u32, u64)> {
    regions
        .into_iter()
        .filter(|region| {
            region.shaped
                && !region.removed
                && region.file == *file
                && region.file_offset <= offset
                && offset.saturating_add(len) <= region.file_offset + region.data_len
        })
        .map(|region| (region.id, offset - region.file_offset))
        .max()
}

/// What happened to a guest's attached mapping.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GuestEvent {
    /// A thread faulted on the page at this offset of the mapping.
    Fault(u64),
    /// The host says the page at this offset is in the memfd.
    Ready(u64),
    /// The host says the page at this offset cannot be read.
    Poison(u64),
    /// The host hung up (exited, or an error on the socket).
    HostGone,
}

/// What the guest does about it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GuestAction {
    /// Send the fault to the host.
    Forward(u64),
    /// Wake the threads waiting at this page (its bytes are in the memfd).
    Wake(u64),
    /// SIGBUS at this page (`UFFDIO_POISON`).
    Poison(u64),
    /// Fill every hole of the memfd from the file, then wake the whole mapping.
    FillAll,
    /// Fill this page from the file (if still a hole), then wake it.
    FillPage(u64),
    /// Nothing (a late answer after the host was gone).
    Nothing,
}

/// The guest's side of one attachment: whether the host still serves it, and what it
/// did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Guest {
    pub host_gone: bool,
    /// Faults sent to the host.
    pub forwarded: u64,
    /// Faults answered by filling from the file after the host went.
    pub filled_pages: u64,
}

impl Guest {
    pub fn decide(&mut self, event: GuestEvent) -> GuestAction {
        match (self.host_gone, event) {
            (false, GuestEvent::Fault(offset)) => {
                self.forwarded += 1;
                GuestAction::Forward(offset)
            }
            (true, GuestEvent::Fault(offset)) => {
                self.filled_pages += 1;
                GuestAction::FillPage(offset)
            }
            (false, GuestEvent::Ready(offset)) => GuestAction::Wake(offset),
            (false, GuestEvent::Poison(offset)) => GuestAction::Poison(offset),
            (true, GuestEvent::Ready(_) | GuestEvent::Poison(_)) => GuestAction::Nothing,
            (false, GuestEvent::HostGone) => {
                self.host_gone = true;
                GuestAction::FillAll
            }
            (true, GuestEvent::HostGone) => GuestAction::Nothing,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: FileKey = FileKey {
        dev: 0x803,
        ino: 42,
        size: 128 << 20,
        mtime_ns: 1_700_000_000_000_000_000,
    };

    fn region(id: u32) -> HostRegion {
        HostRegion {
            id,
            file: FILE,
            file_offset: 0,
            data_len: 128 << 20,
            shaped: true,
            removed: false,
        }
    }

    #[test]
    fn an_attach_finds_a_live_shaped_region_of_the_same_file_and_range() {
        assert_eq!(
            region_for_attach([region(1)], &FILE, 0, 128 << 20),
            Some((1, 0))
        );
        assert_eq!(
            region_for_attach([region(1), region(4), region(2)], &FILE, 0, 128 << 20),
            Some((4, 0)),
            "the newest"
        );
        assert_eq!(region_for_attach([], &FILE, 0, 128 << 20), None);
    }

    #[test]
    fn an_attach_of_part_of_a_region_starts_where_that_part_does() {
        let len = 128 << 20;
        assert_eq!(
            region_for_attach([region(1)], &FILE, 4096, len - 4096),
            Some((1, 4096))
        );
        assert_eq!(region_for_attach([region(1)], &FILE, 0, 4096), Some((1, 0)));
        let later = HostRegion {
            file_offset: 1 << 20,
            data_len: 8 << 20,
            ..region(2)
        };
        assert_eq!(
            region_for_attach([later], &FILE, 3 << 20, 2 << 20),
            Some((2, 2 << 20))
        );
        assert_eq!(
            region_for_attach([later], &FILE, 0, 2 << 20),
            None,
            "begins before the region"
        );
        assert_eq!(
            region_for_attach([later], &FILE, 8 << 20, 2 << 20),
            None,
            "ends past it"
        );
    }

    #[test]
    fn an_attach_is_refused_for_anything_else() {
        let len = 128 << 20;
        let gone = HostRegion {
            removed: true,
            ..region(1)
        };
        let copied = HostRegion {
            shaped: false,
            ..region(1)
        };
        assert_eq!(region_for_attach([gone], &FILE, 0, len), None);
        assert_eq!(region_for_attach([copied], &FILE, 0, len), None);
        assert_eq!(region_for_attach([region(1)], &FILE, 4096, len), None);
        for other in [
            FileKey { ino: 43, ..FILE },
            FileKey { dev: 1, ..FILE },
            FileKey { size: 1, ..FILE },
            FileKey {
                mtime_ns: 0,
                ..FILE
            },
        ] {
            assert_eq!(region_for_attach([region(1)], &other, 0, len), None);
        }
    }

    #[test]
    fn a_guest_forwards_until_the_host_goes_then_fills_for_itself() {
        let mut guest = Guest::default();
        assert_eq!(guest.decide(GuestEvent::Fault(0)), GuestAction::Forward(0));
        assert_eq!(guest.decide(GuestEvent::Ready(0)), GuestAction::Wake(0));
        assert_eq!(
            guest.decide(GuestEvent::Poison(8192)),
            GuestAction::Poison(8192)
        );
        assert_eq!(guest.decide(GuestEvent::HostGone), GuestAction::FillAll);
        assert_eq!(guest.decide(GuestEvent::HostGone), GuestAction::Nothing);
        assert_eq!(guest.decide(GuestEvent::Ready(4096)), GuestAction::Nothing);
        assert_eq!(
            guest.decide(GuestEvent::Fault(4096)),
            GuestAction::FillPage(4096)
        );
        assert_eq!(guest.forwarded, 1);
        assert_eq!(guest.filled_pages, 1);
    }

    #[test]
    fn names_in_the_share_directory() {
        assert_eq!(host_socket_name(4242), "host-4242.sock");
        assert_eq!(share_link_name(0x803, 42), "share-803-42.sock");
    }
}
