//! The cache tier's eviction order for model objects: by the model's pass, not by
//! recency.
//!
//! A decode reads the whole model once per token, in the graph's order
//! (`model_pass::ModelPass`). With a cache smaller than the model, least-recently-used
//! drops exactly the block the next pass needs first, so every pass fetches the whole
//! model again. This order keeps a fixed set instead: the blocks the pass uses first
//! (its prefix) stay, and the blocks used later stream through one slot each, so a pass
//! fetches about `model - cache` (plus the read-ahead window), the same stretch every
//! pass. The set is a function of the pass alone, so it is the same in every mount of
//! the cache directory.
//!
//! A tier above the cache (the pager's RAM budget, the page cache) keeps some of the
//! model too, and never asks for those blocks again: a block the program has not read
//! for two passes' worth of reads is held there, and keeping it here is a block less
//! of the model held by the two tiers together. So such a block goes first, and the
//! cache holds the first blocks of the pass among those the program does read: a pass
//! fetches about `model - (tier above) - cache`.
//!
//! Ranks, lowest evicted first:
//! 1. blocks of objects without a pass (not models), model blocks outside the pass, and
//!    those not read for two passes' worth of reads, least recently used first;
//! 2. blocks of the pass, the one first used latest in it first;
//! 3. blocks read within the last `recent` reads (`spare_recent`), the longest ago
//!    first: a tier above that reads ahead drops some of what it read before using it
//!    and asks for it again a few reads later; dropped here as the latest of the pass,
//!    each would be fetched twice. Sparing them keeps about `recent` blocks of the pass
//!    fewer, so it is done only while more reads than that, a pass, are such second
//!    reads (a program reading straight through the pass makes none);
//! 4. the header's blocks (read by every program that opens the model);
//! 5. the blocks the pass uses within `window` positions after the latest read (what
//!    the mount reads ahead, in the pass's order: dropping them would fetch them twice),
//!    the furthest first.
//!
//! Pure: the mount tells it which blocks are read (`used`); nothing here blocks or does
//! I/O beyond a mutex.

use std::collections::HashMap;
use std::sync::Mutex;

use super::eviction::{take_victims, Candidate, EvictionOrder};
use super::model_pass::ModelPass;

const PASS: u64 = 1 << 62;
const HEADER: u64 = 2 << 62;
const NEAR: u64 = 3 << 62;
const RECENT: u64 = HEADER - 1;

struct Tracked {
    pass: ModelPass,
    /// The position of the latest read, `None` before the first.
    cursor: Option<u32>,
    /// Reads so far (a read of the block read just before is not a new one).
    reads: u64,
    /// Per block: the value of `reads` after its latest read; 0 if not read in this
    /// mount.
    last_read: Vec<u64>,
    last_block: Option<u64>,
    /// Reads of a block read within the last `recent` reads before them that the pass
    /// did not foretell (`next_in_pass`), in the pass's worth of reads going on and in
    /// the one before it.
    rereads: [u64; 2],
}

impl Tracked {
    /// Reads since `block`'s latest read (0: it was the latest); `None` if it was not
    /// read in this mount.
    fn reads_since(&self, block: u64) -> Option<u64> {
        match self.last_read.get(block as usize).copied().unwrap_or(0) {
            0 => None,
            last => Some(self.reads - last),
        }
    }

    /// Whether the pass uses `block` within `window` positions after the latest read
    /// (a block it uses twice in a row, the rank `NEAR` keeps).
    fn next_in_pass(&self, block: u64, window: u32) -> bool {
        let Some(cursor) = self.cursor else {
            return false;
        };
        let from = (cursor + 1) % self.pass.len();
        self.pass
            .next_position(block, from)
            .is_some_and(|next| self.pass.order().distance(from, next) < window)
    }

    /// Whether the tier above reads blocks again soon after it read them, more of them
    /// a pass than sparing them for `recent` reads costs (about `recent` blocks of the
    /// pass kept fewer).
    fn rereads_soon(&self, recent: u64) -> bool {
        recent > 0 && self.rereads[0].max(self.rereads[1]) > recent
    }

    /// Whether `block` was not read in the last two passes' worth of reads (a pass is
    /// its positions: a block shared by two tensors is read at each; two, for the
    /// threads reading one step back and forth): a tier above the cache holds it.
    fn held_above(&self, block: u64, window: u32) -> bool {
        let last = self.last_read.get(block as usize).copied().unwrap_or(0);
        self.reads - last > 2 * u64::from(self.pass.len()) + u64::from(window)
    }
}

/// The graph's eviction order for the objects given a pass, least recently used for
/// the others.
pub struct GraphOrder {
    window: u32,
    /// Blocks read within this many reads are kept over the pass's.
    recent: u64,
    models: Mutex<HashMap<usize, Tracked>>,
}

impl GraphOrder {
    /// An order that spares the blocks used within `window` positions after each read.
    pub fn new(window: u32) -> Self {
        Self {
            window,
            recent: 0,
            models: Mutex::new(HashMap::new()),
        }
    }

    /// Also spares the blocks read within the last `reads` reads, while the program
    /// reads more blocks again that soon, a pass, than sparing them costs.
    pub fn spare_recent(mut self, reads: u64) -> Self {
        self.recent = reads;
        self
    }

    /// Object `object` (the cache's number) is a model read in `pass`.
    pub fn add_model(&self, object: usize, pass: ModelPass) {
        crate::lock::lock(&self.models).insert(
            object,
            Tracked {
                last_read: vec![0; pass.blocks() as usize],
                pass,
                cursor: None,
                reads: 0,
                last_block: None,
                rereads: [0; 2],
            },
        );
    }

    pub fn has_model(&self, object: usize) -> bool {
        crate::lock::lock(&self.models).contains_key(&object)
    }

    /// A program read block `block` of `object`: the cursor moves to that block's
    /// occurrence nearest at or after it (a block outside the pass leaves it, and so
    /// does a second read within `recent` reads that the pass did not foretell: the
    /// program has not gone back, and the read-ahead must not either).
    pub fn used(&self, object: usize, block: u64) {
        let mut models = crate::lock::lock(&self.models);
        let Some(tracked) = models.get_mut(&object) else {
            return;
        };
        // Two reads of one block in a row are one (a read split in pieces).
        if tracked.last_block == Some(block) {
            return;
        }
        let reread = tracked
            .reads_since(block)
            .is_some_and(|ago| ago < self.recent)
            && !tracked.next_in_pass(block, self.window);
        if reread {
            tracked.rereads[0] += 1;
        }
        tracked.reads += 1;
        if tracked.reads % u64::from(tracked.pass.len()) == 0 {
            tracked.rereads = [0, tracked.rereads[0]];
        }
        tracked.last_block = Some(block);
        if let Some(slot) = tracked.last_read.get_mut(block as usize) {
            *slot = tracked.reads;
        }
        if reread {
            return;
        }
        if let Some(position) = tracked
            .pass
            .next_position(block, tracked.cursor.unwrap_or(0))
        {
            tracked.cursor = Some(position);
        }
    }

    /// The next `count` distinct blocks of `object`'s pass after the latest read, in
    /// the order the pass uses them; `None` for an object without a pass (or before
    /// its first read).
    pub fn ahead(&self, object: usize, count: usize) -> Option<Vec<u64>> {
        let models = crate::lock::lock(&self.models);
        let tracked = models.get(&object)?;
        Some(tracked.pass.ahead(tracked.cursor?, count))
    }

    fn rank_in(&self, models: &HashMap<usize, Tracked>, candidate: &Candidate) -> u64 {
        let recency = candidate.tick.min(PASS - 1);
        let Some(tracked) = models.get(&candidate.object) else {
            return recency;
        };
        let pass = &tracked.pass;
        if let Some(cursor) = tracked.cursor {
            let from = (cursor + 1) % pass.len();
            if let Some(next) = pass.next_position(candidate.block, from) {
                let distance = pass.order().distance(from, next);
                if distance < self.window {
                    return NEAR + u64::from(self.window - distance);
                }
            }
        }
        if pass.is_header(candidate.block) {
            return HEADER;
        }
        if tracked.held_above(candidate.block, self.window) {
            return recency;
        }
        if tracked.rereads_soon(self.recent) {
            if let Some(ago) = tracked.reads_since(candidate.block) {
                if ago < self.recent {
                    return RECENT - ago;
                }
            }
        }
        match pass.first_position(candidate.block) {
            Some(first) => PASS + u64::from(pass.len() - first),
            None => recency,
        }
    }
}

impl EvictionOrder for GraphOrder {
    fn rank(&self, candidate: &Candidate) -> u64 {
        self.rank_in(&crate::lock::lock(&self.models), candidate)
    }

    fn victims(&self, candidates: &[Candidate], need: u64) -> Vec<Candidate> {
        if need == 0 {
            return Vec::new();
        }
        let models = crate::lock::lock(&self.models);
        let mut ranked: Vec<(u64, Candidate)> = candidates
            .iter()
            .map(|c| (self.rank_in(&models, c), *c))
            .collect();
        ranked.sort_by_key(|(rank, c)| (*rank, c.object, c.block));
        take_victims(ranked.into_iter().map(|(_, c)| c), need)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::super::eviction::Lru;
    use super::*;
    use crate::graph::CyclicOrder;

    /// A cache of `capacity` equal blocks under `order`, read by a program that goes
    /// through `sequence` `passes` times, each read followed by a read-ahead of the next
    /// `readahead` blocks of the pass (as the mount does). Returns the blocks fetched in
    /// each pass.
    fn simulate(
        order: &dyn EvictionOrder,
        graph: Option<&GraphOrder>,
        sequence: &[u32],
        capacity: usize,
        readahead: usize,
        passes: usize,
    ) -> Vec<u64> {
        simulate_below(order, graph, sequence, capacity, readahead, passes, 0)
    }

    /// `simulate` below a tier that holds blocks `0..above` after the first pass (the
    /// program reads the others only, as under a pager's budget).
    fn simulate_below(
        order: &dyn EvictionOrder,
        graph: Option<&GraphOrder>,
        sequence: &[u32],
        capacity: usize,
        readahead: usize,
        passes: usize,
        above: usize,
    ) -> Vec<u64> {
        let pass = ModelPass::new(
            CyclicOrder::from_sequence(sequence.iter().copied(), 1 << 20),
            u64::from(*sequence.iter().max().unwrap()) + 1,
            0,
        )
        .unwrap();
        let mut resident: BTreeMap<u64, u64> = BTreeMap::new();
        let mut tick = 0u64;
        let mut fetched = Vec::new();
        for round in 0..passes {
            let mut count = 0;
            let held = if round == 0 { 0 } else { above as u32 };
            for &block in sequence.iter().filter(|&&b| b >= held) {
                let block = u64::from(block);
                if let Some(graph) = graph {
                    graph.used(0, block);
                }
                let ahead = match graph.and_then(|g| g.ahead(0, readahead)) {
                    Some(ahead) => ahead,
                    None => {
                        let at = pass.next_position(block, 0).unwrap();
                        pass.ahead(at, readahead)
                    }
                };
                for wanted in std::iter::once(block).chain(ahead) {
                    tick += 1;
                    if let Some(last) = resident.get_mut(&wanted) {
                        if wanted == block {
                            *last = tick;
                        }
                        continue;
                    }
                    count += 1;
                    if resident.len() >= capacity {
                        let candidates: Vec<Candidate> = resident
                            .iter()
                            .map(|(&block, &tick)| Candidate {
                                object: 0,
                                block,
                                tick,
                                bytes: 1,
                            })
                            .collect();
                        for victim in order.victims(&candidates, 1) {
                            resident.remove(&victim.block);
                        }
                    }
                    resident.insert(wanted, tick);
                }
            }
            fetched.push(count);
        }
        fetched
    }

    /// `blocks` with every third one followed by a second read of the one before it.
    fn revisiting(blocks: Vec<u32>) -> Vec<u32> {
        let mut out = Vec::new();
        for (i, &block) in blocks.iter().enumerate() {
            out.push(block);
            if i % 3 == 2 {
                out.push(blocks[i - 1]);
            }
        }
        out
    }

    fn graph_for(sequence: &[u32], window: u32, header_blocks: u64) -> GraphOrder {
        let order = GraphOrder::new(window);
        let blocks = u64::from(*sequence.iter().max().unwrap()) + 1;
        let pass = ModelPass::new(
            CyclicOrder::from_sequence(sequence.iter().copied(), blocks as u32),
            blocks,
            header_blocks,
        )
        .unwrap();
        order.add_model(0, pass);
        order
    }

    #[test]
    fn a_cyclic_pass_fetches_model_minus_cache_not_the_whole_model() {
        // 200 blocks read in an order unlike the file's, some at two positions (a block
        // shared by two tensors), a cache of half of them.
        let sequence = revisiting((0..200u32).map(|i| (i * 7) % 200).collect());
        let (capacity, readahead) = (100, 4);
        let graph = graph_for(&sequence, readahead as u32 + 2, 0);
        let by_graph = simulate(&graph, Some(&graph), &sequence, capacity, readahead, 4);
        let by_lru = simulate(&Lru, None, &sequence, capacity, readahead, 4);
        assert_eq!(by_graph[0], 200);
        let over = (200 - capacity) as f64;
        for &pass in &by_graph[1..] {
            assert!(pass as f64 <= 1.1 * over, "graph: {by_graph:?}");
        }
        // Least recently used fetches everything every pass.
        assert!(by_lru[1..].iter().all(|&p| p == 200), "lru: {by_lru:?}");
    }

    #[test]
    fn blocks_a_tier_above_holds_give_way_to_those_it_reads() {
        // 400 blocks; after the first pass a pager keeps the first 100 in RAM and reads
        // the other 300 each pass; the cache holds 200: a pass then fetches about
        // 400 - 100 - 200, not 300 - 200 + 100 (the pager's blocks kept twice).
        let sequence = revisiting((0..400).collect());
        let graph = graph_for(&sequence, 6, 0);
        let fetched = simulate_below(&graph, Some(&graph), &sequence, 200, 4, 8, 100);
        // The pager's blocks are dropped once unread for two passes' worth of reads.
        for &pass in &fetched[4..] {
            assert!(pass <= 110, "{fetched:?}");
        }
        assert!(fetched[4..].windows(2).all(|w| w[0] == w[1]), "{fetched:?}");
    }

    #[test]
    fn blocks_read_again_soon_after_are_kept_for_it() {
        // A pager that reads ahead, evicts some of it before use and reads it again a
        // few reads later: 300 blocks, every fifth read followed by the block read six
        // reads before, a cache of 150.
        let mut sequence = Vec::new();
        for i in 0..300u32 {
            sequence.push(i);
            if i % 5 == 4 && i >= 6 {
                sequence.push(i - 6);
            }
        }
        // The model's pass has each block once: the second reads are the pager's.
        let model: Vec<u32> = (0..300).collect();
        let passes = |recent: u64| {
            let graph = graph_for(&model, 6, 0).spare_recent(recent);
            simulate(&graph, Some(&graph), &sequence, 150, 4, 5)
        };
        let (without, with) = (passes(0), passes(12));
        // Without: such a block, among the latest of the pass, goes first when the
        // read-ahead needs room, and is fetched again; and the read-ahead goes back
        // with the cursor to fetch what was just read (424 a pass here). Kept for 12
        // reads, they hit, for at most 12 fewer blocks of the pass kept (166).
        assert!(with[0] == 300 && without[0] > 300, "{without:?} {with:?}");
        for pass in 1..5 {
            assert!(without[pass] >= 150 + 59, "{without:?} {with:?}");
            assert!(with[pass] <= 150 + 12 + 6, "{without:?} {with:?}");
        }
    }

    #[test]
    fn a_second_read_soon_after_leaves_the_read_ahead_where_it_was() {
        let model: Vec<u32> = (0..20).collect();
        let read = |order: &GraphOrder| {
            for block in (0..10).chain([6]) {
                order.used(0, block);
            }
            order.ahead(0, 2)
        };
        assert_eq!(
            read(&graph_for(&model, 2, 0).spare_recent(8)),
            Some(vec![10, 11])
        );
        // Without it the cursor goes back to block 6.
        assert_eq!(read(&graph_for(&model, 2, 0)), Some(vec![7, 8]));
    }

    #[test]
    fn a_program_that_reads_nothing_again_soon_keeps_the_whole_cache_for_the_pass() {
        let sequence = revisiting((0..200u32).map(|i| (i * 7) % 200).collect());
        let passes = |recent: u64| {
            let graph = graph_for(&sequence, 6, 0).spare_recent(recent);
            simulate(&graph, Some(&graph), &sequence, 100, 4, 4)
        };
        assert_eq!(passes(0), passes(12));
    }

    #[test]
    fn the_kept_set_is_the_same_every_pass() {
        let sequence: Vec<u32> = (0..60).collect();
        let graph = graph_for(&sequence, 3, 0);
        let by_graph = simulate(&graph, Some(&graph), &sequence, 30, 1, 6);
        // Once the cache has filled, every pass fetches the same number of blocks.
        assert!(
            by_graph[1..].windows(2).all(|w| w[0] == w[1]),
            "{by_graph:?}"
        );
        assert!(by_graph[1] <= 30 + 3, "{by_graph:?}");
    }

    #[test]
    fn ranks_follow_the_pass_the_header_and_the_window() {
        // The pass 5, 3, 1, 2, 0 over blocks 0..6: block 4 is outside it.
        let order = GraphOrder::new(2);
        let pass = ModelPass::new(CyclicOrder::from_sequence([5, 3, 1, 2, 0], 6), 6, 0).unwrap();
        order.add_model(7, pass);
        let c = |object, block, tick| Candidate {
            object,
            block,
            tick,
            bytes: 10,
        };
        // Before any read: the latest first-used goes first; another object's
        // blocks (least recently used) before any of the model's.
        let victims = order.victims(&[c(7, 3, 1), c(7, 0, 2), c(1, 0, 9), c(7, 4, 5)], 25);
        assert_eq!(victims, [c(7, 4, 5), c(1, 0, 9), c(7, 0, 2)]);
        // After a read of block 3 (position 1), blocks 1 and 2 are next: kept last.
        order.used(7, 3);
        assert_eq!(order.ahead(7, 2), Some(vec![1, 2]));
        let victims = order.victims(&[c(7, 1, 1), c(7, 2, 1), c(7, 3, 1), c(7, 0, 1)], 30);
        assert_eq!(victims, [c(7, 0, 1), c(7, 3, 1), c(7, 2, 1)]);
        assert_eq!(order.ahead(1, 2), None);
        assert!(order.has_model(7) && !order.has_model(1));
    }

    #[test]
    fn header_blocks_outlast_the_pass() {
        let order = GraphOrder::new(1);
        let pass = ModelPass::new(CyclicOrder::from_sequence([1, 2, 3], 4), 4, 1).unwrap();
        order.add_model(0, pass);
        let c = |block| Candidate {
            object: 0,
            block,
            tick: 1,
            bytes: 1,
        };
        assert_eq!(order.victims(&[c(0), c(1), c(3)], 2), [c(3), c(1)]);
    }
}
