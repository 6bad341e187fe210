//! The graph policies driving the real pager: a program reading SmolLM2's tensors in
//! execution order, token after token, under a budget of half the model. Graph-driven
//! eviction keeps a fixed part resident and streams the rest (about M - B bytes read per
//! token); FIFO with readahead re-reads about the whole model per token.

mod common;

use std::sync::Arc;

use common::*;
use hyperoffload::geometry::BlockGeometry;
use hyperoffload::graph::arch::execution_order;
use hyperoffload::graph::ModelGraph;
use hyperoffload::model::ModelFile;
use hyperoffload::policy::graph::GraphPrediction;
use hyperoffload::policy::{EvictionKind, PrefetchKind};
use hyperoffload::{MapOptions, Pager};

const TOKENS: usize = 5;
const BLOCK: u64 = 4 << 10;

/// Reads every tensor in execution order `TOKENS` times under half the model in
/// 4 KiB blocks; returns the bytes read per token after the first, and the bytes one
/// token touches.
fn decode(prefetch: PrefetchKind, eviction: EvictionKind) -> Option<(Vec<u64>, u64, u64)> {
    decode_with(prefetch, eviction, (1, 2), BLOCK, false)
        .map(|(per_token, touched, budget, _)| (per_token, touched, budget))
}

/// As `decode`, with a budget of `share` (numerator, denominator) of the file and
/// blocks of `block` bytes, zero copy or not; also returns the bytes the graph
/// policies planned to stream per token.
fn decode_with(
    prefetch: PrefetchKind,
    eviction: EvictionKind,
    share: (u64, u64),
    block: u64,
    zero_copy: bool,
) -> Option<(Vec<u64>, u64, u64, u64)> {
    let path = test_model()?;
    let model = ModelFile::open(&path).unwrap();
    let order = execution_order(&model.tensors);
    let touched: u64 = order
        .steps
        .iter()
        .map(|&i| model.tensors[i].file_range.end - model.tensors[i].file_range.start)
        .sum();
    let budget = model.file_len * share.0 / share.1 / block * block;
    let graph = ModelGraph::from_tensors(
        &model.tensors,
        BlockGeometry::new(0, model.file_len, block).unwrap(),
    );
    let prediction = GraphPrediction::new(Arc::new(graph));
    let pager = pager_or_skip(
        Pager::builder()
            .budget(budget)
            .block_size(block)
            .zero_copy(zero_copy)
            .prefetch(prefetch.build_with(Some(&prediction)))
            .eviction(eviction.build_with(Some(&prediction))),
    )?;
    let region = pager.map_file(&path, MapOptions::default()).unwrap();
    let bytes = region.as_slice();
    let expected = std::fs::read(&path).unwrap();
    let mut per_token = Vec::new();
    let mut before = 0;
    for token in 0..TOKENS {
        // A few embedding rows, then every tensor of the pass.
        if let Some(embedding) = order.rows_only {
            let range = &model.tensors[embedding].file_range;
            let row = (range.end - range.start) / 49152;
            let at = (range.start + row * (token as u64 * 97 % 49152)) as usize;
            assert_eq!(
                bytes[at..at + row as usize],
                expected[at..at + row as usize]
            );
        }
        for &step in &order.steps {
            let range = &model.tensors[step].file_range;
            let (start, end) = (range.start as usize, range.end as usize);
            assert!(
                bytes[start..end] == expected[start..end],
                "{}",
                model.tensors[step].name
            );
        }
        let read = pager.stats().bytes_read;
        if token > 0 {
            per_token.push(read - before);
        }
        before = read;
    }
    let stats = pager.stats();
    assert_eq!(stats.invariant_breaches, 0, "{stats:?}");
    assert!(stats.peak_resident_bytes <= budget);
    eprintln!("{prefetch:?}/{eviction:?}: per token {per_token:?} of {touched} touched, budget {budget}; {}", stats.to_json());
    let plan = prediction.stream_plan();
    if plan.streams() {
        // The blocks kept are resident at the end: eviction took streamed ones.
        let order = prediction.graph().order();
        let kept: Vec<u32> = (0..model.file_len.div_ceil(block) as u32)
            .filter(|&b| order.contains(b) && !plan.is_streamed(b))
            .collect();
        let base = bytes.as_ptr() as usize;
        let evicted: Vec<u32> = kept
            .iter()
            .copied()
            .filter(|&b| {
                !pages_present(base + b as usize * block as usize, block as usize)
                    .into_iter()
                    .any(|present| present)
            })
            .collect();
        eprintln!("{} kept blocks, not resident: {evicted:?}", kept.len());
        assert!(
            evicted.len() * 20 <= kept.len(),
            "kept blocks evicted: {evicted:?} of {}",
            kept.len()
        );
    }
    Some((per_token, touched, budget, plan.streamed_bytes))
}

#[test]
fn graph_policies_stream_only_what_cannot_stay_resident() {
    let Some((per_token, touched, budget)) = decode(PrefetchKind::Graph, EvictionKind::Graph)
    else {
        return;
    };
    // The floor is M - B; on top of it the pager keeps reads in flight ahead of use
    // (they hold budget, up to an eighth of it), a sizeable share on a 94 MiB model
    // read at memory speed: on average 1.2x the floor, where FIFO reads about 2x.
    let floor = touched - budget;
    let mean = per_token.iter().sum::<u64>() as f64 / per_token.len() as f64;
    assert!(
        mean <= 1.2 * floor as f64,
        "graph read {per_token:?} per token, floor {floor}"
    );
}

/// With three quarters of the model in budget the graph policies stream a set of blocks
/// spread evenly along the order (the launcher's 2 MiB blocks, zero copy): the blocks
/// kept stay mapped, each token reads no more than the set, every byte still right.
#[test]
fn graph_policies_stream_a_spread_set_at_three_quarters() {
    let Some((per_token, touched, budget, planned)) = decode_with(
        PrefetchKind::Graph,
        EvictionKind::Graph,
        (3, 4),
        2 << 20,
        true,
    ) else {
        return;
    };
    let floor = touched - budget;
    // The set is M - B plus the room its blocks need while resident: a window of 8 MiB
    // and a step's share ahead and behind, large beside a 94 MiB model. A token reads
    // about M - B of it (32.5 MB here against a set of 54 and a floor of 23), so the
    // bound on bytes is loose; which blocks stay is what `decode_with` checks.
    assert!(planned > floor, "planned {planned}, floor {floor}");
    let mean = per_token.iter().sum::<u64>() as f64 / per_token.len() as f64;
    assert!(
        mean <= 1.1 * planned as f64,
        "read {per_token:?} per token, planned {planned} (floor {floor})"
    );
}

#[test]
fn fifo_rereads_about_the_whole_model_per_token() {
    let Some((per_token, touched, _)) = decode(PrefetchKind::Readahead, EvictionKind::Fifo) else {
        return;
    };
    // Per token the figure swings (86-111 MB seen at 4 KiB blocks, readahead runs past
    // token boundaries); on average FIFO re-reads about the whole model.
    let mean = per_token.iter().sum::<u64>() as f64 / per_token.len() as f64;
    assert!(
        mean >= 0.85 * touched as f64,
        "fifo read {per_token:?} per token of {touched}"
    );
}
