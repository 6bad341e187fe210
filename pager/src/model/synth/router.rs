//! A router with locality, built into the weights so that unmodified llama.cpp shows
//! it: real routers repeat a token's experts in the next tokens, send the same word to
//! the same experts, and drift with the topic. Here the router's input (the residual
//! stream after layer 0's attention) is the current token's embedding plus a vector of
//! the recent tokens:
//!
//! ```text
//!   x = E[t] + sum over window heads h of  gain_h * M_g (A_h V - drift * mean V)
//!       ^ token: the embedding dominates      ^ context: attention over recent tokens
//! ```
//!
//! - Every embedding row has one shared constant coordinate (the *anchor*) and the
//!   same norm, so after the attention norm that coordinate is the same number for
//!   every token. Layer 0's `attn_q` and `attn_k` read only it: q and k are the same
//!   for every token, and after RoPE `q . k` depends only on the distance between the
//!   two positions. Choosing which rotary pairs q and k use, and how strongly, makes a
//!   head's attention a half-Gaussian window over the last `sigma` tokens.
//! - The last head of each group of heads sharing a key (GQA) has q = 0: it attends
//!   evenly to everything so far, and `attn_output` subtracts it (`drift`) from its
//!   group's window heads, so what routes is how the recent text differs from the
//!   text so far, not the words every window holds (which would be a lasting hot set).
//! - `attn_v` reads everything but the anchor; `attn_output` projects each group's
//!   heads through one shared random matrix, scaled by each head's gain.
//! - Layers after the first add no attention output (`attn_output` is zero), so the
//!   routers of every layer see the same token and context, through their own rows.
//!
//! With `context` 0 the router follows the token alone.

use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::Rng;

use super::fill::{f32_to_f16, Fill};
use super::quantize;
use super::SynthError;
use crate::model::ggml_type::GgmlType;

/// Embedding elements are integer multiples of this, at most 127 of it: exact in
/// f32, f16, bf16 and Q8_0 (a power of two is an exact f16 block scale), so every
/// row's norm is exactly the same.
const EMBEDDING_UNIT: f32 = 0.25;
/// The anchor, in units: above every other element, so it is also Q8_0's block maximum.
const ANCHOR_UNITS: i32 = 127;
/// The other elements spread evenly over [-SPREAD_UNITS, SPREAD_UNITS] units (an
/// element spread of about 64 units, 16: the embedding dominates the residual stream,
/// so what later layers' experts add barely moves the routers' input).
const SPREAD_UNITS: i32 = 110;
/// Each key element of a rotary pair in use (after the norm); q carries the strength.
const KEY_AMPLITUDE: f32 = 4.0;
/// A window head uses the rotary pairs whose angle per token lies in
/// `[BAND_LOW, BAND_HIGH] / sigma`: slow enough that `cos` is near its quadratic
/// expansion over the window (a Gaussian), several pairs so that their sum never comes
/// back near its peak far away (checked up to 4096 tokens in the tests).
const BAND_LOW: f32 = 0.02;
const BAND_HIGH: f32 = 0.2;
/// The spread of the output logits over the vocabulary.
const OUTPUT_LOGIT_SPREAD: f32 = 4.0;

/// How a mixture of experts' router follows the text (see the module's description).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RouterLocality {
    /// The recent context's weight in the router's input against the token's: 0 routes
    /// by the token alone; the context's elements are `context` times the embedding's
    /// spread per unit of a head's output.
    pub context: f32,
    /// Relative weights of the windows of `WINDOW_TOKENS` (short, medium, long).
    pub windows: [f32; 3],
    /// The share (0 to 1) of the mean since the sequence's start taken out of the
    /// context: 1 leaves only how the recent text differs from the whole.
    pub drift: f32,
    /// The router skew the preset was calibrated with (`MoeSpec::skew` unless given).
    pub skew: Option<f32>,
}

impl RouterLocality {
    /// Tokens each window reaches back (the Gaussian's standard deviation).
    pub const WINDOW_TOKENS: [f32; 3] = [1.5, 6.0, 40.0];
    /// The most context `check` accepts.
    pub const MAX_CONTEXT: f32 = 64.0;

    /// Routing by the token alone: a word picks the same experts wherever it stands.
    pub fn token() -> Self {
        Self::with_context(0.0)
    }

    /// The preset's windows and drift with this much context.
    pub fn with_context(context: f32) -> Self {
        Self {
            context,
            skew: None,
            ..Self::qwen3()
        }
    }

    /// Calibrated so that llama.cpp decoding plain English one token at a time
    /// (llama-perplexity -b 1 over the GPL's text, 512 tokens, `inspect --trace`) gives
    /// per-layer LRU hit rates near Qwen3-235B-A22B's real decode traces: 0.37, 0.60,
    /// 0.71, 0.86, 0.94 at 5, 12, 20, 36, 55 % of a layer's experts against 0.34, 0.58,
    /// 0.74, 0.89, 0.96 (3 GiB model, 128 experts, 8 used), LFU below LRU at each.
    pub fn qwen3() -> Self {
        Self {
            context: 14.0,
            windows: [1.5, 1.0, 4.0],
            drift: 1.0,
            skew: Some(1.5),
        }
    }

    /// `off` (no locality), `token`, `qwen3` or a context weight.
    pub fn parse(text: &str) -> Result<Option<Self>, SynthError> {
        let locality = match text {
            "off" => return Ok(None),
            "token" => Self::token(),
            "qwen3" => Self::qwen3(),
            number => match number.parse::<f32>() {
                Ok(context) => Self::with_context(context),
                Err(_) => {
                    return Err(SynthError::Locality(format!(
                        "{text:?} is not off, token, qwen3 or a context weight (0 to {})",
                        Self::MAX_CONTEXT
                    )))
                }
            },
        };
        locality.check()?;
        Ok(Some(locality))
    }

    pub fn check(&self) -> Result<(), SynthError> {
        let bad = |what: String| Err(SynthError::Locality(what));
        if !(self.context.is_finite() && (0.0..=Self::MAX_CONTEXT).contains(&self.context)) {
            return bad(format!(
                "context weight {}: must be 0 to {}",
                self.context,
                Self::MAX_CONTEXT
            ));
        }
        if !self.windows.iter().all(|w| w.is_finite() && *w >= 0.0) {
            return bad(format!(
                "window weights {:?}: must be 0 or more",
                self.windows
            ));
        }
        if !(self.drift.is_finite() && (0.0..=1.0).contains(&self.drift)) {
            return bad(format!("drift {}: must be 0 to 1", self.drift));
        }
        Ok(())
    }
}

/// The shape a locality router's tensors are built for.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ContextAttention {
    pub locality: RouterLocality,
    pub n_embd: u32,
    pub n_head: u32,
    pub n_head_kv: u32,
    pub head_dim: u32,
    /// `llama.rope.freq_base`: the rotary angles are `base^(-2i / head_dim)`.
    pub rope_base: f32,
}

/// Which of layer 0's attention tensors a `Fill::Context` is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContextTensor {
    Query,
    Key,
    Value,
    Output,
}

/// What one attention head of layer 0 does.
#[derive(Debug, Clone, Copy, PartialEq)]
enum HeadRole {
    /// Attends over a window of `RouterLocality::WINDOW_TOKENS[kind]` tokens.
    Window { kind: usize },
    /// Attends evenly to every token so far.
    Mean,
}

impl ContextAttention {
    fn heads_per_group(&self) -> u32 {
        (self.n_head / self.n_head_kv.max(1)).max(1)
    }

    /// Heads sharing a key and value: the last of each group is the mean (when a group
    /// has two or more), the others take the window kinds in turn.
    fn role(&self, head: u32) -> HeadRole {
        let per_group = self.heads_per_group();
        let (group, at) = (head / per_group, head % per_group);
        if per_group < 2 {
            return HeadRole::Window {
                kind: head as usize % 3,
            };
        }
        if at == per_group - 1 {
            return HeadRole::Mean;
        }
        HeadRole::Window {
            kind: (group * (per_group - 1) + at) as usize % 3,
        }
    }

    /// Rotary angle per token of pair `i`.
    fn theta(&self, pair: u32) -> f32 {
        self.rope_base
            .powf(-2.0 * pair as f32 / self.head_dim.max(2) as f32)
    }

    /// The pairs a window of `sigma` tokens uses: those in its band, or the one nearest
    /// the band's middle when none is.
    fn band(&self, sigma: f32) -> Vec<u32> {
        let pairs = self.head_dim / 2;
        let (low, high) = (BAND_LOW / sigma, BAND_HIGH / sigma);
        let band: Vec<u32> = (0..pairs)
            .filter(|&i| (low..=high).contains(&self.theta(i)))
            .collect();
        if !band.is_empty() {
            return band;
        }
        let middle = (low * high).sqrt();
        let distance = |i: &u32| (self.theta(*i) / middle).ln().abs();
        (0..pairs)
            .min_by(|a, b| distance(a).total_cmp(&distance(b)))
            .into_iter()
            .collect()
    }

    /// q's element at `dim` of `head`: each of the window's pairs gets an equal share of
    /// `alpha`, the peak score, chosen so that the score falls as a Gaussian of the
    /// window's width: `alpha (1 - mean(theta^2) d^2 / 2) = alpha - d^2 / (2 sigma^2)`.
    fn query(&self, head: u32, dim: u32) -> f32 {
        let HeadRole::Window { kind } = self.role(head) else {
            return 0.0;
        };
        if dim % 2 == 1 {
            return 0.0;
        }
        let sigma = RouterLocality::WINDOW_TOKENS[kind];
        let band = self.band(sigma);
        if !band.contains(&(dim / 2)) {
            return 0.0;
        }
        let mean_square: f32 =
            band.iter().map(|&i| self.theta(i).powi(2)).sum::<f32>() / band.len() as f32;
        let alpha = 1.0 / (sigma * sigma * mean_square);
        // llama.cpp scales q . k by 1 / sqrt(head_dim).
        let kq_scale = 1.0 / (self.head_dim as f32).sqrt();
        alpha / (band.len() as f32 * kq_scale * KEY_AMPLITUDE)
    }

    /// k's element at `dim`: the same for every head, in every pair some window uses.
    fn key(&self, dim: u32) -> f32 {
        let used = RouterLocality::WINDOW_TOKENS
            .iter()
            .any(|&sigma| self.band(sigma).contains(&(dim / 2)));
        if dim % 2 == 0 && used {
            KEY_AMPLITUDE
        } else {
            0.0
        }
    }

    /// The weight of each head's output in the residual stream, per unit of the
    /// embedding's spread: window heads by their kind; a mean head takes away `drift`
    /// of what its group's window heads add.
    fn gain(&self, head: u32) -> f32 {
        let locality = &self.locality;
        let window = |head: u32| match self.role(head) {
            HeadRole::Window { kind } => locality.context * locality.windows[kind],
            HeadRole::Mean => 0.0,
        };
        match self.role(head) {
            HeadRole::Window { .. } => window(head),
            HeadRole::Mean => {
                let per_group = self.heads_per_group();
                let first = head / per_group * per_group;
                -locality.drift * (first..first + per_group).map(window).sum::<f32>()
            }
        }
    }
}

/// The anchor's value after llama.cpp's RMS norm of an embedding row (the same for
/// every row: they share one norm).
fn normed_anchor(n_embd: u32) -> f32 {
    let others = embedding_units(n_embd);
    let squares: f64 = others.iter().map(|&q| f64::from(q * q)).sum::<f64>()
        + f64::from(ANCHOR_UNITS * ANCHOR_UNITS);
    (f64::from(ANCHOR_UNITS) / (squares / f64::from(n_embd.max(1))).sqrt()) as f32
}

/// The embedding's elements after the anchor, in units, before each row shuffles them.
fn embedding_units(n_embd: u32) -> Vec<i32> {
    let n = n_embd.saturating_sub(1).max(1);
    (0..n)
        .map(|k| {
            let at = if n > 1 {
                k as f32 / (n - 1) as f32
            } else {
                0.5
            };
            (-(SPREAD_UNITS as f32) + 2.0 * SPREAD_UNITS as f32 * at).round() as i32
        })
        .collect()
}

/// The embedding's element spread (its rows' RMS).
pub fn embedding_spread(n_embd: u32) -> f32 {
    EMBEDDING_UNIT * ANCHOR_UNITS as f32 / normed_anchor(n_embd)
}

/// How a locality model fills the tensors that make it one (see the module's
/// description), by role and layer; `None` for those filled as in any other model.
pub fn fill_for(role: &str, layer: u32, attention: &ContextAttention) -> Option<Fill> {
    let context = |tensor| {
        Some(Fill::Context {
            attention: *attention,
            tensor,
        })
    };
    match (role, layer) {
        ("token_embd.weight", _) => Some(Fill::Embedding {
            n_embd: attention.n_embd,
        }),
        ("attn_q.weight", 0) => context(ContextTensor::Query),
        ("attn_k.weight", 0) => context(ContextTensor::Key),
        ("attn_v.weight", 0) => context(ContextTensor::Value),
        ("attn_output.weight", 0) => context(ContextTensor::Output),
        // Biases would move q and k off the anchor; later layers add no attention.
        ("attn_q.bias" | "attn_k.bias" | "attn_v.bias" | "attn_output.bias", _) => {
            Some(Fill::Constant(0.0))
        }
        ("attn_output.weight", _) => Some(Fill::Constant(0.0)),
        // The output reads the (tied) embedding: its logits would spread over thousands,
        // and perplexity overflow to inf. Scaled to a spread of a few units, as a
        // trained model's; the greedy choice is the same.
        ("output_norm.weight", _) => Some(Fill::Constant(
            OUTPUT_LOGIT_SPREAD
                / (embedding_spread(attention.n_embd) * (attention.n_embd as f32).sqrt()),
        )),
        _ => None,
    }
}

/// Elements per row of a tensor filled row by row (`fill_rows`); `None` for the rest.
pub fn row_len(what: &Fill) -> Option<u32> {
    match *what {
        Fill::Embedding { n_embd } => Some(n_embd),
        Fill::Context {
            attention, tensor, ..
        } => Some(match tensor {
            ContextTensor::Output => attention.n_head * attention.head_dim,
            _ => attention.n_embd,
        }),
        _ => None,
    }
}

/// Refuses a type the rows of `what` cannot be written in exactly enough.
pub fn check_type(tensor: &str, ty: GgmlType, what: &Fill) -> Result<(), SynthError> {
    let fits = match what {
        Fill::Embedding { .. } => matches!(
            ty,
            GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16 | GgmlType::Q8_0
        ),
        Fill::Context { .. } => quantize::supported(ty),
        _ => true,
    };
    if fits {
        Ok(())
    } else {
        Err(SynthError::LocalityType {
            tensor: tensor.to_string(),
            ty,
        })
    }
}

/// Fills `buf`, whole rows of `what` (a `row_len` fill) in type `ty` starting at row
/// `first_row`.
pub fn fill_rows(ty: GgmlType, what: &Fill, first_row: u64, buf: &mut [u8], rng: &mut SmallRng) {
    let Some(len) = row_len(what) else {
        return;
    };
    let row_bytes = ty.tensor_bytes(&[u64::from(len)]).unwrap_or(1).max(1) as usize;
    let mut out = Vec::with_capacity(buf.len());
    let mut values = Vec::with_capacity(len as usize);
    let units = embedding_units(len);
    for row in first_row..first_row + (buf.len() / row_bytes) as u64 {
        match *what {
            Fill::Embedding { .. } => embedding_row(ty, &units, rng, &mut out),
            Fill::Context { attention, tensor } => {
                values.clear();
                attention.row(tensor, row as u32, rng, &mut values);
                quantize::encode(ty, &values, &mut out);
            }
            _ => {}
        }
    }
    buf[..out.len()].copy_from_slice(&out);
}

/// One embedding row: the anchor, then the shared units in a random order, exact in
/// `ty` (so every row's norm is the same to the last bit of the sum's rounding).
fn embedding_row(ty: GgmlType, units: &[i32], rng: &mut SmallRng, out: &mut Vec<u8>) {
    let mut row = Vec::with_capacity(units.len() + 1);
    row.push(ANCHOR_UNITS);
    row.extend_from_slice(units);
    row[1..].shuffle(rng);
    if ty == GgmlType::Q8_0 {
        for block in row.chunks_exact(32) {
            out.extend(f32_to_f16(EMBEDDING_UNIT).to_le_bytes());
            out.extend(block.iter().map(|&q| q as i8 as u8));
        }
    } else {
        let values: Vec<f32> = row.iter().map(|&q| q as f32 * EMBEDDING_UNIT).collect();
        quantize::encode(ty, &values, out);
    }
}

impl ContextAttention {
    /// Row `row` of `tensor` as floats (`ggml`'s ne[0] is a row: the inputs of one
    /// output element).
    fn row(&self, tensor: ContextTensor, row: u32, rng: &mut SmallRng, out: &mut Vec<f32>) {
        let n_embd = self.n_embd as usize;
        let dim = row % self.head_dim.max(1);
        let anchor = normed_anchor(self.n_embd);
        // Uniform on [-a, a] has unit variance for a = sqrt(3).
        let a = 3f32.sqrt();
        match tensor {
            ContextTensor::Query | ContextTensor::Key => {
                out.resize(n_embd, 0.0);
                out[0] = match tensor {
                    ContextTensor::Query => self.query(row / self.head_dim.max(1), dim),
                    _ => self.key(dim),
                } / anchor;
            }
            ContextTensor::Value => {
                // Unit-variance values from the normed embedding, the anchor left out.
                let std = 1.0 / (n_embd.saturating_sub(1).max(1) as f32).sqrt();
                out.push(0.0);
                out.extend((1..n_embd).map(|_| std * rng.gen_range(-a..=a)));
            }
            ContextTensor::Output => self.output_row(rng, out),
        }
    }

    /// One residual element's weights over every head's output: per group one random
    /// projection, shared by its heads and scaled by each head's gain, so a mean head
    /// takes away exactly what it should from its group's window heads.
    fn output_row(&self, rng: &mut SmallRng, out: &mut Vec<f32>) {
        let a = 3f32.sqrt();
        let head_dim = self.head_dim as usize;
        let scale = embedding_spread(self.n_embd)
            / ((self.n_head_kv.max(1) * self.head_dim.max(1)) as f32).sqrt();
        let per_group = self.heads_per_group();
        for group in 0..self.n_head / per_group {
            let shared: Vec<f32> = (0..head_dim).map(|_| rng.gen_range(-a..=a)).collect();
            for head in group * per_group..(group + 1) * per_group {
                let gain = self.gain(head) * scale;
                out.extend(shared.iter().map(|u| gain * u));
            }
        }
    }
}

#[cfg(test)]
mod tests;
