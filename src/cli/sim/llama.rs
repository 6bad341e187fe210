//! A synthetic llama-shaped model: its tensor table laid out as a GGUF converter writes
//! it, and the block-access sequence of generating tokens with it.
//!
//! The access sequence is written from llama.cpp's per-token execution directly (not
//! from `graph::arch`), so a graph policy is tested against an independent statement of
//! what the program does.

use hyperoffload::geometry::BlockGeometry;
use hyperoffload::model::TensorInfo;

use super::text::TextTokens;
use super::Workload;

/// Q8_0: 32 weights in 34 bytes (an f16 scale and 32 int8).
const Q8_0_BLOCK_ELEMENTS: u64 = 32;
const Q8_0_BLOCK_BYTES: u64 = 34;
/// GGUF's default `general.alignment`.
const ALIGNMENT: u64 = 32;
/// Metadata and tensor infos before the data section (a 32k-token vocabulary's
/// tokenizer takes about this much).
const HEADER_BYTES: u64 = 1_700_000;

/// The dimensions of a llama-family decoder.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct LlamaShape {
    pub layers: u32,
    pub n_embd: u64,
    pub n_ff: u64,
    /// Width of the K and V projections (heads_kv x head_dim).
    pub n_embd_kv: u64,
    pub vocab: u64,
    /// The output head is the token embedding.
    pub tied: bool,
}

/// Tensors of one layer in execution order, with their (rows, columns) as functions of
/// the shape.
const LAYER_EXECUTION: &[&str] = &[
    "attn_norm",
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    "ffn_norm",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
];

impl LlamaShape {
    /// About 520 MB in Q8_0: 30 layers of 1152 x 3072, a 32k vocabulary, untied head.
    pub fn about_500mb() -> Self {
        Self {
            layers: 30,
            n_embd: 1152,
            n_ff: 3072,
            n_embd_kv: 288,
            vocab: 32_000,
            tied: false,
        }
    }

    /// A shape with `layers` layers whose `attn_q` takes about `tensor_bytes`; the other
    /// dimensions follow llama's proportions (K/V a quarter of the width, FFN 8/3 of it).
    pub fn scaled(layers: u32, tensor_bytes: u64) -> Self {
        let elements = tensor_bytes as f64 * Q8_0_BLOCK_ELEMENTS as f64 / Q8_0_BLOCK_BYTES as f64;
        let n_embd = ((elements.sqrt() / 128.0).round().max(1.0) as u64) * 128;
        Self {
            layers,
            n_embd,
            n_ff: (n_embd * 8 / 3).div_ceil(128) * 128,
            n_embd_kv: n_embd / 4,
            vocab: 32_000,
            tied: false,
        }
    }

    fn q8_0(rows: u64, columns: u64) -> u64 {
        rows * columns.div_ceil(Q8_0_BLOCK_ELEMENTS) * Q8_0_BLOCK_BYTES
    }

    /// (dtype, shape in GGUF order, bytes) of a layer tensor.
    fn layer_tensor(&self, name: &str) -> (&'static str, Vec<u64>, u64) {
        let (e, f, kv) = (self.n_embd, self.n_ff, self.n_embd_kv);
        let matrix =
            |columns: u64, rows: u64| ("Q8_0", vec![columns, rows], Self::q8_0(rows, columns));
        match name {
            "attn_q" | "attn_output" => matrix(e, e),
            "attn_k" | "attn_v" => matrix(e, kv),
            "ffn_gate" | "ffn_up" => matrix(e, f),
            "ffn_down" => matrix(f, e),
            _ => ("F32", vec![e], e * 4),
        }
    }

    /// Bytes of one row of the token embedding.
    pub fn embedding_row_bytes(&self) -> u64 {
        Self::q8_0(1, self.n_embd)
    }

    /// The tensor table, in a converter's file order: the embedding, then layers sorted
    /// as strings (`blk.10` before `blk.2`) with their tensors alphabetically, then the
    /// final norm and the head. Data offsets are aligned to 32 bytes, so neighbours share
    /// blocks.
    pub fn tensors(&self) -> Vec<TensorInfo> {
        let mut entries: Vec<TensorEntry> = Vec::new();
        let embd = Self::q8_0(self.vocab, self.n_embd);
        entries.push((
            "token_embd.weight".into(),
            "Q8_0",
            vec![self.n_embd, self.vocab],
            embd,
        ));
        let mut layers: Vec<String> = (0..self.layers).map(|l| l.to_string()).collect();
        layers.sort();
        let mut per_layer: Vec<&str> = LAYER_EXECUTION.to_vec();
        per_layer.sort();
        for layer in &layers {
            for tensor in &per_layer {
                let (dtype, shape, bytes) = self.layer_tensor(tensor);
                entries.push((format!("blk.{layer}.{tensor}.weight"), dtype, shape, bytes));
            }
        }
        entries.push((
            "output_norm.weight".into(),
            "F32",
            vec![self.n_embd],
            self.n_embd * 4,
        ));
        if !self.tied {
            entries.push((
                "output.weight".into(),
                "Q8_0",
                vec![self.n_embd, self.vocab],
                embd,
            ));
        }
        lay_out(entries)
    }

    /// Bytes of the whole file.
    pub fn file_len(&self) -> u64 {
        file_end(&self.tensors())
    }

    /// The blocks a program generating `tokens` tokens accesses, through a region that
    /// maps the whole file in blocks of `block_size`: per token, the blocks of one
    /// embedding row (a different row each token), every layer's tensors in execution
    /// order, the final norm and the head (the whole embedding, when tied). Each tensor
    /// is swept from start to end; touching the block one is already in is one access.
    pub fn workload(&self, block_size: u64, tokens: u32) -> Workload {
        let tensors = self.tensors();
        // The whole file is one region, so its geometry is valid for any non-zero size.
        let layout = BlockGeometry::new(0, self.file_len(), block_size.max(1))
            .expect("a synthetic model's geometry is valid");
        let range_of = |name: &str| {
            tensors
                .iter()
                .find(|t| t.name == name)
                .map(|t| t.file_range.clone())
                .unwrap_or(0..0)
        };
        let mut pass_after_rows: Vec<u32> = Vec::new();
        let sweep = |out: &mut Vec<u32>, range: std::ops::Range<u64>| {
            if let Some(blocks) = layout.blocks_of_file_range(&range) {
                for block in blocks {
                    if out.last() != Some(&block) {
                        out.push(block);
                    }
                }
            }
        };
        for layer in 0..self.layers {
            for tensor in LAYER_EXECUTION {
                sweep(
                    &mut pass_after_rows,
                    range_of(&format!("blk.{layer}.{tensor}.weight")),
                );
            }
        }
        sweep(&mut pass_after_rows, range_of("output_norm.weight"));
        let head = if self.tied {
            "token_embd.weight"
        } else {
            "output.weight"
        };
        sweep(&mut pass_after_rows, range_of(head));

        let embd = range_of("token_embd.weight");
        let row_bytes = self.embedding_row_bytes();
        // The rows of running text's tokens, the same text for every workload.
        let mut text = TextTokens::new(self.vocab, 0);
        let mut accesses = Vec::new();
        let mut token_starts = Vec::new();
        for _ in 0..tokens {
            token_starts.push(accesses.len());
            let start = embd.start + text.next_row() * row_bytes;
            sweep(&mut accesses, start..start + row_bytes);
            for &block in &pass_after_rows {
                if accesses.last() != Some(&block) {
                    accesses.push(block);
                }
            }
        }
        Workload {
            layout,
            accesses,
            token_starts,
            offsets: Vec::new(),
        }
    }
}

/// A tensor to place: name, type name, shape (outermost first) and bytes.
pub(super) type TensorEntry = (String, &'static str, Vec<u64>, u64);

/// Places `entries` one after the other from the end of a GGUF-sized header, each at
/// the next multiple of the GGUF alignment, as a converter writes them.
pub(super) fn lay_out(entries: Vec<TensorEntry>) -> Vec<TensorInfo> {
    let mut at = HEADER_BYTES.next_multiple_of(ALIGNMENT);
    entries
        .into_iter()
        .map(|(name, dtype, shape, bytes)| {
            let start = at.next_multiple_of(ALIGNMENT);
            at = start + bytes;
            TensorInfo {
                name,
                dtype: dtype.into(),
                shape,
                file_range: start..start + bytes,
            }
        })
        .collect()
}

/// Where the last of `tensors` ends: the file's length.
pub(super) fn file_end(tensors: &[TensorInfo]) -> u64 {
    tensors.iter().map(|t| t.file_range.end).max().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_preset_is_about_half_a_gigabyte_and_aligned() {
        let shape = LlamaShape::about_500mb();
        let tensors = shape.tensors();
        assert_eq!(tensors.len(), 1 + 30 * 9 + 2);
        let len = shape.file_len();
        assert!((480_000_000..560_000_000).contains(&len), "{len}");
        assert!(tensors.iter().all(|t| t.file_range.start % 32 == 0));
        assert_eq!(tensors[1].name, "blk.0.attn_k.weight");
        assert_eq!(tensors[10].name, "blk.1.attn_k.weight");
        assert_eq!(tensors[19].name, "blk.10.attn_k.weight");
    }

    #[test]
    fn a_token_reads_one_row_and_every_layer() {
        let shape = LlamaShape::about_500mb();
        let workload = shape.workload(64 << 10, 2);
        assert_eq!(workload.token_starts.len(), 2);
        let first = &workload.accesses[..workload.token_starts[1]];
        let distinct: std::collections::BTreeSet<u32> = first.iter().copied().collect();
        let blocks = workload.layout.block_count() as usize;
        let embd_blocks = (shape.vocab * shape.embedding_row_bytes()).div_ceil(64 << 10) as usize;
        let header_blocks = (HEADER_BYTES / (64 << 10)) as usize;
        // Every block but the embedding's and the header's, and one or two row blocks.
        assert!(distinct.len() >= blocks - embd_blocks - header_blocks - 2);
        assert!(distinct.len() <= blocks - embd_blocks - header_blocks + 4);
        // Blocks shared by tensors that do not run back to back are used twice.
        assert!(first.len() > distinct.len());
    }

    #[test]
    fn scaled_shapes_follow_the_requested_tensor_size() {
        let shape = LlamaShape::scaled(4, 1 << 20);
        assert_eq!(shape.n_embd % 128, 0);
        let q = LlamaShape::q8_0(shape.n_embd, shape.n_embd);
        assert!((800_000..1_300_000).contains(&q), "{q}");
    }
}
