//! Idle fill: the routed experts most likely to run, read into budget nothing holds
//! while the device has nothing else to do.
//!
//! A router's choice is not known before the token reaches the layer, so an expert a
//! token needs for the first time is a demand read the program waits on. Until the
//! budget is full that wait buys nothing: the room is there, the device idles between
//! the reads the program needs. Filling the room with the experts most likely to run
//! (`ExpertUse::probability`, which starts from the counts an earlier run saved) turns
//! those first uses into hits. The requests are `Urgency::IdleFill`: the service reads
//! them only into free budget and only while no read the program needs is queued, so
//! once the budget is full they cost nothing, and eviction stays the eviction policy's.
//!
//! Pure: ranks group numbers by probability and walks them once per token.

use super::expert_use::ExpertUse;

/// How much more often than the prior (the router's choices spread evenly) an expert
/// must run to be read before it is needed. Read early, an expert the run never uses is
/// a read more than demand paging makes; one used in half again the prior's share of
/// tokens (3 in 16 tokens for 2 of 16 experts) goes unused for 25 tokens with a chance
/// of 0.6 %. The experts the router prefers are what the fill is for; with no
/// preference learned yet (every estimate at the prior), nothing is read early.
const MIN_USE_OVER_PRIOR: f64 = 1.5;

/// Expert groups asked for per prefetch plan (each fault plans once): enough to keep
/// one read ahead of the device while the program faults, few enough that a plan stays
/// cheap.
const GROUPS_PER_PLAN: usize = 2;

/// Which experts to ask for next, most probable first.
#[derive(Debug, Default)]
pub(super) struct IdleFill {
    /// Groups, most probable first, as ranked at the start of token `ranked_at`.
    ranking: Vec<u32>,
    ranked_at: Option<u64>,
    /// How far into `ranking` this token's plans have asked.
    next: usize,
}

impl IdleFill {
    /// The groups to ask for now, at most `GROUPS_PER_PLAN`: the most probable of those
    /// not wholly resident that no earlier plan of this token asked for, down to
    /// `MIN_USE_OVER_PRIOR` times the prior. The ranking is renewed at each token, so a
    /// group evicted since it was passed is asked for again from the next token.
    pub(super) fn next_groups(&mut self, experts: &ExpertUse, groups: usize) -> Vec<u32> {
        let token = experts.tokens();
        if self.ranked_at != Some(token) || self.ranking.len() != groups {
            self.ranking = (0..groups as u32).collect();
            // Stable: equal estimates keep group order (layer by layer, as they run).
            self.ranking
                .sort_by(|&a, &b| experts.probability(b).total_cmp(&experts.probability(a)));
            self.ranked_at = Some(token);
            self.next = 0;
        }
        let least = experts.prior() * MIN_USE_OVER_PRIOR;
        let mut out = Vec::with_capacity(GROUPS_PER_PLAN);
        while out.len() < GROUPS_PER_PLAN && self.next < self.ranking.len() {
            let group = self.ranking[self.next];
            if experts.probability(group) < least {
                // Ranked: every group after it is less probable still.
                self.next = self.ranking.len();
                break;
            }
            self.next += 1;
            if !experts.wholly_resident(group) && !experts.reading_now(group) {
                out.push(group);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::BlockGeometry;
    use crate::graph::{ExpertMap, ExpertSlice};

    /// Four experts in layer 0 (groups 0-3) and one in layer 1 (group 4), one block
    /// each.
    fn experts() -> ExpertUse {
        let layout = BlockGeometry::new(0, 5 << 20, 1 << 20).unwrap();
        let slices: Vec<ExpertSlice> = (0..5u64)
            .map(|n| ExpertSlice {
                layer: (n / 4) as u32,
                expert: (n % 4) as u32,
                file_range: n << 20..(n + 1) << 20,
                anchor: 0,
            })
            .collect();
        let map = ExpertMap::new(&slices, &layout).with_used_per_token(Some(1));
        ExpertUse::new(&map, |_| true)
    }

    #[test]
    fn asks_for_the_most_probable_experts_first_and_each_once_a_token() {
        let mut use_ = experts();
        // One used per token of four: the prior is a quarter. Expert 2 used most, then
        // 3, then 4 (layer 1); 0 and 1 at the prior, not preferred.
        use_.seed(2, 100.0, 100.0);
        use_.seed(3, 60.0, 100.0);
        use_.seed(4, 50.0, 100.0);
        for group in [0, 1] {
            use_.seed(group, 25.0, 100.0);
        }
        let mut fill = IdleFill::default();
        assert_eq!(fill.next_groups(&use_, 5), vec![2, 3]);
        assert_eq!(fill.next_groups(&use_, 5), vec![4]);
        assert_eq!(fill.next_groups(&use_, 5), Vec::<u32>::new());
    }

    #[test]
    fn skips_resident_experts_and_asks_again_at_the_next_token() {
        let mut use_ = experts();
        for group in 0..5 {
            use_.seed(group, 50.0 + group as f64, 100.0);
        }
        use_.block_changed(2, true);
        let mut fill = IdleFill::default();
        let mut asked: Vec<u32> = Vec::new();
        while let groups @ [_, ..] = &fill.next_groups(&use_, 5)[..] {
            asked.extend(groups);
        }
        asked.sort_unstable();
        assert_eq!(
            asked,
            vec![0, 1, 3, 4],
            "the resident expert is not asked for"
        );
        // Expert 2 is evicted; nothing more this token.
        use_.block_changed(2, false);
        assert!(fill.next_groups(&use_, 5).is_empty());
        // The next token (layer 1, then layer 0 again): asked for again, first.
        use_.used(4);
        use_.used(0);
        assert_eq!(use_.tokens(), 1);
        assert_eq!(fill.next_groups(&use_, 5).first(), Some(&4));
        assert!(fill.next_groups(&use_, 5).contains(&2));
    }

    #[test]
    fn with_no_preference_learned_nothing_is_asked_for() {
        let use_ = experts();
        assert!(IdleFill::default().next_groups(&use_, 5).is_empty());
    }
}
