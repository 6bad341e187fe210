//! One run of llama-completion under `hyperoffload run`, as the remote bench times it:
//! its wall time, llama's eval rate and the text it printed.

use std::ffi::OsString;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Context};

use super::super::programs::completion_command;
use super::super::remote_figures::RemoteSide;
use super::record::RunRecord;
use super::Setup;
use crate::cli::compare::program_output::ProgramFigures;

/// One program run's outcome.
pub(super) struct Completion {
    pub(super) wall_s: f64,
    pub(super) eval_tps: Option<f64>,
    pub(super) text: String,
}

impl Completion {
    pub(super) fn record(
        self,
        part: &'static str,
        side: RemoteSide,
        round: usize,
        budget: u64,
        tokens: u32,
    ) -> RunRecord {
        RunRecord {
            part,
            side,
            round,
            budget,
            tokens,
            run_s: self.wall_s,
            download_s: None,
            mount_start_s: None,
            eval_tps: self.eval_tps,
            mount: None,
            mount_stats_file: None,
            text: self.text,
        }
    }
}

/// llama-completion on `model` generating `tokens` tokens under `hyperoffload run
/// --budget`, timed from start to exit.
pub(super) fn completion(
    setup: &Setup,
    model: &Path,
    tokens: u32,
    budget: u64,
    ignore_eos: bool,
) -> anyhow::Result<Completion> {
    let program = completion_command(
        &setup.args.llama_bin,
        model,
        tokens,
        setup.args.threads,
        ignore_eos,
    );
    let started = Instant::now();
    let output = Command::new(&setup.exe)
        .arg("run")
        .arg("--budget")
        // With its unit: `run` refuses a plain number below 1 MiB.
        .arg(format!("{budget}B"))
        .arg("--")
        .args(&program)
        .stdin(Stdio::null())
        .output()
        .context("starting hyperoffload run")?;
    let wall_s = started.elapsed().as_secs_f64();
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr);
    if !output.status.success() {
        bail!(
            "{} under hyperoffload run failed ({}):\n{}",
            display_command(&program),
            output.status,
            tail(&stderr, 30)
        );
    }
    let figures = ProgramFigures::parse(&stdout, &stderr);
    Ok(Completion {
        wall_s,
        eval_tps: figures
            .eval_ms_per_token
            .filter(|ms| *ms > 0.0)
            .map(|ms| 1000.0 / ms),
        text: stdout,
    })
}

fn display_command(program: &[OsString]) -> String {
    program
        .iter()
        .map(|a| a.to_string_lossy())
        .collect::<Vec<_>>()
        .join(" ")
}

/// The last `lines` lines of `text`.
pub(super) fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_keeps_the_last_lines() {
        assert_eq!(tail("a\nb\nc\n", 2), "b\nc");
        assert_eq!(tail("a", 5), "a");
    }
}
