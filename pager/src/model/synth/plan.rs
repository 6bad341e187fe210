//! Choosing the shape of a synthetic llama model: how wide and how deep, so that the
//! file comes out near the requested size; its tensors and their order (its metadata:
//! `metadata`).

use std::collections::HashMap;
use std::io;

use rand::seq::SliceRandom;
use rand::SeedableRng;

use super::arch::SynthArch;
use super::fill::{self, Fill};
use super::hf_order;
use super::metadata::{llama_file_type, metadata, same_type};
use super::mix::QuantMix;
use super::router::{self, ContextAttention, RouterLocality};
use super::{SynthError, TensorOrder};
use crate::model::ggml_type::GgmlType;
use crate::model::gguf::{GgufFile, GgufValue, GgufWriter, NewTensor};

/// The dimensions of a llama model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LlamaShape {
    pub n_layer: u64,
    pub n_embd: u64,
    pub n_ff: u64,
    pub n_head: u64,
    pub n_head_kv: u64,
    pub head_dim: u64,
    pub n_vocab: u64,
    /// Routed experts per layer; 0 for a dense model. `n_ff` is then each expert's
    /// feed-forward width, as llama.cpp reads it for a llama mixture of experts.
    pub n_expert: u64,
    /// Experts a token runs per layer (0 for a dense model).
    pub n_expert_used: u64,
    /// Shared experts per layer, which every token runs (`ffn_*_shexp`, `n_ff` wide
    /// each); 0 for the llama mixture of experts.
    pub n_expert_shared: u64,
    /// Leading layers with a dense feed-forward network in place of experts
    /// (DeepSeek's and GLM's first layers), as wide as what a token runs in the
    /// others: its experts and the shared ones. The size is planned as if every
    /// layer had experts (the file comes out a dense layer's difference smaller).
    pub n_layer_dense_lead: u64,
}

impl LlamaShape {
    /// The dimensions of a model's tensor, by its name without the `blk.N.` prefix;
    /// `None` for a tensor a llama model does not have.
    fn dims(&self, role: &str) -> Option<Vec<u64>> {
        let q = self.n_head * self.head_dim;
        let kv = self.n_head_kv * self.head_dim;
        let mla = self.latent_attention();
        Some(match role {
            "token_embd.weight" | "output.weight" => vec![self.n_embd, self.n_vocab],
            "output_norm.weight" | "attn_norm.weight" | "ffn_norm.weight" => vec![self.n_embd],
            "rope_freqs.weight" => vec![self.head_dim / 2],
            "attn_q.weight" => vec![self.n_embd, q],
            "attn_k.weight" | "attn_v.weight" => vec![self.n_embd, kv],
            "attn_output.weight" => vec![q, self.n_embd],
            "attn_q.bias" => vec![q],
            "attn_k.bias" | "attn_v.bias" => vec![kv],
            "attn_output.bias" | "ffn_down.bias" => vec![self.n_embd],
            "ffn_gate.weight" | "ffn_up.weight" => vec![self.n_embd, self.dense_ff()],
            "ffn_gate.bias" | "ffn_up.bias" => vec![self.dense_ff()],
            "ffn_down.weight" => vec![self.dense_ff(), self.n_embd],
            "ffn_gate_inp.weight" if self.n_expert > 0 => vec![self.n_embd, self.n_expert],
            "ffn_gate_exps.weight" | "ffn_up_exps.weight" if self.n_expert > 0 => {
                vec![self.n_embd, self.n_ff, self.n_expert]
            }
            "ffn_down_exps.weight" if self.n_expert > 0 => {
                vec![self.n_ff, self.n_embd, self.n_expert]
            }
            // Other architectures' (`arch`).
            "attn_q_norm.weight" | "attn_k_norm.weight" => vec![self.head_dim],
            "attn_sinks.weight" => vec![self.n_head],
            "post_attention_norm.weight" => vec![self.n_embd],
            "ffn_gate_inp.bias" if self.n_expert > 0 => vec![self.n_expert],
            "ffn_gate_exps.bias" | "ffn_up_exps.bias" if self.n_expert > 0 => {
                vec![self.n_ff, self.n_expert]
            }
            "ffn_down_exps.bias" if self.n_expert > 0 => vec![self.n_embd, self.n_expert],
            "exp_probs_b.bias" if self.n_expert > 0 => vec![self.n_expert],
            "ffn_gate_shexp.weight" | "ffn_up_shexp.weight" if self.n_expert_shared > 0 => {
                vec![self.n_embd, self.n_ff * self.n_expert_shared]
            }
            "ffn_down_shexp.weight" if self.n_expert_shared > 0 => {
                vec![self.n_ff * self.n_expert_shared, self.n_embd]
            }
            // DeepSeek's latent attention (`LatentAttention`).
            "attn_q_a.weight" => vec![self.n_embd, mla.q_lora_rank],
            "attn_q_a_norm.weight" => vec![mla.q_lora_rank],
            "attn_q_b.weight" => vec![mla.q_lora_rank, self.n_head * mla.key_length()],
            "attn_kv_a_mqa.weight" => vec![self.n_embd, mla.kv_lora_rank + mla.rope_dim],
            "attn_kv_a_norm.weight" => vec![mla.kv_lora_rank],
            "attn_k_b.weight" => vec![mla.nope_dim, mla.kv_lora_rank, self.n_head],
            "attn_v_b.weight" => vec![mla.kv_lora_rank, mla.value_length, self.n_head],
            _ => return None,
        })
    }

    /// The width of a dense feed-forward network: `n_ff`, or in a mixture of experts
    /// (its dense leading layers) what a token runs in the others.
    pub(super) fn dense_ff(&self) -> u64 {
        if self.n_expert == 0 {
            self.n_ff
        } else {
            self.n_ff * (self.n_expert_used + self.n_expert_shared)
        }
    }

    /// The latent attention of a model of this shape, were it DeepSeek's.
    pub fn latent_attention(&self) -> LatentAttention {
        LatentAttention::for_head(self.head_dim)
    }

    /// Parameters (elements) of all tensors.
    fn n_params(&self, globals: &[Role], layer: &[Role]) -> u64 {
        let count = |role: &Role| self.dims(&role.name).map_or(0, |d| d.iter().product());
        globals.iter().map(count).sum::<u64>() + self.n_layer * layer.iter().map(count).sum::<u64>()
    }
}

/// DeepSeek's multi-head latent attention (MLA), as llama.cpp loads it: queries
/// through a low-rank pair (`attn_q_a`, `attn_q_b`), keys and values compressed into
/// one latent row per token plus a shared rotated key part (`attn_kv_a_mqa`), and
/// expanded per head by `attn_k_b` and `attn_v_b`. The ranks are DeepSeek-V3's in
/// proportion to the head: with 128-wide value heads it has a 1536 query rank, a 512
/// latent, 128 unrotated and 64 rotated key dimensions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LatentAttention {
    pub q_lora_rank: u64,
    pub kv_lora_rank: u64,
    /// Key dimensions without rotation, per head.
    pub nope_dim: u64,
    /// Rotated key dimensions, shared by all heads.
    pub rope_dim: u64,
    /// Value dimensions per head.
    pub value_length: u64,
}

impl LatentAttention {
    pub(super) fn for_head(head_dim: u64) -> LatentAttention {
        LatentAttention {
            q_lora_rank: 12 * head_dim,
            kv_lora_rank: 4 * head_dim,
            nope_dim: head_dim,
            rope_dim: head_dim / 2,
            value_length: head_dim,
        }
    }

    /// Key dimensions per head, as attention sees them (`key_length_mla`).
    pub fn key_length(&self) -> u64 {
        self.nope_dim + self.rope_dim
    }
}

/// A kind of tensor of the small model, with its type (per small layer, for layers).
#[derive(Debug, Clone)]
pub(super) struct Role {
    pub(super) name: String,
    pub(super) types: Vec<GgmlType>,
}

/// The llama execution order of a layer's tensors (biases follow their weights).
const EXEC_ORDER: &[&str] = &[
    "attn_norm.weight",
    "attn_q.weight",
    "attn_q.bias",
    "attn_q_norm.weight",
    "attn_k.weight",
    "attn_k.bias",
    "attn_k_norm.weight",
    "attn_v.weight",
    "attn_v.bias",
    "attn_q_a.weight",
    "attn_q_a_norm.weight",
    "attn_q_b.weight",
    "attn_kv_a_mqa.weight",
    "attn_kv_a_norm.weight",
    "attn_k_b.weight",
    "attn_v_b.weight",
    "attn_sinks.weight",
    "attn_output.weight",
    "attn_output.bias",
    "ffn_norm.weight",
    "post_attention_norm.weight",
    "ffn_gate_inp.weight",
    "ffn_gate_inp.bias",
    "exp_probs_b.bias",
    "ffn_gate.weight",
    "ffn_gate_exps.weight",
    "ffn_gate_exps.bias",
    "ffn_gate.bias",
    "ffn_up.weight",
    "ffn_up_exps.weight",
    "ffn_up_exps.bias",
    "ffn_up.bias",
    "ffn_down.weight",
    "ffn_down_exps.weight",
    "ffn_down_exps.bias",
    "ffn_down.bias",
    "ffn_gate_shexp.weight",
    "ffn_up_shexp.weight",
    "ffn_down_shexp.weight",
];
/// The tensors every llama layer has.
const REQUIRED_LAYER_ROLES: &[&str] = &[
    "attn_norm.weight",
    "attn_q.weight",
    "attn_k.weight",
    "attn_v.weight",
    "attn_output.weight",
    "ffn_norm.weight",
    "ffn_gate.weight",
    "ffn_up.weight",
    "ffn_down.weight",
];
const GLOBAL_EXEC_ORDER: &[&str] = &[
    "token_embd.weight",
    "rope_freqs.weight",
    "output_norm.weight",
    "output.weight",
];

/// The token embedding's element spread in a model whose routers have affinity.
const AFFINE_EMBEDDING_STD: f32 = 4.0;

/// A mixture of experts in place of each layer's feed-forward network, as llama.cpp
/// runs it for the llama architecture (Mixtral's layout): a router `ffn_gate_inp` and
/// the merged expert tensors `ffn_{gate,up,down}_exps`, expert index outermost.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MoeSpec {
    /// Routed experts per layer.
    pub experts: u64,
    /// Experts a token runs per layer.
    pub used: u64,
    /// Each expert's feed-forward width over the embedding width; `None` keeps the
    /// small model's ratio (coarse experts, as Mixtral). Fine-grained models (OLMoE,
    /// Qwen3-MoE) have many experts of a fraction of it (0.25-0.5).
    pub ff_ratio: Option<f64>,
    /// How unevenly the router spreads tokens over a layer's experts: the spread of
    /// the log of its rows' scales (see `Fill::Router`). 0 gives every expert about the
    /// same share.
    pub skew: f32,
    /// How much each layer's router follows the one before it (see `Fill::Router`),
    /// 0 to 1: 0 draws every layer's router afresh, so which experts a token picks in
    /// one layer says nothing of the next; above 0, each expert of layer l + 1 has a
    /// predecessor in layer l whose router row it shares this part of, so tokens that
    /// pick one tend to pick the other, as in trained routers (inter-layer expert
    /// affinity).
    pub affinity: f32,
    /// Routing that follows the text, token and recent context (`router`); `None`
    /// picks nearly independently from token to token.
    pub locality: Option<RouterLocality>,
}

impl MoeSpec {
    /// The most experts synth writes per layer (real models: 8-256).
    pub const MAX_EXPERTS: u64 = 512;

    fn check(&self) -> Result<(), SynthError> {
        if self.experts < 2 || self.experts > Self::MAX_EXPERTS {
            return Err(SynthError::Unsupported(format!(
                "{} experts per layer: synth writes 2 to {}",
                self.experts,
                Self::MAX_EXPERTS
            )));
        }
        if self.used == 0 || self.used > self.experts {
            return Err(SynthError::Unsupported(format!(
                "{} experts used per token of {}: must be 1 to {}",
                self.used, self.experts, self.experts
            )));
        }
        if let Some(ratio) = self
            .ff_ratio
            .filter(|r| !(r.is_finite() && *r > 0.0 && *r <= 16.0))
        {
            return Err(SynthError::Unsupported(format!(
                "expert feed-forward ratio {ratio}: must be above 0 and at most 16"
            )));
        }
        if !(self.skew.is_finite() && (0.0..=8.0).contains(&self.skew)) {
            return Err(SynthError::Unsupported(format!(
                "router skew {}: must be 0 to 8",
                self.skew
            )));
        }
        if !(self.affinity.is_finite() && (0.0..=1.0).contains(&self.affinity)) {
            return Err(SynthError::Unsupported(format!(
                "router affinity {}: must be 0 to 1",
                self.affinity
            )));
        }
        self.locality.as_ref().map_or(Ok(()), RouterLocality::check)
    }
}

/// What to make: everything but the small model it is shaped like.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SynthRequest {
    /// Approximate size of the file in bytes.
    pub target: u64,
    pub order: TensorOrder,
    pub seed: u64,
    /// The type of every quantized weight, in place of the small model's.
    pub weight_type: Option<GgmlType>,
    /// A recipe of types per tensor (Q4_K_M), in place of `weight_type`.
    pub mix: Option<QuantMix>,
    /// The type of the merged expert tensors alone (after `weight_type`), as released
    /// mixtures of experts have theirs (gpt-oss: MXFP4 experts, the rest 8-bit).
    pub expert_type: Option<GgmlType>,
    /// Experts in place of dense feed-forward networks.
    pub moe: Option<MoeSpec>,
    /// The architecture written (llama: the small model's).
    pub arch: SynthArch,
}

/// Everything needed to write the synthetic model.
#[derive(Debug, Clone)]
pub struct SynthPlan {
    pub shape: LlamaShape,
    pub metadata: Vec<(String, GgufValue)>,
    /// In file order.
    pub tensors: Vec<NewTensor>,
    /// How each tensor is filled, by name.
    pub fills: HashMap<String, Fill>,
    pub alignment: u64,
    /// Size of the finished file.
    pub file_len: u64,
    pub n_params: u64,
}

fn layer_of(name: &str) -> Option<(u64, &str)> {
    let rest = name.strip_prefix("blk.")?;
    let (index, role) = rest.split_once('.')?;
    Some((index.parse().ok()?, role))
}

fn key_u64(small: &GgufFile, key: &str) -> Result<u64, SynthError> {
    small
        .get_u64(key)
        .ok_or_else(|| SynthError::MissingKey(key.to_string()))
}

/// Reads the small model's shape and its tensors' roles and types.
fn small_model(small: &GgufFile) -> Result<(LlamaShape, Vec<Role>, Vec<Role>), SynthError> {
    let shape = small_shape(small)?;
    let (globals, layer) = roles_of(small, &shape)?;
    Ok((shape, globals, layer))
}

/// The small model's dimensions, checked to be a dense llama whose products fit.
fn small_shape(small: &GgufFile) -> Result<LlamaShape, SynthError> {
    let arch = small.architecture().unwrap_or("(none)");
    if arch != "llama" {
        return Err(SynthError::NotLlama(arch.to_string()));
    }
    let n_head = key_u64(small, "llama.attention.head_count")?;
    let n_embd = key_u64(small, "llama.embedding_length")?;
    let embd = small
        .tensor("token_embd.weight")
        .ok_or_else(|| SynthError::MissingTensor("token_embd.weight".into()))?;
    let shape = LlamaShape {
        n_layer: key_u64(small, "llama.block_count")?,
        n_embd,
        n_ff: key_u64(small, "llama.feed_forward_length")?,
        n_head,
        n_head_kv: small
            .get_u64("llama.attention.head_count_kv")
            .unwrap_or(n_head),
        head_dim: small
            .get_u64("llama.attention.key_length")
            .unwrap_or(n_embd / n_head.max(1)),
        n_vocab: embd.dims.get(1).copied().unwrap_or(0),
        n_expert: 0,
        n_expert_used: 0,
        n_expert_shared: 0,
        n_layer_dense_lead: 0,
    };
    if small.get_u64("llama.expert_count").is_some_and(|n| n > 0) {
        return Err(SynthError::Unsupported(
            "the model is already a mixture of experts; synth scales dense models".into(),
        ));
    }
    if shape.n_head == 0 || shape.n_head_kv == 0 || shape.n_head % shape.n_head_kv != 0 {
        return Err(SynthError::Unsupported(format!(
            "head counts {} / {} (kv)",
            shape.n_head, shape.n_head_kv
        )));
    }
    // Metadata is untrusted: multiply checked. Once n_head * head_dim == n_embd, and
    // every tensor's dims are checked against the shape, all later products are
    // bounded by the size of the small file.
    if shape.n_head.checked_mul(shape.head_dim) != Some(shape.n_embd) {
        return Err(SynthError::Unsupported(format!(
            "n_head {} x head_dim {} differs from n_embd {}",
            shape.n_head, shape.head_dim, shape.n_embd
        )));
    }
    Ok(shape)
}

/// The small model's global and per-layer tensor roles, each tensor checked against
/// `shape`, per-layer types in layer order.
fn roles_of(small: &GgufFile, shape: &LlamaShape) -> Result<(Vec<Role>, Vec<Role>), SynthError> {
    let mut globals: Vec<Role> = Vec::new();
    let mut layer: Vec<Role> = Vec::new();
    for t in &small.tensors {
        let (role_name, index) = match layer_of(&t.name) {
            Some((index, role)) => (role, Some(index)),
            None => (t.name.as_str(), None),
        };
        let expected = shape
            .dims(role_name)
            .ok_or_else(|| SynthError::UnknownTensor(t.name.clone()))?;
        if expected != t.dims {
            return Err(SynthError::UnexpectedShape {
                tensor: t.name.clone(),
                dims: t.dims.clone(),
                expected,
            });
        }
        if !fill::supported(t.ggml_type) {
            return Err(SynthError::UnsupportedType(t.ggml_type));
        }
        let roles = if index.is_some() {
            &mut layer
        } else {
            &mut globals
        };
        match roles.iter_mut().find(|r| r.name == role_name) {
            Some(role) => role.types.push(t.ggml_type),
            None => roles.push(Role {
                name: role_name.to_string(),
                types: vec![t.ggml_type],
            }),
        }
    }
    // llama.cpp requires these; they also pin down every dimension of the shape.
    for required in REQUIRED_LAYER_ROLES {
        if !layer.iter().any(|r| r.name == *required) {
            return Err(SynthError::MissingTensor(format!("blk.0.{required}")));
        }
    }
    for role in &layer {
        if role.types.len() as u64 != shape.n_layer {
            return Err(SynthError::Unsupported(format!(
                "{} layers have {}, but llama.block_count is {}",
                role.types.len(),
                role.name,
                shape.n_layer
            )));
        }
    }
    // Per-layer types in layer order, whatever order the file had them in.
    for role in &mut layer {
        let mut typed: Vec<(u64, GgmlType)> = small
            .tensors
            .iter()
            .filter_map(|t| {
                layer_of(&t.name)
                    .filter(|(_, r)| *r == role.name)
                    .map(|(i, _)| (i, t.ggml_type))
            })
            .collect();
        typed.sort_by_key(|(i, _)| *i);
        role.types = typed.into_iter().map(|(_, ty)| ty).collect();
    }
    Ok((globals, layer))
}

/// The type of `role` in layer `i` of `n_layer`: the small model's layer at the same
/// relative depth, so mixed-quantization recipes (Q4_K_M and the like) carry over.
fn layer_type(role: &Role, i: u64, n_layer: u64) -> GgmlType {
    let n = role.types.len() as u64;
    let j = (u128::from(i) * u128::from(n) / u128::from(n_layer.max(1))) as u64;
    let j = j.min(n.saturating_sub(1));
    role.types.get(j as usize).copied().unwrap_or(GgmlType::F32)
}

fn lcm(a: u64, b: u64) -> u64 {
    fn gcd(a: u64, b: u64) -> u64 {
        if b == 0 {
            a
        } else {
            gcd(b, a % b)
        }
    }
    a / gcd(a, b) * b
}

/// Layers of `n_layer` that take their type from small layer `j` of `n_small`
/// (those `i` with `i * n_small / n_layer == j`).
fn layers_from(j: u64, n_small: u64, n_layer: u64) -> u64 {
    let first = |j: u64| (u128::from(j) * u128::from(n_layer)).div_ceil(u128::from(n_small.max(1)));
    // At most n_layer, so it fits back in u64.
    (first(j + 1).min(u128::from(n_layer)) - first(j).min(u128::from(n_layer))) as u64
}

/// Bytes of all tensor data (each padded to the alignment) for a shape. Counts layers
/// per small-model type rather than walking every layer, so it is cheap for any depth.
fn data_bytes(shape: &LlamaShape, globals: &[Role], layer: &[Role], alignment: u64) -> Option<u64> {
    let bytes = |role: &Role, ty: GgmlType| {
        shape
            .dims(&role.name)
            .and_then(|d| ty.tensor_bytes(&d))
            .and_then(|b| b.checked_next_multiple_of(alignment))
    };
    let mut total = 0u64;
    for role in globals {
        total = total.checked_add(bytes(role, role.types[0])?)?;
    }
    for role in layer {
        let n_small = role.types.len() as u64;
        for (j, ty) in role.types.iter().enumerate() {
            let count = layers_from(j as u64, n_small, shape.n_layer);
            total = total.checked_add(bytes(role, *ty)?.checked_mul(count)?)?;
        }
    }
    Some(total)
}

/// Picks the shape nearest `target` bytes of data: widths are whole multiples of the
/// small model's (head counts scaled, head size kept), depth grows with the square root
/// of the width as in real model families, and the feed-forward width is then tuned so
/// the total lands close to the target.
fn choose_shape(
    small: &LlamaShape,
    globals: &[Role],
    layer: &[Role],
    target: u64,
    alignment: u64,
    ff_ratio: Option<f64>,
) -> Result<LlamaShape, SynthError> {
    // ne[0] of every tensor must be whole blocks of its type.
    let all_types = globals.iter().chain(layer).flat_map(|r| r.types.iter());
    let embd_block = all_types.clone().map(|t| t.block_size()).fold(1, lcm);
    let ff_block = layer
        .iter()
        .filter(|r| r.name == "ffn_down.weight" || r.name == "ffn_down_exps.weight")
        .flat_map(|r| r.types.iter())
        .map(|t| t.block_size())
        .fold(embd_block, lcm);
    let ff_ratio = ff_ratio.unwrap_or(small.n_ff as f64 / small.n_embd as f64);

    let mut best: Option<(f64, LlamaShape)> = None;
    let mut smallest: Option<u64> = None;
    for m in 1..=64u64 {
        let mut shape = LlamaShape {
            n_layer: 1,
            n_embd: small.n_embd * m,
            n_head: small.n_head * m,
            n_head_kv: small.n_head_kv * m,
            n_ff: ((small.n_embd * m) as f64 * ff_ratio / ff_block as f64)
                .round()
                .max(1.0) as u64
                * ff_block,
            ..*small
        };
        if shape.n_embd % embd_block != 0 {
            continue;
        }
        let Some(one) = data_bytes(&shape, globals, layer, alignment) else {
            continue;
        };
        smallest = Some(smallest.map_or(one, |s: u64| s.min(one)));
        shape.n_layer = 0;
        let Some(fixed) = data_bytes(&shape, globals, layer, alignment) else {
            continue;
        };
        let per_layer = one - fixed;
        if one > target || per_layer == 0 {
            continue;
        }
        shape.n_layer = ((target - fixed) as f64 / per_layer as f64)
            .round()
            .max(1.0) as u64;
        tune_ff(&mut shape, globals, layer, target, alignment, ff_block);
        // A mixture of experts holds more parameters per layer than a dense model of
        // its depth: Mixtral 8x7B has the depth of the 7B. Depth follows the share of
        // the experts a token runs.
        let sparsity = if small.n_expert > 0 {
            (small.n_expert as f64 / small.n_expert_used.max(1) as f64).sqrt()
        } else {
            1.0
        };
        let want_layers = small.n_layer as f64 * (m as f64).sqrt() / sparsity;
        let score = (shape.n_layer as f64 / want_layers).ln().abs();
        if best.as_ref().is_none_or(|(s, _)| score < *s) {
            best = Some((score, shape));
        }
    }
    best.map(|(_, shape)| shape).ok_or(SynthError::TooSmall {
        requested: target,
        minimum: smallest.unwrap_or(u64::MAX),
    })
}

/// Moves the feed-forward width (in whole blocks, within a factor of two) to bring
/// the total nearest the target. The total grows with the width: binary search.
fn tune_ff(
    shape: &mut LlamaShape,
    globals: &[Role],
    layer: &[Role],
    target: u64,
    alignment: u64,
    block: u64,
) {
    let total = |n_ff: u64| data_bytes(&LlamaShape { n_ff, ..*shape }, globals, layer, alignment);
    let (mut lo, mut hi) = ((shape.n_ff / 2 / block).max(1), shape.n_ff * 2 / block);
    // Find the first width (in blocks) whose total reaches the target.
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        match total(mid * block) {
            Some(t) if t >= target => hi = mid,
            Some(_) => lo = mid + 1,
            None => hi = mid,
        }
    }
    let error = |blocks: u64| total(blocks * block).map_or(u64::MAX, |t| t.abs_diff(target));
    let best = [lo.saturating_sub(1).max(1), lo]
        .into_iter()
        .min_by_key(|&b| error(b))
        .unwrap_or(lo);
    shape.n_ff = best * block;
}

/// Orders tensors like the small model's file: its global tensors before or after the
/// layers as they were, its layers in numeric or string order as they were, and each
/// layer's tensors in the small model's order.
fn file_order(small: &GgufFile, tensors: &mut [NewTensor]) {
    let position = |name: &str| small.tensors.iter().position(|t| t.name == name);
    let first_layer = small
        .tensors
        .iter()
        .position(|t| layer_of(&t.name).is_some())
        .unwrap_or(0);
    // Converters that sort by name put blk.10 before blk.2.
    let by_string = match (
        position("blk.10.attn_norm.weight"),
        position("blk.2.attn_norm.weight"),
    ) {
        (Some(ten), Some(two)) => ten < two,
        _ => false,
    };
    // An expert tensor goes where its dense counterpart was, the router right after
    // the feed-forward norm.
    let role_rank = |role: &str| {
        let (dense, after) = match role {
            "ffn_gate_inp.weight" => ("ffn_norm.weight", 1),
            other => (
                EXPERT_ROLES
                    .iter()
                    .find(|(_, expert)| *expert == other)
                    .map_or(other, |(dense, _)| *dense),
                0,
            ),
        };
        let rank = small
            .tensors
            .iter()
            .filter_map(|t| layer_of(&t.name).filter(|(i, _)| *i == 0).map(|(_, r)| r))
            .position(|r| r == dense)
            .unwrap_or(usize::MAX / 2);
        rank * 2 + after
    };
    tensors.sort_by_cached_key(|t| match layer_of(&t.name) {
        Some((i, role)) => {
            let layer_key = if by_string {
                i.to_string()
            } else {
                format!("{i:020}")
            };
            (1, layer_key, role_rank(role), 0)
        }
        None => {
            let pos = position(&t.name).unwrap_or(usize::MAX);
            let group = if pos < first_layer { 0 } else { 2 };
            (group, String::new(), 0, pos)
        }
    });
}

/// Plans a llama model of about `target` bytes shaped like `small`.
pub fn plan(
    small: &GgufFile,
    target: u64,
    order: TensorOrder,
    seed: u64,
) -> Result<SynthPlan, SynthError> {
    plan_with_weight_type(small, target, order, seed, None)
}

/// As `plan`, with every quantized weight of type `weight_type` instead of the small
/// model's types (norms stay as they are): e.g. a Q8_0 model from a Q4_1 one.
pub fn plan_with_weight_type(
    small: &GgufFile,
    target: u64,
    order: TensorOrder,
    seed: u64,
    weight_type: Option<GgmlType>,
) -> Result<SynthPlan, SynthError> {
    plan_request(
        small,
        &SynthRequest {
            target,
            order,
            seed,
            weight_type,
            mix: None,
            expert_type: None,
            moe: None,
            arch: SynthArch::Llama,
        },
    )
}

/// The dense feed-forward roles a mixture of experts replaces, and their replacements.
const EXPERT_ROLES: &[(&str, &str)] = &[
    ("ffn_gate.weight", "ffn_gate_exps.weight"),
    ("ffn_up.weight", "ffn_up_exps.weight"),
    ("ffn_down.weight", "ffn_down_exps.weight"),
];

/// Turns a dense layer's roles into a mixture of experts': the feed-forward weights
/// become merged expert tensors of the same types, their biases go (llama.cpp's llama
/// experts have none) and an f32 router joins, as converters write Mixtral's.
fn expert_layer(layer: &mut Vec<Role>, n_layer: usize) {
    layer.retain(|role| !role.name.starts_with("ffn_") || !role.name.ends_with(".bias"));
    for role in layer.iter_mut() {
        if let Some((_, expert)) = EXPERT_ROLES.iter().find(|(dense, _)| *dense == role.name) {
            role.name = expert.to_string();
        }
    }
    layer.push(Role {
        name: "ffn_gate_inp.weight".into(),
        types: vec![GgmlType::F32; n_layer],
    });
}

/// A dense leading layer of a mixture of experts whose layers are `layer`: its
/// feed-forward weights in place of the router and experts, of the shared experts'
/// types (the routed ones may have a type of their own), in the same order.
fn dense_layer(layer: &[Role]) -> Vec<Role> {
    let mut dense = Vec::new();
    for role in layer {
        if let Some(base) = role.name.strip_suffix("_exps.weight") {
            let shared = format!("{base}_shexp.weight");
            let types = layer
                .iter()
                .find(|other| other.name == shared)
                .map_or(&role.types, |other| &other.types);
            dense.push(Role {
                name: format!("{base}.weight"),
                types: types.clone(),
            });
        } else if !(role.name.starts_with("ffn_gate_inp.")
            || role.name.starts_with("exp_probs_b.")
            || role.name.contains("_exps.")
            || role.name.contains("_shexp."))
        {
            dense.push(role.clone());
        }
    }
    dense
}

/// Plans the model `request` describes, shaped like `small`.
pub fn plan_request(small: &GgufFile, request: &SynthRequest) -> Result<SynthPlan, SynthError> {
    let &SynthRequest {
        target,
        order,
        seed,
        weight_type,
        mix,
        expert_type,
        moe,
        arch,
    } = request;
    if let (Some(_), Some(_)) = (weight_type, mix) {
        return Err(SynthError::Unsupported(
            "a weight type and a quantization mix: give one".into(),
        ));
    }
    let weight_type = weight_type.or(mix.map(QuantMix::base_type));
    let (mut small_shape, mut globals, mut layer) = small_model(small)?;
    arch.check(moe.as_ref())?;
    if let Some(moe) = moe {
        moe.check()?;
        expert_layer(&mut layer, small_shape.n_layer as usize);
        small_shape.n_expert = moe.experts;
        small_shape.n_expert_used = moe.used;
        small_shape.n_expert_shared = arch.shared_experts();
    }
    arch.adapt_roles(&mut globals, &mut layer, small_shape.n_layer as usize);
    if let Some(weight_type) = weight_type {
        retype_quantized(weight_type, &mut globals, &mut layer)?;
    }
    if let Some(mix) = mix {
        mix.apply(&mut globals, &mut layer);
    }
    if let Some(expert_type) = expert_type {
        if moe.is_none() {
            return Err(SynthError::Unsupported(
                "an expert type without experts: give --experts".into(),
            ));
        }
        if !expert_type.is_quantized() || !fill::supported(expert_type) {
            return Err(SynthError::UnsupportedType(expert_type));
        }
        for role in layer
            .iter_mut()
            .filter(|role| role.name.ends_with("_exps.weight"))
        {
            role.types.fill(expert_type);
        }
    }
    arch.fall_back_types(&mut layer, small_shape.head_dim);
    // The header: metadata as in the small model, plus about 100 bytes per tensor.
    let header_guess = small
        .data_offset
        .saturating_sub(small.tensors.len() as u64 * 64);
    let mut shape = choose_shape(
        &small_shape,
        &globals,
        &layer,
        target.saturating_sub(header_guess),
        small.alignment,
        moe.and_then(|moe| moe.ff_ratio),
    )?;
    shape.n_layer = arch.depth(shape.n_layer);
    shape.n_layer_dense_lead = arch.dense_lead(shape.n_layer);
    let n_params = shape.n_params(&globals, &layer);

    let context = moe
        .and_then(|moe| moe.locality)
        .map(|locality| context_attention(small, &shape, locality))
        .transpose()?;
    let (mut tensors, fills) = tensors_in_exec_order(&shape, &globals, &layer, moe, context);
    for tensor in &tensors {
        if let Some(what) = fills.get(&tensor.name) {
            router::check_type(&tensor.name, tensor.ggml_type, what)?;
        }
    }

    match order {
        TensorOrder::Exec => {}
        TensorOrder::File => file_order(small, &mut tensors),
        TensorOrder::Alphabetical => tensors.sort_by(|a, b| a.name.cmp(&b.name)),
        TensorOrder::Shuffled => tensors.shuffle(&mut rand::rngs::SmallRng::seed_from_u64(seed)),
        TensorOrder::Hf => hf_order::sort(&mut tensors, arch, shape.n_expert),
    }

    let mut metadata = metadata(small, &shape, n_params, arch);
    let file_type = match expert_type {
        // LLAMA_FTYPE_MOSTLY_MXFP4_MOE, as llama-quantize labels gpt-oss's.
        Some(GgmlType::Mxfp4) => Some(38),
        _ => match mix {
            Some(mix) => Some(mix.file_type()),
            None => weight_type.and_then(llama_file_type),
        },
    };
    if let Some(file_type) = file_type {
        // llama.cpp labels the model by it (llama-bench's "Q8_0").
        if let Some((_, value)) = metadata.iter_mut().find(|(k, _)| k == "general.file_type") {
            *value = same_type(Some(value), file_type);
        }
    }
    // The exact size, from laying out the header without writing it anywhere.
    let file_len =
        GgufWriter::new(io::sink(), &metadata, tensors.clone(), small.alignment)?.file_len();
    Ok(SynthPlan {
        shape,
        metadata,
        tensors,
        fills,
        alignment: small.alignment,
        file_len,
        n_params,
    })
}

/// What a locality router's tensors are built for: `shape`, and the small model's
/// rotary base (its RoPE angles; a model that rescales them is refused).
fn context_attention(
    small: &GgufFile,
    shape: &LlamaShape,
    locality: RouterLocality,
) -> Result<ContextAttention, SynthError> {
    if small.get("llama.rope.scaling.type").is_some() || small.tensor("rope_freqs.weight").is_some()
    {
        return Err(SynthError::Locality(
            "the model rescales its rotary angles, which the recency windows are built on".into(),
        ));
    }
    let narrow = |n: u64| u32::try_from(n).map_err(|_| SynthError::Unsupported(format!("{n}")));
    Ok(ContextAttention {
        locality,
        n_embd: narrow(shape.n_embd)?,
        n_head: narrow(shape.n_head)?,
        n_head_kv: narrow(shape.n_head_kv)?,
        head_dim: narrow(shape.head_dim)?,
        rope_base: small
            .get("llama.rope.freq_base")
            .and_then(|v| v.as_f64())
            .unwrap_or(10_000.0) as f32,
    })
}

/// Gives every quantized tensor `weight_type` (a quantized type the filler supports).
fn retype_quantized(
    weight_type: GgmlType,
    globals: &mut [Role],
    layer: &mut [Role],
) -> Result<(), SynthError> {
    if !weight_type.is_quantized() || !fill::supported(weight_type) {
        return Err(SynthError::UnsupportedType(weight_type));
    }
    for role in globals.iter_mut().chain(layer.iter_mut()) {
        for ty in role.types.iter_mut().filter(|ty| ty.is_quantized()) {
            // Same 32-element blocks as the common quantized types; shapes that
            // do not fit are caught when the tensors are sized.
            *ty = weight_type;
        }
    }
    Ok(())
}

/// The tensors of a model of `shape` in execution order (globals before the layers,
/// the layers, the rest), and how each is filled.
fn tensors_in_exec_order(
    shape: &LlamaShape,
    globals: &[Role],
    layer: &[Role],
    moe: Option<MoeSpec>,
    context: Option<ContextAttention>,
) -> (Vec<NewTensor>, HashMap<String, Fill>) {
    let mut tensors = Vec::new();
    let mut fills = HashMap::new();
    let mut add = |name: String, role: &str, layer: u32, ggml_type: GgmlType| {
        let dims = shape.dims(role).unwrap_or_default();
        let locality = context.and_then(|context| router::fill_for(role, layer, &context));
        let what = if let Some(what) = locality {
            what
        } else if role.contains("norm") || role.starts_with("rope_freqs") {
            Fill::Constant(1.0)
        } else if role == "attn_sinks.weight" {
            // A sink logit of 0: the softmax's denominator gains exp(0), as an extra
            // key with a score of 0 would give.
            Fill::Constant(0.0)
        } else if role == "ffn_gate_inp.weight" {
            Fill::Router {
                std: 1.0 / (shape.n_embd.max(1) as f32).sqrt(),
                skew: moe.map_or(0.0, |moe| moe.skew),
                affinity: moe.map_or(0.0, |moe| moe.affinity),
                layer,
                row_len: shape.n_embd,
            }
        } else if role == "token_embd.weight" && moe.is_some_and(|moe| moe.affinity > 0.0) {
            Fill::Weight {
                std: AFFINE_EMBEDDING_STD,
            }
        } else if role.ends_with(".bias") {
            Fill::Weight { std: 0.01 }
        } else {
            // Unit-variance outputs from unit-variance inputs.
            Fill::Weight {
                std: 1.0 / (dims.first().copied().unwrap_or(1).max(1) as f32).sqrt(),
            }
        };
        fills.insert(name.clone(), what);
        tensors.push(NewTensor {
            name,
            dims,
            ggml_type,
        });
    };
    let global_rank = |name: &str| {
        GLOBAL_EXEC_ORDER
            .iter()
            .position(|g| *g == name)
            .unwrap_or(usize::MAX)
    };
    let mut sorted_globals = globals.to_vec();
    sorted_globals.sort_by_key(|r| global_rank(&r.name));
    let (before, after): (Vec<_>, Vec<_>) = sorted_globals
        .iter()
        .partition(|r| global_rank(&r.name) < 2);
    for role in before {
        add(role.name.clone(), &role.name, 0, role.types[0]);
    }
    let mut layer_roles = layer.to_vec();
    layer_roles.sort_by_key(|r| {
        EXEC_ORDER
            .iter()
            .position(|e| *e == r.name)
            .unwrap_or(usize::MAX)
    });
    let dense_roles = dense_layer(&layer_roles);
    for i in 0..shape.n_layer {
        let roles = if i < shape.n_layer_dense_lead {
            &dense_roles
        } else {
            &layer_roles
        };
        for role in roles {
            add(
                format!("blk.{i}.{}", role.name),
                &role.name,
                i as u32,
                layer_type(role, i, shape.n_layer),
            );
        }
    }
    for role in after {
        add(role.name.clone(), &role.name, 0, role.types[0]);
    }

    (tensors, fills)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dense_leading_layer_trades_the_experts_for_a_network_of_the_shared_types() {
        let role = |name: &str, ty: GgmlType| Role {
            name: name.to_string(),
            types: vec![ty],
        };
        let layer = [
            role("attn_norm.weight", GgmlType::F32),
            role("ffn_gate_inp.weight", GgmlType::F32),
            role("exp_probs_b.bias", GgmlType::F32),
            role("ffn_gate_exps.weight", GgmlType::Mxfp4),
            role("ffn_down_exps.weight", GgmlType::Mxfp4),
            role("ffn_down_exps.bias", GgmlType::F32),
            role("ffn_gate_shexp.weight", GgmlType::Q8_0),
            role("ffn_down_shexp.weight", GgmlType::Q6K),
        ];
        let dense = dense_layer(&layer);
        let summary: Vec<(&str, GgmlType)> = dense
            .iter()
            .map(|role| (role.name.as_str(), role.types[0]))
            .collect();
        assert_eq!(
            summary,
            [
                ("attn_norm.weight", GgmlType::F32),
                ("ffn_gate.weight", GgmlType::Q8_0),
                ("ffn_down.weight", GgmlType::Q6K),
            ]
        );
    }

    #[test]
    fn a_dense_network_in_a_mixture_is_as_wide_as_what_a_token_runs() {
        let shape = LlamaShape {
            n_layer: 4,
            n_embd: 64,
            n_ff: 32,
            n_head: 2,
            n_head_kv: 2,
            head_dim: 32,
            n_vocab: 100,
            n_expert: 16,
            n_expert_used: 2,
            n_expert_shared: 1,
            n_layer_dense_lead: 1,
        };
        assert_eq!(shape.dims("ffn_down.weight"), Some(vec![96, 64]));
        assert_eq!(shape.dims("ffn_up_shexp.weight"), Some(vec![64, 32]));
        assert_eq!(shape.dims("attn_k_b.weight"), Some(vec![32, 128, 2]));
        assert_eq!(shape.dims("attn_q_b.weight"), Some(vec![384, 96]));
        let dense = LlamaShape {
            n_expert: 0,
            n_expert_used: 0,
            ..shape
        };
        assert_eq!(dense.dims("ffn_down.weight"), Some(vec![32, 64]));
    }
}
