//! The mixtures of experts people run, as `hyperoffload synth --arch` writes them
//! (issue 42): each loads and decodes in unmodified llama.cpp under its own
//! architecture (llama.cpp refuses a file with a tensor its loader does not claim, or
//! without one it needs), `inspect` names the architecture and cuts each expert's
//! slice where llama.cpp's tensor shapes put it, and the greedy text under the pager at
//! a quarter of the model is the text without it, within the budget. gpt-oss's experts
//! are MXFP4, as released; glm4moe and deepseek2 have a shared expert and a dense first
//! layer, which `inspect` reports, deepseek2 its latent attention; every file is in the
//! order Hugging Face conversion writes.
//!
//! The binaries and the small model come from tools/build-llama.sh and
//! tools/fetch-model.sh, as for the other llama tests.

#![allow(
    clippy::too_many_lines,
    reason = "an end-to-end scenario reads best top to bottom, as its steps run"
)]

mod common;
mod shim_support;

use std::path::Path;
use std::process::Command;

use common::TempDir;
use hyperoffload::model::gguf::GgufFile;
use shim_support::llama::*;
use shim_support::*;

const EXPERTS: u64 = 16;
const USED: u64 = 2;

fn hyperoffload() -> Command {
    Command::new(env!("CARGO_BIN_EXE_hyperoffload"))
}

/// A model to write: its architecture, size, weight types (`--type`) and the types its
/// experts come out in.
struct Case {
    arch: &'static str,
    size: &'static str,
    weight_types: &'static str,
    expert_types: &'static [&'static str],
}

impl Case {
    /// A Q8_0 model of about 192 MiB (18 layers) whose experts are `expert_type`.
    fn q8_0(arch: &'static str, expert_types: &'static [&'static str]) -> Case {
        Case {
            arch,
            size: "192M",
            weight_types: "Q8_0",
            expert_types,
        }
    }
}

/// Writes the mixture of experts `case` describes, like `small`, in Hugging Face's
/// tensor order.
fn synth_arch(small: &Path, model: &Path, case: &Case) {
    let mut synth = hyperoffload();
    synth
        .args(["synth", "--like"])
        .arg(small)
        .args(["--size", case.size, "--type", case.weight_types])
        .args(["--arch", case.arch]);
    if let [expert_type] = case.expert_types {
        synth.args(["--expert-type", expert_type]);
    }
    let arch = case.arch;
    let synth = synth
        // Hugging Face's order: layers 0, 1, 10, 11..., inside a layer the experts
        // before the attention (gpt-oss: every layer's experts first).
        .args(["--order", "hf"])
        // Fine-grained experts, as both families have: more layers (18) in the size.
        .args(["--expert-ff-ratio", "0.5"])
        .args(["--experts", &EXPERTS.to_string()])
        .args(["--experts-used", &USED.to_string()])
        .arg("--out")
        .arg(model)
        .output()
        .unwrap();
    assert_success(&synth, &format!("synth --arch {arch}"));
}

/// `inspect --json` names `arch`, and its routed experts are exactly the merged expert
/// tensors' bytes, `EXPERTS` a layer, as llama.cpp's shapes (ne2 = experts) give them.
fn check_inspect(model: &Path, case: &Case) {
    let arch = case.arch;
    let gguf = GgufFile::open(model).unwrap();
    assert_eq!(gguf.architecture(), Some(arch));
    let position = |name: &str| gguf.tensors.iter().position(|t| t.name == name).unwrap();
    if gguf.get_u64(&format!("{arch}.block_count")) > Some(10) {
        assert!(position("blk.10.attn_output.weight") < position("blk.2.attn_output.weight"));
    }
    assert!(position("blk.2.ffn_down_exps.weight") < position("blk.2.attn_output.weight"));
    let experts_key = format!("{arch}.expert_count");
    assert_eq!(gguf.get_u64(&experts_key), Some(EXPERTS), "{experts_key}");
    let mut merged_bytes = 0;
    let mut types_seen = std::collections::BTreeSet::new();
    for tensor in gguf
        .tensors
        .iter()
        .filter(|t| t.name.ends_with("_exps.weight"))
    {
        assert!(
            case.expert_types.contains(&tensor.ggml_type.name()),
            "{}: {}",
            tensor.name,
            tensor.ggml_type.name()
        );
        assert_eq!(tensor.dims.len(), 3, "{}: {:?}", tensor.name, tensor.dims);
        assert_eq!(
            tensor.dims[2], EXPERTS,
            "{}: {:?}",
            tensor.name, tensor.dims
        );
        merged_bytes += tensor.ggml_type.tensor_bytes(&tensor.dims).unwrap();
        types_seen.insert(tensor.ggml_type.name());
    }
    assert!(
        merged_bytes > 0,
        "no merged expert tensors in the {arch} file"
    );
    let types_expected: std::collections::BTreeSet<&str> =
        case.expert_types.iter().copied().collect();
    assert_eq!(types_seen, types_expected, "the experts' types");
    let inspect = hyperoffload()
        .arg("inspect")
        .arg(model)
        .arg("--json")
        .output()
        .unwrap();
    assert_success(&inspect, "inspect --json");
    let json: serde_json::Value = serde_json::from_str(&stdout(&inspect)).unwrap();
    assert_eq!(json["architecture"], arch, "{json}");
    assert_eq!(json["experts"]["per_layer"], EXPERTS, "{json}");
    assert_eq!(json["experts"]["used_per_token"], USED, "{json}");
    assert_eq!(json["experts"]["routed_bytes"], merged_bytes, "{json}");
    // Every tensor the architecture adds has its place in a layer, not after it.
    let order: Vec<&str> = json["order"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|step| step.as_str())
        .collect();
    let position = |name: &str| order.iter().position(|step| step.starts_with(name));
    // Layer 1: glm4moe's and deepseek2's first layer is dense.
    let first_expert = position("blk.1.ffn_gate_exps").unwrap_or_else(|| panic!("{order:?}"));
    let added: &[&str] = match arch {
        "qwen3moe" => &["blk.1.attn_q_norm", "blk.1.attn_k_norm"],
        "gpt-oss" => &["blk.1.attn_sinks", "blk.1.post_attention_norm"],
        "glm4moe" => &["blk.1.attn_q.bias", "blk.1.post_attention_norm"],
        _ => &["blk.1.attn_q_a", "blk.1.attn_kv_a_mqa", "blk.1.attn_k_b"],
    };
    for name in added {
        let at = position(name).unwrap_or_else(|| panic!("{name} not in {order:?}"));
        assert!(
            at < first_expert,
            "{name} at {at}, after the experts: {order:?}"
        );
    }
    // The router's score bias goes with the router, before the experts; the shared
    // expert, which every token runs, after them; a dense first layer has no experts.
    if matches!(arch, "glm4moe" | "deepseek2") {
        let bias = position("blk.1.exp_probs_b").unwrap_or_else(|| panic!("{order:?}"));
        let shared = position("blk.1.ffn_down_shexp").unwrap_or_else(|| panic!("{order:?}"));
        assert!(bias < first_expert && shared > first_expert, "{order:?}");
        assert_eq!(json["experts"]["shared_per_layer"], 1, "{json}");
        assert_eq!(
            json["experts"]["dense_layers"],
            serde_json::json!([0]),
            "{json}"
        );
        assert!(position("blk.0.ffn_gate_exps").is_none(), "{order:?}");
        assert!(position("blk.0.ffn_down").is_some(), "{order:?}");
    } else {
        assert_eq!(
            json["experts"]["dense_layers"],
            serde_json::json!([]),
            "{json}"
        );
    }
}

fn same_text_under_the_pager(case: Case) {
    let arch = case.arch;
    let Some((bin, small)) = llama_and_model() else {
        return;
    };
    let dir = TempDir::new(&format!("synth-arch-{arch}"));
    let model = dir.path("moe.gguf");
    synth_arch(&small, &model, &case);
    check_inspect(&model, &case);

    let completion = bin.join("llama-completion");
    let args = greedy_completion_args(&model, 24);
    // llama.cpp loads a file by its `general.architecture` and refuses one whose
    // tensors are not exactly what that architecture's loader claims.
    let plain = Command::new(&completion).args(&args).output().unwrap();
    assert_success(&plain, &format!("llama-completion on the {arch} model"));
    let expected = stdout(&plain);
    assert!(!expected.trim().is_empty(), "no text from the {arch} model");

    let stats = dir.path("stats.json");
    let paged = launcher()
        .args(["--budget", "25%", "--stats"])
        .arg(&stats)
        .arg("--")
        .arg(&completion)
        .args(&args)
        .output()
        .unwrap();
    assert_success(&paged, &format!("{arch} under the pager"));
    assert_eq!(
        stdout(&paged),
        expected,
        "{arch}: different text under the pager"
    );
    let json = read_stats(&stats);
    let model_size = std::fs::metadata(&model).unwrap().len();
    let budget = json["budget_bytes"].as_u64().unwrap();
    assert!(budget <= model_size / 4 + (4 << 20), "{json}");
    assert!(
        json["peak_resident_bytes"].as_u64().unwrap() <= budget,
        "{json}"
    );
    // The model was paged, not read once: a quarter of it cannot hold a pass.
    assert!(json["bytes_read"].as_u64().unwrap() > model_size, "{json}");
    // The experts' blocks are watched (whether a watch fires in a run of 24 tokens
    // depends on timing: prefetch may have every expert in before it is touched).
    // Experts' own count: resident embedding rows are watched too.
    assert!(
        json["expert_watches"]["asked"].as_u64().unwrap() > 0,
        "experts not watched: {json}"
    );
}

#[test]
fn a_qwen3moe_model_decodes_the_same_text_under_the_pager() {
    same_text_under_the_pager(Case::q8_0("qwen3moe", &["Q8_0"]));
}

#[test]
fn a_qwen3moe_model_in_q4_k_m_decodes_the_same_text_under_the_pager() {
    // K-quant blocks are 256 weights: the smallest model like SmolLM2 is 2304 wide,
    // about 600 MiB in 6 layers. Q4_K_M gives a third of the layers' down projections,
    // experts included, Q6_K: their slices differ from the other experts'.
    same_text_under_the_pager(Case {
        arch: "qwen3moe",
        size: "600M",
        weight_types: "Q4_K_M",
        expert_types: &["Q4_K", "Q6_K"],
    });
}

#[test]
fn a_glm4moe_model_with_a_shared_expert_and_a_dense_layer_decodes_the_same_text_under_the_pager() {
    same_text_under_the_pager(Case::q8_0("glm4moe", &["Q8_0"]));
}

#[test]
fn a_deepseek2_model_with_latent_attention_decodes_the_same_text_under_the_pager() {
    same_text_under_the_pager(Case::q8_0("deepseek2", &["Q8_0"]));
}

#[test]
fn a_gpt_oss_model_with_mxfp4_experts_decodes_the_same_text_under_the_pager() {
    // An MXFP4 expert's slice (17 bytes per 32 weights) is no whole number of pages.
    same_text_under_the_pager(Case::q8_0("gpt-oss", &["MXFP4"]));
}
