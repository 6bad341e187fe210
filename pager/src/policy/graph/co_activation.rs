//! Co-activation of experts in consecutive layers, learned from faults: which experts of
//! layer l + 1 a token picks given those it picked in layer l.
//!
//! Trained routers are not independent from layer to layer: the residual stream changes
//! little between two layers' routers, so a token that picks expert i in one layer picks
//! some experts of the next far more often than their popularity alone says (inter-layer
//! expert affinity). Knowing where the current token went in this layer then says which
//! experts of the next layers it is likely to need, and eviction can keep those and let
//! go of the ones it is unlikely to need before the token ends.
//!
//! Counted per pair of consecutive expert layers (*slots*): for each expert `i` the
//! tokens in which it was seen used (`basis`), and for each expert `j` of the next slot
//! the tokens in which both were (`pairs`). A pager hears of a use only when it faults,
//! so a token's transition from one slot to the next counts only where the next slot
//! was wholly observed: each of its experts seen used, or observable (not wholly
//! resident, or watched) from the token's entry into the slot to its leaving it. An
//! expert used silently would otherwise count as not following, and eviction would
//! turn against the resident experts it cannot see. The estimate of `P(j | i)` shrinks toward
//! `j`'s popularity `p_j` by `PRIOR_TOKENS`: `(pairs + w p_j) / (basis + w)`, so that
//! with nothing learned the outlook is popularity. The outlook reaches the next expert
//! layer only: the gate below judges one step, and what it has not judged is not used.
//!
//! The outlook is used only while it pays: every transition whose later layer was
//! wholly observed is scored out of sample (predicted when the token enters the layer,
//! before that token is counted), the conditional against popularity alone (Brier
//! score, moving average), and the conditional is used only while it scores better.
//! Routing with no affinity scores the same or worse and leaves popularity in charge.
//!
//! Pure bookkeeping over group numbers (see `graph::ExpertMap`).

use std::cell::RefCell;

/// Tokens of prior belief in each conditional: the popularity weighs as this many tokens
/// of observed pairs.
const PRIOR_TOKENS: f64 = 8.0;
/// When an expert's basis reaches this many tokens its row is halved, so that routing
/// that drifts is followed (as `expert_use` does with use counts).
const HISTORY_TOKENS: f64 = 512.0;
/// Counts from an earlier run weigh at most this many tokens.
const SEED_TOKENS: f64 = 128.0;
/// Weight of one transition in the moving scores.
const SCORE_WEIGHT: f64 = 1.0 / 64.0;
/// Transitions scored before the outlook may be used.
const SCORED_BEFORE_USE: u32 = 32;
/// How much better than popularity the conditional must score to be used.
const SCORE_MARGIN: f64 = 0.98;
/// An expert of the next layer at least this likely to be used by the current token is
/// read before the router asks for it (`speculate`).
const SPECULATE_AT: f64 = 0.5;
/// Speculative reads resolved before their hit rate is judged, and the weight of the
/// history it is judged over.
const SPECULATION_JUDGED_AFTER: f64 = 16.0;
const SPECULATION_HISTORY: f64 = 256.0;
/// The hit rate below which speculative reads stop: a read the token does not use costs
/// the device the time of one it does, and an eviction; at half, what they save in
/// waits is about what they cost.
const SPECULATION_PAYS_AT: f64 = 0.5;

#[derive(Debug, Clone, Default)]
pub(super) struct CoActivation {
    /// Per group: its slot (index into `slots`) and its index within the slot.
    slot_of: Vec<(usize, usize)>,
    /// Per slot (expert layers in order): its groups.
    slots: Vec<Vec<u32>>,
    /// Per group: tokens in which it was seen used, as the `from` of pairs.
    basis: Vec<f64>,
    /// Per slot but the last: row-major `slots[s].len() x slots[s + 1].len()`.
    pairs: Vec<Vec<f64>>,
    /// The token being counted and, per slot, the groups seen used in it.
    token: u64,
    seen: Vec<Vec<u32>>,
    /// Slots of this token whose transition to the next is counted (or passed over):
    /// a transition counts once the token has left the later slot.
    based: usize,
    /// Per slot: whether every group of it was observable when this token entered it
    /// (the group entering excepted: its fault is what was seen).
    observed_from_entry: Vec<bool>,
    /// The slot of the latest counted use.
    last_slot: Option<usize>,
    /// The conditional prediction for a slot made when the token entered it (from the
    /// slot before, seen whole), with popularity's: scored when the token leaves it.
    pending: Option<Pending>,
    score_conditional: f64,
    score_popularity: f64,
    scored: u32,
    /// Over every scored transition: the experts the token used in the later layer,
    /// and how many of them were among as many most likely by each prediction.
    used_total: u64,
    hits_conditional: u64,
    hits_popularity: u64,
    /// Groups read ahead of the router this token (`speculate`), not yet seen used.
    speculated: Vec<u32>,
    /// Speculative reads that the token then used, and those it did not (halved
    /// together at `SPECULATION_HISTORY`).
    speculation_hits: f64,
    speculation_misses: f64,
    /// Totals for the stats.
    speculated_total: u64,
    speculated_used: u64,
    /// Bumped at every change of the counts, the scores or the uses seen.
    version: u64,
    /// The next slot's outlook, as of `version`.
    outlook: RefCell<Option<(u64, Vec<f64>)>>,
}

#[derive(Debug, Clone)]
struct Pending {
    token: u64,
    slot: usize,
    conditional: Vec<f64>,
    popularity: Vec<f64>,
}

/// How well co-activation predicted the next layer's experts, for the stats.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CoActivationSummary {
    /// Transitions from one expert layer to the next seen whole and judged.
    pub transitions: u64,
    /// Per transition: the experts the token used in the later layer.
    pub experts_per_transition: f64,
    /// Per transition: how many of them were among as many experts most likely given
    /// the earlier layer's (co-activation), and by popularity alone.
    pub hits_co_activation: f64,
    pub hits_popularity: f64,
    /// Whether eviction follows co-activation now: it has been scoring better.
    pub in_use: bool,
    /// Experts read ahead of the router because co-activation made them likely, and
    /// how many of them the token then used.
    pub speculated: u64,
    pub speculated_used: u64,
}

/// One counted pair, for saving: `from` and `to` in consecutive expert layers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Pair {
    pub from: u32,
    pub to: u32,
    pub tokens: f64,
}

impl CoActivation {
    /// `layers`: each group's layer.
    pub(super) fn new(layers: &[u32]) -> Self {
        let mut distinct: Vec<u32> = layers.to_vec();
        distinct.sort_unstable();
        distinct.dedup();
        let mut slots: Vec<Vec<u32>> = vec![Vec::new(); distinct.len()];
        let mut slot_of = Vec::with_capacity(layers.len());
        for (group, layer) in layers.iter().enumerate() {
            let slot = distinct.binary_search(layer).unwrap_or(0);
            slot_of.push((slot, slots[slot].len()));
            slots[slot].push(group as u32);
        }
        let pairs = slots
            .windows(2)
            .map(|w| vec![0.0; w[0].len() * w[1].len()])
            .collect();
        Self {
            basis: vec![0.0; layers.len()],
            seen: vec![Vec::new(); slots.len()],
            observed_from_entry: vec![false; slots.len()],
            slot_of,
            slots,
            pairs,
            ..Self::default()
        }
    }

    /// A use of `group` counted in `token` (once per group and token, tokens never
    /// going back). `popularity` is each group's use probability now; `observable`
    /// whether a use of a group would fault now (see the module's doc).
    pub(super) fn used(
        &mut self,
        token: u64,
        group: u32,
        popularity: &dyn Fn(u32) -> f64,
        observable: &dyn Fn(u32) -> bool,
    ) {
        let Some(&(slot, _)) = self.slot_of.get(group as usize) else {
            return;
        };
        if token != self.token {
            self.leave_slot(observable);
            self.count_transitions(self.slots.len(), observable);
            let missed = std::mem::take(&mut self.speculated).len() as f64;
            self.judge_speculation(0.0, missed);
            self.token = token;
            self.seen.iter_mut().for_each(Vec::clear);
            self.last_slot = None;
            self.based = 0;
        }
        if self.last_slot.is_some_and(|last| slot > last) {
            self.leave_slot(observable);
            // Transitions into slots before `slot` are behind the token now.
            self.count_transitions(slot.saturating_sub(1), observable);
        }
        if self.last_slot != Some(slot) && self.seen[slot].is_empty() {
            self.observed_from_entry[slot] = self.slots[slot]
                .iter()
                .all(|&other| other == group || observable(other));
            self.enter_slot(slot, popularity);
        }
        self.last_slot = Some(self.last_slot.map_or(slot, |last| last.max(slot)));
        self.seen[slot].push(group);
        if let Some(at) = self.speculated.iter().position(|&g| g == group) {
            self.speculated.swap_remove(at);
            self.speculated_used += 1;
            self.judge_speculation(1.0, 0.0);
        }
        self.version += 1;
    }

    fn judge_speculation(&mut self, hits: f64, misses: f64) {
        self.speculation_hits += hits;
        self.speculation_misses += misses;
        if self.speculation_hits + self.speculation_misses >= SPECULATION_HISTORY {
            self.speculation_hits /= 2.0;
            self.speculation_misses /= 2.0;
        }
    }

    /// Whether reading experts ahead of the router pays: co-activation does, and the
    /// speculative reads judged so far were used at least `SPECULATION_PAYS_AT` of the
    /// time.
    fn speculation_pays(&self) -> bool {
        let judged = self.speculation_hits + self.speculation_misses;
        self.pays()
            && (judged < SPECULATION_JUDGED_AFTER
                || self.speculation_hits >= SPECULATION_PAYS_AT * judged)
    }

    /// The experts of the next expert layer worth reading before the router asks for
    /// them: at least `SPECULATE_AT` likely to be used by the current token, `wanted`
    /// (not resident, not being read), and not asked for already this token; none while
    /// speculation does not pay. Those returned count as speculated: the token's use of
    /// one is a hit, the token ending without it a miss.
    pub(super) fn speculate(
        &mut self,
        current_token: u64,
        popularity: &dyn Fn(u32) -> f64,
        wanted: &dyn Fn(u32) -> bool,
    ) -> Vec<u32> {
        if !self.speculation_pays() || self.token != current_token {
            return Vec::new();
        }
        let Some(next) = self.last_slot.map(|slot| slot + 1) else {
            return Vec::new();
        };
        let Some(groups) = self.slots.get(next) else {
            return Vec::new();
        };
        let chosen: Vec<u32> = groups
            .iter()
            .copied()
            .filter(|&group| {
                !self.seen[next].contains(&group)
                    && !self.speculated.contains(&group)
                    && wanted(group)
                    && self
                        .this_token(group, current_token, popularity)
                        .is_some_and(|q| q >= SPECULATE_AT)
            })
            .collect();
        self.speculated.extend_from_slice(&chosen);
        self.speculated_total += chosen.len() as u64;
        chosen
    }

    /// Whether this token's use of `slot` is known whole: observable from its entry,
    /// and every group of it seen used or observable still.
    fn wholly_observed(&self, slot: usize, observable: &dyn Fn(u32) -> bool) -> bool {
        self.observed_from_entry[slot]
            && self.slots[slot]
                .iter()
                .all(|group| self.seen[slot].contains(group) || observable(*group))
    }

    /// Counts this token's transitions into the slots before `end + 1` not counted yet:
    /// for each group seen in the earlier slot a token of basis, and a pair with each
    /// seen in the later, where the later was wholly observed.
    fn count_transitions(&mut self, end: usize, observable: &dyn Fn(u32) -> bool) {
        let end = end.min(self.slots.len().saturating_sub(1));
        for slot in self.based..end {
            if self.seen[slot].is_empty() || !self.wholly_observed(slot + 1, observable) {
                continue;
            }
            let width = self.slots[slot + 1].len();
            let columns: Vec<usize> = self.seen[slot + 1]
                .iter()
                .map(|&to| self.slot_of[to as usize].1)
                .collect();
            for &group in &self.seen[slot] {
                let (_, index) = self.slot_of[group as usize];
                let row = &mut self.pairs[slot][index * width..(index + 1) * width];
                for &column in &columns {
                    row[column] += 1.0;
                }
                let basis = &mut self.basis[group as usize];
                *basis += 1.0;
                if *basis >= HISTORY_TOKENS {
                    *basis /= 2.0;
                    row.iter_mut().for_each(|count| *count /= 2.0);
                }
            }
        }
        self.based = self.based.max(end);
    }

    /// The token enters `slot`: predicts it from the slot before, if that was seen in
    /// this token, before any of this slot's pairs are counted.
    fn enter_slot(&mut self, slot: usize, popularity: &dyn Fn(u32) -> f64) {
        self.pending = None;
        if slot == 0 || self.seen[slot - 1].is_empty() {
            return;
        }
        let (conditional, popular) = self.predict(slot - 1, popularity);
        self.pending = Some(Pending {
            token: self.token,
            slot,
            conditional,
            popularity: popular,
        });
    }

    /// The token leaves the slot of its latest use: scores the prediction made for it,
    /// if the slot was wholly observed.
    fn leave_slot(&mut self, observable: &dyn Fn(u32) -> bool) {
        let Some(pending) = self.pending.take() else {
            return;
        };
        if pending.token != self.token
            || Some(pending.slot) != self.last_slot
            || !self.wholly_observed(pending.slot, observable)
        {
            return;
        }
        let seen = &self.seen[pending.slot];
        let brier = |predicted: &[f64]| -> f64 {
            self.slots[pending.slot]
                .iter()
                .zip(predicted)
                .map(|(group, &p)| {
                    let y = if seen.contains(group) { 1.0 } else { 0.0 };
                    (p - y) * (p - y)
                })
                .sum()
        };
        let (conditional, popularity) = (brier(&pending.conditional), brier(&pending.popularity));
        let hits = |predicted: &[f64]| -> u64 {
            let mut ranked: Vec<usize> = (0..predicted.len()).collect();
            ranked.sort_by(|&a, &b| predicted[b].total_cmp(&predicted[a]));
            let groups = &self.slots[pending.slot];
            ranked[..seen.len().min(ranked.len())]
                .iter()
                .filter(|&&at| seen.contains(&groups[at]))
                .count() as u64
        };
        self.used_total += seen.len() as u64;
        self.hits_conditional += hits(&pending.conditional);
        self.hits_popularity += hits(&pending.popularity);
        if self.scored == 0 {
            self.score_conditional = conditional;
            self.score_popularity = popularity;
        } else {
            self.score_conditional += SCORE_WEIGHT * (conditional - self.score_conditional);
            self.score_popularity += SCORE_WEIGHT * (popularity - self.score_popularity);
        }
        self.scored = self.scored.saturating_add(1);
        self.version += 1;
    }

    /// From the use probabilities `q` of slot `from`'s groups (by index in the slot; 1
    /// for those seen) to those of slot `from + 1`, given their popularity.
    fn step(&self, from: usize, q: &[f64], popular: &[f64]) -> Vec<f64> {
        let width = self.slots[from + 1].len();
        let total: f64 = q.iter().sum();
        if total <= 0.0 {
            return popular.to_vec();
        }
        let mut next = vec![0.0; width];
        for (row, &weight) in q.iter().enumerate() {
            if weight <= 0.0 {
                continue;
            }
            let group = self.slots[from][row] as usize;
            let basis = self.basis[group];
            let counts = &self.pairs[from][row * width..(row + 1) * width];
            for ((out, &count), &p) in next.iter_mut().zip(counts).zip(popular) {
                let conditional = (count + PRIOR_TOKENS * p) / (basis + PRIOR_TOKENS);
                *out += weight * conditional.min(1.0);
            }
        }
        next.iter_mut().for_each(|x| *x = (*x / total).min(1.0));
        next
    }

    pub(super) fn summary(&self) -> CoActivationSummary {
        let per = |count: u64| {
            if self.scored == 0 {
                0.0
            } else {
                count as f64 / f64::from(self.scored)
            }
        };
        CoActivationSummary {
            transitions: u64::from(self.scored),
            experts_per_transition: per(self.used_total),
            hits_co_activation: per(self.hits_conditional),
            hits_popularity: per(self.hits_popularity),
            in_use: self.pays(),
            speculated: self.speculated_total,
            speculated_used: self.speculated_used,
        }
    }

    /// Whether the conditional outlook has scored better than popularity.
    pub(super) fn pays(&self) -> bool {
        self.scored >= SCORED_BEFORE_USE
            && self.score_conditional < SCORE_MARGIN * self.score_popularity
    }

    /// The probability that the current token uses `group`, for a group of the expert
    /// layer after the one the token is in (seen through the uses counted); `None`
    /// elsewhere, or while the outlook does not pay: popularity is the estimate there.
    pub(super) fn this_token(
        &self,
        group: u32,
        current_token: u64,
        popularity: &dyn Fn(u32) -> f64,
    ) -> Option<f64> {
        let &(slot, index) = self.slot_of.get(group as usize)?;
        let current = self.last_slot.filter(|_| self.token == current_token)?;
        if slot != current + 1 || !self.pays() {
            return None;
        }
        let mut cache = self.outlook.borrow_mut();
        if cache
            .as_ref()
            .is_none_or(|&(version, _)| version != self.version)
        {
            *cache = Some((self.version, self.predict(current, popularity).0));
        }
        cache.as_ref()?.1.get(index).copied()
    }

    /// The next slot's use probabilities given the groups seen in `slot` this token
    /// (co-activation), and by popularity alone.
    fn predict(&self, slot: usize, popularity: &dyn Fn(u32) -> f64) -> (Vec<f64>, Vec<f64>) {
        let popular: Vec<f64> = self.slots[slot + 1]
            .iter()
            .map(|&g| popularity(g))
            .collect();
        let conditional = self.step(slot, &indicator(&self.seen[slot], self), &popular);
        (conditional, popular)
    }

    /// Every counted pair of at least half a token (halving leaves the rest a trace
    /// of no weight against the prior; dropping it keeps what is saved small). The
    /// basis of each `from` is `basis`.
    pub(super) fn pairs(&self) -> impl Iterator<Item = Pair> + '_ {
        self.pairs
            .iter()
            .enumerate()
            .flat_map(move |(from_slot, counts)| {
                let width = self.slots[from_slot + 1].len();
                counts
                    .iter()
                    .enumerate()
                    .filter(|&(_, &tokens)| tokens >= 0.5)
                    .map(move |(at, &tokens)| Pair {
                        from: self.slots[from_slot][at / width],
                        to: self.slots[from_slot + 1][at % width],
                        tokens,
                    })
            })
    }

    pub(super) fn basis(&self, group: u32) -> f64 {
        self.basis.get(group as usize).copied().unwrap_or(0.0)
    }

    /// Starts from an earlier run's counts: `group`'s basis, and the pairs from it,
    /// scaled together to weigh at most `SEED_TOKENS` tokens. Pairs not from `group` to
    /// a group of the next expert layer are ignored; one counted more often than the
    /// basis counts as often.
    pub(super) fn seed(&mut self, group: u32, basis: f64, pairs: &[(u32, f64)]) {
        let Some(&(slot, row)) = self.slot_of.get(group as usize) else {
            return;
        };
        if !(basis.is_finite() && basis > 0.0) || slot + 1 >= self.slots.len() {
            return;
        }
        let scale = (SEED_TOKENS / basis).min(1.0);
        self.basis[group as usize] = basis * scale;
        let width = self.slots[slot + 1].len();
        for &(to, tokens) in pairs {
            let Some(&(to_slot, column)) = self.slot_of.get(to as usize) else {
                continue;
            };
            if to_slot == slot + 1 && tokens.is_finite() && tokens >= 0.0 {
                self.pairs[slot][row * width + column] = tokens.min(basis) * scale;
            }
        }
        self.version += 1;
    }
}

/// 1 for each group of `seen` at its index in its slot (all of one slot), else 0.
fn indicator(seen: &[u32], co: &CoActivation) -> Vec<f64> {
    let Some(&first) = seen.first() else {
        return Vec::new();
    };
    let (slot, _) = co.slot_of[first as usize];
    let mut q = vec![0.0; co.slots[slot].len()];
    for &group in seen {
        q[co.slot_of[group as usize].1] = 1.0;
    }
    q
}

#[cfg(test)]
mod tests;
