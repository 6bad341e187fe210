//! Starting the program of one run and waiting for it: its command for the side, the
//! two tracefs instances, the cgroup and the trace's pid filter entered before its first
//! instruction, and the memory sampler.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::super::cgroup::{CgroupVersion, MemoryCgroup};
use super::super::record::Side;
use super::super::sampler::Sampler;
use super::super::trace_event::DeviceNumber;
use super::super::tracefs::{Capture, TraceInstance};
use super::super::PagerBudget;
use super::{io_error, pager_outputs, ModelTarget, RunError, RunFiles, RunSpec};

const SAMPLE_INTERVAL: Duration = Duration::from_millis(25);
const TRACE_BUFFER_KB: u64 = 65_536;

/// The tracefs event filter for block events on any of `devices`.
pub(super) fn device_filter(devices: &[DeviceNumber]) -> String {
    devices
        .iter()
        .map(|device| format!("dev == {}", device.kernel_dev_t()))
        .collect::<Vec<_>>()
        .join(" || ")
}

pub(super) fn monotonic_ns() -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `now` is a valid timespec to write to; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
    now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64
}

/// Writes the decimal `value` to `fd` with no allocation: safe between fork and exec.
pub(super) fn write_decimal(fd: i32, value: u32) -> bool {
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

/// A run's two tracefs instances, each captured to its file, tracing off until the
/// program starts.
pub(super) struct RunTraces {
    program: TraceInstance,
    device: TraceInstance,
    program_capture: Capture,
    device_capture: Capture,
}

impl RunTraces {
    pub(super) fn start(unique: &str, spec: &RunSpec, files: &RunFiles) -> Result<Self, RunError> {
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

    pub(super) fn stop(&self) -> Result<(), RunError> {
        self.program.write("tracing_on", "0")?;
        self.device.write("tracing_on", "0")?;
        Ok(())
    }

    /// Drains the captures (tracing stopped) and removes the instances.
    pub(super) fn finish(self) -> Result<(), RunError> {
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
pub(super) fn program_command(spec: &RunSpec, files: &RunFiles) -> Result<Command, RunError> {
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
                .arg(out(&files.pager_trace));
            if !spec.saved_experts {
                command.arg("--fresh-experts");
            }
            command.arg("--").args(spec.program);
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
pub(super) fn spawn_traced(
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
pub(super) fn start_sampler(
    cgroup: &MemoryCgroup,
    model: &ModelTarget,
    origin: Instant,
) -> Sampler {
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
pub(super) fn wait_for(
    child: &mut Child,
    interrupted: &AtomicBool,
) -> Result<ExitStatus, RunError> {
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
}
