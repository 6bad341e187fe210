//! The block-access trace: what the pager records (one row per fault) and the simulator
//! replays.
//!
//! CSV with a header line, one record per row:
//!
//! ```text
//! # file=/models/m.gguf size=536870912 block_size=65536
//! t_ns,tid,region,file_offset,block,block_size,outcome,latency_ns,offset_in_block
//! 1200,4711,0,0,0,65536,missing,25000,8192
//! ```
//!
//! Lines starting with `#` before the header carry `key=value` metadata. `outcome` is
//! one of `missing`, `in_flight`, `staged`, `resident` (the serde names of
//! `FaultOutcome`). `offset_in_block` is where in its block the faulting page lies: which
//! of the experts sharing a block was in use. Traces from before it was recorded have
//! the first eight columns only (`HEADER_V1`) and read back without offsets. The reader
//! streams; a malformed line is an error naming its number.
//!
//! `block` numbers blocks in the region's geometry: the block-size grid, cut at the
//! routed experts' slices where the metadata says `expert_blocks=1` (the shim's
//! default), so a replay must cut the model's blocks the same way.

use std::io::{BufRead, Write};

use thiserror::Error;

use crate::policy::FaultOutcome;

pub const HEADER: &str =
    "t_ns,tid,region,file_offset,block,block_size,outcome,latency_ns,offset_in_block";
/// The metadata key saying the blocks were cut at the experts' slices (`1`).
pub const EXPERT_BLOCKS_KEY: &str = "expert_blocks";

/// The header of traces written before faults kept their offset in the block.
pub const HEADER_V1: &str = "t_ns,tid,region,file_offset,block,block_size,outcome,latency_ns";

/// Where the shim writes its own events (JSON lines) beside a fault trace at `trace`:
/// `<trace>.events.jsonl`. One definition, so whoever clears old traces finds it.
pub fn events_path(trace: &std::path::Path) -> std::path::PathBuf {
    let mut name = trace.as_os_str().to_owned();
    name.push(".events.jsonl");
    name.into()
}

/// The file each region presents, by region id, from the shim's event log
/// (`events_path`): its `map` events name the region and the file's path. A log from
/// before they did names none.
pub fn region_files(events: &str) -> std::collections::HashMap<u32, std::path::PathBuf> {
    events
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|event| event["op"] == "map")
        .filter_map(|event| {
            let region = u32::try_from(event["region"].as_u64()?).ok()?;
            Some((region, event["path"].as_str()?.into()))
        })
        .collect()
}

/// One fault.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct TraceRecord {
    pub t_ns: u64,
    pub tid: u32,
    pub region: u32,
    /// File offset of the block's first byte.
    pub file_offset: u64,
    pub block: u32,
    pub block_size: u64,
    pub outcome: FaultOutcome,
    /// Fault to wake-up.
    pub latency_ns: u64,
    /// Where in the block the faulting page lies; `None` in a trace from before this
    /// was recorded.
    pub offset_in_block: Option<u32>,
}

impl TraceRecord {
    /// The file offset of the faulting page (of the block's first byte where the trace
    /// does not say).
    pub fn fault_file_offset(&self) -> u64 {
        self.file_offset + self.offset_in_block.map_or(0, u64::from)
    }
}

#[derive(Debug, Error)]
pub enum TraceError {
    #[error("trace line {line}: {source}")]
    Io {
        line: u64,
        #[source]
        source: std::io::Error,
    },
    #[error("trace line {line}: expected the header `{HEADER}`")]
    MissingHeader { line: u64 },
    #[error("trace line {line}: expected {expected} fields, found {found}")]
    FieldCount {
        line: u64,
        expected: usize,
        found: usize,
    },
    #[error("trace line {line}: field `{field}`: `{value}` is not a valid value")]
    BadField {
        line: u64,
        field: &'static str,
        value: String,
    },
}

fn outcome_name(outcome: FaultOutcome) -> &'static str {
    match outcome {
        FaultOutcome::Missing => "missing",
        FaultOutcome::InFlight => "in_flight",
        FaultOutcome::Staged => "staged",
        FaultOutcome::Resident => "resident",
    }
}

fn parse_outcome(text: &str) -> Option<FaultOutcome> {
    Some(match text {
        "missing" => FaultOutcome::Missing,
        "in_flight" => FaultOutcome::InFlight,
        "staged" => FaultOutcome::Staged,
        "resident" => FaultOutcome::Resident,
        _ => return None,
    })
}

/// Writes a trace: metadata comments, the header, then records.
pub struct TraceWriter<W: Write> {
    out: W,
}

impl<W: Write> TraceWriter<W> {
    /// Starts a trace; `metadata` pairs become one `# key=value ...` line (values must
    /// not contain spaces or newlines to read back as pairs).
    pub fn new(mut out: W, metadata: &[(&str, String)]) -> std::io::Result<Self> {
        if !metadata.is_empty() {
            let pairs: Vec<String> = metadata.iter().map(|(k, v)| format!("{k}={v}")).collect();
            writeln!(out, "# {}", pairs.join(" "))?;
        }
        writeln!(out, "{HEADER}")?;
        Ok(Self { out })
    }

    pub fn write(&mut self, r: &TraceRecord) -> std::io::Result<()> {
        // A record without an offset is written at the block's start.
        writeln!(
            self.out,
            "{},{},{},{},{},{},{},{},{}",
            r.t_ns,
            r.tid,
            r.region,
            r.file_offset,
            r.block,
            r.block_size,
            outcome_name(r.outcome),
            r.latency_ns,
            r.offset_in_block.unwrap_or(0)
        )
    }

    pub fn into_inner(mut self) -> std::io::Result<W> {
        self.out.flush()?;
        Ok(self.out)
    }
}

/// Reads a trace record by record.
pub struct TraceReader<R: BufRead> {
    input: R,
    line: u64,
    metadata: Vec<(String, String)>,
    buffer: String,
    /// Fields per record: 9, or 8 in a trace with `HEADER_V1`.
    fields: usize,
}

impl<R: BufRead> TraceReader<R> {
    /// Reads the metadata and the header.
    pub fn new(input: R) -> Result<Self, TraceError> {
        let mut reader = Self {
            input,
            line: 0,
            metadata: Vec::new(),
            buffer: String::new(),
            fields: 9,
        };
        loop {
            if !reader.next_line()? {
                return Err(TraceError::MissingHeader { line: reader.line });
            }
            let text = reader.buffer.trim_end();
            if let Some(comment) = text.strip_prefix('#') {
                let pairs = comment
                    .split_whitespace()
                    .filter_map(|pair| pair.split_once('='));
                reader
                    .metadata
                    .extend(pairs.map(|(k, v)| (k.to_string(), v.to_string())));
            } else if text == HEADER {
                return Ok(reader);
            } else if text == HEADER_V1 {
                reader.fields = 8;
                return Ok(reader);
            } else {
                return Err(TraceError::MissingHeader { line: reader.line });
            }
        }
    }

    /// `key=value` pairs from the comment lines before the header.
    pub fn metadata(&self) -> &[(String, String)] {
        &self.metadata
    }

    pub fn metadata_value(&self, key: &str) -> Option<&str> {
        self.metadata
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// The number of the line read last (from 1, the metadata and header included):
    /// after `next`, the line of the record it gave.
    pub fn line(&self) -> u64 {
        self.line
    }

    fn next_line(&mut self) -> Result<bool, TraceError> {
        self.buffer.clear();
        self.line += 1;
        let read = self
            .input
            .read_line(&mut self.buffer)
            .map_err(|source| TraceError::Io {
                line: self.line,
                source,
            })?;
        Ok(read > 0)
    }

    fn parse(&self) -> Result<TraceRecord, TraceError> {
        let line = self.line;
        let fields: Vec<&str> = self.buffer.trim_end().split(',').collect();
        if fields.len() != self.fields {
            return Err(TraceError::FieldCount {
                line,
                expected: self.fields,
                found: fields.len(),
            });
        }
        fn number<T: std::str::FromStr>(
            line: u64,
            field: &'static str,
            text: &str,
        ) -> Result<T, TraceError> {
            text.trim().parse().map_err(|_| TraceError::BadField {
                line,
                field,
                value: text.to_string(),
            })
        }
        Ok(TraceRecord {
            t_ns: number(line, "t_ns", fields[0])?,
            tid: number(line, "tid", fields[1])?,
            region: number(line, "region", fields[2])?,
            file_offset: number(line, "file_offset", fields[3])?,
            block: number(line, "block", fields[4])?,
            block_size: number(line, "block_size", fields[5])?,
            outcome: parse_outcome(fields[6].trim()).ok_or_else(|| TraceError::BadField {
                line,
                field: "outcome",
                value: fields[6].to_string(),
            })?,
            latency_ns: number(line, "latency_ns", fields[7])?,
            offset_in_block: fields
                .get(8)
                .map(|text| number(line, "offset_in_block", text))
                .transpose()?,
        })
    }
}

impl<R: BufRead> Iterator for TraceReader<R> {
    type Item = Result<TraceRecord, TraceError>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            match self.next_line() {
                Err(e) => return Some(Err(e)),
                Ok(false) => return None,
                // Blank lines (a trailing newline, say) carry nothing.
                Ok(true) if self.buffer.trim().is_empty() => continue,
                Ok(true) => return Some(self.parse()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_event_log_names_each_region_s_file() {
        let events = r#"{"op":"map","file":0,"region":0,"path":"/m/a-00001-of-00002.gguf","offset":0}
{"op":"unmap","file":0,"start":0,"end":4096}
{"op":"map","file":1,"region":2,"path":"/m/a-00002-of-00002.gguf","offset":0}
{"op":"map","file":1,"offset":0}
not json
"#;
        let files = region_files(events);
        assert_eq!(files.len(), 2);
        assert_eq!(files[&0], std::path::Path::new("/m/a-00001-of-00002.gguf"));
        assert_eq!(files[&2], std::path::Path::new("/m/a-00002-of-00002.gguf"));
    }

    #[test]
    fn the_events_file_is_named_after_the_whole_trace_name() {
        assert_eq!(
            events_path(std::path::Path::new("/d/t.csv")),
            std::path::Path::new("/d/t.csv.events.jsonl")
        );
    }

    fn record(block: u32, outcome: FaultOutcome) -> TraceRecord {
        TraceRecord {
            t_ns: 1000 + block as u64,
            tid: 7,
            region: 0,
            file_offset: block as u64 * 65536,
            block,
            block_size: 65536,
            outcome,
            latency_ns: 25_000,
            offset_in_block: Some(4096 * block),
        }
    }

    #[test]
    fn writes_and_reads_back_with_metadata() {
        let records = [
            record(0, FaultOutcome::Missing),
            record(1, FaultOutcome::InFlight),
            record(2, FaultOutcome::Staged),
            record(3, FaultOutcome::Resident),
        ];
        let mut writer = TraceWriter::new(
            Vec::new(),
            &[("file", "/m.gguf".into()), ("block_size", "65536".into())],
        )
        .unwrap();
        for r in &records {
            writer.write(r).unwrap();
        }
        let bytes = writer.into_inner().unwrap();
        let reader = TraceReader::new(bytes.as_slice()).unwrap();
        assert_eq!(reader.metadata_value("block_size"), Some("65536"));
        assert_eq!(reader.metadata_value("file"), Some("/m.gguf"));
        let read: Vec<TraceRecord> = reader.map(|r| r.unwrap()).collect();
        assert_eq!(read, records);
    }

    #[test]
    fn outcome_names_match_the_serde_names() {
        for outcome in [
            FaultOutcome::Missing,
            FaultOutcome::InFlight,
            FaultOutcome::Staged,
            FaultOutcome::Resident,
        ] {
            let serde = serde_json::to_string(&outcome).unwrap();
            assert_eq!(serde, format!("\"{}\"", outcome_name(outcome)));
        }
    }

    #[test]
    fn malformed_lines_are_errors_with_their_line_number() {
        assert!(matches!(
            TraceReader::new(&b""[..]),
            Err(TraceError::MissingHeader { line: 1 })
        ));
        assert!(matches!(
            TraceReader::new(&b"# a=b\nt_ns,tid\n"[..]),
            Err(TraceError::MissingHeader { line: 2 })
        ));
        let text = format!("# x=1\n{HEADER_V1}\n1,2,0,0,0,4096,missing,9\n\n1,2,0\n1,2,0,0,0,4096,gone,9\n1,2,0,0,-1,4096,missing,9\n");
        let results: Vec<_> = TraceReader::new(text.as_bytes()).unwrap().collect();
        assert!(results[0].is_ok());
        assert!(matches!(
            results[1],
            Err(TraceError::FieldCount {
                line: 5,
                expected: 8,
                found: 3
            })
        ));
        assert!(matches!(
            &results[2],
            Err(TraceError::BadField {
                line: 6,
                field: "outcome",
                ..
            })
        ));
        assert!(matches!(
            &results[3],
            Err(TraceError::BadField {
                line: 7,
                field: "block",
                ..
            })
        ));
        assert_eq!(results.len(), 4);
        assert_eq!(results[0].as_ref().unwrap().offset_in_block, None);
        let text = format!("{HEADER}\n1,2,0,0,0,4096,missing,9,512\n1,2,0,0,0,4096,missing,9\n");
        let results: Vec<_> = TraceReader::new(text.as_bytes()).unwrap().collect();
        assert_eq!(results[0].as_ref().unwrap().offset_in_block, Some(512));
        assert!(matches!(
            results[1],
            Err(TraceError::FieldCount {
                expected: 9,
                found: 8,
                ..
            })
        ));
    }
}
