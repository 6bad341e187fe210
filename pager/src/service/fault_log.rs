//! Where each served fault is recorded: the latency histogram, and the trace when one is
//! kept.

use crate::policy::{BlockRef, FaultOutcome};
use crate::stats::LatencyHistogram;
use crate::trace::TraceRecord;

/// A thread waiting on a block.
#[derive(Copy, Clone, Debug)]
pub(super) struct Waiter {
    pub t_ns: u64,
    pub tid: u32,
    pub outcome: FaultOutcome,
    /// Where in the block the faulting page lies.
    pub offset_in_block: u32,
}

pub(super) struct FaultLog {
    pub latency: LatencyHistogram,
    pub trace: Option<Vec<TraceRecord>>,
    trace_limit: usize,
    /// Faults not traced because the trace was full.
    pub untraced: u64,
}

impl FaultLog {
    /// A log that traces at most `trace_limit` faults (none when 0).
    pub(super) fn new(trace_limit: usize) -> Self {
        Self {
            latency: LatencyHistogram::default(),
            trace: (trace_limit > 0).then(Vec::new),
            trace_limit,
            untraced: 0,
        }
    }

    /// The threads of `waiters`, waiting on `block`, were woken (or told of an error) at
    /// `now`.
    pub(super) fn served(
        &mut self,
        block: BlockRef,
        file_offset: u64,
        block_size: u64,
        waiters: impl IntoIterator<Item = Waiter>,
        now: u64,
    ) {
        for waiter in waiters {
            self.served_one(block, file_offset, block_size, waiter, now);
        }
    }

    fn served_one(
        &mut self,
        block: BlockRef,
        file_offset: u64,
        block_size: u64,
        waiter: Waiter,
        now: u64,
    ) {
        let latency_ns = now.saturating_sub(waiter.t_ns);
        self.latency.record_ns(latency_ns);
        if let Some(trace) = &mut self.trace {
            if trace.len() < self.trace_limit {
                trace.push(TraceRecord {
                    t_ns: waiter.t_ns,
                    tid: waiter.tid,
                    region: block.region.0,
                    file_offset,
                    block: block.index,
                    block_size,
                    outcome: waiter.outcome,
                    latency_ns,
                    offset_in_block: Some(waiter.offset_in_block),
                });
            } else {
                self.untraced += 1;
            }
        }
    }

    /// Hands over the faults traced so far and how many did not fit, and starts anew.
    pub(super) fn take_trace(&mut self) -> (Vec<TraceRecord>, u64) {
        let trace = self.trace.as_mut().map(std::mem::take).unwrap_or_default();
        (trace, std::mem::take(&mut self.untraced))
    }
}
