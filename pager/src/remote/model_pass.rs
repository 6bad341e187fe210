//! One token's pass over a GGUF object, in the cache tier's blocks: the model graph's
//! predicted cyclic order (`graph::ModelGraph`, from the tensor table in the header),
//! each block's first position in it, and which blocks hold the header.
//!
//! The mount reads an object's first bytes and asks `from_prefix`; a header longer than
//! the prefix asks for more (`Parse::NeedMore`). Pure: parsing and arithmetic only.

use thiserror::Error;

use crate::geometry::{BlockGeometry, GeometryError};
use crate::graph::{CyclicOrder, ModelGraph};
use crate::model::gguf::{GgufError, GgufFile};

/// An object whose pass cannot be known (it is then evicted least recently used first).
#[derive(Debug, Error)]
pub enum PassError {
    #[error("not a GGUF model: {0}")]
    NotGguf(#[source] GgufError),
    #[error("block geometry: {0}")]
    Geometry(#[from] GeometryError),
    #[error("the GGUF header is longer than {0} bytes")]
    HeaderTooLong(u64),
    #[error("no tensor of the model lies in the object")]
    NoTensors,
}

/// The most header bytes `from_prefix` asks for: a vocabulary of a million tokens fits.
pub const MAX_HEADER: u64 = 64 << 20;

/// What the first bytes of an object say.
#[derive(Debug)]
pub enum Parse {
    Model(ModelPass),
    /// The header goes on past the prefix: call again with this many bytes.
    NeedMore(u64),
}

/// The pass of one model object over blocks of one size.
///
/// Invariant: `first[b]` is `Some(p)` exactly when block `b` occurs in `order`, and `p`
/// is its smallest position there.
#[derive(Debug, Clone)]
pub struct ModelPass {
    order: CyclicOrder,
    first: Vec<Option<u32>>,
    /// Blocks with a position.
    distinct: u64,
    /// Blocks `0..header_blocks` hold (some of) the header.
    header_blocks: u64,
}

impl ModelPass {
    /// Parses the header from `prefix`, the first bytes of an object of `size` bytes,
    /// and builds the pass over blocks of `block` bytes.
    pub fn from_prefix(prefix: &[u8], size: u64, block: u64) -> Result<Parse, PassError> {
        let file = match GgufFile::parse_prefix(prefix, size) {
            Ok(file) => file,
            Err(GgufError::Truncated { .. }) if (prefix.len() as u64) < size => {
                let have = prefix.len() as u64;
                if have >= MAX_HEADER {
                    return Err(PassError::HeaderTooLong(MAX_HEADER));
                }
                let want = (have.max(block) * 2).min(MAX_HEADER).min(size);
                return Ok(Parse::NeedMore(want));
            }
            Err(error) => return Err(PassError::NotGguf(error)),
        };
        let layout = BlockGeometry::new(0, size, block)?;
        let graph = ModelGraph::from_tensors(&file.tensor_table(), layout);
        Ok(Parse::Model(Self::new(
            graph.order().clone(),
            size.div_ceil(block),
            file.data_offset.div_ceil(block),
        )?))
    }

    /// The pass `order` over an object of `blocks` blocks whose first `header_blocks`
    /// hold its header.
    pub fn new(order: CyclicOrder, blocks: u64, header_blocks: u64) -> Result<Self, PassError> {
        if order.is_empty() {
            return Err(PassError::NoTensors);
        }
        let mut first = vec![None; blocks as usize];
        for (position, &block) in order.sequence().iter().enumerate() {
            if let Some(slot) = first.get_mut(block as usize) {
                slot.get_or_insert(position as u32);
            }
        }
        Ok(Self {
            distinct: first.iter().filter(|p| p.is_some()).count() as u64,
            order,
            first,
            header_blocks: header_blocks.min(blocks),
        })
    }

    pub fn order(&self) -> &CyclicOrder {
        &self.order
    }

    /// Positions in one pass.
    pub fn len(&self) -> u32 {
        self.order.len()
    }

    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// Where block `block` is first used in the pass; `None` outside it.
    pub fn first_position(&self, block: u64) -> Option<u32> {
        self.first.get(block as usize).copied().flatten()
    }

    pub fn is_header(&self, block: u64) -> bool {
        block < self.header_blocks
    }

    /// Blocks of the object.
    pub fn blocks(&self) -> u64 {
        self.first.len() as u64
    }

    /// Blocks of the pass, distinct, as the pass first uses them.
    pub fn distinct_blocks(&self) -> u64 {
        self.distinct
    }

    /// The position of `block`'s occurrence nearest at or after `from`, round the
    /// cycle; `None` outside the pass.
    pub fn next_position(&self, block: u64, from: u32) -> Option<u32> {
        u32::try_from(block)
            .ok()
            .and_then(|block| self.order.next_position(block, from))
    }

    /// The next `count` distinct blocks the pass uses after `position` (round the
    /// cycle), in the order it uses them.
    pub fn ahead(&self, position: u32, count: usize) -> Vec<u64> {
        let mut out: Vec<u64> = Vec::with_capacity(count);
        let len = self.order.len();
        for step in 1..len {
            if out.len() >= count {
                break;
            }
            let block = u64::from(self.order.block_at((position + step) % len));
            if !out.contains(&block) {
                out.push(block);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::gguf::GgufWriter;

    #[test]
    fn first_positions_and_header_blocks() {
        let order = CyclicOrder::from_sequence([2, 3, 2, 5, 4], 6);
        let pass = ModelPass::new(order, 6, 1).unwrap();
        assert_eq!(pass.first_position(2), Some(0));
        assert_eq!(pass.first_position(5), Some(3));
        assert_eq!(pass.first_position(1), None);
        assert_eq!(pass.first_position(99), None);
        assert!(pass.is_header(0) && !pass.is_header(1));
        assert_eq!(pass.distinct_blocks(), 4);
        assert_eq!(pass.ahead(3, 3), [4, 2, 3]);
        assert_eq!(pass.next_position(2, 1), Some(2));
        assert_eq!(pass.next_position(2, 3), Some(0));
        assert!(matches!(
            ModelPass::new(CyclicOrder::default(), 4, 0),
            Err(PassError::NoTensors)
        ));
    }

    #[test]
    fn a_gguf_header_gives_the_execution_order_and_asks_for_more_when_cut() {
        let bytes = tiny_llama();
        let size = bytes.len() as u64;
        let block = 4096;
        let Parse::Model(pass) = ModelPass::from_prefix(&bytes, size, block).unwrap() else {
            panic!("whole file: a model");
        };
        assert!(pass.distinct_blocks() > 0);
        assert!(pass.is_header(0));
        // Cut short: asks for more, up to the object's size.
        match ModelPass::from_prefix(&bytes[..64], size, block).unwrap() {
            Parse::NeedMore(want) => assert!(want > 64 && want <= size),
            Parse::Model(_) => panic!("64 bytes cannot hold the header"),
        }
        assert!(matches!(
            ModelPass::from_prefix(b"not a model at all", 18, block),
            Err(PassError::NotGguf(_))
        ));
    }

    /// A two-layer llama with tensors in file order unlike the execution order.
    fn tiny_llama() -> Vec<u8> {
        use crate::model::ggml_type::GgmlType;
        use crate::model::gguf::{GgufValue, NewTensor};
        let tensor = |name: String, dims: Vec<u64>| NewTensor {
            name,
            dims,
            ggml_type: GgmlType::F32,
        };
        let mut tensors = vec![tensor("token_embd.weight".into(), vec![64, 256])];
        for layer in 0..2 {
            for name in ["ffn_down", "attn_q", "attn_norm", "ffn_up", "attn_k"] {
                tensors.push(tensor(format!("blk.{layer}.{name}.weight"), vec![64, 64]));
            }
        }
        tensors.push(tensor("output_norm.weight".into(), vec![64]));
        let metadata = vec![(
            "general.architecture".to_string(),
            GgufValue::string("llama"),
        )];
        let mut writer = GgufWriter::new(Vec::new(), &metadata, tensors, 32).unwrap();
        while let Some(left) = writer
            .current()
            .map(|(tensor, written)| tensor.size - written)
        {
            writer.write_data(&vec![7u8; left as usize]).unwrap();
        }
        writer.finish().unwrap()
    }
}
