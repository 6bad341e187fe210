//! The RAM budget: the service's only record of how many bytes are resident, reserved
//! for reads and staged markers, and pinned.
//!
//! Invariant: `resident + reserved <= limit` whenever the service waits for events. A
//! read reserves its bytes before it is issued (after `shortfall` bytes were evicted),
//! the reservation is released when the read is done with, and installed blocks count
//! as resident until they are evicted or dropped. Between the install of a read's blocks
//! and the release of its reservation the same bytes count twice, which errs on the side
//! of the budget. Pinned bytes are resident (or being read) bytes that eviction may not
//! take; they are counted apart so a pin can be refused before it starves demand faults.
//!
//! Giving back more than is counted, or a limit below the pins, is a service bug after
//! which the counts no longer bound memory (a count below zero would wrap to a huge one,
//! and the next sum wrap back to a small one). These are `assert!`s, in every build: a
//! compare beside a subtraction, a few per read; the service stops the process with the
//! message rather than go on past its budget.

use super::super::command::PinRefused;

#[derive(Debug)]
pub(super) struct Budget {
    limit: u64,
    resident: u64,
    reserved: u64,
    pinned: u64,
    peak_resident: u64,
}

impl Budget {
    pub(super) fn new(limit: u64) -> Self {
        Self {
            limit,
            resident: 0,
            reserved: 0,
            pinned: 0,
            peak_resident: 0,
        }
    }

    pub(super) fn limit(&self) -> u64 {
        self.limit
    }

    pub(super) fn resident(&self) -> u64 {
        self.resident
    }

    pub(super) fn pinned(&self) -> u64 {
        self.pinned
    }

    pub(super) fn peak_resident(&self) -> u64 {
        self.peak_resident
    }

    /// Changes the limit. Bytes held above a smaller limit are the caller's to evict
    /// (`shortfall(0)` of them) to restore the invariant.
    pub(super) fn set_limit(&mut self, limit: u64) {
        assert!(self.pinned < limit, "a limit of {limit} below the pins");
        self.limit = limit;
    }

    /// The limit `set_limit` takes when `asked` for: at least `floor` (below it the
    /// program's threads evict each other's blocks for good, see `budget::floor`) and the
    /// pinned bytes and one block more (a pin leaves a block for demand faults), at most
    /// `ceiling` (what the pager was sized for). `floor` is at most `ceiling`, and the
    /// pins leave a block below the limit, so the result is within all three bounds.
    pub(super) fn bounded(&self, asked: u64, floor: u64, ceiling: u64, block_size: u64) -> u64 {
        asked.max(floor).max(self.pinned + block_size).min(ceiling)
    }

    /// Bytes that must be freed before `bytes` more can be reserved.
    pub(super) fn shortfall(&self, bytes: u64) -> u64 {
        (self.resident + self.reserved + bytes).saturating_sub(self.limit)
    }

    /// Reserves `bytes` for a read (or keeps them for a staged marker). The caller made
    /// room first: `shortfall(bytes)` bytes were freed.
    pub(super) fn reserve(&mut self, bytes: u64) {
        self.reserved += bytes;
    }

    /// Gives back a reservation (its read is done with, its marker installed or
    /// discarded).
    pub(super) fn unreserve(&mut self, bytes: u64) {
        assert!(
            bytes <= self.reserved,
            "unreserving {bytes} of {}",
            self.reserved
        );
        self.reserved -= bytes;
    }

    /// Counts an installed block.
    pub(super) fn add_resident(&mut self, bytes: u64) {
        self.resident += bytes;
        self.peak_resident = self.peak_resident.max(self.resident);
    }

    /// Uncounts an evicted or dropped block.
    pub(super) fn remove_resident(&mut self, bytes: u64) {
        assert!(
            bytes <= self.resident,
            "removing {bytes} of {}",
            self.resident
        );
        self.resident -= bytes;
    }

    /// Pins `requested` more bytes, unless that would leave less than one block of
    /// `block_size` for demand faults.
    pub(super) fn pin(&mut self, requested: u64, block_size: u64) -> Result<(), PinRefused> {
        let total = self.pinned + requested;
        if total + block_size > self.limit {
            return Err(PinRefused::ExceedsBudget {
                requested,
                total,
                budget: self.limit,
                block: block_size,
            });
        }
        self.pinned = total;
        Ok(())
    }

    pub(super) fn unpin(&mut self, bytes: u64) {
        assert!(bytes <= self.pinned, "unpinning {bytes} of {}", self.pinned);
        self.pinned -= bytes;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shortfall_counts_resident_and_reserved_bytes() {
        let mut budget = Budget::new(100);
        assert_eq!(budget.shortfall(100), 0);
        assert_eq!(budget.shortfall(101), 1);
        budget.reserve(30);
        budget.add_resident(50);
        assert_eq!(budget.shortfall(20), 0);
        assert_eq!(budget.shortfall(40), 20);
        budget.unreserve(30);
        assert_eq!(budget.shortfall(40), 0);
        budget.remove_resident(50);
        assert_eq!(budget.shortfall(100), 0);
    }

    #[test]
    fn the_peak_remembers_the_most_resident() {
        let mut budget = Budget::new(100);
        budget.add_resident(60);
        budget.add_resident(30);
        budget.remove_resident(80);
        budget.add_resident(10);
        assert_eq!((budget.resident(), budget.peak_resident()), (20, 90));
    }

    #[test]
    fn a_new_limit_stays_between_the_floor_the_pins_and_the_ceiling() {
        let mut budget = Budget::new(100);
        assert_eq!(budget.bounded(60, 20, 200, 10), 60);
        assert_eq!(budget.bounded(5, 20, 200, 10), 20);
        assert_eq!(budget.bounded(500, 20, 200, 10), 200);
        budget.pin(50, 10).unwrap();
        // A smaller budget keeps the pinned bytes and a block for demand faults.
        assert_eq!(budget.bounded(30, 20, 200, 10), 60);
        budget.set_limit(60);
        assert_eq!(budget.limit(), 60);
    }

    #[test]
    fn a_smaller_limit_leaves_what_is_held_above_it_to_evict() {
        let mut budget = Budget::new(100);
        budget.add_resident(70);
        budget.reserve(20);
        budget.set_limit(50);
        assert_eq!(budget.shortfall(0), 40);
        budget.remove_resident(40);
        assert_eq!(budget.shortfall(0), 0);
        // A larger one gives room at once.
        budget.set_limit(150);
        assert_eq!(budget.shortfall(100), 0);
    }

    #[test]
    fn pins_leave_one_block_for_demand_faults() {
        let mut budget = Budget::new(100);
        assert_eq!(budget.pin(60, 20), Ok(()));
        assert_eq!(budget.pin(20, 20), Ok(()));
        assert_eq!(
            budget.pin(1, 20),
            Err(PinRefused::ExceedsBudget {
                requested: 1,
                total: 81,
                budget: 100,
                block: 20
            })
        );
        // A refused pin changes nothing.
        assert_eq!(budget.pinned(), 80);
        budget.unpin(80);
        assert_eq!(budget.pin(80, 20), Ok(()));
    }

    // Counts below zero stop the service in every build (these tests run in release).

    #[test]
    #[should_panic(expected = "unreserving 11 of 10")]
    fn giving_back_more_than_was_reserved_stops() {
        let mut budget = Budget::new(100);
        budget.reserve(10);
        budget.unreserve(11);
    }

    #[test]
    #[should_panic(expected = "removing 11 of 10")]
    fn removing_more_than_is_resident_stops() {
        let mut budget = Budget::new(100);
        budget.add_resident(10);
        budget.remove_resident(11);
    }

    #[test]
    #[should_panic(expected = "unpinning 11 of 10")]
    fn unpinning_more_than_is_pinned_stops() {
        let mut budget = Budget::new(100);
        budget.pin(10, 20).unwrap();
        budget.unpin(11);
    }

    #[test]
    #[should_panic(expected = "a limit of 50 below the pins")]
    fn a_limit_below_the_pins_stops() {
        let mut budget = Budget::new(100);
        budget.pin(60, 20).unwrap();
        budget.set_limit(50);
    }
}
