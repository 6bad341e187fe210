//! `hyperoffload inspect`: what a model file holds and how the pager will see it: the
//! tensor table, sizes per layer and per kind, the predicted execution order, the most
//! central nodes, and the graph for Graphviz; for a mixture of experts and a trace of it,
//! how its router picks experts from token to token.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::compare::heat_map::expert_heat_map;
use super::compare::model_summary::{
    bytes_per_kind, bytes_per_layer, predicted_order, to_dot, top_nodes,
};
use anyhow::{bail, Context};
use clap::Args;
use hyperoffload::geometry::BlockGeometry;
use hyperoffload::graph::expert_store::{self, ExpertCount, ExpertCounts, LoadedCounts};
use hyperoffload::graph::experts::model_block_cuts;
use hyperoffload::graph::routing_stats::{token_expert_sets, RoutingStats, Spread};
use hyperoffload::graph::{ModelGraph, PartTensors};
use hyperoffload::model::{ModelFile, TensorInfo};
use hyperoffload::policy::graph::{expert_use_from_faults, CoActivationSummary};
use hyperoffload::size::format_size;
use serde_json::json;

use super::size_arg;

#[derive(Args, Debug)]
pub struct InspectArgs {
    /// A GGUF or safetensors file (any part of a split GGUF: the whole model is shown).
    model: PathBuf,
    /// Block size the graph is built for (the pager's block size).
    #[arg(long, value_parser = size_arg, default_value = "2M")]
    block: u64,
    /// How many of the most central nodes to list.
    #[arg(long, default_value_t = 15)]
    top: usize,
    /// Print the model graph in Graphviz dot format instead of the summary.
    #[arg(long, conflicts_with = "json")]
    dot: bool,
    /// Print the summary as one JSON object, for scripts.
    #[arg(long)]
    json: bool,
    /// Also list every tensor.
    #[arg(long)]
    tensors: bool,
    /// For a mixture of experts: write an SVG heat map of how often each expert runs
    /// (layers by experts) to this file, from what earlier runs of the model learned
    /// (saved beside it), or from `--trace`.
    #[arg(long)]
    heat_map: Option<PathBuf>,
    /// For a mixture of experts: a demand trace of the model (`hyperoffload run --policy
    /// demand --trace`, one file). Prints how its router picks experts from token to
    /// token (per-layer LRU and LFU hit rates against the share of experts kept, and how
    /// often a token reuses the previous token's experts), beside published figures of
    /// real routers; with --heat-map, the map counts expert use from it too.
    #[arg(long)]
    trace: Option<PathBuf>,
}

pub fn run(args: InspectArgs) -> anyhow::Result<()> {
    let model = ModelFile::open(&args.model)?;
    // The model's files: this one, or every part of the split model it belongs to.
    let files = super::split_parts_or_warn(&model).unwrap_or_else(|| vec![model.clone()]);
    let split = files.len() > 1;
    let graph = model_graph(&model, &files, args.block)?;
    // Each tensor with the part (1-based) holding it.
    let tensors: Vec<(usize, &TensorInfo)> = files
        .iter()
        .enumerate()
        .flat_map(|(part, file)| file.tensors.iter().map(move |tensor| (part + 1, tensor)))
        .collect();
    let all_tensors: Vec<TensorInfo> = tensors.iter().map(|(_, t)| (*t).clone()).collect();
    if args.dot {
        print!("{}", to_dot(&graph));
        return Ok(());
    }
    let weights: u64 = all_tensors
        .iter()
        .map(|t| t.file_range.end - t.file_range.start)
        .sum();
    let replay = match &args.trace {
        Some(trace) => Some(TraceReplay::read(trace, &args.model)?),
        None => None,
    };
    let routing = replay.as_ref().map(TraceReplay::routing).transpose()?;
    if args.json {
        let summary = json_summary(&args, &files, &graph, &tensors, weights, routing.as_ref());
        println!("{}", serde_json::to_string_pretty(&summary)?);
        if let Some(out) = &args.heat_map {
            write_heat_map(&args, &graph, replay.as_ref(), out)?;
        }
        return Ok(());
    }
    print_header(&args.model, &files, &graph, all_tensors.len(), weights);
    if args.tensors {
        print_tensor_table(&tensors, split);
    }
    print_sizes(&all_tensors);
    print_experts(
        &graph,
        &all_tensors,
        weights,
        files.first().and_then(ModelFile::shared_experts),
    );
    if let (Some(stats), Some(trace)) = (&routing, &args.trace) {
        print_routing(trace, stats);
    }
    if let Some(out) = &args.heat_map {
        write_heat_map(&args, &graph, replay.as_ref(), out)?;
    }
    print_order_and_centrality(&graph, &all_tensors, args.top);
    Ok(())
}

/// The graph of the model of `files` (`model` alone, or the parts of the split model it
/// belongs to) in blocks of `block`, cut at the experts' slices as the pager cuts them.
fn model_graph(model: &ModelFile, files: &[ModelFile], block: u64) -> anyhow::Result<ModelGraph> {
    let graph = if files.len() > 1 {
        ModelGraph::from_parts(
            &files.iter().map(PartTensors::from).collect::<Vec<_>>(),
            block,
        )?
    } else {
        let cuts = model_block_cuts(model, hyperoffload::sys::memory::page_size());
        ModelGraph::from_tensors(
            &model.tensors,
            BlockGeometry::new(0, model.file_len, block)?.with_file_cuts(cuts)?,
        )
    };
    Ok(graph.with_experts_used(model.experts_used()))
}

/// The summary's first lines: the model's files and graph, and the lag eviction spares.
fn print_header(
    model: &Path,
    files: &[ModelFile],
    graph: &ModelGraph,
    tensor_count: usize,
    weights: u64,
) {
    let file_len: u64 = files.iter().map(|file| file.file_len).sum();
    let split = files.len() > 1;
    let holder = if split {
        format!(
            "a model split in {} files of {} in all",
            files.len(),
            format_size(file_len)
        )
    } else {
        format!("a {} file", format_size(file_len))
    };
    let architecture = files
        .first()
        .and_then(ModelFile::architecture)
        .map(|arch| format!(", architecture {arch}"))
        .unwrap_or_default();
    println!(
        "{}: {tensor_count} tensors, {} of weights in {holder}{architecture}, graph of {} nodes ({})",
        model.display(),
        format_size(weights),
        graph.graph().node_count(),
        graph.source()
    );
    if split {
        for file in files {
            println!("  {} ({})", file.path.display(), format_size(file.file_len));
        }
    }
    println!(
        "eviction spares up to {} behind the latest fault (back to the start of its step; the largest step, which threads share)",
        format_size(graph.lag_guard() as u64 * graph.geometry().block_size)
    );
}

/// What the text summary shows, as JSON: the files, the graph, bytes per layer and
/// kind, the experts, the predicted order, with --tensors every tensor, and with
/// --trace the routing statistics.
fn json_summary(
    args: &InspectArgs,
    files: &[ModelFile],
    graph: &ModelGraph,
    tensors: &[(usize, &TensorInfo)],
    weights: u64,
    routing: Option<&RoutingStats>,
) -> serde_json::Value {
    let all: Vec<TensorInfo> = tensors.iter().map(|(_, t)| (*t).clone()).collect();
    let layout = graph.geometry();
    let layers: Vec<serde_json::Value> = bytes_per_layer(&all)
        .into_iter()
        .map(|(layer, (bytes, count))| json!({"layer": layer, "tensors": count, "bytes": bytes}))
        .collect();
    let kinds: Vec<serde_json::Value> = bytes_per_kind(&all)
        .into_iter()
        .map(|(kind, (bytes, count, types))| {
            json!({"kind": kind, "tensors": count, "bytes": bytes, "types": types})
        })
        .collect();
    let experts = graph.experts();
    let experts = (!experts.is_empty()).then(|| {
        let routed: u64 = (experts.groups().iter())
            .flat_map(|group| group.bytes.iter().map(|range| range.end - range.start))
            .sum();
        json!({
            "per_layer": experts.experts_per_layer(),
            "used_per_token": experts.used_per_token(),
            "shared_per_layer": files.first().and_then(ModelFile::shared_experts),
            "dense_layers": dense_layers(graph, &all),
            "routed_bytes": routed,
        })
    });
    let mut summary = json!({
        "model": args.model,
        "files": files.iter().map(|file| json!({"path": file.path, "size": file.file_len})).collect::<Vec<_>>(),
        "architecture": files.first().and_then(ModelFile::architecture),
        "tensors": all.len(),
        "weights_bytes": weights,
        "graph": {
            "source": graph.source().to_string(),
            "nodes": graph.graph().node_count(),
            "block_size": layout.block_size,
            "lag_guard_bytes": graph.lag_guard() as u64 * layout.block_size,
        },
        "layers": layers,
        "kinds": kinds,
        "experts": experts,
        "order": predicted_order(&all),
    });
    if args.tensors {
        summary["tensor_table"] = tensors
            .iter()
            .map(|(part, tensor)| {
                json!({
                    "name": tensor.name,
                    "type": tensor.dtype.to_string(),
                    "shape": tensor.shape,
                    "offset": tensor.file_range.start,
                    "bytes": tensor.file_range.end - tensor.file_range.start,
                    "part": part,
                })
            })
            .collect();
    }
    if let (Some(stats), Some(trace)) = (routing, &args.trace) {
        summary["routing"] = json!({
            "trace": trace,
            "stats": stats,
            "lfu_loses_everywhere": stats.lfu_loses_everywhere(),
        });
    }
    summary
}

/// Every tensor in file order, with the part holding it for a split model.
fn print_tensor_table(tensors: &[(usize, &TensorInfo)], split: bool) {
    println!("\n## tensors (file order)\n");
    println!("| name | type | shape | offset | size |");
    println!("|---|---|---|---|---|");
    for (part, tensor) in tensors {
        let offset = tensor.file_range.start;
        let place = if split {
            format!("{offset} in part {part}")
        } else {
            offset.to_string()
        };
        println!(
            "| {} | {} | {:?} | {place} | {} |",
            tensor.name,
            tensor.dtype,
            tensor.shape,
            format_size(tensor.file_range.end - offset)
        );
    }
}

/// Bytes per layer and per kind of tensor.
fn print_sizes(tensors: &[TensorInfo]) {
    println!("\n## bytes per layer\n");
    println!("| layer | tensors | size |");
    println!("|---|---|---|");
    for (layer, (bytes, count)) in bytes_per_layer(tensors) {
        let name = layer.map_or_else(|| "outside layers".to_string(), |l| l.to_string());
        println!("| {name} | {count} | {} |", format_size(bytes));
    }
    println!("\n## bytes per kind\n");
    println!("| kind | tensors | size | types |");
    println!("|---|---|---|---|");
    for (kind, (bytes, count, types)) in bytes_per_kind(tensors) {
        println!(
            "| {kind} | {count} | {} | {} |",
            format_size(bytes),
            types.join(", ")
        );
    }
}

/// The predicted execution order of one token and the most central `top` nodes.
fn print_order_and_centrality(graph: &ModelGraph, tensors: &[TensorInfo], top: usize) {
    let order = predicted_order(tensors);
    println!(
        "\n## predicted execution order (one token, {} steps)\n",
        order.len()
    );
    for (step, name) in order.iter().enumerate() {
        println!("{step:5}  {name}");
    }
    println!("\n## most central nodes (PageRank)\n");
    let all = top_nodes(graph, usize::MAX);
    if ranks_alike(all.iter().map(|&(_, rank, _)| rank)) {
        // A plain cycle of tensors (a dense model, each tensor once per token): every
        // node ranks the same, and a table of equal ranks would say nothing.
        println!(
            "every node ranks the same: each runs once per token, one after the other, \
             so eviction goes by the predicted order alone"
        );
        return;
    }
    println!("| node | rank | size |");
    println!("|---|---|---|");
    for (name, rank, bytes) in all.into_iter().take(top) {
        println!("| {name} | {rank:.5} | {} |", format_size(bytes));
    }
}

/// Whether the ranks differ by less than 1 % (or there are none).
fn ranks_alike(ranks: impl Iterator<Item = f64>) -> bool {
    let (low, high) = ranks.fold((f64::INFINITY, 0.0f64), |(low, high), rank| {
        (low.min(rank), high.max(rank))
    });
    high <= low * 1.01 || high == 0.0
}

/// Writes the heat map of expert use to `out` (counted from `replay`, the trace, when
/// given), and prints per layer the experts used most.
fn write_heat_map(
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

/// A demand trace recorded on a model, replayed against the graph of the run that
/// recorded it (its block size, and its cuts at the experts' slices).
struct TraceReplay {
    path: PathBuf,
    graph: Arc<ModelGraph>,
    /// The blocks faulted on, in order, each with the faulting byte's offset in it.
    faults: Vec<(u32, Option<u32>)>,
}

impl TraceReplay {
    fn read(trace: &Path, model: &Path) -> anyhow::Result<Self> {
        let mut workload = super::simulate::read_trace(trace, None)?;
        let graph = super::simulate::trace_model_graph(model, trace, &mut workload)?;
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
    fn expert_counts(&self) -> anyhow::Result<(ExpertCounts, CoActivationSummary)> {
        expert_use_from_faults(&self.graph, self.faults.iter().copied())
            .context("the model has no routed experts")
    }

    /// How the trace's router picked experts from token to token.
    fn routing(&self) -> anyhow::Result<RoutingStats> {
        let sets = token_expert_sets(&self.graph, self.faults.iter().copied());
        sets.stats()
            .with_context(|| format!("measuring the routing of {}", self.path.display()))
    }
}

/// The routing statistics of a trace, beside published figures of real routers.
fn print_routing(trace: &Path, stats: &RoutingStats) {
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

/// The routed experts as the pager sees them: how many per layer and per token, the
/// size of an expert's slices against the block, and the bytes one token reads: every
/// tensor outside the experts plus the used share of them (the model's sparsity).
/// The layers of a mixture of experts that have none (DeepSeek's and GLM's leading
/// dense layers): paged as every token's, like attention.
fn dense_layers(graph: &ModelGraph, tensors: &[TensorInfo]) -> Vec<u32> {
    let expert_layers: std::collections::BTreeSet<u32> =
        graph.experts().groups().iter().map(|g| g.layer).collect();
    bytes_per_layer(tensors)
        .into_keys()
        .flatten()
        .filter(|layer| !expert_layers.contains(layer))
        .collect()
}

fn print_experts(graph: &ModelGraph, tensors: &[TensorInfo], weights: u64, shared: Option<u32>) {
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
    let geometry = graph.geometry();
    let block = geometry.block_size;
    // What a miss on a slice reads: the blocks holding any of it.
    let worst_read = groups
        .iter()
        .flat_map(|g| g.bytes.iter())
        .map(|slice| {
            let read = geometry.data_range(geometry.blocks_overlapping(slice.clone()));
            (read.end - read.start) as f64 / (slice.end - slice.start).max(1) as f64
        })
        .fold(0.0, f64::max);
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
