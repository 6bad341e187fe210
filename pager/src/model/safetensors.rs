//! Safetensors headers: an 8-byte little-endian header length, a JSON object
//! `{name: {dtype, shape, data_offsets: [start, end]}, "__metadata__": {..}}`, then the
//! data, offsets relative to the end of the header.
//!
//! Parsed by hand rather than with the `safetensors` crate: its reader wants the whole
//! file in memory, and we must read the header of a file larger than RAM.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::path::Path;

use serde::de::{DeserializeSeed, Deserializer, Error as _, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use thiserror::Error;

use super::tensor::TensorInfo;

/// The largest header accepted, as the reference implementation (100 MB).
pub const MAX_HEADER_LEN: u64 = 100_000_000;

/// The key of the free-form string map in the header.
pub const METADATA_KEY: &str = "__metadata__";

/// A safetensors file that could not be read, and why.
#[derive(Debug, Error)]
pub enum SafetensorsError {
    #[error("I/O error: {0}")]
    Io(#[from] io::Error),
    #[error("the input ends at byte {offset} while reading {what}")]
    Truncated { offset: u64, what: &'static str },
    #[error("header length {len} exceeds the limit of {MAX_HEADER_LEN} bytes")]
    HeaderTooLarge { len: u64 },
    #[error("header length {len} runs past the end of the file ({file_len} bytes)")]
    HeaderPastEnd { len: u64, file_len: u64 },
    #[error("the header is not valid UTF-8")]
    BadUtf8,
    #[error("the header is not valid JSON: {0}")]
    BadJson(String),
    #[error("the header is not a JSON object")]
    NotAnObject,
    #[error("tensor {tensor:?}: malformed entry: {reason}")]
    BadEntry { tensor: String, reason: String },
    #[error("__metadata__ is not a map of strings to strings: {0}")]
    BadMetadata(String),
    #[error("tensor {tensor:?}: unknown dtype {dtype:?}")]
    UnknownDtype { tensor: String, dtype: String },
    #[error("tensor {tensor:?}: shape {shape:?} of {dtype} takes {expected} bytes, data_offsets span {found}")]
    SizeMismatch {
        tensor: String,
        dtype: String,
        shape: Vec<u64>,
        expected: u64,
        found: u64,
    },
    #[error(
        "tensor {tensor:?}: shape {shape:?} of {dtype} is not a whole number of bytes or overflows"
    )]
    BadShape {
        tensor: String,
        dtype: String,
        shape: Vec<u64>,
    },
    #[error("tensor {tensor:?}: data_offsets [{start}, {end}] run backwards")]
    BackwardOffsets {
        tensor: String,
        start: u64,
        end: u64,
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
    #[error("the header names {0:?} twice")]
    DuplicateKey(String),
}

/// One tensor of the header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SafetensorsTensor {
    pub name: String,
    pub dtype: String,
    /// Outermost dimension first (C order).
    pub shape: Vec<u64>,
    /// Byte range relative to the start of the data (the end of the header).
    pub data_offsets: (u64, u64),
}

/// A parsed safetensors header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SafetensorsFile {
    /// Length of the JSON header; the data starts at `8 + header_len`.
    pub header_len: u64,
    /// The `__metadata__` map (empty if absent).
    pub metadata: BTreeMap<String, String>,
    /// Tensors in data order (by offset): the header is a JSON object, unordered.
    pub tensors: Vec<SafetensorsTensor>,
    pub file_len: u64,
}

/// The most dimensions a tensor's shape may have (PyTorch's limit is 64 too).
pub const MAX_DIMS: usize = 64;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    dtype: String,
    #[serde(deserialize_with = "bounded_shape")]
    shape: Vec<u64>,
    data_offsets: (u64, u64),
}

/// A shape of at most `MAX_DIMS` dimensions, refused at the first one past it.
fn bounded_shape<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<u64>, D::Error> {
    struct Shape;
    impl<'de> Visitor<'de> for Shape {
        type Value = Vec<u64>;

        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            write!(f, "an array of at most {MAX_DIMS} dimensions")
        }

        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<u64>, A::Error> {
            let mut shape = Vec::new();
            while let Some(dim) = seq.next_element()? {
                if shape.len() == MAX_DIMS {
                    return Err(A::Error::custom(format_args!(
                        "a shape of more than {MAX_DIMS} dimensions"
                    )));
                }
                shape.push(dim);
            }
            Ok(shape)
        }
    }
    deserializer.deserialize_seq(Shape)
}

/// Bits per element of each dtype the format defines.
fn dtype_bits(dtype: &str) -> Option<u64> {
    Some(match dtype {
        "F4" => 4,
        "F6_E2M3" | "F6_E3M2" => 6,
        "BOOL" | "U8" | "I8" | "F8_E5M2" | "F8_E4M3" | "F8_E8M0" => 8,
        "I16" | "U16" | "F16" | "BF16" => 16,
        "I32" | "U32" | "F32" => 32,
        "I64" | "U64" | "F64" | "C64" => 64,
        _ => return None,
    })
}

impl SafetensorsFile {
    /// Reads the header of a file on disk; the tensor data is not read.
    pub fn open(path: &Path) -> Result<SafetensorsFile, SafetensorsError> {
        Self::read_from(File::open(path)?)
    }

    /// Reads the header from a seekable source whose length is the file length.
    pub fn read_from<R: Read + Seek>(mut source: R) -> Result<SafetensorsFile, SafetensorsError> {
        let file_len = source.seek(SeekFrom::End(0))?;
        source.seek(SeekFrom::Start(0))?;
        parse(source, file_len)
    }

    /// Parses a whole file held in memory.
    pub fn parse(bytes: &[u8]) -> Result<SafetensorsFile, SafetensorsError> {
        parse(bytes, bytes.len() as u64)
    }

    /// Parses the header from the first bytes of a file of `file_len` bytes.
    pub fn parse_prefix(prefix: &[u8], file_len: u64) -> Result<SafetensorsFile, SafetensorsError> {
        parse(prefix, file_len)
    }

    /// Absolute offset of the data section.
    pub fn data_offset(&self) -> u64 {
        8 + self.header_len
    }

    /// The tensor table in data order, with absolute byte ranges.
    pub fn tensor_table(&self) -> Vec<TensorInfo> {
        let base = self.data_offset();
        self.tensors
            .iter()
            .map(|t| TensorInfo {
                name: t.name.clone(),
                dtype: t.dtype.clone(),
                shape: t.shape.clone(),
                file_range: base + t.data_offsets.0..base + t.data_offsets.1,
            })
            .collect()
    }
}

fn read_exact<R: Read>(
    source: &mut R,
    buf: &mut [u8],
    offset: u64,
    what: &'static str,
) -> Result<(), SafetensorsError> {
    source.read_exact(buf).map_err(|e| match e.kind() {
        io::ErrorKind::UnexpectedEof => SafetensorsError::Truncated { offset, what },
        _ => SafetensorsError::Io(e),
    })
}

fn parse<R: Read>(mut source: R, file_len: u64) -> Result<SafetensorsFile, SafetensorsError> {
    let (header_len, header) = read_header(&mut source, file_len)?;
    let data_start = 8 + header_len;
    let data_len = file_len - data_start;
    let Header {
        metadata,
        mut tensors,
    } = header;
    for tensor in &tensors {
        let (start, end) = tensor.data_offsets;
        if end > data_len {
            return Err(SafetensorsError::OutOfBounds {
                tensor: tensor.name.clone(),
                start: data_start.saturating_add(start),
                end: data_start.saturating_add(end),
                file_len,
            });
        }
    }
    tensors.sort_by(|a, b| {
        a.data_offsets
            .cmp(&b.data_offsets)
            .then(a.name.cmp(&b.name))
    });
    check_no_overlap(&tensors)?;
    Ok(SafetensorsFile {
        header_len,
        metadata,
        tensors,
        file_len,
    })
}

/// The header's length and its contents, checked to fit in the file.
fn read_header<R: Read>(source: &mut R, file_len: u64) -> Result<(u64, Header), SafetensorsError> {
    let mut len_bytes = [0u8; 8];
    read_exact(source, &mut len_bytes, 0, "the header length")?;
    let header_len = u64::from_le_bytes(len_bytes);
    if header_len > MAX_HEADER_LEN {
        return Err(SafetensorsError::HeaderTooLarge { len: header_len });
    }
    if 8 + header_len > file_len {
        return Err(SafetensorsError::HeaderPastEnd {
            len: header_len,
            file_len,
        });
    }
    // In range: header_len <= MAX_HEADER_LEN.
    let mut bytes = vec![0u8; header_len as usize];
    read_exact(source, &mut bytes, 8, "the header")?;
    let text = std::str::from_utf8(&bytes).map_err(|_| SafetensorsError::BadUtf8)?;
    Ok((header_len, Header::parse(text)?))
}

/// The header's contents, deserialized entry by entry straight into these (no JSON tree
/// of the whole header is built): what it holds is at most a few times the header's
/// bytes, and every entry is checked as it is read.
struct Header {
    metadata: BTreeMap<String, String>,
    tensors: Vec<SafetensorsTensor>,
}

impl Header {
    fn parse(text: &str) -> Result<Header, SafetensorsError> {
        if !text.trim_start().starts_with('{') {
            // Valid JSON of another kind, or not JSON at all.
            return Err(match serde_json::from_str::<serde::de::IgnoredAny>(text) {
                Ok(_) => SafetensorsError::NotAnObject,
                Err(e) => SafetensorsError::BadJson(e.to_string()),
            });
        }
        let mut refused = None;
        let mut deserializer = serde_json::Deserializer::from_str(text);
        let header = HeaderSeed {
            refused: &mut refused,
        }
        .deserialize(&mut deserializer)
        .and_then(|header| deserializer.end().map(|()| header));
        match (header, refused) {
            (Ok(header), _) => Ok(header),
            // An entry that is JSON but not what the format allows: the error it earned.
            (Err(e), Some(refused)) if e.classify() == serde_json::error::Category::Data => {
                Err(refused.with_reason(e))
            }
            (Err(e), _) => Err(SafetensorsError::BadJson(e.to_string())),
        }
    }
}

/// Why the deserializer stopped at an entry, for `Header::parse` to give as the error
/// (serde's own errors carry only text).
enum Refusal {
    /// The entry was refused by serde (its text is the reason).
    Entry(String),
    Metadata,
    /// Refused by a check of ours, with its own error.
    Checked(SafetensorsError),
}

impl Refusal {
    fn with_reason(self, error: serde_json::Error) -> SafetensorsError {
        match self {
            Refusal::Entry(tensor) => SafetensorsError::BadEntry {
                tensor,
                reason: error.to_string(),
            },
            Refusal::Metadata => SafetensorsError::BadMetadata(error.to_string()),
            Refusal::Checked(error) => error,
        }
    }
}

/// Deserializes the header object, leaving in `refused` why it stopped at an entry.
struct HeaderSeed<'a> {
    refused: &'a mut Option<Refusal>,
}

impl<'de> DeserializeSeed<'de> for HeaderSeed<'_> {
    type Value = Header;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Header, D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for HeaderSeed<'_> {
    type Value = Header;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a safetensors header object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Header, A::Error> {
        let mut header = Header {
            metadata: BTreeMap::new(),
            tensors: Vec::new(),
        };
        let mut names = std::collections::HashSet::new();
        let mut metadata_seen = false;
        while let Some(name) = map.next_key::<String>()? {
            let seen = if name == METADATA_KEY {
                std::mem::replace(&mut metadata_seen, true)
            } else {
                names.contains(name.as_str())
            };
            if seen {
                return Err(refuse(self.refused, SafetensorsError::DuplicateKey(name)));
            }
            if name == METADATA_KEY {
                *self.refused = Some(Refusal::Metadata);
                header.metadata = map.next_value_seed(Metadata)?;
                continue;
            }
            *self.refused = Some(Refusal::Entry(name.clone()));
            let entry: Entry = map.next_value()?;
            let tensor =
                checked_tensor(name, entry).map_err(|error| refuse(self.refused, error))?;
            names.insert(tensor.name.clone());
            header.tensors.push(tensor);
        }
        Ok(header)
    }
}

/// The `__metadata__` map of strings to strings, each key once.
struct Metadata;

impl<'de> DeserializeSeed<'de> for Metadata {
    type Value = BTreeMap<String, String>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for Metadata {
    type Value = BTreeMap<String, String>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a map of strings to strings")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut metadata = BTreeMap::new();
        while let Some((key, value)) = map.next_entry::<String, String>()? {
            if metadata.contains_key(&key) {
                return Err(A::Error::custom(format_args!("key {key:?} appears twice")));
            }
            metadata.insert(key, value);
        }
        Ok(metadata)
    }
}

/// Stops the deserializer at a refusal of ours: `error` for `Header::parse` to give, its
/// text for serde.
fn refuse<E: serde::de::Error>(refused: &mut Option<Refusal>, error: SafetensorsError) -> E {
    let message = error.to_string();
    *refused = Some(Refusal::Checked(error));
    E::custom(message)
}

/// A tensor entry of the header, its dtype known and its byte length that of its shape.
fn checked_tensor(name: String, entry: Entry) -> Result<SafetensorsTensor, SafetensorsError> {
    let Some(bits) = dtype_bits(&entry.dtype) else {
        return Err(SafetensorsError::UnknownDtype {
            tensor: name,
            dtype: entry.dtype,
        });
    };
    let bad_shape = || SafetensorsError::BadShape {
        tensor: name.clone(),
        dtype: entry.dtype.clone(),
        shape: entry.shape.clone(),
    };
    let total_bits = entry
        .shape
        .iter()
        .try_fold(bits, |acc, &d| acc.checked_mul(d))
        .ok_or_else(bad_shape)?;
    if total_bits % 8 != 0 {
        return Err(bad_shape());
    }
    let expected = total_bits / 8;
    let (start, end) = entry.data_offsets;
    if end < start {
        return Err(SafetensorsError::BackwardOffsets {
            tensor: name,
            start,
            end,
        });
    }
    if end - start != expected {
        return Err(SafetensorsError::SizeMismatch {
            tensor: name,
            dtype: entry.dtype,
            shape: entry.shape,
            expected,
            found: end - start,
        });
    }
    Ok(SafetensorsTensor {
        name,
        dtype: entry.dtype,
        shape: entry.shape,
        data_offsets: entry.data_offsets,
    })
}

/// Refuses tensors (sorted by offset) whose bytes overlap; empty tensors overlap nothing.
fn check_no_overlap(tensors: &[SafetensorsTensor]) -> Result<(), SafetensorsError> {
    let occupied = tensors
        .iter()
        .filter(|t| t.data_offsets.1 > t.data_offsets.0);
    let mut previous: Option<&SafetensorsTensor> = None;
    for t in occupied {
        if let Some(p) = previous {
            if t.data_offsets.0 < p.data_offsets.1 {
                return Err(SafetensorsError::Overlap {
                    first: p.name.clone(),
                    second: t.name.clone(),
                });
            }
        }
        previous = Some(t);
    }
    Ok(())
}
