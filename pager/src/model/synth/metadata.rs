//! The metadata of a synthetic model: the small model's keys, with the dimensions,
//! parameter count, file type and architecture of the new one.

use super::arch::SynthArch;
use super::plan::LlamaShape;
use crate::model::ggml_type::GgmlType;
use crate::model::gguf::{GgufFile, GgufValue};

/// Writes `value` with the integer type `like` had, so readers expecting u32 get u32.
pub(super) fn same_type(like: Option<&GgufValue>, value: u64) -> GgufValue {
    match like {
        Some(GgufValue::U64(_)) => GgufValue::U64(value),
        Some(GgufValue::I32(_)) => GgufValue::I32(value as i32),
        Some(GgufValue::I64(_)) => GgufValue::I64(value as i64),
        _ => GgufValue::U32(value as u32),
    }
}

fn size_label(n_params: u64) -> String {
    match n_params {
        n if n >= 1_000_000_000 => format!("{:.1}B", n as f64 / 1e9),
        n => format!("{}M", n / 1_000_000),
    }
}

/// llama.cpp's `LLAMA_FTYPE_MOSTLY_*` for a model whose weights are all `ty`.
pub(super) fn llama_file_type(ty: GgmlType) -> Option<u64> {
    Some(match ty.name() {
        "Q4_0" => 2,
        "Q4_1" => 3,
        "Q8_0" => 7,
        "Q5_0" => 8,
        "Q5_1" => 9,
        "Q2_K" => 10,
        "Q6_K" => 18,
        _ => return None,
    })
}

pub(super) fn metadata(
    small: &GgufFile,
    shape: &LlamaShape,
    n_params: u64,
    arch: SynthArch,
) -> Vec<(String, GgufValue)> {
    let mut overrides: Vec<(&str, u64)> = vec![
        ("llama.block_count", shape.n_layer),
        ("llama.embedding_length", shape.n_embd),
        ("llama.feed_forward_length", shape.n_ff),
        ("llama.attention.head_count", shape.n_head),
        ("llama.attention.head_count_kv", shape.n_head_kv),
    ];
    if shape.n_expert > 0 {
        overrides.push(("llama.expert_count", shape.n_expert));
        overrides.push(("llama.expert_used_count", shape.n_expert_used));
    }
    let mut out: Vec<(String, GgufValue)> = small
        .metadata
        .iter()
        .map(|(key, value)| {
            let new = match overrides.iter().find(|(k, _)| k == key) {
                Some((_, v)) => same_type(Some(value), *v),
                None => match key.as_str() {
                    "general.name" => GgufValue::string(format!(
                        "{} (synthetic {})",
                        value.as_str().unwrap_or("model"),
                        size_label(n_params)
                    )),
                    "general.size_label" => GgufValue::string(size_label(n_params)),
                    "general.architecture" => GgufValue::string(arch.name()),
                    _ => value.clone(),
                },
            };
            (key.clone(), new)
        })
        .collect();
    for &(key, v) in &overrides {
        if small.get(key).is_none() {
            out.push((key.to_string(), GgufValue::U32(v as u32)));
        }
    }
    for key in ["llama.rope.dimension_count"] {
        if small.get(key).is_none() {
            out.push((key.to_string(), GgufValue::U32(shape.head_dim as u32)));
        }
    }
    // Another architecture reads the same keys under its own name.
    let prefix = format!("{}.", arch.name());
    for (key, _) in &mut out {
        if let Some(rest) = key.strip_prefix("llama.") {
            *key = format!("{prefix}{rest}");
        }
    }
    for (key, value) in arch.extra_metadata(shape) {
        match out.iter_mut().find(|(k, _)| *k == key) {
            Some((_, old)) => *old = value,
            None => out.push((key, value)),
        }
    }
    out
}
