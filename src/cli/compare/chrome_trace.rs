//! The pager's fault trace as Chrome/Perfetto trace JSON (open in ui.perfetto.dev):
//! one complete (`X`) event per fault, from the fault to the wake-up of its thread,
//! named by the tensor at the faulting page (at the faulting block's start in a trace
//! from before faults kept their offset) when the tensor table is known.
//!
//! ```json
//! {"traceEvents": [{"name": "blk.0.attn_q.weight", "cat": "missing", "ph": "X",
//!   "ts": 1.2, "dur": 25.0, "pid": 1, "tid": 4711,
//!   "args": {"file_offset": 0, "offset_in_block": 8192, "block": 0,
//!            "block_size": 65536, "region": 0, "outcome": "missing",
//!            "latency_us": 25.0}}],
//!  "displayTimeUnit": "ns", "otherData": {...}}
//! ```
//! `ts` and `dur` are microseconds; `cat` is the outcome (`missing`: a demand read,
//! `in_flight`: a read already under way, `staged`, `resident`).

use std::collections::HashMap;

use serde_json::{json, Value};

use hyperoffload::model::TensorInfo;
use hyperoffload::policy::FaultOutcome;
use hyperoffload::trace::TraceRecord;

/// Finds the tensor holding a file offset: tensors sorted by start, binary search.
pub struct TensorLocator<'a> {
    by_start: Vec<&'a TensorInfo>,
}

impl<'a> TensorLocator<'a> {
    pub fn new(tensors: &'a [TensorInfo]) -> Self {
        let mut by_start: Vec<&TensorInfo> = tensors.iter().collect();
        by_start.sort_by_key(|t| t.file_range.start);
        Self { by_start }
    }

    /// The tensor whose data holds `offset`, or else the first one starting in
    /// `offset..offset + len` (a block that begins in padding or metadata).
    pub fn at(&self, offset: u64, len: u64) -> Option<&'a TensorInfo> {
        let after = self
            .by_start
            .partition_point(|t| t.file_range.start <= offset);
        if let Some(tensor) = after.checked_sub(1).map(|i| self.by_start[i]) {
            if tensor.file_range.contains(&offset) {
                return Some(tensor);
            }
        }
        self.by_start
            .get(after)
            .filter(|t| t.file_range.start < offset.saturating_add(len))
            .copied()
    }
}

/// Tensor tables by the region whose faults they name. A region's faults are named by
/// its own file's tensors; a region with no table (a file of no known format, or one
/// the trace does not say) has its faults named by block, never by another file's.
#[derive(Default)]
pub struct RegionTensors<'a> {
    by_region: HashMap<u32, TensorLocator<'a>>,
}

impl<'a> RegionTensors<'a> {
    /// `tensors` name region 0's faults: the first file the pager mapped (region ids
    /// count from 0), all a trace without the shim's map events says.
    #[cfg(test)]
    pub fn first_region(tensors: Option<&'a [TensorInfo]>) -> Self {
        let mut names = Self::default();
        if let Some(tensors) = tensors {
            names.insert(0, tensors);
        }
        names
    }

    /// `tensors` name region `region`'s faults.
    pub fn insert(&mut self, region: u32, tensors: &'a [TensorInfo]) {
        self.by_region.insert(region, TensorLocator::new(tensors));
    }

    /// The tensor a fault hit, if its region has a table.
    fn of(&self, r: &TraceRecord) -> Option<&'a TensorInfo> {
        let locator = self.by_region.get(&r.region)?;
        match r.offset_in_block {
            Some(_) => locator
                .at(r.fault_file_offset(), 1)
                // A page that starts in padding before a tensor.
                .or_else(|| locator.at(r.fault_file_offset(), 4096)),
            None => locator.at(r.file_offset, r.block_size),
        }
    }
}

pub fn outcome_name(outcome: FaultOutcome) -> &'static str {
    match outcome {
        FaultOutcome::Missing => "missing",
        FaultOutcome::InFlight => "in_flight",
        FaultOutcome::Staged => "staged",
        FaultOutcome::Resident => "resident",
    }
}

/// The trace document, faults named by `names`; `metadata` goes to `otherData`.
pub fn chrome_trace(records: &[TraceRecord], names: &RegionTensors<'_>, metadata: Value) -> Value {
    let events: Vec<Value> = records
        .iter()
        .map(|r| {
            let tensor = names.of(r);
            let name = tensor.map_or_else(|| format!("block {}", r.block), |t| t.name.clone());
            json!({
                "name": name,
                "cat": outcome_name(r.outcome),
                "ph": "X",
                "ts": r.t_ns as f64 / 1000.0,
                "dur": r.latency_ns as f64 / 1000.0,
                "pid": 1,
                "tid": r.tid,
                "args": {
                    "file_offset": r.file_offset,
                    "offset_in_block": r.offset_in_block,
                    "block": r.block,
                    "block_size": r.block_size,
                    "region": r.region,
                    "tensor": tensor.map(|t| t.name.as_str()),
                    "expert": tensor.and_then(|t| expert_at(t, r.fault_file_offset())),
                    "outcome": outcome_name(r.outcome),
                    "latency_us": r.latency_ns as f64 / 1000.0,
                },
            })
        })
        .collect();
    json!({
        "traceEvents": events,
        "displayTimeUnit": "ns",
        "otherData": metadata,
    })
}

/// The CSV next to the JSON: the trace's columns plus the tensor name (as in
/// [`chrome_trace`]).
pub fn named_csv(records: &[TraceRecord], names: &RegionTensors<'_>) -> String {
    let mut csv = format!("{},tensor,expert\n", hyperoffload::trace::HEADER);
    for r in records {
        let hit = names.of(r);
        let tensor = hit.map_or("", |t| t.name.as_str());
        let expert = hit
            .and_then(|t| expert_at(t, r.fault_file_offset()))
            .map_or_else(String::new, |e| e.to_string());
        csv.push_str(&format!(
            "{},{},{},{},{},{},{},{},{},{},{}\n",
            r.t_ns,
            r.tid,
            r.region,
            r.file_offset,
            r.block,
            r.block_size,
            outcome_name(r.outcome),
            r.latency_ns,
            r.offset_in_block.unwrap_or(0),
            tensor,
            expert
        ));
    }
    csv
}

/// For a fault in a merged expert tensor (`ffn_*_exps`, or one expert's own tensor),
/// the expert whose slice holds the faulting offset (one before the tensor counts from
/// the tensor's start). In a trace from before faults kept their offset in the block,
/// that is the block's start: where slices are smaller than a block, the first of the
/// experts the block holds.
fn expert_at(tensor: &TensorInfo, fault_offset: u64) -> Option<u32> {
    let at = fault_offset.max(tensor.file_range.start);
    let shares = hyperoffload::graph::arch::expert_slices(tensor)?;
    shares
        .shares
        .iter()
        .find(|(_, range)| range.contains(&at))
        .map(|(expert, _)| *expert)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(name: &str, start: u64, end: u64) -> TensorInfo {
        TensorInfo {
            name: name.into(),
            dtype: "F32".into(),
            shape: vec![(end - start) / 4],
            file_range: start..end,
        }
    }

    fn record(block: u32, outcome: FaultOutcome) -> TraceRecord {
        TraceRecord {
            t_ns: 1500,
            tid: 9,
            region: 0,
            file_offset: u64::from(block) * 4096,
            block,
            block_size: 4096,
            outcome,
            latency_ns: 25_000,
            offset_in_block: None,
        }
    }

    #[test]
    fn locates_tensors_by_offset() {
        let tensors = [tensor("b", 5000, 9000), tensor("a", 100, 4100)];
        let locator = TensorLocator::new(&tensors);
        assert_eq!(locator.at(100, 1).unwrap().name, "a");
        assert_eq!(locator.at(4099, 1).unwrap().name, "a");
        assert_eq!(
            locator.at(4100, 4096).unwrap().name,
            "b",
            "padding before b"
        );
        assert!(locator.at(4100, 100).is_none());
        assert!(locator.at(0, 50).is_none());
        assert!(locator.at(9000, 4096).is_none());
    }

    #[test]
    fn events_have_the_documented_fields() {
        let tensors = [tensor("blk.0.attn_q.weight", 0, 8192)];
        let records = [
            record(0, FaultOutcome::Missing),
            record(5, FaultOutcome::Resident),
        ];
        let names = RegionTensors::first_region(Some(&tensors));
        let trace = chrome_trace(&records, &names, json!({"model": "m"}));
        let text = serde_json::to_string(&trace).unwrap();
        let trace: Value = serde_json::from_str(&text).unwrap();
        let events = trace["traceEvents"].as_array().unwrap();
        assert_eq!(events.len(), 2);
        let first = &events[0];
        assert_eq!(first["name"], "blk.0.attn_q.weight");
        assert_eq!(first["ph"], "X");
        assert_eq!(first["ts"], 1.5);
        assert_eq!(first["dur"], 25.0);
        assert_eq!(first["tid"], 9);
        assert_eq!(first["args"]["outcome"], "missing");
        assert_eq!(first["args"]["file_offset"], 0);
        assert_eq!(events[1]["name"], "block 5");
        assert_eq!(trace["otherData"]["model"], "m");

        let csv = named_csv(&records, &names);
        assert!(csv.starts_with(
            "t_ns,tid,region,file_offset,block,block_size,outcome,latency_ns,offset_in_block,tensor,expert\n"
        ));
        assert!(csv.contains(",missing,25000,0,blk.0.attn_q.weight,\n"));
        assert!(csv.ends_with(",resident,25000,0,,\n"));
    }

    #[test]
    fn faults_in_merged_expert_tensors_name_their_expert() {
        // Four experts of 8 KiB each in one merged tensor starting at 4096.
        let mut exps = tensor("blk.3.ffn_up_exps.weight", 4096, 4096 + 4 * 8192);
        exps.shape = vec![4, 16, 128];
        let tensors = [tensor("blk.3.ffn_norm.weight", 0, 4096), exps];
        let records: Vec<TraceRecord> = [0u32, 1, 3, 6, 8]
            .iter()
            .map(|&block| record(block, FaultOutcome::Missing))
            .collect();
        let names = RegionTensors::first_region(Some(&tensors));
        let csv = named_csv(&records, &names);
        let experts: Vec<&str> = csv
            .lines()
            .skip(1)
            .map(|line| line.rsplit(',').next().unwrap())
            .collect();
        // Block 0 is the norm; block 1 (4096..8192) starts expert 0; block 3 (12288..)
        // is in expert 1; block 6 (24576..) in expert 2; block 8 (32768..) in expert 3.
        assert_eq!(experts, ["", "0", "1", "2", "3"], "{csv}");
        let trace = chrome_trace(&records, &names, json!({}));
        assert_eq!(trace["traceEvents"][2]["args"]["expert"], 1);
        assert_eq!(trace["traceEvents"][0]["args"]["expert"], Value::Null);
    }

    #[test]
    fn faults_in_other_files_are_not_named_by_the_first_file_s_tensors() {
        let tensors = [tensor("blk.0.attn_q.weight", 0, 8192)];
        let second_file = TraceRecord {
            region: 1,
            ..record(0, FaultOutcome::Missing)
        };
        let records = [record(0, FaultOutcome::Missing), second_file];
        let names = RegionTensors::first_region(Some(&tensors));
        let trace = chrome_trace(&records, &names, json!({}));
        let events = trace["traceEvents"].as_array().unwrap();
        assert_eq!(events[0]["name"], "blk.0.attn_q.weight");
        assert_eq!(events[1]["name"], "block 0");
        assert_eq!(events[1]["args"]["tensor"], Value::Null);
        let csv = named_csv(&records, &names);
        let lines: Vec<&str> = csv.lines().collect();
        assert!(lines[1].ends_with(",blk.0.attn_q.weight,"), "{csv}");
        assert!(lines[2].ends_with(",missing,25000,0,,"), "{csv}");
        // With the second file's table, its faults take its own names.
        let second = [tensor("blk.9.ffn_up.weight", 0, 8192)];
        let mut names = RegionTensors::first_region(Some(&tensors));
        names.insert(1, &second);
        let trace = chrome_trace(&records, &names, json!({}));
        assert_eq!(trace["traceEvents"][1]["name"], "blk.9.ffn_up.weight");
    }
}
