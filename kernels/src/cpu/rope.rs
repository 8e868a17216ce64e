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

/// RoPE's frequencies: the base `theta` and a scaling in wavelength form. A pair's
/// frequency `f = theta^(-2i/d)` has wavelength `wl = 2 pi / f`; below
/// `high_wavelength` it is kept, above `low_wavelength` divided by `factor`, and
/// between them blended as Llama 3.1 does: `(1 - s) f / factor + s f` with
/// `s = (1/wl - 1/low) / (1/high - 1/low)`. Linear scaling is `(factor, 0, 0)` and
/// none `(1, 0, 0)`, so one formula serves every kind here and in the GPU kernels.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rope {
    /// Base (10000 in Llama 2, 500000 in Llama 3).
    pub theta: f32,
    /// Divisor of the scaled (long-wavelength) frequencies.
    pub factor: f32,
    /// Wavelengths above it are divided by `factor`.
    pub low_wavelength: f32,
    /// Wavelengths below it are kept.
    pub high_wavelength: f32,
}

impl Rope {
    /// Unscaled frequencies of base `theta`.
    pub const fn plain(theta: f32) -> Rope {
        Rope {
            theta,
            factor: 1.0,
            low_wavelength: 0.0,
            high_wavelength: 0.0,
        }
    }

    /// The frequency of pair `i` of a `head_dim`-wide head, in f64.
    pub fn freq(&self, i: usize, head_dim: usize) -> f64 {
        let f = (self.theta as f64).powf(-2.0 * i as f64 / head_dim as f64);
        let (low, high) = (self.low_wavelength as f64, self.high_wavelength as f64);
        let wl = 2.0 * std::f64::consts::PI / f;
        if wl < high {
            f
        } else if wl > low {
            f / self.factor as f64
        } else {
            let s = (1.0 / wl - 1.0 / low) / (1.0 / high - 1.0 / low);
            (1.0 - s) * f / self.factor as f64 + s * f
        }
    }
}

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

/// The `(cos, sin)` of every pair's rotation by `sign * angle` at each distinct
/// position: the rotations depend only on the position, and a batch repeats its
/// positions in every sequence.
struct Angles {
    distinct: Vec<u32>,
    half: usize,
    table: Vec<(f32, f32)>,
}

impl Angles {
    fn new(positions: &[u32], head_dim: usize, rope: Rope, sign: f64) -> Angles {
        let half = head_dim / 2;
        // The frequencies depend only on the pair index: computed once per call.
        let freqs: Vec<f64> = (0..half).map(|i| rope.freq(i, head_dim)).collect();
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
        Angles {
            distinct,
            half,
            table,
        }
    }

    fn at(&self, pos: u32) -> &[(f32, f32)] {
        let at = self.distinct.binary_search(&pos).unwrap_or(0);
        &self.table[at * self.half..(at + 1) * self.half]
    }
}

/// Rotates the head vector `x` by the pairs' `(cos, sin)` and adds
/// (`accumulate`) or writes the result into `out`.
fn rotate_head(x: &[f32], cs: &[(f32, f32)], accumulate: bool, out: &mut [f32]) {
    let half = cs.len();
    for (i, &(cos, sin)) in cs.iter().enumerate() {
        let (x1, x2) = (x[i], x[i + half]);
        let y1 = x1 * cos - x2 * sin;
        let y2 = x2 * cos + x1 * sin;
        if accumulate {
            out[i] += y1;
            out[i + half] += y2;
        } else {
            out[i] = y1;
            out[i + half] = y2;
        }
    }
}

/// Rotates every `[head_dim]` vector of `x` by `sign * angle` and adds
/// (`accumulate`) or writes the result into `out`.
fn rotate(
    x: &[f32],
    positions: &[u32],
    heads: usize,
    head_dim: usize,
    rope: Rope,
    sign: f64,
    accumulate: bool,
    out: &mut [f32],
) {
    let tok_len = heads * head_dim;
    let angles = Angles::new(positions, head_dim, rope, sign);
    par_rows(out, tok_len, |t0, out| {
        for (t, &pos) in positions[t0..t0 + out.len() / tok_len.max(1)]
            .iter()
            .enumerate()
        {
            let cs = angles.at(pos);
            for h in 0..heads {
                let base = t * tok_len + h * head_dim;
                let xv = &x[t0 * tok_len + base..][..head_dim];
                rotate_head(xv, cs, accumulate, &mut out[base..base + head_dim]);
            }
        }
    });
}

/// RoPE forward on `x [tokens, heads, head_dim]` with `positions [tokens]`,
/// writing `out` (same shape). `head_dim` must be even.
pub fn rope_fwd(
    x: &[f32],
    positions: &[u32],
    tokens: usize,
    heads: usize,
    head_dim: usize,
    rope: Rope,
    out: &mut [f32],
) -> Result<(), KernelError> {
    check(x.len(), out.len(), positions, tokens, heads, head_dim)?;
    rotate(x, positions, heads, head_dim, rope, 1.0, false, out);
    Ok(())
}

/// RoPE backward: the rotation is orthogonal, so `dx += R(-angle) d_out`.
pub fn rope_bwd(
    d_out: &[f32],
    positions: &[u32],
    tokens: usize,
    heads: usize,
    head_dim: usize,
    rope: Rope,
    dx: &mut [f32],
) -> Result<(), KernelError> {
    check(d_out.len(), dx.len(), positions, tokens, heads, head_dim)?;
    rotate(d_out, positions, heads, head_dim, rope, -1.0, true, dx);
    Ok(())
}

/// RoPE on the query and key heads of fused rows `x [rows, width]` (`hq` query
/// heads and `hkv` key heads of `head_dim`, the value columns after them), the
/// value columns copied, into `y` (overwritten); with `backward`, the inverse
/// rotation of a gradient.
pub fn rope_qkv(
    x: &[f32],
    positions: &[u32],
    rows: usize,
    (hq, hkv, head_dim, width): (usize, usize, usize, usize),
    (rope, backward): (Rope, bool),
    y: &mut [f32],
) -> Result<(), KernelError> {
    check_len("x", x.len(), rows * width)?;
    check_len("y", y.len(), rows * width)?;
    let rot = (hq + hkv) * head_dim;
    if rot > width {
        return Err(invalid(
            "width",
            format!("{width} columns hold no {hq} + {hkv} heads of {head_dim}"),
        ));
    }
    check(rows * rot, rows * rot, positions, rows, hq + hkv, head_dim)?;
    // The backward is the inverse rotation added onto zeros, as `rope_bwd` adds it.
    let angles = Angles::new(positions, head_dim, rope, if backward { -1.0 } else { 1.0 });
    par_rows(y, width, |r0, out| {
        for (t, yrow) in out.chunks_exact_mut(width.max(1)).enumerate() {
            let xrow = &x[(r0 + t) * width..][..width];
            yrow[rot..].copy_from_slice(&xrow[rot..]);
            if backward {
                yrow[..rot].fill(0.0);
            }
            let cs = angles.at(positions[r0 + t]);
            for h in 0..hq + hkv {
                let head = h * head_dim..(h + 1) * head_dim;
                rotate_head(&xrow[head.clone()], cs, backward, &mut yrow[head]);
            }
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testutil::{assert_grad_close, dot64, numeric_grad, Rng};

    /// Fused rows of one query head, one key head (d = 2) and a value head: at
    /// position 1 with base 1 the angle is 1 radian; `[1, 0]` turns to
    /// `[cos 1, sin 1]`, `[0, 1]` to `[-sin 1, cos 1]`, the values stay; the backward
    /// turns them back.
    #[test]
    fn rope_qkv_rotates_queries_and_keys_and_copies_values() {
        let x = [1.0, 0.0, 0.0, 1.0, 7.0, 8.0];
        let mut y = [0.0; 6];
        let shape = (1, 1, 2, 6);
        rope_qkv(&x, &[1], 1, shape, (Rope::plain(1.0), false), &mut y).unwrap();
        let (c, s) = (1f32.cos(), 1f32.sin());
        let want = [c, s, -s, c, 7.0, 8.0];
        for (a, b) in y.iter().zip(want) {
            assert!((a - b).abs() < 1e-6, "{y:?}");
        }
        let mut back = [0.0; 6];
        rope_qkv(&y, &[1], 1, shape, (Rope::plain(1.0), true), &mut back).unwrap();
        for (a, b) in back.iter().zip(x) {
            assert!((a - b).abs() < 1e-6, "{back:?}");
        }
    }

    /// The fused kernel is the per-block kernels on the query and key columns, bit
    /// for bit (the backward added onto zeros, negative zeros included), on any
    /// thread count: GQA heads, repeated positions, rows split over a pool.
    #[test]
    fn rope_qkv_equals_the_blockwise_kernels_bit_for_bit() {
        let mut rng = Rng::new(5);
        let (rows, hq, hkv, d, dv) = (12, 4, 2, 8, 6);
        let width = (hq + hkv) * d + hkv * dv;
        let mut x = rng.vec(rows * width);
        // Zeros rotated by a negative cosine (row 2 sits at position 3) give -0.0
        // forward, +0.0 added backward.
        x[2 * width..2 * width + d].fill(0.0);
        let positions: Vec<u32> = (0..rows as u32).map(|r| 3 * (r / 2)).collect();
        let rope = Rope::plain(10000.0);
        for backward in [false, true] {
            let mut want = x.clone();
            for (start, heads) in [(0, hq), (hq * d, hkv)] {
                let n = heads * d;
                let part: Vec<f32> = (0..rows)
                    .flat_map(|r| x[r * width + start..][..n].to_vec())
                    .collect();
                let mut out = vec![0.0; part.len()];
                let f = if backward { rope_bwd } else { rope_fwd };
                f(&part, &positions, rows, heads, d, rope, &mut out).unwrap();
                for (r, o) in out.chunks_exact(n).enumerate() {
                    want[r * width + start..][..n].copy_from_slice(o);
                }
            }
            let negative_zero = want.iter().any(|v| v.to_bits() == (-0.0f32).to_bits());
            assert_eq!(negative_zero, !backward, "the case is in the data");
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            for threads in [1, 2, 3] {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                let mut y = vec![f32::NAN; x.len()];
                let shape = (hq, hkv, d, width);
                pool.install(|| rope_qkv(&x, &positions, rows, shape, (rope, backward), &mut y))
                    .unwrap();
                assert_eq!(
                    bits(&y),
                    bits(&want),
                    "backward {backward}, {threads} threads"
                );
            }
        }
        let mut y = vec![0.0; x.len()];
        let e = rope_qkv(
            &x,
            &positions,
            rows,
            (hq, hkv + 9, d, width),
            (rope, false),
            &mut y,
        );
        assert!(e.is_err(), "heads wider than the rows");
    }

    #[test]
    fn rotate_half_by_hand() {
        // head_dim 4: pairs (0,2) with freq 1 and (1,3) with freq theta^-0.5 = 0.01
        let x = [1.0, 1.0, 0.0, 0.0];
        let mut out = [0.0; 4];
        rope_fwd(&x, &[2], 1, 1, 4, Rope::plain(10000.0), &mut out).unwrap();
        let (a0, a1) = (2.0f64, 0.02f64);
        let expect = [a0.cos(), a1.cos(), a0.sin(), a1.sin()];
        for (o, e) in out.iter().zip(expect) {
            assert!((*o as f64 - e).abs() < 1e-6, "{o} vs {e}");
        }
        // position 0 is the identity
        rope_fwd(&x, &[0], 1, 1, 4, Rope::plain(10000.0), &mut out).unwrap();
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
            rope_fwd(&q, &[pq], 1, heads, hd, Rope::plain(10000.0), &mut a).unwrap();
            rope_fwd(&k, &[pk], 1, heads, hd, Rope::plain(10000.0), &mut b).unwrap();
            dot64(&a, &b)
        };
        assert!((dotp(5, 2) - dotp(105, 102)).abs() < 1e-5);
        // a sequence shard with global positions equals the slice of the full run
        let tokens = 6;
        let x = rng.vec(tokens * heads * hd);
        let pos: Vec<u32> = (0..tokens as u32).collect();
        let mut full = vec![0.0; x.len()];
        rope_fwd(&x, &pos, tokens, heads, hd, Rope::plain(10000.0), &mut full).unwrap();
        let n = heads * hd;
        let mut part = vec![0.0; 3 * n];
        rope_fwd(
            &x[3 * n..],
            &pos[3..],
            3,
            heads,
            hd,
            Rope::plain(10000.0),
            &mut part,
        )
        .unwrap();
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
        rope_bwd(&dy, &pos, tokens, heads, hd, Rope::plain(500000.0), &mut dx).unwrap();
        let n = numeric_grad(&x, 2e-3, |x| {
            let mut y = vec![0.0; x.len()];
            rope_fwd(x, &pos, tokens, heads, hd, Rope::plain(500000.0), &mut y).unwrap();
            dot64(&dy, &y)
        });
        assert_grad_close("rope dx", &dx, &n, 1e-2, 2e-3);
        // bwd(fwd(x)) == x since the rotation is orthogonal
        let mut y = vec![0.0; x.len()];
        rope_fwd(&x, &pos, tokens, heads, hd, Rope::plain(500000.0), &mut y).unwrap();
        let mut back = vec![0.0; x.len()];
        rope_bwd(
            &y,
            &pos,
            tokens,
            heads,
            hd,
            Rope::plain(500000.0),
            &mut back,
        )
        .unwrap();
        for (a, b) in back.iter().zip(&x) {
            assert!((a - b).abs() < 1e-6);
        }
    }

    #[test]
    fn llama3_scaling_by_hand() {
        // Llama 3.1: theta 500000, factor 8, low/high_freq_factor 1/4, 8192 original
        // positions: wavelengths below 8192/4 = 2048 kept, above 8192 divided by 8.
        let rope = Rope {
            theta: 500000.0,
            factor: 8.0,
            low_wavelength: 8192.0,
            high_wavelength: 2048.0,
        };
        // Pair 0: frequency 1, wavelength 2 pi: kept.
        assert_eq!(rope.freq(0, 128), 1.0);
        // Pair 63: 500000^(-126/128) = 2.455140791e-6, wavelength 2.56e6: divided by 8.
        let f63 = rope.freq(63, 128);
        assert!((f63 / 3.068925988914511e-7 - 1.0).abs() < 1e-12, "{f63}");
        // Pair 32: 500000^-0.5 = 1.414213562e-3, wavelength 4442.88, between the two:
        // s = (8192 / 4442.88 - 1) / (4 - 1) = 0.2812826, (1 - s) f / 8 + s f = 5.248462e-4.
        let f32_ = rope.freq(32, 128);
        assert!((f32_ / 5.248461609929547e-4 - 1.0).abs() < 1e-12, "{f32_}");
        // Linear scaling divides every frequency; none keeps them.
        let linear = Rope {
            factor: 4.0,
            ..Rope::plain(10000.0)
        };
        for i in [0, 5, 31] {
            let plain = Rope::plain(10000.0).freq(i, 64);
            assert_eq!(plain, 10000f64.powf(-2.0 * i as f64 / 64.0));
            assert!((linear.freq(i, 64) - plain / 4.0).abs() < 1e-18);
        }
        // The rotation uses the scaled frequency: position 1000 of pair 63.
        let mut x = vec![0.0f32; 128];
        x[63] = 1.0;
        let mut out = vec![0.0f32; 128];
        rope_fwd(&x, &[1000], 1, 1, 128, rope, &mut out).unwrap();
        let ang = 1000.0 * 3.068925988914511e-7f64;
        assert!((out[63] as f64 - ang.cos()).abs() < 1e-7);
        assert!((out[127] as f64 - ang.sin()).abs() < 1e-7);
    }

    #[test]
    fn odd_head_dim_and_bad_lengths_rejected() {
        let mut out = [0.0; 3];
        assert!(matches!(
            rope_fwd(&[0.0; 3], &[0], 1, 1, 3, Rope::plain(1e4), &mut out),
            Err(KernelError::Invalid {
                name: "head_dim",
                ..
            })
        ));
        assert!(rope_fwd(&[0.0; 4], &[0, 1], 1, 1, 4, Rope::plain(1e4), &mut [0.0; 4]).is_err());
    }
}
