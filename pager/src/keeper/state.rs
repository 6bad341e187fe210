//! What the keeper holds and what it does at each event, apart from the system calls
//! (`keeper::serve` makes them): generic over the held descriptor type, so it is
//! unit-tested with plain numbers and no kernel.
//!
//! While a service lives the keeper only holds: its thread's pidfd, each region's file
//! and model file, each child's userfaultfd. A `RegionGone` or `ChildGone` lets go of
//! what it names. When the service's thread has ended (`end`), the session is taken out
//! whole: the keeper asks which of its children still live, fills the regions those
//! cover (`Ending::to_fill`), and then drops everything, which closes the children's
//! userfaultfds.

use std::collections::BTreeMap;

use thiserror::Error;

use super::protocol::{Message, SessionId};

/// A region's files, held for as long as its service keeps it.
#[derive(Debug)]
pub struct HeldRegion<F> {
    /// The region's file (`shaped_region`), read-write.
    pub shape: F,
    /// The model file, readable.
    pub file: F,
    pub base: u64,
    pub file_offset: u64,
    pub data_len: u64,
    pub shape_len: u64,
    pub path: String,
}

/// A forked child's userfaultfd, and the regions live when it was handed over.
#[derive(Debug)]
pub struct HeldChild<F> {
    pub uffd: F,
    pub regions: Vec<u32>,
}

#[derive(Debug)]
struct Session<F> {
    pidfd: F,
    regions: BTreeMap<u32, HeldRegion<F>>,
    children: BTreeMap<u32, HeldChild<F>>,
}

/// A message the keeper cannot act on (its descriptors are dropped).
#[derive(Debug, Error, PartialEq, Eq)]
pub enum StateError {
    #[error("a message for session {0:#x}, which the keeper does not know")]
    UnknownSession(SessionId),
    #[error("session {0:#x} started twice")]
    SessionAgain(SessionId),
    #[error("a message with {got} descriptors where it needs {expected}")]
    Descriptors { expected: usize, got: usize },
}

/// Everything the keeper holds, by session.
#[derive(Debug)]
pub struct Keeper<F> {
    sessions: BTreeMap<SessionId, Session<F>>,
}

impl<F> Default for Keeper<F> {
    fn default() -> Self {
        Self {
            sessions: BTreeMap::new(),
        }
    }
}

/// A session taken out because its service ended: what to fill, then drop.
#[derive(Debug)]
pub struct Ending<F> {
    pub session: SessionId,
    pub pidfd: F,
    pub regions: BTreeMap<u32, HeldRegion<F>>,
    pub children: Vec<HeldChild<F>>,
}

/// Where to ask whether a child's address space lives when none of its regions is
/// held: above any `vm.mmap_min_addr`, below any task size (see
/// `sys::userfaultfd::uffd_process_alive`).
pub const PROBE_ELSEWHERE: u64 = 1 << 30;

impl<F> Ending<F> {
    /// The address to ask about `child` at: a region it has (registered for missing
    /// faults only, where the probe changes nothing), else one it has not.
    pub fn probe_address(&self, child: &HeldChild<F>) -> u64 {
        child
            .regions
            .iter()
            .find_map(|id| self.regions.get(id))
            .map_or(PROBE_ELSEWHERE, |region| region.base)
    }

    /// The regions to fill, given which children still live (`alive[i]` for
    /// `children[i]`): every held region some live child was handed over with.
    pub fn to_fill(&self, alive: &[bool]) -> Vec<u32> {
        let mut ids: Vec<u32> = self
            .children
            .iter()
            .zip(alive)
            .filter(|(_, &alive)| alive)
            .flat_map(|(child, _)| child.regions.iter().copied())
            .filter(|id| self.regions.contains_key(id))
            .collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    }
}

impl<F> Keeper<F> {
    /// Acts on `message`, which came with `fds`: holds them, or lets go of what it
    /// names. On an error the descriptors are dropped.
    pub fn receive(&mut self, message: Message, fds: Vec<F>) -> Result<(), StateError> {
        if fds.len() != message.descriptors() {
            return Err(StateError::Descriptors {
                expected: message.descriptors(),
                got: fds.len(),
            });
        }
        let mut fds = fds.into_iter();
        let session_id = message.session();
        if let Message::Session { session } = message {
            if self.sessions.contains_key(&session) {
                return Err(StateError::SessionAgain(session));
            }
            let pidfd = fds.next().expect("one descriptor");
            self.sessions.insert(
                session,
                Session {
                    pidfd,
                    regions: BTreeMap::new(),
                    children: BTreeMap::new(),
                },
            );
            return Ok(());
        }
        let session = self
            .sessions
            .get_mut(&session_id)
            .ok_or(StateError::UnknownSession(session_id))?;
        match message {
            Message::Session { .. } => unreachable!("handled above"),
            Message::Region {
                region,
                base,
                file_offset,
                data_len,
                shape_len,
                path,
                ..
            } => {
                let (shape, file) = (fds.next().expect("two"), fds.next().expect("two"));
                session.regions.insert(
                    region,
                    HeldRegion {
                        shape,
                        file,
                        base,
                        file_offset,
                        data_len,
                        shape_len,
                        path,
                    },
                );
            }
            Message::RegionGone { region, .. } => {
                session.regions.remove(&region);
            }
            Message::Child { child, regions, .. } => {
                let uffd = fds.next().expect("one descriptor");
                session.children.insert(child, HeldChild { uffd, regions });
            }
            Message::ChildGone { child, .. } => {
                session.children.remove(&child);
            }
        }
        Ok(())
    }

    /// Each session's pidfd, to watch.
    pub fn pidfds(&self) -> impl Iterator<Item = (SessionId, &F)> {
        self.sessions
            .iter()
            .map(|(&session, held)| (session, &held.pidfd))
    }

    /// Takes out session `session`, whose service has ended.
    pub fn end(&mut self, session: SessionId) -> Option<Ending<F>> {
        let held = self.sessions.remove(&session)?;
        Some(Ending {
            session,
            pidfd: held.pidfd,
            regions: held.regions,
            children: held.children.into_values().collect(),
        })
    }

    /// Takes out every session (the program has ended: so have all its services).
    pub fn end_all(&mut self) -> Vec<Ending<F>> {
        let sessions: Vec<SessionId> = self.sessions.keys().copied().collect();
        sessions
            .into_iter()
            .filter_map(|session| self.end(session))
            .collect()
    }

    /// Descriptors held: (sessions, regions, children).
    pub fn held(&self) -> (usize, usize, usize) {
        let regions = self.sessions.values().map(|s| s.regions.len()).sum();
        let children = self.sessions.values().map(|s| s.children.len()).sum();
        (self.sessions.len(), regions, children)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A descriptor, by number.
    type Fd = u32;

    fn region(session: SessionId, region: u32, base: u64) -> Message {
        Message::Region {
            session,
            region,
            base,
            file_offset: 0,
            data_len: 1 << 20,
            shape_len: 1 << 20,
            path: format!("m{region}.gguf"),
        }
    }

    fn child(session: SessionId, child: u32, regions: &[u32]) -> Message {
        Message::Child {
            session,
            child,
            regions: regions.to_vec(),
        }
    }

    #[test]
    fn a_session_holds_its_regions_and_children_until_told_they_are_gone() {
        let mut keeper = Keeper::<Fd>::default();
        keeper
            .receive(Message::Session { session: 1 }, vec![10])
            .unwrap();
        keeper
            .receive(region(1, 0, 0x1000_0000), vec![11, 12])
            .unwrap();
        keeper
            .receive(region(1, 1, 0x2000_0000), vec![13, 14])
            .unwrap();
        keeper.receive(child(1, 16, &[0, 1]), vec![15]).unwrap();
        assert_eq!(keeper.held(), (1, 2, 1));
        keeper
            .receive(
                Message::RegionGone {
                    session: 1,
                    region: 0,
                },
                vec![],
            )
            .unwrap();
        keeper
            .receive(
                Message::ChildGone {
                    session: 1,
                    child: 16,
                },
                vec![],
            )
            .unwrap();
        assert_eq!(keeper.held(), (1, 1, 0));
        assert_eq!(keeper.pidfds().collect::<Vec<_>>(), vec![(1, &10)]);
    }

    #[test]
    fn an_ended_session_fills_what_its_live_children_map() {
        let mut keeper = Keeper::<Fd>::default();
        keeper
            .receive(Message::Session { session: 1 }, vec![10])
            .unwrap();
        keeper
            .receive(region(1, 0, 0x1000_0000), vec![11, 12])
            .unwrap();
        // A child forked with region 0 only; region 1 came later, with a second child.
        keeper.receive(child(1, 16, &[0]), vec![15]).unwrap();
        keeper
            .receive(region(1, 1, 0x2000_0000), vec![13, 14])
            .unwrap();
        keeper.receive(child(1, 17, &[0, 1]), vec![18]).unwrap();
        let ending = keeper.end(1).unwrap();
        assert_eq!(keeper.held(), (0, 0, 0), "the session is taken out whole");
        assert_eq!(ending.children.len(), 2);
        assert_eq!(ending.to_fill(&[true, true]), vec![0, 1]);
        assert_eq!(
            ending.to_fill(&[true, false]),
            vec![0],
            "the second child is gone"
        );
        assert_eq!(
            ending.to_fill(&[false, false]),
            Vec::<u32>::new(),
            "nobody to fill for"
        );
        assert_eq!(ending.probe_address(&ending.children[0]), 0x1000_0000);
    }

    #[test]
    fn a_region_the_service_forgot_is_neither_filled_nor_probed() {
        let mut keeper = Keeper::<Fd>::default();
        keeper
            .receive(Message::Session { session: 1 }, vec![10])
            .unwrap();
        keeper
            .receive(region(1, 0, 0x1000_0000), vec![11, 12])
            .unwrap();
        keeper.receive(child(1, 16, &[0]), vec![15]).unwrap();
        // The program unmapped it; the service filled it for the child first.
        keeper
            .receive(
                Message::RegionGone {
                    session: 1,
                    region: 0,
                },
                vec![],
            )
            .unwrap();
        let ending = keeper.end(1).unwrap();
        assert!(ending.to_fill(&[true]).is_empty());
        assert_eq!(ending.probe_address(&ending.children[0]), PROBE_ELSEWHERE);
    }

    #[test]
    fn sessions_end_apart_from_each_other() {
        // The program exec'd: the first image's service ended, the next one's runs.
        let mut keeper = Keeper::<Fd>::default();
        keeper
            .receive(Message::Session { session: 1 }, vec![10])
            .unwrap();
        keeper.receive(child(1, 16, &[]), vec![15]).unwrap();
        keeper
            .receive(Message::Session { session: 2 }, vec![20])
            .unwrap();
        keeper
            .receive(region(2, 0, 0x1000_0000), vec![21, 22])
            .unwrap();
        let first = keeper.end(1).unwrap();
        assert_eq!(first.children.len(), 1);
        assert!(first.regions.is_empty());
        assert_eq!(keeper.held(), (1, 1, 0));
        assert!(keeper.end(1).is_none(), "ended once");
        let rest = keeper.end_all();
        assert_eq!(rest.len(), 1);
        assert_eq!(rest[0].session, 2);
    }

    #[test]
    fn messages_it_cannot_act_on_are_refused() {
        let mut keeper = Keeper::<Fd>::default();
        assert_eq!(
            keeper.receive(region(5, 0, 0), vec![1, 2]),
            Err(StateError::UnknownSession(5))
        );
        keeper
            .receive(Message::Session { session: 5 }, vec![3])
            .unwrap();
        assert_eq!(
            keeper.receive(Message::Session { session: 5 }, vec![4]),
            Err(StateError::SessionAgain(5))
        );
        assert_eq!(
            keeper.receive(child(5, 1, &[]), vec![]),
            Err(StateError::Descriptors {
                expected: 1,
                got: 0
            })
        );
        assert_eq!(keeper.held(), (1, 0, 0));
    }
}
