//! `hyperoffload inspect`: what a model file holds and how the pager will see it: the
//! tensor table, sizes per layer and per kind, the predicted execution order, the most
//! central nodes, and the graph for Graphviz; for a mixture of experts and a trace of it,
//! how its router picks experts from token to token.
//!
//! Here the model's tables and graph; a mixture of experts' experts and heat map are
//! `experts`', its router's statistics from a trace `routing`'s.

mod experts;
mod routing;

use std::path::{Path, PathBuf};

use super::compare::model_summary::{
    bytes_per_kind, bytes_per_layer, predicted_order, to_dot, top_nodes,
};
use clap::Args;
use hyperoffload::geometry::BlockGeometry;
use hyperoffload::graph::experts::model_block_cuts;
use hyperoffload::graph::routing_stats::RoutingStats;
use hyperoffload::graph::{ModelGraph, PartTensors};
use hyperoffload::model::{ModelFile, TensorInfo};
use hyperoffload::size::format_size;
use serde_json::json;

use super::size_arg;
use experts::{dense_layers, print_experts, write_heat_map};
use routing::{print_routing, TraceReplay};

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
