//! `hyperoffload trace`: a program's faults under the pager, as a Chrome/Perfetto trace
//! and the block-access CSV that `simulate` replays. The exit status is the program's
//! (see `exit_status`), after the trace is written.

use std::collections::HashMap;
use std::ffi::OsString;
use std::io::BufReader;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, ExitStatus};

use anyhow::{bail, Context};
use serde_json::json;

use super::compare::chrome_trace::{chrome_trace, named_csv, RegionTensors};
use super::compare::find_model_argument;
use hyperoffload::model::{ModelFile, TensorInfo};
use hyperoffload::trace::{events_path, region_files, TraceReader};

use super::{child, exit_status};

#[derive(clap::Args)]
pub struct TraceArgs {
    /// The Chrome trace JSON to write; the pager's CSV goes next to it (`.csv`, the
    /// format `simulate --trace` reads) with a copy naming each fault's tensor and, in
    /// a merged expert tensor, its expert (`.tensors.csv`). A name ending in .csv is
    /// refused: the JSON would overwrite the CSV (`--out rec.json`
    /// writes rec.csv too). A recording replaces these files and the shim's events
    /// beside the CSV (`.csv.events.jsonl`) from an earlier run.
    #[arg(long, default_value = "trace.json")]
    out: PathBuf,
    /// RAM for the model's pages, as `run --budget` takes it (a size, or `N%` of the
    /// model). Default: `run`'s.
    #[arg(long, value_parser = checked(super::run::budget_arg))]
    budget: Option<String>,
    /// Prefetch and eviction policy, as `run --policy` takes it. Default: `run`'s.
    #[arg(long, value_parser = super::run::policy_arg)]
    policy: Option<String>,
    /// Block size, as `run --block` takes it. Default: `run`'s.
    #[arg(long, value_parser = checked(super::run::block_arg))]
    block: Option<String>,
    /// Let programs the target executes use the shim too, as `run --inherit`.
    #[arg(long)]
    inherit: bool,
    /// Blocks on the block-size grid alone, as `run --no-expert-blocks`.
    #[arg(long)]
    no_expert_blocks: bool,
    /// Convert this recorded fault trace CSV instead of running a program. It is copied
    /// to the CSV beside --out unless it is that file (by any name); it may not be the
    /// JSON or the tensor-named CSV, which would overwrite it.
    #[arg(long, conflicts_with = "program")]
    from: Option<PathBuf>,
    /// The model file whose tensors name the first mapped file's faults where the
    /// shim's events do not say which file that was (a trace recorded before they did;
    /// default: the program's *.gguf/*.safetensors argument).
    #[arg(long)]
    model: Option<PathBuf>,
    /// The program and its arguments.
    #[arg(last = true, required_unless_present = "from")]
    program: Vec<OsString>,
}

/// A value parser that checks an argument with `parse` and keeps its text, to be passed
/// on to `hyperoffload run` as it was given.
fn checked<T>(
    parse: fn(&str) -> Result<T, String>,
) -> impl Fn(&str) -> Result<String, String> + Clone {
    move |text| parse(text).map(|_| text.to_string())
}

/// Records (or takes `--from`) the CSV and converts it. The exit status is the
/// program's, as `hyperoffload run` passes it on, once the trace is written: a failed
/// program still leaves what it did, and scripts still see that it failed.
pub fn run(args: TraceArgs) -> anyhow::Result<ExitCode> {
    let outputs = Outputs::for_json(&args.out)?;
    let status = match &args.from {
        Some(from) => {
            copy_recording(from, &outputs)?;
            None
        }
        None => {
            clear_outputs(&outputs)?;
            Some(record(&args, &outputs.csv)?)
        }
    };
    let failed = status.filter(|status| !status.success());
    if let Some(status) = failed {
        eprintln!("warning: the program ended with {status}");
        if !outputs.csv.exists() {
            // Nothing to convert: a program killed by a signal runs no exit handlers,
            // so the shim wrote nothing. Its status says more than an error of ours.
            eprintln!(
                "`hyperoffload run` left no trace at {}",
                outputs.csv.display()
            );
            return Ok(exit_status::pass_through(status));
        }
    }
    convert(&args, &outputs)?;
    Ok(failed.map_or(ExitCode::SUCCESS, exit_status::pass_through))
}

/// Runs the program under `hyperoffload run`, which writes the fault CSV at `csv` (and
/// the shim's events beside it).
fn record(args: &TraceArgs, csv: &Path) -> anyhow::Result<ExitStatus> {
    let mut command = Command::new(std::env::current_exe()?);
    command.arg("run");
    let given = [
        ("--budget", &args.budget),
        ("--policy", &args.policy),
        ("--block", &args.block),
    ];
    for (option, value) in given {
        if let Some(value) = value {
            command.arg(option).arg(value);
        }
    }
    if args.inherit {
        command.arg("--inherit");
    }
    if args.no_expert_blocks {
        command.arg("--no-expert-blocks");
    }
    command
        .arg("--trace")
        .arg(csv)
        .arg("--")
        .args(&args.program);
    // If this process dies first, the launcher gets SIGTERM and passes it on to the
    // program, rather than both running on unattended.
    child::end_with_this_process(&mut command, libc::SIGTERM);
    let mut child = command.spawn().context("starting `hyperoffload run`")?;
    // The terminal's ^C goes to the program too; one that ends on it normally writes its
    // trace, which is then converted here, as the launcher reports it: this process
    // died of the ^C at once and the trace was never converted.
    let previous = child::ignore_interrupts();
    let status = child.wait().context("waiting for `hyperoffload run`");
    child::restore_interrupts(previous);
    let status = status?;
    if status.success() && !csv.exists() {
        bail!("`hyperoffload run` left no trace at {}", csv.display());
    }
    Ok(status)
}

/// Removes what an earlier trace to the same outputs left, before the program runs: the
/// launcher and the shim never overwrite a trace (the shim keeps an old events file with
/// only a message), and a run that leaves no trace must not leave the previous run's
/// JSON looking like its own.
fn clear_outputs(outputs: &Outputs) -> anyhow::Result<()> {
    for path in outputs.all() {
        match std::fs::remove_file(&path) {
            Err(error) if error.kind() != std::io::ErrorKind::NotFound => {
                return Err(error).with_context(|| format!("removing {}", path.display()))
            }
            _ => {}
        }
    }
    Ok(())
}

/// Writes the Chrome trace and the tensor-named CSV from the fault CSV.
fn convert(args: &TraceArgs, outputs: &Outputs) -> anyhow::Result<()> {
    let csv = &outputs.csv;
    let reader = TraceReader::new(BufReader::new(
        std::fs::File::open(csv).with_context(|| csv.display().to_string())?,
    ))?;
    let metadata: serde_json::Map<String, serde_json::Value> = reader
        .metadata()
        .iter()
        .map(|(k, v)| (k.clone(), json!(v)))
        .collect();
    let records = reader.collect::<Result<Vec<_>, _>>()?;
    let model_tensors = match &args.model {
        // Asked for: its tensors or an error.
        Some(asked) => Some(super::model_tensors(asked)?),
        // Guessed from the program's arguments: a file the pager served, but maybe of no
        // format with tensors (the shim learns those). The trace is still worth having:
        // it failed after the whole run for want of names.
        None => find_model_argument(&args.program).and_then(|found| {
            super::model_tensors(&found)
                .inspect_err(|error| {
                    eprintln!(
                        "warning: {}: {error:#}; faults are named by block",
                        found.display()
                    )
                })
                .ok()
        }),
    };
    let mut metadata = serde_json::Value::Object(metadata);
    metadata["program"] = json!(args
        .program
        .iter()
        .map(|a| a.to_string_lossy())
        .collect::<Vec<_>>());
    // Each region's faults named by its own file's tensors, as the shim's events say
    // which file each region presents (a split model's parts, a second model); the
    // model argument names the first region's where they do not.
    let events = events_path(args.from.as_deref().unwrap_or(csv));
    let region_files = std::fs::read_to_string(&events)
        .map(|text| region_files(&text))
        .unwrap_or_default();
    // Each file's table read once (None: no model format with tensors).
    let mut tables: HashMap<&Path, Option<Vec<TensorInfo>>> = HashMap::new();
    for path in region_files.values() {
        tables
            .entry(path)
            .or_insert_with(|| ModelFile::open(path).ok().map(|model| model.tensors));
    }
    let mut names = RegionTensors::default();
    for (region, path) in &region_files {
        if let Some(Some(tensors)) = tables.get(path.as_path()) {
            names.insert(*region, tensors);
        }
    }
    if let Some(tensors) = &model_tensors {
        if !region_files.contains_key(&0) {
            names.insert(0, tensors);
        }
    }
    let trace = chrome_trace(&records, &names, metadata);
    write(&outputs.json, &serde_json::to_string(&trace)?)?;
    write(&outputs.tensors, &named_csv(&records, &names))?;
    eprintln!(
        "{} faults: {} (open in ui.perfetto.dev), {} (simulate --trace)",
        records.len(),
        outputs.json.display(),
        csv.display()
    );
    Ok(())
}

fn write(path: &Path, text: &str) -> anyhow::Result<()> {
    std::fs::write(path, text).with_context(|| path.display().to_string())
}

/// The files a trace writes, all named after `--out`.
#[derive(Debug, PartialEq)]
struct Outputs {
    /// The Chrome trace.
    json: PathBuf,
    /// The pager's fault CSV, as `simulate --trace` reads it.
    csv: PathBuf,
    /// The CSV with tensor names.
    tensors: PathBuf,
}

impl Outputs {
    /// The outputs for `--out json`; refused when two of them would be one file, which
    /// happens exactly when `json` ends in `.csv` (or has no file name to replace the
    /// extension of): the JSON would be written over the CSV it is made from.
    fn for_json(json: &Path) -> anyhow::Result<Self> {
        let outputs = Self {
            json: json.to_path_buf(),
            csv: json.with_extension("csv"),
            tensors: json.with_extension("tensors.csv"),
        };
        if outputs.json == outputs.csv || outputs.json == outputs.tensors {
            bail!(
                "--out {}: the Chrome trace JSON would overwrite the fault CSV written beside \
                 it; give --out a .json name (--out {} writes {} too)",
                json.display(),
                json.with_extension("json").display(),
                json.with_extension("csv").display()
            );
        }
        Ok(outputs)
    }

    /// Every file a recording writes: these three and the shim's events beside the CSV.
    fn all(&self) -> [PathBuf; 4] {
        [
            self.json.clone(),
            self.csv.clone(),
            self.tensors.clone(),
            events_path(&self.csv),
        ]
    }
}

/// Puts the recording `from` where the trace's CSV goes. Files are compared by identity,
/// not by name: `./trace.csv` and `trace.csv` are one file, and copying a file onto
/// itself truncates it before reading it.
fn copy_recording(from: &Path, outputs: &Outputs) -> anyhow::Result<()> {
    for (what, output) in [
        ("Chrome trace JSON", &outputs.json),
        ("tensor-named CSV", &outputs.tensors),
    ] {
        if same_file(from, output)? {
            bail!(
                "--from {}: that is where the {what} goes, which would overwrite the \
                 recording; choose another --out",
                from.display()
            );
        }
    }
    if !same_file(from, &outputs.csv)? {
        std::fs::copy(from, &outputs.csv)
            .with_context(|| format!("copying {} to {}", from.display(), outputs.csv.display()))?;
    }
    Ok(())
}

/// Whether `a` and `b` are the same existing file (same device and inode, whatever the
/// spelling, symlinks followed). A path naming no file is no file: not the same.
fn same_file(a: &Path, b: &Path) -> anyhow::Result<bool> {
    let metadata = |path: &Path| match std::fs::metadata(path) {
        Ok(metadata) => Ok(Some(metadata)),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(error) => Err(error).with_context(|| path.display().to_string()),
    };
    Ok(match (metadata(a)?, metadata(b)?) {
        (Some(a), Some(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outputs_are_named_after_the_json() {
        let outputs = Outputs::for_json(Path::new("dir/rec.json")).unwrap();
        assert_eq!(outputs.csv, Path::new("dir/rec.csv"));
        assert_eq!(outputs.tensors, Path::new("dir/rec.tensors.csv"));
        assert_eq!(outputs.all()[3], Path::new("dir/rec.csv.events.jsonl"));
        let outputs = Outputs::for_json(Path::new("rec")).unwrap();
        assert_eq!(outputs.json, Path::new("rec"));
        assert_eq!(outputs.csv, Path::new("rec.csv"));
    }

    #[test]
    fn an_out_whose_json_would_be_the_csv_is_refused() {
        for out in ["rec.csv", "rec.tensors.csv", "/", ".."] {
            let error = Outputs::for_json(Path::new(out)).unwrap_err().to_string();
            assert!(error.contains("would overwrite"), "{out}: {error}");
        }
    }

    #[test]
    fn same_file_sees_through_spellings_and_links() {
        let dir = std::env::temp_dir().join(format!("trace-same-file-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("a.csv");
        std::fs::write(&file, "x").unwrap();
        let link = dir.join("link.csv");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&file, &link).unwrap();
        let other = dir.join("b.csv");
        std::fs::write(&other, "x").unwrap();
        assert!(same_file(&file, &dir.join(".").join("a.csv")).unwrap());
        assert!(same_file(&file, &link).unwrap());
        assert!(!same_file(&file, &other).unwrap());
        assert!(!same_file(&file, &dir.join("missing.csv")).unwrap());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
