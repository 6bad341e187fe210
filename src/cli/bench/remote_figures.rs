//! The remote bench's arithmetic and its part of results.md, apart from the runs: the
//! medians and spreads, the bytes per token from two runs of different lengths, the
//! floor they are held to, which side runs first in a round, and the section of
//! results.md. Pure.

use std::fmt::Write as _;

use serde::Serialize;

pub(super) use crate::cli::compare::figures::Spread;

/// A side of a remote comparison.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(super) enum RemoteSide {
    /// The model read through `hyperoffload mount`.
    Mount,
    /// The model as a local file: downloaded whole first (time to first token), or the
    /// downloaded copy (decode).
    Local,
}

/// The order of the two sides in round `round` (counted from 1): the mount first in
/// odd rounds, the local side first in even ones, so that neither always runs on a
/// machine the other has just warmed or loaded.
pub(super) fn side_order(round: usize) -> [RemoteSide; 2] {
    if round % 2 == 1 {
        [RemoteSide::Mount, RemoteSide::Local]
    } else {
        [RemoteSide::Local, RemoteSide::Mount]
    }
}

/// How a spread of measurements reads in the remote section.
impl Spread {
    /// `median (min-max, N runs)` with `digits` decimals, after dividing by `unit`.
    pub fn show(&self, unit: f64, digits: usize) -> String {
        format!(
            "{:.digits$} ({:.digits$}-{:.digits$}, {} run{})",
            self.median / unit,
            self.min / unit,
            self.max / unit,
            self.runs,
            if self.runs == 1 { "" } else { "s" }
        )
    }
}

/// Bytes fetched per token: two cold runs that differ only in their token count
/// (`short` and `long` bytes fetched, `tokens` apart), so that loading, the prompt and
/// the first pass cancel out. Negative when the longer run fetched less: reported as
/// measured, not hidden.
pub(super) fn per_token(short: u64, long: u64, tokens: u32) -> f64 {
    (long as f64 - short as f64) / f64::from(tokens.max(1))
}

/// What a token must fetch from the remote at least when neither the RAM budget nor the
/// cache tier holds the bytes the other does: the model less both (never below 0).
pub(super) fn fetch_floor(model: u64, budget: u64, cache: u64) -> u64 {
    model.saturating_sub(budget).saturating_sub(cache)
}

/// `a / b`, when both are there and `b` is above 0.
pub(super) fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    }
}

/// Time to the first token at one budget.
#[derive(Debug, Clone, Serialize)]
pub(super) struct TtftRow {
    pub share: f64,
    pub budget: u64,
    /// Wall time of the run through the mount (empty cache tier).
    pub mount_s: Option<Spread>,
    /// Download and run, summed per round.
    pub local_s: Option<Spread>,
    /// Their parts.
    pub download_s: Option<Spread>,
    pub local_run_s: Option<Spread>,
    /// Bytes the mount fetched from the remote per run.
    pub mount_remote_bytes: Option<Spread>,
}

/// Decode after warm-up at one budget: llama's eval rate.
#[derive(Debug, Clone, Serialize)]
pub(super) struct DecodeRow {
    pub share: f64,
    pub budget: u64,
    pub mount_tps: Option<Spread>,
    pub local_tps: Option<Spread>,
    /// Bytes the mount fetched from the remote per run (0 with a warm cache tier).
    pub mount_remote_bytes: Option<Spread>,
}

/// Bytes fetched from the remote per token.
#[derive(Debug, Clone, Serialize)]
pub(super) struct FetchRow {
    pub share: f64,
    pub budget: u64,
    pub cache: u64,
    /// The two runs' token counts.
    pub tokens: (u32, u32),
    pub per_token: Option<Spread>,
    pub floor: u64,
}

/// Everything the remote section of results.md says.
#[derive(Debug, Clone, Serialize)]
pub(super) struct RemoteSummary {
    pub source: String,
    pub key: String,
    pub model_len: u64,
    pub runs: usize,
    pub tokens: u32,
    pub threads: u32,
    pub mount_args: Vec<String>,
    /// Whether the page cache could be dropped before the cold runs.
    pub cold: bool,
    pub ttft: Vec<TtftRow>,
    pub decode: Vec<DecodeRow>,
    pub fetch: Option<FetchRow>,
    /// Whether the text of every run through the mount was the local run's of the same
    /// length.
    pub text_identical: bool,
}

/// The heading that starts the remote section in results.md.
pub(super) const SECTION_HEADING: &str = "## A model in an object store";

const MB: f64 = 1e6;

fn opt(spread: Option<Spread>, unit: f64, digits: usize) -> String {
    spread.map_or("–".to_string(), |s| s.show(unit, digits))
}

fn opt_ratio(value: Option<f64>) -> String {
    value.map_or("–".to_string(), |r| format!("{r:.2}x"))
}

fn median(spread: Option<Spread>) -> Option<f64> {
    spread.map(|s| s.median)
}

/// The remote section of results.md.
pub(super) fn remote_markdown(summary: &RemoteSummary) -> String {
    let mut out = String::new();
    write_introduction(&mut out, summary);
    if !summary.ttft.is_empty() {
        write_ttft(&mut out, &summary.ttft);
    }
    if !summary.decode.is_empty() {
        write_decode(&mut out, summary.tokens, &summary.decode);
    }
    if let Some(row) = &summary.fetch {
        write_fetch(&mut out, row);
    }
    write_text_check(&mut out, summary.text_identical);
    out
}

/// The section's heading and the paragraph on what was run, and how.
fn write_introduction(out: &mut String, summary: &RemoteSummary) {
    let _ = writeln!(
        out,
        "{SECTION_HEADING}\n\n`{}` in `{}` ({:.1} MB), read by `llama-completion -p \"{}\" -c 256 \
         --temp 0 --seed 1 -t {} --no-warmup --no-repack` under `hyperoffload run --budget`, \
         through `hyperoffload mount{}` against the same command on a local copy. {} rounds per \
         part, the two sides alternating within each round; medians (range, runs).{}\n",
        summary.key,
        summary.source,
        summary.model_len as f64 / MB,
        super::programs::FIRST_TOKEN_PROMPT,
        summary.threads,
        summary
            .mount_args
            .iter()
            .map(|a| format!(" {a}"))
            .collect::<String>(),
        summary.runs,
        if summary.cold {
            ""
        } else {
            " **The page cache could not be dropped (not root): the cold runs were not cold.**"
        },
    );
}

/// The time-to-first-token table, a row per budget.
fn write_ttft(out: &mut String, rows: &[TtftRow]) {
    let _ = writeln!(
        out,
        "### Time to the first token, cold\n\n`-n 1`, the page cache dropped before each \
         run. Mount: an empty cache tier, the mount up before the clock starts; local: \
         the whole object downloaded (one streaming GET, the mount's client), then the \
         same run on the copy (whose pages the download left in the page cache, as any \
         download does).\n"
    );
    let _ = writeln!(
        out,
        "| budget | mount s | download then run s | mount / download then run | download s | run s | fetched by the mount MB |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|---|");
    for row in rows {
        let _ = writeln!(
            out,
            "| {:.0}% ({:.1} MB) | {} | {} | {} | {} | {} | {} |",
            row.share,
            row.budget as f64 / MB,
            opt(row.mount_s, 1.0, 2),
            opt(row.local_s, 1.0, 2),
            opt_ratio(ratio(median(row.mount_s), median(row.local_s))),
            opt(row.download_s, 1.0, 2),
            opt(row.local_run_s, 1.0, 2),
            opt(row.mount_remote_bytes, MB, 1),
        );
    }
    out.push('\n');
}

/// The decode table, a row per budget (`tokens` generated per run).
fn write_decode(out: &mut String, tokens: u32, rows: &[DecodeRow]) {
    let _ = writeln!(
        out,
        "### Decode with a warm cache tier\n\n`-n {} --ignore-eos`, llama's eval rate. \
         Mount: a cache tier holding the whole model (read through the mount once \
         before); local: the downloaded copy.\n",
        tokens
    );
    let _ = writeln!(
        out,
        "| budget | mount tok/s | local tok/s | mount / local | fetched by the mount MB |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|");
    for row in rows {
        let _ = writeln!(
            out,
            "| {:.0}% ({:.1} MB) | {} | {} | {} | {} |",
            row.share,
            row.budget as f64 / MB,
            opt(row.mount_tps, 1.0, 2),
            opt(row.local_tps, 1.0, 2),
            opt_ratio(ratio(median(row.mount_tps), median(row.local_tps))),
            opt(row.mount_remote_bytes, MB, 1),
        );
    }
    out.push('\n');
}

/// The bytes fetched per token, against the floor.
fn write_fetch(out: &mut String, row: &FetchRow) {
    let _ = writeln!(
        out,
        "### Bytes fetched from the remote per token\n\nA cache tier of {:.1} MB \
         (`--cache-size`), `--budget {:.0}%` ({:.1} MB); per round two cold runs (an \
         empty cache tier, the page cache dropped) of `-n {}` and `-n {}` `--ignore-eos`: \
         the difference of the bytes the mount fetched (its `--stats`), over {} tokens. \
         Floor: model - budget - cache tier.\n",
        row.cache as f64 / MB,
        row.share,
        row.budget as f64 / MB,
        row.tokens.0,
        row.tokens.1,
        row.tokens.1 - row.tokens.0,
    );
    let _ = writeln!(out, "| fetched per token MB | floor MB | fetched / floor |");
    let _ = writeln!(out, "|---|---|---|");
    let floor = (row.floor > 0).then_some(row.floor as f64);
    let _ = writeln!(
        out,
        "| {} | {:.1} | {} |\n",
        opt(row.per_token, MB, 1),
        row.floor as f64 / MB,
        opt_ratio(ratio(median(row.per_token), floor)),
    );
}

/// Whether the runs through the mount printed the local runs' text, and where the raw
/// runs are.
fn write_text_check(out: &mut String, text_identical: bool) {
    let _ = writeln!(
        out,
        "Text: {}. Raw runs: `remote.json`; the mount's logs and stats: `remote/`.",
        if text_identical {
            "every run through the mount printed the local run's text"
        } else {
            "**a run through the mount printed a text other than the local run's** (remote.json)"
        }
    );
}

/// results.md with `section` (which starts with `SECTION_HEADING`) in place of the
/// remote section `existing` has, or after its end; a title first when there is no file.
pub(super) fn merge_section(existing: Option<&str>, section: &str) -> String {
    let Some(existing) = existing.filter(|text| !text.trim().is_empty()) else {
        return format!("# Benchmark results\n\n{section}");
    };
    let mut kept = String::new();
    let mut inside = false;
    for line in existing.lines() {
        if line.starts_with("## ") {
            inside = line == SECTION_HEADING;
        }
        if !inside {
            kept.push_str(line);
            kept.push('\n');
        }
    }
    let kept = kept.trim_end();
    format!("{kept}\n\n{section}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sides_alternate_from_the_mount_first() {
        use RemoteSide::*;
        assert_eq!(side_order(1), [Mount, Local]);
        assert_eq!(side_order(2), [Local, Mount]);
        assert_eq!(side_order(3), [Mount, Local]);
    }

    #[test]
    fn spreads_take_the_middle_and_the_range() {
        assert_eq!(Spread::of(&[]), None);
        assert_eq!(Spread::of(&[f64::NAN]), None);
        let odd = Spread::of(&[3.0, 1.0, 2.0]).unwrap();
        assert_eq!((odd.median, odd.min, odd.max, odd.runs), (2.0, 1.0, 3.0, 3));
        let even = Spread::of(&[4.0, 1.0, 2.0, 10.0]).unwrap();
        assert_eq!(even.median, 3.0);
        assert_eq!(even.show(1.0, 1), "3.0 (1.0-10.0, 4 runs)");
        assert_eq!(
            Spread::of(&[2.5e6]).unwrap().show(1e6, 2),
            "2.50 (2.50-2.50, 1 run)"
        );
    }

    #[test]
    fn bytes_per_token_are_the_difference_over_the_tokens() {
        // bench/remote.md's round 1: 8 273 636 224 and 12 172 241 792 bytes, 4 tokens.
        let per = per_token(8_273_636_224, 12_172_241_792, 4);
        assert_eq!(per, 974_651_392.0);
        assert_eq!(per_token(100, 60, 4), -10.0);
        assert_eq!(per_token(0, 10, 0), 10.0);
        // 3 215 305 600 bytes, budget 25 %, cache tier 50 %: about 804 MB.
        let model = 3_215_305_600;
        let floor = fetch_floor(model, model / 4, model / 2);
        assert_eq!(floor, 803_826_400);
        assert!((ratio(Some(per), Some(floor as f64)).unwrap() - 1.2125).abs() < 1e-3);
        assert_eq!(fetch_floor(100, 60, 50), 0);
        assert_eq!(ratio(Some(1.0), Some(0.0)), None);
        assert_eq!(ratio(None, Some(1.0)), None);
    }

    fn summary() -> RemoteSummary {
        let spread = |v: &[f64]| Spread::of(v);
        RemoteSummary {
            source: "http://127.0.0.1:8080".into(),
            key: "model.gguf".into(),
            model_len: 100_000_000,
            runs: 2,
            tokens: 8,
            threads: 2,
            mount_args: vec!["--no-passthrough".into()],
            cold: true,
            ttft: vec![TtftRow {
                share: 50.0,
                budget: 50_000_000,
                mount_s: spread(&[2.0, 4.0]),
                local_s: spread(&[6.0, 6.0]),
                download_s: spread(&[1.0, 1.0]),
                local_run_s: spread(&[5.0, 5.0]),
                mount_remote_bytes: spread(&[1e8, 1e8]),
            }],
            decode: vec![DecodeRow {
                share: 50.0,
                budget: 50_000_000,
                mount_tps: spread(&[10.0]),
                local_tps: None,
                mount_remote_bytes: spread(&[0.0]),
            }],
            fetch: Some(FetchRow {
                share: 25.0,
                budget: 25_000_000,
                cache: 50_000_000,
                tokens: (4, 12),
                per_token: spread(&[3e7, 3.2e7]),
                floor: 25_000_000,
            }),
            text_identical: true,
        }
    }

    fn table<'a>(markdown: &'a str, header: &str) -> Vec<&'a str> {
        markdown
            .lines()
            .skip_while(|line| !line.starts_with(header))
            .take_while(|line| line.starts_with('|'))
            .collect()
    }

    fn cells(line: &str) -> Vec<&str> {
        line.split('|').map(str::trim).collect()
    }

    #[test]
    fn the_section_has_the_three_parts_with_their_ratios() {
        let markdown = remote_markdown(&summary());
        assert!(markdown.starts_with(SECTION_HEADING), "{markdown}");
        assert!(markdown.contains("mount --no-passthrough`"), "{markdown}");
        let ttft = table(&markdown, "| budget | mount s");
        assert_eq!(ttft.len(), 3, "{markdown}");
        let row = cells(ttft[2]);
        assert_eq!(row[1], "50% (50.0 MB)");
        assert_eq!(row[2], "3.00 (2.00-4.00, 2 runs)");
        assert_eq!(row[4], "0.50x");
        assert_eq!(row[7], "100.0 (100.0-100.0, 2 runs)");
        let decode = table(&markdown, "| budget | mount tok/s");
        // No local figure: no ratio either.
        assert_eq!(&cells(decode[2])[3..5], ["–", "–"], "{markdown}");
        let fetch = table(&markdown, "| fetched per token MB");
        assert_eq!(
            &cells(fetch[2])[1..4],
            ["31.0 (30.0-32.0, 2 runs)", "25.0", "1.24x"],
            "{markdown}"
        );
        assert!(markdown.contains("`-n 4` and `-n 12`"), "{markdown}");
        assert!(markdown.contains("over 8 tokens"), "{markdown}");
        assert!(markdown.contains("printed the local run's text"));
    }

    #[test]
    fn a_different_text_and_warm_runs_are_said_loudly() {
        let mut summary = summary();
        summary.text_identical = false;
        summary.cold = false;
        let markdown = remote_markdown(&summary);
        assert!(markdown.contains("**a run through the mount printed a text other"));
        assert!(markdown.contains("the cold runs were not cold"));
    }

    #[test]
    fn the_section_replaces_the_previous_one_and_keeps_the_rest() {
        let section = format!("{SECTION_HEADING}\n\nnew\n");
        assert_eq!(
            merge_section(None, &section),
            format!("# Benchmark results\n\n{section}")
        );
        let local = "# Headline benchmark\n\n| a |\n\n## Cold start to the first token\n\nrows\n";
        let once = merge_section(Some(local), &section);
        assert_eq!(once, format!("{}\n\n{section}", local.trim_end()));
        let old =
            format!("{local}\n{SECTION_HEADING}\n\nold\n### part\nold rows\n## After\nkept\n");
        let again = merge_section(Some(&old), &section);
        assert!(
            !again.contains("\nold\n") && !again.contains("old rows"),
            "{again}"
        );
        assert!(again.contains("## After\nkept"), "{again}");
        assert!(again.contains("## Cold start to the first token\n\nrows"));
        assert_eq!(again.matches(SECTION_HEADING).count(), 1, "{again}");
    }
}
