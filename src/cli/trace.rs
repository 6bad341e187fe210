//! `hyperoffload trace`: a program's faults under the pager, as a Chrome/Perfetto trace
//! and the block-access CSV that `simulate` replays.

use std::ffi::OsString;
use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context};
use serde_json::json;

use hyperoffload::compare::chrome_trace::{chrome_trace, named_csv};
use hyperoffload::compare::find_model_argument;
use hyperoffload::trace::TraceReader;

#[derive(clap::Args)]
pub struct TraceArgs {
    /// The Chrome trace JSON to write; the pager's CSV goes next to it (`.csv`, the
    /// format `simulate --trace` reads) with a tensor-named copy (`.tensors.csv`).
    #[arg(long, default_value = "trace.json")]
    out: PathBuf,
    /// RAM budget for the pager (a size or `N%` of the model).
    #[arg(long, default_value = "50%")]
    budget: String,
    /// Convert this recorded fault trace CSV instead of running a program.
    #[arg(long, conflicts_with = "program")]
    from: Option<PathBuf>,
    /// The model file, for tensor names (default: the program's *.gguf/*.safetensors
    /// argument).
    #[arg(long)]
    model: Option<PathBuf>,
    /// The program and its arguments.
    #[arg(last = true, required_unless_present = "from")]
    program: Vec<OsString>,
}

pub fn run(args: TraceArgs) -> anyhow::Result<()> {
    let csv = args.out.with_extension("csv");
    let model = args
        .model
        .clone()
        .or_else(|| find_model_argument(&args.program));
    match &args.from {
        Some(from) => {
            if from != &csv {
                std::fs::copy(from, &csv)
                    .with_context(|| format!("copying {} to {}", from.display(), csv.display()))?;
            }
        }
        None => {
            // The launcher refuses to overwrite a trace.
            let _ = std::fs::remove_file(&csv);
            let status = Command::new(std::env::current_exe()?)
                .arg("run")
                .arg("--budget")
                .arg(&args.budget)
                .arg("--trace")
                .arg(&csv)
                .arg("--")
                .args(&args.program)
                .status()
                .context("starting `hyperoffload run`")?;
            if !status.success() {
                eprintln!("warning: the program ended with {status}");
            }
            if !csv.exists() {
                bail!("`hyperoffload run` left no trace at {}", csv.display());
            }
        }
    }
    let reader = TraceReader::new(BufReader::new(
        std::fs::File::open(&csv).with_context(|| csv.display().to_string())?,
    ))?;
    let metadata: serde_json::Map<String, serde_json::Value> = reader
        .metadata()
        .iter()
        .map(|(k, v)| (k.clone(), json!(v)))
        .collect();
    let records = reader.collect::<Result<Vec<_>, _>>()?;
    let tensors = match &model {
        Some(model) => Some(super::model_tensors(model)?),
        None => None,
    };
    let mut metadata = serde_json::Value::Object(metadata);
    metadata["program"] = json!(args
        .program
        .iter()
        .map(|a| a.to_string_lossy())
        .collect::<Vec<_>>());
    let trace = chrome_trace(&records, tensors.as_deref(), metadata);
    write(&args.out, &serde_json::to_string(&trace)?)?;
    write(
        &args.out.with_extension("tensors.csv"),
        &named_csv(&records, tensors.as_deref()),
    )?;
    eprintln!(
        "{} faults: {} (open in ui.perfetto.dev), {} (simulate --trace)",
        records.len(),
        args.out.display(),
        csv.display()
    );
    Ok(())
}

fn write(path: &Path, text: &str) -> anyhow::Result<()> {
    std::fs::write(path, text).with_context(|| path.display().to_string())
}
