//! The tensors of a planned model in llama's execution order, and how each is filled.

use std::collections::HashMap;

use super::super::fill::Fill;
use super::super::router::{self, ContextAttention};
use super::moe::MoeSpec;
use super::roles::{dense_layer, layer_type, Role};
use super::shape::LlamaShape;
use crate::model::ggml_type::GgmlType;
use crate::model::gguf::NewTensor;

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
const GLOBAL_EXEC_ORDER: &[&str] = &[
    "token_embd.weight",
    "rope_freqs.weight",
    "output_norm.weight",
    "output.weight",
];

/// The token embedding's element spread in a model whose routers have affinity.
const AFFINE_EMBEDDING_STD: f32 = 4.0;

/// The tensors of a model of `shape` in execution order (globals before the layers,
/// the layers, the rest), and how each is filled.
pub(super) fn tensors_in_exec_order(
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
        let what = locality.unwrap_or_else(|| plain_fill(role, layer, &dims, shape, moe));
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

/// How a tensor of `role` in layer `layer`, of `dims`, is filled where no locality
/// router's attention says otherwise.
fn plain_fill(
    role: &str,
    layer: u32,
    dims: &[u64],
    shape: &LlamaShape,
    moe: Option<MoeSpec>,
) -> Fill {
    if role.contains("norm") || role.starts_with("rope_freqs") {
        Fill::Constant(1.0)
    } else if role == "attn_sinks.weight" {
        // A sink logit of 0: the softmax's denominator gains exp(0), as an extra key
        // with a score of 0 would give.
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
    }
}
