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
//! being told its part. A single file's axis is its file offsets, as before.
//!
//! ```text
//!  model axis: 0          start(1)        start(2)           total
//!              | part 0 |pad| part 1     |pad| part 2 |
//! ```

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

    /// Where each of the shim's regions starts on the model axis, by region id; None
    /// for a region of a file that is not one of the model's. `events` is the shim's
    /// event log (`<trace>.events.jsonl`), `files` the `files` of its stats, in order.
    /// The shim logs a `map` event for each mapping it takes, naming its file by index
    /// into `files` and its region by id; logs from before the id was recorded are read
    /// as region ids count, from 0 in the order the shim maps (the n-th `map` event is
    /// region n).
    pub fn region_starts(&self, events: &str, files: &[PathBuf]) -> Vec<Option<u64>> {
        let mut starts: Vec<Option<u64>> = Vec::new();
        let maps = events
            .lines()
            .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
            .filter(|event| event["op"] == "map");
        for (nth, event) in maps.enumerate() {
            let region = event["region"]
                .as_u64()
                .map_or(Some(nth), |id| usize::try_from(id).ok());
            // Region ids count up from 0: a garbled one is skipped, not allocated for.
            let Some(region) = region.filter(|&id| id < 1 << 20) else {
                continue;
            };
            let start = usize::try_from(event["file"].as_u64().unwrap_or(u64::MAX))
                .ok()
                .and_then(|file| files.get(file))
                .and_then(|file| self.part(file))
                .map(|part| part.start);
            if starts.len() <= region {
                starts.resize(region + 1, None);
            }
            starts[region] = start;
        }
        starts
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
        let files = vec![
            PathBuf::from("/m/s-00001-of-00003.gguf"),
            PathBuf::from("/m/s-00003-of-00003.gguf"),
            PathBuf::from("/m/s-00002-of-00003.gguf"),
            PathBuf::from("/m/not-the-model.gguf"),
        ];
        let events = r#"{"op":"map","file":0,"offset":0,"len":10000,"flags":1,"t_ms":1.0}
{"op":"hint","advice":3,"t_ms":1.5}
{"op":"map","file":1,"offset":0,"len":5,"flags":1,"t_ms":2.0}
{"op":"map","file":2,"offset":0,"len":8192,"flags":1,"t_ms":3.0}
{"op":"map","file":3,"offset":0,"len":4096,"flags":1,"t_ms":4.0}
not json
{"op":"map","file":9,"offset":0,"len":4096,"flags":1,"t_ms":5.0}
"#;
        assert_eq!(
            model.region_starts(events, &files),
            [Some(0), Some(20_480), Some(12_288), None, None]
        );
        // With the ids recorded, a region id the log skips (a mapping that failed
        // after taking one) does not shift the rest.
        let events = r#"{"op":"map","file":0,"region":0,"offset":0,"len":10000,"flags":1}
{"op":"map","file":2,"region":2,"offset":0,"len":8192,"flags":1}
{"op":"map","file":1,"region":3,"offset":0,"len":5,"flags":1}
{"op":"map","file":1,"region":99999999999,"offset":0,"len":5,"flags":1}
"#;
        assert_eq!(
            model.region_starts(events, &files),
            [Some(0), None, Some(12_288), Some(20_480)]
        );
    }
}
