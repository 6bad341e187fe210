//! Synthetic models made from the real SmolLM2: right size, consistent metadata,
//! valid layout, requested order.

mod common;

use std::collections::HashSet;

use hyperoffload::model::ggml_type::GgmlType;
use hyperoffload::model::gguf::GgufFile;
use hyperoffload::model::synth::{
    self, f16_to_f32, MoeSpec, RouterLocality, SynthArch, SynthError, SynthRequest, TensorOrder,
};

const TARGET: u64 = 64 << 20;

fn small() -> Option<GgufFile> {
    common::test_model().map(|path| GgufFile::open(&path).unwrap())
}

#[test]
fn synth_model_parses_with_consistent_metadata_and_size() {
    let Some(small) = small() else { return };
    let plan = synth::plan(&small, TARGET, TensorOrder::File, 7).unwrap();
    let bytes = synth::write(&plan, Vec::new(), 7, |_| {}).unwrap();
    assert_eq!(bytes.len() as u64, plan.file_len);
    let ratio = bytes.len() as f64 / TARGET as f64;
    assert!(
        (0.9..=1.1).contains(&ratio),
        "size {} vs {TARGET}",
        bytes.len()
    );

    let big = GgufFile::parse(&bytes).unwrap();
    let key = |k: &str| big.get_u64(k).unwrap();
    let s = plan.shape;
    assert_eq!(key("llama.block_count"), s.n_layer);
    assert_eq!(key("llama.embedding_length"), s.n_embd);
    assert_eq!(key("llama.feed_forward_length"), s.n_ff);
    assert_eq!(key("llama.attention.head_count"), s.n_head);
    assert_eq!(key("llama.attention.head_count_kv"), s.n_head_kv);
    assert_eq!(key("llama.rope.dimension_count"), s.n_embd / s.n_head);
    assert_eq!(
        key("llama.context_length"),
        small.get_u64("llama.context_length").unwrap()
    );
    // The tokenizer is copied verbatim.
    for (k, v) in small
        .metadata
        .iter()
        .filter(|(k, _)| k.starts_with("tokenizer."))
    {
        assert_eq!(big.get(k), Some(v), "{k}");
    }
    // Shapes follow the metadata.
    let dims = |name: &str| big.tensor(name).unwrap().dims.clone();
    let kv = s.n_head_kv * (s.n_embd / s.n_head);
    assert_eq!(dims("token_embd.weight"), vec![s.n_embd, 49152]);
    assert_eq!(dims("blk.0.attn_k.weight"), vec![s.n_embd, kv]);
    assert_eq!(
        dims(&format!("blk.{}.ffn_down.weight", s.n_layer - 1)),
        vec![s.n_ff, s.n_embd]
    );
    assert_eq!(big.tensors.len() as u64, 2 + 9 * s.n_layer);
    assert!(big
        .tensor(&format!("blk.{}.attn_q.weight", s.n_layer))
        .is_none());
    // Same types as the small model.
    assert_eq!(
        big.tensor("blk.3.ffn_up.weight").unwrap().ggml_type,
        GgmlType::Q4_1
    );
    assert_eq!(
        big.tensor("token_embd.weight").unwrap().ggml_type,
        GgmlType::Q8_0
    );

    // Tensors are back to back in header order, as ggml requires.
    let mut expect = 0;
    for t in &big.tensors {
        assert_eq!(t.offset, expect, "{}", t.name);
        expect = (t.offset + t.size).next_multiple_of(big.alignment);
    }

    // Valid data: norms are 1.0, Q4_1 scales small and finite.
    let range = big.file_range(big.tensor("blk.0.attn_norm.weight").unwrap());
    let norm = &bytes[range.start as usize..range.end as usize];
    assert!(norm
        .chunks_exact(4)
        .all(|c| f32::from_le_bytes(c.try_into().unwrap()) == 1.0));
    let range = big.file_range(big.tensor("blk.0.attn_q.weight").unwrap());
    for block in bytes[range.start as usize..range.end as usize].chunks_exact(20) {
        let d = f16_to_f32(u16::from_le_bytes([block[0], block[1]]));
        let m = f16_to_f32(u16::from_le_bytes([block[2], block[3]]));
        assert!(
            d.is_finite() && d > 0.0 && d < 0.1 && m.is_finite(),
            "d {d} m {m}"
        );
    }
}

#[test]
fn synth_orders() {
    let Some(small) = small() else { return };
    let names = |order, seed| -> Vec<String> {
        let plan = synth::plan(&small, TARGET, order, seed).unwrap();
        plan.tensors.into_iter().map(|t| t.name).collect()
    };
    let exec = names(TensorOrder::Exec, 0);
    assert_eq!(exec[0], "token_embd.weight");
    assert_eq!(
        exec[1..10].join(" "),
        [
            "blk.0.attn_norm.weight",
            "blk.0.attn_q.weight",
            "blk.0.attn_k.weight",
            "blk.0.attn_v.weight",
            "blk.0.attn_output.weight",
            "blk.0.ffn_norm.weight",
            "blk.0.ffn_gate.weight",
            "blk.0.ffn_up.weight",
            "blk.0.ffn_down.weight",
        ]
        .join(" ")
    );
    assert_eq!(exec.last().map(String::as_str), Some("output_norm.weight"));

    let alpha = names(TensorOrder::Alphabetical, 0);
    let mut sorted = alpha.clone();
    sorted.sort();
    assert_eq!(alpha, sorted);

    // File order: SmolLM2's converter sorted layers by string and used its own order
    // within a layer; the synthetic file does the same.
    let file = names(TensorOrder::File, 0);
    let small_names: Vec<_> = small.tensors.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(file[..10], small_names[..10]);
    let pos = |name: &str| file.iter().position(|n| n == name).unwrap();
    assert!(pos("blk.10.attn_norm.weight") < pos("blk.2.attn_norm.weight"));

    let shuffled = names(TensorOrder::Shuffled, 1);
    assert_ne!(shuffled, exec);
    assert_eq!(shuffled, names(TensorOrder::Shuffled, 1));
    assert_ne!(shuffled, names(TensorOrder::Shuffled, 2));
    for order in [&alpha, &file, &shuffled] {
        let a: HashSet<_> = order.iter().collect();
        let b: HashSet<_> = exec.iter().collect();
        assert_eq!(a, b);
    }
}

#[test]
fn synth_scales_up_wider_and_deeper() {
    let Some(small) = small() else { return };
    for target in [1u64 << 30, 3 << 30, 10 << 30] {
        let plan = synth::plan(&small, target, TensorOrder::Exec, 0).unwrap();
        let ratio = plan.file_len as f64 / target as f64;
        assert!(
            (0.95..=1.05).contains(&ratio),
            "{target}: {} ({ratio})",
            plan.file_len
        );
        assert!(
            plan.shape.n_embd > 576 && plan.shape.n_layer > 30,
            "{target}: {:?}",
            plan.shape
        );
        assert_eq!(plan.shape.n_ff % 32, 0);
    }
    let too_small = synth::plan(&small, 8 << 20, TensorOrder::Exec, 0);
    assert!(matches!(too_small, Err(synth::SynthError::TooSmall { .. })));
}

#[test]
fn a_weight_type_replaces_every_quantized_type_and_the_file_type() {
    let Some(small) = small() else { return };
    let plan =
        synth::plan_with_weight_type(&small, TARGET, TensorOrder::Exec, 1, Some(GgmlType::Q8_0))
            .unwrap();
    let bytes = synth::write(&plan, Vec::new(), 1, |_| {}).unwrap();
    let model = GgufFile::parse(&bytes).unwrap();
    assert!(model
        .tensors
        .iter()
        .all(|t| t.ggml_type == GgmlType::Q8_0 || t.ggml_type == GgmlType::F32));
    assert!(model.tensors.iter().any(|t| t.ggml_type == GgmlType::Q8_0));
    assert_eq!(model.get_u64("general.file_type"), Some(7));
    let error =
        synth::plan_with_weight_type(&small, TARGET, TensorOrder::Exec, 1, Some(GgmlType::F32));
    assert!(
        matches!(error, Err(SynthError::UnsupportedType(GgmlType::F32))),
        "an unquantized weight type is refused: {:?}",
        error.map(|_| ())
    );
}

fn moe_request(target: u64, experts: u64, used: u64, ff_ratio: Option<f64>) -> SynthRequest {
    SynthRequest {
        target,
        order: TensorOrder::File,
        seed: 3,
        weight_type: Some(GgmlType::Q8_0),
        mix: None,
        expert_type: None,
        moe: Some(MoeSpec {
            experts,
            used,
            ff_ratio,
            skew: 2.0,
            affinity: 0.0,
            locality: None,
        }),
        arch: SynthArch::Llama,
    }
}

#[test]
fn a_mixture_of_experts_has_merged_expert_tensors_a_router_and_its_counts() {
    let Some(small) = small() else { return };
    let plan = synth::plan_request(&small, &moe_request(96 << 20, 8, 2, None)).unwrap();
    let bytes = synth::write(&plan, Vec::new(), 3, |_| {}).unwrap();
    let ratio = bytes.len() as f64 / (96u64 << 20) as f64;
    assert!((0.9..=1.1).contains(&ratio), "size {}", bytes.len());
    let model = GgufFile::parse(&bytes).unwrap();
    let s = plan.shape;
    assert_eq!(model.get_u64("llama.expert_count"), Some(8));
    assert_eq!(model.get_u64("llama.expert_used_count"), Some(2));
    assert_eq!(model.get_u64("llama.feed_forward_length"), Some(s.n_ff));
    for i in 0..s.n_layer {
        let dims = |role: &str| {
            model
                .tensor(&format!("blk.{i}.{role}"))
                .map(|t| t.dims.clone())
        };
        assert_eq!(dims("ffn_gate.weight"), None, "no dense feed-forward left");
        assert_eq!(dims("ffn_gate_inp.weight"), Some(vec![s.n_embd, 8]));
        assert_eq!(
            dims("ffn_gate_exps.weight"),
            Some(vec![s.n_embd, s.n_ff, 8])
        );
        assert_eq!(dims("ffn_up_exps.weight"), Some(vec![s.n_embd, s.n_ff, 8]));
        assert_eq!(
            dims("ffn_down_exps.weight"),
            Some(vec![s.n_ff, s.n_embd, 8])
        );
        let router = model
            .tensor(&format!("blk.{i}.ffn_gate_inp.weight"))
            .unwrap();
        assert_eq!(router.ggml_type, GgmlType::F32);
    }
    // Each layer's router favours its own experts: the rows' spreads differ by about
    // e^skew between the widest and the narrowest, in a different order per layer.
    let mut widest = HashSet::new();
    for i in 0..s.n_layer {
        let router = model
            .tensor(&format!("blk.{i}.ffn_gate_inp.weight"))
            .unwrap();
        let start = (model.data_offset + router.offset) as usize;
        let floats: Vec<f32> = bytes[start..start + (s.n_embd * 8 * 4) as usize]
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        let spreads: Vec<f64> = floats
            .chunks_exact(s.n_embd as usize)
            .map(|row| {
                (row.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>() / row.len() as f64).sqrt()
            })
            .collect();
        let max = spreads.iter().cloned().fold(f64::MIN, f64::max);
        let min = spreads.iter().cloned().fold(f64::MAX, f64::min);
        let spread = (max / min).ln();
        assert!(
            (1.7..=2.3).contains(&spread),
            "layer {i}: log spread {spread}"
        );
        widest.insert(spreads.iter().position(|&x| x == max).unwrap());
    }
    assert!(
        s.n_layer < 3 || widest.len() > 1,
        "every layer favours the same expert"
    );
}

#[test]
fn fine_grained_experts_are_narrow_and_bad_expert_counts_are_refused() {
    let Some(small) = small() else { return };
    let coarse = synth::plan_request(&small, &moe_request(1 << 30, 16, 2, None)).unwrap();
    let fine = synth::plan_request(&small, &moe_request(1 << 30, 64, 8, Some(0.5))).unwrap();
    // The feed-forward width is tuned within a factor of two of the asked ratio.
    let ratio = |shape: &synth::LlamaShape| shape.n_ff as f64 / shape.n_embd as f64;
    assert!(
        (0.25..=1.0).contains(&ratio(&fine.shape)),
        "{:?}",
        fine.shape
    );
    assert!(ratio(&coarse.shape) > 1.3, "{:?}", coarse.shape);
    assert_eq!(fine.shape.n_expert, 64);
    assert_eq!(fine.shape.n_expert_used, 8);
    for (experts, used) in [(1, 1), (8, 0), (8, 9), (100_000, 2)] {
        let error = synth::plan_request(&small, &moe_request(1 << 30, experts, used, None))
            .unwrap_err()
            .to_string();
        assert!(error.contains("expert"), "{experts}/{used}: {error}");
    }
}

/// The routers of a model in layer order, as rows of floats.
fn router_rows(
    model: &GgufFile,
    bytes: &[u8],
    layers: u64,
    experts: u64,
    n_embd: u64,
) -> Vec<Vec<Vec<f32>>> {
    (0..layers)
        .map(|i| {
            let router = model
                .tensor(&format!("blk.{i}.ffn_gate_inp.weight"))
                .unwrap();
            let start = (model.data_offset + router.offset) as usize;
            bytes[start..start + (n_embd * experts * 4) as usize]
                .chunks_exact(n_embd as usize * 4)
                .map(|row| {
                    row.chunks_exact(4)
                        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                        .collect()
                })
                .collect()
        })
        .collect()
}

fn correlation(a: &[f32], b: &[f32]) -> f64 {
    let dot = |x: &[f32], y: &[f32]| x.iter().zip(y).map(|(p, q)| f64::from(p * q)).sum::<f64>();
    dot(a, b) / (dot(a, a) * dot(b, b)).sqrt()
}

/// With router affinity every expert's router row has a predecessor in the layer
/// before that it follows by the affinity; without, none. Out-of-range affinities are
/// refused.
#[test]
fn router_affinity_relates_each_layer_to_the_one_before() {
    let Some(small) = small() else { return };
    let request = |affinity: f32| {
        let mut request = moe_request(96 << 20, 8, 2, None);
        if let Some(moe) = request.moe.as_mut() {
            moe.affinity = affinity;
        }
        request
    };
    for (affinity, expected) in [(0.0f32, 0.0f64), (0.7, 0.7)] {
        let plan = synth::plan_request(&small, &request(affinity)).unwrap();
        let bytes = synth::write(&plan, Vec::new(), 3, |_| {}).unwrap();
        let model = GgufFile::parse(&bytes).unwrap();
        let s = plan.shape;
        assert!(s.n_layer >= 2);
        let routers = router_rows(&model, &bytes, s.n_layer, 8, s.n_embd);
        for pair in routers.windows(2) {
            for row in &pair[1] {
                let best = pair[0]
                    .iter()
                    .map(|before| correlation(row, before))
                    .fold(f64::MIN, f64::max);
                assert!(
                    (best - expected).abs() < 0.15,
                    "affinity {affinity}: best correlation {best}"
                );
            }
        }
    }
    for affinity in [-0.1, 1.5, f32::NAN] {
        let error = synth::plan_request(&small, &request(affinity))
            .unwrap_err()
            .to_string();
        assert!(error.contains("router affinity"), "{affinity}: {error}");
    }
}

/// A locality router (issue 41) is written into layer 0's attention: q and k read
/// the embedding's anchor element alone, later layers add no attention output, every
/// embedding row has the same norm; types it cannot write exactly are refused by name.
#[test]
fn router_locality_writes_its_attention_and_refuses_types_it_cannot() {
    let Some(small) = small() else { return };
    let mut request = moe_request(96 << 20, 8, 2, None);
    if let Some(moe) = request.moe.as_mut() {
        moe.locality = Some(RouterLocality::qwen3());
    }
    // Without --type: the small model's Q4_1 attention and Q8_0 embedding.
    for weight_type in [Some(GgmlType::Q8_0), None] {
        request.weight_type = weight_type;
        let plan = synth::plan_request(&small, &request).unwrap();
        let bytes = synth::write(&plan, Vec::new(), 3, |_| {}).unwrap();
        let model = GgufFile::parse(&bytes).unwrap();
        let data = |name: &str| {
            let range = model.file_range(model.tensor(name).unwrap());
            &bytes[range.start as usize..range.end as usize]
        };
        let s = plan.shape;
        let q = model.tensor("blk.0.attn_q.weight").unwrap();
        let row_bytes = q.ggml_type.tensor_bytes(&[s.n_embd]).unwrap() as usize;
        let block = q.ggml_type.type_size() as usize;
        let mut rows_used = 0;
        for row in data("blk.0.attn_q.weight").chunks_exact(row_bytes) {
            // Past the first block (which holds the anchor's weight) all zeros.
            assert!(row[block..].iter().all(|&b| b == 0), "{weight_type:?}");
            rows_used += usize::from(row[..block].iter().any(|&b| b != 0));
        }
        assert!(rows_used > 0, "{weight_type:?}: q reads nothing");
        assert!(data("blk.1.attn_output.weight").iter().all(|&b| b == 0));
        assert!(data("blk.0.attn_output.weight").iter().any(|&b| b != 0));
    }
    // K-quants' blocks of 256 need a wider model (planned only, never written).
    (request.weight_type, request.target) = (Some(GgmlType::Q4K), 512 << 20);
    let error = synth::plan_request(&small, &request)
        .unwrap_err()
        .to_string();
    assert!(error.contains("give --type Q8_0"), "{error}");
    if let Some(moe) = request.moe.as_mut() {
        moe.locality = Some(RouterLocality::with_context(-1.0));
    }
    let error = synth::plan_request(&small, &request)
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("router locality: context weight -1"),
        "{error}"
    );
}

/// The binary never overwrites a file without `--force`, and never its `--like` input
/// (whatever the path names it by), `--force` or not.
#[test]
fn synth_replaces_a_file_only_with_force_and_never_its_input() {
    let Some(like) = common::test_model() else {
        return;
    };
    let dir = common::TempDir::new("synth-force");
    let out = dir.path("big.gguf");
    std::fs::write(&out, b"someone's file").unwrap();
    let synth = |extra: &[&str], out: &std::path::Path| {
        std::process::Command::new(env!("CARGO_BIN_EXE_hyperoffload"))
            .args(["synth", "--size", "64M", "--like"])
            .arg(&like)
            .arg("--out")
            .arg(out)
            .args(extra)
            .output()
            .unwrap()
    };
    let refused = synth(&[], &out);
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("give --force"));
    assert_eq!(std::fs::read(&out).unwrap(), b"someone's file");
    let forced = synth(&["--force"], &out);
    assert!(
        forced.status.success(),
        "{}",
        String::from_utf8_lossy(&forced.stderr)
    );
    GgufFile::open(&out).unwrap();
    // The input by another name (a symlink to it): refused even with --force.
    let alias = dir.path("alias.gguf");
    std::os::unix::fs::symlink(&like, &alias).unwrap();
    let before = std::fs::metadata(&like).unwrap().len();
    let itself = synth(&["--force"], &alias);
    assert!(!itself.status.success());
    assert!(String::from_utf8_lossy(&itself.stderr).contains("the --like model itself"));
    assert_eq!(std::fs::metadata(&like).unwrap().len(), before);
}
