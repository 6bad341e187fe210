//! Saving a learned graph beside its model (`<model>.hyperoffload-graph`) and loading it
//! on the next run.
//!
//! The file is small JSON: a format name and version, the key of the model it was
//! learned from (size, modification time, a hash of its first MiB), the block geometry,
//! and the counted transitions. A file whose key no longer matches the model is stale:
//! it is reported, not used. A file that does not parse is an error, never a panic.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use thiserror::Error;

use super::Transitions;
use crate::geometry::BlockGeometry;

const FORMAT: &str = "hyperoffload-graph";
const VERSION: u32 = 1;
/// Bytes of the model hashed into its key: enough to tell models apart (the header and
/// tensor table live there), cheap to read at start-up.
const HEAD_BYTES: u64 = 1 << 20;

#[derive(Debug, Error)]
pub enum StoreError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not a hyperoffload file of what was learned: {reason}")]
    Malformed { path: PathBuf, reason: String },
    #[error("{path}: file version {found}, this build reads version {supported}")]
    UnsupportedVersion {
        path: PathBuf,
        found: u32,
        supported: u32,
    },
}

/// Identifies the exact model file a graph was learned from.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ModelKey {
    pub size: u64,
    pub mtime_ns: u64,
    /// FNV-1a of the first MiB, in hex (JSON numbers lose precision past 2^53).
    pub head_hash: String,
}

impl ModelKey {
    pub fn of_file(path: &Path) -> Result<Self, StoreError> {
        let io = |source| StoreError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        let meta = file.metadata().map_err(io)?;
        let mtime_ns = meta
            .modified()
            .map_err(io)?
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos().min(u64::MAX as u128) as u64);
        let mut head = Vec::new();
        file.take(HEAD_BYTES).read_to_end(&mut head).map_err(io)?;
        Ok(Self {
            size: meta.len(),
            mtime_ns,
            head_hash: format!("{:016x}", fnv1a(&head)),
        })
    }
}

/// FNV-1a, 64-bit: stable across Rust versions, unlike `DefaultHasher`.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, &b| {
        (hash ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// What a graph file holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SavedGraph {
    pub key: ModelKey,
    pub layout: BlockGeometry,
    pub transitions: Transitions,
}

#[derive(serde::Serialize, serde::Deserialize)]
struct FileBody {
    format: String,
    version: u32,
    model: ModelKey,
    layout: BlockGeometry,
    /// `[from, to, count]`.
    edges: Vec<(u32, u32, u64)>,
    /// Blocks seen on no edge.
    lone_blocks: Vec<u32>,
    /// `[before, block, after, count]`.
    contexts: Vec<(u32, u32, u32, u64)>,
}

/// The result of looking for a saved graph.
#[derive(Debug)]
pub enum Loaded {
    Fresh(SavedGraph),
    /// There is a graph file, learned from another version of the model: ignore it.
    Stale {
        path: PathBuf,
        reason: String,
    },
    Absent,
}

/// Where the learned graph of `model` lives.
pub fn graph_path(model: &Path) -> PathBuf {
    let mut name = model.as_os_str().to_owned();
    name.push(".hyperoffload-graph");
    PathBuf::from(name)
}

/// Serialises a graph.
pub fn encode(saved: &SavedGraph) -> String {
    let edges: Vec<(u32, u32, u64)> = saved.transitions.edges().collect();
    let on_edge: std::collections::BTreeSet<u32> =
        edges.iter().flat_map(|&(a, b, _)| [a, b]).collect();
    let body = FileBody {
        format: FORMAT.into(),
        version: VERSION,
        model: saved.key.clone(),
        layout: saved.layout.clone(),
        edges,
        lone_blocks: saved
            .transitions
            .blocks()
            .filter(|b| !on_edge.contains(b))
            .collect(),
        contexts: saved.transitions.contexts().collect(),
    };
    // Serialising plain data to a string cannot fail.
    serde_json::to_string(&body).unwrap_or_default()
}

/// Parses a file of what was learned, JSON whose `format` and `version` must be these;
/// `path` only names it in errors.
pub(crate) fn decode_versioned<T: serde::de::DeserializeOwned>(
    text: &str,
    path: &Path,
    format: &str,
    version: u32,
) -> Result<T, StoreError> {
    let malformed = |reason: String| StoreError::Malformed {
        path: path.to_path_buf(),
        reason,
    };
    let value: serde_json::Value =
        serde_json::from_str(text).map_err(|e| malformed(e.to_string()))?;
    if value.get("format").and_then(|f| f.as_str()) != Some(format) {
        return Err(malformed(format!("no \"format\": \"{format}\"")));
    }
    let found = value
        .get("version")
        .and_then(|v| v.as_u64())
        .ok_or_else(|| malformed("no version".into()))?;
    if found != u64::from(version) {
        return Err(StoreError::UnsupportedVersion {
            path: path.to_path_buf(),
            found: found.min(u32::MAX as u64) as u32,
            supported: version,
        });
    }
    serde_json::from_value(value).map_err(|e| malformed(e.to_string()))
}

/// Parses a graph file's text; `path` only names it in errors.
pub fn decode(text: &str, path: &Path) -> Result<SavedGraph, StoreError> {
    let malformed = |reason: String| StoreError::Malformed {
        path: path.to_path_buf(),
        reason,
    };
    let body: FileBody = decode_versioned(text, path, FORMAT, VERSION)?;
    let layout = BlockGeometry::new(
        body.layout.file_offset,
        body.layout.data_len,
        body.layout.block_size,
    )
    .map_err(|e| malformed(e.to_string()))?;
    let block_count = layout.block_count();
    let mut transitions = Transitions::new();
    for (from, to, count) in body.edges {
        if from >= block_count || to >= block_count {
            return Err(malformed(format!(
                "edge {from} -> {to} outside the model's {block_count} blocks"
            )));
        }
        transitions.add_edge(from, to, count);
    }
    for (before, block, after, count) in body.contexts {
        if before.max(block).max(after) >= block_count {
            return Err(malformed(format!(
                "step {before} -> {block} -> {after} outside the model's {block_count} blocks"
            )));
        }
        transitions.add_context(before, block, after, count);
    }
    for block in body.lone_blocks.into_iter().filter(|&b| b < block_count) {
        transitions.add_edge(block, block, 0);
    }
    Ok(SavedGraph {
        key: body.model,
        layout,
        transitions,
    })
}

/// Saves the graph learned for `model` beside it, replacing any older one atomically.
pub fn save(
    model: &Path,
    layout: BlockGeometry,
    transitions: &Transitions,
) -> Result<PathBuf, StoreError> {
    let saved = SavedGraph {
        key: ModelKey::of_file(model)?,
        layout,
        transitions: transitions.clone(),
    };
    let path = graph_path(model);
    write_atomically(&path, encode(&saved).as_bytes())?;
    Ok(path)
}

/// Writes `contents` to `path` through a temporary file renamed over it: a reader sees
/// the old file or the new one, never part of one.
pub(crate) fn write_atomically(path: &Path, contents: &[u8]) -> Result<(), StoreError> {
    let mut temp_name = path.as_os_str().to_owned();
    temp_name.push(format!(".tmp{}", std::process::id()));
    let temp = PathBuf::from(temp_name);
    let io = |source| StoreError::Io {
        path: temp.clone(),
        source,
    };
    let mut file = File::create(&temp).map_err(io)?;
    let written = file
        .write_all(contents)
        .and_then(|()| file.sync_all())
        .map_err(io)
        .and_then(|()| {
            std::fs::rename(&temp, path).map_err(|source| StoreError::Io {
                path: path.to_path_buf(),
                source,
            })
        });
    if written.is_err() {
        let _ = std::fs::remove_file(&temp);
    }
    written
}

/// Loads the graph saved beside `model`, if there is one and it was learned from this
/// very file.
pub fn load(model: &Path) -> Result<Loaded, StoreError> {
    let path = graph_path(model);
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Loaded::Absent),
        Err(source) => return Err(StoreError::Io { path, source }),
    };
    let saved = decode(&text, &path)?;
    let key = ModelKey::of_file(model)?;
    if saved.key != key {
        let reason = if saved.key.size != key.size {
            format!(
                "learned from a {}-byte model, this one has {} bytes",
                saved.key.size, key.size
            )
        } else if saved.key.head_hash != key.head_hash {
            "the model's first MiB changed".to_string()
        } else {
            "the model was modified after the graph was learned".to_string()
        };
        return Ok(Loaded::Stale { path, reason });
    }
    Ok(Loaded::Fresh(saved))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("hyperoffload-store-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn sample() -> (BlockGeometry, Transitions) {
        let mut transitions = Transitions::new();
        transitions.observe_all([0, 1, 2, 0, 1, 2]);
        transitions.break_sequence();
        transitions.observe(3);
        (BlockGeometry::new(0, 4 * 4096, 4096).unwrap(), transitions)
    }

    #[test]
    fn saves_and_loads_round_trip() {
        let dir = temp_dir("round-trip");
        let model = dir.join("model.gguf");
        std::fs::write(&model, vec![7u8; 3 * 4096 + 5]).unwrap();
        let (layout, transitions) = sample();
        let path = save(&model, layout.clone(), &transitions).unwrap();
        assert_eq!(path, dir.join("model.gguf.hyperoffload-graph"));
        match load(&model).unwrap() {
            Loaded::Fresh(saved) => {
                assert_eq!(saved.layout, layout);
                assert_eq!(
                    saved.transitions.edges().collect::<Vec<_>>(),
                    transitions.edges().collect::<Vec<_>>()
                );
                assert_eq!(saved.transitions.cyclic_order(), transitions.cyclic_order());
                assert_eq!(saved.transitions.blocks().count(), 4);
            }
            other => panic!("{other:?}"),
        }
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_changed_model_makes_the_graph_stale_and_none_is_absent() {
        let dir = temp_dir("stale");
        let model = dir.join("model.gguf");
        assert!(matches!(load(&model).unwrap(), Loaded::Absent));
        std::fs::write(&model, vec![7u8; 8192]).unwrap();
        let (layout, transitions) = sample();
        save(&model, layout, &transitions).unwrap();
        std::fs::write(&model, vec![8u8; 8192]).unwrap();
        match load(&model).unwrap() {
            Loaded::Stale { reason, .. } => assert!(
                reason.contains("first MiB") || reason.contains("modified"),
                "{reason}"
            ),
            other => panic!("{other:?}"),
        }
        std::fs::write(&model, vec![8u8; 100]).unwrap();
        assert!(
            matches!(load(&model).unwrap(), Loaded::Stale { reason, .. } if reason.contains("100 bytes"))
        );
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn malformed_files_are_typed_errors() {
        let path = Path::new("x.hyperoffload-graph");
        let (layout, transitions) = sample();
        let good = encode(&SavedGraph {
            key: ModelKey {
                size: 1,
                mtime_ns: 2,
                head_hash: "00".into(),
            },
            layout,
            transitions,
        });
        assert!(decode(&good, path).is_ok());
        for bad in [
            "",
            "{",
            "[]",
            "{\"format\": \"other\"}",
            &good.replace("\"version\":1", "\"version\":\"1\""),
            &good.replace("\"block_size\":4096", "\"block_size\":0"),
            &good.replace("[0,1,2]", "[0,99,2]"),
            &good.replace("\"edges\":", "\"edgez\":"),
            &good[..good.len() / 2],
        ] {
            assert!(
                matches!(decode(bad, path), Err(StoreError::Malformed { .. })),
                "{bad}"
            );
        }
        assert!(matches!(
            decode(&good.replace("\"version\":1", "\"version\":7"), path),
            Err(StoreError::UnsupportedVersion { found: 7, .. })
        ));
    }
}
