//! Recognises the per-token execution order of a model from its tensor names.
//!
//! Llama-family decoders (GGUF names `blk.N.attn_q.weight`, or Hugging Face names
//! `model.layers.N.self_attn.q_proj.weight`) run, per token: rows of the token
//! embedding; for each layer in increasing N its tensors in a fixed order (norm,
//! attention projections, optional q/k norms, output projection, post-norm, FFN norm,
//! router and experts or dense FFN, post-norm); the final norm; the output head (or the
//! whole token embedding when the head is tied to it). Each weight precedes its bias.
//!
//! Tensors a recognised model has but this table does not know keep their file order:
//! unknown per-layer tensors at the end of their layer, unknown global ones after the
//! head. A model with no recognisable layer tensor at all (another architecture, another
//! naming scheme) falls back to file order for every tensor: a decoder's converter
//! usually writes layers in order, and a learned graph corrects the rest.

use crate::model::TensorInfo;

/// Which naming scheme the order was recognised from.
#[derive(Copy, Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Architecture {
    /// GGUF llama-family names (`blk.N.*`).
    LlamaGguf,
    /// Hugging Face llama-family names (`model.layers.N.*`).
    LlamaHf,
    /// Nothing recognised: file order.
    FileOrder,
}

/// The execution order of one token, as indices into the tensor table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecutionOrder {
    pub architecture: Architecture,
    /// Tensors in the order one token reads them in full.
    pub steps: Vec<usize>,
    /// The untied token embedding, of which a token reads only a few rows (which ones
    /// depends on the token), before the first step.
    pub rows_only: Option<usize>,
}

/// Per-layer tensors in execution order (GGUF base names, without `.weight`/`.bias`).
const LAYER_ORDER: &[&str] = &[
    "attn_norm",
    "attn_norm_2",
    "attn_qkv",
    "attn_q",
    "attn_q_norm",
    "attn_k",
    "attn_k_norm",
    "attn_v",
    // DeepSeek's latent attention (MLA): the query through its low-rank pair, the
    // compressed key-value projection and its expansion.
    "attn_q_a",
    "attn_q_a_norm",
    "attn_q_b",
    "attn_kv_a_mqa",
    "attn_kv_a_norm",
    "attn_kv_b",
    "attn_k_b",
    "attn_v_b",
    // gpt-oss: a learned sink logit per head, read by the attention's softmax.
    "attn_sinks",
    "attn_output",
    "attn_post_norm",
    // llama.cpp's name for the norm after attention (gemma's), which gpt-oss and
    // glm4moe put before their experts in place of ffn_norm.
    "post_attention_norm",
    "ffn_norm",
    "ffn_gate_inp",
    "exp_probs_b",
    "ffn_gate_exps",
    "ffn_up_exps",
    "ffn_down_exps",
    "ffn_gate_inp_shexp",
    "ffn_gate_shexp",
    "ffn_up_shexp",
    "ffn_down_shexp",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
    "ffn_post_norm",
    "layer_output_norm",
];

/// Hugging Face llama names mapped to their GGUF equivalents.
const HF_LAYER_NAMES: &[(&str, &str)] = &[
    ("input_layernorm", "attn_norm"),
    ("self_attn.q_proj", "attn_q"),
    ("self_attn.q_norm", "attn_q_norm"),
    ("self_attn.k_proj", "attn_k"),
    ("self_attn.k_norm", "attn_k_norm"),
    ("self_attn.v_proj", "attn_v"),
    ("self_attn.o_proj", "attn_output"),
    ("post_attention_layernorm", "ffn_norm"),
    ("mlp.gate_proj", "ffn_gate"),
    ("mlp.up_proj", "ffn_up"),
    ("mlp.down_proj", "ffn_down"),
    // Mixture of experts: the router, merged experts, shared experts.
    ("mlp.gate", "ffn_gate_inp"),
    ("block_sparse_moe.gate", "ffn_gate_inp"),
    ("mlp.experts.gate_up_proj", "ffn_gate_exps"),
    ("mlp.experts.down_proj", "ffn_down_exps"),
    ("mlp.shared_expert_gate", "ffn_gate_inp_shexp"),
    ("mlp.shared_expert.gate_proj", "ffn_gate_shexp"),
    ("mlp.shared_expert.up_proj", "ffn_up_shexp"),
    ("mlp.shared_expert.down_proj", "ffn_down_shexp"),
    ("mlp.shared_experts.gate_proj", "ffn_gate_shexp"),
    ("mlp.shared_experts.up_proj", "ffn_up_shexp"),
    ("mlp.shared_experts.down_proj", "ffn_down_shexp"),
];

/// Global tensors, where the token's pass reads them.
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Global {
    TokenEmbd,
    TokenEmbdNorm,
    RopeFreqs,
    OutputNorm,
    Output,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Role {
    Global(Global),
    /// Layer, rank in `LAYER_ORDER` (or past its end when unknown).
    Layer(u32, usize),
    Unknown,
}

/// Splits `name.weight` / `name.bias`: the base, and 0 for the weight, 1 for the bias
/// (a weight runs before its bias), 2 for anything else.
fn split_suffix(name: &str) -> (&str, u8) {
    if let Some(base) = name.strip_suffix(".weight") {
        (base, 0)
    } else if let Some(base) = name.strip_suffix(".bias") {
        (base, 1)
    } else {
        (name, 2)
    }
}

fn layer_rank(base: &str) -> usize {
    LAYER_ORDER
        .iter()
        .position(|&known| known == base)
        .unwrap_or(LAYER_ORDER.len())
}

fn gguf_role(base: &str) -> Role {
    if let Some(rest) = base.strip_prefix("blk.") {
        if let Some((layer, tensor)) = rest.split_once('.') {
            if let Ok(layer) = layer.parse::<u32>() {
                return Role::Layer(layer, layer_rank(tensor));
            }
        }
        return Role::Unknown;
    }
    match base {
        "token_embd" => Role::Global(Global::TokenEmbd),
        "token_embd_norm" => Role::Global(Global::TokenEmbdNorm),
        "rope_freqs" => Role::Global(Global::RopeFreqs),
        "output_norm" => Role::Global(Global::OutputNorm),
        "output" => Role::Global(Global::Output),
        _ => Role::Unknown,
    }
}

fn hf_role(base: &str) -> Role {
    let base = base.strip_prefix("model.").unwrap_or(base);
    if let Some(rest) = base.strip_prefix("layers.") {
        if let Some((layer, tensor)) = rest.split_once('.') {
            if let Ok(layer) = layer.parse::<u32>() {
                let gguf = HF_LAYER_NAMES
                    .iter()
                    .find(|(hf, _)| *hf == tensor)
                    .map(|(_, gguf)| *gguf)
                    .or_else(|| hf_single_expert(tensor).map(|(_, kind)| kind))
                    .unwrap_or("");
                return Role::Layer(layer, layer_rank(gguf));
            }
        }
        return Role::Unknown;
    }
    match base {
        "embed_tokens" => Role::Global(Global::TokenEmbd),
        "norm" => Role::Global(Global::OutputNorm),
        "lm_head" => Role::Global(Global::Output),
        _ => Role::Unknown,
    }
}

/// Sort key of a tensor in the token's pass: phase (0 before the layers, 1 the layers,
/// 2 after), layer, rank, weight-before-bias, then file position.
type Key = (u8, u32, usize, u8, u64);

/// Recognises the execution order of `tensors`.
pub fn execution_order(tensors: &[TensorInfo]) -> ExecutionOrder {
    let by_file = || {
        let mut steps: Vec<usize> = (0..tensors.len()).collect();
        steps.sort_by_key(|&i| (tensors[i].file_range.start, i));
        steps
    };
    let scheme = |role: fn(&str) -> Role| {
        tensors
            .iter()
            .map(|t| {
                let (base, suffix) = split_suffix(&t.name);
                (role(base), suffix)
            })
            .collect::<Vec<_>>()
    };
    let gguf = scheme(gguf_role);
    let hf = scheme(hf_role);
    let layer_count = |roles: &[(Role, u8)]| {
        roles
            .iter()
            .filter(|(r, _)| matches!(r, Role::Layer(_, rank) if *rank < LAYER_ORDER.len()))
            .count()
    };
    let (architecture, roles) = match (layer_count(&gguf), layer_count(&hf)) {
        (0, 0) => {
            return ExecutionOrder {
                architecture: Architecture::FileOrder,
                steps: by_file(),
                rows_only: None,
            }
        }
        (g, h) if g >= h => (Architecture::LlamaGguf, gguf),
        _ => (Architecture::LlamaHf, hf),
    };

    let tied = !roles
        .iter()
        .any(|(role, _)| *role == Role::Global(Global::Output));
    let mut rows_only = None;
    let mut keyed: Vec<(Key, usize)> = Vec::with_capacity(tensors.len());
    for (index, ((role, suffix), tensor)) in roles.iter().zip(tensors).enumerate() {
        let at = tensor.file_range.start;
        let key = match *role {
            Role::Global(Global::TokenEmbd) if !tied && *suffix == 0 => {
                rows_only = Some(index);
                continue;
            }
            // Tied: the head is the embedding, swept in full after the final norm.
            Role::Global(Global::TokenEmbd) => (2, 0, Global::Output as usize, *suffix, at),
            Role::Global(global) if global < Global::OutputNorm => {
                (0, 0, global as usize, *suffix, at)
            }
            Role::Global(global) => (2, 0, global as usize, *suffix, at),
            Role::Layer(layer, rank) => (1, layer, rank, *suffix, at),
            Role::Unknown => (2, 1, 0, *suffix, at),
        };
        keyed.push((key, index));
    }
    keyed.sort();
    ExecutionOrder {
        architecture,
        steps: keyed.into_iter().map(|(_, index)| index).collect(),
        rows_only,
    }
}

/// Experts in a tensor that merges them (GGUF `ffn_*_exps`, Hugging Face
/// `mlp.experts.gate_up_proj`), read from the outermost dimension of its shape: the
/// expert index varies slowest, so expert `e` is the `e`-th contiguous share of the
/// bytes. (`TensorInfo::shape` is outermost first; GGUF itself lists `[n_embd, n_ff,
/// n_expert]`, innermost first.)
pub fn expert_count(tensor: &TensorInfo) -> Option<u32> {
    let (base, _) = split_suffix(&tensor.name);
    let merged = base.ends_with("_exps") || hf_merged_experts(base);
    if !merged || tensor.shape.len() != 3 {
        return None;
    }
    let count = *tensor.shape.first()?;
    (count > 1 && count <= u32::MAX as u64).then_some(count as u32)
}

/// Whether a Hugging Face name is a merged expert tensor (`mlp.experts.gate_up_proj`,
/// as gpt-oss stores its experts).
fn hf_merged_experts(base: &str) -> bool {
    base.split_once(".experts.")
        .is_some_and(|(_, rest)| !rest.contains('.'))
}

/// The expert of a Hugging Face per-expert tensor and the GGUF name of its kind:
/// `layers.N.mlp.experts.E.gate_proj` (Qwen-MoE, OLMoE, DeepSeek) or
/// `layers.N.block_sparse_moe.experts.E.w1` (Mixtral).
fn hf_single_expert(base: &str) -> Option<(u32, &'static str)> {
    let (_, rest) = base.split_once(".experts.")?;
    let (expert, kind) = rest.split_once('.')?;
    let expert = expert.parse().ok()?;
    let kind = match kind {
        "gate_proj" | "w1" => "ffn_gate_exps",
        "up_proj" | "w3" => "ffn_up_exps",
        "down_proj" | "w2" => "ffn_down_exps",
        _ => return None,
    };
    Some((expert, kind))
}

/// The layer a tensor belongs to, in either naming scheme.
fn layer_of(base: &str) -> Option<u32> {
    let rest = base
        .strip_prefix("blk.")
        .or_else(|| base.strip_prefix("model.layers."))
        .or_else(|| base.strip_prefix("layers."))?;
    rest.split_once('.')?.0.parse().ok()
}

/// The routed experts' shares of one tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpertShares {
    pub layer: u32,
    /// (expert, byte range of its share), by expert.
    pub shares: Vec<(u32, std::ops::Range<u64>)>,
}

/// The experts' slices of a mixture-of-experts tensor: its layer, and per expert the
/// byte range that expert's share occupies. `None` for a tensor every token reads whole
/// (dense, shared experts, the router), and for one whose bytes do not split evenly.
pub fn expert_slices(tensor: &TensorInfo) -> Option<ExpertShares> {
    let (base, _) = split_suffix(&tensor.name);
    let layer = layer_of(base)?;
    if let Some((expert, _)) = hf_single_expert(base) {
        let shares = vec![(expert, tensor.file_range.clone())];
        return Some(ExpertShares { layer, shares });
    }
    let count = expert_count(tensor)?;
    let range = &tensor.file_range;
    let len = range.end.checked_sub(range.start)?;
    if len % count as u64 != 0 {
        return None;
    }
    let share = len / count as u64;
    let shares = (0..count)
        .map(|expert| {
            let start = range.start + expert as u64 * share;
            (expert, start..start + share)
        })
        .collect();
    Some(ExpertShares { layer, shares })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(names: &[&str]) -> Vec<TensorInfo> {
        names
            .iter()
            .enumerate()
            .map(|(i, name)| TensorInfo {
                name: name.to_string(),
                dtype: "F32".into(),
                shape: vec![8],
                file_range: i as u64 * 32..i as u64 * 32 + 32,
            })
            .collect()
    }

    fn names(tensors: &[TensorInfo], order: &ExecutionOrder) -> Vec<String> {
        order
            .steps
            .iter()
            .map(|&i| tensors[i].name.clone())
            .collect()
    }

    #[test]
    fn llama_gguf_layers_run_in_numeric_then_architectural_order() {
        // Converter order: alphabetical within a layer, layers as strings (10 before 2).
        let tensors = table(&[
            "token_embd.weight",
            "blk.10.attn_k.weight",
            "blk.10.attn_norm.weight",
            "blk.2.ffn_down.weight",
            "blk.2.attn_q.weight",
            "blk.2.attn_q.bias",
            "blk.2.attn_norm.weight",
            "output.weight",
            "output_norm.weight",
        ]);
        let order = execution_order(&tensors);
        assert_eq!(order.architecture, Architecture::LlamaGguf);
        assert_eq!(order.rows_only, Some(0));
        assert_eq!(
            names(&tensors, &order),
            [
                "blk.2.attn_norm.weight",
                "blk.2.attn_q.weight",
                "blk.2.attn_q.bias",
                "blk.2.ffn_down.weight",
                "blk.10.attn_norm.weight",
                "blk.10.attn_k.weight",
                "output_norm.weight",
                "output.weight",
            ]
        );
    }

    #[test]
    fn a_tied_head_sweeps_the_embedding_last() {
        let tensors = table(&[
            "token_embd.weight",
            "blk.0.attn_norm.weight",
            "output_norm.weight",
        ]);
        let order = execution_order(&tensors);
        assert_eq!(order.rows_only, None);
        assert_eq!(
            names(&tensors, &order),
            [
                "blk.0.attn_norm.weight",
                "output_norm.weight",
                "token_embd.weight"
            ]
        );
    }

    #[test]
    fn mixture_of_experts_router_precedes_experts_and_shared_experts() {
        let tensors = table(&[
            "blk.0.ffn_up_shexp.weight",
            "blk.0.ffn_down_exps.weight",
            "blk.0.ffn_gate_inp.weight",
            "blk.0.ffn_up_exps.weight",
            "blk.0.ffn_gate_exps.weight",
            "blk.0.ffn_norm.weight",
            "blk.0.ffn_gate_shexp.weight",
            "blk.0.ffn_down_shexp.weight",
        ]);
        let order = execution_order(&tensors);
        assert_eq!(
            names(&tensors, &order),
            [
                "blk.0.ffn_norm.weight",
                "blk.0.ffn_gate_inp.weight",
                "blk.0.ffn_gate_exps.weight",
                "blk.0.ffn_up_exps.weight",
                "blk.0.ffn_down_exps.weight",
                "blk.0.ffn_gate_shexp.weight",
                "blk.0.ffn_up_shexp.weight",
                "blk.0.ffn_down_shexp.weight",
            ]
        );
        // Outermost first, as `TensorInfo` has it: GGUF's [n_embd, n_ff, n_expert].
        let exps = TensorInfo {
            shape: vec![8, 128, 64],
            file_range: 0..8 * 1024,
            ..tensors[1].clone()
        };
        assert_eq!(expert_count(&exps), Some(8));
        assert_eq!(expert_count(&tensors[2]), None);
        let slices = expert_slices(&exps).unwrap();
        assert_eq!(slices.layer, 0);
        assert_eq!(slices.shares.len(), 8);
        assert_eq!(slices.shares[3], (3, 3 * 1024..4 * 1024));
        assert!(expert_slices(&tensors[2]).is_none());
    }

    #[test]
    fn hugging_face_names_are_recognised() {
        let tensors = table(&[
            "lm_head.weight",
            "model.embed_tokens.weight",
            "model.layers.0.mlp.down_proj.weight",
            "model.layers.0.input_layernorm.weight",
            "model.layers.0.self_attn.q_proj.weight",
            "model.norm.weight",
        ]);
        let order = execution_order(&tensors);
        assert_eq!(order.architecture, Architecture::LlamaHf);
        assert_eq!(order.rows_only, Some(1));
        assert_eq!(
            names(&tensors, &order),
            [
                "model.layers.0.input_layernorm.weight",
                "model.layers.0.self_attn.q_proj.weight",
                "model.layers.0.mlp.down_proj.weight",
                "model.norm.weight",
                "lm_head.weight",
            ]
        );
    }

    #[test]
    fn hugging_face_experts_run_after_their_router() {
        let tensors = table(&[
            "model.layers.0.mlp.experts.1.down_proj.weight",
            "model.layers.0.mlp.experts.0.gate_proj.weight",
            "model.layers.0.mlp.gate.weight",
            "model.layers.0.mlp.experts.0.up_proj.weight",
            "model.layers.0.post_attention_layernorm.weight",
            "model.layers.1.block_sparse_moe.experts.7.w2.weight",
        ]);
        let order = execution_order(&tensors);
        assert_eq!(
            names(&tensors, &order),
            [
                "model.layers.0.post_attention_layernorm.weight",
                "model.layers.0.mlp.gate.weight",
                "model.layers.0.mlp.experts.0.gate_proj.weight",
                "model.layers.0.mlp.experts.0.up_proj.weight",
                "model.layers.0.mlp.experts.1.down_proj.weight",
                "model.layers.1.block_sparse_moe.experts.7.w2.weight",
            ]
        );
        let slices = expert_slices(&tensors[5]).unwrap();
        assert_eq!(slices.layer, 1);
        assert_eq!(slices.shares, vec![(7, tensors[5].file_range.clone())]);
        assert!(expert_slices(&tensors[2]).is_none());
        assert!(expert_slices(&tensors[4]).is_none());
    }

    #[test]
    fn unknown_tensors_keep_file_order_and_unknown_models_fall_back() {
        let tensors = table(&["blk.0.mystery.weight", "blk.0.attn_norm.weight", "extra"]);
        let order = execution_order(&tensors);
        assert_eq!(
            names(&tensors, &order),
            ["blk.0.attn_norm.weight", "blk.0.mystery.weight", "extra"]
        );

        let mut tensors = table(&["conv.b", "conv.a", "head"]);
        tensors[0].file_range = 200..300;
        let order = execution_order(&tensors);
        assert_eq!(order.architecture, Architecture::FileOrder);
        assert_eq!(order.steps, [1, 2, 0]);
    }
}
