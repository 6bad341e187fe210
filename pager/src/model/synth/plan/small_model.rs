//! Reading the small model a synthetic one is shaped like: its dimensions and tensor
//! roles, checked to be a dense llama that synth knows how to scale.

use super::super::fill;
use super::super::SynthError;
use super::roles::{layer_of, Role};
use super::shape::LlamaShape;
use crate::model::ggml_type::GgmlType;
use crate::model::gguf::GgufFile;

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

fn key_u64(small: &GgufFile, key: &str) -> Result<u64, SynthError> {
    small
        .get_u64(key)
        .ok_or_else(|| SynthError::MissingKey(key.to_string()))
}

/// Reads the small model's shape and its tensors' roles and types.
pub(super) fn small_model(
    small: &GgufFile,
) -> Result<(LlamaShape, Vec<Role>, Vec<Role>), SynthError> {
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
