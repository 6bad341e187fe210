//! The GGUF writer against the reader: everything written reads back equal.

mod common;

use std::io::Cursor;

use hyperoffload::model::ggml_type::GgmlType;
use hyperoffload::model::gguf::{
    GgufFile, GgufValue, GgufValueType, GgufWriteError, GgufWriter, NewTensor,
};

fn every_value_type() -> Vec<(String, GgufValue)> {
    let entries = vec![
        ("general.architecture", GgufValue::string("llama")),
        ("t.u8", GgufValue::U8(255)),
        ("t.i8", GgufValue::I8(-128)),
        ("t.u16", GgufValue::U16(65535)),
        ("t.i16", GgufValue::I16(-32768)),
        ("t.u32", GgufValue::U32(u32::MAX)),
        ("t.i32", GgufValue::I32(i32::MIN)),
        ("t.f32", GgufValue::F32(-0.125)),
        ("t.bool", GgufValue::Bool(false)),
        ("t.string", GgufValue::string("ünïcödé ✓")),
        // Not UTF-8: kept as bytes, copied verbatim.
        ("t.raw", GgufValue::String(vec![0xff, 0xfe, b'a'])),
        ("t.u64", GgufValue::U64(u64::MAX)),
        ("t.i64", GgufValue::I64(i64::MIN)),
        ("t.f64", GgufValue::F64(std::f64::consts::PI)),
        ("t.strings", GgufValue::strings(["a", "", "ccc"])),
        (
            "t.floats",
            GgufValue::Array {
                elem_type: GgufValueType::F32,
                values: vec![GgufValue::F32(1.0), GgufValue::F32(f32::NAN)],
            },
        ),
        (
            "t.empty",
            GgufValue::Array {
                elem_type: GgufValueType::U64,
                values: vec![],
            },
        ),
        (
            "t.nested",
            GgufValue::Array {
                elem_type: GgufValueType::Array,
                values: vec![
                    GgufValue::strings(["x"]),
                    GgufValue::Array {
                        elem_type: GgufValueType::Bool,
                        values: vec![GgufValue::Bool(true)],
                    },
                ],
            },
        ),
    ];
    entries
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
}

fn tensors() -> Vec<NewTensor> {
    let t = |name: &str, dims: &[u64], ggml_type| NewTensor {
        name: name.to_string(),
        dims: dims.to_vec(),
        ggml_type,
    };
    vec![
        t("token_embd.weight", &[64, 10], GgmlType::Q8_0),
        t("blk.0.attn_norm.weight", &[64], GgmlType::F32),
        t("blk.0.attn_q.weight", &[256, 3], GgmlType::Q4K),
        t("empty", &[0, 5], GgmlType::F16),
        t("blk.0.ffn_down.weight", &[32, 2, 2, 1], GgmlType::Q4_1),
        t("scalar", &[], GgmlType::I32),
    ]
}

/// Writes each tensor's bytes as its index repeated, in pieces of `piece` bytes.
fn write_file(alignment: u64, piece: usize) -> (Vec<u8>, GgufFile) {
    let metadata = every_value_type();
    let mut writer = GgufWriter::new(Vec::new(), &metadata, tensors(), alignment).unwrap();
    let planned = writer.tensors().to_vec();
    let file_len = writer.file_len();
    for (i, t) in planned.iter().enumerate() {
        let data = vec![i as u8 + 1; t.size as usize];
        for chunk in data.chunks(piece) {
            writer.write_data(chunk).unwrap();
        }
    }
    let bytes = writer.finish().unwrap();
    assert_eq!(bytes.len() as u64, file_len);
    let read = GgufFile::parse(&bytes).unwrap();
    assert_eq!(read.tensors, planned);
    (bytes, read)
}

#[test]
fn writes_what_it_reads_back() {
    for (alignment, piece) in [(32, 7), (64, 1000), (4096, 1)] {
        let (bytes, read) = write_file(alignment, piece);
        assert_eq!(read.version, 3);
        assert_eq!(read.alignment, alignment);
        let mut expect = every_value_type();
        if alignment != 32 {
            expect.push(("general.alignment".into(), GgufValue::U32(alignment as u32)));
        }
        // NaN != NaN, so compare the f32 array by bits.
        assert_eq!(format!("{:?}", read.metadata), format!("{expect:?}"));
        assert_eq!(read.data_offset % alignment, 0);
        for (i, t) in read.tensors.iter().enumerate() {
            let range = read.file_range(t);
            assert_eq!(range.start % alignment, 0);
            let data = &bytes[range.start as usize..range.end as usize];
            assert!(data.iter().all(|&b| b == i as u8 + 1), "{} data", t.name);
        }
        // Reading through Read + Seek gives the same (as text: NaN != NaN).
        let again = GgufFile::read_from(Cursor::new(&bytes)).unwrap();
        assert_eq!(format!("{again:?}"), format!("{read:?}"));
    }
}

#[test]
fn writer_refuses_bad_input() {
    let meta = every_value_type();
    let new = |tensors, alignment| GgufWriter::new(Vec::new(), &meta, tensors, alignment).err();
    assert!(matches!(
        new(tensors(), 48),
        Some(GgufWriteError::BadAlignment(48))
    ));
    let mut dup = tensors();
    dup.push(dup[0].clone());
    assert!(matches!(
        new(dup, 32),
        Some(GgufWriteError::DuplicateTensor(_))
    ));
    let mut bad = tensors();
    bad[0].dims = vec![33, 1];
    assert!(matches!(
        new(bad, 32),
        Some(GgufWriteError::BadShape { .. })
    ));

    let mixed = vec![(
        "m".to_string(),
        GgufValue::Array {
            elem_type: GgufValueType::U8,
            values: vec![GgufValue::I8(1)],
        },
    )];
    assert!(matches!(
        GgufWriter::new(Vec::new(), &mixed, vec![], 32).err(),
        Some(GgufWriteError::MixedArray { .. })
    ));

    let mut writer = GgufWriter::new(Vec::new(), &meta, tensors(), 32).unwrap();
    let first = writer.tensors()[0].size as usize;
    assert!(matches!(
        writer.write_data(&vec![0; first + 1]),
        Err(GgufWriteError::TooMuchData { .. })
    ));
    writer.write_data(&vec![0; first - 1]).unwrap();
    assert!(matches!(
        writer.finish(),
        Err(GgufWriteError::Incomplete { .. })
    ));
}

/// SmolLM2 (tools/fetch-model.sh; written by llama.cpp's gguf-py) read and written again
/// with its own metadata, tensors and alignment is the same file byte for byte: the
/// writer lays a real model out as ggml's writer does, and what the reader took from it
/// is all there is. With `$HYPEROFFLOAD_WRITE_SAMPLE` set it also leaves a file of every
/// value type there, for checking with other readers (gguf-py: `python3 -c "import gguf;
/// gguf.GGUFReader(path)"`).
#[test]
fn rewrites_smollm2_byte_for_byte() {
    if let Some(path) = std::env::var_os("HYPEROFFLOAD_WRITE_SAMPLE") {
        std::fs::write(path, write_file(64, 100).0).unwrap();
    }
    let Some(path) = common::test_model() else {
        return;
    };
    let original = std::fs::read(&path).unwrap();
    let model = GgufFile::parse(&original).unwrap();
    assert!(model.tensors.len() > 100, "{} tensors", model.tensors.len());
    let tensors = model
        .tensors
        .iter()
        .map(|t| NewTensor {
            name: t.name.clone(),
            dims: t.dims.clone(),
            ggml_type: t.ggml_type,
        })
        .collect();
    let mut writer = GgufWriter::new(
        Vec::with_capacity(original.len()),
        &model.metadata,
        tensors,
        model.alignment,
    )
    .unwrap();
    assert_eq!(writer.tensors(), model.tensors.as_slice(), "the layout");
    for t in &model.tensors {
        let range = model.file_range(t);
        writer
            .write_data(&original[range.start as usize..range.end as usize])
            .unwrap();
    }
    let rewritten = writer.finish().unwrap();
    assert_eq!(rewritten.len(), original.len());
    if let Some(at) = rewritten.iter().zip(&original).position(|(a, b)| a != b) {
        panic!(
            "the rewritten model differs from {} first at byte {at} (data from {})",
            path.display(),
            model.data_offset
        );
    }
}
