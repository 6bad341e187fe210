//! The resident blocks of the model that the predicted order does not place (the
//! embedding table, of which each token reads a row or two): how often each is used, and
//! which goes first.
//!
//! Such a block is used when the text holds a token whose row it stores, so it is
//! ranked as an expert is, by its uses per token: its expected next use is the start of
//! the next pass, then a pass more for every `1/p`. A pager hears of a use only when it
//! faults, and a block that stays resident is read once however often the program
//! comes back to it; counted by reads alone, a hot row's estimate falls while it is
//! resident until it is evicted and read again (on gpt-oss-20b's shape at 50 %, 512
//! tokens, the embedding was read 2.2x what Belady reads, 1.5x what LRU does). Where
//! the pager can watch resident blocks, each resident unplaced block is watched: its
//! next use costs one fault without a read and is counted, at most once a pass, and
//! the watch is taken again.
//!
//! Pure bookkeeping over block numbers; the pass clock is `Progress::travelled`.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::hash::Hash;

/// The prior's weight: tokens of one such block a token spread evenly over them, so
/// that the first reads of a uniform table do not rank its blocks apart.
const PRIOR_TOKENS: f64 = 16.0;

/// Generic over the block's name (`B`: the policy's `BlockRef`), so that this
/// bookkeeping knows nothing of the policy around it.
pub(super) struct UnplacedBlocks<B> {
    /// Tracked (resident, evictable) unplaced blocks, with their block of the graph.
    tracked: BTreeMap<B, u32>,
    /// Per graph block ever used: its uses, the pass of the latest, and where the
    /// program was along the order (`Progress::travelled`) at the first.
    uses: HashMap<u32, Uses>,
    /// The use per token each block is given before its uses.
    prior: f64,
    /// Positions of the order in a pass (at least 1): `Progress::travelled` over it is
    /// the pass the program is in.
    pass: u64,
    /// Whether watches are asked for: the pager honours them, and the model does not
    /// fit the budget (`set_watching`).
    watching: bool,
    /// Tracked blocks to watch again, with the pass they were last used in: watched
    /// from the next pass on. A use reads a row, or a whole block while the program
    /// loads, page by page; watched again at once, each page would fault, where one
    /// use a pass is all that is counted.
    pending: HashMap<B, u64>,
    /// Tracked blocks watched now.
    watched: HashSet<B>,
}

#[derive(Clone, Copy)]
struct Uses {
    count: u32,
    last_pass: u64,
    first_travelled: u64,
}

impl<B: Copy + Ord + Hash> UnplacedBlocks<B> {
    /// `blocks`: how many blocks of the graph the order does not place and no expert
    /// holds (the prior gives each a use per token of one over that); `pass`: the
    /// order's length in positions.
    pub(super) fn new(blocks: usize, pass: u64) -> Self {
        Self {
            tracked: BTreeMap::new(),
            uses: HashMap::new(),
            prior: 1.0 / blocks.max(1) as f64,
            pass: pass.max(1),
            watching: false,
            pending: HashMap::new(),
            watched: HashSet::new(),
        }
    }

    /// The pass the program is in, `travelled` positions along the order.
    fn pass_of(&self, travelled: u64) -> u64 {
        travelled / self.pass
    }

    /// `block` (the graph's `global`) was read and is resident and evictable: a use,
    /// with the program `travelled` positions along the order.
    pub(super) fn insert(&mut self, block: B, global: u32, travelled: u64) {
        self.tracked.insert(block, global);
        self.count_use(global, travelled);
        if self.watching {
            self.pending.insert(block, self.pass_of(travelled));
        }
    }

    /// Whether to ask for watches from now, with the program `travelled` positions along
    /// the order. Turned on, every tracked block is watched from the
    /// next pass: one resident since before is as hot as its uses, which only a watch
    /// shows.
    pub(super) fn set_watching(&mut self, watching: bool, travelled: u64) {
        if watching && !self.watching {
            let this_pass = self.pass_of(travelled);
            for &block in self.tracked.keys() {
                if !self.watched.contains(&block) {
                    self.pending.insert(block, this_pass);
                }
            }
        }
        self.watching = watching;
    }

    /// `block` is no longer resident or evictable (a watch on it goes with it). False
    /// if it was not tracked here.
    pub(super) fn remove(&mut self, block: B) -> bool {
        self.watched.remove(&block);
        self.tracked.remove(&block).is_some()
    }

    /// A fault on `block`: if it was watched, a use (counted once a pass), and it is
    /// watched again from the next pass.
    pub(super) fn fault(&mut self, block: B, travelled: u64) {
        if !self.watched.remove(&block) {
            return;
        }
        if let Some(&global) = self.tracked.get(&block) {
            self.count_use(global, travelled);
            self.pending.insert(block, self.pass_of(travelled));
        }
    }

    fn count_use(&mut self, global: u32, travelled: u64) {
        let this_pass = self.pass_of(travelled);
        let uses = self.uses.entry(global).or_insert(Uses {
            count: 0,
            last_pass: u64::MAX,
            first_travelled: travelled,
        });
        if uses.last_pass != this_pass {
            uses.last_pass = this_pass;
            uses.count = uses.count.saturating_add(1);
        }
    }

    /// Appends the blocks to watch now, with the program `travelled` positions along the
    /// order: the tracked ones used since they were last watched, in a pass before this
    /// one.
    pub(super) fn watch(&mut self, out: &mut Vec<B>, travelled: u64) {
        if !self.watching {
            self.pending.clear();
            return;
        }
        let this_pass = self.pass_of(travelled);
        let (tracked, watched) = (&self.tracked, &mut self.watched);
        self.pending.retain(|&block, &mut used_in| {
            if used_in >= this_pass {
                return tracked.contains_key(&block);
            }
            if tracked.contains_key(&block) && watched.insert(block) {
                out.push(block);
            }
            false
        });
    }

    pub(super) fn is_empty(&self) -> bool {
        self.tracked.is_empty()
    }

    /// The tracked block expected to be used furthest ahead, with that expectation in
    /// positions of the order: `to_next_pass`, then a pass more for every `1/p`, `p` its
    /// uses per token since its first (with the prior).
    pub(super) fn furthest(&self, travelled: u64, to_next_pass: f64) -> Option<(B, f64)> {
        let pass = self.pass as f64;
        let mut furthest: Option<(B, f64)> = None;
        for (&block, global) in &self.tracked {
            // Every tracked block was counted when it was inserted.
            let Some(uses) = self.uses.get(global) else {
                continue;
            };
            let tokens = travelled.saturating_sub(uses.first_travelled) as f64 / pass;
            let p = ((f64::from(uses.count) + self.prior * PRIOR_TOKENS)
                / (tokens + 1.0 + PRIOR_TOKENS))
                .clamp(1e-6, 1.0);
            let expected = to_next_pass + pass * (1.0 - p) / p;
            if furthest.is_none_or(|(_, known)| expected > known) {
                furthest = Some((block, expected));
            }
        }
        furthest
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PASS: u64 = 10;

    fn b(index: u32) -> (u32, u32) {
        (0, index)
    }

    /// What `watch` asks for with the program `travelled` positions along.
    fn watched(unplaced: &mut UnplacedBlocks<(u32, u32)>, travelled: u64) -> Vec<(u32, u32)> {
        let mut out = Vec::new();
        unplaced.watch(&mut out, travelled);
        out
    }

    #[test]
    fn a_resident_block_used_every_pass_outlasts_one_read_once_when_watched() {
        let mut unplaced = UnplacedBlocks::new(100, PASS);
        unplaced.set_watching(true, 0);
        // Block 1 is read in pass 0 and used in each of the 19 passes after it,
        // resident throughout; block 2 is read in pass 19 and not used since.
        unplaced.insert(b(1), 1, 0);
        assert!(watched(&mut unplaced, 1).is_empty(), "read in this pass");
        for pass in 1..20 {
            assert_eq!(watched(&mut unplaced, pass * PASS), [b(1)]);
            unplaced.fault(b(1), pass * PASS + 1);
            // The rest of this pass's use (the row's other pages) does not fault: the
            // block is watched again only from the next pass.
            assert!(watched(&mut unplaced, pass * PASS + 2).is_empty());
            unplaced.fault(b(1), pass * PASS + 3);
        }
        unplaced.insert(b(2), 2, 19 * PASS);
        assert_eq!(unplaced.uses[&1].count, 20);
        let (victim, _) = unplaced.furthest(20 * PASS, 0.0).unwrap();
        assert_eq!(victim, b(2));
    }

    #[test]
    fn without_watching_a_resident_blocks_estimate_falls_with_time() {
        let mut unplaced = UnplacedBlocks::new(100, PASS);
        unplaced.insert(b(1), 1, 0);
        assert!(
            watched(&mut unplaced, 5 * PASS).is_empty(),
            "not asked to watch"
        );
        unplaced.fault(b(1), 5 * PASS);
        unplaced.insert(b(2), 2, 19 * PASS);
        // Read once each: the older read goes first.
        let (victim, _) = unplaced.furthest(20 * PASS, 0.0).unwrap();
        assert_eq!(victim, b(1));
    }

    #[test]
    fn blocks_resident_when_watching_starts_are_watched_from_the_next_pass() {
        let mut unplaced = UnplacedBlocks::new(100, PASS);
        unplaced.insert(b(1), 1, 0);
        unplaced.insert(b(2), 2, 0);
        assert!(watched(&mut unplaced, 2 * PASS).is_empty(), "not watching");
        // The budget falls below the model in pass 2: both are watched from pass 3.
        unplaced.set_watching(true, 2 * PASS + 5);
        assert!(watched(&mut unplaced, 2 * PASS + 6).is_empty());
        let mut both = watched(&mut unplaced, 3 * PASS);
        both.sort_unstable();
        assert_eq!(both, [b(1), b(2)]);
        // Turned on again while on: nothing watched twice.
        unplaced.set_watching(true, 3 * PASS);
        assert!(watched(&mut unplaced, 4 * PASS).is_empty());
    }

    #[test]
    fn a_removed_block_is_neither_watched_nor_ranked() {
        let mut unplaced = UnplacedBlocks::new(100, PASS);
        unplaced.set_watching(true, 0);
        unplaced.insert(b(1), 1, 0);
        assert!(unplaced.remove(b(1)));
        assert!(!unplaced.remove(b(1)));
        assert!(watched(&mut unplaced, PASS).is_empty());
        assert!(unplaced.is_empty());
        assert!(unplaced.furthest(PASS, 0.0).is_none());
        // Read again: its earlier use still counts.
        unplaced.insert(b(1), 1, 3 * PASS);
        assert_eq!(unplaced.uses[&1].count, 2);
        assert_eq!(watched(&mut unplaced, 4 * PASS), [b(1)]);
    }
}
