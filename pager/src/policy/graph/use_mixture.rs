//! The chance that the next token runs an expert, learned online per layer as a
//! mixture of recency and frequency.
//!
//! Routers differ in what predicts the next token's experts. Where picks are drawn
//! independently from a fixed popularity, the long-run frequency is the best estimate
//! and any recency only adds noise. Real routers repeat experts from token to token
//! and their popularity drifts with the topic (issue 41's published curves: LRU beats
//! LFU at every cache size), so what ran in the last few tokens tells more. The chance
//! of a use there is additive: a chance to repeat what just ran, plus a drifting
//! popularity.
//!
//! Design, after LRFU: LRFU weighs each past use by `2^(-age/H)` and ranks by the sum,
//! one `H` spanning LRU (small) to LFU (large), fixed in advance. Here a bank of such
//! decayed-frequency estimators with half-lives from 1 to 512 observed tokens each
//! predicts the next token's use, and per layer their predictions are mixed with
//! weights learned online by exponentiated gradient on the log-loss of every observed
//! outcome (each expert observed through a token: used or not). The mixture can be a
//! single memory (LFU-like on independent routing, LRU-like on strongly sticky routing)
//! or a blend of a short and a long one, which is what sticky picks over a drifting
//! popularity are. ARC and 2Q adapt the split of one list of equal pages between a
//! recency and a frequency part; the graph eviction compares expert blocks with dense
//! blocks of other sizes by their expected next use (`Progress::expected_next_use`),
//! so it needs a probability, not a list position. A fixed share of every weight stays
//! with each memory, so a change of routing is followed within tokens.
//!
//! The mixture learns from this run only: an earlier run's saved counts start the long
//! memories (`seed`), and the first tokens' outcomes outweigh them within a few tokens.
//!
//! Pure arithmetic over group numbers; `ExpertUse` decides which groups were observed.

/// The half-lives of the decayed-frequency memories, in tokens of observation.
const HALF_LIVES: [f64; MEMORIES] = [1.0, 4.0, 16.0, 128.0, 4096.0];
const MEMORIES: usize = 5;
/// The predictors mixed: the memories, then the age table (`AgeTable`).
const PREDICTORS: usize = MEMORIES + 1;
/// Age buckets: tokens since the expert last ran in half-octaves (1, 2, 3, 4-5, 6-7,
/// 8-11, ...), the last for 1024 and more, and one for never seen run.
const AGE_BUCKETS: usize = 22;
/// The age table forgets half its counts over this many tokens, so a change of routing
/// is followed.
const AGE_HALF_LIFE: f64 = 128.0;
/// Each memory's prior, in tokens at the prior use probability: a quarter of its
/// half-life, from half a token (the shortest memory still tells a token that just ran
/// the expert from one that did not) to 16 (a long memory does not rank an expert seen
/// once in its first token above the popular ones still being learned).
fn prior_tokens(half_life: f64) -> f64 {
    (half_life / 4.0).clamp(0.5, 16.0)
}
/// Step of the exponentiated gradient per token: a token's outcomes (one per observed
/// expert of the layer) are averaged into one step. The log-losses of memories that
/// rank experts alike differ little, so a small step leaves weight on a noisy memory
/// for hundreds of tokens.
const LEARNING_RATE: f64 = 4.0;
/// The share of the mixture spread evenly over the memories after every step (fixed
/// share): no memory's weight falls so low that it cannot come back within tokens.
/// Every memory keeps at least `FIXED_SHARE / PREDICTORS` (under a thousandth); with
/// `LEARNING_RATE` a memory that starts predicting better takes the lead within tens
/// of tokens.
///
/// Measured with the simulator's synthetic suite (coarse, fine and qwen3-like shapes,
/// independent and locality routing, 25/50/75 %, 512 tokens, seeds 11, 23, 37):
/// against a step of 2 and a share of 0.02, a step of 4 and a share of 0.005 read
/// less on 39 of the 54 rows (by up to 5.5 %), the same on 9 and at most 0.8 % more on
/// 6; the largest gains where recency and frequency compete (coarse locality at 75 %:
/// 5.5 down to 5.2 MiB per token on seed 11, 1.155x LRU to 1.093x).
const FIXED_SHARE: f64 = 0.005;
/// The weights before any outcome: mostly the longest memory, the estimate that is
/// right where routing carries nothing from token to token; recency earns its weight
/// from the run's outcomes (on sticky routing within tens of tokens).
const INITIAL_WEIGHTS: [f64; PREDICTORS] = [0.05, 0.05, 0.1, 0.2, 0.55, 0.05];
/// Predictions are kept this far from 0 and 1, so one surprise costs a bounded loss.
const CLAMP: f64 = 1e-3;

/// One expert's decayed counts in each memory.
#[derive(Debug, Clone, Copy, Default)]
struct Counts {
    uses: [f64; MEMORIES],
    exposure: [f64; MEMORIES],
}

/// Per layer, how often an expert of each age (tokens since it last ran) runs in the
/// next token: LRU's ranking, with the chance each rank has had. Pure recency, as
/// LHD's hit probability by age.
#[derive(Debug, Clone, Copy, Default)]
struct AgeTable {
    runs: [f64; AGE_BUCKETS],
    seen: [f64; AGE_BUCKETS],
}

/// See the module documentation.
#[derive(Debug, Clone, Default)]
pub(super) struct UseMixture {
    counts: Vec<Counts>,
    /// Per group, the token (counted by `close_token`) it last ran in.
    last_ran: Vec<Option<u64>>,
    /// Tokens closed so far.
    tokens: u64,
    /// Per group, its layer's slot in `weights` and `ages`.
    slot: Vec<usize>,
    /// Per layer, the mixture's weights (summing to 1).
    weights: Vec<[f64; PREDICTORS]>,
    ages: Vec<AgeTable>,
    /// Per group, `mixed` as of the last change: every input to it changes only in
    /// `close_token` and `seed`, while eviction asks for it for every resident expert
    /// block on every victim it picks.
    probabilities: Vec<f64>,
    /// Per memory, the factor a token of observation keeps of the counts.
    keep: [f64; MEMORIES],
    /// Per memory, the prior's weight in tokens.
    prior_weight: [f64; MEMORIES],
    prior: f64,
}

impl UseMixture {
    /// `layers`: each group's layer; `prior`: the use probability before any
    /// observation (experts used per token over the layer's experts).
    pub(super) fn new(layers: &[u32], prior: f64) -> Self {
        let mut distinct: Vec<u32> = layers.to_vec();
        distinct.sort_unstable();
        distinct.dedup();
        let slot = layers
            .iter()
            .map(|layer| distinct.binary_search(layer).unwrap_or(0))
            .collect();
        Self {
            counts: vec![Counts::default(); layers.len()],
            last_ran: vec![None; layers.len()],
            tokens: 0,
            slot,
            weights: vec![INITIAL_WEIGHTS; distinct.len()],
            ages: vec![AgeTable::default(); distinct.len()],
            // Before any observation every predictor says the prior.
            probabilities: vec![prior.clamp(0.0, 1.0); layers.len()],
            keep: HALF_LIVES.map(|half_life| 0.5f64.powf(1.0 / half_life)),
            prior_weight: HALF_LIVES.map(prior_tokens),
            prior,
        }
    }

    /// Each predictor's estimate of the chance the next token uses `group`.
    fn predictions(&self, group: u32) -> [f64; PREDICTORS] {
        let (Some(counts), Some(&slot)) = (
            self.counts.get(group as usize),
            self.slot.get(group as usize),
        ) else {
            return [0.0; PREDICTORS];
        };
        let ages = &self.ages[slot];
        let bucket = self.age_bucket(group);
        std::array::from_fn(|m| {
            if m < MEMORIES {
                let weight = self.prior_weight[m];
                (counts.uses[m] + self.prior * weight) / (counts.exposure[m] + weight)
            } else {
                (ages.runs[bucket] + self.prior) / (ages.seen[bucket] + 1.0)
            }
        })
    }

    /// `group`'s age bucket: tokens since it last ran, in powers of two.
    fn age_bucket(&self, group: u32) -> usize {
        match self.last_ran.get(group as usize).copied().flatten() {
            Some(token) => {
                let age = (self.tokens - token).max(1);
                let octave = age.ilog2();
                // The half of the octave: the bit below the leading one.
                let upper = octave > 0 && (age >> (octave - 1)) & 1 == 1;
                (2 * octave as usize + usize::from(upper)).min(AGE_BUCKETS - 2)
            }
            None => AGE_BUCKETS - 1,
        }
    }

    /// The mixture's estimate of the chance the next token uses `group`.
    pub(super) fn probability(&self, group: u32) -> f64 {
        self.probabilities
            .get(group as usize)
            .copied()
            .unwrap_or(0.0)
    }

    /// The mixed estimate from the current weights and counts.
    fn mixed(&self, group: u32) -> f64 {
        let Some(&slot) = self.slot.get(group as usize) else {
            return 0.0;
        };
        let weights = &self.weights[slot];
        let predictions = self.predictions(group);
        (0..PREDICTORS)
            .map(|m| weights[m] * predictions[m])
            .sum::<f64>()
            .clamp(0.0, 1.0)
    }

    /// The weight the mixture gives recency, mean over layers: the two shortest
    /// memories (half-lives of 1 and 4 tokens) and the age table.
    pub(super) fn recency_weight(&self) -> f64 {
        let recency = |w: &[f64; PREDICTORS]| w[0] + w[1] + w[MEMORIES];
        self.weights.iter().map(recency).sum::<f64>() / self.weights.len().max(1) as f64
    }

    /// The use probability before any observation.
    #[cfg(test)]
    pub(super) fn prior(&self) -> f64 {
        self.prior
    }

    /// The mixture's weights of `group`'s layer: the memories, shortest first, then
    /// the age table.
    #[cfg(test)]
    fn weights(&self, group: u32) -> Option<[f64; PREDICTORS]> {
        self.slot
            .get(group as usize)
            .map(|&slot| self.weights[slot])
    }

    /// A token ended: `outcomes` are the groups observed through it, each with whether
    /// it ran. Every layer with an outcome moves its weights toward the predictors that
    /// foresaw them best; then each observed group's counts take the outcome in.
    pub(super) fn close_token(&mut self, outcomes: impl IntoIterator<Item = (u32, bool)>) {
        let layers = self.weights.len();
        let mut gradient = vec![[0.0; PREDICTORS]; layers];
        let mut observed = vec![0u32; layers];
        let mut updates = Vec::new();
        for (group, used) in outcomes {
            let Some(&slot) = self.slot.get(group as usize) else {
                continue;
            };
            let predictions = self.predictions(group);
            let likelihood =
                predictions.map(|p| outcome_likelihood(p.clamp(CLAMP, 1.0 - CLAMP), used));
            let mixed: f64 = (0..PREDICTORS)
                .map(|m| self.weights[slot][m] * likelihood[m])
                .sum();
            for m in 0..PREDICTORS {
                gradient[slot][m] += likelihood[m] / mixed.max(f64::MIN_POSITIVE);
            }
            observed[slot] += 1;
            updates.push((group, slot, self.age_bucket(group), used));
        }
        for slot in 0..layers {
            if observed[slot] > 0 {
                let mean = gradient[slot].map(|g| g / f64::from(observed[slot]));
                step(&mut self.weights[slot], mean);
            }
        }
        let age_keep = 0.5f64.powf(1.0 / AGE_HALF_LIFE);
        for ages in &mut self.ages {
            ages.runs = ages.runs.map(|r| r * age_keep);
            ages.seen = ages.seen.map(|s| s * age_keep);
        }
        let token = self.tokens;
        for (group, slot, bucket, used) in updates {
            let ran = f64::from(u8::from(used));
            let counts = &mut self.counts[group as usize];
            for m in 0..MEMORIES {
                counts.uses[m] = counts.uses[m] * self.keep[m] + ran;
                counts.exposure[m] = counts.exposure[m] * self.keep[m] + 1.0;
            }
            self.ages[slot].runs[bucket] += ran;
            self.ages[slot].seen[bucket] += 1.0;
            if used {
                self.last_ran[group as usize] = Some(token);
            }
        }
        self.tokens += 1;
        // Weights and ages moved for every group, not only the observed ones.
        for group in 0..self.probabilities.len() {
            self.probabilities[group] = self.mixed(group as u32);
        }
    }

    /// Starts `group`'s memories from an earlier run's `uses` in `tokens`: each memory
    /// takes the rate over at most the tokens it remembers at once.
    pub(super) fn seed(&mut self, group: u32, uses: f64, tokens: f64) {
        let Some(counts) = self.counts.get_mut(group as usize) else {
            return;
        };
        if !(tokens > 0.0 && (0.0..=tokens).contains(&uses)) {
            return;
        }
        for m in 0..MEMORIES {
            let remembered = tokens.min(1.0 / (1.0 - self.keep[m]));
            counts.exposure[m] = remembered;
            counts.uses[m] = uses / tokens * remembered;
        }
        self.probabilities[group as usize] = self.mixed(group);
    }
}

/// The chance a prediction `p` gave the outcome.
fn outcome_likelihood(p: f64, used: bool) -> f64 {
    if used {
        p
    } else {
        1.0 - p
    }
}

/// One exponentiated-gradient step of `weights` along `gradient` (the mean, over a
/// token's outcomes, of each memory's likelihood over the mixture's), then the fixed
/// share.
fn step(weights: &mut [f64; PREDICTORS], gradient: [f64; PREDICTORS]) {
    for m in 0..PREDICTORS {
        // The gradient is about 1 for a memory as good as the mixture: centring it
        // keeps the exponent small whatever the scale.
        weights[m] *= (LEARNING_RATE * (gradient[m] - 1.0)).exp();
    }
    let total: f64 = weights.iter().sum();
    for weight in weights.iter_mut() {
        *weight = (1.0 - FIXED_SHARE) * *weight / total.max(f64::MIN_POSITIVE)
            + FIXED_SHARE / PREDICTORS as f64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

    /// One layer of `experts` experts.
    fn mixture(experts: u32, prior: f64) -> UseMixture {
        UseMixture::new(&vec![0; experts as usize], prior)
    }

    /// Runs `tokens` tokens of `pick` (the experts each token runs), every expert
    /// observed, and returns the mixture.
    fn run(
        mut mixture: UseMixture,
        experts: u32,
        tokens: usize,
        mut pick: impl FnMut(usize) -> Vec<u32>,
    ) -> UseMixture {
        for token in 0..tokens {
            let used = pick(token);
            mixture.close_token((0..experts).map(|e| (e, used.contains(&e))));
        }
        mixture
    }

    #[test]
    fn independent_routing_trusts_the_long_memories() {
        let mut rng = SmallRng::seed_from_u64(1);
        // Expert 0 runs in 60 % of tokens, the rest in 5 %, independently.
        let mixture = run(mixture(8, 0.25), 8, 600, |_| {
            (0..8)
                .filter(|&e| rng.gen::<f64>() < if e == 0 { 0.6 } else { 0.05 })
                .collect()
        });
        let weights = mixture.weights(0).unwrap();
        let long: f64 = weights[3..MEMORIES].iter().sum();
        assert!(long > 0.7, "{weights:?}");
        assert!((mixture.probability(0) - 0.6).abs() < 0.12);
        assert!(mixture.probability(1) < 0.15);
    }

    #[test]
    fn sticky_routing_ranks_what_just_ran_first() {
        let mut rng = SmallRng::seed_from_u64(2);
        // Runs of 6 tokens on one expert of 16, then another: a popularity of the
        // whole run says nothing, the last token says almost everything.
        let mut current = 0;
        let mixture = run(mixture(16, 1.0 / 16.0), 16, 600, |token| {
            if token % 6 == 0 {
                current = rng.gen_range(0..16);
            }
            vec![current]
        });
        let weights = mixture.weights(0).unwrap();
        // The shortest memories and the age table: recency.
        assert!(
            weights[0] + weights[1] + weights[MEMORIES] > 0.6,
            "{weights:?}"
        );
        let last = current;
        let other = (last + 1) % 16;
        assert!(
            mixture.probability(last) > 0.5,
            "{}",
            mixture.probability(last)
        );
        assert!(mixture.probability(other) < 0.15);
    }

    #[test]
    fn layers_learn_their_own_weights() {
        let mut mixture = UseMixture::new(&[0, 0, 1, 1], 0.5);
        // Layer 0 alternates its two experts; layer 1 always runs expert 2.
        for token in 0..300 {
            let a = (token % 2) as u32;
            mixture.close_token([(0, a == 0), (1, a == 1), (2, true), (3, false)]);
        }
        assert!(mixture.probability(2) > 0.9);
        assert!(mixture.probability(3) < 0.1);
        let (w0, w1) = (mixture.weights(0).unwrap(), mixture.weights(2).unwrap());
        assert_ne!(w0, w1);
        // Alternation defeats the shortest memory (it always bets on a repeat).
        assert!(w0[0] < 0.2, "{w0:?}");
    }

    #[test]
    fn seeding_starts_the_long_memories_and_bad_counts_are_ignored() {
        let mut mixture = mixture(4, 0.25);
        mixture.seed(0, 900.0, 1000.0);
        mixture.seed(1, 5.0, 4.0);
        mixture.seed(9, 1.0, 2.0);
        let counts = mixture.counts[0];
        assert!((counts.uses[4] / counts.exposure[4] - 0.9).abs() < 1e-9);
        assert!(counts.exposure[0] <= 2.0 + 1e-9, "{counts:?}");
        assert!(mixture.probability(0) > 0.8);
        assert!((mixture.probability(1) - 0.25).abs() < 1e-9, "the prior");
        assert_eq!(mixture.probability(9), 0.0);
    }

    #[test]
    fn the_kept_estimate_is_the_mixture_of_the_current_counts() {
        let mut rng = SmallRng::seed_from_u64(3);
        let mut mixture = UseMixture::new(&[0, 0, 0, 1, 1], 0.4);
        mixture.seed(3, 30.0, 40.0);
        for _ in 0..50 {
            // Some groups unobserved in some tokens: their estimate still moves with
            // their layer's weights.
            let mut outcomes = Vec::new();
            for group in 0..5 {
                if rng.gen::<f64>() < 0.7 {
                    outcomes.push((group, rng.gen::<f64>() < 0.3));
                }
            }
            mixture.close_token(outcomes);
            for group in 0..5 {
                assert_eq!(mixture.probability(group), mixture.mixed(group));
            }
        }
    }

    #[test]
    fn no_outcome_moves_nothing_and_weights_stay_a_distribution() {
        let mut mixture = mixture(4, 0.25);
        let before = mixture.weights(0).unwrap();
        mixture.close_token([]);
        assert_eq!(mixture.weights(0).unwrap(), before);
        for _ in 0..1000 {
            mixture.close_token([(0, true), (1, false)]);
        }
        let weights = mixture.weights(0).unwrap();
        assert!((weights.iter().sum::<f64>() - 1.0).abs() < 1e-9);
        assert!(weights
            .iter()
            .all(|&w| w >= FIXED_SHARE / PREDICTORS as f64 - 1e-12));
    }
}
