//! One tensor of a model file, as every format's header gives it: apart from the
//! formats' parsers, which make it, and the model file, which opens either.

use std::ops::Range;

/// One tensor of a model file.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct TensorInfo {
    pub name: String,
    /// The format's type name (`Q4_1`, `F32`, `BF16`, ...).
    pub dtype: String,
    /// Outermost dimension first (`[rows, row length]`), in every format: GGUF's
    /// ggml-order dims are reversed to match.
    pub shape: Vec<u64>,
    /// Absolute byte range of the tensor's data in the file.
    pub file_range: Range<u64>,
}
