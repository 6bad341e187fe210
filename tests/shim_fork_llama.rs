//! Two forked llama.cpp decoders of one model under `hyperoffload run --budget 50%`
//! (SmolLM2-135M), as it runs by default (zero copy until the fork, which makes the
//! regions inheritable) and with `--serve-forks` (file-shaped from the start):
//! tests/victims/fork_decode.c loads the model with mmap, forks, and each child greedily
//! decodes the same prompt (llama.cpp's own binaries do not fork). Each child's text is
//! the unforked plain run's, and two children in step read about what one reads, within
//! one budget.

mod common;
mod shim_support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use common::TempDir;
use shim_support::llama::{from_script, llama_and_model};
use shim_support::*;

const TOKENS: &str = "16";
const PROMPT: &str = "The capital of France is";

/// tools/build-fork-decode.sh's binary, compiled into `dir` against llama.cpp's
/// static libraries in `bin`'s build tree.
fn fork_decoder(dir: &Path, bin: &Path) -> PathBuf {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tools/build-fork-decode.sh");
    let output = Command::new("bash")
        .arg(script)
        .arg(dir)
        .env("LLAMA_BIN_DIR", bin)
        .stderr(Stdio::inherit())
        .output()
        .unwrap();
    assert_success(&output, "building fork_decode");
    PathBuf::from(stdout(&output).lines().last().unwrap().trim())
}

/// `fork_decode MODEL TOKENS PROCS 1 STEP PROMPT`, under `launcher_args` if any.
fn decode(decoder: &Path, model: &Path, procs: u32, step: &str, launcher_args: &[&str]) -> Output {
    let mut command = if launcher_args.is_empty() {
        Command::new(decoder)
    } else {
        let mut command = Command::new("timeout");
        command
            .arg("300")
            .arg(LAUNCHER)
            .env("HYPEROFFLOAD_SHIM", shim())
            .arg("run")
            .args(launcher_args)
            .arg("--")
            .arg(decoder);
        command
    };
    command
        .arg(model)
        .args([TOKENS, &procs.to_string(), "1", step, PROMPT])
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

/// The children's texts, in child order.
fn texts(output: &Output, procs: u32) -> Vec<String> {
    let seen = stdout(output);
    let mut texts: Vec<(u32, String)> = seen
        .lines()
        .filter_map(|line| {
            let rest = line.strip_prefix("child ")?;
            let (who, text) = rest.split_once(": ")?;
            Some((who.parse().ok()?, text.to_string()))
        })
        .collect();
    texts.sort();
    assert_eq!(texts.len(), procs.max(1) as usize, "{seen}");
    texts.into_iter().map(|(_, text)| text).collect()
}

struct Setup {
    _dir: TempDir,
    decoder: PathBuf,
    model: PathBuf,
    /// The unforked run's text, without the pager.
    plain: String,
}

fn setup(name: &str) -> Option<Setup> {
    let (bin, model) = llama_and_model()?;
    // build-llama.sh prints the bin dir it checked; prefer it when it is this one.
    let bin = from_script("build-llama.sh").unwrap_or(bin);
    let dir = TempDir::new(name);
    let decoder = fork_decoder(&dir.path("build"), &bin);
    // A private copy: files the pager writes beside a model stay in this directory.
    let copy = dir.path("model.gguf");
    std::fs::copy(&model, &copy).unwrap();
    let output = decode(&decoder, &copy, 0, "token", &[]);
    assert_success(&output, "plain decode");
    let plain = texts(&output, 0).remove(0);
    assert!(plain.contains("Paris"), "{plain}");
    Some(Setup {
        _dir: dir,
        decoder,
        model: copy,
        plain,
    })
}

/// `--serve-forks` as the launcher runs by default.
const BY_DEFAULT: &str = "--serve-forks=at-fork";
/// File-shaped from the start.
const FROM_THE_START: &str = "--serve-forks";

/// `procs` forked decoders under `forks --budget 50%`: their texts are the plain run's,
/// and the stats say they were served within the budget. Returns the bytes read.
fn served(setup: &Setup, forks: &str, procs: u32, step: &str) -> u64 {
    let stats = setup._dir.path(&format!("stats-{procs}-{step}.json"));
    let stats_arg = stats.to_str().unwrap();
    let output = decode(
        &setup.decoder,
        &setup.model,
        procs,
        step,
        &[forks, "--budget", "50%", "--stats", stats_arg],
    );
    assert_success(&output, "served decode");
    for text in texts(&output, procs) {
        assert_eq!(text, setup.plain, "{}", stderr(&output));
    }
    let json = read_stats(&stats);
    assert_eq!(json["serve_forks"], true, "{json}");
    // By default, blocks were mapped from frames until the fork made them inheritable.
    assert_eq!(json["zero_copy"], forks == BY_DEFAULT, "{json}");
    assert_eq!(json["forked_children"], procs, "{json}");
    assert!(json["child_faults"].as_u64().unwrap() > 0, "{json}");
    let budget = json["budget_bytes"].as_u64().unwrap();
    let block = json["block_size"].as_u64().unwrap();
    assert!(
        json["peak_resident_bytes"].as_u64().unwrap() <= budget + block,
        "{json}"
    );
    assert_eq!(
        json["child_fill_bytes"], 0,
        "no child outlived the parent: {json}"
    );
    json["bytes_read"].as_u64().unwrap()
}

#[test]
fn two_forked_llama_decoders_print_the_plain_text_and_read_about_what_one_reads() {
    let Some(setup) = setup("fork-llama") else {
        return;
    };
    // In step layer by layer: the two read each layer's weights at the same time.
    let one = served(&setup, BY_DEFAULT, 1, "layer");
    let two = served(&setup, BY_DEFAULT, 2, "layer");
    eprintln!("bytes read, in step by layer: one decoder {one}, two {two}");
    assert!(
        two as f64 <= 1.2 * one as f64,
        "two decoders read {two} bytes, one {one}"
    );
}

#[test]
fn two_forked_llama_decoders_in_step_by_token_print_the_plain_text() {
    let Some(setup) = setup("fork-llama-token") else {
        return;
    };
    // Only a token apart at most: correct text, within the budget; what they read is
    // printed (preload/README.md has the figures), not bounded.
    let one = served(&setup, FROM_THE_START, 1, "token");
    let two = served(&setup, FROM_THE_START, 2, "token");
    eprintln!("bytes read, in step by token: one decoder {one}, two {two}");
}
