//! Every fuzz target's seed files are taken by what the target fuzzes as what they are
//! meant to be: a seed the decoder refuses by mistake would leave its fuzzer exploring
//! error paths only, and one meant to be refused must be refused for its reason. CI runs
//! each fuzzer for seconds, so the seeds decide what it reaches. Every target has seeds
//! and a check here (`every_fuzz_target_has_seeds_checked_here`).

use std::path::{Path, PathBuf};

use hyperoffload::geometry::GeometryError;
use hyperoffload::model::gguf::GgufFile;
use hyperoffload::model::safetensors::SafetensorsFile;
use hyperoffload::remote::cache_index::{self, IndexError};
use hyperoffload::trace::TraceReader;
use hyperoffload::trace_region::{RegionTrace, RegionTraceError};
use hyperoffload::{keeper, share};

fn seeds(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/seeds")
        .join(target)
}

/// Each seed of `target` by name, sorted.
fn seed_files(target: &str) -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(seeds(target))
        .unwrap()
        .map(|entry| {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read(&path).unwrap())
        })
        .collect();
    files.sort();
    files
}

/// The names of the seeds of `target`, so a seed added or renamed is checked here too.
fn names(files: &[(String, Vec<u8>)]) -> Vec<&str> {
    files.iter().map(|(name, _)| name.as_str()).collect()
}

/// Checks that the seeds of a protocol's fuzz target are exactly `expected` and that each
/// decodes to the message its name says (`kind` names the file a message's seed has).
/// The target reads the first byte as the descriptor count, modulo 4.
fn check_protocol_seeds<M: std::fmt::Debug, E: std::fmt::Debug>(
    target: &str,
    expected: &[&str],
    decode: impl Fn(&[u8], usize) -> Result<M, E>,
    kind: impl Fn(&M) -> &'static str,
) {
    let files = seed_files(target);
    assert_eq!(names(&files), expected);
    for (name, bytes) in &files {
        let (&fds, message) = bytes.split_first().expect("a seed has its descriptor byte");
        let decoded = decode(message, usize::from(fds % 4))
            .unwrap_or_else(|error| panic!("{name}: {error:?}"));
        assert_eq!(kind(&decoded), name, "{decoded:?}");
    }
}

#[test]
fn the_keeper_protocol_seeds_decode_to_their_messages() {
    use keeper::protocol::Message;
    let names = [
        "child.bin",
        "child_gone.bin",
        "region.bin",
        "region_gone.bin",
        "session.bin",
    ];
    check_protocol_seeds(
        "keeper_protocol",
        &names,
        Message::decode,
        |message| match message {
            Message::Session { .. } => "session.bin",
            Message::Region { .. } => "region.bin",
            Message::RegionGone { .. } => "region_gone.bin",
            Message::Child { .. } => "child.bin",
            Message::ChildGone { .. } => "child_gone.bin",
        },
    );
}

#[test]
fn the_share_protocol_seeds_decode_to_their_messages() {
    use share::protocol::Message;
    let names = [
        "attach.bin",
        "attached.bin",
        "fault.bin",
        "poison.bin",
        "ready.bin",
        "refused.bin",
    ];
    check_protocol_seeds(
        "share_protocol",
        &names,
        Message::decode,
        |message| match message {
            Message::Attach { .. } => "attach.bin",
            Message::Attached { .. } => "attached.bin",
            Message::Refused { .. } => "refused.bin",
            Message::Fault { .. } => "fault.bin",
            Message::Ready { .. } => "ready.bin",
            Message::Poison { .. } => "poison.bin",
        },
    );
}

#[test]
fn the_trace_seeds_are_read_and_the_region_seeds_sized_or_refused() {
    let files = seed_files("trace_reader");
    assert_eq!(names(&files), ["offsets.csv", "small.csv"]);
    for (name, bytes) in &files {
        let records: Vec<_> = TraceReader::new(&bytes[..]).unwrap().collect();
        assert!(records.len() >= 3, "{name}: {} records", records.len());
        assert!(records.iter().all(|r| r.is_ok()), "{name}: {records:?}");
    }

    let files = seed_files("trace_region");
    assert_eq!(
        names(&files),
        ["offsets.csv", "size-past-u32-blocks", "small.csv"]
    );
    for (name, bytes) in &files {
        let read = RegionTrace::read(TraceReader::new(&bytes[..]).unwrap());
        match name.as_str() {
            // Traces naming their file's size: 6 MiB in 2 MiB blocks, 1 MiB in 64 KiB.
            "offsets.csv" | "small.csv" => {
                let trace = read.unwrap_or_else(|error| panic!("{name}: {error}"));
                let expected = match name.as_str() {
                    "offsets.csv" => (2 << 20, 6 << 20),
                    _ => (64 << 10, 1 << 20),
                };
                assert_eq!((trace.block_size, trace.data_len), expected, "{name}");
                assert!(!trace.blocks.is_empty(), "{name}");
            }
            // The edge the fuzzer is to explore: a size whose blocks do not fit u32.
            _ => assert!(
                matches!(
                    read,
                    Err(RegionTraceError::TooLarge {
                        source: GeometryError::TooManyBlocks { .. },
                        ..
                    })
                ),
                "{name}: {:?}",
                read.map(|trace| trace.data_len)
            ),
        }
    }
}

#[test]
fn the_cache_index_seeds_decode_or_are_refused_for_their_reason() {
    let files = seed_files("cache_index");
    assert_eq!(
        names(&files),
        ["cut_short.idx", "not_utf8_version.idx", "three_blocks.idx"]
    );
    for (name, bytes) in &files {
        let decoded = cache_index::decode(bytes);
        match name.as_str() {
            "three_blocks.idx" => {
                let (header, _, entries) = decoded.unwrap();
                assert_eq!((header.blocks(), entries.len()), (3, 3));
            }
            // Written before its last blocks were: the entries it has are kept.
            "cut_short.idx" => {
                let (header, _, entries) = decoded.unwrap();
                assert_eq!((header.blocks(), entries.len()), (3, 1));
            }
            _ => assert!(
                matches!(decoded, Err(IndexError::NotUtf8(_))),
                "{name}: {:?}",
                decoded.map(|(_, len, _)| len)
            ),
        }
    }
}

#[test]
fn the_graph_and_model_seeds_parse() {
    assert_eq!(names(&seed_files("learned_graph")), ["small.json"]);
    let graph = std::fs::read_to_string(seeds("learned_graph").join("small.json")).unwrap();
    let saved = hyperoffload::graph::store::decode(&graph, Path::new("small.json")).unwrap();
    assert_eq!(saved.layout.block_size, 65536);

    let files = seed_files("gguf");
    assert_eq!(names(&files), ["python.gguf", "writer.gguf"]);
    for (name, bytes) in &files {
        let model = GgufFile::parse(bytes).unwrap_or_else(|error| panic!("{name}: {error}"));
        assert!(!model.tensors.is_empty(), "{name}");
    }
    let files = seed_files("safetensors");
    assert_eq!(names(&files), ["python.safetensors"]);
    let model = SafetensorsFile::parse(&files[0].1).unwrap();
    assert!(!model.tensors.is_empty());
}

/// The targets checked above, by their file names under fuzz/fuzz_targets.
const CHECKED_TARGETS: [&str; 8] = [
    "cache_index",
    "gguf",
    "keeper_protocol",
    "learned_graph",
    "safetensors",
    "share_protocol",
    "trace_reader",
    "trace_region",
];

#[test]
fn every_fuzz_target_has_seeds_checked_here() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
    let listed = |dir: &str, strip: &str| -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(root.join(dir))
            .unwrap()
            .map(|entry| {
                let name = entry.unwrap().file_name().to_string_lossy().into_owned();
                name.strip_suffix(strip).unwrap_or(&name).to_owned()
            })
            .collect();
        names.sort();
        names
    };
    assert_eq!(listed("fuzz_targets", ".rs"), CHECKED_TARGETS);
    assert_eq!(listed("seeds", ""), CHECKED_TARGETS);
}
