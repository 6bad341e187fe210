//! One run of the program, on one side, with everything recorded: a fresh memory
//! cgroup, two tracefs instances (the program's own events; the model device's block
//! requests), memory sampling, and the figures reduced from them.

use std::collections::HashMap;
use std::ffi::OsString;
use std::fs::File;
use std::io::{self, BufRead, BufReader};
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use thiserror::Error;

use super::cgroup::{CgroupError, CgroupVersion, MemoryCgroup};
use super::figures::{
    bandwidth_series, bucket_counts, latency_cdf, request_size_edges, thin, LatencyFigures,
    LATENCY_EDGES_US,
};
use super::kernel_events::{model_faults, program_reads};
use super::model_files::ModelFiles;
use super::program_output::ProgramFigures;
use super::record::{
    FaultFigures, IoFigures, MemoryFigures, RunRecord, RunSeries, Side, TracingFigures,
};
use super::sampler::{SampledRun, Sampler};
use super::samples::{FaultSample, ReadRequest};
use super::trace_event::{lost_events, parse_line, DeviceNumber, EventKind, TraceEvent};
use super::tracefs::{Capture, TraceInstance, TracefsError};
use super::PagerBudget;
use hyperoffload::model::split::{split_parts, SplitError};
use hyperoffload::model::ModelFile;
use hyperoffload::policy::FaultOutcome;
use hyperoffload::trace::{TraceError, TraceReader};

const BANDWIDTH_BIN_NS: u64 = 100_000_000;
const SAMPLE_INTERVAL: Duration = Duration::from_millis(25);
const TRACE_BUFFER_KB: u64 = 65_536;
const PLOT_POINTS: usize = 20_000;

#[derive(Debug, Error)]
pub enum RunError {
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    #[error(transparent)]
    Tracefs(#[from] TracefsError),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: io::Error,
    },
    #[error("pager trace: {0}")]
    PagerTrace(#[from] TraceError),
    #[error("interrupted")]
    Interrupted,
}

fn io_error(what: impl Into<String>) -> impl FnOnce(io::Error) -> RunError {
    let what = what.into();
    move |source| RunError::Io { what, source }
}

/// Why the model's files could not be found.
#[derive(Debug, Error)]
pub enum ModelTargetError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// Boxed: a split error is large, and every compare result would carry its size.
    #[error(transparent)]
    Split(Box<SplitError>),
}

/// The model the program pages (one file, or every part of a split GGUF), and the block
/// devices its files live on.
#[derive(Debug, Clone)]
pub struct ModelTarget {
    pub files: ModelFiles,
    /// The whole disks holding the files, each once, in the order of the parts: block
    /// requests name the disk, not the partition. Parts on different disks are all
    /// traced, and the program's reads from any of them are the model's.
    pub devices: Vec<DeviceNumber>,
}

impl ModelTarget {
    /// The model `path` is (or is a part of), with canonical paths, as the program's
    /// `/proc/PID/maps` names its files. A file that is no model this program reads
    /// (as `model_len` has it) is a model of one file.
    pub fn find(path: &Path) -> Result<ModelTarget, ModelTargetError> {
        let io_error = |path: &Path| {
            let path = path.to_path_buf();
            move |source| ModelTargetError::Io { path, source }
        };
        // Parts are found by the name given: a part reached through a symlink (a
        // Hugging Face cache's snapshot) resolves to a blob named by its hash.
        let resolved = path.canonicalize().map_err(io_error(path))?;
        let parts = match ModelFile::open(path) {
            Ok(model) => split_parts(&model).map_err(|e| ModelTargetError::Split(Box::new(e)))?,
            Err(_) => None,
        };
        let paths = match parts {
            Some(parts) => parts.into_iter().map(|part| part.path).collect(),
            None => vec![resolved],
        };
        let mut files = Vec::with_capacity(paths.len());
        let mut devices = Vec::new();
        for path in paths {
            let path = path.canonicalize().map_err(io_error(&path))?;
            let metadata = std::fs::metadata(&path).map_err(io_error(&path))?;
            let device = disk_of(metadata.dev());
            if !devices.contains(&device) {
                devices.push(device);
            }
            files.push((path, metadata.len()));
        }
        Ok(ModelTarget {
            files: ModelFiles::new(files).expect("a model has at least one file"),
            devices,
        })
    }
}

/// The whole disk holding the filesystem of `st_dev`.
fn disk_of(dev: u64) -> DeviceNumber {
    let mut device = DeviceNumber {
        major: libc::major(dev),
        minor: libc::minor(dev),
    };
    // A partition's sysfs directory has a `partition` file and sits in its disk's.
    let sys = PathBuf::from(format!("/sys/dev/block/{device}"));
    if sys.join("partition").exists() {
        if let Ok(parent) = std::fs::read_to_string(sys.join("../dev")) {
            if let Some((major, minor)) = parent.trim().split_once(':') {
                if let (Ok(major), Ok(minor)) = (major.parse(), minor.parse()) {
                    device = DeviceNumber { major, minor };
                }
            }
        }
    }
    device
}

/// The tracefs event filter for block events on any of `devices`.
fn device_filter(devices: &[DeviceNumber]) -> String {
    devices
        .iter()
        .map(|device| format!("dev == {}", device.kernel_dev_t()))
        .collect::<Vec<_>>()
        .join(" || ")
}

/// What to run and where to put what it leaves.
pub struct RunSpec<'a> {
    pub side: Side,
    pub index: usize,
    pub program: &'a [OsString],
    pub budget: PagerBudget,
    /// Both sides' memory cgroup limit; without it the kernel side's is the budget.
    pub cgroup_limit: Option<u64>,
    pub model: &'a ModelTarget,
    pub out_dir: &'a Path,
    /// The `hyperoffload` binary, whose `run` subcommand starts a program under the
    /// shim.
    pub launcher: &'a Path,
    /// Set by a signal handler: the run is stopped and cleaned up.
    pub interrupted: &'a AtomicBool,
}

/// Bytes of `path` in the page cache now (mincore(2) over a fresh mapping). Pages
/// another process keeps mapped survive `drop_caches`: a run that starts with some is
/// not cold.
pub fn cached_bytes(path: &Path) -> io::Result<u64> {
    let file = File::open(path)?;
    let len = file.metadata()?.len() as usize;
    if len == 0 {
        return Ok(0);
    }
    // SAFETY: a private read-only mapping of a file we opened; nothing reads through it,
    // it is only passed to mincore.
    let map = unsafe { memmap2::MmapOptions::new().len(len).map(&file)? };
    let page = 4096usize;
    let mut resident = vec![0u8; len.div_ceil(page)];
    // SAFETY: `map` covers `len` bytes from a page-aligned address; `resident` holds one
    // byte per page of it.
    let rc = unsafe {
        libc::mincore(
            map.as_ptr() as *mut libc::c_void,
            len,
            resident.as_mut_ptr(),
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(resident.iter().filter(|&&b| b & 1 != 0).count() as u64 * page as u64)
}

fn monotonic_ns() -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `now` is a valid timespec to write to; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
    now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64
}

/// Writes the decimal `value` to `fd` with no allocation: safe between fork and exec.
fn write_decimal(fd: i32, value: u32) -> bool {
    let mut digits = [0u8; 10];
    let mut start = digits.len();
    let mut rest = value;
    loop {
        start -= 1;
        digits[start] = b'0' + (rest % 10) as u8;
        rest /= 10;
        if rest == 0 {
            break;
        }
    }
    let text = &digits[start..];
    // SAFETY: `text` is a live stack buffer of `text.len()` bytes.
    unsafe { libc::write(fd, text.as_ptr().cast(), text.len()) == text.len() as isize }
}

/// The files one run leaves in the output directory, named by side and index.
struct RunFiles {
    program_events: String,
    device_events: String,
    stdout: String,
    stderr: String,
    stats: String,
    pager_trace: String,
}

impl RunFiles {
    fn new(tag: &str) -> Self {
        let name = |suffix: &str| format!("run-{tag}.{suffix}");
        Self {
            program_events: name("events.txt"),
            device_events: name("block.txt"),
            stdout: name("stdout"),
            stderr: name("stderr"),
            stats: name("stats.json"),
            pager_trace: name("faults.csv"),
        }
    }
}

/// A run's two tracefs instances, each captured to its file, tracing off until the
/// program starts.
struct RunTraces {
    program: TraceInstance,
    device: TraceInstance,
    program_capture: Capture,
    device_capture: Capture,
}

impl RunTraces {
    fn start(unique: &str, spec: &RunSpec, files: &RunFiles) -> Result<Self, RunError> {
        // The program's own events: followed from the child into its threads and children.
        let program = TraceInstance::create(&format!("{unique}-proc"))?;
        program.set_buffer_kb(TRACE_BUFFER_KB)?;
        program.write("options/event-fork", "1")?;
        if spec.side == Side::Kernel {
            program.enable_event("exceptions/page_fault_user", None)?;
            program.enable_event("sched/sched_switch", None)?;
            program.enable_event("raw_syscalls/sys_enter", None)?;
        }
        // Block requests complete in interrupt context: filtered by device, not process.
        // Bios too, with every task creation: io_uring's workers are created without a
        // fork event, so the pid filter never follows them; reads are attributed to the
        // program's tasks afterwards (`program_reads`).
        let dev_filter = device_filter(&spec.model.devices);
        let device = TraceInstance::create(&format!("{unique}-dev"))?;
        device.set_buffer_kb(TRACE_BUFFER_KB / 4)?;
        device.enable_event("block/block_bio_queue", Some(&dev_filter))?;
        device.enable_event("task/task_newtask", None)?;
        device.enable_event("block/block_rq_issue", Some(&dev_filter))?;
        device.enable_event("block/block_rq_complete", Some(&dev_filter))?;
        let program_capture = program.capture(&spec.out_dir.join(&files.program_events))?;
        let device_capture = device.capture(&spec.out_dir.join(&files.device_events))?;
        Ok(Self {
            program,
            device,
            program_capture,
            device_capture,
        })
    }

    fn stop(&self) -> Result<(), RunError> {
        self.program.write("tracing_on", "0")?;
        self.device.write("tracing_on", "0")?;
        Ok(())
    }

    /// Drains the captures (tracing stopped) and removes the instances.
    fn finish(self) -> Result<(), RunError> {
        self.program_capture
            .finish()
            .map_err(io_error("reading the trace pipe"))?;
        self.device_capture
            .finish()
            .map_err(io_error("reading the trace pipe"))?;
        Ok(())
    }
}

/// The program as the side runs it: alone (in the cgroup at the budget), or under
/// `hyperoffload run` at the budget with its stats and fault trace recorded. Its
/// output goes to the run's files.
fn program_command(spec: &RunSpec, files: &RunFiles) -> Result<Command, RunError> {
    let out = |name: &str| spec.out_dir.join(name);
    let mut command = match spec.side {
        Side::Kernel => {
            let mut command = Command::new(&spec.program[0]);
            command.args(&spec.program[1..]);
            command
        }
        Side::Pager => {
            // The launcher and the shim refuse to overwrite these, and a file a previous
            // run left would pass for this run's.
            for file in pager_outputs(&files.stats, &files.pager_trace) {
                let _ = std::fs::remove_file(out(&file));
            }
            let mut command = Command::new(spec.launcher);
            command
                .arg("run")
                .arg("--budget")
                .arg(match spec.budget {
                    // With its unit: `run` refuses a plain number below 1 MiB.
                    PagerBudget::Bytes(bytes) => format!("{bytes}B"),
                    PagerBudget::Auto => "auto".to_string(),
                })
                .arg("--stats")
                .arg(out(&files.stats))
                .arg("--trace")
                .arg(out(&files.pager_trace))
                .arg("--")
                .args(spec.program);
            command
        }
    };
    command
        .stdin(Stdio::null())
        .stdout(File::create(out(&files.stdout)).map_err(io_error(&files.stdout))?)
        .stderr(File::create(out(&files.stderr)).map_err(io_error(&files.stderr))?);
    Ok(command)
}

/// Starts `command` inside `cgroup` and the program trace's pid filter, with tracing
/// on from its first instruction; returns it and when it started (CLOCK_MONOTONIC
/// nanoseconds, the clock of the trace events, and as an `Instant`).
fn spawn_traced(
    mut command: Command,
    cgroup: &MemoryCgroup,
    traces: &RunTraces,
) -> Result<(Child, u64, Instant), RunError> {
    let procs = cgroup.procs_file()?;
    let event_pids = traces.program.open_for_write("set_event_pid")?;
    let tracing_on = traces.program.open_for_write("tracing_on")?;
    let (procs_fd, pids_fd, on_fd) = (
        procs.as_raw_fd(),
        event_pids.as_raw_fd(),
        tracing_on.as_raw_fd(),
    );
    // SAFETY: the closure runs between fork and exec and only calls getpid and write
    // (async-signal-safe) on descriptors that stay open until this function drops them
    // after spawn returns; it allocates nothing.
    unsafe {
        command.pre_exec(move || {
            // Into the cgroup and the event pid filter before the program runs, then
            // tracing on, so nothing of the program escapes and nothing else enters.
            let pid = libc::getpid() as u32;
            if !write_decimal(procs_fd, pid) || !write_decimal(pids_fd, pid) {
                return Err(io::Error::last_os_error());
            }
            if libc::write(on_fd, b"1".as_ptr().cast(), 1) != 1 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
    traces.device.write("tracing_on", "1")?;
    let origin_mono_ns = monotonic_ns();
    let origin = Instant::now();
    let child = command
        .spawn()
        .map_err(io_error(format!("starting {:?}", command.get_program())))?;
    drop((procs, event_pids, tracing_on));
    Ok((child, origin_mono_ns, origin))
}

/// Samples the memory of the processes in `cgroup` from `origin` on.
fn start_sampler(cgroup: &MemoryCgroup, model: &ModelTarget, origin: Instant) -> Sampler {
    let usage_cgroup = cgroup.dir().to_path_buf();
    let usage_file = match cgroup.version() {
        CgroupVersion::V1 => "memory.usage_in_bytes",
        CgroupVersion::V2 => "memory.current",
    };
    let usage = move || {
        std::fs::read_to_string(usage_cgroup.join(usage_file))
            .ok()?
            .trim()
            .parse()
            .ok()
    };
    Sampler::start(
        cgroup.dir().to_path_buf(),
        usage,
        model.files.clone(),
        origin,
        SAMPLE_INTERVAL,
    )
}

/// Waits for the program; an interrupt kills it.
fn wait_for(child: &mut Child, interrupted: &AtomicBool) -> Result<ExitStatus, RunError> {
    loop {
        if interrupted.load(Ordering::Relaxed) {
            let _ = child.kill();
            let _ = child.wait();
            return Err(RunError::Interrupted);
        }
        match child
            .try_wait()
            .map_err(io_error("waiting for the program"))?
        {
            Some(status) => return Ok(status),
            None => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

/// Drops the page cache; whether that left none of the model cached (a cold run), and
/// the model's bytes still cached.
fn start_cold(model: &ModelTarget) -> (bool, u64) {
    let dropped = crate::cli::device::drop_page_cache();
    let cached: u64 = model
        .files
        .parts()
        .iter()
        .map(|part| cached_bytes(&part.path).unwrap_or(0))
        .sum();
    (dropped && cached == 0, cached)
}

/// The program's reads from the model's devices, in time order.
fn model_reads(
    device_events: &[TraceEvent],
    pid: u32,
    model: &ModelTarget,
    origin_mono_ns: u64,
) -> Vec<ReadRequest> {
    let mut reads = Vec::new();
    for &device in &model.devices {
        reads.extend(program_reads(device_events, pid, device, origin_mono_ns));
    }
    if model.devices.len() > 1 {
        reads.sort_by_key(|read| read.issue_ns);
    }
    reads
}

/// What one side tells of the model's faults and memory.
struct SideFigures {
    faults: Vec<FaultSample>,
    pager_stats: Option<serde_json::Value>,
    model_peak: Option<u64>,
}

/// The kernel's faults on the model's mappings, and the mappings' peak resident set.
fn kernel_side(program_events: &[TraceEvent], sampled: &SampledRun, origin: u64) -> SideFigures {
    SideFigures {
        faults: model_faults(program_events, &sampled.model_ranges, origin),
        pager_stats: None,
        model_peak: sampled
            .memory
            .iter()
            .filter_map(|m| m.model_rss_bytes)
            .max(),
    }
}

/// The pager's faults from its trace, on the model axis, and its stats.
fn pager_side(spec: &RunSpec, files: &RunFiles) -> Result<SideFigures, RunError> {
    let out = |name: &str| spec.out_dir.join(name);
    let stats: Option<serde_json::Value> = std::fs::read_to_string(out(&files.stats))
        .ok()
        .and_then(|text| serde_json::from_str(&text).ok());
    // A single file's regions are all at 0 on its axis: nothing to look up.
    let region_starts = if spec.model.files.is_split() {
        let events =
            std::fs::read_to_string(out(&events_path_of(&files.pager_trace))).unwrap_or_default();
        spec.model.files.region_starts(&events)
    } else {
        HashMap::new()
    };
    let faults = read_pager_faults(&out(&files.pager_trace), &region_starts)?;
    let model_peak = stats
        .as_ref()
        .and_then(|s| s.get("peak_resident_bytes")?.as_u64());
    Ok(SideFigures {
        faults,
        pager_stats: stats,
        model_peak,
    })
}

fn io_figures(reads: &[ReadRequest], bandwidth: &[(f64, f64)], wall_s: f64) -> IoFigures {
    let bytes_read: u64 = reads.iter().map(|r| r.bytes).sum();
    IoFigures {
        bytes_read,
        read_requests: reads.len() as u64,
        mean_request_bytes: bytes_read as f64 / reads.len().max(1) as f64,
        mean_bandwidth_mb_s: bytes_read as f64 / 1e6 / wall_s.max(1e-9),
        peak_bandwidth_mb_s: bandwidth.iter().map(|b| b.1).fold(0.0, f64::max),
        request_size_counts: bucket_counts(reads.iter().map(|r| r.bytes), &request_size_edges()),
    }
}

/// Fault counts and the latency of the faults that waited for a read.
fn fault_figures(faults: &[FaultSample]) -> FaultFigures {
    let waited: Vec<FaultSample> = faults
        .iter()
        .filter(|f| f.latency_ns.is_some())
        .copied()
        .collect();
    FaultFigures {
        model_faults: faults.len() as u64,
        waited_faults: waited.len() as u64,
        latency: LatencyFigures::of(&waited),
        latency_bucket_counts: bucket_counts(
            waited
                .iter()
                .filter_map(|f| f.latency_ns)
                .map(|ns| ns as f64 / 1000.0),
            LATENCY_EDGES_US,
        ),
    }
}

/// Runs the program once on `spec.side`, from a dropped page cache, in a memory cgroup
/// of its own (limited to the budget on the kernel side), traced and sampled, and
/// reduces what it recorded to the run's figures.
pub fn run_once(spec: &RunSpec) -> Result<RunRecord, RunError> {
    let tag = format!("{}-{}", spec.side.name(), spec.index);
    let files = RunFiles::new(&tag);
    let out = |name: &str| spec.out_dir.join(name);
    let (cold, model_cached_bytes) = start_cold(spec.model);

    let unique = format!("hyperoffload-{}-{tag}", std::process::id());
    let limit = match spec.side {
        Side::Kernel => spec.cgroup_limit.or(spec.budget.bytes()),
        Side::Pager => spec.cgroup_limit,
    };
    let cgroup = MemoryCgroup::create(&unique, limit)?;
    let traces = RunTraces::start(&unique, spec, &files)?;
    let command = program_command(spec, &files)?;
    let (mut child, origin_mono_ns, origin) = spawn_traced(command, &cgroup, &traces)?;
    let sampler = start_sampler(&cgroup, spec.model, origin);
    let status = wait_for(&mut child, spec.interrupted)?;
    let wall_s = origin.elapsed().as_secs_f64();
    traces.stop()?;
    let sampled = sampler.finish();
    traces.finish()?;
    let cgroup_peak = cgroup.peak_bytes().ok();
    drop(cgroup);

    let mut tracing = TracingFigures {
        event_files: vec![files.program_events.clone(), files.device_events.clone()],
        ..Default::default()
    };
    let program_events = read_events(&out(&files.program_events), &mut tracing)?;
    let device_events = read_events(&out(&files.device_events), &mut tracing)?;
    let reads = model_reads(&device_events, child.id(), spec.model, origin_mono_ns);
    let side = match spec.side {
        Side::Kernel => kernel_side(&program_events, &sampled, origin_mono_ns),
        Side::Pager => pager_side(spec, &files)?,
    };

    let stdout = std::fs::read_to_string(out(&files.stdout)).unwrap_or_default();
    let stderr = std::fs::read_to_string(out(&files.stderr)).unwrap_or_default();
    let bandwidth = bandwidth_series(&reads, BANDWIDTH_BIN_NS);
    let fault_points: Vec<(f64, u64)> = side
        .faults
        .iter()
        .map(|f| (f.t_ns as f64 / 1e9, f.file_offset))
        .collect();
    Ok(RunRecord {
        side: spec.side,
        index: spec.index,
        cold,
        model_cached_bytes,
        exit_code: status.code().or_else(|| status.signal().map(|s| -s)),
        wall_s,
        program: ProgramFigures::parse(&stdout, &stderr),
        io: io_figures(&reads, &bandwidth, wall_s),
        faults: fault_figures(&side.faults),
        memory: MemoryFigures {
            cgroup_peak_bytes: cgroup_peak,
            model_peak_resident_bytes: side.model_peak,
            process_peak_rss_bytes: sampled
                .memory
                .iter()
                .filter_map(|m| m.process_rss_bytes)
                .max(),
        },
        pager_stats: side.pager_stats,
        tracing,
        stdout_file: files.stdout,
        stderr_file: files.stderr,
        pager_trace_file: (spec.side == Side::Pager).then_some(files.pager_trace),
        series: RunSeries {
            memory: sampled.memory,
            bandwidth_mb_s: bandwidth,
            fault_map: thin(&fault_points, PLOT_POINTS),
            latency_cdf: latency_cdf(&side.faults, 2_000),
        },
    })
}

/// Every file a pager run writes in the output directory, given its `--stats` and
/// `--trace` names: the shim puts its own events beside the trace
/// (`<trace>.events.jsonl`).
fn pager_outputs(stats_file: &str, trace_file: &str) -> [String; 3] {
    [
        stats_file.to_string(),
        trace_file.to_string(),
        events_path_of(trace_file),
    ]
}

/// The shim's event log beside the trace `trace_file` (`trace::events_path`).
fn events_path_of(trace_file: &str) -> String {
    format!("{trace_file}.events.jsonl")
}

/// The parsed events of a captured trace file, in time order. Events the comparison
/// does not use are dropped; lost and unparsed lines are counted.
fn read_events(path: &Path, tracing: &mut TracingFigures) -> Result<Vec<TraceEvent>, RunError> {
    let file = File::open(path).map_err(io_error(path.display().to_string()))?;
    let mut events = Vec::new();
    for line in BufReader::new(file).lines() {
        let line = line.map_err(io_error(path.display().to_string()))?;
        if let Some(lost) = lost_events(&line) {
            tracing.lost_events += lost;
            continue;
        }
        match parse_line(&line) {
            Ok(Some(event)) if !matches!(event.kind, EventKind::Other(_)) => events.push(event),
            Ok(_) => {}
            Err(error) => {
                tracing.unparsed_lines += 1;
                tracing
                    .first_unparsed
                    .get_or_insert_with(|| error.to_string());
            }
        }
    }
    // The pipe merges the per-CPU buffers in time order already; sorting is cheap
    // insurance.
    events.sort_by_key(|event| event.t_ns);
    Ok(events)
}

/// The pager's fault trace as fault samples: faults that waited for a read (`missing`,
/// `in_flight`) carry their latency; faults served from memory do not, like the
/// kernel's faults that never blocked. A missing file gives no faults.
///
/// The trace records a region and an offset in its file, not the file: a fault is put
/// on the model axis (`model_files`) at its region's start there, `region_starts` by
/// region id. A region it does not know (none for a single file; a file that is not
/// the model's) keeps the fault's file offset.
pub fn read_pager_faults(
    path: &Path,
    region_starts: &HashMap<u32, u64>,
) -> Result<Vec<FaultSample>, RunError> {
    let Ok(file) = File::open(path) else {
        return Ok(Vec::new());
    };
    let mut faults = Vec::new();
    for record in TraceReader::new(BufReader::new(file))? {
        let record = record?;
        let waited = matches!(
            record.outcome,
            FaultOutcome::Missing | FaultOutcome::InFlight
        );
        let start = region_starts.get(&record.region).copied().unwrap_or(0);
        faults.push(FaultSample {
            t_ns: record.t_ns,
            tid: record.tid,
            file_offset: start + record.file_offset,
            latency_ns: waited.then_some(record.latency_ns),
        });
    }
    Ok(faults)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_events_of_every_disk_of_the_model_are_traced() {
        let vda = DeviceNumber {
            major: 254,
            minor: 0,
        };
        let sdb = DeviceNumber {
            major: 8,
            minor: 16,
        };
        assert_eq!(device_filter(&[vda]), "dev == 266338304");
        assert_eq!(
            device_filter(&[vda, sdb]),
            "dev == 266338304 || dev == 8388624"
        );
    }

    #[test]
    fn pager_faults_go_to_their_regions_part() {
        let path = std::env::temp_dir().join(format!("runner-faults-{}.csv", std::process::id()));
        let record = |region: u32, file_offset: u64| hyperoffload::trace::TraceRecord {
            t_ns: 1000,
            tid: 7,
            region,
            file_offset,
            block: (file_offset / 65536) as u32,
            block_size: 65536,
            outcome: FaultOutcome::Missing,
            latency_ns: 500,
            offset_in_block: Some(0),
        };
        let mut writer = hyperoffload::trace::TraceWriter::new(Vec::new(), &[]).unwrap();
        for r in [
            record(0, 65536),
            record(1, 0),
            record(2, 131_072),
            record(3, 0),
        ] {
            writer.write(&r).unwrap();
        }
        std::fs::write(&path, writer.into_inner().unwrap()).unwrap();
        let offsets = |starts: &HashMap<u32, u64>| -> Vec<u64> {
            read_pager_faults(&path, starts)
                .unwrap()
                .iter()
                .map(|f| f.file_offset)
                .collect()
        };
        // One file: the file offsets.
        assert_eq!(offsets(&HashMap::new()), [65536, 0, 131_072, 0]);
        // Region 1 is the third part, region 2 the second; region 3 is unknown.
        assert_eq!(
            offsets(&HashMap::from([(0, 0), (1, 81_920), (2, 40_960)])),
            [65536, 81_920, 172_032, 0]
        );
        std::fs::remove_file(&path).unwrap();
    }
}
