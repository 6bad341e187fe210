//! The budget over time, as the stats report it: each change as (seconds since the
//! pager started, bytes), at most `MAX_POINTS` of them so that a long run under
//! changing pressure keeps a bounded record.
//!
//! When the record is full, a point inside a run that only rises (or only falls) goes
//! first: growing back in steps makes such runs, and the curve keeps its ends, its
//! lowest and highest points and every turn. Only a record of turns alone loses the
//! oldest turn after the first point.

use serde::Serialize;

/// Most points kept.
pub const MAX_POINTS: usize = 512;

/// The budget from `t_s` seconds on.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct BudgetPoint {
    pub t_s: f64,
    pub bytes: u64,
}

/// Appends `point` unless the budget did not change, making room if the record is full.
pub fn record(points: &mut Vec<BudgetPoint>, point: BudgetPoint) {
    if points.last().is_some_and(|last| last.bytes == point.bytes) {
        return;
    }
    if points.len() >= MAX_POINTS {
        thin(points);
    }
    points.push(point);
}

/// Removes one point: the first inside a monotonic run, else the second.
fn thin(points: &mut Vec<BudgetPoint>) {
    let inside_a_run = (1..points.len().saturating_sub(1)).find(|&i| {
        let (before, at, after) = (points[i - 1].bytes, points[i].bytes, points[i + 1].bytes);
        (before < at && at < after) || (before > at && at > after)
    });
    match inside_a_run {
        Some(index) => {
            points.remove(index);
        }
        None if points.len() > 1 => {
            points.remove(1);
        }
        None => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(t_s: f64, bytes: u64) -> BudgetPoint {
        BudgetPoint { t_s, bytes }
    }

    #[test]
    fn only_changes_are_recorded() {
        let mut points = Vec::new();
        record(&mut points, point(0.0, 100));
        record(&mut points, point(1.0, 100));
        record(&mut points, point(2.0, 50));
        assert_eq!(points, [point(0.0, 100), point(2.0, 50)]);
    }

    #[test]
    fn a_full_record_drops_steps_of_a_run_and_keeps_the_turns() {
        let mut points = Vec::new();
        // Falls to 10, then grows back in steps, for longer than the record holds.
        record(&mut points, point(0.0, 1000));
        record(&mut points, point(1.0, 10));
        for step in 0..2 * MAX_POINTS as u64 {
            record(&mut points, point(2.0 + step as f64, 11 + step));
        }
        assert_eq!(points.len(), MAX_POINTS);
        assert_eq!(points[0], point(0.0, 1000));
        assert_eq!(points[1], point(1.0, 10));
        assert_eq!(points.last().unwrap().bytes, 10 + 2 * MAX_POINTS as u64);
    }

    #[test]
    fn a_record_of_turns_alone_loses_the_oldest_turn() {
        let mut points = Vec::new();
        for i in 0..MAX_POINTS as u64 + 1 {
            record(
                &mut points,
                point(i as f64, if i % 2 == 0 { 100 } else { 50 }),
            );
        }
        assert_eq!(points.len(), MAX_POINTS);
        assert_eq!(points[0], point(0.0, 100));
        // The second point (t = 1) went.
        assert_eq!(points[1], point(2.0, 100));
    }
}
