//! End to end: llama-server, the program most llama.cpp users run, under
//! `hyperoffload run --budget 50%` answers eight concurrent completion requests (four
//! slots, so requests are batched together and queued) with the same greedy texts as
//! the plain server, stays healthy, and when SIGTERM is sent to the launcher (as a
//! service manager would) passes it on, ends cleanly with the summary line, and leaves
//! stats showing the pager served the model within the budget.
//!
//! Both servers listen on loopback only; every wait is bounded; a server still running
//! when the test ends (a failure) is killed with its whole process group.

#![allow(
    clippy::too_many_lines,
    reason = "an end-to-end scenario reads best top to bottom, as its steps run"
)]

mod common;
mod shim_support;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};
use std::time::{Duration, Instant};

use common::TempDir;
use shim_support::llama::llama_and_model;
use shim_support::server::{free_loopback_addr, Server};
use shim_support::*;

/// Distinct prompts, one request each, all sent at once (twice the slots, so some wait).
const PROMPTS: [&str; 8] = [
    "The capital of France is",
    "Water boils at a temperature of",
    "The largest planet in the solar system is",
    "The first person to walk on the moon was",
    "To make a cup of tea, you",
    "The chemical symbol for gold is",
    "In computer science, a linked list is",
    "The three primary colors are",
];
/// Tokens generated per request.
const N_PREDICT: u64 = 20;
/// How long loading, one request, or the end after SIGTERM may take before the test
/// fails (a hang is a bug; on two shared cores none takes a tenth of this).
const LIMIT: Duration = Duration::from_secs(180);

/// llama-server's arguments: four slots of 256 tokens of context each (the context is
/// split among the slots), two threads, on loopback. `--no-repack` as in shim_llama:
/// every token then reads the weights through the mapping.
fn server_args(model: &Path, addr: SocketAddr) -> Vec<String> {
    let port = addr.port().to_string();
    let model = model.to_str().unwrap();
    let args = [
        "-m",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        &port,
        "-np",
        "4",
        "-t",
        "2",
        "-c",
        "1024",
        "--no-repack",
    ];
    args.iter().map(|arg| arg.to_string()).collect()
}

/// What one server did: the texts in the order of PROMPTS, the slots that generated
/// them, the batch's wall time, the server process's peak RSS (VmHWM) and file-backed
/// RSS just before SIGTERM, how it ended, its output.
struct Batch {
    texts: Vec<String>,
    slots: BTreeSet<u64>,
    wall: Duration,
    peak_rss_kib: u64,
    file_rss_kib: u64,
    status: ExitStatus,
    output: String,
}

/// One greedy completion of `prompt`: its text and the slot that generated it.
fn complete(addr: SocketAddr, prompt: &str) -> Result<(String, u64), String> {
    let body = serde_json::json!({
        "prompt": prompt,
        "n_predict": N_PREDICT,
        "temperature": 0,
        "seed": 1,
        "cache_prompt": false,
    });
    let response = http::post_json(addr, "/completion", &body, LIMIT)
        .map_err(|error| format!("{prompt:?}: {error}"))?;
    if response.status != 200 {
        return Err(format!("{prompt:?}: {} {}", response.status, response.body));
    }
    let json = response.json();
    match (json["content"].as_str(), json["id_slot"].as_u64()) {
        (Some(text), Some(slot)) => Ok((text.to_string(), slot)),
        _ => Err(format!("{prompt:?}: no content or id_slot in {json}")),
    }
}

/// Every prompt at once, one thread each; the results in the order of PROMPTS.
fn complete_all(addr: SocketAddr) -> Vec<Result<(String, u64), String>> {
    std::thread::scope(|scope| {
        let requests: Vec<_> = PROMPTS
            .iter()
            .map(|prompt| scope.spawn(move || complete(addr, prompt)))
            .collect();
        requests
            .into_iter()
            .map(|request| request.join().expect("a request thread panicked"))
            .collect()
    })
}

/// The pid llama-server runs as: `started` itself, or the launcher's one child.
fn server_pid(started: u32, under_launcher: bool) -> u32 {
    if !under_launcher {
        return started;
    }
    let children = std::fs::read_to_string(format!("/proc/{started}/task/{started}/children"))
        .expect("the launcher's children");
    children
        .split_whitespace()
        .next()
        .and_then(|pid| pid.parse().ok())
        .expect("the launcher runs the server")
}

/// A `/proc/PID/status` field in KiB (0 if absent).
fn status_kib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|value| value.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// Starts the server with `command`, waits for it to be healthy, sends the batch,
/// checks it is still healthy, stops it with SIGTERM.
fn serve_batch(command: Command, addr: SocketAddr, log: PathBuf, under_launcher: bool) -> Batch {
    let mut server = Server::start(command, addr, &log);
    server.wait_healthy(LIMIT);
    let started = Instant::now();
    let results = complete_all(addr);
    let wall = started.elapsed();
    let (texts, slots): (Vec<String>, BTreeSet<u64>) = results
        .into_iter()
        .map(|result| result.unwrap_or_else(|error| panic!("{error}\n{}", server.output())))
        .unzip();
    // Eight requests sent at once to four idle slots, each request holding its slot for
    // many tokens: several slots generate together, batched (what the pager must serve
    // as the plain server does). All on one slot would mean they were not concurrent.
    assert!(
        slots.len() > 1,
        "every request went to slot {slots:?}\n{}",
        server.output()
    );
    server.assert_healthy();
    let pid = server_pid(server.pid(), under_launcher);
    let (peak_rss_kib, file_rss_kib) = (status_kib(pid, "VmHWM"), status_kib(pid, "RssFile"));
    let (status, output) = server.terminate(LIMIT);
    Batch {
        texts,
        slots,
        wall,
        peak_rss_kib,
        file_rss_kib,
        status,
        output,
    }
}

/// The launcher's closing line.
fn closing_line(output: &str) -> &str {
    output
        .lines()
        .rev()
        .find(|line| line.starts_with("hyperoffload: "))
        .unwrap_or("")
}

#[test]
fn llama_server_answers_the_same_under_the_pager_and_stops_cleanly_on_sigterm() {
    let Some((bin, model)) = llama_and_model() else {
        return;
    };
    let server = bin.join("llama-server");
    if !server.is_file() {
        let why = format!(
            "{} is missing: run tools/build-llama.sh (it builds llama-server now)",
            server.display()
        );
        assert!(
            skip_allowed(),
            "{why} (HYPEROFFLOAD_ALLOW_SKIP=1 skips this test)"
        );
        eprintln!("skipped: {why}");
        return;
    }
    let model_size = std::fs::metadata(&model).unwrap().len();
    let dir = TempDir::new("shim-server");

    let addr = free_loopback_addr();
    let mut plain_command = Command::new(&server);
    plain_command.args(server_args(&model, addr));
    let plain = serve_batch(plain_command, addr, dir.path("plain.log"), false);
    assert!(
        plain.status.success(),
        "the plain server after SIGTERM: {}\n{}",
        plain.status,
        plain.output
    );
    for (prompt, text) in PROMPTS.iter().zip(&plain.texts) {
        assert!(!text.trim().is_empty(), "plain: nothing for {prompt:?}");
    }
    assert!(
        plain.texts[0].contains("Paris"),
        "unexpected plain text: {:?}",
        plain.texts[0]
    );

    let stats = dir.path("stats.json");
    let addr = free_loopback_addr();
    let mut paged_command = launcher();
    paged_command
        .args(["--budget", "50%", "--stats"])
        .arg(&stats)
        .arg("--")
        .arg(&server)
        .args(server_args(&model, addr));
    let paged = serve_batch(paged_command, addr, dir.path("paged.log"), true);

    for ((prompt, expected), text) in PROMPTS.iter().zip(&plain.texts).zip(&paged.texts) {
        assert_eq!(
            text, expected,
            "different text under the pager for {prompt:?}"
        );
        eprintln!("{prompt:?} -> {text:?}");
    }
    // llama-server ends with status 0 after SIGTERM; the launcher passes it on and
    // exits with the program's status.
    assert_eq!(
        paged.status.code(),
        plain.status.code(),
        "the launcher after SIGTERM: {}\n{}",
        paged.status,
        paged.output
    );
    let line = closing_line(&paged.output);
    // The server ran its exit handlers, so the shim's final stats are the summary (not
    // a snapshot of a killed program's, nor "no stats").
    assert!(
        line.starts_with("hyperoffload: read ")
            && !line.starts_with("hyperoffload: read 0 B")
            && !line.contains("snapshot"),
        "closing line: {line:?}\n{}",
        paged.output
    );

    let json = read_stats(&stats);
    let bytes_read = json["bytes_read"].as_u64().unwrap();
    let peak = json["peak_resident_bytes"].as_u64().unwrap();
    let budget = json["budget_bytes"].as_u64().unwrap();
    assert!(bytes_read > 0, "{json}");
    assert_eq!(budget, model_size / 2, "50 % of the model: {json}");
    assert!(
        peak <= budget,
        "peak resident {peak} over the budget {budget}: {json}"
    );
    assert_eq!(
        json["files"][0]["size"].as_u64(),
        Some(model_size),
        "{json}"
    );
    assert!(json.get("ended_by_signal").is_none(), "{json}");

    eprintln!(
        "plain: {} requests on slots {:?} in {:.2} s; server peak RSS {} KiB, file-backed \
         RSS {} KiB (the model through the page cache)",
        PROMPTS.len(),
        plain.slots,
        plain.wall.as_secs_f64(),
        plain.peak_rss_kib,
        plain.file_rss_kib
    );
    eprintln!(
        "pager: {} requests on slots {:?} in {:.2} s; server peak RSS {} KiB, file-backed \
         RSS {} KiB; read {bytes_read} bytes, peak resident {peak} of a {budget} budget \
         ({} faults)",
        PROMPTS.len(),
        paged.slots,
        paged.wall.as_secs_f64(),
        paged.peak_rss_kib,
        paged.file_rss_kib,
        json["faults"]
    );
    eprintln!("{line}");
}
