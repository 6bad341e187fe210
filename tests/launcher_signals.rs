//! Signals sent to `hyperoffload run` go to the program, and when the program ends of one
//! the summary and the stats are still written, from the shim's last snapshot, naming
//! the signal. A program killed by a signal runs no exit handlers, so the shim used to
//! leave no stats at all, and the launcher said the program "mapped no file".
//!
//! Each run waits (bounded) until the shim's snapshot in the launcher's private
//! directory shows bytes served, then signals the launcher's pid, never the program's.

mod common;
mod shim_support;

use std::io::Read;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::TempDir;
use shim_support::llama::llama_and_model;
use shim_support::*;

/// How long any step may take before the test fails (a hang is a bug).
const LIMIT: Duration = Duration::from_secs(60);

/// The bytes the pager had served, as the newest snapshot in the launcher's private
/// directory (`hyperoffload-run-<pid>-<hex>` in `temp`) says; 0 before there is one.
fn snapshot_bytes(launcher: u32, temp: &Path) -> u64 {
    let prefix = format!("hyperoffload-run-{launcher}-");
    let Ok(entries) = std::fs::read_dir(temp) else {
        return 0;
    };
    entries
        .flatten()
        .filter(|entry| entry.file_name().to_string_lossy().starts_with(&prefix))
        .filter_map(|dir| std::fs::read_dir(dir.path()).ok())
        .flat_map(|files| files.flatten())
        .filter(|file| {
            let name = file.file_name();
            let name = name.to_string_lossy();
            name.starts_with("snapshot-") && name.ends_with(".json")
        })
        .filter_map(|file| std::fs::read_to_string(file.path()).ok())
        .filter_map(|json| serde_json::from_str::<serde_json::Value>(&json).ok())
        .filter_map(|stats| stats["bytes_read"].as_u64())
        .max()
        .unwrap_or(0)
}

/// The launcher's child (the program), once it runs.
fn program_of(launcher: &Child) -> Option<i32> {
    let children = format!("/proc/{0}/task/{0}/children", launcher.id());
    std::fs::read_to_string(children)
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Waits until `launcher`'s shim has served bytes (its snapshot says so) and the
/// program has printed something (so it is past installing any signal handler of its
/// own: llama-completion installs its SIGINT handler just before it generates), then
/// sends `signal` to the launcher; returns the launcher's status and its stderr, once
/// both it and its program have ended.
fn signal_once_served(launcher: Child, temp: &Path, signal: i32) -> (ExitStatus, String) {
    signal_once_served_checking(launcher, temp, signal, |_| {})
}

/// `signal_once_served`, calling `check` with the program's pid before the signal.
fn signal_once_served_checking(
    mut launcher: Child,
    temp: &Path,
    signal: i32,
    check: impl FnOnce(i32),
) -> (ExitStatus, String) {
    let printed = Arc::new(AtomicBool::new(false));
    let mut stdout = launcher.stdout.take().expect("stdout piped");
    let seen = Arc::clone(&printed);
    // Drained to the end, so the program never blocks on a full pipe.
    let drain = std::thread::spawn(move || {
        let mut buffer = [0u8; 4096];
        while let Ok(1..) = stdout.read(&mut buffer) {
            seen.store(true, Ordering::Release);
        }
    });
    let deadline = Instant::now() + LIMIT;
    while snapshot_bytes(launcher.id(), temp) == 0 || !printed.load(Ordering::Acquire) {
        if Instant::now() > deadline || launcher.try_wait().unwrap().is_some() {
            let _ = launcher.kill();
            let output = launcher.wait_with_output().unwrap();
            panic!(
                "no snapshot with bytes served ({}); stderr:\n{}",
                output.status,
                stderr(&output)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let program = program_of(&launcher).expect("the program runs");
    check(program);
    // SAFETY: signals our own child process, not yet reaped.
    unsafe { libc::kill(launcher.id() as i32, signal) };
    let output = wait_within(launcher, LIMIT).unwrap_or_else(|output| {
        panic!(
            "the launcher did not end after signal {signal}; stderr:\n{}",
            stderr(&output)
        )
    });
    drain.join().unwrap();
    assert!(
        common::process_ended(program),
        "signal {signal}: the program {program} outlived the launcher"
    );
    (output.status, stderr(&output))
}

/// The closing line the launcher printed.
fn closing_line(stderr: &str) -> &str {
    stderr
        .lines()
        .rev()
        .find(|line| line.starts_with("hyperoffload: "))
        .unwrap_or("")
}

/// `hyperoffload run` for these tests: its temp directory `temp` (where its private
/// directory goes), no core file if it dies of SIGQUIT, the four signals at their
/// default action, stdin closed, stdout piped.
fn launcher_in(temp: &Path) -> std::process::Command {
    let mut command = launcher();
    command
        .env("TMPDIR", temp)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    default_signals(&mut command);
    // SAFETY: between fork and exec, only setrlimit(2) on a value on the stack,
    // async-signal-safe.
    unsafe {
        command.pre_exec(|| {
            let none = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            libc::setrlimit(libc::RLIMIT_CORE, &none);
            Ok(())
        });
    }
    command
}

fn assert_stats_name(stats: &Path, signal: &str) {
    let stats = read_stats(stats);
    assert_eq!(stats["ended_by_signal"], signal, "{stats}");
    assert_eq!(stats["snapshot"], true, "{stats}");
    assert!(stats["bytes_read"].as_u64().unwrap() > 0, "{stats}");
}

/// A program with no handlers (a victim reading its model over and over) dies of each
/// of the four signals sent to the launcher; the launcher dies of the same signal (a
/// shell sees what the program did) after saying which signal and what the pager had
/// served, and --stats gets the last snapshot.
#[test]
fn each_signal_sent_to_the_launcher_ends_the_program_and_is_reported_with_its_stats() {
    let dir = TempDir::new("launcher-signals");
    let victim = compile_c(&dir.0, "victim", include_str!("victims/victim.c"));
    let model = dir.path("weights.bin");
    common::pattern_file(&model, 8 << 20);
    for (signal, name) in [
        (libc::SIGTERM, "SIGTERM"),
        (libc::SIGINT, "SIGINT"),
        (libc::SIGHUP, "SIGHUP"),
        (libc::SIGQUIT, "SIGQUIT"),
    ] {
        let temp = TempDir::new(&format!("launcher-signals-{name}"));
        let stats = dir.path(&format!("stats-{name}.json"));
        let launcher = launcher_in(&temp.0)
            .args(["--budget", "2M", "--min-size", "1M", "--match", "*.bin"])
            .arg("--stats")
            .arg(&stats)
            .arg("--")
            .arg(&victim)
            .arg("read-forever")
            .arg(&model)
            .spawn()
            .unwrap();
        let (status, stderr) = signal_once_served(launcher, &temp.0, signal);
        assert_eq!(status.signal(), Some(signal), "{name}: {status}\n{stderr}");
        let line = closing_line(&stderr);
        assert!(
            line.starts_with(&format!(
                "hyperoffload: killed by {name}; as of its last stats snapshot: read "
            )),
            "{name}: {stderr}"
        );
        assert!(!line.contains("read 0 B"), "{name}: {line}");
        assert_stats_name(&stats, name);
    }
}

/// llama-completion generating for good, stopped through the launcher: SIGINT is its
/// own to handle (it prints its timings and `_exit(130)`s, skipping exit handlers), and
/// the launcher exits 130 too, saying so; SIGTERM kills it, and the launcher dies of
/// SIGTERM. Both report what the pager served.
#[test]
fn llama_completion_stopped_through_the_launcher_is_reported_with_its_stats() {
    let Some((bin, model)) = llama_and_model() else {
        return;
    };
    let dir = TempDir::new("launcher-signals-llama");
    for (signal, name) in [(libc::SIGINT, "SIGINT"), (libc::SIGTERM, "SIGTERM")] {
        let temp = TempDir::new(&format!("launcher-signals-llama-{name}"));
        let stats: PathBuf = dir.path(&format!("stats-{name}.json"));
        let launcher = launcher_in(&temp.0)
            .args(["--budget", "50%", "--stats"])
            .arg(&stats)
            .arg("--")
            .arg(bin.join("llama-completion"))
            .arg("-m")
            .arg(&model)
            .args(["-p", "Once upon a time", "-n", "1000000", "--ignore-eos"])
            .args(["--temp", "0", "-t", "2", "-no-cnv", "--no-display-prompt"])
            .arg("--no-repack")
            .spawn()
            .unwrap();
        let (status, stderr) = signal_once_served(launcher, &temp.0, signal);
        let line = closing_line(&stderr);
        if signal == libc::SIGINT {
            assert_eq!(status.code(), Some(130), "{status}\n{stderr}");
            assert!(
                line.starts_with(
                    "hyperoffload: the program exited with status 130 after the SIGINT \
                     passed on to it, without running exit handlers; as of its last stats \
                     snapshot: read "
                ),
                "{stderr}"
            );
            let stats = read_stats(&stats);
            assert!(stats["bytes_read"].as_u64().unwrap() > 0, "{stats}");
        } else {
            assert_eq!(status.signal(), Some(signal), "{status}\n{stderr}");
            assert!(
                line.starts_with(
                    "hyperoffload: killed by SIGTERM; as of its last stats snapshot: read "
                ),
                "{stderr}"
            );
            assert_stats_name(&stats, name);
        }
    }
}

/// Whether process `pid` ignores `signal` (its SigIgn mask in /proc/PID/status).
fn ignores(pid: i32, signal: i32) -> bool {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let mask = status
        .lines()
        .find_map(|line| line.strip_prefix("SigIgn:"))
        .map(|hex| u64::from_str_radix(hex.trim(), 16).unwrap())
        .unwrap();
    mask & (1 << (signal - 1)) != 0
}

/// A launcher started ignoring SIGHUP (under `nohup`) leaves the program ignoring it, as
/// it would without the launcher (whose handler used to reset it to the default at the
/// program's exec); the signals it handles are the default in the program.
#[test]
fn a_signal_the_launcher_was_started_ignoring_stays_ignored_in_the_program() {
    let dir = TempDir::new("launcher-signals-nohup");
    let victim = compile_c(&dir.0, "victim", include_str!("victims/victim.c"));
    let model = dir.path("weights.bin");
    common::pattern_file(&model, 4 << 20);
    let mut command = launcher_in(&dir.0);
    // SAFETY: between fork and exec, only signal(2); after launcher_in's own closure.
    unsafe {
        command.pre_exec(|| {
            libc::signal(libc::SIGHUP, libc::SIG_IGN);
            Ok(())
        });
    }
    let launcher = command
        .args([
            "-q",
            "--budget",
            "2M",
            "--min-size",
            "1M",
            "--match",
            "*.bin",
        ])
        .arg("--")
        .arg(&victim)
        .arg("read-forever")
        .arg(&model)
        .spawn()
        .unwrap();
    let (status, stderr) = signal_once_served_checking(launcher, &dir.0, libc::SIGTERM, |pid| {
        assert!(
            ignores(pid, libc::SIGHUP),
            "the program does not ignore SIGHUP"
        );
        assert!(!ignores(pid, libc::SIGTERM) && !ignores(pid, libc::SIGINT));
    });
    assert_eq!(status.signal(), Some(libc::SIGTERM), "{status}\n{stderr}");
}
