//! With no `--budget` (`auto`), the pager's budget follows memory pressure: a memory
//! hog starts beside a program reading a model under `hyperoffload run` in one memory
//! cgroup, allocating and touching memory in steps until it holds 60 % of the limit,
//! then frees it and exits. A fixed budget of half the cgroup would not fit beside the
//! hog (the pager's frames cannot be reclaimed by the kernel, so the OOM killer would
//! end one of them); the following budget gives memory back as the hog takes it, and
//! takes it again once the hog is gone.
//!
//! The same with llama-completion decoding a 1 GiB model beside the hog: the text is
//! the plain run's and tokens keep coming while the hog holds its memory.
//!
//! No timing is asserted: how fast the budget fell is a figure for
//! `tools/pressure-bench.sh`, how fast decoding recovered one for
//! `tools/pressure-decode.sh`. The waits are bounded only so that a hang fails.

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

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::TempDir;
use shim_support::llama;
use shim_support::*;

const MIB: u64 = 1 << 20;
/// The cgroup's limit.
const LIMIT: u64 = 1024 * MIB;
/// The model: bigger than any budget the cgroup allows, so the pager evicts throughout.
const MODEL: u64 = 768 * MIB;
/// What the hog takes at most: 60 % of the limit, in steps of `HOG_STEP`.
const HOG: u64 = LIMIT / 10 * 6;
const HOG_STEP: u64 = 32 * MIB;

/// Reads the file through one mapping, pass after pass, printing each pass's sha256,
/// until the file named second exists.
const READ_UNTIL_STOPPED: &str = r#"
import sys, os, mmap, hashlib
with open(sys.argv[1], "rb") as f:
    m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
passes = 0
while passes == 0 or not os.path.exists(sys.argv[2]):
    h = hashlib.sha256()
    for at in range(0, len(m), 1 << 20):
        h.update(m[at:at + (1 << 20)])
    print(h.hexdigest(), flush=True)
    passes += 1
"#;

/// Allocates `argv[1]` bytes in steps of `argv[2]`, touching every page, pausing
/// `argv[3]` seconds between steps; holds it all as long again, then frees it.
const HOG_SCRIPT: &str = r#"
import sys, time
total, step, pause = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
held = []
while sum(len(b) for b in held) < total:
    b = bytearray(step)
    b[::4096] = b"\x01" * len(range(0, step, 4096))
    held.append(b)
    time.sleep(pause)
time.sleep(pause * 4)
print(sum(len(b) for b in held))
held.clear()
"#;

fn cgroup_or_skip(name: &str) -> Option<cgroup::MemoryCgroup> {
    cgroup_of_or_skip(name, LIMIT)
}

fn cgroup_of_or_skip(name: &str, limit: u64) -> Option<cgroup::MemoryCgroup> {
    match cgroup::MemoryCgroup::create(name, Some(limit)) {
        Ok(cgroup) => Some(cgroup),
        Err(error) if skip_allowed() => {
            eprintln!("skipped: {error}");
            None
        }
        Err(error) => panic!("{error} (HYPEROFFLOAD_ALLOW_SKIP=1 skips this test)"),
    }
}

/// Runs `command` in `cgroup` (it moves itself there before exec).
fn in_cgroup(command: &mut Command, cgroup: &cgroup::MemoryCgroup) {
    join_cgroup_at_exec(command, cgroup.procs_file().unwrap());
}

/// What the cgroup holds now (v1 `memory.usage_in_bytes`, v2 `memory.current`).
fn usage(cgroup: &cgroup::MemoryCgroup) -> u64 {
    let file = match cgroup.version() {
        cgroup::CgroupVersion::V1 => "memory.usage_in_bytes",
        cgroup::CgroupVersion::V2 => "memory.current",
    };
    let text = std::fs::read_to_string(cgroup.dir().join(file)).unwrap();
    text.trim().parse().unwrap()
}

/// OOM kills in the cgroup (v1 `memory.oom_control`, v2 `memory.events`).
fn oom_kills(cgroup: &cgroup::MemoryCgroup) -> u64 {
    let file = match cgroup.version() {
        cgroup::CgroupVersion::V1 => "memory.oom_control",
        cgroup::CgroupVersion::V2 => "memory.events",
    };
    let text = std::fs::read_to_string(cgroup.dir().join(file)).unwrap();
    hyperoffload::budget::memory_pressure::stat_field(&text, "oom_kill").unwrap()
}

/// Waits until `done`, failing after `limit` with `what`.
fn wait_for(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !done() {
        assert!(Instant::now() < deadline, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The budget's values over the run, from the stats' `budget_history`.
fn budget_history(stats: &serde_json::Value) -> Vec<u64> {
    (stats["budget_history"].as_array().unwrap().iter())
        .map(|point| point["bytes"].as_u64().unwrap())
        .collect()
}

/// The budget fell to `floor` or below (what the hog left), and after its lowest rose
/// to more than twice that again.
fn assert_fell_below_and_grew_back(history: &[u64], floor: u64) {
    let lowest = *history.iter().min().unwrap();
    let lowest_at = history.iter().position(|&bytes| bytes == lowest).unwrap();
    assert!(lowest <= floor, "never below {floor}: {history:?}");
    assert!(
        history[lowest_at..].iter().any(|&bytes| bytes > 2 * lowest),
        "never grew back: {history:?}"
    );
}

fn sha256_of(path: &Path) -> String {
    let output = Command::new(python())
        .args([
            "-c",
            "import sys, hashlib; print(hashlib.sha256(open(sys.argv[1], 'rb').read()).hexdigest())",
        ])
        .arg(path)
        .output()
        .unwrap();
    assert_success(&output, "sha256");
    stdout(&output).trim().to_string()
}

#[test]
fn the_budget_gives_memory_back_to_a_hog_and_takes_it_again_after() {
    let Some(cgroup) = cgroup_or_skip(&format!("hyperoffload-test-hog-{}", std::process::id()))
    else {
        return;
    };
    let dir = TempDir::new("launcher-pressure");
    let model = dir.path("model.gguf");
    common::pattern_file(&model, MODEL);
    let expected = sha256_of(&model);
    let stop = dir.path("stop");
    let stats = dir.path("stats.json");

    let mut victim = launcher();
    victim
        .arg("--stats")
        .arg(&stats)
        .arg("--")
        .arg(python())
        .args(["-c", READ_UNTIL_STOPPED])
        .arg(&model)
        .arg(&stop)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    in_cgroup(&mut victim, &cgroup);
    let victim = victim.spawn().unwrap();

    // The pager fills its budget: more than half the cgroup.
    let victim_alive = |victim_pid: u32| !common::process_ended(victim_pid as i32);
    wait_for(
        "the pager filling its budget",
        Duration::from_secs(120),
        || {
            assert!(victim_alive(victim.id()), "the victim ended early");
            usage(&cgroup) > LIMIT / 2
        },
    );
    let before_hog = usage(&cgroup);

    let mut hog = Command::new(python());
    hog.args(["-c", HOG_SCRIPT])
        .args([HOG.to_string(), HOG_STEP.to_string(), "0.2".to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    in_cgroup(&mut hog, &cgroup);
    let hog = hog.spawn().unwrap().wait_with_output().unwrap();
    assert_success(&hog, "the hog");
    assert_eq!(
        stdout(&hog).trim(),
        HOG.next_multiple_of(HOG_STEP).to_string()
    );

    // The hog is gone: the pager takes the memory again, more than the hog left it.
    wait_for("the pager growing back", Duration::from_secs(120), || {
        assert!(
            victim_alive(victim.id()),
            "the victim ended while growing back"
        );
        usage(&cgroup) > LIMIT - HOG
    });
    std::fs::write(&stop, b"").unwrap();
    let output = wait_within(victim, Duration::from_secs(120))
        .unwrap_or_else(|output| panic!("the victim did not stop: {}", stderr(&output)));
    assert_success(&output, "the victim under the pager");
    assert_eq!(oom_kills(&cgroup), 0, "nobody is OOM-killed");

    // Every pass read the file's bytes.
    let text = stdout(&output);
    let passes: Vec<&str> = text.lines().collect();
    assert!(passes.len() >= 2, "{passes:?}");
    assert!(passes.iter().all(|pass| *pass == expected), "{passes:?}");

    // The budget fell below what the hog left and rose again.
    let json = read_stats(&stats);
    let history = budget_history(&json);
    let start = history[0];
    assert!(start > LIMIT / 2, "started at {start}: {history:?}");
    assert_fell_below_and_grew_back(&history, LIMIT - HOG);
    assert!(before_hog > LIMIT / 2);
    assert!(cgroup.peak_bytes().unwrap() <= LIMIT);
    drop(cgroup);
}

/// The llama test's cgroup: a 1 GiB model and llama.cpp's own buffers (a context of 512
/// tokens) fit in it beside nothing; beside a hog of 60 % a fixed budget of the model
/// would not.
const LLAMA_LIMIT: u64 = 1536 * MIB;
const LLAMA_HOG: u64 = LLAMA_LIMIT / 10 * 6;
/// Tokens generated: enough that the decode outlasts the hog and its aftermath.
const LLAMA_TOKENS: u32 = 256;
/// Tokens written before the hog starts.
const TOKENS_BEFORE_HOG: usize = 16;

/// llama-completion decoding a 1 GiB model under `hyperoffload run` (no `--budget`)
/// while a hog takes 60 % of their cgroup and then exits: nobody is OOM-killed, tokens
/// keep coming beside the hog, the budget falls below what the hog leaves and grows back
/// after it, and the text is the plain run's. No rate is asserted (that is
/// `tools/pressure-decode.sh`'s figure).
#[test]
fn llama_decodes_beside_a_hog_and_its_budget_comes_back() {
    let Some((bin, small)) = llama::llama_and_model() else {
        return;
    };
    let Some(cgroup) = cgroup_of_or_skip(
        &format!("hyperoffload-test-llama-hog-{}", std::process::id()),
        LLAMA_LIMIT,
    ) else {
        return;
    };
    let dir = TempDir::new("launcher-pressure-llama");
    let model = dir.path("model.gguf");
    let synth = Command::new(LAUNCHER)
        .args(["synth", "--like"])
        .arg(&small)
        .args(["--size", "1G", "--type", "Q8_0", "--out"])
        .arg(&model)
        .output()
        .unwrap();
    assert_success(&synth, "synth");
    // A small context: the program's KV cache is charged to the cgroup too.
    let mut args = llama::greedy_completion_args(&model, LLAMA_TOKENS);
    args.extend(["-c".to_string(), "512".to_string()]);
    let completion = bin.join("llama-completion");
    let plain = Command::new(&completion)
        .args(&args)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_success(&plain, "the plain run");

    let stats = dir.path("stats.json");
    let mut victim = launcher();
    victim
        .arg("--stats")
        .arg(&stats)
        .arg("--")
        .arg(&completion)
        .args(&args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    in_cgroup(&mut victim, &cgroup);
    let mut victim = victim.spawn().unwrap();
    // Each write of the program's output, with its time: a token each, or a few.
    let writes = std::sync::Arc::new(std::sync::Mutex::new(Vec::<(Instant, Vec<u8>)>::new()));
    let reader = {
        let writes = std::sync::Arc::clone(&writes);
        let mut out = victim.stdout.take().unwrap();
        std::thread::spawn(move || {
            let mut buffer = [0u8; 1 << 16];
            loop {
                match std::io::Read::read(&mut out, &mut buffer) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => writes
                        .lock()
                        .unwrap()
                        .push((Instant::now(), buffer[..n].to_vec())),
                }
            }
        })
    };
    let victim_pid = victim.id() as i32;
    wait_for("the first tokens", Duration::from_secs(180), || {
        assert!(
            !common::process_ended(victim_pid),
            "the program ended before the hog"
        );
        writes.lock().unwrap().len() >= TOKENS_BEFORE_HOG
    });

    let hog_start = Instant::now();
    let mut hog = Command::new(python());
    hog.args(["-c", HOG_SCRIPT])
        .args([
            LLAMA_HOG.to_string(),
            HOG_STEP.to_string(),
            "0.3".to_string(),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    in_cgroup(&mut hog, &cgroup);
    let hog = hog.spawn().unwrap().wait_with_output().unwrap();
    let hog_end = Instant::now();
    assert_success(&hog, "the hog");
    assert!(
        !common::process_ended(victim_pid),
        "the program ended beside the hog: make LLAMA_TOKENS larger"
    );

    let output = wait_within(victim, Duration::from_secs(300))
        .unwrap_or_else(|output| panic!("the program did not finish: {}", stderr(&output)));
    reader.join().unwrap();
    assert_success(&output, "llama-completion under the pager beside the hog");
    assert_eq!(oom_kills(&cgroup), 0, "nobody is OOM-killed");
    let writes = writes.lock().unwrap();
    let text: Vec<u8> = writes.iter().flat_map(|(_, bytes)| bytes.clone()).collect();
    assert_eq!(
        String::from_utf8_lossy(&text),
        stdout(&plain),
        "the text differs from the plain run's"
    );
    let beside = (writes.iter())
        .filter(|(at, _)| (hog_start..hog_end).contains(at))
        .count();
    assert!(beside > 0, "no token while the hog held its memory");

    let json = read_stats(&stats);
    let history = budget_history(&json);
    assert_fell_below_and_grew_back(&history, LLAMA_LIMIT - LLAMA_HOG);
    assert!(cgroup.peak_bytes().unwrap() <= LLAMA_LIMIT);
    eprintln!(
        "{} writes, {beside} beside the hog ({:.1} s); budget history {history:?}",
        writes.len(),
        (hog_end - hog_start).as_secs_f64()
    );
    drop(cgroup);
}

/// `--min` and `--max` bound `auto`: with a fixed budget, or crossed, they are refused
/// before the program runs.
#[test]
fn min_and_max_are_refused_where_they_bound_nothing() {
    let dir = TempDir::new("launcher-pressure-bounds");
    let marker = dir.path("ran");
    for (args, problem) in [
        (
            &["--budget", "1G", "--max", "2G"][..],
            "bound --budget auto",
        ),
        (
            &["--min", "2G", "--max", "1G"][..],
            "--min is more than --max",
        ),
    ] {
        let output = launcher()
            .args(args)
            .arg("--")
            .arg("touch")
            .arg(&marker)
            .output()
            .unwrap();
        assert!(!output.status.success(), "{args:?} accepted");
        assert!(!marker.exists(), "{args:?}: the program ran");
        assert!(
            stderr(&output).contains(problem),
            "{args:?}: {}",
            stderr(&output)
        );
    }
}

/// `--max` bounds where `auto` starts and how far it grows; `--min` how far it falls.
#[test]
fn max_and_min_bound_the_following_budget() {
    let dir = TempDir::new("launcher-pressure-max");
    let model = dir.path("model.gguf");
    common::pattern_file(&model, 96 * MIB);
    let expected = sha256_of(&model);
    let stop = dir.path("stop");
    std::fs::write(&stop, b"").unwrap();
    let stats = dir.path("stats.json");
    let output = launcher()
        .args(["--max", "32M", "--min", "16M", "--stats"])
        .arg(&stats)
        .arg("--")
        .arg(python())
        .args(["-c", READ_UNTIL_STOPPED])
        .arg(&model)
        .arg(&stop)
        .output()
        .unwrap();
    assert_success(&output, "the reader under --max 32M");
    assert_eq!(stdout(&output).trim(), expected);
    let json = read_stats(&stats);
    let history: Vec<u64> = (json["budget_history"].as_array().unwrap().iter())
        .map(|point| point["bytes"].as_u64().unwrap())
        .collect();
    assert_eq!(history[0], 32 * MIB, "{history:?}");
    assert!(
        history
            .iter()
            .all(|&bytes| (16 * MIB..=32 * MIB).contains(&bytes)),
        "{history:?}"
    );
    assert!(json["peak_resident_bytes"].as_u64().unwrap() <= 32 * MIB);
}
