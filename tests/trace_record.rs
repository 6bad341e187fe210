//! The pager records every fault it serves; the trace round-trips through the CSV
//! format the simulator reads.

mod common;

use common::*;
use hyperoffload::policy::{FaultOutcome, PrefetchKind};
use hyperoffload::trace::{TraceReader, TraceWriter};
use hyperoffload::{MapOptions, Pager};

#[test]
fn every_fault_is_traced_in_order_and_round_trips_through_csv() {
    let dir = TempDir::new("trace");
    let path = dir.path("f.bin");
    pattern_file(&path, 8 << 20);
    let Some(pager) = pager_or_skip(
        Pager::builder()
            .budget(1 << 20)
            .block_size(64 << 10)
            .prefetch(PrefetchKind::None.build())
            .trace(1 << 20),
    ) else {
        return;
    };
    let region = pager.map_file(&path, MapOptions::default()).unwrap();
    for _ in 0..2 {
        for offset in (0..region.len()).step_by(4096) {
            assert_eq!(region.as_slice()[offset], pattern_byte(offset as u64));
        }
    }
    let stats = pager.stats();
    assert_eq!(stats.invariant_breaches, 0, "{stats:?}");
    let (trace, untraced) = pager.take_trace();
    assert_eq!(untraced, 0);
    assert_eq!(trace.len() as u64, stats.faults, "one record per fault");
    // One thread scanning with no prefetch under a small budget: every block is read
    // on demand once per pass, in file order. The kernel may report a fault again when
    // the faulting thread was interrupted while it waited (it faults anew on the way
    // back): such a repeat finds its block resident or being read, right after the
    // fault it repeats.
    let me = hyperoffload::sys::processes::gettid() as u32;
    let demand: Vec<_> = (trace.iter())
        .filter(|record| record.outcome == FaultOutcome::Missing)
        .collect();
    assert_eq!(demand.len(), 2 * 128);
    assert_eq!(stats.demand_faults, 2 * 128);
    for (i, record) in demand.iter().enumerate() {
        assert_eq!(record.block as usize, i % 128);
    }
    for (i, record) in trace.iter().enumerate() {
        assert_eq!(record.file_offset, record.block as u64 * (64 << 10));
        assert_eq!(record.tid, me);
        assert!(record.latency_ns > 0);
        if record.outcome != FaultOutcome::Missing {
            assert!(
                matches!(
                    record.outcome,
                    FaultOutcome::Resident | FaultOutcome::InFlight
                ),
                "{record:?}"
            );
            assert!(i > 0 && trace[i - 1].block == record.block, "{record:?}");
        }
    }
    assert!(trace.len() <= 2 * 128 + 4, "{} faults", trace.len());
    assert!(trace.windows(2).all(|w| w[0].t_ns <= w[1].t_ns));
    let mut writer = TraceWriter::new(Vec::new(), &[("file", path.display().to_string())]).unwrap();
    for record in &trace {
        writer.write(record).unwrap();
    }
    let csv = writer.into_inner().unwrap();
    let reader = TraceReader::new(&csv[..]).unwrap();
    let back: Vec<_> = reader.map(|r| r.unwrap()).collect();
    assert_eq!(back, trace);
    // Taken: the next call starts afresh.
    assert!(pager.take_trace().0.is_empty());
}

/// A recording, as `hyperoffload run --trace` writes it: the fuzzers' seed.
fn recording() -> Vec<u8> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    std::fs::read(root.join("fuzz/seeds/trace_reader/small.csv")).unwrap()
}

/// `hyperoffload trace ARGS` run in `dir`.
fn trace_in(dir: &std::path::Path, args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_hyperoffload"))
        .arg("trace")
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap()
}

#[test]
fn trace_from_the_csv_it_would_write_keeps_the_recording() {
    // `./trace.csv` is the default `--out trace.json`'s CSV under another spelling:
    // copying it onto itself used to truncate it.
    let dir = TempDir::new("trace-from-self");
    let csv = dir.path("trace.csv");
    let absolute = csv.to_str().unwrap().to_string();
    for from in ["./trace.csv", absolute.as_str()] {
        std::fs::write(&csv, recording()).unwrap();
        let output = trace_in(&dir.0, &["--from", from]);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(output.status.success(), "--from {from}: {stderr}");
        assert_eq!(std::fs::read(&csv).unwrap(), recording(), "--from {from}");
        assert!(stderr.contains("4 faults"), "{stderr}");
        let json = std::fs::read_to_string(dir.path("trace.json")).unwrap();
        serde_json::from_str::<serde_json::Value>(&json).unwrap();
    }
}

#[test]
fn trace_refuses_an_out_that_would_write_the_json_over_the_csv() {
    let dir = TempDir::new("trace-out-csv");
    let csv = dir.path("rec.csv");
    std::fs::write(&csv, recording()).unwrap();
    let output = trace_in(&dir.0, &["--from", "rec.csv", "--out", "rec.csv"]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "accepted: {stderr}");
    assert!(stderr.contains("--out rec.json"), "{stderr}");
    assert_eq!(std::fs::read(&csv).unwrap(), recording(), "CSV changed");
    // Nor may the recording be the tensor-named CSV the trace writes.
    let named = dir.path("x.tensors.csv");
    std::fs::write(&named, recording()).unwrap();
    let output = trace_in(&dir.0, &["--from", "x.tensors.csv", "--out", "x.json"]);
    assert!(!output.status.success());
    assert_eq!(
        std::fs::read(&named).unwrap(),
        recording(),
        "recording changed"
    );
    // A .json name writes all three.
    let output = trace_in(&dir.0, &["--from", "rec.csv", "--out", "rec.json"]);
    assert!(output.status.success());
    assert_eq!(std::fs::read(&csv).unwrap(), recording());
    assert!(dir.path("rec.json").is_file() && dir.path("rec.tensors.csv").is_file());
}
