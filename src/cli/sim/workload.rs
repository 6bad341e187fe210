//! The block-access sequence the simulator replays: one region's blocks in access
//! order, with token boundaries and offsets in blocks where they are known.

use hyperoffload::geometry::BlockGeometry;
use hyperoffload::graph::{CyclicOrder, ModelGraph};

/// A block-access sequence over one region.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Workload {
    pub layout: BlockGeometry,
    /// Blocks in access order.
    pub accesses: Vec<u32>,
    /// Index of each token's first access, ascending; empty when unknown.
    pub token_starts: Vec<usize>,
    /// Per access, where in its block the first byte touched lies (as the pager's
    /// faults tell the policies); empty when unknown.
    pub offsets: Vec<u32>,
}

impl Workload {
    /// `tokens` passes of a model graph's predicted order: what a decoder reading the
    /// model as predicted touches, block by block.
    pub fn cyclic(graph: &ModelGraph, tokens: u32) -> Workload {
        let order = graph.order();
        let pass: Vec<u32> = (0..order.len()).map(|at| order.block_at(at)).collect();
        let mut accesses = Vec::with_capacity(pass.len() * tokens as usize);
        let mut token_starts = Vec::with_capacity(tokens as usize);
        for _ in 0..tokens {
            token_starts.push(accesses.len());
            accesses.extend_from_slice(&pass);
        }
        Workload {
            layout: graph.geometry().clone(),
            accesses,
            token_starts,
            offsets: Vec::new(),
        }
    }

    /// Token boundaries found in the accesses themselves: the program follows `order`
    /// through the tensors every token reads, and a token starts where it goes round
    /// from the order's second half to its first. Exact for a demand trace, in which
    /// every block a token uses faults. Other moves by half the order or more, and moves
    /// back, are no progress: a block used at places far apart (where the file puts
    /// tensors of distant layers side by side, or an embedding row read at a token's
    /// start from the tensor that is also the output, at the order's end), or a thread
    /// lagging behind another. Accesses outside the order (routed experts) go with the
    /// token they fall in; those before the first pass starts, with none.
    pub fn with_tokens_from_order(mut self, order: &CyclicOrder) -> Self {
        let half = order.len() / 2;
        let mut at: Option<u32> = None;
        self.token_starts.clear();
        for (i, &block) in self.accesses.iter().enumerate() {
            let Some(position) = order.next_position(block, at.unwrap_or(0)) else {
                continue;
            };
            match at {
                // The first pass starts in the order's first half.
                None if position < half => {
                    self.token_starts.push(i);
                    at = Some(position);
                }
                None => {}
                Some(cursor) if cursor >= half && position + half <= cursor => {
                    self.token_starts.push(i);
                    at = Some(position);
                }
                Some(cursor) if position > cursor && position - cursor < half => {
                    at = Some(position)
                }
                Some(_) => {}
            }
        }
        self
    }

    /// This workload `copies` times over, one after the other (token boundaries too):
    /// replayed, the copies after the first show the steady state, every block used
    /// having been seen before (no first-use reads).
    pub fn repeated(&self, copies: usize) -> Workload {
        let len = self.accesses.len();
        Workload {
            layout: self.layout.clone(),
            accesses: self.accesses.repeat(copies),
            offsets: self.offsets.repeat(copies),
            token_starts: (0..copies)
                .flat_map(|copy| {
                    self.token_starts
                        .iter()
                        .map(move |start| start + copy * len)
                })
                .collect(),
        }
    }

    /// The tokens `range` of this workload (needs token boundaries).
    pub fn tokens(&self, range: std::ops::Range<usize>) -> Workload {
        let bound = |token: usize| {
            self.token_starts
                .get(token)
                .copied()
                .unwrap_or(self.accesses.len())
        };
        let (start, end) = (bound(range.start), bound(range.end));
        Workload {
            layout: self.layout.clone(),
            accesses: self.accesses[start..end].to_vec(),
            offsets: self
                .offsets
                .get(start..end)
                .map_or(Vec::new(), <[u32]>::to_vec),
            token_starts: self.token_starts
                [range.start.min(self.token_starts.len())..range.end.min(self.token_starts.len())]
                .iter()
                .map(|s| s - start)
                .collect(),
        }
    }
}
