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
//! The arithmetic and results.md's section are `remote_figures`'; this is the runs:
//! here the options, the setup and the mount (a child process) the runs read through;
//! the parts' rounds in `parts`, one program run in `completion`, what each run
//! records in `record`.

mod completion;
mod parts;
mod record;

use std::fs::File;
use std::io::{ErrorKind, Read as _, Seek as _, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use serde::Serialize;

use super::remote_figures::{merge_section, remote_markdown, RemoteSummary};
use super::BenchArgs;
use crate::cli::device::drop_page_cache;
use crate::cli::mount::remote::{ObjectInfo, Remote};
use completion::tail;
use hyperoffload::remote::retry::RetryPolicy;
use hyperoffload::remote::source::{check_name, Source};
use hyperoffload::size::format_size;
use record::{texts_agree, RunRecord};

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
    /// Whether the page cache could be dropped (the cold runs are cold).
    cold: bool,
}

/// The bench's options, checked: the source's text, the model's key and the cache
/// directory.
fn checked_options(args: &BenchArgs) -> anyhow::Result<(&str, &str, &Path)> {
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
    Ok((source_text, key, cache_dir))
}

impl<'a> Setup<'a> {
    /// The setup for `object`: the output and cache directories made, the page cache
    /// dropped once to learn whether the cold runs can be cold.
    fn prepare(
        args: &'a BenchArgs,
        source: &'a str,
        key: &'a str,
        object: ObjectInfo,
        cache_dir: &Path,
    ) -> anyhow::Result<Setup<'a>> {
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
            eprintln!(
                "bench: cannot drop the page cache (not root?): the cold runs will not be cold"
            );
        }
        Ok(Setup {
            args,
            source,
            key,
            exe: std::env::current_exe()?,
            work,
            mount_point: cache_dir.join("mnt"),
            local: cache_dir.join("download").join(file_name),
            cache_dir,
            mount_timeout: Duration::from_secs_f64(args.remote.mount_timeout),
            object,
            cold,
        })
    }
}

pub(super) fn run(args: &BenchArgs) -> anyhow::Result<()> {
    let (source_text, key, cache_dir) = checked_options(args)?;
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
    let setup = Setup::prepare(args, source_text, key, object, cache_dir)?;
    eprintln!(
        "bench: {key} in {source_text} ({}), cache tiers and the local copy under {}",
        format_size(setup.object.size),
        setup.cache_dir.display()
    );
    crate::cli::compare::command::catch_interrupts();

    let mut records = Vec::new();
    let summary = run_parts(&setup, &client, &runtime, &mut records)?;
    write_results(args, &summary, &records)?;
    if !summary.text_identical {
        bail!("a run through the mount printed another text than the local run's (remote.json)");
    }
    Ok(())
}

/// Runs the parts --parts names, each run's record added to `records`; what they
/// measured.
fn run_parts(
    setup: &Setup,
    client: &Remote,
    runtime: &tokio::runtime::Runtime,
    records: &mut Vec<RunRecord>,
) -> anyhow::Result<RemoteSummary> {
    let args = setup.args;
    let remote = &args.remote;
    let budgets = args.budgets();
    let mut summary = RemoteSummary {
        source: setup.source.to_string(),
        key: setup.key.to_string(),
        model_len: setup.object.size,
        runs: args.runs,
        tokens: args.tokens,
        threads: args.threads,
        mount_args: remote.mount_args.clone(),
        cold: setup.cold,
        ttft: Vec::new(),
        decode: Vec::new(),
        fetch: None,
        text_identical: true,
    };
    if remote.parts.contains(&Part::Ttft) {
        for &share in &budgets {
            summary
                .ttft
                .push(parts::ttft(setup, client, runtime, share, records)?);
        }
    }
    // The local copy, downloaded by this run (ttft downloads it every round): one left
    // by an earlier run may be of another version of the object.
    let mut have_copy = remote.parts.contains(&Part::Ttft);
    if remote.parts.contains(&Part::Decode) {
        if !have_copy {
            parts::download(setup, client, runtime)?;
            have_copy = true;
        }
        parts::warm_cache_tier(setup)?;
        for &share in &budgets {
            summary.decode.push(parts::decode(setup, share, records)?);
        }
    }
    if remote.parts.contains(&Part::Fetch) {
        if !have_copy {
            parts::download(setup, client, runtime)?;
        }
        summary.fetch = Some(parts::fetch(setup, records)?);
    }
    summary.text_identical = texts_agree(records);
    Ok(summary)
}

/// Writes remote.json (the summary and every run) and the remote section of results.md,
/// and prints the section.
fn write_results(
    args: &BenchArgs,
    summary: &RemoteSummary,
    records: &[RunRecord],
) -> anyhow::Result<()> {
    let json = serde_json::json!({ "summary": summary, "runs": records });
    let path = args.out.join("remote.json");
    std::fs::write(&path, serde_json::to_string_pretty(&json)? + "\n")
        .with_context(|| format!("writing {}", path.display()))?;
    let section = remote_markdown(summary);
    let path = args.out.join("results.md");
    let existing = match std::fs::read_to_string(&path) {
        Ok(text) => Some(text),
        Err(error) if error.kind() == ErrorKind::NotFound => None,
        Err(error) => return Err(error).with_context(|| format!("reading {}", path.display())),
    };
    std::fs::write(&path, merge_section(existing.as_deref(), &section))
        .with_context(|| format!("writing {}", path.display()))?;
    print!("{section}");
    Ok(())
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
}
