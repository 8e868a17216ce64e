//! Rotary position embedding, rotate-half (Llama / Hugging Face) convention.
//!
//! For head dimension `d` and `i < d/2`, the pair `(x[i], x[i + d/2])` is
//! rotated by angle `pos * theta^(-2i/d)`. Positions are given per token so a
//! rank holding a sequence shard passes its global positions.
//!
//! Angles and their sine/cosine are computed in f64 and rounded to f32:
//! `pos * freq` in f32 loses most of the angle's fractional bits once
//! positions reach ~1e5, which is a model-quality bug rather than noise.

#![allow(clippy::too_many_arguments)]

use super::{check_len, invalid, par_rows, prod, KernelError};

fn check(
    x_len: usize,
    out_len: usize,
    positions: &[u32],
    tokens: usize,
    heads: usize,
    head_dim: usize,
) -> Result<(), KernelError> {
    if !head_dim.is_multiple_of(2) {
        return Err(invalid("head_dim", format!("must be even, got {head_dim}")));
    }
    check_len("positions", positions.len(), tokens)?;
    let n = prod("x", &[tokens, heads, head_dim])?;
    check_len("x", x_len, n)?;
    check_len("out", out_len, n)
}

/// Rotates every `[head_dim]` vector of `x` by `sign * angle` and adds
/// (`accumulate`) or writes the result into `out`.
fn rotate(
    x: &[f32],
    positions: &[u32],
    heads: usize,
    head_dim: usize,
    theta: f32,
    sign: f64,
    accumulate: bool,
    out: &mut [f32],
) {
    let half = head_dim / 2;
    let tok_len = heads * head_dim;
    // The frequencies depend only on the pair index: computed once per call.
    let freqs: Vec<f64> = (0..half)
        .map(|i| (theta as f64).powf(-2.0 * i as f64 / head_dim as f64))
        .collect();
    // The rotations depend only on the position, and a batch repeats its
    // positions in every sequence: one (cos, sin) row per distinct position.
    let mut distinct = positions.to_vec();
    distinct.sort_unstable();
    distinct.dedup();
    let mut table = vec![(0.0f32, 0.0f32); distinct.len() * half];
    for (row, &pos) in table.chunks_exact_mut(half.max(1)).zip(&distinct) {
        for (c, &freq) in row.iter_mut().zip(&freqs) {
            let ang = pos as f64 * freq * sign;
            *c = (ang.cos() as f32, ang.sin() as f32);
        }
    }
    par_rows(out, tok_len, |t0, out| {
        for (t, &pos) in positions[t0..t0 + out.len() / tok_len.max(1)]
            .iter()
            .enumerate()
        {
            let at = distinct.binary_search(&pos).unwrap_or(0);
            let cs = &table[at * half..(at + 1) * half];
            for h in 0..heads {
                let base = t * tok_len + h * head_dim;
                let xv = &x[t0 * tok_len + base..][..head_dim];
                let ov = &mut out[base..base + head_dim];
                for (i, &(cos, sin)) in cs.iter().enumerate() {
                    let (x1, x2) = (xv[i], xv[i + half]);
                    let y1 = x1 * cos - x2 * sin;
                    let y2 = x2 * cos + x1 * sin;
                    if accumulate {
                        ov[i] += y1;
                        ov[i + half] += y2;
                    } else {
                        ov[i] = y1;
                        ov[i + half] = y2;
                    }
                }
            }
        }
    });
}

/// RoPE forward on `x [tokens, heads, head_dim]` with `positions [tokens]`,
/// writing `out` (same shape). `head_dim` must be even; `theta` is the base
/// (10000 in Llama 2, 500000 in Llama 3).
pub fn rope_fwd(
    x: &[f32],
    positions: &[u32],
    tokens: usize,
    heads: usize,
    head_dim: usize,
    theta: f32,
    out: &mut [f32],
) -> Result<(), KernelError> {
    check(x.len(), out.len(), positions, tokens, heads, head_dim)?;
    rotate(x, positions, heads, head_dim, theta, 1.0, false, out);
    Ok(())
}

/// RoPE backward: the rotation is orthogonal, so `dx += R(-angle) d_out`.
pub fn rope_bwd(
    d_out: &[f32],
    positions: &[u32],
    tokens: usize,
    heads: usize,
    head_dim: usize,
    theta: f32,
    dx: &mut [f32],
) -> Result<(), KernelError> {
    check(d_out.len(), dx.len(), positions, tokens, heads, head_dim)?;
    rotate(d_out, positions, heads, head_dim, theta, -1.0, true, dx);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testutil::{assert_grad_close, dot64, numeric_grad, Rng};

    #[test]
    fn rotate_half_by_hand() {
        // head_dim 4: pairs (0,2) with freq 1 and (1,3) with freq theta^-0.5 = 0.01
        let x = [1.0, 1.0, 0.0, 0.0];
        let mut out = [0.0; 4];
        rope_fwd(&x, &[2], 1, 1, 4, 10000.0, &mut out).unwrap();
        let (a0, a1) = (2.0f64, 0.02f64);
        let expect = [a0.cos(), a1.cos(), a0.sin(), a1.sin()];
        for (o, e) in out.iter().zip(expect) {
            assert!((*o as f64 - e).abs() < 1e-6, "{o} vs {e}");
        }
        // position 0 is the identity
        rope_fwd(&x, &[0], 1, 1, 4, 10000.0, &mut out).unwrap();
        assert_eq!(out, x);
    }

    #[test]
    fn relative_position_property_and_sharded_positions() {
        // <R(p) q, R(p') k> depends only on p - p'
        let mut rng = Rng::new(21);
        let (heads, hd) = (2, 8);
        let q = rng.vec(heads * hd);
        let k = rng.vec(heads * hd);
        let dotp = |pq: u32, pk: u32| {
            let (mut a, mut b) = (vec![0.0; heads * hd], vec![0.0; heads * hd]);
            rope_fwd(&q, &[pq], 1, heads, hd, 10000.0, &mut a).unwrap();
            rope_fwd(&k, &[pk], 1, heads, hd, 10000.0, &mut b).unwrap();
            dot64(&a, &b)
        };
        assert!((dotp(5, 2) - dotp(105, 102)).abs() < 1e-5);
        // a sequence shard with global positions equals the slice of the full run
        let tokens = 6;
        let x = rng.vec(tokens * heads * hd);
        let pos: Vec<u32> = (0..tokens as u32).collect();
        let mut full = vec![0.0; x.len()];
        rope_fwd(&x, &pos, tokens, heads, hd, 10000.0, &mut full).unwrap();
        let n = heads * hd;
        let mut part = vec![0.0; 3 * n];
        rope_fwd(&x[3 * n..], &pos[3..], 3, heads, hd, 10000.0, &mut part).unwrap();
        assert_eq!(&full[3 * n..], &part[..]);
    }

    #[test]
    fn backward_matches_finite_differences_and_inverts() {
        let mut rng = Rng::new(22);
        let (tokens, heads, hd) = (3, 2, 6);
        let x = rng.vec(tokens * heads * hd);
        let pos = [7u32, 0, 1234];
        let dy = rng.vec(x.len());
        let mut dx = vec![0.0; x.len()];
        rope_bwd(&dy, &pos, tokens, heads, hd, 500000.0, &mut dx).unwrap();
        let n = numeric_grad(&x, 2e-3, |x| {
            let mut y = vec![0.0; x.len()];
            rope_fwd(x, &pos, tokens, heads, hd, 500000.0, &mut y).unwrap();
            dot64(&dy, &y)
        });
        assert_grad_close("rope dx", &dx, &n, 1e-2, 2e-3);
        // bwd(fwd(x)) == x since the rotation is orthogonal
        let mut y = vec![0.0; x.len()];
        rope_fwd(&x, &pos, tokens, heads, hd, 500000.0, &mut y).unwrap();
        let mut back = vec![0.0; x.len()];
        rope_bwd(&y, &pos, tokens, heads, hd, 500000.0, &mut back).unwrap();
        for (a, b) in back.iter().zip(&x) {
            assert!((a - b).abs() < 1e-6);
        }
    }

    #[test]
    fn odd_head_dim_and_bad_lengths_rejected() {
        let mut out = [0.0; 3];
        assert!(matches!(
            rope_fwd(&[0.0; 3], &[0], 1, 1, 3, 1e4, &mut out),
            Err(KernelError::Invalid {
                name: "head_dim",
                ..
            })
        ));
        assert!(rope_fwd(&[0.0; 4], &[0, 1], 1, 1, 4, 1e4, &mut [0.0; 4]).is_err());
    }
}
