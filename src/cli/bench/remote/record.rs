//! The record of each run of the remote bench (remote.json), as the bench says it on
//! stderr, and the check that the runs through the mount printed the local runs' text.

use std::path::PathBuf;

use serde::Serialize;

use super::super::remote_figures::RemoteSide;
use super::MountStats;
use hyperoffload::size::format_size;

/// One run of the program, for remote.json.
#[derive(Debug, Serialize)]
pub(super) struct RunRecord {
    pub(super) part: &'static str,
    pub(super) side: RemoteSide,
    pub(super) round: usize,
    pub(super) budget: u64,
    pub(super) tokens: u32,
    /// Wall time of the program under `hyperoffload run`.
    pub(super) run_s: f64,
    /// Local side of ttft: the download before it.
    pub(super) download_s: Option<f64>,
    /// Mount side: how long the mount took to come up (not in `run_s`).
    pub(super) mount_start_s: Option<f64>,
    pub(super) eval_tps: Option<f64>,
    /// Mount side: what its `--stats` say.
    pub(super) mount: Option<MountStats>,
    /// Mount side: the stats file.
    pub(super) mount_stats_file: Option<PathBuf>,
    pub(super) text: String,
}

/// Whether every mount run's text is the local runs' of its part and token count.
pub(super) fn texts_agree(records: &[RunRecord]) -> bool {
    records
        .iter()
        .filter(|r| r.side == RemoteSide::Mount)
        .all(|mounted| {
            records
                .iter()
                .filter(|r| {
                    r.side == RemoteSide::Local
                        && r.part == mounted.part
                        && r.tokens == mounted.tokens
                })
                .all(|local| local.text == mounted.text)
        })
}

/// How the bench names `side` of `part` on stderr.
pub(super) fn side_name(part: &str, side: RemoteSide) -> &'static str {
    match (part, side) {
        (_, RemoteSide::Mount) => "mount",
        ("ttft", RemoteSide::Local) => "download then run",
        (_, RemoteSide::Local) => "local",
    }
}

/// One line of what `record` measured, for stderr.
pub(super) fn describe(record: &RunRecord) -> String {
    let mut text = format!("run {:.2} s", record.run_s);
    if let Some(up) = record.mount_start_s {
        text += &format!(" (the mount up in {up:.2} s before)");
    }
    if let Some(download) = record.download_s {
        text += &format!(" after a download of {download:.2} s");
    }
    if let Some(tps) = record.eval_tps {
        text += &format!(", {tps:.2} tok/s");
    }
    if let Some(stats) = &record.mount {
        text += &format!(
            ", fetched {} in {} GETs, {} read through the mount, {} opens passed through",
            format_size(stats.remote_bytes),
            stats.remote_gets,
            format_size(stats.read_bytes),
            stats.passthrough_opens
        );
    }
    text
}

#[cfg(test)]
mod tests {
    use super::super::completion::Completion;
    use super::*;

    fn record(part: &'static str, side: RemoteSide, tokens: u32, text: &str) -> RunRecord {
        Completion {
            wall_s: 1.0,
            eval_tps: None,
            text: text.into(),
        }
        .record(part, side, 1, 0, tokens)
    }

    #[test]
    fn texts_are_compared_per_part_and_length() {
        use RemoteSide::*;
        let mut records = vec![
            record("fetch", Mount, 4, "a"),
            record("fetch", Mount, 12, "a b"),
            record("fetch", Local, 4, "a"),
            record("fetch", Local, 12, "a b"),
            record("ttft", Mount, 1, "x"),
            record("ttft", Local, 1, "x"),
        ];
        assert!(texts_agree(&records));
        records.push(record("ttft", Mount, 1, "y"));
        assert!(!texts_agree(&records));
    }
}
