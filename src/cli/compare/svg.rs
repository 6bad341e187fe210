//! Minimal SVG charts (lines, points, bars) written by hand: no fonts or system
//! libraries needed, text is left to the viewer.

use std::fmt::Write;

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Mark {
    Line,
    Points,
    /// Bars centred on each x (categorical charts pass x = 0, 1, 2, ...).
    Bars,
}

#[derive(Debug, Clone)]
pub struct Series {
    pub name: String,
    pub color: &'static str,
    pub mark: Mark,
    pub points: Vec<(f64, f64)>,
}

#[derive(Debug, Clone, Default)]
pub struct Chart {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub x_log: bool,
    /// Labels for x = 0, 1, 2, ... instead of numbers (bar charts).
    pub x_categories: Vec<String>,
    pub series: Vec<Series>,
}

pub const KERNEL_COLOR: &str = "#d62728";
pub const PAGER_COLOR: &str = "#1f77b4";

const WIDTH: f64 = 760.0;
const HEIGHT: f64 = 420.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 60.0;

/// The opening of an SVG document of `width` x `height` on a white background.
pub(crate) fn open_document(out: &mut String, width: f64, height: f64, font_size: u32) {
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="{font_size}">"#
    );
    let _ = writeln!(out, r#"<rect width="100%" height="100%" fill="white"/>"#);
}

/// `text` with the characters SVG's text must not hold raw escaped.
pub(crate) fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// A short label for a tick value.
fn tick_label(value: f64) -> String {
    let magnitude = value.abs();
    if magnitude >= 1e9 {
        format!("{:.1}G", value / 1e9)
    } else if magnitude >= 1e6 {
        format!("{:.1}M", value / 1e6)
    } else if magnitude >= 1e4 {
        format!("{:.0}k", value / 1e3)
    } else if magnitude >= 10.0 || value == 0.0 {
        format!("{value:.0}")
    } else {
        format!("{value:.2}")
    }
}

/// Evenly spaced "nice" ticks covering [low, high].
fn nice_ticks(low: f64, high: f64) -> Vec<f64> {
    let span = (high - low).max(f64::MIN_POSITIVE);
    let raw = span / 5.0;
    let power = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * power)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * power);
    let mut tick = (low / step).ceil() * step;
    let mut ticks = Vec::new();
    while tick <= high + step * 1e-9 && ticks.len() < 50 {
        ticks.push(tick);
        tick += step;
    }
    ticks
}

impl Chart {
    pub fn render(&self) -> String {
        let points = self.series.iter().flat_map(|s| s.points.iter());
        let xs: Vec<f64> = points
            .clone()
            .map(|p| p.0)
            .filter(|x| !self.x_log || *x > 0.0)
            .collect();
        let ys: Vec<f64> = points.map(|p| p.1).collect();
        let fold = |v: &[f64], f: fn(f64, f64) -> f64, init| v.iter().copied().fold(init, f);
        let bars = self.series.iter().any(|s| s.mark == Mark::Bars);
        let (mut x_min, mut x_max) = (
            fold(&xs, f64::min, f64::INFINITY),
            fold(&xs, f64::max, f64::NEG_INFINITY),
        );
        if xs.is_empty() {
            (x_min, x_max) = (0.0, 1.0);
        }
        if bars {
            x_min -= 0.5;
            x_max += 0.5;
        }
        if x_max <= x_min {
            x_max = x_min + 1.0;
        }
        let y_min = 0f64.min(fold(&ys, f64::min, 0.0));
        let mut y_max = fold(&ys, f64::max, 0.0) * 1.05;
        if y_max <= y_min {
            y_max = y_min + 1.0;
        }
        let to_x_axis = |x: f64| {
            if self.x_log {
                x.max(f64::MIN_POSITIVE).log10()
            } else {
                x
            }
        };
        let (ax_min, ax_max) = (
            to_x_axis(x_min),
            to_x_axis(x_max).max(to_x_axis(x_min) + 1e-9),
        );
        let plot_w = WIDTH - LEFT - RIGHT;
        let plot_h = HEIGHT - TOP - BOTTOM;
        let px = |x: f64| LEFT + (to_x_axis(x) - ax_min) / (ax_max - ax_min) * plot_w;
        let py = |y: f64| TOP + plot_h - (y - y_min) / (y_max - y_min) * plot_h;

        let mut svg = String::new();
        open_document(&mut svg, WIDTH, HEIGHT, 12);
        let _ = writeln!(
            svg,
            r#"<text x="{}" y="22" text-anchor="middle" font-size="15">{}</text>"#,
            WIDTH / 2.0,
            escape(&self.title)
        );
        // Axes and ticks.
        let _ = writeln!(
            svg,
            r#"<path d="M{LEFT},{TOP} V{} H{}" fill="none" stroke="black"/>"#,
            TOP + plot_h,
            LEFT + plot_w
        );
        for y in nice_ticks(y_min, y_max) {
            let _ = writeln!(
                svg,
                r##"<line x1="{LEFT}" x2="{}" y1="{py:.1}" y2="{py:.1}" stroke="#ddd"/><text x="{}" y="{:.1}" text-anchor="end">{}</text>"##,
                LEFT + plot_w,
                LEFT - 6.0,
                py(y) + 4.0,
                tick_label(y),
                py = py(y)
            );
        }
        let x_ticks: Vec<f64> = if !self.x_categories.is_empty() {
            (0..self.x_categories.len()).map(|i| i as f64).collect()
        } else if self.x_log {
            let (low, high) = (ax_min.floor() as i32, ax_max.ceil() as i32);
            (low..=high)
                .map(|p| 10f64.powi(p))
                .filter(|x| *x >= x_min && *x <= x_max)
                .collect()
        } else {
            nice_ticks(x_min, x_max)
        };
        for x in x_ticks {
            let label = if self.x_categories.is_empty() {
                tick_label(x)
            } else {
                self.x_categories[x as usize].clone()
            };
            let _ = writeln!(
                svg,
                r#"<text x="{:.1}" y="{}" text-anchor="middle">{}</text>"#,
                px(x),
                TOP + plot_h + 18.0,
                escape(&label)
            );
        }
        let _ = writeln!(
            svg,
            r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#,
            LEFT + plot_w / 2.0,
            HEIGHT - 14.0,
            escape(&self.x_label)
        );
        let _ = writeln!(
            svg,
            r#"<text transform="translate(16,{}) rotate(-90)" text-anchor="middle">{}</text>"#,
            TOP + plot_h / 2.0,
            escape(&self.y_label)
        );
        // Data.
        let bar_series = self
            .series
            .iter()
            .filter(|s| s.mark == Mark::Bars)
            .count()
            .max(1);
        let bar_slot = plot_w / (x_max - x_min) * 0.8;
        let mut bar_index = 0;
        for series in &self.series {
            let visible = series
                .points
                .iter()
                .filter(|p| !self.x_log || p.0 > 0.0)
                .copied();
            match series.mark {
                Mark::Line => {
                    let mut path = String::new();
                    for (i, (x, y)) in visible.enumerate() {
                        let _ = write!(
                            path,
                            "{}{:.1},{:.1} ",
                            if i == 0 { "M" } else { "L" },
                            px(x),
                            py(y)
                        );
                    }
                    let _ = writeln!(
                        svg,
                        r#"<path d="{path}" fill="none" stroke="{}" stroke-width="1.5"/>"#,
                        series.color
                    );
                }
                Mark::Points => {
                    let _ = writeln!(svg, r#"<g fill="{}" fill-opacity="0.5">"#, series.color);
                    for (x, y) in visible {
                        let _ = writeln!(
                            svg,
                            r#"<circle cx="{:.1}" cy="{:.1}" r="1.2"/>"#,
                            px(x),
                            py(y)
                        );
                    }
                    let _ = writeln!(svg, "</g>");
                }
                Mark::Bars => {
                    let width = bar_slot / bar_series as f64;
                    for (x, y) in visible {
                        let left = px(x) - bar_slot / 2.0 + width * bar_index as f64;
                        let _ = writeln!(
                            svg,
                            r#"<rect x="{left:.1}" y="{:.1}" width="{width:.1}" height="{:.1}" fill="{}"/>"#,
                            py(y),
                            (py(y_min.max(0.0)) - py(y)).max(0.0),
                            series.color
                        );
                    }
                    bar_index += 1;
                }
            }
        }
        // Legend.
        for (i, series) in self.series.iter().enumerate() {
            let y = TOP + 8.0 + 16.0 * i as f64;
            let _ = writeln!(
                svg,
                r#"<rect x="{}" y="{}" width="10" height="10" fill="{}"/><text x="{}" y="{}">{}</text>"#,
                LEFT + plot_w - 150.0,
                y - 9.0,
                series.color,
                LEFT + plot_w - 135.0,
                y,
                escape(&series.name)
            );
        }
        svg.push_str("</svg>\n");
        svg
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_every_mark_as_well_formed_svg() {
        let chart = Chart {
            title: "a < b".into(),
            x_label: "x".into(),
            y_label: "y".into(),
            x_log: true,
            x_categories: Vec::new(),
            series: vec![
                Series {
                    name: "kernel".into(),
                    color: KERNEL_COLOR,
                    mark: Mark::Line,
                    points: vec![(0.0, 1.0), (1.0, 2.0), (100.0, 3.0)],
                },
                Series {
                    name: "pager".into(),
                    color: PAGER_COLOR,
                    mark: Mark::Points,
                    points: vec![(10.0, 0.5)],
                },
            ],
        };
        let svg = chart.render();
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("a &lt; b"));
        assert!(svg.contains("<path d=\"M"));
        assert!(svg.contains("<circle"));
        assert!(!svg.contains("NaN") && !svg.contains("inf"));

        let bars = Chart {
            x_categories: vec!["4K".into(), "8K".into()],
            series: vec![Series {
                name: "k".into(),
                color: KERNEL_COLOR,
                mark: Mark::Bars,
                points: vec![(0.0, 3.0), (1.0, 0.0)],
            }],
            ..Default::default()
        }
        .render();
        assert_eq!(
            bars.matches("<rect x=").count(),
            3,
            "two bars and a legend box"
        );
        assert!(!Chart::default().render().contains("NaN"));
    }

    #[test]
    fn ticks_are_round_numbers() {
        assert_eq!(nice_ticks(0.0, 10.0), vec![0.0, 2.0, 4.0, 6.0, 8.0, 10.0]);
        assert_eq!(tick_label(2_500_000.0), "2.5M");
    }
}
