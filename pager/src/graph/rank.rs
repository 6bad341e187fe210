//! PageRank over a weighted directed graph: how much of a random walk along the model's
//! dependency edges passes through each node. Nodes every path goes through (the dense
//! layers) rank high; one expert of many, or an embedding row, ranks low.

/// Weighted PageRank. `edges` are `(from, to, weight)` with non-negative weights; a node
/// with no outgoing weight spreads its rank evenly (the usual dangling-node rule), so the
/// ranks always sum to 1. Iterates until the L1 change drops below `1e-10` or 200 rounds.
pub fn page_rank(node_count: usize, edges: &[(usize, usize, f64)], damping: f64) -> Vec<f64> {
    if node_count == 0 {
        return Vec::new();
    }
    let n = node_count as f64;
    let mut out_weight = vec![0.0f64; node_count];
    for &(from, to, weight) in edges {
        if from < node_count && to < node_count && weight > 0.0 {
            out_weight[from] += weight;
        }
    }
    let mut rank = vec![1.0 / n; node_count];
    let mut next = vec![0.0f64; node_count];
    for _ in 0..200 {
        let dangling: f64 = rank
            .iter()
            .zip(&out_weight)
            .filter(|(_, &w)| w <= 0.0)
            .map(|(r, _)| r)
            .sum();
        let base = (1.0 - damping) / n + damping * dangling / n;
        next.iter_mut().for_each(|r| *r = base);
        for &(from, to, weight) in edges {
            if from < node_count && to < node_count && weight > 0.0 {
                next[to] += damping * rank[from] * weight / out_weight[from];
            }
        }
        let change: f64 = rank.iter().zip(&next).map(|(a, b)| (a - b).abs()).sum();
        std::mem::swap(&mut rank, &mut next);
        if change < 1e-10 {
            break;
        }
    }
    rank
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cycle_ranks_evenly() {
        let ranks = page_rank(3, &[(0, 1, 1.0), (1, 2, 1.0), (2, 0, 1.0)], 0.85);
        for r in ranks {
            assert!((r - 1.0 / 3.0).abs() < 1e-9);
        }
    }

    #[test]
    fn a_hub_outranks_its_branches() {
        // 0 -> {1, 2, 3} evenly, each back to 0: the classic star.
        let edges = [
            (0, 1, 1.0),
            (0, 2, 1.0),
            (0, 3, 1.0),
            (1, 0, 1.0),
            (2, 0, 1.0),
            (3, 0, 1.0),
        ];
        let ranks = page_rank(4, &edges, 0.85);
        // Closed form: r1 = 0.15 / 4 + 0.85 r0 / 3 and r0 + 3 r1 = 1 give
        // r0 = 0.8875 / 1.85.
        assert!((ranks[0] - 0.8875 / 1.85).abs() < 1e-9, "{ranks:?}");
        assert!((ranks.iter().sum::<f64>() - 1.0).abs() < 1e-9);
        assert!((ranks[1] - ranks[3]).abs() < 1e-12);
    }

    #[test]
    fn weights_steer_the_walk_and_dangling_nodes_keep_the_mass() {
        let ranks = page_rank(3, &[(0, 1, 9.0), (0, 2, 1.0)], 0.85);
        assert!(ranks[1] > ranks[2]);
        assert!((ranks.iter().sum::<f64>() - 1.0).abs() < 1e-9);
    }
}
