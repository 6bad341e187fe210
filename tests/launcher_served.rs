//! Served or told why: for each model file the program opened or mapped and the pager did
//! not serve, `hyperoffload run` prints one line with the reason (read rather than
//! mapped, writable, too small, a name and header that say no model, the pager not
//! started, the program killed first), and `--require-served` makes such a run fail.

mod common;
mod shim_support;

use std::io::{BufRead, BufReader};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use common::{pattern_file, TempDir};
use shim_support::*;

const VICTIM_SOURCE: &str = include_str!("victims/victim.c");

/// The exit status of a `--require-served` run that served nothing (documented in
/// `hyperoffload run --help`).
const NOTHING_SERVED: i32 = 3;

fn victim(dir: &TempDir) -> PathBuf {
    compile_c(&dir.0, "victim", VICTIM_SOURCE)
}

/// `hyperoffload run --budget 2M EXTRA -- VICTIM ARGS`.
fn run_victim(victim: &Path, extra: &[&str], args: &[&str]) -> Output {
    launcher()
        .args(["--budget", "2M"])
        .args(extra)
        .arg("--")
        .arg(victim)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

/// The launcher's lines saying a file was not served.
fn unserved_lines(output: &Output) -> Vec<String> {
    stderr(output)
        .lines()
        .filter(|line| line.starts_with("hyperoffload: not served: "))
        .map(str::to_string)
        .collect()
}

/// The one line saying `file` (of `size`) was not served: its reason, after the name.
fn reason_for(output: &Output, file: &Path, size: &str) -> String {
    let lines = unserved_lines(output);
    assert_eq!(lines.len(), 1, "one line:\n{}", stderr(output));
    let head = format!("hyperoffload: not served: {} ({size}): ", file.display());
    lines[0]
        .strip_prefix(&head)
        .unwrap_or_else(|| panic!("{head:?} in {:?}", lines[0]))
        .to_string()
}

fn last_line(output: &Output) -> String {
    stderr(output).lines().last().unwrap_or("").to_string()
}

#[test]
fn a_model_read_rather_than_mapped_is_named_with_the_reason() {
    let dir = TempDir::new("served-pread");
    let victim = victim(&dir);
    let model = dir.path("m.gguf");
    pattern_file(&model, 4 << 20);
    let path = model.to_str().unwrap();
    let output = run_victim(&victim, &["--min-size", "1M"], &["pread", path]);
    assert_success(&output, "pread victim");
    let why = reason_for(&output, &model, "4.00 MiB");
    assert_eq!(
        why,
        "read with read(), not mapped; the pager serves mapped files only"
    );
    assert_eq!(
        last_line(&output),
        "hyperoffload: nothing was served (see above)"
    );
    // -v says so as the program opens it.
    let output = run_victim(&victim, &["--min-size", "1M", "-v"], &["pread", path]);
    assert!(
        stderr(&output).contains(&format!(
            "hyperoffload: {path}: opened, a model by its name; served if the program maps it"
        )),
        "{}",
        stderr(&output)
    );
    // The same file mapped is served, and named in the summary with its size.
    let output = run_victim(&victim, &["--min-size", "1M"], &["read", path]);
    assert_success(&output, "read victim");
    assert!(unserved_lines(&output).is_empty(), "{}", stderr(&output));
    let summary = last_line(&output);
    assert!(
        summary.starts_with("hyperoffload: read ")
            && summary.contains(&format!("; model {path} (4.00 MiB)")),
        "{summary}"
    );
}

#[test]
fn require_served_fails_a_run_that_served_nothing_and_passes_one_that_did() {
    let dir = TempDir::new("served-require");
    let victim = victim(&dir);
    let model = dir.path("m.gguf");
    pattern_file(&model, 4 << 20);
    let path = model.to_str().unwrap();
    let required = ["--min-size", "1M", "--require-served", "-q"];
    let output = run_victim(&victim, &required, &["pread", path]);
    assert_eq!(
        output.status.code(),
        Some(NOTHING_SERVED),
        "{}",
        stderr(&output)
    );
    // Even with -q the reason is given.
    assert!(
        reason_for(&output, &model, "4.00 MiB").starts_with("read with read(), not mapped"),
        "{}",
        stderr(&output)
    );
    assert_eq!(
        last_line(&output),
        format!(
            "hyperoffload: --require-served: {path} (4.00 MiB) was not served; budget 2.00 \
             MiB; exiting with status 3"
        )
    );
    let output = run_victim(&victim, &required, &["read", path]);
    assert_success(&output, "served under --require-served");
    let said = stderr(&output);
    assert!(
        !said.contains("not served") && !said.contains("--require-served"),
        "-q and served: no reasons, no failure:\n{said}"
    );
}

/// llama.cpp's load modes that read the model: `-lm none` (stdio) and `-lm dio` (the
/// file opened with O_DIRECT).
#[test]
fn llama_cpp_reading_its_model_is_told_which_load_mode_maps_it() {
    let Some((bin, model)) = shim_support::llama::llama_and_model() else {
        return;
    };
    let size = hyperoffload::size::format_size(std::fs::metadata(&model).unwrap().len());
    let canonical = std::fs::canonicalize(&model).unwrap();
    for mode in ["none", "dio"] {
        let mut args = shim_support::llama::greedy_completion_args(&model, 2);
        args.extend(["-lm".to_string(), mode.to_string()]);
        let output = launcher()
            .args(["--budget", "50%", "--require-served", "--"])
            .arg(bin.join("llama-completion"))
            .args(&args)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert_eq!(
            output.status.code(),
            Some(NOTHING_SERVED),
            "-lm {mode}: {}",
            stderr(&output)
        );
        assert_eq!(
            reason_for(&output, &canonical, &size),
            "read with read(), not mapped; the pager serves mapped files only; llama.cpp maps \
             it with -lm mmap or the default -lm auto (-lm none, -lm mlock and -lm dio read \
             it; -lm mmap+mlock maps it)",
            "-lm {mode}"
        );
        assert_eq!(
            last_line(&output),
            format!(
                "hyperoffload: --require-served: {} ({size}) was not served; budget 50% of the \
                 model = {}; exiting with status 3",
                canonical.display(),
                hyperoffload::size::format_size(std::fs::metadata(&model).unwrap().len() / 2)
            ),
            "-lm {mode}"
        );
    }
}

#[test]
fn a_writable_mapping_a_small_file_and_an_unknown_name_each_say_why() {
    let dir = TempDir::new("served-refused");
    let victim = victim(&dir);
    let model = dir.path("m.gguf");
    pattern_file(&model, 4 << 20);
    let path = model.to_str().unwrap();

    let output = run_victim(&victim, &["--min-size", "1M"], &["private-writable", path]);
    assert_success(&output, "writable");
    assert!(
        reason_for(&output, &model, "4.00 MiB")
            .starts_with("mapped writable; the pager serves read-only mappings only"),
        "{}",
        stderr(&output)
    );

    // The default minimum size is 64M.
    let output = run_victim(&victim, &[], &["read", path]);
    assert_success(&output, "small");
    assert_eq!(
        reason_for(&output, &model, "4.00 MiB"),
        "smaller than --min-size 64.0 MiB (a lower --min-size serves it)"
    );

    let weights = dir.path("weights.bin");
    pattern_file(&weights, 4 << 20);
    let weights_arg = weights.to_str().unwrap();
    let output = run_victim(&victim, &["--min-size", "1M"], &["read", weights_arg]);
    assert_success(&output, "unknown name");
    assert_eq!(
        reason_for(&output, &weights, "4.00 MiB"),
        "mapped, but its name matches no --match pattern (*.gguf, *.safetensors) and it does \
         not start as a GGUF or safetensors file; --match '*.bin' serves it"
    );
    // What the line suggests serves it.
    let matched = ["--min-size", "1M", "--match", "*.bin", "--require-served"];
    let output = run_victim(&victim, &matched, &["read", weights_arg]);
    assert_success(&output, "with the suggested --match");
    assert!(unserved_lines(&output).is_empty(), "{}", stderr(&output));
}

#[test]
fn a_program_killed_before_mapping_its_model_says_by_which_signal() {
    let dir = TempDir::new("served-killed");
    let victim = victim(&dir);
    let model = dir.path("m.gguf");
    pattern_file(&model, 4 << 20);
    let mut launcher = launcher()
        .args(["--budget", "2M", "--min-size", "1M", "--"])
        .arg(&victim)
        .args(["open-and-wait", model.to_str().unwrap()])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(launcher.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line, "opened\n");
    // SAFETY: signals our own child, not yet reaped.
    unsafe { libc::kill(launcher.id() as i32, libc::SIGTERM) };
    let output = wait_within(launcher, Duration::from_secs(30)).expect("the launcher ended");
    assert_eq!(
        output.status.signal(),
        Some(libc::SIGTERM),
        "{}",
        stderr(&output)
    );
    assert_eq!(
        reason_for(&output, &model, "4.00 MiB"),
        "opened, and not yet mapped when the program was killed by SIGTERM"
    );
    assert_eq!(
        last_line(&output),
        "hyperoffload: killed by SIGTERM; nothing was served (see above)"
    );
}

#[test]
fn a_pager_that_cannot_start_gives_its_reason_for_the_model() {
    use std::os::unix::fs::PermissionsExt;
    // An unprivileged user may not create a kernel-mode userfaultfd here (root-only
    // /dev/userfaultfd, vm.unprivileged_userfaultfd=0). The launcher runs as that user
    // too, so that the shim can write its records into the launcher's directory: the
    // launcher, the shim, the victim and the model go to a directory it can reach.
    let dir = std::env::temp_dir().join(format!("hyperoffload-served-uffd-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let dir = TempDir(dir);
    std::fs::set_permissions(&dir.0, std::fs::Permissions::from_mode(0o755)).unwrap();
    let victim = victim(&dir);
    let launcher_copy = dir.path("hyperoffload");
    std::fs::copy(LAUNCHER, &launcher_copy).unwrap();
    let shim_copy = dir.path("libhyperoffload_preload.so");
    std::fs::copy(shim(), &shim_copy).unwrap();
    let model = dir.path("m.gguf");
    pattern_file(&model, 4 << 20);
    for file in [&victim, &launcher_copy, &shim_copy, &model] {
        std::fs::set_permissions(file, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let output = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(&launcher_copy)
        .args([
            "run",
            "--budget",
            "2M",
            "--min-size",
            "1M",
            "--require-served",
            "--",
        ])
        .arg(&victim)
        .args(["read", model.to_str().unwrap()])
        .env("TMPDIR", "/tmp")
        .env_remove("HYPEROFFLOAD_SHIM")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(
        output.status.code(),
        Some(NOTHING_SERVED),
        "{}",
        stderr(&output)
    );
    // The program ran on the kernel's mapping.
    assert!(stdout(&output).contains("kind file"), "{}", stdout(&output));
    let why = reason_for(&output, &model, "4.00 MiB");
    assert!(
        why.starts_with("the pager could not start: userfaultfd is not permitted"),
        "{why}"
    );
}
