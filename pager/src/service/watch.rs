//! What the service watches on its ring, and the one place that numbers it.
//!
//! The ring (`crate::ring`) carries a bare `u32` with each multishot poll and hands it
//! back with every readiness; which descriptor a number stands for is the service's to
//! say, here and nowhere else. The numbers split into ranges so that a child's or a
//! guest's number is recovered by subtraction, with no table to keep:
//!
//! ```text
//!   0 Faults   1 Commands   2 Installed   3 ShareListen   4..16 never issued
//!   16 .. 2^30          Child(n),  token 16 + n
//!   2^30 ..= u32::MAX   Guest(n),  token 2^30 + n
//! ```
//!
//! A guest's token is above any thread id (`pid_max` is at most 2^22), so it stands for
//! the guest's faulting thread where the service records threads (`sharing`).

/// A descriptor the service polls on its ring.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) enum Watch {
    /// The program's userfaultfd: its faults and forks.
    Faults,
    /// The API side's command eventfd (`crate::command::Shared::wakeup`).
    Commands,
    /// The install workers' eventfd (`install_pool`): prefetched reads installed.
    Installed,
    /// The listening socket guests connect to (`sharing`).
    ShareListen,
    /// Forked child number `n`'s userfaultfd (`children`): numbered from 0 in the order
    /// adopted, never reused, so a readiness of a child gone finds nobody.
    Child(u32),
    /// Guest number `n`'s connection (`sharing`): numbered as children are.
    Guest(u32),
}

const FAULTS: u32 = 0;
const COMMANDS: u32 = 1;
const INSTALLED: u32 = 2;
const SHARE_LISTEN: u32 = 3;
const CHILD_BASE: u32 = 16;
const GUEST_BASE: u32 = 1 << 30;

/// Children the tokens can number (a billion forks: never met).
pub(super) const MAX_CHILDREN: u32 = GUEST_BASE - CHILD_BASE;
/// Guests the tokens can number.
pub(super) const MAX_GUESTS: u32 = u32::MAX - GUEST_BASE + 1;

impl Watch {
    /// The ring token this watch's polls carry.
    ///
    /// # Panics
    /// If a child's or guest's number is past `MAX_CHILDREN` or `MAX_GUESTS`: its token
    /// would be another watch's, and that one's readiness would be served as this one's.
    pub(super) fn token(self) -> u32 {
        match self {
            Watch::Faults => FAULTS,
            Watch::Commands => COMMANDS,
            Watch::Installed => INSTALLED,
            Watch::ShareListen => SHARE_LISTEN,
            Watch::Child(n) => {
                assert!(n < MAX_CHILDREN, "child number {n} has no ring token");
                CHILD_BASE + n
            }
            Watch::Guest(n) => {
                assert!(n < MAX_GUESTS, "guest number {n} has no ring token");
                GUEST_BASE + n
            }
        }
    }

    /// The watch `token` stands for; None for a number `token` never gives.
    pub(super) fn from_token(token: u32) -> Option<Watch> {
        match token {
            FAULTS => Some(Watch::Faults),
            COMMANDS => Some(Watch::Commands),
            INSTALLED => Some(Watch::Installed),
            SHARE_LISTEN => Some(Watch::ShareListen),
            CHILD_BASE..GUEST_BASE => Some(Watch::Child(token - CHILD_BASE)),
            GUEST_BASE..=u32::MAX => Some(Watch::Guest(token - GUEST_BASE)),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_watch_comes_back_from_its_token() {
        let watches = [
            Watch::Faults,
            Watch::Commands,
            Watch::Installed,
            Watch::ShareListen,
            Watch::Child(0),
            Watch::Child(1),
            Watch::Child(MAX_CHILDREN - 1),
            Watch::Guest(0),
            Watch::Guest(1),
            Watch::Guest(MAX_GUESTS - 1),
        ];
        for watch in watches {
            assert_eq!(Watch::from_token(watch.token()), Some(watch), "{watch:?}");
        }
    }

    #[test]
    fn the_ranges_meet_without_overlap() {
        assert_eq!(Watch::Child(0).token(), CHILD_BASE);
        assert_eq!(Watch::Child(MAX_CHILDREN - 1).token(), GUEST_BASE - 1);
        assert_eq!(Watch::Guest(0).token(), GUEST_BASE);
        assert_eq!(Watch::Guest(MAX_GUESTS - 1).token(), u32::MAX);
        assert_eq!(
            Watch::from_token(GUEST_BASE - 1),
            Some(Watch::Child(MAX_CHILDREN - 1))
        );
        assert_eq!(Watch::from_token(GUEST_BASE), Some(Watch::Guest(0)));
    }

    #[test]
    fn a_guests_token_is_no_thread_id() {
        const PID_MAX_LIMIT: u32 = 1 << 22;
        assert!(Watch::Guest(0).token() > PID_MAX_LIMIT);
    }

    #[test]
    fn numbers_no_watch_gives_are_unknown() {
        for token in [4, 5, CHILD_BASE - 1] {
            assert_eq!(Watch::from_token(token), None, "{token}");
        }
    }

    #[test]
    #[should_panic(expected = "has no ring token")]
    fn a_child_past_the_range_has_no_token() {
        Watch::Child(MAX_CHILDREN).token();
    }

    #[test]
    #[should_panic(expected = "has no ring token")]
    fn a_guest_past_the_range_has_no_token() {
        Watch::Guest(MAX_GUESTS).token();
    }
}
