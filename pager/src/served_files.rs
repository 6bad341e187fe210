//! Served or told why: the model files a program opened or mapped under the shim, what
//! became of each, and the one line the launcher prints for each file not served.
//!
//! The shim records the facts (`SeenFiles`, written as JSON whenever they change, so a
//! program killed by a signal leaves them too); `not_served` turns one file's facts and
//! how the program ended into the reason, a plain function unit-tested here.
//!
//! A file is recorded when the program opens it (open, openat, fopen and their 64-bit
//! and fortified variants) or maps it, if it is a model by name or by its header, or,
//! only when mapped, if it is as large as a model (`FoundBy::Size`: a model in a format
//! the shim does not recognise, which `--match` would serve). Files below
//! `REPORT_FLOOR` are not recorded.

use serde::{Deserialize, Serialize};

use crate::size::format_size;

/// Files smaller than this are not recorded: no model worth paging is, and the shim
/// then looks no further at the many small files a program opens (a Python program's
/// modules) than their size.
pub const REPORT_FLOOR: u64 = 1 << 20;

/// How the shim knew the file for a model.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum FoundBy {
    /// Its name matches a pattern.
    Name,
    /// It starts as a GGUF or safetensors file does.
    Header,
    /// Neither: a read-only mapping of a file at least the minimum size.
    Size,
}

/// Why a mapping of the file was left to the kernel.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[serde(rename_all = "snake_case", tag = "kind", content = "detail")]
pub enum Refusal {
    /// Mapped with PROT_WRITE.
    Writable,
    /// Mapped with arguments the pager does not serve (described).
    Request(String),
    /// The model (all the parts of a split GGUF) is below the minimum size.
    TooSmall,
    /// Neither its name nor its header says it is a model.
    NameNotMatched,
    /// The pager could not start (its error).
    PagerNotStarted(String),
    /// The pager could not map it (its error).
    MapFailed(String),
    /// The name the pager opens no longer led to the mapped file.
    NameChanged,
}

/// What the shim saw of one file.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct SeenFile {
    /// The program's name for it where known, else the kernel's.
    pub path: String,
    pub size: u64,
    /// The bytes of its model (all its parts for a split GGUF) where a mapping of it
    /// was screened, else `size`.
    pub model_len: u64,
    pub found_by: FoundBy,
    /// Opened through a call the shim sees.
    pub opened: bool,
    /// At least one mapping of it was served by the pager.
    pub served: bool,
    /// Why the last mapping of it left to the kernel was.
    pub refused: Option<Refusal>,
}

/// What the shim saw of one process's files, as it writes it.
#[derive(Serialize, Deserialize, Debug, Clone, Default, PartialEq, Eq)]
pub struct SeenFiles {
    /// The executable the process runs.
    pub program: String,
    pub min_size: u64,
    pub patterns: Vec<String>,
    pub files: Vec<SeenFile>,
}

impl SeenFiles {
    /// The JSON the shim writes.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// The facts back from the shim's JSON.
    pub fn from_json(json: &str) -> Option<Self> {
        serde_json::from_str(json).ok()
    }

    pub fn any_served(&self) -> bool {
        self.files.iter().any(|file| file.served)
    }

    /// One line for each file not served (without the `hyperoffload: ` prefix):
    /// `not served: <path> (<size>): <why>`. `killed_by` names the signal that ended
    /// the program, if one did. A file known for a model by its size alone (a large
    /// read-only mapping: perhaps a model under another name, perhaps a library or a
    /// data file) is named only when nothing was served: beside a served model it is
    /// most likely not one.
    pub fn unserved_lines(&self, killed_by: Option<&str>) -> Vec<String> {
        let any_served = self.any_served();
        self.files
            .iter()
            .filter(|file| file.found_by != FoundBy::Size || !any_served)
            .filter_map(|file| {
                let why = not_served(file, self, killed_by)?;
                Some(format!(
                    "not served: {} ({}): {why}",
                    file.path,
                    format_size(file.size)
                ))
            })
            .collect()
    }
}

/// Why `file` was not served, or `None` if it was.
pub fn not_served(file: &SeenFile, seen: &SeenFiles, killed_by: Option<&str>) -> Option<String> {
    if file.served {
        return None;
    }
    let Some(refusal) = &file.refused else {
        return Some(never_mapped(&seen.program, killed_by));
    };
    Some(match refusal {
        Refusal::Writable => "mapped writable; the pager serves read-only mappings only (a page \
             the program wrote could not be dropped and read again)"
            .to_string(),
        Refusal::Request(what) => {
            format!("mapped with {what}, which the pager does not serve")
        }
        Refusal::TooSmall => {
            let model = if file.model_len == file.size {
                String::new()
            } else {
                format!(", its model {}", format_size(file.model_len))
            };
            format!(
                "smaller than --min-size {}{model} (a lower --min-size serves it)",
                format_size(seen.min_size)
            )
        }
        Refusal::NameNotMatched => format!(
            "mapped, but its name matches no --match pattern ({}) and it does not start as a \
             GGUF or safetensors file; --match '{}' serves it",
            seen.patterns.join(", "),
            suggested_pattern(&file.path)
        ),
        Refusal::PagerNotStarted(error) => format!("the pager could not start: {error}"),
        Refusal::MapFailed(error) => format!("the pager could not map it: {error}"),
        Refusal::NameChanged => "its name no longer led to the mapped file (replaced or deleted \
             while open)"
            .to_string(),
    })
}

/// A file the program opened and never mapped: it read it, or a signal came first.
fn never_mapped(program: &str, killed_by: Option<&str>) -> String {
    if let Some(signal) = killed_by {
        return format!("opened, and not yet mapped when the program was killed by {signal}");
    }
    let name = program.rsplit('/').next().unwrap_or(program);
    let hint = if name.starts_with("llama") {
        "; llama.cpp maps it with -lm mmap or the default -lm auto (-lm none, -lm mlock and \
         -lm dio read it; -lm mmap+mlock maps it)"
    } else if name.starts_with("python") {
        "; mmap.mmap, numpy.memmap and safetensors.safe_open map it"
    } else {
        ""
    };
    format!("read with read(), not mapped; the pager serves mapped files only{hint}")
}

/// A `--match` glob for `path`: `*.<extension>` of its file name, else the name.
fn suggested_pattern(path: &str) -> String {
    let name = path.rsplit('/').next().unwrap_or(path);
    match name.rsplit_once('.') {
        Some((stem, extension)) if !stem.is_empty() && !extension.is_empty() => {
            format!("*.{extension}")
        }
        _ => name.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(refused: Option<Refusal>) -> SeenFile {
        SeenFile {
            path: "/models/m.gguf".into(),
            size: 4 << 20,
            model_len: 4 << 20,
            found_by: FoundBy::Name,
            opened: true,
            served: false,
            refused,
        }
    }

    fn seen(program: &str, files: Vec<SeenFile>) -> SeenFiles {
        SeenFiles {
            program: program.into(),
            min_size: 64 << 20,
            patterns: vec!["*.gguf".into(), "*.safetensors".into()],
            files,
        }
    }

    fn why(file: SeenFile, program: &str, killed_by: Option<&str>) -> String {
        let seen = seen(program, vec![file.clone()]);
        not_served(&file, &seen, killed_by).expect("not served")
    }

    #[test]
    fn a_large_mapping_known_by_size_alone_is_named_only_when_nothing_was_served() {
        let other = SeenFile {
            path: "/usr/lib/libtorch_cpu.so".into(),
            found_by: FoundBy::Size,
            refused: Some(Refusal::NameNotMatched),
            ..file(None)
        };
        let alone = seen("python3", vec![other.clone()]);
        assert_eq!(alone.unserved_lines(None).len(), 1);
        let served = SeenFile {
            served: true,
            ..file(None)
        };
        let beside = seen("python3", vec![served, other]);
        assert!(beside.unserved_lines(None).is_empty());
    }

    #[test]
    fn a_served_file_has_no_line() {
        let served = SeenFile {
            served: true,
            refused: Some(Refusal::Writable),
            ..file(None)
        };
        let seen = seen("/bin/llama-completion", vec![served.clone(), file(None)]);
        assert_eq!(not_served(&served, &seen, None), None);
        assert!(seen.any_served());
        assert_eq!(seen.unserved_lines(None).len(), 1);
    }

    #[test]
    fn a_file_read_rather_than_mapped_says_how_llama_cpp_maps_it() {
        let line = why(file(None), "/opt/llama/llama-completion", None);
        assert!(line.starts_with("read with read(), not mapped"), "{line}");
        assert!(line.contains("-lm mmap or the default -lm auto"), "{line}");
        let python = why(file(None), "/usr/bin/python3.11", None);
        assert!(python.ends_with("; mmap.mmap, numpy.memmap and safetensors.safe_open map it"));
        let other = why(file(None), "/bin/victim", None);
        assert_eq!(
            other,
            "read with read(), not mapped; the pager serves mapped files only"
        );
    }

    #[test]
    fn a_signal_before_the_mapping_is_named() {
        let line = why(file(None), "/bin/llama-server", Some("SIGTERM"));
        assert_eq!(
            line,
            "opened, and not yet mapped when the program was killed by SIGTERM"
        );
    }

    #[test]
    fn each_refusal_has_its_reason() {
        assert!(why(file(Some(Refusal::Writable)), "v", None).starts_with("mapped writable"));
        let small = why(file(Some(Refusal::TooSmall)), "v", None);
        assert_eq!(
            small,
            "smaller than --min-size 64.0 MiB (a lower --min-size serves it)"
        );
        let part = SeenFile {
            model_len: 40 << 20,
            ..file(Some(Refusal::TooSmall))
        };
        assert!(why(part, "v", None).contains(", its model 40.0 MiB"));
        let unmatched = SeenFile {
            path: "/data/weights.bin".into(),
            found_by: FoundBy::Size,
            ..file(Some(Refusal::NameNotMatched))
        };
        let line = why(unmatched, "v", None);
        assert!(
            line.contains("matches no --match pattern (*.gguf, *.safetensors)"),
            "{line}"
        );
        assert!(line.ends_with("--match '*.bin' serves it"), "{line}");
        let pager = why(
            file(Some(Refusal::PagerNotStarted(
                "userfaultfd is not permitted".into(),
            ))),
            "v",
            None,
        );
        assert_eq!(
            pager,
            "the pager could not start: userfaultfd is not permitted"
        );
        let request = why(file(Some(Refusal::Request("MAP_FIXED".into()))), "v", None);
        assert_eq!(
            request,
            "mapped with MAP_FIXED, which the pager does not serve"
        );
    }

    #[test]
    fn lines_name_the_file_and_its_size() {
        let seen = seen("v", vec![file(Some(Refusal::Writable))]);
        let lines = seen.unserved_lines(None);
        assert_eq!(lines.len(), 1);
        assert!(
            lines[0].starts_with("not served: /models/m.gguf (4.00 MiB): mapped writable"),
            "{}",
            lines[0]
        );
    }

    #[test]
    fn the_pattern_suggested_is_the_extension_else_the_name() {
        assert_eq!(suggested_pattern("/a/weights.bin"), "*.bin");
        assert_eq!(suggested_pattern("/blobs/sha256-3f2a"), "sha256-3f2a");
        assert_eq!(suggested_pattern("/a/.hidden"), ".hidden");
    }

    #[test]
    fn the_json_round_trips() {
        let seen = seen(
            "/bin/v",
            vec![
                file(Some(Refusal::PagerNotStarted("no".into()))),
                file(None),
            ],
        );
        assert_eq!(SeenFiles::from_json(&seen.to_json()), Some(seen));
        assert_eq!(SeenFiles::from_json("{"), None);
    }
}
