//! The order a planned model's tensors are written in (`TensorOrder`), from the
//! execution order they are planned in.

use rand::seq::SliceRandom;
use rand::SeedableRng;

use super::super::arch::SynthArch;
use super::super::{hf_order, TensorOrder};
use super::roles::{layer_of, EXPERT_ROLES};
use crate::model::gguf::{GgufFile, NewTensor};

/// Puts `tensors`, in execution order, in `order`: `small`'s file order, by name,
/// shuffled by `seed`, or as llama.cpp's converter writes `arch`'s Hugging Face
/// checkpoint of `n_expert` experts.
pub(super) fn sort(
    tensors: &mut [NewTensor],
    order: TensorOrder,
    small: &GgufFile,
    seed: u64,
    arch: SynthArch,
    n_expert: u64,
) {
    match order {
        TensorOrder::Exec => {}
        TensorOrder::File => file_order(small, tensors),
        TensorOrder::Alphabetical => tensors.sort_by(|a, b| a.name.cmp(&b.name)),
        TensorOrder::Shuffled => tensors.shuffle(&mut rand::rngs::SmallRng::seed_from_u64(seed)),
        TensorOrder::Hf => hf_order::sort(tensors, arch, n_expert),
    }
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
