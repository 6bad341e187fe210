//! The llama.cpp command lines the bench runs: llama-bench's decode test and
//! llama-completion's cold start to the first token (and its decode, for the remote
//! bench).

use std::ffi::OsString;
use std::path::Path;

use super::BenchArgs;

/// llama-bench's decode test alone (`-p 0`), generating `tokens` tokens once.
pub(super) fn llama_bench_command(args: &BenchArgs, tokens: u32) -> Vec<OsString> {
    let bench = args.llama_bin.join("llama-bench");
    [
        bench.into_os_string(),
        "-m".into(),
        args.model().as_os_str().to_owned(),
        "-p".into(),
        "0".into(),
        "-n".into(),
        tokens.to_string().into(),
        "-t".into(),
        args.threads.to_string().into(),
        "-r".into(),
        "1".into(),
        // No weight repacking: inference must read the mapping (SmolLM2's types have
        // no repacked kernels on x86 anyway; synthetic Q8_0 neither).
        "--repack".into(),
        "0".into(),
    ]
    .into_iter()
    .collect()
}

/// The prompt of the cold-start runs.
pub(super) const FIRST_TOKEN_PROMPT: &str = "The capital of France is";

/// `llama-completion` generating one token from a short prompt: its wall time, run
/// cold, is the time from starting the program to its first token (loading, the
/// prompt's pass over the weights, one sampled token, exit). No warm-up pass (its
/// default is an empty decode over all the weights before the prompt), so the bytes
/// read show whether loading read the model: one pass reads it once. A small context,
/// as llama-bench's (its context is its token count): at the model's default one the
/// program's own memory (KV cache, compute buffers) is large, and the kernel side,
/// whose cgroup counts it, would run out of memory at the small budgets.
pub(super) fn first_token_command(args: &BenchArgs) -> Vec<OsString> {
    completion_command(&args.llama_bin, args.model(), 1, args.threads, false)
}

/// `llama-completion` from `llama_bin` on `model` generating `tokens` tokens greedily
/// from `FIRST_TOKEN_PROMPT`, as `first_token_command` says; with `ignore_eos`, exactly
/// `tokens` of them (an end of text does not stop it), so that runs of different
/// lengths differ by a known number of tokens.
pub(super) fn completion_command(
    llama_bin: &Path,
    model: &Path,
    tokens: u32,
    threads: u32,
    ignore_eos: bool,
) -> Vec<OsString> {
    let completion = llama_bin.join("llama-completion");
    let mut command = vec![
        completion.into_os_string(),
        "-m".into(),
        model.as_os_str().to_owned(),
    ];
    command.extend(
        [
            "-p",
            FIRST_TOKEN_PROMPT,
            "-n",
            &tokens.to_string(),
            "-c",
            "256",
            "--temp",
            "0",
            "--seed",
            "1",
            "-t",
            &threads.to_string(),
            "-no-cnv",
            "--no-display-prompt",
            "--no-warmup",
            "--no-repack",
        ]
        .into_iter()
        .map(OsString::from),
    );
    if ignore_eos {
        command.push("--ignore-eos".into());
    }
    command
}
