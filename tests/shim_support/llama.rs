//! llama.cpp's binaries and the small real model for the tests that run them: from
//! HYPEROFFLOAD_LLAMA_BIN (or LLAMA_BIN_DIR) and HYPEROFFLOAD_TEST_MODEL, else what tools/build-llama.sh and
//! tools/fetch-model.sh print (building or fetching into the cache if need be), else
//! the cache under ${XDG_CACHE_HOME:-$HOME/.cache}/hyperoffload.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use super::skip_allowed;

const MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

pub fn cache_dir() -> PathBuf {
    std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".cache")))
        .unwrap_or_else(|| PathBuf::from("/root/.cache"))
        .join("hyperoffload")
}

/// The last stdout line of a tools/ script, if the script exists in this checkout.
pub fn from_script(script: &str) -> Option<PathBuf> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tools")
        .join(script);
    if !path.is_file() {
        return None;
    }
    let output = Command::new("bash")
        .arg(&path)
        .stderr(Stdio::inherit())
        .output()
        .ok()?;
    assert!(output.status.success(), "tools/{script} failed");
    let text = String::from_utf8_lossy(&output.stdout);
    text.lines().last().map(|line| PathBuf::from(line.trim()))
}

pub fn llama_bin_dir() -> Option<PathBuf> {
    // tools/test.sh sets the first.
    for var in ["HYPEROFFLOAD_LLAMA_BIN", "LLAMA_BIN_DIR"] {
        if let Some(dir) = std::env::var_os(var) {
            return Some(dir.into());
        }
    }
    if let Some(dir) = from_script("build-llama.sh") {
        return Some(dir);
    }
    // The portable build (not `-native`), as tools/build-llama.sh makes it.
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(cache_dir())
        .ok()?
        .flatten()
        .map(|entry| entry.path())
        .filter(|path| {
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            name.starts_with("llama.cpp-") && !name.ends_with("-native")
        })
        .map(|path| path.join("bin"))
        .filter(|bin| bin.join("llama-completion").is_file())
        .collect();
    dirs.sort();
    dirs.pop()
}

pub fn model_path() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("HYPEROFFLOAD_TEST_MODEL") {
        return Some(path.into());
    }
    if let Some(path) = from_script("fetch-model.sh") {
        return Some(path);
    }
    let path = cache_dir().join("models").join(MODEL_FILE);
    path.is_file().then_some(path)
}

/// llama.cpp's bin directory and the model; a test without them fails saying how to get
/// them, unless HYPEROFFLOAD_ALLOW_SKIP=1 (then None, after saying why).
pub fn llama_and_model() -> Option<(PathBuf, PathBuf)> {
    if let (Some(bin), Some(model)) = (llama_bin_dir(), model_path()) {
        return Some((bin, model));
    }
    let why = "llama.cpp or the model is missing: run tools/build-llama.sh and \
               tools/fetch-model.sh (or set LLAMA_BIN_DIR / HYPEROFFLOAD_TEST_MODEL)";
    if skip_allowed() {
        eprintln!("skipped: {why}");
        return None;
    }
    panic!("{why} (HYPEROFFLOAD_ALLOW_SKIP=1 skips this test)");
}

/// llama-completion's arguments for a greedy, seeded completion of `tokens` tokens of
/// "The capital of France is" on `model` (2 threads, no repacking: every token reads the
/// weights through the mapping), printing only the generated text.
pub fn greedy_completion_args(model: &Path, tokens: u32) -> Vec<String> {
    let tokens = tokens.to_string();
    [
        "-m",
        model.to_str().unwrap(),
        "-p",
        "The capital of France is",
        "-n",
        &tokens,
        "--temp",
        "0",
        "--seed",
        "1",
        "-t",
        "2",
        "-no-cnv",
        "--no-display-prompt",
        "--no-repack",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// The text of llama-completion from `bin` completing greedily `tokens` tokens on
/// `model` (`greedy_completion_args`), run plainly; a failed run fails the test.
pub fn greedy_completion(bin: &Path, model: &Path, tokens: u32) -> String {
    let output = Command::new(bin.join("llama-completion"))
        .args(greedy_completion_args(model, tokens))
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}
