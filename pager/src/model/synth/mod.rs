//! Synthetic llama models of any size, shaped like a small real one: more and wider
//! layers, the small model's tokenizer and settings, and random but valid weights of
//! the same quantization types, so llama.cpp loads and runs them. They stand in for
//! models larger than RAM in tests and benchmarks.

mod arch;
mod fill;
mod hf_order;
mod metadata;
mod mix;
mod plan;
mod quantize;
mod router;

use std::collections::HashMap;
use std::io::{self, Write};

use rand::rngs::SmallRng;
use rand::SeedableRng;
use thiserror::Error;

pub use arch::SynthArch;
pub use fill::{f16_to_f32, f32_to_f16, Fill};
pub use mix::QuantMix;
pub use plan::{
    plan, plan_request, plan_with_weight_type, LlamaShape, MoeSpec, SynthPlan, SynthRequest,
};
pub use router::{embedding_spread, ContextAttention, ContextTensor, RouterLocality};

use crate::model::ggml_type::GgmlType;
use crate::model::gguf::{GgufWriteError, GgufWriter, NewTensor};

/// The order tensors are written in. Real converters differ, and the order decides
/// how far apart in the file the tensors of one step are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorOrder {
    /// The order llama.cpp reads them for one token.
    Exec,
    /// The small model's file order, extended to the new layers.
    File,
    /// By name, as safetensors and some converters do (`blk.10` before `blk.2`).
    Alphabetical,
    /// A random permutation (from the seed).
    Shuffled,
    /// As llama.cpp's converter writes a Hugging Face checkpoint: by checkpoint name,
    /// as strings (`hf_order`).
    Hf,
}

/// Why a synthetic model could not be made.
#[derive(Debug, Error)]
pub enum SynthError {
    #[error("the model's architecture is {0:?}; synth builds llama models only")]
    NotLlama(String),
    #[error("the model lacks metadata key {0:?}")]
    MissingKey(String),
    #[error("the model lacks tensor {0:?}")]
    MissingTensor(String),
    #[error("the model has tensor {0:?}, which synth does not know how to scale")]
    UnknownTensor(String),
    #[error("tensor {tensor:?} has dims {dims:?}, expected {expected:?} from the metadata")]
    UnexpectedShape {
        tensor: String,
        dims: Vec<u64>,
        expected: Vec<u64>,
    },
    #[error("synth cannot generate valid {0} data")]
    UnsupportedType(GgmlType),
    #[error("unsupported model shape: {0}")]
    Unsupported(String),
    #[error("requested {requested} bytes, but the smallest model of this shape takes {minimum}")]
    TooSmall { requested: u64, minimum: u64 },
    #[error("router locality: {0}")]
    Locality(String),
    #[error(
        "router locality writes {tensor} with chosen values, which synth writes in F32, F16, \
         BF16, Q8_0, Q4_0 or Q4_1 (Q8_0, F16, F32 or BF16 for the embedding), not {ty}; \
         give --type Q8_0"
    )]
    LocalityType { tensor: String, ty: GgmlType },
    #[error("writing the model: {0}")]
    Write(#[from] GgufWriteError),
    #[error("I/O error: {0}")]
    Io(#[from] io::Error),
}

/// Bytes generated and written per step: big enough to stream at disk speed, small
/// enough to keep memory flat.
const CHUNK: usize = 8 << 20;

/// A seed per tensor from its name, so a tensor's contents do not depend on the order.
fn tensor_seed(seed: u64, name: &str) -> u64 {
    // FNV-1a.
    name.bytes().fold(0xcbf2_9ce4_8422_2325 ^ seed, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The routers with affinity between layers (`Fill::Router`), by name: made in layer
/// order, whatever order the file has, each from its own tensor's seed. Small: a
/// router is experts x n_embd floats.
fn chained_routers(plan: &SynthPlan, seed: u64) -> HashMap<String, Vec<u8>> {
    let mut routers: Vec<(u32, &NewTensor, f32, f32, f32, u64)> = plan
        .tensors
        .iter()
        .filter_map(|tensor| match plan.fills.get(&tensor.name) {
            Some(&Fill::Router {
                std,
                skew,
                affinity,
                layer,
                row_len,
            }) if affinity > 0.0 && tensor.ggml_type == GgmlType::F32 => {
                Some((layer, tensor, std, skew, affinity, row_len))
            }
            _ => None,
        })
        .collect();
    routers.sort_by_key(|&(layer, ..)| layer);
    let mut chain = fill::RouterChain::new();
    routers
        .into_iter()
        .map(|(_, tensor, std, skew, affinity, row_len)| {
            let row_len = row_len.max(1) as usize;
            let elements: u64 = tensor.dims.iter().product();
            let rows = elements as usize / row_len;
            let mut rng = SmallRng::seed_from_u64(tensor_seed(seed, &tensor.name));
            let bytes = chain.next_layer(rows, row_len, std, skew, affinity, &mut rng);
            (tensor.name.clone(), bytes)
        })
        .collect()
}

/// Writes the planned model to `out`, calling `progress` with the bytes of tensor data
/// written so far. Streams: memory use is one chunk whatever the model size, and the
/// routers of a model with router affinity (`chained_routers`, made before the rest).
pub fn write<W: Write>(
    plan: &SynthPlan,
    out: W,
    seed: u64,
    mut progress: impl FnMut(u64),
) -> Result<W, SynthError> {
    let mut writer = GgufWriter::new(out, &plan.metadata, plan.tensors.clone(), plan.alignment)?;
    let mut buf = vec![0u8; CHUNK];
    let mut done = 0u64;
    let mut chained = chained_routers(plan, seed);
    let placed_tensors = writer.tensors().to_vec();
    for (new, placed) in plan.tensors.iter().zip(placed_tensors) {
        let what = plan
            .fills
            .get(&new.name)
            .copied()
            .unwrap_or(Fill::Weight { std: 0.02 });
        if let Some(bytes) = chained.remove(&new.name) {
            if bytes.len() as u64 != placed.size {
                return Err(SynthError::Unsupported(format!(
                    "router {} holds {} bytes, not the {} planned",
                    new.name,
                    bytes.len(),
                    placed.size
                )));
            }
            writer.write_data(&bytes)?;
            done += placed.size;
            progress(done);
            continue;
        }
        let mut rng = SmallRng::seed_from_u64(tensor_seed(seed, &new.name));
        // Whole blocks per chunk, so each chunk is valid data on its own; whole rows
        // for a tensor whose rows are made one by one. A router's rows share one
        // random ranking, so it is made in one piece (it is small: n_embd x experts
        // floats).
        let block = match router::row_len(&what) {
            Some(len) => new.ggml_type.tensor_bytes(&[u64::from(len)]).unwrap_or(1),
            None => new.ggml_type.type_size(),
        }
        .max(1) as usize;
        let step = match what {
            Fill::Router { .. } => (placed.size as usize).max(1),
            _ => (CHUNK / block).max(1) * block,
        };
        let mut left = placed.size;
        while left > 0 {
            let n = step.min(left as usize);
            if buf.len() < n {
                buf.resize(n, 0);
            }
            let first_row = (placed.size - left) / block as u64;
            match router::row_len(&what) {
                Some(_) => {
                    router::fill_rows(new.ggml_type, &what, first_row, &mut buf[..n], &mut rng)
                }
                None => fill::fill(new.ggml_type, what, &mut buf[..n], &mut rng),
            }
            writer.write_data(&buf[..n])?;
            left -= n as u64;
            done += n as u64;
            progress(done);
        }
    }
    Ok(writer.finish()?)
}
