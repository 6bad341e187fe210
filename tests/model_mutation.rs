//! Randomized mutation of valid model files: thousands of broken variants, each of
//! which must parse or fail with an error, never panic. A bounded, deterministic
//! complement to the cargo-fuzz targets (tools/fuzz.sh) that runs in every test pass.

mod common;

use std::panic::{catch_unwind, AssertUnwindSafe};

use hyperoffload::model::gguf::GgufFile;
use hyperoffload::model::safetensors::SafetensorsFile;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const INTERESTING: [u64; 8] = [0, 1, 3, 31, 1 << 32, 1 << 40, u64::MAX, u64::MAX / 2];

/// One random corruption of `bytes`, mostly within `hot` (the structural part).
fn mutate(bytes: &[u8], hot: std::ops::Range<usize>, rng: &mut SmallRng) -> Vec<u8> {
    let mut out = bytes.to_vec();
    let pick = |rng: &mut SmallRng, len: usize| {
        if rng.gen_bool(0.7) && hot.end > hot.start && hot.end <= len {
            rng.gen_range(hot.clone())
        } else {
            rng.gen_range(0..len.max(1))
        }
    };
    for _ in 0..rng.gen_range(1..=4) {
        if out.is_empty() {
            break;
        }
        let at = pick(rng, out.len());
        match rng.gen_range(0..6) {
            0 => out[at] ^= 1 << rng.gen_range(0..8),
            1 => out[at] = rng.gen(),
            2 => {
                let v = INTERESTING[rng.gen_range(0..INTERESTING.len())].to_le_bytes();
                let n = if rng.gen() { 8 } else { 4 };
                let end = (at + n).min(out.len());
                out[at..end].copy_from_slice(&v[..end - at]);
            }
            3 => out.truncate(at),
            4 => {
                let n = rng.gen_range(1..16).min(out.len() - at);
                out.drain(at..at + n);
            }
            _ => {
                let junk: Vec<u8> = (0..rng.gen_range(1..16)).map(|_| rng.gen()).collect();
                out.splice(at..at, junk);
            }
        }
    }
    out
}

/// Parses `cases` mutations of `bytes`; `parse` says whether it accepted one (and checks
/// what it accepted). Fails on a panic, and unless some mutations were accepted and some
/// refused: all of one kind would mean the mutations never reached the parser's checks
/// (all refused at the magic, say) or the checks refuse nothing.
fn run(
    name: &str,
    bytes: &[u8],
    hot: std::ops::Range<usize>,
    cases: u64,
    parse: impl Fn(&[u8]) -> bool,
) {
    let mut rng = SmallRng::seed_from_u64(0x5eed);
    let (mut accepted, mut refused) = (0u64, 0u64);
    for case in 0..cases {
        let input = mutate(bytes, hot.clone(), &mut rng);
        let outcome = catch_unwind(AssertUnwindSafe(|| parse(&input)));
        match outcome {
            Ok(true) => accepted += 1,
            Ok(false) => refused += 1,
            Err(_) => panic!("{name}: case {case} panicked ({} bytes)", input.len()),
        }
    }
    eprintln!("{name}: {accepted} mutations accepted, {refused} refused");
    assert!(
        accepted > 0 && refused > 0,
        "{name}: {accepted} mutations accepted, {refused} refused"
    );
}

fn data(name: &str) -> Vec<u8> {
    std::fs::read(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/data")
            .join(name),
    )
    .unwrap()
}

/// Whether `bytes` parse as GGUF; what parses has every tensor within the file.
fn parse_gguf(bytes: &[u8]) -> bool {
    parse_gguf_prefix(bytes, bytes.len() as u64)
}

/// Whether `prefix` parses as the header of a GGUF file of `file_len` bytes; what
/// parses has every tensor within the file, in order, none overlapping.
fn parse_gguf_prefix(prefix: &[u8], file_len: u64) -> bool {
    let Ok(file) = GgufFile::parse_prefix(prefix, file_len) else {
        return false;
    };
    let mut end = 0;
    let mut table = file.tensor_table();
    table.sort_by_key(|t| t.file_range.start);
    for t in table {
        assert!(t.file_range.start >= file.data_offset, "{}", t.name);
        assert!(t.file_range.start <= t.file_range.end, "{}", t.name);
        assert!(t.file_range.end <= file_len, "{}", t.name);
        assert!(
            t.file_range.start >= end || t.file_range.is_empty(),
            "{}",
            t.name
        );
        end = end.max(t.file_range.end);
    }
    true
}

/// Whether `bytes` parse as safetensors; what parses has every tensor within the file.
fn parse_safetensors(bytes: &[u8]) -> bool {
    let Ok(file) = SafetensorsFile::parse(bytes) else {
        return false;
    };
    let mut end = 0;
    for t in file.tensor_table() {
        assert!(t.file_range.start >= file.data_offset(), "{}", t.name);
        assert!(t.file_range.start <= t.file_range.end, "{}", t.name);
        assert!(t.file_range.end <= bytes.len() as u64, "{}", t.name);
        assert!(
            t.file_range.start >= end || t.file_range.is_empty(),
            "{}",
            t.name
        );
        end = end.max(t.file_range.end);
    }
    true
}

#[test]
fn mutated_small_files_never_panic() {
    let gguf = data("python.gguf");
    let header = GgufFile::parse(&gguf).unwrap().data_offset as usize;
    run("python.gguf", &gguf, 0..header, 5000, parse_gguf);
    let st = data("python.safetensors");
    run(
        "python.safetensors",
        &st,
        0..st.len().min(700),
        5000,
        parse_safetensors,
    );
}

#[test]
fn mutated_real_header_never_panics() {
    let Some(path) = common::test_model() else {
        return;
    };
    let file = GgufFile::open(&path).unwrap();
    // The header and the first bytes of data: enough for every check to run.
    let mut bytes = std::fs::read(&path).unwrap();
    bytes.truncate(file.data_offset as usize + 4096);
    // The tensor infos sit at the end of the header; mutate there mostly.
    let hot = (file.data_offset as usize).saturating_sub(16 << 10)..file.data_offset as usize;
    run("SmolLM2 header", &bytes, hot, 100, |b| {
        parse_gguf_prefix(b, file.file_len)
    });
}
