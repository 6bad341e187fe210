//! What `inspect` shows of a mixture of experts' experts: how many, their slices against
//! the block, the bytes a token reads, and the heat map of how often each runs.

use std::path::Path;

use anyhow::{bail, Context};
use hyperoffload::graph::expert_store::{self, ExpertCount, LoadedCounts};
use hyperoffload::graph::ModelGraph;
use hyperoffload::model::TensorInfo;
use hyperoffload::policy::graph::CoActivationSummary;
use hyperoffload::size::format_size;

use super::super::compare::heat_map::expert_heat_map;
use super::super::compare::model_summary::bytes_per_layer;
use super::routing::TraceReplay;
use super::InspectArgs;

/// Writes the heat map of expert use to `out` (counted from `replay`, the trace, when
/// given), and prints per layer the experts used most.
pub(super) fn write_heat_map(
    args: &InspectArgs,
    graph: &ModelGraph,
    replay: Option<&TraceReplay>,
    out: &Path,
) -> anyhow::Result<()> {
    if graph.experts().is_empty() {
        bail!(
            "{} has no routed experts: no heat map to draw",
            args.model.display()
        );
    }
    let (counts, source) = match replay {
        Some(replay) => {
            let (counts, co_activation) = replay.expert_counts()?;
            print_co_activation(&co_activation);
            (counts, replay.path.clone())
        }
        None => match expert_store::load(&args.model)? {
            LoadedCounts::Fresh { path, counts } => (counts, path),
            LoadedCounts::Stale { path, reason } => {
                bail!(
                    "{} is for another model ({reason}); give --trace",
                    path.display()
                )
            }
            LoadedCounts::Absent => bail!(
                "nothing is known yet of how often {}'s experts run: run it under the pager \
                 once (the graph policy saves what it learns), or give --trace",
                args.model.display()
            ),
        },
    };
    let title = format!(
        "{}: share of tokens using each expert ({})",
        args.model
            .file_name()
            .map_or_else(String::new, |name| name.to_string_lossy().into_owned()),
        source.display()
    );
    std::fs::write(out, expert_heat_map(&title, &counts))
        .with_context(|| format!("writing {}", out.display()))?;
    println!("\n## expert use ({})\n", source.display());
    println!("| layer | tokens | most used experts (share of tokens) |");
    println!("|---|---|---|");
    let mut by_layer: std::collections::BTreeMap<u32, Vec<&ExpertCount>> = Default::default();
    for count in &counts.experts {
        by_layer.entry(count.layer).or_default().push(count);
    }
    for (layer, mut experts) in by_layer {
        let share = |c: &ExpertCount| c.uses / c.tokens.max(f64::MIN_POSITIVE);
        experts.sort_by(|a, b| share(b).total_cmp(&share(a)));
        let tokens = experts.iter().map(|c| c.tokens).fold(0.0, f64::max);
        let top: Vec<String> = experts
            .iter()
            .take(4)
            .map(|c| format!("{} ({:.0} %)", c.expert, share(c) * 100.0))
            .collect();
        println!("| {layer} | {tokens:.0} | {} |", top.join(", "));
    }
    println!("\nheat map: {}", out.display());
    Ok(())
}

/// How predictable the trace's routing was from one layer to the next.
fn print_co_activation(summary: &CoActivationSummary) {
    println!(
        "\n## co-activation\n\nOver {} transitions from one expert layer to the next, replayed \
         in order as the pager learns them: of the {:.2} experts a token used in the next \
         layer, {:.2} were among as many most likely given the experts it used in this one, \
         {:.2} among the most popular; eviction {} co-activation at the end.",
        summary.transitions,
        summary.experts_per_transition,
        summary.hits_co_activation,
        summary.hits_popularity,
        if summary.in_use {
            "follows"
        } else {
            "does not follow"
        }
    );
}

/// The layers of a mixture of experts that have none (DeepSeek's and GLM's leading
/// dense layers): paged as every token's, like attention.
pub(super) fn dense_layers(graph: &ModelGraph, tensors: &[TensorInfo]) -> Vec<u32> {
    let expert_layers: std::collections::BTreeSet<u32> =
        graph.experts().groups().iter().map(|g| g.layer).collect();
    bytes_per_layer(tensors)
        .into_keys()
        .flatten()
        .filter(|layer| !expert_layers.contains(layer))
        .collect()
}

/// The routed experts as the pager sees them: how many per layer and per token, the
/// size of an expert's slices against the block, and the bytes one token reads: every
/// tensor outside the experts plus the used share of them (the model's sparsity).
pub(super) fn print_experts(
    graph: &ModelGraph,
    tensors: &[TensorInfo],
    weights: u64,
    shared: Option<u32>,
) {
    let experts = graph.experts();
    if experts.is_empty() {
        return;
    }
    let groups = experts.groups();
    let layers: std::collections::BTreeSet<u32> = groups.iter().map(|g| g.layer).collect();
    let slices: Vec<u64> = groups
        .iter()
        .flat_map(|g| g.bytes.iter().map(|r| r.end - r.start))
        .collect();
    let expert_bytes: u64 = slices.iter().sum();
    let (smallest, largest) = (
        slices.iter().copied().min().unwrap_or(0),
        slices.iter().copied().max().unwrap_or(0),
    );
    let used = experts.prior_use();
    let per_token = weights.saturating_sub(expert_bytes) as f64 + expert_bytes as f64 * used;
    println!("\n## experts\n");
    println!(
        "{} experts in each of {} layers, {} of them used per token ({:.1} %): {} of routed \
         experts ({:.1} % of the weights)",
        experts.experts_per_layer(),
        layers.len(),
        match experts.used_per_token() {
            Some(used) => used.to_string(),
            None => "an unknown number".to_string(),
        },
        used * 100.0,
        format_size(expert_bytes),
        expert_bytes as f64 * 100.0 / weights.max(1) as f64
    );
    if let Some(shared) = shared {
        println!(
            "{shared} shared expert(s) per layer besides, run by every token: paged as the \
             layer's attention is, not as routed experts"
        );
    }
    let dense = dense_layers(graph, tensors);
    if !dense.is_empty() {
        let names: Vec<String> = dense.iter().map(u32::to_string).collect();
        println!(
            "dense layer(s) without experts, run whole by every token: {}",
            names.join(", ")
        );
    }
    print_slices(graph, (smallest, largest), per_token, weights);
}

/// An expert slice's size against the blocks, what one token reads (`per_token` bytes
/// of `weights`), and how the blocks are cut.
fn print_slices(graph: &ModelGraph, (smallest, largest): (u64, u64), per_token: f64, weights: u64) {
    let geometry = graph.geometry();
    let block = geometry.block_size;
    // What a miss on a slice reads: the blocks holding any of it.
    let worst_read = graph
        .experts()
        .groups()
        .iter()
        .flat_map(|g| g.bytes.iter())
        .map(|slice| {
            let read = geometry.data_range(geometry.blocks_overlapping(slice.clone()));
            (read.end - read.start) as f64 / (slice.end - slice.start).max(1) as f64
        })
        .fold(0.0, f64::max);
    println!(
        "an expert's slice is {} to {} ({:.2} to {:.2} blocks of {}); one token reads about {} \
         ({:.1} % of the weights): the tensors every token reads and its experts",
        format_size(smallest),
        format_size(largest),
        smallest as f64 / block as f64,
        largest as f64 / block as f64,
        format_size(block),
        format_size(per_token as u64),
        per_token * 100.0 / weights.max(1) as f64
    );
    let cut = if geometry.is_uniform() {
        "blocks follow the grid alone"
    } else {
        "blocks are cut at every slice"
    };
    println!(
        "{cut} ({} blocks in all): reading a slice reads at most {worst_read:.2}x its bytes",
        geometry.block_count()
    );
}
