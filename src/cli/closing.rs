//! The launcher's closing line and the stats it keeps: what the pager did, from the
//! shim's stats, and how the program ended wherever that explains stats that are
//! partial or missing. A program killed by a signal runs no exit handlers, so the shim
//! wrote no final stats: its last snapshot (written every half second while the pager
//! ran) stands in for them, and the line says so and names the signal.
//!
//! Before it, one line for each model file the program opened or mapped and was not
//! served, with the reason (`served_files`): the closing line stays the last one.

use hyperoffload::budget::history;
use hyperoffload::served_files::{SeenFiles, REPORT_FLOOR};
use hyperoffload::shim_config::BudgetSpec;
use hyperoffload::size::format_size;

use super::exit_status::{signal_name, Ending};

/// What the launcher knows once the program has ended.
pub struct Outcome<'a> {
    pub ending: &'a Ending,
    /// The last signal the launcher passed on to the program.
    pub passed_on: Option<i32>,
    /// The stats the shim wrote at exit.
    pub stats: Option<&'a str>,
    /// The last snapshot of the stats, written while the pager ran.
    pub snapshot: Option<&'a str>,
    /// What the shim saw of the program's model files, where it recorded any.
    pub seen: Option<&'a SeenFiles>,
    /// What the shim serves, for the line saying nothing was.
    pub patterns: &'a [String],
    /// Whether programs the program started were served too (`--inherit`).
    pub inherit: bool,
}

impl Outcome<'_> {
    /// Whether the pager served any file.
    pub fn served(&self) -> bool {
        let stats_name_files = self.stats.or(self.snapshot).is_some_and(|json| {
            serde_json::from_str::<serde_json::Value>(json)
                .ok()
                .and_then(|stats| stats["files"].as_array().map(|files| !files.is_empty()))
                .unwrap_or(false)
        });
        stats_name_files || self.seen.is_some_and(SeenFiles::any_served)
    }
}

/// Every line to print at the end (without the `hyperoffload: ` prefix): one for each
/// model file not served, then the closing line.
pub fn closing_lines(outcome: &Outcome<'_>) -> Vec<String> {
    let killed = match outcome.ending {
        Ending::Signal(signal) => Some(signal_name(*signal)),
        Ending::Code(_) => None,
    };
    let mut lines = outcome
        .seen
        .map(|seen| seen.unserved_lines(killed.as_deref()))
        .unwrap_or_default();
    lines.push(closing_line(outcome));
    lines
}

/// The closing line (without the `hyperoffload: ` prefix).
pub fn closing_line(outcome: &Outcome<'_>) -> String {
    let killed = match outcome.ending {
        Ending::Signal(signal) => Some(format!("killed by {}", signal_name(*signal))),
        Ending::Code(_) => None,
    };
    match (outcome.stats, outcome.snapshot) {
        (Some(json), _) => match killed {
            Some(killed) => format!("{killed}; {}", summary(json)),
            None => summary(json),
        },
        (None, Some(json)) => {
            let how = match (outcome.ending, outcome.passed_on) {
                (Ending::Signal(_), _) => killed.unwrap_or_default(),
                (Ending::Code(code), Some(signal)) => format!(
                    "the program exited with status {code} after the {} passed on to it, \
                     without running exit handlers",
                    signal_name(signal)
                ),
                (Ending::Code(code), None) => {
                    format!("the program exited with status {code} without running exit handlers")
                }
            };
            format!("{how}; as of its last stats snapshot: {}", summary(json))
        }
        (None, None) if outcome.seen.is_some_and(|seen| !seen.files.is_empty()) => match killed {
            Some(killed) => format!("{killed}; nothing was served (see above)"),
            None => "nothing was served (see above)".to_string(),
        },
        (None, None) => {
            let files = format!(
                "no model file (matching {}, or starting as a GGUF or safetensors file \
                 does, of at least {})",
                outcome.patterns.join(","),
                format_size(REPORT_FLOOR)
            );
            // The shim serves only the process it was started in: a wrapper's child
            // (a script running python) is the usual program that opened the model.
            let children = if outcome.inherit {
                ""
            } else {
                "; programs it started are served only with --inherit"
            };
            match killed {
                Some(killed) => format!(
                    "{killed} before the pager started: nothing was served; the program had \
                     opened or mapped {files}{children}"
                ),
                None => {
                    format!("nothing was served: the program opened or mapped {files}{children}")
                }
            }
        }
    }
}

/// The line of a `--require-served` run that served nothing, ending with `status`: the
/// model not served, its size and the budget it would have had.
pub fn require_served_line(seen: Option<&SeenFiles>, budget: BudgetSpec, status: u8) -> String {
    let unserved: Vec<_> = seen
        .map(|seen| seen.files.iter().filter(|file| !file.served).collect())
        .unwrap_or_default();
    let Some(first) = unserved.first() else {
        return format!(
            "--require-served: no model file was served or seen (budget {budget}); exiting \
             with status {status}"
        );
    };
    let others = match unserved.len() - 1 {
        0 => String::new(),
        1 => " (nor 1 other file)".to_string(),
        more => format!(" (nor {more} other files)"),
    };
    let resolved = match budget {
        BudgetSpec::ModelPercent(_) => {
            format!(" = {}", format_size(budget.resolve(first.model_len, || 0)))
        }
        _ => String::new(),
    };
    format!(
        "--require-served: {} ({}) was not served{others}; budget {budget}{resolved}; exiting \
         with status {status}",
        first.path,
        format_size(first.model_len)
    )
}

/// The stats JSON to keep for `--stats`: the final stats, else the last snapshot; with
/// the signal that killed the program (`ended_by_signal`) where one did.
pub fn kept_stats(outcome: &Outcome<'_>) -> Option<String> {
    let json = outcome.stats.or(outcome.snapshot)?;
    let Ending::Signal(signal) = outcome.ending else {
        return Some(json.to_string());
    };
    let Ok(mut stats) = serde_json::from_str::<serde_json::Value>(json) else {
        return Some(json.to_string());
    };
    stats["ended_by_signal"] = signal_name(*signal).into();
    Some(stats.to_string())
}

/// One line for people from the shim's stats JSON.
pub fn summary(json: &str) -> String {
    let Ok(stats) = serde_json::from_str::<serde_json::Value>(json) else {
        return "the shim's stats are not valid JSON".into();
    };
    let number = |key: &str| stats[key].as_f64().unwrap_or(0.0);
    let bytes_read = number("bytes_read");
    let faults = number("faults");
    // Faults on watched blocks needed no data: not counted for or against read-ahead.
    let watch_faults = number("watch_faults");
    let data_faults = faults - watch_faults;
    let hit_rate = if data_faults > 0.0 {
        100.0 * number("prefetch_hits") / data_faults
    } else {
        0.0
    };
    let watched = if watch_faults > 0.0 {
        format!(", {} on watched blocks", watch_faults as u64)
    } else {
        String::new()
    };
    let elapsed = number("elapsed_s");
    let rate = if elapsed > 0.0 {
        bytes_read / elapsed
    } else {
        0.0
    };
    format!(
        "read {} in {} requests; {} faults ({} on demand, {:.1}% found their block read \
         ahead{}); peak resident {} of {}, the pager's own heap {} at most; {}/s average read \
         rate over {:.2} s",
        format_size(bytes_read as u64),
        number("read_requests") as u64,
        faults as u64,
        number("demand_faults") as u64,
        hit_rate,
        watched,
        format_size(number("peak_resident_bytes") as u64),
        budget_phrase(&stats),
        format_size(number("pager_heap_peak_bytes") as u64),
        format_size(rate as u64),
        elapsed
    ) + &served_model(&stats)
        + &served_process(&stats)
        + &breaches(&stats)
}

/// Internal invariants the service found broken (`Stats::invariant_breaches`), named
/// where there were any: each is a bug the service stepped over.
fn breaches(stats: &serde_json::Value) -> String {
    match stats["invariant_breaches"].as_u64().unwrap_or(0) {
        0 => String::new(),
        n => format!("; {n} internal invariant breaches (a bug: please report it)"),
    }
}

/// The model served (`; model /m/x.gguf (4.00 GiB)`, with `and N more` for more files):
/// empty for stats without files.
fn served_model(stats: &serde_json::Value) -> String {
    let Some(files) = stats["files"].as_array().filter(|files| !files.is_empty()) else {
        return String::new();
    };
    let path = files[0]["path"].as_str().unwrap_or("?");
    let size = format_size(files[0]["size"].as_u64().unwrap_or(0));
    match files.len() - 1 {
        0 => format!("; model {path} ({size})"),
        more => format!("; model {path} ({size}) and {more} more"),
    }
}

/// The budget as the summary says it: `a 2.00 MiB budget`, or, when it followed memory
/// pressure (its history has changes), how far and when it moved: `a budget that followed
/// memory pressure (760 MiB at the start, 106 MiB at its lowest at 3.0 s, 690 MiB at the
/// end, 14 changes from 2.5 s to 9.5 s)`.
fn budget_phrase(stats: &serde_json::Value) -> String {
    let now = stats["budget_bytes"].as_u64().unwrap_or(0);
    let Some(moved) = history::movement(&history::from_stats_json(stats)) else {
        return format!("a {} budget", format_size(now));
    };
    // Its extremes where they differ from the start (auto may grow back past it).
    let extreme = |point: history::BudgetPoint, which: &str| {
        (point.bytes != moved.start).then(|| {
            format!(
                ", {} at its {which} at {:.1} s",
                format_size(point.bytes),
                point.t_s
            )
        })
    };
    let lowest = extreme(moved.lowest, "lowest").unwrap_or_default();
    let highest = extreme(moved.highest, "highest").unwrap_or_default();
    let changes = match moved.changes {
        1 => format!("1 change at {:.1} s", moved.first_change_s),
        n => format!(
            "{n} changes from {:.1} s to {:.1} s",
            moved.first_change_s, moved.last_change_s
        ),
    };
    format!(
        "a budget that followed memory pressure ({} at the start{lowest}{highest}, {} at the \
         end, {changes})",
        format_size(moved.start),
        format_size(now),
    )
}

/// Which process the stats are of (`; served pid 4242 (llama-completion)`): through a
/// wrapper that execs the real program, the real one; empty for stats without it.
fn served_process(stats: &serde_json::Value) -> String {
    let (Some(pid), Some(program)) = (stats["pid"].as_u64(), stats["program"].as_str()) else {
        return String::new();
    };
    let name = program.rsplit('/').next().unwrap_or(program);
    let guests: Vec<&str> = stats["guest_processes"]
        .as_array()
        .map(|list| list.iter().filter_map(|p| p.as_str()).collect())
        .unwrap_or_default();
    if guests.is_empty() {
        format!("; served pid {pid} ({name})")
    } else {
        format!(
            "; served pid {pid} ({name}), and sharing its pager pid {}",
            guests.join(", pid ")
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STATS: &str = r#"{"bytes_read": 1048576, "read_requests": 4, "faults": 4,
        "demand_faults": 4, "elapsed_s": 2.0, "budget_bytes": 2097152}"#;

    fn outcome<'a>(
        ending: &'a Ending,
        stats: Option<&'a str>,
        snapshot: Option<&'a str>,
        patterns: &'a [String],
    ) -> Outcome<'a> {
        Outcome {
            ending,
            passed_on: None,
            stats,
            snapshot,
            seen: None,
            patterns,
            inherit: false,
        }
    }

    #[test]
    fn a_budget_that_changed_is_told_with_its_range() {
        assert!(
            summary(STATS).contains("of a 2.00 MiB budget"),
            "{}",
            summary(STATS)
        );
        let followed = r#"{"budget_bytes": 3145728, "budget_history": [
            {"t_s": 0.0, "bytes": 4194304}, {"t_s": 1.5, "bytes": 1048576},
            {"t_s": 2.0, "bytes": 3145728}]}"#;
        let line = summary(followed);
        assert!(
            line.contains(
                "of a budget that followed memory pressure (4.00 MiB at the start, 1.00 MiB \
                 at its lowest at 1.5 s, 3.00 MiB at the end, 2 changes from 1.5 s to 2.0 s), \
                 the pager's own heap"
            ),
            "{line}"
        );
        // One change, up past the start: the highest is told (no lowest), and when.
        let grew = r#"{"budget_bytes": 8388608, "budget_history": [
            {"t_s": 0.0, "bytes": 4194304}, {"t_s": 0.5, "bytes": 8388608}]}"#;
        let line = summary(grew);
        assert!(
            line.contains(
                "(4.00 MiB at the start, 8.00 MiB at its highest at 0.5 s, 8.00 MiB at the \
                 end, 1 change at 0.5 s),"
            ),
            "{line}"
        );
        // A history of the start alone is a fixed budget.
        let fixed =
            r#"{"budget_bytes": 2097152, "budget_history": [{"t_s": 0.0, "bytes": 2097152}]}"#;
        assert!(summary(fixed).contains("of a 2.00 MiB budget,"));
    }

    #[test]
    fn the_summary_names_the_process_served() {
        let stats = r#"{"bytes_read": 1, "pid": 4242, "program": "/opt/llama/llama-completion"}"#;
        assert!(
            summary(stats).ends_with("; served pid 4242 (llama-completion)"),
            "{}",
            summary(stats)
        );
        assert!(!summary(STATS).contains("served pid"));
        let shared = STATS.replacen(
            '{',
            r#"{"pid": 4242, "program": "/usr/bin/llama-completion",
               "guest_processes": ["4243 (llama-completion)", "4250 (python3)"], "#,
            1,
        );
        assert!(
            summary(&shared).ends_with(
                "; served pid 4242 (llama-completion), and sharing its pager pid 4243 \
                 (llama-completion), pid 4250 (python3)"
            ),
            "{}",
            summary(&shared)
        );
    }

    #[test]
    fn a_normal_end_is_the_summary_alone() {
        let patterns = ["*.gguf".to_string()];
        let line = closing_line(&outcome(&Ending::Code(0), Some(STATS), None, &patterns));
        assert!(line.starts_with("read 1.00 MiB in 4 requests"), "{line}");
        assert_eq!(line, summary(STATS));
    }

    #[test]
    fn a_program_killed_by_a_signal_is_reported_from_its_last_snapshot() {
        let patterns = ["*.gguf".to_string()];
        let ending = Ending::Signal(libc::SIGTERM);
        let killed = outcome(&ending, None, Some(STATS), &patterns);
        let line = closing_line(&killed);
        assert!(
            line.starts_with("killed by SIGTERM; as of its last stats snapshot: read 1.00 MiB"),
            "{line}"
        );
        let kept: serde_json::Value = serde_json::from_str(&kept_stats(&killed).unwrap()).unwrap();
        assert_eq!(kept["ended_by_signal"], "SIGTERM");
        assert_eq!(kept["bytes_read"], 1048576);
        // Final stats (its exit handlers ran after all) come first.
        let line = closing_line(&outcome(&ending, Some(STATS), Some("{}"), &patterns));
        assert!(
            line.starts_with("killed by SIGTERM; read 1.00 MiB"),
            "{line}"
        );
    }

    #[test]
    fn an_exit_without_exit_handlers_after_a_passed_on_signal_says_so() {
        let patterns = ["*.gguf".to_string()];
        let ending = Ending::Code(130);
        let mut interrupted = outcome(&ending, None, Some(STATS), &patterns);
        interrupted.passed_on = Some(libc::SIGINT);
        let line = closing_line(&interrupted);
        assert!(
            line.starts_with(
                "the program exited with status 130 after the SIGINT passed on to it, \
                 without running exit handlers; as of its last stats snapshot: read"
            ),
            "{line}"
        );
        assert_eq!(kept_stats(&interrupted).as_deref(), Some(STATS));
        interrupted.passed_on = None;
        assert!(closing_line(&interrupted)
            .starts_with("the program exited with status 130 without running exit handlers"));
    }

    #[test]
    fn no_stats_at_all_say_why_as_far_as_known() {
        let patterns = ["*.gguf".to_string(), "*.safetensors".to_string()];
        let ending = Ending::Signal(libc::SIGINT);
        let line = closing_line(&outcome(&ending, None, None, &patterns));
        assert_eq!(
            line,
            "killed by SIGINT before the pager started: nothing was served; the program had \
             opened or mapped no model file (matching *.gguf,*.safetensors, or starting as a \
             GGUF or safetensors file does, of at least 1.00 MiB); programs it started are \
             served only with --inherit"
        );
        let ending = Ending::Code(0);
        let line = closing_line(&outcome(&ending, None, None, &patterns));
        assert!(
            line.starts_with("nothing was served: the program opened or mapped no model file"),
            "{line}"
        );
        assert_eq!(kept_stats(&outcome(&ending, None, None, &patterns)), None);
        assert!(!outcome(&ending, None, None, &patterns).served());
        let inherited = Outcome {
            inherit: true,
            ..outcome(&ending, None, None, &patterns)
        };
        assert!(closing_line(&inherited).ends_with("of at least 1.00 MiB)"));
    }

    #[test]
    fn each_file_not_served_has_its_line_before_the_closing_one() {
        use hyperoffload::served_files::{FoundBy, Refusal, SeenFile};
        let patterns = ["*.gguf".to_string()];
        let file = SeenFile {
            path: "/m/m.gguf".into(),
            size: 4 << 20,
            model_len: 4 << 20,
            found_by: FoundBy::Name,
            opened: true,
            served: false,
            refused: Some(Refusal::Writable),
        };
        let seen = SeenFiles {
            program: "/bin/victim".into(),
            min_size: 1 << 20,
            patterns: patterns.to_vec(),
            files: vec![file],
        };
        let ending = Ending::Signal(libc::SIGTERM);
        let mut killed = outcome(&ending, None, None, &patterns);
        killed.seen = Some(&seen);
        assert!(!killed.served());
        let lines = closing_lines(&killed);
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert!(
            lines[0].starts_with("not served: /m/m.gguf (4.00 MiB): mapped writable"),
            "{lines:?}"
        );
        assert_eq!(
            lines[1],
            "killed by SIGTERM; nothing was served (see above)"
        );
        // A file served (the stats list it) is served, whatever the records say.
        let stats = r#"{"bytes_read": 1, "files": [{"path": "/m/m.gguf", "size": 4194304}]}"#;
        let ending = Ending::Code(0);
        let served = Outcome {
            seen: Some(&seen),
            ..outcome(&ending, Some(stats), None, &patterns)
        };
        assert!(served.served());
    }

    #[test]
    fn require_served_names_the_model_its_size_and_the_budget() {
        use hyperoffload::served_files::{FoundBy, SeenFile};
        let file = |path: &str, served| SeenFile {
            path: path.into(),
            size: 100 << 20,
            model_len: 100 << 20,
            found_by: FoundBy::Name,
            opened: true,
            served,
            refused: None,
        };
        let mut seen = SeenFiles {
            files: vec![file("/m/a.gguf", false)],
            ..SeenFiles::default()
        };
        assert_eq!(
            require_served_line(Some(&seen), BudgetSpec::ModelPercent(50), 3),
            "--require-served: /m/a.gguf (100.0 MiB) was not served; budget 50% of the model = \
             50.0 MiB; exiting with status 3"
        );
        seen.files.push(file("/m/b.gguf", false));
        seen.files.push(file("/m/c.gguf", true));
        assert_eq!(
            require_served_line(Some(&seen), BudgetSpec::Bytes(2 << 20), 3),
            "--require-served: /m/a.gguf (100.0 MiB) was not served (nor 1 other file); budget \
             2.00 MiB; exiting with status 3"
        );
        assert_eq!(
            require_served_line(None, BudgetSpec::Auto, 3),
            "--require-served: no model file was served or seen (budget what this process can \
             spare); exiting with status 3"
        );
    }

    #[test]
    fn the_summary_names_the_model_and_its_size() {
        let one = r#"{"bytes_read": 1, "files": [{"path": "/m/m.gguf", "size": 4194304}]}"#;
        assert!(
            summary(one).ends_with("; model /m/m.gguf (4.00 MiB)"),
            "{}",
            summary(one)
        );
        let two =
            r#"{"files": [{"path": "/m/a.gguf", "size": 1024}, {"path": "/m/b.gguf", "size": 1}]}"#;
        assert!(summary(two).ends_with("; model /m/a.gguf (1.00 KiB) and 1 more"));
        assert!(!summary(STATS).contains("; model"));
    }

    #[test]
    fn the_summary_names_invariant_breaches_only_where_there_were_any() {
        let none = r#"{"bytes_read": 1, "invariant_breaches": 0}"#;
        assert!(!summary(none).contains("invariant"), "{}", summary(none));
        let some = r#"{"bytes_read": 1, "invariant_breaches": 3}"#;
        assert!(
            summary(some).ends_with("; 3 internal invariant breaches (a bug: please report it)"),
            "{}",
            summary(some)
        );
    }
}
