//! What the pager did: counters, residency, and latency percentiles, as one snapshot
//! that serializes to JSON.

use hdrhistogram::Histogram;
use serde::Serialize;

/// Latency percentiles in microseconds.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct LatencySummary {
    pub count: u64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
    pub mean: f64,
}

/// A latency histogram in nanoseconds (3 significant digits, any range).
#[derive(Debug, Clone)]
pub struct LatencyHistogram(Histogram<u64>);

impl Default for LatencyHistogram {
    fn default() -> Self {
        // 3 significant figures with auto-resize never fails to construct.
        Self(Histogram::new(3).expect("3 significant figures is a valid histogram precision"))
    }
}

impl LatencyHistogram {
    pub fn record_ns(&mut self, nanos: u64) {
        // An auto-resizing histogram grows to any value, so recording cannot fail.
        let _ = self.0.record(nanos.max(1));
    }

    pub fn merge(&mut self, other: &LatencyHistogram) {
        // Both auto-resize, so adding cannot fail on range.
        let _ = self.0.add(&other.0);
    }

    pub fn summary(&self) -> LatencySummary {
        if self.0.is_empty() {
            return LatencySummary::default();
        }
        let us = |nanos: u64| nanos as f64 / 1000.0;
        LatencySummary {
            count: self.0.len(),
            p50: us(self.0.value_at_quantile(0.50)),
            p90: us(self.0.value_at_quantile(0.90)),
            p99: us(self.0.value_at_quantile(0.99)),
            max: us(self.0.max()),
            mean: self.0.mean() / 1000.0,
        }
    }

    /// Counts per bucket for the given upper edges (in microseconds), plus one overflow
    /// bucket: for plots and comparisons with another histogram on the same edges.
    pub fn bucket_counts(&self, edges_us: &[f64]) -> Vec<u64> {
        let mut counts = vec![0u64; edges_us.len() + 1];
        for value in self.0.iter_recorded() {
            // The bucket's lowest value: recorded values are rounded within a bucket.
            let us = self.0.lowest_equivalent(value.value_iterated_to()) as f64 / 1000.0;
            let bucket = edges_us.partition_point(|&edge| edge < us);
            counts[bucket] += value.count_at_value();
        }
        counts
    }
}

/// A snapshot of a pager's statistics. Field names are part of the JSON interface.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Stats {
    /// Page faults the service handled (all outcomes).
    pub faults: u64,
    /// Faults whose block had to be read on demand.
    pub demand_faults: u64,
    /// Faults that found their block already resident, in flight or staged: the read
    /// had been started before the program needed it (watch faults apart).
    pub prefetch_hits: u64,
    /// Resident blocks the eviction policy asked to watch (see
    /// `EvictionPolicy::watch`): their page-table entries were dropped, their bytes kept.
    pub watched_blocks: u64,
    /// Faults on watched blocks: a use of a resident block shown to the policy, served by
    /// mapping its frame again without a read.
    pub watch_faults: u64,
    /// Blocks installed from reads (demand and prefetch).
    pub blocks_read: u64,
    /// Blocks read because a prefetch policy asked for them.
    pub blocks_prefetched: u64,
    /// Of those, blocks read into free budget while the device idled (popular experts
    /// not yet needed: `Urgency::IdleFill`).
    pub blocks_idle_filled: u64,
    /// Bytes read from the file.
    pub bytes_read: u64,
    /// Read requests submitted to io_uring (a request may cover several blocks).
    pub read_requests: u64,
    pub read_retries: u64,
    /// Reads that failed after retries; their pages were poisoned (SIGBUS on access).
    pub read_errors: u64,
    pub poisoned_pages: u64,
    /// Blocks evicted to stay within the budget.
    pub evictions: u64,
    pub evicted_bytes: u64,
    /// Blocks dropped by a `drop` hint.
    pub dropped_blocks: u64,
    /// Resident blocks whose pages a fault found gone (dropped behind the pager's back,
    /// e.g. by advice given to the kernel directly): read again.
    pub lost_blocks: u64,
    /// Internal invariants the service found broken and stepped over (a block event its
    /// state does not allow, an eviction policy naming a block it may not take): each is
    /// a bug, reported on stderr when met; zero in every correct run, which the tests
    /// check. (Broken invariants that would serve wrong bytes or overrun the budget stop
    /// the process instead.)
    pub invariant_breaches: u64,
    /// The budget now (it changes with `Pager::set_budget`).
    pub budget_bytes: u64,
    /// The budget over time: where it started and each change since (see
    /// `budget_history`).
    pub budget_history: Vec<crate::budget::history::BudgetPoint>,
    pub resident_bytes: u64,
    pub peak_resident_bytes: u64,
    pub pinned_bytes: u64,
    pub block_size: u64,
    pub queue_depth: u32,
    /// Threads installing prefetched reads beside the fault service thread.
    pub install_threads: u32,
    /// Nice value the pager's threads run at (see `PagerBuilder::thread_nice`).
    pub thread_nice: i32,
    /// Whether reads bypass the page cache (O_DIRECT); when not, why.
    pub direct_io: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub direct_io_fallback: Option<String>,
    /// Whether blocks are installed without copying (frames of a huge-page tmpfs file
    /// mapped into the region, see `shared_store`); when not, why.
    pub zero_copy: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub zero_copy_refused: Option<String>,
    /// Whether children of `fork` are served (`PagerBuilder::serve_forks`); when asked
    /// for and refused, why.
    pub serve_forks: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub forks_refused: Option<String>,
    /// Forked children served so far, and those whose process still lives (as far as
    /// the service last looked).
    pub forked_children: u64,
    pub live_children: u64,
    /// Faults that came from forked children (counted in `faults` too).
    pub child_faults: u64,
    /// Bytes written into file-shaped regions for forked children outside the budget:
    /// every hole when children outlive the service or a region they map is unmapped,
    /// and pages they read where the program unmapped part of a region.
    pub child_fill_bytes: u64,
    /// Guests (other processes of the run's tree, `crate::share`) that attached to a
    /// region of this pager, and the faults they forwarded (counted in `faults` too).
    pub guests: u64,
    pub guest_faults: u64,
    /// Each guest as it attached: `pid (command)`.
    pub guest_processes: Vec<String>,
    /// With zero copy: memory the frames hold (in use, or free and kept for the next
    /// read), now and at most. Bounded by the budget plus a region's short last block.
    pub frame_memory_bytes: u64,
    pub peak_frame_memory_bytes: u64,
    /// With a prefetch policy that follows a prediction (the graph's): how often the
    /// program landed where it said, and how many parts of the order it has left to
    /// demand paging because the program did not follow them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prediction: Option<crate::policy::ConfidenceSummary>,
    /// For a mixture of experts under the graph policy: how well the experts a token
    /// used in one layer predicted those of the next (co-activation), against
    /// popularity alone, and whether eviction follows it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub co_activation: Option<crate::policy::CoActivationSummary>,
    /// For a mixture of experts under the graph policy: the weight its estimate of the
    /// next token's experts gives recency (what ran in the last few tokens) rather than
    /// long-run frequency, mean over layers, 0 to 1: low where routing is independent
    /// from token to token, high where it repeats and drifts as real routers do.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expert_recency: Option<f64>,
    /// For a mixture of experts under the graph policy: resident experts' blocks it asked
    /// to watch, and the watch faults that showed them used.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expert_watches: Option<crate::policy::ExpertWatches>,
    /// Time from reading a fault event to waking its thread.
    pub fault_latency_us: LatencySummary,
    /// Time from submitting a read to its completion.
    pub read_latency_us: LatencySummary,
    /// Seconds since the pager started.
    pub elapsed_s: f64,
}

impl Stats {
    /// Share of the faults that needed data (all but watch faults) whose read had
    /// already been started.
    pub fn hit_rate(&self) -> f64 {
        let data_faults = self.faults.saturating_sub(self.watch_faults);
        if data_faults == 0 {
            0.0
        } else {
            self.prefetch_hits as f64 / data_faults as f64
        }
    }

    pub fn to_json(&self) -> String {
        // Plain numbers, strings and bools: serialization cannot fail.
        serde_json::to_string(self).expect("stats serialize to JSON")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_and_buckets() {
        let mut histogram = LatencyHistogram::default();
        for us in 1..=100u64 {
            histogram.record_ns(us * 1000);
        }
        let summary = histogram.summary();
        assert_eq!(summary.count, 100);
        assert!((summary.p50 - 50.0).abs() < 0.5, "{summary:?}");
        assert!((summary.p99 - 99.0).abs() < 0.5, "{summary:?}");
        assert!((summary.max - 100.0).abs() < 0.5, "{summary:?}");
        assert_eq!(histogram.bucket_counts(&[10.0, 50.0]), vec![10, 40, 50]);
    }

    #[test]
    fn empty_histogram_summarizes_to_zero() {
        assert_eq!(
            LatencyHistogram::default().summary(),
            LatencySummary::default()
        );
    }

    #[test]
    fn json_has_the_documented_fields() {
        let json: serde_json::Value = serde_json::from_str(&Stats::default().to_json()).unwrap();
        for field in [
            "faults",
            "bytes_read",
            "blocks_read",
            "prefetch_hits",
            "evictions",
            "budget_bytes",
            "budget_history",
            "peak_resident_bytes",
            "invariant_breaches",
        ] {
            assert!(json.get(field).is_some(), "missing {field}");
        }
        for field in ["p50", "p90", "p99", "max"] {
            assert!(
                json["fault_latency_us"].get(field).is_some(),
                "missing {field}"
            );
        }
    }
}
