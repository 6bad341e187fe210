//! The stats JSON (and the optional fault trace, with the shim's own events beside it)
//! written when the program exits, with what was learned for the next run (a graph, or
//! how often a mixture of experts' experts ran): from an
//! atexit handler registered when the pager starts. Regions are not dropped at exit
//! (other threads may still be reading them); only the files are written.
//!
//! The JSON holds the pager's `Stats` fields, plus `files` (path, size of every managed
//! file), `config` (the budget as given and in bytes, policy, patterns, minimum size),
//! `pager_heap_bytes` and `pager_heap_peak_bytes` (the pager's own heap, see `heap`),
//! `pid` and `managed_mappings` (still mapped at exit).
//!
//! Files are created with O_EXCL|O_NOFOLLOW, mode 0600: never clobbered, never through a
//! symlink. With inheritance on, several processes may share one stats path: the first
//! to exit takes it, the others write `<path>.<pid>`.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use hyperoffload::graph::Transitions;
use hyperoffload::graph::{expert_store, store};
use hyperoffload::policy::graph::GraphPrediction;
use hyperoffload::trace::{events_path, TraceWriter};

use crate::{managed::Reentry, state};

static REGISTERED: AtomicBool = AtomicBool::new(false);

/// Registers the exit handler (once).
pub fn register() {
    if !REGISTERED.swap(true, Ordering::AcqRel) {
        // SAFETY: registers a plain extern "C" function with no arguments.
        unsafe { libc::atexit(write_at_exit) };
    }
}

extern "C" fn write_at_exit() {
    // A child inherits the handler but not the pager's service thread: asking it for
    // stats would wait forever. However the child was made (daemon, _Fork, a raw
    // system call), the check sees it; the report is the parent's to write.
    if state::is_forked_child() {
        return;
    }
    let Some(shim) = state::shim_even_if_disabled() else {
        return;
    };
    let Some(pager) = shim.pager_if_running() else {
        return;
    };
    let _reentry = Reentry::enter();
    let config = &shim.config;
    if let Some(path) = &config.stats_path {
        let stats = pager.stats();
        let mut json: serde_json::Value =
            serde_json::from_str(&stats.to_json()).unwrap_or_default();
        json["files"] = shim
            .files()
            .into_iter()
            .map(|(path, size)| serde_json::json!({"path": path, "size": size}))
            .collect();
        json["config"] = serde_json::json!({
            "budget": config.budget.to_env_value(),
            "budget_bytes": pager.budget(),
            "policy": config.policy,
            "policy_in_use": shim.policy_in_use(),
            "patterns": config.patterns,
            "min_size": config.min_size,
        });
        // The pager's own heap beside the budget's frames (see `heap`).
        json["pager_heap_bytes"] = crate::heap::in_use().into();
        json["pager_heap_peak_bytes"] = crate::heap::peak().into();
        // SAFETY: getpid has no memory effects.
        json["pid"] = unsafe { libc::getpid() }.into();
        json["managed_mappings"] = shim.managed_count().into();
        write_new(shim, path, config.inherit, json.to_string().as_bytes());
    }
    // The pager's faults: for the trace file and for learning the model's graph.
    let (records, untraced) = if config.trace_path.is_some() || shim.learning().is_some() {
        pager.take_trace()
    } else {
        (Vec::new(), 0)
    };
    if let Some((model, layout)) = shim.learning() {
        // The first region is the one the graph is for (region ids count from 0).
        let mut transitions = Transitions::new();
        transitions.observe_all(
            records
                .iter()
                .filter(|record| record.region == 0)
                .map(|record| record.block),
        );
        match store::save(&model, layout, &transitions) {
            Ok(saved) => shim.say(&format!(
                "learned the access order of {} from {} faults; saved {} for the next run",
                model.display(),
                records.len(),
                saved.display()
            )),
            Err(error) => shim.say(&format!("cannot save the learned graph: {error}")),
        }
    }
    if let Some((model, prediction)) = shim.expert_learning() {
        save_expert_counts(shim, &model, &prediction);
    }
    if let Some(path) = &config.trace_path {
        let files = shim.files();
        let mut metadata: Vec<(&str, String)> = vec![
            ("block_size", pager.block_size().to_string()),
            ("untraced", untraced.to_string()),
        ];
        if let Some((file, size)) = files.first() {
            metadata.push(("file", file.display().to_string()));
            metadata.push(("size", size.to_string()));
        }
        let csv = TraceWriter::new(Vec::new(), &metadata).and_then(|mut writer| {
            for record in &records {
                writer.write(record)?;
            }
            writer.into_inner()
        });
        if let Ok(csv) = csv {
            write_new(shim, path, config.inherit, &csv);
        }
        // The shim's own decisions (what it took over, hints, unmaps), one JSON a line.
        let mut lines = shim.take_trace().join("\n");
        lines.push('\n');
        write_new(shim, &events_path(path), config.inherit, lines.as_bytes());
    }
}

/// Saves what this run learned of the model's routing for the next run, once it has
/// followed a few tokens.
fn save_expert_counts(shim: &crate::managed::Shim, model: &Path, prediction: &GraphPrediction) {
    const MIN_TOKENS: u64 = 2;
    if prediction.expert_tokens() < MIN_TOKENS {
        return;
    }
    let Some(counts) = prediction.expert_counts() else {
        return;
    };
    match expert_store::save(model, &counts) {
        Ok(saved) => {
            if shim.config.verbose {
                shim.say(&format!(
                    "saved the use of {} experts over {} tokens to {} for the next run",
                    counts.experts.len(),
                    prediction.expert_tokens(),
                    saved.display()
                ));
            }
        }
        Err(error) => shim.say(&format!(
            "cannot save what was learned of the experts: {error}"
        )),
    }
}

fn write_new(shim: &crate::managed::Shim, path: &Path, inherit: bool, contents: &[u8]) {
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
    if inherit && matches!(&file, Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists) {
        // SAFETY: getpid has no memory effects.
        let pid = unsafe { libc::getpid() };
        target = PathBuf::from(format!("{}.{pid}", path.display()));
        file = create(&target);
    }
    let written = file.and_then(|mut file| file.write_all(contents));
    if let Err(error) = written {
        shim.say(&format!("cannot write {}: {error}", target.display()));
    }
}
