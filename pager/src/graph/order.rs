//! The predicted cyclic order of blocks: one token's pass over the model, which the next
//! token repeats. Positions index into it; a block may sit at several positions (a block
//! shared by two tensors that do not run back to back is used twice per pass).

/// A cyclic sequence of block indices with, for every block, the sorted positions where
/// it occurs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CyclicOrder {
    seq: Vec<u32>,
    /// `positions[offsets[b]..offsets[b + 1]]` are block `b`'s positions, ascending.
    offsets: Vec<u32>,
    positions: Vec<u32>,
}

impl CyclicOrder {
    /// Builds the order from a pass's block sequence. Blocks at or past `block_count` are
    /// dropped, and so are immediate repeats (also across the wrap from the last position
    /// to the first): touching the block you are in is not a new use.
    pub fn from_sequence(sequence: impl IntoIterator<Item = u32>, block_count: u32) -> Self {
        let mut seq: Vec<u32> = Vec::new();
        for block in sequence {
            if block < block_count && seq.last() != Some(&block) {
                seq.push(block);
            }
        }
        while seq.len() > 1 && seq.first() == seq.last() {
            seq.pop();
        }
        let mut counts = vec![0u32; block_count as usize + 1];
        for &block in &seq {
            counts[block as usize + 1] += 1;
        }
        for i in 1..counts.len() {
            counts[i] += counts[i - 1];
        }
        let offsets = counts;
        let mut fill = offsets.clone();
        let mut positions = vec![0u32; seq.len()];
        for (position, &block) in seq.iter().enumerate() {
            let slot = &mut fill[block as usize];
            positions[*slot as usize] = position as u32;
            *slot += 1;
        }
        Self {
            seq,
            offsets,
            positions,
        }
    }

    /// Positions in one pass.
    pub fn len(&self) -> u32 {
        self.seq.len() as u32
    }

    pub fn is_empty(&self) -> bool {
        self.seq.is_empty()
    }

    /// The pass as a sequence of block indices.
    pub fn sequence(&self) -> &[u32] {
        &self.seq
    }

    pub fn block_at(&self, position: u32) -> u32 {
        self.seq[position as usize]
    }

    /// Where `block` occurs in the pass, ascending; empty when it is not predicted.
    pub fn positions(&self, block: u32) -> &[u32] {
        let Some(&start) = self.offsets.get(block as usize) else {
            return &[];
        };
        let end = self.offsets[block as usize + 1];
        &self.positions[start as usize..end as usize]
    }

    pub fn contains(&self, block: u32) -> bool {
        !self.positions(block).is_empty()
    }

    /// How many steps forward from `from` to `to`, going round the cycle.
    pub fn distance(&self, from: u32, to: u32) -> u32 {
        if to >= from {
            to - from
        } else {
            self.len() - from + to
        }
    }

    /// The first position of `block` at or after `from`, going round the cycle.
    pub fn next_position(&self, block: u32, from: u32) -> Option<u32> {
        let positions = self.positions(block);
        let after = positions.partition_point(|&p| p < from);
        positions.get(after).or(positions.first()).copied()
    }

    /// The last position of `block` before `before`, going round the cycle: where it
    /// was last used when the program is at `before`.
    pub fn prev_position(&self, block: u32, before: u32) -> Option<u32> {
        let positions = self.positions(block);
        let at = positions.partition_point(|&p| p < before);
        at.checked_sub(1)
            .and_then(|last| positions.get(last))
            .or(positions.last())
            .copied()
    }

    /// Steps from `from` until `block` is next used; `None` when it is not predicted.
    pub fn next_use(&self, block: u32, from: u32) -> Option<u32> {
        self.next_position(block, from)
            .map(|position| self.distance(from, position))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeats_are_merged_and_positions_indexed() {
        let order = CyclicOrder::from_sequence([3, 3, 1, 2, 1, 9, 3], 4);
        assert_eq!(order.sequence(), &[3, 1, 2, 1]);
        assert_eq!(order.positions(1), &[1, 3]);
        assert_eq!(order.positions(0), &[] as &[u32]);
        assert_eq!(order.positions(7), &[] as &[u32]);
    }

    #[test]
    fn next_use_goes_round_the_cycle() {
        let order = CyclicOrder::from_sequence([0, 1, 2, 1, 3], 4);
        assert_eq!(order.next_use(1, 0), Some(1));
        assert_eq!(order.next_use(1, 2), Some(1));
        assert_eq!(order.next_use(1, 4), Some(2));
        assert_eq!(order.next_use(0, 1), Some(4));
        assert_eq!(order.next_use(0, 0), Some(0));
        assert!(order.next_use(5, 0).is_none());
    }

    #[test]
    fn prev_position_goes_back_round_the_cycle() {
        let order = CyclicOrder::from_sequence([0, 1, 2, 1, 3], 4);
        assert_eq!(order.prev_position(1, 4), Some(3));
        assert_eq!(order.prev_position(1, 3), Some(1));
        assert_eq!(order.prev_position(1, 1), Some(3));
        assert_eq!(order.prev_position(3, 0), Some(4));
        assert_eq!(order.prev_position(0, 1), Some(0));
        assert!(order.prev_position(5, 2).is_none());
    }
}
