//! What a run learned of a mixture of experts' routing (how often a token uses each
//! expert), saved for the next run of the same model so that it starts warm: beside
//! the model (`<model>.hyperoffload-experts`), or, where the model's directory cannot
//! be written, under `${XDG_CACHE_HOME:-$HOME/.cache}/hyperoffload/learned/`.
//!
//! Small JSON: a format name and version, the key of the model file (as for learned
//! graphs, see [`store`](super::store)), per expert (layer, expert) the tokens in
//! which it was seen used and the tokens it was observed over, and the co-activation
//! counts: per pair of experts of consecutive layers the tokens that used both, and per
//! expert the tokens those pairs were counted over (version 2; a version 1 file has no
//! pairs and is read as such). A file whose key does not match the model is stale:
//! reported, not used. A file that does not parse is an error, never a panic.

use std::path::{Path, PathBuf};

use super::store::{decode_versioned, write_atomically, ModelKey, StoreError};

const FORMAT: &str = "hyperoffload-experts";
const VERSION: u32 = 2;
/// The version before co-activation counts, still read.
const VERSION_WITHOUT_PAIRS: u32 = 1;
const SUFFIX: &str = ".hyperoffload-experts";

/// How often one expert was seen used.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ExpertCount {
    pub layer: u32,
    pub expert: u32,
    /// Tokens in which it was seen used.
    pub uses: f64,
    /// Tokens over which its use was observed (`uses` at most).
    pub tokens: f64,
    /// Tokens in which it was counted as the first of co-activation pairs (see
    /// `ExpertPair`).
    #[serde(default)]
    pub paired_tokens: f64,
}

/// How often a token used both `expert` of `layer` and `next_expert` of the next
/// layer with experts, `next_layer`.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ExpertPair {
    pub layer: u32,
    pub expert: u32,
    pub next_layer: u32,
    pub next_expert: u32,
    /// Tokens (at most the first expert's `paired_tokens`).
    pub tokens: f64,
}

/// What was learned of a model's experts.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ExpertCounts {
    pub experts: Vec<ExpertCount>,
    #[serde(default)]
    pub pairs: Vec<ExpertPair>,
}

#[derive(serde::Serialize, serde::Deserialize)]
struct FileBody {
    format: String,
    version: u32,
    model: ModelKey,
    experts: Vec<ExpertCount>,
    #[serde(default)]
    pairs: Vec<ExpertPair>,
}

/// The result of looking for saved counts.
#[derive(Debug)]
pub enum LoadedCounts {
    Fresh {
        path: PathBuf,
        counts: ExpertCounts,
    },
    /// Counts learned from another version of the model: ignored.
    Stale {
        path: PathBuf,
        reason: String,
    },
    Absent,
}

/// Where counts for `model` are saved beside it.
pub fn beside(model: &Path) -> PathBuf {
    let mut name = model.as_os_str().to_owned();
    name.push(SUFFIX);
    PathBuf::from(name)
}

/// Where counts for `model` go when its directory cannot be written: named by the
/// model's file name and key, so two models of one name do not share counts.
pub fn in_cache(model: &Path, key: &ModelKey) -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|dir| !dir.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".cache")))?;
    let name = model.file_name()?.to_string_lossy();
    Some(
        base.join("hyperoffload")
            .join("learned")
            .join(format!("{name}-{}{SUFFIX}", key.head_hash)),
    )
}

pub fn encode(key: &ModelKey, counts: &ExpertCounts) -> String {
    let body = FileBody {
        format: FORMAT.into(),
        version: VERSION,
        model: key.clone(),
        experts: counts.experts.clone(),
        pairs: counts.pairs.clone(),
    };
    // Plain numbers and strings: serialising cannot fail.
    serde_json::to_string(&body).unwrap_or_default()
}

/// Parses a counts file's text; `path` only names it in errors.
pub fn decode(text: &str, path: &Path) -> Result<(ModelKey, ExpertCounts), StoreError> {
    let body: FileBody = match decode_versioned(text, path, FORMAT, VERSION) {
        Err(StoreError::UnsupportedVersion { found, .. }) if found == VERSION_WITHOUT_PAIRS => {
            decode_versioned(text, path, FORMAT, VERSION_WITHOUT_PAIRS)?
        }
        other => other?,
    };
    let malformed = |reason: String| StoreError::Malformed {
        path: path.to_path_buf(),
        reason,
    };
    for count in &body.experts {
        let sane = count.uses.is_finite()
            && count.tokens.is_finite()
            && count.paired_tokens.is_finite()
            && count.uses >= 0.0
            && count.uses <= count.tokens
            && count.paired_tokens >= 0.0;
        if !sane {
            return Err(malformed(format!(
                "layer {} expert {}: {} uses in {} tokens, {} paired",
                count.layer, count.expert, count.uses, count.tokens, count.paired_tokens
            )));
        }
    }
    for pair in &body.pairs {
        if !(pair.tokens.is_finite() && pair.tokens >= 0.0) || pair.next_layer <= pair.layer {
            return Err(malformed(format!(
                "pair layer {} expert {} -> layer {} expert {}: {} tokens",
                pair.layer, pair.expert, pair.next_layer, pair.next_expert, pair.tokens
            )));
        }
    }
    Ok((
        body.model,
        ExpertCounts {
            experts: body.experts,
            pairs: body.pairs,
        },
    ))
}

/// Saves `counts` for `model`: beside it, else in the cache directory. Returns where.
pub fn save(model: &Path, counts: &ExpertCounts) -> Result<PathBuf, StoreError> {
    let key = ModelKey::of_file(model)?;
    let text = encode(&key, counts);
    let path = beside(model);
    let beside_error = match write_atomically(&path, text.as_bytes()) {
        Ok(()) => return Ok(path),
        Err(error) => error,
    };
    let Some(cached) = in_cache(model, &key) else {
        return Err(beside_error);
    };
    if let Some(dir) = cached.parent() {
        std::fs::create_dir_all(dir).map_err(|source| StoreError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
    }
    write_atomically(&cached, text.as_bytes())?;
    Ok(cached)
}

/// Loads the counts saved for `model` (beside it first), if they were learned from this
/// very file.
pub fn load(model: &Path) -> Result<LoadedCounts, StoreError> {
    let key = ModelKey::of_file(model)?;
    let candidates = [Some(beside(model)), in_cache(model, &key)];
    for path in candidates.into_iter().flatten() {
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(source) => return Err(StoreError::Io { path, source }),
        };
        let (saved, counts) = decode(&text, &path)?;
        if saved != key {
            let reason = if saved.size != key.size {
                format!(
                    "learned from a {}-byte model, this one has {} bytes",
                    saved.size, key.size
                )
            } else {
                "the model changed since".to_string()
            };
            return Ok(LoadedCounts::Stale { path, reason });
        }
        return Ok(LoadedCounts::Fresh { path, counts });
    }
    Ok(LoadedCounts::Absent)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "hyperoffload-expert-store-{name}-{}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn counts() -> ExpertCounts {
        ExpertCounts {
            experts: vec![
                ExpertCount {
                    layer: 0,
                    expert: 3,
                    uses: 12.0,
                    tokens: 40.0,
                    paired_tokens: 12.0,
                },
                ExpertCount {
                    layer: 1,
                    expert: 0,
                    uses: 0.5,
                    tokens: 7.25,
                    paired_tokens: 0.0,
                },
            ],
            pairs: vec![ExpertPair {
                layer: 0,
                expert: 3,
                next_layer: 1,
                next_expert: 0,
                tokens: 0.5,
            }],
        }
    }

    #[test]
    fn a_version_1_file_is_read_without_pairs() {
        let text = r#"{"format":"hyperoffload-experts","version":1,"model":{"size":1,"mtime_ns":1,"head_hash":"0"},"experts":[{"layer":0,"expert":1,"uses":1,"tokens":2}]}"#;
        let (_, counts) = decode(text, Path::new("x")).unwrap();
        assert_eq!(counts.experts.len(), 1);
        assert_eq!(counts.experts[0].paired_tokens, 0.0);
        assert!(counts.pairs.is_empty());
    }

    #[test]
    fn saved_beside_the_model_and_loaded_while_it_is_unchanged() {
        let dir = temp_dir("beside");
        let model = dir.join("m.gguf");
        std::fs::write(&model, vec![7u8; 5000]).unwrap();
        assert!(matches!(load(&model).unwrap(), LoadedCounts::Absent));
        let path = save(&model, &counts()).unwrap();
        assert_eq!(path, dir.join("m.gguf.hyperoffload-experts"));
        match load(&model).unwrap() {
            LoadedCounts::Fresh { counts: loaded, .. } => assert_eq!(loaded, counts()),
            other => panic!("{other:?}"),
        }
        std::fs::write(&model, vec![7u8; 6000]).unwrap();
        match load(&model).unwrap() {
            LoadedCounts::Stale { reason, .. } => assert!(reason.contains("5000"), "{reason}"),
            other => panic!("{other:?}"),
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn malformed_files_are_errors_naming_the_problem() {
        let path = Path::new("x.hyperoffload-experts");
        for (text, expected) in [
            ("{", "not a hyperoffload"),
            (r#"{"format":"other","version":1}"#, "format"),
            (
                r#"{"format":"hyperoffload-experts","version":9}"#,
                "version 9",
            ),
            (
                r#"{"format":"hyperoffload-experts","version":1,"model":{"size":1,"mtime_ns":1,"head_hash":"0"},"experts":[{"layer":0,"expert":1,"uses":5,"tokens":2}]}"#,
                "5 uses in 2 tokens",
            ),
            (
                r#"{"format":"hyperoffload-experts","version":2,"model":{"size":1,"mtime_ns":1,"head_hash":"0"},"experts":[],"pairs":[{"layer":3,"expert":1,"next_layer":3,"next_expert":0,"tokens":1}]}"#,
                "layer 3 expert 1 -> layer 3",
            ),
        ] {
            let error = decode(text, path).unwrap_err().to_string();
            assert!(error.contains(expected), "{text}: {error}");
        }
    }
}
