//! The files of the model a comparison pages: one file, or every part of a split GGUF
//! (`llama-gguf-split`), which the program maps each whole and which count as one model:
//! the budget is a share of all of them, and faults and resident bytes in any of them
//! are the model's.
//!
//! One offset axis for the whole model. The parts are laid end to end, part k from the
//! page boundary after part k - 1 ends, as `ModelGraph::from_parts` lays them with the
//! page as its block. A fault is placed at its part's start plus its offset in the part.
//! So the fault map shows one sweep through the model per token, as for a single file,
//! rather than the parts' sweeps drawn over each other on the same offsets; and the
//! offsets are those of the parts' tensor tables shifted the same way (what
//! `from_parts(parts, 4096)` builds on), so such a table names a fault's tensor without
//! being told its part. A single file's axis is its file offsets.
//!
//! ```text
//!  model axis: 0          start(1)        start(2)           total
//!              | part 0 |pad| part 1     |pad| part 2 |
//! ```

use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Parts start at a multiple of this on the model axis: the page, the unit kernel
/// faults are reported in, so a page of a part stays a page of the axis.
pub const PART_ALIGN: u64 = 4096;

/// One file of the model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelPart {
    pub path: PathBuf,
    pub len: u64,
    /// Where the part's first byte lies on the model axis.
    pub start: u64,
}

impl ModelPart {
    /// The model-axis offset of `file_offset` in this part.
    pub fn model_offset(&self, file_offset: u64) -> u64 {
        self.start + file_offset
    }
}

/// Every file of the model, in order (never empty).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelFiles {
    parts: Vec<ModelPart>,
}

impl ModelFiles {
    /// The model made of `files` (path, length), in order; None when there are none.
    pub fn new(files: impl IntoIterator<Item = (PathBuf, u64)>) -> Option<ModelFiles> {
        let mut start = 0;
        let parts: Vec<ModelPart> = files
            .into_iter()
            .map(|(path, len)| {
                let part = ModelPart { path, len, start };
                start = (start + len).next_multiple_of(PART_ALIGN);
                part
            })
            .collect();
        (!parts.is_empty()).then_some(ModelFiles { parts })
    }

    pub fn parts(&self) -> &[ModelPart] {
        &self.parts
    }

    /// The first file: the model itself when it is not split.
    pub fn first(&self) -> &ModelPart {
        &self.parts[0]
    }

    pub fn is_split(&self) -> bool {
        self.parts.len() > 1
    }

    /// Bytes of all the files: what a percentage budget is a share of (`model_len`).
    pub fn total_len(&self) -> u64 {
        self.parts.iter().map(|part| part.len).sum()
    }

    /// The part whose file is `path` (as `/proc/PID/maps` names it: canonical).
    pub fn part(&self, path: &Path) -> Option<&ModelPart> {
        self.parts.iter().find(|part| part.path == path)
    }

    /// Where each of the shim's regions of the model's files starts on the model axis,
    /// by region id, from the shim's event log (`<trace>.events.jsonl`, whose `map`
    /// events name each region's file: `trace::region_files`).
    pub fn region_starts(&self, events: &str) -> HashMap<u32, u64> {
        hyperoffload::trace::region_files(events)
            .into_iter()
            .filter_map(|(region, path)| Some((region, self.part(&path)?.start)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn three() -> ModelFiles {
        ModelFiles::new([
            (PathBuf::from("/m/s-00001-of-00003.gguf"), 10_000),
            (PathBuf::from("/m/s-00002-of-00003.gguf"), 8192),
            (PathBuf::from("/m/s-00003-of-00003.gguf"), 5),
        ])
        .unwrap()
    }

    #[test]
    fn parts_lie_end_to_end_from_page_boundaries() {
        let model = three();
        let starts: Vec<u64> = model.parts().iter().map(|p| p.start).collect();
        assert_eq!(starts, [0, 12_288, 20_480]);
        assert_eq!(model.total_len(), 18_197);
        assert!(model.is_split());
        assert_eq!(model.parts()[1].model_offset(4096), 16_384);
        assert_eq!(
            model
                .part(Path::new("/m/s-00003-of-00003.gguf"))
                .map(|p| p.start),
            Some(20_480)
        );
        assert_eq!(model.part(Path::new("/m/other.gguf")), None);
    }

    #[test]
    fn a_single_file_is_its_own_axis() {
        let model = ModelFiles::new([(PathBuf::from("/m/model.gguf"), 10_000)]).unwrap();
        assert!(!model.is_split());
        assert_eq!(model.first().start, 0);
        assert_eq!(model.first().model_offset(777), 777);
        assert_eq!(model.total_len(), 10_000);
        assert!(ModelFiles::new([]).is_none());
    }

    #[test]
    fn regions_find_their_part_through_the_shims_map_events() {
        let model = three();
        // A region id the log skips (a mapping that failed after taking one) does not
        // shift the rest; a file that is not the model's has no place.
        let events = r#"{"op":"map","file":0,"region":0,"path":"/m/s-00001-of-00003.gguf","offset":0}
{"op":"hint","advice":3,"t_ms":1.5}
{"op":"map","file":2,"region":2,"path":"/m/s-00002-of-00003.gguf","offset":0}
{"op":"map","file":1,"region":3,"path":"/m/s-00003-of-00003.gguf","offset":0}
not json
{"op":"map","file":3,"region":4,"path":"/m/not-the-model.gguf","offset":0}
"#;
        let starts = model.region_starts(events);
        assert_eq!(starts.len(), 3);
        assert_eq!((starts[&0], starts[&2], starts[&3]), (0, 12_288, 20_480));
    }
}
