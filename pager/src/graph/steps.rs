//! One token's pass over a tensor table, as the graph is built from it: each tensor
//! of the architecture's execution order becomes a step (its extents, the graph's
//! nodes, in chains), from which follow the edges between steps, the pieces of work
//! threads share and where each piece starts in the predicted order.

use petgraph::graph::{DiGraph, NodeIndex};

use super::arch;
use super::experts::ExpertSlice;
use super::node::{Node, NodeLabel};
use super::order::CyclicOrder;
use crate::geometry::BlockGeometry;
use crate::model::TensorInfo;

/// One tensor's place in the pass: chains of extents, one per expert (a single chain for
/// a dense tensor), or the embedding's extents as alternatives.
pub(super) struct Step {
    groups: Vec<Vec<NodeIndex>>,
    experts: bool,
    /// For routed experts: the layer and each expert's byte range (`arch::expert_slices`).
    sparse: Option<arch::ExpertShares>,
}

impl Step {
    /// The step of `tensor`: its extents (`extents`), added to `graph` as nodes, one
    /// chain per expert; extents outside the region are left out.
    pub(super) fn of(
        tensor: &TensorInfo,
        layout: &BlockGeometry,
        max_extent_bytes: u64,
        graph: &mut DiGraph<Node, f64>,
    ) -> Step {
        let groups: Vec<Vec<NodeIndex>> = extents(tensor, layout, max_extent_bytes)
            .into_iter()
            .map(|group| group.into_iter().map(|n| graph.add_node(n)).collect())
            .filter(|group: &Vec<NodeIndex>| !group.is_empty())
            .collect();
        let sparse = arch::expert_slices(tensor);
        Step {
            experts: groups.len() > 1 || sparse.is_some(),
            groups,
            sparse,
        }
    }

    /// The step as the untied embedding's rows: a token reads any one of its extents,
    /// so each is a chain of its own.
    pub(super) fn into_rows(self) -> Step {
        Step {
            groups: self.groups.into_iter().flatten().map(|n| vec![n]).collect(),
            experts: false,
            sparse: None,
        }
    }

    /// Whether no extent of the tensor lies in the region.
    pub(super) fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }
}

/// The pieces of work threads share, in execution order, as runs of blocks: a step, or
/// one expert's matrix of a tensor split by experts that every token reads whole. The
/// pass is their blocks in turn. The experts a router chooses among are not part of it:
/// which of them a token reads is not known ahead (`ExpertMap`); each of their slices is
/// anchored at the unit that follows, returned beside the units.
pub(super) fn work_units(
    steps: &[Step],
    graph: &DiGraph<Node, f64>,
) -> (Vec<Vec<u32>>, Vec<ExpertSlice>) {
    let mut units: Vec<Vec<u32>> = Vec::new();
    let mut sparse_slices: Vec<ExpertSlice> = Vec::new();
    for step in steps {
        if let Some(shares) = &step.sparse {
            sparse_slices.extend(shares.shares.iter().map(|(expert, range)| ExpertSlice {
                layer: shares.layer,
                expert: *expert,
                file_range: range.clone(),
                anchor: units.len() as u32,
            }));
            continue;
        }
        let blocks_of = |nodes: &[NodeIndex]| -> Vec<u32> {
            nodes
                .iter()
                .flat_map(|&node| graph[node].blocks.clone())
                .collect()
        };
        if step.experts {
            units.extend(step.groups.iter().map(|group| blocks_of(group)));
        } else {
            let nodes: Vec<NodeIndex> = step.groups.iter().flatten().copied().collect();
            units.push(blocks_of(&nodes));
        }
    }
    (units, sparse_slices)
}

/// The largest piece of work: extents of one tensor may share their boundary blocks, so
/// a unit's span, not its length.
pub(super) fn largest_span(units: &[Vec<u32>]) -> u32 {
    units
        .iter()
        .map(|blocks| {
            let start = blocks.iter().min().copied().unwrap_or(0);
            let end = blocks.iter().max().map_or(0, |&last| last + 1);
            end.saturating_sub(start)
        })
        .max()
        .unwrap_or(0)
}

/// The edges of one pass: along each group's extents, and from each step (or the
/// embedding rows) to the next, round the cycle.
pub(super) fn step_edges(steps: &[Step], rows: Option<&Step>) -> Vec<(NodeIndex, NodeIndex, f64)> {
    let mut edges: Vec<(NodeIndex, NodeIndex, f64)> = Vec::new();
    let mut cycle: Vec<&Step> = steps.iter().collect();
    cycle.extend(rows.iter().filter(|step| !step.groups.is_empty()));
    for step in &cycle {
        for group in &step.groups {
            for pair in group.windows(2) {
                edges.push((pair[0], pair[1], 1.0));
            }
        }
    }
    // Round the cycle: the last step (or the embedding rows) feeds the first.
    if cycle.len() > 1 {
        for (i, from) in cycle.iter().enumerate() {
            connect(&mut edges, from, cycle[(i + 1) % cycle.len()]);
        }
    }
    edges
}

/// Per position of `order`: the position where its unit (a run of blocks, in the
/// order `units` follow the pass) starts. `order` is `units` concatenated with repeats
/// merged: a unit whose first block is the previous one's last starts at that shared
/// position; blocks the order dropped are skipped.
pub(super) fn unit_starts(order: &CyclicOrder, units: &[Vec<u32>]) -> Vec<u32> {
    let sequence = order.sequence();
    let mut starts = vec![0; sequence.len()];
    let mut next = 0;
    for unit in units {
        let shares_first = next > 0
            && unit
                .first()
                .is_some_and(|&first| sequence[next - 1] == first);
        let start = if shares_first { next - 1 } else { next } as u32;
        for &block in unit {
            if sequence.get(next) == Some(&block) {
                starts[next] = start;
                next += 1;
            }
        }
    }
    starts
}

/// Edges from the exits of step `from` to the entries of step `to`. Expert `e` feeds
/// expert `e` when both steps are split by the same experts; otherwise every exit feeds
/// every entry. Weights are split evenly so that each step passes on a total weight of 1.
fn connect(edges: &mut Vec<(NodeIndex, NodeIndex, f64)>, from: &Step, to: &Step) {
    let exits: Vec<NodeIndex> = from
        .groups
        .iter()
        .filter_map(|g| g.last().copied())
        .collect();
    let entries: Vec<NodeIndex> = to
        .groups
        .iter()
        .filter_map(|g| g.first().copied())
        .collect();
    if from.experts && to.experts && exits.len() == entries.len() {
        let weight = 1.0 / exits.len() as f64;
        for (&a, &b) in exits.iter().zip(&entries) {
            edges.push((a, b, weight));
        }
        return;
    }
    let weight = 1.0 / (exits.len() * entries.len()).max(1) as f64;
    for &a in &exits {
        for &b in &entries {
            edges.push((a, b, weight));
        }
    }
}

/// Cuts a tensor into extents of at most `max_bytes` (and at expert boundaries), each
/// with the blocks it covers; extents outside the region are left out. Returns one
/// group per expert, in file order.
fn extents(tensor: &TensorInfo, layout: &BlockGeometry, max_bytes: u64) -> Vec<Vec<Node>> {
    let range = tensor.file_range.clone();
    let len = range.end.saturating_sub(range.start);
    let experts = arch::expert_count(tensor)
        .filter(|&n| len % n as u64 == 0)
        .unwrap_or(1);
    let per_expert = len / experts as u64;
    let max_bytes = max_bytes.max(1);
    (0..experts)
        .map(|expert| {
            let start = range.start + expert as u64 * per_expert;
            let end = start + per_expert;
            let pieces = per_expert.div_ceil(max_bytes).max(1);
            (0..pieces)
                .filter_map(|part| {
                    let piece = start + part * max_bytes..(start + (part + 1) * max_bytes).min(end);
                    let blocks = layout.blocks_of_file_range(&piece)?;
                    Some(Node {
                        label: NodeLabel::Extent {
                            tensor: tensor.name.clone(),
                            part: part as u32,
                            expert: (experts > 1).then_some(expert),
                        },
                        file_range: piece,
                        blocks,
                    })
                })
                .collect()
        })
        .collect()
}
