//! The model file readers and writers against real and generated files.

mod common;

use std::collections::HashSet;

use hyperoffload::model::ggml_type::GgmlType;
use hyperoffload::model::gguf::{GgufFile, GgufValue};
use hyperoffload::model::TensorInfo;

/// Checks that no two ranges overlap and all lie within `file_len`.
fn assert_disjoint_in_bounds(table: &[TensorInfo], file_len: u64) {
    let mut ranges: Vec<_> = table
        .iter()
        .map(|t| (t.file_range.clone(), &t.name))
        .collect();
    ranges.sort_by_key(|(r, _)| r.start);
    for (r, name) in &ranges {
        assert!(
            r.start <= r.end && r.end <= file_len,
            "{name} {r:?} past {file_len}"
        );
    }
    for pair in ranges.windows(2) {
        assert!(
            pair[0].0.end <= pair[1].0.start,
            "{} and {} overlap",
            pair[0].1,
            pair[1].1
        );
    }
}

#[test]
fn reads_the_real_smollm2_gguf() {
    let Some(path) = common::test_model() else {
        return;
    };
    let gguf = GgufFile::open(&path).unwrap();
    assert_eq!(gguf.version, 3);
    assert_eq!(gguf.alignment, 32);
    assert_eq!(gguf.architecture(), Some("llama"));
    assert_eq!(gguf.get_u64("llama.block_count"), Some(30));
    assert_eq!(gguf.get_u64("llama.embedding_length"), Some(576));
    let tokens = gguf
        .get("tokenizer.ggml.tokens")
        .and_then(GgufValue::as_array);
    assert_eq!(tokens.map(<[_]>::len), Some(49152));
    // 30 layers of 9 tensors, token_embd and output_norm (the output is tied).
    assert_eq!(gguf.tensors.len(), 272);

    let table = gguf.tensor_table();
    let names: HashSet<_> = table.iter().map(|t| t.name.as_str()).collect();
    for name in [
        "token_embd.weight",
        "blk.0.attn_q.weight",
        "blk.29.ffn_down.weight",
        "output_norm.weight",
    ] {
        assert!(names.contains(name), "missing {name}");
    }
    let embd = table
        .iter()
        .find(|t| t.name == "token_embd.weight")
        .unwrap();
    assert_eq!(embd.dtype, "Q8_0");
    assert_eq!(embd.shape, vec![49152, 576]);
    assert_eq!(embd.file_range.end - embd.file_range.start, 30_081_024);
    let q = gguf.tensor("blk.0.attn_q.weight").unwrap();
    assert_eq!(
        (q.ggml_type, q.dims.as_slice()),
        (GgmlType::Q4_1, &[576u64, 576][..])
    );

    let file_len = std::fs::metadata(&path).unwrap().len();
    assert_eq!(gguf.file_len, file_len);
    assert_disjoint_in_bounds(&table, file_len);
    for t in &table {
        assert_eq!(
            (t.file_range.start - gguf.data_offset) % 32,
            0,
            "{} misaligned",
            t.name
        );
    }

    // The header alone is enough: parse it from a prefix of the file.
    let bytes = std::fs::read(&path).unwrap();
    let prefix = &bytes[..gguf.data_offset as usize];
    assert_eq!(GgufFile::parse_prefix(prefix, file_len).unwrap(), gguf);
    assert_eq!(GgufFile::parse(&bytes).unwrap(), gguf);
}

fn data_path(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}

/// A file written by gguf-py (`tests/data/python.gguf`, made by
/// `gguf.GGUFWriter` 0.17): an independent writer, every scalar type, nested arrays.
#[test]
fn reads_a_gguf_written_by_gguf_py() {
    let gguf = GgufFile::open(&data_path("python.gguf")).unwrap();
    let expect = [
        ("t.u8", GgufValue::U8(200)),
        ("t.i8", GgufValue::I8(-100)),
        ("t.u16", GgufValue::U16(60000)),
        ("t.i16", GgufValue::I16(-30000)),
        ("t.u32", GgufValue::U32(4_000_000_000)),
        ("t.i32", GgufValue::I32(-2_000_000_000)),
        ("t.f32", GgufValue::F32(1.5)),
        ("t.bool", GgufValue::Bool(true)),
        ("t.str", GgufValue::string("héllo")),
        ("t.u64", GgufValue::U64((1 << 63) + 5)),
        ("t.i64", GgufValue::I64(-(1 << 62))),
        ("t.f64", GgufValue::F64(2.25)),
        ("t.arr_str", GgufValue::strings(["a", "bc", ""])),
    ];
    for (key, value) in expect {
        assert_eq!(gguf.get(key), Some(&value), "{key}");
    }
    let nested = gguf.get("t.nested").and_then(GgufValue::as_array).unwrap();
    assert_eq!(nested.len(), 2);
    assert_eq!(nested[1].as_array().map(<[_]>::len), Some(1));

    let table = gguf.tensor_table();
    let ranges: Vec<_> = table
        .iter()
        .map(|t| {
            (
                t.name.as_str(),
                t.dtype.as_str(),
                t.shape.clone(),
                t.file_range.clone(),
            )
        })
        .collect();
    // Offsets and sizes as gguf-py's reader reports them.
    assert_eq!(
        ranges,
        vec![
            ("a.weight", "F32", vec![4, 64], 672..1696),
            ("b.weight", "F16", vec![3, 32], 1696..1888),
            ("c.weight", "Q8_0", vec![2, 32], 1888..1956),
        ]
    );
}
