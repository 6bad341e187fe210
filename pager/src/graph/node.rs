//! The graph's nodes: pieces of the model file, each with the blocks it covers.
//!
//! Apart from the graph itself so that the parts that make nodes (`steps`, from the
//! tensor table) and the graph that links them both depend on it, not on each other.

use std::ops::Range;

/// What a node stands for.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub enum NodeLabel {
    /// Piece `part` of a tensor (of one expert, for a mixture-of-experts tensor).
    Extent {
        tensor: String,
        part: u32,
        expert: Option<u32>,
    },
    /// One block, in a graph learned with no model knowledge.
    Block,
}

/// A node: a piece of the file and the blocks it covers. A block shared by two
/// neighbouring pieces belongs to both.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Node {
    pub label: NodeLabel,
    pub file_range: Range<u64>,
    pub blocks: Range<u32>,
}
