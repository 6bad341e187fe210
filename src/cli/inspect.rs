//! `hyperoffload inspect`: what a model file holds and how the pager will see it: the
//! tensor table, sizes per layer and per kind, the predicted execution order, the most
//! central nodes, and the graph for Graphviz.

use std::path::PathBuf;

use clap::Args;
use hyperoffload::compare::model_summary::{
    bytes_per_kind, bytes_per_layer, predicted_order, to_dot, top_nodes,
};
use hyperoffload::graph::{BlockLayout, ModelGraph};
use hyperoffload::model::ModelFile;
use hyperoffload::size::format_size;

use super::size_arg;

#[derive(Args, Debug)]
pub struct InspectArgs {
    /// A GGUF or safetensors file.
    model: PathBuf,
    /// Block size the graph is built for (the pager's block size).
    #[arg(long, value_parser = size_arg, default_value = "64K")]
    block: u64,
    /// How many of the most central nodes to list.
    #[arg(long, default_value_t = 15)]
    top: usize,
    /// Print the model graph in Graphviz dot format instead of the summary.
    #[arg(long)]
    dot: bool,
    /// Also list every tensor.
    #[arg(long)]
    tensors: bool,
}

pub fn run(args: InspectArgs) -> anyhow::Result<()> {
    let model = ModelFile::open(&args.model)?;
    let layout = BlockLayout::new(0, model.file_len, args.block)?;
    let graph = ModelGraph::from_tensors(&model.tensors, layout);
    if args.dot {
        print!("{}", to_dot(&graph));
        return Ok(());
    }
    let weights: u64 = model
        .tensors
        .iter()
        .map(|t| t.file_range.end - t.file_range.start)
        .sum();
    println!(
        "{}: {} tensors, {} of weights in a {} file, graph of {} nodes ({:?})",
        args.model.display(),
        model.tensors.len(),
        format_size(weights),
        format_size(model.file_len),
        graph.graph().node_count(),
        graph.source()
    );
    println!(
        "eviction spares up to {} behind the latest fault (back to the start of its step; the largest step, which threads share)",
        format_size(graph.lag_guard() as u64 * layout.block_size)
    );
    if args.tensors {
        println!("\n## tensors (file order)\n");
        println!("| name | type | shape | offset | size |");
        println!("|---|---|---|---|---|");
        for tensor in &model.tensors {
            println!(
                "| {} | {} | {:?} | {} | {} |",
                tensor.name,
                tensor.dtype,
                tensor.shape,
                tensor.file_range.start,
                format_size(tensor.file_range.end - tensor.file_range.start)
            );
        }
    }
    println!("\n## bytes per layer\n");
    println!("| layer | tensors | size |");
    println!("|---|---|---|");
    for (layer, (bytes, count)) in bytes_per_layer(&model.tensors) {
        let name = layer.map_or_else(|| "outside layers".to_string(), |l| l.to_string());
        println!("| {name} | {count} | {} |", format_size(bytes));
    }
    println!("\n## bytes per kind\n");
    println!("| kind | tensors | size | types |");
    println!("|---|---|---|---|");
    for (kind, (bytes, count, types)) in bytes_per_kind(&model.tensors) {
        println!(
            "| {kind} | {count} | {} | {} |",
            format_size(bytes),
            types.join(", ")
        );
    }
    let order = predicted_order(&model.tensors);
    println!(
        "\n## predicted execution order (one token, {} steps)\n",
        order.len()
    );
    for (step, name) in order.iter().enumerate() {
        println!("{step:5}  {name}");
    }
    println!("\n## most central nodes (PageRank)\n");
    println!("| node | rank | size |");
    println!("|---|---|---|");
    for (name, rank, bytes) in top_nodes(&graph, args.top) {
        println!("| {name} | {rank:.5} | {} |", format_size(bytes));
    }
    Ok(())
}
