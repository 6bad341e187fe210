//! `hyperoffload bench`: the headline benchmark. llama-bench decode (tg) on one model at
//! several budgets, under the kernel's paging (memory cgroup at the budget) and under
//! the pager, with the floor each budget allows: token time >= max(compute time, floor
//! bytes / device bandwidth). For a dense model the floor is M - B bytes read per token
//! (and the simulated optimum on the predicted order beside it); for a mixture of
//! experts, whose tokens read only the experts the router picks, it is Belady's policy
//! replayed on a demand trace of the program (and the frequency floor beside it: the
//! best a policy can do that learns how often experts run, not the sequence).
//! Writes `results.md` (and one `compare` report per budget) to `--out`.
//!
//! The parts: `reference` measures what the pager is held to (the device's limit,
//! alone and beside a decode, and the warm decode's speed), `floors` the bytes a token
//! must read at each budget, `programs` the llama.cpp command lines, `results` the rows
//! and results.md. `run` measures the references and the floors once, then per budget
//! compares the two sides on decode and on the first token and measures the pager's
//! bytes per token.
//!
//! With `--remote SOURCE --model-key NAME` it benchmarks a model in an object store
//! instead (`remote`, `remote_figures`): time to the first token through `hyperoffload
//! mount` against downloading the whole object and then running, decode speed with a
//! warm cache tier against the local copy, and the bytes fetched from the remote per
//! token with a cache tier of half the model.

mod floors;
mod programs;
mod reference;
mod remote;
mod remote_figures;
mod results;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::AtomicBool;

use anyhow::{bail, Context};
use clap::Args;
use hyperoffload::graph::expert_store;
use hyperoffload::model::ModelFile;
use hyperoffload::size::format_size;

use super::compare::record::{RunRecord, Side};
use super::compare::{compare, CompareConfig, PagerBudget};
use super::device::drop_page_cache;
use super::provenance::Provenance;
use floors::Floors;
use programs::{first_token_command, llama_bench_command};
use reference::{device_limit, References};
use results::{latency_median, results_markdown, side_median, Measured, Row};

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// The model llama-bench decodes (GGUF). Not with --remote.
    #[arg(long, required_unless_present = "remote", conflicts_with = "remote")]
    model: Option<PathBuf>,
    /// llama.cpp's bin directory (holding llama-bench, and llama-completion).
    #[arg(long)]
    llama_bin: PathBuf,
    /// Budgets, in percent of the model [default: 25,50,75,90,125; with --remote, 50].
    #[arg(long, value_delimiter = ',')]
    budgets: Vec<f64>,
    /// Runs per side and budget (medians are reported).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Tokens generated per run (llama-bench -n).
    #[arg(long, default_value_t = 8)]
    tokens: u32,
    /// llama-bench threads.
    #[arg(long, default_value_t = 2)]
    threads: u32,
    /// Output directory.
    #[arg(long, default_value = "bench")]
    out: PathBuf,
    #[command(flatten)]
    remote: remote::RemoteArgs,
}

impl BenchArgs {
    /// The local model (clap requires --model unless --remote is given, and the remote
    /// bench never asks for it).
    fn model(&self) -> &Path {
        self.model
            .as_deref()
            .expect("--model is required without --remote")
    }

    /// The budgets asked for, or the default of the mode.
    fn budgets(&self) -> Vec<f64> {
        match (self.budgets.is_empty(), self.remote.source.is_some()) {
            (false, _) => self.budgets.clone(),
            (true, false) => vec![25.0, 50.0, 75.0, 90.0, 125.0],
            (true, true) => vec![50.0],
        }
    }
}

/// `share` percent of a model of `model_len` bytes, in whole pages.
fn budget_bytes(model_len: u64, share: f64) -> u64 {
    ((model_len as f64 * share / 100.0) as u64).next_multiple_of(4096)
}

/// The upper median.
fn median(values: &mut [f64]) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    values.sort_by(|a, b| a.total_cmp(b));
    Some(values[values.len() / 2])
}

pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    if args.tokens == 0 || args.runs == 0 {
        bail!("--tokens and --runs must be at least 1");
    }
    if let Some(share) = args
        .budgets()
        .into_iter()
        .find(|share| !(share.is_finite() && *share > 0.0))
    {
        bail!("--budgets {share}: a budget is a percentage above 0");
    }
    if args.remote.source.is_some() {
        return remote::run(&args);
    }
    std::fs::create_dir_all(&args.out)?;
    // The checkout the binary was built in (target/release/ lies inside it).
    let exe = std::env::current_exe()?;
    let provenance = Provenance::of_this_run(exe.parent().unwrap_or(Path::new(".")));
    let model = ModelFile::open(args.model())?;
    let model_len = model.file_len;
    eprintln!(
        "bench: {} ({})",
        args.model().display(),
        format_size(model_len)
    );
    let references = References::measure(&args)?;
    let floors = Floors::of(&args, &model)?;

    // Ctrl-C or SIGTERM ends the run in progress; the cgroup and trace instances are
    // removed on the way out.
    super::compare::command::catch_interrupts();
    let interrupted = &super::compare::command::INTERRUPTED;
    let mut rows = Vec::new();
    for share in args.budgets() {
        rows.push(measure_budget(
            &args,
            share,
            model_len,
            &floors,
            interrupted,
        )?);
    }
    let compute_s = compute_seconds(&rows, references.warm_tps, model_len);
    let markdown = results_markdown(
        &args,
        &provenance.line(std::time::SystemTime::now()),
        Measured {
            len: model_len,
            sparse: matches!(floors, Floors::Trace(_)),
        },
        &references,
        compute_s,
        &rows,
    );
    let path = args.out.join("results.md");
    std::fs::write(&path, &markdown).with_context(|| format!("writing {}", path.display()))?;
    print!("{markdown}");
    Ok(())
}

/// Compute per token: the warm kernel run's, or the pager's with the model resident
/// (a budget above the model) when that is faster: its blocks are mapped as 2 MiB
/// pages, and the floor is the best the program has shown.
fn compute_seconds(rows: &[Row], warm_tps: f64, model_len: u64) -> f64 {
    let resident_tps = rows
        .iter()
        .filter(|row| row.budget >= model_len)
        .filter_map(|row| row.pager_tps)
        .fold(0.0, f64::max);
    1.0 / warm_tps.max(resident_tps)
}

/// One budget, `share` percent of the model: the decode runs and the first-token runs
/// of both sides (`compare`), the device's limit right before and after the decode
/// runs, the floors, and the pager's bytes per token.
fn measure_budget(
    args: &BenchArgs,
    share: f64,
    model_len: u64,
    floors: &Floors,
    interrupted: &AtomicBool,
) -> anyhow::Result<Row> {
    let budget = budget_bytes(model_len, share);
    let dir = args.out.join(format!("budget-{share}pct"));
    eprintln!("bench: budget {share}% = {}", format_size(budget));
    let config = |program, out_dir| -> anyhow::Result<CompareConfig> {
        Ok(CompareConfig {
            program,
            budget: PagerBudget::Bytes(budget),
            cgroup_limit: None,
            runs: args.runs,
            out_dir,
            model: Some(args.model().to_path_buf()),
            launcher: std::env::current_exe()?,
            // The bench removes the saved counts once, before its first pager run
            // (`floors::forget_expert_counts`); later runs start from what earlier
            // ones learned, as a user's second run would.
            saved_experts: true,
        })
    };
    // The device's rate drifts over minutes, so each budget's floor uses the device as
    // measured right before and right after its decode runs, not only at the start.
    let mut device_beside = device_limit(args.model())?;
    let report = compare(
        &config(llama_bench_command(args, args.tokens), dir.clone())?,
        interrupted,
        print_progress,
    )?;
    device_beside.extend(device_limit(args.model())?);
    let device_bps = median(&mut device_beside).expect("six measurements");
    eprintln!(
        "bench:   device limit beside the runs {:.0} MB/s",
        device_bps / 1e6
    );
    eprintln!("bench:   cold start to the first token (llama-completion -n 1)");
    let first_token = compare(
        &config(first_token_command(args), dir.join("first-token"))?,
        interrupted,
        print_progress,
    )?;
    let first = &first_token.runs;
    let runs = &report.runs;
    let tps = |side| side_median(runs, side, |r| r.program.bench_tokens_per_s("tg"));
    let (floor_bytes_per_token, optimum) = floors.per_token(model_len, budget, args.tokens);
    let pager_bytes_per_token = pager_bytes_per_token(args, budget, &dir)?;
    let bytes_read = |r: &RunRecord| Some(r.io.bytes_read as f64);
    Ok(Row {
        share,
        budget,
        kernel_tps: tps(Side::Kernel),
        pager_tps: tps(Side::Pager),
        pager_bytes_per_token,
        floor_bytes_per_token,
        optimum_bytes_per_token: optimum,
        device_bps,
        kernel_read_mb_s: side_median(runs, Side::Kernel, |r| Some(r.io.mean_bandwidth_mb_s)),
        pager_read_mb_s: side_median(runs, Side::Pager, |r| Some(r.io.mean_bandwidth_mb_s)),
        kernel_p50_us: latency_median(runs, Side::Kernel, |l| l.p50_us),
        kernel_p99_us: latency_median(runs, Side::Kernel, |l| l.p99_us),
        pager_p50_us: latency_median(runs, Side::Pager, |l| l.p50_us),
        pager_p99_us: latency_median(runs, Side::Pager, |l| l.p99_us),
        kernel_first_token_s: side_median(first, Side::Kernel, |r| Some(r.wall_s)),
        pager_first_token_s: side_median(first, Side::Pager, |r| Some(r.wall_s)),
        kernel_first_token_bytes: side_median(first, Side::Kernel, bytes_read),
        pager_first_token_bytes: side_median(first, Side::Pager, bytes_read),
    })
}

fn print_progress(record: &RunRecord) {
    eprintln!(
        "bench:   {} run {}: {:.1} s, tg {}, {} read",
        record.side.name(),
        record.index,
        record.wall_s,
        record
            .program
            .bench_tokens_per_s("tg")
            .map(|t| format!("{t:.2} t/s"))
            .unwrap_or_else(|| "-".into()),
        format_size(record.io.bytes_read),
    )
}

/// Bytes the pager reads per generated token at `budget`: two cold runs that differ
/// only in the number of tokens, so loading and warm-up cancel out. Both start from the
/// same saved expert counts (a mixture of experts' runs save what they learned for the
/// next): a first run that had learned less would read more in the tokens both make.
fn pager_bytes_per_token(args: &BenchArgs, budget: u64, dir: &Path) -> anyhow::Result<f64> {
    let launcher = std::env::current_exe()?;
    let counts = expert_store::beside(args.model());
    let saved = std::fs::read(&counts).ok();
    let mut read = Vec::new();
    for (i, tokens) in [2, 2 + args.tokens].into_iter().enumerate() {
        match &saved {
            Some(bytes) => std::fs::write(&counts, bytes)
                .with_context(|| format!("restoring {}", counts.display()))?,
            None => {
                let _ = std::fs::remove_file(&counts);
            }
        }
        drop_page_cache();
        let stats = dir.join(format!("pager-{tokens}-tokens-{i}.json"));
        let _ = std::fs::remove_file(&stats);
        let status = Command::new(&launcher)
            .arg("run")
            .arg("--budget")
            // With its unit: `run` refuses a plain number below 1 MiB.
            .arg(format!("{budget}B"))
            .arg("--stats")
            .arg(&stats)
            .arg("--")
            .args(llama_bench_command(args, tokens))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()?;
        if !status.success() {
            bail!("llama-bench under the pager failed ({status})");
        }
        let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&stats)?)?;
        let bytes = json
            .get("bytes_read")
            .or_else(|| json.get("stats").and_then(|s| s.get("bytes_read")))
            .and_then(|v| v.as_u64())
            .context("no bytes_read in the pager's stats")?;
        read.push(bytes as f64);
    }
    Ok((read[1] - read[0]).max(0.0) / args.tokens as f64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{CommandFactory, Parser};

    #[derive(Parser, Debug)]
    struct Bench {
        #[command(flatten)]
        args: BenchArgs,
    }

    fn parse(line: &str) -> Result<BenchArgs, clap::Error> {
        Bench::try_parse_from(std::iter::once("bench").chain(line.split_whitespace()))
            .map(|bench| bench.args)
    }

    /// What `Command::debug_assert` would check of the definitions, in a form that runs
    /// in release builds too (clap compiles its own checks in debug builds only, and the
    /// tests run with --release): every argument has its own id and long name and says
    /// what it is for, and every relation between arguments (`required_unless_present`,
    /// `conflicts_with`, `requires`) names arguments that exist, shown by its effect: the
    /// error clap gives, naming the arguments. A relation naming an id that does not
    /// exist has no such effect.
    #[test]
    fn the_arguments_are_well_formed() {
        let command = Bench::command();
        let (mut ids, mut longs) = (
            std::collections::HashSet::new(),
            std::collections::HashSet::new(),
        );
        for arg in command.get_arguments() {
            let id = arg.get_id().as_str();
            assert!(ids.insert(id), "id {id} twice");
            let long = arg
                .get_long()
                .unwrap_or_else(|| panic!("{id} has no long name"));
            assert!(longs.insert(long), "--{long} twice");
            assert!(arg.get_help().is_some(), "--{long} has no help");
        }
        let refused = |line: &str, kind: clap::error::ErrorKind, names: &[&str]| {
            let error = parse(line).expect_err(line);
            let text = error.to_string();
            assert_eq!(error.kind(), kind, "{line}: {text}");
            for name in names {
                assert!(text.contains(name), "{line}: {text} does not name {name}");
            }
        };
        use clap::error::ErrorKind::{ArgumentConflict, MissingRequiredArgument};
        // --model unless --remote, not both; --llama-bin always.
        refused("--llama-bin b", MissingRequiredArgument, &["--model"]);
        refused("--model m", MissingRequiredArgument, &["--llama-bin"]);
        refused(
            "--model m --remote s3://b --model-key m --cache-dir c --llama-bin b",
            ArgumentConflict,
            &["--model", "--remote"],
        );
        // --remote with its key and cache directory, which need it.
        refused(
            "--remote s3://b --cache-dir c --llama-bin b",
            MissingRequiredArgument,
            &["--model-key"],
        );
        refused(
            "--remote s3://b --model-key m --llama-bin b",
            MissingRequiredArgument,
            &["--cache-dir"],
        );
        refused(
            "--model m --model-key k --llama-bin b",
            MissingRequiredArgument,
            &["--remote"],
        );
        refused(
            "--model m --cache-dir c --llama-bin b",
            MissingRequiredArgument,
            &["--remote"],
        );
    }

    #[test]
    fn a_local_or_a_remote_model_with_its_budgets() {
        let local = parse("--model m.gguf --llama-bin b").unwrap();
        assert_eq!(local.model(), Path::new("m.gguf"));
        assert_eq!(local.budgets(), [25.0, 50.0, 75.0, 90.0, 125.0]);
        let remote = parse(
            "--remote s3://b/p --model-key m.gguf --cache-dir c --llama-bin b \
             --mount-arg --no-passthrough --mount-arg=--block=4M --parts ttft,fetch",
        )
        .unwrap();
        assert_eq!(remote.budgets(), [50.0]);
        assert_eq!(remote.remote.mount_args, ["--no-passthrough", "--block=4M"]);
        assert_eq!(
            remote.remote.parts,
            [remote::Part::Ttft, remote::Part::Fetch]
        );
        let remote =
            parse("--remote s3://b --model-key m --cache-dir c --llama-bin b --budgets 30,60")
                .unwrap();
        assert_eq!(remote.budgets(), [30.0, 60.0]);
    }
}
