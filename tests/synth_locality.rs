//! Issue 41: `synth --router-locality` makes a mixture of experts whose routing inside
//! unmodified llama.cpp follows the text, as real routers' does. Plain English (the
//! GPL's text, which every Debian machine has) is decoded one token at a time by
//! llama-perplexity (`-b 1 -ub 1`) under `hyperoffload run --policy demand` with a
//! budget far below a token's reads, so every expert a token uses faults and the trace
//! shows each token's experts per layer. On that trace the locality model reuses the
//! previous tokens' experts (a small per-layer LRU cache hits often, and more often
//! than one keeping the most used so far, as on real routers), where the default
//! router's picks are held up by popularity alone.

mod common;
mod shim_support;

use std::path::Path;
use std::process::{Command, Stdio};

use common::TempDir;
use shim_support::llama::llama_and_model;
use shim_support::{assert_success, launcher, stdout};

/// Plain English text of a package every Debian system has (base-files).
const TEXT: &str = "/usr/share/common-licenses/GPL-3";
/// Tokens decoded per model: llama-perplexity's context, one chunk of it.
const TOKENS: &str = "128";

/// A Q8_0 mixture of 128 fine-grained experts (8 used, Qwen3-MoE's numbers) like
/// `small`, with `router` as its `--router-locality` (3 layers: 160 MiB).
fn synth(small: &Path, model: &Path, router: &str) {
    let output = Command::new(env!("CARGO_BIN_EXE_hyperoffload"))
        .args(["synth", "--like"])
        .arg(small)
        .args(["--size", "160M", "--type", "Q8_0", "--experts", "128"])
        .args(["--experts-used", "8", "--expert-ff-ratio", "0.25"])
        .args(["--router-locality", router, "--out"])
        .arg(model)
        .output()
        .unwrap();
    assert_success(&output, "synth");
}

/// Decodes `TEXT` one token at a time on `model` under the demand pager, recording its
/// faults to `trace`; returns what llama-perplexity printed.
fn decode(bin: &Path, model: &Path, trace: &Path) -> String {
    let output = launcher()
        .args([
            "--policy", "demand", "--block", "2M", "--budget", "16M", "--trace",
        ])
        .arg(trace)
        .arg("--")
        .arg(bin.join("llama-perplexity"))
        .arg("-m")
        .arg(model)
        .args([
            "-f", TEXT, "-c", TOKENS, "--chunks", "1", "-b", "1", "-ub", "1",
        ])
        .args(["-t", "2", "--no-repack"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_success(&output, "llama-perplexity under the pager");
    stdout(&output)
}

/// The routing statistics `hyperoffload inspect --trace` reads off a demand trace.
#[derive(Debug)]
struct Routing {
    tokens: u64,
    /// Mean over layers of the LRU and the LFU hit rate at 5 % and 12 % of a layer's
    /// experts (a token's experts looked up as it found the cache).
    lru: [f64; 2],
    lfu: [f64; 2],
    /// The share of a token's experts the previous token used, and what independent
    /// picks with each layer's popularity would give.
    same: f64,
    same_by_chance: f64,
}

fn routing(trace: &Path, model: &Path) -> Routing {
    let output = Command::new(env!("CARGO_BIN_EXE_hyperoffload"))
        .arg("inspect")
        .arg(model)
        .arg("--trace")
        .arg(trace)
        .arg("--json")
        .output()
        .unwrap();
    assert_success(&output, "inspect --trace");
    let json: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    let stats = &json["routing"]["stats"];
    let mean = |value: &serde_json::Value| value["mean"].as_f64().unwrap();
    let cache = |i: usize, eviction: &str| mean(&stats["caches"][i][eviction]);
    Routing {
        tokens: stats["tokens"].as_u64().unwrap(),
        lru: [cache(0, "lru"), cache(1, "lru")],
        lfu: [cache(0, "lfu"), cache(1, "lfu")],
        same: mean(&stats["consecutive"]["same"]),
        same_by_chance: mean(&stats["consecutive"]["same_by_chance"]),
    }
}

#[test]
fn a_locality_router_reuses_recent_experts_on_real_text_in_llama_cpp() {
    let Some((bin, small)) = llama_and_model() else {
        return;
    };
    let dir = TempDir::new("synth-locality");
    let (local, independent) = (dir.path("local.gguf"), dir.path("independent.gguf"));
    synth(&small, &local, "qwen3");
    synth(&small, &independent, "off");
    let local_run = decode(&bin, &local, &dir.path("local.csv"));
    let routed = routing(&dir.path("local.csv"), &local);
    decode(&bin, &independent, &dir.path("independent.csv"));
    let default = routing(&dir.path("independent.csv"), &independent);
    eprintln!("locality: {routed:?}\ndefault: {default:?}");
    let tokens: u64 = TOKENS.parse().unwrap();
    for routing in [&routed, &default] {
        assert!(
            (tokens - 2..=tokens + 1).contains(&routing.tokens),
            "the trace told {} tokens apart, not {tokens}: {routing:?}",
            routing.tokens
        );
    }
    // The locality model keeps the last tokens' experts: a small LRU cache hits well
    // above its share (0.05), above the default router's, and above a cache keeping
    // the experts used most so far; consecutive tokens share experts far more often
    // than their popularity explains.
    assert!(routed.lru[0] > 0.2, "{routed:?}");
    assert!(routed.lru[0] > default.lru[0], "{routed:?}\n{default:?}");
    for share in 0..2 {
        assert!(routed.lru[share] > routed.lfu[share] + 0.03, "{routed:?}");
    }
    assert!(routed.same > 1.8 * routed.same_by_chance, "{routed:?}");
    // The default router's picks are held up by popularity alone: frequency wins, and
    // consecutive tokens share what popularity gives.
    assert!(default.lfu[0] > default.lru[0] + 0.03, "{default:?}");
    assert!(default.same < 1.3 * default.same_by_chance, "{default:?}");

    // Finite, and the same without the pager: llama-perplexity's estimate.
    let estimate = |text: &str| {
        text.lines()
            .find(|l| l.starts_with("[1]"))
            .map(str::to_string)
    };
    let first = estimate(&local_run).unwrap_or_else(|| panic!("no estimate: {local_run}"));
    let value: f64 = first[3..].trim_end_matches(',').parse().unwrap();
    assert!(value.is_finite() && value > 1.0, "{first}");
    let again = Command::new(bin.join("llama-perplexity"))
        .arg("-m")
        .arg(&local)
        .args([
            "-f", TEXT, "-c", TOKENS, "--chunks", "1", "-b", "1", "-ub", "1",
        ])
        .args(["-t", "2", "--no-repack"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_success(&again, "llama-perplexity");
    assert_eq!(estimate(&stdout(&again)), Some(first));
}
