//! Tests of the locality router's tensors: pure, no kernel.
use super::*;
use rand::SeedableRng;

fn attention(rope_base: f32, n_head: u32, n_head_kv: u32) -> ContextAttention {
    ContextAttention {
        locality: RouterLocality::qwen3(),
        n_embd: 64 * n_head,
        n_head,
        n_head_kv,
        head_dim: 64,
        rope_base,
    }
}

/// The attention weights a window head gives the tokens `0..n` back, from its q
/// and k rows as llama.cpp scores them after RoPE.
fn weights(attention: &ContextAttention, head: u32, n: usize) -> Vec<f64> {
    let anchor = normed_anchor(attention.n_embd);
    let kq_scale = 1.0 / f64::from(attention.head_dim).sqrt();
    let score = |distance: usize| -> f64 {
        (0..attention.head_dim / 2)
            .map(|i| {
                let q = f64::from(attention.query(head, 2 * i) / anchor * anchor);
                let k = f64::from(attention.key(2 * i));
                q * k * (distance as f64 * f64::from(attention.theta(i))).cos()
            })
            .sum::<f64>()
            * kq_scale
    };
    let scores: Vec<f64> = (0..n).map(score).collect();
    let top = scores.iter().copied().fold(f64::MIN, f64::max);
    let exp: Vec<f64> = scores.iter().map(|s| (s - top).exp()).collect();
    let total: f64 = exp.iter().sum();
    exp.iter().map(|e| e / total).collect()
}

#[test]
fn window_heads_attend_to_about_their_last_tokens_at_any_context_length() {
    for base in [10_000.0, 100_000.0, 500_000.0] {
        let attention = attention(base, 9, 3);
        for head in 0..9 {
            let HeadRole::Window { kind } = attention.role(head) else {
                continue;
            };
            let sigma = f64::from(RouterLocality::WINDOW_TOKENS[kind]);
            for n in [64, 512, 4096] {
                let w = weights(&attention, head, n);
                let mean: f64 = w.iter().enumerate().map(|(d, p)| d as f64 * p).sum();
                // A half-Gaussian's mean is 0.8 sigma; discrete, a little less.
                assert!(
                    (0.5 * sigma..=1.0 * sigma).contains(&mean),
                    "base {base} sigma {sigma} n {n}: mean distance {mean}"
                );
                let far: f64 = w.iter().skip((4.0 * sigma) as usize + 2).sum();
                assert!(
                    far < 0.01,
                    "base {base} sigma {sigma} n {n}: {far} far away"
                );
            }
        }
    }
}

#[test]
fn each_group_of_heads_has_one_mean_that_takes_away_its_windows() {
    let attention = attention(100_000.0, 9, 3);
    let roles: Vec<HeadRole> = (0..9).map(|h| attention.role(h)).collect();
    let mut kinds = [0; 3];
    for group in roles.chunks(3) {
        assert_eq!(group[2], HeadRole::Mean);
        for role in &group[..2] {
            let HeadRole::Window { kind } = role else {
                panic!("{roles:?}")
            };
            kinds[*kind] += 1;
        }
    }
    assert_eq!(kinds, [2, 2, 2], "every window kind as often");
    for group in 0..3 {
        let gains: Vec<f32> = (3 * group..3 * group + 3)
            .map(|h| attention.gain(h))
            .collect();
        assert!(gains[0] > 0.0 && gains[1] > 0.0);
        assert!((gains.iter().sum::<f32>()).abs() < 1e-5, "{gains:?}");
    }
    // A mean head's q is zero: it attends evenly.
    assert!((0..64).all(|d| attention.query(2, d) == 0.0));
    // Without a shared key (one head per group) every head is a window.
    let solo = ContextAttention {
        n_head_kv: 9,
        ..attention
    };
    assert!((0..9).all(|h| matches!(solo.role(h), HeadRole::Window { .. })));
}

#[test]
fn embedding_rows_share_their_norm_and_anchor_exactly() {
    let n_embd = 576;
    let ctx = attention(100_000.0, 9, 3);
    let fill = Fill::Embedding { n_embd };
    for ty in [GgmlType::Q8_0, GgmlType::F16, GgmlType::F32] {
        let row_bytes = ty.tensor_bytes(&[u64::from(n_embd)]).unwrap() as usize;
        let mut buf = vec![0u8; row_bytes * 4];
        fill_rows(ty, &fill, 0, &mut buf, &mut SmallRng::seed_from_u64(1));
        let rows: Vec<Vec<f32>> = buf.chunks_exact(row_bytes).map(|r| decode(ty, r)).collect();
        let norm = |r: &[f32]| r.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>();
        for row in &rows {
            assert_eq!(row[0], ANCHOR_UNITS as f32 * EMBEDDING_UNIT, "{ty}");
            assert_eq!(norm(row), norm(&rows[0]), "{ty}");
        }
        assert_ne!(rows[0], rows[1], "{ty}: rows are shuffled");
        let spread = (norm(&rows[0]) / f64::from(n_embd)).sqrt() as f32;
        assert!((spread - embedding_spread(n_embd)).abs() < 1e-3, "{spread}");
    }
    let refused = check_type("token_embd.weight", GgmlType::Q4_1, &fill);
    assert!(
        matches!(&refused, Err(SynthError::LocalityType { tensor, ty: GgmlType::Q4_1 })
            if tensor == "token_embd.weight"),
        "{refused:?}"
    );
    let query = fill_for("attn_q.weight", 0, &ctx).unwrap();
    assert!(check_type("blk.0.attn_q.weight", GgmlType::Q4_1, &query).is_ok());
    assert!(matches!(
        check_type("blk.0.attn_q.weight", GgmlType::Q4K, &query),
        Err(SynthError::LocalityType {
            ty: GgmlType::Q4K,
            ..
        })
    ));
}

/// Q8_0, F16 or F32 row bytes as floats.
fn decode(ty: GgmlType, row: &[u8]) -> Vec<f32> {
    use crate::model::synth::f16_to_f32;
    let half = |b: &[u8]| f16_to_f32(u16::from_le_bytes([b[0], b[1]]));
    match ty {
        GgmlType::Q8_0 => row
            .chunks_exact(34)
            .flat_map(|b| b[2..].iter().map(move |&q| half(b) * f32::from(q as i8)))
            .collect(),
        GgmlType::F16 => row.chunks_exact(2).map(half).collect(),
        _ => row
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect(),
    }
}

#[test]
fn query_and_key_rows_read_the_anchor_alone() {
    let ctx = attention(100_000.0, 9, 3);
    let mut rng = SmallRng::seed_from_u64(2);
    for (tensor, rows) in [(ContextTensor::Query, 9 * 64), (ContextTensor::Key, 3 * 64)] {
        let mut used = 0;
        for row in 0..rows {
            let mut values = Vec::new();
            ctx.row(tensor, row, &mut rng, &mut values);
            assert_eq!(values.len(), 576);
            assert!(values[1..].iter().all(|&x| x == 0.0));
            used += usize::from(values[0] != 0.0);
        }
        assert!(used > 0 && used < rows as usize / 2, "{tensor:?}: {used}");
    }
    let mut values = Vec::new();
    ctx.row(ContextTensor::Value, 0, &mut rng, &mut values);
    assert_eq!(values[0], 0.0, "values leave the anchor out");
    assert!(values[1..].iter().all(|&x| x != 0.0));
}

#[test]
fn locality_arguments_parse_and_bad_ones_say_why() {
    assert_eq!(RouterLocality::parse("off").unwrap(), None);
    assert_eq!(
        RouterLocality::parse("qwen3").unwrap(),
        Some(RouterLocality::qwen3())
    );
    assert_eq!(
        RouterLocality::parse("token").unwrap().unwrap().context,
        0.0
    );
    let three = RouterLocality::parse("3.5").unwrap().unwrap();
    assert_eq!((three.context, three.skew), (3.5, None));
    for bad in ["-1", "65", "NaN", "inf", "lots"] {
        let error = RouterLocality::parse(bad).unwrap_err().to_string();
        assert!(error.starts_with("router locality: "), "{bad}: {error}");
    }
}
