//! `hyperoffload synth`: write a synthetic llama model of a given size.

use std::fs::File;
use std::io::BufWriter;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};

use hyperoffload::model::ggml_type::GgmlType;
use hyperoffload::model::gguf::GgufFile;
use hyperoffload::model::synth::{
    self, MoeSpec, QuantMix, RouterLocality, SynthArch, SynthPlan, SynthRequest, TensorOrder,
};
use hyperoffload::size::{format_size, parse_size};

/// Write a llama model of about SIZE bytes shaped like a small one: more and wider
/// layers, its tokenizer, random valid weights of its quantization types.
#[derive(Debug, Args)]
pub struct SynthArgs {
    /// The small GGUF model to imitate (llama architecture).
    #[arg(long)]
    like: PathBuf,
    /// Approximate size of the new file (e.g. 3G, 512M).
    #[arg(long, value_parser = parse_size)]
    size: u64,
    /// Where to write the new model (a new file, unless --force).
    #[arg(long)]
    out: PathBuf,
    /// Replace --out if it exists (never the --like model itself).
    #[arg(long)]
    force: bool,
    /// The order of the tensors in the file.
    #[arg(long, value_enum, default_value_t = Order::File)]
    order: Order,
    /// Quantization type of every quantized weight (e.g. Q8_0), instead of the small
    /// model's, or the recipe Q4_K_M (Q4_K, with Q6_K for the output head and for the
    /// attention values and down projections of a third of the layers, as
    /// llama-quantize makes it).
    #[arg(long = "type", value_parser = weight_types_arg)]
    weight_types: Option<WeightTypes>,
    /// Quantization type of the merged expert tensors alone (with --experts), after
    /// --type: e.g. MXFP4 experts in a Q8_0 model, as gpt-oss is released, or Q4_K.
    #[arg(long, requires = "experts", value_parser = weight_type_arg)]
    expert_type: Option<GgmlType>,
    /// Seed of the random weights (and of the shuffled order).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Make a mixture of experts: this many routed experts per layer in place of each
    /// feed-forward network (llama.cpp's llama MoE layout, as Mixtral's).
    #[arg(long)]
    experts: Option<u64>,
    /// Experts each token runs per layer (with --experts).
    #[arg(long, requires = "experts", default_value_t = 2)]
    experts_used: u64,
    /// Each expert's feed-forward width over the embedding width (with --experts);
    /// default the small model's ratio (coarse experts). Fine-grained MoE: 0.25-0.5
    /// with 64 or more experts.
    #[arg(long, requires = "experts")]
    expert_ff_ratio: Option<f64>,
    /// How unevenly the router spreads tokens over a layer's experts (with --experts):
    /// 0 about evenly; each layer favours different experts. Default 2, or the
    /// --router-locality preset's.
    #[arg(long, requires = "experts")]
    router_skew: Option<f32>,
    /// How much each layer's router follows the layer before it (with --experts), 0
    /// to 1: 0 makes each layer's picks independent of the last; higher makes tokens
    /// that pick an expert in one layer tend to pick its successor in the next, as
    /// trained routers do.
    #[arg(long, requires = "experts", default_value_t = 0.0)]
    router_affinity: f32,
    /// Make routing follow the text (with --experts), as real routers do: `off` builds
    /// no locality in (the router favours popular experts); `token` routes by the
    /// current token alone (a word picks the same experts wherever it stands); `qwen3`
    /// by the token and how the last tokens drift from the text so far, calibrated so
    /// that decoding plain English one token at a time gives per-layer LRU hit rates
    /// near Qwen3-235B-A22B's (0.34, 0.58, 0.74, 0.89, 0.96 at 5, 12, 20, 36, 55 % of a
    /// layer's experts kept), with its skew (1.5) unless --router-skew is given; a
    /// number (0 to 64) is `qwen3`'s recency with that weight of context against the
    /// token (the preset's: 14). Needs Q8_0, Q4_0, Q4_1 or float attention weights.
    #[arg(long, requires = "experts", default_value = "off", value_parser = locality_arg)]
    router_locality: Locality,
    /// The architecture of the new model: `llama` (the small model's, dense or with
    /// Mixtral's experts), or a mixture of experts as another family lays it out, with
    /// the tensors and keys llama.cpp requires of it: `qwen3moe` (per-head query and
    /// key norms), `gpt-oss` (biases on the attention output, router and experts,
    /// attention sinks, sliding-window layers, an untied output head), `glm4moe`
    /// (attention biases, a shared expert, the router's score bias, a dense first
    /// layer), `deepseek2` (latent attention, a shared expert, the router's score bias,
    /// a dense first layer). Those need --experts and no --router-locality.
    #[arg(long, value_enum, default_value_t = Arch::Llama)]
    arch: Arch,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Arch {
    Llama,
    Qwen3moe,
    GptOss,
    Glm4moe,
    Deepseek2,
}

impl From<Arch> for SynthArch {
    fn from(arch: Arch) -> Self {
        match arch {
            Arch::Llama => SynthArch::Llama,
            Arch::Qwen3moe => SynthArch::Qwen3Moe,
            Arch::GptOss => SynthArch::GptOss,
            Arch::Glm4moe => SynthArch::Glm4Moe,
            Arch::Deepseek2 => SynthArch::DeepSeek2,
        }
    }
}

/// `--router-locality`: `None` for `off` (clap reads an `Option` field as optional).
#[derive(Debug, Clone, Copy)]
struct Locality(Option<RouterLocality>);

fn locality_arg(text: &str) -> Result<Locality, String> {
    RouterLocality::parse(text)
        .map(Locality)
        .map_err(|error| error.to_string())
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Order {
    /// llama.cpp's execution order.
    Exec,
    /// The small model's file order, extended.
    File,
    /// Sorted by name.
    Alphabetical,
    /// A random permutation.
    Shuffled,
    /// As llama.cpp's converter writes a Hugging Face checkpoint: checkpoint names
    /// sorted as strings (`blk.10` before `blk.2`; in a layer the experts before the
    /// attention), gpt-oss's experts first.
    Hf,
}

impl From<Order> for TensorOrder {
    fn from(order: Order) -> Self {
        match order {
            Order::Exec => TensorOrder::Exec,
            Order::File => TensorOrder::File,
            Order::Alphabetical => TensorOrder::Alphabetical,
            Order::Shuffled => TensorOrder::Shuffled,
            Order::Hf => TensorOrder::Hf,
        }
    }
}

/// `--router-skew` without a locality preset.
const DEFAULT_SKEW: f32 = 2.0;

/// `--type`: one type for every quantized weight, or a recipe.
#[derive(Debug, Clone, Copy)]
enum WeightTypes {
    One(GgmlType),
    Mix(QuantMix),
}

fn weight_types_arg(name: &str) -> Result<WeightTypes, String> {
    match QuantMix::from_name(name) {
        Some(mix) => Ok(WeightTypes::Mix(mix)),
        None => weight_type_arg(name)
            .map(WeightTypes::One)
            .map_err(|error| format!("{error}, or the recipe Q4_K_M")),
    }
}

fn weight_type_arg(name: &str) -> Result<GgmlType, String> {
    GgmlType::from_name(name)
        .ok_or_else(|| format!("`{name}` is not a ggml type (e.g. Q8_0, Q4_1)"))
}

pub fn run(args: SynthArgs) -> anyhow::Result<()> {
    let small =
        GgufFile::open(&args.like).with_context(|| format!("reading {}", args.like.display()))?;
    refuse_overwriting_input(&args)?;
    let plan = synth::plan_request(&small, &synth_request(&args)).with_context(|| {
        format!(
            "planning a {} model like {}",
            format_size(args.size),
            args.like.display()
        )
    })?;
    say_plan(&plan);
    write_model(&args, &plan)
}

/// What the arguments ask the library to make.
fn synth_request(args: &SynthArgs) -> SynthRequest {
    SynthRequest {
        target: args.size,
        order: args.order.into(),
        seed: args.seed,
        weight_type: match args.weight_types {
            Some(WeightTypes::One(ty)) => Some(ty),
            _ => None,
        },
        mix: match args.weight_types {
            Some(WeightTypes::Mix(mix)) => Some(mix),
            _ => None,
        },
        expert_type: args.expert_type,
        moe: args.experts.map(|experts| MoeSpec {
            experts,
            used: args.experts_used,
            ff_ratio: args.expert_ff_ratio,
            skew: args
                .router_skew
                .or(args.router_locality.0.and_then(|locality| locality.skew))
                .unwrap_or(DEFAULT_SKEW),
            affinity: args.router_affinity,
            locality: args.router_locality.0,
        }),
        arch: args.arch.into(),
    }
}

/// The planned model's shape, on stderr.
fn say_plan(plan: &SynthPlan) {
    let s = plan.shape;
    eprintln!(
        "synth: {} layers, n_embd {}, n_ff {}, heads {}/{} (kv), {:.2}B parameters, {} tensors, {}",
        s.n_layer,
        s.n_embd,
        s.n_ff,
        s.n_head,
        s.n_head_kv,
        plan.n_params as f64 / 1e9,
        plan.tensors.len(),
        format_size(plan.file_len)
    );
    if s.n_expert > 0 {
        eprintln!(
            "synth: {} experts per layer, {} used per token, expert feed-forward width {}",
            s.n_expert, s.n_expert_used, s.n_ff
        );
    }
}

/// Writes `plan` to --out with a progress bar, and syncs it.
fn write_model(args: &SynthArgs, plan: &SynthPlan) -> anyhow::Result<()> {
    let file =
        File::create(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
    let bar = ProgressBar::new(plan.file_len);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let start = Instant::now();
    let out = synth::write(
        plan,
        BufWriter::with_capacity(1 << 20, file),
        args.seed,
        |done| bar.set_position(done),
    )
    .with_context(|| format!("writing {}", args.out.display()))?;
    out.into_inner()
        .map_err(|e| e.into_error())
        .and_then(|f| f.sync_all())
        .with_context(|| format!("flushing {}", args.out.display()))?;
    bar.finish_and_clear();
    eprintln!(
        "synth: wrote {} ({}) in {:.1} s",
        args.out.display(),
        format_size(plan.file_len),
        start.elapsed().as_secs_f64()
    );
    Ok(())
}

/// A file at --out is replaced only with --force, and never when it is the small model
/// being imitated: that would destroy the input while it is being read.
fn refuse_overwriting_input(args: &SynthArgs) -> anyhow::Result<()> {
    use std::os::unix::fs::MetadataExt;
    let Ok(out) = std::fs::symlink_metadata(&args.out) else {
        return Ok(());
    };
    if let Ok(like) = std::fs::metadata(&args.like) {
        let target = std::fs::metadata(&args.out).unwrap_or(out.clone());
        if like.dev() == target.dev() && like.ino() == target.ino() {
            anyhow::bail!(
                "--out {} is the --like model itself; choose another path",
                args.out.display()
            );
        }
    }
    if !args.force {
        anyhow::bail!(
            "--out {} exists; give --force to replace it",
            args.out.display()
        );
    }
    Ok(())
}
