//! The graph policies against the floor on a llama-shaped workload: 16 tokens over a
//! ~520 MB model (30 layers, converter file order, 32-byte alignment), 64 KiB blocks,
//! budgets of 1/4, 1/2 and 3/4 of the model.

use std::sync::Arc;

use hyperoffload::graph::{ModelGraph, Transitions};

use crate::cli::sim::{llama::LlamaShape, simulate, SimPolicy, SimReport, Timing, Workload};

const BLOCK: u64 = 64 << 10;
const TOKENS: u32 = 16;

fn workload() -> (LlamaShape, Workload) {
    let shape = LlamaShape::about_500mb();
    let workload = shape.workload(BLOCK, TOKENS);
    (shape, workload)
}

fn run(
    workload: &Workload,
    budget: u64,
    policy: SimPolicy,
    graph: Option<&Arc<ModelGraph>>,
) -> SimReport {
    simulate(workload, budget, policy, None, graph, Timing::default()).unwrap()
}

fn budgets(model: u64) -> [(u64, &'static str); 3] {
    [
        (model / 4, "1/4"),
        (model / 2, "1/2"),
        (model * 3 / 4, "3/4"),
    ]
}

#[test]
fn graph_policy_reads_within_5_percent_of_belady_and_lru_reads_the_model() {
    let (shape, workload) = workload();
    let model = workload.layout.data_len;
    let graph = Arc::new(ModelGraph::from_tensors(
        &shape.tensors(),
        workload.layout.clone(),
    ));
    for (budget, label) in budgets(model) {
        let belady = run(&workload, budget, SimPolicy::Belady, None);
        let graph_report = run(&workload, budget, SimPolicy::Graph, Some(&graph));
        let ratio = graph_report.bytes_read as f64 / belady.bytes_read as f64;
        println!(
            "budget {label}: belady {} graph {} ratio {ratio:.4} (demand misses {})",
            belady.bytes_read, graph_report.bytes_read, graph_report.demand_misses
        );
        assert!(ratio <= 1.05, "budget {label}: graph/belady = {ratio}");

        let lru = run(&workload, budget, SimPolicy::Lru, None);
        for (token, &bytes) in lru.bytes_per_token.iter().enumerate().skip(1) {
            assert!(
                bytes as f64 > 0.9 * model as f64,
                "budget {label}, token {token}: LRU read {bytes} of {model}"
            );
        }
    }
}

#[test]
fn a_graph_learned_from_two_tokens_alone_is_within_5_percent_of_belady() {
    let (_, workload) = workload();
    let model = workload.layout.data_len;
    let learning = workload.tokens(0..2);
    let mut transitions = Transitions::new();
    transitions.observe_all(learning.accesses.iter().copied());
    let graph = Arc::new(ModelGraph::learned(workload.layout.clone(), &transitions));
    let rest = workload.tokens(2..TOKENS as usize);
    for (budget, label) in budgets(model) {
        let belady = run(&rest, budget, SimPolicy::Belady, None);
        let learned = run(&rest, budget, SimPolicy::Graph, Some(&graph));
        let ratio = learned.bytes_read as f64 / belady.bytes_read as f64;
        println!(
            "learned, budget {label}: belady {} graph {} ratio {ratio:.4}",
            belady.bytes_read, learned.bytes_read
        );
        assert!(
            ratio <= 1.05,
            "budget {label}: learned graph/belady = {ratio}"
        );
    }
}
