//! Model file formats: the tensor table of a model file, in file byte ranges.

pub mod ggml_type;
pub mod gguf;
pub mod safetensors;
pub mod split;
pub mod synth;
mod tensor;

use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use thiserror::Error;

use gguf::{GgufError, GgufFile};
use safetensors::{SafetensorsError, SafetensorsFile};
pub use tensor::TensorInfo;

/// The parsed header of a model file, by format.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelFormat {
    Gguf(GgufFile),
    Safetensors(SafetensorsFile),
}

impl ModelFormat {
    /// The format's name.
    pub fn name(&self) -> &'static str {
        match self {
            ModelFormat::Gguf(_) => "gguf",
            ModelFormat::Safetensors(_) => "safetensors",
        }
    }
}

/// A model file whose header has been read: its tensor table and format details.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelFile {
    pub path: PathBuf,
    pub file_len: u64,
    /// The tensors in the format's header order, with absolute byte ranges.
    pub tensors: Vec<TensorInfo>,
    pub format: ModelFormat,
}

/// Why a model file could not be opened.
#[derive(Debug, Error)]
#[error("{}: {kind}", path.display())]
pub struct ModelError {
    pub path: PathBuf,
    pub kind: ModelErrorKind,
}

/// What went wrong with a model file.
#[derive(Debug, Error)]
pub enum ModelErrorKind {
    #[error("{0}")]
    Io(#[from] io::Error),
    #[error("not a model file this program knows (GGUF or safetensors); it starts with {0:02x?}")]
    UnknownFormat(Vec<u8>),
    #[error("bad GGUF: {0}")]
    Gguf(#[from] GgufError),
    #[error("bad safetensors: {0}")]
    Safetensors(#[from] SafetensorsError),
}

/// Bytes `has_model_header` looks at.
pub const MODEL_HEADER_LEN: usize = 9;

/// Whether a file starting with `start` (its first `MODEL_HEADER_LEN` bytes) is a model
/// this crate reads: GGUF's magic, or a safetensors header (a little-endian length of
/// at most 100 MiB, then the JSON's `{`), as `ModelFile::open` tells them apart.
pub fn has_model_header(start: &[u8]) -> bool {
    if start.starts_with(gguf::MAGIC) {
        return true;
    }
    match (start.get(..8), start.get(8)) {
        (Some(length), Some(b'{')) => {
            let length = u64::from_le_bytes(length.try_into().expect("8 bytes"));
            (2..=100 << 20).contains(&length)
        }
        _ => false,
    }
}

impl ModelFile {
    /// Reads the header of a GGUF or safetensors file (told apart by the GGUF magic,
    /// else by the `.safetensors` extension or a header that opens with `{`). Only the
    /// header is read, whatever the size of the file.
    pub fn open(path: impl AsRef<Path>) -> Result<ModelFile, ModelError> {
        let path = path.as_ref();
        Self::open_inner(path).map_err(|kind| ModelError {
            path: path.to_path_buf(),
            kind,
        })
    }

    /// How many experts a token runs per layer, for a mixture-of-experts model whose
    /// metadata says (GGUF `{arch}.expert_used_count`); `None` otherwise.
    pub fn experts_used(&self) -> Option<u32> {
        let ModelFormat::Gguf(gguf) = &self.format else {
            return None;
        };
        let arch = gguf.architecture()?;
        let used = gguf.get_u64(&format!("{arch}.expert_used_count"))?;
        u32::try_from(used).ok().filter(|&used| used > 0)
    }

    /// The GGUF `general.architecture` (`llama`, `qwen3moe`, `gpt-oss`...); `None` for
    /// safetensors, which does not say.
    pub fn architecture(&self) -> Option<&str> {
        match &self.format {
            ModelFormat::Gguf(gguf) => gguf.architecture(),
            ModelFormat::Safetensors(_) => None,
        }
    }

    /// Shared experts per layer (`<arch>.expert_shared_count`: DeepSeek's and GLM's
    /// `ffn_*_shexp`, which every token runs), when the file says.
    pub fn shared_experts(&self) -> Option<u32> {
        let ModelFormat::Gguf(gguf) = &self.format else {
            return None;
        };
        let arch = gguf.architecture()?;
        let shared = gguf.get_u64(&format!("{arch}.expert_shared_count"))?;
        u32::try_from(shared).ok().filter(|&shared| shared > 0)
    }

    fn open_inner(path: &Path) -> Result<ModelFile, ModelErrorKind> {
        let mut file = File::open(path)?;
        let file_len = file.metadata()?.len();
        let mut start = Vec::with_capacity(9);
        (&mut file).take(9).read_to_end(&mut start)?;
        file.seek(SeekFrom::Start(0))?;
        let format = if start.starts_with(gguf::MAGIC) {
            ModelFormat::Gguf(GgufFile::read_from(file)?)
        } else if path.extension().is_some_and(|e| e == "safetensors")
            || start.get(8) == Some(&b'{')
        {
            ModelFormat::Safetensors(SafetensorsFile::read_from(file)?)
        } else {
            return Err(ModelErrorKind::UnknownFormat(start));
        };
        let tensors = match &format {
            ModelFormat::Gguf(g) => g.tensor_table(),
            ModelFormat::Safetensors(s) => s.tensor_table(),
        };
        Ok(ModelFile {
            path: path.to_path_buf(),
            file_len,
            tensors,
            format,
        })
    }
}

#[cfg(test)]
mod header_tests {
    use super::*;

    #[test]
    fn model_headers_are_told_from_other_files() {
        assert!(has_model_header(b"GGUF\x03\0\0\0\0"));
        let mut safetensors = 1234u64.to_le_bytes().to_vec();
        safetensors.push(b'{');
        assert!(has_model_header(&safetensors));
        // A length too large for a header, a missing brace, an ELF file, too short.
        let mut huge = (1u64 << 40).to_le_bytes().to_vec();
        huge.push(b'{');
        assert!(!has_model_header(&huge));
        let mut no_brace = 1234u64.to_le_bytes().to_vec();
        no_brace.push(b'[');
        assert!(!has_model_header(&no_brace));
        assert!(!has_model_header(b"\x7fELF\x02\x01\x01\0\0"));
        assert!(!has_model_header(b"GGU"));
    }
}
