//! Hugging Face conversion's tensor order: llama.cpp's converter writes tensors in
//! the order it reads them from the checkpoint, whose names are sorted as strings
//! (`model.layers.10.*` before `model.layers.2.*`; inside a layer `mlp.*` before
//! `post_attention_layernorm` before `self_attn.*`, so `ffn_down_exps` before
//! `attn_q`). It merges a layer's experts into `ffn_{down,gate,up}_exps` when it
//! reaches that layer's last expert tensor, and gpt-oss's converter writes every
//! layer's MXFP4 experts before anything else.

use super::arch::SynthArch;
use crate::model::gguf::NewTensor;

/// The Hugging Face name of a layer tensor's role (`attn_q.weight`), and where among
/// tensors of that name it comes (merged experts: down, gate, up).
fn layer_name(role: &str, arch: SynthArch, last_expert: &str) -> (String, u8) {
    let (base, suffix) = role.rsplit_once('.').unwrap_or((role, "weight"));
    let expert = |rank: u8| (format!("mlp.experts.{last_expert}.up_proj.weight"), rank);
    let name = match (base, arch) {
        ("ffn_down_exps", _) => return expert(0),
        ("ffn_gate_exps", _) => return expert(1),
        ("ffn_up_exps", _) => return expert(2),
        ("attn_norm", _) => "input_layernorm",
        ("attn_q", _) => "self_attn.q_proj",
        ("attn_k", _) => "self_attn.k_proj",
        ("attn_v", _) => "self_attn.v_proj",
        ("attn_output", _) => "self_attn.o_proj",
        ("attn_q_norm", _) => "self_attn.q_norm",
        ("attn_k_norm", _) => "self_attn.k_norm",
        ("attn_sinks", _) => "self_attn.sinks",
        ("attn_q_a", _) => "self_attn.q_a_proj",
        ("attn_q_a_norm", _) => "self_attn.q_a_layernorm",
        ("attn_q_b", _) => "self_attn.q_b_proj",
        ("attn_kv_a_mqa", _) => "self_attn.kv_a_proj_with_mqa",
        ("attn_kv_a_norm", _) => "self_attn.kv_a_layernorm",
        // The converter splits kv_b_proj into the key and value expansions.
        ("attn_k_b", _) => return ("self_attn.kv_b_proj.weight".into(), 0),
        ("attn_v_b", _) => return ("self_attn.kv_b_proj.weight".into(), 1),
        ("exp_probs_b", _) => return ("mlp.gate.e_score_correction_bias".into(), 0),
        ("ffn_gate_shexp", _) => "mlp.shared_experts.gate_proj",
        ("ffn_up_shexp", _) => "mlp.shared_experts.up_proj",
        ("ffn_down_shexp", _) => "mlp.shared_experts.down_proj",
        ("ffn_norm" | "post_attention_norm", _) => "post_attention_layernorm",
        ("ffn_gate_inp", SynthArch::GptOss) => "mlp.router",
        ("ffn_gate_inp", _) => "mlp.gate",
        ("ffn_gate", _) => "mlp.gate_proj",
        ("ffn_up", _) => "mlp.up_proj",
        ("ffn_down", _) => "mlp.down_proj",
        (other, _) => other,
    };
    // gpt-oss's expert biases: `mlp.experts.down_proj_bias`, and gate and up split
    // from `mlp.experts.gate_up_proj_bias`.
    let name = match (role, arch) {
        ("ffn_down_exps.bias", SynthArch::GptOss) => {
            return ("mlp.experts.down_proj_bias".into(), 0)
        }
        ("ffn_gate_exps.bias", SynthArch::GptOss) => {
            return ("mlp.experts.gate_up_proj_bias".into(), 0)
        }
        ("ffn_up_exps.bias", SynthArch::GptOss) => {
            return ("mlp.experts.gate_up_proj_bias".into(), 1)
        }
        _ => format!("{name}.{suffix}"),
    };
    (name, 0)
}

/// The sort key of `name` in Hugging Face order: (written first, checkpoint name,
/// rank among tensors from one checkpoint name).
fn key(name: &str, arch: SynthArch, last_expert: &str) -> (u8, String, u8) {
    let Some((layer, role)) = name
        .strip_prefix("blk.")
        .and_then(|rest| rest.split_once('.'))
    else {
        let global = match name {
            "token_embd.weight" => "model.embed_tokens.weight",
            "output_norm.weight" => "model.norm.weight",
            "output.weight" => "lm_head.weight",
            // Tensors the converter computes (rope_freqs) come before the checkpoint's.
            other => return (0, other.to_string(), 0),
        };
        return (1, global.to_string(), 0);
    };
    let (hf, rank) = layer_name(role, arch, last_expert);
    let first = arch == SynthArch::GptOss && role.ends_with("_exps.weight");
    (u8::from(!first), format!("model.layers.{layer}.{hf}"), rank)
}

/// Sorts `tensors` into Hugging Face conversion's order for a model of `arch` with
/// `experts` routed experts per layer.
pub(super) fn sort(tensors: &mut [NewTensor], arch: SynthArch, experts: u64) {
    let last_expert = (0..experts.max(1))
        .map(|expert| expert.to_string())
        .max()
        .unwrap_or_default();
    tensors.sort_by_cached_key(|tensor| key(&tensor.name, arch, &last_expert));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ggml_type::GgmlType;

    fn tensors(names: &[&str]) -> Vec<NewTensor> {
        names
            .iter()
            .map(|name| NewTensor {
                name: name.to_string(),
                dims: vec![1],
                ggml_type: GgmlType::F32,
            })
            .collect()
    }

    fn sorted(names: &[&str], arch: SynthArch, experts: u64) -> Vec<String> {
        let mut tensors = tensors(names);
        sort(&mut tensors, arch, experts);
        tensors.into_iter().map(|tensor| tensor.name).collect()
    }

    #[test]
    fn layers_sort_as_strings_and_experts_come_before_attention() {
        let names = [
            "token_embd.weight",
            "blk.2.attn_norm.weight",
            "blk.2.attn_q.weight",
            "blk.2.ffn_norm.weight",
            "blk.2.ffn_gate_inp.weight",
            "blk.2.ffn_gate_exps.weight",
            "blk.2.ffn_up_exps.weight",
            "blk.2.ffn_down_exps.weight",
            "blk.10.attn_q.weight",
            "output_norm.weight",
        ];
        assert_eq!(
            sorted(&names, SynthArch::Qwen3Moe, 16),
            [
                "token_embd.weight",
                "blk.10.attn_q.weight",
                "blk.2.attn_norm.weight",
                "blk.2.ffn_down_exps.weight",
                "blk.2.ffn_gate_exps.weight",
                "blk.2.ffn_up_exps.weight",
                "blk.2.ffn_gate_inp.weight",
                "blk.2.ffn_norm.weight",
                "blk.2.attn_q.weight",
                "output_norm.weight",
            ]
        );
    }

    #[test]
    fn gpt_oss_writes_every_layers_experts_first() {
        let names = [
            "token_embd.weight",
            "blk.0.attn_q.weight",
            "blk.0.ffn_up_exps.weight",
            "blk.0.ffn_up_exps.bias",
            "blk.1.ffn_down_exps.weight",
            "blk.1.ffn_gate_inp.weight",
        ];
        assert_eq!(
            sorted(&names, SynthArch::GptOss, 32),
            [
                "blk.0.ffn_up_exps.weight",
                "blk.1.ffn_down_exps.weight",
                "token_embd.weight",
                "blk.0.ffn_up_exps.bias",
                "blk.0.attn_q.weight",
                "blk.1.ffn_gate_inp.weight",
            ]
        );
    }
}
