//! The architectures synth writes besides llama: the mixtures of experts people run,
//! each the llama mixture of experts (`plan::expert_layer`) with the tensors and keys
//! llama.cpp's loader for that architecture requires (it refuses a file with a tensor
//! it does not claim, or without one it needs, or a key of another GGUF type).
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
//! Both rotate query and key dimensions in NEOX pairs (i, i + d/2), not llama's
//! (2i, 2i + 1), so the locality router's chosen attention (`router`), built on
//! llama's pairs, is refused for them.

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
}

/// gpt-oss's sliding window (tokens), as the released models have it.
const GPT_OSS_SLIDING_WINDOW: u32 = 128;

impl SynthArch {
    /// The GGUF architecture name, the prefix of its metadata keys.
    pub fn name(self) -> &'static str {
        match self {
            SynthArch::Llama => "llama",
            SynthArch::Qwen3Moe => "qwen3moe",
            SynthArch::GptOss => "gpt-oss",
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
            return Err(SynthError::Locality(format!(
                "{} rotates queries and keys in NEOX pairs, which the recency windows \
                 (built on llama's) do not follow; use --arch llama",
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
        let f32_role = |name: &str| Role {
            name: name.to_string(),
            types: vec![GgmlType::F32; n_layer],
        };
        match self {
            SynthArch::Llama => {}
            SynthArch::Qwen3Moe => {
                layer.push(f32_role("attn_q_norm.weight"));
                layer.push(f32_role("attn_k_norm.weight"));
            }
            SynthArch::GptOss => {
                for role in layer.iter_mut() {
                    if role.name == "ffn_norm.weight" {
                        role.name = "post_attention_norm.weight".into();
                    }
                }
                for name in [
                    "attn_sinks.weight",
                    "attn_output.bias",
                    "ffn_gate_inp.bias",
                    "ffn_gate_exps.bias",
                    "ffn_up_exps.bias",
                    "ffn_down_exps.bias",
                ] {
                    if !layer.iter().any(|role| role.name == name) {
                        layer.push(f32_role(name));
                    }
                }
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
        }
    }
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
