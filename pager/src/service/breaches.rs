//! Breaches of the service's invariants that it can step over: a block event its state
//! does not allow (`ServedRegion::advance`), an eviction policy naming a block eviction
//! or watching may not take. Each is a bug, but not one that serves wrong bytes or
//! overruns the budget: the service counts it (`Stats::invariant_breaches`, which the
//! tests require to be zero, in every build), reports the first few on stderr, and goes
//! on. Breaches it cannot step over are `assert!`s, in every build: the service stops
//! the process with the message (see `fatal`).

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Breaches reported on stderr; later ones are only counted (a bug met on every fault
/// would otherwise flood the program's output).
const REPORTED: u64 = 8;

/// The service's count of breaches, shared with its regions.
#[derive(Clone, Debug, Default)]
pub(super) struct Breaches(Arc<AtomicU64>);

impl Breaches {
    /// Counts one breach and reports it, unless `REPORTED` already were. Written with
    /// write(2), as `fatal` writes: stderr's lock may be held by a faulting thread.
    pub(super) fn record(&self, what: fmt::Arguments<'_>) {
        let before = self.0.fetch_add(1, Ordering::Relaxed);
        if before < REPORTED {
            let message = format!(
                "hyperoffload: internal invariant broken (a bug; the service goes on): {what}\n"
            );
            crate::sys::files::write_stderr(message.as_bytes());
        }
    }

    pub(super) fn count(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_breach_is_counted_in_every_clone() {
        let breaches = Breaches::default();
        let region = breaches.clone();
        for n in 0..REPORTED + 2 {
            region.record(format_args!("test breach {n}"));
        }
        assert_eq!(breaches.count(), REPORTED + 2);
    }
}
