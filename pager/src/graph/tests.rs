use std::ops::Range;
use std::path::Path;

use petgraph::graph::NodeIndex;

use super::*;

/// Lays tensors out back to back, each start aligned to 32 bytes as GGUF does.
fn packed(tensors: &[(&str, u64)]) -> Vec<TensorInfo> {
    let mut at = 0u64;
    tensors
        .iter()
        .map(|&(name, len)| {
            let start = at.next_multiple_of(32);
            at = start + len;
            TensorInfo {
                name: name.into(),
                dtype: "F32".into(),
                shape: vec![len / 4],
                file_range: start..start + len,
            }
        })
        .collect()
}

fn end_of(tensors: &[TensorInfo]) -> u64 {
    tensors.iter().map(|t| t.file_range.end).max().unwrap_or(0)
}

/// The graph of `tensors` over 4 KiB blocks, cut into extents of one block.
fn one_block_extents(tensors: &[TensorInfo]) -> (ModelGraph, BlockGeometry) {
    let layout = BlockGeometry::new(0, end_of(tensors), 4096).unwrap();
    let options = BuildOptions {
        max_extent_bytes: 4096,
    };
    (
        ModelGraph::from_tensors_with(tensors, layout.clone(), options),
        layout,
    )
}

fn extent_names(graph: &ModelGraph) -> Vec<(String, u32, Range<u32>)> {
    graph
        .graph()
        .raw_nodes()
        .iter()
        .map(|n| match &n.weight.label {
            NodeLabel::Extent { tensor, part, .. } => {
                (tensor.clone(), *part, n.weight.blocks.clone())
            }
            NodeLabel::Block => ("block".into(), 0, n.weight.blocks.clone()),
        })
        .collect()
}

#[test]
fn large_tensors_become_several_extents_and_neighbours_share_blocks() {
    let tensors = packed(&[
        ("blk.0.attn_norm.weight", 100),
        ("blk.0.attn_q.weight", 10_000),
        ("blk.0.attn_k.weight", 1000),
    ]);
    let (graph, _) = one_block_extents(&tensors);
    let extents = extent_names(&graph);
    // attn_q: 128..10128 in pieces of 4096: 128..4224, 4224..8320, 8320..10128.
    assert_eq!(
        extents,
        vec![
            ("blk.0.attn_norm.weight".into(), 0, 0..1),
            ("blk.0.attn_q.weight".into(), 0, 0..2),
            ("blk.0.attn_q.weight".into(), 1, 1..3),
            ("blk.0.attn_q.weight".into(), 2, 2..3),
            ("blk.0.attn_k.weight".into(), 0, 2..3),
        ]
    );
    // Block 0 is shared by the norm and q; block 2 by q and k; each is used once.
    assert_eq!(graph.order().sequence(), &[0, 1, 2]);
    // The chain of extents plus the wrap from k back to the norm.
    assert_eq!(graph.graph().edge_count(), 5);
}

#[test]
fn a_block_shared_by_tensors_far_apart_in_the_pass_is_used_twice() {
    // File order k, norm, q; execution order norm, q, k. With 64-byte blocks the tail of
    // k and the norm share block 1, which the pass uses first (norm) and again (k's end).
    let tensors = packed(&[
        ("blk.0.attn_k.weight", 96),
        ("blk.0.attn_norm.weight", 16),
        ("blk.0.attn_q.weight", 200),
        ("blk.0.ffn_norm.weight", 16),
    ]);
    let layout = BlockGeometry::new(0, end_of(&tensors), 64).unwrap();
    let graph = ModelGraph::from_tensors(&tensors, layout);
    // norm [1], q [2..6], k [0, 1], ffn_norm [5].
    assert_eq!(graph.order().sequence(), &[1, 2, 3, 4, 5, 0, 1, 5]);
    assert_eq!(graph.order().positions(1), &[0, 6]);
    assert_eq!(graph.order().next_use(5, 5), Some(2));
}

fn llama_names(layers: u32, tied: bool) -> Vec<(String, u64)> {
    let mut names = vec![("token_embd.weight".to_string(), 50_000)];
    let mut layer_names: Vec<String> = (0..layers).map(|i| i.to_string()).collect();
    layer_names.sort(); // converter order: "10" before "2"
    for layer in layer_names {
        for (tensor, len) in [
            ("attn_k", 12_000),
            ("attn_norm", 64),
            ("attn_output", 16_000),
            ("attn_q", 16_000),
            ("attn_v", 12_000),
            ("ffn_down", 40_000),
            ("ffn_gate", 40_000),
            ("ffn_norm", 64),
            ("ffn_up", 40_000),
        ] {
            names.push((format!("blk.{layer}.{tensor}.weight"), len));
        }
    }
    names.push(("output_norm.weight".into(), 64));
    if !tied {
        names.push(("output.weight".into(), 50_000));
    }
    names
}

fn table_of(names: &[(String, u64)]) -> Vec<TensorInfo> {
    let refs: Vec<(&str, u64)> = names.iter().map(|(n, l)| (n.as_str(), *l)).collect();
    packed(&refs)
}

#[test]
fn llama_order_follows_the_layers_not_the_file() {
    let tensors = table_of(&llama_names(12, false));
    let layout = BlockGeometry::new(0, end_of(&tensors), 4096).unwrap();
    let graph = ModelGraph::from_tensors(&tensors, layout.clone());
    assert_eq!(
        graph.source(),
        GraphSource::Architecture(Architecture::LlamaGguf)
    );
    let blocks_of = |name: &str| {
        let t = tensors.iter().find(|t| t.name == name).unwrap();
        layout.blocks_of_file_range(&t.file_range).unwrap()
    };
    // An interior block: the first and last may be shared with file neighbours.
    let first_position = |name: &str| graph.order().positions(blocks_of(name).start + 1)[0];
    // Layer 2 runs before layer 10 although the file holds 10 first.
    assert!(first_position("blk.2.attn_q.weight") < first_position("blk.10.attn_q.weight"));
    assert!(blocks_of("blk.10.attn_q.weight").start < blocks_of("blk.2.attn_q.weight").start);
    // Within a layer: q before k before v before the FFN.
    assert!(first_position("blk.3.attn_q.weight") < first_position("blk.3.attn_k.weight"));
    assert!(first_position("blk.3.attn_v.weight") < first_position("blk.3.ffn_gate.weight"));
    // The order starts at layer 0 and ends with the head; the untied embedding is read by
    // rows only and is not predicted.
    assert_eq!(
        graph.order().block_at(0),
        blocks_of("blk.0.attn_norm.weight").start
    );
    assert_eq!(
        graph.order().block_at(graph.order().len() - 1),
        blocks_of("output.weight").end - 1
    );
    let embd = blocks_of("token_embd.weight");
    assert!(!graph.order().contains(embd.start));
    // Every block of the model but the embedding's is in the pass.
    assert!(graph.predicted_bytes() >= layout.data_len - 50_000 - 4096);
    // Cut into extents, the embedding's rows are alternatives: each ranks low.
    let fine = ModelGraph::from_tensors_with(
        &tensors,
        layout.clone(),
        BuildOptions {
            max_extent_bytes: 8192,
        },
    );
    let interior = embd.start + 2;
    assert!(fine.block_rank(interior) > 0.0);
    assert!(
        fine.block_rank(interior)
            < fine.block_rank(blocks_of("blk.3.attn_q.weight").start + 1) / 3.0
    );
}

#[test]
fn a_tied_head_puts_the_embedding_at_the_end_of_the_pass() {
    let tensors = table_of(&llama_names(2, true));
    let layout = BlockGeometry::new(0, end_of(&tensors), 4096).unwrap();
    let graph = ModelGraph::from_tensors(&tensors, layout);
    let order = graph.order();
    // token_embd is at the start of the file and at the end of the pass.
    assert_eq!(order.block_at(order.len() - 1), 50_000 / 4096);
    assert!(order.contains(0));
}

#[test]
fn experts_are_split_and_rank_below_the_dense_path() {
    let mut tensors = packed(&[
        ("blk.0.attn_norm.weight", 4096),
        ("blk.0.ffn_gate_inp.weight", 4096),
        ("blk.0.ffn_gate_exps.weight", 8 * 4096),
        ("blk.0.ffn_up_exps.weight", 8 * 4096),
        ("blk.0.ffn_down_exps.weight", 8 * 4096),
        ("blk.0.ffn_up_shexp.weight", 4096),
    ]);
    for t in tensors.iter_mut().filter(|t| t.name.contains("_exps")) {
        // Outermost first: GGUF's [n_embd, n_ff, n_expert] reversed.
        t.shape = vec![8, 32, 32];
    }
    let layout = BlockGeometry::new(0, end_of(&tensors), 4096).unwrap();
    let graph = ModelGraph::from_tensors(&tensors, layout);
    let experts: Vec<Option<u32>> = graph
        .graph()
        .raw_nodes()
        .iter()
        .filter_map(|n| match &n.weight.label {
            NodeLabel::Extent { tensor, expert, .. } if tensor.contains("gate_exps") => {
                Some(*expert)
            }
            _ => None,
        })
        .collect();
    assert_eq!(experts, (0..8).map(Some).collect::<Vec<_>>());
    // The router fans out to 8 experts; expert e of gate feeds expert e of up.
    let router = NodeIndex::new(1);
    assert_eq!(graph.graph().edges(router).count(), 8);
    let gate_e3 = NodeIndex::new(2 + 3);
    let next: Vec<usize> = graph
        .graph()
        .neighbors(gate_e3)
        .map(|n| n.index())
        .collect();
    assert_eq!(next, vec![2 + 8 + 3]);
    // Which experts run is not known ahead: the order is the dense path alone, and the
    // experts are groups of one slice per expert tensor, anchored where the shared
    // expert (the next dense step) starts.
    let dense: Vec<u32> = graph.order().sequence().to_vec();
    let shexp_block = tensors[5].file_range.start as u32 / 4096;
    assert_eq!(dense, vec![0, 1, shexp_block]);
    let experts = graph.experts();
    assert_eq!(experts.groups().len(), 8);
    let e3 = experts.group(3);
    assert_eq!((e3.layer, e3.expert), (0, 3));
    assert_eq!(
        e3.slices,
        vec![2 + 3..2 + 4, 2 + 8 + 3..2 + 8 + 4, 2 + 16 + 3..2 + 16 + 4]
    );
    assert_eq!(e3.anchor, 2);
    assert_eq!(experts.groups_of(2 + 8 + 3), &[3]);
    assert_eq!(experts.groups_of(0), &[] as &[u32]);
    let router_rank = graph.node_ranks()[1];
    assert!(graph.node_ranks()[gate_e3.index()] < router_rank / 4.0);
}

#[test]
fn unknown_architectures_fall_back_to_file_order() {
    let tensors = packed(&[("conv1.w", 5000), ("conv1.b", 100), ("fc.w", 9000)]);
    let layout = BlockGeometry::new(0, end_of(&tensors), 4096).unwrap();
    let graph = ModelGraph::from_tensors(&tensors, layout);
    assert_eq!(
        graph.source(),
        GraphSource::Architecture(Architecture::FileOrder)
    );
    assert_eq!(graph.order().sequence(), &[0, 1, 2, 3]);
}

#[test]
fn a_learned_graph_predicts_the_trace_cycle_and_ranks_by_traffic() {
    let layout = BlockGeometry::new(0, 10 * 4096, 4096).unwrap();
    let mut transitions = Transitions::new();
    for _ in 0..3 {
        transitions.observe_all([7, 2, 9, 4]);
    }
    transitions.observe(5); // seen once, off the cycle
    let graph = ModelGraph::learned(layout, &transitions);
    assert_eq!(graph.source(), GraphSource::Learned);
    let order = graph.order();
    assert_eq!(order.len(), 5);
    assert_eq!(order.next_use(9, order.positions(2)[0]), Some(1));
    assert!(graph.block_rank(5) < graph.block_rank(9));
    assert_eq!(graph.block_rank(0), 0.0);
}

#[test]
fn the_lag_guard_is_the_largest_step_and_zero_when_learned() {
    let tensors = packed(&[
        ("blk.0.attn_norm.weight", 100),
        ("blk.0.attn_q.weight", 40_000),
        ("blk.0.attn_k.weight", 8_000),
    ]);
    // Cut into extents of one block: the guard still spans the whole tensor, since
    // threads split a tensor's rows, not its extents.
    let (graph, layout) = one_block_extents(&tensors);
    // attn_q: bytes 128..40128, blocks 0..10.
    assert_eq!(graph.lag_guard(), 10);
    let learned = ModelGraph::from_pass(layout, &[0, 1, 2, 3]);
    assert_eq!(learned.lag_guard(), 0);
}

#[test]
fn the_guard_at_a_position_reaches_back_to_the_start_of_its_step() {
    let tensors = packed(&[
        ("blk.0.attn_norm.weight", 100),
        ("blk.0.attn_q.weight", 40_000),
        ("blk.0.attn_k.weight", 8_000),
    ]);
    let (graph, layout) = one_block_extents(&tensors);
    // attn_norm: block 0; attn_q: blocks 0..=9; attn_k: blocks 9..=11. Shared blocks
    // are merged: the pass is blocks 0..=11 at positions 0..=11.
    assert_eq!(graph.order().sequence(), &(0..12).collect::<Vec<_>>()[..]);
    let guards: Vec<u32> = (0..12).map(|p| graph.lag_guard_at(p)).collect();
    // attn_q starts at the block it shares with attn_norm; attn_k at the one it
    // shares with attn_q (position 9, which the order gives attn_q).
    assert_eq!(guards, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]);
    // Without steps, the graph-wide guard everywhere.
    let learned = ModelGraph::from_pass(layout, &[0, 1, 2, 3]).with_lag_guard(2);
    assert_eq!(learned.lag_guard_at(3), 2);
}

/// A llama's tensor table cut in two files after tensor `cut`, each file's ranges its
/// own (from offset `header`, as a GGUF part's data follows its header).
fn two_parts(cut: usize, header: u64) -> (Vec<TensorInfo>, Vec<TensorInfo>) {
    let names = llama_names(4, false);
    let shift = |tensors: Vec<TensorInfo>| -> Vec<TensorInfo> {
        tensors
            .into_iter()
            .map(|t| TensorInfo {
                file_range: t.file_range.start + header..t.file_range.end + header,
                ..t
            })
            .collect()
    };
    (
        shift(table_of(&names[..cut])),
        shift(table_of(&names[cut..])),
    )
}

#[test]
fn a_split_model_is_one_order_over_its_parts_laid_end_to_end() {
    let (first, second) = two_parts(20, 1000);
    let (first_len, second_len) = (end_of(&first) + 100, end_of(&second));
    let parts = [
        PartTensors {
            path: Path::new("/m-00001-of-00002.gguf"),
            file_len: first_len,
            tensors: &first,
        },
        PartTensors {
            path: Path::new("/m-00002-of-00002.gguf"),
            file_len: second_len,
            tensors: &second,
        },
    ];
    let graph = ModelGraph::from_parts(&parts, 4096).unwrap();
    let first_blocks = first_len.div_ceil(4096) as u32;
    assert_eq!(graph.parts().len(), 2);
    assert_eq!(graph.parts()[1].first_block, first_blocks);
    assert_eq!(graph.part_of(first_blocks - 1), Some(0));
    assert_eq!(graph.part_of(first_blocks), Some(1));
    assert_eq!(graph.part_of(graph.geometry().block_count()), None);
    // Exact lengths: the first part's last block is as short as the file leaves it.
    assert_eq!(graph.block_len(first_blocks - 1), first_len % 4096);
    assert_eq!(graph.block_len(first_blocks), 4096);
    assert_eq!(
        (0..graph.geometry().block_count())
            .map(|b| graph.block_len(b))
            .sum::<u64>(),
        first_len + second_len
    );
    // The same order as the whole model's: tensor after tensor through both parts.
    let whole = table_of(&llama_names(4, false));
    let unsplit =
        ModelGraph::from_tensors(&whole, BlockGeometry::new(0, end_of(&whole), 4096).unwrap());
    // Tensor by tensor, read off the blocks only one tensor covers (norms share theirs).
    let tensor_order = |graph: &ModelGraph| -> Vec<String> {
        let mut names: Vec<String> = Vec::new();
        for &block in graph.order().sequence() {
            let owners: Vec<&str> = graph
                .graph()
                .raw_nodes()
                .iter()
                .filter(|n| n.weight.blocks.contains(&block))
                .filter_map(|n| match &n.weight.label {
                    NodeLabel::Extent { tensor, .. } => Some(tensor.as_str()),
                    NodeLabel::Block => None,
                })
                .collect();
            if let [tensor] = owners[..] {
                if names.last().map(String::as_str) != Some(tensor) {
                    names.push(tensor.to_string());
                }
            }
        }
        names
    };
    let split_order = tensor_order(&graph);
    assert_eq!(split_order.len(), 4 * 7 + 1, "{split_order:?}");
    assert_eq!(split_order, tensor_order(&unsplit));
    // A tensor of the second part sits on the second part's blocks.
    let last = graph
        .graph()
        .raw_nodes()
        .iter()
        .find(|n| matches!(&n.weight.label, NodeLabel::Extent { tensor, .. } if tensor == "output.weight"))
        .unwrap();
    assert!(last.weight.blocks.start >= first_blocks, "{last:?}");
}
