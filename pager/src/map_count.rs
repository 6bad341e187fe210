//! How many memory mappings (VMAs) zero-copy regions may take, against the process's
//! limit (`vm.max_map_count`, 65530 by default).
//!
//! With zero copy every block the program touches is mapped from its own frame: a
//! mapping of its own, which stays after eviction (only its page-table entries go), so
//! a region's count grows with the blocks touched, not with the budget. When the
//! process reaches the limit, mapping a frame fails (ENOMEM) and the service cannot go
//! on: the program is stopped. So a region is refused up front, with the reason, unless
//! its most mappings fit beside what the process has and what earlier regions may still
//! grow to.

/// Mappings left for the rest of the program (its own mmaps, malloc arenas, thread
/// stacks) beyond what regions may take.
pub const SPARE_MAPPINGS: u64 = 1024;

/// The most mappings a zero-copy region of `blocks` blocks can take: each block mapped
/// from its own frame, and a piece of the untouched reservation between each two.
pub fn zero_copy_mappings(blocks: u64) -> u64 {
    blocks.saturating_mul(2).saturating_add(1)
}

/// Mappings a new region may still take, given the process's `in_use` ones now, what
/// earlier regions were `promised` (their most, part of which `in_use` already counts:
/// the estimate errs on the safe side), and the `limit`.
pub fn mappings_available(in_use: u64, promised: u64, limit: u64) -> u64 {
    limit.saturating_sub(
        in_use
            .saturating_add(promised)
            .saturating_add(SPARE_MAPPINGS),
    )
}

/// The process's limit and its mappings now, from /proc; None if either is unreadable
/// (then nothing is checked).
pub fn limit_and_in_use() -> Option<(u64, u64)> {
    let limit = std::fs::read_to_string("/proc/sys/vm/max_map_count")
        .ok()?
        .trim()
        .parse()
        .ok()?;
    let maps = std::fs::read("/proc/self/maps").ok()?;
    let in_use = maps.iter().filter(|&&byte| byte == b'\n').count() as u64;
    Some((limit, in_use))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_region_may_take_two_mappings_a_block_and_one() {
        assert_eq!(zero_copy_mappings(0), 1);
        assert_eq!(zero_copy_mappings(1533), 3067);
        assert_eq!(zero_copy_mappings(u64::MAX), u64::MAX);
    }

    #[test]
    fn what_is_available_leaves_the_program_its_spare() {
        assert_eq!(
            mappings_available(100, 0, 65530),
            65530 - 100 - SPARE_MAPPINGS
        );
        assert_eq!(
            mappings_available(100, 3067, 65530),
            65530 - 100 - 3067 - SPARE_MAPPINGS
        );
        // Nothing left, never negative.
        assert_eq!(mappings_available(65000, 3067, 65530), 0);
        assert_eq!(mappings_available(u64::MAX, u64::MAX, 65530), 0);
    }
}
