//! How often each expert of a mixture-of-experts model is used, learned from faults.
//!
//! A pager hears of an access only when it faults: an expert whose blocks are all
//! resident is used silently. Counting faults alone would therefore make the experts
//! kept resident look unused, and evict exactly the popular ones. Instead an expert's
//! use probability per token is estimated only over the tokens during which it could
//! have been seen, those it spent not wholly resident (its *exposure*):
//! `p = (misses + prior * weight) / (exposure + weight)`. For routing that does not
//! depend on what is resident (the router never sees the pager), that is an unbiased
//! estimate, and a resident expert keeps the estimate it had when it was read.
//!
//! Tokens are counted by the layers of the expert faults: a fault in a lower layer than
//! the previous one starts a new token. A token with no expert fault at all goes
//! uncounted, which only slows the learning (every exposure is short by the same
//! tokens).
//!
//! Pure bookkeeping over group and block numbers (see `graph::ExpertMap`).

use crate::graph::ExpertMap;

/// Tokens of prior belief: the prior counts as this many tokens of observation. A
/// weak prior ranks an expert seen once in its first token (p = 0.42 with 2 tokens of
/// 1/8) above the popular ones still being learned, and it keeps that rank while it
/// stays resident, since a resident expert's use is unseen. Measured on a 3 GiB
/// synthetic MoE (16 experts, 2 used), llama-bench tg10 - tg2, two alternating rounds:
/// 16 tokens read 331-334 MiB per token at 25 % against 374-386 with 2, and 109
/// against 141-143 at 50 %.
const PRIOR_TOKENS: f64 = 16.0;
/// When an expert's exposure reaches this many tokens, its counts are halved, so that
/// popularity that drifts (another prompt, another topic) is followed.
const HISTORY_TOKENS: f64 = 512.0;

#[derive(Debug, Clone, Default)]
struct GroupUse {
    /// Tokens in which the expert was seen used while not wholly resident.
    misses: f64,
    /// Completed stretches of exposure, in tokens.
    exposure: f64,
    /// The token since which the expert has not been wholly resident, if it is not.
    absent_since: Option<u64>,
    /// Its distinct blocks not resident now.
    missing_blocks: u32,
    /// The token (plus one) of its latest counted use; 0: none.
    last_use: u64,
}

/// Learned use probabilities of a model's experts.
#[derive(Debug, Clone, Default)]
pub struct ExpertUse {
    groups: Vec<GroupUse>,
    layers: Vec<u32>,
    prior: f64,
    token: u64,
    last_layer: Option<u32>,
}

impl ExpertUse {
    /// Every expert starts not resident, at the prior.
    pub fn new(map: &ExpertMap) -> Self {
        let groups = map
            .groups()
            .iter()
            .map(|group| {
                let mut blocks: Vec<u32> = group.blocks().collect();
                blocks.sort_unstable();
                blocks.dedup();
                GroupUse {
                    missing_blocks: blocks.len() as u32,
                    absent_since: Some(0),
                    ..GroupUse::default()
                }
            })
            .collect();
        Self {
            groups,
            layers: map.groups().iter().map(|group| group.layer).collect(),
            prior: map.prior_use(),
            token: 0,
            last_layer: None,
        }
    }

    /// Tokens counted so far.
    #[cfg(test)]
    pub fn tokens(&self) -> u64 {
        self.token
    }

    /// A fault in a block of `group`: the expert is in use in the current token. Calling
    /// it again for the same fault, or for another block of the expert in the same
    /// token, counts nothing more.
    pub fn used(&mut self, group: u32) {
        let Some(&layer) = self.layers.get(group as usize) else {
            return;
        };
        if self.last_layer.is_some_and(|last| layer < last) {
            self.token += 1;
        }
        self.last_layer = Some(layer);
        let token = self.token;
        let use_ = &mut self.groups[group as usize];
        if use_.last_use != token + 1 {
            use_.last_use = token + 1;
            use_.misses += 1.0;
            // The token of the use counts as exposure whatever happens next.
            if use_.absent_since.is_none() {
                use_.exposure += 1.0;
            }
        }
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

    /// One of `group`'s blocks became resident (`resident`) or stopped being resident.
    pub fn block_changed(&mut self, group: u32, resident: bool) {
        let token = self.token;
        let Some(use_) = self.groups.get_mut(group as usize) else {
            return;
        };
        if resident {
            use_.missing_blocks = use_.missing_blocks.saturating_sub(1);
            if use_.missing_blocks == 0 {
                if let Some(since) = use_.absent_since.take() {
                    // Exposure through the current token.
                    use_.exposure += (token + 1 - since) as f64;
                }
            }
        } else {
            use_.missing_blocks += 1;
            if use_.absent_since.is_none() {
                // From the next token: the current one was seen (resident) until now.
                use_.absent_since = Some(token + 1);
            }
        }
        if use_.exposure >= HISTORY_TOKENS {
            use_.exposure /= 2.0;
            use_.misses /= 2.0;
        }
    }

    /// The estimated probability that a token uses `group`.
    pub fn probability(&self, group: u32) -> f64 {
        let Some(use_) = self.groups.get(group as usize) else {
            return 0.0;
        };
        let open = use_
            .absent_since
            .map_or(0.0, |since| self.token.saturating_sub(since) as f64);
        let exposure = use_.exposure + open;
        ((use_.misses + self.prior * PRIOR_TOKENS) / (exposure + PRIOR_TOKENS)).min(1.0)
    }

    /// The probability that a token reads a block holding bytes of `groups`: that it
    /// uses at least one of them (independently, as an estimate).
    pub fn block_probability(&self, groups: &[u32]) -> f64 {
        1.0 - groups
            .iter()
            .map(|&group| 1.0 - self.probability(group))
            .product::<f64>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::{BlockLayout, ExpertSlice};

    /// Two layers of four experts, one block per expert, two used per token.
    fn map() -> ExpertMap {
        let layout = BlockLayout::new(0, 8 * 100, 100).unwrap();
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
        let mut use_ = ExpertUse::new(&map());
        assert!((use_.probability(0) - 0.5).abs() < 1e-9);
        use_.used(0);
        use_.used(4);
        use_.used(4);
        assert_eq!(use_.tokens(), 0);
        use_.used(1);
        assert_eq!(use_.tokens(), 1);
    }

    #[test]
    fn a_resident_expert_keeps_its_estimate_and_cold_ones_fall() {
        let mut use_ = ExpertUse::new(&map());
        // Expert 0 is used in token 0, read, and kept resident. Then for 100 tokens
        // layer 0 uses expert 3 (never resident) and layer 1 expert 4.
        use_.used(0);
        use_.block_changed(0, true);
        let kept = use_.probability(0);
        for _ in 0..100 {
            use_.used(3);
            use_.used(4);
        }
        assert_eq!(use_.tokens(), 99);
        assert!(
            (use_.probability(0) - kept).abs() < 1e-9,
            "resident: unseen, unchanged"
        );
        assert!(use_.probability(1) < 0.1, "exposed and never used");
        assert!(use_.probability(3) > 0.9, "exposed and used every token");
    }

    #[test]
    fn evicted_experts_are_exposed_again_from_the_next_token() {
        let mut use_ = ExpertUse::new(&map());
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
}
