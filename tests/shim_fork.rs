//! fork under the pager as it runs by default (`--serve-forks=at-fork`: zero copy until
//! the first fork, which makes the regions inheritable): a forked child sees the file's
//! bytes at every address of every served mapping (pages the parent touched and pages
//! it did not), served by the parent's pager, never a crash, and the parent goes on
//! being served. Python as the client (`os.fork`, `multiprocessing` with the fork start
//! method, fork then exec), under a budget of a quarter of a 128 MiB model. With
//! `--serve-forks=never` the child maps the file from the page cache instead, with one
//! message.

mod common;
mod shim_support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use common::{pattern_file, TempDir};
use shim_support::*;

const MODEL_LEN: u64 = (128 << 20) + 4321;

/// `plain FILE`: the SHA-256 of each quarter of the file, read with read(2).
/// `fork FILE`: maps the file, reads the first quarter, forks; the child hashes every
/// quarter through the mapping; the parent waits, then hashes them too.
/// `pool FILE`: maps the file, reads the first quarter, then 3 workers of a
/// multiprocessing pool (fork start method) hash the quarters through the mapping.
/// `exec FILE`: maps the file, reads it, forks; the child execs this interpreter in
/// `plain` mode.
const SCRIPT: &str = FORK_VICTIM;

struct Setup {
    dir: TempDir,
    model: PathBuf,
    python: PathBuf,
    /// The quarters' hashes as `plain` prints them.
    expected: String,
}

fn setup(name: &str) -> Setup {
    let dir = TempDir::new(name);
    let model = dir.path("m.gguf");
    pattern_file(&model, MODEL_LEN);
    let python = python();
    let output = Command::new(&python)
        .args(["-c", SCRIPT, "plain"])
        .arg(&model)
        .output()
        .unwrap();
    assert_success(&output, "plain read");
    let expected = stdout(&output)
        .trim()
        .strip_prefix("plain ")
        .unwrap()
        .to_string();
    Setup {
        dir,
        model,
        python,
        expected,
    }
}

/// The script in `mode` under `hyperoffload run --budget 32M` (and `options`), killed
/// after 120 s.
fn under_pager(setup: &Setup, options: &[&str], mode: &str, stats: &Path) -> Output {
    Command::new("timeout")
        .arg("120")
        .arg(LAUNCHER)
        .env("HYPEROFFLOAD_SHIM", shim())
        .args(["run", "--budget", "32M", "--min-size", "1M"])
        .args(options)
        .arg("--stats")
        .arg(stats)
        .arg("--")
        .arg(&setup.python)
        .args(["-c", SCRIPT, mode])
        .arg(&setup.model)
        .arg(SCRIPT)
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

fn line<'a>(text: &'a str, prefix: &str) -> Vec<&'a str> {
    text.lines()
        .filter_map(|line| line.strip_prefix(prefix))
        .collect()
}

/// The parent read the file's bytes through the pager after the fork.
fn assert_parent_served(setup: &Setup, output: &Output, stats: &Path) {
    let seen = stdout(output);
    assert_eq!(
        line(&seen, "parent "),
        vec![setup.expected.as_str()],
        "{seen}"
    );
    let json = read_stats(stats);
    assert!(json["bytes_read"].as_u64().unwrap() >= MODEL_LEN, "{json}");
    assert!(
        json["peak_resident_bytes"].as_u64().unwrap() <= 32 << 20,
        "{json}"
    );
}

/// The children were served by the pager: blocks mapped zero copy before the fork, the
/// regions made inheritable at it, the children's faults served, nothing left to the
/// page cache.
fn assert_children_served(output: &Output, stats: &Path, children: u64) {
    let json = read_stats(stats);
    assert_eq!(json["zero_copy"], true, "{json}");
    assert_eq!(json["serve_forks"], true, "{json}");
    assert!(
        json["forked_children"].as_u64().unwrap() >= children,
        "{json}"
    );
    assert!(json["child_faults"].as_u64().unwrap() > 0, "{json}");
    let messages = stderr(output);
    assert!(
        !messages.contains("from the kernel's page cache"),
        "{messages}"
    );
}

/// The script in `mode` under the pager with `options`, named `name`: it succeeds, the
/// lines its readers print after `reader` hold the file's hashes (once), every child
/// exits 0, and the parent was served. Returns the output and the stats file.
fn readers_see_the_file(
    name: &str,
    options: &[&str],
    mode: &str,
    reader: &str,
) -> (Output, PathBuf, Setup) {
    let setup = setup(name);
    let stats = setup.dir.path("stats.json");
    let output = under_pager(&setup, options, mode, &stats);
    assert_success(&output, mode);
    let seen = stdout(&output);
    assert_eq!(line(&seen, reader), vec![setup.expected.as_str()], "{seen}");
    assert!(
        line(&seen, "child status ")
            .iter()
            .all(|status| *status == "0"),
        "{seen}"
    );
    assert_parent_served(&setup, &output, &stats);
    (output, stats, setup)
}

#[test]
fn a_forked_child_reads_the_files_bytes_where_the_parent_read_and_where_not() {
    let (output, stats, _setup) = readers_see_the_file("fork-os", &[], "fork", "child sees ");
    assert_eq!(line(&stdout(&output), "child status "), vec!["0"]);
    assert_children_served(&output, &stats, 1);
}

#[test]
fn without_serving_forks_a_child_reads_the_files_bytes_from_the_page_cache() {
    let (output, stats, _setup) = readers_see_the_file(
        "fork-never",
        &["--serve-forks=never"],
        "fork",
        "child sees ",
    );
    assert_eq!(line(&stdout(&output), "child status "), vec!["0"]);
    assert_eq!(read_stats(&stats)["serve_forks"], false);
    assert_one_fork_message(&output);
}

#[test]
fn multiprocessing_fork_workers_read_chunks_of_the_mapping() {
    let (output, stats, _setup) = readers_see_the_file("fork-pool", &[], "pool", "pool ");
    // Three workers, served from the regions the first fork made inheritable.
    assert_children_served(&output, &stats, 3);
}

#[test]
fn without_serving_forks_multiprocessing_workers_get_one_message() {
    let (output, _, _setup) =
        readers_see_the_file("fork-pool-never", &["--serve-forks=never"], "pool", "pool ");
    // Three workers, one message.
    assert_one_fork_message(&output);
}

#[test]
fn a_forked_child_that_execs_another_program_runs_it_unchanged() {
    let (output, _, _setup) = readers_see_the_file("fork-exec", &[], "exec", "plain ");
    assert_eq!(line(&stdout(&output), "child status "), vec!["0"]);
}

/// The shim said once (for the first child, however many) that forked children read
/// the model from the kernel's page cache.
fn assert_one_fork_message(output: &std::process::Output) {
    let messages = stderr(output);
    assert_eq!(
        messages.matches("from the kernel's page cache").count(),
        1,
        "{messages}"
    );
}
