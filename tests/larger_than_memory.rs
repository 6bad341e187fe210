//! Issue 43: a model larger than the memory the program may use, default flags.
//!
//! Unmodified llama-completion decodes a synthetic mixture of experts two and a half
//! times the size of the memory cgroup it runs in, under `hyperoffload run` with no
//! `--budget`: it is not OOM-killed, it prints the text the plain (kernel mmap) run of
//! the same model prints outside the cgroup, and the cgroup's peak stays below its limit.
//!
//! What makes it pass is the automatic budget following the cgroup: the pager's frames
//! are shared memory, charged to the cgroup and not reclaimable (there is no swap), so a
//! budget taken from the machine's available memory holds the whole model and the cgroup's
//! OOM killer ends the program; a budget of nothing (the headroom rule before issue 43
//! in a cgroup this small) reads the model a few KiB at a time and never finishes.
//! No timing is asserted; the waits are bounded only so that a hang fails.

#![allow(
    clippy::too_many_lines,
    reason = "an end-to-end scenario reads best top to bottom, as its steps run"
)]

mod common;
mod shim_support;

// The memory cgroup `hyperoffload compare` uses, which belongs to the binary: its file
// compiled here.
#[allow(dead_code)]
#[path = "../src/cli/compare/cgroup.rs"]
mod cgroup;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::TempDir;
use shim_support::llama;
use shim_support::*;

const MIB: u64 = 1 << 20;
/// The cgroup's limit: llama.cpp's own memory with a context of 256 tokens (about 40
/// MiB) and the pager's heap fit in it, the model many times over not.
const LIMIT: u64 = 256 * MIB;
/// The model's size as synth takes it: two and a half times the limit.
const MODEL_SIZE: &str = "640M";
/// Tokens generated: a prompt pass and a decode, a few passes over the model's layers.
const TOKENS: u32 = 16;

/// OOM kills in the cgroup (v1 `memory.oom_control`, v2 `memory.events`).
fn oom_kills(cgroup: &cgroup::MemoryCgroup) -> u64 {
    let file = match cgroup.version() {
        cgroup::CgroupVersion::V1 => "memory.oom_control",
        cgroup::CgroupVersion::V2 => "memory.events",
    };
    let text = std::fs::read_to_string(cgroup.dir().join(file)).unwrap();
    hyperoffload::budget::memory_pressure::stat_field(&text, "oom_kill").unwrap()
}

#[test]
fn a_model_larger_than_its_memory_cgroup_decodes_as_the_kernel_does_with_no_budget() {
    let Some((bin, small)) = llama::llama_and_model() else {
        return;
    };
    let cgroup = match cgroup::MemoryCgroup::create(
        &format!("hyperoffload-test-larger-{}", std::process::id()),
        Some(LIMIT),
    ) {
        Ok(cgroup) => cgroup,
        Err(error) if skip_allowed() => {
            eprintln!("skipped: {error}");
            return;
        }
        Err(error) => panic!("{error} (HYPEROFFLOAD_ALLOW_SKIP=1 skips this test)"),
    };
    let dir = TempDir::new("larger-than-memory");
    let model = dir.path("moe.gguf");
    let synth = Command::new(LAUNCHER)
        .args(["synth", "--like"])
        .arg(&small)
        .args(["--size", MODEL_SIZE, "--type", "Q8_0"])
        .args(["--experts", "32", "--experts-used", "4", "--out"])
        .arg(&model)
        .output()
        .unwrap();
    assert_success(&synth, "synth");
    let model_len = std::fs::metadata(&model).unwrap().len();
    assert!(model_len > 2 * LIMIT, "a model of {model_len} bytes");

    // A small context: the program's KV cache is charged to the cgroup too.
    let mut args = llama::greedy_completion_args(&model, TOKENS);
    args.extend(["-c".to_string(), "256".to_string()]);
    let completion = bin.join("llama-completion");
    // The kernel's run, outside the cgroup (in this test's own, unlimited).
    let plain = Command::new(&completion)
        .args(&args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let plain = wait_within(plain, Duration::from_secs(120))
        .unwrap_or_else(|output| panic!("the plain run hung: {}", stderr(&output)));
    assert_success(&plain, "the plain run");
    let expected = stdout(&plain);
    assert!(!expected.trim().is_empty(), "no text from the plain run");

    let stats = dir.path("stats.json");
    let mut paged = launcher();
    paged
        .arg("--stats")
        .arg(&stats)
        .arg("--")
        .arg(&completion)
        .args(&args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    join_cgroup_at_exec(&mut paged, cgroup.procs_file().unwrap());
    let output = wait_within(paged.spawn().unwrap(), Duration::from_secs(180))
        .unwrap_or_else(|output| panic!("the paged run hung: {}", stderr(&output)));
    let kills = oom_kills(&cgroup);
    let peak = cgroup.peak_bytes().unwrap();
    assert_eq!(kills, 0, "OOM-killed: {}", stderr(&output));
    assert_success(&output, "llama-completion under the pager with no --budget");
    assert_eq!(
        stdout(&output),
        expected,
        "the text differs from the kernel's"
    );

    let json = read_stats(&stats);
    assert_eq!(json["config"]["budget"], "auto", "{json}");
    let budget = json["budget_bytes"].as_u64().unwrap();
    let resident = json["peak_resident_bytes"].as_u64().unwrap();
    let bytes_read = json["bytes_read"].as_u64().unwrap();
    eprintln!(
        "model {model_len} bytes in a cgroup of {LIMIT}: budget {budget}, peak resident \
         {resident}, read {bytes_read}, cgroup peak {peak}"
    );
    // The budget came from the cgroup: less than its limit, and enough to page in more
    // than a few blocks (a budget of nothing is raised to a few 4 KiB blocks).
    assert!(budget < LIMIT, "budget {budget} in a cgroup of {LIMIT}");
    assert!(budget >= 32 * MIB, "budget {budget}: too little of {LIMIT}");
    assert!(resident <= budget, "{json}");
    assert!(
        json["faults"].as_u64().unwrap() > 0,
        "nothing served: {json}"
    );
    // The pager read more than its budget could hold: it paged, not just loaded.
    assert!(bytes_read > budget, "{json}");
    assert!(peak < LIMIT, "the cgroup peaked at {peak} of {LIMIT}");
    drop(cgroup);
}
