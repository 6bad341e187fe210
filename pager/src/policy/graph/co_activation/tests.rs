//! Tests of co-activation's counts, scores and speculation: pure, no kernel.
use super::*;

/// Three layers of four experts: groups 0-3, 4-7, 8-11.
fn three_layers() -> CoActivation {
    CoActivation::new(&[0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2])
}

const QUARTER: &dyn Fn(u32) -> f64 = &|_| 0.25;
/// Every group observable: nothing resident.
const ALL: &dyn Fn(u32) -> bool = &|_| true;

/// `tokens` tokens, each using one expert per layer as `route` picks by token.
fn run(co: &mut CoActivation, tokens: std::ops::Range<u64>, route: impl Fn(u64) -> [u32; 3]) {
    for token in tokens {
        for group in route(token) {
            co.used(token, group, QUARTER, ALL);
        }
    }
}

#[test]
fn with_nothing_learned_the_outlook_is_popularity_and_unused() {
    let mut co = three_layers();
    co.used(0, 1, QUARTER, ALL);
    assert!(!co.pays());
    assert_eq!(co.this_token(5, 0, QUARTER), None);
    // Even asked directly, the prediction of an empty table is popularity.
    let (q, _) = co.predict(0, QUARTER);
    assert!(q.iter().all(|&p| (p - 0.25).abs() < 1e-9), "{q:?}");
}

#[test]
fn a_chain_of_affine_experts_is_learned_scored_and_followed() {
    let mut co = three_layers();
    // Expert e of layer 0 is always followed by e in layer 1 and e in layer 2.
    run(&mut co, 0..200, |t| {
        let e = (t * 7 % 4) as u32;
        [e, 4 + e, 8 + e]
    });
    assert!(
        co.pays(),
        "{} vs {}",
        co.score_conditional,
        co.score_popularity
    );
    let summary = co.summary();
    assert_eq!(
        summary.transitions,
        2 * 200 - 1,
        "the last token's second is still open"
    );
    assert!(summary.hits_co_activation > 0.9, "{summary:?}");
    assert!(summary.hits_popularity < 0.5, "{summary:?}");
    assert!(summary.in_use);
    co.used(200, 2, QUARTER, ALL);
    let next = co.this_token(6, 200, QUARTER).unwrap();
    let other = co.this_token(5, 200, QUARTER).unwrap();
    assert!(next > 0.85, "{next}");
    assert!(other < 0.05, "{other}");
    // Two layers ahead: beyond what the gate judges.
    assert_eq!(co.this_token(10, 200, QUARTER), None);
    // Behind or in the current layer: none.
    assert_eq!(co.this_token(1, 200, QUARTER), None);
    assert_eq!(co.this_token(6, 199, QUARTER), None);
}

#[test]
fn likely_experts_of_the_next_layer_are_speculated_while_they_are_used() {
    let mut co = three_layers();
    run(&mut co, 0..200, |t| {
        let e = (t * 7 % 4) as u32;
        [e, 4 + e, 8 + e]
    });
    let wanted: &dyn Fn(u32) -> bool = &|_| true;
    co.used(200, 2, QUARTER, ALL);
    assert_eq!(co.speculate(200, QUARTER, wanted), [6]);
    assert!(
        co.speculate(200, QUARTER, wanted).is_empty(),
        "once a token"
    );
    co.used(200, 6, QUARTER, ALL);
    assert_eq!(co.summary().speculated_used, 1);
    // Routing changes: the successor is now never used, and speculation stops once
    // its misses are judged.
    let mut asked = 0;
    for token in 201..260 {
        co.used(token, 1, QUARTER, ALL);
        asked += co.speculate(token, QUARTER, wanted).len();
        co.used(token, 7, QUARTER, ALL);
        co.used(token, 11, QUARTER, ALL);
    }
    assert!((8..40).contains(&asked), "{asked}");
    assert!(co.speculate(260, QUARTER, wanted).is_empty());
}

#[test]
fn independent_routing_does_not_pay() {
    let mut co = three_layers();
    let mut state = 12345u64;
    let mut next = move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((state >> 33) % 4) as u32
    };
    let routes: Vec<[u32; 3]> = (0..400).map(|_| [next(), 4 + next(), 8 + next()]).collect();
    run(&mut co, 0..400, |t| routes[t as usize]);
    assert!(co.scored > 300);
    assert!(
        !co.pays(),
        "{} vs {}",
        co.score_conditional,
        co.score_popularity
    );
}

#[test]
fn pairs_round_trip_through_seed() {
    let mut co = three_layers();
    run(&mut co, 0..10, |_| [0, 5, 10]);
    let pairs: Vec<Pair> = co.pairs().collect();
    assert_eq!(
        pairs,
        [
            Pair {
                from: 0,
                to: 5,
                tokens: 10.0
            },
            Pair {
                from: 5,
                to: 10,
                tokens: 9.0
            }
        ]
    );
    // The open token's transition into layer 1 is counted (it has left layer 1),
    // into layer 2 not yet.
    assert_eq!(co.basis(0), 10.0);
    assert_eq!(co.basis(5), 9.0);
    let mut fresh = three_layers();
    fresh.seed(0, co.basis(0), &[(5, 10.0), (9, 3.0), (6, 11.0)]);
    assert_eq!(fresh.basis(0), 10.0);
    let seeded: Vec<Pair> = fresh.pairs().collect();
    let pair = |to, tokens| Pair {
        from: 0,
        to,
        tokens,
    };
    assert_eq!(
        seeded,
        [pair(5, 10.0), pair(6, 10.0)],
        "a pair into another layer is ignored, one above the basis counts as often"
    );
}

#[test]
fn a_layer_with_an_expert_that_could_be_used_unseen_is_not_counted() {
    let mut co = three_layers();
    // Group 6 of layer 1 is resident and unwatched: its use would not fault.
    let unseen: &dyn Fn(u32) -> bool = &|group| group != 6;
    for token in 0..50 {
        for group in [0, 4, 8] {
            co.used(token, group, QUARTER, unseen);
        }
    }
    // Into layer 1: never wholly observed, so nothing counted nor scored; into
    // layer 2: counted.
    assert_eq!(co.basis(0), 0.0);
    assert_eq!(co.basis(4), 49.0);
    assert!(co.pairs().all(|pair| pair.from != 0));
    assert_eq!(co.summary().transitions, 49);
    // Seen used, a group that could go unseen does not stop the count.
    let mut co = three_layers();
    for token in 0..10 {
        for group in [0, 6, 8] {
            co.used(token, group, QUARTER, unseen);
        }
    }
    assert_eq!(co.basis(0), 10.0);
}

#[test]
fn the_last_layer_has_no_outlook_and_a_new_token_starts_clean() {
    let mut co = three_layers();
    run(&mut co, 0..100, |t| {
        let e = (t % 4) as u32;
        [e, 4 + e, 8 + e]
    });
    co.used(100, 8, QUARTER, ALL);
    assert_eq!(co.this_token(0, 100, QUARTER), None);
    co.used(101, 3, QUARTER, ALL);
    assert!(co.this_token(7, 101, QUARTER).unwrap() > 0.75);
}
