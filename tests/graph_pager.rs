//! The graph policies driving the real pager: a program reading SmolLM2's tensors in
//! execution order, token after token, under a budget of half the model. Graph-driven
//! eviction keeps a fixed part resident and streams the rest (about M - B bytes read per
//! token); FIFO with readahead re-reads about the whole model per token.

mod common;

use std::sync::Arc;

use common::*;
use hyperoffload::graph::arch::execution_order;
use hyperoffload::graph::{BlockLayout, ModelGraph};
use hyperoffload::model::ModelFile;
use hyperoffload::policy::graph::GraphPrediction;
use hyperoffload::policy::{EvictionKind, PrefetchKind};
use hyperoffload::{MapOptions, Pager};

const TOKENS: usize = 5;
const BLOCK: u64 = 4 << 10;

/// Reads every tensor in execution order `TOKENS` times; returns the bytes read per
/// token after the first, and the bytes one token touches.
fn decode(prefetch: PrefetchKind, eviction: EvictionKind) -> Option<(Vec<u64>, u64, u64)> {
    let path = test_model()?;
    let model = ModelFile::open(&path).unwrap();
    let order = execution_order(&model.tensors);
    let touched: u64 = order
        .steps
        .iter()
        .map(|&i| model.tensors[i].file_range.end - model.tensors[i].file_range.start)
        .sum();
    let budget = model.file_len / 2 / BLOCK * BLOCK;
    let graph = ModelGraph::from_tensors(
        &model.tensors,
        BlockLayout::new(0, model.file_len, BLOCK).unwrap(),
    );
    let prediction = GraphPrediction::new(Arc::new(graph));
    let pager = pager_or_skip(
        Pager::builder()
            .budget(budget)
            .block_size(BLOCK)
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
    assert!(stats.peak_resident_bytes <= budget);
    eprintln!("{prefetch:?}/{eviction:?}: per token {per_token:?} of {touched} touched, budget {budget}; {}", stats.to_json());
    Some((per_token, touched, budget))
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
