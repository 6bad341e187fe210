//! The architectures synth writes besides llama: the mixtures of experts people run,
//! each the llama mixture of experts (`plan::roles::expert_layer`) with the tensors and
//! keys llama.cpp's loader for that architecture requires (it refuses a file with a
//! tensor it does not claim, or without one it needs, or a key of another GGUF type).
//!
//! - `qwen3moe` (Qwen3-30B-A3B, Qwen3-235B-A22B): RMS norms of each head's queries and
//!   keys (`attn_q_norm`, `attn_k_norm`), the experts' width in
//!   `expert_feed_forward_length`.
//! - `gpt-oss`: a bias on the attention output, the router and every expert (the
//!   experts' biases are one row per expert), a learned sink logit per head
//!   (`attn_sinks`), every other layer attending over a sliding window, the norm before
//!   the experts named `post_attention_norm`, and an output head of its own (llama.cpp
//!   does not tie it to the embedding for gpt-oss).
//!
//! - `glm4moe` (GLM-4.5): biases on the queries, keys and values, the norm before
//!   the experts named `post_attention_norm`, a shared expert every token runs
//!   (`ffn_*_shexp`), a score bias added to the router's logits to choose experts
//!   (`exp_probs_b`), sigmoid gating, and a dense first layer.
//! - `deepseek2` (DeepSeek-V2/V3, Kimi K2): latent attention (`plan::LatentAttention`)
//!   in place of llama's, a shared expert, the router's score bias, sigmoid gating,
//!   and a dense first layer.
//!
//! qwen3moe, gpt-oss and glm4moe rotate query and key dimensions in NEOX pairs
//! (i, i + d/2), not llama's (2i, 2i + 1), and deepseek2 attends through its latent,
//! so the locality router's chosen attention (`router`), built on llama's, is refused
//! for them.

use super::plan::{LlamaShape, MoeSpec, Role};
use super::SynthError;
use crate::model::ggml_type::GgmlType;
use crate::model::gguf::GgufValue;

/// The architecture of a synthetic model (GGUF `general.architecture`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SynthArch {
    /// llama, dense or with Mixtral's experts: the small model's own architecture.
    #[default]
    Llama,
    Qwen3Moe,
    GptOss,
    Glm4Moe,
    DeepSeek2,
}

/// gpt-oss's sliding window (tokens), as the released models have it.
const GPT_OSS_SLIDING_WINDOW: u32 = 128;

/// llama.cpp's `LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID`: DeepSeek-V3 and GLM-4.5 weigh
/// each chosen expert by the sigmoid of its logit.
const GATING_SIGMOID: u32 = 2;

/// The shared experts of glm4moe and deepseek2, per layer (both families have one).
const SHARED_EXPERTS: u64 = 1;

/// Their leading dense layers: GLM-4.5-Air has one, DeepSeek-V3 and GLM-4.5 three of
/// 61 and 92; synthetic models have 10-40 layers.
const DENSE_LEAD: u64 = 1;

/// Depths at which llama.cpp takes a deepseek2 file for DeepSeek-V2-Lite, whose
/// queries have no low-rank pair (`attn_q` in place of `attn_q_a` and `attn_q_b`).
const DEEPSEEK2_LITE_DEPTHS: [u64; 2] = [26, 27];

impl SynthArch {
    /// The GGUF architecture name, the prefix of its metadata keys.
    pub fn name(self) -> &'static str {
        match self {
            SynthArch::Llama => "llama",
            SynthArch::Qwen3Moe => "qwen3moe",
            SynthArch::GptOss => "gpt-oss",
            SynthArch::Glm4Moe => "glm4moe",
            SynthArch::DeepSeek2 => "deepseek2",
        }
    }

    /// Shared experts per layer, which every token runs.
    pub(super) fn shared_experts(self) -> u64 {
        match self {
            SynthArch::Glm4Moe | SynthArch::DeepSeek2 => SHARED_EXPERTS,
            _ => 0,
        }
    }

    /// Leading layers that are dense, of a model `n_layer` deep (at least one layer
    /// keeps its experts).
    pub(super) fn dense_lead(self, n_layer: u64) -> u64 {
        match self {
            SynthArch::Glm4Moe | SynthArch::DeepSeek2 => DENSE_LEAD.min(n_layer.saturating_sub(1)),
            _ => 0,
        }
    }

    /// A depth llama.cpp reads as this architecture's: a deepseek2 of a Lite's depth
    /// goes one layer deeper.
    pub(super) fn depth(self, n_layer: u64) -> u64 {
        match self {
            SynthArch::DeepSeek2 if DEEPSEEK2_LITE_DEPTHS.contains(&n_layer) => {
                DEEPSEEK2_LITE_DEPTHS[1] + 1
            }
            _ => n_layer,
        }
    }

    /// Refuses what this architecture cannot be written with.
    pub(super) fn check(self, moe: Option<&MoeSpec>) -> Result<(), SynthError> {
        if self == SynthArch::Llama {
            return Ok(());
        }
        let Some(moe) = moe else {
            return Err(SynthError::Unsupported(format!(
                "{} is a mixture of experts: give --experts",
                self.name()
            )));
        };
        if moe.locality.is_some() {
            let why = match self {
                SynthArch::DeepSeek2 => "attends through a compressed latent",
                _ => "rotates queries and keys in NEOX pairs",
            };
            return Err(SynthError::Locality(format!(
                "{} {why}, which the recency windows (built on llama's attention) do not \
                 follow; use --arch llama",
                self.name()
            )));
        }
        Ok(())
    }

    /// Turns the roles of a llama mixture of experts into this architecture's:
    /// `n_layer` is the small model's depth (types are per small layer).
    pub(super) fn adapt_roles(
        self,
        globals: &mut Vec<Role>,
        layer: &mut Vec<Role>,
        n_layer: usize,
    ) {
        match self {
            SynthArch::Llama => {}
            SynthArch::Qwen3Moe => {
                layer.push(f32_role("attn_q_norm.weight", n_layer));
                layer.push(f32_role("attn_k_norm.weight", n_layer));
            }
            SynthArch::GptOss => gpt_oss_roles(globals, layer, n_layer),
            SynthArch::Glm4Moe => {
                rename(layer, "ffn_norm.weight", "post_attention_norm.weight");
                add_f32_roles(
                    layer,
                    &[
                        "attn_q.bias",
                        "attn_k.bias",
                        "attn_v.bias",
                        "exp_probs_b.bias",
                    ],
                    n_layer,
                );
                add_shared_experts(layer);
            }
            SynthArch::DeepSeek2 => {
                latent_attention_roles(layer, n_layer);
                layer.push(f32_role("exp_probs_b.bias", n_layer));
                add_shared_experts(layer);
            }
        }
    }

    /// Gives a tensor whose rows are not whole blocks of its type the type llama.cpp's
    /// quantizer falls back to (Q8_0): deepseek2's `attn_k_b`, whose rows are one
    /// head's unrotated key dimensions, too short for a K-quant's 256-element blocks.
    pub(super) fn fall_back_types(self, layer: &mut [Role], head_dim: u64) {
        if self != SynthArch::DeepSeek2 {
            return;
        }
        let nope_dim = super::plan::LatentAttention::for_head(head_dim).nope_dim;
        for role in layer
            .iter_mut()
            .filter(|role| role.name == "attn_k_b.weight")
        {
            for ty in role.types.iter_mut() {
                if nope_dim % ty.block_size() != 0 {
                    *ty = GgmlType::Q8_0;
                }
            }
        }
    }

    /// Keys this architecture needs beyond the llama ones (renamed to its prefix),
    /// each of the GGUF type llama.cpp reads it as.
    pub(super) fn extra_metadata(self, shape: &LlamaShape) -> Vec<(String, GgufValue)> {
        let key = |name: &str| format!("{}.{name}", self.name());
        let u32_of = |n: u64| GgufValue::U32(u32::try_from(n).unwrap_or(u32::MAX));
        match self {
            SynthArch::Llama => Vec::new(),
            SynthArch::Qwen3Moe | SynthArch::GptOss => {
                let mut keys = vec![
                    (key("expert_feed_forward_length"), u32_of(shape.n_ff)),
                    // Both build each head from key_length (qwen3moe asserts it equals
                    // the rotated dimensions and value_length).
                    (key("attention.key_length"), u32_of(shape.head_dim)),
                    (key("attention.value_length"), u32_of(shape.head_dim)),
                ];
                if self == SynthArch::GptOss {
                    keys.push((
                        key("attention.sliding_window"),
                        GgufValue::U32(GPT_OSS_SLIDING_WINDOW),
                    ));
                }
                keys
            }
            SynthArch::Glm4Moe | SynthArch::DeepSeek2 => {
                let mut keys = vec![
                    (key("expert_feed_forward_length"), u32_of(shape.n_ff)),
                    // The dense leading layers' width.
                    (key("feed_forward_length"), u32_of(shape.dense_ff())),
                    (key("expert_shared_count"), u32_of(shape.n_expert_shared)),
                    (
                        key("leading_dense_block_count"),
                        u32_of(shape.n_layer_dense_lead),
                    ),
                    (key("expert_gating_func"), GgufValue::U32(GATING_SIGMOID)),
                    (key("expert_weights_norm"), GgufValue::Bool(true)),
                    (key("expert_weights_scale"), GgufValue::F32(1.0)),
                ];
                if self == SynthArch::Glm4Moe {
                    keys.push((key("attention.key_length"), u32_of(shape.head_dim)));
                    keys.push((key("attention.value_length"), u32_of(shape.head_dim)));
                } else {
                    let mla = shape.latent_attention();
                    keys.extend([
                        (key("attention.q_lora_rank"), u32_of(mla.q_lora_rank)),
                        (key("attention.kv_lora_rank"), u32_of(mla.kv_lora_rank)),
                        // The cache holds one latent row and the rotated key part
                        // per token, shared by all heads: one key-value head.
                        (
                            key("attention.key_length"),
                            u32_of(mla.kv_lora_rank + mla.rope_dim),
                        ),
                        (key("attention.value_length"), u32_of(mla.kv_lora_rank)),
                        (key("attention.key_length_mla"), u32_of(mla.key_length())),
                        (key("attention.value_length_mla"), u32_of(mla.value_length)),
                        (key("attention.head_count_kv"), GgufValue::U32(1)),
                        (key("rope.dimension_count"), u32_of(mla.rope_dim)),
                    ]);
                }
                keys
            }
        }
    }
}

/// A role of F32 tensors (a norm, a bias), in each of `n_layer` small layers.
fn f32_role(name: &str, n_layer: usize) -> Role {
    Role {
        name: name.to_string(),
        types: vec![GgmlType::F32; n_layer],
    }
}

/// gpt-oss's: the norm before the experts renamed, biases on the attention output, the
/// router and the experts, sinks, and an output head of its own (of the embedding's
/// types) where the small model ties it to the embedding.
fn gpt_oss_roles(globals: &mut Vec<Role>, layer: &mut Vec<Role>, n_layer: usize) {
    rename(layer, "ffn_norm.weight", "post_attention_norm.weight");
    add_f32_roles(
        layer,
        &[
            "attn_sinks.weight",
            "attn_output.bias",
            "ffn_gate_inp.bias",
            "ffn_gate_exps.bias",
            "ffn_up_exps.bias",
            "ffn_down_exps.bias",
        ],
        n_layer,
    );
    let has_output = globals.iter().any(|role| role.name == "output.weight");
    let embedding = globals.iter().find(|role| role.name == "token_embd.weight");
    if let (false, Some(embedding)) = (has_output, embedding) {
        let output = Role {
            name: "output.weight".into(),
            types: embedding.types.clone(),
        };
        globals.push(output);
    }
}

/// DeepSeek's latent attention in place of llama's: its query pair of the queries'
/// types, its key-value compression and key expansion of the keys', its value
/// expansion of the values', and F32 norms.
fn latent_attention_roles(layer: &mut Vec<Role>, n_layer: usize) {
    let types_of = |layer: &[Role], name: &str| {
        layer
            .iter()
            .find(|role| role.name == name)
            .map_or_else(|| vec![GgmlType::F32; n_layer], |role| role.types.clone())
    };
    let (q, k, v) = (
        types_of(layer, "attn_q.weight"),
        types_of(layer, "attn_k.weight"),
        types_of(layer, "attn_v.weight"),
    );
    layer.retain(|role| {
        !["attn_q.", "attn_k.", "attn_v."]
            .iter()
            .any(|prefix| role.name.starts_with(prefix))
    });
    let typed = |name: &str, types: &Vec<GgmlType>| Role {
        name: name.to_string(),
        types: types.clone(),
    };
    layer.extend([
        typed("attn_q_a.weight", &q),
        f32_role("attn_q_a_norm.weight", n_layer),
        typed("attn_q_b.weight", &q),
        typed("attn_kv_a_mqa.weight", &k),
        f32_role("attn_kv_a_norm.weight", n_layer),
        typed("attn_k_b.weight", &k),
        typed("attn_v_b.weight", &v),
    ]);
}

/// F32 roles (norms, biases, sinks) of these names, where the layer lacks them.
fn add_f32_roles(layer: &mut Vec<Role>, names: &[&str], n_layer: usize) {
    for name in names {
        if !layer.iter().any(|role| role.name == *name) {
            layer.push(Role {
                name: name.to_string(),
                types: vec![GgmlType::F32; n_layer],
            });
        }
    }
}

fn rename(layer: &mut [Role], from: &str, to: &str) {
    for role in layer.iter_mut().filter(|role| role.name == from) {
        role.name = to.to_string();
    }
}

/// One shared expert, of the routed experts' width and types (before `--expert-type`,
/// which released models apply to the routed experts alone).
fn add_shared_experts(layer: &mut Vec<Role>) {
    let shared: Vec<Role> = layer
        .iter()
        .filter_map(|role| {
            let base = role.name.strip_suffix("_exps.weight")?;
            Some(Role {
                name: format!("{base}_shexp.weight"),
                types: role.types.clone(),
            })
        })
        .collect();
    layer.extend(shared);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roles(names: &[&str]) -> Vec<Role> {
        names
            .iter()
            .map(|name| Role {
                name: name.to_string(),
                types: vec![GgmlType::Q8_0; 2],
            })
            .collect()
    }

    fn names(roles: &[Role]) -> Vec<&str> {
        roles.iter().map(|role| role.name.as_str()).collect()
    }

    #[test]
    fn gpt_oss_gets_its_biases_sinks_norm_name_and_an_untied_head() {
        let mut globals = roles(&["token_embd.weight", "output_norm.weight"]);
        let mut layer = roles(&["attn_norm.weight", "ffn_norm.weight", "ffn_up_exps.weight"]);
        SynthArch::GptOss.adapt_roles(&mut globals, &mut layer, 2);
        assert_eq!(
            names(&globals),
            ["token_embd.weight", "output_norm.weight", "output.weight"]
        );
        assert_eq!(globals[2].types, globals[0].types);
        let layer_names = names(&layer);
        assert!(layer_names.contains(&"post_attention_norm.weight"));
        assert!(!layer_names.contains(&"ffn_norm.weight"));
        for needed in [
            "attn_sinks.weight",
            "ffn_gate_inp.bias",
            "ffn_down_exps.bias",
        ] {
            let role = layer.iter().find(|role| role.name == needed).unwrap();
            assert_eq!(role.types, [GgmlType::F32; 2], "{needed}");
        }
    }

    #[test]
    fn qwen3moe_gets_head_norms_and_llama_is_untouched() {
        let (mut globals, mut layer) = (roles(&["token_embd.weight"]), roles(&["attn_q.weight"]));
        SynthArch::Llama.adapt_roles(&mut globals, &mut layer, 2);
        assert_eq!(names(&layer), ["attn_q.weight"]);
        SynthArch::Qwen3Moe.adapt_roles(&mut globals, &mut layer, 2);
        assert_eq!(
            names(&layer),
            ["attn_q.weight", "attn_q_norm.weight", "attn_k_norm.weight"]
        );
        assert_eq!(names(&globals), ["token_embd.weight"]);
    }

    #[test]
    fn glm4moe_gets_attention_biases_a_score_bias_and_a_shared_expert() {
        let mut globals = roles(&["token_embd.weight"]);
        let mut layer = roles(&["attn_q.weight", "ffn_norm.weight", "ffn_down_exps.weight"]);
        SynthArch::Glm4Moe.adapt_roles(&mut globals, &mut layer, 2);
        assert_eq!(
            names(&layer),
            [
                "attn_q.weight",
                "post_attention_norm.weight",
                "ffn_down_exps.weight",
                "attn_q.bias",
                "attn_k.bias",
                "attn_v.bias",
                "exp_probs_b.bias",
                "ffn_down_shexp.weight",
            ]
        );
        assert_eq!(layer[7].types, [GgmlType::Q8_0; 2]);
        assert_eq!(SynthArch::Glm4Moe.shared_experts(), 1);
        assert_eq!(SynthArch::Glm4Moe.dense_lead(20), 1);
        assert_eq!(
            SynthArch::Glm4Moe.dense_lead(1),
            0,
            "one layer keeps its experts"
        );
        assert_eq!(SynthArch::Qwen3Moe.dense_lead(20), 0);
    }

    #[test]
    fn deepseek2_attends_through_its_latent_and_avoids_lite_depths() {
        let mut globals = roles(&["token_embd.weight"]);
        let mut layer = roles(&[
            "attn_q.weight",
            "attn_k.weight",
            "attn_v.weight",
            "attn_output.weight",
            "ffn_up_exps.weight",
        ]);
        layer[1].types = vec![GgmlType::Q4K; 2];
        SynthArch::DeepSeek2.adapt_roles(&mut globals, &mut layer, 2);
        let layer_names = names(&layer);
        for gone in ["attn_q.weight", "attn_k.weight", "attn_v.weight"] {
            assert!(!layer_names.contains(&gone), "{layer_names:?}");
        }
        for needed in [
            "attn_q_a.weight",
            "attn_q_b.weight",
            "attn_kv_a_mqa.weight",
            "attn_k_b.weight",
            "attn_v_b.weight",
            "attn_output.weight",
            "exp_probs_b.bias",
            "ffn_up_shexp.weight",
        ] {
            assert!(layer_names.contains(&needed), "{needed}: {layer_names:?}");
        }
        // attn_k_b's rows are one head's 64 unrotated dimensions: no Q4_K block.
        SynthArch::DeepSeek2.fall_back_types(&mut layer, 64);
        let k_b = layer.iter().find(|r| r.name == "attn_k_b.weight").unwrap();
        assert_eq!(k_b.types, [GgmlType::Q8_0; 2]);
        let kv_a = layer
            .iter()
            .find(|r| r.name == "attn_kv_a_mqa.weight")
            .unwrap();
        assert_eq!(kv_a.types, [GgmlType::Q4K; 2]);
        assert_eq!(SynthArch::DeepSeek2.depth(26), 28);
        assert_eq!(SynthArch::DeepSeek2.depth(27), 28);
        assert_eq!(SynthArch::DeepSeek2.depth(30), 30);
        assert_eq!(SynthArch::Glm4Moe.depth(27), 27);
    }

    #[test]
    fn the_experts_and_no_locality_are_required() {
        let moe = MoeSpec {
            experts: 8,
            used: 2,
            ff_ratio: None,
            skew: 0.0,
            affinity: 0.0,
            locality: None,
        };
        assert!(SynthArch::Llama.check(None).is_ok());
        let error = SynthArch::Qwen3Moe.check(None).unwrap_err().to_string();
        assert!(error.contains("--experts"), "{error}");
        assert!(SynthArch::GptOss.check(Some(&moe)).is_ok());
        let local = MoeSpec {
            locality: super::super::RouterLocality::parse("qwen3").unwrap(),
            ..moe
        };
        let error = SynthArch::GptOss
            .check(Some(&local))
            .unwrap_err()
            .to_string();
        assert!(error.contains("NEOX"), "{error}");
    }
}
