//! `hyperoffload bench --remote SOURCE --model-key NAME`: a model in an object store,
//! read by llama-completion under `hyperoffload run` through `hyperoffload mount` (a
//! child process of this executable, as a node would run it), against the same model
//! downloaded whole and run from the local disk. Three parts, each optional (`--parts`):
//!
//! - `ttft`: time to the first token, cold (an empty cache tier, the page cache
//!   dropped), against downloading the whole object and then running;
//! - `decode`: llama's eval rate with a warm cache tier against the local copy;
//! - `fetch`: bytes fetched from the remote per token with a cache tier of half the
//!   model, against model - budget - cache tier.
//!
//! The arithmetic and results.md's section are `remote_figures`'; this is the runs.

use std::ffi::OsString;
use std::fs::File;
use std::io::{ErrorKind, Read as _, Seek as _, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use serde::Serialize;

use super::programs::completion_command;
use super::remote_figures::{
    fetch_floor, merge_section, per_token, remote_markdown, side_order, DecodeRow, FetchRow,
    RemoteSide, RemoteSummary, Spread, TtftRow,
};
use super::{budget_bytes, BenchArgs};
use crate::cli::compare::program_output::ProgramFigures;
use crate::cli::device::drop_page_cache;
use crate::cli::mount::remote::{ObjectInfo, Remote};
use hyperoffload::remote::retry::RetryPolicy;
use hyperoffload::remote::source::{check_name, Source};
use hyperoffload::size::format_size;

/// The remote bench's options (`bench --remote`).
#[derive(Args, Debug, Default)]
pub struct RemoteArgs {
    /// Benchmark a model in an object store instead of --model: `s3://BUCKET[/PREFIX]`
    /// or an `http(s)://` base URL, as `hyperoffload mount` takes it (S3 endpoint and
    /// keys from the AWS environment). Root: the cold runs drop the page cache.
    #[arg(id = "remote", long = "remote", value_name = "SOURCE", requires_all = ["model_key", "cache_dir"])]
    pub source: Option<String>,
    /// With --remote: the model's object, a path below SOURCE.
    #[arg(long, value_name = "NAME", requires = "remote")]
    pub model_key: Option<String>,
    /// With --remote: a directory on the local disk for the mount's cache tiers and the
    /// downloaded copy (the disk a node would keep models on).
    #[arg(long, value_name = "DIR", requires = "remote")]
    pub cache_dir: Option<PathBuf>,
    /// With --remote: the parts to run.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "ttft,decode,fetch"
    )]
    pub parts: Vec<Part>,
    /// With --remote: the fetch part's budget, in percent of the model (its cache tier
    /// holds 50 %, so the floor, model - budget - cache tier, needs less than 50).
    #[arg(long, default_value_t = 25.0)]
    pub fetch_budget: f64,
    /// With --remote: the fetch part's two runs generate 4 and 4 + this many tokens.
    #[arg(long, default_value_t = 8)]
    pub fetch_tokens: u32,
    /// With --remote: an argument for the mounts of the ttft and decode parts
    /// (repeatable), e.g. `--mount-arg=--no-passthrough`.
    #[arg(long = "mount-arg", value_name = "ARG", allow_hyphen_values = true)]
    pub mount_args: Vec<String>,
    /// With --remote: seconds a mount may take to come up (or to end after SIGTERM).
    #[arg(long, default_value_t = 60.0)]
    pub mount_timeout: f64,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    Ttft,
    Decode,
    Fetch,
}

/// Tokens of the fetch part's shorter run.
const FETCH_FIRST_TOKENS: u32 = 4;

/// One run of the program, for remote.json.
#[derive(Debug, Serialize)]
struct RunRecord {
    part: &'static str,
    side: RemoteSide,
    round: usize,
    budget: u64,
    tokens: u32,
    /// Wall time of the program under `hyperoffload run`.
    run_s: f64,
    /// Local side of ttft: the download before it.
    download_s: Option<f64>,
    /// Mount side: how long the mount took to come up (not in `run_s`).
    mount_start_s: Option<f64>,
    eval_tps: Option<f64>,
    /// Mount side: what its `--stats` say.
    mount: Option<MountStats>,
    /// Mount side: the stats file.
    mount_stats_file: Option<PathBuf>,
    text: String,
}

/// The figures of a mount's `--stats` the bench uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
struct MountStats {
    remote_bytes: u64,
    remote_gets: u64,
    read_bytes: u64,
    passthrough_opens: u64,
    fuse_opens: u64,
}

impl MountStats {
    fn from_json(json: &serde_json::Value) -> anyhow::Result<MountStats> {
        let field = |pointer: &str| {
            json.pointer(pointer)
                .and_then(serde_json::Value::as_u64)
                .with_context(|| format!("no {pointer} in the mount's stats"))
        };
        Ok(MountStats {
            remote_bytes: field("/remote/bytes")?,
            remote_gets: field("/remote/gets")?,
            read_bytes: field("/read_bytes")?,
            passthrough_opens: field("/passthrough_opens")?,
            fuse_opens: field("/fuse_opens/total")?,
        })
    }
}

/// What the bench measures against, resolved from the arguments.
struct Setup<'a> {
    args: &'a BenchArgs,
    source: &'a str,
    key: &'a str,
    object: ObjectInfo,
    exe: PathBuf,
    /// Per-run files: mount logs and stats.
    work: PathBuf,
    cache_dir: PathBuf,
    mount_point: PathBuf,
    /// The downloaded copy.
    local: PathBuf,
    mount_timeout: Duration,
}

pub(super) fn run(args: &BenchArgs) -> anyhow::Result<()> {
    let remote = &args.remote;
    let source_text = remote.source.as_deref().expect("checked by the caller");
    // clap requires both with --remote.
    let key = remote
        .model_key
        .as_deref()
        .context("--remote needs --model-key")?;
    let cache_dir = remote
        .cache_dir
        .as_deref()
        .context("--remote needs --cache-dir")?;
    if remote.parts.is_empty() {
        bail!("--parts: name at least one of ttft, decode, fetch");
    }
    if remote.fetch_tokens == 0 {
        bail!("--fetch-tokens must be at least 1");
    }
    if !(remote.fetch_budget > 0.0 && remote.fetch_budget < 50.0) {
        bail!(
            "--fetch-budget {}: must be above 0 and below 50 (the cache tier holds the other 50 %)",
            remote.fetch_budget
        );
    }
    if !(remote.mount_timeout.is_finite() && remote.mount_timeout > 0.0) {
        bail!("--mount-timeout {}: must be above 0", remote.mount_timeout);
    }
    if !args.llama_bin.join("llama-completion").is_file() {
        bail!(
            "{}: no llama-completion there (--llama-bin: llama.cpp's bin directory)",
            args.llama_bin.display()
        );
    }
    let source = Source::parse(source_text)?;
    check_name(key).context("--model-key")?;

    // The object's size and version, asked with the mount's client: a store that does
    // not answer, or an object that is not there, is said here, before any run.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the I/O runtime")?;
    let client = Remote::new(source, RetryPolicy::with_deadline(Duration::from_secs(15)))?;
    let object = runtime
        .block_on(client.head(key))
        .with_context(|| format!("the model {key} in {source_text}"))?;
    let file_name = Path::new(key)
        .file_name()
        .context("--model-key names no file")?;

    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let work = args.out.join("remote");
    std::fs::create_dir_all(&work).with_context(|| format!("creating {}", work.display()))?;
    std::fs::create_dir_all(cache_dir)
        .with_context(|| format!("creating {}", cache_dir.display()))?;
    let cache_dir = cache_dir
        .canonicalize()
        .with_context(|| cache_dir.display().to_string())?;
    let cold = drop_page_cache();
    if !cold {
        eprintln!("bench: cannot drop the page cache (not root?): the cold runs will not be cold");
    }
    let setup = Setup {
        args,
        source: source_text,
        key,
        exe: std::env::current_exe()?,
        work,
        mount_point: cache_dir.join("mnt"),
        local: cache_dir.join("download").join(file_name),
        cache_dir,
        mount_timeout: Duration::from_secs_f64(remote.mount_timeout),
        object,
    };
    eprintln!(
        "bench: {key} in {source_text} ({}), cache tiers and the local copy under {}",
        format_size(setup.object.size),
        setup.cache_dir.display()
    );
    crate::cli::compare::command::catch_interrupts();

    let budgets = args.budgets();
    let mut records = Vec::new();
    let mut summary = RemoteSummary {
        source: source_text.to_string(),
        key: key.to_string(),
        model_len: setup.object.size,
        runs: args.runs,
        tokens: args.tokens,
        threads: args.threads,
        mount_args: remote.mount_args.clone(),
        cold,
        ttft: Vec::new(),
        decode: Vec::new(),
        fetch: None,
        text_identical: true,
    };
    if remote.parts.contains(&Part::Ttft) {
        for &share in &budgets {
            summary
                .ttft
                .push(ttft(&setup, &client, &runtime, share, &mut records)?);
        }
    }
    // The local copy, downloaded by this run (ttft downloads it every round): one left
    // by an earlier run may be of another version of the object.
    let mut have_copy = remote.parts.contains(&Part::Ttft);
    if remote.parts.contains(&Part::Decode) {
        if !have_copy {
            download(&setup, &client, &runtime)?;
            have_copy = true;
        }
        warm_cache_tier(&setup)?;
        for &share in &budgets {
            summary.decode.push(decode(&setup, share, &mut records)?);
        }
    }
    if remote.parts.contains(&Part::Fetch) {
        if !have_copy {
            download(&setup, &client, &runtime)?;
        }
        summary.fetch = Some(fetch(&setup, &mut records)?);
    }
    summary.text_identical = texts_agree(&records);

    let json = serde_json::json!({ "summary": &summary, "runs": &records });
    let path = args.out.join("remote.json");
    std::fs::write(&path, serde_json::to_string_pretty(&json)? + "\n")
        .with_context(|| format!("writing {}", path.display()))?;
    let section = remote_markdown(&summary);
    let path = args.out.join("results.md");
    let existing = match std::fs::read_to_string(&path) {
        Ok(text) => Some(text),
        Err(error) if error.kind() == ErrorKind::NotFound => None,
        Err(error) => return Err(error).with_context(|| format!("reading {}", path.display())),
    };
    std::fs::write(&path, merge_section(existing.as_deref(), &section))
        .with_context(|| format!("writing {}", path.display()))?;
    print!("{section}");
    if !summary.text_identical {
        bail!("a run through the mount printed another text than the local run's (remote.json)");
    }
    Ok(())
}

/// Whether every mount run's text is the local runs' of its part and token count.
fn texts_agree(records: &[RunRecord]) -> bool {
    records
        .iter()
        .filter(|r| r.side == RemoteSide::Mount)
        .all(|mounted| {
            records
                .iter()
                .filter(|r| {
                    r.side == RemoteSide::Local
                        && r.part == mounted.part
                        && r.tokens == mounted.tokens
                })
                .all(|local| local.text == mounted.text)
        })
}

fn interrupted() -> anyhow::Result<()> {
    if crate::cli::compare::command::INTERRUPTED.load(std::sync::atomic::Ordering::Relaxed) {
        bail!("interrupted");
    }
    Ok(())
}

/// Downloads the object to the local copy; returns the seconds it took.
fn download(
    setup: &Setup,
    client: &Remote,
    runtime: &tokio::runtime::Runtime,
) -> anyhow::Result<f64> {
    if let Some(dir) = setup.local.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let _ = std::fs::remove_file(&setup.local);
    let started = Instant::now();
    runtime
        .block_on(client.download(&setup.object, &setup.local))
        .with_context(|| format!("downloading {} from {}", setup.key, setup.source))?;
    Ok(started.elapsed().as_secs_f64())
}

/// A cache tier directory under --cache-dir, emptied.
fn empty_tier(setup: &Setup, name: &str) -> anyhow::Result<PathBuf> {
    let dir = setup.cache_dir.join(name);
    match std::fs::remove_dir_all(&dir) {
        Ok(()) => {}
        Err(error) if error.kind() == ErrorKind::NotFound => {}
        Err(error) => return Err(error).with_context(|| format!("emptying {}", dir.display())),
    }
    Ok(dir)
}

/// Time to the first token at `share` percent of the model.
fn ttft(
    setup: &Setup,
    client: &Remote,
    runtime: &tokio::runtime::Runtime,
    share: f64,
    records: &mut Vec<RunRecord>,
) -> anyhow::Result<TtftRow> {
    let budget = budget_bytes(setup.object.size, share);
    eprintln!(
        "bench: time to the first token, cold, budget {share}% ({})",
        format_size(budget)
    );
    let (mut mount_s, mut local_s, mut download_s, mut run_s, mut fetched) =
        (vec![], vec![], vec![], vec![], vec![]);
    for round in 1..=setup.args.runs {
        for side in side_order(round) {
            interrupted()?;
            drop_page_cache();
            let record = match side {
                RemoteSide::Mount => {
                    let tier = empty_tier(setup, "cache-cold")?;
                    let name = format!("ttft-{share}pct-{round}");
                    let mount = MountChild::start(setup, &tier, None, true, &name)?;
                    let run = completion(setup, &mount.file(setup.key), 1, budget, false);
                    let up = mount.up_s;
                    let (stats, stats_file) = mount.stop()?;
                    let run = run?;
                    mount_s.push(run.wall_s);
                    fetched.push(stats.remote_bytes as f64);
                    RunRecord {
                        mount: Some(stats),
                        mount_stats_file: Some(stats_file),
                        mount_start_s: Some(up),
                        ..run.record("ttft", side, round, budget, 1)
                    }
                }
                RemoteSide::Local => {
                    let got = download(setup, client, runtime)?;
                    let run = completion(setup, &setup.local, 1, budget, false)?;
                    download_s.push(got);
                    run_s.push(run.wall_s);
                    local_s.push(got + run.wall_s);
                    RunRecord {
                        download_s: Some(got),
                        ..run.record("ttft", side, round, budget, 1)
                    }
                }
            };
            eprintln!(
                "bench:   {} round {round}: {}",
                side_name("ttft", side),
                describe(&record)
            );
            records.push(record);
        }
    }
    Ok(TtftRow {
        share,
        budget,
        mount_s: Spread::of(&mount_s),
        local_s: Spread::of(&local_s),
        download_s: Spread::of(&download_s),
        local_run_s: Spread::of(&run_s),
        mount_remote_bytes: Spread::of(&fetched),
    })
}

/// The warm cache tier of the decode part: the whole object read through a mount once.
fn warm_cache_tier(setup: &Setup) -> anyhow::Result<()> {
    let tier = empty_tier(setup, "cache-warm")?;
    eprintln!("bench: filling the warm cache tier {}", tier.display());
    let mount = MountChild::start(setup, &tier, None, false, "decode-fill")?;
    let file = mount.file(setup.key);
    let copied = File::open(&file)
        .and_then(|mut f| std::io::copy(&mut f, &mut std::io::sink()))
        .with_context(|| format!("reading {} through the mount", file.display()));
    mount.stop()?;
    let copied = copied?;
    if copied != setup.object.size {
        bail!(
            "{}: read {copied} bytes through the mount, the object has {}",
            file.display(),
            setup.object.size
        );
    }
    Ok(())
}

/// Decode speed at `share` percent of the model: warm cache tier against the local copy.
fn decode(setup: &Setup, share: f64, records: &mut Vec<RunRecord>) -> anyhow::Result<DecodeRow> {
    let budget = budget_bytes(setup.object.size, share);
    let tokens = setup.args.tokens;
    eprintln!(
        "bench: decode, warm cache tier, budget {share}% ({})",
        format_size(budget)
    );
    let tier = setup.cache_dir.join("cache-warm");
    let (mut mount_tps, mut local_tps, mut fetched) = (vec![], vec![], vec![]);
    for round in 1..=setup.args.runs {
        for side in side_order(round) {
            interrupted()?;
            let record = match side {
                RemoteSide::Mount => {
                    let name = format!("decode-{share}pct-{round}");
                    let mount = MountChild::start(setup, &tier, None, true, &name)?;
                    let run = completion(setup, &mount.file(setup.key), tokens, budget, true);
                    let up = mount.up_s;
                    let (stats, stats_file) = mount.stop()?;
                    let run = run?;
                    mount_tps.extend(run.eval_tps);
                    fetched.push(stats.remote_bytes as f64);
                    RunRecord {
                        mount: Some(stats),
                        mount_stats_file: Some(stats_file),
                        mount_start_s: Some(up),
                        ..run.record("decode", side, round, budget, tokens)
                    }
                }
                RemoteSide::Local => {
                    let run = completion(setup, &setup.local, tokens, budget, true)?;
                    local_tps.extend(run.eval_tps);
                    run.record("decode", side, round, budget, tokens)
                }
            };
            eprintln!(
                "bench:   {} round {round}: {}",
                side_name("decode", side),
                describe(&record)
            );
            records.push(record);
        }
    }
    Ok(DecodeRow {
        share,
        budget,
        mount_tps: Spread::of(&mount_tps),
        local_tps: Spread::of(&local_tps),
        mount_remote_bytes: Spread::of(&fetched),
    })
}

/// Bytes fetched per token with a cache tier of half the model, at the fetch budget;
/// one local run of each length beside, for the texts.
fn fetch(setup: &Setup, records: &mut Vec<RunRecord>) -> anyhow::Result<FetchRow> {
    let remote = &setup.args.remote;
    let model = setup.object.size;
    let budget = budget_bytes(model, remote.fetch_budget);
    let cache = model / 2;
    let lengths = [FETCH_FIRST_TOKENS, FETCH_FIRST_TOKENS + remote.fetch_tokens];
    eprintln!(
        "bench: bytes fetched per token, cache tier {}, budget {}% ({})",
        format_size(cache),
        remote.fetch_budget,
        format_size(budget)
    );
    let mut per = Vec::new();
    for round in 1..=setup.args.runs {
        let mut fetched = Vec::new();
        for tokens in lengths {
            interrupted()?;
            let tier = empty_tier(setup, "cache-half")?;
            drop_page_cache();
            let name = format!("fetch-{round}-{tokens}-tokens");
            // The mount's defaults: the figure is the cache tier's and the pager's.
            let mount = MountChild::start(setup, &tier, Some(cache), false, &name)?;
            let run = completion(setup, &mount.file(setup.key), tokens, budget, true);
            let up = mount.up_s;
            let (stats, stats_file) = mount.stop()?;
            let run = run?;
            fetched.push(stats.remote_bytes);
            let record = RunRecord {
                mount: Some(stats),
                mount_stats_file: Some(stats_file),
                mount_start_s: Some(up),
                ..run.record("fetch", RemoteSide::Mount, round, budget, tokens)
            };
            eprintln!(
                "bench:   fetch round {round}, -n {tokens}: {}",
                describe(&record)
            );
            records.push(record);
        }
        let bytes = per_token(fetched[0], fetched[1], remote.fetch_tokens);
        eprintln!(
            "bench:   fetch round {round}: {} per token",
            format_size(bytes.max(0.0) as u64)
        );
        per.push(bytes);
    }
    // The local texts of both lengths, to check the mount's against.
    for tokens in lengths {
        interrupted()?;
        let run = completion(setup, &setup.local, tokens, budget, true)?;
        records.push(run.record("fetch", RemoteSide::Local, 1, budget, tokens));
    }
    Ok(FetchRow {
        share: remote.fetch_budget,
        budget,
        cache,
        tokens: (lengths[0], lengths[1]),
        per_token: Spread::of(&per),
        floor: fetch_floor(model, budget, cache),
    })
}

fn side_name(part: &str, side: RemoteSide) -> &'static str {
    match (part, side) {
        (_, RemoteSide::Mount) => "mount",
        ("ttft", RemoteSide::Local) => "download then run",
        (_, RemoteSide::Local) => "local",
    }
}

fn describe(record: &RunRecord) -> String {
    let mut text = format!("run {:.2} s", record.run_s);
    if let Some(up) = record.mount_start_s {
        text += &format!(" (the mount up in {up:.2} s before)");
    }
    if let Some(download) = record.download_s {
        text += &format!(" after a download of {download:.2} s");
    }
    if let Some(tps) = record.eval_tps {
        text += &format!(", {tps:.2} tok/s");
    }
    if let Some(stats) = &record.mount {
        text += &format!(
            ", fetched {} in {} GETs, {} read through the mount, {} opens passed through",
            format_size(stats.remote_bytes),
            stats.remote_gets,
            format_size(stats.read_bytes),
            stats.passthrough_opens
        );
    }
    text
}

/// One program run's outcome.
struct Completion {
    wall_s: f64,
    eval_tps: Option<f64>,
    text: String,
}

impl Completion {
    fn record(
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
fn completion(
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
fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// `hyperoffload mount` of the source, a child process of this executable, serving the
/// model object; unmounted with SIGTERM by `stop` (or, on an error path, when dropped).
struct MountChild<'a> {
    setup: &'a Setup<'a>,
    child: Option<Child>,
    log: PathBuf,
    stats: PathBuf,
    /// Seconds it took to come up.
    up_s: f64,
}

impl<'a> MountChild<'a> {
    /// Starts the mount on the setup's mount point with `tier` as its cache directory
    /// and waits for its "mounted" line, at most --mount-timeout. `extra`: the
    /// --mount-arg arguments too. `name`: of its log and stats files.
    fn start(
        setup: &'a Setup<'a>,
        tier: &Path,
        cache_size: Option<u64>,
        extra: bool,
        name: &str,
    ) -> anyhow::Result<MountChild<'a>> {
        prepare_mount_point(&setup.mount_point)?;
        let log = setup.work.join(format!("mount-{name}.log"));
        let stats = setup.work.join(format!("mount-{name}.stats.json"));
        let _ = std::fs::remove_file(&stats);
        let mut command = Command::new(&setup.exe);
        command
            .arg("mount")
            .arg(setup.source)
            .arg(&setup.mount_point)
            .arg("--cache-dir")
            .arg(tier)
            .arg("--object")
            .arg(setup.key)
            .arg("--stats")
            .arg(&stats);
        if let Some(size) = cache_size {
            command.arg("--cache-size").arg(format!("{size}B"));
        }
        if extra {
            command.args(&setup.args.remote.mount_args);
        }
        let started = Instant::now();
        let child = command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(File::create(&log).with_context(|| format!("creating {}", log.display()))?)
            .spawn()
            .context("starting hyperoffload mount")?;
        let mut mount = MountChild {
            setup,
            child: Some(child),
            log,
            stats,
            up_s: 0.0,
        };
        loop {
            if mount.log_text().contains("hyperoffload: mounted") {
                mount.up_s = started.elapsed().as_secs_f64();
                return Ok(mount);
            }
            let child = mount.child.as_mut().expect("running");
            if let Some(status) = child.try_wait()? {
                mount.child = None;
                bail!(
                    "hyperoffload mount ended ({status}) before it was up:\n{}",
                    tail(&mount.log_text(), 20)
                );
            }
            if started.elapsed() > setup.mount_timeout {
                let log = tail(&mount.log_text(), 20);
                drop(mount);
                bail!(
                    "hyperoffload mount was not up in {} s (--mount-timeout); its log:\n{log}",
                    setup.mount_timeout.as_secs_f64()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn file(&self, key: &str) -> PathBuf {
        self.setup.mount_point.join(key)
    }

    fn log_text(&self) -> String {
        let mut text = String::new();
        if let Ok(mut file) = File::open(&self.log) {
            // The last 64 KiB are enough for the lines looked for.
            let len = file.metadata().map(|m| m.len()).unwrap_or(0);
            let _ = file.seek(SeekFrom::Start(len.saturating_sub(64 << 10)));
            let mut bytes = Vec::new();
            let _ = file.read_to_end(&mut bytes);
            text = String::from_utf8_lossy(&bytes).into_owned();
        }
        text
    }

    /// Unmounts (SIGTERM) and returns the mount's stats and their file.
    fn stop(mut self) -> anyhow::Result<(MountStats, PathBuf)> {
        let status = self.end()?;
        if !status.success() {
            bail!(
                "hyperoffload mount ended {status}:\n{}",
                tail(&self.log_text(), 20)
            );
        }
        let text = std::fs::read_to_string(&self.stats).with_context(|| {
            format!(
                "the mount's stats {}; its log:\n{}",
                self.stats.display(),
                tail(&self.log_text(), 20)
            )
        })?;
        let json: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("parsing {}", self.stats.display()))?;
        Ok((MountStats::from_json(&json)?, self.stats.clone()))
    }

    /// SIGTERM, then waits at most --mount-timeout; after that SIGKILL and a lazy
    /// unmount, and an error.
    fn end(&mut self) -> anyhow::Result<std::process::ExitStatus> {
        let mut child = self.child.take().context("the mount was stopped already")?;
        // SAFETY: kill(2) on our own child, not reaped yet (its pid is not reused).
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        let started = Instant::now();
        loop {
            if let Some(status) = child.try_wait()? {
                if !status.success() {
                    // Killed by the signal before it could unmount, say while starting.
                    detach_if_stale(&self.setup.mount_point)?;
                }
                return Ok(status);
            }
            if started.elapsed() > self.setup.mount_timeout {
                let _ = child.kill();
                let _ = child.wait();
                let _ = hyperoffload::sys::files::unmount_lazy(&self.setup.mount_point);
                bail!(
                    "hyperoffload mount did not end in {} s after SIGTERM (killed):\n{}",
                    self.setup.mount_timeout.as_secs_f64(),
                    tail(&self.log_text(), 20)
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for MountChild<'_> {
    fn drop(&mut self) {
        if self.child.is_some() {
            if let Err(error) = self.end() {
                eprintln!("bench: {error}");
            }
        }
    }
}

/// The mount point, made if need be; a mount left there by an earlier run that died
/// (its directory answers ENOTCONN) is detached first.
fn prepare_mount_point(dir: &Path) -> anyhow::Result<()> {
    detach_if_stale(dir)?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))
}

/// Detaches a FUSE mount on `dir` whose process is gone (the directory answers
/// ENOTCONN): a mount killed before it could unmount leaves one.
fn detach_if_stale(dir: &Path) -> anyhow::Result<()> {
    if let Err(error) = std::fs::metadata(dir) {
        if error.raw_os_error() == Some(libc::ENOTCONN) {
            eprintln!("bench: {}: a stale mount, detached", dir.display());
            hyperoffload::sys::files::unmount_lazy(dir)
                .with_context(|| format!("detaching the stale mount {}", dir.display()))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mount_stats_are_read_from_the_mount_s_json() {
        let json = serde_json::json!({
            "passthrough_opens": 2,
            "fuse_opens": {"off": 0, "total": 3},
            "reads": 10,
            "read_bytes": 4096,
            "remote": {"heads": 1, "gets": 5, "bytes": 1000, "retries": 0, "failures": 0},
            "cache": {},
        });
        assert_eq!(
            MountStats::from_json(&json).unwrap(),
            MountStats {
                remote_bytes: 1000,
                remote_gets: 5,
                read_bytes: 4096,
                passthrough_opens: 2,
                fuse_opens: 3,
            }
        );
        let error = MountStats::from_json(&serde_json::json!({"remote": {}})).unwrap_err();
        assert!(error.to_string().contains("/remote/bytes"), "{error}");
    }

    fn record(part: &'static str, side: RemoteSide, tokens: u32, text: &str) -> RunRecord {
        Completion {
            wall_s: 1.0,
            eval_tps: None,
            text: text.into(),
        }
        .record(part, side, 1, 0, tokens)
    }

    #[test]
    fn texts_are_compared_per_part_and_length() {
        use RemoteSide::*;
        let mut records = vec![
            record("fetch", Mount, 4, "a"),
            record("fetch", Mount, 12, "a b"),
            record("fetch", Local, 4, "a"),
            record("fetch", Local, 12, "a b"),
            record("ttft", Mount, 1, "x"),
            record("ttft", Local, 1, "x"),
        ];
        assert!(texts_agree(&records));
        records.push(record("ttft", Mount, 1, "y"));
        assert!(!texts_agree(&records));
    }

    #[test]
    fn tail_keeps_the_last_lines() {
        assert_eq!(tail("a\nb\nc\n", 2), "b\nc");
        assert_eq!(tail("a", 5), "a");
    }
}
