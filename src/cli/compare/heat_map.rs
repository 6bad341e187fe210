//! A heat map of how often each expert of a mixture of experts runs: one row per layer,
//! one cell per expert, darker for experts a token uses more often. Plain SVG written
//! by hand, as the other charts (`svg`).

use std::fmt::Write;

use super::svg::{escape, open_document};
use hyperoffload::graph::expert_store::ExpertCounts;

const CELL: f64 = 14.0;
const LEFT: f64 = 70.0;
const TOP: f64 = 50.0;
const LEGEND: f64 = 60.0;

/// The heat map of `counts` (use per token: uses / tokens observed) under `title`.
/// Experts without counts are left blank.
pub fn expert_heat_map(title: &str, counts: &ExpertCounts) -> String {
    let layers = counts
        .experts
        .iter()
        .map(|c| c.layer + 1)
        .max()
        .unwrap_or(0);
    let experts = counts
        .experts
        .iter()
        .map(|c| c.expert + 1)
        .max()
        .unwrap_or(0);
    let width = LEFT + experts as f64 * CELL + 20.0;
    let height = TOP + layers as f64 * CELL + LEGEND;
    let mut svg = String::new();
    open_document(&mut svg, width, height, 11);
    let _ = writeln!(
        svg,
        r#"<text x="{}" y="20" font-size="14">{}</text>"#,
        LEFT,
        escape(title)
    );
    let _ = writeln!(svg, r#"<text x="{LEFT}" y="{}">expert</text>"#, TOP - 8.0);
    for layer in 0..layers {
        let y = TOP + layer as f64 * CELL;
        let _ = writeln!(
            svg,
            r#"<text x="{}" y="{}" text-anchor="end">layer {layer}</text>"#,
            LEFT - 6.0,
            y + CELL - 3.0
        );
    }
    for count in &counts.experts {
        if count.tokens <= 0.0 {
            continue;
        }
        let share = (count.uses / count.tokens).clamp(0.0, 1.0);
        let x = LEFT + count.expert as f64 * CELL;
        let y = TOP + count.layer as f64 * CELL;
        let _ = writeln!(
            svg,
            r#"<rect x="{x}" y="{y}" width="{CELL}" height="{CELL}" fill="{}" stroke="white" stroke-width="0.5"><title>layer {} expert {}: {:.1} % of {:.0} tokens</title></rect>"#,
            shade(share),
            count.layer,
            count.expert,
            share * 100.0,
            count.tokens
        );
    }
    // Legend: the scale from unused to used in every token.
    let legend_y = TOP + layers as f64 * CELL + 20.0;
    for step in 0..=10 {
        let share = step as f64 / 10.0;
        let _ = writeln!(
            svg,
            r#"<rect x="{}" y="{legend_y}" width="{CELL}" height="{CELL}" fill="{}"/>"#,
            LEFT + step as f64 * CELL,
            shade(share)
        );
    }
    let _ = writeln!(
        svg,
        r#"<text x="{}" y="{}">share of tokens using the expert: 0 to 100 %</text>"#,
        LEFT,
        legend_y + CELL + 14.0
    );
    svg.push_str("</svg>\n");
    svg
}

/// White for 0, dark blue for 1.
fn shade(share: f64) -> String {
    let channel = |full: f64| (255.0 - (255.0 - full) * share).round() as u8;
    format!(
        "#{:02x}{:02x}{:02x}",
        channel(8.0),
        channel(48.0),
        channel(107.0)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyperoffload::graph::expert_store::ExpertCount;

    #[test]
    fn one_cell_per_expert_shaded_by_its_use() {
        let count = |layer, expert, uses| ExpertCount {
            layer,
            expert,
            uses,
            tokens: 10.0,
            paired_tokens: 0.0,
        };
        let counts = ExpertCounts {
            experts: vec![count(0, 0, 10.0), count(0, 1, 0.0), count(1, 3, 5.0)],
            pairs: Vec::new(),
        };
        let svg = expert_heat_map("m <1>", &counts);
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>\n"));
        assert!(svg.contains("m &lt;1&gt;"));
        assert_eq!(svg.matches("<title>").count(), 3);
        assert!(svg.contains("layer 1 expert 3: 50.0 % of 10 tokens"));
        let cell = |title: &str| {
            let at = svg.find(title).unwrap();
            let fill = svg[..at].rfind("fill=\"").unwrap();
            svg[fill + 6..fill + 13].to_string()
        };
        assert_eq!(
            cell("layer 0 expert 0"),
            "#08306b",
            "used every token: darkest"
        );
        assert_eq!(cell("layer 0 expert 1"), "#ffffff", "never used: white");
        assert!(svg.contains("layer 1</text>") && !svg.contains("layer 2</text>"));
    }
}
