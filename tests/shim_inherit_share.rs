//! `hyperoffload run --inherit`: processes of the run that map the same model share one
//! resident copy and one budget (`hyperoffload::share`). Python children started with
//! `subprocess` (fork+exec) reading a 128 MiB `*.gguf` under a 32 MiB budget, a host
//! child that exits (or is SIGKILLed) while a guest reads, and two llama-completion
//! processes started by a shell.

mod common;
mod shim_support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use common::{pattern_file, TempDir};
use shim_support::llama::{greedy_completion, greedy_completion_args, llama_and_model};
use shim_support::*;

const MODEL_LEN: u64 = 128 << 20;
const BUDGET: u64 = 32 << 20;
const BLOCK: u64 = 2 << 20;
const SCRIPT: &str = include_str!("shim_support/share_victim.py");

/// `hyperoffload run --inherit --budget BUDGET -- program...`, killed after 120 s.
fn run(budget: &str, program: &[&std::ffi::OsStr]) -> Output {
    Command::new("timeout")
        .arg("120")
        .arg(LAUNCHER)
        .env("HYPEROFFLOAD_SHIM", shim())
        .args(["run", "--inherit", "--budget", budget, "--min-size", "1M"])
        .arg("--")
        .args(program)
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

/// The victim script in `mode` with `args`.
fn victim(dir: &TempDir, mode: &str, args: &[&Path]) -> Output {
    let script = dir.path("share_victim.py");
    std::fs::write(&script, SCRIPT).unwrap();
    let python = python();
    let mut program = vec![python.as_os_str(), script.as_os_str(), mode.as_ref()];
    program.extend(args.iter().map(|arg| arg.as_os_str()));
    run("32M", &program)
}

/// Every stats file the run's processes wrote (the victim copied them into `out`).
fn all_stats(out: &Path) -> Vec<serde_json::Value> {
    let mut stats: Vec<PathBuf> = std::fs::read_dir(out)
        .unwrap()
        .flatten()
        .map(|entry| entry.path())
        .filter(|path| {
            path.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("stats.json")
        })
        .collect();
    stats.sort();
    stats.iter().map(|path| read_stats(path)).collect()
}

/// The stats of the one pager of a run (the victim copied them into `out`), which one
/// guest attached to and sent faults.
fn one_pager_with_one_guest(out: &Path) -> serde_json::Value {
    let mut stats = all_stats(out);
    assert_eq!(stats.len(), 1, "one pager for both: {stats:?}");
    let host = stats.remove(0);
    assert_eq!(host["guests"], 1, "{host}");
    assert!(host["guest_faults"].as_u64().unwrap() > 0, "{host}");
    host
}

fn model(dir: &TempDir) -> PathBuf {
    let model = dir.path("m.gguf");
    pattern_file(&model, MODEL_LEN);
    model
}

#[test]
fn two_children_reading_one_model_in_step_read_it_once_within_one_budget() {
    let dir = TempDir::new("share-two");
    let model = model(&dir);
    let out = dir.path("out");
    std::fs::create_dir(&out).unwrap();
    let output = victim(&dir, "two", &[&model, &out]);
    assert_success(&output, "two readers");
    let seen = stdout(&output);
    let want = sha256(&model);
    for role in ["a", "b"] {
        assert!(
            seen.contains(&format!("hash {role} {want}")),
            "{seen}\n{}",
            stderr(&output)
        );
    }
    let stats = all_stats(&out);
    assert!(!stats.is_empty(), "no stats: {}", stderr(&output));
    let read: u64 = stats
        .iter()
        .map(|json| json["bytes_read"].as_u64().unwrap())
        .sum();
    let guests: u64 = stats
        .iter()
        .map(|json| json["guests"].as_u64().unwrap())
        .sum();
    assert_eq!(
        guests, 1,
        "one child attached to the other's pager: {stats:?}"
    );
    assert_eq!(stats.len(), 1, "one pager for both: {stats:?}");
    assert!(
        read as f64 <= 1.2 * MODEL_LEN as f64,
        "read {read} bytes for a {MODEL_LEN}-byte file: {stats:?}"
    );
    let host = &stats[0];
    assert!(host["guest_faults"].as_u64().unwrap() > 0, "{host}");
    let peak = host["peak_resident_bytes"].as_u64().unwrap();
    assert!(peak <= BUDGET + BLOCK, "peak resident {peak}: {host}");
}

/// A guest that maps part of what its host's region maps (an offset and a length of
/// its own) attaches to it, and both read the file's bytes with one pager.
#[test]
fn a_guest_mapping_part_of_the_hosts_region_shares_it() {
    let dir = TempDir::new("share-part");
    let model = model(&dir);
    let out = dir.path("out");
    std::fs::create_dir(&out).unwrap();
    let (offset, len) = (MODEL_LEN / 4 + 8192, MODEL_LEN / 2);
    let bytes = std::fs::read(&model).unwrap();
    let want_slice = {
        let slice = dir.path("slice");
        std::fs::write(&slice, &bytes[offset as usize..(offset + len) as usize]).unwrap();
        sha256(&slice)
    };
    let (offset_arg, len_arg) = (offset.to_string(), len.to_string());
    let range = [Path::new(&offset_arg), Path::new(&len_arg)];
    let output = victim(&dir, "part", &[&model, &out, range[0], range[1]]);
    assert_success(&output, "part");
    let seen = stdout(&output);
    let context = format!("{seen}\n{}", stderr(&output));
    assert!(seen.contains("slice status 0"), "{context}");
    assert!(
        seen.contains(&format!("hash slice {want_slice}")),
        "{context}"
    );
    assert!(
        seen.contains(&format!("hash whole {}", sha256(&model))),
        "{context}"
    );
    one_pager_with_one_guest(&out);
}

/// A guest reads every page of the mapping after its host ended (`how`: `exit` or
/// `kill`): all of them the file's bytes.
fn guest_outlives_host(how: &str) {
    let dir = TempDir::new(&format!("share-outlive-{how}"));
    let model = model(&dir);
    let out = dir.path("out");
    std::fs::create_dir(&out).unwrap();
    let output = victim(&dir, "outlive", &[&model, &out, how.as_ref()]);
    assert_success(&output, "outlive");
    let seen = stdout(&output);
    let pages = MODEL_LEN / 4096;
    assert!(
        seen.contains(&format!("pages {pages} differ 0 zeros 0")),
        "{seen}\n{}",
        stderr(&output)
    );
    assert!(seen.contains("guest status 0"), "{seen}");
    let stats = all_stats(&out);
    if how == "kill" {
        assert!(seen.contains("host status -9"), "{seen}");
        // The host wrote none; the guest none either: it had no pager of its own.
        assert!(stats.is_empty(), "{stats:?}");
    } else {
        assert_eq!(stats.len(), 1, "only the host paged: {stats:?}");
        assert_eq!(stats[0]["guests"], 1, "{}", stats[0]);
    }
}

#[test]
fn a_guest_reads_the_files_bytes_after_its_host_exits() {
    guest_outlives_host("exit");
}

#[test]
fn a_guest_reads_the_files_bytes_after_its_host_is_killed() {
    guest_outlives_host("kill");
}

#[test]
fn two_llama_completions_started_by_a_shell_share_one_pager_and_say_the_same() {
    let Some((bin, model)) = llama_and_model() else {
        return;
    };
    let plain = greedy_completion(&bin, &model, 12);
    let dir = TempDir::new("share-llama");
    let out = dir.path("out");
    std::fs::create_dir(&out).unwrap();
    let quoted: Vec<String> = greedy_completion_args(&model, 12)
        .iter()
        .map(|arg| format!("'{arg}'"))
        .collect();
    let llama = format!(
        "{} {}",
        bin.join("llama-completion").display(),
        quoted.join(" ")
    );
    let out_s = out.display();
    let script = format!(
        "{llama} >{out_s}/1.txt 2>{out_s}/1.err & {llama} >{out_s}/2.txt 2>{out_s}/2.err & \
         wait; cp \"$HYPEROFFLOAD_STATS\"* {out_s}/"
    );
    let output = run("50%", &["sh".as_ref(), "-c".as_ref(), script.as_ref()]);
    assert_success(&output, "sh");
    for name in ["1", "2"] {
        let text = std::fs::read_to_string(out.join(format!("{name}.txt"))).unwrap();
        let err = std::fs::read_to_string(out.join(format!("{name}.err"))).unwrap_or_default();
        assert_eq!(text, plain, "llama-completion {name}: {err}");
    }
    one_pager_with_one_guest(&out);
    // The summary names both processes: the host, and the guest that shared its pager.
    let messages = stderr(&output);
    assert!(
        messages.contains("(llama-completion), and sharing its pager pid ")
            && messages.matches("(llama-completion)").count() >= 2,
        "{messages}"
    );
}
