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
mod file;
mod read;
mod value;
mod write;

use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::Path;

pub use error::GgufError;
pub use file::{GgufFile, GgufTensor, ALIGNMENT_KEY, DEFAULT_ALIGNMENT, MAGIC};
pub use read::{MAX_ARRAY_LEN, MAX_DIMS, MAX_NESTING, MAX_STRING_LEN};
pub use value::{GgufValue, GgufValueType};
pub use write::{GgufWriteError, GgufWriter, NewTensor};

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
}
