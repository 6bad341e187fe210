//! Planning a synthetic llama model: from the small model it is shaped like and what
//! was asked for, its shape (how wide and how deep, so that the file comes out near the
//! requested size), its tensors, their order and its metadata. The steps are
//! submodules: reading the small model (`small_model`), its tensor roles (`roles`),
//! the sizing (`sizing`) of a shape (`shape`), the tensors (`tensors`) and their order
//! (`order`); `moe` is what a mixture of experts asks for, and the metadata is
//! `metadata`'s.

mod moe;
mod order;
mod roles;
mod shape;
mod sizing;
mod small_model;
mod tensors;

use std::collections::HashMap;
use std::io;

use super::arch::SynthArch;
use super::fill::Fill;
use super::metadata::{llama_file_type, metadata, same_type};
use super::mix::QuantMix;
use super::router::{self, ContextAttention, RouterLocality};
use super::{SynthError, TensorOrder};
use crate::model::ggml_type::GgmlType;
use crate::model::gguf::{GgufFile, GgufValue, GgufWriter, NewTensor};
pub use moe::MoeSpec;
pub(super) use roles::Role;
use roles::{expert_layer, retype_experts, retype_quantized};
pub use shape::{LatentAttention, LlamaShape};
use sizing::choose_shape;
use small_model::small_model;
use tensors::tensors_in_exec_order;

/// What to make: everything but the small model it is shaped like.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SynthRequest {
    /// Approximate size of the file in bytes.
    pub target: u64,
    pub order: TensorOrder,
    pub seed: u64,
    /// The type of every quantized weight, in place of the small model's.
    pub weight_type: Option<GgmlType>,
    /// A recipe of types per tensor (Q4_K_M), in place of `weight_type`.
    pub mix: Option<QuantMix>,
    /// The type of the merged expert tensors alone (after `weight_type`), as released
    /// mixtures of experts have theirs (gpt-oss: MXFP4 experts, the rest 8-bit).
    pub expert_type: Option<GgmlType>,
    /// Experts in place of dense feed-forward networks.
    pub moe: Option<MoeSpec>,
    /// The architecture written (llama: the small model's).
    pub arch: SynthArch,
}

/// Everything needed to write the synthetic model.
#[derive(Debug, Clone)]
pub struct SynthPlan {
    pub shape: LlamaShape,
    pub metadata: Vec<(String, GgufValue)>,
    /// In file order.
    pub tensors: Vec<NewTensor>,
    /// How each tensor is filled, by name.
    pub fills: HashMap<String, Fill>,
    pub alignment: u64,
    /// Size of the finished file.
    pub file_len: u64,
    pub n_params: u64,
}

/// Plans a llama model of about `target` bytes shaped like `small`.
pub fn plan(
    small: &GgufFile,
    target: u64,
    order: TensorOrder,
    seed: u64,
) -> Result<SynthPlan, SynthError> {
    plan_with_weight_type(small, target, order, seed, None)
}

/// As `plan`, with every quantized weight of type `weight_type` instead of the small
/// model's types (norms stay as they are): e.g. a Q8_0 model from a Q4_1 one.
pub fn plan_with_weight_type(
    small: &GgufFile,
    target: u64,
    order: TensorOrder,
    seed: u64,
    weight_type: Option<GgmlType>,
) -> Result<SynthPlan, SynthError> {
    plan_request(
        small,
        &SynthRequest {
            target,
            order,
            seed,
            weight_type,
            mix: None,
            expert_type: None,
            moe: None,
            arch: SynthArch::Llama,
        },
    )
}

/// Plans the model `request` describes, shaped like `small`.
pub fn plan_request(small: &GgufFile, request: &SynthRequest) -> Result<SynthPlan, SynthError> {
    let (small_shape, globals, layer) = requested_roles(small, request)?;
    let shape = planned_shape(small, request, &small_shape, &globals, &layer)?;
    let n_params = shape.n_params(&globals, &layer);

    let context = request
        .moe
        .and_then(|moe| moe.locality)
        .map(|locality| context_attention(small, &shape, locality))
        .transpose()?;
    let (mut tensors, fills) =
        tensors_in_exec_order(&shape, &globals, &layer, request.moe, context);
    for tensor in &tensors {
        if let Some(what) = fills.get(&tensor.name) {
            router::check_type(&tensor.name, tensor.ggml_type, what)?;
        }
    }
    order::sort(
        &mut tensors,
        request.order,
        small,
        request.seed,
        request.arch,
        shape.n_expert,
    );

    let metadata = labelled_metadata(small, &shape, n_params, request);
    // The exact size, from laying out the header without writing it anywhere.
    let file_len =
        GgufWriter::new(io::sink(), &metadata, tensors.clone(), small.alignment)?.file_len();
    Ok(SynthPlan {
        shape,
        metadata,
        tensors,
        fills,
        alignment: small.alignment,
        file_len,
        n_params,
    })
}

/// The small model's shape and tensor roles, made those of the model `request` asks
/// for before it is sized: experts in place of the dense network, the architecture's
/// tensors, and the types asked for.
fn requested_roles(
    small: &GgufFile,
    request: &SynthRequest,
) -> Result<(LlamaShape, Vec<Role>, Vec<Role>), SynthError> {
    let &SynthRequest {
        weight_type,
        mix,
        expert_type,
        moe,
        arch,
        ..
    } = request;
    if let (Some(_), Some(_)) = (weight_type, mix) {
        return Err(SynthError::Unsupported(
            "a weight type and a quantization mix: give one".into(),
        ));
    }
    let weight_type = weight_type.or(mix.map(QuantMix::base_type));
    let (mut small_shape, mut globals, mut layer) = small_model(small)?;
    arch.check(moe.as_ref())?;
    if let Some(moe) = moe {
        moe.check()?;
        expert_layer(&mut layer, small_shape.n_layer as usize);
        small_shape.n_expert = moe.experts;
        small_shape.n_expert_used = moe.used;
        small_shape.n_expert_shared = arch.shared_experts();
    }
    arch.adapt_roles(&mut globals, &mut layer, small_shape.n_layer as usize);
    if let Some(weight_type) = weight_type {
        retype_quantized(weight_type, &mut globals, &mut layer)?;
    }
    if let Some(mix) = mix {
        mix.apply(&mut globals, &mut layer);
    }
    if let Some(expert_type) = expert_type {
        if moe.is_none() {
            return Err(SynthError::Unsupported(
                "an expert type without experts: give --experts".into(),
            ));
        }
        retype_experts(expert_type, &mut layer)?;
    }
    arch.fall_back_types(&mut layer, small_shape.head_dim);
    Ok((small_shape, globals, layer))
}

/// The shape of the model `request` asks for, of roles `globals` and `layer`: its data
/// sized near the target less the header, then as deep, and with as many dense leading
/// layers, as its architecture has them.
fn planned_shape(
    small: &GgufFile,
    request: &SynthRequest,
    small_shape: &LlamaShape,
    globals: &[Role],
    layer: &[Role],
) -> Result<LlamaShape, SynthError> {
    // The header: metadata as in the small model, plus about 100 bytes per tensor.
    let header_guess = small
        .data_offset
        .saturating_sub(small.tensors.len() as u64 * 64);
    let mut shape = choose_shape(
        small_shape,
        globals,
        layer,
        request.target.saturating_sub(header_guess),
        small.alignment,
        request.moe.and_then(|moe| moe.ff_ratio),
    )?;
    shape.n_layer = request.arch.depth(shape.n_layer);
    shape.n_layer_dense_lead = request.arch.dense_lead(shape.n_layer);
    Ok(shape)
}

/// The planned model's metadata (`metadata`), its file type that of the types asked
/// for, if any.
fn labelled_metadata(
    small: &GgufFile,
    shape: &LlamaShape,
    n_params: u64,
    request: &SynthRequest,
) -> Vec<(String, GgufValue)> {
    let mut metadata = metadata(small, shape, n_params, request.arch);
    if let Some(file_type) = file_type(request) {
        // llama.cpp labels the model by it (llama-bench's "Q8_0").
        if let Some((_, value)) = metadata.iter_mut().find(|(k, _)| k == "general.file_type") {
            *value = same_type(Some(value), file_type);
        }
    }
    metadata
}

/// `general.file_type` for the types `request` asks for: as llama-quantize labels a
/// model of them; `None` keeps the small model's.
fn file_type(request: &SynthRequest) -> Option<u64> {
    match request.expert_type {
        // LLAMA_FTYPE_MOSTLY_MXFP4_MOE, as llama-quantize labels gpt-oss's.
        Some(GgmlType::Mxfp4) => Some(38),
        _ => match request.mix {
            Some(mix) => Some(mix.file_type()),
            None => request.weight_type.and_then(llama_file_type),
        },
    }
}

/// What a locality router's tensors are built for: `shape`, and the small model's
/// rotary base (its RoPE angles; a model that rescales them is refused).
fn context_attention(
    small: &GgufFile,
    shape: &LlamaShape,
    locality: RouterLocality,
) -> Result<ContextAttention, SynthError> {
    if small.get("llama.rope.scaling.type").is_some() || small.tensor("rope_freqs.weight").is_some()
    {
        return Err(SynthError::Locality(
            "the model rescales its rotary angles, which the recency windows are built on".into(),
        ));
    }
    let narrow = |n: u64| u32::try_from(n).map_err(|_| SynthError::Unsupported(format!("{n}")));
    Ok(ContextAttention {
        locality,
        n_embd: narrow(shape.n_embd)?,
        n_head: narrow(shape.n_head)?,
        n_head_kv: narrow(shape.n_head_kv)?,
        head_dim: narrow(shape.head_dim)?,
        rope_base: small
            .get("llama.rope.freq_base")
            .and_then(|v| v.as_f64())
            .unwrap_or(10_000.0) as f32,
    })
}
