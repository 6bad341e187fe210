//! The safetensors header reader against files written by the Rust crate and Python.

use std::collections::HashMap;

use hyperoffload::model::safetensors::SafetensorsFile;
use hyperoffload::model::{ModelFile, ModelFormat};
use safetensors::tensor::{Dtype, SafeTensors, TensorView};

fn data_path(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}

#[test]
fn reads_a_file_written_by_the_safetensors_crate() {
    let a: Vec<u8> = (0..4 * 6 * 4).map(|i| i as u8).collect();
    let b = vec![1u8; 10 * 2];
    let c = vec![2u8; 3 * 8];
    let views = vec![
        (
            "zeta.weight",
            TensorView::new(Dtype::F32, vec![4, 6], &a).unwrap(),
        ),
        (
            "alpha.bias",
            TensorView::new(Dtype::BF16, vec![10], &b).unwrap(),
        ),
        ("mid.ids", TensorView::new(Dtype::I64, vec![3], &c).unwrap()),
    ];
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    let bytes = safetensors::tensor::serialize(views, &Some(meta)).unwrap();

    let file = SafetensorsFile::parse(&bytes).unwrap();
    assert_eq!(file.metadata.get("format").map(String::as_str), Some("pt"));
    let reference = SafeTensors::deserialize(&bytes).unwrap();
    let table = file.tensor_table();
    assert_eq!(table.len(), 3);
    for t in &table {
        let view = reference.tensor(&t.name).unwrap();
        let start = view.data().as_ptr() as u64 - bytes.as_ptr() as u64;
        assert_eq!(
            t.file_range,
            start..start + view.data().len() as u64,
            "{}",
            t.name
        );
        let shape: Vec<u64> = view.shape().iter().map(|&d| d as u64).collect();
        assert_eq!(t.shape, shape);
        assert_eq!(t.dtype, format!("{:?}", view.dtype()));
    }
    // Data order, not name order.
    let mut sorted = table.clone();
    sorted.sort_by_key(|t| t.file_range.start);
    assert_eq!(sorted, table);

    // The header alone suffices.
    let header_end = file.data_offset() as usize;
    let from_prefix = SafetensorsFile::parse_prefix(&bytes[..header_end], bytes.len() as u64);
    assert_eq!(from_prefix.unwrap(), file);
}

/// `tests/data/python.safetensors`: written by Python safetensors 0.8 (numpy), with
/// a scalar, an empty tensor and `__metadata__`.
#[test]
fn reads_a_file_written_by_python() {
    let model = ModelFile::open(data_path("python.safetensors")).unwrap();
    let ModelFormat::Safetensors(file) = &model.format else {
        panic!("detected as {}", model.format.name());
    };
    assert_eq!(file.header_len, 640);
    assert_eq!(file.metadata.get("format").map(String::as_str), Some("np"));
    let base = 8 + 640;
    let get = |name: &str| model.tensors.iter().find(|t| t.name == name).unwrap();
    let embed = get("model.embed_tokens.weight");
    assert_eq!(
        (embed.dtype.as_str(), embed.shape.as_slice()),
        ("F16", &[12u64, 8][..])
    );
    assert_eq!(embed.file_range, base + 608..base + 800);
    assert_eq!(get("ids").file_range, base..base + 40);
    assert_eq!(get("scalar").shape, Vec::<u64>::new());
    assert_eq!(get("scalar").file_range, base + 800..base + 801);
    assert_eq!(get("empty").file_range, base + 801..base + 801);
    assert_eq!(get("mask").file_range, base + 801..base + 804);
    assert_eq!(model.tensors.len(), 8);
    assert_eq!(model.file_len, 1452);
}
