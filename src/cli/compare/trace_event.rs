//! One line of tracefs text output (`trace`, `trace_pipe`), parsed into the events the
//! comparison uses. The line layout is
//!
//! ```text
//!            TASK-PID     CPU#  |||||  TIMESTAMP  FUNCTION
//!      llama-bench-4711   [001] d....  1606.771107: page_fault_user: address=0x7f41... ip=0x... error_code=0x14
//! ```
//!
//! and each event's text follows the `print fmt` of its `format` file.

use thiserror::Error;

/// A block device number as the kernel's block tracepoints print it (`254,0`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub struct DeviceNumber {
    pub major: u32,
    pub minor: u32,
}

impl DeviceNumber {
    /// The kernel-internal `dev_t` (`MKDEV`: major << 20 | minor), which event filters on
    /// a `dev` field compare against. It is not the user-space `st_dev` encoding.
    pub fn kernel_dev_t(self) -> u64 {
        (u64::from(self.major) << 20) | u64::from(self.minor)
    }
}

impl std::fmt::Display for DeviceNumber {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.major, self.minor)
    }
}

/// What happened, for the events the comparison reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventKind {
    /// `exceptions:page_fault_user`.
    PageFaultUser { address: u64, error_code: u64 },
    /// `sched:sched_switch`; `prev_state` as printed (`R`, `S`, `D`, `R+`, ...).
    SchedSwitch {
        prev_pid: u32,
        prev_state: String,
        next_pid: u32,
    },
    /// `raw_syscalls:sys_enter`: the thread is back in user space and made a call.
    SyscallEnter { number: i64 },
    /// `block:block_bio_queue`: a bio submitted by the current task.
    BioQueue {
        dev: DeviceNumber,
        rwbs: String,
        sector: u64,
        sectors: u32,
    },
    /// `block:block_rq_issue`: a request sent to the device.
    RequestIssue {
        dev: DeviceNumber,
        rwbs: String,
        bytes: u64,
        sector: u64,
        sectors: u32,
    },
    /// `block:block_rq_complete`.
    RequestComplete {
        dev: DeviceNumber,
        rwbs: String,
        sector: u64,
        sectors: u32,
        error: i32,
    },
    /// `task:task_newtask`: the current task created task `pid` (a thread, a child,
    /// or a kernel worker such as io_uring's `iou-wrk`).
    TaskNew { pid: u32 },
    /// Any other event, by name.
    Other(String),
}

/// One parsed line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceEvent {
    /// The task that was current when the event fired (a thread id).
    pub tid: u32,
    pub cpu: u32,
    /// The trace clock's timestamp in nanoseconds (printed with microsecond precision).
    pub t_ns: u64,
    pub kind: EventKind,
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum TraceLineError {
    #[error("no `[CPU]` column in `{0}`")]
    NoCpu(String),
    #[error("no `TASK-PID` before the CPU column in `{0}`")]
    NoTask(String),
    #[error("no `TIMESTAMP: EVENT:` after the CPU column in `{0}`")]
    NoTimestamp(String),
    #[error("event `{event}`: cannot read `{text}`")]
    BadEvent { event: String, text: String },
}

/// Parses one line; comment lines (`#`) and blank lines give `Ok(None)`. The trace
/// pipe also prints `CPU:1 [LOST 12 EVENTS]` lines: they give `Ok(None)` too, and
/// [`lost_events`] counts them.
pub fn parse_line(line: &str) -> Result<Option<TraceEvent>, TraceLineError> {
    let trimmed = line.trim();
    if trimmed.is_empty() || trimmed.starts_with('#') || lost_events(trimmed).is_some() {
        return Ok(None);
    }
    let (task, cpu, rest) =
        split_cpu_column(line).ok_or_else(|| TraceLineError::NoCpu(line.into()))?;
    let tid = task
        .trim()
        .rsplit_once('-')
        .and_then(|(_, pid)| pid.parse().ok())
        .ok_or_else(|| TraceLineError::NoTask(line.into()))?;
    // After the CPU column: the flags, then `SECONDS.MICROS:`, then `event:`.
    let mut words = rest.trim_start().splitn(2, char::is_whitespace);
    let _flags = words.next();
    let rest = words.next().unwrap_or("").trim_start();
    let (stamp, rest) = rest
        .split_once(": ")
        .ok_or_else(|| TraceLineError::NoTimestamp(line.into()))?;
    let t_ns = parse_timestamp(stamp).ok_or_else(|| TraceLineError::NoTimestamp(line.into()))?;
    let (event, text) = rest
        .split_once(": ")
        .unwrap_or((rest.trim_end_matches(':'), ""));
    let kind = event_kind(event, text).ok_or_else(|| TraceLineError::BadEvent {
        event: event.to_string(),
        text: text.to_string(),
    })?;
    Ok(Some(TraceEvent {
        tid,
        cpu,
        t_ns,
        kind,
    }))
}

/// The event `event` read from its fields `text`; `None` when a field it needs is not
/// there or does not read. An event the comparison does not use is `Other`.
fn event_kind(event: &str, text: &str) -> Option<EventKind> {
    Some(match event {
        "page_fault_user" => EventKind::PageFaultUser {
            address: hex(field(text, "address=")?)?,
            error_code: hex(field(text, "error_code=")?)?,
        },
        "sched_switch" => EventKind::SchedSwitch {
            prev_pid: number(field(text, "prev_pid="))?,
            prev_state: field(text, "prev_state=")?.to_string(),
            next_pid: number(field(text, "next_pid="))?,
        },
        "sys_enter" => EventKind::SyscallEnter {
            number: number(
                text.strip_prefix("NR ")
                    .and_then(|t| t.split_whitespace().next()),
            )?,
        },
        "block_bio_queue" => bio_queue(text)?,
        "block_rq_issue" => request_issue(text)?,
        "block_rq_complete" => request_complete(text)?,
        "task_newtask" => EventKind::TaskNew {
            pid: number(field(text, "pid="))?,
        },
        other => EventKind::Other(other.to_string()),
    })
}

/// `block_bio_queue`'s fields: `254,0 R 12345 + 8 [comm]`.
fn bio_queue(text: &str) -> Option<EventKind> {
    let words: Vec<&str> = text.split_whitespace().collect();
    Some(EventKind::BioQueue {
        dev: device(words.first())?,
        rwbs: words.get(1)?.to_string(),
        sector: number(words.get(2).copied())?,
        sectors: number(words.get(4).copied())?,
    })
}

/// `block_rq_issue`'s fields: `254,0 R 4096 () 12345 + 8 none,0,0 [comm]`; the `(cmd)`
/// is empty for file-system requests.
fn request_issue(text: &str) -> Option<EventKind> {
    let words: Vec<&str> = text.split_whitespace().collect();
    let plus = words.iter().position(|w| *w == "+")?;
    Some(EventKind::RequestIssue {
        dev: device(words.first())?,
        rwbs: words.get(1)?.to_string(),
        bytes: number(words.get(2).copied())?,
        sector: number(plus.checked_sub(1).and_then(|i| words.get(i).copied()))?,
        sectors: number(words.get(plus + 1).copied())?,
    })
}

/// `block_rq_complete`'s fields: `254,0 R () 12345 + 8 none,0,0 [0]`.
fn request_complete(text: &str) -> Option<EventKind> {
    let words: Vec<&str> = text.split_whitespace().collect();
    let plus = words.iter().position(|w| *w == "+")?;
    let error = words
        .last()
        .and_then(|w| w.strip_prefix('[')?.strip_suffix(']')?.parse().ok())?;
    Some(EventKind::RequestComplete {
        dev: device(words.first())?,
        rwbs: words.get(1)?.to_string(),
        sector: number(plus.checked_sub(1).and_then(|i| words.get(i).copied()))?,
        sectors: number(words.get(plus + 1).copied())?,
        error,
    })
}

/// The count in a `CPU:1 [LOST 12 EVENTS]` line.
pub fn lost_events(line: &str) -> Option<u64> {
    let rest = line.trim().strip_prefix("CPU:")?;
    let count = rest.split("[LOST ").nth(1)?.split_whitespace().next()?;
    count.parse().ok()
}

/// Splits `TASK-PID [CPU] rest` at the first `[digits]` (task names may hold spaces).
fn split_cpu_column(line: &str) -> Option<(&str, u32, &str)> {
    let mut search = 0;
    while let Some(open) = line[search..].find('[').map(|i| i + search) {
        let close = line[open..].find(']').map(|i| i + open)?;
        let inside = &line[open + 1..close];
        if !inside.is_empty() && inside.bytes().all(|b| b.is_ascii_digit()) {
            return Some((&line[..open], inside.parse().ok()?, &line[close + 1..]));
        }
        search = open + 1;
    }
    None
}

/// `1606.771107` (seconds, any number of fraction digits) to nanoseconds.
fn parse_timestamp(text: &str) -> Option<u64> {
    let (seconds, fraction) = text.trim().split_once('.').unwrap_or((text.trim(), ""));
    let seconds: u64 = seconds.parse().ok()?;
    let digits = fraction.len().min(9);
    let fraction_ns: u64 = if digits == 0 {
        0
    } else {
        fraction[..digits].parse::<u64>().ok()? * 10u64.pow(9 - digits as u32)
    };
    Some(seconds * 1_000_000_000 + fraction_ns)
}

/// The word after `key` in `text` (`prev_state=D ==> ...` gives `D`).
fn field<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    let start = text.find(key)? + key.len();
    text[start..].split_whitespace().next()
}

fn number<T: std::str::FromStr>(text: Option<&str>) -> Option<T> {
    text?.trim().parse().ok()
}

fn hex(text: &str) -> Option<u64> {
    u64::from_str_radix(text.trim().trim_start_matches("0x"), 16).ok()
}

fn device(text: Option<&&str>) -> Option<DeviceNumber> {
    let (major, minor) = text?.split_once(',')?;
    Some(DeviceNumber {
        major: major.parse().ok()?,
        minor: minor.parse().ok()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(line: &str) -> TraceEvent {
        parse_line(line).unwrap().unwrap()
    }

    #[test]
    fn page_fault_user() {
        let event = parse("            sync-13588   [000] d....  1606.771107: page_fault_user: address=0x7f413808eb70 ip=0x7f413808eb70 error_code=0x14");
        assert_eq!(event.tid, 13588);
        assert_eq!(event.cpu, 0);
        assert_eq!(event.t_ns, 1_606_771_107_000);
        assert_eq!(
            event.kind,
            EventKind::PageFaultUser {
                address: 0x7f41_3808_eb70,
                error_code: 0x14
            }
        );
    }

    #[test]
    fn sched_switch_with_spaces_and_dashes_in_names() {
        let event = parse("   my task-name-77   [001] d..2.  12.000001: sched_switch: prev_comm=my task-name prev_pid=77 prev_prio=120 prev_state=D ==> next_comm=swapper/1 next_pid=0 next_prio=120");
        assert_eq!(event.tid, 77);
        assert_eq!(event.t_ns, 12_000_001_000);
        assert_eq!(
            event.kind,
            EventKind::SchedSwitch {
                prev_pid: 77,
                prev_state: "D".into(),
                next_pid: 0
            }
        );
    }

    #[test]
    fn block_events() {
        let dev = DeviceNumber {
            major: 254,
            minor: 0,
        };
        assert_eq!(
            parse("     llama-bench-900     [001] .....   5.5: block_bio_queue: 254,0 RA 2048 + 256 [llama-bench]").kind,
            EventKind::BioQueue {
                dev,
                rwbs: "RA".into(),
                sector: 2048,
                sectors: 256
            }
        );
        assert_eq!(
            parse("     llama-bench-900     [001] .....   5.5: block_rq_issue: 254,0 RA 131072 () 2048 + 256 none,0,0 [llama-bench]").kind,
            EventKind::RequestIssue {
                dev,
                rwbs: "RA".into(),
                bytes: 131072,
                sector: 2048,
                sectors: 256
            }
        );
        assert_eq!(
            parse("          <idle>-0       [000] d.h1.   5.600000: block_rq_complete: 254,0 RA () 2048 + 256 none,0,0 [0]").kind,
            EventKind::RequestComplete {
                dev,
                rwbs: "RA".into(),
                sector: 2048,
                sectors: 256,
                error: 0
            }
        );
        assert_eq!(dev.kernel_dev_t(), 266_338_304);
    }

    #[test]
    fn task_newtask() {
        let event = parse("     llama-bench-900     [001] .....   5.5: task_newtask: pid=912 comm=llama bench clone_flags=3d0f00 oom_score_adj=0");
        assert_eq!(event.tid, 900);
        assert_eq!(event.kind, EventKind::TaskNew { pid: 912 });
    }

    #[test]
    fn syscalls_other_events_comments_and_losses() {
        assert_eq!(
            parse("  a-5 [000] ..... 1.000000: sys_enter: NR 202 (7f, 80, 0, 0, 0, 0)").kind,
            EventKind::SyscallEnter { number: 202 }
        );
        assert_eq!(
            parse("  a-5 [000] ..... 1.000000: mm_filemap_fault: dev=254:0 ino=12 ofs=4096").kind,
            EventKind::Other("mm_filemap_fault".into())
        );
        assert_eq!(parse_line("# tracer: nop").unwrap(), None);
        assert_eq!(parse_line("").unwrap(), None);
        assert_eq!(parse_line("CPU:1 [LOST 12 EVENTS]").unwrap(), None);
        assert_eq!(lost_events("CPU:1 [LOST 12 EVENTS]"), Some(12));
    }

    #[test]
    fn malformed_lines_are_errors() {
        assert!(matches!(
            parse_line("garbage"),
            Err(TraceLineError::NoCpu(_))
        ));
        assert!(matches!(
            parse_line("  a-5 [000] ..... 1.0: page_fault_user: address=zz error_code=0x4"),
            Err(TraceLineError::BadEvent { .. })
        ));
        assert!(matches!(
            parse_line("  a-5 [000] ..... notatime page_fault_user"),
            Err(TraceLineError::NoTimestamp(_))
        ));
    }
}
