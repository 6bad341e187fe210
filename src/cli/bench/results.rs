//! The rows the bench measures and `results.md`: the decode table against the
//! floors, how they were measured, and the first-token table.

use std::fmt::Write as _;

use super::floors::TRACE_EXTRA_TOKENS;
use super::programs::FIRST_TOKEN_PROMPT;
use super::reference::{DecodeShare, References};
use super::{median, BenchArgs};
use crate::cli::compare::figures::LatencyFigures;
use crate::cli::compare::record::{RunRecord, Side};

pub(super) struct Row {
    pub share: f64,
    pub budget: u64,
    pub kernel_tps: Option<f64>,
    pub pager_tps: Option<f64>,
    pub pager_bytes_per_token: f64,
    /// Bytes a token must read: M - B for a dense model, Belady's on the demand trace
    /// for a mixture of experts.
    pub floor_bytes_per_token: f64,
    /// Beside the floor: the simulated optimum on the predicted order (dense), the
    /// frequency floor on the demand trace (mixture of experts).
    pub optimum_bytes_per_token: Option<f64>,
    /// The device's limit measured beside this budget's decode runs (the upper median of
    /// three measurements before them and three after).
    pub device_bps: f64,
    pub kernel_read_mb_s: Option<f64>,
    pub pager_read_mb_s: Option<f64>,
    pub kernel_p50_us: Option<f64>,
    pub kernel_p99_us: Option<f64>,
    pub pager_p50_us: Option<f64>,
    pub pager_p99_us: Option<f64>,
    /// Cold start to the first token (see `first_token_command`): wall seconds and
    /// bytes read from the device, medians per side.
    pub kernel_first_token_s: Option<f64>,
    pub pager_first_token_s: Option<f64>,
    pub kernel_first_token_bytes: Option<f64>,
    pub pager_first_token_bytes: Option<f64>,
}

impl Row {
    /// Floor bytes per token / `device_bps`: the reads' part of the floor.
    fn read_floor_s(&self) -> f64 {
        self.floor_bytes_per_token / self.device_bps
    }
}

/// The median of `value` over `side`'s runs that succeeded.
pub(super) fn side_median(
    runs: &[RunRecord],
    side: Side,
    value: impl Fn(&RunRecord) -> Option<f64>,
) -> Option<f64> {
    let mut values: Vec<f64> = runs
        .iter()
        .filter(|r| r.side == side && r.succeeded())
        .filter_map(value)
        .collect();
    median(&mut values)
}

/// The median of a latency figure over a side's runs that measured one: a run in which
/// no fault waited has no latency (compare's report shows "–"), not a latency of 0.
pub(super) fn latency_median(
    runs: &[RunRecord],
    side: Side,
    figure: impl Fn(&LatencyFigures) -> f64,
) -> Option<f64> {
    side_median(runs, side, |r| {
        (r.faults.waited_faults > 0).then(|| figure(&r.faults.latency))
    })
}

/// The model benchmarked: its length, and whether it is a mixture of experts (whose
/// floors come from a demand trace).
#[derive(Clone, Copy)]
pub(super) struct Measured {
    pub len: u64,
    pub sparse: bool,
}

fn mib(bytes: f64) -> f64 {
    bytes / (1 << 20) as f64
}

/// `v` with `digits` decimals, or a dash.
fn opt(v: Option<f64>, digits: usize) -> String {
    v.map_or("–".to_string(), |v| format!("{v:.digits$}"))
}

fn ratio(pager: Option<f64>, kernel: Option<f64>) -> Option<f64> {
    match (pager, kernel) {
        (Some(p), Some(k)) if k > 0.0 => Some(p / k),
        _ => None,
    }
}

pub(super) fn results_markdown(
    args: &BenchArgs,
    provenance: &str,
    model: Measured,
    references: &References,
    compute_s: f64,
    rows: &[Row],
) -> String {
    let decode_share = &references.decode_share;
    let mut out = String::new();
    write_method(
        &mut out,
        args,
        provenance,
        model,
        references.device_bps,
        decode_share,
        (references.warm_tps, compute_s),
    );
    write_decode_table(&mut out, model, decode_share, compute_s, rows);
    write_floor_note(&mut out, args, model);
    write_first_token_table(&mut out, args, rows);
    out
}

/// The title and how the figures were measured. `(warm_tps, compute_s)`: the warm
/// decode's speed and the compute time per token the floors use.
fn write_method(
    out: &mut String,
    args: &BenchArgs,
    provenance: &str,
    model: Measured,
    device_bps: f64,
    decode_share: &DecodeShare,
    (warm_tps, compute_s): (f64, f64),
) {
    let _ = writeln!(
        out,
        "# Headline benchmark: llama-bench decode under a RAM budget\n\n{provenance}\n"
    );
    let _ = writeln!(
        out,
        "Model `{}` ({:.0} MiB), llama-bench `-p 0 -n {} -t {} -r 1 --repack 0`, {} runs per side \
         and budget (medians), page cache dropped before every run. Device limit (io_uring \
         O_DIRECT 1 MiB reads, QD32, cold, median of 3) at the start: {:.0} MB/s; each budget's \
         floor uses the limit measured beside its decode runs (column \"device MB/s\": the \
         upper median of 3 measurements before them and 3 after). Reads shaped as the pager's \
         (2 MiB, two deep, landing across 1 GiB) beside a warm llama-bench tg (the model \
         resident, the program decoding): {:.0} MB/s against {:.0} alone just before ({:.0} \
         %): reads and decode share the memory. Warm decode without a \
         limit: {:.2} tok/s (fastest of 3 runs); compute per token, the faster of that and the \
         pager's with the model resident: {:.3} s. Kernel: the unchanged program in a memory \
         cgroup limited to the budget (page cache included); pager: `hyperoffload run \
         --budget` with the default policies.\n",
        args.model().display(),
        mib(model.len as f64),
        args.tokens,
        args.threads,
        args.runs,
        device_bps / 1e6,
        decode_share.during_bps / 1e6,
        decode_share.alone_bps / 1e6,
        decode_share.fraction() * 100.0,
        warm_tps,
        compute_s,
    );
}

/// Per budget: both sides' decode speed, the pager's token time against the floor
/// (alone and beside a decode), its bytes per token against the floors, read rates and
/// fault latencies.
fn write_decode_table(
    out: &mut String,
    model: Measured,
    decode_share: &DecodeShare,
    compute_s: f64,
    rows: &[Row],
) {
    let (floor_column, optimum_column) = if model.sparse {
        ("Belady on the trace (MiB)", "frequency floor (MiB)")
    } else {
        ("M - B (MiB)", "optimum (sim, MiB)")
    };
    let _ = writeln!(
        out,
        "| budget | kernel tok/s | pager tok/s | pager/kernel | pager token time / floor | \
         device MB/s | token time / floor beside decode | pager bytes/token (MiB) | {floor_column} | {optimum_column} | read MB/s kernel / pager | \
         fault p50 us kernel / pager | fault p99 us kernel / pager |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for row in rows {
        let speedup =
            ratio(row.pager_tps, row.kernel_tps).map_or("–".into(), |r| format!("{r:.2}x"));
        let to_floor = |read_floor_s: f64| {
            row.pager_tps.map_or("–".to_string(), |tps| {
                format!("{:.2}", (1.0 / tps) / compute_s.max(read_floor_s))
            })
        };
        let _ = writeln!(
            out,
            "| {:.0}% ({:.0} MiB) | {} | {} | {} | {} | {:.0} | {} | {:.1} | {:.1} | {} | {} / {} | {} / {} | {} / {} |",
            row.share,
            mib(row.budget as f64),
            opt(row.kernel_tps, 2),
            opt(row.pager_tps, 2),
            speedup,
            to_floor(row.read_floor_s()),
            row.device_bps / 1e6,
            to_floor(row.read_floor_s() / decode_share.fraction()),
            mib(row.pager_bytes_per_token),
            mib(row.floor_bytes_per_token),
            opt(row.optimum_bytes_per_token.map(mib), 1),
            opt(row.kernel_read_mb_s, 0),
            opt(row.pager_read_mb_s, 0),
            opt(row.kernel_p50_us, 0),
            opt(row.pager_p50_us, 0),
            opt(row.kernel_p99_us, 0),
            opt(row.pager_p99_us, 0),
        );
    }
}

/// Where the floor comes from, and how the pager's bytes per token are measured.
fn write_floor_note(out: &mut String, args: &BenchArgs, model: Measured) {
    let floor = if model.sparse {
        format!(
            "Floor: token time >= max(compute, floor bytes / device MB/s), where a mixture of \
             experts' floor bytes are Belady's policy replayed on a demand trace of the \
             program (llama-bench tg{} under `hyperoffload run --policy demand --block 2M \
             --budget 16M`: every block each token uses; `hyperoffload simulate --trace \
             demand-trace.csv --model M --policy belady`), in steady state: the trace replayed \
             twice, per pass of its second copy, when every expert used has been read once \
             (the pager's bytes, tokens 3 to {} of a cold run, still hold some first uses). \
             Frequency floor: the block the whole trace uses \
             least is evicted first (`--policy frequency`): the best a policy can do that \
             learns how often each expert runs but cannot foresee the router. Each pager run \
             saves what it learned of the experts beside the model and the next starts from \
             it: the bench removes the saved counts first, so its first pager run starts cold.",
            args.tokens + TRACE_EXTRA_TOKENS,
            args.tokens + 2
        )
    } else {
        "Floor: token time >= max(compute, (M - B) / device MB/s). Optimum: Belady's policy \
         replayed on the model's predicted order (`hyperoffload simulate --model --policy \
         belady`)."
            .to_string()
    };
    let _ = writeln!(
        out,
        "\n{floor} Beside decode: the device rate scaled by what it gives beside a decode (the \
         bound were every read made while the program computes; the target is the floor). \
         Pager bytes per token: two cold pager runs generating 2 and 2 + {} tokens, the \
         difference divided by {} (loading and warm-up cancel out). Per-budget reports with \
         plots: `budget-*/report.md`.",
        args.tokens, args.tokens
    );
}

/// Cold start to the first token, per budget and side.
fn write_first_token_table(out: &mut String, args: &BenchArgs, rows: &[Row]) {
    let _ = writeln!(
        out,
        "\n## Cold start to the first token\n\n`llama-completion -p \"{FIRST_TOKEN_PROMPT}\" -n 1 -c \
         256 -t {} --no-warmup --no-repack`, page cache dropped, {} runs per side (medians): wall \
         time from starting the program to its exit after the first token (loading, the \
         prompt's pass over the weights, one token), and the bytes it read from the device. \
         One pass reads the model once; loading that reads it whole (llama.cpp maps with \
         MAP_POPULATE) reads it twice when it does not fit.\n",
        args.threads, args.runs,
    );
    let _ = writeln!(
        out,
        "| budget | first token s kernel | first token s pager | pager/kernel | read MiB kernel | read MiB pager |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|");
    for row in rows {
        let _ = writeln!(
            out,
            "| {:.0}% ({:.0} MiB) | {} | {} | {} | {} | {} |",
            row.share,
            mib(row.budget as f64),
            opt(row.kernel_first_token_s, 2),
            opt(row.pager_first_token_s, 2),
            opt(ratio(row.pager_first_token_s, row.kernel_first_token_s), 2),
            opt(row.kernel_first_token_bytes.map(mib), 0),
            opt(row.pager_first_token_bytes.map(mib), 0),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Model length in these tests.
    const MODEL: u64 = 2 << 30;

    fn row(share: f64, pager_tps: Option<f64>) -> Row {
        Row {
            share,
            // M - B of 0.7 GB: 0.2 s at the row's 3.5 GB/s.
            budget: MODEL - 700_000_000,
            kernel_tps: Some(0.5),
            pager_tps,
            pager_bytes_per_token: 1e9,
            floor_bytes_per_token: 700_000_000.0,
            optimum_bytes_per_token: None,
            device_bps: 3.5e9,
            kernel_read_mb_s: None,
            pager_read_mb_s: None,
            kernel_p50_us: None,
            kernel_p99_us: None,
            pager_p50_us: None,
            pager_p99_us: None,
            kernel_first_token_s: None,
            pager_first_token_s: None,
            kernel_first_token_bytes: None,
            pager_first_token_bytes: None,
        }
    }

    fn dense() -> Measured {
        Measured {
            len: MODEL,
            sparse: false,
        }
    }

    fn args() -> BenchArgs {
        BenchArgs {
            model: Some("m.gguf".into()),
            llama_bin: "bin".into(),
            budgets: vec![50.0],
            runs: 3,
            tokens: 8,
            threads: 2,
            out: "bench".into(),
            remote: Default::default(),
        }
    }

    #[test]
    fn every_row_has_the_headers_columns_and_both_floors() {
        let share = DecodeShare {
            alone_bps: 3.5e9,
            during_bps: 2.8e9,
        };
        // Token 0.25 s, floor max(0.1, 0.2): 1.25; beside decode the reads' floor is
        // 0.2 / 0.8 = 0.25: 1.00.
        let rows = [row(50.0, Some(4.0)), row(90.0, None)];
        let provenance = "Measured by `hyperoffload bench` from A to B (UTC), commit C.";
        let references = References {
            device_bps: 3.6e9,
            warm_tps: 10.0,
            decode_share: share,
        };
        let markdown = results_markdown(&args(), provenance, dense(), &references, 0.1, &rows);
        assert!(
            markdown.contains(&format!("\n\n{provenance}\n")),
            "{markdown}"
        );
        let table: Vec<&str> = markdown
            .lines()
            .skip_while(|line| !line.starts_with("| budget | kernel tok/s"))
            .take_while(|line| line.starts_with('|'))
            .collect();
        let columns = |line: &str| line.matches('|').count();
        assert_eq!(table.len(), 4, "{markdown}");
        assert!(
            table.iter().all(|line| columns(line) == columns(table[0])),
            "{markdown}"
        );
        let cells: Vec<&str> = table[2].split('|').map(str::trim).collect();
        assert_eq!(&cells[5..8], ["1.25", "3500", "1.00"], "{}", table[2]);
        let missing: Vec<&str> = table[3].split('|').map(str::trim).collect();
        assert_eq!(&missing[5..8], ["–", "3500", "–"], "{}", table[3]);
        assert!(markdown.contains("2800 MB/s against 3500 alone just before (80 %)"));
    }

    #[test]
    fn a_mixture_of_experts_is_held_to_the_trace_s_floors() {
        let share = DecodeShare {
            alone_bps: 3.5e9,
            during_bps: 3.5e9,
        };
        let mut moe = row(50.0, Some(4.0));
        // 35 MB a token at 3.5 GB/s: 0.01 s, below compute (0.1 s): 0.25 / 0.1.
        moe.floor_bytes_per_token = 35e6;
        let references = References {
            device_bps: 3.5e9,
            warm_tps: 10.0,
            decode_share: share,
        };
        let moe_model = Measured {
            len: MODEL,
            sparse: true,
        };
        let markdown = results_markdown(&args(), "", moe_model, &references, 0.1, &[moe]);
        assert!(
            markdown.contains("| Belady on the trace (MiB) | frequency floor (MiB) |"),
            "{markdown}"
        );
        assert!(
            markdown.contains("demand trace of the program"),
            "{markdown}"
        );
        let line = markdown.lines().find(|l| l.starts_with("| 50%")).unwrap();
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        assert_eq!((cells[5], cells[9]), ("2.50", "33.4"), "{line}");
    }

    fn run_record(side: Side, exit_code: i32, waited_p50_us: Option<f64>) -> RunRecord {
        let mut record = RunRecord {
            side,
            exit_code: Some(exit_code),
            ..Default::default()
        };
        if let Some(p50_us) = waited_p50_us {
            record.faults.waited_faults = 5;
            record.faults.latency.measured = 5;
            record.faults.latency.p50_us = p50_us;
        }
        record
    }

    #[test]
    fn latency_medians_skip_runs_without_a_waited_fault() {
        let runs = [
            run_record(Side::Kernel, 0, Some(100.0)),
            run_record(Side::Kernel, 0, None),
            run_record(Side::Kernel, 0, None),
            // A failed run does not count either.
            run_record(Side::Kernel, 1, Some(900.0)),
            run_record(Side::Pager, 0, None),
        ];
        let p50 = |side| latency_median(&runs, side, |l| l.p50_us);
        assert_eq!(p50(Side::Kernel), Some(100.0));
        assert_eq!(p50(Side::Pager), None);
    }
}
