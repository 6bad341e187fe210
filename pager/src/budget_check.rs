//! A budget checked before the program runs: refused where the pager could not start
//! with it, raised where it could not make progress in it, warned of where the machine
//! or the memory cgroup cannot give it. A plain function of the configuration and the
//! facts of the machine; the caller reads those (`budget::floor::threads`,
//! `budget::memory_limits::read`) and says what this decides.
//!
//! Only a budget in bytes can be checked before the program maps its model: a
//! percentage of the model is checked by the shim when the pager starts, the same way
//! (`ShimConfig::sizing`, `memory_limits::budget_warning`).

use thiserror::Error;

use crate::budget::floor::{self, Raise, BLOCKS_PER_THREAD};
use crate::budget::memory_limits::{budget_warning, BudgetWarning, MemoryLimits};
use crate::shim_config::{BudgetSpec, ShimConfig};
use crate::size::format_size;

/// What to run with, and what to tell the user first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Checked {
    /// The budget for the shim: the one configured, or the floor it was raised to.
    pub budget: BudgetSpec,
    pub raised: Option<Raise>,
    pub warning: Option<BudgetWarning>,
}

/// A budget and block size the pager cannot take together.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum BudgetCheckError {
    #[error(
        "a block of {} does not fit in a budget of {}: the pager needs {} for blocks that \
         size ({BLOCKS_PER_THREAD} for each of {threads} threads, one per CPU); give a \
         smaller block or a larger budget",
        format_size(*.block_size), format_size(*.budget), format_size(*.floor)
    )]
    BlockAboveBudget {
        block_size: u64,
        budget: u64,
        floor: u64,
        threads: usize,
    },
}

/// Checks `config`'s budget for a program whose `threads` threads fault at once, on a
/// machine with `limits`. A block size the configuration names that is larger than the
/// budget is an error (the user asked for two things that cannot be had together); a
/// budget of at least a block but below the floor is raised to it.
pub fn check_budget(
    config: &ShimConfig,
    threads: usize,
    limits: &MemoryLimits,
) -> Result<Checked, BudgetCheckError> {
    let BudgetSpec::Bytes(asked) = config.budget else {
        return Ok(Checked {
            budget: config.budget,
            raised: None,
            warning: None,
        });
    };
    if let Some(block_size) = config.block_size.filter(|&block| block > asked) {
        return Err(BudgetCheckError::BlockAboveBudget {
            block_size,
            budget: asked,
            floor: floor::floor(block_size, threads),
            threads,
        });
    }
    // The model's size is not known yet: the smallest block size it could get.
    let sizing = config.sizing(asked, 0, threads);
    Ok(Checked {
        budget: BudgetSpec::Bytes(sizing.budget),
        raised: sizing.raised,
        warning: budget_warning(sizing.budget, limits),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::budget::memory_limits::Limit;

    const GIB: u64 = 1 << 30;

    fn config(budget: BudgetSpec, block_size: Option<u64>) -> ShimConfig {
        let mut config = ShimConfig::defaults();
        config.budget = budget;
        config.block_size = block_size;
        config
    }

    fn machine() -> MemoryLimits {
        MemoryLimits {
            total: Some(16 * GIB),
            available: Some(12 * GIB),
            cgroup: None,
            cgroup_spare: None,
        }
    }

    #[test]
    fn a_budget_that_fits_is_taken_as_it_is() {
        let checked = check_budget(&config(BudgetSpec::Bytes(GIB), None), 2, &machine());
        assert_eq!(
            checked,
            Ok(Checked {
                budget: BudgetSpec::Bytes(GIB),
                raised: None,
                warning: None
            })
        );
    }

    #[test]
    fn a_budget_below_the_floor_is_raised() {
        let checked = check_budget(&config(BudgetSpec::Bytes(4096), None), 2, &machine()).unwrap();
        assert_eq!(checked.budget, BudgetSpec::Bytes(16 << 10));
        assert_eq!(checked.raised.unwrap().asked, 4096);
        // A block the user named: raised to two of them for each thread.
        let checked = check_budget(
            &config(BudgetSpec::Bytes(64 << 20), Some(64 << 20)),
            2,
            &machine(),
        )
        .unwrap();
        assert_eq!(checked.budget, BudgetSpec::Bytes(256 << 20));
    }

    #[test]
    fn a_block_larger_than_the_budget_is_refused() {
        let error = check_budget(
            &config(BudgetSpec::Bytes(32 << 20), Some(64 << 20)),
            2,
            &machine(),
        )
        .unwrap_err();
        assert_eq!(
            error,
            BudgetCheckError::BlockAboveBudget {
                block_size: 64 << 20,
                budget: 32 << 20,
                floor: 256 << 20,
                threads: 2
            }
        );
        let message = error.to_string();
        assert!(
            message.contains("64.0 MiB") && message.contains("32.0 MiB"),
            "{message}"
        );
    }

    #[test]
    fn a_budget_above_the_machine_is_warned_of() {
        let checked = check_budget(&config(BudgetSpec::Bytes(1 << 40), None), 2, &machine());
        let warning = checked.unwrap().warning.unwrap();
        assert_eq!(warning.limit, Limit::Total);
        let cgroup = MemoryLimits {
            cgroup: Some(GIB),
            ..machine()
        };
        let checked = check_budget(&config(BudgetSpec::Bytes(2 * GIB), None), 2, &cgroup);
        assert_eq!(checked.unwrap().warning.unwrap().limit, Limit::Cgroup);
    }

    #[test]
    fn a_percentage_is_left_for_the_shim() {
        let percent = config(BudgetSpec::ModelPercent(50), Some(1 << 30));
        let checked = check_budget(&percent, 2, &machine()).unwrap();
        assert_eq!(checked.budget, BudgetSpec::ModelPercent(50));
        assert_eq!((checked.raised, checked.warning), (None, None));
    }
}
