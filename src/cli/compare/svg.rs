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

const PLOT_W: f64 = WIDTH - LEFT - RIGHT;
const PLOT_H: f64 = HEIGHT - TOP - BOTTOM;

/// The data ranges a chart shows and where they land in the plot area.
struct Frame {
    x_min: f64,
    x_max: f64,
    y_min: f64,
    y_max: f64,
    /// The x range on the axis's own scale (log10 on a log axis).
    ax_min: f64,
    ax_max: f64,
    x_log: bool,
}

impl Frame {
    /// Ranges covering every point (x > 0 only, on a log axis), y from 0 at most, with
    /// room for bars either side and a little above the highest point.
    fn of(chart: &Chart) -> Frame {
        let points = chart.series.iter().flat_map(|s| s.points.iter());
        let xs: Vec<f64> = points
            .clone()
            .map(|p| p.0)
            .filter(|x| !chart.x_log || *x > 0.0)
            .collect();
        let ys: Vec<f64> = points.map(|p| p.1).collect();
        let fold = |v: &[f64], f: fn(f64, f64) -> f64, init| v.iter().copied().fold(init, f);
        let bars = chart.series.iter().any(|s| s.mark == Mark::Bars);
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
        let mut frame = Frame {
            x_min,
            x_max,
            y_min,
            y_max,
            ax_min: 0.0,
            ax_max: 0.0,
            x_log: chart.x_log,
        };
        frame.ax_min = frame.to_x_axis(x_min);
        frame.ax_max = frame.to_x_axis(x_max).max(frame.ax_min + 1e-9);
        frame
    }

    fn to_x_axis(&self, x: f64) -> f64 {
        if self.x_log {
            x.max(f64::MIN_POSITIVE).log10()
        } else {
            x
        }
    }

    fn px(&self, x: f64) -> f64 {
        LEFT + (self.to_x_axis(x) - self.ax_min) / (self.ax_max - self.ax_min) * PLOT_W
    }

    fn py(&self, y: f64) -> f64 {
        TOP + PLOT_H - (y - self.y_min) / (self.y_max - self.y_min) * PLOT_H
    }
}

impl Chart {
    pub fn render(&self) -> String {
        let frame = Frame::of(self);
        let mut svg = String::new();
        open_document(&mut svg, WIDTH, HEIGHT, 12);
        let _ = writeln!(
            svg,
            r#"<text x="{}" y="22" text-anchor="middle" font-size="15">{}</text>"#,
            WIDTH / 2.0,
            escape(&self.title)
        );
        self.draw_axes(&mut svg, &frame);
        self.draw_series(&mut svg, &frame);
        self.draw_legend(&mut svg);
        svg.push_str("</svg>\n");
        svg
    }

    /// Where the x axis has ticks: each category, each power of ten on a log axis,
    /// round numbers otherwise.
    fn x_ticks(&self, frame: &Frame) -> Vec<f64> {
        if !self.x_categories.is_empty() {
            (0..self.x_categories.len()).map(|i| i as f64).collect()
        } else if self.x_log {
            let (low, high) = (frame.ax_min.floor() as i32, frame.ax_max.ceil() as i32);
            (low..=high)
                .map(|p| 10f64.powi(p))
                .filter(|x| *x >= frame.x_min && *x <= frame.x_max)
                .collect()
        } else {
            nice_ticks(frame.x_min, frame.x_max)
        }
    }

    /// The axes, their ticks with grid lines across for y, and their labels.
    fn draw_axes(&self, svg: &mut String, frame: &Frame) {
        let _ = writeln!(
            svg,
            r#"<path d="M{LEFT},{TOP} V{} H{}" fill="none" stroke="black"/>"#,
            TOP + PLOT_H,
            LEFT + PLOT_W
        );
        for y in nice_ticks(frame.y_min, frame.y_max) {
            let _ = writeln!(
                svg,
                r##"<line x1="{LEFT}" x2="{}" y1="{py:.1}" y2="{py:.1}" stroke="#ddd"/><text x="{}" y="{:.1}" text-anchor="end">{}</text>"##,
                LEFT + PLOT_W,
                LEFT - 6.0,
                frame.py(y) + 4.0,
                tick_label(y),
                py = frame.py(y)
            );
        }
        for x in self.x_ticks(frame) {
            let label = if self.x_categories.is_empty() {
                tick_label(x)
            } else {
                self.x_categories[x as usize].clone()
            };
            let _ = writeln!(
                svg,
                r#"<text x="{:.1}" y="{}" text-anchor="middle">{}</text>"#,
                frame.px(x),
                TOP + PLOT_H + 18.0,
                escape(&label)
            );
        }
        let _ = writeln!(
            svg,
            r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#,
            LEFT + PLOT_W / 2.0,
            HEIGHT - 14.0,
            escape(&self.x_label)
        );
        let _ = writeln!(
            svg,
            r#"<text transform="translate(16,{}) rotate(-90)" text-anchor="middle">{}</text>"#,
            TOP + PLOT_H / 2.0,
            escape(&self.y_label)
        );
    }

    /// Every series as its mark; the bar series share each x's slot side by side.
    fn draw_series(&self, svg: &mut String, frame: &Frame) {
        let bar_series = self
            .series
            .iter()
            .filter(|s| s.mark == Mark::Bars)
            .count()
            .max(1);
        let bar_slot = PLOT_W / (frame.x_max - frame.x_min) * 0.8;
        let mut bar_index = 0;
        for series in &self.series {
            let visible = series
                .points
                .iter()
                .filter(|p| !self.x_log || p.0 > 0.0)
                .copied();
            match series.mark {
                Mark::Line => draw_line(svg, frame, series.color, visible),
                Mark::Points => draw_points(svg, frame, series.color, visible),
                Mark::Bars => {
                    let width = bar_slot / bar_series as f64;
                    for (x, y) in visible {
                        let left = frame.px(x) - bar_slot / 2.0 + width * bar_index as f64;
                        let _ = writeln!(
                            svg,
                            r#"<rect x="{left:.1}" y="{:.1}" width="{width:.1}" height="{:.1}" fill="{}"/>"#,
                            frame.py(y),
                            (frame.py(frame.y_min.max(0.0)) - frame.py(y)).max(0.0),
                            series.color
                        );
                    }
                    bar_index += 1;
                }
            }
        }
    }

    fn draw_legend(&self, svg: &mut String) {
        for (i, series) in self.series.iter().enumerate() {
            let y = TOP + 8.0 + 16.0 * i as f64;
            let _ = writeln!(
                svg,
                r#"<rect x="{}" y="{}" width="10" height="10" fill="{}"/><text x="{}" y="{}">{}</text>"#,
                LEFT + PLOT_W - 150.0,
                y - 9.0,
                series.color,
                LEFT + PLOT_W - 135.0,
                y,
                escape(&series.name)
            );
        }
    }
}

fn draw_line(
    svg: &mut String,
    frame: &Frame,
    color: &str,
    points: impl Iterator<Item = (f64, f64)>,
) {
    let mut path = String::new();
    for (i, (x, y)) in points.enumerate() {
        let _ = write!(
            path,
            "{}{:.1},{:.1} ",
            if i == 0 { "M" } else { "L" },
            frame.px(x),
            frame.py(y)
        );
    }
    let _ = writeln!(
        svg,
        r#"<path d="{path}" fill="none" stroke="{color}" stroke-width="1.5"/>"#
    );
}

fn draw_points(
    svg: &mut String,
    frame: &Frame,
    color: &str,
    points: impl Iterator<Item = (f64, f64)>,
) {
    let _ = writeln!(svg, r#"<g fill="{color}" fill-opacity="0.5">"#);
    for (x, y) in points {
        let _ = writeln!(
            svg,
            r#"<circle cx="{:.1}" cy="{:.1}" r="1.2"/>"#,
            frame.px(x),
            frame.py(y)
        );
    }
    let _ = writeln!(svg, "</g>");
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
