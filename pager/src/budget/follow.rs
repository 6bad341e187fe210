//! Following memory pressure under `--budget auto`: given what the machine and the
//! memory cgroup can spare now, and whether the kernel reported pressure, what the
//! budget should be. A plain function of its readings (`BudgetFollow::next`); the
//! readings and the pressure events are `memory_pressure`'s and `pressure_events`'s, and
//! `crate::pressure_follower` applies the answer with `Pager::set_budget`.
//!
//! The rule:
//! - What the pager could have is what it holds now plus what is spare (the memory
//!   available, and the cgroup's limit less what it uses that it cannot reclaim); the
//!   budget aims at that less the same headroom the starting budget leaves
//!   (`memory_limits::auto_budget`), within the bounds (`--min`, `--max`).
//! - Under pressure the kernel reported on this process's cgroup (its PSI, a v1
//!   pressure level of medium or more, v2 `memory.events` high or max), the aim is an
//!   eighth below the budget at most, whatever the readings say, once every
//!   `GROW_PERIOD_NS`: reclaim is under way, so memory that looks spare may be on its
//!   way elsewhere. Any pressure (also the v1 `low` level, and stalls anywhere on the
//!   machine) holds growth back for `CALM_NS` after it.
//! - A lower aim is taken at once: the hog's next step could end in the OOM killer. A
//!   higher one is approached in steps (`GROW_STEP` or a quarter of the aim, whichever is
//!   more, once every `GROW_PERIOD`), so that a program that allocates again meets a
//!   budget that grew by a step, not all the way back.
//! - Small changes are not made (`deadband`): a program's own allocations and the page
//!   cache move the readings by a few percent all the time (measured: llama-bench
//!   loading a 1 GiB model in a 1.5 GiB cgroup moved the aim by 10-20 MiB, 18 changes in
//!   6 s with a fixed 4 MiB threshold), and each shrink evicts blocks the program reads
//!   again. Growth needs twice the margin a shrink does, so the two do not alternate.

use crate::budget::memory_limits::auto_headroom;

/// After the last pressure event, how long the budget does not grow.
pub const CALM_NS: u64 = 2_000_000_000;
/// Least time between two growth steps.
pub const GROW_PERIOD_NS: u64 = 500_000_000;
/// Least growth step.
pub const GROW_STEP: u64 = 64 << 20;
/// Smallest change made.
pub const MIN_CHANGE: u64 = 4 << 20;

/// The least a shrink of `budget` changes it by: `MIN_CHANGE`, or a thirty-second of it
/// (a growth needs twice that).
pub fn deadband(budget: u64) -> u64 {
    MIN_CHANGE.max(budget / 32)
}

/// What the kernel said about memory pressure since the last reading.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub enum Pressure {
    #[default]
    None,
    /// Reclaim has begun (cgroup v1 `low`): hold growth back.
    Low,
    /// Tasks of this cgroup stall on memory (its PSI, v1 `medium`/`critical`, v2
    /// `memory.events` high or max): give memory back.
    High,
}

/// One reading of what this process can have.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Reading {
    /// Bytes the pager holds now: its resident blocks, or with zero copy the memory of
    /// its frames if that is more. They count in the spare below as used.
    pub held: u64,
    /// What the machine and the cgroup can still give (the least of `MemAvailable` and
    /// the cgroup's room), if known.
    pub spare: Option<u64>,
    pub pressure: Pressure,
}

/// Where the budget may go: `--min` and `--max`, and the pager's own bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    pub min: u64,
    pub max: u64,
}

impl Bounds {
    fn clamp(&self, bytes: u64) -> u64 {
        bytes.min(self.max).max(self.min)
    }
}

/// The budget a follower has set, and when it last saw pressure and last grew.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BudgetFollow {
    pub budget: u64,
    pub bounds: Bounds,
    last_pressure_ns: Option<u64>,
    last_growth_ns: Option<u64>,
    /// When pressure last took an eighth off.
    last_cut_ns: Option<u64>,
}

/// What the pager could have, less the headroom (the starting budget's rule).
pub fn aim(held: u64, spare: u64) -> u64 {
    let room = held.saturating_add(spare);
    room.saturating_sub(auto_headroom(room))
}

impl BudgetFollow {
    pub fn new(budget: u64, bounds: Bounds) -> Self {
        Self {
            budget: bounds.clamp(budget),
            bounds,
            last_pressure_ns: None,
            last_growth_ns: None,
            last_cut_ns: None,
        }
    }

    /// The budget to set at `now_ns` after `reading`, if it is to change (and then it
    /// is taken as set).
    pub fn next(&mut self, now_ns: u64, reading: &Reading) -> Option<u64> {
        if reading.pressure != Pressure::None {
            self.last_pressure_ns = Some(now_ns);
        }
        let mut aim = match reading.spare {
            Some(spare) => aim(reading.held, spare),
            // Nothing known: stay, unless the kernel says to give back.
            None => self.budget,
        };
        let since_cut = self
            .last_cut_ns
            .map_or(u64::MAX, |at| now_ns.saturating_sub(at));
        if reading.pressure == Pressure::High && since_cut >= GROW_PERIOD_NS {
            let cut = self.budget - self.budget / 8;
            if cut < aim {
                aim = cut;
                self.last_cut_ns = Some(now_ns);
            }
        }
        let aim = self.bounds.clamp(aim);
        let next = if aim < self.budget {
            (self.budget - aim >= deadband(self.budget) || aim == self.bounds.min).then_some(aim)
        } else if aim > self.budget {
            self.growth(now_ns, aim)
        } else {
            None
        }?;
        if next == self.budget {
            return None;
        }
        if next > self.budget {
            self.last_growth_ns = Some(now_ns);
        }
        self.budget = next;
        Some(next)
    }

    /// One growth step toward `aim`, if it is time for one.
    fn growth(&self, now_ns: u64, aim: u64) -> Option<u64> {
        let since = |at: Option<u64>| at.map_or(u64::MAX, |at| now_ns.saturating_sub(at));
        if since(self.last_pressure_ns) < CALM_NS || since(self.last_growth_ns) < GROW_PERIOD_NS {
            return None;
        }
        if aim - self.budget < 2 * deadband(self.budget) && aim != self.bounds.max {
            return None;
        }
        let step = GROW_STEP.max(aim / 4);
        Some(aim.min(self.budget.saturating_add(step)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;
    const S: u64 = 1_000_000_000;

    fn follow(budget: u64) -> BudgetFollow {
        BudgetFollow::new(
            budget,
            Bounds {
                min: 16 * MIB,
                max: 12 * GIB,
            },
        )
    }

    fn reading(held: u64, spare: u64, pressure: Pressure) -> Reading {
        Reading {
            held,
            spare: Some(spare),
            pressure,
        }
    }

    #[test]
    fn the_aim_is_what_could_be_had_less_the_starting_headroom() {
        // Nothing held: the starting budget's rule.
        assert_eq!(aim(0, 2 * GIB), 2 * GIB - GIB / 2);
        // Held bytes count as the pager's: holding the starting budget, it stays.
        let start = aim(0, 2 * GIB);
        assert_eq!(aim(start, 2 * GIB - start), start);
        // Little room: half of it.
        assert_eq!(aim(0, 100 * MIB), 50 * MIB);
    }

    #[test]
    fn a_steady_reading_changes_nothing() {
        let start = aim(0, 2 * GIB);
        let mut follow = follow(start);
        for second in 0..10 {
            let reading = reading(start, 2 * GIB - start, Pressure::None);
            assert_eq!(follow.next(second * S, &reading), None);
        }
    }

    #[test]
    fn less_to_spare_shrinks_at_once() {
        let start = aim(0, 2 * GIB);
        let mut follow = follow(start);
        // A hog takes 400 MiB of what was spare: the aim falls.
        let spare = 2 * GIB - start - 400 * MIB;
        let shrunk = follow.next(S, &reading(start, spare, Pressure::None));
        assert_eq!(shrunk, Some(aim(start, spare)));
        assert_eq!(follow.budget, aim(start, spare));
        // Small changes are not made. (What the pager gave back is spare now.)
        let held = follow.budget;
        let spare = spare + (start - held);
        assert_eq!(
            follow.next(2 * S, &reading(held, spare - MIB, Pressure::None)),
            None
        );
    }

    #[test]
    fn readings_that_wander_a_little_change_nothing() {
        let mut follow = follow(GIB);
        // Held 1 GiB, and room for an aim a thirty-third lower, then a twentieth higher.
        let spare_for = |aim_wanted: u64| (aim_wanted * 4).div_ceil(3) - GIB;
        let lower = GIB - GIB / 33;
        let higher = GIB + GIB / 20;
        for (second, aim_wanted) in [(1, lower), (5, higher), (9, lower), (13, higher)] {
            let reading = reading(GIB, spare_for(aim_wanted), Pressure::None);
            assert_eq!(follow.next(second * S, &reading), None, "{aim_wanted}");
        }
        // Past the band: a shrink of a sixteenth is made.
        let reading = reading(GIB, spare_for(GIB - GIB / 16), Pressure::None);
        assert!(follow.next(20 * S, &reading).is_some());
    }

    #[test]
    fn pressure_gives_an_eighth_back_even_if_the_readings_look_fine() {
        let mut follow = follow(GIB);
        let next = follow.next(S, &reading(GIB, 4 * GIB, Pressure::High));
        assert_eq!(next, Some(GIB - GIB / 8));
        // Low pressure gives nothing back, and holds growth back.
        let mut follow = BudgetFollow::new(GIB, follow.bounds);
        assert_eq!(follow.next(S, &reading(GIB, 4 * GIB, Pressure::Low)), None);
        assert_eq!(
            follow.next(S + CALM_NS - 1, &reading(GIB, 4 * GIB, Pressure::None)),
            None
        );
        assert!(follow
            .next(S + CALM_NS, &reading(GIB, 4 * GIB, Pressure::None))
            .is_some());
    }

    #[test]
    fn pressure_that_lasts_takes_an_eighth_a_period() {
        let mut follow = follow(GIB);
        let pressed = reading(GIB, 4 * GIB, Pressure::High);
        let mut budgets = Vec::new();
        for tenth in 0..10 {
            if let Some(next) = follow.next(tenth * S / 10, &pressed) {
                budgets.push(next);
            }
        }
        assert_eq!(budgets, [GIB - GIB / 8, (GIB - GIB / 8) * 7 / 8]);
    }

    #[test]
    fn growth_comes_back_in_steps_once_calm() {
        let mut follow = follow(GIB);
        // The hog took everything spare, then more as the pager gave it back: down to
        // the minimum.
        assert_eq!(
            follow.next(0, &reading(GIB, 0, Pressure::High)),
            Some(aim(GIB, 0))
        );
        // Less than twice the least headroom left: half of what it holds, each reading.
        for (tenths, held, next) in [(1, 100, 50), (2, 50, 25), (3, 25, 16)] {
            assert_eq!(
                follow.next(tenths * S / 10, &reading(held * MIB, 0, Pressure::None)),
                Some(next * MIB)
            );
        }
        // The hog exits: 3 GiB spare, aim 2.25 GiB; nothing until calm.
        let spare = 3 * GIB;
        let target = aim(16 * MIB, spare);
        assert_eq!(
            follow.next(S, &reading(16 * MIB, spare, Pressure::None)),
            None
        );
        let mut now = CALM_NS;
        let mut steps = Vec::new();
        while target - follow.budget >= 2 * deadband(follow.budget) {
            let held = follow.budget;
            if let Some(next) =
                follow.next(now, &reading(held, spare - held + 16 * MIB, Pressure::None))
            {
                steps.push(next);
            }
            now += GROW_PERIOD_NS / 2;
            assert!(now < 100 * S, "never grew back: {steps:?}");
        }
        // Steps of a quarter of the aim, one per period, and the last to the aim.
        assert!(steps.len() >= 4, "{steps:?}");
        assert!(steps.windows(2).all(|pair| pair[1] > pair[0]), "{steps:?}");
        assert!(steps
            .windows(2)
            .all(|pair| pair[1] - pair[0] <= target / 4 + MIB));
        let last = *steps.last().unwrap();
        assert!(
            last <= target && target - last < 2 * deadband(last),
            "{steps:?}"
        );
    }

    #[test]
    fn the_bounds_hold() {
        let bounds = Bounds {
            min: 256 * MIB,
            max: GIB,
        };
        let mut follow = BudgetFollow::new(GIB, bounds);
        let pressed = reading(300 * MIB, 0, Pressure::High);
        assert_eq!(follow.next(0, &pressed), Some(256 * MIB));
        assert_eq!(follow.next(S, &pressed), None);
        let mut now = 10 * S;
        while follow
            .next(now, &reading(follow.budget, 64 * GIB, Pressure::None))
            .is_some()
        {
            now += S;
        }
        assert_eq!(follow.budget, GIB);
        // Unknown readings: the budget stays unless the kernel says to give back.
        let unknown = Reading {
            held: GIB,
            spare: None,
            pressure: Pressure::None,
        };
        assert_eq!(follow.next(now + 10 * S, &unknown), None);
        let pressed = Reading {
            pressure: Pressure::High,
            ..unknown
        };
        assert_eq!(follow.next(now + 11 * S, &pressed), Some(GIB - GIB / 8));
    }
}
