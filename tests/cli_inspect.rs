//! `hyperoffload inspect` on SmolLM2: the summary for people, and the same as JSON for
//! scripts.

mod common;

use std::process::Command;

fn inspect(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_hyperoffload"))
        .arg("inspect")
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn inspect_prints_the_model_for_people_and_as_json() {
    let Some(model) = common::test_model() else {
        return;
    };
    let model = model.to_str().unwrap();
    let text = inspect(&[model]);
    assert!(text.status.success());
    let text = String::from_utf8(text.stdout).unwrap();
    // The graph's source in words, and no table of equal ranks for a dense model.
    assert!(
        text.contains("(llama-family execution order, from the GGUF tensor names)"),
        "{text}"
    );
    assert!(!text.contains("Architecture("), "{text}");
    assert!(text.contains("every node ranks the same"), "{text}");

    let json = inspect(&[model, "--json", "--tensors"]);
    assert!(json.status.success());
    let json: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    let tensors = json["tensors"].as_u64().unwrap();
    assert_eq!(
        json["tensor_table"].as_array().unwrap().len() as u64,
        tensors
    );
    assert_eq!(json["graph"]["block_size"], 2 << 20);
    assert!(json["graph"]["source"].as_str().unwrap().contains("llama"));
    let layers: u64 = (json["layers"].as_array().unwrap().iter())
        .map(|layer| layer["tensors"].as_u64().unwrap())
        .sum();
    assert_eq!(layers, tensors);
    let weights: u64 = (json["kinds"].as_array().unwrap().iter())
        .map(|kind| kind["bytes"].as_u64().unwrap())
        .sum();
    assert_eq!(weights, json["weights_bytes"].as_u64().unwrap());
    assert!(json["order"].as_array().unwrap().len() > 100);
    assert!(json["experts"].is_null());
    // --dot and --json are two different outputs.
    let both = inspect(&[model, "--json", "--dot"]);
    let stderr = String::from_utf8_lossy(&both.stderr);
    assert!(!both.status.success());
    assert!(
        stderr.contains("'--dot' cannot be used with '--json'")
            || stderr.contains("'--json' cannot be used with '--dot'"),
        "{stderr}"
    );
}
