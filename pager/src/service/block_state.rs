//! The life of one block, as the service sees it: one state per block, changed only by
//! `transition`, which names every change the service makes and refuses any other.
//!
//! ```text
//!            Queued ──ReadIssued──> Reading ──Installed──> Resident
//!   Missing ─┘  ^ └─Dequeued─> Missing │ │ └─Staged──> Staged ─Installed─┘   │
//!     ^         └──────Requeued────────┘ └─Poisoned─> Poisoned              │
//!     └──────────────────────── Released ──────────────────────────────────┘
//!   Unmapped: reached from any state, left by none.
//! ```

use std::fmt;

/// Where a staged block's bytes wait until the program touches it.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) enum StagedIn {
    /// In this stash buffer (blocks are copied in).
    Stash(u32),
    /// Where it will be mapped from, not yet mapped: its frame (zero copy) or the
    /// region's file (reads in place).
    InPlace,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) enum BlockState {
    /// Not in memory and not asked for: a fault on it is a demand miss.
    Missing,
    /// Waiting in the demand or prefetch queue for a read slot.
    Queued,
    /// Its read is in flight (or finished and waiting to be installed).
    Reading,
    /// Read and held back (a prefetch marker) until the program faults on it; its bytes
    /// stay reserved in the budget meanwhile.
    Staged(StagedIn),
    /// Installed in the region and counted in the budget's resident bytes.
    Resident,
    /// Its read failed for good while a thread needed it: its pages raise SIGBUS. A later
    /// fault (a page not poisoned) or a pin reads it again.
    Poisoned,
    /// The program unmapped it: never read, installed or dropped again (something else
    /// may be mapped there now).
    Unmapped,
}

/// What happened to a block.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) enum BlockEvent {
    /// A thread faulted on it, a prefetch or a pin asked for it: it waits for a read slot.
    Queued,
    /// Taken off the prefetch queue unread (nothing resident was worth less).
    Dequeued,
    /// Its read was issued.
    ReadIssued,
    /// Its read finished and its bytes are held back until the program touches it.
    Staged(StagedIn),
    /// Its bytes are in the region now.
    Installed,
    /// It gave up its memory or its held-back bytes (evicted, dropped, a marker
    /// discarded): the next access faults it in again.
    Released,
    /// Its read failed and nobody needs it now: it is read again on demand.
    ReadFailed,
    /// A read of several blocks failed: this one is read again alone.
    Requeued,
    /// Its read failed for good while a thread waited on it.
    Poisoned,
    /// The program unmapped it.
    Unmapped,
}

/// A change the state machine does not allow: a service bug.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) struct InvalidTransition {
    pub from: BlockState,
    pub event: BlockEvent,
}

impl fmt::Display for InvalidTransition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "block event {:?} in state {:?}", self.event, self.from)
    }
}

impl BlockEvent {
    /// The state every allowed transition on this event leads to.
    pub(super) fn target(self) -> BlockState {
        match self {
            BlockEvent::Queued | BlockEvent::Requeued => BlockState::Queued,
            BlockEvent::Dequeued | BlockEvent::Released | BlockEvent::ReadFailed => {
                BlockState::Missing
            }
            BlockEvent::ReadIssued => BlockState::Reading,
            BlockEvent::Staged(place) => BlockState::Staged(place),
            BlockEvent::Installed => BlockState::Resident,
            BlockEvent::Poisoned => BlockState::Poisoned,
            BlockEvent::Unmapped => BlockState::Unmapped,
        }
    }
}

/// The state a block in `from` enters on `event`, or why it cannot.
pub(super) fn transition(
    from: BlockState,
    event: BlockEvent,
) -> Result<BlockState, InvalidTransition> {
    use BlockState as S;
    let allowed = match event {
        BlockEvent::Queued => matches!(from, S::Missing | S::Poisoned),
        BlockEvent::Dequeued | BlockEvent::ReadIssued => from == S::Queued,
        BlockEvent::Staged(_)
        | BlockEvent::ReadFailed
        | BlockEvent::Requeued
        | BlockEvent::Poisoned => from == S::Reading,
        BlockEvent::Installed => matches!(from, S::Reading | S::Staged(_)),
        BlockEvent::Released => {
            matches!(from, S::Missing | S::Resident | S::Poisoned | S::Staged(_))
        }
        BlockEvent::Unmapped => true,
    };
    if allowed {
        Ok(event.target())
    } else {
        Err(InvalidTransition { from, event })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STATES: [BlockState; 8] = [
        BlockState::Missing,
        BlockState::Queued,
        BlockState::Reading,
        BlockState::Staged(StagedIn::Stash(3)),
        BlockState::Staged(StagedIn::InPlace),
        BlockState::Resident,
        BlockState::Poisoned,
        BlockState::Unmapped,
    ];

    fn walk(events: &[BlockEvent]) -> Result<BlockState, InvalidTransition> {
        events
            .iter()
            .try_fold(BlockState::Missing, |state, &event| {
                transition(state, event)
            })
    }

    #[test]
    fn a_demand_read_installs_and_an_eviction_releases() {
        use BlockEvent::*;
        assert_eq!(
            walk(&[Queued, ReadIssued, Installed]),
            Ok(BlockState::Resident)
        );
        assert_eq!(
            walk(&[Queued, ReadIssued, Installed, Released]),
            Ok(BlockState::Missing)
        );
    }

    #[test]
    fn a_marker_is_staged_then_installed_or_discarded() {
        use BlockEvent::*;
        let staged = [Queued, ReadIssued, Staged(StagedIn::InPlace)];
        assert_eq!(walk(&staged), Ok(BlockState::Staged(StagedIn::InPlace)));
        assert_eq!(
            walk(&[&staged[..], &[Installed]].concat()),
            Ok(BlockState::Resident)
        );
        assert_eq!(
            walk(&[&staged[..], &[Released]].concat()),
            Ok(BlockState::Missing)
        );
    }

    #[test]
    fn failed_reads_poison_requeue_or_forget() {
        use BlockEvent::*;
        assert_eq!(
            walk(&[Queued, ReadIssued, Poisoned]),
            Ok(BlockState::Poisoned)
        );
        assert_eq!(
            walk(&[Queued, ReadIssued, Requeued]),
            Ok(BlockState::Queued)
        );
        assert_eq!(
            walk(&[Queued, ReadIssued, ReadFailed]),
            Ok(BlockState::Missing)
        );
        // A poisoned block is read again when asked for, or dropped.
        assert_eq!(
            walk(&[Queued, ReadIssued, Poisoned, Queued]),
            Ok(BlockState::Queued)
        );
        assert_eq!(
            walk(&[Queued, ReadIssued, Poisoned, Released]),
            Ok(BlockState::Missing)
        );
    }

    #[test]
    fn unmapped_is_reached_from_everywhere_and_left_by_nothing() {
        for from in STATES {
            assert_eq!(
                transition(from, BlockEvent::Unmapped),
                Ok(BlockState::Unmapped)
            );
        }
        let events = [
            BlockEvent::Queued,
            BlockEvent::Dequeued,
            BlockEvent::ReadIssued,
            BlockEvent::Staged(StagedIn::InPlace),
            BlockEvent::Installed,
            BlockEvent::Released,
            BlockEvent::ReadFailed,
            BlockEvent::Requeued,
            BlockEvent::Poisoned,
        ];
        for event in events {
            assert_eq!(
                transition(BlockState::Unmapped, event),
                Err(InvalidTransition {
                    from: BlockState::Unmapped,
                    event
                }),
                "{event:?}"
            );
        }
    }

    #[test]
    fn nothing_is_read_twice_or_installed_unread() {
        use BlockEvent::*;
        for (from, event) in [
            (BlockState::Resident, Queued),
            (BlockState::Reading, Queued),
            (BlockState::Queued, Queued),
            (BlockState::Missing, ReadIssued),
            (BlockState::Resident, ReadIssued),
            (BlockState::Missing, Installed),
            (BlockState::Queued, Installed),
            (BlockState::Resident, Installed),
            (BlockState::Reading, Released),
            (BlockState::Queued, Released),
            (BlockState::Resident, Staged(StagedIn::Stash(0))),
        ] {
            let refused = transition(from, event);
            assert_eq!(refused, Err(InvalidTransition { from, event }));
        }
    }

    #[test]
    fn every_allowed_transition_reaches_the_events_target() {
        let events = [
            BlockEvent::Queued,
            BlockEvent::Dequeued,
            BlockEvent::ReadIssued,
            BlockEvent::Staged(StagedIn::Stash(1)),
            BlockEvent::Installed,
            BlockEvent::Released,
            BlockEvent::ReadFailed,
            BlockEvent::Requeued,
            BlockEvent::Poisoned,
            BlockEvent::Unmapped,
        ];
        for from in STATES {
            for event in events {
                if let Ok(to) = transition(from, event) {
                    assert_eq!(to, event.target());
                }
            }
        }
    }
}
