//! How often each expert of a mixture-of-experts model is used, learned from faults.
//!
//! A pager hears of an access only when it faults. An expert with a block missing faults
//! when it is used; an expert wholly resident is used silently, unless the pager watches
//! one of its blocks (`EvictionPolicy::watch`: its next access faults without a read).
//! So an expert is *observable* while it is not wholly resident or while it is watched,
//! and its use probability per token is estimated over the tokens it was observable in
//! (its *exposure*): `p = (uses + prior * weight) / (exposure + weight)`. For routing
//! that does not depend on what is resident (the router never sees the pager) that is an
//! unbiased estimate whatever share of the tokens is observed. Without watching, a
//! resident expert keeps the estimate it had when it was read, however rarely it is used
//! since; with it, every resident expert watched from one token to the next is counted
//! exactly.
//!
//! What eviction ranks by (`probability`) is not that long-run estimate but the chance
//! the next token uses the expert, mixed per layer from recency and frequency as the
//! run's own outcomes reward (`UseMixture`): each token closes with every observed
//! expert's outcome. The long-run counts are what a run saves for the next.
//!
//! Tokens are counted by the layers of the expert faults: a fault in a lower layer than
//! the previous one starts a new token. A token with no expert fault at all goes
//! uncounted, which only slows the learning (every exposure is short by the same
//! tokens).
//!
//! Pure bookkeeping over group and block numbers (see `graph::ExpertMap`).

use super::co_activation::{CoActivation, CoActivationSummary, Pair};
use super::use_mixture::UseMixture;
use crate::graph::ExpertMap;

/// Tokens of prior belief: the prior counts as this many tokens of observation. A
/// weak prior ranks an expert seen once in its first token above the popular ones still
/// being learned; a strong one takes long to leave. Measured on a 3 GiB synthetic MoE
/// (16 experts, 2 used), llama-bench tg10 - tg2, two alternating rounds, before resident
/// experts were watched: 16 tokens read 331-334 MiB per token at 25 % against 374-386
/// with 2, and 109 against 141-143 at 50 %. With watching, the simulator on the
/// synthetic MoE workloads reads within 3 % for any weight from 1 to 64 tokens.
#[cfg(test)]
const PRIOR_TOKENS: f64 = 16.0;
/// When an expert's exposure reaches this many tokens, its counts are halved, so that
/// popularity that drifts (another prompt, another topic) is followed.
const HISTORY_TOKENS: f64 = 512.0;
/// Counts from an earlier run weigh at most this many tokens: enough to rank the
/// experts from the first token, little enough for this run's routing to take over.
const SEED_TOKENS: f64 = 128.0;

#[derive(Debug, Clone, Default)]
struct GroupUse {
    /// Tokens in which the expert was seen used.
    uses: f64,
    /// Tokens counted as observed, in closed stretches (see `exposed_until`).
    exposure: f64,
    /// Tokens before this one are counted in `exposure` where they were observed; none
    /// at or after it is. Keeps a token from being counted twice.
    exposed_until: u64,
    /// The first token of the stretch the expert has been observable in, if it is.
    observable_from: Option<u64>,
    /// Its distinct blocks not resident now.
    missing_blocks: u32,
    /// A block of it is watched: its next use faults.
    watched: bool,
    /// The token (plus one) of its latest counted use; 0: none.
    last_use: u64,
}

impl GroupUse {
    fn observable(&self) -> bool {
        self.missing_blocks > 0 || self.watched
    }

    /// Counts tokens `from..end` as observed (those not counted yet).
    fn expose(&mut self, from: u64, end: u64) {
        let start = from.max(self.exposed_until);
        if end > start {
            self.exposure += (end - start) as f64;
            self.exposed_until = end;
        }
    }

    fn forget_old_history(&mut self) {
        if self.exposure >= HISTORY_TOKENS {
            self.exposure /= 2.0;
            self.uses /= 2.0;
        }
    }
}

/// Learned use probabilities of a model's experts.
#[derive(Debug, Clone, Default)]
pub struct ExpertUse {
    groups: Vec<GroupUse>,
    layers: Vec<u32>,
    token: u64,
    last_layer: Option<u32>,
    /// Which experts of the next layer the current token is likely to use.
    co: CoActivation,
    /// The next token's use of each expert, from recency and frequency as each layer's
    /// routing has shown them (`probability`).
    mixture: UseMixture,
}

impl ExpertUse {
    /// Every expert starts not resident (observable), at the prior. `routed` tells the
    /// blocks that hold routed experts only: a block an expert shares with a tensor every
    /// token reads is resident or not with that tensor, and says nothing of the expert.
    pub fn new(map: &ExpertMap, routed: impl Fn(u32) -> bool) -> Self {
        let groups = map
            .groups()
            .iter()
            .map(|group| {
                let mut blocks: Vec<u32> = group.blocks().filter(|&block| routed(block)).collect();
                blocks.sort_unstable();
                blocks.dedup();
                GroupUse {
                    missing_blocks: blocks.len() as u32,
                    observable_from: Some(0),
                    ..GroupUse::default()
                }
            })
            .collect();
        let layers: Vec<u32> = map.groups().iter().map(|group| group.layer).collect();
        Self {
            groups,
            co: CoActivation::new(&layers),
            mixture: UseMixture::new(&layers, map.prior_use()),
            layers,
            token: 0,
            last_layer: None,
        }
    }

    /// Tokens counted so far.
    pub fn tokens(&self) -> u64 {
        self.token
    }

    /// Per expert: the tokens it was seen used in and the tokens it was observed over,
    /// the current stretch counted through the last completed token (what
    /// `probability` weighs, without the prior).
    pub fn counts(&self) -> impl Iterator<Item = (u32, f64, f64)> + '_ {
        self.groups
            .iter()
            .enumerate()
            .map(|(group, use_)| (group as u32, use_.uses, self.observed(use_)))
    }

    /// Starts `group` from what an earlier run counted (`uses` in `tokens`), weighed as
    /// at most `SEED_TOKENS` tokens.
    pub fn seed(&mut self, group: u32, uses: f64, tokens: f64) {
        let Some(use_) = self.groups.get_mut(group as usize) else {
            return;
        };
        if !(tokens > 0.0 && (0.0..=tokens).contains(&uses)) {
            return;
        }
        let scale = (SEED_TOKENS / tokens).min(1.0);
        use_.uses = uses * scale;
        use_.exposure = tokens * scale;
        self.mixture.seed(group, uses * scale, tokens * scale);
    }

    /// The layer of the latest expert fault: where the program is.
    pub fn current_layer(&self) -> Option<u32> {
        self.last_layer
    }

    pub fn layer(&self, group: u32) -> Option<u32> {
        self.layers.get(group as usize).copied()
    }

    /// A fault in a block of `group`: the expert is in use in the current token. Calling
    /// it again for the same fault, or for another block of the expert in the same
    /// token, counts nothing more.
    pub fn used(&mut self, group: u32) {
        let Some(&layer) = self.layers.get(group as usize) else {
            return;
        };
        if self.last_layer.is_some_and(|last| layer < last) {
            self.close_token();
            self.token += 1;
        }
        self.last_layer = Some(layer);
        let token = self.token;
        let use_ = &mut self.groups[group as usize];
        if use_.last_use != token + 1 {
            use_.last_use = token + 1;
            use_.uses += 1.0;
            // A token in which the use was seen was observed, whatever the state.
            let in_stretch = use_.observable_from.is_some_and(|from| from <= token);
            if !in_stretch {
                use_.expose(token, token + 1);
            }
            use_.forget_old_history();
            let mut co = std::mem::take(&mut self.co);
            co.used(token, group, &|group| self.probability(group), &|group| {
                self.groups
                    .get(group as usize)
                    .is_some_and(GroupUse::observable)
            });
            self.co = co;
        }
    }

    /// The current token ends: every expert observed through it (used in it, or
    /// observable since before it) tells the mixture whether it ran.
    fn close_token(&mut self) {
        let token = self.token;
        let outcomes = self.groups.iter().enumerate().filter_map(|(group, use_)| {
            let used = use_.last_use == token + 1;
            let observed = used
                || (use_.observable() && use_.observable_from.is_some_and(|from| from <= token));
            observed.then_some((group as u32, used))
        });
        self.mixture.close_token(outcomes);
    }

    /// The probability that the current token uses `group` before it ends: from the
    /// experts it used in the layer it is in (`CoActivation`) for the next layer, where
    /// that has been paying; else the expert's popularity (`probability`).
    pub fn this_token_probability(&self, group: u32) -> f64 {
        self.co
            .this_token(group, self.token, &|group| self.probability(group))
            .unwrap_or_else(|| self.probability(group))
    }

    /// `block_probability` for the rest of the current token.
    pub fn this_token_block_probability(&self, groups: &[u32]) -> f64 {
        any_of(groups, |group| self.this_token_probability(group))
    }

    /// The experts of the next layer to read before the router asks for them
    /// (`CoActivation::speculate`): likely, not wholly resident, not being read.
    pub fn speculate(&mut self) -> Vec<u32> {
        let mut co = std::mem::take(&mut self.co);
        let chosen = co.speculate(self.token, &|group| self.probability(group), &|group| {
            !self.wholly_resident(group) && !self.reading_now(group)
        });
        self.co = co;
        chosen
    }

    /// How well co-activation has predicted the next layer's experts.
    pub fn co_activation(&self) -> CoActivationSummary {
        self.co.summary()
    }

    /// The co-activation counts: every pair of experts of consecutive layers seen used
    /// in one token (`pair_basis`: the tokens each was counted over as the first).
    pub fn pairs(&self) -> impl Iterator<Item = Pair> + '_ {
        self.co.pairs()
    }

    pub fn pair_basis(&self, group: u32) -> f64 {
        self.co.basis(group)
    }

    /// Starts `group`'s co-activation counts from an earlier run's (see
    /// `CoActivation::seed`).
    pub fn seed_pairs(&mut self, group: u32, basis: f64, pairs: &[(u32, f64)]) {
        self.co.seed(group, basis, pairs);
    }

    /// Whether `group` was seen in use in the current token.
    pub fn used_now(&self, group: u32) -> bool {
        self.groups
            .get(group as usize)
            .is_some_and(|use_| use_.last_use == self.token + 1)
    }

    /// Whether `group` is being read now: used in the current token, in the layer of the
    /// latest expert fault. Its blocks are needed until the program leaves the layer.
    pub fn reading_now(&self, group: u32) -> bool {
        self.used_now(group) && self.layers.get(group as usize).copied() == self.last_layer
    }

    /// Whether every block of `group` is resident.
    pub fn wholly_resident(&self, group: u32) -> bool {
        self.groups
            .get(group as usize)
            .is_some_and(|use_| use_.missing_blocks == 0)
    }

    /// Whether a block of `group` is watched.
    pub fn watched(&self, group: u32) -> bool {
        self.groups
            .get(group as usize)
            .is_some_and(|use_| use_.watched)
    }

    /// One of `group`'s blocks became resident (`resident`) or stopped being resident.
    pub fn block_changed(&mut self, group: u32, resident: bool) {
        // Read because a fault showed it in use (counted) or ahead of its use; either
        // way the current token is as observed as it will be.
        self.change(group, true, |use_| {
            if resident {
                use_.missing_blocks = use_.missing_blocks.saturating_sub(1);
            } else {
                use_.missing_blocks += 1;
            }
        });
    }

    /// A block of `group` is watched from now (`true`), or no longer (`false`).
    /// `seen_through_now`: whether the current token is fully observed when the watch
    /// ends: its fault showed this group in use, or its layer had passed. A watch taken
    /// by another group's use of a block they share leaves this group's use in the rest
    /// of the token unseen.
    pub fn set_watched(&mut self, group: u32, watched: bool, seen_through_now: bool) {
        self.change(group, seen_through_now, |use_| use_.watched = watched);
    }

    /// Applies `change` to `group` and opens or closes its stretch of observability.
    /// A stretch opens from the next token: this one may have passed the layer. It
    /// closes through the current token when `seen_through_now`, else before it.
    fn change(&mut self, group: u32, seen_through_now: bool, change: impl FnOnce(&mut GroupUse)) {
        let token = self.token;
        let Some(use_) = self.groups.get_mut(group as usize) else {
            return;
        };
        let before = use_.observable();
        change(use_);
        match (before, use_.observable()) {
            (false, true) => use_.observable_from = Some(token + 1),
            (true, false) => {
                if let Some(from) = use_.observable_from.take() {
                    let end = if seen_through_now { token + 1 } else { token };
                    use_.expose(from, end);
                }
            }
            _ => {}
        }
        use_.forget_old_history();
    }

    /// Whether `group` has been seen in use: in a token of this run, or in the counts an
    /// earlier run saved (`seed`). Halving old history never takes a use to zero.
    pub fn seen_used(&self, group: u32) -> bool {
        self.groups
            .get(group as usize)
            .is_some_and(|use_| use_.uses > 0.0)
    }

    /// Tokens since `group` was last seen used (0: in the current one); `u64::MAX`
    /// if never in this run.
    pub fn tokens_since_use(&self, group: u32) -> u64 {
        match self.groups.get(group as usize) {
            Some(use_) if use_.last_use > 0 => self.token + 1 - use_.last_use,
            _ => u64::MAX,
        }
    }

    /// The estimated probability that the next token uses `group`: recency and
    /// frequency mixed as the layer's routing has rewarded (`UseMixture`).
    pub fn probability(&self, group: u32) -> f64 {
        self.mixture.probability(group)
    }

    /// The weight `probability` has learned to give recency, mean over layers
    /// (`UseMixture::recency_weight`).
    pub fn recency_weight(&self) -> f64 {
        self.mixture.recency_weight()
    }

    /// The long-run estimate of how often a token uses `group` (its uses over the
    /// tokens it was observed in, with the prior): what a run saves for the next, and
    /// what the tests check the counting by.
    #[cfg(test)]
    pub fn popularity(&self, group: u32) -> f64 {
        let Some(use_) = self.groups.get(group as usize) else {
            return 0.0;
        };
        let exposure = self.observed(use_);
        ((use_.uses + self.mixture.prior() * PRIOR_TOKENS) / (exposure + PRIOR_TOKENS)).min(1.0)
    }

    /// Tokens `use_` was observed over: its closed stretches, the completed tokens of
    /// its open one, and the current token if a use in it was seen (a use is counted at
    /// once; the token it was seen in cannot be one it went unused).
    fn observed(&self, use_: &GroupUse) -> f64 {
        let open = use_.observable_from.map_or(0, |from| {
            let start = from.max(use_.exposed_until);
            let through = self.token + u64::from(use_.last_use == self.token + 1);
            through.saturating_sub(start)
        });
        use_.exposure + open as f64
    }

    /// The probability that a token reads a block holding bytes of `groups`: that it
    /// uses at least one of them (independently, as an estimate).
    pub fn block_probability(&self, groups: &[u32]) -> f64 {
        any_of(groups, |group| self.probability(group))
    }
}

/// The probability that at least one of `groups` is used, each with `probability`,
/// independently.
fn any_of(groups: &[u32], probability: impl Fn(u32) -> f64) -> f64 {
    1.0 - groups
        .iter()
        .map(|&group| 1.0 - probability(group))
        .product::<f64>()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::BlockGeometry;
    use crate::graph::ExpertSlice;

    /// Two layers of four experts, one block per expert, two used per token.
    fn map() -> ExpertMap {
        let layout = BlockGeometry::new(0, 8 * 100, 100).unwrap();
        let slices: Vec<ExpertSlice> = (0..8)
            .map(|i| ExpertSlice {
                layer: i / 4,
                expert: i % 4,
                file_range: i as u64 * 100..(i as u64 + 1) * 100,
                anchor: 0,
            })
            .collect();
        ExpertMap::new(&slices, &layout).with_used_per_token(Some(2))
    }

    #[test]
    fn starts_at_the_prior_and_counts_tokens_by_layer() {
        let mut use_ = ExpertUse::new(&map(), |_| true);
        assert!((use_.probability(0) - 0.5).abs() < 1e-9);
        use_.used(0);
        use_.used(4);
        use_.used(4);
        assert_eq!(use_.tokens(), 0);
        assert_eq!(use_.current_layer(), Some(1));
        use_.used(1);
        assert_eq!(use_.tokens(), 1);
    }

    #[test]
    fn a_resident_unwatched_expert_keeps_its_estimate_and_cold_ones_fall() {
        let mut use_ = ExpertUse::new(&map(), |_| true);
        // Expert 0 is used in token 0, read, and kept resident. Then for 100 tokens
        // layer 0 uses expert 3 (never resident) and layer 1 expert 4.
        use_.used(0);
        use_.block_changed(0, true);
        let kept = use_.popularity(0);
        for _ in 0..100 {
            use_.used(3);
            use_.used(4);
        }
        assert_eq!(use_.tokens(), 99);
        assert!(
            (use_.popularity(0) - kept).abs() < 1e-9,
            "resident: unseen, unchanged"
        );
        assert!(use_.probability(1) < 0.1, "exposed and never used");
        assert!(use_.probability(3) > 0.9, "exposed and used every token");
    }

    #[test]
    fn counts_from_an_earlier_run_start_the_estimate_and_export_again() {
        let mut use_ = ExpertUse::new(&map(), |_| true);
        use_.seed(0, 900.0, 1000.0);
        use_.seed(1, 0.0, 1000.0);
        use_.seed(2, 5.0, 4.0); // impossible: ignored
        assert!(use_.probability(0) > 0.8, "{}", use_.probability(0));
        assert!(use_.probability(1) < 0.1, "{}", use_.probability(1));
        assert!((use_.probability(2) - 0.5).abs() < 1e-9, "the prior");
        let counts: Vec<(u32, f64, f64)> = use_.counts().collect();
        assert_eq!(counts[0], (0, 900.0 * 0.128, 128.0));
        // Experts never resident are observed from the start: 3 tokens counted.
        for _ in 0..4 {
            use_.used(3);
            use_.used(4);
        }
        let counts: Vec<(u32, f64, f64)> = use_.counts().collect();
        assert_eq!(counts[3], (3, 4.0, 4.0), "used in each of 4 tokens");
        assert_eq!(counts[5], (5, 0.0, 3.0), "3 completed tokens, unused");
    }

    #[test]
    fn the_tokens_since_an_expert_ran_count_from_its_last_seen_use() {
        let mut use_ = ExpertUse::new(&map(), |_| true);
        assert_eq!(use_.tokens_since_use(0), u64::MAX, "never ran");
        use_.used(0);
        use_.used(4);
        assert_eq!(use_.tokens_since_use(0), 0, "in the current token");
        for _ in 0..3 {
            use_.used(1);
            use_.used(4);
        }
        assert_eq!(use_.tokens_since_use(0), 3);
        assert_eq!(use_.tokens_since_use(1), 0);
        assert_eq!(use_.tokens_since_use(99), u64::MAX, "no such expert");
    }

    #[test]
    fn evicted_experts_are_exposed_again_from_the_next_token() {
        let mut use_ = ExpertUse::new(&map(), |_| true);
        use_.used(0);
        use_.block_changed(0, true);
        use_.block_changed(0, false);
        for _ in 0..8 {
            use_.used(1);
            use_.used(5);
        }
        // Used again once, in one of the 8 tokens since it went.
        use_.used(0);
        let p = use_.probability(0);
        assert!(p < 0.5 && p > 0.1, "{p}");
        assert!(use_.block_probability(&[0, 1]) > use_.probability(1));
    }

    /// One token: layer 0 uses expert 3 (never resident) and `kept`, layer 1 expert 4; a
    /// watched expert whose use faults is watched again once the program has left its
    /// layer, as the graph eviction policy does.
    fn token(use_: &mut ExpertUse, kept: Option<u32>) {
        use_.used(3);
        if let Some(group) = kept {
            use_.used(group);
            if use_.watched(group) {
                use_.set_watched(group, false, true);
            }
        }
        use_.used(4);
        if let Some(group) = kept {
            if use_.wholly_resident(group) {
                use_.set_watched(group, true, true);
            }
        }
    }

    /// Experts 0 and 1 of layer 0 used in token 0, read, kept and watched once the
    /// program reached layer 1 (expert 4).
    fn two_watched() -> ExpertUse {
        let mut use_ = ExpertUse::new(&map(), |_| true);
        for group in [0, 1] {
            use_.used(group);
            use_.block_changed(group, true);
            use_.set_watched(group, true, true);
        }
        use_.used(4);
        use_
    }

    #[test]
    fn a_watched_resident_expert_is_counted_exactly() {
        let mut use_ = two_watched();
        // 100 tokens: expert 0 used in every other one, expert 1 never.
        for i in 0..100 {
            token(&mut use_, (i % 2 == 0).then_some(0));
        }
        let (p0, p1) = (use_.probability(0), use_.probability(1));
        assert!((p0 - 0.5).abs() < 0.08, "{p0}");
        assert!(p1 < 0.15, "{p1}");
    }

    #[test]
    fn a_watch_lost_to_a_neighbour_does_not_count_the_token_unused() {
        let mut use_ = two_watched();
        let before = use_.popularity(1);
        // For 50 tokens a block both share fires for expert 0: expert 1's watch goes
        // before its use could be seen, and is taken again after the layer.
        for _ in 0..50 {
            use_.used(0);
            use_.set_watched(0, false, true);
            use_.set_watched(1, false, false);
            use_.used(4);
            use_.set_watched(0, true, true);
            use_.set_watched(1, true, true);
        }
        assert!(
            (use_.popularity(1) - before).abs() < 0.05,
            "unseen tokens moved the estimate: {before} -> {}",
            use_.popularity(1)
        );
        assert!(use_.probability(0) > 0.85, "{}", use_.probability(0));
    }
}
