//! The budget over time, as the stats report it: each change as (seconds since the
//! pager started, bytes), at most `MAX_POINTS` of them so that a long run under
//! changing pressure keeps a bounded record.
//!
//! When the record is full, a point inside a run that only rises (or only falls) goes
//! first: growing back in steps makes such runs, and the curve keeps its ends, its
//! lowest and highest points and every turn. Only a record of turns alone loses the
//! oldest turn after the first point.

use serde::{Deserialize, Serialize};

/// Most points kept.
pub const MAX_POINTS: usize = 512;

/// The budget from `t_s` seconds on.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
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

/// The history in a stats JSON (`Stats::budget_history`): empty when it has none.
pub fn from_stats_json(stats: &serde_json::Value) -> Vec<BudgetPoint> {
    serde_json::from_value(stats["budget_history"].clone()).unwrap_or_default()
}

/// How the budget moved over a run: where it started and ended, its extremes, and when
/// it changed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Movement {
    pub start: u64,
    pub end: u64,
    /// The lowest budget and when it was first set.
    pub lowest: BudgetPoint,
    /// The highest budget and when it was first set.
    pub highest: BudgetPoint,
    /// Changes after the start (the record's points less one: a thinned record counts
    /// only the points it kept).
    pub changes: usize,
    /// When the first and the last change came.
    pub first_change_s: f64,
    pub last_change_s: f64,
}

/// How the budget moved; `None` when it never did (no record, or the start alone).
pub fn movement(points: &[BudgetPoint]) -> Option<Movement> {
    let (first, rest) = points.split_first()?;
    let (second, last) = (rest.first()?, rest.last()?);
    let pick = |better: fn(u64, u64) -> bool| {
        (points.iter()).fold(*first, |best, p| {
            if better(p.bytes, best.bytes) {
                *p
            } else {
                best
            }
        })
    };
    Some(Movement {
        start: first.bytes,
        end: last.bytes,
        lowest: pick(|a, b| a < b),
        highest: pick(|a, b| a > b),
        changes: rest.len(),
        first_change_s: second.t_s,
        last_change_s: last.t_s,
    })
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
    fn movement_names_the_ends_the_extremes_and_when() {
        assert_eq!(movement(&[]), None);
        assert_eq!(movement(&[point(0.0, 100)]), None);
        let points = [
            point(0.0, 760),
            point(2.5, 300),
            point(3.0, 106),
            point(4.0, 106 + 1),
            point(9.5, 690),
        ];
        let moved = movement(&points).unwrap();
        assert_eq!((moved.start, moved.end, moved.changes), (760, 690, 4));
        assert_eq!(moved.lowest, point(3.0, 106));
        assert_eq!(moved.highest, point(0.0, 760));
        assert_eq!((moved.first_change_s, moved.last_change_s), (2.5, 9.5));
    }

    #[test]
    fn the_history_is_read_back_from_stats_json() {
        let json: serde_json::Value = serde_json::from_str(
            r#"{"budget_history": [{"t_s": 0.0, "bytes": 4}, {"t_s": 1.5, "bytes": 2}]}"#,
        )
        .unwrap();
        assert_eq!(from_stats_json(&json), [point(0.0, 4), point(1.5, 2)]);
        assert!(from_stats_json(&serde_json::json!({})).is_empty());
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
