//! `report.md` and `report.json` from the runs of both sides.

use std::fmt::Write;

use serde::{Deserialize, Serialize};

use super::figures::{request_size_edges, Spread, LATENCY_EDGES_US};
use super::record::{RunRecord, Side};
use hyperoffload::size::format_size;

/// How the figures were obtained, for a reader who wants to reproduce them.
pub const METHOD: &str = "\
- Each run starts cold: `sync; echo 3 > /proc/sys/vm/drop_caches` (root), then mincore(2) over \
the model checks none of it stayed cached (pages another process maps survive the drop).
- Kernel side: the program unchanged, in a fresh memory cgroup (cgroup v2 `memory.max`, or v1 \
`memory.limit_in_bytes`) limited to the budget (to the `--cgroup-limit` when one is given), page \
cache included. The child joins the cgroup between fork and exec. Pager side: `hyperoffload run \
--budget B --stats F --trace F -- PROGRAM`, in a cgroup used only to measure its peak (limited \
to the `--cgroup-limit` when one is given, the pager's frames and the program's memory both \
counted in it).
- Tracing: tracefs directly, two private instances per run (`instances/hyperoffload-PID-*`, \
`trace_clock` mono). Instance 1 follows the program (`set_event_pid` written by the child \
before exec, `options/event-fork`) with `exceptions:page_fault_user`, `sched:sched_switch` and \
`raw_syscalls:sys_enter` (kernel side). Instance 2 has `block:block_bio_queue` and \
`block:block_rq_issue`/`block_rq_complete` filtered by the device (`dev == MKDEV(major, \
minor)` of the disk holding the model), since completions run in interrupt context, and \
`task:task_newtask`. The raw event text is kept as `run-*.events.txt` and `run-*.block.txt`.
- Reads: the device's read requests that overlap a bio one of the program's tasks queued: the \
child and, transitively, every task one of them created (threads, children, and io_uring's \
`iou-wrk` workers, which no fork event announces); bytes, count and sizes from \
`block_rq_issue`, bandwidth per 100 ms by `block_rq_complete` time.
- Kernel faults: `page_fault_user` events whose address lies in the model's file mapping \
(ranges from `/proc/PID/maps`, sampled every 25 ms). Latency: the kernel here has no fault-exit \
tracepoint, kprobes or function_graph, so a fault's end is inferred per thread: a fault that \
blocks (`sched_switch` away with `prev_state=D`) ends when the thread is switched back in; \
that wait (I/O and page lock) is its latency. A fault followed by the thread's next fault or \
system call without blocking was served from memory: counted, latency not measured.
- Pager faults: the pager's own trace (`run-pager-*.faults.csv`): faults served by a demand or \
in-flight read carry their latency (fault event to wake-up); faults on resident or staged blocks \
count like the kernel's non-blocking ones. Both sides' latencies use the same bucket edges.
- Memory: cgroup peak (`memory.max_usage_in_bytes` / `memory.peak`); model resident: largest \
smaps `Rss` of the model mapping (kernel), the pager's `peak_resident_bytes` (pager); process \
peak: largest sampled VmRSS sum over the cgroup's processes.
- Medians over runs, spread as min-max; ratio = pager median / kernel median.";

/// The runs whose program failed, each named with its exit status and stderr file.
pub fn failed_runs(runs: &[RunRecord]) -> Vec<String> {
    runs.iter()
        .filter(|r| !r.succeeded())
        .map(|r| {
            format!(
                "{} run {} (exit {}, see `{}`)",
                r.side.name(),
                r.index,
                r.exit_code.map_or("by signal".into(), |c| c.to_string()),
                r.stderr_file
            )
        })
        .collect()
}

/// What was compared.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ReportHeader {
    pub command: Vec<String>,
    /// The model's file; its first part for a split model.
    pub model: String,
    /// Every part of a split model, in order; empty for a model in one file.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub model_parts: Vec<String>,
    /// Bytes of the model: of all its parts for a split model.
    pub model_bytes: u64,
    /// The pager's fixed budget; 0 with `budget_auto`.
    pub budget_bytes: u64,
    /// The pager chose and followed its budget (`run --budget auto`).
    #[serde(default)]
    pub budget_auto: bool,
    /// Both sides ran in a memory cgroup of this size; without it, the kernel side's
    /// cgroup was limited to the budget and the pager's was not limited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cgroup_limit_bytes: Option<u64>,
    /// The disks holding the model's files (`major:minor`, comma-separated).
    pub device: String,
    pub runs_per_side: usize,
    /// Every run started with a dropped page cache.
    pub cold: bool,
    pub cgroup_version: String,
    pub kernel: String,
}

impl ReportHeader {
    /// `Model `m.gguf` (92.0 MiB)`, or for a split model
    /// `Model `m-00001-of-00003.gguf` split in 3 files (92.0 MiB in all)`.
    /// The budget as the header states it: the pager's and the cgroups'.
    fn budget_phrase(&self) -> String {
        let share = |bytes: u64| bytes as f64 * 100.0 / self.model_bytes.max(1) as f64;
        let budget = match self.budget_auto {
            true => "auto (the pager's choice, followed while it ran: its curve is in the resident memory plot)".to_string(),
            false => format!("{} ({:.0}% of the model)", format_size(self.budget_bytes), share(self.budget_bytes)),
        };
        match self.cgroup_limit_bytes {
            Some(limit) => format!(
                "{budget}, both sides in a memory cgroup of {} ({:.0}% of the model)",
                format_size(limit),
                share(limit)
            ),
            None => budget,
        }
    }

    fn model_phrase(&self) -> String {
        match self.model_parts.len() {
            0 | 1 => format!("Model `{}` ({})", self.model, format_size(self.model_bytes)),
            parts => format!(
                "Model `{}` split in {parts} files ({} in all)",
                self.model,
                format_size(self.model_bytes)
            ),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    pub header: ReportHeader,
    pub method: String,
    pub latency_edges_us: Vec<f64>,
    pub request_size_edges: Vec<u64>,
    pub runs: Vec<RunRecord>,
}

/// One row of a metric table.
struct Metric {
    name: &'static str,
    unit: &'static str,
    value: fn(&RunRecord) -> Option<f64>,
}

const MIB: f64 = 1024.0 * 1024.0;

fn metric_groups() -> Vec<(&'static str, Vec<Metric>)> {
    vec![
        ("Speed", speed_metrics()),
        ("Reads from the block device", read_metrics()),
        ("Page faults on the model", fault_metrics()),
        ("Memory", memory_metrics()),
    ]
}

/// How fast the program ran.
fn speed_metrics() -> Vec<Metric> {
    vec![
        Metric {
            name: "wall time",
            unit: "s",
            value: |r| Some(r.wall_s),
        },
        Metric {
            name: "generation (llama-bench tg)",
            unit: "t/s",
            value: |r| r.program.bench_tokens_per_s("tg"),
        },
        Metric {
            name: "prompt (llama-bench pp)",
            unit: "t/s",
            value: |r| r.program.bench_tokens_per_s("pp"),
        },
        Metric {
            name: "eval time per token",
            unit: "ms",
            value: |r| r.program.eval_ms_per_token,
        },
    ]
}

/// What the model's device read, as the kernel's block layer saw it (and as the pager counted it).
fn read_metrics() -> Vec<Metric> {
    vec![
        Metric {
            name: "bytes read",
            unit: "MiB",
            value: |r| Some(r.io.bytes_read as f64 / MIB),
        },
        Metric {
            name: "read requests",
            unit: "",
            value: |r| Some(r.io.read_requests as f64),
        },
        Metric {
            name: "mean request size",
            unit: "KiB",
            value: |r| Some(r.io.mean_request_bytes / 1024.0),
        },
        Metric {
            name: "mean read bandwidth",
            unit: "MB/s",
            value: |r| Some(r.io.mean_bandwidth_mb_s),
        },
        Metric {
            name: "peak read bandwidth (100 ms)",
            unit: "MB/s",
            value: |r| Some(r.io.peak_bandwidth_mb_s),
        },
        Metric {
            name: "bytes read (pager's own count)",
            unit: "MiB",
            value: |r| r.pager_stat("bytes_read").map(|b| b as f64 / MIB),
        },
    ]
}

/// Faults on the model's pages, and the latency of those that waited for a read.
fn fault_metrics() -> Vec<Metric> {
    vec![
        Metric {
            name: "faults",
            unit: "",
            value: |r| Some(r.faults.model_faults as f64),
        },
        Metric {
            name: "faults that waited for a read",
            unit: "",
            value: |r| Some(r.faults.waited_faults as f64),
        },
        Metric {
            name: "latency p50 (waited)",
            unit: "µs",
            value: |r| (r.faults.waited_faults > 0).then_some(r.faults.latency.p50_us),
        },
        Metric {
            name: "latency p90 (waited)",
            unit: "µs",
            value: |r| (r.faults.waited_faults > 0).then_some(r.faults.latency.p90_us),
        },
        Metric {
            name: "latency p99 (waited)",
            unit: "µs",
            value: |r| (r.faults.waited_faults > 0).then_some(r.faults.latency.p99_us),
        },
        Metric {
            name: "latency max (waited)",
            unit: "µs",
            value: |r| (r.faults.waited_faults > 0).then_some(r.faults.latency.max_us),
        },
    ]
}

/// Peak memory: the cgroup's, the model's resident set, the process's.
fn memory_metrics() -> Vec<Metric> {
    vec![
        Metric {
            name: "cgroup peak (page cache included)",
            unit: "MiB",
            value: |r| r.memory.cgroup_peak_bytes.map(|b| b as f64 / MIB),
        },
        Metric {
            name: "model peak resident",
            unit: "MiB",
            value: |r| r.memory.model_peak_resident_bytes.map(|b| b as f64 / MIB),
        },
        Metric {
            name: "process peak RSS",
            unit: "MiB",
            value: |r| r.memory.process_peak_rss_bytes.map(|b| b as f64 / MIB),
        },
    ]
}

fn number(value: f64) -> String {
    if value == 0.0 || value.abs() >= 100.0 {
        format!("{value:.0}")
    } else if value.abs() >= 10.0 {
        format!("{value:.1}")
    } else {
        format!("{value:.2}")
    }
}

fn spread_cell(spread: Option<Spread>) -> String {
    match spread {
        None => "–".into(),
        Some(s) if s.runs == 1 || s.min == s.max => number(s.median),
        Some(s) => format!("{} ({}–{})", number(s.median), number(s.min), number(s.max)),
    }
}

fn side_values(runs: &[RunRecord], side: Side, value: fn(&RunRecord) -> Option<f64>) -> Vec<f64> {
    runs.iter()
        .filter(|r| r.side == side && r.succeeded())
        .filter_map(value)
        .collect()
}

impl Report {
    pub fn to_markdown(&self) -> String {
        let mut md = String::new();
        self.write_header(&mut md);
        self.write_metric_tables(&mut md);
        self.write_histogram(
            &mut md,
            "Fault latency histogram (faults that waited, summed over runs)",
            "latency (µs)",
            &self
                .latency_edges_us
                .iter()
                .map(|e| format!("≤ {e}"))
                .collect::<Vec<_>>(),
            |r| &r.faults.latency_bucket_counts,
        );
        self.write_histogram(
            &mut md,
            "Read request sizes (summed over runs)",
            "size",
            &self
                .request_size_edges
                .iter()
                .map(|e| format!("≤ {}", format_size(*e)))
                .collect::<Vec<_>>(),
            |r| &r.io.request_size_counts,
        );
        let _ = writeln!(md, "## Plots\n");
        for (file, title) in PLOTS {
            let _ = writeln!(md, "- [{title}]({file})");
        }
        let _ = writeln!(md, "\n## Method\n\n{}\n", self.method);
        let lost: u64 = self.runs.iter().map(|r| r.tracing.lost_events).sum();
        if lost > 0 {
            let _ = writeln!(md, "Trace buffers dropped {lost} events over all runs: fault and read counts are lower bounds.\n");
        }
        md
    }

    /// The command, model, budget and system, and the runs that were not cold or
    /// failed.
    fn write_header(&self, md: &mut String) {
        let h = &self.header;
        let _ = writeln!(md, "# hyperoffload compare\n");
        let _ = writeln!(md, "`{}`\n", h.command.join(" "));
        let _ = writeln!(
            md,
            "{}, budget {}, {} run(s) per side, alternating; device {}, cgroup {}, kernel {}.\n",
            h.model_phrase(),
            h.budget_phrase(),
            h.runs_per_side,
            h.device,
            h.cgroup_version,
            h.kernel
        );
        if !h.cold {
            let _ = writeln!(
                md,
                "**Not cold**: before some runs the page cache could not be dropped (not root) or part of the model stayed cached (mapped by another process), so reads may have been served from memory.\n"
            );
            for run in self.runs.iter().filter(|r| !r.cold) {
                let _ = writeln!(
                    md,
                    "- {} run {}: {} of the model cached at the start",
                    run.side.name(),
                    run.index,
                    format_size(run.model_cached_bytes)
                );
            }
            let _ = writeln!(md);
        }
        let failed = failed_runs(&self.runs);
        if !failed.is_empty() {
            let _ = writeln!(
                md,
                "**Failed runs, left out of the figures**: {}.\n",
                failed.join(", ")
            );
        }
    }

    /// A table per metric group: each side's median (and range) and their ratio.
    fn write_metric_tables(&self, md: &mut String) {
        for (group, metrics) in metric_groups() {
            let _ = writeln!(md, "## {group}\n");
            let _ = writeln!(
                md,
                "| metric | kernel | pager | pager/kernel |\n|---|---:|---:|---:|"
            );
            for metric in metrics {
                let kernel = Spread::of(&side_values(&self.runs, Side::Kernel, metric.value));
                let pager = Spread::of(&side_values(&self.runs, Side::Pager, metric.value));
                if kernel.is_none() && pager.is_none() {
                    continue;
                }
                let ratio = match (kernel, pager) {
                    (Some(k), Some(p)) if k.median != 0.0 => format!("{:.2}", p.median / k.median),
                    _ => "–".into(),
                };
                let name = if metric.unit.is_empty() {
                    metric.name.to_string()
                } else {
                    format!("{} ({})", metric.name, metric.unit)
                };
                let _ = writeln!(
                    md,
                    "| {name} | {} | {} | {ratio} |",
                    spread_cell(kernel),
                    spread_cell(pager)
                );
            }
            let _ = writeln!(md);
        }
    }

    fn write_histogram(
        &self,
        md: &mut String,
        title: &str,
        label: &str,
        edges: &[String],
        counts: fn(&RunRecord) -> &Vec<u64>,
    ) {
        let sum = |side: Side| {
            let mut total = vec![0u64; edges.len() + 1];
            for run in self.runs.iter().filter(|r| r.side == side && r.succeeded()) {
                for (slot, count) in total.iter_mut().zip(counts(run)) {
                    *slot += count;
                }
            }
            total
        };
        let (kernel, pager) = (sum(Side::Kernel), sum(Side::Pager));
        let _ = writeln!(
            md,
            "## {title}\n\n| {label} | kernel | pager |\n|---|---:|---:|"
        );
        let labels = edges.iter().cloned().chain(["more".to_string()]);
        for ((label, k), p) in labels.zip(&kernel).zip(&pager) {
            if *k > 0 || *p > 0 {
                let _ = writeln!(md, "| {label} | {k} | {p} |");
            }
        }
        let _ = writeln!(md);
    }
}

/// The plot files `write_plots` produces, with their titles.
pub const PLOTS: &[(&str, &str)] = &[
    (
        "resident.svg",
        "Resident bytes and the pager's budget over time",
    ),
    ("bandwidth.svg", "Read bandwidth over time"),
    ("request-sizes.svg", "Read request size histogram"),
    ("fault-latency-cdf.svg", "Fault latency CDF"),
    ("fault-map.svg", "Fault map: file offset against time"),
];

/// The standard bucket edges, for a report's header fields.
pub fn standard_edges() -> (Vec<f64>, Vec<u64>) {
    (LATENCY_EDGES_US.to_vec(), request_size_edges())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(side: Side, index: usize, exit_code: Option<i32>) -> RunRecord {
        RunRecord {
            side,
            index,
            exit_code,
            stderr_file: format!("run-{}-{index}.stderr", side.name()),
            ..Default::default()
        }
    }

    #[test]
    fn failed_runs_name_each_failure_and_nothing_else() {
        let runs = [
            run(Side::Kernel, 1, Some(0)),
            run(Side::Pager, 1, Some(1)),
            run(Side::Kernel, 2, None),
            run(Side::Pager, 2, Some(0)),
        ];
        assert_eq!(
            failed_runs(&runs),
            [
                "pager run 1 (exit 1, see `run-pager-1.stderr`)",
                "kernel run 2 (exit by signal, see `run-kernel-2.stderr`)"
            ]
        );
        assert!(failed_runs(&runs[..1]).is_empty());
    }

    #[test]
    fn a_split_model_is_named_with_its_parts_and_total_size() {
        let mut header = ReportHeader {
            command: vec!["llama-bench".into()],
            model: "/m/model.gguf".into(),
            model_parts: Vec::new(),
            model_bytes: 3 << 20,
            budget_bytes: 3 << 19,
            budget_auto: false,
            cgroup_limit_bytes: None,
            device: "8:0".into(),
            runs_per_side: 1,
            cold: true,
            cgroup_version: "V2".into(),
            kernel: "6.18".into(),
        };
        assert_eq!(header.model_phrase(), "Model `/m/model.gguf` (3.00 MiB)");
        let json = serde_json::to_string(&header).unwrap();
        assert!(!json.contains("model_parts"), "{json}");

        header.model = "/m/s-00001-of-00003.gguf".into();
        header.model_parts = (1..=3)
            .map(|no| format!("/m/s-{no:05}-of-00003.gguf"))
            .collect();
        assert_eq!(
            header.model_phrase(),
            "Model `/m/s-00001-of-00003.gguf` split in 3 files (3.00 MiB in all)"
        );
        let back: ReportHeader =
            serde_json::from_str(&serde_json::to_string(&header).unwrap()).unwrap();
        assert_eq!(back.model_parts.len(), 3);

        assert_eq!(header.budget_phrase(), "1.50 MiB (50% of the model)");
        header.cgroup_limit_bytes = Some(2 << 20);
        assert_eq!(
            header.budget_phrase(),
            "1.50 MiB (50% of the model), both sides in a memory cgroup of 2.00 MiB (67% of the model)"
        );
        header.budget_auto = true;
        header.budget_bytes = 0;
        assert!(header
            .budget_phrase()
            .starts_with("auto (the pager's choice"));
        // Reports written before these fields were kept read as fixed budgets.
        let mut old = serde_json::to_value(&header).unwrap();
        let fields = old.as_object_mut().unwrap();
        fields.remove("budget_auto");
        fields.remove("cgroup_limit_bytes");
        let back: ReportHeader = serde_json::from_value(old).unwrap();
        assert!(!back.budget_auto && back.cgroup_limit_bytes.is_none());
    }
}
