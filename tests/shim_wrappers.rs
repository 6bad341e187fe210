//! Programs started through wrappers: the process `hyperoffload run` starts keeps the
//! pager through every exec in that same process (a `#!/bin/sh` wrapper that execs
//! llama-completion, `env` then the interpreter), and a wrapper that runs the program as
//! a child (another pid) has it served only with `--inherit`. The stats and the closing
//! line name the process served.

mod common;
mod shim_support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use common::{pattern_file, TempDir};
use shim_support::llama::*;
use shim_support::*;

/// Prints the SHA-256 of a whole file read through `mmap(PROT_READ)`, and whether its
/// own LD_PRELOAD still names the shim.
const READ_MMAP: &str = r#"
import sys, os, mmap, hashlib
with open(sys.argv[1], "rb") as f:
    m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
print("sha256", hashlib.sha256(m).hexdigest())
print("preload has shim", int("hyperoffload" in os.environ.get("LD_PRELOAD", "")))
"#;

fn script(dir: &TempDir, name: &str, text: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.path(name);
    std::fs::write(&path, text).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

/// `hyperoffload run --budget 8M --min-size 1M --stats STATS [extra] -- program...`.
fn run(extra: &[&str], stats: &Path, program: &[&std::ffi::OsStr]) -> Output {
    launcher()
        .args(["--budget", "8M", "--min-size", "1M", "--match", "*.gguf"])
        .args(extra)
        .arg("--stats")
        .arg(stats)
        .arg("--")
        .args(program)
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

/// Asserts the stats are of a process running `program` that was served bytes, and
/// that the closing line names it.
fn assert_served(output: &Output, stats: &Path, program: &str) {
    let json = read_stats(stats);
    assert!(json["bytes_read"].as_u64().unwrap() > 0, "{json}");
    let exe = json["program"].as_str().unwrap();
    let name = Path::new(exe).file_name().unwrap().to_string_lossy();
    assert!(name.starts_with(program), "{json}");
    let line = format!("served pid {} ({name})", json["pid"]);
    assert!(stderr(output).contains(&line), "{}", stderr(output));
}

#[test]
fn a_sh_wrapper_that_execs_llama_completion_is_served_and_says_the_same() {
    let Some((bin, model)) = llama_and_model() else {
        return;
    };
    let dir = TempDir::new("wrap-llama");
    let completion = bin.join("llama-completion");
    let wrapper = script(
        &dir,
        "llama-wrapper",
        &format!("#!/bin/sh\nexec {} \"$@\"\n", completion.display()),
    );
    let args = greedy_completion_args(&model, 12);
    let plain = Command::new(&completion)
        .args(&args)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_success(&plain, "plain llama-completion");
    let stats = dir.path("stats.json");
    let output = launcher()
        .args(["--budget", "50%", "--stats"])
        .arg(&stats)
        .arg("--")
        .arg(&wrapper)
        .args(&args)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_success(&output, "llama-completion through the wrapper");
    assert!(!stdout(&plain).trim().is_empty());
    assert_eq!(stdout(&output), stdout(&plain));
    assert_served(&output, &stats, "llama-completion");
    let json = read_stats(&stats);
    let size = std::fs::metadata(&model).unwrap().len();
    assert!(json["peak_resident_bytes"].as_u64().unwrap() <= size / 2 + (2 << 20));
}

#[test]
fn env_then_the_interpreter_is_served() {
    let dir = TempDir::new("wrap-env");
    let model = dir.path("m.gguf");
    pattern_file(&model, (24 << 20) + 4321);
    let stats = dir.path("stats.json");
    let python = python();
    let output = run(
        &[],
        &stats,
        &[
            "env".as_ref(),
            "HYPEROFFLOAD_UNRELATED=1".as_ref(),
            python.as_os_str(),
            "-c".as_ref(),
            READ_MMAP.as_ref(),
            model.as_os_str(),
        ],
    );
    assert_success(&output, "env python3");
    let seen = stdout(&output);
    assert!(
        seen.contains(&format!("sha256 {}", sha256(&model))),
        "{seen}"
    );
    // The same process: what it executes would keep the pager too.
    assert!(seen.contains("preload has shim 1"), "{seen}");
    assert_served(&output, &stats, "python");
}

#[test]
fn a_wrapper_that_runs_the_program_as_a_child_serves_it_only_with_inherit() {
    let dir = TempDir::new("wrap-child");
    let model = dir.path("m.gguf");
    pattern_file(&model, (24 << 20) + 4321);
    let python = python();
    let script_path = dir.path("read.py");
    std::fs::write(&script_path, READ_MMAP).unwrap();
    let wrapper = script(
        &dir,
        "child-wrapper",
        &format!(
            "#!/bin/sh\n{} {} \"$1\"\necho wrapper done\n",
            python.display(),
            script_path.display()
        ),
    );
    let expected = format!("sha256 {}", sha256(&model));

    let stats = dir.path("plain.json");
    let output = run(&[], &stats, &[wrapper.as_os_str(), model.as_os_str()]);
    assert_success(&output, "child wrapper");
    let seen = stdout(&output);
    assert!(seen.contains(&expected), "{seen}");
    assert!(seen.contains("wrapper done"), "{seen}");
    // The child took the shim out of its own LD_PRELOAD and served nothing.
    assert!(seen.contains("preload has shim 0"), "{seen}");
    assert!(!stats.exists(), "a child was served without --inherit");
    // And the closing line says where to look.
    assert!(
        stderr(&output).contains("nothing was served")
            && stderr(&output).contains("programs it started are served only with --inherit"),
        "{}",
        stderr(&output)
    );

    let stats = dir.path("inherit.json");
    let output = run(
        &["--inherit"],
        &stats,
        &[wrapper.as_os_str(), model.as_os_str()],
    );
    assert_success(&output, "child wrapper --inherit");
    let seen = stdout(&output);
    assert!(seen.contains(&expected), "{seen}");
    assert!(seen.contains("preload has shim 1"), "{seen}");
    assert_served(&output, &stats, "python");
}
