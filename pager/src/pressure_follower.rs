//! Following memory pressure with a pager's budget (`--budget auto` in the shim): one
//! `step` waits for a pressure event or `PERIOD`, reads what the process can spare,
//! asks `budget::follow` what the budget should be, and sets it. The shim calls `step`
//! on a thread of its own; an embedder can do the same.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::budget::follow::{Bounds, BudgetFollow, Pressure, Reading};
use crate::budget::memory_pressure::{psi_pressure, psi_total_us, CgroupEvents, CgroupFiles};
use crate::budget::pressure_events::{PressureEvents, PSI_STALL_US, PSI_WINDOW_US};
use crate::pager::Pager;

/// Longest wait between two readings: a hog that allocates faster than the headroom in
/// this time can still push the cgroup to its limit before the budget follows.
pub const PERIOD: Duration = Duration::from_millis(100);
/// Shortest time between two readings: under lasting reclaim the v1 events come many
/// times a second, and each reading asks the fault service for its stats.
pub const MIN_PERIOD: Duration = Duration::from_millis(20);

/// A pager's budget following what its process can spare.
pub struct PressureFollower {
    pager: Pager,
    files: CgroupFiles,
    events: PressureEvents,
    follow: BudgetFollow,
    start: Instant,
    last_step: Instant,
    last_events: Option<CgroupEvents>,
    /// Without a PSI trigger: the PSI file polled, and its last (time, total stall).
    psi_polled: Option<(PathBuf, Option<(u64, u64)>)>,
}

/// The follower's bounds: `min` and `max` if given, within the pager's own.
pub fn bounds(pager_bounds: (u64, u64), min: Option<u64>, max: Option<u64>) -> Bounds {
    let (floor, ceiling) = pager_bounds;
    let min = min.unwrap_or(floor).clamp(floor, ceiling);
    let max = max.unwrap_or(ceiling).clamp(min, ceiling);
    Bounds { min, max }
}

/// Whether the PSI `some` total rose from `then` to `now` (each (time in ns, total
/// stall in us)) at a trigger's rate or more: polled totals count as a trigger would.
pub fn stalled(then: (u64, u64), now: (u64, u64)) -> bool {
    let elapsed_us = (now.0.saturating_sub(then.0) / 1000).max(1);
    let stall_us = now.1.saturating_sub(then.1);
    stall_us as u128 * PSI_WINDOW_US as u128 >= PSI_STALL_US as u128 * elapsed_us as u128
}

impl PressureFollower {
    /// Follows for `pager`, between `min` and `max` (default: the pager's bounds).
    pub fn new(pager: Pager, min: Option<u64>, max: Option<u64>) -> Self {
        let files = CgroupFiles::find();
        let events = PressureEvents::open(&files);
        let psi_polled = (!events.has_psi()).then(|| (files.psi_path(), None));
        let follow = BudgetFollow::new(pager.budget(), bounds(pager.budget_bounds(), min, max));
        Self {
            last_events: files.events(),
            pager,
            files,
            events,
            follow,
            start: Instant::now(),
            last_step: Instant::now(),
            psi_polled,
        }
    }

    /// What is watched, for the user: the event sources, and the readings.
    pub fn describe(&self) -> String {
        let mut watched = self.events.sources();
        if self.psi_polled.is_some() && psi_total_us(&self.files.psi_path()).is_some() {
            watched.push("PSI totals (polled)");
        }
        if self.last_events.is_some() {
            watched.push("cgroup v2 memory.events");
        }
        let readings = match (self.files.v2_dir(), self.files.v1_dir()) {
            (Some(_), _) => "MemAvailable, cgroup v2 memory.current/max",
            (None, Some(_)) => "MemAvailable, cgroup v1 usage/limit",
            (None, None) => "MemAvailable",
        };
        let events = if watched.is_empty() {
            "no pressure events".to_string()
        } else {
            watched.join(", ")
        };
        format!(
            "budget follows memory pressure between {} and {} ({readings}; {events})",
            crate::size::format_size(self.follow.bounds.min),
            crate::size::format_size(self.follow.bounds.max),
        )
    }

    /// Waits for pressure or `PERIOD`, then sets the budget if it is to change. False
    /// once the pager's service is gone (there is nothing more to follow for).
    pub fn step(&mut self) -> bool {
        let mut pressure = self.events.wait(PERIOD);
        std::thread::sleep(MIN_PERIOD.saturating_sub(self.last_step.elapsed()));
        self.last_step = Instant::now();
        let now_ns = self.start.elapsed().as_nanos() as u64;
        if let Some(events) = self.files.events() {
            if self
                .last_events
                .is_some_and(|last| events.rose_since(&last))
            {
                pressure = pressure.max(Pressure::High);
            }
            self.last_events = Some(events);
        }
        if let Some((path, last)) = &mut self.psi_polled {
            if let Some(total) = psi_total_us(path) {
                if last.is_some_and(|then| stalled(then, (now_ns, total))) {
                    pressure = pressure.max(psi_pressure(path));
                }
                *last = Some((now_ns, total));
            }
        }
        let stats = self.pager.stats();
        let reading = Reading {
            held: stats.resident_bytes.max(stats.frame_memory_bytes),
            spare: self.files.spare(),
            pressure,
        };
        if let Some(budget) = self.follow.next(now_ns, &reading) {
            match self.pager.set_budget(budget) {
                Ok(set) => self.follow.budget = set,
                Err(_) => return false,
            }
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn polled_psi_totals_count_at_the_trigger_s_rate() {
        const MS: u64 = 1_000_000;
        // 100 ms of stall in a second is the trigger; 10 ms in 100 ms the same rate.
        assert!(stalled((0, 0), (1000 * MS, 100_000)));
        assert!(stalled((0, 5), (100 * MS, 10_005)));
        assert!(!stalled((0, 0), (100 * MS, 9_000)));
        assert!(!stalled((0, 7), (1000 * MS, 7)));
        // A total that went back (a new cgroup file) is no stall.
        assert!(!stalled((0, 100), (1000 * MS, 0)));
    }

    #[test]
    fn the_bounds_given_stay_within_the_pager_s() {
        let pager = (16, 1000);
        assert_eq!(bounds(pager, None, None), Bounds { min: 16, max: 1000 });
        assert_eq!(
            bounds(pager, Some(100), Some(500)),
            Bounds { min: 100, max: 500 }
        );
        // Below the floor, above the ceiling, or crossed: the pager's bounds win and
        // the maximum is never below the minimum.
        assert_eq!(
            bounds(pager, Some(1), Some(5000)),
            Bounds { min: 16, max: 1000 }
        );
        assert_eq!(
            bounds(pager, Some(600), Some(500)),
            Bounds { min: 600, max: 600 }
        );
    }
}
