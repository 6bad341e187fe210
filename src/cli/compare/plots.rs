//! The report's SVG plots, each drawn from one representative run per side (the run
//! with the median wall time).

use super::figures::request_size_edges;
use super::record::{RunRecord, Side};
use super::report::Report;
use super::svg::{Chart, Mark, Series, KERNEL_COLOR, PAGER_COLOR};
use hyperoffload::size::format_size;

/// The successful run of `side` with the median wall time.
pub fn representative(report: &Report, side: Side) -> Option<&RunRecord> {
    let mut runs: Vec<&RunRecord> = report
        .runs
        .iter()
        .filter(|r| r.side == side && r.succeeded())
        .collect();
    runs.sort_by(|a, b| a.wall_s.total_cmp(&b.wall_s));
    runs.get(runs.len().saturating_sub(1) / 2).copied()
}

fn color(side: Side) -> &'static str {
    match side {
        Side::Kernel => KERNEL_COLOR,
        Side::Pager => PAGER_COLOR,
    }
}

fn per_side(
    report: &Report,
    mut series: impl FnMut(Side, &RunRecord) -> Vec<Series>,
) -> Vec<Series> {
    [Side::Kernel, Side::Pager]
        .into_iter()
        .filter_map(|side| representative(report, side).map(|run| series(side, run)))
        .flatten()
        .collect()
}

const MIB: f64 = 1024.0 * 1024.0;

/// (file name, SVG text) for every plot in [`super::report::PLOTS`].
pub fn render_plots(report: &Report) -> Vec<(&'static str, String)> {
    vec![
        ("resident.svg", resident_chart(report).render()),
        ("bandwidth.svg", bandwidth_chart(report).render()),
        ("request-sizes.svg", request_sizes_chart(report).render()),
        ("fault-latency-cdf.svg", latency_cdf_chart(report).render()),
        ("fault-map.svg", fault_map_chart(report).render()),
    ]
}

/// The cgroup's memory and the model's resident set over time.
fn resident_chart(report: &Report) -> Chart {
    Chart {
        title: "Resident memory over time".into(),
        x_label: "time (s)".into(),
        y_label: "MiB".into(),
        series: per_side(report, |side, run| {
            let points =
                |pick: fn(&super::samples::MemorySample) -> Option<u64>| -> Vec<(f64, f64)> {
                    run.series
                        .memory
                        .iter()
                        .filter_map(|m| pick(m).map(|b| (m.t_ns as f64 / 1e9, b as f64 / MIB)))
                        .collect()
                };
            let mut series = vec![Series {
                name: format!("{} cgroup", side.name()),
                color: color(side),
                mark: Mark::Line,
                points: points(|m| m.cgroup_bytes),
            }];
            let model = points(|m| m.model_rss_bytes);
            if !model.is_empty() {
                series.push(Series {
                    name: format!("{} model RSS", side.name()),
                    color: if side == Side::Kernel {
                        "#ff9896"
                    } else {
                        "#aec7e8"
                    },
                    mark: Mark::Line,
                    points: model,
                });
            }
            series
        }),
        ..Default::default()
    }
}

/// Read bandwidth from the model's device over time.
fn bandwidth_chart(report: &Report) -> Chart {
    Chart {
        title: "Read bandwidth from the model's device (100 ms bins)".into(),
        x_label: "time (s)".into(),
        y_label: "MB/s".into(),
        series: per_side(report, |side, run| {
            vec![Series {
                name: side.name().into(),
                color: color(side),
                mark: Mark::Line,
                points: run.series.bandwidth_mb_s.clone(),
            }]
        }),
        ..Default::default()
    }
}

/// Read requests by size, summed over every successful run of a side.
fn request_sizes_chart(report: &Report) -> Chart {
    let edges = request_size_edges();
    let mut categories: Vec<String> = edges
        .iter()
        .map(|e| format!("≤{}", format_size(*e)))
        .collect();
    categories.push("more".into());
    Chart {
        title: "Read request sizes (all runs)".into(),
        x_label: "request size".into(),
        y_label: "requests".into(),
        x_categories: categories,
        series: [Side::Kernel, Side::Pager]
            .into_iter()
            .map(|side| {
                let mut total = vec![0u64; edges.len() + 1];
                for run in report
                    .runs
                    .iter()
                    .filter(|r| r.side == side && r.succeeded())
                {
                    for (slot, count) in total.iter_mut().zip(&run.io.request_size_counts) {
                        *slot += count;
                    }
                }
                Series {
                    name: side.name().into(),
                    color: color(side),
                    mark: Mark::Bars,
                    points: total
                        .iter()
                        .enumerate()
                        .map(|(i, c)| (i as f64, *c as f64))
                        .collect(),
                }
            })
            .collect(),
        ..Default::default()
    }
}

/// The latency distribution of the faults that waited for a read.
fn latency_cdf_chart(report: &Report) -> Chart {
    Chart {
        title: "Latency of faults that waited for a read (CDF)".into(),
        x_label: "latency (µs, log scale)".into(),
        y_label: "share of faults".into(),
        x_log: true,
        series: per_side(report, |side, run| {
            vec![Series {
                name: side.name().into(),
                color: color(side),
                mark: Mark::Line,
                points: run.series.latency_cdf.clone(),
            }]
        }),
        ..Default::default()
    }
}

/// Where in the model each fault fell, against time.
fn fault_map_chart(report: &Report) -> Chart {
    // A split model's faults are on one axis, its parts end to end (`model_files`).
    let (map_title, map_axis) = if report.header.model_parts.len() > 1 {
        (
            "Faults on the model: offset in its files laid end to end, against time",
            "offset in the model's files (MiB)",
        )
    } else {
        (
            "Faults on the model: file offset against time",
            "file offset (MiB)",
        )
    };
    Chart {
        title: map_title.into(),
        x_label: "time (s)".into(),
        y_label: map_axis.into(),
        series: per_side(report, |side, run| {
            vec![Series {
                name: side.name().into(),
                color: color(side),
                mark: Mark::Points,
                points: run
                    .series
                    .fault_map
                    .iter()
                    .map(|(t, offset)| (*t, *offset as f64 / MIB))
                    .collect(),
            }]
        }),
        ..Default::default()
    }
}
