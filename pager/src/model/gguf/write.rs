//! The GGUF writer: a version 3 header laid out as ggml's own writer does (tensor data
//! in header order, each tensor padded to the alignment), then the data, streamed in
//! pieces so a file of any size never has to fit in memory.

use std::collections::HashSet;
use std::io::{self, Write};

use thiserror::Error;

use super::file::{GgufTensor, ALIGNMENT_KEY, DEFAULT_ALIGNMENT, MAGIC};
use super::read::MAX_DIMS;
use super::value::{GgufValue, GgufValueType};
use crate::model::ggml_type::GgmlType;

/// A GGUF file that could not be written, and why.
#[derive(Debug, Error)]
pub enum GgufWriteError {
    #[error("I/O error: {0}")]
    Io(#[from] io::Error),
    #[error("alignment {0} is not a non-zero power of two")]
    BadAlignment(u64),
    #[error(
        "metadata says general.alignment = {metadata}, but the writer was asked for {alignment}"
    )]
    AlignmentMismatch { metadata: String, alignment: u64 },
    #[error("metadata key {0:?} appears twice")]
    DuplicateKey(String),
    #[error("metadata key {key:?}: array declared {elem_type:?} holds a {found:?}")]
    MixedArray {
        key: String,
        elem_type: GgufValueType,
        found: GgufValueType,
    },
    #[error("tensor {0:?} appears twice")]
    DuplicateTensor(String),
    #[error("tensor {tensor:?} has {n_dims} dimensions, ggml allows at most {MAX_DIMS}")]
    TooManyDims { tensor: String, n_dims: usize },
    #[error("tensor {tensor:?}: {ggml_type} dims {dims:?} are not whole blocks or overflow")]
    BadShape {
        tensor: String,
        ggml_type: GgmlType,
        dims: Vec<u64>,
    },
    #[error("tensor {tensor:?} takes {expected} bytes, but more data was written")]
    TooMuchData { tensor: String, expected: u64 },
    #[error("all tensors are written; {0} more bytes were given")]
    NoTensorLeft(usize),
    #[error(
        "tensor {tensor:?} got {written} of its {expected} bytes before the file was finished"
    )]
    Incomplete {
        tensor: String,
        written: u64,
        expected: u64,
    },
}

/// A tensor to be written: the writer assigns its offset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewTensor {
    pub name: String,
    /// ggml order (`ne[0]`, the row length, first).
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
}

/// Streams one GGUF file: the header goes out in `new`, then `write_data` takes each
/// tensor's bytes in header order, in pieces of any size, padding between tensors.
pub struct GgufWriter<W: Write> {
    out: W,
    tensors: Vec<GgufTensor>,
    data_offset: u64,
    alignment: u64,
    /// Index of the tensor being written.
    current: usize,
    /// Bytes of the current tensor written so far.
    written: u64,
}

const ZEROS: [u8; 4096] = [0; 4096];

impl<W: Write> GgufWriter<W> {
    /// Writes the header (version 3) and the padding up to the data section. If
    /// `alignment` is not the default and the metadata lacks `general.alignment`, the
    /// key is appended so readers find the data where it is.
    pub fn new(
        mut out: W,
        metadata: &[(String, GgufValue)],
        tensors: Vec<NewTensor>,
        alignment: u64,
    ) -> Result<Self, GgufWriteError> {
        if !alignment.is_power_of_two() {
            return Err(GgufWriteError::BadAlignment(alignment));
        }
        let mut keys = HashSet::new();
        for (key, value) in metadata {
            if !keys.insert(key.as_str()) {
                return Err(GgufWriteError::DuplicateKey(key.clone()));
            }
            check_value(key, value)?;
            if key == ALIGNMENT_KEY && value.as_u64() != Some(alignment) {
                return Err(GgufWriteError::AlignmentMismatch {
                    metadata: value.to_string(),
                    alignment,
                });
            }
        }
        let extra_alignment = (alignment != DEFAULT_ALIGNMENT && !keys.contains(ALIGNMENT_KEY))
            .then(|| {
                // ggml reads the alignment as a u32 and fails on any other type.
                let value = u32::try_from(alignment)
                    .map_err(|_| GgufWriteError::BadAlignment(alignment))?;
                Ok::<_, GgufWriteError>((ALIGNMENT_KEY.to_string(), GgufValue::U32(value)))
            })
            .transpose()?;

        let placed = place(tensors, alignment)?;
        let mut header = Vec::new();
        header.extend_from_slice(MAGIC);
        header.extend_from_slice(&3u32.to_le_bytes());
        put_u64(&mut header, placed.len() as u64);
        put_u64(
            &mut header,
            (metadata.len() + usize::from(extra_alignment.is_some())) as u64,
        );
        for (key, value) in metadata.iter().chain(extra_alignment.as_ref()) {
            put_bytes(&mut header, key.as_bytes());
            header.extend_from_slice(&value.value_type().id().to_le_bytes());
            put_value(&mut header, value);
        }
        for tensor in &placed {
            put_bytes(&mut header, tensor.name.as_bytes());
            // At most MAX_DIMS, checked in `place`.
            header.extend_from_slice(&(tensor.dims.len() as u32).to_le_bytes());
            for &dim in &tensor.dims {
                put_u64(&mut header, dim);
            }
            header.extend_from_slice(&tensor.ggml_type.id().to_le_bytes());
            put_u64(&mut header, tensor.offset);
        }
        let data_offset = (header.len() as u64).next_multiple_of(alignment);
        header.resize(data_offset as usize, 0);
        out.write_all(&header)?;

        let mut writer = GgufWriter {
            out,
            tensors: placed,
            data_offset,
            alignment,
            current: 0,
            written: 0,
        };
        writer.skip_empty_tensors()?;
        Ok(writer)
    }

    /// The tensors with their assigned offsets, in file order.
    pub fn tensors(&self) -> &[GgufTensor] {
        &self.tensors
    }

    /// Absolute offset of the data section.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// Length of the finished file.
    pub fn file_len(&self) -> u64 {
        self.data_offset + data_len(&self.tensors, self.alignment)
    }

    /// The tensor the next `write_data` goes to, and how many of its bytes are written.
    pub fn current(&self) -> Option<(&GgufTensor, u64)> {
        self.tensors.get(self.current).map(|t| (t, self.written))
    }

    /// Appends bytes to the current tensor. A piece may not run past the end of the
    /// tensor; when a tensor is complete, the padding is written and the next begins.
    pub fn write_data(&mut self, bytes: &[u8]) -> Result<(), GgufWriteError> {
        let Some(tensor) = self.tensors.get(self.current) else {
            return Err(GgufWriteError::NoTensorLeft(bytes.len()));
        };
        let left = tensor.size - self.written;
        if bytes.len() as u64 > left {
            return Err(GgufWriteError::TooMuchData {
                tensor: tensor.name.clone(),
                expected: tensor.size,
            });
        }
        self.out.write_all(bytes)?;
        self.written += bytes.len() as u64;
        if self.written == tensor.size {
            let padding = tensor.size.next_multiple_of(self.alignment) - tensor.size;
            self.pad(padding)?;
            self.current += 1;
            self.written = 0;
            self.skip_empty_tensors()?;
        }
        Ok(())
    }

    /// Checks every tensor got all its bytes, flushes, and hands back the output.
    pub fn finish(mut self) -> Result<W, GgufWriteError> {
        if let Some(tensor) = self.tensors.get(self.current) {
            return Err(GgufWriteError::Incomplete {
                tensor: tensor.name.clone(),
                written: self.written,
                expected: tensor.size,
            });
        }
        self.out.flush()?;
        Ok(self.out)
    }

    fn pad(&mut self, mut n: u64) -> io::Result<()> {
        while n > 0 {
            let step = n.min(ZEROS.len() as u64);
            self.out.write_all(&ZEROS[..step as usize])?;
            n -= step;
        }
        Ok(())
    }

    fn skip_empty_tensors(&mut self) -> io::Result<()> {
        while self.tensors.get(self.current).is_some_and(|t| t.size == 0) {
            self.current += 1;
        }
        Ok(())
    }
}

/// Assigns offsets in order, each tensor padded to the alignment, as ggml requires.
fn place(tensors: Vec<NewTensor>, alignment: u64) -> Result<Vec<GgufTensor>, GgufWriteError> {
    let mut names = HashSet::new();
    let mut offset = 0u64;
    let mut placed = Vec::with_capacity(tensors.len());
    for t in tensors {
        if !names.insert(t.name.clone()) {
            return Err(GgufWriteError::DuplicateTensor(t.name));
        }
        if t.dims.len() > MAX_DIMS as usize {
            return Err(GgufWriteError::TooManyDims {
                n_dims: t.dims.len(),
                tensor: t.name,
            });
        }
        let bad_shape = || GgufWriteError::BadShape {
            tensor: t.name.clone(),
            ggml_type: t.ggml_type,
            dims: t.dims.clone(),
        };
        let size = t.ggml_type.tensor_bytes(&t.dims).ok_or_else(bad_shape)?;
        let next = size
            .checked_next_multiple_of(alignment)
            .and_then(|padded| offset.checked_add(padded))
            .ok_or_else(bad_shape)?;
        placed.push(GgufTensor {
            name: t.name,
            dims: t.dims,
            ggml_type: t.ggml_type,
            offset,
            size,
        });
        offset = next;
    }
    Ok(placed)
}

fn data_len(tensors: &[GgufTensor], alignment: u64) -> u64 {
    tensors
        .last()
        .map_or(0, |t| t.offset + t.size.next_multiple_of(alignment))
}

fn check_value(key: &str, value: &GgufValue) -> Result<(), GgufWriteError> {
    if let GgufValue::Array { elem_type, values } = value {
        for v in values {
            if v.value_type() != *elem_type {
                return Err(GgufWriteError::MixedArray {
                    key: key.to_string(),
                    elem_type: *elem_type,
                    found: v.value_type(),
                });
            }
            check_value(key, v)?;
        }
    }
    Ok(())
}

fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    put_u64(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

fn put_value(out: &mut Vec<u8>, value: &GgufValue) {
    match value {
        GgufValue::U8(v) => out.push(*v),
        GgufValue::I8(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::U16(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::I16(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::U32(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::I32(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::F32(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::Bool(v) => out.push(u8::from(*v)),
        GgufValue::String(bytes) => put_bytes(out, bytes),
        GgufValue::Array { elem_type, values } => {
            out.extend_from_slice(&elem_type.id().to_le_bytes());
            put_u64(out, values.len() as u64);
            for v in values {
                put_value(out, v);
            }
        }
        GgufValue::U64(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::I64(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::F64(v) => out.extend_from_slice(&v.to_le_bytes()),
    }
}
