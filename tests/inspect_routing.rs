//! `hyperoffload inspect --trace`: how a mixture of experts' router picks experts from
//! token to token (`graph::routing_stats`). The faults of a demand trace are cut into
//! tokens as the graph policy cuts them; end to end, a synthetic mixture decoded by
//! llama-bench under `run --policy demand --trace` gives a hit curve at all five shares.

mod common;
mod shim_support;

use std::path::Path;
use std::process::{Command, Stdio};

use common::TempDir;
use hyperoffload::geometry::BlockGeometry;
use hyperoffload::graph::routing_stats::token_expert_sets;
use hyperoffload::graph::ModelGraph;
use hyperoffload::model::TensorInfo;
use shim_support::llama::llama_and_model;
use shim_support::{assert_success, launcher, stdout, LAUNCHER};

const BLOCK: u64 = 4096;

/// Two layers of 8 experts, each expert's slice of each expert tensor one block; a
/// layer's blocks: attn_norm, the router, then gate, up and down, 8 blocks each.
fn two_layers_of_experts() -> ModelGraph {
    let mut tensors = Vec::new();
    let mut at = 0;
    for layer in 0..2 {
        for (kind, blocks) in [
            ("attn_norm", 1),
            ("ffn_gate_inp", 1),
            ("ffn_gate_exps", 8),
            ("ffn_up_exps", 8),
            ("ffn_down_exps", 8),
        ] {
            let len = blocks * BLOCK;
            tensors.push(TensorInfo {
                name: format!("blk.{layer}.{kind}.weight"),
                dtype: "F32".into(),
                // Outermost first: the expert, for the expert tensors.
                shape: if blocks == 8 {
                    vec![8, 32, 32]
                } else {
                    vec![1024]
                },
                file_range: at..at + len,
            });
            at += len;
        }
    }
    ModelGraph::from_tensors(&tensors, BlockGeometry::new(0, at, BLOCK).unwrap())
}

/// The block of layer `layer`'s expert `expert` in its gate (`tensor` 0), up or down.
fn expert_block(layer: u32, tensor: u32, expert: u32) -> u32 {
    layer * 26 + 2 + tensor * 8 + expert
}

#[test]
fn faults_are_cut_into_tokens_where_the_layer_goes_down() {
    let graph = two_layers_of_experts();
    let faults = [
        // Token 0: a dense block, expert 1 (gate, then up: one use), 3, then layer 1.
        (0, Some(8)),
        (expert_block(0, 0, 1), Some(8)),
        (expert_block(0, 1, 1), Some(8)),
        (expert_block(0, 2, 3), None),
        (26, Some(0)),
        (expert_block(1, 0, 2), Some(8)),
        // Token 1: back in layer 0.
        (expert_block(0, 0, 1), Some(8)),
        (expert_block(1, 2, 5), Some(8)),
        // Token 2.
        (expert_block(0, 0, 3), Some(8)),
        (expert_block(1, 0, 2), Some(8)),
    ];
    let sets = token_expert_sets(&graph, faults);
    assert_eq!(sets.layers, [0, 1]);
    assert_eq!(sets.experts_per_layer, 8);
    assert_eq!(
        sets.tokens,
        [
            vec![vec![1, 3], vec![2]],
            vec![vec![1], vec![5]],
            vec![vec![3], vec![2]],
        ]
    );
    let stats = sets.stats().unwrap();
    assert_eq!((stats.tokens, stats.layers), (3, 2));
    // Layer 0: token 1 reuses token 0's expert 1, token 2 nothing of token 1's (0.5);
    // layer 1 never repeats the previous token (0).
    let same = stats.consecutive.same.unwrap();
    assert_eq!((same.min, same.max), (0.0, 0.5));
    assert!(token_expert_sets(&graph, [(0, None), (26, None)])
        .tokens
        .is_empty());
}

/// The LRU hit rate printed for each share, in order.
fn lru_curve(text: &str) -> Vec<(String, f64)> {
    text.lines()
        .filter(|line| line.starts_with("| ") && line.contains(" % | "))
        .filter_map(|line| {
            let cells: Vec<&str> = line.split('|').map(str::trim).collect();
            let rate = cells.get(3)?.split_whitespace().next()?.parse().ok()?;
            Some((cells[1].to_string(), rate))
        })
        .collect()
}

/// Synth, record, inspect: a router that picks independently of the previous token (its
/// popularity uneven, so above the share but far from real routers' 0.96 at 55 %).
#[test]
fn inspect_prints_the_routing_of_a_recorded_trace() {
    let Some((bin, small)) = llama_and_model() else {
        return;
    };
    let dir = TempDir::new("inspect-routing");
    let (model, trace) = (dir.path("moe.gguf"), dir.path("trace.csv"));
    let synth = Command::new(LAUNCHER)
        .args(["synth", "--like"])
        .arg(&small)
        .args(["--size", "384M", "--type", "Q8_0", "--experts", "16"])
        .args(["--experts-used", "2", "--router-skew", "0", "--out"])
        .arg(&model)
        .output()
        .unwrap();
    assert_success(&synth, "synth --experts");
    let record = launcher()
        .args([
            "--policy", "demand", "--block", "2M", "--budget", "16M", "--trace",
        ])
        .arg(&trace)
        .arg("--")
        .arg(bin.join("llama-bench"))
        .arg("-m")
        .arg(&model)
        .args(["-p", "0", "-n", "16", "-t", "2", "-r", "1", "--repack", "0"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_success(&record, "run --policy demand --trace");
    let text = inspect(&model, &trace, &[]);
    assert!(text.contains("## routing"), "{text}");
    let curve = lru_curve(&text);
    let shares: Vec<&str> = curve.iter().map(|(share, _)| share.as_str()).collect();
    assert_eq!(shares, ["5 %", "12 %", "20 %", "36 %", "55 %"], "{text}");
    // An LRU cache holding more of each layer hits at least as often.
    assert!(curve.windows(2).all(|w| w[0].1 <= w[1].1), "{text}");
    let at_55 = curve[4].1;
    assert!((0.3..=0.95).contains(&at_55), "at 55 %: {at_55}\n{text}");
    assert!(text.contains("consecutive tokens: "), "{text}");

    let json: serde_json::Value = serde_json::from_str(&inspect(&model, &trace, &["--json"]))
        .expect("inspect --json prints JSON");
    let stats = &json["routing"]["stats"];
    assert!(stats["tokens"].as_u64().unwrap() >= 16, "{stats}");
    assert_eq!(stats["caches"].as_array().unwrap().len(), 5, "{stats}");
    let json_55 = stats["caches"][4]["lru"]["mean"].as_f64().unwrap();
    assert!((json_55 - at_55).abs() < 0.001, "{json_55} against {at_55}");
}

fn inspect(model: &Path, trace: &Path, extra: &[&str]) -> String {
    let output = Command::new(LAUNCHER)
        .arg("inspect")
        .arg(model)
        .arg("--trace")
        .arg(trace)
        .args(extra)
        .output()
        .unwrap();
    assert_success(&output, "inspect --trace");
    stdout(&output)
}
