//! Malformed model files: each gives the expected typed error, and none panics.

use hyperoffload::model::ggml_type::GgmlType;
use hyperoffload::model::gguf::{GgufError, GgufFile, GgufValue, GgufWriter, NewTensor};
use hyperoffload::model::safetensors::{SafetensorsError, SafetensorsFile};

/// A GGUF header assembled field by field, so each field can be made wrong.
#[derive(Default)]
struct RawGguf {
    bytes: Vec<u8>,
}

impl RawGguf {
    fn new(version: u32, tensor_count: u64, kv_count: u64) -> Self {
        let mut raw = RawGguf::default();
        raw.bytes.extend_from_slice(b"GGUF");
        raw.u32(version).u64(tensor_count).u64(kv_count);
        raw
    }
    fn u32(&mut self, v: u32) -> &mut Self {
        self.bytes.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.bytes.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn str(&mut self, s: &[u8]) -> &mut Self {
        self.u64(s.len() as u64);
        self.bytes.extend_from_slice(s);
        self
    }
    fn kv_u32(&mut self, key: &str, v: u32) -> &mut Self {
        self.str(key.as_bytes()).u32(4).u32(v)
    }
    fn tensor(&mut self, name: &[u8], dims: &[u64], ggml_type: u32, offset: u64) -> &mut Self {
        self.str(name).u32(dims.len() as u32);
        for &d in dims {
            self.u64(d);
        }
        self.u32(ggml_type).u64(offset)
    }
    /// The header, padded to 32, then `data` zero bytes.
    fn finish(&self, data: usize) -> Vec<u8> {
        let mut out = self.bytes.clone();
        out.resize(out.len().next_multiple_of(32) + data, 0);
        out
    }
}

fn gguf_err(bytes: &[u8]) -> GgufError {
    match GgufFile::parse(bytes) {
        Ok(file) => panic!("parsed a malformed file: {file:?}"),
        Err(e) => {
            // Every error must render a message (no panics in Display either).
            assert!(!e.to_string().is_empty());
            e
        }
    }
}

macro_rules! assert_gguf_err {
    ($bytes:expr, $pattern:pat $(if $guard:expr)?) => {{
        let err = gguf_err(&$bytes);
        assert!(matches!(&err, $pattern $(if $guard)?), "got {err:?}");
    }};
}

/// A valid file with a little of everything, made by the writer.
fn valid_gguf() -> Vec<u8> {
    let metadata = vec![
        (
            "general.architecture".to_string(),
            GgufValue::string("llama"),
        ),
        ("tokens".to_string(), GgufValue::strings(["a", "bb", "ccc"])),
        ("n".to_string(), GgufValue::U32(7)),
    ];
    let tensors = vec![
        NewTensor {
            name: "a".into(),
            dims: vec![32, 2],
            ggml_type: GgmlType::Q4_0,
        },
        NewTensor {
            name: "b".into(),
            dims: vec![5],
            ggml_type: GgmlType::F32,
        },
    ];
    let mut w = GgufWriter::new(Vec::new(), &metadata, tensors, 32).unwrap();
    w.write_data(&[1; 36]).unwrap();
    w.write_data(&[2; 20]).unwrap();
    w.finish().unwrap()
}

#[test]
fn truncated_gguf_at_every_length() {
    let bytes = valid_gguf();
    let file = GgufFile::parse(&bytes).unwrap();
    let header_end = file.data_offset as usize;
    let data_end = file
        .tensor_table()
        .iter()
        .map(|t| t.file_range.end)
        .max()
        .unwrap() as usize;
    // The padding after the last tensor is not needed.
    for n in data_end..bytes.len() {
        assert!(
            GgufFile::parse(&bytes[..n]).is_ok(),
            "cut at {n} in the final padding"
        );
    }
    for n in 0..data_end {
        let err = gguf_err(&bytes[..n]);
        if n < header_end {
            // Counts and lengths are checked against what is left, so a cut header
            // fails on the count or on the read itself; a cut in the padding after
            // the header leaves the tensors out of bounds.
            assert!(
                matches!(
                    err,
                    GgufError::Truncated { .. }
                        | GgufError::CountTooLarge { .. }
                        | GgufError::StringTooLong { .. }
                        | GgufError::OutOfBounds { .. }
                ),
                "cut at {n}: {err:?}"
            );
        } else {
            assert!(
                matches!(err, GgufError::OutOfBounds { .. }),
                "cut at {n}: {err:?}"
            );
        }
    }
    // A prefix with the true file length: only the header is needed.
    for n in 0..header_end {
        if let Err(err) = GgufFile::parse_prefix(&bytes[..n], bytes.len() as u64) {
            assert!(
                matches!(err, GgufError::Truncated { .. }),
                "prefix {n}: {err:?}"
            );
        }
    }
    let prefix = GgufFile::parse_prefix(&bytes[..header_end], bytes.len() as u64);
    assert_eq!(prefix.unwrap(), file);
}

#[test]
fn gguf_header_errors() {
    let mut bad_magic = valid_gguf();
    bad_magic[..4].copy_from_slice(b"GGML");
    assert_gguf_err!(bad_magic, GgufError::BadMagic(m) if m == b"GGML");

    for version in [0, 1, 4, 0x0300_0000] {
        assert_gguf_err!(RawGguf::new(version, 0, 0).finish(0), GgufError::UnsupportedVersion(v) if *v == version);
    }
    // Version 2 is accepted (same layout as 3).
    assert!(GgufFile::parse(&RawGguf::new(2, 0, 0).finish(0)).is_ok());

    assert_gguf_err!(
        RawGguf::new(3, u64::MAX, 0).finish(0),
        GgufError::CountTooLarge { .. }
    );
    assert_gguf_err!(
        RawGguf::new(3, 0, 1 << 40).finish(1000),
        GgufError::CountTooLarge { .. }
    );
    // Plausible against a tiny file only if each entry were under the minimum size.
    assert_gguf_err!(
        RawGguf::new(3, 10, 0).finish(100),
        GgufError::CountTooLarge { .. }
    );

    let mut huge_key = RawGguf::new(3, 0, 1);
    huge_key.u64(u64::MAX);
    assert_gguf_err!(huge_key.finish(64), GgufError::StringTooLong { .. });

    let mut bad_key = RawGguf::new(3, 0, 1);
    bad_key.str(&[b'k', 0xc3, 0x28]).u32(4).u32(1);
    assert_gguf_err!(bad_key.finish(0), GgufError::BadUtf8 { .. });

    let mut bad_type = RawGguf::new(3, 0, 1);
    bad_type.str(b"k").u32(13).u32(1);
    assert_gguf_err!(
        bad_type.finish(0),
        GgufError::UnknownValueType { type_id: 13, .. }
    );

    let mut huge_array = RawGguf::new(3, 0, 1);
    huge_array.str(b"k").u32(9).u32(10).u64(1 << 60);
    assert_gguf_err!(huge_array.finish(4096), GgufError::CountTooLarge { .. });

    let mut deep = RawGguf::new(3, 0, 1);
    deep.str(b"k").u32(9);
    for _ in 0..20 {
        deep.u32(9).u64(1);
    }
    deep.u32(0).u64(0);
    assert_gguf_err!(deep.finish(0), GgufError::NestingTooDeep { .. });

    let mut dup = RawGguf::new(3, 0, 2);
    dup.kv_u32("k", 1).kv_u32("k", 2);
    assert_gguf_err!(dup.finish(0), GgufError::DuplicateKey(k) if k == "k");

    for alignment in [0, 3, 48] {
        let mut bad_align = RawGguf::new(3, 0, 1);
        bad_align.kv_u32("general.alignment", alignment);
        assert_gguf_err!(bad_align.finish(0), GgufError::BadAlignment(_));
    }
    let mut string_align = RawGguf::new(3, 0, 1);
    string_align.str(b"general.alignment").u32(8).str(b"64");
    assert_gguf_err!(string_align.finish(0), GgufError::BadAlignment(_));
}

#[test]
fn gguf_tensor_errors() {
    let one = |name: &[u8], dims: &[u64], ty: u32, offset: u64, data: usize| {
        let mut raw = RawGguf::new(3, 1, 0);
        raw.tensor(name, dims, ty, offset);
        raw.finish(data)
    };
    // The valid baseline: 32 f32 = 128 bytes.
    assert!(GgufFile::parse(&one(b"t", &[32], 0, 0, 128)).is_ok());

    assert_gguf_err!(one(b"t", &[32], 0, 0, 127), GgufError::OutOfBounds { .. });
    assert_gguf_err!(
        one(b"t", &[32], 0, 1 << 40, 128),
        GgufError::OutOfBounds { .. }
    );
    assert_gguf_err!(
        one(b"t", &[32], 0, u64::MAX - 31, 128),
        GgufError::SizeOverflow { .. }
    );
    assert_gguf_err!(
        one(b"t", &[32], 0, 4, 256),
        GgufError::MisalignedOffset { offset: 4, .. }
    );
    assert_gguf_err!(
        one(&[0xff, b't'], &[32], 0, 0, 128),
        GgufError::BadUtf8 { .. }
    );
    assert_gguf_err!(
        one(b"t", &[32], 4, 0, 128),
        GgufError::UnknownGgmlType { type_id: 4, .. }
    );
    assert_gguf_err!(
        one(b"t", &[32], 99, 0, 128),
        GgufError::UnknownGgmlType { .. }
    );
    assert_gguf_err!(
        one(b"t", &[1, 1, 1, 1, 1], 0, 0, 128),
        GgufError::TooManyDims { n_dims: 5, .. }
    );
    assert_gguf_err!(
        one(b"t", &[1 << 40, 1 << 40], 0, 0, 128),
        GgufError::SizeOverflow { .. }
    );
    assert_gguf_err!(
        one(b"t", &[u64::MAX], 0, 0, 128),
        GgufError::DimTooLarge { .. }
    );
    assert_gguf_err!(
        one(b"t", &[33], GgmlType::Q4_0.id(), 0, 128),
        GgufError::NotBlockMultiple { ne0: 33, .. }
    );

    let two = |second_offset: u64, second_name: &[u8]| {
        let mut raw = RawGguf::new(3, 2, 0);
        raw.tensor(b"a", &[32], 0, 0)
            .tensor(second_name, &[32], 0, second_offset);
        raw.finish(512)
    };
    assert!(GgufFile::parse(&two(128, b"b")).is_ok());
    assert_gguf_err!(two(96, b"b"), GgufError::Overlap { .. });
    assert_gguf_err!(two(0, b"b"), GgufError::Overlap { .. });
    assert_gguf_err!(two(128, b"a"), GgufError::DuplicateTensor(n) if n == "a");
}

fn safetensors_bytes(header: &str, data: usize) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.resize(out.len() + data, 0);
    out
}

fn st_err(bytes: &[u8]) -> SafetensorsError {
    match SafetensorsFile::parse(bytes) {
        Ok(file) => panic!("parsed a malformed file: {file:?}"),
        Err(e) => {
            assert!(!e.to_string().is_empty());
            e
        }
    }
}

macro_rules! assert_st_err {
    ($bytes:expr, $pattern:pat $(if $guard:expr)?) => {{
        let err = st_err(&$bytes);
        assert!(matches!(&err, $pattern $(if $guard)?), "got {err:?}");
    }};
}

#[test]
fn safetensors_errors() {
    let ok =
        r#"{"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},"__metadata__":{"k":"v"}}"#;
    let good = safetensors_bytes(ok, 16);
    assert!(SafetensorsFile::parse(&good).is_ok());
    for n in 0..good.len() {
        let err = st_err(&good[..n]);
        assert!(
            matches!(
                err,
                SafetensorsError::Truncated { .. }
                    | SafetensorsError::HeaderPastEnd { .. }
                    | SafetensorsError::OutOfBounds { .. }
            ),
            "cut at {n}: {err:?}"
        );
    }

    let mut huge = u64::MAX.to_le_bytes().to_vec();
    huge.extend_from_slice(b"{}");
    assert_st_err!(huge, SafetensorsError::HeaderTooLarge { .. });
    let mut past = 1000u64.to_le_bytes().to_vec();
    past.extend_from_slice(b"{}");
    assert_st_err!(past, SafetensorsError::HeaderPastEnd { .. });

    let mut bad_utf8 = 3u64.to_le_bytes().to_vec();
    bad_utf8.extend_from_slice(&[b'{', 0xff, b'}']);
    assert_st_err!(bad_utf8, SafetensorsError::BadUtf8);
    assert_st_err!(
        safetensors_bytes("{\"a\":", 0),
        SafetensorsError::BadJson(_)
    );
    assert_st_err!(safetensors_bytes("[1,2]", 0), SafetensorsError::NotAnObject);
    let entry = |e: &str| safetensors_bytes(&format!("{{\"t\":{e}}}"), 64);
    assert_st_err!(
        entry(r#"{"dtype":"F32","shape":[2]}"#),
        SafetensorsError::BadEntry { .. }
    );
    assert_st_err!(
        entry(r#"{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}"#),
        SafetensorsError::BadEntry { .. }
    );
    assert_st_err!(
        entry(r#"{"dtype":"Q4","shape":[2],"data_offsets":[0,8]}"#),
        SafetensorsError::UnknownDtype { .. }
    );
    assert_st_err!(
        entry(r#"{"dtype":"F32","shape":[3],"data_offsets":[0,8]}"#),
        SafetensorsError::SizeMismatch { .. }
    );
    assert_st_err!(
        entry(r#"{"dtype":"F32","shape":[2],"data_offsets":[8,0]}"#),
        SafetensorsError::BackwardOffsets { .. }
    );
    assert_st_err!(
        entry(r#"{"dtype":"F32","shape":[2],"data_offsets":[60,68]}"#),
        SafetensorsError::OutOfBounds { .. }
    );
    assert_st_err!(
        entry(r#"{"dtype":"U8","shape":[4294967296,4294967296,16],"data_offsets":[0,8]}"#),
        SafetensorsError::BadShape { .. }
    );
    assert_st_err!(
        entry(r#"{"dtype":"F4","shape":[3],"data_offsets":[0,2]}"#),
        SafetensorsError::BadShape { .. }
    );
    assert_st_err!(
        safetensors_bytes(r#"{"__metadata__":{"k":1}}"#, 0),
        SafetensorsError::BadMetadata(_)
    );
    let overlap = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},
                      "b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#;
    assert_st_err!(
        safetensors_bytes(overlap, 16),
        SafetensorsError::Overlap { .. }
    );
}

/// Headers at and past the size limit, shapes past the dimension limit, names given
/// twice and text after the object: each refused with its own error. The header is read
/// entry by entry into the tensor table (no JSON tree of it is built), so a header near
/// the limit costs about its own size.
#[test]
fn safetensors_oversized_and_malformed_headers() {
    use hyperoffload::model::safetensors::{MAX_DIMS, MAX_HEADER_LEN};
    let claiming = |len: u64| {
        let mut bytes = len.to_le_bytes().to_vec();
        bytes.extend_from_slice(b"{}");
        SafetensorsFile::parse_prefix(&bytes, u64::MAX).unwrap_err()
    };
    assert!(matches!(
        claiming(MAX_HEADER_LEN + 1),
        SafetensorsError::HeaderTooLarge { len } if len == MAX_HEADER_LEN + 1
    ));
    // At the limit it is read, and the prefix given ends first.
    assert!(matches!(
        claiming(MAX_HEADER_LEN),
        SafetensorsError::Truncated {
            offset: 8,
            what: "the header"
        }
    ));

    let entry = |shape: &str| format!(r#"{{"dtype":"U8","shape":{shape},"data_offsets":[0,1]}}"#);
    let ones = |n: usize| format!("[{}]", vec!["1"; n].join(","));
    let file = SafetensorsFile::parse(&safetensors_bytes(
        &format!(r#"{{"t":{}}}"#, entry(&ones(MAX_DIMS))),
        1,
    ))
    .unwrap();
    assert_eq!(file.tensors[0].shape.len(), MAX_DIMS);
    let error = st_err(&safetensors_bytes(
        &format!(r#"{{"t":{}}}"#, entry(&ones(MAX_DIMS + 1))),
        1,
    ));
    assert!(
        matches!(&error, SafetensorsError::BadEntry { tensor, reason }
            if tensor == "t" && reason.contains("more than 64 dimensions")),
        "{error:?}"
    );

    let twice = format!(r#"{{"a":{},"a":{}}}"#, entry("[1]"), entry("[1]"));
    assert_st_err!(
        safetensors_bytes(&twice, 1),
        SafetensorsError::DuplicateKey(name) if name == "a"
    );
    assert_st_err!(
        safetensors_bytes(r#"{"__metadata__":{},"__metadata__":{}}"#, 0),
        SafetensorsError::DuplicateKey(name) if name == "__metadata__"
    );
    assert_st_err!(
        safetensors_bytes(r#"{"__metadata__":{"k":"v","k":"w"}}"#, 0),
        SafetensorsError::BadMetadata(_)
    );
    assert_st_err!(safetensors_bytes("{} {}", 0), SafetensorsError::BadJson(_));
    assert_st_err!(safetensors_bytes("{}x", 0), SafetensorsError::BadJson(_));
    assert_st_err!(safetensors_bytes("[1,", 0), SafetensorsError::BadJson(_));
    assert_st_err!(safetensors_bytes("", 0), SafetensorsError::BadJson(_));
    for other in ["5", "\"x\"", "null", " [] "] {
        assert_st_err!(safetensors_bytes(other, 0), SafetensorsError::NotAnObject);
    }
    assert_st_err!(
        safetensors_bytes(r#"{"t":5}"#, 0),
        SafetensorsError::BadEntry { tensor, .. } if tensor == "t"
    );
    assert_st_err!(
        safetensors_bytes(r#"{"t":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":1}}"#, 1),
        SafetensorsError::BadEntry { tensor, .. } if tensor == "t"
    );
    // Padding after the object, as writers align the data, is fine.
    assert!(SafetensorsFile::parse(&safetensors_bytes("{}      ", 0)).is_ok());

    // 200 000 tensors (a 15 MB header): read whole, in data order.
    let count = 200_000;
    let mut header = String::from("{");
    for i in (0..count).rev() {
        header.push_str(&format!(
            r#""t{i}":{{"dtype":"U8","shape":[2],"data_offsets":[{},{}]}},"#,
            2 * i,
            2 * i + 2
        ));
    }
    header.pop();
    header.push('}');
    let file = SafetensorsFile::parse(&safetensors_bytes(&header, 2 * count)).unwrap();
    assert_eq!(file.tensors.len(), count);
    assert_eq!(
        file.tensors[count - 1].data_offsets,
        (2 * count as u64 - 2, 2 * count as u64)
    );
}
