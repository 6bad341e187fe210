//! What `inspect --trace` shows of a mixture of experts' router: a demand trace replayed
//! against the model's graph, and how the router picked experts from token to token
//! beside published figures of real routers.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context};
use hyperoffload::graph::expert_store::ExpertCounts;
use hyperoffload::graph::routing_stats::{token_expert_sets, RoutingStats, Spread};
use hyperoffload::graph::ModelGraph;
use hyperoffload::policy::graph::{expert_use_from_faults, CoActivationSummary};

/// A demand trace recorded on a model, replayed against the graph of the run that
/// recorded it (its block size, and its cuts at the experts' slices).
pub(super) struct TraceReplay {
    pub(super) path: PathBuf,
    graph: Arc<ModelGraph>,
    /// The blocks faulted on, in order, each with the faulting byte's offset in it.
    faults: Vec<(u32, Option<u32>)>,
}

impl TraceReplay {
    pub(super) fn read(trace: &Path, model: &Path) -> anyhow::Result<Self> {
        let mut workload = super::super::simulate::read_trace(trace, None)?;
        let graph = super::super::simulate::trace_model_graph(model, trace, &mut workload)?;
        if graph.experts().is_empty() {
            bail!(
                "{} has no routed experts: --trace shows how a mixture of experts routes",
                model.display()
            );
        }
        let faults = workload
            .accesses
            .iter()
            .copied()
            .zip(workload.offsets.iter().map(|&offset| Some(offset)))
            .collect();
        Ok(Self {
            path: trace.to_path_buf(),
            graph: Arc::new(graph),
            faults,
        })
    }

    /// Expert use counted from the trace, and how well co-activation predicted it.
    pub(super) fn expert_counts(&self) -> anyhow::Result<(ExpertCounts, CoActivationSummary)> {
        expert_use_from_faults(&self.graph, self.faults.iter().copied())
            .context("the model has no routed experts")
    }

    /// How the trace's router picked experts from token to token.
    pub(super) fn routing(&self) -> anyhow::Result<RoutingStats> {
        let sets = token_expert_sets(&self.graph, self.faults.iter().copied());
        sets.stats()
            .with_context(|| format!("measuring the routing of {}", self.path.display()))
    }
}

/// The routing statistics of a trace, beside published figures of real routers.
pub(super) fn print_routing(trace: &Path, stats: &RoutingStats) {
    println!("\n## routing ({})\n", trace.display());
    let used = stats
        .used_per_token
        .map_or_else(|| "none".to_string(), |used| format!("{used:.2}"));
    println!(
        "{} tokens; {} expert layers of {} experts ({} never used); experts a token used in \
         a layer: {used}",
        stats.tokens, stats.layers, stats.experts_per_layer, stats.layers_unused
    );
    println!(
        "\nHit rate of a cache per layer holding a share of the layer's experts: each \
         token's experts looked up as the token found the cache, then put in (every token \
         after the first counts), mean over layers \
         (lowest-highest). A router picking evenly and independently of the previous token \
         hits about the share; real ones more (Qwen3-235B-A22B decode, the last column), and on them \
         LFU loses to LRU at every share.\n"
    );
    println!("| share | experts kept | LRU | LFU | Qwen3-235B LRU |");
    println!("|---|---|---|---|---|");
    for point in &stats.caches {
        println!(
            "| {:.0} % | {} | {} | {} | {:.3} |",
            point.share * 100.0,
            point.experts_kept,
            rate(point.lru),
            rate(point.lfu),
            point.reference_lru
        );
    }
    let losses = (stats.caches.iter()).filter(|p| {
        p.lru
            .zip(p.lfu)
            .is_some_and(|(lru, lfu)| lru.mean > lfu.mean)
    });
    match stats.lfu_loses_everywhere() {
        None => println!("\ntoo few tokens for a hit rate: a trace of 2 tokens at least"),
        Some(true) => println!("\nLFU loses to LRU at every share, as on real routers"),
        Some(false) => println!(
            "\nLFU loses to LRU at {} of {} shares (on real routers, at every share)",
            losses.count(),
            stats.caches.len()
        ),
    }
    print_consecutive(stats);
}

/// How often consecutive tokens chose the same experts, against chance.
fn print_consecutive(stats: &RoutingStats) {
    let c = &stats.consecutive;
    let Some(same) = c.same else {
        println!("no two consecutive tokens used a layer: nothing to compare");
        return;
    };
    println!(
        "consecutive tokens: {} of a token's experts in a layer were the previous token's \
         (independent picks with each layer's popularity: {}); {} of tokens shared at least \
         one (any two tokens: {}; Mixtral 8x7B, of its 2 among 8: 46-67 % against 46 %)",
        percent(Some(same)),
        percent(c.same_by_chance),
        percent(c.any_shared),
        percent(c.any_shared_by_chance)
    );
}

/// `mean (min-max)` of a rate per layer.
fn rate(figure: Option<Spread>) -> String {
    let Some(s) = figure else { return "-".into() };
    format!("{:.3} ({:.3}-{:.3})", s.mean, s.min, s.max)
}

/// `mean % (min-max)` of a share per layer.
fn percent(figure: Option<Spread>) -> String {
    let Some(s) = figure else { return "-".into() };
    let [mean, min, max] = [s.mean, s.min, s.max].map(|share| share * 100.0);
    format!("{mean:.1} % ({min:.1}-{max:.1})")
}
