//! The GGUF header parser. It reads front to back through any `Read`, checking every
//! count and length against the bytes left in the file before allocating for it, so a
//! hostile or truncated file costs at most its own size in memory and never panics.

use std::collections::HashSet;
use std::io::{self, Read};

use super::error::GgufError;
use super::file::{GgufFile, GgufTensor, DEFAULT_ALIGNMENT, MAGIC};
use super::value::{GgufValue, GgufValueType};
use crate::model::ggml_type::GgmlType;

/// ggml's GGML_MAX_DIMS.
pub const MAX_DIMS: u32 = 4;
/// Deepest array nesting accepted. Real files nest at most once; the limit bounds the
/// reader's recursion.
pub const MAX_NESTING: usize = 8;
/// Longest string accepted (keys, names, values): chat templates are kilobytes, so
/// 64 MiB is generous and stops a length field from claiming gigabytes of a large file.
pub const MAX_STRING_LEN: u64 = 64 << 20;
/// Most elements in one array. Vocabularies are under a million entries; each element
/// costs a `GgufValue` in memory, so this bounds what a huge file can make us hold.
pub const MAX_ARRAY_LEN: u64 = 1 << 24;
/// Elements reserved up front for an array whatever its declared count; the rest grow
/// as elements are actually read.
const PREALLOC_LIMIT: u64 = 1 << 16;

/// Bytes one metadata entry occupies at least: key length, empty key, type, one byte.
const MIN_KV_LEN: u64 = 8 + 4 + 1;
/// Bytes one tensor info occupies at least: name length, n_dims, type, offset.
const MIN_TENSOR_INFO_LEN: u64 = 8 + 4 + 4 + 8;

/// A reader that knows its position and the length of the whole file.
struct Source<R> {
    inner: R,
    pos: u64,
    file_len: u64,
}

impl<R: Read> Source<R> {
    fn remaining(&self) -> u64 {
        self.file_len.saturating_sub(self.pos)
    }

    fn bytes<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N], GgufError> {
        let mut buf = [0u8; N];
        self.fill(&mut buf, what)?;
        Ok(buf)
    }

    fn fill(&mut self, buf: &mut [u8], what: &dyn Fn() -> String) -> Result<(), GgufError> {
        match self.inner.read_exact(buf) {
            Ok(()) => {
                self.pos += buf.len() as u64;
                Ok(())
            }
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Err(GgufError::Truncated {
                offset: self.pos,
                what: what(),
            }),
            Err(e) => Err(GgufError::Io(e)),
        }
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.bytes(what)?))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.bytes(what)?))
    }

    /// A count of items each at least `min_len` bytes long, checked against the rest
    /// of the file and `limit` before anyone allocates for it.
    fn count(
        &mut self,
        min_len: u64,
        limit: u64,
        what: &dyn Fn() -> String,
    ) -> Result<u64, GgufError> {
        let offset = self.pos;
        let count = self.u64(what)?;
        let remaining = self.remaining();
        let fits = count
            .checked_mul(min_len)
            .is_some_and(|need| need <= remaining);
        if !fits || count > limit {
            return Err(GgufError::CountTooLarge {
                what: what(),
                count,
                offset,
                remaining,
            });
        }
        Ok(count)
    }

    fn raw_string(&mut self, what: &dyn Fn() -> String) -> Result<Vec<u8>, GgufError> {
        let offset = self.pos;
        let len = self.u64(what)?;
        let limit = MAX_STRING_LEN.min(self.remaining());
        if len > limit {
            return Err(GgufError::StringTooLong {
                what: what(),
                len,
                offset,
                limit,
            });
        }
        // In range: len <= MAX_STRING_LEN, which fits in usize.
        let mut buf = vec![0u8; len as usize];
        self.fill(&mut buf, what)?;
        Ok(buf)
    }

    fn utf8_string(&mut self, what: &dyn Fn() -> String) -> Result<String, GgufError> {
        let offset = self.pos;
        let raw = self.raw_string(what)?;
        String::from_utf8(raw).map_err(|_| GgufError::BadUtf8 {
            what: what(),
            offset,
        })
    }

    fn value(
        &mut self,
        value_type: GgufValueType,
        key: &str,
        depth: usize,
    ) -> Result<GgufValue, GgufError> {
        let what = || format!("the value of metadata key {key:?}");
        let what = &what;
        Ok(match value_type {
            GgufValueType::U8 => GgufValue::U8(u8::from_le_bytes(self.bytes(what)?)),
            GgufValueType::I8 => GgufValue::I8(i8::from_le_bytes(self.bytes(what)?)),
            GgufValueType::U16 => GgufValue::U16(u16::from_le_bytes(self.bytes(what)?)),
            GgufValueType::I16 => GgufValue::I16(i16::from_le_bytes(self.bytes(what)?)),
            GgufValueType::U32 => GgufValue::U32(self.u32(what)?),
            GgufValueType::I32 => GgufValue::I32(i32::from_le_bytes(self.bytes(what)?)),
            GgufValueType::F32 => GgufValue::F32(f32::from_le_bytes(self.bytes(what)?)),
            // ggml accepts only 0 and 1 as booleans; other bytes are read as true.
            GgufValueType::Bool => GgufValue::Bool(self.bytes::<1>(what)?[0] != 0),
            GgufValueType::String => GgufValue::String(self.raw_string(what)?),
            GgufValueType::U64 => GgufValue::U64(self.u64(what)?),
            GgufValueType::I64 => GgufValue::I64(i64::from_le_bytes(self.bytes(what)?)),
            GgufValueType::F64 => GgufValue::F64(f64::from_le_bytes(self.bytes(what)?)),
            GgufValueType::Array => {
                if depth >= MAX_NESTING {
                    return Err(GgufError::NestingTooDeep {
                        key: key.to_string(),
                        max: MAX_NESTING,
                    });
                }
                let elem_type = self.value_type(key)?;
                let count = self.count(elem_type.min_encoded_len(), MAX_ARRAY_LEN, &|| {
                    format!("array of metadata key {key:?}")
                })?;
                let mut values = Vec::with_capacity(count.min(PREALLOC_LIMIT) as usize);
                for _ in 0..count {
                    values.push(self.value(elem_type, key, depth + 1)?);
                }
                GgufValue::Array { elem_type, values }
            }
        })
    }

    fn value_type(&mut self, key: &str) -> Result<GgufValueType, GgufError> {
        let offset = self.pos;
        let type_id = self.u32(&|| format!("the value type of metadata key {key:?}"))?;
        GgufValueType::from_id(type_id).ok_or_else(|| GgufError::UnknownValueType {
            key: key.to_string(),
            type_id,
            offset,
        })
    }

    fn tensor_info(&mut self, index: u64) -> Result<GgufTensor, GgufError> {
        let name = self.utf8_string(&|| format!("the name of tensor {index}"))?;
        let what = || format!("the shape and type of tensor {name:?}");
        let what = &what;
        let n_dims = self.u32(what)?;
        if n_dims > MAX_DIMS {
            return Err(GgufError::TooManyDims {
                tensor: name,
                n_dims,
                max: MAX_DIMS,
            });
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            let dim = self.u64(what)?;
            // ggml holds dimensions in int64_t.
            if i64::try_from(dim).is_err() {
                return Err(GgufError::DimTooLarge { tensor: name, dim });
            }
            dims.push(dim);
        }
        let type_id = self.u32(what)?;
        let offset = self.u64(what)?;
        let Some(ggml_type) = GgmlType::from_id(type_id) else {
            return Err(GgufError::UnknownGgmlType {
                tensor: name,
                type_id,
            });
        };
        let ne0 = dims.first().copied().unwrap_or(1);
        if ne0 % ggml_type.block_size() != 0 {
            return Err(GgufError::NotBlockMultiple {
                tensor: name,
                ggml_type: ggml_type.name().to_string(),
                ne0,
                block_size: ggml_type.block_size(),
            });
        }
        let Some(size) = ggml_type.tensor_bytes(&dims) else {
            return Err(GgufError::SizeOverflow { tensor: name });
        };
        Ok(GgufTensor {
            name,
            dims,
            ggml_type,
            offset,
            size,
        })
    }
}

/// Parses a GGUF header from `inner`, positioned at the start of a file of `file_len`
/// bytes. Reads only the header: the tensor data is never touched.
pub(super) fn parse<R: Read>(inner: R, file_len: u64) -> Result<GgufFile, GgufError> {
    let mut src = Source {
        inner,
        pos: 0,
        file_len,
    };
    let magic: [u8; 4] = src.bytes(&|| "the magic".to_string())?;
    if &magic != MAGIC {
        return Err(GgufError::BadMagic(magic));
    }
    let version = src.u32(&|| "the version".to_string())?;
    if !(2..=3).contains(&version) {
        return Err(GgufError::UnsupportedVersion(version));
    }
    let tensor_count = src.count(MIN_TENSOR_INFO_LEN, u64::MAX, &|| {
        "the tensor count".to_string()
    })?;
    let kv_count = src.count(MIN_KV_LEN, u64::MAX, &|| {
        "the metadata key count".to_string()
    })?;

    let mut metadata = Vec::with_capacity(kv_count.min(PREALLOC_LIMIT) as usize);
    let mut keys = HashSet::new();
    for index in 0..kv_count {
        let key = src.utf8_string(&|| format!("metadata key {index}"))?;
        let value_type = src.value_type(&key)?;
        let value = src.value(value_type, &key, 0)?;
        if !keys.insert(key.clone()) {
            return Err(GgufError::DuplicateKey(key));
        }
        metadata.push((key, value));
    }

    let mut tensors = Vec::with_capacity(tensor_count.min(PREALLOC_LIMIT) as usize);
    let mut names = HashSet::new();
    for index in 0..tensor_count {
        let tensor = src.tensor_info(index)?;
        if !names.insert(tensor.name.clone()) {
            return Err(GgufError::DuplicateTensor(tensor.name));
        }
        tensors.push(tensor);
    }
    let header_end = src.pos;

    let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some((_, value)) => match value.as_u64() {
            Some(a) if a.is_power_of_two() => a,
            _ => return Err(GgufError::BadAlignment(value.to_string())),
        },
    };
    let data_offset = header_end
        .checked_next_multiple_of(alignment)
        .ok_or_else(|| GgufError::BadAlignment(alignment.to_string()))?;

    let file = GgufFile {
        version,
        metadata,
        tensors,
        data_offset,
        alignment,
        file_len,
    };
    check_placement(&file)?;
    Ok(file)
}

/// Every tensor aligned, inside the file, and clear of every other.
fn check_placement(file: &GgufFile) -> Result<(), GgufError> {
    let mut spans = Vec::with_capacity(file.tensors.len());
    for tensor in &file.tensors {
        if tensor.offset % file.alignment != 0 {
            return Err(GgufError::MisalignedOffset {
                tensor: tensor.name.clone(),
                offset: tensor.offset,
                alignment: file.alignment,
            });
        }
        let overflow = || GgufError::SizeOverflow {
            tensor: tensor.name.clone(),
        };
        let start = file
            .data_offset
            .checked_add(tensor.offset)
            .ok_or_else(overflow)?;
        let end = start.checked_add(tensor.size).ok_or_else(overflow)?;
        if end > file.file_len {
            return Err(GgufError::OutOfBounds {
                tensor: tensor.name.clone(),
                start,
                end,
                file_len: file.file_len,
            });
        }
        // Empty tensors occupy no bytes and cannot overlap anything.
        if end > start {
            spans.push((start, end, tensor.name.as_str()));
        }
    }
    spans.sort_unstable();
    for pair in spans.windows(2) {
        if pair[1].0 < pair[0].1 {
            return Err(GgufError::Overlap {
                first: pair[0].2.to_string(),
                second: pair[1].2.to_string(),
            });
        }
    }
    Ok(())
}
