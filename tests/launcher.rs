//! `hyperoffload run` as a supervisor: what it refuses before starting the program, and
//! what happens to the program and the launcher's private directory when the launcher
//! itself is signalled or killed.

mod common;
mod shim_support;

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use shim_support::*;

/// The launcher's private directories (`hyperoffload-run-<pid>-<hex>`) in `temp`.
fn private_dirs_of(launcher: u32, temp: &Path) -> Vec<PathBuf> {
    let prefix = format!("hyperoffload-run-{launcher}-");
    std::fs::read_dir(temp)
        .unwrap()
        .flatten()
        .filter(|entry| entry.file_name().to_string_lossy().starts_with(&prefix))
        .map(|entry| entry.path())
        .collect()
}

/// Starts `run -- sleep 60` with `temp` as its temp dir (each test its own: a launcher
/// removes dead launchers' directories) and returns it with the pid of the sleeping
/// program, once the program runs.
// The caller waits for the launcher it gets back (clippy does not follow it there).
#[allow(clippy::zombie_processes)]
fn launch_sleeper(temp: &Path) -> (Child, i32) {
    let launcher = default_signals(&mut launcher())
        .env("TMPDIR", temp)
        .args(["-q", "--", "sleep", "60"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let children = format!("/proc/{0}/task/{0}/children", launcher.id());
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let listed = std::fs::read_to_string(&children).unwrap_or_default();
        if let Some(pid) = listed.split_whitespace().next() {
            let pid: i32 = pid.parse().unwrap();
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            if comm.trim() == "sleep" {
                return (launcher, pid);
            }
        }
        if Instant::now() > deadline {
            let mut launcher = launcher;
            let _ = launcher.kill();
            let _ = launcher.wait();
            panic!("the program never started");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn wait_ended(pid: i32, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !common::process_ended(pid) {
        assert!(
            Instant::now() < deadline,
            "{what}: process {pid} still runs"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn wait_child(child: &mut Child) -> std::process::ExitStatus {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        assert!(Instant::now() < deadline, "the launcher did not end");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A SIGTERM or SIGHUP sent to the launcher alone reaches the program, which ends of it;
/// the launcher then ends the same way and leaves no directory behind. It used to die at
/// once, leaving the program running under init and its directory in /tmp.
#[test]
fn a_termination_sent_to_the_launcher_reaches_the_program() {
    let temp = common::TempDir::new("launcher-term");
    for signal in [libc::SIGTERM, libc::SIGHUP] {
        let (mut launcher, program) = launch_sleeper(&temp.0);
        // SAFETY: signals our own child process.
        unsafe { libc::kill(launcher.id() as i32, signal) };
        let status = wait_child(&mut launcher);
        assert_eq!(status.signal(), Some(signal), "launcher: {status}");
        wait_ended(program, "the program after the launcher's signal");
        assert!(private_dirs_of(launcher.id(), &temp.0).is_empty());
    }
}

/// A launcher killed outright cannot pass anything on: the program dies with it (the
/// parent-death signal) instead of running on unsupervised, and the directory it left
/// is removed by the next launcher.
#[test]
fn a_killed_launcher_takes_the_program_with_it_and_its_directory_goes_next_time() {
    let temp = common::TempDir::new("launcher-kill");
    let (mut killed, program) = launch_sleeper(&temp.0);
    killed.kill().unwrap();
    let status = wait_child(&mut killed);
    assert_eq!(status.signal(), Some(libc::SIGKILL));
    wait_ended(program, "the program after the launcher was killed");
    assert!(
        !private_dirs_of(killed.id(), &temp.0).is_empty(),
        "a killed launcher cannot remove its directory"
    );
    let output = launcher()
        .env("TMPDIR", &temp.0)
        .args(["-q", "--", "true"])
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(
        private_dirs_of(killed.id(), &temp.0).is_empty(),
        "the next launcher left the dead one's directory"
    );
}

fn launcher_run(args: &[&str]) -> std::process::Output {
    launcher().args(args).output().unwrap()
}

/// Settings the shim would refuse (it would then run the program unpaged and the launcher
/// exit 0) are refused before the program starts, with the shim's reason (a block size
/// already as the option is read: see tests/launcher_budget.rs).
#[test]
fn settings_the_shim_would_refuse_are_refused_up_front() {
    for (args, reason) in [
        (&["--block", "3000"][..], "smaller than a page"),
        (
            &["--match", ""][..],
            "the shim would refuse this configuration: HYPEROFFLOAD_MATCH",
        ),
    ] {
        let mut all = args.to_vec();
        all.extend(["--", "true"]);
        let output = launcher_run(&all);
        assert!(!output.status.success(), "{args:?} accepted");
        let message = stderr(&output);
        assert!(message.contains(reason), "{args:?}: {message}");
    }
}

/// `--serve-forks` alone takes no value from the program's name that follows it; a
/// value is given with `=`, and one it does not know is refused naming those it does.
#[test]
fn serve_forks_alone_is_followed_by_the_program_and_a_bad_value_is_named() {
    let output = launcher_run(&["-q", "--serve-forks", "true"]);
    assert!(output.status.success(), "{}", stderr(&output));
    let output = launcher_run(&["-q", "--serve-forks=never", "true"]);
    assert!(output.status.success(), "{}", stderr(&output));
    let output = launcher_run(&["--serve-forks=sometimes", "true"]);
    assert!(!output.status.success());
    let message = stderr(&output);
    assert!(
        message.contains("sometimes") && message.contains("at-fork, always, never"),
        "{message}"
    );
}

/// `--trace F` writes F and F.events.jsonl; with the second already there the shim
/// could not write it (a message, exit status 0): refused up front like F itself.
#[test]
fn a_trace_whose_events_file_exists_is_refused_up_front() {
    let dir = common::TempDir::new("launcher-trace");
    let trace = dir.path("t.csv");
    std::fs::write(dir.path("t.csv.events.jsonl"), "{}\n").unwrap();
    let output = launcher()
        .arg("--trace")
        .arg(&trace)
        .args(["--", "true"])
        .output()
        .unwrap();
    assert!(!output.status.success());
    let message = stderr(&output);
    assert!(message.contains("t.csv.events.jsonl"), "{message}");
    assert!(message.contains("refusing to overwrite"), "{message}");
}
