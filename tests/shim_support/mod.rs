//! Helpers for the tests that run programs under the LD_PRELOAD shim: finding (or
//! building) the shim, compiling victim programs, running them with and without it.
#![allow(dead_code)]

pub mod http;
pub mod llama;
pub mod server;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

pub const LAUNCHER: &str = env!("CARGO_BIN_EXE_hyperoffload");

/// The shim beside the launcher. `cargo test` does not build cdylibs of other workspace
/// members (tools/test.sh builds the workspace first); if it is missing, it is built into
/// a separate target directory (the test's own cargo holds the main one's lock).
pub fn shim() -> PathBuf {
    static SHIM: OnceLock<PathBuf> = OnceLock::new();
    SHIM.get_or_init(|| {
        let beside = Path::new(LAUNCHER).with_file_name("libhyperoffload_preload.so");
        if beside.is_file() {
            return beside;
        }
        let target = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/shim-for-tests");
        let status = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
            .args(["build", "--release", "-p", "hyperoffload-preload"])
            .env("CARGO_TARGET_DIR", &target)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .status()
            .expect("running cargo to build the shim");
        assert!(status.success(), "building the shim failed");
        let built = target.join("release/libhyperoffload_preload.so");
        assert!(
            built.is_file(),
            "{} missing after the build",
            built.display()
        );
        built
    })
    .clone()
}

/// `hyperoffload run ARGS -- PROGRAM...` with the shim found as above.
pub fn launcher() -> Command {
    let mut command = Command::new(LAUNCHER);
    command.arg("run").env("HYPEROFFLOAD_SHIM", shim());
    command
}

/// Has `command` start its program with SIGTERM, SIGHUP, SIGINT and SIGQUIT at their
/// default action. The launcher leaves a signal it was started ignoring ignored in the
/// program (a suite run under `nohup`, or as a script's background job, ignores SIGHUP
/// or SIGINT and SIGQUIT): tests that signal a launcher are about signals that are not.
pub fn default_signals(command: &mut Command) -> &mut Command {
    use std::os::unix::process::CommandExt;
    // SAFETY: between fork and exec, only signal(2), async-signal-safe.
    unsafe {
        command.pre_exec(|| {
            for signal in [libc::SIGTERM, libc::SIGHUP, libc::SIGINT, libc::SIGQUIT] {
                libc::signal(signal, libc::SIG_DFL);
            }
            Ok(())
        });
    }
    command
}

/// Compiles a C program into `dir`.
pub fn compile_c(dir: &Path, name: &str, source: &str) -> PathBuf {
    let src = dir.join(format!("{name}.c"));
    std::fs::write(&src, source).unwrap();
    let exe = dir.join(name);
    let output = Command::new("cc")
        .args(["-O1", "-Wall", "-pthread", "-o"])
        .arg(&exe)
        .arg(&src)
        .output()
        .expect("running cc");
    assert!(
        output.status.success(),
        "cc failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    exe
}

pub fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

pub fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// Fails with both streams if the program did not succeed.
pub fn assert_success(output: &Output, what: &str) {
    assert!(
        output.status.success(),
        "{what}: {:?}\nstdout:\n{}\nstderr:\n{}",
        output.status,
        stdout(output),
        stderr(output)
    );
}

/// The SHA-256 of the file at `path`, in hex (sha256sum).
pub fn sha256(path: &Path) -> String {
    let output = Command::new("sha256sum").arg(path).output().unwrap();
    assert_success(&output, "sha256sum");
    stdout(&output)
        .split_whitespace()
        .next()
        .unwrap()
        .to_string()
}

pub fn read_stats(path: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|error| panic!("stats {}: {error}", path.display()));
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    // A pager's stats (not a mount's): its service broke none of its invariants.
    if json.get("faults").is_some() {
        assert_eq!(
            json["invariant_breaches"],
            0,
            "stats {}: {json}",
            path.display()
        );
    }
    json
}

pub fn skip_allowed() -> bool {
    std::env::var("HYPEROFFLOAD_ALLOW_SKIP").as_deref() == Ok("1")
}

/// Whether FUSE can be used here (`hyperoffload mount`); without it the test fails
/// unless skipping is allowed.
pub fn fuse_or_skip() -> bool {
    if Path::new("/dev/fuse").exists() {
        return true;
    }
    if skip_allowed() {
        eprintln!("skipped: no /dev/fuse");
        return false;
    }
    panic!("no /dev/fuse (HYPEROFFLOAD_ALLOW_SKIP=1 skips the mount tests)");
}

/// `python3`: the virtual environment under the cache, where tools/setup.sh puts numpy
/// and safetensors when the system's Python refuses pip installs, else the one on the
/// PATH.
pub fn python3() -> Command {
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".cache")));
    let venv = cache.map(|cache| cache.join("hyperoffload/python/bin/python3"));
    match venv.filter(|venv| venv.is_file()) {
        Some(venv) => Command::new(venv),
        None => Command::new("python3"),
    }
}

/// The Python interpreter itself (not a wrapper script such as pyenv's, which would
/// exec it without the shim).
pub fn python() -> PathBuf {
    let output = python3()
        .args(["-c", "import sys; print(sys.executable)"])
        .output()
        .expect("python3");
    PathBuf::from(stdout(&output).trim())
}

/// Waits for `child` to end and collects its output, for at most `limit`: past it the
/// child is killed (SIGKILL) and what it wrote is the error, so a hung program fails
/// its test rather than hanging it.
pub fn wait_within(
    child: std::process::Child,
    limit: std::time::Duration,
) -> Result<Output, Output> {
    let pid = child.id() as i32;
    let (done, finished) = std::sync::mpsc::channel();
    let waiter = std::thread::spawn(move || {
        let output = child.wait_with_output().unwrap();
        let _ = done.send(());
        output
    });
    if finished.recv_timeout(limit).is_err() {
        // SAFETY: signals our own child, not yet reaped (the waiter has not returned).
        unsafe { libc::kill(pid, libc::SIGKILL) };
        return Err(waiter.join().unwrap());
    }
    Ok(waiter.join().unwrap())
}

/// The Python program the fork tests run (`plain`, `fork`, `pool`, `exec` and `readers`
/// modes; see the tests' comments).
pub const FORK_VICTIM: &str = include_str!("fork_victim.py");

/// Makes `command` move itself into the cgroup whose `cgroup.procs` is `procs` before
/// it execs, so the program and everything it starts are charged there from its start.
pub fn join_cgroup_at_exec(command: &mut Command, mut procs: std::fs::File) {
    use std::io::Write;
    use std::os::unix::process::CommandExt;
    // SAFETY: between fork and exec, only write(2) on a descriptor opened before.
    unsafe {
        command.pre_exec(move || procs.write_all(b"0").map(|_| ()));
    }
}
