//! `hyperoffload compare` of a program that fails: the report is written and names the
//! failed runs, and compare exits non-zero; a rerun into the same directory leaves
//! none of the previous pager run's files. Needs root (cgroups, tracefs,
//! drop_caches); one run per side of `false`, so each test takes about a second.

mod common;

use common::out_dir;

use std::path::Path;
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_hyperoffload");

fn is_root() -> bool {
    // SAFETY: geteuid(2) has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    if !root && std::env::var("HYPEROFFLOAD_ALLOW_SKIP").as_deref() == Ok("1") {
        eprintln!("skipped: compare needs root (memory cgroups, tracefs, drop_caches)");
        return false;
    }
    assert!(
        root,
        "compare needs root (memory cgroups, tracefs, drop_caches)"
    );
    true
}

fn compare_false(out: &Path) -> std::process::Output {
    let model = out.join("model.gguf");
    std::fs::write(&model, vec![0u8; 1 << 20]).unwrap();
    Command::new(BIN)
        .args(["compare", "--budget", "50%", "--runs", "1", "--model"])
        .arg(&model)
        .arg("--out")
        .arg(out)
        .args(["--", "false"])
        .output()
        .expect("start hyperoffload")
}

#[test]
fn compare_of_a_failing_program_writes_the_report_and_exits_non_zero() {
    if !is_root() {
        return;
    }
    let out = out_dir("compare-failing");
    std::fs::create_dir_all(&out).unwrap();
    let output = compare_false(&out);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "compare exited 0: {stderr}");
    for run in ["kernel run 1 (exit 1", "pager run 1 (exit 1"] {
        assert!(stderr.contains(run), "{run} not named: {stderr}");
    }
    let markdown = std::fs::read_to_string(out.join("report.md")).expect("report.md");
    assert!(markdown.contains("**Failed runs"), "{markdown}");
    assert!(out.join("report.json").is_file());
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn a_rerun_leaves_none_of_the_previous_pager_run_s_files() {
    if !is_root() {
        return;
    }
    let out = out_dir("compare-rerun");
    std::fs::create_dir_all(&out).unwrap();
    // What a previous pager run left: its stats, its fault trace and the shim's
    // events beside the trace. `false` maps no model, so this run writes none of them.
    let stale = [
        "run-pager-1.stats.json",
        "run-pager-1.faults.csv",
        "run-pager-1.faults.csv.events.jsonl",
    ];
    for file in stale {
        std::fs::write(out.join(file), "from the previous run\n").unwrap();
    }
    compare_false(&out);
    for file in stale {
        assert!(
            !out.join(file).exists(),
            "{file} left from the previous run"
        );
    }
    let _ = std::fs::remove_dir_all(&out);
}
