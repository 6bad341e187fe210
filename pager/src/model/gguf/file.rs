//! A parsed GGUF header and what it answers (metadata, tensor infos, each tensor's
//! bytes): what `read` makes and `write` lays out, apart from both.

use super::value::GgufValue;
use crate::model::ggml_type::GgmlType;
use crate::model::tensor::TensorInfo;

/// The four bytes every GGUF file starts with.
pub const MAGIC: &[u8; 4] = b"GGUF";
/// The alignment of tensor data when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// The metadata key that overrides the alignment.
pub const ALIGNMENT_KEY: &str = "general.alignment";

/// One tensor info of a GGUF header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GgufTensor {
    pub name: String,
    /// ggml order: `dims[0]` (`ne[0]`) is the contiguous dimension, the row length.
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Offset of the data from the start of the data section.
    pub offset: u64,
    /// Bytes of data, from the type's block size and the dims.
    pub size: u64,
}

/// A parsed GGUF header, with everything needed to find each tensor's bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufFile {
    pub version: u32,
    /// Key/values in file order.
    pub metadata: Vec<(String, GgufValue)>,
    /// Tensor infos in header order (which ggml requires to be the data order too).
    pub tensors: Vec<GgufTensor>,
    /// Absolute file offset of the data section.
    pub data_offset: u64,
    pub alignment: u64,
    /// Length of the whole file, against which the tensors were bounds-checked.
    pub file_len: u64,
}

impl GgufFile {
    /// The value of a metadata key.
    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.metadata
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, value)| value)
    }

    /// An unsigned integer metadata value.
    pub fn get_u64(&self, key: &str) -> Option<u64> {
        self.get(key).and_then(GgufValue::as_u64)
    }

    /// A string metadata value.
    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.get(key).and_then(GgufValue::as_str)
    }

    /// `general.architecture` (`llama`, `qwen2`, ...).
    pub fn architecture(&self) -> Option<&str> {
        self.get_str("general.architecture")
    }

    /// The tensor info with this name.
    pub fn tensor(&self, name: &str) -> Option<&GgufTensor> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// Absolute file byte range of a tensor's data. The parser checked that it does
    /// not overflow and lies within the file.
    pub fn file_range(&self, tensor: &GgufTensor) -> std::ops::Range<u64> {
        let start = self.data_offset + tensor.offset;
        start..start + tensor.size
    }

    /// The tensor table in header order. Shapes are outermost first (`[rows, row
    /// length]`, as in PyTorch and safetensors), the reverse of ggml's `ne` order.
    pub fn tensor_table(&self) -> Vec<TensorInfo> {
        self.tensors
            .iter()
            .map(|t| TensorInfo {
                name: t.name.clone(),
                dtype: t.ggml_type.name().to_string(),
                shape: t.dims.iter().rev().copied().collect(),
                file_range: self.file_range(t),
            })
            .collect()
    }
}
