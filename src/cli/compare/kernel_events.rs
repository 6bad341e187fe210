//! The kernel side's faults and reads, reconstructed from its tracepoints.
//!
//! Fault latency. This kernel has no tracepoint at the end of a page fault, no kprobes
//! and no function_graph tracer, so the end is inferred per thread from the scheduler:
//! a fault on the model mapping (`exceptions:page_fault_user`, address in the mapping)
//! that blocks (`sched_switch` away from the thread with `prev_state=D`) ends when the
//! thread is switched back in (`sched_switch` with `next_pid` = the thread): that wait
//! is the fault's latency, I/O and page lock included. A fault that is followed by the
//! thread's next fault or system call (`raw_syscalls:sys_enter`) without blocking was
//! served from memory (page cache, fault-around): it is counted, latency unmeasured.
//! A thread preempted during a fault (`prev_state=R`) is not counted as blocked.
//!
//! Reads. Block requests complete in interrupt context, in any task, so requests are
//! traced for the model's device and attributed to the program when they overlap a bio
//! one of the program's tasks queued (`block:block_bio_queue`, traced for the device,
//! every process). The program's tasks are the child and, transitively, every task
//! one of them created (`task:task_newtask`): threads, children, and the kernel's
//! io_uring workers (`iou-wrk-*`), which issue the pager's punted reads and which the
//! per-process instance's fork following never sees. A request issued again before it
//! completed (requeued by the driver) counts once.

use std::collections::{BTreeMap, HashMap, HashSet};

use super::samples::{FaultSample, MappedRange, ReadRequest};
use super::trace_event::{DeviceNumber, EventKind, TraceEvent};

/// Faults on the model mapping, in time order, with times relative to `origin_ns`.
/// `events` are the program's own (per-process) events, in time order.
pub fn model_faults(
    events: &[TraceEvent],
    ranges: &[MappedRange],
    origin_ns: u64,
) -> Vec<FaultSample> {
    enum Open {
        Running(FaultSample),
        Blocked(FaultSample),
    }
    let mut open: HashMap<u32, Open> = HashMap::new();
    let mut faults = Vec::new();
    let since = |t: u64| t.saturating_sub(origin_ns);
    for event in events {
        match &event.kind {
            EventKind::PageFaultUser { address, .. } => {
                if let Some(Open::Running(previous) | Open::Blocked(previous)) =
                    open.remove(&event.tid)
                {
                    faults.push(previous);
                }
                if let Some(offset) = ranges.iter().find_map(|r| r.model_offset_of(*address)) {
                    let sample = FaultSample {
                        t_ns: since(event.t_ns),
                        tid: event.tid,
                        file_offset: offset & !4095,
                        latency_ns: None,
                    };
                    open.insert(event.tid, Open::Running(sample));
                }
            }
            EventKind::SyscallEnter { .. } => {
                if let Some(Open::Running(previous)) = open.remove(&event.tid) {
                    faults.push(previous);
                }
            }
            EventKind::SchedSwitch {
                prev_pid,
                prev_state,
                next_pid,
            } => {
                if prev_state.starts_with('D') {
                    if let Some(Open::Running(sample)) = open.remove(prev_pid) {
                        open.insert(*prev_pid, Open::Blocked(sample));
                    }
                }
                if matches!(open.get(next_pid), Some(Open::Blocked(_))) {
                    if let Some(Open::Blocked(mut sample)) = open.remove(next_pid) {
                        sample.latency_ns = Some(since(event.t_ns).saturating_sub(sample.t_ns));
                        faults.push(sample);
                    }
                }
            }
            _ => {}
        }
    }
    // Faults still open at the end never blocked (or never resumed): unmeasured.
    faults.extend(open.into_values().map(|state| match state {
        Open::Running(sample) | Open::Blocked(sample) => sample,
    }));
    faults.sort_by_key(|fault| fault.t_ns);
    faults
}

/// The tasks of the program, followed through task creation in time order.
#[derive(Debug)]
struct ProgramTasks {
    root: u32,
    tids: HashSet<u32>,
}

impl ProgramTasks {
    fn new(root: u32) -> Self {
        Self {
            root,
            tids: HashSet::from([root]),
        }
    }

    /// `creator` created `created`: ours if the creator is. A tid another process's
    /// task gets is no longer ours (tids are reused); the root is ours from the start,
    /// though someone else (the runner) created it.
    fn created(&mut self, creator: u32, created: u32) {
        if self.tids.contains(&creator) {
            self.tids.insert(created);
        } else if created != self.root {
            self.tids.remove(&created);
        }
    }

    fn contains(&self, tid: u32) -> bool {
        self.tids.contains(&tid)
    }
}

/// Sector ranges of the reads the program's tasks queued on `device`: start -> end
/// (longest wins on equal starts). `events` hold `task_newtask` and `block_bio_queue`
/// events of every process, in time order; `root` is the program's first task.
fn program_bios(events: &[TraceEvent], root: u32, device: DeviceNumber) -> BTreeMap<u64, u64> {
    let mut tasks = ProgramTasks::new(root);
    let mut bios: BTreeMap<u64, u64> = BTreeMap::new();
    for event in events {
        match &event.kind {
            EventKind::TaskNew { pid } => tasks.created(event.tid, *pid),
            EventKind::BioQueue {
                dev,
                rwbs,
                sector,
                sectors,
            } if *dev == device && rwbs.contains('R') && tasks.contains(event.tid) => {
                let end = sector + u64::from(*sectors);
                let entry = bios.entry(*sector).or_insert(end);
                *entry = (*entry).max(end);
            }
            _ => {}
        }
    }
    bios
}

/// The device's read requests that overlap a bio the program queued, with times
/// relative to `origin_ns`. `device_events` hold the device's `block_bio_queue`,
/// `block_rq_issue` and `block_rq_complete` events and every `task_newtask`, in time
/// order; `root` is the program's first task (the child the runner started).
pub fn program_reads(
    device_events: &[TraceEvent],
    root: u32,
    device: DeviceNumber,
    origin_ns: u64,
) -> Vec<ReadRequest> {
    let bios = program_bios(device_events, root, device);
    let overlaps_a_bio = |start: u64, end: u64| {
        // A bio starting before `end` whose end is past `start`. Bios are short and do
        // not nest, so the last few starting before `end` are enough to look at.
        bios.range(..end)
            .rev()
            .take(64)
            .any(|(_, &bio_end)| bio_end > start)
    };
    let mut requests = Vec::new();
    let mut in_flight: HashMap<u64, usize> = HashMap::new();
    for event in device_events {
        match &event.kind {
            EventKind::RequestIssue {
                dev,
                rwbs,
                bytes,
                sector,
                sectors,
            } if *dev == device && rwbs.contains('R') => {
                let bytes = if *bytes > 0 {
                    *bytes
                } else {
                    u64::from(*sectors) * 512
                };
                // A request the driver could not take is requeued and issued again
                // (virtio-blk under load does this often): one request, one count.
                if in_flight.contains_key(sector) {
                    continue;
                }
                if overlaps_a_bio(*sector, sector + u64::from(*sectors).max(1)) {
                    in_flight.insert(*sector, requests.len());
                    requests.push(ReadRequest {
                        issue_ns: event.t_ns.saturating_sub(origin_ns),
                        complete_ns: None,
                        bytes,
                    });
                }
            }
            EventKind::RequestComplete {
                dev, rwbs, sector, ..
            } if *dev == device && rwbs.contains('R') => {
                if let Some(index) = in_flight.remove(sector) {
                    requests[index].complete_ns = Some(event.t_ns.saturating_sub(origin_ns));
                }
            }
            _ => {}
        }
    }
    requests
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(t_us: u64, tid: u32, kind: EventKind) -> TraceEvent {
        TraceEvent {
            tid,
            cpu: 0,
            t_ns: t_us * 1000,
            kind,
        }
    }

    fn fault(address: u64) -> EventKind {
        EventKind::PageFaultUser {
            address,
            error_code: 4,
        }
    }

    fn switch(prev_pid: u32, prev_state: &str, next_pid: u32) -> EventKind {
        EventKind::SchedSwitch {
            prev_pid,
            prev_state: prev_state.into(),
            next_pid,
        }
    }

    const MAP: MappedRange = MappedRange {
        start: 0x10000,
        end: 0x20000,
        model_offset: 0x1000,
    };

    #[test]
    fn blocking_faults_get_latency_and_others_do_not() {
        let events = [
            // Thread 1: a fault that blocks 300 us.
            event(100, 1, fault(0x10010)),
            event(110, 1, switch(1, "D", 0)),
            // Thread 2: a fault served from memory, ended by its next system call.
            event(120, 2, fault(0x11000)),
            event(130, 2, EventKind::SyscallEnter { number: 0 }),
            event(400, 0, switch(0, "R", 1)),
            // Thread 2: a fault outside the model, then one preempted (R) in the model.
            event(500, 2, fault(0x90000)),
            event(510, 2, fault(0x12000)),
            event(520, 2, switch(2, "R+", 1)),
            event(530, 1, switch(1, "S", 2)),
        ];
        let faults = model_faults(&events, &[MAP], 50_000);
        assert_eq!(faults.len(), 3, "{faults:?}");
        assert_eq!(faults[0].t_ns, 50_000);
        assert_eq!(faults[0].file_offset, 0x1000);
        assert_eq!(faults[0].latency_ns, Some(300_000));
        assert_eq!(faults[1].file_offset, 0x2000);
        assert_eq!(faults[1].latency_ns, None);
        assert_eq!(faults[2].file_offset, 0x3000);
        assert_eq!(faults[2].latency_ns, None);
    }

    const DEV: DeviceNumber = DeviceNumber {
        major: 254,
        minor: 0,
    };

    fn bio(sector: u64, sectors: u32) -> EventKind {
        EventKind::BioQueue {
            dev: DEV,
            rwbs: "RA".into(),
            sector,
            sectors,
        }
    }

    fn issue(dev: DeviceNumber, sector: u64, sectors: u32) -> EventKind {
        EventKind::RequestIssue {
            dev,
            rwbs: "RA".into(),
            bytes: u64::from(sectors) * 512,
            sector,
            sectors,
        }
    }

    fn complete(sector: u64) -> EventKind {
        EventKind::RequestComplete {
            dev: DEV,
            rwbs: "RA".into(),
            sector,
            sectors: 8,
            error: 0,
        }
    }

    fn new_task(pid: u32) -> EventKind {
        EventKind::TaskNew { pid }
    }

    #[test]
    fn reads_are_attributed_by_the_program_s_bios() {
        let other = DeviceNumber { major: 8, minor: 0 };
        let device = [
            event(1, 5, bio(1000, 8)),
            event(2, 5, bio(1008, 8)),
            event(2, 9, bio(5000, 8)),
            // Two merged bios of the program.
            event(3, 5, issue(DEV, 1000, 16)),
            // Someone else's read on the same device, and a read on another device.
            event(4, 9, issue(DEV, 5000, 8)),
            event(4, 9, issue(other, 1000, 8)),
            // Requeued and issued again.
            event(5, 5, issue(DEV, 1000, 16)),
            event(10, 0, complete(1000)),
            event(11, 0, complete(5000)),
        ];
        let reads = program_reads(&device, 5, DEV, 1000);
        assert_eq!(
            reads,
            vec![ReadRequest {
                issue_ns: 2000,
                complete_ns: Some(9000),
                bytes: 8192
            }]
        );
    }

    #[test]
    fn reads_of_every_task_the_program_created_count_and_no_one_else_s() {
        let device = [
            // The runner (1) starts the program (5): ours all the same.
            event(1, 1, new_task(5)),
            // The program's thread 6 and an io_uring worker 7 that thread 6's ring
            // created (no fork event announces it), which creates worker 8.
            event(2, 5, new_task(6)),
            event(3, 6, new_task(7)),
            event(4, 7, new_task(8)),
            // Another process (9) creates 10.
            event(5, 9, new_task(10)),
            event(10, 5, bio(1000, 8)),
            event(11, 6, bio(2000, 8)),
            event(12, 7, bio(3000, 8)),
            event(13, 8, bio(4000, 8)),
            event(14, 9, bio(5000, 8)),
            event(15, 10, bio(6000, 8)),
            // Worker 7 exits; another process's new task gets its tid.
            event(20, 9, new_task(7)),
            event(21, 7, bio(7000, 8)),
        ];
        let issues: Vec<TraceEvent> = (1..=7)
            .map(|i| event(30 + i, 0, issue(DEV, i * 1000, 8)))
            .collect();
        let events: Vec<TraceEvent> = device.into_iter().chain(issues).collect();
        let issued_us: Vec<u64> = program_reads(&events, 5, DEV, 0)
            .iter()
            .map(|r| r.issue_ns / 1000)
            .collect();
        assert_eq!(issued_us, vec![31, 32, 33, 34]);
    }
}
