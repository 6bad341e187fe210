//! Tests of the routing statistics on generated traces: pure, no kernel.
use super::*;
use rand::rngs::SmallRng;
use rand::seq::index::sample;
use rand::{Rng, SeedableRng};

/// `tokens` tokens of `layers` layers, each layer's experts from `pick(token, the
/// previous token's)`.
fn trace(
    tokens: usize,
    layers: usize,
    mut pick: impl FnMut(usize, &[u32]) -> Vec<u32>,
) -> Vec<Vec<Vec<u32>>> {
    let mut out: Vec<Vec<Vec<u32>>> = Vec::new();
    for t in 0..tokens {
        let token = (0..layers)
            .map(|l| pick(t, out.last().map_or(&[][..], |p| p[l].as_slice())))
            .collect();
        out.push(token);
    }
    out
}

fn uniform(rng: &mut SmallRng, experts: u32, used: usize) -> Vec<u32> {
    let picks = sample(rng, experts as usize, used).into_iter();
    picks.map(|e| e as u32).collect()
}

fn mean(figure: Option<Spread>) -> f64 {
    figure.expect("measured").mean
}

#[test]
fn an_independent_uniform_router_hits_about_the_share() {
    let mut rng = SmallRng::seed_from_u64(7);
    let tokens = trace(1500, 4, |_, _| uniform(&mut rng, 128, 8));
    let stats = RoutingStats::measure(&tokens, 128).unwrap();
    assert_eq!(stats.caches.len(), 5);
    for (point, kept) in stats.caches.iter().zip([6, 15, 26, 46, 70]) {
        assert_eq!(point.experts_kept, kept);
        let expected = kept as f64 / 128.0;
        assert!((mean(point.lru) - expected).abs() < 0.03, "{point:?}");
        assert!((mean(point.lfu) - expected).abs() < 0.05, "{point:?}");
    }
    let c = &stats.consecutive;
    assert!((mean(c.same) - 8.0 / 128.0).abs() < 0.01, "{c:?}");
    assert!((mean(c.same_by_chance) - 8.0 / 128.0).abs() < 0.01, "{c:?}");
    // 1 - C(120, 8) / C(128, 8): about 0.41.
    assert!((mean(c.any_shared) - 0.41).abs() < 0.04, "{c:?}");
    assert!((mean(c.any_shared_by_chance) - 0.41).abs() < 0.02, "{c:?}");
    assert_eq!(stats.used_per_token, Some(8.0));
    assert_eq!((stats.layers, stats.layers_unused), (4, 0));
}

#[test]
fn a_sticky_router_hits_far_above_the_share() {
    let mut rng = SmallRng::seed_from_u64(8);
    // Each of a token's 8 experts is its predecessor's with probability 0.9.
    let tokens = trace(1000, 3, |_, previous| {
        let kept = previous.iter().copied().filter(|_| rng.gen_bool(0.9));
        let mut set: Vec<u32> = kept.collect();
        while set.len() < 8 {
            let e = rng.gen_range(0..128);
            if !set.contains(&e) {
                set.push(e);
            }
        }
        set
    });
    let stats = RoutingStats::measure(&tokens, 128).unwrap();
    assert!(mean(stats.caches[1].lru) > 0.8, "{:?}", stats.caches[1]);
    assert!(mean(stats.caches[4].lru) > 0.85);
    let c = &stats.consecutive;
    assert!(mean(c.same) > 0.85 && mean(c.same_by_chance) < 0.2, "{c:?}");
    assert!(mean(c.any_shared) > 0.99);
}

#[test]
fn lfu_loses_to_lru_when_popularity_drifts() {
    let mut rng = SmallRng::seed_from_u64(9);
    // 4 picked in a window of 8 of 64 experts that moves by 8 every 200 tokens.
    let tokens = trace(1600, 2, |t, _| {
        let base = (t / 200 * 8 % 64) as u32;
        let picks = uniform(&mut rng, 8, 4).into_iter();
        picks.map(|e| base + e).collect()
    });
    let stats = RoutingStats::measure(&tokens, 64).unwrap();
    let point = &stats.caches[1];
    assert_eq!(point.experts_kept, 8);
    assert!(mean(point.lru) > 0.9, "{point:?}");
    assert!(mean(point.lfu) < mean(point.lru) - 0.2, "{point:?}");
    assert_eq!(stats.lfu_loses_everywhere(), Some(true));
}

#[test]
fn a_lasting_hot_set_favours_lfu() {
    let mut rng = SmallRng::seed_from_u64(10);
    // Experts 0..4 always, and 4 of the other 60 at random: LFU keeps the four.
    let tokens = trace(800, 1, |_, _| {
        let mut set = vec![0, 1, 2, 3];
        set.extend(uniform(&mut rng, 60, 4).into_iter().map(|e| e + 4));
        set
    });
    let stats = RoutingStats::measure(&tokens, 64).unwrap();
    let point = &stats.caches[1];
    assert!(mean(point.lfu) > mean(point.lru), "{point:?}");
    assert_eq!(stats.lfu_loses_everywhere(), Some(false));
}

#[test]
fn one_token_unused_layers_and_no_experts_give_clear_results() {
    let one = RoutingStats::measure(&[vec![vec![1, 2], vec![]]], 4).unwrap();
    assert_eq!((one.tokens, one.layers, one.layers_unused), (1, 2, 1));
    assert!(one
        .caches
        .iter()
        .all(|p| p.lru.is_none() && p.lfu.is_none()));
    assert_eq!(one.consecutive.same, None);
    assert_eq!(one.consecutive.any_shared_by_chance, None);
    assert_eq!(one.lfu_loses_everywhere(), None);

    // Layer 1 never used; layer 0 repeats: measured over layer 0 alone.
    let tokens = vec![vec![vec![3], vec![]], vec![vec![3, 3]]];
    let stats = RoutingStats::measure(&tokens, 4).unwrap();
    assert_eq!((stats.layers, stats.layers_unused), (2, 1));
    assert_eq!(stats.used_per_token, Some(1.0));
    assert_eq!(
        stats.caches[0].lru.map(|s| (s.mean, s.layers)),
        Some((1.0, 1))
    );
    assert_eq!(mean(stats.consecutive.same), 1.0);
    assert_eq!(mean(stats.consecutive.same_by_chance), 1.0);

    let no_experts = Err(RoutingStatsError::NoExperts);
    assert_eq!(RoutingStats::measure(&tokens, 0), no_experts);
    assert_eq!(TokenExperts::default().stats(), no_experts);
    assert!(matches!(
        RoutingStats::measure(&tokens, 3),
        Err(RoutingStatsError::ExpertOutOfRange { expert: 3, .. })
    ));
    let empty = RoutingStats::measure(&[], 8).unwrap();
    assert_eq!((empty.tokens, empty.used_per_token), (0, None));
    assert!(empty
        .caches
        .iter()
        .all(|p| p.experts_kept >= 1 && p.lru.is_none()));
}

#[test]
fn a_cache_smaller_than_a_token_keeps_its_latest_experts() {
    // 1 slot, 2 experts a token, always the same two in the same order: 1 slot
    // keeps the token's last, which the next token finds (half its picks); 2 hold
    // both.
    let stats = RoutingStats::measure(&vec![vec![vec![0, 1]]; 10], 20).unwrap();
    let kept: Vec<u32> = stats.caches.iter().map(|p| p.experts_kept).collect();
    assert_eq!(kept, [1, 2, 4, 7, 11]);
    assert_eq!(mean(stats.caches[0].lru), 0.5);
    assert_eq!(
        (mean(stats.caches[1].lru), mean(stats.caches[1].lfu)),
        (1.0, 1.0)
    );
}
