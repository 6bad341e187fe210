//! The measurements both sides are reduced to, so one report treats them alike: faults
//! in the model's file, reads from the block device, memory over time.

use serde::{Deserialize, Serialize};

/// A page fault on the model's mapping.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FaultSample {
    /// Since the run started.
    pub t_ns: u64,
    pub tid: u32,
    /// Offset in the model of the faulting page (kernel side) or block (pager side): in
    /// its file, on the model axis of `model_files` for a split model.
    pub file_offset: u64,
    /// Time until the faulting thread ran again; None when it was not measured (a kernel
    /// fault that never blocked: its latency is below what the tracepoints can show).
    pub latency_ns: Option<u64>,
}

/// A read request to the block device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReadRequest {
    /// Since the run started.
    pub issue_ns: u64,
    pub complete_ns: Option<u64>,
    pub bytes: u64,
}

/// Memory in use at one moment of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemorySample {
    pub t_ns: u64,
    /// The run's memory cgroup usage (page cache included).
    pub cgroup_bytes: Option<u64>,
    /// The process's resident set (VmRSS).
    pub process_rss_bytes: Option<u64>,
    /// Resident bytes of the model file's mapping (smaps `Rss`), when the mapping is
    /// still a file mapping (the kernel side).
    pub model_rss_bytes: Option<u64>,
}

/// An address range of the program that maps part of one of the model's files.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MappedRange {
    pub start: u64,
    pub end: u64,
    /// Offset of `start` on the model axis (`model_files`): the file offset for a model
    /// in one file.
    pub model_offset: u64,
}

impl MappedRange {
    /// The model offset of `address` when it lies in the range.
    pub fn model_offset_of(&self, address: u64) -> Option<u64> {
        (self.start..self.end)
            .contains(&address)
            .then(|| self.model_offset + (address - self.start))
    }
}
