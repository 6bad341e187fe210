//! `hyperoffload simulate`: bytes read per token by a policy against the floor.

use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context};

use super::sim::moe::MoeShape;
use super::sim::router::{Locality, Routing};
use super::sim::{llama::LlamaShape, simulate, SimPolicy, SimReport, Timing, Workload};
use hyperoffload::geometry::BlockGeometry;
use hyperoffload::graph::experts::model_block_cuts;
use hyperoffload::graph::{ModelGraph, PartTensors, Transitions};
use hyperoffload::policy::PrefetchKind;
use hyperoffload::size::{format_size, parse_size};
use hyperoffload::trace::{TraceReader, EXPERT_BLOCKS_KEY};
use hyperoffload::trace_region::RegionTrace;

#[derive(clap::Args)]
pub struct SimulateArgs {
    /// A recorded fault trace (the CSV `hyperoffload trace` or `run --trace` writes). With --model, replayed against the
    /// graph the pager builds from that model's tensor table (its experts included), as
    /// a run of the model under the pager would be; without, against a graph learned
    /// from the trace.
    #[arg(
        long,
        conflicts_with_all = ["synthetic_llama", "synthetic_moe"],
        required_unless_present_any = ["synthetic_llama", "synthetic_moe", "model"]
    )]
    trace: Option<PathBuf>,
    /// A model file (GGUF or safetensors; any part of a split GGUF stands for them
    /// all): its predicted order, repeated for --tokens; with --trace, the model the
    /// trace was recorded on (one file).
    #[arg(long, conflicts_with_all = ["synthetic_llama", "synthetic_moe"])]
    model: Option<PathBuf>,
    /// A synthetic llama-shaped model: `LAYERS:TENSOR_BYTES` (TENSOR_BYTES is the size of
    /// one layer's attn_q; `30:1.4M` is about 520 MB), or `default`.
    #[arg(long, conflicts_with = "synthetic_moe")]
    synthetic_llama: Option<String>,
    /// A synthetic mixture-of-experts llama: `coarse` (16 experts, 2 used), `fine` (64,
    /// 8) or `qwen3` (128, 8), its experts picked by --router.
    #[arg(long, value_enum)]
    synthetic_moe: Option<MoeShapeName>,
    /// The synthetic mixture of experts' router: `independent` draws each token's
    /// experts afresh from a skewed popularity; `locality` repeats some of the previous
    /// token's and draws the rest from a popularity that drifts, calibrated to real
    /// routers' per-layer LRU hit curve (Qwen3-235B's).
    #[arg(
        long,
        value_enum,
        default_value = "independent",
        requires = "synthetic_moe"
    )]
    router: RouterName,
    /// Seed of the synthetic mixture of experts' router.
    #[arg(long, default_value_t = 11, requires = "synthetic_moe")]
    seed: u64,
    /// Tokens to generate (synthetic), or tokens the trace holds (to report per token;
    /// with --model the trace's tokens are found where the program starts the model's
    /// pass again, and this is not needed).
    #[arg(long)]
    tokens: Option<u32>,
    /// Replays the sequence this many times over and reports bytes per token over the
    /// last copy: the steady state, in which every block used has been read once (for a
    /// trace of a few tokens of a mixture of experts, most of whose reads are first uses).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    repeat: u32,
    /// Resident budget: a size (`128M`) or a share of the model (`50%`).
    #[arg(long)]
    budget: String,
    /// The policy, by `run`'s names and meanings, or one of the offline floors.
    #[arg(long, value_enum)]
    policy: SimulatedPolicy,
    /// Prefetch policy, in place of the one the policy name implies (`--policy lru
    /// --prefetch none`: LRU eviction alone).
    #[arg(long, value_enum)]
    prefetch: Option<PrefetchName>,
    /// Block size (synthetic workloads; a trace says its own).
    #[arg(long, default_value = "64K")]
    block: String,
    /// Learn the graph from the first N tokens with no model knowledge and simulate the
    /// rest. Without it the graph comes from the tensor table (synthetic), or is learned
    /// from the whole trace, as if from an earlier identical run.
    #[arg(long)]
    learn: Option<usize>,
    /// Learn the graph from this other trace (as a recording run of the same file would
    /// have), then replay --trace against it: a program that no longer follows the
    /// order it was learned on.
    #[arg(long, requires = "trace", conflicts_with_all = ["learn", "model"])]
    learn_from: Option<PathBuf>,
    #[arg(long)]
    json: bool,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum MoeShapeName {
    Coarse,
    Fine,
    Qwen3,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum RouterName {
    Independent,
    Locality,
}

/// What `simulate --prefetch` names: the pager's prefetch policies.
#[derive(Copy, Clone, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PrefetchName {
    /// Read only what faults.
    None,
    /// Read the blocks following a fault, growing the window while faults stay sequential.
    Readahead,
    /// Read ahead along the model graph's predicted order.
    Graph,
}

impl From<PrefetchName> for PrefetchKind {
    fn from(name: PrefetchName) -> Self {
        match name {
            PrefetchName::None => PrefetchKind::None,
            PrefetchName::Readahead => PrefetchKind::Readahead,
            PrefetchName::Graph => PrefetchKind::Graph,
        }
    }
}

/// What `simulate --policy` names: `run`'s policies, which pair a prefetch policy with
/// an eviction policy (see `policy_name::POLICY_NAMES`), and the offline floors.
#[derive(Copy, Clone, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum SimulatedPolicy {
    /// As run's: prefetch along the model's predicted order, evict the block used
    /// furthest ahead.
    Graph,
    /// As run's: sequential readahead on faults, FIFO eviction.
    Readahead,
    /// As run's: read only what faults, FIFO eviction.
    Demand,
    /// As run's: sequential readahead, evict the least recently used block.
    Lru,
    /// As run's: sequential readahead, CLOCK eviction.
    Clock,
    /// The offline optimum, demand reads only: the floor.
    Belady,
    /// Offline: evict the block the whole sequence uses least, demand reads only. The
    /// floor for a policy that learns how often blocks are used but cannot foresee the
    /// sequence (exact when accesses are drawn independently, as routed experts nearly
    /// are).
    Frequency,
    /// Online: evict the block used least often so far, demand reads only: `frequency`
    /// with the counts learned as the sequence goes, so the distance between the two is
    /// what learning them costs.
    Lfu,
}

impl SimulatedPolicy {
    /// The eviction side and the prefetch policy the name implies (`None`: the
    /// simulator's default for that eviction side).
    fn parts(self) -> (SimPolicy, Option<PrefetchKind>) {
        match self {
            SimulatedPolicy::Graph => (SimPolicy::Graph, None),
            SimulatedPolicy::Readahead => (SimPolicy::Fifo, Some(PrefetchKind::Readahead)),
            SimulatedPolicy::Demand => (SimPolicy::Fifo, Some(PrefetchKind::None)),
            SimulatedPolicy::Lru => (SimPolicy::Lru, Some(PrefetchKind::Readahead)),
            SimulatedPolicy::Clock => (SimPolicy::Clock, Some(PrefetchKind::Readahead)),
            SimulatedPolicy::Belady => (SimPolicy::Belady, None),
            SimulatedPolicy::Frequency => (SimPolicy::Frequency, None),
            SimulatedPolicy::Lfu => (SimPolicy::Lfu, None),
        }
    }
}

pub fn run(args: SimulateArgs) -> anyhow::Result<()> {
    let (workload, tensor_graph, model_len) = workload_and_graph(&args)?;
    let model = model_len.unwrap_or(workload.layout.data_len);
    let budget = super::budget_bytes(&args.budget, model)?;

    let (workload, graph) = match args.learn {
        Some(tokens) => {
            if workload.token_starts.len() <= tokens {
                bail!("--learn {tokens} needs more than {tokens} tokens with known boundaries (--tokens)");
            }
            let mut transitions = Transitions::new();
            transitions.observe_all(workload.tokens(0..tokens).accesses);
            let rest = workload.tokens(tokens..workload.token_starts.len());
            (rest, ModelGraph::learned(workload.layout, &transitions))
        }
        None if args.learn_from.is_some() => {
            let path = args.learn_from.as_deref().expect("checked");
            let recorded = read_trace(path, None)?;
            if recorded.layout != workload.layout {
                bail!(
                    "{} was recorded on another file or block size than {}",
                    path.display(),
                    args.trace.as_deref().expect("required by clap").display()
                );
            }
            let mut transitions = Transitions::new();
            transitions.observe_all(recorded.accesses.iter().copied());
            let graph = ModelGraph::learned(workload.layout.clone(), &transitions);
            (workload, graph)
        }
        None => {
            let graph = tensor_graph.unwrap_or_else(|| {
                let mut transitions = Transitions::new();
                transitions.observe_all(workload.accesses.iter().copied());
                ModelGraph::learned(workload.layout.clone(), &transitions)
            });
            (workload, graph)
        }
    };
    let graph = Arc::new(graph);
    let timing = Timing::default();
    // Per token from the last copy's first token (after the first: it starts cold).
    let copy_tokens = workload.token_starts.len();
    let copies = args.repeat as usize;
    let first_token = if copies > 1 {
        (copies - 1) * copy_tokens
    } else {
        1
    };
    let workload = workload.repeated(copies);
    let (policy, implied_prefetch) = args.policy.parts();
    let report = simulate(
        &workload,
        budget,
        policy,
        args.prefetch.map(PrefetchKind::from).or(implied_prefetch),
        Some(&graph),
        timing,
    )?;
    let floor = simulate(&workload, budget, SimPolicy::Belady, None, None, timing)?;
    let per_token = |report: &SimReport| match workload.token_starts.is_empty() {
        false => report.bytes_per_token_from(first_token),
        true => {
            report.steady_bytes_per_token(args.tokens.map(|t| u64::from(t) * args.repeat as u64))
        }
    };
    let per_token = (per_token(&report), per_token(&floor));
    print_report(&report, &floor, model, per_token, copies, args.json)
}

/// The access sequence the arguments name, the graph of the model's tensor table where
/// there is one, and the model's bytes where the workload's layout is not them (a split
/// model).
fn workload_and_graph(
    args: &SimulateArgs,
) -> anyhow::Result<(Workload, Option<ModelGraph>, Option<u64>)> {
    let mut model_len = None;
    let (workload, tensor_graph) = match (&args.trace, &args.synthetic_llama) {
        (Some(path), _) => {
            let mut workload = read_trace(path, args.tokens)?;
            match &args.model {
                Some(model_path) => {
                    let graph = trace_model_graph(model_path, path, &mut workload)?;
                    (workload.with_tokens_from_order(graph.order()), Some(graph))
                }
                None => (workload, None),
            }
        }
        (None, None) if args.model.is_some() => {
            let path = args.model.as_ref().expect("checked");
            let model = hyperoffload::model::ModelFile::open(path)?;
            let block = parse_size(&args.block)?;
            let graph = match super::split_parts_or_warn(&model) {
                // All the parts, replayed as one region: the files end to end, each
                // from a block boundary (a part's short last block counts whole).
                Some(parts) => {
                    model_len = Some(parts.iter().map(|part| part.file_len).sum());
                    let tables: Vec<PartTensors> = parts.iter().map(PartTensors::from).collect();
                    ModelGraph::from_parts(&tables, block)?.into_one_region()
                }
                // Cut at the experts' slices, as the pager cuts them.
                None => {
                    let cuts = model_block_cuts(&model, hyperoffload::sys::memory::page_size());
                    let layout =
                        BlockGeometry::new(0, model.file_len, block)?.with_file_cuts(cuts)?;
                    ModelGraph::from_tensors(&model.tensors, layout)
                }
            };
            (
                Workload::cyclic(&graph, args.tokens.unwrap_or(16)),
                Some(graph),
            )
        }
        (None, Some(spec)) => {
            let shape = parse_shape(spec)?;
            let block = parse_size(&args.block)?;
            if block == 0 {
                bail!("--block must be positive");
            }
            let workload = shape.workload(block, args.tokens.unwrap_or(16));
            let graph = ModelGraph::from_tensors(&shape.tensors(), workload.layout.clone());
            (workload, Some(graph))
        }
        (None, None) if args.synthetic_moe.is_some() => {
            let shape = moe_shape(args);
            let block = parse_size(&args.block)?;
            if block == 0 {
                bail!("--block must be positive");
            }
            let workload = shape.workload(block, args.tokens.unwrap_or(256), args.seed);
            let graph = ModelGraph::from_tensors(&shape.tensors(), workload.layout.clone())
                .with_experts_used(Some(shape.used));
            (workload, Some(graph))
        }
        (None, None) => {
            bail!(
                "give --trace FILE, --model FILE, --synthetic-llama LAYERS:TENSOR_BYTES \
                 or --synthetic-moe SHAPE"
            )
        }
    };
    Ok((workload, tensor_graph, model_len))
}

/// The graph the pager would build for `path` mapped whole in the blocks the trace at
/// `trace` was recorded in (`workload`, read from it): the trace's block size, cut at
/// the experts' slices where the run cut them; its tensor table's order, and its
/// experts with the model's used count. The workload takes the graph's geometry.
pub(super) fn trace_model_graph(
    path: &Path,
    trace: &Path,
    workload: &mut Workload,
) -> anyhow::Result<ModelGraph> {
    let model = hyperoffload::model::ModelFile::open(path)?;
    let block = workload.layout.block_size;
    let cuts = if recorded_expert_blocks(trace)? {
        model_block_cuts(&model, hyperoffload::sys::memory::page_size())
    } else {
        Vec::new()
    };
    let layout = BlockGeometry::new(0, model.file_len, block)?.with_file_cuts(cuts)?;
    let reached = workload.accesses.iter().copied().max().unwrap_or(0);
    if reached >= layout.block_count() {
        bail!(
            "the trace reaches block {reached} but {} has only {} blocks of at most {}: \
             recorded on another model?",
            path.display(),
            layout.block_count(),
            format_size(block)
        );
    }
    workload.layout = layout.clone();
    Ok(ModelGraph::from_tensors(&model.tensors, layout).with_experts_used(model.experts_used()))
}

/// Whether the run that recorded the trace at `path` cut its blocks at the experts'
/// slices (`expert_blocks=1` in its header; traces from before say nothing: no).
fn recorded_expert_blocks(path: &Path) -> anyhow::Result<bool> {
    let file = std::fs::File::open(path).with_context(|| format!("{}", path.display()))?;
    let reader = TraceReader::new(BufReader::new(file))?;
    Ok(reader.metadata_value(EXPERT_BLOCKS_KEY) == Some("1"))
}

/// The synthetic mixture of experts `--synthetic-moe` and `--router` name.
fn moe_shape(args: &SimulateArgs) -> MoeShape {
    let shape = match args.synthetic_moe.unwrap_or(MoeShapeName::Coarse) {
        MoeShapeName::Coarse => MoeShape::coarse(),
        MoeShapeName::Fine => MoeShape::fine(),
        MoeShapeName::Qwen3 => MoeShape::qwen3_like(),
    };
    shape.with_routing(match args.router {
        RouterName::Independent => Routing::Independent,
        RouterName::Locality => Routing::Locality(Locality::qwen3()),
    })
}

fn parse_shape(spec: &str) -> anyhow::Result<LlamaShape> {
    if spec == "default" {
        return Ok(LlamaShape::about_500mb());
    }
    let (layers, bytes) = spec
        .split_once(':')
        .with_context(|| format!("--synthetic-llama `{spec}`: expected LAYERS:TENSOR_BYTES"))?;
    let layers: u32 = layers.parse().context("--synthetic-llama layers")?;
    Ok(LlamaShape::scaled(layers, parse_size(bytes)?))
}

/// The faults of the trace's first region as an access sequence, checked against the
/// region (`RegionTrace`) before anything is sized by them. Token boundaries are
/// unknown; with `tokens`, the trace is cut into that many equal parts.
pub(super) fn read_trace(path: &Path, tokens: Option<u32>) -> anyhow::Result<Workload> {
    let file = std::fs::File::open(path).with_context(|| format!("{}", path.display()))?;
    let reader =
        TraceReader::new(BufReader::new(file)).with_context(|| format!("{}", path.display()))?;
    let trace = RegionTrace::read(reader).with_context(|| format!("{}", path.display()))?;
    let layout = BlockGeometry::new(0, trace.data_len, trace.block_size)?;
    let accesses = trace.blocks;
    let token_starts = match tokens {
        Some(n) if n > 0 => (0..n as usize)
            .map(|t| t * accesses.len() / n as usize)
            .collect(),
        _ => Vec::new(),
    };
    Ok(Workload {
        layout,
        accesses,
        token_starts,
        offsets: trace.offsets,
    })
}

/// `per_token`: bytes per token of the report and of the floor, in steady state.
fn print_report(
    report: &SimReport,
    floor: &SimReport,
    model: u64,
    (per_token, floor_per_token): (Option<f64>, Option<f64>),
    copies: usize,
    json: bool,
) -> anyhow::Result<()> {
    let ratio = report.bytes_read as f64 / floor.bytes_read.max(1) as f64;
    if json {
        let value = serde_json::json!({
            "model_bytes": model,
            "report": report,
            "belady_bytes_read": floor.bytes_read,
            "ratio_to_belady": ratio,
            "steady_bytes_per_token": per_token,
            "belady_steady_bytes_per_token": floor_per_token,
        });
        println!("{}", serde_json::to_string_pretty(&value)?);
        return Ok(());
    }
    println!(
        "policy {} (prefetch {}), budget {} of a {} model",
        report.policy,
        report.prefetch,
        format_size(report.budget_bytes),
        format_size(model)
    );
    println!(
        "read {} ({} demand misses, {} blocks prefetched, {} wasted); belady {}; ratio {ratio:.4}",
        format_size(report.bytes_read),
        report.demand_misses,
        report.prefetched_blocks,
        report.wasted_prefetch_blocks,
        format_size(floor.bytes_read)
    );
    if let (Some(ours), Some(best)) = (per_token, floor_per_token) {
        println!(
            "per token {}: {} ({:.1}% of the model); belady {}",
            if copies > 1 {
                "over the last copy"
            } else {
                "after the first"
            },
            format_size(ours as u64),
            ours * 100.0 / model as f64,
            format_size(best as u64)
        );
    }
    Ok(())
}
