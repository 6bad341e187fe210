//! What can be wrong with a GGUF file.

use std::io;

use thiserror::Error;

/// A GGUF file that could not be read, and why. Every way a malformed file can fail
/// ends here; the reader never panics and never allocates more than the file could
/// hold.
#[derive(Debug, Error)]
pub enum GgufError {
    #[error("I/O error: {0}")]
    Io(#[from] io::Error),
    #[error("the input ends at byte {offset} while reading {what}")]
    Truncated { offset: u64, what: String },
    #[error("not a GGUF file: the magic is {0:02x?}, expected \"GGUF\"")]
    BadMagic([u8; 4]),
    #[error("unsupported GGUF version {0} (this reader knows 2 and 3; a big-endian file shows a byte-swapped version)")]
    UnsupportedVersion(u32),
    #[error("{what}: count {count} at byte {offset} is impossible, only {remaining} bytes remain in the file")]
    CountTooLarge {
        what: String,
        count: u64,
        offset: u64,
        remaining: u64,
    },
    #[error("{what}: string length {len} at byte {offset} is impossible (limit {limit} bytes)")]
    StringTooLong {
        what: String,
        len: u64,
        offset: u64,
        limit: u64,
    },
    #[error("{what} at byte {offset} is not valid UTF-8")]
    BadUtf8 { what: String, offset: u64 },
    #[error("metadata key {key:?}: unknown value type {type_id} at byte {offset}")]
    UnknownValueType {
        key: String,
        type_id: u32,
        offset: u64,
    },
    #[error("metadata key {key:?}: arrays nested deeper than {max} levels")]
    NestingTooDeep { key: String, max: usize },
    #[error("metadata key {0:?} appears twice")]
    DuplicateKey(String),
    #[error("tensor {0:?} appears twice")]
    DuplicateTensor(String),
    #[error("tensor {tensor:?} has {n_dims} dimensions, ggml allows at most {max}")]
    TooManyDims {
        tensor: String,
        n_dims: u32,
        max: u32,
    },
    #[error("tensor {tensor:?}: dimension {dim} exceeds ggml's int64 range")]
    DimTooLarge { tensor: String, dim: u64 },
    #[error("tensor {tensor:?}: unknown ggml type id {type_id}")]
    UnknownGgmlType { tensor: String, type_id: u32 },
    #[error("tensor {tensor:?}: first dimension {ne0} is not a multiple of the {ggml_type} block size {block_size}")]
    NotBlockMultiple {
        tensor: String,
        ggml_type: String,
        ne0: u64,
        block_size: u64,
    },
    #[error("tensor {tensor:?}: its size or position overflows 64 bits")]
    SizeOverflow { tensor: String },
    #[error("general.alignment is {0}, not a non-zero power of two held in an unsigned integer")]
    BadAlignment(String),
    #[error("tensor {tensor:?}: offset {offset} is not a multiple of the alignment {alignment}")]
    MisalignedOffset {
        tensor: String,
        offset: u64,
        alignment: u64,
    },
    #[error(
        "tensor {tensor:?}: bytes {start}..{end} lie past the end of the file ({file_len} bytes)"
    )]
    OutOfBounds {
        tensor: String,
        start: u64,
        end: u64,
        file_len: u64,
    },
    #[error("tensors {first:?} and {second:?} overlap in the file")]
    Overlap { first: String, second: String },
}
