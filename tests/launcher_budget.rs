//! `hyperoffload run` checks the budget and block size before the program starts: what
//! the pager could not take is an error (and the program never runs), a budget too
//! small for the pager to make progress in is raised with one line (it used to
//! livelock), and a budget above the machine's or the cgroup's memory is warned of.

mod common;
mod shim_support;

// The memory cgroup `hyperoffload compare` uses, which belongs to the binary: its file
// compiled here.
#[allow(dead_code)]
#[path = "../src/cli/compare/cgroup.rs"]
mod cgroup;

use std::process::{Command, Output, Stdio};
use std::time::Duration;

use common::TempDir;
use shim_support::*;

/// Runs `command` to its end, collecting its output; fails if it runs past `limit` (a
/// livelocked program is killed and reported, never waited out).
fn output_within(command: &mut Command, limit: Duration) -> Output {
    let child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_within(child, limit).unwrap_or_else(|output| {
        panic!(
            "still running after {limit:?} (a livelock?); stderr:\n{}",
            stderr(&output)
        )
    })
}

/// `run ARGS -- touch MARKER`: whether the program ran is whether the marker exists.
fn refused(args: &[&str]) -> String {
    let dir = TempDir::new("launcher-budget-refused");
    let marker = dir.path("ran");
    let output = output_within(
        launcher().args(args).arg("--").arg("touch").arg(&marker),
        Duration::from_secs(30),
    );
    assert!(!output.status.success(), "{args:?} accepted");
    assert!(
        !marker.exists(),
        "{args:?}: the program ran although the settings were refused"
    );
    stderr(&output)
}

/// `--budget 50` meant 50 %: it used to be 50 bytes, and the pager silently did not
/// start (exit status 0).
#[test]
fn a_budget_with_no_unit_and_too_small_for_bytes_is_refused_with_the_percentage_suggested() {
    let message = refused(&["--budget", "50"]);
    assert!(message.contains("`50`"), "{message}");
    assert!(message.contains("`50%`"), "{message}");
}

/// Block sizes the pager cannot take are refused, naming the problem and the accepted
/// forms; a block larger than the budget too (the pager used to refuse to start, and
/// the program ran unpaged with exit status 0).
#[test]
fn block_sizes_the_pager_cannot_take_are_refused_before_the_program_starts() {
    for (args, problem) in [
        (&["--block", "64"][..], "did you mean 64K?"),
        (&["--block", "3M"][..], "not a power of two"),
        (&["--block", "2G"][..], "larger than 1 GiB"),
        (&["--block", "64Q"][..], "64Q"),
    ] {
        let message = refused(args);
        assert!(message.contains(problem), "{args:?}: {message}");
        assert!(message.contains("from 4K to 1G"), "{args:?}: {message}");
    }
    let message = refused(&["--budget", "32M", "--block", "64M"]);
    assert!(
        message.contains("a block of 64.0 MiB does not fit in a budget of 32.0 MiB"),
        "{message}"
    );
}

fn threads_counted() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// A budget below two blocks for each thread faulting at once used to livelock (every
/// load straddling two blocks evicted the block it needed first). It is raised to that
/// floor, with one line, and the program finishes with the file's bytes.
#[test]
fn a_budget_too_small_to_make_progress_in_is_raised_and_the_program_finishes() {
    let dir = TempDir::new("launcher-budget-raise");
    let victim = compile_c(&dir.0, "victim", include_str!("victims/victim.c"));
    let file = dir.path("weights.bin");
    common::pattern_file(&file, 1 << 20);
    let threads = threads_counted().min(4);
    let plain = Command::new(&victim)
        .args(["straddle", file.to_str().unwrap(), &threads.to_string()])
        .output()
        .unwrap();
    assert_success(&plain, "the victim without the pager");
    for budget in ["4K", "8K"] {
        let stats = dir.path(&format!("stats-{budget}.json"));
        let output = output_within(
            launcher()
                .args(["--budget", budget, "--block", "4K", "--min-size", "1M"])
                .args(["--match", "*.bin", "--stats"])
                .arg(&stats)
                .arg("--")
                .arg(&victim)
                .args(["straddle", file.to_str().unwrap(), &threads.to_string()]),
            Duration::from_secs(120),
        );
        assert_success(&output, budget);
        assert_eq!(stdout(&output), stdout(&plain), "{budget}: other bytes");
        let message = stderr(&output);
        let asked: u64 = if budget == "4K" { 4 << 10 } else { 8 << 10 };
        let floor = 2 * 4096 * threads_counted().clamp(1, 64) as u64;
        let stats = read_stats(&stats);
        let raised = message.matches("the pager needs to make progress").count();
        if asked < floor {
            assert_eq!(raised, 1, "{budget}: one line saying so: {message}");
            assert_eq!(stats["budget_bytes"], floor, "{budget}");
        } else {
            assert_eq!(raised, 0, "{budget}: {message}");
            assert_eq!(stats["budget_bytes"], asked, "{budget}");
        }
        assert!(stats["bytes_read"].as_u64().unwrap() >= 1 << 20, "{stats}");
    }
}

fn mem_total() -> u64 {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap();
    let (total, _) = hyperoffload::budget::memory_limits::parse_meminfo(&meminfo);
    total.unwrap()
}

/// `--budget 1T` on a smaller machine was taken silently.
#[test]
fn a_budget_above_the_machines_ram_is_warned_of() {
    let budget = format!("{}M", (mem_total() >> 20) * 4);
    let output = output_within(
        launcher().args(["--budget", &budget, "--", "true"]),
        Duration::from_secs(30),
    );
    assert_success(&output, "a run with a large budget");
    let message = stderr(&output);
    assert!(
        message.contains("warning: the budget of") && message.contains("this machine's RAM"),
        "{message}"
    );
}

/// Within a memory cgroup, a budget above its limit is warned of (a smaller one not).
#[test]
fn a_budget_above_the_cgroups_limit_is_warned_of() {
    let name = format!("hyperoffload-test-budget-{}", std::process::id());
    let cgroup = match cgroup::MemoryCgroup::create(&name, Some(256 << 20)) {
        Ok(cgroup) => cgroup,
        Err(error) if skip_allowed() => {
            eprintln!("skipped: {error}");
            return;
        }
        Err(error) => panic!("{error} (HYPEROFFLOAD_ALLOW_SKIP=1 skips this test)"),
    };
    for (budget, warned) in [("1G", true), ("128M", false)] {
        let mut command = launcher();
        command.args(["--budget", budget, "--", "true"]);
        join_cgroup_at_exec(&mut command, cgroup.procs_file().unwrap());
        let output = output_within(&mut command, Duration::from_secs(30));
        assert_success(&output, budget);
        let message = stderr(&output);
        assert_eq!(
            message.contains("the memory limit of this process's cgroup (256.0 MiB)"),
            warned,
            "{budget}: {message}"
        );
    }
    drop(cgroup);
}

/// Reads a file through one read-only mapping, twice, and prints a checksum.
const READ_TWICE: &str = r#"
import sys, mmap, hashlib
with open(sys.argv[1], "rb") as f:
    m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
h = hashlib.sha256()
for _ in range(2):
    for at in range(0, len(m), 1 << 20):
        h.update(m[at:at + (1 << 20)])
print(h.hexdigest())
"#;

/// The default budget (`auto`) follows the memory cgroup the program runs in: a 512 MiB
/// model read through a 384 MiB cgroup. With the old default (half the machine's RAM)
/// the pager's frames, which the cgroup is charged for and cannot reclaim, outgrew the
/// limit and the program was OOM-killed; now the budget is what the cgroup can still
/// give less a quarter, and the program reads the file's bytes to the end.
#[test]
fn with_no_budget_the_pager_fits_the_memory_cgroup_it_runs_in() {
    let limit: u64 = 384 << 20;
    let name = format!("hyperoffload-test-auto-{}", std::process::id());
    let cgroup = match cgroup::MemoryCgroup::create(&name, Some(limit)) {
        Ok(cgroup) => cgroup,
        Err(error) if skip_allowed() => {
            eprintln!("skipped: {error}");
            return;
        }
        Err(error) => panic!("{error} (HYPEROFFLOAD_ALLOW_SKIP=1 skips this test)"),
    };
    let dir = TempDir::new("launcher-auto-budget");
    let model = dir.path("big.gguf");
    common::pattern_file(&model, 512 << 20);
    let python = python();
    let plain = Command::new(&python)
        .args(["-c", READ_TWICE])
        .arg(&model)
        .output()
        .unwrap();
    assert_success(&plain, "python");
    let stats = dir.path("stats.json");
    let procs = cgroup.procs_file().unwrap();
    let mut command = launcher();
    command
        .arg("--stats")
        .arg(&stats)
        .arg("--")
        .arg(&python)
        .args(["-c", READ_TWICE])
        .arg(&model);
    join_cgroup_at_exec(&mut command, procs);
    let output = output_within(&mut command, Duration::from_secs(300));
    let events = std::fs::read_to_string(cgroup.dir().join("memory.events")).unwrap_or_default();
    assert_success(&output, "python under the pager with no --budget");
    assert_eq!(
        stdout(&output),
        stdout(&plain),
        "different bytes under the pager"
    );
    let json = read_stats(&stats);
    let budget = json["budget_bytes"].as_u64().unwrap();
    assert!(
        budget <= limit / 4 * 3,
        "budget {budget} in a cgroup of {limit}"
    );
    assert!(budget >= 64 << 20, "budget {budget}: too little of {limit}");
    assert_eq!(json["config"]["budget"], "auto");
    assert!(json["bytes_read"].as_u64().unwrap() >= 2 * (512 << 20) - budget);
    assert!(
        !events
            .lines()
            .any(|line| line.starts_with("oom_kill ") && line != "oom_kill 0"),
        "{events}"
    );
    assert!(cgroup.peak_bytes().unwrap() <= limit);
    drop(cgroup);
}
