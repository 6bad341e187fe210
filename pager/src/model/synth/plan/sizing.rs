//! Choosing the width and depth of a model of the small one's roles and types so that
//! its tensor data comes out nearest a requested size.

use super::super::SynthError;
use super::roles::Role;
use super::shape::LlamaShape;
use crate::model::ggml_type::GgmlType;

fn lcm(a: u64, b: u64) -> u64 {
    fn gcd(a: u64, b: u64) -> u64 {
        if b == 0 {
            a
        } else {
            gcd(b, a % b)
        }
    }
    a / gcd(a, b) * b
}

/// Layers of `n_layer` that take their type from small layer `j` of `n_small`
/// (those `i` with `i * n_small / n_layer == j`).
fn layers_from(j: u64, n_small: u64, n_layer: u64) -> u64 {
    let first = |j: u64| (u128::from(j) * u128::from(n_layer)).div_ceil(u128::from(n_small.max(1)));
    // At most n_layer, so it fits back in u64.
    (first(j + 1).min(u128::from(n_layer)) - first(j).min(u128::from(n_layer))) as u64
}

/// Bytes of all tensor data (each padded to the alignment) for a shape. Counts layers
/// per small-model type rather than walking every layer, so it is cheap for any depth.
fn data_bytes(shape: &LlamaShape, globals: &[Role], layer: &[Role], alignment: u64) -> Option<u64> {
    let bytes = |role: &Role, ty: GgmlType| {
        shape
            .dims(&role.name)
            .and_then(|d| ty.tensor_bytes(&d))
            .and_then(|b| b.checked_next_multiple_of(alignment))
    };
    let mut total = 0u64;
    for role in globals {
        total = total.checked_add(bytes(role, role.types[0])?)?;
    }
    for role in layer {
        let n_small = role.types.len() as u64;
        for (j, ty) in role.types.iter().enumerate() {
            let count = layers_from(j as u64, n_small, shape.n_layer);
            total = total.checked_add(bytes(role, *ty)?.checked_mul(count)?)?;
        }
    }
    Some(total)
}

/// Picks the shape nearest `target` bytes of data: widths are whole multiples of the
/// small model's (head counts scaled, head size kept), depth grows with the square root
/// of the width as in real model families, and the feed-forward width is then tuned so
/// the total lands close to the target.
pub(super) fn choose_shape(
    small: &LlamaShape,
    globals: &[Role],
    layer: &[Role],
    target: u64,
    alignment: u64,
    ff_ratio: Option<f64>,
) -> Result<LlamaShape, SynthError> {
    // ne[0] of every tensor must be whole blocks of its type.
    let all_types = globals.iter().chain(layer).flat_map(|r| r.types.iter());
    let embd_block = all_types.clone().map(|t| t.block_size()).fold(1, lcm);
    let ff_block = layer
        .iter()
        .filter(|r| r.name == "ffn_down.weight" || r.name == "ffn_down_exps.weight")
        .flat_map(|r| r.types.iter())
        .map(|t| t.block_size())
        .fold(embd_block, lcm);
    let ff_ratio = ff_ratio.unwrap_or(small.n_ff as f64 / small.n_embd as f64);

    let mut best: Option<(f64, LlamaShape)> = None;
    let mut smallest: Option<u64> = None;
    for m in 1..=64u64 {
        let mut shape = LlamaShape {
            n_layer: 1,
            n_embd: small.n_embd * m,
            n_head: small.n_head * m,
            n_head_kv: small.n_head_kv * m,
            n_ff: ((small.n_embd * m) as f64 * ff_ratio / ff_block as f64)
                .round()
                .max(1.0) as u64
                * ff_block,
            ..*small
        };
        if shape.n_embd % embd_block != 0 {
            continue;
        }
        let Some(one) = data_bytes(&shape, globals, layer, alignment) else {
            continue;
        };
        smallest = Some(smallest.map_or(one, |s: u64| s.min(one)));
        shape.n_layer = 0;
        let Some(fixed) = data_bytes(&shape, globals, layer, alignment) else {
            continue;
        };
        let per_layer = one - fixed;
        if one > target || per_layer == 0 {
            continue;
        }
        shape.n_layer = ((target - fixed) as f64 / per_layer as f64)
            .round()
            .max(1.0) as u64;
        tune_ff(&mut shape, globals, layer, target, alignment, ff_block);
        // A mixture of experts holds more parameters per layer than a dense model of
        // its depth: Mixtral 8x7B has the depth of the 7B. Depth follows the share of
        // the experts a token runs.
        let sparsity = if small.n_expert > 0 {
            (small.n_expert as f64 / small.n_expert_used.max(1) as f64).sqrt()
        } else {
            1.0
        };
        let want_layers = small.n_layer as f64 * (m as f64).sqrt() / sparsity;
        let score = (shape.n_layer as f64 / want_layers).ln().abs();
        if best.as_ref().is_none_or(|(s, _)| score < *s) {
            best = Some((score, shape));
        }
    }
    best.map(|(_, shape)| shape).ok_or(SynthError::TooSmall {
        requested: target,
        minimum: smallest.unwrap_or(u64::MAX),
    })
}

/// Moves the feed-forward width (in whole blocks, within a factor of two) to bring
/// the total nearest the target. The total grows with the width: binary search.
fn tune_ff(
    shape: &mut LlamaShape,
    globals: &[Role],
    layer: &[Role],
    target: u64,
    alignment: u64,
    block: u64,
) {
    let total = |n_ff: u64| data_bytes(&LlamaShape { n_ff, ..*shape }, globals, layer, alignment);
    let (mut lo, mut hi) = ((shape.n_ff / 2 / block).max(1), shape.n_ff * 2 / block);
    // Find the first width (in blocks) whose total reaches the target.
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        match total(mid * block) {
            Some(t) if t >= target => hi = mid,
            Some(_) => lo = mid + 1,
            None => hi = mid,
        }
    }
    let error = |blocks: u64| total(blocks * block).map_or(u64::MAX, |t| t.abs_diff(target));
    let best = [lo.saturating_sub(1).max(1), lo]
        .into_iter()
        .min_by_key(|&b| error(b))
        .unwrap_or(lo);
    shape.n_ff = best * block;
}
