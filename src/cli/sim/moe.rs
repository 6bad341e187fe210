//! A synthetic mixture-of-experts llama: its tensor table as a GGUF converter writes it
//! (merged `ffn_{gate,up,down}_exps`, expert index outermost), and the block-access
//! sequence of generating tokens with it, each token's experts picked by a synthetic
//! router (`router`: independent draws from a skewed popularity that differs per
//! layer, or picks with real routers' locality).
//!
//! As `sim::llama`, the accesses are written from llama.cpp's execution directly, not
//! from `graph::arch`: per layer attention, the router, then for the chosen experts in
//! ascending order their gate slices, their up slices, their down slices (ggml's
//! `mul_mat_id` runs one merged tensor for all chosen experts before the next).

use rand::rngs::SmallRng;
use rand::SeedableRng;

use hyperoffload::geometry::BlockGeometry;
use hyperoffload::graph::experts::expert_block_cuts;
use hyperoffload::model::TensorInfo;

use super::llama::{file_end, lay_out, TensorEntry};
use super::router::{Router, Routing};
use super::text::TextTokens;
use super::Workload;

/// The page the cuts are rounded to: x86_64's, fixed so that a shape's workload is the
/// same on every machine.
const PAGE: u64 = 4096;
const Q8_0_BLOCK_ELEMENTS: u64 = 32;
const Q8_0_BLOCK_BYTES: u64 = 34;

/// The dimensions of a mixture-of-experts llama.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct MoeShape {
    pub layers: u32,
    pub n_embd: u64,
    /// Width of one expert's FFN.
    pub n_ff_exp: u64,
    pub experts: u32,
    /// Experts a token runs per layer.
    pub used: u32,
    pub vocab: u64,
    /// Popularity of the expert of rank r in a layer is proportional to
    /// `1 / (r + 1)^skew` (0: uniform), for the independent router.
    pub skew: f64,
    pub routing: Routing,
}

impl MoeShape {
    /// Coarse: 16 experts of which 2 run, slices of a few MiB (Mixtral-like).
    pub fn coarse() -> Self {
        Self {
            layers: 8,
            n_embd: 1024,
            n_ff_exp: 2816,
            experts: 16,
            used: 2,
            vocab: 32_000,
            skew: 1.0,
            routing: Routing::Independent,
        }
    }

    /// Fine-grained: 64 small experts of which 8 run (Qwen3-MoE-, OLMoE-like).
    pub fn fine() -> Self {
        Self {
            layers: 8,
            n_embd: 1024,
            n_ff_exp: 512,
            experts: 64,
            used: 8,
            vocab: 32_000,
            skew: 1.0,
            routing: Routing::Independent,
        }
    }

    /// Fine-grained as Qwen3-MoE: 128 small experts of which 8 run.
    pub fn qwen3_like() -> Self {
        Self {
            layers: 8,
            n_embd: 1024,
            n_ff_exp: 384,
            experts: 128,
            used: 8,
            vocab: 32_000,
            skew: 1.0,
            routing: Routing::Independent,
        }
    }

    /// The same shape, routed by `routing`.
    pub fn with_routing(self, routing: Routing) -> Self {
        Self { routing, ..self }
    }

    fn q8_0(rows: u64, columns: u64) -> u64 {
        rows * columns.div_ceil(Q8_0_BLOCK_ELEMENTS) * Q8_0_BLOCK_BYTES
    }

    /// (dtype, shape outermost first, bytes) of a layer tensor.
    fn layer_tensor(&self, name: &str) -> (&'static str, Vec<u64>, u64) {
        let (e, f, n) = (self.n_embd, self.n_ff_exp, self.experts as u64);
        match name {
            "attn_q" | "attn_output" => ("Q8_0", vec![e, e], Self::q8_0(e, e)),
            "attn_k" | "attn_v" => ("Q8_0", vec![e / 4, e], Self::q8_0(e / 4, e)),
            "ffn_gate_inp" => ("F32", vec![n, e], n * e * 4),
            "ffn_gate_exps" | "ffn_up_exps" => ("Q8_0", vec![n, f, e], n * Self::q8_0(f, e)),
            "ffn_down_exps" => ("Q8_0", vec![n, e, f], n * Self::q8_0(e, f)),
            _ => ("F32", vec![e], e * 4),
        }
    }

    /// The tensor table in a converter's order: embedding, layers sorted as strings
    /// with their tensors alphabetically, final norm, head.
    pub fn tensors(&self) -> Vec<TensorInfo> {
        let embd = Self::q8_0(self.vocab, self.n_embd);
        let mut entries: Vec<TensorEntry> = vec![(
            "token_embd.weight".into(),
            "Q8_0",
            vec![self.vocab, self.n_embd],
            embd,
        )];
        let mut layers: Vec<String> = (0..self.layers).map(|l| l.to_string()).collect();
        layers.sort();
        let mut per_layer = LAYER_TENSORS.to_vec();
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
        entries.push((
            "output.weight".into(),
            "Q8_0",
            vec![self.vocab, self.n_embd],
            embd,
        ));
        lay_out(entries)
    }

    pub fn file_len(&self) -> u64 {
        file_end(&self.tensors())
    }

    /// The blocks a program generating `tokens` tokens accesses through a region of the
    /// whole file in blocks of `block_size`, each token's experts drawn with `seed`.
    pub fn workload(&self, block_size: u64, tokens: u32, seed: u64) -> Workload {
        self.generate(block_size, tokens, seed, None)
    }

    /// `tokens` other tokens of the router `workload(block_size, _, seed)` runs: the
    /// same popularity per layer, the picks drawn afresh with `picks_seed`. On the
    /// independent router, counted over many tokens, it is that popularity itself: what
    /// the best online policy would keep if it knew it from the start (see
    /// `sim::frequency`). The locality router's popularity drifts along another path,
    /// so there it is no such reference.
    #[cfg(test)]
    pub fn resampled(&self, block_size: u64, tokens: u32, seed: u64, picks_seed: u64) -> Workload {
        self.generate(block_size, tokens, seed, Some(picks_seed))
    }

    /// `workload`, the picks drawn with `picks_seed` if given, else with the generator
    /// that drew the router's popularity.
    fn generate(
        &self,
        block_size: u64,
        tokens: u32,
        seed: u64,
        picks_seed: Option<u64>,
    ) -> Workload {
        let tensors = self.tensors();
        // Cut at the experts' slices, as the pager cuts a GGUF (`model_block_cuts`): a
        // token that runs an expert reads its bytes, not its neighbours' in a shared
        // block. A synthetic file is far from 2^32 blocks of any size.
        let cuts = expert_block_cuts(&tensors, PAGE);
        let layout = BlockGeometry::new(0, self.file_len(), block_size.max(1))
            .and_then(|layout| layout.with_file_cuts(cuts))
            .expect("a synthetic model's geometry is valid");
        let range_of = |name: &str| {
            tensors
                .iter()
                .find(|t| t.name == name)
                .map(|t| t.file_range.clone())
                .unwrap_or(0..0)
        };
        // Each block of `range` in turn, with where in it the sweep enters.
        let sweep = |out: &mut Vec<(u32, u32)>, range: std::ops::Range<u64>| {
            if let Some(blocks) = layout.blocks_of_file_range(&range) {
                for block in blocks {
                    let block_start = layout.block_start(block);
                    let offset = (block_start.max(range.start) - block_start) as u32;
                    if out.last().map(|&(last, _)| last) != Some(block) {
                        out.push((block, offset));
                    }
                }
            }
        };
        let mut rng = SmallRng::seed_from_u64(seed);
        let mut router = Router::new(
            self.routing,
            self.layers,
            self.experts,
            self.used,
            self.skew,
            &mut rng,
        );
        let mut rng = picks_seed.map_or(rng, SmallRng::seed_from_u64);
        let embd = range_of("token_embd.weight");
        let row_bytes = Self::q8_0(1, self.n_embd);
        let mut text = TextTokens::new(self.vocab, seed);
        let mut accesses = Vec::new();
        let mut token_starts = Vec::new();
        for _ in 0..tokens {
            token_starts.push(accesses.len());
            let start = embd.start + text.next_row() * row_bytes;
            sweep(&mut accesses, start..start + row_bytes);
            for layer in 0..self.layers {
                for tensor in DENSE_BEFORE_EXPERTS {
                    sweep(
                        &mut accesses,
                        range_of(&format!("blk.{layer}.{tensor}.weight")),
                    );
                }
                let chosen = router.next(layer, &mut rng);
                for tensor in ["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"] {
                    let whole = range_of(&format!("blk.{layer}.{tensor}.weight"));
                    let share = (whole.end - whole.start) / self.experts as u64;
                    for &expert in &chosen {
                        let start = whole.start + expert as u64 * share;
                        sweep(&mut accesses, start..start + share);
                    }
                }
            }
            sweep(&mut accesses, range_of("output_norm.weight"));
            sweep(&mut accesses, range_of("output.weight"));
        }
        Workload {
            layout,
            offsets: accesses.iter().map(|&(_, offset)| offset).collect(),
            accesses: accesses.iter().map(|&(block, _)| block).collect(),
            token_starts,
        }
    }
}

const LAYER_TENSORS: &[&str] = &[
    "attn_norm",
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    "ffn_norm",
    "ffn_gate_inp",
    "ffn_gate_exps",
    "ffn_up_exps",
    "ffn_down_exps",
];

/// The tensors of a layer every token reads before its experts: all but the three
/// merged expert tensors, which close `LAYER_TENSORS`.
const DENSE_BEFORE_EXPERTS: &[&str] = LAYER_TENSORS.split_at(LAYER_TENSORS.len() - 3).0;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_read_the_dense_path_and_only_their_experts() {
        let shape = MoeShape::coarse();
        let block = 1 << 20;
        let workload = shape.workload(block, 4, 7);
        let blocks = workload.layout.block_count() as usize;
        let first = &workload.accesses[..workload.token_starts[1]];
        let distinct: std::collections::BTreeSet<u32> = first.iter().copied().collect();
        // Two experts of sixteen: well under a third of the model per token.
        assert!(
            distinct.len() < blocks / 3,
            "{} of {blocks}",
            distinct.len()
        );
        let exps = shape.layer_tensor("ffn_gate_exps").2;
        assert!(exps % shape.experts as u64 == 0);
    }

    #[test]
    fn popularity_is_skewed_and_differs_per_layer() {
        let shape = MoeShape::coarse();
        let mut rng = SmallRng::seed_from_u64(1);
        let mut router = Router::new(Routing::Independent, 2, 16, 2, shape.skew, &mut rng);
        let mut counts = vec![vec![0u32; 16]; 2];
        for _ in 0..2000 {
            for (layer, counts) in counts.iter_mut().enumerate() {
                for e in router.next(layer as u32, &mut rng) {
                    counts[e as usize] += 1;
                }
            }
        }
        let top = |c: &Vec<u32>| (0..16).max_by_key(|&e| c[e]).unwrap();
        assert_ne!(top(&counts[0]), top(&counts[1]));
        let mut sorted = counts[0].clone();
        sorted.sort_unstable_by(|a, b| b.cmp(a));
        let top_quarter: u32 = sorted[..4].iter().sum();
        assert!(top_quarter * 2 > sorted.iter().sum::<u32>(), "{sorted:?}");
    }
}
