//! The smallest budget the pager can make progress in, and raising a budget to it.
//!
//! The fault service spares the last two blocks each thread faulted on (see
//! `recent_faults`): one instruction can need two blocks at once (a load straddling a
//! block boundary), and evicting the first to read the second has the retried
//! instruction fault on the first again, for good. The spared blocks can only be kept
//! while the budget holds them: two blocks for every thread that faults at once. Below
//! that, a thread's pair is evicted to serve another thread (or its own second block),
//! and the program livelocks, faulting endlessly: measured with llama-completion on
//! SmolLM2 and 4 KiB blocks, `--budget 4K -t 1` and `--budget 8K` or `12K -t 2` never
//! finish, `8K -t 1` and `16K -t 2` do. Reads in flight and held-back markers need no
//! room of their own: a demand read evicts the oldest of its thread's blocks, which is
//! no longer spared once the thread faulted elsewhere, and discards held markers first.
//!
//! How many threads fault at once cannot be known before the program runs; the floor
//! counts one per CPU the process may run on (what llama.cpp starts by default), at
//! most the threads whose blocks are spared. A program running more threads than that
//! at a budget this small can still starve; the line that says the budget was raised
//! gives the count, so the user can raise it further.

use crate::recent_faults::MAX_THREADS;
use crate::size::format_size;

/// Blocks a faulting thread needs resident at once.
pub const BLOCKS_PER_THREAD: u64 = 2;

/// The smallest budget in which `threads` threads can each hold their blocks of
/// `block_size` bytes.
pub fn floor(block_size: u64, threads: usize) -> u64 {
    block_size.saturating_mul(BLOCKS_PER_THREAD * threads.clamp(1, MAX_THREADS) as u64)
}

/// A budget raised to the floor: what was asked and why it was not enough.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Raise {
    pub asked: u64,
    pub floor: u64,
    pub block_size: u64,
    pub threads: usize,
}

impl std::fmt::Display for Raise {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the budget of {} is below the {} the pager needs to make progress \
             ({BLOCKS_PER_THREAD} blocks of {} for each of {} threads, one per CPU); using {}",
            format_size(self.asked),
            format_size(self.floor),
            format_size(self.block_size),
            self.threads.clamp(1, MAX_THREADS),
            format_size(self.floor),
        )
    }
}

/// `budget`, or the floor if it is below it (and then how it was raised).
pub fn raise_to_floor(budget: u64, block_size: u64, threads: usize) -> (u64, Option<Raise>) {
    let floor = floor(block_size, threads);
    if budget >= floor {
        return (budget, None);
    }
    let raise = Raise {
        asked: budget,
        floor,
        block_size,
        threads,
    };
    (floor, Some(raise))
}

/// The threads the floor counts: the CPUs this process may run on (its affinity and its
/// cgroup's CPU quota), at most the threads the service spares blocks for.
pub fn threads() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |threads| threads.get())
        .clamp(1, MAX_THREADS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_floor_is_two_blocks_a_thread() {
        assert_eq!(floor(4096, 1), 8 << 10);
        assert_eq!(floor(4096, 2), 16 << 10);
        assert_eq!(floor(2 << 20, 4), 16 << 20);
        // No thread count below one or above the spared threads.
        assert_eq!(floor(4096, 0), 8 << 10);
        assert_eq!(floor(4096, 1000), floor(4096, MAX_THREADS));
        assert_eq!(floor(u64::MAX, 2), u64::MAX);
    }

    #[test]
    fn budgets_below_the_floor_are_raised_and_say_so() {
        assert_eq!(raise_to_floor(16 << 10, 4096, 2), (16 << 10, None));
        assert_eq!(raise_to_floor(1 << 30, 4096, 2), (1 << 30, None));
        let (budget, raise) = raise_to_floor(4096, 4096, 2);
        assert_eq!(budget, 16 << 10);
        let raise = raise.unwrap();
        assert_eq!((raise.asked, raise.floor), (4096, 16 << 10));
        let line = raise.to_string();
        assert!(
            line.contains("4.00 KiB") && line.contains("16.0 KiB"),
            "{line}"
        );
        assert!(line.contains("2 threads"), "{line}");
    }
}
