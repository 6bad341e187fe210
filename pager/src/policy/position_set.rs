//! A set of positions in the predicted order, with a fast "last member at or before".
//!
//! The graph eviction policy asks, for every block it evicts, which resident position
//! lies furthest ahead of the program; at 4 KiB blocks that is some 400 000 questions per
//! token of a 3 GiB model, interleaved with as many inserts and removals. A `BTreeSet`
//! answered them at a few cache misses each and cost a quarter of the fault service's
//! time. This is a three-level bitmap instead: each level has one bit per non-empty
//! word of the level below, so a search touches at most a few words per level.

/// Positions `0..len`, as a hierarchy of bitmaps (level 0: one bit per position).
#[derive(Clone, Debug)]
pub struct PositionSet {
    levels: Vec<Vec<u64>>,
    len: u32,
    count: usize,
}

impl PositionSet {
    pub fn new(len: u32) -> Self {
        let mut levels = Vec::new();
        let mut bits = len.max(1) as usize;
        loop {
            let words = bits.div_ceil(64);
            levels.push(vec![0u64; words]);
            if words == 1 {
                break;
            }
            bits = words;
        }
        Self {
            levels,
            len,
            count: 0,
        }
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.count
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    pub fn contains(&self, position: u32) -> bool {
        position < self.len && self.levels[0][position as usize / 64] >> (position % 64) & 1 == 1
    }

    /// Adds `position`; false if it was already there. Positions past the end are ignored.
    pub fn insert(&mut self, position: u32) -> bool {
        if position >= self.len || self.contains(position) {
            return false;
        }
        let mut index = position as usize;
        for level in &mut self.levels {
            let word = &mut level[index / 64];
            let was_empty = *word == 0;
            *word |= 1 << (index % 64);
            if !was_empty {
                break;
            }
            index /= 64;
        }
        self.count += 1;
        true
    }

    /// Removes `position`; false if it was not there.
    pub fn remove(&mut self, position: u32) -> bool {
        if !self.contains(position) {
            return false;
        }
        let mut index = position as usize;
        for level in &mut self.levels {
            let word = &mut level[index / 64];
            *word &= !(1 << (index % 64));
            if *word != 0 {
                break;
            }
            index /= 64;
        }
        self.count -= 1;
        true
    }

    /// The greatest member at or before `position`.
    pub fn last_at_or_before(&self, position: u32) -> Option<u32> {
        if self.is_empty() {
            return None;
        }
        let position = position.min(self.len.checked_sub(1)?) as usize;
        // Climb while the word holding `index` has nothing at or below it.
        let mut index = position;
        let mut level = 0;
        loop {
            let word = self.levels[level][index / 64] & below_and_at(index % 64);
            if word != 0 {
                index = (index / 64) * 64 + highest_bit(word);
                break;
            }
            // Nothing in this word at or below `index`: look at words before it.
            if index / 64 == 0 {
                return None;
            }
            index = index / 64 - 1;
            level += 1;
            if level == self.levels.len() {
                return None;
            }
        }
        // Descend: at each lower level take the highest bit of the word found.
        while level > 0 {
            level -= 1;
            let word = self.levels[level][index];
            debug_assert_ne!(word, 0, "a summary bit stands for a non-empty word");
            index = index * 64 + highest_bit(word);
        }
        Some(index as u32)
    }
}

impl PositionSet {
    /// The least member at or after `position`.
    pub fn first_at_or_after(&self, position: u32) -> Option<u32> {
        if self.is_empty() || position >= self.len {
            return None;
        }
        // Climb while the word holding `index` has nothing at or above it.
        let mut index = position as usize;
        let mut level = 0;
        loop {
            let word = self.levels[level][index / 64] & at_and_above(index % 64);
            if word != 0 {
                index = (index / 64) * 64 + word.trailing_zeros() as usize;
                break;
            }
            // Nothing in this word at or above `index`: look at words after it.
            index = index / 64 + 1;
            level += 1;
            if level == self.levels.len() || index / 64 >= self.levels[level].len() {
                return None;
            }
        }
        // Descend: at each lower level take the lowest bit of the word found.
        while level > 0 {
            level -= 1;
            let word = self.levels[level][index];
            debug_assert_ne!(word, 0, "a summary bit stands for a non-empty word");
            index = index * 64 + word.trailing_zeros() as usize;
        }
        Some(index as u32)
    }
}

/// Bits `bit..64` of a word.
fn at_and_above(bit: usize) -> u64 {
    u64::MAX << bit
}

/// Bits `0..=bit` of a word.
fn below_and_at(bit: usize) -> u64 {
    if bit == 63 {
        u64::MAX
    } else {
        (1u64 << (bit + 1)) - 1
    }
}

fn highest_bit(word: u64) -> usize {
    63 - word.leading_zeros() as usize
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    /// A small deterministic generator, enough to shuffle operations.
    fn next(state: &mut u64) -> u64 {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        *state
    }

    #[test]
    fn agrees_with_a_btree_set_under_random_operations() {
        for len in [1u32, 63, 64, 65, 4095, 4096, 4097, 300_000] {
            let mut set = PositionSet::new(len);
            let mut model = BTreeSet::new();
            let mut state = 0x9E37_79B9_7F4A_7C15 ^ len as u64;
            for _ in 0..20_000 {
                let position = (next(&mut state) % len as u64) as u32;
                match next(&mut state) % 4 {
                    0 => assert_eq!(set.insert(position), model.insert(position)),
                    1 => assert_eq!(set.remove(position), model.remove(&position)),
                    2 => assert_eq!(
                        set.first_at_or_after(position),
                        model.range(position..).next().copied(),
                        "len {len}, from {position}"
                    ),
                    _ => assert_eq!(
                        set.last_at_or_before(position),
                        model.range(..=position).next_back().copied(),
                        "len {len}, at {position}"
                    ),
                }
                assert_eq!(set.len(), model.len());
            }
        }
    }

    #[test]
    fn finds_members_across_empty_words_and_levels() {
        let mut set = PositionSet::new(1 << 20);
        assert_eq!(set.last_at_or_before(u32::MAX), None);
        set.insert(5);
        set.insert(70_000);
        assert_eq!(set.last_at_or_before(69_999), Some(5));
        assert_eq!(set.last_at_or_before(70_000), Some(70_000));
        assert_eq!(set.last_at_or_before(u32::MAX), Some(70_000));
        assert_eq!(set.last_at_or_before(4), None);
        assert_eq!(set.first_at_or_after(0), Some(5));
        assert_eq!(set.first_at_or_after(6), Some(70_000));
        assert_eq!(set.first_at_or_after(70_001), None);
        assert_eq!(set.first_at_or_after(u32::MAX), None);
        set.remove(5);
        assert_eq!(set.last_at_or_before(69_999), None);
        assert!(!set.insert(1 << 20), "past the end");
        assert!(!set.contains(1 << 20));
    }
}
