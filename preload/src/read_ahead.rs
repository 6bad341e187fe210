//! How much a MAP_POPULATE or WILLNEED hint over a managed mapping reads ahead.
//!
//! - No hint reads more than half the budget (`cap`): over a model larger than the
//!   budget, reading it all would only evict what it read.
//! - Hints covering at least half their mapping are loading's (llama.cpp maps each file
//!   with MAP_POPULATE, then advises WILLNEED over all of it). Those of all live
//!   mappings together read at most half the budget, one shared allowance, because a
//!   split model is a mapping per file. A mapping is charged only for bytes past those
//!   it was granted already (the WILLNEED after the populate asks for nothing new), and
//!   its charge is given back when it goes (`managed`).
//! - Smaller hints (a program advising the rows it is about to use, every token) are not
//!   charged and each read up to half the budget: an allowance spent at load would
//!   otherwise drop them all.

use std::ops::Range;

/// What one hint reads and what it takes from the shared allowance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    pub read: Range<u64>,
    /// Bytes taken from the allowance (0 for a hint that is not loading's).
    pub charged: u64,
}

/// The grant for a hint over `range` of a mapping of `mapping_len` bytes whose loading
/// hints were granted up to `granted_end`, with `left` of the shared allowance and a cap
/// of `cap` bytes a hint.
pub fn grant(range: Range<u64>, mapping_len: u64, granted_end: u64, left: u64, cap: u64) -> Grant {
    let len = range.end.saturating_sub(range.start);
    if len < mapping_len.div_ceil(2) {
        return Grant {
            read: range.start..range.start + len.min(cap),
            charged: 0,
        };
    }
    // Loading's: from where the mapping's earlier grants end (if this one starts within
    // them), as far as the allowance goes.
    let start = if range.start <= granted_end {
        granted_end.min(range.end)
    } else {
        range.start
    };
    let end = range.end.min(start.saturating_add(left.min(cap)));
    Grant {
        read: start..end,
        charged: end - start,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn the_parts_of_a_split_model_share_half_the_budget_at_load() {
        // Budget 180: cap 90. Four files of 50 populated then advised whole.
        let (cap, mut left) = (90 * MIB, 90 * MIB);
        let mut read = 0;
        for _ in 0..4 {
            let populate = grant(0..50 * MIB, 50 * MIB, 0, left, cap);
            left -= populate.charged;
            let advise = grant(0..50 * MIB, 50 * MIB, populate.read.end, left, cap);
            left -= advise.charged;
            read += populate.charged + advise.charged;
            assert_eq!(
                advise.read.start, populate.read.end,
                "the advice after the populate asks for nothing it was granted"
            );
        }
        assert_eq!(read, 90 * MIB);
        assert_eq!(left, 0);
    }

    #[test]
    fn one_file_reads_half_the_budget_as_before() {
        let populate = grant(0..1000 * MIB, 1000 * MIB, 0, 90 * MIB, 90 * MIB);
        assert_eq!(populate.read, 0..90 * MIB);
        let advise = grant(0..1000 * MIB, 1000 * MIB, 90 * MIB, 0, 90 * MIB);
        assert!(advise.read.is_empty());
    }

    #[test]
    fn small_hints_are_not_loading_and_take_nothing_from_the_allowance() {
        // The allowance spent: rows advised at run time are still read, up to the cap.
        let rows = grant(400 * MIB..401 * MIB, 1000 * MIB, 90 * MIB, 0, 90 * MIB);
        assert_eq!(rows.read, 400 * MIB..401 * MIB);
        assert_eq!(rows.charged, 0);
        let large = grant(0..400 * MIB, 1000 * MIB, 90 * MIB, 0, 90 * MIB);
        assert_eq!(large.read, 0..90 * MIB);
    }

    #[test]
    fn a_hint_past_the_granted_part_is_charged_from_its_own_start() {
        let hint = grant(40 * MIB..100 * MIB, 100 * MIB, 10 * MIB, 20 * MIB, 90 * MIB);
        assert_eq!(hint.read, 40 * MIB..60 * MIB);
        assert_eq!(hint.charged, 20 * MIB);
    }
}
