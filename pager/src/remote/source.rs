//! What `hyperoffload mount SOURCE` names: an S3 bucket and prefix, or an HTTP base URL,
//! and the object names under it. Pure.

use thiserror::Error;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum SourceError {
    #[error("source `{0}`: expected s3://BUCKET[/PREFIX] or http(s)://HOST[/PATH]")]
    Scheme(String),
    #[error("source `{0}`: no bucket")]
    NoBucket(String),
    #[error("object name `{0}`: must be a relative path without empty, `.` or `..` parts")]
    BadName(String),
    #[error("object name `{0}` is given twice, or is both a file and a directory")]
    Clash(String),
}

/// A remote source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// `s3://bucket/prefix`: objects under `prefix/` (all of them, or those named).
    S3 { bucket: String, prefix: String },
    /// `http(s)://host/path`: the named objects, at `base/name`.
    Http { base: String },
}

impl Source {
    pub fn parse(text: &str) -> Result<Self, SourceError> {
        if let Some(rest) = text.strip_prefix("s3://") {
            let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
            if bucket.is_empty() {
                return Err(SourceError::NoBucket(text.to_string()));
            }
            let prefix = prefix.trim_matches('/').to_string();
            return Ok(Self::S3 {
                bucket: bucket.to_string(),
                prefix,
            });
        }
        if text.starts_with("http://") || text.starts_with("https://") {
            let base = text.trim_end_matches('/');
            if base.split("://").nth(1).is_none_or(str::is_empty) {
                return Err(SourceError::Scheme(text.to_string()));
            }
            return Ok(Self::Http {
                base: base.to_string(),
            });
        }
        Err(SourceError::Scheme(text.to_string()))
    }

    /// The key of object `name` in the store (S3: under the prefix; HTTP: the path
    /// below the base URL).
    pub fn key(&self, name: &str) -> String {
        match self {
            Self::S3 { prefix, .. } if !prefix.is_empty() => format!("{prefix}/{name}"),
            _ => name.to_string(),
        }
    }

    /// The name in the mount of a listed S3 key: the key without the prefix. None for a
    /// key outside the prefix or one that is no file name (a "directory marker" `a/`).
    pub fn name_of(&self, key: &str) -> Option<String> {
        let name = match self {
            Self::S3 { prefix, .. } if !prefix.is_empty() => {
                key.strip_prefix(prefix.as_str())?.strip_prefix('/')?
            }
            _ => key,
        };
        check_name(name).ok().map(|()| name.to_string())
    }
}

/// An object name is a relative path of plain parts.
pub fn check_name(name: &str) -> Result<(), SourceError> {
    let bad = name.is_empty()
        || name.starts_with('/')
        || name.contains('\0')
        || name
            .split('/')
            .any(|part| part.is_empty() || part == "." || part == "..");
    if bad {
        Err(SourceError::BadName(name.to_string()))
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_parse() {
        assert_eq!(
            Source::parse("s3://models/llama/7b/").unwrap(),
            Source::S3 {
                bucket: "models".into(),
                prefix: "llama/7b".into()
            }
        );
        assert_eq!(
            Source::parse("s3://models").unwrap(),
            Source::S3 {
                bucket: "models".into(),
                prefix: "".into()
            }
        );
        assert_eq!(
            Source::parse("http://127.0.0.1:8080/m/").unwrap(),
            Source::Http {
                base: "http://127.0.0.1:8080/m".into()
            }
        );
        assert_eq!(
            Source::parse("s3:///x"),
            Err(SourceError::NoBucket("s3:///x".into()))
        );
        for no_source in ["ftp://x", "http://", "https:///", "/local/dir"] {
            assert_eq!(
                Source::parse(no_source),
                Err(SourceError::Scheme(no_source.into())),
                "{no_source}"
            );
        }
    }

    #[test]
    fn keys_and_names_map_through_the_prefix() {
        let s3 = Source::parse("s3://b/p/q").unwrap();
        assert_eq!(s3.key("m.gguf"), "p/q/m.gguf");
        assert_eq!(s3.name_of("p/q/sub/m.gguf").as_deref(), Some("sub/m.gguf"));
        assert_eq!(s3.name_of("p/qx/m.gguf"), None);
        assert_eq!(s3.name_of("p/q/dir/"), None);
        let root = Source::parse("s3://b").unwrap();
        assert_eq!(root.key("m"), "m");
        assert_eq!(root.name_of("m").as_deref(), Some("m"));
    }

    #[test]
    fn names_are_plain_relative_paths() {
        for good in ["m.gguf", "a/b.safetensors", "..x"] {
            assert!(check_name(good).is_ok(), "{good}");
        }
        for bad in ["", "/abs", "a//b", "a/./b", "../up", "a/..", "a/"] {
            assert_eq!(
                check_name(bad),
                Err(SourceError::BadName(bad.into())),
                "{bad}"
            );
        }
    }
}
