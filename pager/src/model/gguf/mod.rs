//! GGUF, llama.cpp's model format (versions 2 and 3): a little-endian header of
//! metadata key/values and tensor infos, then the tensor data, each tensor at an offset
//! (relative to the data section) aligned to `general.alignment`.
//!
//! ```text
//! "GGUF" | version u32 | tensor_count u64 | kv_count u64
//! kv_count x   { key: string, type: u32, value }
//! tensor_count x { name: string, n_dims: u32, dims: u64 x n_dims, type: u32, offset: u64 }
//! padding to the alignment | data section (tensors at data_offset + offset)
//! string = { len: u64, bytes }
//! ```

mod error;
mod read;
mod value;
mod write;

use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::Path;

pub use error::GgufError;
pub use read::{MAX_ARRAY_LEN, MAX_DIMS, MAX_NESTING, MAX_STRING_LEN};
pub use value::{GgufValue, GgufValueType};
pub use write::{GgufWriteError, GgufWriter, NewTensor};

use super::ggml_type::GgmlType;
use super::TensorInfo;

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
    /// Reads the header of a GGUF file from disk, without reading the tensor data.
    pub fn open(path: &Path) -> Result<GgufFile, GgufError> {
        Self::read_from(File::open(path)?)
    }

    /// Reads the header from a seekable source (its length is the file length). Only
    /// the header is read, through a buffer: a model of any size costs its header.
    pub fn read_from<R: Read + Seek>(mut source: R) -> Result<GgufFile, GgufError> {
        let file_len = source.seek(SeekFrom::End(0))?;
        source.seek(SeekFrom::Start(0))?;
        read::parse(BufReader::with_capacity(1 << 20, source), file_len)
    }

    /// Parses a whole file held in memory.
    pub fn parse(bytes: &[u8]) -> Result<GgufFile, GgufError> {
        read::parse(bytes, bytes.len() as u64)
    }

    /// Parses the header from the first bytes of a file of `file_len` bytes. If the
    /// prefix is too short, the error is `Truncated` with an offset at the prefix's
    /// end: read more and try again.
    pub fn parse_prefix(prefix: &[u8], file_len: u64) -> Result<GgufFile, GgufError> {
        read::parse(prefix, file_len)
    }

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
