//! Changing the budget while serving (`Command::SetBudget`): a larger budget gives
//! reads room at once; a smaller one is met by evicting through the eviction policy
//! before the command is answered, with the victims' frames giving their memory back.
//! Either way the policies hear of it: the eviction policy ranks blocks for the new
//! budget before anything is evicted for it (`EvictionPolicy::budget_changed`: the graph
//! policy chooses its streamed set again), and the prefetch policy resizes its lookahead
//! (`PrefetchPolicy::budget_changed`).
//!
//! What cannot be evicted at that moment (blocks being read, held by a read's
//! reservation, pinned blocks, and each thread's last two blocks, which the budget's
//! floor keeps room for) stays counted: once those reads finish, the service
//! evicts what is still above the budget (`shed_excess`, each turn of its loop), and no
//! new read is issued until what is held fits (a read's room is its bytes plus the
//! excess). So when `set_budget` returns, resident and reserved bytes together are
//! within the new budget, or everything evictable is gone and the excess is the reads
//! in flight (at most the queue depth times the largest read) until they finish.

use super::room::Purpose;
use super::{FaultService, ServiceError};
use crate::budget::history::{self, BudgetPoint};
use crate::policy::{BlockRef, ReadKind};

impl FaultService {
    /// Sets the budget to `asked` within the pager's bounds and evicts what it holds
    /// above it; returns the budget now in force.
    pub(super) fn set_budget(&mut self, asked: u64) -> Result<u64, ServiceError> {
        let limit = self.budget.bounded(
            asked,
            self.config.budget_floor,
            self.config.budget_ceiling,
            self.config.block_size,
        );
        let changed = limit != self.budget.limit();
        if changed {
            self.budget.set_limit(limit);
            self.stats.budget_bytes = limit;
            let point = BudgetPoint {
                t_s: self.start.elapsed().as_secs_f64(),
                bytes: limit,
            };
            history::record(&mut self.stats.budget_history, point);
            // Ranked for the new budget before anything is evicted for it.
            self.eviction.budget_changed(limit);
        }
        self.shed_excess()?;
        if let Some(store) = &mut self.store {
            // With the victims' frames back: unused frames keep no more memory than
            // the budget (and the frame a read may need) allows.
            store.set_memory_limit(limit + self.config.block_size);
        }
        if changed {
            // Lookahead sized by the old budget would read ahead what the new one has
            // no room for (or too little, once it grew back).
            self.prefetch.budget_changed(limit);
        }
        Ok(limit)
    }

    /// Evicts resident blocks while more is held than the budget allows (after it
    /// shrank), as far as anything evictable is left.
    pub(super) fn shed_excess(&mut self) -> Result<(), ServiceError> {
        if self.budget.shortfall(0) == 0 {
            return Ok(());
        }
        // Nothing is to be read: the policy is asked as for a demand read (which must
        // be given a victim while any is evictable), of a block of a live region. Each
        // thread's last blocks are spared: the floor keeps room for them.
        let Some(incoming) = self.regions.keys().next().map(|&id| BlockRef::new(id, 0)) else {
            return Ok(());
        };
        self.evict_until_fits(0, incoming, ReadKind::Demand, Purpose::Shrink)?;
        Ok(())
    }
}
