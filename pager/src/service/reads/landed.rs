//! Where a finished read goes: held back as a prefetch marker until the program faults
//! on it, or installed. A pure decision, from what the read's block is found to be.

use crate::policy::Install;
use crate::service::block_state::BlockState;

/// What a finished read's first block is found to be (a marker is a read of one block).
#[derive(Copy, Clone, Debug)]
pub(in crate::service) struct Landed {
    pub install: Install,
    /// The block's state now: `Reading`, unless the program unmapped it while it was
    /// read (`Unmapped`, see `FaultService::drop_blocks`).
    pub state: BlockState,
    /// Whether a thread waits on the block.
    pub waited: bool,
    /// Whether its bytes landed where they are mapped from (zero copy, reads in place).
    pub in_place: bool,
    /// Whether fewer markers than the most held (`max_staged`) are held back.
    pub marker_room: bool,
}

/// Where a finished read goes next.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(in crate::service) enum NextForRead {
    /// Held back as a marker where it landed (`StagedIn::InPlace`).
    HoldInPlace,
    /// Held back as a marker in the stash if it has room (`StagedIn::Stash`), else
    /// installed.
    HoldInStash,
    /// Installed (`install_read`). For a block the program unmapped while it was read,
    /// that finishes the read without installing anything (`blocks_installed`).
    Install,
}

impl Landed {
    /// A marker (`Install::OnFault`) nobody waits on is held back until the program
    /// faults on it; every other read is installed. Only a block still `Reading` is
    /// held back: one the program unmapped while it was read is `Unmapped`, which no
    /// event leaves (`block_state`), and nothing will ever fault on it, so holding it
    /// would keep its frame or stash buffer and its reservation for good.
    pub(in crate::service) fn next(self) -> NextForRead {
        let marker =
            self.install == Install::OnFault && !self.waited && self.state == BlockState::Reading;
        match (marker, self.in_place) {
            (true, true) if self.marker_room => NextForRead::HoldInPlace,
            (true, false) => NextForRead::HoldInStash,
            _ => NextForRead::Install,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::service::block_state::{transition, BlockEvent, InvalidTransition, StagedIn};

    fn landed(install: Install, state: BlockState, in_place: bool) -> Landed {
        Landed {
            install,
            state,
            waited: false,
            in_place,
            marker_room: true,
        }
    }

    #[test]
    fn a_marker_nobody_waits_on_is_held_back_where_it_landed_or_in_the_stash() {
        let marker = landed(Install::OnFault, BlockState::Reading, true);
        assert_eq!(marker.next(), NextForRead::HoldInPlace);
        let copied = landed(Install::OnFault, BlockState::Reading, false);
        assert_eq!(copied.next(), NextForRead::HoldInStash);
        let full = Landed {
            marker_room: false,
            ..marker
        };
        assert_eq!(full.next(), NextForRead::Install, "no room for markers");
        // The stash has its own room (`Stash::put`): checked when the marker is put there.
        let copied_full = Landed {
            marker_room: false,
            ..copied
        };
        assert_eq!(copied_full.next(), NextForRead::HoldInStash);
        let waited = Landed {
            waited: true,
            ..marker
        };
        assert_eq!(waited.next(), NextForRead::Install, "a thread waits on it");
        let eager = landed(Install::Eager, BlockState::Reading, true);
        assert_eq!(eager.next(), NextForRead::Install);
    }

    #[test]
    fn a_marker_the_program_unmapped_while_it_was_read_is_never_held_back() {
        // The program unmapped the block (`Unmapped`) while its read was in flight, as a
        // program closing its mapping with prefetches on the device does. Held back, it
        // would take `Staged` from `Unmapped`, which no transition allows.
        for in_place in [true, false] {
            let unmapped = landed(Install::OnFault, BlockState::Unmapped, in_place);
            assert_eq!(
                unmapped.next(),
                NextForRead::Install,
                "in place: {in_place}"
            );
            let staged = match in_place {
                true => BlockEvent::Staged(StagedIn::InPlace),
                false => BlockEvent::Staged(StagedIn::Stash(0)),
            };
            assert_eq!(
                transition(BlockState::Unmapped, staged),
                Err(InvalidTransition {
                    from: BlockState::Unmapped,
                    event: staged
                })
            );
        }
    }
}
