//! One run's figures, as `report.json` holds them.

use serde::{Deserialize, Serialize};

use super::figures::LatencyFigures;
use super::program_output::ProgramFigures;
use super::samples::MemorySample;

/// Which way the program's model was paged.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Side {
    /// Unchanged program: mmap, page cache and readahead, in a memory cgroup limited to
    /// the budget.
    #[default]
    Kernel,
    /// The program under the shim (`hyperoffload run`) with the same budget.
    Pager,
}

impl Side {
    pub fn name(self) -> &'static str {
        match self {
            Side::Kernel => "kernel",
            Side::Pager => "pager",
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct IoFigures {
    /// Bytes of the program's read requests to the model's block device.
    pub bytes_read: u64,
    pub read_requests: u64,
    pub mean_request_bytes: f64,
    /// Bytes read over the run's wall time, MB/s.
    pub mean_bandwidth_mb_s: f64,
    /// The highest bandwidth in any 100 ms interval, MB/s.
    pub peak_bandwidth_mb_s: f64,
    /// Requests per size bucket (edges: `figures::request_size_edges`, then overflow).
    pub request_size_counts: Vec<u64>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct FaultFigures {
    /// Faults on the model's pages (kernel) or blocks (pager).
    pub model_faults: u64,
    /// Faults that waited for a read: blocked in D state (kernel), served by a demand
    /// or in-flight read (pager). Latency figures cover these.
    pub waited_faults: u64,
    pub latency: LatencyFigures,
    /// Waited faults per latency bucket (edges: `figures::LATENCY_EDGES_US`, then
    /// overflow).
    pub latency_bucket_counts: Vec<u64>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct MemoryFigures {
    /// Peak charge of the run's memory cgroup (page cache included).
    pub cgroup_peak_bytes: Option<u64>,
    /// Peak resident bytes of the model: the largest smaps `Rss` of its file mapping
    /// (kernel), the pager's `peak_resident_bytes` (pager).
    pub model_peak_resident_bytes: Option<u64>,
    /// Peak resident set of the program's processes (VmRSS, sampled).
    pub process_peak_rss_bytes: Option<u64>,
}

/// Time series for the plots.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RunSeries {
    pub memory: Vec<MemorySample>,
    /// (seconds, MB/s) per 100 ms.
    pub bandwidth_mb_s: Vec<(f64, f64)>,
    /// (seconds, file offset) of faults on the model, thinned.
    pub fault_map: Vec<(f64, u64)>,
    /// (latency µs, share of waited faults), thinned.
    pub latency_cdf: Vec<(f64, f64)>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TracingFigures {
    /// Events the ring buffers dropped (`[LOST N EVENTS]`).
    pub lost_events: u64,
    /// Lines that did not parse (the first is kept in `first_unparsed`).
    pub unparsed_lines: u64,
    pub first_unparsed: Option<String>,
    /// Raw event files, relative to the output directory.
    pub event_files: Vec<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RunRecord {
    pub side: Side,
    /// 1-based, per side.
    pub index: usize,
    /// Whether the run started with none of the model in the page cache.
    pub cold: bool,
    /// Model bytes in the page cache after dropping it, just before the run (pages
    /// another process keeps mapped stay).
    pub model_cached_bytes: u64,
    pub exit_code: Option<i32>,
    pub wall_s: f64,
    pub program: ProgramFigures,
    pub io: IoFigures,
    pub faults: FaultFigures,
    pub memory: MemoryFigures,
    /// The pager's own stats JSON (pager side).
    pub pager_stats: Option<serde_json::Value>,
    pub tracing: TracingFigures,
    /// stdout and stderr files of the program, relative to the output directory.
    pub stdout_file: String,
    pub stderr_file: String,
    /// Pager side: the fault trace CSV, relative to the output directory.
    pub pager_trace_file: Option<String>,
    pub series: RunSeries,
}

impl RunRecord {
    /// Whether the program exited with status 0: a failed run (killed for memory, say)
    /// has no figures worth reporting.
    pub fn succeeded(&self) -> bool {
        self.exit_code == Some(0)
    }

    /// A figure of the pager's stats JSON.
    pub fn pager_stat(&self, field: &str) -> Option<u64> {
        self.pager_stats.as_ref()?.get(field)?.as_u64()
    }
}
