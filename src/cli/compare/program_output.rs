//! The program's own figures, read from what it printed: llama-bench's markdown table or
//! `-o json` array (tokens per second per test), llama-completion's timing lines
//! (milliseconds per token).

use serde::{Deserialize, Serialize};

/// One llama-bench test (`pp512`, `tg8`, ...) and its throughput.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BenchTest {
    pub test: String,
    pub tokens_per_s: f64,
    pub stddev: f64,
}

/// What the program reported about its own speed, when it is a program we recognise.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ProgramFigures {
    /// llama-bench tests, in the order printed.
    pub bench: Vec<BenchTest>,
    /// llama-completion: generation time per token (`eval time`).
    pub eval_ms_per_token: Option<f64>,
    /// llama-completion: prompt processing time per token (`prompt eval time`).
    pub prompt_ms_per_token: Option<f64>,
}

impl ProgramFigures {
    /// Reads whatever it recognises in the program's stdout and stderr.
    pub fn parse(stdout: &str, stderr: &str) -> Self {
        let mut bench = parse_bench_json(stdout).unwrap_or_default();
        if bench.is_empty() {
            bench = parse_bench_markdown(stdout);
        }
        let mut figures = ProgramFigures {
            bench,
            ..Default::default()
        };
        for line in stdout.lines().chain(stderr.lines()) {
            if let Some((prompt, ms)) = parse_eval_line(line) {
                if prompt {
                    figures.prompt_ms_per_token = Some(ms);
                } else {
                    figures.eval_ms_per_token = Some(ms);
                }
            }
        }
        figures
    }

    /// Tokens per second of the first test whose name starts with `prefix` (`tg`, `pp`).
    pub fn bench_tokens_per_s(&self, prefix: &str) -> Option<f64> {
        self.bench
            .iter()
            .find(|test| test.test.starts_with(prefix))
            .map(|test| test.tokens_per_s)
    }
}

/// Rows of llama-bench's markdown table:
/// `| llama 256M Q4_1 | 92.10 MiB | 134.52 M | CPU | 2 | tg8 | 73.1 ± 0.00 |`.
/// The `test` and `t/s` columns are found by the header, whose other columns vary with
/// the options.
pub fn parse_bench_markdown(text: &str) -> Vec<BenchTest> {
    let cells = |line: &str| -> Option<Vec<String>> {
        let line = line.trim();
        let inner = line.strip_prefix('|')?.strip_suffix('|')?;
        Some(
            inner
                .split('|')
                .map(|cell| cell.trim().to_string())
                .collect(),
        )
    };
    let mut columns: Option<(usize, usize)> = None;
    let mut tests = Vec::new();
    for line in text.lines() {
        let Some(row) = cells(line) else { continue };
        let test_column = row.iter().position(|cell| cell == "test");
        let speed_column = row.iter().position(|cell| cell == "t/s");
        if let (Some(test), Some(speed)) = (test_column, speed_column) {
            columns = Some((test, speed));
            continue;
        }
        let Some((test, speed)) = columns else {
            continue;
        };
        let (Some(name), Some(value)) = (row.get(test), row.get(speed)) else {
            continue;
        };
        let mut numbers = value.split('±').map(|part| part.trim().parse::<f64>());
        if let Some(Ok(tokens_per_s)) = numbers.next() {
            let stddev = numbers.next().and_then(Result::ok).unwrap_or(0.0);
            tests.push(BenchTest {
                test: name.clone(),
                tokens_per_s,
                stddev,
            });
        }
    }
    tests
}

#[derive(Deserialize)]
struct BenchJsonEntry {
    n_prompt: u64,
    n_gen: u64,
    avg_ts: f64,
    #[serde(default)]
    stddev_ts: f64,
}

/// llama-bench `-o json`: an array of objects with `n_prompt`, `n_gen`, `avg_ts`,
/// `stddev_ts`. The test is named as in the table: `tgN` when it generates, else `ppN`.
/// None when the text does not contain such an array.
pub fn parse_bench_json(text: &str) -> Option<Vec<BenchTest>> {
    let start = text.find('[')?;
    let end = text.rfind(']')?;
    let entries: Vec<BenchJsonEntry> = serde_json::from_str(text.get(start..=end)?).ok()?;
    Some(
        entries
            .into_iter()
            .map(|entry| BenchTest {
                test: if entry.n_gen > 0 {
                    format!("tg{}", entry.n_gen)
                } else {
                    format!("pp{}", entry.n_prompt)
                },
                tokens_per_s: entry.avg_ts,
                stddev: entry.stddev_ts,
            })
            .collect(),
    )
}

/// llama-completion's timing lines:
/// `llama_perf_context_print:        eval time =  123.45 ms / 31 runs ( 3.98 ms per token, 251.11 tokens per second)`.
/// Returns (is the prompt line, milliseconds per token).
pub fn parse_eval_line(line: &str) -> Option<(bool, f64)> {
    let (label, rest) = line.split_once('=')?;
    let label = label.trim_end();
    let prompt = if label.ends_with("prompt eval time") {
        true
    } else if label.ends_with("eval time") {
        false
    } else {
        return None;
    };
    let before = rest.split("ms per token").next()?;
    if before.len() == rest.len() {
        return None;
    }
    let number = before.rsplit('(').next()?.trim();
    number.parse().ok().map(|ms| (prompt, ms))
}

#[cfg(test)]
mod tests {
    use super::*;

    const BENCH_TABLE: &str = "\
| model                          |       size |     params | backend    | threads |            test |                  t/s |
| ------------------------------ | ---------: | ---------: | ---------- | ------: | --------------: | -------------------: |
| llama 256M Q4_1                |  92.10 MiB |   134.52 M | CPU        |       2 |             tg8 |         12.34 ± 0.56 |
| llama 256M Q4_1                |  92.10 MiB |   134.52 M | CPU        |       2 |           pp512 |        300.5 ± 10.25 |

build: 1234abcd (11434)
";

    #[test]
    fn reads_bench_markdown_rows_by_header() {
        let tests = parse_bench_markdown(BENCH_TABLE);
        assert_eq!(
            tests,
            vec![
                BenchTest {
                    test: "tg8".into(),
                    tokens_per_s: 12.34,
                    stddev: 0.56
                },
                BenchTest {
                    test: "pp512".into(),
                    tokens_per_s: 300.5,
                    stddev: 10.25
                },
            ]
        );
        let figures = ProgramFigures::parse(BENCH_TABLE, "");
        assert_eq!(figures.bench_tokens_per_s("tg"), Some(12.34));
        assert_eq!(figures.bench_tokens_per_s("pp"), Some(300.5));
    }

    #[test]
    fn reads_bench_json() {
        let json = r#"[
  {"build_commit": "x", "n_prompt": 0, "n_gen": 4, "avg_ns": 1, "stddev_ns": 0,
   "avg_ts": 73.1, "stddev_ts": 0.5, "samples_ts": [73.1]},
  {"n_prompt": 512, "n_gen": 0, "avg_ts": 900.0}
]"#;
        let tests = parse_bench_json(json).unwrap();
        assert_eq!(tests[0].test, "tg4");
        assert_eq!(tests[0].tokens_per_s, 73.1);
        assert_eq!(tests[0].stddev, 0.5);
        assert_eq!(tests[1].test, "pp512");
        assert_eq!(ProgramFigures::parse(json, "").bench.len(), 2);
    }

    #[test]
    fn reads_completion_timings() {
        let stderr = "\
llama_perf_sampler_print:    sampling time =       1.10 ms /    37 runs   (    0.03 ms per token, 33636.36 tokens per second)
llama_perf_context_print:        load time =     105.17 ms
llama_perf_context_print: prompt eval time =      21.50 ms /     6 tokens (    3.58 ms per token,   279.07 tokens per second)
llama_perf_context_print:        eval time =     123.45 ms /    31 runs   (    3.98 ms per token,   251.11 tokens per second)
llama_perf_context_print:       total time =     150.00 ms /    37 tokens
";
        let figures = ProgramFigures::parse("Paris.", stderr);
        assert_eq!(figures.eval_ms_per_token, Some(3.98));
        assert_eq!(figures.prompt_ms_per_token, Some(3.58));
        assert!(figures.bench.is_empty());
        assert_eq!(parse_eval_line("load time = 105.17 ms"), None);
    }

    #[test]
    fn unrecognised_output_gives_no_figures() {
        assert_eq!(
            ProgramFigures::parse("hello | a | b |\n[1, 2]", "eval time = soon"),
            ProgramFigures::default()
        );
    }
}
