//! A model's tensor roles (a kind of tensor, with its type per small layer) and what a
//! plan makes of the small model's: experts in place of the dense feed-forward network,
//! dense leading layers, other types.

use super::super::fill;
use super::super::SynthError;
use crate::model::ggml_type::GgmlType;

/// A kind of tensor of the small model, with its type (per small layer, for layers).
#[derive(Debug, Clone)]
pub(in crate::model::synth) struct Role {
    pub(in crate::model::synth) name: String,
    pub(in crate::model::synth) types: Vec<GgmlType>,
}

/// The layer and role of a layer's tensor (`blk.N.role`), by its name.
pub(super) fn layer_of(name: &str) -> Option<(u64, &str)> {
    let rest = name.strip_prefix("blk.")?;
    let (index, role) = rest.split_once('.')?;
    Some((index.parse().ok()?, role))
}

/// The type of `role` in layer `i` of `n_layer`: the small model's layer at the same
/// relative depth, so mixed-quantization recipes (Q4_K_M and the like) carry over.
pub(super) fn layer_type(role: &Role, i: u64, n_layer: u64) -> GgmlType {
    let n = role.types.len() as u64;
    let j = (u128::from(i) * u128::from(n) / u128::from(n_layer.max(1))) as u64;
    let j = j.min(n.saturating_sub(1));
    role.types.get(j as usize).copied().unwrap_or(GgmlType::F32)
}

/// The dense feed-forward roles a mixture of experts replaces, and their replacements.
pub(super) const EXPERT_ROLES: &[(&str, &str)] = &[
    ("ffn_gate.weight", "ffn_gate_exps.weight"),
    ("ffn_up.weight", "ffn_up_exps.weight"),
    ("ffn_down.weight", "ffn_down_exps.weight"),
];

/// Turns a dense layer's roles into a mixture of experts': the feed-forward weights
/// become merged expert tensors of the same types, their biases go (llama.cpp's llama
/// experts have none) and an f32 router joins, as converters write Mixtral's.
pub(super) fn expert_layer(layer: &mut Vec<Role>, n_layer: usize) {
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
pub(super) fn dense_layer(layer: &[Role]) -> Vec<Role> {
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

/// Gives every quantized tensor `weight_type` (a quantized type the filler supports).
pub(super) fn retype_quantized(
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

/// Gives the merged expert tensors alone `expert_type` (a quantized type the filler
/// supports), as released mixtures of experts have theirs.
pub(super) fn retype_experts(expert_type: GgmlType, layer: &mut [Role]) -> Result<(), SynthError> {
    if !expert_type.is_quantized() || !fill::supported(expert_type) {
        return Err(SynthError::UnsupportedType(expert_type));
    }
    for role in layer
        .iter_mut()
        .filter(|role| role.name.ends_with("_exps.weight"))
    {
        role.types.fill(expert_type);
    }
    Ok(())
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
}
