//! `hyperoffload bench`: the headline benchmark. llama-bench decode (tg) on one model at
//! several budgets, under the kernel's paging (memory cgroup at the budget) and under
//! the pager, with the floor each budget allows: token time >= max(compute time, floor
//! bytes / device bandwidth). For a dense model the floor is M - B bytes read per token
//! (and the simulated optimum on the predicted order beside it); for a mixture of
//! experts, whose tokens read only the experts the router picks, it is Belady's policy
//! replayed on a demand trace of the program (and the frequency floor beside it: the
//! best a policy can do that learns how often experts run, not the sequence).
//! Writes `results.md` (and one `compare` report per budget) to `--out`.

use std::ffi::OsString;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::compare::figures::LatencyFigures;
use super::compare::program_output::ProgramFigures;
use super::compare::record::{RunRecord, Side};
use super::compare::{compare, CompareConfig};
use super::device::{drop_page_cache, read_rate, sequential_read_rate};
use super::sim::{simulate, SimPolicy, SimReport, Timing, Workload};
use anyhow::{bail, Context};
use clap::Args;
use hyperoffload::graph::{expert_store, BlockLayout, ModelGraph};
use hyperoffload::model::ModelFile;
use hyperoffload::size::format_size;

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// The model llama-bench decodes (GGUF).
    #[arg(long)]
    model: PathBuf,
    /// llama.cpp's bin directory (holding llama-bench).
    #[arg(long)]
    llama_bin: PathBuf,
    /// Budgets, in percent of the model.
    #[arg(long, value_delimiter = ',', default_value = "25,50,75,90,125")]
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
}

fn median(values: &mut [f64]) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    values.sort_by(|a, b| a.total_cmp(b));
    Some(values[values.len() / 2])
}

/// Three cold measurements of the device's limit: io_uring O_DIRECT reads of the whole
/// model, 1 MiB each, 32 deep.
fn device_limit(model: &Path) -> anyhow::Result<Vec<f64>> {
    let mut rates = Vec::new();
    for _ in 0..3 {
        if !drop_page_cache() {
            eprintln!("bench: cannot drop the page cache (not root?): figures are not cold");
        }
        rates.push(sequential_read_rate(model, 1 << 20, 32)?);
    }
    Ok(rates)
}

/// What of its rate the device keeps while the unchanged program decodes with the
/// model resident: reads shaped as the pager's while a spread set streams (2 MiB, two
/// deep, each landing in its own memory across 1 GiB), alone and then beside a warm
/// llama-bench tg, three measurements each, back to back. Reads and decode share the
/// memory: here such reads ran at 3.3-3.4 GB/s alone and 3.0-3.2 beside a decode (two
/// threads streaming memory cut them to 2.8-2.9), while reads into 4 MiB used over and
/// over kept their speed beside either. So where the pager's reads overlap the
/// program's compute they run below the device's limit measured alone.
/// Returns (alone, during decode).
fn device_during_decode(args: &BenchArgs) -> anyhow::Result<(Vec<f64>, Vec<f64>)> {
    let pager_shaped = || read_rate(&args.model, 2 << 20, 2, 1 << 30);
    let mut alone = Vec::new();
    for _ in 0..3 {
        alone.push(pager_shaped()?);
    }
    // Long enough to outlast loading and the measurements; killed once they are done.
    let command = llama_bench_command(args, 512);
    let mut decode = Command::new(&command[0])
        .args(&command[1..])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting llama-bench")?;
    let measured = (|| {
        // Decoding once the program has had 3 s of CPU: loading a model from the page
        // cache takes a fraction of that, decode uses both threads.
        let started = Instant::now();
        while cpu_seconds(decode.id())? < 3.0 {
            if let Some(status) = decode.try_wait()? {
                bail!("llama-bench exited ({status}) before it started decoding");
            }
            if started.elapsed() > Duration::from_secs(120) {
                bail!("llama-bench did not start decoding within 120 s");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let mut during = Vec::new();
        for _ in 0..3 {
            during.push(pager_shaped()?);
        }
        if let Some(status) = decode.try_wait()? {
            bail!("llama-bench exited ({status}) while the device was measured beside it");
        }
        Ok(during)
    })();
    let _ = decode.kill();
    let _ = decode.wait();
    Ok((alone, measured?))
}

/// User and system CPU seconds process `pid` has used so far.
fn cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("reading /proc/{pid}/stat"))?;
    // Fields after the command name (which may hold spaces), from field 3 on.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    let ticks = |field: usize| -> anyhow::Result<f64> {
        fields
            .get(field - 3)
            .and_then(|v| v.parse::<f64>().ok())
            .with_context(|| format!("no field {field} in /proc/{pid}/stat"))
    };
    // SAFETY: sysconf reads a configuration value and touches no memory of ours.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Ok((ticks(14)? + ticks(15)?) / per_second.max(1.0))
}

fn llama_bench_command(args: &BenchArgs, tokens: u32) -> Vec<OsString> {
    let bench = args.llama_bin.join("llama-bench");
    [
        bench.into_os_string(),
        "-m".into(),
        args.model.clone().into_os_string(),
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
const FIRST_TOKEN_PROMPT: &str = "The capital of France is";

/// `llama-completion` generating one token from a short prompt: its wall time, run
/// cold, is the time from starting the program to its first token (loading, the
/// prompt's pass over the weights, one sampled token, exit). No warm-up pass (its
/// default is an empty decode over all the weights before the prompt), so the bytes
/// read show whether loading read the model: one pass reads it once. A small context,
/// as llama-bench's (its context is its token count): at the model's default one the
/// program's own memory (KV cache, compute buffers) was 780 MiB, and the kernel side,
/// whose cgroup counts it, was killed for memory at a quarter of the model.
fn first_token_command(args: &BenchArgs) -> Vec<OsString> {
    let completion = args.llama_bin.join("llama-completion");
    let mut command = vec![
        completion.into_os_string(),
        "-m".into(),
        args.model.clone().into_os_string(),
    ];
    command.extend(
        [
            "-p",
            FIRST_TOKEN_PROMPT,
            "-n",
            "1",
            "-c",
            "256",
            "--temp",
            "0",
            "--seed",
            "1",
            "-t",
            &args.threads.to_string(),
            "-no-cnv",
            "--no-display-prompt",
            "--no-warmup",
            "--no-repack",
        ]
        .into_iter()
        .map(OsString::from),
    );
    command
}

/// Tokens per second of llama-bench's tg test, warm and without a memory limit: the
/// compute-bound speed. The fastest of three runs after one that warms the page cache:
/// on a shared machine noise only slows a run, and the floor should not be lowered by
/// it (a median of two ran at 9.7 tok/s once, where the pager with the model resident
/// ran at 11.7).
fn warm_tokens_per_s(args: &BenchArgs) -> anyhow::Result<f64> {
    let command = llama_bench_command(args, args.tokens);
    let mut speeds = Vec::new();
    for _ in 0..4 {
        let output = Command::new(&command[0])
            .args(&command[1..])
            .output()
            .context("running llama-bench")?;
        if !output.status.success() {
            bail!(
                "llama-bench failed: {}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
        let figures = ProgramFigures::parse(
            &String::from_utf8_lossy(&output.stdout),
            &String::from_utf8_lossy(&output.stderr),
        );
        speeds.push(
            figures
                .bench_tokens_per_s("tg")
                .context("no tg figure from llama-bench")?,
        );
    }
    speeds.remove(0);
    Ok(speeds.into_iter().fold(0.0, f64::max))
}

/// Bytes the pager reads per generated token at `budget`: two cold runs that differ
/// only in the number of tokens, so loading and warm-up cancel out. Both start from the
/// same saved expert counts (a mixture of experts' runs save what they learned for the
/// next): a first run that had learned less would read more in the tokens both make.
fn pager_bytes_per_token(args: &BenchArgs, budget: u64, dir: &Path) -> anyhow::Result<f64> {
    let launcher = std::env::current_exe()?;
    let counts = expert_store::beside(&args.model);
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
            .arg(budget.to_string())
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

/// The device's rate alone and beside a warm decode, for reads shaped as the pager's,
/// measured back to back (`device_during_decode`).
struct DecodeShare {
    alone_bps: f64,
    during_bps: f64,
}

impl DecodeShare {
    /// What of the limit measured alone the device gives beside a decode.
    fn fraction(&self) -> f64 {
        self.during_bps / self.alone_bps
    }
}

impl Row {
    /// Floor bytes per token / `device_bps`: the reads' part of the floor.
    fn read_floor_s(&self) -> f64 {
        self.floor_bytes_per_token / self.device_bps
    }
}

struct Row {
    share: f64,
    budget: u64,
    kernel_tps: Option<f64>,
    pager_tps: Option<f64>,
    pager_bytes_per_token: f64,
    /// Bytes a token must read: M - B for a dense model, Belady's on the demand trace
    /// for a mixture of experts.
    floor_bytes_per_token: f64,
    /// Beside the floor: the simulated optimum on the predicted order (dense), the
    /// frequency floor on the demand trace (mixture of experts).
    optimum_bytes_per_token: Option<f64>,
    /// The device's limit measured beside this budget's decode runs (the upper median of
    /// three measurements before them and three after).
    device_bps: f64,
    kernel_read_mb_s: Option<f64>,
    pager_read_mb_s: Option<f64>,
    kernel_p50_us: Option<f64>,
    kernel_p99_us: Option<f64>,
    pager_p50_us: Option<f64>,
    pager_p99_us: Option<f64>,
    /// Cold start to the first token (see `first_token_command`): wall seconds and
    /// bytes read from the device, medians per side.
    kernel_first_token_s: Option<f64>,
    pager_first_token_s: Option<f64>,
    kernel_first_token_bytes: Option<f64>,
    pager_first_token_bytes: Option<f64>,
}

/// The median of `value` over `side`'s runs that succeeded.
fn side_median(
    runs: &[RunRecord],
    side: Side,
    value: impl Fn(&RunRecord) -> Option<f64>,
) -> Option<f64> {
    let mut values: Vec<f64> = runs
        .iter()
        .filter(|r| r.side == side && r.succeeded())
        .filter_map(value)
        .collect();
    median(&mut values)
}

/// The median of a latency figure over a side's runs that measured one: a run in which
/// no fault waited has no latency (compare's report shows "–"), not a latency of 0.
fn latency_median(
    runs: &[RunRecord],
    side: Side,
    figure: impl Fn(&LatencyFigures) -> f64,
) -> Option<f64> {
    side_median(runs, side, |r| {
        (r.faults.waited_faults > 0).then(|| figure(&r.faults.latency))
    })
}

pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    if args.tokens == 0 || args.runs == 0 {
        bail!("--tokens and --runs must be at least 1");
    }
    std::fs::create_dir_all(&args.out)?;
    let model = ModelFile::open(&args.model)?;
    let model_len = model.file_len;
    eprintln!(
        "bench: {} ({})",
        args.model.display(),
        format_size(model_len)
    );

    let device_bps = median(&mut device_limit(&args.model)?).expect("three measurements");
    eprintln!("bench: device limit {:.0} MB/s", device_bps / 1e6);
    let warm_tps = warm_tokens_per_s(&args)?;
    eprintln!("bench: warm decode {warm_tps:.2} tok/s");
    let (mut alone, mut during) = device_during_decode(&args)?;
    let decode_share = DecodeShare {
        alone_bps: median(&mut alone).expect("three measurements"),
        during_bps: median(&mut during).expect("three measurements"),
    };
    eprintln!(
        "bench: pager-shaped reads {:.0} MB/s alone, {:.0} MB/s beside a warm decode",
        decode_share.alone_bps / 1e6,
        decode_share.during_bps / 1e6
    );

    // The optimum for each budget, from the model's predicted order; for a mixture of
    // experts, from a demand trace of the program.
    let block = hyperoffload::pager::DEFAULT_BLOCK_SIZE.max(64 << 10);
    let layout = BlockLayout::new(0, model_len, block)?;
    let graph = ModelGraph::from_tensors(&model.tensors, layout);
    let experts = graph.experts().groups().len();
    let floors = if experts > 0 {
        // Every pager run saves what it learned of the experts for the next: the first
        // run of this bench starts cold, as a first run of the model does.
        forget_expert_counts(&args.model);
        let trace = record_demand_trace(&args)?;
        eprintln!(
            "bench: mixture of experts ({experts} experts in all): floors from {}",
            trace.display()
        );
        let workload = super::simulate::read_trace(&trace, None)?;
        let graph = super::simulate::trace_model_graph(&args.model, &workload)?;
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
    };

    // Ctrl-C or SIGTERM ends the run in progress; the cgroup and trace instances are
    // removed on the way out.
    super::compare::command::catch_interrupts();
    let interrupted = &super::compare::command::INTERRUPTED;
    let mut rows = Vec::new();
    for &share in &args.budgets {
        let budget = ((model_len as f64 * share / 100.0) as u64).next_multiple_of(4096);
        let dir = args.out.join(format!("budget-{share}pct"));
        eprintln!("bench: budget {share}% = {}", format_size(budget));
        let progress = |record: &RunRecord| {
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
        };
        let config = |program, out_dir| -> anyhow::Result<CompareConfig> {
            Ok(CompareConfig {
                program,
                budget_bytes: budget,
                runs: args.runs,
                out_dir,
                model: Some(args.model.clone()),
                launcher: std::env::current_exe()?,
            })
        };
        // This virtual disk's rate drifts by several percent over minutes (3.2-3.7 GB/s
        // in one day here), so each budget's floor uses the device as measured right
        // before and right after its decode runs, not only at the start of the bench.
        let mut device_beside = device_limit(&args.model)?;
        let report = compare(
            &config(llama_bench_command(&args, args.tokens), dir.clone())?,
            interrupted,
            progress,
        )?;
        device_beside.extend(device_limit(&args.model)?);
        let budget_device_bps = median(&mut device_beside).expect("six measurements");
        eprintln!(
            "bench:   device limit beside the runs {:.0} MB/s",
            budget_device_bps / 1e6
        );
        eprintln!("bench:   cold start to the first token (llama-completion -n 1)");
        let first_token = compare(
            &config(first_token_command(&args), dir.join("first-token"))?,
            interrupted,
            progress,
        )?;
        let first = &first_token.runs;
        let runs = &report.runs;
        let tps = |side| side_median(runs, side, |r| r.program.bench_tokens_per_s("tg"));
        let (floor_bytes_per_token, optimum) = floors.per_token(model_len, budget, args.tokens);
        let pager_bytes_per_token = pager_bytes_per_token(&args, budget, &dir)?;
        rows.push(Row {
            share,
            budget,
            kernel_tps: tps(Side::Kernel),
            pager_tps: tps(Side::Pager),
            pager_bytes_per_token,
            floor_bytes_per_token,
            optimum_bytes_per_token: optimum,
            device_bps: budget_device_bps,
            kernel_read_mb_s: side_median(runs, Side::Kernel, |r| Some(r.io.mean_bandwidth_mb_s)),
            pager_read_mb_s: side_median(runs, Side::Pager, |r| Some(r.io.mean_bandwidth_mb_s)),
            kernel_p50_us: latency_median(runs, Side::Kernel, |l| l.p50_us),
            kernel_p99_us: latency_median(runs, Side::Kernel, |l| l.p99_us),
            pager_p50_us: latency_median(runs, Side::Pager, |l| l.p50_us),
            pager_p99_us: latency_median(runs, Side::Pager, |l| l.p99_us),
            kernel_first_token_s: side_median(first, Side::Kernel, |r| Some(r.wall_s)),
            pager_first_token_s: side_median(first, Side::Pager, |r| Some(r.wall_s)),
            kernel_first_token_bytes: side_median(first, Side::Kernel, |r| {
                Some(r.io.bytes_read as f64)
            }),
            pager_first_token_bytes: side_median(first, Side::Pager, |r| {
                Some(r.io.bytes_read as f64)
            }),
        });
    }
    // Compute per token: the warm kernel run's, or the pager's with the model resident
    // (a budget above the model) when that is faster: its blocks are mapped as 2 MiB
    // pages, and the floor is the best the program has shown.
    let resident_tps = rows
        .iter()
        .filter(|row| row.budget >= model_len)
        .filter_map(|row| row.pager_tps)
        .fold(0.0, f64::max);
    let compute_s = 1.0 / warm_tps.max(resident_tps);
    let markdown = results_markdown(
        &args,
        Measured {
            len: model_len,
            sparse: matches!(floors, Floors::Trace(_)),
        },
        device_bps,
        &decode_share,
        warm_tps,
        compute_s,
        &rows,
    );
    let path = args.out.join("results.md");
    std::fs::write(&path, &markdown).with_context(|| format!("writing {}", path.display()))?;
    print!("{markdown}");
    Ok(())
}

/// Where each budget's floor comes from.
enum Floors {
    /// A dense model: every token reads the whole model, in the predicted order.
    Dense(Workload),
    /// A mixture of experts: a demand trace of the program, 2 MiB blocks.
    Trace(Workload),
}

impl Floors {
    /// (floor, optimum beside it) in bytes per token at `budget`; over the tokens the
    /// pager's bytes are measured on (`pager_bytes_per_token`) for a trace.
    fn per_token(&self, model_len: u64, budget: u64, tokens: u32) -> (f64, Option<f64>) {
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
}

/// Tokens the demand trace generates beyond those the pager's bytes are measured on.
const TRACE_EXTRA_TOKENS: u32 = 6;

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

/// The model benchmarked: its length, and whether it is a mixture of experts (whose
/// floors come from a demand trace).
#[derive(Clone, Copy)]
struct Measured {
    len: u64,
    sparse: bool,
}

fn results_markdown(
    args: &BenchArgs,
    model: Measured,
    device_bps: f64,
    decode_share: &DecodeShare,
    warm_tps: f64,
    compute_s: f64,
    rows: &[Row],
) -> String {
    let mib = |bytes: f64| bytes / (1 << 20) as f64;
    let opt =
        |v: Option<f64>, digits: usize| v.map_or("–".to_string(), |v| format!("{v:.digits$}"));
    let ratio = |pager: Option<f64>, kernel: Option<f64>| match (pager, kernel) {
        (Some(p), Some(k)) if k > 0.0 => Some(p / k),
        _ => None,
    };
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# Headline benchmark: llama-bench decode under a RAM budget\n"
    );
    let _ = writeln!(
        out,
        "Model `{}` ({:.0} MiB), llama-bench `-p 0 -n {} -t {} -r 1 --repack 0`, {} runs per side \
         and budget (medians), page cache dropped before every run. Device limit (io_uring \
         O_DIRECT 1 MiB reads, QD32, cold, median of 3) at the start: {:.0} MB/s; each budget's \
         floor uses the limit measured beside its decode runs (column \"device MB/s\": the \
         upper median of 3 measurements before them and 3 after). Reads shaped as the pager's \
         (2 MiB, two deep, landing across 1 GiB) beside a warm llama-bench tg (the model \
         resident, the program decoding): {:.0} MB/s against {:.0} alone just before ({:.0} \
         %): reads and decode share the memory. Warm decode without a \
         limit: {:.2} tok/s (fastest of 3 runs); compute per token, the faster of that and the \
         pager's with the model resident: {:.3} s. Kernel: the unchanged program in a memory \
         cgroup limited to the budget (page cache included); pager: `hyperoffload run \
         --budget` with the default policies.\n",
        args.model.display(),
        mib(model.len as f64),
        args.tokens,
        args.threads,
        args.runs,
        device_bps / 1e6,
        decode_share.during_bps / 1e6,
        decode_share.alone_bps / 1e6,
        decode_share.fraction() * 100.0,
        warm_tps,
        compute_s,
    );
    let (floor_column, optimum_column) = if model.sparse {
        ("Belady on the trace (MiB)", "frequency floor (MiB)")
    } else {
        ("M - B (MiB)", "optimum (sim, MiB)")
    };
    let _ = writeln!(
        out,
        "| budget | kernel tok/s | pager tok/s | pager/kernel | pager token time / floor | \
         device MB/s | token time / floor beside decode | pager bytes/token (MiB) | {floor_column} | {optimum_column} | read MB/s kernel / pager | \
         fault p50 us kernel / pager | fault p99 us kernel / pager |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for row in rows {
        let speedup =
            ratio(row.pager_tps, row.kernel_tps).map_or("–".into(), |r| format!("{r:.2}x"));
        let to_floor = |read_floor_s: f64| {
            row.pager_tps.map_or("–".to_string(), |tps| {
                format!("{:.2}", (1.0 / tps) / compute_s.max(read_floor_s))
            })
        };
        let _ = writeln!(
            out,
            "| {:.0}% ({:.0} MiB) | {} | {} | {} | {} | {:.0} | {} | {:.1} | {:.1} | {} | {} / {} | {} / {} | {} / {} |",
            row.share,
            mib(row.budget as f64),
            opt(row.kernel_tps, 2),
            opt(row.pager_tps, 2),
            speedup,
            to_floor(row.read_floor_s()),
            row.device_bps / 1e6,
            to_floor(row.read_floor_s() / decode_share.fraction()),
            mib(row.pager_bytes_per_token),
            mib(row.floor_bytes_per_token),
            opt(row.optimum_bytes_per_token.map(mib), 1),
            opt(row.kernel_read_mb_s, 0),
            opt(row.pager_read_mb_s, 0),
            opt(row.kernel_p50_us, 0),
            opt(row.pager_p50_us, 0),
            opt(row.kernel_p99_us, 0),
            opt(row.pager_p99_us, 0),
        );
    }
    let floor = if model.sparse {
        format!(
            "Floor: token time >= max(compute, floor bytes / device MB/s), where a mixture of \
             experts' floor bytes are Belady's policy replayed on a demand trace of the \
             program (llama-bench tg{} under `hyperoffload run --policy demand --block 2M \
             --budget 16M`: every block each token uses; `hyperoffload simulate --trace \
             demand-trace.csv --model M --policy belady`), in steady state: the trace replayed \
             twice, per pass of its second copy, when every expert used has been read once \
             (the pager's bytes, tokens 3 to {} of a cold run, still hold some first uses). \
             Frequency floor: the block the whole trace uses \
             least is evicted first (`--policy frequency`): the best a policy can do that \
             learns how often each expert runs but cannot foresee the router. Each pager run \
             saves what it learned of the experts beside the model and the next starts from \
             it: the bench removes the saved counts first, so its first pager run starts cold.",
            args.tokens + TRACE_EXTRA_TOKENS,
            args.tokens + 2
        )
    } else {
        "Floor: token time >= max(compute, (M - B) / device MB/s). Optimum: Belady's policy \
         replayed on the model's predicted order (`hyperoffload simulate --model --policy \
         belady`)."
            .to_string()
    };
    let _ = writeln!(
        out,
        "\n{floor} Beside decode: the device rate scaled by what it gives beside a decode (the \
         bound were every read made while the program computes; the target is the floor). \
         Pager bytes per token: two cold pager runs generating 2 and 2 + {} tokens, the \
         difference divided by {} (loading and warm-up cancel out). Per-budget reports with \
         plots: `budget-*/report.md`.",
        args.tokens, args.tokens
    );
    let _ = writeln!(
        out,
        "\n## Cold start to the first token\n\n`llama-completion -p \"{FIRST_TOKEN_PROMPT}\" -n 1 -c \
         256 -t {} --no-warmup --no-repack`, page cache dropped, {} runs per side (medians): wall \
         time from starting the program to its exit after the first token (loading, the \
         prompt's pass over the weights, one token), and the bytes it read from the device. \
         One pass reads the model once; loading that reads it whole (llama.cpp maps with \
         MAP_POPULATE) reads it twice when it does not fit.\n",
        args.threads, args.runs,
    );
    let _ = writeln!(
        out,
        "| budget | first token s kernel | first token s pager | pager/kernel | read MiB kernel | read MiB pager |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|");
    for row in rows {
        let _ = writeln!(
            out,
            "| {:.0}% ({:.0} MiB) | {} | {} | {} | {} | {} |",
            row.share,
            mib(row.budget as f64),
            opt(row.kernel_first_token_s, 2),
            opt(row.pager_first_token_s, 2),
            opt(ratio(row.pager_first_token_s, row.kernel_first_token_s), 2),
            opt(row.kernel_first_token_bytes.map(mib), 0),
            opt(row.pager_first_token_bytes.map(mib), 0),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Model length in these tests.
    const MODEL: u64 = 2 << 30;

    fn row(share: f64, pager_tps: Option<f64>) -> Row {
        Row {
            share,
            // M - B of 0.7 GB: 0.2 s at the row's 3.5 GB/s.
            budget: MODEL - 700_000_000,
            kernel_tps: Some(0.5),
            pager_tps,
            pager_bytes_per_token: 1e9,
            floor_bytes_per_token: 700_000_000.0,
            optimum_bytes_per_token: None,
            device_bps: 3.5e9,
            kernel_read_mb_s: None,
            pager_read_mb_s: None,
            kernel_p50_us: None,
            kernel_p99_us: None,
            pager_p50_us: None,
            pager_p99_us: None,
            kernel_first_token_s: None,
            pager_first_token_s: None,
            kernel_first_token_bytes: None,
            pager_first_token_bytes: None,
        }
    }

    fn dense() -> Measured {
        Measured {
            len: MODEL,
            sparse: false,
        }
    }

    fn args() -> BenchArgs {
        BenchArgs {
            model: "m.gguf".into(),
            llama_bin: "bin".into(),
            budgets: vec![50.0],
            runs: 3,
            tokens: 8,
            threads: 2,
            out: "bench".into(),
        }
    }

    #[test]
    fn every_row_has_the_headers_columns_and_both_floors() {
        let share = DecodeShare {
            alone_bps: 3.5e9,
            during_bps: 2.8e9,
        };
        // Token 0.25 s, floor max(0.1, 0.2): 1.25; beside decode the reads' floor is
        // 0.2 / 0.8 = 0.25: 1.00.
        let rows = [row(50.0, Some(4.0)), row(90.0, None)];
        let markdown = results_markdown(&args(), dense(), 3.6e9, &share, 10.0, 0.1, &rows);
        let table: Vec<&str> = markdown
            .lines()
            .skip_while(|line| !line.starts_with("| budget | kernel tok/s"))
            .take_while(|line| line.starts_with('|'))
            .collect();
        let columns = |line: &str| line.matches('|').count();
        assert_eq!(table.len(), 4, "{markdown}");
        assert!(
            table.iter().all(|line| columns(line) == columns(table[0])),
            "{markdown}"
        );
        let cells: Vec<&str> = table[2].split('|').map(str::trim).collect();
        assert_eq!(&cells[5..8], ["1.25", "3500", "1.00"], "{}", table[2]);
        let missing: Vec<&str> = table[3].split('|').map(str::trim).collect();
        assert_eq!(&missing[5..8], ["–", "3500", "–"], "{}", table[3]);
        assert!(markdown.contains("2800 MB/s against 3500 alone just before (80 %)"));
    }

    #[test]
    fn a_mixture_of_experts_is_held_to_the_trace_s_floors() {
        let share = DecodeShare {
            alone_bps: 3.5e9,
            during_bps: 3.5e9,
        };
        let mut moe = row(50.0, Some(4.0));
        // 35 MB a token at 3.5 GB/s: 0.01 s, below compute (0.1 s): 0.25 / 0.1.
        moe.floor_bytes_per_token = 35e6;
        let markdown = results_markdown(
            &args(),
            Measured {
                len: MODEL,
                sparse: true,
            },
            3.5e9,
            &share,
            10.0,
            0.1,
            &[moe],
        );
        assert!(
            markdown.contains("| Belady on the trace (MiB) | frequency floor (MiB) |"),
            "{markdown}"
        );
        assert!(
            markdown.contains("demand trace of the program"),
            "{markdown}"
        );
        let line = markdown.lines().find(|l| l.starts_with("| 50%")).unwrap();
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        assert_eq!((cells[5], cells[9]), ("2.50", "33.4"), "{line}");
    }

    fn run_record(side: Side, exit_code: i32, waited_p50_us: Option<f64>) -> RunRecord {
        let mut record = RunRecord {
            side,
            exit_code: Some(exit_code),
            ..Default::default()
        };
        if let Some(p50_us) = waited_p50_us {
            record.faults.waited_faults = 5;
            record.faults.latency.measured = 5;
            record.faults.latency.p50_us = p50_us;
        }
        record
    }

    #[test]
    fn latency_medians_skip_runs_without_a_waited_fault() {
        let runs = [
            run_record(Side::Kernel, 0, Some(100.0)),
            run_record(Side::Kernel, 0, None),
            run_record(Side::Kernel, 0, None),
            // A failed run does not count either.
            run_record(Side::Kernel, 1, Some(900.0)),
            run_record(Side::Pager, 0, None),
        ];
        let p50 = |side| latency_median(&runs, side, |l| l.p50_us);
        assert_eq!(p50(Side::Kernel), Some(100.0));
        assert_eq!(p50(Side::Pager), None);
    }

    #[test]
    fn cpu_seconds_counts_this_process_and_names_a_missing_one() {
        let before = cpu_seconds(std::process::id()).unwrap();
        let started = Instant::now();
        let mut spin = 0u64;
        let mut after = before;
        // Until the count moves by 0.2 s of CPU, or 10 s of a count that stays put.
        while after - before < 0.2 && started.elapsed() < Duration::from_secs(10) {
            for _ in 0..1_000_000 {
                spin = std::hint::black_box(spin.wrapping_add(1));
            }
            after = cpu_seconds(std::process::id()).unwrap();
        }
        assert!(
            after - before >= 0.2,
            "{before} -> {after} after 10 s of spinning"
        );
        // Past the kernel's largest pid (4194304).
        let error = cpu_seconds(u32::MAX).unwrap_err().to_string();
        assert!(
            error.contains(&format!("/proc/{}/stat", u32::MAX)),
            "{error}"
        );
    }
}
