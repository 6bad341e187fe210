//! `hyperoffload mount SOURCE DIR --cache-dir D`: the objects of an S3-compatible store
//! or an HTTP server as read-only files under DIR (FUSE), read through a local cache
//! tier that persists across mounts. The decisions are the library's
//! (`hyperoffload::remote`); this is the glue: the remote (`remote.rs`, object_store),
//! the filesystem (`fs.rs`, fuser), and the mount's life here.

mod fs;
/// Also the remote bench's client (`bench --remote` downloads the model with it).
pub(super) mod remote;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{bail, Context};
use clap::Args;
use hyperoffload::remote::block_plan::BlockGrid;
use hyperoffload::remote::cache_store::Cache;
use hyperoffload::remote::consistency::version_key;
use hyperoffload::remote::eviction::{EvictionOrder, Lru};
use hyperoffload::remote::graph_eviction::GraphOrder;
use hyperoffload::remote::model_pass::{ModelPass, Parse};
use hyperoffload::remote::passthrough::Why;
use hyperoffload::remote::retry::RetryPolicy;
use hyperoffload::remote::source::{check_name, Source};
use hyperoffload::remote::tree::Tree;
use hyperoffload::size::format_size;

use super::size_arg;

#[derive(Args, Debug)]
pub struct MountArgs {
    /// `s3://BUCKET[/PREFIX]` (any S3-compatible store: endpoint, region and keys from
    /// the AWS environment variables — AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID,
    /// AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION... — or the profile's entries in
    /// ~/.aws/config and ~/.aws/credentials) or an `http(s)://` base URL.
    source: String,
    /// The directory to mount on (it must exist).
    dir: PathBuf,
    /// The cache tier's directory: a sparse file per object and its index; a second
    /// mount with the same directory reads nothing remote that the first one cached.
    /// One mount at a time per directory.
    #[arg(long)]
    cache_dir: PathBuf,
    /// Most bytes the cache tier holds (evicted as --eviction says). Default: no limit.
    #[arg(long, value_parser = size_arg)]
    cache_size: Option<u64>,
    /// Which cached blocks go first when the cache is full. `graph`: for a GGUF object
    /// (a name ending in .gguf), by the model's pass (the blocks a token reads first
    /// stay, the rest stream through), other objects least recently used first;
    /// `lru`: least recently used first for every object.
    #[arg(long, value_enum, default_value_t = Eviction::Graph)]
    eviction: Eviction,
    /// An object to serve, as a path below SOURCE (repeatable). Needed for an HTTP
    /// source (it has no listing); for S3, the default is every object under the prefix.
    #[arg(long = "object", value_name = "NAME")]
    objects: Vec<String>,
    /// Block size: the unit of the cache and of each ranged GET.
    #[arg(long, value_parser = size_arg, default_value = "2M")]
    block: u64,
    /// Blocks read ahead of each read.
    #[arg(long, default_value_t = 8)]
    readahead: u64,
    /// Ranged GETs in flight at most.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=256))]
    max_inflight: u32,
    /// Seconds a remote request may take in all, retries with backoff included; after
    /// that the read fails with EIO (never zeros, never a longer wait).
    #[arg(long, default_value_t = 30.0)]
    timeout: f64,
    /// Let other users read the mount (FUSE's allow_other).
    #[arg(long)]
    allow_other: bool,
    /// Never open a file with FUSE passthrough: every read goes through the mount, even
    /// of an object wholly cached (by default the kernel reads those from the cache
    /// file itself, Linux 6.9 or newer, as root).
    #[arg(long)]
    no_passthrough: bool,
    /// Write what the mount did (remote requests and bytes, cache hits, evictions) as
    /// JSON to this file when it ends.
    #[arg(long)]
    stats: Option<PathBuf>,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Eviction {
    Graph,
    Lru,
}

pub fn run(args: MountArgs) -> anyhow::Result<ExitCode> {
    let source = Source::parse(&args.source)?;
    check_args(&args, &source)?;
    let policy = RetryPolicy::with_deadline(Duration::from_secs_f64(args.timeout));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .thread_name("hyperoffload-remote")
        .build()
        .context("starting the I/O runtime")?;
    let remote = remote::Remote::new(source, policy)?;
    let started = Instant::now();
    let names = object_names(&args, &runtime, &remote)?;
    let tree = Tree::build(&names)?;
    let infos = runtime.block_on(futures::future::try_join_all(
        names.iter().map(|name| remote.head(name)),
    ))?;
    let graph = graph_order(&args);
    let (cache, objects) = open_cache(&args, infos, graph.as_ref())?;
    let total: u64 = objects.iter().map(|o| o.info.size).sum();
    let shared = Arc::new(fs::Shared::new(
        objects,
        cache,
        remote,
        runtime.handle().clone(),
        graph.clone(),
        args.max_inflight as usize,
        args.readahead,
    ));
    choose_passthrough(&shared, &args);
    if let Some(graph) = &graph {
        learn_passes(&shared, graph, &runtime, args.block);
    }
    shared.check_cached();
    let filesystem = fs::MountFs {
        tree,
        shared: Arc::clone(&shared),
        // SAFETY: getuid/getgid have no preconditions and cannot fail.
        uid: unsafe { libc::getuid() },
        // SAFETY: as above.
        gid: unsafe { libc::getgid() },
        mounted_at: SystemTime::now(),
    };
    let (mut unmounter, worker, done) = start_session(filesystem, &args)?;
    say_mounted(&args, &shared, total, started);
    let signal = wait_for_end(&runtime, &shared, done)?;
    let ended = end_session(signal, &mut unmounter, worker, &args);
    shared.cache.flush().context("writing the cache index")?;
    let summary = summary(&shared);
    say_unmounted(&args, signal, &summary);
    if let Some(path) = &args.stats {
        std::fs::write(path, serde_json::to_string_pretty(&summary)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    // Fetches still running (read-ahead) are dropped with the runtime.
    runtime.shutdown_timeout(Duration::from_secs(1));
    ended.context("the FUSE session")?;
    Ok(ExitCode::SUCCESS)
}

/// Refuses arguments the mount cannot run with, before anything is asked of the remote.
fn check_args(args: &MountArgs, source: &Source) -> anyhow::Result<()> {
    if !args.block.is_power_of_two() || args.block < 4096 {
        bail!(
            "--block {}: must be a power of two of at least 4K",
            args.block
        );
    }
    if !(args.timeout.is_finite() && args.timeout >= 0.5) {
        bail!("--timeout {}: must be at least 0.5 (seconds)", args.timeout);
    }
    if !args.dir.is_dir() {
        bail!(
            "{}: not a directory (the mount point must exist)",
            args.dir.display()
        );
    }
    for name in &args.objects {
        check_name(name)?;
    }
    if matches!(source, Source::Http { .. }) && args.objects.is_empty() {
        bail!("an HTTP source has no listing: name its objects with --object NAME (repeatable)");
    }
    Ok(())
}

/// The objects to serve: those --object names, else every object the store lists.
fn object_names(
    args: &MountArgs,
    runtime: &tokio::runtime::Runtime,
    remote: &remote::Remote,
) -> anyhow::Result<Vec<String>> {
    Ok(if args.objects.is_empty() {
        let names = runtime.block_on(remote.list())?;
        if names.is_empty() {
            bail!("{}: no objects there", args.source);
        }
        names
    } else {
        args.objects.clone()
    })
}

/// The cache's eviction order when it is the graph's (`--eviction graph`).
fn graph_order(args: &MountArgs) -> Option<Arc<GraphOrder>> {
    // The blocks read ahead, and the one being read, are spared (`GraphOrder`); so are
    // those read within two such windows, which a pager reading ahead of its program
    // may drop and read again. Replaying the reads a mount saw from a 3 GiB llama
    // under a quarter's budget, over a cache of half the model: 4.4 % fewer fetches
    // with 20 reads (the default here), 3.8 % with 16 or 24, 0.3 % with 8.
    let window = args.readahead as u32 + 2;
    (args.eviction == Eviction::Graph)
        .then(|| Arc::new(GraphOrder::new(window).spare_recent(2 * u64::from(window))))
}

/// The cache tier under --cache-dir, evicting by `graph` (else least recently used
/// first), and an entry in it for each object.
fn open_cache(
    args: &MountArgs,
    infos: Vec<remote::ObjectInfo>,
    graph: Option<&Arc<GraphOrder>>,
) -> anyhow::Result<(Cache, Vec<fs::Served>)> {
    let limit = args.cache_size.unwrap_or(u64::MAX);
    if limit < args.block {
        eprintln!(
            "hyperoffload: mount: --cache-size {} is less than one block ({}): nothing will be cached",
            format_size(limit),
            format_size(args.block)
        );
    }
    let order: Box<dyn EvictionOrder> = match graph {
        Some(graph) => Box::new(Arc::clone(graph)),
        None => Box::new(Lru),
    };
    let cache = Cache::open(&args.cache_dir, limit, order)?;
    let mut objects = Vec::new();
    for info in infos {
        let id = cache
            .attach(
                &info.name,
                &version_key(&info.etag, info.size),
                info.size,
                args.block,
            )
            .with_context(|| format!("cache entry of {}", info.name))?;
        let blocks = info.size.div_ceil(args.block);
        objects.push(fs::Served {
            grid: BlockGrid::new(info.size, args.block),
            info,
            cache: id,
            changed: AtomicBool::new(false),
            advised: (0..blocks).map(|_| AtomicBool::new(false)).collect(),
            opens: Default::default(),
            checking: Default::default(),
        });
    }
    Ok((cache, objects))
}

/// Turns passthrough off for the mount when --no-passthrough says so or the cache
/// directory cannot give the kernel what it needs.
fn choose_passthrough(shared: &fs::Shared, args: &MountArgs) {
    if args.no_passthrough {
        shared.turn_passthrough_off("--no-passthrough".to_string());
    } else if let Err(error) = shared.cache.opens_direct() {
        // The kernel opens the cache file with the program's flags, O_DIRECT included.
        shared.turn_passthrough_off(format!(
            "the cache directory {} refuses O_DIRECT ({error})",
            args.cache_dir.display()
        ));
    }
}

/// Mounts `filesystem` on --dir and runs its session on a thread of its own; the
/// session's unmounter, the thread, and what says the session ended.
fn start_session(
    filesystem: fs::MountFs,
    args: &MountArgs,
) -> anyhow::Result<(
    fuser::SessionUnmounter,
    std::thread::JoinHandle<std::io::Result<()>>,
    tokio::sync::oneshot::Receiver<()>,
)> {
    let mut config = fuser::Config::default();
    config.mount_options = vec![
        fuser::MountOption::RO,
        fuser::MountOption::FSName(format!("hyperoffload:{}", args.source)),
        fuser::MountOption::Subtype("hyperoffload".to_string()),
        fuser::MountOption::NoDev,
        fuser::MountOption::NoSuid,
    ];
    if args.allow_other {
        config.acl = fuser::SessionACL::All;
    }
    let mut session = fuser::Session::new(filesystem, &args.dir, &config).with_context(|| {
        format!(
            "mounting on {} (FUSE: is /dev/fuse there?)",
            args.dir.display()
        )
    })?;
    let unmounter = session.unmount_callable();
    let (done_tx, done_rx) = tokio::sync::oneshot::channel();
    let worker = std::thread::Builder::new()
        .name("hyperoffload-fuse".into())
        .spawn(move || {
            let result = session.run();
            let _ = done_tx.send(());
            result
        })
        .context("starting the FUSE thread")?;
    Ok((unmounter, worker, done_rx))
}

/// The line that says the mount is up: `bench --remote` waits for it.
fn say_mounted(args: &MountArgs, shared: &fs::Shared, total: u64, started: Instant) {
    eprintln!(
        "hyperoffload: mounted {} object{} ({}) of {} at {} in {:.2} s; cache {} holds {}",
        shared.objects.len(),
        if shared.objects.len() == 1 { "" } else { "s" },
        format_size(total),
        args.source,
        args.dir.display(),
        started.elapsed().as_secs_f64(),
        args.cache_dir.display(),
        format_size(shared.cache.stats().used_bytes),
    );
}

/// Waits until a signal (its name) or an unmount from outside (umount, fusermount3 -u:
/// `None`), writing the cache's last-use order every few seconds meanwhile.
fn wait_for_end(
    runtime: &tokio::runtime::Runtime,
    shared: &fs::Shared,
    done_rx: tokio::sync::oneshot::Receiver<()>,
) -> std::io::Result<Option<&'static str>> {
    runtime.block_on(async {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        let mut hup = signal(SignalKind::hangup())?;
        let mut done = done_rx;
        let mut flush = tokio::time::interval(Duration::from_secs(5));
        loop {
            tokio::select! {
                _ = term.recv() => return Ok::<_, std::io::Error>(Some("SIGTERM")),
                _ = int.recv() => return Ok(Some("SIGINT")),
                _ = hup.recv() => return Ok(Some("SIGHUP")),
                _ = &mut done => return Ok(None),
                _ = flush.tick() => {
                    if let Err(error) = shared.cache.flush() {
                        eprintln!("hyperoffload: mount: writing the cache index: {error}");
                    }
                }
            }
        }
    })
}

/// Unmounts on a signal (detaching the mount when files are still open in it) and
/// waits for the FUSE thread: the session's outcome (`Ok` for a thread left to end
/// with the process, still connected to open files).
fn end_session(
    signal: Option<&str>,
    unmounter: &mut fuser::SessionUnmounter,
    worker: std::thread::JoinHandle<std::io::Result<()>>,
    args: &MountArgs,
) -> std::io::Result<()> {
    let mut detached = false;
    if signal.is_some() {
        if let Err(error) = unmounter.unmount() {
            // Files still open in the mount (EBUSY): detach it, and end anyway; the
            // programs holding them get ENOTCONN from then on, as with `umount -l`.
            eprintln!(
                "hyperoffload: mount: unmounting {}: {error}; detaching it (files are open in it)",
                args.dir.display()
            );
            if let Err(error) = hyperoffload::sys::files::unmount_lazy(&args.dir) {
                eprintln!(
                    "hyperoffload: mount: detaching {}: {error}",
                    args.dir.display()
                );
            }
            detached = true;
        }
    }
    let waited = Instant::now();
    while detached && !worker.is_finished() && waited.elapsed() < Duration::from_secs(1) {
        std::thread::sleep(Duration::from_millis(10));
    }
    if worker.is_finished() || !detached {
        worker.join().expect("FUSE thread panicked")
    } else {
        Ok(()) // still connected to open files: ends with the process
    }
}

/// The line that says what the mount did, once unmounted.
fn say_unmounted(args: &MountArgs, signal: Option<&str>, summary: &serde_json::Value) {
    eprintln!(
        "hyperoffload: unmounted {}{}: opens: {} with passthrough, {} through the mount; {} reads ({}), {} failed; remote: {} GETs ({}), {} retries; cache: {} hit, {} stored, {} evicted, holds {}",
        args.dir.display(),
        signal.map(|s| format!(" on {s}")).unwrap_or_default(),
        summary["passthrough_opens"],
        summary["fuse_opens"]["total"],
        summary["reads"],
        format_size(summary["read_bytes"].as_u64().unwrap_or(0)),
        summary["read_errors"],
        summary["remote"]["gets"],
        format_size(summary["remote"]["bytes"].as_u64().unwrap_or(0)),
        summary["remote"]["retries"],
        format_size(summary["cache"]["hit_bytes"].as_u64().unwrap_or(0)),
        format_size(summary["cache"]["stored_bytes"].as_u64().unwrap_or(0)),
        format_size(summary["cache"]["evicted_bytes"].as_u64().unwrap_or(0)),
        format_size(summary["cache"]["used_bytes"].as_u64().unwrap_or(0)),
    );
}

/// Gives `graph` the pass of every GGUF object, read from its header (through the
/// cache: the program opening the model reads the same blocks). An object whose header
/// cannot be read or parsed is evicted least recently used first, as it says.
fn learn_passes(
    shared: &Arc<fs::Shared>,
    graph: &GraphOrder,
    runtime: &tokio::runtime::Runtime,
    block: u64,
) {
    for (index, served) in shared.objects.iter().enumerate() {
        let name = &served.info.name;
        if !name.to_ascii_lowercase().ends_with(".gguf") {
            continue;
        }
        let size = served.info.size;
        let mut want = block.min(size);
        let outcome = loop {
            let prefix = match runtime.block_on(shared.read(index, 0..want)) {
                Ok(prefix) => prefix,
                Err(error) => break Err(error.to_string()),
            };
            match ModelPass::from_prefix(&prefix, size, block) {
                Ok(Parse::Model(pass)) => break Ok(pass),
                Ok(Parse::NeedMore(more)) => want = more,
                Err(error) => break Err(error.to_string()),
            }
        };
        match outcome {
            Ok(pass) => {
                eprintln!(
                    "hyperoffload: mount: {name}: cache eviction by the model's pass ({} blocks of {} in it)",
                    pass.distinct_blocks(),
                    size.div_ceil(block)
                );
                graph.add_model(served.cache.index(), pass);
            }
            Err(error) => eprintln!(
                "hyperoffload: mount: {name}: {error}: its cached blocks are evicted least recently used first"
            ),
        }
    }
}

fn summary(shared: &fs::Shared) -> serde_json::Value {
    let remote = &shared.remote.stats;
    let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    let mut fuse_opens = serde_json::Map::new();
    let mut total = 0;
    for why in [
        Why::Off,
        Why::NotCached,
        Why::NotChecked,
        Why::OpenThroughFuse,
    ] {
        let (index, name) = fs::why_index(why);
        let count = load(&shared.fuse_opens[index]);
        total += count;
        fuse_opens.insert(name.to_string(), count.into());
    }
    fuse_opens.insert("total".to_string(), total.into());
    serde_json::json!({
        // Opens the kernel reads from the cache file itself: their reads are in none
        // of the counts below.
        "passthrough_opens": load(&shared.passthrough_opens),
        "passthrough_off": shared.passthrough_off(),
        "fuse_opens": fuse_opens,
        "reads": load(&shared.reads),
        "read_bytes": load(&shared.read_bytes),
        "read_errors": load(&shared.read_errors),
        "remote": {
            "heads": load(&remote.heads),
            "gets": load(&remote.gets),
            "bytes": load(&remote.bytes),
            "retries": load(&remote.retries),
            "failures": load(&remote.failures),
        },
        "cache": shared.cache.stats(),
    })
}
