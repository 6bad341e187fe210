//! Random tensor data that is valid for its ggml type: random quants, with every block
//! scale a small finite number, so a model built from it computes finite outputs.
//!
//! Block layouts follow `ggml/src/ggml-common.h`. Each tensor's blocks take their scale
//! from a 256-entry table around a target, indexed by a random byte already in the
//! block, so no per-block float work or extra random draws are needed.

use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::{Rng, RngCore};

use super::router::{ContextAttention, ContextTensor};
use crate::model::ggml_type::GgmlType;

/// What kind of values a tensor holds, which decides how it is filled.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Fill {
    /// A matrix weight with elements of about this standard deviation.
    Weight { std: f32 },
    /// Every element this value (norm weights: 1.0).
    Constant(f32),
    /// A mixture of experts' router: one row of `row_len` elements per expert, each
    /// row's elements of standard deviation `std` times the row's scale. The scales'
    /// logs spread evenly over `[-skew/2, skew/2]` in a random order of the experts,
    /// so a token's router logits (a row's dot product with the token's state) vary
    /// more for some experts than for others, and top-k picks those more often: expert
    /// popularity is skewed, differently in each layer (each router has its own seed).
    /// Filled whole: the ranking spans every row.
    ///
    /// With `affinity` above 0 the routers of consecutive layers are related: each row
    /// of layer l + 1 (in a random matching of rows) takes `affinity` of its direction
    /// from a row of layer l and the rest afresh (`RouterChain`). The residual stream
    /// changes little from one layer's router to the next, so a token whose state
    /// points along an expert's row in layer l tends to pick its successor in l + 1.
    /// Each row keeps its predecessor's scale: popularity follows the chain, and which experts
    /// are popular still differs per layer (the matching is random).
    Router {
        std: f32,
        skew: f32,
        affinity: f32,
        layer: u32,
        row_len: u64,
    },
    /// A locality router's token embedding (`router`): rows of `n_embd` elements of one
    /// norm, each with the same anchor element first. Filled by whole rows.
    Embedding { n_embd: u32 },
    /// One of layer 0's attention tensors of a locality router (`router`): chosen
    /// values, not random ones. Filled by whole rows.
    Context {
        attention: ContextAttention,
        tensor: ContextTensor,
    },
}

/// The f16 bit pattern nearest to `x` (round to nearest even); values below the
/// smallest normal f16 become zero, values beyond the largest become infinity.
pub fn f32_to_f16(x: f32) -> u16 {
    let bits = x.to_bits();
    let sign = ((bits >> 16) & 0x8000) as u16;
    let exp = ((bits >> 23) & 0xff) as i32;
    let mant = bits & 0x7f_ffff;
    if exp == 0xff {
        return sign | 0x7c00 | if mant != 0 { 0x200 } else { 0 };
    }
    let e = exp - 127 + 15;
    if e >= 0x1f {
        return sign | 0x7c00;
    }
    // Subnormal results keep what precision they can: small K-quant block scales
    // (1e-5 and below) live there in real models too.
    let (half, shift) = if e <= 0 {
        if e < -10 {
            return sign;
        }
        // Value = m * 2^(e - 14) units of 2^-24, the smallest subnormal.
        let m = mant | 0x80_0000;
        let shift = (14 - e) as u32;
        (m >> shift, shift)
    } else {
        (((e as u32) << 10) | (mant >> 13), 13)
    };
    let source = if e <= 0 { mant | 0x80_0000 } else { mant };
    let rest = source & ((1 << shift) - 1);
    let halfway = 1 << (shift - 1);
    let round = rest > halfway || (rest == halfway && half & 1 == 1);
    // A carry out of the mantissa correctly bumps the exponent.
    sign | (half + u32::from(round)) as u16
}

/// f16 bits to f32 (for tests and checks).
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = u32::from(h & 0x8000) << 16;
    let exp = u32::from((h >> 10) & 0x1f);
    let mant = u32::from(h & 0x3ff);
    let bits = match exp {
        0 if mant == 0 => sign,
        0 => {
            // Subnormal: normalise.
            let shift = mant.leading_zeros() - 21;
            sign | ((113 - shift) << 23) | ((mant << (shift + 13)) & 0x7f_ffff)
        }
        0x1f => sign | 0x7f80_0000 | (mant << 13),
        _ => sign | ((exp + 112) << 23) | (mant << 13),
    };
    f32::from_bits(bits)
}

fn bf16(x: f32) -> u16 {
    // Truncation is fine for random data.
    (x.to_bits() >> 16) as u16
}

/// Typical |value| of one element per unit of block scale, per type: the block scale
/// is the wanted standard deviation divided by this.
fn unit(ty: GgmlType) -> f32 {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q4_1 => 4.6,
        GgmlType::Q5_0 | GgmlType::Q5_1 => 9.2,
        GgmlType::Q8_0 | GgmlType::Q8_1 | GgmlType::Q8K => 73.0,
        GgmlType::Q2K => 8.0,
        GgmlType::Q3K => 40.0,
        GgmlType::Q4K => 143.0,
        GgmlType::Q5K => 285.0,
        GgmlType::Q6K => 1330.0,
        GgmlType::Iq4Nl | GgmlType::Iq4Xs => 60.0,
        GgmlType::Iq1S | GgmlType::Iq1M => 8.0,
        GgmlType::Tq1_0 | GgmlType::Tq2_0 => 1.0,
        _ => 30.0,
    }
}

/// Whether `fill` can produce valid data of this type.
pub fn supported(ty: GgmlType) -> bool {
    !matches!(ty, GgmlType::Nvfp4 | GgmlType::Q1_0)
}

/// Fills `buf` (a whole number of blocks of `ty`) with valid random data.
pub fn fill(ty: GgmlType, what: Fill, buf: &mut [u8], rng: &mut SmallRng) {
    match (ty, what) {
        (GgmlType::F32, Fill::Constant(v)) => repeat(buf, &v.to_le_bytes()),
        (GgmlType::F16, Fill::Constant(v)) => repeat(buf, &f32_to_f16(v).to_le_bytes()),
        (GgmlType::Bf16, Fill::Constant(v)) => repeat(buf, &bf16(v).to_le_bytes()),
        (GgmlType::F64, Fill::Constant(v)) => repeat(buf, &f64::from(v).to_le_bytes()),
        (GgmlType::F32, Fill::Weight { std }) => {
            floats(buf, 4, std, rng, |x| x.to_le_bytes().to_vec())
        }
        (GgmlType::F16, Fill::Weight { std }) => {
            floats(buf, 2, std, rng, |x| f32_to_f16(x).to_le_bytes().to_vec())
        }
        (GgmlType::Bf16, Fill::Weight { std }) => {
            floats(buf, 2, std, rng, |x| bf16(x).to_le_bytes().to_vec())
        }
        (GgmlType::F64, Fill::Weight { std }) => {
            floats(buf, 8, std, rng, |x| f64::from(x).to_le_bytes().to_vec())
        }
        (
            GgmlType::F32,
            Fill::Router {
                std, skew, row_len, ..
            },
        ) => router(buf, std, skew, row_len, rng),
        // Integer tensors hold indices or counts, not weights: zeros are valid.
        (GgmlType::I8 | GgmlType::I16 | GgmlType::I32 | GgmlType::I64, _) => buf.fill(0),
        // Zero bytes are zeros in every type (block scales of 0): a locality model's
        // later layers add no attention output.
        (_, Fill::Constant(0.0)) => buf.fill(0),
        // A quantized "constant" (never produced by the planner) gets weight data.
        (_, Fill::Constant(_)) => quantized(ty, 0.02, buf, rng),
        // Row by row, from the first (`write` passes each chunk's first row).
        (_, Fill::Embedding { .. } | Fill::Context { .. }) => {
            super::router::fill_rows(ty, &what, 0, buf, rng)
        }
        (_, Fill::Weight { std }) => quantized(ty, std, buf, rng),
        // Routers are planned as f32; any other type gets plain weights.
        (_, Fill::Router { std, .. }) => fill(ty, Fill::Weight { std }, buf, rng),
    }
}

/// See `Fill::Router`. `buf` holds whole f32 rows of `row_len` elements.
fn router(buf: &mut [u8], std: f32, skew: f32, row_len: u64, rng: &mut SmallRng) {
    let row_bytes = (row_len.max(1) * 4) as usize;
    let rows = buf.len() / row_bytes;
    let mut ranks: Vec<usize> = (0..rows).collect();
    ranks.shuffle(rng);
    for (row, &rank) in buf.chunks_exact_mut(row_bytes).zip(&ranks) {
        let position = if rows > 1 {
            rank as f32 / (rows - 1) as f32
        } else {
            0.5
        };
        let scale = (skew * (0.5 - position)).exp();
        floats(row, 4, std * scale, rng, |x| x.to_le_bytes().to_vec());
    }
}

/// Routers with affinity between consecutive layers (see `Fill::Router`), made layer
/// by layer: each layer's rows follow the directions of the layer made before it.
pub struct RouterChain {
    /// The previous layer's row directions (elements of unit variance, before the
    /// row's scale and the router's `std`).
    directions: Vec<Vec<f32>>,
    /// The previous layer's rows' ranks of scale.
    ranks: Vec<usize>,
}

impl RouterChain {
    pub fn new() -> Self {
        Self {
            directions: Vec::new(),
            ranks: Vec::new(),
        }
    }

    /// The next layer's router as f32 bytes: `rows` rows of `row_len` elements. The
    /// first layer made (or one whose shape differs from the one before) is drawn
    /// afresh.
    pub fn next_layer(
        &mut self,
        rows: usize,
        row_len: usize,
        std: f32,
        skew: f32,
        affinity: f32,
        rng: &mut SmallRng,
    ) -> Vec<u8> {
        let mut ranks: Vec<usize> = (0..rows).collect();
        ranks.shuffle(rng);
        let mut predecessors: Vec<usize> = (0..rows).collect();
        predecessors.shuffle(rng);
        let follows = affinity > 0.0
            && self.directions.len() == rows
            && self.directions.iter().all(|row| row.len() == row_len);
        if follows {
            // A row keeps its predecessor's scale: an expert whose predecessor was
            // popular is popular too, and its logits spread as its predecessor's did,
            // so the token that picked one picks the other. Which experts are popular
            // still differs per layer (the matching is random).
            ranks = predecessors.iter().map(|&p| self.ranks[p]).collect();
        }
        let (kept, fresh) = if follows {
            (affinity, (1.0 - affinity * affinity).max(0.0).sqrt())
        } else {
            (0.0, 1.0)
        };
        // Uniform on [-a, a] has unit variance for a = sqrt(3); the sum of two
        // independent unit-variance parts weighed kept^2 + fresh^2 = 1 has it too.
        let a = 3f32.sqrt();
        let mut directions = Vec::with_capacity(rows);
        let mut bytes = Vec::with_capacity(rows * row_len * 4);
        for row in 0..rows {
            let position = if rows > 1 {
                ranks[row] as f32 / (rows - 1) as f32
            } else {
                0.5
            };
            let scale = std * (skew * (0.5 - position)).exp();
            let before = follows.then(|| &self.directions[predecessors[row]]);
            let direction: Vec<f32> = (0..row_len)
                .map(|i| {
                    let x: f32 = rng.gen_range(-a..=a);
                    fresh * x + before.map_or(0.0, |b| kept * b[i])
                })
                .collect();
            bytes.extend(direction.iter().flat_map(|d| (d * scale).to_le_bytes()));
            directions.push(direction);
        }
        self.directions = directions;
        self.ranks = ranks;
        bytes
    }
}

impl Default for RouterChain {
    fn default() -> Self {
        Self::new()
    }
}

fn repeat(buf: &mut [u8], pattern: &[u8]) {
    for chunk in buf.chunks_exact_mut(pattern.len()) {
        chunk.copy_from_slice(pattern);
    }
}

fn floats(
    buf: &mut [u8],
    width: usize,
    std: f32,
    rng: &mut SmallRng,
    encode: impl Fn(f32) -> Vec<u8>,
) {
    // Uniform on [-a, a] has standard deviation a / sqrt(3).
    let a = std * 3f32.sqrt();
    for chunk in buf.chunks_exact_mut(width) {
        let x: f32 = rng.gen_range(-a..=a);
        chunk.copy_from_slice(&encode(x));
    }
}

/// 256 f16 scales spread over [0.5, 1.5] x `d`.
fn scale_table(d: f32) -> [[u8; 2]; 256] {
    let mut table = [[0u8; 2]; 256];
    for (i, entry) in table.iter_mut().enumerate() {
        *entry = f32_to_f16(d * (0.5 + i as f32 / 256.0)).to_le_bytes();
    }
    table
}

fn put_f16(block: &mut [u8], at: usize, table: &[[u8; 2]; 256], index: u8) {
    block[at..at + 2].copy_from_slice(&table[usize::from(index)]);
}

/// int8 quants must stay in -127..=127: ggml's quantizers never produce -128, and
/// some SIMD dot products take the absolute value of a quant.
fn clamp_i8(bytes: &mut [u8]) {
    for b in bytes {
        if *b == 0x80 {
            *b = 0x81;
        }
    }
}

fn quantized(ty: GgmlType, std: f32, buf: &mut [u8], rng: &mut SmallRng) {
    rng.fill_bytes(buf);
    let d = std / unit(ty);
    let d_table = scale_table(d);
    let size = ty.type_size() as usize;
    // Second table for the "min" of the affine types, chosen to centre the values.
    let m_table = match ty {
        GgmlType::Q4_1 => scale_table(-8.0 * d),
        GgmlType::Q5_1 => scale_table(-16.0 * d),
        GgmlType::Q2K => scale_table(d),
        GgmlType::Q4K => scale_table(7.5 * d),
        GgmlType::Q5K => scale_table(15.5 * d),
        _ => d_table,
    };
    for block in buf.chunks_exact_mut(size) {
        match ty {
            GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Iq4Nl => {
                put_f16(block, 0, &d_table, block[0])
            }
            GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K => {
                let i = block[0];
                put_f16(block, 0, &d_table, i);
                put_f16(block, 2, &m_table, i);
            }
            GgmlType::Q8_0 => {
                put_f16(block, 0, &d_table, block[0]);
                clamp_i8(&mut block[2..]);
            }
            GgmlType::Q8_1 => {
                let i = block[0];
                put_f16(block, 0, &d_table, i);
                clamp_i8(&mut block[4..]);
                let sum: i32 = block[4..].iter().map(|&q| i32::from(q as i8)).sum();
                let dv = f16_to_f32(u16::from_le_bytes(d_table[usize::from(i)]));
                block[2..4].copy_from_slice(&f32_to_f16(dv * sum as f32).to_le_bytes());
            }
            GgmlType::Q2K => {
                let i = block[80];
                put_f16(block, 80, &d_table, i);
                put_f16(block, 82, &m_table, i);
            }
            GgmlType::Q3K => put_f16(block, 108, &d_table, block[108]),
            GgmlType::Q6K => put_f16(block, 208, &d_table, block[208]),
            GgmlType::Q8K => {
                let scale = d * (0.5 + f32::from(block[0]) / 256.0);
                block[0..4].copy_from_slice(&scale.to_le_bytes());
                clamp_i8(&mut block[4..260]);
                for g in 0..16 {
                    let sum: i16 = block[4 + 16 * g..4 + 16 * (g + 1)]
                        .iter()
                        .map(|&q| i16::from(q as i8))
                        .sum();
                    block[260 + 2 * g..262 + 2 * g].copy_from_slice(&sum.to_le_bytes());
                }
            }
            GgmlType::Iq1M => {
                // The f16 scale is spread over the top nibbles of the four u16 scales.
                let bits = u16::from_le_bytes(d_table[usize::from(block[48])]);
                for j in 0..4 {
                    let at = 48 + 2 * j;
                    let old = u16::from_le_bytes([block[at], block[at + 1]]);
                    let new = (old & 0x0fff) | (((bits >> (4 * j)) & 0xf) << 12);
                    block[at..at + 2].copy_from_slice(&new.to_le_bytes());
                }
            }
            GgmlType::Tq1_0 => put_f16(block, 52, &d_table, block[52]),
            GgmlType::Tq2_0 => put_f16(block, 64, &d_table, block[64]),
            GgmlType::Mxfp4 => {
                // E8M0 shared exponent: 2^(e - 127), kept near the wanted scale.
                let e = (127.0 + (std / 3.0).log2()).round().clamp(1.0, 254.0) as u8;
                block[0] = e;
            }
            // The remaining IQ types: an f16 scale first, then grid indices, signs
            // and sub-scales, all of which are valid for any bits.
            _ => put_f16(block, 0, &d_table, block[0]),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn rows(bytes: &[u8], row_len: usize) -> Vec<Vec<f32>> {
        bytes
            .chunks_exact(row_len * 4)
            .map(|row| {
                row.chunks_exact(4)
                    .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                    .collect()
            })
            .collect()
    }

    fn correlation(a: &[f32], b: &[f32]) -> f32 {
        let dot = |x: &[f32], y: &[f32]| x.iter().zip(y).map(|(p, q)| p * q).sum::<f32>();
        dot(a, b) / (dot(a, a) * dot(b, b)).sqrt()
    }

    #[test]
    fn chained_routers_follow_the_layer_before_by_their_affinity() {
        let (experts, row_len) = (8, 512);
        let mut rng = SmallRng::seed_from_u64(5);
        let mut chain = RouterChain::new();
        let first = rows(
            &chain.next_layer(experts, row_len, 0.1, 2.0, 0.8, &mut rng),
            row_len,
        );
        let second = rows(
            &chain.next_layer(experts, row_len, 0.1, 2.0, 0.8, &mut rng),
            row_len,
        );
        // Each row of the second layer has one predecessor it correlates with at about
        // the affinity, and keeps its scale; the others it does not correlate with.
        for row in &second {
            let mut by_correlation: Vec<(f32, &Vec<f32>)> =
                first.iter().map(|f| (correlation(row, f), f)).collect();
            by_correlation.sort_by(|a, b| b.0.total_cmp(&a.0));
            let (best, predecessor) = by_correlation[0];
            assert!((best - 0.8).abs() < 0.08, "{best}");
            assert!(by_correlation[1].0.abs() < 0.2, "{}", by_correlation[1].0);
            let norm = |r: &[f32]| r.iter().map(|x| x * x).sum::<f32>().sqrt();
            let ratio = norm(row) / norm(predecessor);
            assert!((ratio - 1.0).abs() < 0.1, "scale kept: {ratio}");
        }
        // Without affinity a layer is drawn afresh.
        let third = rows(
            &chain.next_layer(experts, row_len, 0.1, 2.0, 0.0, &mut rng),
            row_len,
        );
        for row in &third {
            assert!(second.iter().all(|s| correlation(row, s).abs() < 0.2));
        }
    }

    #[test]
    fn f16_conversion_round_trips_small_values() {
        // Every finite f16 (normal and subnormal) survives the trip.
        for h in 0..=u16::MAX {
            if h & 0x7c00 != 0x7c00 {
                assert_eq!(f32_to_f16(f16_to_f32(h)), h, "{h:#06x}");
            }
        }
        assert_eq!(f32_to_f16(1e6), 0x7c00);
        assert_eq!(f32_to_f16(1e-9), 0);
        for x in [0.1f32, 1e-5, 3e-7] {
            let back = f16_to_f32(f32_to_f16(x));
            assert!((back - x).abs() <= x * 1e-3 + 6e-8, "{x} -> {back}");
        }
    }

    #[test]
    fn block_scales_are_finite_and_small() {
        let mut rng = SmallRng::seed_from_u64(1);
        for ty in GgmlType::all().filter(|t| t.is_quantized() && supported(*t)) {
            let mut buf = vec![0u8; ty.type_size() as usize * 64];
            fill(ty, Fill::Weight { std: 0.02 }, &mut buf, &mut rng);
            let at = match ty {
                GgmlType::Q2K => Some(80),
                GgmlType::Q3K => Some(108),
                GgmlType::Q6K => Some(208),
                GgmlType::Tq1_0 => Some(52),
                GgmlType::Tq2_0 => Some(64),
                GgmlType::Q8K | GgmlType::Iq1M | GgmlType::Mxfp4 => None,
                _ => Some(0),
            };
            if let Some(at) = at {
                for block in buf.chunks_exact(ty.type_size() as usize) {
                    let d = f16_to_f32(u16::from_le_bytes([block[at], block[at + 1]]));
                    assert!(d.is_finite() && d > 0.0 && d < 0.05, "{ty}: d = {d}");
                }
            }
        }
    }
}
