//! `hyperoffload run`: runs an unmodified program with the LD_PRELOAD shim, so that its
//! model files are served by the pager within a budget, then summarises what the pager
//! did.
//!
//! - The shim is `libhyperoffload_preload.so` beside this executable (`cargo build
//!   --release --workspace` puts it there), or the file `HYPEROFFLOAD_SHIM` names.
//! - Statically linked and setuid/setgid programs are refused: LD_PRELOAD cannot reach
//!   them.
//! - Programs the target executes do not get the shim (each would get a budget of its
//!   own) unless `--inherit`; forked children that do not exec never use it.
//! - SIGTERM, SIGHUP, SIGINT and SIGQUIT sent to the launcher go to the program (see
//!   `forward`). When a signal ends it, the shim has run no exit handler: the summary
//!   comes from the stats snapshot it wrote last (`closing`), and names the signal.
//! - Each model file the program opened or mapped and the pager did not serve gets a line
//!   saying why (`served_files`, from what the shim recorded), before the summary.
//! - The exit status is the program's; if a signal killed it, the launcher kills itself
//!   with the same signal (so a shell sees the same thing), or exits with 128 + N if it
//!   survives that. With `--require-served`, a run that served nothing exits with
//!   `NOTHING_SERVED` instead, whatever the program's status.
//!
//! The private directory the shim writes into is `private_dir`'s; reading what it left
//! there, `shim_records`'.

use std::ffi::OsString;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, ExitStatus};

use anyhow::{bail, Context};
use hyperoffload::budget::{floor, memory_limits};
use hyperoffload::budget_check::check_budget;
use hyperoffload::policy_name::{check_policy_name, DEFAULT_POLICY, POLICY_NAMES};
use hyperoffload::shim_config::{parse_block_size, BudgetSpec, ShimConfig, ALL_VARS};

use super::child::end_with_this_process;
use super::closing::{closing_lines, kept_stats, require_served_line, Outcome};
use super::exec_check::{check_reachable, resolve_program};
use super::exit_status::ending;
use super::forward;
use hyperoffload::keeper::serve::{KeeperThread, KeptChildren};
use private_dir::PrivateDir;
use shim_records::{last_snapshot, seen_files};

mod private_dir;
mod shim_records;

/// The shim's file name.
pub const SHIM_FILE: &str = "libhyperoffload_preload.so";

/// The exit status of a `--require-served` run that served nothing.
pub const NOTHING_SERVED: u8 = 3;

#[derive(clap::Args)]
#[command(trailing_var_arg = true)]
pub struct RunArgs {
    /// RAM for the model's pages: a size (48M, 2G; a number without a unit is bytes,
    /// from 1M) or a percentage of the size of the model of the first file the program
    /// maps (50%): that file, or every part of the split GGUF it belongs to. Raised to
    /// two blocks for each CPU, below which the program could not make progress.
    /// `auto` (the default): what the process can have when the pager starts (the
    /// memory available, and what its memory cgroup can still give) less a quarter of
    /// that (at least 256M) for the program's own memory; while
    /// the program runs it follows memory pressure: smaller at once when the machine or
    /// the cgroup has less to spare or the kernel reports pressure, larger in steps when
    /// that eases.
    #[arg(long, value_parser = budget_arg)]
    budget: Option<BudgetSpec>,
    /// With `--budget auto`: the most the budget grows to (default: the RAM less a
    /// quarter).
    #[arg(long, value_parser = super::size_arg)]
    max: Option<u64>,
    /// With `--budget auto`: the least the budget gives back to (default, and never
    /// less: two blocks for each CPU, below which the program could not make progress).
    #[arg(long, value_parser = super::size_arg)]
    min: Option<u64>,
    /// Files to serve, by name (a glob; on the whole path if it contains a /). Repeat
    /// for several. Default: *.gguf and *.safetensors. A file of any name that starts
    /// as a GGUF or safetensors file does is served too.
    #[arg(long = "match", value_name = "GLOB")]
    patterns: Vec<String>,
    /// Smaller files are left to the kernel (a part of a split GGUF counts the whole
    /// model's size).
    #[arg(long, value_parser = super::size_arg, default_value = "64M")]
    min_size: u64,
    /// Prefetch and eviction policy.
    #[arg(long, default_value = DEFAULT_POLICY, value_parser = policy_arg)]
    policy: String,
    /// Block size (a power of two from 4K to 1G). Default: 2M with zero copy and a
    /// budget of at least 16M, else 4K.
    #[arg(long, value_parser = block_arg)]
    block: Option<u64>,
    /// Threads installing prefetched reads beside the fault service thread (0: none).
    /// Default: the pager's.
    #[arg(long, value_parser = clap::value_parser!(u16).range(0..=16))]
    install_threads: Option<u16>,
    /// Copy blocks in rather than map them from a huge-page store (zero copy needs
    /// blocks of a multiple of 2M and CAP_SYS_ADMIN; without either it copies anyway).
    #[arg(long)]
    no_zero_copy: bool,
    /// Cut blocks on the block-size grid alone, not also at each routed expert's slice
    /// of a mixture-of-experts model (where a block would hold several experts, a token
    /// then reads the neighbours of the experts it runs).
    #[arg(long)]
    no_expert_blocks: bool,
    /// Learn a mixture of experts' routing from this run alone: neither start from the
    /// expert use an earlier run saved beside the model nor save this run's.
    #[arg(long)]
    fresh_experts: bool,
    /// Also write the pager's stats (JSON) to this new file.
    #[arg(long)]
    stats: Option<PathBuf>,
    /// Write the shim's mapping events (JSON lines) to this new file.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Let programs the target executes use the shim too (each with its own budget).
    #[arg(long)]
    inherit: bool,
    /// When children of `fork` are served through the pager, sharing the parent's
    /// resident blocks and budget: `at-fork` (the default) maps blocks zero copy until
    /// the program first forks, then makes its regions inheritable (the fork waits
    /// while the resident blocks are written into them, about 0.3 s a GiB, and blocks
    /// are read in place from then on); `always` (or the flag alone) does so from the
    /// start; `never` leaves a forked child to map the model files from the page cache,
    /// outside the budget. Children still alive when the program ends, however it ends,
    /// get the whole of the models they map, beyond the budget, and one message; this
    /// process keeps them and serves them until they exit, and only then returns.
    #[arg(
        long,
        value_enum,
        value_name = "WHEN",
        default_value_t = ServeForks::AtFork,
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "always"
    )]
    serve_forks: ServeForks,
    /// Say what the shim takes over and why not.
    #[arg(long, short)]
    verbose: bool,
    /// Print no summary.
    #[arg(long, short)]
    quiet: bool,
    /// Exit with status 3 if the pager served no file (the program read its model
    /// rather than mapped it, mapped it writable, ...: the lines before the summary say
    /// why), whatever the program's own status.
    #[arg(long)]
    require_served: bool,
    /// The program and its arguments.
    #[arg(required = true, value_name = "PROGRAM")]
    command: Vec<OsString>,
}

pub(super) fn budget_arg(text: &str) -> Result<BudgetSpec, String> {
    BudgetSpec::parse(text).map_err(|error| error.to_string())
}

pub(super) fn block_arg(text: &str) -> Result<u64, String> {
    parse_block_size(text).map_err(|error| error.to_string())
}

pub(super) fn policy_arg(text: &str) -> Result<String, String> {
    check_policy_name(text)
        .map(|_| text.to_string())
        .map_err(|error| {
            let list: Vec<String> = POLICY_NAMES
                .iter()
                .map(|(name, what)| format!("{name}: {what}"))
                .collect();
            format!("{error}\n  {}", list.join("\n  "))
        })
}

/// When forked children are served (`--serve-forks`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ServeForks {
    /// From the program's first fork on.
    AtFork,
    /// From the start.
    Always,
    /// Never: children map the files from the page cache.
    Never,
}

pub fn run(args: RunArgs) -> anyhow::Result<ExitCode> {
    let shim = find_shim()?;
    let program = resolve_program(&args.command[0])?;
    check_reachable(&program)
        .with_context(|| format!("cannot run {} under the pager", program.display()))?;
    refuse_existing_outputs(&args)?;
    let private = PrivateDir::create()?;
    let shim_stats = private.0.join("stats.json");
    let mut config = shim_config(&args, &shim_stats)?;
    if config.inherit {
        // The processes of the run meet there to share the models they map
        // (`hyperoffload::share`).
        let dir = private.0.join("share");
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&dir)
            .with_context(|| format!("cannot create {}", dir.display()))?;
        config.share_dir = Some(dir);
    }
    let command = program_command(&args, &config, &shim);
    let keep_children = config.serve_forks || config.serve_forks_at_fork;
    let ended = run_supervised(command, &program, keep_children)?;
    let stats = std::fs::read_to_string(&shim_stats).ok();
    let snapshot = stats
        .is_none()
        .then(|| last_snapshot(&private.0, ended.pid))
        .flatten();
    let seen = seen_files(&private.0, ended.pid);
    let how = ending(ended.status);
    let outcome = Outcome {
        ending: &how,
        passed_on: ended.passed_on,
        stats: stats.as_deref(),
        snapshot: snapshot.as_deref(),
        seen: seen.as_ref(),
        patterns: &config.patterns,
        inherit: config.inherit,
    };
    let refused = args.require_served && !outcome.served();
    if !args.quiet || refused {
        for line in closing_lines(&outcome) {
            eprintln!("hyperoffload: {line}");
        }
    }
    if let (Some(json), Some(path)) = (kept_stats(&outcome), &args.stats) {
        write_new(path, json.as_bytes())
            .with_context(|| format!("cannot write --stats {}", path.display()))?;
    }
    drop(private);
    // Forked children the program served that outlive it are served by this process
    // until they exit (see `keep_children`).
    if let Some(kept) = ended.kept {
        kept.wait();
    }
    if refused {
        eprintln!(
            "hyperoffload: {}",
            require_served_line(seen.as_ref(), config.budget, NOTHING_SERVED)
        );
        return Ok(ExitCode::from(NOTHING_SERVED));
    }
    Ok(super::exit_status::pass_through(ended.status))
}

/// Refuses a run that would overwrite a file: the shim refuses to (with a message on
/// stderr), so a rerun would have lost it with an exit status of 0.
fn refuse_existing_outputs(args: &RunArgs) -> anyhow::Result<()> {
    let events = args.trace.as_ref().map(|path| events_path(path));
    for (what, path) in [
        ("--stats", &args.stats),
        ("--trace", &args.trace),
        ("--trace (its events)", &events),
    ] {
        if let Some(path) = path {
            if path.symlink_metadata().is_ok() {
                bail!(
                    "{what} {}: the file exists; refusing to overwrite it",
                    path.display()
                );
            }
        }
    }
    Ok(())
}

/// The shim's configuration for this run, checked as the shim will read it.
fn shim_config(args: &RunArgs, shim_stats: &Path) -> anyhow::Result<ShimConfig> {
    let mut config = ShimConfig::defaults();
    if let Some(budget) = args.budget {
        config.budget = budget;
    }
    if config.budget != BudgetSpec::Auto && (args.min.is_some() || args.max.is_some()) {
        bail!("--min and --max bound --budget auto; a fixed --budget stays as given");
    }
    if let (Some(min), Some(max)) = (args.min, args.max) {
        if min > max {
            bail!("--min is more than --max");
        }
    }
    config.budget_min = args.min;
    config.budget_max = args.max;
    if !args.patterns.is_empty() {
        config.patterns = args.patterns.clone();
    }
    config.min_size = args.min_size;
    config.policy = args.policy.clone();
    config.block_size = args.block;
    config.install_threads = args.install_threads.map(usize::from);
    config.zero_copy = !args.no_zero_copy;
    config.expert_blocks = !args.no_expert_blocks;
    config.saved_experts = !args.fresh_experts;
    config.stats_path = Some(shim_stats.to_path_buf());
    config.snapshot_dir = shim_stats.parent().map(Path::to_path_buf);
    config.trace_path = args.trace.as_ref().map(absolute).transpose()?;
    config.verbose = args.verbose;
    config.inherit = args.inherit;
    config.serve_forks = args.serve_forks == ServeForks::Always;
    config.serve_forks_at_fork = args.serve_forks == ServeForks::AtFork;
    config.budget = checked_budget(&config)?;
    // What the shim would refuse (and then run the program unpaged, exiting 0) is refused
    // here, before the program starts: the shim reads the same variables.
    check_as_the_shim_reads_it(&config)?;
    Ok(config)
}

/// The budget to run with: refused, raised to what the pager needs or warned of before
/// the program starts (see `budget_check`), each with one line.
fn checked_budget(config: &ShimConfig) -> anyhow::Result<BudgetSpec> {
    let checked = check_budget(config, floor::threads(), &memory_limits::read())
        .context("cannot run with this --budget and --block")?;
    if let Some(raise) = checked.raised {
        eprintln!("hyperoffload: {raise}");
    }
    if let Some(warning) = checked.warning {
        eprintln!("hyperoffload: {warning}");
    }
    Ok(checked.budget)
}

/// The user's command with the shim preloaded (ahead of any LD_PRELOAD of theirs) and
/// configured, and no other hyperoffload variable of the caller's.
fn program_command(args: &RunArgs, config: &ShimConfig, shim: &Path) -> Command {
    let mut command = Command::new(&args.command[0]);
    command.args(&args.command[1..]);
    for var in ALL_VARS {
        command.env_remove(var);
    }
    command.envs(config.to_env());
    let preload = match std::env::var_os("LD_PRELOAD") {
        Some(existing) if !existing.is_empty() => {
            let mut list = OsString::from(shim);
            list.push(":");
            list.push(existing);
            list
        }
        _ => shim.as_os_str().to_owned(),
    };
    command.env("LD_PRELOAD", preload);
    command
}

/// How the program ended: its status, its pid, and the last signal passed on to it.
struct Ended {
    status: ExitStatus,
    pid: u32,
    passed_on: Option<libc::c_int>,
    /// The keeper, serving children that outlive the program.
    kept: Option<KeptChildren>,
}

/// Runs the program to its end, passing termination signals on (see `forward`), and
/// returns how it ended. With `serve_forks`, this process is the keeper of the
/// program's forked children (see `keep_children`).
fn run_supervised(
    mut command: Command,
    program: &Path,
    serve_forks: bool,
) -> anyhow::Result<Ended> {
    // If the launcher dies without passing a signal on (SIGKILL, a crash), the program
    // goes too rather than run on unsupervised, its stats unreported.
    end_with_this_process(&mut command, libc::SIGKILL);
    let keeper = if serve_forks {
        keep_children(&mut command)
    } else {
        None
    };
    let forwarding = forward::start();
    forwarding.keep_ignored(&mut command);
    let child = command
        .spawn()
        .with_context(|| format!("cannot start {}", program.display()));
    // The program has its end of the keeper's socket now (or never will).
    let keeper = keeper.map(|(thread, _program_end)| thread);
    let mut child = match child {
        Ok(child) => child,
        Err(error) => {
            forwarding.stop();
            if let Some(keeper) = keeper {
                keeper.finish().1.wait();
            }
            return Err(error);
        }
    };
    let pid = child.id();
    forward::to(pid as libc::pid_t);
    // Signals stop being passed on before the program is reaped: its pid can be reused
    // only after that.
    wait_without_reaping(pid as libc::pid_t);
    // Every thread of the program has ended: the keeper fills what its services left
    // to children still alive, and goes on serving those.
    let kept = keeper.map(|keeper| keeper.finish().1);
    let passed_on = forwarding.stop();
    let status = child.wait().context("waiting for the program")?;
    Ok(Ended {
        status,
        pid,
        passed_on,
        kept,
    })
}

/// Makes this process the keeper of the program's forked children
/// (`hyperoffload::keeper`): a socket pair, the keeper's end watched by a thread of
/// this process, the program's end inherited by the program at the number
/// `HYPEROFFLOAD_KEEPER` names (close-on-exec cleared in the program only, between fork
/// and exec). Returns the thread and the program's end, to close once the program has
/// started. Without it (one line says why), children are served as before.
fn keep_children(command: &mut Command) -> Option<(KeeperThread, std::os::fd::OwnedFd)> {
    use std::os::fd::AsRawFd;
    use std::os::unix::process::CommandExt;
    let started =
        hyperoffload::sys::sockets::seqpacket_pair().and_then(|(keeper_end, program_end)| {
            let thread = hyperoffload::keeper::serve::start(keeper_end)?;
            Ok((thread, program_end))
        });
    let (thread, program_end) = match started {
        Ok(started) => started,
        Err(error) => {
            eprintln!(
                "hyperoffload: cannot start the keeper ({error}): forked children alive when \
                 the program ends by _exit, a signal or an exec may read zeros where a block \
                 was not resident"
            );
            return None;
        }
    };
    let fd = program_end.as_raw_fd();
    command.env(hyperoffload::shim_config::ENV_KEEPER, fd.to_string());
    // SAFETY: the closure runs between fork and exec and only calls fcntl(2)
    // (async-signal-safe) on a descriptor this process owns until after the spawn.
    unsafe {
        command.pre_exec(move || {
            if libc::fcntl(fd, libc::F_SETFD, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    Some((thread, program_end))
}

/// The shim beside this executable, or where `HYPEROFFLOAD_SHIM` says.
fn find_shim() -> anyhow::Result<PathBuf> {
    if let Some(path) = std::env::var_os("HYPEROFFLOAD_SHIM") {
        let path = absolute(&PathBuf::from(path))?;
        if !path.is_file() {
            bail!("HYPEROFFLOAD_SHIM={}: no such file", path.display());
        }
        return Ok(path);
    }
    let exe = std::env::current_exe().context("cannot find this executable")?;
    let path = exe.with_file_name(SHIM_FILE);
    if !path.is_file() {
        bail!(
            "the shim {} is missing: build it with `cargo build --release --workspace` (it is \
             installed beside the hyperoffload binary), or set HYPEROFFLOAD_SHIM",
            path.display()
        );
    }
    Ok(path)
}

fn absolute(path: &PathBuf) -> anyhow::Result<PathBuf> {
    Ok(if path.is_absolute() {
        path.clone()
    } else {
        std::env::current_dir()?.join(path)
    })
}

/// Where the shim writes its mapping events beside a `--trace` file.
fn events_path(trace: &Path) -> PathBuf {
    PathBuf::from(format!("{}.events.jsonl", trace.display()))
}

/// Refuses a configuration the shim would refuse, with the shim's reason.
fn check_as_the_shim_reads_it(config: &ShimConfig) -> anyhow::Result<()> {
    let env = config.to_env();
    let lookup = |var: &str| {
        env.iter()
            .find(|(name, _)| *name == var)
            .map(|(_, value)| value.clone())
    };
    ShimConfig::from_lookup(lookup)
        .map(|_| ())
        .map_err(|error| anyhow::anyhow!("the shim would refuse this configuration: {error}"))
}

/// Creates `path` (never overwriting, never through a symlink), mode 0600.
fn write_new(path: &Path, contents: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)?
        .write_all(contents)
}

/// Waits until the program has ended, leaving it to be reaped (`Child::wait`).
fn wait_without_reaping(pid: libc::pid_t) {
    loop {
        // SAFETY: an all-zero siginfo_t is valid; waitid writes into it.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: waits for our own child with WNOWAIT, which leaves it unreaped.
        let rc = unsafe {
            libc::waitid(
                libc::P_PID,
                pid as libc::id_t,
                &mut info,
                libc::WEXITED | libc::WNOWAIT,
            )
        };
        if rc == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shims_refusals_are_the_launchers() {
        let mut config = ShimConfig::defaults();
        assert!(check_as_the_shim_reads_it(&config).is_ok());
        config.block_size = Some(3000);
        let error = check_as_the_shim_reads_it(&config).unwrap_err().to_string();
        assert!(error.contains("HYPEROFFLOAD_BLOCK"), "{error}");
    }
}
