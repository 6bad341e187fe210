//! Learning the access order from a trace of faulted blocks, with no model knowledge:
//! any file format, any program. Transitions between consecutive faults become weighted
//! edges; an Eulerian trail along them turns them back into a cyclic order.

use std::collections::{BTreeMap, BTreeSet};

/// Counted transitions between consecutively faulted blocks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Transitions {
    counts: BTreeMap<(u32, u32), u64>,
    /// Counted `(before, block, after)` steps: which way the trace left a block given
    /// how it entered it. A block shared by two places of a pass (the boundary of two
    /// tensors that do not run back to back) is entered and left differently at each.
    contexts: BTreeMap<(u32, u32, u32), u64>,
    before_last: Option<u32>,
    /// Blocks seen, including ones with no transition (a trace of one fault).
    seen: BTreeSet<u32>,
    last: Option<u32>,
}

impl Transitions {
    pub fn new() -> Self {
        Self::default()
    }

    /// Records a fault on `block`. A repeated fault on the same block (threads racing
    /// on it) is not a transition.
    pub fn observe(&mut self, block: u32) {
        self.seen.insert(block);
        match self.last {
            Some(last) if last == block => {}
            Some(last) => {
                *self.counts.entry((last, block)).or_insert(0) += 1;
                if let Some(before) = self.before_last {
                    *self.contexts.entry((before, last, block)).or_insert(0) += 1;
                }
                self.before_last = Some(last);
                self.last = Some(block);
            }
            None => self.last = Some(block),
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

    /// Adds a counted `(before, block, after)` step directly (loading a saved graph).
    pub fn add_context(&mut self, before: u32, block: u32, after: u32, count: u64) {
        if count > 0 {
            *self.contexts.entry((before, block, after)).or_insert(0) += count;
        }
    }

    /// `(before, block, after, count)` in ascending order.
    pub fn contexts(&self) -> impl Iterator<Item = (u32, u32, u32, u64)> + '_ {
        self.contexts.iter().map(|(&(a, b, c), &n)| (a, b, c, n))
    }

    /// Ends the current sequence: the next fault starts a new one (a new run).
    pub fn break_sequence(&mut self) {
        self.last = None;
        self.before_last = None;
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

    /// The count of the typical transition: the median over transitions observed (each
    /// edge weighted by its count), which for a repeated pass is the number of passes.
    fn typical_count(&self) -> u64 {
        let mut weights: Vec<u64> = self.counts.values().copied().collect();
        weights.sort_unstable();
        let total: u64 = weights.iter().sum();
        let mut seen = 0;
        for weight in weights {
            seen += weight;
            if 2 * seen >= total {
                return weight.max(1);
            }
        }
        1
    }

    /// The predicted cyclic order: one pass, in which a block may occur several times.
    ///
    /// The counts are turned into per-pass multiplicities (divided by the typical count,
    /// which is the number of passes observed); edges seen in at most half
    /// of the passes are noise (the embedding row a token happened to read) and dropped.
    /// An Eulerian trail over the rest (Hierholzer's algorithm) is the pass; at each block
    /// it takes the edge the trace most often took after the same previous block, then
    /// the heaviest. So a block shared by two places of the pass is left the way it was
    /// entered each time, which a walk visiting each block once, or choosing by edge
    /// weight alone, gets wrong. Edges left over (a graph that is not one trail) start further trails,
    /// appended in turn, and blocks on no kept edge come last. Deterministic, and a
    /// function of the counts only, so a saved graph reproduces it.
    pub fn cyclic_order(&self) -> Vec<u32> {
        let mut edges = TrailEdges::kept(&self.counts, self.typical_count());
        let mut order: Vec<u32> = Vec::new();
        let mut placed: BTreeSet<u32> = BTreeSet::new();
        while let Some(start) = edges.trail_start() {
            let trail = edges.walk(start, &self.contexts);
            placed.extend(trail.iter().copied());
            order.extend(trail);
        }
        order.extend(self.seen.iter().copied().filter(|b| !placed.contains(b)));
        order
    }
}

/// The edges `cyclic_order` walks: those kept for one pass, each as many times as it is
/// taken per pass, minus those walked already.
struct TrailEdges {
    /// Successors as (remaining multiplicity, count, target), heaviest first.
    successors: BTreeMap<u32, Vec<(u64, u64, u32)>>,
    /// Per block: the multiplicities of the edges left leaving it, less those entering.
    balance: BTreeMap<u32, i64>,
}

impl TrailEdges {
    /// The transitions of `counts` seen in more than half of `passes` passes, each
    /// taken its count divided by the passes (rounded, at least once) per pass.
    fn kept(counts: &BTreeMap<(u32, u32), u64>, passes: u64) -> Self {
        let mut successors: BTreeMap<u32, Vec<(u64, u64, u32)>> = BTreeMap::new();
        let mut balance: BTreeMap<u32, i64> = BTreeMap::new();
        for (&(from, to), &count) in counts {
            if 2 * count <= passes {
                continue;
            }
            let multiplicity = ((count + passes / 2) / passes).max(1);
            successors
                .entry(from)
                .or_default()
                .push((multiplicity, count, to));
            *balance.entry(from).or_default() += multiplicity as i64;
            *balance.entry(to).or_default() -= multiplicity as i64;
        }
        for list in successors.values_mut() {
            list.sort_by(|x, y| y.1.cmp(&x.1).then(x.2.cmp(&y.2)));
        }
        Self {
            successors,
            balance,
        }
    }

    /// Where the next trail starts: where more leaves than enters; a closed one
    /// anywhere: at the heaviest block with edges left (lowest index on ties). `None`
    /// once every edge is walked.
    fn trail_start(&self) -> Option<u32> {
        let out_weight = |list: &Vec<(u64, u64, u32)>| list.iter().map(|e| e.1).sum::<u64>();
        let remaining = |node: &u32| {
            self.successors
                .get(node)
                .is_some_and(|l| l.iter().any(|e| e.0 > 0))
        };
        self.balance
            .iter()
            .filter(|(node, &b)| b > 0 && remaining(node))
            .map(|(&node, _)| node)
            .next()
            .or_else(|| {
                self.successors
                    .iter()
                    .filter(|(node, _)| remaining(node))
                    .max_by(|a, b| out_weight(a.1).cmp(&out_weight(b.1)).then(b.0.cmp(a.0)))
                    .map(|(&node, _)| node)
            })
    }

    /// Walks a trail from `start` (Hierholzer's algorithm), using up its edges: at each
    /// block the edge the trace (`contexts`) most often took after the block the walk
    /// came from, then the heaviest. A closed trail is returned without its return to
    /// `start`: the pass wraps there by itself.
    fn walk(&mut self, start: u32, contexts: &BTreeMap<(u32, u32, u32), u64>) -> Vec<u32> {
        let mut stack = vec![start];
        let mut trail = Vec::new();
        while let Some(&node) = stack.last() {
            // Leave the block the way the trace most often left it when entered from
            // where the walk came from, then by the heaviest edge.
            let before = stack.len().checked_sub(2).map(|i| stack[i]);
            let context =
                |to: u32| before.map_or(0, |b| contexts.get(&(b, node, to)).copied().unwrap_or(0));
            let next = self
                .successors
                .get_mut(&node)
                .and_then(|list| {
                    list.iter_mut().filter(|e| e.0 > 0).max_by(|x, y| {
                        (context(x.2), x.1)
                            .cmp(&(context(y.2), y.1))
                            .then(y.2.cmp(&x.2))
                    })
                })
                .map(|edge| {
                    edge.0 -= 1;
                    edge.2
                });
            match next {
                Some(to) => {
                    *self.balance.entry(node).or_default() -= 1;
                    *self.balance.entry(to).or_default() += 1;
                    stack.push(to);
                }
                None => trail.extend(stack.pop()),
            }
        }
        trail.reverse();
        // A closed trail ends where it began: the pass wraps there by itself.
        if trail.len() > 1 && trail.first() == trail.last() {
            trail.pop();
        }
        trail
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
    fn a_block_used_twice_per_pass_is_left_the_way_it_was_entered() {
        // Block 7 is used after 2 and again after 5: a figure of eight.
        let pass = [1, 7, 2, 3, 4, 5, 7, 6];
        let mut transitions = Transitions::new();
        for _ in 0..3 {
            transitions.observe_all(pass);
        }
        let order = transitions.cyclic_order();
        assert_eq!(rotate_to(&order, 1), pass);
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
