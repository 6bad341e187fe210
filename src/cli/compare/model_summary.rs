//! What `hyperoffload inspect` shows about a model: sizes per layer and per kind of
//! tensor, the predicted per-token execution order, the most central graph nodes, and
//! the graph in Graphviz form.

use std::collections::BTreeMap;
use std::fmt::Write;

use hyperoffload::graph::arch::execution_order;
use hyperoffload::graph::{ModelGraph, NodeLabel};
use hyperoffload::model::TensorInfo;

/// The layer of a llama-family tensor name (`blk.3.*`, `model.layers.3.*`).
pub fn layer_of(name: &str) -> Option<u32> {
    let rest = name
        .strip_prefix("blk.")
        .or_else(|| name.strip_prefix("model.layers."))?;
    rest.split('.').next()?.parse().ok()
}

/// The name without its layer prefix (`blk.3.attn_q.weight` -> `attn_q.weight`).
pub fn kind_of(name: &str) -> &str {
    match layer_of(name) {
        Some(_) => {
            let prefix_dots = if name.starts_with("blk.") { 2 } else { 3 };
            name.splitn(prefix_dots + 1, '.').last().unwrap_or(name)
        }
        None => name,
    }
}

fn bytes(tensor: &TensorInfo) -> u64 {
    tensor.file_range.end - tensor.file_range.start
}

/// Bytes and tensor count per layer (None: tensors outside any layer).
pub fn bytes_per_layer(tensors: &[TensorInfo]) -> BTreeMap<Option<u32>, (u64, usize)> {
    let mut totals = BTreeMap::new();
    for tensor in tensors {
        let entry = totals.entry(layer_of(&tensor.name)).or_insert((0, 0));
        entry.0 += bytes(tensor);
        entry.1 += 1;
    }
    totals
}

/// Bytes and tensor count per kind (name without layer), with the dtypes seen.
pub fn bytes_per_kind(tensors: &[TensorInfo]) -> BTreeMap<String, (u64, usize, Vec<String>)> {
    let mut totals: BTreeMap<String, (u64, usize, Vec<String>)> = BTreeMap::new();
    for tensor in tensors {
        let entry = totals.entry(kind_of(&tensor.name).to_string()).or_default();
        entry.0 += bytes(tensor);
        entry.1 += 1;
        if !entry.2.contains(&tensor.dtype) {
            entry.2.push(tensor.dtype.clone());
        }
    }
    totals
}

/// Tensor names in the order one token reads them (the untied embedding, of which
/// only rows are read, first and marked).
pub fn predicted_order(tensors: &[TensorInfo]) -> Vec<String> {
    let order = execution_order(tensors);
    order
        .rows_only
        .map(|i| format!("{} (rows)", tensors[i].name))
        .into_iter()
        .chain(order.steps.iter().map(|&i| tensors[i].name.clone()))
        .collect()
}

/// A node's display name.
pub fn node_name(label: &NodeLabel, first_block: u32) -> String {
    match label {
        NodeLabel::Extent {
            tensor,
            part,
            expert,
        } => match expert {
            Some(expert) => format!("{tensor}[expert {expert}]#{part}"),
            None => format!("{tensor}#{part}"),
        },
        NodeLabel::Block => format!("block {first_block}"),
    }
}

/// The `count` nodes with the highest PageRank: (name, rank, bytes).
pub fn top_nodes(graph: &ModelGraph, count: usize) -> Vec<(String, f64, u64)> {
    let ranks = graph.node_ranks();
    let mut nodes: Vec<(String, f64, u64)> = graph
        .graph()
        .node_indices()
        .map(|index| {
            let node = &graph.graph()[index];
            (
                node_name(&node.label, node.blocks.start),
                ranks[index.index()],
                node.file_range.end - node.file_range.start,
            )
        })
        .collect();
    nodes.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    nodes.truncate(count);
    nodes
}

/// The graph in Graphviz `dot` form; node labels carry the PageRank.
pub fn to_dot(graph: &ModelGraph) -> String {
    let g = graph.graph();
    let ranks = graph.node_ranks();
    let mut dot =
        String::from("digraph model {\n  rankdir=LR;\n  node [shape=box, fontsize=10];\n");
    for index in g.node_indices() {
        let node = &g[index];
        let name = node_name(&node.label, node.blocks.start).replace('"', "\\\"");
        let _ = writeln!(
            dot,
            "  n{} [label=\"{name}\\nrank {:.4}\"];",
            index.index(),
            ranks[index.index()]
        );
    }
    for edge in g.edge_indices() {
        if let Some((from, to)) = g.edge_endpoints(edge) {
            let _ = writeln!(
                dot,
                "  n{} -> n{} [label=\"{:.2}\"];",
                from.index(),
                to.index(),
                g[edge]
            );
        }
    }
    dot.push_str("}\n");
    dot
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyperoffload::geometry::BlockGeometry;

    fn tensors() -> Vec<TensorInfo> {
        let names = [
            "token_embd.weight",
            "blk.0.attn_q.weight",
            "blk.0.ffn_down.weight",
            "blk.1.attn_q.weight",
            "blk.1.ffn_down.weight",
            "output_norm.weight",
        ];
        names
            .iter()
            .enumerate()
            .map(|(i, name)| TensorInfo {
                name: name.to_string(),
                dtype: if i == 5 { "F32" } else { "Q4_1" }.into(),
                shape: vec![64, 64],
                file_range: (i as u64 * 8192)..(i as u64 * 8192 + 8192),
            })
            .collect()
    }

    #[test]
    fn layers_and_kinds() {
        assert_eq!(layer_of("blk.12.attn_q.weight"), Some(12));
        assert_eq!(layer_of("model.layers.3.mlp.up_proj.weight"), Some(3));
        assert_eq!(layer_of("output.weight"), None);
        assert_eq!(kind_of("blk.12.attn_q.weight"), "attn_q.weight");
        assert_eq!(
            kind_of("model.layers.3.mlp.up_proj.weight"),
            "mlp.up_proj.weight"
        );
        let layers = bytes_per_layer(&tensors());
        assert_eq!(layers[&Some(0)], (16384, 2));
        assert_eq!(layers[&None], (16384, 2));
        let kinds = bytes_per_kind(&tensors());
        assert_eq!(kinds["attn_q.weight"].0, 16384);
        assert_eq!(kinds["output_norm.weight"].2, vec!["F32".to_string()]);
    }

    #[test]
    fn order_ranks_and_dot() {
        let tensors = tensors();
        let order = predicted_order(&tensors);
        assert_eq!(
            order.first().map(String::as_str),
            Some("blk.0.attn_q.weight")
        );
        assert!(
            order.iter().any(|n| n == "token_embd.weight"),
            "tied head: {order:?}"
        );
        let layout = BlockGeometry::new(0, 6 * 8192, 4096).unwrap();
        let graph = ModelGraph::from_tensors(&tensors, layout);
        let top = top_nodes(&graph, 3);
        assert_eq!(top.len(), 3);
        assert!(top[0].1 >= top[1].1 && top[1].1 >= top[2].1);
        let dot = to_dot(&graph);
        assert!(dot.starts_with("digraph model {"));
        assert!(dot.contains("->"));
        assert!(dot.contains("blk.0.attn_q.weight#0"));
    }
}
