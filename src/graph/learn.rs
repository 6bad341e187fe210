//! Learning the access order from a trace of faulted blocks, with no model knowledge:
//! any file format, any program. Transitions between consecutive faults become weighted
//! edges; a greedy walk along the heaviest edges turns them back into a cyclic order.

use std::collections::{BTreeMap, BTreeSet};

/// Counted transitions between consecutively faulted blocks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Transitions {
    counts: BTreeMap<(u32, u32), u64>,
    /// Blocks seen, including ones with no transition (a trace of one fault).
    seen: BTreeSet<u32>,
    last: Option<u32>,
}

/// How far back the walk looks for a successor when the current block has no unvisited
/// one: a block whose successors were all taken often shares one with its predecessors
/// (two forward streams interleaving over one tensor).
const LOOK_BACK: usize = 8;

impl Transitions {
    pub fn new() -> Self {
        Self::default()
    }

    /// Records a fault on `block`. A repeated fault on the same block (threads racing
    /// on it) is not a transition.
    pub fn observe(&mut self, block: u32) {
        self.seen.insert(block);
        if let Some(last) = self.last.replace(block) {
            if last != block {
                *self.counts.entry((last, block)).or_insert(0) += 1;
            }
        }
    }

    pub fn observe_all(&mut self, blocks: impl IntoIterator<Item = u32>) {
        blocks.into_iter().for_each(|b| self.observe(b));
    }

    /// Adds a counted edge directly (loading a saved graph, merging runs).
    pub fn add_edge(&mut self, from: u32, to: u32, count: u64) {
        self.seen.insert(from);
        self.seen.insert(to);
        if from != to && count > 0 {
            *self.counts.entry((from, to)).or_insert(0) += count;
        }
    }

    /// Ends the current sequence: the next fault starts a new one (a new run).
    pub fn break_sequence(&mut self) {
        self.last = None;
    }

    pub fn blocks(&self) -> impl Iterator<Item = u32> + '_ {
        self.seen.iter().copied()
    }

    /// `(from, to, count)` in ascending `(from, to)` order.
    pub fn edges(&self) -> impl Iterator<Item = (u32, u32, u64)> + '_ {
        self.counts.iter().map(|(&(a, b), &c)| (a, b, c))
    }

    pub fn is_empty(&self) -> bool {
        self.seen.is_empty()
    }

    /// The predicted cyclic order: every seen block once. A greedy walk follows the
    /// heaviest edge to an unvisited block (ties to the lower block index); when there is
    /// none it tries the successors of the last few blocks walked, then jumps to the
    /// heaviest unvisited block. The walk starts at the heaviest block, which for a cycle
    /// is as good a start as any: the order is cyclic. Deterministic, and a function of
    /// the counts only, so a saved graph reproduces it.
    pub fn cyclic_order(&self) -> Vec<u32> {
        let blocks: Vec<u32> = self.seen.iter().copied().collect();
        let index_of = |block: u32| blocks.binary_search(&block).ok();
        let mut successors: Vec<Vec<(u64, u32)>> = vec![Vec::new(); blocks.len()];
        let mut weight = vec![0u64; blocks.len()];
        for (&(a, b), &count) in &self.counts {
            if let (Some(ia), Some(ib)) = (index_of(a), index_of(b)) {
                successors[ia].push((count, b));
                weight[ia] += count;
                weight[ib] += count;
            }
        }
        for list in &mut successors {
            // Heaviest first, then lower block.
            list.sort_by(|x, y| y.0.cmp(&x.0).then(x.1.cmp(&y.1)));
        }
        let mut by_weight: Vec<usize> = (0..blocks.len()).collect();
        by_weight.sort_by(|&x, &y| weight[y].cmp(&weight[x]).then(x.cmp(&y)));

        let mut visited = vec![false; blocks.len()];
        let mut order: Vec<u32> = Vec::with_capacity(blocks.len());
        let mut next_heavy = 0;
        let mut current = by_weight.first().copied();
        while let Some(at) = current {
            visited[at] = true;
            order.push(blocks[at]);
            let unvisited_successor = |from: usize| {
                successors[from]
                    .iter()
                    .filter_map(|&(_, b)| index_of(b))
                    .find(|&i| !visited[i])
            };
            current = order
                .iter()
                .rev()
                .take(LOOK_BACK)
                .filter_map(|&b| index_of(b))
                .find_map(unvisited_successor)
                .or_else(|| {
                    while next_heavy < by_weight.len() && visited[by_weight[next_heavy]] {
                        next_heavy += 1;
                    }
                    by_weight.get(next_heavy).copied()
                });
        }
        order
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rotate_to(order: &[u32], first: u32) -> Vec<u32> {
        let at = order.iter().position(|&b| b == first).unwrap();
        order[at..].iter().chain(&order[..at]).copied().collect()
    }

    #[test]
    fn a_repeated_scan_is_learned_as_its_cycle() {
        let pass = [5, 9, 1, 7, 3, 2];
        let mut transitions = Transitions::new();
        transitions.observe_all(pass.iter().chain(&pass).chain(&pass).copied());
        assert_eq!(rotate_to(&transitions.cyclic_order(), 5), pass);
        assert_eq!(transitions.edges().count(), pass.len());
    }

    #[test]
    fn side_branches_are_kept_and_the_main_cycle_wins() {
        // Each pass starts with a different "embedding row" block (100 + token).
        let body = [10, 11, 12, 13, 14];
        let mut transitions = Transitions::new();
        for token in 0..3 {
            transitions.observe(100 + token);
            transitions.observe_all(body);
        }
        let order = transitions.cyclic_order();
        assert_eq!(order.len(), body.len() + 3);
        let main: Vec<u32> = rotate_to(&order, 10)
            .into_iter()
            .filter(|&b| b < 100)
            .collect();
        assert_eq!(main, body);
        let at10 = order.iter().position(|&b| b == 10).unwrap();
        let consecutive = order
            .windows(2)
            .filter(|w| body.windows(2).any(|p| p == *w));
        assert_eq!(consecutive.count(), body.len() - 1, "{order:?} {at10}");
    }

    #[test]
    fn repeats_are_not_transitions_and_empty_is_empty() {
        let mut transitions = Transitions::new();
        assert!(transitions.cyclic_order().is_empty());
        transitions.observe_all([4, 4, 4]);
        assert_eq!(transitions.edges().count(), 0);
        assert_eq!(transitions.cyclic_order(), vec![4]);
    }
}
