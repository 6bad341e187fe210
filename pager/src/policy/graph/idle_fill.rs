//! Idle fill: the routed experts most likely to run, read into budget nothing holds
//! while the device has nothing else to do.
//!
//! A router's choice is not known before the token reaches the layer, so an expert a
//! token needs for the first time is a demand read the program waits on. Until the
//! budget is full that wait buys nothing: the room is there, the device idles between
//! the reads the program needs. Filling the room with the experts most likely to run
//! (`ExpertUse::probability`, which starts from the counts an earlier run saved) turns
//! those first uses into hits. The requests are `Urgency::IdleFill`: the service reads
//! them only into free budget and only while no read the program needs is queued, and
//! the policy asks for none once the budget has filled (room freed after that, by a
//! victim larger than the block read in its place or by a token without misses, is
//! taken back by the program's next reads), so once the budget is full they cost
//! nothing, and eviction stays the eviction policy's.
//!
//! Pure: ranks group numbers by probability and walks them once per token.

use super::expert_use::ExpertUse;

/// Which experts are worth reading before they are needed: those seen in use at least
/// once (in this run or the counts an earlier run saved), most probable first. Reading
/// costs device time only while the device idles, but every frame filled costs CPU on
/// the program's cores (allocation, the host's first touch of fresh memory, mapping),
/// so an expert the router has never been seen to pick is left to demand paging: with
/// no evidence it is read on the chance of the prior alone.
///
/// Measured, 3 GiB coarse MoE (16 experts, 2 used), llama-bench tg8 cold, seeded with the
/// counts of one 9-token run (100 of the 272 experts seen in use), alternating with the
/// kernel in a memory cgroup of the budget:
/// - at 50 %, a bar of 1.5x the prior's probability (which an expert used once or twice
///   in 9 tokens stays below, the prior's weight included) filled 47 of the 100 and
///   decoded 6.6-10.3 tok/s with 43 demand faults; the experts seen in use, 15.2 tok/s
///   with 14-15 (kernel 2.0-2.3), reading the same 1.64 GiB in the run;
/// - at 75 %, 7.9-10.2 against 19.2-22.0 tok/s (kernel 4.5), 0-1 demand faults;
///   filling every expert instead, the 170 never seen in use too (1.1 GiB more),
///   decoded 4.2-5.6: the fill went on through the decode;
/// - at 25 % (the budget is full after the first token either way) 5.7-5.8 against
///   4.6-5.3 tok/s, 0.5 % more bytes (kernel 0.4-0.5).
fn worth_filling(experts: &ExpertUse, group: u32) -> bool {
    experts.seen_used(group)
}

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
    /// not wholly resident and `worth_filling` that no earlier plan of this token asked
    /// for. The ranking is renewed at each token, so a group evicted since it was passed
    /// is asked for again from the next token.
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
        let mut out = Vec::with_capacity(GROUPS_PER_PLAN);
        while out.len() < GROUPS_PER_PLAN && self.next < self.ranking.len() {
            let group = self.ranking[self.next];
            self.next += 1;
            if worth_filling(experts, group)
                && !experts.wholly_resident(group)
                && !experts.reading_now(group)
            {
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
        // 3, then 4 (layer 1); 0 and 1 never seen in use.
        use_.seed(2, 100.0, 100.0);
        use_.seed(3, 60.0, 100.0);
        use_.seed(4, 50.0, 100.0);
        for group in [0, 1] {
            use_.seed(group, 0.0, 100.0);
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
        let mut again = fill.next_groups(&use_, 5);
        assert_eq!(again.first(), Some(&4), "used in the token just ended");
        while let groups @ [_, ..] = &fill.next_groups(&use_, 5)[..] {
            again.extend(groups);
        }
        assert!(again.contains(&2), "{again:?}");
    }

    #[test]
    fn an_expert_seen_in_use_once_is_asked_for_however_rarely() {
        let mut use_ = experts();
        // Seen once in 100 tokens: far below the prior of a quarter (0.05 with the
        // prior's weight), yet read into free room; the experts never seen are not.
        use_.seed(1, 1.0, 100.0);
        use_.seed(3, 0.0, 100.0);
        assert!(use_.probability(1) < 0.25 / 4.0);
        let mut fill = IdleFill::default();
        assert_eq!(fill.next_groups(&use_, 5), vec![1]);
        assert!(fill.next_groups(&use_, 5).is_empty());
    }

    #[test]
    fn with_no_preference_learned_nothing_is_asked_for() {
        let use_ = experts();
        assert!(IdleFill::default().next_groups(&use_, 5).is_empty());
    }
}
