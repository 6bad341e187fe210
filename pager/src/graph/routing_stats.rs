//! How a mixture of experts' router picks from one token to the next, measured on what a
//! run recorded, so that a model's router can be compared to published real-router
//! figures: the hit rate of a per-layer LRU (and LFU) cache of experts against the share
//! of the layer's experts it holds, and how often a token reuses its predecessor's
//! experts against what independent picks with the same popularity would give.
//!
//! Pure computation over expert numbers; [`token_expert_sets`] turns a demand trace's
//! faults into the per-token sets the rest takes.

use std::collections::BTreeSet;

use serde::Serialize;
use thiserror::Error;

use crate::graph::ModelGraph;

/// Shares of a layer's experts the cache holds.
pub const SHARES: [f64; 5] = [0.05, 0.12, 0.20, 0.36, 0.55];

/// The per-layer LRU hit rate at `SHARES` of real decode traces of Qwen3-235B-A22B (128
/// experts, 8 used; `boyle/data/curves.json` of the PyPI package `boyle`). A router
/// picking independently of the previous token gets about the share itself.
pub const QWEN3_235B_LRU: [f64; 5] = [0.339, 0.580, 0.743, 0.886, 0.961];

/// Partners each token is compared with to estimate by chance how often two tokens
/// share an expert (all the others when there are fewer).
const CHANCE_PARTNERS: usize = 256;

/// Routing that cannot be measured.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum RoutingStatsError {
    #[error("no routed experts: a layer of 0 experts has no routing to measure")]
    NoExperts,
    #[error("token {token} used expert {expert} in layer {layer}, which has only {experts}")]
    ExpertOutOfRange {
        token: usize,
        layer: usize,
        expert: u32,
        experts: u32,
    },
}

/// Which experts each token used in each expert layer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TokenExperts {
    /// The model's numbers of the layers with routed experts, ascending.
    pub layers: Vec<u32>,
    pub experts_per_layer: u32,
    /// Per token, per layer (as in `layers`), the experts used, in the order first seen.
    pub tokens: Vec<Vec<Vec<u32>>>,
}

impl TokenExperts {
    pub fn stats(&self) -> Result<RoutingStats, RoutingStatsError> {
        RoutingStats::measure(&self.tokens, self.experts_per_layer)
    }
}

/// The experts each token used, from the faults of a demand trace through one region
/// presenting the whole model of `graph` (every block a token uses faults): a fault in a
/// block of routed experts shows them in use (`ExpertMap::groups_in_use`), and one in a
/// lower layer than the previous starts a new token, as the graph policy tells tokens
/// apart. Faults outside the routed experts are passed over.
pub fn token_expert_sets(
    graph: &ModelGraph,
    faults: impl IntoIterator<Item = (u32, Option<u32>)>,
) -> TokenExperts {
    let experts = graph.experts();
    let layers: Vec<u32> = experts
        .groups()
        .iter()
        .map(|group| group.layer)
        .collect::<BTreeSet<u32>>()
        .into_iter()
        .collect();
    let mut tokens: Vec<Vec<Vec<u32>>> = Vec::new();
    let mut last_layer = None;
    for (block, offset) in faults {
        // A block shared with a tensor every token reads says nothing of the router.
        if graph.order().contains(block) || experts.groups_of(block).is_empty() {
            continue;
        }
        let range = graph.geometry().block_range(block);
        for id in experts.groups_in_use(block, offset, range) {
            let group = experts.group(id);
            let Ok(at) = layers.binary_search(&group.layer) else {
                continue;
            };
            if tokens.is_empty() || last_layer.is_some_and(|last| group.layer < last) {
                tokens.push(vec![Vec::new(); layers.len()]);
            }
            last_layer = Some(group.layer);
            if let Some(set) = tokens.last_mut().map(|token| &mut token[at]) {
                if !set.contains(&group.expert) {
                    set.push(group.expert);
                }
            }
        }
    }
    TokenExperts {
        layers,
        experts_per_layer: experts.experts_per_layer(),
        tokens,
    }
}

/// A figure measured per layer: its mean, lowest and highest over the layers measured.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Spread {
    pub mean: f64,
    pub min: f64,
    pub max: f64,
    /// How many layers it was measured in.
    pub layers: usize,
}

impl Spread {
    /// Over the layers that have a value; `None` when none has.
    fn over(values: impl IntoIterator<Item = Option<f64>>) -> Option<Spread> {
        let values: Vec<f64> = values.into_iter().flatten().collect();
        if values.is_empty() {
            return None;
        }
        Some(Spread {
            mean: values.iter().sum::<f64>() / values.len() as f64,
            min: values.iter().copied().fold(f64::INFINITY, f64::min),
            max: values.iter().copied().fold(f64::NEG_INFINITY, f64::max),
            layers: values.len(),
        })
    }
}

/// The hit rates of per-layer caches holding one share of each layer's experts.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CachePoint {
    pub share: f64,
    /// The share in experts: rounded to the nearest, at least 1.
    pub experts_kept: u32,
    /// Evicting the least recently used.
    pub lru: Option<Spread>,
    /// Keeping those used most so far, ties to the most recent.
    pub lfu: Option<Spread>,
    /// `QWEN3_235B_LRU` at this share.
    pub reference_lru: f64,
}

/// How much of a token's routing in a layer repeats the previous token's.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Consecutive {
    /// The share of a token's experts that the previous token also used (token pairs
    /// both seen in the layer).
    pub same: Option<Spread>,
    /// What independent picks with the layer's popularity give: `sum p_e^2 / sum p_e`,
    /// `p_e` the share of tokens using expert `e` (see `same_by_chance`).
    pub same_by_chance: Option<Spread>,
    /// The share of tokens that used at least one of the previous token's experts (the
    /// measure of Mixtral's paper).
    pub any_shared: Option<Spread>,
    /// The same for any two tokens (up to `CHANCE_PARTNERS` others for each token).
    pub any_shared_by_chance: Option<Spread>,
}

/// Routing statistics of a trace of tokens (see the module's description).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RoutingStats {
    pub tokens: usize,
    pub experts_per_layer: u32,
    /// Expert layers in the input, and how many of them no token used.
    pub layers: usize,
    pub layers_unused: usize,
    /// Experts a token used in a layer, on average where it used any.
    pub used_per_token: Option<f64>,
    /// One point per share of `SHARES`. Every token's accesses after the first token's
    /// count (the first fills the caches).
    pub caches: Vec<CachePoint>,
    pub consecutive: Consecutive,
}

impl RoutingStats {
    /// Measures `tokens[t][l]`, the experts token `t` used in layer `l` (a token listing
    /// fewer layers used none in the rest), of `experts_per_layer` each. An expert
    /// listed twice in one token and layer counts once.
    pub fn measure(
        tokens: &[Vec<Vec<u32>>],
        experts_per_layer: u32,
    ) -> Result<Self, RoutingStatsError> {
        if experts_per_layer == 0 {
            return Err(RoutingStatsError::NoExperts);
        }
        let layers = by_layer(tokens, experts_per_layer)?;
        let used = layers.iter().flatten().map(Vec::len);
        let used: Vec<usize> = used.filter(|&n| n > 0).collect();
        let caches = SHARES
            .iter()
            .zip(QWEN3_235B_LRU)
            .map(|(&share, reference_lru)| {
                let kept = experts_kept(share, experts_per_layer);
                let rate = |eviction| {
                    Spread::over(
                        layers
                            .iter()
                            .map(|sets| hit_rate(sets, experts_per_layer, kept, eviction)),
                    )
                };
                CachePoint {
                    share,
                    experts_kept: kept,
                    lru: rate(Eviction::LeastRecent),
                    lfu: rate(Eviction::LeastFrequent),
                    reference_lru,
                }
            })
            .collect();
        Ok(Self {
            tokens: tokens.len(),
            experts_per_layer,
            layers: layers.len(),
            layers_unused: layers
                .iter()
                .filter(|sets| sets.iter().all(Vec::is_empty))
                .count(),
            used_per_token: (!used.is_empty())
                .then(|| used.iter().sum::<usize>() as f64 / used.len() as f64),
            caches,
            consecutive: consecutive(&layers, experts_per_layer),
        })
    }

    /// Whether LRU hits more often than LFU at every share, as on real routers; `None`
    /// when a share has no hit rate.
    pub fn lfu_loses_everywhere(&self) -> Option<bool> {
        self.caches.iter().try_fold(true, |all, point| {
            Some(all && point.lru?.mean > point.lfu?.mean)
        })
    }
}

/// `share` of `experts`, rounded to the nearest, at least 1.
fn experts_kept(share: f64, experts: u32) -> u32 {
    ((share * experts as f64).round() as u32).clamp(1, experts.max(1))
}

/// The input turned round: per layer, per token, its experts without repeats, checked.
fn by_layer(
    tokens: &[Vec<Vec<u32>>],
    experts: u32,
) -> Result<Vec<Vec<Vec<u32>>>, RoutingStatsError> {
    let layer_count = tokens.iter().map(Vec::len).max().unwrap_or(0);
    let mut layers = vec![Vec::with_capacity(tokens.len()); layer_count];
    for (token, sets) in tokens.iter().enumerate() {
        for (layer, per_token) in layers.iter_mut().enumerate() {
            let mut set: Vec<u32> = Vec::new();
            for &expert in sets.get(layer).map_or(&[][..], Vec::as_slice) {
                if expert >= experts {
                    return Err(RoutingStatsError::ExpertOutOfRange {
                        token,
                        layer,
                        expert,
                        experts,
                    });
                }
                if !set.contains(&expert) {
                    set.push(expert);
                }
            }
            per_token.push(set);
        }
    }
    Ok(layers)
}

#[derive(Copy, Clone, Debug)]
enum Eviction {
    LeastRecent,
    LeastFrequent,
}

/// A cache of some of a layer's experts, accessed one expert at a time.
struct ExpertCache {
    eviction: Eviction,
    capacity: usize,
    /// (key, expert) of the resident experts, the next victim first.
    resident: BTreeSet<((u64, u64), u32)>,
    /// Per expert: its key while resident.
    key: Vec<Option<(u64, u64)>>,
    uses: Vec<u64>,
    clock: u64,
}

impl ExpertCache {
    fn new(eviction: Eviction, experts: u32, capacity: u32) -> Self {
        Self {
            eviction,
            capacity: capacity as usize,
            resident: BTreeSet::new(),
            key: vec![None; experts as usize],
            uses: vec![0; experts as usize],
            clock: 0,
        }
    }

    fn holds(&self, expert: u32) -> bool {
        self.key.get(expert as usize).is_some_and(Option::is_some)
    }

    /// Uses `expert`: whether it was resident. LRU always admits it, evicting the least
    /// recently used; LFU keeps the most used so far (ties to the most recent), so it
    /// admits the expert only if it has been used at least as often as the victim.
    fn access(&mut self, expert: u32) -> bool {
        let e = expert as usize;
        self.clock += 1;
        self.uses[e] += 1;
        let key = match self.eviction {
            Eviction::LeastRecent => (self.clock, 0),
            Eviction::LeastFrequent => (self.uses[e], self.clock),
        };
        if let Some(old) = self.key[e].replace(key) {
            self.resident.remove(&(old, expert));
            self.resident.insert((key, expert));
            return true;
        }
        if self.resident.len() >= self.capacity {
            match self.resident.first().copied() {
                Some((victim, other)) if victim < key => {
                    self.resident.pop_first();
                    self.key[other as usize] = None;
                }
                _ => {
                    self.key[e] = None;
                    return false;
                }
            }
        }
        self.resident.insert((key, expert));
        false
    }
}

/// The hit rate of a cache of `capacity` of a layer's `experts` fed each token's
/// experts in turn (`sets`), the first token's only filling it; `None` when no token
/// after the first used any.
///
/// A token's experts are looked up in the cache as the token found it, then go in in
/// the order they ran: a pager holds all of a token's experts while their layer runs,
/// so what counts is which of them earlier tokens left resident. `boyle`'s curves feed
/// the accesses one at a time instead; the two agree once the cache holds more than a
/// token's experts (Qwen3's 128 from 12 % on), and below that one at a time counts the
/// token's own picks evicting each other (in ggml's ascending order an independent
/// router of 8 among 128 hits 0.008 at 5 %, where the share is 0.05).
fn hit_rate(sets: &[Vec<u32>], experts: u32, capacity: u32, eviction: Eviction) -> Option<f64> {
    let mut cache = ExpertCache::new(eviction, experts, capacity);
    let (mut hits, mut accesses) = (0u64, 0u64);
    for (token, set) in sets.iter().enumerate() {
        if token > 0 {
            hits += set.iter().filter(|&&e| cache.holds(e)).count() as u64;
            accesses += set.len() as u64;
        }
        for &expert in set {
            cache.access(expert);
        }
    }
    (accesses > 0).then(|| hits as f64 / accesses as f64)
}

/// `Consecutive` over every layer.
fn consecutive(layers: &[Vec<Vec<u32>>], experts: u32) -> Consecutive {
    let pairs: Vec<(Option<f64>, Option<f64>)> = layers.iter().map(|s| repeats(s)).collect();
    Consecutive {
        same: Spread::over(pairs.iter().map(|&(same, _)| same)),
        same_by_chance: Spread::over(layers.iter().map(|s| same_by_chance(s, experts))),
        any_shared: Spread::over(pairs.iter().map(|&(_, any)| any)),
        any_shared_by_chance: Spread::over(layers.iter().map(|s| any_shared_by_chance(s, experts))),
    }
}

/// For one layer, over the consecutive tokens that both used it: the mean share of the
/// second's experts the first used too, and the share of pairs with any in common.
fn repeats(sets: &[Vec<u32>]) -> (Option<f64>, Option<f64>) {
    let (mut same, mut any, mut pairs) = (0.0, 0usize, 0usize);
    for pair in sets.windows(2) {
        let (previous, current) = (&pair[0], &pair[1]);
        if previous.is_empty() || current.is_empty() {
            continue;
        }
        let common = current.iter().filter(|e| previous.contains(e)).count();
        same += common as f64 / current.len() as f64;
        any += (common > 0) as usize;
        pairs += 1;
    }
    if pairs == 0 {
        return (None, None);
    }
    (Some(same / pairs as f64), Some(any as f64 / pairs as f64))
}

/// `sum p_e^2 / sum p_e` for one layer over the `T` tokens that used it, `n_e` of them
/// expert `e`: `p_e = n_e / T`, and `p_e^2` estimated as `n_e (n_e - 1) / (T (T - 1))`,
/// the share of pairs of distinct tokens both using it. `(n_e / T)^2` counts each
/// token paired with itself too: on 16 tokens of a uniform router of 2 among 16 it
/// gives 19 % where chance is 12.5 %. `None` with fewer than two such tokens.
fn same_by_chance(sets: &[Vec<u32>], experts: u32) -> Option<f64> {
    let seen = sets.iter().filter(|set| !set.is_empty()).count();
    if seen < 2 {
        return None;
    }
    let mut uses = vec![0u64; experts as usize];
    for &expert in sets.iter().flatten() {
        uses[expert as usize] += 1;
    }
    let t = seen as f64;
    let squares: f64 = uses.iter().map(|&n| (n * n.saturating_sub(1)) as f64).sum();
    let total: f64 = uses.iter().map(|&n| n as f64).sum();
    Some(squares / (t * (t - 1.0)) / (total / t))
}

/// For one layer, the share of pairs of tokens (each with up to `CHANCE_PARTNERS` others
/// spread over the trace) that have an expert in common; `None` with fewer than two
/// tokens that used it.
fn any_shared_by_chance(sets: &[Vec<u32>], experts: u32) -> Option<f64> {
    let words = (experts as usize).div_ceil(64);
    let masks: Vec<Vec<u64>> = sets
        .iter()
        .filter(|set| !set.is_empty())
        .map(|set| {
            let mut mask = vec![0u64; words];
            for &e in set {
                mask[e as usize / 64] |= 1 << (e % 64);
            }
            mask
        })
        .collect();
    let n = masks.len();
    if n < 2 {
        return None;
    }
    let partners = (n - 1).min(CHANCE_PARTNERS);
    let (mut shared, mut pairs) = (0usize, 0usize);
    for (i, mask) in masks.iter().enumerate() {
        for m in 0..partners {
            // Distinct offsets in 1..n, spread evenly.
            let other = &masks[(i + 1 + m * (n - 1) / partners) % n];
            shared += mask.iter().zip(other).any(|(a, b)| a & b != 0) as usize;
            pairs += 1;
        }
    }
    Some(shared as f64 / pairs as f64)
}

#[cfg(test)]
mod tests;
