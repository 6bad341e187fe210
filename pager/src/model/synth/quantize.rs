//! Chosen values, not random ones, in a tensor's ggml type: the rows of the tensors a
//! locality router is built from (`router`) must hold what was designed (a single
//! non-zero element, exact zeros, one shared projection), so they are quantized the
//! way ggml's reference quantizers do, for the few types that is written for here.

use super::fill::f32_to_f16;
use crate::model::ggml_type::GgmlType;

/// Whether `encode` writes this type.
pub fn supported(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::F32
            | GgmlType::F16
            | GgmlType::Bf16
            | GgmlType::Q8_0
            | GgmlType::Q4_0
            | GgmlType::Q4_1
    )
}

/// Appends `values` (a whole number of `ty`'s blocks) to `out` in type `ty`, which
/// must be `supported`. An all-zero block is written as zero bytes, which every one of
/// these types reads back as exact zeros.
pub fn encode(ty: GgmlType, values: &[f32], out: &mut Vec<u8>) {
    match ty {
        GgmlType::F32 => out.extend(values.iter().flat_map(|x| x.to_le_bytes())),
        GgmlType::F16 => out.extend(values.iter().flat_map(|&x| f32_to_f16(x).to_le_bytes())),
        GgmlType::Bf16 => out.extend(values.iter().flat_map(|&x| bf16_round(x).to_le_bytes())),
        GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q4_1 => {
            for block in values.chunks_exact(32) {
                match ty {
                    // Q4_0 would write d = -0.0 and quants of 8 for it.
                    _ if block.iter().all(|&x| x == 0.0) => {
                        out.extend(std::iter::repeat_n(0u8, ty.type_size() as usize))
                    }
                    GgmlType::Q8_0 => q8_0(block, out),
                    GgmlType::Q4_0 => q4_0(block, out),
                    _ => q4_1(block, out),
                }
            }
        }
        other => unreachable!("quantize::encode({other}) is not supported"),
    }
}

/// bf16 by round to nearest even (values here are finite).
fn bf16_round(x: f32) -> u16 {
    let bits = x.to_bits();
    let round = 0x7fff + ((bits >> 16) & 1);
    (bits.wrapping_add(round) >> 16) as u16
}

/// `quantize_row_q8_0_ref`: d = max|x| / 127, q = round(x / d).
fn q8_0(block: &[f32], out: &mut Vec<u8>) {
    let amax = block.iter().fold(0f32, |m, x| m.max(x.abs()));
    let d = amax / 127.0;
    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
    out.extend(f32_to_f16(d).to_le_bytes());
    out.extend(block.iter().map(|x| (x * id).round() as i8 as u8));
}

/// `quantize_row_q4_0_ref`: d = (the element of largest magnitude) / -8, q = x / d + 8
/// clamped to 0..=15, two quants a byte (element j low, j + 16 high).
fn q4_0(block: &[f32], out: &mut Vec<u8>) {
    let max = block
        .iter()
        .copied()
        .fold(0f32, |m, x| if x.abs() > m.abs() { x } else { m });
    let d = max / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out.extend(f32_to_f16(d).to_le_bytes());
    let q = |x: f32| ((x * id + 8.5) as i32).clamp(0, 15) as u8;
    out.extend((0..16).map(|j| q(block[j]) | (q(block[j + 16]) << 4)));
}

/// `quantize_row_q4_1_ref`: m = min, d = (max - min) / 15, q = round((x - m) / d).
fn q4_1(block: &[f32], out: &mut Vec<u8>) {
    let min = block.iter().copied().fold(f32::INFINITY, f32::min);
    let max = block.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let d = (max - min) / 15.0;
    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
    out.extend(f32_to_f16(d).to_le_bytes());
    out.extend(f32_to_f16(min).to_le_bytes());
    let q = |x: f32| (((x - min) * id + 0.5) as i32).clamp(0, 15) as u8;
    out.extend((0..16).map(|j| q(block[j]) | (q(block[j + 16]) << 4)));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::synth::f16_to_f32;

    /// What ggml reads back from one block of `ty`.
    fn decode(ty: GgmlType, bytes: &[u8]) -> Vec<f32> {
        let half = |at: usize| f16_to_f32(u16::from_le_bytes([bytes[at], bytes[at + 1]]));
        let nibbles = |at: usize| -> Vec<f32> {
            let low = bytes[at..at + 16].iter().map(|b| f32::from(b & 15));
            let high = bytes[at..at + 16].iter().map(|b| f32::from(b >> 4));
            low.chain(high).collect()
        };
        match ty {
            GgmlType::Q8_0 => bytes[2..34]
                .iter()
                .map(|&q| half(0) * f32::from(q as i8))
                .collect(),
            GgmlType::Q4_0 => nibbles(2).iter().map(|q| half(0) * (q - 8.0)).collect(),
            GgmlType::Q4_1 => nibbles(4).iter().map(|q| half(0) * q + half(2)).collect(),
            GgmlType::F16 => bytes
                .chunks_exact(2)
                .map(|b| f16_to_f32(u16::from_le_bytes([b[0], b[1]])))
                .collect(),
            GgmlType::Bf16 => bytes
                .chunks_exact(2)
                .map(|b| f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16))
                .collect(),
            _ => bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect(),
        }
    }

    #[test]
    fn blocks_read_back_within_a_step_and_zeros_exactly() {
        let values: Vec<f32> = (0..32)
            .map(|i| ((i * 37 % 32) as f32 - 15.5) * 0.1)
            .collect();
        let mut sparse = vec![0f32; 32];
        sparse[0] = 3.25;
        for ty in [
            GgmlType::F32,
            GgmlType::F16,
            GgmlType::Bf16,
            GgmlType::Q8_0,
            GgmlType::Q4_0,
            GgmlType::Q4_1,
        ] {
            let mut out = Vec::new();
            encode(ty, &values, &mut out);
            assert_eq!(out.len() as u64, ty.tensor_bytes(&[32]).unwrap(), "{ty}");
            // Within half a step, but Q4_0's quants reach one step less far up than
            // down (-8..=7): the largest positive value may lose a whole step.
            let (step, within) = match ty {
                GgmlType::Q4_0 => (1.55 / 8.0, 1.01),
                GgmlType::Q4_1 => (3.1 / 15.0, 0.51),
                GgmlType::Q8_0 => (1.55 / 127.0, 0.51),
                _ => (0.01, 0.51),
            };
            for (got, want) in decode(ty, &out).iter().zip(&values) {
                assert!(
                    (got - want).abs() <= step * within,
                    "{ty}: {got} for {want}"
                );
            }
            // One element and zeros: the zeros stay exact, the element within a step.
            let mut out = Vec::new();
            encode(ty, &sparse, &mut out);
            let back = decode(ty, &out);
            assert!((back[0] - 3.25).abs() < 0.01, "{ty}: {}", back[0]);
            assert!(back[1..].iter().all(|&x| x == 0.0), "{ty}: {back:?}");
            let mut zeros = Vec::new();
            encode(ty, &[0.0; 32], &mut zeros);
            assert!(zeros.iter().all(|&b| b == 0), "{ty}: zero block {zeros:?}");
        }
    }
}
