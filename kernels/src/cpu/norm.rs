//! LayerNorm and RMSNorm over the last dimension.
//!
//! The forward saves per-row statistics (`mean`, `rstd = 1/sqrt(var + eps)`)
//! so the backward does not recompute reductions over `x`.

#![allow(clippy::too_many_arguments)] // flat kernel-launch style signatures

use super::{bias_grad, check_len, invalid, par_map, par_rows, prod, KernelError};

/// A weight gradient `dw[c] += sum_r f(r, c)` with each column's sum in row
/// order, the columns spread over the pool: `add_row(r, c0, part)` adds row
/// `r`'s terms into `part`, the columns from `c0` on.
fn weight_grad(dw: &mut [f32], rows: usize, add_row: impl Fn(usize, usize, &mut [f32]) + Sync) {
    par_rows(dw, 1, |c0, part| {
        (0..rows).for_each(|r| add_row(r, c0, part))
    });
}

/// Rows whose statistics the forwards compute together. Each row's sum still
/// adds its terms left to right, bit for bit a plain loop's; but one row's sum
/// is a chain of dependent additions, each waiting out the one before it, while
/// eight rows' independent chains interleaved keep the adders busy. Measured
/// (`benches/benches/kernels.rs`, 2048 rows of 384, one thread): LayerNorm's
/// forward 1.5x, RMSNorm's 1.3x. The backwards keep one row at a time: their
/// two sums per row, blocked so, became vectors filled lane by lane, slower
/// than the plain loop.
const ROWS: usize = 8;

/// [`ROWS`] sums over the columns `0..dim`, each from `init` with the terms
/// added in column order: `out[k] = init + term(k, 0) + term(k, 1) + ...`.
#[inline(always)]
fn sums(init: f32, dim: usize, term: impl Fn(usize, usize) -> f32) -> [f32; ROWS] {
    let mut s = [init; ROWS];
    for c in 0..dim {
        for (k, sk) in s.iter_mut().enumerate() {
            *sk += term(k, c);
        }
    }
    s
}

/// `f` on the rows in blocks of [`ROWS`] (a short last block repeats its last
/// row; the repeats' results are dropped), the blocks over the intra-op pool;
/// one result per row, in row order.
fn per_row<T: Send>(rows: usize, f: impl Fn([usize; ROWS]) -> [T; ROWS] + Sync + Send) -> Vec<T> {
    let block = |b: usize| std::array::from_fn(|k| (b * ROWS + k).min(rows - 1));
    let mut out: Vec<T> = par_map(rows.div_ceil(ROWS), |b| f(block(b)))
        .into_iter()
        .flatten()
        .collect();
    out.truncate(rows);
    out
}

fn check_rows(
    rows: usize,
    dim: usize,
    xs: &[(&'static str, usize)],
    per_row: &[(&'static str, usize)],
    per_col: &[(&'static str, usize)],
) -> Result<(), KernelError> {
    if dim == 0 {
        return Err(invalid("dim", "must be positive"));
    }
    let n = prod("x", &[rows, dim])?;
    for &(name, len) in xs {
        check_len(name, len, n)?;
    }
    for &(name, len) in per_row {
        check_len(name, len, rows)?;
    }
    for &(name, len) in per_col {
        check_len(name, len, dim)?;
    }
    Ok(())
}

/// LayerNorm forward: `y = (x - mean) * rstd * weight + bias` per row of
/// `x [rows, dim]`, variance biased (divide by `dim`) as in PyTorch.
/// Writes `y [rows, dim]`, `mean [rows]`, `rstd [rows]`.
///
/// Mean and variance use two passes in f32, which avoids the cancellation of
/// `E[x^2] - E[x]^2` for rows with a large offset.
pub fn layernorm_fwd(
    x: &[f32],
    weight: &[f32],
    bias: &[f32],
    rows: usize,
    dim: usize,
    eps: f32,
    y: &mut [f32],
    mean: &mut [f32],
    rstd: &mut [f32],
) -> Result<(), KernelError> {
    check_rows(
        rows,
        dim,
        &[("x", x.len()), ("y", y.len())],
        &[("mean", mean.len()), ("rstd", rstd.len())],
        &[("weight", weight.len()), ("bias", bias.len())],
    )?;
    let inv = 1.0 / dim as f32;
    // Rows are independent: statistics, then outputs, each spread over the
    // intra-op pool (the same arithmetic per row whatever the thread count).
    // `-0.0` is where `Iterator::sum` starts.
    let stats = per_row(rows, |idx| {
        let xs = idx.map(|r| &x[r * dim..][..dim]);
        let mu = sums(-0.0, dim, |k, c| xs[k][c]).map(|s| s * inv);
        let var = sums(-0.0, dim, |k, c| (xs[k][c] - mu[k]) * (xs[k][c] - mu[k]));
        std::array::from_fn(|k| (mu[k], 1.0 / (var[k] * inv + eps).sqrt()))
    });
    for (r, &(mu, rs)) in stats.iter().enumerate() {
        mean[r] = mu;
        rstd[r] = rs;
    }
    par_rows(y, dim, |r0, y| {
        for (i, yr) in y.chunks_exact_mut(dim).enumerate() {
            let r = r0 + i;
            let (mu, rs) = stats[r];
            let xr = &x[r * dim..(r + 1) * dim];
            for (c, yo) in yr.iter_mut().enumerate() {
                *yo = (xr[c] - mu) * rs * weight[c] + bias[c];
            }
        }
    });
    Ok(())
}

/// LayerNorm backward. Accumulates `dx [rows, dim]`, `dweight [dim]`,
/// `dbias [dim]` from `dy` using the `mean`/`rstd` saved by
/// [`layernorm_fwd`].
///
/// `dx = rstd * (g - mean(g) - xhat * mean(g * xhat))` with `g = dy * weight`
/// and `xhat = (x - mean) * rstd`.
pub fn layernorm_bwd(
    x: &[f32],
    weight: &[f32],
    mean: &[f32],
    rstd: &[f32],
    dy: &[f32],
    rows: usize,
    dim: usize,
    dx: &mut [f32],
    dweight: &mut [f32],
    dbias: &mut [f32],
) -> Result<(), KernelError> {
    check_rows(
        rows,
        dim,
        &[("x", x.len()), ("dy", dy.len()), ("dx", dx.len())],
        &[("mean", mean.len()), ("rstd", rstd.len())],
        &[
            ("weight", weight.len()),
            ("dweight", dweight.len()),
            ("dbias", dbias.len()),
        ],
    )?;
    let inv = 1.0 / dim as f32;
    // Each weight gradient sums over rows in row order, the columns spread over
    // the intra-op pool; the input gradients are per row, the rows spread.
    bias_grad(dy, dbias)?;
    weight_grad(dweight, rows, |r, c0, dw| {
        let (mu, rs) = (mean[r], rstd[r]);
        let (xr, dyr) = (&x[r * dim + c0..], &dy[r * dim + c0..]);
        for ((d, &xc), &g) in dw.iter_mut().zip(xr).zip(dyr) {
            *d += g * ((xc - mu) * rs);
        }
    });
    par_rows(dx, dim, |r0, dx| {
        for (i, dxr) in dx.chunks_exact_mut(dim).enumerate() {
            let r = r0 + i;
            let xr = &x[r * dim..(r + 1) * dim];
            let dyr = &dy[r * dim..(r + 1) * dim];
            let (mu, rs) = (mean[r], rstd[r]);
            let mut sum_g = 0.0f32;
            let mut sum_gx = 0.0f32;
            for c in 0..dim {
                let xhat = (xr[c] - mu) * rs;
                let g = dyr[c] * weight[c];
                sum_g += g;
                sum_gx += g * xhat;
            }
            let (mg, mgx) = (sum_g * inv, sum_gx * inv);
            for (c, d) in dxr.iter_mut().enumerate() {
                let xhat = (xr[c] - mu) * rs;
                *d += rs * (dyr[c] * weight[c] - mg - xhat * mgx);
            }
        }
    });
    Ok(())
}

/// RMSNorm forward: `y = x * rstd * weight` with
/// `rstd = 1 / sqrt(mean(x^2) + eps)` per row (no mean subtraction, no bias,
/// as in Llama). Writes `y [rows, dim]` and `rstd [rows]`.
pub fn rmsnorm_fwd(
    x: &[f32],
    weight: &[f32],
    rows: usize,
    dim: usize,
    eps: f32,
    y: &mut [f32],
    rstd: &mut [f32],
) -> Result<(), KernelError> {
    check_rows(
        rows,
        dim,
        &[("x", x.len()), ("y", y.len())],
        &[("rstd", rstd.len())],
        &[("weight", weight.len())],
    )?;
    let inv = 1.0 / dim as f32;
    let rs = per_row(rows, |idx| {
        let xs = idx.map(|r| &x[r * dim..][..dim]);
        sums(-0.0, dim, |k, c| xs[k][c] * xs[k][c]).map(|ms| 1.0 / (ms * inv + eps).sqrt())
    });
    rstd.copy_from_slice(&rs);
    par_rows(y, dim, |r0, y| {
        for (i, yr) in y.chunks_exact_mut(dim).enumerate() {
            let r = r0 + i;
            let (xr, rs) = (&x[r * dim..(r + 1) * dim], rstd[r]);
            for (c, yo) in yr.iter_mut().enumerate() {
                *yo = xr[c] * rs * weight[c];
            }
        }
    });
    Ok(())
}

/// RMSNorm backward. Accumulates `dx [rows, dim]` and `dweight [dim]` using
/// the `rstd` saved by [`rmsnorm_fwd`]:
/// `dx = rstd * (g - xhat * mean(g * xhat))`, `g = dy * weight`,
/// `xhat = x * rstd`.
pub fn rmsnorm_bwd(
    x: &[f32],
    weight: &[f32],
    rstd: &[f32],
    dy: &[f32],
    rows: usize,
    dim: usize,
    dx: &mut [f32],
    dweight: &mut [f32],
) -> Result<(), KernelError> {
    check_rows(
        rows,
        dim,
        &[("x", x.len()), ("dy", dy.len()), ("dx", dx.len())],
        &[("rstd", rstd.len())],
        &[("weight", weight.len()), ("dweight", dweight.len())],
    )?;
    let inv = 1.0 / dim as f32;
    // As in `layernorm_bwd`: the weight gradient's columns and the input
    // gradient's rows over the intra-op pool.
    weight_grad(dweight, rows, |r, c0, dw| {
        let rs = rstd[r];
        let (xr, dyr) = (&x[r * dim + c0..], &dy[r * dim + c0..]);
        for ((d, &xc), &g) in dw.iter_mut().zip(xr).zip(dyr) {
            *d += g * (xc * rs);
        }
    });
    par_rows(dx, dim, |r0, dx| {
        for (i, dxr) in dx.chunks_exact_mut(dim).enumerate() {
            let r = r0 + i;
            let xr = &x[r * dim..(r + 1) * dim];
            let dyr = &dy[r * dim..(r + 1) * dim];
            let rs = rstd[r];
            let mut sum_gx = 0.0f32;
            for c in 0..dim {
                let xhat = xr[c] * rs;
                sum_gx += dyr[c] * weight[c] * xhat;
            }
            let mgx = sum_gx * inv;
            for (c, d) in dxr.iter_mut().enumerate() {
                *d += rs * (dyr[c] * weight[c] - xr[c] * rs * mgx);
            }
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testutil::{assert_grad_close, dot64, numeric_grad, Rng};
    use proptest::prelude::*;

    #[test]
    fn layernorm_of_1_2_3_by_hand() {
        // mean 2, biased var 2/3, rstd = 1/sqrt(2/3) = 1.2247449
        let mut y = [0.0; 3];
        let (mut m, mut r) = ([0.0], [0.0]);
        layernorm_fwd(
            &[1.0, 2.0, 3.0],
            &[1.0; 3],
            &[0.0; 3],
            1,
            3,
            0.0,
            &mut y,
            &mut m,
            &mut r,
        )
        .unwrap();
        assert_eq!(m[0], 2.0);
        assert!((r[0] - 1.224_744_9).abs() < 1e-6);
        for (a, b) in y.iter().zip([-1.224_744_9, 0.0, 1.224_744_9]) {
            assert!((a - b).abs() < 1e-6, "{a} vs {b}");
        }
        // weight and bias apply elementwise after normalisation
        layernorm_fwd(
            &[1.0, 2.0, 3.0],
            &[2.0, 1.0, 0.5],
            &[1.0, -1.0, 0.0],
            1,
            3,
            0.0,
            &mut y,
            &mut m,
            &mut r,
        )
        .unwrap();
        for (a, b) in y.iter().zip([1.0 - 2.449_489_8, -1.0, 0.612_372_4]) {
            assert!((a - b).abs() < 1e-6, "{a} vs {b}");
        }
    }

    #[test]
    fn rmsnorm_by_hand() {
        // mean square of [3, 4] is 12.5; rstd = 1/sqrt(12.5)
        let mut y = [0.0; 2];
        let mut r = [0.0];
        rmsnorm_fwd(&[3.0, 4.0], &[1.0, 2.0], 1, 2, 0.0, &mut y, &mut r).unwrap();
        let rs = 1.0 / 12.5f32.sqrt();
        assert!((r[0] - rs).abs() < 1e-7);
        assert!((y[0] - 3.0 * rs).abs() < 1e-6 && (y[1] - 8.0 * rs).abs() < 1e-6);
    }

    #[test]
    fn layernorm_backward_matches_finite_differences() {
        let mut rng = Rng::new(11);
        let (rows, dim, eps) = (3, 7, 1e-5);
        let x = rng.vec(rows * dim);
        let w: Vec<f32> = rng.vec(dim).iter().map(|v| 1.0 + v).collect();
        let b = rng.vec(dim);
        let dy = rng.vec(rows * dim);
        let fwd = |x: &[f32], w: &[f32], b: &[f32]| {
            let mut y = vec![0.0; rows * dim];
            let (mut m, mut r) = (vec![0.0; rows], vec![0.0; rows]);
            layernorm_fwd(x, w, b, rows, dim, eps, &mut y, &mut m, &mut r).unwrap();
            (y, m, r)
        };
        let (_, m, r) = fwd(&x, &w, &b);
        let mut dx = vec![0.0; rows * dim];
        let mut dw = vec![0.0; dim];
        let mut db = vec![0.0; dim];
        layernorm_bwd(&x, &w, &m, &r, &dy, rows, dim, &mut dx, &mut dw, &mut db).unwrap();
        let h = 2e-3;
        let nx = numeric_grad(&x, h, |x| dot64(&dy, &fwd(x, &w, &b).0));
        let nw = numeric_grad(&w, h, |w| dot64(&dy, &fwd(&x, w, &b).0));
        let nb = numeric_grad(&b, h, |b| dot64(&dy, &fwd(&x, &w, b).0));
        assert_grad_close("ln dx", &dx, &nx, 1e-2, 2e-3);
        assert_grad_close("ln dw", &dw, &nw, 1e-2, 2e-3);
        assert_grad_close("ln db", &db, &nb, 1e-2, 2e-3);

        // accumulation: a second call doubles every gradient
        let (dx1, dw1) = (dx.clone(), dw.clone());
        layernorm_bwd(&x, &w, &m, &r, &dy, rows, dim, &mut dx, &mut dw, &mut db).unwrap();
        for (a, b) in dx.iter().zip(&dx1).chain(dw.iter().zip(&dw1)) {
            assert!(
                (a - 2.0 * b).abs() <= 1e-6 * (1.0 + b.abs()),
                "{a} vs 2 * {b}"
            );
        }
    }

    #[test]
    fn rmsnorm_backward_matches_finite_differences() {
        let mut rng = Rng::new(12);
        let (rows, dim, eps) = (4, 5, 1e-6);
        let x = rng.vec(rows * dim);
        let w: Vec<f32> = rng.vec(dim).iter().map(|v| 1.0 + v).collect();
        let dy = rng.vec(rows * dim);
        let fwd = |x: &[f32], w: &[f32]| {
            let mut y = vec![0.0; rows * dim];
            let mut r = vec![0.0; rows];
            rmsnorm_fwd(x, w, rows, dim, eps, &mut y, &mut r).unwrap();
            (y, r)
        };
        let (_, r) = fwd(&x, &w);
        let mut dx = vec![0.0; rows * dim];
        let mut dw = vec![0.0; dim];
        rmsnorm_bwd(&x, &w, &r, &dy, rows, dim, &mut dx, &mut dw).unwrap();
        let h = 2e-3;
        let nx = numeric_grad(&x, h, |x| dot64(&dy, &fwd(x, &w).0));
        let nw = numeric_grad(&w, h, |w| dot64(&dy, &fwd(&x, w).0));
        assert_grad_close("rms dx", &dx, &nx, 1e-2, 2e-3);
        assert_grad_close("rms dw", &dw, &nw, 1e-2, 2e-3);
    }

    /// The forwards' per-row statistics, whose rows run eight at a time, and
    /// their outputs equal one row's plain loop bit for bit, with a short last
    /// block and on a pool of 1 to 3 threads.
    #[test]
    fn rows_in_blocks_give_a_plain_loops_bits() {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let mut rng = Rng::new(29);
        for (rows, dim) in [(1, 5), (8, 16), (37, 29)] {
            let n = rows * dim;
            let (x, w, b) = (rng.vec(n), rng.vec(dim), rng.vec(dim));
            let inv = 1.0 / dim as f32;
            let (mut mean, mut rstd, mut y) = (vec![0.0; rows], vec![0.0; rows], vec![0.0; n]);
            let (mut rms, mut yr) = (vec![0.0; rows], vec![0.0; n]);
            for r in 0..rows {
                let xr = &x[r * dim..(r + 1) * dim];
                let mu = xr.iter().sum::<f32>() * inv;
                let var = xr.iter().map(|&v| (v - mu) * (v - mu)).sum::<f32>() * inv;
                (mean[r], rstd[r]) = (mu, 1.0 / (var + 1e-5).sqrt());
                let ms = xr.iter().map(|&v| v * v).sum::<f32>() * inv;
                rms[r] = 1.0 / (ms + 1e-5).sqrt();
                for c in 0..dim {
                    y[r * dim + c] = (xr[c] - mu) * rstd[r] * w[c] + b[c];
                    yr[r * dim + c] = xr[c] * rms[r] * w[c];
                }
            }
            for threads in 1..=3 {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                let (mut m2, mut r2, mut y2) = (vec![0.0; rows], vec![0.0; rows], vec![0.0; n]);
                let (mut rms2, mut yr2) = (vec![0.0; rows], vec![0.0; n]);
                pool.install(|| {
                    layernorm_fwd(&x, &w, &b, rows, dim, 1e-5, &mut y2, &mut m2, &mut r2).unwrap();
                    rmsnorm_fwd(&x, &w, rows, dim, 1e-5, &mut yr2, &mut rms2).unwrap();
                });
                let at = format!("{rows}x{dim}, {threads} threads");
                assert_eq!(bits(&m2), bits(&mean), "mean {at}");
                assert_eq!(bits(&r2), bits(&rstd), "rstd {at}");
                assert_eq!(bits(&y2), bits(&y), "layernorm y {at}");
                assert_eq!(bits(&rms2), bits(&rms), "rms rstd {at}");
                assert_eq!(bits(&yr2), bits(&yr), "rmsnorm y {at}");
            }
        }
    }

    /// The weight gradients over a pool of 1 to 3 threads equal each column's
    /// sum taken in row order on one thread, bit for bit, and the input
    /// gradients do not depend on the pool.
    #[test]
    fn weight_gradients_over_a_pool_are_row_order_sums() {
        let (rows, dim) = (37, 29);
        let mut rng = Rng::new(13);
        let (x, dy, w) = (rng.vec(rows * dim), rng.vec(rows * dim), rng.vec(dim));
        let (mean, rstd) = (rng.vec(rows), rng.vec(rows));
        let start = rng.vec(dim);
        let (mut lw, mut lb, mut rw) = (start.clone(), start.clone(), start.clone());
        for r in 0..rows {
            for c in 0..dim {
                let (xc, g) = (x[r * dim + c], dy[r * dim + c]);
                lw[c] += g * ((xc - mean[r]) * rstd[r]);
                lb[c] += g;
                rw[c] += g * (xc * rstd[r]);
            }
        }
        let mut dx1 = None;
        for threads in 1..=3 {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let (mut dw, mut db, mut dwr) = (start.clone(), start.clone(), start.clone());
            let (mut dx, mut dxr) = (vec![0.0; rows * dim], vec![0.0; rows * dim]);
            pool.install(|| {
                layernorm_bwd(
                    &x, &w, &mean, &rstd, &dy, rows, dim, &mut dx, &mut dw, &mut db,
                )
                .unwrap();
                rmsnorm_bwd(&x, &w, &rstd, &dy, rows, dim, &mut dxr, &mut dwr).unwrap();
            });
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&dw), bits(&lw), "{threads} threads");
            assert_eq!(bits(&db), bits(&lb), "{threads} threads");
            assert_eq!(bits(&dwr), bits(&rw), "{threads} threads");
            let dxs = (bits(&dx), bits(&dxr));
            assert_eq!(dx1.get_or_insert_with(|| dxs.clone()), &dxs);
        }
    }

    #[test]
    fn norm_size_errors() {
        let mut y = [0.0; 4];
        let (mut m, mut r) = ([0.0; 2], [0.0; 2]);
        assert!(matches!(
            layernorm_fwd(&[0.0; 4], &[1.0; 3], &[0.0; 2], 2, 2, 1e-5, &mut y, &mut m, &mut r),
            Err(KernelError::Length { name: "weight", .. })
        ));
        assert!(rmsnorm_fwd(&[0.0; 4], &[1.0; 2], 2, 2, 1e-5, &mut y, &mut r[..1]).is_err());
        assert!(rmsnorm_fwd(&[], &[], 2, 0, 1e-5, &mut [], &mut r).is_err());
    }

    fn naive_layernorm(
        x: &[f32],
        w: &[f32],
        b: &[f32],
        rows: usize,
        dim: usize,
        eps: f64,
    ) -> Vec<f64> {
        let mut y = vec![0.0; rows * dim];
        for r in 0..rows {
            let xr: Vec<f64> = x[r * dim..(r + 1) * dim]
                .iter()
                .map(|&v| v as f64)
                .collect();
            let mu = xr.iter().sum::<f64>() / dim as f64;
            let var = xr.iter().map(|v| (v - mu) * (v - mu)).sum::<f64>() / dim as f64;
            for c in 0..dim {
                y[r * dim + c] = (xr[c] - mu) / (var + eps).sqrt() * w[c] as f64 + b[c] as f64;
            }
        }
        y
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn prop_layernorm_finite_and_matches_f64(
            rows in 1usize..6, dim in 1usize..70, seed in any::<u64>(), shift in -100.0f32..100.0,
        ) {
            let mut rng = Rng::new(seed);
            let x: Vec<f32> = rng.vec(rows * dim).iter().map(|v| v * 3.0 + shift).collect();
            let w = rng.vec(dim);
            let b = rng.vec(dim);
            let mut y = vec![0.0; rows * dim];
            let (mut m, mut r) = (vec![0.0; rows], vec![0.0; rows]);
            layernorm_fwd(&x, &w, &b, rows, dim, 1e-5, &mut y, &mut m, &mut r).unwrap();
            let yr = naive_layernorm(&x, &w, &b, rows, dim, 1e-5);
            for (a, e) in y.iter().zip(&yr) {
                prop_assert!(a.is_finite());
                prop_assert!((*a as f64 - e).abs() <= 2e-3 * (1.0 + e.abs()), "{} vs {}", a, e);
            }
        }
    }
}
