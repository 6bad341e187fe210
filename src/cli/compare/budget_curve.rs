//! The pager's budget over a run, for the resident memory plot: a step line from the
//! stats' budget history (each budget holds until the next change).
//!
//! The history's times count from the pager's start, a few milliseconds after the run's
//! (the shim starts the pager as the program maps its model): close enough for a plot.

use hyperoffload::budget::history::BudgetPoint;

const MIB: f64 = 1024.0 * 1024.0;

/// (seconds, MiB) of the budget as a step line: each change holds until the next, the
/// last until `end_s` (the run's end, where later than the last change).
pub fn budget_steps(history: &[BudgetPoint], end_s: f64) -> Vec<(f64, f64)> {
    let mut steps = Vec::with_capacity(2 * history.len() + 1);
    for point in history {
        let mib = point.bytes as f64 / MIB;
        if let Some(&(_, before)) = steps.last() {
            steps.push((point.t_s, before));
        }
        steps.push((point.t_s, mib));
    }
    if let Some(&(last_t, last)) = steps.last() {
        if end_s > last_t {
            steps.push((end_s, last));
        }
    }
    steps
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(t_s: f64, mib: u64) -> BudgetPoint {
        BudgetPoint {
            t_s,
            bytes: mib << 20,
        }
    }

    #[test]
    fn each_budget_holds_until_the_next_change_and_the_last_until_the_end() {
        let history = [point(0.0, 760), point(2.0, 106), point(5.0, 690)];
        assert_eq!(
            budget_steps(&history, 8.0),
            [
                (0.0, 760.0),
                (2.0, 760.0),
                (2.0, 106.0),
                (5.0, 106.0),
                (5.0, 690.0),
                (8.0, 690.0)
            ]
        );
    }

    #[test]
    fn a_fixed_budget_is_a_flat_line_and_no_history_no_line() {
        assert_eq!(
            budget_steps(&[point(0.0, 64)], 3.0),
            [(0.0, 64.0), (3.0, 64.0)]
        );
        // A run that ended before the last change was recorded ends at the change.
        assert_eq!(budget_steps(&[point(0.0, 64)], 0.0), [(0.0, 64.0)]);
        assert!(budget_steps(&[], 3.0).is_empty());
    }
}
