//! The model graph: which parts of the model file a token reads, in what order, and how
//! central each part is. Policies use it to predict the next use of every block.
//!
//! Nodes are tensor *extents* (a tensor cut into pieces of bounded size, and at expert
//! boundaries) or, for a graph learned from a fault trace, single blocks. Edges follow
//! the per-token execution: from the tensor table and the architecture's names
//! ([`arch`], made into steps of the pass by `steps`), or from transitions observed in
//! a trace ([`learn`]). The policies follow the predicted cyclic order of blocks
//! ([`CyclicOrder`]: one token's pass, which the next token repeats) and the expert
//! table; each block's centrality (PageRank over the weighted edges, [`rank`]) is what
//! `inspect` reports as the central nodes.
//!
//! Everything here is pure computation over block indices, except [`store`], which
//! saves and loads learned graphs beside the model file, and [`expert_store`], which
//! does the same for how often a mixture of experts' experts run.

pub mod arch;
mod block_lengths;
pub mod expert_store;
pub mod experts;
pub mod learn;
mod node;
mod order;
pub mod rank;
pub mod routing_stats;
mod steps;
pub mod store;

use std::path::{Path, PathBuf};

use petgraph::graph::DiGraph;
use thiserror::Error;

pub use arch::{Architecture, ExecutionOrder};
pub use block_lengths::BlockLengths;
pub use experts::{ExpertGroup, ExpertMap, ExpertSlice};
pub use learn::Transitions;
pub use node::{Node, NodeLabel};
pub use order::CyclicOrder;
use steps::{largest_span, step_edges, unit_starts, work_units, Step};

use crate::geometry::{BlockGeometry, GeometryError};
use crate::model::{ModelFile, TensorInfo};

/// A graph that cannot be built.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum GraphError {
    #[error(transparent)]
    Geometry(#[from] GeometryError),
}

/// PageRank's damping factor: the usual 0.85.
const DAMPING: f64 = 0.85;

/// Where the graph's edges came from.
#[derive(Copy, Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum GraphSource {
    Architecture(Architecture),
    /// Learned from the faults of a recording run: one run's observation.
    Learned,
    /// An order given whole by the caller (`from_pass`).
    Given,
}

impl std::fmt::Display for GraphSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            GraphSource::Architecture(Architecture::LlamaGguf) => {
                "llama-family execution order, from the GGUF tensor names"
            }
            GraphSource::Architecture(Architecture::LlamaHf) => {
                "llama-family execution order, from the Hugging Face tensor names"
            }
            GraphSource::Architecture(Architecture::FileOrder) => {
                "file order: no architecture recognised in the tensor names"
            }
            GraphSource::Learned => "learned from a recording run",
            GraphSource::Given => "an order given whole",
        })
    }
}

/// Options for building a graph from a tensor table.
#[derive(Copy, Clone, Debug)]
pub struct BuildOptions {
    /// Largest extent: bigger tensors are cut into several nodes, so that centrality
    /// and edges stay local.
    pub max_extent_bytes: u64,
}

impl Default for BuildOptions {
    fn default() -> Self {
        Self {
            max_extent_bytes: 32 << 20,
        }
    }
}

/// One file of the model a graph describes: a region of geometry `geometry` (block size:
/// the graph's) has its block `i` at the graph's block `first_block + i`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GraphPart {
    /// The file; `None` in a graph of one file, which any region of its geometry
    /// presents (the pager was given the file, under whatever name).
    pub path: Option<PathBuf>,
    pub geometry: BlockGeometry,
    pub first_block: u32,
}

impl GraphPart {
    /// The one part of a graph over one region of geometry `layout`.
    fn whole(layout: &BlockGeometry) -> Vec<GraphPart> {
        vec![GraphPart {
            path: None,
            geometry: layout.clone(),
            first_block: 0,
        }]
    }
}

/// One file of a model stored in several, as `ModelGraph::from_parts` takes it.
#[derive(Debug, Clone, Copy)]
pub struct PartTensors<'a> {
    pub path: &'a Path,
    pub file_len: u64,
    /// Its tensor table, with the file's own byte ranges.
    pub tensors: &'a [TensorInfo],
}

impl<'a> From<&'a ModelFile> for PartTensors<'a> {
    fn from(file: &'a ModelFile) -> Self {
        Self {
            path: &file.path,
            file_len: file.file_len,
            tensors: &file.tensors,
        }
    }
}

/// A model's dependency graph over the blocks of one region, or of one region per file
/// for a model stored in several (`from_parts`).
#[derive(Debug, Clone)]
pub struct ModelGraph {
    /// The blocks the graph counts: of the one region, or of every part's in turn.
    layout: BlockGeometry,
    /// The files those blocks come from, in block order (never empty).
    parts: Vec<GraphPart>,
    source: GraphSource,
    graph: DiGraph<Node, f64>,
    node_rank: Vec<f64>,
    /// Per block: the highest rank of a node covering it, 0 if none does.
    block_rank: Vec<f64>,
    order: CyclicOrder,
    /// See `lag_guard`.
    lag_guard: u32,
    /// Per position of the order: where the piece of work it belongs to (a step, or one
    /// expert's matrix) starts. Empty for a learned graph. See `lag_guard_at`.
    unit_start: Vec<u32>,
    /// The routed experts, outside the order.
    experts: ExpertMap,
}

impl ModelGraph {
    /// Builds the graph of a model from its tensor table, as read through a region with
    /// geometry `layout`.
    pub fn from_tensors(tensors: &[TensorInfo], layout: BlockGeometry) -> Self {
        Self::from_tensors_with(tensors, layout, BuildOptions::default())
    }

    pub fn from_tensors_with(
        tensors: &[TensorInfo],
        layout: BlockGeometry,
        options: BuildOptions,
    ) -> Self {
        let exec = arch::execution_order(tensors);
        let mut graph = DiGraph::new();
        let mut step_of = |index: usize| {
            Step::of(
                &tensors[index],
                &layout,
                options.max_extent_bytes,
                &mut graph,
            )
        };
        let steps: Vec<Step> = exec
            .steps
            .iter()
            .map(|&i| step_of(i))
            .filter(|step| !step.is_empty())
            .collect();
        // A token reads a row of the untied embedding: any one of its extents.
        let rows = exec.rows_only.map(&mut step_of).map(Step::into_rows);

        let edges = step_edges(&steps, rows.as_ref());
        for (from, to, weight) in edges {
            graph.add_edge(from, to, weight);
        }

        let (units, sparse_slices) = work_units(&steps, &graph);
        let order =
            CyclicOrder::from_sequence(units.iter().flatten().copied(), layout.block_count());
        let unit_start = unit_starts(&order, &units);
        let mut experts = ExpertMap::new(&sparse_slices, &layout);
        // Anchor: the first position of the unit after the experts (round the cycle).
        experts.remap_anchors(|unit| {
            let first = units
                .iter()
                .cycle()
                .skip(unit as usize)
                .take(units.len())
                .find_map(|blocks| blocks.first().copied());
            first
                .and_then(|block| order.positions(block).first().copied())
                .unwrap_or(0)
        });
        let lag_guard = largest_span(&units);
        let mut model = Self::finish(
            layout,
            GraphSource::Architecture(exec.architecture),
            graph,
            order,
            lag_guard,
            unit_start,
        );
        model.experts = experts;
        model
    }

    /// Builds the graph of a model stored in several files (a split GGUF, see
    /// `model::split`), each presented whole by a region of its own in blocks of
    /// `block_size`: the blocks of each file follow the previous file's, and one order
    /// runs through them all. The nodes' file ranges are offsets in the files laid end to
    /// end, each from a block boundary.
    pub fn from_parts(parts: &[PartTensors<'_>], block_size: u64) -> Result<Self, GraphError> {
        if block_size == 0 {
            return Err(GeometryError::ZeroBlockSize.into());
        }
        let mut graph_parts = Vec::with_capacity(parts.len());
        let mut tensors = Vec::new();
        let mut first_block = 0u64;
        let mut data_len = 0;
        for file in parts {
            let first = u32::try_from(first_block).map_err(|_| GeometryError::TooManyBlocks {
                data_len: first_block * block_size + file.file_len,
                block_size,
            })?;
            let base = first_block * block_size;
            tensors.extend(file.tensors.iter().map(|tensor| TensorInfo {
                file_range: base + tensor.file_range.start..base + tensor.file_range.end,
                ..tensor.clone()
            }));
            let geometry = BlockGeometry::new(0, file.file_len, block_size)?;
            first_block += geometry.block_count() as u64;
            graph_parts.push(GraphPart {
                path: Some(file.path.to_path_buf()),
                geometry,
                first_block: first,
            });
            data_len = base + file.file_len;
        }
        let layout = BlockGeometry::new(0, data_len, block_size)?;
        let mut graph = Self::from_tensors(&tensors, layout);
        if !graph_parts.is_empty() {
            graph.parts = graph_parts;
        }
        Ok(graph)
    }

    /// Builds the graph learned from observed block transitions, with no model
    /// knowledge: one node per block seen.
    pub fn learned(layout: BlockGeometry, transitions: &Transitions) -> Self {
        let block_count = layout.block_count();
        let mut graph = DiGraph::new();
        let mut node_of = std::collections::BTreeMap::new();
        for block in transitions.blocks().filter(|&b| b < block_count) {
            let node = graph.add_node(Node {
                label: NodeLabel::Block,
                file_range: layout.block_file_range(block),
                blocks: block..block + 1,
            });
            node_of.insert(block, node);
        }
        for (from, to, count) in transitions.edges() {
            if let (Some(&a), Some(&b)) = (node_of.get(&from), node_of.get(&to)) {
                graph.add_edge(a, b, count as f64);
            }
        }
        let order = CyclicOrder::from_sequence(transitions.cyclic_order(), block_count);
        Self::finish(layout, GraphSource::Learned, graph, order, 0, Vec::new())
    }

    /// A graph of single blocks whose predicted order is exactly `pass` (one token's
    /// sequence of blocks), with an edge for each step of it, round the cycle.
    pub fn from_pass(layout: BlockGeometry, pass: &[u32]) -> Self {
        let order = CyclicOrder::from_sequence(pass.iter().copied(), layout.block_count());
        let mut transitions = Transitions::new();
        transitions.observe_all(order.sequence().iter().copied());
        if let Some(&first) = order.sequence().first() {
            transitions.observe(first);
        }
        let mut graph = Self::learned(layout, &transitions);
        graph.order = order;
        graph.source = GraphSource::Given;
        graph
    }

    fn finish(
        layout: BlockGeometry,
        source: GraphSource,
        graph: DiGraph<Node, f64>,
        order: CyclicOrder,
        lag_guard: u32,
        unit_start: Vec<u32>,
    ) -> Self {
        let edges: Vec<(usize, usize, f64)> = graph
            .raw_edges()
            .iter()
            .map(|e| (e.source().index(), e.target().index(), e.weight))
            .collect();
        let node_rank = rank::page_rank(graph.node_count(), &edges, DAMPING);
        let mut block_rank = vec![0.0f64; layout.block_count() as usize];
        for (node, &rank) in graph.raw_nodes().iter().zip(&node_rank) {
            for block in node.weight.blocks.clone() {
                let slot = &mut block_rank[block as usize];
                *slot = slot.max(rank);
            }
        }
        Self {
            parts: GraphPart::whole(&layout),
            layout,
            source,
            graph,
            node_rank,
            block_rank,
            order,
            lag_guard,
            unit_start,
            experts: ExpertMap::default(),
        }
    }

    /// Sets how many experts a token runs per layer (the model's `expert_used_count`),
    /// which the policies start from before they have learned the experts' popularity.
    pub fn with_experts_used(mut self, used: Option<u32>) -> Self {
        self.experts = std::mem::take(&mut self.experts).with_used_per_token(used);
        self
    }

    /// The experts a router chooses among, by block: none for a dense model.
    pub fn experts(&self) -> &ExpertMap {
        &self.experts
    }

    /// The most positions behind the program's latest fault that a thread may still be
    /// reading, anywhere in the pass: the largest step of the order (a tensor, or one
    /// expert's matrix) in blocks; 0 for a learned graph, which knows no tensors (the
    /// graph policies then use the lag they observe). Threads split each step's rows
    /// between them and fault at different offsets in it, and the latest fault may come
    /// from the one ahead. Eviction guards the positions back to the start of the
    /// current step (`lag_guard_at`), sparing the lagging thread a demand read of a
    /// block evicted under it; this bound sizes the room a streamed set keeps for them.
    pub fn lag_guard(&self) -> u32 {
        self.lag_guard
    }

    /// Positions behind `position` that a thread may still be reading when the latest
    /// fault is there: back to the start of the step (or expert's matrix) that
    /// `position` belongs to. The CPU backend waits for every thread at the end of
    /// each step, so threads sharing one are never further apart. Without steps (a
    /// learned graph) `lag_guard`. Guarding more than this costs reads: a guarded block
    /// is passed over for an older one the budget could have kept for the next pass
    /// (a quarter of a 3 GiB llama: 2410 MiB per token guarding the largest step
    /// everywhere, 2361-2379 guarding the current one).
    pub fn lag_guard_at(&self, position: u32) -> u32 {
        match self.unit_start.get(position as usize) {
            Some(&start) => position - start,
            None => self.lag_guard,
        }
    }

    #[cfg(test)]
    pub(crate) fn with_lag_guard(mut self, positions: u32) -> Self {
        self.lag_guard = positions;
        self
    }

    /// The block geometry of the region the graph describes (of the parts laid end to
    /// end, for a model in several files).
    pub fn geometry(&self) -> &BlockGeometry {
        &self.layout
    }

    /// The graph with its parts forgotten: one region of the parts laid end to end,
    /// each from a block boundary (a part's short last block counts whole), for
    /// replaying a split model as one access sequence (`simulate`).
    pub fn into_one_region(mut self) -> Self {
        self.parts = GraphPart::whole(&self.layout);
        self
    }

    /// The files the graph's blocks come from, in block order.
    pub fn parts(&self) -> &[GraphPart] {
        &self.parts
    }

    /// The part block `block` belongs to, by index in `parts`.
    pub fn part_of(&self, block: u32) -> Option<usize> {
        let at = self
            .parts
            .partition_point(|part| part.first_block <= block)
            .checked_sub(1)?;
        let part = &self.parts[at];
        (block - part.first_block < part.geometry.block_count()).then_some(at)
    }

    pub fn source(&self) -> GraphSource {
        self.source
    }

    /// The petgraph graph: nodes and weighted edges.
    pub fn graph(&self) -> &DiGraph<Node, f64> {
        &self.graph
    }

    /// PageRank of each node, indexed like the graph's nodes.
    pub fn node_ranks(&self) -> &[f64] {
        &self.node_rank
    }

    /// Centrality of a block: the highest PageRank of a node covering it, 0 for a block
    /// no node covers.
    pub fn block_rank(&self, block: u32) -> f64 {
        self.block_rank.get(block as usize).copied().unwrap_or(0.0)
    }

    /// The predicted cyclic order of blocks: one token's pass.
    pub fn order(&self) -> &CyclicOrder {
        &self.order
    }

    /// Bytes one pass over the predicted order reads (each distinct block once).
    pub fn predicted_bytes(&self) -> u64 {
        let mut seen = vec![false; self.layout.block_count() as usize];
        let mut total = 0;
        for &block in self.order.sequence() {
            if !std::mem::replace(&mut seen[block as usize], true) {
                total += self.block_len(block);
            }
        }
        total
    }
}

impl BlockLengths for ModelGraph {
    fn block_size(&self) -> u64 {
        self.layout.block_size
    }

    fn block_count(&self) -> u32 {
        self.layout.block_count()
    }

    /// Exact across parts: a part's last block is as short as the file leaves it.
    fn block_len(&self, block: u32) -> u64 {
        let Some(part) = self.part_of(block).map(|at| &self.parts[at]) else {
            return 0;
        };
        part.geometry.block_len(block - part.first_block)
    }
}

#[cfg(test)]
mod tests;
