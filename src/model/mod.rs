//! Model file formats: the tensor table of a model file, in file byte ranges.

pub mod ggml_type;
pub mod gguf;

use std::ops::Range;

/// One tensor of a model file.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct TensorInfo {
    pub name: String,
    /// The format's type name (`Q4_1`, `F32`, `BF16`, ...).
    pub dtype: String,
    pub shape: Vec<u64>,
    /// Absolute byte range of the tensor's data in the file.
    pub file_range: Range<u64>,
}
