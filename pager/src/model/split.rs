//! Models stored in several GGUF files (`llama-gguf-split`): `name-00001-of-00004.gguf`
//! and its siblings. Large models are mostly published this way; llama.cpp loads every
//! part given the first, and maps each file whole. To the pager they are one model: a
//! budget given as a share is a share of all the parts, and one predicted order runs
//! through them all.
//!
//! Each part is a GGUF file of its own with `split.no` (0-based) and `split.count` in its
//! metadata, and its own tensor table: the tensors whose data it holds. The names follow
//! llama.cpp's `llama_split_path`: `{prefix}-{no + 1:05}-of-{count:05}.gguf`.
//!
//! Hugging Face shards safetensors models the same way, by name only:
//! `model-00001-of-00003.safetensors` and its siblings, each with its own header (the
//! index beside them maps tensors to shards, which the headers already say).

use std::path::{Path, PathBuf};

use thiserror::Error;

use super::{ModelError, ModelFile, ModelFormat};

/// Metadata keys of a split GGUF (llama.cpp's `LLM_KV_SPLIT_*`).
pub const SPLIT_NO: &str = "split.no";
pub const SPLIT_COUNT: &str = "split.count";

/// Most parts a split model's names can number (`-%05d-of-%05d`).
pub const MAX_PARTS: u64 = 99_999;

/// Why the parts of a split model could not be gathered.
#[derive(Debug, Error)]
pub enum SplitError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(
        "{}: part {} of a {count}-part split model, but its name does not end in \
         `{expected}`, so its other parts cannot be found",
        path.display(), no + 1
    )]
    UnexpectedName {
        path: PathBuf,
        no: u64,
        count: u64,
        expected: String,
    },
    #[error("{}: `split.no` is {no}, not below `split.count` {count}", path.display())]
    BadNumber { path: PathBuf, no: u64, count: u64 },
    #[error(
        "{}: `split.count` is {count}; llama.cpp names at most {MAX_PARTS} parts",
        path.display()
    )]
    TooManyParts { path: PathBuf, count: u64 },
    #[error(
        "{}: part {} of the split model {} is missing ({source})",
        path.display(), no + 1, first.display()
    )]
    MissingPart {
        path: PathBuf,
        first: PathBuf,
        no: u64,
        source: std::io::Error,
    },
    #[error(
        "{}: expected part {} of {count} of a split model, but it says part {} of {}",
        path.display(), no + 1, found_no.map_or("?".to_string(), |n| (n + 1).to_string()),
        found_count.map_or("?".to_string(), |n| n.to_string())
    )]
    WrongPart {
        path: PathBuf,
        no: u64,
        count: u64,
        found_no: Option<u64>,
        found_count: Option<u64>,
    },
}

/// Where a model file stands in a split model: part `no` (0-based) of `count`. A GGUF
/// part says so in its metadata; a safetensors shard only in its name, as Hugging Face
/// names them (`model-00001-of-00003.safetensors`, beside an index that lists them).
fn split_position(model: &ModelFile) -> Option<(u64, u64)> {
    match &model.format {
        ModelFormat::Gguf(gguf) => {
            let count = gguf.get_u64(SPLIT_COUNT)?;
            let no = gguf.get_u64(SPLIT_NO).unwrap_or(0);
            Some((no, count))
        }
        ModelFormat::Safetensors(_) => shard_position(model.path.file_name()?.to_str()?),
    }
}

/// Part `no` (0-based) of `count` from a name ending in `-NNNNN-of-MMMMM.safetensors`.
fn shard_position(name: &str) -> Option<(u64, u64)> {
    let stem = name.strip_suffix(".safetensors")?;
    let tail = stem.get(stem.len().checked_sub(15)?..)?;
    let (number, count) = tail.strip_prefix('-')?.split_once("-of-")?;
    let digits = |text: &str| {
        (text.len() == 5 && text.bytes().all(|b| b.is_ascii_digit())).then(|| text.parse().ok())?
    };
    let (number, count): (u64, u64) = (digits(number)?, digits(count)?);
    Some((number.checked_sub(1)?, count))
}

/// The file extension of `model`'s format, as its parts are named.
fn extension(model: &ModelFile) -> &'static str {
    match model.format {
        ModelFormat::Gguf(_) => "gguf",
        ModelFormat::Safetensors(_) => "safetensors",
    }
}

/// The file name suffix of part `no` (0-based) of `count`.
fn part_suffix(no: u64, count: u64, extension: &str) -> String {
    format!("-{:05}-of-{:05}.{extension}", no + 1, count)
}

/// The path of part `no` (0-based) of `count` of the split GGUF whose parts are named
/// from `prefix` (the path of any part without its suffix).
pub fn part_path(prefix: &Path, no: u64, count: u64) -> PathBuf {
    named_part(prefix, no, count, "gguf")
}

fn named_part(prefix: &Path, no: u64, count: u64, extension: &str) -> PathBuf {
    let mut path = prefix.as_os_str().to_os_string();
    path.push(part_suffix(no, count, extension));
    PathBuf::from(path)
}

/// Every part of the split model `model` belongs to, in order, with their tensor tables;
/// `None` when `model` is not part of a split model (no `split.count`, or a count of one).
/// Each sibling must exist and say it is the part its name says.
pub fn split_parts(model: &ModelFile) -> Result<Option<Vec<ModelFile>>, SplitError> {
    let Some((no, count)) = split_position(model) else {
        return Ok(None);
    };
    if count <= 1 {
        return Ok(None);
    }
    let path = &model.path;
    if count > MAX_PARTS {
        return Err(SplitError::TooManyParts {
            path: path.clone(),
            count,
        });
    }
    if no >= count {
        return Err(SplitError::BadNumber {
            path: path.clone(),
            no,
            count,
        });
    }
    let extension = extension(model);
    let suffix = part_suffix(no, count, extension);
    let text = path.as_os_str().as_encoded_bytes();
    let Some(prefix) = text.strip_suffix(suffix.as_bytes()) else {
        return Err(SplitError::UnexpectedName {
            path: path.clone(),
            no,
            count,
            expected: suffix,
        });
    };
    // SAFETY: `prefix` is `text` less an ASCII suffix, so it splits the encoded bytes
    // at a boundary between characters (as `strip_suffix` on valid encoded bytes does).
    let prefix = Path::new(unsafe { std::ffi::OsStr::from_encoded_bytes_unchecked(prefix) });
    let first = named_part(prefix, 0, count, extension);
    let mut parts = Vec::new();
    for part in 0..count {
        if part == no {
            parts.push(model.clone());
            continue;
        }
        let part_path = named_part(prefix, part, count, extension);
        if let Err(source) = std::fs::metadata(&part_path) {
            return Err(SplitError::MissingPart {
                path: part_path,
                first,
                no: part,
                source,
            });
        }
        let sibling = ModelFile::open(&part_path)?;
        let found = split_position(&sibling).filter(|_| self::extension(&sibling) == extension);
        if found != Some((part, count)) {
            return Err(SplitError::WrongPart {
                path: part_path,
                no: part,
                count,
                found_no: found.map(|(n, _)| n),
                found_count: found.map(|(_, c)| c),
            });
        }
        parts.push(sibling);
    }
    Ok(Some(parts))
}

/// The bytes of the model `path` holds: the sizes of all its parts for a split GGUF,
/// else the file's size. A file that is no model this program reads counts its size.
pub fn model_len(path: &Path) -> Result<u64, SplitError> {
    match ModelFile::open(path) {
        Ok(model) => Ok(match split_parts(&model)? {
            Some(parts) => parts.iter().map(|part| part.file_len).sum(),
            None => model.file_len,
        }),
        Err(error) => match std::fs::metadata(path) {
            Ok(meta) => Ok(meta.len()),
            Err(_) => Err(error.into()),
        },
    }
}

/// For tests: writes a GGUF of one tensor (`blk.N.attn_q.weight`, N the part number)
/// with the given split keys (`None`: none).
#[cfg(test)]
pub(crate) fn write_test_part(path: &Path, split: Option<(u16, u16)>) {
    use crate::model::ggml_type::GgmlType;
    use crate::model::gguf::{GgufValue, GgufWriter, NewTensor};
    let mut metadata = vec![(
        "general.architecture".to_string(),
        GgufValue::string("llama"),
    )];
    if let Some((no, count)) = split {
        metadata.push((SPLIT_NO.to_string(), GgufValue::U16(no)));
        metadata.push((SPLIT_COUNT.to_string(), GgufValue::U16(count)));
    }
    let tensors = vec![NewTensor {
        name: format!("blk.{}.attn_q.weight", split.map_or(0, |s| s.0)),
        dims: vec![256],
        ggml_type: GgmlType::F32,
    }];
    let file = std::fs::File::create(path).unwrap();
    let mut writer = GgufWriter::new(file, &metadata, tensors, 32).unwrap();
    writer.write_data(&[0u8; 1024]).unwrap();
    writer.finish().unwrap();
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::gguf::GgufValue;

    fn dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("split-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn any_part_finds_all_parts_in_order() {
        let dir = dir("all");
        for no in 0..3 {
            write_test_part(&part_path(&dir.join("m"), no, 3), Some((no as u16, 3)));
        }
        for no in 0..3 {
            let model = ModelFile::open(part_path(&dir.join("m"), no, 3)).unwrap();
            let parts = split_parts(&model).unwrap().expect("a split model");
            let names: Vec<_> = parts
                .iter()
                .map(|p| p.path.file_name().unwrap().to_str().unwrap().to_string())
                .collect();
            assert_eq!(
                names,
                [
                    "m-00001-of-00003.gguf",
                    "m-00002-of-00003.gguf",
                    "m-00003-of-00003.gguf"
                ]
            );
        }
        let one = std::fs::metadata(part_path(&dir.join("m"), 0, 3))
            .unwrap()
            .len();
        assert_eq!(
            model_len(&part_path(&dir.join("m"), 1, 3)).unwrap(),
            3 * one
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Writes a safetensors file of F32 tensors of `floats` elements each.
    fn write_safetensors(path: &Path, tensors: &[(&str, usize)]) {
        let mut header = serde_json::Map::new();
        let mut at = 0;
        for &(name, floats) in tensors {
            header.insert(
                name.to_string(),
                serde_json::json!({"dtype": "F32", "shape": [floats],
                    "data_offsets": [at, at + 4 * floats]}),
            );
            at += 4 * floats;
        }
        let header = serde_json::Value::Object(header).to_string();
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        bytes.resize(bytes.len() + at, 0);
        std::fs::write(path, bytes).unwrap();
    }

    #[test]
    fn hugging_face_shards_are_found_by_name() {
        let dir = dir("shards");
        let layer = |n: u32| -> Vec<(String, usize)> {
            ["self_attn.q_proj", "self_attn.k_proj", "mlp.down_proj"]
                .iter()
                .map(|t| (format!("model.layers.{n}.{t}.weight"), 1024))
                .collect()
        };
        for (no, layers) in [(1, 0..2), (2, 2..4), (3, 4..6)] {
            let names: Vec<(String, usize)> = layers.flat_map(layer).collect();
            let refs: Vec<(&str, usize)> = names.iter().map(|(n, f)| (n.as_str(), *f)).collect();
            write_safetensors(
                &dir.join(format!("model-{no:05}-of-00003.safetensors")),
                &refs,
            );
        }
        let second = ModelFile::open(dir.join("model-00002-of-00003.safetensors")).unwrap();
        let parts = split_parts(&second).unwrap().expect("three shards");
        assert_eq!(parts.len(), 3);
        assert!(parts[2].path.ends_with("model-00003-of-00003.safetensors"));
        let total: u64 = parts.iter().map(|p| p.file_len).sum();
        assert_eq!(model_len(&second.path).unwrap(), total);
        // One order through all shards, layer after layer.
        let tables: Vec<crate::graph::PartTensors> =
            parts.iter().map(crate::graph::PartTensors::from).collect();
        let graph = crate::graph::ModelGraph::from_parts(&tables, 4096).unwrap();
        let first_of_last = graph.parts()[2].first_block;
        let sequence = graph.order().sequence();
        assert!(sequence.iter().any(|&b| b >= first_of_last), "{sequence:?}");
        assert!(sequence.windows(2).all(|w| w[0] <= w[1]), "{sequence:?}");
        // A lone shard, or a name that is no shard's, is no split model.
        write_safetensors(&dir.join("model.safetensors"), &[("a", 4)]);
        let lone = ModelFile::open(dir.join("model.safetensors")).unwrap();
        assert!(split_parts(&lone).unwrap().is_none());
        std::fs::remove_file(dir.join("model-00003-of-00003.safetensors")).unwrap();
        let error = split_parts(&second).unwrap_err().to_string();
        assert!(error.contains("part 3"), "{error}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_whole_model_is_no_split() {
        let dir = dir("whole");
        let path = dir.join("m.gguf");
        write_test_part(&path, None);
        assert!(split_parts(&ModelFile::open(&path).unwrap())
            .unwrap()
            .is_none());
        let single = dir.join("s-00001-of-00001.gguf");
        write_test_part(&single, Some((0, 1)));
        assert!(split_parts(&ModelFile::open(&single).unwrap())
            .unwrap()
            .is_none());
        assert_eq!(
            model_len(&path).unwrap(),
            std::fs::metadata(&path).unwrap().len()
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_missing_or_wrong_part_is_named() {
        let dir = dir("missing");
        let prefix = dir.join("m");
        write_test_part(&part_path(&prefix, 0, 3), Some((0, 3)));
        write_test_part(&part_path(&prefix, 2, 3), Some((2, 3)));
        let first = ModelFile::open(part_path(&prefix, 0, 3)).unwrap();
        let error = split_parts(&first).unwrap_err().to_string();
        assert!(
            error.contains("m-00002-of-00003.gguf") && error.contains("part 2"),
            "{error}"
        );
        // A part 2 that says it is part 3.
        write_test_part(&part_path(&prefix, 1, 3), Some((2, 3)));
        let error = split_parts(&first).unwrap_err().to_string();
        assert!(
            error.contains("expected part 2 of 3") && error.contains("says part 3 of 3"),
            "{error}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_renamed_part_or_a_bad_number_is_refused() {
        let dir = dir("renamed");
        let renamed = dir.join("model.gguf");
        write_test_part(&renamed, Some((0, 2)));
        let error = split_parts(&ModelFile::open(&renamed).unwrap())
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("part 1 of a 2-part") && error.contains("-00001-of-00002.gguf"),
            "{error}"
        );
        let huge = dir.join("h-00001-of-100000.gguf");
        write_test_part(&huge, Some((0, 0)));
        let mut model = ModelFile::open(&huge).unwrap();
        if let ModelFormat::Gguf(gguf) = &mut model.format {
            for (key, value) in gguf.metadata.iter_mut() {
                if key == SPLIT_COUNT {
                    *value = GgufValue::U64(u64::MAX);
                }
            }
        }
        let error = split_parts(&model).unwrap_err().to_string();
        assert!(error.contains("at most 99999 parts"), "{error}");
        let bad = dir.join("b-00005-of-00002.gguf");
        write_test_part(&bad, Some((4, 2)));
        let error = split_parts(&ModelFile::open(&bad).unwrap())
            .unwrap_err()
            .to_string();
        assert!(error.contains("not below"), "{error}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
