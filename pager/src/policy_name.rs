//! Policies by the names users give them (`hyperoffload run --policy`, the shim's
//! `HYPEROFFLOAD_POLICY`). One table, so a new policy is added in one place.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use thiserror::Error;

use crate::geometry::BlockGeometry;
use crate::graph::expert_store::{self, LoadedCounts};
use crate::graph::store::{self, Loaded};
use crate::graph::{GraphSource, ModelGraph, PartTensors};
use crate::model::split::split_parts;
use crate::model::ModelFile;
use crate::policy::graph::GraphPrediction;
use crate::policy::{
    EvictionKind, EvictionPolicy, PrefetchKind, PrefetchPolicy, RecordingEviction,
};

/// A prefetch and an eviction policy chosen together, and what was chosen.
pub struct PolicyPair {
    pub prefetch: Box<dyn PrefetchPolicy>,
    pub eviction: Box<dyn EvictionPolicy>,
    /// What was built, for people: "graph (tensor table, 23456 blocks)", or why a
    /// fallback was taken.
    pub description: String,
    /// The graph must be learned from this run's faults and saved beside the model
    /// (graph requested, neither a tensor table nor a usable saved graph): record every
    /// fault and call `graph::store::save` at the end. Never set for a run that has a
    /// graph (see `policies_by_name`).
    pub learn: Option<crate::geometry::BlockGeometry>,
    /// The graph policies' shared prediction of a mixture of experts, already started
    /// from counts an earlier run saved: save `expert_counts` at the end
    /// (`graph::expert_store::save`) for the next run.
    pub experts: Option<Arc<GraphPrediction>>,
    /// The graph saved by an earlier run that this run follows (a learned order), to
    /// forget at the end if the program did not follow it
    /// (`ConfidenceSummary::not_followed`): the next run then records the order again.
    pub followed_graph: Option<PathBuf>,
}

/// The names accepted, the default first, with what each means.
pub const POLICY_NAMES: &[(&str, &str)] = &[
    (
        "graph",
        "prefetch along the model's predicted execution order and evict the block used \
         furthest ahead (the default); the order comes from the tensor table of a GGUF or \
         safetensors file, or from a graph learned in an earlier run; without either, \
         readahead",
    ),
    ("readahead", "sequential readahead on faults, FIFO eviction"),
    ("demand", "read only what faults, FIFO eviction"),
    (
        "lru",
        "sequential readahead, evict the least recently faulted block",
    ),
    ("clock", "sequential readahead, CLOCK eviction over faults"),
];

pub const DEFAULT_POLICY: &str = "graph";

#[derive(Debug, Error, PartialEq, Eq)]
#[error("unknown policy `{name}` (known: {known})")]
pub struct UnknownPolicy {
    pub name: String,
    pub known: String,
}

/// The model file a policy is for: the file range the first region presents, the
/// pager's block size, and where the region's blocks are cut besides
/// (`MapOptions::block_cuts`); and whether what earlier runs learned of it counts.
#[derive(Debug, Clone, Copy)]
pub struct ModelHint<'a> {
    pub path: &'a Path,
    pub file_offset: u64,
    pub data_len: u64,
    pub block_size: u64,
    pub block_cuts: &'a [u64],
    /// Start a mixture of experts' ranking from the expert use an earlier run saved
    /// beside the model (`graph::expert_store`); without it the run learns alone.
    pub saved_experts: bool,
}

impl ModelHint<'_> {
    /// The geometry of the region the hint describes.
    pub fn geometry(&self) -> Result<BlockGeometry, crate::geometry::GeometryError> {
        BlockGeometry::new(self.file_offset, self.data_len, self.block_size)?
            .with_file_cuts(self.block_cuts.iter().copied())
    }
}

/// Whether `name` names a policy.
pub fn check_policy_name(name: &str) -> Result<(), UnknownPolicy> {
    kinds(name).map(|_| ())
}

/// Builds the policies `name` stands for; the graph policy builds its graph for `model`.
pub fn policies_by_name(
    name: &str,
    model: Option<&ModelHint<'_>>,
) -> Result<PolicyPair, UnknownPolicy> {
    let (prefetch, eviction) = kinds(name)?;
    if prefetch != PrefetchKind::Graph {
        return Ok(PolicyPair {
            prefetch: prefetch.build(),
            eviction: eviction.build(),
            description: name.to_string(),
            learn: None,
            experts: None,
            followed_graph: None,
        });
    }
    Ok(match model.map(model_graph) {
        Some(Ok((graph, source))) => graph_pair(prefetch, eviction, graph, source, model),
        Some(Err(why)) => recording_pair(&why, model),
        None => recording_pair("no model file", model),
    })
}

/// The graph policies of `graph` (found by `source`), their experts seeded with what
/// an earlier run of `model` learned of its routing.
fn graph_pair(
    prefetch: PrefetchKind,
    eviction: EvictionKind,
    graph: ModelGraph,
    source: String,
    model: Option<&ModelHint<'_>>,
) -> PolicyPair {
    let followed_graph = (graph.source() == GraphSource::Learned)
        .then(|| model.map(|hint| store::graph_path(hint.path)))
        .flatten();
    let blocks = graph.geometry().block_count();
    let has_experts = !graph.experts().is_empty();
    let prediction = GraphPrediction::new(Arc::new(graph));
    let mut description = format!("graph ({source}, {blocks} blocks)");
    if has_experts {
        description.push_str(&seed_saved_experts(&prediction, model));
    }
    PolicyPair {
        prefetch: prefetch.build_with(Some(&prediction)),
        eviction: eviction.build_with(Some(&prediction)),
        experts: has_experts.then(|| Arc::clone(&prediction)),
        description,
        // A run with a graph learns nothing: it prefetches, so only mispredicted
        // blocks fault, and the transitions among those few are no access order.
        // Saving them would replace the recording with a poorer graph, and the
        // run after that would be nearly as bad as none. The recording is kept
        // until the model changes (its key no longer matches) or the graph file
        // is deleted, which makes the next run record again.
        learn: None,
        followed_graph,
    }
}

/// Seeds `prediction`'s experts with the use an earlier run of `model` saved, when the
/// run allows it, and says what came of it (for the policies' description).
fn seed_saved_experts(prediction: &GraphPrediction, model: Option<&ModelHint<'_>>) -> String {
    // A model is used more than once: what an earlier run learned of its routing ranks
    // the experts from the first token.
    let path = model
        .filter(|hint| hint.saved_experts)
        .map(|hint| hint.path);
    match path.map(expert_store::load) {
        Some(Ok(LoadedCounts::Fresh { path, counts })) => {
            let matched = prediction.seed_expert_counts(&counts);
            format!("; use of {matched} experts from {}", path.display())
        }
        Some(Ok(LoadedCounts::Stale { path, reason })) => {
            format!("; {} ignored: {reason}", path.display())
        }
        Some(Err(error)) => format!("; saved expert use ignored: {error}"),
        Some(Ok(LoadedCounts::Absent)) | None => String::new(),
    }
}

/// The policies of a run whose model has no graph yet (`why`): a recording run.
fn recording_pair(why: &str, model: Option<&ModelHint<'_>>) -> PolicyPair {
    // Demand paging makes every block fault (once per pass under a budget smaller than
    // the file), so the trace holds the whole access order to learn from; readahead
    // would hide most of it.
    let learn = model.and_then(|hint| hint.geometry().ok());
    let (prefetch, eviction, what): (_, Box<dyn EvictionPolicy>, _) = match learn {
        // Resident blocks are watched (with zero copy), so that every access is
        // recorded, not only the misses.
        Some(_) => (
            PrefetchKind::None,
            Box::new(RecordingEviction::default()),
            "demand paging, recording the access order to learn a graph",
        ),
        None => (
            PrefetchKind::Readahead,
            EvictionKind::Fifo.build(),
            "readahead",
        ),
    };
    PolicyPair {
        prefetch: prefetch.build(),
        eviction,
        description: format!("{what} (graph unavailable: {why})"),
        learn,
        experts: None,
        followed_graph: None,
    }
}

const LEARNED: &str = "learned graph";

/// The model's graph: from its tensor table (the tables of all its files for a split
/// GGUF), else from a graph saved beside it by an earlier run. Errors say why neither
/// was usable.
fn model_graph(hint: &ModelHint<'_>) -> Result<(ModelGraph, String), String> {
    let layout = hint.geometry().map_err(|error| error.to_string())?;
    let table = match ModelFile::open(hint.path) {
        Ok(model) => return Ok(table_graph(&model, layout)),
        Err(error) => error.to_string(),
    };
    match store::load(hint.path) {
        Ok(Loaded::Fresh(saved)) if saved.layout == layout => Ok((
            ModelGraph::learned(layout, &saved.transitions),
            LEARNED.to_string(),
        )),
        Ok(Loaded::Fresh(_)) => Err(format!("{table}; the saved graph is for another layout")),
        Ok(Loaded::Stale { reason, .. }) => Err(format!("{table}; saved graph ignored: {reason}")),
        Ok(Loaded::Absent) => Err(table),
        Err(error) => Err(format!("{table}; {error}")),
    }
}

/// The graph of `model`'s tensor table as a region of geometry `layout` presents it;
/// for a part of a split GGUF, of all the parts' tables (each file presented whole).
/// Parts that cannot be gathered leave the graph to this file's table, and say why.
fn table_graph(model: &ModelFile, layout: BlockGeometry) -> (ModelGraph, String) {
    let (graph, source) = table_graph_of_parts(model, layout);
    (graph.with_experts_used(model.experts_used()), source)
}

fn table_graph_of_parts(model: &ModelFile, layout: BlockGeometry) -> (ModelGraph, String) {
    let block_size = layout.block_size;
    let whole_file = layout.file_offset == 0 && layout.data_len == model.file_len;
    let alone = |why: String| {
        (
            ModelGraph::from_tensors(&model.tensors, layout.clone()),
            why,
        )
    };
    let parts = match split_parts(model) {
        Ok(None) => return alone("tensor table".to_string()),
        // The parts' graph binds regions presenting whole files (as llama.cpp maps them).
        Ok(Some(_)) if !whole_file => {
            let (offset, len) = (layout.file_offset, layout.data_len);
            return alone(format!(
                "tensor table of this split file, mapped in part ({len} bytes from offset {offset})"
            ));
        }
        Ok(Some(parts)) => parts,
        Err(error) => return alone(format!("tensor table of this split file: {error}")),
    };
    let tables: Vec<PartTensors> = parts.iter().map(PartTensors::from).collect();
    match ModelGraph::from_parts(&tables, block_size) {
        Ok(graph) => (
            graph,
            format!("tensor tables of {} split files", parts.len()),
        ),
        Err(error) => alone(format!("tensor table of this split file: {error}")),
    }
}

fn kinds(name: &str) -> Result<(PrefetchKind, EvictionKind), UnknownPolicy> {
    match name {
        "graph" => Ok((PrefetchKind::Graph, EvictionKind::Graph)),
        "readahead" => Ok((PrefetchKind::Readahead, EvictionKind::Fifo)),
        "demand" => Ok((PrefetchKind::None, EvictionKind::Fifo)),
        "lru" => Ok((PrefetchKind::Readahead, EvictionKind::Lru)),
        "clock" => Ok((PrefetchKind::Readahead, EvictionKind::Clock)),
        _ => Err(UnknownPolicy {
            name: name.to_string(),
            known: POLICY_NAMES
                .iter()
                .map(|(name, _)| *name)
                .collect::<Vec<_>>()
                .join(", "),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_listed_name_builds() {
        for (name, _) in POLICY_NAMES {
            let pair = policies_by_name(name, None).unwrap();
            assert!(!pair.prefetch.name().is_empty());
        }
        assert_eq!(POLICY_NAMES[0].0, DEFAULT_POLICY);
    }

    #[test]
    fn graph_without_a_model_falls_back_and_says_why() {
        let pair = policies_by_name("graph", None).unwrap();
        assert_eq!(pair.prefetch.name(), "readahead");
        assert!(
            pair.description.contains("no model file"),
            "{}",
            pair.description
        );
        let hint = ModelHint {
            path: Path::new("/nonexistent/model.bin"),
            file_offset: 0,
            data_len: 1 << 20,
            block_size: 4096,
            block_cuts: &[],
            saved_experts: true,
        };
        let pair = policies_by_name("graph", Some(&hint)).unwrap();
        assert_eq!(
            pair.prefetch.name(),
            "none",
            "a recording run pages on demand"
        );
        assert!(pair.learn.is_some());
        assert!(
            pair.description.contains("graph unavailable"),
            "{}",
            pair.description
        );
    }

    #[test]
    fn a_run_with_a_learned_graph_keeps_it_rather_than_learning_again() {
        let dir = std::env::temp_dir().join(format!("policy-learned-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let model = dir.join("m.bin");
        std::fs::write(&model, vec![7u8; 16 * 4096]).unwrap();
        let hint = ModelHint {
            path: &model,
            file_offset: 0,
            data_len: 16 * 4096,
            block_size: 4096,
            block_cuts: &[],
            saved_experts: true,
        };
        let recording = policies_by_name("graph", Some(&hint)).unwrap();
        let layout = recording.learn.expect("no graph yet: a recording run");
        let mut transitions = crate::graph::Transitions::new();
        transitions.observe_all((0..16).chain(0..16));
        store::save(&model, layout, &transitions).unwrap();
        let pair = policies_by_name("graph", Some(&hint)).unwrap();
        assert!(pair.description.contains(LEARNED), "{}", pair.description);
        assert!(pair.learn.is_none(), "the learned graph would be replaced");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_split_part_mapped_whole_gets_the_parts_graph_and_in_part_its_own() {
        use crate::model::split::{part_path, write_test_part};
        let dir = std::env::temp_dir().join(format!("policy-split-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for no in 0..2 {
            write_test_part(&part_path(&dir.join("m"), no, 2), Some((no as u16, 2)));
        }
        let first = part_path(&dir.join("m"), 0, 2);
        let len = std::fs::metadata(&first).unwrap().len();
        let hint = |file_offset: u64, data_len: u64| ModelHint {
            path: &first,
            file_offset,
            data_len,
            block_size: 4096,
            block_cuts: &[],
            saved_experts: true,
        };
        let whole = policies_by_name("graph", Some(&hint(0, len))).unwrap();
        assert!(
            whole.description.contains("2 split files"),
            "{}",
            whole.description
        );
        let in_part = policies_by_name("graph", Some(&hint(0, len - 32))).unwrap();
        assert!(
            in_part.description.contains("mapped in part"),
            "{}",
            in_part.description
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn unknown_names_list_the_known_ones() {
        let error = check_policy_name("belady").unwrap_err();
        assert!(error.to_string().contains("readahead"), "{error}");
    }
}
