//! Derived figures: distributions and time series computed from a run's samples, the
//! same way for both sides.

use serde::{Deserialize, Serialize};

use super::samples::{FaultSample, ReadRequest};

/// Upper bucket edges of fault latency histograms, in microseconds; one overflow bucket
/// follows. Both sides use these, so their counts compare bucket by bucket.
pub const LATENCY_EDGES_US: &[f64] = &[
    5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1_000.0, 2_000.0, 5_000.0, 10_000.0, 20_000.0,
    50_000.0, 100_000.0,
];

/// Upper edges of the read request size histogram, in bytes (powers of two from 4 KiB to
/// 4 MiB); one overflow bucket follows.
pub fn request_size_edges() -> Vec<u64> {
    (12..=22).map(|shift| 1u64 << shift).collect()
}

/// The median and the range of a set of values from repeated runs.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
    pub runs: usize,
}

impl Spread {
    /// None for no values.
    pub fn of(values: &[f64]) -> Option<Spread> {
        let mut sorted: Vec<f64> = values.iter().copied().filter(|v| v.is_finite()).collect();
        if sorted.is_empty() {
            return None;
        }
        sorted.sort_by(f64::total_cmp);
        let n = sorted.len();
        let median = if n % 2 == 1 {
            sorted[n / 2]
        } else {
            (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
        };
        Some(Spread {
            median,
            min: sorted[0],
            max: sorted[n - 1],
            runs: n,
        })
    }
}

/// Counts per bucket: `edges` are inclusive upper edges, the last bucket is overflow.
pub fn bucket_counts<T: PartialOrd + Copy>(
    values: impl IntoIterator<Item = T>,
    edges: &[T],
) -> Vec<u64> {
    let mut counts = vec![0u64; edges.len() + 1];
    for value in values {
        counts[edges.partition_point(|edge| *edge < value)] += 1;
    }
    counts
}

/// Latency percentiles in microseconds over the faults with a measured latency.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct LatencyFigures {
    pub measured: u64,
    pub p50_us: f64,
    pub p90_us: f64,
    pub p99_us: f64,
    pub max_us: f64,
    pub mean_us: f64,
}

impl LatencyFigures {
    pub fn of(faults: &[FaultSample]) -> Self {
        let mut us: Vec<f64> = faults
            .iter()
            .filter_map(|f| f.latency_ns)
            .map(|ns| ns as f64 / 1000.0)
            .collect();
        if us.is_empty() {
            return Self::default();
        }
        us.sort_by(f64::total_cmp);
        let at = |q: f64| us[((us.len() as f64 * q).ceil() as usize).clamp(1, us.len()) - 1];
        LatencyFigures {
            measured: us.len() as u64,
            p50_us: at(0.5),
            p90_us: at(0.9),
            p99_us: at(0.99),
            max_us: us[us.len() - 1],
            mean_us: us.iter().sum::<f64>() / us.len() as f64,
        }
    }
}

/// (latency in µs, share of measured faults at or below it), one point per fault, at
/// most `max_points` (evenly thinned).
pub fn latency_cdf(faults: &[FaultSample], max_points: usize) -> Vec<(f64, f64)> {
    let mut us: Vec<f64> = faults
        .iter()
        .filter_map(|f| f.latency_ns)
        .map(|ns| ns as f64 / 1000.0)
        .collect();
    us.sort_by(f64::total_cmp);
    let n = us.len();
    let step = n.div_ceil(max_points.max(1)).max(1);
    let mut points: Vec<(f64, f64)> = us
        .iter()
        .enumerate()
        .filter(|(i, _)| i % step == step - 1 || *i == n - 1)
        .map(|(i, &value)| (value, (i + 1) as f64 / n as f64))
        .collect();
    points.dedup_by(|a, b| a.0 == b.0 && a.1 == b.1);
    points
}

/// Read bandwidth in MB/s per interval of `bin_ns`, by completion time: (interval start
/// in seconds, MB/s). Covers 0 up to the last completion.
pub fn bandwidth_series(reads: &[ReadRequest], bin_ns: u64) -> Vec<(f64, f64)> {
    let bin_ns = bin_ns.max(1);
    let Some(last) = reads.iter().filter_map(|r| r.complete_ns).max() else {
        return Vec::new();
    };
    let mut bytes = vec![0u64; (last / bin_ns + 1) as usize];
    for read in reads {
        if let Some(done) = read.complete_ns {
            bytes[(done / bin_ns) as usize] += read.bytes;
        }
    }
    let seconds = bin_ns as f64 / 1e9;
    bytes
        .iter()
        .enumerate()
        .map(|(i, &b)| (i as f64 * seconds, b as f64 / 1e6 / seconds))
        .collect()
}

/// Every `step`-th element, so a plot stays small; the last one is kept.
pub fn thin<T: Copy>(items: &[T], max: usize) -> Vec<T> {
    let step = items.len().div_ceil(max.max(1)).max(1);
    items
        .iter()
        .enumerate()
        .filter(|(i, _)| i % step == 0 || *i + 1 == items.len())
        .map(|(_, item)| *item)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fault(latency_us: Option<u64>) -> FaultSample {
        FaultSample {
            t_ns: 0,
            tid: 1,
            file_offset: 0,
            latency_ns: latency_us.map(|us| us * 1000),
        }
    }

    #[test]
    fn spread_median_of_odd_and_even_counts() {
        assert_eq!(Spread::of(&[]), None);
        let odd = Spread::of(&[3.0, 1.0, 2.0]).unwrap();
        assert_eq!((odd.median, odd.min, odd.max, odd.runs), (2.0, 1.0, 3.0, 3));
        assert_eq!(Spread::of(&[4.0, 1.0]).unwrap().median, 2.5);
    }

    #[test]
    fn buckets_are_inclusive_upper_edges_with_overflow() {
        assert_eq!(
            bucket_counts([1, 10, 11, 100, 101], &[10, 100]),
            vec![2, 2, 1]
        );
        let sizes = request_size_edges();
        assert_eq!(sizes.first(), Some(&4096));
        assert_eq!(sizes.last(), Some(&(4 << 20)));
    }

    #[test]
    fn latency_figures_and_cdf_skip_unmeasured_faults() {
        let faults: Vec<FaultSample> = (1..=100)
            .map(|us| fault(Some(us)))
            .chain([fault(None)])
            .collect();
        let figures = LatencyFigures::of(&faults);
        assert_eq!(figures.measured, 100);
        assert_eq!(figures.p50_us, 50.0);
        assert_eq!(figures.p99_us, 99.0);
        assert_eq!(figures.max_us, 100.0);
        let cdf = latency_cdf(&faults, 10);
        assert_eq!(cdf.len(), 10);
        assert_eq!(cdf.last(), Some(&(100.0, 1.0)));
        assert_eq!(cdf[0], (10.0, 0.1));
        assert_eq!(
            LatencyFigures::of(&[fault(None)]),
            LatencyFigures::default()
        );
    }

    #[test]
    fn bandwidth_bins_by_completion() {
        let read = |done_ms: u64, bytes| ReadRequest {
            issue_ns: 0,
            complete_ns: Some(done_ms * 1_000_000),
            bytes,
        };
        let series = bandwidth_series(
            &[
                read(50, 1_000_000),
                read(150, 2_000_000),
                read(160, 1_000_000),
            ],
            100_000_000,
        );
        assert_eq!(series, vec![(0.0, 10.0), (0.1, 30.0)]);
        assert!(bandwidth_series(&[], 1).is_empty());
    }

    #[test]
    fn thinning_keeps_the_last() {
        let items: Vec<u32> = (0..10).collect();
        assert_eq!(thin(&items, 3), vec![0, 4, 8, 9]);
        assert_eq!(thin(&items, 100), items);
    }
}
