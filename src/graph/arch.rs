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
    "attn_output",
    "attn_post_norm",
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
                    .map_or("", |(_, gguf)| gguf);
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

/// Experts in a mixture-of-experts tensor (`ffn_*_exps`), read from the last dimension
/// of its shape (GGUF lists dimensions innermost first: `[n_embd, n_ff, n_expert]`).
pub fn expert_count(tensor: &TensorInfo) -> Option<u32> {
    let (base, _) = split_suffix(&tensor.name);
    if !base.ends_with("_exps") || tensor.shape.len() != 3 {
        return None;
    }
    let count = *tensor.shape.last()?;
    (count > 1 && count <= u32::MAX as u64).then_some(count as u32)
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
        let exps = TensorInfo {
            shape: vec![64, 128, 8],
            ..tensors[1].clone()
        };
        assert_eq!(expert_count(&exps), Some(8));
        assert_eq!(expert_count(&tensors[2]), None);
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
