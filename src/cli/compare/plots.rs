//! The report's SVG plots, each drawn from one representative run per side (the run
//! with the median wall time).

use super::budget_curve::budget_steps;
use super::figures::request_size_edges;
use super::record::{RunRecord, Side};
use super::report::Report;
use super::svg::{Chart, Mark, Series, KERNEL_COLOR, PAGER_COLOR};
use hyperoffload::budget::history;
use hyperoffload::size::format_size;

/// The pager's budget line.
const BUDGET_COLOR: &str = "#2ca02c";

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

/// The cgroup's memory and the model's resident set over time; on the pager side, where
/// the model is not a file mapping any more, the process's resident set (which holds the
/// pager's frames) and the pager's budget, from its stats' history.
fn resident_chart(report: &Report) -> Chart {
    Chart {
        title: "Resident memory and the pager's budget over time".into(),
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
            let light = if side == Side::Kernel {
                "#ff9896"
            } else {
                "#aec7e8"
            };
            let model = points(|m| m.model_rss_bytes);
            let process = points(|m| m.process_rss_bytes);
            if !model.is_empty() {
                series.push(Series {
                    name: format!("{} model RSS", side.name()),
                    color: light,
                    mark: Mark::Line,
                    points: model,
                });
            } else if !process.is_empty() {
                series.push(Series {
                    name: format!("{} process RSS", side.name()),
                    color: light,
                    mark: Mark::Line,
                    points: process,
                });
            }
            let history = run
                .pager_stats
                .as_ref()
                .map(history::from_stats_json)
                .unwrap_or_default();
            let budget = budget_steps(&history, run.wall_s);
            if !budget.is_empty() {
                series.push(Series {
                    name: format!("{} budget", side.name()),
                    color: BUDGET_COLOR,
                    mark: Mark::Line,
                    points: budget,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::compare::report::ReportHeader;
    use crate::cli::compare::samples::MemorySample;

    fn report(runs: Vec<RunRecord>) -> Report {
        Report {
            header: ReportHeader {
                command: vec!["llama-bench".into()],
                model: "/m/model.gguf".into(),
                model_parts: Vec::new(),
                model_bytes: 1 << 30,
                budget_bytes: 512 << 20,
                budget_auto: false,
                cgroup_limit_bytes: None,
                device: "8:0".into(),
                runs_per_side: 1,
                cold: true,
                cgroup_version: "V2".into(),
                kernel: "6.18".into(),
            },
            method: String::new(),
            latency_edges_us: Vec::new(),
            request_size_edges: Vec::new(),
            runs,
        }
    }

    fn run(side: Side) -> RunRecord {
        let sample = |t_s: u64, mib: u64| MemorySample {
            t_ns: t_s * 1_000_000_000,
            cgroup_bytes: Some(mib << 20),
            process_rss_bytes: Some(mib << 20),
            model_rss_bytes: (side == Side::Kernel).then_some(mib << 20),
        };
        let mut run = RunRecord {
            side,
            index: 1,
            exit_code: Some(0),
            wall_s: 4.0,
            ..Default::default()
        };
        run.series.memory = vec![sample(0, 10), sample(4, 300)];
        run
    }

    #[test]
    fn the_pager_side_plots_its_budget_curve_beside_its_resident_bytes() {
        let mut pager = run(Side::Pager);
        pager.pager_stats = Some(serde_json::json!({
            "budget_bytes": 400u64 << 20,
            "budget_history": [
                {"t_s": 0.0, "bytes": 512u64 << 20},
                {"t_s": 1.5, "bytes": 100u64 << 20},
                {"t_s": 3.0, "bytes": 400u64 << 20}
            ]
        }));
        let chart = resident_chart(&report(vec![run(Side::Kernel), pager]));
        let names: Vec<&str> = chart.series.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "kernel cgroup",
                "kernel model RSS",
                "pager cgroup",
                "pager process RSS",
                "pager budget"
            ]
        );
        let budget = &chart.series[4].points;
        assert_eq!(budget.first(), Some(&(0.0, 512.0)));
        assert!(budget.contains(&(1.5, 100.0)), "{budget:?}");
        assert_eq!(budget.last(), Some(&(4.0, 400.0)), "held to the run's end");
        assert!(chart.render().contains(">pager budget</text>"));
    }
}
