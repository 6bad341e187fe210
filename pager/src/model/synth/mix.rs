//! Quantization mixes: the per-tensor types llama.cpp's quantizer gives a model for a
//! named recipe, so a synthetic model's tensors, and so its experts' slices, have the
//! sizes and alignments released files have.
//!
//! Q4_K_M (llama-quantize's `llama_tensor_get_type`): Q4_K for every quantized weight
//! but the output head (Q6_K; the embedding when it is the head) and, in about a third of the layers (the first and last
//! eighth and every third between), the attention's values and the feed-forward
//! network's down projection (Q6_K), experts and shared experts included.

use super::plan::Role;
use crate::model::ggml_type::GgmlType;

/// A named quantization recipe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantMix {
    /// llama.cpp's Q4_K_M.
    Q4KM,
}

impl QuantMix {
    /// The recipe with this name (`Q4_K_M`; case-insensitive).
    pub fn from_name(name: &str) -> Option<QuantMix> {
        name.eq_ignore_ascii_case("Q4_K_M")
            .then_some(QuantMix::Q4KM)
    }

    /// The type of the weights the recipe does not single out.
    pub fn base_type(self) -> GgmlType {
        match self {
            QuantMix::Q4KM => GgmlType::Q4K,
        }
    }

    /// llama.cpp's `LLAMA_FTYPE_MOSTLY_*`, which labels the model.
    pub fn file_type(self) -> u64 {
        match self {
            QuantMix::Q4KM => 15,
        }
    }

    /// Gives the singled-out tensors their types; every quantized weight already has
    /// the base type. A layer role's types are per small-model layer, so "which
    /// layers" is taken at their relative depth.
    pub(super) fn apply(self, globals: &mut [Role], layer: &mut [Role]) {
        let QuantMix::Q4KM = self;
        // The output head; tied to the embedding, the embedding is the head.
        let head = if globals.iter().any(|role| role.name == "output.weight") {
            "output.weight"
        } else {
            "token_embd.weight"
        };
        for role in globals.iter_mut().filter(|role| role.name == head) {
            quantized_to_q6_k(&mut role.types, |_| true);
        }
        let more_bits = |role: &str| {
            matches!(
                role,
                "attn_v.weight"
                    | "attn_v_b.weight"
                    | "ffn_down.weight"
                    | "ffn_down_exps.weight"
                    | "ffn_down_shexp.weight"
            )
        };
        for role in layer.iter_mut().filter(|role| more_bits(&role.name)) {
            let n = role.types.len();
            quantized_to_q6_k(&mut role.types, |i| use_more_bits(i, n));
        }
    }
}

/// Q6_K for the quantized types at the indices `pick` selects.
fn quantized_to_q6_k(types: &mut [GgmlType], pick: impl Fn(usize) -> bool) {
    for (i, ty) in types.iter_mut().enumerate() {
        if ty.is_quantized() && pick(i) {
            *ty = GgmlType::Q6K;
        }
    }
}

/// llama.cpp's `use_more_bits`: layer `i` of `n` is one of the first or last eighth,
/// or every third between.
fn use_more_bits(i: usize, n: usize) -> bool {
    i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn more_bits_as_llama_cpp_picks_them() {
        let picked: Vec<usize> = (0..16).filter(|&i| use_more_bits(i, 16)).collect();
        assert_eq!(picked, [0, 1, 4, 7, 10, 13, 14, 15]);
    }

    #[test]
    fn q4_k_m_singles_out_the_head_values_and_down_projections() {
        let role = |name: &str, ty: GgmlType| Role {
            name: name.to_string(),
            types: vec![ty; 16],
        };
        let mut globals = [
            role("token_embd.weight", GgmlType::Q4K),
            role("output.weight", GgmlType::Q4K),
        ];
        let mut layer = [
            role("attn_norm.weight", GgmlType::F32),
            role("attn_q.weight", GgmlType::Q4K),
            role("attn_v.weight", GgmlType::Q4K),
            role("ffn_down_exps.weight", GgmlType::Q4K),
        ];
        QuantMix::Q4KM.apply(&mut globals, &mut layer);
        assert_eq!(globals[0].types[0], GgmlType::Q4K);
        assert_eq!(globals[1].types[0], GgmlType::Q6K);
        let mut tied = [role("token_embd.weight", GgmlType::Q4K)];
        QuantMix::Q4KM.apply(&mut tied, &mut []);
        assert_eq!(
            tied[0].types[0],
            GgmlType::Q6K,
            "the tied embedding is the head"
        );
        assert_eq!(layer[0].types, [GgmlType::F32; 16]);
        assert_eq!(layer[1].types, [GgmlType::Q4K; 16]);
        for role in &layer[2..] {
            assert_eq!(role.types[0], GgmlType::Q6K, "{}", role.name);
            assert_eq!(role.types[2], GgmlType::Q4K, "{}", role.name);
            assert_eq!(role.types[4], GgmlType::Q6K, "{}", role.name);
        }
        assert_eq!(QuantMix::from_name("q4_k_m"), Some(QuantMix::Q4KM));
        assert_eq!(QuantMix::from_name("Q4_K"), None);
    }
}
