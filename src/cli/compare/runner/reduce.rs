//! What one run recorded, reduced: the program's reads from the model's disks, the
//! faults each side tells of, and the figures of its reads and faults.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::Path;

use super::super::figures::{bucket_counts, request_size_edges, LatencyFigures, LATENCY_EDGES_US};
use super::super::kernel_events::{model_faults, program_reads};
use super::super::record::{FaultFigures, IoFigures, TracingFigures};
use super::super::sampler::SampledRun;
use super::super::samples::{FaultSample, ReadRequest};
use super::super::trace_event::{lost_events, parse_line, EventKind, TraceEvent};
use super::{events_path_of, io_error, ModelTarget, RunError, RunFiles, RunSpec};
use hyperoffload::policy::FaultOutcome;
use hyperoffload::trace::TraceReader;

/// The program's reads from the model's devices, in time order.
pub(super) fn model_reads(
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
pub(super) struct SideFigures {
    pub(super) faults: Vec<FaultSample>,
    pub(super) pager_stats: Option<serde_json::Value>,
    pub(super) model_peak: Option<u64>,
}

/// The kernel's faults on the model's mappings, and the mappings' peak resident set.
pub(super) fn kernel_side(
    program_events: &[TraceEvent],
    sampled: &SampledRun,
    origin: u64,
) -> SideFigures {
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
pub(super) fn pager_side(spec: &RunSpec, files: &RunFiles) -> Result<SideFigures, RunError> {
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

pub(super) fn io_figures(
    reads: &[ReadRequest],
    bandwidth: &[(f64, f64)],
    wall_s: f64,
) -> IoFigures {
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
pub(super) fn fault_figures(faults: &[FaultSample]) -> FaultFigures {
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

/// The parsed events of a captured trace file, in time order. Events the comparison
/// does not use are dropped; lost and unparsed lines are counted.
pub(super) fn read_events(
    path: &Path,
    tracing: &mut TracingFigures,
) -> Result<Vec<TraceEvent>, RunError> {
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
fn read_pager_faults(
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
