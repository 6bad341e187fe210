//! The files written when the program exits: the stats JSON, the optional fault trace
//! with the shim's own events beside it, and what was learned for the next run (a
//! graph, or how often a mixture of experts' experts ran); and the stats snapshots
//! written while it runs (`write_snapshot`), for a program that ends without running
//! exit handlers (killed by a signal, or `_exit`).
//!
//! A leaf: it knows nothing of the shim's state. The exit handler (`state`) gathers a
//! `Run` from the shim and calls `write`; regions are not dropped at exit (other
//! threads may still be reading them), only the files are written.
//!
//! The JSON holds the pager's `Stats` fields, plus `files` (path, size of every managed
//! file), `config` (the budget as given and in bytes, policy, patterns, minimum size),
//! `pager_heap_bytes` and `pager_heap_peak_bytes` (the pager's own heap, see `heap`),
//! `pid`, `program` (the executable it runs, through any wrapper's exec) and
//! `managed_mappings` (still mapped at exit).
//!
//! Files are created with O_EXCL|O_NOFOLLOW, mode 0600: never clobbered, never through a
//! symlink. With inheritance on, several processes may share one stats path: the first
//! to exit takes it, the others write `<path>.<pid>`.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use hyperoffload::geometry::BlockGeometry;
use hyperoffload::graph::{expert_store, store, Transitions};
use hyperoffload::policy::graph::GraphPrediction;
use hyperoffload::shim_config::ShimConfig;
use hyperoffload::sys::processes::getpid;
use hyperoffload::trace::{events_path, TraceRecord, TraceWriter};
use hyperoffload::Pager;

/// What the report is made of: the running pager and what the shim knows of the run.
pub struct Run<'a> {
    pub config: &'a ShimConfig,
    pub pager: &'a Pager,
    /// Path and size of every managed file, in the order they were first managed.
    pub files: Vec<(PathBuf, u64)>,
    /// What the pager runs ("graph (tensor table, ...)").
    pub policy_in_use: String,
    /// Managed mappings still mapped.
    pub managed_mappings: usize,
    /// The pager's own heap (see `heap`): bytes in use and the peak.
    pub heap_bytes: (usize, usize),
    /// The model whose graph this run learns, and the layout to save it for.
    pub learning: Option<(PathBuf, BlockGeometry)>,
    /// A mixture of experts' model, and the prediction whose expert counts are saved.
    pub experts: Option<(PathBuf, Arc<GraphPrediction>)>,
    /// The learned graph the run followed: removed if the program did not follow it.
    pub followed_graph: Option<PathBuf>,
    /// Takes the shim's own events (one JSON a line), when the trace is written.
    pub take_events: &'a dyn Fn() -> Vec<String>,
    /// Tells the user something (a file that could not be written, what was saved).
    pub say: &'a dyn Fn(&str),
}

/// Writes every file the configuration asks for, and saves what was learned.
pub fn write(run: &Run<'_>) {
    let config = run.config;
    if let Some(path) = &config.stats_path {
        write_new(run, path, stats_json(run).to_string().as_bytes());
    }
    // The pager's faults: for the trace file and for learning the model's graph.
    let (records, untraced) = if config.trace_path.is_some() || run.learning.is_some() {
        run.pager.take_trace()
    } else {
        (Vec::new(), 0)
    };
    if let Some((model, layout)) = &run.learning {
        save_graph(run, model, layout.clone(), &records);
    }
    if let Some((model, prediction)) = run.experts.as_ref().filter(|_| config.saved_experts) {
        save_expert_counts(run, model, prediction);
    }
    if let Some(graph) = &run.followed_graph {
        forget_unfollowed(run, graph);
    }
    if let Some(path) = &config.trace_path {
        write_trace(run, path, &records, untraced);
    }
}

fn stats_json(run: &Run<'_>) -> serde_json::Value {
    let config = run.config;
    let mut json: serde_json::Value =
        serde_json::from_str(&run.pager.stats().to_json()).unwrap_or_default();
    json["files"] = run
        .files
        .iter()
        .map(|(path, size)| serde_json::json!({"path": path, "size": size}))
        .collect();
    json["config"] = serde_json::json!({
        "budget": config.budget.to_env_value(),
        "budget_bytes": run.pager.budget(),
        "policy": config.policy,
        "policy_in_use": run.policy_in_use,
        "patterns": config.patterns,
        "min_size": config.min_size,
    });
    // The pager's own heap beside the budget's frames (see `heap`).
    json["pager_heap_bytes"] = run.heap_bytes.0.into();
    json["pager_heap_peak_bytes"] = run.heap_bytes.1.into();
    json["pid"] = getpid().into();
    // The program this process runs now: after a wrapper's exec, the real one.
    json["program"] = std::fs::read_link("/proc/self/exe")
        .map(|exe| exe.display().to_string())
        .unwrap_or_default()
        .into();
    json["managed_mappings"] = run.managed_mappings.into();
    json
}

/// Writes the stats as they are now (with `"snapshot": true`) to
/// `dir/snapshot-<pid>.json`, replacing the previous snapshot: written to a temporary
/// file in `dir` and renamed over it, so a reader finds a whole snapshot, this one or
/// the one before, whenever the process dies.
pub fn write_snapshot(run: &Run<'_>, dir: &Path) -> std::io::Result<()> {
    let mut json = stats_json(run);
    json["snapshot"] = true.into();
    let name = format!("snapshot-{}.json", getpid());
    crate::replace_file::write_replacing(dir, &name, json.to_string().as_bytes())
}

/// Saves the access order of the model's first region (region ids count from 0: the
/// first is the one the graph is for) for the next run.
fn save_graph(run: &Run<'_>, model: &Path, layout: BlockGeometry, records: &[TraceRecord]) {
    let mut transitions = Transitions::new();
    transitions.observe_all(
        records
            .iter()
            .filter(|record| record.region == 0)
            .map(|record| record.block),
    );
    match store::save(model, layout, &transitions) {
        Ok(saved) => (run.say)(&format!(
            "learned the access order of {} from {} faults; saved {} for the next run",
            model.display(),
            records.len(),
            saved.display()
        )),
        Err(error) => (run.say)(&format!("cannot save the learned graph: {error}")),
    }
}

/// Removes the learned graph `graph` if the program did not follow it (the run read
/// ahead in few or none of its parts): the next run records the order again.
fn forget_unfollowed(run: &Run<'_>, graph: &Path) {
    let Some(prediction) = run.pager.stats().prediction else {
        return;
    };
    if !prediction.not_followed() {
        return;
    }
    let what = format!(
        "the program did not follow the order learned in {} ({} of {} parts; {} of {} \
         faults elsewhere than planned)",
        graph.display(),
        prediction.failing_parts,
        prediction.parts,
        prediction.surprise_faults,
        prediction.surprise_faults + prediction.expected_faults,
    );
    match std::fs::remove_file(graph) {
        Ok(()) => (run.say)(&format!(
            "{what}; removed it, so the next run records the order again"
        )),
        Err(error) => (run.say)(&format!("{what}; cannot remove it: {error}")),
    }
}

/// Saves what this run learned of the model's routing for the next run, once it has
/// followed a few tokens.
fn save_expert_counts(run: &Run<'_>, model: &Path, prediction: &GraphPrediction) {
    const MIN_TOKENS: u64 = 2;
    if prediction.expert_tokens() < MIN_TOKENS {
        return;
    }
    let Some(counts) = prediction.expert_counts() else {
        return;
    };
    match expert_store::save(model, &counts) {
        Ok(saved) => {
            if run.config.verbose {
                (run.say)(&format!(
                    "saved the use of {} experts over {} tokens to {} for the next run",
                    counts.experts.len(),
                    prediction.expert_tokens(),
                    saved.display()
                ));
            }
        }
        Err(error) => (run.say)(&format!(
            "cannot save what was learned of the experts: {error}"
        )),
    }
}

/// The fault trace CSV at `path`, and the shim's own decisions (what it took over,
/// hints, unmaps), one JSON a line, beside it.
fn write_trace(run: &Run<'_>, path: &Path, records: &[TraceRecord], untraced: u64) {
    let mut metadata: Vec<(&str, String)> = vec![
        ("block_size", run.pager.block_size().to_string()),
        (
            hyperoffload::trace::EXPERT_BLOCKS_KEY,
            u8::from(run.config.expert_blocks).to_string(),
        ),
        ("untraced", untraced.to_string()),
    ];
    if let Some((file, size)) = run.files.first() {
        metadata.push(("file", file.display().to_string()));
        metadata.push(("size", size.to_string()));
    }
    let csv = TraceWriter::new(Vec::new(), &metadata).and_then(|mut writer| {
        for record in records {
            writer.write(record)?;
        }
        writer.into_inner()
    });
    if let Ok(csv) = csv {
        write_new(run, path, &csv);
    }
    let mut lines = (run.take_events)().join("\n");
    lines.push('\n');
    write_new(run, &events_path(path), lines.as_bytes());
}

/// Creates `path` (or `<path>.<pid>` if taken and processes share it) with `contents`.
fn write_new(run: &Run<'_>, path: &Path, contents: &[u8]) {
    let create = |path: &Path| {
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(path)
    };
    let mut target: PathBuf = path.to_path_buf();
    let mut file = create(&target);
    if run.config.inherit
        && matches!(&file, Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists)
    {
        target = PathBuf::from(format!("{}.{}", path.display(), getpid()));
        file = create(&target);
    }
    let written = file.and_then(|mut file| file.write_all(contents));
    if let Err(error) = written {
        (run.say)(&format!("cannot write {}: {error}", target.display()));
    }
}
