//! Where each budget's floor comes from: for a dense model, M - B bytes a token and
//! Belady's policy on the predicted order beside it; for a mixture of experts, Belady's
//! and the frequency floor replayed on a demand trace of the program.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, Context};
use hyperoffload::geometry::BlockGeometry;
use hyperoffload::graph::{expert_store, ModelGraph};
use hyperoffload::model::ModelFile;

use super::programs::llama_bench_command;
use super::BenchArgs;
use crate::cli::device::drop_page_cache;
use crate::cli::sim::{simulate, SimPolicy, SimReport, Timing, Workload};

/// Where each budget's floor comes from.
pub(super) enum Floors {
    /// A dense model: every token reads the whole model, in the predicted order.
    Dense(Workload),
    /// A mixture of experts: a demand trace of the program, 2 MiB blocks.
    Trace(Workload),
}

impl Floors {
    /// (floor, optimum beside it) in bytes per token at `budget`; over the tokens the
    /// pager's bytes are measured on (`pager_bytes_per_token`) for a trace.
    pub fn per_token(&self, model_len: u64, budget: u64, tokens: u32) -> (f64, Option<f64>) {
        let replay = |workload: &Workload, policy| {
            simulate(workload, budget, policy, None, None, Timing::default()).ok()
        };
        match self {
            Floors::Dense(workload) => (
                model_len.saturating_sub(budget) as f64,
                replay(workload, SimPolicy::Belady)
                    .and_then(|report| report.steady_bytes_per_token(Some(6))),
            ),
            Floors::Trace(workload) => {
                // Steady state: the trace replayed twice, the bytes of its second copy,
                // in which every expert used has been seen (a first use is a read no
                // policy avoids, and the pager may make it while loading). Per pass of
                // the program: llama-bench's warm-up and its tokens.
                let twice = workload.repeated(2);
                let copy = workload.token_starts.len();
                let passes = f64::from(tokens + TRACE_EXTRA_TOKENS + 1);
                // Per pass the program made (the boundaries found may count one more).
                let second_copy = |report: SimReport| {
                    let bytes = report.bytes_per_token.get(copy..)?;
                    Some(bytes.iter().sum::<u64>() as f64 / passes)
                };
                (
                    replay(&twice, SimPolicy::Belady)
                        .and_then(second_copy)
                        .unwrap_or(0.0),
                    replay(&twice, SimPolicy::Frequency).and_then(second_copy),
                )
            }
        }
    }

    /// The floors of `model`: from its predicted order, or, for a mixture of experts,
    /// from a demand trace of the program (recorded here, after removing the expert
    /// counts earlier runs saved).
    pub fn of(args: &BenchArgs, model: &ModelFile) -> anyhow::Result<Floors> {
        let block = hyperoffload::pager::DEFAULT_BLOCK_SIZE.max(64 << 10);
        let layout = BlockGeometry::new(0, model.file_len, block)?;
        let graph = ModelGraph::from_tensors(&model.tensors, layout);
        let experts = graph.experts().groups().len();
        Ok(if experts > 0 {
            // Every pager run saves what it learned of the experts for the next: the first
            // run of this bench starts cold, as a first run of the model does.
            forget_expert_counts(args.model());
            let trace = record_demand_trace(args)?;
            eprintln!(
                "bench: mixture of experts ({experts} experts in all): floors from {}",
                trace.display()
            );
            let mut workload = crate::cli::simulate::read_trace(&trace, None)?;
            let graph =
                crate::cli::simulate::trace_model_graph(args.model(), &trace, &mut workload)?;
            let workload = workload.with_tokens_from_order(graph.order());
            let passes = workload.token_starts.len();
            if passes < (args.tokens + TRACE_EXTRA_TOKENS) as usize {
                bail!(
                    "{}: {passes} passes over the model found, {} expected",
                    trace.display(),
                    args.tokens + TRACE_EXTRA_TOKENS + 1
                );
            }
            Floors::Trace(workload)
        } else {
            Floors::Dense(Workload::cyclic(&graph, 6))
        })
    }
}

/// Tokens the demand trace generates beyond those the pager's bytes are measured on.
pub(super) const TRACE_EXTRA_TOKENS: u32 = 6;

/// Removes the expert counts an earlier run saved for `model` (beside it or in the
/// cache), so that this bench's first pager run starts cold.
fn forget_expert_counts(model: &Path) {
    let _ = std::fs::remove_file(expert_store::beside(model));
    if let Some(cached) = hyperoffload::graph::store::ModelKey::of_file(model)
        .ok()
        .and_then(|key| expert_store::in_cache(model, &key))
    {
        let _ = std::fs::remove_file(cached);
    }
}

/// Records every block llama-bench reads, in order: demand paging with 2 MiB blocks
/// under a budget of a few blocks, so each block a token uses faults (the trace the
/// floors are replayed on).
fn record_demand_trace(args: &BenchArgs) -> anyhow::Result<PathBuf> {
    let trace = args.out.join("demand-trace.csv");
    let _ = std::fs::remove_file(&trace);
    let _ = std::fs::remove_file(hyperoffload::trace::events_path(&trace));
    drop_page_cache();
    let status = Command::new(std::env::current_exe()?)
        .args([
            "run", "-q", "--policy", "demand", "--block", "2M", "--budget", "16M",
        ])
        .arg("--trace")
        .arg(&trace)
        .arg("--")
        .args(llama_bench_command(args, args.tokens + TRACE_EXTRA_TOKENS))
        .stdout(Stdio::null())
        .status()
        .context("recording a demand trace")?;
    if !status.success() {
        bail!("llama-bench under demand paging failed ({status})");
    }
    Ok(trace)
}
