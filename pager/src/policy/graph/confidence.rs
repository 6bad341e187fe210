//! Whether the program follows the predicted order, part by part: the adaptive safety
//! of the graph policies. A prediction that fails (a learned order the program no longer
//! follows, a model whose tensor table says one order while the program runs another)
//! turns every prefetch into bytes read and evicted unused; demand paging never does
//! worse than that. So each part of the order keeps a score of how often the program
//! arrived in it where the last plan said it would, and prefetch reads nothing for a
//! part whose score has fallen, until the program is seen following the order there
//! again.
//!
//! A part is judged by its own score once it has been judged a few times; before
//! that, by the score of the whole order, so that a program that follows none of it is
//! found out within a few faults rather than a few in every part. A part's own score
//! starts from the whole's.
//!
//! What counts as "where the plan said": a plan made at position `from` covered the
//! next `reach` positions (the window it read or found requested, the blocks resident
//! after it, which the program runs through without a fault, and one more window of
//! slack for a program briefly ahead of its reads). The next fault that moves the
//! program along the order lands in a step that starts within that reach, or a little
//! behind (a thread lagging behind the one that faulted last): expected. Anywhere else
//! it jumped: a surprise. A program that follows the order is hardly ever surprised;
//! one that visits the order's blocks at random lands in the reach about `reach/len`
//! of the time for each position its block has in the order.

/// Parts the order is cut into; each keeps its own score.
const SECTIONS: u32 = 32;
/// Weight of the newest judgement in a part's score, and judgements a part needs
/// before its score is acted on: a part reacts within a few of its faults.
const PART: Scoring = Scoring {
    weight: 1.0 / 4.0,
    min_judged: 4,
};
/// The same for the whole order's score, which hears every fault: slower, so that a
/// few surprises in one part do not stop prefetch everywhere else.
const WHOLE: Scoring = Scoring {
    weight: 1.0 / 8.0,
    min_judged: 4,
};
/// Where the whole order's score starts for a learned order.
const LEARNED_PRIOR: f32 = 0.75;
/// A part fails below this score and recovers above `RECOVER` (hysteresis: a part does
/// not flip back and forth on every fault near the threshold).
const FAIL: f32 = 0.5;
const RECOVER: f32 = 0.85;

/// The positions a plan covered: from `from`, `reach` positions on.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Planned {
    pub from: u32,
    pub reach: u32,
}

/// How well the program follows each part of an order of `len` positions.
#[derive(Clone, Debug)]
pub struct Confidence {
    len: u32,
    /// The whole order's score, judged by every fault.
    whole: Part,
    parts: Vec<Part>,
    expected: u64,
    surprises: u64,
}

struct Scoring {
    weight: f32,
    min_judged: u32,
}

#[derive(Copy, Clone, Debug)]
struct Part {
    score: f32,
    judged: u32,
    failing: bool,
}

impl Part {
    const TRUSTED: Part = Part {
        score: 1.0,
        judged: 0,
        failing: false,
    };

    fn judge(&mut self, expected: bool, scoring: &Scoring) {
        let sample = if expected { 1.0 } else { 0.0 };
        self.score += scoring.weight * (sample - self.score);
        self.judged = self.judged.saturating_add(1);
        if self.judged >= scoring.min_judged {
            if self.score < FAIL {
                self.failing = true;
            } else if self.score > RECOVER {
                self.failing = false;
            }
        }
    }
}

/// What the judgements so far add up to, for the stats.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct ConfidenceSummary {
    /// Faults that landed where the last plan said.
    pub expected_faults: u64,
    /// Faults that landed elsewhere in the order.
    pub surprise_faults: u64,
    /// Parts of the order prefetch reads nothing for now.
    pub failing_parts: u32,
    pub parts: u32,
}

impl ConfidenceSummary {
    /// Whether the program did not follow the order: most parts failing now, and more
    /// surprises than landings as planned. A saved (learned) order it did not follow is
    /// worth recording again rather than following in the next run.
    pub fn not_followed(&self) -> bool {
        self.failing_parts * 2 >= self.parts && self.surprise_faults > self.expected_faults
    }
}

impl Confidence {
    /// Scores for an order of `len` positions. A `learned` order (one recording run's)
    /// is a guess where a tensor table is knowledge: prefetch waits until the program
    /// is seen following it (the whole order's score starts failing, a few landings as
    /// planned below recovering), so an order it no longer follows costs no read ahead.
    pub fn new(len: u32, learned: bool) -> Self {
        let whole = if learned {
            Part {
                score: LEARNED_PRIOR,
                judged: 0,
                failing: true,
            }
        } else {
            Part::TRUSTED
        };
        Self {
            len,
            whole,
            parts: vec![Part::TRUSTED; SECTIONS.min(len.max(1)) as usize],
            expected: 0,
            surprises: 0,
        }
    }

    fn part_of(&self, position: u32) -> usize {
        let parts = self.parts.len() as u64;
        ((position as u64 * parts) / self.len.max(1) as u64).min(parts - 1) as usize
    }

    /// Judges a fault that put the program at `position`: `expected` when it landed
    /// where the plan said (see `lands_as_planned`). Counted in the part it landed in.
    pub fn judge(&mut self, position: u32, expected: bool) {
        if expected {
            self.expected += 1;
        } else {
            self.surprises += 1;
        }
        let at = self.part_of(position);
        let part = &mut self.parts[at];
        if part.judged == 0 {
            // A part starts from what the whole order says, not from trust: parts judged
            // only now and then would otherwise prefetch on a clean slate each time.
            *part = Part {
                judged: 0,
                ..self.whole
            };
        }
        part.judge(expected, &PART);
        self.whole.judge(expected, &WHOLE);
    }

    /// Whether prefetch should leave the part holding `position` to demand paging.
    pub fn failing(&self, position: u32) -> bool {
        self.part_failing(self.part_of(position))
    }

    /// Whether part `index` is left to demand paging: by its own score once judged
    /// often enough, else by the whole order's.
    fn part_failing(&self, index: usize) -> bool {
        let part = &self.parts[index];
        if part.judged >= PART.min_judged {
            part.failing
        } else {
            self.whole.failing
        }
    }

    pub fn summary(&self) -> ConfidenceSummary {
        ConfidenceSummary {
            expected_faults: self.expected,
            surprise_faults: self.surprises,
            failing_parts: (0..self.parts.len())
                .filter(|&index| self.part_failing(index))
                .count() as u32,
            parts: self.parts.len() as u32,
        }
    }
}

/// Whether a fault that moved the program `ahead` positions past the plan's start, or
/// `behind` positions back from it, landed where `planned` said: in a step that starts
/// within its reach (`into_step`: positions from the start of the landing's step to it;
/// threads share a step's rows, so one of them starts in its middle), or a little
/// behind (`behind` is `Some` only for such a lag).
pub fn lands_as_planned(planned: Planned, ahead: u32, into_step: u32, behind: Option<u32>) -> bool {
    behind.is_some() || ahead.saturating_sub(into_step) <= planned.reach
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_program_that_follows_the_order_keeps_every_part() {
        let mut confidence = Confidence::new(256, false);
        for position in 0..256 * 4 {
            confidence.judge(position % 256, true);
        }
        assert_eq!(confidence.summary().failing_parts, 0);
        assert!((0..256).all(|position| !confidence.failing(position)));
    }

    #[test]
    fn a_part_fails_on_surprises_and_recovers_when_followed_again() {
        let mut confidence = Confidence::new(256, false);
        // The rest of the order is followed.
        for position in (16..256).step_by(2) {
            confidence.judge(position, true);
        }
        // Three surprises are too few to judge by.
        for _ in 0..3 {
            confidence.judge(10, false);
        }
        assert!(!confidence.failing(10));
        confidence.judge(10, false);
        assert!(confidence.failing(10));
        // Only its own part: position 10 is in part 1 of 32 (positions 8..16).
        assert!(confidence.failing(15));
        assert!(!confidence.failing(16));
        // A part not judged yet goes by the whole order, which is mostly followed.
        assert!(!confidence.failing(7));
        // A few expected landings are not enough to trust it again (hysteresis).
        for _ in 0..3 {
            confidence.judge(12, true);
        }
        assert!(confidence.failing(12));
        for _ in 0..10 {
            confidence.judge(12, true);
        }
        assert!(!confidence.failing(12));
        let summary = confidence.summary();
        assert_eq!(summary.surprise_faults, 4);
        assert_eq!(summary.expected_faults, 120 + 13);
    }

    #[test]
    fn random_landings_fail_where_reach_is_a_small_part_of_the_order() {
        // A plan reaching 16 of 256 positions: a program landing at random is expected
        // one time in 16.
        let planned = Planned { from: 0, reach: 16 };
        let mut confidence = Confidence::new(256, false);
        let mut state = 1u32;
        for _ in 0..2000 {
            state = state.wrapping_mul(1_103_515_245).wrapping_add(12345);
            let ahead = (state >> 8) % 256;
            confidence.judge(ahead, lands_as_planned(planned, ahead, 0, None));
        }
        assert!(
            confidence.summary().failing_parts >= 30,
            "{:?}",
            confidence.summary()
        );
    }

    #[test]
    fn a_learned_order_is_given_up_sooner_than_a_tensor_table() {
        let mut table = Confidence::new(256, false);
        let mut learned = Confidence::new(256, true);
        for part in 0..4 {
            table.judge(part * 8, false);
            learned.judge(part * 8, false);
        }
        assert!(!table.failing(100));
        assert!(learned.failing(100));
        // Followed, a learned order is trusted within a few faults.
        let mut followed = Confidence::new(256, true);
        assert!(followed.failing(0));
        for position in 0..4 {
            followed.judge(position, true);
        }
        assert!(!followed.failing(100));
    }

    #[test]
    fn an_order_is_not_followed_when_most_parts_fail_on_more_surprises_than_not() {
        let summary = |failing_parts, surprise_faults, expected_faults| ConfidenceSummary {
            expected_faults,
            surprise_faults,
            failing_parts,
            parts: 32,
        };
        assert!(summary(32, 565, 180).not_followed());
        assert!(summary(16, 100, 99).not_followed());
        // A few parts failing, or a program mostly where planned, is followed.
        assert!(!summary(15, 565, 180).not_followed());
        assert!(!summary(32, 100, 100).not_followed());
        assert!(!summary(0, 0, 0).not_followed());
    }

    #[test]
    fn a_lagging_thread_and_one_in_a_step_begun_are_expected() {
        let planned = Planned { from: 40, reach: 8 };
        assert!(lands_as_planned(planned, 8, 0, None));
        assert!(!lands_as_planned(planned, 9, 0, None));
        assert!(lands_as_planned(planned, 200, 0, Some(3)));
        // 30 positions on, in a step that began 24 positions before: within reach.
        assert!(lands_as_planned(planned, 30, 24, None));
        assert!(!lands_as_planned(planned, 30, 21, None));
    }

    #[test]
    fn the_summary_counts_each_failing_part_once() {
        // 254 positions in 32 parts: parts are not all the same length.
        let mut confidence = Confidence::new(254, false);
        for position in 0..254 {
            confidence.judge(position, true);
        }
        // Only the first part (positions 0..8) fails; a part counted by a position of
        // its neighbour's would count it twice.
        for _ in 0..6 {
            confidence.judge(0, false);
        }
        assert!(confidence.failing(0));
        assert_eq!(confidence.summary().failing_parts, 1);
    }

    #[test]
    fn parts_not_judged_yet_go_by_the_whole_order() {
        let mut confidence = Confidence::new(256, false);
        // Eight surprises, each in another part: no part has its own verdict yet.
        for part in 0..8 {
            confidence.judge(part * 8, false);
        }
        assert!((0..256).all(|position| confidence.failing(position)));
        assert_eq!(confidence.summary().failing_parts, 32);
    }

    #[test]
    fn short_orders_have_a_part_per_position() {
        let mut confidence = Confidence::new(3, false);
        assert_eq!(confidence.summary().parts, 3);
        for _ in 0..8 {
            confidence.judge(1, true);
        }
        for _ in 0..4 {
            confidence.judge(2, false);
        }
        assert!(confidence.failing(2));
        assert!(!confidence.failing(1));
        assert_eq!(Confidence::new(0, false).summary().parts, 1);
    }
}
